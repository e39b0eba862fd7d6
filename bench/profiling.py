"""Where a step's time goes: torch.profiler summaries, host syncs, and what the host did while the GPU idled.

Each helper takes ``step_fn(batch)``, one training step of a peer, and a few batches; the
runner calls them after the timed steps (``profile``, ``syncs``, ``gaps`` experiment keys; the
model benches' ``--profile``), so profiling never slows the steps that are timed.
``bench/profile_table.py`` turns the profiles of a results file into a table.
"""

from __future__ import annotations

import json
import os
import time
import warnings

import torch
from torch.autograd import DeviceType

from flops import PEAK_BF16
from measure import sync


# aten ops that are matrix products (the CPU dry run's "kernels")
ATEN_GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


# ops that only move or cast data, in the names inductor gives its fused kernels
_MOVES = {"to", "copy", "clone", "view", "unsafe", "t", "transpose", "permute", "expand", "slice", "cat",
          "select", "squeeze", "unsqueeze", "reshape", "contiguous", "constant", "pad", "scatter"}


def categorize(name: str) -> str:
    """A kernel's category by its name (a CUDA kernel, or an aten op in CPU dry runs).

    Attention before GEMMs: cuDNN's attention kernels carry GEMM-like names (``sm90_``, ``wgmma``).
    Inductor's kernels (``triton_poi_fused__to_copy_add_native_layer_norm_backward_5``) are named
    by every op they fuse: one that casts as well as normalises is a norm, and it counts as a
    cast only when every op in it moves or casts data.
    """
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if n in ATEN_GEMM or any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "splitk")):
        return "gemm"
    if n.startswith("triton_") and "_fused_" in n:
        ops = {w for w in n.split("_fused_", 1)[1].split("_") if w and not w.isdigit()}
        if "norm" in ops:
            return "norm"
        if ops & {"softmax", "nll", "logsumexp", "cross", "entropy"}:
            return "reduce/softmax/loss"
        return "dtype/copy" if ops and ops <= _MOVES else "elementwise/other"
    if "conv" in n or "implicit" in n or "cudnn" in n or "winograd" in n:
        return "conv"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer/foreach"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    if "copy" in n or "cast" in n:
        return "dtype/copy"
    if "norm" in n:
        return "norm"
    if "reduce" in n or "softmax" in n or "ctc" in n:
        return "reduce/softmax/loss"
    return "elementwise/other"


def gap_owners(step_fn, batches: list, top: int = 6, min_ms: float = 0.5, gpu_cats=("kernel", "gpu_memcpy", "gpu_memset")) -> list:
    """What the host was doing while the GPU sat idle: the ``top`` longest GPU idle gaps of the
    steps, each with the project frames (ddptrain/, bench/, examples/; from ``with_stack``) and
    host ops that overlap it most. Stack recording slows the host, so the gaps here are longer
    than in an unprofiled step: use it to attribute gaps, not to size them."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts, with_stack=True) as prof:
        for b in batches:
            step_fn(b)
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if isinstance(e, dict) and "dur" in e]
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in gpu_cats)
    host = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") not in gpu_cats
            and e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "user_annotation")]
    gaps, end = [], None
    for s, e, name in gpu:  # times in microseconds
        if end is not None and s - end > min_ms * 1e3:
            gaps.append((end, s, name))
        end = e if end is None else max(end, e)
    gaps.sort(key=lambda g: g[0] - g[1])
    out = []
    for a, b, after in gaps[:top]:
        over: dict = {}
        for s, e, name in host:
            o = min(e, b) - max(s, a)
            mine = any(k in name for k in ("ddptrain/", "bench/", "examples/")) and "site-packages" not in name
            if o > 0.05 * (b - a) and (mine or ".py(" not in name):
                over[name[:100]] = max(over.get(name[:100], 0), o)
        ranked = sorted(over.items(), key=lambda kv: -kv[1])[:14]
        out.append({"gap_ms": round((b - a) / 1e3, 2), "next": after[:70],
                    "host": [(n, round(o / 1e3, 2)) for n, o in ranked]})
    return out


# runtime calls in which the host waits for the GPU (a sync, a copy that blocks, a full launch queue)
WAITS = ("Synchronize", "Memcpy", "Command Buffer Full")


def _union_ns(ivals: list) -> tuple[int, list]:
    """Total length of the union of ``(start, end, i)`` intervals, and the gaps between them as
    ``(length, i before, i after)``: the index of the interval that ended last before the gap
    and of the one that starts it."""
    ivals = sorted(ivals)
    if not ivals:
        return 0, []
    total, gaps = 0, []
    (cur_s, cur_e, last) = ivals[0]
    for s, e, i in ivals[1:]:
        if s > cur_e:
            total += cur_e - cur_s
            gaps.append((s - cur_e, last, i))
            cur_s, cur_e, last = s, e, i
        elif e >= cur_e:
            cur_e, last = e, i
    return total + cur_e - cur_s, gaps


def profile_steps(step_fn, batches: list, flops: list | None = None) -> dict:
    """Run ``step_fn(batch)`` for each batch under torch.profiler and report where a step's time
    goes and the floor it implies: the step with no host time at all, its kernels back to back.

    On a GPU (CUDA activity only, so the host is barely slowed): kernel time per step by
    category and the top kernels; the GPU busy share of the wall time (the union of kernel
    intervals) and its idle share; ``host_ms_per_step``, the wall time less the time the host
    sat in runtime calls that wait for the GPU (``WAITS``: it is the host's own work, Python and
    launches, an estimate); ``floor_ms`` = kernel time per step (summed, so kernels on two
    streams count twice); ``floor_ratio`` = the profiled step's wall time / ``floor_ms`` (how
    much faster the same batches could run). On the CPU (dry runs) the "kernels" are the aten
    ops' self times and the host is the whole step.

    Args:
        step_fn: one training step, ``step_fn(batch)``.
        batches: the batches profiled, one step each (steps whose shapes have been compiled).
        flops: model FLOPs of each batch (None: no MFU): adds ``mfu_profiled`` and
            ``mfu_at_floor`` (per GPU, against ``flops.PEAK_BF16``).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for b in batches:
            step_fn(b)
        sync()
        wall = time.perf_counter() - t0
    if cuda:
        return step_times(prof.profiler.kineto_results.events(), wall, len(batches), flops)
    # the CPU: aten ops' self times stand in for kernels
    ops = [(e.key, e.self_cpu_time_total * 1e3, e.count) for e in prof.key_averages() if e.key.startswith("aten::")]
    return step_times([], wall, len(batches), flops, cpu_ops=ops)


def step_times(events, wall: float, n: int, flops: list | None = None, cpu_ops: list | None = None) -> dict:
    """:func:`profile_steps`' report from the profiler's kineto events (``name()``,
    ``device_type()``, ``start_ns()``, ``duration_ns()``) of ``n`` steps that took ``wall``
    seconds, or on the CPU from ``cpu_ops``: ``(aten op, self ns, calls)``."""
    wall_ns = wall * 1e9
    cats, names, runtime, kernels, waits = {}, {}, {}, [], []
    for e in events:
        dur, k = e.duration_ns(), e.name()
        if e.device_type() == DeviceType.CUDA:
            if k.startswith("##"):  # a region annotated on the GPU's timeline, not a kernel
                continue
            kernels.append((e.start_ns(), e.start_ns() + dur, len(kernels), k[:80]))
            c = categorize(k)
            cats[c] = cats.get(c, 0) + dur
            t, m = names.get(k[:120], (0, 0))
            names[k[:120]] = (t + dur, m + 1)
        elif any(w in k for w in WAITS):
            t, m = runtime.get(k, (0, 0))
            runtime[k] = (t + dur, m + 1)
            waits.append((e.start_ns(), e.start_ns() + dur, 0))
    if cpu_ops is not None:
        for k, dur, calls in cpu_ops:
            c = categorize(k)
            cats[c] = cats.get(c, 0) + dur
            names[k] = (dur, calls)
        busy, gaps, span, waited = sum(cats.values()), [], wall_ns, 0
    elif not kernels:
        return {"wall_ms_per_step": wall * 1e3 / n, "note": "no CUDA events"}
    else:
        busy, gaps = _union_ns([(s, e, i) for s, e, i, _ in kernels])
        span = max(e for _, e, _, _ in kernels) - min(s for s, _, _, _ in kernels)
        waited = _union_ns(waits)[0]
    total = sum(cats.values())
    floor = total / 1e6 / n
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:15]
    by_size = sorted(cats.items(), key=lambda kv: -kv[1])
    gaps = sorted(((g, kernels[a][3], kernels[b][3]) for g, a, b in gaps), key=lambda g: -g[0])
    out = {
        "steps": n, "kernels": "cpu aten ops (self time)" if cpu_ops is not None else "cuda",
        "wall_ms_per_step": wall * 1e3 / n, "kernel_ms_per_step": floor,
        "gpu_span_ms_per_step": span / 1e6 / n, "gpu_busy_ms_per_step": busy / 1e6 / n,
        "gpu_busy_frac_of_wall": busy / wall_ns, "gpu_idle_frac_of_wall": 1 - busy / wall_ns,
        "gpu_idle_frac_of_span": 1 - busy / span if span else 0.0,
        "host_ms_per_step": max(0.0, wall_ns - waited) / 1e6 / n, "host_wait_ms_per_step": waited / 1e6 / n,
        "floor_ms": floor, "floor_ratio": wall * 1e3 / n / floor if floor else None,
        "kernel_ms_per_step_by_category": {k: round(v / 1e6 / n, 2) for k, v in by_size},
        "kernel_share_by_category": {k: round(v / total, 4) for k, v in by_size} if total else {},
        "top_kernels": [{"name": k, "ms_per_step": round(t / 1e6 / n, 3), "calls_per_step": c / n}
                        for k, (t, c) in top],
        "runtime_calls_per_step": {k: {"calls": c / n, "ms": round(t / 1e6 / n, 3)} for k, (t, c) in runtime.items()},
        "idle_gaps_over_1ms_ms_per_step": round(sum(g[0] for g in gaps if g[0] > 1e6) / 1e6 / n, 2),
        "largest_idle_gaps": [{"ms": round(g / 1e6, 2), "after": a, "before": b} for g, a, b in gaps[:12]],
    }
    if flops and all(f is not None for f in flops):
        per_step = sum(flops) / n
        out.update(flops_per_step=per_step, mfu_profiled=per_step / (wall / n) / PEAK_BF16,
                   mfu_at_floor=per_step / (floor / 1e3) / PEAK_BF16 if floor else None)
    return out


def summary(prof: dict) -> dict:
    """The profile's headline numbers (the PROFILE line a plan's log shows)."""
    keys = ("wall_ms_per_step", "kernel_ms_per_step", "gpu_idle_frac_of_wall", "host_ms_per_step", "floor_ms",
            "floor_ratio", "mfu_profiled", "mfu_at_floor", "idle_gaps_over_1ms_ms_per_step")
    out = {k: float(f"{prof[k]:.4g}") if isinstance(prof.get(k), float) else prof.get(k) for k in keys if k in prof}
    out["top_categories_ms"] = dict(list(prof.get("kernel_ms_per_step_by_category", {}).items())[:4])
    return out


def count_syncs(step_fn, batch) -> list:
    """Host syncs of one step, by the Python line that caused them (torch.cuda sync debug mode)."""
    if not torch.cuda.is_available():
        return []
    sync()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            step_fn(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sync()
    where: dict = {}
    for x in w:
        if "synchroniz" in str(x.message).lower():
            k = f"{os.path.relpath(x.filename) if x.filename.startswith('/') else x.filename}:{x.lineno}"
            where[k] = where.get(k, 0) + 1
    return sorted(where.items(), key=lambda kv: -kv[1])


def batch_flops(batch) -> float | None:
    """A batch's model FLOPs from the ``stats`` its collate added (``workloads.StatsCollate``)."""
    return batch["stats"].get("flops") if isinstance(batch, dict) and isinstance(batch.get("stats"), dict) else None


def diagnose(exp: dict, step_fn, batches, flops_of=batch_flops) -> dict:
    """The diagnostics an experiment asked for, run after its timed steps.

    Args:
        exp: the experiment; ``syncs``, ``profile``, ``gaps`` select the diagnostics and
            ``profile_steps`` (default 3) how many steps are profiled.
        step_fn: one training step, ``step_fn(batch)``.
        batches: an iterator of batches (the first one is a warm-up step); best the timed
            steps' own (``measure.TimedLoss(keep=...)``), whose shapes are compiled already.
        flops_of: ``batch -> model FLOPs`` (None: unknown), read before the steps run.
    """
    out: dict = {}
    if not (exp.get("profile") or exp.get("syncs") or exp.get("gaps")):
        return out
    got = [next(batches) for _ in range(exp.get("profile_steps", 3) + 1)]
    flops = [flops_of(b) for b in got[1:]]
    step_fn(got[0])
    if exp.get("syncs"):
        out["syncs"] = count_syncs(step_fn, got[0])
    if exp.get("profile"):
        out["profile"] = profile_steps(step_fn, got[1:], flops)
    if exp.get("gaps"):
        try:  # a diagnostic: its failure must not lose the timed result
            out["gaps"] = gap_owners(step_fn, got[1:3])
        except Exception as e:  # noqa: BLE001
            out["gaps"] = f"{type(e).__name__}: {e}"
    return out
