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
from ddptrain.activation_offload import apply_offload
from ddptrain.compile import EagerFallbacks, apply_compile, compile_whole
from ddptrain.config import Config
from ddptrain.lora import apply_lora
from ddptrain.precision import Precision
from ddptrain.recompute import apply_recompute
from ddptrain.streamed_base import place_model, stream_base
from ddptrain.update import backend as backends
from ddptrain.update.backend import Backend
from ddptrain.throughput import AllReduceTimer
from ddptrain.update.choose import choose
from ddptrain.update.step import StepUpdate


@dataclass
class PreparedModel:
    """What :func:`prepare_model` made of a model."""

    module: nn.Module  # the model itself, on its device (LoRA'd, bf16 under masters): what is saved
    model: nn.Module  # what the training loop calls: the module, or its DDP / sharded-gradient wrapper, maybe compiled
    backend: Backend  # the optimizer step and where model state lives (ddptrain/update/), its optimizer not built yet
    adapted: list  # LoRA-adapted module names
    recomputed: list  # recomputed module names
    activation_offload: Optional[Any]  # recompute.offload's saved-tensor hooks
    compiled: list  # regionally compiled module names
    streamed: Optional[Any]  # lora.base_offload's streamed base
    fallbacks: EagerFallbacks  # compiled functions dynamo runs eagerly (past compile.recompile_limit)
    allreduce_timer: Optional[Any] = None  # logging.allreduce_share under DDP: a throughput.AllReduceTimer


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


def prepare_model(model: nn.Module, cfg: Config, info: dist.DistInfo, time_allreduce: bool = False) -> PreparedModel:
    """Device, LoRA, recompute, compile, master weights, DDP: the order each of them needs.

    Args:
        model: the model as the recipe built it; modified in place.
        cfg: the whole config (``trainer``, ``lora``, ``recompute``, ``compile``, ``optim``, ``dist``).
        info: this process's place (``dist.setup_for(cfg)``).
        time_allreduce: under DDP, time how long each rank waits for the gradient all-reduce
            (``logging.allreduce_share``: a :class:`ddptrain.throughput.AllReduceTimer` its comm hook reports to).

    Raises:
        ConfigError: a combination no optimizer backend serves on this many processes
            (:func:`ddptrain.update.choose.choose`).
    """
    device = info.device
    choice = choose(cfg, info.world_size, device)  # before the model is touched: a refused set-up changes nothing
    # lora.base_offload: the streamed base stays off the GPU; LoRA first: recompute/compile/masters/DDP see its params
    model, lc = place_model(model, device, cfg), cfg.lora
    adapted = apply_lora(model, lc.targets, lc.rank, lc.alpha, lc.dropout, lc.trainable) if lc.enabled else []
    recomputed = apply_recompute(model, cfg.recompute) if cfg.recompute.enabled else []
    activation_offload = apply_offload(model, cfg.recompute, device)  # recompute.offload: saved tensors to host
    compiled = apply_compile(model, cfg.compile)  # regional: selected blocks only
    # bf16 weights with fp32 masters (on the GPU, sharded or on the host), or the model as it is
    backend = backends.make(choice, model, cfg, device)
    streamed = stream_base(model, cfg, device, recomputed)  # after the masters' casts, before DDP
    wrapped = backend.reducer(model, cfg)  # optim.shard_grads: each rank reduces into its own shard, no DDP
    ddp = wrapped is None and info.distributed
    allreduce_timer = AllReduceTimer(device) if ddp and info.world_size > 1 and time_allreduce else None
    if ddp:
        wrapped = dist.wrap_ddp(model, cfg.dist, device, allreduce_timer)
    wrapped = model if wrapped is None else wrapped
    if cfg.compile.enabled and not compiled:  # whole model, after DDP: dynamo then
        # splits the graph at DDP's bucket boundaries so gradient all-reduce still overlaps
        wrapped = compile_whole(wrapped, cfg.compile, cfg.dist.bucket_cap_mb if ddp else None,
                                recomputed=len(recomputed))
    return PreparedModel(model, wrapped, backend, adapted, recomputed, activation_offload, compiled, streamed,
                         EagerFallbacks(cfg.compile.enabled), allreduce_timer)


def prepare_step(prepared: PreparedModel, loss_fn: Callable, cfg: Config, info: dist.DistInfo) -> OneStep:
    """The optimizer (built by the backend over what it updates), the precision policy and the
    update of ``prepared``'s training step."""
    t, device = cfg.trainer, info.device
    precision = Precision(t.precision, device, t.fp16_init_scale)
    backend = prepared.backend
    # compile.cuda_graphs: a captured backward accumulates into the very gradient tensors: kept, zeroed
    backend.start(prepared.module, cfg, precision, keep_grads=cfg.compile.cuda_graphs)
    update = StepUpdate(backend, precision, info.world_size, t.clip_grad_norm, device)
    solo = prepared.module if info.distributed else prepared.model  # one rank: the compiled model, if any
    return OneStep(solo, loss_fn, backend.optimizer, precision, update, device)
