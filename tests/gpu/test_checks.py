"""The on-GPU checks of bench/check_*.py, each run as its own process and held to its verdict.

The bounds are the ones the scripts' GPU runs gave (bench/NOTES.md, the call named beside each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def _script(name: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(BENCH), BENCH, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.join(BENCH, name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


@pytest.mark.timeout(900)
def test_cuda_graphs_replay_the_eager_losses(tmp_path):
    """bench/NOTES.md call s13a: 24 x 256, bitwise equal losses; the graphs faster than eager."""
    out = tmp_path / "cg.jsonl"
    _script("check_cuda_graphs.py", "--steps", "30", "--out", str(out))
    eager, graphs, again = _rows(out)
    assert graphs["peer"] == "cuda_graphs" and graphs["cuda_graphs"] == 3  # one graph per batch shape
    spread = again["loss_max_rel_diff_vs_eager"]  # eager's own run-to-run difference on this GPU
    assert graphs["loss_max_rel_diff_vs_eager"] <= max(spread, 1e-6) * 2
    assert graphs["step_ms_median"] < eager["step_ms_median"]


@pytest.mark.timeout(900)
def test_activation_offload_keeps_the_losses_and_lowers_the_peak(tmp_path):
    """The script exits 1 when a variant's losses leave twice the plain runs' own spread, or
    recompute + offload saves less than half of what it moves (bench/NOTES.md item 61)."""
    _script("check_activation_offload.py", "--layers", "8", "--d", "1024", "--heads", "8", "--seq", "2048")


@pytest.mark.timeout(900)
def test_offload_update_matches_the_on_device_update(tmp_path):
    """bench/NOTES.md item 52: losses within bf16 rounding of the on-device fused AdamW (6.1e-5
    over 20 steps; the script itself exits 1 at 2e-2)."""
    out = tmp_path / "off.jsonl"
    _script("check_offload.py", "--params", "2e8", "--out", str(out))
    (equivalence,) = [r for r in _rows(out) if r["workload"] == "offload_equivalence"]
    assert equivalence["max_rel_loss_diff"] <= 1e-3, equivalence


@pytest.mark.timeout(900)
def test_sharded_grads_hold_less_than_ddp(tmp_path):
    """Rank 0 of N (torch's fake process group): sharded gradients hold fewer bytes per parameter
    at rest than DDP + sharded masters, and fewer the more ranks share them."""
    out = tmp_path / "sg.jsonl"
    _script("check_sharded_grads.py", "--d", "1024", "--layers", "8", "--worlds", "2", "4", "--out", str(out))
    rows = {(r["world_size"], r["shard_grads"]): r for r in _rows(out)}
    for world in (2, 4):
        assert rows[world, True]["rest_bytes_per_param"] < rows[world, False]["rest_bytes_per_param"], rows
    assert rows[4, True]["rest_bytes_per_param"] < rows[2, True]["rest_bytes_per_param"], rows


@pytest.mark.timeout(1200)
def test_streamed_base_losses_equal_the_resident_base(tmp_path):
    """A 9B decoder's LoRA run with its base streamed from host memory: the first step's loss is
    the resident base's bit for bit (bench/NOTES.md, the H200 call of 2026-12-02)."""
    out = tmp_path / "sb.jsonl"
    _script("check_streamed_base.py", "--steps", "2", "--out", str(out), "--tmp", str(tmp_path / "runs"), timeout=1100)
    rows = _rows(out)
    assert rows and not any("error" in r for r in rows), rows
    assert all(r.get("loss_first_step_equal", True) for r in rows), rows
