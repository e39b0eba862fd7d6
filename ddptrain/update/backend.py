"""The optimizer backend: the one object that owns the optimizer step and where model state lives.

The Trainer holds one :class:`Backend` and knows nothing of how it keeps its state. A backend owns
the model's trainable parameters (whose ``.grad`` the backward fills), their fp32 masters if any,
and the optimizer state, on this GPU, split over the ranks, or in host memory. The step's common
part (the all-reduce of the step's report, the normalisation, the clipping factor and the finite
verdict) is :class:`ddptrain.update.step.StepUpdate`'s, for every backend; it asks the backend for
the gradient norm and for the step. Which backend a run takes is decided by
:func:`ddptrain.update.choose.choose` only.

==========  ==========================================  ==========================  ===================
backend     what it keeps                               GPU B/param (AdamW)         host B/param
==========  ==========================================  ==========================  ===================
replicated  fp32 weights and a torch optimizer          16; ZeRO-1: 8 + 8/N         0
            (ZeRO-1: ZeroRedundancyOptimizer)
masters     bf16 weights, fp32 masters; torch AdamW     16 (+4 transient unless     0
            or the fused Triton kernel                  the kernel runs)
sharded     bf16 weights; each rank its partition's     4 + 12/N; shard_grads:      0
            fp32 masters + state                        2 + 2/N + 12/N
host        bf16 weights on the GPU; masters + state    2 + 2 (1 rank: 2;           (4 + 8 + 2)/N
            in pinned host memory                       shard_grads: 2 + 2/N)
==========  ==========================================  ==========================  ===================

(AdamW; the exact parts, per backend, are each class's :meth:`Backend.rates`.) The backends wrap the
classes that hold the tensors (:class:`ddptrain.precision.MasterWeights`,
:class:`ddptrain.update.sharded.ShardedMasterWeights`, :class:`ddptrain.update.host.OffloadedMasters`,
:class:`ddptrain.update.fused.FusedMasterAdamW`) without reaching into them: the Trainer, the EMA,
checkpoints, the weights file and the estimator ask the backend.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn

from ddptrain import dist as ddist
from ddptrain.optim import build_optimizer, is_zero, skips_on_device, step_unless
from ddptrain.precision import MasterWeights, Precision
from ddptrain.reshard import FullOptimizer, MasterShards, ZeroShards
from ddptrain.sharded_grads import ShardedGradReducer
from ddptrain.update import host
from ddptrain.update.choose import Choice
from ddptrain.update.fused import FusedMasterAdamW
from ddptrain.update.sharded import ShardedMasterWeights


@dataclass
class EmaFollows:
    """What an EMA of the weights follows (ddptrain/ema.py), as the backend keeps it.

    Attributes:
        sources: model parameter -> the fp32 tensor the optimizer updates (its master); a parameter
            missing here is its own source.
        mine: ids of the parameters this rank updates (the EMA keeps those); None: all of them.
        sharded: each rank updates a partition (the EMA is sharded as the optimizer is).
        on_host: the masters live in host memory (``ema.device: auto`` keeps the EMA beside them;
            their host-memory check counted it).
        restore: puts the trained weights back into the model from the masters after an evaluation
            on the EMA weights (collective when sharded); None: there are no masters.
    """

    sources: dict = field(default_factory=dict)
    mine: Optional[set] = None
    sharded: bool = False
    on_host: bool = False
    restore: Optional[Callable[[], None]] = None


class Backend(abc.ABC):
    """The optimizer step of one run and the state it updates.

    Made in two steps by ddptrain/prepare.py: the constructor takes the model before the streamed
    base and DDP (masters cast and partitioned there), :meth:`start` builds the optimizer once the
    model is complete. Then, each step: :meth:`before_backward` before each micro-batch's backward,
    :meth:`grad_norm`, :meth:`step` (or :meth:`skip`), :meth:`zero_grad`.

    Attributes:
        name: ``replicated`` | ``masters`` | ``sharded`` | ``host``.
        choice: the :class:`ddptrain.update.choose.Choice` it serves.
        params: the model's trainable parameters (their ``.grad`` is what backward fills).
        master: the object holding the fp32 masters (a MasterWeights, ShardedMasterWeights or
            OffloadedMasters), or None.
        optimizer: the torch optimizer (after :meth:`start`): the LR scheduler drives its groups.
        on_device: :meth:`step` takes device tensors and skips a non-finite step on the device,
            so the step is queued before the host has read the verdict (else the host decides).
        shards_grads: each rank holds the gradients of its own partition only: :meth:`grad_norm`
            is the rank's squared norm, summed over the ranks.
    """

    name: ClassVar[str] = ""

    def __init__(self, choice: Choice, model: nn.Module, cfg: Any, device: torch.device):
        self.choice, self.device = choice, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master: Any = None
        self.optimizer: Any = None
        self.module: Optional[nn.Module] = None
        self._checkpoint: Any = None  # the optimizer state object of the last states() (a resume loads into it)
        self.precision: Optional[Precision] = None
        self.keep_grads = False
        self.on_device = False
        self.shards_grads = False

    # ------------------------------------------------------------------ set-up

    def start(self, module: nn.Module, cfg: Any, precision: Precision, keep_grads: bool = False) -> None:
        """Build the optimizer over what this backend updates.

        Args:
            module: the complete (unwrapped) model.
            cfg: the whole config (``optim``).
            precision: the run's autocast / GradScaler policy.
            keep_grads: zero the gradients in place instead of freeing them (``compile.cuda_graphs``:
                a captured backward accumulates into those very tensors).
        """
        self.precision, self.keep_grads, self.module = precision, keep_grads, module
        self.params = [p for p in module.parameters() if p.requires_grad]  # the model complete now
        self.optimizer = self._build_optimizer(module, cfg)
        self.on_device = self._skips_on_device()

    def _build_optimizer(self, module: nn.Module, cfg: Any):
        return build_optimizer(module, cfg.optim, self.device)

    def _skips_on_device(self) -> bool:
        return self.precision.mode != "fp16" and skips_on_device(self.optimizer)

    def reducer(self, model: nn.Module, cfg: Any) -> Optional[nn.Module]:
        """The wrapper that reduces the gradients in place of DDP (sharded gradients), or None."""
        return None

    # ------------------------------------------------------------------ one step

    def before_backward(self, last: bool) -> None:
        """Called before each micro-batch's backward (``last``: the step's last one)."""

    def _grads(self) -> list:
        return [p.grad for p in self.params if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """This rank's contribution to the global gradient norm (a 0-d float64 device tensor): the
        norm of its gradients, or their squared norm under :attr:`shards_grads`."""
        grads = self._grads()
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))).double()
        return norm.square() if self.shards_grads else norm

    @abc.abstractmethod
    def step(self, factor, skip) -> bool:
        """Apply the update to ``factor`` x the gradients.

        Args:
            factor: the normalisation-and-clipping scale: a 0-d device tensor under :attr:`on_device`,
                else a float (the host has read it).
            skip: under :attr:`on_device`, a 0-d float device tensor, non-zero where the step was
                not finite (the update then leaves weights, moments and step counts untouched);
                else None (a host-decided step is called only when finite).

        Returns:
            Whether a step was applied (a host-decided fp16 step may be skipped by the scaler);
            under :attr:`on_device` the caller reads that from the step's report instead.
        """

    def skip(self) -> None:
        """A host-decided step that was not finite: nothing is updated (fp16's scaler lowers its scale)."""
        self.precision.skip()

    def zero_grad(self) -> None:
        """Drop (or, under ``keep_grads``, zero in place) the step's gradients."""
        if self.keep_grads:
            torch._foreach_zero_(self._grads())
            return
        self.optimizer.zero_grad(set_to_none=True)

    def drop_grads(self) -> None:
        """Free every gradient the backend keeps beside the model's (after a failed step)."""

    # ------------------------------------------------------------------ what others ask of it

    def states(self) -> tuple[dict, dict]:
        """The checkpoint's stateful objects of the optimizer: ``(shared, per_rank)``, one of them
        holding ``"optimizer"``: the whole optimizer (saved once), or a per-rank shard state. Each
        also loads a checkpoint of the other kind (another number of ranks: ddptrain/reshard.py)."""
        self._checkpoint = FullOptimizer(self.optimizer, self.module, self.master)
        return {"optimizer": self._checkpoint}, {}

    def weights(self, module: nn.Module) -> dict:
        """The tensors this backend contributes to the checkpoint's weights file (``module``'s state
        dict, with the fp32 masters in place of bf16 weights where this rank holds all of them)."""
        return module.state_dict()

    def load_weights(self, saved: dict, module: nn.Module) -> None:
        """After a resume loaded ``saved`` (the weights file) into ``module``: the masters from them."""

    def ema_follows(self) -> EmaFollows:
        """What an EMA of the weights averages (:class:`EmaFollows`)."""
        return EmaFollows()

    def where(self) -> dict:
        """Where each part of the model state lives: ``weights``, ``masters``, ``optimizer_state``
        (``gpu`` | ``host`` | None) and ``sharded`` (over the ranks)."""
        return {"weights": "gpu", "masters": None, "optimizer_state": "gpu", "sharded": False}

    # ------------------------------------------------------------------ bytes, for the estimator

    @classmethod
    @abc.abstractmethod
    def rates(cls, choice: Choice) -> dict:
        """Bytes per trainable parameter of each part of the state, ``{part: (bytes, scope)}``:
        scope ``all`` (every rank holds it for every parameter) or ``owned`` (for its partition's
        only). Parts: ``weights`` (None: the parameter's own dtype), ``grads`` (None: as the
        weight), ``masters``, ``optimizer``, ``master_grads`` (transient, in the step) on the GPU;
        ``host_masters``, ``host_optimizer``, ``host_grads`` in host memory."""

    @classmethod
    def bytes_per_param(cls, choice: Choice) -> dict:
        """``{"gpu": B, "host": B}`` per trainable parameter on a rank (owned parts counted 1/N;
        transient master gradients and scratch left out; fp32 weights where the model's own)."""
        n = max(1, choice.world_size)
        gpu = host = 0.0
        for part, (b, scope) in cls.rates(choice).items():
            if part == "master_grads":
                continue
            b = 4 if b is None else b
            share = b / n if scope == "owned" else b
            if part.startswith("host_"):
                host += share
            else:
                gpu += share
        return {"gpu": gpu, "host": host}


class Replicated(Backend):
    """A torch optimizer over the model's own parameters; ZeRO-1 (``optim.zero`` on several ranks)
    through ZeroRedundancyOptimizer, whose shard a checkpoint saves per rank."""

    name = "replicated"

    def step(self, factor, skip) -> bool:
        if self.on_device:
            # the fused kernel applies the factor itself (grad / grad_scale, skipped where not finite)
            step_unless(self.optimizer, found_inf=skip, grad_scale=factor.reciprocal().float())
            return True
        grads = self._grads()
        if grads:
            torch._foreach_mul_(grads, factor)
        return self.precision.step(self.optimizer)  # fp16: False if the scaler skipped it

    def states(self) -> tuple[dict, dict]:
        if is_zero(self.optimizer):
            return {}, {"optimizer": ZeroShards(self.optimizer)}
        return super().states()

    def ema_follows(self) -> EmaFollows:
        if not is_zero(self.optimizer):
            return EmaFollows()
        local = {id(t) for g in self.optimizer.optim.param_groups for t in g["params"]}
        return EmaFollows(mine={id(p) for p in self.params if id(p) in local}, sharded=True)

    def where(self) -> dict:
        return {**super().where(), "sharded": is_zero(self.optimizer)}

    @classmethod
    def rates(cls, choice: Choice) -> dict:
        return {"weights": (None, "all"), "grads": (None, "all"), "masters": (0, "all"),
                "optimizer": (choice.state_bytes, "owned" if choice.zero else "all"), "master_grads": (0, "all")}


class Masters(Backend):
    """A bf16 model with fp32 masters on every rank (:class:`ddptrain.precision.MasterWeights`),
    updated by torch's optimizer or, with ``choice.fused``, by the fused Triton AdamW
    (:class:`ddptrain.update.fused.FusedMasterAdamW`) that reads the bf16 gradients itself."""

    name = "masters"

    def __init__(self, choice: Choice, model: nn.Module, cfg: Any, device: torch.device):
        super().__init__(choice, model, cfg, device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            ddist.broadcast_module(model)  # the masters are made here: the same start on every rank
        self.master = self._masters(model, cfg, device)
        self.fused = None

    def _masters(self, model: nn.Module, cfg: Any, device: torch.device):
        return MasterWeights(model, torch.bfloat16)

    def _build_optimizer(self, module: nn.Module, cfg: Any):
        return build_optimizer(module, cfg.optim, self.device, self.master.to_master)

    def start(self, module: nn.Module, cfg: Any, precision: Precision, keep_grads: bool = False) -> None:
        super().start(module, cfg, precision, keep_grads)
        if self.choice.fused:
            self.fused = FusedMasterAdamW(self.optimizer, self.master)
            self.on_device = True  # it skips a non-finite step on the device

    def step(self, factor, skip) -> bool:
        if self.on_device:
            if self.fused is not None:
                # reads the model's bf16 gradients x factor and writes masters, moments and bf16 weights
                self.fused.step(factor, skip)
                return True
            self.master.load_grads(None)  # the fused optimizer applies the factor itself
            step_unless(self.optimizer, found_inf=skip, grad_scale=factor.reciprocal().float())
            self.master.copy_to_model()  # after a skip the masters are unchanged: a no-op copy
            return True
        self.master.load_grads(factor)
        stepped = self.precision.step(self.optimizer)
        if stepped:
            self.master.copy_to_model()
        return stepped

    def zero_grad(self) -> None:
        if self.keep_grads:
            torch._foreach_zero_(self._grads())  # the model's, kept where a graph writes them
            self.master.drop_master_grads()  # the fp32 masters' (the ones that are not the model's)
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.master.zero_model_grads()

    def drop_grads(self) -> None:
        self.master.zero_model_grads()

    def weights(self, module: nn.Module) -> dict:
        return self.master.state_dict(module)

    def load_weights(self, saved: dict, module: nn.Module) -> None:
        # exact fp32 masters gathered from a sharded checkpoint, if any, over their bf16 rounding
        gathered = getattr(self._checkpoint, "masters", {})
        self.master.load_state_dict({**saved, **gathered}, module)

    def ema_follows(self) -> EmaFollows:
        return EmaFollows(sources=dict(self.master.to_master), restore=self.master.copy_to_model)

    def where(self) -> dict:
        return {**super().where(), "masters": "gpu"}

    @classmethod
    def rates(cls, choice: Choice) -> dict:
        return {"weights": (2, "all"), "grads": (2, "all"), "masters": (4, "all"),
                "optimizer": (choice.state_bytes, "all"), "master_grads": (0 if choice.fused else 4, "all")}


class Sharded(Masters):
    """Each rank keeps the fp32 masters and optimizer state of its own partition
    (:class:`ddptrain.update.sharded.ShardedMasterWeights`); with ``choice.shard_grads`` each rank
    also reduces into its own gradient shard (:class:`ddptrain.sharded_grads.ShardedGradReducer`)
    instead of DDP."""

    name = "sharded"

    def __init__(self, choice: Choice, model: nn.Module, cfg: Any, device: torch.device):
        super().__init__(choice, model, cfg, device)
        self.shards_grads = choice.shard_grads

    def _masters(self, model: nn.Module, cfg: Any, device: torch.device):
        return ShardedMasterWeights(model, torch.bfloat16)

    def _build_optimizer(self, module: nn.Module, cfg: Any):
        # a plain optimizer over this rank's masters (every group kept, even if empty here)
        return build_optimizer(module, cfg.optim, self.device, self.master.to_master, local_only=True)

    def reducer(self, model: nn.Module, cfg: Any) -> Optional[nn.Module]:
        if not self.choice.shard_grads:
            return None
        return ShardedGradReducer(model, self.master.owners, cfg.dist.bucket_cap_mb, cfg.dist.broadcast_buffers)

    def states(self) -> tuple[dict, dict]:
        return {}, {"optimizer": MasterShards(self.optimizer, self.master, self.module)}

    def ema_follows(self) -> EmaFollows:
        return EmaFollows(sources=dict(self.master.to_master), mine={id(p) for p in self.master.to_master},
                          sharded=True, restore=self.master.copy_to_model)

    def where(self) -> dict:
        return {**super().where(), "sharded": True}

    @classmethod
    def rates(cls, choice: Choice) -> dict:
        return {"weights": (2, "all"), "grads": (2, "owned" if choice.shard_grads else "all"),
                "masters": (4, "owned"), "optimizer": (choice.state_bytes, "owned"), "master_grads": (4, "owned")}


class Host(Sharded):
    """fp32 masters and optimizer state in pinned host memory, updated there
    (:class:`ddptrain.update.host.OffloadedMasters`); each rank its partition on several ranks
    (checkpoints then as the sharded backend's), with or without sharded gradients. The step is
    decided on the host: a non-finite one is skipped before a gradient leaves the GPU."""

    name = "host"

    def _masters(self, model: nn.Module, cfg: Any, device: torch.device):
        # ema.enabled: its fp32 copy sits beside the masters on the host (its memory is checked with theirs)
        return host.prepare(model, cfg.optim.offload_chunk_mb, device, host_ema=bool(cfg.ema.enabled))

    def _build_optimizer(self, module: nn.Module, cfg: Any):
        # updated on the host: torch's fused CPU AdamW (multi-threaded) unless optim.fused=false
        return build_optimizer(module, cfg.optim, self.device, self.master.to_master,
                               local_only=self.master.sharded)

    def _skips_on_device(self) -> bool:
        return False

    def before_backward(self, last: bool) -> None:
        # one rank: during the step's last backward each gradient goes to the host as it is made
        if self.master.streams:
            self.master.streaming = last

    def grad_norm(self) -> torch.Tensor:
        if not self.master.sent():
            return super().grad_norm()
        norm = self.master.grad_norm().double()  # most gradients are on the host already
        return norm.square() if self.shards_grads else norm

    def step(self, factor, skip) -> bool:
        self.master.step(self.optimizer, factor)
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.master.zero_model_grads()

    def states(self) -> tuple[dict, dict]:
        if self.master.sharded:
            return super().states()
        return Backend.states(self)

    def ema_follows(self) -> EmaFollows:
        sharded = self.master.sharded
        return EmaFollows(sources=dict(self.master.to_master),
                          mine={id(p) for p in self.master.to_master} if sharded else None,
                          sharded=sharded, on_host=True, restore=self.master.copy_to_model)

    def where(self) -> dict:
        return {"weights": "gpu", "masters": "host", "optimizer_state": "host", "sharded": self.master.sharded}

    @classmethod
    def rates(cls, choice: Choice) -> dict:
        if choice.shard_grads:
            grads = (2, "owned")
        elif choice.world_size == 1 and choice.grad_accum == 1:
            grads = (0, "all")  # one rank: each gradient leaves for the host as the backward makes it
        else:
            grads = (2, "all")
        return {"weights": (2, "all"), "grads": grads, "masters": (0, "all"), "optimizer": (0, "all"),
                "master_grads": (0, "all"), "host_masters": (4, "owned"),
                "host_optimizer": (choice.state_bytes, "owned"), "host_grads": (2, "owned")}


BY_NAME = {b.name: b for b in (Replicated, Masters, Sharded, Host)}


def backend_class(choice: Choice) -> type:
    """The :class:`Backend` class ``choice`` names (its ``rates`` and ``bytes_per_param`` need no instance)."""
    return BY_NAME[choice.backend]


def make(choice: Choice, model: nn.Module, cfg: Any, device: torch.device) -> Backend:
    """The backend ``choice`` names, over ``model`` (on its device, before the streamed base and DDP)."""
    return backend_class(choice)(choice, model, cfg, device)
