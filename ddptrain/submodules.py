"""Choosing a model's submodules by class name or name glob, and giving one an instance ``forward``.

Activation checkpointing (:mod:`ddptrain.recompute`) and regional compilation
(:mod:`ddptrain.compile`) both act on selected submodules, and both act by changing what the
module's call runs, without touching its class, parameters, ``state_dict()`` keys or hooks. They
share both pieces here so that they select modules the same way and compose in either order: a
module's :class:`InstanceForward` runs ``inner`` (the class forward, or compile's compiled copy
of it) through ``around`` (recompute's checkpoint, in training), each set by its own owner.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any, Callable, Iterable, Optional

from torch import nn


def match_modules(model: nn.Module, module_classes: Iterable[str], name_globs: Iterable[str],
                  what: str) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs selected by class name or dotted-name glob, outermost only.

    A module matches if its class name is in ``module_classes`` or its dotted name matches one
    of ``name_globs`` (fnmatch; ``*`` also crosses dots). Containers without a ``forward``
    (ModuleList, ModuleDict: never called) are never selected, and a match nested inside an
    earlier match is skipped. Registration order is kept.

    Args:
        model: the model to search (names are relative to it).
        module_classes: class names to select.
        name_globs: dotted-name patterns to select.
        what: the config section asking (named in the error).

    Raises:
        ValueError: nothing matched; the message names the patterns, ``what`` and some class
            names that do exist in the model.
    """
    classes, globs = set(module_classes), list(name_globs)
    matched: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).forward is nn.Module.forward or any(name.startswith(p + ".") or p == "" for p, _ in matched):
            continue
        if type(module).__name__ in classes or any(fnmatch.fnmatchcase(name, g) for g in globs):
            matched.append((name, module))
    if not matched:
        present = sorted({type(m).__name__ for m in model.modules()})[:20]
        raise ValueError(f"{what} is enabled but no module matched module_classes="
                         f"{sorted(classes)} name_globs={globs}; class names in this model "
                         f"include {present}")
    return matched


class InstanceForward:
    """A module's instance-level ``forward``: ``inner(module, ...)``, run through ``around``.

    ``nn.Module.__call__`` calls ``self.forward``, so module hooks still run around it. A callable
    object rather than a closure so ``copy.deepcopy(model)`` (EMA copies) gets a forward bound to
    the copy, not to the original module.

    Attributes:
        module: the module it belongs to.
        inner: an unbound forward, called as ``inner(module, *args, **kwargs)``; the class's own
            ``forward`` unless replaced (regional compilation puts a compiled one here).
        around: ``None``, or ``around(module, forward, *args, **kwargs)`` that calls ``forward``
            (``inner`` bound to the module) its own way (recompute checkpoints it in training).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.inner: Callable = type(module).forward
        self.around: Optional[Callable] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = functools.partial(self.inner, self.module)
        if self.around is None:
            return forward(*args, **kwargs)
        return self.around(self.module, forward, *args, **kwargs)


def instance_forward(module: nn.Module, name: str = "") -> InstanceForward:
    """The module's :class:`InstanceForward`, installed if it has none yet.

    Raises:
        ValueError: the module already has an instance ``forward`` set by other code (it would
            be silently dropped).
    """
    current = module.__dict__.get("forward")
    if isinstance(current, InstanceForward):
        return current
    if current is not None:
        raise ValueError(f"module {name or type(module).__name__!r} already has an instance-level forward "
                         f"({current!r}) set by other code; recompute/compile would replace it")
    module.forward = InstanceForward(module)
    return module.forward


def tidy_forward(module: nn.Module) -> None:
    """Remove the module's :class:`InstanceForward` if it no longer changes anything."""
    current = module.__dict__.get("forward")
    if isinstance(current, InstanceForward) and current.around is None and current.inner is type(module).forward:
        del module.__dict__["forward"]
