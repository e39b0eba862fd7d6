"""Optimizer offload: the fp32 masters and AdamW state live in (pinned) host memory.

With ``optim.offload: cpu`` (and ``trainer.param_dtype: bf16``) the GPU keeps only the bf16
weights and their bf16 gradients: 4 B per trainable parameter instead of the 16 of
:class:`ddptrain.precision.MasterWeights`, or ``2 + 2/N`` with sharded gradients. Each rank
holds the masters of its own partition only (the whole-tensor partition of
ddptrain/update/sharded.py), so the host of a node holds each master once.

How a step goes, once the StepUpdate has all-reduced the step's verdict (finite? the
normalisation-and-clipping factor?) and read it on the host:

1. The owned bf16 gradients are copied to a pinned bf16 staging buffer on a side stream, all
   queued at once. On one rank most of them are there already: during the step's last backward
   each gradient is copied down (and its norm taken) as soon as autograd has finished it, and
   freed on the GPU, so the GPU never holds all of them.
2. A worker thread updates the masters chunk by chunk (``optim.offload_chunk_mb``), in the order
   the next forward uses them: as soon as a chunk's gradients have landed, the host widens them
   to fp32, runs the optimizer's own step (torch's fused CPU AdamW, multi-threaded) over that
   chunk's masters with the factor as its ``grad_scale``, rounds the updated masters into the
   staging buffer and queues their copy back to the GPU on a second side stream, then marks the
   chunk ready. So chunk ``i``'s host update runs while chunk ``i+1``'s gradients arrive and chunk
   ``i-1``'s weights leave.
3. On one rank the step returns as soon as the worker has started: the loop logs, loads the next
   batch and starts the next forward while the host is still updating. Each forward block
   (below) waits, before it runs, for its own weights only: on the host until its chunks are
   marked ready (a CUDA stream told to wait on an event not yet recorded would not wait), then
   the compute stream waits on those chunks' upload events. The weights every forward reads are
   those of the finished update: nothing is stale or delayed, and the result is bitwise that of
   waiting for the whole update (tests/test_offload.py). On several ranks the step waits for the
   whole update, then each owner's flat buffer is broadcast as with sharded masters.

The blocks whose forward pre-hooks wait (:func:`forward_blocks`): the outermost of the modules
that regional compile or recompute run as one unit and the children of every ``nn.ModuleList``
(the repeated layers). Outermost, because a hook on a module inside a compiled region would be
traced into the compiled code (regional compile replaces only the instance's ``forward``, so
the hooks of the compiled block itself still run eagerly); under a whole-model compile there are
no hooks and the forward waits for the whole update. The parameters outside every block
(embeddings, final norm, output head) are updated first and waited for before each forward
starts (``StepUpdate.before_backward``). The chunks are cut in that order, recorded from the
forward hooks before the first step. Everything else that reads the weights, masters or
optimizer state between two steps calls :meth:`OffloadedMasters.settle` first (evaluation, the
EMA, checkpoint saves, the next step's gradients, ``close``); an error on the worker thread is
raised there, at the next wait.

Why the update waits for the end of the backward: it needs the global gradient norm (clipping)
and the all-ranks finite check, which exist only once every gradient does; an update started
earlier would be stale or inexact. A non-finite step is skipped before the host updates anything.
Only the copies start early, and only on one rank: with several, a gradient is final once DDP (or
the sharded reducer) has reduced it, which the gradient hooks do not see. A parameter whose
gradient arrives twice in one backward (reentrant checkpointing) has the second part added on the
host, bf16 as the GPU would, and is downloaded after the backward from then on.

Why the optimizer's own step per chunk (a private copy of it whose param groups are the chunk's,
hyperparameters as they were when the step was called: the scheduler changes the real ones
meanwhile): its state is then plain optimizer state, so checkpoints have the format of the
on-GPU path and a run may resume with offload on or off. On one rank the weights file holds the
fp32 masters (as MasterWeights'); on several (with ``optim.zero: true``, which the Trainer asks
for), the bf16 weights plus each rank's ShardedMasterState, as the sharded masters save them.

Which kernel: ``optim.fused: auto`` picks the on-device update's (ddptrain/optim.py): on a CPU
device foreach AdamW on both paths, with the factor multiplied in as the on-device path does, so
the offloaded update is bitwise the on-device one with any ``optim.fused``. On a GPU the host
runs torch's fused CPU AdamW and the device torch's fused CUDA AdamW (or the Triton kernel of
``optim.fused_update``): the same arithmetic on other hardware, equal to fp32 rounding, not
bitwise (bench/check_offload.py: losses within 6.1e-5 relative over 20 steps).

Host memory per owned parameter: 4 (master) + 8 (AdamW moments) + 2 (bf16 staging), plus fp32
gradient scratch for the largest chunk (at most one ``optim.offload_chunk_mb`` chunk plus one
tensor, at most what the rank owns), and 4 more with ``ema.enabled`` (its EMA lives beside the
masters): every rank checks before allocating that its node holds all of its ranks' shares
(process.py's ``agree_on_host_memory``). On a CPU run (the tests) the same code runs without
streams: the worker thread, the chunk order and every wait included.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.config import ConfigError
from ddptrain.precision import cast_frozen, kept_fp32
from ddptrain.process import agree_on_host_memory
from ddptrain.update.sharded import partition


def host_bytes_per_param() -> int:
    """Host bytes per owned trainable parameter: master, two AdamW moments, bf16 staging."""
    return 4 + 8 + 2


def scratch_elems(owned: Sequence[int], chunk_elems: int) -> int:
    """The most fp32 gradient scratch one rank's chunks can need, whatever their order: a chunk
    is closed once it reaches ``chunk_elems``, so it holds less than that plus one tensor, and
    never more than what the rank owns (``owned``: its tensors' sizes)."""
    return min(sum(owned), chunk_elems - 1 + max(owned)) if owned else 0


def forward_blocks(model: nn.Module, regions: Sequence[str] = ()) -> list[nn.Module]:
    """The modules whose forward pre-hooks wait for their own updated weights: the outermost of
    the modules named in ``regions`` (those regional compile or recompute run as one unit) and
    the callable children of every ``nn.ModuleList``, keeping those with trainable parameters.

    Outermost: a hook inside a compiled region would be traced into it; a compiled or recomputed
    block's own hooks run eagerly (only its instance ``forward`` is replaced)."""
    regions = set(regions)
    listed = {f"{name}.{i}" if name else str(i)
              for name, m in model.named_modules() if isinstance(m, nn.ModuleList) for i in range(len(m))}
    picked: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():  # parents before their children
        if not name or any(name.startswith(p + ".") for p, _ in picked):
            continue
        if name in regions or (name in listed and type(m).forward is not nn.Module.forward):
            picked.append((name, m))
    return [m for _, m in picked if any(p.requires_grad for p in m.parameters())]


class _Chunk:
    """Whole tensors of one bucket, updated together: their ``runs`` of the flat buffer
    (``[start, end)`` elements, merged where adjacent, and where each starts in the scratch)."""

    __slots__ = ("bucket", "params", "masters", "runs", "elems", "grads", "landed", "uploaded", "ready", "waited")

    def __init__(self, bucket: "_Bucket", params: list, to_master: dict):
        self.bucket = bucket
        self.params = sorted(params, key=lambda p: bucket.offset[id(p)])
        self.masters = [to_master[p] for p in self.params]
        self.runs: list[list[int]] = []
        pos = 0
        for p in self.params:
            start, n = bucket.offset[id(p)], p.numel()
            if self.runs and self.runs[-1][1] == start:
                self.runs[-1][1] = start + n
            else:
                self.runs.append([start, start + n, pos])
            pos += n
        self.elems = pos
        self.grads: list = []  # the masters' fp32 gradients: views of the scratch
        self.landed = None  # CUDA event: this step's gradients of the chunk are on the host
        self.uploaded = None  # CUDA event: its new weights are on the GPU
        self.ready = threading.Event()  # the host has updated the chunk and queued its upload
        self.ready.set()
        self.waited = True  # this step's forward has waited for it already


class _Bucket:
    """One owner's trainable tensors of one dtype: a flat device buffer the parameters are views
    of (one broadcast, one upload per run of a chunk), and, for this rank's own buckets, the
    pinned host masters and staging buffer in the same layout."""

    def __init__(self, owner: int, params: list, dtype: torch.dtype, own: bool, pin: bool):
        self.owner, self.dtype = owner, dtype
        device = params[0].device
        total = sum(p.numel() for p in params)
        self.chunks: list[_Chunk] = []
        self.masters: list[nn.Parameter] = []
        self.params = list(params)
        self.offset: dict[int, int] = {}  # id(param) -> its first element in the flat buffer
        self.staged: dict[int, torch.Tensor] = {}  # id(param) -> its gradient's place in the staging buffer
        if own:
            self.master_flat = torch.empty(total, dtype=torch.float32, pin_memory=pin)
            self.staging = torch.empty(total, dtype=dtype, pin_memory=pin)
        # The parameters pass through the host (rounded there, as the GPU would) and leave the GPU
        # before the flat buffer is allocated, so it never holds them at full precision beside it.
        rounded = self.staging if own else torch.empty(total, dtype=dtype)
        shapes = [p.shape for p in params]
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.offset[id(p)] = offset
                if own:  # the master from the parameter at full precision, before it is rounded
                    view = self.master_flat[offset:offset + n].view(p.shape)
                    view.copy_(p.detach())
                    rounded[offset:offset + n].copy_(view.view(-1))
                    self.masters.append(nn.Parameter(view))
                    self.staged[id(p)] = self.staging[offset:offset + n].view(p.shape)
                else:
                    rounded[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = torch.empty(0, dtype=dtype, device=device)  # the old storage is freed here
                offset += n
            self.flat = torch.empty(total, dtype=dtype, device=device)
            self.flat.copy_(rounded)
            offset = 0
            for p, shape in zip(params, shapes):
                n = shape.numel()
                p.data = self.flat[offset:offset + n].view(shape)
                offset += n


class OffloadedMasters:
    """fp32 masters and optimizer state on the host, for a bf16 model on the GPU.

    The interface of :class:`~ddptrain.precision.MasterWeights` that the Trainer and checkpoints
    use (``to_master``, ``copy_to_model``, ``zero_model_grads``, ``state_dict``,
    ``load_state_dict``; ``sharded``, ``trainable``, ``global_index`` for ShardedMasterState on
    several ranks) plus :meth:`step`, which the StepUpdate calls instead of the optimizer, and
    :meth:`settle`, which whatever reads the weights, masters or optimizer state between two
    steps calls first (the update may still be running on the host: see the module docstring).

    Args:
        model: the model on its device, identical on every rank, not yet wrapped in DDP;
            modified in place (dtypes; each owner's trainable parameters become views of one
            flat buffer per dtype; forward pre-hooks on ``blocks``).
        dtype: the low-precision dtype (``torch.bfloat16``).
        chunk_mb: host-update pipeline granularity, in MB of bf16 gradients.
        host_ema: an EMA will be kept beside the masters (``ema.enabled``): the host-memory check
            counts its 4 B per owned parameter too.
        blocks: the modules whose forward waits for its own weights (:func:`forward_blocks`);
            None: ``forward_blocks(model)``; empty: every forward waits for the whole update.

    Attributes:
        overlap: the step returns while the host updates (one rank); False: it waits for the
            whole update, as before the overlap (several ranks; the tests' reference).

    Raises:
        ValueError: fewer trainable tensors than ranks.
        ConfigError: this node's ranks would not fit their shares (and the EMA's) in host memory.
    """

    offloaded = True

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, chunk_mb: float = 256.0,
                 host_ema: bool = False, blocks: Optional[Sequence[nn.Module]] = None):
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        self.sharded = distributed  # checkpoints: ShardedMasterState per rank, bf16 weights file
        keep = kept_fp32(model)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if len(self.trainable) < self.world_size:
            raise ValueError(f"optim.offload shards whole tensors: the model has {len(self.trainable)} trainable "
                             f"tensors for {self.world_size} ranks")
        self.device = self.trainable[0].device
        self.cuda = self.device.type == "cuda"
        self.owners = owners = partition([p.numel() for p in self.trainable], self.world_size)  # optim.shard_grads reads it
        cast_frozen(model, dtype, keep)
        self.chunk_elems = max(1, int(chunk_mb * 2**20 / 2))
        owned = [p.numel() for p, o in zip(self.trainable, owners) if o == self.rank]
        need = {"fp32 masters": 4 * sum(owned), "AdamW moments": 8 * sum(owned),
                "bf16 staging of gradients and weights": 2 * sum(owned),
                "fp32 gradient scratch of one chunk": 4 * scratch_elems(owned, self.chunk_elems)}
        if host_ema:  # allocated later (ddptrain/ema.py), checked now: before any of it is
            need["EMA of the weights (ema.enabled, beside the masters)"] = 4 * sum(owned)
        agree_on_host_memory(need, self.device, "optim.offload=cpu",
                             "turn optim.offload off" + (" or ema.enabled off" if host_ema else ""))
        self.buckets: list[_Bucket] = []
        for r in range(self.world_size):
            for kept in (False, True):
                group = [p for p, o in zip(self.trainable, owners) if o == r and (id(p) in keep) == kept]
                if group:
                    self.buckets.append(_Bucket(r, group, torch.float32 if kept else dtype, r == self.rank,
                                                self.cuda))
        self.own = [b for b in self.buckets if b.owner == self.rank]
        self._to_master, self.global_index = {}, {}
        index = {id(p): g for g, p in enumerate(self.trainable)}
        for b in self.own:
            for p, m in zip(b.params, b.masters):
                self._to_master[p] = m
                self.global_index[id(m)] = index[id(p)]
        self._bucket_of = {id(p): b for b in self.own for p in b.params}
        self._scratch = torch.empty(0, dtype=torch.float32)  # fp32 gradients of one chunk
        if self.cuda:
            self._down = torch.cuda.Stream(self.device)
            self._up = torch.cuda.Stream(self.device)
        # one rank: the gradients of the step's last backward leave the GPU as autograd finishes them
        self.streams = self.world_size == 1
        self.streaming = False  # StepUpdate.before_backward: on for the step's last micro-batch
        self._staged = {k: v for b in self.own for k, v in b.staged.items()}
        self._slot = {id(p): i for i, p in enumerate(self.trainable)}
        self._norms = torch.zeros(len(self.trainable), dtype=torch.float32, device=self.device)
        self._sent = [False] * len(self.trainable)  # this step's gradient is in the staging buffer
        self._twice: list = []  # parameters whose gradient came again after it was sent (this step)
        self._after_backward: set = set()  # parameters seen to get two gradients in one backward
        if self.streams:
            for p in self.trainable:
                p.register_post_accumulate_grad_hook(self._send)
        self.restored = False  # set when a checkpoint's masters were loaded (ShardedMasterState)
        # the update on the host, overlapped with the next forward (one rank)
        self.overlap = self.world_size == 1
        self._thread: Optional[threading.Thread] = None  # the worker of the update in flight
        self._error: Optional[BaseException] = None  # what the worker raised (raised again at every wait)
        self._error_seen = False
        self._steps = 0  # updates started, for the error message
        self.blocks = list(forward_blocks(model) if blocks is None else blocks)
        owned_ids = {id(p) for b in self.own for p in b.params}
        self._block_params = [list({id(p): p for p in m.parameters() if id(p) in owned_ids}.values())
                              for m in self.blocks]
        self._entered: list[int] = []  # blocks in the order the forward first entered them
        self._cut_final = False  # chunks cut in forward order (at the first step)
        self._block_chunks: list[list[_Chunk]] = [[] for _ in self.blocks]
        self._early: list[_Chunk] = []  # chunks of parameters outside every block: waited before the forward
        self._hooks = [m.register_forward_pre_hook(functools.partial(self._enter, i)) for i, m in enumerate(self.blocks)]
        self._members: Optional[tuple] = None  # (optimizer, chunk -> the masters of each of its param groups)
        self._cut([p for b in self.own for p in b.params])  # registration order until the forward shows its own

    @property
    def to_master(self) -> dict:
        """Model parameter -> its fp32 master on the host (this rank's own), after the update in flight."""
        self.settle()
        return self._to_master

    def host_bytes(self) -> int:
        """Host memory this rank holds for the offload (masters, moments, staging, scratch)."""
        owned = sum(b.master_flat.numel() for b in self.own)
        return owned * host_bytes_per_param() + self._scratch.numel() * 4

    # ------------------------------------------------------------------ the chunks, in forward order

    def _cut(self, order: list) -> None:
        """Chunks of whole tensors of one bucket each, cut along ``order`` once a chunk reaches
        ``chunk_elems``; they are updated in the order of their first tensor."""
        open_: dict[int, tuple[int, list, int]] = {}  # id(bucket) -> (first position, params, elements)
        cut: list[tuple[int, _Chunk]] = []
        for i, p in enumerate(order):
            b = self._bucket_of[id(p)]
            first, params, n = open_.get(id(b), (i, [], 0))
            params.append(p)
            n += p.numel()
            if n >= self.chunk_elems:
                cut.append((first, _Chunk(b, params, self._to_master)))
                open_.pop(id(b), None)
            else:
                open_[id(b)] = (first, params, n)
        cut += [(first, _Chunk(self._bucket_of[id(params[0])], params, self._to_master))
                for first, params, _ in open_.values()]
        self.chunks = [c for _, c in sorted(cut, key=lambda fc: fc[0])]
        for b in self.own:
            b.chunks = [c for c in self.chunks if c.bucket is b]
        largest = max((c.elems for c in self.chunks), default=0)
        if largest > self._scratch.numel():
            self._scratch = torch.empty(largest, dtype=torch.float32)
        for c in self.chunks:
            offset, c.grads = 0, []
            for m in c.masters:
                c.grads.append(self._scratch[offset:offset + m.numel()].view(m.shape))
                offset += m.numel()
        where = {id(p): c for c in self.chunks for p in c.params}
        self._block_chunks = [list({id(where[id(p)]): where[id(p)] for p in ps}.values()) for ps in self._block_params]
        inside = {id(p) for ps in self._block_params for p in ps}
        self._early = list({id(where[id(p)]): where[id(p)] for b in self.own for p in b.params
                            if id(p) not in inside}.values())
        self._members = None

    def _forward_order(self) -> list:
        """This rank's parameters as the forward uses them: those outside every block first (they
        are waited for before the forward starts), then each block's, in the order the forward
        entered the blocks (those it never entered last)."""
        inside = {id(p) for ps in self._block_params for p in ps}
        order = {id(p): p for b in self.own for p in b.params if id(p) not in inside}
        seen = dict.fromkeys(self._entered)
        for i in [*seen, *(i for i in range(len(self.blocks)) if i not in seen)]:
            order.update({id(p): p for p in self._block_params[i] if id(p) not in order})
        return list(order.values())

    def _enter(self, index: int, module: nn.Module, args) -> None:
        """Forward pre-hook of block ``index``: before the first step, note the order; while an
        update is in flight, wait for the chunks of this block's weights."""
        if not self._cut_final and index not in self._entered:
            self._entered.append(index)
        if self._thread is not None:
            for c in self._block_chunks[index]:
                self._wait(c)

    def _wait(self, c: _Chunk) -> None:
        """The forward may read chunk ``c``'s new weights from here on (the compute stream waits
        for its upload, which the host must have queued first)."""
        if c.waited:
            return
        c.ready.wait()
        self._raise()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(c.uploaded)
        c.waited = True

    def before_forward(self) -> None:
        """Called before each training forward: wait for the weights no block's hook covers
        (everything without blocks)."""
        if self._thread is None:
            return
        if not self.blocks:
            self.settle()
            return
        for c in self._early:
            self._wait(c)

    # ------------------------------------------------------------------ the gradients

    @torch.no_grad()
    def _send(self, p: torch.Tensor) -> None:
        """Autograd has finished ``p.grad`` for this backward: on the step's last one, take its norm,
        queue its copy to the staging buffer and free it on the GPU."""
        if not self.streaming or id(p) in self._after_backward:
            return
        self.settle()  # the staging buffer is the last update's until it has finished
        i = self._slot[id(p)]
        if self._sent[i]:  # a second gradient in this backward: grad_norm() adds it on the host
            self._twice.append(p)
            return
        g = p.grad
        self._norms[i] = torch.linalg.vector_norm(g, 2, dtype=torch.float32)
        if self.cuda:
            self._down.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._down):
                self._staged[id(p)].copy_(g, non_blocking=True)
            g.record_stream(self._down)  # its memory is not reused before the copy has read it
        else:
            self._staged[id(p)].copy_(g)
        self._sent[i] = True
        p.grad = None

    def sent(self) -> bool:
        """Some of this step's gradients left the GPU during the backward."""
        return any(self._sent)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The gradient norm (fp32, on the device) when some gradients were sent during the
        backward: theirs as taken then, the rest's (still on the GPU) now, in parameter order."""
        self.settle()
        for p in dict.fromkeys(self._twice):  # rare: add the late part on the host, as bf16 on the GPU would
            if self.cuda:
                self._down.synchronize()
            view = self._staged[id(p)]
            view.copy_(view.float() + p.grad.to("cpu", torch.float32))
            self._norms[self._slot[id(p)]] = torch.linalg.vector_norm(view, 2, dtype=torch.float32).to(self.device)
            self._after_backward.add(id(p))  # from the next step on, downloaded after the backward
            p.grad = None
        self._twice.clear()
        left = [p for p in self.trainable if p.grad is not None]
        if left:
            norms = torch._foreach_norm([p.grad for p in left], 2, dtype=torch.float32)
            self._norms[[self._slot[id(p)] for p in left]] = torch.stack(norms)
        return torch.linalg.vector_norm(self._norms)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        """One optimizer step on the host for this rank's masters, gradients x ``factor`` (the
        StepUpdate's normalisation and clipping); then the new weights back on every rank.

        Called only for a finite step: a skipped one never reaches the host. With ``overlap``
        (one rank) it returns while a worker thread updates the chunks in forward order; the
        next forward's blocks wait for their own chunks, anything else calls :meth:`settle`.

        Raises:
            RuntimeError: the previous update failed on the host (its error chained).
        """
        self.settle()
        if not self._cut_final:  # the first step: the forward has shown the order it uses the weights in
            self._cut(self._forward_order())
            self._cut_final = True
        chunks = self.chunks
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self._down.wait_stream(compute)  # the gradients are complete (and all-reduced)
            self._down.wait_stream(self._up)  # the staging buffer's last upload has left
        for c in chunks:  # every download queued at once, in update order: they run while the host works
            with torch.cuda.stream(self._down) if self.cuda else contextlib.nullcontext():
                for p in c.params:
                    if self._sent[self._slot[id(p)]]:
                        continue  # copied during the backward
                    view = self._staged[id(p)]
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad, non_blocking=self.cuda)
                if self.cuda:
                    c.landed = torch.cuda.Event()
                    c.landed.record(self._down)
                    c.uploaded = torch.cuda.Event()
            c.ready, c.waited = threading.Event(), False
        if self._members is None or self._members[0] is not optimizer:
            ids = [set(map(id, g["params"])) for g in optimizer.param_groups]
            self._members = (optimizer, [[[m for m in c.masters if id(m) in g] for g in ids] for c in chunks])
        # the hyperparameters of this step, as they are now: the scheduler changes the real ones next
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        groups = [[dict(h, params=ms) for h, ms in zip(hyper, per_group)] for per_group in self._members[1]]
        shadow = object.__new__(type(optimizer))  # the optimizer's state, hooks and defaults; its own groups
        shadow.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})  # not a scheduler's wrapper
        optimizer._opt_called = True  # what the LR scheduler's wrapper of optimizer.step would have noted
        self._steps += 1
        self._thread = threading.Thread(target=self._update, args=(chunks, groups, shadow, factor),
                                        name=f"ddptrain-offload-step{self._steps}")
        self._thread.start()
        if not self.overlap:
            self.settle()
        self._broadcast()

    def _update(self, chunks: list, groups: list, shadow: torch.optim.Optimizer, factor: float) -> None:
        """The worker thread: each chunk's host update and upload, in order; marks each ready."""
        try:
            grad_scale = torch.full((), 1.0 / factor, dtype=torch.float32)
            with torch.no_grad(), torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
                for c, gs in zip(chunks, groups):
                    if self.cuda:
                        c.landed.synchronize()
                    b = c.bucket
                    for start, end, pos in c.runs:  # widened to fp32 (multi-threaded copies)
                        self._scratch[pos:pos + end - start].copy_(b.staging[start:end])
                    for m, g in zip(c.masters, c.grads):
                        m.grad = g
                    shadow.param_groups = gs
                    _step(shadow, grad_scale, factor)
                    for m in c.masters:
                        m.grad = None
                    for start, end, _ in c.runs:
                        b.staging[start:end].copy_(b.master_flat[start:end])  # rounded to the model dtype
                        if self.cuda:
                            with torch.cuda.stream(self._up):
                                b.flat[start:end].copy_(b.staging[start:end], non_blocking=True)
                        else:
                            b.flat[start:end].copy_(b.staging[start:end])
                    if self.cuda:
                        c.uploaded.record(self._up)
                    c.ready.set()
        except BaseException as e:  # raised in the training thread at its next wait
            self._error = e
        finally:
            for c in chunks:
                c.ready.set()  # nobody waits forever: they find the error

    def _raise(self) -> None:
        if self._error is not None:
            self._error_seen = True
            raise RuntimeError(f"optim.offload=cpu: the host update of the optimizer (update {self._steps}) failed "
                               f"on its worker thread; the masters are part-updated and this run cannot go on: "
                               f"{self._error!r}") from self._error

    def settle(self) -> None:
        """Wait until the update in flight has finished: every master, moment and weight is the
        step's (on the GPU: the compute stream waits for the last upload). Cheap when none is.

        Raises:
            RuntimeError: the update failed on its worker thread (its error chained), at this and
                every later wait.
        """
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._up)  # the next forward reads the new weights
        self._raise()

    def close(self) -> None:
        """Finish the update in flight (no thread is left running) and remove the forward hooks.

        Raises:
            RuntimeError: the update failed and no wait has raised it yet.
        """
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if not self._error_seen:
            self._raise()

    def _broadcast(self) -> None:
        if self.world_size > 1:
            works = [dist.broadcast(b.flat, src=b.owner, async_op=True) for b in self.buckets]
            for w in works:
                w.wait()

    # ------------------------------------------------------------------ the MasterWeights interface

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round every owned master into the model (all chunks), then broadcast the partitions."""
        self.settle()
        for b in self.own:
            b.staging.copy_(b.master_flat)
            b.flat.copy_(b.staging, non_blocking=False)
        self._broadcast()

    def load_grads(self, factor, owned=None) -> None:  # pragma: no cover - the step reads the grads itself
        raise RuntimeError("OffloadedMasters reads the gradients in step(); load_grads is not used")

    def zero_model_grads(self) -> None:
        """Drop this step's gradients (on the GPU and those sent to the host); the update in
        flight, if any, has read its own already."""
        for p in self.trainable:
            p.grad = None
        self.streaming = False
        self._sent = [False] * len(self.trainable)
        self._twice.clear()
        self._norms.zero_()

    def _masters_by_storage(self) -> dict:
        return {p.data_ptr(): m for p, m in self.to_master.items()}

    def state_dict(self, module: nn.Module) -> dict:
        """One rank: the model's state dict with the fp32 masters in place of the bf16 weights
        (as :class:`~ddptrain.precision.MasterWeights`); several: the bf16 state dict (the
        masters travel in each rank's ShardedMasterState)."""
        self.settle()
        if self.sharded:
            return module.state_dict()
        masters = self._masters_by_storage()
        return {k: masters[v.data_ptr()].detach() if v.data_ptr() in masters and v.numel() else v
                for k, v in module.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, saved: dict, module: nn.Module) -> None:
        """The masters from saved full-precision weights (unless a checkpoint's own masters were
        restored), then the model's weights from the masters."""
        self.settle()
        if not self.restored:
            masters = self._masters_by_storage()
            for k, v in module.state_dict().items():
                if v.data_ptr() in masters and v.numel() and k in saved:
                    masters[v.data_ptr()].copy_(saved[k])
        self.copy_to_model()


def _step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor, factor: float) -> None:
    """``optimizer.step()`` on gradients x ``factor``: fused kernels take ``grad_scale`` (its
    reciprocal, as the on-device fused step does); the others get their gradients multiplied
    first, as :meth:`MasterWeights.load_grads` does on the device (the same rounding)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale = grad_scale
        optimizer.found_inf = torch.zeros((), dtype=torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    else:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
        optimizer.step()


def prepare(model: nn.Module, chunk_mb: float, device: torch.device, host_ema: bool = False,
            regions: Sequence[str] = (), hooks: bool = True) -> OffloadedMasters:
    """:class:`OffloadedMasters` for ``model``, after checking that pinned memory works on this
    machine and that the host can hold every local rank's share (with the EMA's: ``host_ema``).

    Args:
        regions: names of the modules regional compile or recompute run as one unit (the
            forward hooks go on them or around them: :func:`forward_blocks`).
        hooks: False under a whole-model compile (hooks would be traced): every forward then
            waits for the whole update.

    Raises:
        ConfigError: no pinned memory, or too little host memory: before anything is allocated.
    """
    if device.type == "cuda":
        try:
            torch.empty(1, pin_memory=True)
        except RuntimeError as e:
            raise ConfigError(f"optim.offload=cpu needs pinned host memory, which fails here ({e}); "
                              "set optim.offload=none") from e
    blocks = forward_blocks(model, regions) if hooks else []
    return OffloadedMasters(model, torch.bfloat16, chunk_mb, host_ema, blocks)
