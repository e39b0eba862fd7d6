"""The TTS latent cache: a corpus encoded to VAE latents once, cached next to each manifest.

VoxCPM trains on the latents of its frozen AudioVAE. Upstream's script encodes every utterance
with the VAE again in every step; here the VAE runs once per utterance, before training, and the
trained module never holds it. For ``DIR/NAME.jsonl`` the cache is the folder ``DIR/NAME.latents/``:

* ``meta.json``: what the latents depend on: the VAE (its architecture, its config with the input
  sample rate, and a SHA-256 of its weights as loaded: ``finetune_tts.vae_spec``) and the patch
  size; beside them ``vae_source``, where those weights were read (the weights file with its size
  and modification time, or a random VAE's preset and seed), which memoises the hash: a later run
  of the same file does not hash it again, and a moved or copied model folder keeps its caches;
* ``index.jsonl``: one line per utterance: id, text, manifest line, the audio file's size and
  modification time, latent frames and the latent file; upstream VoxCPM's ``ref_audio`` and
  ``dataset_id`` when the line has them (passed through to :class:`CachedUtterance`);
* ``<hash of the id>.npy``: ``(frames, latent_dim)`` float32;
* for VoxCPM2 (``encode_ref``), each line's ``ref_audio`` encoded the same way into its own
  ``.npy`` (the index's ``ref_latent``, ``ref_frames`` and ``ref_audio_key``), so the reference
  conditioning costs no VAE pass in training either.

With ``min_sample_rate`` (VoxCPM2: the VAE's input rate, read from the model), an audio or
ref_audio file recorded at a lower rate is a bad line naming the file: upsampled audio has no top
band and the model learns to speak muffled. Higher rates are resampled to the VAE's, as for 1.5.

Rerunning :func:`prepare` is a no-op when nothing changed (no file is written, the VAE is not even
loaded); utterances whose audio changed, or that are new, are encoded; a different VAE (weights,
config or architecture) or patch size starts the cache over, and :func:`read_cache` refuses it,
naming what differs. A cache of the first format (keyed on the VAE file's path, size and
modification time) is taken over without encoding while that file is unchanged. Bad data is
handled as ``ddptrain.data.validate`` handles it, each case named by manifest file and line in
its words: malformed lines and duplicate ids (found before anything is encoded), then missing,
unreadable, corrupt or zero-length audio (found by encoding); ``data.bad_data: error`` stops
after listing every bad one, ``skip`` leaves them out of the cache. The recipe
(examples/finetune_tts.py) prepares its manifests itself on rank 0 before training; ``python
examples/prepare_tts.py`` does it beforehand.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import numpy as np

from ddptrain.data import DataError, Problem, load_audio
from ddptrain.data.audio import AudioError
from ddptrain.data.validate import finish_report, read_entries

CACHE_FORMAT = "ddptrain-tts-latents/2"
LEGACY_FORMAT = "ddptrain-tts-latents/1"  # meta.json's "vae" was the file's path, size and modification time


@dataclass(frozen=True)
class CachedUtterance:
    id: str
    text: str
    latent_path: str  # absolute
    frames: int  # latent frames (a multiple of the patch size)
    source: str  # manifest
    line: int  # its 1-based line
    ref_audio: Optional[str] = None  # the line's reference recording (absolute path), upstream VoxCPM2's ref_audio
    dataset_id: Union[int, str, None] = None  # the line's dataset_id, as upstream VoxCPM's JSONL gives it
    ref_latent_path: Optional[str] = None  # ref_audio's latents (absolute), when the cache encodes references
    ref_frames: int = 0  # their latent frames


def cache_dir(manifest: str) -> str:
    """``DIR/NAME.jsonl`` -> ``DIR/NAME.latents``."""
    stem = manifest[:-len(".jsonl")] if manifest.endswith(".jsonl") else manifest
    return stem + ".latents"


def _latent_name(utt_id: str) -> str:
    return hashlib.blake2b(utt_id.encode(), digest_size=10).hexdigest() + ".npy"


def _file_key(path: str) -> list:
    st = os.stat(path) if os.path.exists(path) else None
    return [path, st.st_size if st else None, st.st_mtime_ns if st else None]


def _rate_problem(path: str, min_rate: int, what: str) -> Optional[str]:
    """Why ``path`` (read from its header) is recorded below ``min_rate``, or None."""
    if not min_rate or not os.path.isfile(path):
        return None  # a missing file is reported by the load that follows
    import soundfile as sf

    try:
        rate = sf.info(path).samplerate
    except (RuntimeError, OSError):
        return None  # unreadable: reported by the load that follows
    if rate >= min_rate:
        return None
    return (f"{what} {path} is recorded at {rate} Hz, below the VAE's input rate of {min_rate} Hz (the model's "
            f"config.json audio_vae_config.sample_rate): upsampled audio has no top band and the model learns to "
            f"speak muffled; use recordings at {min_rate} Hz or more, or leave this line out")


def _audio_key(entry) -> list:
    st = os.stat(entry.audio_filepath) if os.path.exists(entry.audio_filepath) else None
    return [entry.audio_filepath, entry.offset, entry.duration if entry.is_segment else None,
            st.st_size if st else None, st.st_mtime_ns if st else None]


def _write_atomic(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader never sees half a file


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_index(path: str) -> dict:
    rows = {}
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    rows[row["id"]] = row
    except (OSError, ValueError, KeyError):
        return {}
    return rows


PASSED = ("ref_audio", "dataset_id")


def _passed(entry) -> dict:
    """The line's upstream keys that training may need (only those it has: an older index stays as it was)."""
    return {k: getattr(entry, k) for k in PASSED if getattr(entry, k) is not None}


def prepare(manifest: str, vae_spec: dict, patch_size: int, get_vae: Callable[[], tuple],
            bad_data: str = "error", log: Callable[[str], None] = print,
            fields: Optional[Mapping[str, str]] = None, encode_ref: bool = False, min_sample_rate: int = 0,
            vae_source: Optional[dict] = None) -> dict:
    """Bring ``manifest``'s latent cache up to date.

    Args:
        manifest: a JSONL manifest in any of ddptrain/data/manifest.py's spellings: NeMo's
            (audio_filepath, text [, duration, offset, id]) or upstream VoxCPM's (audio, text
            [, duration, ref_audio, dataset_id]); a line without duration gets its header's.
        vae_spec: what identifies the VAE (JSON-able; see :func:`finetune_tts.vae_spec`).
        patch_size: the model's latent frames per LM position (latents are padded to whole patches).
        get_vae: ``() -> (vae, encode)`` with ``encode(vae, wave) -> (frames, D) tensor``; called
            only if something needs encoding.
        bad_data: ``error``: raise naming every unreadable utterance; ``skip``: leave them out.
        log: where the one-line summary goes.
        fields: ``data.fields`` (manifest keys of other names).
        encode_ref: also encode each line's ``ref_audio`` (VoxCPM2's reference conditioning).
        min_sample_rate: refuse audio recorded below this rate, naming the file (0: no check).
        vae_source: where the VAE's weights were read (JSON-able; see :func:`finetune_tts.vae_source`):
            recorded beside ``vae_spec`` for :func:`recorded_vae`.

    Returns:
        ``{"dir", "encoded", "reused", "skipped", "written"}`` (``written``: whether any file changed).

    Raises:
        DataError: under ``bad_data: error``, malformed manifest lines or duplicate ids (before
            anything is encoded), or unreadable/corrupt audio (every such utterance named with its
            manifest line and file). ``skip`` leaves them all out of the cache.
    """
    folder = cache_dir(manifest)
    # the shared manifest checks and policy (ddptrain/data/validate.py): bad lines and duplicate
    # ids are named by file:line, and under bad_data=error stop the run before any encoding
    entries, problems = read_entries(manifest, fields)
    usable = finish_report(entries, problems, bad_data).entries
    meta = _meta(vae_spec, patch_size, encode_ref)
    old_meta = _read_json(os.path.join(folder, "meta.json"))
    current = _key(old_meta) == meta or _legacy_current(old_meta, vae_source, patch_size, encode_ref)
    old = _read_index(os.path.join(folder, "index.jsonl")) if current else {}
    if vae_source is not None:
        meta = {**meta, "vae_source": vae_source}
    rows, todo, unreadable = [], [], []
    for e in usable:
        key, prev = _audio_key(e), old.get(e.id)
        ref_key = _file_key(e.ref_audio) if encode_ref and e.ref_audio else None
        if (prev is not None and prev.get("audio") == key and os.path.isfile(os.path.join(folder, prev["latent"]))
                and prev.get("ref_audio_key") == ref_key
                and (ref_key is None or os.path.isfile(os.path.join(folder, prev["ref_latent"])))):
            kept = {k: v for k, v in prev.items() if k not in PASSED}  # a line may have dropped its ref_audio
            rows.append({**kept, "text": e.text, "line": e.line, **_passed(e)})
        else:
            rows.append(None)
            todo.append((len(rows) - 1, e, key, ref_key))
    vae = encode = None
    for slot, e, key, ref_key in todo:
        rate_problem = _rate_problem(e.audio_filepath, min_sample_rate, "audio") or (
            _rate_problem(e.ref_audio, min_sample_rate, "ref_audio") if ref_key else None)
        if rate_problem:
            unreadable.append(Problem(e.source, e.line, e.id, rate_problem))
            continue
        if vae is None:
            vae, encode = get_vae()
            os.makedirs(folder, exist_ok=True)
        try:
            wave = load_audio(e.audio_filepath, int(vae.sample_rate), e.offset, e.duration if e.is_segment else None)
        except AudioError as err:  # worded as ddptrain.data.validate words it (its reasons can be grepped)
            reason = str(err) if str(err).startswith("zero-length audio") else f"unreadable audio: {err}"
            if not os.path.exists(e.audio_filepath):
                reason = f"missing audio file: {e.audio_filepath}"
            unreadable.append(Problem(e.source, e.line, e.id, reason))
            continue
        ref = {}
        if ref_key:
            try:
                ref_wave = load_audio(e.ref_audio, int(vae.sample_rate))
            except AudioError as err:
                unreadable.append(Problem(e.source, e.line, e.id, f"unreadable ref_audio: {err}"))
                continue
            zr = np.ascontiguousarray(encode(vae, ref_wave).numpy().astype(np.float32))
            ref_name = _latent_name(e.id + "\0ref_audio")
            _write_atomic(os.path.join(folder, ref_name), lambda f: np.save(f, zr))
            ref = {"ref_audio_key": ref_key, "ref_latent": ref_name, "ref_frames": int(zr.shape[0])}
        z = np.ascontiguousarray(encode(vae, wave).numpy().astype(np.float32))
        name = _latent_name(e.id)
        _write_atomic(os.path.join(folder, name), lambda f: np.save(f, z))
        rows[slot] = {"id": e.id, "text": e.text, "line": e.line, "audio": key, "latent": name, "frames": int(z.shape[0]),
                      **ref, **_passed(e)}
    report = finish_report(entries, problems + unreadable, bad_data)  # error: every bad line, in manifest order
    for p in report.problems:
        log(f"skipped: {p}")
    skipped = report.num_skipped
    rows = [r for r in rows if r is not None]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    written = len(todo) > len(unreadable)  # some latents were written
    index_path, meta_path = os.path.join(folder, "index.jsonl"), os.path.join(folder, "meta.json")
    if not os.path.isfile(index_path) or open(index_path).read() != text:
        os.makedirs(folder, exist_ok=True)
        _write_atomic(index_path, lambda f: f.write(text.encode()))
        written = True
    if old_meta != meta:
        _write_atomic(meta_path, lambda f: f.write(json.dumps(meta, indent=1).encode()))
        written = True
    encoded = len(todo) - len(unreadable)
    summary = {"dir": folder, "encoded": encoded, "reused": len(rows) - encoded, "skipped": skipped, "written": written}
    log(f"{manifest}: {encoded} encoded, {summary['reused']} cached"
        + (f", {skipped} skipped (bad lines or audio)" if skipped else "") + f" -> {folder}")
    return summary


def _meta(vae_spec: dict, patch_size: int, encode_ref: bool) -> dict:
    meta = {"format": CACHE_FORMAT, "vae": vae_spec, "patch_size": int(patch_size)}
    if encode_ref:  # a 1.5 cache keeps the meta it always had
        meta["ref_audio"] = "encoded"
    return meta


def _key(meta: Optional[dict]) -> Optional[dict]:
    """What of ``meta.json`` the latents depend on (``vae_source`` only memoises the VAE's hash)."""
    return {k: v for k, v in meta.items() if k != "vae_source"} if isinstance(meta, dict) else None


def _legacy_current(meta: Optional[dict], vae_source: Optional[dict], patch_size: int, encode_ref: bool) -> bool:
    """Whether a first-format cache was encoded by the VAE of ``vae_source``: its ``vae`` named the
    same file with the same size and modification time (or the same random VAE)."""
    return (isinstance(meta, dict) and vae_source is not None and meta.get("format") == LEGACY_FORMAT
            and meta.get("vae") == vae_source and meta.get("patch_size") == int(patch_size)
            and ("ref_audio" in meta) == encode_ref)


def recorded_vae(manifest: str, vae_source: dict) -> Optional[dict]:
    """The VAE spec ``manifest``'s cache recorded for weights read from ``vae_source`` (its hash,
    computed then), or None: the cache holds another source, or none."""
    meta = _read_json(os.path.join(cache_dir(manifest), "meta.json"))
    if isinstance(meta, dict) and meta.get("format") == CACHE_FORMAT and meta.get("vae_source") == vae_source:
        return meta.get("vae")
    return None


def _differences(old, new, prefix: str = "") -> list[str]:
    """``key: old (this run: new)`` for each key whose values differ, nested keys dotted."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [f"{prefix or 'value'}: {old} (this run: {new})"]
    return [d for k in sorted(set(old) | set(new), key=str)
            for d in _differences(old.get(k), new.get(k), f"{prefix}{k}" if not prefix else f"{prefix}.{k}")]


def read_cache(manifest: str, vae_spec: dict, patch_size: int, encode_ref: bool = False) -> list[CachedUtterance]:
    """The cached utterances of ``manifest`` (after :func:`prepare`).

    Raises:
        DataError: no cache, one made with another VAE or patch size, or a latent file missing.
    """
    folder = cache_dir(manifest)
    meta = _read_json(os.path.join(folder, "meta.json"))
    want = _meta(vae_spec, patch_size, encode_ref)
    hint = f"run: python examples/prepare_tts.py --config CONFIG {manifest}"
    if meta is None:
        raise DataError(f"{manifest}: no latent cache in {folder} ({hint})")
    if meta.get("format") != CACHE_FORMAT:
        raise DataError(f"{folder} is a latent cache of another format ({meta.get('format')}; this run reads "
                        f"{CACHE_FORMAT}); {hint} (it keeps the latents when the VAE is the one they were made with)")
    if _key(meta) != want:
        raise DataError(f"{folder} was made with another VAE or patch size: "
                        f"{'; '.join(_differences(_key(meta), want))}; {hint}")
    out = []
    for row in _read_index(os.path.join(folder, "index.jsonl")).values():
        path = os.path.join(folder, row["latent"])
        if not os.path.isfile(path):
            raise DataError(f"{manifest}:{row['line']} (id {row['id']}): latent file {path} is missing; {hint}")
        ref_path = os.path.abspath(os.path.join(folder, row["ref_latent"])) if row.get("ref_latent") else None
        if ref_path and not os.path.isfile(ref_path):
            raise DataError(f"{manifest}:{row['line']} (id {row['id']}): ref_audio latent file {ref_path} is missing; "
                            f"{hint}")
        out.append(CachedUtterance(row["id"], row["text"], os.path.abspath(path), int(row["frames"]),
                                   manifest, int(row["line"]), row.get("ref_audio"), row.get("dataset_id"),
                                   ref_path, int(row.get("ref_frames", 0))))
    return out
