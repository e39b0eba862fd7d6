"""Audio I/O on real files: formats and rates, mono-mix, resampling, slices, speed, failures."""

import numpy as np
import pytest
import soundfile as sf
import torch

from ddptrain.data import AudioError, DataError, audio_info, load_audio


def tone(freq, seconds, rate, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    x = 0.5 * np.sin(2 * np.pi * freq * t).astype(np.float32)
    return np.stack([x * (1 - 0.5 * c) for c in range(channels)], axis=1)


def peak_hz(wave, rate):
    spec = np.abs(np.fft.rfft(wave.numpy() * np.hanning(wave.numel())))
    return np.argmax(spec) * rate / wave.numel()


@pytest.mark.parametrize("fmt, subtype", [("wav", "PCM_16"), ("flac", "PCM_16"), ("wav", "FLOAT")])
@pytest.mark.parametrize("rate", [8000, 16000, 44100])
def test_round_trip_and_resample_to_16k(tmp_path, fmt, subtype, rate):
    path = str(tmp_path / f"x.{fmt}")
    sf.write(path, tone(440.0, 1.25, rate), rate, subtype=subtype)
    info = audio_info(path)
    assert (info.sample_rate, info.frames, info.channels) == (rate, int(1.25 * rate), 1)
    native = load_audio(path)
    assert native.dtype == torch.float32 and native.shape == (int(1.25 * rate),)
    assert np.allclose(native.numpy(), tone(440.0, 1.25, rate)[:, 0], atol=1e-4)
    wave = load_audio(path, 16000)
    assert wave.shape == (20000,)  # 1.25 s at 16 kHz, whatever the file's rate
    assert abs(peak_hz(wave, 16000) - 440.0) < 2.0  # the content survives resampling
    assert 0.45 < wave.abs().max() < 0.55


def test_stereo_is_mixed_to_mono(tmp_path):
    path = str(tmp_path / "s.flac")
    sf.write(path, tone(300.0, 0.5, 16000, channels=2), 16000)
    wave = load_audio(path, 16000)
    assert wave.ndim == 1
    assert np.allclose(wave.numpy(), 0.75 * tone(300.0, 0.5, 16000)[:, 0], atol=1e-4)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_offset_and_duration_slice_matches_slicing_the_whole_file(tmp_path, fmt):
    path = str(tmp_path / f"long.{fmt}")
    rng = np.random.default_rng(0)
    sf.write(path, (0.3 * rng.standard_normal((48000, 1))).astype(np.float32), 16000, subtype="PCM_16")
    full = load_audio(path)
    part = load_audio(path, offset=1.0, duration=0.5)
    assert torch.equal(part, full[16000:24000])
    assert torch.equal(load_audio(path, offset=2.5), full[40000:])


def test_speed_perturbation_changes_length_not_content_rate(tmp_path):
    path = str(tmp_path / "t.wav")
    sf.write(path, tone(500.0, 1.0, 16000), 16000)
    fast = load_audio(path, 16000, speed=1.1)
    slow = load_audio(path, 16000, speed=0.9)
    assert abs(fast.numel() - 16000 / 1.1) <= 2 and abs(slow.numel() - 16000 / 0.9) <= 2
    assert abs(peak_hz(fast, 16000) - 550.0) < 5  # sox "speed": pitch moves with tempo
    # speed and resampling in one pass: 44.1 kHz file, 16 kHz out, 0.9x speed
    path2 = str(tmp_path / "t44.wav")
    sf.write(path2, tone(500.0, 1.0, 44100), 44100)
    assert abs(load_audio(path2, 16000, speed=0.9).numel() - 16000 / 0.9) <= 2


def test_failures_are_named_audio_errors(tmp_path):
    with pytest.raises(AudioError, match="not found: .*missing.wav"):
        load_audio(str(tmp_path / "missing.wav"))
    (tmp_path / "junk.wav").write_bytes(b"RIFF....WAVEfmt garbage" * 10)
    with pytest.raises(AudioError, match="junk.wav"):
        load_audio(str(tmp_path / "junk.wav"))
    with pytest.raises(AudioError, match="junk.wav"):
        audio_info(str(tmp_path / "junk.wav"))
    empty = str(tmp_path / "empty.wav")
    sf.write(empty, np.zeros((0, 1), np.float32), 16000)
    with pytest.raises(AudioError, match="zero-length audio"):
        load_audio(empty)
    short = str(tmp_path / "short.wav")
    sf.write(short, tone(200, 1.0, 16000), 16000)
    with pytest.raises(AudioError, match="past the end"):
        load_audio(short, offset=1.5)
    with pytest.raises(AudioError, match="has only 1.000s but the manifest asks for 0.500s \\+ 1.000s"):
        load_audio(short, offset=0.5, duration=1.0)
    nan = str(tmp_path / "nan.wav")
    x = tone(200, 0.2, 16000)
    x[100] = np.nan
    sf.write(nan, x, 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="non-finite"):
        load_audio(nan)
    assert issubclass(AudioError, DataError) and issubclass(DataError, ValueError)


def test_truncated_flac_is_an_error_not_a_short_or_silent_tensor(tmp_path):
    path = str(tmp_path / "cut.flac")
    rng = np.random.default_rng(1)
    sf.write(path, (0.3 * rng.standard_normal((32000, 1))).astype(np.float32), 16000)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    assert audio_info(path).frames == 32000  # the header still promises the whole file ...
    with pytest.raises(AudioError, match="cannot decode audio .*cut.flac"):
        load_audio(path)  # ... so only decoding finds the damage
