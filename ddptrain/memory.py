"""Estimate the per-GPU memory of the *model state* before a run: parameters, gradients,
optimizer state, DDP's gradient buckets and an EMA of the weights, with and without ZeRO, sharded
gradients, optimizer offload and a streamed frozen base; the host memory those tiers move there;
the activations of one real step (:func:`measure_activations`); and what fits 16 / 24 / 48 / 80 GB
cards.

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

With ``trainer.param_dtype: bf16`` (a bf16 model with fp32 master weights), the memory tiers
(docs/design.md), GPU bytes per trainable parameter on N GPUs, each composing with the ones above:

==========================================  ================  ==============================
tier                                        GPU B/param       host B/param (per rank)
==========================================  ================  ==============================
bf16 weights + fp32 masters                 16 (+4 transient) 0
+ sharded masters (``optim.zero``)          4 + 12/N (+4/N)   0
+ sharded gradients (``optim.shard_grads``) 2 + 2/N + 12/N    0
+ optimizer offload (``optim.offload: cpu``) 2 + 2/N (1 GPU: 2) (4 + 8 + 2)/N + one fp32 chunk
==========================================  ================  ==============================

The first row's 4 transient bytes are the fp32 gradients the step makes for the masters; the fused
update (``optim.fused_update``, on by default on a GPU where it applies) reads the bf16 gradients
itself and makes none. Sharded masters (ddptrain/update/sharded.py): the fp32 masters are split
with the Adam state, and the step makes a transient fp32 gradient for the rank's own masters
(``master_grads``: 4 or 4/N B). Sharded gradients: each rank keeps the bf16 gradients of its own
partition only. Optimizer offload (ddptrain/update/host.py): the masters (4 B), AdamW moments (8 B) and a bf16
staging copy of the gradients and weights (2 B) of each rank's partition live in pinned host
memory, with one chunk (``optim.offload_chunk_mb``, MB of bf16 gradients) of fp32 gradient
scratch; the GPU keeps the bf16 weights and gradients only (no GPU-side staging: the copies go
straight between the gradients/weights and the pinned buffer). Without sharded gradients the GPU
keeps ``2 + 2`` B; on one GPU with one micro-batch a step, ``2``: each gradient is copied to the
host and freed as the backward finishes it (with accumulation, the earlier micro-batches'
gradients wait on the GPU).

Frozen parameters (LoRA's base, a frozen encoder) cost their weights only: 2 B each under
``param_dtype: bf16``, no gradient, master or optimizer state (``--trainable`` on the command
line; a model's ``requires_grad`` flags otherwise). A frozen base streamed from pinned host
memory (``lora.base_offload: cpu``) costs the GPU a ring of ``lora.stream_ahead + 1`` blocks'
weights only (the largest block's size x the ring), plus any frozen weights outside the
streamed blocks, and costs each rank's host 2 B per streamed parameter.

An EMA of the weights (``ema.enabled``, ddptrain/ema.py) is one fp32 copy of the trainable
parameters, 4 B each, partitioned as the optimizer state is (``4 * shard``: 4/N B under
``optim.zero``, the sharded masters or a multi-rank offload; 4 B replicated otherwise). It lives on
the GPU, or in host memory (``host_ema``) with ``ema.device: cpu``, or ``auto`` under
``optim.offload: cpu``; ``cpu`` with the weights on the GPU adds two pinned staging buffers of
``ddptrain.ema.CHUNK_ELEMS`` fp32 elements (64 MiB). Evaluating on it with fp32 weights and no
masters briefly copies the trained weights to the host (not counted here).

Given a model (not only a parameter count) the estimate uses the real dtypes, counts frozen
parameters as parameters only, reproduces the partition (ZeroRedundancyOptimizer's greedy one
per parameter group, or the sharded masters' over all trainable tensors) so the optimizer
figure is that of the most loaded rank, cuts offload's chunks as ddptrain/update/host.py does, and
picks a streamed base's blocks as ddptrain/streamed_base.py does (``lora.stream_blocks``, else
the children of the largest ``nn.ModuleList``: a decoder's layers).

GB here: cards and caps are in GiB (2**30 bytes), as ``trainer.gpu_memory_gb``: a "24 GB"
RTX 3090/4090 has ~23.6-24 GiB. ``format_table`` prints both.

Command line::

    python -m ddptrain.memory --params 1.54e9 --world-size 2 --zero
    python -m ddptrain.memory --params 10.29e9 --world-size 2 --zero --param-dtype bf16
    python -m ddptrain.memory --params 10.29e9 --trainable 47.6e6 --param-dtype bf16   # LoRA
    python -m ddptrain.memory --params 2.14e9 --world-size 2 --param-dtype bf16 --shard-grads --offload
    python -m ddptrain.memory --preset glm4v-9b-lora --base-offload --param-dtype bf16
    python -m ddptrain.memory --config configs/glmasr.yaml --world-size 2 optim.offload=cpu
    python -m ddptrain.memory --params 2.14e9 --world-size 2 --zero --param-dtype bf16 --ema   # + EMA on the GPUs
    python -m ddptrain.memory --table          # what fits where: sizes x GPUs x full/LoRA (139 GiB GPUs)
    python -m ddptrain.memory --table --preset glm-asr-nano --activations-gb 6   # 16/24/48/80 GB cards x tiers
    python -m ddptrain.memory --table --preset glm-asr-nano --ema --ema-device cpu   # + an EMA in host memory
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ddptrain.config import Config, ConfigError, cli_prog, load_config
from ddptrain.contract import to_device
from ddptrain.ema import CHUNK_ELEMS as EMA_CHUNK_ELEMS
from ddptrain.optim import param_groups
from ddptrain.precision import KEEP_FP32
from ddptrain.update.backend import backend_class
from ddptrain.update.choose import Refused, choose
from ddptrain.update.sharded import partition

_ADAM = ("adam", "adamw")
GiB = 2**30

# The shipped workloads, with the counts they were measured with (nothing computed here):
# GLM-ASR-Nano-2512: BENCHMARKS.md ("2.14B parameters", the published config); VoxCPM-1.5:
# BENCHMARKS.md / examples/models/voxcpm_tts.py ("~0.8B"); the GLM-4.1V-9B shape with LoRA r=16 on
# the decoder's attention and MLP projections: the num_params / num_trainable of bench_9b.py's
# lora_ddptrain rows (bench/results/h200x1_2026-12-01_s9d_glm4v_9b_fix.jsonl). Its streamed
# blocks (streamed_base.find_blocks: the largest ModuleList) are the 40 decoder layers of
# 203,969,024 parameters each; 2,134,016,512 frozen parameters stay on the GPU (embedding, head,
# the vision tower), counted once from bench_9b.build on the meta device.
PRESETS: dict[str, dict[str, Any]] = {
    "glm-asr-nano": dict(title="GLM-ASR-Nano-2512, full fine-tune", params=2.14e9, trainable=None),
    "glm4v-9b-lora": dict(title="GLM-4.1V-9B shape, LoRA r=16", params=10_340_372_992, trainable=47_595_520,
                          stream_block_params=203_969_024, stream_resident_params=2_134_016_512),
    "voxcpm-1.5": dict(title="VoxCPM-1.5, full fine-tune", params=0.8e9, trainable=None),
}
CARDS_GIB = (16, 24, 48, 80)


def _switches(cfg) -> dict:
    """The keys beside the optimizer backend (ddptrain/update/choose.py decides that) the estimate
    reads. Read with defaults, so a config (or a schema of an older ddptrain) without the key counts
    as the switch off."""
    return {"shard_grads": bool(getattr(cfg.optim, "shard_grads", False)),
            "offload": str(getattr(cfg.optim, "offload", "none")).lower() == "cpu",
            "chunk_mb": float(getattr(cfg.optim, "offload_chunk_mb", 256.0)),
            "streamed": str(getattr(cfg.lora, "base_offload", "none")).lower() == "cpu",
            "ring": int(getattr(cfg.lora, "stream_ahead", 1)) + 1,
            "ema": bool(getattr(getattr(cfg, "ema", None), "enabled", False)),
            "ema_device": str(getattr(getattr(cfg, "ema", None), "device", "auto")).lower()}


def _zero_partition_max(sizes_by_group: list[list[int]], world_size: int) -> int:
    """Largest per-rank element count under ZeroRedundancyOptimizer's greedy partition
    (each group's tensors largest first, each to the rank with the smallest total so far)."""
    totals = [0] * world_size
    for sizes in sizes_by_group:
        for n in sorted(sizes, reverse=True):
            r = totals.index(min(totals))
            totals[r] += n
    return max(totals)


def _offload_host(sizes: list[int], fp32: list[bool], owners: list[int], world_size: int,
                  chunk_elems: int, per_state: int) -> dict:
    """Host bytes of the most loaded rank under ddptrain/update/host.py's layout: per owned element a
    4 B master, the optimizer state and a staging copy in the model dtype (2 B; 4 for tensors kept
    fp32), plus fp32 scratch for the largest chunk (whole tensors, cut once a run reaches
    ``chunk_elems``)."""
    best = None
    for r in range(world_size):
        owned = staging = largest = 0
        for kept in (False, True):
            run = 0
            for n, f, o in zip(sizes, fp32, owners):
                if o != r or f != kept:
                    continue
                owned, staging, run = owned + n, staging + n * (4 if kept else 2), run + n
                if run >= chunk_elems:
                    largest, run = max(largest, run), 0
            largest = max(largest, run)
        parts = {"masters": 4 * owned, "optimizer": per_state * owned, "grads": staging, "scratch": 4 * largest}
        if best is None or sum(parts.values()) > sum(best.values()):
            best = parts
    return best or {"masters": 0, "optimizer": 0, "grads": 0, "scratch": 0}


def stream_blocks(model: nn.Module, globs: Sequence[str] = ()) -> list[nn.Module]:
    """The blocks a streamed frozen base moves to the GPU one at a time, chosen as
    ddptrain/streamed_base.py's ``find_blocks`` does: the outermost modules matching ``globs``
    (``lora.stream_blocks``), else the children of the model's largest ``nn.ModuleList`` by
    parameter count (a decoder's layers, not its vision tower's blocks)."""
    import fnmatch

    if globs:
        blocks: list[tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if name and any(fnmatch.fnmatchcase(name, g) for g in globs) and not any(
                    name.startswith(b + ".") for b, _ in blocks):
                blocks.append((name, m))
        return [m for _, m in blocks]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))  # first of equals


def estimate_model_state(model_or_num_params: Union[nn.Module, int, float], cfg=None,
                         world_size: int = 1, trainable: Optional[float] = None,
                         stream_ring_bytes: Optional[float] = None, stream_resident: float = 0,
                         device: str = "cuda") -> dict:
    """Per-GPU bytes of the model state a ddptrain run holds, and the host bytes per rank of the
    tiers that move state there.

    Args:
        model_or_num_params: the model (exact: real dtypes, frozen parameters, partitions,
            offload chunks, streamed blocks), or a parameter count (fp32 unless ``param_dtype:
            bf16``, shard = ceil(trainable / N)).
        cfg: a :class:`ddptrain.Config`: ``optim.name``, ``optim.momentum``, ``optim.zero``,
            ``optim.shard_grads``, ``optim.offload``, ``optim.offload_chunk_mb``,
            ``dist.gradient_as_bucket_view``, ``trainer.precision``, ``trainer.param_dtype``,
            ``lora.base_offload``, ``lora.stream_ahead``, ``ema.enabled``, ``ema.device`` are
            read (a missing key = off);
            default: defaults.
        world_size: number of ranks (DDP, ZeRO, sharded gradients only act when > 1; offload
            gives each rank 1/N of the host state).
        trainable: with a parameter count, how many of them train (default: all); the rest
            are frozen (weights only).
        stream_ring_bytes: with a parameter count and ``lora.base_offload: cpu``, the GPU bytes
            of the streamed base's ring (largest block x (stream_ahead + 1)); a model gives it.
        stream_resident: with a parameter count and a streamed base, how many frozen parameters
            stay on the GPU (outside the streamed blocks); default 0.
        device: ``"cuda"`` (default) or ``"cpu"``: where the run trains. ``optim.fused_update:
            auto`` runs on CUDA only, and where it runs the step makes no fp32 master gradients.

    Returns:
        dict of bytes: on the GPU ``params`` (resident weights), ``stream_ring``, ``grads``,
        ``masters``, ``optimizer``, ``ddp_buckets``, ``ema``, ``total`` (their sum), the transient
        ``autocast_weight_copies`` and ``master_grads``; per rank on the host ``host_masters``,
        ``host_optimizer``, ``host_grads`` (bf16 staging), ``host_scratch`` (one fp32 chunk),
        ``host_base`` (a streamed frozen base, pinned), ``host_ema``, ``host_total``; plus ``num_params`` and
        ``num_trainable`` (counts).

    Raises:
        ValueError: world_size < 1, a negative parameter count (or more trainable than all), an
            optimizer with no rule, or a streamed base given by count without ``stream_ring_bytes``.
        ConfigError: a set-up the Trainer refuses (:func:`ddptrain.update.choose.choose`: offload
            without ``param_dtype: bf16``, or with ``ema.device: gpu``, ...).
    """
    if cfg is None:

        cfg = Config()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # the backend the run would take, and its refusals: the Trainer's own choice (ddptrain/update/choose.py)
    choice = choose(cfg, world_size, device)
    rates = backend_class(choice).rates(choice)  # bytes per parameter of each part, and whose parameters
    ddp = world_size > 1
    bf16 = rates["weights"][0] is not None  # bf16 weights (every backend but replicated)
    offload = choice.backend == "host"
    partitioned = any(scope == "owned" for _, scope in rates.values())  # some part is held for a partition only
    sw = _switches(cfg)
    streamed = sw["streamed"]
    chunk_elems = max(1, int(sw["chunk_mb"] * 2**20 / 2))  # as ddptrain/update/host.py: MB of bf16 gradients
    host = {"masters": 0, "optimizer": 0, "grads": 0, "scratch": 0}
    ring = host_base = 0

    if isinstance(model_or_num_params, nn.Module):

        model = model_or_num_params
        params = list({id(p): p for p in model.parameters()}.values())  # tied weights once
        trainable = [p for p in params if p.requires_grad]
        num_params = sum(p.numel() for p in params)
        num_trainable = sum(p.numel() for p in trainable)

        def weight_bytes(ps) -> int:  # bf16 model: every weight 2 B (the estimate ignores KEEP_FP32)
            return sum(p.numel() * (2 if bf16 else p.element_size()) for p in ps)

        param_bytes, weight_grads = weight_bytes(params), weight_bytes(trainable)
        sizes = [p.numel() for p in trainable]
        owners = [0] * len(trainable)
        if ddp and choice.backend in ("sharded", "host"):  # whole tensors over all trainable ones
            owners = partition(sizes, world_size)
            shard = max(sum(n for n, o in zip(sizes, owners) if o == r) for r in range(world_size))
        elif choice.zero:  # ZeroRedundancyOptimizer: each parameter group partitioned on its own
            groups = param_groups(model, cfg.optim.weight_decay)
            shard = _zero_partition_max([[p.numel() for p in g["params"]] for g in groups], world_size)
        else:
            shard = num_trainable
        # a replicated optimizer's state has the parameters' dtype
        state_scale = (trainable[0].element_size() if trainable else 4) / 4 if not bf16 else 1
        if offload:
            keep = {id(t) for m in model.modules() if isinstance(m, KEEP_FP32) for t in m.parameters(recurse=False)}
            host = _offload_host(sizes, [id(p) in keep for p in trainable], owners, world_size, chunk_elems,
                                 choice.state_bytes)
        if streamed:
            blocks = [[p for p in {id(p): p for p in b.parameters()}.values() if not p.requires_grad]
                      for b in stream_blocks(model, list(getattr(cfg.lora, "stream_blocks", None) or ()))]
            in_blocks = {id(p) for b in blocks for p in b}
            ring = sw["ring"] * max((weight_bytes(b) for b in blocks), default=0)
            host_base = weight_bytes([p for p in params if id(p) in in_blocks])
            param_bytes -= host_base  # resident: the trainable weights and frozen ones outside the blocks
    else:
        n = float(model_or_num_params)
        if n < 0:
            raise ValueError(f"number of parameters must be >= 0, got {model_or_num_params}")
        num_params = int(round(n))
        num_trainable = num_params if trainable is None else int(round(float(trainable)))
        if not 0 <= num_trainable <= num_params:
            raise ValueError(f"trainable={trainable} must be in [0, {num_params}]")
        w = 2 if bf16 else 4  # bytes of a weight and of its gradient
        shard = -(-num_trainable // world_size) if partitioned else num_trainable
        param_bytes, weight_grads, state_scale = w * num_params, w * num_trainable, 1
        if offload:
            host = {"masters": rates["host_masters"][0] * shard, "optimizer": rates["host_optimizer"][0] * shard,
                    "grads": rates["host_grads"][0] * shard,
                    "scratch": 4 * min(shard, chunk_elems)}  # about one chunk: the real ones end at tensor edges
        if streamed:
            if stream_ring_bytes is None:
                raise ValueError("lora.base_offload=cpu with a parameter count needs stream_ring_bytes "
                                 "(largest block x (stream_ahead + 1)), or give the model")
            resident = int(round(float(stream_resident)))
            if not 0 <= resident <= num_params - num_trainable:
                raise ValueError(f"stream_resident={stream_resident} must be in [0, {num_params - num_trainable}] "
                                 "(frozen parameters)")
            ring = int(stream_ring_bytes)
            host_base = w * (num_params - num_trainable - resident)
            param_bytes -= host_base

    def part(name: str) -> float:
        """The bytes of one part of the state on the most loaded rank, at the backend's rate."""
        b, scope = rates[name]
        return b * (shard if scope == "owned" else num_trainable)

    # gradients: the weights' own dtype (None), or the backend's rate (sharded: the rank's own; host on one
    # rank without accumulation: none, each leaves for the host as the backward makes it)
    grad_bytes = weight_grads if rates["grads"][0] is None else part("grads")
    masters, master_grads = part("masters"), part("master_grads")  # fp32 masters, the step's fp32 gradients
    opt_bytes = part("optimizer") * state_scale
    buckets = grad_bytes if ddp and not cfg.dist.gradient_as_bucket_view and not choice.shard_grads else 0
    ema = host_ema = 0
    if sw["ema"]:  # fp32, partitioned as the optimizer state: `shard` is the most loaded rank's share
        if sw["ema_device"] == "cpu" or (sw["ema_device"] == "auto" and offload):
            # ema.device=cpu with the weights on the GPU: two pinned buffers the update copies through
            host_ema = 4 * shard + (2 * 4 * EMA_CHUNK_ELEMS if shard and not offload else 0)
        else:
            ema = 4 * shard
    autocast = 2 * num_trainable if cfg.trainer.precision in ("bf16", "fp16") and not bf16 else 0
    # frozen weights are cast too, but count the trainable ones: a frozen feature encoder's
    # casts are freed as soon as its (gradient-free) forward is done
    host_total = sum(host.values()) + host_base + host_ema
    return {
        "params": int(param_bytes),
        "stream_ring": int(ring),
        "grads": int(grad_bytes),
        "masters": int(masters),
        "optimizer": int(opt_bytes),
        "ddp_buckets": int(buckets),
        "ema": int(ema),
        "total": int(param_bytes + ring + grad_bytes + masters + opt_bytes + buckets + ema),
        "autocast_weight_copies": int(autocast),
        "master_grads": int(master_grads),
        "host_masters": int(host["masters"]),
        "host_optimizer": int(host["optimizer"]),
        "host_grads": int(host["grads"]),
        "host_scratch": int(host["scratch"]),
        "host_base": int(host_base),
        "host_ema": int(host_ema),
        "host_total": int(host_total),
        "num_params": int(num_params),
        "num_trainable": int(num_trainable),
    }


def format_table(est: dict, title: str = "", local_world_size: int = 1,
                 activations: Optional[float] = None) -> str:
    """A small fixed-width table (GB = 1e9 bytes and GiB) of an :func:`estimate_model_state` result,
    with the host memory of offload / a streamed base (per rank, and per node of
    ``local_world_size`` ranks) when there is any, and ``activations`` (bytes) when known: the
    peak is then the state plus the larger of the activations (a measured term includes autocast's
    copies) and the step's transient master gradients, which do not coexist."""
    n = max(est["num_params"], 1)
    rows = [("parameters", est["params"])]
    if est.get("stream_ring"):
        rows.append(("streamed base ring", est["stream_ring"]))
    rows += [("gradients", est["grads"]), ("fp32 master weights", est["masters"]),
             ("optimizer state", est["optimizer"]), ("DDP buckets (extra)", est["ddp_buckets"])]
    if est.get("ema"):
        rows.append(("EMA of the weights (fp32)", est["ema"]))
    rows += [("total model state", est["total"]), ("+ autocast copies (transient)", est["autocast_weight_copies"]),
             ("+ fp32 master grads (transient)", est["master_grads"])]
    if activations is not None:
        rows.append(("+ activations (one step)", activations))
        rows.append(("peak per GPU", est["total"] + max(est["master_grads"], activations)))
    lines = [title] if title else []
    lines.append(f"{'':32s}{'GB':>10s}{'GiB':>10s}{'B/param':>10s}")
    for name, b in rows:
        lines.append(f"{name:32s}{b / 1e9:10.2f}{b / 2**30:10.2f}{b / n:10.2f}")
    if est.get("host_total"):
        host = [("host: fp32 master weights", est["host_masters"]), ("host: optimizer state", est["host_optimizer"]),
                ("host: gradient/weight staging", est["host_grads"]),
                ("host: fp32 gradient chunk", est["host_scratch"]),
                ("host: frozen base (pinned)", est["host_base"]), ("host: EMA of the weights", est.get("host_ema", 0)),
                ("host total per rank", est["host_total"])]
        if local_world_size > 1:
            host.append((f"host total per node ({local_world_size} ranks)", est["host_total"] * local_world_size))
        lines += [f"{name:32s}{b / 1e9:10.2f}{b / 2**30:10.2f}{b / n:10.2f}" for name, b in host if b]
    return "\n".join(lines)


def fits_table(sizes: Sequence[float] = (0.3e9, 1.5e9, 3e9, 7e9, 10.29e9, 14e9), gpus: Sequence[int] = (1, 2, 4, 8),
               lora_fraction: float = 0.005, gpu_gib: float = 139.0, headroom_gib: float = 24.0,
               measured: Optional[dict] = None, ema: bool = False, ema_device: str = "auto") -> str:
    """What fits where: a Markdown table of per-GPU model state (GiB) by model size, GPU count
    and full fine-tune / LoRA, from :func:`estimate_model_state`.

    Full fine-tune: ``param_dtype: bf16`` + AdamW, ZeRO (sharded masters) on more than one GPU.
    LoRA: the same with ``lora_fraction`` of the parameters trainable (r=16 on the attention and
    MLP projections of a GLM-4-9B-shaped decoder is 0.46%). A cell fits when the model state plus
    its transient master gradients plus ``headroom_gib`` for activations stays within ``gpu_gib``.

    Args:
        measured: ``{(size, gpus, "full" | "lora"): peak GiB}`` measured on a GPU: shown beside
            the estimate and marked as measured.
        ema, ema_device: ``ema.enabled``, ``ema.device``: an fp32 EMA of the trainable weights,
            in the cells on the GPU (``auto``, ``gpu``), or a cell's ``host`` GiB per rank (``cpu``).
    """

    head = "| parameters | mode | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in gpus) + " |"
    rows = [head, "| --- | --- |" + " --- |" * len(gpus)]
    for n in sizes:
        for mode in ("full", "lora"):
            cells = []
            for g in gpus:
                cfg = Config()
                cfg.trainer.precision, cfg.trainer.param_dtype, cfg.optim.zero = "bf16", "bf16", g > 1
                cfg.ema.enabled, cfg.ema.device = ema, ema_device
                est = estimate_model_state(n, cfg, g, trainable=n * lora_fraction if mode == "lora" else None)
                gib = (est["total"] + est["master_grads"]) / 2**30
                cell = f"{gib:.1f}" + ("" if gib + headroom_gib <= gpu_gib else " (no)")
                if est["host_total"]:
                    cell += f", host {est['host_total'] / 2**30:.1f}"
                got = (measured or {}).get((n, g, mode))
                cells.append(cell + (f", measured peak {got:.1f}" if got is not None else ""))
            rows.append(f"| {n / 1e9:.3g}B | {'LoRA' if mode == 'lora' else 'full'} | " + " | ".join(cells) + " |")
    return "\n".join(([_ema_note(ema_device)] if ema else []) + rows)


def _ema_note(device: str, offload_row: bool = False) -> str:
    """The tables' line on the EMA they include: where its 4 B per owned parameter are counted."""
    if device == "cpu":
        where = "in the host GiB per rank"
    else:
        where = "in the cells (GPU)"
        if offload_row:
            where += "; in the offload row on the host, beside the masters"
            if device == "gpu":
                where += " (the config refuses ema.device=gpu with optim.offload=cpu)"
    return f"With an fp32 EMA of the trainable weights (ema.device={device}): {where}."


def _tier_config(zero: bool = False, shard_grads: bool = False, offload: bool = False, streamed: bool = False,
                 chunk_mb: float = 256.0, stream_ahead: int = 1, ema: bool = False, ema_device: str = "auto"):

    cfg = Config()
    cfg.trainer.precision, cfg.trainer.param_dtype, cfg.optim.zero = "bf16", "bf16", zero
    # plain attribute sets: the estimate reads these keys with defaults, whichever ddptrain defines them
    cfg.optim.shard_grads, cfg.optim.offload_chunk_mb = shard_grads, chunk_mb
    cfg.optim.offload = "cpu" if offload else "none"
    cfg.lora.base_offload, cfg.lora.stream_ahead = "cpu" if streamed else "none", stream_ahead
    # ema.device=gpu with offload is refused by the config: that row keeps the EMA on the host (auto)
    cfg.ema.enabled, cfg.ema.device = ema, "auto" if offload and ema_device == "gpu" else ema_device
    return cfg


# (label, switches, shown for full fine-tunes / for LoRA): the rows of cards_table
TIERS = [
    ("DDP, bf16 weights + fp32 masters", {}, "full"),
    ("+ sharded masters (optim.zero)", {"zero": True}, "full"),
    ("+ sharded grads (optim.shard_grads)", {"zero": True, "shard_grads": True}, "full"),
    ("+ optimizer offload (optim.offload: cpu)", {"zero": True, "shard_grads": True, "offload": True}, "full"),
    ("LoRA, bf16 frozen base", {"zero": True}, "lora"),
    ("LoRA, streamed base (lora.base_offload: cpu)", {"zero": True, "streamed": True}, "lora"),
]


def cards_table(num_params: float, trainable: Optional[float] = None, gpus: Sequence[int] = (1, 2, 4, 8),
                cards_gib: Sequence[float] = CARDS_GIB, activations: Optional[float] = None,
                stream_block_bytes: Optional[float] = None, stream_resident: float = 0,
                chunk_mb: float = 256.0, stream_ahead: int = 1, title: str = "", ema: bool = False,
                ema_device: str = "auto") -> str:
    """What fits 16 / 24 / 48 / 80 GB cards: a Markdown table, one row per memory tier, one column
    per GPU count, each cell the model state per GPU (GiB, with the step's transient fp32 master
    gradients) and the smallest card it fits.

    A full fine-tune (``trainable`` None or all) gets the DDP / sharded masters / sharded grads /
    offload rows, a LoRA the bf16-base and streamed-base rows (adapters with sharded masters on
    several GPUs). A cell fits a card of G GiB (``trainer.gpu_memory_gb: G``) when the state plus
    the larger of ``activations`` and the transient master gradients is at most G; without an
    activation term the check is on the state only and the title says so. Host rows give the
    pinned host memory per rank / per node (all the GPUs on one node) of the tiers that use it.

    Args:
        num_params: all parameters; ``trainable``: those that train (default: all).
        activations: bytes of activations per GPU (:func:`measure_activations`, or given).
        stream_block_bytes: the largest streamed block's bf16 weights (a streamed-base row needs
            it; the ring is ``stream_ahead + 1`` of them); ``stream_resident``: frozen
            parameters outside the blocks, kept on the GPU.
        ema, ema_device: ``ema.enabled``, ``ema.device``: an fp32 EMA of the trainable weights,
            in the cells on the GPU, in the host rows in host memory (``cpu``; ``auto`` under offload).
    """
    lora = trainable is not None and trainable < num_params
    head = "| tier | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in gpus) + " |"
    rows = [head, "| --- |" + " --- |" * len(gpus)]
    for label, switches, kind in TIERS:
        if kind != ("lora" if lora else "full"):
            continue
        if switches.get("streamed") and stream_block_bytes is None:
            continue
        cells, host = [], []
        for g in gpus:
            cfg = _tier_config(chunk_mb=chunk_mb, stream_ahead=stream_ahead, ema=ema, ema_device=ema_device,
                               **switches)
            ring = None if stream_block_bytes is None else (stream_ahead + 1) * stream_block_bytes
            est = estimate_model_state(num_params, cfg, g, trainable, stream_ring_bytes=ring,
                                       stream_resident=stream_resident)
            state = est["total"] + est["master_grads"]
            need = est["total"] + max(est["master_grads"], activations or 0)
            card = next((c for c in sorted(cards_gib) if need <= c * GiB), None)
            cells.append(f"{state / GiB:.1f} ({f'{card:g}+' if card else 'no'})")
            if est["host_total"]:
                host.append(f"{est['host_total'] / GiB:.1f} / {est['host_total'] * g / GiB:.1f}")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
        if host:
            rows.append("| &nbsp;&nbsp;host GiB per rank / node | " + " | ".join(host) + " |")
    t = int(round(num_params if trainable is None else trainable))
    act = (f"the state + {activations / GiB:.1f} GiB of activations per GPU" if activations is not None
           else "state only, no activation term: give one with --activations-gb (measure_activations)")
    cards = " / ".join(f"{c:g}" for c in sorted(cards_gib))
    lines = [title] if title else []
    lines += [f"{num_params:.4g} parameters, {t:.4g} trainable. Cells: GiB of model state per GPU (with the "
              f"step's transient fp32 master grads) and the smallest {cards} GiB card it fits "
              f"('24+': 24 GiB and larger, 'no': none).",
              f"Fits by: {act}. Host rows: pinned host GiB per rank / per node (all the GPUs on one node).",
              *([_ema_note(ema_device, offload_row=not lora)] if ema else []), "", *rows]
    if lora and stream_block_bytes is None:
        lines.append("(the streamed-base row needs the ring: --stream-ring-gb, or a --preset)")
    return "\n".join(lines)


def measure_activations(model: nn.Module, loss_fn: Callable, batch: Any,
                        dtype: Optional[torch.dtype] = torch.bfloat16) -> Optional[dict]:
    """The activation term of one real training step: one forward + backward of ``batch`` on the
    model's CUDA device, peak allocated memory minus the model state at rest after it.

    The state at rest is what stays allocated once the step's graph is freed: the weights, the
    gradients this step made, whatever optimizer state exists. So the estimator's model state
    (which counts the gradients) plus this term is the measured peak. It covers the batch, the
    saved activations, autocast's weight copies and the backward's temporaries; the gradients
    the step made are set back to None afterwards.

    Args:
        model: the model as it will train (recompute, LoRA, dtypes applied), on a CUDA device.
        loss_fn: ``loss_fn(model, batch) -> (loss_sum, num_units)`` (the loss contract).
        batch: one batch as the loader yields it (moved to the model's device here); use the
            costliest one (``trainer.preflight`` finds it).
        dtype: autocast dtype of the forward, None for none.

    Returns:
        ``{"activations", "peak", "at_rest"}`` in bytes, or None on a CPU model (with a warning:
        there is no allocator to measure).
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        warnings.warn(f"measure_activations: the model is on {device}; the activation term can only be measured "
                      "on a CUDA device (give it to the estimator by hand: --activations-gb)")
        return None
    had_grad = {id(p) for p in model.parameters() if p.grad is not None}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        loss_sum, units = loss_fn(model, to_device(batch, device))
    (loss_sum.float() / max(float(units), 1.0)).backward()
    del loss_sum, units
    torch.cuda.synchronize(device)
    peak, at_rest = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
    for p in model.parameters():
        if id(p) not in had_grad:
            p.grad = None
    return {"activations": int(peak - at_rest), "peak": int(peak), "at_rest": int(at_rest)}


def _config_from(path: str, overrides: Sequence[str]):
    """A training YAML's library sections (a recipe's own sections are left out) + overrides."""
    import dataclasses
    import tempfile

    from omegaconf import OmegaConf


    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    known = {f.name for f in dataclasses.fields(Config)}
    mine = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k in known}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(mine)))
    try:
        return load_config(f.name, list(overrides))
    except ConfigError as e:
        raise ConfigError(str(e).replace(f.name, path)) from None
    finally:
        os.unlink(f.name)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=cli_prog("ddptrain.memory"),
                                description="Per-GPU model-state memory of a ddptrain run (params, grads, "
                                            "optimizer state, DDP buckets), with or without ZeRO, sharded "
                                            "gradients, optimizer offload or a streamed frozen base, and the host "
                                            "memory those use. GiB = 2**30 bytes, as trainer.gpu_memory_gb.",
                                epilog="With --config, key=value overrides may follow (as for training).")
    p.add_argument("--params", type=float, help="number of parameters, e.g. 1.54e9")
    p.add_argument("--trainable", type=float, default=None,
                   help="how many of them train (default: all; e.g. a LoRA's adapter parameters)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a shipped workload's parameter counts (instead of --params/--trainable): "
                        + "; ".join(f"{k}: {v['title']}" for k, v in PRESETS.items()))
    p.add_argument("--config", help="read optim / trainer / dist / lora keys from this training YAML "
                                     "(flags given here override it)")
    p.add_argument("--table", action="store_true",
                   help="with --params or --preset: what fits 16/24/48/80 GB cards at 1, 2, 4 and 8 GPUs, per "
                        "memory tier; alone: the what-fits-where table (sizes x GPUs x full/LoRA) for 139 GiB GPUs; "
                        "--ema adds the EMA where --ema-device puts it")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (GPUs)")
    p.add_argument("--local-world-size", type=int, default=None,
                   help="ranks per node, for the host memory per node (default: --world-size)")
    p.add_argument("--zero", action="store_true", help="optim.zero=true (shard the optimizer state)")
    p.add_argument("--shard-grads", action="store_true", help="optim.shard_grads=true (each rank reduces into "
                                                              "its own gradient shard)")
    p.add_argument("--offload", action="store_true", help="optim.offload=cpu (masters + optimizer state in "
                                                          "pinned host memory; needs --param-dtype bf16; on "
                                                          "several GPUs with optim.zero=true, as the Trainer asks)")
    p.add_argument("--offload-chunk-mb", type=float, default=None, help="optim.offload_chunk_mb (default 256)")
    p.add_argument("--base-offload", action="store_true", help="lora.base_offload=cpu (the frozen base streamed "
                                                               "from pinned host memory)")
    p.add_argument("--stream-ahead", type=int, default=None, help="lora.stream_ahead (default 1): the ring holds "
                                                                  "this many blocks + 1")
    p.add_argument("--stream-ring-gb", type=float, default=None,
                   help="GiB of the streamed base's ring on the GPU (largest block x (stream_ahead + 1)); "
                        "needed with --params, a preset knows it")
    p.add_argument("--activations-gb", type=float, default=None,
                   help="GiB of activations per GPU, e.g. measured with ddptrain.memory.measure_activations")
    p.add_argument("--ema", action="store_true", help="ema.enabled=true (an fp32 EMA of the trainable weights, "
                                                      "partitioned as the optimizer state)")
    p.add_argument("--ema-device", default=None, choices=["auto", "gpu", "cpu"],
                   help="ema.device (default auto: host memory under --offload, else the GPU)")
    p.add_argument("--optim", default=None, choices=["adamw", "adam", "sgd"], help="optim.name (default adamw)")
    p.add_argument("--no-momentum", action="store_true", help="SGD without momentum")
    p.add_argument("--no-bucket-view", action="store_true", help="dist.gradient_as_bucket_view=false")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"], help="default bf16")
    p.add_argument("--param-dtype", default=None, choices=["fp32", "bf16"],
                   help="trainer.param_dtype (bf16: bf16 model + fp32 master weights; needs --precision bf16; "
                        "default fp32)")
    args, overrides = p.parse_known_args(argv)
    if overrides and not args.config:
        p.error(f"unrecognized arguments: {' '.join(overrides)} (key=value overrides need --config)")
    preset = PRESETS.get(args.preset) if args.preset else None
    if preset and args.params is not None:
        p.error("--preset gives the parameter counts: leave out --params")
    num_params = preset["params"] if preset else args.params
    trainable = preset["trainable"] if preset and args.trainable is None else args.trainable
    activations = None if args.activations_gb is None else args.activations_gb * GiB


    if args.config:
        try:
            cfg = _config_from(args.config, overrides)
        except ConfigError as e:
            p.error(str(e))
    else:
        cfg = Config()
        cfg.trainer.precision = "bf16"  # the command line's defaults (a training config's are fp32)
    cfg.optim.name = args.optim or cfg.optim.name
    cfg.optim.zero = cfg.optim.zero or args.zero
    cfg.optim.momentum = 0.0 if args.no_momentum else cfg.optim.momentum
    cfg.dist.gradient_as_bucket_view = cfg.dist.gradient_as_bucket_view and not args.no_bucket_view
    cfg.trainer.precision = args.precision or cfg.trainer.precision
    cfg.trainer.param_dtype = args.param_dtype or cfg.trainer.param_dtype
    sw = _switches(cfg)  # plain attribute sets below: the estimate reads these keys with defaults
    cfg.optim.shard_grads = sw["shard_grads"] or args.shard_grads
    cfg.optim.offload = "cpu" if sw["offload"] or args.offload else "none"
    # --offload on several GPUs: the host backend's partition, which the Trainer runs with optim.zero only
    cfg.optim.zero = cfg.optim.zero or (args.offload and args.world_size > 1)
    cfg.optim.offload_chunk_mb = args.offload_chunk_mb or sw["chunk_mb"]
    cfg.lora.base_offload = "cpu" if sw["streamed"] or args.base_offload else "none"
    cfg.lora.stream_ahead = sw["ring"] - 1 if args.stream_ahead is None else args.stream_ahead
    cfg.ema.enabled = sw["ema"] or args.ema
    cfg.ema.device = args.ema_device or sw["ema_device"]

    block = preset.get("stream_block_params") if preset else None
    ring = args.stream_ring_gb * GiB if args.stream_ring_gb is not None else (
        None if block is None else 2 * block * (cfg.lora.stream_ahead + 1))
    resident = preset.get("stream_resident_params", 0) if preset else 0
    if args.table:
        if num_params is None:
            print(fits_table(ema=cfg.ema.enabled, ema_device=cfg.ema.device))
            return 0
        print(cards_table(num_params, trainable, activations=activations,
                          stream_block_bytes=None if ring is None else ring / (cfg.lora.stream_ahead + 1),
                          stream_resident=resident, chunk_mb=cfg.optim.offload_chunk_mb,
                          stream_ahead=cfg.lora.stream_ahead, title=preset["title"] if preset else "",
                          ema=cfg.ema.enabled, ema_device=cfg.ema.device))
        return 0
    if num_params is None:
        p.error("--params or --preset is required (or --table)")
    try:
        choice = choose(cfg, args.world_size, "cuda")  # what the Trainer would refuse, refused here with its words
    except Refused as e:  # named by the flags that set the keys, then the Trainer's reason
        flags = {"ema.enabled": "--ema", "ema.device": f"--ema-device {cfg.ema.device}", "optim.offload": "--offload",
                 "optim.zero": "--zero", "optim.shard_grads": "--shard-grads",
                 "trainer.param_dtype": f"--param-dtype {cfg.trainer.param_dtype}",
                 "trainer.precision": f"--precision {cfg.trainer.precision}"}
        p.error(f"{' with '.join(flags.get(k, k) for k in e.keys)}: {e}")
    if cfg.lora.base_offload == "cpu" and ring is None:
        p.error("--base-offload with --params needs --stream-ring-gb (the GPU ring of streamed blocks)")
    est = estimate_model_state(num_params, cfg, args.world_size, trainable, stream_ring_bytes=ring,
                               stream_resident=resident)
    o = cfg.optim
    tiers = [" + ZeRO" if o.zero and args.world_size > 1 else "",
             " + sharded grads" if o.shard_grads and args.world_size > 1 else "",
             " + optimizer offload" if o.offload == "cpu" else "",
             " + streamed base" if cfg.lora.base_offload == "cpu" else "",
             f" + EMA ({cfg.ema.device})" if cfg.ema.enabled else ""]
    title = (f"{preset['title'] + ': ' if preset else ''}{num_params:.3g} parameters"
             f"{f' ({trainable:.3g} trainable)' if trainable is not None else ''}, "
             f"{args.world_size} GPU(s), optim={o.name}{''.join(tiers)}, precision={cfg.trainer.precision}"
             f"{', param_dtype=bf16' if cfg.trainer.param_dtype == 'bf16' else ''}"
             f"{', gradient_as_bucket_view=false' if not cfg.dist.gradient_as_bucket_view else ''}; "
             f"the {choice.backend} backend (per GPU)")
    print(format_table(est, title, args.local_world_size or args.world_size, activations))
    return 0


if __name__ == "__main__":
    sys.exit(main())
