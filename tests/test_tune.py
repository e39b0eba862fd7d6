"""ddptrain.tune on CPU: the batch-size search against fake memory models, the whole tuner through
a real Trainer step on a fake device (memory grows with the largest tensor a module sees, past
its capacity it raises torch.cuda.OutOfMemoryError), the command line on the ASR recipe followed
by training with the data.max_duration it prints, and the Trainer's pre-flight check (names the
bucket, changes nothing).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import numpy as np
import pytest
import torch
from torch import nn

import ddptrain
from ddptrain import dist, tune
from ddptrain.data import DurationBucketSampler, SpeechCollator
from ddptrain.prepare import prepare_model, prepare_step
from ddptrain.tune import Bucket, PreflightError, TuneError, search_batch_sizes

from _dist import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tests/conftest.py: tiny steps, shared cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F, H = 4, 8  # feature bins of the synthetic corpus; the model's width (its largest activation: B x T x H)
DURS = np.round(np.random.default_rng(0).uniform(0.5, 4.0, 160), 2)


# ----------------------------------------------------------------------------- the search alone


def linear_memory(base, per_second, capacity, target):
    """try_batch of a GPU whose step peaks at base + B * per_second * longest**1.5 (None past capacity)."""
    calls = []

    def try_batch(b: Bucket, size: int):
        calls.append((b.index, size))
        peak = base + size * per_second * b.longest ** 1.5
        return None if peak > capacity else peak

    def exact(b: Bucket) -> int:
        return min(b.cap, int((target - base) // (per_second * b.longest ** 1.5)))

    return try_batch, exact, calls


def buckets(n=8, cap=500):
    return [Bucket(k, 2.0 * k, 2.0 * k + 2, None, cap) for k in range(n)][::-1]  # longest first


@pytest.mark.parametrize("capacity", [80e9, 95e9])  # a target below the GPU and one just under it
def test_search_finds_the_exact_largest_size_per_bucket_in_few_tries(capacity):
    try_batch, exact, calls = linear_memory(10e9, 0.05e9, capacity, target=72e9)
    found = search_batch_sizes(buckets(), try_batch, 72e9, base_bytes=10e9, tolerance=0)
    assert [r["batch_size"] for r in found] == [exact(b) for b in buckets()]
    assert all(r["peak_gb"] <= 72 for r in found)
    assert len(calls) <= 4 * len(found), f"{len(calls)} tries for {len(found)} buckets"
    again = search_batch_sizes(buckets(), linear_memory(10e9, 0.05e9, capacity, 72e9)[0], 72e9, 10e9, tolerance=0)
    assert again == found  # deterministic


def test_search_without_a_base_and_with_superlinear_memory_still_bisects_to_the_exact_size():
    def try_batch(b, size):  # attention-like: memory grows with size**1.3, so extrapolation overshoots
        peak = 2e9 + 0.3e9 * size ** 1.3 * b.longest
        return None if peak > 60e9 else peak

    found = search_batch_sizes(buckets(5), try_batch, 50e9, base_bytes=0, tolerance=0)
    for r, b in zip(found, buckets(5)):
        n = r["batch_size"]
        assert try_batch(b, n) <= 50e9 and (try_batch(b, n + 1) or 1e99) > 50e9


def test_tolerance_stops_early_below_the_exact_size_and_caps_are_kept():
    try_batch, exact, _ = linear_memory(0, 0.001e9, 1e12, target=80e9)
    bs = buckets(4, cap=10_000)
    loose = search_batch_sizes(bs, try_batch, 80e9, tolerance=0.1)
    for r, b in zip(loose, bs):
        assert 0.9 * exact(b) <= r["batch_size"] <= exact(b)
    capped = search_batch_sizes(buckets(4, cap=50), try_batch, 80e9, tolerance=0)
    assert all(r["batch_size"] == 50 and r["capped"] for r in capped)


def test_a_bucket_where_one_utterance_does_not_fit_is_an_error_naming_it():
    try_batch, _, _ = linear_memory(10e9, 30e9, 100e9, target=80e9)  # longest 16 s: 1 row = 1.9 TB
    with pytest.raises(TuneError, match=r"bucket 7 \(utterances 14.00-16.00 s.*runs out of memory"):
        search_batch_sizes(buckets(), try_batch, 80e9, 10e9)


def test_out_of_memory_is_recognised_when_wrapped():
    inner = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        try:
            raise inner
        except Exception as e:
            raise RuntimeError("rank 0, step 1, micro-batch 0: OutOfMemoryError") from e
    except RuntimeError as wrapped:
        assert tune.is_oom(wrapped)
    assert not tune.is_oom(ValueError("shape mismatch"))


# ----------------------------------------------------------------------------- a fake device


class FakeDevice:
    """A GPU whose step peaks at ``base + per_element * (largest module input, elements) ** power``
    bytes and raises torch.cuda.OutOfMemoryError past ``capacity``; the meter the tuner reads."""

    def __init__(self, base=1e6, per_element=1.0, capacity=80e3 + 1e6, power=1.0):
        self.base, self.per, self.cap, self.power, self.largest = base, per_element, capacity, power, 0
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        n = max((a.numel() for a in args if isinstance(a, torch.Tensor)), default=0)
        self.largest = max(self.largest, n)
        if self.peak() > self.cap:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (fake device, {self.peak():.0f} bytes)")

    def reset(self):
        self.largest = 0

    def peak(self, largest=None):
        return self.base + self.per * (self.largest if largest is None else largest) ** self.power

    def current(self):
        return self.base

    def capacity(self):
        return self.cap

    def name(self):
        return "fake"

    def close(self):
        self.handle.remove()


class Frames(torch.utils.data.Dataset):
    def __len__(self):
        return len(DURS)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(int(i))
        return {"id": str(i), "text": "x", "features": torch.randn(int(round(DURS[i] * 100)), F, generator=g)}


def loader(**kw):
    sampler = DurationBucketSampler(DURS, **{"max_duration": 20.0, "num_buckets": 4, "seed": 1, **kw})
    return torch.utils.data.DataLoader(Frames(), batch_sampler=sampler,
                                       collate_fn=SpeechCollator("features", num_mel_bins=F, pad_to_multiple=1,
                                                                 with_tokens=False))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.drop, self.out = nn.Linear(F, H), nn.BatchNorm1d(H), nn.Dropout(0.2), nn.Linear(H, 1)

    def forward(self, x):
        h = self.norm(self.proj(x).transpose(1, 2)).transpose(1, 2)
        return self.out(self.drop(h)).squeeze(-1)


def frame_loss(model, batch):
    mask = torch.arange(batch["features"].shape[1])[None] < batch["feature_lens"][:, None]
    return ((model(batch["features"]) - 1.0) ** 2 * mask).sum(), mask.sum()


def config(tmp_path, *extra):
    return ddptrain.load_config(None, [f"trainer.output_dir={tmp_path}/run", "trainer.device=cpu",
                                       "logging.progress_bar=false", "logging.tensorboard=false",
                                       "data.num_buckets=4", *extra])


@pytest.mark.parametrize("power, per_element", [(1.0, 1.0), (1.5, 0.2)])  # linear, and superlinear: some tries OOM
def test_find_max_duration_runs_real_steps_and_its_budget_fits_every_bucket(tmp_path, power, per_element):
    torch.manual_seed(0)
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    data = loader()
    device = FakeDevice(per_element=per_element, power=power)
    target = device.base + 60e3  # under the fake capacity
    try:
        doc = tune.find_max_duration(model, frame_loss, config(tmp_path), data, target / 1e9,
                                     tolerance=0, meter=device, say=lambda line: None)
    finally:
        device.close()
    s = data.batch_sampler
    frames = [int(round(hi * 100)) for _, hi in s.bucket_edges]
    expect = [max(b for b in range(1, n + 1) if device.peak(b * t * H) <= target)  # the widest activation: B*T*H
              for t, n in zip(frames, s.bucket_utterances)]
    assert [b["batch_size"] for b in doc["buckets"]] == expect
    tries = [t[1] for b in doc["buckets"] for t in b["tries"]]
    assert "over" in tries and ("oom" in tries) == (power > 1), tries
    assert doc["device"] == "fake"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "tuning moved the weights"
    assert expect != s.bucket_batch_sizes
    # the best single max_duration: no bucket over its measured size, and a hair more puts one over
    single = doc["max_duration"]
    at = DurationBucketSampler(DURS, max_duration=single, num_buckets=4, seed=1).bucket_batch_sizes
    above = DurationBucketSampler(DURS, max_duration=math.nextafter(single, math.inf), num_buckets=4, seed=1)
    assert all(a <= e for a, e in zip(at, expect)) and any(a > e for a, e in zip(above.bucket_batch_sizes, expect))
    # that max_duration trains a whole epoch on the fake device without an OOM
    loaded = loader(max_duration=single)
    device = FakeDevice(per_element=per_element, power=power)
    try:
        with ddptrain.Trainer(Tiny(), frame_loss, config(tmp_path, "trainer.max_epochs=1",
                                                         f"data.max_duration={single}"), loaded) as trainer:
            trainer.fit()
            assert trainer.step == len(loaded) and device.peak() <= target
    finally:
        device.close()


class MaskedAttention(nn.Module):
    """Frame self-attention that, like transformers' SDPA path, drops the padding mask when
    nothing is padded: with a mask, its largest input (what FakeDevice charges) is the B x T x T
    mask; without, B x T x H (a flash kernel keeps no T x T tensor)."""

    def forward(self, h, mask):
        scores = h @ h.transpose(1, 2) / H ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ h


class Attending(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.attn, self.out = nn.Linear(F, H), MaskedAttention(), nn.Linear(H, 1)

    def forward(self, x, lens):
        valid = torch.arange(x.shape[1])[None] < lens[:, None]
        mask = None if bool(valid.all()) else valid[:, None, :].expand(-1, x.shape[1], -1)  # keys only: finite rows
        return self.out(self.attn(self.proj(x), mask)).squeeze(-1)


def attending_loss(model, batch):
    lens = batch["feature_lens"]
    mask = torch.arange(batch["features"].shape[1])[None] < lens[:, None]
    return ((model(batch["features"], lens) - 1.0) ** 2 * mask).sum(), mask.sum()


def test_the_tuner_measures_padded_batches_as_training_runs_them(tmp_path):
    """Each bucket's costliest batch is padded like a real one: a model that skips its padding
    mask on an unpadded batch (transformers' SDPA attention) is measured on its masked path, so
    the tuned epoch stays under the target (measured unpadded, it went over by the mask)."""
    data = loader()
    s = data.batch_sampler
    assert all(len({DURS[r] for r in s.pessimistic_batch(k, 3)}) == 2 for k in range(s.num_buckets))
    device = FakeDevice(capacity=1e6 + 3e6)
    target = device.base + 2e6
    try:
        doc = tune.find_max_duration(Attending(), attending_loss, config(tmp_path), data, target / 1e9,
                                     tolerance=0, meter=device, say=lambda line: None)
        frames = [int(round(hi * 100)) for _, hi in s.bucket_edges]
        expect = [max(b for b in range(1, n + 1) if device.peak(b * t * t) <= target)  # the mask: B*T*T
                  for t, n in zip(frames, s.bucket_utterances)]
        assert [b["batch_size"] for b in doc["buckets"]] == expect
        loaded = loader(max_duration=doc["max_duration"])
        with ddptrain.Trainer(Attending(), attending_loss, config(tmp_path, "trainer.max_epochs=1"), loaded) as trainer:
            device.reset()
            trainer.fit()
        assert trainer.step == len(loaded) and device.peak() <= target
    finally:
        device.close()


def test_the_tuner_builds_no_trainer_and_writes_nothing(tmp_path, monkeypatch):
    """find_max_duration prepares the model as the Trainer does (ddptrain/prepare.py) and steps it
    without one: no run folder, no temporary folder, no logs (it used to build a whole Trainer in a
    temporary folder); the pre-flight check runs on that same narrow OneStep."""
    scratch, made, mkdtemp = tmp_path / "tmp", [], tempfile.mkdtemp
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **kw: made.append(mkdtemp(*a, **kw)) or made[-1])
    monkeypatch.setattr(ddptrain.Trainer, "__init__", lambda *a, **kw: pytest.fail("the tuner built a Trainer"))
    cfg = config(tmp_path, "trainer.preflight=all")
    device = FakeDevice()
    try:
        doc = tune.find_max_duration(Tiny(), frame_loss, cfg, loader(), (device.base + 60e3) / 1e9, tolerance=0,
                                     meter=device, say=lambda line: None)
        step = prepare_step(prepare_model(Tiny(), cfg, dist.setup_for(cfg)), frame_loss, cfg, dist.setup_for(cfg))
        said: list[str] = []
        checked = tune.preflight(step, loader(), "all", say=said.append)
    finally:
        device.close()
    assert doc["max_duration"] > 0 and len(doc["buckets"]) == 4
    assert [r["bucket"] for r in checked] == [3, 2, 1, 0] and len(said) == 4 and all("fits" in s for s in said)
    assert not os.path.exists(tmp_path / "run"), "trainer.output_dir was created"
    assert made == [], "the tuner made a temporary folder"
    # torch's own kernel cache folder (torchinductor_USER) is made by building any optimizer
    assert [n for n in os.listdir(scratch) if not n.startswith("torchinductor")] == []


def test_the_tuner_needs_a_bucket_sampler_and_one_process(tmp_path):
    plain = torch.utils.data.DataLoader(Frames(), batch_size=4)
    with pytest.raises(ddptrain.ConfigError, match="DurationBucketSampler"):
        tune.find_max_duration(Tiny(), frame_loss, config(tmp_path), plain, 1.0, meter=object())
    with pytest.raises(ddptrain.ConfigError, match="pass make_batch"):
        tune.find_max_duration(Tiny(), frame_loss, config(tmp_path), loader().batch_sampler, 1.0, meter=object())
    with pytest.raises(ddptrain.ConfigError, match="CUDA device"):
        tune.find_max_duration(Tiny(), frame_loss, config(tmp_path), loader(), 1.0)


@pytest.mark.timeout(120)
def test_command_line_on_the_asr_recipe_then_training_with_the_max_duration_it_prints(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import finetune_asr

    src = os.path.join(ROOT, "examples", "data", "digits", "base")
    manifest = tmp_path / "train.jsonl"
    with open(os.path.join(src, "train.jsonl")) as f, open(manifest, "w") as o:
        for line, _ in zip(f, range(24)):
            item = json.loads(line)
            item["audio_filepath"] = os.path.join(src, item["audio_filepath"])
            o.write(json.dumps(item) + "\n")
    args = [f"data.train_manifest={manifest}", 'data.eval_manifest=""', "demo.test_manifests=[]",
            f"data.tokenizer={tmp_path}/tok.json", "data.num_workers=0", "data.num_buckets=2",
            "data.spec_augment=false", "checkpoint.keep_best=0", "logging.progress_bar=false",
            "model.d_model=32", "model.num_heads=2", "model.ffn_dim=64", "model.num_layers=1", "trainer.device=cpu"]
    fake = FakeDevice(base=1e6, per_element=1.0, capacity=1e6 + 3e6)
    monkeypatch.setattr(tune, "default_meter", lambda dev: fake)
    docs, search = [], tune.find_max_duration
    monkeypatch.setattr(tune, "find_max_duration", lambda *a, **kw: docs.append(search(*a, **kw)) or docs[-1])
    try:
        rc = tune.main(["--recipe", os.path.join(ROOT, "examples", "finetune_asr.py"), "--config",
                        os.path.join(ROOT, "configs", "asr_demo.yaml"), "--memory-gb", "0.0025",
                        "--tolerance", "0", f"trainer.output_dir={tmp_path}/tune", *args])
        printed = capsys.readouterr().out
        (doc,) = docs
        best = math.floor(doc["max_duration"] * 10) / 10
        assert rc == 0 and f"train with: data.max_duration={best}\n" in printed
        for b in doc["buckets"]:  # the size chosen fits, one more does not (or the bucket is used up)
            assert b["peak_gb"] <= 0.0025
            assert b["capped"] or any(t[0] == b["batch_size"] + 1 and t[1] in ("oom", "over") for t in b["tries"])
        finetune_asr.main(["--config", os.path.join(ROOT, "configs", "asr_demo.yaml"), "trainer.max_steps=3",
                           "trainer.preflight=all", f"trainer.output_dir={tmp_path}/train", *args,
                           f"data.max_duration={best}"])
    finally:
        fake.close()
    err = capsys.readouterr().err
    assert err.count("pre-flight: bucket") == 2, err[-2000:]


def test_a_recipe_without_build_or_schema_is_refused(tmp_path):
    bad = tmp_path / "recipe_without_build.py"
    bad.write_text("import ddptrain\n")
    with pytest.raises(ddptrain.ConfigError, match="no build"):
        tune.load_recipe(str(bad))
    bad = tmp_path / "recipe_without_schema.py"
    bad.write_text("def build(cfg):\n    pass\n")
    with pytest.raises(ddptrain.ConfigError, match="exactly one ddptrain.Config subclass"):
        tune.load_recipe(str(bad))


# ----------------------------------------------------------------------------- pre-flight


def oom_above(rows_times_frames):
    """A loss_fn that runs out of (fake) memory for batches of more than this many padded frames."""
    def loss(model, batch):
        b, t = batch["features"].shape[:2]
        if b * t > rows_times_frames:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b * t} frames")
        return frame_loss(model, batch)
    return loss


def test_preflight_names_the_bucket_that_runs_out_of_memory(tmp_path):
    data = loader()
    s = data.batch_sampler
    padded = [b * int(round(hi * 100)) for b, (_, hi) in zip(s.bucket_batch_sizes, s.bucket_edges)]
    worst = int(np.argmax(padded))
    with ddptrain.Trainer(Tiny(), oom_above(max(padded) - 1), config(tmp_path, "trainer.preflight=worst",
                                                                      "trainer.max_steps=2"), data) as trainer:
        with pytest.raises(PreflightError) as e:
            trainer.fit()
        assert trainer.step == 0, "training started before the check"
    lo, hi = s.bucket_edges[worst]
    msg = str(e.value)
    assert f"bucket {worst} (utterances {lo:.2f}-{hi:.2f} s; batch of {s.bucket_batch_sizes[worst]}" in msg
    assert "out of memory" in msg and "python -m ddptrain.tune" in msg
    # every bucket fits: training goes on
    with ddptrain.Trainer(Tiny(), oom_above(max(padded)), config(tmp_path, "trainer.preflight=all",
                                                                 "trainer.max_steps=2", "checkpoint.start_over=true"),
                          loader()) as trainer:
        trainer.fit()
        assert trainer.step == 2


def _two_rank_preflight(rank, world_size, folder):
    for oom_on_rank1 in (True, False):
        data = loader(world_size=world_size, rank=rank)
        s = data.batch_sampler
        padded = max(b * int(round(hi * 100)) for b, (_, hi) in zip(s.bucket_batch_sizes, s.bucket_edges))
        loss = oom_above(padded - 1) if oom_on_rank1 and rank == 1 else frame_loss
        out = os.path.join(folder, f"oom{int(oom_on_rank1)}")
        cfg = config(out, "trainer.preflight=worst", "trainer.max_steps=2", "dist.timeout_s=60")
        with ddptrain.Trainer(Tiny(), loss, cfg, data) as trainer:
            try:
                trainer.fit()
                result = f"trained {trainer.step}"
            except PreflightError as e:
                result = str(e)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(result)


@pytest.mark.timeout(120)
def test_preflight_on_two_ranks_agrees_an_oom_on_one_rank_and_nobody_hangs(tmp_path):
    """Rank 1 runs out of memory before its model's forward; rank 0 must not wait in a collective."""
    run_ranks(_two_rank_preflight, 2, str(tmp_path), timeout=100)
    oom, fine = ([open(tmp_path / f"oom{k}" / f"rank{r}.txt").read() for r in range(2)] for k in (1, 0))
    assert "out of memory on another rank" in oom[0] and "does not fit" in oom[0]
    assert "CUDA out of memory. Tried to allocate" in oom[1] and "bucket" in oom[1]
    assert fine == ["trained 2", "trained 2"]


def train(tmp_path, name, preflight, steps=6):
    torch.manual_seed(3)
    cfg = config(tmp_path / name, f"trainer.preflight={preflight}", f"trainer.max_steps={steps}",
                 "logging.log_every=1", "optim.lr=0.05")
    with ddptrain.Trainer(Tiny(), frame_loss, cfg, loader()) as trainer:
        trainer.fit()
        weights = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    losses = [json.loads(line)["loss"] for line in open(tmp_path / name / "run" / "metrics.jsonl")
              if json.loads(line)["split"] == "train"]
    return losses, weights


def test_preflight_leaves_training_exactly_as_without_it(tmp_path):
    """Dropout, BatchNorm statistics and AdamW: the run with the check equals the run without."""
    plain_losses, plain_weights = train(tmp_path, "plain", "off")
    checked_losses, checked_weights = train(tmp_path, "checked", "all")
    assert checked_losses == plain_losses
    assert all(torch.equal(plain_weights[k], checked_weights[k]) for k in plain_weights)


def test_preflight_of_a_resumed_optimizer_leaves_its_state_alone(tmp_path):
    with ddptrain.Trainer(Tiny(), frame_loss, config(tmp_path, "trainer.max_steps=3"), loader()) as trainer:
        trainer.fit()
        state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
        params = [p.detach().clone() for p in trainer.module.parameters()]
        tune.preflight(trainer.one_step, trainer.train_data, "all")
        for p, s in trainer.optimizer.state.items():
            assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
        assert all(torch.equal(a, b) for a, b in zip(params, trainer.module.parameters()))


def test_preflight_needs_a_bucket_sampler(tmp_path):
    plain = torch.utils.data.DataLoader(Frames(), batch_size=4, collate_fn=loader().collate_fn)
    with ddptrain.Trainer(Tiny(), frame_loss, config(tmp_path, "trainer.preflight=worst",
                                                     "checkpoint.start_over=true"), plain) as t:
        with pytest.raises(ddptrain.ConfigError, match="trainer.preflight=worst: needs a DurationBucketSampler"):
            t.fit()
