"""A training step's data and work: the stream of steps, and one micro-batch's forward and backward.

:class:`StepStream` turns a DataLoader into steps: epochs, the resume position (O(1) through a
stateful batch sampler, by skipping batches otherwise), the epoch protocol of samplers and
datasets (``set_epoch``), and the grouping of batches into one step's micro-batches. The loop then
reads ``for micro in stream: train_step(micro)``; the counters it advances live in the progress
record.

:func:`forward_backward` is the one copy of a micro-batch's work (autocast, the loss contract,
loss scaling, backward, the error that names the batch), adding into :class:`StepSums`, what
:class:`ddptrain.update.step.StepUpdate` all-reduces. ``Trainer.train_step``, the pre-flight check
and the tuner (ddptrain/preflight.py, ddptrain/tune.py) all step through it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Iterator, Optional

import torch

from ddptrain.config import TrainerConfig
from ddptrain.contract import TrainingError, batch_ids, check_loss_output, unit_faults
from ddptrain.precision import Precision
from ddptrain.progress import RNGStreams, TrainingProgress


def stateful_sampler(loader: Any) -> Optional[Any]:
    """The loader's batch sampler if it can resume by itself (``DurationBucketSampler``), else None."""
    bs = getattr(loader, "batch_sampler", None)
    if bs is not None and all(hasattr(bs, m) for m in ("state_dict", "load_state_dict", "set_epoch")):
        return bs
    return None


class StepSums:
    """This rank's sums over one step's micro-batches (0-d float64 tensors on ``device``): the
    loss, the units a loss_fn counted as tensors, their faults (:func:`ddptrain.contract.unit_faults`),
    and the units it counted as host numbers, which never need a copy to the device."""

    def __init__(self, device: torch.device):
        f64 = dict(dtype=torch.float64, device=device)
        self.device = device
        self.loss, self.units, self.negative = (torch.zeros((), **f64) for _ in range(3))
        self.units_host = 0.0

    def add(self, loss_sum: torch.Tensor, units: Any) -> None:
        self.loss += loss_sum.detach().double()
        if isinstance(units, torch.Tensor):
            units = units.detach().to(self.device, torch.float64).reshape(())
            self.units += units
            self.negative += unit_faults(units)  # negative, NaN or inf: the guard names it
        else:
            self.units_host += float(units)

    def totals(self) -> tuple:
        """The first four arguments of :meth:`ddptrain.update.step.StepUpdate.__call__`."""
        return self.loss, self.units, self.units_host, self.negative


def forward_backward(model: torch.nn.Module, loss_fn: Callable, precision: Precision, batch: Any, where: str,
                     sums: StepSums, scale: float = 1.0, weight: float = 1.0) -> None:
    """One micro-batch: ``loss_fn(model, batch)`` under autocast, the backward of its loss x
    ``scale`` (fp16: loss-scaled), its loss and units added to ``sums``.

    Args:
        model: what the forward calls: the loop's DDP wrapper, or the prepared model itself.
        batch: on the device already.
        where: "rank r, step s, micro-batch i" (or the bucket being measured), for errors.
        scale: the loss's pre-scale (the Trainer's ``unit_scale``: gradients of about unit size).
        weight: 0.0: a replayed batch standing in for an empty one (zero gradient, zero units).

    Raises:
        TrainingError: ``loss_fn`` broke the loss contract.
        RuntimeError: any other error of the forward or backward, naming ``where`` and the
            batch's ids; the original is its cause (an out-of-memory error stays recognisable).
    """
    try:
        with precision.autocast():
            loss_sum, units = check_loss_output(loss_fn(model, batch), where)
        if weight == 0.0:
            loss_sum, units = loss_sum * 0.0, 0
        precision.scale(loss_sum.float() * scale).backward()
    except TrainingError:
        raise
    except Exception as e:
        raise RuntimeError(f"{where}: {type(e).__name__}: {e}{batch_ids(batch)}") from e
    sums.add(loss_sum, units)


class StepStream:
    """Args:
        loader: the training DataLoader (or any re-iterable with ``len``).
        progress: epoch, batches consumed, step (read and advanced by the loop and here).
        rng: this rank's streams; a resumed state is applied before the first iterator.
        cfg: the ``trainer`` section: ``grad_accum_steps`` micro-batches per step, and the run's
            length (``max_steps``, or ``max_epochs`` when it is 0).
        epoch_end: called after each finished epoch (a full GC, where the ranks wait anyway).

    It holds no reference to the Trainer: a finished Trainer is freed at once, and with it a
    loader's persistent workers (see :meth:`stop_workers`).
    """

    def __init__(self, loader: Any, progress: TrainingProgress, rng: RNGStreams, cfg: TrainerConfig,
                 epoch_end: Callable[[], None]):
        self.loader, self.progress, self.rng, self.cfg = loader, progress, rng, cfg
        self.epoch_end = epoch_end
        self.wait_s = 0.0  # how long the last step waited for its data
        self.say: Callable[[str], None] = print  # the Trainer's logger, once it has one
        self._said_end = False

    def finished(self) -> bool:
        p, t = self.progress, self.cfg
        if p.step >= t.max_steps if t.max_steps > 0 else p.epoch >= t.max_epochs:
            return True
        # a mix whose every source reached its data.source_caps has nothing left to draw (ddptrain/data/mix.py)
        end = getattr(stateful_sampler(self.loader), "end_epoch", None)
        if end is None or p.epoch < end:
            return False
        if not self._said_end:
            self._said_end = True
            limit = f"trainer.max_steps={t.max_steps}" if t.max_steps > 0 else f"trainer.max_epochs={t.max_epochs}"
            self.say(f"every training source has reached its data.source_caps by epoch {end}: the run ends at step "
                     f"{p.step}, before {limit}")
        return True

    def stop_workers(self) -> None:
        """Shut a DataLoader's persistent workers down now (``fit`` is over), instead of whenever
        the loader is garbage-collected: a worker ignores SIGTERM (process.py), so a late shutdown
        can leave it running until the process exits."""
        if getattr(self.loader, "_iterator", None) is not None:
            self.loader._iterator = None  # its __del__ shuts the workers down

    def __iter__(self) -> Iterator[list]:
        p = self.progress
        while not self.finished():
            batches, micro = self._epoch_iterator(), None
            try:
                while not self.finished():
                    tic = time.perf_counter()
                    micro = list(itertools.islice(batches, self.cfg.grad_accum_steps))
                    self.wait_s = time.perf_counter() - tic
                    if not micro:
                        break
                    yield micro  # the loop trains on it and advances p.step / p.batches_done
            finally:
                batches = None  # shut the loader's workers down now, even on an exception
            if not micro or p.batches_done >= p.epoch_batches:
                p.epoch, p.batches_done = p.epoch + 1, 0
                self.epoch_end()

    def _epoch_iterator(self) -> Iterator:
        """This epoch's batches, starting after the ones already consumed (on resume).

        Creating a DataLoader iterator draws a worker seed from the global torch RNG. It is done
        inside ``fork_rng`` so it does not move the RNG that dropout uses: then a run resumed
        from a checkpoint sees exactly the random stream of the uninterrupted run, whether the
        checkpoint was taken mid-epoch or at an epoch boundary.
        """
        p = self.progress
        self.rng.apply_pending()  # a resumed run's streams, once, before anything draws from them
        sampler = stateful_sampler(self.loader)
        plain = getattr(self.loader, "sampler", None)
        if sampler is not None and p.batches_done == 0:
            sampler.set_epoch(p.epoch)  # a resumed stateful sampler starts at its saved position
        elif sampler is None and hasattr(plain, "set_epoch"):
            plain.set_epoch(p.epoch)
        if hasattr(getattr(self.loader, "dataset", None), "set_epoch"):
            self.loader.dataset.set_epoch(p.epoch)  # augmentation draws from (seed, epoch, index)
        p.epoch_batches = len(self.loader)
        with torch.random.fork_rng(devices=[]):
            it = iter(self.loader)
            if sampler is None:
                for _ in range(p.batches_done):  # generic loaders: skip what was consumed (O(k))
                    next(it)
        return it
