"""A small Conformer-CTC acoustic model for the ddptrain examples.

This model belongs to the examples, not to the library: ddptrain trains any
``nn.Module``; this one is what the demos use.

    features (B, T, 80) fbank, 10 ms hop
      -> Conv2dSubsampling: 2 x [Conv2d(kernel 3, stride 2) + ReLU]   (4x: 40 ms frames)
      -> Linear(channels * freq', d_model) + dropout
      -> torchaudio.models.Conformer (num_layers blocks)
      -> Linear(d_model, vocab_size) -> log_softmax                   (CTC head, blank = 0)

Output lengths follow the subsampling exactly::

    out_len = ((T - 1) // 2 - 1) // 2          (both convolutions: kernel 3, stride 2, no padding)

The default configuration has about 2.2 M parameters and trains on a laptop
CPU in minutes on the connected-digit demo data (examples/data).

Run ``python examples/models/conformer_ctc.py`` for a self-check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torchaudio


@dataclass
class ConformerCTCConfig:
    input_dim: int = 80  # feature bins per frame (80-bin fbank / log-mel)
    d_model: int = 144  # Conformer width (attention and convolution channels)
    num_heads: int = 4  # attention heads; must divide d_model
    ffn_dim: int = 576  # hidden size of the two feed-forward modules per block (4 x d_model)
    num_layers: int = 4  # Conformer blocks
    depthwise_conv_kernel_size: int = 31  # convolution module kernel (odd), in 40 ms frames
    dropout: float = 0.1  # dropout in the front end and in every Conformer sub-module
    vocab_size: int = 28  # CTC output units, blank (index 0) included: blank + space + a-z
    subsampling_channels: int = 64  # channels of the two Conv2d front-end layers


def subsampled_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after the 4x front end (two Conv2d, kernel 3, stride 2, no padding)."""
    return torch.div(torch.div(lengths - 1, 2, rounding_mode="floor") - 1, 2,
                     rounding_mode="floor").clamp(min=0)


class Conv2dSubsampling(nn.Module):
    """(B, T, F) -> (B, T', d_model) with T' = ((T - 1) // 2 - 1) // 2."""

    def __init__(self, input_dim: int, d_model: int, channels: int, dropout: float):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, stride=2),
            nn.ReLU(),
            nn.Conv2d(channels, channels, kernel_size=3, stride=2),
            nn.ReLU(),
        )
        freq = ((input_dim - 1) // 2 - 1) // 2
        self.out = nn.Linear(channels * freq, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv(x.unsqueeze(1))  # (B, C, T', F')
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return self.dropout(x), subsampled_lengths(lengths)


class _PaddingMask:
    """Holds the (B, T') padding mask (True = padding) during ConformerCTC.forward."""

    mask: torch.Tensor | None = None


class _MaskedDepthwiseConv(nn.Module):
    """Zeroes padded frames before the depthwise convolution of a Conformer block.

    torchaudio's Conformer masks attention but not its convolution module, so
    without this the frames past an utterance's end (whatever the rest of the
    batch made them) leak into its last kernel_size // 2 frames and the output
    depends on how the batch was padded.
    """

    def __init__(self, conv: nn.Conv1d, holder: _PaddingMask):
        super().__init__()
        self.conv = conv
        self._holder = holder

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T')
        mask = self._holder.mask
        if mask is not None:
            x = x.masked_fill(mask[:, None, : x.shape[-1]], 0.0)
        return self.conv(x)


class ConformerCTC(nn.Module):
    """Conv2d subsampling + torchaudio Conformer encoder + linear CTC head."""

    def __init__(self, cfg: ConformerCTCConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or ConformerCTCConfig()
        self.subsampling = Conv2dSubsampling(cfg.input_dim, cfg.d_model,
                                             cfg.subsampling_channels, cfg.dropout)
        self.encoder = torchaudio.models.Conformer(
            input_dim=cfg.d_model,
            num_heads=cfg.num_heads,
            ffn_dim=cfg.ffn_dim,
            num_layers=cfg.num_layers,
            depthwise_conv_kernel_size=cfg.depthwise_conv_kernel_size,
            dropout=cfg.dropout,
        )
        self._padding = _PaddingMask()
        for layer in self.encoder.conformer_layers:
            seq = layer.conv_module.sequential  # [pointwise, GLU, depthwise, norm, ...]
            seq[2] = _MaskedDepthwiseConv(seq[2], self._padding)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, features: torch.Tensor,
                feature_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features (B, T, input_dim), feature_lens (B,) ->
        log_probs (B, T', vocab_size) (log-softmax over the vocabulary), out_lens (B,).

        Frames past out_lens are padding; nn.CTCLoss wants log_probs.transpose(0, 1).
        """
        x, out_lens = self.subsampling(features, feature_lens)
        # torchaudio's Conformer masks attention by lengths; it needs every length >= 1 and a time
        # axis exactly max(lengths) long (batches may be padded further, e.g. to a multiple of 8)
        lens = out_lens.clamp(min=1).to(x.device)
        x = x[:, : int(lens.max())]
        out_lens = out_lens.clamp(max=x.shape[1])
        # The mask stays set after forward on purpose: activation checkpointing re-runs the layers
        # during backward and must see the same mask (the next forward replaces it).
        self._padding.mask = torch.arange(x.shape[1], device=x.device)[None, :] >= lens[:, None]
        x, _ = self.encoder(x, lens)
        return self.head(x).log_softmax(dim=-1), out_lens

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def ctc_greedy_decode(log_probs: torch.Tensor, out_lens: torch.Tensor,
                      blank: int = 0) -> list[list[int]]:
    """Best-path CTC decoding: argmax per frame, merge repeats, drop blanks.

    log_probs (B, T', V), out_lens (B,) -> one list of token ids per utterance.
    """
    best = log_probs.argmax(dim=-1).cpu()
    hyps = []
    for seq, n in zip(best, out_lens.cpu().tolist()):
        seq = torch.unique_consecutive(seq[: int(n)])
        hyps.append([int(t) for t in seq if t != blank])
    return hyps


def _self_check() -> None:
    torch.manual_seed(0)
    cfg = ConformerCTCConfig()
    model = ConformerCTC(cfg)
    print(f"ConformerCTC default config: {model.num_params():,} parameters")

    feature_lens = torch.tensor([301, 250, 57, 7])  # 7 frames -> 1 output frame
    feats = torch.randn(len(feature_lens), int(feature_lens.max()), cfg.input_dim)
    log_probs, out_lens = model(feats, feature_lens)
    expect = [((t - 1) // 2 - 1) // 2 for t in feature_lens.tolist()]
    assert out_lens.tolist() == expect, (out_lens.tolist(), expect)
    assert log_probs.shape == (len(feature_lens), max(expect), cfg.vocab_size), log_probs.shape
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(()), atol=1e-4)
    # padding must not change the result for an utterance
    lp1, _ = model.eval()(feats[2:3, :57], feature_lens[2:3])
    lp_full, _ = model(feats, feature_lens)
    assert torch.allclose(lp1[0], lp_full[2, : expect[2]], atol=1e-4)
    # nor must padding the whole batch past its longest utterance (pad_to_multiple)
    lp_pad, lens_pad = model(nn.functional.pad(feats, (0, 0, 0, 13)), feature_lens)
    assert lens_pad.tolist() == expect and torch.allclose(lp_pad, lp_full, atol=1e-4)
    model.train()

    targets = torch.randint(1, cfg.vocab_size, (len(feature_lens), 10))
    target_lens = torch.tensor([10, 8, 5, 1])
    loss = nn.CTCLoss(blank=0, zero_infinity=True)(
        log_probs.transpose(0, 1), targets, out_lens, target_lens)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    hyps = ctc_greedy_decode(log_probs.detach(), out_lens)
    assert len(hyps) == len(feature_lens) and all(0 not in h for h in hyps)
    print(f"forward+backward ok: loss {loss.item():.2f}, out_lens {out_lens.tolist()} "
          f"== ((T-1)//2-1)//2 for T={feature_lens.tolist()}")


if __name__ == "__main__":
    _self_check()
