"""Mixed-precision policy: autocast for the forward pass, GradScaler for fp16.

- ``fp32``: no autocast, no scaler.
- ``bf16``: autocast to bfloat16. bf16 has fp32's exponent range, so no loss scaling is needed.
- ``fp16``: autocast to float16 plus a GradScaler: the loss is multiplied by a large scale before
  backward so small gradients do not flush to zero, then the gradients are unscaled before
  clipping. A step whose gradients overflowed is skipped by the scaler and the scale is halved; we
  detect that (the scale went down) so the Trainer can report it and keep the LR schedule still.

With ``trainer.param_dtype: fp32`` (the default) the parameters and optimizer state stay fp32 and
autocast makes bf16/fp16 copies of the weights in every forward. ``trainer.param_dtype: bf16``
(with ``precision: bf16``) makes the model itself bf16 and keeps fp32 "master" copies for the
optimizer instead: see :class:`MasterWeights`.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

# Modules whose parameters stay fp32 under param_dtype=bf16: BatchNorm's kernels take bf16 input
# with fp32 weights and running statistics, and bf16 running statistics would drift.
KEEP_FP32 = (nn.modules.batchnorm._NormBase,)


def kept_fp32(model: nn.Module) -> set:
    """The ids of the parameters and buffers that stay fp32 under param_dtype=bf16 (``KEEP_FP32``)."""
    return {id(t) for m in model.modules() if isinstance(m, KEEP_FP32)
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}


def cast_frozen(model: nn.Module, dtype: torch.dtype, keep: set) -> None:
    """Frozen floating-point parameters and all floating-point buffers to ``dtype`` (those in
    ``keep`` excepted): frozen weights need no master, and a fp32 buffer would promote the
    activations back to fp32."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and id(p) not in keep:
            p.data = p.data.to(dtype)
    for m in model.modules():
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and id(b) not in keep:
                setattr(m, name, b.to(dtype))


class Precision:
    """Autocast + (for fp16) loss scaling, with skipped-step detection.

    Args:
        mode: ``fp32`` | ``bf16`` | ``fp16``.
        device: the training device (autocast is per device type).
        init_scale: GradScaler's initial scale (fp16 only).
    """

    def __init__(self, mode: str, device: torch.device, init_scale: float = 65536.0):
        self.mode = mode
        self.device_type = device.type
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=(mode == "fp16"))

    def autocast(self):
        """Context for the forward pass and loss (not for backward or the optimizer step)."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler.is_enabled() else loss

    def unscale_(self, optimizer) -> None:
        """Turn scaled grads back into true grads (before clipping / our normalisation)."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> bool:
        """Run the optimizer step (the scaler may skip it). Returns True if a step was taken.

        After the DDP all-reduce every rank holds the same gradients, so the scaler's inf check
        gives the same answer on every rank and all ranks skip together.
        """
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before  # the scale drops only when the step was skipped

    def skip(self) -> None:
        """A step the Trainer skipped (non-finite gradients): let the scaler lower its scale."""
        if self.scaler.is_enabled():
            self.scaler.update()

    def reset_scaler(self) -> None:
        """Forget a step that failed part-way (say, out of memory after ``unscale_``), keeping the
        scale and its growth count: GradScaler would otherwise refuse the next step's ``unscale_``."""
        if self.scaler.is_enabled():
            state = self.scaler.state_dict()
            self.scaler = torch.amp.GradScaler(self.device_type, enabled=True)
            self.scaler.load_state_dict(state)

    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


class MasterWeights:
    """A bf16 model with fp32 master copies of its parameters, which the optimizer updates.

    Why: with fp32 parameters, autocast casts every weight to bf16 in every forward (and again in
    every activation recomputation), the residual stream between layers stays fp32, and DDP
    all-reduces fp32 gradients. A bf16 model does none of that: no weight casts, half the
    activation traffic and half the gradient traffic. Why fp32 masters: an Adam update of 1e-5
    relative to a weight is far below bf16's resolution (2^-8) and would round away if applied to
    the bf16 weights; the masters accumulate it and the bf16 weights follow them.

    What changes for the user: gradients are accumulated over micro-batches and all-reduced in
    bf16 (like ``dist.comm_hook=bf16``); floating-point buffers are bf16 too, except inside
    BatchNorm-type modules, whose parameters and buffers stay fp32 (``KEEP_FP32``).

    Memory per trainable parameter: 2 (bf16 weight) + 2 (bf16 grad) + 4 (master) + 8 (Adam)
    + 4 transient (fp32 master gradient during the step) — the same 16 B as fp32 parameters at
    rest, minus autocast's 2 B of transient weight copies, with the activations of a bf16
    residual stream. Under ``optim.zero`` on several ranks the Trainer uses
    :class:`ddptrain.update.sharded.ShardedMasterWeights` instead: 4 + 12/N B.

    Args:
        model: the model, on its device, *not yet wrapped in DDP*; modified in place (parameters
            and buffers cast). Changing a parameter's dtype after DDP has registered its
            gradient hooks would silently detach them (see :meth:`load_state_dict`).
        dtype: the low-precision dtype (``torch.bfloat16``).
    """

    sharded = False  # every rank holds every master (see ddptrain/update/sharded.py for the other kind)

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        keep = kept_fp32(model)
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model param, master); same object if kept fp32
        self.to_master: dict[nn.Parameter, nn.Parameter] = {}
        for p in model.parameters():  # shared (tied) parameters come once: one master each
            if not p.requires_grad:
                continue  # frozen: no master (cast_frozen below)
            if id(p) in keep or not p.is_floating_point():
                master = p
            else:
                master = nn.Parameter(p.detach().clone().float())
                p.data = p.data.to(dtype)
            self.pairs.append((p, master))
            self.to_master[p] = master
        cast_frozen(model, dtype, keep)
        self._cast = [(p, m) for p, m in self.pairs if p is not m]
        self._kept = [p for p, m in self.pairs if p is m]  # fp32 already: the optimizer updates them

    def load_grads(self, factor, owned: Optional[set] = None) -> None:
        """Master gradients = ``factor`` x the (all-reduced) model gradients, in fp32.

        Args:
            factor: the Trainer's normalisation and clipping scale for this step (a float), or
                None: the gradients as they are (a fused optimizer applies the factor itself).
            owned: under ZeRO, the ids of the masters this rank updates; the others get none.
        """
        cast = [(p, m) for p, m in self._cast if p.grad is not None and (owned is None or id(m) in owned)]
        if cast:
            # views of one fp32 buffer, filled by one multi-tensor copy: not a cast kernel and an
            # allocation per parameter (the buffer is freed when the optimizer drops the grads)
            sizes = [-(-p.numel() // 16) * 16 for p, _ in cast]  # 64-byte aligned views: vectorised kernels
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=cast[0][0].device)
            grads = [g[:p.numel()].view(p.shape) for g, (p, _) in zip(flat.split(sizes), cast)]
            torch._foreach_copy_(grads, [p.grad for p, _ in cast])
            if factor is not None:
                torch._foreach_mul_(grads, factor)
            for (_, m), g in zip(cast, grads):
                m.grad = g
        kept = [p.grad for p in self._kept if p.grad is not None]
        if kept and factor is not None:
            torch._foreach_mul_(kept, factor)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the (updated) masters into the bf16 model parameters."""
        if self._cast:
            torch._foreach_copy_([p for p, _ in self._cast], [m for _, m in self._cast])

    def zero_model_grads(self) -> None:
        for p, m in self._cast:
            p.grad = None

    def drop_master_grads(self) -> None:
        """Free the fp32 master gradients :meth:`load_grads` made, leaving the model's own."""
        for _, m in self._cast:
            m.grad = None

    def state_dict(self, module: nn.Module) -> dict:
        """``module.state_dict()`` with the fp32 masters in place of the bf16 parameters: what a
        checkpoint saves, so resuming restores the masters exactly."""
        masters = self._masters_by_storage()
        return {k: masters[v.data_ptr()].detach() if v.data_ptr() in masters and v.numel() else v
                for k, v in module.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, saved: dict, module: nn.Module) -> None:
        """Set the masters from full-precision saved weights (names as in ``module``), then the
        bf16 parameters from the masters. Never swaps a parameter's ``.data`` for another
        dtype: that would detach DDP's gradient hooks from the parameter."""
        masters = self._masters_by_storage()
        for k, v in module.state_dict().items():
            if v.data_ptr() in masters and v.numel() and k in saved:
                masters[v.data_ptr()].copy_(saved[k])
        self.copy_to_model()

    def _masters_by_storage(self) -> dict:
        # state_dict() values are fresh tensor objects: match them to parameters by data pointer
        # (tied parameters share one, so both names get the one master)
        return {p.data_ptr(): m for p, m in self._cast}
