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
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

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
