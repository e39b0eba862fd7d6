"""GLM-ASR-Nano-2512 on N GPUs: bench_glmasr.py's peers under torchrun, one row for all ranks.

(In bench/multi/ rather than bench/: tests/test_bench.py pins the list of bench/*.py modules.)

bench_glmasr.py measures one GPU: its ddptrain loader is rank 0 of 1 and its HF model is built
on ``cuda:0``. Here every rank runs the same peer on its own GPU and its own share of the data
(ddptrain: rank r of N of the bucketed plan; the HF Trainer shards its random batches itself,
under DDP or DeepSpeed ZeRO-2), and rank 0 appends one row to ``--out``: samples/s and audio-s/s
summed over the ranks over the slowest rank's timed span, MFU per GPU, every GPU's peak memory
(``peak_alloc_gb_per_gpu``) and every rank's own samples/s. Same row on one GPU (plain python),
so a scaling efficiency is a ratio of two rows of one call.

    torchrun --nproc_per_node=4 bench/multi/glmasr.py --peer ddptrain_bf16_compile --out r.jsonl
    torchrun --nproc_per_node=4 bench/multi/glmasr.py --peer hf_ds2 --out r.jsonl
    python bench/multi/glmasr.py --peer hf_ds2 --out r.jsonl          # one GPU
    torchrun --nproc_per_node=2 bench/multi/glmasr.py --peer ddptrain --preset tiny --batch 2 \\
        --warmup 1 --steps 2 --workers 0 --out /tmp/r.jsonl                    # CPU dry run (gloo)

Every other option is bench_glmasr.py's (``--batch`` is per GPU, ``--ov=k=v`` adds a ddptrain
override). This process has no timeout of its own: bench/gpu_session.py's plans ``glmasr2`` and
``glmasr4`` launch it with one per launch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import bench_glmasr as bg  # noqa: E402
from measure import world  # noqa: E402

from ddptrain.dist import teardown  # noqa: E402


def shard_bench_glmasr(rank: int, world_size: int, local: int) -> None:
    """Points bench_glmasr's one-GPU set-up at this rank: its device (bench_glmasr builds on the
    current one) and its share of ddptrain's batches (bench_glmasr asks for rank 0 of 1)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    one_gpu = bg.fg.build_synthetic_loader

    def sharded(cfg, layout, vocab, _world_size, _rank, *args, **kw):
        return one_gpu(cfg, layout, vocab, world_size, rank, *args, **kw)

    bg.fg.build_synthetic_loader = sharded


def combine(rows: list[dict], world_size: int) -> dict:
    """One row for all ranks: totals (samples_per_step too) over the slowest rank's time, MFU
    and memory per GPU; ``batch`` stays per GPU."""
    elapsed = max(r["elapsed_s"] for r in rows)
    n = sum(r["samples_per_step"] * r["steps"] for r in rows)
    audio = sum(r["audio_s_per_s"] * r["elapsed_s"] for r in rows)
    flops = sum(r["tflops"] * 1e12 * r["elapsed_s"] for r in rows)
    tflops_per_gpu = flops / elapsed / world_size / 1e12
    return dict(rows[0], world_size=world_size, elapsed_s=elapsed, samples_per_s=n / elapsed,
                audio_s_per_s=audio / elapsed, samples_per_step=n / rows[0]["steps"], tflops=tflops_per_gpu, tflops_per_gpu=tflops_per_gpu,
                mfu=tflops_per_gpu * 1e12 / bg.PEAK_BF16,
                peak_alloc_gb=max((r["peak_alloc_gb"] or 0.0) for r in rows) if rows[0]["peak_alloc_gb"] is not None else None,
                peak_alloc_gb_per_gpu=[r["peak_alloc_gb"] for r in rows],
                peak_reserved_gb_per_gpu=[r["peak_reserved_gb"] for r in rows],
                samples_per_s_per_rank=[r["samples_per_s"] for r in rows],
                audio_s_per_rank=[round(r["audio_s_per_s"] * r["elapsed_s"], 2) for r in rows],
                date=datetime.date.today().isoformat())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", required=True, help="a bench_glmasr.py peer (hf, hf_ds2, ddptrain_bf16_compile, ...)")
    p.add_argument("--out", required=True, help="JSON-lines file; rank 0 appends the row")
    p.add_argument("--tmp", default="", help="scratch folder shared by the ranks (run folders)")
    a, rest = p.parse_known_args(argv)
    rank, world_size, local = world()
    shard_bench_glmasr(rank, world_size, local)
    if bg.base_peer(a.peer) == "hf_ds2" and "WORLD_SIZE" not in os.environ:
        # DeepSpeed wants a process group even on one GPU: a group of one, as torchrun would make
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
    # the ranks of one launch share a parent (torchrun's agent), so they agree on this folder
    tmp = a.tmp or os.path.join(tempfile.gettempdir(), f"bench_glmasr_multi_{os.getppid()}")
    os.makedirs(tmp, exist_ok=True)
    row_file = os.path.join(tmp, f"{a.peer}_rank{rank}.json")
    bg.main(["--peer", a.peer, "--row", row_file, "--tmp", tmp, *rest])
    with open(row_file) as f:
        row = json.load(f)
    rows = [row]
    if world_size > 1:  # the peer's own process group (ddptrain's, accelerate's or DeepSpeed's)
        rows = [None] * world_size
        torch.distributed.all_gather_object(rows, row)
    if rank == 0:
        with open(a.out, "a") as f:
            f.write(json.dumps(combine(rows, world_size)) + "\n")
        print("RESULT", json.dumps({k: combine(rows, world_size)[k] for k in (
            "peer", "world_size", "samples_per_s", "mfu", "peak_alloc_gb_per_gpu")}), flush=True)
    teardown()  # a collection before the group goes: gloo can abort at exit otherwise (ddptrain/dist.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
