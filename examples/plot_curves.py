"""Plot a run's logged scalars (metrics.jsonl) to a PNG: training loss, learning rate, eval WER/CER.

    python examples/plot_curves.py runs/asr_demo/base runs/asr_demo/accent --out docs/asr_demo_curves.png

Needs matplotlib (not a ddptrain dependency: `pip install matplotlib`). TensorBoard shows the same
scalars live: `tensorboard --logdir runs/asr_demo`.
"""

import argparse
import json
import os
import sys

try:
    import matplotlib
except ImportError:  # not a ddptrain dependency: say so in one line instead of a traceback
    sys.exit("examples/plot_curves.py needs matplotlib, which the set-up does not install: pip install matplotlib")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="run folders (consecutive stages are drawn one after another)")
    ap.add_argument("--out", default="curves.png")
    args = ap.parse_args()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    offset = 0
    for run in args.runs:
        recs = read(run)
        name = os.path.basename(os.path.normpath(run))
        train = [r for r in recs if r["split"] == "train"]
        evals = [r for r in recs if r["split"] == "eval"]
        axes[0].plot([offset + r["step"] for r in train], [r["loss"] for r in train], label=f"{name} train loss / token")
        axes[1].plot([offset + r["step"] for r in train], [r["lr"] for r in train], label=name)
        for key in ("wer", "cer"):
            axes[2].plot([offset + r["step"] for r in evals], [100 * r[key] for r in evals], marker="o",
                         label=f"{name} dev {key.upper()}")
        offset += max((r["step"] for r in recs), default=0)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    for ax, title in zip(axes, ("training loss (CTC, per token)", "learning rate", "dev WER / CER (%)")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
