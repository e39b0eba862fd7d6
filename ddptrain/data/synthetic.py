"""A small synthetic speech-like corpus on disk, for tests, benchmarks and smoke runs.

Nothing downloads at run time, so code that needs "some audio and a manifest" makes it here:
harmonic tones with a moving pitch, syllable-rate amplitude modulation and a little noise, so
features have structure, and transcripts whose length grows with duration (about 10 characters
per second, which a 25 frames/s CTC model can emit).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np

_WORDS = ("the", "a", "speech", "model", "data", "train", "sound", "quick", "brown", "fox", "jumps",
          "over", "lazy", "dog", "hello", "world", "seven", "blue", "river", "light")


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
