"""Training-state checkpoints: atomic, complete-or-absent, resumable bit for bit.

Layout of one checkpoint (a folder under ``<output_dir>/checkpoints/``)::

    step_00000120/
        model.safetensors     weights only; loadable with safetensors + load_state_dict, no ddptrain
                              (checkpoint.trainable_only: the trainable tensors, the base by path);
                              written and read by ddptrain/weights.py
        trainer.pt            the shared states (optimizer, LR scheduler, loss scaler, progress, EMA), rank 0
        {name}_rank{r}.pt     the per-rank states: rng, sampler position, a ZeRO optimizer (and EMA) shard
        config.yaml           the config the checkpoint was saved under
        folders.json          fingerprints of a recipe's model folders (RESUME_FOLDERS; ddptrain/resume.py)
        meta.json             step, epoch, world size, run id, eval metrics, time
        SHA256SUMS            the SHA-256 of every file above (`sha256sum -c SHA256SUMS` checks them)
        COMPLETE              written last; a folder without it is never loaded

What goes in is decided by the caller, which hands :func:`save` / :func:`load` dicts of stateful
objects (``state_dict()`` / ``load_state_dict()``) and the other files by name (text, or a
function that writes the file, as ``model.safetensors`` is written): this module knows folders
and files, not Trainers or weight formats. ddptrain/weights.py imports this module (a weights
path may be a checkpoint or run folder, checked against its checksums), never the other way.

Why per-rank ZeRO shards instead of ``consolidate_state_dict()``: consolidation funnels every
rank's state through rank 0's GPU (a memory spike of the whole optimizer state, 8 B/param for
Adam) and is slow on large models; per-rank files are written in parallel straight from CPU
copies. Resuming on another number of processes reads the old shards one at a time and each new
rank keeps the entries of its own partition (``load_resharded``, see ddptrain/optim.py).

Atomicity: every rank writes into ``.tmp-step_N``; the ranks agree (all-reduce) that every
write succeeded; then rank 0 writes the marker, fsyncs and renames the folder to ``step_N``.
A crash at any point leaves either the previous checkpoints untouched plus a stale ``.tmp-``
folder (ignored, removed next save), or a complete new checkpoint. Every checkpoint names the
run that wrote it (``run_id``, read by :func:`run_id_of`): a run never overwrites or prunes
another run's checkpoints.

Integrity: a complete folder can still be damaged later (a disk error, a copy cut short or
altered in place). Each rank hashes the files it wrote and rank 0 writes them to ``SHA256SUMS``
before the marker; every file is checked against it before it is read (:func:`ensure_intact`;
once per process while unchanged). ``resume: auto`` takes the newest checkpoint whose files all
check out (:func:`newest_intact`, saying why it skipped newer ones), and pruning always keeps it.
A checkpoint saved before checksums existed has no ``SHA256SUMS``: it loads as before, unverified
(the resume says so), and counts as intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Union

import torch

from ddptrain import dist

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d+)$")
# Each checkpoint's files with their SHA-256, in `sha256sum` format (`sha256sum -c SHA256SUMS`
# checks a folder without ddptrain); written at save before COMPLETE, checked before a file is read.
CHECKSUMS = "SHA256SUMS"

__all__ = ["CheckpointError", "COMPLETE", "CHECKSUMS", "checkpoint_root", "list_complete", "find_latest",
           "run_id_of", "check_writable", "sha256_files", "read_checksums", "mark_intact", "damage", "ensure_intact",
           "newest_intact", "save", "read_meta", "resolve", "load", "saved_states", "prune", "produces"]


class CheckpointError(RuntimeError):
    """A checkpoint (or a weights file) could not be written or read; the message names the path."""


# ----------------------------------------------------------------------------- checkpoint folders


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_complete(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, COMPLETE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest(root: str) -> Optional[str]:
    """The newest complete checkpoint, or None. Half-written (``.tmp-``) folders never count."""
    found = list_complete(root)
    return found[-1][1] if found else None


def run_id_of(path: str) -> Optional[str]:
    """The run that wrote the checkpoint at ``path`` (its meta.json's ``run_id``), or None where
    it cannot be read."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def check_writable(path: str, min_free_gb: float) -> None:
    """Fail before training, not after hours of it, if checkpoints cannot be written.

    Raises:
        CheckpointError: the folder cannot be created or written, or has too little free space.
    """
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {path!r} is not writable: {e}") from e
    free_gb = shutil.disk_usage(path).free / 1e9
    if free_gb < min_free_gb:
        raise CheckpointError(
            f"checkpoint directory {path!r} has {free_gb:.2f} GB free, less than "
            f"checkpoint.min_free_gb={min_free_gb}; free space or lower the limit")


# ----------------------------------------------------------------------------- checksums

# realpath -> (size, mtime_ns, inode) of the checkpoint files this process has checked (or just
# written): a resume reads model.safetensors and trainer.pt after open_run checked them, and a
# file is hashed once, not at every read. A file written to since has another mtime: checked again.
_INTACT: dict[str, tuple] = {}


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def _sha256(path: str) -> str:
    h, buf = hashlib.sha256(), bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # hashlib releases the GIL on large buffers: files hash in parallel
    return h.hexdigest()


def sha256_files(paths: list[str]) -> dict[str, str]:
    """``{path: SHA-256 hex digest}``, hashed in parallel threads (1.5 GB/s each on a current CPU)."""
    if not paths:
        return {}
    with ThreadPoolExecutor(min(8, len(paths), os.cpu_count() or 1)) as pool:
        return dict(zip(paths, pool.map(_sha256, paths)))


def read_checksums(folder: str) -> Optional[dict[str, str]]:
    """``{file name: digest}`` of a checkpoint's :data:`CHECKSUMS`, or None where it has none
    (saved by a ddptrain from before checksums: such a checkpoint loads unverified)."""
    try:
        with open(os.path.join(folder, CHECKSUMS), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read {os.path.join(folder, CHECKSUMS)}: {e}") from e
    sums = {}
    for line in lines:
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise CheckpointError(f"{os.path.join(folder, CHECKSUMS)} is damaged (line {line[:80]!r})")
        sums[name.lstrip("*")] = digest
    return sums


def mark_intact(folder: str, names) -> None:
    """Record ``names`` in ``folder`` as checked (files this process just wrote, or that another
    rank checked on the same storage)."""
    for name in names:
        path = os.path.join(folder, name)
        try:
            _INTACT[os.path.realpath(path)] = _stat_key(path)
        except OSError:
            pass


def damage(folder: str, names: Optional[list[str]] = None) -> str:
    """What is wrong with a checkpoint's files against its :data:`CHECKSUMS` ("" when nothing,
    or when it has no checksums; ``names``: only these files, those listed).

    A file is hashed at most once per process while unchanged (see ``_INTACT``).
    """
    try:
        sums = read_checksums(folder)
    except CheckpointError as e:
        return str(e)
    if sums is None:
        return ""
    todo, problems = [], []
    for name in (sums if names is None else [n for n in names if n in sums]):
        path = os.path.join(folder, name)
        try:
            key = _stat_key(path)
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if _INTACT.get(os.path.realpath(path)) != key:
            todo.append(path)
    for path, digest in sha256_files(todo).items():
        name = os.path.basename(path)
        if digest != sums[name]:
            problems.append(f"{name}: its SHA-256 is not the one in {CHECKSUMS} (the file changed after it was "
                            "saved: disk or copy corruption)")
        else:
            mark_intact(folder, [name])
    return "; ".join(problems)


def ensure_intact(file: str) -> None:
    """Check one checkpoint file against its folder's :data:`CHECKSUMS` before it is read (a file
    outside a checkpoint folder, or not listed, passes).

    Raises:
        CheckpointError: the file is not the one saved (the message names it and the folder).
    """
    folder = os.path.dirname(os.path.abspath(file))
    if not os.path.isfile(os.path.join(folder, COMPLETE)):
        return  # not a checkpoint's file: a SHA256SUMS there is someone else's
    why = damage(folder, [os.path.basename(file)])
    if why:
        raise CheckpointError(f"checkpoint {folder} is damaged: {why}; use an earlier checkpoint")


# ----------------------------------------------------------------------------- save / load


def _fsync_write(path: str, write_fn) -> None:
    with open(path, "wb") as f:
        write_fn(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: str) -> None:
    """Flush a folder, or a file another function wrote and closed, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: str,
    step: int,
    shared: dict,
    per_rank: dict,
    meta: dict,
    device: torch.device,
    files: Optional[dict[str, Union[str, Callable[[str], None]]]] = None,
) -> str:
    """Collective: every rank calls it; returns the final checkpoint path.

    Args:
        root: the checkpoints folder.
        shared: name -> stateful object whose state is the same on every rank (optimizer,
            scheduler, scaler, progress); rank 0 writes their ``state_dict()`` to ``trainer.pt``.
        per_rank: name -> stateful object whose state differs per rank (RNG, sampler, a ZeRO
            shard), or None; each rank writes ``{name}_rank{r}.pt``.
        meta: JSON-able facts (epoch, world size, metrics, run id) for humans and keep-best.
        files: the other files rank 0 writes into the checkpoint, by name: a text
            (``config.yaml``), or a function that writes the file at the path it is given
            (``model.safetensors``: a writer from ddptrain/weights.py); each is fsynced.

    Raises:
        CheckpointError: on every rank, if any rank failed to write; earlier checkpoints are
            intact. Also (before writing) if ``step``'s folder belongs to another run.
    """
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            owner = run_id_of(final) if os.path.isdir(final) else None
            if owner is not None and owner != meta.get("run_id"):
                raise CheckpointError(f"{final} belongs to run {owner!r}, not this run "
                                      f"({meta.get('run_id')!r}): refusing to overwrite it")
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a stale half-write from a crashed attempt
            os.makedirs(tmp)
        except (OSError, CheckpointError) as e:
            error = e
    if dist.any_rank(error is not None, device):
        raise CheckpointError(f"cannot create checkpoint folder {tmp}: {error}")

    written: list[str] = []
    sums: dict[str, str] = {}
    try:
        for key, obj in per_rank.items():
            if obj is not None:
                state = obj.state_dict()
                written.append(f"{key}_rank{rank}.pt")
                _fsync_write(os.path.join(tmp, written[-1]), lambda f: torch.save(state, f))
        if rank == 0:
            state = {key: obj.state_dict() for key, obj in shared.items()}
            _fsync_write(os.path.join(tmp, "trainer.pt"), lambda f: torch.save(state, f))
            for fname, content in (files or {}).items():
                if callable(content):
                    content(os.path.join(tmp, fname))
                    _fsync(os.path.join(tmp, fname))
                else:
                    _fsync_write(os.path.join(tmp, fname), lambda f: f.write(content.encode()))
            written += ["trainer.pt", *(files or {})]
        # hashed from the files (page cache), not the memory: the sums say what reached the file system
        sums = {os.path.basename(p): d for p, d in sha256_files([os.path.join(tmp, n) for n in written]).items()}
    except Exception as e:  # disk full, permissions, ...: agree on failure below
        error = repr(e)
        try:  # torch.save reports a full disk as "unexpected pos ...": say how much space was left
            error += f", {shutil.disk_usage(tmp).free / 2**20:.0f} MiB free on that disk"
        except OSError:
            pass
    gathered = dist.all_gather_object((error, sums))
    failed = [e for e, _ in gathered]
    if any(failed):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        bad = "; ".join(f"rank {r}: {msg}" for r, msg in enumerate(failed) if msg)
        raise CheckpointError(f"saving checkpoint {final} failed ({bad}); earlier checkpoints are intact")

    if rank == 0:
        try:
            meta = dict(meta, step=step, world_size=dist.get_world_size(),
                        per_rank=sorted(k for k, v in per_rank.items() if v is not None),
                        saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
            text = json.dumps(meta, indent=1).encode()
            _fsync_write(os.path.join(tmp, "meta.json"), lambda f: f.write(text))
            every = {name: d for _, part in gathered for name, d in part.items()}
            every["meta.json"] = hashlib.sha256(text).hexdigest()
            listing = "".join(f"{d}  {name}\n" for name, d in sorted(every.items())).encode()
            _fsync_write(os.path.join(tmp, CHECKSUMS), lambda f: f.write(listing))
            _fsync_write(os.path.join(tmp, COMPLETE), lambda f: f.write(b"ok\n"))
            _fsync(tmp)
            if os.path.exists(final):  # this run saved this step before (a periodic save, then the end)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync(root)
        except Exception as e:
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.any_rank(error is not None, device):
        raise CheckpointError(f"finalising checkpoint {final} failed: {error}")
    mark_intact(final, [name for _, part in gathered for name in part] + ["meta.json"])  # hashed just now
    return final


def read_meta(path: str) -> dict:
    """The ``meta.json`` of a complete checkpoint folder.

    Raises:
        CheckpointError: the path is missing, is not a checkpoint (a run folder, a checkpoints
            folder, anything else: the message says which), is incomplete, or its meta.json
            is damaged.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if not os.path.isfile(os.path.join(path, COMPLETE)):
        if list_complete(path) or list_complete(checkpoint_root(path)):
            raise CheckpointError(f"{path} is a folder of checkpoints (or a run folder), not one checkpoint: "
                                  f"pass one of its step_* folders, or resume=auto with this trainer.output_dir")
        if STEP_DIR.match(os.path.basename(os.path.normpath(path))) or os.path.basename(path).startswith(".tmp-"):
            raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker): it was "
                                  "interrupted while being written; use an earlier one")
        raise CheckpointError(f"{path} is not a ddptrain checkpoint (no {COMPLETE} marker, not a step_* folder)")
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        meta["world_size"]  # a damaged meta.json fails here, where the error can name the file
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: meta.json: {type(e).__name__}: {e}") from e
    return meta


def resolve(path: str, say=print) -> str:
    """A checkpoint to resume from: ``path`` itself, or the newest intact checkpoint of a run
    folder or checkpoints folder (said so by the caller's log line), its files checked.

    Raises:
        CheckpointError: see :func:`read_meta`; a checkpoint whose files are not the ones saved
            (the message names them and the intact checkpoints before it).
    """
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, COMPLETE)):
        root = path if list_complete(path) else checkpoint_root(path)
        if list_complete(root):
            return newest_intact(root, say)
    read_meta(path)
    why = damage(path)
    if why:
        m = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
        before = [p for s, p in list_complete(os.path.dirname(os.path.normpath(path)))
                  if p != os.path.normpath(path) and (m is None or s < int(m.group(1)))]
        older = next((p for p in reversed(before) if not damage(p)), None)  # hashes only until one checks out
        raise CheckpointError(f"checkpoint {path} is damaged: {why}. Resume from an intact one"
                              + (f" (the newest: {older})" if older else " (there is none before it)"))
    return path


def newest_intact(root: str, say=print, run_id: Optional[str] = None) -> Optional[str]:
    """The newest complete checkpoint under ``root`` whose files match its checksums (None when
    there is no complete one); each newer, damaged one is named through ``say`` with what is wrong.

    Args:
        run_id: only this run's checkpoints (pruning); None: any.

    Raises:
        CheckpointError: complete checkpoints exist and every one is damaged.
    """
    found = [p for _, p in list_complete(root) if run_id is None or run_id_of(p) == run_id]
    skipped = []
    for path in reversed(found):
        why = damage(path)
        if not why:
            if skipped:
                say(f"checkpoint {skipped[-1][0]} is damaged ({skipped[-1][1]}); using {path}, the newest intact one"
                    if len(skipped) == 1 else f"{len(skipped)} newer checkpoints are damaged ("
                    + "; ".join(f"{os.path.basename(p)}: {w}" for p, w in skipped) + f"); using {path}")
            if read_checksums(path) is None:
                say(f"checkpoint {path} has no {CHECKSUMS} (saved before ddptrain checked its files): "
                    "it is used without verifying them")
            return path
        skipped.append((path, why))
    if skipped:
        raise CheckpointError(f"every complete checkpoint in {root} is damaged: "
                              + "; ".join(f"{os.path.basename(p)}: {w}" for p, w in skipped)
                              + ". Restore them from a copy, or start a new run (checkpoint.resume=none)")
    return None


class _LazyRankStates:
    """``old[k]``: rank ``k``'s saved state of one per-rank object, read from disk on access (a
    ZeRO re-partition reads the old shards one at a time instead of all at once)."""

    def __init__(self, path: str, key: str, world_size: int):
        self.path, self.key, self.world_size = path, key, world_size

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, k: int):
        if not 0 <= k < self.world_size:
            raise IndexError(k)
        return _torch_load(os.path.join(self.path, f"{self.key}_rank{k}.pt"))


def load(path: str, shared: dict, per_rank: dict, world_size: int, rank: int) -> dict:
    """Load a complete checkpoint's states into the stateful objects: the inverse of :func:`save`
    (the weights are read separately, with ``ddptrain.weights.read_weights``). Shared states are
    loaded first, so a per-rank object may depend on one (the sampler position on the progress
    record).

    A checkpoint written by another number of processes loads too, if every per-rank object in it
    can move: each then gets ``load_resharded(old_states, meta)`` instead of ``load_state_dict``.
    A state saved per rank that this run holds once (a ZeRO optimizer resumed on one process) is
    gathered the same way (``load_resharded`` of the shared object); one saved once that this run
    holds per rank is dealt out (``load_unsharded(state, meta)``, else ``load_resharded([state],
    meta)``): ddptrain/reshard.py.

    Returns:
        The checkpoint's meta.json.

    Raises:
        CheckpointError: unreadable or incomplete checkpoint; a state missing from it, or one
            that does not fit its object (the message names it); another world size with a
            per-rank state that cannot move.
    """
    ensure_intact(os.path.join(path, "meta.json"))
    meta = read_meta(path)
    old_world = int(meta["world_size"])
    saved_per_rank = set(meta.get("per_rank", []))
    if old_world != world_size:
        stuck = [k for k in saved_per_rank if k in per_rank and not hasattr(per_rank[k], "load_resharded")]
        if stuck:
            raise CheckpointError(
                f"checkpoint {path} was written by {old_world} processes, this run has {world_size}, and "
                f"its per-rank state {', '.join(sorted(stuck))} cannot be re-partitioned (a plain sampler "
                f"or loader has no global plan to re-deal). Relaunch with {old_world} processes, use "
                f"DurationBucketSampler (build_dataloader), or start a new run from the weights only "
                f"(ddptrain.load_weights on {os.path.join(path, 'model.safetensors')}).")
    trainer_state = _torch_load(os.path.join(path, "trainer.pt"))
    for key, obj in shared.items():
        # saved per rank (sharded: ZeRO, sharded masters, their EMA), one object here: gathered
        gather = key not in trainer_state and key in saved_per_rank and hasattr(obj, "load_resharded")
        if key not in trainer_state and not gather:
            raise CheckpointError(f"checkpoint {path} has no {key!r} state (trainer.pt holds {sorted(trainer_state)}"
                                  + (f"; its per-rank {key!r} state cannot be gathered into this run's)"
                                     if key in saved_per_rank else ")"))
        try:
            if gather:
                obj.load_resharded(_LazyRankStates(path, key, old_world), meta)
            else:
                obj.load_state_dict(trainer_state[key])
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: cannot load its {key!r} state: {type(e).__name__}: {e}") from e
    for key, obj in per_rank.items():
        if obj is None:
            continue
        # saved once (one process), sharded here: each rank takes its part (the same format, or load_unsharded)
        deal = key not in saved_per_rank and key in trainer_state and (
            hasattr(obj, "load_unsharded") or hasattr(obj, "load_resharded"))
        if key not in saved_per_rank and not deal:
            raise CheckpointError(f"checkpoint {path} has no per-rank {key!r} state (it holds "
                                  f"{sorted(saved_per_rank) or 'none'})")
        try:
            if deal and hasattr(obj, "load_unsharded"):
                obj.load_unsharded(trainer_state[key], meta)
            elif deal:
                obj.load_resharded([trainer_state[key]], meta)
            elif old_world == world_size:
                obj.load_state_dict(_torch_load(os.path.join(path, f"{key}_rank{rank}.pt")))
            else:
                obj.load_resharded(_LazyRankStates(path, key, old_world), meta)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: cannot load its per-rank {key!r} state: "
                                  f"{type(e).__name__}: {e}") from e
    return meta


def saved_states(path: str, key: str) -> list:
    """The saved state of one stateful object, not loaded into one: ``[state]`` when it was saved
    once (``trainer.pt``), every rank's (``{key}_rank{r}.pt``, rank order) when per rank, [] when
    the checkpoint has none. Tensors are memory-mapped: read from disk when used, so a tool (an
    export) can take one tensor at a time.

    Raises:
        CheckpointError: see :func:`read_meta`; a file that does not match its checksum.
    """
    meta = read_meta(path)
    if key in meta.get("per_rank", []):
        return [_torch_load(os.path.join(path, f"{key}_rank{r}.pt"), mmap=True) for r in range(int(meta["world_size"]))]
    state = _torch_load(os.path.join(path, "trainer.pt"), mmap=True)
    return [state[key]] if key in state else []


def _torch_load(path: str, mmap: bool = False):
    ensure_intact(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(e).__name__}: {e}") from e


def produces(result: dict, metric: str, sources=()) -> bool:
    """Whether an evaluation's ``result`` has keep_best's ``metric``. With ``sources`` (a probe of
    a few batches, which need not hold every source), a per-source name ``base/source`` counts when
    ``source`` is one of them and ``base`` (or ``base/`` of another source) was produced."""
    if metric in result:
        return True
    base, _, source = metric.rpartition("/")
    return bool(base) and source in set(map(str, sources)) and any(k == base or k.startswith(base + "/") for k in result)


def prune(root: str, keep_last: int, keep_best: int, metric: str, mode: str, run_id: str) -> list[str]:
    """Delete this run's checkpoints outside keep-last-k and keep-best-k (rank 0 only).

    Only checkpoints whose meta.json names ``run_id`` are candidates: another run's checkpoints
    are never deleted. The newest complete checkpoint and the newest intact one (its files match
    its checksums: :func:`newest_intact`) are never deleted, whatever the settings: a restart
    resumes from the one, or from the other if the one turns out damaged. A checkpoint that cannot
    be deleted is warned about and left (the new checkpoint is already safe; training goes on).

    Returns:
        The deleted paths.
    """
    found = [(s, p) for s, p in list_complete(root) if run_id_of(p) == run_id]
    if keep_last <= 0 or len(found) <= 1:
        return []
    keep = {p for _, p in found[-keep_last:]}
    keep.add(found[-1][1])
    try:  # the checkpoint just saved was hashed as it was written: usually no file is read here
        keep.add(newest_intact(root, lambda _: None, run_id))
    except CheckpointError:
        pass  # none is intact: keep_last decides alone
    if keep_best > 0:
        scored = []
        for _, p in found:
            try:
                with open(os.path.join(p, "meta.json")) as f:
                    value = json.load(f).get("metrics", {}).get(metric)
            except (OSError, ValueError):
                value = None
            if value is not None:
                scored.append((value if mode == "min" else -value, p))
        keep.update(p for _, p in sorted(scored)[:keep_best])
    deleted = []
    for _, p in found:
        if p in keep:
            continue
        try:
            # remove the marker first: if we die mid-delete, the leftover is "incomplete", not "corrupt"
            os.remove(os.path.join(p, COMPLETE))
            shutil.rmtree(p)
            deleted.append(p)
        except OSError as e:
            warnings.warn(f"could not delete old checkpoint {p} (keep_last/keep_best pruning): {e}; "
                          "training continues, remove it by hand", stacklevel=2)
    return deleted
