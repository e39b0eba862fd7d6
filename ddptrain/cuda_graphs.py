"""``compile.cuda_graphs``: each batch shape's forward and backward captured once as a CUDA graph.

Why: a step of many small kernels (VoxCPM's decoder layers, a short cut-window batch) is bound by
the host: Python, autograd and kernel launches take longer than the kernels, and the GPU idles
between them. Length-bucketed batches come in a small set of shapes per epoch, so each shape's
whole forward + backward can be recorded once and replayed after by one launch.

How, per *key* (the batch's structure: each tensor's shape and dtype, every host number and
string by value, lists of strings by length only):

1. The first ``compile.cuda_graph_warmup`` micro-batches of a key run eagerly, the usual path
   (dynamo compiles for the shape, caches fill, lazily made gradients are allocated).
2. The next one is captured: its tensors are copied into static device buffers kept for the key,
   and ``loss_fn`` + backward run under ``torch.cuda.graph``, gradients accumulating into the
   ``.grad`` tensors that exist already (the update zeroes them in place instead of freeing them:
   ``StepUpdate(keep_grads=True)``). It is then replayed once to compute it.
3. Every later micro-batch of the key copies its tensors into the key's buffers and replays. The
   unit pre-scale, the weight (0 for a replayed stand-in of an empty batch) and fp16's loss scale
   are device tensors the graph reads, so they may change between replays.

A key whose capture fails (a host sync in the forward, say ``.item()`` or a data-dependent shape,
or no memory left for its activations in the graphs' pool),
whose capture would make a gradient that did not exist, or whose host unit count differs between
its warm-up and its capture, runs eagerly from then on, with one warning. So do keys beyond
``compile.cuda_graph_max`` (a run of ever-new shapes), and batches holding objects this module does
not know (their key cannot be told). All graphs share one memory pool: a replay's outputs are read
into the step's sums before the next replay can overwrite them.

What ``loss_fn`` must do for a graph to stand for it:
compute from the batch's tensors and numbers only. Strings (ids, texts) and Python state read in
the forward (a schedule's progress) are those of the captured batch, and host-side work (a
tokenizer called in the loss) runs only at capture. A unit count that varies within one shape
must be a tensor (a count the shapes fix, such as ``labels.numel()``, may be a number).

Costs: gradients stay allocated through the forward (2-4 B per trainable parameter during the
forward that eager frees after the update); the graphs' pool holds about one micro-batch's
activations of the largest captured shape beside the eager pool (``torch.cuda.memory_reserved``
counts it, ``max_memory_allocated`` does not; each capture first empties eager's cache into the driver
so that the pool can grow); each new key costs its warm-up plus one capture.
A trainable parameter with a gradient stays with one (zeros in a step that does not use it, which
AdamW's momentum and decay then move), where eager leaves it untouched.

On the CPU there are no graphs; the same bookkeeping runs the loss on the key's static buffers
(``backend="rerun"``), so the tests see every copy and scale the GPU path makes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ddptrain.config import ConfigError
from ddptrain.contract import TrainingError, batch_ids, check_loss_output, to_device
from ddptrain.precision import Precision
from ddptrain.steps import StepSums, forward_backward


class _Unknown(Exception):
    """A batch leaf whose type this module cannot key or copy."""


def batch_key(batch: Any) -> tuple:
    """What must match for two micro-batches to share one graph (see the module docstring).

    Raises:
        _Unknown: the batch holds an object other than tensors, numbers, strings, None and
            (nested) dicts, lists and tuples of those.
    """
    if isinstance(batch, torch.Tensor):
        return ("T", tuple(batch.shape), batch.dtype)
    if isinstance(batch, dict):
        return ("D", tuple((k, batch_key(v)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(x, str) for x in batch):
            return ("S", len(batch))  # per-utterance ids / texts / sources: not an input of the graph
        return (type(batch).__name__, tuple(batch_key(v) for v in batch))
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return ("V", type(batch).__name__, batch)
    raise _Unknown(type(batch).__name__)


def _static_copy(batch: Any, device: torch.device) -> Any:
    """The batch with each tensor in a new buffer on ``device`` (never the loader's own tensor)."""
    if isinstance(batch, torch.Tensor):
        return torch.empty_like(batch, device=device).copy_(batch, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _static_copy(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not (batch and isinstance(batch[0], str)):
        return type(batch)(_static_copy(v, device) for v in batch)
    return batch


def _copy_into(static: Any, batch: Any) -> None:
    """Copy ``batch``'s tensors into the same-keyed ``static`` buffers (host to device, async)."""
    if isinstance(static, torch.Tensor):
        static.copy_(batch, non_blocking=True)
    elif isinstance(static, dict):
        for k, v in static.items():
            _copy_into(v, batch[k])
    elif isinstance(static, (list, tuple)) and not (static and isinstance(static[0], str)):
        for s, b in zip(static, batch):
            _copy_into(s, b)


class _Graph:
    """One key's static buffers and its captured graph (None on the CPU backend)."""

    def __init__(self, static: Any):
        self.static = static
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.loss: Optional[torch.Tensor] = None  # outputs of the last replay (shared pool: read at once)
        self.units: Any = None  # a float64 device tensor (weighted), or the host number loss_fn returned
        self.host_units = 0.0  # a host unit count: the one the key fixes (checked against its warm-up)


class GraphedSteps:
    """Runs one micro-batch's forward and backward, as :func:`ddptrain.steps.forward_backward`
    does, through a CUDA graph per batch key once the key is warm.

    Args:
        model: what the forward calls (one process: the prepared model, compiled or not).
        loss_fn, precision: as the Trainer's.
        params: the trainable parameters whose ``.grad`` the backward fills.
        device: the training device; CPU runs the ``rerun`` backend.
        warmup: eager micro-batches of a key before it is captured (``compile.cuda_graph_warmup``).
        limit: keys captured at most (``compile.cuda_graph_max``); later ones run eagerly.
        say: where warnings go (the Trainer's logger).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, precision: Precision, params: list,
                 device: torch.device, warmup: int = 1, limit: int = 64, say: Callable[[str], None] = print):
        self.model, self.loss_fn, self.precision, self.params = model, loss_fn, precision, params
        self.device, self.warmup, self.limit, self.say = device, warmup, limit, say
        self.backend = "cuda" if device.type == "cuda" else "rerun"
        f32 = dict(dtype=torch.float32, device=device)
        self.scale_t, self.weight_t = torch.ones((), **f32), torch.ones((), **f32)  # read by every replay
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: dict[tuple, int] = {}  # key -> eager micro-batches so far
        self.host_units: dict[tuple, float] = {}  # key -> the host unit count its warm-up returned
        self.eager_only: set = set()
        self.reasons: list[str] = []  # why each key in eager_only runs eagerly (the warnings' text)
        cuda = self.backend == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None  # one pool: graphs run one at a time
        self.stream = torch.cuda.Stream(device) if cuda else None  # capture needs a stream of its own
        self.replayed = self.total = 0
        self._said_unknown = self._said_limit = False

    def __call__(self, batch: Any, where: str, sums: StepSums, scale: float = 1.0, weight: float = 1.0) -> None:
        """One micro-batch (``batch`` as the loader made it, on the host) into ``sums``."""
        self.total += 1
        key = self._key(batch)
        entry = self.graphs.get(key)
        if entry is None and key is not None and key not in self.eager_only \
                and self.seen.get(key, 0) >= self.warmup and self._room():
            entry = self._capture(key, batch, where, scale, weight)  # None: it cannot be, eager from now on
        if entry is not None:
            self._replay(entry, batch, sums, scale, weight)
            return
        before = sums.units_host
        forward_backward(self.model, self.loss_fn, self.precision, to_device(batch, self.device), where, sums,
                         scale, weight)
        if key is not None and weight == 1.0 and key not in self.eager_only:
            self.seen[key] = self.seen.get(key, 0) + 1
            units = sums.units_host - before
            if self.host_units.setdefault(key, units) != units:
                self._give_up(key, f"loss_fn's host unit count changed within one shape ({self.host_units[key]:g}, "
                                   f"then {units:g}): return it as a tensor to capture it")

    def scalars(self) -> dict:
        """For the training log: keys captured, and the share of micro-batches that replayed one."""
        return {"cuda_graphs": len(self.graphs), "cuda_graph_share": self.replayed / max(1, self.total)}

    # ------------------------------------------------------------------ internals

    def _key(self, batch: Any) -> Optional[tuple]:
        try:
            return batch_key(batch)
        except _Unknown as e:
            if not self._said_unknown:
                self._said_unknown = True
                self.say(f"WARNING: compile.cuda_graphs: a batch holds a {e} (not a tensor, number, string or "
                         "container of them): such batches run eagerly")
            return None

    def _room(self) -> bool:
        if len(self.graphs) < self.limit:
            return True
        if not self._said_limit:
            self._said_limit = True
            self.say(f"WARNING: compile.cuda_graphs: {self.limit} batch shapes captured "
                     f"(compile.cuda_graph_max={self.limit}); new shapes run eagerly from now on (pad to fewer "
                     "shapes, e.g. data.pad_to_multiple, or raise compile.cuda_graph_max)")
        return False

    def _give_up(self, key: tuple, why: str) -> None:
        self.eager_only.add(key)
        self.reasons.append(why)
        self.say(f"WARNING: compile.cuda_graphs: a batch shape runs eagerly: {why}")

    def _forward_backward(self, static: Any, where: str, backward: bool = True) -> tuple:
        """The work a graph records: :func:`forward_backward`'s, with scale and weight as tensors."""
        with self.precision.autocast():
            loss_sum, units = check_loss_output(self.loss_fn(self.model, static), where)
        loss = loss_sum.float() * self.weight_t
        if backward:
            self.precision.scale(loss * self.scale_t).backward()
        if isinstance(units, torch.Tensor):
            units = units.detach().to(torch.float64).reshape(()) * self.weight_t.double()
        return loss.detach(), units

    def _capture(self, key: tuple, batch: Any, where: str, scale: float, weight: float) -> Optional[_Graph]:
        """The key's graph, recorded but not yet run (None: it cannot be, see the module docstring)."""
        entry = _Graph(_static_copy(batch, self.device))  # outside the graphs' pool: it outlives every replay
        self.scale_t.fill_(scale)
        self.weight_t.fill_(weight)
        had = {id(p): (p.grad.data_ptr() if p.grad is not None else None) for p in self.params}
        graph = torch.cuda.CUDAGraph() if self.backend == "cuda" else None
        if graph is not None:
            torch.cuda.empty_cache()  # eager's free cached blocks back to the driver: the graphs' pool cannot use them
        try:
            if graph is not None:
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    entry.loss, entry.units = self._forward_backward(entry.static, where)
            else:  # rerun: a forward that changes nothing stands for the capture (its RNG draws undone,
                # and its buffers: a capture runs no kernel, BatchNorm's running statistics stay)
                buffers = [(b, b.clone()) for b in self.model.buffers()]
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    entry.units = self._forward_backward(entry.static, where, backward=False)[1]
                    for b, kept in buffers:
                        b.copy_(kept)
        except TrainingError:
            raise
        except Exception as e:  # nothing ran: the gradients hold what they held before the capture
            self._forget_new_grads(had)
            hint = ""
            if isinstance(e, torch.OutOfMemoryError):
                hint = (" (the graphs' pool holds a micro-batch's activations beside eager's: fewer such shapes "
                        "fit; a smaller batch, or compile.cuda_graphs=false)")
            self._give_up(key, f"its capture failed ({type(e).__name__}: {str(e).splitlines()[0][:300]}){hint}"
                               f"{batch_ids(batch)}")
            return None
        moved = sum((p.grad.data_ptr() if p.grad is not None else None) != had[id(p)] for p in self.params)
        if moved:
            self._forget_new_grads(had)
            self._give_up(key, f"its capture made {moved} new gradient tensor(s) (of parameters its eager "
                               "warm-up did not reach)")
            return None
        warm = self.host_units.get(key, 0.0)
        if not isinstance(entry.units, torch.Tensor) and float(entry.units) != warm:
            self._give_up(key, f"loss_fn's host unit count changed within one shape ({warm:g} in its warm-up, "
                               f"{float(entry.units):g} at capture): return it as a tensor to capture it")
            return None
        entry.graph, entry.host_units = graph, warm
        self.graphs[key] = entry
        return entry

    def _forget_new_grads(self, had: dict) -> None:
        for p in self.params:
            if had[id(p)] is None:
                p.grad = None  # made inside a graph pool by a capture that is discarded

    def _replay(self, entry: _Graph, batch: Any, sums: StepSums, scale: float, weight: float) -> None:
        _copy_into(entry.static, batch)
        self.scale_t.fill_(scale)
        self.weight_t.fill_(weight)
        if entry.graph is not None:
            entry.graph.replay()
            loss, units = entry.loss, entry.units
        else:  # rerun: the same computation, eagerly, on the key's static buffers
            loss, units = self._forward_backward(entry.static, "compile.cuda_graphs (rerun)")
        # tensor units were weighted inside the graph; a host count is the one the key fixes
        sums.add(loss, units if isinstance(units, torch.Tensor) else entry.host_units * weight)
        self.replayed += 1


def for_run(cfg: Any, step: Any, world_size: int) -> Optional[GraphedSteps]:
    """The Trainer's :class:`GraphedSteps` for ``compile.cuda_graphs`` (None when it is off).

    Args:
        cfg: the whole config; step: the run's :class:`ddptrain.prepare.OneStep`.

    Raises:
        ConfigError: on more than one process (DDP's gradient hooks and all-reduce inside a
            captured backward are not supported yet).
    """
    c = cfg.compile
    if not c.cuda_graphs:
        return None
    if world_size > 1:
        raise ConfigError(f"compile.cuda_graphs=true runs on one process for now ({world_size} here): DDP's "
                          "gradient hooks and all-reduce are not captured; set compile.cuda_graphs=false")
    return GraphedSteps(step.model, step.loss_fn, step.precision, step.update.params, step.device,
                        c.cuda_graph_warmup, c.cuda_graph_max)
