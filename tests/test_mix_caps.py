"""Mixing temperature and per-source exposure caps (ddptrain/data/mix.py): the shares' math, caps
in epochs and hours that are never exceeded, shorter epochs counted in the run's length, the end
of the run once every source is capped, exact mid-epoch resume, equal steps on 2 ranks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import ddptrain
from ddptrain.config import ConfigError, load_config
from ddptrain.data import DataConfig, build_dataloader
from ddptrain.data.mix import WeightedMixSampler, mix_shares
from _dist import run_ranks
from test_mix import DURS, SIZES, SRC, drawn, two_sources  # noqa: F401 (a fixture)
from test_resume import N_UTT, Recording, Utterances, collate
from test_trainer import FrameMLP, make_cfg

NAMES = ["accent", "base"]


def mix(weights=(0.5, 0.5), caps=None, **kw):
    base = dict(max_duration=25.0, num_buckets=10, seed=3)
    base.update(kw)
    return WeightedMixSampler(DURS, SRC, weights, NAMES, caps=caps, **base)


def run_epochs(sampler, epochs):
    """Per epoch: the indices drawn, and len() before iterating."""
    out = []
    for e in range(epochs):
        sampler.set_epoch(e)
        out.append((drawn(sampler), len(sampler)))
    return out


# ------------------------------------------------------------------ temperature


def test_temperature_shares_follow_b_to_the_one_over_t():
    b = np.array([100.0, 400.0, 0.0, 1600.0])
    assert np.allclose(mix_shares(b, 1.0), b / b.sum())
    root = np.sqrt(b)  # T = 2: square roots
    assert np.allclose(mix_shares(b, 2.0), root / root.sum())
    assert np.allclose(mix_shares(b, float("inf")), [1 / 3, 1 / 3, 0, 1 / 3])  # uniform over b > 0
    sharp = mix_shares(b, 0.5)  # T < 1: squares
    assert np.allclose(sharp, b ** 2 / (b ** 2).sum()) and sharp[3] > (b / b.sum())[3]
    assert np.allclose(mix_shares([3e6, 1.0], 0.01), [1.0, 0.0])  # no overflow at small T
    shares = [mix_shares(b, t)[0] for t in (1, 2, 5, 50)]
    assert shares == sorted(shares)  # the smallest source gains as T grows
    with pytest.raises(ValueError, match="mix_temperature must be > 0"):
        mix_shares(b, 0.0)
    with pytest.raises(ValueError, match="not all 0"):
        mix_shares([0, 0], 2.0)


def test_temperature_reaches_the_loaders_sampler_from_weights_or_sizes(two_sources):  # noqa: F811
    a, b, tok = two_sources  # 12 and 36 utterances
    sources = {"a": a, "b": b}
    c = dict(max_duration=4.0, num_buckets=3, num_workers=0, num_mel_bins=20, train_sources=sources)
    by_size = build_dataloader(sources, DataConfig(**c, mix_temperature=2.0), tok, train=True).batch_sampler
    assert np.allclose(by_size.weights, mix_shares([12, 36], 2.0))  # sizes^(1/2): 0.366 / 0.634
    weighted = build_dataloader(sources, DataConfig(**c, train_weights={"a": 1, "b": 9}, mix_temperature=float("inf")),
                                tok, train=True).batch_sampler
    assert weighted.weights == [0.5, 0.5]
    assert build_dataloader(sources, DataConfig(**c), tok, train=True).batch_sampler.weights == [0.25, 0.75]
    cfg = load_config(None, ["data.train_sources={a: x, b: y}", "data.mix_temperature=.inf"])
    assert cfg.data.mix_temperature == float("inf")
    for bad in ("0", "-1", "nan", "hot"):
        with pytest.raises(ConfigError, match="data.mix_temperature"):
            load_config(None, [f"data.mix_temperature={bad}"])


# ------------------------------------------------------------------ caps


def test_an_epochs_cap_of_one_draws_every_utterance_exactly_once_then_stops():
    s = mix(caps={"base": {"epochs": 1.0}})  # base gives 300 of its 1500 per epoch: 5 epochs of it
    epochs = run_epochs(s, 8)
    base = np.concatenate([idx[SRC[idx] == 1] for idx, _ in epochs])
    assert np.array_equal(np.sort(base), np.arange(SIZES[0], SIZES[0] + SIZES[1]))  # each once, none twice
    assert all(np.sum(SRC[idx] == 0) == 300 for idx, _ in epochs)  # the uncapped source keeps its draw
    assert [n for _, n in epochs] == s.epoch_lengths(8)  # the run's length counts the shorter epochs
    assert epochs[0][1] > epochs[-1][1] and np.sum(SRC[epochs[-1][0]] == 1) == 0
    assert s.end_epoch is None  # accent is uncapped: the run goes on


@pytest.mark.parametrize("hours", [0.3, 0.5, 2.5])
def test_an_hours_cap_is_never_exceeded_and_nearly_reached(hours):
    s = mix(caps={"base": {"hours": hours}})
    base = np.concatenate([idx[SRC[idx] == 1] for idx, _ in run_epochs(s, 14)])
    seconds = DURS[base].sum()
    assert hours * 3600 - 10 * DURS.max() < seconds <= hours * 3600  # within one utterance per bucket
    if hours * 3600 < DURS[SRC == 1].sum():
        assert np.unique(base).size == base.size  # under one pass of the source: no repeats


def test_when_every_source_is_capped_epochs_are_empty_from_end_epoch():
    s = mix(caps={"base": {"epochs": 1.0}, "accent": {"epochs": 2.0}})
    epochs = run_epochs(s, 8)
    assert s.end_epoch == 6
    assert [n for _, n in epochs][6:] == [0, 0] and all(n > 0 for _, n in epochs[:6])
    everything = np.concatenate([idx for idx, _ in epochs])
    assert np.bincount(SRC[everything]).tolist() == [600, 1500]
    assert mix(caps={"base": {"epochs": 1.0}}).end_epoch is None


def test_caps_are_checked_and_refused_by_name():
    with pytest.raises(ValueError, match="source_caps names 'other'"):
        mix(caps={"other": {"epochs": 1}})
    with pytest.raises(ValueError, match=r"source_caps\['base'\] must be \{epochs: x\} or \{hours: x\}"):
        mix(caps={"base": {"days": 1}})
    with pytest.raises(ValueError, match=r"source_caps\['base'\].hours must be a number > 0"):
        mix(caps={"base": {"hours": 0}})
    with pytest.raises(ConfigError, match=r"data.source_caps names 'c', which is not a source of data.train_sources"):
        load_config(None, ["data.train_sources={a: x, b: y}", "data.source_caps={c: {hours: 1}}"])
    with pytest.raises(ConfigError, match=r"data.source_caps=.*entry 'a' .* must be \{epochs: x\} or \{hours: x\}"):
        load_config(None, ["data.train_sources={a: x}", "data.source_caps={a: {epochs: 1, hours: 2}}"])
    with pytest.raises(ValueError, match=r"source_caps: saved \{'base': \{'epochs': 1.0\}\}, now \{\}"):
        mix().load_state_dict(mix(caps={"base": {"epochs": 1.0}}).state_dict())
    old = mix().state_dict()
    del old["source_caps"]  # a state saved before caps existed
    mix().load_state_dict(old)


@pytest.mark.parametrize("world", [1, 2])
def test_mid_epoch_resume_in_a_capped_epoch_is_exact(world):
    caps = {"base": {"hours": 0.5}}
    for epoch in (2, 3):  # the epoch the cap is reached in, and one after it
        ranks = [mix(caps=caps, world_size=world, rank=r) for r in range(world)]
        for r in ranks:
            r.set_epoch(epoch)
        full = [list(r) for r in ranks]
        assert len({len(f) for f in full}) == 1  # equal steps on every rank
        for r, f in zip(ranks, full):
            resumed = mix(caps=caps, world_size=world, rank=r.rank)
            resumed.load_state_dict(dict(r.state_dict(), epoch=epoch, position=3))
            assert list(resumed) == f[3:]


# ------------------------------------------------------------------ through the Trainer

SPLIT = 12  # Utterances 0..11 are source "a", the rest "b"


def _capped_loader(world=1, rank=0, caps=None):
    data = Utterances()
    src = [0 if i < SPLIT else 1 for i in range(N_UTT)]
    sampler = WeightedMixSampler([n / 10 for n in data.lens], src, (0.5, 0.5), ["a", "b"], max_duration=4.0,
                                 num_buckets=3, seed=3, world_size=world, rank=rank,
                                 caps=caps or {"a": {"epochs": 2.0}, "b": {"epochs": 1.0}})
    return DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=0)


def _fit(out, *extra, world=1, rank=0):
    torch.manual_seed(0)
    loss = Recording()
    t = ddptrain.Trainer(FrameMLP(dropout=0.1), loss, make_cfg(out, "checkpoint.keep_last=0", *extra),
                         _capped_loader(world, rank))
    t.fit()
    return t, loss.seen


def test_the_run_ends_when_every_source_is_capped_and_says_so(tmp_path, capsys):
    t, seen = _fit(tmp_path / "steps", "trainer.max_steps=1000")
    counts = {"a": sum(u < f"u{SPLIT:03d}" for u in seen)}
    assert counts["a"] == 2 * SPLIT and len(seen) - counts["a"] == N_UTT - SPLIT  # the caps, exactly
    assert t.step < 1000
    assert "every training source has reached its data.source_caps by epoch" in capsys.readouterr().err
    e, seen_e = _fit(tmp_path / "epochs", "trainer.max_epochs=50")
    assert seen_e == seen and e.step == t.step == e.total_steps  # the LR schedule's horizon counts the short epochs


def test_a_resumed_capped_run_sees_the_uninterrupted_batches(tmp_path):
    _, whole = _fit(tmp_path / "whole", "trainer.max_epochs=50")
    _, first = _fit(tmp_path / "cut", "trainer.max_steps=5")  # mid-epoch (2 steps of the first epochs are 3..4)
    t, rest = _fit(tmp_path / "cut", "trainer.max_epochs=50", "checkpoint.resume=auto")
    assert first + rest == whole


def _rank_worker(rank, world, out):
    t, seen = _fit(os.path.join(out, "run"), "trainer.max_steps=1000", world=world, rank=rank)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": seen, "step": t.step}, f)


@pytest.mark.timeout(180)
def test_two_ranks_take_equal_steps_and_share_the_caps(tmp_path):
    run_ranks(_rank_worker, 2, str(tmp_path), timeout=150)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert ranks[0]["step"] == ranks[1]["step"] > 0
    seen = ranks[0]["seen"] + ranks[1]["seen"]
    a = [u for u in seen if u < f"u{SPLIT:03d}"]
    assert sorted(a) == sorted([f"u{i:03d}" for i in range(SPLIT)] * 2)  # split tail: each twice, no copies
    assert sorted(u for u in seen if u >= f"u{SPLIT:03d}") == [f"u{i:03d}" for i in range(SPLIT, N_UTT)]
