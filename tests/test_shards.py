"""Tar shards (ddptrain/data/shards.py) and their sampler (ddptrain/data/shard_sampler.py): the round
trip against the manifest path, shards of other tools, bad shards named, exact resume mid-shard,
equal steps per rank, and what windowed planning keeps of DurationBucketSampler's plan."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time

import numpy as np
import pytest
import torch

from _dist import run_ranks
from ddptrain.data import CharTokenizer, DataConfig, DataError, DurationBucketSampler, build_dataloader, load_manifest
from ddptrain.data.shard_sampler import ShardWindowSampler
from ddptrain.data.shards import build_index, index_path, load_shards, main, write_shards
from ddptrain.data.synthetic import write_synthetic_corpus

DURS = np.round(np.random.default_rng(5).uniform(0.7, 1.6, 40), 3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_synthetic_corpus(str(tmp_path_factory.mktemp("corpus")), DURS, seed=3)


@pytest.fixture(scope="module")
def tok(corpus):
    return CharTokenizer.build(corpus)


def cfg(**kw):
    base = dict(max_duration=4.0, num_buckets=3, num_workers=0, num_mel_bins=20, seed=7, shard_window=0)
    base.update(kw)
    return DataConfig(**base)


def batches(loader):
    return [(b["ids"], b["features"], b["tokens"]) for b in loader]


def same(a, b):
    assert len(a) == len(b)
    for (ia, fa, ta), (ib, fb, tb) in zip(a, b):
        assert ia == ib
        assert torch.equal(fa, fb) and torch.equal(ta, tb)


def test_shards_give_the_manifest_path_batches_for_the_same_plan(corpus, tok, tmp_path):
    paths = write_shards(corpus, str(tmp_path / "sh"), shard_size=12, shuffle=False)
    assert [os.path.basename(p) for p in paths] == [f"shard-{i:06d}.tar" for i in range(4)]
    c = cfg(speed_perturb=[0.9, 1.0, 1.1], spec_augment=True)  # augmentation comes from (seed, epoch, index)
    from_manifest = build_dataloader(corpus, c, tok, train=True)
    from_shards = build_dataloader(str(tmp_path / "sh"), c, tok, train=True)
    assert isinstance(from_shards.batch_sampler, ShardWindowSampler) and not from_shards.batch_sampler.windowed
    for loader in (from_manifest, from_shards):
        loader.batch_sampler.set_epoch(1)
        loader.dataset.set_epoch(1)
    same(batches(from_manifest), batches(from_shards))


def test_written_index_is_the_one_a_reader_builds_from_the_tar(corpus, tmp_path):
    for p in write_shards(corpus, str(tmp_path / "sh"), shard_size=16, seed=1):
        with open(index_path(p)) as f:
            assert json.load(f) == build_index(p)
    shards = load_shards(str(tmp_path / "sh"))
    assert sorted(shards.keys[i] for i in range(len(shards))) == [f"line{n:08d}" for n in range(1, 41)]
    np.testing.assert_allclose(np.sort(shards.duration), np.sort([e.duration for e in load_manifest(corpus)]))
    assert not shards.problems


def foreign_shards(folder, entries, per_shard=25) -> None:
    """Shards as another tool writes them (WebDataset layout, KEY.flac + KEY.txt, no durations, no index)."""
    folder.mkdir()
    for start in range(0, len(entries), per_shard):
        with tarfile.open(folder / f"data-{start // per_shard}.tar", "w") as tar:
            for n, e in enumerate(entries[start:start + per_shard], start=start):
                for name in (f"utt{n:03d}.flac", f"utt{n:03d}.txt"):
                    data = open(e.audio_filepath, "rb").read() if name.endswith(".flac") else e.text.encode()
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def test_shards_of_another_tool_are_indexed_on_first_read(corpus, tok, tmp_path):
    entries = load_manifest(corpus)
    folder = tmp_path / "foreign"
    foreign_shards(folder, entries[:25])
    loader = build_dataloader(str(folder / "*.tar"), cfg(), tok, train=False)
    assert os.path.exists(folder / "data-0.idx.json")  # saved for the next run
    got = {i: (t, f) for b in loader for i, t, f in zip(b["ids"], b["texts"], b["features"])}
    want = {f"utt{n:03d}": e.text for n, e in enumerate(entries[:25])}
    assert {i: t for i, (t, _) in got.items()} == want
    np.testing.assert_allclose(loader.batch_sampler.durations, [e.duration for e in entries[:25]], atol=1e-4)


def _index_on_two_ranks(rank, world, folder, out):
    from ddptrain import dist

    dist.setup("gloo", 60.0, "cpu")
    if rank == 1:
        time.sleep(1.0)  # rank 0 has built and saved its share of the indexes before rank 1 looks
    loader = build_dataloader(folder, cfg(), None, train=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"len": len(loader), "plan": [list(map(int, b)) for b in loader.batch_sampler]}, f)
    dist.teardown()


@pytest.mark.timeout(120)
def test_two_ranks_index_new_shards_once_and_agree(corpus, tmp_path):
    foreign_shards(tmp_path / "foreign", load_manifest(corpus), per_shard=10)
    run_ranks(_index_on_two_ranks, 2, str(tmp_path / "foreign"), str(tmp_path), timeout=90)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["len"] == res[1]["len"] > 0
    assert sorted(i for r in res for b in r["plan"] for i in b) == list(range(40))
    assert len(list((tmp_path / "foreign").glob("*.idx.json"))) == 4


def test_a_truncated_shard_is_named_with_its_member(corpus, tok, tmp_path):
    paths = write_shards(corpus, str(tmp_path / "sh"), shard_size=10, shuffle=False)
    with open(index_path(paths[1])) as f:
        index = json.load(f)
    cut = index["audio_offset"][6] + 100  # inside the 7th sample's audio
    with open(paths[1], "r+b") as f:
        f.truncate(cut)
    with pytest.raises(DataError) as err:
        build_dataloader(str(tmp_path / "sh"), cfg(), tok, train=True)
    msg = str(err.value)
    assert f"{paths[1]}:7 (id {index['keys'][6]}): truncated shard: member {index['keys'][6]}.flac" in msg
    assert f"{paths[1]}:10 " in msg and "shard-000000" not in msg  # every lost member, none of the others
    loader = build_dataloader(str(tmp_path / "sh"), cfg(bad_data="skip"), tok, train=True)
    assert sum(len(b["ids"]) for b in loader) == 40 - 4  # the six complete members of shard 1 stay

    # a shard cut short after its index was read: the worker's read names shard and member
    loader = build_dataloader(str(tmp_path / "sh"), cfg(bad_data="skip"), tok, train=True)
    with open(paths[2], "r+b") as f:
        f.truncate(1024)
    with pytest.raises(DataError, match=r"shard-000002.tar:2 .*truncated shard: member .*\.flac ends at byte \d+, "
                                         r"the file has 1024 of the"):
        build_dataloader(str(tmp_path / "sh"), cfg(), tok, train=True)  # the next run's index check
    loader.dataset.cfg.bad_data = "error"
    with pytest.raises(DataError, match=r"shard-000002.tar:\d+ .*truncated shard: member \w+\.(json|flac) needs bytes "
                                         r"\d+\.\.\d+, \S+shard-000002.tar ends at 1024"):
        list(loader)


def test_compressed_shards_are_refused(tmp_path):
    with tarfile.open(tmp_path / "a.tar.gz", "w:gz"):
        pass
    with pytest.raises(DataError, match="compressed: shards must be plain tar files"):
        load_shards(str(tmp_path / "a.tar.gz"))
    with pytest.raises(DataError, match="no shards match"):
        load_shards(str(tmp_path / "none-*.tar"))


def test_resume_mid_shard_gives_the_uninterrupted_batches(corpus, tok, tmp_path):
    write_shards(corpus, str(tmp_path / "sh"), shard_size=8)
    c = cfg(shard_window=2, speed_perturb=[0.9, 1.0], spec_augment=True)
    full = build_dataloader(str(tmp_path / "sh"), c, tok, train=True)
    full.batch_sampler.set_epoch(1)
    full.dataset.set_epoch(1)
    want = batches(full)
    k = len(want) // 2
    plan, shard_of = list(full.batch_sampler), full.dataset.set.shard
    before = {int(shard_of[i]) for b in plan[:k] for i in b}
    after = {int(shard_of[i]) for b in plan[k:] for i in b}
    assert before & after  # batch k is in the middle of a shard (its other utterances come later)

    state = dict(full.batch_sampler.state_dict(), position=k)
    resumed = build_dataloader(str(tmp_path / "sh"), c, tok, train=True)
    resumed.batch_sampler.load_state_dict(state)
    resumed.batch_sampler.set_epoch(1)
    resumed.dataset.set_epoch(1)
    assert len(resumed) == len(want)
    same(batches(resumed), want[k:])


def test_workers_read_the_same_batches(corpus, tok, tmp_path):
    write_shards(corpus, str(tmp_path / "sh"), shard_size=8)
    one = batches(build_dataloader(str(tmp_path / "sh"), cfg(shard_window=2), tok, train=True))
    two = batches(build_dataloader(str(tmp_path / "sh"), cfg(shard_window=2, num_workers=2), tok, train=True))
    same(one, two)


def test_the_writer_command_line(corpus, tmp_path, capsys):
    assert main([corpus, str(tmp_path / "out"), "--shard-size", "15", "--audio", "wav"]) == 0
    shards = load_shards(str(tmp_path / "out"))
    assert len(shards.paths) == 3 and shards.exts == ["wav", "json"]
    os.unlink(index_path(shards.paths[0]))
    assert main(["--index", str(tmp_path / "out")]) == 0
    assert os.path.exists(index_path(shards.paths[0]))
    assert main(["missing.jsonl", str(tmp_path / "x")]) == 1
    assert "manifest not found" in capsys.readouterr().err


# ------------------------------------------------------------------ the sampler, from durations only

LONG = np.clip(np.random.default_rng(0).lognormal(np.log(12), 0.5, 6000), 1, 35)
SHARD = np.arange(LONG.size) // 200  # 30 shards


def windowed(**kw):
    base = dict(max_duration=200.0, num_buckets=10, shards=SHARD, window_shards=2, seed=1)
    base.update(kw)
    return ShardWindowSampler(LONG, **base)


def working_set(plan) -> float:
    """Shards being read at a time: the mean over batches of the shards whose first and last
    batch of the epoch enclose it (what has to stay in the page cache)."""
    first, last = {}, {}
    for t, b in enumerate(plan):
        for s in np.unique(SHARD[b]):
            first.setdefault(s, t)
            last[s] = t
    return sum(last[s] - first[s] + 1 for s in first) / len(plan)


@pytest.mark.parametrize("tail", ["split", "duplicate", "drop"])
def test_two_ranks_get_equal_steps_and_each_step_reads_one_window(tail):
    ranks = [windowed(world_size=2, rank=r, tail=tail) for r in range(2)]
    plans = [list(s) for s in ranks]
    assert len(plans[0]) == len(plans[1]) == len(ranks[0]) == len(ranks[1])
    seen = [i for p in plans for b in p for i in b]
    if tail == "split":
        assert sorted(seen) == list(range(LONG.size))  # each utterance once
    # the same number of batches as the global plan, every epoch
    assert len(ranks[0]) == len(DurationBucketSampler(LONG, max_duration=200.0, num_buckets=10, world_size=2,
                                                      rank=0, tail=tail))
    ranks[0].set_epoch(3)
    assert len(list(ranks[0])) == len(plans[0])


def test_windows_keep_the_global_padding_and_read_a_few_shards_at_a_time():
    glob = DurationBucketSampler(LONG, max_duration=200.0, num_buckets=10, seed=1)
    win = windowed()
    assert win.windowed and not windowed(window_shards=0).windowed
    pad = win.epoch_stats()["padding_fraction"]
    assert pad < 0.03 and abs(pad - glob.epoch_stats()["padding_fraction"]) < 1e-3
    assert len(win) == len(glob)
    assert working_set(list(glob)) > 29 and working_set(list(win)) < 8  # of 30 shards
    first = [i for b in list(win)[: len(win) // 4] for i in b]
    assert np.unique(SHARD[first]).size <= 12  # the first quarter of the epoch reads few shards
    assert list(windowed(window_shards=0)) == list(glob)  # 0: the global plan itself


def test_a_state_resumes_on_another_world_size():
    two = [windowed(world_size=2, rank=r) for r in range(2)]
    done = 10
    seen = [i for s in two for b in list(s)[:done] for i in b]
    three = [windowed(world_size=3, rank=r) for r in range(3)]
    for s in three:
        s.load_state_dict(dict(two[0].state_dict(), position=done))
    rest = [list(s) for s in three]
    assert len({len(s) for s in three}) == 1 and len({len(r) for r in rest}) == 1
    assert sorted(seen + [i for r in rest for b in r for i in b]) == list(range(LONG.size))


def test_a_state_of_another_layout_is_refused():
    state = windowed().state_dict()
    with pytest.raises(ValueError, match="window_shards: saved 2, now 4"):
        windowed(window_shards=4).load_state_dict(state)
    with pytest.raises(ValueError, match="layout_fingerprint"):
        windowed(shards=SHARD[::-1].copy()).load_state_dict(state)


def _cut(path, member_name, inside: bool):
    """Truncate a tar inside member ``member_name``'s data, or right after its (padded) data."""
    with tarfile.open(path) as tar:
        m = tar.getmember(member_name)
    end = m.offset_data + (m.size // 2 if inside else -(-m.size // 512) * 512)
    with open(path, "r+b") as f:
        f.truncate(end)
    return end


@pytest.mark.parametrize("inside", [True, False])
def test_a_truncated_shard_without_index_says_how_many_samples_were_lost(corpus, tok, tmp_path, inside):
    """issue 30, item 3: the members past the cut were lost without a word, and the cut sample was
    reported as "no transcript" (a cut right after its audio) or the whole set refused as unreadable."""
    folder = tmp_path / "foreign"
    foreign_shards(folder, load_manifest(corpus)[:30], per_shard=10)
    end = _cut(folder / "data-1.tar", "utt013.flac" if inside else "utt015.flac", inside)
    with pytest.raises(DataError) as err:
        build_dataloader(str(folder), cfg(), tok, train=True)
    msg = str(err.value)
    k = 4 if inside else 6  # the sample the file ends in
    assert (f"data-1.tar:{k} (id utt01{k - 1}): truncated shard: the file ends at byte {end} in sample {k}" in msg
            and f"{k - 1} sample(s) before it are read" in msg and f"about {10 - k + 1} lost" in msg), msg
    assert "no transcript" not in msg and "data-0.tar" not in msg
    loader = build_dataloader(str(folder), cfg(bad_data="skip"), tok, train=True)
    assert sum(len(b["ids"]) for b in loader) == 20 + k - 1


def _garble_audio(path, sample):
    """Overwrite the middle third of one sample's audio with noise: the header still parses, decoding fails."""
    with open(index_path(path)) as f:
        index = json.load(f)
    off, size = index["audio_offset"][sample], index["audio_size"][sample]
    with open(path, "r+b") as f:
        f.seek(off + size // 3)
        f.write(np.random.default_rng(0).integers(0, 256, size // 3, dtype=np.uint8).tobytes())
    return index["keys"][sample]


def test_validate_decode_covers_shards_as_it_covers_manifests(corpus, tok, tmp_path):
    """issue 30, item 8: a corrupt member failed only when its batch was reached."""
    paths = write_shards(corpus, str(tmp_path / "sh"), shard_size=10, shuffle=False)
    key = _garble_audio(paths[1], 2)
    build_dataloader(str(tmp_path / "sh"), cfg(), tok, train=True)  # the index alone cannot tell
    with pytest.raises(DataError, match=rf"shard-000001.tar:3 \(id .*\): unreadable audio: cannot decode .*{key}"):
        build_dataloader(str(tmp_path / "sh"), cfg(validate_decode=True), tok, train=True)
    loader = build_dataloader(str(tmp_path / "sh"), cfg(validate_decode=True, bad_data="skip"), tok, train=True)
    assert sum(len(b["ids"]) for b in loader) == 39


def test_the_validate_command_takes_a_shard_folder(corpus, tmp_path, capsys):
    from ddptrain.data import validate

    paths = write_shards(corpus, str(tmp_path / "sh"), shard_size=10, shuffle=False)
    assert validate.main([str(tmp_path / "sh")]) == 0
    assert "40 utterance(s), no problems" in capsys.readouterr().out
    key = _garble_audio(paths[3], 0)
    assert validate.main([str(tmp_path / "sh")]) == 0  # an index-level check cannot see it
    assert validate.main([str(tmp_path / "sh"), "--decode"]) == 1
    out = capsys.readouterr().out
    assert f"shard-000003.tar:1 (id " in out and f"unreadable audio: cannot decode audio member {key}.flac" in out
    assert "1 of 40 utterance(s) have problems" in out


def test_a_shard_whose_members_are_not_adjacent_is_indexed_by_key(corpus, tok, tmp_path, caplog):
    """issue 30, item 9: all audio first, then all transcripts: "20 of 20 ... no audio member" for
    a 10-utterance shard."""
    entries = load_manifest(corpus)[:10]
    (tmp_path / "odd").mkdir()
    with tarfile.open(tmp_path / "odd" / "data.tar", "w") as tar:
        for ext in ("flac", "txt"):
            for n, e in enumerate(entries):
                data = open(e.audio_filepath, "rb").read() if ext == "flac" else e.text.encode()
                info = tarfile.TarInfo(f"utt{n:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with caplog.at_level("WARNING", logger="ddptrain.data.shards"):
        loader = build_dataloader(str(tmp_path / "odd"), cfg(), tok, train=False)
    got = {i: t for b in loader for i, t in zip(b["ids"], b["texts"])}
    assert got == {f"utt{n:03d}": e.text for n, e in enumerate(entries)}
    assert "members of 10 sample(s) are not adjacent" in caplog.text and "utt000.txt" in caplog.text


def test_an_index_that_no_longer_matches_its_tar_is_rebuilt(corpus, tok, tmp_path, caplog):
    """issue 30, item 9: a tar rewritten with other content of the same size kept its old index,
    and training met decode errors (or other utterances' transcripts)."""
    path = write_shards(corpus, str(tmp_path / "sh"), shard_size=20, shuffle=False)[0]
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    size = os.path.getsize(path)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:  # the same members, samples in reverse order
        for i in range(len(members) - 2, -1, -2):
            for m, data in members[i:i + 2]:
                tar.addfile(m, io.BytesIO(data))
    assert os.path.getsize(path) == size
    with caplog.at_level("WARNING", logger="ddptrain.data.shards"):
        loader = build_dataloader(str(tmp_path / "sh"), cfg(), tok, train=False)
    assert "stale" in caplog.text and os.path.basename(path) in caplog.text
    texts = {e.id: e.text for e in load_manifest(corpus)}
    for b in loader:
        for i, t in zip(b["ids"], b["texts"]):
            assert texts[i] == t
