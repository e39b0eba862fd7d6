"""GLM-4.1V-9B (the architecture of AutoGLM-Phone-9B) fine-tuning: ddptrain against HF Trainer + peft.

Jobs (each one process, or torchrun for several GPUs; rows appended to ``--out``):

* ``lora_ddptrain``: ``Glm4vForConditionalGeneration`` at the real shapes (10.29B parameters:
  a 40-layer 4096-d GLM decoder with 32 query / 2 KV heads and a 151,552-token vocabulary, a
  24-layer 1536-d vision tower), random init, built directly in bf16 on the GPU. LoRA r=16 on
  the decoder's attention and MLP projections (``q/k/v/o_proj``, ``gate_up_proj``,
  ``down_proj``), everything else frozen in bf16 (``trainer.param_dtype: bf16``), recompute on
  every decoder layer, the loss at the supervised positions only (``ddptrain.causal_lm_loss``).
  One sequence of 8192 tokens per step, with an image of 56 x 56 patches (784 merged vision
  tokens, a 784 x 784 px image) fed through the vision tower, synthetic (``pixel_values``,
  ``image_grid_thw``, ``mm_token_type_ids``).
* ``lora_ddptrain_compiled``: ``lora_ddptrain`` with the decoder layer class compiled (regional,
  ``compile.module_classes: [Glm4vTextDecoderLayer]``, inside its recompute region): inductor
  fuses the eager step's casts, copies and elementwise kernels. Its correctness check: a plan that
  runs both jobs compares their per-step losses and gradient norms (every ddptrain row records
  ``losses`` and ``grad_norms`` of all its steps, warm-up included) and appends a
  ``compiled_vs_eager`` row; beyond ``CHECK_RTOL`` the plan exits 1.
* ``lora_hf_peft``: the same model, batch, LoRA targets and rank through ``transformers.Trainer``
  + ``peft`` (bf16, gradient checkpointing, fused AdamW, the model's own loss over full logits).
  Both peers adapt the same 240 decoder layers (never the vision tower, whose attention is
  ``attn.qkv`` / ``attn.proj``): each job checks its targets select the layers the other's do
  (:func:`lora_layers`) and that it trains their ``r (in + out)`` adapter parameters (47.6M), and
  its row records ``num_trainable``, counted before DeepSpeed ZeRO-3 partitions the parameters
  (after it, ``numel()`` is 0 for all but those under its persistence threshold: 21.3M).
* ``full3b_ddptrain``: a full fine-tune of a ~3.2B GLM-shaped text decoder (24 layers, 3072-d,
  8192 FFN, the same vocabulary) on one GPU through the masters path (bf16 weights, fp32 masters).
* ``full9b_zero`` / ``full9b_zero2``: the 10B full fine-tune on 4 / 2 GPUs (ZeRO with sharded
  masters, recompute), issue 22; the plans ``glmasr2`` and ``large4`` of bench/gpu_session.py run
  them. On a 24 GB card (``--gpu-memory-gb 23``: every job capped): ``lora_ddptrain_streamed``
  (``lora.base_offload=cpu``: the frozen decoder layers in pinned host memory, streamed one
  layer ahead) and ``lora_hf_peft_ds3_offload`` (HF + peft under DeepSpeed ZeRO-3 with parameters
  and optimizer offloaded to the CPU), each also at 4k tokens (``..._4k``). ``estimate`` prints the estimator's per-GPU model state at 1-8 GPUs against the card.

Every row: tokens/s, step time, MFU (analytic FLOPs below, recompute not counted), peak GPU
memory (of every GPU: ``peak_alloc_gib_per_gpu``), and the model-state estimate of
``ddptrain.memory`` beside the measured allocation. ``--profile [N]`` (ddptrain jobs): then N (3)
steps under torch.profiler (``bench/profiling.py``: kernel time by category, GPU idle share,
host time per step, the floor at zero host time and MFU there) in the row's ``profile``.
Workload names contain "glm4v"/"9b" as BENCHMARKS.md expects.

    python3 bench/bench_9b.py plan --out "$OUT/glm4v_9b.jsonl"            # the one-H200 plan (~7 min)
    python3 bench/bench_9b.py plan --dry --out /tmp/b9.jsonl              # every job, tiny, on CPU
    python3 bench/bench_9b.py job lora_ddptrain --out r.jsonl            # one job
    python3 bench/bench_9b.py plan --jobs lora_ddptrain_compiled,lora_ddptrain --profile --out r.jsonl  # + the check
    torchrun --nproc_per_node=4 bench/bench_9b.py job full9b_zero --out r.jsonl
    python3 bench/bench_9b.py estimate                                   # CPU: does 10B fit on 2 GPUs?

FLOPs of one step (T tokens, S supervised, P decoder linear weights, attention causal):
forward ``2PT + 2 L T^2 (H hd) + 2 V d S`` (+ the vision tower's forward, frozen: ``2 P_vis N +
4 depth N^2 d_vis`` for N patches). LoRA (frozen base): forward + input gradients = 2x forward
for the linear layers and the head, 3x for attention; the adapters' own FLOPs are left out.
Full fine-tune: 3x forward (weight gradients too), 3x attention.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (ROOT, HERE) if p not in sys.path]

import ddptrain  # noqa: E402
from ddptrain.losses import causal_lm_loss  # noqa: E402
from flops import PEAK_BF16  # noqa: E402
from measure import append_row, cap_gpu_memory, gather, mem_reset, peak_gb, sync, world  # noqa: E402
from profiling import diagnose  # noqa: E402
from profiling import summary as profile_summary  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]}
TOKENS = {"image_start": 151339, "image_end": 151340, "image": 151343, "video": 151344}
LORA_TARGETS = ["*language_model.layers.*.self_attn.[qkvo]_proj", "*language_model.layers.*.mlp.*_proj"]
PEFT_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate_up|down)_proj)"
LORA_RANK, LORA_ALPHA = 16, 32

# shapes by preset: "real" (the GPU) and "tiny" (the CPU dry run, same code paths)
TEXT = {"real": dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=2),
        "real3b": dict(vocab_size=151552, hidden_size=3072, intermediate_size=8192, num_hidden_layers=24,
                       num_attention_heads=24, num_key_value_heads=2),
        "tiny": dict(vocab_size=151552 // 512, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)}
VISION = {"real": {}, "tiny": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256)}
BATCH = {"real": dict(seq=8192, grid=56), "tiny": dict(seq=64, grid=8)}

JOBS = {  # name: (what it runs, GPUs, timeout in seconds on the GPU)
    "lora_ddptrain": (dict(model="9b", peer="ddptrain", lora=True), 1, 150),
    "lora_ddptrain_compiled": (dict(model="9b", peer="ddptrain", lora=True, compile=True), 1, 300),
    "lora_hf_peft": (dict(model="9b", peer="hf_peft", lora=True), 1, 150),
    "full3b_ddptrain": (dict(model="3b", peer="ddptrain", lora=False), 1, 110),
    "full9b_zero": (dict(model="9b", peer="ddptrain", lora=False, zero=True), 4, 300),
    "full9b_zero2": (dict(model="9b", peer="ddptrain", lora=False, zero=True), 2, 300),
}
# on a 24 GB card (--gpu-memory-gb): the frozen base streamed from pinned host memory, at 8k and
# 4k tokens, against HF + peft with DeepSpeed ZeRO-3 offloading parameters and optimizer to the CPU
for _seq in (8192, 4096):
    _k = "" if _seq == 8192 else "_4k"
    JOBS[f"lora_ddptrain_streamed{_k}"] = (dict(model="9b", peer="ddptrain", lora=True, stream=True, seq=_seq), 1, 200)
    JOBS[f"lora_ddptrain{_k}"] = JOBS.get(f"lora_ddptrain{_k}", (dict(model="9b", peer="ddptrain", lora=True, seq=_seq), 1, 150))
    JOBS[f"lora_hf_peft_ds3_offload{_k}"] = (dict(model="9b", peer="hf_peft", lora=True, ds3_offload=True, seq=_seq), 1, 300)
    JOBS[f"lora_hf_peft{_k}"] = JOBS.get(f"lora_hf_peft{_k}", (dict(model="9b", peer="hf_peft", lora=True, seq=_seq), 1, 150))
PLAN_H200 = ["lora_ddptrain", "lora_hf_peft", "full3b_ddptrain"]  # one H200, ~410 s in all
# a compiled job and its eager twin: in one plan, their per-step losses and gradient norms must agree
COMPILED_VS_EAGER = {"lora_ddptrain_compiled": "lora_ddptrain"}
# relative tolerance of that agreement, by preset. GPU (bf16): inductor rounds at other points than
# the eager kernels (it keeps fused intermediates in fp32), ~2e-3 a rounding, averaged over the
# step's tokens; 1e-2 leaves room for 7 steps of drift and still catches a wrong gradient or
# a layer that ran other code. CPU dry run (aot_eager: the same ATen ops): equal to the last bits.
CHECK_RTOL = {"real": 1e-2, "tiny": 1e-5}


def glm4v_config(preset: str, with_vision: bool = True):
    from transformers import Glm4vConfig

    text = dict(TEXT["real3b" if preset == "real" and not with_vision else preset], rope_parameters=ROPE,
                max_position_embeddings=32768)
    ids = dict(image_token_id=TOKENS["image"], image_start_token_id=TOKENS["image_start"],
               image_end_token_id=TOKENS["image_end"], video_token_id=TOKENS["video"])
    v = text["vocab_size"]
    if v <= TOKENS["video"]:  # a tiny vocabulary: its last ids are the special ones
        ids = dict(image_token_id=v - 2, image_start_token_id=v - 4, image_end_token_id=v - 3, video_token_id=v - 1)
    return Glm4vConfig(text_config=text, vision_config=VISION[preset], **ids)


class TextLM(nn.Module):
    """The GLM-4.1V text decoder with its head and no vision tower (the ~3B full fine-tune)."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.glm4v.modeling_glm4v import Glm4vTextModel

        self.language_model = Glm4vTextModel(cfg.text_config)
        self.lm_head = nn.Linear(cfg.text_config.hidden_size, cfg.text_config.vocab_size, bias=False)

    def hidden(self, input_ids, **_):
        return self.language_model(input_ids=input_ids, use_cache=False).last_hidden_state


class WithLoss(nn.Module):
    """``forward(batch) -> (loss_sum, tokens)`` inside the (DDP) forward: hidden states of the
    model, then the head and cross-entropy at the supervised positions only.

    ``use_cache=False``: the decoder otherwise makes a DynamicCache (``use_cache`` defaults to True
    in training too) that every recomputed layer writes to again in backward; the cache then held
    each recomputed layer's graph and activations to the end of the backward (87.5 GiB peak on
    one H200, BENCHMARKS.md). HF's own gradient checkpointing drops the cache for this reason."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels, **vision):
        if isinstance(self.lm, TextLM):
            hidden = self.lm.hidden(input_ids)
        else:
            hidden = self.lm.model(input_ids=input_ids, use_cache=False, **vision).last_hidden_state
        return causal_lm_loss(hidden, self.lm.lm_head.weight, labels)


def build(job: dict, preset: str, dev: torch.device) -> nn.Module:
    """The model, random init, built directly in bf16 on ``dev`` (no fp32 copy anywhere)."""
    from transformers import Glm4vForConditionalGeneration

    cfg = glm4v_config(preset, with_vision=job["model"] == "9b")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            return Glm4vForConditionalGeneration(cfg) if job["model"] == "9b" else TextLM(cfg)
    finally:
        torch.set_default_dtype(old)


def lora_layers(model: nn.Module) -> list[str]:
    """The linear layers both peers adapt: ddptrain's globs (fnmatch, as ddptrain/lora.py matches)
    and peft's regex (``re.fullmatch`` of a string ``target_modules``, as peft matches it).

    Raises:
        ValueError: the two select different layers (the comparison would train different jobs).
    """
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ours = [n for n in linears if any(fnmatch.fnmatchcase(n, g) for g in LORA_TARGETS)]
    theirs = [n for n in linears if re.fullmatch(PEFT_TARGETS, n)]
    if ours != theirs:
        raise ValueError(f"LORA_TARGETS and PEFT_TARGETS select different layers: only ddptrain's "
                         f"{sorted(set(ours) - set(theirs))[:6]}, only peft's {sorted(set(theirs) - set(ours))[:6]}")
    return ours


def lora_trainable(model: nn.Module) -> int:
    """Adapter parameters of :func:`lora_layers` at ``LORA_RANK``: ``r (in + out)`` a layer (no biases)."""
    layers = dict(model.named_modules())
    return sum(LORA_RANK * (layers[n].in_features + layers[n].out_features) for n in lora_layers(model))


def check_trainable(peer: str, got: int, want: int) -> None:
    """Refuse a row whose peer trains another number of parameters than the shared targets give."""
    if got != want:
        raise RuntimeError(f"{peer} trains {got:,} parameters, the shared LoRA targets {want:,}: not the same job")


def make_batch(cfg, preset: str, dev: torch.device, vision: bool, seq: int = 0) -> dict:
    """One sequence: 16 prompt tokens, then (with ``vision``) an image block, then text; the loss
    is on the text after the image. Token ids avoid the special ids."""
    seq, grid = (seq if seq and preset == "real" else BATCH[preset]["seq"]), BATCH[preset]["grid"]
    g = torch.Generator().manual_seed(0)
    vocab = cfg.text_config.vocab_size
    ids = torch.randint(0, cfg.image_start_token_id - 1, (1, seq), generator=g)
    supervised_from = 16
    batch = {}
    if vision:
        n_img = grid * grid // 4  # 2x2 patches merge into one LLM token
        ids[0, 16] = cfg.image_start_token_id
        ids[0, 17:17 + n_img] = cfg.image_token_id
        ids[0, 17 + n_img] = cfg.image_end_token_id
        supervised_from = 18 + n_img
        v = cfg.vision_config
        batch["pixel_values"] = torch.randn(grid * grid, v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                                            generator=g).to(torch.bfloat16)
        batch["image_grid_thw"] = torch.tensor([[1, grid, grid]])
        batch["mm_token_type_ids"] = (ids == cfg.image_token_id).int()
    labels = ids.clone()
    labels[0, :supervised_from] = -100
    assert int(ids.max()) < vocab
    batch.update(input_ids=ids, labels=labels)
    return {k: v.to(dev) for k, v in batch.items()}


def step_flops(cfg, batch: dict, lora: bool, vision: bool) -> float:
    """Analytic training FLOPs of one step (see the module docstring)."""
    t = cfg.text_config
    T = batch["input_ids"].numel()
    S = int((batch["labels"][:, 1:] != -100).sum())
    hd = t.hidden_size // t.num_attention_heads
    per_layer = (t.hidden_size * hd * (t.num_attention_heads * 2 + t.num_key_value_heads * 2)
                 + 3 * t.hidden_size * t.intermediate_size)
    linear = 2.0 * per_layer * t.num_hidden_layers * T
    attn = 2.0 * t.num_hidden_layers * T * T * t.num_attention_heads * hd
    head = 2.0 * t.vocab_size * t.hidden_size * S
    total = (2.0 if lora else 3.0) * (linear + head) + 3.0 * attn
    if vision:
        v, n = cfg.vision_config, batch["pixel_values"].shape[0]
        p_vis = v.depth * (4 * v.hidden_size ** 2 + 3 * v.hidden_size * v.intermediate_size)
        total += 2.0 * p_vis * n + 4.0 * v.depth * n * n * v.hidden_size
    return total


def _row(job_name, job, preset, dev, cfg, step_s, tokens, flops, extra) -> dict:
    ws = world()[1]
    med = statistics.median(step_s)
    # every rank's peak (GiB): does one rank hold more than its share?
    per_gpu = [x for (x,) in gather([(peak_gb() or 0.0) * 1e9 / 2**30])]
    import transformers

    return {"workload": f"glm4v_{job['model']}" + ("_text" if job["model"] == "3b" else ""), "name": job_name,
            "peer": job["peer"], "world_size": ws, "preset": preset, "lora": job["lora"], "batch": 1,  # sequence per GPU
            "tokens_per_step": tokens,
            "steps": len(step_s), "step_ms_median": round(1e3 * med, 1), "step_ms_all": [round(1e3 * s, 1) for s in step_s],
            "tokens_per_s": tokens * ws / med, "tflops_per_gpu": flops / med / 1e12,
            "mfu": flops / med / PEAK_BF16, "peak_alloc_gib": round(max(per_gpu), 2),
            "peak_alloc_gib_per_gpu": [round(x, 2) for x in per_gpu],
            "peak_alloc_gb_per_gpu": [round(x * 2**30 / 1e9, 2) for x in per_gpu],
            "peak_alloc_gb": round(max(per_gpu) * 2**30 / 1e9, 2),  # the results schema's unit (1e9 bytes)
            "samples_per_s": ws / med, "audio_s_per_s": None,  # one sequence per GPU and step
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "date": datetime.date.today().isoformat(),
            "gpu_memory_gb": GPU_MEMORY_GB or None, **extra}


def run_ddptrain(job_name: str, job: dict, preset: str, warmup: int, steps: int, tmp: str, profile: int = 0) -> dict:
    from ddptrain.memory import estimate_model_state

    ov = [f"trainer.output_dir={tmp}/{job_name}", "trainer.precision=bf16", "trainer.param_dtype=bf16",
          "trainer.clip_grad_norm=1.0", f"trainer.max_steps={warmup + steps}", "checkpoint.save_at_end=false",
          "logging.tensorboard=false", "logging.progress_bar=false", "logging.log_every=100000", "optim.lr=1e-4",
          "recompute.enabled=true", "recompute.module_classes=[Glm4vTextDecoderLayer]", "checkpoint.start_over=true"]
    if job["lora"]:
        ov += ["lora.enabled=true", f"lora.targets={json.dumps(LORA_TARGETS)}", f"lora.rank={LORA_RANK}",
               f"lora.alpha={LORA_ALPHA}"]
    if job.get("zero"):
        ov.append("optim.zero=true")
    if job.get("compile"):  # the decoder layers' one compiled forward, inside their recompute regions
        ov += ["compile.enabled=true", "compile.module_classes=[Glm4vTextDecoderLayer]"]
        ov += ["compile.backend=aot_eager"] if preset == "tiny" else []  # CPU: traced, no code generation
    if job.get("stream"):  # the frozen decoder layers live in pinned host memory, streamed one ahead
        ov += ["lora.base_offload=cpu"]  # the blocks: the children of the largest ModuleList (the decoder layers)
    if GPU_MEMORY_GB:
        ov.append(f"trainer.gpu_memory_gb={GPU_MEMORY_GB}")
    cfg = ddptrain.load_config(None, ov)
    info = ddptrain.setup_distributed(cfg)
    dev = info.device
    base = build(job, preset, dev)
    want = lora_trainable(base) if job["lora"] else None  # the peft peer's count: the same layers
    model = WithLoss(base)
    mcfg = glm4v_config(preset, with_vision=job["model"] == "9b")
    batch = make_batch(mcfg, preset, dev, vision=job["model"] == "9b", seq=job.get("seq", 0))
    mem_reset()
    trainer = ddptrain.Trainer(model, lambda m, b: m(**b), cfg, [batch] * (warmup + steps))
    if want is not None:
        check_trainable("ddptrain", sum(p.numel() for p in trainer.module.parameters() if p.requires_grad), want)
    times, losses, grad_norms = [], [], []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        out = trainer.train_step([batch])
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(out["loss_sum"] / max(out["units"], 1))  # host floats already: the step read them
        grad_norms.append(out["grad_norm"])
    at_rest = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0  # grads freed after the step
    flops = step_flops(mcfg, batch, job["lora"], job["model"] == "9b")
    # --profile: `profile` more steps under torch.profiler after one unprofiled (bench/profiling.py)
    diag = diagnose({"profile": bool(profile), "profile_steps": profile}, lambda b: trainer.train_step([b]),
                    itertools.repeat(batch), flops_of=lambda b: flops)
    if "profile" in diag and world()[0] == 0:
        print("PROFILE", job_name, json.dumps(profile_summary(diag["profile"])), flush=True)
    est = estimate_model_state(trainer.module, cfg, info.world_size)
    extra = {"loss_per_token": out["loss_sum"] / max(out["units"], 1), "num_params": est["num_params"],
             "num_trainable": est["num_trainable"], "model_state_at_rest_gib": round(at_rest, 2),
             "estimate_at_rest_gib": round((est["params"] + est["masters"] + est["optimizer"]) / 2**30, 2),
             "estimate_total_gib": round((est["total"] + est["master_grads"]) / 2**30, 2),
             "adapted_layers": len(trainer.adapted), "recomputed": len(trainer.recomputed),
             "compiled": len(trainer.compiled), "compile_eager_fallbacks": trainer.prepared.fallbacks.count,
             "losses": losses, "grad_norms": grad_norms, **diag}
    trainer.close()
    return _row(job_name, job, preset, dev, mcfg, times[warmup:], batch["input_ids"].numel(), flops, extra)


def run_hf_peft(job_name: str, job: dict, preset: str, warmup: int, steps: int, tmp: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cap_gpu_memory(GPU_MEMORY_GB)
    from peft.tuners.lora import LoraLayer

    mcfg = glm4v_config(preset)
    base = build(job, preset, dev)
    want = lora_trainable(base)
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                            target_modules=PEFT_TARGETS))
    # counted now: DeepSpeed ZeRO-3 empties partitioned parameters (numel() 0) when training starts
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    check_trainable("peft", trainable, want)
    adapted = sum(isinstance(m, LoraLayer) for m in model.modules())
    batch = make_batch(mcfg, preset, torch.device("cpu"), vision=True, seq=job.get("seq", 0))
    times, marks = [], {}
    extra_args = {}
    if job.get("ds3_offload"):  # ZeRO-3, parameters and optimizer state on the CPU (DeepSpeedCPUAdam)
        extra_args["deepspeed"] = {
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True, "stage3_gather_16bit_weights_on_model_save": False},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            times.append(time.perf_counter() - marks["t"])

    args = TrainingArguments(output_dir=f"{tmp}/{job_name}", per_device_train_batch_size=1, bf16=True,
                             max_steps=warmup + steps, learning_rate=1e-4, max_grad_norm=1.0, logging_steps=100000,
                             save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                             remove_unused_columns=False, seed=0, use_cpu=dev.type == "cpu", **extra_args)
    data = [{k: v[0] if k in ("input_ids", "labels", "mm_token_type_ids") else v for k, v in batch.items()}] * (
        warmup + steps)

    def collate(items):
        one = items[0]
        return {k: (v[None] if k in ("input_ids", "labels", "mm_token_type_ids") else v) for k, v in one.items()}

    mem_reset()
    Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[Clock()]).train()
    return _row(job_name, job, preset, dev, mcfg, times[warmup:], batch["input_ids"].numel(),
                step_flops(mcfg, batch, True, True), {"num_trainable": trainable, "adapted_layers": adapted})


GPU_MEMORY_GB = float(os.environ.get("BENCH_GPU_MEMORY_GB", "0") or 0)  # --gpu-memory-gb, through the env to each job


def run_job(name: str, preset: str, out: str, tmp: str, profile: int = 0) -> int:
    """One job in this process; ``profile``: that many steps profiled after the timed ones
    (ddptrain jobs)."""
    job = JOBS[name][0]
    warmup, steps = (2, 5) if preset == "real" else (1, 2)
    try:
        if job["peer"] == "hf_peft":
            try:
                import peft  # noqa: F401
            except ImportError:
                row = {"workload": "glm4v_9b", "name": name, "peer": "hf_peft", "skipped": "peft is not installed"}
                append_row(out, row)
                return 0
            row = run_hf_peft(name, job, preset, warmup, steps, tmp)
        else:
            row = run_ddptrain(name, job, preset, warmup, steps, tmp, profile)
    except Exception as e:  # an error row, and exit status 1 (bench/gpu_session.py's convention)
        append_row(out, {"workload": f"glm4v_{job['model']}", "name": name, "peer": job["peer"],
                      "gpu_memory_gb": GPU_MEMORY_GB or None, "error": f"{type(e).__name__}: {e}"[:2000]})
        raise
    if world()[0] == 0:
        append_row(out, row)
        print(json.dumps({k: row[k] for k in ("name", "tokens_per_s", "mfu", "peak_alloc_gib") if k in row}))
    ddptrain.dist.teardown()  # a multi-rank job leaves its process group as the examples do
    return 0


def run_plan(jobs: list[str], dry: bool, out: str, tmp: str, profile: int = 0) -> int:
    """Each job in its own process with a hard timeout; the dry run runs them tiny on CPU (the
    multi-GPU job on 2 gloo ranks)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1" if dry else "8",
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), ROOT) if p))
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    failed = 0
    start = len(open(out).readlines()) if os.path.exists(out) else 0  # the rows this plan appends come after
    for name in jobs:
        _, gpus, timeout = JOBS[name]
        n = 2 if dry and gpus > 1 else gpus
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                  "--master_port=29531"] if n > 1 else [sys.executable]
        cmd = launch + [os.path.abspath(__file__), "job", name, "--out", out, "--tmp", tmp] + (["--dry"] if dry else [])
        cmd += [f"--profile={profile}"] if profile else []
        job_env = dict(env)
        if JOBS[name][0].get("ds3_offload") and n == 1:  # DeepSpeed wants a process group: torchrun's env of one rank
            job_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29532", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        t0 = time.time()
        try:
            rc = subprocess.run(cmd, env=job_env, timeout=timeout * (3 if dry else 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
            append_row(out, {"workload": "glm4v", "name": name, "gpu_memory_gb": GPU_MEMORY_GB or None,
                          "error": f"timed out after {timeout}s"})
        print(f"[bench_9b] {name}: rc={rc} in {time.time() - t0:.0f}s", flush=True)
        failed += rc != 0
    rows = [json.loads(x) for x in open(out).readlines()[start:] if x.strip()] if os.path.exists(out) else []
    for compiled, eager in COMPILED_VS_EAGER.items():
        if compiled in jobs and eager in jobs:
            row = compare_losses(rows, compiled, eager, CHECK_RTOL["tiny" if dry else "real"])
            append_row(out, row)
            print(f"[bench_9b] {row['name']}: {'ok' if row['ok'] else 'FAILED'} {json.dumps(row)}", flush=True)
            failed += not row["ok"]
    return 1 if failed else 0


def compare_losses(rows: list, compiled: str, eager: str, rtol: float) -> dict:
    """The check row of a compiled job against its eager twin, from the plan's rows: the largest
    relative difference of their per-step losses and gradient norms, ``ok`` within ``rtol``
    (a missing or failed row is not ok)."""
    got = {r.get("name"): r for r in rows if "losses" in r}
    row = {"workload": "glm4v_9b", "name": f"{compiled}_vs_eager", "check": "compiled_vs_eager",
           "compiled": compiled, "eager": eager, "rtol": rtol, "ok": False}
    if compiled not in got or eager not in got:
        return dict(row, error=f"no row with losses for {compiled if compiled not in got else eager}")
    a, b = got[compiled], got[eager]

    def rel(x: list, y: list) -> float:  # a non-finite value on either side counts as infinitely far
        d = [abs(p - q) / max(abs(q), 1e-12) for p, q in zip(x, y)]
        return max((v if math.isfinite(v) else math.inf for v in d), default=math.inf)

    loss_diff, norm_diff = rel(a["losses"], b["losses"]), rel(a["grad_norms"], b["grad_norms"])
    same_steps = len(a["losses"]) == len(b["losses"]) > 0
    return dict(row, steps=len(a["losses"]), max_loss_rel_diff=loss_diff, max_grad_norm_rel_diff=norm_diff,
                losses_compiled=a["losses"], losses_eager=b["losses"],
                ok=same_steps and loss_diff <= rtol and norm_diff <= rtol)


def estimate(gpus=(1, 2, 4, 8), card_gib: float = 139.8) -> list[dict]:
    """The estimator's per-GPU model state of the 10B full fine-tune (bf16 weights, ZeRO with
    sharded masters), from the real model on the meta device: what it holds at rest and at the
    step's peak (+ the fp32 gradients of the rank's own masters). Activations come on top: with
    recompute, one 8192-token sequence, ~6 GiB on the 3B model (bench/NOTES.md, item 39)."""
    from ddptrain.memory import estimate_model_state

    cfg = ddptrain.load_config(None, ["trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.zero=true"])
    model = build(JOBS["full9b_zero"][0], "real", torch.device("meta"))
    out = []
    for n in gpus:
        est = estimate_model_state(model, cfg, n)
        at_rest, step = est["total"] / 2**30, (est["total"] + est["master_grads"]) / 2**30
        out.append({"gpus": n, "params": est["num_params"], "at_rest_gib": round(at_rest, 1),
                    "step_gib": round(step, 1), "left_for_activations_gib": round(card_gib - step, 1)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_9b.py", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["plan", "job", "estimate"])
    p.add_argument("job", nargs="?", help="a job name (with 'job'): " + ", ".join(JOBS))
    p.add_argument("--jobs", default=",".join(PLAN_H200), help="the plan's jobs, comma-separated")
    p.add_argument("--dry", action="store_true", help="tiny shapes on CPU (same code paths)")
    p.add_argument("--out", default="", help="results file (JSON lines, appended)")
    p.add_argument("--tmp", default="/tmp/bench_9b", help="scratch folder for run folders")
    p.add_argument("--gpu-memory-gb", type=float, default=0.0, help="cap every job's GPU memory at this many GiB")
    p.add_argument("--profile", type=int, nargs="?", const=3, default=0,
                   help="ddptrain jobs: then profile N (3) steps (bench/profiling.py: kernel time, idle, host, floor)")
    args = p.parse_args(argv)
    if args.gpu_memory_gb:
        global GPU_MEMORY_GB
        GPU_MEMORY_GB = args.gpu_memory_gb
        os.environ["BENCH_GPU_MEMORY_GB"] = str(args.gpu_memory_gb)
    if args.what == "estimate":
        for r in estimate():
            print(json.dumps(r))
        return 0
    if not args.out:
        p.error("--out is required")
    if args.what == "job":
        if args.job not in JOBS:
            p.error(f"unknown job {args.job!r}: one of {', '.join(JOBS)}")
        return run_job(args.job, "tiny" if args.dry else "real", args.out, args.tmp, args.profile)
    jobs = args.jobs.split(",")
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        p.error(f"unknown jobs {unknown}: {', '.join(JOBS)}")
    return run_plan(jobs, args.dry, args.out, args.tmp, args.profile)


if __name__ == "__main__":
    sys.exit(main())
