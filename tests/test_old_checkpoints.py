"""Checkpoints written by ddptrain before the optimizer backends (ddptrain/update/) still resume.

tests/data/old_checkpoints/ holds step-3 folders of six set-ups (fp32; bf16 masters, with and
without an EMA; optimizer offload; ZeRO with an EMA and sharded masters on 2 gloo ranks), written
by the code at 7a106d0 with tests/data/old_checkpoints/make.py, and the losses that code logged
for steps 4-6 of the uninterrupted run. Each is resumed here by today's code, which must land on
those losses: the checkpoint formats (weights file, optimizer, sharded states, EMA) did not change.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "old_checkpoints")
sys.path.insert(0, HERE)

with open(os.path.join(HERE, "expected.json")) as f:
    EXPECTED = json.load(f)


def _resume_worker(rank, world, out, name, extra, folder):
    import make

    losses = make.run(rank, world, out, name, tuple(extra), resume=folder)
    if rank == 0:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(losses, f)


def _resumed(tmp_path, name):
    setup = EXPECTED["setups"][name]
    folder = tmp_path / "saved" / name
    shutil.copytree(os.path.join(HERE, name), folder)  # a resume reads only, but the fixture stays pristine
    if setup["ranks"] == 1:
        import make

        return make.run(0, 1, str(tmp_path), name, tuple(setup["overrides"]), resume=str(folder))
    from _dist import run_ranks

    run_ranks(_resume_worker, setup["ranks"], str(tmp_path), name, setup["overrides"], str(folder), timeout=150)
    with open(tmp_path / f"{name}.json") as f:
        return json.load(f)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(EXPECTED["setups"]))
def test_a_checkpoint_of_the_old_code_resumes_to_the_old_codes_losses(tmp_path, name, one_thread_frozen_heap):
    losses = _resumed(tmp_path, name)
    # rel 1e-6: bitwise on the machine that wrote them; another CPU's vector paths may round differently
    assert losses == pytest.approx(EXPECTED["setups"][name]["losses_after"], rel=1e-6, abs=0), name
