"""Exact resume on the shipped ASR example's own data path, for every DataLoader setting users have.

What is compared: an uninterrupted run with ``num_workers: 0`` (the reference) against runs that
resume from its checkpoints with other loader settings. A resumed run must log the reference's
loss at every step after the resume point and end with bit-identical weights.

Set-up, as in examples/finetune_asr.py but tiny: ``ddptrain.data.build_dataloader`` (its
``DurationBucketSampler``) or a plain torch ``DistributedSampler`` over ``SpeechDataset``, a
1-block Conformer-CTC from examples/models, the example's CTC objective, dropout, SpecAugment
and speed perturbation on, warmup-cosine schedule. Each case runs past an epoch boundary.

The matrix:

* samplers: ``DurationBucketSampler`` (via ``build_dataloader``) and ``DistributedSampler``
  (the Trainer then skips the consumed batches by iterating);
* loader settings: workers 0, 1 (persistent), 2 (persistent), 2 (not persistent);
* resume points: mid-epoch and the last step of an epoch (the next run starts at an epoch
  boundary); on 1 rank each sampler resumes with every worker setting mid-epoch and with 0, 1
  and 2 workers at the epoch's end; on 2 ranks (gloo processes through tests/_dist.py: timeout,
  a failure on one rank ends both) with 2 persistent workers mid-epoch and 1 fresh worker at the end;
* ``feature_device: gpu`` (features and SpecAugment in the loss, on the CPU here), 1 rank, once.

The checkpoints come from the reference, so a resumed run with workers must also equal the
uninterrupted run without them: augmentation that depends on the workers shows up here.

Every run computes with one intra-op thread (``OMP_NUM_THREADS=1``, as torchrun sets it):
otherwise ddptrain gives a training process the cores its workers leave free
(``process.budget_cpu_threads``), so each ``num_workers`` would sum floats in another order and
runs with different settings could only agree to rounding. A resume with the same settings is
exact either way.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ddptrain
from ddptrain.data import CharTokenizer, SpeechCollator, SpeechDataset, build_dataloader, load_manifest

from _dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "examples", "data", "digits", "base")
sys.path.insert(0, os.path.join(ROOT, "examples"))

from finetune_asr import CTCObjective  # noqa: E402
from models.conformer_ctc import ConformerCTC, ConformerCTCConfig  # noqa: E402

NUM_UTTERANCES = 16
MEL = 40
# (num_workers, persistent_workers, resume point)
SETTINGS = [(0, False, "mid"), (1, True, "mid"), (2, True, "mid"), (2, False, "mid"),
            (0, False, "end"), (2, True, "end"), (1, True, "end")]
# on 2 ranks what is new is the per-rank position (the workers behave as on 1 rank)
TWO_RANK_SETTINGS = [(2, True, "mid"), (1, False, "end")]


def tiny_manifest(folder: str) -> str:
    """The first shipped base-train utterances, with absolute audio paths; returns the manifest."""
    out = os.path.join(folder, "tiny.jsonl")
    with open(os.path.join(BASE, "train.jsonl")) as src, open(out, "w") as dst:
        for line, _ in zip(src, range(NUM_UTTERANCES)):
            item = json.loads(line)
            item["audio_filepath"] = os.path.join(BASE, item["audio_filepath"])
            dst.write(json.dumps(item) + "\n")
    return out


def write_config(folder: str) -> None:
    """What every run shares (one YAML file: each command-line override costs a config merge)."""
    manifest = tiny_manifest(folder)
    with open(os.path.join(folder, "base.yaml"), "w") as f:
        f.write(f"""
trainer: {{precision: fp32, clip_grad_norm: 5.0, eval_every: 0, seed: 0, gc_every_steps: 0}}
optim: {{name: adamw, lr: 3.0e-3, weight_decay: 0.01}}
scheduler: {{name: warmup_cosine, warmup_steps: 2, min_lr_ratio: 0.05}}
checkpoint: {{keep_last: 0, save_at_end: false}}
logging: {{log_every: 1, progress_bar: false}}
data: {{train_manifest: {manifest}, features: fbank, num_mel_bins: {MEL}, spec_augment: true, freq_masks: 2,
       freq_mask_width: 8, time_masks: 2, time_mask_ratio: 0.1, speed_perturb: [0.9, 1.0, 1.1],
       max_duration: 8, num_buckets: 2, pin_memory: false, prefetch_factor: 2}}
""")


def make_cfg(out: str, run: str, workers: int, persistent: bool, steps: int, save_every: int, resume: str,
             extra: tuple):
    return ddptrain.load_config(os.path.join(out, "base.yaml"), [
        f"trainer.output_dir={os.path.join(out, run)}", f"trainer.max_steps={steps}",
        f"checkpoint.every_steps={save_every}", f"checkpoint.resume={resume}", f"data.num_workers={workers}",
        f"data.persistent_workers={str(persistent).lower()}", *extra])


def make_loader(cfg, tokenizer, sampler: str, world: int, rank: int):
    if sampler == "bucket":
        return build_dataloader(cfg.data.train_manifest, cfg.data, tokenizer, train=True,
                                world_size=world, rank=rank)
    # what a user writes around ddptrain's dataset with torch's own sampler
    dataset = SpeechDataset(load_manifest(cfg.data.train_manifest), cfg.data, tokenizer, train=True)
    workers = cfg.data.num_workers
    return DataLoader(dataset, batch_size=3, num_workers=workers,
                      sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0),
                      collate_fn=SpeechCollator("features", MEL, cfg.data.pad_to_multiple, with_tokens=True),
                      persistent_workers=cfg.data.persistent_workers and workers > 0)


def train(out: str, run: str, sampler: str, world: int, rank: int, workers: int, persistent: bool,
          steps: int, save_every: int, resume: str, extra: tuple) -> dict:
    """One run of the example's recipe; returns its final step and weights."""
    cfg = make_cfg(out, run, workers, persistent, steps, save_every, resume, extra)
    tokenizer = CharTokenizer.build(cfg.data.train_manifest)
    loader = make_loader(cfg, tokenizer, sampler, world, rank)
    torch.manual_seed(0)  # the same initial weights in every run, as the example does
    model = ConformerCTC(ConformerCTCConfig(input_dim=MEL, d_model=16, num_heads=2, ffn_dim=32, num_layers=1,
                                            depthwise_conv_kernel_size=7, subsampling_channels=4,
                                            vocab_size=tokenizer.vocab_size, dropout=0.1))
    objective = CTCObjective(tokenizer, getattr(loader, "feature_extractor", None))
    trainer = ddptrain.Trainer(model, objective, cfg, loader)
    trainer.fit()  # shuts its loader's persistent workers down (test_trainer.py checks)
    return {"step": trainer.step, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def losses(out: str, run: str) -> dict[int, float]:
    """Step -> logged training loss (rank 0 writes metrics.jsonl)."""
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r.get("split") == "train"}


def _matrix(rank: int, world: int, out: str, sampler: str, settings: list, extra: tuple) -> dict:
    """The reference run, then each setting resumed from one of its checkpoints.

    Returns:
        ``{"problems": [what differs], "timings": {run: seconds}}``.
    """
    probe = make_loader(make_cfg(out, "probe", 0, False, 1, 0, "none", extra), None, sampler, world, rank)
    per_epoch = len(probe)
    points = {"mid": max(1, per_epoch // 2), "end": per_epoch}
    steps = per_epoch + 2  # both resume points are followed by an epoch boundary and more steps
    save_every = math.gcd(*points.values())  # saves at both resume points (and few others)
    start = time.perf_counter()
    ref = train(out, "ref", sampler, world, rank, 0, False, steps, save_every, "none", extra)
    problems, timings = [], {"reference: workers=0, uninterrupted": round(time.perf_counter() - start, 2)}
    for workers, persistent, point in settings:
        name = f"workers={workers}{' persistent' if persistent else ''} resumed at the {point} of epoch 0"
        start = time.perf_counter()
        ckpt_dir = os.path.join(out, "ref", "checkpoints", f"step_{points[point]:08d}")
        run = f"w{workers}{'p' if persistent else ''}_{point}"
        got = train(out, run, sampler, world, rank, workers, persistent, steps, save_every, ckpt_dir, extra)
        timings[name] = round(time.perf_counter() - start, 2)
        if got["step"] != steps:
            problems.append(f"{name}: ended at step {got['step']}, not {steps}")
        differ = [k for k in ref["weights"] if not torch.equal(ref["weights"][k], got["weights"][k])]
        if differ:
            problems.append(f"{name}: {len(differ)} of {len(ref['weights'])} tensors differ (e.g. {differ[0]})")
        if rank == 0:
            a, b = losses(out, "ref"), losses(out, run)
            bad = [s for s in range(points[point] + 1, steps + 1) if a.get(s) != b.get(s)]
            if bad:
                problems.append(f"{name}: loss differs from step {bad[0]} on (reference {a.get(bad[0])}, "
                                f"resumed {b.get(bad[0])})")
    return {"problems": problems, "timings": timings}


def _cases(rank: int, world: int, out: str, cases: list) -> None:
    """Every case of one process group; each rank writes ``result_rank{rank}.json``."""
    os.environ["OMP_NUM_THREADS"] = "1"  # see the module docstring
    torch.set_num_threads(1)
    if world > 1:
        # ranks started by spawn inherit spawn as the default start method, and every worker would
        # import torch anew; under torchrun (and in the 1-rank cases) Linux workers fork
        torch.multiprocessing.set_start_method("fork", force=True)
    results = {}
    for name, sampler, settings, extra in cases:
        results[name] = _matrix(rank, world, os.path.join(out, name), sampler, settings, extra)
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
        json.dump(results, f)


def check(tmp_path, monkeypatch, world: int, cases: list) -> None:
    """Run ``cases`` (name, sampler, settings, extra overrides) on ``world`` ranks; assert no difference."""
    for name, *_ in cases:
        os.makedirs(tmp_path / name)
        write_config(str(tmp_path / name))
    if world == 1:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        threads = torch.get_num_threads()
        try:
            _cases(0, 1, str(tmp_path), cases)
        finally:
            torch.set_num_threads(threads)
    else:
        run_ranks(_cases, world, str(tmp_path), cases, timeout=300)
    problems = []
    for rank in range(world):
        with open(tmp_path / f"result_rank{rank}.json") as f:
            for name, result in json.load(f).items():
                problems += [f"{name}, rank {rank}: {p}" for p in result["problems"]]
                if rank == 0:
                    print(name, json.dumps(result["timings"], indent=1))
    assert not problems, "resumed runs differ from the uninterrupted one:\n" + "\n".join(problems)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sampler", ["bucket", "distributed"])
def test_one_rank_resumes_like_the_uninterrupted_run(tmp_path, monkeypatch, sampler):
    check(tmp_path, monkeypatch, 1, [(sampler, sampler, SETTINGS, ())])


@pytest.mark.timeout(300)
def test_two_ranks_resume_like_the_uninterrupted_run(tmp_path, monkeypatch):
    """One process group for both samplers: starting 2 ranks costs more than their runs."""
    check(tmp_path, monkeypatch, 2, [(s, s, TWO_RANK_SETTINGS, ()) for s in ("bucket", "distributed")])


@pytest.mark.timeout(120)
def test_resume_with_features_computed_in_the_loss(tmp_path, monkeypatch):
    """``feature_device: gpu`` on the CPU: SpecAugment runs in the training process on the global
    RNG (restored by the checkpoint), speed perturbation still in the workers."""
    check(tmp_path, monkeypatch, 1, [("gpu_features", "bucket", [(2, True, "mid")], ("data.feature_device=gpu",))])
