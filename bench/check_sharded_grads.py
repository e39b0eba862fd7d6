"""GPU memory check of ``optim.shard_grads``: what rank 0 of an N-rank run holds, per parameter.

One process plays rank 0 of N through torch's fake process group (its collectives do nothing, so
one GPU suffices and the numbers are what a rank holds, not how fast the ranks talk). A bf16
transformer-shaped stack (two biased linears and a LayerNorm per layer) trains a few steps under
DDP + sharded masters (``optim.zero``) and under ``optim.shard_grads``; for each N the row gives
the memory at rest (after a step) and the peak of a step, in bytes per trainable parameter, and
the reducer's peak staging.

    python3 bench/check_sharded_grads.py --out rows.jsonl [--d 2048] [--layers 48] [--worlds 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ddptrain  # noqa: E402
from ddptrain.sharded_grads import ShardedGradReducer  # noqa: E402


class Stack(nn.Module):
    def __init__(self, d: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).squeeze(-1)


def frame_loss(model, batch):
    return ((model(batch["x"]).float() - batch["y"]) ** 2).sum(), batch["y"].numel()


def _no_comm(state, bucket):  # DDP under the fake group: its buckets exist, nothing is sent
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def measure(d: int, layers: int, world: int, shard: bool, steps: int, tmp: str) -> dict:
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # CPU: a dry run, no memory figures
        model = Stack(d, layers)
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(4, 128, d, generator=gen).bfloat16(), "y": torch.randn(4, 128, generator=gen)}
            for _ in range(steps)]
    cfg = ddptrain.load_config(None, [
        f"trainer.output_dir={tmp}/{world}_{shard}", f"trainer.max_steps={steps}", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.jsonl=false", "checkpoint.save_at_end=false", "trainer.precision=bf16",
        "trainer.param_dtype=bf16", "optim.zero=true", "optim.fused=true", f"optim.shard_grads={str(shard).lower()}",
        "logging.allreduce_share=false"])  # its timing hook would take the comm-hook slot _no_comm needs
    trainer = ddptrain.Trainer(model, frame_loss, cfg, data)
    if not shard:
        trainer.model.register_comm_hook(None, _no_comm)
    reducer = trainer.model if isinstance(trainer.model, ShardedGradReducer) else None
    rest, peak, cuda = [], [], torch.cuda.is_available()
    for batch in data:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if reducer is not None:
            reducer.reset_peak()
        trainer.train_step([batch])
        if cuda:
            torch.cuda.synchronize()
        peak.append(torch.cuda.max_memory_allocated() if cuda else 0)
        rest.append(torch.cuda.memory_allocated() if cuda else 0)
    row = {"check": "sharded_grads", "world_size": world, "shard_grads": shard, "params": n,
           "rest_bytes_per_param": round(rest[-1] / n, 3), "peak_bytes_per_param": round(max(peak[1:]) / n, 3),
           "first_step_peak_bytes_per_param": round(peak[0] / n, 3),
           "peak_staging_bytes": reducer.peak_staged * 2 if reducer else None,
           "buckets": len(reducer.buckets) if reducer else None,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    trainer.close()
    del trainer, model, reducer
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = p.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a") as out:
        for world in args.worlds:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            for shard in (False, True):
                row = measure(args.d, args.layers, world, shard, args.steps, tmp)
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
