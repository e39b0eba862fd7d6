"""Tests for ddptrain/precision.py's MasterWeights (trainer.param_dtype=bf16): fp32 masters take
updates a bf16 weight cannot hold, BatchNorm stays fp32, checkpoints hold the masters exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ddptrain
from test_trainer import make_cfg

BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16")


class Weights(nn.Module):
    """One weight matrix whose gradient is a known constant: loss = sum(C * W)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 64).reshape(8, 8))
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(x @ self.w)


C = torch.tensor([0.5, -0.25, 1.0, -2.0] * 16).reshape(8, 8)  # exact in bf16


def const_grad_loss(model, batch):
    w = model.module.w if hasattr(model, "module") else model.w
    out = model(batch["x"])  # exercises the bf16 forward through a fp32 BatchNorm
    return (C * w).sum() + 0.0 * out.float().sum(), 1


def test_masters_take_updates_below_bf16_resolution(tmp_path):
    steps, lr = 5, 1e-4  # an Adam step moves each weight by ~lr: far below bf16's 2^-8 relative
    model = Weights()
    w0 = model.w.detach().clone()
    cfg = make_cfg(tmp_path, f"trainer.max_steps={steps}", f"optim.lr={lr}", "optim.weight_decay=0.0",
                   "checkpoint.save_at_end=false", *BF16)
    trainer = ddptrain.Trainer(model, const_grad_loss, cfg, [{"x": torch.randn(4, 8)}] * steps)
    assert model.w.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.float32
    assert model.norm.running_mean.dtype == torch.float32
    trainer.fit()

    ref = nn.Parameter(w0.clone())  # what fp32 AdamW does with the same (exact) gradients
    opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0, foreach=True)
    for _ in range(steps):
        ref.grad = C.clone()
        opt.step()
    master = trainer.backend.master.to_master[model.w]
    assert master.dtype == torch.float32
    assert torch.equal(master.detach(), ref.detach())
    assert torch.equal(model.w.detach(), ref.detach().to(torch.bfloat16))
    moved = (master.detach() - w0).abs()
    assert moved.min() > 0.9 * steps * lr  # every weight moved, in fp32
    # ...while a bf16 weight updated in place would not have moved at all:
    assert torch.equal((w0.to(torch.bfloat16) - lr * torch.sign(C).to(torch.bfloat16)), w0.to(torch.bfloat16))


def _train_4_steps(out, resume, model_cls, loss_fn, make_data, lr):
    """4 steps with bf16 masters and a checkpoint every 2; ``resume``: "none" or a checkpoint."""
    torch.manual_seed(0)
    model = model_cls()
    cfg = make_cfg(out, "trainer.max_steps=4", f"optim.lr={lr}", "checkpoint.every_steps=2",
                   "checkpoint.keep_last=0", f"checkpoint.resume={resume}", *BF16)
    trainer = ddptrain.Trainer(model, loss_fn, cfg, make_data())
    trainer.fit()
    return trainer


def test_checkpoint_holds_fp32_masters_and_resume_restores_them(tmp_path):
    def run(out, resume):
        return _train_4_steps(out, resume, Weights, const_grad_loss, lambda: [{"x": torch.randn(4, 8)}] * 4, 1e-3)

    full = run(tmp_path / "full", "none")
    master = full.backend.master.to_master[full.module.w].detach()
    saved = load_file(str(tmp_path / "full" / "checkpoints" / "step_00000004" / "model.safetensors"))
    assert saved["w"].dtype == torch.float32 and torch.equal(saved["w"], master)
    assert full.module.w.dtype == torch.bfloat16  # the model went back to bf16 after the save
    resumed = run(tmp_path / "resumed", str(tmp_path / "full" / "checkpoints" / "step_00000002"))
    assert resumed.step == 4
    assert torch.equal(resumed.backend.master.to_master[resumed.module.w].detach(), master)
    assert torch.equal(resumed.module.w.detach(), full.module.w.detach())


def test_bf16_params_need_bf16_precision():
    with pytest.raises(ddptrain.ConfigError, match="param_dtype=bf16 needs trainer.precision=bf16"):
        ddptrain.load_config(None, ["trainer.param_dtype=bf16", "trainer.precision=fp16"])


class Tied(nn.Module):
    """Embedding and output projection share one weight (as in Whisper's decoder)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tok):
        return self.out(torch.tanh(self.mid(self.emb(tok))))


def tied_loss(model, batch):
    logits = model(batch["tok"]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, 11), batch["tok"].reshape(-1), reduction="sum"), \
        batch["tok"].numel()


def test_tied_weights_have_one_master_and_save_and_resume(tmp_path):
    def data():
        gen = torch.Generator().manual_seed(1)
        return [{"tok": torch.randint(0, 11, (3, 5), generator=gen)} for _ in range(4)]

    def run(out, resume):
        return _train_4_steps(out, resume, Tied, tied_loss, data, 1e-2)

    full = run(tmp_path / "full", "none")
    model = full.module
    assert model.out.weight is model.emb.weight and len(full.backend.master.pairs) == 3  # emb/out, mid.w, mid.b
    master = full.backend.master.to_master[model.emb.weight].detach()
    saved = load_file(str(tmp_path / "full" / "checkpoints" / "step_00000004" / "model.safetensors"))
    assert torch.equal(saved["emb.weight"], master) and torch.equal(saved["out.weight"], master)
    resumed = run(tmp_path / "resumed", str(tmp_path / "full" / "checkpoints" / "step_00000002"))
    assert resumed.module.out.weight is resumed.module.emb.weight
    assert torch.equal(resumed.backend.master.to_master[resumed.module.emb.weight].detach(), master)


def test_reset_scaler_forgets_a_failed_step_and_keeps_the_scale():
    """A step that failed after unscale_ (an OOM in the pre-flight check or the tuner) leaves
    GradScaler refusing the next unscale_; reset_scaler clears that, and the scale and its growth
    count stay as they were."""
    from ddptrain.precision import Precision

    w = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    prec = Precision("fp16", torch.device("cpu"), init_scale=1024.0)
    prec.scale((w * 2).sum()).backward()
    assert prec.step(opt)  # a finite step: the growth count is now 1
    grown = prec.state_dict()
    prec.scale((w * 2).sum()).backward()
    prec.unscale_(opt)  # ... and the step fails here
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        prec.unscale_(opt)
    prec.reset_scaler()
    assert prec.state_dict() == grown and prec.loss_scale() == 1024.0
    w.grad = None
    prec.scale((w * 2).sum()).backward()
    prec.unscale_(opt)
    assert torch.equal(w.grad, torch.full((4,), 2.0))  # unscaled by the kept scale
    Precision("bf16", torch.device("cpu")).reset_scaler()  # no scaler: nothing to reset
