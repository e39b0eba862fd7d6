"""Process-group set-up and the few collectives the Trainer needs.

One code path for every launch mode: ``python script.py`` (one process, no process group),
``torchrun --nproc_per_node=N`` and ``torchrun --nnodes=M --rdzv_backend=c10d ...`` (torchrun
exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, we read them). A user's script
never branches on the launch mode.

Every control-flow decision (stop, skip a step, save now) goes through :func:`any_rank` so all
ranks take the same branch; a rank that decides alone would leave the others waiting forever in
the next collective.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from ddptrain.config import ConfigError

if TYPE_CHECKING:
    from ddptrain.config import DistConfig


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: Optional[str]  # None when running as a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def configure_allocator(conf: str) -> None:
    """PyTorch's CUDA caching-allocator settings, unless the user set ``PYTORCH_CUDA_ALLOC_CONF``.

    Why ``expandable_segments:True`` by default: batches of varying shapes (every bucket its own)
    leave the default allocator's fixed segments fragmented; on one H200 a Conformer epoch with
    per-bucket budgets ran out of memory with 124 GiB allocated and 14 GiB reserved but unusable.
    Expandable segments grow and shrink in place instead.
    """
    if not conf or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf  # read when CUDA initialises (and by child processes)
    apply_now = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if torch.cuda.is_initialized() and apply_now:  # CUDA already in use: new segments follow the settings
        apply_now(conf)


def setup(backend: str = "auto", timeout_s: float = 600.0, device: str = "auto",
          cuda_alloc_conf: str = "", gpu_memory_gb: float = 0.0) -> DistInfo:
    """Initialise the process group from torchrun's environment, or run as a single process.

    Args:
        backend: ``auto`` picks NCCL when the device is CUDA and gloo otherwise.
        timeout_s: collective timeout. A peer that died turns into an error after this long
            instead of an endless wait (NCCL also needs async error handling for that, which
            torch enables by default).
        device: ``auto`` uses ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.
        cuda_alloc_conf: ``trainer.cuda_alloc_conf`` (see :func:`configure_allocator`).
        gpu_memory_gb: ``trainer.gpu_memory_gb`` (see :func:`cap_gpu_memory`); 0 = no cap.

    Returns:
        The rank, world size, local rank, device and backend of this process.

    Raises:
        ConfigError: a ``gpu_memory_gb`` above the GPU's total memory.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device asks for CUDA but torch.cuda.is_available() is False")
        configure_allocator(cuda_alloc_conf)
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    cap_gpu_memory(gpu_memory_gb, dev, quiet=rank != 0)  # before anything (the model) lands on the GPU

    if dist.is_initialized():  # the user (or a test) set it up already: just describe it
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, dist.get_backend())
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistInfo(0, 1, 0, dev, None)

    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = dev  # eager NCCL init: errors show up here, not at the first step
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _restart_safe_store(rank, world_size, timeout)
    dist.init_process_group(backend=backend, timeout=timeout, world_size=world_size, rank=rank,
                            store=store, **kwargs)
    global _heartbeat
    if _heartbeat is not None:  # a previous process group's
        _heartbeat.stop()
    _heartbeat = Heartbeat(store, rank, world_size, timeout_s)  # names a rank that stops answering
    return DistInfo(rank, world_size, local_rank, dev, backend)


def setup_for(config) -> DistInfo:
    """:func:`setup` with a config's ``dist`` and ``trainer`` keys (the one place that maps them)."""
    t = config.trainer
    return setup(config.dist.backend, config.dist.timeout_s, t.device, t.cuda_alloc_conf, t.gpu_memory_gb)


def gpu_memory_fraction(gib: float, total_memory: int) -> float:
    """The caching-allocator fraction that caps a GPU of ``total_memory`` bytes at ``gib`` GiB.

    Args:
        gib: the cap in GiB (2**30 bytes), as ``trainer.gpu_memory_gb``.
        total_memory: the GPU's ``torch.cuda.get_device_properties(d).total_memory`` in bytes.

    Raises:
        ConfigError: a cap larger than the GPU (it would cap nothing and pretend to emulate a
            card that this GPU cannot be).
    """
    if gib * 2**30 > total_memory:
        most = int(total_memory / 2**30 * 100) / 100  # rounded down: the largest cap that is accepted
        raise ConfigError(f"trainer.gpu_memory_gb={gib:g} is more than this GPU's {total_memory / 2**30:.2f} GiB "
                          f"(total_memory): set it to at most {most:g}, or 0 for no cap")
    return float(gib * 2**30 / total_memory)


def cap_gpu_memory(gib: float, device: torch.device, quiet: bool = False) -> None:
    """Cap this process's caching allocator on ``device`` at ``gib`` GiB (``trainer.gpu_memory_gb``).

    GiB, not 1e9 bytes: a "24 GB" RTX 3090/4090 reports ~23.6-24 GiB of ``total_memory``, so
    ``gpu_memory_gb: 24`` makes a large GPU behave like that card. The cap covers what PyTorch's
    allocator reserves (fragmentation included), not the CUDA context (~0.3-0.5 GiB on a real
    card, outside the cap): for a tight emulation of a 24 GB card, use 23. On a CPU run the cap
    is ignored with a note, not refused: the same config then also runs CPU dry runs and tests,
    where there is no GPU memory to cap and nothing the cap would change.

    Args:
        gib: the cap in GiB; 0 (or less) = no cap.
        device: this rank's device (``cuda:LOCAL_RANK``), already current.
        quiet: no note on a CPU run (every rank but rank 0).

    Raises:
        ConfigError: a cap larger than the GPU's total memory.
    """
    if not gib or gib <= 0:
        return
    if device.type != "cuda":
        if not quiet:
            print(f"note: trainer.gpu_memory_gb={gib:g} ignored: this run is on {device}, not a GPU", flush=True)
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction(gib, total), device)


def _restart_safe_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The rendezvous store, with keys namespaced by torchrun's restart count.

    After ``torchrun --max-restarts`` restarts the workers, the agent's store still holds the
    previous attempt's keys, including the dead processes' gloo/NCCL addresses; a restarted rank
    could read one before its peer overwrites it and fail with "Connection refused" (a race seen
    here in about one restart in five; cf. pytorch/pytorch#167288). A fresh prefix per attempt
    removes the race.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=(rank == 0 and not agent_store), timeout=timeout,
                          multi_tenant=not agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ddptrain/attempt_{attempt}", store)


def teardown() -> None:
    """Destroy the process group (if we made one); safe to call twice. Every rank calls it at
    the end of a run. gloo can abort the process at exit ("terminate called without an active
    exception") in two known ways, both guarded against here: one rank destroys its group while
    a peer still has work pending on it (hence the barrier), or a finished run's DDP reducer and
    gloo work objects, kept alive by reference cycles, are freed only while the interpreter shuts
    down (hence a collection first, while everything they touch still exists)."""
    global _heartbeat
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    if _heartbeat is not None:  # after the barrier: a rank waiting in it still answers
        _heartbeat.stop()
        _heartbeat = None


# ----------------------------------------------------------------------------- who stopped answering


class PeerTimeoutError(RuntimeError):
    """A collective timed out; the message names the rank(s) that stopped answering (their last
    heartbeat, step and place) and says what every rank was doing."""


class Heartbeat:
    """Each rank's sign of life in the rendezvous store, read when a collective times out.

    Why: a collective that times out fails on the ranks that wait in it, which are the healthy
    ones; the rank that stopped (SIGSTOP, a debugger, a hung driver call, a dead host) says
    nothing, and torchrun's "root cause" is the healthy rank's error. So every rank writes, from
    a thread, ``"<step> <time> <where>"`` under ``heartbeat/<rank>`` every ``interval_s``: a
    frozen process stops writing, a rank waiting in a collective or busy in a slow ``loss_fn``
    goes on (and says where its main thread is). One store write every few seconds per rank,
    over its own connection; nothing in the training loop.

    Args:
        store: the process group's store (cloned here: a connection of its own).
        rank, world_size: this process's place.
        timeout_s: ``dist.timeout_s``; the beat comes every ``min(5, timeout_s / 10)`` s, so a
            frozen rank's heartbeat is several beats old when a collective times out.
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval_s = max(0.2, min(5.0, self.timeout_s / 10))
        self.progress = None  # the Trainer's TrainingProgress (its .step), once it has one
        self._main = threading.main_thread().ident
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        try:
            self.store = store.clone()
            self.store.set_timeout(datetime.timedelta(seconds=max(2 * self.interval_s, 2.0)))
        except Exception:  # a store without clone(): no heartbeat, errors stay as they are
            self.store = None
            return
        self._beat()
        self._thread = threading.Thread(target=self._run, name="ddptrain-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # ended before the interpreter is: never inside a store call at shutdown

    def _key(self, rank: int) -> str:
        return f"heartbeat/{rank}"

    def _where(self) -> str:
        """Where the main thread is: its innermost frame, and the innermost outside torch."""
        frame = sys._current_frames().get(self._main)
        places = []
        while frame is not None and len(places) < 2:
            code = frame.f_code
            outside = os.sep + "torch" + os.sep not in code.co_filename
            if not places or (outside and os.sep + "torch" + os.sep in places[0][1]):
                places.append((code.co_name, code.co_filename, frame.f_lineno))
            frame = frame.f_back
        return " < ".join(f"{name} ({os.path.basename(file)}:{line})" for name, file, line in places) or "?"

    def _beat(self) -> None:
        step = getattr(self.progress, "step", -1)
        with self._lock:
            self.store.set(self._key(self.rank), f"{step} {time.time():.3f} {self._where()}")

    def _run(self) -> None:
        seen, since, looks = None, time.monotonic(), [0.5, 0.75]
        while not self._stopped.wait(self.interval_s):
            try:
                self._beat()
                step = getattr(self.progress, "step", None)
                if step != seen:
                    seen, since, looks = step, time.monotonic(), [0.5, 0.75]
                elif looks and step is not None and time.monotonic() - since > looks[0] * self.timeout_s:
                    # half-way and three quarters to the timeout: NCCL's watchdog ends the process
                    # without a Python exception, so this line may be all that names the silent rank
                    looks.pop(0)
                    silent, every = self._summary(self.read())
                    if silent:
                        looks.clear()  # said once per stall
                        print(f"WARNING: rank {self.rank}: no step for {time.monotonic() - since:.0f} s, and {silent} "
                              f"stopped answering. Heartbeats: {every}", file=sys.stderr, flush=True)
            except Exception:  # the store's host is gone or busy: the next beat tries again
                pass

    def stop(self) -> None:
        self._stopped.set()
        if getattr(self, "_thread", None) is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        atexit.unregister(self.stop)

    def read(self) -> dict[int, tuple[int, float, str]]:
        """``{rank: (step, seconds since its last beat, where)}`` of the ranks whose heartbeat
        could be read."""
        out = {}
        if self.store is None or not self._lock.acquire(timeout=2 * self.interval_s):
            return out
        try:
            now = time.time()
            for r in range(self.world_size):
                try:
                    if self.store.check([self._key(r)]):
                        step, stamp, where = self.store.get(self._key(r)).decode().split(" ", 2)
                        out[r] = (int(step), max(0.0, now - float(stamp)), where)
                except Exception:
                    continue
        finally:
            self._lock.release()
        return out

    def _summary(self, beats: dict) -> tuple[str, str]:
        """(the silent ranks named with their last heartbeat, or ""; every rank's heartbeat)."""
        stale = 3 * self.interval_s  # a healthy rank's heartbeat is at most one interval old
        # a missing heartbeat counts only where this rank's own could be read (the store answers)
        silent = sorted(r for r in range(self.world_size)
                        if (r not in beats and self.rank in beats) or (r in beats and beats[r][1] > stale))

        def at(step: int, where: str) -> str:
            return f"{f'after step {step}' if step >= 0 else 'outside fit()'}, in {where}"

        named = ", ".join(f"rank {r}" + (f" (last heartbeat {beats[r][1]:.0f} s ago, {at(beats[r][0], beats[r][2])})"
                                         if r in beats else " (no heartbeat at all)") for r in silent)
        every = "; ".join(f"rank {r}: {age:.0f} s ago, {at(step, where)}"
                          for r, (step, age, where) in sorted(beats.items()))
        return named, every

    def explain(self, error: BaseException) -> Optional[PeerTimeoutError]:
        """A :class:`PeerTimeoutError` naming who stopped answering, when ``error`` (or its cause)
        is a collective's timeout or a lost peer; None for any other error."""
        if not lost_peer(error):
            return None
        beats = self.read()
        if not beats:
            return None
        silent, every = self._summary(beats)
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        if not silent and not _TIMED_OUT.search(" ".join(map(str, _chain(error)))):
            return None  # a peer that crashed says so itself (its own error is the root cause)
        if silent:
            head = (f"rank {self.rank}: a collective did not complete within dist.timeout_s={self.timeout_s:g}: "
                    f"{silent} stopped answering: that process is stopped (SIGSTOP, a debugger), frozen in a "
                    "system or driver call, dead, or its host is unreachable. Look there first")
        else:
            head = (f"rank {self.rank}: a collective did not complete within dist.timeout_s={self.timeout_s:g}, "
                    "and every rank still answers: one is busy elsewhere (a slow loss_fn or data loading, a "
                    "collective only some ranks call): see where each one is")
        return PeerTimeoutError(f"{head}. Heartbeats (every {self.interval_s:g} s): {every}. "
                                f"The error on this rank: {first}")


# what a collective's timeout or a vanished peer says (gloo, NCCL); not a DataLoader's timeout
_LOST_PEER = re.compile(r"timed out waiting \d+ ?ms|gloo.*connection (closed|reset) by peer|watchdog caught collective "
                        r"operation timeout|nccl.*(timeout|timed out|remote process exited)", re.IGNORECASE | re.DOTALL)


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _chain(error: Optional[BaseException]) -> list[BaseException]:
    """``error`` and the errors it wraps (causes, contexts)."""
    seen: list[BaseException] = []
    while error is not None and all(error is not e for e in seen) and len(seen) < 8:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` (or an error it wraps) is a collective's timeout or a peer gone: a
    c10d network / store error, or gloo's and NCCL's words for one."""
    kinds = tuple(getattr(dist, k) for k in ("DistNetworkError", "DistStoreError") if hasattr(dist, k))
    return any(isinstance(e, kinds) or _LOST_PEER.search(str(e)) for e in _chain(error))


_heartbeat: Optional[Heartbeat] = None


def follow_progress(progress) -> None:
    """Let this rank's heartbeat say its step (``progress.step``, read by the heartbeat's thread)
    and warn when it stalls with a peer silent; None: no step to watch (outside the loop)."""
    if _heartbeat is not None:
        _heartbeat.progress = progress
        if progress is not None:  # one beat now: steps faster than the beat's interval still show inside fit
            with contextlib.suppress(Exception):  # the store's host busy: the thread's next beat tries again
                _heartbeat._beat()


def peer_timeout(error: BaseException) -> Optional[PeerTimeoutError]:
    """:meth:`Heartbeat.explain` of this process's heartbeat; None without one, or for another error."""
    return _heartbeat.explain(error) if _heartbeat is not None else None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_reduce_sum(values: Sequence[float], device: torch.device) -> list[float]:
    """Sum a few scalars over all ranks in one collective (float64, so counts stay exact)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on any rank: the collective agreement on control flow."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from ``src`` to all ranks (e.g. the checkpoint path to resume)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers to every rank (what DDP does when it wraps a model).

    Needed where state is derived from the weights *before* DDP exists: the fp32 master weights
    of ``trainer.param_dtype: bf16`` are copied from the fp32 model, so it must already be the
    same on every rank. Tensors go in flat chunks of up to 256 MB per dtype.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [t for t in [*module.parameters(), *module.buffers()] if t.numel() > 0]
    chunk: list[torch.Tensor] = []
    size = 0
    for i, t in enumerate(tensors):
        chunk.append(t)
        size += t.numel() * t.element_size()
        if i == len(tensors) - 1 or tensors[i + 1].dtype != t.dtype or size > 256 << 20:
            flat = torch.cat([c.detach().reshape(-1) for c in chunk])
            dist.broadcast(flat, src=src)
            offset = 0
            for c in chunk:
                c.copy_(flat[offset:offset + c.numel()].view_as(c))
                offset += c.numel()
            chunk, size = [], 0


def wrap_ddp(model: torch.nn.Module, cfg: "DistConfig", device: torch.device, timer=None) -> torch.nn.Module:
    """``DistributedDataParallel`` with the ``dist`` config section's bucket size, bucket view,
    unused-parameter search, buffer broadcast and optional gradient-compression hook.

    Args:
        timer: a :class:`ddptrain.throughput.AllReduceTimer` that wraps the communication hook
            (DDP's own all-reduce without compression), or None.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=cfg.gradient_as_bucket_view,
              find_unused_parameters=cfg.find_unused_parameters, broadcast_buffers=cfg.broadcast_buffers)
    hooks = {"none": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
             "fp16": default_hooks.fp16_compress_hook}
    if cfg.comm_hook != "none" or timer is not None:  # otherwise DDP's C++ all-reduce, no Python per bucket
        hook = hooks[cfg.comm_hook]
        ddp.register_comm_hook(state=None, hook=timer.wrap(hook) if timer is not None else hook)
    return ddp


# ----------------------------------------------------------------------------- the link check

# Conservative bus bandwidth (GB/s, NCCL-tests' convention) of one all-reduce of a 25 MB gradient
# bucket between the GPUs of one host: well under what the link gives at that size, so only a
# fallback to a slower path (host memory, sockets) falls below half of it. First match wins.
LINK_BUSBW_GBPS: tuple[tuple[str, str, float], ...] = (
    (r"H200 NVL|H100 NVL", "NVLink bridge", 50.0),
    (r"H100 PCIe", "PCIe peer-to-peer", 10.0),
    (r"B200|GH200|H200|H100|H800", "NVLink", 100.0),  # SXM boards: NVSwitch / NVLink 4-5
    (r"A100-SXM|A100 SXM|A800-SXM", "NVLink", 60.0),
)
PCIE_P2P_BUSBW_GBPS = 10.0  # any other GPU pair with peer access (PCIe, or a consumer NVLink bridge)


def expected_busbw(device: torch.device, local_world: int, world: int) -> tuple[float, str]:
    """(GB/s, link) that an all-reduce between this host's GPUs should reach at least, or
    (0, why not) where no figure applies: CPU, several hosts (the network's figure is the
    user's to give), or GPUs without peer access (host memory is then the only path)."""
    if device.type != "cuda":
        return 0.0, "CPU"
    if local_world != world:
        return 0.0, "several hosts"
    name = torch.cuda.get_device_name(device)
    for pattern, link, gbps in LINK_BUSBW_GBPS:
        if re.search(pattern, name):
            return gbps, link
    peers = [i for i in range(torch.cuda.device_count()) if i != device.index][:1]
    if peers and torch.cuda.can_device_access_peer(device.index, peers[0]):
        return PCIE_P2P_BUSBW_GBPS, "peer-to-peer"
    return 0.0, "no peer access"


def time_all_reduce(nbytes: int, device: torch.device, warmup: int = 2, iters: int = 5) -> float:
    """Seconds per all-reduce of ``nbytes`` of fp32 over all ranks (the slowest rank's mean over
    ``iters`` after ``warmup``); collective."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    tic = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - tic) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """NCCL-tests' all-reduce bus bandwidth in GB/s: ``2 (n - 1) / n`` x bytes / time, the rate
    each link carries in a ring, comparable with the link's own figure for any ``n``."""
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def preflight(cfg: "DistConfig", info: DistInfo, logger, step: int = 0) -> Optional[dict]:
    """``dist.preflight``: time an all-reduce of one gradient bucket, log its bus bandwidth on rank 0
    (``dist/allreduce_busbw_gbps``) and warn when it is far below the link's figure.

    Why: NCCL falls back from NVLink / PCIe peer-to-peer to host memory (SHM) or sockets without a
    word (a topology it distrusts, ``NCCL_P2P_LEVEL``/``NCCL_P2P_DISABLE`` left over, a container
    without peer access); such a fallback has cost users 41% of their throughput. Collective.

    Args:
        cfg: the ``dist`` section (``preflight``, ``bucket_cap_mb``, ``expected_busbw_gbps``).
        info: this process's place; one process runs nothing.
        logger: a :class:`ddptrain.logging.RunLogger` (``log``, ``print``: rank 0 only).
        step: the step the figures are logged at (a resumed run's).

    Returns:
        The logged figures, or None when the check did not run.
    """
    if cfg.preflight == "off" or info.world_size < 2 or not is_initialized() or (
            cfg.preflight == "auto" and info.device.type != "cuda"):
        return None
    nbytes = int(cfg.bucket_cap_mb * 2**20)  # DDP's bucket_cap_mb is MiB
    seconds = time_all_reduce(nbytes, info.device)
    busbw = bus_bandwidth(nbytes, seconds, info.world_size)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    expected, link = ((cfg.expected_busbw_gbps, "dist.expected_busbw_gbps") if cfg.expected_busbw_gbps > 0
                      else expected_busbw(info.device, local, info.world_size))
    figures = {"allreduce_busbw_gbps": busbw, "allreduce_ms": seconds * 1e3, "bucket_mb": cfg.bucket_cap_mb}
    if expected:
        figures["expected_busbw_gbps"] = expected
    logger.log(step, figures, prefix="dist")
    if expected and busbw < 0.5 * expected:
        logger.print(f"WARNING: dist.preflight: an all-reduce of one {cfg.bucket_cap_mb:g} MB gradient bucket over "
                     f"{info.world_size} ranks ran at {busbw:.1f} GB/s bus bandwidth, under half the ~{expected:g} "
                     f"GB/s expected of this link ({link}): NCCL is probably going through host memory (SHM) or "
                     "sockets instead of NVLink / PCIe peer-to-peer. Run with NCCL_DEBUG=INFO to see the transport; "
                     "check NCCL_P2P_LEVEL (e.g. NCCL_P2P_LEVEL=NVL, or SYS for PCIe across CPU sockets) and that "
                     "NCCL_P2P_DISABLE / NCCL_SHM_DISABLE are not set. dist.expected_busbw_gbps sets the expected "
                     "figure, dist.preflight=off skips this check.")
    return figures
