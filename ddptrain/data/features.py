"""Acoustic features: Kaldi-compatible fbank, plain and Whisper log-mel, normalisation, SpecAugment.

One module, :class:`BatchFeatureExtractor`, computes features for a *padded batch* of
waveforms. The DataLoader workers call it with a batch of one (``feature_device: worker``); with
``feature_device: gpu`` the batch carries raw audio and the user calls the same module on the
GPU inside the loss function. Same code on both paths means the two can only differ by float
rounding (tests/test_features.py checks they agree).

Why padding cannot leak into the features: frames use ``snip_edges`` framing (a frame is only
emitted if it fits entirely inside the utterance, as Kaldi does), each frame is processed on its
own (DC removal, pre-emphasis and windowing never look across frames), normalisation statistics
are taken over the valid frames only, and padded frames are zeroed. So an utterance gives the
same features alone or next to a longer one. The frame count is
``1 + (samples - window) // hop`` (0 when shorter than one window).

Conventions:
    * ``fbank`` scales the waveform to the 16-bit range first (Kaldi reads int16 samples), so
      log energies and the energy floor match Kaldi's and ``torchaudio.compliance.kaldi.fbank``.
    * ``logmel`` is ``log(max(mel_power, 1e-10))`` of the [-1, 1] waveform, window = FFT size.
    * normalisation ``utterance`` uses each utterance's own mean/std per mel bin; ``global``
      uses a stats file written by :func:`compute_global_stats`
      (``python -m ddptrain.data.features MANIFEST OUT.json``).
    * SpecAugment runs only in training mode, after normalisation, and masks with 0 (the
      normalised mean). In the workers the mode is the loader's (``train=``); on the device
      (``feature_device: gpu``) a loss function calls :meth:`BatchFeatureExtractor.for_model`,
      which follows the *model's* mode, so the one extractor of the training loader gives
      unmasked features whenever the model is evaluated (``Trainer.evaluate`` sets ``eval()``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch
import torchaudio
from torch import Tensor, nn

from ddptrain.config import check_section, cli_prog
from ddptrain.data.audio import load_audio
from ddptrain.data.config import DataConfig
from ddptrain.data.manifest import load_manifest, parse_field_args

FEATURE_KINDS = ("fbank", "logmel", "whisper_logmel")
WHISPER_WINDOW_S = 30  # Whisper encoders take 30 s windows: 3000 frames of 10 ms
_INT16_SCALE = 32768.0
_EPS = torch.finfo(torch.float32).eps


class BatchFeatureExtractor(nn.Module):
    """Padded audio batch -> padded, normalised (and in training, augmented) features.

    Args:
        cfg: the data config (``features``, ``sample_rate``, ``num_mel_bins``, frame sizes,
            ``normalize``/``global_stats``, SpecAugment fields, ``pad_to_multiple``).

    Call with ``audio`` (B, S) float and ``audio_lens`` (B,) int on any device, and optionally
    a CPU ``generator`` for SpecAugment (default: the global RNG); returns a dict
    with ``features`` (B, T, F) float32, ``feature_lens`` (B,) int64 and ``padding_mask``
    (B, T) bool (True = padding), T rounded up to ``cfg.pad_to_multiple``.

    ``whisper_logmel`` reproduces ``transformers.WhisperFeatureExtractor`` (``feature_size`` =
    ``num_mel_bins``, 128 for large-v3 and GLM-ASR, 80 before): each utterance is zero-padded to a
    30 s window, framed centred (reflect padding, 25 ms Hann window, 10 ms hop), slaney mel
    filters to 8 kHz, ``log10``, floored at the utterance's maximum - 8, then ``(x + 4) / 4``.
    Its padded frames are model input (the log-mel of silence the model was trained on), so
    they are not zeroed, and ``data.normalize`` must be ``none``. T is always 3000; the frames
    of the real audio (``feature_lens``) are ``ceil(samples / hop)``, as in the Hugging Face
    attention mask. Only the frames that see the (padded) batch's samples are computed: the
    rest are silence, one value per utterance, filled in. The first T' frames of a window are
    the same whatever is cut after them, so a model may be given ``features[:, :T']`` to skip
    trailing silence. Audio longer than the window is an error: split it into 30 s chunks first.

    Raises:
        ConfigError: a ``cfg`` value outside what ``load_config`` accepts (frames too short for
            the sample rate, ``whisper_logmel`` with a normalisation other than ``none``, ...).
        ValueError: ``features: raw`` (there is nothing to extract).
    """

    def __init__(self, cfg: DataConfig):
        super().__init__()
        cfg = check_section(cfg, "data")  # a DataConfig built in Python gets load_config's checks
        if cfg.features not in FEATURE_KINDS:
            raise ValueError(f"data.features={cfg.features!r}: feature extraction needs one of {FEATURE_KINDS}")
        self.kind = cfg.features
        self.sample_rate = cfg.sample_rate
        self.win = int(cfg.sample_rate * cfg.frame_length_ms / 1000)
        self.hop = int(cfg.sample_rate * cfg.frame_shift_ms / 1000)
        self.normalize = cfg.normalize
        self.pad_to_multiple = max(1, cfg.pad_to_multiple)
        self.spec_augment = cfg.spec_augment
        self.freq_masks, self.freq_mask_width = cfg.freq_masks, cfg.freq_mask_width
        self.time_masks, self.time_mask_ratio = cfg.time_masks, cfg.time_mask_ratio
        if self.kind == "whisper_logmel":
            self.n_fft = self.win
            self.window_samples = WHISPER_WINDOW_S * cfg.sample_rate
            banks = torchaudio.functional.melscale_fbanks(
                self.n_fft // 2 + 1, 0.0, min(8000.0, cfg.sample_rate / 2), cfg.num_mel_bins, cfg.sample_rate,
                norm="slaney", mel_scale="slaney")
            self.register_buffer("mel_banks", banks.T.float().contiguous(), persistent=False)  # (F, n_fft//2+1)
            self.register_buffer("window", torch.hann_window(self.win), persistent=False)
        elif self.kind == "fbank":
            n_fft = 1 << (self.win - 1).bit_length()  # Kaldi's round_to_power_of_two
            self.n_fft = n_fft
            banks, _ = torchaudio.compliance.kaldi.get_mel_banks(
                cfg.num_mel_bins, n_fft, float(cfg.sample_rate), 20.0, 0.0, 100.0, -500.0, 1.0)
            banks = nn.functional.pad(banks, (0, 1))  # Kaldi ignores the Nyquist bin
            window = torch.hann_window(self.win, periodic=False, dtype=torch.float64).pow(0.85)  # povey
            self.register_buffer("mel_banks", banks.T.float().contiguous(), persistent=False)
            self.register_buffer("window", window.float(), persistent=False)
        else:
            self.n_fft = self.win
            self.mel = torchaudio.transforms.MelSpectrogram(
                sample_rate=cfg.sample_rate, n_fft=self.win, win_length=self.win, hop_length=self.hop,
                n_mels=cfg.num_mel_bins, center=False, power=2.0)
        mean = torch.zeros(cfg.num_mel_bins)
        std = torch.ones(cfg.num_mel_bins)
        if cfg.normalize == "global":
            mean, std = load_global_stats(cfg.global_stats, cfg.num_mel_bins)
        self.register_buffer("global_mean", mean, persistent=False)
        self.register_buffer("global_std", std, persistent=False)

    def for_model(self, model: nn.Module, batch: dict) -> dict[str, Tensor]:
        """The ``feature_device: gpu`` path: features of ``batch["audio"]`` (with
        ``batch["audio_lens"]``) on the audio's device, SpecAugment only while ``model`` is
        training. Every recipe's loss calls this, so none can mask evaluation features (the bug
        of an extractor left in the training loader's mode).

        Returns:
            The dict of :meth:`forward`.
        """
        audio = batch["audio"]
        self.to(audio.device)
        return self._extract(audio, batch["audio_lens"], None, augment=model.training)

    def num_frames(self, num_samples: Tensor) -> Tensor:
        """Frames of an utterance of ``num_samples`` (snip-edges framing; 0 if too short)."""
        n = torch.as_tensor(num_samples)
        if self.kind == "whisper_logmel":  # centred frames: one per started hop
            return torch.div(n + self.hop - 1, self.hop, rounding_mode="floor")
        return torch.where(n >= self.win, 1 + torch.div(n - self.win, self.hop, rounding_mode="floor"),
                           torch.zeros_like(n))

    def forward(self, audio: Tensor, audio_lens: Tensor,
                generator: Optional[torch.Generator] = None) -> dict[str, Tensor]:
        return self._extract(audio, audio_lens, generator, augment=self.training)

    def _extract(self, audio: Tensor, audio_lens: Tensor, generator: Optional[torch.Generator],
                 augment: bool) -> dict[str, Tensor]:
        if self.kind == "whisper_logmel":
            return self._whisper(audio, audio_lens, augment)
        audio = audio.float()
        lens = self.num_frames(audio_lens.to(audio.device).long())
        t_max = int(lens.max()) if lens.numel() else 0
        t_pad = -(-t_max // self.pad_to_multiple) * self.pad_to_multiple
        # only the samples the longest utterance's frames need: trailing padding costs nothing
        need = (t_max - 1) * self.hop + self.win if t_max else 0
        audio = audio[:, :need]
        if t_max == 0:
            feats = audio.new_zeros(audio.shape[0], 0, self.global_mean.numel())
        elif self.kind == "fbank":
            feats = self._fbank(audio)
        else:
            feats = self.mel(audio).clamp_min(1e-10).log().transpose(1, 2)
        mask = torch.arange(t_pad, device=audio.device)[None, :] >= lens[:, None]  # True = padding
        feats = nn.functional.pad(feats, (0, 0, 0, t_pad - feats.shape[1]))
        feats = self._normalize(feats, lens, mask)
        if augment and self.spec_augment:
            feats = spec_augment(feats, lens, self.freq_masks, self.freq_mask_width,
                                 self.time_masks, self.time_mask_ratio, generator)
        feats = feats.masked_fill(mask[:, :, None], 0.0)
        return {"features": feats.contiguous(), "feature_lens": lens, "padding_mask": mask}

    def _fbank(self, audio: Tensor) -> Tensor:
        # Kaldi compute-fbank-feats (torchaudio.compliance.kaldi.fbank defaults), batched.
        frames = (audio * _INT16_SCALE).unfold(-1, self.win, self.hop)  # (B, M, win)
        frames = frames - frames.mean(dim=-1, keepdim=True)  # remove_dc_offset
        prev = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)  # replicate-padded shift
        frames = (frames - 0.97 * prev) * self.window  # pre-emphasis, povey window
        spec = torch.fft.rfft(frames, n=self.n_fft).abs().pow(2)  # (B, M, n_fft//2+1)
        return (spec @ self.mel_banks).clamp_min(_EPS).log()

    def _whisper(self, audio: Tensor, audio_lens: Tensor, augment: bool) -> dict[str, Tensor]:
        n = self.window_samples
        lens = audio_lens.to(audio.device).long()
        if audio.shape[1] > n:  # only then a look at the lengths (a host sync) is needed
            longest = int(lens.max())
            if longest > n:
                raise ValueError(f"whisper_logmel: an utterance of {longest / self.sample_rate:.2f}s is longer than "
                                 f"the {WHISPER_WINDOW_S} s window; split it into {WHISPER_WINDOW_S} s chunks first")
            audio = audio[:, :n]
        # Frames past the batch's samples (+ one FFT and one hop, so the end's reflect padding
        # mirrors zeros) are silence: log10 of the 1e-10 floor. Computing up to there gives the
        # whole window's values; the silence is filled in below.
        width = audio.shape[1] + self.n_fft + self.hop
        cut = n if width >= n else width
        frames_out = n // self.hop
        audio = nn.functional.pad(audio.float(), (0, cut - audio.shape[1]))
        audio = audio * (torch.arange(cut, device=audio.device)[None, :] < lens[:, None])  # silence after the end
        # fp32 throughout: called inside a bf16 autocast region on the GPU path, the mel product
        # would otherwise round the features the model was pretrained on
        with torch.autocast(audio.device.type, enabled=False):
            spec = torch.stft(audio, self.n_fft, self.hop, window=self.window, center=True, pad_mode="reflect",
                              return_complex=True)[..., :frames_out].abs().pow(2)  # (B, n_fft//2+1, <= 3000)
            logmel = (self.mel_banks @ spec).clamp_min(1e-10).log10()
            floor = logmel.amax(dim=(1, 2), keepdim=True) - 8.0
            logmel = torch.maximum(logmel, floor)
            if logmel.shape[2] < frames_out:
                silence = torch.maximum(floor, torch.full_like(floor, -10.0))
                logmel = torch.cat([logmel, silence.expand(-1, logmel.shape[1], frames_out - logmel.shape[2])], 2)
            feats = ((logmel + 4.0) / 4.0).transpose(1, 2)
        frames = self.num_frames(lens)
        mask = torch.arange(feats.shape[1], device=audio.device)[None, :] >= frames[:, None]
        if augment and self.spec_augment:
            feats = spec_augment(feats, frames, self.freq_masks, self.freq_mask_width,
                                 self.time_masks, self.time_mask_ratio)
        return {"features": feats.contiguous(), "feature_lens": frames, "padding_mask": mask}

    def _normalize(self, feats: Tensor, lens: Tensor, mask: Tensor) -> Tensor:
        if self.normalize == "none":
            return feats
        if self.normalize == "global":
            return (feats - self.global_mean) / self.global_std
        valid = (~mask).unsqueeze(-1).to(feats.dtype)
        n = lens.clamp_min(1).to(feats.dtype)[:, None, None]
        mean = (feats * valid).sum(1, keepdim=True) / n
        var = (((feats - mean) * valid) ** 2).sum(1, keepdim=True) / n
        return (feats - mean) / var.sqrt().clamp_min(1e-5)


def spec_augment(feats: Tensor, lens: Tensor, freq_masks: int, freq_mask_width: int,
                 time_masks: int, time_mask_ratio: float, generator: Optional[torch.Generator] = None) -> Tensor:
    """SpecAugment (Park et al. 2019) without time warping, vectorised over the batch.

    Each utterance gets its own masks; a time mask is at most ``time_mask_ratio`` of *that*
    utterance's length and lies inside its valid frames, so short utterances are not wiped out.
    Masked values are 0 (the mean after normalisation).
    """
    b, t, f = feats.shape
    dev = feats.device
    keep = torch.ones(b, t, f, dtype=torch.bool, device=dev)

    def rand(*shape):
        return torch.rand(*shape, generator=generator, device="cpu").to(dev)

    if freq_masks > 0 and freq_mask_width > 0:
        width = (rand(b, freq_masks) * (min(freq_mask_width, f) + 1)).floor()
        start = (rand(b, freq_masks) * (f - width + 1)).floor()
        bins = torch.arange(f, device=dev)[None, None, :]
        hit = (bins >= start[..., None]) & (bins < (start + width)[..., None])  # (B, n, F)
        keep &= ~hit.any(1)[:, None, :]
    if time_masks > 0 and time_mask_ratio > 0:
        max_w = (lens.to(dev).float() * time_mask_ratio).floor()[:, None]  # (B, 1)
        width = (rand(b, time_masks) * (max_w + 1)).floor()
        start = (rand(b, time_masks) * (lens.to(dev).float()[:, None] - width + 1).clamp_min(1)).floor()
        frames = torch.arange(t, device=dev)[None, None, :]
        hit = (frames >= start[..., None]) & (frames < (start + width)[..., None])  # (B, n, T)
        keep &= ~hit.any(1)[:, :, None]
    return feats * keep


def load_global_stats(path: str, num_bins: int) -> tuple[Tensor, Tensor]:
    """Read ``{"mean": [...], "std": [...]}`` (one value per mel bin).

    Raises:
        ValueError: no path, unreadable file, or lists of the wrong length.
    """
    if not path:
        raise ValueError("data.normalize=global needs data.global_stats (a JSON file from "
                         "`python -m ddptrain.data.features MANIFEST OUT.json`)")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        mean = torch.tensor(obj["mean"], dtype=torch.float32)
        std = torch.tensor(obj["std"], dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read global stats {path}: {e}") from None
    if mean.shape != (num_bins,) or std.shape != (num_bins,):
        raise ValueError(f"{path}: mean/std have {mean.numel()}/{std.numel()} values, expected {num_bins} "
                         f"(data.num_mel_bins)")
    return mean, std.clamp_min(1e-5)


def compute_global_stats(entries: Sequence, cfg: DataConfig, max_utterances: int = 0) -> dict:
    """Per-bin mean and std of un-normalised features over (a prefix of) a manifest.

    Args:
        entries: ``ManifestEntry`` list (see :func:`ddptrain.data.load_manifest`).
        cfg: data config; ``features``, ``sample_rate`` and frame settings are used.
        max_utterances: use only this many (evenly spaced) entries; 0 = all.

    Returns:
        ``{"mean": [...], "std": [...], "frames": N, "features": kind}``, ready for ``json.dump``.
    """
    from dataclasses import replace


    ext = BatchFeatureExtractor(replace(cfg, normalize="none", spec_augment=False, pad_to_multiple=1)).eval()
    if max_utterances and len(entries) > max_utterances:
        step = len(entries) / max_utterances
        entries = [entries[int(i * step)] for i in range(max_utterances)]
    total = torch.zeros(cfg.num_mel_bins, dtype=torch.float64)
    total_sq = torch.zeros_like(total)
    frames = 0
    with torch.no_grad():
        for e in entries:
            wave = load_audio(e.audio_filepath, cfg.sample_rate, e.offset, e.duration if e.is_segment else None)
            out = ext(wave[None], torch.tensor([wave.numel()]))
            x = out["features"][0, : int(out["feature_lens"][0])].double()
            total += x.sum(0)
            total_sq += (x * x).sum(0)
            frames += x.shape[0]
    if frames == 0:
        raise ValueError("no feature frames: are the utterances shorter than one frame?")
    mean = total / frames
    std = (total_sq / frames - mean * mean).clamp_min(0).sqrt()
    return {"mean": mean.tolist(), "std": std.tolist(), "frames": frames, "features": cfg.features}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ddptrain.data.features MANIFEST OUT.json``: write global normalisation stats."""
    p = argparse.ArgumentParser(prog=cli_prog("ddptrain.data.features"), description=main.__doc__)
    p.add_argument("manifest", help="manifest path(s), comma-separated")
    p.add_argument("output", help="JSON file to write (use it as data.global_stats)")
    p.add_argument("--features", default="fbank", choices=FEATURE_KINDS)
    p.add_argument("--sample-rate", type=int, default=16000)
    p.add_argument("--num-mel-bins", type=int, default=80)
    p.add_argument("--max-utterances", type=int, default=2000, help="0 = all")
    p.add_argument("--field", action="append", default=[], metavar="FIELD=KEY",
                   help="a manifest key of another name, as data.fields (e.g. audio=wav); repeatable")
    a = p.parse_args(argv)

    cfg = DataConfig(features=a.features, sample_rate=a.sample_rate, num_mel_bins=a.num_mel_bins)
    stats = compute_global_stats(load_manifest(a.manifest, parse_field_args(a.field)), cfg, a.max_utterances)
    with open(a.output, "w", encoding="utf-8") as f:
        json.dump(stats, f)
    print(f"wrote {a.output}: {stats['frames']} frames, {len(stats['mean'])} bins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
