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

    sharded_masters = "trainer.param_dtype=bf16" in extra  # a plain optimizer over the rank's own masters
    assert isinstance(trainer.optimizer, ZeroRedundancyOptimizer) == ("optim.zero=false" not in extra
                                                                      and not sharded_masters)
    # each rank holds state for only part of the parameters
    local = getattr(trainer.optimizer, "optim", trainer.optimizer)
    n_local = sum(p.numel() for g in local.param_groups for p in g["params"])
    n_all = sum(p.numel() for p in model.parameters())
    masters = sum(m.numel() for p, m in trainer.backend.master.pairs if p is not m) if trainer.backend.master else 0
    trainer.fit()
    torch.save({"params": params_of(model), "n_local": n_local, "n_all": n_all, "masters": masters},
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


def _masters_of(ckpt_dir) -> dict:
    """The fp32 masters of a checkpoint by parameter name: from model.safetensors (replicated
    masters), or gathered from the per-rank optimizer shards (sharded masters; global index =
    position among the model's trainable parameters)."""
    names = [n for n, p in FrameMLP().named_parameters() if p.requires_grad]
    shards = sorted(ckpt_dir.glob("optimizer_rank*.pt"))
    if not shards:
        return load_file(str(ckpt_dir / "model.safetensors"))
    out = {}
    for f in shards:
        st = torch.load(f, weights_only=False)
        for g, m in zip(st["global_index"], st["masters"]):
            assert names[g] not in out, f"{names[g]} has a master on two ranks"
            out[names[g]] = m
    return out


BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16")


@pytest.mark.timeout(240)
def test_zero_with_bf16_params_shards_the_masters_matches_plain_and_one_rank_and_resumes_exactly(tmp_path):
    """param_dtype=bf16 under ZeRO: each rank keeps fp32 masters (and Adam state) for its own
    partition only, and broadcasts its updated bf16 parameters. Against the same 2-rank run with
    replicated masters and a plain optimizer, the same bf16 gradients go into the same fp32
    AdamW arithmetic: the masters agree bit for bit, and so do the bf16 weights. Against one
    rank accumulating the two ranks' batches: equal within bf16 rounding of the gradients. The mid-run save at
    step 3 is in the trajectory on purpose (saving must not disturb training), and a resume from
    it in new processes is bitwise the uninterrupted run."""
    run_ranks(_zero_worker, 2, str(tmp_path), "zero", BF16)
    run_ranks(_zero_worker, 2, str(tmp_path), "plain", (*BF16, "optim.zero=false"))
    zero = [torch.load(tmp_path / f"zero_rank{r}.pt", weights_only=False) for r in range(2)]
    plain = torch.load(tmp_path / "plain_rank0.pt", weights_only=False)
    n_all = zero[0]["n_all"]
    assert plain["masters"] == n_all  # replicated: every rank holds every master
    assert all(0 < z["masters"] < n_all for z in zero) and sum(z["masters"] for z in zero) == n_all

    final = f"checkpoints/step_{STEPS:08d}"
    assert not list((tmp_path / "plain" / final).glob("optimizer_rank*.pt"))
    zero_masters, plain_masters = _masters_of(tmp_path / "zero" / final), _masters_of(tmp_path / "plain" / final)
    start = params_of(FrameMLP())
    for k, v in plain["params"].items():
        assert v.dtype == torch.bfloat16 and zero_masters[k].dtype == torch.float32
        assert not torch.equal(v, start[k].to(torch.bfloat16)), f"{k} did not train"
        assert torch.equal(zero_masters[k], plain_masters[k]), k
        for r in range(2):
            assert torch.equal(zero[r]["params"][k], zero_masters[k].to(torch.bfloat16)), f"rank {r}: {k}"
    saved = load_file(str(tmp_path / "zero" / final / "model.safetensors"))
    assert all(saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], v) for k, v in zero[0]["params"].items())

    torch.manual_seed(0)
    one = FrameMLP()
    cfg = make_cfg(tmp_path / "one", f"trainer.max_steps={STEPS}", "trainer.grad_accum_steps=2",
                   "trainer.clip_grad_norm=0.5", "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2", *BF16)
    ddptrain.Trainer(one, frame_loss, cfg, [b for mb in micro_batches(STEPS) for b in mb]).fit()
    one_masters = _masters_of(tmp_path / "one" / final)
    for k, v in one_masters.items():  # bf16 gradients summed in another order: bf16-level differences
        moved = (v - start[k]).abs().max()
        assert (zero_masters[k] - v).abs().max() < 0.02 * moved, k

    mid = tmp_path / "zero" / "checkpoints" / "step_00000003"
    run_ranks(_zero_worker, 2, str(tmp_path), "resumed", (*BF16, f"checkpoint.resume={mid}"))
    for r in range(2):
        resumed = torch.load(tmp_path / f"resumed_rank{r}.pt", weights_only=False)["params"]
        for k, v in zero[r]["params"].items():
            assert torch.equal(resumed[k], v), f"rank {r}: {k} differs after resume"
    for k, v in _masters_of(tmp_path / "resumed" / final).items():
        assert torch.equal(v, zero_masters[k]), f"master {k} differs after resume"


def _reshard_worker(rank, world, out, run, extra):
    torch.manual_seed(0)
    data = [mb[rank % 2] for mb in micro_batches(3)]
    cfg = make_cfg(os.path.join(out, run), "trainer.max_steps=6", "optim.zero=true", "checkpoint.every_steps=3",
                   "checkpoint.keep_last=0", *BF16, *extra)
    trainer = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data)
    if trainer.step:  # resumed on another world size: this rank's masters and Adam state as loaded
        torch.save(trainer._states()[1]["optimizer"].state_dict(), os.path.join(out, f"loaded_rank{rank}.pt"))
    trainer.fit()
    torch.save(params_of(trainer.module), os.path.join(out, f"{run}_rank{rank}.pt"))


@pytest.mark.timeout(180)
def test_sharded_masters_are_repartitioned_onto_another_world_size(tmp_path):
    """Sharded masters saved by 2 ranks resume on 3: every tensor's master and Adam moments
    arrive unchanged at its new owner, and the 3 ranks train on in step."""
    run_ranks(_reshard_worker, 2, str(tmp_path), "two", ())
    mid = tmp_path / "two" / "checkpoints" / "step_00000003"
    run_ranks(_reshard_worker, 3, str(tmp_path), "three", (f"checkpoint.resume={mid}",))

    def by_global(files):
        got = {}
        for f in files:
            st = torch.load(f, weights_only=False)
            for local, (g, m) in enumerate(zip(st["global_index"], st["masters"])):
                assert g not in got
                got[g] = (m, st["shard"]["state"].get(local, {}))
        return got

    saved = by_global(sorted(mid.glob("optimizer_rank*.pt")))
    loaded = by_global([tmp_path / f"loaded_rank{r}.pt" for r in range(3)])
    assert sorted(saved) == sorted(loaded) == list(range(len(list(FrameMLP().parameters()))))
    for g, (m, state) in saved.items():
        assert torch.equal(loaded[g][0], m), f"tensor {g}: master changed in the re-partition"
        assert state and all(torch.equal(loaded[g][1][k], v) for k, v in state.items()), f"tensor {g}: Adam state"
    final = [torch.load(tmp_path / f"three_rank{r}.pt") for r in range(3)]
    for k, v in final[0].items():
        assert all(torch.equal(f[k], v) for f in final[1:]), k
        assert torch.isfinite(v.float()).all()


def _inf_at_step_2(model, batch):
    loss, units = frame_loss(model, batch)
    return loss * batch["scale"], units


def _skip_worker(rank, world, out):
    torch.manual_seed(0)
    data = [dict(mb[rank], scale=torch.tensor(float("inf") if i == 1 else 1.0)) for i, mb in enumerate(micro_batches(3))]
    cfg = make_cfg(os.path.join(out, "skip"), "trainer.max_steps=3", "optim.zero=true", "optim.fused=true",
                   "checkpoint.save_at_end=false", *BF16)
    trainer = ddptrain.Trainer(FrameMLP(), _inf_at_step_2, cfg, data)
    assert trainer.skip_on_device  # the fused kernel skips on the device (found_inf)
    snaps = []
    for micro in [[b] for b in data]:
        trainer.train_step(micro)
        snaps.append({"params": params_of(trainer.module),
                      "masters": [m.detach().clone() for _, m in trainer.backend.master.pairs],
                      "state": {k: v.clone() for st in trainer.optimizer.state.values() for k, v in st.items()
                                if k == "exp_avg"}})
    torch.save({"snaps": snaps, "skipped": trainer.skipped_steps}, os.path.join(out, f"skip_rank{rank}.pt"))


@pytest.mark.timeout(120)
def test_sharded_masters_skip_a_non_finite_step_on_the_device(tmp_path):
    run_ranks(_skip_worker, 2, str(tmp_path))
    for r in range(2):
        got = torch.load(tmp_path / f"skip_rank{r}.pt", weights_only=False)
        first, bad, third = got["snaps"]
        assert got["skipped"] == 1
        for k, v in first["params"].items():
            assert torch.equal(bad["params"][k], v), f"rank {r}: {k} moved in the skipped step"
            assert not torch.equal(third["params"][k], v), f"rank {r}: {k} did not train after the skip"
        assert all(torch.equal(a, b) for a, b in zip(first["masters"], bad["masters"]))
        assert all(torch.equal(first["state"][k], bad["state"][k]) for k in first["state"])


# ----------------------------------------------------------------------------- one rank <-> several (issue 49 item 10)


def _solo_worker(rank, world, out, run, extra):
    """Steps 1-3 and 4-6 are 3 global batches an epoch (an epoch boundary at the save): 2 ranks
    take one micro-batch each, 1 rank both (``trainer.grad_accum_steps=2``), the same global batch."""
    torch.manual_seed(0)
    data = [mb[rank] for mb in micro_batches(3)] if world == 2 else [b for mb in micro_batches(3) for b in mb]
    cfg = make_cfg(os.path.join(out, run), "trainer.max_steps=6", "optim.zero=true", "checkpoint.every_steps=3",
                   "checkpoint.keep_last=0", "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2",
                   f"trainer.grad_accum_steps={3 - world}", *extra)
    trainer = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data)
    if trainer.step:  # resumed: the optimizer state (and masters) as loaded, in global-index form
        trainer.optimizer.zero_grad()
        state = trainer._states()[1 if world == 2 else 0]["optimizer"]
        loaded = {"state": state.state_dict(), "ema": trainer.ema.state_dict() if trainer.ema else None}
        if trainer.backend.master is not None and world == 1:
            loaded["masters"] = {k: v.clone() for k, v in trainer.backend.master.state_dict(trainer.module).items()}
        torch.save(loaded, os.path.join(out, f"{run}_loaded_rank{rank}.pt"))
    trainer.fit()
    state = trainer.backend.master.state_dict(trainer.module) if trainer.backend.master is not None and world == 1 else None
    torch.save({"params": params_of(trainer.module), "masters": state}, os.path.join(out, f"{run}_rank{rank}.pt"))


def _plain_named_order(model):
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in ddptrain.optim.param_groups(model, 0.0) for p in g["params"]]


def _in_process(fn, *args):
    """A one-rank run in this process (no process group), as the user's ``python train.py``."""
    fn(0, 1, *args)


def _global_states(folder, names):
    """{tensor name: (Adam state, master or None)} of a sharded checkpoint's optimizer files."""
    out = {}
    for f in sorted(folder.glob("optimizer_rank*.pt")):
        st = torch.load(f, weights_only=False)
        for local, g in enumerate(st["global_index"]):
            out[names[g]] = (st["shard"]["state"].get(local, {}), st["masters"][local] if "masters" in st else None)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [(), (*BF16, "optim.shard_grads=true", "ema.enabled=true")],
                         ids=["zero", "sharded_masters_and_grads_ema"])
def test_a_sharded_checkpoint_resumes_on_one_rank_and_a_one_rank_checkpoint_on_two(tmp_path, extra):
    """2 ranks -> 1: the plain optimizer gets every shard's Adam state (and the exact fp32 masters,
    which the weights file holds only rounded to bf16), and the run ends where the uninterrupted
    2-rank run ends. 1 rank -> 2: each rank takes its partition, and the run ends where the
    uninterrupted 1-rank run ends."""
    model = FrameMLP()
    plain_order = _plain_named_order(model)  # the plain optimizer's tensors, and ZeRO's global index
    names = plain_order if not extra else [n for n, p in model.named_parameters() if p.requires_grad]
    # 2 ranks uninterrupted, then 1 rank from its step 3
    run_ranks(_solo_worker, 2, str(tmp_path), "two", extra)
    mid = tmp_path / "two" / "checkpoints" / "step_00000003"
    _in_process(_solo_worker, str(tmp_path), "two_to_one", (*extra, f"checkpoint.resume={mid}"))
    loaded = torch.load(tmp_path / "two_to_one_loaded_rank0.pt", weights_only=False)
    saved = _global_states(mid, names)
    assert sorted(loaded["state"]["state"]) == list(range(len(plain_order)))
    for i, name in enumerate(plain_order):
        adam, master = saved[name]
        assert adam and all(torch.equal(loaded["state"]["state"][i][k], v) for k, v in adam.items()), name
        if master is not None:
            assert torch.equal(loaded["masters"][name], master), f"{name}: the fp32 master, not its bf16 rounding"
    if loaded["ema"] is not None:  # the EMA shards, gathered
        for r in range(2):
            for k, v in torch.load(mid / f"ema_rank{r}.pt", weights_only=False)["tensors"].items():
                assert torch.equal(loaded["ema"]["tensors"][k], v), k
    two = torch.load(tmp_path / "two_rank0.pt", weights_only=False)["params"]
    one = torch.load(tmp_path / "two_to_one_rank0.pt", weights_only=False)["params"]
    for k, v in two.items():  # 1 rank accumulating the 2 ranks' batches: the same sums, another order
        torch.testing.assert_close(one[k], v, rtol=1e-5, atol=1e-6, msg=k)

    # 1 rank uninterrupted, then 2 ranks from its step 3
    _in_process(_solo_worker, str(tmp_path), "one", extra)
    mid = tmp_path / "one" / "checkpoints" / "step_00000003"
    assert not list(mid.glob("optimizer_rank*.pt"))  # one process: the optimizer is saved once
    run_ranks(_solo_worker, 2, str(tmp_path), "one_to_two", (*extra, f"checkpoint.resume={mid}"))
    full = torch.load(mid / "trainer.pt", weights_only=False)["optimizer"]["state"]
    dealt = {}
    for r in range(2):
        st = torch.load(tmp_path / f"one_to_two_loaded_rank{r}.pt", weights_only=False)["state"]
        for local, g in enumerate(st["global_index"]):
            assert names[g] not in dealt, f"{names[g]} on two ranks"
            dealt[names[g]] = st["shard"]["state"][local]
    assert sorted(dealt) == sorted(plain_order)
    for i, name in enumerate(plain_order):
        assert all(torch.equal(dealt[name][k], v) for k, v in full[i].items()), name
    one = torch.load(tmp_path / "one_rank0.pt", weights_only=False)["params"]
    for r in range(2):
        two = torch.load(tmp_path / f"one_to_two_rank{r}.pt", weights_only=False)["params"]
        for k, v in one.items():
            torch.testing.assert_close(two[k], v, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {k}")
