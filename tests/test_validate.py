"""Manifest validation: every bad-data case has its named reason; error vs. skip policy; CLI."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from ddptrain.data import CharTokenizer, DataConfig, DataError, build_dataloader, validate_manifest
from ddptrain.data.synthetic import synth_waveform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_wav(path, seconds, rate=16000):
    sf.write(path, synth_waveform(seconds, rate, np.random.default_rng(0)), rate, subtype="PCM_16")
    return os.path.basename(path)


@pytest.fixture
def bad_corpus(tmp_path):
    """A manifest with one good line followed by one line per kind of problem."""
    d = tmp_path
    good = write_wav(d / "good.wav", 2.0)
    write_wav(d / "long.wav", 8.0)
    (d / "corrupt.wav").write_bytes(b"this is not audio at all" * 20)
    sf.write(d / "empty.wav", np.zeros((0, 1), np.float32), 16000)
    cut = write_wav(d / "cut.flac", 2.0)
    data = (d / "cut.flac").read_bytes()
    (d / "cut.flac").write_bytes(data[: len(data) // 2])
    lines = [
        ({"audio_filepath": good, "duration": 2.0, "text": "fine"}, None),
        ({"audio_filepath": "missing.wav", "duration": 2.0, "text": "x"}, "missing audio file"),
        ({"audio_filepath": "corrupt.wav", "duration": 2.0, "text": "x"}, "unreadable audio"),
        ({"audio_filepath": "empty.wav", "duration": 1.0, "text": "x"}, "zero-length audio"),
        ({"audio_filepath": good, "duration": 3.5, "text": "x"}, "duration mismatch"),
        ({"audio_filepath": good, "duration": 1.5, "offset": 1.0, "text": "x"}, "duration mismatch"),
        ({"audio_filepath": good, "duration": 2.0, "text": "  "}, "empty text"),
        ({"audio_filepath": good, "duration": 2.0, "text": "a" * 60}, "text too long for CTC"),
        ({"audio_filepath": "long.wav", "duration": 8.0, "text": "x"}, "too long"),
        ('{"audio_filepath": oops}', "bad line: invalid JSON"),
        ({"audio_filepath": good, "duration": 2.0, "text": "fine", "offset": 0.0}, None),  # a valid segment
        ({"audio_filepath": cut, "duration": 2.0, "text": "x"}, "unreadable audio"),  # only found with decode
    ]
    m = d / "m.jsonl"
    m.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line, _ in lines) + "\n")
    return str(m), [(i + 1, why) for i, (_, why) in enumerate(lines)]


CFG = DataConfig(max_duration=6.0, output_frame_rate=25.0)


def test_each_problem_has_its_named_reason_on_its_line(bad_corpus):
    m, expected = bad_corpus
    report = validate_manifest(m, CFG, decode=True, policy="skip")
    got = {p.line: p.reason for p in report.problems}
    for line, why in expected:
        if why is None:
            assert line not in got, f"line {line} is fine but got {got.get(line)}"
        else:
            assert got[line].startswith(why), f"line {line}: expected {why!r}, got {got.get(line)!r}"
    assert report.num_total == len(expected) and report.num_skipped == len(got)
    assert [e.line for e in report.entries] == [1, 11]
    assert "60 tokens (+59 repeats)" in got[8]
    assert "max_duration=6.0" in got[9]


def test_header_check_does_not_decode(bad_corpus):
    m, expected = bad_corpus
    report = validate_manifest(m, CFG, policy="skip")
    assert 12 not in {p.line for p in report.problems}  # the truncated FLAC's header is intact


def test_error_policy_lists_every_bad_line(bad_corpus):
    m, expected = bad_corpus
    with pytest.raises(DataError) as err:
        validate_manifest(m, CFG, decode=True)
    msg = str(err.value)
    bad_lines = [line for line, why in expected if why]
    assert len(err.value.problems) == len(bad_lines)
    for line in bad_lines:
        assert f"{m}:{line}: " in msg


def test_unknown_characters_and_ctc_with_a_tokenizer(tmp_path):
    write_wav(tmp_path / "a.wav", 1.0)
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "abc"}) + "\n" +
                 json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "abz\u00e9"}) + "\n")
    tok = CharTokenizer.build(["abc"])
    report = validate_manifest(str(m), CFG, tokenizer=tok, policy="skip")
    assert [p.line for p in report.problems] == [2]
    assert "unknown characters 'z' (U+007A), '\u00e9' (U+00E9)" in report.problems[0].reason
    unk = CharTokenizer.build(["abc"], unk_token="<unk>")
    assert validate_manifest(str(m), CFG, tokenizer=unk).ok


def test_ctc_check_counts_repeats_and_uses_the_fastest_speed(tmp_path):
    write_wav(tmp_path / "a.wav", 1.0)  # 25 output frames at 25 frames/s
    m = tmp_path / "m.jsonl"
    texts = ["ab" * 12, "a" * 13, "ab" * 12 + "a"]  # 24 (fits), 13 + 12 repeats = 25 (fits), 25 (fits)
    m.write_text("".join(json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": t}) + "\n" for t in texts))
    assert validate_manifest(str(m), CFG).ok
    fast = DataConfig(max_duration=6.0, speed_perturb=[1.0, 1.1])  # 1.1x: 22 frames
    report = validate_manifest(str(m), fast, policy="skip")
    assert [p.line for p in report.problems] == [1, 2, 3]


def test_budget_check_accounts_for_slow_speed_perturbation_and_quadratic_cost(tmp_path):
    write_wav(tmp_path / "a.wav", 5.8)
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"audio_filepath": "a.wav", "duration": 5.8, "text": "x"}) + "\n")
    assert validate_manifest(str(m), CFG).ok
    with pytest.raises(DataError, match="too long: 5.80s at speed 0.9"):
        validate_manifest(str(m), DataConfig(max_duration=6.0, speed_perturb=[0.9, 1.0]))
    with pytest.raises(DataError, match="too long"):
        validate_manifest(str(m), DataConfig(max_duration=6.0, quadratic_duration=20))
    with pytest.raises(DataError, match="max_utterance_duration=5.0s"):
        validate_manifest(str(m), DataConfig(max_duration=6.0, max_utterance_duration=5.0))


def test_build_dataloader_applies_the_policy(bad_corpus):
    m, _ = bad_corpus
    with pytest.raises(DataError, match="have problems"):
        build_dataloader(m, DataConfig(max_duration=6.0, num_workers=0), None)
    loader = build_dataloader(m, DataConfig(max_duration=6.0, num_workers=0, bad_data="skip",
                                            validate_decode=True), None)
    assert loader.validation_report.num_skipped == 10
    assert sorted(i for b in loader for i in b["ids"]) == sorted([f"{m}:1", f"{m}:11"])


@pytest.mark.timeout(120)
def test_command_line_prints_problems_and_exits_nonzero(bad_corpus, tmp_path):
    m, expected = bad_corpus
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-m", "ddptrain.data.validate", m, "--max-duration", "6", "--decode"],
                         capture_output=True, text=True, env=env, timeout=100)
    assert run.returncode == 1
    for line, why in expected:
        if why:
            assert f"{m}:{line}: {why}" in run.stdout
    assert "10 of 12 utterance(s) have problems" in run.stdout
    # next to the audio, since relative paths resolve against the manifest's folder
    clean_m = os.path.join(os.path.dirname(m), "clean.jsonl")
    with open(m) as src, open(clean_m, "w") as dst:
        dst.write(src.readline())
    ok = subprocess.run([sys.executable, "-m", "ddptrain.data.validate", clean_m], capture_output=True, text=True,
                        env=env, timeout=100)
    assert ok.returncode == 0 and "1 utterance(s), no problems" in ok.stdout
    assert "RuntimeWarning" not in run.stderr + ok.stderr
