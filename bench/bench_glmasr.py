"""GLM-ASR-Nano-2512 training throughput on one GPU: ddptrain vs the HF Trainer, side by side.

Workload ``glmasr``: ``GlmAsrForConditionalGeneration`` random-initialised from the published
config (transformers' ``GlmAsrConfig`` defaults, 2.14B unique parameters), synthetic speech:
lognormal durations (median 7 s, sigma 0.5, clipped 1-30 s), ~3 transcript tokens per second
(+ EOS), a 20-token prompt around the audio placeholders, the loss on the transcript + EOS only,
Whisper 128-bin log-mel computed in 6 loader workers; batch 16 utterances, one 30 s window each
(``glmasr_win30``) or the encoder windows cut to the batch (``glmasr_cut``). Nothing is
downloaded.

Peers (one subprocess each, so memory peaks and compile caches do not leak between them, and a
peer that does not finish in ``--timeout`` seconds is recorded as such):

* ``hf``: transformers.Trainer, bf16, the model's own forward with ``labels`` (-100 off the
  transcript), random batches of 16 (its default sampler), fused AdamW, clip 1.0.
* ``hf_compile``: the same with ``torch_compile=True``.
* ``hf_grouped``, ``hf_compile_grouped``: the same with the HF Trainer's
  ``train_sampling_strategy="group_by_length"`` (its ``LengthGroupedSampler``: megabatches of
  50 batches sorted by length), on precomputed lengths (audio seconds) as a ``datasets`` length
  column would give them: the HF Trainer's own bucketing, so its decoder is padded less.
* ``hf_ds2``: the same under DeepSpeed ZeRO-2 (a config without an ``optimizer`` block, so the
  HF Trainer's torch AdamW is used and no DeepSpeed op is compiled).
* ``hf_ds2_offload``: ZeRO-2 with ``offload_optimizer: cpu`` (DeepSpeedCPUAdam) and gradient
  checkpointing: what users run on 24 GB cards.
* ``bare``: a plain loop over the same HF forward and batches: autocast bf16, fused AdamW, clip 1.0,
  ``loss.item()`` every 10 steps.
* ``ddptrain``: examples/finetune_glmasr.py's model and data under ddptrain.Trainer with
  ``trainer.precision=bf16`` and nothing else (fp32 weights, eager).
* ``ddptrain_bf16``: + bf16 weights with fp32 masters (``trainer.param_dtype=bf16``);
  ``ddptrain_bf16_compile``: + the encoder/decoder layers compiled (``compile.module_classes``,
  static shapes until one changes), configs/glmasr.yaml's set-up; ``..._cut``: encoder windows cut
  to the batch (``glmasr.encoder_length=batch``; the compiled one over a single bucket so every
  batch holds 16); ``ddptrain_best``: bf16 + compiled with ``compile.dynamic=true`` from the
  start; ``..._cg`` (``ddptrain_bf16_compile_cg``, ``..._cut_cg``): + ``compile.cuda_graphs=true``,
  one CUDA graph per batch shape; more variants by ``--ov NAME=k=v,k=v`` (values without commas).
* ``ddptrain_offload``: bf16 weights, layers compiled and recomputed, ``optim.offload=cpu`` (the
  masters and AdamW on the host); ``ddptrain_offload_eager`` without the compile.
* ``--gpu-memory-gb G``: every peer capped at G GiB (ddptrain's ``trainer.gpu_memory_gb``, the
  same allocator fraction for the others); the rows carry ``gpu_memory_gb``.
* ``data``: the loader alone, batches per second (is a peer data-bound?).
* any peer + ``_flash`` (e.g. ``hf_flash``, ``ddptrain_bf16_compile_flash``): its forwards inside
  ``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``. Under ddptrain's compiled layers this
  does not take (call s8a: cuDNN's kernels still ran).
* ``--ov`` keys ``bench.cudagraphs=A+B`` (modules of these classes compiled whole with CUDA
  graphs), ``bench.cg_encoder=true`` (= ``GlmAsrEncoder``) and ``bench.compile_mode=M`` (the
  regional compile of ``compile.module_classes`` in mode M, e.g. ``reduce-overhead``: CUDA
  graphs per layer) and ``bench.inductor.NAME=VALUE`` (an Inductor setting, e.g.
  ``cpp_wrapper=True``: kernels launched from C++ rather than Python): experiments, not ddptrain
  options.

``--profile`` adds, for ddptrain peers, a profile of ``--profile-steps`` (3) steps over the last
timed batches after the timed ones (``bench/profiling.py``: kernel time by category, GPU idle
share, host time per step, the floor: kernel time at zero host time, MFU there); ``--gaps``
what the host did in the longest GPU idle gaps. Results of 2026-12-01 (one H200, three calls;
the ``call`` field): ``bench/results/h200x1_2026-12-01_glmasr.jsonl``.

Timing: 8 warm-up steps, then 16 timed steps (``--warmup`` / ``--steps``), host clock around a
device sync. MFU = FLOPs of the padded batches as that peer computes them / (time x 989.4e12,
the dense bf16 peak of one H100/H200 SXM). Per batch of B utterances in R chunk rows of T mel
frames and a decoder padded to L positions: encoder ``6 * P_enc_layers * R * T/2 + 12 * n_enc *
d_enc * R * (T/2)^2`` + convs (conv1 2x forward: its input needs no gradient; conv2 3x) +
projector ``6 * P_proj * N``; decoder ``6 * P_dec_layers * B * L + 6 * n_dec * d_dec * B *
L^2`` (causal: half of the full attention's 12); LM head ``6 * vocab * d_dec * K``, with K = B * L
for the HF forward (logits everywhere) and K = target tokens for ddptrain's, and N = R * T/8 for
the HF forward (the projector on every frame) and N = the audio placeholders for ddptrain's.
Recomputation is not counted. The formulas: ``GlmAsrFlops`` in examples/models/train_flops.py.

    python bench/bench_glmasr.py --out bench/results/h200x1_2026-12-01_glmasr.jsonl \\
        --peers hf,hf_ds2,bare,ddptrain,ddptrain_best,ddptrain_best_cut
    python bench/bench_glmasr.py --preset tiny --warmup 1 --steps 2 --peers ...   # CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import finetune_glmasr as fg  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain.data import SyntheticCorpus  # noqa: E402
from flops import PEAK_BF16  # noqa: E402
from measure import (graph_counts, TimedSteps, append_row, cap_gpu_memory, device, mem_reset, named_peers, peak_gb,  # noqa: E402
                     peer_row, sync)
from models.train_flops import GlmAsrFlops  # noqa: E402
from profiling import diagnose  # noqa: E402
from profiling import summary as profile_summary  # noqa: E402

SR = 16000
OVERRIDES = {
    "ddptrain": [],
    "ddptrain_best": ["trainer.param_dtype=bf16", "compile.enabled=true", "compile.dynamic=true",
                      "compile.module_classes=[GlmAsrEncoderLayer,LlamaDecoderLayer]"],
}
CUT_ONE_BUCKET = ["glmasr.encoder_length=batch", "data.num_buckets=1", "data.bucket_sort_pool=32"]
BF16, COMPILE = ["trainer.param_dtype=bf16"], ["compile.enabled=true", "compile.module_classes=[GlmAsrEncoderLayer,LlamaDecoderLayer]"]
OVERRIDES.update({
    "ddptrain_bf16": BF16,  # bf16 weights + fp32 masters, eager
    "ddptrain_bf16_compile": BF16 + COMPILE,  # ... + the layers compiled, static shapes until one changes
    "ddptrain_bf16_compile_enc": BF16 + ["compile.enabled=true", "compile.module_classes=[GlmAsrEncoderLayer]"],
    "ddptrain_bf16_cut": BF16 + ["glmasr.encoder_length=batch"],
    # cut windows: one bucket sorted in pools of 32 batches, so every batch holds 16 utterances
    # (20 buckets leave short last batches, each a new shape for the compiled layers)
    "ddptrain_bf16_compile_cut": BF16 + COMPILE + CUT_ONE_BUCKET,
    "ddptrain_bf16_compile_cut_dyn": BF16 + COMPILE + CUT_ONE_BUCKET + ["compile.dynamic=true"],
})
OVERRIDES["ddptrain_bf16_compile_cut_cg"] = OVERRIDES["ddptrain_bf16_compile_cut"] + ["compile.cuda_graphs=true"]
OVERRIDES["ddptrain_bf16_compile_cg"] = OVERRIDES["ddptrain_bf16_compile"] + ["compile.cuda_graphs=true"]  # 30 s windows
OVERRIDES["ddptrain_cut"] = ["glmasr.encoder_length=batch"]
OVERRIDES["ddptrain_best_cut"] = OVERRIDES["ddptrain_best"] + ["glmasr.encoder_length=batch"]
OVERRIDES["ddptrain_best_recompute"] = OVERRIDES["ddptrain_best"] + [
    "recompute.enabled=true", "recompute.module_classes=[GlmAsrEncoderLayer,LlamaDecoderLayer]"]
# on a small card: bf16 weights, fp32 masters and AdamW on the host, every layer recomputed
RECOMPUTE = ["recompute.enabled=true", "recompute.module_classes=[GlmAsrEncoderLayer,LlamaDecoderLayer]"]
OVERRIDES["ddptrain_offload"] = BF16 + COMPILE + RECOMPUTE + ["optim.offload=cpu"]
OVERRIDES["ddptrain_offload_eager"] = BF16 + RECOMPUTE + ["optim.offload=cpu"]
HF_PEERS = ("hf", "hf_compile", "hf_ds2", "hf_ds2_offload", "hf_grouped", "hf_compile_grouped", "bare")


# ------------------------------------------------------------------------------------ FLOPs


class StatsCollate:
    """Wraps a GlmAsrCollator: adds ``stats`` (samples, audio seconds, FLOPs) to every batch and,
    for the HF peers, turns the batch into the HF forward's keyword arguments."""

    def __init__(self, inner, flops: GlmAsrFlops, hf: bool):
        self.inner, self.flops, self.hf = inner, flops, hf

    def __call__(self, examples):
        b = self.inner(examples)
        ids = b["input_ids"]
        bsz, length = ids.shape
        feats = b["features"]
        # the HF forward computes logits everywhere and projects every frame; ours only the real ones
        flops = self.flops(feats.shape[0], feats.shape[1], bsz, length, bsz * length,
                           feats.shape[0] * (feats.shape[1] // 8)) if self.hf else self.flops.of_batch(b)
        stats = {"n": bsz, "audio_s": float(sum(e["audio"].numel() for e in examples)) / SR,
                 "rows": feats.shape[0], "frames": feats.shape[1], "length": length, "flops": flops}
        if not self.hf:
            b["stats"] = stats
            return b
        labels = torch.full_like(ids, -100).flatten()
        real = b["labels"] >= 0  # not a padded target (glmasr.pad_indices)
        labels[b["pred_index"][real] + 1] = b["labels"][real]
        ends = (b["pred_index"][real] // length).bincount(minlength=bsz) + b["prompt_lens"]
        attn = (torch.arange(length)[None, :] < ends[:, None]).long()
        mask = (torch.arange(feats.shape[1])[None, :] < b["chunk_frames"][:, None]).long()
        return {"input_ids": ids, "attention_mask": attn, "labels": labels.view(bsz, length),
                "input_features": feats.transpose(1, 2).contiguous(), "input_features_mask": mask, "stats": stats}


# ------------------------------------------------------------------------------------ set-up


# the HF and bare peers pad the decoder to multiples of 8, close to a collator padding to the
# longest utterance; ddptrain's peers take configs/glmasr.yaml's coarser steps
HF_PADDING = ["glmasr.token_pad_multiple=8"]


def recipe_cfg(args, peer_overrides=()):
    ov = ["trainer.precision=bf16", "trainer.clip_grad_norm=1.0", f"trainer.max_steps={args.warmup + args.steps + 1}",
          f"trainer.output_dir={args.tmp}/{args.peer}", "checkpoint.save_at_end=false", "logging.tensorboard=false",
          "logging.progress_bar=false", f"logging.log_every={args.warmup}", "optim.lr=1e-5", "optim.betas=[0.9,0.999]",
          f"glmasr.preset={args.preset}", f"data.num_workers={args.workers}", f"data.max_batch_size={args.batch}",
          f"data.max_duration={args.batch * 30}", "data.num_buckets=20", "scheduler.name=constant", *peer_overrides]
    return ddptrain.load_config(os.path.join(HERE, "..", "configs", "glmasr.yaml"), [
        "compile.enabled=false", "recompute.enabled=false", "trainer.param_dtype=fp32", *ov], schema=fg.RecipeConfig)


def corpus(args) -> SyntheticCorpus:
    """The recipe's synthetic corpus at 20 buckets x 13 batches: with 30 s windows every batch
    holds ``--batch`` utterances, so compiled layers see one new shape only (the decoder length),
    within the warm-up."""
    return dataclasses.replace(fg.SYNTHETIC, utterances=20 * 13 * args.batch)


def hf_model_and_data(args, cfg):
    """The HF model and a loader of random batches over the same synthetic corpus as ddptrain's."""
    from models.glmasr import load_hf_model

    torch.manual_seed(0)
    with torch.device(device()):
        model = load_hf_model("", "published" if args.preset == "published" else "tiny",
                              tiny_tokens=tiny_tokens() if args.preset == "tiny" else None)
    layout = fg.synthetic_layout(model.config)
    dataset = fg.synthetic_speech(corpus(args), cfg.data.seed, layout, model.config.text_config.vocab_size)
    collate, _ = fg.make_collator(cfg, layout, model.config.text_config.max_position_embeddings, True)
    return model, dataset, StatsCollate(collate, GlmAsrFlops(model), hf=True)


def tiny_tokens() -> dict:
    return {"vocab_size": 512, "audio_token_id": 500, "eos_token_id": 2}


# ------------------------------------------------------------------------------------ peers


def run_ddptrain(args) -> dict:
    ov = OVERRIDES[args.base] + list(args.ov)
    # bench.cudagraphs=A+B: modules of these classes compiled whole with CUDA graphs (mode
    # reduce-overhead, a graph per input shape); bench.cg_encoder=true: the audio encoder
    cg = [o.split("=", 1)[1].split("+") for o in ov if o.startswith("bench.cudagraphs=")]
    cg = (cg[0] if cg else []) + (["GlmAsrEncoder"] if "bench.cg_encoder=true" in ov else [])
    cap = [f"trainer.gpu_memory_gb={args.gpu_memory_gb}"] if args.gpu_memory_gb else []
    cfg = recipe_cfg(args, [o for o in ov if not o.startswith("bench.")] + cap)
    for o in ov:  # bench.compile_mode=M: the regional compile in a mode the config refuses (reduce-overhead)
        if o.startswith("bench.compile_mode="):
            cfg.compile.mode = o.split("=", 1)[1]
        if o.startswith("bench.inductor."):  # bench.inductor.NAME=VALUE: an Inductor setting, e.g. cpp_wrapper=True
            import ast

            import torch._inductor.config as inductor_config
            name, value = o[len("bench.inductor."):].split("=", 1)
            if not hasattr(inductor_config, name):
                raise ValueError(f"{o}: torch._inductor.config has no setting {name!r}")
            setattr(inductor_config, name, ast.literal_eval(value))
    info = ddptrain.setup_distributed(cfg)
    tiny = tiny_tokens() if args.preset == "tiny" else None
    from models.glmasr import GlmAsrForTraining, load_hf_model

    torch.manual_seed(0)
    with torch.device(info.device):
        hf = load_hf_model("", args.preset, cfg.glmasr.attn_implementation, tiny)
    model = GlmAsrForTraining(hf, cfg.glmasr.freeze_encoder)
    for module in (m for m in model.modules() if type(m).__name__ in cg):
        module.forward = torch.compile(module.forward, mode="reduce-overhead")
    layout = fg.synthetic_layout(hf.config)
    flops = GlmAsrFlops(hf)
    loader = fg.build_synthetic_loader(cfg, layout, hf.config.text_config.vocab_size, 1, 0,
                                       hf.config.text_config.max_position_embeddings,
                                       collate_wrapper=lambda c: StatsCollate(c, flops, hf=False), corpus=corpus(args))
    objective = fg.GlmAsrObjective(layout, None, loader.feature_extractor)
    counters = torch._dynamo.utils.counters["stats"]

    def loss(m, batch):
        with attention_scope(args):
            return objective(m, batch)

    def stats(batch):  # + the graphs compiled so far: was a slow step one that compiled?
        return dict(batch.pop("stats"), graphs=counters["unique_graphs"])

    # timed at the step, and the stats out of the batch: compile.cuda_graphs replays skip loss_fn
    timed = TimedSteps(stats, keep=args.profile_steps + 1 if args.profile or args.gaps else 0)
    mem_reset()
    trainer = ddptrain.Trainer(model, loss, cfg, loader)
    timed.attach(trainer)
    trainer.fit()
    sync()
    w, n = args.warmup, args.steps
    elapsed, stats, _ = timed.window(w, n)
    logged = [json.loads(x) for x in open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl"))]
    waits = [r["data_wait_frac"] for r in logged if r.get("split") == "train" and w < r["step"] <= w + n]
    extra = {"compiled_modules": len(trainer.compiled), "recomputed_modules": len(trainer.recomputed),
             "ov": ov, "data_wait_frac": waits,
             "losses": [r["loss"] for r in logged if r.get("split") == "train"],  # graphs vs eager, log by log
             "data_batch_size_mean": loader.batch_sampler.epoch_stats()["batch_size_mean"],
             **step_record(timed.calls, w, n), **graph_counts(trainer)}
    extra.update(diagnose({"profile": args.profile, "gaps": args.gaps, "profile_steps": args.profile_steps},
                          lambda b: trainer.train_step([b]), itertools.cycle(list(timed.recent))))
    if "profile" in extra:
        print("PROFILE", args.peer, json.dumps(profile_summary(extra["profile"])), flush=True)
    return summarize(args, elapsed, stats, extra)


def step_record(calls: list, w: int, n: int) -> dict:
    """Per timed step: host ms, shape (rows x frames, decoder length), whether the run saw that
    shape for the first time, and dynamo graphs compiled in it (is a slow step a new shape?)."""
    seen, out = set(), {"step_ms": [], "step_shape": [], "step_new_shape": [], "step_new_graphs": []}
    for i in range(w + n):
        t, s = calls[i]
        shape = f"{s['rows']}x{s['frames']},{s['length']}"
        if i >= w:
            out["step_ms"].append(round(1e3 * (calls[i + 1][0] - t), 1))
            out["step_shape"].append(shape)
            out["step_new_shape"].append(shape not in seen)
            out["step_new_graphs"].append(calls[i + 1][1]["graphs"] - s["graphs"])
        seen.add(shape)
    if torch.cuda.is_available():
        out["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return out


def run_bare(args) -> dict:
    cfg = recipe_cfg(args, HF_PADDING)
    model, dataset, collate = hf_model_and_data(args, cfg)
    dev = device()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.01,
                            fused=dev.type == "cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, collate_fn=collate,
                                         num_workers=args.workers, pin_memory=dev.type == "cuda", drop_last=True,
                                         generator=torch.Generator().manual_seed(0),
                                         prefetch_factor=4 if args.workers else None)
    mem_reset()
    model.train()
    stats, t0 = [], None
    it = iter(loader)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sync()
            t0 = time.perf_counter()
        batch = next(it)
        s = batch.pop("stats")
        if i >= args.warmup:
            stats.append(s)
        batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            with attention_scope(args):
                loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 10 == 0:
            loss.item()
    sync()
    return summarize(args, time.perf_counter() - t0, stats, {})


def run_hf(args) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg = recipe_cfg(args, HF_PADDING)
    model, dataset, collate = hf_model_and_data(args, cfg)
    w, n = args.warmup, args.steps
    record = {"stats": [], "t": {}}

    class BenchTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            if self.args.train_sampling_strategy != "group_by_length":
                return super()._get_train_sampler(train_dataset)
            from transformers.trainer_pt_utils import LengthGroupedSampler

            # what the HF Trainer builds from a datasets.Dataset's length column (it would
            # otherwise compute every item's features once to measure it)
            return LengthGroupedSampler(self.args.train_batch_size, lengths=[int(1000 * d) for d in dataset.durations])

        def training_step(self, model, inputs, num_items_in_batch=None):
            s = inputs.pop("stats")
            if w <= self.state.global_step < w + n:
                record["stats"].append(s)
            with attention_scope(args):  # the forward and backward are both inside training_step
                return super().training_step(model, inputs, num_items_in_batch)

    start = time.perf_counter()

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if state.global_step in (w, w + n):
                sync()
                record["t"][state.global_step] = time.perf_counter()
            if state.global_step <= 3 or state.global_step % 10 == 0:  # how far a peer that times out got
                print(f"[{args.peer}] step {state.global_step} at {time.perf_counter() - start:.1f} s",
                      file=sys.stderr, flush=True)

    extra_args = {}
    if args.base.startswith("hf_compile"):
        extra_args["torch_compile"] = True
    if args.base.endswith("_grouped"):
        extra_args["train_sampling_strategy"] = "group_by_length"
    if args.base == "hf_ds2":
        extra_args["deepspeed"] = {  # no "optimizer" block: the HF Trainer's torch AdamW, no DeepSpeed ops
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
            "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    if args.base == "hf_ds2_offload":
        # what users run on 24 GB cards: ZeRO-2, the optimizer on the CPU (DeepSpeedCPUAdam, built
        # by DeepSpeed's JIT at the first run), gradient checkpointing
        extra_args["gradient_checkpointing"] = True
        extra_args["deepspeed"] = {
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    targs = TrainingArguments(
        output_dir=f"{args.tmp}/{args.peer}", per_device_train_batch_size=args.batch, bf16=torch.cuda.is_available(),
        max_steps=w + n, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0, logging_steps=100000,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=args.workers,
        dataloader_pin_memory=torch.cuda.is_available(), dataloader_prefetch_factor=4 if args.workers else None,
        remove_unused_columns=False, seed=0, use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True,
        **extra_args)
    mem_reset()
    trainer = BenchTrainer(model=model, args=targs, train_dataset=dataset, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    sync()
    return summarize(args, record["t"][w + n] - record["t"][w], record["stats"], {})


# ------------------------------------------------------------------------------------ results


def summarize(args, elapsed: float, stats: list, extra: dict) -> dict:
    tot = {k: sum(float(s[k]) for s in stats) for k in ("n", "audio_s", "flops")}
    tflops = tot["flops"] / elapsed / 1e12
    cut = "cut" in args.peer or any("encoder_length=batch" in o for o in args.ov)
    return {
        "workload": "glmasr_cut" if cut else "glmasr_win30", "peer": args.peer, "world_size": 1,
        "batch": args.batch, "preset": args.preset, "steps": len(stats), "warmup": args.warmup,
        "elapsed_s": round(elapsed, 3), "samples_per_s": tot["n"] / elapsed, "audio_s_per_s": tot["audio_s"] / elapsed,
        "samples_per_step": tot["n"] / max(len(stats), 1),
        "mean_frames": sum(s["frames"] for s in stats) / max(len(stats), 1),
        "mean_decoder_length": sum(s["length"] for s in stats) / max(len(stats), 1),
        "tflops": tflops, "mfu": tflops * 1e12 / PEAK_BF16,
        "peak_alloc_gb": peak_gb(), "peak_reserved_gb": peak_gb(reserved=True),
        "gpu_memory_gb": args.gpu_memory_gb or None,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__, **extra,
    }


def run_data(args) -> dict:
    """The loader alone (no model work): batches per second its workers deliver."""
    cfg = recipe_cfg(args, HF_PADDING)
    from models.glmasr import published_config, tiny_config

    mc = published_config() if args.preset == "published" else tiny_config(**tiny_tokens())
    loader = fg.build_synthetic_loader(cfg, fg.synthetic_layout(mc), mc.text_config.vocab_size, 1, 0, corpus=corpus(args))
    it = iter(loader)
    for _ in range(args.warmup):
        next(it)
    t0 = time.perf_counter()
    n = sum(len(next(it)["ids"]) for _ in range(args.steps))
    dt = time.perf_counter() - t0
    return {"workload": "glmasr_win30", "peer": "data", "world_size": 1, "batch": args.batch,
            "batches_per_s": args.steps / dt, "samples_per_s": n / dt, "workers": args.workers}


PEERS = {**{name: run_hf for name in HF_PEERS if name != "bare"}, "bare": run_bare, "data": run_data}


FLASH = "_flash"  # suffix: the same peer with attention limited to PyTorch's flash / efficient kernels


def base_peer(peer: str) -> str:
    """A peer's set-up without the ``_flash`` suffix. (Rows of 2026-12-01 call s7 named
    ``*_nocudnn`` called ``torch.backends.cuda.enable_cudnn_sdp(False)``, which did not take:
    their profiles still show cuDNN's attention kernels. They are repeats of the peer without
    the suffix; ``_flash`` uses the ``sdpa_kernel`` context around every forward instead.)"""
    return peer[:-len(FLASH)] if peer.endswith(FLASH) else peer


def attention_scope(args):
    """The context every forward of this peer runs in: with ``_flash``, no cuDNN attention (it
    builds a plan per new shape on the host); the backward follows the forward's kernel."""
    if args.base == args.peer:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def run_one(args) -> dict:
    args.base = base_peer(args.peer)
    if args.base in PEERS:
        return PEERS[args.base](args)
    if args.base in OVERRIDES or args.base.startswith("ddptrain"):
        OVERRIDES.setdefault(args.base, [])
        return run_ddptrain(args)
    raise ValueError(f"unknown peer {args.peer!r} (known: {sorted(PEERS) + sorted(OVERRIDES)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="hf,hf_ds2,bare,ddptrain,ddptrain_best,ddptrain_best_cut")
    p.add_argument("--out", default="")
    p.add_argument("--preset", default="published", choices=("published", "tiny"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per peer (its start and compile included)")
    p.add_argument("--hf-compile-timeout", type=float, default=200.0, help="seconds for hf_compile (whole-model compile)")
    p.add_argument("--ov", action="append", default=[], help="NAME=k=v,k=[a,b]: a ddptrain peer with these overrides")
    p.add_argument("--profile", action="store_true",
                   help="ddptrain peers: then profile a few steps (bench/profiling.py: kernel time, idle, host, floor)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps --profile profiles (after one more unprofiled)")
    p.add_argument("--gaps", action="store_true", help="ddptrain peers: what the host did in the longest GPU idle gaps")
    p.add_argument("--gpu-memory-gb", type=float, default=0.0,
                   help="cap every peer's GPU memory to this many GiB (a small card on a big GPU)")
    p.add_argument("--peer", help=argparse.SUPPRESS)  # internal: run one peer in this process
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="")
    args = p.parse_args(argv)
    if args.peer:
        args.ov = [o for o in args.ov]
        if args.gpu_memory_gb and torch.cuda.is_available() and not base_peer(args.peer).startswith("ddptrain"):
            cap_gpu_memory(args.gpu_memory_gb)  # ddptrain peers cap themselves: trainer.gpu_memory_gb
        row = run_one(args)
        with open(args.row, "w") as f:
            json.dump(row, f)
        return 0
    peers = named_peers(args.peers, args.ov, OVERRIDES)
    named = [o.split("=", 1)[0] for o in args.ov]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for peer in peers:
            row_file = os.path.join(tmp, f"{peer}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--peer", peer, "--row", row_file, "--tmp", tmp,
                   "--preset", args.preset, "--batch", str(args.batch), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--workers", str(args.workers),
                   "--gpu-memory-gb", str(args.gpu_memory_gb), "--profile-steps", str(args.profile_steps)]
            cmd += ["--profile"] * args.profile + ["--gaps"] * args.gaps
            cmd += [f"--ov={o}" for o in OVERRIDES.get(peer, []) if peer in named]
            env = dict(os.environ)
            if base_peer(peer).startswith("hf_compile"):  # a timed-out row's tail then says what recompiled
                env.setdefault("TORCH_LOGS", "recompiles")
            if base_peer(peer).startswith("hf_ds2"):  # DeepSpeed wants a process group: one rank of torchrun's env
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            tic = time.time()
            limit = args.hf_compile_timeout if base_peer(peer).startswith("hf_compile") else args.timeout
            ok, row = peer_row(cmd, row_file, limit, env, workload="glmasr_win30", peer=peer, world_size=1,
                               batch=args.batch, gpu_memory_gb=args.gpu_memory_gb or None)
            row["wall_s"] = round(time.time() - tic, 1)
            failed += not ok
            line = json.dumps(row)
            print(line if ok else line[:2000], flush=True)
            append_row(args.out, row)
    print(f"{'peer':<26}{'workload':<14}{'samples/s':>10}{'audio s/s':>11}{'peak GB':>9}{'MFU':>7}")
    if args.out:
        rows = [json.loads(x) for x in open(args.out)][-len(peers):]
        for r in rows:
            if "mfu" not in r:
                print(f"{r['peer']:<26}{r['workload']:<14}{r.get('samples_per_s', 0):>10.1f}  {r.get('error', '')[:60]}")
            elif "error" in r:
                print(f"{r['peer']:<26}{r['workload']:<14}  error: {r['error'][:60]}")
            else:
                print(f"{r['peer']:<26}{r['workload']:<14}{r['samples_per_s']:>10.1f}{r['audio_s_per_s']:>11.0f}"
                      f"{(r['peak_alloc_gb'] or 0):>9.1f}{r['mfu']:>7.1%}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
