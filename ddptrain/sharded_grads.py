"""Sharded gradients (ZeRO-2 style): each rank ends the backward with the reduced gradients of
the tensors it owns only.

With ``optim.shard_grads: true`` (and ``optim.zero: true``, ``trainer.param_dtype: bf16``) on
N > 1 ranks, the Trainer wraps the model in :class:`ShardedGradReducer` instead of DDP. Under
DDP every rank all-reduces, and keeps, the whole bf16 gradient (2 B per parameter), though with
sharded masters (ddptrain/update/sharded.py) a rank only ever reads the gradients of its own
partition. Here each gradient is sent to its owner and freed: model state becomes
``2 + 2/N + 12/N`` B per trainable parameter instead of ``2 + 2 + 12/N``.

How a backward goes:

1. The trainable tensors are grouped, in backward order, into buckets of at most
   ``dist.bucket_cap_mb``, each of one owner (and one dtype); a tensor of at least that size has
   a bucket of its own. The order is first the reverse of ``model.parameters()``, then the order
   rank 0's first backward produced its gradients in (DDP rebuilds its buckets the same way).
2. A post-accumulate-grad hook takes each gradient out of ``p.grad`` into its bucket. When the
   bucket's last one arrives, they are multiplied by ``1/N`` (DDP's average, with DDP's own
   multiply) into one flat buffer, or, for a bucket of one tensor, in place with no copy.
3. When a bucket is complete, and every bucket before it has been sent, ``dist.reduce(bucket,
   dst=owner)`` starts, overlapped with the rest of the backward. Buckets start in one fixed order
   on every rank, so the collectives match whatever order this rank's gradients came in.
   Reduce-to-owner, not reduce_scatter: the partition is by whole tensors, so a bucket has one
   destination; NCCL and gloo both run ``reduce`` asynchronously.
4. A bucket is retired once at most ``IN_FLIGHT`` newer ones are in flight, and at the end of
   the backward (an autograd engine callback, as DDP's): the owner's parameters get their
   gradients as views of the reduced bucket, or add it to what earlier micro-batches of the step
   left; a non-owner frees the bucket.

Gradient accumulation: every micro-batch is reduced (ZeRO-2's choice), so memory stays ``2/N``
through the accumulation; :meth:`ShardedGradReducer.no_sync` exists for the Trainer's loop and
only keeps DDP's buffer-broadcast timing. The sum of the reduced micro-batches equals DDP's reduced
sum up to bf16 rounding (DDP adds the micro-batches locally, then reduces once); with one
micro-batch per step the gradients are DDP's bit for bit on 2 ranks.

Buffers (``dist.broadcast_buffers``): broadcast from rank 0 before the first forward and before
every forward whose predecessor ran with grad enabled outside ``no_sync``, as DDP does (with
accumulation: once per step, at its first micro-batch). That keeps BatchNorm running statistics
DDP's bit for bit.

Memory per rank, beyond the owned gradients (``2/N`` B per parameter): the gradients that have
arrived for buckets not yet complete (at most one such bucket per owner and dtype when the
gradients come in rank 0's order, each under ``dist.bucket_cap_mb``), the buckets in flight
(``IN_FLIGHT``, and the one being started), and a bucket's pieces while they are copied into its
flat buffer. That staging does not grow with the model (``peak_staged`` counts it; a 2048-wide
transformer stack, whose 32 MB weights are buckets of their own: three of them, at any N). After
the optimizer step nothing is kept: at rest a rank holds no gradient memory at all, where DDP
keeps its 2 B/param buckets.

Not supported: ``dist.find_unused_parameters`` (refused by the config: every trainable parameter
must get a gradient in every backward, and a missing one is an error naming it),
``dist.comm_hook`` (refused: gradients travel in their own dtype), and, as with DDP, reentrant
activation checkpointing (``torch.utils.checkpoint(use_reentrant=True)``: a backward inside the
backward); ddptrain's own recompute is not reentrant.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

# torch's lazy form of torch.compiler.disable imports torch._dynamo at the first call, not with
# ddptrain (~1-2 s of every process's start; tests/test_import_time.py)
_disable_dynamo = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable

IN_FLIGHT = 2  # buckets whose reduce may still run when the next one starts (more: more staging memory)


class _Bucket:
    """Tensors of one owner and dtype, in backward order. Their gradients wait as autograd made
    them (``pieces``) until the last one arrives; the flat buffer exists from then until the
    bucket is retired."""

    def __init__(self, owner: int, indices: list[int], params: Sequence[nn.Parameter]):
        self.owner, self.indices = owner, indices
        self.dtype, self.device = params[indices[0]].dtype, params[indices[0]].device
        self.offsets, self.numel = {}, 0
        for i in indices:
            self.offsets[i] = self.numel
            self.numel += params[i].numel()
        self.pending = len(indices)
        self.pieces: list[tuple[int, torch.Tensor]] = []
        self.buffer: Optional[torch.Tensor] = None
        self.work = None


def plan_buckets(order: Sequence[int], params: Sequence[nn.Parameter], owners: Sequence[int],
                 cap_bytes: int) -> list[_Bucket]:
    """Buckets of at most ``cap_bytes``, or of one larger tensor (then sent in place, with no
    copy), each of one owner and dtype, in the order they complete if the gradients arrive in
    ``order``."""
    position = {i: pos for pos, i in enumerate(order)}
    open_: dict[tuple, tuple[list[int], int]] = {}  # (owner, dtype) -> (indices, bytes)
    done: list[list[int]] = []
    for i in order:
        key, size = (owners[i], params[i].dtype), params[i].numel() * params[i].element_size()
        if size >= cap_bytes:  # alone, and the smaller tensors around it go on filling their bucket
            done.append([i])
            continue
        group, total = open_.pop(key, ([], 0))
        if group and total + size > cap_bytes:
            done.append(group)
            group, total = [], 0
        group.append(i)
        total += size
        if total >= cap_bytes:
            done.append(group)
        else:
            open_[key] = (group, total)
    done += [group for group, _ in open_.values()]
    return [_Bucket(owners[g[0]], g, params) for g in sorted(done, key=lambda g: position[g[-1]])]


class ShardedGradReducer(nn.Module):
    """The model, wrapped like DDP (``.module``, ``forward``, ``no_sync``), whose backward leaves
    each rank the averaged gradients of the tensors it owns and no others.

    Args:
        module: the model, identical on every rank, its trainable parameters already in their
            final dtype and storage (after :class:`~ddptrain.update.sharded.ShardedMasterWeights`).
        owners: the owner rank of each trainable parameter, in ``module.parameters()`` order
            (``ShardedMasterWeights.owners``).
        bucket_cap_mb: ``dist.bucket_cap_mb``.
        broadcast_buffers: ``dist.broadcast_buffers``.

    Raises:
        ValueError: no process group, or ``owners`` does not match the trainable parameters.
    """

    def __init__(self, module: nn.Module, owners: Sequence[int], bucket_cap_mb: float = 25.0,
                 broadcast_buffers: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("ShardedGradReducer needs a process group (optim.shard_grads with several ranks)")
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in module.parameters() if p.requires_grad]
        if len(owners) != len(self.params):
            raise ValueError(f"{len(owners)} owners for {len(self.params)} trainable parameters")
        self.owners = list(owners)
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = [names[id(p)] for p in self.params]
        self.cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        self.buckets = plan_buckets(range(len(self.params))[::-1], self.params, self.owners, self.cap_bytes)
        self._index_buckets()
        self.buffers_to_sync = [b for b in module.buffers() if b.numel()] if broadcast_buffers else []
        self._sync_buffers = True  # DDP's require_forward_param_sync: the first forward broadcasts
        self._in_no_sync = False
        self._rebuilt = False  # the buckets follow rank 0's first backward once it has run
        self._arrivals: list[int] = []
        self._armed = False  # set by a forward with grad enabled: a backward of another graph is left alone
        self._queued = False
        self._next = 0  # the next bucket to start
        self._in_flight: deque = deque()
        self._held: dict[int, torch.Tensor] = {}  # owned gradients of earlier micro-batches of this step
        self._got: list[bool] = []  # which tensors' gradients this backward has produced
        self.staged = 0  # elements in bucket buffers that are not (yet) this rank's gradients
        self.peak_staged = 0  # the most of them at once since the last reset_peak()
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _index_buckets(self) -> None:
        self._bucket_of = {i: b for b in self.buckets for i in b.indices}

    # ------------------------------------------------------------------ the DDP-like surface

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's accumulation context, for the Trainer's loop: the gradients are reduced anyway
        (that is what keeps them at 2/N bytes per parameter); only the buffer broadcast follows
        DDP (skipped in the forward after one under ``no_sync``)."""
        before, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = before

    def forward(self, *args, **kwargs):
        self._pre_forward()
        return self.module(*args, **kwargs)

    @_disable_dynamo  # a whole-model torch.compile traces only the module's own forward
    def _pre_forward(self) -> None:
        if torch.is_grad_enabled():
            self._arm()
        if self.buffers_to_sync and self._sync_buffers:
            self._broadcast_buffers()
        self._sync_buffers = torch.is_grad_enabled() and not self._in_no_sync

    def reset_peak(self) -> None:
        self.peak_staged = self.staged

    # ------------------------------------------------------------------ one backward

    def _arm(self) -> None:
        """Before a forward whose backward reduces: take back the owned gradients earlier
        micro-batches left in ``p.grad`` (the new local ones must not be added to them)."""
        if self._in_flight:
            raise RuntimeError("a forward started while the previous backward's reduces are still in flight")
        self._held = {}
        for i, p in enumerate(self.params):
            if self.owners[i] == self.rank and p.grad is not None:
                self._held[i] = p.grad
                p.grad = None
        self._armed, self._queued, self._next = True, False, 0
        self._got = [False] * len(self.params)
        for b in self.buckets:
            b.pending, b.pieces, b.buffer, b.work = len(b.indices), [], None, None

    def _hook(self, i: int):
        @torch.no_grad()
        def hook(p: torch.Tensor) -> None:
            if not self._armed:  # a backward this wrapper's forward did not start: plain local gradients
                return
            if not self._queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._queued = True
            if p.grad.is_sparse:
                raise RuntimeError(f"{self.names[i]}: sparse gradients are not supported by optim.shard_grads")
            self._got[i] = True
            if not self._rebuilt:
                self._arrivals.append(i)
            b = self._bucket_of[i]
            b.pieces.append((i, p.grad))  # not copied yet: a bucket still filling holds only what arrived
            self._stage(p.numel())
            p.grad = None  # the bucket holds it now: freed once sent, not at the end of the backward
            b.pending -= 1
            if b.pending == 0:
                self._pack(b)
            self._start_ready()

        return hook

    def _pack(self, b: _Bucket) -> None:
        """The complete bucket's gradients times ``1/N`` (DDP's average, with DDP's multiply:
        the Reducer's mul_out by 1/world_size) in one flat buffer; a bucket of one tensor is
        scaled and sent in place, with no copy."""
        scale = 1.0 / self.world_size
        if len(b.pieces) == 1 and b.pieces[0][1].is_contiguous():
            b.buffer = b.pieces[0][1].mul_(scale).view(-1)
        else:
            b.buffer = torch.empty(b.numel, dtype=b.dtype, device=b.device)
            self._stage(b.numel)  # the copy and its pieces, for a moment
            for i, grad in b.pieces:
                torch.mul(grad, scale, out=b.buffer[b.offsets[i]:b.offsets[i] + grad.numel()].view(grad.shape))
            self._stage(-b.numel)
        b.pieces = []

    def _start_ready(self) -> None:
        """Start every complete bucket whose predecessors have all started (the same order on
        every rank, so the collectives pair up); retire the oldest beyond ``IN_FLIGHT``."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            b.work = dist.reduce(b.buffer, dst=b.owner, async_op=True)
            self._in_flight.append(b)
            self._next += 1
            while len(self._in_flight) > IN_FLIGHT:
                self._retire(self._in_flight.popleft())

    def _retire(self, b: _Bucket) -> None:
        """Wait for the bucket's reduce (on NCCL: the compute stream waits, the host does not);
        the owner keeps the sum as its gradients, everyone else frees the bucket."""
        b.work.wait()
        if b.owner == self.rank:
            for i in b.indices:
                p = self.params[i]
                view = b.buffer[b.offsets[i]:b.offsets[i] + p.numel()].view(p.shape)
                # a later micro-batch adds into the step's gradient; the first one's bucket becomes it
                p.grad = self._held.pop(i).add_(view) if i in self._held else view
        self._stage(-b.numel)
        b.buffer, b.work = None, None

    def _finish(self) -> None:
        """End of the backward: every bucket started and retired; on the first backward, the
        buckets are re-planned in rank 0's gradient order."""
        self._armed = False
        if self._next < len(self.buckets):
            missing = [self.names[i] for i, got in enumerate(self._got) if not got]
            raise RuntimeError(
                f"rank {self.rank}: trainable parameters got no gradient in this backward: {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}. optim.shard_grads reduces every trainable parameter "
                "in every backward (dist.find_unused_parameters is not supported with it): freeze parameters "
                "the loss does not use (requires_grad=False), or set optim.shard_grads=false")
        while self._in_flight:
            self._retire(self._in_flight.popleft())
        if not self._rebuilt:
            self._rebuild()

    def _rebuild(self) -> None:
        order = [self._arrivals] if self.rank == 0 else [None]
        dist.broadcast_object_list(order, src=0)
        self.buckets = plan_buckets(order[0], self.params, self.owners, self.cap_bytes)
        self._index_buckets()
        self._rebuilt, self._arrivals = True, []

    # ------------------------------------------------------------------ helpers

    def _stage(self, numel: int) -> None:
        self.staged += numel
        self.peak_staged = max(self.peak_staged, self.staged)

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank, one flat broadcast per dtype (DDP's buffer sync)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.buffers_to_sync:
            by_dtype.setdefault(b.dtype, []).append(b)
        for group in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in group])
            dist.broadcast(flat, src=0)
            torch._foreach_copy_(group, [v.view_as(b) for v, b in zip(flat.split([b.numel() for b in group]), group)])
