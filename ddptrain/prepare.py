"""The model made ready to train, and its optimizer step: the Trainer's set-up, shared with the tuner.

:func:`prepare_model` applies, in the order each needs, what a config asks of a model: device,
LoRA, recompute, activation offload, regional compile, bf16 weights with fp32 masters, the
streamed base, DDP (or the sharded-gradient reducer), whole-model compile. :func:`prepare_step`
adds the optimizer, the precision policy and the update, as a :class:`OneStep`: all that the
pre-flight check and the tuner (ddptrain/preflight.py, ddptrain/tune.py) see of a training set-up.
So ``python -m ddptrain.tune`` measures the model the Trainer would train without building one
(no run folder, no logs, no checkpoints), and neither needs a Trainer's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ddptrain import dist
from ddptrain.update import fused as fused_update, host as offload
from ddptrain.activation_offload import apply_offload
from ddptrain.compile import EagerFallbacks, apply_compile, compile_whole
from ddptrain.config import Config, ConfigError
from ddptrain.lora import apply_lora
from ddptrain.optim import build_optimizer
from ddptrain.precision import MasterWeights, Precision
from ddptrain.recompute import apply_recompute
from ddptrain.sharded_grads import ShardedGradReducer
from ddptrain.update.sharded import ShardedMasterWeights
from ddptrain.streamed_base import place_model, stream_base
from ddptrain.update.step import StepUpdate


@dataclass
class PreparedModel:
    """What :func:`prepare_model` made of a model."""

    module: nn.Module  # the model itself, on its device (LoRA'd, bf16 under masters): what is saved
    model: nn.Module  # what the training loop calls: the module, or its DDP / sharded-gradient wrapper, maybe compiled
    master: Optional[Any]  # MasterWeights, ShardedMasterWeights or OffloadedMasters (param_dtype=bf16), or None
    adapted: list  # LoRA-adapted module names
    recomputed: list  # recomputed module names
    activation_offload: Optional[Any]  # recompute.offload's saved-tensor hooks
    compiled: list  # regionally compiled module names
    streamed: Optional[Any]  # lora.base_offload's streamed base
    fallbacks: EagerFallbacks  # compiled functions dynamo runs eagerly (past compile.recompile_limit)


@dataclass(frozen=True)
class OneStep:
    """One rank's training step: what ``Trainer.train_step`` runs, handed to the pre-flight
    check and the tuner instead of a Trainer (built by :func:`prepare_step`)."""

    model: nn.Module  # no collective in its forward or backward: a rank that fails leaves none waiting
    loss_fn: Callable
    optimizer: Any
    precision: Precision
    update: StepUpdate
    device: torch.device


def shard_grads(cfg: Config, world_size: int) -> bool:
    """``optim.shard_grads`` in effect: one rank is DDP-free already."""
    return cfg.optim.shard_grads and world_size > 1


def prepare_model(model: nn.Module, cfg: Config, info: dist.DistInfo,
                  allreduce_timer: Optional[Any] = None) -> PreparedModel:
    """Device, LoRA, recompute, compile, master weights, DDP: the order each of them needs.

    Args:
        model: the model as the recipe built it; modified in place.
        cfg: the whole config (``trainer``, ``lora``, ``recompute``, ``compile``, ``optim``, ``dist``).
        info: this process's place (``dist.setup_for(cfg)``).
        allreduce_timer: a :class:`ddptrain.throughput.AllReduceTimer` DDP's comm hook reports to, or None.

    Raises:
        ConfigError: ``optim.offload=cpu`` or ``optim.shard_grads`` on several processes without
            ``optim.zero``.
    """
    device = info.device
    # lora.base_offload: the streamed base stays off the GPU; LoRA first: recompute/compile/masters/DDP see its params
    model, lc = place_model(model, device, cfg), cfg.lora
    adapted = apply_lora(model, lc.targets, lc.rank, lc.alpha, lc.dropout, lc.trainable) if lc.enabled else []
    recomputed = apply_recompute(model, cfg.recompute) if cfg.recompute.enabled else []
    activation_offload = apply_offload(model, cfg.recompute, device)  # recompute.offload: saved tensors to host
    compiled = apply_compile(model, cfg.compile)  # regional: selected blocks only
    master = None
    if cfg.trainer.param_dtype == "bf16":  # bf16 model, fp32 masters in the optimizer
        if info.distributed:
            dist.broadcast_module(model)  # the masters are made here: same start on every rank
        sharded = cfg.optim.zero and info.world_size > 1  # each rank: its own partition's masters
        if cfg.optim.offload == "cpu":  # each rank's partition of masters on the host, updated there
            if info.world_size > 1 and not cfg.optim.zero:  # its checkpoints are sharded masters'
                raise ConfigError("optim.offload=cpu on several processes shards the masters as optim.zero "
                                  "does: set optim.zero=true (a resume may then turn the offload off)")
            # ema.enabled: its fp32 copy sits beside the masters on the host (ema.device=gpu is refused with offload)
            master = offload.prepare(model, cfg.optim.offload_chunk_mb, device, host_ema=cfg.ema.enabled)
        else:
            master = (ShardedMasterWeights if sharded else MasterWeights)(model, torch.bfloat16)
    streamed = stream_base(model, cfg, device, recomputed)  # after the masters' casts, before DDP
    wrapped, ddp = model, info.distributed and not shard_grads(cfg, info.world_size)
    if shard_grads(cfg, info.world_size):  # instead of DDP: each rank reduces into, and keeps, its partition's grads
        if getattr(master, "owners", None) is None:
            raise ConfigError("optim.shard_grads=true needs the sharded fp32 masters of optim.zero=true "
                              "(this set-up has no partition of the masters to shard the gradients by)")
        wrapped = ShardedGradReducer(model, master.owners, cfg.dist.bucket_cap_mb, cfg.dist.broadcast_buffers)
    elif info.distributed:
        wrapped = dist.wrap_ddp(model, cfg.dist, device, allreduce_timer)
    if cfg.compile.enabled and not compiled:  # whole model, after DDP: dynamo then
        # splits the graph at DDP's bucket boundaries so gradient all-reduce still overlaps
        wrapped = compile_whole(wrapped, cfg.compile, cfg.dist.bucket_cap_mb if ddp else None,
                                recomputed=len(recomputed))
    return PreparedModel(model, wrapped, master, adapted, recomputed, activation_offload, compiled, streamed,
                         EagerFallbacks(cfg.compile.enabled))


def prepare_step(prepared: PreparedModel, loss_fn: Callable, cfg: Config, info: dist.DistInfo) -> OneStep:
    """The optimizer (plain or ZeRO, over the masters if any), the precision policy and the
    update of ``prepared``'s training step."""
    t, device = cfg.trainer, info.device
    optimizer = build_optimizer(prepared.module, cfg.optim, device, prepared.master)
    precision = Precision(t.precision, device, t.fp16_init_scale)
    # the tensors whose gradients backward fills (the model's; with masters they are bf16)
    params = [p for p in prepared.module.parameters() if p.requires_grad]
    fused = fused_update.for_run(cfg.optim.fused_update, optimizer, prepared.master, device)
    update = StepUpdate(optimizer, precision, prepared.master, params, info.world_size, t.clip_grad_norm, device,
                        sharded_grads=shard_grads(cfg, info.world_size), keep_grads=cfg.compile.cuda_graphs,
                        fused=fused)
    solo = prepared.module if info.distributed else prepared.model  # one rank: the compiled model, if any
    return OneStep(solo, loss_fn, optimizer, precision, update, device)
