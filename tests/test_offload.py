"""Optimizer offload (optim.offload=cpu, ddptrain/update/host.py) against the on-device update.

On CPU the offload path runs its whole machinery (partition, staging buffer, chunked host
update with the optimizer's own step, broadcast of each owner's weights) without streams, and
the host update on its worker thread while the next forward runs (each block waiting for its own
chunks). Both sides run the same AdamW kernel on the same fp32 masters and bf16 gradients (fused
with ``optim.fused=true``, foreach with the default on a CPU device): the tests ask for bitwise
equality.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file

import ddptrain
from _dist import run_ranks
from ddptrain import preflight
from ddptrain.config import ConfigError
from ddptrain.update.host import OffloadedMasters
from test_trainer import FEAT, FrameMLP, frame_loss, make_cfg, micro_batches, params_of

STEPS = 20
BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.fused=true", "trainer.clip_grad_norm=0.5",
        "scheduler.name=warmup_cosine", "scheduler.warmup_steps=3", "trainer.grad_accum_steps=2")
# a chunk smaller than one weight matrix: several chunks per step, each its own host update
SMALL_CHUNKS = ("optim.offload=cpu", "optim.offload_chunk_mb=0.00003")


def _run(out, run, data, *extra, make_model=FrameMLP, watch=None):
    torch.manual_seed(0)
    model = make_model()
    cfg = make_cfg(os.path.join(out, run), f"trainer.max_steps={STEPS}", "checkpoint.every_steps=10",
                   "checkpoint.keep_last=0", *BF16, *extra)
    losses = []
    with ddptrain.Trainer(model, frame_loss, cfg, data) as trainer:
        real = trainer.train_step

        def step(micro):
            out_ = real(micro)
            losses.append(out_["loss_sum"])
            return out_

        trainer.train_step = step
        if watch is not None:
            watch(trainer)
        trainer.fit()
        master = trainer.backend.master
    return params_of(model), losses, master


def _data_one_rank():
    return [b for mb in micro_batches(STEPS) for b in mb]


@pytest.mark.timeout(120)
def test_offload_one_rank_equals_the_on_device_update_bitwise_and_resumes_with_offload_on_or_off(tmp_path):
    data = _data_one_rank()
    plain, plain_losses, _ = _run(tmp_path, "plain", data)
    off, off_losses, master = _run(tmp_path, "off", data, *SMALL_CHUNKS)
    assert isinstance(master, OffloadedMasters)
    assert sum(len(b.chunks) for b in master.own) > 3, "the test needs several chunks"
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in master.to_master.values())
    assert off_losses == plain_losses
    start = params_of(FrameMLP())
    for k, v in plain.items():
        assert v.dtype == torch.bfloat16 and not torch.equal(v, start[k].to(torch.bfloat16)), f"{k} did not train"
        assert torch.equal(off[k], v), k
    final = f"checkpoints/step_{STEPS:08d}"
    a = load_file(str(tmp_path / "plain" / final / "model.safetensors"))
    b = load_file(str(tmp_path / "off" / final / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and b[k].dtype == torch.float32 for k in a)

    # the checkpoint format is the on-device one: resume the offloaded run with offload off, and
    # the on-device run with offload on; both end bitwise where the uninterrupted runs ended
    mid = "checkpoints/step_00000010"
    on_off, losses_a, _ = _run(tmp_path, "resumed_off", data, f"checkpoint.resume={tmp_path / 'off' / mid}")
    off_on, losses_b, _ = _run(tmp_path, "resumed_on", data, *SMALL_CHUNKS,
                               f"checkpoint.resume={tmp_path / 'plain' / mid}")
    assert losses_a == losses_b == plain_losses[10:]
    for k, v in plain.items():
        assert torch.equal(on_off[k], v) and torch.equal(off_on[k], v), k


@pytest.mark.timeout(120)
def test_offload_one_rank_sends_the_last_backwards_gradients_during_it(tmp_path):
    """With accumulation 2, the first micro-batch's gradients accumulate on the device and the
    second backward sends each finished gradient to the host and frees it: at the update no
    gradient is left on the device (the result is the bitwise test's above)."""
    seen = []

    class Spy:  # the StepUpdate, looked at when the loop calls it
        def __init__(self, trainer):
            self.trainer, self.real = trainer, trainer.update

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __call__(self, *a, **k):
            master = self.trainer.backend.master
            seen.append(([p.grad is not None for p in master.trainable], list(master._sent)))
            return self.real(*a, **k)

    def watch(trainer):
        trainer.update = Spy(trainer)

    _run(tmp_path, "off", _data_one_rank(), *SMALL_CHUNKS, watch=watch)
    assert len(seen) == STEPS
    for on_device, sent in seen:
        assert not any(on_device) and all(sent)


class TwiceUsed(torch.nn.Module):
    """A layer used once plainly and once inside a reentrant checkpoint: its gradient arrives in
    two parts within one backward (the reentrant backward accumulates on its own)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(FEAT, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)

    def _block(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = self._block(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(self._block, h, use_reentrant=True)
        return self.out(h).squeeze(-1)


@pytest.mark.timeout(120)
def test_offload_adds_a_gradient_that_arrives_twice_in_one_backward(tmp_path):
    """Reentrant checkpointing: the shared layer's second gradient part comes after its first was
    sent; the host adds it (as bf16 on the device would) and later steps download that layer
    after the backward. Bitwise the on-device update, as the plain model's test."""
    data = _data_one_rank()
    plain, plain_losses, _ = _run(tmp_path, "plain", data, make_model=TwiceUsed)
    off, off_losses, master = _run(tmp_path, "off", data, *SMALL_CHUNKS, make_model=TwiceUsed)
    assert master._after_backward == {id(master.trainable[2]), id(master.trainable[3])}  # shared.weight, .bias
    assert off_losses == plain_losses
    for k, v in plain.items():
        assert torch.equal(off[k], v), k


def _worker(rank, world, out, run, extra):
    data = [mb[rank] for mb in micro_batches(STEPS)]
    params, losses, master = _run(out, run, data, "optim.zero=true", *extra)
    owned = sum(m.numel() for m in master.to_master.values())
    torch.save({"params": params, "losses": losses, "owned": owned,
                "offloaded": getattr(master, "offloaded", False)}, os.path.join(out, f"{run}_rank{rank}.pt"))


@pytest.mark.timeout(240)
def test_offload_two_ranks_equals_sharded_masters_bitwise_and_resumes(tmp_path):
    """Each rank holds only its partition's masters on the host; the result is bitwise that of
    the sharded masters on the device, and a resume from a mid-run checkpoint (either way) too."""
    run_ranks(_worker, 2, str(tmp_path), "dev", ())
    run_ranks(_worker, 2, str(tmp_path), "off", SMALL_CHUNKS)
    dev = [torch.load(tmp_path / f"dev_rank{r}.pt", weights_only=False) for r in range(2)]
    off = [torch.load(tmp_path / f"off_rank{r}.pt", weights_only=False) for r in range(2)]
    n_all = sum(p.numel() for p in FrameMLP().parameters())
    assert all(o["offloaded"] for o in off)
    assert all(0 < o["owned"] < n_all for o in off) and sum(o["owned"] for o in off) == n_all
    for r in range(2):
        assert off[r]["losses"] == dev[r]["losses"]
        for k, v in dev[r]["params"].items():
            assert torch.equal(off[r]["params"][k], v), f"rank {r}: {k}"
    mid = tmp_path / "dev" / "checkpoints" / "step_00000010"
    run_ranks(_worker, 2, str(tmp_path), "resumed", (*SMALL_CHUNKS, f"checkpoint.resume={mid}"))
    for r in range(2):
        resumed = torch.load(tmp_path / f"resumed_rank{r}.pt", weights_only=False)
        assert resumed["losses"] == dev[r]["losses"][10:]
        for k, v in dev[r]["params"].items():
            assert torch.equal(resumed["params"][k], v), f"rank {r}: {k} differs after resume"


def _inf_at_step_3(model, batch):
    loss, units = frame_loss(model, batch)
    _inf_at_step_3.calls += 1
    return (loss * float("inf") if _inf_at_step_3.calls in (5, 6) else loss), units


def test_offload_skips_a_non_finite_step_and_counts_it(tmp_path):
    _inf_at_step_3.calls = 0
    torch.manual_seed(0)
    model = FrameMLP()
    cfg = make_cfg(tmp_path / "run", "trainer.max_steps=5", *BF16, *SMALL_CHUNKS)
    with ddptrain.Trainer(model, _inf_at_step_3, cfg, _data_one_rank()) as trainer:
        before = {}

        def watch(micro, real=trainer.train_step):
            if trainer.step == 2:
                before.update({k: m.detach().clone() for k, m in enumerate(trainer.backend.master.to_master.values())})
            out = real(micro)
            if trainer.step == 3:
                assert not out["stepped"]
                after = {k: m.detach() for k, m in enumerate(trainer.backend.master.to_master.values())}
                assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed a master"
            return out

        trainer.train_step = watch
        trainer.fit()
        assert trainer.skipped_steps == 1
        steps = [s["step"].item() for s in trainer.optimizer.state.values()]
        assert steps and all(s == 4 for s in steps)  # 5 steps, one skipped: AdamW's counters say 4


def test_offload_needs_bf16_params(tmp_path):
    with pytest.raises(ConfigError, match="optim.offload=cpu needs trainer.param_dtype=bf16"):
        make_cfg(tmp_path, "optim.offload=cpu")
    cfg = make_cfg(tmp_path, "optim.offload=off")
    assert cfg.optim.offload == "none"


def test_offload_refuses_a_host_without_the_memory_before_allocating(tmp_path, monkeypatch):
    import ddptrain.process as process

    monkeypatch.setattr(process, "available_host_memory", lambda *a, **k: 1024)  # 1 KiB free
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path / "run", "trainer.max_steps=1", *BF16, *SMALL_CHUNKS)
    with pytest.raises(ConfigError, match="optim.offload=cpu"):
        ddptrain.Trainer(FrameMLP(), frame_loss, cfg, _data_one_rank())


@pytest.mark.timeout(240)
def test_offload_composes_with_sharded_gradients_bitwise(tmp_path):
    """optim.shard_grads + optim.offload: each rank receives only its own partition's reduced
    gradients and updates those masters on the host; bitwise the on-device sharded run."""
    grads = ("optim.shard_grads=true",)
    run_ranks(_worker, 2, str(tmp_path), "dev", grads)
    run_ranks(_worker, 2, str(tmp_path), "off", (*grads, *SMALL_CHUNKS))
    for r in range(2):
        dev = torch.load(tmp_path / f"dev_rank{r}.pt", weights_only=False)
        off = torch.load(tmp_path / f"off_rank{r}.pt", weights_only=False)
        assert off["offloaded"] and off["losses"] == dev["losses"]
        for k, v in dev["params"].items():
            assert torch.equal(off["params"][k], v), f"rank {r}: {k}"


def _no_zero_worker(rank, world, out):
    cfg = make_cfg(os.path.join(out, "run"), "trainer.max_steps=1", *BF16, *SMALL_CHUNKS)
    with pytest.raises(ConfigError, match="set optim.zero=true"):
        ddptrain.Trainer(FrameMLP(), frame_loss, cfg, [mb[rank] for mb in micro_batches(1)])


@pytest.mark.timeout(120)
def test_offload_on_several_ranks_needs_optim_zero(tmp_path):
    run_ranks(_no_zero_worker, 2, str(tmp_path))


class _OomInBackward(torch.autograd.Function):
    """Identity forward; its backward fails as a GPU out of memory would, after the layers above
    it have made (and the offload has sent) their gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated)")


def _oom_loss(model, batch):
    h = _OomInBackward.apply(model.net[0](batch["x"]))
    pred = model.net[1:](h).squeeze(-1)
    mask = torch.arange(batch["x"].shape[1])[None, :] < batch["lens"][:, None]
    return (((pred.float() - batch["y"]) ** 2) * mask).sum(), mask.sum()


@pytest.mark.timeout(120)
def test_a_preflight_step_that_fails_mid_backward_leaves_the_offload_nothing(tmp_path):
    """preflight.train_once sends the gradients on as the loop's last micro-batch does; when its
    backward fails half-way (an out-of-memory error), release() drops what was already sent, and
    the run that follows is bitwise the one without the failed step."""
    data = _data_one_rank()
    clean, clean_losses, _ = _run(tmp_path, "clean", data, *SMALL_CHUNKS)
    failed = []

    def fail_once(trainer):
        step = trainer.one_step
        oom = preflight.train_once(dataclasses.replace(step, loss_fn=_oom_loss), data[0], "preflight")
        failed.append((oom, list(trainer.backend.master._sent)))
        preflight.release(step)

    after, after_losses, master = _run(tmp_path, "after", data, *SMALL_CHUNKS, watch=fail_once)
    oom, sent = failed[0]
    assert oom and "out of memory" in oom
    assert any(sent) and not all(sent), "the failure should come after some gradients were sent"
    assert not any(master._sent)
    assert after_losses == clean_losses
    for k, v in clean.items():
        assert torch.equal(after[k], v), k


# ----------------------------------------------------------------------------- issue 49 items 6 and 11

@pytest.mark.timeout(120)
def test_offload_equals_the_on_device_update_with_the_default_optimizer_kernel(tmp_path):
    """optim.fused=auto on a CPU device: the offloaded update runs the on-device path's kernel
    (foreach AdamW, the factor multiplied into the gradients), so the two agree bitwise."""
    data = _data_one_rank()
    default = ("optim.fused=auto", "trainer.grad_accum_steps=1", "trainer.clip_grad_norm=0")
    plain, plain_losses, _ = _run(tmp_path, "plain", data, *default)
    off, off_losses, master = _run(tmp_path, "off", data, *default, *SMALL_CHUNKS)
    assert isinstance(master, OffloadedMasters)
    assert off_losses == plain_losses
    for k, v in plain.items():
        assert torch.equal(off[k], v), k
    final = f"checkpoints/step_{STEPS:08d}/model.safetensors"  # the fp32 masters
    a, b = load_file(str(tmp_path / "plain" / final)), load_file(str(tmp_path / "off" / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_offload_host_memory_need_counts_the_scratch_this_rank_needs(tmp_path, monkeypatch):
    """A 300-parameter model with the default 256 MB chunks needs a few KB of fp32 scratch, not
    a whole chunk's 0.5 GiB: it starts on a host with 1.3 GiB free (1 GiB of it kept free); the
    message names each part of the need."""
    import ddptrain.process as process
    from ddptrain.update.host import scratch_elems

    assert scratch_elems([10, 30, 20], 2**27) == 60 and scratch_elems([10, 30, 20], 25) == 25 - 1 + 30
    assert scratch_elems([], 5) == 0
    monkeypatch.setattr(process, "available_host_memory", lambda *a, **k: int(1.3 * 2**30))
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path / "run", "trainer.max_steps=1", *BF16, "optim.offload=cpu")
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, _data_one_rank()) as trainer:
        n = sum(p.numel() for p in trainer.backend.master.trainable)
        assert trainer.backend.master.host_bytes() <= n * 18
    monkeypatch.setattr(process, "available_host_memory", lambda *a, **k: 1024)
    with pytest.raises(ConfigError, match="fp32 masters .* AdamW moments .* bf16 staging .* fp32 gradient scratch"):
        ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(tmp_path / "run2", *BF16, "optim.offload=cpu"),
                         _data_one_rank())
