"""Optimizer parameter groups and LR schedules."""


import pytest
import torch
from torch import nn

from ddptrain.config import OptimConfig, SchedulerConfig
from ddptrain.optim import build_optimizer, build_scheduler, lr_lambda, param_groups


def test_no_decay_for_biases_and_norms():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Conv1d(8, 8, 3), nn.BatchNorm1d(8))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert len(no_decay["params"]) == 6  # 2 biases, LayerNorm w+b, BatchNorm w+b


def test_frozen_params_are_left_out():
    model = nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    assert sum(len(g["params"]) for g in opt.param_groups) == 1


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_optimizers_build_and_step(name):
    model = nn.Linear(4, 1)
    opt = build_optimizer(model, OptimConfig(name=name, lr=0.1), torch.device("cpu"))
    model(torch.randn(3, 4)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight)


def test_schedules():
    f = lr_lambda(SchedulerConfig(name="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1), total_steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(59) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)  # half-way through the decay
    assert f(109) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    lin = lr_lambda(SchedulerConfig(name="warmup_linear", warmup_steps=0), total_steps=100)
    assert lin(49) == pytest.approx(0.5)
    noam = lr_lambda(SchedulerConfig(name="noam", warmup_steps=100), total_steps=10_000)
    assert noam(99) == pytest.approx(1.0) and noam(399) == pytest.approx(0.5)
    assert max(noam(s) for s in range(1000)) == pytest.approx(1.0)
    const = lr_lambda(SchedulerConfig(name="constant", warmup_steps=4), total_steps=10)
    assert [const(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_scheduler_sets_lr():
    model = nn.Linear(2, 2)
    opt = build_optimizer(model, OptimConfig(lr=1.0), torch.device("cpu"))
    sched = build_scheduler(opt, SchedulerConfig(name="warmup_linear", warmup_steps=2), total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 0.5, 0.0])
