"""Estimate the per-GPU memory of the *model state* before a run: parameters, gradients,
optimizer state and DDP's gradient buckets, with and without ZeRO.

What ddptrain keeps per trainable parameter (all fp32 "master" tensors, whatever
``trainer.precision`` says: autocast only makes bf16/fp16 *copies* for the forward pass):

=====================  =========================  =========================================
tensor                 bytes / parameter          notes
=====================  =========================  =========================================
parameters             4                          every rank holds all of them (DDP)
gradients              4                          from backward to ``zero_grad``; with
                                                  ``dist.gradient_as_bucket_view`` they *are*
                                                  DDP's buckets, which stay allocated
DDP buckets            4 if not bucket view       a second copy of the gradients, only when
                                                  ``dist.gradient_as_bucket_view: false``
Adam(W) moments        8 / N with ``optim.zero``  ``exp_avg`` + ``exp_avg_sq``; ZeRO gives each
                       (else 8)                   rank the state of ~1/N of the parameters
SGD momentum           4 / N (else 4)             0 without momentum
=====================  =========================  =========================================

So plain DDP + AdamW costs 16 B/parameter on every rank, and ZeRO over N ranks
``8 + 8/N`` (12 B on 2 GPUs). Activations come on top and depend on the batch; so do the
*transient* bf16/fp16 weight copies autocast makes in the forward pass (2 B/parameter, kept
until backward has used them), reported separately as ``autocast_weight_copies``.

With ``trainer.param_dtype: bf16`` (a bf16 model with fp32 master weights): 2 (weights) + 2
(gradients) + 4 (masters) + 8 (Adam) = 16 B on one rank. With ZeRO on N ranks the masters are
sharded with the Adam state (ddptrain/sharded_masters.py): ``4 + 12/N`` (10 B on 2 GPUs, 5.5 B
on 8). No autocast copies; a transient fp32 gradient for the rank's own masters during the step
(``master_grads``: 4 or 4/N B).

Frozen parameters (LoRA's base, a frozen encoder) cost their weights only: 2 B each under
``param_dtype: bf16``, no gradient, master or optimizer state (``--trainable`` on the command
line; a model's ``requires_grad`` flags otherwise).

Given a model (not only a parameter count) the estimate uses the real dtypes, counts frozen
parameters as parameters only, and reproduces the partition (ZeroRedundancyOptimizer's greedy
one per parameter group, or the sharded masters' over all trainable tensors) so the optimizer
figure is that of the most loaded rank.

Command line::

    python -m ddptrain.memory --params 1.54e9 --world-size 2 --zero
    python -m ddptrain.memory --params 10.29e9 --world-size 2 --zero --param-dtype bf16
    python -m ddptrain.memory --params 10.29e9 --trainable 47.6e6 --param-dtype bf16   # LoRA
    python -m ddptrain.memory --table          # what fits where: sizes x GPUs x full/LoRA
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence, Union

from torch import nn

_ADAM = ("adam", "adamw")


def _state_bytes_per_param(cfg) -> int:
    """Optimizer state bytes per fp32 trainable parameter (before ZeRO sharding)."""
    name = cfg.optim.name.lower()
    if name in _ADAM:
        return 8  # exp_avg + exp_avg_sq, fp32 (the step counter is one scalar per tensor)
    if name == "sgd":
        return 4 if cfg.optim.momentum else 0
    raise ValueError(f"optim.name={cfg.optim.name!r}: no memory rule for this optimizer")


def _zero_partition_max(sizes_by_group: list[list[int]], world_size: int) -> int:
    """Largest per-rank element count under ZeroRedundancyOptimizer's greedy partition
    (each group's tensors largest first, each to the rank with the smallest total so far)."""
    totals = [0] * world_size
    for sizes in sizes_by_group:
        for n in sorted(sizes, reverse=True):
            r = totals.index(min(totals))
            totals[r] += n
    return max(totals)


def estimate_model_state(model_or_num_params: Union[nn.Module, int, float], cfg=None,
                         world_size: int = 1, trainable: Optional[float] = None) -> dict:
    """Per-GPU bytes of the model state a ddptrain run holds.

    Args:
        model_or_num_params: the model (exact: real dtypes, frozen parameters, ZeRO partition),
            or a parameter count (fp32 unless ``param_dtype: bf16``, ZeRO shard =
            ceil(trainable / N)).
        cfg: a :class:`ddptrain.Config` (``optim.name``, ``optim.momentum``, ``optim.zero``,
            ``dist.gradient_as_bucket_view``, ``trainer.precision``, ``trainer.param_dtype``
            are read); default: defaults.
        world_size: number of ranks (DDP and ZeRO only act when > 1).
        trainable: with a parameter count, how many of them train (default: all); the rest
            are frozen (weights only).

    Returns:
        dict of bytes: ``params``, ``grads``, ``optimizer``, ``ddp_buckets``, ``total`` (their
        sum), the transient ``autocast_weight_copies``, plus ``num_params`` and
        ``num_trainable`` (counts).

    Raises:
        ValueError: world_size < 1, a negative parameter count (or more trainable than all), or
            an optimizer with no rule.
    """
    if cfg is None:
        from ddptrain.config import Config

        cfg = Config()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    zero = bool(cfg.optim.zero) and world_size > 1  # the Trainer ignores optim.zero on one rank
    ddp = world_size > 1
    per_state = _state_bytes_per_param(cfg)
    bf16 = str(cfg.trainer.param_dtype).lower() == "bf16"

    if isinstance(model_or_num_params, nn.Module):
        from ddptrain.optim import param_groups

        model = model_or_num_params
        params = list({id(p): p for p in model.parameters()}.values())  # tied weights once
        trainable = [p for p in params if p.requires_grad]
        num_params = sum(p.numel() for p in params)
        num_trainable = sum(p.numel() for p in trainable)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        if zero and bf16:  # sharded masters: whole tensors over all trainable ones at once
            from ddptrain.sharded_masters import partition

            owners = partition([p.numel() for p in trainable], world_size)
            shard = max(sum(p.numel() for p, o in zip(trainable, owners) if o == r) for r in range(world_size))
        elif zero:
            groups = param_groups(model, cfg.optim.weight_decay)
            shard = _zero_partition_max([[p.numel() for p in g["params"]] for g in groups], world_size)
        else:
            shard = num_trainable
        # optimizer state has the parameters' dtype (fp32 master weights)
        state_elt = trainable[0].element_size() if trainable else 4
        opt_bytes = shard * (per_state // 4) * state_elt
    else:
        n = float(model_or_num_params)
        if n < 0:
            raise ValueError(f"number of parameters must be >= 0, got {model_or_num_params}")
        num_params = int(round(n))
        num_trainable = num_params if trainable is None else int(round(float(trainable)))
        if not 0 <= num_trainable <= num_params:
            raise ValueError(f"trainable={trainable} must be in [0, {num_params}]")
        param_bytes, grad_bytes = 4 * num_params, 4 * num_trainable
        shard = -(-num_trainable // world_size) if zero else num_trainable
        opt_bytes = per_state * shard

    masters = master_grads = 0
    if bf16:
        # bf16 model + fp32 masters: the weights (frozen ones too) and gradients shrink to 2 B,
        # the Adam state stays fp32, and the step makes fp32 gradients for the rank's own
        # masters. Under ZeRO the masters are sharded with the Adam state (sharded_masters.py).
        param_bytes, grad_bytes = 2 * num_params, 2 * num_trainable
        masters, master_grads = 4 * shard, 4 * shard
        opt_bytes = shard * per_state
    buckets = grad_bytes if ddp and not cfg.dist.gradient_as_bucket_view else 0
    autocast = 2 * num_trainable if cfg.trainer.precision in ("bf16", "fp16") and not masters else 0
    # frozen weights are cast too, but count the trainable ones: a frozen feature encoder's
    # casts are freed as soon as its (gradient-free) forward is done
    return {
        "params": int(param_bytes),
        "grads": int(grad_bytes),
        "masters": int(masters),
        "optimizer": int(opt_bytes),
        "ddp_buckets": int(buckets),
        "total": int(param_bytes + grad_bytes + masters + opt_bytes + buckets),
        "autocast_weight_copies": int(autocast),
        "master_grads": int(master_grads),
        "num_params": int(num_params),
        "num_trainable": int(num_trainable),
    }


def format_table(est: dict, title: str = "") -> str:
    """A small fixed-width table (GB = 1e9 bytes and GiB) of an :func:`estimate_model_state` result."""
    n = max(est["num_params"], 1)
    rows = [("parameters", est["params"]), ("gradients", est["grads"]), ("fp32 master weights", est["masters"]),
            ("optimizer state", est["optimizer"]), ("DDP buckets (extra)", est["ddp_buckets"]),
            ("total model state", est["total"]), ("+ autocast copies (transient)", est["autocast_weight_copies"]),
            ("+ fp32 master grads (transient)", est["master_grads"])]
    lines = [title] if title else []
    lines.append(f"{'':32s}{'GB':>10s}{'GiB':>10s}{'B/param':>10s}")
    for name, b in rows:
        lines.append(f"{name:32s}{b / 1e9:10.2f}{b / 2**30:10.2f}{b / n:10.2f}")
    return "\n".join(lines)


def fits_table(sizes: Sequence[float] = (0.3e9, 1.5e9, 3e9, 7e9, 10.29e9, 14e9), gpus: Sequence[int] = (1, 2, 4, 8),
               lora_fraction: float = 0.005, gpu_gib: float = 139.0, headroom_gib: float = 24.0,
               measured: Optional[dict] = None) -> str:
    """What fits where: a Markdown table of per-GPU model state (GiB) by model size, GPU count
    and full fine-tune / LoRA, from :func:`estimate_model_state`.

    Full fine-tune: ``param_dtype: bf16`` + AdamW, ZeRO (sharded masters) on more than one GPU.
    LoRA: the same with ``lora_fraction`` of the parameters trainable (r=16 on the attention and
    MLP projections of a GLM-4-9B-shaped decoder is 0.46%). A cell fits when the model state plus
    its transient master gradients plus ``headroom_gib`` for activations stays within ``gpu_gib``.

    Args:
        measured: ``{(size, gpus, "full" | "lora"): peak GiB}`` measured on a GPU: shown beside
            the estimate and marked as measured.
    """
    from ddptrain.config import Config

    head = "| parameters | mode | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in gpus) + " |"
    rows = [head, "| --- | --- |" + " --- |" * len(gpus)]
    for n in sizes:
        for mode in ("full", "lora"):
            cells = []
            for g in gpus:
                cfg = Config()
                cfg.trainer.precision, cfg.trainer.param_dtype, cfg.optim.zero = "bf16", "bf16", g > 1
                est = estimate_model_state(n, cfg, g, trainable=n * lora_fraction if mode == "lora" else None)
                gib = (est["total"] + est["master_grads"]) / 2**30
                cell = f"{gib:.1f}" + ("" if gib + headroom_gib <= gpu_gib else " (no)")
                got = (measured or {}).get((n, g, mode))
                cells.append(cell + (f", measured peak {got:.1f}" if got is not None else ""))
            rows.append(f"| {n / 1e9:.3g}B | {'LoRA' if mode == 'lora' else 'full'} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddptrain.memory",
                                description="Per-GPU model-state memory of a ddptrain run (params, grads, "
                                            "optimizer state, DDP buckets), with or without ZeRO.")
    p.add_argument("--params", type=float, help="number of parameters, e.g. 1.54e9")
    p.add_argument("--trainable", type=float, default=None,
                   help="how many of them train (default: all; e.g. a LoRA's adapter parameters)")
    p.add_argument("--table", action="store_true", help="print the what-fits-where table (sizes x GPUs x full/LoRA) "
                                                        "for 139 GiB GPUs and exit")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (GPUs)")
    p.add_argument("--zero", action="store_true", help="optim.zero=true (shard the optimizer state)")
    p.add_argument("--optim", default="adamw", choices=["adamw", "adam", "sgd"])
    p.add_argument("--no-momentum", action="store_true", help="SGD without momentum")
    p.add_argument("--no-bucket-view", action="store_true", help="dist.gradient_as_bucket_view=false")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="trainer.param_dtype (bf16: bf16 model + fp32 master weights; needs --precision bf16)")
    args = p.parse_args(argv)
    if args.table:
        print(fits_table())
        return 0
    if args.params is None:
        p.error("--params is required (or --table)")

    from ddptrain.config import Config

    cfg = Config()
    cfg.optim.name, cfg.optim.zero = args.optim, args.zero
    cfg.optim.momentum = 0.0 if args.no_momentum else cfg.optim.momentum
    cfg.dist.gradient_as_bucket_view = not args.no_bucket_view
    cfg.trainer.precision, cfg.trainer.param_dtype = args.precision, args.param_dtype
    est = estimate_model_state(args.params, cfg, args.world_size, args.trainable)
    title = (f"{args.params:.3g} parameters"
             f"{f' ({args.trainable:.3g} trainable)' if args.trainable is not None else ''}, "
             f"{args.world_size} GPU(s), optim={args.optim}"
             f"{' + ZeRO' if cfg.optim.zero and args.world_size > 1 else ''}, precision={args.precision}"
             f"{', param_dtype=bf16' if args.param_dtype == 'bf16' else ''}"
             f"{', gradient_as_bucket_view=false' if args.no_bucket_view else ''} (per GPU)")
    print(format_table(est, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
