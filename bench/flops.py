"""Analytic training FLOPs of one padded batch, and the MFU they give.

MFU = model FLOPs / (time x GPUs x ``PEAK_BF16``), with the FLOPs of the *padded* batch actually
computed and recomputation not counted. ``bench/check_flops.py`` checks these formulas against
torch's FlopCounterMode on small models.
"""

from __future__ import annotations

PEAK_BF16 = 989.4e12  # dense bf16 tensor-core peak of one H100/H200 SXM (datasheet)


class Flops:
    """Training FLOPs (forward + backward = 3x forward for trained weights) of one padded batch.

    Linear layers: ``6 * params * tokens``; attention (QK^T and AV): ``12 * layers * d * T^2``
    per sequence; convolutions counted exactly from their output lengths (a frozen front end:
    forward only; a layer whose input needs no gradient: forward + weight gradient = 2x).

    Args:
        kind: ``wav2vec2`` | ``whisper`` | ``conformer``.
        model: the model (parameter counts and sizes are read from it; meta tensors are fine).

    Raises:
        ValueError: for an unknown ``kind``.
    """

    def __init__(self, kind: str, model):
        self.kind = kind
        c = model.config if hasattr(model, "config") else None
        if kind == "wav2vec2":
            self.convs = [(k, s) for k, s in zip(c.conv_kernel, c.conv_stride)]
            self.dims = [1] + list(c.conv_dim)
            fe = model.wav2vec2.feature_extractor
            self.fe_trained = any(p.requires_grad for p in fe.parameters())
            fe_ids = {id(p) for p in fe.parameters()}
            self.p_train = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in fe_ids)
            self.layers, self.d = c.num_hidden_layers, c.hidden_size
        elif kind == "whisper":
            enc, dec = model.model.encoder, model.model.decoder
            self.p_enc = sum(p.numel() for p in enc.layers.parameters())
            self.p_dec = sum(p.numel() for p in dec.layers.parameters())
            self.p_ckv = sum(p.numel() for lyr in dec.layers
                             for m in (lyr.encoder_attn.k_proj, lyr.encoder_attn.v_proj) for p in m.parameters())
            self.n_enc, self.n_dec, self.d = c.encoder_layers, c.decoder_layers, c.d_model
            self.mel, self.vocab, self.src = c.num_mel_bins, c.vocab_size, c.max_source_positions
        elif kind == "conformer":
            cc = model.cfg
            conv_ids = {id(p) for p in model.subsampling.conv.parameters()}
            self.p_enc = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in conv_ids)
            self.layers, self.d, self.ch, self.fdim = cc.num_layers, cc.d_model, cc.subsampling_channels, cc.input_dim
        else:
            raise ValueError(f"unknown workload {kind!r} (wav2vec2 | whisper | conformer)")

    def wav2vec2(self, batch: int, samples: int) -> float:
        """``batch`` utterances padded to ``samples`` audio samples."""
        n, cnn = samples, 0.0
        for i, (k, s) in enumerate(self.convs):
            n = (n - k) // s + 1
            cnn += 2.0 * n * k * self.dims[i] * self.dims[i + 1]
        cnn *= 3.0 if self.fe_trained else 1.0
        t = n
        return batch * (cnn + 6.0 * self.p_train * t + 12.0 * self.layers * self.d * t * t)

    def whisper(self, batch: int, dec_len: int) -> float:
        """``batch`` 30 s windows with decoder targets padded to ``dec_len`` tokens."""
        d, t, L = self.d, self.src, dec_len
        conv = 2 * (2.0 * 2 * t * self.mel * 3 * d) + 3 * (2.0 * t * d * 3 * d)  # conv1: fwd+wgrad, conv2: 3x
        enc = 6.0 * self.p_enc * t + 12.0 * self.n_enc * d * t * t
        dec = 6.0 * (self.p_dec - self.p_ckv) * L + 6.0 * self.p_ckv * t + 12.0 * self.n_dec * d * (L * L + L * t)
        head = 6.0 * self.vocab * d * L
        return batch * (conv + enc + dec + head)

    def conformer(self, batch: int, frames: int) -> float:
        """``batch`` utterances padded to ``frames`` fbank frames (before the 4x subsampling)."""
        t1 = (frames - 1) // 2
        f1 = (self.fdim - 1) // 2
        t2, f2 = (t1 - 1) // 2, (f1 - 1) // 2
        conv = 2 * 2.0 * t1 * f1 * 9 * self.ch + 3 * 2.0 * t2 * f2 * 9 * self.ch * self.ch
        return batch * (conv + 6.0 * self.p_enc * t2 + 12.0 * self.layers * self.d * t2 * t2)
