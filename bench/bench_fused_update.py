"""The optimizer update of a bf16 model with fp32 masters, alone: unfused vs ``optim.fused_update``.

Unfused is what ddptrain/update/backend.py runs on a GPU: the bf16 gradients copied into fp32 master
gradients (``MasterWeights.load_grads``), torch's fused AdamW with the factor and the non-finite
flag on the device, the masters rounded into the bf16 weights (``copy_to_model``). Fused is
:class:`ddptrain.update.fused.FusedMasterAdamW`. The model is a stack of Whisper-large-sized
layers (width 1280, 4 attention projections with biases, a 5120 MLP, two LayerNorms): 78 layers
are 1.54B parameters, Whisper-large-v3's count. CUDA events over ``--iters`` updates after 3.

    python bench/bench_fused_update.py --layers 78 --out rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ddptrain.update.fused import FusedMasterAdamW  # noqa: E402
from ddptrain.optim import param_groups, step_unless  # noqa: E402
from ddptrain.precision import MasterWeights  # noqa: E402


def layer(width: int) -> nn.Module:
    return nn.ModuleList([nn.Linear(width, width) for _ in range(4)]
                         + [nn.Linear(width, 4 * width), nn.Linear(4 * width, width),
                            nn.LayerNorm(width), nn.LayerNorm(width)])


def build(layers: int, width: int, fused: bool):
    torch.manual_seed(0)
    model = nn.Sequential(*[layer(width) for _ in range(layers)]).cuda()
    master = MasterWeights(model)
    masters = {id(p): m for p, m in master.pairs}
    groups = [dict(g, params=[masters[id(p)] for p in g["params"]]) for g in param_groups(model, 0.01)]
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    for p, _ in master.pairs:
        p.grad = torch.randn_like(p)
    update = FusedMasterAdamW(opt, master) if fused else None
    return model, master, opt, update


def update_once(master, opt, update) -> None:
    """One update with a factor of 0.5 and no non-finite flag: fused if ``update``, else unfused."""
    factor = torch.tensor(0.5, dtype=torch.float64, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    if update is not None:
        update.step(factor, found_inf)
    else:
        master.load_grads(None)
        step_unless(opt, found_inf=found_inf, grad_scale=factor.reciprocal().float())
        master.copy_to_model()
        master.drop_master_grads()


def run(args, fused: bool) -> dict:
    model, master, opt, update = build(args.layers, args.width, fused)

    for _ in range(3):
        update_once(master, opt, update)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        update_once(master, opt, update)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.iters
    n = sum(m.numel() for _, m in master.pairs)
    return {"workload": "adamw_masters_update", "peer": "ddptrain_fused_update" if fused else "ddptrain_unfused",
            "world_size": 1, "num_params": n, "tensors": len(master.pairs), "ms_per_update": round(ms, 3),
            "params_per_s": n / ms * 1e3, "bytes_per_param_at_30": 30,
            "effective_tb_per_s_at_30B": round(30 * n / ms / 1e9, 3),
            "peak_alloc_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for fused in (False, True):
        row = run(args, fused)
        print("RESULT", json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    # the two paths must agree: one more update from the same start, compared
    a, b = build(2, args.width, False), build(2, args.width, True)
    for _, master, opt, update in (a, b):
        update_once(master, opt, update)
    diff = max((ma - mb).abs().max().item() for (_, ma), (_, mb) in zip(a[1].pairs, b[1].pairs))
    wdiff = max((pa.float() - pb.float()).abs().max().item() for (pa, _), (pb, _) in zip(a[1].pairs, b[1].pairs))
    print(f"CHECK max |master difference| {diff:.3e}, max |bf16 weight difference| {wdiff:.3e}")
    for row in rows:
        row.update(check_master_max_abs_diff=diff, check_weight_max_abs_diff=wdiff)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
