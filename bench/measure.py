"""Timing, memory and GPU-sensor helpers every benchmark uses, and the one result row of run.py's peers.

How a run is timed: ``W`` warm-up steps, then ``N`` timed steps. With ``replay: K`` the loader
yields its first ``K`` batches, then the same ``K`` again (``ReplayLoader``), so every peer is
timed in the steady state on identical batches. Step times come from host timestamps at each
loss call (ddptrain: ``TimedLoss``) or each step (bare loop); the span of the timed steps is
closed with a device synchronisation. The model benchmarks (bench_glmasr.py, bench_voxcpm.py,
bench_9b.py) time, cap and read memory with these same pieces and run each peer in its own
bounded process (``peer_row``).
"""

from __future__ import annotations

import collections
import gc
import json
import math
import os
import re
import statistics
import subprocess
import time
from typing import Callable, Optional

import torch

from flops import PEAK_BF16


def log(*a):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*a, flush=True)


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def device() -> torch.device:
    """This process's GPU (the current CUDA device), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reduce(values: list[float], op: str = "sum") -> list[float]:
    """All-reduce a few host floats over the ranks (sum or max); unchanged without a process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX)
    return t.tolist()


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's copy of a few host floats, in rank order; ``[values]`` without a process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=device())
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t)
    return [x.tolist() for x in out]


def to_device(b, dev):
    if isinstance(b, torch.Tensor):
        return b.to(dev, non_blocking=True)
    if isinstance(b, dict):
        return {k: to_device(v, dev) for k, v in b.items()}
    return b


def mem_reset():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def mem_now() -> float:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0.0


def peak_gb(reserved: bool = False) -> Optional[float]:
    """Peak allocated (or reserved) GPU memory since :func:`mem_reset` in GB (1e9 bytes); None on CPU."""
    if not torch.cuda.is_available():
        return None
    return (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / 1e9


def cap_gpu_memory(gib: float) -> None:
    """Caps the caching allocator at ``gib`` GiB of the current GPU, so a large GPU behaves like a
    small card, for peers that are not ddptrain (it caps itself: ``trainer.gpu_memory_gb``); 0 or
    no GPU: nothing."""
    if gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))


def mem_peak() -> dict:
    if not torch.cuda.is_available():
        return {"peak_alloc_gb": 0.0, "peak_reserved_gb": 0.0}
    return {"peak_alloc_gb": float(torch.cuda.max_memory_allocated()),
            "peak_reserved_gb": float(torch.cuda.max_memory_reserved())}


class TimedLoader:
    """Wraps a DataLoader: same ``len``/``batch_sampler``/``sampler``; records the host's wait for each batch."""

    def __init__(self, loader):
        self.loader, self.waits = loader, []
        self.batch_sampler, self.sampler = loader.batch_sampler, loader.sampler

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        while True:
            t = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                return
            self.waits.append(time.perf_counter() - t)
            yield b


class ReplayLoader:
    """Yields the first ``k`` batches of ``loader``, then the same ``k`` batches again, forever.

    Why: speech batches have new shapes all the time, and the first time a shape is seen cuDNN
    (convolutions, its SDPA attention) builds an execution plan on the host. A training run
    reaches the steady state where every (quantised) shape is cached; a 20-step benchmark does
    not. Measuring the second pass over the same ``k`` batches times every peer in that steady
    state, on identical batches. Batches stay pinned in host memory after the first pass.
    """

    def __init__(self, loader, k: int):
        self.loader, self.k = loader, k
        self.batch_sampler = self.sampler = None  # the Trainer treats it as a plain iterable
        self.dataset = getattr(loader, "dataset", None)
        self.waits = []

    def __len__(self):
        return 10 ** 6

    def __iter__(self):
        cache, it = [], iter(self.loader)
        for _ in range(self.k):
            t = time.perf_counter()
            b = next(it)
            self.waits.append(time.perf_counter() - t)
            cache.append(b)
            yield b
        del it
        while True:
            for b in cache:
                self.waits.append(0.0)
                yield b


class GpuSensors:
    """This process's GPU as NVML reports it: SM clock, temperature, power, throttle reasons.

    Why: a hot or power-capped GPU clocking down looks just like a slower step (and like a
    communication overhead when a cold 1-GPU run is compared with a warm 2-GPU one). Sampled
    once per step; off when NVML is not there (CPU, or no pynvml).
    """

    def __init__(self):
        self.samples: list = []
        self.ok = torch.cuda.is_available()

    def sample(self) -> None:
        if not self.ok:
            return
        try:
            mask = 0
            try:  # private helper: the NVML handle of the current device (honours CUDA_VISIBLE_DEVICES)
                import pynvml

                mask = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(torch.cuda._get_pynvml_handler())
            except Exception:
                pass
            self.samples.append((torch.cuda.clock_rate(), torch.cuda.temperature(), torch.cuda.power_draw() / 1e3, mask))
        except Exception as e:  # no NVML: say so once, then stop trying
            log(f"GPU sensors off: {type(e).__name__}: {e}")
            self.ok = False

    def summary(self, i0: int, i1: int) -> dict:
        got = [x for x in self.samples[i0:i1] if x]
        if not got:
            return {}
        clocks = [c for c, _, _, _ in got]
        mask = 0
        for *_, m in got:
            mask |= int(m)
        # this rank's GPU only (no collective here: a rank without NVML must not hang the others)
        return {"sm_clock_mhz": [min(clocks), round(sum(clocks) / len(clocks)), max(clocks)],
                "gpu_temp_c": [got[0][1], got[-1][1]], "power_w_mean": round(sum(p for _, _, p, _ in got) / len(got)),
                "throttle_reasons_mask": hex(mask)}


class Interleave:
    """The batches ``N`` ranks would get, in step order (rank 0 step 0, rank 1 step 0, rank 0
    step 1, ...): a 1-GPU run over it does exactly the work of the ``N``-GPU run, which is what
    a scaling efficiency needs (the ``N``-GPU plan has other batches than the 1-GPU plan)."""

    def __init__(self, loaders):
        self.loaders, self.dataset = loaders, loaders[0].dataset

    def __len__(self):
        return sum(len(x) for x in self.loaders)

    def __iter__(self):
        for step in zip(*self.loaders):
            yield from step


class TimedLoss:
    """Wraps the loss: records the host time and the batch stats at every call (= every step start).

    Args:
        fn: the loss function ``(model, batch) -> (loss_sum, units)``.
        stats: ``batch -> dict`` of the batch's counts; default: the ``stats`` its collate added.
        keep: hold the last ``keep`` batches (as the loss got them, on the device; a dict is
            copied before ``stats`` may change it) in ``recent``: steps to profile afterwards
            on shapes the timed steps compiled already.
    """

    def __init__(self, fn, stats: Optional[Callable[[dict], dict]] = None, keep: int = 0):
        self.fn, self.calls, self.sensors = fn, [], GpuSensors()
        self.stats = stats or (lambda batch: batch.get("stats", {}))
        self.recent = collections.deque(maxlen=keep)

    def __call__(self, model, batch):
        if self.recent.maxlen:
            self.recent.append(dict(batch) if isinstance(batch, dict) else batch)
        self.calls.append((time.perf_counter(), self.stats(batch)))
        self.sensors.sample()
        return self.fn(model, batch)

    def window(self, w: int, n: int, end: Optional[float] = None) -> tuple[float, list, list]:
        """``(seconds, stats, step seconds)`` of steps ``w`` to ``w + n - 1``: a step lasts from its
        loss call to the next; ``end`` (a host time after a device sync) closes the last step when
        no call followed it."""
        t = [c[0] for c in self.calls[w:w + n + 1]]
        if len(t) == n:
            t.append(end)
        return t[-1] - t[0], [s for _, s in self.calls[w:w + n]], [b - a for a, b in zip(t, t[1:])]


class TimedSteps(TimedLoss):
    """A :class:`TimedLoss` whose clock is the Trainer's step, not the loss call: a replayed CUDA
    graph (``compile.cuda_graphs``) runs no ``loss_fn``, and per-batch ``stats`` left in the batch
    would give every batch a graph key of its own (host numbers are keyed by value).

    ``attach(trainer)`` wraps ``trainer.train_step``: at each step it records the host time and
    the stats (``stats(batch)``, default: the ``stats`` entry the collate added, taken out of a
    copy of the batch before the Trainer sees it); a step of several micro-batches records their
    numeric stats summed, other entries from the first. ``recent`` keeps the batches with their
    stats, as profiling's FLOPs count reads them.
    """

    def __init__(self, stats: Optional[Callable[[dict], dict]] = None, keep: int = 0):
        super().__init__(None, stats or (lambda batch: batch.pop("stats", {})), keep)

    def attach(self, trainer) -> "TimedSteps":
        inner = trainer.train_step

        def train_step(micro_batches):
            t, seen, batches = time.perf_counter(), [], []
            for b in micro_batches:
                if self.recent.maxlen:
                    self.recent.append(dict(b) if isinstance(b, dict) else b)
                b = dict(b) if isinstance(b, dict) else b  # a replayed batch must keep its stats
                seen.append(self.stats(b))
                batches.append(b)
            merged = dict(seen[0]) if seen else {}
            for k in merged:
                if len(seen) > 1 and all(isinstance(s.get(k), (int, float, torch.Tensor)) for s in seen):
                    merged[k] = sum(s[k] for s in seen)
            self.calls.append((t, merged))
            self.sensors.sample()
            return inner(batches)

        trainer.train_step = train_step
        return self


def graph_counts(trainer) -> dict:
    """``compile.cuda_graphs``' counts over the whole run (warm-up included): keys captured,
    micro-batches that replayed one, micro-batches in all, keys left eager and why; {} when it is off."""
    g = getattr(trainer, "graphs", None)
    return {} if g is None else {"cuda_graphs": len(g.graphs), "cuda_graph_replays": g.replayed,
                                 "cuda_graph_batches": g.total, "cuda_graph_eager_keys": len(g.eager_only),
                                 "cuda_graph_eager_why": sorted(set(g.reasons))[:8]}


def append_row(path: str, row: dict) -> None:
    """Appends ``row`` as one JSON line to ``path`` (its folder made if needed); rank 0 only, so
    the ranks of one run write one row."""
    if not path or world()[0] != 0:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def named_peers(peers: str, ov: list, overrides: dict) -> list:
    """The peers to run: ``peers`` (comma-separated) + each ``--ov NAME=k=v,k=[a,b]`` as a peer
    ``NAME`` whose overrides (split at the commas outside ``[...]``) go into ``overrides``."""
    named = dict(o.split("=", 1) for o in ov)
    for name, value in named.items():
        overrides[name] = re.split(r",(?![^\[]*\])", value)
    listed = [x for x in peers.split(",") if x]
    return listed + [x for x in named if x not in listed]


def peer_row(cmd: list, row_file: str, timeout: float, env: Optional[dict] = None, **keys) -> tuple[bool, dict]:
    """Runs one peer in its own process (its memory peak and compile caches leave with it), bounded
    by ``timeout`` seconds: ``(True, the row it wrote to row_file)``, else ``(False, keys + error)``
    with the tail of its output, or ``did not finish within ...`` and the tail."""
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x]
        return False, {**keys, "error": f"did not finish within {timeout:.0f} s", "tail": "".join(out)[-3000:]}
    if proc.returncode == 0 and os.path.exists(row_file):
        with open(row_file) as f:
            return True, json.load(f)
    return False, {**keys, "error": (proc.stdout + proc.stderr)[-3000:]}


class GcPauses:
    """Records each Python garbage collection (host start time, generation, duration) while active.

    Why: an automatic collection on one rank stalls every rank at the next all-reduce; this
    shows whether the pauses land inside the timed steps (``trainer.gc_every_steps`` paces them).
    """

    def __init__(self):
        self.events, self._start = [], None

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.events.append((self._start, info["generation"], time.perf_counter() - self._start))
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)

    def summary(self, t0: float, t1: float) -> dict:
        ev = [(g, d) for t, g, d in self.events if t0 <= t < t1]
        return {"gc_count": len(ev), "gc_ms_total": round(1e3 * sum(d for _, d in ev), 1),
                "gc_pauses_over_1ms": [[g, round(1e3 * d, 1)] for g, d in ev if d > 1e-3]}


def summarize(exp, workload, ws, elapsed, stats, waits_s, step_times, mem, extra) -> dict:
    """The result row of one experiment: throughput summed over ranks, memory maxed over ranks.

    Args:
        exp: the experiment (its name, peer, batch, budget, overrides are copied into the row).
        workload: the workload name.
        ws: world size.
        elapsed: seconds of the timed steps on this rank (the row takes the slowest rank's).
        stats: the timed batches' ``stats`` dicts (``workloads.StatsCollate``).
        waits_s: seconds this rank waited for data during the timed steps.
        step_times: seconds of each timed step ([] when the peer cannot see its steps).
        mem: byte counts to report in GB, maxed over ranks.
        extra: further keys for the row.
    """
    keys = ["n", "audio_s", "padded_s", "tokens", "flops"]
    tot = [sum(float(s.get(k, 0)) for s in stats) for k in keys]
    g = dict(zip(keys, reduce(tot, "sum")))
    elapsed = reduce([elapsed], "max")[0]
    wait = reduce([waits_s], "max")[0]
    m = dict(zip(mem, reduce([mem[k] for k in mem], "max")))
    # per GPU, for scaling runs: is one rank's memory, clock or power unlike the others' (NaN:
    # a rank without NVML)
    nan = float("nan")
    clock = extra.get("sm_clock_mhz", [nan, nan, nan])[1]
    per = gather([mem.get("peak_alloc_gb", 0.0) / 1e9, clock, extra.get("power_w_mean", nan)])
    per_gpu = {key: [None if math.isnan(v) else round(v, 2) for v in col] for key, col in
               zip(("peak_alloc_gb_per_gpu", "sm_clock_mhz_per_gpu", "power_w_per_gpu"), zip(*per))}
    per_gpu_tflops = g["flops"] / elapsed / ws / 1e12
    return {
        "workload": workload, "name": exp["name"], "peer": exp["peer"], "world_size": ws,
        "batch": exp.get("batch"), "budget": exp.get("budget"), "ov": exp.get("ov", []),
        "replay": exp.get("replay"), "sdpa": exp.get("sdpa", "default"),
        "steps": len(stats), "elapsed_s": round(elapsed, 3),
        "samples_per_s": g["n"] / elapsed, "audio_s_per_s": g["audio_s"] / elapsed,
        "padded_s_per_s": g["padded_s"] / elapsed, "tokens_per_s": g["tokens"] / elapsed,
        "padding_frac": 1 - g["audio_s"] / g["padded_s"] if g["padded_s"] else 0.0,
        "samples_per_step_per_gpu": g["n"] / max(len(stats), 1) / ws,
        "tflops_per_gpu": per_gpu_tflops, "mfu": per_gpu_tflops * 1e12 / PEAK_BF16,
        "data_wait_frac": wait / elapsed, "step_ms_median": 1e3 * statistics.median(step_times) if step_times else None,
        "step_ms_all": [round(1e3 * t, 1) for t in step_times],
        **{k: round(v / 1e9, 3) for k, v in m.items()}, **per_gpu,
        **extra,
    }
