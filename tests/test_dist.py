"""Tests for ddptrain/dist.py helpers that need a process group (2 gloo ranks)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from _dist import run_ranks
from ddptrain import dist


def _broadcast_worker(rank, world, out):
    dist.setup("gloo", 60.0, "cpu")
    torch.manual_seed(100 + rank)  # a different init on every rank
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3).to(torch.float64))
    model[1].running_mean.normal_()
    dist.broadcast_module(model)
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    dist.teardown()


@pytest.mark.timeout(120)
def test_broadcast_module_copies_rank0_params_and_buffers_of_every_dtype(tmp_path):
    run_ranks(_broadcast_worker, 2, str(tmp_path))
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    torch.manual_seed(100)
    want = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3).to(torch.float64))
    want[1].running_mean.normal_()
    for k, v in want.state_dict().items():
        assert torch.equal(a[k], v) and torch.equal(b[k], v), k
