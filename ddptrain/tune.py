"""The largest ``data.max_duration`` that fits on the GPU, measured by one real step per bucket.

Why: ``data.max_duration`` set by trial and error is wrong both ways at once: too high, the
longest utterances run out of memory hours into a run; too low, the GPU is half empty. The
tuner runs, for each bucket of the training sampler, the costliest batch that bucket can produce
(:meth:`DurationBucketSampler.pessimistic_batch`: B rows of its longest input and, with a second
length, its longest target, padded as training's batches are, so a model takes its masked path
as it does in training) through one real training step: the Trainer's own model set-up
(:func:`ddptrain.prepare.prepare_model`: device, recompute, compile, bf16 masters) and step
(:func:`ddptrain.steps.forward_backward`: loss, backward; then clipping and the optimizer step),
at the config's precision, with no Trainer and nothing written to disk. It searches the largest B per bucket whose peak memory
(``torch.cuda.max_memory_allocated``) stays under a target, and prints the largest single
``data.max_duration`` under which every bucket's batch stays at or below its measured size
(about a minute on one H200 for wav2vec2-large, the Conformer and GLM-ASR)::

    python -m ddptrain.tune --recipe examples/finetune_asr.py --config configs/asr_gpu.yaml
        # memory target: 90% of the GPU; prints e.g. "train with: data.max_duration=412.3"
    python examples/finetune_asr.py --config configs/asr_gpu.yaml data.max_duration=412.3

(Per-bucket batch sizes written to a file trained no faster than that one number on the three
models measured, within 2%: their memory is close to linear in padded seconds.)

The recipe contract (``--recipe FILE.py``): the file defines one :class:`ddptrain.Config`
subclass (its schema) and ``build(cfg)`` (or ``build(cfg, info)``, ``info`` from
``ddptrain.setup_distributed``) returning ``(model, loss_fn, train_loader, ...)``: the pieces its
``main`` trains with. From Python: :func:`find_max_duration`.

The search, per bucket from the longest to the shortest: start from the previous bucket's size
(a shorter bucket fits at least as many rows), grow by linear extrapolation of the measured peak
(activations grow linearly in B), then bisect between the largest size that fitted and the
smallest that did not, until they are within ``tolerance``. Between tries the gradients are
freed and ``torch.cuda.empty_cache`` runs; after an out-of-memory error the exception and its
traceback are dropped first and ``gc`` collects the cycles that still hold the activations.
The optimizer state is allocated once, by a warm-up step, and kept: a real run's forward and
backward run with it resident. Every step runs at learning rate 0, so
the weights do not move.

What a single-process measurement leaves out: NCCL's buffers (outside PyTorch's allocator) and
fragmentation over a long run; keep the target below the GPU's size (the 90% default). ZeRO and
sharded masters only lower the per-rank memory of an N-GPU run, so a budget found on one GPU holds.

The pre-flight check (``trainer.preflight``) and the pieces the tuner shares with it (one
training step at learning rate 0, the sampler's buckets, memory measurement) are in
ddptrain/preflight.py, which the Trainer imports without this command line.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import os
import sys
import time
from typing import Callable, Optional, Sequence

import torch

from ddptrain import dist
from ddptrain.config import Config, ConfigError, check_config, cli_prog, load_config
from ddptrain.data.sampler import padded_cost
from ddptrain.preflight import (GB, Bucket, CudaMemory, PreflightError, before_fit, bucket_sampler, device_meter,
                                is_oom, loader_batches, lr_zero, preflight, release, sampler_buckets, train_once)
from ddptrain.prepare import prepare_model, prepare_step

# the tuner's own names, and the pre-flight check's (importable from here as before preflight.py)
__all__ = ["TuneError", "search_batch_sizes", "default_meter", "find_max_duration", "single_max_duration",
           "load_recipe", "main", "GB", "Bucket", "CudaMemory", "PreflightError", "before_fit", "is_oom",
           "loader_batches", "preflight", "sampler_buckets", "train_once"]


class TuneError(RuntimeError):
    """The tuner cannot find a budget (a bucket whose single utterance does not fit)."""


# ----------------------------------------------------------------------------- the search


def search_batch_sizes(buckets: Sequence[Bucket], try_batch: Callable[[Bucket, int], Optional[float]],
                       target_bytes: float, base_bytes: float = 0.0, tolerance: float = 0.02,
                       say: Callable[[str], None] = lambda line: None) -> list[dict]:
    """The largest batch size per bucket whose step peaks at or under ``target_bytes``.

    Deterministic given ``try_batch``; assumes memory grows with the batch size.

    Args:
        buckets: the buckets, searched in this order (longest first: each result is the next
            bucket's starting point).
        try_batch: ``(bucket, size) -> peak bytes``, or None when the step ran out of memory.
        target_bytes: the most a step may peak at.
        base_bytes: memory in use between steps (weights, optimizer state), for extrapolating.
        tolerance: stop when the largest fitting size is within this fraction of the smallest
            failing one (0 = exact).
        say: where to report each bucket's result.

    Returns:
        One dict per bucket, in the order given: ``bucket``, ``batch_size``, ``peak_gb`` (of the
        chosen size), ``capped`` (the bucket's cap was reached), ``tries`` ([size, peak GB or
        "oom" or "over"]).

    Raises:
        TuneError: a bucket where one utterance alone does not fit (naming it).
    """
    results, hint = [], 1
    for b in buckets:
        lo, hi, lo_peak, tries = 0, b.cap + 1, None, []  # lo fits, hi does not (cap + 1: never tried)
        guess = min(max(hint, 1), b.cap)
        while hi - lo > 1 and not (lo and hi <= b.cap and hi - 1 - lo <= tolerance * lo):
            size = min(max(guess, lo + 1), hi - 1)
            peak = try_batch(b, size)
            fits = peak is not None and peak <= target_bytes
            tries.append([size, "oom" if peak is None else round(peak / GB, 3) if fits else "over"])
            if fits:
                lo, lo_peak = size, peak
                if hi > b.cap:  # no failure yet: extrapolate linearly from the base, at most 4x
                    rows = (peak - base_bytes) / size
                    est = int((target_bytes - base_bytes) // rows) if rows > 0 else 4 * size
                    guess = min(max(est, size + 1), 4 * size)
                else:
                    guess = (lo + hi) // 2
            else:
                hi = size
                guess = (lo + hi) // 2
        if lo == 0:
            reason = tries[-1][1] if tries else "?"
            raise TuneError(f"{b.describe(1)}: one utterance alone {'runs out of memory' if reason == 'oom' else 'peaks over the target'} "
                            f"({target_bytes / GB:.3g} GB); drop longer utterances (data.max_utterance_duration), "
                            f"turn on recompute, or raise the memory target")
        results.append({"bucket": b.index, "batch_size": lo, "peak_gb": round(lo_peak / GB, 3) if lo_peak else None,
                        "capped": lo == b.cap, "tries": tries})
        say(f"{b.describe(lo)}: peak {results[-1]['peak_gb']} GB{' (cap)' if lo == b.cap else ''}, "
            f"{len(tries)} tries")
        hint = lo
    return results


# ----------------------------------------------------------------------------- measuring


def default_meter(device: torch.device) -> CudaMemory:
    """The memory measurement of ``device``.

    Raises:
        ConfigError: not a CUDA device.
    """
    meter = device_meter(device)
    if meter is None:
        raise ConfigError(f"measuring memory needs a CUDA device (the Trainer chose {device})")
    return meter


def find_max_duration(model: torch.nn.Module, loss_fn, config, loader_or_sampler, memory_target_gb: Optional[float],
                      tolerance: float = 0.02, make_batch=None, meter=None,
                      say: Callable[[str], None] = print) -> dict:
    """Measure the largest batch per bucket that stays under ``memory_target_gb``, and from
    those the largest single ``data.max_duration`` (:func:`single_max_duration`).

    Args:
        model: the model as the recipe builds it; prepared in place the way the Trainer does
            (device, recompute, compile, bf16), so build a fresh one to train. Its weights do
            not change (every step runs at learning rate 0).
        loss_fn: the recipe's ``loss_fn(model, batch) -> (loss_sum, units)``.
        config: the training config (precision, recompute, compile, optimizer, ...).
        loader_or_sampler: the training DataLoader (its batch_sampler a DurationBucketSampler),
            or the sampler itself together with ``make_batch``.
        memory_target_gb: the most a step may peak at, in GB (1e9 bytes); None: 90% of the device.
        tolerance: stop a bucket's search within this fraction of the largest fitting size.
        make_batch: ``dataset indices -> batch``; default :func:`loader_batches` of the loader.
        meter: memory measurement with ``reset/peak/current/capacity/name`` (default
            :func:`default_meter`; inject one to run the search on a CPU).
        say: progress lines.

    Returns:
        ``max_duration`` (the number to train with), how it was measured (``memory_target_gb``,
        ``device``, ``capacity_gb``, ``base_gb``, ``tolerance``, ``tuning_s``) and ``buckets``:
        per bucket ``bucket``, ``shortest_s``, ``longest_s``, ``batch_size`` (the largest that
        fitted), ``padded_s``, ``peak_gb``, ``capped``, ``tries`` (see :func:`search_batch_sizes`).

    Raises:
        ConfigError: no DurationBucketSampler, no CUDA device and no ``meter``, or a process group
            of several ranks (tune in one process).
        TuneError: a bucket whose single utterance does not fit.
    """
    sampler = bucket_sampler(loader_or_sampler)
    make_batch = make_batch or loader_batches(loader_or_sampler)
    if dist.get_world_size() > 1:
        raise ConfigError("run the tuner in one process (python, not torchrun): its budgets hold per rank")
    start = time.perf_counter()
    config = check_config(config)  # a Config built in Python gets load_config's checks too
    info = dist.setup_for(config)  # the device, its memory cap and allocator settings, as the Trainer's
    meter = meter or default_meter(info.device)
    torch.use_deterministic_algorithms(config.trainer.deterministic)  # its kernels are training's
    step = prepare_step(prepare_model(model, config, info), loss_fn, config, info)
    memory_target_gb = memory_target_gb or round(0.9 * meter.capacity() / GB, 1)
    buckets = sorted(sampler_buckets(sampler), key=lambda b: (-b.longest, -(b.max_tokens or 0), b.index))

    def try_batch(b: Bucket, size: int) -> Optional[float]:
        batch = make_batch(sampler.pessimistic_batch(b.index, size))
        meter.reset()
        failed = train_once(step, batch, f"tuning {b.describe(size)}")
        peak = meter.peak()
        batch = None
        release(step, collect=failed is not None)
        return None if failed else peak

    with lr_zero(step.optimizer):
        shortest = buckets[-1]
        if try_batch(shortest, 1) is None:  # allocates the optimizer state, as in a running job
            raise TuneError(f"the warm-up step ({shortest.describe(1)}) ran out of memory")
        base = meter.current()
        say(f"tuning {len(buckets)} buckets on {meter.name()}: target {memory_target_gb:.3g} GB of "
            f"{meter.capacity() / GB:.3g}; {base / GB:.3g} GB at rest (weights, optimizer state)")
        found = search_batch_sizes(buckets, try_batch, memory_target_gb * GB, base, tolerance, say)
    found.sort(key=lambda r: r["bucket"])
    single = single_max_duration(sampler, found)
    if single is None:  # every bucket reached its cap: the budget that gives each its cap
        q = sampler.quadratic_duration
        single = max(r["batch_size"] * float(padded_cost(b.longest, q)) for r, b in zip(found, sampler_buckets(sampler)))
    rows = [{"bucket": b.index, "shortest_s": round(b.shortest, 4), "longest_s": round(b.longest, 4),
             "batch_size": r["batch_size"], "padded_s": round(r["batch_size"] * b.longest, 3), "peak_gb": r["peak_gb"],
             "capped": r["capped"], "tries": r["tries"]} for r, b in zip(found, sampler_buckets(sampler))]
    return dict(max_duration=single, memory_target_gb=memory_target_gb, device=meter.name(),
                capacity_gb=round(meter.capacity() / GB, 2), base_gb=round(base / GB, 3), tolerance=tolerance,
                tuning_s=round(time.perf_counter() - start, 1), buckets=rows)


def single_max_duration(sampler, found: Sequence[dict]) -> Optional[float]:
    """The largest one ``data.max_duration`` under which every bucket's costliest batch still
    fits: with one budget M, bucket b takes floor(M / cost_b) rows (cost_b: the padded cost of
    its longest utterance), which fits while that is at most its measured size B_b; so M* = min
    over b of (B_b + 1) x cost_b, minus a hair. Buckets whose search stopped at a cap (their
    utterance count, ``data.max_batch_size``) do not bind; None if every bucket did.

    Where memory grows linearly with padded seconds, M* is as good as per-bucket batch sizes
    (every bucket's limit is the same padded seconds).
    """
    q = sampler.quadratic_duration
    bounds = [(r["batch_size"] + 1) * float(padded_cost(b.longest, q))
              for r, b in zip(found, sampler_buckets(sampler)) if not r["capped"]]
    return math.nextafter(min(bounds), 0.0) if bounds else None


# ----------------------------------------------------------------------------- command line


def load_recipe(path: str):
    """``(module, schema, build)`` of a recipe file (see the module docstring).

    Raises:
        ConfigError: no such file, no ``build`` function, or not exactly one Config subclass.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"--recipe {path}: no such file")
    name = os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(name)  # imported already (as ``import NAME`` would): the same classes
    if module is None or os.path.abspath(getattr(module, "__file__", "") or "") != os.path.abspath(path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclass type hints resolve through sys.modules
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    schemas = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Config)
               and v.__module__ == module.__name__]
    build = getattr(module, "build", None)
    if not callable(build):
        raise ConfigError(f"--recipe {path}: defines no build(cfg) function returning (model, loss_fn, train_loader)")
    if len(schemas) != 1:
        raise ConfigError(f"--recipe {path}: needs exactly one ddptrain.Config subclass (its config schema), "
                          f"found {[s.__name__ for s in schemas]}")
    return module, schemas[0], build


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=cli_prog("ddptrain.tune"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="recipe file with build(cfg) (see above)")
    parser.add_argument("--config", help="the training YAML config; key=value overrides follow")
    parser.add_argument("--memory-gb", type=float, default=None, help="peak memory target per step (default 90%% of the GPU)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="search precision, a fraction of the batch size")
    args, overrides = parser.parse_known_args(argv)
    _, schema, build = load_recipe(args.recipe)
    cfg = load_config(args.config, overrides, schema=schema)
    info = dist.setup_for(cfg)  # as ddptrain.setup_distributed
    if info.world_size > 1:
        raise ConfigError("run the tuner in one process (python, not torchrun): its budgets hold per rank")
    built = build(cfg, info) if len(inspect.signature(build).parameters) >= 2 else build(cfg)
    model, loss_fn, loader = built[:3]
    doc = find_max_duration(model, loss_fn, cfg, loader, args.memory_gb, tolerance=args.tolerance)
    print(f"{'bucket':>6} {'seconds':>13} {'batch':>6} {'padded s':>9} {'peak GB':>8}")
    for b in doc["buckets"]:
        print(f"{b['bucket']:>6} {b['shortest_s']:>6.2f}-{b['longest_s']:<6.2f} {b['batch_size']:>6} "
              f"{b['padded_s']:>9.1f} {b['peak_gb'] if b['peak_gb'] is not None else '-':>8}")
    best = math.floor(doc["max_duration"] * 10) / 10  # rounded down: still at or under every bucket's size
    print(f"the largest data.max_duration that fits every bucket under {doc['memory_target_gb']:g} GB on "
          f"{doc['device']}: {best} (measured in {doc['tuning_s']} s)")
    print(f"train with: data.max_duration={best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
