"""ddptrain/lora.py: zero-initialised adapters reproduce the base model, merged and unmerged
outputs agree, only adapters train (the frozen base in bf16 with no masters), 2-rank DDP with
frozen parameters needs no unused-parameter search and matches one rank, and LoRA composes with
recompute and regional compile."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from safetensors.torch import load_file

import ddptrain
from _dist import run_ranks
from ddptrain import checkpoint as ckpt
from ddptrain import weights
from ddptrain.lora import LoRALinear, apply_lora, lora_state_dict, merge_lora, merged_state_dict, unmerge_lora
from test_trainer import make_cfg, params_of

D = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        h = x + torch.tanh(self.q_proj(x)) * self.v_proj(x)
        return h + self.mlp(self.norm(h))


class Tiny(nn.Module):
    """Two blocks and a head: the targets are attention-like and MLP projections."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 1)
        self.aux = nn.Linear(D, D)  # never called: were it trainable, DDP would need find_unused_parameters

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)


TARGETS = ["blocks.*.q_proj", "blocks.*.v_proj", "blocks.*.mlp.*"]


def loss_fn(model, batch):
    err = (model(batch["x"]).float() - batch["y"]) ** 2
    return err.sum(), err.numel()


def data(n, seed=0, rows=4):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, 5, 3, generator=g), "y": torch.randn(rows, 5, generator=g)} for _ in range(n)]


def _randomise_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.3)


def test_zero_initialised_adapters_reproduce_the_base_model():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 5, 3)
    base_out, base_keys = model(x), set(model.state_dict())
    names = apply_lora(model, TARGETS, rank=4, alpha=8)
    assert names == ["blocks.0.q_proj", "blocks.0.v_proj", "blocks.0.mlp.0", "blocks.0.mlp.2",
                     "blocks.1.q_proj", "blocks.1.v_proj", "blocks.1.mlp.0", "blocks.1.mlp.2"]
    assert torch.equal(model(x), base_out)
    # base names unchanged (base checkpoints load as they are); adapters are <layer>.lora_A / lora_B
    assert set(model.state_dict()) == base_keys | set(lora_state_dict(model))
    assert "blocks.0.q_proj.lora_A" in lora_state_dict(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    assert isinstance(model.blocks[0].q_proj, nn.Linear) and model.blocks[0].q_proj.lora_scaling == 2.0


def test_merged_and_unmerged_outputs_agree_and_merge_restores_the_base_layout():
    torch.manual_seed(0)
    model = Tiny()
    base_keys, w0 = set(model.state_dict()), model.blocks[0].q_proj.weight.detach().clone()
    x = torch.randn(2, 5, 3)
    base_out = model(x)
    apply_lora(model, TARGETS, rank=4, alpha=8, dropout=0.5)
    _randomise_adapters(model)
    model.eval()  # dropout off: the adapter's eval output is what merging bakes in
    unmerged = model(x)
    assert (unmerged - base_out).abs().max() > 0.1  # the adapters do change the output
    exported = merged_state_dict(model)
    assert set(exported) == base_keys and torch.equal(model.blocks[0].q_proj.weight, w0)  # model unchanged

    merge_lora(model, keep_adapters=True)
    torch.testing.assert_close(model(x), unmerged, rtol=1e-5, atol=1e-6)
    unmerge_lora(model)
    torch.testing.assert_close(model.blocks[0].q_proj.weight, w0, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x), unmerged, rtol=1e-5, atol=1e-6)

    merge_lora(model)
    assert type(model.blocks[0].q_proj) is nn.Linear and set(model.state_dict()) == base_keys
    torch.testing.assert_close(model(x), unmerged, rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        assert torch.equal(v, exported[k]), k

    plain = Tiny()
    plain.load_state_dict(exported)  # the base model's own class loads the merged weights
    torch.testing.assert_close(plain.eval()(x), unmerged, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["fp32", "bf16_autocast", "bf16_base_fp32_adapters"])
def test_adapter_output_and_gradients_follow_the_formula(case):
    """``W x + b + s B A x`` and its gradients for x, A and B, on each path the forward takes: fp32,
    bf16 autocast, and a bf16 base with fp32 adapters outside autocast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 2 * D))
    apply_lora(model, ["0"], rank=4, alpha=12)
    m = model[0]
    with torch.no_grad():
        m.lora_B.normal_()
    if case == "bf16_base_fp32_adapters":
        m.weight.data, m.bias.data = m.weight.data.bfloat16(), m.bias.data.bfloat16()
    x = torch.randn(3, 5, D, requires_grad=True)
    xin = x.bfloat16() if case == "bf16_base_fp32_adapters" else x
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16_autocast"):
        out = m(xin)
    A, B = m.lora_A.detach().clone().requires_grad_(), m.lora_B.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ref = (x2 @ m.weight.float().t() + m.bias.float()) + m.lora_scaling * (x2 @ A.t() @ B.t())
    rel = 1e-6 if case == "fp32" else 1e-2  # of the reference's norm: bf16 rounds each element to 2^-8

    def close(a, b):
        assert (a.float() - b).norm() <= rel * b.norm(), (case, (a.float() - b).norm() / b.norm())

    expected_dtype = torch.float32 if case == "fp32" else torch.bfloat16
    assert out.dtype == expected_dtype and out.shape == (3, 5, 2 * D)
    close(out, ref.detach())
    g = torch.randn(out.shape)
    out.float().backward(g)
    ref.backward(g)
    for got, want in ((x.grad, x2.grad), (m.lora_A.grad, A.grad), (m.lora_B.grad, B.grad)):
        close(got, want)


def test_bad_targets_and_globs_are_errors():
    class Sub(nn.Linear):
        pass

    model = Tiny()
    with pytest.raises(ValueError, match="matched no nn.Linear layer.*blocks.0.q_proj"):
        apply_lora(model, ["*.k_proj"])
    with pytest.raises(ValueError, match="trainable globs \\['nope.\\*'\\] matched no parameter"):
        apply_lora(model, TARGETS, trainable=["nope.*"])
    model.head = Sub(D, 1)
    with pytest.raises(ValueError, match="head is a Sub, a subclass of nn.Linear"):
        apply_lora(model, ["head"])
    apply_lora(model, ["blocks.0.q_proj"])
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        apply_lora(model, ["blocks.0.q_proj"])
    with torch.device("meta"):
        meta = Tiny()
    with pytest.raises(ValueError, match="meta device: load the base weights"):
        apply_lora(meta, TARGETS)
    with pytest.raises(ddptrain.ConfigError, match="lora.enabled=true needs lora.targets"):
        ddptrain.load_config(None, ["lora.enabled=true"])
    with pytest.raises(ddptrain.ConfigError, match="lora.rank=0"):
        ddptrain.load_config(None, ["lora.rank=0"])


LORA = ("lora.enabled=true", f"lora.targets={TARGETS}".replace("'", ""), "lora.rank=4", "lora.alpha=8",
        "lora.trainable=[head.*]")
BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16")


def test_trainer_trains_adapters_only_with_the_frozen_base_in_bf16_without_masters(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = make_cfg(tmp_path, "trainer.max_steps=3", "checkpoint.save_at_end=false", *LORA, *BF16)
    trainer = ddptrain.Trainer(model, loss_fn, cfg, data(3))
    assert len(trainer.adapted) == 8
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    masters = {id(p) for p, _ in trainer.backend.master.pairs}
    assert masters == {id(p) for p in model.parameters() if p.requires_grad}  # adapters + head only
    trainer.fit()
    after = model.state_dict()
    for k, v in base.items():
        if k.startswith("head."):
            assert not torch.equal(after[k].float(), v.to(torch.bfloat16).float()), f"{k} did not train"
        else:
            assert torch.equal(after[k], v.to(after[k].dtype)), f"frozen {k} changed"
    assert all(not torch.equal(v, torch.zeros_like(v)) for k, v in lora_state_dict(model).items() if "lora_B" in k)


def _ddp_worker(rank, world, out, extra):
    torch.manual_seed(0)
    model = Tiny()
    cfg = make_cfg(os.path.join(out, "ddp"), "trainer.max_steps=3", "checkpoint.save_at_end=false",
                   "dist.find_unused_parameters=false", *LORA, *extra)
    trainer = ddptrain.Trainer(model, loss_fn, cfg, data(3, seed=rank, rows=2))
    trainer.fit()
    if rank == 0:
        torch.save(params_of(model), os.path.join(out, "ddp.pt"))


@pytest.mark.timeout(120)
def test_two_rank_ddp_with_frozen_base_needs_no_unused_parameter_search_and_matches_one_rank(tmp_path):
    """DDP registers only the adapters (and the head): the frozen base never takes part in the
    gradient all-reduce, and with find_unused_parameters=false nothing complains."""
    run_ranks(_ddp_worker, 2, str(tmp_path), ())
    two = torch.load(tmp_path / "ddp.pt")
    torch.manual_seed(0)
    one = Tiny()
    both = [{"x": torch.cat([a["x"], b["x"]]), "y": torch.cat([a["y"], b["y"]])}
            for a, b in zip(data(3, seed=0, rows=2), data(3, seed=1, rows=2))]
    cfg = make_cfg(tmp_path / "one", "trainer.max_steps=3", "checkpoint.save_at_end=false", *LORA)
    ddptrain.Trainer(one, loss_fn, cfg, both).fit()
    for k, v in params_of(one).items():
        torch.testing.assert_close(two[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(two["blocks.0.q_proj.lora_B"], torch.zeros_like(two["blocks.0.q_proj.lora_B"]))


def test_composes_with_recompute_and_regional_compile(tmp_path):
    """The adapted layers inside recomputed, compiled blocks give the eager model's gradients."""
    def grads(*extra):
        torch.manual_seed(0)
        model = Tiny()
        cfg = make_cfg(tmp_path / "x", "trainer.max_steps=1", "checkpoint.save_at_end=false",
                       "checkpoint.start_over=true", *LORA, "lora.dropout=0.3", *extra)
        trainer = ddptrain.Trainer(model, loss_fn, cfg, data(1))
        _randomise_adapters(model)
        torch.manual_seed(5)  # the same dropout masks in every variant
        loss, _ = loss_fn(trainer.model, data(1)[0])
        loss.backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        trainer.close()
        return out

    plain = grads()
    both = grads("recompute.enabled=true", "recompute.module_classes=[Block]", "compile.enabled=true",
                 "compile.module_classes=[Block]", "compile.backend=aot_eager")
    assert set(plain) == set(both) and any("lora_A" in k for k in plain)
    for k, v in plain.items():
        torch.testing.assert_close(both[k], v, rtol=1e-5, atol=1e-6, msg=k)


# ----------------------------------------------------------------------------- trainable-only checkpoints


def _base_file(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "base.safetensors"
    ddptrain.save_weights(Tiny(), str(path))
    return str(path)


def _run(out, base, steps, *extra):
    """A LoRA run on the base model's weights, checkpoints holding the trainable tensors only."""
    torch.manual_seed(0)
    model = Tiny()
    ddptrain.load_weights(model, base)
    cfg = make_cfg(out, f"trainer.max_steps={steps}", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                   "checkpoint.trainable_only=true", f"checkpoint.base_model={base}", *LORA, *BF16, *extra)
    trainer = ddptrain.Trainer(model, loss_fn, cfg, data(steps))
    trainer.fit()
    return trainer


def test_trainable_only_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path):
    base = _base_file(tmp_path)
    full = _run(tmp_path / "full", base, 4)
    step4 = tmp_path / "full" / "checkpoints" / "step_00000004"
    saved = load_file(str(step4 / "model.safetensors"))
    want = set(lora_state_dict(full.module)) | {"head.weight", "head.bias"}
    assert set(saved) == want  # the frozen base is not in it
    assert all(v.dtype == torch.float32 for v in saved.values())  # the fp32 masters
    info = weights.weights_info(str(step4))
    assert info["trainable_only"] and info["base_model"] == os.path.abspath(base) and info["base_fingerprint"]
    assert set(info["lora_scalings"]) == set(full.adapted)

    resumed = _run(tmp_path / "resumed", base, 4, f"checkpoint.resume={tmp_path / 'full' / 'checkpoints' / 'step_00000002'}")
    assert resumed.step == 4
    for k, v in full.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[k], v), f"{k} differs after resume"
    for (_, a), (_, b) in zip(full.backend.master.pairs, resumed.backend.master.pairs):
        assert torch.equal(a, b)

    # resuming onto another base model is refused, naming the base
    other = tmp_path / "other.safetensors"
    torch.manual_seed(7)
    ddptrain.save_weights(Tiny(), str(other))
    with pytest.raises(ckpt.CheckpointError, match="frozen weights of .*base.safetensors.* differ"):
        _run(tmp_path / "wrong", str(other), 4, f"checkpoint.resume={step4}")


def test_load_weights_composes_base_and_adapters_and_export_merges_them(tmp_path):
    base = _base_file(tmp_path)
    trained = _run(tmp_path / "run", base, 2).module.eval()
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        want = trained(x.to(torch.bfloat16)).float()  # the bf16 model the run trained

    # a plain model of the base architecture, built on the meta device: base + adapters from the checkpoint
    with weights.empty_weights():
        model = Tiny()
    ddptrain.load_weights(model, str(tmp_path / "run"), dtype=torch.float32)
    assert isinstance(model.blocks[0].q_proj, LoRALinear)
    assert not any(t.is_meta for t in model.state_dict().values())
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), want, rtol=2e-2, atol=2e-2)  # trained in bf16
        exact = {k: v for k, v in model.state_dict().items()}
    trained_fp32 = weights.read_weights(str(tmp_path / "run"))[1]
    assert all(torch.equal(exact[k], v) for k, v in trained_fp32.items())  # the masters, exactly

    # export: plain merged safetensors the base class loads
    assert weights.main(["export", str(tmp_path / "run"), str(tmp_path / "merged"), "--max-shard-gb", "1e-6"]) == 0
    assert (tmp_path / "merged" / "model.safetensors.index.json").exists()  # tiny shards: several files
    plain = Tiny()
    weights.load_pretrained(plain, str(tmp_path / "merged"))
    assert set(plain.state_dict()) == set(Tiny().state_dict())
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), model(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ckpt.CheckpointError, match="holds the trainable parameters only; its base model"):
        os.rename(base, base + ".moved")
        ddptrain.load_weights(Tiny(), str(tmp_path / "run"))
    ddptrain.load_weights(Tiny(), str(tmp_path / "run"), base=base + ".moved")


def test_adapters_export_holds_the_trained_tensors_alone_and_loads_on_the_base(tmp_path):
    base = _base_file(tmp_path)
    trained = _run(tmp_path / "run", base, 2).module.eval()
    assert weights.main(["adapters", str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    file = str(tmp_path / "out" / "adapters.safetensors")
    saved, stored = load_file(file), weights.read_weights(str(tmp_path / "run"))[1]
    assert set(saved) == set(stored) == set(lora_state_dict(trained)) | {"head.weight", "head.bias"}  # no base tensor
    assert all(torch.equal(v, stored[k]) for k, v in saved.items())
    info = weights.weights_info(file)
    assert info["trainable_only"] and info["base_model"] == os.path.abspath(base)
    assert set(info["lora_scalings"]) == {k[: -len(".lora_A")] for k in saved if k.endswith(".lora_A")}
    # the file alone, on a plain model: the base from its path, the adapters added from its header
    model = Tiny()
    ddptrain.load_weights(model, file)
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), trained(x.to(torch.bfloat16)).float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ckpt.CheckpointError, match="holds no LoRA adapters"):
        weights.export_adapters(base, str(tmp_path / "none"))


def test_a_target_pattern_that_matches_nothing_is_refused_with_the_closest_names():
    """issue 30, item 7: a typo in one pattern adapted fewer layers without a word."""
    from ddptrain.lora import LoRALinear

    model = Tiny()
    with pytest.raises(ValueError, match=r"lora.targets pattern 'blocks.\*.vproj' matched no nn.Linear layer.*"
                                         r"closest.*'blocks.\*.v_proj'"):
        apply_lora(model, ["blocks.*.q_proj", "blocks.*.vproj"])
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # refused before anything changed
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"'blocks.\*.mlp' matched no nn.Linear layer.*only modules that are not "
                                         r"nn.Linear.*blocks.0.mlp \(Sequential\).*'blocks.\*.mlp.\*'"):
        apply_lora(model, ["blocks.*.q_proj", "blocks.*.mlp"])
