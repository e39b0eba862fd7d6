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
        assert flag.requested
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
