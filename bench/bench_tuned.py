"""Per-bucket budgets measured on the GPU against the best single ``max_duration`` (issue 21).

Results: ``bench/results/h200x1_2026-12-01_s7_tuned*.jsonl``. The first GPU run (3,000
utterances, one pass) compared 3 timed steps per variant on a corpus whose buckets mostly fit in
one batch, and the variant that ran first paid every shape's first-use cost: its rows say
nothing about per-bucket budgets (kept as measured; BENCHMARKS.md says so).

Per workload, on one GPU, on the synthetic corpora of the other benchmarks (nothing downloaded):

* ``wav2vec2``: Wav2Vec2ForCTC, wav2vec2-large-lv60 layout (315M), raw audio, lognormal
  durations (median 7 s, 1-20 s), bf16 autocast (bench/workloads.py).
* ``conformer``: the examples' Conformer-CTC at bench size (110M, 80-bin fbank), bf16 autocast.
* ``glmasr``: GLM-ASR-Nano-2512 random-initialised (2.1B), configs/glmasr.yaml's set-up (bf16
  weights + fp32 masters, encoder/decoder layers compiled), 30 s windows, buckets on windows and
  decoder length; ``data.max_batch_size`` lifted so neither variant is capped at 16.

Steps, all under one memory target (``--memory-gb``, default 90% of the GPU):

1. ``tuned``: ``ddptrain.tune.find_bucket_budgets`` (tolerance 0: each bucket's exact largest
   batch), its wall time (``tuning_s``) and the budget file.
2. ``hand``: the best single ``data.max_duration`` a person could find by trial and error, i.e.
   the largest one under which every bucket's costliest batch fits. It follows from step 1's
   per-bucket maxima without another measurement: bucket ``b`` takes ``floor(M / cost_b)`` rows,
   which fits while that is ``<= B_b``, so ``M* = min over b of (B_b + 1) * cost_b`` (minus a
   hair; buckets the search capped do not bind): the budget file's ``single_max_duration``
   (``ddptrain.tune.single_max_duration``).
3. Each variant trains one full epoch plan with ddptrain.Trainer on a fresh model (no OOM
   allowed; an OOM is an error row): samples/s and audio-seconds/s after ``--warmup`` steps,
   the epoch's wall time, steps, padding, mean batch size and peak memory. The variants run
   in turns ``--passes`` times (default 2): the first pass pays the per-shape costs (cuDNN plans,
   autotuning) for whichever variant runs first, so compare the rows of the last pass (``pass``).

Rows: ``workload``, ``variant`` (hand | tuned), ``tuned`` and ``per_bucket`` (True for the
per-bucket budgets), ``budget`` (M* for hand), the throughput figures, ``tuning_s``,
``memory_target_gb``, the tuner's per-bucket sizes and peaks (``bucket_batch_sizes``,
``bucket_peak_gb``, ``base_gb``), where training peaked (``peak_step``, ``peak_bucket``,
``peak_batch``, ``tuner_peak_gb`` of that bucket, ``peak_alloc_gb_after_step``,
``peak_reserved_gb``, ``alloc_retries``), ``wall_s`` since the workload started, versions, GPU
and date. Each row is appended as its variant finishes.

    python bench/bench_tuned.py --workloads wav2vec2,conformer,glmasr --out bench/results/h200x1_DATE_tuned.jsonl
    python bench/bench_tuned.py --dry --out /tmp/tuned.jsonl      # CPU: tiny models, a stand-in meter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (HERE, os.path.join(HERE, "..", "examples")) if p not in sys.path]

import finetune_hf_model as fhm  # noqa: E402
import workloads  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain import tune  # noqa: E402
from ddptrain.data import DurationBucketSampler, SpeechCollator, make_loader  # noqa: E402

WORKLOADS = ("wav2vec2", "conformer", "glmasr")
GB = 1e9


class ModuleInputMeter:
    """CPU stand-in for the GPU's memory in ``--dry`` runs: a step "peaks" at ``base + bytes x``
    the largest tensor any module received, and past ``capacity`` raises an OOM, as a GPU would."""

    def __init__(self, capacity_gb: float, base_gb: float = 0.01, bytes_per_element: float = 4.0):
        self.cap, self.base, self.per, self.largest = capacity_gb * GB, base_gb * GB, bytes_per_element, 0
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.largest = max([self.largest] + [a.numel() for a in args if isinstance(a, torch.Tensor)])
        if self.peak() > self.cap:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (stand-in meter: {self.peak() / GB:.3f} GB)")

    def reset(self):
        self.largest = 0

    def peak(self) -> float:
        return self.base + self.per * self.largest

    def current(self) -> float:
        return self.base

    def capacity(self) -> float:
        return self.cap

    def name(self) -> str:
        return "cpu stand-in"

    def close(self):
        self.handle.remove()


# ------------------------------------------------------------------------------------ workloads


def config(args, workload: str, folder: str):
    common = [f"trainer.output_dir={folder}", "trainer.max_epochs=1", "trainer.max_steps=0", "logging.tensorboard=false",
              "logging.progress_bar=false", "logging.log_every=1000", "checkpoint.save_at_end=false",
              "checkpoint.keep_best=0", "scheduler.name=constant", f"data.num_workers={0 if args.dry else 6}",
              "data.max_batch_size=0", f"data.num_buckets={args.buckets}", "data.max_duration=600"]
    if workload == "glmasr":
        import finetune_glmasr as fg

        extra = ["compile.enabled=false", "trainer.param_dtype=fp32", "trainer.precision=fp32"] if args.dry else []
        return ddptrain.load_config(os.path.join(HERE, "..", "configs", "glmasr.yaml"), [
            *common, "data.max_duration=480", f"glmasr.preset={'tiny' if args.dry else 'published'}",
            f"glmasr.synthetic_utterances={args.utterances}", *extra], schema=fg.RecipeConfig)
    return ddptrain.load_config(None, [*common, f"trainer.precision={'fp32' if args.dry else 'bf16'}",
                                       "optim.lr=1e-5", "trainer.clip_grad_norm=1.0"])


def build(args, workload: str, cfg):
    """A fresh ``(model, loss_fn, loader)``; every batch carries host ``stats`` (n, audio_s)."""
    dev = torch.device("cuda", 0) if torch.cuda.is_available() and not args.dry else torch.device("cpu")
    preset = "tiny" if args.dry else "large"
    data = cfg.data
    if workload == "glmasr":
        import bench_glmasr as bg
        import finetune_glmasr as fg
        from models.glmasr import GlmAsrForTraining, load_hf_model

        torch.manual_seed(0)
        with torch.device(dev):
            hf = load_hf_model("", cfg.glmasr.preset, cfg.glmasr.attn_implementation,
                               bg.tiny_tokens() if args.dry else None)
        layout, flops = fg.synthetic_layout(hf.config), bg.GlmAsrFlops(hf)
        loader = fg.build_synthetic_loader(cfg, layout, hf.config.text_config.vocab_size, 1, 0,
                                           hf.config.text_config.max_position_embeddings,
                                           collate_wrapper=lambda c: bg.StatsCollate(c, flops, hf=False))
        return GlmAsrForTraining(hf, cfg.glmasr.freeze_encoder), fg.GlmAsrObjective(layout, None, loader.feature_extractor), loader
    model, loss, flops = workloads.build(workload, preset, {}, dev)
    h = workloads.hf_cfg(workload, preset, {})
    h.synthetic_utterances = args.utterances
    if args.dry:  # short utterances: a CPU step stays cheap
        h.synthetic_median_s, h.synthetic_min_s, h.synthetic_max_s = 1.5, 0.5, 4.0
    wrap = lambda c: workloads.StatsCollate(c, workload, flops)  # noqa: E731
    if workload == "wav2vec2":
        return model, loss, fhm.build_synthetic_loader(h, data, 1, 0, model.config, collate_wrapper=wrap)
    durations = fhm.synthetic_durations(h, data.seed)
    sampler = DurationBucketSampler.from_config(durations, data, True, world_size=1, rank=0)
    collate = wrap(SpeechCollator(mode="features", num_mel_bins=80, pad_to_multiple=1))
    return model, loss, make_loader(workloads.SyntheticFbank(durations, vocab=model.cfg.vocab_size), sampler, collate,
                                    data)


def with_sampler(loader, **changes):
    """The same loader (``make_loader``, of the loader's ``data_config``) over a
    DurationBucketSampler with the same settings except ``changes``."""
    s = loader.batch_sampler
    kw = dict(max_duration=s.max_duration, max_batch_size=s.max_batch_size, quadratic_duration=s.quadratic_duration,
              num_buckets=s.num_buckets, tokens=s.tokens, max_tokens=s.max_tokens, sort_pool=s.sort_pool,
              sync_buckets=s.sync_buckets, shuffle=s.shuffle, tail=s.tail, seed=s.seed, world_size=1, rank=0)
    new = make_loader(loader.dataset, DurationBucketSampler(s.durations, **{**kw, **changes}), loader.collate_fn,
                      loader.data_config)
    new.feature_extractor = loader.feature_extractor
    return new


def cuda_peak() -> float:
    """The allocator's peak so far; host-side bookkeeping, so reading it every step costs no sync."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0.0


def batch_bucket(batch: dict, sampler) -> int | None:
    """The bucket a batch came from, found from its utterance ids (the synthetic corpora's ids are
    dataset indices): the first whose longest input and most tokens reach the batch's."""
    try:
        rows = [int(i) for i in batch.get("ids") or []]
    except (TypeError, ValueError):
        return None
    if not rows:
        return None
    longest = float(sampler.durations[rows].max())
    most = None if sampler.tokens is None else float(sampler.tokens[rows].max())
    tokens = sampler.bucket_max_tokens
    for k, (_, hi) in enumerate(sampler.bucket_edges):
        if hi >= longest and (most is None or tokens[k] >= most):
            return k
    return None


def peak_record(calls, final: float, doc: dict) -> dict:
    """Where training's peak happened: the step, its batch and bucket, what the tuner measured for
    that bucket, and the allocator's reserved peak and retries (cudaFree-and-retry after a miss)."""
    if not torch.cuda.is_available() or not calls:
        return {}
    after = [c[2] for c in calls[1:]] + [final]  # the peak after step 1, 2, ... (read at the next loss call)
    i = next(k for k, peak in enumerate(after) if peak >= final)
    stats, bucket = calls[i][1], calls[i][3]
    mem = torch.cuda.memory_stats()
    return {"peak_step": i + 1, "peak_bucket": bucket,
            "peak_batch": {k: stats[k] for k in ("n", "padded_s", "frames", "length") if k in stats},
            "tuner_peak_gb": None if bucket is None else doc["buckets"][bucket]["peak_gb"],
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / GB,
            "alloc_retries": mem.get("num_alloc_retries", 0),
            "peak_alloc_gb_after_step": [round(p / GB, 3) for p in after]}


def train_epoch(model, loss, cfg, loader, warmup: int, doc: dict) -> dict:
    """One epoch plan; throughput after ``warmup`` steps (host clock at each loss call)."""
    calls = []  # (host clock, batch stats, allocator peak so far, bucket)

    def timed(m, batch):
        calls.append((time.perf_counter(), batch.pop("stats"), cuda_peak(), batch_bucket(batch, loader.batch_sampler)))
        return loss(m, batch)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with ddptrain.Trainer(model, timed, cfg, loader) as trainer:
        trainer.fit()
        stats = loader.batch_sampler.epoch_stats()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    timed_calls = calls[min(warmup, len(calls) - 1):]
    elapsed = end - timed_calls[0][0]
    n = sum(c[1]["n"] for c in timed_calls)
    audio = sum(c[1]["audio_s"] for c in timed_calls)
    return {"steps": len(calls), "epoch_s": round(end - start, 2), "samples_per_s": n / elapsed,
            "audio_s_per_s": audio / elapsed, "padding_frac": stats["padding_fraction"],
            "batch_size_mean": stats["batch_size_mean"], "budget_fill": stats["budget_fill"],
            "peak_alloc_gb": cuda_peak() / GB if torch.cuda.is_available() else None,
            **peak_record(calls, cuda_peak(), doc)}


# ------------------------------------------------------------------------------------ main


def run_workload(args, workload: str, folder: str, emit) -> None:
    """Tune, then train the variants in turns; ``emit(row)`` as each finishes (a command cut off
    by its time limit keeps the rows written so far)."""
    meter = ModuleInputMeter(args.memory_gb * 1.25) if args.dry else None
    start = time.perf_counter()
    try:
        cfg = config(args, workload, os.path.join(folder, "tune"))
        model, loss, loader = build(args, workload, cfg)
        budgets = os.path.join(folder, f"{workload}_budgets.json")
        doc = tune.find_bucket_budgets(model, loss, cfg, loader, args.memory_gb, out=budgets, tolerance=0.0,
                                       meter=meter, say=lambda line: print(workload, line, flush=True))
        del model
        # the best single budget the tuner's measurements allow (all buckets capped: the largest batch)
        hand = doc["single_max_duration"] or max(b["padded_s"] for b in doc["buckets"])
        # in turns, ``--passes`` times: the first pass pays the per-shape costs (cuDNN plans,
        # autotuning) for whichever variant runs first; the last pass compares warm variants
        order = [("hand", {"max_duration": hand}), ("tuned", {"bucket_budgets": budgets})] * args.passes
        for i, (variant, change) in enumerate(order):
            cfg = config(args, workload, os.path.join(folder, variant))
            model, loss, loader = build(args, workload, cfg)
            # peer/world_size/mfu: the results schema's fields (no FLOP model here: mfu is None;
            # batch sizes vary per bucket: batch is the epoch's mean, set after training)
            row = {"workload": workload, "peer": f"ddptrain_{variant}", "world_size": 1, "mfu": None,
                   "variant": variant, "tuned": variant == "tuned",
                   "per_bucket": variant == "tuned", "budget": hand if variant == "hand" else None,
                   "memory_target_gb": doc["memory_target_gb"], "tuning_s": doc["tuning_s"],
                   "bucket_batch_sizes": [b["batch_size"] for b in doc["buckets"]],
                   "bucket_peak_gb": [b["peak_gb"] for b in doc["buckets"]], "base_gb": doc["base_gb"],
                   "pass": i // 2 + 1, "passes": args.passes}
            try:
                loader = with_sampler(loader, **change)
                row["plan_batch_sizes"] = loader.batch_sampler.bucket_batch_sizes
                row.update(train_epoch(model, loss, cfg, loader, args.warmup, doc))
                row["batch"] = row.get("batch_size_mean")
            except Exception as e:  # an OOM (or anything) is a result row, not a lost session
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            del model
            row["wall_s"] = round(time.perf_counter() - start, 1)  # since the workload started (incl. tuning)
            emit(row)
    finally:
        if meter is not None:
            meter.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    parser.add_argument("--memory-gb", type=float, default=None, help="per-step peak target (default 90%% of the GPU)")
    parser.add_argument("--utterances", type=int, default=None, help="corpus size (default 8000; dry: 16)")
    parser.add_argument("--buckets", type=int, default=None, help="data.num_buckets (default 30; dry: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (default 10; dry: 1)")
    parser.add_argument("--passes", type=int, default=2, help="hand and tuned in turns this many times (compare the last)")
    parser.add_argument("--dry", action="store_true", help="CPU: tiny models, a small corpus, a stand-in meter")
    args = parser.parse_args(argv)
    for key, real, dry in (("utterances", 8000, 16), ("buckets", 30, 2), ("warmup", 10, 1)):
        if getattr(args, key) is None:
            setattr(args, key, dry if args.dry else real)
    if args.memory_gb is None:
        args.memory_gb = 0.015 if args.dry else round(0.9 * torch.cuda.get_device_properties(0).total_memory / GB, 1)
    from run import versions

    failed = 0

    def emit(row: dict) -> None:
        nonlocal failed
        row.update(versions(), dry=args.dry, utterances=args.utterances, buckets=args.buckets)
        failed += "error" in row
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        shown = {k: v for k, v in row.items() if not k.endswith(("batch_sizes", "_gb_after_step", "bucket_peak_gb"))}
        print("RESULT", json.dumps(shown), flush=True)

    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload {unknown[0]!r} (known: {', '.join(WORKLOADS)})")
    with tempfile.TemporaryDirectory() as folder:
        for workload in args.workloads.split(","):
            try:
                run_workload(args, workload, os.path.join(folder, workload), emit)
            except Exception as e:  # noqa: BLE001 - recorded, and the exit status says so
                emit({"workload": workload, "error": f"{type(e).__name__}: {str(e)[:500]}"})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
