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
