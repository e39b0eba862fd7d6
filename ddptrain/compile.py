"""torch.compile policy: the whole model, or only selected submodules ("regional compilation").

Why compile at all: in eager mode a transformer layer is dozens of small kernels — layout copies
around attention, bf16 casts of fp32 weights and activations, bias/GELU/dropout/residual chains —
and on a large GPU those can cost as much time as the matmuls do. Inductor fuses them (the
measured gain is in BENCHMARKS.md).

Whole model or regional: the whole model is the faster choice where it compiles, because the
code between the blocks (embeddings, masks, a large output projection and its loss) gains too. Regional is for
models the whole-model compile breaks on, and for compiled recompute regions. Compiling the
repeated blocks (``compile.module_classes: [WhisperEncoderLayer,
...]``) compiles each block class once and reuses the code for every instance
(``torch._dynamo.config.inline_inbuilt_nn_modules``, default on), so compile time does not grow
with depth; and the code *between* the blocks — attention-mask building, SpecAugment's boolean
indexing, the loss — stays eager, where data-dependent shapes cannot break the compiler (the
whole-model compile of transformers' wav2vec2 fails in inductor on SpecAugment's masked
``index_put``).

With activation checkpointing, a checkpointed block is compiled *inside* its recompute region
(``ddptrain.recompute.checkpoint`` runs eagerly: dynamo cannot trace its saved-tensor hooks), so
the forward and the recomputation both run the compiled code. A whole-model compile cannot do
that: the checkpointed blocks then run eagerly; name them in ``compile.module_classes`` instead.

Past dynamo's recompile limit a compiled function runs eagerly from then on, with one log line
from torch and no error; :class:`EagerFallbacks` turns that line into a warning naming
``compile.recompile_limit`` and a ``compile_eager_fallbacks`` counter in the training log.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from ddptrain.config import ConfigError
from ddptrain.submodules import instance_forward, match_modules

if TYPE_CHECKING:
    from ddptrain.config import CompileConfig


def compile_options(cfg: "CompileConfig") -> dict[str, Any]:
    """Keyword arguments for ``torch.compile`` from the config section; also sets dynamo's
    per-function recompile limit (``compile.recompile_limit``), read when a frame recompiles."""
    # past the limit dynamo runs the frame eagerly without an error; a regional block class used
    # with several dtypes, flags or shapes reaches torch's default of 8 in the first steps
    torch._dynamo.config.recompile_limit = int(cfg.recompile_limit)
    dynamic: Optional[bool] = {"auto": None, "true": True, "false": False}[str(cfg.dynamic).lower()]
    if cfg.backend != "inductor":  # modes are inductor options
        return {"backend": cfg.backend, "dynamic": dynamic}
    return {"mode": cfg.mode, "dynamic": dynamic}


# torch/_dynamo/convert_frame.py logs this (args: limit name, its value, "'fn' (file:line)") once
# per code object, when it stops compiling it; dynamo's counters keep no function name
_LIMIT_LOGGER, _LIMIT_MESSAGE = "torch._dynamo.convert_frame", "torch._dynamo hit config."
_LIMIT_COUNTER = "Dynamo recompile limit exceeded"  # the start of its counters["unimplemented"] key
# the ddptrain key that sets each limit (accumulated_recompile_limit, 256 in torch, has none)
_LIMIT_KEYS = {"recompile_limit": "compile.recompile_limit"}


class _LimitHits(logging.Handler):
    """Every recompile-limit hit dynamo logs in this process: (limit name, value, function)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[tuple[str, Any, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(record.msg, str) and record.msg.startswith(_LIMIT_MESSAGE) and len(args) >= 3:
            self.hits.append((str(args[0]), args[1], str(args[2])))


_HITS = _LimitHits()  # one handler per process, however many Trainers it builds


def _counted_hits() -> int:
    """Hits in dynamo's counters: these also count while dynamo's warnings are silenced (TORCH_LOGS)."""
    counts = torch._dynamo.utils.counters["unimplemented"]
    return sum(n for msg, n in counts.items() if msg.startswith(_LIMIT_COUNTER))


class EagerFallbacks:
    """Compiled functions that dynamo gave up on (they run eagerly) since this object was made.

    ``scalars(say)`` is called at each training log line: it says one warning per new function
    and returns ``{"compile_eager_fallbacks": n}``; with ``enabled=False`` (no compile) it returns
    nothing. Each rank compiles the same code, so rank 0's count stands for all of them.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        if enabled:
            logger = logging.getLogger(_LIMIT_LOGGER)
            if _HITS not in logger.handlers:
                logger.addHandler(_HITS)
        self._start = self._seen = len(_HITS.hits)
        self._counted = _counted_hits()  # dynamo.reset() clears the counters: a drop counts as nothing
        self._unnamed = 0  # hits already warned about without a function name

    @property
    def count(self) -> int:
        if not self.enabled:
            return 0
        return max(len(_HITS.hits) - self._start, _counted_hits() - self._counted)

    def scalars(self, say: Callable[[str], None]) -> dict:
        if not self.enabled:
            return {}
        for limit, value, function in _HITS.hits[self._seen:]:
            key = _LIMIT_KEYS.get(limit, f"torch._dynamo.config.{limit}")
            say(f"WARNING: torch.compile stopped compiling {function}: dynamo hit {key}={value} (its "
                f"compiled variants: other dtypes, flags or shapes) and runs it eagerly from now on, "
                f"slower; raise {key} to keep it compiled (TORCH_LOGS=recompiles lists the reasons)")
        self._seen = len(_HITS.hits)
        unnamed = self.count - (self._seen - self._start)  # counted, but dynamo's warning was silenced
        if unnamed > self._unnamed:
            say(f"WARNING: dynamo hit its recompile limit for {unnamed} compiled function(s) (their names "
                "are in dynamo's warnings, silenced here) and runs them eagerly, slower; raise "
                "compile.recompile_limit to keep them compiled")
            self._unnamed = unnamed
        return {"compile_eager_fallbacks": self.count}


def compile_whole(model: nn.Module, cfg: "CompileConfig", ddp_bucket_cap_mb: Optional[float],
                  recomputed: int = 0) -> nn.Module:
    """``torch.compile`` the whole model, after DDP wrapped it (``ddp_bucket_cap_mb``: its bucket
    size; ``None`` without DDP).

    With DDP, ``compile.ddp_overlap`` picks dynamo's DDPOptimizer (the graph is split at the
    bucket boundaries, so each bucket's all-reduce starts while the backward goes on) or one
    graph whose gradients, hence all-reduces, all come at the end of the backward; on NVLink the
    two measured the same, and the overlap stays the default for slower links. DDPOptimizer needs buckets of
    at least DDP's 1 MB first bucket; that is checked here, so the error names the config keys
    instead of an assertion inside dynamo at the first step.
    """
    if ddp_bucket_cap_mb is not None and cfg.ddp_overlap and ddp_bucket_cap_mb < 1:
        raise ConfigError(f"dist.bucket_cap_mb={ddp_bucket_cap_mb} with a whole-model compile and "
                          "compile.ddp_overlap=true: dynamo splits the graph at DDP's buckets and needs "
                          "them to be at least 1 MB; raise it or set compile.ddp_overlap=false")
    if recomputed:
        warnings.warn(f"compile.enabled with recompute: the {recomputed} checkpointed modules run eagerly "
                      "inside the compiled model; list their classes in compile.module_classes to compile "
                      "them too", stacklevel=3)
    torch._dynamo.config.optimize_ddp = bool(cfg.ddp_overlap)  # read when the first step compiles
    return torch.compile(model, **compile_options(cfg))


def is_regional(cfg: "CompileConfig") -> bool:
    return bool(cfg.module_classes or cfg.name_globs)


def apply_compile(model: nn.Module, cfg: "CompileConfig") -> list[str]:
    """Compile the submodules of ``model`` selected by ``cfg``, in place (regional compilation).

    Apply it to the bare model *before* DDP, before or after
    :func:`ddptrain.recompute.apply_recompute` (a recomputed block then runs the compiled forward
    inside its checkpoint). Only the instance's ``forward`` is replaced, so parameter names and
    ``state_dict()`` keys do not change and checkpoints load into an uncompiled model.

    Args:
        model: the model to modify.
        cfg: the ``compile`` config section; nothing is done unless it is enabled *and* names
            module classes or globs (the whole-model case is the Trainer's: it wraps DDP).

    Returns:
        The dotted names of the compiled modules.

    Raises:
        ValueError: nothing matched (the message lists class names that exist), or a matched
            module has an instance ``forward`` set by other code.
    """
    if not (cfg.enabled and is_regional(cfg)):
        return []
    opts = compile_options(cfg)
    per_class: dict[type, Any] = {}
    names = []
    for name, module in match_modules(model, cfg.module_classes, cfg.name_globs, "compile"):
        # One compiled *unbound* forward per block class, the module passed as an argument: every
        # class has its own code object, so its compiled variants (static, then dynamic shapes)
        # never compete for dynamo's per-code-object recompile limit with other classes (as
        # they would through nn.Module.compile, which compiles the shared Module._call_impl);
        # past that limit dynamo silently runs a frame eagerly. And a deepcopy of the model (EMA)
        # calls the same compiled code with its own weights.
        cls = type(module)
        if cls not in per_class:
            per_class[cls] = torch.compile(cls.forward, **opts)
        # a recompute checkpoint around it (InstanceForward.around) stays eager
        instance_forward(module, name).inner = per_class[cls]
        names.append(name)
    return names
