"""Every optimizer backend on this machine's device, run by two checkouts: the same losses, grad
norms, skips and weights, or the first differences.

The ddptrain/update/ refactor changed no arithmetic: on a GPU this checks its device paths (the
step skipped on the device with the sync-free report, the fused Triton AdamW, the host backend's
streams, fp16's scaler, the EMA) against the code before it. 20 steps of a small MLP, clipping,
one non-finite step, a checkpoint at step 10. Run from the repository root::

    git archive 7a106d0 | (mkdir -p /tmp/ref && tar -x -C /tmp/ref)
    python3 bench/check_backends.py --ref /tmp/ref --out "$OUT"    # prints SAME / DIFFERENT per set-up
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUPS = {
    "fp32": [],
    "fp32_bf16autocast": ["trainer.precision=bf16"],
    "fp16": ["trainer.precision=fp16"],
    "masters_unfused": ["trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.fused_update=false"],
    "masters_fused": ["trainer.precision=bf16", "trainer.param_dtype=bf16"],
    "masters_fused_ema": ["trainer.precision=bf16", "trainer.param_dtype=bf16", "ema.enabled=true", "ema.decay=0.5"],
    "host": ["trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.offload=cpu", "optim.offload_chunk_mb=0.01"],
    "host_accum_ema": ["trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.offload=cpu",
                       "optim.offload_chunk_mb=0.01", "trainer.grad_accum_steps=2", "ema.enabled=true"],
}
WORKER = r'''
import json, sys, torch, torch.nn as nn, ddptrain
out, extra = sys.argv[1], sys.argv[2:]
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.net = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))
    def forward(s, x): return s.net(x).squeeze(-1)
def loss(model, b):
    pred = model(b["x"]); m = torch.arange(b["x"].shape[1], device=pred.device)[None] < b["lens"][:, None]
    return ((pred - b["y"]) ** 2 * m).sum(), m.sum()
g = torch.Generator().manual_seed(1)
data = []
for i in range(40):
    n, T = 4, 8 + (i % 5) * 7
    x = torch.randn(n, T, 64, generator=g); y = torch.randn(n, T, generator=g); lens = torch.randint(1, T + 1, (n,), generator=g)
    if i == 13: x[0, 0, 0] = float("inf")  # a non-finite step: skipped
    data.append({"x": x, "y": y, "lens": lens})
cfg = ddptrain.load_config(None, [f"trainer.output_dir={out}", "logging.progress_bar=false", "trainer.max_steps=20",
    "optim.lr=0.01", "trainer.clip_grad_norm=0.5", "checkpoint.every_steps=10", "checkpoint.keep_last=0", *extra])
torch.manual_seed(0)
losses = []
with ddptrain.Trainer(M(), loss, cfg, data) as t:
    real = t.train_step
    def step(mb):
        o = real(mb); losses.append([o["loss_sum"], o["grad_norm"], o["stepped"]]); return o
    t.train_step = step
    t.fit()
    w = {k: v.float().sum().item() for k, v in t.module.state_dict().items()}
print("RESULT" + json.dumps({"losses": losses, "w": w}))
'''


def run(code, name, extra, out):
    """One set-up's run in a fresh process importing ``code``'s ddptrain: its result, or its error."""
    env = dict(os.environ, PYTHONPATH=code)
    p = subprocess.run([sys.executable, "-c", WORKER, os.path.join(out, name), *extra], env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    return {"error": (p.stderr or p.stdout)[-3000:]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", required=True, help="the reference checkout's root (its ddptrain/ is imported)")
    p.add_argument("--out", required=True, help="a folder for the runs and compare.json")
    p.add_argument("--only", default="", help="comma-separated set-ups (default: all)")
    args = p.parse_args()
    out = args.out
    report = {}
    for name, extra in SETUPS.items():
        if args.only and name not in args.only.split(","):
            continue
        old = run(args.ref, name + "_old", extra, out)
        new = run(ROOT, name + "_new", extra, out)
        same = "error" not in old and old == new
        report[name] = {"same": same, "old": old, "new": new}
        print(name, "SAME" if same else "DIFFERENT", (old.get("error") or "")[-500:], (new.get("error") or "")[-1500:], flush=True)
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
