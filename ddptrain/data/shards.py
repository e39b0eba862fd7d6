"""Tar shards in the WebDataset layout, with a small index per shard: write, index, read.

Why: at 10^5-10^6 utterances, one file per utterance means one open (a metadata round trip on
network storage) and one small random read per utterance. A shard holds about a thousand
utterances in one file, so a worker opens each shard once and reads its members by offset.

Layout, the one WebDataset, wids and ``tar`` itself read: an *uncompressed* tar whose members
come in samples, one per utterance, adjacent and sharing a key (the member name up to its first
dot): ``KEY.flac`` (any extension soundfile decodes: flac, wav, ogg, opus, mp3, ...) and
``KEY.json``, the utterance's record ``{"id", "text", "duration", "speaker", "lang", ...}``
(a ``KEY.txt`` transcript instead of the JSON works too). ``python -m ddptrain.data.shards``
writes them from any manifest, shuffled (so a shard is a random sample of the corpus).

Index: next to ``NAME.tar``, ``NAME.idx.json`` holds one column per field -- key, utterance id,
duration, text length, and the byte offset and size of each sample's members -- plus the size of
the tar. (Version 1 indexes, without the ids, are still read: the keys stand in for the ids;
``python -m ddptrain.data.shards --index`` rewrites them.) The
sampler plans an epoch from the index alone; a worker reads a member with one ``os.pread``.
It is written after its tar (both atomically), so an index means a complete shard. It also keeps
a signature of the tar (a hash of a few samples' tar headers): a tar rewritten after its index
(another content, even of the same size) is found stale when read, and indexed again.

Shards written by other tools: a shard without an index is indexed when first read (its tar
headers, the JSON records, and the audio header where a record has no duration); with a process
group each rank indexes a 1/W share. Members are grouped by key, so a tar whose samples' members
are not adjacent (all audio, then all transcripts) is indexed as it is, with a warning: ddptrain
reads members by offset, streaming readers need the WebDataset order. The index is saved next to the shard where that folder is
writable, else kept for this run only, with a warning. Compressed shards (``.tar.gz``) are
refused: a compressed stream cannot be read at an offset.

Bad data, under ``data.bad_data`` like manifest lines: a shard shorter than its index says (a copy
cut short), a sample without audio or transcript, an index that disagrees with its tar. Each
problem names the shard and the member (``shard.tar:N (id KEY): reason``, N = the sample's
number in the shard).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import logging
import os
import re
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import soundfile as sf
import torch

from ddptrain import dist
from ddptrain.config import check_section, cli_prog
from ddptrain.data.audio import AudioError, load_audio, resample
from ddptrain.data.config import DataConfig
from ddptrain.data.dataset import PackedStrings, SpeechDataset
from ddptrain.data.errors import DataError, Problem
from ddptrain.data.manifest import load_manifest, parse_field_args
from ddptrain.data.sampler import padded_cost

log = logging.getLogger(__name__)

INDEX_FORMAT = "ddptrain-shard-index"
INDEX_VERSION = 2  # 2: adds the "ids" column (version 1 is still read)
AUDIO_EXTS = ("flac", "wav", "ogg", "opus", "mp3", "aiff", "aif", "au", "w64", "caf")
_COLUMNS = ("keys", "duration", "text_len", "offset", "audio_ext", "audio_offset", "audio_size",
            "meta_ext", "meta_offset", "meta_size", "ids")
_V1_COLUMNS = _COLUMNS[:-1]
_BLOCK = 512  # tar block size: member data is padded to a multiple of it


def index_path(tar_path: str) -> str:
    """``dir/NAME.tar`` -> ``dir/NAME.idx.json``."""
    return (tar_path[:-4] if tar_path.endswith(".tar") else tar_path) + ".idx.json"


def is_shard_spec(spec: str) -> bool:
    """Whether one path of ``data.train_manifest`` names shards rather than a JSONL manifest: a
    ``.tar`` file, a folder of them, a glob, or a brace range (``shard-{000000..000099}.tar``)."""
    spec = os.fspath(spec)
    return spec.endswith((".tar", ".tar.gz", ".tgz")) or os.path.isdir(spec) or any(c in spec for c in "*?[{")


def resolve_shards(spec: str) -> list[str]:
    """The shard files a spec names (see :func:`is_shard_spec`), in sorted order.

    Raises:
        DataError: nothing matches, or a shard is compressed.
    """
    spec = os.path.expanduser(os.fspath(spec))
    if os.path.isdir(spec):
        paths = sorted(glob.glob(os.path.join(glob.escape(spec), "*.tar")))
    else:
        paths = sorted(p for pattern in _expand_braces(spec) for p in glob.glob(pattern))
    if not paths:
        raise DataError(f"no shards match {spec!r} (expected .tar files: a folder, a glob or shard-{{000000..000009}}.tar)")
    for p in paths:
        if p.endswith((".gz", ".tgz")) or _is_gzip(p):
            raise DataError(f"{p} is compressed: shards must be plain tar files, read at byte offsets "
                            f"(`gunzip` them, or rewrite them with `python -m ddptrain.data.shards`)")
    return paths


def _expand_braces(spec: str) -> list[str]:
    m = re.search(r"\{(\d+)\.\.(\d+)\}", spec)
    if not m:
        return [spec]
    a, b = m.group(1), m.group(2)
    width = len(a)
    head, tail = spec[:m.start()], spec[m.end():]
    return [q for i in range(int(a), int(b) + 1) for q in _expand_braces(f"{head}{i:0{width}d}{tail}")]


def _is_gzip(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError:
        return False


# ---------------------------------------------------------------------- writing


def write_shards(manifest, out_dir: str, shard_size: int = 1000, shuffle: bool = True, seed: int = 0,
                 audio: str = "keep", prefix: str = "shard", fields: Optional[dict] = None) -> list[str]:
    """Write a manifest's utterances as tar shards plus their indexes.

    Args:
        manifest: manifest path(s) (comma-separated or a list), or ``ManifestEntry`` list.
        out_dir: created if needed; shards are ``{prefix}-000000.tar``, ...
        shard_size: utterances per shard.
        shuffle: write the utterances in a random order (``seed``), so every shard is a random
            sample of the corpus (the sampler's windows of shards then are too).
        audio: ``keep``: the audio file's bytes as they are (whole-file lines; segment lines,
            those with an ``offset``, are cut and stored as FLAC); ``flac`` / ``wav``: decode
            and store every utterance in that format, at the file's sample rate.
        prefix: shard file-name prefix.
        fields: ``data.fields`` (manifest keys of other names: ddptrain/data/manifest.py).

    Returns:
        The shard paths.

    Raises:
        DataError: a bad manifest line (all listed), an unreadable audio file, a bad option.
    """
    if shard_size < 1 or audio not in ("keep", "flac", "wav"):
        raise DataError(f"need shard_size >= 1 and audio in keep|flac|wav, got {shard_size=} {audio=}")
    entries = list(manifest) if isinstance(manifest, list) and manifest and not isinstance(manifest[0], str) \
        else load_manifest(manifest, fields)
    order = np.random.default_rng(seed).permutation(len(entries)) if shuffle else np.arange(len(entries))
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for n, start in enumerate(range(0, len(entries), shard_size)):
        path = os.path.join(out_dir, f"{prefix}-{n:06d}.tar")
        _write_one(path, [entries[i] for i in order[start:start + shard_size]], audio)
        paths.append(path)
    return paths


def _write_one(path: str, entries, audio: str) -> None:
    cols: dict[str, list] = {k: [] for k in _COLUMNS}
    used: set[str] = set()
    tmp = path + ".tmp"
    with open(tmp, "wb") as raw:
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for e in entries:
                data, ext = _audio_bytes(e, audio)
                key = _key_for(f"line{e.line:08d}" if e.id == f"{e.source}:{e.line}" else e.id, used)
                record = {"id": e.id, "text": e.text, "duration": e.duration}
                record.update({k: v for k, v in (("speaker", e.speaker), ("lang", e.lang), ("dataset_id", e.dataset_id),
                                                 ("ref_audio", e.ref_audio)) if v is not None})
                record.update(e.extra)
                meta = json.dumps(record, ensure_ascii=False).encode("utf-8")
                cols["keys"].append(key)
                cols["ids"].append(e.id)
                cols["duration"].append(e.duration)
                cols["text_len"].append(len(e.text))
                cols["offset"].append(tar.offset)
                for name, payload, kind in ((f"{key}.{ext}", data, "audio"), (f"{key}.json", meta, "meta")):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(payload), 0, 0o644  # byte-identical rewrites
                    tar.addfile(info, io.BytesIO(payload))
                    cols[f"{kind}_ext"].append(name.split(".", 1)[1])
                    cols[f"{kind}_offset"].append(tar.offset - _round_up(len(payload)))
                    cols[f"{kind}_size"].append(len(payload))
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)
    _save_index(path, {"format": INDEX_FORMAT, "version": INDEX_VERSION, "tar": os.path.basename(path),
                       "tar_bytes": os.path.getsize(path), "signature": _signature(path, cols["offset"]),
                       "problems": [], **cols})


def _signature(tar_path: str, offsets: Sequence[int]) -> str:
    """A hash of the tar headers of up to 8 samples spread over the shard (their member names and
    sizes): a tar rewritten after its index, even to the same size, changes it. 8 small reads."""
    picks = sorted({int(round(x)) for x in np.linspace(0, len(offsets) - 1, min(len(offsets), 8))}) if offsets else []
    h = hashlib.sha1(str(len(offsets)).encode())
    with open(tar_path, "rb") as f:
        for j in picks:
            f.seek(int(offsets[j]))
            h.update(f.read(_BLOCK))
    return h.hexdigest()[:16]


def _audio_bytes(e, audio: str) -> tuple[bytes, str]:
    ext = os.path.splitext(e.audio_filepath)[1].lstrip(".").lower()
    if audio == "keep" and not e.is_segment and ext in AUDIO_EXTS:
        try:
            with open(e.audio_filepath, "rb") as f:
                return f.read(), ext
        except OSError as err:
            raise DataError(f"{e.where()}: cannot read {e.audio_filepath}: {err}") from None
    fmt = "wav" if audio == "wav" else "flac"
    try:
        rate = sf.info(e.audio_filepath).samplerate
    except (RuntimeError, OSError) as err:
        raise DataError(f"{e.where()}: cannot read {e.audio_filepath}: {err}") from None
    wave = load_audio(e.audio_filepath, None, e.offset, e.duration if e.is_segment else None)
    buf = io.BytesIO()
    sf.write(buf, wave.numpy(), rate, format=fmt.upper(), subtype="PCM_16")
    return buf.getvalue(), fmt


def _key_for(uid: str, used: set) -> str:
    # WebDataset splits a member name at its first dot: a key must have none (nor a slash)
    key = re.sub(r"[^\w\-]", "_", uid) or "utt"
    base, n = key, 1
    while key in used:
        key, n = f"{base}_{n}", n + 1
    used.add(key)
    return key


def _round_up(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def _save_index(tar_path: str, index: dict) -> bool:
    """Write atomically next to the shard; False (and nothing written) where that is not allowed."""
    path = index_path(tar_path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f, ensure_ascii=False, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


# ---------------------------------------------------------------------- indexing foreign shards

_MEMBER = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # WebDataset's key / extension split


def build_index(tar_path: str) -> dict:
    """Index one shard by reading it: tar headers, JSON records, audio headers where needed.

    Samples without audio or transcript are left out and listed under ``"problems"`` (so a saved
    index reports them on every load). A tar that ends without its end-of-archive block was cut
    short (a copy interrupted): the sample the file ends in and every later one are lost; that is
    one problem, at the first lost sample, saying how many were read (``"truncated"`` records where;
    :func:`load_shards` adds how many the other shards of the set hold, the best guess of how many
    followed, which only an index could tell).

    Raises:
        DataError: the file is not a readable tar.
    """
    size = os.path.getsize(tar_path)
    groups: dict[str, dict] = {}  # key -> {extension: member}, in the order the keys first appear
    problems: list[list] = []
    truncated, last, scattered, repeated, count = False, None, [], {}, 0
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            while True:
                try:
                    m = tar.next()
                except tarfile.ReadError:  # a member's data runs past the end of the file
                    truncated = True
                    break
                if m is None:
                    truncated = not _terminated(tar_path, tar.offset)
                    break
                hit = _MEMBER.match(m.name) if m.isfile() else None
                if hit is None:
                    continue
                key, ext = hit.group(1), hit.group(2)
                count += 1
                if key in groups and key != last and len(scattered) < 10 ** 6:
                    scattered.append((key, ext, count))  # a member of a sample that began earlier
                if ext in groups.setdefault(key, {}):
                    repeated.setdefault(key, f"{key}.{ext}")
                groups[key][ext] = m
                last = key
            samples = list(groups.items())
            if scattered:
                key, ext, at = scattered[0]
                log.warning("%s: the members of %d sample(s) are not adjacent (e.g. %s.%s is member %d, after "
                            "members of other samples): indexed by key, as ddptrain reads members by offset; "
                            "streaming (WebDataset) readers need each sample's members together", tar_path,
                            len({k for k, _, _ in scattered}), key, ext, at)
            cut = _first_lost(samples, size) if truncated else len(samples) + 1
            cols: dict[str, list] = {k: [] for k in _COLUMNS}
            for n, (key, members) in enumerate(samples[:cut - 1], start=1):
                why = (f"member {repeated[key]} appears more than once in the shard: which one is the sample's is "
                       "not known" if key in repeated else _index_sample(tar, key, members, size, cols))
                if why:
                    problems.append([n, key, why])
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{tar_path}: not a readable tar file ({e})") from None
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "tar": os.path.basename(tar_path),
             "tar_bytes": size, "signature": _signature(tar_path, cols["offset"]), "problems": problems, **cols}
    if truncated:
        key = samples[cut - 1][0] if cut <= len(samples) else ""
        problems.append([cut, key, f"truncated shard: the file ends at byte {size} in sample {cut}"
                                   f"{f' ({key})' if key else ''}: it and every later sample are lost, {cut - 1} "
                                   "sample(s) before it are read (copy the shard again)"])
        index["truncated"] = {"first_lost": cut, "at_byte": size}
    return index


def _terminated(tar_path: str, offset: int) -> bool:
    """Whether a zero block (the end-of-archive marker) follows the last member at ``offset``."""
    with open(tar_path, "rb") as f:
        f.seek(offset)
        block = f.read(_BLOCK)
    return len(block) == _BLOCK and not any(block)


def _first_lost(samples: list, size: int) -> int:
    """The number of the first sample a cut at byte ``size`` lost: one with a member past the end,
    else a last sample missing its audio or transcript (its later members were cut), else the next."""
    for n, (_, members) in enumerate(samples, start=1):
        if any(m.offset_data + m.size > size for m in members.values()):
            return n
    if samples:
        exts = [x.rsplit(".", 1)[-1].lower() for x in samples[-1][1]]
        if not any(x in AUDIO_EXTS for x in exts) or not ({"json", "txt"} & set(exts)):
            return len(samples)
    return len(samples) + 1


def _say_how_many_lost(indexes: list[dict]) -> None:
    """Add to each truncated shard's problem how many samples the set's complete shards hold: a
    shard without an index cannot tell how many followed its cut, its siblings give the guess."""
    full = [len(x["keys"]) + len(x["problems"]) for x in indexes if "truncated" not in x]
    for x in indexes:
        if "truncated" in x and not x["truncated"].get("told"):
            first, problem = x["truncated"]["first_lost"], x["problems"][-1]
            guess = (f"; the other shards of this set hold up to {max(full)} samples: about "
                     f"{max(1, max(full) - first + 1)} lost" if full else "; how many followed is not known")
            problem[2] = problem[2].replace(" (copy the shard again)", f"{guess} (copy the shard again)")
            x["truncated"]["told"] = True


def _index_sample(tar: tarfile.TarFile, key: str, members: dict, size: int, cols: dict) -> str:
    audio = next((x for x in members if x.rsplit(".", 1)[-1].lower() in AUDIO_EXTS), None)
    meta = "json" if "json" in members else "txt" if "txt" in members else None
    if audio is None:
        return f"sample has no audio member (members: {', '.join(f'{key}.{x}' for x in members)})"
    if meta is None:
        return f"sample has no transcript ({key}.json with a \"text\" field, or {key}.txt)"
    for x in (audio, meta):
        m = members[x]
        if m.offset_data + m.size > size:
            return (f"truncated shard: member {key}.{x} needs bytes {m.offset_data}..{m.offset_data + m.size}, "
                    f"the file ends at {size}")
    raw = tar.extractfile(members[meta]).read()
    try:
        record = json.loads(raw) if meta == "json" else {"text": raw.decode("utf-8").strip()}
    except (ValueError, UnicodeDecodeError) as e:
        return f"member {key}.{meta} is not valid {'JSON' if meta == 'json' else 'UTF-8'}: {e}"
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        return f"member {key}.{meta} has no \"text\" string"
    duration = record.get("duration")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0:
        try:
            info = sf.info(io.BytesIO(tar.extractfile(members[audio]).read()))
            duration = info.frames / info.samplerate
        except (RuntimeError, OSError, ValueError, TypeError) as e:
            return f"cannot read the audio header of member {key}.{audio}: {e}"
    cols["keys"].append(key)
    cols["ids"].append(str(record.get("id", key)))
    cols["duration"].append(float(duration))
    cols["text_len"].append(len(text))
    cols["offset"].append(min(members[x].offset for x in members))
    for kind, x in (("audio", audio), ("meta", meta)):
        cols[f"{kind}_ext"].append(x)
        cols[f"{kind}_offset"].append(members[x].offset_data)
        cols[f"{kind}_size"].append(members[x].size)
    return ""


# ---------------------------------------------------------------------- reading


class _PerShard:
    """``view[i]`` = ``values[shard[i]]``: one string per utterance without storing N strings."""

    def __init__(self, values: Sequence[str], shard: np.ndarray):
        self.values, self.shard = list(values), shard

    def __len__(self) -> int:
        return len(self.shard)

    def __getitem__(self, i: int) -> str:
        return self.values[int(self.shard[i])]


@dataclass
class ShardSet:
    """The index of a list of shards, as flat arrays over their utterances (shard-major order).

    ``problems`` are the samples the indexes leave out (or that lie past the end of a truncated
    shard); ``load_shards`` applies ``data.bad_data`` to them.
    """

    paths: list[str]
    shard: np.ndarray  # int64 per utterance: index into paths
    number: np.ndarray  # int64: the sample's 1-based number within its shard (for messages)
    keys: PackedStrings
    duration: np.ndarray  # float64 seconds
    text_len: np.ndarray  # int64 characters
    exts: list[str]  # member extensions: audio and meta members are stored as codes into this table
    audio_code: np.ndarray
    audio_offset: np.ndarray
    audio_size: np.ndarray
    meta_code: np.ndarray
    meta_offset: np.ndarray
    meta_size: np.ndarray
    problems: list[Problem] = field(default_factory=list)
    ids: Optional[PackedStrings] = None  # the records' utterance ids (None: a version-1 index, the keys stand in)

    def __len__(self) -> int:
        return int(self.duration.size)

    def subset(self, keep: np.ndarray) -> "ShardSet":
        """The utterances where the boolean mask ``keep`` is True (problems kept as they are)."""
        idx = np.flatnonzero(keep)
        pick = lambda a: a[idx]  # noqa: E731
        return ShardSet(self.paths, pick(self.shard), pick(self.number), PackedStrings([self.keys[i] for i in idx]),
                        pick(self.duration), pick(self.text_len), self.exts, pick(self.audio_code),
                        pick(self.audio_offset), pick(self.audio_size), pick(self.meta_code),
                        pick(self.meta_offset), pick(self.meta_size), list(self.problems),
                        None if self.ids is None else PackedStrings([self.ids[i] for i in idx]))

    def utterance_id(self, i: int) -> str:
        """The id of utterance ``i`` (its record's ``id``; the key where the index has no ids)."""
        return (self.ids if self.ids is not None else self.keys)[i]

    def fingerprint(self) -> bytes:
        """Bytes that identify the utterances (keys, durations), for the ranks' agreement check."""
        return b"\0".join(self.keys[i].encode() for i in range(len(self))) + np.round(self.duration, 4).tobytes()


def load_shards(specs: Union[str, Sequence[str]]) -> ShardSet:
    """Read (or build) the indexes of the shards ``specs`` name (see :func:`is_shard_spec`).

    Missing or stale indexes are built; with a process group, rank ``r`` builds every W-th one and
    the ranks exchange them, so a set of new shards is read once, not W times.

    Raises:
        DataError: no shards match, a compressed shard, a shard that is not a tar, an index that
            is not ddptrain's (it names the file: delete it to rebuild).
    """
    specs = [specs] if isinstance(specs, (str, os.PathLike)) else list(specs)
    paths = [p for s in specs for p in resolve_shards(s)]
    indexes: list[Optional[dict]] = [_read_index(p) for p in paths]
    missing = [i for i, x in enumerate(indexes) if x is None]
    w, r = dist.get_world_size(), dist.get_rank()
    if w > 1:  # agree on the list: a rank that looks later may find indexes another rank just saved
        missing = sorted(set().union(*dist.all_gather_object(missing)))
    if missing:
        mine = {i: build_index(paths[i]) for i in missing[r::w]}
        unsaved = [paths[i] for i, x in mine.items() if not x["problems"] and not _save_index(paths[i], x)]
        if unsaved:
            log.warning("could not save the index of %d shard(s) next to them (read-only folder?), e.g. %s: "
                        "they are indexed again by every run", len(unsaved), unsaved[0])
        built = mine if w == 1 else {i: x for part in dist.all_gather_object(mine) for i, x in part.items()}
        for i in missing:
            indexes[i] = built[i]
        _say_how_many_lost(indexes)
    return _flatten(paths, indexes)


def _read_index(tar_path: str) -> Optional[dict]:
    """The saved index, or None when there is none or it is stale (built again by the caller)."""
    path = index_path(tar_path)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable shard index ({e}); delete it to have it rebuilt") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or index.get("version") not in (1, 2):
        raise DataError(f"{path}: not a {INDEX_FORMAT} version 1 or {INDEX_VERSION} file; delete it to have it rebuilt")
    lengths = {len(index.get(k, ())) for k in (_V1_COLUMNS if index["version"] == 1 else _COLUMNS)}
    if len(lengths) != 1:
        raise DataError(f"{path}: columns of different lengths; delete it to have it rebuilt")
    size = os.path.getsize(tar_path)
    if size > index["tar_bytes"]:  # the shard was rewritten after its index
        log.warning("%s is larger than its index says (%d > %d bytes): indexing it again", tar_path, size,
                    index["tar_bytes"])
        return None
    if size == index["tar_bytes"] and "signature" in index and _signature(tar_path, index["offset"]) != index["signature"]:
        log.warning("%s: its index %s is stale (the tar's member headers are not the ones it recorded: the tar "
                    "was rewritten after it, to the same size): indexing it again", tar_path, path)
        return None
    return index


def _flatten(paths: list[str], indexes: list[dict]) -> ShardSet:
    exts: dict[str, int] = {}
    cols: dict[str, list] = {k: [] for k in ("shard", "number", "duration", "text_len", "audio_code", "audio_offset",
                                             "audio_size", "meta_code", "meta_offset", "meta_size")}
    keys: list[str] = []
    ids: Optional[list[str]] = []
    problems: list[Problem] = []
    for s, (path, index) in enumerate(zip(paths, indexes)):
        n = len(index["keys"])
        size = os.path.getsize(path)
        # the samples an index leaves out keep their numbers, so the others' are not 1..n
        left_out = np.array([int(p[0]) for p in index["problems"]], dtype=np.int64)
        numbers = np.setdiff1d(np.arange(1, n + 1 + left_out.size, dtype=np.int64), left_out)[:n]
        for num, key, why in index["problems"]:
            problems.append(Problem(path, int(num), str(key), why))
        end = np.maximum(np.asarray(index["audio_offset"], np.int64) + np.asarray(index["audio_size"], np.int64),
                         np.asarray(index["meta_offset"], np.int64) + np.asarray(index["meta_size"], np.int64))
        cut = end > size
        for j in np.flatnonzero(cut):
            problems.append(Problem(path, int(numbers[j]), index["keys"][j],
                                    f"truncated shard: member {index['keys'][j]}.{index['audio_ext'][j]} ends at "
                                    f"byte {int(end[j])}, the file has {size} of the {index['tar_bytes']} bytes "
                                    f"its index expects (copy the shard again)"))
        ok = ~cut
        keys += [k for k, good in zip(index["keys"], ok) if good]
        if ids is not None and "ids" in index:
            ids += [k for k, good in zip(index["ids"], ok) if good]
        else:
            ids = None  # a version-1 index among them: the keys stand in for all ids
        cols["shard"].append(np.full(int(ok.sum()), s, dtype=np.int64))
        cols["number"].append(numbers[ok])
        for col, name in (("duration", "duration"), ("text_len", "text_len"), ("audio_offset", "audio_offset"),
                          ("audio_size", "audio_size"), ("meta_offset", "meta_offset"), ("meta_size", "meta_size")):
            cols[col].append(np.asarray(index[name], dtype=np.float64 if col == "duration" else np.int64)[ok])
        for col, name in (("audio_code", "audio_ext"), ("meta_code", "meta_ext")):
            cols[col].append(np.array([exts.setdefault(x, len(exts)) for x, good in zip(index[name], ok) if good],
                                      dtype=np.int64))
    cat = {k: np.concatenate(v) if v else np.zeros(0, np.float64 if k == "duration" else np.int64)
           for k, v in cols.items()}
    return ShardSet(paths, cat["shard"], cat["number"], PackedStrings(keys), cat["duration"], cat["text_len"],
                    list(exts), cat["audio_code"], cat["audio_offset"], cat["audio_size"], cat["meta_code"],
                    cat["meta_offset"], cat["meta_size"], problems, None if ids is None else PackedStrings(ids))


def decode_audio(data: bytes, name: str, sample_rate: Optional[int] = None, speed: float = 1.0) -> torch.Tensor:
    """Decode an in-memory audio file like :func:`~ddptrain.data.audio.load_audio` reads one from disk.

    Raises:
        AudioError: undecodable, empty or non-finite audio (the message names ``name``).
    """
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sr = f.samplerate
            samples = f.read(dtype="float32", always_2d=True)
    except (RuntimeError, OSError, ValueError, TypeError, sf.SoundFileError) as e:
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise AudioError(f"cannot decode audio {name}: {why}") from None
    if samples.shape[0] == 0:
        raise AudioError(f"zero-length audio: {name}")
    if not np.isfinite(samples).all():
        raise AudioError(f"non-finite (NaN/inf) samples in {name}")
    wave = torch.from_numpy(samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0])
    return resample(wave, sr, sample_rate or sr, speed)


class ShardDataset(SpeechDataset):
    """:class:`SpeechDataset` over shards: the same examples, bad-data policy and augmentation,
    read from tar members by offset instead of from one file per utterance.

    Each worker keeps its shards open (up to ``max_open`` file descriptors, least recently used
    closed first) and reads with ``os.pread``, which has no shared file position, so forked
    workers may share nothing.

    Args:
        shards: the index (:func:`load_shards`).
        cfg: data config (audio, features, augmentation, ``bad_data``).
        tokenizer: ``CharTokenizer`` or ``None``.
        train: augmentation on (as for SpeechDataset).
        max_open: file descriptors a worker keeps open.
    """

    def __init__(self, shards: ShardSet, cfg: DataConfig, tokenizer=None, train: bool = False, max_open: int = 256):
        self.set = shards
        self.ids = shards.keys  # until the record is read; messages name the shard and key
        self.sources = _PerShard(shards.paths, shards.shard)
        self.paths = self.sources
        self.lines = shards.number
        self.durations = shards.duration
        self.max_open = int(max_open)
        self._fds: dict[int, int] = {}
        self._fd_pid = os.getpid()
        self._setup(check_section(cfg, "data"), tokenizer, train)

    def __len__(self) -> int:
        return len(self.set)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fds"] = {}  # descriptors do not travel to spawned workers
        return state

    def __del__(self):
        self.close()

    def close(self) -> None:
        """Close this process's shard files (reopened on demand)."""
        if getattr(self, "_fd_pid", None) == os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds = {}

    def _fd(self, s: int) -> int:
        if self._fd_pid != os.getpid():  # a forked worker: the parent's descriptors are the parent's
            self._fds, self._fd_pid = {}, os.getpid()
        fd = self._fds.pop(s, None)
        if fd is None:
            if len(self._fds) >= self.max_open:
                os.close(self._fds.pop(next(iter(self._fds))))
            path = self.set.paths[s]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise DataError(f"cannot open shard {path}: {e}") from None
        self._fds[s] = fd  # most recently used last
        return fd

    def _member(self, i: int, offset: int, size: int, name: str) -> bytes:
        s = int(self.set.shard[i])
        data = os.pread(self._fd(s), int(size), int(offset))
        if len(data) < size:
            path = self.set.paths[s]
            raise DataError(f"truncated shard: member {name} needs bytes {offset}..{offset + size}, {path} ends at "
                            f"{os.path.getsize(path)} (copy the shard again)")
        return data

    def _read(self, i: int, speed: float) -> tuple[torch.Tensor, str, str]:
        st, key = self.set, self.set.keys[i]
        meta_name = f"{key}.{st.exts[int(st.meta_code[i])]}"
        raw = self._member(i, st.meta_offset[i], st.meta_size[i], meta_name)
        try:
            record = json.loads(raw) if meta_name.endswith(".json") else {"text": raw.decode("utf-8").strip()}
            text = record["text"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise DataError(f"member {meta_name}: no readable transcript ({type(e).__name__}: {e})") from None
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"empty text (member {meta_name})")
        audio_name = f"{key}.{st.exts[int(st.audio_code[i])]}"
        data = self._member(i, st.audio_offset[i], st.audio_size[i], audio_name)
        wave = decode_audio(data, f"member {audio_name} of {st.paths[int(st.shard[i])]}", self.cfg.sample_rate, speed)
        self._check_duration(i, wave, speed, f"member {audio_name}")
        return wave, text, str(record.get("id", key))


def shard_problems(shards: ShardSet, cfg: DataConfig) -> tuple[list[Problem], np.ndarray]:
    """What the index tells about each utterance before any audio is read: the checks of
    ``validate.py`` that need only a duration and a text length (too long for the budget,
    shorter than a feature frame, empty text, a text too long for CTC -- counted in characters,
    which a character tokenizer maps one to one; repeats are found when the utterance loads).

    Returns:
        ``(problems, bad)``: one problem per failed check, and a mask of the utterances with any.
    """

    speeds = [float(s) for s in cfg.speed_perturb] or [1.0]
    slow, fast = min(speeds), max(speeds)
    d, n = shards.duration, shards.text_len
    checks = [
        (padded_cost(d / slow, cfg.quadratic_duration) > cfg.max_duration,
         lambda i: f"too long: {d[i]:.2f}s does not fit in a batch of max_duration={cfg.max_duration}s"),
        ((d > cfg.max_utterance_duration) if cfg.max_utterance_duration > 0 else np.zeros(d.size, bool),
         lambda i: f"too long: {d[i]:.2f}s > max_utterance_duration={cfg.max_utterance_duration}s"),
        ((d < cfg.frame_length_ms / 1000) if cfg.features != "raw" else np.zeros(d.size, bool),
         lambda i: f"shorter than one feature frame: {d[i] * 1000:.1f} ms < {cfg.frame_length_ms} ms"),
        (n == 0, lambda i: "empty text"),
        ((n > np.floor(d / fast * cfg.output_frame_rate)) if cfg.output_frame_rate > 0 else np.zeros(d.size, bool),
         lambda i: f"text too long for CTC: {n[i]} characters need more than the "
                   f"{int(d[i] / fast * cfg.output_frame_rate)} output frames of {d[i]:.2f}s"),
    ]
    out, bad = [], np.zeros(d.size, dtype=bool)
    for mask, why in checks:
        bad |= mask
        for i in np.flatnonzero(mask):
            out.append(Problem(shards.paths[int(shards.shard[i])], int(shards.number[i]), shards.keys[i], why(i)))
    return out, bad


def decode_problems(shards: ShardSet, cfg: DataConfig, indices: Optional[Sequence[int]] = None,
                    num_threads: int = 8) -> list[Problem]:
    """Read and decode utterances of a shard set (all, or those at ``indices``): what
    ``data.validate_decode`` finds in a manifest's audio files, with the same reasons --
    ``unreadable audio``, ``zero-length audio``, ``non-finite samples``, ``duration mismatch``
    (the index's duration against the decoded length, ``data.duration_tolerance``), and a
    transcript member that does not read (``empty text``, ``unreadable transcript``).

    Returns:
        One problem per bad utterance, in shard order.
    """
    idx = np.arange(len(shards)) if indices is None else np.asarray(indices, dtype=np.int64)
    groups = [idx[shards.shard[idx] == s] for s in np.unique(shards.shard[idx])]

    def check(members: np.ndarray) -> list[Problem]:
        path = shards.paths[int(shards.shard[members[0]])]
        out = []
        fd = os.open(path, os.O_RDONLY)  # pread: one descriptor serves the thread, no shared position
        try:
            for i in members:
                why = _member_problem(fd, shards, int(i), cfg.duration_tolerance)
                if why:
                    out.append(Problem(path, int(shards.number[i]), shards.utterance_id(int(i)), why))
        finally:
            os.close(fd)
        return out

    with ThreadPoolExecutor(max(1, num_threads)) as pool:  # libsndfile releases the GIL while decoding
        return [p for part in pool.map(check, groups) for p in part]


def _member_problem(fd: int, st: ShardSet, i: int, tolerance: float) -> str:
    key = st.keys[i]
    meta, audio = f"{key}.{st.exts[int(st.meta_code[i])]}", f"{key}.{st.exts[int(st.audio_code[i])]}"
    raw = os.pread(fd, int(st.meta_size[i]), int(st.meta_offset[i]))
    try:
        record = json.loads(raw) if meta.endswith(".json") else {"text": raw.decode("utf-8")}
        text = record["text"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        return f"unreadable transcript: member {meta} ({type(e).__name__}: {e})"
    if not isinstance(text, str) or not text.strip():
        return f"empty text (member {meta})"
    data = os.pread(fd, int(st.audio_size[i]), int(st.audio_offset[i]))
    if len(data) < st.audio_size[i]:
        return f"truncated shard: member {audio} needs {int(st.audio_size[i])} bytes, {len(data)} are there"
    frames = 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate = f.samplerate
            for block in f.blocks(blocksize=1 << 16, dtype="float32", always_2d=True):
                if not np.isfinite(block).all():
                    return f"non-finite samples: NaN/inf in member {audio}"
                frames += block.shape[0]
    except (RuntimeError, OSError, ValueError, TypeError, sf.SoundFileError) as e:
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return f"unreadable audio: cannot decode audio member {audio}: {why}"
    if frames == 0:
        return f"zero-length audio: member {audio}"
    if abs(frames / rate - float(st.duration[i])) > tolerance:
        return f"duration mismatch: the index says {float(st.duration[i]):.3f}s, member {audio} has {frames / rate:.3f}s"
    return ""


def check_shards(shards: ShardSet, cfg: DataConfig, decode: bool) -> tuple[list[Problem], np.ndarray]:
    """Validation of a shard set as of a manifest's lines: :func:`shard_problems` (from the index)
    and, with ``decode`` (``data.validate_decode``), :func:`decode_problems`, each rank of a
    process group decoding every W-th utterance.

    Returns:
        ``(problems, bad)``: the problems and a mask of the utterances with any.
    """
    problems, bad = shard_problems(shards, cfg)
    if decode:
        w, r = dist.get_world_size(), dist.get_rank()
        mine = decode_problems(shards, cfg, np.arange(len(shards))[r::w])
        found = mine if w == 1 else [p for part in dist.all_gather_object(mine) for p in part]
        where = {(shards.paths[int(s)], int(n)): i for i, (s, n) in enumerate(zip(shards.shard, shards.number))}
        for p in found:
            bad[where[(p.source, p.line)]] = True
        problems += found
    return problems, bad


# ---------------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog=cli_prog("ddptrain.data.shards"),
        description="Write a manifest's utterances as WebDataset-layout tar shards with an index each "
                    "(MANIFEST OUT_DIR), or index existing shards (--index SHARDS...).")
    p.add_argument("paths", nargs="+", help="MANIFEST OUT_DIR; with --index: shard folders, globs or files")
    p.add_argument("--shard-size", type=int, default=1000, help="utterances per shard (default 1000)")
    p.add_argument("--no-shuffle", action="store_true", help="keep the manifest order (default: shuffled)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--audio", choices=("keep", "flac", "wav"), default="keep",
                   help="keep the audio files' bytes (default), or re-encode every utterance")
    p.add_argument("--prefix", default="shard", help="shard file-name prefix")
    p.add_argument("--index", action="store_true", help="(re)build the indexes of existing shards")
    p.add_argument("--field", action="append", default=[], metavar="FIELD=KEY",
                   help="a manifest key of another name, as data.fields (e.g. audio=wav); repeatable")
    a = p.parse_args(argv)
    try:
        if a.index:
            for path in (q for s in a.paths for q in resolve_shards(s)):
                index = build_index(path)
                for num, key, why in index["problems"]:
                    print(f"{path}:{num} (id {key}): {why}")
                if not index["problems"] and not _save_index(path, index):
                    print(f"error: cannot write {index_path(path)}", file=sys.stderr)
                    return 1
                print(f"{index_path(path)}: {len(index['keys'])} utterance(s)"
                      + (f", {len(index['problems'])} problem(s): not saved" if index["problems"] else ""))
            return 0
        if len(a.paths) != 2:
            p.error("expected MANIFEST OUT_DIR")
        paths = write_shards(a.paths[0], a.paths[1], a.shard_size, not a.no_shuffle, a.seed, a.audio, a.prefix,
                             parse_field_args(a.field))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(paths)} shard(s) to {a.paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
