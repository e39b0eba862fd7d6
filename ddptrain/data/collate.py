"""Collate examples into a padded batch dict (runs in the DataLoader workers).

Time is padded to the batch maximum rounded up to ``pad_to_multiple`` (8 by default): tensor
cores want dimensions that are multiples of 8, and the rounding costs under 1% on speech-length
sequences. Batch keys:

``features`` (B, T, F) float32, ``feature_lens`` (B,) int64, ``padding_mask`` (B, T) bool with
True = padding  -- when features are computed in the workers;
``audio`` (B, S) float32, ``audio_lens`` (B,) int64  -- for ``features: raw`` or
``feature_device: gpu`` (then call ``loader.feature_extractor`` on the device);
``tokens`` (B, L) int64 padded with 0 (the blank; use ``token_lens``), ``token_lens`` (B,)
-- when a tokenizer is set; L is the longest target rounded up to ``token_pad_multiple`` (1 by
default: fewer distinct L means fewer cuDNN plans, recompiles and ``compile.cuda_graphs`` keys);
``texts`` list[str], ``ids`` list[str], ``skipped_ids`` list[str] (utterances of this batch
dropped under ``bad_data: skip``; usually empty);
``dataset_ids`` / ``ref_audios`` lists (``None`` where a line has none) -- when the examples carry
``dataset_id`` / ``ref_audio`` (manifests with upstream VoxCPM's keys).

A batch can have B = 0: every utterance of it was skipped, or it is an ``exact``-tail filler on
an evaluation rank. Tensors then have a zero batch dimension; loops should skip such batches
(collectively, under DDP).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ddptrain.data.dataset import BadExample


def lengths_to_padding_mask(lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B,) lengths -> (B, max_len) bool mask, True where padded (e.g. for a wav2vec2 mask)."""
    return torch.arange(max_len, device=lens.device)[None, :] >= lens[:, None]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class SpeechCollator:
    """Callable collate_fn.

    Args:
        mode: ``"features"`` or ``"audio"`` (what the examples carry; fixes the keys even for
            an empty batch).
        num_mel_bins: F of an empty features batch.
        pad_to_multiple: round the padded time dimension up to a multiple of this.
        with_tokens: emit ``tokens``/``token_lens``.
        token_pad_id: value for padded token positions.
        token_pad_multiple: round the padded token dimension up to a multiple of this.
        audio_length: ``mode="audio"`` only: pad audio to exactly this many samples when > 0
            (Whisper's 30 s window: then a batch's shape no longer depends on its longest clip).
            A longer clip is an error naming its id.
    """

    def __init__(self, mode: str = "features", num_mel_bins: int = 80, pad_to_multiple: int = 8,
                 with_tokens: bool = True, token_pad_id: int = 0, token_pad_multiple: int = 1,
                 audio_length: int = 0):
        if mode not in ("features", "audio"):
            raise ValueError(f"mode must be 'features' or 'audio', got {mode!r}")
        self.mode = mode
        self.num_mel_bins = num_mel_bins
        self.pad_to_multiple = max(1, pad_to_multiple)
        self.with_tokens = with_tokens
        self.token_pad_id = token_pad_id
        self.token_pad_multiple = max(1, token_pad_multiple)
        self.audio_length = audio_length

    def __call__(self, examples: Sequence) -> dict:
        good = [e for e in examples if not isinstance(e, BadExample)]
        batch: dict = {
            "ids": [e["id"] for e in good],
            "texts": [e["text"] for e in good],
            "skipped_ids": [e.id for e in examples if isinstance(e, BadExample)],
        }
        for key, name in (("dataset_id", "dataset_ids"), ("ref_audio", "ref_audios")):
            if any(key in e for e in good):
                batch[name] = [e.get(key) for e in good]
        if self.mode == "features":
            seqs = [e["features"] for e in good]
            x, lens = self._pad([s for s in seqs], (self.num_mel_bins,), torch.float32)
            batch["features"], batch["feature_lens"] = x, lens
            batch["padding_mask"] = lengths_to_padding_mask(lens, x.shape[1])
        else:
            e = max(good, key=lambda x: x["audio"].shape[0], default=None)
            if self.audio_length and e is not None and e["audio"].shape[0] > self.audio_length:
                raise ValueError(f"utterance {e['id']!r}: {e['audio'].shape[0]} samples, longer than the "
                                 f"{self.audio_length} the collator pads audio to (a model's fixed window: split "
                                 "longer clips; data.speed_perturb factors below 1 lengthen them)")
            batch["audio"], batch["audio_lens"] = self._pad([e["audio"] for e in good], (), torch.float32,
                                                            self.audio_length)
        if self.with_tokens:
            toks = [e["tokens"] for e in good]
            lens = torch.tensor([t.numel() for t in toks], dtype=torch.int64)
            width = _round_up(int(lens.max()), self.token_pad_multiple) if toks else 0
            out = torch.full((len(toks), width), self.token_pad_id, dtype=torch.int64)
            for row, t in zip(out, toks):
                row[: t.numel()] = t
            batch["tokens"], batch["token_lens"] = out, lens
        return batch

    def _pad(self, seqs: list, tail: tuple, dtype, length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.tensor([s.shape[0] for s in seqs], dtype=torch.int64)
        t = length or (_round_up(int(lens.max()), self.pad_to_multiple) if seqs else 0)
        out = torch.zeros((len(seqs), t, *tail), dtype=dtype)
        for row, s in zip(out, seqs):
            row[: s.shape[0]] = s
        return out, lens
