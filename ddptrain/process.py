"""Process-level concerns of a training process: preemption signals, the CPU thread budget, the
host memory offload and a host EMA may take, and when Python's garbage collector runs.

Kept out of the Trainer so the loop reads as training only. Everything here is per process; the
collective agreement on a preemption (all ranks stop at the same step) happens in the Trainer's
per-step all-reduce.
"""

from __future__ import annotations

import atexit
import gc
import math
import multiprocessing
import os
import signal
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed

from ddptrain.config import ConfigError


class PreemptionFlag:
    """Turns preemption signals (SIGTERM, SIGUSR1, ...) into a flag the training loop polls.

    The handler only sets a flag: saving from inside a signal handler could interrupt a
    collective half-way. ``install()`` before the training loop, ``restore()`` after it puts the
    previous handlers back and hands them the signals that arrived meanwhile, so the host
    program is as it was: a signal the loop acted on (``acknowledge()``: it saved and exits) is
    not repeated to a default or ignoring handler, every other one is delivered (a SIGTERM that
    came during the last evaluation still ends the process; a host's own handler sees every one).

    Args:
        names: signal names, e.g. ``["SIGTERM", "SIGUSR1"]``.

    Raises:
        ValueError: an unknown signal name.
    """

    def __init__(self, names: list[str]):
        self.signals = []
        for name in names:
            sig = getattr(signal, name, None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"trainer.preempt_signals: unknown signal {name!r}")
            self.signals.append(sig)
        self.requested = False
        self.received: list[int] = []  # in arrival order, each signal once
        self._acknowledged = False
        self._old: dict = {}
        self._installed = False
        self._sigchld: Any = None  # torch's DataLoader takes SIGCHLD over: given back too

    def _handler(self, signum, frame) -> None:
        self.requested = True
        if signum not in self.received:
            self.received.append(signum)

    def install(self) -> None:
        """Take over the signals (main thread only; a second call keeps the first's saved handlers)."""
        if threading.current_thread() is threading.main_thread() and not self._installed:
            self._installed = True
            self._sigchld = signal.getsignal(signal.SIGCHLD) if hasattr(signal, "SIGCHLD") else None
            self._old = {sig: signal.signal(sig, self._handler) for sig in self.signals}

    def acknowledge(self) -> None:
        """The loop acts on the request (saves and exits): the default action is not repeated."""
        self._acknowledged = True

    def restore(self) -> None:
        """Put the previous handlers back, then deliver to them the signals that arrived."""
        if not self._installed:
            return
        old, self._old, self._installed = self._old, {}, False
        for sig, handler in old.items():
            signal.signal(sig, handler)
        _give_back_sigchld(self._sigchld)
        received, self.received = self.received, []
        for sig in received:
            handler = old.get(sig)
            if callable(handler) or (handler == signal.SIG_DFL and not self._acknowledged):
                signal.raise_signal(sig)  # runs the handler now (or ends the process: its default)


def _give_back_sigchld(before: Any) -> None:
    """Put back the SIGCHLD handler that torch's DataLoader installed during ``fit()``.

    torch installs it (to report a dead worker at once) when a loader first starts workers, and
    never removes it; its flag is reset too, so a later loader of the host installs it again.
    """
    from torch.utils.data._utils import signal_handling  # private: checked, else left alone

    if before is None or not getattr(signal_handling, "_SIGCHLD_handler_set", False):
        return
    if signal.getsignal(signal.SIGCHLD) != before:
        signal.signal(signal.SIGCHLD, before)
        signal_handling._SIGCHLD_handler_set = False


def budget_cpu_threads(loader: Any) -> None:
    """On CPU, give each training process its share of the cores, minus its DataLoader workers.

    OpenMP threads that compete for a busy core spin at every parallel region: on a 2-core
    machine with one DataLoader worker, 2 intra-op threads made the demo's Conformer step 15x
    slower than 1 thread. An explicit ``OMP_NUM_THREADS`` (torchrun sets 1) is respected.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = getattr(loader, "num_workers", 0) or 0
    torch.set_num_threads(max(1, usable_cpu_count() // local - workers))


def usable_cpu_count(cgroup_root: str = "/sys/fs/cgroup", proc_root: str = "/proc") -> int:
    """The cores this process may use: its CPU affinity (taskset, a container's or SLURM's
    cpuset), else every core of the machine (``os.cpu_count()``, which ignores the affinity);
    at most its cgroup's CPU quota rounded up (``docker --cpus``, a Kubernetes CPU limit), which
    throttles a process that runs more threads than the quota instead of hiding the cores."""
    try:
        cores = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity on macOS and Windows
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_root)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


CGROUP_ROOT = "/sys/fs/cgroup"  # where cgroup hierarchies are mounted; tests pass a fake tree's root


def own_cgroups(proc_root: str = "/proc") -> dict[str, str]:
    """This process's cgroup paths from ``/proc/self/cgroup``: v1 lines
    (``4:memory:/slurm/uid_0/job_1``) give one entry per controller (``"cpu,cpuacct"`` two), the
    v2 line (``0::/user.slice/...``) the key ``""``; {} when unreadable."""
    paths: dict[str, str] = {}
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    for controller in parts[1].split(",") if parts[1] else [""]:
                        paths[controller] = parts[2]
    except OSError:
        pass
    return paths


def _cgroup_mount(controller: str, proc_root: str, cgroup_root: str) -> tuple[str, str]:
    """``(folder, root)`` of the hierarchy that holds ``controller`` (``""``: cgroup v2): where it
    is mounted (re-rooted under ``cgroup_root``) and which cgroup the mount shows at its top (a
    container without its own cgroup namespace sees its own cgroup there); from
    ``/proc/self/mountinfo``, else the usual place (``cgroup_root/memory``, ``cgroup_root``)."""
    try:
        with open(os.path.join(proc_root, "self", "mountinfo")) as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields, kind = left.split(), right.split()
                if not sep or len(fields) < 5 or len(kind) < 3:
                    continue
                if (kind[0] == "cgroup2" and not controller) or (
                        kind[0] == "cgroup" and controller and controller in kind[2].split(",")):
                    mount = fields[4].replace("\\040", " ")
                    rel = os.path.relpath(mount, CGROUP_ROOT)
                    folder = mount if rel.startswith("..") else os.path.normpath(os.path.join(cgroup_root, rel))
                    return folder, fields[3]
    except OSError:
        pass
    return (os.path.join(cgroup_root, controller) if controller else cgroup_root), "/"


def cgroup_folders(controller: str, proc_root: str = "/proc", cgroup_root: str = CGROUP_ROOT) -> list[str]:
    """The folders of this process's cgroup for ``controller`` (``""``: the v2 hierarchy) and of
    each of its parents up to the top of the mount, deepest first: a limit of any of them applies
    (Slurm's v1 ``memory:/slurm/uid_0/job_1`` limits the job two levels below the root). Folders
    that do not exist are listed too: reading their files fails, and the caller skips them."""
    folder, mount_root = _cgroup_mount(controller, proc_root, cgroup_root)
    own = own_cgroups(proc_root).get(controller, "")
    inside = own == mount_root or own.startswith(mount_root.rstrip("/") + "/")  # the mount's top is mount_root
    rel = os.path.relpath(own, mount_root) if inside else own
    parts = [p for p in rel.split("/") if p and p != "." and p != ".."]
    return list(dict.fromkeys(os.path.join(folder, *parts[:k]) for k in range(len(parts), -1, -1)))


def cgroup_cpu_quota(root: str = CGROUP_ROOT, proc_root: str = "/proc") -> Optional[float]:
    """CPUs' worth of time per period the process's cgroup may use, or None (no limit, or no
    cgroup file readable): the tightest over its own cgroup and its parents
    (:func:`cgroup_folders`). cgroup v2: ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"); v1:
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (-1 = no limit)."""
    found = []
    for folder in cgroup_folders("", proc_root, root):
        try:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            if quota != "max":
                found.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    for folder in cgroup_folders("cpu", proc_root, root):
        quota, period = _read_int(os.path.join(folder, "cpu.cfs_quota_us")), \
            _read_int(os.path.join(folder, "cpu.cfs_period_us"))
        if quota is not None and period and quota > 0 and period > 0:
            found.append(quota / period)
    return min(found) if found else None


def prepare_loader_workers(loader: Any, names: list[str]) -> None:
    """Make DataLoader workers ignore the preemption signals and keep Python's automatic GC.

    Signals: a cluster often signals the whole process group. A worker killed by SIGTERM makes
    the main process's next ``next(loader)`` raise, which would turn an orderly preemption save
    into a crash; the main process alone decides when to stop, and shuts its workers down itself.

    GC: workers are forked while ``fit()`` has the automatic collector off (``StepPacedGC``) and
    would inherit that; nothing paces their collections, so their reference cycles would pile up
    for the whole epoch. Each worker turns it back on.

    Exit: workers that ignore SIGTERM cannot be ended by multiprocessing at interpreter exit; an
    exit hook kills any still alive (see :func:`_kill_workers_at_exit`).
    """
    if not hasattr(loader, "worker_init_fn") or getattr(loader, "num_workers", 0) == 0:
        return
    if not isinstance(loader.worker_init_fn, _WorkerInit):
        loader.worker_init_fn = _WorkerInit(names, loader.worker_init_fn)
    if names:
        _kill_workers_at_exit()


_exit_hook_registered = False


def _kill_workers_at_exit() -> None:
    """Register (once) an exit hook that kills DataLoader workers still alive when Python exits.

    Why: at exit, multiprocessing ends its daemonic children with SIGTERM and then waits for
    them, and ours ignore SIGTERM. Normally none is left by then (freeing the DataLoader iterator
    shuts its workers down), but an exception that leaves ``fit()`` keeps the iterator alive in
    its traceback until after the exit hooks: the process printed its error and then waited
    forever (a corrupt audio file met by a worker). Exit hooks run last-registered first, so
    this one runs before multiprocessing's.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_kill_loader_workers)
        _exit_hook_registered = True


def _kill_loader_workers() -> None:
    """Kill the daemonic children that ignore SIGTERM: the ones multiprocessing could not end."""
    stuck = [p for p in multiprocessing.active_children() if p.daemon and _ignores_sigterm(p.pid)]
    if stuck:
        # DataLoader's SIGCHLD handler would report each killed worker as a crash of its own
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for p in stuck:
            p.kill()


def _ignores_sigterm(pid: int) -> bool:
    """From /proc (Linux); elsewhere False, and such a process may still hang at exit."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class _WorkerInit:
    """Picklable worker_init_fn: ignore ``names``, enable GC, then call the user's own init."""

    def __init__(self, names: list[str], inner: Optional[Callable]):
        self.names, self.inner = list(names), inner

    def __call__(self, worker_id: int) -> None:
        for name in self.names:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        gc.enable()
        if self.inner is not None:
            self.inner(worker_id)


class StepPacedGC:
    """Runs Python's cyclic garbage collector at the same optimizer steps on every rank.

    Why: CPython's automatic collector starts whenever allocations pass a threshold, so each
    rank pauses at its own moment, and in synchronous data parallelism every other rank waits
    for it at the next all-reduce. The pauses are not small in a training process: a compiled
    model holds many Python objects (FX graphs, guards), and a full collection walks all of them
    (bench/NOTES.md has one measured case). torchtitan and torchtnt pace the collector the same
    way.

    With ``every_steps`` > 0 the automatic collector is off inside ``fit()``: the young
    generations are collected every ``every_steps`` steps (cheap: only recent objects), and a
    full collection runs at epoch ends, after evaluations and after checkpoints, where the
    ranks wait for each other anyway. Garbage without reference cycles is freed at once as
    always; only cycles wait for the next collection. ``every_steps`` = 0 leaves Python's
    automatic collection as it is.

    Args:
        every_steps: collect the young generations every this many optimizer steps; 0 = off.
    """

    def __init__(self, every_steps: int):
        if every_steps < 0:
            raise ValueError(f"trainer.gc_every_steps must be >= 0, got {every_steps}")
        self.every_steps = every_steps
        self._was_enabled = True

    def start(self) -> None:
        """Collect everything once, then switch the automatic collector off (if pacing)."""
        self._was_enabled = gc.isenabled()
        if self.every_steps > 0:
            gc.collect()
            gc.disable()

    def step(self, step: int) -> None:
        """Called after optimizer step ``step`` (1-based) on every rank."""
        if self.every_steps > 0 and step % self.every_steps == 0:
            gc.collect(1)

    def full(self) -> None:
        """A full collection at a point where the ranks are synchronised anyway."""
        if self.every_steps > 0:
            gc.collect()

    def stop(self) -> None:
        """Give the process its automatic collector back (as it was before ``start``)."""
        if self.every_steps > 0 and self._was_enabled:
            gc.enable()


# ----------------------------------------------------------------------------- host memory


def _meminfo_available(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            return next((int(line.split()[1]) for line in f if line.split()[:1] == [key]), 0)
    except (OSError, ValueError, IndexError):
        return 0


def cgroup_memory_available(root: str = CGROUP_ROOT, proc_root: str = "/proc") -> Optional[int]:
    """Bytes the process's cgroup may still take before its memory limit, or None (no limit, or
    no cgroup file readable): the tightest over its own cgroup and each of its parents
    (:func:`cgroup_folders`, read from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``), v2
    and v1 alike. v2: ``memory.max`` minus ``memory.current`` (less its reclaimable
    ``inactive_file`` page cache); v1: ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``
    (less ``total_inactive_file``), under the mount of the memory controller.

    Args:
        root, proc_root: where the cgroup hierarchies and ``/proc`` are (tests pass fake trees).
    """
    found = []
    for controller, limit_file, used_file, cache in (("", "memory.max", "memory.current", "inactive_file"), (
            "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        for folder in cgroup_folders(controller, proc_root, root):
            limit = _read_int(os.path.join(folder, limit_file))
            if limit is None or limit >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2**63 - 1
                continue
            used = (_read_int(os.path.join(folder, used_file)) or 0) - _stat_value(
                os.path.join(folder, "memory.stat"), cache)
            found.append(limit - max(used, 0))
    return max(min(found), 0) if found else None


def available_host_memory(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                          proc_root: str = "/proc") -> Optional[int]:
    """Host memory this process can still take, in bytes: the machine's ``MemAvailable``, at most
    what its cgroup's limit leaves; None when neither can be read."""
    known = [b for b in (_meminfo_available(meminfo), cgroup_memory_available(cgroup_root, proc_root)) if b is not None]
    return min(known) if known else None


def check_host_memory(needed_bytes_per_rank: float, local_world_size: int, what: str = "optim.offload=cpu",
                      reserve_bytes: float = 2**30, meminfo: str = "/proc/meminfo",
                      cgroup_root: str = "/sys/fs/cgroup", parts: Optional[dict[str, float]] = None,
                      instead: str = "", proc_root: str = "/proc") -> Optional[int]:
    """Refuse, before training, a run whose ranks on this node need more host memory than is free.

    Every rank of the node calls it with its own need before any of them allocates (each then
    sees the same free memory, and the check counts all ``local_world_size`` shares).

    Args:
        needed_bytes_per_rank: host bytes one rank will allocate (the estimator's
            ``host_total``; ``OffloadedMasters.host_bytes()``).
        local_world_size: ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``).
        what: the switch that needs the memory, for the message.
        reserve_bytes: kept free for the rest of the process (the Python heap, loader workers).
        meminfo, cgroup_root, proc_root: where to read (tests pass fakes).
        parts: what makes up ``needed_bytes_per_rank``, named (``{"the EMA ...": bytes}``), for
            the message: the share to cut is then visible.
        instead: the last remedy of the message (default: turn ``what``'s key off).

    Returns:
        The available bytes it compared against, or None when nothing could be read (no check).

    Raises:
        ConfigError: the need (all local ranks, plus the reserve) exceeds what is available; the
            message has the numbers and what to change.
    """

    available = available_host_memory(meminfo, cgroup_root, proc_root)
    if available is None:
        return None
    need = float(needed_bytes_per_rank) * max(int(local_world_size), 1)
    if need + reserve_bytes > available:
        each, key = f"{float(needed_bytes_per_rank) / 2**30:.1f} GiB each", what.split("=")[0]
        if parts:
            each += ": " + " + ".join(f"{_gib(b)} {name}" for name, b in parts.items())
        raise ConfigError(
            f"{what}: the {local_world_size} rank(s) on this node need {need / 2**30:.1f} GiB of host memory "
            f"({each}) + {reserve_bytes / 2**30:.1f} GiB kept free, but "
            f"{available / 2**30:.1f} GiB is available (MemAvailable / the cgroup's memory limit): spread the run over "
            f"more nodes (each rank holds 1/N of the state), train fewer parameters (LoRA), raise the "
            f"container's memory limit, or {instead or f'turn {key} off'} "
            "(python -m ddptrain.memory shows each figure)")
    return available


def _gib(nbytes: float) -> str:
    # a share under 0.1 GiB still shows its size (a small EMA beside a large offload)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= 0.1 * scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def agree_on_host_memory(parts: dict[str, float], device: torch.device, what: str, instead: str = "") -> None:
    """:func:`check_host_memory` of this rank's ``parts`` (named bytes, summed), the verdict
    agreed by every rank (one collective when distributed), so none goes on to allocate while
    another raises. Call it on every rank, before the memory is allocated.

    Raises:
        ConfigError: this rank's check failed (its numbers), or another rank's did.
    """
    error = None
    try:
        check_host_memory(sum(parts.values()), int(os.environ.get("LOCAL_WORLD_SIZE", "1")), what,
                          parts=parts, instead=instead)
    except ConfigError as e:
        error = e
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        ok = torch.tensor([0.0 if error else 1.0], device=device)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        if ok.item() == 0 and error is None:
            error = ConfigError(f"{what}: another rank found too little host memory (its error says how much)")
    if error is not None:
        raise error
