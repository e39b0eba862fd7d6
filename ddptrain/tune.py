"""Per-bucket batch budgets measured on the GPU, and the Trainer's pre-flight check.

Why: one ``data.max_duration`` for every bucket is set by trial and error, and it is wrong both
ways at once: the longest utterances run out of memory hours into a run while the short buckets
leave the GPU half empty (attention grows with length squared; NeMo's OOMptimizer found 5x larger
batches on Canary-1B this way). The tuner runs, for each bucket of the training sampler, the
costliest batch that bucket can produce (:meth:`DurationBucketSampler.pessimistic_batch`:
B rows of its longest input and, with a second length, its longest target) through one real
training step: the Trainer's own model set-up (device, recompute, compile, bf16 masters), loss,
backward, clipping and optimizer step, at the config's precision. It searches the largest B
whose peak memory (``torch.cuda.max_memory_allocated``) stays under a target and writes a budget
file that ``data.bucket_budgets`` hands to the sampler::

    python -m ddptrain.tune --recipe examples/finetune_asr.py --config configs/asr_gpu.yaml \\
        --out runs/asr/budgets.json                     # memory target: 90% of the GPU
    python examples/finetune_asr.py --config configs/asr_gpu.yaml data.bucket_budgets=runs/asr/budgets.json

The recipe contract (``--recipe FILE.py``): the file defines one :class:`ddptrain.Config`
subclass (its schema) and ``build(cfg)`` (or ``build(cfg, info)``, ``info`` from
``ddptrain.setup_distributed``) returning ``(model, loss_fn, train_loader, ...)``: the pieces its
``main`` trains with. From Python: :func:`find_bucket_budgets`.

The search, per bucket from the longest to the shortest: start from the previous bucket's size
(a shorter bucket fits at least as many rows), grow by linear extrapolation of the measured peak
(activations grow linearly in B), then bisect between the largest size that fitted and the
smallest that did not, until they are within ``tolerance``. Between tries the gradients are
freed and ``torch.cuda.empty_cache`` runs; after an out-of-memory error the exception and its
traceback are dropped first and ``gc`` collects the cycles that still hold the activations. The optimizer state is allocated once, by a warm-up step, and kept:
a real run's forward and backward run with it resident. Every step runs at learning rate 0, so
the weights do not move.

What a single-process measurement leaves out: NCCL's buffers (outside PyTorch's allocator) and
fragmentation over a long run; keep the target below the GPU's size (the 90% default). ZeRO and
sharded masters only lower the per-rank memory of an N-GPU run, so budgets found on one GPU hold.

The pre-flight check (``trainer.preflight``): before the first step, the Trainer runs the
costliest batch of the worst few buckets (``worst``: the largest padded seconds, padded cost,
longest utterance and most tokens) or of every bucket (``all``) once, with learning rate 0, the
optimizer state and BatchNorm statistics restored and the RNG forked, so training afterwards is
the same as without it. An out-of-memory error is raised then, naming the bucket.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib.util
import inspect
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ddptrain import dist
from ddptrain.config import ConfigError
from ddptrain.contract import check_loss_output, to_device
from ddptrain.data.sampler import padded_cost, write_bucket_budgets
from ddptrain.optim import is_zero
from ddptrain.steps import stateful_sampler

GB = 1e9
# The config keys that change the memory of a step; a budget file records them and the Trainer
# refuses a file measured under other values.
MEMORY_KEYS = ("trainer.precision", "trainer.param_dtype", "recompute.enabled", "recompute.module_classes",
               "recompute.name_globs", "recompute.every_k", "compile.enabled", "compile.module_classes",
               "compile.name_globs", "compile.mode", "optim.name", "data.features", "data.feature_device",
               "data.num_mel_bins", "data.pad_to_multiple")


class PreflightError(RuntimeError):
    """The costliest batch of a bucket does not fit on the device; the message names the bucket."""


class TuneError(RuntimeError):
    """The tuner cannot find a budget (a bucket whose single utterance does not fit)."""


@dataclass(frozen=True)
class Bucket:
    """What the search knows of one sampler bucket."""

    index: int
    shortest: float  # seconds (the sampler's durations: cost-seconds for recipes that round them)
    longest: float
    max_tokens: Optional[float]  # most tokens of an utterance, or None without a second length
    cap: int  # the largest batch size worth trying (utterances in the bucket, max_batch_size)

    def describe(self, size: int) -> str:
        tokens = f", up to {self.max_tokens:g} tokens" if self.max_tokens is not None else ""
        return (f"bucket {self.index} (utterances {self.shortest:.2f}-{self.longest:.2f} s{tokens}; batch of "
                f"{size} = {size * self.longest:.1f} padded s)")


def sampler_buckets(sampler) -> list[Bucket]:
    """The sampler's buckets, as the search and the pre-flight check see them."""
    tokens, cap = sampler.bucket_max_tokens, sampler.max_batch_size
    return [Bucket(k, lo, hi, None if tokens is None else tokens[k], min(n, cap) if cap else n)
            for k, ((lo, hi), n) in enumerate(zip(sampler.bucket_edges, sampler.bucket_utterances))]


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


class CudaMemory:
    """Peak memory of a step on a CUDA device (``torch.cuda.max_memory_allocated``)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> float:
        torch.cuda.synchronize(self.device)
        return float(torch.cuda.max_memory_allocated(self.device))

    def current(self) -> float:
        return float(torch.cuda.memory_allocated(self.device))

    def capacity(self) -> float:
        return float(torch.cuda.get_device_properties(self.device).total_memory)

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)


def default_meter(device: torch.device) -> CudaMemory:
    """The memory measurement of ``device``.

    Raises:
        ConfigError: not a CUDA device.
    """
    if device.type != "cuda":
        raise ConfigError(f"measuring memory needs a CUDA device (the Trainer chose {device})")
    return CudaMemory(device)


def is_oom(error: BaseException) -> bool:
    """An out-of-memory error, also when wrapped (the Trainer re-raises loss_fn errors)."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _release(trainer, collect: bool = True) -> None:
    """Free what a step left behind: gradients, cached blocks and (``collect``: after a failure,
    whose traceback cycles hold the activations) garbage."""
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.master is not None:
        trainer.master.zero_model_grads()
    if trainer.precision.scaler.is_enabled():  # a failed step may have left the scaler mid-step
        state = trainer.precision.scaler.state_dict()
        trainer.precision.scaler = torch.amp.GradScaler(trainer.device.type, enabled=True)
        trainer.precision.scaler.load_state_dict(state)
    if collect:
        gc.collect()
    if trainer.device.type == "cuda":
        torch.cuda.empty_cache()


def train_once(trainer, batch: Any, where: str, update: bool = True) -> Optional[str]:
    """One forward + backward + optimizer update through the Trainer's pieces (DDP, autocast,
    masters, ZeRO, clipping), without touching its progress, schedule or guard.

    Collective on several ranks: the forward and backward run on the module without its DDP
    wrapper (no buffer broadcast or gradient all-reduce a failed rank would leave waiting; its
    gradients then take one extra copy of memory, an overestimate), and the ranks agree on an
    out-of-memory error before the update's all-reduce. (An error inside ZeRO's step, between its
    broadcasts, is left to ``dist.timeout_s``.)

    Args:
        update: False: forward and backward only (the gradients are then freed).

    Returns:
        None, or the out-of-memory message (this or another rank's).

    Raises:
        Exception: any other error of the step.
    """
    failed = None
    model = trainer.module if trainer.info.distributed else trainer.model
    model.train()
    try:
        batch = to_device(batch, trainer.device)
        with trainer.precision.autocast():
            loss_sum, units = check_loss_output(trainer.loss_fn(model, batch), where)
        trainer.precision.scale(loss_sum.float()).backward()
    except Exception as e:  # only an OOM is an answer, anything else is raised
        if not is_oom(e):
            raise
        failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    batch = None
    if dist.any_rank(failed is not None, trainer.device):
        return failed or "out of memory on another rank"
    if not update:
        return None
    f64 = dict(dtype=torch.float64, device=trainer.device)
    tensor_units = isinstance(units, torch.Tensor)
    units_dev = units.detach().to(**f64).reshape(()) if tensor_units else torch.zeros((), **f64)
    try:
        trainer.update(loss_sum.detach().double(), units_dev, 0.0 if tensor_units else float(units),
                       torch.zeros((), **f64), False, 1.0)
    except Exception as e:
        if not is_oom(e):
            raise
        failed = f"{type(e).__name__} in the optimizer step: {str(e).splitlines()[0][:300]}"
    if dist.any_rank(failed is not None, trainer.device):
        return failed or "out of memory on another rank"
    return None


@contextlib.contextmanager
def _lr_zero(optimizer):
    """Steps that measure, not train: every parameter group at learning rate 0."""
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


def _optimizer_states(optimizer) -> dict:
    return (optimizer.optim if is_zero(optimizer) else optimizer).state


def loader_batches(loader) -> Callable[[list], Any]:
    """``rows -> batch`` through the loader's own dataset and collate function; speed
    perturbation draws its slowest factor, the length the sampler budgeted for.

    Raises:
        ConfigError: ``loader`` has no dataset and collate function (a bare sampler: pass
            ``make_batch``).
    """
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if dataset is None or collate is None:
        raise ConfigError(f"{type(loader).__name__} has no dataset and collate_fn to build batches from: "
                          "pass make_batch (dataset indices -> batch)")

    def make(rows: list) -> Any:
        speeds = getattr(dataset, "speeds", None)
        if speeds:
            dataset.speeds = [min(speeds)]
        try:
            items = {i: dataset[i] for i in sorted(set(rows))}
        finally:
            if speeds:
                dataset.speeds = speeds
        return collate([dict(items[i]) if isinstance(items[i], dict) else items[i] for i in rows])

    return make


def _bucket_sampler(data):
    sampler = stateful_sampler(data) if hasattr(data, "batch_sampler") else data
    if not hasattr(sampler, "pessimistic_batch"):
        raise ConfigError("needs a DurationBucketSampler (the training DataLoader's batch_sampler): it builds "
                          f"each bucket's costliest batch; got {type(sampler).__name__}")
    return sampler


def memory_settings(config, module: torch.nn.Module) -> dict:
    """What a budget file records of the set-up it was measured under (see ``MEMORY_KEYS``)."""
    out = {}
    for key in MEMORY_KEYS:
        section, leaf = key.split(".")
        value = getattr(getattr(config, section), leaf)
        out[key] = list(value) if isinstance(value, (list, tuple)) else value
    out["num_parameters"] = sum(p.numel() for p in module.parameters())
    out["num_trainable"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return out


def _tuning_config(config, folder: str):
    cfg = copy.deepcopy(config)
    cfg.trainer = dataclasses.replace(cfg.trainer, output_dir=folder, preflight="none", preempt_signals=[])
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, resume="none", keep_best=0, min_free_gb=0.0)
    cfg.logging = dataclasses.replace(cfg.logging, tensorboard=False, jsonl=False, progress_bar=False)
    return cfg


def find_bucket_budgets(model: torch.nn.Module, loss_fn, config, loader_or_sampler, memory_target_gb: Optional[float],
                        out: Optional[str] = None, tolerance: float = 0.02, make_batch=None, meter=None,
                        say: Callable[[str], None] = print) -> dict:
    """Measure the largest batch per bucket that stays under ``memory_target_gb``; write the file.

    Args:
        model: the model as the recipe builds it; prepared in place the way the Trainer does
            (device, recompute, compile, bf16), so build a fresh one to train. Its weights do
            not change (every step runs at learning rate 0).
        loss_fn: the recipe's ``loss_fn(model, batch) -> (loss_sum, units)``.
        config: the training config (precision, recompute, compile, optimizer, ...).
        loader_or_sampler: the training DataLoader (its batch_sampler a DurationBucketSampler),
            or the sampler itself together with ``make_batch``.
        memory_target_gb: the most a step may peak at, in GB (1e9 bytes); None: 90% of the device.
        out: the budget file to write (None: only return it).
        tolerance: stop a bucket's search within this fraction of the largest fitting size.
        make_batch: ``dataset indices -> batch``; default :func:`loader_batches` of the loader.
        meter: memory measurement with ``reset/peak/current/capacity/name`` (default
            :func:`default_meter`; inject one to run the search on a CPU).
        say: progress lines.

    Returns:
        The budget file's content (see ``write_bucket_budgets``).

    Raises:
        ConfigError: no DurationBucketSampler, no CUDA device and no ``meter``, or a process group
            of several ranks (tune in one process).
        TuneError: a bucket whose single utterance does not fit.
    """
    from ddptrain.trainer import Trainer

    sampler = _bucket_sampler(loader_or_sampler)
    make_batch = make_batch or loader_batches(loader_or_sampler)
    if dist.get_world_size() > 1:
        raise ConfigError("run the tuner in one process (python, not torchrun): its budgets hold per rank")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder, \
            Trainer(model, loss_fn, _tuning_config(config, folder), loader_or_sampler) as trainer:
        meter = meter or default_meter(trainer.device)
        memory_target_gb = memory_target_gb or round(0.9 * meter.capacity() / GB, 1)
        buckets = sorted(sampler_buckets(sampler), key=lambda b: (-b.longest, -(b.max_tokens or 0), b.index))

        def try_batch(b: Bucket, size: int) -> Optional[float]:
            batch = make_batch(sampler.pessimistic_batch(b.index, size))
            meter.reset()
            failed = train_once(trainer, batch, f"tuning {b.describe(size)}")
            peak = meter.peak()
            batch = None
            _release(trainer, collect=failed is not None)
            return None if failed else peak

        with _lr_zero(trainer.optimizer):
            shortest = buckets[-1]
            if try_batch(shortest, 1) is None:  # allocates the optimizer state, as in a running job
                raise TuneError(f"the warm-up step ({shortest.describe(1)}) ran out of memory")
            base = meter.current()
            say(f"tuning {len(buckets)} buckets on {meter.name()}: target {memory_target_gb:.3g} GB of "
                f"{meter.capacity() / GB:.3g}; {base / GB:.3g} GB at rest (weights, optimizer state)")
            found = search_batch_sizes(buckets, try_batch, memory_target_gb * GB, base, tolerance, say)
        settings = memory_settings(config, trainer.module)
    found.sort(key=lambda r: r["bucket"])
    q = sampler.quadratic_duration
    info = [{"peak_gb": r["peak_gb"], "capped": r["capped"], "tries": r["tries"],
             "budget": round(r["batch_size"] * float(padded_cost(b.longest, q)), 3)}
            for r, b in zip(found, sampler_buckets(sampler))]
    doc = dict(memory_target_gb=memory_target_gb, device=meter.name(), capacity_gb=round(meter.capacity() / GB, 2),
               base_gb=round(base / GB, 3), tolerance=tolerance, tuning_s=round(time.perf_counter() - start, 1),
               settings=settings, date=time.strftime("%Y-%m-%d"))
    return write_bucket_budgets(out, sampler, [r["batch_size"] for r in found], info, **doc)


# ----------------------------------------------------------------------------- the Trainer's checks


def before_fit(trainer) -> None:
    """The Trainer's checks before its first step (called at the start of ``fit``).

    The budget file the training sampler uses (``data.bucket_budgets``) is the one configured
    and was measured under this run's memory settings; then ``trainer.preflight``.

    Raises:
        ConfigError: ``data.bucket_budgets`` set but not used by the training sampler (a recipe
            that builds its own sampler must pass it on), or measured under other settings.
        PreflightError: a bucket's costliest batch ran out of memory (see :func:`preflight`).
    """
    cfg = trainer.cfg
    want = getattr(getattr(cfg, "data", None), "bucket_budgets", "")
    path = getattr(stateful_sampler(trainer.train_data), "bucket_budgets", None)
    if want and (not path or os.path.abspath(path) != os.path.abspath(want)):
        raise ConfigError(f"data.bucket_budgets={want!r}, but the training sampler uses {path!r}: a recipe that "
                          "builds its own DurationBucketSampler must pass bucket_budgets=cfg.data.bucket_budgets")
    if path:
        check_budget_settings(path, cfg, trainer.module)
    if cfg.trainer.preflight != "none":
        preflight(trainer, cfg.trainer.preflight)


def check_budget_settings(path: str, config, module: torch.nn.Module) -> None:
    """Raises ConfigError if budget file ``path`` was measured under other memory settings or
    another model size than ``config`` and ``module`` (a file without settings is trusted)."""
    with open(path) as f:
        saved = json.load(f).get("settings") or {}
    now = memory_settings(config, module)
    diff = [f"{k}: measured {saved[k]!r}, now {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if diff:
        raise ConfigError(f"{path} (data.bucket_budgets) was measured under another set-up, so its batch sizes "
                          f"may not fit: {'; '.join(diff)}. Re-run python -m ddptrain.tune with this config")


def _worst_buckets(sampler) -> list[int]:
    """The buckets whose costliest batch is the largest by padded seconds, padded cost, longest
    utterance and most tokens (in that order, without repeats)."""
    edges, sizes, tokens = sampler.bucket_edges, sampler.bucket_batch_sizes, sampler.bucket_max_tokens
    q = sampler.quadratic_duration
    keys = [lambda k: sizes[k] * edges[k][1], lambda k: sizes[k] * float(padded_cost(edges[k][1], q)),
            lambda k: edges[k][1]] + ([lambda k: sizes[k] * tokens[k]] if tokens is not None else [])
    chosen: list[int] = []
    for key in keys:
        k = max(range(len(edges)), key=lambda k: (key(k), k))
        chosen += [k] if k not in chosen else []
    return chosen


def preflight(trainer, mode: str = "worst") -> list[dict]:
    """Run the costliest batch of the worst buckets (``worst``) or of every bucket (``all``) once.

    The step is a real one (forward, backward and, before the optimizer has any state, the
    optimizer step that allocates it) at learning rate 0; afterwards the optimizer state, the
    model's buffers (BatchNorm statistics), the loss scale and the random streams are as before,
    so the run trains exactly as without the check. Collective: every rank runs the same batches.

    Returns:
        One dict per bucket run: ``bucket``, ``batch_size``, ``peak_gb`` (None off CUDA).

    Raises:
        ConfigError: the training loader has no DurationBucketSampler.
        PreflightError: a batch ran out of memory; the message names the bucket (its lengths,
            batch size) and the memory.
    """
    try:
        sampler = _bucket_sampler(trainer.train_data)
    except ConfigError as e:
        raise ConfigError(f"trainer.preflight={mode}: {e}") from None
    make = loader_batches(trainer.train_data)
    buckets, sizes = sampler_buckets(sampler), sampler.bucket_batch_sizes
    chosen = sorted(range(len(buckets)), key=lambda k: -buckets[k].longest) if mode == "all" else _worst_buckets(sampler)
    meter = CudaMemory(trainer.device) if trainer.device.type == "cuda" else None
    states = _optimizer_states(trainer.optimizer)
    fresh = not any(states.values())  # a resumed optimizer's state is not touched: no update step
    buffers = [(b, b.detach().clone()) for b in trainer.module.buffers()]
    scale = trainer.precision.state_dict()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    cuda = [trainer.device.index if trainer.device.index is not None else torch.cuda.current_device()] if meter else []
    results = []
    try:
        with torch.random.fork_rng(devices=cuda), _lr_zero(trainer.optimizer):
            for k in chosen:
                b, size = buckets[k], sizes[k]
                batch = make(sampler.pessimistic_batch(k))
                if meter:
                    meter.reset()
                failed = train_once(trainer, batch, f"pre-flight {b.describe(size)}", update=fresh)
                batch = None
                peak = meter.peak() / GB if meter else None
                _release(trainer, collect=failed is not None)
                if failed:
                    memory = f" (peak {peak:.1f} GB of {meter.capacity() / GB:.1f} GB)" if meter else ""
                    raise PreflightError(
                        f"pre-flight check: the costliest batch of {b.describe(size)} does not fit{memory}: {failed}. "
                        f"Lower data.max_duration (or this bucket's batch_size in data.bucket_budgets), turn on "
                        f"recompute, or measure per-bucket budgets: python -m ddptrain.tune")
                results.append({"bucket": k, "batch_size": size, "peak_gb": None if peak is None else round(peak, 3)})
                trainer.logger.print(f"pre-flight: {b.describe(size)} fits" + (
                    f": peak {peak:.1f} GB of {meter.capacity() / GB:.1f} GB" if meter else ""))
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        if fresh:
            states.clear()
        trainer.precision.load_state_dict(scale)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        _release(trainer, collect=False)
    return results


# ----------------------------------------------------------------------------- command line


def load_recipe(path: str):
    """``(module, schema, build)`` of a recipe file (see the module docstring).

    Raises:
        ConfigError: no such file, no ``build`` function, or not exactly one Config subclass.
    """
    from ddptrain.config import Config

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
    import ddptrain

    parser = argparse.ArgumentParser(prog="python -m ddptrain.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="recipe file with build(cfg) (see above)")
    parser.add_argument("--config", help="the training YAML config; key=value overrides follow")
    parser.add_argument("--out", required=True, help="budget file to write (then train with data.bucket_budgets=OUT)")
    parser.add_argument("--memory-gb", type=float, default=None, help="peak memory target per step (default 90%% of the GPU)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="search precision, a fraction of the batch size")
    args, overrides = parser.parse_known_args(argv)
    _, schema, build = load_recipe(args.recipe)
    cfg = ddptrain.load_config(args.config, overrides, schema=schema)
    info = ddptrain.setup_distributed(cfg)
    if info.world_size > 1:
        raise ConfigError("run the tuner in one process (python, not torchrun): its budgets hold per rank")
    built = build(cfg, info) if len(inspect.signature(build).parameters) >= 2 else build(cfg)
    model, loss_fn, loader = built[:3]
    doc = find_bucket_budgets(model, loss_fn, cfg, loader, args.memory_gb, out=args.out, tolerance=args.tolerance)
    print(f"{'bucket':>6} {'seconds':>13} {'batch':>6} {'padded s':>9} {'peak GB':>8}")
    for b in doc["buckets"]:
        print(f"{b['bucket']:>6} {b['shortest_s']:>6.2f}-{b['longest_s']:<6.2f} {b['batch_size']:>6} "
              f"{b['padded_s']:>9.1f} {b['peak_gb'] if b['peak_gb'] is not None else '-':>8}")
    print(f"wrote {args.out} in {doc['tuning_s']} s; train with data.bucket_budgets={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
