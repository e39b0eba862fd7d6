"""StepGuard: counts the steps that were not applied and decides when training must stop.

Every rank calls :meth:`StepGuard.judge` with the same all-reduced values, so every rank
reaches the same verdict at the same step: nobody is left waiting in a collective. The loop
acts on the verdict (save, then raise); the guard only decides and words the error.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from ddptrain.config import TrainerConfig
from ddptrain.contract import NONFINITE_UNITS, TrainingError
from ddptrain.progress import TrainingProgress


class StepGuard:
    """Args:
        cfg: the ``trainer`` config section (``max_nonfinite_steps``, ``fp16_min_scale``).
        precision: the :class:`~ddptrain.precision.Precision` policy (mode, loss scale).
        progress: the counters it keeps (skipped steps, non-finite and empty steps in a row).

    ``say`` prints a line (the Trainer sets it to its logger's ``print`` once the logger exists).
    """

    def __init__(self, cfg: TrainerConfig, precision, progress: TrainingProgress):
        self.cfg, self.precision, self.progress = cfg, precision, progress
        self.say: Callable[[str], None] = print

    def judge(self, stepped: bool, loss_sum: float, units: float, norm: float, negative: float,
              ids: str) -> Optional[str]:
        """Count this step; return why training must stop (``nonfinite``, ``no_units``,
        ``fp16_collapse``), or None.

        Under fp16 an overflowed *gradient* is routine (the scaler halves its scale and skips the
        step), so only a non-finite *loss* counts toward the abort; a scale that keeps falling is
        caught by ``fp16_min_scale`` instead.

        Raises:
            TrainingError: loss_fn returned a negative, NaN or inf unit count on some rank
                (``negative``: the step's sum of :func:`ddptrain.contract.unit_faults`); the step
                was not applied.
        """
        p, t = self.progress, self.cfg
        if negative > 0:
            nonfinite, below = divmod(int(negative), int(NONFINITE_UNITS))
            if nonfinite:
                raise TrainingError(f"step {p.step}: loss_fn returned a non-finite num_units (NaN or inf) on "
                                    f"{nonfinite} micro-batch(es), so the step was not applied; num_units must count "
                                    f"the units its loss_sum sums over (frames, tokens){ids}")
            raise TrainingError(f"step {p.step}: loss_fn returned a negative num_units on {below} "
                                "micro-batch(es); it must count the units its loss_sum sums over")
        p.skipped_steps += not stepped
        p.empty_in_row = p.empty_in_row + 1 if units == 0 else 0
        if p.empty_in_row:
            self.say(f"step {p.step}: loss_fn returned 0 units on every rank, step skipped")
        bad = not math.isfinite(loss_sum) or (self.precision.mode != "fp16" and not math.isfinite(norm))
        p.nonfinite_in_row = p.nonfinite_in_row + 1 if bad else 0
        if bad:
            self.say(f"step {p.step}: non-finite loss/gradient, step skipped on all ranks "
                     f"({p.nonfinite_in_row} in a row){ids}")
        if p.nonfinite_in_row >= t.max_nonfinite_steps:
            return "nonfinite"
        if p.empty_in_row >= t.max_nonfinite_steps:
            return "no_units"
        if self.precision.mode == "fp16" and self.precision.loss_scale() < t.fp16_min_scale:
            return "fp16_collapse"
        return None

    def error(self, reason: str, saved: Optional[str] = None) -> TrainingError:
        """The error that ends training for ``reason`` (``saved``: the checkpoint just written)."""
        p, t = self.progress, self.cfg
        if reason == "nonfinite":
            return TrainingError(f"{p.nonfinite_in_row} consecutive non-finite steps (limit trainer."
                                 f"max_nonfinite_steps={t.max_nonfinite_steps}) at step {p.step}; saved the "
                                 f"last good state as: {saved}")
        if reason == "no_units":
            return TrainingError(f"loss_fn returned num_units=0 on every rank for {p.empty_in_row} steps in a "
                                 f"row (limit trainer.max_nonfinite_steps) at step {p.step}: nothing was "
                                 "trained; does it count the right units (target tokens, frames)?")
        return TrainingError(f"fp16 loss scale collapsed to {self.precision.loss_scale():.3g} (< trainer."
                             f"fp16_min_scale={t.fp16_min_scale}) at step {p.step}: the gradients overflow "
                             "even unscaled; try bf16 or a lower learning rate")
