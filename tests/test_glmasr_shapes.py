"""GLM-ASR collator: with encoder windows cut to the batch, mel lengths are padded to
``glmasr.frame_pad_multiple`` (fewer distinct shapes), and the audio placeholders still follow
each chunk's own valid frames."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import ddptrain  # noqa: E402

fg = pytest.importorskip("finetune_glmasr")
from models.glmasr import audio_token_count  # noqa: E402


def _collate(multiple, seconds):
    layout = fg.PromptLayout(prefix=(1, 2), suffix=(3,), audio_token_id=9, eos_id=4, pad_id=0, eos_ids=(4,))
    c = fg.GlmAsrCollator(layout, None, "batch", 8, frame_pad_multiple=multiple)
    ex = [{"id": str(i), "text": "x", "audio": torch.zeros(int(s * 16000)), "tokens": torch.tensor([5, 6, 4])}
          for i, s in enumerate(seconds)]
    return c(ex)


@pytest.mark.parametrize("multiple,seconds,frames", [(8, [1.23, 2.0], 200), (8, [2.01], 208), (400, [1.23, 2.0], 400),
                                                     (400, [4.01], 800), (400, [29.5], 3000), (8, [30.0], 3000)])
def test_mel_length_is_padded_to_the_frame_multiple_and_capped_at_the_window(multiple, seconds, frames):
    b = _collate(multiple, seconds)
    assert b["num_frames"] == frames
    # placeholders per utterance: its own valid frames, not the padded length
    n_audio = (b["input_ids"] == 9).sum(1).tolist()
    assert n_audio == [audio_token_count(int(f)) for f in b["chunk_frames"].tolist()]


def test_a_frame_multiple_that_is_not_a_multiple_of_8_is_refused_by_name():
    with pytest.raises(ddptrain.ConfigError, match="glmasr.frame_pad_multiple=100"):  # at load: the recipe's RULES
        ddptrain.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "glmasr.yaml"),
                             ["glmasr.frame_pad_multiple=100"], schema=fg.RecipeConfig)
