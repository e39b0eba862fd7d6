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
    monkeypatch.setattr(process, "cgroup_cpu_quota", lambda *a, **k: None)  # not the test machine's own quota
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


def _cgroup(root, files: dict) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


@pytest.mark.parametrize("files, cores", [
    ({"cpu.max": "250000 100000\n"}, 3),                             # v2, docker --cpus=2.5
    ({"cpu.max": "max 100000\n"}, 8),                                # v2, no limit
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 8),      # v1, no limit
    ({"cpu.max": "50000 100000\n"}, 1),                              # half a core still gets one thread
    ({"cpu.max": "garbage\n"}, 8),                                   # unreadable: the affinity only
    ({}, 8),                                                         # no cgroup files at all
])
def test_a_cgroup_cpu_quota_caps_the_affinity(tmp_path, monkeypatch, files, cores):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    # no /proc/self/cgroup (a fake /proc): the usual mount places, at their top
    assert process.usable_cpu_count(_cgroup(tmp_path, files), str(tmp_path / "proc")) == cores


def test_the_quota_caps_the_thread_budget(threads, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(process, "cgroup_cpu_quota", lambda *a, **k: 4.0)  # docker --cpus=4
    process.budget_cpu_threads(_Loader())
    assert torch.get_num_threads() == 1  # 4 CPUs of quota / 2 processes - 1 worker, not 8 / 2 - 1
