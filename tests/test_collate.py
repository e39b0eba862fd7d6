"""Collation and the DataLoader end to end: keys, padding, workers, GPU feature path, bad data
met during training."""

import os

import numpy as np
import pytest
import torch

from ddptrain.data import (BadExample, CharTokenizer, DataConfig, DataError, SpeechCollator, build_dataloader,
                           load_manifest)
from ddptrain.data.synthetic import write_synthetic_corpus

DURS = np.round(np.random.default_rng(0).uniform(0.3, 2.0, 24), 3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    return write_synthetic_corpus(str(folder), DURS, seed=0)


@pytest.fixture(scope="module")
def tok(corpus):
    return CharTokenizer.build(corpus)


def cfg(**kw):
    base = dict(max_duration=6.0, num_buckets=4, num_workers=0, num_mel_bins=40, seed=1)
    base.update(kw)
    return DataConfig(**base)


def truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def test_collator_pads_to_a_multiple_of_8_with_lengths_masks_and_tokens():
    ex = [{"id": "a", "text": "ab", "tokens": torch.tensor([1, 2]), "features": torch.ones(13, 4)},
          BadExample("b", "corrupt"),
          {"id": "c", "text": "abc", "tokens": torch.tensor([1, 2, 3]), "features": torch.ones(3, 4)}]
    b = SpeechCollator("features", num_mel_bins=4)(ex)
    assert b["features"].shape == (2, 16, 4) and b["features"].dtype == torch.float32
    assert b["feature_lens"].tolist() == [13, 3] and b["feature_lens"].dtype == torch.int64
    assert b["padding_mask"].dtype == torch.bool
    assert b["padding_mask"][0].tolist() == [False] * 13 + [True] * 3
    assert b["features"][1, 3:].abs().sum() == 0
    assert b["tokens"].tolist() == [[1, 2, 0], [1, 2, 3]] and b["token_lens"].tolist() == [2, 3]
    assert b["ids"] == ["a", "c"] and b["texts"] == ["ab", "abc"] and b["skipped_ids"] == ["b"]
    audio = SpeechCollator("audio")([{"id": "a", "text": "x", "tokens": torch.tensor([1]), "audio": torch.ones(5)}])
    assert audio["audio"].shape == (1, 8) and audio["audio_lens"].tolist() == [5]
    empty = SpeechCollator("features", num_mel_bins=4)([])
    assert empty["features"].shape == (0, 0, 4) and empty["tokens"].shape == (0, 0) and empty["ids"] == []


def test_collator_pads_tokens_to_a_multiple_and_audio_to_a_fixed_length():
    """token_pad_multiple rounds the token width up (lengths stay true); audio_length pads every
    batch's audio to one width, so batch shapes differ by fewer dimensions (CUDA graph keys)."""
    ex = [{"id": "a", "text": "ab", "tokens": torch.tensor([1, 2]), "audio": torch.ones(5)},
          {"id": "c", "text": "abc", "tokens": torch.tensor([1, 2, 3]), "audio": torch.ones(9)}]
    b = SpeechCollator("audio", token_pad_multiple=4, token_pad_id=7, audio_length=20)(ex)
    assert b["tokens"].tolist() == [[1, 2, 7, 7], [1, 2, 3, 7]] and b["token_lens"].tolist() == [2, 3]
    assert b["audio"].shape == (2, 20) and b["audio_lens"].tolist() == [5, 9] and b["audio"][1, 9:].abs().sum() == 0
    assert SpeechCollator("audio", token_pad_multiple=3)(ex)["tokens"].shape == (2, 3)  # already a multiple
    assert SpeechCollator("audio", audio_length=20)([])["audio"].shape == (0, 20)
    with pytest.raises(ValueError, match="utterance 'c': 9 samples, longer than the 8"):
        SpeechCollator("audio", audio_length=8)(ex)


@pytest.mark.timeout(120)
def test_loader_with_workers_covers_the_epoch_once_with_typed_batches(corpus, tok):
    loader = build_dataloader(corpus, cfg(num_workers=2, persistent_workers=True), tok, train=True)
    assert isinstance(loader.batch_sampler, type(loader.batch_sampler)) and len(loader) == len(loader.batch_sampler)
    ids = []
    for epoch in range(2):
        loader.batch_sampler.set_epoch(epoch)
        seen = []
        for b in loader:
            assert b["features"].dtype == torch.float32 and b["features"].shape[2] == 40
            assert b["features"].shape[1] % 8 == 0
            assert b["padding_mask"].shape == b["features"].shape[:2]
            assert b["tokens"].dtype == torch.int64 and b["token_lens"].dtype == torch.int64
            assert [tok.decode(t[:n]) for t, n in zip(b["tokens"], b["token_lens"])] == b["texts"]
            assert b["skipped_ids"] == []
            seen += b["ids"]
        assert sorted(seen) == sorted(e.id for e in load_manifest(corpus))
        ids.append(seen)
    assert ids[0] != ids[1]  # reshuffled per epoch


def test_ranks_get_disjoint_batches_through_the_loader(corpus, tok):
    seen = []
    lens = set()
    for rank in range(3):
        loader = build_dataloader(corpus, cfg(), tok, train=True, world_size=3, rank=rank)
        lens.add(len(loader))
        seen += [i for b in loader for i in b["ids"]]
    assert len(lens) == 1 and sorted(seen) == sorted(e.id for e in load_manifest(corpus))


@pytest.mark.parametrize("kind", ["fbank", "logmel"])
def test_gpu_feature_path_agrees_with_the_worker_path(corpus, tok, kind):
    worker = build_dataloader(corpus, cfg(features=kind), tok, train=False)
    gpu = build_dataloader(corpus, cfg(features=kind, feature_device="gpu"), tok, train=False)
    assert worker.feature_extractor is None and gpu.feature_extractor is not None
    ext = gpu.feature_extractor  # on a GPU machine: .to("cuda") and feed the batch on the device
    n = 0
    for wb, gb in zip(worker, gpu):
        assert wb["ids"] == gb["ids"] and set(gb) >= {"audio", "audio_lens", "tokens", "token_lens"}
        with torch.no_grad():
            out = ext(gb["audio"], gb["audio_lens"])
        assert torch.equal(out["feature_lens"], wb["feature_lens"])
        assert torch.equal(out["padding_mask"], wb["padding_mask"])
        torch.testing.assert_close(out["features"], wb["features"], atol=1e-4, rtol=1e-4)
        n += 1
    assert n == len(worker) > 1


def test_raw_audio_batches(corpus, tok):
    loader = build_dataloader(corpus, cfg(features="raw"), tok, train=False)
    b = next(iter(loader))
    assert b["audio"].ndim == 2 and b["audio"].shape[1] % 8 == 0 and "features" not in b
    assert b["audio_lens"].max() <= b["audio"].shape[1]


def test_speed_perturbation_keeps_batches_within_the_budget(corpus, tok):
    c = cfg(features="raw", speed_perturb=[0.9, 1.0, 1.1], max_duration=4.0)
    loader = build_dataloader(corpus, c, tok, train=True)
    torch.manual_seed(0)
    for b in loader:
        padded_seconds = b["audio"].shape[0] * b["audio_lens"].max().item() / 16000
        assert padded_seconds <= 4.0 + 1e-3
    assert build_dataloader(corpus, c, tok, train=False).batch_sampler.durations.max() == pytest.approx(DURS.max())


def test_eval_loader_is_exact_and_ordered(corpus, tok):
    loaders = [build_dataloader(corpus, cfg(), tok, train=False, world_size=32, rank=r) for r in range(32)]
    assert len({len(x) for x in loaders}) == 1
    ids = [i for x in loaders for b in x for i in b["ids"]]
    assert sorted(ids) == sorted(e.id for e in load_manifest(corpus))  # no duplicate, none dropped
    assert any(b["features"].shape[0] == 0 for x in loaders for b in x)  # 24 utterances, 32 ranks


@pytest.fixture
def damaged(tmp_path):
    """A corpus where two FLAC files are truncated after validation could see it (header intact)."""
    m = write_synthetic_corpus(str(tmp_path), DURS[:12], seed=3)
    entries = load_manifest(m)
    for e in (entries[2], entries[7]):
        truncate(e.audio_filepath)
    return m, entries


@pytest.mark.timeout(120)
def test_corrupt_file_during_training_names_file_and_id(damaged, tok):
    m, entries = damaged
    loader = build_dataloader(m, cfg(num_workers=2, max_duration=3.0), tok, train=True)  # header check passes
    with pytest.raises(DataError) as err:
        for _ in loader:
            pass
    msg = str(err.value)
    assert any(os.path.basename(e.audio_filepath) in msg and e.id in msg for e in (entries[2], entries[7]))
    assert "cannot decode audio" in msg


@pytest.mark.timeout(120)
def test_corrupt_file_under_skip_is_skipped_and_counted(damaged, tok):
    m, entries = damaged
    loader = build_dataloader(m, cfg(num_workers=2, max_duration=3.0, bad_data="skip"), tok, train=True)
    skipped, seen = [], []
    for b in loader:
        skipped += b["skipped_ids"]
        seen += b["ids"]
        assert b["features"].shape[0] == len(b["ids"])
    assert sorted(skipped) == sorted([entries[2].id, entries[7].id])
    assert sorted(seen + skipped) == sorted(e.id for e in entries)


@pytest.mark.timeout(120)
def test_skip_policy_refuses_to_train_on_a_broken_setup(tmp_path, tok):
    m = write_synthetic_corpus(str(tmp_path), np.full(30, 0.3), seed=4)
    for e in load_manifest(m):
        truncate(e.audio_filepath)
    loader = build_dataloader(m, cfg(num_workers=1, bad_data="skip"), tok, train=True)
    with pytest.raises(DataError, match="broken set-up"):
        for _ in loader:
            pass


def test_file_longer_than_its_manifest_line_is_caught_at_load_time(tmp_path, tok):
    m = write_synthetic_corpus(str(tmp_path), [1.0, 1.0], seed=5)
    lines = open(m).read().replace('"duration": 1.0', '"duration": 0.5', 1)
    open(m, "w").write(lines)
    loader = build_dataloader(m, cfg(validate=False), tok, train=False)
    with pytest.raises(DataError, match="duration mismatch: the manifest says 0.500s"):
        list(loader)
