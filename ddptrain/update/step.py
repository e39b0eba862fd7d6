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

from ddptrain.optim import is_zero, skips_on_device, step_unless
from ddptrain.precision import MasterWeights, Precision


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
    """Args:
        optimizer: plain or ZeRO; with ``master``, it updates the fp32 masters.
        precision: autocast / GradScaler policy (fp16 keeps GradScaler's own skip).
        master: the :class:`MasterWeights` of a bf16 model, or None.
        params: the model's trainable parameters (their ``.grad`` is what backward filled).
        world_size: processes in the step's all-reduce (1 without a process group).
        clip: ``trainer.clip_grad_norm`` (0 = off).
        device: the training device.
        sharded_grads: each rank holds the gradients of its own partition only
            (``optim.shard_grads``): the global norm is the root of the ranks' summed squares.
        keep_grads: zero the model's gradients in place instead of freeing them
            (``compile.cuda_graphs``: a captured backward accumulates into those very tensors).
        fused: the :class:`ddptrain.fused_update.FusedMasterAdamW` of ``optim.fused_update``, which
            then steps in place of ``optimizer``, on the device (skipped there if not finite).
    """

    def __init__(self, optimizer, precision: Precision, master: Optional[MasterWeights], params: list,
                 world_size: int, clip: float, device: torch.device, sharded_grads: bool = False,
                 keep_grads: bool = False, fused=None):
        self.optimizer, self.precision, self.master, self.params = optimizer, precision, master, params
        self.world_size, self.clip, self.device = world_size, clip, device
        self.sharded_grads, self.keep_grads, self.fused = sharded_grads, keep_grads, fused
        self._owned = ({id(p) for g in optimizer.optim.param_groups for p in g["params"]}
                       if is_zero(optimizer) else None)  # the masters this rank updates
        # A fused optimizer can skip a non-finite step on the device: the step is then queued
        # before the host has read whether it was finite, and the GPU does not idle while the
        # host launches it. fp16 keeps GradScaler's skip, other optimizers decide on the host.
        self.on_device = fused is not None or (precision.mode != "fp16" and skips_on_device(optimizer))
        self.offloaded = getattr(master, "offloaded", False)  # ddptrain/offload.py steps on the host
        self.report = HostReport(device)

    def before_backward(self, last: bool) -> None:
        """Called before each micro-batch's backward: during the step's last one, an offloaded
        master on one rank (ddptrain/offload.py) takes each gradient to the host as it is made."""
        if self.offloaded and self.master.streams:
            self.master.streaming = last

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
        self.precision.unscale_(self.optimizer)  # fp16: true (unscaled) gradients from here on
        grads = [p.grad for p in self.params if p.grad is not None]
        f64 = dict(dtype=torch.float64, device=self.device)
        if self.offloaded and self.master.sent():  # one rank: most gradients are on the host already
            raw_norm = self.master.grad_norm().double()
        else:
            raw_norm = (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))).double()
                        if grads else torch.zeros((), **f64))
        if self.sharded_grads:
            raw_norm = raw_norm.square()  # summed over the ranks' disjoint shards by the all-reduce
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
        norm_t = (norm_sum.sqrt() if self.sharded_grads else norm_sum / self.world_size) * factor
        # a broken unit count (negative, NaN, inf: contract.unit_faults) never steps, even by zero
        finite_t = torch.isfinite(norm_t) & torch.isfinite(loss_t) & (units_t > 0) & (negative_t == 0)
        if self.clip > 0:
            factor = factor * torch.where(norm_t > self.clip, self.clip / (norm_t + 1e-6), 1.0)
        report = torch.stack([loss_t, units_t, stop_t, norm_t, finite_t.double(), negative_t, factor])
        if self.offloaded:
            # the host updates the masters: it needs the verdict and the factor anyway, and a
            # non-finite step is skipped before a gradient leaves the GPU
            loss, units, stop, norm, finite, negative, factor = report.tolist()
            stepped = finite > 0
            if stepped:
                self.master.step(self.optimizer, factor)
        elif self.on_device:
            self.report.send(report)  # read once the step's kernels are queued behind it
            if self.fused is not None:
                # reads the model's bf16 gradients x factor and writes masters, moments and bf16 weights
                self.fused.step(factor, (~finite_t).float())
            else:
                # the fused kernel applies the factor itself (grad / grad_scale, skipped where not
                # finite), so no separate multiply runs over the gradients
                self._scale_grads(grads, None)
                step_unless(self.optimizer, found_inf=(~finite_t).float(), grad_scale=factor.reciprocal().float())
                if self.master:
                    self.master.copy_to_model()  # after a skip the masters are unchanged: a no-op copy
            loss, units, stop, norm, finite, negative, _ = self.report.read()
            stepped = finite > 0
        else:
            loss, units, stop, norm, finite, negative, factor = report.tolist()
            stepped = False
            if finite > 0:
                self._scale_grads(grads, factor)
                stepped = self.precision.step(self.optimizer)  # fp16: False if the scaler skipped it
                if stepped and self.master:
                    self.master.copy_to_model()
            else:
                self.precision.skip()  # fp16: the scaler lowers its scale after an overflow
        self._zero_grads(grads)
        return {"loss_sum": loss, "units": units, "grad_norm": norm, "negative": negative,
                "preempt": stop > 0, "stepped": stepped}

    def _zero_grads(self, grads: list) -> None:
        if self.keep_grads:
            torch._foreach_zero_(grads)  # the model's, kept where a graph writes them
            if self.master:
                self.master.drop_master_grads()  # the fp32 masters' (the ones that are not the model's)
            return
        self.optimizer.zero_grad(set_to_none=True)
        if self.master:
            self.master.zero_model_grads()

    def _scale_grads(self, grads: list, factor) -> None:
        """Gradients x ``factor`` (a float; None: left to the optimizer); with masters, into their
        fp32 gradients (only this rank's shard under ZeRO)."""
        if not grads:
            return
        if self.master:
            self.master.load_grads(factor, self._owned)
        elif factor is not None:
            torch._foreach_mul_(grads, factor)
