"""ZeRO-sharded optimizer state (optim.zero=true) against plain AdamW, including a mid-run resume."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

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

    assert isinstance(trainer.optimizer, ZeroRedundancyOptimizer) == ("optim.zero=false" not in extra)
    # each rank holds state for only part of the parameters
    local = getattr(trainer.optimizer, "optim", trainer.optimizer)
    n_local = sum(p.numel() for g in local.param_groups for p in g["params"])
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


def _epochs_worker(rank, world, out, run, extra):
    """3 batches per epoch, so a checkpoint at step 3 is an epoch boundary (any loader reshards there)."""
    torch.manual_seed(0)
    data = [mb[rank % 2] for mb in micro_batches(3)]
    cfg = make_cfg(os.path.join(out, run), "trainer.max_steps=6", "optim.zero=true", "checkpoint.every_steps=3",
                   "checkpoint.keep_last=0", "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2", *extra)
    trainer = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data)
    if trainer.step:  # resumed on another world size: the whole Adam state, gathered on rank 0
        trainer.optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save(trainer.optimizer.state_dict(), os.path.join(out, "consolidated.pt"))
    trainer.fit()
    torch.save(params_of(trainer.module), os.path.join(out, f"{run}_rank{rank}.pt"))


@pytest.mark.timeout(180)
def test_zero_shards_are_repartitioned_onto_another_world_size(tmp_path):
    """A ZeRO checkpoint of 2 ranks resumes on 3: every parameter's Adam state arrives in its new
    owner's shard unchanged, and training goes on with the same weights on every rank."""
    run_ranks(_epochs_worker, 2, str(tmp_path), "two", ())
    mid = tmp_path / "two" / "checkpoints" / "step_00000003"
    run_ranks(_epochs_worker, 3, str(tmp_path), "three", (f"checkpoint.resume={mid}",))
    expected = {}
    for r in range(2):
        shard = torch.load(mid / f"optimizer_rank{r}.pt", weights_only=False)
        for local, g in enumerate(shard["global_index"]):
            expected[g] = shard["shard"]["state"][local]
    got = torch.load(tmp_path / "consolidated.pt", weights_only=False)["state"]
    assert sorted(got) == sorted(expected) and len(expected) == len(list(FrameMLP().parameters()))
    for g, state in expected.items():
        for k, v in state.items():
            assert torch.equal(got[g][k], v), f"parameter {g}: {k} changed in the re-partition"
    final = [torch.load(tmp_path / f"three_rank{r}.pt") for r in range(3)]
    for k, v in final[0].items():
        assert all(torch.equal(f[k], v) for f in final[1:]), k
        assert torch.isfinite(v).all()


def _bucket_view_worker(rank, world, out):
    torch.manual_seed(0)
    model = FrameMLP()
    data = [mb[rank] for mb in micro_batches(STEPS)]
    cfg = make_cfg(os.path.join(out, "bv"), f"trainer.max_steps={STEPS}", "optim.zero=true",
                   "optim.zero_bucket_view=false", "checkpoint.save_at_end=false", "trainer.clip_grad_norm=0.5",
                   "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2")
    ddptrain.Trainer(model, frame_loss, cfg, data).fit()
    torch.save(params_of(model), os.path.join(out, f"bv_rank{rank}.pt"))


@pytest.mark.timeout(120)
def test_zero_without_bucket_view_matches_plain_adamw(tmp_path):
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


@pytest.mark.timeout(180)
def test_zero_with_bf16_master_weights_matches_plain_and_resumes_exactly(tmp_path):
    """param_dtype=bf16 under ZeRO (each rank casts and updates only its own shard of the fp32
    masters) against the same 2-rank run with a plain optimizer: the same bf16 gradients go into
    the same fp32 AdamW arithmetic, so the fp32 masters (saved as the checkpoint weights) agree
    bit for bit, and the bf16 weights are the rounded masters. The mid-run save at step 3 is in
    the trajectory on purpose: saving must not disturb training (an earlier version swapped the
    parameters' .data to fp32 to save them, which silently detached DDP's gradient hooks)."""
    bf16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16")
    run_ranks(_zero_worker, 2, str(tmp_path), "zero", bf16)
    run_ranks(_zero_worker, 2, str(tmp_path), "plain", (*bf16, "optim.zero=false"))
    zero = [torch.load(tmp_path / f"zero_rank{r}.pt", weights_only=False)["params"] for r in range(2)]
    plain = torch.load(tmp_path / "plain_rank0.pt", weights_only=False)["params"]
    start = params_of(FrameMLP())
    final = f"checkpoints/step_{STEPS:08d}/model.safetensors"
    zero_masters = load_file(str(tmp_path / "zero" / final))
    plain_masters = load_file(str(tmp_path / "plain" / final))
    for k, v in plain.items():
        assert v.dtype == torch.bfloat16 and zero_masters[k].dtype == torch.float32
        assert not torch.equal(v, start[k].to(torch.bfloat16)), f"{k} did not train"
        assert torch.equal(zero_masters[k], plain_masters[k]), k
        for r in range(2):
            assert torch.equal(zero[r][k], zero_masters[k].to(torch.bfloat16)), f"rank {r}: {k}"
    mid = tmp_path / "zero" / "checkpoints" / "step_00000003"
    run_ranks(_zero_worker, 2, str(tmp_path), "resumed", (*bf16, f"checkpoint.resume={mid}"))
    for r in range(2):
        resumed = torch.load(tmp_path / f"resumed_rank{r}.pt", weights_only=False)["params"]
        for k, v in zero[r].items():
            assert torch.equal(resumed[k], v), f"rank {r}: {k} differs after resume"
