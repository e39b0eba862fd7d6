"""Tests for ddptrain/compile.py: regional compilation gives the eager gradients, also inside
recompute regions, and leaves parameter names alone.

The ``aot_eager`` backend traces with dynamo and AOT autograd (what inductor consumes) without
generating code, so these tests need no C compiler. Its dropout draws random numbers differently
from eager kernels, so compiled-vs-eager comparisons run with dropout off; compiled-with-recompute
vs compiled-without-recompute runs with dropout on and must agree exactly.
"""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch
from torch import nn

import ddptrain

from ddptrain.compile import EagerFallbacks, apply_compile, compile_whole
from ddptrain.config import CompileConfig, ConfigError, RecomputeConfig
from ddptrain.recompute import apply_recompute, remove_recompute
from _dist import run_ranks
from test_recompute import TinyTransformer, _grads
from test_trainer import FEAT, FrameMLP, concat, frame_loss, make_batch, make_cfg, micro_batches, params_of


def _cfg(**kw) -> CompileConfig:
    return CompileConfig(enabled=True, backend="aot_eager", **kw)


def _set_dropout(model: nn.Module, p: float) -> None:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = p


def _loss(feats):
    return lambda m: m(feats).pow(2).sum()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_regional_compile_matches_eager_and_keeps_names():
    torch.manual_seed(0)
    plain = TinyTransformer().train()
    _set_dropout(plain, 0.0)
    ours = copy.deepcopy(plain)
    names = apply_compile(ours, _cfg(module_classes=["Block"]))
    assert names == [f"layers.{i}" for i in range(4)]
    assert list(ours.state_dict()) == list(plain.state_dict())  # checkpoints stay loadable
    torch._dynamo.utils.counters.clear()
    feats = torch.randn(2, 7, 8)
    want, got = _grads(plain, _loss(feats)), _grads(ours, _loss(feats))
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > 0  # really went through dynamo
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_compiled_inside_recompute_equals_compiled_without_recompute():
    torch.manual_seed(0)
    base = TinyTransformer().train()  # dropout on: the recomputation must replay the same masks
    compiled = copy.deepcopy(base)
    apply_compile(compiled, _cfg(module_classes=["Block"]))
    both = copy.deepcopy(base)
    assert len(apply_recompute(both, RecomputeConfig(enabled=True, module_classes=["Block"]))) == 4
    apply_compile(both, _cfg(module_classes=["Block"]))
    assert all(layer.forward.inner is not type(layer).forward for layer in both.layers)
    feats = torch.randn(2, 7, 8)
    torch._dynamo.utils.counters.clear()
    want, got = _grads(compiled, _loss(feats), seed=3), _grads(both, _loss(feats), seed=3)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_recompute_applied_after_compile_keeps_the_compiled_forward():
    torch.manual_seed(0)
    base = TinyTransformer().train()
    compiled = copy.deepcopy(base)
    apply_compile(compiled, _cfg(module_classes=["Block"]))
    later = copy.deepcopy(base)
    apply_compile(later, _cfg(module_classes=["Block"]))
    apply_recompute(later, RecomputeConfig(enabled=True, module_classes=["Block"]))
    assert all(layer.forward.inner is not type(layer).forward and layer.forward.around is not None
               for layer in later.layers)
    feats = torch.randn(2, 7, 8)
    want, got = _grads(compiled, _loss(feats), seed=3), _grads(later, _loss(feats), seed=3)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert remove_recompute(later) == [f"layers.{i}" for i in range(4)]
    assert all(layer.forward.around is None and layer.forward.inner is not type(layer).forward
               for layer in later.layers)  # still compiled


def test_a_forward_set_by_other_code_is_not_silently_replaced():
    model = TinyTransformer()
    model.layers[1].forward = lambda *a, **k: None  # e.g. a hook library's own wrapper
    with pytest.raises(ValueError, match="'layers.1' already has an instance-level forward"):
        apply_compile(model, _cfg(module_classes=["Block"]))
    with pytest.raises(ValueError, match="'layers.1' already has an instance-level forward"):
        apply_recompute(model, RecomputeConfig(enabled=True, name_globs=["layers.1"]))


def test_deepcopy_of_compiled_recompute_model_uses_its_own_weights():
    torch.manual_seed(0)
    model = TinyTransformer().train()
    _set_dropout(model, 0.0)
    apply_recompute(model, RecomputeConfig(enabled=True, module_classes=["Block"]))
    apply_compile(model, _cfg(module_classes=["Block"]))
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    feats = torch.randn(2, 7, 8)
    g_model, g_ema = _grads(model, _loss(feats)), _grads(ema, _loss(feats))
    assert all(v.abs().sum() > 0 for v in g_ema.values())
    assert any(not torch.equal(g_model[k], g_ema[k]) for k in g_model)


def test_nothing_matched_names_the_section():
    with pytest.raises(ValueError, match="compile is enabled but no module matched.*Block"):
        apply_compile(TinyTransformer(), _cfg(module_classes=["NoSuchLayer"]))


def test_disabled_or_whole_model_config_leaves_the_model_alone():
    model = TinyTransformer()
    assert apply_compile(model, CompileConfig(enabled=False, module_classes=["Block"])) == []
    assert apply_compile(model, _cfg()) == []  # whole model: the Trainer wraps DDP instead
    assert "forward" not in model.layers[0].__dict__


def test_whole_model_compile_with_ddp_needs_buckets_of_at_least_1_mb():
    model = FrameMLP()
    with pytest.raises(ConfigError, match=r"dist.bucket_cap_mb=0.5 .*compile.ddp_overlap=false"):
        compile_whole(model, _cfg(), ddp_bucket_cap_mb=0.5)
    compile_whole(model, _cfg(ddp_overlap=False), ddp_bucket_cap_mb=0.5)
    assert torch._dynamo.config.optimize_ddp is False
    compile_whole(model, _cfg(), ddp_bucket_cap_mb=None)  # no DDP: nothing to split
    assert torch._dynamo.config.optimize_ddp is True


# Trainer on 2 gloo ranks vs eager on 1: regional compile inside recompute regions, and the whole
# model compiled after DDP, its graph split at DDP's buckets (dynamo's DDPOptimizer; one bucket
# for this small model) or one graph with the all-reduce after the backward
TRAINER_CASES = {
    "regional_recompute": (["compile.module_classes=[Sequential]", "recompute.enabled=true",
                            "recompute.module_classes=[Sequential]"], ["net"]),
    "whole_split_at_buckets": (["compile.ddp_overlap=true"], []),
    "whole_one_graph": (["compile.ddp_overlap=false"], []),
}


def _trainer_worker(rank, world, out, steps, case):
    overrides, compiled = TRAINER_CASES[case]
    torch.manual_seed(0)
    model = FrameMLP()
    cfg = make_cfg(os.path.join(out, "compiled"), f"trainer.max_steps={steps}", "checkpoint.save_at_end=false",
                   "compile.enabled=true", "compile.backend=aot_eager", *overrides)
    trainer = ddptrain.Trainer(model, frame_loss, cfg, [mb[rank] for mb in micro_batches(steps)])
    assert trainer.compiled == compiled and trainer.recomputed == compiled
    if not compiled:
        assert torch._dynamo.config.optimize_ddp is cfg.compile.ddp_overlap
    trainer.fit()
    if rank == 0:
        torch.save(params_of(model), os.path.join(out, "compiled.pt"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_compiled_trainer_on_two_ranks_matches_eager(tmp_path, case):
    steps = 3
    run_ranks(_trainer_worker, 2, str(tmp_path), steps, case)
    torch.manual_seed(0)
    eager = FrameMLP()
    cfg = make_cfg(tmp_path / "eager", f"trainer.max_steps={steps}", "checkpoint.save_at_end=false")
    ddptrain.Trainer(eager, frame_loss, cfg, [concat(a, b) for a, b in micro_batches(steps)]).fit()
    got = torch.load(tmp_path / "compiled.pt")
    for k, v in params_of(eager).items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


class _Scaled(nn.Module):
    """A block class reused with a different Python flag per instance: dynamo guards on the flag,
    so each instance is its own compiled variant of the one compiled forward."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.lin = k, nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.k


@pytest.mark.parametrize("limit,graphs", [(None, 12), (8, 8)])
def test_recompile_limit_keeps_every_variant_of_a_block_class_compiled(limit, graphs):
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):  # restored after
        _count_graphs(limit, graphs)


def _count_graphs(limit, graphs):
    model = nn.Sequential(*[_Scaled(k) for k in range(1, 13)])
    cfg = _cfg(module_classes=["_Scaled"]) if limit is None else _cfg(module_classes=["_Scaled"], recompile_limit=limit)
    apply_compile(model, cfg)
    assert torch._dynamo.config.recompile_limit == cfg.recompile_limit
    torch._dynamo.utils.counters.clear()
    model(torch.randn(2, 4)).sum().backward()
    # past the limit dynamo runs a block eagerly without an error: torch's default (8) would
    # leave 4 of these 12 blocks uncompiled, as it left VoxCPM2's MiniCPM layers
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


class _Variants(nn.Module):
    """Twelve instances of one block class, each its own compiled variant (see ``_Scaled``)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(FEAT, 4), nn.Linear(4, 1)
        self.blocks = nn.Sequential(*[_Scaled(k) for k in range(1, 13)])

    def forward(self, x):
        return self.out(self.blocks(self.inp(x))).squeeze(-1)


@pytest.mark.parametrize("limit", [8, 32])
def test_trainer_warns_when_a_compiled_block_falls_back_to_eager(tmp_path, capsys, limit):
    gen = torch.Generator().manual_seed(0)
    data = [make_batch(gen, 3, 5) for _ in range(2)]  # one shape: only the 12 flags make variants
    cfg = make_cfg(tmp_path, "trainer.max_steps=2", "checkpoint.save_at_end=false", "compile.enabled=true",
                   "compile.backend=aot_eager", "compile.module_classes=[_Scaled]", f"compile.recompile_limit={limit}")
    ddptrain.Trainer(_Variants(), frame_loss, cfg, data).fit()
    err = capsys.readouterr().err
    train = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r["split"] == "train"]
    said = [line for line in err.splitlines() if line.startswith("WARNING: torch.compile stopped compiling")]
    where = f"({_Scaled.forward.__code__.co_filename}:{_Scaled.forward.__code__.co_firstlineno})"
    if limit == 8:  # the 9th variant runs eagerly: named once, counted in every line from then on
        assert len(said) == 1 and "compile.recompile_limit=8" in said[0] and where in said[0], err
        assert [r["compile_eager_fallbacks"] for r in train] == [1, 1]
    else:
        assert said == [] and [r["compile_eager_fallbacks"] for r in train] == [0, 0]


def test_eager_fallbacks_counts_a_hit_whose_warning_is_silenced():
    fallbacks = EagerFallbacks(enabled=True)
    logger = logging.getLogger("torch._dynamo.convert_frame")
    level = logger.level
    logger.setLevel(logging.ERROR)  # as TORCH_LOGS="-dynamo" does
    try:
        model = nn.Sequential(*[_Scaled(k) for k in range(1, 13)])
        apply_compile(model, _cfg(module_classes=["_Scaled"], recompile_limit=8))
        model(torch.randn(2, 4)).sum().backward()
    finally:
        logger.setLevel(level)
    said = []
    assert fallbacks.scalars(said.append) == {"compile_eager_fallbacks": 1}
    assert len(said) == 1 and "compile.recompile_limit" in said[0]
    assert EagerFallbacks(enabled=False).scalars(said.append) == {}
