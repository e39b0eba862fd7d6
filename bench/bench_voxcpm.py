"""VoxCPM-1.5 or VoxCPM2 TTS training throughput on one GPU: upstream's training step vs ddptrain, side by side.

Workloads: ``--arch voxcpm1.5`` (the default; workload ``voxcpm15_tts``) trains upstream's
``VoxCPMModel`` random-initialised in VoxCPM-1.5's layout (examples/models/voxcpm_tts.py, preset
``voxcpm1.5``: ~0.8B parameters without the VAE, a 44.1 kHz VAE, patch 4); ``--arch voxcpm2``
(``voxcpm2_tts``) upstream's ``VoxCPM2Model`` in VoxCPM2's layout (preset ``voxcpm2``: 2.29B
parameters, the 16 kHz-in / 48 kHz-out AudioVAEV2, patch 4). Synthetic speech: lognormal
durations (median 5 s, sigma 0.5, clipped 1-15 s), random audio at the VAE's input rate as the
built model reports it (``vae.sample_rate``: 44.1 kHz, 16 kHz), ~3.5 text tokens per second of
audio (random ids). ``--ref-audio`` (VoxCPM2): every utterance carries the next one's recording
as its ``ref_audio``, in front of its sequence with no loss on it, as upstream's packer and the
recipe put it. Nothing is downloaded. Each peer runs in its own subprocess (bounded by
``--timeout``), so memory peaks and compile caches do not leak between them, and a peer that
fails (CUDA out of memory included) leaves an error row (``error``: the failure's last line,
``oom``, ``tail``) and the next peer runs.

* ``upstream``: scripts/train_voxcpm_finetune.py's step as it runs it, reproduced because its
  data stack (HF ``datasets`` + argbind) is not installed, with the settings of its config for
  the architecture (conf/voxcpm_v1.5/voxcpm_finetune_all.yaml: batch 16, 2 workers, no gradient
  clipping, 100 warm-up steps of 2000; conf/voxcpm_v2/voxcpm_finetune_all.yaml: batch 2 x 8
  accumulated micro-batches, 8 workers, clipping at 1.0, 100 of 1000 steps, ``max_batch_tokens``
  8192: utterances longer than 8192 // batch estimated positions are dropped first, as its
  script does): a DataLoader of random utterances (its collate: audio and text padded with
  -100; with ``ref_audio`` its reference recordings too), upstream's own
  ``AudioFeatureProcessingPacker`` encoding every utterance (and reference) through the VAE on
  the GPU in every step, fp32 weights, the forward under bf16 autocast with ``progress``,
  ``(loss/diff + loss/stop) / accumulation`` (lambdas 1), GradScaler (its Accelerator has one),
  ``clip_grad_norm_``, AdamW lr 1e-5 / wd 0.01, cosine schedule with warm-up, ``.item()`` of the
  losses every 10 steps. ``--batch`` and ``--grad-accum`` replace the config's (to find the
  largest batch a GPU holds).
* ``upstream_lora``: the same step with upstream's own LoRA (its ``LoRAConfig``: q/k/v/o of the
  base LM, the residual LM and the DiT; conf/voxcpm_v2/voxcpm_finetune_lora.yaml's r 32 alpha
  32, v1.5's r 8 alpha 16) on the fp32 base it freezes, lr 1e-4.
* ``ddptrain``: examples/finetune_tts.py's data path and objective under ddptrain.Trainer with
  the architecture's config (configs/tts_voxcpm15.yaml, configs/tts_voxcpm2.yaml): latents
  encoded once beforehand (that time is in the row as ``prepare_s``), batches of
  ``data.max_duration`` padded latent seconds from ``DurationBucketSampler``, bf16 autocast,
  fp32 weights, eager.
* ``ddptrain_best``: + bf16 weights with fp32 masters (``trainer.param_dtype=bf16``) and the
  MiniCPM layers compiled (regional, dynamic shapes); ``ddptrain_best_md320``: + 320 padded
  latent seconds per batch over 10 buckets (the 4.10x row of BENCHMARKS.md).
* ``ddptrain_lora`` / ``ddptrain_lora_md320``: the LoRA config (configs/tts_voxcpm2_lora.yaml:
  r 32 alpha 32 on the same q/k/v/o; tts_voxcpm15_lora.yaml: r 8 alpha 16) on a bf16 frozen
  base, the MiniCPM layers compiled; ``_md320`` as above.
* ``ddptrain_offload_md320`` / ``_md240``: ``ddptrain_best`` at 320 / 240 padded latent seconds
  with ``optim.offload=cpu`` (masters and AdamW on the host); ``ddptrain_offload_rc_md320``: +
  the MiniCPM layers recomputed in backward (VoxCPM2 on a 24 GB card), for ``--gpu-memory-gb G``:
  every peer capped at G GiB (the rows carry ``gpu_memory_gb``). More variants: ``--ov NAME=k=v,k=v``
  (a NAME starting ``ddptrain_lora`` starts from the LoRA config).
* ``--profile`` (ddptrain peers): after the timed steps, ``--profile-steps`` steps over the last
  timed batches under torch.profiler (``bench/profiling.py``): kernel time by category, GPU idle
  share, host time per step, the floor (kernel time at zero host time) and MFU there; ``--gaps``
  what the host did in the longest GPU idle gaps.

Several GPUs (issue 22): ``--nproc N`` runs each ddptrain peer under torchrun, every rank on its
share of the batch plan (latents encoded once, each rank a share); the row sums throughput over
the ranks over the slowest rank's time, MFU and ``peak_alloc_gb_per_gpu`` per GPU. ``--as-world N``
on one GPU trains on exactly the batches of the N-GPU run (all ranks' batches in step order,
``N`` times the steps), so the scaling efficiency compares identical work; its row is named
``PEER_asN``.

Timing: ``--warmup`` steps, then ``--steps`` timed (optimizer) steps, host clock around a device
sync. audio-s/s counts the real (unpadded) seconds of the target utterances trained on (not their
references). Padding: the share of LM positions (B x S) that are padding. MFU = FLOPs of the
padded batches / (time x 989.4e12, the dense bf16 peak of one H100/H200 SXM), the FLOPs of
``VoxCpmFlops`` (examples/models/train_flops.py, the recipe's ``flops_fn``; LoRA peers: frozen
weights); the VAE (upstream runs its encoder in every step) is not counted.

    python bench/bench_voxcpm.py --out bench/results/h200x1_DATE_voxcpm.jsonl
    python bench/bench_voxcpm.py --arch voxcpm2 --peers upstream,ddptrain_best_md320 --batch 16 --grad-accum 1 \
        --out r.jsonl
    python bench/bench_voxcpm.py --dry --out /tmp/rows.jsonl     # CPU: tiny preset, a few steps
    python bench/bench_voxcpm.py --dry --inline --out /tmp/rows.jsonl   # ... all peers in one process
    python bench/bench_voxcpm.py --arch voxcpm2 --dry --inline --ref-audio --out /tmp/rows.jsonl  # tiny-v2
    python bench/bench_voxcpm.py --peers ddptrain_best_md320 --utterances 3200 --nproc 4 --out r.jsonl
    python bench/bench_voxcpm.py --peers ddptrain_best_md320 --utterances 3200 --as-world 4 --out r.jsonl
    python3 bench/gpu_session.py voxcpm2 --out "$OUT" --budget 540 --no-calib   # the VoxCPM2 plan, one H200
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (HERE, os.path.join(HERE, "..", "examples")) if p not in sys.path]

from ddptrain.data import SyntheticCorpus  # noqa: E402
from flops import PEAK_BF16  # noqa: E402
from models.train_flops import VoxCpmFlops as Flops  # noqa: E402
from measure import (graph_counts, Interleave, TimedSteps, append_row, cap_gpu_memory, device, mem_reset,  # noqa: E402
                     named_peers, peak_gb, peer_row, sync, world)
from profiling import diagnose  # noqa: E402
from profiling import summary as profile_summary  # noqa: E402

# lognormal durations (median 5 s, clipped 1-15 s), ~3.5 text ids a second of audio
CORPUS = SyntheticCorpus(median_s=5.0, sigma=0.5, min_s=1.0, max_s=15.0, tokens_per_s=3.5, token_jitter=0.2,
                         min_tokens=2)
COMPILE = ["compile.enabled=true", "compile.dynamic=true", "compile.module_classes=[MiniCPMDecoderLayer]"]
MD320 = ["data.max_duration=320", "data.num_buckets=10"]
OVERRIDES = {
    "ddptrain": [],
    "ddptrain_bf16": ["trainer.param_dtype=bf16"],
    "ddptrain_best": ["trainer.param_dtype=bf16", *COMPILE],
    "ddptrain_lora": COMPILE,  # the LoRA config (bf16 frozen base already): a name starting ddptrain_lora
    "ddptrain_lora_md320": COMPILE + MD320,
}
OVERRIDES["ddptrain_best_md320"] = OVERRIDES["ddptrain_best"] + MD320
# on a small card: the masters and AdamW on the host (optim.offload), so activations get the GPU
OVERRIDES["ddptrain_offload_md320"] = OVERRIDES["ddptrain_best_md320"] + ["optim.offload=cpu"]
OVERRIDES["ddptrain_offload_md240"] = OVERRIDES["ddptrain_best"] + ["data.max_duration=240", "data.num_buckets=10",
                                                                     "optim.offload=cpu"]
# VoxCPM2's activations at 320 s exceed a 24 GB card beside its 9.2 GB of bf16 weights and gradients: recompute
OVERRIDES["ddptrain_offload_rc_md320"] = OVERRIDES["ddptrain_offload_md320"] + [
    "recompute.enabled=true", "recompute.module_classes=[MiniCPMDecoderLayer]"]
UPSTREAM_PEERS = ("upstream", "upstream_lora")


@dataclasses.dataclass(frozen=True)
class Arch:
    """A VoxCPM generation: its presets, ddptrain's configs, and the settings of upstream's
    fine-tuning configs (conf/voxcpm_v*/voxcpm_finetune_{all,lora}.yaml) that its peers run."""

    preset: str
    dry_preset: str
    workload: str
    config: str  # configs/: full fine-tuning
    lora_config: str  # configs/: LoRA
    batch: int  # upstream's batch_size
    grad_accum: int  # grad_accum_steps
    workers: int  # num_workers
    max_grad_norm: float  # 0: no clipping (its clip_grad_norm_(1e9) only computes the norm)
    total_steps: int  # num_iters = max_steps: the cosine schedule's length and progress's denominator
    max_batch_tokens: int  # 0: no length filter
    lora_r: int
    lora_alpha: int
    warmup_steps: int = 100
    lr: float = 1e-5
    lora_lr: float = 1e-4


ARCHS = {
    "voxcpm1.5": Arch("voxcpm1.5", "tiny", "voxcpm15_tts", "tts_voxcpm15.yaml", "tts_voxcpm15_lora.yaml",
                      batch=16, grad_accum=1, workers=2, max_grad_norm=0.0, total_steps=2000, max_batch_tokens=0,
                      lora_r=8, lora_alpha=16),
    "voxcpm2": Arch("voxcpm2", "tiny-v2", "voxcpm2_tts", "tts_voxcpm2.yaml", "tts_voxcpm2_lora.yaml",
                    batch=2, grad_accum=8, workers=8, max_grad_norm=1.0, total_steps=1000, max_batch_tokens=8192,
                    lora_r=32, lora_alpha=32),
}


def workload(args) -> str:
    return ("voxcpm2_tiny_dry" if args.arch == "voxcpm2" else "voxcpm_tiny_dry") if args.dry else \
        ARCHS[args.arch].workload


# ------------------------------------------------------------------------------------ model, data, FLOPs


def make_model(args, lora: bool = False):
    """(model without VAE, VAE, layout): random init, built on the device; ``lora``: with upstream's
    own LoRA layers (its ``LoRAConfig`` of the architecture's LoRA config), the rest frozen."""
    from models import voxcpm_tts as vt

    arch = ARCHS[args.arch]
    preset = arch.dry_preset if args.dry else arch.preset
    kind = vt.preset_architecture(preset)
    dtype = "float32" if args.dry else "bfloat16"
    layout = vt.preset_config(preset, 512 if args.dry else 0, dtype)
    adapters = vt.model_module(kind).LoRAConfig(enable_lm=True, enable_dit=True, r=arch.lora_r,
                                                 alpha=arch.lora_alpha) if lora else None
    dev = device()
    with torch.device(dev):
        torch.manual_seed(1)
        vae = vt.vae_from_config(layout.audio_vae_config, kind).float().eval().requires_grad_(False)
        torch.manual_seed(0)
        model = vt.build_model(layout, vt.char_tokenizer(), vae, str(dev), kind, upstream_lora=adapters)
    return model, vae, layout


def corpus(utterances: int, vocab: int, sample_rate: int):
    """The library's in-memory corpus (``CORPUS``, ``utterances`` long): random audio at
    ``sample_rate`` (the VAE's input rate) and text ids in [200, vocab), deterministic."""
    return dataclasses.replace(CORPUS, utterances=utterances).dataset(0, (200, vocab), sample_rate=sample_rate)


def ref_of(i: int, n: int) -> int:
    """``--ref-audio``: utterance ``i``'s reference recording is the next utterance's audio."""
    return (i + 1) % n


class UpstreamSamples(torch.utils.data.Dataset):
    """The corpus as upstream's sample dicts (text_ids, audio_array, ...; ref_audio_array with
    ``ref``), the utterances ``keep``."""

    def __init__(self, speech, keep, ref: bool):
        self.speech, self.keep, self.ref = speech, list(keep), ref

    def __len__(self):
        return len(self.keep)

    def __getitem__(self, k):
        i = self.keep[k]
        x = self.speech[i]
        sample = {"text_ids": x["tokens"].tolist(), "audio_array": x["audio"].numpy(), "dataset_id": 0,
                  "is_prompt": False, "index": int(i)}
        if self.ref:
            sample["ref_audio_array"] = self.speech[ref_of(i, len(self.speech))]["audio"].numpy()
        return sample


def upstream_collate(batch):
    """voxcpm.training.data.HFVoxCPMDataset.collate_fn (audio, text and reference audio padded with -100)."""
    pad = lambda seqs, v: torch.stack([torch.nn.functional.pad(s, (0, max(len(x) for x in seqs) - len(s)), value=v)  # noqa: E731
                                       for s in seqs])
    text = pad([torch.tensor(s["text_ids"], dtype=torch.int32) for s in batch], -100)
    audio = pad([torch.tensor(s["audio_array"], dtype=torch.float32) for s in batch], -100.0)
    out = {"text_tokens": text, "audio_tokens": audio, "task_ids": torch.ones(len(batch), dtype=torch.int32),
           "dataset_ids": torch.zeros(len(batch), dtype=torch.int32), "is_prompts": [False] * len(batch),
           "index": [s["index"] for s in batch]}
    if "ref_audio_array" in batch[0]:
        out["ref_audio_tokens"] = pad([torch.tensor(s["ref_audio_array"], dtype=torch.float32) for s in batch], -100.0)
    return out


def upstream_keep(speech, batch: int, max_batch_tokens: int, frame_rate: float, patch: int, ref: bool) -> list:
    """The utterances upstream's script trains on: with ``max_batch_tokens`` those whose estimated
    sequence (``voxcpm.training.data.compute_sample_lengths``: text + patches [+ reference
    patches] + 2 [+ 2]) is at most ``max_batch_tokens // batch`` positions; all without."""
    d = speech.durations
    patches = lambda s: math.ceil(math.ceil(s * frame_rate) / patch)  # noqa: E731
    keep = []
    for i in range(len(d)):
        n = len(speech.tokens(i)) + patches(d[i]) + 2 + ((patches(d[ref_of(i, len(d))]) + 2) if ref else 0)
        if not max_batch_tokens or n <= max_batch_tokens // batch:
            keep.append(i)
    return keep


def summarize(args, peer, elapsed, stats, extra, world_size=1, peaks=None) -> dict:
    """The row: ``stats`` of every timed step of every rank, ``elapsed`` the slowest rank's time;
    throughput in total, MFU per GPU, ``peaks`` (GB) per GPU."""
    tot = {k: sum(float(s[k]) for s in stats) for k in ("n", "audio_s", "flops", "real", "padded")}
    tflops = tot["flops"] / elapsed / world_size / 1e12
    peaks = peaks or [peak_gb()]
    steps = len(stats) // world_size
    return {"workload": workload(args), "peer": peer, "world_size": world_size,
            "steps": steps, "warmup": args.warmup, "elapsed_s": round(elapsed, 3),
            "samples": int(tot["n"]), "audio_s": round(tot["audio_s"], 3),  # the timed work itself
            "samples_per_s": tot["n"] / elapsed, "audio_s_per_s": tot["audio_s"] / elapsed,
            "samples_per_step": tot["n"] / max(1, steps), "padding_fraction": 1 - tot["real"] / max(1, tot["padded"]),
            "tflops": tflops, "mfu": tflops * 1e12 / PEAK_BF16,
            "peak_alloc_gb": None if peaks[0] is None else max(peaks), "peak_alloc_gb_per_gpu": peaks,
            "peak_reserved_gb": peak_gb(reserved=True),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "gpu_memory_gb": args.gpu_memory_gb or None, "ref_audio": args.ref_audio,
            **extra}


def upstream_name(args, peer: str) -> str:
    """An upstream row's name: its batch (x accumulation) and memory cap, e.g. ``upstream_b2x8``, ``upstream_b1_23gib``."""
    accum = f"x{args.grad_accum}" if args.grad_accum > 1 else ""
    return f"{peer}_b{args.batch}{accum}" + (f"_{args.gpu_memory_gb:g}gib" if args.gpu_memory_gb else "")


def params(model) -> dict:
    return {"params": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


# ------------------------------------------------------------------------------------ peers


def run_upstream(args) -> dict:
    from models import voxcpm_tts as vt

    arch, lora = ARCHS[args.arch], args.peer == "upstream_lora"
    cap_gpu_memory(args.gpu_memory_gb)  # ddptrain peers cap themselves: trainer.gpu_memory_gb
    model, vae, layout = make_model(args, lora=lora)
    dev = device()
    speech = corpus(args.utterances, layout.lm_config.vocab_size, vae.sample_rate)
    d = speech.durations
    flops = Flops(model, layout, lora=lora)
    keep = upstream_keep(speech, args.batch, arch.max_batch_tokens, vae.sample_rate / vae.hop_length,
                         layout.patch_size, args.ref_audio)
    packer = vt.upstream_packer_class()(dataset_cnt=1, max_len=layout.max_length, patch_size=layout.patch_size,
                                        feat_dim=layout.feat_dim, audio_vae=vae)
    loader = torch.utils.data.DataLoader(UpstreamSamples(speech, keep, args.ref_audio), batch_size=args.batch,
                                         shuffle=True, num_workers=0 if args.dry else arch.workers,
                                         collate_fn=upstream_collate, drop_last=True, pin_memory=True,
                                         generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=arch.lora_lr if lora else arch.lr,
                            weight_decay=0.01)
    from transformers import get_cosine_schedule_with_warmup

    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=arch.warmup_steps,
                                            num_training_steps=arch.total_steps)
    scaler = torch.amp.GradScaler("cuda", enabled=dev.type == "cuda")

    def epochs():  # its get_next_batch: a new epoch (reshuffled) when one ends
        while True:
            yield from loader

    model.train()
    mem_reset()
    it, stats, t0, loss = epochs(), [], None, None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        done = {"n": 0, "audio_s": 0.0, "flops": 0.0, "real": 0, "padded": 0}
        for _ in range(args.grad_accum):
            batch = next(it)
            p = packer(audio_tokens=batch["audio_tokens"].to(dev), text_tokens=batch["text_tokens"].to(dev),
                       task_ids=batch["task_ids"].to(dev), dataset_ids=batch["dataset_ids"].to(dev),
                       is_prompts=batch["is_prompts"], ref_audio_tokens=batch["ref_audio_tokens"].to(dev)
                       if "ref_audio_tokens" in batch else None)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = model(p["text_tokens"], p["text_mask"], p["audio_feats"], p["audio_mask"], p["loss_mask"],
                            p["position_ids"], p["labels"], progress=step / arch.total_steps)
            total = (out["loss/diff"] + out["loss/stop"]) / args.grad_accum
            scaler.scale(total).backward()
            b, s = p["text_mask"].shape
            done = {"n": done["n"] + b, "audio_s": done["audio_s"] + float(d[batch["index"]].sum()),
                    "flops": done["flops"] + flops(b, s), "padded": done["padded"] + b * s,
                    "real": done["real"] + (p["text_mask"] + p["audio_mask"]).sum()}  # text, 101/102, audio
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=arch.max_grad_norm or 1e9)
        scaler.step(opt)
        scaler.update()
        sched.step()
        if step % 10 == 0:
            loss = float(total.item()) * args.grad_accum
        if step >= args.warmup:
            stats.append(done)
    sync()
    elapsed = time.perf_counter() - t0
    stats = [dict(x, real=int(x["real"])) for x in stats]  # read after the clock: no sync of ours in the steps
    return summarize(args, args.peer, elapsed, stats, {
        "name": upstream_name(args, args.peer), "batch": args.batch, "grad_accum": args.grad_accum,
        "kept_utterances": len(keep), "utterances": args.utterances,
        "loss": loss if loss is not None else float(total.item()) * args.grad_accum, **params(model)})


def run_ddptrain(args) -> dict:
    import finetune_tts as ft
    import tts_cache

    import ddptrain

    from models import voxcpm_tts as vt

    arch, lora = ARCHS[args.arch], args.peer.startswith("ddptrain_lora")
    ov = OVERRIDES[args.peer] + list(args.ov)
    cfg = ddptrain.load_config(os.path.join(HERE, "..", "configs", arch.lora_config if lora else arch.config), [
        f"trainer.output_dir={args.tmp}/{args.peer}", f"trainer.max_steps={args.as_world * (args.warmup + args.steps)}",
        "trainer.eval_every=0", "checkpoint.save_at_end=false", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.log_every=10", f"data.num_workers={0 if args.dry else 2}", f"data.max_duration={args.max_duration}",
        "tts.num_samples=0", *ov, *([f"trainer.gpu_memory_gb={args.gpu_memory_gb}"] if args.gpu_memory_gb else []),
        *(["trainer.device=cpu", *([] if "optim.offload=cpu" in ov else ["trainer.precision=fp32", "trainer.param_dtype=fp32"]),
                                     "data.num_buckets=2", "compile.enabled=false",
                                     f"data.max_duration={args.max_duration}"] if args.dry else [])],
        schema=ft.RecipeConfig)
    info = ddptrain.setup_distributed(cfg)
    ws, rank = info.world_size, info.rank
    model, vae, layout = make_model(args)
    speech = corpus(args.utterances, layout.lm_config.vocab_size, vae.sample_rate)
    d = speech.durations
    flops = Flops(model, layout, lora=lora)
    # the prepare step: encode every utterance once, each rank a share (timed, reported apart)
    folder = os.path.join(args.tmp, "latents")
    os.makedirs(folder, exist_ok=True)
    sync()
    t = time.perf_counter()
    utts = []
    for i in range(rank, len(d), ws):
        z = vt.encode_latents(vae, speech[i]["audio"], layout.patch_size).numpy()
        path = os.path.join(folder, f"{i}.npy")
        np.save(path, z)
        utts.append(tts_cache.CachedUtterance(str(i), str(i), path, int(z.shape[0]), "synthetic", i + 1))
    sync()
    prepare_s = time.perf_counter() - t
    if ws > 1:  # every rank's share, for every rank's batch plan (the files are on this host)
        shares = [None] * ws
        torch.distributed.all_gather_object(shares, utts)
        utts = sorted((u for share in shares for u in share), key=lambda u: u.line)
    if args.ref_audio:  # the reference is another utterance's recording: its latents are cached already
        utts = [dataclasses.replace(u, ref_audio=str(r.id), ref_latent_path=r.latent_path, ref_frames=r.frames)
                for u, r in ((u, utts[ref_of(k, len(utts))]) for k, u in enumerate(utts))]
    by_text = {str(i): speech.tokens(i).tolist() for i in range(len(d))}  # an utterance's "text" is its index

    class Ids:
        def __call__(self, text):
            return by_text[text]

    w, n = args.as_world * args.warmup, args.as_world * args.steps
    if args.as_world > 1:  # one GPU, the batches of an as_world-GPU run, in step order
        loader = Interleave([ft.build_loader(utts, cfg, Ids(), layout, True, args.as_world, r)
                             for r in range(args.as_world)])
        if len(loader) < w + n + 1:  # a second epoch would reshuffle unlike the N-GPU run's
            raise ValueError(f"--as-world {args.as_world}: {w + n + 1} steps exceed one epoch of {len(loader)} "
                             f"batches; give more --utterances")
    else:
        loader = ft.build_loader(utts, cfg, Ids(), layout, True, ws, rank)

    def stats(batch):
        b, s = batch["text_mask"].shape
        real = (batch["text_mask"] + batch["audio_mask"]).sum()  # the host batch: no device sync
        return {"n": b, "audio_s": float(sum(d[int(i)] for i in batch["ids"])), "flops": flops(b, s), "real": real,
                "padded": b * s}

    # timed at the Trainer's step, not in the loss: compile.cuda_graphs replays skip loss_fn
    timed = TimedSteps(stats, keep=args.profile_steps + 1 if args.profile or args.gaps else 0)
    mem_reset()
    trainer = ddptrain.Trainer(model, ft.TTSObjective(), cfg, loader)
    timed.attach(trainer)
    trainer.fit()
    sync()
    elapsed, timed_stats, _ = timed.window(w, n, end=time.perf_counter())
    reals = torch.stack([x["real"] for x in timed_stats]).tolist() if timed_stats else []  # one read, no sync per step
    timed_stats = [dict(x, real=int(r)) for x, r in zip(timed_stats, reals)]
    # every rank steps (a step is collective); the row carries rank 0's profile
    diag = diagnose({"profile": args.profile, "gaps": args.gaps, "profile_steps": args.profile_steps},
                    lambda b: trainer.train_step([b]), itertools.cycle(list(timed.recent)),
                    flops_of=lambda b: stats(b)["flops"])
    if "profile" in diag and rank == 0:
        print("PROFILE", args.peer, json.dumps(profile_summary(diag["profile"])), flush=True)
    mine = {"elapsed": elapsed, "stats": timed_stats, "peak": peak_gb(), "prepare_s": prepare_s}
    every = [mine]
    if ws > 1:
        every = [None] * ws
        torch.distributed.all_gather_object(every, mine)
    logged = [json.loads(x) for x in open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl"))] if rank == 0 else []
    trainer.close()
    name = f"{args.peer}_as{args.as_world}" if args.as_world > 1 else args.peer
    prepare_s = max(e["prepare_s"] for e in every)
    return summarize(args, name, max(e["elapsed"] for e in every), [s for e in every for s in e["stats"]],
                     {"max_duration": cfg.data.max_duration, "ov": ov, "prepare_s": round(prepare_s, 2),
                      "prepare_audio_s_per_s": float(d.sum()) / prepare_s, "compiled_modules": len(trainer.compiled),
                      "recomputed_modules": len(trainer.recomputed), "adapted_modules": len(trainer.adapted),
                      "compile_eager_fallbacks": trainer.prepared.fallbacks.count,  # past compile.recompile_limit
                      "as_world": args.as_world, "utterances": args.utterances,
                      "samples_per_s_per_rank": [sum(s["n"] for s in e["stats"]) / e["elapsed"] for e in every],
                      "loss": logged[-1]["loss"] if logged else None,
                      "losses": [r.get("loss") for r in logged if r.get("split") == "train"],  # every log line's
                      "data_wait_frac": [r.get("data_wait_frac") for r in logged if r.get("split") == "train"],
                      **params(trainer.module), **graph_counts(trainer), **diag},
                     world_size=ws, peaks=[e["peak"] for e in every])


def run_one(args) -> dict:
    if args.peer.startswith("upstream"):
        if args.peer not in UPSTREAM_PEERS:
            raise ValueError(f"unknown upstream peer {args.peer!r} (known: {', '.join(UPSTREAM_PEERS)})")
        if world()[1] > 1 or args.as_world > 1:
            raise ValueError("the upstream peers run on one GPU only (their step is reproduced without DDP)")
        return run_upstream(args)
    OVERRIDES.setdefault(args.peer, [])
    return run_ddptrain(args)


def failed_row(row: dict) -> dict:
    """A failed peer's row made readable: ``error`` the failure's last line (the full output's tail
    moves to ``tail``), ``oom`` whether CUDA ran out of memory."""
    text = row.get("error", "")
    if "tail" not in row:  # the process ended with an error, not a timeout: its output is in "error"
        lines = [x for x in text.splitlines() if x.strip()]
        row["tail"], row["error"] = text, (lines[-1] if lines else "exited with an error and no output")[:400]
    row["oom"] = any(k in text + row.get("tail", "") for k in ("OutOfMemoryError", "CUDA out of memory"))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHS), default="voxcpm1.5")
    p.add_argument("--peers", default="upstream,ddptrain,ddptrain_best")
    p.add_argument("--out", default="")
    p.add_argument("--dry", action="store_true", help="CPU: tiny preset, 24 utterances, 1 + 2 steps, fp32, no compile")
    p.add_argument("--batch", type=int, default=0, help="upstream's batch size (0: its config's: 16 for 1.5, 2 for v2)")
    p.add_argument("--grad-accum", type=int, default=0,
                   help="upstream's accumulated micro-batches per step (0: its config's: 1 for 1.5, 8 for v2)")
    p.add_argument("--ref-audio", action="store_true",
                   help="VoxCPM2: every utterance has the next one's recording as its ref_audio")
    p.add_argument("--max-duration", type=float, default=160.0, help="ddptrain: padded latent seconds per batch")
    p.add_argument("--utterances", type=int, default=320)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per peer (start and compile included)")
    p.add_argument("--ov", action="append", default=[], help="NAME=k=v,k=v: a ddptrain peer with these overrides")
    p.add_argument("--inline", action="store_true", help="run the peers in this process (CPU dry runs: one import)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs per ddptrain peer (torchrun)")
    p.add_argument("--as-world", type=int, default=1, help="one GPU trained on the batches of an N-GPU run")
    p.add_argument("--gpu-memory-gb", type=float, default=0.0, help="cap every peer's GPU memory at this many GiB")
    p.add_argument("--profile", action="store_true",
                   help="ddptrain peers: then profile a few steps (bench/profiling.py: kernel time, idle, host, floor)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps --profile profiles (after one more unprofiled)")
    p.add_argument("--gaps", action="store_true", help="ddptrain peers: what the host did in the longest GPU idle gaps")
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="")
    args = p.parse_args(argv)
    arch = ARCHS[args.arch]
    if args.ref_audio and args.arch != "voxcpm2":
        p.error("--ref-audio: reference recordings are VoxCPM2's (--arch voxcpm2)")
    args.batch, args.grad_accum = args.batch or arch.batch, args.grad_accum or arch.grad_accum
    if args.dry:  # a few tiny steps; two accumulated micro-batches where the config accumulates
        args.batch, args.utterances, args.warmup, args.steps, args.max_duration = 4, 24, 1, 2, 20.0
        args.grad_accum = min(args.grad_accum, 2)
    if args.peer:  # one peer in this process (under torchrun: every rank; rank 0 writes the row)
        row = run_one(args)
        if world()[0] == 0:
            with open(args.row, "w") as f:
                json.dump(row, f)
        import ddptrain

        ddptrain.dist.teardown()  # a collection, a barrier, then the group: no abort at exit
        return 0
    peers = named_peers(args.peers, args.ov, OVERRIDES)
    named = [o.split("=", 1)[0] for o in args.ov]
    failed = 0
    for peer in peers:
        if args.inline:  # no subprocess: no time limit either, for the dry run's few steps
            with tempfile.TemporaryDirectory() as tmp:
                args.peer, args.tmp, args.ov = peer, tmp, []  # a named peer's overrides are in OVERRIDES
                row = run_one(args)
            args.peer = None
            print(json.dumps(row)[:3000], flush=True)
            append_row(args.out, row)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            row_file = os.path.join(tmp, "row.json")
            launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                      "--master_port=29571"] if args.nproc > 1 else [sys.executable]
            cmd = launch + [os.path.abspath(__file__), "--arch", args.arch, "--peer", peer, "--row", row_file, "--tmp",
                            tmp, "--batch", str(args.batch), "--grad-accum", str(args.grad_accum), "--max-duration",
                            str(args.max_duration), "--utterances", str(args.utterances), "--warmup", str(args.warmup),
                            "--steps", str(args.steps), "--as-world", str(args.as_world), "--gpu-memory-gb",
                            str(args.gpu_memory_gb)]
            cmd += ["--profile-steps", str(args.profile_steps)] + ["--profile"] * args.profile + ["--gaps"] * args.gaps
            cmd += ["--dry"] * args.dry + ["--ref-audio"] * args.ref_audio
            cmd += [f"--ov={o}" for o in OVERRIDES.get(peer, []) if peer in named]
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if args.dry else "4"))
            if any("optim.offload=cpu" in o for o in OVERRIDES.get(peer, [])) and "OMP_NUM_THREADS" not in os.environ:
                env.pop("OMP_NUM_THREADS")  # the host update is the step's longest part: every core

            tic = time.time()
            keys = {"peer": peer, "arch": args.arch}
            if peer in UPSTREAM_PEERS:
                keys.update(name=upstream_name(args, peer), batch=args.batch, grad_accum=args.grad_accum)
            ok, row = peer_row(cmd, row_file, args.timeout, env, **keys)
        if not ok:
            row = failed_row(row)
        row.setdefault("workload", workload(args))
        row.setdefault("gpu_memory_gb", args.gpu_memory_gb or None)
        row["wall_s"] = round(time.time() - tic, 1)
        failed += not ok
        print(json.dumps(row)[:3000], flush=True)
        append_row(args.out, row)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
