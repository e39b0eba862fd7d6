"""examples/finetune_hf_model.py: Whisper on manifests (Whisper log-mel, the checkpoint's
tokenizer) trains and is evaluated by greedy decoding, WER/CER summed as error counts.

A tiny random Whisper and a byte-level BPE tokenizer with Whisper's special tokens are saved to a
folder and loaded back offline. transformers is a dev dependency (setup.py), so this runs in CI.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_hf_model as fhm  # noqa: E402
from transformers import PreTrainedTokenizerFast, WhisperConfig, WhisperForConditionalGeneration  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain import metrics  # noqa: E402
from ddptrain.data import write_synthetic_corpus  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]


def whisper_folder(root, texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    cfg = WhisperConfig(vocab_size=len(fast), num_mel_bins=128, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=1500, max_target_positions=64, pad_token_id=ids["<|endoftext|>"],
                        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
                        decoder_start_token_id=ids["<|startoftranscript|>"], use_cache=False)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(cfg).save_pretrained(root)
    fast.save_pretrained(root)
    return str(root)


@pytest.mark.timeout(300)
def test_whisper_on_manifests_learns_and_reports_wer_from_greedy_decoding(tmp_path):
    manifest = write_synthetic_corpus(str(tmp_path / "data"), [1.0, 1.4, 0.8, 1.2], seed=4)
    texts = [json.loads(line)["text"] for line in open(manifest)]
    folder = whisper_folder(tmp_path / "model", texts)
    argv = [f"hf.model=whisper", f"hf.path={folder}", f"data.train_manifest={manifest}",
            f"data.eval_manifest={manifest}", "data.features=whisper_logmel", "data.num_mel_bins=128",
            "data.normalize=none", "data.max_duration=60", "data.max_batch_size=2", "data.num_buckets=1",
            "data.num_workers=0", "trainer.precision=fp32", "trainer.device=cpu", f"trainer.output_dir={tmp_path}/run",
            "trainer.max_steps=16", "optim.lr=3e-3", "scheduler.warmup_steps=0", "scheduler.name=constant",
            "logging.tensorboard=false", "logging.progress_bar=false", "logging.log_every=1", "hf.max_new_tokens=16"]
    result = fhm.main(argv)
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "train"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert set(result) >= {"loss", "wer", "cer"}

    # the reported WER/CER are the error counts of the greedy transcripts, recomputed here
    cfg = ddptrain.load_config(None, argv, schema=fhm.FinetuneConfig)
    _, evals, targets = fhm.whisper_manifest_data(cfg, cfg.hf)
    model = WhisperForConditionalGeneration.from_pretrained(folder, local_files_only=True)
    ddptrain.load_weights(model, str(tmp_path / "run"))
    greedy = fhm.WhisperGreedy(targets, fhm.Seq2SeqLoss(model.config), 16)
    hyps, refs = [], []
    with torch.no_grad():
        for batch in evals:
            hyps += greedy.transcripts(model.eval(), batch)
            refs += batch["texts"]
    w, c = metrics.word_errors(refs, hyps), metrics.char_errors(refs, hyps)
    assert result["wer"] == pytest.approx(w[0] / w[1]) and result["cer"] == pytest.approx(c[0] / c[1])


def test_whisper_targets_put_the_prefix_first_and_eos_last(tmp_path):
    folder = whisper_folder(tmp_path, ["hello world"])
    from transformers import AutoTokenizer

    t = fhm.WhisperTargets(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    ids = t.encode("hello world")
    assert ids[:3] == t.prefix[1:] and ids[-1] == t.eos and t.decode(ids[3:-1]) == "hello world"
    with pytest.raises(ValueError, match="<\\|de\\|>"):
        fhm.WhisperTargets(AutoTokenizer.from_pretrained(folder, local_files_only=True), language="de")


def _whisper_cfg(tmp_path, manifest, folder, *extra):
    return ddptrain.load_config(None, [
        "hf.model=whisper", f"hf.path={folder}", f"data.train_manifest={manifest}", f"data.eval_manifest={manifest}",
        "data.features=whisper_logmel", "data.num_mel_bins=128", "data.normalize=none", "data.max_duration=60",
        "data.max_batch_size=2", "data.num_buckets=1", "data.num_workers=0", "data.shuffle=false",
        f"trainer.output_dir={tmp_path}/run", *extra], schema=fhm.FinetuneConfig)


def _whisper_data(tmp_path, manifest, folder, *extra):
    cfg = _whisper_cfg(tmp_path, manifest, folder, *extra)
    return fhm.whisper_manifest_data(cfg, cfg.hf)


def test_whisper_eval_features_are_not_spec_augmented_with_gpu_features(tmp_path):
    """feature_device=gpu: Seq2SeqLoss computes features with the training loader's extractor;
    they follow the model's mode (before, the eval loss and greedy decoding saw SpecAugment masks)."""
    manifest = write_synthetic_corpus(str(tmp_path / "data"), [1.0, 1.4, 0.8, 1.2], seed=4)
    folder = whisper_folder(tmp_path / "model", [json.loads(line)["text"] for line in open(manifest)])
    aug = ("data.spec_augment=true", "data.time_mask_ratio=0.5", "data.freq_mask_width=60")
    _, evals_w, _ = _whisper_data(tmp_path, manifest, folder, *aug)
    train_g, evals_g, _ = _whisper_data(tmp_path, manifest, folder, *aug, "data.feature_device=gpu")
    model = WhisperForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    bw, bg = next(iter(evals_w)), next(iter(evals_g))
    assert "features" not in bg and bw["ids"] == bg["ids"]
    loss_g = fhm.Seq2SeqLoss(model.config, 1, train_g.feature_extractor)
    with torch.no_grad():
        lw, nw = fhm.Seq2SeqLoss(model.config)(model, bw)  # worker features of an evaluation loader: never masked
        lg, ng = loss_g(model, bg)
    assert nw == ng
    torch.testing.assert_close(lg, lw, atol=1e-4, rtol=1e-5)
    assert not torch.equal(loss_g.features(model.train(), bg), loss_g.features(model.eval(), bg))


def test_whisper_batches_differ_only_by_their_padded_target_length(tmp_path):
    """Whisper on manifests: the collate pads targets to hf.token_pad_multiple and, with GPU
    features, audio to the 30 s window, so a run's batch shapes (its compile.cuda_graphs keys)
    are one per padded target length and batch size, whatever the clips' durations."""
    from ddptrain.cuda_graphs import batch_key

    durations = [0.6, 1.9, 1.1, 2.6, 0.8, 1.5, 2.2, 1.3]
    manifest = write_synthetic_corpus(str(tmp_path / "data"), durations, seed=5)
    folder = whisper_folder(tmp_path / "model", [json.loads(line)["text"] for line in open(manifest)])
    train, _, _ = _whisper_data(tmp_path, manifest, folder, "data.feature_device=gpu", "hf.token_pad_multiple=8",
                                "data.token_pad_multiple=2")
    batches = list(train)
    assert sum(len(b["ids"]) for b in batches) == len(durations)
    assert {b["audio"].shape[1] for b in batches} == {30 * 16000}
    assert all(b["tokens"].shape[1] % 8 == 0 and b["tokens"].shape[1] - 8 < b["token_lens"].max() for b in batches)
    keys = {batch_key({k: v for k, v in b.items() if k not in ("ids", "texts")}) for b in batches}
    assert len(keys) == len({tuple(b["tokens"].shape) for b in batches}) < len({int(b["audio_lens"].max())
                                                                               for b in batches})
    model = WhisperForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():  # the collate's padding is the loss's: same loss and unit count
        b = batches[0]
        loss, n = fhm.Seq2SeqLoss(model.config, 8, train.feature_extractor)(model, b)
        cut = dict(b, tokens=b["tokens"][:, :int(b["token_lens"].max())])
        ref, n_ref = fhm.Seq2SeqLoss(model.config, 1, train.feature_extractor)(model, cut)
    assert int(n) == int(n_ref) == int(b["token_lens"].sum())
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)


def test_whisper_rejects_at_load_a_clip_that_speed_perturbation_would_push_past_the_window(tmp_path):
    """A 28.5 s clip fits the 30 s window, but not at speed 0.9 (31.7 s): the training loader names
    its manifest line at load (before, training stopped mid-epoch in the collate); evaluation,
    never perturbed, keeps the 30 s limit."""
    from ddptrain.data import DataError

    manifest = write_synthetic_corpus(str(tmp_path / "data"), [1.0, 28.5, 1.2], seed=6)
    folder = whisper_folder(tmp_path / "model", [json.loads(line)["text"] for line in open(manifest)])
    cfg = _whisper_cfg(tmp_path, manifest, folder, "data.speed_perturb=[0.9,1.0,1.1]")
    assert fhm.whisper_data_config(cfg.data, cfg.hf, True).max_utterance_duration == pytest.approx(27.0)
    assert fhm.whisper_data_config(cfg.data, cfg.hf, False).max_utterance_duration == 30.0
    capped = _whisper_cfg(tmp_path, manifest, folder, "data.speed_perturb=[1.0,1.1]", "data.max_utterance_duration=20")
    assert fhm.whisper_data_config(capped.data, capped.hf, True).max_utterance_duration == 20.0
    with pytest.raises(DataError, match=r"manifest.jsonl:2: too long: 28.50s > max_utterance_duration=27.0s"):
        fhm.whisper_manifest_data(cfg, cfg.hf)
    plain = _whisper_cfg(tmp_path, manifest, folder)
    train, _, _ = fhm.whisper_manifest_data(plain, plain.hf)  # without perturbation the clip trains
    assert sum(len(b["ids"]) for b in train) == 3


def test_wav2vec2_on_raw_audio_masks_only_in_training_and_refuses_spec_augment(tmp_path):
    """wav2vec2 takes raw audio (no extractor, with feature_device=gpu too) and masks its own
    inputs while training (mask_time_prob); data.spec_augment, which would do nothing, is refused."""
    from ddptrain.data import build_dataloader, load_or_build_tokenizer

    manifest = write_synthetic_corpus(str(tmp_path / "data"), [1.0, 1.4, 0.8, 1.2], seed=4)
    argv = ["hf.model=wav2vec2", "hf.preset=tiny", f"data.train_manifest={manifest}", "data.features=raw",
            "data.num_workers=0", "data.max_duration=60", "data.num_buckets=1", f"data.tokenizer={tmp_path}/tok.json",
            "data.feature_device=gpu"]
    with pytest.raises(ddptrain.ConfigError, match="data.spec_augment masks features"):
        ddptrain.load_config(None, [*argv, "data.spec_augment=true"], schema=fhm.FinetuneConfig)
    with pytest.raises(ddptrain.ConfigError, match="hf.model=wav2vec2 on manifests takes data.features=raw"):
        ddptrain.load_config(None, [*argv, "data.features=fbank"], schema=fhm.FinetuneConfig)
    cfg = ddptrain.load_config(None, argv, schema=fhm.FinetuneConfig)
    tok = load_or_build_tokenizer(cfg.data)
    loader = build_dataloader(manifest, cfg.data, tok, train=False)
    assert loader.feature_extractor is None
    torch.manual_seed(0)
    model = fhm.build_model(cfg.hf, tok.vocab_size)
    model.config.mask_time_prob = 0.5  # masks in nearly every utterance while training
    loss, batch = fhm.loss_for(model), next(iter(loader))
    with torch.no_grad():
        model.eval()
        assert torch.equal(loss(model, batch)[0], loss(model, batch)[0])
        model.train()
        torch.manual_seed(1)
        a = loss(model, batch)[0]
        torch.manual_seed(2)
        assert not torch.equal(a, loss(model, batch)[0])
