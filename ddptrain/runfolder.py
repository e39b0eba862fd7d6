"""A run owns its folder: an exclusive lock, a run id, and no silent reuse of another run's folder.

Two runs started on one ``trainer.output_dir`` would overwrite each other's checkpoints and
interleave metrics.jsonl; a new run in an old run's folder would prune the old run's
checkpoints and overwrite some of them. So:

* rank 0 holds an exclusive ``flock`` on ``<output_dir>/.lock`` from the Trainer's start to the
  end of ``fit()`` (or ``close()``); the kernel drops it when the process dies, however it dies.
  A second run is refused at once with the holder's pid, host and start time.
* every run has an id, written into each of its checkpoints; a resume from this folder's own
  checkpoints continues that run (same id). Only checkpoints with the run's id are ever pruned
  or overwritten (see checkpoint.py).
* a new run (``checkpoint.resume: none``) in a folder that holds another run's checkpoints is
  refused with what to do, unless ``checkpoint.start_over: true``: then that run's files are
  moved, not deleted, to ``<output_dir>/archive/<time>/``.

flock is advisory and local to one machine's kernel (on NFS it depends on the mount): it stops
the common accident of two launches on one folder, not a determined second writer.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from typing import Any, Optional

import torch

from ddptrain import dist
from ddptrain.checkpoint import (CheckpointError, check_writable, checkpoint_root, list_complete, mark_intact,
                                 newest_intact, read_checksums, resolve)

LOCK = ".lock"
RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "config.yaml")


class FolderLock:
    """The exclusive hold on a run folder (taken by rank 0 only).

    Raises:
        CheckpointError: another process holds the folder (its pid, host and start are named).
    """

    def __init__(self, output_dir: str):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, LOCK)
        self._fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 4096, 0).decode(errors="replace").strip() or "unknown process"
            os.close(self._fd)
            self._fd = None
            raise CheckpointError(f"{output_dir} is in use by another run ({holder}); wait for it to "
                                  "finish, or give this run another trainer.output_dir") from None
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, info.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self):
        self.release()


def open_run(cfg: Any, is_main: bool, device: torch.device) -> tuple[Optional[FolderLock], Optional[str], str]:
    """Collective: check the run folder on every rank, lock and claim it on rank 0.

    Args:
        cfg: the whole config (``trainer.output_dir`` and the ``checkpoint`` section are read).

    Returns:
        ``(lock or None on other ranks, checkpoint to resume from or None, run id)``.

    Raises:
        CheckpointError: on every rank: unwritable folder, a folder in use or owned by another
            run, a resume path that is not a checkpoint.
    """
    out, c = cfg.trainer.output_dir, cfg.checkpoint
    error = None
    try:  # every rank checks: on several nodes each writes its own rank files
        check_writable(checkpoint_root(out), c.min_free_gb)
    except CheckpointError as e:
        error = e
    if dist.any_rank(error is not None, device):
        raise error or CheckpointError(f"another rank cannot write to {checkpoint_root(out)}")
    lock, decision = None, None
    if is_main:
        try:
            lock = FolderLock(out)
            want = c.resume
            # the newest checkpoint whose files match their checksums (a damaged newer one is named)
            path = None if want in ("", "none") else newest_intact(checkpoint_root(out)) if want == "auto" \
                else resolve(want)
            archived, run_id = claim(out, path, c.start_over)
            if archived:
                print(f"checkpoint.start_over: moved the previous run's files to {archived}")
            decision = (path, run_id)
        except CheckpointError as e:
            if lock is not None:
                lock.release()
            decision = str(e)
    decision = dist.broadcast_object(decision)
    if isinstance(decision, str):
        raise CheckpointError(decision)
    if decision[0] and not is_main:  # rank 0 has hashed its files: the others need not again
        mark_intact(decision[0], read_checksums(decision[0]) or ())
    return (lock, *decision)


def claim(output_dir: str, resuming_from: Optional[str], start_over: bool) -> tuple[Optional[str], str]:
    """Decide whose folder this is, on rank 0, before any file of the new run is written.

    Args:
        output_dir: the run folder.
        resuming_from: the checkpoint this run resumes from, or None for a new run.
        start_over: ``checkpoint.start_over``: archive another run's files instead of refusing.

    Returns:
        ``(archived_to or None, run_id)``: a resume of this folder's own checkpoint keeps its
        run's id; anything else is a new run with a new id.

    Raises:
        CheckpointError: a new run in a folder holding another run's checkpoints.
    """
    root = checkpoint_root(output_dir)
    existing = list_complete(root)
    if resuming_from is not None:
        own = os.path.realpath(os.path.dirname(os.path.normpath(resuming_from))) == os.path.realpath(root)
        run_id = _meta_run_id(resuming_from) if own else None
        if own or not existing:
            return None, run_id or new_run_id()
    if not existing:
        return None, new_run_id()
    if not start_over:
        raise CheckpointError(
            f"{output_dir} holds another run's checkpoints ({len(existing)}, newest "
            f"{os.path.basename(existing[-1][1])}). To continue that run set checkpoint.resume=auto; "
            f"to keep it and start a new one, give this run another trainer.output_dir; to start over "
            f"here, set checkpoint.start_over=true (its files are moved to {output_dir}/archive/, not deleted)")
    archive = os.path.join(output_dir, "archive", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(archive, exist_ok=True)
    for name in RUN_FILES:
        if os.path.exists(os.path.join(output_dir, name)):
            os.rename(os.path.join(output_dir, name), os.path.join(archive, name))
    return archive, new_run_id()


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _meta_run_id(checkpoint: str) -> Optional[str]:
    try:
        with open(os.path.join(checkpoint, "meta.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None
