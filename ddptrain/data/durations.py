"""Audio durations read from file headers, cached next to the manifest whose lines lack them.

A manifest line without ``duration`` (upstream VoxCPM's JSONL, most ASR exports) gets the length
of its audio file from the header (``soundfile.info``: frames / sample rate, a few bytes read, no
decoding). For the rare format whose header has no frame count, the file is decoded once to count
its frames, and a warning says which files cost that.

The results are kept in ``DIR/NAME.durations.json`` for the manifest ``DIR/NAME.jsonl``, keyed by
the audio file's resolved path, size and modification time, so a second read of the manifest
opens no audio file and a changed file is read again. Why next to the manifest and not in the
run folder: a duration is a fact of the data, shared by every run, the validator, the shard writer
and the tokenizer build, and parsing a manifest knows no run folder (a data folder read-only to
the user only costs the cache: a warning, and the headers are read each time). The cache is
written atomically (temp file, fsync, rename), so ranks reading one manifest at the same time may
each write it; a cache that cannot be parsed is ignored with a warning and rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

CACHE_FORMAT = "ddptrain-durations/1"
# Below this many files the headers are read in the calling thread (a pool costs more than it saves).
PARALLEL_FROM = 64

log = logging.getLogger(__name__)


def cache_path(manifest: str) -> str:
    """``DIR/NAME.jsonl`` -> ``DIR/NAME.durations.json``."""
    stem = manifest[:-len(".jsonl")] if manifest.endswith(".jsonl") else manifest
    return stem + ".durations.json"


def header_durations(paths: Sequence[str], manifest: str, num_threads: int = 8) -> tuple[dict, dict]:
    """The duration of each audio file, from the cache of ``manifest`` or the file's header.

    Args:
        paths: resolved audio paths (repeats are read once).
        manifest: the manifest they come from (its cache file sits next to it).
        num_threads: parallel header reads for many files (libsndfile releases the GIL).

    Returns:
        ``(seconds, problems)``: ``{path: seconds}`` for the readable files and ``{path: reason}``
        for the others (missing, unreadable header, undecodable), in validate.py's words.
    """
    import soundfile as sf  # here, not at the top: `import ddptrain` (config.py reads FIELDS) loads no audio library

    where = cache_path(manifest)
    cached = _read_cache(where)
    todo = list(dict.fromkeys(paths))

    def one(path: str) -> tuple:  # -> (key or None, seconds or None, reason, decoded)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None, None, f"missing audio file: {path}", False
        except OSError as e:
            return None, None, f"unreadable audio: {path}: {e.strerror or e}", False
        key = [st.st_size, st.st_mtime_ns]
        hit = cached.get(path)
        if hit is not None and hit[:2] == key:
            return None, hit[2], "", False
        try:
            info = sf.info(path)
        except (RuntimeError, OSError, ValueError, TypeError) as e:  # sf.LibsndfileError is a RuntimeError
            return None, None, f"unreadable audio: cannot read audio header of {path}: {_short(e)}", False
        if info.frames == 0:
            return None, None, f"zero-length audio: {path}", False
        if 0 < info.frames < 2 ** 62:
            return key, info.frames / info.samplerate, "", False
        # libsndfile's "unknown length" (SF_COUNT_MAX, e.g. some streamed files): count by decoding
        frames, reason = _decoded_frames(path)
        if reason or not frames:
            return None, None, reason or f"zero-length audio: {path}", False
        return key, frames / info.samplerate, "", True

    if len(todo) >= PARALLEL_FROM and num_threads > 1:
        with ThreadPoolExecutor(min(num_threads, len(todo))) as pool:
            results = list(pool.map(one, todo, chunksize=64))
    else:
        results = [one(p) for p in todo]
    seconds, problems, decoded = {}, {}, []
    fresh = {}
    for path, (key, sec, reason, was_decoded) in zip(todo, results):
        if reason:
            problems[path] = reason
            continue
        seconds[path] = sec
        fresh[path] = key + [sec] if key is not None else cached[path]
        if key is not None and was_decoded:
            decoded.append(path)
    if decoded:
        log.warning("%d audio file(s) have no length in their header (e.g. %s): measured by decoding them, once "
                    "(cached in %s)", len(decoded), decoded[0], where)
    read = sum(1 for key, *_ in results if key is not None)
    if read:  # keep what was read for the next time
        log.info("%s: read the duration of %d audio file(s) from their headers (cached in %s)", manifest, read, where)
        _write_cache(where, fresh)
    return seconds, problems


def _decoded_frames(path: str) -> tuple[int, str]:
    import soundfile as sf

    frames = 0
    try:
        with sf.SoundFile(path) as f:
            for block in f.blocks(blocksize=1 << 16, dtype="float32", always_2d=True):
                frames += block.shape[0]
    except (RuntimeError, OSError, ValueError, sf.SoundFileError) as e:
        return 0, f"unreadable audio: cannot decode {path}: {_short(e)}"
    return frames, ""


def _read_cache(where: str) -> dict:
    """``{path: [size, mtime_ns, seconds]}``; {} when there is none, or with a warning when it is
    not one this module wrote (corrupt, truncated, another format): then it is rebuilt."""
    try:
        with open(where, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the duration cache %s (%s): it is rebuilt", where, e)
        return {}
    files = raw.get("files") if isinstance(raw, dict) and raw.get("format") == CACHE_FORMAT else None
    ok = isinstance(files, dict) and all(
        isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        for v in files.values())
    if not ok:
        log.warning("ignoring the duration cache %s (not a %s file): it is rebuilt", where, CACHE_FORMAT)
        return {}
    return files


def _write_cache(where: str, files: dict) -> Optional[str]:
    tmp = f"{where}.tmp{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format": CACHE_FORMAT, "files": files}, f, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, where)  # a reader sees the old cache or the new one, never half of one
    except OSError as e:
        log.warning("cannot write the duration cache %s (%s): the audio headers are read again next time", where, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    return where


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
