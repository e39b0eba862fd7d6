"""ddptrain/streamed_base.py: a LoRA run whose frozen base streams from host memory through a ring
of two block buffers trains bitwise like the plain run (recompute on and off, accumulation, bf16
weights, evaluation, 2 gloo ranks), keeps only the ring "on the device", saves and resumes the
true base weights, and refuses what it cannot do.

On CPU the "device" ring is other CPU memory: the weights really are copied in and out of it,
and a forward pre-hook on every frozen linear layer checks that it computes from the ring.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

import ddptrain
from _dist import run_ranks
from ddptrain import weights
from ddptrain.streamed_base import find_blocks, place_model
from test_trainer import make_cfg

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tiny models: one thread is fastest

D = 8
BLOCKS = 4


class Block(nn.Module):
    """Attention-like and MLP projections, a norm and a buffer (the buffer stays resident)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D, bias=False)
        self.register_buffer("gain", torch.full((D,), 0.5))

    def forward(self, x):
        h = self.norm(x)
        att = torch.softmax(self.q_proj(h) @ self.k_proj(h).transpose(-1, -2) / D ** 0.5, dim=-1)
        x = x + self.o_proj(att @ self.v_proj(h))
        return x + self.down(F.gelu(self.up(x))) * self.gain


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)


LORA = ("lora.enabled=true", "lora.targets=[blocks.*.q_proj,blocks.*.v_proj,blocks.*.o_proj]", "lora.rank=2",
        "lora.alpha=4", "lora.trainable=[head.*]")
OFFLOAD = ("lora.base_offload=cpu",)
RECOMPUTE = ("recompute.enabled=true", "recompute.module_classes=[Block]")
BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16")


def data(n, seed=0, rows=2):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, 5, 3, generator=g), "y": torch.randn(rows, 5, generator=g)} for _ in range(n)]


class Recorder:
    """The loss function, keeping every training and evaluation loss sum exactly."""

    def __init__(self):
        self.train, self.eval = [], []

    def __call__(self, model, batch):
        err = (model(batch["x"]).float() - batch["y"]) ** 2
        (self.train if model.training else self.eval).append(err.sum().detach().clone())
        return err.sum(), err.numel()


def ring_checks(trainer):
    """A pre-hook on every frozen linear layer of the blocks: its weight must be ring memory
    whenever it computes (forward, recomputation, evaluation)."""
    ring = {s.data.untyped_storage().data_ptr() for s in trainer.streamed.slots}
    seen = []

    def check(module, args):
        assert module.weight.untyped_storage().data_ptr() in ring, "a streamed layer computed from host memory"
        seen.append(1)

    for m in trainer.module.blocks.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(check)
    return seen


def train(out, *extra, steps=10, accum=1, seed=0, checks=True):
    torch.manual_seed(seed)
    model = TinyLM()
    rec = Recorder()
    cfg = make_cfg(out, f"trainer.max_steps={steps}", f"trainer.grad_accum_steps={accum}", "trainer.eval_every=5",
                   "checkpoint.save_at_end=false", "checkpoint.start_over=true", *LORA, *extra)
    trainer = ddptrain.Trainer(model, rec, cfg, data(steps * accum, seed=seed), eval_data=data(2, seed=99))
    seen = ring_checks(trainer) if trainer.streamed and checks else None
    trainer.fit()
    trainer.close()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return rec, state, trainer, seen


VARIANTS = {"fp32": (), "recompute": RECOMPUTE, "accum2_bf16_dropout": ("lora.dropout=0.2", *BF16),
            "recompute_accum2_bf16": (*RECOMPUTE, *BF16)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_losses_and_weights_are_bitwise_those_of_the_resident_base(tmp_path, variant):
    accum = 2 if "accum2" in variant else 1
    plain, plain_state, _, _ = train(tmp_path / "plain", *VARIANTS[variant], accum=accum)
    streamed, state, trainer, seen = train(tmp_path / "streamed", *VARIANTS[variant], *OFFLOAD, accum=accum)
    assert len(streamed.train) == 10 * accum and len(streamed.eval) == 4  # two evaluations of two batches
    assert torch.equal(torch.stack(streamed.train), torch.stack(plain.train))
    assert torch.equal(torch.stack(streamed.eval), torch.stack(plain.eval))
    assert set(state) == set(plain_state)
    for k, v in plain_state.items():
        assert v.dtype == state[k].dtype and torch.equal(state[k], v), k
    assert any("lora_B" in k and state[k].abs().sum() > 0 for k in state)  # the adapters did train
    s = trainer.streamed.stats
    # 4 blocks through 2 ring buffers: each forward and each backward copies at least 2 blocks in
    assert s["copies"] >= 4 * 10 * accum and s["reused"] > 0 and s["on_demand"] == 0
    assert len(seen) > 0


def test_saved_weights_follow_their_block_to_another_ring_buffer(tmp_path):
    """Without recompute the backward reads weights autograd saved in the forward. A no-grad call
    of block 0 between forward and backward moves the ring around (block 3 then comes back into
    the buffer block 1 held in the forward): saved weights must be read from where their block
    is now, not from where it was."""
    import copy

    from ddptrain.lora import apply_lora
    from ddptrain.streamed_base import stream_base

    torch.manual_seed(0)
    model = TinyLM()
    apply_lora(model, ["blocks.*.q_proj", "blocks.*.v_proj"], rank=2, alpha=4)
    for m in model.modules():
        if hasattr(m, "lora_B"):
            nn.init.normal_(m.lora_B)
    plain = copy.deepcopy(model)
    sb = stream_base(model, make_cfg(tmp_path, *LORA, *OFFLOAD), torch.device("cpu"))
    x, h = torch.randn(2, 5, 3), torch.randn(2, 5, D)
    grads = []
    for m in (plain, model):
        loss = m(x).square().sum()
        with torch.no_grad():
            m.blocks[0](h)
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert sb.stats["copies"] >= 7 and sb.stats["on_demand"] == 0
    assert set(grads[0]) == set(grads[1]) and any("lora_A" in n for n in grads[0])
    for n, g in grads[0].items():
        assert torch.equal(grads[1][n], g), n


def test_between_steps_only_the_ring_holds_streamed_weights_on_the_device(tmp_path):
    _, _, trainer, _ = train(tmp_path, *BF16, *OFFLOAD, steps=3)
    model, sb = trainer.module, trainer.streamed
    assert [b.name for b in sb.blocks] == [f"blocks.{i}" for i in range(BLOCKS)]
    host = [(b.host.data_ptr(), b.host.data_ptr() + b.nbytes) for b in sb.blocks]
    ring = {s.data.untyped_storage().data_ptr() for s in sb.slots}
    frozen_in_blocks = resident = 0
    for name, p in model.named_parameters():
        inside = any(lo <= p.data_ptr() < hi for lo, hi in host)
        assert p.untyped_storage().data_ptr() not in ring, f"{name} points into the ring between steps"
        if name.startswith("blocks.") and not p.requires_grad:
            assert inside and name in sb.param_names(), f"{name} is not in its host copy"
            frozen_in_blocks += p.numel() * p.element_size()
        else:
            assert not inside
            resident += p.numel() * p.element_size()
    assert not any(n.startswith("blocks.") and n.endswith("gain") for n in sb.param_names())  # buffers stay
    assert sb.host_bytes() >= frozen_in_blocks
    # what the device holds of the streamed base: 2 blocks' worth, half of the 4 blocks' weights
    assert len(sb.slots) == 2 and sb.device_bytes() == 2 * max(b.nbytes for b in sb.blocks)
    assert sb.device_bytes() <= frozen_in_blocks / 2 + 2 * 256 * len(sb.blocks[0].params)  # alignment padding
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.bfloat16 for b in sb.blocks for p in b.params)


def test_place_model_moves_only_the_resident_part(tmp_path):
    """The base never visits the device: on the meta device the streamed weights keep their data."""
    torch.manual_seed(0)
    model = TinyLM()
    w = model.blocks[2].up.weight.detach().clone()
    cfg = make_cfg(tmp_path, *LORA, *OFFLOAD)
    place_model(model, torch.device("meta"), cfg)
    assert model.inp.weight.is_meta and model.head.weight.is_meta and model.blocks[0].gain.is_meta
    assert model.blocks[2].up.weight.numel() == 0  # a placeholder until stream_base
    plan = model._ddptrain_streamed_plan
    assert [n for n, _ in plan.blocks] == [f"blocks.{i}" for i in range(BLOCKS)]
    assert any(torch.equal(t, w) for t in plan.data.values())


def test_ring_copies_follow_in_place_changes_of_the_base(tmp_path):
    """load_state_dict writes the host copies; a ring buffer still holding the old block is not reused."""
    _, state, trainer, _ = train(tmp_path, *OFFLOAD, steps=2, checks=False)
    model = trainer.module
    state = dict(state)
    state["blocks.0.up.weight"] = state["blocks.0.up.weight"] * -3  # block 0 is in the ring after a backward
    model.load_state_dict(state)
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        streamed = model.eval()(x)
        trainer.streamed.remove()
        direct = model(x)  # straight from the host copies
    assert torch.equal(streamed, direct)


# ----------------------------------------------------------------------------- checkpoints


def run(out, steps, *extra):
    torch.manual_seed(0)
    model = TinyLM()
    cfg = make_cfg(out, f"trainer.max_steps={steps}", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                   *LORA, *BF16, *OFFLOAD, *extra)
    trainer = ddptrain.Trainer(model, Recorder(), cfg, data(steps))
    trainer.fit()
    trainer.close()
    return trainer


def test_checkpoints_hold_the_true_base_and_resume_exactly(tmp_path):
    torch.manual_seed(0)
    base = {k: v.to(torch.bfloat16) for k, v in TinyLM().state_dict().items()}
    full = run(tmp_path / "full", 4)
    saved = load_file(str(tmp_path / "full" / "checkpoints" / "step_00000002" / "model.safetensors"))
    for k, v in base.items():
        if k.startswith("blocks.") and k.endswith("weight") and "norm" not in k:
            assert torch.equal(saved[k], v), f"{k}: the checkpoint does not hold the base weight"
    resumed = run(tmp_path / "resumed", 4, f"checkpoint.resume={tmp_path / 'full' / 'checkpoints' / 'step_00000002'}")
    assert resumed.step == 4
    for k, v in full.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[k], v), f"{k} differs after resume"

    # trainable-only: the base by path, its fingerprint read from the host copies
    path = tmp_path / "base.safetensors"
    torch.manual_seed(0)
    ddptrain.save_weights(TinyLM(), str(path))
    only = ("checkpoint.trainable_only=true", f"checkpoint.base_model={path}")
    a = run(tmp_path / "a", 4, *only)
    b = run(tmp_path / "b", 4, *only, f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000002'}")
    assert weights.weights_info(str(tmp_path / "a" / "checkpoints" / "step_00000002"))["base_fingerprint"]
    for k, v in a.module.state_dict().items():
        assert torch.equal(b.module.state_dict()[k], v), k


# ----------------------------------------------------------------------------- 2 ranks


def _ranks_worker(rank, world, out):
    results = {}
    for mode in ("none", "cpu"):
        torch.manual_seed(rank)  # different bases per rank: both paths start from rank 0's
        model = TinyLM()
        rec = Recorder()
        cfg = make_cfg(os.path.join(out, mode), "trainer.max_steps=5", "trainer.grad_accum_steps=2",
                       "checkpoint.save_at_end=false", *LORA, *RECOMPUTE, *BF16, f"lora.base_offload={mode}")
        trainer = ddptrain.Trainer(model, rec, cfg, data(10, seed=rank))
        trainer.fit()
        trainer.close()
        results[mode] = {"losses": torch.stack(rec.train),
                         "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.timeout(120)
def test_two_ranks_stream_bitwise_like_the_resident_base(tmp_path):
    run_ranks(_ranks_worker, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for r in (r0, r1):
        assert torch.equal(r["cpu"]["losses"], r["none"]["losses"])
        for k, v in r["none"]["state"].items():
            assert torch.equal(r["cpu"]["state"][k], v), k
    for k, v in r0["cpu"]["state"].items():  # rank 1 streams rank 0's base (broadcast at set-up)
        assert torch.equal(r1["cpu"]["state"][k], v), k


# ----------------------------------------------------------------------------- refusals


def _trainer(tmp_path, model, *extra):
    cfg = make_cfg(tmp_path, "trainer.max_steps=1", *LORA, *OFFLOAD, *extra)
    return ddptrain.Trainer(model, Recorder(), cfg, data(1))


def test_refusals_name_what_to_change(tmp_path):
    with pytest.raises(ddptrain.ConfigError, match="set lora.enabled=true"):
        ddptrain.load_config(None, ["lora.base_offload=cpu"])
    with pytest.raises(ddptrain.ConfigError, match="set compile.enabled=false"):
        ddptrain.load_config(None, [*LORA, *OFFLOAD, "compile.enabled=true"])
    with pytest.raises(ddptrain.ConfigError, match="lora.stream_ahead"):
        ddptrain.load_config(None, [*LORA, *OFFLOAD, "lora.stream_ahead=0"])
    with pytest.raises(ddptrain.ConfigError, match=r"globs \['layers.\*'\] match no module.*blocks"):
        _trainer(tmp_path, TinyLM(), "lora.stream_blocks=[layers.*]")
    with pytest.raises(ddptrain.ConfigError, match="ModuleList itself is not"):
        _trainer(tmp_path, TinyLM(), "lora.stream_blocks=[blocks]")

    tied = TinyLM()
    tied.extra = nn.Linear(D, D)
    tied.extra.weight = tied.blocks[1].q_proj.weight
    with pytest.raises(ddptrain.ConfigError, match="blocks.1.q_proj.weight .* same tensor as extra.weight"):
        _trainer(tmp_path, tied)

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = TinyLM()

        def forward(self, x):
            return self.lm(x)

    with pytest.raises(ddptrain.ConfigError, match="recompute wraps 'lm', which holds the streamed block lm.blocks.0"):
        _trainer(tmp_path, Body(), "recompute.enabled=true", "recompute.name_globs=[lm]",
                 "lora.targets=[lm.blocks.*.q_proj]", "lora.trainable=[]")
    flat = nn.Sequential(nn.Linear(3, D), nn.Linear(D, 1))
    with pytest.raises(ddptrain.ConfigError, match="found no nn.ModuleList"):
        _trainer(tmp_path, flat, "lora.targets=[0]", "lora.trainable=[]")
    hf = TinyLM()
    hf.blocks[0].gradient_checkpointing = True
    with pytest.raises(ddptrain.ConfigError, match="own gradient checkpointing is on for blocks.0"):
        _trainer(tmp_path, hf)


def test_default_blocks_are_the_largest_module_list():
    model = TinyLM()
    model.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(8)])  # more children, fewer parameters
    assert [n for n, _ in find_blocks(model)] == [f"blocks.{i}" for i in range(BLOCKS)]
    assert [n for n, _ in find_blocks(model, ["blocks.*", "small.1"])] == [f"blocks.{i}" for i in range(BLOCKS)] + [
        "small.1"]


@pytest.mark.timeout(300)
def test_bench_check_runs_tiny_on_cpu(tmp_path):
    """bench/check_streamed_base.py --tiny: both modes' rows, the offloaded one with equal losses."""
    pytest.importorskip("transformers")
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("check_streamed_base", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "check_streamed_base.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--tiny", "--steps", "2", "--out", str(out), "--tmp", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["base_offload"], r["seq"]) for r in rows) == [("cpu", 64), ("cpu", 128), ("none", 64),
                                                                    ("none", 128)]
    for r in rows:
        assert {"workload", "peer", "world_size", "batch", "tokens_per_s", "peak_alloc_gb", "gpu_memory_gb"} <= set(r)
        assert "error" not in r and len(r["losses"]) == 3
        if r["base_offload"] == "cpu":
            assert r["loss_bitwise_equal"] and r["streamed_blocks"] == 4 and r["copied_gb_per_step"] > 0
