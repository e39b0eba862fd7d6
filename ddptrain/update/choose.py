"""``choose(config, world_size, device)``: which optimizer backend a run takes, or why none serves it.

This is the only place that picks a backend (ddptrain/update/backend.py) and the only place that
refuses a combination of update-path keys. ``load_config`` calls it without a world size (the
rules every world size shares, so a bad YAML fails at load, naming its file and line); the
Trainer and the tuner call it with the run's world size and device (ddptrain/prepare.py); the
memory estimator (``python -m ddptrain.memory``) calls it for the world size it is asked about.
So what is estimated is what runs, and each rule is written once.

The decision, in words:

- ``trainer.param_dtype: fp32`` -> **replicated**: a torch optimizer over the model's own
  parameters; ``optim.zero`` on several ranks wraps it in ZeroRedundancyOptimizer (its state,
  8/N B a parameter under AdamW, split over the ranks).
- ``trainer.param_dtype: bf16`` -> **masters** on one rank, or on several without ``optim.zero``:
  a bf16 model, fp32 masters beside it, updated by torch's AdamW or by the fused Triton kernel
  (``optim.fused_update``).
- ``+ optim.zero`` on several ranks -> **sharded**: each rank keeps the masters and optimizer state
  of its own partition; ``optim.shard_grads`` makes each rank reduce into its own gradient shard too.
- ``+ optim.offload: cpu`` -> **host**: masters and optimizer state in pinned host memory, updated
  there (each rank its partition; ``optim.shard_grads`` as above).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

from ddptrain.errors import ConfigError


class Refused(ConfigError):
    """A combination no backend serves; ``keys`` are the config keys it names (their origins
    prefix the message at load)."""

    def __init__(self, keys: tuple, why: str):
        super().__init__(why)
        self.keys = keys


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided for one run.

    Attributes:
        backend: ``replicated`` | ``masters`` | ``sharded`` | ``host``.
        world_size: the ranks it was chosen for.
        zero: replicated: ZeroRedundancyOptimizer over the ranks (``optim.zero``, several ranks).
        shard_grads: sharded / host: each rank reduces into its own gradient shard (instead of DDP).
        fused: masters: the fused Triton AdamW takes the step (``optim.fused_update`` resolved for the device).
        state_bytes: optimizer state per updated fp32 parameter (AdamW 8, SGD with momentum 4).
        grad_accum: ``trainer.grad_accum_steps`` (one rank of the host backend frees gradients as they are made
            only without accumulation).
    """

    backend: str
    world_size: int
    zero: bool = False
    shard_grads: bool = False
    fused: bool = False
    state_bytes: int = 8
    grad_accum: int = 1


def _get(cfg: Any, key: str, default: Any) -> Any:
    """``cfg``'s value of ``section.key`` (a schema of an older ddptrain may lack it: ``default``)."""
    section, leaf = key.split(".")
    return getattr(getattr(cfg, section, None), leaf, default)


def fused_kernel_serves(mode: Any, adamw: bool, fused_adamw: bool, unsharded_masters: bool, cuda: bool) -> bool:
    """Whether ``optim.fused_update`` (``mode``) takes the step (ddptrain/update/fused.py): ``true``
    always (where it cannot, :func:`choose` refuses the config), ``auto`` where it applies (the fp32
    masters of the masters backend, updated by AdamW with its fused kernels, on a GPU with Triton),
    ``false`` never. :func:`choose` decides with it, and so does ``fused.for_run``."""
    mode = str(mode).lower()  # a CLI override `optim.fused_update=true` arrives as "True"
    if mode != "auto":
        return mode == "true"
    return cuda and adamw and fused_adamw and unsharded_masters and importlib.util.find_spec("triton") is not None


def _state_bytes(name: str, momentum: float) -> int:
    if name in ("adam", "adamw"):
        return 8  # exp_avg + exp_avg_sq, fp32 (the step counter is one scalar per tensor)
    if name == "sgd":
        return 4 if momentum else 0
    raise ValueError(f"optim.name={name!r}: no memory rule for this optimizer")


def choose(cfg: Any, world_size: Optional[int] = None, device: Any = None) -> Choice:
    """The backend that serves ``cfg`` on ``world_size`` ranks of ``device``.

    Args:
        cfg: a :class:`ddptrain.Config` (keys a schema lacks count as their defaults).
        world_size: ranks of the run; None: only the rules every world size shares (``load_config``).
        device: the training device (``torch.device`` or ``"cuda"`` / ``"cpu"``); None: not known yet
            (``optim.fused_update: auto`` then counts as off).

    Returns:
        The :class:`Choice`.

    Raises:
        ConfigError: (a :class:`Refused`) a combination no backend serves, naming the keys and the
            backend that would serve.
    """
    precision = str(_get(cfg, "trainer.precision", "fp32")).lower()
    bf16 = str(_get(cfg, "trainer.param_dtype", "fp32")).lower() == "bf16"
    zero = bool(_get(cfg, "optim.zero", False))
    shard = bool(_get(cfg, "optim.shard_grads", False))
    offload = str(_get(cfg, "optim.offload", "none")).lower() == "cpu"
    name = str(_get(cfg, "optim.name", "adamw")).lower()
    fused_update = str(_get(cfg, "optim.fused_update", "auto")).lower()
    ema_gpu = bool(_get(cfg, "ema.enabled", False)) and str(_get(cfg, "ema.device", "auto")).lower() == "gpu"

    def refuse(keys: tuple, why: str) -> None:
        raise Refused(keys, why)

    if bf16 and precision != "bf16":
        refuse(("trainer.param_dtype", "trainer.precision"),
               "trainer.param_dtype=bf16 needs trainer.precision=bf16 (fp16 parameters would need loss "
               "scaling of bf16 master gradients: not supported); the replicated backend serves "
               "trainer.param_dtype=fp32 with any trainer.precision")
    if shard and not (zero and bf16):
        refuse(("optim.shard_grads", "optim.zero", "trainer.param_dtype"),
               "optim.shard_grads=true needs optim.zero=true and trainer.param_dtype=bf16 (each rank keeps the "
               "gradients of the tensors whose sharded fp32 masters it owns: the sharded backend)")
    if shard and bool(_get(cfg, "dist.find_unused_parameters", False)):
        refuse(("optim.shard_grads", "dist.find_unused_parameters"),
               "optim.shard_grads=true reduces every trainable parameter in every backward: "
               "dist.find_unused_parameters=true is not supported with it (freeze the unused parameters, or set "
               "optim.shard_grads=false: the sharded backend then reduces through DDP)")
    if shard and str(_get(cfg, "dist.comm_hook", "none")).lower() != "none":
        refuse(("optim.shard_grads", "dist.comm_hook"),
               "optim.shard_grads=true sends the gradients in their own dtype (bf16 for a bf16 model): set "
               "dist.comm_hook=none, or optim.shard_grads=false (the sharded backend then reduces through DDP, "
               "which takes the hook)")
    if offload and not bf16:
        refuse(("optim.offload", "trainer.param_dtype"),
               "optim.offload=cpu needs trainer.param_dtype=bf16 (a bf16 model on the GPU, fp32 masters on the "
               "host: the host backend)")
    if fused_update == "true" and not (bf16 and name == "adamw" and not zero and not offload):
        refuse(("optim.fused_update", "trainer.param_dtype", "optim.name", "optim.zero", "optim.offload"),
               "optim.fused_update=true updates the fp32 masters of trainer.param_dtype=bf16 with AdamW on the "
               "training device (the masters backend): it needs trainer.param_dtype=bf16, optim.name=adamw, "
               "optim.zero=false and optim.offload=none")
    if offload and ema_gpu:
        refuse(("ema.enabled", "ema.device", "optim.offload"),
               "ema.device=gpu with optim.offload=cpu would hold 4 B per trainable parameter on the GPU that the "
               "offload moved off it, and copy the host masters up at every update: set ema.device=auto (the host "
               "backend keeps it in host memory, beside the masters)")
    if offload and bool(_get(cfg, "compile.cuda_graphs", False)):
        refuse(("compile.cuda_graphs", "optim.offload"),
               "compile.cuda_graphs=true needs optim.offload=none: the host backend's copies and hooks during the "
               "backward cannot be captured in a CUDA graph (the masters backend serves cuda graphs)")
    many = world_size is not None and world_size > 1
    if offload and many and not zero:
        refuse(("optim.offload", "optim.zero"),
               "optim.offload=cpu on several processes shards the masters as optim.zero does: set optim.zero=true "
               "(the host backend then holds each rank's partition; a resume may turn the offload off)")
    state = _state_bytes(name, float(_get(cfg, "optim.momentum", 0.0)))
    accum = int(_get(cfg, "trainer.grad_accum_steps", 1))
    if offload:
        return Choice("host", world_size or 1, shard_grads=shard and many, state_bytes=state, grad_accum=accum)
    if not bf16:
        return Choice("replicated", world_size or 1, zero=zero and many, state_bytes=state, grad_accum=accum)
    if zero and many:
        return Choice("sharded", world_size, shard_grads=shard, state_bytes=state, grad_accum=accum)
    cuda = device is not None and str(getattr(device, "type", device)).startswith("cuda")
    fused_adamw = (cuda if str(_get(cfg, "optim.fused", "auto")).lower() == "auto"
                   else str(_get(cfg, "optim.fused", "auto")).lower() == "true")
    fused = device is not None and fused_kernel_serves(fused_update, name == "adamw", fused_adamw, True, cuda)
    return Choice("masters", world_size or 1, fused=fused, state_bytes=state, grad_accum=accum)
