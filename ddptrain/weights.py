"""Weights files: every read and write of model weights, whole or streamed, and their exports.

One module owns the safetensors files ddptrain reads and writes: a checkpoint's
``model.safetensors`` (:func:`weights_to_save` + :func:`save_weights`, read back with
:func:`read_weights` / :func:`load_weights`), pretrained weights streamed into a model built
without storage (:func:`empty_weights` + :func:`load_pretrained`), and exports as plain or
Hugging Face sharded files (:func:`write_shards`, :func:`export_merged`: a LoRA checkpoint's
adapters merged into its base; with ``ema.enabled``, its EMA weights by default, see
:func:`checkpoint_ema`), a LoRA checkpoint's adapters alone (:func:`export_adapters`: one small
file per adapter, loaded on top of a base kept once), and one file written a tensor at a time
(:func:`save_streamed`: the checkpoint average of ddptrain/average.py)::

    python -m ddptrain.weights export runs/x/checkpoints/step_00001000 out_dir/ [--dtype bf16] [--weights model]
    python -m ddptrain.weights adapters runs/x/checkpoints/step_00001000 out_dir/ [--name lora_weights.safetensors]

An export never writes inside a checkpoint folder (its checksums would fail the next resume) nor
over what it reads; it refuses a non-empty ``out_dir`` (an adapters file that exists) unless
``--force``, which empties the folder first so no earlier file sits beside the new weights
(:func:`check_output`).

Why it sits above checkpoint.py: a weights path may name a checkpoint or a run folder (its
newest complete checkpoint), and a file in a checkpoint is checked against the folder's
``SHA256SUMS`` before it is read, so this module asks checkpoint.py about folders. checkpoint.py
never imports it: it writes ``model.safetensors`` by calling the writer the Trainer hands it
(:func:`save_weights` of :func:`weights_to_save`'s tensors), so neither needs a third module
of shared layout facts between them.

Loading large weights: the usual way, ``model = Model(config)`` then
``model.load_state_dict(load_file(path))``, holds three copies at its peak: the randomly
initialised fp32 model (4 B/param: 41 GB for 10.3B parameters), the loaded state dict, and the
bf16 cast. Here the model is built without storage and filled tensor by tensor::

    from ddptrain.weights import empty_weights, load_pretrained

    with empty_weights():                 # parameters on the meta device: no memory, no init
        model = MyModel(config)
    load_pretrained(model, "/models/glm-4-9b", dtype=torch.bfloat16, device="cuda")

Each parameter is allocated in its final dtype on its final device and read straight into
(a CPU target) or through one tensor-sized host buffer (a GPU target), so host memory peaks at
about one bf16 copy for a CPU model and one tensor for a GPU one. Buffers are built normally
inside :func:`empty_weights` (non-persistent ones, e.g. rotary tables, are not in checkpoints).

Why not ``safetensors.safe_open``: it memory-maps the file, and every page read stays resident
in the process until the file is closed (measured: reading a 200 MB file tensor by tensor
raised peak RSS by 200 MB on top of the copies). The format is simple (8-byte little-endian
header length, JSON header with each tensor's dtype, shape and offsets and ``__metadata__``,
raw little-endian bytes), so :func:`read_header` and :class:`SafetensorsSource` read it with
plain reads into each tensor's destination.

Sources: one ``.safetensors`` file, a folder with ``model.safetensors``, a Hugging Face folder
of shards (``model.safetensors.index.json``), or a ddptrain checkpoint or run folder.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import struct
import sys
from typing import Callable, Iterable, Iterator, Optional, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddptrain.checkpoint import CHECKSUMS, COMPLETE, CheckpointError, checkpoint_root, ensure_intact, find_latest, read_meta
from ddptrain.config import cli_prog
from ddptrain.ema import saved_ema
from ddptrain.lora import add_adapters, lora_scalings, merge_tensors
from ddptrain.precision import kept_fp32

WEIGHTS = "model.safetensors"  # a checkpoint's weights file (and a Hugging Face folder's single file)
INDEX = "model.safetensors.index.json"  # a Hugging Face folder of shards
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

# A trainable-only weights file (checkpoint.trainable_only) says so in its safetensors header:
HEADER_TRAINABLE_ONLY = "ddptrain.trainable_only"
HEADER_BASE_MODEL = "ddptrain.base_model"
HEADER_BASE_FINGERPRINT = "ddptrain.base_fingerprint"
HEADER_LORA_SCALINGS = "ddptrain.lora_scalings"

__all__ = ["WEIGHTS", "DTYPES", "unwrap", "weights_file", "read_header", "weights_info", "resolve_base",
           "save_weights", "trainable_keys", "base_fingerprint", "weights_to_save", "read_weights", "load_weights",
           "apply_weights", "resume_keys", "SafetensorsSource", "empty_weights", "load_pretrained", "write_shards",
           "save_streamed", "check_output", "clear_folder", "checkpoint_ema", "export_merged", "export_adapters", "main"]


# ----------------------------------------------------------------------------- paths and headers


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def weights_file(path: str) -> str:
    """The weights file ``path`` names: the file itself, a checkpoint folder's
    ``model.safetensors``, or that of a run folder's newest complete checkpoint.

    Raises:
        CheckpointError: no such file.
    """
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, WEIGHTS)):
        latest = find_latest(checkpoint_root(path))  # a run folder: its newest complete checkpoint
        path = latest if latest else path
    if os.path.isdir(path):
        path = os.path.join(path, WEIGHTS)
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


# ----------------------------------------------------------------------------- whole files: save


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
    _save_file(state, path, {"format": "pt", "writer": "ddptrain", **(metadata or {})})


def _new_file_mode() -> int:
    """The permission bits ``open()`` gives a new file: 0o666 less the process umask (read from
    /proc, since ``os.umask`` can only read it by setting it, process-wide)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # no /proc (macOS): the brief window has the strictest mask, never a looser one
    os.umask(mask)
    return 0o666 & ~mask


def _save_file(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """``safetensors.torch.save_file``, the file's permissions then those of any new file (umask 022:
    0644): safetensors writes a private temporary file (0600) and renames it into place."""
    save_file(tensors, path, metadata=metadata)
    try:
        os.chmod(path, _new_file_mode())
    except OSError:  # a file system without modes (some network mounts): the file stays as written
        pass


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


def weights_to_save(module: nn.Module, tensors: Optional[dict] = None, trainable_only: bool = False,
                    base_model: str = "") -> tuple[dict, dict]:
    """``(tensors, header entries)`` a checkpoint saves as its ``model.safetensors``.

    Args:
        module: the (unwrapped) model.
        tensors: the weights by state-dict key (the optimizer backend's ``weights(module)``: fp32
            masters where it holds them all); default ``module.state_dict()``.
        trainable_only: keep only :func:`trainable_keys`; the header names ``base_model``
            (absolute path) and the frozen weights' :func:`base_fingerprint`.
        base_model: where the frozen weights come from.
    """
    weights = tensors if tensors is not None else module.state_dict()
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


# ----------------------------------------------------------------------------- whole files: load


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


def load_weights(model: nn.Module, path: str, strict: bool = True, base: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None,
                 which: str = "model") -> dict:
    """Load safetensors weights (a file, or a checkpoint folder) into ``model``.

    A trainable-only checkpoint (``checkpoint.trainable_only``) is composed: first its base
    model, read tensor by tensor (:func:`load_pretrained`; a model built with
    ``empty_weights()`` is allocated in ``dtype`` on ``device`` here), then the checkpoint's own
    tensors. The LoRA adapters a checkpoint holds are added to a model that has none yet
    (layers and scalings from the file's header). ``which="ema"`` puts the checkpoint's EMA
    (``ema.enabled``, ddptrain/ema.py) over the trained tensors it averages, in fp32 until the
    model's own dtype rounds them, as the Trainer's evaluation swaps them in.

    Args:
        path: a ``.safetensors`` file, a checkpoint folder holding ``model.safetensors``, or a
            run folder (its newest complete checkpoint is used).
        strict: if False, load what matches (name and shape) and report the rest: the partial
            initialisation used for fine-tuning with, say, a new output vocabulary.
        base: the base model of a trainable-only checkpoint, if not where the checkpoint says.
        dtype, device: for tensors allocated while loading the base (meta models).
        which: ``model`` (default): the trained weights; ``ema``: the EMA weights (an error
            naming the checkpoint folder when it has none); ``auto``: the EMA when the
            checkpoint's evaluation measured it (what ``keep_best`` ranked), as
            ``python -m ddptrain.weights export`` chooses (:func:`checkpoint_ema`).

    Returns:
        ``{"missing": [...], "unexpected": [...], "mismatched": [...], "loaded": n,
        "weights": "ema" | "model"}``.

    Raises:
        CheckpointError: file missing/corrupt, or (strict) any key or shape mismatch, with a
            readable diff; a trainable-only checkpoint whose base model cannot be found;
            ``which="ema"`` and no EMA in the checkpoint.
    """
    file = weights_file(path)
    info = weights_info(file)
    source, saved = read_weights(file)
    averaged = checkpoint_ema(file, which)
    unknown = sorted(set(averaged) - set(saved))
    if unknown:
        raise CheckpointError(f"the EMA of {file} has tensors its weights lack: {unknown[:10]}")
    saved.update(averaged)  # fp32: load_state_dict rounds each to the model's dtype
    target = unwrap(model)
    if not info["trainable_only"]:
        add_adapters(target, info["lora_scalings"], saved)  # a LoRA run's full checkpoint into a plain model
        report = apply_weights(target, source, saved, strict=strict)
    else:
        base_report = load_pretrained(target, base or resolve_base(info["base_model"], file), dtype=dtype,
                                      device=device, strict=False, skip=saved)
        add_adapters(target, info["lora_scalings"], saved)
        need = set(saved) | set(base_report["missing"]) if strict else None  # what the base did not provide
        report = apply_weights(target, source, saved, strict=strict, expect=need)
        if strict and base_report["unexpected"]:
            raise CheckpointError(f"base model of {file} has tensors this model lacks: {base_report['unexpected'][:20]}")
    return {**report, "weights": "ema" if averaged else "model"}


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


# ----------------------------------------------------------------------------- streamed: tensor by tensor


def _files(path: str) -> list[str]:
    """The safetensors files a path names (see the module docstring)."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"cannot read the shard index {index}: {type(e).__name__}: {e}") from e
            return [os.path.join(path, s) for s in shards]
        if os.path.isfile(os.path.join(path, WEIGHTS)):
            return [os.path.join(path, WEIGHTS)]
        return [weights_file(path)]  # a checkpoint or run folder (raises if there are no weights)
    raise CheckpointError(f"weights not found: {path}")


class SafetensorsSource:
    """The tensors of safetensors file(s), read one at a time with plain file reads.

    Args:
        path: a file, a folder with ``model.safetensors`` or ``model.safetensors.index.json``,
            or a ddptrain checkpoint / run folder.

    Raises:
        CheckpointError: a missing or malformed file (the message names it).
    """

    def __init__(self, path: str):
        self.path = path
        self.entries: dict[str, tuple[str, torch.dtype, tuple, int, int]] = {}  # name -> file, dtype, shape, start, end
        self.metadata: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        for file in _files(path):
            ensure_intact(file)  # a checkpoint's file is checked against its SHA256SUMS, as read_weights does
            header, metadata, base = read_header(file)
            self.metadata.update(metadata)
            for name, e in header.items():
                if e["dtype"] not in _ST_DTYPES:
                    raise CheckpointError(f"{file}: tensor {name} has dtype {e['dtype']}, which ddptrain cannot read")
                begin, end = e["data_offsets"]
                self.entries[name] = (file, _ST_DTYPES[e["dtype"]], tuple(e["shape"]), base + begin, base + end)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][1]

    def _read(self, name: str, out: torch.Tensor) -> None:
        file, _, _, start, end = self.entries[name]
        f = self._handles.get(file)
        if f is None:
            f = self._handles[file] = open(file, "rb", buffering=0)
        view = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else None
        if view is None:
            return
        f.seek(start)
        done = 0
        while done < end - start:  # readinto may return less than asked for
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{file}: tensor {name} is cut short ({done} of {end - start} bytes)")
            done += got

    def get(self, name: str) -> torch.Tensor:
        """A new CPU tensor holding ``name`` as stored."""
        _, dtype, shape, _, _ = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        self._read(name, out)
        return out

    @torch.no_grad()
    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (any device and dtype, the stored shape) with tensor ``name``: straight
        into a contiguous CPU tensor of the stored dtype, else through one host buffer."""
        _, dtype, shape, _, _ = self.entries[name]
        if tuple(out.shape) != shape:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {shape}, the model's has {tuple(out.shape)}")
        if out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous():
            self._read(name, out)
        else:
            out.copy_(self.get(name))

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with their parameters on the meta device (no memory, no initialisation
    cost); buffers are built as usual. Fill them with :func:`load_pretrained`."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _slots(model: nn.Module) -> dict[int, list]:
    """``id(tensor) -> [(state-dict key, module, attribute, is_parameter)]``: tied tensors share an entry."""
    slots: dict[int, list] = {}
    prefix = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    for module, name in prefix.items():
        for attr, t in module._parameters.items():
            if t is not None:
                slots.setdefault(id(t), []).append((f"{name}.{attr}" if name else attr, module, attr, True))
        for attr, t in module._buffers.items():
            if t is not None and attr not in module._non_persistent_buffers_set:
                slots.setdefault(id(t), []).append((f"{name}.{attr}" if name else attr, module, attr, False))
    return slots


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, *, dtype: Optional[torch.dtype] = None,
                    device: Union[str, torch.device, None] = None, strict: bool = True,
                    skip: Iterable[str] = (), rename: Optional[Callable[[str], Optional[str]]] = None) -> dict:
    """Fill ``model``'s parameters and persistent buffers from safetensors, one tensor at a time.

    Parameters on the meta device (:func:`empty_weights`) are allocated here, in ``dtype``
    (floating tensors; BatchNorm-type modules stay fp32, as ``trainer.param_dtype: bf16`` keeps
    them) on ``device``; tensors that already have storage are copied into in place, keeping
    their dtype and device. Tied parameters stay tied (one tensor, loaded once).

    Args:
        model: the model (not wrapped in DDP).
        path: see :class:`SafetensorsSource`.
        dtype: the dtype of floating tensors allocated here (default: as the model declares).
        device: where tensors allocated here go (default: CPU).
        strict: a model tensor the file lacks, or a file tensor the model lacks, is an error
            (shape mismatches always are).
        skip: state-dict keys not to load (and not to miss): they come from elsewhere, e.g. a
            trainable-only checkpoint's own tensors. Meta ones are allocated, uninitialised.
        rename: maps a file key to the model key it fills (None: ignore it), e.g. for another
            library's naming.

    Returns:
        ``{"loaded": n, "missing": [...], "unexpected": [...], "bytes": b}``.

    Raises:
        CheckpointError: missing/unexpected keys (strict), a shape mismatch, a parameter left on
            the meta device, or an unreadable file.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    keep32 = kept_fp32(model)
    skip = set(skip)
    loaded = nbytes = 0
    missing: list[str] = []
    with SafetensorsSource(path) as src:
        by_model_key = {}
        for k in src.keys():
            target = rename(k) if rename else k
            if target is not None:
                by_model_key[target] = k
        used = set()  # file keys accounted for
        for slot in _slots(model).values():
            keys = [s[0] for s in slot]
            file_keys = [by_model_key[k] for k in keys if k in by_model_key]
            used.update(file_keys)  # a tied tensor stored under both names is read once
            skipped = any(k in skip for k in keys)
            if not file_keys and not skipped:
                missing += keys
                continue
            _, module, attr, is_param = slot[0]
            old = module._parameters[attr] if is_param else module._buffers[attr]
            if old.is_meta:  # allocate it (a skipped one too: its caller fills it), in its final dtype
                want = old.dtype
                if old.is_floating_point():
                    want = torch.float32 if id(old) in keep32 else dtype or old.dtype
                new = torch.empty(old.shape, dtype=want, device=device)
                if not skipped:
                    src.read_into(file_keys[0], new)
                nbytes += new.numel() * new.element_size()
                new = nn.Parameter(new, requires_grad=old.requires_grad) if is_param else new
                for _, m, a, p in slot:
                    (m._parameters if p else m._buffers)[a] = new
            elif not skipped:
                src.read_into(file_keys[0], old)
                nbytes += old.numel() * old.element_size()
            loaded += not skipped
        unexpected = sorted(set(by_model_key.values()) - used)
    if strict and (missing or unexpected):
        lines = [f"weights in {path} do not fit the model (strict=False loads what fits):"]
        for title, names in (("missing in the file", sorted(missing)), ("not in the model", unexpected)):
            if names:
                more = " ..." if len(names) > 20 else ""
                lines.append(f"  {title} ({len(names)}): " + ", ".join(names[:20]) + more)
        raise CheckpointError("\n".join(lines))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"after loading {path}, {len(left)} tensors are still on the meta device (not in the file): "
                     f"{left[:10]}; initialise them before training")
    return {"loaded": loaded, "missing": sorted(missing), "unexpected": unexpected, "bytes": nbytes}

# ----------------------------------------------------------------------------- exports


def _checkpoint_above(path: str) -> Optional[str]:
    """The ddptrain checkpoint folder ``path`` is (or lies inside), or None: a folder holding a
    ``COMPLETE`` marker or a ``SHA256SUMS``, as checkpoint.py writes them."""
    folder = path
    while True:
        if os.path.isfile(os.path.join(folder, COMPLETE)) or os.path.isfile(os.path.join(folder, CHECKSUMS)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def check_output(out: str, inputs: Iterable[str] = (), folder: bool = False, force: bool = False) -> str:
    """Refuse an output that would destroy data: a path inside a ddptrain checkpoint (its
    ``SHA256SUMS`` would no longer match: the next resume calls it damaged), one of the files
    read to make it, or (unless ``force``) an existing file or non-empty folder.

    Args:
        out: the file (``folder=False``) or folder to write.
        inputs: the files (or model folders) the output is made from: checkpoints' weights, a base model.
        folder: ``out`` is a folder (exports) rather than one file (an average, an adapter file).
        force: replace an existing file; write into a non-empty folder (the caller empties it
            with :func:`clear_folder`, so no earlier file is left beside the new ones).

    Returns:
        ``out``'s absolute, symlink-resolved path.

    Raises:
        CheckpointError: naming ``out`` and what it would destroy.
    """
    real = os.path.realpath(out)
    sources = {os.path.realpath(f) for f in inputs}
    inside = _checkpoint_above(real if folder else os.path.dirname(real))
    if inside:
        raise CheckpointError(f"{out} is inside the checkpoint {inside}: writing there would change that checkpoint's "
                              "files (its SHA256SUMS would no longer match and the next resume would call it damaged). "
                              "Write outside the checkpoints folder, e.g. RUN/exports/")
    if folder:
        held = sorted(f for f in sources if f == real or f.startswith(real.rstrip(os.sep) + os.sep))
        if held:
            raise CheckpointError(f"{out} holds {held[0]}, which this export reads: write to another folder")
        if os.path.exists(real) and not os.path.isdir(real):
            raise CheckpointError(f"{out} is a file, not a folder: name a folder to write the weights into")
        entries = sorted(os.listdir(real)) if os.path.isdir(real) else []
        if entries and not force:
            raise CheckpointError(f"{out} is not empty ({', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}): "
                                  "its files would sit beside the new weights. Name an empty or new folder, or pass "
                                  "--force (force=True) to empty it first")
        subdirs = [e for e in entries if os.path.isdir(os.path.join(real, e))]
        if entries and subdirs:
            raise CheckpointError(f"{out} holds folders ({', '.join(subdirs[:5])}): not a weights folder, so --force "
                                  "does not empty it; name an empty or new folder")
        return real
    if real in sources:
        raise CheckpointError(f"{out} is one of the files read to make it: write to another file")
    if os.path.isdir(real):
        raise CheckpointError(f"{out} is a folder: name the .safetensors file to write "
                              f"(e.g. {os.path.join(out, 'averaged.safetensors')})")
    if os.path.exists(real) and not force:
        raise CheckpointError(f"{out} exists: pass --force (force=True) to replace it, or name another file")
    return real


def clear_folder(path: str) -> None:
    """Remove the files of a folder :func:`check_output` passed with ``force`` (it holds no
    subfolders), so the export written next is the folder's whole content."""
    if os.path.isdir(path):
        for name in os.listdir(path):
            if os.path.isfile(os.path.join(path, name)) or os.path.islink(os.path.join(path, name)):
                os.remove(os.path.join(path, name))



def write_shards(items: Iterable[tuple[str, torch.Tensor]], out_dir: str, max_shard_bytes: int,
                 metadata: Optional[dict] = None) -> list[str]:
    """Write ``(name, tensor)`` pairs as safetensors shards of at most ``max_shard_bytes`` (a
    single tensor may exceed it), holding one shard in memory at a time.

    One shard is ``model.safetensors``; several are ``model-0000k-of-0000n.safetensors`` with
    ``model.safetensors.index.json``: the layout Hugging Face ``from_pretrained`` reads.

    Returns:
        The paths written.
    """
    os.makedirs(out_dir, exist_ok=True)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    parts, shard, size, total, weight_map = [], {}, 0, 0, {}

    def flush():
        nonlocal shard, size
        if shard:
            tmp = os.path.join(out_dir, f".part-{len(parts):05d}.safetensors")
            _save_file(shard, tmp, meta)
            parts.append((tmp, list(shard)))
            shard, size = {}, 0

    for name, t in items:
        n = t.numel() * t.element_size()
        if shard and size + n > max_shard_bytes:
            flush()
        shard[name] = t.detach().to("cpu").contiguous()
        size += n
        total += n
    flush()
    if len(parts) == 1:
        final = os.path.join(out_dir, "model.safetensors")
        os.replace(parts[0][0], final)
        return [final]
    files = []
    for i, (tmp, names) in enumerate(parts):
        final = os.path.join(out_dir, f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors")
        os.replace(tmp, final)
        files.append(final)
        weight_map.update(dict.fromkeys(names, os.path.basename(final)))
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return files + [os.path.join(out_dir, INDEX)]


def save_streamed(path: str, specs: list[tuple[str, torch.dtype, tuple]], tensors: Iterable[torch.Tensor],
                  metadata: Optional[dict] = None) -> None:
    """Write one safetensors file a tensor at a time: memory stays at one tensor, whatever the
    file's size (:func:`save_weights` and :func:`write_shards` hold a whole file or shard).

    The format allows it: the header (names, dtypes, shapes, offsets) is known from ``specs``
    before any data, and the data follows in that order. Written to a temporary name in the same
    folder, fsynced, then renamed: ``path`` is complete or absent.

    Args:
        specs: ``(name, dtype, shape)`` of every tensor, in file order.
        tensors: yields each tensor in that order (any device; checked against its spec).
        metadata: the header's ``__metadata__`` (values become strings).

    Raises:
        CheckpointError: a tensor that does not match its spec, or too few tensors.
    """
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, offset = {}, 0
    for name, dtype, shape in specs:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {k: str(v) for k, v in (metadata or {}).items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            it = iter(tensors)
            for name, dtype, shape in specs:
                t = next(it, None)
                if t is None:
                    raise CheckpointError(f"writing {path}: no tensor came for {name}")
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"writing {path}: tensor {name} is {t.dtype} {tuple(t.shape)}, "
                                          f"its header says {dtype} {tuple(shape)}")
                if t.numel():
                    f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def checkpoint_ema(path: str, which: str = "auto") -> dict:
    """The EMA tensors (``ema.enabled``; ddptrain/ema.py) to put over the weights ``path`` names:
    ``which`` = ``ema``: the checkpoint's EMA (an error if it has none); ``model``: none ({});
    ``auto``: the EMA when the checkpoint's metrics measured it (``meta.json``'s ``ema.evaluated``:
    the weights keep-best ranked), else none.

    Returns:
        ``{state-dict key: fp32 tensor}``, memory-mapped (read when used).

    Raises:
        CheckpointError: ``which=ema`` and ``path`` is no checkpoint with an EMA; a bad ``which``.
    """
    if which not in ("auto", "ema", "model"):
        raise CheckpointError(f"which weights: {which!r} is not one of auto, ema, model")
    file = weights_file(path)
    folder = os.path.dirname(os.path.abspath(file))
    if which == "model":
        return {}
    saved = all(os.path.isfile(os.path.join(folder, n)) for n in (COMPLETE, "meta.json"))  # a ddptrain checkpoint
    meta = read_meta(folder).get("ema") if saved else None
    if which == "auto" and not (meta and meta.get("evaluated")):
        return {}
    if not saved:
        raise CheckpointError(f"{file} is not in a complete ddptrain checkpoint folder (no {COMPLETE} and meta.json "
                              "beside it), so it has no EMA weights: ask for its trained weights ('model')")
    found = saved_ema(folder) if meta else {}
    if not found:
        raise CheckpointError(f"checkpoint {folder} holds no EMA weights (it was not saved with ema.enabled=true): "
                              "ask for its trained weights ('model') instead")
    return found


def export_merged(checkpoint: str, out_dir: str, dtype: Optional[str] = None, max_shard_gb: float = 5.0,
                  weights: str = "auto", force: bool = False) -> list[str]:
    """Write a checkpoint's weights with the adapters merged in, as plain safetensors shards.

    The result has the base model's tensor names only (Hugging Face layout: ``model.safetensors``,
    or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` above
    ``max_shard_gb``), so the base model's own code loads it. A trainable-only checkpoint's base
    weights are read from the path it names, tensor by tensor: memory stays near one shard.

    Args:
        checkpoint: a checkpoint folder, a run folder or a ``model.safetensors`` file.
        out_dir: the folder to write (created).
        dtype: ``bf16`` | ``fp16`` | ``fp32`` for every floating tensor; default: as stored.
        max_shard_gb: the largest shard, in GB (1e9 bytes).
        weights: ``auto`` | ``ema`` | ``model``: the checkpoint's EMA weights in place of its
            trained ones (:func:`checkpoint_ema`; ``auto``: when its evaluation measured them),
            in the dtype the checkpoint stores each tensor in.
        force: write into a non-empty ``out_dir``, emptied first (its files only).

    Returns:
        The files written.

    Raises:
        ddptrain.CheckpointError: the checkpoint or its base model cannot be read; ``out_dir``
            is inside a checkpoint, holds what is read, or (without ``force``) is not empty
            (:func:`check_output`).
    """
    file = weights_file(checkpoint)
    info = weights_info(file)
    base_path = resolve_base(info["base_model"], file) if info.get("trainable_only") else None
    check_output(out_dir, [file] + ([base_path] if base_path else []), folder=True, force=force)
    cast = DTYPES[dtype] if dtype else None
    with SafetensorsSource(file) as own:  # checked against the checkpoint's SHA256SUMS here, first
        averaged = checkpoint_ema(file, weights)
        unknown = sorted(set(averaged) - set(own.keys()))
        if unknown:
            raise CheckpointError(f"the EMA of {file} has tensors its weights lack: {unknown[:10]}")
        # the trainable part (small for a trainable-only checkpoint); the EMA over the trained weights
        adapter = {k: averaged[k].to(own.dtype(k)) if k in averaged else own.get(k) for k in own.keys()}
    scalings = info.get("lora_scalings", {})
    base = SafetensorsSource(resolve_base(info["base_model"], file)) if info.get("trainable_only") else None
    if force:
        clear_folder(out_dir)  # no earlier shard, index or config.json is left beside the new weights

    def merged():
        layers = {k[: -len(".lora_A")] for k in adapter if k.endswith(".lora_A")}
        names = base.keys() if base else [k for k in adapter if not k.endswith((".lora_A", ".lora_B"))]
        for name in names:
            t = adapter[name] if name in adapter else base.get(name)  # trained tensors win over the base
            layer = name[: -len(".weight")] if name.endswith(".weight") else None
            if layer in layers:
                t = merge_tensors({name: t, f"{layer}.lora_A": adapter[f"{layer}.lora_A"],
                                   f"{layer}.lora_B": adapter[f"{layer}.lora_B"]}, scalings)[name]
            yield name, (t.to(cast) if cast is not None and t.is_floating_point() else t)

    try:
        return write_shards(merged(), out_dir, int(max_shard_gb * 1e9),
                            metadata={"format": "pt", "writer": "ddptrain.weights export", "source": file,
                                      "ddptrain.weights": "ema" if averaged else "model"})
    finally:
        if base is not None:
            base.close()


def export_adapters(checkpoint: str, out_dir: str, name: str = "adapters.safetensors", dtype: Optional[str] = None,
                    weights: str = "auto", force: bool = False) -> str:
    """Write a LoRA checkpoint's adapters alone: every ``<layer>.lora_A`` / ``<layer>.lora_B``
    tensor under the model's own names (a trainable-only checkpoint's other trained tensors too,
    e.g. ``lora.trainable``), one safetensors file. Its header makes it a trainable-only weights
    file: the base model (the checkpoint's, or for a full checkpoint the checkpoint's own file,
    which holds the frozen base) and the scalings (layer -> alpha / r), so
    ``ddptrain.load_weights(model, file)`` composes base and adapters, and a model's own adapter
    loader reads the names (upstream VoxCPM's ``load_lora_weights``: examples/export_tts.py).

    Args:
        checkpoint: a checkpoint folder, a run folder or a ``model.safetensors`` file.
        out_dir: the folder to write (created).
        name: the file's name in ``out_dir``.
        dtype: ``bf16`` | ``fp16`` | ``fp32`` for every floating tensor; default: as stored (the
            fp32 masters under ``trainer.param_dtype: bf16``).
        weights: ``auto`` | ``ema`` | ``model``, as :func:`export_merged`.
        force: replace an existing file of that name.

    Returns:
        The file written.

    Raises:
        ddptrain.CheckpointError: the checkpoint cannot be read, or holds no LoRA adapters; the
            file would be inside a checkpoint, is the checkpoint's own, or (without ``force``)
            exists (:func:`check_output`).
    """
    file = weights_file(checkpoint)
    info = weights_info(file)
    check_output(os.path.join(out_dir, name), [file], force=force)
    cast = DTYPES[dtype] if dtype else None
    with SafetensorsSource(file) as own:  # checked against the checkpoint's SHA256SUMS here, first
        keys = [k for k in own.keys() if info["trainable_only"] or k.endswith((".lora_A", ".lora_B"))]
        if not any(k.endswith(".lora_A") for k in keys):
            raise CheckpointError(f"{file} holds no LoRA adapters (no *.lora_A tensor): it was not trained with "
                                  "lora.enabled=true; export its weights with `python -m ddptrain.weights export`")
        averaged = checkpoint_ema(file, weights)
        tensors = {k: averaged[k].to(own.dtype(k)) if k in averaged else own.get(k) for k in keys}
    tensors = {k: t.to(cast) if cast is not None and t.is_floating_point() else t for k, t in tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    meta = {HEADER_LORA_SCALINGS: json.dumps(info["lora_scalings"]), HEADER_TRAINABLE_ONLY: "true",
            HEADER_BASE_MODEL: info["base_model"] if info["trainable_only"] else os.path.abspath(file),
            "source": file, "ddptrain.weights": "ema" if averaged else "model"}
    if info["base_fingerprint"]:
        meta[HEADER_BASE_FINGERPRINT] = info["base_fingerprint"]
    save_weights(tensors, path + ".tmp", metadata=meta)
    os.replace(path + ".tmp", path)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=cli_prog("ddptrain.weights"),
                                description="Weights tools. export: a checkpoint's weights, LoRA adapters merged in, as "
                                            "plain safetensors (the base model's names and layout).")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write a checkpoint's weights (adapters merged into its base) as safetensors")
    e.add_argument("checkpoint", help="checkpoint folder, run folder or model.safetensors")
    e.add_argument("out_dir", help="output folder")
    e.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast floating tensors")
    e.add_argument("--max-shard-gb", type=float, default=5.0, help="largest output file (GB)")
    e.add_argument("--force", action="store_true", help="write into a non-empty output folder, emptied first")
    e.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                   help="ema: the checkpoint's EMA weights (ema.enabled); model: its trained weights; auto (default): "
                        "the EMA when the checkpoint's evaluation measured it (what keep_best ranked), else the trained")
    a = sub.add_parser("adapters", help="write a LoRA checkpoint's adapters alone (the model's names), one file")
    a.add_argument("checkpoint", help="checkpoint folder, run folder or model.safetensors")
    a.add_argument("out_dir", help="output folder")
    a.add_argument("--name", default="adapters.safetensors", help="the file's name (default: adapters.safetensors)")
    a.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast floating tensors")
    a.add_argument("--weights", choices=["auto", "ema", "model"], default="auto", help="as for export")
    a.add_argument("--force", action="store_true", help="replace an existing file of that name")
    args = p.parse_args(argv)
    try:
        if args.cmd == "adapters":
            files = [export_adapters(args.checkpoint, args.out_dir, args.name, args.dtype, args.weights, args.force)]
        else:
            files = export_merged(args.checkpoint, args.out_dir, args.dtype, args.max_shard_gb, args.weights,
                                  args.force)
    except CheckpointError as e:
        p.exit(2, f"{p.prog} {args.cmd}: error: {e}\n")
    print(json.dumps({"written": files, "weights": read_header(files[0])[1].get("ddptrain.weights")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
