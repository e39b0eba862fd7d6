"""Weighted mixing of sources (ddptrain/data/mix.py): weights set each source's share of an epoch,
the draw keeps the sampler's promises (constant epoch length, no repeats, equal steps, exact
resume), named sources reach the batches and the recipe's per-source metrics."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from ddptrain.config import ConfigError, load_config
from ddptrain.data import CharTokenizer, DataConfig, build_dataloader, load_manifest
from ddptrain.data.mix import WeightedMixSampler
from ddptrain.data.shards import write_shards
from ddptrain.data.synthetic import write_synthetic_corpus

RNG = np.random.default_rng(2)
SIZES = (300, 1500)  # the demo's accent and base training sets
DURS = np.concatenate([RNG.uniform(1, 3, SIZES[0]), RNG.uniform(1, 4, SIZES[1])])
SRC = np.repeat([0, 1], SIZES)


def mix(weights, **kw):
    base = dict(max_duration=25.0, num_buckets=10, seed=3)
    base.update(kw)
    return WeightedMixSampler(DURS, SRC, weights, ["accent", "base"], **base)


def drawn(sampler):
    return np.array([i for b in sampler for i in b], dtype=np.int64)


@pytest.mark.parametrize("weights,expect", [((0.5, 0.5), (300, 300)), ((0.25, 0.75), (300, 900)),
                                            ((0.75, 0.25), (300, 100)), ((1, 0), (300, 0)),
                                            ((300, 1500), SIZES)])
def test_weights_set_each_sources_share_of_every_epoch(weights, expect):
    s = mix(weights)
    lengths = set()
    for epoch in range(4):
        s.set_epoch(epoch)
        idx = drawn(s)
        assert tuple(np.bincount(SRC[idx], minlength=2)) == expect
        assert np.unique(idx).size == idx.size  # no utterance twice in one epoch
        assert s.epoch_stats()["source_utterances"] == dict(zip(["accent", "base"], expect))
        lengths.add(len(s))
    assert len(lengths) == 1  # the same number of batches every epoch (exact LR schedules)
    assert s.epoch_stats()["padding_fraction"] < 0.03


def test_a_larger_source_rotates_through_all_of_itself():
    s = mix((0.5, 0.5))  # base gives 300 of its 1500 per epoch
    seen = set()
    for epoch in range(5):
        s.set_epoch(epoch)
        seen |= {i for i in drawn(s) if SRC[i] == 1}
    assert len(seen) > 0.97 * SIZES[1]  # all but the few a bucket's count does not divide
    s.set_epoch(5)
    first, again = drawn(s), (s.set_epoch(5), drawn(s))[1]
    assert np.array_equal(first, again)  # the draw is a function of the epoch


def test_two_ranks_get_equal_steps_and_one_share_each():
    ranks = [mix((0.25, 0.75), world_size=2, rank=r) for r in range(2)]
    plans = [drawn(r) for r in ranks]
    assert len(ranks[0]) == len(ranks[1]) == len(list(ranks[0]))
    both = np.concatenate(plans)
    assert np.unique(both).size == both.size == 1200  # split tail: disjoint and complete


def test_mid_epoch_resume_and_reshard_are_exact():
    s = mix((0.5, 0.5))
    s.set_epoch(2)
    full = list(s)
    resumed = mix((0.5, 0.5))
    resumed.load_state_dict(dict(s.state_dict(), epoch=2, position=7))
    assert list(resumed) == full[7:]
    # saved on 2 ranks mid-epoch, resumed on 1: the rest of the epoch's draw, exactly once
    two = [mix((0.5, 0.5), world_size=2, rank=r) for r in range(2)]
    for t in two:
        t.set_epoch(2)
    done = [i for t in two for b in list(t)[:5] for i in b]
    single = mix((0.5, 0.5))
    single.load_state_dict(dict(two[1].state_dict(), epoch=2, position=5))
    rest = [i for b in single for i in b]
    assert sorted(done + rest) == sorted(i for b in full for i in b)


def test_changed_weights_are_refused_on_resume():
    state = mix((0.5, 0.5)).state_dict()
    with pytest.raises(ValueError, match=r"source_weights: saved \[0.5, 0.5\], now \[0.25, 0.75\]"):
        mix((0.25, 0.75)).load_state_dict(state)


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="weights must be >= 0 and not all 0"):
        mix((0, 0))
    with pytest.raises(ConfigError, match="data.train_weights needs one weight per name of data.train_sources"):
        load_config(None, ["data.train_sources={a: x.jsonl, b: y.jsonl}", "data.train_weights={a: 1}"])
    with pytest.raises(ConfigError, match="data.train_weights=.* entry 'a' .* must be >= 0"):
        load_config(None, ["data.train_sources={a: x.jsonl}", "data.train_weights={a: -1}"])
    with pytest.raises(ConfigError, match="data.train_manifest and data.train_sources both name"):
        load_config(None, ["data.train_sources={a: x.jsonl}", "data.train_manifest=y.jsonl"])


# ------------------------------------------------------------------ through build_dataloader


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(4)
    a = write_synthetic_corpus(str(root / "a"), np.round(rng.uniform(0.7, 1.5, 12), 3), seed=1)
    b = write_synthetic_corpus(str(root / "b"), np.round(rng.uniform(0.7, 1.5, 36), 3), seed=2)
    write_shards(b, str(root / "b_shards"), shard_size=9)
    return a, str(root / "b_shards"), CharTokenizer.build(f"{a},{b}")


def cfg(sources, **kw):
    base = dict(max_duration=4.0, num_buckets=3, num_workers=0, num_mel_bins=20, train_sources=sources)
    base.update(kw)
    return DataConfig(**base)


def test_named_sources_reach_the_batches_and_their_weights_the_epoch(two_sources):
    a, b, tok = two_sources
    sources = {"a": a, "b": b}  # a manifest and a shard set
    loader = build_dataloader(sources, cfg(sources, train_weights={"a": 0.5, "b": 0.5}), tok, train=True)
    got = [(s, i) for batch in loader for s, i in zip(batch["sources"], batch["ids"])]
    assert sorted(s for s, _ in got) == ["a"] * 12 + ["b"] * 12
    assert {i for s, i in got if s == "a"} == {e.id for e in load_manifest(a)}
    evaluation = build_dataloader(sources, cfg(sources), tok, train=False)
    names = [s for batch in evaluation for s in batch["sources"]]
    assert sorted(names) == ["a"] * 12 + ["b"] * 36  # evaluation: every utterance once, unweighted


def test_sources_get_their_own_augmentation(two_sources):
    a, _, tok = two_sources
    sources = {"x": a, "y": a}  # the same audio twice: only the seeds differ
    c = cfg(sources, speed_perturb=[0.8, 0.9, 1.0, 1.1, 1.2], features="raw", validate=False)
    loader = build_dataloader(sources, c, tok, train=True)
    ds = loader.dataset
    lens = [(ds[i]["audio"].numel(), ds[i + 12]["audio"].numel()) for i in range(12)]
    assert any(x != y for x, y in lens)


def test_the_recipe_reports_metrics_per_source():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from finetune_asr import CTCObjective

    tok = CharTokenizer.build(["ab", "ba"])
    hyps = ["ab", "ab", "ba"]

    def model(feats, lens):  # emits each hypothesis' characters, one per frame
        ids = [tok.encode(h) for h in hyps]
        lp = torch.full((len(ids), 4, tok.vocab_size), -30.0)
        for r, seq in enumerate(ids):
            for t in range(4):
                lp[r, t, seq[t] if t < len(seq) else 0] = 0.0
        return lp, torch.full((len(ids),), 4)

    batch = {"features": torch.zeros(3, 4, 1), "feature_lens": torch.full((3,), 4),
             "texts": ["ab", "ba", "ba"], "sources": ["x", "y", "x"]}
    out = CTCObjective(tok).error_counts(model, batch)
    assert out["wer"] == (1, 3)  # the existing names, unchanged
    assert out["wer/x"] == (0, 2) and out["wer/y"] == (1, 1)
    assert set(out) == {"wer", "cer", "wer/x", "cer/x", "wer/y", "cer/y"}
    del batch["sources"]
    assert set(CTCObjective(tok).error_counts(model, batch)) == {"wer", "cer"}


def test_the_demo_mix_config_loads_and_takes_weights_from_the_command_line(monkeypatch):
    import importlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "examples"))
    schema = importlib.import_module("finetune_asr").ASRConfig
    cfg = load_config(os.path.join(root, "configs", "asr_demo_mix.yaml"),
                      ["data.train_weights.accent=0.25", "data.train_weights.base=0.75"], schema=schema)
    assert cfg.data.train_weights == {"accent": 0.25, "base": 0.75}
    assert list(cfg.data.train_sources) == list(cfg.data.eval_sources) == ["accent", "base"]


# ------------------------------------------------------------------ duplicates across sources (issue 30, item 4)


def _lines(entries, **change):
    return "".join(json.dumps({"audio_filepath": e.audio_filepath, "duration": e.duration, "text": e.text,
                               **{k: f(i, e) for k, f in change.items()}}) + "\n" for i, e in enumerate(entries))


def test_the_same_utterances_in_two_sources_are_found_by_id_and_by_audio_path(two_sources, tmp_path):
    from ddptrain.data import DataError

    a, _, tok = two_sources
    new = load_manifest(write_synthetic_corpus(str(tmp_path / "new"), [1.0, 1.2], seed=9))
    again = tmp_path / "again.jsonl"  # three of a's utterances under other ids, and two new ones
    again.write_text(_lines(load_manifest(a)[:3], id=lambda i, e: f"other{i}") + _lines(new, id=lambda i, e: f"new{i}"))
    sources = {"a": a, "again": str(again)}
    with pytest.raises(DataError) as err:
        build_dataloader(sources, cfg(sources), tok, train=True)
    msg = str(err.value)
    assert f"{again}:1 (id other0): duplicate audio" in msg and f"{a}:1" in msg and f"{again}:4" not in msg
    loader = build_dataloader(sources, cfg(sources, bad_data="skip"), tok, train=True)
    assert sum(len(b["ids"]) for b in loader) == 12 + 2  # each utterance once
    # the same manifest named by two sources: the same ids
    twice = {"x": a, "y": f"{a},{again}"}
    with pytest.raises(DataError, match=rf"{a}:1: duplicate id.*source 'x'"):
        build_dataloader(twice, cfg(twice), tok, train=True)
    # plain comma-separated manifests: by audio path too
    with pytest.raises(DataError, match=rf"{again}:2 \(id other1\): duplicate audio"):
        build_dataloader(f"{a},{again}", cfg(""), tok, train=True)


def test_the_same_utterances_in_two_shard_sets_are_found(two_sources, tmp_path):
    from ddptrain.data import DataError

    a, _, tok = two_sources
    write_shards(a, str(tmp_path / "one"), shard_size=5)
    write_shards(a, str(tmp_path / "two"), shard_size=4, seed=3)
    for sources in ({"x": str(tmp_path / "one"), "y": str(tmp_path / "two")},
                    {"x": f"{tmp_path / 'one'},{tmp_path / 'two'}"}, {"m": a, "s": str(tmp_path / "two")}):
        with pytest.raises(DataError, match=r"(?s)12 of 24 utterance\(s\) have problems.*two/shard-0000\d\d.tar:\d+ "
                                            r"\(id .*\): duplicate id"):
            build_dataloader(sources, cfg(sources), tok, train=True)


# ------------------------------------------------------------------ issue 49, item 12


def test_huge_weights_mean_their_ratio():
    """Weights whose sum overflows (1e308 + 1e308) are shares like any others, not a crash."""
    want = drawn(mix((1, 3)))
    assert np.array_equal(drawn(mix((0.5e308, 1.5e308))), want)
    assert mix((1e308, 1e308)).weights == [0.5, 0.5]
    from ddptrain.data.mix import mix_shares

    assert mix_shares([1e308, 1e308], 2.0).tolist() == [0.5, 0.5]


def test_overlapping_eval_sources_get_an_evaluation_message(two_sources, tmp_path):
    from ddptrain.data import DataError

    a, _, tok = two_sources
    again = tmp_path / "again.jsonl"  # two of a's utterances under other ids
    again.write_text(_lines(load_manifest(a)[:2], id=lambda i, e: f"other{i}"))
    for sources in ({"a": a, "again": str(again)}, f"{a},{again}"):  # named sources, or manifests in a row
        with pytest.raises(DataError) as err:
            build_dataloader(sources, cfg(sources if isinstance(sources, dict) else ""), tok, train=False)
        msg = str(err.value)
        assert f"{again}:1 (id other0): duplicate audio" in msg and "train twice" not in msg, msg
        assert "it would be scored twice in every evaluation" in msg, msg
    with pytest.raises(DataError, match="it would train twice an epoch"):  # training keeps its words
        build_dataloader({"a": a, "again": str(again)}, cfg({"a": a, "again": str(again)}), tok, train=True)
