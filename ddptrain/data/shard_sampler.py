"""ShardWindowSampler: DurationBucketSampler's batches, planned within windows of shards.

Why: DurationBucketSampler draws every batch from the whole corpus, so over shards each batch
reads from anywhere: random reads over every shard, every shard open in every worker. This
sampler keeps what DurationBucketSampler promises and confines reading to a few shards at a time.

The trade-off, chosen here: the *buckets* stay global -- edges and batch sizes are computed once
from every utterance, exactly as DurationBucketSampler does -- but *which* utterances share a
batch is decided within a window of ``window_shards`` shards. Per epoch, with
``rng = default_rng([seed, epoch, 1])``:

1. The shards are shuffled and the epoch's utterances are taken in that shard order, cut into
   ``ceil(shards / window_shards)`` windows of equal size. Utterances not in a shard (manifest
   sources mixed with shard sources) are spread over the windows at random. With several
   sources (``sources``), each source is cut into the same number of windows, so every window
   holds each source in its share of the epoch.
2. Window by window, each bucket takes the window's utterances of that bucket (shuffled) after
   the ones it carried over, cuts as many whole sort pools as it can (``sort_pool`` batches,
   rounded up to runs of ``G`` batches; ``G`` = world size with ``sync_buckets``, else 1), sorts
   each pool by duration and cuts it into batches; the rest is carried to the next window. The
   window's runs of ``G`` batches are shuffled and appended to the epoch. So a window's batches
   read that window's shards, plus what a bucket carried from the windows before.
3. After the last window, what every bucket still carries (fewer than ``G`` batches' worth) is
   cut into batches and grouped like DurationBucketSampler's left-over batches; the tail policy,
   the deal to ranks, resume and resharding are DurationBucketSampler's own.

What this keeps: each bucket still yields ``ceil(utterances / batch size)`` batches, so the epoch
has exactly as many batches as DurationBucketSampler would plan (the same every epoch: exact LR
schedules), equal on every rank; padding is that of the same pool sorting, since pools are
whole (BENCHMARKS.md: equal to the global plan's to 0.1 points); the plan is a pure function of
``(seed, epoch, index)``, so a resume is exact and O(plan), and a state may be resumed on another
world size. What it gives up: an utterance's batch-mates come from its own window (and the ones
a sparse bucket carried), not from the whole corpus, and the order of the epoch follows the
shuffled shards (why the shard writer shuffles utterances into shards by default).
``window_shards = 0``, or no shard information, is DurationBucketSampler's global plan exactly.

Sizing: a bucket fills a pool in every window when a window holds about ``num_buckets x
max(sort_pool, G) x max_duration`` seconds of audio (30 buckets, pools of 8, 200 s: 13 hours, four
shards of 1,000 ten-second utterances); smaller windows still work, but sparse buckets then carry
utterances over several windows, and more shards are being read at a time.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import numpy as np

from ddptrain.data.sampler import DurationBucketSampler, padded_cost


class ShardWindowSampler(DurationBucketSampler):
    """Batch sampler over utterances stored in shards (see the module docstring).

    Args:
        durations: seconds per utterance, indexed like the dataset.
        shards: shard number of each utterance (``-1``: not in a shard), or None.
        window_shards: shards per planning window; 0 = DurationBucketSampler's global plan.
        sources: source number of each utterance (for mixing, ddptrain/data/mix.py), or None.
        **kwargs: DurationBucketSampler's settings (max_duration, num_buckets, sort_pool,
            sync_buckets, shuffle, tail, seed, world_size, rank, ...).

    Raises:
        ValueError: DurationBucketSampler's, or ``shards`` / ``sources`` not one per utterance.
    """

    def __init__(self, durations: Sequence[float], shards: Optional[Sequence[int]] = None, window_shards: int = 4,
                 sources: Optional[Sequence[int]] = None, **kwargs):
        super().__init__(durations, **kwargs)
        n = self.durations.size
        self.shards = self._per_utterance(shards, "shards", n)
        self.sources = self._per_utterance(sources, "sources", n)
        if int(window_shards) != window_shards or window_shards < 0:
            raise ValueError(f"window_shards must be an integer >= 0, got {window_shards!r}")
        self.window_shards = int(window_shards)
        self._bucket_of = np.empty(n, dtype=np.int64)
        for b, members in enumerate(self._buckets):
            self._bucket_of[members] = b
        h = hashlib.blake2b(digest_size=8)
        for a in (self.shards, self.sources):
            h.update(b"-" if a is None else a.tobytes())
        self._layout_fingerprint = h.hexdigest()

    @staticmethod
    def _per_utterance(values, name: str, n: int) -> Optional[np.ndarray]:
        if values is None:
            return None
        a = np.asarray(values, dtype=np.int64)
        if a.shape != (n,) or (a < -1).any():
            raise ValueError(f"{name} must be one integer >= -1 per utterance ({n}), got shape {a.shape}")
        return a

    @property
    def windowed(self) -> bool:
        """Whether batches are planned within windows (else: DurationBucketSampler's global plan)."""
        return self.window_shards > 0 and self.shards is not None and bool((self.shards >= 0).any())

    def _epoch_members(self, epoch: int) -> list[np.ndarray]:
        """Per bucket, the utterances the epoch covers: all of them here; a weighted mix draws."""
        return self._buckets

    # ------------------------------------------------------------------ the plan
    def _base_batches(self, epoch: int, group: int) -> list[np.ndarray]:
        members = self._epoch_members(epoch)
        if not self.windowed and members is self._buckets:
            return super()._base_batches(epoch, group)
        rng = np.random.default_rng([self.seed, epoch, 1])
        windows = self._windows(members, rng)
        pending = [np.zeros(0, dtype=np.int64) for _ in self._buckets]
        out: list[np.ndarray] = []
        # a bucket cuts whole sort pools (rounded to runs of `group` batches): smaller cuts would
        # sort fewer utterances together, and padding grows
        pool_batches = group * max(1, math.ceil(self.sort_pool / group)) if self.shuffle else group
        for window in windows:  # window[b]: this window's utterances of bucket b
            runs = []
            for b, (new, bs) in enumerate(zip(window, self._bucket_batch_size)):
                idx = np.concatenate([pending[b], rng.permutation(new) if self.shuffle else new])
                full = idx.size // (pool_batches * bs) * (pool_batches * bs)
                take, pending[b] = idx[:full], idx[full:]
                batches = self._cut(take, bs)
                runs += [batches[i:i + group] for i in range(0, len(batches), group)]
            order = rng.permutation(len(runs)) if self.shuffle else range(len(runs))
            out += [b for i in order for b in runs[i]]
        leftover = [b for rest, bs in zip(pending, self._bucket_batch_size) for b in self._cut(rest, bs)]
        if group <= 1:
            return out + ([leftover[i] for i in rng.permutation(len(leftover))] if self.shuffle else leftover)
        # as DurationBucketSampler's left-over batches: by padded cost, in runs of near-equal cost
        q = self.quadratic_duration
        leftover.sort(key=lambda b: (b.size * float(padded_cost(self.durations[b].max(), q)), b[0]))
        full = len(leftover) - len(leftover) % group
        runs = [leftover[i:i + group] for i in range(0, full, group)]
        order = rng.permutation(len(runs)) if self.shuffle else range(len(runs))
        return out + [b for i in order for b in runs[i]] + leftover[full:]

    def _cut(self, idx: np.ndarray, bs: int) -> list[np.ndarray]:
        """Batches of ``bs`` (the last may be short), sorted by duration within pools first."""
        if idx.size == 0:
            return []
        if self.shuffle and self.sort_pool > 0:
            idx = self._sorted(idx, np.arange(idx.size) // (self.sort_pool * bs))
        elif not self.shuffle:
            idx = self._sorted(idx)  # evaluation: the window's utterances in increasing duration
        return np.split(idx, range(bs, idx.size, bs))

    def _windows(self, members: list[np.ndarray], rng: np.random.Generator) -> list[list[np.ndarray]]:
        """The epoch's utterances as windows x buckets (see the module docstring, step 1)."""
        items = np.concatenate(members)
        if not self.windowed:
            return [[m for m in members]]
        shard = self.shards[items]
        in_shard = shard >= 0
        used = np.unique(shard[in_shard])
        n_windows = max(1, math.ceil(used.size / self.window_shards))
        rank = np.full(self.shards.max() + 1, -1.0)  # the position of each shard in this epoch's order
        rank[used] = rng.permutation(used.size) if self.shuffle else np.arange(used.size)
        # utterances in a shard: by shard position, then in file order (their index); the others at random
        key = np.where(in_shard, rank[np.maximum(shard, 0)], rng.random(items.size) * used.size if self.shuffle
                       else items / max(1, self.durations.size) * used.size)
        source = self.sources[items] if self.sources is not None else np.zeros(items.size, dtype=np.int64)
        order = np.lexsort((items, key, source))
        window = np.empty(items.size, dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, source[order][1:] != source[order][:-1]])
        for a, b in zip(starts, np.r_[starts[1:], items.size]):  # each source cut into n_windows equal parts
            window[order[a:b]] = np.arange(b - a) * n_windows // (b - a)
        bucket = self._bucket_of[items]
        cell = window * len(self._buckets) + bucket
        by_cell = order[np.argsort(cell[order], kind="stable")]  # within a cell: shard order, then file order
        bounds = np.searchsorted(cell[by_cell], np.arange(n_windows * len(self._buckets) + 1))
        parts = [items[by_cell[bounds[c]:bounds[c + 1]]] for c in range(n_windows * len(self._buckets))]
        return [parts[w * len(self._buckets):(w + 1) * len(self._buckets)] for w in range(n_windows)]

    # ------------------------------------------------------------------ checkpointing
    def _settings(self) -> dict:
        return {**super()._settings(), "window_shards": self.window_shards,
                "layout_fingerprint": self._layout_fingerprint}

    def __repr__(self) -> str:
        shards = 0 if self.shards is None else int(np.unique(self.shards[self.shards >= 0]).size)
        return (f"ShardWindowSampler(utterances={self.durations.size}, shards={shards}, "
                f"window_shards={self.window_shards}, buckets={len(self._buckets)}, tail={self.tail!r}, "
                f"world_size={self.world_size}, rank={self.rank})")
