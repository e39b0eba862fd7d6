"""NeMo-style JSONL manifests: one utterance per line.

Each line is a JSON object with ``audio_filepath`` (a relative path resolves against the folder
of the manifest, so a data set folder can be moved as a whole), ``duration`` (seconds) and
``text``; optionally ``offset`` (seconds into the file: the line is then a *segment* of a longer
recording), ``speaker``, ``lang`` and ``id``. Other keys are kept in ``ManifestEntry.extra``.

Every entry gets a stable id: its ``id`` field, or ``"<manifest path as given>:<line>"``. The
Trainer quotes ids in error messages, so a bad utterance can always be found again.

A bad line is a :class:`DataError` that names the file and line; all bad lines of a file are
listed at once (fixing them one run at a time is the thing we want to spare the user).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

from ddptrain.data.errors import DataError, Problem

PathOrPaths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


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
    source: str = ""  # manifest path as given ("" when built in memory)
    line: int = 0  # 1-based line in ``source``
    extra: dict = field(default_factory=dict)  # any other keys of the line

    def where(self) -> str:
        """``file:line (id ...)`` for messages."""
        return str(Problem(self.source, self.line, self.id, "")).rstrip(": ")


def split_paths(paths: PathOrPaths) -> list[str]:
    """A path, a comma-separated string of paths, or a list of paths -> list of paths."""
    if isinstance(paths, (str, os.PathLike)):
        return [p.strip() for p in os.fspath(paths).split(",") if p.strip()]
    return [os.fspath(p) for p in paths]


def parse_manifest(path: Union[str, os.PathLike]) -> tuple[list[ManifestEntry], list[Problem]]:
    """Parse one manifest, collecting bad lines instead of stopping at the first.

    Returns:
        ``(entries, problems)``: the good lines and one :class:`Problem` per bad line.

    Raises:
        DataError: the manifest file itself cannot be opened or is not UTF-8 text.
    """
    path = os.fspath(path)
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
        raise DataError(f"manifest not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read manifest {path}: {e}") from None
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue  # blank lines (e.g. a trailing newline pair) are harmless
        entry, reason = _parse_line(raw, path, lineno, base)
        if entry is None:
            problems.append(Problem(path, lineno, _id_hint(raw), reason))
        else:
            entries.append(entry)
    return entries, problems


def load_manifest(paths: PathOrPaths) -> list[ManifestEntry]:
    """Read one or more manifests.

    Args:
        paths: a path, a comma-separated string of paths, or a list of paths. Entries keep
            the order of the files and of their lines.

    Returns:
        The entries, in order.

    Raises:
        DataError: any line is malformed (every bad line is listed, as ``file:line: reason``),
            a manifest is missing, or two entries share an id.
    """
    entries: list[ManifestEntry] = []
    problems: list[Problem] = []
    for path in split_paths(paths):
        got, bad = parse_manifest(path)
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


_KNOWN = ("audio_filepath", "duration", "text", "offset", "speaker", "lang", "id")


def _parse_line(raw: str, path: str, lineno: int, base: str) -> tuple[Optional[ManifestEntry], str]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    missing = [k for k in ("audio_filepath", "duration", "text") if k not in obj]
    if missing:
        return None, f"missing key(s) {', '.join(missing)}"
    audio = obj["audio_filepath"]
    if not isinstance(audio, str) or not audio:
        return None, f"audio_filepath must be a non-empty string, got {audio!r}"
    duration, why = _seconds(obj["duration"], "duration")
    if why:
        return None, why
    if duration <= 0:
        return None, f"duration must be > 0, got {obj['duration']!r}"
    offset = 0.0
    if "offset" in obj:
        offset, why = _seconds(obj["offset"], "offset")
        if why:
            return None, why
        if offset < 0:
            return None, f"offset must be >= 0, got {obj['offset']!r}"
    text = obj["text"]
    if not isinstance(text, str):
        return None, f"text must be a string, got {type(text).__name__}"
    for key in ("speaker", "lang", "id"):
        if key in obj and not isinstance(obj[key], (str, int)):
            return None, f"{key} must be a string or an integer, got {type(obj[key]).__name__}"
    uid = str(obj["id"]) if "id" in obj else f"{path}:{lineno}"
    audio = os.path.expanduser(audio)
    return ManifestEntry(
        id=uid,
        audio_filepath=audio if os.path.isabs(audio) else os.path.normpath(os.path.join(base, audio)),
        duration=duration,
        text=text,
        offset=offset,
        is_segment="offset" in obj,
        speaker=None if obj.get("speaker") is None else str(obj["speaker"]),
        lang=None if obj.get("lang") is None else str(obj["lang"]),
        source=path,
        line=lineno,
        extra={k: v for k, v in obj.items() if k not in _KNOWN},
    ), ""


def _seconds(value, key: str) -> tuple[float, str]:
    # bool is an int subclass; "duration": true is a bug, not one second
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0, f"{key} must be a number of seconds, got {value!r}"
    if not math.isfinite(value):
        return 0.0, f"{key} must be finite, got {value!r}"
    return float(value), ""


def _id_hint(raw: str) -> str:
    try:
        obj = json.loads(raw)
        return str(obj.get("id", "")) if isinstance(obj, dict) else ""
    except json.JSONDecodeError:
        return ""
