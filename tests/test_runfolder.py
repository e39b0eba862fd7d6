"""A run owns its folder (ddptrain/runfolder.py): the lock, run ids, and no silent reuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ddptrain
from ddptrain import checkpoint as ckpt
from ddptrain.runfolder import FolderLock
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches


def _trainer(tmp, *extra):
    torch.manual_seed(0)
    return ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(tmp, "trainer.max_steps=4", *extra), micro_batches(2)[0])


def test_a_second_run_on_a_held_folder_is_refused(tmp_path):
    lock = FolderLock(str(tmp_path))
    with pytest.raises(ckpt.CheckpointError, match=rf"in use by another run \(.*\"pid\": {os.getpid()}"):
        _trainer(tmp_path)
    lock.release()
    _trainer(tmp_path).fit()  # free again


def test_the_lock_dies_with_its_process(tmp_path):
    holder = textwrap.dedent(f"""
        import os, sys
        from ddptrain.runfolder import FolderLock
        lock = FolderLock({str(tmp_path)!r})
        print("held", flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", holder], capture_output=True, text=True, timeout=60)
    assert "held" in out.stdout and out.returncode == -9
    _trainer(tmp_path).fit()


def test_a_new_run_in_another_runs_folder_is_refused_then_archived_on_request(tmp_path):
    _trainer(tmp_path, "checkpoint.every_steps=2").fit()
    old = sorted(os.listdir(tmp_path / "checkpoints"))
    with pytest.raises(ckpt.CheckpointError, match="holds another run's checkpoints.*checkpoint.resume=auto"
                                                   ".*checkpoint.start_over=true"):
        _trainer(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == old  # nothing touched
    _trainer(tmp_path, "checkpoint.start_over=true", "checkpoint.every_steps=2").fit()
    archived = list((tmp_path / "archive").iterdir())
    assert len(archived) == 1 and sorted(os.listdir(archived[0] / "checkpoints")) == old
    ids = {json.load(open(p / "meta.json"))["run_id"] for p in (tmp_path / "checkpoints").iterdir()}
    assert len(ids) == 1 and ids.isdisjoint({json.load(open(archived[0] / "checkpoints" / o / "meta.json"))["run_id"]
                                             for o in old})


def test_resume_keeps_the_run_id_and_prune_spares_other_runs(tmp_path):
    _trainer(tmp_path, "checkpoint.every_steps=1", "checkpoint.keep_last=0").fit()
    root = tmp_path / "checkpoints"
    foreign = root / "step_00000001"
    meta = json.load(open(foreign / "meta.json"))
    run_id = meta["run_id"]
    meta["run_id"] = "someone-else"
    (foreign / "meta.json").write_text(json.dumps(meta))
    t = _trainer(tmp_path, "checkpoint.resume=auto", "trainer.max_steps=6", "checkpoint.every_steps=1",
                 "checkpoint.keep_last=1")
    assert t.progress.run_id == run_id
    t.fit()
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000006"]  # the foreign one is left alone


def test_save_refuses_to_overwrite_another_runs_checkpoint(tmp_path):
    t = _trainer(tmp_path, "checkpoint.every_steps=2")
    t.fit()
    t.progress.run_id = "intruder"
    with pytest.raises(ckpt.CheckpointError, match="belongs to run"):
        t.save()  # step 4 exists, written by the real run


def test_prune_failure_warns_and_training_goes_on(tmp_path, monkeypatch):
    real = ckpt.shutil.rmtree

    def stuck(path, *a, **k):
        if os.path.basename(str(path)).startswith("step_"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(ckpt.shutil, "rmtree", stuck)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = _trainer(tmp_path, "checkpoint.every_steps=1", "checkpoint.keep_last=1")
        t.fit()
    assert t.step == 4
    assert any("could not delete old checkpoint" in str(w.message) and "step_0000000" in str(w.message)
               for w in caught)


def test_resume_paths_say_what_they_are(tmp_path):
    _trainer(tmp_path / "a", "checkpoint.every_steps=2").fit()
    # a run folder resumes from its newest complete checkpoint
    t = _trainer(tmp_path / "b", f"checkpoint.resume={tmp_path / 'a'}", "trainer.max_steps=5")
    assert t.step == 4
    t.close()
    (tmp_path / "a" / "checkpoints" / ".tmp-step_00000009").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="interrupted while being written"):
        _trainer(tmp_path / "c", f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / '.tmp-step_00000009'}")
    (tmp_path / "junk").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="is not a ddptrain checkpoint"):
        _trainer(tmp_path / "d", f"checkpoint.resume={tmp_path / 'junk'}")


# ------------------------------------------------- every file in the folder is a run's (issue 30, item 2)


def test_start_over_archives_every_file_of_the_previous_run_but_the_inputs_it_reads(tmp_path):
    _trainer(tmp_path, "checkpoint.every_steps=2").fit()
    (tmp_path / "report.json").write_text('{"before": {"x": 1}}')  # what a recipe wrote after fit
    (tmp_path / "samples").mkdir()
    (tmp_path / "tokenizer.json").write_text("{}")  # an input the new run's config names: it stays
    t = _trainer(tmp_path, "checkpoint.start_over=true", f"data.tokenizer={tmp_path / 'tokenizer.json'}")
    t.close()
    archived = list((tmp_path / "archive").iterdir())
    assert len(archived) == 1
    assert {"report.json", "samples", "checkpoints", "metrics.jsonl", "config.yaml"} <= set(os.listdir(archived[0]))
    assert json.load(open(archived[0] / "report.json")) == {"before": {"x": 1}}
    assert not (tmp_path / "report.json").exists() and (tmp_path / "tokenizer.json").exists()


def test_a_new_run_archives_what_a_run_without_checkpoints_left_behind(tmp_path, capsys):
    _trainer(tmp_path, "checkpoint.save_at_end=false").fit()  # no checkpoint: nothing to resume or refuse
    first = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    _trainer(tmp_path, "checkpoint.save_at_end=false", "trainer.max_steps=2").fit()
    archived = list((tmp_path / "archive").iterdir())
    assert len(archived) == 1 and (archived[0] / "metrics.jsonl").read_text() == first
    assert "moved" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert max(steps) == 2  # the new run's own log, not appended to the old one's


def test_write_file_archives_the_version_it_replaces(tmp_path):
    from ddptrain.runfolder import write_file

    write_file(str(tmp_path), "report.json", '{"a": 1}')
    write_file(str(tmp_path), "report.json", '{"a": 1}')  # the same text: nothing to keep
    assert not (tmp_path / "archive").exists()
    old = write_file(str(tmp_path), "report.json", '{"a": 2}')
    assert open(old).read() == '{"a": 1}' and os.path.dirname(os.path.dirname(old)) == str(tmp_path / "archive")
    assert (tmp_path / "report.json").read_text() == '{"a": 2}'
    again = write_file(str(tmp_path), "report.json", '{"a": 3}')  # within the same second: its own folder
    assert again != old and open(again).read() == '{"a": 2}' and open(old).read() == '{"a": 1}'


def test_forked_workers_do_not_hold_the_folder_lock(tmp_path):
    """issue 30, item 14: a restart right after a SIGKILL was refused while the dead run's DataLoader
    workers (forked, so holding the lock's descriptor) were still alive."""
    holder = textwrap.dedent(f"""
        import multiprocessing, os, time
        from ddptrain.runfolder import FolderLock
        lock = FolderLock({str(tmp_path)!r})
        worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
        worker.start()  # as a DataLoader worker is started
        print(worker.pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())  # not communicate(): the worker holds the pipe open too
    assert proc.wait(timeout=60) == -9
    try:
        os.kill(worker, 0)  # the worker outlives its parent
        FolderLock(str(tmp_path)).release()  # not refused
    finally:
        os.kill(worker, 9)
