"""WER / CER as error *counts* that reduce correctly across batches and ranks.

A corpus WER is total word errors / total reference words. Averaging per-batch (or per-rank)
WERs weights short utterances too heavily, so everything here returns ``(errors, ref_length)``
pairs; the Trainer sums numerators and denominators over all batches and ranks and divides once.
"""

from __future__ import annotations

from typing import Sequence

from ddptrain import dist


def edit_distance(ref: Sequence, hyp: Sequence) -> int:
    """Levenshtein distance (substitutions + deletions + insertions), O(len(ref) * len(hyp))."""
    if len(ref) < len(hyp):
        ref, hyp = hyp, ref
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def word_errors(refs: Sequence[str], hyps: Sequence[str]) -> tuple[int, int]:
    """``(word errors, reference words)`` summed over utterance pairs."""
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    errs = sum(edit_distance(r.split(), h.split()) for r, h in zip(refs, hyps))
    return errs, sum(len(r.split()) for r in refs)


def char_errors(refs: Sequence[str], hyps: Sequence[str]) -> tuple[int, int]:
    """``(character errors, reference characters)``; spaces count, runs of spaces collapse."""
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    norm = lambda s: " ".join(s.split())  # noqa: E731
    errs = sum(edit_distance(norm(r), norm(h)) for r, h in zip(refs, hyps))
    return errs, sum(len(norm(r)) for r in refs)


def reduce_ratios(sums: dict, device) -> dict:
    """``{name: [numerator, denominator]}`` summed over all ranks -> ``{name: ratio}`` (NaN for a
    zero denominator). Collective; names may differ between ranks (one with no batches)."""

    # the same names in the same order on every rank, even one that had no batches
    names = sorted(set().union(*dist.all_gather_object(sorted(sums))))
    flat = dist.all_reduce_sum([v for k in names for v in sums.get(k, [0.0, 0.0])], device)
    return {k: flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else float("nan") for i, k in enumerate(names)}
