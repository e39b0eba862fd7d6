"""compile.cuda_graphs on one GPU: same losses as eager for N steps, and the step time of each.

A host-bound workload by construction: a stack of small transformer encoder layers (``--layers``,
``--dim``) over length-bucketed batches of a few shapes (batch sizes x lengths of ``--shapes``),
trained by ddptrain.Trainer (bf16 autocast, bf16 weights with fp32 masters, fused AdamW, two
micro-batches a step, dropout off) for ``--steps`` steps in each mode of ``--modes``, each mode a
fresh seeded model in this process. Rows (bench/results fields): workload, peer (the mode),
world_size, batch (tokens per micro-batch, mean), tokens_per_s (timed steps after ``--warmup``),
step_ms_median, peak_alloc_gb, peak_reserved_gb, the per-step losses, and for every mode after the
first ``loss_max_rel_diff_vs_<first>``; ``eager`` twice measures eager's own run-to-run spread.

    python3 bench/check_cuda_graphs.py --out "$OUT/cuda_graphs.jsonl"             # one GPU
    python3 bench/check_cuda_graphs.py --tiny --steps 6 --out /tmp/cg.jsonl       # CPU: the rerun backend
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ddptrain  # noqa: E402


class Stack(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(32, dim)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0,
                                                               batch_first=True) for _ in range(layers))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).squeeze(-1)


def loss_fn(model, batch):
    pred = model(batch["x"])
    mask = (torch.arange(batch["x"].shape[1], device=pred.device)[None] < batch["lens"][:, None]).float()
    return (((pred.float() - batch["y"]) ** 2) * mask).sum(), mask.sum()


def batches(n: int, shapes: list, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b, t = shapes[i % len(shapes)]
        x = torch.randn(b, t, 32, generator=gen)
        out.append({"x": x, "y": x.mean(-1), "lens": torch.randint(t // 2, t + 1, (b,), generator=gen)})
    return out


def run(mode: str, args, data: list, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = Stack(args.dim, args.layers)
    gpu = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ddptrain.load_config(None, [f"trainer.output_dir={tmp}", "logging.progress_bar=false",
                                          "logging.log_every=1000", "checkpoint.save_at_end=false",
                                          f"trainer.max_steps={args.steps}", "trainer.grad_accum_steps=2",
                                          f"trainer.precision={'bf16' if gpu else 'fp32'}",
                                          f"trainer.param_dtype={'bf16' if gpu else 'fp32'}", "optim.lr=1e-4",
                                          f"trainer.device={'cuda' if gpu else 'cpu'}",
                                          f"compile.cuda_graphs={mode == 'cuda_graphs'}"])
        trainer = ddptrain.Trainer(model, loss_fn, cfg, data)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        losses, times = [], []
        for s in range(args.steps):
            micro = data[2 * s % len(data): 2 * s % len(data) + 2]
            tic = time.perf_counter()
            out = trainer.train_step(micro)  # one host sync per step (the update's report)
            times.append(time.perf_counter() - tic)
            losses.append(out["loss_sum"] / max(out["units"], 1e-9))
        scalars = trainer.graphs.scalars() if trainer.graphs is not None else {}
        trainer.close()
    timed = times[args.warmup:]
    tokens = statistics.mean(int(b["x"].shape[0] * b["x"].shape[1]) for b in data)
    row = {"workload": f"stack{args.layers}x{args.dim}", "peer": mode, "world_size": 1, "batch": tokens,
           "step_ms_median": 1e3 * statistics.median(timed), "tokens_per_s": 2 * tokens * len(timed) / sum(timed),
           "losses": losses, **scalars}
    if gpu:
        row.update(peak_alloc_gb=torch.cuda.max_memory_allocated() / 1e9,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="eager,cuda_graphs,eager")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--shapes", default="16x128,8x256,32x64", help="BxT of the batches, in turn")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="CPU: 2 layers of 64")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.dim, args.warmup = 2, 64, min(args.warmup, 2)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    data = batches(2 * len(shapes) * 2, shapes)  # every shape in both micro-batch slots, repeated
    rows, first = [], None
    for mode in args.modes.split(","):
        row = run(mode, args, data, device)
        if first is None:
            first = row
        else:
            row[f"loss_max_rel_diff_vs_{first['peer']}"] = max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], first["losses"]))
        row.update(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   date=datetime.date.today().isoformat())
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
