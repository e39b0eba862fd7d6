"""Resuming with another config (ddptrain/resume.py) and onto another number of processes."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ddptrain
from ddptrain import resume
from ddptrain.config import to_yaml
from ddptrain.data import DurationBucketSampler
from _dist import run_ranks
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches

N_UTT = 41  # not a multiple of the batch sizes: the split tail is exercised too


class Utterances(Dataset):
    """Synthetic variable-length "utterances" with ids, durations 0.2..1.6 s (10 frames/s)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        self.lens = torch.randint(2, 17, (N_UTT,), generator=gen).tolist()
        self.x = [torch.randn(n, 6, generator=gen) for n in self.lens]

    def __len__(self):
        return N_UTT

    def __getitem__(self, i):
        return {"id": f"u{i:03d}", "x": self.x[i]}


def collate(items):
    t = max(it["x"].shape[0] for it in items)
    x = torch.stack([nn.functional.pad(it["x"], (0, 0, 0, t - it["x"].shape[0])) for it in items])
    lens = torch.tensor([it["x"].shape[0] for it in items])
    return {"ids": [it["id"] for it in items], "x": x, "y": x.sum(-1) * 0.3, "lens": lens}


class Recording:
    """frame_loss, remembering which utterances each training step saw."""

    def __init__(self):
        self.seen = []

    def __call__(self, model, batch):
        if model.training:
            self.seen += batch["ids"]
        return frame_loss(model, batch)


def _reshard_worker(rank, world, out, run, extra):
    data = Utterances()
    sampler = DurationBucketSampler([n / 10 for n in data.lens], max_duration=4.0, num_buckets=3, seed=3,
                                    world_size=world, rank=rank)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=1)
    torch.manual_seed(0)
    loss = Recording()
    cfg = make_cfg(os.path.join(out, "run"), "optim.zero=true", "checkpoint.keep_last=0", *extra)
    trainer = ddptrain.Trainer(FrameMLP(dropout=0.1), loss, cfg, loader)
    trainer.fit()
    with open(os.path.join(out, f"{run}_rank{rank}.json"), "w") as f:
        json.dump({"seen": loss.seen, "step": trainer.step, "epoch": trainer.progress.epoch}, f)


@pytest.mark.timeout(180)
def test_two_ranks_resume_on_three_mid_epoch_sees_every_utterance_once(tmp_path):
    run_ranks(_reshard_worker, 2, str(tmp_path), "two", ("trainer.max_steps=3",))
    run_ranks(_reshard_worker, 3, str(tmp_path), "three", ("checkpoint.resume=auto", "trainer.max_epochs=1"))
    two = [json.load(open(tmp_path / f"two_rank{r}.json")) for r in range(2)]
    three = [json.load(open(tmp_path / f"three_rank{r}.json")) for r in range(3)]
    seen = [u for r in two + three for u in r["seen"]]
    assert sorted(seen) == [f"u{i:03d}" for i in range(N_UTT)], "each utterance of the epoch exactly once"
    assert all(r["step"] == 3 for r in two)
    assert len({r["step"] for r in three}) == 1 and three[0]["step"] > 3, "training continued, in step"
    assert all(r["epoch"] == 1 for r in three)
    log = (tmp_path / "run" / "config.yaml").read_text()
    assert "resumed at step 3" in log and "trainer.max_steps: 3 -> 0" in log


# ----------------------------------------------------------------------------- changed config


def _run(tmp, steps, *extra):
    torch.manual_seed(0)
    data = micro_batches(4)[0] * 2  # 4 batches per epoch
    t = ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(tmp, f"trainer.max_steps={steps}", *extra), data)
    t.fit()
    return t


def test_a_new_lr_on_resume_takes_effect_and_is_recorded(tmp_path):
    _run(tmp_path, 4, "checkpoint.every_steps=2")
    t = _run(tmp_path, 6, "checkpoint.resume=auto", "optim.lr=0.01")
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)  # constant schedule: the new peak
    text = (tmp_path / "config.yaml").read_text()
    assert "optim.lr: 0.05 -> 0.01" in text and "lr: 0.05" in text  # the start config stays, the change is appended
    assert ddptrain.load_config(str(tmp_path / "config.yaml")).optim.lr == 0.05


def test_longer_max_steps_keeps_the_schedule_horizon(tmp_path):
    sched = ("scheduler.name=warmup_cosine", "scheduler.warmup_steps=1", "scheduler.min_lr_ratio=0.1")
    _run(tmp_path, 4, *sched)
    t = _run(tmp_path, 8, "checkpoint.resume=auto", *sched)
    # the cosine ended at step 4: past its end the rate stays at its floor instead of climbing back
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.1)


def test_refused_keys_are_named(tmp_path):
    _run(tmp_path, 2)
    with pytest.raises(ddptrain.ConfigError, match=r"optim.name: saved 'adamw', now 'sgd'"):
        _run(tmp_path, 4, "checkpoint.resume=auto", "optim.name=sgd")
    with pytest.raises(ddptrain.ConfigError, match=r"trainer.precision: saved 'fp32', now 'bf16'"):
        _run(tmp_path, 4, "checkpoint.resume=auto", "trainer.precision=bf16")


def test_unchanged_resume_appends_nothing(tmp_path):
    _run(tmp_path, 2, "checkpoint.every_steps=1")
    before = (tmp_path / "config.yaml").read_text()
    _run(tmp_path, 2, "checkpoint.resume=auto", "checkpoint.every_steps=1")
    # max_steps equal, nothing else changed: the record stays as it was
    assert (tmp_path / "config.yaml").read_text() == before


def test_a_changed_lora_rank_is_refused_by_name(tmp_path):
    lora = ("lora.enabled=true", "lora.targets=[net.0]", "lora.rank=2")
    _run(tmp_path, 2, *lora)
    with pytest.raises(ddptrain.ConfigError, match=r"lora.rank: saved 2, now 4 \(the saved adapters"):
        _run(tmp_path, 4, "checkpoint.resume=auto", *lora, "lora.rank=4")


def _mix_config(**data):
    cfg = ddptrain.Config()
    cfg.data.train_sources = {"accent": "a/train.jsonl", "base": "b/shards/"}
    cfg.data.train_weights = {"accent": 0.5, "base": 0.5}
    cfg.data.eval_sources = {"accent": "a/dev.jsonl"}
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.mark.parametrize("key, value", [
    ("lora.enabled", True), ("lora.targets", ["*.q_proj"]), ("lora.rank", 8), ("lora.alpha", 8.0),
    ("lora.trainable", ["head.*"]), ("data.shard_window", 0),
    ("data.train_sources", {"accent": "a/train.jsonl", "base": "c/shards/"}),
    ("data.train_weights", {"accent": 0.25, "base": 0.75})])
def test_lora_and_mix_keys_that_change_the_saved_state_are_refused(key, value):
    saved, now = _mix_config(), _mix_config()
    section, leaf = key.split(".")
    setattr(getattr(now, section), leaf, value)
    diff = resume.changes(to_yaml(saved), now)
    assert diff and all(k == key or k.startswith(key + ".") for k in diff)
    with pytest.raises(ddptrain.ConfigError, match=re.escape(key)):
        resume.check(diff, "ckpt")


def test_lora_dropout_and_eval_sources_may_change_and_are_recorded(tmp_path):
    saved = _mix_config()
    now = _mix_config(eval_sources={"accent": "a/dev.jsonl", "base": "b/dev.jsonl"})
    now.lora.dropout = 0.1
    diff = resume.changes(to_yaml(saved), now)
    assert diff == {"data.eval_sources.base": (None, "b/dev.jsonl"), "lora.dropout": (0.0, 0.1)}
    resume.check(diff, "ckpt")  # allowed
    resume.record(str(tmp_path), to_yaml(saved), None, {})
    resume.record(str(tmp_path), to_yaml(now), 10, diff)
    text = (tmp_path / "config.yaml").read_text()
    assert "#   data.eval_sources.base: None -> 'b/dev.jsonl'" in text and "#   lora.dropout: 0.0 -> 0.1" in text


def test_one_changed_weight_is_reported_as_its_own_key_and_refused():
    saved = _mix_config()
    diff = resume.changes(to_yaml(saved), _mix_config(train_weights={"accent": 0.25, "base": 0.5}))
    assert diff == {"data.train_weights.accent": (0.5, 0.25)}
    with pytest.raises(ddptrain.ConfigError, match=r"data.train_weights.accent: saved 0.5, now 0.25 \(.*share"):
        resume.check(diff, "ckpt")
    # weights given where there were none (by size): every new entry is a change, and refused
    diff = resume.changes(to_yaml(_mix_config(train_weights={})), saved)
    assert diff == {"data.train_weights.accent": (None, 0.5), "data.train_weights.base": (None, 0.5)}
    with pytest.raises(ddptrain.ConfigError, match=r"data.train_weights.base: saved None, now 0.5"):
        resume.check(diff, "ckpt")
    # a source name with a dot in it stays one name
    dotted = _mix_config(train_sources={"en.us": "a/train.jsonl"}, train_weights={"en.us": 1.0})
    diff = resume.changes(to_yaml(dotted), _mix_config(train_sources={"en.us": "a/train.jsonl"},
                                                       train_weights={"en.us": 2.0}))
    assert diff == {"data.train_weights[en.us]": (1.0, 2.0)}
    with pytest.raises(ddptrain.ConfigError, match=re.escape("data.train_weights[en.us]: saved 1.0, now 2.0")):
        resume.check(diff, "ckpt")
    assert resume.changes(to_yaml(saved), saved) == {}
