"""Losses for language-model heads that never materialise the full ``(B, T, V)`` logits.

Why: a decoder with a 151,552-token vocabulary (GLM-4, Qwen2) at 8k positions has logits of
8192 x 151552 = 1.24e9 values: 2.5 GB in bf16, 5 GB in fp32 for the softmax, and autograd keeps
them (and their gradient) alive through the backward. That is more than all the layers'
recomputed activations together. Two things remove it:

1. Only *supervised* positions get logits (``labels != ignore_index``; in speech/TTS recipes the
   prompt and the audio placeholders are not supervised, often most of the sequence).
2. The head runs over those positions in chunks of rows, and each chunk's gradient (with respect
   to the hidden states and the head weight) is computed right away in the forward, so no
   chunk's logits outlive it: peak memory is one chunk of logits, whatever the sequence length.
   The backward then only scales the saved gradients by the incoming gradient (the scheme of
   Liger-Kernel's fused linear cross-entropy). The FLOPs are those of the plain head: one
   forward and two gradient matmuls, nothing recomputed.

Both functions follow the loss contract (docs/design.md): they return the *sum* of the token
cross-entropies and the number of tokens it covers.

Example, on a Hugging Face causal LM (the base model's last hidden state and the head's weight)::

    def loss_fn(model, batch):
        core = model.module if hasattr(model, "module") else model
        hidden = core.model(input_ids=batch["input_ids"]).last_hidden_state
        return causal_lm_loss(hidden, core.lm_head.weight, batch["labels"])

(Call the DDP wrapper's forward instead if you need DDP's forward hooks; see the recipes.)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["causal_lm_loss", "linear_cross_entropy"]


class _ChunkedLinearCE(torch.autograd.Function):
    """``sum_i CE(hidden[i] @ weight.T + bias, target[i])``, its gradients computed in the forward.

    The inputs come uncast; the matmuls run in ``dtype`` (autocast's, decided by the caller) and
    each gradient is returned in its input's own dtype, so an fp32 head keeps an fp32 gradient.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, chunk: int,
                dtype: torch.dtype, need: tuple) -> Tensor:
        need_h, need_w, need_b = need
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        # the head's gradient accumulates over chunks in fp32: bf16 sums of thousands of rows lose bits
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk].to(dtype)
            t = target[start:start + chunk]
            logits = F.linear(h, w, b).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if not any(need):
                continue
            # d(lse - logit[t]) / d logits = softmax - onehot, formed in place in the logits buffer
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(t.numel(), device=t.device), t] -= 1.0
            if need_b:
                grad_b += grad.sum(0)
            grad = grad.to(dtype)
            if need_h:
                torch.matmul(grad, w, out=grad_h[start:start + chunk])
            if need_w:
                grad_w += grad.t() @ h
        ctx.save_for_backward(*(g for g in (grad_h, grad_w, grad_b) if g is not None))
        ctx.need, ctx.dtypes = need, (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        saved = iter(ctx.saved_tensors)
        grads = [(next(saved) * grad_out).to(dt) if on else None for on, dt in zip(ctx.need, ctx.dtypes)]
        return grads[0], grads[1], grads[2], None, None, None, None


def _compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype a matmul on ``t`` runs in here: autocast's if it is on, else the tensor's."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind) and t.is_floating_point():
        return torch.get_autocast_dtype(kind)
    return t.dtype


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                         chunk_size: int = 2048) -> Tensor:
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target``, in row chunks.

    Args:
        hidden: ``(N, D)`` hidden states of the supervised positions only.
        weight: ``(V, D)`` output projection (``lm_head.weight``); frozen or trainable.
        target: ``(N,)`` token ids in ``[0, V)``.
        bias: optional ``(V,)`` output bias.
        chunk_size: rows per chunk; peak extra memory is about ``chunk_size x V x 4`` bytes
            (2048 rows x 151552 = 1.2 GB), plus an fp32 ``(V, D)`` gradient if ``weight`` trains.

    Returns:
        A 0-d fp32 tensor: the sum over the ``N`` rows (0 when ``N == 0``).

    Raises:
        ValueError: shapes that do not fit, or ``chunk_size < 1``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "must be (N, D) and (V, D)")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: target {tuple(target.shape)} must be ({hidden.shape[0]},)")
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size} must be >= 1")
    dtype = _compute_dtype(hidden)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):  # the Function casts to autocast's dtype itself
        return _ChunkedLinearCE.apply(hidden, weight, bias, target.long(), int(chunk_size), dtype, need)


def causal_lm_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Optional[Tensor] = None,
                   ignore_index: int = -100, shift: bool = True, positions: Optional[Tensor] = None,
                   chunk_size: int = 2048) -> tuple[Tensor, int]:
    """Next-token cross-entropy at the supervised positions only: ``(loss_sum, num_tokens)``.

    Two ways to say which positions are supervised:

    - ``labels`` of shape ``(B, T)`` with ``ignore_index`` where there is no target. With
      ``shift=True`` (Hugging Face's convention: labels are the input ids) position ``t``
      predicts ``labels[:, t + 1]``; with ``shift=False`` it predicts ``labels[:, t]``. Finding
      the positions costs one host sync (their count decides the shapes).
    - ``positions``: flat indices into ``hidden.reshape(-1, D)`` of the positions that predict,
      with ``labels`` the ``(N,)`` targets they predict, both built on the host by the collate
      function: no host sync in the step.

    Args:
        hidden: ``(B, T, D)`` final hidden states (after the last norm), before the head.
        weight: ``(V, D)`` head weight (``lm_head.weight``; tied embeddings are fine).
        labels: see above.
        bias: optional head bias.
        ignore_index: the label of unsupervised positions.
        shift: whether ``labels`` (the ``(B, T)`` form) are aligned with the inputs.
        positions: optional flat prediction positions (see above).
        chunk_size: rows per chunk (see :func:`linear_cross_entropy`).

    Returns:
        ``(loss_sum, num_tokens)``: a 0-d fp32 tensor and a host int (the loss contract).

    Raises:
        ValueError: shapes that do not fit, or a target outside the vocabulary.
    """
    if hidden.dim() != 3:
        raise ValueError(f"causal_lm_loss: hidden must be (B, T, D), got {tuple(hidden.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if positions is not None:
        if labels.shape != positions.shape or positions.dim() != 1:
            raise ValueError(f"causal_lm_loss: positions {tuple(positions.shape)} and labels {tuple(labels.shape)} "
                             "must be two (N,) tensors")
        rows, target = flat.index_select(0, positions.to(flat.device)), labels.to(flat.device)
    else:
        if labels.shape != hidden.shape[:2]:
            raise ValueError(f"causal_lm_loss: labels {tuple(labels.shape)} must be (B, T) = {tuple(hidden.shape[:2])}")
        if shift:  # position t predicts token t + 1; the last position predicts nothing
            labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)
        labels = labels.reshape(-1).to(flat.device)
        index = (labels != ignore_index).nonzero().squeeze(1)
        rows, target = flat.index_select(0, index), labels.index_select(0, index)
        if target.numel():  # one more sync where there is one anyway: a bad id is an error, not a device assert
            low, high = torch.stack([target.min(), target.max()]).tolist()
            if low < 0 or high >= weight.shape[0]:
                raise ValueError(f"causal_lm_loss: a target id is outside the vocabulary [0, {weight.shape[0]}) "
                                 f"(min {low}, max {high}); is ignore_index={ignore_index} right?")
    return linear_cross_entropy(rows, weight, target, bias, chunk_size), int(target.numel())
