"""Counting the bytes autograd saves for backward: the measure of what activation checkpointing
saves (tests/test_recompute.py). A test tool, not part of the library."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Context manager counting the bytes autograd saves for backward inside it.

    Storages are counted once however many views of them are saved (a layer's output saved by the
    next layer's norm and its residual add costs memory once). Saved tensors are kept referenced
    until the context exits, so a freed storage's address cannot be reused and be miscounted.
    Inside a :func:`ddptrain.recompute.checkpoint` region only what it keeps (its inputs) is counted,
    which is exactly the memory that stays alive.

    Args:
        ignore: tensors whose storages are not counted, typically ``model.parameters()``
            (weights are saved by every matmul but exist whether or not we checkpoint).
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()):
        self.nbytes = 0
        self._seen = {t.untyped_storage().data_ptr() for t in ignore}
        self._keep: list[torch.Tensor] = []
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "SavedBytes":
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.nbytes += storage.nbytes()
            self._keep.append(t)
        return t

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._keep.clear()


def saved_activation_bytes(fn: Callable[[], Any], ignore: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of (distinct) tensors autograd saves for backward while running ``fn()``.

    Args:
        fn: a zero-argument callable, e.g. ``lambda: model(x)``.
        ignore: tensors not to count (see :class:`SavedBytes`).

    Returns:
        The byte count.
    """
    with SavedBytes(ignore) as counter:
        fn()
    return counter.nbytes
