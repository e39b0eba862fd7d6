"""preflight.BudgetWatch on CPU: a run trained with a budget file whose peak memory goes over the
file's memory target warns once (step, peak, target, file, what to do) and logs
``budget_overshoot_gb``; under the target it only logs 0; without a budget file, or off CUDA,
nothing happens. The peak comes from a fake meter (``preflight.device_meter`` replaced), a fixed
list of peaks, one per logged step; on two ranks the rank over the target is the one named.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import ddptrain
from ddptrain import preflight
from ddptrain.data import DurationBucketSampler, SpeechCollator
from ddptrain.data.sampler import write_bucket_budgets

from _dist import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tests/conftest.py: tiny steps, shared cores

F = 4
DURS = np.round(np.random.default_rng(0).uniform(0.5, 2.0, 48), 2)
TARGET_GB = 2.0


class FakeMemory:
    """A device whose peak (bytes) is ``peaks_gb[i]`` at the i-th read (the last one after them)."""

    def __init__(self, peaks_gb):
        self.peaks_gb, self.reads, self.resets = list(peaks_gb), 0, 0

    def reset(self):
        self.resets += 1

    def peak(self):
        self.reads += 1
        return self.peaks_gb[min(self.reads, len(self.peaks_gb)) - 1] * 1e9


class Frames(torch.utils.data.Dataset):
    def __len__(self):
        return len(DURS)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(int(i))
        return {"id": str(i), "text": "x", "features": torch.randn(int(round(DURS[i] * 20)), F, generator=g)}


def loader(**kw):
    sampler = DurationBucketSampler(DURS, max_duration=6.0, num_buckets=3, seed=1, **kw)
    return torch.utils.data.DataLoader(Frames(), batch_sampler=sampler, collate_fn=SpeechCollator(
        "features", num_mel_bins=F, pad_to_multiple=1, with_tokens=False))


def frame_loss(model, batch):
    mask = torch.arange(batch["features"].shape[1])[None] < batch["feature_lens"][:, None]
    return ((model(batch["features"]).squeeze(-1) - 1.0) ** 2 * mask).sum(), mask.sum()


def budget_file(folder) -> str:
    path = os.path.join(folder, "budgets.json")
    s = loader().batch_sampler
    write_bucket_budgets(path, s, [2] * len(s.bucket_edges), memory_target_gb=TARGET_GB)
    return path


def train(folder, budgets=None, steps=5, **kw) -> list[dict]:
    """Train ``steps`` steps logging every step; the train lines of metrics.jsonl."""
    torch.manual_seed(0)
    cfg = ddptrain.load_config(None, [f"trainer.output_dir={folder}/run", "trainer.device=cpu", f"trainer.max_steps={steps}",
                                      "logging.log_every=1", "logging.progress_bar=false", "logging.tensorboard=false",
                                      "data.num_buckets=3", "dist.timeout_s=60"]
                               + ([f"data.bucket_budgets={budgets}"] if budgets else []))
    with ddptrain.Trainer(nn.Linear(F, 1), frame_loss, cfg, loader(bucket_budgets=budgets, **kw)) as trainer:
        trainer.fit()
    if trainer.info.rank != 0:
        return []  # rank 0 writes the logs
    return [r for r in map(json.loads, open(os.path.join(folder, "run", "metrics.jsonl"))) if r["split"] == "train"]


def fake_device(monkeypatch, peaks_gb) -> FakeMemory:
    fake = FakeMemory(peaks_gb)
    monkeypatch.setattr(preflight, "device_meter", lambda device: fake)
    return fake


def test_the_first_step_over_the_target_warns_once_and_the_overshoot_is_logged(tmp_path, monkeypatch, capsys):
    path = budget_file(tmp_path)
    fake = fake_device(monkeypatch, [1.5, 1.9, 2.6, 3.0, 2.9])  # over the 2 GB target from step 3
    rows = train(tmp_path, path)
    err = capsys.readouterr().err
    assert fake.resets == 1 and fake.reads == 5  # reset after the checks before fit, read at each logged step
    assert err.count("WARNING") == 1, err
    warning = next(line for line in err.splitlines() if "WARNING" in line)
    assert warning.startswith("WARNING: step 3: peak memory 2.60 GB is 0.60 GB over the 2 GB target that "
                              f"{path} (data.bucket_budgets) was tuned for"), warning
    assert "python -m ddptrain.tune" in warning and "--memory-gb 1.4 (the target minus this overshoot)" in warning
    assert [round(r["budget_overshoot_gb"], 6) for r in rows] == [0.0, 0.0, 0.6, 1.0, 0.9]


def test_under_the_target_there_is_no_warning_and_the_overshoot_is_zero(tmp_path, monkeypatch, capsys):
    fake_device(monkeypatch, [1.0, 1.5, 2.0])  # at the target is not over it
    rows = train(tmp_path, budget_file(tmp_path))
    assert "WARNING" not in capsys.readouterr().err
    assert [r["budget_overshoot_gb"] for r in rows] == [0.0] * 5


def test_without_a_budget_file_or_off_cuda_nothing_happens(tmp_path, monkeypatch, capsys):
    path = budget_file(tmp_path)
    assert not any("budget_overshoot_gb" in r for r in train(tmp_path / "cpu", path))  # the real meter: None on CPU
    fake = fake_device(monkeypatch, [9.0])
    rows = train(tmp_path / "plain")
    assert "WARNING" not in capsys.readouterr().err
    assert not any("budget_overshoot_gb" in r for r in rows) and fake.reads == fake.resets == 0


def test_a_file_without_a_memory_target_is_not_watched(tmp_path, monkeypatch):
    path = tmp_path / "hand.json"
    s = loader().batch_sampler
    write_bucket_budgets(path, s, [2] * len(s.bucket_edges))  # written by hand: no memory_target_gb
    fake = fake_device(monkeypatch, [9.0])
    assert not any("budget_overshoot_gb" in r for r in train(tmp_path, str(path)))
    assert fake.reads == 0


def _two_ranks(rank, world_size, folder, path):
    # rank 1 goes over at step 2, rank 0 never: the check is per rank, rank 0 reports it
    preflight.device_meter = lambda device: FakeMemory([1.0, 2.5, 2.7] if rank == 1 else [1.2])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rows = train(folder, path, steps=4, world_size=world_size, rank=rank)
    if rank == 0:
        with open(os.path.join(folder, "rank0.json"), "w") as f:
            json.dump({"err": err.getvalue(), "overshoot": [r["budget_overshoot_gb"] for r in rows]}, f)


@pytest.mark.timeout(120)
def test_on_two_ranks_the_rank_over_the_target_is_named(tmp_path):
    path = tmp_path / "budgets.json"
    s = loader(world_size=2, rank=0).batch_sampler
    write_bucket_budgets(path, s, [2] * len(s.bucket_edges), memory_target_gb=TARGET_GB)
    run_ranks(_two_ranks, 2, str(tmp_path), str(path), timeout=100)
    seen = json.load(open(tmp_path / "rank0.json"))
    assert seen["err"].count("WARNING") == 1
    assert "WARNING: step 2: peak memory 2.50 GB on rank 1 is 0.50 GB over the 2 GB target" in seen["err"]
    assert [round(v, 6) for v in seen["overshoot"]] == [0.0, 0.5, 0.7, 0.7]
