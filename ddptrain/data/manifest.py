"""JSONL manifests, as users have them: one utterance per line, keys in any common spelling.

Each line is a JSON object. One mapping (:data:`FIELDS`) says which keys spell each field:
the audio path (``audio_filepath`` as NeMo, ``audio`` as upstream VoxCPM and HF, also as
``{"path": ...}``, or ``audio_path``; a relative path resolves against the folder of the manifest,
so a data set folder can be moved as a whole), the text (``text``, ``transcript``,
``transcription``, ``sentence``), ``duration`` (seconds), and optionally ``offset`` (seconds into
the file: the line is then a *segment* of a longer recording), ``id``, ``speaker``, ``lang``,
``dataset_id`` and ``ref_audio`` (upstream VoxCPM's; a path, resolved like the audio). So
upstream VoxCPM's ``{"audio", "text", "ref_audio", "duration", "dataset_id"}`` and the NeMo, Common
Voice and HF exports read unchanged; ``data.fields: {audio: wav, text: normalized}`` names keys of
other names (then only that key is read for the field). Other keys are kept in
``ManifestEntry.extra``. Two spellings of one field that disagree are a bad line; so is a line
with none of a required field's spellings (the message lists the keys the line has).

A line without ``duration`` gets its audio file's length from the file header, read once and
cached next to the manifest (ddptrain/data/durations.py); a file whose header cannot be read is a
bad line like any other, under ``data.bad_data``.

Every entry gets a stable id: its ``id`` field, or ``"<manifest path as given>:<line>"``. The
Trainer quotes ids in error messages, so a bad utterance can always be found again.

A bad line is a :class:`DataError` that names the file and line; all bad lines of a file are
listed at once (fixing them one run at a time is the thing we want to spare the user).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from ddptrain.data.durations import cache_path, header_durations
from ddptrain.data.errors import DataError, Problem

PathOrPaths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

# The one key mapping: each field of a line and the keys it may be spelled with, the canonical
# (NeMo) spelling first. ``data.fields: {field: key}`` replaces a field's spellings with one key
# of the user's (then the usual spellings of that field are extra keys, passed through).
FIELDS: dict[str, tuple[str, ...]] = {
    "audio": ("audio_filepath", "audio", "audio_path"),  # NeMo; upstream VoxCPM / HF ("audio": {"path": ...} too)
    "text": ("text", "transcript", "transcription", "sentence"),  # sentence: Common Voice
    "duration": ("duration",),  # seconds; missing: read from the audio header (durations.py)
    "offset": ("offset",),  # seconds into the file: the line is a segment
    "id": ("id", "utt_id"),
    "speaker": ("speaker", "speaker_id"),
    "lang": ("lang", "language"),
    "dataset_id": ("dataset_id",),  # upstream VoxCPM: which data set (an integer there) the line belongs to
    "ref_audio": ("ref_audio",),  # upstream VoxCPM2: a reference recording (a path, resolved like audio)
}
REQUIRED = ("audio", "text")


def field_spellings(fields: Optional[Mapping[str, str]] = None) -> dict[str, tuple[str, ...]]:
    """:data:`FIELDS` with ``data.fields``' keys in place of the usual spellings.

    Raises:
        DataError: ``fields`` names a field that does not exist, or gives it an empty key.
    """
    spellings = dict(FIELDS)
    for name, key in (fields or {}).items():
        if name not in FIELDS:
            raise DataError(f"data.fields: unknown field {name!r} (fields: {', '.join(FIELDS)})")
        if not isinstance(key, str) or not key.strip():
            raise DataError(f"data.fields: field {name!r} needs a non-empty key, got {key!r}")
        spellings[name] = (key,)
    return spellings


def parse_field_args(args: Sequence[str]) -> dict[str, str]:
    """``["audio=wav", "text=normalized"]`` (a command line's ``--field``) -> ``data.fields``.

    Raises:
        DataError: an argument without ``=``, or an unknown field.
    """
    out = {}
    for a in args:
        name, eq, key = a.partition("=")
        if not eq:
            raise DataError(f"--field {a!r}: expected FIELD=KEY, e.g. audio=wav")
        out[name.strip()] = key.strip()
    field_spellings(out)
    return out



@dataclass
class ManifestEntry:
    """One utterance of a manifest."""

    id: str  # stable id: the line's "id" field, or "<manifest>:<line>"
    audio_filepath: str  # absolute (or as-given absolute) path of the audio file
    duration: float  # seconds (of the segment, when offset is set)
    text: str  # transcript
    offset: float = 0.0  # seconds into the file where the utterance starts
    is_segment: bool = False  # the line had an "offset" key: duration is a slice, not the file
    speaker: Optional[str] = None
    lang: Optional[str] = None
    dataset_id: Union[int, str, None] = None  # upstream VoxCPM's data-set index, as the line gives it
    ref_audio: Optional[str] = None  # absolute path of the reference recording (upstream VoxCPM2's ref_audio)
    source: str = ""  # manifest path as given ("" when built in memory)
    line: int = 0  # 1-based line in ``source``
    extra: dict = field(default_factory=dict)  # any other keys of the line
    duration_from: str = ""  # the line had no duration: the cache file it came from (durations.py), for messages

    def where(self) -> str:
        """``file:line (id ...)`` for messages."""
        return str(Problem(self.source, self.line, self.id, "")).rstrip(": ")


def split_paths(paths: PathOrPaths) -> list[str]:
    """A path, a comma-separated string of paths, or a list of paths -> list of paths.

    A comma inside a path is written ``\\,``; a string that names an existing file or folder as a
    whole is that one path (commas and all).
    """
    if isinstance(paths, (str, os.PathLike)):
        text = os.fspath(paths)
        if "," in text and os.path.exists(text.strip()):
            return [text.strip()]
        return [p.strip().replace("\\,", ",") for p in re.split(r"(?<!\\),", text) if p.strip()]
    return [os.fspath(p) for p in paths]


def _comma_hint(path: str) -> str:
    """For a manifest not found: the file it is the start of, if one has a comma after it there
    (``data/x,y.jsonl`` cut at its comma into ``data/x``), and how to write that comma."""
    folder, name = os.path.split(path)
    try:
        cut = sorted(n for n in os.listdir(folder or ".") if n.startswith(name + ","))
    except OSError:
        return ""
    if not cut:
        return ""
    whole = os.path.join(folder, cut[0])
    return f" (a comma separates manifest paths, and {whole} exists: write it as {whole.replace(',', chr(92) + ',')})"


def parse_manifest(path: Union[str, os.PathLike], fields: Optional[Mapping[str, str]] = None,
                   num_threads: int = 8, read_durations: bool = True) -> tuple[list[ManifestEntry], list[Problem]]:
    """Parse one manifest, collecting bad lines instead of stopping at the first.

    Args:
        path: the manifest.
        fields: ``data.fields``: ``{field: key}`` for keys of other names than :data:`FIELDS`.
        num_threads: parallel header reads for lines without ``duration``.
        read_durations: False: such lines keep ``duration`` NaN and no audio file is opened (for
            a reader of the texts alone, the tokenizer's build).

    Returns:
        ``(entries, problems)``: the good lines and one :class:`Problem` per bad line (a line
        without ``duration`` whose audio header cannot be read is one).

    Raises:
        DataError: the manifest file itself cannot be opened or is not UTF-8 text; ``fields``
            names an unknown field.
    """
    path = os.fspath(path)
    fields = dict(fields or {})
    spellings = field_spellings(fields)
    base = os.path.dirname(os.path.abspath(path))
    entries: list[ManifestEntry] = []
    problems: list[Problem] = []
    try:
        # split on "\n" only: str.splitlines() also splits on U+2028, U+2029 and U+0085, which
        # JSON allows raw inside strings (json.dumps(..., ensure_ascii=False) writes them), and
        # would cut a good line in two and shift every later line number. utf-8-sig: a BOM
        # (Windows editors) is dropped, not reported as invalid JSON on line 1.
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise DataError(f"manifest not found: {path}{_comma_hint(path)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read manifest {path}: {e}") from None
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue  # blank lines (e.g. a trailing newline pair) are harmless
        entry, reason = _parse_line(raw, path, lineno, base, spellings, fields)
        if entry is None:
            problems.append(Problem(path, lineno, _id_hint(raw, spellings), reason))
        else:
            entries.append(entry)
    unknown = [e for e in entries if math.isnan(e.duration)]
    if unknown and read_durations:
        seconds, unreadable = header_durations([e.audio_filepath for e in unknown], path, num_threads)
        cache = cache_path(path)
        for e in unknown:
            if e.audio_filepath in seconds:
                e.duration, e.duration_from = seconds[e.audio_filepath], cache
        key = spellings["duration"][0]
        problems += [Problem(e.source, e.line, e.id, f"missing key(s) {key} and the audio header cannot give it: "
                             f"{unreadable[e.audio_filepath]}") for e in unknown if e.audio_filepath in unreadable]
        problems.sort(key=lambda p: p.line)
        entries = [e for e in entries if not math.isnan(e.duration)]
    return entries, problems


def load_manifest(paths: PathOrPaths, fields: Optional[Mapping[str, str]] = None) -> list[ManifestEntry]:
    """Read one or more manifests.

    Args:
        paths: a path, a comma-separated string of paths, or a list of paths. Entries keep
            the order of the files and of their lines.
        fields: ``data.fields`` (keys of other names, see :data:`FIELDS`).

    Returns:
        The entries, in order.

    Raises:
        DataError: any line is malformed (every bad line is listed, as ``file:line: reason``),
            a manifest is missing, or two entries share an id.
    """
    entries: list[ManifestEntry] = []
    problems: list[Problem] = []
    for path in split_paths(paths):
        got, bad = parse_manifest(path, fields)
        entries += got
        problems += bad
    problems += duplicate_id_problems(entries)
    if problems:
        raise DataError.from_problems(f"{len(problems)} bad manifest line(s):", problems)
    return entries


def duplicate_id_problems(entries: Iterable[ManifestEntry]) -> list[Problem]:
    """One problem per entry whose id was already used by an earlier entry."""
    first: dict[str, ManifestEntry] = {}
    problems = []
    for e in entries:
        if e.id in first:
            p = first[e.id]
            problems.append(Problem(e.source, e.line, e.id, f"duplicate id (first used at {p.source}:{p.line})"))
        else:
            first[e.id] = e
    return problems


def _pick(obj: dict, name: str, spellings: dict, same: Callable = lambda v: v) -> tuple[list[str], Any, str]:
    """``(keys, value, why)`` of one field in a line: the keys it is spelled with (the one read
    first; none: absent) and its value; ``why`` when two spellings disagree (``same`` maps a value
    to what is compared)."""
    keys = [k for k in spellings[name] if k in obj]
    given = [k for k in keys if obj[k] is not None] or keys  # a null spelling beside a real one says nothing
    if not given:
        return [], None, ""
    first = given[0]
    for k in given[1:]:
        if same(obj[k]) != same(obj[first]):
            return keys, None, (f"{first} and {k} disagree ({obj[first]!r} vs {obj[k]!r}): keep one, or name the "
                                f"one to read with data.fields.{name}")
    return [first] + [k for k in keys if k != first], obj[first], ""


def _missing(names: Sequence[str], spellings: dict, fields: Mapping[str, str], obj: dict) -> str:
    parts = []
    for n in names:
        canonical, *others = spellings[n]
        parts.append(f"{canonical} (data.fields.{n})" if n in fields else
                     canonical + (f" (or {', '.join(others)})" if others else ""))
    return (f"missing key(s) {', '.join(parts)}; the line has {', '.join(map(str, obj)) or 'no keys'} "
            "(data.fields names other keys, e.g. data.fields.audio=wav)")


def _path_value(value, key: str) -> tuple[Optional[str], str]:
    """An audio path as a manifest gives it: a string, or HF's ``{"path": ...}``."""
    if isinstance(value, dict):
        value = value.get("path")
    if not isinstance(value, str) or not value:
        return None, f"{key} must be a non-empty string (or {{\"path\": ...}}), got {value!r}"
    return value, ""


def _resolve(path: str, base: str) -> str:
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def _parse_line(raw: str, path: str, lineno: int, base: str, spellings: dict,
                fields: Mapping[str, str]) -> tuple[Optional[ManifestEntry], str]:
    """One line -> an entry (``duration`` NaN when the line has none: read from the header later)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    got, used = {}, set()  # field -> (key read, value); every key of a field (not passed through as extra)
    for name in FIELDS:
        same = (lambda v: _resolve(_path_value(v, "")[0] or "", base)) if name in ("audio", "ref_audio") else \
            (lambda v: v)
        keys, value, why = _pick(obj, name, spellings, same)
        if why:
            return None, why
        if keys:
            got[name] = (keys[0], value)
            used.update(keys)
    missing = [n for n in REQUIRED if n not in got]
    if missing:
        return None, _missing(missing, spellings, fields, obj)
    audio, why = _path_value(*got["audio"][::-1])
    if why:
        return None, why
    duration = math.nan
    if got.get("duration", (0, None))[1] is not None:
        duration, why = _seconds(got["duration"][1], got["duration"][0])
        if why:
            return None, why
        if duration <= 0:
            return None, f"{got['duration'][0]} must be > 0, got {got['duration'][1]!r}"
    offset, segment = 0.0, got.get("offset", (0, None))[1] is not None
    if segment:
        offset, why = _seconds(got["offset"][1], got["offset"][0])
        if why:
            return None, why
        if offset < 0:
            return None, f"{got['offset'][0]} must be >= 0, got {got['offset'][1]!r}"
        if math.isnan(duration):
            return None, (f"missing key(s) {spellings['duration'][0]}: a segment line (one with "
                          f"{got['offset'][0]}) must give its length")
    text_key, text = got["text"]
    if not isinstance(text, str):
        return None, f"{text_key} must be a string, got {type(text).__name__}"
    for name in ("speaker", "lang", "id", "dataset_id"):
        key, value = got.get(name, (name, None))
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
            return None, f"{key} must be a string or an integer, got {type(value).__name__}"
    ref_audio = got.get("ref_audio", ("", None))[1]
    if ref_audio is not None and ref_audio != "":
        ref_audio, why = _path_value(ref_audio, got["ref_audio"][0])
        if why:
            return None, why
        ref_audio = _resolve(ref_audio, base)

    def opt(name):
        value = got.get(name, (None, None))[1]
        return None if value is None else str(value)

    return ManifestEntry(
        id=opt("id") or f"{path}:{lineno}",
        audio_filepath=_resolve(audio, base),
        duration=duration,
        text=text,
        offset=offset,
        is_segment=segment,
        speaker=opt("speaker"),
        lang=opt("lang"),
        dataset_id=got.get("dataset_id", (None, None))[1],
        ref_audio=ref_audio or None,
        source=path,
        line=lineno,
        extra={k: v for k, v in obj.items() if k not in used},
    ), ""


def _seconds(value, key: str) -> tuple[float, str]:
    # bool is an int subclass; "duration": true is a bug, not one second
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0, f"{key} must be a number of seconds, got {value!r}"
    if not math.isfinite(value):
        return 0.0, f"{key} must be finite, got {value!r}"
    return float(value), ""


def _id_hint(raw: str, spellings: dict) -> str:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return ""
    key = next((k for k in spellings["id"] if isinstance(obj, dict) and obj.get(k) is not None), None)
    return str(obj[key]) if key is not None else ""
