"""GLM-ASR-Nano-2512 for training: the Hugging Face modules, our glue between them.

``transformers.GlmAsrForConditionalGeneration`` is an audio encoder (Whisper-like, rotary
positions), a projector that merges 4 encoder frames into one LLM embedding, and a Llama
decoder. Its own ``forward`` is built for inference; training through it costs three things
this wrapper avoids, with the same modules and weights:

* logits over all positions: 59,264-way logits for every prompt and audio position, of which
  only the transcript's are used. Here the LM head runs on the target positions only.
* host syncs: it finds the valid audio frames with a boolean index and checks the placeholder
  count against them (each a device-to-host copy). Here the collator computes, on the host, the
  flat positions that audio embeddings go to and come from (``audio_dst``/``audio_src``) and
  the positions that predict a target (``pred_index``); the step has no data-dependent shapes.
* a padding mask: batches are *right*-padded, so with causal attention no real position ever
  sees a pad; the decoder runs plain causal attention (``attention_mask=None``), its layers called
  here (:meth:`GlmAsrForTraining.decode`: HF's mask preparation syncs with the host).

``tests/test_example_glmasr.py`` checks that the logits equal the HF forward's at the target
positions, and that :meth:`GlmAsrForTraining.transcribe` (HF ``generate``) gives the same tokens
batched as one utterance at a time.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

WINDOW_FRAMES = 3000  # a 30 s window of 10 ms frames, what the encoder was pretrained on
FRAME_MULTIPLE = 8  # conv stride 2, then 4 frames per embedding: mel lengths must divide by 8


def audio_token_count(frames: int, merge: int = 4) -> int:
    """LLM embeddings (placeholder tokens) of one chunk of ``frames`` valid mel frames.

    The model's own arithmetic (``GlmAsrModel.get_audio_features``): conv1 (k3, s1, p1), conv2
    (k3, s2, p1), then ``merge`` frames per embedding. 3000 frames give 375.
    """
    n = frames
    for padding, kernel, stride in ((1, 3, 1), (1, 3, 2)):
        n = (n + 2 * padding - (kernel - 1) - 1) // stride + 1
    return max(0, (n - merge) // merge + 1)


def published_config(attn_implementation: str = "sdpa"):
    """The GLM-ASR-Nano-2512 layout (transformers' ``GlmAsrConfig`` defaults = the published config)."""
    from transformers import GlmAsrConfig

    cfg = GlmAsrConfig()
    cfg._attn_implementation = attn_implementation
    cfg.text_config._attn_implementation = attn_implementation
    cfg.audio_config._attn_implementation = attn_implementation
    return cfg


def tiny_config(vocab_size: int, audio_token_id: int, eos_token_id: int, num_mel_bins: int = 128):
    """A 2+2-layer GlmAsr small enough for CPU tests (same structure as the published one)."""
    from transformers import GlmAsrConfig

    return GlmAsrConfig(
        audio_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_mel_bins=num_mel_bins),
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=[eos_token_id]),
        audio_token_id=audio_token_id)


class GlmAsrForTraining(nn.Module):
    """A ``GlmAsrForConditionalGeneration`` (``self.hf``) with a training forward.

    Args:
        hf_model: the Hugging Face model (loaded or random-initialised).
        freeze_encoder: keep the audio encoder's weights fixed (the projector and the LLM still
            train); its forward then runs without autograd, which saves its activations too.

    State-dict keys are the HF model's with an ``hf.`` prefix; :meth:`save_pretrained` writes a
    folder that ``GlmAsrForConditionalGeneration.from_pretrained`` loads.
    """

    def __init__(self, hf_model: nn.Module, freeze_encoder: bool = False):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        audio = hf_model.config.audio_config
        self.merge = audio.intermediate_size // audio.hidden_size  # encoder frames per LLM embedding
        self.freeze_encoder = freeze_encoder
        if freeze_encoder:
            self.hf.model.audio_tower.requires_grad_(False)

    def audio_embeddings(self, features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """(R, T, mel) log-mel chunks, T a multiple of 8 -> the LLM embeddings at ``index`` of the
        flattened (R * T // 8) ones. The projector runs on those only, not on the padding."""
        rows = features.shape[0]
        tower = self.hf.model.audio_tower
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_encoder):
            hidden = tower(features.transpose(1, 2).to(tower.conv1.weight.dtype), return_dict=True).last_hidden_state
        hidden = hidden.reshape(rows * (hidden.shape[1] // self.merge), hidden.shape[-1] * self.merge)
        return self.hf.model.multi_modal_projector(hidden.index_select(0, index))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, audio_src: torch.Tensor,
                audio_dst: torch.Tensor, pred_index: torch.Tensor) -> torch.Tensor:
        """Logits at the positions that predict a target token.

        Args:
            input_ids: (B, L) right-padded prompt + placeholders + transcript.
            features: (R, T, mel) one row per 30 s chunk (T a multiple of 8).
            audio_src: (N,) indices into the flattened (R * T // 8) audio embeddings ...
            audio_dst: (N,) ... and the flattened (B * L) positions they replace; ``B * L`` is a
                pad (written to a scratch row that is dropped).
            pred_index: (K,) flattened positions whose next token is a target (or a pad whose
                label the loss ignores).

        Returns:
            (K, vocab) logits.
        """
        b, length = input_ids.shape
        lm = self.hf.model.language_model
        embeds = lm.embed_tokens(input_ids).flatten(0, 1)
        audio = self.audio_embeddings(features, audio_src)
        scratch = embeds.new_zeros(1, embeds.shape[1])  # where padded entries of audio_dst go
        embeds = torch.cat([embeds, scratch]).index_copy(0, audio_dst, audio.to(embeds.dtype))[:-1].view(b, length, -1)
        hidden = self.decode(embeds)
        return self.hf.lm_head(hidden.flatten(0, 1).index_select(0, pred_index))

    def decode(self, embeds: torch.Tensor) -> torch.Tensor:
        """The decoder stack on (B, L, d) embeddings, causal, no cache: the HF ``LlamaModel.forward``
        loop without its mask preparation, whose check for packed sequences (``position_ids`` with
        no ``attention_mask``) copies a flag to the host on every call (a sync, and no CUDA graph)."""
        lm = self.hf.model.language_model
        positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
        rotary = lm.rotary_emb(embeds, position_ids=positions)
        hidden = embeds
        for layer in lm.layers[:lm.config.num_hidden_layers]:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)
        return lm.norm(hidden)

    @torch.no_grad()
    def transcribe(self, batch: dict, features: torch.Tensor, max_new_tokens: int, eos_token_ids: Sequence[int],
                   pad_token_id: int) -> list[list[int]]:
        """Greedy decoding with HF ``generate`` from each utterance's prompt (left-padded).

        Args:
            batch: the collator's batch (``input_ids``, ``prompt_lens``, ``chunk_frames``).
            features: its (R, T, mel) features on the model's device.
            max_new_tokens: decoding stops after this many tokens (or at an EOS).
            eos_token_ids: any of these ends an utterance.
            pad_token_id: fills the left padding and finished rows.

        Returns:
            The generated token ids of each utterance, without the EOS.
        """
        ids, plen = batch["input_ids"], batch["prompt_lens"].tolist()
        width = max(plen)
        prompt = torch.full((len(plen), width), pad_token_id, dtype=ids.dtype, device=ids.device)
        attn = torch.zeros_like(prompt)
        for i, n in enumerate(plen):
            prompt[i, width - n:] = ids[i, :n]
            attn[i, width - n:] = 1
        frames = batch["chunk_frames"].to(features.device)
        feat_mask = (torch.arange(features.shape[1], device=features.device)[None, :] < frames[:, None]).long()
        out = self.hf.generate(input_ids=prompt, attention_mask=attn, input_features=features.transpose(1, 2),
                               input_features_mask=feat_mask, max_new_tokens=max_new_tokens, do_sample=False,
                               num_beams=1, eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id)
        eos = set(eos_token_ids)
        result = []
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in eos), len(row))
            result.append(row[:cut])
        return result

    def save_pretrained(self, folder: str, tokenizer=None) -> None:
        """Write the HF model (and tokenizer) to ``folder``, loadable with ``from_pretrained``."""
        self.hf.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)


def load_hf_model(path: str = "", preset: str = "published", attn_implementation: str = "sdpa",
                  tiny_tokens: Optional[dict] = None) -> nn.Module:
    """A ``GlmAsrForConditionalGeneration`` from a local folder (no network), or random-initialised.

    Args:
        path: a folder with ``config.json`` and safetensors weights; "" = random init.
        preset: random init only: ``published`` (the released layout, 2.1B) or ``tiny`` (tests).
        attn_implementation: ``sdpa`` | ``eager`` (| ``flash_attention_2`` where installed).
        tiny_tokens: the tiny preset's ``vocab_size``, ``audio_token_id``, ``eos_token_id``.

    Raises:
        ValueError: an unknown preset, or ``tiny`` without ``tiny_tokens``.
    """
    from transformers import GlmAsrForConditionalGeneration

    if path:
        model = GlmAsrForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                               attn_implementation=attn_implementation)
    elif preset == "published":
        model = GlmAsrForConditionalGeneration(published_config(attn_implementation))
    elif preset == "tiny":
        if not tiny_tokens:
            raise ValueError("glmasr.preset=tiny needs the tokenizer's vocab_size, audio_token_id and eos_token_id")
        cfg = tiny_config(**tiny_tokens)
        cfg._attn_implementation = attn_implementation
        model = GlmAsrForConditionalGeneration(cfg)
    else:
        raise ValueError(f"glmasr.preset={preset!r} is not one of published, tiny")
    model.config.use_cache = False  # training; generate() turns the cache on for itself
    return model
