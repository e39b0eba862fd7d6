"""Fine-tune GLM-ASR-Nano-2512 (audio encoder + projector + Llama decoder) with ddptrain.Trainer.

The model is ``transformers.GlmAsrForConditionalGeneration`` (transformers >= 5) from a folder you
downloaded (config, tokenizer files, safetensors); nothing is fetched. transformers is a
dependency of this recipe only, never of ddptrain. Without ``glmasr.path`` the recipe refuses to
start, unless a random init is asked for by name (``glmasr.preset``: ``tiny``, ``published``).

    # the model folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...)
    hf download zai-org/GLM-ASR-Nano-2512 --local-dir /models/GLM-ASR-Nano-2512
    # the CPU mode, no download: a tiny random GlmAsr on the shipped digits (about a minute, 2 cores)
    python examples/finetune_glmasr.py --config configs/glmasr_tiny.yaml
    # one GPU, your manifests, the default set-up (30 s windows, bf16 weights + fp32 masters)
    python examples/finetune_glmasr.py --config configs/glmasr.yaml glmasr.path=/models/GLM-ASR-Nano-2512 \\
        data.train_manifest=train.jsonl data.eval_manifest=dev.jsonl
    # 8 GPUs; encoder frozen (only the projector and the LLM train)
    torchrun --nproc_per_node=8 examples/finetune_glmasr.py --config configs/glmasr.yaml \\
        glmasr.path=/models/GLM-ASR-Nano-2512 data.train_manifest=train.jsonl glmasr.freeze_encoder=true
    # the encoder on the batch's length instead of 30 s windows (faster; see below)
    python examples/finetune_glmasr.py --config configs/glmasr.yaml ... glmasr.encoder_length=batch

What a step sees, per utterance: ``prompt before | one placeholder per audio embedding | prompt
after | transcript | EOS``; the loss is the cross-entropy of the transcript tokens and the EOS
only, summed, with their count as the units (ddptrain's loss contract), so the prompt never
enters the loss. ``glmasr.prompt`` is the template, ``{audio}`` marking the placeholders; its
default is the one of the upstream inference code (zai-org/GLM-ASR).

Audio: manifests (``data.train_manifest``), soundfile + resampling to 16 kHz, Whisper's 128-bin
log-mel (``data.features: whisper_logmel``, in the loader workers or on the GPU with
``data.feature_device: gpu``). Longer than 30 s: cut into 30 s chunks as the HF processor does
(``glmasr.long_audio: split``) or refused before training with the manifest line named
(``refuse``). Batches: ``data.max_duration`` padded seconds per batch, where an utterance costs
whole 30 s windows (``encoder_length: window``) or its duration (``batch``), plus
``glmasr.max_tokens`` decoder positions (B x the longest decoder sequence); both are bucket keys.

``glmasr.encoder_length: window`` (default) runs the encoder on 30 s windows, the input it was
pretrained on. ``batch`` cuts the windows to the batch's longest chunk (rounded up to 8 frames):
the encoder has rotary positions, so shorter inputs are valid and much cheaper, but an encoder
pretrained on 30 s windows then sees less trailing silence than it knows; it changes the input
distribution. Keep ``window`` for fine-tuning a pretrained checkpoint unless you have measured
that ``batch`` does no harm on your data.

Evaluation: the eval loss, and WER/CER of greedy decoding (HF ``generate``; batched,
length-sorted, each rank its own shard; error counts summed over ranks).

Speed on one H200 against the HF Trainer (bench/bench_glmasr.py): BENCHMARKS.md, section GLM-ASR.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddptrain  # noqa: E402
from ddptrain import metrics  # noqa: E402
from ddptrain.config import at_least, one_of, satisfies, switch  # noqa: E402
from ddptrain.data import BatchFeatureExtractor, DataError, DurationBucketSampler, Problem, make_loader  # noqa: E402
from ddptrain.data.dataset import BadExample, SpeechDataset  # noqa: E402
from ddptrain.data.sampler import speed_stretch  # noqa: E402
from ddptrain.data.synthetic import SyntheticCorpus, SyntheticSpeech  # noqa: E402
from ddptrain.data.validate import budget_problems, check_entries, keep_good, read_entries  # noqa: E402
from models.glmasr import (FRAME_MULTIPLE, WINDOW_FRAMES, GlmAsrForTraining, audio_token_count,  # noqa: E402
                           load_hf_model)
from models.folders import check_model_folder, download_command  # noqa: E402
from models.train_flops import GlmAsrFlops  # noqa: E402

MODEL_ID = "zai-org/GLM-ASR-Nano-2512"  # the Hugging Face model id glmasr.path is a download of
# what the recipe reads from glmasr.path (transformers' own errors on a missing file name another cause)
MODEL_FILES = {"config.json": ("config.json",), "the weights (model*.safetensors)": ("*.safetensors",),
               "the tokenizer (tokenizer.json, tokenizer_config.json)": ("tokenizer.json",)}
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|begin_of_audio|>", "<|end_of_audio|>"]
DEFAULT_PROMPT = "<|user|>\n<|begin_of_audio|>{audio}<|end_of_audio|><|user|>\nPlease transcribe this audio into text<|assistant|>\n"
AUDIO_TOKEN = "<|pad|>"  # the tokenizer's name of config.audio_token_id in the released model
IGNORE_INDEX = -100  # the label of a padded target (glmasr.pad_indices): no loss, not a unit


@dataclass
class GlmAsrRecipeConfig:
    path: str = ""  # local model folder (config.json, safetensors, tokenizer files), downloaded from MODEL_ID
    preset: str = ""  # "" = load glmasr.path; a random init instead: published (the released layout, 2.1B) | tiny (CPU)
    tokenizer: str = ""  # tokenizer folder; "" = path
    attn_implementation: str = "sdpa"  # sdpa | eager (| flash_attention_2 where installed)
    prompt: str = DEFAULT_PROMPT  # text around the audio; {audio} marks the placeholders
    eos_token: str = ""  # ends every transcript (and generation); "" = the tokenizer's eos_token
    encoder_length: str = "window"  # window (30 s, as pretrained) | batch (the batch's longest chunk, a multiple of 8 frames)
    long_audio: str = "split"  # split (30 s chunks, as the HF processor) | refuse (an error naming the manifest line)
    freeze_encoder: bool = False  # keep the audio encoder fixed; the projector and the LLM train
    max_tokens: int = 0  # decoder positions per batch: B x longest prompt+audio+transcript <= this; 0 = no limit
    token_pad_multiple: int = 8  # pad the decoder length to a multiple of this (fewer distinct shapes)
    frame_pad_multiple: int = 8  # encoder_length=batch: pad the mel length to a multiple of this (of 8; 400 = 4 s: fewer shapes)
    pad_indices: str = "auto"  # on: the audio and target index lists padded, so they are as long as the batch's shapes say (compile.cuda_graphs can replay them) | off | auto = on with compile.cuda_graphs
    target_pad_multiple: int = 128  # pad_indices: the targets padded to a multiple of this (label -100: no loss, no unit)
    generate_eval: bool = True  # eval: WER/CER of greedy decoding (else the loss only)
    max_new_tokens: int = 200  # generation stops after this many tokens
    export_dir: str = ""  # at the end, save the model + tokenizer here as a HF folder (from_pretrained)


@dataclass
class RecipeConfig(ddptrain.Config):
    glmasr: GlmAsrRecipeConfig = field(default_factory=GlmAsrRecipeConfig)
    # a resume refuses these changed (ddptrain/resume.py): the saved weights belong to them
    RESUME_REFUSED: ClassVar[dict[str, str]] = {
        "glmasr.path": "the saved weights were trained from this model",
        "glmasr.preset": "random init: the saved weights have this preset's layout",
    }
    RESUME_FOLDERS: ClassVar[tuple[str, ...]] = ("glmasr.path",)  # moved or copied elsewhere: still accepted
    # checked at load with the library's (ddptrain/config.py RULES), each error naming its key
    RULES: ClassVar[dict] = {
        "glmasr.preset": one_of("", "published", "tiny"),
        "glmasr.encoder_length": one_of("window", "batch"),
        "glmasr.long_audio": one_of("split", "refuse"),
        "glmasr.prompt": satisfies("text with {audio} once", lambda v: v.count("{audio}") == 1,
                                   "must contain {audio} exactly once (where the audio placeholders go)"),
        "glmasr.frame_pad_multiple": satisfies(
            f"a positive multiple of {FRAME_MULTIPLE}", lambda v: v >= FRAME_MULTIPLE and v % FRAME_MULTIPLE == 0,
            f"must be a positive multiple of {FRAME_MULTIPLE} (the encoder merges 8 mel frames into one LLM embedding)"),
        "glmasr.token_pad_multiple": at_least(1),
        "glmasr.pad_indices": switch("off", "on", "auto"),
        "glmasr.target_pad_multiple": at_least(1),
        "glmasr.max_tokens": at_least(0),
        "glmasr.max_new_tokens": at_least(1),
    }
    RULES_TOGETHER: ClassVar[list] = [
        (("data.features", "data.normalize"), lambda kind, normalize: kind == "whisper_logmel" and normalize == "none",
         "GLM-ASR takes Whisper's log-mel: set data.features=whisper_logmel and data.normalize=none "
         "(configs/glmasr.yaml does)"),
    ]


# ---------------------------------------------------------------------------------- prompt + tokens


@dataclass(frozen=True)
class PromptLayout:
    """Token ids around the audio placeholders, and the special ids the batches need."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    audio_token_id: int
    eos_id: int
    pad_id: int
    eos_ids: tuple[int, ...]  # any of these ends a generated transcript

    @classmethod
    def from_tokenizer(cls, tokenizer, model_config, template: str, eos_token: str = "") -> "PromptLayout":
        before, after = template.split("{audio}")
        enc = lambda s: tuple(tokenizer.encode(s, add_special_tokens=False)) if s else ()  # noqa: E731
        eos = eos_token or tokenizer.eos_token
        if not eos:
            raise ddptrain.ConfigError("the tokenizer has no eos_token: set glmasr.eos_token")
        eos_id = tokenizer.convert_tokens_to_ids(eos)
        gen_eos = model_config.text_config.eos_token_id
        gen_eos = list(gen_eos) if isinstance(gen_eos, (list, tuple)) else [gen_eos] if gen_eos is not None else []
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
        return cls(enc(before), enc(after), int(model_config.audio_token_id), int(eos_id), int(pad),
                   tuple(dict.fromkeys([int(eos_id), *map(int, gen_eos)])))


class TranscriptTokenizer:
    """What ddptrain.data needs of a tokenizer: ``encode(text)`` -> transcript ids + EOS."""

    unk_id = -1  # subword tokenizers have no unknown characters: the validator's check is skipped

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer, self.eos_id = tokenizer, eos_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def check_model_source(g: GlmAsrRecipeConfig) -> None:
    """Refuse a run without weights to load unless a random init is asked for by name.

    Raises:
        ConfigError: neither or both of ``glmasr.path`` and ``glmasr.preset``; a model or tokenizer
            folder that is missing or lacks a file (the message says what a downloaded one holds).
    """
    get = f"{download_command(MODEL_ID)}, then glmasr.path=/models/{MODEL_ID.split('/')[-1]}"
    if not g.path and not g.preset:
        raise ddptrain.ConfigError(f"glmasr.path is not set: the recipe fine-tunes a downloaded {MODEL_ID}: {get}. "
                                   "A random init instead: glmasr.preset=tiny (a CPU-sized model, "
                                   "configs/glmasr_tiny.yaml) or glmasr.preset=published (the released 2.1B layout)")
    if g.path and g.preset:
        raise ddptrain.ConfigError(f"glmasr.path={g.path!r} and glmasr.preset={g.preset!r}: the preset is a random "
                                   "init, the path loads weights; set glmasr.preset='' to fine-tune the folder")
    if g.path:
        check_model_folder("glmasr.path", g.path, MODEL_FILES if not g.tokenizer else dict(list(MODEL_FILES.items())[:2]),
                           MODEL_ID)
    if g.tokenizer:
        check_model_folder("glmasr.tokenizer", g.tokenizer, dict(list(MODEL_FILES.items())[2:]), MODEL_ID)


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + the released model's special tokens, no merges) for the
    tiny preset: built here, so a CPU run needs no download and every rank gets the same one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0])


def load_tokenizer(g: GlmAsrRecipeConfig, real_data: bool = False):
    """The tokenizer of ``glmasr.tokenizer`` or ``glmasr.path``; the tiny preset on real data
    without one: :func:`byte_tokenizer`; else ``None`` (synthetic token ids)."""
    from transformers import AutoTokenizer

    folder = g.tokenizer or g.path
    if not folder:
        return byte_tokenizer() if g.preset == "tiny" and real_data else None
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


# ---------------------------------------------------------------------------------- batches


def chunk_frames(num_samples: int, hop: int = 160, window: int = WINDOW_FRAMES * 160) -> list[int]:
    """Valid mel frames of each 30 s chunk of an utterance (the HF processor's chunking)."""
    chunks = max(1, -(-num_samples // window))
    return [-(-(min(window, num_samples - i * window)) // hop) for i in range(chunks)]


class GlmAsrCollator:
    """Examples (``audio``, ``tokens`` = transcript + EOS) -> a batch for :class:`GlmAsrForTraining`.

    Runs in the loader workers. Everything data-dependent is decided here, on the host: the
    chunking, the placeholder count per utterance, and the flat indices the model scatters audio
    embeddings to and reads logits from, so a training step needs no host sync.

    Args:
        layout: prompt and special token ids.
        extractor: the ``whisper_logmel`` extractor for worker features; ``None`` = emit the audio
            (``data.feature_device: gpu``: the objective runs the extractor on the device).
        encoder_length: ``window`` (3000 frames) or ``batch`` (longest chunk, a multiple of 8).
        token_pad_multiple: the decoder length is padded to a multiple of this.
        frame_pad_multiple: ``batch``: the mel length is padded to a multiple of this (of 8).
        max_positions: the LLM's context; a longer sequence is an error naming the utterance.
        split_long: cut audio over 30 s into chunks; False = an error naming the utterance.
        hop: samples per mel frame.
        target_pad_multiple: 0 = index lists as long as their entries; k > 0 = padded, so their
            lengths follow the batch's tensor shapes and ``compile.cuda_graphs`` can replay
            one graph for every batch of one shape: ``audio_src`` / ``audio_dst`` to one entry per
            embedding of the chunk rows (pads: source 0, destination ``B * L``, which the model
            drops), ``pred_index`` / ``labels`` to a multiple of k (label -100: no loss), the
            audio (``feature_device: gpu``) to the samples of ``num_frames``.

    Batch keys: ``ids``, ``texts``, ``skipped_ids``; ``input_ids`` (B, L); ``features`` (R, T,
    mel) or ``audio`` (R, S) + ``audio_lens`` (R,) + ``num_frames`` (T, an int); ``chunk_frames``
    (R,); ``audio_src``, ``audio_dst``, ``pred_index``, ``labels``; ``prompt_lens`` (B,).
    """

    def __init__(self, layout: PromptLayout, extractor: Optional[BatchFeatureExtractor], encoder_length: str = "window",
                 token_pad_multiple: int = 8, max_positions: int = 8192, split_long: bool = True, hop: int = 160,
                 frame_pad_multiple: int = FRAME_MULTIPLE, target_pad_multiple: int = 0):
        self.layout, self.extractor = layout, extractor
        self.target_multiple = target_pad_multiple
        self.encoder_length, self.multiple = encoder_length, max(1, token_pad_multiple)
        self.frame_multiple = frame_pad_multiple
        self.max_positions, self.split_long, self.hop = max_positions, split_long, hop
        self.window = WINDOW_FRAMES * hop

    def __call__(self, examples: Sequence) -> dict:
        good = [e for e in examples if not isinstance(e, BadExample)]
        batch: dict = {"ids": [e["id"] for e in good], "texts": [e["text"] for e in good],
                       "skipped_ids": [e.id for e in examples if isinstance(e, BadExample)]}
        if not good:
            return batch
        lay = self.layout
        pieces, frames, seqs, spans = [], [], [], []
        for e in good:
            audio = e["audio"]
            if audio.numel() > self.window and not self.split_long:
                raise DataError(f"utterance {e['id']}: {audio.numel() / (100 * self.hop):.2f}s is longer than the 30 s "
                                "window (glmasr.long_audio=refuse)")
            f = chunk_frames(audio.numel(), self.hop, self.window)
            pieces += [audio[i * self.window:(i + 1) * self.window] for i in range(len(f))]
            frames.append(f)
            n_audio = sum(audio_token_count(x) for x in f)
            seq = [*lay.prefix, *([lay.audio_token_id] * n_audio), *lay.suffix]
            spans.append((len(lay.prefix), n_audio, len(seq), e["tokens"].numel()))
            seqs.append(seq + e["tokens"].tolist())
            if len(seqs[-1]) > self.max_positions:
                raise DataError(f"utterance {e['id']}: {len(seqs[-1])} decoder positions (prompt + audio + transcript) "
                                f"exceed the model's {self.max_positions}")
        flat_frames = [x for f in frames for x in f]
        t = WINDOW_FRAMES if self.encoder_length == "window" else min(
            WINDOW_FRAMES, -(-max(flat_frames) // self.frame_multiple) * self.frame_multiple)
        per_row = t // FRAME_MULTIPLE  # LLM embeddings per chunk row
        length = -(-max(len(s) for s in seqs) // self.multiple) * self.multiple
        input_ids = torch.full((len(seqs), length), lay.pad_id, dtype=torch.int64)
        src, dst, pred, labels, row = [], [], [], [], 0
        for b, (seq, f, (start, n_audio, prompt_len, n_target)) in enumerate(zip(seqs, frames, spans)):
            input_ids[b, :len(seq)] = torch.tensor(seq)
            for x in f:
                src.append(row * per_row + torch.arange(audio_token_count(x)))
                row += 1
            dst.append(b * length + start + torch.arange(n_audio))
            # position p predicts token p + 1: the transcript and its EOS start at prompt_len
            pred.append(b * length + prompt_len - 1 + torch.arange(n_target))
            labels.append(input_ids[b, prompt_len:prompt_len + n_target])
        src, dst, pred, labels = torch.cat(src), torch.cat(dst), torch.cat(pred), torch.cat(labels)
        if self.target_multiple:
            src, dst, pred, labels = self._pad_indices(src, dst, pred, labels, row * per_row, len(seqs) * length)
        lens = torch.tensor([p.numel() for p in pieces], dtype=torch.int64)
        audio = torch.zeros(len(pieces), t * self.hop if self.target_multiple else int(lens.max()))
        for r, p in enumerate(pieces):
            audio[r, :p.numel()] = p
        if self.extractor is not None:
            with torch.no_grad():
                batch["features"] = self.extractor(audio, lens)["features"][:, :t].contiguous()
        else:
            batch.update(audio=audio, audio_lens=lens, num_frames=t)
        batch.update(input_ids=input_ids, chunk_frames=torch.tensor(flat_frames, dtype=torch.int64),
                     audio_src=src, audio_dst=dst, pred_index=pred, labels=labels,
                     prompt_lens=torch.tensor([s[2] for s in spans], dtype=torch.int64))
        return batch

    def _pad_indices(self, src, dst, pred, labels, embeddings: int, positions: int) -> tuple:
        """The four index lists padded (see ``target_pad_multiple``): audio to ``embeddings``
        entries, destination ``positions`` (one past the last: the model's scratch row)."""
        pad = embeddings - src.numel()
        targets = -(-labels.numel() // self.target_multiple) * self.target_multiple - labels.numel()
        return (F.pad(src, (0, pad)), F.pad(dst, (0, pad), value=positions), F.pad(pred, (0, targets)),
                F.pad(labels, (0, targets), value=IGNORE_INDEX))


def decoder_length(layout: PromptLayout, num_samples: int, num_targets: int, hop: int = 160) -> int:
    """Decoder positions of one utterance: prompt + placeholders + transcript + EOS."""
    n_audio = sum(audio_token_count(f) for f in chunk_frames(num_samples, hop))
    return len(layout.prefix) + n_audio + len(layout.suffix) + num_targets


def audio_cost(durations: np.ndarray, encoder_length: str) -> np.ndarray:
    """Seconds of ``data.max_duration`` each utterance uses: whole 30 s windows (``window``: the
    encoder runs on full windows whatever the audio's length) or its own seconds (``batch``)."""
    return np.ceil(durations / 30.0 - 1e-9) * 30.0 if encoder_length == "window" else durations


WINDOW_UNIT = "of 30 s encoder windows"  # how a window-costed budget is named in a too-long message


def make_sampler(durations: np.ndarray, dec_lens: np.ndarray, g: GlmAsrRecipeConfig, data, train: bool,
                 world_size: int, rank: int) -> DurationBucketSampler:
    """The library's sampler of ``data``, bucketed on audio cost (whole 30 s windows, or
    seconds) and decoder length (``glmasr.max_tokens``)."""
    return DurationBucketSampler.from_config(durations, data, train, cost=functools.partial(
        audio_cost, encoder_length=g.encoder_length), tokens=dec_lens, max_tokens=g.max_tokens,
        world_size=world_size, rank=rank)


def make_collator(cfg, layout: PromptLayout, max_positions: int, train: bool) -> tuple:
    """``(collator, extractor or None)``: with ``data.feature_device: gpu`` the collator ships
    audio and the objective computes the features with the extractor (``make_loader`` attaches
    the same kind as the loader's ``feature_extractor``)."""
    data, g = cfg.data, cfg.glmasr
    extractor = BatchFeatureExtractor(data).train(train)
    on_gpu = data.feature_device == "gpu"
    pad = g.pad_indices == "on" or (g.pad_indices == "auto" and cfg.compile.cuda_graphs)
    collate = GlmAsrCollator(layout, None if on_gpu else extractor, g.encoder_length, g.token_pad_multiple,
                             max_positions, g.long_audio == "split", extractor.hop, g.frame_pad_multiple,
                             g.target_pad_multiple if pad else 0)
    return collate, (extractor if on_gpu else None)


def build_manifest_loader(manifest: str, cfg, tokenizer: TranscriptTokenizer, layout: PromptLayout,
                          max_positions: int, train: bool, world_size: int, rank: int) -> DataLoader:
    """Validated manifest -> bucketed DataLoader of GLM-ASR batches.

    Every utterance that cannot be trained on is one problem of ``file:line (id ...)``: a bad
    line or audio file (the library's checks, with ``data.validate``), one alone over
    ``data.max_duration`` (the library's budget check, through this recipe's cost: whole 30 s
    windows with ``encoder_length: window``), audio over 30 s with ``glmasr.long_audio:
    refuse``, a sequence longer than the LLM's context, or one alone over ``glmasr.max_tokens``.
    ``data.bad_data`` decides: ``error`` lists them all and stops, ``skip`` leaves them out and
    prints them on rank 0.

    Raises:
        DataError: any such problem under ``data.bad_data: error``; no utterance left.
    """
    data, g = cfg.data, cfg.glmasr
    entries, problems = read_entries(manifest, data.fields)
    cost = functools.partial(audio_cost, encoder_length=g.encoder_length)
    unit = WINDOW_UNIT if g.encoder_length == "window" else ""
    if data.validate:
        problems += check_entries(entries, data, tokenizer, data.validate_decode, cost=cost, cost_unit=unit)
    else:
        problems += budget_problems(entries, [e.duration for e in entries], data, cost, unit)
    stretch = speed_stretch(data, train)
    hop = int(data.sample_rate * data.frame_shift_ms / 1000)
    positions = {}  # id(entry) -> decoder positions, for the sampler's token counts of the kept ones
    for e in entries:
        sec = e.duration * stretch
        n = positions[id(e)] = decoder_length(layout, int(math.ceil(sec * data.sample_rate)),
                                              len(tokenizer.encode(e.text)), hop)
        if g.long_audio == "refuse" and sec > 30.0:
            problems.append(Problem(e.source, e.line, e.id, f"{e.duration:.2f}s is longer than the 30 s window "
                                    "(glmasr.long_audio=refuse; 'split' cuts it into 30 s chunks)"))
        elif n > max_positions:
            problems.append(Problem(e.source, e.line, e.id, f"{n} decoder positions (prompt + audio + transcript) "
                                    f"exceed the model's context of {max_positions}"))
        if 0 < g.max_tokens < n:
            problems.append(Problem(e.source, e.line, e.id, f"too long: {n} decoder positions do not fit in a batch "
                                    f"of glmasr.max_tokens={g.max_tokens}"))
    # the shared bad-data policy (ddptrain/data/validate.py), with our headline: the default
    # one's `python -m ddptrain.data.validate` knows nothing of this model's limits
    keep = keep_good(entries, problems, data.bad_data, manifest, f"{manifest}: {{summary}} (bad lines, or too long "
                     "for this model or batch budget; data.bad_data=skip leaves them out):", print if rank == 0 else None)
    dataset = SpeechDataset(keep, dataclasses.replace(data, features="raw"), tokenizer, train)
    sampler = make_sampler(dataset.durations, np.array([positions[id(e)] for e in keep], dtype=np.float64), g, data,
                           train, world_size, rank)
    return make_loader(dataset, sampler, make_collator(cfg, layout, max_positions, train)[0], data, train)


# ---------------------------------------------------------------------------------- synthetic data


# a random init without a tokenizer trains on this (bench/bench_glmasr.py passes its own size)
SYNTHETIC = SyntheticCorpus(utterances=2000, median_s=7.0, sigma=0.5, min_s=1.0, max_s=30.0, tokens_per_s=3.0,
                            token_jitter=0.3)


def synthetic_speech(corpus: SyntheticCorpus, seed: int, layout: PromptLayout, vocab: int,
                     sample_rate: int = 16000) -> SyntheticSpeech:
    """The library's in-memory corpus as GLM-ASR examples: transcript ids + EOS, ids below the
    audio placeholder (a transcript must not contain it: the HF forward counts them)."""
    return corpus.dataset(seed, (0, min(vocab, 50000, layout.audio_token_id)), sample_rate=sample_rate,
                          suffix=(layout.eos_id,))


def synthetic_layout(model_config, prompt_tokens: int = 20) -> PromptLayout:
    """A prompt of fixed ids for tokenizer-less random-init runs (benchmarks)."""
    vocab = model_config.text_config.vocab_size
    eos = model_config.text_config.eos_token_id
    eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
    ids = tuple(range(100, 100 + prompt_tokens))
    return PromptLayout(ids[:prompt_tokens // 2], ids[prompt_tokens // 2:], int(model_config.audio_token_id),
                        eos, min(vocab - 1, eos), (eos,))


def build_synthetic_loader(cfg, layout: PromptLayout, vocab: int, world_size: int, rank: int,
                           max_positions: int = 8192, collate_wrapper=None,
                           corpus: SyntheticCorpus = SYNTHETIC) -> DataLoader:
    """The training loader over :func:`synthetic_speech`, bucketed as a manifest's would be;
    ``collate_wrapper(collate) -> collate`` lets a benchmark add per-batch statistics."""
    data = cfg.data
    speech = synthetic_speech(corpus, data.seed, layout, vocab, data.sample_rate)
    hop = int(data.sample_rate * data.frame_shift_ms / 1000)
    dec = np.array([decoder_length(layout, int(x * data.sample_rate), int(k) + 1, hop)  # + EOS
                    for x, k in zip(speech.durations, speech.num_tokens)], np.float64)
    sampler = make_sampler(speech.durations, dec, cfg.glmasr, data, True, world_size, rank)
    collate, _ = make_collator(cfg, layout, max_positions, True)
    return make_loader(speech, sampler, collate_wrapper(collate) if collate_wrapper else collate, data)


# ---------------------------------------------------------------------------------- objective


class GlmAsrObjective:
    """The loss contract: (sum of cross-entropies of transcript + EOS tokens, their count).

    Also the eval metrics (WER/CER of greedy decoding, as error counts the Trainer sums over
    batches and ranks) and, with ``data.feature_device: gpu``, the features on the device
    (``BatchFeatureExtractor.for_model``: SpecAugment only while the model trains).
    """

    def __init__(self, layout: PromptLayout, tokenizer: Optional[TranscriptTokenizer] = None,
                 feature_extractor: Optional[BatchFeatureExtractor] = None, max_new_tokens: int = 200):
        self.layout, self.tokenizer, self.extractor = layout, tokenizer, feature_extractor
        self.max_new_tokens = max_new_tokens

    def features(self, model, batch: dict) -> torch.Tensor:
        if "features" in batch:
            return batch["features"]
        return self.extractor.for_model(model, batch)["features"][:, :batch["num_frames"]]

    def __call__(self, model, batch):
        logits = model(batch["input_ids"], self.features(model, batch), batch["audio_src"], batch["audio_dst"],
                       batch["pred_index"])
        labels = batch["labels"]
        loss = F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)
        return loss, (labels != IGNORE_INDEX).sum()  # a tensor: padded targets (glmasr.pad_indices) are not units

    def transcripts(self, model, batch) -> list[str]:
        ids = model.transcribe(batch, self.features(model, batch), self.max_new_tokens, self.layout.eos_ids,
                               self.layout.pad_id)
        return [self.tokenizer.decode(x) for x in ids]

    def error_counts(self, model, batch) -> dict:
        """Eval metrics as (numerator, denominator): corpus WER and CER of greedy decoding."""
        hyps = self.transcripts(model, batch)
        return {"wer": metrics.word_errors(batch["texts"], hyps), "cer": metrics.char_errors(batch["texts"], hyps)}


# ---------------------------------------------------------------------------------- main


def build_model(cfg, info, real_data: bool) -> tuple:
    """``(GlmAsrForTraining, HF tokenizer or None)``: the weights of ``glmasr.path`` or a random
    init of ``glmasr.preset``, the same on every rank."""
    g = cfg.glmasr
    check_model_source(g)
    hf_tok = load_tokenizer(g, real_data)
    if hf_tok is None and g.preset == "tiny":
        raise ddptrain.ConfigError("glmasr.preset=tiny trains on real data: set data.train_manifest "
                                   "(configs/glmasr_tiny.yaml uses the shipped digits)")
    if hf_tok is None and real_data:
        raise ddptrain.ConfigError("real data (data.train_manifest) needs a tokenizer: set glmasr.path (or glmasr.tokenizer)")
    tiny = None
    if hf_tok is not None and not g.path:
        eos = g.eos_token or hf_tok.eos_token
        tiny = dict(vocab_size=len(hf_tok), audio_token_id=hf_tok.convert_tokens_to_ids(AUDIO_TOKEN),
                    eos_token_id=hf_tok.convert_tokens_to_ids(eos))
    torch.manual_seed(cfg.trainer.seed)  # the same initial weights on every rank and every run
    with torch.device(info.device if not g.path else "cpu"):  # a 2B random init is fast on the GPU
        hf_model = load_hf_model(g.path, g.preset, g.attn_implementation, tiny)
    return GlmAsrForTraining(hf_model, freeze_encoder=g.freeze_encoder), hf_tok


def build(cfg, info) -> tuple:
    """(model, objective, train loader, eval loader or None, tokenizer or None) for ``cfg``."""
    g = cfg.glmasr
    model, hf_tok = build_model(cfg, info, bool(cfg.data.train_manifest))
    hf_model = model.hf
    max_positions = hf_model.config.text_config.max_position_embeddings
    if hf_tok is None:
        layout = synthetic_layout(hf_model.config)
        train = build_synthetic_loader(cfg, layout, hf_model.config.text_config.vocab_size, info.world_size,
                                       info.rank, max_positions)
        return model, GlmAsrObjective(layout, None, train.feature_extractor), train, None, None
    layout = PromptLayout.from_tokenizer(hf_tok, hf_model.config, g.prompt, g.eos_token)
    tok = TranscriptTokenizer(hf_tok, layout.eos_id)
    train = build_manifest_loader(cfg.data.train_manifest, cfg, tok, layout, max_positions, True,
                                  info.world_size, info.rank)
    evals = (build_manifest_loader(cfg.data.eval_manifest, cfg, tok, layout, max_positions, False,
                                   info.world_size, info.rank) if cfg.data.eval_manifest else None)
    objective = GlmAsrObjective(layout, tok, train.feature_extractor, g.max_new_tokens)
    return model, objective, train, evals, hf_tok


def build_eval(cfg, info, manifests: list[str]) -> tuple:
    """examples/evaluate.py's pieces: ``(model, loss_fn, metrics_fn, {manifest: eval loader})``;
    the metrics are WER/CER of greedy decoding (``glmasr.generate_eval``)."""
    g = cfg.glmasr
    model, hf_tok = build_model(cfg, info, True)
    max_positions = model.config.text_config.max_position_embeddings
    layout = PromptLayout.from_tokenizer(hf_tok, model.config, g.prompt, g.eos_token)
    tok = TranscriptTokenizer(hf_tok, layout.eos_id)
    loaders = {m: build_manifest_loader(m, cfg, tok, layout, max_positions, False, info.world_size, info.rank)
               for m in manifests}
    objective = GlmAsrObjective(layout, tok, next(iter(loaders.values())).feature_extractor, g.max_new_tokens)
    return model, objective, objective.error_counts if g.generate_eval else None, loaders


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (configs/glmasr.yaml)")
    args, overrides = parser.parse_known_args(argv)
    cfg = ddptrain.load_config(args.config, overrides, schema=RecipeConfig)
    info = ddptrain.setup_distributed(cfg)
    model, objective, train, evals, hf_tok = build(cfg, info)
    trainer = ddptrain.Trainer(model, objective, cfg, train, eval_data=evals,
                               metrics_fn=objective.error_counts if evals is not None and cfg.glmasr.generate_eval
                               and objective.tokenizer is not None else None,
                               flops_fn=GlmAsrFlops(model.hf).of_batch)  # MFU in the log
    if info.is_main:
        n = sum(p.numel() for p in model.parameters())
        t = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"GLM-ASR: {n:,} parameters ({t:,} trained); {len(train)} batches/epoch/rank on "
              f"{info.world_size} process(es), device {trainer.device}; recomputed {len(trainer.recomputed)}, "
              f"compiled {len(trainer.compiled)} modules")
    result = trainer.fit()
    if cfg.glmasr.export_dir and info.is_main:
        trainer.module.save_pretrained(cfg.glmasr.export_dir, hf_tok)
        print(f"saved the fine-tuned model to {cfg.glmasr.export_dir}")
    trainer.close()
    ddptrain.dist.teardown()  # every rank, after rank 0's export: the process group ends here
    return result


if __name__ == "__main__":
    print(main(sys.argv[1:]))
