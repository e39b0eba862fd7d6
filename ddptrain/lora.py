"""LoRA: low-rank adapters on ``nn.Linear`` layers chosen by module-name patterns.

An adapted layer computes ``W x + b + (alpha / r) * B A dropout(x)`` with ``A`` (r x in) and
``B`` (out x r); only ``A`` and ``B`` train (plus any parameters named in ``trainable``), the
base weights are frozen. ``B`` starts at zero, so an adapted model computes exactly what the base
model did until the first update.

Why a hand-written adapter: it is twenty lines, it keeps the base model's parameter names (an
adapted ``q_proj`` still has ``q_proj.weight``, so base checkpoints load into it unchanged, and
the adapters are ``q_proj.lora_A`` / ``q_proj.lora_B``), and it is an ``nn.Linear`` in every
respect (the layer object, its hooks and references stay; only its class becomes
:class:`LoRALinear`), so DDP, recompute, compile and master weights see ordinary parameters.

Use it through the config (no code)::

    lora:
      enabled: true
      targets: ["*.self_attn.q_proj", "*.self_attn.v_proj", "*.mlp.*_proj"]
      rank: 16
      alpha: 32
    trainer:
      param_dtype: bf16     # the frozen base in bf16 with no fp32 copy; fp32 masters for the adapters
      precision: bf16
    checkpoint:
      trainable_only: true  # checkpoints hold the adapters (+ optimizer state); the base by path
      base_model: /models/base/model.safetensors

or from Python: :func:`apply_lora`, :func:`merge_lora`, :func:`lora_state_dict`,
:func:`merged_state_dict`. Export a trained checkpoint as plain merged weights (base + adapters
folded in; loadable by the base model's own code) with ddptrain/weights.py::

    python -m ddptrain.weights export runs/x/checkpoints/step_00001000 out_dir/ [--dtype bf16]

Frozen parameters cost their weights only: with ``trainer.param_dtype: bf16`` 2 B each, no
gradient, no master, no optimizer state (see ``python -m ddptrain.memory --trainable``). DDP
only registers the trainable parameters, so frozen ones never need
``dist.find_unused_parameters``.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from typing import Iterable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["LoRALinear", "apply_lora", "merge_lora", "unmerge_lora", "lora_state_dict", "merged_state_dict",
           "lora_scalings", "add_adapters", "merge_tensors"]


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter; made by :func:`apply_lora` (never built directly).

    Attributes:
        lora_A: ``(r, in_features)`` parameter, Kaiming-uniform initialised.
        lora_B: ``(out_features, r)`` parameter, zero initialised.
        lora_scaling: ``alpha / r``.
        lora_dropout: dropout probability on the adapter's input.
        lora_merged: the adapter is folded into ``weight`` (forward skips it).
    """

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora_merged:
            return out
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        if h.dtype != self.lora_A.dtype and not torch.is_autocast_enabled(h.device.type):
            h = h.to(self.lora_A.dtype)  # fp32 adapters on a bf16 base, outside autocast
        return out + (F.linear(F.linear(h, self.lora_A), self.lora_B) * self.lora_scaling).to(out.dtype)

    def delta(self) -> torch.Tensor:
        """``alpha / r * B @ A`` in fp32: what merging adds to ``weight``."""
        return (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.lora_scaling

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_rank={self.lora_A.shape[0]}, lora_scaling={self.lora_scaling:g}"
                f"{', merged' if self.lora_merged else ''}")


def _match(names: Iterable[str], globs: Sequence[str]) -> list[str]:
    return [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)]


def apply_lora(model: nn.Module, targets: Sequence[str], rank: int = 16, alpha: float = 32.0,
               dropout: float = 0.0, trainable: Sequence[str] = (), freeze: bool = True) -> list[str]:
    """Add adapters to the ``nn.Linear`` layers whose dotted names match ``targets``, in place.

    Call it on the model with its base weights loaded (the adapters are made on the weights'
    device), before the Trainer wraps it (the Trainer does it itself with ``lora.enabled``).
    The adapters are fp32; ``trainer.param_dtype: bf16`` makes them bf16 with fp32 masters.

    Args:
        model: the model.
        targets: module-name globs (fnmatch; ``*`` crosses dots), e.g. ``["*.q_proj", "*.v_proj"]``.
            Modules they match that are not ``nn.Linear`` (a whole attention block, say) are
            left alone; matched linear layers of a subclass of ``nn.Linear`` are an error.
        rank: the adapter rank ``r``.
        alpha: the adapter output is scaled by ``alpha / rank``.
        dropout: dropout probability on the adapter input (training only).
        trainable: parameter-name globs that stay trainable besides the adapters (a new head,
            norms); everything else is frozen when ``freeze``.
        freeze: set ``requires_grad=False`` on every other parameter.

    Returns:
        The dotted names of the adapted layers.

    Raises:
        ValueError: a pattern of ``targets`` matched no linear layer (the message names it and the
            closest layer names, as globs), a matched layer
            already has an adapter or is a subclass of ``nn.Linear``, its weights are on the meta
            device, a ``trainable`` glob matched nothing, or ``rank < 1``.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = _match(linears, targets)
    for glob in targets:  # a typo in one pattern would silently adapt fewer layers
        if not _match(linears, [glob]):
            raise ValueError(_unmatched(glob, model, linears))
    for name in chosen:
        m = linears[name]
        if isinstance(m, LoRALinear):
            raise ValueError(f"{name} already has a LoRA adapter (apply_lora was called twice on it)")
        if type(m) is not nn.Linear:
            raise ValueError(f"{name} is a {type(m).__name__}, a subclass of nn.Linear: LoRA adapts plain nn.Linear "
                             "layers only; narrow lora.targets")
        if m.weight.is_meta:
            raise ValueError(f"{name}'s weight is on the meta device: load the base weights "
                             "(ddptrain.load_pretrained) before adding adapters")
    extra = [n for n, _ in model.named_parameters()] if trainable else []
    keep = set(_match(extra, trainable))
    missing = [g for g in trainable if not _match(extra, [g])]
    if missing:
        raise ValueError(f"lora.trainable globs {missing} matched no parameter; parameters include {extra[:12]}")
    if freeze:
        for n, p in model.named_parameters():
            p.requires_grad_(n in keep)
    for name in chosen:
        m = linears[name]
        a = torch.empty(rank, m.in_features, device=m.weight.device, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear's own initialisation, as in the LoRA paper's code
        m.__class__ = LoRALinear
        m.lora_A = nn.Parameter(a)
        m.lora_B = nn.Parameter(torch.zeros(m.out_features, rank, device=m.weight.device, dtype=torch.float32))
        m.lora_scaling, m.lora_dropout, m.lora_merged = float(alpha) / rank, float(dropout), False
    return chosen


def _unmatched(glob: str, model: nn.Module, linears: dict) -> str:
    """Why ``glob`` adapts nothing, with the closest linear layer names (as globs: layer numbers
    replaced by ``*``, then as they are)."""
    others = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
              if n and not isinstance(m, nn.Linear) and fnmatch.fnmatchcase(n, glob)]
    if others:
        return (f"lora.targets pattern {glob!r} matched no nn.Linear layer, only modules that are not nn.Linear: "
                f"{', '.join(others[:5])}{' ...' if len(others) > 5 else ''}; to adapt the linear layers inside "
                f"them, write {glob + '.*'!r}")
    generic = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", n) for n in linears})
    close = difflib.get_close_matches(glob, generic, n=5, cutoff=0.5) or generic[:5]
    return (f"lora.targets pattern {glob!r} matched no nn.Linear layer (a typo?); the closest: "
            f"{', '.join(map(repr, close))}; linear layers in this model include {sorted(linears)[:12]}")


def add_adapters(model: nn.Module, scalings: dict, tensors: dict) -> list[str]:
    """Give ``model`` the adapters a saved state names, where it has none yet (loading a LoRA
    checkpoint into a plain model): layer names and ``alpha / r`` from ``scalings``
    (:func:`lora_scalings`), ranks from the saved ``lora_A`` shapes. Flags are left as they are.

    Returns:
        The layers that got an adapter here.
    """
    added = []
    modules = dict(model.named_modules())
    for layer, scaling in scalings.items():
        if isinstance(modules.get(layer), LoRALinear):
            continue
        rank = tensors[f"{layer}.lora_A"].shape[0]
        added += apply_lora(model, [layer], rank=rank, alpha=scaling * rank, freeze=False)
    return added


def _adapted(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@torch.no_grad()
def merge_lora(model: nn.Module, keep_adapters: bool = False) -> list[str]:
    """Fold every adapter into its layer's weight (``W += alpha/r * B A``, computed in fp32).

    Args:
        model: an adapted model (not wrapped in DDP).
        keep_adapters: keep ``lora_A``/``lora_B`` (the layer skips them; :func:`unmerge_lora`
            takes the update out again). By default they are removed and every layer is a plain
            ``nn.Linear`` again: the model has the base model's parameters and names exactly.

    Returns:
        The names of the merged layers.
    """
    names = []
    for name, m in _adapted(model):
        if not m.lora_merged:
            m.weight.copy_((m.weight.float() + m.delta()).to(m.weight.dtype))
            m.lora_merged = True
        if not keep_adapters:
            del m.lora_A, m.lora_B
            m.__class__ = nn.Linear
            for attr in ("lora_scaling", "lora_dropout", "lora_merged"):
                delattr(m, attr)
        names.append(name)
    return names


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> list[str]:
    """Take merged adapters (``merge_lora(keep_adapters=True)``) out of the weights again.

    Exact for fp32 weights; a bf16 weight was rounded when the update went in, so it comes back
    within bf16 rounding of the original.
    """
    names = []
    for name, m in _adapted(model):
        if m.lora_merged:
            m.weight.copy_((m.weight.float() - m.delta()).to(m.weight.dtype))
            m.lora_merged = False
            names.append(name)
    return names


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (``...q_proj.lora_A``), detached."""
    return {f"{n}.{k}": getattr(m, k).detach() for n, m in _adapted(model) for k in ("lora_A", "lora_B")}


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """``{layer name: alpha / r}`` of every adapter (saved with trainable-only checkpoints)."""
    return {n: m.lora_scaling for n, m in _adapted(model)}


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with the adapters folded in, leaving ``model`` unchanged.

    Keys are the base model's (no ``lora_A``/``lora_B``); adapted weights are new tensors in
    the weight's dtype, everything else is the model's own tensor.
    """
    adapted = dict(_adapted(model))
    out = {}
    for k, v in model.state_dict().items():
        owner, _, leaf = k.rpartition(".")
        if leaf in ("lora_A", "lora_B") and owner in adapted:
            continue
        m = adapted.get(owner)
        if m is not None and leaf == "weight" and not m.lora_merged:
            v = (v.float() + m.delta().to(v.device)).to(v.dtype)
        out[k] = v
    return out


def merge_tensors(tensors: dict, scalings: dict) -> dict:
    """Fold ``X.lora_A`` / ``X.lora_B`` pairs of a flat tensor dict into ``X.weight``.

    Args:
        tensors: name -> tensor, holding every adapted layer's ``weight`` and its adapter pair.
        scalings: layer name -> ``alpha / r``.

    Returns:
        A new dict without adapter keys.

    Raises:
        KeyError: an adapter whose layer's weight or scaling is missing.
    """
    out = {k: v for k, v in tensors.items() if not k.endswith((".lora_A", ".lora_B"))}
    for k in tensors:
        if k.endswith(".lora_A"):
            layer = k[: -len(".lora_A")]
            w = out[f"{layer}.weight"]
            delta = (tensors[f"{layer}.lora_B"].float() @ tensors[k].float()) * scalings[layer]
            out[f"{layer}.weight"] = (w.float() + delta).to(w.dtype)
    return out
