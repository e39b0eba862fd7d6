"""DurationBucketSampler: batches by a budget of padded audio seconds, the same plan on every rank.

What it yields: lists of dataset indices (it is a *batch* sampler: pass it to
``DataLoader(batch_sampler=...)``). Protocol the Trainer relies on:

* ``set_epoch(epoch)`` before iterating an epoch; ``len(sampler)`` = batches (= optimizer
  micro-steps) this rank gets in that epoch, equal on every rank.
* ``state_dict()`` / ``load_state_dict(state)``: exact mid-epoch resume. ``state["epoch"]`` and
  ``state["position"]``, where position = batches of the epoch already done. The DataLoader
  prefetches, so the sampler's own count runs ahead of training; the Trainer overwrites
  ``position`` with the batches it actually consumed before saving. A loaded position is used
  by the first iteration that *starts* (its first ``next()``), however many ``iter()`` calls
  come before: torch's DataLoader with workers calls ``iter()`` twice for one epoch's iterator
  and reads only the second. Once an iteration has started, the next ``iter()`` is a fresh
  pass over the epoch.
* The sampler decides which utterances a batch holds, nothing random about them: their
  augmentation is drawn by ``SpeechDataset`` from ``(seed, epoch, index)``, so a resumed run
  with fresh DataLoader workers sees the same audio (see ``SpeechDataset.set_epoch``).
* ``epoch_stats()`` -> dict: padding fraction, batch-size statistics, duplicated/dropped counts
  of the current epoch's plan (the same on every rank), for logging.

A second length per utterance (``tokens``, e.g. target tokens or a decoder's sequence length) is
optional. With it, utterances are ordered by duration and then by tokens wherever the plan sorts
them (buckets, pools), and ``max_tokens`` caps ``batch_size * most tokens in the bucket``: buckets
on both lengths, one budget each. A speech-LLM on fixed 30 s windows passes durations rounded up
to whole windows (all the same for short utterances), so its batches are grouped by decoder
length instead.

How a plan is made (all of it a pure function of ``(seed, epoch, durations, settings)``):

1. Buckets (once): utterances sorted by duration are cut into ``num_buckets`` runs that each
   hold about the same *total* duration, so no bucket is starved of batches. Bucket ``b``'s batch
   size is ``floor(max_duration / cost(longest utterance in b))`` (capped by
   ``max_batch_size``), where ``cost(d) = d``, or ``d + d*d/quadratic_duration``. The padded
   batch ``B * cost(longest)`` therefore never exceeds ``max_duration``, and because sizes are
   fixed per bucket, the number of batches is the same every epoch (exact LR schedules).
2. Per epoch, with ``rng = default_rng([seed, epoch])``: shuffle each bucket, sort the shuffled
   utterances by duration inside pools of ``sort_pool`` batches (neighbours in a batch are then
   close in length: about 4x less padding than packing the shuffled bucket, yet batch contents
   change every epoch), cut into batches, and shuffle the batch order across all buckets.
   With ``sync_buckets`` (default) and ``W = world_size > 1``, what is shuffled is runs of ``W``
   neighbouring batches of one bucket, so the ``W`` batches of a step are near-equal in length
   (each bucket's short last batch and the batches that fill no run are pooled, ordered by
   padded cost, and grouped the same way).
3. Distributed split: the epoch's global batch list is made a multiple of ``world_size`` by the
   tail policy, and rank ``r`` takes batches ``r, r + W, r + 2W, ...``. Step ``s`` of every
   rank therefore covers global batches ``[s*W, (s+1)*W)``: ranks are disjoint by construction
   and nobody waits in an all-reduce for a rank that has run out of data.

Why ``sync_buckets``: every step ends in an all-reduce, so a step lasts as long as the costliest
of its ``W`` batches. Equal padded seconds are not equal cost (attention grows with length
squared, batch sizes round down, a Whisper window's decoder length varies), and batches drawn
from random buckets cost different amounts. ``bench/bench_balance.py`` computes the share of a
step the ranks spend waiting from the plan's FLOPs: on the benchmark's wav2vec2 corpus with 2
ranks, 5.0% unsynchronised vs 0.8% synchronised (8 ranks: 10.2% vs 4.6%). On 2 H200s
(BENCHMARKS.md), every rank training on the same batches took the 2-GPU Whisper step from 570 to
546 ms. Lhotse's ``DynamicBucketingSampler(sync_buckets=True)`` does the same for the same
reason. With ``W = 1`` the plan is exactly the unsynchronised one.

Tail policies (``tail``), i.e. what happens when the number of batches ``n`` is not a multiple
of ``world_size`` ``W``:

* ``split`` (default): split the largest batches in two (halves stay within budget) until
  ``n % W == 0``. Every utterance is seen exactly once. Only if there are too few utterances to
  split (fewer utterances than needed batches, e.g. a data set smaller than ``W``) are the
  missing batches filled with copies of the first batches of the epoch.
* ``duplicate``: append copies of the first ``W - n % W`` batches of the (shuffled) epoch.
* ``drop``: drop the last ``n % W`` batches of the (shuffled) epoch, i.e. random utterances
  each epoch; a data set with fewer than ``W`` batches gives empty epochs.
* ``exact``: like ``split``, but missing batches are *empty* (``[]``) instead of copies; for
  evaluation, where a duplicate would bias the metric. Evaluation loops must skip empty batches.

Resume in O(1): the plan is rebuilt from the seed (milliseconds, durations only; no audio is
read) and iteration starts at batch ``position``. A state saved with another world size is
*resharded exactly*: the batches the old ranks had not reached are re-dealt over the new ranks
(each utterance of the epoch is still seen once under ``split``/``exact``); ``position`` keeps
counting the epoch's steps from its start, and ``len()`` of that one epoch becomes (steps done
before) + (the rest re-dealt), so a Trainer should re-read ``len(sampler)`` after loading. Other
differences (seed, data set, budget, buckets, ...) are an error that names the field.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from typing import Callable, Optional, Sequence

import numpy as np
from torch.utils.data import Sampler

from ddptrain import dist
from ddptrain.config import check_section

log = logging.getLogger(__name__)

TAILS = ("split", "duplicate", "drop", "exact")
_STATE_VERSION = 1


def padded_cost(durations, quadratic_duration: float):
    """The budget cost of utterances of ``durations`` seconds (a number or an array): ``d``, or
    ``d + d*d/quadratic_duration`` when that is > 0. A batch costs ``size * cost(longest)``."""
    d = durations
    return d + d * d / quadratic_duration if quadratic_duration > 0 else d


def speed_stretch(data_cfg, train: bool) -> float:
    """How much longer speed perturbation can make an utterance: ``1 / min(data.speed_perturb)``
    for training data, 1 without perturbation and for evaluation (never perturbed)."""
    speeds = [float(s) for s in data_cfg.speed_perturb] if train else []
    return 1.0 / min(speeds) if speeds else 1.0


def budget_lengths(durations, data_cfg, train: bool = True,
                   cost: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> np.ndarray:
    """The lengths the sampler budgets with: each manifest duration at the slowest speed
    (:func:`speed_stretch`), through the recipe's ``cost`` (seconds -> seconds of
    ``data.max_duration``, e.g. whole 30 s encoder windows) when it has one."""
    d = np.asarray(durations, dtype=np.float64) * speed_stretch(data_cfg, train)
    return d if cost is None else np.asarray(cost(d), dtype=np.float64)


def sampler_settings(data_cfg, train: bool = True, world_size: Optional[int] = None, rank: Optional[int] = None,
                     seed: Optional[int] = None) -> dict:
    """:class:`DurationBucketSampler`'s keyword arguments for a ``data:`` section: the one
    translation of the config to batching (the library's loader, the recipes and the benchmarks
    all use it, through :meth:`DurationBucketSampler.from_config`). Training data get
    ``data.shuffle`` and ``data.tail``; evaluation data are not shuffled and use the ``exact``
    tail."""
    return dict(
        max_duration=data_cfg.max_duration,
        max_batch_size=data_cfg.max_batch_size,
        quadratic_duration=data_cfg.quadratic_duration,
        num_buckets=data_cfg.num_buckets,
        sort_pool=data_cfg.bucket_sort_pool,
        sync_buckets=data_cfg.sync_buckets,
        shuffle=data_cfg.shuffle and train,
        tail=data_cfg.tail if train else "exact",
        seed=data_cfg.seed if seed is None else seed,
        world_size=dist.get_world_size() if world_size is None else world_size,
        rank=dist.get_rank() if rank is None else rank,
    )


class DurationBucketSampler(Sampler):
    """Batch sampler: duration-bucketed, budgeted by padded seconds, distributed, resumable.

    Args:
        durations: seconds per utterance, indexed like the dataset.
        max_duration: budget per batch, in (cost-)seconds of *padded* audio:
            ``batch_size * cost(longest utterance) <= max_duration``.
        max_batch_size: cap on utterances per batch; 0 = no cap.
        quadratic_duration: if > 0, ``cost(d) = d + d**2 / quadratic_duration`` so batches of
            long utterances get smaller (self-attention memory/time grows with length squared).
            Lhotse's guidance applies: 15-40 for transformers.
        tokens: optional second length per utterance (e.g. target tokens), indexed like
            ``durations``: the sort key after duration (see the module docstring).
        max_tokens: if > 0 (needs ``tokens``), also ``batch_size * most tokens <= max_tokens``
            in every batch.
        num_buckets: duration buckets, each holding about equal total duration.
        sort_pool: within a bucket, sort shuffled utterances by duration in pools of this many
            batches before cutting batches; 0 = pack the shuffled bucket as it is.
        sync_buckets: the ``world_size`` batches of each step come from the same bucket,
            neighbours in duration (see the module docstring); no effect on one rank.
        shuffle: shuffle (with ``seed`` + epoch); False = buckets in increasing duration,
            utterances sorted, the same every epoch (for evaluation).
        tail: ``split`` | ``duplicate`` | ``drop`` | ``exact``, see the module docstring.
        seed: base seed, must be the same on every rank.
        world_size: number of ranks; default: ``ddptrain.dist.get_world_size()`` (1 without a
            process group).
        rank: this rank; default: ``ddptrain.dist.get_rank()`` (0 without a process group).

    Raises:
        ValueError: bad settings, an empty data set, or an utterance that does not fit in a
            batch on its own (validate the manifest first: ``bad_data: skip`` drops those).
    """

    def __init__(
        self,
        durations: Sequence[float],
        max_duration: float,
        max_batch_size: int = 0,
        quadratic_duration: float = 0.0,
        num_buckets: int = 30,
        tokens: Optional[Sequence[float]] = None,
        max_tokens: float = 0.0,
        sort_pool: int = 8,
        sync_buckets: bool = True,
        shuffle: bool = True,
        tail: str = "split",
        seed: int = 0,
        world_size: Optional[int] = None,
        rank: Optional[int] = None,
    ):
        world_size = dist.get_world_size() if world_size is None else world_size
        rank = dist.get_rank() if rank is None else rank
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got {world_size=} {rank=}")
        if tail not in TAILS:
            raise ValueError(f"tail={tail!r} is not one of {', '.join(TAILS)}")
        if not max_duration > 0 or num_buckets < 1 or max_batch_size < 0 or sort_pool < 0 or quadratic_duration < 0:
            raise ValueError(f"need max_duration > 0, num_buckets >= 1 and non-negative max_batch_size, "
                             f"sort_pool, quadratic_duration; got {max_duration=} {num_buckets=} "
                             f"{max_batch_size=} {sort_pool=} {quadratic_duration=}")
        if int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        d = np.asarray(durations, dtype=np.float64)
        if d.ndim != 1 or d.size == 0:
            raise ValueError("durations must be a non-empty 1-D sequence (is the manifest empty, "
                             "or were all lines skipped as bad data?)")
        if not np.isfinite(d).all() or (d <= 0).any():
            raise ValueError(f"durations must be finite and > 0; bad indices: {np.flatnonzero(~(d > 0))[:10].tolist()}")
        self.tokens = None
        if tokens is not None:
            t = np.asarray(tokens, dtype=np.float64)
            if t.shape != d.shape or not np.isfinite(t).all() or (t < 0).any():
                raise ValueError(f"tokens must be finite, >= 0 and one per utterance ({d.size}), got shape {t.shape}")
            self.tokens = t
        if max_tokens < 0 or (max_tokens > 0 and self.tokens is None):
            raise ValueError(f"max_tokens={max_tokens} needs tokens (one count per utterance) and must be >= 0")
        self.max_tokens = float(max_tokens)
        self.durations = d
        self.max_duration = float(max_duration)
        self.max_batch_size = int(max_batch_size)
        self.quadratic_duration = float(quadratic_duration)
        self.num_buckets = int(num_buckets)
        self.sort_pool = int(sort_pool)
        self.sync_buckets = bool(sync_buckets)
        self.shuffle = bool(shuffle)
        self.tail = tail
        self.seed = int(seed)
        self.world_size = int(world_size)
        self.rank = int(rank)

        # identifies the data set in a checkpoint: a changed manifest cannot resume mid-epoch
        key = np.round(d, 4).tobytes() + (b"" if self.tokens is None else np.round(self.tokens, 4).tobytes())
        self._fingerprint = hashlib.blake2b(key, digest_size=8).hexdigest()

        too_long = np.flatnonzero(padded_cost(d, self.quadratic_duration) > self.max_duration)
        if too_long.size:
            raise ValueError(
                f"{too_long.size} utterance(s) do not fit in a batch of max_duration={self.max_duration}s on "
                f"their own (indices {too_long[:10].tolist()}, durations {np.round(d[too_long[:10]], 2).tolist()}); "
                f"raise max_duration or drop them (validate with bad_data=skip)")
        if self.max_tokens > 0 and (self.tokens > self.max_tokens).any():
            over = np.flatnonzero(self.tokens > self.max_tokens)
            raise ValueError(f"{over.size} utterance(s) have more than max_tokens={self.max_tokens} tokens on their "
                             f"own (indices {over[:10].tolist()}, tokens {self.tokens[over[:10]].tolist()})")
        self._buckets, self._bucket_batch_size = self._make_buckets()

        self.epoch = 0
        # reshards of the current epoch: (epoch, old world size, position at the reshard). The
        # epoch is stored with each entry because a Trainer may save at an epoch boundary with
        # state["epoch"] already advanced: an old epoch's reshard must not bend the new epoch's plan.
        self._history: list[tuple[int, int, int]] = []
        self._resume_position: Optional[int] = None  # set by load_state_dict, used up by the next iteration
        self._position = 0  # batches handed out by the current iteration (runs ahead of training)
        self._plan_cache: Optional[tuple] = None
        self._stats_cache: Optional[tuple] = None

    @classmethod
    def from_config(cls, durations, data_cfg, train: bool = True, *,
                    cost: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                    tokens: Optional[Sequence[float]] = None, max_tokens: float = 0.0,
                    world_size: Optional[int] = None, rank: Optional[int] = None, seed: Optional[int] = None,
                    **overrides) -> "DurationBucketSampler":
        """The sampler of a ``data:`` section (:func:`sampler_settings`), over lengths that
        allow for speed perturbation (:func:`budget_lengths`).

        Args:
            durations: seconds per utterance as the manifest has them, or a dataset with a
                ``durations`` array (``SpeechDataset``).
            data_cfg: the ``data:`` section (checked here, once: ``ddptrain.config.check_section``).
            train: training or evaluation batching (see :func:`sampler_settings`).
            cost: ``seconds -> seconds`` of ``data.max_duration`` an utterance uses, vectorised
                (a recipe's own, e.g. whole 30 s windows); default: its seconds.
            tokens, max_tokens: the second length per utterance and its budget (the class's).
            world_size, rank: default from ``ddptrain.dist``.
            seed: default ``data.seed``.
            **overrides: settings that replace the section's (e.g. a fixed ``max_batch_size``).

        Raises:
            ConfigError: a ``data_cfg`` value outside what ``load_config`` accepts.
            ValueError: as the class (an utterance over a budget on its own, ...).
        """
        data_cfg = check_section(data_cfg, "data")
        lengths = getattr(durations, "durations", durations)
        settings = {**sampler_settings(data_cfg, train, world_size, rank, seed), **overrides}
        return cls(budget_lengths(lengths, data_cfg, train, cost), tokens=tokens, max_tokens=max_tokens, **settings)

    # ------------------------------------------------------------------ buckets
    def _make_buckets(self) -> tuple[list[np.ndarray], list[int]]:
        d = self.durations
        order = self._sorted(np.arange(d.size))
        cum = np.cumsum(d[order])
        # cut the sorted list where the running total crosses k/num_buckets of the total: equal
        # total duration per bucket means equal numbers of batches, so no bucket runs dry first
        targets = cum[-1] * np.arange(1, self.num_buckets) / self.num_buckets
        cuts = np.unique(np.concatenate([[0], np.searchsorted(cum, targets, side="left") + 1, [d.size]]))
        cuts = cuts[(cuts >= 0) & (cuts <= d.size)]
        buckets, sizes = [], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            if b <= a:
                continue
            members = order[a:b]  # sorted by duration (then tokens), ties by index: deterministic
            bs = self._batch_size_for(float(d[members[-1]]))
            if self.max_tokens > 0:
                bs = min(bs, max(1, int(self.max_tokens // max(float(self.tokens[members].max()), 1e-9))))
            buckets.append(members)
            sizes.append(bs)
        return buckets, sizes

    def _sorted(self, idx: np.ndarray, pools: Optional[np.ndarray] = None) -> np.ndarray:
        """``idx`` stably sorted by (pool,) duration (, tokens)."""
        keys = [self.durations[idx]] + ([pools] if pools is not None else [])
        if self.tokens is not None:
            keys.insert(0, self.tokens[idx])
        return idx[np.lexsort(keys)]

    def _batch_size_for(self, longest: float) -> int:
        c = float(padded_cost(longest, self.quadratic_duration))
        bs = max(1, int(math.floor(self.max_duration / c)))
        while bs > 1 and bs * c > self.max_duration:  # guard against float rounding up
            bs -= 1
        return min(bs, self.max_batch_size) if self.max_batch_size else bs

    @property
    def bucket_edges(self) -> list[tuple[float, float]]:
        """(shortest, longest) duration of each bucket."""
        return [(float(self.durations[m[0]]), float(self.durations[m[-1]])) for m in self._buckets]

    @property
    def bucket_batch_sizes(self) -> list[int]:
        """Utterances per (full) batch in each bucket."""
        return list(self._bucket_batch_size)

    @property
    def bucket_utterances(self) -> list[int]:
        """Utterances in each bucket."""
        return [int(m.size) for m in self._buckets]

    @property
    def bucket_max_tokens(self) -> Optional[list[float]]:
        """Most tokens of an utterance in each bucket (None without ``tokens``)."""
        return None if self.tokens is None else [float(self.tokens[m].max()) for m in self._buckets]

    def pessimistic_batch(self, bucket: int, batch_size: Optional[int] = None) -> list[int]:
        """The costliest batch bucket ``bucket`` can hold, as dataset indices (for the tuner and
        the Trainer's pre-flight check): ``batch_size`` rows (default: the bucket's batch size)
        of its longest utterance and, with ``tokens``, alternately of the utterance with the most
        tokens, so the padded batch is B x longest input x longest target.

        The batch is padded as training's batches are: when all its rows have one length (or,
        with ``tokens``, one token count), the first becomes the bucket's shortest utterance (the
        padded shape stays the same). A batch without padding takes a path training never takes:
        models drop an all-ones padding mask (transformers' SDPA attention does), while masked
        attention on a GPU keeps a B x T x T bias per layer for backward, gigabytes at long inputs."""
        members = self._buckets[bucket]
        longest = int(members[-1])  # sorted by duration, then tokens
        rows = [longest]
        if self.tokens is not None:
            most = int(members[np.lexsort((self.durations[members], self.tokens[members]))[-1]])
            rows = [longest, most] if most != longest else rows
        n = self._bucket_batch_size[bucket] if batch_size is None else int(batch_size)
        batch = [rows[i % len(rows)] for i in range(n)]
        first = int(members[0])  # the shortest utterance (of those, the fewest tokens)

        def unpadded(values) -> bool:  # every row has one value, and the bucket a smaller one
            return len({float(values[r]) for r in rows}) == 1 and values[first] < values[longest]

        if n > 1 and (unpadded(self.durations) or (self.tokens is not None and unpadded(self.tokens))):
            batch[0] = first  # the other rows keep the longest input and the most tokens
        return batch

    # ------------------------------------------------------------------ the plan
    def _base_batches(self, epoch: int, group: int) -> list[np.ndarray]:
        """The epoch's global batch list, before the tail policy; identical on every rank.

        ``group`` > 1 (sync_buckets): shuffled in runs of ``group`` neighbouring batches of one
        bucket; the list then ends with the ``len % group`` batches that fit in no run.
        """
        rng = np.random.default_rng([self.seed, epoch])
        per_bucket: list[list[np.ndarray]] = []
        for members, bs in zip(self._buckets, self._bucket_batch_size):
            idx = members
            if self.shuffle:
                idx = rng.permutation(members)
                if self.sort_pool > 0:
                    idx = self._sorted(idx, np.arange(idx.size) // (self.sort_pool * bs))
            per_bucket.append(np.split(idx, range(bs, idx.size, bs)))
        if not self.shuffle or group <= 1:
            batches = [b for bucket in per_bucket for b in bucket]
            return [batches[i] for i in rng.permutation(len(batches))] if self.shuffle else batches
        runs, leftover = [], []
        for bucket, bs in zip(per_bucket, self._bucket_batch_size):
            # a bucket's last batch is usually short: it goes with the other left-over batches
            n = len(bucket) - (bucket[-1].size < bs)
            full = n - n % group
            runs += [bucket[i:i + group] for i in range(0, full, group)]
            leftover += bucket[full:]
        # the left-over batches, ordered by padded cost, make runs of near-equal cost too
        q = self.quadratic_duration
        leftover.sort(key=lambda b: (b.size * float(padded_cost(self.durations[b].max(), q)), b[0]))
        full = len(leftover) - len(leftover) % group
        runs += [leftover[i:i + group] for i in range(0, full, group)]
        return [b for i in rng.permutation(len(runs)) for b in runs[i]] + leftover[full:]

    def _plan(self) -> tuple[list[np.ndarray], list[bool], dict, int]:
        """(global batches, filler flags, tail info, steps done before the last reshard)."""
        key = (self.epoch, tuple(self._history), self.world_size)
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        # the epoch's plan was made for the world size it started with (runs of that many batches)
        group = (self._history[0][1] if self._history else self.world_size) if self.sync_buckets else 1
        batches = self._base_batches(self.epoch, group)
        done = 0
        for i, (_, old_world, old_pos) in enumerate(self._history):
            # what the old ranks had not reached yet, minus filler (copies/empties of the old tail)
            adj, filler, _ = _fit_to_ranks(batches, old_world, self.tail, keep_runs=group > 1 and i == 0)
            start = (old_pos - done) * old_world
            batches = [b for b, f in zip(adj[start:], filler[start:]) if not f]
            done = old_pos
        # re-dealt batches after a reshard are no longer in runs of the new world size
        adj, filler, info = _fit_to_ranks(batches, self.world_size, self.tail, keep_runs=group > 1 and not self._history)
        result = (adj, filler, info, done)
        self._plan_cache = (key, result)
        return result

    def _rank_batches(self) -> tuple[list[np.ndarray], int]:
        adj, _, _, done = self._plan()
        return adj[self.rank :: self.world_size], done

    # ------------------------------------------------------------------ sampler protocol
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate next (same value on every rank).

        Setting the epoch a state was just loaded for keeps the pending resume position, so a
        Trainer may call ``load_state_dict(s)`` and then ``set_epoch(s["epoch"])``. Any other
        epoch starts from its first batch.
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._history = []
            self._resume_position = None
            self._position = 0

    def __len__(self) -> int:
        """Batches this rank gets in the current epoch (equal on all ranks), counting from the
        epoch's start even when resuming mid-epoch."""
        batches, done = self._rank_batches()
        return done + len(batches)

    def __iter__(self):
        if self._resume_position is None:
            self._history = []  # a fresh pass over the epoch: the full plan, not a resumed one
            start = 0
        else:
            start = self._resume_position
        batches, done = self._rank_batches()
        if not done <= start <= done + len(batches):
            raise ValueError(f"resume position {start} is outside epoch {self.epoch}'s "
                             f"{done}..{done + len(batches)} batches")
        # the plan is made here, not lazily in the generator: the DataLoader calls iter() when
        # the epoch's iterator is created, and that is the state the epoch must run with
        return self._generate(batches, start, done)

    def _generate(self, batches: list[np.ndarray], start: int, done: int):
        # The resume position is used up when iteration begins, not by iter(): a DataLoader with
        # workers calls iter() twice for one epoch and reads only the second iterator.
        self._resume_position = None
        self._position = start
        for b in batches[start - done:]:
            self._position += 1
            yield b.tolist()
        self._position = 0  # epoch complete: nothing left to skip

    # ------------------------------------------------------------------ checkpointing
    def _settings(self) -> dict:
        return {
            "seed": self.seed,
            "num_utterances": int(self.durations.size),
            "durations_fingerprint": self._fingerprint,
            "max_duration": self.max_duration,
            "max_batch_size": self.max_batch_size,
            "quadratic_duration": self.quadratic_duration,
            "max_tokens": self.max_tokens,
            "num_buckets": self.num_buckets,
            "sort_pool": self.sort_pool,
            "sync_buckets": self.sync_buckets,
            "shuffle": self.shuffle,
            "tail": self.tail,
        }

    def state_dict(self) -> dict:
        """Everything needed to resume this rank exactly; plain Python types only.

        ``position`` is the batches of ``epoch`` handed out so far (or, right after
        :meth:`load_state_dict`, the position the next iteration will start at).
        """
        position = self._resume_position if self._resume_position is not None else self._position
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "position": int(position),
            "reshard_history": [list(h) for h in self._history],
            "world_size": self.world_size,
            "rank": self.rank,
            **self._settings(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at batch ``state["position"]`` of epoch ``state["epoch"]`` in the next iteration
        that starts (see the module docstring: ``iter()`` alone does not use the position up).

        Raises:
            ValueError: unknown or missing keys, a state of another data set, seed or batching
                set-up (the message names each differing field, saved vs. now), a state of
                another rank, or a position outside the epoch.
        """
        s = dict(state)
        try:
            version = s.pop("version")
            epoch, position = int(s.pop("epoch")), int(s.pop("position"))
            history = [(int(e), int(w), int(p)) for e, w, p in s.pop("reshard_history")]
            world_size, rank = int(s.pop("world_size")), int(s.pop("rank"))
            s.setdefault("sync_buckets", False)  # states saved before the option existed
            s.setdefault("max_tokens", 0.0)
            budgets = s.pop("bucket_budgets", None)  # states saved while per-bucket budget files existed
            saved = {k: s.pop(k) for k in self._settings()}
        except KeyError as e:
            raise ValueError(f"sampler state is missing key {e.args[0]!r}") from None
        if s:
            raise ValueError(f"sampler state has unexpected key(s) {sorted(s)}")
        if version != _STATE_VERSION:
            raise ValueError(f"sampler state version {version} is not supported (expected {_STATE_VERSION})")
        now = self._settings()
        diff = [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in now if saved[k] != now[k]]
        if budgets is not None:
            diff.append(f"bucket_budgets: saved {budgets!r} (a per-bucket budget file, no longer supported), now None")
        if diff:
            raise ValueError("sampler state was saved with a different set-up, so the saved position "
                             "means different batches now: " + "; ".join(diff))
        if world_size == self.world_size and rank != self.rank:
            raise ValueError(f"sampler state is for rank {rank} but this sampler is rank {self.rank} "
                             f"(each rank must load its own state)")
        self.epoch = epoch
        self._history = history = [h for h in history if h[0] == epoch]
        if world_size != self.world_size:
            # reshard: the old ranks' remaining batches are re-dealt over this world size
            old = type(self).__new__(type(self))  # a subclass (shard windows, a mix) re-deals by its own plan
            old.__dict__.update(self.__dict__)
            old.world_size, old.rank, old._plan_cache = world_size, 0, None
            self._check_position(old, position)
            log.info("resharding sampler state of epoch %d from world size %d to %d at batch %d",
                     epoch, world_size, self.world_size, position)
            self._history = history + [(epoch, world_size, position)]
        self._plan_cache = None
        self._check_position(self, position)
        self._resume_position = position
        self._position = position

    @staticmethod
    def _check_position(sampler: "DurationBucketSampler", position: int) -> None:
        batches, done = sampler._rank_batches()
        if not done <= position <= done + len(batches):
            raise ValueError(f"sampler state position {position} is outside epoch {sampler.epoch}, which has "
                             f"batches {done}..{done + len(batches)} at world size {sampler.world_size}")

    # ------------------------------------------------------------------ statistics
    def epoch_stats(self) -> dict:
        """Statistics of the current epoch's plan over all ranks (identical on every rank).

        Returns:
            dict with ``padding_fraction`` (padded seconds that are padding), ``budget_fill``
            (mean padded batch cost / ``max_duration``), ``step_balance``
            (sum over steps of the ranks' mean padded batch cost / of their maximum: 1.0 = no rank waits for another
            at the step's all-reduce, in the sampler's cost model), ``batch_size_mean/min/max``,
            ``num_batches`` (this rank), ``num_batches_total`` (all ranks), ``num_utterances``
            (including duplicates), ``duplicated_utterances``, ``dropped_utterances``,
            ``split_batches``, ``empty_batches``.
        """
        adj, _, info, _ = self._plan()
        key = (self.epoch, tuple(self._history), self.world_size)
        if self._stats_cache is not None and self._stats_cache[0] == key:
            return dict(self._stats_cache[1])  # the Trainer asks at every log step: O(N) once per epoch
        sizes = np.array([b.size for b in adj], dtype=np.int64)
        nonempty = sizes[sizes > 0]
        longest = np.zeros(0)
        real = 0.0
        if nonempty.size:
            d = self.durations[np.concatenate([b for b in adj if b.size])]
            starts = np.concatenate([[0], np.cumsum(nonempty)[:-1]])
            longest = np.maximum.reduceat(d, starts)
            real = float(d.sum())
        padded = float((nonempty * longest).sum())
        cost = nonempty * padded_cost(longest, self.quadratic_duration)
        per_step = np.zeros(sizes.size)
        per_step[sizes > 0] = cost
        per_step = per_step.reshape(-1, self.world_size)  # the plan is a multiple of the world size
        stats = {
            "padding_fraction": 1.0 - real / padded if padded else 0.0,
            "budget_fill": float((cost / self.max_duration).mean()) if cost.size else 0.0,
            "step_balance": float(per_step.mean(1).sum() / per_step.max(1).sum()) if cost.size else 1.0,
            "batch_size_mean": float(sizes.mean()) if sizes.size else 0.0,
            "batch_size_min": int(sizes.min()) if sizes.size else 0,
            "batch_size_max": int(sizes.max()) if sizes.size else 0,
            "num_batches": len(self),
            "num_batches_total": len(adj),
            "num_utterances": int(sizes.sum()),
            **info,
        }
        self._stats_cache = (key, stats)
        return dict(stats)

    def __repr__(self) -> str:
        return (f"DurationBucketSampler(utterances={self.durations.size}, max_duration={self.max_duration}, "
                f"buckets={len(self._buckets)}, tail={self.tail!r}, world_size={self.world_size}, rank={self.rank})")


def _fit_to_ranks(batches: list[np.ndarray], world_size: int, tail: str,
                  keep_runs: bool = False) -> tuple[list[np.ndarray], list[bool], dict]:
    """Apply the tail policy so ``len(result) % world_size == 0``.

    ``keep_runs``: the list is runs of ``world_size`` batches (sync_buckets) followed by the
    ``len % world_size`` left over; only those are split or filled up, so every run stays one step.

    Returns:
        ``(batches, filler, info)``: filler[i] is True for a copy or an empty batch added to
        fill the last step (dropped on reshard), info counts what the policy did.
    """
    info = {"duplicated_utterances": 0, "dropped_utterances": 0, "split_batches": 0, "empty_batches": 0}
    n = len(batches)
    missing = -n % world_size
    if missing == 0:
        return list(batches), [False] * n, info
    if tail == "drop":
        keep = n - (n % world_size)
        info["dropped_utterances"] = int(sum(b.size for b in batches[keep:]))
        return list(batches[:keep]), [False] * keep, info
    head = n - n % world_size if keep_runs else 0
    out = list(batches[head:])
    if tail in ("split", "exact"):
        while True:
            out, still = _split_largest(list(batches[head:]), missing)
            if not still or head == 0:
                break
            head -= world_size  # too few utterances left over to split: open up the last run too
        missing = still
        info["split_batches"] = (len(out) - (n - head))
    filler = [False] * len(out)
    if missing:
        source = list(batches[:head]) + out  # copies of the epoch's first batches
        if tail == "exact" or not source:
            extra = [np.zeros(0, dtype=np.int64)] * missing
            info["empty_batches"] = missing
        else:
            extra = [source[i % len(source)] for i in range(missing)]
            info["duplicated_utterances"] = int(sum(b.size for b in extra))
        out += extra
        filler += [True] * missing
    return list(batches[:head]) + out, [False] * head + filler, info


def _split_largest(batches: list[np.ndarray], missing: int) -> tuple[list[np.ndarray], int]:
    """Split the largest batches in halves (ties: earliest first) to add up to ``missing`` batches.

    Returns the new list (halves take the place of their batch) and how many are still missing
    (non-zero only when every batch is down to one utterance).
    """
    pieces: dict[int, np.ndarray] = dict(enumerate(batches))  # piece id -> indices
    slots: list[list[int]] = [[i] for i in range(len(batches))]  # original batch -> its pieces, in order
    heap = [(-b.size, i, i) for i, b in enumerate(batches) if b.size >= 2]
    heapq.heapify(heap)
    next_id = len(batches)
    while missing and heap:
        _, slot, pid = heapq.heappop(heap)
        b = pieces.pop(pid)
        half = b.size // 2
        a_id, b_id = next_id, next_id + 1
        next_id += 2
        pieces[a_id], pieces[b_id] = b[:half], b[half:]
        k = slots[slot].index(pid)
        slots[slot][k : k + 1] = [a_id, b_id]
        for q in (a_id, b_id):
            if pieces[q].size >= 2:
                heapq.heappush(heap, (-pieces[q].size, slot, q))
        missing -= 1
    return [pieces[q] for s in slots for q in s], missing
