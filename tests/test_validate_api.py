"""ddptrain/data/validate.py's shared API: ``read_entries`` and ``finish_report(..., headline=)``,
and the two recipes that route their own checks through it (GLM-ASR, VoxCPM TTS).

Why a file of its own: loader.py, mix.py and the recipes all build on these two functions, so
their contract (what counts as an entry, how problems merge, what the error says) is pinned
here once; the recipe tests use fakes (a character tokenizer, a layout) instead of a model, so
they check the bad-data policy alone, in seconds.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import ddptrain  # noqa: E402
from ddptrain.data import DataError, Problem, write_synthetic_corpus  # noqa: E402
from ddptrain.data import validate  # noqa: E402
from ddptrain.data.manifest import ManifestEntry  # noqa: E402
from ddptrain.data.validate import finish_report, read_entries  # noqa: E402


def _manifest(path, rows):
    with open(path, "w") as f:
        f.write("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


# ---------------------------------------------------------------------------------- read_entries


def test_read_entries_names_bad_lines_and_duplicates_across_files(tmp_path):
    a = _manifest(tmp_path / "a.jsonl", [{"audio_filepath": "x.wav", "duration": 1.0, "text": "hi", "id": "u1"},
                                         "{not json"])
    b = _manifest(tmp_path / "b.jsonl", [{"audio_filepath": "y.wav", "duration": 2.0, "text": "yo", "id": "u1"}])
    entries, problems = read_entries(f"{a},{b}")
    assert [(e.source, e.line, e.id) for e in entries] == [(a, 1, "u1"), (b, 1, "u1")]
    assert [(p.source, p.line) for p in problems] == [(a, 2), (b, 1)]
    assert problems[0].reason.startswith("bad line: ") and problems[1].reason.startswith("duplicate id")
    # entries built in memory are taken as they are; only their ids are checked
    given = [ManifestEntry(id="same", audio_filepath=f, duration=1.0, text="t") for f in ("m.wav", "n.wav")]
    got, dup = read_entries(given)
    assert got == given and got is not given and [p.reason[:12] for p in dup] == ["duplicate id"]
    assert not hasattr(validate, "_entries_of"), "every caller uses read_entries"


def test_read_entries_of_a_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        read_entries(str(tmp_path / "nope.jsonl"))


# ---------------------------------------------------------------------------------- finish_report


@dataclass(frozen=True)
class Utt:
    """Not a ManifestEntry: only what finish_report needs, plus a payload of the caller's."""

    source: str
    line: int
    id: str
    payload: int = 0


def _utts():
    return [Utt("m{x}.jsonl", i, f"u{i}", i * 10) for i in range(1, 5)]


def test_finish_report_skip_merges_per_line_and_keeps_the_given_objects():
    utts = _utts()
    problems = [Problem("m{x}.jsonl", 3, "u3", "too long: a"), Problem("m{x}.jsonl", 1, "u1", "b"),
                Problem("m{x}.jsonl", 3, "u3", "c")]
    report = finish_report(utts, problems, "skip")
    assert report.entries == [utts[1], utts[3]] and report.entries[0] is utts[1]
    assert [(p.line, p.reason) for p in report.problems] == [(1, "b"), (3, "too long: a; c")]
    assert (report.num_total, report.num_skipped) == (4, 2)


def test_finish_report_error_lists_all_under_the_callers_headline():
    utts = _utts()
    problems = [Problem("m{x}.jsonl", 4, "u4", "over budget"), Problem("m{x}.jsonl", 2, "u2", "too many positions")]
    with pytest.raises(DataError) as e:
        finish_report(utts, problems, "error", headline="m{x}.jsonl: {summary} for this recipe:")
    msg = str(e.value)
    # {summary} filled in; the braces of a path left alone (no str.format)
    assert msg.splitlines()[0] == "m{x}.jsonl: 2 of 4 utterance(s) have problems for this recipe:"
    assert "python -m ddptrain.data.validate" not in msg
    assert msg.index("m{x}.jsonl:2 (id u2): too many positions") < msg.index("m{x}.jsonl:4 (id u4): over budget")
    assert [p.line for p in e.value.problems] == [2, 4]
    with pytest.raises(DataError, match=r"^2 of 4 utterance\(s\) have problems .*python -m ddptrain.data.validate"):
        finish_report(utts, problems, "error")  # the default: the validator's own checks
    assert finish_report(utts, [], "error").entries == utts  # nothing wrong: no error


def test_finish_report_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="'skpi'.*error, skip"):
        finish_report(_utts(), [], "skpi")


# ---------------------------------------------------------------------------------- GLM-ASR recipe


class CharTok:
    """A stand-in for the HF tokenizer: one id per character."""

    def encode(self, text, add_special_tokens=False):
        return [10 + ord(c) % 200 for c in text]


@pytest.fixture(scope="module")
def glm_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm")
    write_synthetic_corpus(str(folder), [1.0, 31.5, 1.2, 1.4, 0.8, 1.1], seed=3)
    path = str(folder / "manifest.jsonl")
    rows = [json.loads(x) for x in open(path)]
    texts = ["hello", "long audio", "x" * 500, "y" * 430, "missing", "fine"]
    rows = [{**r, "text": t, "id": f"utt{i}"} for i, (r, t) in enumerate(zip(rows, texts), 1)]
    rows[4]["audio_filepath"] = "audio/gone.flac"
    return _manifest(path, rows + ["{not json"])  # 1 and 6 good; 2 over budget; 3, 4 too many positions;
    # 5 no audio file; 7 not JSON (decoder positions: 23, 409, 521, 453, -, 23)


def _glm(manifest, *overrides):
    import finetune_glmasr as fg

    cfg = ddptrain.load_config(os.path.join(ROOT, "configs", "glmasr.yaml"), [
        f"data.train_manifest={manifest}", "data.num_workers=0", "data.max_duration=45", "glmasr.max_tokens=420",
        *overrides], schema=fg.RecipeConfig)
    layout = fg.PromptLayout((3, 4, 5), (6, 7), 1, 2, 0, (2,))
    return fg, cfg, fg.TranscriptTokenizer(CharTok(), layout.eos_id), layout


def test_glmasr_error_lists_every_problem_by_line_under_the_recipes_headline(glm_corpus):
    fg, cfg, tok, layout = _glm(glm_corpus)
    with pytest.raises(DataError) as e:
        fg.build_manifest_loader(glm_corpus, cfg, tok, layout, 500, True, 1, 0)
    msg = str(e.value)
    head = msg.splitlines()[0]
    assert head.startswith(f"{glm_corpus}: 5 of 7 utterance(s) have problems") and "data.bad_data=skip" in head
    assert "python -m ddptrain.data.validate" not in head  # these checks are the recipe's
    assert f"{glm_corpus}:2 (id utt2): too long: 31.50s = 60s of 30 s encoder windows" in msg
    assert "data.max_duration=45.0s" in msg
    assert f"{glm_corpus}:3 (id utt3): " in msg and "exceed the model's context of 500" in msg
    assert "glmasr.max_tokens=420" in msg.split(f"{glm_corpus}:3 ")[1].splitlines()[0]  # both reasons, one line
    assert f"{glm_corpus}:4 (id utt4): too long: " in msg and "context" not in msg.split(":4 (id utt4)")[1].split("\n")[0]
    assert f"{glm_corpus}:5 (id utt5): missing audio file" in msg and f"{glm_corpus}:7: bad line" in msg
    assert f"{glm_corpus}:1 " not in msg and f"{glm_corpus}:6 " not in msg
    assert [p.line for p in e.value.problems] == [2, 3, 4, 5, 7]


def test_glmasr_skip_drops_them_and_prints_on_rank_0_only(glm_corpus, capsys):
    fg, cfg, tok, layout = _glm(glm_corpus, "data.bad_data=skip")
    loader = fg.build_manifest_loader(glm_corpus, cfg, tok, layout, 500, True, 1, 0)
    assert loader.dataset.lines.tolist() == [1, 6]
    out = capsys.readouterr().out
    assert f"{glm_corpus}: skipped 5 of 7 utterance(s) (data.bad_data=skip)" in out
    assert f"{glm_corpus}:2 (id utt2): too long" in out
    fg.build_manifest_loader(glm_corpus, cfg, tok, layout, 500, True, 2, 1)
    assert capsys.readouterr().out == ""


def test_glmasr_budget_in_seconds_with_batch_encoder_length(glm_corpus):
    # encoder_length=batch: 31.5 s costs its seconds, under a 45 s budget; the window cost is gone
    fg, cfg, tok, layout = _glm(glm_corpus, "data.bad_data=skip", "glmasr.encoder_length=batch")
    loader = fg.build_manifest_loader(glm_corpus, cfg, tok, layout, 500, False, 1, 0)
    assert loader.dataset.lines.tolist() == [1, 2, 6]


# ---------------------------------------------------------------------------------- TTS recipe


def _tts():
    import finetune_tts as ft
    from tts_cache import CachedUtterance

    cfg = ddptrain.load_config(os.path.join(ROOT, "configs", "tts_dialect.yaml"),
                               ["data.num_workers=0", "data.max_duration=10", "tts.max_text_tokens=0"],
                               schema=ft.RecipeConfig)
    layout = SimpleNamespace(audio_vae_config=SimpleNamespace(sample_rate=16000, encoder_rates=[10, 10]),
                             patch_size=2, max_length=60)  # 160 latent frames a second
    utts = [CachedUtterance(f"t{i}", text, f"/nowhere/t{i}.npy", frames, "tts.jsonl", i)
            for i, (text, frames) in enumerate([("ok", 40), ("z" * 70, 40), ("long", 1800), ("ok too", 20)], 1)]
    return ft, cfg, list, layout, utts  # the tokenizer: one id per character (list("ab") has 2)


def test_tts_error_uses_its_own_headline_and_skip_prints_on_rank_0(capsys):
    ft, cfg, tok, layout, utts = _tts()
    with pytest.raises(DataError) as e:
        ft.build_loader(utts, cfg, tok, layout, True, 1, 0)
    msg = str(e.value)
    assert msg.splitlines()[0] == ("tts.jsonl: 2 of 4 utterance(s) have problems for this model and batch budget "
                                   "(data.bad_data=skip leaves them out):")
    assert "tts.jsonl:2 (id t2): 92 positions" in msg and "tts.jsonl:3 (id t3): " in msg
    assert "11.25s of latent audio" in msg
    skip = ddptrain.load_config(os.path.join(ROOT, "configs", "tts_dialect.yaml"),
                                ["data.num_workers=0", "data.max_duration=10", "tts.max_text_tokens=0",
                                 "data.bad_data=skip"], schema=ft.RecipeConfig)
    capsys.readouterr()
    loader = ft.build_loader(utts, skip, tok, layout, True, 1, 0)
    assert [u.line for u in loader.dataset.utts] == [1, 4]
    assert "tts.jsonl: skipped 2 of 4 utterance(s) (data.bad_data=skip)" in capsys.readouterr().out
    ft.build_loader(utts, skip, tok, layout, True, 2, 1)
    assert capsys.readouterr().out == ""
