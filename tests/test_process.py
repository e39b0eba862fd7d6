"""ddptrain/process.py: preemption signals become a flag, the paced garbage collector, the CPU
thread budget and the DataLoader workers' signal/GC set-up."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddptrain.config import ConfigError
from ddptrain.process import PreemptionFlag, StepPacedGC, budget_cpu_threads, check_host_memory, prepare_loader_workers
from ddptrain import process


def test_preemption_signal_sets_the_flag_and_restore_puts_the_old_handler_back():
    old = signal.getsignal(signal.SIGUSR1)
    flag = PreemptionFlag(["SIGUSR1"])
    flag.install()
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to the main thread before kill returns
        assert flag.requested and flag.received == [signal.SIGUSR1]
        flag.acknowledge()  # the loop saves and exits: the default action (end) is not repeated
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR1) is old
    with pytest.raises(ValueError, match="trainer.preempt_signals: unknown signal 'SIGNOPE'"):
        PreemptionFlag(["SIGNOPE"])


@pytest.fixture
def collections():
    seen: list[int] = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    was = gc.isenabled()
    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)
    gc.enable() if was else gc.disable()


def test_paced_gc_collects_young_objects_every_n_steps_and_everything_at_full(collections):
    pacer = StepPacedGC(3)
    gc.enable()
    pacer.start()
    assert not gc.isenabled() and collections == [2]  # one full collection, then automatic GC off
    collections.clear()
    for step in range(1, 8):
        pacer.step(step)
    assert collections == [1, 1]  # steps 3 and 6, young generations only
    pacer.full()
    assert collections == [1, 1, 2]
    pacer.stop()
    assert gc.isenabled()


def test_paced_gc_off_leaves_automatic_collection_alone(collections):
    pacer = StepPacedGC(0)
    gc.enable()
    pacer.start()
    for step in range(1, 10):
        pacer.step(step)
    pacer.full()
    assert gc.isenabled() and collections == []
    pacer.stop()
    assert gc.isenabled()
    with pytest.raises(ValueError, match="trainer.gc_every_steps must be >= 0"):
        StepPacedGC(-1)


class _Loader:
    num_workers = 1


def test_cpu_threads_are_the_process_share_of_cores_minus_its_workers(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr("ddptrain.process.usable_cpu_count", lambda: 8)
        budget_cpu_threads(_Loader())
        assert torch.get_num_threads() == 3  # 8 cores / 2 processes - 1 worker
        monkeypatch.setattr("ddptrain.process.usable_cpu_count", lambda: 2)
        budget_cpu_threads(_Loader())
        assert torch.get_num_threads() == 1  # never 0
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(5)
        budget_cpu_threads(_Loader())
        assert torch.get_num_threads() == 5  # an explicit OMP_NUM_THREADS is respected
    finally:
        torch.set_num_threads(before)


class _WorkerState(Dataset):
    """Each item reports the worker's SIGUSR1 handler, whether GC is on, and the user's init mark."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return (signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN, gc.isenabled(), os.environ.get("USER_INIT", ""))


def _user_init(worker_id):
    os.environ["USER_INIT"] = f"ran in worker {worker_id}"


@pytest.mark.timeout(60)
def test_loader_workers_ignore_preemption_signals_run_gc_and_keep_the_users_init():
    loader = DataLoader(_WorkerState(), batch_size=None, num_workers=1, worker_init_fn=_user_init)
    prepare_loader_workers(loader, ["SIGUSR1"])
    prepare_loader_workers(loader, ["SIGUSR1"])  # idempotent: not wrapped twice
    was = gc.isenabled()
    gc.disable()  # as inside fit(): the workers are forked from a process with automatic GC off
    try:
        got = list(loader)
    finally:
        gc.enable() if was else gc.disable()
    assert [tuple(x) for x in got] == [(True, True, "ran in worker 0")] * 2
    assert loader.worker_init_fn.inner is _user_init
    plain = DataLoader(_WorkerState(), batch_size=None, num_workers=0)
    prepare_loader_workers(plain, ["SIGUSR1"])
    assert plain.worker_init_fn is None  # no workers: nothing to prepare


# ----------------------------------------------------------------------------- host memory (optim.offload, lora.base_offload)


def _meminfo(tmp_path, gib):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       999999999 kB\nMemFree:          1000 kB\nMemAvailable:   {gib * 2**20} kB\n")
    return str(path)


def _cgroup_files(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root)


@pytest.mark.parametrize("files, available_gib", [
    ({}, 10),                                                           # no cgroup: MemAvailable
    ({"memory.max": "max\n", "memory.current": "0\n"}, 10),            # v2, no limit
    ({"memory.max": f"{8 * 2**30}\n", "memory.current": f"{3 * 2**30}\n",
      "memory.stat": f"anon 1\ninactive_file {2**30}\n"}, 6),         # v2: 8 - (3 - 1 reclaimable)
    ({"memory/memory.limit_in_bytes": f"{4 * 2**30}\n", "memory/memory.usage_in_bytes": f"{2**30}\n"}, 3),  # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, 10),   # v1, no limit
])
def test_check_host_memory_reads_meminfo_and_cgroup(tmp_path, files, available_gib):
    meminfo, root = _meminfo(tmp_path, 10), _cgroup_files(tmp_path / "cg", files)
    (tmp_path / "cg").mkdir(exist_ok=True)
    half = (available_gib - 1) / 2 * 2**30  # two ranks' shares + the 1 GiB reserve: exactly what is there
    proc = str(tmp_path / "proc")  # no /proc/self/cgroup: the usual mount places, at their top
    assert check_host_memory(half, 2, meminfo=meminfo, cgroup_root=root, proc_root=proc) == available_gib * 2**30
    with pytest.raises(ConfigError) as e:
        check_host_memory(half + 2**20, 2, meminfo=meminfo, cgroup_root=root, proc_root=proc)
    msg = str(e.value)
    assert "optim.offload=cpu" in msg and f"{available_gib:.1f} GiB is available" in msg and "2 rank(s)" in msg
    assert "more nodes" in msg  # what to change


def test_check_host_memory_without_anything_to_read(tmp_path):
    assert check_host_memory(1e15, 8, meminfo=str(tmp_path / "none"), cgroup_root=str(tmp_path)) is None
    with pytest.raises(ConfigError, match="lora.base_offload=cpu"):
        check_host_memory(2 * 2**30, 1, what="lora.base_offload=cpu", meminfo=_meminfo(tmp_path, 2),
                          cgroup_root=str(tmp_path))


# ----------------------------------------------------------------------------- the process's own cgroup (issue 49 item 5)

V1_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
             "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
             "35 31 0:32 {root} /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
             "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
V2_MOUNTS = "31 23 0:28 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
GIB = 2**30


@pytest.mark.parametrize("own, mounts, files, available", [
    # Slurm, cgroup v1: the job's limit two levels below the root (which has none), its page cache reclaimable
    ("4:memory:/slurm/uid_0/job_1\n2:cpu,cpuacct:/slurm/uid_0/job_1\n0::/\n", V1_MOUNTS.format(root="/"),
     {"memory/memory.limit_in_bytes": "9223372036854771712\n",
      "memory/slurm/uid_0/job_1/memory.limit_in_bytes": f"{4 * GIB}\n",
      "memory/slurm/uid_0/job_1/memory.usage_in_bytes": f"{2 * GIB}\n",
      "memory/slurm/uid_0/job_1/memory.stat": f"cache 5\ntotal_inactive_file {GIB}\n"}, 3 * GIB),
    # v1, a parent tighter than the job: the tightest counts (the user's whole allocation)
    ("4:memory:/slurm/uid_0/job_1/step_0\n", V1_MOUNTS.format(root="/"),
     {"memory/slurm/uid_0/memory.limit_in_bytes": f"{5 * GIB}\n",
      "memory/slurm/uid_0/memory.usage_in_bytes": f"{4 * GIB}\n",
      "memory/slurm/uid_0/job_1/memory.limit_in_bytes": f"{8 * GIB}\n",
      "memory/slurm/uid_0/job_1/memory.usage_in_bytes": f"{GIB}\n"}, GIB),
    # v1 in a container without its own cgroup namespace: the mount's top is the container's cgroup
    ("4:memory:/docker/abc\n", V1_MOUNTS.format(root="/docker/abc"),
     {"memory/memory.limit_in_bytes": f"{6 * GIB}\n", "memory/memory.usage_in_bytes": "0\n"}, 6 * GIB),
    # v2, nested: the own cgroup unlimited ("max"), its parent slice limited
    ("0::/system.slice/train.scope\n", V2_MOUNTS,
     {"system.slice/memory.max": f"{6 * GIB}\n", "system.slice/memory.current": f"{3 * GIB}\n",
      "system.slice/memory.stat": f"anon 1\ninactive_file {GIB}\n",
      "system.slice/train.scope/memory.max": "max\n", "system.slice/train.scope/memory.current": f"{GIB}\n"}, 4 * GIB),
    # v2: the own cgroup tighter than its parent
    ("0::/user.slice/job\n", V2_MOUNTS,
     {"user.slice/memory.max": f"{6 * GIB}\n", "user.slice/memory.current": "0\n",
      "user.slice/job/memory.max": f"{2 * GIB}\n", "user.slice/job/memory.current": "0\n"}, 2 * GIB),
    # over the limit already: nothing left, not a negative number
    ("0::/a\n", V2_MOUNTS, {"a/memory.max": f"{GIB}\n", "a/memory.current": f"{3 * GIB}\n"}, 0),
    # "max" / unlimited everywhere, files missing, garbage: no limit
    ("0::/a/b\n", V2_MOUNTS, {"a/memory.max": "max\n", "a/b/memory.max": "max\n"}, None),
    ("4:memory:/slurm/uid_0/job_1\n", V1_MOUNTS.format(root="/"), {}, None),
    ("4:memory:/slurm/uid_0/job_1\n", V1_MOUNTS.format(root="/"),
     {"memory/slurm/uid_0/job_1/memory.limit_in_bytes": "garbage\n"}, None),
    ("0::/gone\n", V2_MOUNTS, {"memory.max": f"{2 * GIB}\n"}, 2 * GIB),  # the own folder missing: its parents
])
def test_the_memory_limit_is_the_tightest_of_the_own_cgroup_and_its_parents(tmp_path, own, mounts, files, available):
    root = _cgroup_files(tmp_path / "cg", files)
    (tmp_path / "cg").mkdir(exist_ok=True)
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(own)
    (proc / "mountinfo").write_text(mounts)
    assert process.cgroup_memory_available(root, str(tmp_path / "proc")) == available
    # and the host-memory check of optim.offload / a host EMA compares against it
    meminfo = _meminfo(tmp_path, 100)
    expected = 100 * GIB if available is None else min(available, 100 * GIB)
    assert process.available_host_memory(meminfo, root, str(tmp_path / "proc")) == expected


def test_cgroup_files_that_cannot_be_read_mean_no_limit(tmp_path):
    """No /proc/self/cgroup, no mountinfo, no cgroup tree: no limit, no error."""
    assert process.cgroup_memory_available(str(tmp_path / "none"), str(tmp_path / "none")) is None
    assert process.own_cgroups(str(tmp_path)) == {}


def test_the_cpu_quota_of_a_nested_v1_cgroup_caps_the_threads(tmp_path):
    root = _cgroup_files(tmp_path / "cg", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/slurm/uid_0/job_1/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/slurm/uid_0/job_1/cpu.cfs_period_us": "100000\n"})
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:memory:/slurm/uid_0/job_1\n2:cpu,cpuacct:/slurm/uid_0/job_1\n")
    (proc / "mountinfo").write_text(V1_MOUNTS.format(root="/"))
    assert process.cgroup_cpu_quota(root, str(tmp_path / "proc")) == 3.0


# ----------------------------------------------------------------------------- the host's signal handlers (issue 49 item 13)


class _Recorder:
    """A host program's own signal handler: records what reaches it."""

    def __init__(self):
        self.got: list[int] = []

    def __call__(self, signum, frame):
        self.got.append(signum)


def _signalling_trainer(tmp_path, at_step: int, in_eval: bool):
    """A tiny Trainer over 4 steps that sends itself SIGUSR1 during step ``at_step``'s loss (or
    during the final evaluation), with SIGUSR1 as its preemption signal."""
    import ddptrain
    from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches

    calls = {"train": 0}

    def loss(model, batch):
        if model.training:
            calls["train"] += 1
            if not in_eval and calls["train"] == at_step:
                os.kill(os.getpid(), signal.SIGUSR1)
        elif in_eval:
            os.kill(os.getpid(), signal.SIGUSR1)
        return frame_loss(model, batch)

    torch.manual_seed(0)
    data = [mb[0] for mb in micro_batches(4)]
    cfg = make_cfg(tmp_path, "trainer.max_steps=4", "trainer.preempt_signals=[SIGUSR1]", "checkpoint.save_at_end=false")
    return ddptrain.Trainer(FrameMLP(), loss, cfg, data, eval_data=data[:1])


@pytest.mark.timeout(120)
def test_fit_gives_the_host_its_handlers_back_with_the_signals_it_kept(tmp_path):
    """A signal the loop could no longer act on (it came during the final evaluation) was lost:
    the host's handler never saw it, and a default SIGTERM that should end the process did
    not. A signal the loop acted on (save, SystemExit) now also reaches the host's own handler,
    so a program (pytest) that ends on SIGTERM still ends. Handlers are back after every fit."""
    host = _Recorder()
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    old = signal.signal(signal.SIGUSR1, host)
    try:
        with _signalling_trainer(tmp_path / "late", 0, in_eval=True) as trainer:
            trainer.fit()  # the loop is over: nothing to save, the signal goes to the host
        assert host.got == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) is host
        with _signalling_trainer(tmp_path / "mid", 2, in_eval=False) as trainer:
            with pytest.raises(SystemExit):
                trainer.fit()
            assert trainer.step == 2  # it saved at step 2 and exited, as a preemption does
        assert host.got == [signal.SIGUSR1] * 2 and signal.getsignal(signal.SIGUSR1) is host
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        signal.signal(signal.SIGUSR1, old)


def _restore_in_a_child(mode: str) -> int:
    """Fork; the child installs a flag, gets SIGUSR1, restores and exits 0 if still alive."""
    pid = os.fork()
    if pid == 0:  # the child: only os._exit leaves it (no pytest teardown in a fork)
        try:
            if mode == "ignored":
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            else:
                signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            kept = signal.getsignal(signal.SIGUSR1)
            flag = PreemptionFlag(["SIGUSR1"])
            flag.install()
            flag.install()  # a second install keeps the first's saved handler
            os.kill(os.getpid(), signal.SIGUSR1)
            if mode == "acknowledged":
                flag.acknowledge()
            flag.restore()
            os._exit(0 if signal.getsignal(signal.SIGUSR1) == kept else 3)
        finally:
            os._exit(4)
    return os.waitpid(pid, 0)[1]


def test_restore_ends_on_a_default_signal_it_did_not_act_on_and_keeps_an_ignored_one():
    """The default action of SIGUSR1 ends the process: a flag whose signal was not acted on
    delivers it at restore(); an acknowledged one, or an ignored signal, does not."""
    assert os.WIFSIGNALED(status := _restore_in_a_child("default")) and os.WTERMSIG(status) == signal.SIGUSR1
    assert os.waitstatus_to_exitcode(_restore_in_a_child("acknowledged")) == 0
    assert os.waitstatus_to_exitcode(_restore_in_a_child("ignored")) == 0


_SESSION = '''
import os, signal
import torch
import ddptrain
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches

def test_a_trainer_gets_sigterm_mid_fit():
    steps = []
    def loss(model, batch):
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return frame_loss(model, batch)
    cfg = make_cfg(os.path.abspath("run"), "trainer.max_steps=4", "checkpoint.save_at_end=false")
    ddptrain.Trainer(FrameMLP(), loss, cfg, [mb[0] for mb in micro_batches(4)]).fit()

def test_b_runs_only_if_the_run_went_on():
    open("went_on", "w").close()
'''


@pytest.mark.timeout(120)
def test_sigterm_ends_the_test_run_also_while_a_trainer_fits(tmp_path):
    """The suite absorbed SIGTERM (``timeout`` did not stop it): a Trainer in a test took it as a
    preemption, exited that test with SystemExit, and pytest went on. tests/conftest.py's handler
    gets it back from the Trainer and ends the run, with the Trainer's save done."""
    import subprocess
    import sys

    (tmp_path / "test_session.py").write_text(_SESSION)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          "test_session.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    out = run.stdout + run.stderr
    assert run.returncode == 128 + signal.SIGTERM, out
    assert "stopped by signal SIGTERM" in out, out
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir(), out  # the Trainer saved first
    assert not (tmp_path / "went_on").exists(), out


class _Frames(Dataset):
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


@pytest.mark.timeout(120)
def test_a_fit_with_loader_workers_leaves_no_sigchld_handler_and_no_worker(tmp_path, monkeypatch):
    """torch's DataLoader takes SIGCHLD over when its first worker starts and never gives it back:
    after fit() the host's handler is back (and torch's flag reset, so a later loader of the host
    installs its own again), and no worker outlives the run."""
    import multiprocessing

    import ddptrain
    from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches
    from torch.utils.data._utils import signal_handling

    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)
    before = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        loader = DataLoader(_Frames([mb[0] for mb in micro_batches(3)]), batch_size=None, num_workers=1)
        cfg = make_cfg(tmp_path, "trainer.max_steps=3", "checkpoint.save_at_end=false")
        with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, loader) as trainer:
            trainer.fit()
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
        assert not signal_handling._SIGCHLD_handler_set
        assert not [p for p in multiprocessing.active_children() if p.daemon], "a loader worker outlived fit()"
    finally:
        signal.signal(signal.SIGCHLD, before)
