"""Faults provoked for real: preemption, crashes (also mid-save), a raising rank, multi-node.

Each case launches ``torchrun`` on tests/jobs/fault_job.py (2 CPU processes, gloo) as a
subprocess with a hard timeout, then compares the parameters with an uninterrupted run:
deterministic CPU fp32 training must come out bit-identical after any recovery.

A launch costs 10-15 s on 2 CPU cores, most of it interpreter start-up and shut-down (the
training is ~2 s), so the recoveries that each needed a launch of their own only to finish the
run (preemption on one node, preemption on two nodes, a kill during a save) are chained in one
run folder: each fault's launch is the previous fault's restart, each stage's checks name its
fault, and a checkpoint of the chain is compared with the uninterrupted run's at the same step
before the final parameters are.
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


def torchrun(out_dir, fault="none", *overrides, restarts=0, nnodes=1, nproc=2, extra=(), stdout=subprocess.PIPE):
    if nnodes == 1:
        launch = ["--standalone", f"--nproc_per_node={nproc}"]
    else:
        launch = list(extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, f"--max-restarts={restarts}",
           JOB, str(out_dir), fault, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True)


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


class Background:
    """A torchrun launch started now, its output to a file (a pipe nobody reads could fill up);
    ``result()`` waits for it."""

    def __init__(self, out_dir, fault="none", *overrides, **launch):
        self.out, self.log = out_dir, open(f"{out_dir}.log", "w+")
        self.proc = torchrun(out_dir, fault, *overrides, stdout=self.log, **launch)
        self._result = None

    def result(self, timeout=120):
        if self._result is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)
                self.proc.wait()
                self.log.seek(0)
                pytest.fail(f"job hung (> {timeout}s):\n{self.log.read()[-3000:]}")
            self.log.seek(0)
            self._result = self.proc.returncode, self.log.read()
        return self._result

    def close(self):
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The launches that need nothing from another test, started together when the first test
    asks: the uninterrupted run (every checkpoint kept: the chain compares with them) and the
    SIGKILL case. They overlap the chained test's launches, which leave a core idle much of the
    time (agents polling, exit barriers, a crashed peer noticed only when its orphaned DataLoader
    worker exits); their own tests wait for them."""
    runs = {"reference": Background(tmp_path_factory.mktemp("reference"), "none", "checkpoint.keep_last=0"),
            "sigkill": Background(tmp_path_factory.mktemp("sigkill"), "sigkill:1:5", restarts=3)}
    yield runs
    for run in runs.values():
        run.close()


@pytest.fixture(scope="module")
def reference(launched):
    """The uninterrupted run's folder, as a function: calling it waits for the run."""
    def folder():
        rc, log = launched["reference"].result()
        assert rc == 0, log[-3000:]
        return launched["reference"].out
    return folder


def assert_same(params, reference):
    for k, v in final_params(reference()).items():
        assert torch.equal(params[k], v), f"{k} differs from the uninterrupted run"


def assert_same_checkpoint(out_dir, reference, step, after):
    from safetensors.torch import load_file

    name = os.path.join("checkpoints", f"step_{step:08d}", "model.safetensors")
    ours, ref = load_file(os.path.join(out_dir, name)), load_file(os.path.join(reference(), name))
    assert ours.keys() == ref.keys()
    for k in ref:
        assert torch.equal(ours[k], ref[k]), f"step {step} after {after}: {k} differs from the uninterrupted run"


def two_nodes(out_dir, fault):
    """2 nodes x 1 process on localhost, through c10d rendezvous: [(rc, log)] of both."""
    port = free_port()
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=ddptrain-test"]
    nodes = [torchrun(out_dir, fault, nnodes=2, extra=rdzv) for _ in range(2)]
    return [finish(p) for p in nodes]


def resumed_lines(log):
    return [line for line in log.splitlines() if "resumed from" in line]


@pytest.mark.timeout(400)
def test_preemption_on_one_and_two_nodes_then_a_kill_mid_save_resume_exactly(tmp_path, reference):
    """One run, three faults, each recovered by the next launch:

    1. SIGTERM on rank 1 of a 1-node job before step 5: it saves step 5, exits 0, writes no final.
    2. The restart, on 2 nodes x 1 process (c10d rendezvous), resumes at step 5; SIGTERM on rank
       0 before step 7: both nodes save step 7 and exit 0. Its step 6 equals the uninterrupted one.
    3. The restart, on 1 node, resumes the 2-node checkpoint at step 7; rank 0 is SIGKILLed in the
       middle of writing step 8; torchrun restarts it, and it resumes at the complete step 7, never
       the torn step 8. The final parameters equal the uninterrupted run's.
    """
    rc, log = finish(torchrun(tmp_path, "sigterm:1:5"))
    assert rc == 0, log[-3000:]  # trainer.preempt_exit_code
    assert "preemption signal: saving at step 5" in log
    assert (tmp_path / "checkpoints" / "step_00000005" / "COMPLETE").exists()
    assert not (tmp_path / "final.pt").exists()

    os.remove(tmp_path / "fault-fired-sigterm")  # the job fires each kind once per folder: re-arm it
    results = two_nodes(tmp_path, "sigterm:0:7")
    for rc, log in results:
        assert rc == 0, log[-3000:]
    log = "".join(log for _, log in results)
    resumed = resumed_lines(log)
    assert len(resumed) == 1 and "step_00000005" in resumed[0], log[-3000:]  # printed by rank 0 only
    assert "preemption signal: saving at step 7" in log
    assert not (tmp_path / "final.pt").exists()
    assert_same_checkpoint(tmp_path, reference, 6, "the 1-node preemption at step 5")

    rc, log = finish(torchrun(tmp_path, "killsave:0:8", restarts=3))
    assert rc == 0, log[-3000:]
    resumed = resumed_lines(log)  # at the launch, then after torchrun's restart
    assert len(resumed) == 2, log[-3000:]
    assert "step_00000007" in resumed[0], resumed  # the 2-node preemption's checkpoint, on 1 node
    assert "step_00000007" in resumed[1], resumed  # not the torn step 8
    assert_same(final_params(tmp_path), reference)


@pytest.mark.timeout(300)
def test_sigkill_restarts_by_itself_and_matches(launched, reference):
    run = launched["sigkill"]  # torchrun ... sigkill:1:5 --max-restarts=3, started by the fixture
    rc, log = run.result()
    assert rc == 0, log[-3000:]
    resumed = resumed_lines(log)  # (not just "step_00000004" anywhere: the first attempt logs saving it)
    assert len(resumed) == 1 and "step_00000004" in resumed[0], log[-3000:]
    assert_same(final_params(run.out), reference)


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
