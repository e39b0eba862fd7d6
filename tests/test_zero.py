"""ZeRO-sharded optimizer state (optim.zero=true) against plain AdamW, including a mid-run resume."""

from __future__ import annotations

import os

import pytest
import torch

import ddptrain
from _dist import run_ranks
from test_trainer import FrameMLP, concat, frame_loss, make_cfg, micro_batches, params_of

STEPS = 6


def _zero_worker(rank, world, out, run, extra):
    torch.manual_seed(0)
    model = FrameMLP()
    data = [mb[rank] for mb in micro_batches(STEPS)]
    cfg = make_cfg(os.path.join(out, run), f"trainer.max_steps={STEPS}", "optim.zero=true",
                   "checkpoint.every_steps=3", "checkpoint.keep_last=0", "trainer.clip_grad_norm=0.5",
                   "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2", *extra)
    trainer = ddptrain.Trainer(model, frame_loss, cfg, data)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    assert isinstance(trainer.optimizer, ZeroRedundancyOptimizer)
    # each rank holds state for only part of the parameters
    n_local = sum(p.numel() for g in trainer.optimizer.optim.param_groups for p in g["params"])
    n_all = sum(p.numel() for p in model.parameters())
    trainer.fit()
    torch.save({"params": params_of(model), "n_local": n_local, "n_all": n_all},
               os.path.join(out, f"{run}_rank{rank}.pt"))


@pytest.mark.timeout(180)
def test_zero_two_ranks_matches_plain_adamw_one_rank_and_resumes(tmp_path):
    run_ranks(_zero_worker, 2, str(tmp_path), "zero", ())
    shards = [torch.load(tmp_path / f"zero_rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(s["n_local"] < s["n_all"] for s in shards)
    assert sum(s["n_local"] for s in shards) == shards[0]["n_all"]
    mid = tmp_path / "zero" / "checkpoints" / "step_00000003"
    assert (mid / "optimizer_rank0.pt").exists() and (mid / "optimizer_rank1.pt").exists()

    torch.manual_seed(0)
    plain = FrameMLP()
    cfg = make_cfg(tmp_path / "plain", f"trainer.max_steps={STEPS}", "trainer.clip_grad_norm=0.5",
                   "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2")
    ddptrain.Trainer(plain, frame_loss, cfg, [concat(a, b) for a, b in micro_batches(STEPS)]).fit()
    for k, v in params_of(plain).items():
        torch.testing.assert_close(shards[0]["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(shards[1]["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)

    # resume the ZeRO run from step 3 in new processes: bitwise equal to the uninterrupted one
    run_ranks(_zero_worker, 2, str(tmp_path), "resumed", (f"checkpoint.resume={mid}",))
    for r in range(2):
        resumed = torch.load(tmp_path / f"resumed_rank{r}.pt", weights_only=False)["params"]
        for k, v in shards[r]["params"].items():
            assert torch.equal(resumed[k], v), f"rank {r}: {k} differs after ZeRO resume"


def _wrong_world_worker(rank, world, out, ckpt_path):
    cfg = make_cfg(os.path.join(out, "w3"), f"checkpoint.resume={ckpt_path}", "optim.zero=true")
    with pytest.raises(ddptrain.CheckpointError, match="written by 2 processes, this run has 3"):
        ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(1)[0])


@pytest.mark.timeout(180)
def test_resume_with_other_world_size_fails_up_front(tmp_path):
    run_ranks(_zero_worker, 2, str(tmp_path), "zero", ())
    run_ranks(_wrong_world_worker, 3, str(tmp_path), str(tmp_path / "zero" / "checkpoints" / "step_00000003"))


def _bucket_view_worker(rank, world, out):
    torch.manual_seed(0)
    model = FrameMLP()
    data = [mb[rank] for mb in micro_batches(STEPS)]
    cfg = make_cfg(os.path.join(out, "bv"), f"trainer.max_steps={STEPS}", "optim.zero=true",
                   "optim.zero_bucket_view=true", "checkpoint.save_at_end=false", "trainer.clip_grad_norm=0.5",
                   "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2")
    ddptrain.Trainer(model, frame_loss, cfg, data).fit()
    torch.save(params_of(model), os.path.join(out, f"bv_rank{rank}.pt"))


@pytest.mark.timeout(120)
def test_zero_bucket_view_matches_plain_adamw(tmp_path):
    run_ranks(_bucket_view_worker, 2, str(tmp_path))
    torch.manual_seed(0)
    plain = FrameMLP()
    cfg = make_cfg(tmp_path / "plain", f"trainer.max_steps={STEPS}", "trainer.clip_grad_norm=0.5",
                   "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2", "checkpoint.save_at_end=false")
    ddptrain.Trainer(plain, frame_loss, cfg, [concat(a, b) for a, b in micro_batches(STEPS)]).fit()
    for r in range(2):
        got = torch.load(tmp_path / f"bv_rank{r}.pt")
        for k, v in params_of(plain).items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {k}")
