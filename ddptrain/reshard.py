"""The optimizer's checkpoint state, and its move between a sharded run and a run on one process.

A sharded optimizer saves one file per rank (``optimizer_rank{r}.pt``), each tensor's state keyed
by a *global* index: ZeRO (:class:`ddptrain.optim.ZeroShardState`) by the tensor's position in
the optimizer's parameter groups, the sharded fp32 masters (and offloaded ones on several ranks:
:class:`ddptrain.update.sharded.ShardedMasterState`) by its position among the model's trainable
parameters, with the masters themselves. A run on one process has a plain optimizer (over the
fp32 masters of ``trainer.param_dtype: bf16``, if any) and saves it once, in ``trainer.pt``.

A resume on another number of processes (:func:`ddptrain.checkpoint.load`) re-deals the state:

- sharded -> sharded: each object's ``load_resharded`` (its own module);
- sharded -> one process: :class:`FullOptimizer` gathers every shard's state into the plain
  optimizer and, from sharded masters, the exact fp32 masters (:attr:`FullOptimizer.masters`:
  the weights file of a sharded run holds only their bf16 rounding);
- one process -> sharded: :class:`ZeroShards` / :class:`MasterShards` take their partition of
  the plain optimizer's state (``load_unsharded``); the masters come from the one-process
  weights file, which holds them in fp32.

Nothing is rounded or recomputed on the way: a resumed run continues with the same numbers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ddptrain.optim import ZeroShardState, param_groups
from ddptrain.update.sharded import ShardedMasterState


def _hparams(groups: list) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _load(optimizer: torch.optim.Optimizer, moved: dict, hparams: Optional[list]) -> None:
    """Load per-parameter ``moved`` state (local index -> state) and the groups' ``hparams``."""
    state = optimizer.state_dict()
    state["state"] = moved
    if hparams is not None:
        if len(hparams) != len(state["param_groups"]):
            raise ValueError(f"the checkpoint's optimizer has {len(hparams)} parameter groups, this one "
                             f"{len(state['param_groups'])}")
        for group, saved in zip(state["param_groups"], hparams):
            group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.load_state_dict(state)


def _plain_order(module: nn.Module) -> list[nn.Parameter]:
    """The model's trainable parameters in the order a plain optimizer holds them
    (:func:`ddptrain.optim.param_groups`: decay group, then no-decay group)."""
    return [p for g in param_groups(module, 0.0) for p in g["params"]]


class FullOptimizer:
    """The plain (unsharded) optimizer as a checkpoint's shared state: saved as the optimizer's own
    ``state_dict`` (``trainer.pt``), and loadable from a sharded run's per-rank files.

    Args:
        optimizer: the plain optimizer (over the masters' tensors when ``master`` is set).
        module: the model (unwrapped): the sharded masters' index is its trainable parameters' order.
        master: MasterWeights / OffloadedMasters on one process, or None.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, master: Any = None):
        self.optimizer, self.module, self.master = optimizer, module, master
        self.masters: dict[str, torch.Tensor] = {}  # state-dict key -> fp32 master gathered from shards

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def load_resharded(self, old_states, meta: dict) -> None:
        """Gather the shards of a ZeRO or sharded-masters run, read one at a time, into this
        optimizer; the sharded masters' fp32 values into :attr:`masters`.

        Raises:
            ValueError: the shards are of another model (number of tensors, shapes), or a tensor
                of this optimizer has no state in them while others have.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        to_model = {id(m): p for p, m in getattr(self.master, "to_master", {}).items()}
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        by_trainable = {id(p): g for g, p in enumerate(trainable)}
        local_of_trainable = {by_trainable[id(to_model.get(id(p), p))]: i for i, p in enumerate(params)}
        names: dict[int, list[str]] = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            names.setdefault(id(v), []).append(k)
        moved, hparams, seen, masters = {}, None, set(), {}
        for k in range(len(old_states)):
            old = old_states[k]
            if "masters" in old:  # sharded masters: global index = position among the trainable tensors
                if old.get("num_tensors") != len(trainable):
                    raise ValueError(f"the checkpoint's model had {old.get('num_tensors')} trainable tensors, "
                                     f"this one has {len(trainable)}")
                local_of, hparams = local_of_trainable, _hparams(old["shard"]["param_groups"])
            else:  # ZeRO: global index = position in the optimizer's groups, the same as this optimizer's
                local_of, hparams = {i: i for i in range(len(params))}, old["hparams"]
            for local, g in enumerate(old["global_index"]):
                if g not in local_of:
                    raise ValueError(f"the checkpoint's optimizer has a tensor {g}; this one has {len(params)}")
                seen.add(local_of[g])
                if local in old["shard"]["state"]:
                    moved[local_of[g]] = old["shard"]["state"][local]
                if "masters" in old:
                    masters[g] = old["masters"][local]
            del old  # one old shard in memory at a time
        missing = sorted(set(range(len(params))) - seen)
        if missing:
            raise ValueError(f"the checkpoint's shards hold no tensor {missing[:10]} of this optimizer's {len(params)}")
        for g, m in masters.items():
            if tuple(m.shape) != tuple(trainable[g].shape):
                raise ValueError(f"saved master of shape {tuple(m.shape)} for a tensor of shape "
                                 f"{tuple(trainable[g].shape)}")
            self.masters.update(dict.fromkeys(names.get(id(trainable[g]), []), m))
        _load(self.optimizer, moved, hparams)


class ZeroShards(ZeroShardState):
    """:class:`~ddptrain.optim.ZeroShardState` that also loads a one-process optimizer's state:
    its tensors are in the same order as ZeRO's global index (both follow the parameter groups)."""

    def load_unsharded(self, state: dict, meta: dict) -> None:
        n, here = (sum(len(g["params"]) for g in groups) for groups in (state["param_groups"], self.zero.param_groups))
        if n != here:
            raise ValueError(f"the checkpoint's optimizer has {n} tensors, this one has {here}")
        self.load_resharded([{"shard": state, "global_index": list(range(n)),
                              "hparams": _hparams(state["param_groups"])}], meta)


class MasterShards(ShardedMasterState):
    """:class:`~ddptrain.update.sharded.ShardedMasterState` that also takes its partition of a
    one-process optimizer's state; the masters then come from the checkpoint's fp32 weights
    (``ShardedMasterWeights.load_state_dict``).

    Args:
        module: the model (unwrapped): the one-process optimizer's tensors follow its groups.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master: Any, module: nn.Module):
        super().__init__(optimizer, master)
        self.module = module

    def load_unsharded(self, state: dict, meta: dict) -> None:
        order = _plain_order(self.module)
        n = sum(len(g["params"]) for g in state["param_groups"])
        if n != len(order):
            raise ValueError(f"the checkpoint's optimizer has {n} tensors, this model trains {len(order)}")
        by_trainable = {id(p): g for g, p in enumerate(self.master.trainable)}
        mine = {self.master.global_index[id(p)]: i for i, p in enumerate(self._locals())}
        moved = {}
        for i, p in enumerate(order):
            g = by_trainable[id(p)]
            if g in mine and i in state["state"]:
                moved[mine[g]] = state["state"][i]
        _load(self.optimizer, moved, _hparams(state["param_groups"]))

