"""ddptrain/losses.py: the chunked head + cross-entropy equals the full-logits cross-entropy (value
and gradients, fp32 and bf16 autocast, frozen or trainable head, with a bias), the two ways of
naming supervised positions agree, and no (positions x vocabulary) logits are kept for backward."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from _saved_bytes import SavedBytes
from ddptrain.losses import causal_lm_loss, linear_cross_entropy

B, T, D, V = 3, 11, 16, 97


def _inputs(seed=0, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :4] = -100  # a prompt
    labels[2, 7:] = -100  # padding
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                           reduction="sum"), int((labels[:, 1:] != -100).sum())


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_full_cross_entropy_value_and_gradients(chunk, bias):
    h, w, b, labels = _inputs(bias=bias)
    loss, n = causal_lm_loss(h, w, labels, bias=b, chunk_size=chunk)
    params = [h, w] + ([b] if bias else [])
    got = torch.autograd.grad(loss * 0.5, params)  # a scaled upstream gradient, as the Trainer's
    ref, n_ref = _reference(h, w, b, labels)
    want = torch.autograd.grad(ref * 0.5, params)
    assert n == n_ref and isinstance(n, int)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_unshifted_labels_and_host_built_positions_agree():
    h, w, _, labels = _inputs()
    shifted, n = causal_lm_loss(h, w, labels)
    aligned = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], 1)  # already "position t predicts t"
    unshifted, n2 = causal_lm_loss(h, w, aligned, shift=False)
    flat = aligned.reshape(-1)
    pos = (flat != -100).nonzero().squeeze(1)
    by_pos, n3 = causal_lm_loss(h, w, flat[pos], positions=pos)
    assert n == n2 == n3
    torch.testing.assert_close(unshifted, shifted)
    torch.testing.assert_close(by_pos, shifted)


def test_frozen_head_gets_no_gradient_and_eval_needs_none():
    h, w, _, labels = _inputs()
    w.requires_grad_(False)
    loss, _ = causal_lm_loss(h, w, labels)
    (gh,) = torch.autograd.grad(loss, [h])
    ref, _ = _reference(h, w, None, labels)
    torch.testing.assert_close(gh, torch.autograd.grad(ref, [h])[0], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_loss(h, w, labels, chunk_size=5)[0], ref.detach(), rtol=1e-5, atol=1e-5)


def test_bf16_autocast_matches_full_logits_under_autocast():
    h, w, _, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = causal_lm_loss(h, w, labels, chunk_size=8)
        ref, _ = _reference(h, w, None, labels)
    gl = torch.autograd.grad(loss, [h, w])
    gr = torch.autograd.grad(ref, [h, w])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-3, atol=1e-2)
    for a, b in zip(gl, gr):
        assert a.dtype == b.dtype == torch.float32  # each gradient in its input's dtype
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def test_bf16_tensors_give_bf16_gradients():
    h, w, _, labels = _inputs(dtype=torch.bfloat16)
    loss, _ = causal_lm_loss(h, w, labels)
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert gh.dtype == gw.dtype == torch.bfloat16
    ref, _ = _reference(h.float(), w.float(), None, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=0.2)


def test_no_supervised_positions_is_zero_loss_zero_units_and_zero_gradient():
    h, w, _, labels = _inputs()
    loss, n = causal_lm_loss(h, w, torch.full_like(labels, -100))
    assert n == 0 and loss.item() == 0.0
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert not gh.any() and not gw.any()


def test_keeps_no_logits_for_backward():
    """Autograd's saved tensors hold the gradients (hidden-sized and head-sized), never the
    (positions x vocabulary) logits the plain head keeps."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 64, 8, 4096
    h = torch.randn(1, n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (1, n), generator=g)
    with SavedBytes(ignore=[h, w]) as ours:
        causal_lm_loss(h, w, labels, chunk_size=16)
    with SavedBytes(ignore=[h, w]) as plain:
        _reference(h, w, None, labels)
    logits_bytes = (n - 1) * v * 4
    assert plain.nbytes >= logits_bytes
    assert ours.nbytes <= (n * d + v * d) * 4 * 1.1 < logits_bytes


def test_bad_input_is_a_clear_error():
    h, w, _, labels = _inputs()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        causal_lm_loss(h, w, labels.clamp_min(0) + V)  # forgot to mark padding, ids shifted
    with pytest.raises(ValueError, match=r"labels \(3, 10\) must be \(B, T\)"):
        causal_lm_loss(h, w, labels[:, 1:])
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h[0], w, labels[0].clamp_min(0), chunk_size=0)
    with pytest.raises(ValueError, match="must be \\(N, D\\) and \\(V, D\\)"):
        linear_cross_entropy(h[0], w[:, :3], labels[0].clamp_min(0))
