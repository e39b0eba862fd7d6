"""The synthetic speech corpus for tests, benchmarks and smoke runs: in memory, or written to disk.

Nothing downloads at run time, so code that needs "some speech" makes it here, in one of two ways:

* :class:`SyntheticCorpus` + :class:`SyntheticSpeech`: utterances held in memory (lognormal
  durations, transcripts whose length follows them), made per index from noise. Nothing is read
  or decoded, so a benchmark times the model, not the disk; every recipe's random-init mode and
  every model benchmark draws its data from here, each passing the shape it needs.
* :func:`write_synthetic_corpus`: audio files and a manifest on disk, for code that reads
  manifests: harmonic tones with a moving pitch, syllable-rate amplitude modulation and a little
  noise, so features have structure, and transcripts whose length grows with duration (about 10
  characters per second, which a 25 frames/s CTC model can emit).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

_WORDS = ("the", "a", "speech", "model", "data", "train", "sound", "quick", "brown", "fox", "jumps",
          "over", "lazy", "dog", "hello", "world", "seven", "blue", "river", "light")


@dataclass(frozen=True)
class SyntheticCorpus:
    """The shape of an in-memory corpus: how many utterances, how long, how many transcript ids.

    Durations are lognormal around ``median_s`` (shape ``sigma``; 0 = all ``median_s``), clipped to
    ``[min_s, max_s]`` and rounded to 1 ms. Transcripts have ``tokens_per_s`` ids per second of
    audio, each utterance's count scaled by a uniform ``1 +- token_jitter`` and rounded; or, with
    ``median_tokens`` > 0, lognormal lengths of their own (shape ``token_sigma``, drawn from a
    generator of ``seed + 1`` and rounded down), as a 30 s window holds any amount of speech.
    Counts are at least ``min_tokens`` and (``max_tokens`` > 0) at most ``max_tokens``.
    """

    utterances: int = 2000
    median_s: float = 7.0
    sigma: float = 0.5
    min_s: float = 1.0
    max_s: float = 30.0
    tokens_per_s: float = 3.0
    token_jitter: float = 0.0
    median_tokens: float = 0.0
    token_sigma: float = 0.6
    min_tokens: int = 1
    max_tokens: int = 0

    def lengths(self, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(durations in s, transcript ids per utterance)``; the same seed gives the same corpus."""
        rng = np.random.default_rng(seed)
        d = rng.lognormal(math.log(self.median_s), self.sigma, self.utterances)
        d = np.clip(d, self.min_s, self.max_s).round(3)
        if self.median_tokens > 0:  # independent of the durations: their own generator
            n = np.floor(np.random.default_rng(seed + 1).lognormal(math.log(self.median_tokens), self.token_sigma,
                                                                   self.utterances))
        else:
            scale = rng.uniform(1 - self.token_jitter, 1 + self.token_jitter, d.size) if self.token_jitter else 1.0
            n = np.round(d * self.tokens_per_s * scale)
        n = np.maximum(self.min_tokens, n)
        return d, (np.minimum(n, self.max_tokens) if self.max_tokens > 0 else n).astype(np.int64)

    def dataset(self, seed: int, token_ids: tuple[int, int], **kw) -> "SyntheticSpeech":
        """The corpus of ``seed`` as a :class:`SyntheticSpeech` (``kw``: its other arguments)."""
        return SyntheticSpeech(*self.lengths(seed), token_ids, **kw)


class SyntheticSpeech(Dataset):
    """Utterances of noise with random transcript ids, shaped like ``ddptrain.data``'s examples.

    Item ``i`` is ``{"id", "text": "", "audio" or "features", "tokens"}``, made from a generator
    seeded by ``i`` alone, so every loader worker, rank and run makes the same example. ``tokens``
    are ``prefix`` + ``num_tokens[i]`` ids drawn from ``[low, high)`` + ``suffix``; they are drawn
    first, so :meth:`tokens` gives them without making the audio.

    Args:
        durations: seconds per utterance.
        num_tokens: random transcript ids per utterance (``prefix`` and ``suffix`` come on top).
        token_ids: ``(low, high)``: the ids are drawn from ``[low, high)``.
        sample_rate: audio samples per second (``audio``: float32, 0.1 x standard normal).
        num_mel_bins: > 0: ``features`` of ``(frames, num_mel_bins)`` instead of audio.
        frame_rate: feature frames per second of duration.
        frames: > 0: every utterance has this many feature frames (Whisper's 3000-frame windows).
        prefix: fixed ids before the random ones (a task prefix).
        suffix: fixed ids after them (an end-of-sequence id).
    """

    def __init__(self, durations, num_tokens, token_ids: tuple[int, int], sample_rate: int = 16000,
                 num_mel_bins: int = 0, frame_rate: float = 100.0, frames: int = 0,
                 prefix: Sequence[int] = (), suffix: Sequence[int] = ()):
        self.durations = np.asarray(durations, dtype=np.float64)
        self.num_tokens = np.asarray(num_tokens, dtype=np.int64)
        if len(self.durations) != len(self.num_tokens):
            raise ValueError(f"{len(self.durations)} durations but {len(self.num_tokens)} token counts")
        self.low, self.high = map(int, token_ids)
        if not self.low < self.high:
            raise ValueError(f"token_ids={token_ids}: expected (low, high) with low < high")
        self.sample_rate, self.num_mel_bins, self.frame_rate, self.frames = sample_rate, num_mel_bins, frame_rate, frames
        self.prefix = torch.tensor(list(prefix), dtype=torch.long)
        self.suffix = torch.tensor(list(suffix), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.durations)

    def _tokens(self, i: int, g: torch.Generator) -> torch.Tensor:
        ids = torch.randint(self.low, self.high, (int(self.num_tokens[i]),), generator=g)
        return torch.cat([self.prefix, ids, self.suffix])

    def tokens(self, i: int) -> torch.Tensor:
        """Item ``i``'s ``tokens`` alone."""
        return self._tokens(i, torch.Generator().manual_seed(int(i)))

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(int(i))
        out = {"id": str(i), "text": "", "tokens": self._tokens(i, g)}
        d = float(self.durations[i])
        if self.num_mel_bins:
            out["features"] = torch.randn(self.frames or int(d * self.frame_rate), self.num_mel_bins, generator=g)
        else:
            out["audio"] = 0.1 * torch.randn(int(d * self.sample_rate), generator=g)
        return out


def synth_waveform(duration: float, sample_rate: int, rng: np.random.Generator, channels: int = 1) -> np.ndarray:
    """(samples, channels) float32 in [-1, 1]."""
    n = max(1, int(round(duration * sample_rate)))
    t = np.arange(n) / sample_rate
    f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.2, 1.0) * t))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    x = sum(np.sin(k * phase) / k for k in range(1, 6))
    x = x * (0.55 + 0.45 * np.sin(2 * np.pi * rng.uniform(3, 5) * t))  # syllable-rate envelope
    x = 0.25 * x / np.abs(x).max() + 0.01 * rng.standard_normal(n)
    out = np.repeat(x[:, None], channels, axis=1) * np.linspace(1.0, 0.8, channels)[None, :]
    return out.astype(np.float32)


def synth_text(duration: float, rng: np.random.Generator, chars_per_second: float = 10.0) -> str:
    words: list[str] = []
    while len(" ".join(words)) < max(1.0, duration * chars_per_second * 0.8):
        words.append(_WORDS[int(rng.integers(len(_WORDS)))])
    return " ".join(words)


def write_synthetic_corpus(
    folder: str,
    durations: Sequence[float],
    sample_rate: int = 16000,
    fmt: str = "flac",
    seed: int = 0,
    channels: int = 1,
    texts: Optional[Sequence[str]] = None,
    manifest_name: str = "manifest.jsonl",
) -> str:
    """Write one audio file per duration and a manifest with relative paths.

    Args:
        folder: created if needed; audio goes to ``folder/audio/``.
        durations: seconds per utterance.
        sample_rate: file sample rate.
        fmt: ``flac`` or ``wav`` (16-bit PCM).
        seed: RNG seed (the same seed writes the same corpus).
        channels: channels per file.
        texts: transcripts; default: random words, ~10 characters per second.
        manifest_name: manifest file name inside ``folder``.

    Returns:
        The manifest path.
    """
    import soundfile as sf  # here, so the waveform helpers work where soundfile is not installed

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "audio"), exist_ok=True)
    manifest = os.path.join(folder, manifest_name)
    with open(manifest, "w", encoding="utf-8") as f:
        for i, d in enumerate(durations):
            rel = os.path.join("audio", f"utt{i:06d}.{fmt}")
            wave = synth_waveform(float(d), sample_rate, rng, channels)
            sf.write(os.path.join(folder, rel), wave, sample_rate, subtype="PCM_16")
            text = texts[i] if texts is not None else synth_text(float(d), rng)
            f.write(json.dumps({"audio_filepath": rel, "duration": round(wave.shape[0] / sample_rate, 6),
                                "text": text}) + "\n")
    return manifest
