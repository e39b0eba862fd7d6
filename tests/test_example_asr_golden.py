"""Golden losses: the demo recipe's first logged training losses against stored values.

Runs ``examples/finetune_asr.py``'s ``main()`` on ``configs/asr_demo.yaml`` in this process,
changed only where a test must be small: a few steps logged one by one, a smaller Conformer, a
short warmup (so the updates move the loss), no evaluation or test sets. Everything else is the
shipped demo: its training manifest, fbank features, SpecAugment in one DataLoader worker,
dropout, AdamW, clipping, the warmup-cosine schedule, the length-bucketing sampler.

What it guards: a refactor of the loop, the data path or the example that is meant to change
nothing must leave these numbers alone; a change that is meant to change them (a new default,
another augmentation stream) updates GOLDEN in the same commit, saying why.

Tolerance: relative 1e-5. On one machine the run is bit-exact (repeated runs reproduce the
stored values to the last digit): the trajectory depends only on the seeds. What may differ on
another machine is float rounding, where CPU kernels (AVX2 vs AVX-512, another oneDNN) sum in
another order. Measured here by changing the order through the thread count (the test itself
pins one thread): 1e-7 relative at step 1, 9e-7 at step 6, so 1e-5 leaves a 10x margin. Real
changes are far larger: another data seed (batches and masks), a warmup one step longer or a
clipping threshold of 4 instead of 5 move a loss by 5e-3 relative or more.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_asr  # noqa: E402

STEPS = 6
# Loss per target token at steps 1..STEPS, from this test's run at the commit that added it
# (torch 2.11 CPU). Update only with a change that is meant to change training, and say so.
GOLDEN = [3.859572004563738, 3.599123932594477, 3.4723144028903037, 3.127213838084644, 3.2969517371466543,
          3.1174705649321934]
RTOL = 1e-5


@pytest.mark.timeout(120)
def test_demo_recipe_logs_the_golden_losses(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the Trainer then keeps one intra-op thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    manifest = os.path.join(ROOT, "examples", "data", "digits", "base", "train.jsonl")
    try:
        finetune_asr.main([
            "--config", os.path.join(ROOT, "configs", "asr_demo.yaml"),
            f"trainer.output_dir={tmp_path}/run", f"data.tokenizer={tmp_path}/tokenizer.json",
            f"data.train_manifest={manifest}", 'data.eval_manifest=""', "demo.test_manifests=[]",
            f"trainer.max_steps={STEPS}", "logging.log_every=1", "logging.progress_bar=false",
            "checkpoint.keep_best=0", "checkpoint.save_at_end=false", "scheduler.warmup_steps=2",
            "model.d_model=32", "model.num_heads=2", "model.ffn_dim=64", "model.num_layers=1",
        ])
    finally:
        torch.set_num_threads(threads)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        train = [r for r in map(json.loads, f) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in train]
    print("losses:", losses)
    assert losses == pytest.approx(GOLDEN, rel=RTOL), (
        f"the demo's first {STEPS} losses changed:\n  got    {losses}\n  golden {GOLDEN}")
