"""GPU check of ``optim.offload=cpu``: the same losses as the on-device update, and the host step's cost.

1. A small bf16 transformer trained 20 steps twice on the GPU, masters on the device (fused CUDA
   AdamW) and offloaded (fused CPU AdamW): the losses must agree to bf16 rounding (the two fused
   kernels differ in the last bits of fp32, which bf16 weights mostly hide).
2. The host update alone, at ``--params`` trainable parameters (GLM-ASR-Nano-2512: 2.14e9): the
   wall time of :meth:`OffloadedMasters.step` (gradients down, fused CPU AdamW in chunks, weights
   up) against the sum of its parts measured separately.

    python3 bench/check_offload.py --out rows.jsonl [--params 2.14e9] [--threads 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ddptrain  # noqa: E402
from ddptrain.update.host import OffloadedMasters  # noqa: E402


class Tiny(nn.Module):
    def __init__(self, d=512, layers=4, vocab=1000):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True), layers)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def lm_loss(model, batch):
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"), batch[:, 1:].numel()


def losses(tmp: str, name: str, *extra: str) -> list:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 1000, (8, 129), generator=gen) for _ in range(20)]
    cfg = ddptrain.load_config(None, [f"trainer.output_dir={tmp}/{name}", "trainer.max_steps=20", "logging.progress_bar=false",
                                      "logging.tensorboard=false", "checkpoint.save_at_end=false", "trainer.precision=bf16",
                                      "trainer.param_dtype=bf16", "trainer.clip_grad_norm=1.0", "optim.lr=3e-4", *extra])
    out = []
    with ddptrain.Trainer(Tiny(), lm_loss, cfg, data) as trainer:
        step = trainer.train_step
        trainer.train_step = lambda micro: (lambda o: (out.append(o["loss_sum"] / o["units"]), o)[1])(step(micro))
        trainer.fit()
    return out


def host_step(n_params: float, chunk_mb: float) -> dict:
    """Time OffloadedMasters.step on a model of n_params in 1024 x 4096 matrices."""
    rows = int(n_params // (1024 * 4096))
    model = nn.ParameterList([nn.Parameter(torch.randn(1024, 4096, device="cuda") * 0.02) for _ in range(rows)])
    master = OffloadedMasters(model, torch.bfloat16, chunk_mb)
    opt = torch.optim.AdamW([master.to_master[p] for p in model], lr=1e-5, fused=True)
    for p in model:
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        t = time.perf_counter()
        master.step(opt, 1.0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    # the parts alone: the download, the optimizer over all masters at once, the upload
    flat = [b for b in master.own][0]
    torch.cuda.synchronize()
    t = time.perf_counter()
    flat.staging.copy_(flat.flat, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t
    for m in opt.param_groups[0]["params"]:
        m.grad = torch.zeros_like(m)
    t = time.perf_counter()
    opt.step()
    adam_s = time.perf_counter() - t
    return {"workload": "offload_host_step", "peer": "ddptrain_offload", "world_size": 1, "params": rows * 1024 * 4096,
            "chunk_mb": chunk_mb, "threads": torch.get_num_threads(), "step_s": times, "step_s_best": min(times[1:]),
            "one_copy_s": copy_s, "adam_all_at_once_s": adam_s,
            "pinned_host_gb": master.host_bytes() / 1e9, "device": torch.cuda.get_device_name(0)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--params", type=float, default=2.14e9)
    p.add_argument("--chunk-mb", type=float, default=256.0)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dev = losses(tmp, "device")
        off = losses(tmp, "offload", "optim.offload=cpu")
    worst = max(abs(a - b) / abs(a) for a, b in zip(dev, off))
    rows.append({"workload": "offload_equivalence", "peer": "ddptrain_offload", "world_size": 1, "steps": len(dev),
                 "loss_device": dev, "loss_offload": off, "max_rel_loss_diff": worst})
    print(f"losses on the device {dev[0]:.4f} -> {dev[-1]:.4f}, offloaded {off[0]:.4f} -> {off[-1]:.4f}, "
          f"max relative difference {worst:.2e}", flush=True)
    rows.append(host_step(args.params, args.chunk_mb))
    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
