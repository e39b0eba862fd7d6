"""Where a step's time goes: torch.profiler summaries, host syncs, and what the host did while the GPU idled.

Each helper takes ``step_fn(batch)``, one training step of a peer, and a few batches; the
runner calls them after the timed steps (``profile``, ``syncs``, ``gaps`` experiment keys), so
profiling never slows the steps that are timed.
"""

from __future__ import annotations

import json
import os
import time
import warnings

import torch

from measure import sync


def categorize(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "splitk")):
        return "gemm"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
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


def profile_steps(step_fn, batches: list) -> dict:
    """Run ``step_fn(batch)`` for each batch under torch.profiler (CUDA activity only) and report the
    GPU busy/idle share over the span of the steps, kernel time by category and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        for b in batches:
            step_fn(b)
        return {}
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for b in batches:
            step_fn(b)
        sync()
        wall = time.perf_counter() - t0
    ivals, cats, names, runtime, kname = [], {}, {}, {}, []
    for e in prof.profiler.kineto_results.events():
        dur = e.duration_ns()
        if e.device_type() == DeviceType.CUDA:
            s = e.start_ns()
            ivals.append((s, s + dur))
            kname.append(e.name()[:80])
            c = categorize(e.name())
            cats[c] = cats.get(c, 0) + dur
            k = e.name()[:120]
            t, n = names.get(k, (0, 0))
            names[k] = (t + dur, n + 1)
        else:
            k = e.name()
            if k.startswith("cuda") and ("Synchronize" in k or "Memcpy" in k or "StreamWait" in k):
                t, n = runtime.get(k, (0, 0))
                runtime[k] = (t + dur, n + 1)
    if not ivals:
        return {"wall_ms": wall * 1e3, "note": "no CUDA events"}
    order = sorted(range(len(ivals)), key=lambda i: ivals[i])
    busy, (cur_s, cur_e), last = 0, ivals[order[0]], order[0]
    gaps = []  # (idle ns, kernel before, kernel after): where the GPU waits for the host
    for i in order[1:]:
        s, e = ivals[i]
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, kname[last], kname[i]))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        if e >= cur_e:
            last = i
    busy += cur_e - cur_s
    ivals = [ivals[i] for i in order]
    span = ivals[-1][1] - ivals[0][0]
    total = sum(cats.values())
    n = len(batches)
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:15]
    gaps.sort(key=lambda g: -g[0])
    return {
        "steps": n, "wall_ms_per_step": wall * 1e3 / n, "gpu_span_ms_per_step": span / 1e6 / n,
        "gpu_busy_ms_per_step": busy / 1e6 / n, "gpu_idle_frac_of_wall": 1 - busy / 1e9 / wall,
        "gpu_idle_frac_of_span": 1 - busy / span,
        "kernel_ms_per_step_by_category": {k: round(v / 1e6 / n, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "kernel_share_by_category": {k: round(v / total, 4) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k, "ms_per_step": round(t / 1e6 / n, 3), "calls_per_step": c / n} for k, (t, c) in top],
        "runtime_calls_per_step": {k: {"calls": c / n, "ms": round(t / 1e6 / n, 3)} for k, (t, c) in runtime.items()},
        "idle_gaps_over_1ms_ms_per_step": round(sum(g[0] for g in gaps if g[0] > 1e6) / 1e6 / n, 2),
        "largest_idle_gaps": [{"ms": round(g / 1e6, 2), "after": a, "before": b} for g, a, b in gaps[:12]],
    }


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


def diagnose(exp: dict, step_fn, batches) -> dict:
    """The diagnostics an experiment asked for, run on fresh batches after its timed steps.

    Args:
        exp: the experiment; ``syncs``, ``profile``, ``gaps`` select the diagnostics and
            ``profile_steps`` (default 3) how many steps are profiled.
        step_fn: one training step, ``step_fn(batch)``.
        batches: an iterator of batches (the first one is a warm-up step).
    """
    out: dict = {}
    if not (exp.get("profile") or exp.get("syncs") or exp.get("gaps")):
        return out
    got = [next(batches) for _ in range(exp.get("profile_steps", 3) + 1)]
    step_fn(got[0])
    if exp.get("syncs"):
        out["syncs"] = count_syncs(step_fn, got[0])
    if exp.get("profile"):
        out["profile"] = profile_steps(step_fn, got[1:])
    if exp.get("gaps"):
        try:  # a diagnostic: its failure must not lose the timed result
            out["gaps"] = gap_owners(step_fn, got[1:3])
        except Exception as e:  # noqa: BLE001
            out["gaps"] = f"{type(e).__name__}: {e}"
    return out
