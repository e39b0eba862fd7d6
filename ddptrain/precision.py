"""Mixed-precision policy: autocast for the forward pass, GradScaler for fp16.

- ``fp32``: no autocast, no scaler.
- ``bf16``: autocast to bfloat16. bf16 has fp32's exponent range, so no loss scaling is needed.
- ``fp16``: autocast to float16 plus a GradScaler: the loss is multiplied by a large scale before
  backward so small gradients do not flush to zero, then the gradients are unscaled before
  clipping. A step whose gradients overflowed is skipped by the scaler and the scale is halved; we
  detect that (the scale went down) so the Trainer can report it and keep the LR schedule still.

The parameters and optimizer state stay fp32 in every mode (the "master weights").
"""

from __future__ import annotations

import contextlib

import torch


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

    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)
