"""ddptrain/data/synthetic.py: the one synthetic speech corpus. The in-memory one
(``SyntheticCorpus`` + ``SyntheticSpeech``) is what every recipe's random-init mode and every
model benchmark trains on; before, five modules each held a copy of their own."""

from __future__ import annotations

import ast
import os
import pathlib

import numpy as np
import pytest
import torch

from ddptrain.data import SyntheticCorpus, SyntheticSpeech

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_corpus_lengths_are_deterministic_clipped_and_follow_the_duration():
    c = SyntheticCorpus(utterances=500, median_s=5.0, sigma=0.8, min_s=1.0, max_s=12.0, tokens_per_s=4.0,
                        token_jitter=0.25, min_tokens=2)
    d, n = c.lengths(3)
    d2, n2 = c.lengths(3)
    assert np.array_equal(d, d2) and np.array_equal(n, n2) and not np.array_equal(d, c.lengths(4)[0])
    assert d.min() == 1.0 and d.max() == 12.0 and np.array_equal(d, d.round(3))  # clipped, whole ms
    assert 4.5 < np.median(d) < 5.5 and n.dtype == np.int64 and n.min() >= 2
    ratio = n[d > 3] / (4.0 * d[d > 3])  # tokens_per_s x duration, jittered by +-25% (and rounded)
    assert 0.7 < ratio.min() < 0.85 and 1.15 < ratio.max() < 1.3
    assert np.array_equal(SyntheticCorpus(utterances=50, tokens_per_s=3.0).lengths(0)[1],
                          np.maximum(1, np.round(SyntheticCorpus(utterances=50).lengths(0)[0] * 3.0)))  # no jitter


def test_corpus_with_lognormal_transcripts_of_their_own():
    # Whisper's windows: every utterance 30 s, transcripts lognormal, clipped (here to [40, 100] tokens)
    d, n = SyntheticCorpus(utterances=2000, median_s=30.0, sigma=0.0, min_s=30.0, max_s=30.0, median_tokens=60.0,
                           token_sigma=0.6, min_tokens=40, max_tokens=100).lengths(0)
    assert set(d.tolist()) == {30.0} and n.min() == 40 and n.max() == 100 and 55 < np.median(n) < 65


def test_items_are_made_per_index_the_same_everywhere():
    speech = SyntheticSpeech([1.0, 0.5, 2.0], [4, 1, 9], (5, 9), sample_rate=8000, prefix=(1, 2), suffix=(3,))
    again = SyntheticSpeech([1.0, 0.5, 2.0], [4, 1, 9], (5, 9), sample_rate=8000, prefix=(1, 2), suffix=(3,))
    x = speech[2]
    assert set(x) == {"id", "text", "audio", "tokens"} and x["id"] == "2" and x["text"] == ""
    assert x["audio"].shape == (16000,) and x["audio"].dtype == torch.float32
    assert x["tokens"][:2].tolist() == [1, 2] and x["tokens"][-1] == 3 and len(x["tokens"]) == 12
    assert 5 <= int(x["tokens"][2:-1].min()) and int(x["tokens"][2:-1].max()) < 9
    assert torch.equal(x["audio"], again[2]["audio"]) and torch.equal(x["tokens"], again[2]["tokens"])
    assert torch.equal(speech.tokens(2), x["tokens"])  # without making the audio
    assert not torch.equal(speech[0]["audio"][:4000], x["audio"][:4000])
    assert len(speech) == 3 and speech.durations.tolist() == [1.0, 0.5, 2.0]


def test_feature_items_at_a_frame_rate_or_a_fixed_window():
    fbank = SyntheticSpeech([1.25], [3], (1, 50), num_mel_bins=80)[0]
    assert "audio" not in fbank and fbank["features"].shape == (125, 80)
    window = SyntheticSpeech([30.0], [3], (0, 50), num_mel_bins=128, frames=3000)[0]
    assert window["features"].shape == (3000, 128)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="2 durations but 1 token counts"):
        SyntheticSpeech([1.0, 2.0], [3], (0, 10))
    with pytest.raises(ValueError, match=r"token_ids=\(4, 4\)"):
        SyntheticSpeech([1.0], [3], (4, 4))


def test_no_recipe_or_benchmark_makes_a_corpus_of_its_own():
    """A dataset class in examples/ or bench/ that draws random audio or features in its
    ``__getitem__`` is a copy of SyntheticSpeech: use ``ddptrain.data.SyntheticSpeech`` instead."""
    copies = []
    for path in sorted([*ROOT.glob("examples/**/*.py"), *ROOT.glob("bench/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name == "__getitem__":
                calls = {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call)
                         and isinstance(n.func, ast.Attribute)}
                if calls & {"randn", "randint", "lognormal"}:
                    copies.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not copies, f"synthetic corpora outside ddptrain/data/synthetic.py: {copies}"
