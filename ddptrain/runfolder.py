"""A run owns its folder: an exclusive lock, a run id, and no silent reuse of another run's folder.

Two runs started on one ``trainer.output_dir`` would overwrite each other's checkpoints and
interleave metrics.jsonl; a new run in an old run's folder would prune the old run's
checkpoints and overwrite some of them. So:

* rank 0 holds an exclusive ``flock`` on ``<output_dir>/.lock`` from the Trainer's start to the
  end of ``fit()`` (or ``close()``); the kernel drops it when the process dies, however it dies.
  A second run is refused at once with the holder's pid, host and start time. A flock belongs to
  the open file, which a fork shares: a forked child (a DataLoader worker) closes its copy at once
  (``os.register_at_fork``), so workers that outlive a killed run do not hold its folder.
* every run has an id, written into each of its checkpoints; a resume from this folder's own
  checkpoints continues that run (same id). Only checkpoints with the run's id are ever pruned
  or overwritten (see checkpoint.py).
* a new run (``checkpoint.resume: none``) in a folder that holds another run's checkpoints is
  refused with what to do, unless ``checkpoint.start_over: true``: then that run's files are
  moved, not deleted, to ``<output_dir>/archive/<time>/``: all of them (a recipe's report.json
  and samples too), except the inputs the new run's config names (a tokenizer file kept there).
  A previous run that left files but no complete checkpoint has nothing to resume or to refuse
  for: its files are moved the same way, and the new run says so.
* every file in the folder belongs to a run and is appended to or archived, never silently
  replaced: the logs append, a resume appends its changes to config.yaml, and a recipe writes
  its own files with :func:`write_file`, which moves the version it replaces to the archive.

flock is advisory and local to one machine's kernel (on NFS it depends on the mount): it stops
the common accident of two launches on one folder, not a determined second writer.
"""

from __future__ import annotations

import dataclasses
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
                                 newest_intact, read_checksums, resolve, run_id_of)

LOCK = ".lock"
ARCHIVE = "archive"
RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "config.yaml")  # what tells that a run was here
_HELD: set[int] = set()  # the descriptors of the locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child: close the parent's lock descriptors (the parent's lock stays held)."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class FolderLock:
    """The exclusive hold on a run folder (taken by rank 0 only).

    Raises:
        CheckpointError: another process holds the folder (its pid, host and start are named).
    """

    def __init__(self, output_dir: str):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, LOCK)
        self._pid = os.getpid()  # a forked child's copy of this object must not close a descriptor
        self._fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 4096, 0).decode(errors="replace").strip() or "unknown process"
            os.close(self._fd)
            self._fd = None
            raise CheckpointError(f"{output_dir} is in use by another run ({holder}){_if_dead(holder)}; wait "
                                  "for it to finish, or give this run another trainer.output_dir") from None
        _HELD.add(self._fd)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, info.encode(), 0)

    def release(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            _HELD.discard(self._fd)
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __del__(self):
        self.release()


def _if_dead(holder: str) -> str:
    """A note when the recorded holder is a process of this host that has exited: what holds the
    lock then is a child it forked before ddptrain closed locks in children (or a child it exec'd
    with the descriptor passed on)."""
    try:
        info = json.loads(holder)
        if info.get("host") != socket.gethostname():
            return ""
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return (f"; pid {info['pid']} has exited, so a process it started still holds the lock: it ends "
                "with that process (ps -o pid,ppid,cmd to find it)")
    except (ValueError, KeyError, TypeError, PermissionError, OSError):
        pass
    return ""


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
            archived, run_id = claim(out, path, c.start_over, keep=_inputs(cfg))
            if archived:
                print(f"{'checkpoint.start_over: ' if c.start_over else 'a new run: '}moved the previous run's "
                      f"files ({', '.join(sorted(os.listdir(archived)))}) to {archived}")
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


def claim(output_dir: str, resuming_from: Optional[str], start_over: bool,
          keep: frozenset = frozenset()) -> tuple[Optional[str], str]:
    """Decide whose folder this is, on rank 0, before any file of the new run is written.

    Args:
        output_dir: the run folder.
        resuming_from: the checkpoint this run resumes from, or None for a new run.
        start_over: ``checkpoint.start_over``: archive another run's files instead of refusing.
        keep: real paths of the new run's inputs (:func:`_inputs`): never moved to the archive.

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
        run_id = run_id_of(resuming_from) if own else None
        if own:
            return None, run_id or new_run_id()
    if not existing:  # a new run; files of one that saved no checkpoint go to the archive
        leftovers = _leftovers(output_dir, keep)
        if not any(name in RUN_FILES for name in leftovers):
            return None, new_run_id()  # the user's own files, no run's: left alone
        return _move(output_dir, leftovers), new_run_id()
    if not start_over:
        raise CheckpointError(
            f"{output_dir} holds another run's checkpoints ({len(existing)}, newest "
            f"{os.path.basename(existing[-1][1])}). To continue that run set checkpoint.resume=auto; "
            f"to keep it and start a new one, give this run another trainer.output_dir; to start over "
            f"here, set checkpoint.start_over=true (its files are moved to {output_dir}/archive/, not deleted)")
    return _move(output_dir, _leftovers(output_dir, keep)), new_run_id()


def write_file(output_dir: str, name: str, text: str, say=print) -> Optional[str]:
    """Write a file of the run (a recipe's report.json, say) into its folder, atomically; a
    different version already there is moved to ``<output_dir>/archive/<time>/`` first (and said),
    so a resumed or repeated run never drops what an earlier launch wrote. Rank 0 only.

    Returns:
        Where the replaced version went, or None (no file, or the same text).
    """
    path = os.path.join(output_dir, name)
    moved = None
    try:
        with open(path, "rb") as f:
            same = f.read() == text.encode()
    except FileNotFoundError:
        same = True
    if not same:
        folder = _archive_folder(output_dir)
        moved = os.path.join(folder, name)
        os.makedirs(os.path.dirname(moved), exist_ok=True)
        os.rename(path, moved)
        say(f"{path}: the version it replaces is kept as {moved}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return moved


def _archive_folder(output_dir: str) -> str:
    """A new ``archive/<time>`` folder (``-2``, ``-3``... within one second: never merged into)."""
    base = os.path.join(output_dir, ARCHIVE, time.strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 10000):
        folder = base if n == 1 else f"{base}-{n}"
        try:
            os.makedirs(folder)
            return folder
        except FileExistsError:
            continue
    raise CheckpointError(f"cannot make an archive folder in {output_dir}/{ARCHIVE}")


def _leftovers(output_dir: str, keep: frozenset) -> list[str]:
    """The folder's entries a previous run may own: all but the lock, the archive, an empty
    checkpoints folder (made by this run's write check) and the inputs in ``keep``."""
    out = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if name in (LOCK, ARCHIVE) or (name == "checkpoints" and os.path.isdir(path) and not os.listdir(path)):
            continue
        real = os.path.realpath(path)
        if any(k == real or k.startswith(real + os.sep) for k in keep):
            continue  # an input of this run (or a folder holding one)
        out.append(name)
    return out


def _move(output_dir: str, names: list[str]) -> Optional[str]:
    if not names:
        return None
    archive = _archive_folder(output_dir)
    for name in names:
        os.rename(os.path.join(output_dir, name), os.path.join(archive, name))
    return archive


def _inputs(cfg: Any) -> frozenset:
    """Real paths of the existing files and folders that the config's string values name."""
    found, seen = set(), set()

    def walk(v):
        if id(v) in seen:
            return
        seen.add(id(v))
        if isinstance(v, str):
            if v.strip() and os.path.exists(v):
                found.add(os.path.realpath(v))
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif dataclasses.is_dataclass(v):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name, None))

    walk(cfg)
    found.discard(os.path.realpath(cfg.trainer.output_dir))  # the folder itself is no input
    return frozenset(found)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
