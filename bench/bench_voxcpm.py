"""VoxCPM-1.5 TTS training throughput on one GPU: upstream's training step vs ddptrain, side by side.

Workload ``voxcpm15_tts``: upstream's ``VoxCPMModel`` random-initialised in VoxCPM-1.5's layout
(examples/models/voxcpm_tts.py, preset ``voxcpm1.5``: ~0.8B parameters without the VAE, a 44.1
kHz VAE, patch 4) on synthetic speech: lognormal durations (median 5 s, sigma 0.5, clipped
1-15 s), random 44.1 kHz audio, ~3.5 text tokens per second of audio (random ids). Nothing is
downloaded. Each peer runs in its own subprocess (bounded by ``--timeout``), so memory peaks and
compile caches do not leak between them.

* ``upstream``: scripts/train_voxcpm_finetune.py's step as it runs it, reproduced because its
  data stack (HF ``datasets`` + argbind) is not installed: a DataLoader of 16 random utterances
  (``batch_size: 16``, 2 workers, its collate: audio and text padded with -100), upstream's own
  ``AudioFeatureProcessingPacker`` encoding every utterance through the VAE on the GPU in every
  step, the forward under bf16 autocast with ``progress``, ``loss/diff + loss/stop`` (lambdas 1),
  GradScaler (its Accelerator has one), ``clip_grad_norm_(1e9)`` (max_grad_norm 0), AdamW
  lr 1e-5 / wd 0.01, cosine schedule with warmup, ``.item()`` of the losses every 10 steps.
* ``ddptrain``: examples/finetune_tts.py's data path and objective under ddptrain.Trainer: latents
  encoded once beforehand (that time is in the row as ``prepare_s``), batches of
  ``data.max_duration`` padded latent seconds from ``DurationBucketSampler``, bf16 autocast,
  fp32 weights, eager.
* ``ddptrain_offload_md320`` / ``_md240``: ``ddptrain_best`` at 320 / 240 padded latent seconds
  with ``optim.offload=cpu`` (masters and AdamW on the host), for ``--gpu-memory-gb G``: every
  peer capped at G GiB (the rows carry ``gpu_memory_gb``).
* ``ddptrain_best``: + bf16 weights with fp32 masters (``trainer.param_dtype=bf16``) and the
  MiniCPM layers compiled (regional, dynamic shapes); ``ddptrain_best_md320``: + 320 padded
  latent seconds per batch over 10 buckets (the 4.10x row of BENCHMARKS.md). More variants:
  ``--ov NAME=k=v,k=v``.
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

Timing: ``--warmup`` steps, then ``--steps`` timed steps, host clock around a device sync.
audio-s/s counts the real (unpadded) seconds of the utterances trained on. Padding: the share
of LM positions (B x S) that are padding. MFU = FLOPs of the padded batches / (time x 989.4e12,
the dense bf16 peak of one H100/H200 SXM), the FLOPs of ``VoxCpmFlops``
(examples/models/train_flops.py, the recipe's ``flops_fn``); the VAE (upstream runs its encoder in
every step) is not counted.

    python bench/bench_voxcpm.py --out bench/results/h200x1_DATE_voxcpm.jsonl
    python bench/bench_voxcpm.py --dry --out /tmp/rows.jsonl     # CPU: tiny preset, a few steps
    python bench/bench_voxcpm.py --dry --inline --out /tmp/rows.jsonl   # ... all peers in one process
    python bench/bench_voxcpm.py --peers ddptrain_best_md320 --utterances 3200 --nproc 4 --out r.jsonl
    python bench/bench_voxcpm.py --peers ddptrain_best_md320 --utterances 3200 --as-world 4 --out r.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
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
from measure import (Interleave, TimedLoss, append_row, cap_gpu_memory, device, mem_reset,  # noqa: E402
                     named_peers, peak_gb, peer_row, sync, world)
from profiling import diagnose  # noqa: E402
from profiling import summary as profile_summary  # noqa: E402

# lognormal durations (median 5 s, clipped 1-15 s), ~3.5 text ids a second of audio
CORPUS = SyntheticCorpus(median_s=5.0, sigma=0.5, min_s=1.0, max_s=15.0, tokens_per_s=3.5, token_jitter=0.2,
                         min_tokens=2)
OVERRIDES = {
    "ddptrain": [],
    "ddptrain_bf16": ["trainer.param_dtype=bf16"],
    "ddptrain_best": ["trainer.param_dtype=bf16", "compile.enabled=true", "compile.dynamic=true",
                      "compile.module_classes=[MiniCPMDecoderLayer]"],
}
OVERRIDES["ddptrain_best_md320"] = OVERRIDES["ddptrain_best"] + ["data.max_duration=320", "data.num_buckets=10"]
# on a small card: the masters and AdamW on the host (optim.offload), so activations get the GPU
OVERRIDES["ddptrain_offload_md320"] = OVERRIDES["ddptrain_best_md320"] + ["optim.offload=cpu"]
OVERRIDES["ddptrain_offload_md240"] = OVERRIDES["ddptrain_best"] + ["data.max_duration=240", "data.num_buckets=10",
                                                                     "optim.offload=cpu"]


# ------------------------------------------------------------------------------------ model, data, FLOPs


def make_model(args):
    """(model without VAE, VAE, layout): random init, built on the device."""
    from models import voxcpm_tts as vt

    preset = "tiny" if args.dry else "voxcpm1.5"
    dtype = "float32" if args.dry else "bfloat16"
    layout = vt.preset_config(preset, 512 if args.dry else 0, dtype)
    dev = device()
    with torch.device(dev):
        torch.manual_seed(1)
        vae = vt.vae_from_config(layout.audio_vae_config).float().eval().requires_grad_(False)
        torch.manual_seed(0)
        model = vt.build_model(layout, vt.char_tokenizer(), vae, str(dev))
    return model, vae, layout


def corpus(utterances: int, vocab: int, sample_rate: int = 44100):
    """The library's in-memory corpus (``CORPUS``, ``utterances`` long): random audio at the VAE's
    rate and text ids in [200, vocab), deterministic."""
    return dataclasses.replace(CORPUS, utterances=utterances).dataset(0, (200, vocab), sample_rate=sample_rate)


class UpstreamSamples(torch.utils.data.Dataset):
    """The corpus as upstream's sample dicts (text_ids, audio_array, ...)."""

    def __init__(self, speech):
        self.speech = speech

    def __len__(self):
        return len(self.speech)

    def __getitem__(self, i):
        x = self.speech[i]
        return {"text_ids": x["tokens"].tolist(), "audio_array": x["audio"].numpy(), "dataset_id": 0,
                "is_prompt": False, "index": int(i)}


def upstream_collate(batch):
    """voxcpm.training.data.HFVoxCPMDataset.collate_fn (audio and text padded with -100)."""
    pad = lambda seqs, v: torch.stack([torch.nn.functional.pad(s, (0, max(len(x) for x in seqs) - len(s)), value=v)  # noqa: E731
                                       for s in seqs])
    text = pad([torch.tensor(s["text_ids"], dtype=torch.int32) for s in batch], -100)
    audio = pad([torch.tensor(s["audio_array"], dtype=torch.float32) for s in batch], -100.0)
    return {"text_tokens": text, "audio_tokens": audio, "task_ids": torch.ones(len(batch), dtype=torch.int32),
            "dataset_ids": torch.zeros(len(batch), dtype=torch.int32), "is_prompts": [False] * len(batch),
            "index": [s["index"] for s in batch]}




def summarize(args, peer, elapsed, stats, extra, world_size=1, peaks=None) -> dict:
    """The row: ``stats`` of every timed step of every rank, ``elapsed`` the slowest rank's time;
    throughput in total, MFU per GPU, ``peaks`` (GB) per GPU."""
    tot = {k: sum(float(s[k]) for s in stats) for k in ("n", "audio_s", "flops", "real", "padded")}
    tflops = tot["flops"] / elapsed / world_size / 1e12
    peaks = peaks or [peak_gb()]
    steps = len(stats) // world_size
    return {"workload": "voxcpm_tiny_dry" if args.dry else "voxcpm15_tts", "peer": peer, "world_size": world_size,
            "steps": steps, "warmup": args.warmup, "elapsed_s": round(elapsed, 3),
            "samples": int(tot["n"]), "audio_s": round(tot["audio_s"], 3),  # the timed work itself
            "samples_per_s": tot["n"] / elapsed, "audio_s_per_s": tot["audio_s"] / elapsed,
            "samples_per_step": tot["n"] / max(1, steps), "padding_fraction": 1 - tot["real"] / max(1, tot["padded"]),
            "tflops": tflops, "mfu": tflops * 1e12 / PEAK_BF16,
            "peak_alloc_gb": None if peaks[0] is None else max(peaks), "peak_alloc_gb_per_gpu": peaks,
            "peak_reserved_gb": peak_gb(reserved=True),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "gpu_memory_gb": args.gpu_memory_gb or None, **extra}


# ------------------------------------------------------------------------------------ peers


def run_upstream(args) -> dict:
    from models import voxcpm_tts as vt

    cap_gpu_memory(args.gpu_memory_gb)  # ddptrain peers cap themselves: trainer.gpu_memory_gb
    model, vae, layout = make_model(args)
    dev = device()
    speech = corpus(args.utterances, layout.lm_config.vocab_size, vae.sample_rate)
    d = speech.durations
    flops = Flops(model, layout)
    packer = vt.upstream_packer_class()(dataset_cnt=1, max_len=layout.max_length, patch_size=layout.patch_size,
                                        feat_dim=layout.feat_dim, audio_vae=vae)
    loader = torch.utils.data.DataLoader(UpstreamSamples(speech), batch_size=args.batch, shuffle=True,
                                         num_workers=0 if args.dry else 2, collate_fn=upstream_collate, drop_last=True, pin_memory=True,
                                         generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.01)
    from transformers import get_cosine_schedule_with_warmup

    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=100, num_training_steps=2000)
    scaler = torch.amp.GradScaler("cuda", enabled=dev.type == "cuda")
    model.train()
    mem_reset()
    it, stats, t0, loss = iter(loader), [], None, None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        batch = next(it)
        p = packer(audio_tokens=batch["audio_tokens"].to(dev), text_tokens=batch["text_tokens"].to(dev),
                   task_ids=batch["task_ids"].to(dev), dataset_ids=batch["dataset_ids"].to(dev),
                   is_prompts=batch["is_prompts"])
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = model(p["text_tokens"], p["text_mask"], p["audio_feats"], p["audio_mask"], p["loss_mask"],
                        p["position_ids"], p["labels"], progress=step / 2000)
        total = out["loss/diff"] + out["loss/stop"]
        scaler.scale(total).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        scaler.step(opt)
        scaler.update()
        sched.step()
        if step % 10 == 0:
            loss = float(total.item())
        if step >= args.warmup:
            b, s = p["text_mask"].shape
            real = int((p["text_mask"] + p["audio_mask"]).sum())  # text, 101/102 and audio positions
            stats.append({"n": b, "audio_s": float(d[batch["index"]].sum()), "flops": flops(b, s),
                          "real": real, "padded": b * s})
    sync()
    elapsed = time.perf_counter() - t0
    return summarize(args, "upstream", elapsed, stats, {"batch": args.batch, "loss": loss if loss is not None
                                                        else float(total.item())})


def run_ddptrain(args) -> dict:
    import finetune_tts as ft
    import tts_cache

    import ddptrain

    from models import voxcpm_tts as vt

    ov = OVERRIDES[args.peer] + list(args.ov)
    cfg = ddptrain.load_config(os.path.join(HERE, "..", "configs", "tts_voxcpm15.yaml"), [
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
    flops = Flops(model, layout)
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
        real = int((batch["text_mask"] + batch["audio_mask"]).sum())
        return {"n": b, "audio_s": float(sum(d[int(i)] for i in batch["ids"])), "flops": flops(b, s), "real": real,
                "padded": b * s}

    timed = TimedLoss(ft.TTSObjective(), stats, keep=args.profile_steps + 1 if args.profile or args.gaps else 0)
    mem_reset()
    trainer = ddptrain.Trainer(model, timed, cfg, loader)
    trainer.fit()
    sync()
    elapsed, timed_stats, _ = timed.window(w, n, end=time.perf_counter())
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
                      "as_world": args.as_world, "utterances": args.utterances,
                      "samples_per_s_per_rank": [sum(s["n"] for s in e["stats"]) / e["elapsed"] for e in every],
                      "loss": logged[-1]["loss"] if logged else None,
                      "data_wait_frac": [r.get("data_wait_frac") for r in logged if r.get("split") == "train"],
                      **diag},
                     world_size=ws, peaks=[e["peak"] for e in every])


def run_one(args) -> dict:
    if args.peer == "upstream":
        if world()[1] > 1 or args.as_world > 1:
            raise ValueError("the upstream peer runs on one GPU only (its step is reproduced without DDP)")
        return run_upstream(args)
    OVERRIDES.setdefault(args.peer, [])
    return run_ddptrain(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="upstream,ddptrain,ddptrain_best")
    p.add_argument("--out", default="")
    p.add_argument("--dry", action="store_true", help="CPU: tiny preset, 24 utterances, 1 + 2 steps, fp32, no compile")
    p.add_argument("--batch", type=int, default=16, help="upstream's batch size (its configs: 16)")
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
    if args.dry:
        args.batch, args.utterances, args.warmup, args.steps, args.max_duration = 4, 24, 1, 2, 20.0
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
            cmd = launch + [os.path.abspath(__file__), "--peer", peer, "--row", row_file, "--tmp", tmp,
                            "--batch", str(args.batch), "--max-duration", str(args.max_duration), "--utterances",
                            str(args.utterances), "--warmup", str(args.warmup), "--steps", str(args.steps),
                            "--as-world", str(args.as_world), "--gpu-memory-gb", str(args.gpu_memory_gb),
                            "--profile-steps", str(args.profile_steps)] + ["--profile"] * args.profile + ["--gaps"] * args.gaps
            cmd += ["--dry"] * args.dry + [f"--ov={o}" for o in OVERRIDES.get(peer, []) if peer in named]
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if args.dry else "4"))
            if any("optim.offload=cpu" in o for o in OVERRIDES.get(peer, [])) and "OMP_NUM_THREADS" not in os.environ:
                env.pop("OMP_NUM_THREADS")  # the host update is the step's longest part: every core

            tic = time.time()
            ok, row = peer_row(cmd, row_file, args.timeout, env, peer=peer)
        row.setdefault("workload", "voxcpm_tiny_dry" if args.dry else "voxcpm15_tts")
        row.setdefault("gpu_memory_gb", args.gpu_memory_gb or None)
        row["wall_s"] = round(time.time() - tic, 1)
        failed += not ok
        print(json.dumps(row)[:3000], flush=True)
        append_row(args.out, row)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
