"""ddptrain/data/durations.py: a line without duration gets its audio header's, read once and cached.

Checked: header durations equal the true length for WAV and FLAC; a second read of the manifest
opens no audio file; a touched or rewritten file is read again; a corrupt cache is ignored with a
warning and rebuilt; a header without a frame count is measured by decoding, with a warning; an
unreadable file is a bad line under data.bad_data; the cache is written atomically (no temp file
left, a failed write only warns); the tokenizer, which needs only texts, opens no audio file.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import soundfile as sf

from ddptrain.data import DataConfig, DataError, load_manifest, parse_manifest, validate_manifest
from ddptrain.data import durations
from ddptrain.data.tokenizer import CharTokenizer


def tone(path, seconds, rate=16000, fmt=None):
    n = int(round(seconds * rate))
    sf.write(str(path), 0.1 * np.sin(np.arange(n) / 7.0), rate, format=fmt)
    return n / rate


def write_manifest(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    return str(path)


@pytest.fixture()
def corpus(tmp_path):
    """Three files (WAV 16 kHz, FLAC 22.05 kHz, WAV 8 kHz) and a manifest with no durations."""
    (tmp_path / "wavs").mkdir()
    true = {"a": tone(tmp_path / "wavs" / "a.wav", 1.25), "b": tone(tmp_path / "wavs" / "b.flac", 0.7, 22050),
            "c": tone(tmp_path / "wavs" / "c.wav", 2.0, 8000)}
    rows = [{"audio": f"wavs/{k}.{'flac' if k == 'b' else 'wav'}", "text": k} for k in true]
    return write_manifest(tmp_path / "train.jsonl", rows), true


@pytest.fixture()
def header_reads(monkeypatch):
    """Counts soundfile.info calls: the audio files a manifest read opens."""
    calls = []
    real = sf.info

    def counting(path, *a, **k):
        calls.append(os.path.basename(path))
        return real(path, *a, **k)

    monkeypatch.setattr(sf, "info", counting)
    return calls


def test_header_durations_are_the_true_durations(corpus, header_reads):
    manifest, true = corpus
    entries = load_manifest(manifest)
    assert {e.text: e.duration for e in entries} == pytest.approx(true, abs=1e-12)
    assert [e.is_segment for e in entries] == [False] * 3
    assert sorted(header_reads) == ["a.wav", "b.flac", "c.wav"]
    assert os.path.isfile(durations.cache_path(manifest)) and manifest.endswith("train.jsonl")
    assert durations.cache_path(manifest).endswith("train.durations.json")


def test_a_second_read_opens_no_audio_file_and_a_touched_file_is_read_again(corpus, header_reads):
    manifest, true = corpus
    first = load_manifest(manifest)
    header_reads.clear()
    again = load_manifest(manifest)
    assert [e.duration for e in again] == [e.duration for e in first] and header_reads == []
    # a new modification time alone: that file's header is read again, the others come from the cache
    path = first[0].audio_filepath
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert [e.duration for e in load_manifest(manifest)] == [e.duration for e in first]
    assert header_reads == ["a.wav"]
    # a rewritten file (another length): its new duration
    header_reads.clear()
    new = tone(first[2].audio_filepath, 3.5, 8000)
    assert load_manifest(manifest)[2].duration == pytest.approx(new) and header_reads == ["c.wav"]
    header_reads.clear()
    load_manifest(manifest)
    assert header_reads == []
    assert not [f for f in os.listdir(os.path.dirname(manifest)) if ".tmp" in f]  # written atomically


@pytest.mark.parametrize("garbage", ["{not json", json.dumps({"format": "something else", "files": {}}),
                                     json.dumps({"format": durations.CACHE_FORMAT, "files": {"x": [1, "a", 2]}})])
def test_a_corrupt_cache_is_ignored_with_a_warning_and_rebuilt(corpus, header_reads, caplog, garbage):
    manifest, true = corpus
    load_manifest(manifest)
    with open(durations.cache_path(manifest), "w") as f:
        f.write(garbage)
    header_reads.clear()
    with caplog.at_level(logging.WARNING, logger="ddptrain.data.durations"):
        entries = load_manifest(manifest)
    assert {e.text: e.duration for e in entries} == pytest.approx(true)
    assert len(header_reads) == 3 and "ignoring the duration cache" in caplog.text
    assert durations.cache_path(manifest) in caplog.text
    header_reads.clear()
    load_manifest(manifest)
    assert header_reads == []  # rebuilt


def test_a_header_without_frame_count_is_measured_by_decoding(corpus, monkeypatch, caplog):
    manifest, true = corpus
    real = sf.info

    def unknown_length(path, *a, **k):  # libsndfile's SF_COUNT_MAX: "length not known"
        info = real(path, *a, **k)
        info.frames = 2**63 - 1
        return info

    monkeypatch.setattr(sf, "info", unknown_length)
    with caplog.at_level(logging.WARNING, logger="ddptrain.data.durations"):
        entries = load_manifest(manifest)
    assert {e.text: e.duration for e in entries} == pytest.approx(true, abs=1e-12)
    assert "3 audio file(s) have no length in their header" in caplog.text and "decoding" in caplog.text


def test_unreadable_audio_is_a_bad_line_under_the_bad_data_policy(corpus, header_reads):
    manifest, true = corpus
    folder = os.path.dirname(manifest)
    with open(os.path.join(folder, "wavs", "broken.wav"), "wb") as f:
        f.write(b"RIFF" + os.urandom(64))
    with open(os.path.join(folder, "wavs", "empty.wav"), "wb") as f:
        sf.write(f, np.zeros(0), 16000, format="WAV")
    rows = [json.loads(x) for x in open(manifest)]
    rows[1:1] = [{"audio": "wavs/broken.wav", "text": "x"}, {"audio": "wavs/missing.wav", "text": "y", "id": "m"},
                 {"audio": "wavs/empty.wav", "text": "z"}]
    bad = write_manifest(os.path.join(folder, "bad.jsonl"), rows)
    entries, problems = parse_manifest(bad)
    assert [e.text for e in entries] == ["a", "b", "c"]
    assert [(p.source, p.line) for p in problems] == [(bad, 2), (bad, 3), (bad, 4)]
    assert all(p.reason.startswith("missing key(s) duration and the audio header cannot give it: ") for p in problems)
    assert "unreadable audio" in problems[0].reason and "broken.wav" in problems[0].reason
    assert "missing audio file" in problems[1].reason and problems[1].id == "m"
    assert "zero-length audio" in problems[2].reason
    with pytest.raises(DataError, match=rf"bad.jsonl:3 \(id m\): missing key\(s\) duration"):
        load_manifest(bad)
    with pytest.raises(DataError, match="data.bad_data=skip would skip them"):
        validate_manifest(bad, DataConfig(features="raw", output_frame_rate=0))
    report = validate_manifest(bad, DataConfig(features="raw", output_frame_rate=0), policy="skip")
    assert [e.text for e in report.entries] == ["a", "b", "c"] and report.num_skipped == 3
    # the bad files are not cached: they are tried again (a fixed file is then read)
    header_reads.clear()
    parse_manifest(bad)
    assert sorted(header_reads) == ["broken.wav", "empty.wav"]


def test_many_files_are_read_in_parallel_with_the_same_result(tmp_path, monkeypatch, header_reads):
    rows, true = [], {}
    for i in range(12):
        true[str(i)] = tone(tmp_path / f"{i}.wav", 0.1 + 0.05 * i)
        rows.append({"audio_filepath": f"{i}.wav", "text": str(i)})
    manifest = write_manifest(tmp_path / "m.jsonl", rows)
    monkeypatch.setattr(durations, "PARALLEL_FROM", 4)
    assert {e.text: e.duration for e in load_manifest(manifest)} == pytest.approx(true)
    assert len(header_reads) == 12


def test_a_cache_that_cannot_be_written_only_warns(corpus, monkeypatch, caplog):
    manifest, true = corpus

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with caplog.at_level(logging.WARNING, logger="ddptrain.data.durations"):
        entries = load_manifest(manifest)
    assert {e.text: e.duration for e in entries} == pytest.approx(true)
    assert "cannot write the duration cache" in caplog.text
    assert not os.path.exists(durations.cache_path(manifest))
    assert not [f for f in os.listdir(os.path.dirname(manifest)) if ".tmp" in f]


def test_lines_with_durations_open_nothing_and_the_tokenizer_needs_no_header(corpus, header_reads):
    manifest, true = corpus
    rows = [json.loads(x) for x in open(manifest)]
    given = write_manifest(os.path.join(os.path.dirname(manifest), "given.jsonl"),
                           [{**r, "duration": 9.0} for r in rows])
    assert [e.duration for e in load_manifest(given)] == [9.0] * 3
    tok = CharTokenizer.build(manifest)
    assert tok.encode("abc") and header_reads == []
    assert not os.path.exists(durations.cache_path(given)) and not os.path.exists(durations.cache_path(manifest))


def test_a_stale_cache_is_named_as_the_culprit_with_the_file_to_delete(corpus):
    """A file rewritten with its size and time kept: the cached duration is stale, and the
    validator's mismatch names the cache (the manifest line has no duration), not the manifest."""
    manifest, true = corpus
    entries = load_manifest(manifest)
    path = entries[0].audio_filepath
    st = os.stat(path)
    sf.write(path, np.zeros(int(1.25 * 16000)), 8000)  # 2.5 s at 8 kHz, the same number of bytes
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    cache = durations.cache_path(manifest)
    with pytest.raises(DataError) as err:
        validate_manifest(manifest, DataConfig())
    msg = str(err.value)
    assert (f"duration mismatch: the duration cache {cache} says 1.250s (the line has no duration), {path} has "
            f"2.500s: delete {cache} (it is rebuilt from the audio headers)") in msg, msg
    assert "the manifest says" not in msg
    os.remove(cache)
    assert validate_manifest(manifest, DataConfig()).num_skipped == 0
