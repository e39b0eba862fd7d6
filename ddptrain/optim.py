"""Optimizers (plain or ZeRO-sharded) and learning-rate schedules, built from config.

Weight decay goes on weight matrices only: decaying biases and norm gains pulls them toward zero
for no benefit and measurably hurts fine-tuning, so they get their own group with decay 0.

``optim.zero: true`` wraps the same optimizer class in
``torch.distributed.optim.ZeroRedundancyOptimizer``: each rank keeps the optimizer state
(Adam's two moments: 8 bytes/parameter) for 1/N of the parameters and broadcasts its updated
shard after the step. Gradients are still all-reduced by DDP, so every rank sees the full, true
gradient: clipping by global norm and the GradScaler's inf check need no extra collective.
With ``trainer.param_dtype: bf16`` the masters themselves are sharded instead (the sharded
backend, ddptrain/update/sharded.py): a plain optimizer over the rank's own fp32 masters.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from ddptrain.config import OptimConfig, SchedulerConfig

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
if hasattr(nn, "RMSNorm"):
    _NORM_TYPES = _NORM_TYPES + (nn.RMSNorm,)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decay / no-decay groups.

    No decay for: biases, parameters of normalisation layers (by type, or any module whose class
    name ends in "Norm" so third-party norms are covered), and any other 0/1-D parameter.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        is_norm = isinstance(module, _NORM_TYPES) or type(module).__name__.lower().endswith("norm")
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if is_norm or name.endswith("bias") or p.ndim <= 1:
                no_decay.append(p)
            else:
                decay.append(p)
    # "decay" marks the group, so a resume can re-apply a changed weight_decay (apply_hparams)
    groups = [{"params": decay, "weight_decay": weight_decay, "decay": True},
              {"params": no_decay, "weight_decay": 0.0, "decay": False}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    masters: Optional[dict] = None, local_only: bool = False) -> torch.optim.Optimizer:
    """The optimizer the config names, optionally ZeRO-sharded over the process group.

    Args:
        model: the (unwrapped) model; only parameters with ``requires_grad`` are optimised.
        cfg: the ``optim`` config section.
        device: training device; fused Adam kernels are used on CUDA when ``fused: auto``.
        masters: model parameter -> the tensor the optimizer updates instead (the fp32 masters of
            a bf16 model, ddptrain/update/backend.py). Groups are chosen on the model.
        local_only: ``masters`` maps only this rank's parameters (sharded masters): the optimizer
            is a plain one over them (every group kept, even if empty here, so all ranks have the
            same groups), never ZeroRedundancyOptimizer.

    Raises:
        ValueError: no trainable parameters.
    """
    groups = param_groups(model, cfg.weight_decay)
    if local_only:
        groups = [dict(g, params=[masters[p] for p in g["params"] if p in masters]) for g in groups]
    elif masters:
        groups = [dict(g, params=[masters.get(p, p) for p in g["params"]]) for g in groups]
    if not groups:
        raise ValueError("the model has no parameters with requires_grad=True: nothing to train")
    name = cfg.name.lower()
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        mode = str(cfg.fused).lower()  # a CLI override `optim.fused=true` arrives as "True"
        # auto: the kernel of the on-device update, also for masters offloaded to the host (on a
        # GPU torch's fused CPU AdamW, multi-threaded; on a CPU device foreach: then the offloaded
        # update is bitwise the on-device one, ddptrain/offload.py)
        fused = device.type == "cuda" if mode == "auto" else mode == "true"
        kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
        if not fused:
            kwargs["foreach"] = True  # one multi-tensor kernel per group instead of a loop over params
    elif name == "sgd":
        cls = torch.optim.SGD
        kwargs = dict(lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    else:
        raise ValueError(f"optim.name={cfg.name!r} is not one of adamw, adam, sgd")

    if cfg.zero and not local_only and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # parameters_as_bucket_view packs each rank's parameters into flat buffers so the
        # post-step broadcast is one call per rank instead of one per parameter
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls,
                                       parameters_as_bucket_view=cfg.zero_bucket_view, **kwargs)
    return cls(groups, **kwargs)


def is_zero(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def skips_on_device(optimizer) -> bool:
    """Whether the optimizer (ZeRO's local one, if sharded) can skip a step on the device: fused
    Adam, AdamW and SGD take a ``found_inf`` tensor (the protocol GradScaler uses)."""
    inner = optimizer.optim if is_zero(optimizer) else optimizer
    return bool(getattr(inner, "_step_supports_amp_scaling", False))


def step_unless(optimizer, found_inf: torch.Tensor, grad_scale: Optional[torch.Tensor] = None) -> None:
    """``optimizer.step()``, except that where ``found_inf`` (a 0-d float tensor on the device) is
    non-zero the fused kernel leaves weights, moments and step counts untouched; with
    ``grad_scale`` (0-d, on the device) it steps on ``grad / grad_scale``.

    Why: the decision stays on the device, so the step can be queued before the host has read
    whether it was finite (see ``Trainer.train_step``). Requires :func:`skips_on_device`.
    """
    inner = optimizer.optim if is_zero(optimizer) else optimizer
    inner.found_inf = found_inf
    if grad_scale is not None:
        inner.grad_scale = grad_scale
    try:
        optimizer.step()
    finally:
        del inner.found_inf
        inner.__dict__.pop("grad_scale", None)


def lr_lambda(cfg: SchedulerConfig, total_steps: int) -> Callable[[int], float]:
    """The LR multiplier (of ``optim.lr``) for the optimizer step with index ``step`` (0-based).

    - constant: 1 after the warmup.
    - warmup_cosine / warmup_linear: linear warmup, then decay to ``min_lr_ratio`` over
      ``decay_steps`` (default: the rest of the run).
    - noam / inverse_sqrt: linear warmup, then ``sqrt(warmup / step)``. This is the Noam
      schedule of the Transformer paper (and fairseq's inverse_sqrt) normalised so that its peak
      equals ``optim.lr`` instead of ``d_model**-0.5 * factor``; the two names give one curve.
    """
    warmup = max(0, cfg.warmup_steps)
    decay = cfg.decay_steps if cfg.decay_steps > 0 else max(1, total_steps - warmup)
    floor = cfg.min_lr_ratio
    name = cfg.name

    def fn(step: int) -> float:
        s = step + 1  # the step about to be taken, 1-based: the first warmup step has a non-zero LR
        if warmup and s <= warmup:
            return s / warmup
        if name == "constant":
            return 1.0
        if name in ("noam", "inverse_sqrt"):
            return math.sqrt(max(warmup, 1) / s)
        progress = min(1.0, (s - warmup) / decay)
        if name == "warmup_cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if name == "warmup_linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        raise ValueError(f"scheduler.name={name!r} is not a known schedule")

    return fn


def build_scheduler(optimizer, cfg: SchedulerConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_lambda`. The Trainer steps it only when the optimizer stepped."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))


class ZeroShardState:
    """A ZeroRedundancyOptimizer's local shard as a per-rank stateful object for checkpoints.

    Each rank saves only its own partition's optimizer state, with the *global* index of every
    parameter in it (its position in the optimizer's full parameter list, the same on every rank
    and every world size). So a run resumed on another number of processes can re-partition:
    each new rank reads the old shards one at a time and keeps the entries of its own parameters.
    """

    def __init__(self, optimizer):
        self.zero = optimizer

    def _global_index(self) -> list[int]:
        full = {id(p): i for i, p in enumerate(p for g in self.zero.param_groups for p in g["params"])}
        return [full[id(p)] for g in self.zero.optim.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        return {"shard": self.zero.optim.state_dict(), "global_index": self._global_index(),
                "hparams": [{k: v for k, v in g.items() if k != "params"} for g in self.zero.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        self.zero.optim.load_state_dict(state["shard"])
        self._set_hparams(state["hparams"])

    def load_resharded(self, old_states, meta: dict) -> None:
        """Consolidate the old ranks' shards into this rank's new partition."""
        mine = {g: i for i, g in enumerate(self._global_index())}
        moved, hparams = {}, None
        for k in range(len(old_states)):
            old = old_states[k]
            for local, g in enumerate(old["global_index"]):
                if g in mine and local in old["shard"]["state"]:
                    moved[mine[g]] = old["shard"]["state"][local]
            hparams = old["hparams"]
            del old  # one old shard in memory at a time
        state = self.zero.optim.state_dict()  # this partition's param groups, local indices
        state["state"] = moved
        self.zero.optim.load_state_dict(state)
        self._set_hparams(hparams)

    def _set_hparams(self, hparams: list) -> None:
        # the scheduler writes the learning rate into ZeRO's groups, which it copies to the shard's
        for group, saved in zip(self.zero.param_groups, hparams):
            group.update(saved)


def apply_hparams(optimizer, scheduler, cfg: OptimConfig, sched_cfg: SchedulerConfig, horizon: int) -> None:
    """After a resume: the config's hyperparameters over the checkpoint's, from this step on.

    Loading an optimizer state restores its param groups' ``lr``, ``weight_decay``, betas, ...;
    loading the LR scheduler restores its ``base_lrs``. The config is what the user asked for
    now, so it wins (ddptrain/resume.py records what changed). The schedule keeps ``horizon``,
    the total steps of the run that started it, so a longer ``max_steps`` does not re-stretch it.
    """
    for group in optimizer.param_groups:
        if "betas" in group:
            group["betas"] = tuple(cfg.betas)
            group["eps"] = cfg.eps
        if "momentum" in group:
            group["momentum"], group["nesterov"] = cfg.momentum, cfg.nesterov
        if "decay" in group:  # the no-decay group (biases, norms) stays at 0
            group["weight_decay"] = cfg.weight_decay if group["decay"] else 0.0
        group["initial_lr"] = cfg.lr
    fn = lr_lambda(sched_cfg, horizon)
    scheduler.lr_lambdas = [fn] * len(optimizer.param_groups)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    # the same expression LambdaLR.get_lr evaluates, so an unchanged config resumes bit for bit
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
