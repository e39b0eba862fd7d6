"""Check activation offload (``recompute.offload: cpu``) on a GPU: same losses, less memory, its time.

    python bench/check_activation_offload.py                  # 16 blocks, d=2048, batch 4 x 4096 frames
    python bench/check_activation_offload.py --layers 24 --batch 8 --seq 3000 --steps 6
    python bench/check_activation_offload.py --device cpu --layers 2 --d 64 --heads 2 --seq 32   # the script itself

The same training steps (AdamW, dropout on, bf16 autocast over fp32 weights, a fixed seed per
step) run five ways on one GPU, one row each: plain, plain again (is this GPU's plain run bitwise
repeatable?), offload alone (every tensor saved inside the blocks to host), recompute, and
recompute + offload (the blocks' kept inputs to host). A row gives the losses' agreement with its
reference, the peak memory of steps 2..N (weights, gradients and AdamW state included; "act" is the
peak minus what was allocated before the step), the median step time and what went to host.

Asserts: offload alone gives the plain run's losses and recompute + offload gives recompute's,
bitwise where the plain run repeats bitwise (else within twice the plain runs' own difference, at
least 1e-4 relative); recompute + offload peaks
below recompute by at least half the inputs it moved; every step gave its host blocks back.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddptrain.activation_offload import apply_offload  # noqa: E402
from ddptrain.recompute import apply_recompute  # noqa: E402

GIB = 2 ** 30


class Block(nn.Module):
    """Pre-norm transformer block (attention with dropout: the RNG must replay)."""

    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + self.drop(a)
        return x + self.ff(self.norm2(x))


class Model(nn.Module):
    def __init__(self, feat: int, d: int, layers: int, heads: int, vocab: int, p: float):
        super().__init__()
        self.proj = nn.Linear(feat, d)
        self.layers = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class _NoMemory:
    """torch.cuda's memory counters on a CPU run (the script's own smoke test): all zero."""

    def synchronize(self):
        pass

    def reset_peak_memory_stats(self):
        pass

    def memory_allocated(self):
        return 0

    def max_memory_allocated(self):
        return 0

    def empty_cache(self):
        pass


def run(name: str, base: nn.Module, args, batches: list, recompute: bool, offload: bool) -> dict:
    cuda = torch.cuda if args.device == "cuda" else _NoMemory()
    model = copy.deepcopy(base).train()
    cfg = SimpleNamespace(enabled=recompute, module_classes=["Block"], name_globs=[], every_k=1,
                          offload="cpu" if offload else "none")
    if recompute:
        apply_recompute(model, cfg)
    off = apply_offload(model, cfg, torch.device(args.device), min_bytes=args.min_kb * 1024) if offload else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    losses, times, peaks, acts, moved = [], [], [], [], []
    for step, (x, y) in enumerate(batches):
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        before = cuda.memory_allocated()
        bytes_in = off.pool.bytes_in if off else 0
        start = time.perf_counter()
        torch.manual_seed(1000 + step)  # the same dropout masks for every variant
        with torch.autocast(args.device, dtype=torch.bfloat16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
        peaks.append(cuda.max_memory_allocated())
        acts.append(cuda.max_memory_allocated() - before)
        if off:
            moved.append(off.pool.bytes_in - bytes_in)
            assert off.pool.live_bytes == 0, f"{name}: step {step} left host blocks in use"
    row = {"name": name, "losses": torch.stack(losses).cpu(), "peak": max(peaks[1:]), "act": max(acts[1:]),
           "time": statistics.median(times[1:]), "moved": statistics.median(moved) if moved else 0,
           "held": off.pool.held_bytes if off else 0, "stats": dict(off.stats) if off else {}}
    if off:
        off.remove()
    del model, opt, off
    gc.collect()  # a recomputed model is a reference cycle: free it before the next variant's "before"
    cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--min-kb", type=int, default=64, help="smaller saved tensors stay on the GPU")
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out (e.g. offload)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of this script")
    args = ap.parse_args()
    assert args.device == "cpu" or torch.cuda.is_available(), "needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    feat, vocab = 128, 512
    torch.manual_seed(0)
    base = Model(feat, args.d, args.layers, args.heads, vocab, args.dropout).to(args.device)
    gen = torch.Generator(device=args.device).manual_seed(1)
    batches = [(torch.randn(args.batch, args.seq, feat, device=args.device, generator=gen),
                torch.randint(0, vocab, (args.batch, args.seq), device=args.device, generator=gen))
               for _ in range(args.steps)]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (no memory figures)"
    print(f"{device}  torch {torch.__version__}  {args.layers} blocks d={args.d} "
          f"batch {args.batch} x {args.seq}  {sum(p.numel() for p in base.parameters()) / 1e6:.0f}M params")
    variants = [("plain", False, False, None), ("plain_again", False, False, "plain"),
                ("offload", False, True, "plain"), ("recompute", True, False, "plain"),
                ("recompute_offload", True, True, "recompute")]
    skip = set(filter(None, args.skip.split(",")))
    rows = {}
    for name, recompute, offload, _ in variants:
        if name not in skip:
            rows[name] = run(name, base, args, batches, recompute, offload)
    exact = "plain_again" in rows and torch.equal(rows["plain"]["losses"], rows["plain_again"]["losses"])
    # where the plain run does not repeat (atomics in some backward kernels), a variant may differ
    # from its reference as much as two plain runs differ from each other, twice over
    noise = ((rows["plain_again"]["losses"] - rows["plain"]["losses"]).abs() / rows["plain"]["losses"].abs()).max().item() \
        if "plain_again" in rows else 0.0
    rtol = max(1e-4, 2 * noise)
    print(f"plain repeats bitwise: {exact}; plain vs plain_again: {noise:.1e} relative; tolerance {rtol:.1e}")
    print(f"{'variant':<18} {'vs':<10} {'losses':<10} {'peak GiB':>9} {'act GiB':>8} {'step s':>7} "
          f"{'to host GiB':>11} {'pool GiB':>8}")
    failures = []
    for name, _, _, ref in variants:
        if name not in rows:
            continue
        row = rows[name]
        agree = "-"
        if ref in rows:
            a, b = row["losses"], rows[ref]["losses"]
            same = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=rtol, atol=0)
            agree = ("equal" if torch.equal(a, b) else f"{(a - b).abs().max().item():.1e}") if same else "DIFFER"
            if not same and name != "plain_again":
                failures.append(f"{name}: losses {a.tolist()} vs {ref} {b.tolist()}")
        print(f"{name:<18} {ref or '':<10} {agree:<10} {row['peak'] / GIB:>9.2f} {row['act'] / GIB:>8.2f} "
              f"{row['time']:>7.3f} {row['moved'] / GIB:>11.2f} {row['held'] / GIB:>8.2f}")
    for name in ("offload", "recompute_offload"):
        if name in rows:
            print(f"{name} stats: {rows[name]['stats']}")
    if "recompute" in rows and "recompute_offload" in rows:
        saved = rows["recompute"]["peak"] - rows["recompute_offload"]["peak"]
        moved = rows["recompute_offload"]["moved"]
        print(f"recompute_offload: peak {saved / GIB:.2f} GiB below recompute; {moved / GIB:.2f} GiB of inputs moved")
        if saved < 0.5 * moved and args.device == "cuda":
            failures.append(f"recompute_offload saves {saved / GIB:.2f} GiB of peak, less than half of the "
                            f"{moved / GIB:.2f} GiB it moved")
    print("OK" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
