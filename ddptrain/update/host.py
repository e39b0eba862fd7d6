"""Optimizer offload: the fp32 masters and AdamW state live in (pinned) host memory.

With ``optim.offload: cpu`` (and ``trainer.param_dtype: bf16``) the GPU keeps only the bf16
weights and their bf16 gradients: 4 B per trainable parameter instead of the 16 of
:class:`ddptrain.precision.MasterWeights`, or ``2 + 2/N`` with sharded gradients. Each rank
holds the masters of its own partition only (the whole-tensor partition of
ddptrain/update/sharded.py), so the host of a node holds each master once.

How a step goes, once the StepUpdate has all-reduced the step's verdict (finite? the
normalisation-and-clipping factor?) and read it on the host:

1. The owned bf16 gradients are copied to a pinned bf16 staging buffer on a side stream, chunk
   by chunk (``optim.offload_chunk_mb``), all queued at once. On one rank most of them are there
   already: during the step's last backward each gradient is copied down (and its norm taken) as
   soon as autograd has finished it, and freed on the GPU, so the GPU never holds all of them.
2. For each chunk, as soon as its copy has landed: the host widens the gradients to fp32, runs
   the optimizer's own step (torch's fused CPU AdamW, multi-threaded) over that chunk's masters
   with the factor as its ``grad_scale``, rounds the updated masters into the staging buffer and
   queues their copy back to the GPU on a second side stream. So chunk ``i``'s host update runs
   while chunk ``i+1``'s gradients arrive and chunk ``i-1``'s weights leave.
3. The compute stream waits for the last upload; on several ranks each owner's flat buffer is
   then broadcast as with sharded masters.

Why the update waits for the end of the backward: it needs the global gradient norm (clipping)
and the all-ranks finite check, which exist only once every gradient does; an update started
earlier would be stale or inexact. A non-finite step is skipped before the host updates anything.
Only the copies start early, and only on one rank: with several, a gradient is final once DDP (or
the sharded reducer) has reduced it, which the gradient hooks do not see. A parameter whose
gradient arrives twice in one backward (reentrant checkpointing) has the second part added on the
host, bf16 as the GPU would, and is downloaded after the backward from then on.

Why the optimizer's own step per chunk (its param groups narrowed to the chunk for the call):
its state is then plain AdamW state, so checkpoints have the format of the on-GPU path and a run
may resume with offload on or off. On one rank the weights file holds the fp32 masters (as
MasterWeights'); on several (with ``optim.zero: true``, which the Trainer asks for), the bf16
weights plus each rank's ShardedMasterState, as the sharded masters save them.

Which kernel: ``optim.fused: auto`` picks the on-device update's (ddptrain/optim.py): on a CPU
device foreach AdamW on both paths, with the factor multiplied in as the on-device path does, so
the offloaded update is bitwise the on-device one with any ``optim.fused``. On a GPU the host
runs torch's fused CPU AdamW and the device torch's fused CUDA AdamW (or the Triton kernel of
``optim.fused_update``): the same arithmetic on other hardware, equal to fp32 rounding, not
bitwise (bench/check_offload.py: losses within 6.1e-5 relative over 20 steps).

Host memory per owned parameter: 4 (master) + 8 (AdamW moments) + 2 (bf16 staging), plus fp32
gradient scratch of the largest chunk (:func:`scratch_elems`), and 4 more with ``ema.enabled`` (its EMA lives beside the masters):
every rank checks before allocating that its node holds all of its ranks' shares (process.py's
``agree_on_host_memory``). On a CPU run (the tests) the same code runs without streams.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

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
    """The most fp32 gradient scratch one rank's chunks can need: a chunk is closed once it
    reaches ``chunk_elems``, so it holds less than that plus one tensor, and never more than what
    the rank owns (``owned``: its tensors' sizes)."""
    return min(sum(owned), chunk_elems - 1 + max(owned)) if owned else 0


class _Chunk:
    """A run of whole tensors of one flat buffer: ``[start, end)`` elements, and its params."""

    __slots__ = ("start", "end", "params", "masters", "landed")

    def __init__(self, start: int, end: int, params: list, masters: list):
        self.start, self.end, self.params, self.masters = start, end, params, masters
        self.landed = None  # CUDA event: this step's gradients of the chunk are on the host


class _Bucket:
    """One owner's trainable tensors of one dtype: a flat device buffer the parameters are views
    of (one broadcast, one upload per chunk), and, for this rank's own buckets, the pinned host
    masters and staging buffer in the same layout."""

    def __init__(self, owner: int, params: list, dtype: torch.dtype, own: bool, pin: bool, chunk_elems: int):
        self.owner, self.dtype = owner, dtype
        device = params[0].device
        total = sum(p.numel() for p in params)
        self.chunks: list[_Chunk] = []
        self.masters: list[nn.Parameter] = []
        self.staged: dict[int, torch.Tensor] = {}  # id(param) -> its gradient's place in the staging buffer
        if own:
            self.master_flat = torch.empty(total, dtype=torch.float32, pin_memory=pin)
            self.staging = torch.empty(total, dtype=dtype, pin_memory=pin)
        # The parameters pass through the host (rounded there, as the GPU would) and leave the GPU
        # before the flat buffer is allocated, so it never holds them at full precision beside it.
        rounded = self.staging if own else torch.empty(total, dtype=dtype)
        shapes = [p.shape for p in params]
        offset, start, run, run_masters = 0, 0, [], []
        with torch.no_grad():
            for p in params:
                n = p.numel()
                if own:  # the master from the parameter at full precision, before it is rounded
                    view = self.master_flat[offset:offset + n].view(p.shape)
                    view.copy_(p.detach())
                    rounded[offset:offset + n].copy_(view.view(-1))
                    master = nn.Parameter(view)
                    self.masters.append(master)
                    run_masters.append(master)
                    self.staged[id(p)] = self.staging[offset:offset + n].view(p.shape)
                else:
                    rounded[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = torch.empty(0, dtype=dtype, device=device)  # the old storage is freed here
                run.append(p)
                offset += n
                if own and offset - start >= chunk_elems:
                    self.chunks.append(_Chunk(start, offset, run, run_masters))
                    start, run, run_masters = offset, [], []
            if own and run:
                self.chunks.append(_Chunk(start, offset, run, run_masters))
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
    several ranks) plus :meth:`step`, which the StepUpdate calls instead of the optimizer.

    Args:
        model: the model on its device, identical on every rank, not yet wrapped in DDP;
            modified in place (dtypes; each owner's trainable parameters become views of one
            flat buffer per dtype).
        dtype: the low-precision dtype (``torch.bfloat16``).
        chunk_mb: host-update pipeline granularity, in MB of bf16 gradients.
        host_ema: an EMA will be kept beside the masters (``ema.enabled``): the host-memory check
            counts its 4 B per owned parameter too.

    Raises:
        ValueError: fewer trainable tensors than ranks.
        ConfigError: this node's ranks would not fit their shares (and the EMA's) in host memory.
    """

    offloaded = True

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, chunk_mb: float = 256.0,
                 host_ema: bool = False):
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
        chunk_elems = max(1, int(chunk_mb * 2**20 / 2))
        owned = [p.numel() for p, o in zip(self.trainable, owners) if o == self.rank]
        need = {"fp32 masters": 4 * sum(owned), "AdamW moments": 8 * sum(owned),
                "bf16 staging of gradients and weights": 2 * sum(owned),
                "fp32 gradient scratch of one chunk": 4 * scratch_elems(owned, chunk_elems)}
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
                                                self.cuda, chunk_elems))
        self.own = [b for b in self.buckets if b.owner == self.rank]
        self.to_master, self.global_index = {}, {}
        index = {id(p): g for g, p in enumerate(self.trainable)}
        for b in self.own:
            for c in b.chunks:
                for p, m in zip(c.params, c.masters):
                    self.to_master[p] = m
                    self.global_index[id(m)] = index[id(p)]
        largest = max((c.end - c.start for b in self.own for c in b.chunks), default=0)
        self._scratch = torch.empty(largest, dtype=torch.float32, pin_memory=False)  # fp32 gradients of one chunk
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

    def host_bytes(self) -> int:
        """Host memory this rank holds for the offload (masters, moments, staging, scratch)."""
        owned = sum(b.master_flat.numel() for b in self.own)
        return owned * host_bytes_per_param() + self._scratch.numel() * 4

    # ------------------------------------------------------------------ the gradients

    @torch.no_grad()
    def _send(self, p: torch.Tensor) -> None:
        """Autograd has finished ``p.grad`` for this backward: on the step's last one, take its norm,
        queue its copy to the staging buffer and free it on the GPU."""
        if not self.streaming or id(p) in self._after_backward:
            return
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

        Called only for a finite step: a skipped one never reaches the host.
        """
        chunks = [(b, c) for b in self.own for c in b.chunks]
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self._down.wait_stream(compute)  # the gradients are complete (and all-reduced)
            self._down.wait_stream(self._up)  # the staging buffer's last upload has left
        for b, c in chunks:  # every download queued at once: they run while the host works
            with torch.cuda.stream(self._down) if self.cuda else contextlib.nullcontext():
                offset = c.start
                for p in c.params:
                    view = b.staging[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    if self._sent[self._slot[id(p)]]:
                        continue  # copied during the backward
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad, non_blocking=self.cuda)
                if self.cuda:
                    c.landed = torch.cuda.Event()
                    c.landed.record(self._down)
        grad_scale = torch.full((), 1.0 / factor, dtype=torch.float32)
        groups = optimizer.param_groups
        saved = [g["params"] for g in groups]
        member = [set(map(id, ps)) for ps in saved]
        try:
            for b, c in chunks:
                if self.cuda:
                    c.landed.synchronize()
                n = c.end - c.start
                scratch = self._scratch[:n]
                scratch.copy_(b.staging[c.start:c.end])  # widened to fp32 (multi-threaded copy)
                offset = 0
                for m in c.masters:
                    m.grad = scratch[offset:offset + m.numel()].view(m.shape)
                    offset += m.numel()
                for g, ids in zip(groups, member):
                    g["params"] = [m for m in c.masters if id(m) in ids]
                _step(optimizer, grad_scale, factor)
                for m in c.masters:
                    m.grad = None
                b.staging[c.start:c.end].copy_(b.master_flat[c.start:c.end])  # rounded to the model dtype
                if self.cuda:
                    with torch.cuda.stream(self._up):
                        b.flat[c.start:c.end].copy_(b.staging[c.start:c.end], non_blocking=True)
                else:
                    b.flat[c.start:c.end].copy_(b.staging[c.start:c.end])
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps
        if self.cuda:
            compute.wait_stream(self._up)  # the next forward reads the new weights
        self._broadcast()

    def _broadcast(self) -> None:
        if self.world_size > 1:
            works = [dist.broadcast(b.flat, src=b.owner, async_op=True) for b in self.buckets]
            for w in works:
                w.wait()

    # ------------------------------------------------------------------ the MasterWeights interface

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round every owned master into the model (all chunks), then broadcast the partitions."""
        for b in self.own:
            b.staging.copy_(b.master_flat)
            b.flat.copy_(b.staging, non_blocking=False)
        self._broadcast()

    def load_grads(self, factor, owned=None) -> None:  # pragma: no cover - the step reads the grads itself
        raise RuntimeError("OffloadedMasters reads the gradients in step(); load_grads is not used")

    def zero_model_grads(self) -> None:
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
        if self.sharded:
            return module.state_dict()
        masters = self._masters_by_storage()
        return {k: masters[v.data_ptr()].detach() if v.data_ptr() in masters and v.numel() else v
                for k, v in module.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, saved: dict, module: nn.Module) -> None:
        """The masters from saved full-precision weights (unless a checkpoint's own masters were
        restored), then the model's weights from the masters."""
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


def prepare(model: nn.Module, chunk_mb: float, device: torch.device, host_ema: bool = False) -> OffloadedMasters:
    """:class:`OffloadedMasters` for ``model``, after checking that pinned memory works on this
    machine and that the host can hold every local rank's share (with the EMA's: ``host_ema``).

    Raises:
        ConfigError: no pinned memory, or too little host memory: before anything is allocated.
    """
    if device.type == "cuda":
        try:
            torch.empty(1, pin_memory=True)
        except RuntimeError as e:
            raise ConfigError(f"optim.offload=cpu needs pinned host memory, which fails here ({e}); "
                              "set optim.offload=none") from e
    return OffloadedMasters(model, torch.bfloat16, chunk_mb, host_ema)
