"""The CPU thread budget counts the cores of the process's affinity, not the machine's (ddptrain/process.py)."""

from __future__ import annotations

import os

import pytest
import torch

from ddptrain import process


class _Loader:
    num_workers = 1


@pytest.fixture
def threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine; an affinity below is what counts
    yield
    torch.set_num_threads(before)


def test_the_budget_is_the_affinity_share(threads, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    process.budget_cpu_threads(_Loader())
    assert torch.get_num_threads() == 3  # 8 allowed cores / 2 processes - 1 worker, not 64 / 2 - 1


def test_without_sched_getaffinity_every_core_counts(threads, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    process.budget_cpu_threads(_Loader())
    assert torch.get_num_threads() == 31
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # undeterminable
    assert process.usable_cpu_count() == 1
