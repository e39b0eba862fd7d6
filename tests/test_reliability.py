"""Faults provoked for real: preemption, crashes (also mid-save), a raising rank, multi-node.

Each case launches ``torchrun`` on tests/jobs/fault_job.py (2 CPU processes, gloo) as a
subprocess with a hard timeout, then compares the final parameters with an uninterrupted run:
deterministic CPU fp32 training must come out bit-identical after any recovery.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from _dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "fault_job.py")


def torchrun(out_dir, fault="none", *overrides, restarts=0, nnodes=1, nproc=2, timeout=120, extra=()):
    if nnodes == 1:
        launch = ["--standalone", f"--nproc_per_node={nproc}"]
    else:
        launch = list(extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, f"--max-restarts={restarts}",
           JOB, str(out_dir), fault, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_tree(pid):
    """SIGKILL ``pid`` and all its descendants (torchrun starts each rank in a session of its
    own, so a process-group kill misses them, and they hold the output pipe open)."""
    children = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def finish(proc, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"job hung (> {timeout}s):\n{out[-3000:]}")
    return proc.returncode, out


def final_params(out_dir):
    return torch.load(os.path.join(out_dir, "final.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    rc, log = finish(torchrun(out))
    assert rc == 0, log[-3000:]
    return final_params(out)


def assert_same(params, reference):
    for k, v in reference.items():
        assert torch.equal(params[k], v), f"{k} differs from the uninterrupted run"


@pytest.mark.timeout(300)
def test_sigterm_on_one_rank_saves_exits_and_resumes_exactly(tmp_path, reference):
    rc, log = finish(torchrun(tmp_path, "sigterm:1:5"))
    assert rc == 0, log[-3000:]  # trainer.preempt_exit_code
    assert "preemption signal: saving at step 5" in log
    assert (tmp_path / "checkpoints" / "step_00000005" / "COMPLETE").exists()
    assert not (tmp_path / "final.pt").exists()
    rc, log = finish(torchrun(tmp_path))  # the restart: resume=auto
    assert rc == 0, log[-3000:]
    assert "resumed from" in log and "step 5" in log
    assert_same(final_params(tmp_path), reference)


@pytest.mark.timeout(300)
def test_sigkill_restarts_by_itself_and_matches(tmp_path, reference):
    rc, log = finish(torchrun(tmp_path, "sigkill:1:5", restarts=3))
    assert rc == 0, log[-3000:]
    assert "resumed from" in log and "step_00000004" in log
    assert_same(final_params(tmp_path), reference)


@pytest.mark.timeout(300)
def test_kill_during_checkpoint_write_never_loads_half_checkpoint(tmp_path, reference):
    rc, log = finish(torchrun(tmp_path, "killsave:0:6", restarts=3))
    assert rc == 0, log[-3000:]
    assert "step_00000004" in log.split("resumed from", 1)[1].splitlines()[0]  # not the torn step 6
    assert_same(final_params(tmp_path), reference)


@pytest.mark.timeout(120)
def test_exception_on_one_rank_ends_the_job_promptly(tmp_path):
    start = time.monotonic()
    rc, log = finish(torchrun(tmp_path, "raise:1:5", "dist.timeout_s=600"), timeout=100)
    elapsed = time.monotonic() - start
    assert rc != 0
    assert "rank 1, step 5" in log and "injected failure" in log and "utterances: utt" in log
    assert elapsed < 60, f"took {elapsed:.0f}s: the healthy rank waited in a collective"


@pytest.mark.timeout(120)
def test_data_error_in_a_worker_ends_the_job_promptly(tmp_path):
    """A corrupt item raised in a DataLoader worker ends every process: the failing one must not
    hang at exit on its workers (they ignore SIGTERM, which multiprocessing uses at exit)."""
    start = time.monotonic()
    rc, log = finish(torchrun(tmp_path, "baddata:1:3", "dist.timeout_s=600"), timeout=100)
    elapsed = time.monotonic() - start
    assert rc != 0
    assert "injected corrupt item" in log
    assert elapsed < 60, f"took {elapsed:.0f}s: a process hung after the error"


@pytest.mark.timeout(300)
def test_two_nodes_on_localhost_train_and_resume(tmp_path, reference):
    """2 nodes x 1 process through c10d rendezvous; preempted, then resumed on 2 nodes again."""
    logs = []
    for fault in ("sigterm:0:7", "none"):
        port = free_port()
        rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=ddptrain-test"]
        nodes = [torchrun(tmp_path, fault, nnodes=2, extra=rdzv) for _ in range(2)]
        results = [finish(p) for p in nodes]
        for rc, log in results:
            assert rc == 0, log[-3000:]
        logs.append("".join(log for _, log in results))
    assert "preemption signal: saving at step 7" in logs[0]
    assert "resumed from" in logs[1] and "step_00000007" in logs[1]
    assert_same(final_params(tmp_path), reference)
