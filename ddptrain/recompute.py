"""Hand-written activation (gradient) checkpointing and the policy that applies it to a model.

Why recompute: in a speech encoder most training memory is activations saved for backward
(every attention score, FFN hidden and norm input of every layer). Keeping only each layer's
*input* and re-running the layer's forward when backward reaches it trades ~1/3 more compute for
memory that no longer grows with depth, which buys longer utterances or bigger batches.

How (the saved-tensors-hooks design of torch's non-reentrant checkpoint, written out here so it is
readable and ours):

1. Forward runs once, normally, under :func:`torch.autograd.graph.saved_tensors_hooks`. Whenever
   autograd wants to save a tensor for backward, the pack hook stores an index instead.
2. The first time backward unpacks one of those indices, the region is re-run under the RNG and
   autocast state of the original forward, and the pack hook of *that* run captures the saved
   tensors in order. Index ``i`` of the recomputation is index ``i`` of the original forward.
3. Each recomputed tensor is handed out once and then dropped, so recomputed memory is freed as
   backward consumes it. The recomputation's own autograd graph (it runs with grad enabled, to
   see what autograd saves) gets emptied slots, not the tensors: if the region leaks a tensor of
   that graph into outside state (a KV cache passed in, with Hugging Face's ``use_cache=True``),
   the graph outlives the recomputation but holds no activations (else a decoder's KV cache
   keeps every recomputed layer alive to the end of the backward). A KV cache in a region warns.

The autograd graph is the original one: there is no second backward and no autograd Function
wrapped around the region, so parameters get their gradient exactly once (DDP's hooks see
nothing unusual, no_sync works), inputs need not require grad, keyword arguments are fine and any
output structure (tuple, dict, ``ModelOutput``) passes through untouched.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ddptrain.submodules import InstanceForward, instance_forward, match_modules, tidy_forward

if TYPE_CHECKING:  # only its attributes are read; keeps this module free of the YAML stack
    from ddptrain.config import RecomputeConfig

__all__ = ["checkpoint", "apply_recompute", "remove_recompute"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


class _StopRecompute(Exception):
    """Raised inside the recomputation once every needed tensor is captured (skips the rest)."""


class _Handle:
    """What autograd holds instead of a saved tensor. Weakly tracked: a dead handle means the
    graph node that saved it is gone, so its tensor need not be kept when recomputing."""

    __slots__ = ("idx", "__weakref__")

    def __init__(self, idx: int):
        self.idx = idx


class _Slot:
    """What the recomputed graph's nodes hold instead of a tensor (see ``_Frame._recompute``)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def unpack(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError("recompute: a backward through the graph of a recomputation (it is for its saved "
                               "tensors only, and they are gone once the recomputation returns)")
        return self.tensor


_warned_state: set = set()


def _warn_if_stateful(fn: Callable, others: list) -> None:
    """Once per module class: a KV cache among the region's arguments (``use_cache=True``).

    A cache's ``update`` runs again when the region is recomputed, so the cache grows and holds
    the recomputed graph; recompute then frees the activations anyway (``_Slot``), but the
    cache's contents are wrong and its memory is wasted. Hugging Face decoders default to
    ``use_cache=True`` in training too unless their own gradient checkpointing is on.
    """
    cache = next((o for o in others if callable(getattr(o, "get_seq_length", None))
                  and callable(getattr(o, "update", None))), None)
    if cache is None:
        return
    owner = getattr(fn, "__self__", None)  # a bound forward, or submodules' partial(inner, module)
    if owner is None and isinstance(fn, functools.partial) and fn.args and isinstance(fn.args[0], nn.Module):
        owner = fn.args[0]
    name = type(owner).__name__ if owner is not None else getattr(fn, "__qualname__", repr(fn))
    if name in _warned_state:
        return
    _warned_state.add(name)
    warnings.warn(
        f"recompute: {name} is checkpointed and gets a {type(cache).__name__} (a KV cache): the recomputation "
        "in backward updates the cache a second time. Call the model with use_cache=False for training.",
        RuntimeWarning, stacklevel=4)


class _SaveInputs(torch.autograd.Function):
    """Keeps the region's tensor inputs as ordinary saved tensors of a node that is never run.

    Saving them through autograd (not a Python list) means an in-place change to an input between
    forward and backward raises autograd's usual "modified by an inplace operation" error instead
    of silently recomputing from wrong values, and outer saved-tensor hooks (e.g. a memory
    count) see them, because they *are* what checkpointing keeps in memory.
    """

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return torch.empty((0,))

    @staticmethod
    def backward(ctx, *grads):  # never reached: the output is not used by anything
        return (None,) * (1 + len(ctx.saved_tensors))


class _Frame:
    """State of one checkpointed call: its inputs, RNG/autocast state and saved-tensor handles."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn = fn
        self.kwarg_names = list(kwargs)
        flat = list(args) + list(kwargs.values())
        self.num_args = len(args)
        self.tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        self.others = [None if isinstance(a, torch.Tensor) else a for a in flat]
        dummy = torch.empty((0,), requires_grad=True)  # a grad_fn even if no input needs grad
        self.saver = _SaveInputs.apply(dummy, *(flat[i] for i in self.tensor_pos))
        # RNG: dropout must draw the same mask again. CUDA only if it is already initialised (a
        # CPU run must not create a CUDA context), and only for devices this region can touch.
        self.cpu_rng = torch.get_rng_state()
        self.cuda_devices: list[int] = []
        if torch.cuda.is_initialized():
            devs = {torch.cuda.current_device()}
            devs |= {flat[i].device.index for i in self.tensor_pos if flat[i].is_cuda}
            self.cuda_devices = sorted(devs)
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        # Autocast is thread-local and backward usually runs outside it (or on another thread).
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in _AUTOCAST_DEVICES]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.handles: list[weakref.ref] = []
        _warn_if_stateful(fn, self.others)
        self.meta: list[tuple] = []  # (shape, dtype, device) per saved tensor: detects divergence
        self.stores: dict[int, dict[int, torch.Tensor]] = {}  # graph task id -> idx -> tensor

    def pack(self, t: torch.Tensor) -> _Handle:
        handle = _Handle(len(self.meta))
        self.handles.append(weakref.ref(handle))
        self.meta.append((t.shape, t.dtype, t.device))
        return handle

    def unpack(self, handle: _Handle) -> torch.Tensor:
        # One recomputation per backward pass (graph task): a second backward through a retained
        # graph recomputes again rather than reusing tensors the first one already consumed.
        # (Private, but it is what torch.utils.checkpoint itself keys on; -1 outside backward.)
        gid = torch._C._current_graph_task_id()
        store = self.stores.get(gid)
        if store is None or handle.idx not in store:
            store = self.stores[gid] = self._recompute()
        tensor = store.pop(handle.idx)
        if not store:
            del self.stores[gid]
        return tensor

    def _inputs(self) -> tuple[tuple, dict]:
        flat = list(self.others)
        for pos, t in zip(self.tensor_pos, self.saver.grad_fn.saved_tensors):
            flat[pos] = t
        kwargs = dict(zip(self.kwarg_names, flat[self.num_args:]))
        return tuple(flat[: self.num_args]), kwargs

    def _recompute(self) -> dict[int, torch.Tensor]:
        args, kwargs = self._inputs()
        captured: list[torch.Tensor] = []
        slots: list[_Slot] = []
        wanted = len(self.meta)

        def capture(t: torch.Tensor) -> _Slot:
            # detach: hand back values only; keeping the recomputed graph would hold its memory.
            captured.append(t.detach())
            if len(captured) == wanted:
                raise _StopRecompute  # the rest of the forward saves nothing we need
            # The recomputed graph gets a slot, emptied below, not the tensor: if the region
            # stored a tensor of that graph outside itself (a KV cache passed in as an argument,
            # a module attribute), the graph outlives the recomputation, and with the tensors
            # in it every recomputed layer's activations would stay alive to the end of the
            # backward: recompute undone, silently.
            slots.append(_Slot(captured[-1]))
            return slots[-1]

        with contextlib.ExitStack() as stack:
            stack.callback(_restore, _running_stats(self.fn))  # see _running_stats: updated once a step
            # fork_rng: the replayed draws must not move the RNG stream of the rest of training.
            stack.enter_context(torch.random.fork_rng(self.cuda_devices, device_type="cuda"))
            torch.set_rng_state(self.cpu_rng)
            for dev, state in zip(self.cuda_devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, dev)
            for dev, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(capture, _Slot.unpack))
            try:
                self.fn(*args, **kwargs)
            except _StopRecompute:
                pass
            finally:
                for slot in slots:
                    slot.tensor = None
                slots.clear()
        if len(captured) != wanted:
            raise RuntimeError(
                f"recompute: the recomputed forward saved {len(captured)} tensors for backward but "
                f"the original saved {wanted}. The checkpointed function must take the same path "
                "both times: no data-dependent branches on state that changes between forward and "
                "backward (module attributes, global flags, torch.is_grad_enabled()).")
        for i, (t, (shape, dtype, device)) in enumerate(zip(captured, self.meta)):
            if (t.shape, t.dtype, t.device) != (shape, dtype, device):
                raise RuntimeError(
                    f"recompute: saved tensor #{i} was {tuple(shape)} {dtype} on {device} in "
                    f"forward but {tuple(t.shape)} {t.dtype} on {t.device} when recomputed (other "
                    "autocast/precision or control flow between forward and backward? a compiled block "
                    "that ran eagerly in one of the two because dynamo's recompile limit was reached: "
                    "raise compile.recompile_limit)")
        out = {i: t for i, t in enumerate(captured) if self.handles[i]() is not None}
        captured.clear()  # the closure above may outlive this call (see capture)
        return out


def _region_modules(fn: Callable) -> list[nn.Module]:
    """The modules a checkpointed ``fn`` runs, as far as ``fn`` shows them: ``fn`` itself, the
    module of a bound ``forward`` or of submodules' ``partial(inner, module)``, modules in its
    closure (``lambda x: layer(x)``)."""
    found = [fn, getattr(fn, "__self__", None)]
    while isinstance(fn, functools.partial):
        found += fn.args
        fn = fn.func
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            value = cell.cell_contents
            found += value if isinstance(value, (list, tuple)) else [value]
    return list({id(m): m for m in found if isinstance(m, nn.Module)}.values())


def _running_stats(fn: Callable) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(buffer, copy)`` of the running statistics of every norm layer in the region.

    A norm layer in training mode normalises with the batch's statistics and *also* updates its
    running ones (BatchNorm*, SyncBatchNorm, InstanceNorm* with ``track_running_stats``): the
    recomputation would update them a second time a step (twice the momentum, twice
    ``num_batches_tracked``), so evaluation would use other statistics than a plain run's. Its
    outputs never read the running statistics in training, so putting them back after the
    recomputation is exact; a copy of a few per-channel vectors is cheap, and unlike toggling
    ``track_running_stats`` it changes no module attribute (a compiled block would recompile on
    it, and InstanceNorm updates tracked buffers whatever the flag says).
    """
    saved = []
    for owner in _region_modules(fn):
        for m in owner.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.training:
                for buf in (m.running_mean, m.running_var, m.num_batches_tracked):
                    if isinstance(buf, torch.Tensor) and not isinstance(buf, nn.parameter.UninitializedBuffer):
                        saved.append((buf, buf.clone()))
    return saved


@torch.no_grad()
def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buf, copy in saved:
        buf.copy_(copy)


# dynamo cannot trace the hooks: compiled models run this region eagerly. torch's lazy form of
# torch.compiler.disable imports torch._dynamo at the first call, not with ddptrain (~2 s).
_disable_dynamo = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


@_disable_dynamo
def checkpoint(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` keeping only its inputs for backward; recompute the rest.

    Under ``torch.no_grad()`` / inference nothing is saved anyway, so this is a plain call.
    Under ``torch.compile`` the region is a graph break and runs eagerly: dynamo cannot trace
    saved-tensor hooks that recompute, and an eager region is correct where a traced one is not.

    Args:
        fn: the region to checkpoint. Must be deterministic given its inputs, the RNG state and
            the autocast state (all three are replayed), and must not change its control flow
            between forward and backward. Norm layers' running statistics are updated once (the
            recomputation puts them back) in the modules ``fn`` shows: ``fn`` itself, a bound
            method's module, a ``functools.partial``'s module arguments, modules (or lists of
            them) in its closure; not modules it reaches otherwise (through a global).
        *args: positional arguments for ``fn``; tensors among them need not require grad.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        Whatever ``fn`` returns (any structure; it is not wrapped).

    Raises:
        RuntimeError: in backward, if the recomputation saved different tensors than the forward,
            or (autograd's own error) if a tensor input was modified in place after the call.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args, **kwargs)


def _checkpoint_in_training(module: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
    """The ``around`` of a recomputed module's :class:`~ddptrain.submodules.InstanceForward`."""
    if module.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, **kwargs)
    return forward(*args, **kwargs)  # eval / no_grad: nothing to save, nothing to recompute


def _is_recomputed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, InstanceForward) and forward.around is _checkpoint_in_training


def apply_recompute(model: nn.Module, cfg: "RecomputeConfig") -> list[str]:
    """Checkpoint the submodules of ``model`` selected by ``cfg``, in place.

    Only the instance's ``forward`` is replaced, so parameter names, ``state_dict()`` keys and
    module hooks are unchanged and saved weights load into an un-wrapped model. Apply it to the
    bare model *before* wrapping it in DDP (names then have no ``module.`` prefix).

    A module matches if its class name is in ``cfg.module_classes`` or its dotted name matches
    one of ``cfg.name_globs`` (fnmatch; ``*`` also crosses dots). Matches nested inside another
    match are skipped (recomputing the outer one already covers them); of the remaining matches,
    in registration order, indices 0, k, 2k, ... are wrapped for ``every_k = k``.

    Args:
        model: the model to modify.
        cfg: which modules to wrap; nothing is done if ``cfg.enabled`` is false.

    Returns:
        The dotted names of the wrapped modules.

    Raises:
        ValueError: ``every_k < 1``, the model is already wrapped, or nothing matched (the
            message names the patterns and some class names that do exist in the model).
    """
    if not cfg.enabled:
        return []
    if cfg.every_k < 1:
        raise ValueError(f"recompute.every_k must be >= 1, got {cfg.every_k}")
    if any(_is_recomputed(m) for m in model.modules()):
        raise ValueError("model already has recompute applied; call remove_recompute() first")
    matched = match_modules(model, cfg.module_classes, cfg.name_globs, "recompute")
    chosen = matched[:: cfg.every_k]
    for name, module in chosen:
        instance_forward(module, name).around = _checkpoint_in_training
    return [name for name, _ in chosen]


def remove_recompute(model: nn.Module) -> list[str]:
    """Undo :func:`apply_recompute`: wrapped modules run their forward without checkpointing again.

    Args:
        model: a model previously passed to :func:`apply_recompute` (anything else is a no-op).

    Returns:
        The dotted names of the modules that were unwrapped.
    """
    names = []
    for name, module in model.named_modules():
        if _is_recomputed(module):
            module.forward.around = None
            tidy_forward(module)  # a compiled forward (ddptrain.compile) stays
            names.append(name)
    return names
