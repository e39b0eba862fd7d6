"""Activation offload: what autograd keeps for the backward of chosen modules waits in host memory.

Why: with recompute on, what is left of a step's activations is every recomputed block's inputs
(B x T x D per layer, all layers, alive from the forward to that block's backward) plus one
block's working set. Moving those inputs to host memory while the rest of the forward and the
later blocks' backward run lets the batch grow (DeepSpeed calls it ``cpu_checkpointing``).

One mechanism, two uses (``recompute.offload: cpu``, the modules chosen by the ``recompute``
section's selection keys):

- with ``recompute.enabled``: each recomputed region keeps only its inputs, and it keeps them as
  ordinary saved tensors of autograd (ddptrain/recompute.py's ``_SaveInputs``), so saved-tensor
  hooks entered around the region's call see exactly those; inside the region recompute's own
  hooks come first and nothing else reaches ours.
- without: the same hooks around a selected module's call see every tensor autograd saves in it
  (``torch.autograd.graph.saved_tensors_hooks``, as torch's ``save_on_cpu``), and all go to host.

How a tensor travels on CUDA (on a CPU device the same code runs with plain copies):

1. Pack (forward): the side stream waits for the compute stream (the tensor's producer is queued
   there), then copies the tensor into a block of the pinned :class:`HostPool`;
   ``record_stream`` keeps its GPU memory from being reused before the copy has read it. The
   compute stream never waits in the forward. A tensor saved several times (one norm output
   read by three projections) is copied once while it is alive and unchanged.
2. Unpack (backward): the first unpack of region ``k`` brings all of ``k`` back (unless it is
   already on its way) and starts region ``k-1``'s copies on the side stream, so they overlap
   ``k``'s recomputation and backward; the compute stream waits for an event of ``k``'s copies
   only. Device memory for the copies is allocated on the compute stream, and the side stream
   waits for it first, so no copy lands in memory that queued compute work still reads.
3. A device copy is handed out once and dropped; the host block returns to the pool when
   autograd frees the saved tensor. Both directions run on one side stream, so a block reused
   by the next forward's copy is written only after the last copy that read it.

What stays on the device: weights (parameters, their views and autocast's casts of them: they
exist anyway, and moving them every step only costs bandwidth), tensors under ``min_bytes``
(a copy's latency is worth more than their memory), tensors on another device, and anything that
is not a plain strided tensor (sparse, quantized, conjugate views, subclasses). Offloading moves
values, never RNG or autocast state, so recompute's replay (docs/design.md) is untouched.

With compile: a regionally compiled block runs its compiled forward inside the region (the hooks
are entered around it, eagerly). A whole-model ``torch.compile`` does not run saved-tensor hooks
entered inside the compiled code, so without recompute that set-up is refused (config.py); with
recompute the checkpointed blocks run eagerly anyway. With ``lora.base_offload`` the streamed
base's hooks are entered first (outside ours): with recompute the blocks' kept inputs reach ours;
without recompute ours would take the streamed weights' saves, which streamed_base.py refuses.

A saved tensor is a snapshot: an in-place change to it after the forward, which plain autograd
reports at the backward, is reported here too while the tensor is still alive (its version
moved); once it is freed nobody can change it.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ddptrain.submodules import InstanceForward, match_modules

if TYPE_CHECKING:  # only its attributes are read; keeps this module free of the YAML stack
    from ddptrain.config import RecomputeConfig

__all__ = ["ActivationOffload", "HostPool", "apply_offload", "MIN_BYTES"]

MIN_BYTES = 64 * 1024  # smaller saved tensors stay on the device: a copy's latency costs more than they weigh

# dynamo cannot trace saved-tensor hooks being entered: the hooked call runs eagerly (see recompute)
_disable_dynamo = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


# ----------------------------------------------------------------------------- host memory


class _Chunk:
    __slots__ = ("data", "size", "top", "live")

    def __init__(self, data: torch.Tensor):
        self.data, self.size, self.top, self.live = data, data.numel(), 0, 0


class _Block:
    """``size`` bytes at ``offset`` of a chunk; returned with :meth:`HostPool.give`."""

    __slots__ = ("chunk", "offset", "size")

    def __init__(self, chunk: _Chunk, offset: int, size: int):
        self.chunk, self.offset, self.size = chunk, offset, size

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.chunk.data[self.offset: self.offset + numel * dtype.itemsize].view(dtype)


class HostPool:
    """Host buffers for offloaded tensors: a few large chunks (pinned for CUDA), carved in order.

    Why chunks: pinning memory (cudaHostAlloc) is slow, so a buffer per tensor per step would
    cost more than the copy; a step packs its saved tensors in forward order and frees them in
    about the reverse order, so a bump pointer per chunk, reset when the chunk's last block is
    given back, reuses the same memory step after step without per-size free lists.

    Args:
        pin: allocate pinned (page-locked) chunks, for asynchronous copies from/to CUDA.
        chunk_bytes: the smallest chunk; a larger tensor gets a chunk of its own size (rounded
            up to a power of two, the granularity of torch's pinned allocator).
    """

    ALIGN = 512  # block alignment: any dtype's view works, DMA likes aligned rows

    def __init__(self, pin: bool, chunk_bytes: int = 64 << 20):
        self.pin, self.chunk_bytes = pin, chunk_bytes
        self._chunks: list[_Chunk] = []
        self._current: Optional[_Chunk] = None
        self._lock = threading.Lock()  # packs run in the forward's thread, frees in autograd's
        self.live_bytes = 0  # in blocks handed out now
        self.peak_live_bytes = 0
        self.bytes_in = 0  # handed out in all, ever: what went through the pool

    @property
    def held_bytes(self) -> int:
        """Host memory the pool holds (live or free)."""
        return sum(c.size for c in self._chunks)

    def take(self, nbytes: int) -> _Block:
        size = max(1, -(-nbytes // self.ALIGN)) * self.ALIGN
        with self._lock:
            chunk = self._current
            if chunk is None or chunk.top + size > chunk.size:
                chunk = next((c for c in self._chunks if c.live == 0 and c.size >= size), None)
                if chunk is None:
                    bytes_ = max(self.chunk_bytes, 1 << (size - 1).bit_length())
                    chunk = _Chunk(torch.empty(bytes_, dtype=torch.uint8, pin_memory=self.pin))
                    self._chunks.append(chunk)
                self._current = chunk
            block = _Block(chunk, chunk.top, size)
            chunk.top += size
            chunk.live += 1
            self.live_bytes += size
            self.bytes_in += size
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return block

    def give(self, block: _Block) -> None:
        with self._lock:
            chunk = block.chunk
            chunk.live -= 1
            self.live_bytes -= block.size
            if chunk.live == 0:
                chunk.top = 0

    def release(self) -> None:
        """Drop the free chunks (blocks still handed out keep theirs)."""
        with self._lock:
            self._chunks = [c for c in self._chunks if c.live > 0]
            if self._current is not None and self._current.live == 0:
                self._current = None


# ----------------------------------------------------------------------------- copies


class _CpuCopies:
    """A CPU device: plain copies, nothing to wait for (the path the tests run)."""

    def to_host(self, src: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(src)

    def to_device(self, pairs: list) -> None:
        for host, dst in pairs:
            dst.copy_(host)

    def wait(self, event: Any) -> None:
        pass

    def drop_unwaited(self, event: Any, stream: Any) -> None:
        pass

    def consumer(self) -> None:
        return None


class _CudaCopies:
    """One side stream of the training device for both directions (see :class:`HostPool` reuse)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def to_host(self, src: torch.Tensor, host: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # src's producer is queued there
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
        src.record_stream(self.stream)  # its memory is not reused before the copy has read it

    def to_device(self, pairs: list) -> torch.cuda.Event:
        # the destinations were allocated on the compute stream, possibly in memory that queued
        # compute work still reads (freed there a moment ago): write only after that work
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for host, dst in pairs:
                dst.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def drop_unwaited(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        # a prefetched copy nobody unpacked (graph freed): its memory goes back to the compute
        # stream's pool, so that stream must not reuse it before the copy has landed
        stream.wait_event(event)

    def consumer(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)


# ----------------------------------------------------------------------------- saved tensors


def _span(t: torch.Tensor) -> int:
    """Elements from the tensor's first to its last element in memory (its strides' reach)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or autocast's cast of one (a copy whose input is a parameter)."""
    base = t
    while base._base is not None:
        base = base._base
    if isinstance(base, nn.Parameter):
        return True
    fn = base.grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0" and fn.next_functions:
        source = fn.next_functions[0][0]
        return isinstance(getattr(source, "variable", None), nn.Parameter)
    return False


class _HostCopy:
    """One tensor's values in a pool block, shared by every save of it while it is unchanged."""

    __slots__ = ("pool", "block", "host", "shape", "stride", "dtype", "numel", "source", "version", "__weakref__")

    def __init__(self, pool: HostPool, copies: Any, t: torch.Tensor):
        self.pool, self.shape, self.dtype = pool, t.shape, t.dtype
        span = _span(t)
        if span <= t.numel():  # dense (any layout) or overlapping: copy its memory, keep strides
            self.stride, self.numel = t.stride(), span
            src = t.detach().as_strided((span,), (1,))
        else:  # a view with gaps (q of a fused qkv): its elements, contiguous
            self.stride, self.numel = None, t.numel()
            src = t.detach()
        self.block = pool.take(self.numel * t.element_size())
        flat = self.block.view(t.dtype, self.numel)
        self.host = flat if self.stride is not None else flat.view(t.shape)
        copies.to_host(src, self.host)
        self.source = weakref.ref(t)  # its version at unpack shows an in-place change
        self.version = t._version

    def empty(self, device: torch.device) -> torch.Tensor:
        """Device memory for the copy back (``host``'s shape)."""
        return torch.empty(self.host.shape, dtype=self.dtype, device=device)

    def restore(self, dst: torch.Tensor) -> torch.Tensor:
        """The saved tensor from its device copy: the original strides again."""
        return dst.as_strided(self.shape, self.stride) if self.stride is not None else dst

    def __del__(self):
        try:
            self.pool.give(self.block)
        except Exception:  # interpreter shutdown
            pass


class _Saved:
    """What autograd holds instead of a saved tensor: its host copy and, once brought back, its
    device copy (for ``pending`` more unpacks)."""

    __slots__ = ("region", "copy", "device", "event", "stream", "pending", "__weakref__")

    def __init__(self, region: "_Region", copy: _HostCopy):
        self.region, self.copy = region, copy
        self.device: Optional[torch.Tensor] = None
        self.event, self.stream, self.pending = None, None, 0

    def __del__(self):
        try:
            if self.device is not None:  # brought back but never unpacked
                self.region.owner.copies.drop_unwaited(self.event, self.stream)
        except Exception:
            pass


class _Region:
    """One call of a selected module: its saved tensors, and the region packed just before it."""

    __slots__ = ("owner", "saves", "by_key", "prev", "prefetched", "__weakref__")

    def __init__(self, owner: "ActivationOffload"):
        self.owner = owner
        self.saves: list[weakref.ref] = []
        self.by_key: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.prev: Optional[weakref.ref] = None  # set at its first offloaded tensor (None: the first region)
        self.prefetched = False  # region prev's copies were started


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)


# ----------------------------------------------------------------------------- the offloader


class ActivationOffload:
    """Sends the tensors autograd saves inside :meth:`region` to host memory and back.

    Use :func:`apply_offload` for a model (it enters a region around each selected module's
    call); a region can also wrap any code directly (``with offload.region(): y = f(x)``).

    Args:
        device: the training device; only tensors on it are offloaded. On a CPU device the
            saved tensors are copied to (unpinned) pool memory: no memory is saved, the code runs.
        min_bytes: tensors smaller than this stay where they are (default :data:`MIN_BYTES`).

    Attributes:
        pool: the :class:`HostPool` (``bytes_in``: bytes that went to host; ``live_bytes``: held now).
        stats: counters: ``offloaded`` tensors (``offloaded_bytes``), saves ``shared`` with an
            earlier copy, ``loaded_bytes`` brought back,
            ``prefetched`` regions, and tensors kept on the device by reason (``kept_weight``,
            ``kept_small``, ``kept_other``).
    """

    def __init__(self, device: torch.device, min_bytes: Optional[int] = None):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        cuda = device.type == "cuda"
        self.pool = HostPool(pin=cuda)
        self.copies = _CudaCopies(device) if cuda else _CpuCopies()
        self.stats = dict.fromkeys(("offloaded", "offloaded_bytes", "shared", "loaded_bytes", "prefetched",
                                    "kept_weight", "kept_small", "kept_other"), 0)
        self._shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # _key -> _HostCopy
        self._last: Optional[weakref.ref] = None  # the newest region that offloaded something
        self._open: list = []  # hooks contexts of the module calls now running (apply_offload)
        self._handles: list = []

    def region(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context whose saved tensors go to host; regions entered in turn prefetch each other."""
        region = _Region(self)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(region, t), self._unpack)

    # -- pack

    def _keep_reason(self, t: torch.Tensor) -> Optional[str]:
        if (type(t) not in (torch.Tensor, nn.Parameter) or t.device != self.device or t.layout != torch.strided
                or t.is_quantized or t.is_nested or t.is_conj() or t.is_neg()):
            return "kept_other"
        if _is_weight(t):
            return "kept_weight"
        if min(_span(t), t.numel()) * t.element_size() < max(self.min_bytes, 1):
            return "kept_small"
        return None

    def _pack(self, region: _Region, t: torch.Tensor) -> Any:
        why = self._keep_reason(t)
        if why:
            self.stats[why] += 1
            return t  # autograd keeps it as usual
        key = _key(t)
        saved = region.by_key.get(key)
        if saved is None or saved.copy.source() is None:  # dead source: its address may be reused
            copy = self._shared.get(key)
            if copy is None or copy.source() is None:
                copy = _HostCopy(self.pool, self.copies, t)
                self._shared[key] = copy
                self.stats["offloaded"] += 1
                self.stats["offloaded_bytes"] += copy.numel * t.element_size()
            else:
                self.stats["shared"] += 1
            saved = _Saved(region, copy)
            region.by_key[key] = saved
            region.saves.append(weakref.ref(saved))
            if not region.saves[1:]:  # its first: the region before it is the newest that offloaded
                region.prev, self._last = self._last, weakref.ref(region)
        saved.pending += 1
        return saved

    # -- unpack

    def _load(self, region: _Region) -> bool:
        """Queue the copies back of every saved tensor of ``region`` not on the device yet (any?)."""
        todo = [s for s in (ref() for ref in region.saves) if s is not None and s.device is None]
        if not todo:
            return False
        pairs = []
        for s in todo:
            s.device = s.copy.empty(self.device)  # on the compute stream: see _CudaCopies.to_device
            pairs.append((s.copy.host, s.device))
            self.stats["loaded_bytes"] += s.copy.block.size
        event, stream = self.copies.to_device(pairs), self.copies.consumer()
        for s in todo:
            s.event, s.stream = event, stream
        return True

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):  # kept on the device by _pack
            return saved
        region, copy = saved.region, saved.copy
        source = copy.source()
        if source is not None and source._version != copy.version:
            raise RuntimeError("activation offload: a tensor saved for backward was modified by an inplace "
                               f"operation after the forward (version {copy.version} -> {source._version}); "
                               "its saved value would be stale")
        if saved.device is None:
            self._load(region)
        if not region.prefetched:  # region k-1's copies overlap region k's backward
            region.prefetched = True
            prev = region.prev() if region.prev is not None else None
            if prev is not None and self._load(prev):
                self.stats["prefetched"] += 1
        self.copies.wait(saved.event)
        out = copy.restore(saved.device)
        saved.pending -= 1
        if saved.pending <= 0:  # handed out to every save: our reference would only hold memory
            saved.device, saved.event, saved.stream = None, None, None
        return out

    # -- modules

    def _enter(self, module: nn.Module, args: Any) -> None:
        ctx = self.region() if module.training and torch.is_grad_enabled() else None
        if ctx is not None:
            ctx.__enter__()
        self._open.append(ctx)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self._open.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def attach(self, module: nn.Module) -> None:
        """Run every call of ``module`` (in training, with grad) inside a region."""
        def enter(module, args):  # functions, not bound methods: dynamo's disable marks them
            self._enter(module, args)

        def exit_(module, args, output):
            self._exit(module, args, output)

        self._handles += [module.register_forward_pre_hook(_disable_dynamo(enter)),
                          module.register_forward_hook(_disable_dynamo(exit_), always_call=True)]

    def remove(self) -> None:
        """Detach from every module; free the pool's unused memory."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.pool.release()


def _recomputed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, InstanceForward) and forward.around is not None


def apply_offload(model: nn.Module, cfg: "RecomputeConfig", device: torch.device,
                  min_bytes: Optional[int] = None) -> Optional[ActivationOffload]:
    """Offload the saved tensors of the modules ``cfg`` selects (``recompute.offload``).

    With ``cfg.enabled`` the modules are the recomputed ones (apply
    :func:`ddptrain.recompute.apply_recompute` first) and what goes to host is the inputs they
    keep; without, the same selection (``module_classes``, ``name_globs``, ``every_k``) has every
    tensor saved inside it offloaded. Apply it to the bare model, before DDP.

    Args:
        model: the model (on ``device``).
        cfg: the ``recompute`` section; nothing is done if ``cfg.offload`` is ``none``.
        device: the training device.
        min_bytes: see :class:`ActivationOffload`.

    Returns:
        The :class:`ActivationOffload` (``remove()`` undoes it), or None.

    Raises:
        ValueError: nothing matched, or ``cfg.enabled`` but the selected modules are not
            recomputed.
    """
    if str(cfg.offload).lower() == "none":
        return None
    matched = match_modules(model, cfg.module_classes, cfg.name_globs, "recompute.offload")[:: max(cfg.every_k, 1)]
    if cfg.enabled and not all(_recomputed(m) for _, m in matched):
        raise ValueError("recompute.offload with recompute.enabled offloads what the recomputed modules keep: "
                         "call apply_recompute(model, cfg) first")
    if torch.device(device).type == "cpu":
        warnings.warn("recompute.offload=cpu on a CPU device copies saved tensors to other host memory: "
                      "it saves nothing (the code path runs)", RuntimeWarning, stacklevel=2)
    offload = ActivationOffload(device, min_bytes)
    for _, module in matched:
        offload.attach(module)
    return offload
