"""DurationBucketSampler with per-bucket budgets (``bucket_budgets``, a file from ddptrain.tune):
the file's batch sizes are used, the sampler's contract holds (equal steps per rank, every
utterance once under ``tail=split``, exact resume, small padding), and a file of another data set
or a changed budget is refused by name.

Lhotse style: every rank is built with explicit ``world_size=`` / ``rank=``; no process group.
"""

import json

import numpy as np
import pytest

from ddptrain.data.sampler import BUDGET_FORMAT, DurationBucketSampler, write_bucket_budgets

DURS = np.clip(np.random.default_rng(0).lognormal(np.log(12.0), 0.5, 3000), 1.0, 35.0)
TOKS = np.maximum(1, np.round(DURS * np.random.default_rng(1).uniform(1.0, 5.0, DURS.size)))
KW = dict(max_duration=150, num_buckets=12, seed=4)


def tuned_sizes(sampler):
    """What a tuner finds when memory grows like B * T^1.5: short buckets take many more rows."""
    return [max(1, int(4000 / hi ** 1.5)) for _, hi in sampler.bucket_edges]


@pytest.fixture
def budget_file(tmp_path):
    plain = DurationBucketSampler(DURS, **KW)
    path = tmp_path / "budgets.json"
    write_bucket_budgets(path, plain, tuned_sizes(plain), memory_target_gb=100.0)
    return str(path), tuned_sizes(plain)


def ranks(world_size, budget_file, epoch=0, **kw):
    out = []
    for r in range(world_size):
        s = DurationBucketSampler(DURS, world_size=world_size, rank=r, bucket_budgets=budget_file, **{**KW, **kw})
        s.set_epoch(epoch)
        out.append((s, list(s)))
    return out


def test_the_file_sizes_replace_max_duration_and_max_batch_size_caps_them(budget_file):
    path, sizes = budget_file
    s = DurationBucketSampler(DURS, bucket_budgets=path, **KW)
    plain = DurationBucketSampler(DURS, **KW)
    assert s.bucket_batch_sizes == sizes != plain.bucket_batch_sizes
    assert s.bucket_edges == plain.bucket_edges  # the buckets themselves are the data set's
    capped = DurationBucketSampler(DURS, bucket_budgets=path, max_batch_size=20, **{k: v for k, v in KW.items()})
    assert capped.bucket_batch_sizes == [min(b, 20) for b in sizes]
    # a max_duration too small for the longest utterance is no error: the file decides
    DurationBucketSampler(DURS, bucket_budgets=path, **{**KW, "max_duration": 5.0})


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_every_utterance_once_equal_steps_and_each_batch_within_its_bucket_budget(budget_file, world_size):
    path, sizes = budget_file
    got = ranks(world_size, path, epoch=1)
    assert len({len(b) for _, b in got}) == 1, "every rank must get the same number of batches"
    flat = sorted(i for _, batches in got for b in batches for i in b)
    assert flat == list(range(DURS.size))
    s = got[0][0]
    edges = s.bucket_edges
    for _, batches in got:
        for b in batches:
            k = next(k for k, (lo, hi) in enumerate(edges) if lo <= DURS[b].min() and DURS[b].max() <= hi)
            assert len(b) <= sizes[k]
            assert len(b) * DURS[b].max() <= s.bucket_budget(k) + 1e-9
    stats = s.epoch_stats()
    assert 0.6 < stats["budget_fill"] <= 1.0 and stats["padding_fraction"] < 0.05


def test_resume_with_budgets_is_exact_across_a_restart_and_a_reshard(budget_file):
    path, _ = budget_file
    (_, full), = ranks(1, path, epoch=2)
    for world_size in (1, 2):
        states, heads = [], []
        for s, batches in ranks(world_size, path, epoch=2):
            it = iter(s)
            heads.append([next(it) for _ in range(7)])
            states.append(s.state_dict())
        if world_size == 1:
            b = DurationBucketSampler(DURS, bucket_budgets=path, world_size=1, rank=0, **KW)
            b.load_state_dict(states[0])
            assert heads[0] + list(b) == full
        else:  # 2 ranks -> 3 ranks mid-epoch: the rest is re-dealt, each utterance still once
            rest = []
            for r in range(3):
                b = DurationBucketSampler(DURS, bucket_budgets=path, world_size=3, rank=r, **KW)
                b.load_state_dict(states[0])
                rest += list(b)
            seen = sorted(i for batch in [*heads[0], *heads[1], *rest] for i in batch)
            assert seen == list(range(DURS.size))


def test_changed_budgets_or_a_state_without_them_are_refused_on_resume(budget_file, tmp_path):
    path, sizes = budget_file
    s = DurationBucketSampler(DURS, bucket_budgets=path, **KW)
    state = s.state_dict()
    assert json.loads(json.dumps(state)) == state
    other = tmp_path / "other.json"
    write_bucket_budgets(other, s, [b + 1 for b in sizes])
    with pytest.raises(ValueError, match="bucket_budgets: saved"):
        DurationBucketSampler(DURS, bucket_budgets=str(other), **KW).load_state_dict(state)
    with pytest.raises(ValueError, match="bucket_budgets: saved"):
        DurationBucketSampler(DURS, **KW).load_state_dict(state)
    plain_state = DurationBucketSampler(DURS, **KW).state_dict()
    with pytest.raises(ValueError, match="bucket_budgets: saved None"):
        s.load_state_dict(plain_state)
    # the same budgets under another file name resume fine: the sizes are what counts
    moved = tmp_path / "moved.json"
    moved.write_text(open(path).read())
    DurationBucketSampler(DURS, bucket_budgets=str(moved), **KW).load_state_dict(state)


def test_a_budget_file_of_another_data_set_or_bucketing_is_refused_naming_the_file(budget_file):
    path, _ = budget_file
    for durations, kw, what in [(DURS[:-1], KW, "num_utterances"), (DURS * 1.1, KW, "durations_fingerprint"),
                                (DURS, {**KW, "num_buckets": 10}, "num_buckets")]:
        with pytest.raises(ValueError, match="another data set") as e:
            DurationBucketSampler(durations, bucket_budgets=path, **kw)
        assert path in str(e.value) and what in str(e.value)
    with pytest.raises(ValueError, match="durations_fingerprint"):  # tokens are part of the data set
        DurationBucketSampler(DURS, tokens=TOKS, bucket_budgets=path, **KW)


def test_unreadable_or_malformed_budget_files_are_errors_naming_the_file(tmp_path):
    plain = DurationBucketSampler(DURS, **KW)
    ident = {"format": BUDGET_FORMAT, **plain.budget_identity()}
    cases = [("missing.json", None, "cannot read"), ("bad.json", "{not json", "cannot read"),
             ("fmt.json", json.dumps({"format": "x"}), "not a budget file"),
             ("rows.json", json.dumps({**ident, "buckets": [{"size": 3}]}), "batch_size"),
             ("zero.json", json.dumps({**ident, "buckets": [{"batch_size": 0}] * 12}), ">= 1"),
             ("count.json", json.dumps({**ident, "buckets": [{"batch_size": 3}] * 5}), "5 bucket budgets")]
    for name, text, msg in cases:
        p = tmp_path / name
        if text is not None:
            p.write_text(text)
        with pytest.raises(ValueError, match=msg) as e:
            DurationBucketSampler(DURS, bucket_budgets=str(p), **KW)
        assert str(p) in str(e.value)
    with pytest.raises(ValueError, match="one batch size >= 1"):
        write_bucket_budgets(tmp_path / "w.json", plain, [1, 2])


def test_pessimistic_batch_is_the_longest_input_and_the_longest_target_of_the_bucket():
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
