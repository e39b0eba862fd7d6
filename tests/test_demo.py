"""The README's main command (`make demo`) in a short form: both stages of the ASR demo, with the
shipped configs, the stage-2 `init_from` hand-over and the before/after report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stage(config, out, *extra):
    cmd = [sys.executable, os.path.join(ROOT, "examples", "finetune_asr.py"), "--config", os.path.join(ROOT, config),
           f"data.tokenizer={out}/tokenizer.json", "logging.progress_bar=false", "trainer.max_steps=6",
           "trainer.eval_every=0", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.timeout(900)
def test_demo_both_stages_short(tmp_path):
    out1 = stage("configs/asr_demo.yaml", tmp_path, f"trainer.output_dir={tmp_path}/base")
    assert "=== results" in out1 and "base/test.jsonl: WER" in out1
    out2 = stage("configs/asr_demo_accent.yaml", tmp_path, f"trainer.output_dir={tmp_path}/accent",
                 f"model.init_from={tmp_path}/base")
    assert "initialised 140 tensors" in out2 and "before fine-tuning" in out2
    report = json.load(open(tmp_path / "accent" / "report.json"))
    accent = "examples/data/digits/accent/test.jsonl"
    # the "before" score is the stage-1 model's: the same numbers stage 1 reported for that set
    stage1 = json.load(open(tmp_path / "base" / "report.json"))["after"][accent]
    assert report["before"][accent] == stage1
