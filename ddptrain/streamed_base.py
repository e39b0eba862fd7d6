"""A frozen base streamed from host memory, a block ahead of use: LoRA on a base that does not fit the GPU.

With ``lora.base_offload: cpu`` the frozen parameters of the model's repeated blocks (a
decoder's layers) live in host memory, one flat pinned buffer per block, and the GPU holds a
ring of ``lora.stream_ahead + 1`` block-sized buffers. While block ``k`` computes, block ``k+1``'s
weights are copied into the ring on a side stream; the backward needs the weights again
(``dX = dY W`` for a frozen linear layer; recompute re-runs the block's forward) and streams
them in reverse order. What stays on the GPU as without streaming: the trainable parameters
(the adapters, ``lora.trainable``), every frozen parameter outside the streamed blocks
(embeddings, head, final norm) and every buffer (a buffer may change in the forward, e.g.
BatchNorm statistics, which a read-only copy would lose; they are small).

Why streaming and not a 4-bit (NF4) frozen base, the issue's other option:

- exact: a block computes with the very weights of the plain path, so a run with
  ``base_offload: cpu`` has bitwise the losses and adapters of one without
  (tests/test_streamed_base.py); NF4 trains a different model (a quantisation error per weight)
  and needs its own dequantising kernels;
- no dependency: copies, streams, events and module hooks of plain PyTorch (NF4: bitsandbytes);
- memory: the GPU keeps ``stream_ahead + 1`` blocks: 0.82 GB for a 9B GLM-4 decoder (204 M
  parameters, 0.41 GB of bf16 weights a layer) instead of 18-21 GB (NF4: ~5 GB);
- cost: PCIe bandwidth, each block crosses twice per micro-batch (forward, backward). It is
  hidden where a block computes longer than its copy takes. A 9B layer's forward is
  ``2 x 204e6 x T`` FLOPs (+ attention), its backward with recompute ~3x that. On a 24 GB card
  (RTX 4090/3090: PCIe 4.0 x16, ~25 GB/s, 16 ms a layer; ~100 TFLOP/s achieved) the forward of
  4k tokens takes ~18 ms and of 8k ~40 ms: the copies hide from ~4k tokens per micro-batch up. On
  an H200 (PCIe 5.0, 55 GB/s from pinned memory, 7.5 ms a layer; ~600 TFLOP/s) a 4k forward
  takes ~3 ms and is copy-bound: a 9B LoRA step of 4k tokens took 19% longer there, one of 8k
  tokens no longer (bench/check_streamed_base.py). Short micro-batches are copy-bound
  everywhere; use long ones.

How (the ring): a forward pre-hook on block ``k`` makes ``k``'s weights resident (the compute
stream waits for the event of their copy) and queues the copy of ``k+1 .. k+stream_ahead`` into
the least recently used free ring buffers. After the forward, the block's parameters point at
their host copies again and an event on the compute stream marks the end of the kernels that
read its ring buffer; a copy into that buffer waits for it, so no weight is overwritten while a
queued kernel still reads it. A ring buffer that still holds a block's current weights is used
again without a copy (the last layers at the turn from forward to backward; the first ones from
one micro-batch to the next); an in-place change to a parameter (``load_state_dict``) moves its
version and so invalidates the ring's copy.

Backward: a hook on the gradient of each block output fires before the first of the block's
backward nodes runs (autograd runs a graph's nodes in reverse creation order on a device), so it
makes block ``k`` resident and prefetches ``k-1 ..``; a callback at the end of the backward
points the last block back at the host. Tensors autograd saves in a streamed block's forward
that are ring memory (a weight, ``weight.t()``) are saved as markers by saved-tensor hooks and
handed out in the backward as views of whichever ring buffer then holds the block. With
recompute on the blocks, recompute's own hooks take every saved tensor (ours only see the inputs
it keeps) and its recomputation runs after our backward hook, on the resident weights.

Between steps every streamed parameter points at its host copy: ``state_dict()`` (checkpoints,
full or ``checkpoint.trainable_only``), the base fingerprint and ``load_state_dict`` see the true
base weights, never ring contents. DDP ignores the streamed parameters (they are frozen and on
the host); their rank 0 values are broadcast once here, as DDP does at wrap time.

Where the Trainer installs it (ddptrain/trainer.py ``_setup_model``): :func:`place_model`
instead of ``model.to(device)`` moves everything but the streamed parameters to the GPU (they
hold empty placeholders until installed, so the base never visits the GPU); LoRA, recompute and
master weights follow (the masters' cast sets the placeholders' dtype: the base is streamed in
bf16 under ``trainer.param_dtype: bf16``); then :func:`stream_base` copies the base into its host
buffers in that dtype, before DDP. Refused: ``compile`` (the blocks run eagerly here: their
weights change storage at every call), recompute of a module that encloses a streamed block
(and a model's own gradient checkpointing: both re-run the blocks inside the backward), and
frozen parameters a block shares with anything outside it. On a CPU device (the tests) the
same code runs with plain copies: the "device" ring is other CPU memory.

Config (``lora`` section): ``base_offload`` (none | cpu), ``stream_blocks`` (module-name globs of
the blocks; default: the children of the model's largest ``nn.ModuleList``), ``stream_ahead``.
Use ``trainer.param_dtype: bf16``: fp32 frozen weights cross PCIe at twice the bytes, and without
recompute autocast's bf16 copies of them stay alive until the backward.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.config import ConfigError

__all__ = ["StreamedBase", "find_blocks", "place_model", "stream_base"]

_ALIGN = 256  # bytes: each tensor in a flat buffer starts where vectorised kernels want it
_PLAN = "_ddptrain_streamed_plan"  # the model attribute holding place_model's placeholders until stream_base


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# ----------------------------------------------------------------------------- choosing the blocks


def find_blocks(model: nn.Module, globs: Sequence[str] = ()) -> list[tuple[str, nn.Module]]:
    """The blocks whose frozen weights stream, ``(name, module)`` in registration order.

    Args:
        model: the model (names relative to it).
        globs: module-name patterns (fnmatch; ``*`` crosses dots), e.g. ``["model.layers.*"]``;
            the outermost callable matches are the blocks. Empty: the children of the model's
            largest ``nn.ModuleList`` (by parameter count: a decoder's layers, not its vision
            tower's blocks).

    Raises:
        ConfigError: a glob that matches no module, or (without globs) no ``nn.ModuleList``.
    """
    if globs:
        callable_ = [(n, m) for n, m in model.named_modules() if n and type(m).forward is not nn.Module.forward]
        missing = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n, _ in callable_)]
        if missing:
            lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)][:6]
            raise ConfigError(f"lora.stream_blocks globs {missing} match no module that is called (a ModuleList "
                              f"itself is not: match its children, e.g. 'layers.*'); lists in this model: {lists}")
        blocks: list[tuple[str, nn.Module]] = []
        for name, m in callable_:
            inside = any(name.startswith(b + ".") for b, _ in blocks)  # the outermost match is the block
            if not inside and any(fnmatch.fnmatchcase(name, g) for g in globs):
                blocks.append((name, m))
        return blocks
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ConfigError("lora.base_offload=cpu found no nn.ModuleList of blocks in the model: name the blocks "
                          "to stream with lora.stream_blocks (module-name globs, e.g. ['model.layers.*'])")
    name, best = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))  # first of equals
    return [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(best)]


def _frozen(block: nn.Module, prefix: str, keep: Iterable[str], plan: bool) -> list[tuple[str, nn.Parameter]]:
    """The block's parameters to stream: frozen ones (``plan``: those LoRA will freeze, i.e. not
    matching ``keep``), each once."""
    keep, seen, out = list(keep), set(), []
    for n, p in block.named_parameters():
        full = f"{prefix}.{n}"
        frozen = not any(fnmatch.fnmatchcase(full, g) for g in keep) if plan else not p.requires_grad
        if frozen and id(p) not in seen:
            seen.add(id(p))
            out.append((full, p))
    return out


def _refuse_shared(model: nn.Module, blocks: list[tuple[str, list[tuple[str, nn.Parameter]]]]) -> None:
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for block, params in blocks:
        for name, p in params:
            other = [n for n in names[id(p)] if not n.startswith(block + ".")]
            if other:
                raise ConfigError(f"lora.base_offload=cpu: {name} (streamed block {block}) is the same tensor as "
                                  f"{other[0]} outside that block (tied weights); untie it, or leave the block out "
                                  "of lora.stream_blocks")


# ----------------------------------------------------------------------------- set-up, in two steps


class _Plan:
    """What :func:`place_model` leaves for :func:`stream_base`: the blocks and each streamed
    parameter's data (the parameter itself holds an empty placeholder meanwhile)."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], data: dict[int, torch.Tensor]):
        self.blocks, self.data = blocks, data


def place_model(model: nn.Module, device: torch.device, cfg: Any) -> nn.Module:
    """``model.to(device)``, except that with ``lora.base_offload: cpu`` the parameters to stream
    stay where they are: the base never has to fit the GPU.

    The streamed parameters (those of the blocks that LoRA will freeze: every one not matching
    ``lora.trainable``) hold empty placeholders of their dtype until :func:`stream_base`; LoRA,
    recompute and master weights may run in between (a dtype cast of a placeholder is the dtype
    the base is streamed in).

    Args:
        model: the model, as the user built it (on the host, or anywhere).
        device: the training device.
        cfg: the run's :class:`ddptrain.Config` (its ``lora`` section is read).

    Raises:
        ConfigError: see :func:`find_blocks`; a streamed parameter that is shared with a module
            outside its block; no frozen parameter in any block.
    """
    lc = cfg.lora
    if str(lc.base_offload).lower() != "cpu":
        return model.to(device)
    blocks = find_blocks(model, lc.stream_blocks)
    chosen = [(name, _frozen(m, name, lc.trainable, plan=True)) for name, m in blocks]
    if not any(params for _, params in chosen):
        raise ConfigError(f"lora.base_offload=cpu: the blocks {blocks[0][0]}.. hold no frozen parameter to stream "
                          "(lora.trainable keeps them all trainable)")
    _refuse_shared(model, chosen)
    data = {}
    for _, params in chosen:
        for _, p in params:
            data[id(p)] = p.data
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    model.to(device)
    setattr(model, _PLAN, _Plan(blocks, data))
    return model


def stream_base(model: nn.Module, cfg: Any, device: torch.device,
                recomputed: Sequence[str] = ()) -> Optional["StreamedBase"]:
    """Stream the frozen base of ``cfg.lora``'s blocks from host memory (``lora.base_offload: cpu``).

    Call it on the bare model after LoRA and master weights (their dtype casts come first) and
    before DDP. After :func:`place_model` the base is taken from where it waited; without it
    (a model already on the device) the frozen weights move to the host here.

    Args:
        model: the model (not wrapped in DDP).
        cfg: the run's config (``lora`` section).
        device: the training device.
        recomputed: the names of the recomputed modules (``apply_recompute``'s result).

    Returns:
        The :class:`StreamedBase`, or None when ``lora.base_offload`` is ``none``.

    Raises:
        ConfigError: a recomputed module encloses a streamed block (its recomputation would run
            the blocks inside the backward), and the refusals of :func:`place_model`.
    """
    lc = cfg.lora
    if str(lc.base_offload).lower() != "cpu":
        return None
    plan: Optional[_Plan] = model.__dict__.pop(_PLAN, None)
    blocks = plan.blocks if plan is not None else find_blocks(model, lc.stream_blocks)
    for r in recomputed:
        inside = [b for b, _ in blocks if r == "" or b.startswith(r + ".")]
        if inside:
            raise ConfigError(f"recompute wraps {r or 'the whole model'!r}, which holds the streamed block "
                              f"{inside[0]}: recompute the blocks themselves (or modules inside them), e.g. "
                              f"recompute.module_classes=[{type(blocks[0][1]).__name__}]")
    hf = [b for b, m in blocks if getattr(m, "gradient_checkpointing", False)]
    if hf:
        raise ConfigError(f"lora.base_offload=cpu: the model's own gradient checkpointing is on for {hf[0]} (Hugging "
                          "Face gradient_checkpointing_enable): it re-runs the blocks' forward inside the backward; "
                          "turn it off and use ddptrain's recompute (recompute.enabled, recompute.module_classes)")
    chosen = [(name, _frozen(m, name, (), plan=False)) for name, m in blocks]
    if plan is not None:
        planned = {i for i in plan.data}
        trainable = [n for name, m in blocks for n, p in m.named_parameters(prefix=name) if id(p) in planned
                     and p.requires_grad]
        if trainable:
            raise ConfigError(f"lora.base_offload=cpu: {trainable[0]} was to be streamed as frozen but trains: "
                              "lora.trainable decides what trains in a LoRA run")
    else:
        _refuse_shared(model, chosen)
    chosen = [(name, m, params) for (name, params), (_, m) in zip(chosen, blocks) if params]
    base = StreamedBase(chosen, device, lc.stream_ahead, plan.data if plan is not None else {})
    from torch.nn.parallel import DistributedDataParallel as DDP

    ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | base.param_names()
    DDP._set_params_and_buffers_to_ignore_for_model(model, sorted(ignore))
    return base


# ----------------------------------------------------------------------------- host memory


class _Registered:
    """Plain host memory page-locked with ``cudaHostRegister``, for as long as this object lives.

    Why not ``pin_memory=True``: PyTorch's caching host allocator rounds every buffer up to a
    power of two, 512 MiB for a 9B layer's 389 MiB (a third more host memory for the base). The
    copies from registered memory run at the pinned rate (55 GB/s on an H200, as pin_memory).
    """

    def __init__(self, nbytes: int):
        page = 4096
        self.raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
        start = -self.raw.data_ptr() % page
        self.tensor = self.raw[start:start + nbytes]
        self.ptr = self.raw.data_ptr() + start
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.ptr, _pages(nbytes, page), 0))

    def __del__(self):
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # interpreter shutdown: the process's memory goes anyway
            pass


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a block's output: a tensor, or tuples, lists and dicts (``ModelOutput``) of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _pages(n: int, page: int) -> int:
    return -(-n // page) * page


def _host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, Any]:
    """A flat uint8 host buffer (page-locked when ``pin``) and the object that keeps it pinned."""
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8), None
    if hasattr(torch.cuda.cudart(), "cudaHostRegister"):
        holder = _Registered(nbytes)
        return holder.tensor, holder
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None


# ----------------------------------------------------------------------------- the ring


class _Block:
    """One streamed block: its frozen parameters and their host copies (views of one flat buffer)."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]],
                 data: dict, pin: bool):
        self.index, self.name, self.module = index, name, module
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        sources = [data.pop(id(p), None) for p in self.params]  # where a parameter holds a placeholder
        # the parameter's dtype (master weights may have cast its placeholder), the data's shape
        self.layout = [(p.dtype, (p if src is None else src).shape) for p, src in zip(self.params, sources)]
        self.offsets, total = [], 0
        for dtype, shape in self.layout:
            self.offsets.append(total)
            total = _aligned(total + shape.numel() * dtype.itemsize)
        self.nbytes = total
        self.host, self._pinned = _host_buffer(total, pin)
        self.host_views = self.views_of(self.host)
        with torch.no_grad():
            for p, src, view in zip(self.params, sources, self.host_views):
                view.copy_(p.data if src is None else src)  # a cast, where the dtype changed
                p.data = view

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameters' views into a flat buffer laid out like the host copy."""
        return [flat[o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for o, (dtype, shape) in zip(self.offsets, self.layout)]

    def version(self) -> tuple:
        # an in-place write to a parameter (load_state_dict's copy_) moves its version counter
        return tuple(p._version for p in self.params)


class _Slot:
    """One ring buffer on the device and what it holds."""

    def __init__(self, data: torch.Tensor, blocks: list[_Block], cuda: bool):
        self.data = data
        with torch.inference_mode(False):  # views made once, usable in training and evaluation alike
            self.views = [b.views_of(data) for b in blocks]
        self.block: Optional[int] = None  # index of the block whose weights it holds
        self.version: Optional[tuple] = None  # that block's version when copied
        self.ready = torch.cuda.Event() if cuda else None  # the copy into it is done
        self.free = torch.cuda.Event() if cuda else None  # the kernels that read it are done
        self.used = 0  # last use, for least-recently-used replacement


class _Weight:
    """What autograd holds instead of a saved tensor that is ring memory: where it lies in its block."""

    __slots__ = ("block", "offset", "dtype", "size", "stride")

    def __init__(self, block: int, t: torch.Tensor):
        self.block, self.offset, self.dtype, self.size, self.stride = (block, t.storage_offset(), t.dtype,
                                                                        t.shape, t.stride())


class StreamedBase:
    """The host copies of the streamed blocks' frozen weights, the device ring and the hooks that
    move weights between them. Made by :func:`stream_base`.

    Args:
        blocks: ``(name, module, [(parameter name, parameter), ...])`` per block, in execution
            order (the order prefetching assumes; another order is correct, only slower).
        device: the training device (a CPU device runs the same code with plain copies).
        ahead: blocks prefetched ahead of the one computing (``lora.stream_ahead``).
        data: parameter id -> its data where a parameter holds a placeholder (:func:`place_model`).

    Attributes:
        stats: counters: ``copies`` / ``copied_bytes`` (host to ring), ``reused`` (a block
            found in the ring: prefetched, or still there), ``on_demand`` (saved weights needed
            outside their block's backward: copied whole, slow).
    """

    def __init__(self, blocks: list[tuple[str, nn.Module, list]], device: torch.device, ahead: int = 1,
                 data: Optional[dict] = None):
        if ahead < 1:
            raise ConfigError(f"lora.stream_ahead must be >= 1, got {ahead}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        data = {} if data is None else data
        self.blocks = [_Block(i, name, m, params, data, self.cuda) for i, (name, m, params) in enumerate(blocks)]
        self.ahead = ahead
        size = max(b.nbytes for b in self.blocks)
        self.slots = [_Slot(torch.empty(size, dtype=torch.uint8, device=self.device), self.blocks, self.cuda)
                      for _ in range(min(ahead + 1, len(self.blocks)))]
        self._by_ptr = {s.data.untyped_storage().data_ptr(): s for s in self.slots}
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = dict.fromkeys(("copies", "copied_bytes", "reused", "on_demand"), 0)
        self._tick = 0
        self._active: dict[int, _Slot] = {}  # blocks whose parameters point into the ring now
        self._calls: list[tuple[int, Any]] = []  # (block, saved-tensor hooks) of the forward calls running
        self._bw_task: Optional[int] = None  # the backward (graph task) now streaming, its block, its stream
        self._bw_block: Optional[int] = None
        self._bw_stream: Any = None
        self._warned = False
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._broadcast()
        self._handles = []
        for b in self.blocks:
            self._handles += [
                # first of the pre-hooks: saved-tensor hooks entered by later ones (activation
                # offload) sit above ours, as they would without streaming
                b.module.register_forward_pre_hook(functools.partial(self._before, b.index), prepend=True),
                b.module.register_forward_hook(functools.partial(self._after, b.index), always_call=True)]

    # -- what it holds

    def param_names(self) -> set[str]:
        """The dotted names of the streamed parameters (as in the model's ``named_parameters``)."""
        return {n for b in self.blocks for n in b.names}

    def device_bytes(self) -> int:
        """Bytes of the ring on the device: all the streamed base ever holds there."""
        return sum(s.data.numel() for s in self.slots)

    def host_bytes(self) -> int:
        """Bytes of the host copies (the streamed base)."""
        return sum(b.nbytes for b in self.blocks)

    def remove(self) -> None:
        """Detach the hooks; the streamed parameters keep their host copies (on the host)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- the ring

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def _fetch(self, i: int, keep: set, must: bool) -> Optional[_Slot]:
        """The ring buffer holding block ``i``'s current weights, queuing their copy if needed,
        into the least recently used buffer not in ``keep`` (ids). None if none is free and not ``must``."""
        b, self._tick = self.blocks[i], self._tick + 1
        version = b.version()
        for s in self.slots:
            if s.block == i and s.version == version:
                s.used = self._tick
                self.stats["reused"] += 1
                return s
        free = [s for s in self.slots if id(s) not in keep and s not in self._active.values()]
        if not free:
            if must:
                raise RuntimeError(f"streamed base: no free ring buffer for {b.name} ({len(self._active)} blocks "
                                   "in use at once): raise lora.stream_ahead")
            return None
        s = min(free, key=lambda s: s.used)
        dst = s.data[:b.nbytes]
        if self.cuda:
            self.copy_stream.wait_event(s.free)  # the kernels that read its old weights are done
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(b.host, non_blocking=True)
            s.ready.record(self.copy_stream)
        else:
            dst.copy_(b.host)
        s.block, s.version, s.used = i, version, self._tick
        self.stats["copies"] += 1
        self.stats["copied_bytes"] += b.nbytes
        return s

    def _activate(self, i: int) -> None:
        s = self._fetch(i, set(), must=True)
        if self.cuda:
            self._stream().wait_event(s.ready)
        for p, view in zip(self.blocks[i].params, s.views[i]):
            p.data = view
        self._active[i] = s

    def _deactivate(self, i: int, stream: Any = None) -> None:
        s = self._active.pop(i)
        if self.cuda:
            s.free.record(stream or self._stream())
        b = self.blocks[i]
        for p, view in zip(b.params, b.host_views):
            p.data = view

    def _prefetch(self, order: Iterable[int]) -> None:
        keep = {id(s) for s in self._active.values()}
        for j in order:
            s = self._fetch(j, keep, must=False)
            if s is None:
                return
            keep.add(id(s))

    # -- forward

    def _before(self, i: int, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() >= 0:  # -1 outside a backward
            raise RuntimeError(f"streamed base: {self.blocks[i].name} ran its forward inside a backward (a "
                               "recomputation other than ddptrain's recompute: Hugging Face gradient checkpointing, "
                               "torch.utils.checkpoint around the blocks); use ddptrain's recompute on the blocks")
        if self._bw_block is not None:
            self._backward_done()  # a backward that ended without its callback (it raised)
        ctx = None
        if torch.is_grad_enabled():
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
        self._calls.append((i, ctx))
        self._activate(i)
        self._prefetch(range(i + 1, min(i + 1 + self.ahead, len(self.blocks))))

    def _after(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._calls or self._calls[-1][0] != i:
            return  # our pre-hook did not run (an earlier pre-hook raised)
        _, ctx = self._calls.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if i in self._active:
            self._deactivate(i)
        if output is not None and torch.is_grad_enabled():
            hook = functools.partial(self._backward_hook, i)
            for t in _tensors(output):
                if t.grad_fn is not None:
                    t.register_hook(hook)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.device or t.layout != torch.strided:
            return t
        try:
            s = self._by_ptr.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
            return t
        return t if s is None or s.block is None else _Weight(s.block, t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Weight):
            return saved
        s = self._active.get(saved.block)
        if s is not None:
            storage = s.data.untyped_storage()
        else:  # outside its block's backward (a block output kept elsewhere): a private copy
            self.stats["on_demand"] += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"streamed base: weights of {self.blocks[saved.block].name} were needed outside "
                              "its backward and are copied on demand (correct, slow)", RuntimeWarning, stacklevel=2)
            storage = self.blocks[saved.block].host.to(self.device, non_blocking=True).untyped_storage()
        return torch.empty(0, dtype=saved.dtype, device=self.device).set_(storage, saved.offset, saved.size,
                                                                          saved.stride)

    # -- backward

    def _backward_hook(self, i: int, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._bw_task:  # the first streamed block of this backward
            if self._bw_block is not None:
                self._deactivate(self._bw_block, self._bw_stream)
                self._bw_block = None
            self._bw_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self._bw_block == i:
            return
        if self._bw_block is not None:
            self._deactivate(self._bw_block, self._bw_stream)
            self._bw_block = None
        self._bw_stream = self._stream()
        self._activate(i)
        self._bw_block = i
        self._prefetch(range(i - 1, max(i - 1 - self.ahead, -1), -1))

    def _backward_done(self) -> None:
        if self._bw_block is not None:
            self._deactivate(self._bw_block, self._bw_stream)
        self._bw_block = self._bw_task = None

    # -- distributed

    @torch.no_grad()
    def _broadcast(self) -> None:
        """Rank 0's base on every rank (DDP does this for the parameters it wraps), a block at a
        time through one ring buffer."""
        s = self.slots[0]
        for b in self.blocks:
            dst = s.data[:b.nbytes]
            dst.copy_(b.host)
            dist.broadcast(dst, src=0)
            if dist.get_rank() != 0:
                b.host.copy_(dst)
        s.block = s.version = None
