"""Typed configuration: dataclasses with documented defaults, loaded from YAML + CLI overrides.

Why dataclasses on ``OmegaConf.structured``: the schema *is* the documentation (every default
lives next to a comment that says what it does), and OmegaConf rejects an unknown or mistyped
key instead of silently ignoring it. A run that trains for a day with ``optim.lr`` spelled
``optim.lrr`` is the bug we want to make impossible.

User scripts extend the schema by subclassing :class:`Config` and adding their own sections::

    @dataclass
    class MyConfig(ddptrain.Config):
        model: MyModelConfig = field(default_factory=MyModelConfig)

    cfg = ddptrain.load_config("configs/x.yaml", sys.argv[1:], schema=MyConfig)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import math
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from ddptrain.data.config import DataConfig
from ddptrain.data.errors import DataError
from ddptrain.data.manifest import field_spellings
from ddptrain.errors import ConfigError
from ddptrain.update.choose import Refused, choose


@dataclass
class TrainerConfig:
    output_dir: str = "runs/default"  # run folder: checkpoints/, tensorboard/, metrics.jsonl
    max_epochs: int = 1  # passes over the training data (ignored when max_steps > 0)
    max_steps: int = 0  # optimizer steps to run; 0 = run max_epochs
    grad_accum_steps: int = 1  # micro-batches per optimizer step (per rank)
    precision: str = "fp32"  # autocast dtype of the forward (fp16 also scales the loss: GradScaler)
    param_dtype: str = "fp32"  # bf16: with precision bf16, a bf16 model + fp32 master weights in the optimizer (no weight casts, bf16 grads)
    clip_grad_norm: float = 0.0  # clip the global grad norm to this; 0 = no clipping (norm still logged)
    seed: int = 0  # model init / dropout seed; each rank adds its rank
    eval_every: int = 0  # evaluate every N optimizer steps; 0 = only at the end
    max_nonfinite_steps: int = 5  # abort after this many consecutive non-finite steps
    device: str = "auto"  # auto: cuda:LOCAL_RANK if available, else cpu; cuda: cuda:LOCAL_RANK
    cuda_alloc_conf: str = "expandable_segments:True"  # PyTorch's CUDA allocator settings when PYTORCH_CUDA_ALLOC_CONF is unset; "" = PyTorch's defaults
    gpu_memory_gb: float = 0.0  # cap this process's GPU memory at this many GiB (the caching allocator's fraction), so a large GPU behaves like a smaller card; 0 = no cap
    deterministic: bool = False  # torch.use_deterministic_algorithms (slower; for bitwise tests)
    fp16_init_scale: float = 65536.0  # GradScaler initial loss scale
    fp16_min_scale: float = 1.0e-4  # a loss scale below this is reported as a collapse and aborts
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # save + exit on these (SIGTERM, TERM and term all name SIGTERM)
    preempt_exit_code: int = 0  # exit code after a preemption save (0: torchrun does not restart)
    preflight: str = "none"  # before training, one step on the costliest batch of the worst few buckets (worst) or of every bucket (all), so an out-of-memory error names its bucket in the first minute (ddptrain/preflight.py)
    gc_every_steps: int = 50  # Python GC: collect young objects every N steps on all ranks, full at epoch ends/evals/saves, automatic GC off during fit; 0 = Python's automatic GC


@dataclass
class DistConfig:
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = 600.0  # collective timeout: a dead peer becomes an error after this long
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    gradient_as_bucket_view: bool = True  # grads alias DDP buckets: saves one copy of the grads
    find_unused_parameters: bool = False  # set True for partly frozen / branchy models (slower)
    broadcast_buffers: bool = True  # sync buffers (e.g. BatchNorm stats) from rank 0 every forward
    comm_hook: str = "none"  # compress gradients to this dtype for the all-reduce
    preflight: str = "auto"  # at start, time an all-reduce of one gradient bucket (bucket_cap_mb), log its bus bandwidth and warn (naming NCCL_P2P_LEVEL) when it is far below the GPUs' link: auto = on more than one GPU, always = also on CPU (gloo), off (ddptrain/dist.py)
    expected_busbw_gbps: float = 0.0  # dist.preflight warns below half this all-reduce bus bandwidth (GB/s); 0 = the link's figure from ddptrain/dist.py's table (none across nodes or without peer access: no warning)


@dataclass
class OptimConfig:
    name: str = "adamw"  # torch.optim.AdamW, Adam (weight decay added to the gradient) or SGD
    lr: float = 1.0e-3  # peak learning rate
    weight_decay: float = 0.01  # applied to weights only, never to biases or norm parameters
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # Adam(W) betas
    eps: float = 1.0e-8  # Adam(W) epsilon
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = False  # SGD Nesterov momentum
    fused: str = "auto"  # auto: fused Adam(W) kernels on CUDA
    zero: bool = False  # shard optimizer state across ranks (ZeroRedundancyOptimizer)
    zero_bucket_view: bool = True  # ZeRO: flat parameter buckets, one broadcast per rank after the step instead of one per parameter
    shard_grads: bool = False  # ZeRO-2: each rank keeps only its own partition's reduced gradients (2/N B/param instead of 2), replacing DDP; needs optim.zero and trainer.param_dtype=bf16; one rank: no change (ddptrain/sharded_grads.py)
    offload: str = "none"  # cpu: fp32 masters + optimizer state in pinned host memory, updated there (each rank its partition); needs trainer.param_dtype=bf16 (ddptrain/update/host.py)
    offload_chunk_mb: float = 256.0  # optim.offload: gradients go down, are updated and go back up in chunks of this many MB (of bf16 gradients), so the copies overlap the host update
    fused_update: str = "auto"  # AdamW on the fp32 masters of trainer.param_dtype=bf16 in one kernel per param group that reads the bf16 gradients and writes the bf16 weights (~30 B of traffic a parameter instead of ~40, no fp32 gradient buffer); same optimizer state. auto: on a GPU with Triton wherever it applies (optim.name=adamw, optim.fused not false, optim.zero=false, optim.offload=none); true: required, refused elsewhere (ddptrain/update/fused.py)


@dataclass
class SchedulerConfig:
    name: str = "constant"  # LR schedule after the warmup (ddptrain/optim.py, lr_lambda)
    warmup_steps: int = 0  # linear warmup from 0 to optim.lr
    min_lr_ratio: float = 0.0  # cosine/linear decay floor, as a fraction of optim.lr
    decay_steps: int = 0  # steps over which to decay; 0 = the run's total steps


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # save every N optimizer steps; 0 = only at the end
    save_at_end: bool = True  # save after the last step
    keep_last: int = 3  # keep this many most recent checkpoints (0 = keep all)
    keep_best: int = 0  # also keep the best K by `best_metric` (0 = off); a scheduled save evaluates first if its step had no evaluation
    best_metric: str = "loss"  # eval metric name for keep_best; <metric>/mean (e.g. wer/mean) is the mean over the eval sources of <metric>/<source>, each source counted once (ddptrain/regression.py)
    best_mode: str = "min"  # min: a lower best_metric is better; max: a higher one
    resume: str = "none"  # auto: the newest complete checkpoint in output_dir, if any; or a checkpoint path
    min_free_gb: float = 1.0  # refuse to start if the checkpoint disk has less free space
    start_over: bool = False  # a new run in a folder holding another run's checkpoints: true moves that run's files to output_dir/archive/ (else refused)
    trainable_only: bool = False  # model.safetensors holds the trainable parameters and buffers only (LoRA adapters, a new head); the frozen rest comes from checkpoint.base_model
    base_model: str = ""  # the pretrained weights the frozen parameters were loaded from (safetensors file or folder); named in trainable-only checkpoints, ddptrain.load_weights reads it first


@dataclass
class LoggingConfig:
    log_every: int = 10  # log training scalars every N optimizer steps
    tensorboard: bool = True  # write TensorBoard events to output_dir/tensorboard
    jsonl: bool = True  # write output_dir/metrics.jsonl (one JSON object per logged step)
    progress_bar: bool = True  # tqdm progress bar with ETA on rank 0
    peak_tflops: float = 0.0  # one GPU's dense peak for the logged mfu (model FLOPs from Trainer(flops_fn=...)), TFLOP/s; 0 = the bf16 peak of the GPU's name (ddptrain/throughput.py); on CPU without it no mfu is logged
    allreduce_share: bool = True  # DDP on several ranks: time each rank's wait for the gradient all-reduce after its backward and log allreduce_frac_min/max (a Python comm hook, two CUDA events a step)


@dataclass
class RecomputeConfig:
    enabled: bool = False  # activation (gradient) checkpointing: recompute activations in backward
    module_classes: list[str] = field(default_factory=list)  # wrap modules of these class names
    name_globs: list[str] = field(default_factory=list)  # ... and/or modules whose names match these globs
    every_k: int = 1  # wrap only every k-th matching module (1 = all): memory/speed trade-off
    offload: str = "none"  # cpu: the saved tensors of the selected modules wait in pinned host memory for the backward (side-stream copies, prefetched): with recompute.enabled the inputs each recomputed block keeps, without it every tensor saved inside the selected modules (ddptrain/activation_offload.py)


@dataclass
class CompileConfig:
    enabled: bool = False  # torch.compile the model for training steps (fuses casts, copies, elementwise chains)
    module_classes: list[str] = field(default_factory=list)  # compile only modules of these class names ("regional"); empty + no globs = whole model
    name_globs: list[str] = field(default_factory=list)  # ... and/or modules whose names match these globs
    mode: str = "default"  # torch.compile mode
    dynamic: str = "auto"  # auto: static shapes, dynamic after the first shape change
    backend: str = "inductor"  # torch.compile backend (aot_eager: trace without code generation, for debugging)
    recompile_limit: int = 32  # compiled variants dynamo keeps per compiled function (torch's default: 8); past it the block runs eagerly (slower; under recompute an error; the Trainer warns and logs compile_eager_fallbacks). A class reused with other dtypes/flags (VoxCPM2's four MiniCPM stacks) needs more than 8
    ddp_overlap: bool = True  # whole model on >1 GPU: split the graph at DDP buckets so the all-reduce overlaps the backward; false: one graph, all-reduce after it
    cuda_graphs: bool = False  # one GPU: capture each batch shape's forward + backward as a CUDA graph after its warm-up and replay it (ddptrain/cuda_graphs.py: what loss_fn must do, what it costs); for host-bound steps of many small kernels
    cuda_graph_warmup: int = 1  # compile.cuda_graphs: eager micro-batches of a shape before it is captured
    cuda_graph_max: int = 64  # compile.cuda_graphs: shapes captured at most; later new shapes run eagerly (each graph keeps its static input buffers)


@dataclass
class LoraConfig:
    enabled: bool = False  # add LoRA adapters (ddptrain/lora.py) to the nn.Linear layers named by lora.targets; every other parameter is frozen
    targets: list[str] = field(default_factory=list)  # module-name globs of the layers to adapt, e.g. ["*.self_attn.q_proj", "*.mlp.*_proj"]
    rank: int = 16  # adapter rank r
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input (training only)
    trainable: list[str] = field(default_factory=list)  # parameter-name globs that stay trainable besides the adapters (a new head, norms)
    base_offload: str = "none"  # cpu: the frozen weights of the repeated blocks live in pinned host memory and are streamed to a GPU ring of stream_ahead + 1 blocks, a block ahead of use (forward and backward; exact, ddptrain/streamed_base.py); for a base that does not fit the GPU
    stream_blocks: list[str] = field(default_factory=list)  # lora.base_offload: module-name globs of the blocks to stream, e.g. ["model.layers.*"]; empty = the children of the model's largest nn.ModuleList
    stream_ahead: int = 1  # lora.base_offload: blocks whose weights are copied ahead of the one computing (the ring holds stream_ahead + 1)


@dataclass
class EmaConfig:
    enabled: bool = False  # keep an exponential moving average of the trainable weights in fp32 (of the fp32 masters under param_dtype=bf16; each rank its own partition under optim.zero), saved in checkpoints; evaluation and keep_best use it (ddptrain/ema.py)
    decay: float = 0.999  # per EMA update: ema = decay * ema + (1 - decay) * weights; it averages over about every_steps / (1 - decay) optimizer steps
    every_steps: int = 1  # update the EMA after every N applied optimizer updates (a skipped non-finite step does not count)
    warmup: bool = False  # the n-th update (from 0) uses min(decay, (1 + n) / (10 + n)), so the starting weights fade within a few hundred updates (training from scratch); false: a fine-tune's pretrained start counts at full decay
    device: str = "auto"  # where the EMA lives: auto (host memory under optim.offload=cpu, beside the masters; else the training device), gpu (the training device), cpu (host memory: every update copies the fp32 weights down in chunks, the GPU's queue waiting)
    evaluate: bool = True  # evaluation (and so keep_best) runs on the EMA weights, swapped in and back bit for bit; false: on the trained weights (the EMA is still kept and saved)


@dataclass
class EvalConfig:
    baseline: str = "none"  # the base model's metrics the regression gate compares every evaluation with: none (no gate), measure (evaluate before the first step; kept in output_dir/eval_baseline.json, which a resume reads), or a JSON file ({metric: value}, or a checkpoint's meta.json) (ddptrain/regression.py)
    regression_metric: str = "wer"  # the gate compares <metric>/<source> of every eval source (data.eval_sources) with the base's
    regression_mode: str = "min"  # min: lower is better (a source regresses above base + margin); max: higher is better (below base - margin)
    regression_margin: float = 0.0  # how much worse than the base a source may get before the gate warns and flags it (eval/regressed/<source>), in the metric's units


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)


# ----------------------------------------------------------------------------- the key table
# Every key of Config, with what it accepts. Checked once, at load (and by the data classes for a
# DataConfig built in Python, through check_section), so a bad value is an error naming its key
# and origin before anything starts, not a failure (or a silent misreading) deep in a run.


class _Bad(ValueError):
    """A value a rule rejects; the message is the reason, without the key."""


class Rule:
    """What one key accepts: ``check(value)`` returns the value in canonical form (choices
    lower-cased, signal names spelled ``SIGTERM``) or raises ``_Bad``; ``text`` documents it."""

    def __init__(self, text: str, check: Callable[[Any], Any]):
        self.text, self.check = text, check


ANY = Rule("", lambda v: v)


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(f"must be a number, not {type(v).__name__}")
    if not math.isfinite(v):
        raise _Bad("must be finite")
    return v


def one_of(*choices: str) -> Rule:
    """One of ``choices``, in any case; stored lower-case (the users compare with ``==``)."""
    def check(v):
        if str(v).lower() not in choices:
            raise _Bad(f"is not one of {', '.join(choices)}")
        return str(v).lower()
    return Rule(" | ".join(choices), check)


def switch(off: str, on: str, *others: str) -> Rule:
    """:func:`one_of` where a YAML boolean (false/off/no, true/on/yes) means ``off`` / ``on``."""
    words = one_of(off, on, *others)
    booleans = dict.fromkeys(("false", "off", "no"), off) | dict.fromkeys(("true", "on", "yes"), on)

    def check(v):
        return words.check(booleans.get(str(v).strip().lower(), v))
    return Rule(f"{words.text} (false = {off}, true = {on})", check)


def at_least(low: float) -> Rule:
    def check(v):
        if not _number(v) >= low:
            raise _Bad(f"must be >= {low}")
        return v
    return Rule(f">= {low}", check)


def above(low: float) -> Rule:
    def check(v):
        if not _number(v) > low:
            raise _Bad(f"must be > {low}")
        return v
    return Rule(f"> {low}", check)


def within(low: float, high: float, high_open: bool = False) -> Rule:
    """``low <= v <= high`` (``< high`` with ``high_open``)."""
    def check(v):
        v = _number(v)
        if not (low <= v < high if high_open else low <= v <= high):
            raise _Bad(f"must be in [{low}, {high}{')' if high_open else ']'}")
        return v
    return Rule(f"in [{low}, {high}{')' if high_open else ']'}", check)


def not_empty() -> Rule:
    def check(v):
        if not str(v).strip():
            raise _Bad("must not be empty")
        return v
    return Rule("not empty", check)


def satisfies(text: str, ok: Callable[[Any], bool], why: str) -> Rule:
    """A rule from a predicate (a recipe's own): ``text`` documents it, ``why`` follows
    ``key=value`` in the error ("must contain {audio} exactly once")."""
    def check(v):
        if not ok(v):
            raise _Bad(why)
        return v
    return Rule(text, check)


def keyword_or_path(*keywords: str) -> Rule:
    """One of ``keywords`` (any case, stored lower-case; "" is the first) or else a path (as given)."""
    def check(v):
        word = str(v).strip().lower() or keywords[0]
        return word if word in keywords else v
    return Rule(" | ".join(keywords) + " | a path", check)


def items(rule: Rule, count: Optional[int] = None) -> Rule:
    """A list whose every item passes ``rule`` (and of exactly ``count`` items, if given)."""
    def check(v):
        v = list(v)
        if count is not None and len(v) != count:
            raise _Bad(f"must have {count} values, not {len(v)}")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(rule.check(x))
            except _Bad as e:
                raise _Bad(f"item {i} ({x!r}) {e}") from None
        return out
    return Rule((f"{count} values, " if count else "") + f"each {rule.text}", check)


def entries(rule: Rule) -> Rule:
    """A mapping ``{name: value}`` whose every value passes ``rule`` (names are strings)."""
    def check(v):
        out = {}
        for k, x in dict(v).items():
            try:
                out[str(k)] = rule.check(x)
            except _Bad as e:
                raise _Bad(f"entry {k!r} ({x!r}) {e}") from None
        return out
    return Rule(f"{{name: value}}, each {rule.text}", check)


def _manifest_fields(v: Any) -> dict:
    """``data.fields``: every name a field of the manifest key mapping, every key a non-empty string."""
    fields = {str(k): x for k, x in dict(v).items()}
    try:
        field_spellings(fields)
    except DataError as e:
        raise _Bad(str(e).split(": ", 1)[1]) from None
    return fields


def _temperature(v: Any) -> float:
    """``data.mix_temperature``: a number > 0; ``.inf`` (uniform shares) is allowed."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not v > 0:
        raise _Bad("must be a number > 0 (.inf: uniform over the sources)")
    return float(v)


def _source_caps(v: Any) -> dict:
    """``data.source_caps``: per source one cap, ``{epochs: x}`` or ``{hours: x}`` with x > 0."""
    out = {}
    for name, cap in dict(v).items():
        cap = dict(cap) if isinstance(cap, (dict, DictConfig)) else cap
        if not isinstance(cap, dict) or len(cap) != 1 or str(next(iter(cap))) not in ("epochs", "hours"):
            raise _Bad(f"entry {name!r} ({cap!r}) must be {{epochs: x}} or {{hours: x}}")
        (kind, x), = cap.items()
        try:
            out[str(name)] = {str(kind): above(0).check(x)}
        except _Bad as e:
            raise _Bad(f"entry {name!r}: {kind} ({x!r}) {e}") from None
    return out


def _signal_name(v: Any) -> str:
    """``SIGTERM``, ``sigterm``, ``TERM`` and ``term`` all name SIGTERM; stored as ``SIGTERM``."""
    name = str(v).strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    if not isinstance(getattr(signal, name, None), signal.Signals) or name.startswith("SIG_"):
        raise _Bad(f"{v!r} is not a signal name (e.g. SIGTERM, SIGUSR1)")
    if name in ("SIGKILL", "SIGSTOP"):
        raise _Bad(f"{name} cannot be caught, so it cannot trigger a save")
    return name


SIGNALS = items(Rule("signal name (SIGTERM, TERM or term)", _signal_name))

RULES: dict[str, Rule] = {
    "trainer.output_dir": not_empty(),
    "trainer.max_epochs": at_least(0),  # and >= 1 when max_steps is 0: see _TOGETHER
    "trainer.max_steps": at_least(0),
    "trainer.grad_accum_steps": at_least(1),
    "trainer.precision": one_of("fp32", "bf16", "fp16"),
    "trainer.param_dtype": one_of("fp32", "bf16"),
    "trainer.clip_grad_norm": at_least(0),
    "trainer.seed": at_least(0),
    "trainer.eval_every": at_least(0),
    "trainer.max_nonfinite_steps": at_least(1),
    "trainer.device": one_of("auto", "cpu", "cuda"),
    "trainer.cuda_alloc_conf": ANY,
    "trainer.gpu_memory_gb": at_least(0),
    "trainer.deterministic": ANY,
    "trainer.fp16_init_scale": above(0),
    "trainer.fp16_min_scale": at_least(0),
    "trainer.preempt_signals": SIGNALS,
    "trainer.preempt_exit_code": within(0, 255),
    "trainer.preflight": switch("none", "worst", "all"),
    "trainer.gc_every_steps": Rule(">= 0", lambda v: v),  # checked where it is used: process.StepPacedGC
    "dist.backend": one_of("auto", "nccl", "gloo"),
    "dist.timeout_s": at_least(1),
    "dist.bucket_cap_mb": above(0),
    "dist.gradient_as_bucket_view": ANY,
    "dist.find_unused_parameters": ANY,
    "dist.broadcast_buffers": ANY,
    "dist.comm_hook": one_of("none", "bf16", "fp16"),
    "dist.preflight": switch("off", "auto", "always"),
    "dist.expected_busbw_gbps": at_least(0),
    "optim.name": one_of("adamw", "adam", "sgd"),
    "optim.lr": above(0),
    "optim.weight_decay": at_least(0),
    "optim.betas": items(within(0, 1, high_open=True), count=2),
    "optim.eps": above(0),
    "optim.momentum": within(0, 1),
    "optim.nesterov": ANY,
    "optim.fused": one_of("auto", "true", "false"),
    "optim.zero": ANY,
    "optim.zero_bucket_view": ANY,
    "optim.shard_grads": ANY,
    "optim.offload": switch("none", "cpu"),
    "optim.offload_chunk_mb": above(0),
    "optim.fused_update": one_of("auto", "true", "false"),
    "scheduler.name": one_of("constant", "warmup_cosine", "warmup_linear", "noam", "inverse_sqrt"),
    "scheduler.warmup_steps": at_least(0),
    "scheduler.min_lr_ratio": within(0, 1),
    "scheduler.decay_steps": at_least(0),
    "checkpoint.every_steps": at_least(0),
    "checkpoint.save_at_end": ANY,
    "checkpoint.keep_last": at_least(0),
    "checkpoint.keep_best": at_least(0),
    "checkpoint.best_metric": not_empty(),  # whether the run logs it is checked by the Trainer
    "checkpoint.best_mode": one_of("min", "max"),
    "checkpoint.resume": keyword_or_path("none", "auto"),
    "checkpoint.min_free_gb": at_least(0),
    "checkpoint.start_over": ANY,
    "checkpoint.trainable_only": ANY,
    "checkpoint.base_model": ANY,
    "logging.log_every": at_least(1),
    "logging.tensorboard": ANY,
    "logging.jsonl": ANY,
    "logging.progress_bar": ANY,
    "logging.peak_tflops": at_least(0),
    "logging.allreduce_share": ANY,
    "recompute.enabled": ANY,
    "recompute.module_classes": ANY,
    "recompute.name_globs": ANY,
    "recompute.every_k": at_least(1),
    "recompute.offload": switch("none", "cpu"),
    "compile.enabled": ANY,
    "compile.module_classes": ANY,
    "compile.name_globs": ANY,
    "compile.mode": one_of("default", "max-autotune-no-cudagraphs"),
    "compile.dynamic": one_of("auto", "true", "false"),
    "compile.backend": not_empty(),
    "compile.recompile_limit": at_least(1),
    "compile.ddp_overlap": ANY,
    "compile.cuda_graphs": ANY,
    "compile.cuda_graph_warmup": at_least(1),
    "compile.cuda_graph_max": at_least(1),
    "lora.enabled": ANY,
    "lora.targets": items(not_empty()),
    "lora.rank": at_least(1),
    "lora.alpha": above(0),
    "lora.dropout": within(0, 1, high_open=True),
    "lora.trainable": items(not_empty()),
    "lora.base_offload": switch("none", "cpu"),
    "lora.stream_blocks": items(not_empty()),
    "lora.stream_ahead": at_least(1),
    "ema.enabled": ANY,
    "ema.decay": within(0, 1, high_open=True),
    "ema.every_steps": at_least(1),
    "ema.warmup": ANY,
    "ema.device": one_of("auto", "gpu", "cpu"),
    "ema.evaluate": ANY,
    "eval.baseline": keyword_or_path("none", "measure"),
    "eval.regression_metric": not_empty(),
    "eval.regression_mode": one_of("min", "max"),
    "eval.regression_margin": at_least(0),
    "data.train_manifest": ANY,
    "data.eval_manifest": ANY,
    "data.fields": Rule("{field: key}, field one of ddptrain.data.manifest.FIELDS", lambda v: _manifest_fields(v)),
    "data.train_sources": entries(not_empty()),
    "data.train_weights": entries(at_least(0)),
    "data.source_caps": Rule("{name: {epochs: x} or {hours: x}}, x > 0", lambda v: _source_caps(v)),
    "data.mix_temperature": Rule("> 0 (.inf = uniform)", lambda v: _temperature(v)),
    "data.eval_sources": entries(not_empty()),
    "data.shard_window": at_least(0),
    "data.tokenizer": ANY,
    "data.unk_token": ANY,
    "data.sample_rate": above(0),
    "data.features": one_of("fbank", "logmel", "whisper_logmel", "raw"),
    "data.num_mel_bins": at_least(1),
    "data.frame_length_ms": above(0),
    "data.frame_shift_ms": above(0),
    "data.normalize": one_of("utterance", "global", "none"),
    "data.global_stats": ANY,
    "data.feature_device": one_of("worker", "gpu"),
    "data.speed_perturb": items(above(0)),
    "data.spec_augment": ANY,
    "data.freq_masks": at_least(0),
    "data.freq_mask_width": at_least(0),
    "data.time_masks": at_least(0),
    "data.time_mask_ratio": within(0, 1),
    "data.max_duration": above(0),
    "data.max_batch_size": at_least(0),
    "data.quadratic_duration": at_least(0),
    "data.num_buckets": at_least(1),
    "data.bucket_sort_pool": at_least(0),
    "data.sync_buckets": ANY,
    "data.shuffle": ANY,
    "data.tail": one_of("split", "duplicate", "drop"),
    "data.seed": at_least(0),
    "data.num_workers": at_least(0),
    "data.pin_memory": ANY,
    "data.prefetch_factor": at_least(1),
    "data.persistent_workers": ANY,
    "data.pad_to_multiple": at_least(1),
    "data.token_pad_multiple": at_least(1),
    "data.loader_timeout_s": at_least(0),
    "data.bad_data": one_of("error", "skip"),
    "data.validate": ANY,
    "data.validate_decode": ANY,
    "data.duration_tolerance": at_least(0),
    "data.output_frame_rate": at_least(0),
    "data.max_utterance_duration": at_least(0),
}

# Rules over several keys of one section: (keys, ok(*values), what is wrong: a text, or a function
# of the values that words it), checked after the keys' own rules, so the values are canonical.
_TOGETHER: list[tuple[tuple[str, ...], Callable[..., bool], Any]] = [
    (("trainer.max_epochs", "trainer.max_steps"), lambda epochs, steps: epochs >= 1 or steps > 0,
     "trainer.max_epochs must be >= 1 when trainer.max_steps=0 (nothing would train)"),
    (("optim.name", "optim.nesterov", "optim.momentum"),
     lambda name, nesterov, momentum: not (name == "sgd" and nesterov and momentum == 0),
     "optim.nesterov=true needs optim.momentum > 0"),
    (("lora.enabled", "lora.targets"), lambda on, targets: not on or bool(targets),
     "lora.enabled=true needs lora.targets (module-name globs of the nn.Linear layers to adapt)"),
    (("lora.base_offload", "lora.enabled"), lambda offload, on: offload == "none" or on,
     "lora.base_offload=cpu streams the frozen base of a LoRA run: set lora.enabled=true (and lora.targets), "
     "or lora.base_offload=none"),
    (("lora.base_offload", "compile.enabled"), lambda offload, compile_: offload == "none" or not compile_,
     "lora.base_offload=cpu runs the streamed blocks eagerly (their weights change storage at every call): "
     "set compile.enabled=false"),
    (("lora.base_offload", "recompute.offload", "recompute.enabled"),
     lambda base, acts, recompute: base == "none" or acts == "none" or recompute,
     "lora.base_offload=cpu with recompute.offload=cpu needs recompute.enabled=true: without recompute, activation "
     "offload's saved-tensor hooks would keep the streamed weights' ring memory as it is (overwritten by then)"),
    (("checkpoint.trainable_only", "checkpoint.base_model"), lambda only, base: not only or bool(str(base).strip()),
     "checkpoint.trainable_only=true needs checkpoint.base_model (the weights the frozen parameters come from: "
     "load_weights reads them before the checkpoint's own)"),
    (("recompute.enabled", "recompute.module_classes", "recompute.name_globs"),
     lambda on, classes, globs: not on or bool(classes) or bool(globs),
     "recompute.enabled=true needs recompute.module_classes or recompute.name_globs (which modules to recompute)"),
    (("recompute.offload", "recompute.module_classes", "recompute.name_globs"),
     lambda offload, classes, globs: offload == "none" or bool(classes) or bool(globs),
     "recompute.offload=cpu needs recompute.module_classes or recompute.name_globs (whose saved tensors go to "
     "host memory)"),
    (("recompute.offload", "recompute.enabled", "compile.enabled", "compile.module_classes", "compile.name_globs"),
     lambda offload, recompute, on, classes, globs: offload == "none" or recompute or not on or bool(classes or globs),
     "recompute.offload=cpu without recompute.enabled needs a regional compile (compile.module_classes or "
     "compile.name_globs) or none: a whole-model torch.compile does not run the saved-tensor hooks that offload"),
    (("compile.cuda_graphs", "recompute.enabled"), lambda graphs, recompute: not (graphs and recompute),
     "compile.cuda_graphs=true with recompute.enabled=true is not supported: recomputation re-draws dropout from "
     "an RNG state saved on the host, which a captured graph cannot replay; set one of them false"),
    (("compile.cuda_graphs", "recompute.offload", "lora.base_offload"),
     lambda graphs, acts, base: not graphs or acts == base == "none",
     "compile.cuda_graphs=true needs recompute.offload and lora.base_offload both none: their host-side copies "
     "and hooks during the backward cannot be captured in a CUDA graph"),
    (("data.train_manifest", "data.train_sources"), lambda manifest, sources: not (str(manifest).strip() and sources),
     "data.train_manifest and data.train_sources both name the training data: set one of them"),
    (("data.eval_manifest", "data.eval_sources"), lambda manifest, sources: not (str(manifest).strip() and sources),
     "data.eval_manifest and data.eval_sources both name the evaluation data: set one of them"),
    (("data.train_sources", "data.train_weights"),
     lambda sources, weights: not weights or (set(weights) == set(sources) and sum(weights.values()) > 0),
     lambda sources, weights: _weights_why(sources, weights)),
    (("data.eval_sources",), lambda sources: "mean" not in sources,
     "data.eval_sources may not name a source 'mean': eval/<metric>/mean is the mean over the sources"),
    (("data.train_sources", "data.source_caps"), lambda sources, caps: set(caps) <= set(sources),
     lambda sources, caps: f"data.source_caps names {', '.join(map(repr, sorted(set(caps) - set(sources))))}, which "
                           f"is not a source of data.train_sources ({', '.join(map(str, sources)) or 'none'})"),
    (("data.features", "data.sample_rate", "data.frame_length_ms", "data.frame_shift_ms"),
     lambda kind, rate, length, shift: kind == "raw" or (int(rate * length / 1000) >= 2 and int(rate * shift / 1000) >= 1),
     "data.frame_length_ms / data.frame_shift_ms are under 2 / 1 samples at data.sample_rate"),
    (("data.features", "data.normalize", "data.global_stats"),
     lambda kind, normalize, stats: kind == "raw" or normalize != "global" or bool(stats),
     "data.normalize=global needs data.global_stats (a JSON file from "
     "`python -m ddptrain.data.features MANIFEST OUT.json`)"),
    (("data.features", "data.normalize"), lambda kind, normalize: kind != "whisper_logmel" or normalize == "none",
     "data.features=whisper_logmel has Whisper's own fixed scaling: set data.normalize=none"),
]


def schema_rules(schema: type) -> tuple[list[dict[str, Rule]], list[tuple]]:
    """The tables a config class is checked against: :data:`RULES` and the multi-key rules, then
    the class's own (a recipe's), declared beside its sections as ``RESUME_REFUSED`` is::

        @dataclass
        class RecipeConfig(ddptrain.Config):
            tts: TTSConfig = field(default_factory=TTSConfig)
            RULES: ClassVar[dict[str, Rule]] = {"tts.num_samples": at_least(0)}
            RULES_TOGETHER: ClassVar[list] = [(("tts.path", "tts.preset"), ok, "what is wrong")]

    A recipe's rule for a library key (``data.features``) applies after the library's.

    Returns:
        ``([RULES, the class's RULES], _TOGETHER + the class's RULES_TOGETHER)``.
    """
    return [RULES, dict(getattr(schema, "RULES", {}))], _TOGETHER + list(getattr(schema, "RULES_TOGETHER", []))


def _weights_why(sources: dict, weights: dict) -> str:
    """What is wrong with data.train_weights, naming the bad name and the valid ones."""
    names = ", ".join(map(str, sources)) or "none: weights need named sources, data.train_sources={name: path}"
    head = "data.train_weights needs one weight per name of data.train_sources (and no other name), not all 0"
    unknown, missing = sorted(set(weights) - set(sources)), [s for s in sources if s not in weights]
    if unknown:
        return (f"{head}: data.train_weights names {', '.join(map(repr, unknown))}, which is not a source of "
                f"data.train_sources ({names})")
    if missing:
        return f"{head}: data.train_weights has no weight for {', '.join(map(repr, missing))} (sources: {names})"
    return f"{head}: every weight is 0"


def check_section(section: Any, name: str) -> Any:
    """Check one config section built in Python (e.g. a ``DataConfig(...)`` handed straight to
    a data class) against the same table as :func:`load_config`.

    Args:
        section: the section object (a dataclass instance).
        name: its key in :class:`Config` (``"data"``).

    A section this returned is not checked again while its values stay as they were: the data
    loader checks its section at its entry, and the parts it builds (dataset, feature extractors,
    sampler) take the checked section, so a loader build checks it once.

    Returns:
        ``section`` with its values in canonical form (a copy if any changed).

    Raises:
        ConfigError: a value the table rejects; the message names the key.
    """
    if getattr(section, _CHECKED, None) == _values_of(section):
        return section
    fixed = _check({name: section}, {})[name]
    object.__setattr__(fixed, _CHECKED, _values_of(fixed))
    return fixed


_CHECKED = "_ddptrain_checked"  # the values a section had when check_section returned it


def _values_of(section: Any) -> str:
    return repr([getattr(section, f.name) for f in dataclasses.fields(section)] + _extra_attributes(section))


def _extra_attributes(obj: Any) -> list[str]:
    """Attributes set on a dataclass instance that are none of its fields (a typo in Python:
    ``cfg.trainer.max_step = 5``); private names (``_ddptrain_checked``) are the library's."""
    fields = {f.name for f in dataclasses.fields(obj)}
    return [k for k in getattr(obj, "__dict__", ()) if k not in fields and not k.startswith("_")]  # slots: none


def _did_you_mean(word: str, known, prefix: str = "") -> str:
    """``: did you mean 'prefix+match'?`` for the closest of ``known``, or "" if none is close."""
    close = difflib.get_close_matches(word, [str(k) for k in known], n=1)
    return f": did you mean '{prefix}{close[0]}'?" if close else ""


def _refuse_unknown_attributes(root: Any) -> None:
    """Fail on an attribute of a Python-built config that is no key, as an unknown YAML key fails:
    a dataclass takes any attribute, and a misspelt one would be silently ignored."""
    named = list(root.items()) if isinstance(root, dict) else []
    if not isinstance(root, dict):
        sections = [f.name for f in dataclasses.fields(root)]
        if extras := _extra_attributes(root):
            raise ConfigError(f"unknown config key '{extras[0]}' (an attribute set in Python that "
                              f"{type(root).__name__} does not have){_did_you_mean(extras[0], sections)}")
        named = [(name, getattr(root, name)) for name in sections]
    while named:
        key, obj = named.pop(0)
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            continue
        fields = [f.name for f in dataclasses.fields(obj)]
        if extras := _extra_attributes(obj):
            raise ConfigError(f"unknown config key '{key}.{extras[0]}' (an attribute set in Python that "
                              f"{type(obj).__name__} does not have){_did_you_mean(extras[0], fields, key + '.')}")
        named += [(f"{key}.{name}", getattr(obj, name)) for name in fields]  # a recipe's nested sections


def check_config(cfg: Any) -> Any:
    """Check a whole config however it was built (``load_config``, or a ``Config()`` made and
    changed in Python) against the same tables as :func:`load_config`; the Trainer calls it at
    its start, so ``best_mode="MIN"`` or ``precision="BF16"`` mean what they mean at load and
    ``max_epochs=0`` is refused instead of saving an untrained checkpoint.

    Returns:
        A shallow copy of ``cfg`` with canonical values (the caller's object is left as it was).

    Raises:
        ConfigError: a value or combination the tables reject; the message names the key.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)
    return _check(copy.copy(cfg), {})


def _check(root: Any, origins: dict[str, str]) -> Any:
    """Apply RULES and _TOGETHER to ``root`` (a Config, or a dict of sections, keyed like Config)
    and return it with canonical values; ``origins`` names where each key was set."""

    def holder_of(key):
        section, leaf = key.split(".", 1)
        obj = root.get(section) if isinstance(root, dict) else getattr(root, section, None)
        return (obj, leaf) if obj is not None and hasattr(obj, leaf) else (None, leaf)

    def fail(key, why):
        where = origins.get(key)
        raise ConfigError(f"{where + ': ' if where else ''}{why}")

    _refuse_unknown_attributes(root)
    tables, together = schema_rules(Config if isinstance(root, dict) else type(root))
    mine = [k for k in [*tables[1], *(k for keys, _, _ in together[len(_TOGETHER):] for k in keys)]
            if holder_of(k)[0] is None]
    if mine:  # a misspelt key would silently never be checked
        raise ConfigError(f"{type(root).__name__}.RULES names keys the config does not have: {', '.join(mine)}")
    changed: dict[str, dict[str, Any]] = {}
    for key, rule in [kv for table in tables for kv in table.items()]:
        obj, leaf = holder_of(key)
        if obj is None:
            continue
        value = changed.get(key.split(".", 1)[0], {}).get(leaf, getattr(obj, leaf))
        try:
            canonical = rule.check(value)
        except _Bad as e:
            shown = list(value) if isinstance(value, (list, tuple)) else value
            fail(key, f"{key}={shown!r} {e}")
        if canonical != value:
            changed.setdefault(key.split(".", 1)[0], {})[leaf] = canonical
    for section, values in changed.items():  # a copy: a section the caller built stays as it was
        if isinstance(root, dict):
            root[section] = dataclasses.replace(root[section], **values)
        else:
            setattr(root, section, dataclasses.replace(getattr(root, section), **values))
    for keys, ok, why in together:
        found = [holder_of(k) for k in keys]
        if any(obj is None for obj, _ in found):
            continue
        values = [getattr(obj, leaf) for obj, leaf in found]
        if not ok(*values):
            where = sorted({origins[k] for k in keys if k in origins})
            raise ConfigError(f"{'; '.join(where) + ': ' if where else ''}{why(*values) if callable(why) else why}")
    if not isinstance(root, dict):  # the update-path rules: one function, shared with the run and the estimator
        try:
            choose(root)
        except Refused as e:
            where = sorted({origins[k] for k in e.keys if k in origins})
            raise ConfigError(f"{'; '.join(where) + ': ' if where else ''}{e}") from None
    return root


# Keys that existed once, with what to set instead: a config that still sets one is refused
# with this, not the bare "unknown key".
REMOVED_KEYS = {
    "data.bucket_budgets": "per-bucket budget files are gone (they trained no faster than the best single "
                           "data.max_duration on the three models measured): run python -m ddptrain.tune, which "
                           "prints that data.max_duration, and set it instead",
}


def load_config(
    path: Optional[str] = None,
    overrides: Sequence[str] = (),
    schema: type = Config,
) -> Any:
    """Build a config from the schema's defaults, a YAML file and ``key=value`` overrides.

    Args:
        path: YAML file (optional). Its keys must exist in ``schema``.
        overrides: CLI-style ``section.key=value`` strings, applied last.
        schema: the dataclass to validate against (subclass :class:`Config` to add sections).

    Returns:
        An instance of ``schema`` (a typed OmegaConf object that behaves like the dataclass).

    Raises:
        ConfigError: unknown key, wrong type, bad choice or malformed override; the message
            names the key and the file or the override it came from.
    """
    cfg = OmegaConf.structured(schema)
    origins: dict[str, str] = {}  # key -> the file or override that set it last
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as e:  # yaml syntax errors carry their own line numbers
            raise ConfigError(f"{path}: cannot parse YAML: {e}") from e
        if not isinstance(file_cfg, DictConfig):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (trainer:, data:, ...), "
                              f"not a {type(file_cfg).__name__}")
        cfg = _merge(cfg, file_cfg, origin=path)
        origins.update(dict.fromkeys(_leaf_keys(file_cfg), path))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
        one = OmegaConf.from_dotlist([item])
        cfg = _merge(cfg, one, origin=f"override {item!r}", key=item.split("=", 1)[0])
        origins.update(dict.fromkeys(_leaf_keys(one), f"override {item!r}"))
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
        raise ConfigError(f"{path or 'config'}: {e}") from None
    return _check(obj, origins)


def _leaf_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """The dotted keys of the values (not sections) in ``node``."""
    out = []
    for k, v in node.items_ex(resolve=False):
        out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, DictConfig) else [f"{prefix}{k}"]
    return out


def _merge(base: DictConfig, other: DictConfig, origin: str, key: str = "?") -> DictConfig:
    """``OmegaConf.merge`` whose errors name the key and where it came from (``key``: the
    override's own key, for errors that carry none, e.g. a value given for a whole section)."""
    try:
        return OmegaConf.merge(base, other)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = e.full_key or getattr(e, "key", None) or key
        if key in REMOVED_KEYS:
            raise ConfigError(f"{origin}: '{key}' is no longer a config key: {REMOVED_KEYS[key]}") from None
        section, _, leaf = str(key).rpartition(".")
        node = OmegaConf.select(base, section) if section else base
        known = node.keys() if isinstance(node, DictConfig) else ()
        guess = _did_you_mean(leaf, known, section + "." if section else "")
        raise ConfigError(f"{origin}: unknown config key '{key}' (check the spelling against "
                          f"the dataclasses in ddptrain/config.py){guess}") from None
    except ValidationError as e:
        section = None if e.msg and e.full_key else _section_given_a_value(base, other)
        if section is not None:  # OmegaConf names no key for it ('?' in a file)
            name, value = section
            raise ConfigError(f"{origin}: bad value for '{name}': a section takes keys below it ({name}.key=value on "
                              f"the command line; in YAML, indented key: value lines under {name}:), not a value "
                              f"({value})") from None
        why = str(e.msg).splitlines()[0] if e.msg else "a section takes keys below it (section.key=value), not a value"
        raise ConfigError(f"{origin}: bad value for '{e.full_key or key}': {why}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{origin}: {e}") from None
    except TypeError as e:  # OmegaConf's "Cannot merge incompatible container types" names no key
        clash = _container_clash(base, other)
        if clash is None:
            raise ConfigError(f"{origin}: {e}") from None
        where, wants_mapping = clash
        raise ConfigError(f"{origin}: {where} takes " + ("a mapping {name: value}, not a list" if wants_mapping else
                          "a list [a, b, ...], not a mapping") + f" (e.g. {where}="
                          + ("{a: 1, b: 2})" if wants_mapping else "[1, 2])")) from None


def _pairs(base: DictConfig, other: DictConfig, prefix: str = ""):
    """``(dotted key, base's value, other's value)`` for each key both hold, depth first, going
    into the sections both hold as sections instead of yielding them."""
    for k in other:
        try:
            if k not in base:
                continue
            b, o = base[k], other[k]
        except OmegaConfBaseException:
            continue
        if isinstance(b, DictConfig) and isinstance(o, DictConfig):
            yield from _pairs(b, o, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", b, o


def _section_given_a_value(base: DictConfig, other: DictConfig) -> Optional[tuple[str, str]]:
    """The first key that is a section in ``base`` and a value (not a mapping) in ``other``:
    ``(dotted key, the value as YAML writes it)``, or None."""
    for key, b, o in _pairs(base, other):
        if isinstance(b, DictConfig):
            return key, str(OmegaConf.to_container(o) if isinstance(o, ListConfig) else o)
    return None


def _container_clash(base: DictConfig, other: DictConfig) -> Optional[tuple[str, bool]]:
    """The first key where ``other`` gives a list for a mapping of ``base`` or the reverse:
    ``(dotted key, whether base has a mapping)``, or None."""
    for key, b, o in _pairs(base, other):
        if isinstance(b, (DictConfig, ListConfig)) and isinstance(o, (DictConfig, ListConfig)) and \
                isinstance(b, DictConfig) != isinstance(o, DictConfig):
            return key, isinstance(b, DictConfig)
    return None


def to_yaml(cfg: Any) -> str:
    """The config as YAML text (saved in every run folder so a run can be reproduced)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def reference_markdown(schema: type = Config) -> str:
    """A Markdown table of every config key, its default, what it accepts (:data:`RULES`) and
    its comment (docs/config.md).

    The comments are read from the dataclass source, so the reference cannot drift from the code:
    ``python docs/generate.py`` rewrites docs/config.md from it, and a test checks it is current.
    """
    import inspect
    import re

    rows = ["| key | default | accepts | meaning |", "| --- | --- | --- | --- |"]
    rules = {**schema_rules(schema)[0][1], **RULES}  # a library key keeps the library's text

    def walk(cls, prefix):
        comments = {}
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+):.*?#\s*(.*)$", line)
            if m:
                comments[m.group(1)] = m.group(2).replace("|", "\\|")
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                rule = rules.get(f"{prefix}{f.name}", ANY).text.replace("|", "\\|")
                rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {rule} | {comments.get(f.name, '')} |")

    walk(schema, "")
    return "\n".join(rows)


def cli_prog(module: str) -> str:
    """The name a ``ddptrain`` tool's usage line shows: the console command it was run as
    (``ddptrain-average``, from setup.py's ``console_scripts``), else ``python -m <module>``.

    Args:
        module: the tool's module, e.g. ``ddptrain.average``.
    """
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("ddptrain-") else f"python -m {module}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ddptrain-config`` (``python -m ddptrain.config``): print the config reference."""
    argparse.ArgumentParser(prog=cli_prog("ddptrain.config"), description="Print every config key with its default, accepted "
                            "values and meaning, as the Markdown table of docs/config.md.").parse_args(argv)
    print(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
