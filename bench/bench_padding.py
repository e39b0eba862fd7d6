"""Padding and batch shape: DurationBucketSampler vs. random fixed-size vs. HF group_by_length.

Why this benchmark: padding is compute the GPU spends on zeros, and a batch whose padded size
swings with its longest utterance is what makes memory peaks (and OOMs) unpredictable. Both are
properties of the *sampler*, so they can be measured without audio: only durations are needed.

Data: ``--n`` durations from a lognormal with median ``--median`` s and shape ``--sigma``,
clipped to [1, 35] s (LibriSpeech-like: most utterances 10-16 s, a tail of short ones).

Baselines, given the same average utterances per batch as DurationBucketSampler:
* random fixed-size: shuffle, cut into batches of B;
* HF ``group_by_length`` (transformers' ``get_length_grouped_indices``): shuffle, cut into
  mega-batches of 50 * B, sort each by length (descending), cut into batches of B, put the
  batch with the longest utterance first.

Columns: padding % (padded seconds that are zeros), padding % in frames after rounding T up to
a multiple of 8 at 100 frames/s, mean and max padded batch seconds (B * longest: memory),
batches per epoch, lag-1 autocorrelation of the batch mean duration in batch order (about 0 =
batch order shuffled, about 1 = sorted), and the share of epoch-1 batches that already existed
in epoch 0 (0 = compositions change every epoch).

Run::

    python bench/bench_padding.py                  # the table in BENCHMARKS.md
    python bench/bench_padding.py --sigma 0.8      # a wider duration distribution
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddptrain.data.sampler import DurationBucketSampler  # noqa: E402


def durations(n: int, median: float, sigma: float, seed: int) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(np.log(median), sigma, n), 1.0, 35.0)


def random_fixed(d: np.ndarray, b: int, epoch: int) -> list[np.ndarray]:
    idx = np.random.default_rng([1, epoch]).permutation(d.size)
    return np.split(idx, range(b, d.size, b))


def group_by_length(d: np.ndarray, b: int, epoch: int, mega: int = 50) -> list[np.ndarray]:
    idx = np.random.default_rng([2, epoch]).permutation(d.size)
    batches = []
    for m in np.split(idx, range(mega * b, d.size, mega * b)):
        m = m[np.argsort(-d[m], kind="stable")]
        batches += np.split(m, range(b, m.size, b))
    longest = int(np.argmax([d[x].max() for x in batches]))
    batches[0], batches[longest] = batches[longest], batches[0]
    return batches


def bucket_sampler(d: np.ndarray, epoch: int, **kw) -> list[np.ndarray]:
    s = DurationBucketSampler(d, seed=0, **kw)
    s.set_epoch(epoch)
    return [np.asarray(x) for x in s]


def measure(d: np.ndarray, make) -> dict:
    e0, e1 = make(0), make(1)
    sizes = np.array([x.size for x in e0])
    longest = np.array([d[x].max() for x in e0])
    real = d.sum()
    padded = (sizes * longest).sum()
    frames = np.ceil(longest * 100 / 8) * 8  # T rounded up to a multiple of 8 at 100 frames/s
    real_frames = np.floor(d * 100).sum()
    means = np.array([d[x].mean() for x in e0])
    same = {tuple(sorted(x.tolist())) for x in e0} & {tuple(sorted(x.tolist())) for x in e1}
    return {
        "pad": 1 - real / padded,
        "pad_frames": 1 - real_frames / (sizes * frames).sum(),
        "mean_padded_s": float((sizes * longest).mean()),
        "max_padded_s": float((sizes * longest).max()),
        "batches": len(e0),
        "mean_bs": float(sizes.mean()),
        "autocorr": float(np.corrcoef(means[:-1], means[1:])[0, 1]),
        "repeat": len(same) / len(e1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--median", type=float, default=12.0)
    p.add_argument("--sigma", type=float, default=0.5)
    p.add_argument("--max-duration", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    d = durations(a.n, a.median, a.sigma, a.seed)
    print(f"{a.n} durations, lognormal median {a.median}s sigma {a.sigma}, clipped to [1, 35]s: "
          f"mean {d.mean():.2f}s, p5 {np.percentile(d, 5):.2f}s, p95 {np.percentile(d, 95):.2f}s, "
          f"max_duration {a.max_duration}s per batch\n")
    ours = dict(max_duration=a.max_duration, num_buckets=30, sort_pool=8)
    ref = measure(d, lambda e: bucket_sampler(d, e, **ours))
    b = max(1, int(round(ref["mean_bs"])))
    rows = [
        ("DurationBucketSampler (30 buckets, sort_pool 8)", ref),
        ("DurationBucketSampler (30 buckets, sort_pool 0)",
         measure(d, lambda e: bucket_sampler(d, e, max_duration=a.max_duration, num_buckets=30, sort_pool=0))),
        ("DurationBucketSampler (30 buckets, quadratic 30)",
         measure(d, lambda e: bucket_sampler(d, e, quadratic_duration=30, **ours))),
        (f"random fixed-size (B={b})", measure(d, lambda e: random_fixed(d, b, e))),
        (f"HF group_by_length (B={b}, mega-batch 50)", measure(d, lambda e: group_by_length(d, b, e))),
    ]
    print("| sampler | padding | padding (frames, T%8) | padded s/batch mean | max | batches | mean B "
          "| order autocorr | batches repeated next epoch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {100 * r['pad']:.2f}% | {100 * r['pad_frames']:.2f}% | {r['mean_padded_s']:.1f} | "
              f"{r['max_padded_s']:.1f} | {r['batches']} | {r['mean_bs']:.1f} | {r['autocorr']:+.2f} | "
              f"{100 * r['repeat']:.1f}% |")
    for n in (a.n, 1_000_000):
        dd = durations(n, a.median, a.sigma, a.seed)
        t = time.perf_counter()
        s = DurationBucketSampler(dd, world_size=8, rank=0, **ours)
        t_init = time.perf_counter() - t
        t = time.perf_counter()
        len(s)
        t_plan = time.perf_counter() - t
        print(f"\nplan cost, {n} utterances: buckets {1000 * t_init:.0f} ms, one epoch's plan "
              f"(= the whole cost of a mid-epoch resume) {1000 * t_plan:.0f} ms")


if __name__ == "__main__":
    main()
