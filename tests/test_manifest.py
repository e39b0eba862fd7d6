"""JSONL manifests: fields, path resolution, ids, and errors that name file and line."""

import json
import os

import pytest

from ddptrain.data import DataError, load_manifest, parse_manifest


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def test_fields_relative_paths_and_ids(tmp_path):
    sub = tmp_path / "corpus"
    sub.mkdir()
    m = write_lines(sub / "train.jsonl", [
        {"audio_filepath": "audio/a.flac", "duration": 1.5, "text": "hello"},
        "",
        {"audio_filepath": "/abs/b.wav", "duration": 2, "text": "x", "offset": 0.5, "speaker": 12,
         "lang": "en", "id": "utt-b", "custom": [1, 2]},
    ])
    a, b = load_manifest(m)
    assert a.audio_filepath == os.path.join(str(sub), "audio", "a.flac")
    assert (a.duration, a.text, a.offset, a.is_segment, a.speaker, a.lang) == (1.5, "hello", 0.0, False, None, None)
    assert a.id == f"{m}:1" and a.line == 1 and a.source == m
    assert b.audio_filepath == "/abs/b.wav"
    assert (b.offset, b.is_segment, b.speaker, b.lang, b.id, b.line) == (0.5, True, "12", "en", "utt-b", 3)
    assert b.extra == {"custom": [1, 2]}


def test_relative_paths_resolve_against_the_manifest_folder_not_the_cwd(tmp_path, monkeypatch):
    m = write_lines(tmp_path / "m.jsonl", [{"audio_filepath": "x.wav", "duration": 1, "text": "a"}])
    monkeypatch.chdir("/")
    assert load_manifest(os.path.relpath(m, "/"))[0].audio_filepath == str(tmp_path / "x.wav")


def test_several_manifests_keep_order(tmp_path):
    m1 = write_lines(tmp_path / "a.jsonl", [{"audio_filepath": "1.wav", "duration": 1, "text": "a"}])
    m2 = write_lines(tmp_path / "b.jsonl", [{"audio_filepath": "2.wav", "duration": 1, "text": "b"}])
    assert [e.text for e in load_manifest([m1, m2])] == ["a", "b"]
    assert [e.text for e in load_manifest(f"{m2},{m1}")] == ["b", "a"]


BAD_LINES = [
    ('{"audio_filepath": "a.wav", "duration": 1, "text": "a"', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ({"duration": 1, "text": "a"}, "missing key(s) audio_filepath"),
    ({"audio_filepath": "a.wav", "text": "a"}, "missing key(s) duration"),
    ({"audio_filepath": "a.wav", "duration": "1.0", "text": "a"}, "duration must be a number"),
    ({"audio_filepath": "a.wav", "duration": True, "text": "a"}, "duration must be a number"),
    ({"audio_filepath": "a.wav", "duration": -2, "text": "a"}, "duration must be > 0"),
    ('{"audio_filepath": "a.wav", "duration": NaN, "text": "a"}', "duration must be finite"),
    ({"audio_filepath": "a.wav", "duration": 1, "text": None}, "text must be a string"),
    ({"audio_filepath": "", "duration": 1, "text": "a"}, "audio_filepath must be a non-empty string"),
    ({"audio_filepath": "a.wav", "duration": 1, "text": "a", "offset": -1}, "offset must be >= 0"),
    ({"audio_filepath": "a.wav", "duration": 1, "text": "a", "speaker": {"x": 1}}, "speaker must be"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_each_bad_line_names_file_line_and_reason(tmp_path, line, reason):
    good = {"audio_filepath": "a.wav", "duration": 1, "text": "ok"}
    m = write_lines(tmp_path / "m.jsonl", [good, line, good])
    with pytest.raises(DataError) as err:
        load_manifest(m)
    assert f"{m}:2: " in str(err.value) and reason in str(err.value)
    assert [(p.source, p.line) for p in err.value.problems] == [(m, 2)]


def test_every_bad_line_is_listed_at_once(tmp_path):
    good = {"audio_filepath": "a.wav", "duration": 1, "text": "ok"}
    m = write_lines(tmp_path / "m.jsonl", [good, "{", good, "nope", {"text": "x"}])
    entries, problems = parse_manifest(m)
    assert len(entries) == 2 and [p.line for p in problems] == [2, 4, 5]
    with pytest.raises(DataError, match="3 bad manifest line"):
        load_manifest(m)


def test_duplicate_ids_and_missing_manifest(tmp_path):
    e = {"audio_filepath": "a.wav", "duration": 1, "text": "ok", "id": "u1"}
    m = write_lines(tmp_path / "m.jsonl", [e, e])
    with pytest.raises(DataError, match=r"m.jsonl:2 \(id u1\): duplicate id \(first used at .*m.jsonl:1\)"):
        load_manifest(m)
    with pytest.raises(DataError, match="manifest not found"):
        load_manifest(tmp_path / "nope.jsonl")


def test_unicode_line_separators_inside_text_and_a_bom(tmp_path):
    """U+2028/U+2029/U+0085 are legal raw inside JSON strings: the line stays one line and the
    line numbers after it stay right; a UTF-8 BOM and CRLF line ends are accepted."""
    good = {"audio_filepath": "a.wav", "duration": 1, "text": "ok"}
    odd = {"audio_filepath": "b.wav", "duration": 1, "text": "one\u2028two\u2029three\x85four"}
    m = tmp_path / "m.jsonl"
    body = "\r\n".join([json.dumps(good), json.dumps(odd, ensure_ascii=False), "not json", json.dumps(good)])
    m.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    entries, problems = parse_manifest(str(m))
    assert [e.line for e in entries] == [1, 2, 4]
    assert entries[1].text == odd["text"]
    assert [p.line for p in problems] == [3]


# ------------------------------------------------------------------ spellings: data as users have it


@pytest.mark.parametrize("audio_key", ["audio_filepath", "audio", "audio_path"])
@pytest.mark.parametrize("text_key", ["text", "transcript", "transcription", "sentence"])
def test_every_spelling_of_audio_and_text(tmp_path, audio_key, text_key):
    m = write_lines(tmp_path / "m.jsonl", [{audio_key: "a.wav", text_key: "hello", "duration": 1.0}])
    (e,) = load_manifest(m)
    assert (e.audio_filepath, e.text, e.extra) == (str(tmp_path / "a.wav"), "hello", {})


@pytest.mark.parametrize("key, field, value", [("id", "id", "u1"), ("utt_id", "id", "u1"),
                                               ("speaker", "speaker", "s1"), ("speaker_id", "speaker", "s1"),
                                               ("lang", "lang", "en"), ("language", "lang", "en"),
                                               ("dataset_id", "dataset_id", 3)])
def test_every_spelling_of_the_optional_fields(tmp_path, key, field, value):
    m = write_lines(tmp_path / "m.jsonl", [{"audio": "a.wav", "text": "t", "duration": 1, key: value}])
    (e,) = load_manifest(m)
    assert getattr(e, field) == value and e.extra == {}


def test_upstream_voxcpm_jsonl_reads_unchanged(tmp_path):
    """upstream's {"audio", "text", "ref_audio", "duration", "dataset_id"}: the audio (also HF's
    {"path": ...}) and ref_audio resolve against the manifest folder; dataset_id stays an integer."""
    m = write_lines(tmp_path / "train.jsonl", [
        {"audio": "wavs/a.wav", "text": "one", "ref_audio": "refs/r.wav", "duration": 2.5, "dataset_id": 0},
        {"audio": {"path": "/abs/b.wav"}, "text": "two", "duration": 1.0, "dataset_id": 1, "ref_audio": None},
        {"audio": "wavs/c.wav", "text": "three", "duration": 1.5, "emotion": "calm"},
    ])
    a, b, c = load_manifest(m)
    assert (a.audio_filepath, a.ref_audio, a.dataset_id, a.duration) == (
        str(tmp_path / "wavs" / "a.wav"), str(tmp_path / "refs" / "r.wav"), 0, 2.5)
    assert (b.audio_filepath, b.ref_audio, b.dataset_id) == ("/abs/b.wav", None, 1)
    assert (c.ref_audio, c.dataset_id, c.extra) == (None, None, {"emotion": "calm"})
    assert a.extra == {} and b.extra == {} and a.id == f"{m}:1"


def test_two_spellings_of_one_field_must_agree(tmp_path):
    m = write_lines(tmp_path / "m.jsonl", [
        {"audio": "a.wav", "audio_filepath": "./a.wav", "text": "x", "sentence": "x", "duration": 1},  # agree
        {"audio": "a.wav", "audio_filepath": "b.wav", "text": "x", "duration": 1},
        {"audio": "a.wav", "text": "x", "transcript": "y", "duration": 1},
        {"audio": "a.wav", "text": "x", "duration": 1, "lang": "en", "language": "de"},
    ])
    entries, problems = parse_manifest(m)
    assert [e.line for e in entries] == [1] and entries[0].extra == {}
    assert [p.line for p in problems] == [2, 3, 4]
    assert "audio_filepath and audio disagree ('b.wav' vs 'a.wav')" in problems[0].reason
    assert "data.fields.audio" in problems[0].reason
    assert "text and transcript disagree ('x' vs 'y')" in problems[1].reason
    assert "lang and language disagree" in problems[2].reason


def test_a_line_without_audio_or_text_names_file_line_its_keys_and_the_spellings(tmp_path):
    m = write_lines(tmp_path / "m.jsonl", [{"audio": "a.wav", "text": "ok", "duration": 1},
                                           {"wav": "a.wav", "normalized": "x", "duration": 1}])
    with pytest.raises(DataError) as err:
        load_manifest(m)
    msg = str(err.value)
    assert f"{m}:2: missing key(s) audio_filepath (or audio, audio_path), text (or transcript, transcription, " \
           "sentence); the line has wav, normalized, duration" in msg
    assert "data.fields" in msg


def test_data_fields_names_keys_of_other_names(tmp_path):
    """data.fields: {audio: wav, text: normalized}: those keys are read, the usual spellings of
    those fields pass through as extra keys (no disagreement), and the message names data.fields."""
    import ddptrain
    from ddptrain.data.tokenizer import CharTokenizer
    from ddptrain.data.validate import read_entries

    m = write_lines(tmp_path / "m.jsonl", [{"wav": "a.wav", "normalized": "hello", "text": "Hello!", "duration": 1},
                                           {"wav": "b.wav", "text": "no normalized key", "duration": 1}])
    cfg = ddptrain.load_config(None, ["data.fields={audio: wav, text: normalized}"]).data
    assert cfg.fields == {"audio": "wav", "text": "normalized"}
    entries, problems = read_entries(m, cfg.fields)
    assert (entries[0].audio_filepath, entries[0].text, entries[0].extra) == (
        str(tmp_path / "a.wav"), "hello", {"text": "Hello!"})
    assert [p.line for p in problems] == [2]
    assert "missing key(s) normalized (data.fields.text); the line has wav, text, duration" in problems[0].reason
    assert set(CharTokenizer.build(m, fields=cfg.fields).encode("hello")) and \
        "!" not in CharTokenizer.build(m, fields=cfg.fields).vocab
    with pytest.raises(ddptrain.ConfigError, match="unknown field 'wave'"):
        ddptrain.load_config(None, ["data.fields={wave: x}"])
    with pytest.raises(DataError, match="unknown field 'wave'"):
        load_manifest(m, {"wave": "x"})


def test_null_optional_values_are_absent_and_a_segment_needs_its_duration(tmp_path):
    m = write_lines(tmp_path / "m.jsonl", [
        {"audio": "a.wav", "text": "t", "duration": 1, "id": None, "speaker": None, "offset": None},
        {"audio": "a.wav", "text": "t", "offset": 0.5},
    ])
    entries, problems = parse_manifest(m)
    assert (entries[0].id, entries[0].speaker, entries[0].is_segment) == (f"{m}:1", None, False)
    assert [p.line for p in problems] == [2]
    assert "missing key(s) duration: a segment line (one with offset) must give its length" in problems[0].reason


def test_upstream_keys_reach_the_dataset_item_and_the_batch(tmp_path):
    """dataset_id and ref_audio pass through SpeechDataset into the batch (None where a line has none)."""
    import numpy as np
    import soundfile as sf

    from ddptrain.data import DataConfig, build_dataloader

    for name, n in (("a", 8000), ("b", 12000), ("r", 4000)):
        sf.write(str(tmp_path / f"{name}.wav"), 0.1 * np.sin(np.arange(n) / 5.0), 16000)
    m = write_lines(tmp_path / "up.jsonl", [{"audio": "a.wav", "text": "one", "ref_audio": "r.wav", "dataset_id": 2},
                                            {"audio": "b.wav", "text": "two"}])
    cfg = DataConfig(features="raw", num_workers=0, shuffle=False, max_duration=100, output_frame_rate=0)
    loader = build_dataloader(m, cfg, None, train=False)
    item = loader.dataset[0]
    assert (item["dataset_id"], item["ref_audio"]) == (2, str(tmp_path / "r.wav"))
    assert (loader.dataset[1]["dataset_id"], loader.dataset[1]["ref_audio"]) == (None, None)
    got, lens = {}, {}
    for batch in loader:
        got.update(zip(batch["texts"], zip(batch["dataset_ids"], batch["ref_audios"])))
        lens.update(zip(batch["texts"], batch["audio_lens"].tolist()))
    assert got == {"one": (2, str(tmp_path / "r.wav")), "two": (None, None)}
    assert lens == {"one": 8000, "two": 12000} and [e.duration for e in load_manifest(m)] == [0.5, 0.75]


def test_the_command_lines_take_field(tmp_path, capsys):
    """--field FIELD=KEY on `python -m ddptrain.data.validate` and `python -m ddptrain.data.shards`."""
    import numpy as np
    import soundfile as sf

    from ddptrain.data import load_shards, shards, validate

    sf.write(str(tmp_path / "a.wav"), 0.1 * np.sin(np.arange(8000) / 5.0), 16000)
    m = write_lines(tmp_path / "m.jsonl", [{"wav": "a.wav", "normalized": "hello", "text": "Hello!"}])
    assert validate.main([m, "--output-frame-rate", "0", "--field", "audio=wav", "--field", "text=normalized"]) == 0
    assert "1 utterance(s), no problems" in capsys.readouterr().out
    assert validate.main([m, "--output-frame-rate", "0"]) == 1
    assert f"{m}:1: bad line: missing key(s) audio_filepath" in capsys.readouterr().out
    assert validate.main([m, "--field", "wave=x"]) == 1 and "unknown field 'wave'" in capsys.readouterr().err
    assert shards.main([m, str(tmp_path / "sh"), "--field", "audio=wav", "--field", "text=normalized"]) == 0
    s = load_shards(str(tmp_path / "sh"))
    assert len(s) == 1 and float(s.duration[0]) == 0.5


def test_a_comma_inside_a_manifest_path(tmp_path):
    """Commas separate manifest paths: a path that exists as a whole is one path, ``\\,`` escapes a
    comma, and a fragment that is not found names the file with the comma it was cut from."""
    line = {"audio_filepath": "a.wav", "duration": 1, "text": "ok"}
    comma = write_lines(tmp_path / "x,y.jsonl", [dict(line, id="c")])
    other = write_lines(tmp_path / "z.jsonl", [dict(line, id="z")])
    assert [e.id for e in load_manifest(comma)] == ["c"]  # exists as a whole: not split
    escaped = comma.replace(",", "\\,")
    assert [e.id for e in load_manifest(f"{escaped},{other}")] == ["c", "z"]
    with pytest.raises(DataError) as err:
        load_manifest(f"{comma},{other}")
    assert str(err.value) == (f"manifest not found: {tmp_path}/x (a comma separates manifest paths, and {comma} "
                              f"exists: write it as {escaped})")
    with pytest.raises(DataError, match=rf"manifest not found: {tmp_path}/nope.jsonl$"):
        load_manifest(f"{tmp_path}/nope.jsonl,{other}")
