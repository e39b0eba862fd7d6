"""Several data sources in one loader: named manifests or shard sets, mixed by weight.

Why: fine-tuning on a new accent or domain alone forgets the old one; training on the plain
concatenation with the old data forgets less but learns the new one more slowly. Weights choose
the point in between::

    data:
      train_sources: {accent: data/accent/train.jsonl, base: data/base/shards/}
      train_weights: {accent: 0.5, base: 0.5}      # share of each epoch's utterances
      eval_sources: {accent: data/accent/dev.jsonl, base: data/base/dev.jsonl}

What a weight means: source ``s`` makes up ``w_s / sum(w)`` of the utterances of every training
epoch. An epoch ends when the source with the least data for its weight has been seen once, so no
utterance repeats within an epoch: the epoch holds ``N = min_s(n_s / share_s)`` utterances, and
a larger source contributes the next part of itself each epoch, taken circularly from one
random order of its utterances, so all of it is seen before any utterance comes back. Without weights, sources are
in proportion to their sizes: every utterance once per epoch, as a concatenation.

The draw keeps the sampler's promises (:class:`WeightedMixSampler`): it is stratified by the
sampler's buckets -- source ``s`` gives bucket ``b`` the same number of utterances every epoch,
in proportion to its own utterances in that bucket -- so every bucket, and so the epoch, has the
same number of batches every epoch (exact LR schedules); the draw is a pure function of
``(seed, epoch)``, so a resume is exact; the plan is ShardWindowSampler's (windows of shards
when sources are shard sets; each window then holds every source in its share).

Evaluation over named sources scores every utterance once (weights are for training) and each
batch carries ``batch["sources"]``, the source name of each utterance, so a recipe's
``metrics_fn`` can return per-source pairs such as ``wer/accent`` (examples/finetune_asr.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
from torch.utils.data import Dataset

from ddptrain.data.collate import SpeechCollator
from ddptrain.data.config import DataConfig
from ddptrain.data.dataset import BadExample, SpeechDataset
from ddptrain.data.errors import DataError
from ddptrain.data.manifest import ManifestEntry, split_paths
from ddptrain.data.shard_sampler import ShardWindowSampler
from ddptrain.data.shards import ShardDataset, ShardSet, check_shards, is_shard_spec, load_shards
from ddptrain.data.validate import ValidationReport, duplicate_problems, finish_report, read_entries

log = logging.getLogger(__name__)


class WeightedMixSampler(ShardWindowSampler):
    """ShardWindowSampler whose epochs draw each source's share (see the module docstring).

    Args:
        durations: seconds per utterance, indexed like the dataset (all sources).
        sources: source number (0..S-1) of each utterance.
        weights: one weight >= 0 per source (not all 0).
        names: one name per source (for messages, statistics and the resume check).
        shards, window_shards, **kwargs: as :class:`ShardWindowSampler`.

    Raises:
        ValueError: ShardWindowSampler's, or weights / names that do not match the sources, or
            a weighted source without utterances.
    """

    def __init__(self, durations: Sequence[float], sources: Sequence[int], weights: Sequence[float],
                 names: Sequence[str], shards: Optional[Sequence[int]] = None, window_shards: int = 0, **kwargs):
        super().__init__(durations, shards=shards, window_shards=window_shards, sources=sources, **kwargs)
        w = np.asarray(weights, dtype=np.float64)
        if self.sources is None or len(names) != w.size or w.ndim != 1 or self.sources.max() >= w.size \
                or (self.sources < 0).any():
            raise ValueError(f"need a source number in 0..{w.size - 1} per utterance and one weight and name per "
                             f"source; got {w.size} weights and {len(names)} names")
        if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"weights must be >= 0 and not all 0, got {dict(zip(names, w.tolist()))}")
        self.names, self.weights = [str(n) for n in names], (w / w.sum()).tolist()
        n_sb = np.zeros((w.size, len(self._buckets)), dtype=np.int64)
        np.add.at(n_sb, (self.sources, self._bucket_of), 1)
        n_s = n_sb.sum(1)
        share = w / w.sum()
        empty = [n for n, k, x in zip(self.names, n_s, share) if x > 0 and k == 0]
        if empty:
            raise ValueError(f"source(s) {empty} have a weight but no utterances (all skipped as bad data?)")
        epoch_size = min(k / x for k, x in zip(n_s, share) if x > 0)  # the first source to run out sets it
        self.counts = np.stack([_largest_remainder(n_sb[s] * (share[s] * epoch_size / n_s[s]) if n_s[s] else
                                                   np.zeros(len(self._buckets)), n_sb[s]) for s in range(w.size)])
        self._strata = [[np.flatnonzero((self.sources == s) & (self._bucket_of == b)) for b in range(len(self._buckets))]
                        for s in range(w.size)]
        self._everything = bool((self.counts == n_sb).all())  # weights in proportion to the sizes
        self._source_stats: Optional[tuple] = None

    def _epoch_members(self, epoch: int) -> list[np.ndarray]:
        if self._everything:
            return self._buckets  # every utterance once: the plain plan
        return [np.concatenate([self._draw(s, b, epoch) for s in range(len(self.names))])
                for b in range(len(self._buckets))]

    def _draw(self, s: int, b: int, epoch: int) -> np.ndarray:
        """Source ``s``'s utterances of bucket ``b`` in ``epoch``: the epoch's slice of one random
        order of them, read circularly (``count`` per epoch), so no utterance comes twice in one
        epoch and each comes once every ``n / count`` epochs."""
        members, c = self._strata[s][b], int(self.counts[s, b])
        if c == 0 or c == members.size:
            return members[:c]
        order = np.random.default_rng([self.seed, 2, s, b]).permutation(members.size) if self.shuffle \
            else np.arange(members.size)
        start = int(epoch) * c % members.size
        return members[np.sort(np.take(order, np.arange(start, start + c), mode="wrap"))]

    def _settings(self) -> dict:
        return {**super()._settings(), "source_names": list(self.names),
                "source_weights": [round(x, 6) for x in self.weights]}

    def epoch_stats(self) -> dict:
        """DurationBucketSampler's statistics, plus ``source_utterances`` {name: count} of the plan."""
        stats = super().epoch_stats()
        key = (self.epoch, tuple(self._history), self.world_size)
        if self._source_stats is None or self._source_stats[0] != key:  # asked at every log step
            adj = [b for b in self._plan()[0] if b.size]
            idx = np.concatenate(adj) if adj else np.zeros(0, dtype=np.int64)
            counts = np.bincount(self.sources[idx], minlength=len(self.names))
            self._source_stats = (key, {n: int(c) for n, c in zip(self.names, counts)})
        stats["source_utterances"] = dict(self._source_stats[1])
        return stats


def _largest_remainder(target: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Integers summing to ``round(sum(target))``, each ``floor`` or ``ceil`` of its target, <= cap."""
    base = np.minimum(np.floor(target + 1e-9).astype(np.int64), cap)
    extra = int(round(float(target.sum()))) - int(base.sum())
    room = np.flatnonzero(base < cap)
    for i in room[np.argsort(-(target[room] - base[room]), kind="stable")][:max(0, extra)]:
        base[i] += 1
    return base


class MixedDataset(Dataset):
    """Several datasets as one index space (in order); examples of named sources carry
    ``example["source"]``. ``set_epoch`` reaches every part.

    Each part after the first draws its augmentation from its own seed, so utterance ``i`` of one
    source and utterance ``i`` of another are not perturbed alike.
    """

    def __init__(self, parts: Sequence[Dataset], names: Optional[Sequence[Optional[str]]] = None):
        self.parts, self.names = list(parts), list(names) if names is not None else None
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        for k, p in enumerate(self.parts[1:], start=1):
            p.seed = int(np.random.SeedSequence([p.seed, k]).generate_state(1, np.uint32)[0])
        self.extractor = self.parts[0].extractor
        self.train = self.parts[0].train

    def __len__(self) -> int:
        return int(self.starts[-1])

    def set_epoch(self, epoch: int) -> None:
        for p in self.parts:
            p.set_epoch(epoch)

    def __getitem__(self, i):
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        example = self.parts[k][int(i) - int(self.starts[k])]
        if self.names is not None and not isinstance(example, BadExample):
            example["source"] = self.names[k]
        return example


class SourceCollator(SpeechCollator):
    """SpeechCollator that adds ``batch["sources"]``: the source name of each utterance."""

    def __call__(self, examples: Sequence) -> dict:
        batch = super().__call__(examples)
        batch["sources"] = [e["source"] for e in examples if not isinstance(e, BadExample)]
        return batch


@dataclass
class Sources:
    """The utterances of several sources, validated, as one index space (``load_sources``)."""

    names: Optional[list[str]]  # per source; None for unnamed paths (a concatenation)
    parts: list  # per part: a list of ManifestEntry or a ShardSet
    part_source: list[int]  # the source number of each part
    report: ValidationReport
    durations: np.ndarray = field(init=False)
    shards: Optional[np.ndarray] = field(init=False)  # global shard number per utterance, -1 = none
    sources: np.ndarray = field(init=False)  # source number per utterance

    def __post_init__(self):
        durs, shards, srcs, base = [], [], [], 0
        for part, s in zip(self.parts, self.part_source):
            if isinstance(part, ShardSet):
                durs.append(part.duration)
                shards.append(part.shard + base)
                base += len(part.paths)
            else:
                durs.append(np.array([e.duration for e in part], dtype=np.float64))
                shards.append(np.full(len(part), -1, dtype=np.int64))
            srcs.append(np.full(len(durs[-1]), s, dtype=np.int64))
        self.durations = np.concatenate(durs)
        self.shards = np.concatenate(shards) if base else None
        self.sources = np.concatenate(srcs)

    def fingerprint(self) -> bytes:
        """Identifies the utterances (ids/keys and durations), for the ranks' agreement check."""
        return b"".join(p.fingerprint() if isinstance(p, ShardSet) else
                        "".join(f"{e.id}\t{e.duration:.4f}\n" for e in p).encode() for p in self.parts)

    def dataset(self, cfg: DataConfig, tokenizer, train: bool) -> Dataset:
        parts = [ShardDataset(p, cfg, tokenizer, train) if isinstance(p, ShardSet)
                 else SpeechDataset(p, cfg, tokenizer, train) for p in self.parts]
        if len(parts) == 1 and self.names is None:
            return parts[0]
        return MixedDataset(parts, None if self.names is None else [self.names[s] for s in self.part_source])

    def sampler(self, durations: np.ndarray, cfg: DataConfig, train: bool, **kwargs) -> ShardWindowSampler:
        """The batch sampler: weighted for named training sources, else one pass over everything."""
        window = cfg.shard_window if self.shards is not None else 0
        if train and self.names is not None:
            weights = [cfg.train_weights.get(n, 0.0) for n in self.names] if cfg.train_weights else \
                [float(np.sum(self.sources == s)) for s in range(len(self.names))]
            return WeightedMixSampler(durations, self.sources, weights, self.names, shards=self.shards,
                                      window_shards=window, **kwargs)
        return ShardWindowSampler(durations, shards=self.shards, window_shards=window,
                                  sources=self.sources if self.names is not None else None, **kwargs)


def uses_sources(manifest) -> bool:
    """Whether ``build_dataloader`` needs this module: named sources or any shard set."""
    if isinstance(manifest, Mapping):
        return True
    if isinstance(manifest, (list, tuple)) and manifest and isinstance(manifest[0], ManifestEntry):
        return False
    return any(is_shard_spec(p) for p in split_paths(manifest))


def load_sources(manifest, cfg: DataConfig, tokenizer, check_manifest: Callable) -> Sources:
    """Parse, index and validate every source, then apply ``data.bad_data`` to all at once.

    Args:
        manifest: ``{name: paths}`` (named sources) or paths (comma-separated or a list) of
            manifests and shard sets.
        cfg: the data config.
        tokenizer: for the manifest checks (or None).
        check_manifest: ``(entries, cfg, tokenizer) -> problems``, the loader's (rank-sharded)
            audio checks of manifest lines.

    Raises:
        DataError: under ``bad_data: error``, every problem of every source (manifest lines by
            ``file:line``, shard members by ``shard.tar:N (id key)``); a source with no utterance left.
    """
    named = isinstance(manifest, Mapping)
    items = list(manifest.items()) if named else [(None, manifest)]
    parts, part_source, problems, good_entries = [], [], [], []
    total = 0
    for s, (name, paths) in enumerate(items):
        paths = split_paths(paths)
        manifests = [p for p in paths if not is_shard_spec(p)]
        specs = [p for p in paths if is_shard_spec(p)]
        if manifests:
            entries, bad = read_entries(manifests, cfg.fields)
            if cfg.validate:
                bad += check_manifest(entries, cfg, tokenizer)
            report = finish_report(entries, bad, "skip")
            total += report.num_total
            problems += report.problems
            good_entries += report.entries
            parts.append(report.entries)
            part_source.append(s)
        if specs:
            shards = load_shards(specs)
            total += len(shards) + len(shards.problems)
            problems += shards.problems
            if cfg.validate:  # as manifest lines: the index's checks, and decoding with validate_decode
                bad, mask = check_shards(shards, cfg, cfg.validate_decode)
                problems += bad
                if bad:
                    shards = shards.subset(~mask)
            parts.append(shards)
            part_source.append(s)
    if cfg.validate:  # the same utterance in two sources (or shard sets) would train twice an epoch
        twice, parts = duplicate_problems(parts, [items[s][0] for s in part_source])
        problems += twice
        dropped = {(p.source, p.line, p.id) for p in twice}
        good_entries = [e for e in good_entries if (e.source, e.line, e.id) not in dropped]
    report = ValidationReport(good_entries, problems, total)
    if problems and cfg.bad_data == "error":
        raise DataError.from_problems(f"{report.summary()} (data.bad_data=skip would skip them):", problems)
    if problems:
        log.warning("skipped %d bad utterance(s) of %d (data.bad_data=skip):\n%s", len(problems), total,
                    "\n".join(str(p) for p in problems[:50]))
    kept = [(p, s) for p, s in zip(parts, part_source) if len(p)]
    for s, (name, _) in enumerate(items):
        if named and not any(src == s for _, src in kept):
            raise DataError(f"source {name!r} has no utterances left (after skipping bad ones)")
    if not kept:
        raise DataError(f"no utterances left in {manifest!r} (after skipping bad ones)")
    return Sources([str(n) for n, _ in items] if named else None, [p for p, _ in kept], [s for _, s in kept], report)

