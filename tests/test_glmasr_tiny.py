"""Issue 30 item 16: GLM-ASR's CPU mode, configs/glmasr_tiny.yaml as shipped: a tiny random-init
GlmAsr (glmasr.preset=tiny, the recipe's byte-level tokenizer, no download) on the shipped digits;
the loss falls and the eval reports WER/CER of greedy generation."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_glmasr as fg  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tests/conftest.py: tiny steps, shared cores


@pytest.mark.timeout(240)
def test_the_tiny_config_trains_on_the_digits_and_reports_wer(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's manifests are relative to the checkout
    out = tmp_path / "run"
    result = fg.main(["--config", "configs/glmasr_tiny.yaml", f"trainer.output_dir={out}", "logging.tensorboard=false",
                      "logging.progress_bar=false"])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if r.get("split") == "train"]
    assert len(losses) >= 10 and losses[-1] < 0.4 * losses[0], losses
    assert {"loss", "wer", "cer"} <= set(result) and all(math.isfinite(result[k]) for k in ("wer", "cer"))
    assert result["cer"] < 1.0, result  # generation is no longer the random model's garbage
    assert any(r.get("split") == "eval" and "wer" in r for r in rows)
