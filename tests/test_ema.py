"""ddptrain/ema.py: the EMA's arithmetic against a hand-computed reference, its place in the loop
(applied updates only, every k), exact resume, evaluation on the EMA with the trained weights
given back bit for bit, sharding over 2 gloo ranks (ZeRO, sharded masters, offload) against the
replicated and 1-rank EMA, LoRA adapters only, and its export."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ddptrain
from _dist import run_ranks
from ddptrain import checkpoint as ckpt
from ddptrain import ema as ema_module
from ddptrain import weights
from ddptrain.config import ConfigError, EmaConfig
from ddptrain.ema import ExponentialMovingAverage
from test_trainer import FEAT, FrameMLP, InfOnStep, ListLoader, frame_loss, make_batch, make_cfg, micro_batches, \
    params_of

BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16")


def _tiny():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    m[1].bias.requires_grad_(False)  # frozen: never averaged
    return m


@pytest.mark.parametrize("every,warmup", [(1, False), (3, False), (2, True)])
def test_the_update_is_the_hand_computed_average(every, warmup):
    m = _tiny()
    ema = ExponentialMovingAverage(EmaConfig(enabled=True, decay=0.9, every_steps=every, warmup=warmup), m)
    trained = {n: p for n, p in m.named_parameters() if p.requires_grad}
    ref = {n: p.detach().double().clone() for n, p in trained.items()}
    g, n = torch.Generator().manual_seed(1), 0
    for step in range(1, 10):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        moved = ema.step()
        assert moved == (step % every == 0), step
        if moved:
            d = min(0.9, (1 + n) / (10 + n)) if warmup else 0.9
            ref = {k: d * v + (1 - d) * trained[k].detach().double() for k, v in ref.items()}
            n += 1
    assert (ema.updates, ema.seen) == (n, 9)
    got = ema.state_dict()["tensors"]
    assert set(got) == set(trained) and "1.bias" not in got
    for k, v in ref.items():
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k].double(), v, rtol=1e-6, atol=1e-6, msg=k)


def test_the_host_copy_path_equals_the_direct_update(monkeypatch):
    """ema.device=cpu with the weights on a GPU copies them down chunk by chunk through two
    buffers; on CPU the same code runs (forced), with chunks smaller than one matrix."""
    monkeypatch.setattr(ema_module, "CHUNK_ELEMS", 5)
    m = _tiny()
    cfg = EmaConfig(enabled=True, decay=0.7)
    direct, staged = ExponentialMovingAverage(cfg, m), ExponentialMovingAverage(cfg, m)
    staged.staged = True
    for _ in range(4):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.1).add_(0.3)
        direct.step(), staged.step()
    for k, v in direct.state_dict()["tensors"].items():
        assert torch.equal(staged.state_dict()["tensors"][k], v), k


def test_only_applied_updates_count_and_the_trainer_averages_them(tmp_path):
    """A non-finite step (the 3rd) is skipped: it neither moves the EMA nor counts toward
    ema.every_steps; the EMA equals the reference over the weights after each applied update."""
    torch.manual_seed(0)
    model = FrameMLP()
    data = [b for mb in micro_batches(4) for b in mb][:7]
    cfg = make_cfg(tmp_path, "trainer.max_steps=7", "ema.enabled=true", "ema.decay=0.8", "ema.every_steps=2",
                   "checkpoint.save_at_end=false")
    trainer = ddptrain.Trainer(model, InfOnStep({3}, rank=1), cfg, data)
    ref = {k: v.double() for k, v in params_of(model).items()}
    applied = 0
    for b in data:
        if trainer.train_step([b])["stepped"]:
            applied += 1
            if applied % 2 == 0:
                ref = {k: 0.8 * v + 0.2 * params_of(model)[k].double() for k, v in ref.items()}
    assert trainer.skipped_steps == 1 and (trainer.ema.seen, trainer.ema.updates) == (6, 3)
    got = trainer.ema.state_dict()["tensors"]
    for k, v in ref.items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-6, atol=1e-6, msg=k)


# ----------------------------------------------------------------------------- host memory


@pytest.mark.parametrize("where", ["offload", "cpu"])
def test_a_host_ema_that_does_not_fit_the_node_is_refused_at_start_naming_its_share(tmp_path, monkeypatch, where):
    """The node's host-memory check counts an EMA in host memory: beside offloaded masters
    (ema.device=auto) within the offload's own check, alone with ema.device=cpu. A limit that
    holds the rest and half the EMA refuses the run at set-up, naming the EMA's share; one
    that holds it exactly lets it start."""
    import ddptrain.process as process

    free, needs, check = [2**50], [], process.check_host_memory
    monkeypatch.setattr(process, "available_host_memory", lambda *a, **k: free[0])
    monkeypatch.setattr(process, "check_host_memory", lambda need, *a, **k: needs.append(need) or check(need, *a, **k))
    extra = (*BF16, "optim.offload=cpu", "optim.offload_chunk_mb=0.00003") if where == "offload" else ("ema.device=cpu",)
    ema_bytes = 4 * sum(p.numel() for p in FrameMLP().parameters())  # every parameter trains

    def start(n, *more):
        torch.manual_seed(0)
        cfg = make_cfg(tmp_path / f"run{n}", "trainer.max_steps=1", "checkpoint.save_at_end=false", *extra, *more)
        ddptrain.Trainer(FrameMLP(), frame_loss, cfg, [b for mb in micro_batches(1) for b in mb]).close()

    start(0)  # without the EMA: the offload's own need (none with ema.device=cpu, which has no offload)
    rest = sum(needs)
    assert (rest > 0) == (where == "offload")
    free[0] = 2**30 + rest + ema_bytes // 2  # the 1 GiB reserve, the rest, half the EMA
    start(1)
    with pytest.raises(ConfigError) as e:
        start(2, "ema.enabled=true")
    msg = str(e.value)
    assert msg.startswith("optim.offload=cpu:" if where == "offload" else "ema.device=cpu:"), msg
    assert f"{ema_bytes / 2**10:.1f} KiB EMA of the weights" in msg and "ema." in msg.split("or ")[-1], msg
    free[0] = 2**30 + rest + ema_bytes
    start(3, "ema.enabled=true")
    assert needs[-1] == rest + ema_bytes


# ----------------------------------------------------------------------------- resume


def _resume_run(out, steps, *extra):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    data = ListLoader([make_batch(gen, 2, 5 + i) for i in range(3)])
    cfg = make_cfg(out, f"trainer.max_steps={steps}", "checkpoint.every_steps=4", "checkpoint.keep_last=0",
                   "ema.decay=0.9", "ema.warmup=true", "ema.every_steps=2", *extra)
    trainer = ddptrain.Trainer(FrameMLP(dropout=0.2), frame_loss, cfg, data)
    trainer.fit()
    return trainer


def test_a_resumed_run_has_the_uninterrupted_runs_ema_bit_for_bit(tmp_path, capsys):
    full = _resume_run(tmp_path / "full", 8, "ema.enabled=true")
    mid = tmp_path / "full" / "checkpoints" / "step_00000004"
    assert ckpt.read_meta(str(mid))["ema"] == {"updates": 2, "evaluated": True}
    resumed = _resume_run(tmp_path / "resumed", 8, "ema.enabled=true", f"checkpoint.resume={mid}")
    a, b = full.ema.state_dict(), resumed.ema.state_dict()
    assert (a["updates"], a["seen"]) == (b["updates"], b["seen"]) == (4, 8)
    for k, v in a["tensors"].items():
        assert torch.equal(b["tensors"][k], v), f"EMA {k} differs after resume"

    # EMA turned on at a resume: it starts from the resumed weights
    _resume_run(tmp_path / "plain", 4)
    late = _resume_run(tmp_path / "late", 4, "ema.enabled=true",
                       f"checkpoint.resume={tmp_path / 'plain' / 'checkpoints' / 'step_00000004'}")
    assert "holds no EMA" in capsys.readouterr().out
    assert late.ema.updates == 0 and all(torch.equal(v, params_of(late.module)[k])
                                         for k, v in late.ema.state_dict()["tensors"].items())


# ----------------------------------------------------------------------------- evaluation


class NormFrame(FrameMLP):
    """FrameMLP behind a BatchNorm: its parameters stay fp32 under param_dtype=bf16 (their master
    is the parameter itself), so the swap must keep a copy of them."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(FEAT)

    def forward(self, x):
        return super().forward(self.bn(x.transpose(1, 2)).transpose(1, 2))


def _manual_loss(trainer, data):
    num = den = 0.0
    trainer.module.eval()
    with torch.no_grad(), trainer.precision.autocast():
        for b in data:
            loss, units = frame_loss(trainer.module, b)
            num, den = num + float(loss), den + float(units)
    return num / den


@pytest.mark.parametrize("extra", [(), BF16], ids=["fp32", "bf16-masters"])
def test_evaluation_runs_on_the_ema_and_gives_the_trained_weights_back_bit_for_bit(tmp_path, extra):
    torch.manual_seed(0)
    data = [b for mb in micro_batches(3) for b in mb]
    cfg = make_cfg(tmp_path, "trainer.max_steps=6", "ema.enabled=true", "ema.decay=0.5", "checkpoint.every_steps=3",
                   "checkpoint.keep_best=1", "checkpoint.keep_last=1", *extra)
    trainer = ddptrain.Trainer(NormFrame(), frame_loss, cfg, data, eval_data=data)
    final = trainer.fit()["loss"]
    before = params_of(trainer.module)
    masters = [m.detach().clone() for _, m in trainer.backend.master.pairs] if trainer.backend.master else []
    assert trainer.backend.master is None or any(p is m for p, m in trainer.backend.master.pairs)  # BatchNorm kept fp32
    got = trainer.evaluate()["loss"]
    after = params_of(trainer.module)
    assert all(torch.equal(after[k], v) for k, v in before.items()), "trained weights not restored exactly"
    assert all(torch.equal(a, m) for a, (_, m) in zip(masters, trainer.backend.master.pairs)) if masters else True
    assert got == final  # the end-of-fit evaluation ran on the same EMA
    with trainer.ema.swapped():
        swapped = params_of(trainer.module)
        manual = _manual_loss(trainer, data)
    ema = trainer.ema.state_dict()["tensors"]
    assert all(torch.equal(swapped[k], v.to(swapped[k].dtype)) for k, v in ema.items())
    assert not all(torch.equal(swapped[k], before[k]) for k in ema)
    assert got == pytest.approx(manual, rel=1e-9)
    trainer.cfg.ema.evaluate = False  # the trained weights score differently
    assert trainer.evaluate()["loss"] != got
    # keep_best ranked the checkpoints by the EMA's metric, and says so
    meta = ckpt.read_meta(str(tmp_path / "checkpoints" / "step_00000006"))
    assert meta["metrics"]["loss"] == final and meta["ema"]["evaluated"]


# ----------------------------------------------------------------------------- sharded, 2 ranks

STEPS = 6
FUSED = ("optim.fused=true", "trainer.clip_grad_norm=0.5")  # the same AdamW kernel with and without offload


def _dist_worker(rank, world, out, run, extra):
    torch.manual_seed(0)
    one = world == 1
    data = [b for mb in micro_batches(STEPS) for b in mb] if one else [mb[rank] for mb in micro_batches(STEPS)]
    evals = [b for mb in micro_batches(2) for b in mb] if one else [mb[rank] for mb in micro_batches(2)]
    cfg = make_cfg(os.path.join(out, run), f"trainer.max_steps={STEPS}", "ema.enabled=true", "ema.decay=0.7",
                   "ema.every_steps=2", "checkpoint.every_steps=3", "checkpoint.keep_last=0",
                   *(["trainer.grad_accum_steps=2"] if one else []), *FUSED, *extra)
    trainer = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data, eval_data=evals)
    trainer.fit()
    before = params_of(trainer.module)
    loss = trainer.evaluate()["loss"]
    assert all(torch.equal(params_of(trainer.module)[k], v) for k, v in before.items()), f"rank {rank}: not restored"
    state = trainer.ema.state_dict()
    torch.save({"ema": {k: v.detach().cpu() for k, v in state["tensors"].items()}, "loss": loss,
                "sharded": trainer.ema.sharded, "device": str(trainer.ema.device), "updates": state["updates"]},
               os.path.join(out, f"{run}_rank{rank}.pt"))


def _gathered(tmp_path, run, world=2) -> dict:
    shards = [torch.load(tmp_path / f"{run}_rank{r}.pt", weights_only=False) for r in range(world)]
    out = {}
    for s in shards:
        tensors = s["ema"] if "ema" in s else s["tensors"]
        assert not set(tensors) & set(out), "a tensor's EMA on two ranks"
        out.update(tensors)
    return out


@pytest.mark.timeout(400)
def test_sharded_emas_equal_the_replicated_and_one_rank_ema_and_resume_exactly(tmp_path):
    """Each rank of a ZeRO run (fp32 ZeroRedundancyOptimizer, bf16 sharded masters, and sharded
    masters offloaded to the host) keeps the EMA of its own partition only; gathered, it is the
    replicated 2-rank EMA bit for bit (bf16: the same masters), and the 1-rank run's within the
    rounding of the gradients; evaluation on it gives every rank the same score as the replicated
    run. A resume of the sharded run from step 3 has the uninterrupted run's EMA bit for bit."""
    runs = {"zero": ("optim.zero=true",), "replicated16": BF16, "zero16": (*BF16, "optim.zero=true"),
            "offload16": (*BF16, "optim.zero=true", "optim.offload=cpu")}
    for run, extra in runs.items():
        run_ranks(_dist_worker, 2, str(tmp_path), run, extra, timeout=180)
    _dist_worker(0, 1, str(tmp_path), "one", ())
    _dist_worker(0, 1, str(tmp_path), "one16", BF16)
    names = set(params_of(FrameMLP()))
    for run in ("zero", "zero16", "offload16"):
        shards = [torch.load(tmp_path / f"{run}_rank{r}.pt", weights_only=False) for r in range(2)]
        assert all(s["sharded"] and 0 < len(s["ema"]) < len(names) for s in shards), run
        assert shards[0]["loss"] == shards[1]["loss"]
    assert torch.load(tmp_path / "offload16_rank0.pt", weights_only=False)["device"] == "cpu"  # beside the masters
    replicated = torch.load(tmp_path / "replicated16_rank0.pt", weights_only=False)
    assert not replicated["sharded"] and set(replicated["ema"]) == names
    zero16, offload16 = _gathered(tmp_path, "zero16"), _gathered(tmp_path, "offload16")
    for k, v in replicated["ema"].items():
        assert torch.equal(zero16[k], v) and torch.equal(offload16[k], v), k
    for run in ("zero16", "offload16"):
        assert torch.load(tmp_path / f"{run}_rank0.pt", weights_only=False)["loss"] == replicated["loss"], run
    one, zero = torch.load(tmp_path / "one_rank0.pt", weights_only=False)["ema"], _gathered(tmp_path, "zero")
    assert set(zero) == names
    for k, v in one.items():
        torch.testing.assert_close(zero[k], v, rtol=1e-5, atol=1e-6, msg=k)
    start, one16 = params_of(FrameMLP()), torch.load(tmp_path / "one16_rank0.pt", weights_only=False)["ema"]
    for k, v in one16.items():  # bf16 gradients summed in another order: bf16-level differences
        assert (zero16[k] - v).abs().max() < 0.02 * (v - start[k]).abs().max(), k

    mid = tmp_path / "zero16" / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in mid.glob("ema_rank*.pt")) == ["ema_rank0.pt", "ema_rank1.pt"]
    run_ranks(_dist_worker, 2, str(tmp_path), "resumed16", (*BF16, "optim.zero=true", f"checkpoint.resume={mid}"),
              timeout=180)
    resumed = _gathered(tmp_path, "resumed16")
    assert all(torch.equal(resumed[k], v) for k, v in zero16.items())
    # and the export gathers every rank's shard: the EMA, rounded as the checkpoint stores the weights (bf16)
    final = tmp_path / "zero16" / "checkpoints" / f"step_{STEPS:08d}"
    assert weights.main(["export", str(final), str(tmp_path / "export16")]) == 0
    exported = load_file(str(tmp_path / "export16" / "model.safetensors"))
    assert all(torch.equal(exported[k], v.to(torch.bfloat16)) for k, v in zero16.items())


def _reshard_worker(rank, world, out, run, extra):
    torch.manual_seed(0)
    data = [mb[rank % 2] for mb in micro_batches(3)]  # an epoch of 3 steps: any loader reshards at its end
    cfg = make_cfg(os.path.join(out, run), "trainer.max_steps=3", "optim.zero=true", "ema.enabled=true",
                   "ema.decay=0.5", *BF16, *extra)
    trainer = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data)
    if trainer.step == 0:
        trainer.fit()
    state = trainer.ema.state_dict()
    torch.save(dict(state, tensors={k: v.detach().clone() for k, v in state["tensors"].items()}),
               os.path.join(out, f"{run}_rank{rank}.pt"))


@pytest.mark.timeout(240)
def test_a_sharded_ema_is_repartitioned_onto_another_world_size(tmp_path):
    run_ranks(_reshard_worker, 2, str(tmp_path), "two", (), timeout=180)
    step = tmp_path / "two" / "checkpoints" / "step_00000003"
    run_ranks(_reshard_worker, 3, str(tmp_path), "three", (f"checkpoint.resume={step}",), timeout=180)
    two = [torch.load(tmp_path / f"two_rank{r}.pt", weights_only=False) for r in range(2)]
    three = [torch.load(tmp_path / f"three_rank{r}.pt", weights_only=False) for r in range(3)]
    assert all(s["tensors"] for s in three) and {(s["updates"], s["seen"]) for s in two + three} == {(3, 3)}
    saved, loaded = _gathered(tmp_path, "two"), {}
    for s in three:
        assert not set(s["tensors"]) & set(loaded)
        loaded.update(s["tensors"])
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], v) for k, v in saved.items())


# ----------------------------------------------------------------------------- LoRA and export


def test_lora_averages_the_adapters_only_and_the_export_merges_the_ema(tmp_path):
    from test_lora import LORA, Tiny, _base_file, data, loss_fn

    base = _base_file(tmp_path)
    torch.manual_seed(0)
    model = Tiny()
    ddptrain.load_weights(model, base)
    cfg = make_cfg(tmp_path / "run", "trainer.max_steps=4", "checkpoint.trainable_only=true",
                   f"checkpoint.base_model={base}", "ema.enabled=true", "ema.decay=0.6", *LORA, *BF16)
    trainer = ddptrain.Trainer(model, loss_fn, cfg, data(4))
    trainer.fit()
    ema = trainer.ema.state_dict()["tensors"]
    assert set(ema) == {k for k in weights.trainable_keys(trainer.module)}  # adapters + the trainable head
    assert any(k.endswith("lora_A") for k in ema) and not any(k.endswith("q_proj.weight") for k in ema)
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert weights.main(["export", str(step), str(tmp_path / "ema")]) == 0  # auto: the EMA, as evaluated
    assert weights.main(["export", str(step), str(tmp_path / "trained"), "--weights", "model"]) == 0

    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(3))
    for folder, adapters in (("ema", ema), ("trained", {})):
        want = Tiny()  # the checkpoint's base + adapters, the EMA's put over them by hand
        ddptrain.load_weights(want, str(step), dtype=torch.float32)
        plain = Tiny()  # the export: the adapters merged into the base's own layout
        weights.load_pretrained(plain, str(tmp_path / folder))
        with torch.no_grad():
            for k, v in adapters.items():
                want.state_dict()[k].copy_(v)
            torch.testing.assert_close(plain.eval()(x), want.eval()(x), rtol=1e-5, atol=1e-5, msg=folder)


def test_export_of_the_ema_without_one_and_bad_keys_are_refused(tmp_path):
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=2")
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(1)[0]).fit()
    step = tmp_path / "checkpoints" / "step_00000002"
    with pytest.raises(ckpt.CheckpointError, match="holds no EMA weights"):
        weights.export_merged(str(step), str(tmp_path / "out"), weights="ema")
    assert weights.export_merged(str(step), str(tmp_path / "out")) == [str(tmp_path / "out" / "model.safetensors")]
    for bad, why in (("ema.decay=1", "ema.decay"), ("ema.every_steps=0", "ema.every_steps"),
                     ("ema.device=gpu0", "ema.device")):
        with pytest.raises(ConfigError, match=why):
            make_cfg(tmp_path, "ema.enabled=true", bad)
    with pytest.raises(ConfigError, match="ema.device=gpu with optim.offload=cpu"):
        make_cfg(tmp_path, "ema.enabled=true", "ema.device=gpu", "optim.offload=cpu", *BF16)


# ----------------------------------------------------------------------------- loading outside training


@pytest.mark.parametrize("extra", [(), BF16], ids=["fp32", "bf16-masters"])
def test_load_weights_gives_the_checkpoints_ema_or_its_trained_weights(tmp_path, extra):
    """load_weights(which=ema) puts the checkpoint's EMA into a fresh model (rounded to the model's
    dtype only), which=model / auto without ema.evaluate its trained weights, which=auto with it the
    EMA; the export of either set holds the same tensors (in the stored dtype)."""
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=3", "ema.enabled=true", "ema.decay=0.5", *extra)
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, [b for mb in micro_batches(3) for b in mb][:3]).fit()
    step = str(tmp_path / "checkpoints" / "step_00000003")
    ema, trained = ema_module.saved_ema(step), load_file(os.path.join(step, "model.safetensors"))
    assert set(ema) == set(trained) and any(not torch.equal(ema[k].float(), trained[k].float()) for k in ema)
    for which, want in (("ema", ema), ("model", trained), ("auto", ema)):  # auto: ema.evaluate is on
        model = FrameMLP()
        report = ddptrain.load_weights(model, str(tmp_path), which=which)  # the run folder: its newest checkpoint
        assert report["weights"] == ("model" if which == "model" else "ema") and report["loaded"] == len(want)
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k].float()), (which, k)
        out = tmp_path / f"export_{which}"
        assert weights.main(["export", step, str(out), "--weights", which]) == 0
        exported = load_file(str(out / "model.safetensors"))
        assert all(torch.equal(exported[k], want[k].to(trained[k].dtype)) for k in trained), which
    # bf16 params: the EMA rounded to bf16 as the Trainer's evaluation swaps it in
    model = FrameMLP().to(torch.bfloat16)
    ddptrain.load_weights(model, step, which="ema")
    assert all(torch.equal(v, ema[k].to(torch.bfloat16)) for k, v in model.state_dict().items())


def test_without_an_ema_loading_gives_the_trained_weights_and_asking_for_it_names_the_folder(tmp_path):
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=2")
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(1)[0]).fit()
    step = tmp_path / "checkpoints" / "step_00000002"
    trained = load_file(str(step / "model.safetensors"))
    model = FrameMLP()
    assert ddptrain.load_weights(model, str(tmp_path), which="auto")["weights"] == "model"
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint {step} holds no EMA weights"):
        ddptrain.load_weights(FrameMLP(), str(tmp_path), which="ema")  # the run folder: the checkpoint is named
    loose = tmp_path / "loose.safetensors"
    weights.save_weights(model, str(loose))
    with pytest.raises(ckpt.CheckpointError, match=rf"{loose} is not in a complete ddptrain checkpoint"):
        ddptrain.load_weights(FrameMLP(), str(loose), which="ema")
    with pytest.raises(ckpt.CheckpointError, match="'best' is not one of auto, ema, model"):
        ddptrain.load_weights(FrameMLP(), str(step), which="best")


def test_resuming_with_ema_off_from_a_checkpoint_with_an_ema_says_it_is_dropped(tmp_path, capsys):
    """ema.enabled=false at a resume drops the checkpoint's EMA: said at the resume, naming the
    checkpoint, what is lost and how to keep it (issue 49, item 8)."""
    _resume_run(tmp_path / "ema", 4, "ema.enabled=true")
    step = tmp_path / "ema" / "checkpoints" / "step_00000004"
    capsys.readouterr()
    _resume_run(tmp_path / "off", 4, f"checkpoint.resume={step}")
    out = capsys.readouterr().out
    assert f"WARNING: {step} holds an EMA of the weights (2 updates) and ema.enabled=false: this run drops it" in out
    assert f"ddptrain-weights export {step} OUT --weights ema" in out and "ema.enabled=true" in out.split("drops it")[1]
    _resume_run(tmp_path / "on", 4, "ema.enabled=true", f"checkpoint.resume={step}")  # kept: not a word
    assert "drops it" not in capsys.readouterr().out
