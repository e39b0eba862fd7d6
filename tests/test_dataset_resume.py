"""SpeechDataset augmentation is a function of (data seed, epoch, index), whoever loads it.

A resumed run has fresh DataLoader workers, each at another position of its stream, and
persistent workers live across epochs: augmentation drawn from a worker's own RNG differs
between such runs. These tests load the same utterances through different loader set-ups and
ask for the same speed-perturbed, SpecAugmented features (tests/test_resume_matrix.py checks
whole training runs).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from multiprocessing.reduction import ForkingPickler
from dataclasses import replace

import pytest
import torch
from torch.utils.data import DataLoader

from ddptrain.data import DataConfig, SpeechDataset, load_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "examples", "data", "digits", "base")
N = 4
CFG = DataConfig(num_mel_bins=40, spec_augment=True, freq_masks=2, freq_mask_width=8, time_masks=2,
                 time_mask_ratio=0.1, speed_perturb=[0.9, 1.0, 1.1])


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    path = tmp_path_factory.mktemp("manifest") / "tiny.jsonl"
    with open(os.path.join(BASE, "train.jsonl")) as src, open(path, "w") as dst:
        for line, _ in zip(src, range(N)):
            item = json.loads(line)
            item["audio_filepath"] = os.path.join(BASE, item["audio_filepath"])
            dst.write(json.dumps(item) + "\n")
    return load_manifest(str(path))


def load_epochs(dataset, epochs, order=None, **loader_kw) -> dict:
    """(epoch, index) -> features, through one DataLoader used for all ``epochs``."""
    order = order or list(range(len(dataset)))
    loader = DataLoader(dataset, sampler=order, batch_size=1, collate_fn=list, **loader_kw)
    out = {}
    for epoch in epochs:
        dataset.set_epoch(epoch)
        for i, (example,) in zip(order, loader):
            out[epoch, i] = example["features"]
    return out


def same(a: dict, b: dict) -> list:
    """The keys whose features differ."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(60)
def test_workers_persistent_or_not_and_order_do_not_change_the_augmentation(entries):
    ds = SpeechDataset(entries, CFG, train=True)
    ref = load_epochs(ds, [0, 1])
    assert len({x.shape[0] for x in ref.values()}) > N, "speed perturbation must change some lengths"
    epoch1 = {k: v for k, v in ref.items() if k[0] == 1}
    assert len(same({k: ref[0, k[1]] for k in epoch1}, epoch1)) > N // 2, "each epoch must augment anew"
    # persistent workers learn the new epoch through shared memory; a resumed run starts its
    # workers (and their RNG) afresh, at another position and in another order
    for name, kw in [("2 persistent workers", dict(num_workers=2, persistent_workers=True)),
                     ("2 workers, another order", dict(order=[3, 1, 0, 2], num_workers=2))]:
        differ = same(ref, load_epochs(ds, [0, 1], **kw))
        assert not differ, f"{name}: (epoch, index) {differ} augmented unlike workers=0"
    other_seed = load_epochs(SpeechDataset(entries, replace(CFG, seed=1), train=True), [0])
    assert len(same({k: ref[k] for k in other_seed}, other_seed)) > N // 2, "data.seed must change the augmentation"


def test_the_epoch_survives_pickling_into_spawned_workers(entries):
    """Spawned workers (macOS, ``multiprocessing_context='spawn'``) get the dataset through
    multiprocessing's ForkingPickler; its epoch must stay the shared one."""
    ds = SpeechDataset(entries, CFG, train=True)
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(ds)
    in_worker = pickle.loads(buf.getvalue())
    ds.set_epoch(3)
    assert torch.equal(in_worker[1]["features"], ds[1]["features"]), "the unpickled dataset lost the epoch"


def test_set_epoch_checks_its_argument(entries):
    ds = SpeechDataset(entries, CFG, train=True)
    with pytest.raises(ValueError, match="epoch"):
        ds.set_epoch(-1)


def test_evaluation_data_is_not_augmented(entries):
    ds = SpeechDataset(entries, CFG, train=False)
    assert not same(load_epochs(ds, [0]), {(0, i): v for (_, i), v in load_epochs(ds, [5]).items()})
