"""DurationBucketSampler: coverage, budget, determinism, resume, resharding, statistics.

Lhotse style: every rank is built with explicit ``world_size=`` / ``rank=``; no process group.
"""

import collections

import numpy as np
import pytest

from ddptrain.data.sampler import DurationBucketSampler


def librispeech_like(n, seed=0, median=12.0, sigma=0.5, lo=1.0, hi=35.0):
    return np.clip(np.random.default_rng(seed).lognormal(np.log(median), sigma, n), lo, hi)


def all_ranks(durations, world_size, epoch=0, **kw):
    """Per-rank batch lists for one epoch."""
    out = []
    for r in range(world_size):
        s = DurationBucketSampler(durations, world_size=world_size, rank=r, **kw)
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s)
        out.append(batches)
    return out


def cost(d, q):
    return d + d * d / q if q else d


DURS = librispeech_like(3000)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("tail", ["split", "exact"])
def test_exact_tails_cover_each_utterance_once_with_equal_batch_counts(world_size, tail):
    ranks = all_ranks(DURS, world_size, max_duration=150, tail=tail, seed=3)
    assert len({len(b) for b in ranks}) == 1, "every rank must get the same number of batches"
    flat = [i for batches in ranks for b in batches for i in b]
    assert sorted(flat) == list(range(len(DURS)))
    for r in range(world_size):  # disjoint
        others = {i for rr in range(world_size) if rr != r for b in ranks[rr] for i in b}
        assert not others & {i for b in ranks[r] for i in b}


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_duplicate_and_drop_tails_are_explicit_and_bounded(world_size):
    n_batches = len(DurationBucketSampler(DURS, max_duration=150, tail="split", shuffle=True, seed=3))
    for tail in ("duplicate", "drop"):
        ranks = all_ranks(DURS, world_size, max_duration=150, tail=tail, seed=3)
        assert len({len(b) for b in ranks}) == 1
        flat = [i for batches in ranks for b in batches for i in b]
        counts = collections.Counter(flat)
        stats = DurationBucketSampler(DURS, max_duration=150, tail=tail, seed=3, world_size=world_size,
                                      rank=0).epoch_stats()
        if tail == "duplicate":
            assert set(counts) == set(range(len(DURS)))  # nothing lost
            assert len(flat) - len(DURS) == stats["duplicated_utterances"]
            assert len(ranks[0]) == -(-n_batches // world_size)
        else:
            assert max(counts.values()) == 1  # nothing twice
            assert len(DURS) - len(flat) == stats["dropped_utterances"]
            assert len(ranks[0]) == n_batches // world_size


@pytest.mark.parametrize("n, world_size", [(1, 2), (1, 8), (3, 8), (5, 3), (7, 8), (9, 8)])
@pytest.mark.parametrize("tail", ["split", "duplicate", "exact"])
def test_tiny_data_sets_give_every_rank_the_same_number_of_batches(n, world_size, tail):
    durs = librispeech_like(n, seed=n)
    ranks = all_ranks(durs, world_size, max_duration=40, tail=tail)
    assert len({len(b) for b in ranks}) == 1 and len(ranks[0]) >= 1
    flat = [i for batches in ranks for b in batches for i in b]
    assert set(flat) == set(range(n))  # covered
    if tail == "exact":
        assert sorted(flat) == list(range(n))  # exactly once; fillers are empty batches
    else:
        assert all(len(b) > 0 for batches in ranks for b in batches)  # a training step needs data


def test_drop_tail_on_tiny_data_gives_empty_but_equal_epochs():
    ranks = all_ranks(librispeech_like(3), 8, max_duration=40, tail="drop")
    assert {len(b) for b in ranks} == {0}


@pytest.mark.parametrize("q, cap", [(0.0, 0), (0.0, 7), (20.0, 0), (30.0, 5)])
def test_every_batch_respects_the_padded_budget_and_cap(q, cap):
    for world_size in (1, 3):
        for batches in all_ranks(DURS, world_size, max_duration=120, quadratic_duration=q, max_batch_size=cap):
            for b in batches:
                longest = DURS[b].max()
                assert len(b) * cost(longest, q) <= 120 + 1e-9
                if cap:
                    assert len(b) <= cap


def test_quadratic_duration_gives_long_utterances_smaller_batches():
    plain = DurationBucketSampler(DURS, max_duration=200)
    quad = DurationBucketSampler(DURS, max_duration=200, quadratic_duration=15)
    assert quad.bucket_batch_sizes[-1] < plain.bucket_batch_sizes[-1]
    # the relative shrink grows with length: long buckets lose more than short ones
    ratios = np.array(quad.bucket_batch_sizes) / np.array(plain.bucket_batch_sizes)
    assert ratios[-1] < ratios[0]


def test_an_utterance_longer_than_the_budget_is_an_error():
    with pytest.raises(ValueError, match="do not fit in a batch of max_duration=30"):
        DurationBucketSampler([5.0, 31.0, 12.0], max_duration=30)


def test_bad_arguments_are_errors():
    for kw in [dict(tail="wrap"), dict(world_size=2, rank=2), dict(max_duration=0), dict(seed=-1)]:
        with pytest.raises(ValueError):
            DurationBucketSampler(DURS, **{"max_duration": 100, **kw})
    with pytest.raises(ValueError, match="non-empty"):
        DurationBucketSampler([], max_duration=100)
    with pytest.raises(ValueError, match="finite and > 0"):
        DurationBucketSampler([1.0, float("nan")], max_duration=100)


def test_buckets_hold_about_equal_total_duration():
    s = DurationBucketSampler(DURS, max_duration=200, num_buckets=20)
    totals = np.array([DURS[m].sum() for m in s._buckets])
    assert len(totals) == 20
    assert totals.max() / totals.min() < 1.1
    edges = s.bucket_edges
    assert all(a <= b for a, b in edges) and all(edges[i][1] <= edges[i + 1][0] for i in range(len(edges) - 1))


def test_many_equal_durations_do_not_make_empty_buckets():
    durs = np.r_[np.full(500, 35.0), np.full(500, 1.0), librispeech_like(100)]
    s = DurationBucketSampler(durs, max_duration=200, num_buckets=50)
    assert all(len(m) for m in s._buckets)
    assert sorted(i for b in s for i in b) == list(range(len(durs)))


def test_same_seed_same_batches_and_other_epoch_or_seed_other_batches():
    def epoch_batches(seed, epoch):
        s = DurationBucketSampler(DURS, max_duration=150, seed=seed, world_size=2, rank=1)
        s.set_epoch(epoch)
        return list(s)

    a = epoch_batches(7, 0)
    assert a == epoch_batches(7, 0)
    b = epoch_batches(7, 1)
    c = epoch_batches(8, 0)
    assert a != b and a != c
    # not just a reordering: batch contents change between epochs too
    sets_a = {tuple(sorted(x)) for x in a}
    sets_b = {tuple(sorted(x)) for x in b}
    assert len(sets_a & sets_b) < 0.2 * len(sets_a)


def test_batches_are_shuffled_across_buckets():
    s = DurationBucketSampler(DURS, max_duration=150, seed=0)
    means = np.array([DURS[b].mean() for b in s])
    # sorted order would give a correlation of ~1 with the batch position
    assert abs(np.corrcoef(np.arange(len(means)), means)[0, 1]) < 0.2
    ordered = DurationBucketSampler(DURS, max_duration=150, shuffle=False)
    means = np.array([DURS[b].mean() for b in ordered])
    assert np.all(np.diff(means) >= -1e-9) or np.corrcoef(np.arange(len(means)), means)[0, 1] > 0.95
    assert list(ordered) == list(ordered)  # no randomness without shuffle


def test_one_rank_plan_does_not_depend_on_sync_buckets():
    for tail in ("split", "duplicate"):
        a = all_ranks(DURS, 1, max_duration=150, seed=4, tail=tail, sync_buckets=True)
        b = all_ranks(DURS, 1, max_duration=150, seed=4, tail=tail, sync_buckets=False)
        assert a == b


def _step_spread(ranks):
    """Per step: longest utterance of the costliest batch / of the cheapest batch."""
    return np.array([max(DURS[b].max() for b in step) / min(DURS[b].max() for b in step)
                     for step in zip(*ranks)])


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_sync_buckets_give_the_ranks_of_a_step_batches_from_one_bucket(world_size):
    kw = dict(max_duration=150, seed=5, tail="split")
    s0 = DurationBucketSampler(DURS, world_size=world_size, rank=0, **kw)
    bucket_of = np.empty(len(DURS), dtype=np.int64)
    for k, members in enumerate(s0._buckets):
        bucket_of[members] = k
    synced = all_ranks(DURS, world_size, **kw)
    steps = list(zip(*synced))
    mixed = sum(len({int(bucket_of[b[0]]) for b in step}) > 1 for step in steps)
    # only the leftover batches (fewer than world_size per bucket) and the tail step may mix
    assert mixed <= len(s0._buckets) + 1, (mixed, len(steps))
    # the costliest batch of a step is close to the cheapest; without syncing it is not
    free = all_ranks(DURS, world_size, sync_buckets=False, **kw)
    # (measured here: median 1.007 / 1.015 / 1.048 synced vs 1.53 / 2.01 / 3.64 free, W = 2 / 3 / 8)
    assert np.median(_step_spread(synced)) < 1.1
    assert np.median(_step_spread(free)) > 1.4
    # the sampler reports the same balance (in its cost model: padded seconds)
    balance = {}
    for plan, sync in ((synced, True), (free, False)):
        stats = DurationBucketSampler(DURS, world_size=world_size, rank=0, sync_buckets=sync, **kw).epoch_stats()
        c = np.array([[len(b) * DURS[b].max() for b in step] for step in zip(*plan)])
        assert stats["step_balance"] == pytest.approx(c.mean(1).sum() / c.max(1).sum())
        balance[sync] = stats["step_balance"]
    # (measured here: 0.994 / 0.984 / 0.952 synced vs 0.926 / 0.913 / 0.888 free, W = 2 / 3 / 8)
    assert balance[True] > balance[False] + 0.05
    # and the plan still covers every utterance once, with the same batches overall
    assert sorted(i for r in synced for b in r for i in b) == list(range(len(DURS)))
    assert len(synced[0]) == len(free[0])


def test_sync_buckets_shuffle_the_runs():
    ranks = all_ranks(DURS, 2, max_duration=150, seed=0)
    means = np.array([DURS[b].mean() for b in ranks[0]])
    assert abs(np.corrcoef(np.arange(len(means)), means)[0, 1]) < 0.2
    other = all_ranks(DURS, 2, max_duration=150, seed=0, epoch=1)
    assert ranks != other


def test_padding_is_small_on_a_librispeech_like_distribution():
    durs = librispeech_like(20000, seed=1)
    stats = DurationBucketSampler(durs, max_duration=200, seed=0, world_size=4, rank=0).epoch_stats()
    assert stats["padding_fraction"] < 0.03
    # and measured directly from the batches, on every epoch
    s = DurationBucketSampler(durs, max_duration=200, seed=0)
    for epoch in range(2):
        s.set_epoch(epoch)
        batches = list(s)
        real = sum(durs[b].sum() for b in batches)
        padded = sum(len(b) * durs[b].max() for b in batches)
        assert 1 - real / padded < 0.03


def test_epoch_stats_match_the_batches():
    durs = np.array([1.0, 2.0, 3.0, 4.0, 10.0, 10.0])
    s = DurationBucketSampler(durs, max_duration=20, num_buckets=1, shuffle=False)
    batches = list(s)  # one bucket, sorted, batch size floor(20 / 10) = 2
    assert batches == [[0, 1], [2, 3], [4, 5]]
    st = s.epoch_stats()
    assert st["num_batches"] == 3 and st["batch_size_max"] == 2 and st["batch_size_mean"] == 2
    assert st["padding_fraction"] == pytest.approx(1 - 30 / (2 * 2 + 2 * 4 + 2 * 10))


def test_batch_count_is_the_same_every_epoch():
    s = DurationBucketSampler(DURS, max_duration=150, world_size=3, rank=2)
    lens = set()
    for epoch in range(4):
        s.set_epoch(epoch)
        lens.add(len(s))
        assert len(list(s)) == len(s)
    assert len(lens) == 1


# ---------------------------------------------------------------------- resume


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_first_k_plus_rest_equals_uninterrupted(world_size):
    kw = dict(max_duration=150, seed=5, world_size=world_size)
    for rank in range(world_size):
        ref = DurationBucketSampler(DURS, rank=rank, **kw)
        ref.set_epoch(2)
        full = list(ref)
        for k in [0, 1, 7, len(full) // 2, len(full) - 1, len(full)]:
            a = DurationBucketSampler(DURS, rank=rank, **kw)
            a.set_epoch(2)
            it = iter(a)
            head = [next(it) for _ in range(k)]
            state = a.state_dict()
            assert state["epoch"] == 2 and state["position"] == k
            b = DurationBucketSampler(DURS, rank=rank, **kw)
            b.load_state_dict(state)
            b.set_epoch(2)  # a Trainer re-announcing the resumed epoch must not lose the position
            assert len(b) == len(full)
            assert head + list(b) == full
            b.set_epoch(3)  # and the next epoch is complete again
            assert len(list(b)) == len(b)


def test_trainer_overwrites_position_with_what_it_consumed():
    # The DataLoader prefetches: the sampler has handed out more batches than were trained on.
    s = DurationBucketSampler(DURS, max_duration=150, seed=1)
    s.set_epoch(4)
    ref = DurationBucketSampler(DURS, max_duration=150, seed=1)
    ref.set_epoch(4)
    full = list(ref)
    it = iter(s)
    for _ in range(10):
        next(it)  # handed out 10 ...
    state = s.state_dict()
    assert state["position"] == 10
    state["position"] = 6  # ... but the training loop consumed 6
    r = DurationBucketSampler(DURS, max_duration=150, seed=1)
    r.load_state_dict(state)
    assert list(r) == full[6:]


@pytest.mark.parametrize("world_size", [1, 2])
def test_iter_twice_before_consuming_keeps_the_resume_position(world_size):
    # torch's DataLoader with workers calls iter(batch_sampler) twice when it makes an epoch's
    # iterator (_BaseDataLoaderIter.__init__ and _MultiProcessingDataLoaderIter._reset) and
    # consumes only the second one
    kw = dict(max_duration=150, seed=2, world_size=world_size)
    for rank in range(world_size):
        ref = DurationBucketSampler(DURS, rank=rank, **kw)
        ref.set_epoch(1)
        full = list(ref)
        s = DurationBucketSampler(DURS, rank=rank, **kw)
        s.load_state_dict(dict(ref.state_dict(), position=5))
        s.set_epoch(1)
        unused = iter(s)  # noqa: F841
        assert s.state_dict()["position"] == 5, "making an iterator must not use up the position"
        assert list(iter(s)) == full[5:]
        assert list(s) == full, "once an iteration has started, the next one is a fresh epoch"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_workers_resumes_at_the_position(workers):
    import torch

    ref = DurationBucketSampler(DURS[:400], max_duration=100, seed=4)
    full = list(ref)
    s = DurationBucketSampler(DURS[:400], max_duration=100, seed=4)
    s.load_state_dict(dict(ref.state_dict(), position=3))
    loader = torch.utils.data.DataLoader(range(400), batch_sampler=s, num_workers=workers,
                                         collate_fn=lambda b: [int(i) for i in b])
    assert list(loader) == full[3:]


def test_position_resets_after_a_complete_epoch_and_iteration_restarts():
    s = DurationBucketSampler(DURS[:200], max_duration=100, seed=1)
    first = list(s)
    assert s.state_dict()["position"] == 0
    assert list(s) == first  # same epoch again: the whole epoch, not an empty tail


def test_state_dict_is_plain_and_has_the_keys_the_trainer_uses():
    s = DurationBucketSampler(DURS, max_duration=150, world_size=2, rank=1)
    st = s.state_dict()
    for key in ("epoch", "position", "seed", "world_size", "rank", "num_utterances", "max_duration"):
        assert key in st
    import json

    assert json.loads(json.dumps(st)) == st  # plain Python types


def test_load_state_dict_rejects_other_setups_by_name():
    s = DurationBucketSampler(DURS, max_duration=150, seed=1, world_size=2, rank=0)
    st = s.state_dict()
    cases = [
        (DurationBucketSampler(DURS, max_duration=150, seed=2, world_size=2, rank=0), "seed: saved 1, now 2"),
        (DurationBucketSampler(DURS[:-1], max_duration=150, seed=1, world_size=2, rank=0), "num_utterances"),
        (DurationBucketSampler(DURS[::-1].copy(), max_duration=150, seed=1, world_size=2, rank=0), "fingerprint"),
        (DurationBucketSampler(DURS, max_duration=100, seed=1, world_size=2, rank=0), "max_duration"),
        (DurationBucketSampler(DURS, max_duration=150, seed=1, world_size=2, rank=0, sync_buckets=False),
         "sync_buckets: saved True, now False"),
        (DurationBucketSampler(DURS, max_duration=150, seed=1, world_size=2, rank=1), "is for rank 0"),
    ]
    for other, msg in cases:
        with pytest.raises(ValueError, match=msg):
            other.load_state_dict(st)
    with pytest.raises(ValueError, match="unexpected key"):
        s.load_state_dict({**st, "extra": 1})
    with pytest.raises(ValueError, match="missing key 'position'"):
        s.load_state_dict({k: v for k, v in st.items() if k != "position"})
    with pytest.raises(ValueError, match="outside epoch"):
        s.load_state_dict({**st, "position": len(s) + 1})
    s.load_state_dict(st)  # the untouched state still loads
    # a state saved before sync_buckets existed was an unsynchronised plan
    old = {k: v for k, v in st.items() if k != "sync_buckets"}
    with pytest.raises(ValueError, match="sync_buckets: saved False, now True"):
        s.load_state_dict(old)
    DurationBucketSampler(DURS, max_duration=150, seed=1, world_size=2, rank=0, sync_buckets=False).load_state_dict(old)


@pytest.mark.parametrize("old_w, new_w, k", [(4, 2, 5), (2, 3, 0), (3, 8, 11), (8, 1, 3), (2, 5, 40)])
def test_loading_another_world_size_reshards_exactly(old_w, new_w, k):
    kw = dict(max_duration=150, seed=9)
    consumed = []
    for r in range(old_w):  # the old job: every rank trains k batches of epoch 1
        s = DurationBucketSampler(DURS, world_size=old_w, rank=r, **kw)
        s.set_epoch(1)
        it = iter(s)
        consumed += [i for _ in range(k) for i in next(it)]
        state = s.state_dict()
    rest = []
    lens = set()
    for r in range(new_w):  # the new job loads (any rank's) state; ranks only differ in "rank"
        s = DurationBucketSampler(DURS, world_size=new_w, rank=r, **kw)
        s.load_state_dict(state)
        s.set_epoch(1)
        batches = list(s)
        lens.add(len(s))
        assert len(batches) == len(s) - k  # position counts batches of the epoch done so far
        rest += [i for b in batches for i in b]
        st2 = s.state_dict()
        assert st2["epoch"] == 1
    assert len(lens) == 1
    assert sorted(consumed + rest) == list(range(len(DURS)))  # each utterance exactly once


def test_two_reshards_in_one_epoch_stay_exact_and_resume_after_the_second():
    kw = dict(max_duration=150, seed=2)
    consumed = []

    def run(world, state, steps):
        out_state = None
        for r in range(world):
            s = DurationBucketSampler(DURS, world_size=world, rank=r, **kw)
            if state is not None:
                s.load_state_dict(state)
            else:
                s.set_epoch(0)
            it = iter(s)
            for _ in range(steps):
                consumed.extend(next(it))
            st = s.state_dict()
            out_state = st
        return out_state

    st = run(4, None, 3)
    st = run(3, st, 4)  # position 3 -> 7
    assert st["position"] == 7
    st = run(2, st, 2)  # and a plain resume (same world size) in the middle
    rest = []
    for r in range(2):
        s = DurationBucketSampler(DURS, world_size=2, rank=r, **kw)
        s.load_state_dict({**st, "rank": r})
        rest += [i for b in s for i in b]
    assert sorted(consumed + rest) == list(range(len(DURS)))


def test_a_reshard_does_not_leak_into_the_next_epoch_when_the_trainer_advances_the_epoch():
    kw = dict(max_duration=150, seed=4)
    s = DurationBucketSampler(DURS, world_size=4, rank=0, **kw)
    s.set_epoch(0)
    it = iter(s)
    next(it)
    st = s.state_dict()
    n = DurationBucketSampler(DURS, world_size=2, rank=0, **kw)
    n.load_state_dict(st)  # resharded epoch 0 ...
    list(n)
    st = n.state_dict()
    assert st["reshard_history"]
    st.update(epoch=1, position=0)  # ... the Trainer saves at the epoch boundary
    m = DurationBucketSampler(DURS, world_size=2, rank=0, **kw)
    m.load_state_dict(st)
    fresh = DurationBucketSampler(DURS, world_size=2, rank=0, **kw)
    fresh.set_epoch(1)
    assert list(m) == list(fresh)


@pytest.mark.parametrize("seed", range(12))
def test_synchronised_plans_keep_the_sampler_contract_on_random_setups(seed):
    """Random sizes, world sizes, budgets, pools, bucket counts and tails, with sync_buckets on:
    equal batch counts, budget kept, coverage, and an exact reshard onto another world size."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    durs = librispeech_like(n, seed=seed)
    world = int(rng.integers(2, 9))
    tail = ("split", "exact", "duplicate")[seed % 3]
    kw = dict(max_duration=float(rng.uniform(36, 200)), sort_pool=int(rng.integers(0, 9)),
              num_buckets=int(rng.integers(1, 40)), seed=seed, tail=tail)
    ranks = all_ranks(durs, world, **kw)
    assert len({len(b) for b in ranks}) == 1
    flat = [i for r in ranks for b in r for i in b]
    assert set(flat) == set(range(n))
    if tail == "exact":
        assert sorted(flat) == list(range(n))
    assert all(len(b) * durs[b].max() <= kw["max_duration"] + 1e-9 for r in ranks for b in r if len(b))
    if tail != "exact":
        return
    # reshard after k steps onto another world size: every utterance still exactly once
    k = int(rng.integers(0, len(ranks[0]) + 1))
    new_world = int(rng.integers(1, 9))
    consumed = [i for r in ranks for b in r[:k] for i in b]
    s = DurationBucketSampler(durs, world_size=world, rank=0, **kw)
    it = iter(s)
    for _ in range(k):
        next(it)
    state = s.state_dict()
    rest = []
    for r in range(new_world):
        s2 = DurationBucketSampler(durs, world_size=new_world, rank=r, **kw)
        s2.load_state_dict(state)
        rest += [i for b in s2 for i in b]
    assert sorted(consumed + rest) == list(range(n))


class HalvedBatches(DurationBucketSampler):
    """A subclass with its own deal: every batch of the base plan cut in two (twice the batches)."""

    def _base_batches(self, epoch, group):
        return [half for b in super()._base_batches(epoch, group) for half in np.array_split(b, 2) if half.size]


def test_a_reshard_recomputes_the_old_deal_with_the_subclass_own_plan():
    kw = dict(max_duration=150, seed=6, sync_buckets=False)
    base_len = len(DurationBucketSampler(DURS, world_size=2, rank=0, **kw))
    k = base_len + 3  # a position only the subclass's plan reaches
    consumed = []
    for r in range(2):
        s = HalvedBatches(DURS, world_size=2, rank=r, **kw)
        it = iter(s)
        consumed += [i for _ in range(k) for i in next(it)]
        state = s.state_dict()
    rest = []
    for r in range(3):
        s = HalvedBatches(DURS, world_size=3, rank=r, **kw)
        s.load_state_dict(state)  # the old deal is HalvedBatches' at world size 2, not the base class's
        rest += [i for b in s for i in b]
    assert sorted(consumed + rest) == list(range(len(DURS)))


def test_a_reshard_checks_the_position_against_a_weighted_mix_plan():
    from ddptrain.data.mix import WeightedMixSampler

    sources = np.arange(len(DURS)) % 2
    kw = dict(max_duration=150, seed=1, world_size=2)
    s = WeightedMixSampler(DURS, sources, [1.0, 0.2], ["a", "b"], rank=0, **kw)  # "b" sparse: a short epoch
    assert len(s) < len(DurationBucketSampler(DURS, rank=0, **kw))
    state = {**s.state_dict(), "position": len(s) + 1}  # past the mix's epoch, inside the base plan's
    new = WeightedMixSampler(DURS, sources, [1.0, 0.2], ["a", "b"], max_duration=150, seed=1, world_size=3, rank=0)
    with pytest.raises(ValueError, match="outside epoch"):
        new.load_state_dict(state)


PB_DURS = np.clip(np.random.default_rng(0).lognormal(np.log(12.0), 0.5, 3000), 1.0, 35.0)
PB_TOKS = np.maximum(1, np.round(PB_DURS * np.random.default_rng(1).uniform(1.0, 5.0, PB_DURS.size)))


def test_pessimistic_batch_is_the_longest_input_and_the_longest_target_of_the_bucket():
    DURS, TOKS, KW = PB_DURS, PB_TOKS, dict(max_duration=150, num_buckets=12, seed=4)
    s = DurationBucketSampler(DURS, tokens=TOKS, max_duration=150, max_tokens=600, num_buckets=12)
    for k in (0, 5, 11):
        members = [i for i in range(DURS.size) if s.bucket_edges[k][0] <= DURS[i] <= s.bucket_edges[k][1]]
        rows = s.pessimistic_batch(k, 5)
        assert len(rows) == 5 and DURS[rows].max() == DURS[members].max()
        assert TOKS[rows].max() == TOKS[members].max() == s.bucket_max_tokens[k]
        assert len(s.pessimistic_batch(k)) == s.bucket_batch_sizes[k]
    # without tokens: copies of the longest utterance, and one short row so the batch is padded
    # (a batch of one length would measure the mask-free path that training never takes)
    plain = DurationBucketSampler(DURS, **KW)
    rows = plain.pessimistic_batch(3, 4)
    shortest, longest = plain.bucket_edges[3]
    assert DURS[rows[0]] == shortest < longest and all(DURS[r] == longest for r in rows[1:])
    assert set(plain.pessimistic_batch(3, 1)) == {rows[1]}  # one row: the longest, nothing to pad
    # one duration (30 s windows bucketed by transcript): the targets are padded instead
    windows = DurationBucketSampler(np.full(DURS.size, 30.0), tokens=TOKS, max_duration=300, max_tokens=600,
                                    num_buckets=4)
    for k in range(4):
        rows = windows.pessimistic_batch(k, 3)
        assert TOKS[rows].max() == windows.bucket_max_tokens[k] > TOKS[rows].min()


def test_a_state_saved_with_a_per_bucket_budget_file_is_refused_and_one_without_resumes():
    """States saved while ``bucket_budgets`` existed carry the key: None (no file) resumes
    exactly; a file's batch sizes meant other batches, so that state is refused by name."""
    s = DurationBucketSampler(PB_DURS, max_duration=150, num_buckets=12, seed=4)
    it = iter(s)
    for _ in range(5):
        next(it)
    old = {**s.state_dict(), "bucket_budgets": None}
    resumed = DurationBucketSampler(PB_DURS, max_duration=150, num_buckets=12, seed=4)
    resumed.load_state_dict(old)
    assert list(resumed) == list(s)[5:]
    with pytest.raises(ValueError, match=r"bucket_budgets: saved \[3, 4\] \(a per-bucket budget file"):
        resumed.load_state_dict({**old, "bucket_budgets": [3, 4]})
