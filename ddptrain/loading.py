"""Loading large pretrained weights without a full fp32 copy on the host.

The usual way to fine-tune a checkpoint, ``model = Model(config)`` then
``model.load_state_dict(load_file(path))``, holds three copies at its peak: the randomly
initialised fp32 model (4 B/param: 41 GB for 10.3B parameters), the loaded state dict, and the
bf16 cast. Here the model is built without storage and filled tensor by tensor::

    from ddptrain.loading import empty_weights, load_pretrained

    with empty_weights():                 # parameters on the meta device: no memory, no init
        model = MyModel(config)
    load_pretrained(model, "/models/glm-4-9b", dtype=torch.bfloat16, device="cuda")

Each parameter is allocated in its final dtype on its final device and read straight into
(a CPU target) or through one tensor-sized host buffer (a GPU target), so host memory peaks at
about one bf16 copy for a CPU model and one tensor for a GPU one. Buffers are built normally
inside :func:`empty_weights` (non-persistent ones, e.g. rotary tables, are not in checkpoints).

Why not ``safetensors.safe_open``: it memory-maps the file, and every page read stays resident
in the process until the file is closed (measured: reading a 200 MB file tensor by tensor
raised peak RSS by 200 MB on top of the copies). The format is simple (8-byte header length,
JSON header, raw little-endian bytes), so :class:`SafetensorsSource` reads each tensor with
plain reads into its destination.

Sources: one ``.safetensors`` file, a folder with ``model.safetensors``, a Hugging Face folder
of shards (``model.safetensors.index.json``), or a ddptrain checkpoint or run folder.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable, Iterable, Iterator, Optional, Union

import torch
from safetensors.torch import save_file
from torch import nn

from ddptrain.checkpoint_files import CheckpointError, read_header, weights_file
from ddptrain.precision import kept_fp32

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
INDEX = "model.safetensors.index.json"

__all__ = ["SafetensorsSource", "empty_weights", "load_pretrained", "write_shards", "DTYPES"]


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
        if os.path.isfile(os.path.join(path, "model.safetensors")):
            return [os.path.join(path, "model.safetensors")]
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
            save_file(shard, tmp, metadata=meta)
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
