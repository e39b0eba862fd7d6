"""Tests for ddptrain/fused_update.py (``optim.fused_update``): AdamW on the fp32 masters of a bf16
model, the bf16 gradients read and the bf16 weights written by one Triton kernel.

On the CPU the Trainer runs the unfused half of the update (torch's fused AdamW on fp32
gradients); the kernel itself runs in Triton's interpreter, in a subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import ddptrain
from ddptrain.update.fused import FusedMasterAdamW
from ddptrain.precision import MasterWeights
from test_precision import BF16, Weights, const_grad_loss
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches

HERE = os.path.dirname(os.path.abspath(__file__))


def _fit(out, *extra, steps=4, resume="none"):
    torch.manual_seed(0)
    model = FrameMLP()
    data = [mb[0] for mb in micro_batches(steps * 2)]
    cfg = make_cfg(out, f"trainer.max_steps={steps}", "trainer.grad_accum_steps=2", "trainer.clip_grad_norm=0.5",
                   "checkpoint.every_steps=2", "checkpoint.keep_last=0", f"checkpoint.resume={resume}",
                   *BF16, *extra)
    trainer = ddptrain.Trainer(model, frame_loss, cfg, data)
    trainer.fit()
    return trainer


def _masters(trainer):
    return [m.detach().clone() for _, m in trainer.backend.master.pairs]


def test_fused_update_steps_as_torch_adamw_does(tmp_path):
    plain = _fit(tmp_path / "plain")
    fused = _fit(tmp_path / "fused", "optim.fused_update=true")
    assert fused.step == plain.step == 4
    for a, b in zip(_masters(fused), _masters(plain)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for (p, _), (q, _) in zip(fused.backend.master.pairs, plain.backend.master.pairs):
        assert p.dtype == q.dtype
        assert torch.allclose(p.detach().float(), q.detach().float(), rtol=1e-2, atol=1e-3)
    state = fused.optimizer.state[fused.backend.master.pairs[0][1]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 4.0


def test_fused_update_resumes_exactly_and_from_an_unfused_checkpoint(tmp_path):
    full = _fit(tmp_path / "full", "optim.fused_update=true")
    resumed = _fit(tmp_path / "resumed", "optim.fused_update=true",
                   resume=str(tmp_path / "full" / "checkpoints" / "step_00000002"))
    assert resumed.step == 4
    for a, b in zip(_masters(resumed), _masters(full)):
        assert torch.equal(a, b)
    # the optimizer state is torch AdamW's own: an unfused run's checkpoint resumes under the fused update
    _fit(tmp_path / "plain")
    crossed = _fit(tmp_path / "crossed", "optim.fused_update=true",
                   resume=str(tmp_path / "plain" / "checkpoints" / "step_00000002"))
    for a, b in zip(_masters(crossed), _masters(full)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_fused_update_with_cuda_graphs_keeps_the_kept_gradients(tmp_path):
    # graphs (the CPU's rerun backend) keep the model's gradients between steps: the update reads them
    fused = _fit(tmp_path / "fused", "optim.fused_update=true")
    graphed = _fit(tmp_path / "graphed", "optim.fused_update=true", "compile.cuda_graphs=true",
                   "compile.cuda_graph_warmup=1")
    assert graphed.graphs is not None and graphed.graphs.replayed > 0
    for a, b in zip(_masters(graphed), _masters(fused)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_non_finite_step_changes_nothing():
    model = Weights()
    master = MasterWeights(model)
    opt = torch.optim.AdamW([m for _, m in master.pairs], lr=1e-2)
    update = FusedMasterAdamW(opt, master)
    for p, _ in master.pairs:
        p.grad = torch.ones_like(p)
    update.step(torch.ones((), dtype=torch.float64), torch.zeros(()))
    before = [(m.detach().clone(), {k: v.clone() for k, v in opt.state[m].items()}) for _, m in master.pairs]
    weights = [p.detach().clone() for p, _ in master.pairs]
    update.step(torch.ones((), dtype=torch.float64), torch.ones(()))  # found_inf
    for (p, m), (m0, s0), w0 in zip(master.pairs, before, weights):
        assert torch.equal(m, m0) and torch.equal(p, w0)
        assert all(torch.equal(opt.state[m][k], v) for k, v in s0.items())
        assert float(opt.state[m]["step"]) == 1.0


def test_fused_update_needs_bf16_masters_and_adamw():
    with pytest.raises(ddptrain.ConfigError, match="optim.fused_update=true .* trainer.param_dtype=bf16"):
        ddptrain.load_config(None, ["optim.fused_update=true"])
    with pytest.raises(ddptrain.ConfigError, match="optim.fused_update=true"):
        ddptrain.load_config(None, [*BF16, "optim.fused_update=true", "optim.name=sgd"])
    with pytest.raises(ddptrain.ConfigError, match="optim.fused_update=true"):
        ddptrain.load_config(None, [*BF16, "optim.fused_update=true", "optim.offload=cpu"])
    ddptrain.load_config(None, [*BF16, "optim.fused_update=true"])



def test_auto_takes_the_fused_update_where_it_applies_and_only_there(tmp_path, monkeypatch):
    """optim.fused_update=auto (the default): on a GPU with Triton for bf16 masters under a plain,
    fused AdamW; off on the CPU, under another optimizer or AdamW's unfused kernels, with sharded or
    absent masters, without Triton; ``true`` refuses what ``auto`` passes over."""
    from ddptrain.update import fused as fused_update

    assert ddptrain.load_config(None, []).optim.fused_update == "auto"
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    master = MasterWeights(Weights())
    adamw = torch.optim.AdamW([m for _, m in master.pairs], lr=1e-2, fused=True)  # as optim.fused=auto on a GPU
    unfused = torch.optim.AdamW([m for _, m in master.pairs], lr=1e-2, foreach=True)  # optim.fused=false
    sgd = torch.optim.SGD([m for _, m in master.pairs], lr=1e-2)
    monkeypatch.setattr(fused_update.importlib.util, "find_spec", lambda name: object())  # "Triton is there"
    assert isinstance(fused_update.for_run("auto", adamw, master, gpu), FusedMasterAdamW)
    assert fused_update.for_run("auto", adamw, master, cpu) is None
    assert fused_update.for_run("auto", sgd, master, gpu) is None
    assert fused_update.for_run("auto", unfused, master, gpu) is None
    assert fused_update.for_run("auto", adamw, None, gpu) is None
    assert fused_update.for_run("false", adamw, master, gpu) is None
    assert isinstance(fused_update.for_run("true", adamw, master, cpu), FusedMasterAdamW)  # the CPU runs its unfused half
    with pytest.raises(ddptrain.ConfigError, match="optim.name=adamw"):
        fused_update.for_run("true", sgd, master, gpu)
    monkeypatch.setattr(master, "sharded", True, raising=False)
    assert fused_update.for_run("auto", adamw, master, gpu) is None
    monkeypatch.setattr(master, "sharded", False, raising=False)
    monkeypatch.setattr(fused_update.importlib.util, "find_spec", lambda name: None)  # no Triton
    assert fused_update.for_run("auto", adamw, master, gpu) is None
    monkeypatch.undo()
    # through the Trainer on the CPU: auto leaves the unfused update in place
    assert _fit(tmp_path / "auto", steps=2).backend.fused is None

KERNEL_CHECK = r"""
import torch
from torch import nn
from ddptrain.update.fused import FusedMasterAdamW, _BLOCK
from ddptrain.precision import MasterWeights
from ddptrain.optim import param_groups

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(70, 2 * _BLOCK // 70 + 3), nn.LayerNorm(2 * _BLOCK // 70 + 3),
                      nn.BatchNorm1d(2 * _BLOCK // 70 + 3), nn.Linear(2 * _BLOCK // 70 + 3, 5))
ref_params = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
master = MasterWeights(model)
groups = param_groups(model, 0.1)  # decay for weights, none for biases and norms
masters = {id(p): m for p, m in master.pairs}
opt = torch.optim.AdamW([dict(g, params=[masters[id(p)] for p in g["params"]]) for g in groups],
                        lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
index = {id(p): i for i, p in enumerate(model.parameters())}
ref = torch.optim.AdamW([dict(g, params=[ref_params[index[id(p)]] for p in g["params"]]) for g in groups],
                        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
update = FusedMasterAdamW(opt, master)
for step in range(3):
    for (p, _), r in zip(master.pairs, ref_params):
        g = torch.randn(p.shape).to(p.dtype)
        p.grad = g
        r.grad = g.float() * 0.5
    found_inf = torch.tensor(float(step == 1))
    update.step(torch.tensor(0.5, dtype=torch.float64), found_inf)
    if step != 1:
        ref.step()
kernel = sum(p is not m for p, m in master.pairs)
assert kernel == 6, kernel  # cast to bf16: both Linear layers and the LayerNorm (BatchNorm stays fp32)
for (p, m), r in zip(master.pairs, ref_params):
    assert torch.allclose(m, r, rtol=1e-6, atol=1e-7), (p.shape, (m - r).abs().max())
    assert float(opt.state[m]["step"]) == 2.0
    if p is not m:  # the interpreter rounds to bf16 toward zero, the GPU to nearest: within one bf16 step
        ulp = m.detach().abs() * 2.0 ** -7 + 1e-30
        assert ((p.float() - m).abs() <= ulp).all()
print("KERNEL OK", kernel)
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_kernel_matches_torch_adamw_in_tritons_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "KERNEL OK 6" in done.stdout
