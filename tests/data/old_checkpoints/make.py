"""Writes the checkpoint folders of tests/test_old_checkpoints.py with the code it is run with.

They were written by ddptrain at 7a106d0 (before the optimizer backends of ddptrain/update/),
so the test checks that a checkpoint written by that code still resumes, and continues to the
losses that code recorded for the uninterrupted run. Run from the repository root::

    PYTHONPATH=$PWD:$PWD/tests OMP_NUM_THREADS=1 python tests/data/old_checkpoints/make.py

Each set-up trains FrameMLP (tests/test_trainer.py) for STEPS steps, saving at step SAVED; the
folder of step SAVED is kept (trimmed of logs), and expected.json records the losses of the
steps after it. Nothing here is run by the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

STEPS, SAVED = 6, 3
COMMON = ("trainer.clip_grad_norm=0.5", "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2",
          "checkpoint.every_steps=3", "checkpoint.keep_last=0", f"trainer.max_steps={STEPS}")
BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.fused=true")
# name -> (ranks, overrides)
SETUPS = {
    "fp32": (1, ()),
    "bf16_masters": (1, BF16),
    "bf16_masters_ema": (1, (*BF16, "ema.enabled=true", "ema.decay=0.5")),
    "offload": (1, (*BF16, "optim.offload=cpu", "optim.offload_chunk_mb=0.00003", "trainer.grad_accum_steps=2")),
    "zero_2ranks": (2, ("optim.zero=true", "ema.enabled=true", "ema.decay=0.5")),
    "sharded_masters_2ranks": (2, (*BF16, "optim.zero=true")),
}


def run(rank, world, out, name, extra, resume=None):
    """Train one set-up; returns (its losses, per step)."""
    import ddptrain
    from test_trainer import FrameMLP, concat, frame_loss, make_cfg, micro_batches

    torch.manual_seed(0)
    batches = micro_batches(STEPS)
    if world == 1:
        accum = "trainer.grad_accum_steps=2" in extra
        data = [b for mb in batches for b in mb] if accum else [concat(a, b) for a, b in batches]
    else:
        data = [mb[rank] for mb in batches]
    cfg = make_cfg(os.path.join(out, name), *COMMON, *extra, *([f"checkpoint.resume={resume}"] if resume else []))
    losses = []
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data) as trainer:
        real = trainer.train_step

        def step(micro):
            got = real(micro)
            losses.append(got["loss_sum"] / max(got["units"], 1e-12))
            return got

        trainer.train_step = step
        trainer.fit()
    return losses


def _worker(rank, world, out, name, extra):
    losses = run(rank, world, out, name, extra)
    if rank == 0:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(losses, f)


def main() -> None:
    from _dist import run_ranks

    torch.set_num_threads(1)
    expected = {}
    with tempfile.TemporaryDirectory() as out:
        for name, (world, extra) in SETUPS.items():
            if world == 1:
                losses = run(0, 1, out, name, extra)
            else:
                run_ranks(_worker, world, out, name, extra, timeout=300)
                with open(os.path.join(out, f"{name}.json")) as f:
                    losses = json.load(f)
            src = os.path.join(out, name, "checkpoints", f"step_{SAVED:08d}")
            dst = os.path.join(HERE, name)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
            expected[name] = {"ranks": world, "overrides": list(extra), "losses_after": losses[SAVED:]}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump({"steps": STEPS, "saved": SAVED, "common": list(COMMON), "setups": expected}, f, indent=1)


if __name__ == "__main__":
    main()
