"""Run benchmark experiments in this process and append one JSON row each to ``--out``.

An experiment is a dict: ``name``, ``peer`` (``peers.PEERS``) and the keys in
``EXPERIMENT_KEYS``. Experiments run one after the other; one that fails writes a row with its
``error`` and the process exits 1. Run one process per GPU (torchrun) or plain python for one
GPU; ``bench/gpu_session.py`` runs whole plans, one process per experiment::

    torchrun --nproc_per_node=2 bench/run.py --workload whisper --out r.jsonl \\
        --exps '[{"name": "b24", "peer": "ddptrain", "batch": 24, "replay": 12,
                  "ov": ["trainer.param_dtype=bf16", "compile.enabled=true"]}]'
    python bench/run.py --workload conformer --preset tiny --warmup 1 --steps 2 --out /tmp/r.jsonl \\
        --exps '[{"name": "cpu", "peer": "bare", "budget": 40, "workers": 0}]'      # CPU dry run

Each row: samples/s, audio-seconds/s (real, i.e. without padding), padding fraction, model
TFLOP/s per GPU and MFU (``flops.py``), peak memory (max over ranks), data wait, step times,
the GPU's clock/temperature/power during the timed steps, and the versions and GPU it ran on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

import ddptrain
from measure import world
from peers import PEERS
from profiling import summary
from workloads import WORKLOADS

# What each key does (every one optional except name and peer). A key nothing reads (a removed
# option, a typo) is refused up front, so a stale plan fails before it costs device time.
EXPERIMENT_KEYS = {
    "name": "row name", "peer": "training loop (peers.PEERS)",
    "batch": "utterances / windows per batch and GPU (whisper; the HF peers)",
    "budget": "data.max_duration: padded seconds per batch and GPU (ddptrain, bare)",
    "ov": "ddptrain config overrides", "workers": "DataLoader workers (default 4)",
    "replay": "time a second pass over the first K batches (steady state; measure.ReplayLoader)",
    "warmup": "warm-up steps (default --warmup)", "steps": "timed steps (default --steps)",
    "sdpa": "no_cudnn: flash / memory-efficient attention kernels only",
    "attn": "HF attn_implementation (sdpa | eager)", "hf_group": "HF group_by_length sampling (wav2vec2)",
    "compile_backend": "torch.compile backend for ddptrain and hf_compile (aot_eager in CPU dry runs)",
    "as_world": "on one GPU, train on the batches of an N-GPU run (measure.Interleave)",
    "same_data": "diagnostic: every rank trains on rank 0's batches",
    "nocomm": "diagnostic: DDP comm hook that skips the all-reduce (ranks then train apart)",
    "ddp1": "diagnostic: one GPU under torchrun, i.e. a DDP group of one (gpu_session.py)",
    "item_every": "bare loop: read the loss every N steps (default 10)",
    "bucket_view": "bare loop: DDP gradient_as_bucket_view",
    "profile": "torch.profiler summary of a few steps after the timed ones (kernel time, idle, host, floor)",
    "profile_steps": "steps profiled (default 3)", "syncs": "host syncs of one step, by source line",
    "gaps": "host work during the longest GPU idle gaps",
}


def check_experiments(exps: list) -> None:
    """Checks a list of experiments before any of them runs.

    Raises:
        ValueError: naming the experiment and key, for an unknown key or peer or a missing name.
    """
    for i, e in enumerate(exps):
        label = e.get("name", f"experiment {i}")
        if "name" not in e or "peer" not in e:
            raise ValueError(f"{label}: every experiment needs 'name' and 'peer'")
        if e["peer"] not in PEERS:
            raise ValueError(f"{label}: unknown peer {e['peer']!r} (known: {sorted(PEERS)})")
        unknown = sorted(set(e) - set(EXPERIMENT_KEYS))
        if unknown:
            raise ValueError(f"{label}: unknown experiment key(s) {unknown} (known: {sorted(EXPERIMENT_KEYS)})")


def load_experiments(arg: str) -> list:
    """``arg``: a JSON list, or ``@file.json``; checked with :func:`check_experiments`.

    Raises:
        ValueError: for JSON that is not a list of objects, or a bad experiment.
    """
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            exps = json.load(f)
    else:
        exps = json.loads(arg)
    if not isinstance(exps, list) or not all(isinstance(e, dict) for e in exps):
        raise ValueError(f"--exps {arg[:80]!r}: expected a JSON list of experiment objects")
    check_experiments(exps)
    return exps


def versions() -> dict:
    try:  # only the wav2vec2 / Whisper workloads and the HF peers need it
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {"torch": torch.__version__, "transformers": tf_version,
            "ddptrain_from": os.path.relpath(os.path.dirname(ddptrain.__file__)),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d")}


def report(rec: dict) -> None:
    """One-line summaries on stdout (gpu_session.py forwards the lines starting with these tags)."""
    short = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
             if k not in ("profile", "syncs", "ov", "gaps")}
    print("RESULT", json.dumps(short), flush=True)
    if "profile" in rec:
        pr = rec["profile"]
        print("PROFILE", rec["name"], json.dumps(dict(summary(pr), largest_idle_gaps=pr.get("largest_idle_gaps", [])[:4])),
              flush=True)
    if "syncs" in rec:
        print("SYNCS", rec["name"], json.dumps(rec["syncs"][:12]), flush=True)
    gaps = rec.get("gaps", [])
    for g in gaps if isinstance(gaps, list) else [gaps]:  # a string: the diagnostic failed
        print("GAP", rec["name"], json.dumps(g), flush=True)


def main(argv=None) -> int:
    """Runs the experiments; returns 1 when any of them failed (its row then holds the error)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--exps", required=True, help="JSON list of experiments, or @file.json")
    p.add_argument("--out", required=True, help="JSON-lines file to append results to (rank 0)")
    p.add_argument("--preset", default="large", choices=["large", "tiny"], help="tiny: small models for CPU dry runs")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tmp", default="/tmp/ddptrain_bench")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    exps = load_experiments(a.exps)
    rank, ws, local = world()
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    meta = dict(versions(), tag=a.tag)
    failed = 0
    for exp in exps:
        W, N = exp.get("warmup", a.warmup), exp.get("steps", a.steps)
        t = time.time()
        if torch.cuda.is_available():
            torch.backends.cuda.enable_cudnn_sdp(exp.get("sdpa") != "no_cudnn")
        try:
            rec = PEERS[exp["peer"]](a.workload, a.preset, exp, W, N, a.tmp)
            rec.update(meta, wall_total_s=round(time.time() - t, 1))
        except Exception as e:  # one failed experiment must not cost the others
            import traceback

            traceback.print_exc()
            rec = {"workload": a.workload, "name": exp["name"], "peer": exp["peer"], "world_size": ws,
                   "error": f"{type(e).__name__}: {str(e)[:2000]}", **meta}
            if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
                rec["oom"] = True
            failed += 1
        gc.collect()
        torch._dynamo.reset()  # every experiment compiles from scratch, no recompile limit carried over
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if rank == 0:
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            report(rec)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
