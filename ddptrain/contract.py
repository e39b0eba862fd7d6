"""What a batch and a ``loss_fn``'s answer must look like, and the errors that say so.

The loss contract (docs/design.md): ``loss_fn(model, batch) -> (loss_sum, num_units)``, a 0-d
tensor summed over units and the count of those units (a number or a one-element tensor,
>= 0). A broken answer is named here with the rank, step and what was returned, instead of
surfacing later as a broadcasting error or as every step silently skipped.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# What one micro-batch's tensor unit count adds to the step's fault sum (:func:`unit_faults`): 1 if
# it is negative, NONFINITE_UNITS if it is NaN or inf. One device sum carries both counts to the
# guard, in the step's one all-reduce (far fewer than 2**20 micro-batches take part in a step).
NONFINITE_UNITS = 2.0 ** 20


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite losses, loss-scale collapse, a broken loss_fn, ...)."""


def check_loss_output(returned: Any, where: str, host: bool = False) -> tuple:
    """``(loss_sum, units)`` from a ``loss_fn`` call, checked.

    Args:
        returned: what ``loss_fn`` returned.
        where: "rank r, step s, micro-batch i", for the message.
        host: also check tensor units here (evaluation reads them on the host anyway).

    Raises:
        TrainingError: not a pair, a loss that is not 0-d, or units that are not a count >= 0
            (tensor units are checked on the device by the caller, to avoid a host sync).
    """
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise TrainingError(f"{where}: loss_fn must return (loss_sum, num_units), it returned {describe(returned)}")
    loss_sum, units = returned
    if not (isinstance(loss_sum, torch.Tensor) and loss_sum.ndim == 0):
        raise TrainingError(f"{where}: loss_fn's loss_sum must be a 0-d tensor (e.g. losses.sum()), "
                            f"it returned {describe(loss_sum)}")
    if isinstance(units, torch.Tensor):
        if units.numel() != 1:
            raise TrainingError(f"{where}: loss_fn's num_units must be a number or a 1-element tensor, "
                                f"it returned {describe(units)}")
        if host and not (float(units) >= 0 and math.isfinite(float(units))):
            raise TrainingError(f"{where}: loss_fn's num_units must be a count >= 0, it returned {float(units)!r}")
    elif not isinstance(units, (int, float)) or isinstance(units, bool) or not (units >= 0 and math.isfinite(units)):
        raise TrainingError(f"{where}: loss_fn's num_units must be a count >= 0 (the frames, tokens or "
                            f"utterances its loss_sum sums over), it returned {units!r}")
    return loss_sum, units


def unit_faults(units: torch.Tensor) -> torch.Tensor:
    """The fault count of one tensor ``num_units``, on its device (no host sync): see
    :data:`NONFINITE_UNITS`; :meth:`ddptrain.guard.StepGuard.judge` reads the step's sum."""
    return (units < 0).double() + (~torch.isfinite(units)).double() * NONFINITE_UNITS


def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} ({x.dtype})"
    return f"{type(x).__name__} {x!r}"[:200]


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not (batch and isinstance(batch[0], str)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def is_empty(batch: Any) -> bool:
    """A batch whose utterances were all skipped as bad data (or an evaluation filler)."""
    return isinstance(batch, dict) and "ids" in batch and len(batch["ids"]) == 0


def batch_ids(batch: Any) -> str:
    """`` [utterances: a, b, ...]`` for error messages, or "" if the batch has no ids."""
    ids = batch.get("ids") if isinstance(batch, dict) else None
    if not ids:
        return ""
    shown = list(ids[:10])
    return f" [utterances: {', '.join(map(str, shown))}{' ...' if len(ids) > 10 else ''}]"
