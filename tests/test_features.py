"""Features: Kaldi compatibility, padding invariance (worker vs. GPU batch path), normalisation,
SpecAugment."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torchaudio

from ddptrain.data import BatchFeatureExtractor, DataConfig, compute_global_stats, load_manifest, spec_augment
from ddptrain.data.features import main as features_main
from ddptrain.data.synthetic import synth_waveform, write_synthetic_corpus


def waves(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(synth_waveform(n / 16000, 16000, rng)[:, 0]) for n in lengths]


def pad(ws):
    lens = torch.tensor([w.numel() for w in ws])
    out = torch.zeros(len(ws), int(lens.max()) + 123)  # extra trailing padding must not matter
    for row, w in zip(out, ws):
        row[: w.numel()] = w
    return out, lens


@pytest.mark.parametrize("n", [400, 401, 16000, 23456])
def test_fbank_matches_kaldi_compliance_fbank(n):
    cfg = DataConfig(features="fbank", normalize="none", num_mel_bins=80)
    (w,) = waves([n])
    ours = BatchFeatureExtractor(cfg).eval()(w[None], torch.tensor([n]))
    ref = torchaudio.compliance.kaldi.fbank(w[None] * 32768, num_mel_bins=80, sample_frequency=16000)
    assert int(ours["feature_lens"][0]) == ref.shape[0] == 1 + (n - 400) // 160
    torch.testing.assert_close(ours["features"][0, : ref.shape[0]], ref, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("kind", ["fbank", "logmel"])
@pytest.mark.parametrize("norm", ["utterance", "none"])
def test_batch_path_equals_one_utterance_at_a_time(kind, norm):
    cfg = DataConfig(features=kind, normalize=norm, num_mel_bins=40)
    ext = BatchFeatureExtractor(cfg).eval()
    ws = waves([16000, 5000, 23999, 401])
    batch = ext(*pad(ws))
    t = batch["features"].shape[1]
    assert t % 8 == 0 and t >= int(batch["feature_lens"].max())
    for i, w in enumerate(ws):
        single = ext(w[None], torch.tensor([w.numel()]))
        n = int(single["feature_lens"][0])
        assert int(batch["feature_lens"][i]) == n
        torch.testing.assert_close(batch["features"][i, :n], single["features"][0, :n], atol=1e-4, rtol=1e-4)
        assert not batch["padding_mask"][i, :n].any() and batch["padding_mask"][i, n:].all()
        assert (batch["features"][i, n:] == 0).all()


def test_utterance_normalisation_uses_valid_frames_only():
    ext = BatchFeatureExtractor(DataConfig(normalize="utterance", num_mel_bins=40)).eval()
    out = ext(*pad(waves([16000, 6000])))
    for i in range(2):
        x = out["features"][i, : int(out["feature_lens"][i])]
        torch.testing.assert_close(x.mean(0), torch.zeros(40), atol=1e-4, rtol=0)
        torch.testing.assert_close(x.std(0, unbiased=False), torch.ones(40), atol=1e-3, rtol=0)


def test_global_stats_file_round_trip(tmp_path):
    m = write_synthetic_corpus(str(tmp_path / "c"), [0.5, 0.8, 1.1])
    cfg = DataConfig(num_mel_bins=40)
    stats = compute_global_stats(load_manifest(m), cfg)
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats))
    ext = BatchFeatureExtractor(replace(cfg, normalize="global", global_stats=str(path))).eval()
    feats = [ext(w[None], torch.tensor([w.numel()])) for w in
             [torch.from_numpy(__import__("soundfile").read(e.audio_filepath, dtype="float32")[0])
              for e in load_manifest(m)]]
    allx = torch.cat([f["features"][0, : int(f["feature_lens"][0])] for f in feats])
    torch.testing.assert_close(allx.mean(0), torch.zeros(40), atol=1e-3, rtol=0)
    torch.testing.assert_close(allx.std(0, unbiased=False), torch.ones(40), atol=1e-2, rtol=0)
    assert features_main([m, str(tmp_path / "cli.json"), "--num-mel-bins", "40"]) == 0
    assert len(json.loads((tmp_path / "cli.json").read_text())["mean"]) == 40
    with pytest.raises(ValueError, match="expected 80"):
        BatchFeatureExtractor(DataConfig(normalize="global", global_stats=str(path)))
    with pytest.raises(ValueError, match="needs data.global_stats"):
        BatchFeatureExtractor(DataConfig(normalize="global"))


def test_spec_augment_only_in_training_and_only_inside_each_utterance():
    cfg = DataConfig(spec_augment=True, freq_masks=2, freq_mask_width=10, time_masks=3, time_mask_ratio=0.1,
                     num_mel_bins=40)
    ext = BatchFeatureExtractor(cfg)
    x, lens = pad(waves([32000, 8000]))
    clean = ext.eval()(x, lens)["features"]
    torch.manual_seed(0)
    aug = ext.train()(x, lens)
    assert not torch.equal(aug["features"], clean)
    masked = (aug["features"] == 0) & (clean != 0)
    for i in range(2):
        n = int(aug["feature_lens"][i])
        # masked time spans lie inside the utterance and are at most 10% of it, per mask
        rows = masked[i, :, :].all(1).nonzero().flatten()
        assert rows.numel() <= 3 * int(0.1 * n) + 1 and (rows < n).all()
        # frequency masks: at most 2 x 10 bins, whole columns over the valid frames
        cols = masked[i, :n].all(0).nonzero().flatten()
        assert cols.numel() <= 20
    g = torch.Generator().manual_seed(1)
    f = torch.randn(3, 50, 40)
    for _ in range(20):
        out = spec_augment(f, torch.tensor([50, 20, 1]), 0, 0, 2, 0.2, generator=g)
        assert torch.equal(out[1, 20:], f[1, 20:])  # time masks stay inside the utterance
        assert torch.equal(out[2], f[2])  # 20% of one frame rounds down to no mask


@pytest.mark.parametrize("kind", ["fbank", "whisper_logmel"])
def test_for_model_masks_only_while_the_model_trains_whatever_the_extractors_mode(kind):
    """The feature_device: gpu path: the training loader's extractor (in training mode) gives the
    evaluation model unmasked features; the extractor's own mode is left as it was."""
    extra = dict(normalize="none", num_mel_bins=128) if kind == "whisper_logmel" else {}
    cfg = DataConfig(features=kind, spec_augment=True, time_mask_ratio=0.5, freq_mask_width=40, **extra)
    audio, lens = pad(waves([16000, 12000]))
    batch = {"audio": audio, "audio_lens": lens}
    ext = BatchFeatureExtractor(cfg).train()
    plain = BatchFeatureExtractor(cfg).eval()(audio, lens)["features"]
    model = torch.nn.Linear(1, 1)
    torch.testing.assert_close(ext.for_model(model.eval(), batch)["features"], plain)
    assert ext.training
    torch.manual_seed(0)
    assert not torch.equal(ext.for_model(model.train(), batch)["features"], plain)
    eval_ext = BatchFeatureExtractor(cfg).eval()  # an evaluation loader's, with a training model: masked
    assert not torch.equal(eval_ext.for_model(model, batch)["features"], plain) and not eval_ext.training


def test_too_short_audio_has_zero_frames_and_empty_batches_work():
    ext = BatchFeatureExtractor(DataConfig()).eval()
    out = ext(torch.zeros(2, 399), torch.tensor([399, 100]))
    assert out["feature_lens"].tolist() == [0, 0] and out["features"].shape == (2, 0, 80)
    out = ext(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long))
    assert out["features"].shape == (0, 0, 80)
