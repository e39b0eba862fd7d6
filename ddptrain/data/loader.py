"""build_dataloader: manifest(s) + DataConfig -> a DataLoader whose batch_sampler is a
:class:`~ddptrain.data.sampler.DurationBucketSampler`.

The wiring, in order: parse the manifests; validate them (``data.validate``; with a process
group, each rank checks a 1/W share of the files and the problems are all-gathered, so a large
data set is not read W times); apply the bad-data policy; check that every rank ended up with
the same utterances (two ranks with different lists would silently train on overlapping
batches); then sampler, dataset, collator, DataLoader.

Speed perturbation makes an utterance up to ``1/min(speed_perturb)`` times longer, so the
training sampler budgets with durations scaled by that factor: the padded batch stays within
``max_duration`` whatever factor a worker draws.

Evaluation loaders (``train=False``) never shuffle, never augment and use the ``exact`` tail
(no duplicated or dropped utterance; an empty batch on a rank that has nothing left).

Attributes added to the returned DataLoader: ``validation_report`` (a ``ValidationReport``, or
``None`` when validation is off), ``feature_extractor`` (the ``BatchFeatureExtractor`` to run on
the device for ``feature_device: gpu``, else ``None``), ``data_config``.

:func:`make_loader` is the one place a DataLoader is made from the ``data:`` section; with
:meth:`DurationBucketSampler.from_config <ddptrain.data.sampler.DurationBucketSampler.from_config>`
it is what a recipe with its own dataset and collator uses (examples/finetune_glmasr.py,
finetune_tts.py, finetune_hf_model.py, the benchmarks), so the loaders cannot drift apart.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import DataLoader

from ddptrain import dist
from ddptrain.config import check_section
from ddptrain.data.collate import SpeechCollator
from ddptrain.data.config import DataConfig
from ddptrain.data.dataset import SpeechDataset
from ddptrain.data.errors import DataError
from ddptrain.data.features import WHISPER_WINDOW_S, BatchFeatureExtractor
from ddptrain.data.manifest import ManifestEntry
from ddptrain.data.mix import SourceCollator, Sources, load_sources, uses_sources
from ddptrain.data.sampler import DurationBucketSampler, budget_lengths, sampler_settings
from ddptrain.data.tokenizer import CharTokenizer
from ddptrain.data.validate import (SCORE_TWICE, TRAIN_TWICE, ValidationReport, check_entries, duplicate_problems,
                                    finish_report, read_entries)

log = logging.getLogger(__name__)


def build_dataloader(
    manifest: Union[str, os.PathLike, Sequence],
    data_cfg: DataConfig,
    tokenizer: Union[CharTokenizer, str, None] = None,
    train: bool = True,
    world_size: Optional[int] = None,
    rank: Optional[int] = None,
    seed: Optional[int] = None,
) -> DataLoader:
    """Build the training or evaluation DataLoader.

    Args:
        manifest: manifest path, comma-separated paths, list of paths, or ``ManifestEntry`` list;
            a path may name shards (a ``.tar``, a folder or glob of them: ddptrain/data/shards.py);
            a ``{name: paths}`` mapping gives named sources (ddptrain/data/mix.py), mixed by
            ``data.train_weights`` when ``train``, with ``batch["sources"]`` in every batch.
        data_cfg: the ``data:`` config section.
        tokenizer: a ``CharTokenizer``, a tokenizer file path, or ``None`` (no ``tokens`` keys).
        train: training (shuffle, augmentation, ``data.tail``) or evaluation (none of those).
        world_size, rank: default from ``ddptrain.dist`` (1 / 0 without a process group).
        seed: sampler seed; default ``data_cfg.seed``.

    Returns:
        A DataLoader yielding batch dicts (keys: see ``ddptrain/data/collate.py``) with
        ``.batch_sampler`` the DurationBucketSampler (for shards or sources, its subclass
        ShardWindowSampler or WeightedMixSampler).

    Raises:
        ConfigError: a ``data_cfg`` value outside what ``load_config`` accepts.
        DataError: bad manifest lines or shard members under ``bad_data: error`` (all listed),
            no utterance left, or ranks that disagree about the data set.
    """
    cfg = check_section(data_cfg, "data")  # a DataConfig built in Python gets load_config's checks, once
    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = CharTokenizer.load(tokenizer)

    sources: Optional[Sources] = None
    report: Optional[ValidationReport] = None
    if uses_sources(manifest):  # named sources or shard sets (mix.py, shards.py)
        sources = load_sources(manifest, cfg, tokenizer, _check_sharded, train)
        report, durations = sources.report, sources.durations
        _check_same_on_all_ranks(sources.fingerprint(), durations.size)
    else:
        entries, problems = read_entries(manifest, cfg.fields)
        if cfg.validate:
            problems += _check_sharded(entries, cfg, tokenizer)
            problems += duplicate_problems([entries], [None], by_id=False,  # one audio in two manifests
                                           why=TRAIN_TWICE if train else SCORE_TWICE)[0]
            report = finish_report(entries, problems, cfg.bad_data)
            entries = report.entries
            if report.problems:
                log.warning("skipped %d bad utterance(s) of %d (data.bad_data=skip):\n%s",
                            report.num_skipped, report.num_total, report)
        else:
            entries = finish_report(entries, problems, cfg.bad_data).entries  # parse errors still count
        if not entries:
            raise DataError(f"no utterances left in {manifest!r} (after skipping bad lines)")
        _check_same_on_all_ranks("".join(f"{e.id}\t{e.duration:.4f}\n" for e in entries).encode(), len(entries))
        durations = np.array([e.duration for e in entries], dtype=np.float64)

    settings = sampler_settings(cfg, train, world_size, rank, seed)
    if sources is None:
        sampler = DurationBucketSampler(budget_lengths(durations, cfg, train), **settings)
        dataset = SpeechDataset(entries, cfg, tokenizer, train)
    else:
        sampler = sources.sampler(budget_lengths(durations, cfg, train), cfg, train, **settings)
        dataset = sources.dataset(cfg, tokenizer, train)
    collate = (SourceCollator if sources is not None and sources.names else SpeechCollator)(
        mode="features" if dataset.extractor is not None else "audio",
        num_mel_bins=cfg.num_mel_bins,
        pad_to_multiple=cfg.pad_to_multiple,
        with_tokens=tokenizer is not None,
        token_pad_multiple=cfg.token_pad_multiple,
        # Whisper's features are the whole window whatever the audio's length: padding the audio to
        # it gives every batch of B one audio shape (one CUDA graph key per target length)
        audio_length=WHISPER_WINDOW_S * cfg.sample_rate if cfg.features == "whisper_logmel" else 0,
    )
    loader = make_loader(dataset, sampler, collate, cfg, train)
    loader.validation_report = report
    return loader


def make_loader(dataset, sampler, collate, data_cfg: DataConfig, train: bool = True) -> DataLoader:
    """The DataLoader of a ``data:`` section: ``sampler``'s batches of ``dataset`` through
    ``collate``, with the section's workers, pinning (CUDA only), persistent workers, prefetch
    and ``loader_timeout_s`` (a stuck batch is an error, not a hang).

    Args:
        dataset: index -> example.
        sampler: a batch sampler (``DurationBucketSampler.from_config``).
        collate: examples -> batch.
        data_cfg: the ``data:`` section (checked once: ``ddptrain.config.check_section``).
        train: the mode of ``feature_extractor`` (below), as the loader's data are.

    Returns:
        The DataLoader, with ``data_config`` (the checked section) and ``feature_extractor``:
        with ``feature_device: gpu`` (and features other than ``raw``) the
        ``BatchFeatureExtractor`` a loss runs on the device through ``for_model(model, batch)``,
        which masks only while the model trains; else ``None``.

    Raises:
        ConfigError: a ``data_cfg`` value outside what ``load_config`` accepts.
    """
    cfg = check_section(data_cfg, "data")
    workers = max(0, cfg.num_workers)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=cfg.pin_memory and torch.cuda.is_available(),
        persistent_workers=cfg.persistent_workers and workers > 0,
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
        timeout=cfg.loader_timeout_s if workers > 0 else 0,
    )
    loader.data_config = cfg
    loader.feature_extractor = (
        BatchFeatureExtractor(cfg).train(train) if cfg.features != "raw" and cfg.feature_device == "gpu" else None
    )
    return loader


def _check_sharded(entries: list[ManifestEntry], cfg: DataConfig, tokenizer) -> list:
    """Each rank of the process group checks every W-th entry; all ranks get all problems."""
    w, r = dist.get_world_size(), dist.get_rank()
    if w == 1:
        return check_entries(entries, cfg, tokenizer, cfg.validate_decode)
    mine = check_entries(entries[r::w], cfg, tokenizer, cfg.validate_decode)
    return [p for part in dist.all_gather_object(mine) for p in part]


def _check_same_on_all_ranks(identity: bytes, count: int) -> None:
    """Raise on every rank if the ranks of the process group ended up with different utterances
    (``identity``: the ids and durations of this rank's ``count`` utterances, as bytes)."""
    if dist.get_world_size() == 1:
        return
    seen = dist.all_gather_object((hashlib.blake2b(identity, digest_size=8).hexdigest(), count))
    if len(set(seen)) > 1:
        per_rank = ", ".join(f"rank {r}: {n}" for r, (_, n) in enumerate(seen))
        raise DataError(f"the ranks see different lists of utterances ({per_rank}; rank {dist.get_rank()} "
                        f"here): do all ranks read the same manifest, and is the audio storage the same "
                        f"everywhere (a file readable on one node only)?")
