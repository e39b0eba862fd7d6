"""DurationBucketSampler with a second length per utterance (``tokens``, ``max_tokens``): both
budgets hold, batches are grouped by tokens where durations tie, resume and its checks still hold.

Lhotse style: every rank is built with explicit ``world_size=`` / ``rank=``; no process group.
"""

import numpy as np
import pytest

from ddptrain.data.sampler import DurationBucketSampler

RNG = np.random.default_rng(0)
DURS = np.clip(RNG.lognormal(np.log(7.0), 0.6, 2000), 1.0, 30.0)
TOKS = np.maximum(1, np.round(DURS * RNG.uniform(1.0, 5.0, DURS.size)))  # speech rates differ
WINDOWS = np.full(DURS.size, 30.0)  # 30 s encoder windows: every utterance costs one window


def epoch(durations, world_size=1, rank=0, ep=0, **kw):
    s = DurationBucketSampler(durations, world_size=world_size, rank=rank, **kw)
    s.set_epoch(ep)
    return s, list(s)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_both_budgets_hold_and_every_utterance_is_seen_once(world_size):
    seen = []
    for r in range(world_size):
        s, batches = epoch(DURS, world_size, r, tokens=TOKS, max_duration=120, max_tokens=300)
        assert len(batches) == len(s)
        for b in batches:
            assert len(b) * DURS[b].max() <= 120 + 1e-9
            assert len(b) * TOKS[b].max() <= 300 + 1e-9
        seen += [i for b in batches for i in b]
    assert sorted(seen) == list(range(DURS.size))


def tokens_padding(batches, tokens):
    return 1 - sum(tokens[b].sum() for b in batches) / sum(len(b) * tokens[b].max() for b in batches)


def test_windows_of_equal_duration_are_grouped_by_tokens():
    _, plain = epoch(WINDOWS, max_duration=16 * 30, max_batch_size=16)
    _, grouped = epoch(WINDOWS, tokens=TOKS, max_duration=16 * 30, max_batch_size=16)
    assert {len(b) for b in grouped} <= set(range(1, 17)) and len(grouped) == len(plain)
    assert tokens_padding(grouped, TOKS) < 0.3 * tokens_padding(plain, TOKS)


def test_without_tokens_the_plan_is_unchanged():
    _, a = epoch(DURS, max_duration=100, seed=3)
    _, b = epoch(DURS, tokens=None, max_tokens=0, max_duration=100, seed=3)
    assert a == b


def test_resume_with_tokens_is_exact_and_other_tokens_are_refused():
    kw = dict(tokens=TOKS, max_duration=120, max_tokens=300, seed=2, world_size=2, rank=1)
    _, full = epoch(DURS, ep=1, **kw)
    a = DurationBucketSampler(DURS, **kw)
    a.set_epoch(1)
    it = iter(a)
    head = [next(it) for _ in range(5)]
    state = a.state_dict()
    b = DurationBucketSampler(DURS, **kw)
    b.load_state_dict(state)
    assert head + list(b) == full
    other = DurationBucketSampler(DURS, **{**kw, "tokens": TOKS + 1})
    with pytest.raises(ValueError, match="durations_fingerprint"):
        other.load_state_dict(state)
    budget = DurationBucketSampler(DURS, **{**kw, "max_tokens": 400})
    with pytest.raises(ValueError, match="max_tokens"):
        budget.load_state_dict(state)


def test_bad_tokens_are_errors():
    with pytest.raises(ValueError, match="one per utterance"):
        DurationBucketSampler(DURS, max_duration=100, tokens=TOKS[:-1])
    with pytest.raises(ValueError, match="needs tokens"):
        DurationBucketSampler(DURS, max_duration=100, max_tokens=10)
    with pytest.raises(ValueError, match="more than max_tokens"):
        DurationBucketSampler(DURS, max_duration=100, tokens=TOKS, max_tokens=float(TOKS.max()) - 1)
