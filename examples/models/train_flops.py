"""Analytic training FLOPs of one padded batch for the recipes' models: their ``flops_fn``.

``Trainer(flops_fn=...)`` calls ``of_batch(batch)`` on the host copy of every micro-batch, and
the training log shows ``tflops_per_gpu`` and ``mfu`` (ddptrain/throughput.py); the benchmarks
count the same FLOPs. MFU = model FLOPs / (time x GPUs x dense peak), with the FLOPs of the
*padded* batch actually computed and recomputation not counted.

Training FLOPs = forward + backward = 3x forward for trained weights. Linear layers: ``6 *
params * tokens``; attention (QK^T and AV): ``12 * layers * d * T^2`` per sequence (``6`` for a
causal decoder); convolutions counted exactly from their output lengths (a frozen front end:
forward only; a layer whose input needs no gradient: forward + weight gradient = 2x).
``bench/check_flops.py`` checks the wav2vec2 and Whisper formulas against torch's
FlopCounterMode on small models.

* :class:`Flops`: wav2vec2 and Whisper (examples/finetune_hf_model.py), Conformer-CTC
  (examples/finetune_asr.py);
* :class:`GlmAsrFlops`: GLM-ASR-Nano-2512 (examples/finetune_glmasr.py);
* :class:`VoxCpmFlops`: VoxCPM (examples/finetune_tts.py).
"""

from __future__ import annotations

from typing import Callable, Optional


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


class Flops:
    """Training FLOPs of one padded batch of wav2vec2, Whisper or the Conformer-CTC.

    Args:
        kind: ``wav2vec2`` | ``whisper`` | ``conformer``.
        model: the model (parameter counts and sizes are read from it; meta tensors are fine).
        token_multiple: Whisper: the loss pads the targets to a multiple of this
            (``hf.token_pad_multiple``), so the decoder runs on that length.
        frames_of: Conformer on audio batches (``data.feature_device: gpu``): the longest
            utterance's samples -> the padded feature frames the extractor makes of the batch.

    Raises:
        ValueError: for an unknown ``kind``.
    """

    def __init__(self, kind: str, model, token_multiple: int = 1, frames_of: Optional[Callable[[int], int]] = None):
        self.kind, self.token_multiple, self.frames_of = kind, max(1, token_multiple), frames_of
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
            self.p_enc = _count(enc.layers)
            self.p_dec = _count(dec.layers)
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

    def of_batch(self, batch: dict) -> float:
        """The FLOPs of a ddptrain.data batch (``audio`` (B, S), ``features`` (B, T, F), ``tokens`` (B, L))."""
        if self.kind == "wav2vec2":
            return self.wav2vec2(*batch["audio"].shape)
        if self.kind == "whisper":
            n, length = batch["tokens"].shape
            return self.whisper(n, -(-length // self.token_multiple) * self.token_multiple)
        if "features" in batch:
            return self.conformer(*batch["features"].shape[:2])
        return self.conformer(batch["audio"].shape[0], self.frames_of(int(batch["audio_lens"].max())))


class GlmAsrFlops:
    """Training FLOPs of one padded GLM-ASR batch: encoder on R chunk rows of T mel frames
    (conv front end, T/2 positions), projector on the embeddings that reach the LLM, the causal
    decoder on B x L positions, the LM head on the predicted positions. Plain numbers, picklable.

    Args:
        hf_model: ``transformers.GlmAsrForConditionalGeneration`` (the recipe's ``model.hf``).
    """

    def __init__(self, hf_model):
        m, c = hf_model.model, hf_model.config
        self.p_enc = _count(m.audio_tower.layers)
        self.p_dec = _count(m.language_model.layers)
        self.p_proj = _count(m.multi_modal_projector)
        self.n_enc, self.d_enc = c.audio_config.num_hidden_layers, c.audio_config.hidden_size
        self.n_dec, self.d_dec = c.text_config.num_hidden_layers, c.text_config.hidden_size
        self.mel, self.vocab = c.audio_config.num_mel_bins, c.text_config.vocab_size

    def __call__(self, rows: int, frames: int, batch: int, length: int, logits: int, projected: int) -> float:
        t2 = frames // 2
        enc = 6.0 * self.p_enc * rows * t2 + 12.0 * self.n_enc * self.d_enc * rows * t2 * t2
        conv = rows * (2.0 * 2 * frames * self.mel * 3 * self.d_enc + 3.0 * 2 * t2 * self.d_enc * 3 * self.d_enc)
        proj = 6.0 * self.p_proj * projected
        dec = 6.0 * self.p_dec * batch * length + 6.0 * self.n_dec * self.d_dec * batch * length * length
        return enc + conv + proj + dec + 6.0 * self.vocab * self.d_dec * logits

    def of_batch(self, batch: dict) -> float:
        """The FLOPs of a recipe batch (``GlmAsrCollator``'s keys; mel on the host or on the GPU)."""
        bsz, length = batch["input_ids"].shape
        if "features" in batch:
            rows, frames = batch["features"].shape[:2]
        else:
            rows, frames = batch["audio"].shape[0], int(batch["num_frames"])
        # the targets and audio embeddings that are not padding (glmasr.pad_indices): host tensors
        targets = int((batch["labels"] != -100).sum())  # -100: finetune_glmasr.IGNORE_INDEX, as its objective counts
        projected = int((batch["audio_dst"] < bsz * length).sum())
        return self(rows, frames, bsz, length, targets, projected)


class VoxCpmFlops:
    """Training FLOPs of one padded VoxCPM (or VoxCPM2) batch of B rows of S positions, patch P:
    base and residual LM ``6 * P_layers * B*S + 6 * n * d * B * S^2`` (causal), local encoder on
    B*S rows of P+1 tokens and local DiT on B*S rows of 2P+1 tokens (VoxCPM2: 2P+3, the base and
    the residual LM's outputs and the time step as three tokens) ``6 * P_layers * rows * L + 12 * n *
    d * rows * L^2``, the other weights ``6 * P * B*S``; ``d`` is the attention width (heads x
    head size: VoxCPM2's 1024-wide local layers attend 2048 wide). The VAE (the recipe encodes the
    latents once, beforehand) is not counted. With ``lora`` the weights are frozen: ``4 * P`` per
    token instead of ``6 * P`` (forward and input gradient, no weight gradient; the adapters' own
    FLOPs are left out).

    Args:
        model: the VoxCPM model without its VAE (examples/models/voxcpm_tts.py).
        layout: its config (``patch_size``).
        lora: the weights are a frozen base under adapters.
    """

    def __init__(self, model, layout, lora: bool = False):
        self.per_param = 4.0 if lora else 6.0
        lm, res = model.base_lm, model.residual_lm
        enc, dit = model.feat_encoder.encoder, model.feat_decoder.estimator.decoder
        width = lambda m: m.layers[0].self_attn.q_proj.out_features  # noqa: E731
        # the DiT's tokens before its 2P: VoxCPM2Model's the two LMs' outputs and the time apart, VoxCPM's all summed
        conditions = 3 if type(model).__name__ == "VoxCPM2Model" else 1
        self.parts = [(_count(lm.layers), len(lm.layers), width(lm), None),
                      (_count(res.layers), len(res.layers), width(res), None),
                      (_count(enc.layers), len(enc.layers), width(enc), layout.patch_size + 1),
                      (_count(dit.layers), len(dit.layers), width(dit), 2 * layout.patch_size + conditions)]
        big = sum(p for p, _, _, _ in self.parts) + lm.embed_tokens.weight.numel()
        self.other = _count(model) - big

    def __call__(self, b: int, s: int) -> float:
        w = self.per_param
        total = w * self.other * b * s
        for p, n, d, local in self.parts:
            if local is None:  # causal over the sequence
                total += w * p * b * s + 6.0 * n * d * b * s * s
            else:  # b*s rows of `local` tokens, full attention
                rows = b * s
                total += w * p * rows * local + 12.0 * n * d * rows * local * local
        return total

    def of_batch(self, batch: dict) -> float:
        """The FLOPs of a recipe batch (``TTSCollator``'s ``text_mask``: B x S)."""
        return self(*batch["text_mask"].shape)
