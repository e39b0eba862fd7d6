"""Training-state checkpoints: atomic, complete-or-absent, resumable bit for bit.

Layout of one checkpoint (a folder under ``<output_dir>/checkpoints/``)::

    step_00000120/
        model.safetensors     weights only; loadable with safetensors + load_state_dict, no ddptrain
                              (checkpoint.trainable_only: the trainable tensors, the base by path)
        trainer.pt            the shared states (optimizer, LR scheduler, loss scaler, progress), rank 0
        {name}_rank{r}.pt     the per-rank states: rng, sampler position, a ZeRO optimizer shard
        config.yaml           the config the checkpoint was saved under
        folders.json          fingerprints of a recipe's model folders (RESUME_FOLDERS; ddptrain/resume.py)
        meta.json             step, epoch, world size, run id, eval metrics, time
        SHA256SUMS            the SHA-256 of every file above (`sha256sum -c SHA256SUMS` checks them)
        COMPLETE              written last; a folder without it is never loaded

What goes in is decided by the caller, which hands :func:`save` / :func:`load` dicts of stateful
objects (``state_dict()`` / ``load_state_dict()``): this module knows files, not Trainers.

Why per-rank ZeRO shards instead of ``consolidate_state_dict()``: consolidation funnels every
rank's state through rank 0's GPU (a memory spike of the whole optimizer state, 8 B/param for
Adam) and is slow on large models; per-rank files are written in parallel straight from CPU
copies. Resuming on another number of processes reads the old shards one at a time and each new
rank keeps the entries of its own partition (``load_resharded``, see ddptrain/optim.py).

Atomicity: every rank writes into ``.tmp-step_N``; the ranks agree (all-reduce) that every
write succeeded; then rank 0 writes the marker, fsyncs and renames the folder to ``step_N``.
A crash at any point leaves either the previous checkpoints untouched plus a stale ``.tmp-``
folder (ignored, removed next save), or a complete new checkpoint. Every checkpoint names the
run that wrote it (``run_id``): a run never overwrites or prunes another run's checkpoints.

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
import shutil
import time
import warnings
from typing import Optional, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddptrain import dist
from ddptrain.checkpoint_files import (CHECKSUMS, COMPLETE, HEADER_BASE_FINGERPRINT, HEADER_BASE_MODEL,
                                       HEADER_LORA_SCALINGS, HEADER_TRAINABLE_ONLY, STEP_DIR, CheckpointError,
                                       checkpoint_root, damage, ensure_intact, find_latest, list_complete,
                                       mark_intact, read_checksums, resolve_base, sha256_files, weights_file,
                                       weights_info)
from ddptrain.loading import load_pretrained
from ddptrain.lora import add_adapters, lora_scalings

# the read-only half of the layout lives in checkpoint_files.py; its names are this module's too
__all__ = ["CheckpointError", "COMPLETE", "CHECKSUMS", "checkpoint_root", "list_complete", "find_latest",
           "newest_intact", "damage", "ensure_intact", "check_writable",
           "unwrap", "save_weights", "weights_file", "read_weights", "trainable_keys", "base_fingerprint",
           "weights_to_save", "weights_info", "resolve_base", "resume_keys", "load_weights", "apply_weights",
           "save", "read_meta", "resolve", "load", "prune", "produces"]


# ----------------------------------------------------------------------------- paths


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


def save_weights(model: Union[nn.Module, dict], path: str, metadata: Optional[dict] = None) -> None:
    """Model weights (a module, or a state dict) as safetensors. Tied (shared) tensors are stored
    as separate copies so the file loads with plain ``safetensors.torch.load_file`` +
    ``load_state_dict``. ``metadata``: extra string entries for the file's header (see
    :func:`weights_to_save`)."""
    state, seen = {}, set()
    weights = model if isinstance(model, dict) else unwrap(model).state_dict()
    for k, v in weights.items():
        t = v.detach()
        if t.data_ptr() in seen and t.numel() > 0:
            t = t.clone()
        seen.add(t.data_ptr())
        state[k] = t.to("cpu").contiguous()
    save_file(state, path, metadata={"format": "pt", "writer": "ddptrain", **(metadata or {})})


def read_weights(path: str) -> tuple[str, dict]:
    """``(file, tensors by name)`` of saved weights: ``path`` is a file, a checkpoint folder or
    a run folder, as in :func:`load_weights`.

    Raises:
        CheckpointError: file missing or unreadable.
    """
    path = weights_file(path)
    ensure_intact(path)
    try:
        return path, load_file(path)
    except Exception as e:
        raise CheckpointError(f"cannot read weights {path}: {e}") from e


def trainable_keys(module: nn.Module) -> set:
    """The state-dict keys of the trainable parameters and of every persistent buffer (buffers
    such as BatchNorm statistics change in training whether or not their module is frozen)."""
    module = unwrap(module)
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return trainable | (set(module.state_dict()) - params)


@torch.no_grad()
def base_fingerprint(module: nn.Module) -> str:
    """A cheap fingerprint of the frozen parameters (names, shapes and the bf16-rounded sum of the
    first 1024 values of each): enough to tell that a resume runs on another base model."""
    frozen = [(n, p) for n, p in sorted(unwrap(module).named_parameters()) if not p.requires_grad]
    if not frozen:
        return ""
    sums = torch.stack([p.detach().reshape(-1)[:1024].to(torch.bfloat16).double().sum() for _, p in frozen]).tolist()
    text = ";".join(f"{n}{tuple(p.shape)}={v:.6e}" for (n, p), v in zip(frozen, sums))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def weights_to_save(module: nn.Module, master=None, trainable_only: bool = False,
                    base_model: str = "") -> tuple[dict, dict]:
    """``(tensors, header entries)`` a checkpoint saves as its ``model.safetensors``.

    Args:
        module: the (unwrapped) model.
        master: its master weights, if any (their ``state_dict(module)``: fp32 masters).
        trainable_only: keep only :func:`trainable_keys`; the header names ``base_model``
            (absolute path) and the frozen weights' :func:`base_fingerprint`.
        base_model: where the frozen weights come from.
    """
    weights = master.state_dict(module) if master is not None else module.state_dict()
    header = {}
    scalings = lora_scalings(module)
    if scalings:  # lets load_weights add the adapters to a plain model, and export merge them
        header[HEADER_LORA_SCALINGS] = json.dumps(scalings)
    if trainable_only:
        keep = trainable_keys(module)
        weights = {k: v for k, v in weights.items() if k in keep}
        header.update({HEADER_TRAINABLE_ONLY: "true", HEADER_BASE_MODEL: os.path.abspath(base_model),
                       HEADER_BASE_FINGERPRINT: base_fingerprint(module)})
    return weights, header


def resume_keys(module: nn.Module, file: str) -> Optional[set]:
    """The keys a resume must find in ``file``: all (None) for a full checkpoint; the trainable
    ones for a trainable-only checkpoint, after checking the model's frozen weights are the
    base it was trained on.

    Raises:
        CheckpointError: the frozen weights differ from the checkpoint's base model.
    """
    info = weights_info(file)
    if not info["trainable_only"]:
        return None
    now = base_fingerprint(module)
    if info["base_fingerprint"] != now:
        raise CheckpointError(f"{file} was trained on the frozen weights of {info['base_model']!r} (fingerprint "
                              f"{info['base_fingerprint']}); this model's frozen weights differ ({now}): load that "
                              "base model before resuming")
    return trainable_keys(module)


def load_weights(model: nn.Module, path: str, strict: bool = True, base: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None) -> dict:
    """Load safetensors weights (a file, or a checkpoint folder) into ``model``.

    A trainable-only checkpoint (``checkpoint.trainable_only``) is composed: first its base
    model, read tensor by tensor (:func:`ddptrain.loading.load_pretrained`; a model built with
    ``empty_weights()`` is allocated in ``dtype`` on ``device`` here), then the checkpoint's own
    tensors. The LoRA adapters a checkpoint holds are added to a model that has none yet
    (layers and scalings from the file's header).

    Args:
        path: a ``.safetensors`` file, a checkpoint folder holding ``model.safetensors``, or a
            run folder (its newest complete checkpoint is used).
        strict: if False, load what matches (name and shape) and report the rest: the partial
            initialisation used for fine-tuning with, say, a new output vocabulary.
        base: the base model of a trainable-only checkpoint, if not where the checkpoint says.
        dtype, device: for tensors allocated while loading the base (meta models).

    Returns:
        ``{"missing": [...], "unexpected": [...], "mismatched": [...], "loaded": n}``.

    Raises:
        CheckpointError: file missing/corrupt, or (strict) any key or shape mismatch, with a
            readable diff; a trainable-only checkpoint whose base model cannot be found.
    """
    file = weights_file(path)
    info = weights_info(file)
    source, saved = read_weights(file)
    target = unwrap(model)
    if not info["trainable_only"]:
        add_adapters(target, info["lora_scalings"], saved)  # a LoRA run's full checkpoint into a plain model
        return apply_weights(target, source, saved, strict=strict)
    base_report = load_pretrained(target, base or resolve_base(info["base_model"], file), dtype=dtype,
                                  device=device, strict=False, skip=saved)
    add_adapters(target, info["lora_scalings"], saved)
    need = set(saved) | set(base_report["missing"]) if strict else None  # what the base did not provide
    report = apply_weights(target, source, saved, strict=strict, expect=need)
    if strict and base_report["unexpected"]:
        raise CheckpointError(f"base model of {file} has tensors this model lacks: {base_report['unexpected'][:20]}")
    return report


def apply_weights(model: nn.Module, source: str, saved: dict, strict: bool = True,
                  expect: Optional[set] = None) -> dict:
    """The second half of :func:`load_weights`: put tensors already read from ``source`` (named
    in messages) into ``model``, with the same checks, report and errors.

    Args:
        expect: the keys ``saved`` must hold (default: all of the model's); a trainable-only
            checkpoint passes :func:`trainable_keys` (see :func:`resume_keys`).
    """
    target = unwrap(model)
    own = target.state_dict()
    missing = sorted((set(own) if expect is None else set(expect)) - set(saved))
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



def save(
    root: str,
    step: int,
    weights: Union[nn.Module, dict],
    shared: dict,
    per_rank: dict,
    meta: dict,
    device: torch.device,
    files: Optional[dict] = None,
    weights_metadata: Optional[dict] = None,
) -> str:
    """Collective: every rank calls it; returns the final checkpoint path.

    Args:
        root: the checkpoints folder.
        weights: the model, or the state dict to save as its weights (e.g. the fp32 masters).
        shared: name -> stateful object whose state is the same on every rank (optimizer,
            scheduler, scaler, progress); rank 0 writes their ``state_dict()`` to ``trainer.pt``.
        per_rank: name -> stateful object whose state differs per rank (RNG, sampler, a ZeRO
            shard), or None; each rank writes ``{name}_rank{r}.pt``.
        meta: JSON-able facts (epoch, world size, metrics, run id) for humans and keep-best.
        files: extra text files rank 0 writes into the checkpoint (e.g. ``config.yaml``).
        weights_metadata: header entries of ``model.safetensors`` (:func:`weights_to_save`).

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
            owner = _run_id_of(final) if os.path.isdir(final) else None
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
            save_weights(weights, os.path.join(tmp, "model.safetensors"), weights_metadata)
            state = {key: obj.state_dict() for key, obj in shared.items()}
            _fsync_write(os.path.join(tmp, "trainer.pt"), lambda f: torch.save(state, f))
            for fname, text in (files or {}).items():
                _fsync_write(os.path.join(tmp, fname), lambda f: f.write(text.encode()))
            written += ["model.safetensors", "trainer.pt", *(files or {})]
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
            _fsync_dir(tmp)
            if os.path.exists(final):  # this run saved this step before (a periodic save, then the end)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
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
    found = [p for _, p in list_complete(root) if run_id is None or _run_id_of(p) == run_id]
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
    (weights are read separately with :func:`read_weights`). Shared states are loaded first, so a
    per-rank object may depend on one (the sampler position on the progress record).

    A checkpoint written by another number of processes loads too, if every per-rank object in it
    can move: each then gets ``load_resharded(old_states, meta)`` instead of ``load_state_dict``.

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
        if key not in trainer_state:
            raise CheckpointError(f"checkpoint {path} has no {key!r} state (trainer.pt holds {sorted(trainer_state)})")
        try:
            obj.load_state_dict(trainer_state[key])
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: cannot load its {key!r} state: {type(e).__name__}: {e}") from e
    for key, obj in per_rank.items():
        if obj is None:
            continue
        if key not in saved_per_rank:
            raise CheckpointError(f"checkpoint {path} has no per-rank {key!r} state (it holds "
                                  f"{sorted(saved_per_rank) or 'none'})")
        try:
            if old_world == world_size:
                obj.load_state_dict(_torch_load(os.path.join(path, f"{key}_rank{rank}.pt")))
            else:
                obj.load_resharded(_LazyRankStates(path, key, old_world), meta)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: cannot load its per-rank {key!r} state: "
                                  f"{type(e).__name__}: {e}") from e
    return meta


def _torch_load(path: str):
    ensure_intact(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(e).__name__}: {e}") from e


def _run_id_of(path: str) -> Optional[str]:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


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
    found = [(s, p) for s, p in list_complete(root) if _run_id_of(p) == run_id]
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
