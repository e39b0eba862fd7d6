"""RunLogger (ddptrain/logging.py): a log file that cannot be written never stops training."""

from __future__ import annotations

import json

import pytest
import torch

import ddptrain
from ddptrain.logging import ThroughputWindow
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches


class FullDisk:
    """A file whose writes fail as on a full disk."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def close(self):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("sink", ["jsonl", "tb"])
def test_a_full_disk_under_the_logs_degrades_logging_not_training(tmp_path, capfd, sink):
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=4", "checkpoint.every_steps=2")
    t = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(2)[0])
    if sink == "jsonl":
        t.logger.jsonl = FullDisk()
    else:
        t.logger.tb.add_scalar = lambda *a, **k: FullDisk().write("")
    t.fit()
    assert t.step == 4 and (tmp_path / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    err = capfd.readouterr().err
    path = "metrics.jsonl" if sink == "jsonl" else "tensorboard"
    assert err.count(f"WARNING: cannot write {tmp_path / path}") == 1 and "No space left" in err


def test_metrics_after_fit_reach_the_log(tmp_path):
    """Evaluations after fit() (a test set) are logged: fit leaves the logger open until close()."""
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=2")
    data = micro_batches(2)[0]
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data) as t:
        t.fit()
        t.evaluate(data, prefix="test")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert any(r["split"] == "test" and r["step"] == 2 for r in rows)


def test_throughput_window_rates():
    w = ThroughputWindow()
    w.add(6.0, 3.0, 0.0)
    w.add(2.0, 1.0, 0.0)
    s = w.scalars()
    assert s["loss"] == 2.0 and s["units_per_s"] > 0 and s["steps_per_s"] > 0
    assert w.steps == 0  # a new window


def test_a_cpu_runs_printed_step_line_has_no_gpu_fields(tmp_path, capfd):
    """issue 49 item 15: a CPU run's step line was ~380 characters with GPU fields (TFLOP/s, MFU)
    and a loss scale of 1; metrics.jsonl keeps every field."""
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=2", "logging.log_every=1", "logging.progress_bar=false")
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(2)[0], flops_fn=lambda b: 1e6).fit()
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("[train step")]
    assert lines and all("tflops_per_gpu" not in x and "mfu=" not in x and "loss_scale" not in x for x in lines)
    assert "loss=" in lines[-1] and "lr=" in lines[-1]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"split": "train"' in x]
    assert rows and all("tflops_per_gpu" in r and r["loss_scale"] == 1.0 for r in rows)
