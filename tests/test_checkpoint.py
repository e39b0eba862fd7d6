"""Training-state folders: incomplete and damaged checkpoints named, failed saves agreed on by every
rank, SHA256SUMS written and checked, pruning, the run id (weights files: tests/test_weights.py)."""

from __future__ import annotations

import os

import pytest
import torch

import ddptrain
from ddptrain import checkpoint as ckpt
from ddptrain import weights
from _dist import run_ranks
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches


def test_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.read_meta(str(tmp_path / "step_00000001"))


def test_run_id_of_reads_meta_json_and_says_none_when_it_cannot(tmp_path):
    """The one reader of a checkpoint's run id, for saving, pruning and runfolder's resume."""
    step = tmp_path / "step_00000001"
    step.mkdir()
    assert ckpt.run_id_of(str(step)) is None  # no meta.json
    for text, want in (('{"run_id": "abc"}', "abc"), ('{"step": 1}', None), ("[1, 2]", None), ("{", None)):
        (step / "meta.json").write_text(text)
        assert ckpt.run_id_of(str(step)) == want, text


@pytest.mark.parametrize("meta", [None, '{"world_size": ', '{"step": 3}'])
def test_missing_or_damaged_meta_is_named(tmp_path, meta):
    step = tmp_path / "step_00000001"
    step.mkdir()
    (step / ckpt.COMPLETE).write_text("")
    if meta is not None:
        (step / "meta.json").write_text(meta)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot read checkpoint .*step_00000001: meta.json"):
        ckpt.read_meta(str(step))


def test_prune_keeps_best_and_newest(tmp_path):
    cfg = make_cfg(tmp_path, "trainer.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=1",
                   "checkpoint.keep_best=1", "trainer.eval_every=1", "checkpoint.best_metric=loss")
    data = micro_batches(3)[0] * 3
    torch.manual_seed(0)
    t = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data, eval_data=data[:1])
    t.fit()
    kept = sorted(os.listdir(tmp_path / "checkpoints"))
    assert "step_00000006" in kept and 1 <= len(kept) <= 2


def _failing_save_worker(rank, world, out):
    torch.manual_seed(0)
    cfg = make_cfg(out, "trainer.max_steps=4", "checkpoint.every_steps=2", "checkpoint.save_at_end=false")
    data = [mb[rank] for mb in micro_batches(4)]
    trainer = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data)
    real = torch.save
    calls = {"n": 0}

    def disk_full(obj, f, *a, **k):
        calls["n"] += 1
        if rank == 1 and "step_00000004" in getattr(f, "name", ""):  # rank 1's second checkpoint: "disk full"
            raise OSError(28, "No space left on device")
        return real(obj, f, *a, **k)

    ckpt.torch.save = disk_full
    with pytest.raises(ckpt.CheckpointError, match="rank 1: OSError.*No space left"):
        trainer.fit()
    assert trainer.step == 4
    assert ckpt.find_latest(os.path.join(out, "checkpoints")).endswith("step_00000002")


@pytest.mark.timeout(120)
def test_failed_save_errors_on_every_rank_and_keeps_previous(tmp_path):
    run_ranks(_failing_save_worker, 2, str(tmp_path))
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_00000002"]  # the torn step-4 folder was removed
    assert (root / "step_00000002" / "COMPLETE").exists()


def test_keep_best_by_a_metric_the_run_never_logs_is_refused(tmp_path):
    data = micro_batches(3)[0]
    cfg = make_cfg(tmp_path / "a", "trainer.max_steps=2", "checkpoint.keep_best=1", "checkpoint.best_metric=wer")
    t = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data, eval_data=data[:1])
    with pytest.raises(ddptrain.ConfigError, match=r"checkpoint.best_metric='wer' is not a metric .*\(loss\)"):
        t.fit()
    assert t.step == 0  # refused before training, not after it
    cfg = make_cfg(tmp_path / "b", "trainer.max_steps=2", "checkpoint.keep_best=1")
    with pytest.raises(ddptrain.ConfigError, match="no eval_data"):
        ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data)


# ----------------------------------------------------------------------------- checksums (issue 30, item 1)


def _corrupt_in_place(path):
    """Flip the last byte (tensor data, not the header): same size, still a valid safetensors file."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def _run(tmp, *extra):
    torch.manual_seed(0)
    cfg = make_cfg(tmp, "trainer.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0", *extra)
    return ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(2)[0])


def test_every_checkpoint_file_has_a_checksum_sha256sum_can_check(tmp_path):
    import hashlib

    _run(tmp_path).fit()
    step = tmp_path / "checkpoints" / "step_00000004"
    lines = (step / ckpt.CHECKSUMS).read_text().splitlines()
    sums = dict(reversed(line.split("  ", 1)) for line in lines)  # `sha256sum -c SHA256SUMS` format
    assert {"model.safetensors", "trainer.pt", "rng_rank0.pt", "sampler_rank0.pt", "config.yaml",
            "meta.json"} <= set(sums)
    for name, digest in sums.items():
        assert hashlib.sha256((step / name).read_bytes()).hexdigest() == digest, name


def test_a_checkpoint_corrupted_in_place_is_refused_and_auto_resume_falls_back(tmp_path, capsys):
    _run(tmp_path).fit()
    root = tmp_path / "checkpoints"
    _corrupt_in_place(root / "step_00000004" / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000004.*model.safetensors.*changed after it was saved"):
        weights.load_weights(FrameMLP(), str(root / "step_00000004"))
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors.*changed after it was saved.*step_00000002"):
        _run(tmp_path / "b", f"checkpoint.resume={root / 'step_00000004'}")  # asked for by path: refused
    capsys.readouterr()
    t = _run(tmp_path, "checkpoint.resume=auto", "trainer.max_steps=6")
    assert t.step == 2  # the newest checkpoint whose files are the ones saved
    said = capsys.readouterr().out
    assert "step_00000004" in said and "model.safetensors" in said and "resumed from" in said
    t.close()


def test_pruning_never_deletes_the_newest_intact_checkpoint(tmp_path):
    _run(tmp_path).fit()
    root = tmp_path / "checkpoints"
    _corrupt_in_place(root / "step_00000004" / "trainer.pt")
    run_id = ckpt.read_meta(str(root / "step_00000004"))["run_id"]
    ckpt.prune(str(root), keep_last=1, keep_best=0, metric="loss", mode="min", run_id=run_id)
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004"]


def test_checkpoints_saved_without_checksums_still_load_and_say_so(tmp_path, capsys):
    _run(tmp_path).fit()
    for step in (tmp_path / "checkpoints").iterdir():
        (step / ckpt.CHECKSUMS).unlink()  # as an older ddptrain wrote them
    weights.load_weights(FrameMLP(), str(tmp_path))
    capsys.readouterr()
    t = _run(tmp_path, "checkpoint.resume=auto", "trainer.max_steps=6")
    assert t.step == 4
    assert f"no {ckpt.CHECKSUMS}" in capsys.readouterr().out
    t.fit()
    assert (tmp_path / "checkpoints" / "step_00000006" / ckpt.CHECKSUMS).exists()


def test_keep_best_gets_a_metric_for_every_scheduled_checkpoint(tmp_path):
    """issue 30, item 6: eval_every=0 (the default) with every_steps>0 left every checkpoint without
    metrics (the final evaluation came after the last periodic save), so keep_best ranked nothing."""
    import json

    data = micro_batches(3)[0] * 3
    cfg = make_cfg(tmp_path, "trainer.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                   "checkpoint.keep_best=1", "trainer.eval_every=0")
    torch.manual_seed(0)
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data, eval_data=data[:1]).fit()
    root = tmp_path / "checkpoints"
    metrics = {p: json.load(open(root / p / "meta.json"))["metrics"] for p in sorted(os.listdir(root))}
    assert list(metrics) == ["step_00000002", "step_00000004", "step_00000006"]
    assert all("loss" in m for m in metrics.values()), metrics


def test_keep_best_probe_accepts_a_metric_of_a_source_its_first_batch_lacks(tmp_path):
    """issue 30, item 12: the one-batch probe refused a valid per-source metric (``err/b``)
    because the first evaluation batch held no utterance of source b."""
    data = micro_batches(3)[0]
    evals = [dict(data[0], sources=["a"] * 3), dict(data[1], sources=["b"] * 2)]

    def per_source(model, batch):
        sse, n = frame_loss(model, batch)
        return {f"err/{s}": (float(sse), float(n)) for s in set(batch["sources"])}

    def trainer(tmp, metric):
        cfg = make_cfg(tmp, "trainer.max_steps=2", "checkpoint.keep_best=1", f"checkpoint.best_metric={metric}",
                       "data.eval_sources={a: a.jsonl, b: b.jsonl}")
        torch.manual_seed(0)
        return ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data, eval_data=evals, metrics_fn=per_source)

    t = trainer(tmp_path / "ok", "err/b")
    assert "err/b" in t.fit()
    for bad in ("err/c", "wer/b"):  # not a source; not a metric the run produces
        with pytest.raises(ddptrain.ConfigError, match=rf"best_metric='{bad}' is not a metric"):
            trainer(tmp_path / bad.replace("/", "_"), bad).fit()


def _damaged_rank_file_worker(rank, world, out):
    data = [mb[rank] for mb in micro_batches(4)]
    cfg = make_cfg(out, "trainer.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0")
    torch.manual_seed(0)
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data).fit()
    if rank == 0:  # another rank's file: rank 0 checks every file of the folder before the ranks load
        _corrupt_in_place(os.path.join(out, "checkpoints", "step_00000004", "rng_rank1.pt"))
    ddptrain.dist.barrier()
    torch.manual_seed(0)
    t = ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(out, "trainer.max_steps=6", "checkpoint.resume=auto"), data)
    assert t.step == 2, t.step
    t.fit()


@pytest.mark.timeout(120)
def test_two_ranks_fall_back_together_past_a_damaged_rank_file(tmp_path):
    run_ranks(_damaged_rank_file_worker, 2, str(tmp_path))
    assert (tmp_path / "checkpoints" / "step_00000006" / ckpt.CHECKSUMS).exists()
