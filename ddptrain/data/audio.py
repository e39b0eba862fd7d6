"""Audio I/O: read with soundfile, mix to mono, resample with torchaudio, optional speed change.

Why soundfile and not ``torchaudio.load``: torchaudio 2.9+ moved decoding to TorchCodec (an
FFmpeg dependency); libsndfile is small, reads WAV/FLAC/OGG (and MP3 on libsndfile >= 1.1),
and can *seek*, so a 5 s segment of a one-hour recording costs a 5 s read, not a one-hour one.

Every failure is an :class:`AudioError` (a :class:`~ddptrain.data.errors.DataError`) whose
message names the file: the dataset adds the manifest line and utterance id on top.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import soundfile as sf
import torch
import torchaudio

from ddptrain.data.errors import DataError


class AudioError(DataError):
    """An audio file is missing, unreadable, corrupt, empty or shorter than asked for."""


@dataclass(frozen=True)
class AudioInfo:
    sample_rate: int
    frames: int
    channels: int

    @property
    def duration(self) -> float:
        return self.frames / self.sample_rate


def audio_info(path: str) -> AudioInfo:
    """Read the header only (cheap): sample rate, length in frames, channels.

    Raises:
        AudioError: missing file or a header libsndfile cannot parse.
    """
    if not os.path.isfile(path):
        raise AudioError(f"audio file not found: {path}")
    try:
        info = sf.info(path)
    except FileNotFoundError:
        raise AudioError(f"audio file not found: {path}") from None
    except (RuntimeError, OSError, ValueError, TypeError) as e:  # sf.LibsndfileError is a RuntimeError
        raise AudioError(f"cannot read audio header of {path}: {_short(e)}") from None
    return AudioInfo(int(info.samplerate), int(info.frames), int(info.channels))


def load_audio(
    path: str,
    sample_rate: Optional[int] = None,
    offset: float = 0.0,
    duration: Optional[float] = None,
    speed: float = 1.0,
) -> torch.Tensor:
    """Load a mono float32 waveform, optionally a slice of the file, resampled.

    Args:
        path: audio file.
        sample_rate: resample to this rate; ``None`` keeps the file's rate.
        offset: seconds to skip at the start (the file is seeked, not read and dropped).
        duration: seconds to read from ``offset``; ``None`` = to the end of the file.
        speed: speed-perturbation factor (Kaldi/sox ``speed``: 1.1 is 10% faster and shorter,
            with pitch shifted too). Folded into the resampling ratio, so it costs no extra pass.

    Returns:
        Tensor of shape ``(samples,)``, float32 in [-1, 1] for integer formats.

    Raises:
        AudioError: missing or corrupt file, an empty result, a slice past the end of the
            file, or non-finite samples (a float WAV full of NaN must not reach the model).
    """
    if not os.path.isfile(path):  # libsndfile would only say "System error"
        raise AudioError(f"audio file not found: {path}")
    try:
        with sf.SoundFile(path) as f:
            sr, total = f.samplerate, f.frames
            start = int(round(offset * sr))
            if start > 0 and start >= total:
                raise AudioError(f"offset {offset:.3f}s is past the end of {path} ({total / sr:.3f}s)")
            want = total - start if duration is None else int(round(duration * sr))
            if start:
                if f.seekable():
                    f.seek(start)
                else:  # e.g. some compressed streams: read and drop the head instead
                    f.read(start, dtype="float32", always_2d=True)
            data = f.read(want, dtype="float32", always_2d=True)
    except AudioError:
        raise
    except FileNotFoundError:
        raise AudioError(f"audio file not found: {path}") from None
    except (RuntimeError, OSError, ValueError, TypeError, sf.SoundFileError) as e:
        raise AudioError(f"cannot decode audio {path}: {_short(e)}") from None
    if data.shape[0] == 0:
        raise AudioError(f"zero-length audio: {path}" + (f" at offset {offset:.3f}s" if offset else ""))
    if duration is not None and data.shape[0] < want - max(1, sr // 100):
        # a segment that runs past the end of the file: the manifest is wrong, say so
        raise AudioError(
            f"{path} has only {(start + data.shape[0]) / sr:.3f}s but the manifest asks for "
            f"{offset:.3f}s + {duration:.3f}s"
        )
    if not np.isfinite(data).all():
        raise AudioError(f"non-finite (NaN/inf) samples in {path}")
    wave = torch.from_numpy(data.mean(axis=1) if data.shape[1] > 1 else data[:, 0])
    return resample(wave, sr, sample_rate or sr, speed)


def resample(wave: torch.Tensor, orig_rate: int, new_rate: int, speed: float = 1.0) -> torch.Tensor:
    """Resample ``wave`` (..., samples) from ``orig_rate`` to ``new_rate``, changing speed too.

    Speed ``f`` is the same as pretending the audio was recorded at ``orig_rate * f``; both
    rates are integers, so the ratio is exact for factors like 0.9 and 1.1.
    """
    src = int(round(orig_rate * speed))
    if src == new_rate:
        return wave
    return _resampler(src, new_rate)(wave)


@functools.lru_cache(maxsize=32)
def _resampler(orig: int, new: int) -> torchaudio.transforms.Resample:
    # the sinc kernel only depends on the two rates: build it once per worker, not per file
    return torchaudio.transforms.Resample(orig, new)


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
