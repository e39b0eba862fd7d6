"""The update of one optimizer step, after the backward: normalise, clip, skip or step.

The loss contract makes every rank backpropagate ``unit_scale * loss_sum`` of its own
micro-batches, and DDP averages the gradients over ranks. What the step needs is
``sum over ranks (grad of loss_sum) / global units``; this module turns one into the other, clips
by the global norm, and applies the step unless the loss or the gradients were non-finite (or
there were no units at all). Everything is decided from one small all-reduce per step, and read
on the host once (``report.tolist()``): the preemption flag and the loss_fn's unit checks travel
in the same collective. Where the step is skipped on the device, the report is read as soon as
it exists (:class:`HostReport`), not after the optimizer's kernels: the host's work between two
steps then runs while the GPU updates the weights.
"""

from __future__ import annotations

from typing import Optional

import torch

from ddptrain.precision import Precision


class HostReport:
    """The step's report on its way to the host. On a GPU it is copied into pinned memory right
    behind the kernels that computed it, and an event marks the copy: :meth:`read` waits for that
    event, not for everything queued after it (the optimizer's kernels), so the host's
    bookkeeping, the next batch and the next forward's launches overlap the update. On the CPU
    there is nothing to overlap: :meth:`read` is ``tolist()``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: Optional[torch.Tensor] = None
        self.buffer: Optional[torch.Tensor] = None
        self.copied = torch.cuda.Event() if self.cuda else None

    def send(self, report: torch.Tensor) -> None:
        if not self.cuda:
            self.pending = report
            return
        if self.buffer is None or self.buffer.shape != report.shape:
            self.buffer = torch.empty(report.shape, dtype=report.dtype, pin_memory=True)
        # the previous read waited for the previous copy: the buffer is free to write again
        self.buffer.copy_(report, non_blocking=True)
        self.copied.record()

    def read(self) -> list:
        if not self.cuda:
            report, self.pending = self.pending, None
            return report.tolist()
        self.copied.synchronize()
        return self.buffer.tolist()


class StepUpdate:
    """The common part of every backend's step: all-reduce, normalise, clip, judge; then the
    backend steps (or skips) and drops the gradients.

    Args:
        backend: the run's :class:`ddptrain.update.backend.Backend` (started: its optimizer built).
        precision: autocast / GradScaler policy (fp16 keeps GradScaler's own skip).
        world_size: processes in the step's all-reduce (1 without a process group).
        clip: ``trainer.clip_grad_norm`` (0 = off).
        device: the training device.
    """

    def __init__(self, backend, precision: Precision, world_size: int, clip: float, device: torch.device):
        self.backend, self.precision = backend, precision
        self.world_size, self.clip, self.device = world_size, clip, device
        self.report = HostReport(device)

    params = property(lambda self: self.backend.params, doc="the model's trainable parameters")
    on_device = property(lambda self: self.backend.on_device,
                         doc="a non-finite step is skipped on the device (queued before the host reads the verdict)")

    def before_backward(self, last: bool) -> None:
        """Called before each micro-batch's backward (``last``: the step's last one)."""
        self.backend.before_backward(last)

    def __call__(self, loss_sum: torch.Tensor, units_dev: torch.Tensor, units_host: float,
                 negative: torch.Tensor, preempt: bool, unit_scale: float) -> dict:
        """All-reduce, normalise, clip and step (or skip); zero the gradients.

        Args:
            loss_sum, units_dev, negative: this rank's sums over its micro-batches (0-d float64
                device tensors; ``negative`` counts micro-batches with a negative unit count).
            units_host: the unit counts the loss_fn returned as host numbers.
            preempt: this rank received a preemption signal.
            unit_scale: the pre-scale the losses were multiplied by before backward.

        Returns:
            ``loss_sum``, ``units``, ``grad_norm``, ``negative`` (global, as floats),
            ``preempt`` (any rank) and ``stepped``.
        """
        backend = self.backend
        self.precision.unscale_(backend.optimizer)  # fp16: true (unscaled) gradients from here on
        f64 = dict(dtype=torch.float64, device=self.device)
        # this rank's part: its norm, or under sharded gradients its squared norm (summed by the all-reduce)
        raw_norm = backend.grad_norm()
        # Host values enter through torch.full, not torch.tensor: a copy from a host scalar would
        # block the host until the backward has finished (a second sync per step, seen on a GPU).
        flags = torch.stack([loss_sum, units_dev + torch.full((), units_host, **f64),
                             torch.full((), float(preempt), **f64), raw_norm.to(self.device), negative])
        if self.world_size > 1:
            torch.distributed.all_reduce(flags)
        loss_t, units_t, stop_t, norm_sum, negative_t = flags.unbind()
        # DDP has averaged the gradients, so every rank holds the same ones and the same norm
        # (sharded gradients: the same average, each rank its own tensors)
        factor = self.world_size / (units_t.clamp_min(1e-12) * unit_scale)
        norm_t = (norm_sum.sqrt() if backend.shards_grads else norm_sum / self.world_size) * factor
        # a broken unit count (negative, NaN, inf: contract.unit_faults) never steps, even by zero
        finite_t = torch.isfinite(norm_t) & torch.isfinite(loss_t) & (units_t > 0) & (negative_t == 0)
        if self.clip > 0:
            factor = factor * torch.where(norm_t > self.clip, self.clip / (norm_t + 1e-6), 1.0)
        report = torch.stack([loss_t, units_t, stop_t, norm_t, finite_t.double(), negative_t, factor])
        if backend.on_device:
            self.report.send(report)  # read once the step's kernels are queued behind it
            backend.step(factor, (~finite_t).float())
            loss, units, stop, norm, finite, negative, _ = self.report.read()
            stepped = finite > 0
        else:
            # the host decides: a non-finite step is skipped before anything is updated (and, for
            # the host backend, before a gradient leaves the GPU)
            loss, units, stop, norm, finite, negative, factor = report.tolist()
            stepped = False
            if finite > 0:
                stepped = backend.step(factor, None)
            else:
                backend.skip()  # fp16: the scaler lowers its scale after an overflow
        backend.zero_grad()
        return {"loss_sum": loss, "units": units, "grad_norm": norm, "negative": negative,
                "preempt": stop > 0, "stepped": stepped}
