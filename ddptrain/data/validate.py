"""Validate manifests before training: find every bad line up front, not one per crashed run.

Checks, per line (the reason strings start with these words, so reports can be grepped):

* ``bad line``: not JSON / missing, mistyped or disagreeing keys, or no ``duration`` and an audio
  header that cannot give it (from the manifest parser);
* ``duplicate id``: within the manifests read together, and (:func:`duplicate_problems`) across
  every source and shard set of a run;
* ``duplicate audio``: a line of one manifest file names the audio (file, and segment) of a line
  of another, under another id (the same utterance would train twice an epoch);
* ``missing audio file``;
* ``unreadable audio``: libsndfile cannot parse the header (with ``decode``: the data);
* ``zero-length audio``;
* ``duration mismatch``: the header's length differs from the manifest's ``duration`` by more
  than ``duration_tolerance`` (for a segment line, one with ``offset``: the segment runs past
  the end of the file);
* ``truncated audio`` / ``non-finite samples`` (only with ``decode``);
* ``empty text``;
* ``unknown characters`` (when a tokenizer without an unknown token is given);
* ``text too long for CTC``: CTC needs one output frame per token plus one blank between
  repeated tokens, and the model emits ``duration * output_frame_rate`` frames (at the fastest
  speed perturbation, which makes the utterance shortest);
* ``shorter than one feature frame``;
* ``too long``: the utterance alone exceeds the batch budget ``max_duration`` as the sampler
  counts it (at the slowest speed perturbation, through a recipe's cost function, with
  ``quadratic_duration``: :func:`budget_problems`) or ``max_utterance_duration``.

The header check is cheap (it reads a few bytes per file, in threads); ``decode`` reads every
file in full, which finds corrupt bodies but costs minutes per thousand hours of audio.
Anything that slips through is still caught when a worker loads it (see ``dataset.py``).

Shards (a ``.tar``, a folder or glob of them, among the paths) are validated as manifests are:
their index's problems, the checks that need only a duration and a text length, and with
``decode`` every member decoded (ddptrain/data/shards.py: ``check_shards``, ``decode_problems``).

Policy (``data.bad_data``): ``error`` raises a :class:`DataError` listing every bad line;
``skip`` returns the good entries and the count skipped.

The shared API for code with checks of its own (loader.py, mix.py, the recipes):
:func:`read_entries` parses manifests into entries and the problems found while parsing, and
:func:`finish_report` applies the policy to any problems at all (one per line, in manifest
order, the bad entries dropped), with the caller's ``headline`` when its checks are not this
module's (a recipe's context length or batch budget: the command line above would not find them).

Command line::

    python -m ddptrain.data.validate train.jsonl [more.jsonl | shards/] [--config configs/x.yaml]
        [--sample-rate 16000] [--max-duration 200] [--output-frame-rate 25] [--tokenizer vocab.json]
        [--decode] [--threads 8] [--field audio=wav ...]

prints one ``file:line: reason`` per problem and a summary, and exits 1 if there were problems.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Protocol, Sequence, Union

import numpy as np
import soundfile as sf

from ddptrain.config import ConfigError, check_section, cli_prog, load_config
from ddptrain.data.audio import AudioError, audio_info
from ddptrain.data.config import DataConfig
from ddptrain.data.errors import DataError, Problem
from ddptrain.data.manifest import ManifestEntry, duplicate_id_problems, parse_field_args, parse_manifest, split_paths
from ddptrain.data.sampler import padded_cost
from ddptrain.data.shards import ShardSet, check_shards, is_shard_spec, load_shards
from ddptrain.data.tokenizer import CharTokenizer

ManifestLike = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]], Sequence[ManifestEntry]]

# The policy's own headline: these checks are the command line's, so it can reprint the list.
DEFAULT_HEADLINE = ("{summary} (data.bad_data=skip would skip them; "
                    "`python -m ddptrain.data.validate MANIFEST` prints this list):")


class Located(Protocol):
    """What :func:`finish_report` needs of an entry: where it is (a ``ManifestEntry``, a
    recipe's cached utterance, ...), the same three fields a :class:`Problem` names."""

    source: str
    line: int
    id: str


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_manifest`."""

    entries: list  # the good entries, in manifest order (ManifestEntry, or what finish_report was given)
    problems: list[Problem] = field(default_factory=list)  # one per bad line, in manifest order
    num_total: int = 0  # lines (entries) looked at

    @property
    def num_bad(self) -> int:
        return len(self.problems)

    @property
    def num_skipped(self) -> int:
        """Bad lines left out of ``entries`` (all of them: that is what skipping means)."""
        return len(self.problems)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.ok:
            return f"{self.num_total} utterance(s), no problems"
        return f"{self.num_bad} of {self.num_total} utterance(s) have problems"

    def __str__(self) -> str:
        return "\n".join([str(p) for p in self.problems] + [self.summary()])


def validate_manifest(
    manifest: ManifestLike,
    data_cfg: Optional[DataConfig] = None,
    tokenizer=None,
    decode: Optional[bool] = None,
    num_threads: int = 8,
    policy: Optional[str] = None,
) -> ValidationReport:
    """Check every line of one or more manifests, and every utterance of shards (see the module
    docstring for the checks), and that no utterance comes twice (:func:`duplicate_problems`).

    Args:
        manifest: path, comma-separated paths, list of paths, or a list of ``ManifestEntry``; a
            path may name shards (a ``.tar``, a folder or glob of them).
        data_cfg: supplies sample rate, budget, tolerance, CTC frame rate...; default config if None.
        tokenizer: check that every character is known (skipped when None).
        decode: decode every file in full; default ``data_cfg.validate_decode``.
        num_threads: parallel header reads (libsndfile releases the GIL).
        policy: ``error`` | ``skip``; default ``data_cfg.bad_data``.

    Returns:
        The report: good entries, problems, counts. Under ``skip`` the caller trains on
        ``report.entries`` and logs ``report.num_skipped``.

    Raises:
        ConfigError: a ``data_cfg`` value (or ``policy``) outside what ``load_config`` accepts.
        DataError: under ``error``, when any line is bad; the message lists every bad line as
            ``file:line: reason`` (``.problems`` has them as records).
    """
    cfg = data_cfg or DataConfig()
    if policy is not None:
        cfg = replace(cfg, bad_data=policy)
    cfg = check_section(cfg, "data")
    decode = cfg.validate_decode if decode is None else decode
    listed = isinstance(manifest, (list, tuple)) and manifest and isinstance(manifest[0], ManifestEntry)
    paths = [] if listed else split_paths(manifest)
    specs = [p for p in paths if is_shard_spec(p)]
    entries, problems = read_entries(manifest if listed or not specs else [p for p in paths if p not in specs],
                                     cfg.fields)
    problems += check_entries(entries, cfg, tokenizer, decode, num_threads)
    parts, counted = [entries], 0
    if specs:
        shards = load_shards(specs)
        bad, _ = check_shards(shards, cfg, decode)
        problems += shards.problems + bad
        parts.append(shards)
        counted = len(shards) + len(shards.problems)
    problems += duplicate_problems(parts, [None] * len(parts))[0]
    report = finish_report(entries, problems, "skip")
    if specs:  # finish_report counts entries plus problems outside them; a shard set's utterances are counted here
        known, tars = {(e.source, e.line, e.id) for e in entries}, set(shards.paths)
        unparsed = sum(1 for p in report.problems if p.source not in tars and (p.source, p.line, p.id) not in known)
        report.num_total = len(entries) + unparsed + counted
    if report.problems and cfg.bad_data == "error":
        raise DataError.from_problems(DEFAULT_HEADLINE.replace("{summary}", report.summary()), report.problems)
    return report


def read_entries(manifest: ManifestLike, fields: Optional[Mapping[str, str]] = None) -> tuple[list[ManifestEntry], list[Problem]]:
    """Parse manifests into entries, collecting every bad line instead of stopping at the first.

    Args:
        manifest: path, comma-separated paths, list of paths, or a list of ``ManifestEntry``
            (taken as they are: only their ids are checked).
        fields: ``data.fields`` (manifest keys of other names: ddptrain/data/manifest.py).

    Returns:
        ``(entries, problems)``: the parsed entries in manifest order, and one ``Problem`` per
        line that did not parse (reason ``bad line: ...``) or repeats an earlier id
        (``duplicate id``). Hand both, with any problems of your own, to :func:`finish_report`.

    Raises:
        DataError: a manifest file that cannot be opened (no line of it can be named).
    """
    if isinstance(manifest, (list, tuple)) and manifest and isinstance(manifest[0], ManifestEntry):
        entries = list(manifest)
        return entries, duplicate_id_problems(entries)
    entries, problems = [], []
    for path in split_paths(manifest):
        got, bad = parse_manifest(path, fields)
        entries += got
        problems += [replace(p, reason="bad line: " + p.reason) for p in bad]
    return entries, problems + duplicate_id_problems(entries)


def finish_report(entries: Sequence[Located], problems: Sequence[Problem], policy: str,
                  headline: Optional[str] = None) -> ValidationReport:
    """Apply the bad-data policy: merge problems per line, drop the bad entries, raise or return.

    Args:
        entries: everything that was checked, in manifest order; anything with ``.source``,
            ``.line`` and ``.id`` (the key a :class:`Problem` is matched on).
        problems: from :func:`read_entries`, :func:`check_entries` and the caller's own checks,
            in any order; several for one line become one, their reasons joined by ``; ``.
        policy: ``error`` | ``skip`` (``data.bad_data``).
        headline: the first line of the ``error`` message, ``{summary}`` replaced by the
            report's summary ("3 of 40 utterance(s) have problems"). Default: one that points at
            ``python -m ddptrain.data.validate``; pass your own when the checks are yours (that
            command cannot reproduce a context-length or batch-budget check).

    Returns:
        The report: the good entries (the objects given, in order), the merged problems in
        manifest order, and the count looked at (entries plus lines that did not parse).
        Under ``skip`` saying what was skipped is the caller's job (it knows its rank and log).

    Raises:
        ValueError: ``policy`` is neither ``error`` nor ``skip`` (a typo must not mean skip).
        DataError: under ``error``, when there is any problem; the message lists them all as
            ``file:line (id ...): reason`` (``.problems`` has them as records).
    """
    if policy not in ("error", "skip"):
        raise ValueError(f"bad-data policy {policy!r} is not one of error, skip (data.bad_data)")
    merged: dict[tuple, Problem] = {}
    for p in problems:
        key = (p.source, p.line, p.id)
        if key in merged:
            merged[key] = replace(merged[key], reason=merged[key].reason + "; " + p.reason)
        else:
            merged[key] = p
    rank: dict[str, int] = {}
    for src in [e.source for e in entries] + [p.source for p in merged.values()]:
        rank.setdefault(src, len(rank))
    bad = sorted(merged.values(), key=lambda p: (rank[p.source], p.line))
    bad_keys = set(merged)
    good = [e for e in entries if (e.source, e.line, e.id) not in bad_keys]
    known = {(e.source, e.line, e.id) for e in entries}
    parse_only = sum(1 for k in merged if k not in known)
    report = ValidationReport(good, bad, len(entries) + parse_only)
    if bad and policy == "error":
        # str.replace, not str.format: a headline naming a path with braces in it stays as it is
        raise DataError.from_problems((headline or DEFAULT_HEADLINE).replace("{summary}", report.summary()), bad)
    return report


def keep_good(entries: Sequence[Located], problems: Sequence[Problem], policy: str, source: str, headline: str,
              say: Optional[Callable[[str], None]] = None) -> list:
    """:func:`finish_report` for a recipe's own loader: the good entries, the skipped ones told.

    Args:
        entries, problems, policy, headline: as for :func:`finish_report`.
        source: the manifest, named in the notice and in the error when nothing is left.
        say: where the list of skipped lines goes under ``skip`` (rank 0's ``print``; ``None``
            on the other ranks, so it is said once).

    Raises:
        DataError: under ``error``, any problem (all listed); under ``skip``, no entry left.
    """
    report = finish_report(entries, problems, policy, headline=headline)
    if report.problems and say is not None:
        say(f"{source}: skipped {report.num_skipped} of {report.num_total} utterance(s) (data.bad_data=skip):\n"
            + "\n".join(f"  {p}" for p in report.problems))
    if not report.entries:
        raise DataError(f"no utterances left in {source} to train or evaluate on (after skipping bad ones)")
    return report.entries


TRAIN_TWICE = "it would train twice an epoch"
SCORE_TWICE = "it would be scored twice in every evaluation"  # eval data (build_dataloader's train=False)


def duplicate_problems(parts: Sequence, names: Sequence[Optional[str]], by_id: bool = True,
                       why: str = TRAIN_TWICE) -> tuple[list[Problem], list]:
    """The utterances that an earlier part of a run's data already holds, so none trains twice an
    epoch: by id (``by_id``) across parts and within a shard set, and, where ids differ, by audio
    for manifest lines of different files (the same file and, for a segment line, the same
    offset and duration).

    Args:
        parts: the run's parts in order, each a list of ``ManifestEntry`` (the duplicate ids within
            one list are :func:`read_entries`' to report) or a :class:`~ddptrain.data.shards.ShardSet`.
        names: the source name of each part (named in messages), or None.
        by_id: also compare ids (False: audio only).
        why: what a copy would do, said after each problem (:data:`SCORE_TWICE` for eval data).

    Returns:
        ``(problems, parts)``: one problem per later copy, and the parts without those copies.
    """
    ids: dict[str, tuple[int, str]] = {}  # id -> (its part, where it was first seen)
    audio: dict[tuple, tuple[str, str, str]] = {}  # (file, offset, segment length) -> (manifest, where, id)
    problems, out = [], []
    for k, (part, name) in enumerate(zip(parts, names)):
        label = f"source {name!r} at " if name is not None else ""
        if isinstance(part, ShardSet):
            drop = np.zeros(len(part), dtype=bool)
            for i in range(len(part)):
                uid, path, num = part.utterance_id(i), part.paths[int(part.shard[i])], int(part.number[i])
                if by_id and uid in ids:
                    problems.append(Problem(path, num, uid, f"duplicate id (also {ids[uid][1]}): {why}"))
                    drop[i] = True
                else:
                    ids.setdefault(uid, (k, f"{label}{path}:{num}"))
            out.append(part.subset(~drop) if drop.any() else part)
            continue
        keep = []
        for e in part:
            where = f"{label}{e.source}:{e.line}"
            key = (e.audio_filepath, round(e.offset, 3), round(e.duration, 3) if e.is_segment else None)
            seen = audio.get(key)
            if by_id and ids.get(e.id, (k,))[0] != k:  # within one part: read_entries' own check
                problems.append(Problem(e.source, e.line, e.id, f"duplicate id (also {ids[e.id][1]}): {why}"))
            elif seen is not None and seen[0] != e.source and seen[2] != e.id:
                problems.append(Problem(e.source, e.line, e.id, f"duplicate audio: {e.audio_filepath} is also "
                                        f"{seen[1]} (id {seen[2]}): {why}"))
            else:
                ids.setdefault(e.id, (k, where))
                audio.setdefault(key, (e.source, where, e.id))
                keep.append(e)
        out.append(keep)
    return problems, out


def check_entries(entries: Sequence[ManifestEntry], cfg: DataConfig, tokenizer=None, decode: bool = False,
                  num_threads: int = 8, cost: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                  cost_unit: str = "") -> list[Problem]:
    """All problems of ``entries`` (text checks here, audio checks in a thread pool); ``cost``
    and ``cost_unit`` as for :func:`budget_problems` (a recipe's batch cost, so the budget is
    checked here, as its sampler counts it, not again by the recipe)."""
    problems = budget_problems(entries, [e.duration for e in entries], cfg, cost, cost_unit)
    over = {(p.source, p.line, p.id) for p in problems}
    problems += [p for e in entries for p in _text_problems(e, cfg, tokenizer, (e.source, e.line, e.id) in over)]
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        for e, reason in zip(entries, pool.map(lambda e: _audio_problem(e, cfg, decode), entries, chunksize=64)):
            if reason:
                problems.append(Problem(e.source, e.line, e.id, reason))
    return problems


def budget_problems(entries: Sequence[Located], seconds: Sequence[float], cfg: DataConfig,
                    cost: Optional[Callable[[np.ndarray], np.ndarray]] = None, cost_unit: str = "") -> list[Problem]:
    """A ``too long`` problem for each entry that does not fit in a batch of ``data.max_duration``
    on its own, counted as ``DurationBucketSampler.from_config`` counts it (which refuses such an
    utterance by index only): its seconds at the slowest speed perturbation, through ``cost``,
    with ``quadratic_duration``.

    Args:
        entries: what the problems name (``.source``, ``.line``, ``.id``).
        seconds: each entry's audio seconds.
        cfg: the data section.
        cost: a recipe's ``seconds -> seconds of data.max_duration``, vectorised (the sampler's
            ``cost``, e.g. whole 30 s encoder windows); default: the seconds.
        cost_unit: what the counted seconds are, in the message ("of 30 s encoder windows").
    """
    if not len(entries):
        return []
    slow = _speed_range(cfg)[0]
    at = np.asarray(seconds, dtype=np.float64) / slow  # speed 0.9: 11% longer
    used = padded_cost(at if cost is None else np.asarray(cost(at), dtype=np.float64), cfg.quadratic_duration)
    out = []
    for e, d, a, c in zip(entries, seconds, at, used):
        if c > cfg.max_duration:
            speed = f" at speed {slow}" if slow != 1.0 else ""
            counted = f" = {c:.4g}s" if c != a else ""
            unit = f" {cost_unit}" if cost_unit else ""
            out.append(Problem(e.source, e.line, e.id, f"too long: {d:.2f}s{speed}{counted}{unit} does not fit in "
                               f"a batch of data.max_duration={cfg.max_duration}s"))
    return out


def _speed_range(cfg: DataConfig) -> tuple[float, float]:
    speeds = [float(s) for s in cfg.speed_perturb] or [1.0]
    return min(speeds), max(speeds)


def _text_problems(e: ManifestEntry, cfg: DataConfig, tokenizer, over_budget: bool) -> list[Problem]:
    out = []

    def bad(reason):
        out.append(Problem(e.source, e.line, e.id, reason))

    fast = _speed_range(cfg)[1]
    if not over_budget and cfg.max_utterance_duration > 0 and e.duration > cfg.max_utterance_duration:
        bad(f"too long: {e.duration:.2f}s > max_utterance_duration={cfg.max_utterance_duration}s")
    if cfg.features != "raw" and e.duration < cfg.frame_length_ms / 1000:
        bad(f"shorter than one feature frame: {e.duration * 1000:.1f} ms < {cfg.frame_length_ms} ms")
    if not e.text.strip():
        bad("empty text")
        return out
    tokens: Sequence = e.text
    if tokenizer is not None:
        unknown = tokenizer.unknown_chars(e.text) if getattr(tokenizer, "unk_id", None) is None else []
        if unknown:
            bad("unknown characters " + ", ".join(f"{c!r} (U+{ord(c):04X})" for c in unknown))
            return out
        tokens = tokenizer.encode(e.text)
    if cfg.output_frame_rate > 0:
        frames = math.floor(e.duration / fast * cfg.output_frame_rate)
        repeats = sum(1 for a, b in zip(tokens, tokens[1:]) if a == b)
        if len(tokens) + repeats > frames:
            bad(f"text too long for CTC: {len(tokens)} tokens (+{repeats} repeats) need more than the "
                f"{frames} output frames of {e.duration:.2f}s at {cfg.output_frame_rate} frames/s")
    return out


def _audio_problem(e: ManifestEntry, cfg: DataConfig, decode: bool) -> str:
    if not os.path.exists(e.audio_filepath):
        return f"missing audio file: {e.audio_filepath}"
    try:
        info = audio_info(e.audio_filepath)
    except AudioError as err:
        return f"unreadable audio: {err}"
    if info.frames == 0:
        return f"zero-length audio: {e.audio_filepath}"
    tol = cfg.duration_tolerance
    if e.is_segment:
        if e.offset + e.duration > info.duration + tol:
            return (f"duration mismatch: segment {e.offset:.3f}s + {e.duration:.3f}s runs past the end of "
                    f"{e.audio_filepath} ({info.duration:.3f}s)")
    elif abs(info.duration - e.duration) > tol and e.duration_from:  # a stale cache, not the line, is wrong
        return (f"duration mismatch: the duration cache {e.duration_from} says {e.duration:.3f}s (the line has no "
                f"duration), {e.audio_filepath} has {info.duration:.3f}s: delete {e.duration_from} (it is rebuilt "
                "from the audio headers)")
    elif abs(info.duration - e.duration) > tol:
        return f"duration mismatch: the manifest says {e.duration:.3f}s, {e.audio_filepath} has {info.duration:.3f}s"
    if decode:
        return _decode_problem(e.audio_filepath, info.frames)
    return ""


def _decode_problem(path: str, header_frames: int) -> str:
    frames = 0
    try:
        with sf.SoundFile(path) as f:
            for block in f.blocks(blocksize=1 << 16, dtype="float32", always_2d=True):
                if not np.isfinite(block).all():
                    return f"non-finite samples: NaN/inf in {path}"
                frames += block.shape[0]
    except (RuntimeError, OSError, ValueError, sf.SoundFileError) as err:
        return f"unreadable audio: cannot decode {path}: {str(err).strip().splitlines()[-1] if str(err).strip() else err!r}"
    if frames < header_frames:
        return f"truncated audio: decoded {frames} of the {header_frames} frames the header of {path} promises"
    return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=cli_prog("ddptrain.data.validate"),
                                description="Check manifests for bad lines; exit 1 if any.")
    p.add_argument("manifests", nargs="+", help="JSONL manifest(s), or shards: a .tar, a folder or glob of them")
    p.add_argument("--config", help="YAML config whose data: section supplies the defaults")
    p.add_argument("--sample-rate", type=int)
    p.add_argument("--max-duration", type=float, help="batch budget in seconds")
    p.add_argument("--max-utterance-duration", type=float)
    p.add_argument("--quadratic-duration", type=float)
    p.add_argument("--output-frame-rate", type=float, help="model output frames/s for the CTC check (0 = off)")
    p.add_argument("--duration-tolerance", type=float)
    p.add_argument("--tokenizer", help="tokenizer file: also check for unknown characters")
    p.add_argument("--field", action="append", default=[], metavar="FIELD=KEY",
                   help="a manifest key of another name, as data.fields (e.g. audio=wav); repeatable")
    p.add_argument("--decode", action="store_true", help="decode every file in full (slow, thorough)")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    a = p.parse_args(argv)
    try:
        cfg = load_config(a.config).data if a.config else DataConfig()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for arg, key in [("sample_rate", "sample_rate"), ("max_duration", "max_duration"),
                     ("max_utterance_duration", "max_utterance_duration"),
                     ("quadratic_duration", "quadratic_duration"), ("output_frame_rate", "output_frame_rate"),
                     ("duration_tolerance", "duration_tolerance")]:
        if getattr(a, arg) is not None:
            cfg = replace(cfg, **{key: getattr(a, arg)})
    try:
        if a.field:
            cfg = replace(cfg, fields={**cfg.fields, **parse_field_args(a.field)})
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = None
    tok_path = a.tokenizer or (cfg.tokenizer if a.config and cfg.tokenizer and os.path.exists(cfg.tokenizer) else "")
    try:
        if tok_path:
            tokenizer = CharTokenizer.load(tok_path)
        report = validate_manifest(a.manifests, cfg, tokenizer, decode=a.decode or None,
                                   num_threads=a.threads, policy="skip")
    except (DataError, ConfigError) as e:  # unreadable manifest or tokenizer file, or a bad --option
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.summary() if a.quiet else str(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
