"""Run logging on rank 0: TensorBoard scalars, a JSONL metrics file and a console progress bar.

Every other rank gets a logger whose methods do nothing, so the training loop never branches on
the rank to log. The JSONL file (one object per logged step, flushed at once) is the
machine-readable record that tests and scripts read; TensorBoard is for people.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

from ddptrain.config import LoggingConfig


class RunLogger:
    """Writes scalars to TensorBoard, ``metrics.jsonl`` and the console (rank 0 only).

    Args:
        output_dir: the run folder.
        cfg: the ``logging`` config section.
        enabled: False on ranks other than 0.
        total_steps: for the progress bar's ETA.
    """

    def __init__(self, output_dir: str, cfg: LoggingConfig, enabled: bool, total_steps: int, start_step: int = 0):
        self.enabled = enabled
        self.tb = None
        self.jsonl = None
        self.bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if cfg.jsonl:
            self.jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a", buffering=1)
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0, disable=None)

    def log(self, step: int, scalars: dict, prefix: str = "train") -> None:
        """Record ``scalars`` at optimizer step ``step`` under ``prefix/`` (train, eval, data)."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in scalars.items() if v is not None}
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
        if self.jsonl is not None:
            record = {"step": step, "split": prefix, "time": round(time.time(), 3)}
            record.update({k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()})
            self.jsonl.write(json.dumps(record) + "\n")
        text = " ".join(f"{k}={_fmt(v)}" for k, v in clean.items())
        self.print(f"[{prefix} step {step}] {text}")

    def advance(self, n: int = 1, postfix: Optional[dict] = None) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
        self.bar = self.tb = self.jsonl = None


def _fmt(v: float) -> str:
    if isinstance(v, float) and (abs(v) >= 1e4 or (0 < abs(v) < 1e-3)):
        return f"{v:.3e}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
