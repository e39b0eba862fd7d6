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

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from ddptrain.data.config import DataConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the file and/or key at fault."""


@dataclass
class TrainerConfig:
    output_dir: str = "runs/default"  # run folder: checkpoints/, tensorboard/, metrics.jsonl
    max_epochs: int = 1  # passes over the training data (ignored when max_steps > 0)
    max_steps: int = 0  # optimizer steps to run; 0 = run max_epochs
    grad_accum_steps: int = 1  # micro-batches per optimizer step (per rank)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses a GradScaler)
    param_dtype: str = "fp32"  # fp32 | bf16: with precision bf16, a bf16 model + fp32 master weights in the optimizer (no weight casts, bf16 grads)
    clip_grad_norm: float = 0.0  # clip the global grad norm to this; 0 = no clipping (norm still logged)
    seed: int = 0  # model init / dropout seed; each rank adds its rank
    eval_every: int = 0  # evaluate every N optimizer steps; 0 = only at the end
    max_nonfinite_steps: int = 5  # abort after this many consecutive non-finite steps
    device: str = "auto"  # auto (cuda:LOCAL_RANK if available else cpu) | cpu | cuda
    deterministic: bool = False  # torch.use_deterministic_algorithms (slower; for bitwise tests)
    fp16_init_scale: float = 65536.0  # GradScaler initial loss scale
    fp16_min_scale: float = 1.0e-4  # a loss scale below this is reported as a collapse and aborts
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # save + exit on these
    preempt_exit_code: int = 0  # exit code after a preemption save (0: torchrun does not restart)
    gc_every_steps: int = 50  # Python GC: collect young objects every N steps on all ranks, full at epoch ends/evals/saves, automatic GC off during fit; 0 = Python's automatic GC


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    timeout_s: float = 600.0  # collective timeout: a dead peer becomes an error after this long
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    gradient_as_bucket_view: bool = True  # grads alias DDP buckets: saves one copy of the grads
    find_unused_parameters: bool = False  # set True for partly frozen / branchy models (slower)
    broadcast_buffers: bool = True  # sync buffers (e.g. BatchNorm stats) from rank 0 every forward
    comm_hook: str = "none"  # none | bf16 | fp16: compress gradients for the all-reduce


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd
    lr: float = 1.0e-3  # peak learning rate
    weight_decay: float = 0.01  # applied to weights only, never to biases or norm parameters
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # Adam(W) betas
    eps: float = 1.0e-8  # Adam(W) epsilon
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = False  # SGD Nesterov momentum
    fused: str = "auto"  # auto (fused kernels on CUDA) | true | false
    zero: bool = False  # shard optimizer state across ranks (ZeroRedundancyOptimizer)
    zero_bucket_view: bool = True  # ZeRO: flat parameter buckets, one broadcast per rank after the step (BENCHMARKS.md: -1% vs -5% throughput)


@dataclass
class SchedulerConfig:
    name: str = "constant"  # constant | warmup_cosine | warmup_linear | noam | inverse_sqrt
    warmup_steps: int = 0  # linear warmup from 0 to optim.lr
    min_lr_ratio: float = 0.0  # cosine/linear decay floor, as a fraction of optim.lr
    decay_steps: int = 0  # steps over which to decay; 0 = the run's total steps


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # save every N optimizer steps; 0 = only at the end
    save_at_end: bool = True  # save after the last step
    keep_last: int = 3  # keep this many most recent checkpoints (0 = keep all)
    keep_best: int = 0  # also keep the best K by `best_metric` (0 = off)
    best_metric: str = "loss"  # eval metric name for keep_best
    best_mode: str = "min"  # min | max
    resume: str = "none"  # none | auto (newest complete checkpoint in output_dir) | a checkpoint path
    min_free_gb: float = 1.0  # refuse to start if the checkpoint disk has less free space


@dataclass
class LoggingConfig:
    log_every: int = 10  # log training scalars every N optimizer steps
    tensorboard: bool = True  # write TensorBoard events to output_dir/tensorboard
    jsonl: bool = True  # write output_dir/metrics.jsonl (one JSON object per logged step)
    progress_bar: bool = True  # tqdm progress bar with ETA on rank 0


@dataclass
class RecomputeConfig:
    enabled: bool = False  # activation (gradient) checkpointing: recompute activations in backward
    module_classes: list[str] = field(default_factory=list)  # wrap modules of these class names
    name_globs: list[str] = field(default_factory=list)  # ... and/or modules whose names match these globs
    every_k: int = 1  # wrap only every k-th matching module (1 = all): memory/speed trade-off


@dataclass
class CompileConfig:
    enabled: bool = False  # torch.compile the model for training steps (fuses casts, copies, elementwise chains)
    module_classes: list[str] = field(default_factory=list)  # compile only modules of these class names ("regional"); empty + no globs = whole model
    name_globs: list[str] = field(default_factory=list)  # ... and/or modules whose names match these globs
    mode: str = "default"  # torch.compile mode: default | max-autotune-no-cudagraphs
    dynamic: str = "auto"  # auto (static shapes, dynamic after the first shape change) | true | false
    backend: str = "inductor"  # torch.compile backend (aot_eager: trace without code generation, for debugging)
    ddp_overlap: bool = True  # whole model on >1 GPU: split the graph at DDP buckets so the all-reduce overlaps the backward; false: one graph, all-reduce after it


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
    data: DataConfig = field(default_factory=DataConfig)


_CHOICES = {
    "trainer.precision": ("fp32", "bf16", "fp16"),
    "trainer.param_dtype": ("fp32", "bf16"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "dist.comm_hook": ("none", "bf16", "fp16"),
    "optim.name": ("adamw", "adam", "sgd"),
    "optim.fused": ("auto", "true", "false"),
    "scheduler.name": ("constant", "warmup_cosine", "warmup_linear", "noam", "inverse_sqrt"),
    "checkpoint.best_mode": ("min", "max"),
    "compile.mode": ("default", "max-autotune-no-cudagraphs"),
    "compile.dynamic": ("auto", "true", "false"),
}


# Keys whose values below these bounds would fail later without naming the key (a division by
# zero, a collective that times out at once, a DataLoader error). trainer.gc_every_steps is
# checked where it is used (StepPacedGC), which names it too.
_MINIMUM = {
    "trainer.grad_accum_steps": 1,
    "trainer.max_steps": 0,
    "trainer.max_nonfinite_steps": 1,
    "logging.log_every": 1,
    "dist.timeout_s": 1,
    "checkpoint.keep_last": 0,
    "checkpoint.keep_best": 0,
    "data.num_workers": 0,
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
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
        cfg = _merge(cfg, OmegaConf.from_dotlist([item]), origin=f"override {item!r}", key=item.split("=", 1)[0])
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and str(value).lower() not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for key, least in _MINIMUM.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and value < least:
            raise ConfigError(f"{key}={value!r} must be >= {least}")
    if str(OmegaConf.select(cfg, "trainer.param_dtype")).lower() == "bf16" \
            and str(OmegaConf.select(cfg, "trainer.precision")).lower() != "bf16":
        raise ConfigError("trainer.param_dtype=bf16 needs trainer.precision=bf16 (fp16 parameters "
                          "would need loss scaling of bf16 master gradients: not supported)")
    return OmegaConf.to_object(cfg)


def _merge(base: DictConfig, other: DictConfig, origin: str, key: str = "?") -> DictConfig:
    """``OmegaConf.merge`` whose errors name the key and where it came from (``key``: the
    override's own key, for errors that carry none, e.g. a value given for a whole section)."""
    try:
        return OmegaConf.merge(base, other)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = e.full_key or getattr(e, "key", None) or key
        raise ConfigError(f"{origin}: unknown config key '{key}' (check the spelling against "
                          f"the dataclasses in ddptrain/config.py)") from None
    except ValidationError as e:
        why = str(e.msg).splitlines()[0] if e.msg else "a section takes keys below it (section.key=value), not a value"
        raise ConfigError(f"{origin}: bad value for '{e.full_key or key}': {why}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{origin}: {e}") from None


def to_yaml(cfg: Any) -> str:
    """The config as YAML text (saved in every run folder so a run can be reproduced)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def reference_markdown(schema: type = Config) -> str:
    """A Markdown table of every config key, its default and its comment (for the README).

    The comments are read from the dataclass source, so the README reference cannot drift from
    the code: ``python -m ddptrain.config`` regenerates it, and a test checks it is current.
    """
    import inspect
    import re

    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

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
                rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {comments.get(f.name, '')} |")

    walk(schema, "")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
