"""features: whisper_logmel against transformers' WhisperFeatureExtractor (the GLM-ASR / Whisper
front end), on the CPU batch path, the one-utterance worker path and cut windows.

transformers is a dev dependency (setup.py's ``dev`` extra), so these run in CI.
"""

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from ddptrain.data import BatchFeatureExtractor, DataConfig
from ddptrain.data.synthetic import synth_waveform

SR = 16000


def waves(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(synth_waveform(n / SR, SR, rng)[:, 0]).float() for n in lengths]


def pad(ws, extra=37):
    lens = torch.tensor([w.numel() for w in ws])
    out = torch.zeros(len(ws), int(lens.max()) + extra)
    for row, w in zip(out, ws):
        row[: w.numel()] = w
    return out, lens


def reference(ws, bins):
    fe = WhisperFeatureExtractor(feature_size=bins, sampling_rate=SR)
    out = fe([w.numpy() for w in ws], sampling_rate=SR, return_tensors="pt", return_attention_mask=True)
    return out["input_features"].transpose(1, 2), out["attention_mask"].sum(-1)


@pytest.mark.parametrize("bins", [128, 80])
def test_whisper_logmel_matches_transformers(bins):
    # lengths: under one frame, not a multiple of the hop, 1 s, a full 30 s window
    ws = waves([100, 12345, SR, 30 * SR], seed=bins)
    ref, ref_lens = reference(ws, bins)
    ext = BatchFeatureExtractor(DataConfig(features="whisper_logmel", num_mel_bins=bins, normalize="none")).eval()
    out = ext(*pad(ws, extra=0))
    assert out["features"].shape == ref.shape == (4, 3000, bins)
    torch.testing.assert_close(out["features"], ref, atol=2e-4, rtol=1e-4)
    assert out["feature_lens"].tolist() == ref_lens.tolist()
    assert out["padding_mask"].sum(1).tolist() == (3000 - ref_lens).tolist()
    for i, w in enumerate(ws):  # one utterance at a time (the worker path) gives the same
        single = ext(w[None], torch.tensor([w.numel()]))
        torch.testing.assert_close(single["features"][0], ref[i], atol=2e-4, rtol=1e-4)


def test_whisper_logmel_ignores_trailing_padding_and_samples_past_the_length():
    ext = BatchFeatureExtractor(DataConfig(features="whisper_logmel", num_mel_bins=128, normalize="none")).eval()
    ws = waves([7000, 20000])
    audio, lens = pad(ws, extra=500)
    audio[0, 7000:] = 1.0  # garbage after the length must be treated as silence
    out = ext(audio, lens)
    ref, _ = reference(ws, 128)
    torch.testing.assert_close(out["features"], ref, atol=2e-4, rtol=1e-4)


def test_whisper_logmel_under_bf16_autocast_stays_fp32():
    ext = BatchFeatureExtractor(DataConfig(features="whisper_logmel", num_mel_bins=128, normalize="none")).eval()
    ws = waves([16000])
    plain = ext(*pad(ws))["features"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = ext(*pad(ws))["features"]
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, plain)


def test_whisper_logmel_refuses_long_audio_and_normalisation():
    ext = BatchFeatureExtractor(DataConfig(features="whisper_logmel", normalize="none"))
    with pytest.raises(ValueError, match="longer than the 30 s window"):
        ext(torch.zeros(1, 30 * SR + 1), torch.tensor([30 * SR + 1]))
    with pytest.raises(ValueError, match="data.normalize=none"):
        BatchFeatureExtractor(DataConfig(features="whisper_logmel", normalize="utterance"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU path: needs CUDA")
def test_whisper_logmel_gpu_equals_cpu():
    ext = BatchFeatureExtractor(DataConfig(features="whisper_logmel", num_mel_bins=128, normalize="none")).eval()
    audio, lens = pad(waves([16000, 50000]))
    cpu = ext(audio, lens)["features"]
    gpu = ext.cuda()(audio.cuda(), lens.cuda())["features"].cpu()
    torch.testing.assert_close(gpu, cpu, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["worker", "gpu"])
def test_whisper_logmel_through_build_dataloader(tmp_path, device):
    """Both loader paths give the transformers features of each file's audio: the worker path
    keeps each utterance's whole window, the GPU path runs the loader's extractor on the batch."""
    from ddptrain.data import build_dataloader, load_audio, load_manifest, write_synthetic_corpus

    manifest = write_synthetic_corpus(str(tmp_path), [1.3, 2.1, 0.7], seed=3)
    cfg = DataConfig(features="whisper_logmel", num_mel_bins=128, normalize="none", feature_device=device,
                     num_workers=0, max_duration=100, num_buckets=1, validate=False)
    loader = build_dataloader(manifest, cfg, None, train=False, world_size=1, rank=0)
    (batch,) = list(loader)
    ids = batch["ids"]
    if device == "gpu":  # the same module the recipe runs on the device, here on the CPU
        batch = loader.feature_extractor(batch["audio"], batch["audio_lens"])
    by_id = {e.id: e for e in load_manifest(manifest)}
    ref, _ = reference([load_audio(by_id[i].audio_filepath, SR) for i in ids], 128)
    torch.testing.assert_close(batch["features"], ref, atol=2e-4, rtol=1e-4)
