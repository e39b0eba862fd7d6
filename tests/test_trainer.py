"""Trainer equivalences (ranks vs accumulation vs big batch), exact resume, AMP and skip logic.

Distributed cases run 2 gloo processes on CPU through tests/_dist.py (hard timeout, a failure on
one rank ends all ranks). Results travel back through files in tmp_path.
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
from torch import nn

import ddptrain
from ddptrain import checkpoint as ckpt
from ddptrain import weights
from ddptrain.optim import is_zero

from _dist import run_ranks

FEAT = 6


class FrameMLP(nn.Module):
    """Per-frame regressor over padded (B, T, F) sequences; dropout exercises RNG handling."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def frame_loss(model, batch):
    """Sum of squared errors over valid frames; units = valid frames (the loss contract)."""
    pred = model(batch["x"])
    mask = torch.arange(batch["x"].shape[1])[None, :] < batch["lens"][:, None]
    err = ((pred.float() - batch["y"]) ** 2) * mask
    return err.sum(), mask.sum()


def make_batch(gen: torch.Generator, n: int, max_len: int) -> dict:
    lens = torch.randint(1, max_len + 1, (n,), generator=gen)
    x = torch.randn(n, max_len, FEAT, generator=gen)
    y = x.sum(-1) * 0.3 + torch.randn(n, max_len, generator=gen) * 0.1
    return {"x": x, "y": y, "lens": lens}


def concat(a: dict, b: dict) -> dict:
    t = max(a["x"].shape[1], b["x"].shape[1])
    pad = lambda v, fill=0.0: nn.functional.pad(v, (0, 0, 0, t - v.shape[1]) if v.ndim == 3 else (0, t - v.shape[1]), value=fill)  # noqa: E731
    return {"x": torch.cat([pad(a["x"]), pad(b["x"])]), "y": torch.cat([pad(a["y"]), pad(b["y"])]),
            "lens": torch.cat([a["lens"], b["lens"]])}


def micro_batches(steps: int) -> list[list[dict]]:
    """steps x 2 micro-batches with very different lengths, so normalisation errors show."""
    gen = torch.Generator().manual_seed(123)
    return [[make_batch(gen, 3, 4), make_batch(gen, 2, 13)] for _ in range(steps)]


def make_cfg(tmp, *extra):
    return ddptrain.load_config(None, [f"trainer.output_dir={tmp}", "logging.progress_bar=false",
                                       "logging.log_every=1", "optim.lr=0.05", "optim.weight_decay=0.1",
                                       "trainer.clip_grad_norm=0", *extra])


def params_of(model):
    return {k: v.detach().clone() for k, v in weights.unwrap(model).state_dict().items()}


# ----------------------------------------------------------------------------- equivalences


def _equiv_worker(rank, world, out, steps):
    torch.manual_seed(0)
    model = FrameMLP()
    data = [mb[rank] for mb in micro_batches(steps)]
    cfg = make_cfg(os.path.join(out, "run2"), f"trainer.max_steps={steps}", "checkpoint.save_at_end=false")
    trainer = ddptrain.Trainer(model, frame_loss, cfg, data)
    trainer.fit()
    if rank == 0:
        torch.save(params_of(model), os.path.join(out, "ranks2.pt"))


@pytest.mark.timeout(120)
def test_two_ranks_equal_one_rank_big_batch_and_accumulation(tmp_path):
    steps = 4
    run_ranks(_equiv_worker, 2, str(tmp_path), steps)
    two_ranks = torch.load(tmp_path / "ranks2.pt")

    torch.manual_seed(0)
    big = FrameMLP()
    cfg = make_cfg(tmp_path / "big", f"trainer.max_steps={steps}", "checkpoint.save_at_end=false")
    ddptrain.Trainer(big, frame_loss, cfg, [concat(a, b) for a, b in micro_batches(steps)]).fit()

    torch.manual_seed(0)
    acc = FrameMLP()
    cfg = make_cfg(tmp_path / "acc", f"trainer.max_steps={steps}", "trainer.grad_accum_steps=2",
                   "checkpoint.save_at_end=false")
    ddptrain.Trainer(acc, frame_loss, cfg, [b for mb in micro_batches(steps) for b in mb]).fit()

    torch.manual_seed(0)
    start = params_of(FrameMLP())
    for k, v in params_of(big).items():
        assert not torch.allclose(v, start[k]), f"{k} did not train"
        torch.testing.assert_close(two_ranks[k], v, rtol=1e-5, atol=1e-6, msg=f"2 ranks vs big batch: {k}")
        torch.testing.assert_close(params_of(acc)[k], v, rtol=1e-5, atol=1e-6, msg=f"accumulation vs big batch: {k}")


@pytest.mark.parametrize("clip,param_dtype", [(0.0, "fp32"), (0.05, "fp32"), (0.05, "bf16")])
def test_step_decided_on_device_equals_host_decision(tmp_path, clip, param_dtype):
    """A fused AdamW (skip and clip decided on the device, no host sync before the step, the
    normalisation and clip factor applied inside the kernel as its grad_scale) trains to the same
    weights as the foreach AdamW (decided on the host), with clipping active or not, with fp32
    parameters or bf16 ones and fp32 masters."""
    runs = {}
    for fused in ("true", "false"):
        torch.manual_seed(0)
        model = FrameMLP()
        cfg = make_cfg(tmp_path / fused, "trainer.max_steps=4", f"optim.fused={fused}",
                       f"trainer.clip_grad_norm={clip}", "checkpoint.save_at_end=false",
                       *([f"trainer.param_dtype={param_dtype}", "trainer.precision=bf16"] if param_dtype == "bf16" else []))
        trainer = ddptrain.Trainer(model, frame_loss, cfg, [b for mb in micro_batches(4) for b in mb])
        assert trainer.skip_on_device == (fused == "true")
        norms = [trainer.train_step([b])["grad_norm"] for b in [b for mb in micro_batches(4) for b in mb][:4]]
        if clip:
            assert min(norms) > clip, "the test must exercise clipping"
        runs[fused] = params_of(model)
    torch.manual_seed(0)
    start = params_of(FrameMLP())
    for k, v in runs["false"].items():
        assert not torch.allclose(v.float(), start[k]), f"{k} did not train"
        torch.testing.assert_close(runs["true"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_mean_of_means_would_differ():
    """Guard that the test data really distinguishes global-unit normalisation from per-batch means."""
    a, b = micro_batches(1)[0]
    means = (a["lens"].sum().item(), b["lens"].sum().item())
    assert means[0] != means[1]


# ----------------------------------------------------------------------------- resume


class ListLoader:
    """A re-iterable list of batches with a DistributedSampler-like set_epoch (generic path)."""

    def __init__(self, batches):
        self.batches = batches
        self.epoch = 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.epoch))
        return iter([self.batches[i] for i in order])

    @property
    def sampler(self):
        return self

    def set_epoch(self, epoch):
        self.epoch = epoch


def _resume_worker(rank, world, out, run, resume_from):
    torch.manual_seed(0)
    model = FrameMLP(dropout=0.2)
    gen = torch.Generator().manual_seed(7 + rank)
    data = ListLoader([make_batch(gen, 2, 5 + i) for i in range(3)])
    cfg = make_cfg(os.path.join(out, run), "trainer.max_steps=8", "trainer.grad_accum_steps=1",
                   "checkpoint.every_steps=4", "checkpoint.keep_last=0", "scheduler.name=warmup_cosine",
                   "scheduler.warmup_steps=2", f"checkpoint.resume={resume_from}")
    trainer = ddptrain.Trainer(model, frame_loss, cfg, data)
    trainer.fit()
    torch.save({"params": params_of(model), "optim": trainer.optimizer.state_dict(),
                "sched": trainer.scheduler.state_dict()}, os.path.join(out, f"{run}_rank{rank}.pt"))


@pytest.mark.timeout(180)
def test_resume_is_bitwise_identical(tmp_path):
    """8 steps straight vs (8 steps with a save at 4) -> new processes resume from step 4."""
    run_ranks(_resume_worker, 2, str(tmp_path), "full", "none")
    mid = tmp_path / "full" / "checkpoints" / "step_00000004"
    assert (mid / "COMPLETE").exists()
    run_ranks(_resume_worker, 2, str(tmp_path), "resumed", str(mid))
    for rank in range(2):
        a = torch.load(tmp_path / f"full_rank{rank}.pt", weights_only=False)
        b = torch.load(tmp_path / f"resumed_rank{rank}.pt", weights_only=False)
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), f"rank {rank} param {k} differs after resume"
        for pid, st in a["optim"]["state"].items():
            for name, v in st.items():
                assert torch.equal(v, b["optim"]["state"][pid][name]), f"optimizer {pid}.{name} differs"
        assert a["sched"]["last_epoch"] == b["sched"]["last_epoch"] == 8


def test_resume_auto_picks_newest_complete(tmp_path):
    cfg = make_cfg(tmp_path, "trainer.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=2")
    data = micro_batches(3)[0] * 3
    torch.manual_seed(0)
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data).fit()
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_00000004", "step_00000006"]  # keep_last=2
    # a half-written newer checkpoint (no marker) and a stale temp folder must be ignored
    (root / "step_00000099").mkdir()
    (root / ".tmp-step_00000100").mkdir()
    assert ckpt.find_latest(str(root)).endswith("step_00000006")
    cfg2 = make_cfg(tmp_path, "trainer.max_steps=8", "checkpoint.resume=auto")
    t2 = ddptrain.Trainer(FrameMLP(), frame_loss, cfg2, data)
    assert t2.step == 6


def test_missing_checkpoint_path_is_a_clear_error(tmp_path):
    cfg = make_cfg(tmp_path, f"checkpoint.resume={tmp_path}/nope")
    with pytest.raises(ckpt.CheckpointError, match="not found"):
        ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(1)[0])


def test_unwritable_output_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = make_cfg(blocker / "run")
    with pytest.raises(ckpt.CheckpointError, match="not writable"):
        ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(1)[0])


# ----------------------------------------------------------------------------- precision and skips


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_precisions_train_on_cpu(tmp_path, precision):
    torch.manual_seed(0)
    model = FrameMLP()
    data = [b for mb in micro_batches(4) for b in mb]
    cfg = make_cfg(tmp_path, f"trainer.precision={precision}", "trainer.max_epochs=3", "optim.lr=0.01")
    trainer = ddptrain.Trainer(model, frame_loss, cfg, data, eval_data=data)
    before = trainer.evaluate()["loss"]
    after = trainer.fit()["loss"]
    assert after < before * 0.9, (before, after)
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    train = [l for l in lines if l["split"] == "train"]
    assert all("grad_norm" in l and "loss_scale" in l and "lr" in l for l in train)
    if precision == "fp16":
        assert train[-1]["loss_scale"] > 1.0


class InfOnStep:
    """Loss wrapper that makes rank 1's loss infinite on chosen optimizer steps."""

    def __init__(self, bad_calls, rank):
        self.calls, self.bad, self.rank = 0, set(bad_calls), rank

    def __call__(self, model, batch):
        loss, units = frame_loss(model, batch)
        self.calls += 1
        if self.rank == 1 and self.calls in self.bad:
            loss = loss * float("inf")
        return loss, units


def _inf_worker(rank, world, out, variant):
    precision, zero, fused = variant.split("+")[0], "zero" in variant, "fused" in variant
    torch.manual_seed(0)
    model = FrameMLP()
    data = [mb[rank] for mb in micro_batches(5)]
    cfg = make_cfg(os.path.join(out, variant), "trainer.max_steps=5", f"trainer.precision={precision}",
                   f"optim.zero={zero}", f"optim.fused={fused}",
                   *(["trainer.param_dtype=bf16"] if "masters" in variant else []),
                   f"optim.fused_update={'fused_update' in variant}",
                   "checkpoint.save_at_end=false", "scheduler.name=warmup_linear", "scheduler.warmup_steps=3",
                   "trainer.fp16_init_scale=256")  # no routine overflow: only the injected inf skips
    trainer = ddptrain.Trainer(model, InfOnStep({3}, rank), cfg, data)
    snapshots = []
    for i, mb in enumerate(data):
        before = params_of(model)
        out_step = trainer.train_step([mb])  # advances trainer.step itself
        changed = any(not torch.equal(before[k], v) for k, v in params_of(model).items())
        opt = trainer.optimizer.optim if is_zero(trainer.optimizer) else trainer.optimizer
        adam_steps = {float(st["step"]) for st in opt.state.values()}
        snapshots.append({"stepped": out_step["stepped"], "changed": changed,
                          "sched": trainer.scheduler.last_epoch, "adam_steps": adam_steps,
                          "on_device": trainer.skip_on_device})
    torch.save({"snap": snapshots, "skipped": trainer.skipped_steps}, os.path.join(out, f"{variant}_{rank}.pt"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["fp32", "fp16", "fp16+zero", "fp32+fused", "fp32+fused+zero", "bf16+fused+masters",
                                     "bf16+fused+masters+zero", "bf16+fused_update+masters"])
def test_inf_on_one_rank_skips_step_on_all_ranks(tmp_path, variant):
    """GradScaler unscale/skip logic holds with plain and ZeRO-sharded optimizers; with a fused
    Adam (fp32/bf16) the skip is decided on the device (found_inf), with the same outcome: no
    change to the weights, Adam's step count or the schedule."""
    run_ranks(_inf_worker, 2, str(tmp_path), variant)
    for rank in range(2):
        res = torch.load(tmp_path / f"{variant}_{rank}.pt", weights_only=False)
        snap = res["snap"]
        assert [s["stepped"] for s in snap] == [True, True, False, True, True], (rank, snap)
        assert not snap[2]["changed"], "params changed on the skipped step"
        assert [s["sched"] for s in snap] == [1, 2, 2, 3, 4], "scheduler advanced on a skipped step"
        assert res["skipped"] == 1
        assert [s["adam_steps"] for s in snap] == [{1.0}, {2.0}, {2.0}, {3.0}, {4.0}]
        assert all(s["on_device"] == ("fused" in variant) for s in snap)


def test_consecutive_nonfinite_steps_abort(tmp_path):
    def always_nan(model, batch):
        loss, units = frame_loss(model, batch)
        return loss * float("nan"), units

    cfg = make_cfg(tmp_path, "trainer.max_steps=10", "trainer.max_nonfinite_steps=3")
    trainer = ddptrain.Trainer(FrameMLP(), always_nan, cfg, [b for mb in micro_batches(5) for b in mb])
    start = params_of(trainer.model)
    with pytest.raises(ddptrain.TrainingError, match="3 consecutive non-finite.*step_00000003"):
        trainer.fit()
    assert trainer.step == 3  # aborted at the third step, after saving the last good state
    reloaded = FrameMLP()
    weights.load_weights(reloaded, str(tmp_path / "checkpoints" / "step_00000003"))
    for k, v in params_of(reloaded).items():
        assert torch.equal(v, start[k]), "the saved state is not the last good (untouched) one"


def test_error_in_loss_names_rank_step_and_utterances(tmp_path):
    def broken(model, batch):
        raise ValueError("bad batch")

    data = [dict(b, ids=["utt-a", "utt-b"]) for b in micro_batches(1)[0]]
    trainer = ddptrain.Trainer(FrameMLP(), broken, make_cfg(tmp_path), data)
    with pytest.raises(RuntimeError, match=r"rank 0, step 1.*bad batch.*utt-a, utt-b"):
        trainer.fit()


# ----------------------------------------------------------------------------- empty batches


def _empty_batch_worker(rank, world, out):
    torch.manual_seed(0)
    model = FrameMLP()
    data = [dict(mb[rank], ids=[f"u{rank}"] * len(mb[rank]["lens"])) for mb in micro_batches(3)]
    if rank == 1:  # all utterances of rank 1's second batch were skipped as bad data
        data[1] = {"x": torch.zeros(0, 1, FEAT), "y": torch.zeros(0, 1), "lens": torch.zeros(0, dtype=torch.long),
                   "ids": []}
    cfg = make_cfg(os.path.join(out, "empty"), "trainer.max_steps=3", "checkpoint.save_at_end=false")
    ddptrain.Trainer(model, frame_loss, cfg, data).fit()
    if rank == 0:
        torch.save(params_of(model), os.path.join(out, "empty.pt"))


@pytest.mark.timeout(120)
def test_empty_batch_on_one_rank_counts_as_zero_units(tmp_path):
    """An all-skipped batch keeps DDP in step and contributes nothing: equal to a big-batch run
    whose second step holds rank 0's micro-batch only."""
    run_ranks(_empty_batch_worker, 2, str(tmp_path))
    torch.manual_seed(0)
    ref = FrameMLP()
    mbs = micro_batches(3)
    data = [concat(*mbs[0]), mbs[1][0], concat(*mbs[2])]
    ddptrain.Trainer(ref, frame_loss, make_cfg(tmp_path / "ref", "trainer.max_steps=3",
                                               "checkpoint.save_at_end=false"), data).fit()
    got = torch.load(tmp_path / "empty.pt")
    for k, v in params_of(ref).items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


# ----------------------------------------------------------------------------- garbage collection


def test_gc_is_paced_by_steps_and_restored(tmp_path):
    """Automatic GC is off inside fit(); young collections every N steps, full ones at epoch end."""
    events = []

    def loss(model, batch):
        events.append(("step", gc.isenabled()))
        return frame_loss(model, batch)

    def on_gc(phase, info):
        if phase == "stop":
            events.append(("gc", info["generation"]))

    data = [b for mb in micro_batches(4) for b in mb]  # 8 batches: one epoch = 8 steps
    cfg = make_cfg(tmp_path, "trainer.max_epochs=1", "trainer.gc_every_steps=3", "checkpoint.save_at_end=false")
    trainer = ddptrain.Trainer(FrameMLP(), loss, cfg, data)
    assert gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        trainer.fit()
    finally:
        gc.callbacks.remove(on_gc)
    assert gc.isenabled()  # given back
    assert all(enabled is False for kind, enabled in events if kind == "step")
    seq = ["s" if kind == "step" else f"g{v}" for kind, v in events]
    assert "".join(seq) == "g2sssg1sssg1ssg2", seq

    events.clear()
    cfg = make_cfg(tmp_path, "trainer.max_epochs=1", "trainer.gc_every_steps=0", "checkpoint.save_at_end=false")
    ddptrain.Trainer(FrameMLP(), loss, cfg, data).fit()
    assert [v for kind, v in events if kind == "step"] == [True] * 8  # Python's own collector stays on

    with pytest.raises(ValueError, match="gc_every_steps"):
        ddptrain.Trainer(FrameMLP(), loss, make_cfg(tmp_path, "trainer.gc_every_steps=-1"), data)


class _GcProbe(torch.utils.data.Dataset):
    """Batches that carry whether their DataLoader worker had Python's automatic GC on."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return dict(self.batches[i], gc_on=torch.tensor(gc.isenabled()))


def test_loader_workers_keep_automatic_gc(tmp_path):
    """Workers forked while fit() has the collector off must not inherit that (they would leak cycles)."""
    seen = []

    def loss(model, batch):
        seen.append(bool(batch.pop("gc_on")))
        return frame_loss(model, batch)

    data = [b for mb in micro_batches(2) for b in mb]
    loader = torch.utils.data.DataLoader(_GcProbe(data), batch_size=None, num_workers=1)
    cfg = make_cfg(tmp_path, "trainer.max_epochs=1", "checkpoint.save_at_end=false")
    ddptrain.Trainer(FrameMLP(), loss, cfg, loader).fit()
    assert seen == [True] * len(data)


def test_host_unit_counts_are_not_copied_to_the_device_per_micro_batch(tmp_path):
    """A loss_fn returning a Python int (the minimal example does): the step must not turn it
    into a tensor from host data (on a GPU a blocking host-to-device copy per micro-batch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostTensors(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.lift_fresh.default:  # a tensor made from host data
                HostTensors.count += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=3")
    trainer = ddptrain.Trainer(FrameMLP(), lambda m, b: (frame_loss(m, b)[0], int(b["lens"].sum())), cfg,
                               micro_batches(1)[0])
    batch = micro_batches(1)[0][0]
    trainer.train_step([batch])  # the first step makes the optimizer's state
    counts = []
    for n in (1, 4):
        HostTensors.count = 0
        with HostTensors():
            trainer.train_step([batch] * n)
        counts.append(HostTensors.count)
    assert counts[0] == counts[1], f"host-made tensors per step grow with micro-batches: {counts}"


def test_every_training_step_runs_in_train_mode_after_evaluations(tmp_path):
    """train_step walks the modules to set train mode only after an evaluation left them in eval
    mode: every training forward still sees dropout on, every evaluation forward sees it off."""
    seen = []

    def loss(model, batch):
        seen.append(("train" if torch.is_grad_enabled() else "eval", weights.unwrap(model).net[3].training))
        return frame_loss(model, batch)

    torch.manual_seed(0)
    data = [mb[0] for mb in micro_batches(6)]
    model = FrameMLP(dropout=0.1).eval()  # fit puts it in train mode
    cfg = make_cfg(tmp_path, "trainer.max_steps=6", "trainer.eval_every=2")
    ddptrain.Trainer(model, loss, cfg, data, eval_data=data[:2]).fit()
    assert [m for kind, m in seen if kind == "train"] == [True] * 6
    assert [m for kind, m in seen if kind == "eval"] == [False] * 6  # 2 batches at steps 2, 4, 6


class _Frames(torch.utils.data.Dataset):
    def __init__(self):
        self.batches = micro_batches(2)[0]

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.batches[i]


def test_a_finished_trainer_leaves_no_worker_and_no_cycle(tmp_path):
    """Persistent loader workers end with fit(), and the Trainer is freed by reference counting
    (a reference cycle left it to the collector, whose late worker shutdown stalled and let
    SIGTERM-ignoring workers live on)."""
    import multiprocessing
    import time
    import weakref

    loader = torch.utils.data.DataLoader(_Frames(), batch_size=None, num_workers=2, persistent_workers=True)
    torch.manual_seed(0)
    trainer = ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(tmp_path, "trainer.max_steps=3"), loader)
    trainer.fit()
    trainer.close()
    alive = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert alive() is None, "the Trainer is in a reference cycle"
    finally:
        gc.enable()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
