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

Temperature (``data.mix_temperature`` = T), as in multilingual training: source ``s``'s share is
``b_s^(1/T) / sum_r b_r^(1/T)``, where ``b_s`` is its ``train_weights`` entry, or its number of
utterances when there are no weights (weights and sizes never multiply: weights replace sizes).
T = 1 keeps the shares as given; T > 1 flattens them toward uniform (T = inf: uniform over the
sources with ``b > 0``); T < 1 sharpens them. A weight of 0 stays 0 at every T.

Exposure caps (``data.source_caps``: ``{name: {epochs: x}}`` or ``{name: {hours: x}}``): a source
stops being drawn once the run has drawn ``x`` times its utterances, or ``x`` hours of its
audio (the manifest's durations). The cap is kept per bucket, so a capped source's lengths stay
spread as its own: bucket ``b`` of source ``s`` may give ``floor(x * n_sb)`` utterances over the
run (epochs), or the longest run of its circular order whose seconds fit ``x`` hours times the
bucket's share of the source's seconds (hours); never more than the cap. ``epochs: 1.0`` is every
utterance exactly once. The epoch in which a cap is reached draws only what is left of it, and
later epochs draw nothing of that source: epochs get shorter (the other sources keep their
per-epoch draws), and the run's length counts them (:meth:`WeightedMixSampler.epoch_lengths`).
Once every source with a share is capped, epochs are empty: ``end_epoch`` is the first of them,
and the Trainer ends the run there, saying so (ddptrain/steps.py). Everything stays a pure
function of ``(seed, epoch)``: what was drawn before an epoch is computed, not stored, so a
resume and the ranks' equal step counts hold as without caps; the sampler's state holds the caps,
and a resume under other caps is refused, naming them.

Evaluation over named sources scores every utterance once (weights are for training) and each
batch carries ``batch["sources"]``, the source name of each utterance, so a recipe's
``metrics_fn`` can return per-source pairs such as ``wer/accent`` (examples/finetune_asr.py); the
Trainer adds their mean over the sources, ``wer/mean``, and checks each against the base model's
(ddptrain/regression.py).
"""

from __future__ import annotations

import copy
import logging
import math
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
from ddptrain.data.validate import (SCORE_TWICE, TRAIN_TWICE, ValidationReport, duplicate_problems, finish_report,
                                    read_entries)

log = logging.getLogger(__name__)


class WeightedMixSampler(ShardWindowSampler):
    """ShardWindowSampler whose epochs draw each source's share (see the module docstring).

    Args:
        durations: seconds per utterance, indexed like the dataset (all sources).
        sources: source number (0..S-1) of each utterance.
        weights: one weight >= 0 per source (not all 0).
        names: one name per source (for messages, statistics and the resume check).
        shards, window_shards, **kwargs: as :class:`ShardWindowSampler`.
        caps: ``{name: {"epochs": x} or {"hours": x}}``, exposure caps (the module docstring).
        seconds: audio seconds per utterance for ``hours`` caps; default ``durations`` (which
            may be budget lengths: speed-stretched, a recipe's cost).

    Raises:
        ValueError: ShardWindowSampler's, or weights / names that do not match the sources, or
            a weighted source without utterances, or a cap of an unknown source or kind.
    """

    def __init__(self, durations: Sequence[float], sources: Sequence[int], weights: Sequence[float],
                 names: Sequence[str], shards: Optional[Sequence[int]] = None, window_shards: int = 0,
                 caps: Optional[Mapping[str, Mapping[str, float]]] = None, seconds: Optional[Sequence[float]] = None,
                 **kwargs):
        super().__init__(durations, shards=shards, window_shards=window_shards, sources=sources, **kwargs)
        w = np.asarray(weights, dtype=np.float64)
        if self.sources is None or len(names) != w.size or w.ndim != 1 or self.sources.max() >= w.size \
                or (self.sources < 0).any():
            raise ValueError(f"need a source number in 0..{w.size - 1} per utterance and one weight and name per "
                             f"source; got {w.size} weights and {len(names)} names")
        if not np.isfinite(w).all() or (w < 0).any() or not w.max() > 0:
            raise ValueError(f"weights must be >= 0 and not all 0, got {dict(zip(names, w.tolist()))}")
        if not np.isfinite(w.sum()):  # huge weights (1e308 + 1e308): the sum overflows; their ratio is what counts
            w = w / w.max()
        share = w / w.sum()
        self.names, self.weights = [str(n) for n in names], share.tolist()
        n_sb = np.zeros((w.size, len(self._buckets)), dtype=np.int64)
        np.add.at(n_sb, (self.sources, self._bucket_of), 1)
        n_s = n_sb.sum(1)
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
        self.caps = _check_caps(caps, self.names)
        self._limit = self._cap_limits(self.durations if seconds is None else np.asarray(seconds, dtype=np.float64))
        drawn = self.counts > 0
        capped = drawn & (self._limit >= 0)
        # the first epoch that draws nothing: every drawn (source, bucket) has reached its cap
        self.end_epoch: Optional[int] = None
        if drawn.any() and (capped == drawn).all():
            self.end_epoch = int(np.max(-(-self._limit[drawn] // self.counts[drawn])))
        self._lengths: dict = {}  # epoch draws (counts) -> batches of this rank (epoch_lengths)

    def _cap_limits(self, secs: np.ndarray) -> np.ndarray:
        """Per source and bucket, the utterances the run may draw of it (-1: no cap)."""
        if secs.shape != self.durations.shape:
            raise ValueError(f"seconds must be one per utterance ({self.durations.size}), got shape {secs.shape}")
        limit = np.full(self.counts.shape, -1, dtype=np.int64)
        for s, name in enumerate(self.names):
            if name not in self.caps:
                continue
            (kind, x), = self.caps[name].items()
            total = float(secs[self.sources == s].sum())
            for b, members in enumerate(self._strata[s]):
                if kind == "epochs":
                    limit[s, b] = int(math.floor(x * members.size + 1e-9))
                    continue
                # hours: the longest prefix of the bucket's circular order within its share of them
                prefix = np.concatenate([[0.0], np.cumsum(secs[members[self._order(s, b)]])])
                budget = x * 3600.0 * prefix[-1] / total
                cycles = int(budget // prefix[-1]) if prefix[-1] > 0 else 0
                within = np.searchsorted(prefix, (budget - cycles * prefix[-1]) * (1 + 1e-12), "right") - 1
                limit[s, b] = cycles * members.size + int(within)
        return limit

    def _epoch_counts(self, epoch: int) -> np.ndarray:
        """Per source and bucket, the utterances ``epoch`` draws: the plan's counts, less what the
        caps leave after the epochs before it (each drew its full counts until a cap bit)."""
        c = self.counts
        left = np.where(self._limit >= 0, self._limit - c * int(epoch), c)
        return np.clip(left, 0, c)

    def _order(self, s: int, b: int) -> np.ndarray:
        """The circular order source ``s`` reads its utterances of bucket ``b`` in (positions in the stratum)."""
        n = self._strata[s][b].size
        return np.random.default_rng([self.seed, 2, s, b]).permutation(n) if self.shuffle else np.arange(n)

    def _epoch_members(self, epoch: int) -> list[np.ndarray]:
        counts = self._epoch_counts(epoch)
        if self._everything and (counts == self.counts).all():
            return self._buckets  # every utterance once: the plain plan
        return [np.concatenate([self._draw(s, b, epoch, int(counts[s, b])) for s in range(len(self.names))])
                for b in range(len(self._buckets))]

    def _draw(self, s: int, b: int, epoch: int, k: int) -> np.ndarray:
        """Source ``s``'s ``k`` utterances of bucket ``b`` in ``epoch``: the epoch's slice of one
        random order of them, read circularly (``count`` per epoch, the first ``k`` of it), so no
        utterance comes twice in one epoch and each comes once every ``n / count`` epochs."""
        members, c = self._strata[s][b], int(self.counts[s, b])
        if k == 0 or k == members.size:
            return members[:k]
        start = int(epoch) * c % members.size
        return members[np.sort(np.take(self._order(s, b), np.arange(start, start + k), mode="wrap"))]

    def epoch_lengths(self, epochs: int) -> list[int]:
        """Batches this rank gets in each of epochs ``0 .. epochs - 1`` (equal on every rank):
        the same every epoch unless caps shorten the later ones (0 from ``end_epoch`` on). One
        plan per distinct draw, so a long run of equal epochs costs one plan."""
        out = []
        for e in range(int(epochs)):
            key = self._epoch_counts(e).tobytes()
            if key not in self._lengths:
                probe = copy.copy(self)  # the plan of epoch e, leaving this sampler's epoch alone
                probe.epoch, probe._history, probe._plan_cache = e, [], None
                self._lengths[key] = len(probe)
            out.append(self._lengths[key])
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        state.setdefault("source_caps", {})  # states saved before caps existed
        super().load_state_dict(state)

    def _settings(self) -> dict:
        return {**super()._settings(), "source_names": list(self.names),
                "source_weights": [round(x, 6) for x in self.weights],
                "source_caps": {n: dict(c) for n, c in self.caps.items()}}

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


CAP_KINDS = ("epochs", "hours")


def _check_caps(caps, names: Sequence[str]) -> dict:
    """``{name: {kind: x}}`` checked: a known source, one kind of :data:`CAP_KINDS`, ``x > 0``."""
    out = {}
    for name, cap in dict(caps or {}).items():
        cap = dict(cap) if isinstance(cap, Mapping) else cap
        if str(name) not in names:
            raise ValueError(f"source_caps names {name!r}, which is not a training source ({', '.join(names)})")
        if not isinstance(cap, dict) or len(cap) != 1 or next(iter(cap)) not in CAP_KINDS:
            raise ValueError(f"source_caps[{name!r}] must be {{epochs: x}} or {{hours: x}}, got {cap!r}")
        (kind, x), = cap.items()
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
            raise ValueError(f"source_caps[{name!r}].{kind} must be a number > 0, got {x!r}")
        out[str(name)] = {kind: float(x)}
    return out


def mix_shares(base: Sequence[float], temperature: float = 1.0) -> np.ndarray:
    """Sampling shares ``b^(1/T) / sum(b^(1/T))`` (the module docstring); ``b = 0`` stays 0, and
    ``temperature = inf`` is uniform over the sources with ``b > 0``.

    Raises:
        ValueError: a ``b`` < 0 or not finite, all ``b`` 0, or ``temperature <= 0``.
    """
    b = np.asarray(base, dtype=np.float64)
    if not np.isfinite(b).all() or (b < 0).any() or not b.max() > 0:  # not the sum: it may overflow
        raise ValueError(f"mixing weights must be finite, >= 0 and not all 0, got {b.tolist()}")
    if not temperature > 0:
        raise ValueError(f"mix_temperature must be > 0, got {temperature!r}")
    # normalised first, so b^(1/T) of large sizes at small T stays in range
    p = np.where(b > 0, (b / b.max()) ** (1.0 / float(temperature)), 0.0)
    return p / p.sum()


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
        return source_sampler(durations, self.sources, self.names, cfg, train, seconds=self.durations,
                              shards=self.shards, window_shards=window, **kwargs)


def source_sampler(durations: np.ndarray, sources: np.ndarray, names: Optional[Sequence[str]], cfg: DataConfig,
                   train: bool, seconds: Optional[np.ndarray] = None, **kwargs) -> ShardWindowSampler:
    """The batch sampler of utterances from named sources, as the ``data:`` section mixes them: for
    training a :class:`WeightedMixSampler` (``data.train_weights`` or the sources' sizes, through
    ``data.mix_temperature``, capped by ``data.source_caps``), for evaluation one pass over every
    utterance. The library's loader uses it, and so does a recipe with its own dataset (the TTS
    recipe's cached latents).

    Args:
        durations: the budget length of each utterance (``sampler.budget_lengths``).
        sources: the source number (0..S-1) of each utterance.
        names: the name of each source (None: unnamed paths, a concatenation).
        cfg: the ``data:`` section.
        train: training (weighted draws) or evaluation.
        seconds: audio seconds per utterance for ``hours`` caps; default ``durations``.
        **kwargs: the sampler's other arguments (``sampler.sampler_settings``, shards, tokens).

    Raises:
        DataError: ``data.source_caps`` without named training sources.
        ValueError: :class:`WeightedMixSampler`'s.
    """
    if train and names is not None:
        weights = [cfg.train_weights.get(n, 0.0) for n in names] if cfg.train_weights else \
            [float(np.sum(sources == s)) for s in range(len(names))]
        if cfg.mix_temperature != 1:  # T = 1 keeps the weights as given (exactly: no rounding)
            weights = mix_shares(weights, cfg.mix_temperature).tolist()
        return WeightedMixSampler(durations, sources, weights, names, caps=cfg.source_caps, seconds=seconds, **kwargs)
    if train and cfg.source_caps:
        raise DataError(f"data.source_caps needs named training sources (data.train_sources), "
                        f"got {sorted(cfg.source_caps)}")
    return ShardWindowSampler(durations, sources=sources if names is not None else None, **kwargs)


def uses_sources(manifest) -> bool:
    """Whether ``build_dataloader`` needs this module: named sources or any shard set."""
    if isinstance(manifest, Mapping):
        return True
    if isinstance(manifest, (list, tuple)) and manifest and isinstance(manifest[0], ManifestEntry):
        return False
    return any(is_shard_spec(p) for p in split_paths(manifest))


def load_sources(manifest, cfg: DataConfig, tokenizer, check_manifest: Callable, train: bool = True) -> Sources:
    """Parse, index and validate every source, then apply ``data.bad_data`` to all at once.

    Args:
        manifest: ``{name: paths}`` (named sources) or paths (comma-separated or a list) of
            manifests and shard sets.
        cfg: the data config.
        tokenizer: for the manifest checks (or None).
        check_manifest: ``(entries, cfg, tokenizer) -> problems``, the loader's (rank-sharded)
            audio checks of manifest lines.
        train: training data (else evaluation data: a duplicate's message says what it would do there).

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
        twice, parts = duplicate_problems(parts, [items[s][0] for s in part_source],
                                          why=TRAIN_TWICE if train else SCORE_TWICE)
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

