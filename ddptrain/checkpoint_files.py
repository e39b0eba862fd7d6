"""Checkpoints and weights files on disk, read-only: which folders are complete checkpoints,
which file holds a path's weights, and what a weights file's header says.

Why a module of its own: three modules need these facts and each needs another of them.
checkpoint.py writes this layout and adds LoRA adapters when it loads weights (lora.py);
loading.py reads tensors from the files named here (a base model may be a run folder); lora.py
exports a checkpoint's weights with loading.py's reader. All three import this module, which
imports nothing of ddptrain, so the import graph stays acyclic:
``checkpoint -> lora -> loading -> checkpoint_files``. ``ddptrain.checkpoint`` re-exports every
public name here (``ddptrain.CheckpointError`` among them).

The safetensors header (:func:`read_header`) is read with plain reads: 8-byte little-endian
length, then JSON (tensors by name, ``__metadata__``); loading.py says why not ``safe_open``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d+)$")
# Each checkpoint's files with their SHA-256, in `sha256sum` format (`sha256sum -c SHA256SUMS`
# checks a folder without ddptrain); written at save before COMPLETE, checked before a file is read.
CHECKSUMS = "SHA256SUMS"

# A trainable-only weights file (checkpoint.trainable_only) says so in its safetensors header:
HEADER_TRAINABLE_ONLY = "ddptrain.trainable_only"
HEADER_BASE_MODEL = "ddptrain.base_model"
HEADER_BASE_FINGERPRINT = "ddptrain.base_fingerprint"
HEADER_LORA_SCALINGS = "ddptrain.lora_scalings"

__all__ = ["CheckpointError", "COMPLETE", "CHECKSUMS", "checkpoint_root", "list_complete", "find_latest",
           "weights_file", "read_header", "weights_info", "resolve_base", "sha256_files", "read_checksums",
           "damage", "ensure_intact", "mark_intact"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path."""


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


# ----------------------------------------------------------------------------- weights files


def weights_file(path: str) -> str:
    """The weights file ``path`` names: the file itself, a checkpoint folder's
    ``model.safetensors``, or that of a run folder's newest complete checkpoint.

    Raises:
        CheckpointError: no such file.
    """
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "model.safetensors")):
        latest = find_latest(checkpoint_root(path))  # a run folder: its newest complete checkpoint
        path = latest if latest else path
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(path):
        raise CheckpointError(f"weights file not found: {path}")
    return path


def read_header(file: str) -> tuple[dict, dict, int]:
    """``(tensors, metadata, data_start)`` of one safetensors file: each tensor's header entry
    (``dtype``, ``shape``, ``data_offsets`` from ``data_start``) by name, and ``__metadata__``.

    Raises:
        CheckpointError: the file is missing or not a safetensors file.
    """
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > os.path.getsize(file) - 8:
                raise ValueError(f"header length {n} exceeds the file: not a safetensors file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"cannot read weights {file}: {type(e).__name__}: {e}") from e
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata, 8 + n


def weights_info(path: str) -> dict:
    """What a weights file's header says: ``trainable_only``, ``base_model``,
    ``base_fingerprint``, ``lora_scalings`` (layer -> alpha / r)."""
    meta = read_header(weights_file(path))[1]
    return {"trainable_only": meta.get(HEADER_TRAINABLE_ONLY) == "true", "base_model": meta.get(HEADER_BASE_MODEL, ""),
            "base_fingerprint": meta.get(HEADER_BASE_FINGERPRINT, ""),
            "lora_scalings": json.loads(meta.get(HEADER_LORA_SCALINGS, "{}"))}


def resolve_base(base: str, file: str) -> str:
    """The base model a trainable-only ``file`` names, checked to exist.

    Raises:
        CheckpointError: it does not (moved or deleted): pass ``base=`` to ``load_weights``.
    """
    if not base or not os.path.exists(base):
        raise CheckpointError(f"{file} holds the trainable parameters only; its base model {base!r} is not there. "
                              "Pass the base weights: ddptrain.load_weights(model, path, base=...)")
    return base
