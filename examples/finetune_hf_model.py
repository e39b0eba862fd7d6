"""Fine-tune a Hugging Face wav2vec2 (CTC) or Whisper (encoder-decoder) model with ddptrain.Trainer.

No HF Trainer, no accelerate: the model is an ordinary ``nn.Module`` and the loss follows the
ddptrain contract ``(loss_sum, num_units)``. ``transformers`` is a dependency of this script
only, never of ddptrain. Nothing is downloaded: ``hf.path`` is a local checkpoint folder, or the
model is random-initialised from a size preset (what the GPU benchmarks do).

    # wav2vec2-large (lv60 layout, 315M) on a synthetic corpus, 2 GPUs: the fastest measured
    # setting (bf16 model + fp32 masters, the encoder blocks and front end compiled)
    torchrun --nproc_per_node=2 examples/finetune_hf_model.py hf.model=wav2vec2 \
        trainer.precision=bf16 trainer.param_dtype=bf16 trainer.max_steps=200 data.max_duration=500 \
        compile.enabled=true 'compile.module_classes=[Wav2Vec2EncoderLayerStableLayerNorm,Wav2Vec2FeatureEncoder,Wav2Vec2FeatureProjection,Wav2Vec2PositionalConvEmbedding]'
    # Whisper-large-v3 (1.54B), 30 s windows, 24 per GPU, the whole model compiled
    torchrun --nproc_per_node=2 examples/finetune_hf_model.py hf.model=whisper hf.batch_size=24 \
        trainer.precision=bf16 trainer.param_dtype=bf16 compile.enabled=true
    # ... or with activation checkpointing on every layer (a quarter of the activations at
    # +26-31% step time; the checkpointed blocks are compiled inside their recompute regions)
    torchrun --nproc_per_node=2 examples/finetune_hf_model.py hf.model=whisper hf.batch_size=24 \
        trainer.precision=bf16 trainer.param_dtype=bf16 recompute.enabled=true \
        'recompute.module_classes=[WhisperEncoderLayer,WhisperDecoderLayer]' \
        compile.enabled=true 'compile.module_classes=[WhisperEncoderLayer,WhisperDecoderLayer]'
    # a local wav2vec2 checkpoint on real data (raw 16 kHz audio, character tokenizer)
    python examples/finetune_hf_model.py hf.path=/models/wav2vec2-large-lv60 \\
        data.train_manifest=train.jsonl data.features=raw data.max_duration=300
    # a local Whisper checkpoint on real data, evaluated by greedy decoding (WER/CER)
    python examples/finetune_hf_model.py hf.model=whisper hf.path=/models/whisper-large-v3 \\
        data.train_manifest=train.jsonl data.eval_manifest=dev.jsonl data.features=whisper_logmel \\
        data.num_mel_bins=128 data.normalize=none data.max_duration=240

Batches: wav2vec2 batches are cut by ddptrain's ``DurationBucketSampler`` (``data.max_duration``
seconds of *padded* audio per batch and rank). Whisper batches are ``hf.batch_size`` 30 s
windows; every encoder input has the same length, so the same sampler buckets them by transcript
length instead (the decoder's padded length). In both, ``data.sync_buckets`` (default on) gives
the ranks of one step batches from the same bucket, so no rank waits for a costlier batch.

Whisper on manifests: Whisper's log-mel of 30 s windows (``data.features: whisper_logmel``, the
``WhisperFeatureExtractor`` recipe), the checkpoint's tokenizer, targets ``<|lang|><|task|>
<|notimestamps|> text <|endoftext|>`` after ``<|startoftranscript|>``; a batch is
``data.max_duration / 30`` windows. Evaluation decodes greedily from that prefix (each rank its
own length-sorted shard) and reports WER/CER as error counts summed over ranks.

Speed: BENCHMARKS.md section (a) has the measured numbers (bf16 with
``trainer.param_dtype=bf16`` and ``compile.enabled=true`` is the fastest setting measured). The
whole-model compile fails in inductor on wav2vec2's SpecAugment (masked ``index_put``): compile
its blocks (``compile.module_classes``) instead. Flash attention instead of cuDNN's was 11-13%
slower. Keep shapes few (``data.pad_to_multiple`` for audio, ``hf.token_pad_multiple`` for
Whisper targets, both applied in the collate): each new shape builds cuDNN plans (and, compiled,
may recompile) on the host, and is one more ``compile.cuda_graphs`` key. With
``data.feature_device: gpu`` Whisper's audio is padded to the 30 s window, so its batches' shapes
differ only by target length.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddptrain  # noqa: E402
from ddptrain import metrics  # noqa: E402
from ddptrain.config import at_least, one_of  # noqa: E402
from ddptrain.data import DurationBucketSampler, SpeechCollator, make_loader  # noqa: E402
from ddptrain.data.synthetic import SyntheticCorpus, SyntheticSpeech  # noqa: E402
from models.train_flops import Flops  # noqa: E402

WHISPER_FRAMES = 3000  # 30 s of 10 ms frames: Whisper's encoder only takes full windows


@dataclass
class HFConfig:
    model: str = "wav2vec2"  # wav2vec2 (CTC head) | whisper (encoder-decoder)
    path: str = ""  # local checkpoint folder for from_pretrained (no downloads); "" = random init
    preset: str = "large"  # random-init size: large (wav2vec2-large-lv60 / whisper-large-v3) | tiny (tests)
    attn_implementation: str = "sdpa"  # sdpa | eager (| flash_attention_2 where installed)
    freeze_feature_encoder: bool = True  # wav2vec2: keep the CNN front end frozen (standard fine-tuning)
    vocab_size: int = 32  # wav2vec2 CTC head size for random init (real data: the tokenizer's size)
    batch_size: int = 8  # whisper: 30 s windows per batch and rank
    token_pad_multiple: int = 16  # whisper: targets padded to a multiple of this in the collate (fewer shapes)
    language: str = "en"  # whisper on manifests: <|language|> token of the target prefix
    task: str = "transcribe"  # whisper on manifests: transcribe | translate
    generate_eval: bool = True  # whisper on manifests: eval WER/CER by greedy decoding (else the loss only)
    max_new_tokens: int = 200  # whisper generation: tokens after the prefix


@dataclass
class FinetuneConfig(ddptrain.Config):
    hf: HFConfig = field(default_factory=HFConfig)
    # checked at load with the library's (ddptrain/config.py RULES), each error naming its key
    RULES: ClassVar[dict] = {
        "hf.model": one_of("wav2vec2", "whisper"),
        "hf.preset": one_of("large", "tiny"),
        "hf.batch_size": at_least(1),
        "hf.token_pad_multiple": at_least(1),
        "hf.max_new_tokens": at_least(1),
        "hf.task": one_of("transcribe", "translate"),
    }
    RULES_TOGETHER: ClassVar[list] = [
        (("hf.model", "data.train_manifest", "data.features", "data.normalize"),
         lambda m, manifest, kind, normalize: m != "whisper" or not str(manifest).strip()
         or (kind == "whisper_logmel" and normalize == "none"),
         "hf.model=whisper on manifests takes Whisper's log-mel: set data.features=whisper_logmel "
         "data.normalize=none (and data.num_mel_bins)"),
        (("hf.model", "data.train_manifest", "hf.path"),
         lambda m, manifest, path: m != "whisper" or not str(manifest).strip() or bool(str(path).strip()),
         "hf.model=whisper on manifests needs hf.path (its tokenizer)"),
        (("hf.model", "data.train_manifest", "data.features"),
         lambda m, manifest, kind: m != "wav2vec2" or not str(manifest).strip() or kind == "raw",
         "hf.model=wav2vec2 on manifests takes data.features=raw (Whisper: data.features=whisper_logmel)"),
        (("data.features", "data.spec_augment"), lambda kind, augment: kind != "raw" or not augment,
         "data.spec_augment masks features, and data.features=raw has none: wav2vec2 masks its own inputs "
         "in training (its config's mask_time_prob)"),
    ]


# ---------------------------------------------------------------------------------- models


def build_model(h: HFConfig, vocab_size: int | None = None) -> torch.nn.Module:
    """Wav2Vec2ForCTC or WhisperForConditionalGeneration, from ``h.path`` or random-initialised."""
    import transformers as tf

    if h.model == "wav2vec2":
        if h.path:
            model = tf.Wav2Vec2ForCTC.from_pretrained(h.path, local_files_only=True, layerdrop=0.0,
                                                      vocab_size=vocab_size or h.vocab_size, pad_token_id=0,
                                                      ctc_zero_infinity=True, ignore_mismatched_sizes=True,
                                                      attn_implementation=h.attn_implementation)
        else:
            model = tf.Wav2Vec2ForCTC(wav2vec2_config(h.preset, vocab_size or h.vocab_size, h.attn_implementation))
        if h.freeze_feature_encoder:
            model.freeze_feature_encoder()
    elif h.model == "whisper":
        if h.path:
            model = tf.WhisperForConditionalGeneration.from_pretrained(
                h.path, local_files_only=True, attn_implementation=h.attn_implementation)
        else:
            model = tf.WhisperForConditionalGeneration(whisper_config(h.preset, h.attn_implementation))
        model.config.use_cache = False  # training: no KV cache
    else:
        raise ValueError(f"hf.model={h.model!r} is not one of wav2vec2, whisper")
    return model


def wav2vec2_config(preset: str, vocab_size: int = 32, attn: str = "sdpa"):
    """wav2vec2-large-lv60 layout (24 x 1024, stable layer norm, 315M) or a tiny one for tests.

    layerdrop is 0: a dropped layer leaves parameters without gradients, which DDP rejects
    unless ``find_unused_parameters`` (slower) is on.
    """
    from transformers import Wav2Vec2Config

    common = dict(vocab_size=vocab_size, pad_token_id=0, layerdrop=0.0, ctc_zero_infinity=True,
                  feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True,
                  feat_extract_activation="gelu", mask_time_prob=0.05, attn_implementation=attn)
    if preset == "large":
        return Wav2Vec2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                              intermediate_size=4096, **common)
    if preset == "tiny":
        return Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              conv_dim=(32,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                              mask_time_length=2, **common)
    raise ValueError(f"hf.preset={preset!r} is not one of large, tiny")


def whisper_config(preset: str, attn: str = "sdpa"):
    """Whisper-large-v3 layout (32+32 x 1280, 128 mel bins, 51866 tokens, 1.54B) or a tiny one."""
    from transformers import WhisperConfig

    tokens = dict(pad_token_id=50256, bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258,
                  use_cache=False, attn_implementation=attn)
    if preset == "large":
        return WhisperConfig(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32,
                             decoder_layers=32, encoder_attention_heads=20, decoder_attention_heads=20,
                             encoder_ffn_dim=5120, decoder_ffn_dim=5120, max_source_positions=1500,
                             max_target_positions=448, **tokens)
    if preset == "tiny":
        return WhisperConfig(vocab_size=51866, num_mel_bins=128, d_model=32, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                             decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=448, **tokens)
    raise ValueError(f"hf.preset={preset!r} is not one of large, tiny")


# ---------------------------------------------------------------------------------- losses


class CTCLoss:
    """wav2vec2 CTC loss, summed over utterances; units = target tokens.

    Output lengths come from the conv stack's kernel/stride arithmetic on the device and the
    targets stay padded (2-D) for ``F.ctc_loss``, so no step needs a host sync here (the HF
    model's own ``labels=`` path does ``labels.max()`` and ``masked_select``, two syncs).
    """

    def __init__(self, config):
        self.convs = list(zip(config.conv_kernel, config.conv_stride))
        self.blank = config.pad_token_id

    def out_lengths(self, lens: torch.Tensor) -> torch.Tensor:
        for k, s in self.convs:
            lens = torch.div(lens - k, s, rounding_mode="floor") + 1
        return lens

    def __call__(self, model, batch):
        audio, lens = batch["audio"], batch["audio_lens"]
        mask = torch.arange(audio.shape[1], device=audio.device)[None, :] < lens[:, None]
        logits = model(audio, attention_mask=mask.long()).logits
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, batch["tokens"], self.out_lengths(lens), batch["token_lens"],
                          blank=self.blank, reduction="sum", zero_infinity=True)
        return loss, batch["token_lens"].sum()


class Seq2SeqLoss:
    """Whisper cross-entropy summed over target tokens; units = target tokens.

    ``batch["features"]`` is (B, T, mel) as ddptrain's collator makes it; T is padded to the
    3000 frames of a 30 s window. The decoder input is ``[decoder_start] + tokens[:-1]``. With
    ``data.feature_device: gpu`` the batch carries audio and ``feature_extractor`` (the loader's)
    computes the features on the device (``for_model``: SpecAugment only while the model trains).
    """

    def __init__(self, config, token_pad_multiple: int = 1, feature_extractor=None):
        self.start = config.decoder_start_token_id
        self.multiple = max(1, token_pad_multiple)
        self.extractor = feature_extractor

    def features(self, model, batch) -> torch.Tensor:
        if "features" in batch:
            return batch["features"]
        return self.extractor.for_model(model, batch)["features"]

    def __call__(self, model, batch):
        feats, tokens, tlen = self.features(model, batch), batch["tokens"], batch["token_lens"]
        if feats.shape[1] < WHISPER_FRAMES:
            feats = F.pad(feats, (0, 0, 0, WHISPER_FRAMES - feats.shape[1]))
        extra = -tokens.shape[1] % self.multiple  # padded positions are masked out of the loss below
        if extra:
            tokens = F.pad(tokens, (0, extra))
        valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < tlen[:, None]
        dec_in = torch.cat([torch.full_like(tokens[:, :1], self.start), tokens[:, :-1]], dim=1)
        logits = model(input_features=feats.transpose(1, 2), decoder_input_ids=dec_in, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.masked_fill(~valid, -100).flatten(),
                               ignore_index=-100, reduction="sum")
        return loss, valid.sum()


class WhisperTargets:
    """Transcript -> Whisper target ids, the ``encode`` ddptrain.data's loader calls.

    ``<|startoftranscript|>`` is the decoder's start token (``Seq2SeqLoss`` prepends it); the
    targets are ``<|lang|> <|task|> <|notimestamps|>`` + the text's tokens + ``<|endoftext|>``.

    Raises:
        ValueError: the tokenizer lacks one of the prefix's special tokens.
    """

    unk_id = -1  # byte-level BPE has no unknown characters: ddptrain's character check is skipped

    def __init__(self, tokenizer, language: str = "en", task: str = "transcribe"):
        names = ["<|startoftranscript|>", f"<|{language}|>", f"<|{task}|>", "<|notimestamps|>"]
        ids = [tokenizer.convert_tokens_to_ids(n) for n in names]
        missing = [n for n, i in zip(names, ids) if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} (hf.language / hf.task?)")
        self.tokenizer, self.prefix, self.eos = tokenizer, ids, tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.prefix[1:] + self.tokenizer.encode(" " + text.strip(), add_special_tokens=False) + [self.eos]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True).strip()


class WhisperGreedy:
    """Eval metrics for ``Trainer(metrics_fn=...)``: WER/CER of greedy decoding as error counts.

    Decodes each batch from the target prefix with the plain ``GenerationMixin.generate``
    (greedy, KV cache; Whisper's own ``generate`` needs a language table in the checkpoint's
    generation config). The Trainer sums the counts over batches and ranks: a corpus WER.
    """

    def __init__(self, targets: WhisperTargets, loss: Seq2SeqLoss, max_new_tokens: int = 200):
        self.targets, self.loss, self.max_new_tokens = targets, loss, max_new_tokens

    def transcripts(self, model, batch) -> list[str]:
        from transformers.generation import GenerationMixin

        feats = self.loss.features(model, batch)
        prefix = torch.tensor([self.targets.prefix] * feats.shape[0], device=feats.device)
        if feats.shape[1] < WHISPER_FRAMES:
            feats = F.pad(feats, (0, 0, 0, WHISPER_FRAMES - feats.shape[1]))
        out = GenerationMixin.generate(model, input_features=feats.transpose(1, 2).to(model.dtype),
                                       decoder_input_ids=prefix, decoder_attention_mask=torch.ones_like(prefix),
                                       max_new_tokens=self.max_new_tokens, do_sample=False,
                                       num_beams=1, eos_token_id=self.targets.eos,
                                       pad_token_id=model.config.pad_token_id)
        hyps = []
        for row in out[:, prefix.shape[1]:].tolist():
            cut = row.index(self.targets.eos) if self.targets.eos in row else len(row)
            hyps.append(self.targets.decode(row[:cut]))
        return hyps

    def __call__(self, model, batch) -> dict:
        hyps = self.transcripts(model, batch)
        refs = [" ".join(t.split()) for t in batch["texts"]]
        return {"wer": metrics.word_errors(refs, hyps), "cer": metrics.char_errors(refs, hyps)}


def whisper_token_multiple(data_cfg, h: HFConfig) -> int:
    """What the collate pads Whisper targets to a multiple of: both keys' (the lcm), so the loss's
    own ``hf.token_pad_multiple`` padding finds nothing left to do."""
    return math.lcm(data_cfg.token_pad_multiple, h.token_pad_multiple)


def whisper_manifest_data(cfg, h: HFConfig):
    """(train loader, eval loader or None, WhisperTargets) for Whisper on manifests (the data
    settings Whisper needs are :class:`FinetuneConfig`'s rules, checked at load)."""
    from transformers import AutoTokenizer

    from ddptrain.data import build_dataloader

    targets = WhisperTargets(AutoTokenizer.from_pretrained(h.path, local_files_only=True), h.language, h.task)
    data = cfg.data
    train = build_dataloader(data.train_manifest, whisper_data_config(data, h, True), targets, train=True)
    evals = (build_dataloader(data.eval_manifest, whisper_data_config(data, h, False), targets, train=False)
             if data.eval_manifest else None)
    return train, evals, targets


def whisper_data_config(data_cfg, h: HFConfig, train: bool):
    """``data_cfg`` as Whisper's loaders take it: no CTC length limit (a decoder has none), targets
    padded to :func:`whisper_token_multiple`, and no utterance longer than the encoder's 30 s
    window once speed perturbation (training only) has slowed it down: with ``speed_perturb``
    down to 0.9 that is 27 s, rejected at load with its manifest line rather than mid-epoch."""
    from dataclasses import replace

    from ddptrain.data.sampler import speed_stretch

    longest = 30.0 / max(1.0, speed_stretch(data_cfg, train))
    if data_cfg.max_utterance_duration:
        longest = min(longest, data_cfg.max_utterance_duration)
    return replace(data_cfg, output_frame_rate=0.0, max_utterance_duration=longest,
                   token_pad_multiple=whisper_token_multiple(data_cfg, h))


def loss_for(model, token_pad_multiple: int = 1) -> object:
    cfg = model.config
    return CTCLoss(cfg) if cfg.model_type == "wav2vec2" else Seq2SeqLoss(cfg, token_pad_multiple)


# ---------------------------------------------------------------------------------- synthetic data


# without data.train_manifest the model trains on these (the benchmarks pass their own): wav2vec2
# on lognormal durations with ~15 characters a second, Whisper on 30 s windows with lognormal
# transcripts up to its 448-token decoder context
SYNTHETIC = {"wav2vec2": SyntheticCorpus(utterances=20000, median_s=7.0, sigma=0.5, min_s=1.0, max_s=20.0,
                                         tokens_per_s=15.0),
             "whisper": SyntheticCorpus(utterances=20000, median_s=30.0, sigma=0.0, min_s=30.0, max_s=30.0,
                                        median_tokens=60.0, token_sigma=0.6, min_tokens=8, max_tokens=448)}
WHISPER_PREFIX = (50258, 50259, 50360, 50364)  # <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>
WHISPER_EOS = 50257


def synthetic_speech(model: str, model_config=None, seed: int = 0, corpus: SyntheticCorpus | None = None,
                     vocab_size: int = 32) -> SyntheticSpeech:
    """The library's in-memory corpus as this model's examples: raw 16 kHz audio with character
    ids (wav2vec2; ``vocab_size`` without a model config) or (3000, mel) log-mel windows with
    Whisper's target ids (the prefix after the start token, the text, EOS)."""
    corpus = corpus or SYNTHETIC[model]
    if model == "wav2vec2":
        return corpus.dataset(seed, (1, model_config.vocab_size if model_config is not None else vocab_size))
    mel = model_config.num_mel_bins if model_config is not None else 128
    return corpus.dataset(seed, (0, WHISPER_EOS), num_mel_bins=mel, frames=WHISPER_FRAMES,
                          prefix=WHISPER_PREFIX[1:], suffix=(WHISPER_EOS,))  # the start token is prepended


def build_synthetic_loader(h: HFConfig, data_cfg, world_size: int, rank: int, model_config=None,
                           collate_wrapper=None, corpus: SyntheticCorpus | None = None) -> DataLoader:
    """The training loader over :func:`synthetic_speech`: bucketed by duration (wav2vec2) or
    fixed-size batches of 30 s windows bucketed by transcript length (whisper). ``collate_wrapper
    (collate) -> collate`` lets a benchmark add per-batch statistics."""
    speech = synthetic_speech(h.model, model_config, data_cfg.seed, corpus, h.vocab_size)
    wrap = collate_wrapper or (lambda c: c)
    if h.model == "wav2vec2":
        sampler = DurationBucketSampler.from_config(speech.durations, data_cfg, True, world_size=world_size, rank=rank)
        collate = SpeechCollator(mode="audio", pad_to_multiple=data_cfg.pad_to_multiple,
                                 token_pad_multiple=data_cfg.token_pad_multiple)
        return make_loader(speech, sampler, wrap(collate), data_cfg)
    # The sampler's "durations" are transcript lengths here (what differs between windows), and
    # its budget is batch_size x the longest transcript: every batch holds hf.batch_size windows
    # (the last one of a bucket fewer), of similar decoder length.
    lengths = speech.num_tokens.astype(np.float64) + len(WHISPER_PREFIX) + 1
    sampler = DurationBucketSampler.from_config(lengths, data_cfg, True, world_size=world_size, rank=rank,
                                                max_duration=h.batch_size * lengths.max(), max_batch_size=h.batch_size,
                                                quadratic_duration=0.0)  # lengths in tokens: no seconds budget
    collate = SpeechCollator(mode="features", num_mel_bins=speech.num_mel_bins, pad_to_multiple=1,
                             token_pad_id=WHISPER_EOS,
                             token_pad_multiple=whisper_token_multiple(data_cfg, h))
    return make_loader(speech, sampler, wrap(collate), data_cfg)


# ---------------------------------------------------------------------------------- main


def main(argv: list[str]) -> dict:
    config_path = argv[1] if len(argv) > 1 and argv[0] == "--config" else None
    overrides = argv[2:] if config_path else argv
    cfg = ddptrain.load_config(config_path, ["trainer.output_dir=runs/finetune_hf", "trainer.precision=bf16",
                                             "trainer.clip_grad_norm=1.0", "optim.lr=3e-5",
                                             "scheduler.name=warmup_linear", "scheduler.warmup_steps=50",
                                             *overrides], schema=FinetuneConfig)
    info = ddptrain.setup_distributed(cfg)
    h = cfg.hf
    if cfg.data.train_manifest and h.model == "whisper":
        loader, evals, targets = whisper_manifest_data(cfg, h)
        torch.manual_seed(cfg.trainer.seed)
        model = build_model(h)
        loss = Seq2SeqLoss(model.config, h.token_pad_multiple, loader.feature_extractor)
        metrics = WhisperGreedy(targets, loss, h.max_new_tokens) if evals is not None and h.generate_eval else None
        trainer = ddptrain.Trainer(model, loss, cfg, loader, eval_data=evals, metrics_fn=metrics,
                                   flops_fn=Flops("whisper", model, h.token_pad_multiple).of_batch)
        return trainer.fit()
    if cfg.data.train_manifest:  # wav2vec2 on raw audio (FinetuneConfig's rules)
        from ddptrain.data import build_dataloader, load_or_build_tokenizer

        tok = load_or_build_tokenizer(cfg.data)
        loader = build_dataloader(cfg.data.train_manifest, cfg.data, tok, train=True)
        model = build_model(h, vocab_size=tok.vocab_size)
    else:
        model = build_model(h)
        loader = build_synthetic_loader(h, cfg.data, info.world_size, info.rank, model.config)
    trainer = ddptrain.Trainer(model, loss_for(model, h.token_pad_multiple), cfg, loader,
                               flops_fn=Flops(h.model, model, h.token_pad_multiple).of_batch)  # MFU in the log
    return trainer.fit()


if __name__ == "__main__":
    print(main(sys.argv[1:]))
    ddptrain.dist.teardown()  # every rank ends its process group (none in a one-process run)
