"""Run logging on rank 0: TensorBoard scalars, a JSONL metrics file and a console progress bar.

Every other rank gets a logger whose methods do nothing, so the training loop never branches on
the rank to log. The JSONL file (one object per logged step, flushed at once) is the
machine-readable record that tests and scripts read; TensorBoard is for people.

A log file that cannot be written (a full disk, a vanished mount) never stops training: the
logger prints one warning naming the file and the error, drops that sink, and goes on with the
others. Checkpoints are what a run cannot lose, and their writes fail loudly on their own
(checkpoint.py); a metrics line is not worth a day of training.

The loop only reports what each step did; the throughput window (loss, rates, MFU, data and
all-reduce waits between two logged steps: ddptrain/throughput.py) turns that into the line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable, Optional

import torch

from ddptrain.config import LoggingConfig
from ddptrain.throughput import ThroughputWindow

# Left out of the printed line (not of metrics.jsonl or TensorBoard) where they say nothing: model
# FLOP/s and MFU off a GPU (no peak to compare with), and a loss scale of 1 (no fp16 scaler).
GPU_ONLY = ("tflops_per_gpu", "mfu")


class RunLogger:
    """Writes scalars to TensorBoard, ``metrics.jsonl`` and the console (rank 0 only).

    Args:
        output_dir: the run folder.
        cfg: the ``logging`` config section.
        enabled: False on ranks other than 0.
        total_steps: for the progress bar's ETA.
        window: what sums the steps between two logged ones (rates, MFU, waits); with several
            ranks it is collective, and every rank's logger feeds it.
    """

    def __init__(self, output_dir: str, cfg: LoggingConfig, enabled: bool, total_steps: int, start_step: int = 0,
                 window: Optional[ThroughputWindow] = None):
        self.enabled = enabled
        self.log_every = cfg.log_every
        self.window = window or ThroughputWindow()
        self.tb_path = os.path.join(output_dir, "tensorboard")
        self.jsonl_path = ""
        self.tb = None
        self.jsonl = None
        self.bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(self.tb_path)
        if cfg.jsonl:
            self.jsonl_path = os.path.join(output_dir, "metrics.jsonl")
            self.jsonl = open(self.jsonl_path, "a", buffering=1)
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0, disable=None)

    def log(self, step: int, scalars: dict, prefix: str = "train", name: str = "") -> None:
        """Record ``scalars`` at optimizer step ``step`` under ``prefix/`` (train, eval, data).

        Args:
            name: the data set, when a prefix covers several (each test set): in the printed line,
                as ``"set"`` in metrics.jsonl and in the TensorBoard tags (``test/NAME/wer``).
        """
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in scalars.items() if v is not None}
        tag = f"{prefix}/{name}" if name else prefix  # two test sets at one step would share test/wer
        if self.tb is not None:
            try:
                for k, v in clean.items():
                    self.tb.add_scalar(f"{tag}/{k}", v, step)
            except Exception as e:  # the writer thread re-raises its own write errors here
                self._drop("tb", self.tb_path, e)
        if self.jsonl is not None:
            record = {"step": step, "split": prefix, **({"set": name} if name else {}), "time": round(time.time(), 3)}
            record.update({k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()})
            try:
                self.jsonl.write(json.dumps(record) + "\n")
            except OSError as e:
                self._drop("jsonl", self.jsonl_path, e)
        gpu = self.window.device.type != "cpu"
        text = " ".join(f"{k}={_fmt(v)}" for k, v in clean.items()
                        if (gpu or k not in GPU_ONLY) and not (k == "loss_scale" and v == 1.0))
        self.print(f"[{prefix} {name} step {step}] {text}" if name else f"[{prefix} step {step}] {text}")

    def step_done(self, step: int, loss_sum: float, units: float, wait_s: float, last: bool,
                  extra: Callable[[], dict], batches: list = ()) -> None:
        """One optimizer step is done: feed the window (``batches``: the step's host micro-batches)
        and the progress bar; every ``log_every`` steps (and at the last) log the window plus
        ``extra()``. Called on every rank: the window's figures are gathered from all of them."""
        self.window.add(loss_sum, units, wait_s, batches)
        self.advance(1, {"loss": loss_sum / max(units, 1e-9)})
        if step % self.log_every == 0 or last:
            self.log(step, {**self.window.scalars(), **extra()})

    def _drop(self, sink: str, path: str, error: Exception) -> None:
        self.print(f"WARNING: cannot write {path} ({type(error).__name__}: {error}); "
                   f"training continues without it (checkpoints are unaffected)")
        handle = getattr(self, sink)
        setattr(self, sink, None)
        try:
            handle.close()
        except Exception:  # noqa: BLE001 - the file is broken already; closing it may fail again
            pass

    def flush(self) -> None:
        """Push buffered events to disk (after fit; the logger stays open for later evaluations)."""
        if self.tb is not None:
            try:
                self.tb.flush()
            except Exception as e:  # noqa: BLE001
                self._drop("tb", self.tb_path, e)

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
        self.flush()
        for sink, path in (("tb", self.tb_path), ("jsonl", self.jsonl_path)):
            if getattr(self, sink) is not None:
                try:
                    getattr(self, sink).close()
                except Exception as e:  # noqa: BLE001
                    self._drop(sink, path, e)
        self.bar = self.tb = self.jsonl = None


def _fmt(v: float) -> str:
    if isinstance(v, float) and (abs(v) >= 1e4 or (0 < abs(v) < 1e-3)):
        return f"{v:.3e}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def data_scalars(sampler: Any, device: torch.device) -> dict:
    """Peak GPU memory and the sampler's epoch statistics (padding, batch size, fill, balance)."""
    out = {}
    if device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    stats = sampler.epoch_stats() if hasattr(sampler, "epoch_stats") else {}
    for k in ("padding_fraction", "batch_size_mean", "budget_fill", "step_balance"):
        if isinstance(stats.get(k), (int, float)):
            out[f"data_{k}"] = stats[k]
    return out
