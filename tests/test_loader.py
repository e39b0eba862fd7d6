"""build_dataloader (ddptrain/data/loader.py): what the returned loader carries, the training vs
evaluation set-up, the checks of a DataConfig built in Python, and the agreement between ranks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from _dist import run_ranks
from ddptrain.config import ConfigError
from ddptrain.data import (BatchFeatureExtractor, CharTokenizer, DataConfig, DataError, DurationBucketSampler,
                           build_dataloader, load_manifest)
from ddptrain.data.synthetic import write_synthetic_corpus

DURS = np.round(np.random.default_rng(1).uniform(0.3, 1.5, 14), 3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_synthetic_corpus(str(tmp_path_factory.mktemp("corpus")), DURS, seed=2)


def cfg(**kw):
    base = dict(max_duration=3.0, num_buckets=3, num_workers=0, num_mel_bins=20, seed=4)
    base.update(kw)
    return DataConfig(**base)


def ids_of(loader):
    return [i for batch in loader for i in batch["ids"]]


def test_training_loader_carries_its_sampler_report_config_and_covers_the_epoch(corpus):
    tok = CharTokenizer.build(corpus)
    loader = build_dataloader(corpus, cfg(features="FBank", bad_data="Error"), tok, train=True)
    assert isinstance(loader.batch_sampler, DurationBucketSampler)
    assert loader.batch_sampler.shuffle and loader.batch_sampler.tail == "split"
    assert loader.validation_report.ok and loader.validation_report.num_total == len(DURS)
    assert (loader.data_config.features, loader.data_config.bad_data) == ("fbank", "error")  # canonical
    assert loader.feature_extractor is None  # features are made in the workers
    batches = list(loader)
    assert sorted(i for b in batches for i in b["ids"]) == sorted(e.id for e in load_manifest(corpus))
    assert all(b["features"].shape[-1] == 20 and "tokens" in b for b in batches)


def test_evaluation_loader_is_exact_unshuffled_and_unaugmented_on_every_rank(corpus):
    c = cfg(speed_perturb=[0.5, 1.0], spec_augment=True, shuffle=True, tail="duplicate")
    loaders = [build_dataloader(corpus, c, train=False, world_size=3, rank=r) for r in range(3)]
    for loader in loaders:
        s = loader.batch_sampler
        assert (s.tail, s.shuffle, s.world_size) == ("exact", False, 3)
        assert not loader.dataset.train and loader.dataset.speeds == []
        np.testing.assert_allclose(s.durations, DURS)  # no stretch for speed perturbation
    assert len({len(loader) for loader in loaders}) == 1  # equal batch counts (some may be empty)
    seen = [i for loader in loaders for i in ids_of(loader)]
    assert sorted(seen) == sorted(e.id for e in load_manifest(corpus))  # each utterance exactly once
    first = ids_of(loaders[1])
    loaders[1].batch_sampler.set_epoch(5)
    assert ids_of(loaders[1]) == first  # the same order every epoch


def test_training_budget_allows_for_the_slowest_speed(corpus):
    loader = build_dataloader(corpus, cfg(speed_perturb=[0.5, 1.0]), train=True)
    np.testing.assert_allclose(loader.batch_sampler.durations, DURS * 2)
    for batch in loader.batch_sampler:
        assert len(batch) * 2 * DURS[batch].max() <= 3.0 + 1e-9


def test_gpu_features_come_with_an_extractor_in_the_loaders_mode(corpus):
    train = build_dataloader(corpus, cfg(feature_device="GPU", spec_augment=True), train=True)
    evaluation = build_dataloader(corpus, cfg(feature_device="gpu", spec_augment=True), train=False)
    assert isinstance(train.feature_extractor, BatchFeatureExtractor) and train.feature_extractor.training
    assert not evaluation.feature_extractor.training
    batch = next(iter(evaluation))
    assert "audio" in batch and "features" not in batch


@pytest.mark.parametrize("kw,pattern", [
    (dict(tail="exact"), "data.tail='exact' is not one of split, duplicate, drop"),
    (dict(prefetch_factor=0, num_workers=1), "data.prefetch_factor=0 must be >= 1"),
    (dict(normalize="global"), "data.normalize=global needs data.global_stats"),
])
def test_a_data_config_built_in_python_is_checked_like_a_loaded_one(corpus, kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_dataloader(corpus, cfg(**kw))


def _two_ranks(rank, world, corpus, out):
    from ddptrain import dist

    dist.setup("gloo", 60.0, "cpu")
    # one bad line: found by whichever rank checks it, skipped on both
    lines = open(corpus).read().splitlines()
    bad = json.loads(lines[0])
    bad["audio_filepath"] = "audio/missing.flac"
    shared = os.path.join(os.path.dirname(corpus), "with_bad_line.jsonl")
    if rank == 0:
        with open(shared, "w") as f:
            f.write("\n".join(lines + [json.dumps(bad)]) + "\n")
    dist.barrier()
    loader = build_dataloader(shared, cfg(bad_data="skip"), train=True)
    report = loader.validation_report
    result = {"skipped": [p.reason for p in report.problems], "n": len(report.entries),
              "world": loader.batch_sampler.world_size, "rank": loader.batch_sampler.rank}
    # rank 1 misses an utterance (a file only one node can read, say): every rank must refuse
    mine = os.path.join(os.path.dirname(corpus), f"rank{rank}.jsonl")
    with open(mine, "w") as f:
        f.write("\n".join(lines[: len(lines) - rank]) + "\n")
    try:
        build_dataloader(mine, cfg(), train=True)
        result["error"] = None
    except DataError as e:
        result["error"] = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.teardown()


@pytest.mark.timeout(120)
def test_ranks_share_validation_and_refuse_different_utterance_lists(corpus, tmp_path):
    run_ranks(_two_ranks, 2, corpus, str(tmp_path), timeout=90)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert (res["world"], res["rank"]) == (2, r)
        assert res["n"] == len(DURS) and len(res["skipped"]) == 1 and "missing audio file" in res["skipped"][0]
        assert res["error"] and "different lists of utterances" in res["error"], res
        assert f"rank 0: {len(DURS)}, rank 1: {len(DURS) - 1}" in res["error"]


def test_the_data_section_is_checked_once_per_loader_build(corpus, monkeypatch):
    """build_dataloader checks the section at its entry; the dataset, the feature extractors and
    the sampler it builds take the checked section (each checked it again before)."""
    import ddptrain.config

    calls = []
    real = ddptrain.config._check  # what check_section runs, looked up at each call
    monkeypatch.setattr(ddptrain.config, "_check", lambda root, origins: calls.append(*root) or real(root, origins))
    build_dataloader(corpus, cfg(feature_device="GPU", spec_augment=True), train=True)
    assert calls == ["data"]
    mine = cfg(features="LOGMEL")
    first = build_dataloader(corpus, mine, train=True)
    build_dataloader(corpus, first.data_config, train=False)  # the checked section: not checked again
    assert calls == ["data", "data"]
    first.data_config.max_duration = -1.0  # changed since: checked again
    with pytest.raises(ConfigError, match="data.max_duration=-1.0 must be > 0"):
        build_dataloader(corpus, first.data_config, train=False)


def test_from_config_and_make_loader_are_the_loaders_own_translation(corpus):
    """DurationBucketSampler.from_config and make_loader (what recipes use) make the sampler and
    DataLoader build_dataloader makes, training and evaluation."""
    from ddptrain.data import make_loader

    c = cfg(num_workers=2, loader_timeout_s=9.0, tail="duplicate", quadratic_duration=20.0, speed_perturb=[0.8, 1.0],
            persistent_workers=False, prefetch_factor=3)
    for train in (True, False):
        ref = build_dataloader(corpus, c, train=train)
        sampler = DurationBucketSampler.from_config(ref.dataset, c, train)
        assert sampler.state_dict() == ref.batch_sampler.state_dict()
        np.testing.assert_allclose(sampler.durations, ref.dataset.durations * (1.25 if train else 1.0))
        mine = make_loader(ref.dataset, sampler, ref.collate_fn, c, train)
        for key in ("num_workers", "timeout", "prefetch_factor", "persistent_workers", "pin_memory"):
            assert getattr(mine, key) == getattr(ref, key), key
        assert mine.timeout == 9.0 and mine.data_config == ref.data_config
    # a recipe's cost (whole 1 s units here) and overrides
    s = DurationBucketSampler.from_config(DURS, c, False, cost=np.ceil, max_batch_size=2)
    assert set(np.unique(s.durations)) <= {1.0, 2.0} and s.max_batch_size == 2 and s.tail == "exact"
