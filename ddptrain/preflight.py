"""The Trainer's checks before its first step, and the one-step measurement the tuner shares.

The pre-flight check (``trainer.preflight``): before the first step, the Trainer runs the
costliest batch of the worst few buckets (``worst``: the largest padded seconds, padded cost,
longest utterance and most tokens) or of every bucket (``all``) once, with learning rate 0, the
optimizer state and BatchNorm statistics restored and the RNG forked, so training afterwards is
the same as without it. An out-of-memory error is raised then, naming the bucket.

What is here and not in tune.py: what the Trainer runs itself (:func:`before_fit`, then
:func:`preflight`), and the pieces both use -- :func:`train_once` (one real step, through
:func:`ddptrain.steps.forward_backward` as the loop's), the sampler's buckets as :class:`Bucket`,
memory measurement. Both see a training set-up only as a :class:`ddptrain.prepare.OneStep` (the
model, loss_fn, optimizer, precision, update and device) and the training loader; tune.py (the
search for the largest ``data.max_duration``, ``python -m ddptrain.tune``) builds that OneStep
itself, so the Trainer imports this module and not the tuner's command line.
"""

from __future__ import annotations

import contextlib
import gc
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from ddptrain import dist
from ddptrain.config import ConfigError
from ddptrain.contract import to_device
from ddptrain.data.sampler import padded_cost
from ddptrain.optim import is_zero
from ddptrain.steps import StepSums, forward_backward, stateful_sampler

GB = 1e9


class PreflightError(RuntimeError):
    """The costliest batch of a bucket does not fit on the device; the message names the bucket."""


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
        """The memory this process may use: the GPU's, or ``trainer.gpu_memory_gb``'s cap of it."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        return float(total * torch.cuda.get_per_process_memory_fraction(self.device))

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)


def device_meter(device: torch.device) -> Optional[CudaMemory]:
    """The memory measurement of ``device``; None off CUDA (there is nothing to measure)."""
    return CudaMemory(device) if device.type == "cuda" else None


def is_oom(error: BaseException) -> bool:
    """An out-of-memory error, also when wrapped (the Trainer re-raises loss_fn errors)."""
    return _oom_in(error) is not None


def _oom_in(error: BaseException) -> Optional[BaseException]:
    """The out-of-memory error in ``error``'s chain of causes (the innermost one: its own words)."""
    found, seen = None, 0
    while error is not None and seen < 10:
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            found = error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return found


def release(step, collect: bool = True) -> None:
    """Free what a step of ``step`` (a :class:`ddptrain.prepare.OneStep`) left behind: gradients,
    a failed step's scaler state, cached blocks and (``collect``: after a failure, whose
    traceback cycles hold the activations) garbage."""
    step.optimizer.zero_grad(set_to_none=True)  # the masters' gradients, if any
    step.model.zero_grad(set_to_none=True)
    step.update.backend.drop_grads()  # the masters' own; offload: also what a failed backward had sent to the host
    step.precision.reset_scaler()  # a failed step may have left the scaler mid-step
    if collect:
        gc.collect()
    if step.device.type == "cuda":
        torch.cuda.empty_cache()


def train_once(step, batch: Any, where: str, update: bool = True) -> Optional[str]:
    """One forward + backward (:func:`ddptrain.steps.forward_backward`, the loop's own) and
    optimizer update (masters, ZeRO, clipping) of ``step`` (a :class:`ddptrain.prepare.OneStep`).

    Collective on several ranks: ``step.model`` is the module without its DDP wrapper (no buffer
    broadcast or gradient all-reduce a failed rank would leave waiting; its gradients then take
    one extra copy of memory, an overestimate), and the ranks agree on an out-of-memory error
    before the update's all-reduce. (An error inside ZeRO's step, between its broadcasts, is left
    to ``dist.timeout_s``.)

    Args:
        update: False: forward and backward only (the gradients are then freed).

    Returns:
        None, or the out-of-memory message (this or another rank's).

    Raises:
        Exception: any other error of the step.
    """
    failed, sums = None, StepSums(step.device)
    step.model.train()
    step.update.before_backward(update)  # as the loop's last micro-batch: offload sends the gradients on
    try:
        forward_backward(step.model, step.loss_fn, step.precision, to_device(batch, step.device), where, sums)
    except Exception as e:  # only an OOM is an answer, anything else is raised
        if not is_oom(e):
            raise
        failed = _oom_message(e)
    batch = None
    if dist.any_rank(failed is not None, step.device):
        return failed or "out of memory on another rank"
    if not update:
        return None
    try:
        step.update(*sums.totals(), False, 1.0)
    except Exception as e:
        if not is_oom(e):
            raise
        failed = _oom_message(e, " in the optimizer step")
    if dist.any_rank(failed is not None, step.device):
        return failed or "out of memory on another rank"
    return None


def _oom_message(error: Exception, where: str = "") -> str:
    """The first line of the out-of-memory error in ``error``'s causes, as it said it."""
    oom = _oom_in(error)
    return f"{type(oom).__name__}{where}: {str(oom).splitlines()[0][:300]}"


@contextlib.contextmanager
def lr_zero(optimizer):
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


def bucket_sampler(data):
    sampler = stateful_sampler(data) if hasattr(data, "batch_sampler") else data
    if not hasattr(sampler, "pessimistic_batch"):
        raise ConfigError("needs a DurationBucketSampler (the training DataLoader's batch_sampler): it builds "
                          f"each bucket's costliest batch; got {type(sampler).__name__}")
    return sampler


# ----------------------------------------------------------------------------- the Trainer's checks


def before_fit(mode: str, step, data, say: Callable[[str], None] = print) -> None:
    """The Trainer's checks before its first step (called at the start of ``fit``):
    ``trainer.preflight`` (``mode``), see :func:`preflight`.

    Raises:
        PreflightError: a bucket's costliest batch ran out of memory (see :func:`preflight`).
    """
    if mode != "none":
        preflight(step, data, mode, say)


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


def preflight(step, data, mode: str = "worst", say: Callable[[str], None] = print) -> list[dict]:
    """Run the costliest batch of the worst buckets (``worst``) or of every bucket (``all``) once.

    Args:
        step: the training step (a :class:`ddptrain.prepare.OneStep`: ``Trainer.one_step``).
        data: the training DataLoader, its batch_sampler a DurationBucketSampler.
        say: where each bucket's result is reported (the Trainer's logger).

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
        sampler = bucket_sampler(data)
    except ConfigError as e:
        raise ConfigError(f"trainer.preflight={mode}: {e}") from None
    make = loader_batches(data)
    buckets, sizes = sampler_buckets(sampler), sampler.bucket_batch_sizes
    chosen = sorted(range(len(buckets)), key=lambda k: -buckets[k].longest) if mode == "all" else _worst_buckets(sampler)
    meter, device = device_meter(step.device), step.device
    states = _optimizer_states(step.optimizer)
    fresh = not any(states.values())  # a resumed optimizer's state is not touched: no update step
    buffers = [(b, b.detach().clone()) for b in step.model.buffers()]
    scale = step.precision.state_dict()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if meter else []
    results = []
    try:
        with torch.random.fork_rng(devices=cuda), lr_zero(step.optimizer):
            for k in chosen:
                b, size = buckets[k], sizes[k]
                batch = make(sampler.pessimistic_batch(k))
                if meter:
                    meter.reset()
                failed = train_once(step, batch, f"pre-flight {b.describe(size)}", update=fresh)
                batch = None
                peak = meter.peak() / GB if meter else None
                release(step, collect=failed is not None)
                if failed:
                    memory = f" (peak {peak:.1f} GB of {meter.capacity() / GB:.1f} GB)" if meter else ""
                    raise PreflightError(
                        f"pre-flight check: the costliest batch of {b.describe(size)} does not fit{memory}: {failed}. "
                        f"Lower data.max_duration, turn on recompute, or measure the largest data.max_duration "
                        f"that fits: python -m ddptrain.tune")
                results.append({"bucket": k, "batch_size": size, "peak_gb": None if peak is None else round(peak, 3)})
                say(f"pre-flight: {b.describe(size)} fits" + (
                    f": peak {peak:.1f} GB of {meter.capacity() / GB:.1f} GB" if meter else ""))
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        if fresh:
            states.clear()
        step.precision.load_state_dict(scale)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        release(step, collect=False)
    return results
