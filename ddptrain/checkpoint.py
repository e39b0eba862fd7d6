"""Training-state checkpoints: atomic, complete-or-absent, resumable bit for bit.

Layout of one checkpoint (a folder under ``<output_dir>/checkpoints/``)::

    step_00000120/
        model.safetensors     weights only; loadable with safetensors + load_state_dict, no ddptrain
        trainer.pt            optimizer (unsharded), LR scheduler, loss scaler, counters (rank 0)
        optimizer_rank{r}.pt  ZeRO only: each rank's own optimizer-state shard
        rank{r}.pt            per rank: RNG states (python, numpy, torch CPU/CUDA), sampler state
        meta.json             step, epoch, world size, eval metrics, time
        COMPLETE              written last; a folder without it is never loaded

Why per-rank ZeRO shards instead of ``consolidate_state_dict()``: consolidation funnels every
rank's state through rank 0's GPU (a memory spike of the whole optimizer state, 8 B/param for
Adam) and is slow on large models; per-rank files are written in parallel straight from CPU
copies. The price: resuming a ZeRO run needs the same world size (checked up front).

What a Trainer puts into one and takes back out is at the end of this file
(``save_trainer_state`` / ``restore_trainer_state``), so the Trainer's loop stays short.

Atomicity: every rank writes into ``.tmp-step_N``; the ranks agree (all-reduce) that every
write succeeded; then rank 0 writes the marker, fsyncs and renames the folder to ``step_N``.
A crash at any point leaves either the previous checkpoints untouched plus a stale ``.tmp-``
folder (ignored, removed next save), or a complete new checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import time
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddptrain import dist
from ddptrain.optim import is_zero

if TYPE_CHECKING:
    from ddptrain.trainer import Trainer

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path."""


# ----------------------------------------------------------------------------- paths


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_complete(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, COMPLETE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest(root: str) -> Optional[str]:
    """The newest complete checkpoint, or None. Half-written (``.tmp-``) folders never count."""
    found = list_complete(root)
    return found[-1][1] if found else None


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


# ----------------------------------------------------------------------------- weights


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def save_weights(model: Union[nn.Module, dict], path: str) -> None:
    """Model weights (a module, or a state dict) as safetensors. Tied (shared) tensors are stored
    as separate copies so the file loads with plain ``safetensors.torch.load_file`` +
    ``load_state_dict``."""
    state, seen = {}, set()
    weights = model if isinstance(model, dict) else unwrap(model).state_dict()
    for k, v in weights.items():
        t = v.detach()
        if t.data_ptr() in seen and t.numel() > 0:
            t = t.clone()
        seen.add(t.data_ptr())
        state[k] = t.to("cpu").contiguous()
    save_file(state, path, metadata={"format": "pt", "writer": "ddptrain"})


def read_weights(path: str) -> tuple[str, dict]:
    """``(file, tensors by name)`` of saved weights: ``path`` is a file, a checkpoint folder or
    a run folder, as in :func:`load_weights`.

    Raises:
        CheckpointError: file missing or unreadable.
    """
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "model.safetensors")):
        latest = find_latest(checkpoint_root(path))  # a run folder: its newest complete checkpoint
        path = latest if latest else path
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(path):
        raise CheckpointError(f"weights file not found: {path}")
    try:
        return path, load_file(path)
    except Exception as e:
        raise CheckpointError(f"cannot read weights {path}: {e}") from e


def load_weights(model: nn.Module, path: str, strict: bool = True) -> dict:
    """Load safetensors weights (a file, or a checkpoint folder) into ``model``.

    Args:
        path: a ``.safetensors`` file, a checkpoint folder holding ``model.safetensors``, or a
            run folder (its newest complete checkpoint is used).
        strict: if False, load what matches (name and shape) and report the rest: the partial
            initialisation used for fine-tuning with, say, a new output vocabulary.

    Returns:
        ``{"missing": [...], "unexpected": [...], "mismatched": [...], "loaded": n}``.

    Raises:
        CheckpointError: file missing/corrupt, or (strict) any key or shape mismatch, with a
            readable diff.
    """
    return apply_weights(model, *read_weights(path), strict=strict)


def apply_weights(model: nn.Module, source: str, saved: dict, strict: bool = True) -> dict:
    """The second half of :func:`load_weights`: put tensors already read from ``source`` (named
    in messages) into ``model``, with the same checks, report and errors."""
    target = unwrap(model)
    own = target.state_dict()
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    mismatched = sorted(
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
        for k in set(own) & set(saved) if saved[k].shape != own[k].shape)
    report = {"missing": missing, "unexpected": unexpected, "mismatched": mismatched}
    if strict and (missing or unexpected or mismatched):
        lines = [f"weights in {source} do not fit the model (pass strict=False to load what fits):"]
        for title, items in (("missing in checkpoint", missing), ("unexpected in checkpoint", unexpected),
                             ("shape mismatch", mismatched)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        raise CheckpointError("\n".join(lines))
    bad = {m.split(":")[0] for m in mismatched}
    loadable = {k: v for k, v in saved.items() if k in own and k not in bad}
    target.load_state_dict(loadable, strict=False)
    report["loaded"] = len(loadable)
    return report


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _numpy_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ----------------------------------------------------------------------------- save / load


def _fsync_write(path: str, write_fn) -> None:
    with open(path, "wb") as f:
        write_fn(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str,
    step: int,
    model: Union[nn.Module, dict],
    trainer_state: dict,
    rank_state: dict,
    optimizer_shard: Optional[dict],
    meta: dict,
    device: torch.device,
) -> str:
    """Collective: every rank calls it; returns the final checkpoint path.

    Args:
        root: the checkpoints folder.
        model: the model, or the state dict to save as its weights (the fp32 masters).
        trainer_state: written by rank 0 (optimizer when not sharded, scheduler, scaler, counters).
        rank_state: this rank's own state (RNG, sampler position).
        optimizer_shard: this rank's ZeRO optimizer shard, or None.
        meta: JSON-able facts (step, epoch, world size, metrics) for humans and keep-best.

    Raises:
        CheckpointError: on every rank, if any rank failed to write; earlier checkpoints are intact.
    """
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a stale half-write from a crashed attempt
            os.makedirs(tmp)
        except OSError as e:
            error = e
    if dist.any_rank(error is not None, device):
        raise CheckpointError(f"cannot create checkpoint folder {tmp}: {error}")

    try:
        _fsync_write(os.path.join(tmp, f"rank{rank}.pt"), lambda f: torch.save(rank_state, f))
        if optimizer_shard is not None:
            _fsync_write(os.path.join(tmp, f"optimizer_rank{rank}.pt"), lambda f: torch.save(optimizer_shard, f))
        if rank == 0:
            save_weights(model, os.path.join(tmp, "model.safetensors"))
            _fsync_write(os.path.join(tmp, "trainer.pt"), lambda f: torch.save(trainer_state, f))
    except Exception as e:  # disk full, permissions, ...: agree on failure below
        error = repr(e)
        try:  # torch.save reports a full disk as "unexpected pos ...": say how much space was left
            error += f", {shutil.disk_usage(tmp).free / 2**20:.0f} MiB free on that disk"
        except OSError:
            pass
    failed = dist.all_gather_object(error)
    if any(failed):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        bad = "; ".join(f"rank {r}: {msg}" for r, msg in enumerate(failed) if msg)
        raise CheckpointError(f"saving checkpoint {final} failed ({bad}); earlier checkpoints are intact")

    if rank == 0:
        try:
            meta = dict(meta, step=step, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
            _fsync_write(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
            _fsync_write(os.path.join(tmp, COMPLETE), lambda f: f.write(b"ok\n"))
            _fsync_dir(tmp)
            if os.path.exists(final):  # same step saved twice (e.g. end of run right after a periodic save)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
        except Exception as e:
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.any_rank(error is not None, device):
        raise CheckpointError(f"finalising checkpoint {final} failed: {error}")
    return final


def load_checkpoint(path: str, world_size: int, rank: int) -> dict:
    """Read a complete checkpoint for this rank.

    Returns:
        ``{"meta", "trainer", "rank", "optimizer_shard"}`` (weights are loaded separately with
        :func:`load_weights`).

    Raises:
        CheckpointError: not found, incomplete, or written with another world size.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if not os.path.isfile(os.path.join(path, COMPLETE)):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker): it was "
                              "interrupted while being written; use an earlier one")
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        meta["world_size"]  # a damaged meta.json fails here, where the error can name the file
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: meta.json: {type(e).__name__}: {e}") from e
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {meta['world_size']} processes, this run has "
            f"{world_size}. The sampler position, RNG streams{' and ZeRO optimizer shards' if meta.get('zero') else ''} "
            f"are per rank, so an exact resume needs the same world size. Relaunch with "
            f"--nproc_per_node/--nnodes giving {meta['world_size']} processes, or start a new run "
            f"from the weights only (ddptrain.load_weights on {os.path.join(path, 'model.safetensors')}).")
    try:
        out = {
            "meta": meta,
            "trainer": torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=False),
            "rank": torch.load(os.path.join(path, f"rank{rank}.pt"), map_location="cpu", weights_only=False),
            "optimizer_shard": None,
        }
        shard = os.path.join(path, f"optimizer_rank{rank}.pt")
        if os.path.isfile(shard):
            out["optimizer_shard"] = torch.load(shard, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    return out


def prune(root: str, keep_last: int, keep_best: int, metric: str, mode: str) -> list[str]:
    """Delete checkpoints outside keep-last-k and keep-best-k (rank 0 only). Returns deleted paths.

    The newest complete checkpoint is never deleted, whatever the settings: it is the one a
    restart resumes from.
    """
    found = list_complete(root)
    if keep_last <= 0 or len(found) <= 1:
        return []
    keep = {p for _, p in found[-keep_last:]}
    keep.add(found[-1][1])
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
        if p not in keep:
            # remove the marker first: if we die mid-delete, the leftover is "incomplete", not "corrupt"
            os.remove(os.path.join(p, COMPLETE))
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted


# ------------------------------------------------------------------ a Trainer's state


def save_trainer_state(trainer: "Trainer") -> str:
    """Collective: write ``trainer``'s complete training state as its step's checkpoint.

    What a bit-exact resume needs: the weights (the fp32 masters under ``trainer.param_dtype:
    bf16``), the optimizer (under ZeRO each rank's own shard plus the param-group
    hyperparameters), LR scheduler, precision (GradScaler) state, the loop's counters, and per
    rank the RNG and sampler state. The DataLoader prefetches, so the sampler's own position runs
    ahead of training: the saved position is what the loop consumed.

    Returns:
        The checkpoint's folder.
    """
    sampler = trainer._stateful_sampler()
    sampler_state = None
    if sampler is not None:
        sampler_state = dict(sampler.state_dict(), position=trainer.batches_done, epoch=trainer.epoch)
    opt = trainer.optimizer
    zero = is_zero(opt)
    trainer_state = {
        "optimizer": None if zero else opt.state_dict(),
        "zero_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] if zero else None,
        "scheduler": trainer.scheduler.state_dict(),
        "precision": trainer.precision.state_dict(),
        "counters": {"step": trainer.step, "epoch": trainer.epoch, "batches_done": trainer.batches_done,
                     "unit_scale": trainer.unit_scale, "skipped_steps": trainer.skipped_steps},
    }
    rank_state = {"rng": rng_state(), "sampler": sampler_state}
    metrics = trainer.last_eval if trainer.last_eval_step == trainer.step else {}
    meta = {"epoch": trainer.epoch, "world_size": trainer.info.world_size, "zero": zero,
            "metrics": {k: v for k, v in metrics.items() if math.isfinite(v)}}
    weights = trainer.master.state_dict(trainer.module) if trainer.master else trainer.module
    return save_checkpoint(trainer.ckpt_root, trainer.step, weights, trainer_state, rank_state,
                           opt.optim.state_dict() if zero else None, meta, trainer.device)


def restore_trainer_state(trainer: "Trainer", path: str) -> None:
    """Load the checkpoint at ``path`` into ``trainer``: the inverse of :func:`save_trainer_state`.

    The weights file is read once: its tensors fill the model and, under ``param_dtype: bf16``,
    the fp32 masters at full precision. The RNG state is kept in ``trainer._resume_rng`` and set
    when the first epoch iterator is made (see ``Trainer._epoch_iterator``).

    Raises:
        CheckpointError: unreadable or incomplete checkpoint, another world size under ZeRO, or a
            ZeRO checkpoint resumed without ``optim.zero`` (or the reverse).
    """
    state = load_checkpoint(path, trainer.info.world_size, trainer.info.rank)
    source, saved = read_weights(path)
    apply_weights(trainer.module, source, saved, strict=True)
    if trainer.master:
        trainer.master.load_state_dict(saved, trainer.module)
    tr = state["trainer"]
    if is_zero(trainer.optimizer):
        if state["optimizer_shard"] is None:
            raise CheckpointError(f"{path} has no ZeRO optimizer shards; it was saved with optim.zero=false")
        trainer.optimizer.optim.load_state_dict(state["optimizer_shard"])
        for group, hparams in zip(trainer.optimizer.param_groups, tr["zero_param_groups"]):
            group.update(hparams)
    else:
        if tr["optimizer"] is None:
            raise CheckpointError(f"{path} holds ZeRO shards; set optim.zero=true to resume it")
        trainer.optimizer.load_state_dict(tr["optimizer"])
    trainer.scheduler.load_state_dict(tr["scheduler"])
    trainer.precision.load_state_dict(tr["precision"])
    c = tr["counters"]
    trainer.step, trainer.epoch, trainer.batches_done = c["step"], c["epoch"], c["batches_done"]
    trainer.unit_scale, trainer.skipped_steps = c["unit_scale"], c["skipped_steps"]
    if trainer.batches_done >= trainer.batches_per_epoch:  # saved at an epoch's last batch
        trainer.epoch, trainer.batches_done = trainer.epoch + 1, 0
    sampler = trainer._stateful_sampler()
    if sampler is not None and state["rank"]["sampler"] is not None:
        sampler.load_state_dict(dict(state["rank"]["sampler"], epoch=trainer.epoch, position=trainer.batches_done))
    trainer._resume_rng = state["rank"]["rng"]
