"""ZeRO for a bf16 model: each rank keeps the fp32 masters (and Adam state) of its own partition.

With ``trainer.param_dtype: bf16`` and ``optim.zero: true`` on N > 1 ranks. Per trainable
parameter a rank then holds 2 B (bf16 weight) + 2 B (bf16 gradient) + 12/N B (its share of the
fp32 masters and the two Adam moments): ``4 + 12/N`` (DeepSpeed ZeRO-1's bf16 figure), where
:class:`ddptrain.precision.MasterWeights` under ZeroRedundancyOptimizer kept every master on
every rank (``8 + 8/N``). A 10.3B-parameter model on 2 GPUs: 103 GB of model state instead of 124.

How a step goes (the sharded backend, ddptrain/update/backend.py, drives it through the MasterWeights interface):

1. DDP all-reduces the bf16 gradients as usual: every rank has the full, true gradient, so the
   global-norm clip and the non-finite check need nothing new. (With ``optim.shard_grads``,
   ddptrain/sharded_grads.py reduces each gradient to its owner instead: ``2 + 2/N + 12/N``.)
2. Each rank forms fp32 gradients for its own masters only, and a plain (fused, on CUDA) AdamW
   over those masters steps them, or skips on the device when the step was non-finite.
3. Each rank rounds its updated masters into its bf16 parameters, and every rank's partition is
   broadcast from its owner: 2 B per parameter on the wire, half the fp32 broadcast of
   ZeroRedundancyOptimizer over fp32 masters. The parameters of each owner live in one flat
   buffer (they are views of it), so that is one broadcast per owner, with no copies.

Partition: whole tensors, largest first, each to the least-loaded rank (ZeroRedundancyOptimizer's
rule, over all trainable tensors at once); the same on every rank, computed from shapes alone.

Checkpoints: the weights file holds the bf16 parameters (the masters rounded: what inference
uses); each rank's ``optimizer_rank{r}.pt`` holds its masters and Adam state keyed by the
tensor's *global* index (its position among the model's trainable parameters), so a resume on
another number of ranks re-partitions them exactly (:meth:`ShardedMasterState.load_resharded`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.precision import MasterWeights, cast_frozen, kept_fp32


def partition(sizes: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each tensor: largest first, each to the rank with the fewest elements so
    far (ties: the lower rank, then the earlier tensor)."""
    totals, owners = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = totals.index(min(totals))
        owners[i] = r
        totals[r] += sizes[i]
    return owners


class ShardedMasterWeights(MasterWeights):
    """:class:`~ddptrain.precision.MasterWeights` whose fp32 masters exist for this rank's
    partition only; :meth:`copy_to_model` broadcasts every partition's updated bf16 weights.

    Same interface (``to_master``, ``load_grads``, ``copy_to_model``, ``zero_model_grads``,
    ``state_dict``, ``load_state_dict``): ``to_master`` maps this rank's parameters only, so
    :func:`ddptrain.optim.build_optimizer` builds a plain optimizer over the local masters.

    Args:
        model: the model on its device, identical on every rank (``dist.broadcast_module``),
            not yet wrapped in DDP; modified in place (dtypes, and parameter storage: each
            owner's trainable parameters become views of one flat buffer).
        dtype: the low-precision dtype (``torch.bfloat16``).

    Raises:
        ValueError: no process group, or fewer trainable tensors than ranks.
    """

    sharded = True

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        if not dist.is_initialized():
            raise ValueError("ShardedMasterWeights needs a process group (optim.zero with several ranks)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        keep = kept_fp32(model)
        # every trainable tensor once (tied ones too): its position here is its global index
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if len(self.trainable) < self.world_size:
            raise ValueError(f"optim.zero with trainer.param_dtype=bf16 shards whole tensors: the model has "
                             f"{len(self.trainable)} trainable tensors for {self.world_size} ranks")
        self.owners = partition([p.numel() for p in self.trainable], self.world_size)
        cast_frozen(model, dtype, keep)  # frozen: bf16, no master, never broadcast
        # the masters first, from the parameters at full precision
        self.pairs, self.to_master, self.global_index = [], {}, {}
        for g, (p, owner) in enumerate(zip(self.trainable, self.owners)):
            if owner != self.rank:
                continue
            master = p if id(p) in keep else nn.Parameter(p.detach().float().clone())
            self.pairs.append((p, master))
            self.to_master[p] = master
            self.global_index[id(master)] = g
        # each owner's parameters, per dtype, as views of one flat buffer: one broadcast each
        self.buckets: list[tuple[int, torch.Tensor]] = []
        for r in range(self.world_size):
            for kept in (False, True):
                group = [p for p, o in zip(self.trainable, self.owners) if o == r and (id(p) in keep) == kept]
                if group:
                    self.buckets.append((r, self._flatten(group, torch.float32 if kept else dtype)))
        self._cast = [(p, m) for p, m in self.pairs if p is not m]
        self._kept = [p for p, m in self.pairs if p is m]
        self.restored = False  # set when a checkpoint's masters were loaded (ShardedMasterState)

    @staticmethod
    @torch.no_grad()
    def _flatten(params: list, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        offset = 0
        for p in params:
            view = flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view  # the old storage is freed here: at most one extra bucket at a time
            offset += p.numel()
        return flat

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round this rank's masters into its bf16 parameters, then broadcast every partition
        from its owner (a collective: every rank calls it at the same step)."""
        super().copy_to_model()
        works = [dist.broadcast(flat, src=r, async_op=True) for r, flat in self.buckets]
        for w in works:
            w.wait()

    def zero_model_grads(self) -> None:
        for p in self.trainable:  # every rank's gradients, not only the owned ones
            p.grad = None

    def state_dict(self, module: nn.Module) -> dict:
        """The model's own (bf16) state dict: rank 0 holds no other rank's masters; the masters
        travel in each rank's optimizer shard (:class:`ShardedMasterState`)."""
        return module.state_dict()

    @torch.no_grad()
    def load_state_dict(self, saved: dict, module: nn.Module) -> None:
        """Masters from saved weights, unless the checkpoint's own masters were restored (then
        ``saved``, their bf16 rounding, is already in the model); then the bf16 weights from the
        masters on every rank."""
        if not self.restored:
            by_ptr = {p.data_ptr(): m for p, m in self._cast}
            for k, v in module.state_dict().items():
                if v.data_ptr() in by_ptr and v.numel() and k in saved:
                    by_ptr[v.data_ptr()].copy_(saved[k])
        self.copy_to_model()


class ShardedMasterState:
    """This rank's masters and optimizer state, keyed by global tensor index, for checkpoints.

    Args:
        optimizer: the plain optimizer over ``master``'s local masters.
        master: the :class:`ShardedMasterWeights`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master: ShardedMasterWeights):
        self.optimizer, self.master = optimizer, master

    def _locals(self) -> list:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        params = self._locals()
        return {"shard": self.optimizer.state_dict(), "global_index": [self.master.global_index[id(p)] for p in params],
                "masters": [p.detach() for p in params], "num_tensors": len(self.master.trainable)}

    def load_state_dict(self, state: dict) -> None:
        self._check(state)
        self.optimizer.load_state_dict(state["shard"])
        self._set_masters({g: m for g, m in zip(state["global_index"], state["masters"])})

    def load_resharded(self, old_states, meta: dict) -> None:
        """Collect this rank's tensors (masters and Adam state) from the old ranks' shards, read
        one at a time."""
        mine = {self.master.global_index[id(p)]: i for i, p in enumerate(self._locals())}
        moved, masters, groups = {}, {}, None
        for k in range(len(old_states)):
            old = old_states[k]
            self._check(old)
            for local, g in enumerate(old["global_index"]):
                if g in mine:
                    masters[g] = old["masters"][local]
                    if local in old["shard"]["state"]:
                        moved[mine[g]] = old["shard"]["state"][local]
            groups = old["shard"]["param_groups"]  # every rank has the same groups (some may be empty)
            del old
        state = self.optimizer.state_dict()
        state["state"] = moved
        for group, saved in zip(state["param_groups"], groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.load_state_dict(state)
        self._set_masters(masters)

    def _check(self, state: dict) -> None:
        if state.get("num_tensors") != len(self.master.trainable):
            raise ValueError(f"the checkpoint's model had {state.get('num_tensors')} trainable tensors, this one has "
                             f"{len(self.master.trainable)}")

    @torch.no_grad()
    def _set_masters(self, by_global: dict) -> None:
        params = self._locals()
        lost = [self.master.global_index[id(p)] for p in params if self.master.global_index[id(p)] not in by_global]
        if lost:
            raise ValueError(f"no saved master for trainable tensors {lost[:10]} (of this rank's partition)")
        for p in params:
            saved = by_global[self.master.global_index[id(p)]]
            if saved.shape != p.shape:
                raise ValueError(f"saved master of shape {tuple(saved.shape)} for a tensor of shape {tuple(p.shape)}")
            p.copy_(saved)
        self.master.restored = True
