"""What a resumed run may change, and the record of what it changed.

A checkpoint is saved with its config (``config.yaml`` in the checkpoint folder). Resuming with
another config is compared key by key:

* refused (:data:`REFUSED`): keys the saved state means something else under — the precision
  and parameter dtype (loss-scaler state, master weights), the optimizer's kind and sharding
  (its state's layout), the LoRA set-up (the saved adapters' layers, shapes and scaling, the
  parameters a trainable-only checkpoint and the optimizer state cover), and the data keys that
  define the epoch plan (the saved position would point at other batches): the data set, named
  sources and their weights (each source's share of every epoch), shard windows, bucketing. The
  error names every such key, saved vs now. A recipe refuses keys of its own sections through
  its Config subclass (:func:`refused_keys`)::

      @dataclass
      class RecipeConfig(ddptrain.Config):
          tts: TTSConfig = field(default_factory=TTSConfig)
          RESUME_REFUSED: ClassVar[dict[str, str]] = {"tts.path": "the latents come from this model's VAE"}
          RESUME_FOLDERS: ClassVar[tuple[str, ...]] = ("tts.path",)

  A key in ``RESUME_FOLDERS`` names a model file or folder: it may change when only the path
  did (the folder was moved or copied to another node). Each checkpoint holds a fingerprint of
  each such folder (``folders.json``: its files' names and sizes, its ``config.json`` and bytes
  sampled through each file, :func:`fingerprint`), and the new path must match it.
* applied: everything else. ``lora.dropout`` and ``data.eval_sources`` (evaluation only) among
  them, like ``data.eval_manifest``. Optimizer hyperparameters (``optim.lr``, ``weight_decay``,
  betas, ...) are re-applied over the checkpoint's from the resumed step on; the LR schedule
  keeps the horizon of the run that started it, so a new ``trainer.max_steps`` lengthens or
  shortens the run without re-stretching the schedule (past its end the rate stays at the
  floor); ``scheduler.*`` keys reshape it from the resumed step on.

A dict-valued key (``data.train_weights``, ``data.train_sources``: tables keyed by source name)
is compared entry by entry: a change of one weight is the key ``data.train_weights.accent``
(a name with a dot in it: ``data.train_weights[en.us]``), refused or recorded as its table is.

The run folder's ``config.yaml`` is written once, when the run starts; every resume that
changes keys appends a comment block to it (the file still loads as the starting config), and
each checkpoint holds the config it was saved under.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from ddptrain.config import ConfigError

REFUSED = {
    "trainer.precision": "the loss-scaler state and the step-skipping rule belong to the saved precision",
    "trainer.param_dtype": "the saved optimizer state belongs to fp32 master weights or to fp32 parameters",
    "optim.name": "the saved optimizer state has that optimizer's layout",
    "optim.zero": "the optimizer state was saved sharded or unsharded",
    "data.train_manifest": "the saved data position indexes this data set",
    "data.seed": "the saved data position indexes this epoch plan",
    "data.max_duration": "the saved data position indexes this epoch plan",
    "data.max_batch_size": "the saved data position indexes this epoch plan",
    "data.quadratic_duration": "the saved data position indexes this epoch plan",
    "data.num_buckets": "the saved data position indexes this epoch plan",
    "data.bucket_sort_pool": "the saved data position indexes this epoch plan",
    "data.sync_buckets": "the saved data position indexes this epoch plan",
    "data.shuffle": "the saved data position indexes this epoch plan",
    "data.tail": "the saved data position indexes this epoch plan",
    "data.speed_perturb": "the batch budget (and so the epoch plan) depends on the slowest speed",
    "data.train_sources": "the saved data position indexes this data set (these sources)",
    "data.train_weights": "the saved data position indexes this epoch plan (each source's share of every epoch)",
    "data.shard_window": "the saved data position indexes this epoch plan (batches planned within shard windows)",
    "data.mix_temperature": "the saved data position indexes this epoch plan (each source's share of every epoch)",
    "data.source_caps": "the saved data position indexes this epoch plan (what each epoch draws of a capped source)",
    "lora.enabled": "the saved weights and optimizer state hold (or lack) the adapters",
    "lora.targets": "the saved adapters and their optimizer state belong to these layers",
    "lora.rank": "the saved adapters and their optimizer state have this rank's shapes",
    "lora.alpha": "the saved adapters were trained under the scaling alpha / rank: another alpha changes what they add",
    "lora.trainable": "the saved trainable-only weights and the optimizer state cover exactly these parameters",
}
# allowed and recorded, though close to the refused ones: lora.dropout (a training-time
# regularizer, no saved state), data.eval_sources (evaluation only, as data.eval_manifest)
# keys that differ between a run and its resume by their nature
IGNORED = ("checkpoint.resume", "checkpoint.start_over")


def flatten(cfg: Any, tables: frozenset = frozenset()) -> dict:
    """``{"section.key": value}`` of a config object or a YAML text.

    Sections (dataclasses) are walked; every other value is a leaf, a dict-valued key
    (``data.train_weights``) included: its table is one value, which :func:`changes` compares
    entry by entry. A YAML text has no types, so ``tables`` names its dict-valued keys (any other
    mapping in it is taken for a section).
    """
    if isinstance(cfg, str):
        node = OmegaConf.create(cfg)
        walk_into = lambda path: path not in tables  # noqa: E731
    else:
        node = OmegaConf.structured(cfg)
        walk_into = set(_section_paths(node, "")).__contains__
    out: dict = {}

    def walk(d, prefix):
        for k, v in d.items():
            path = f"{prefix}{k}"
            if isinstance(v, Mapping) and walk_into(path):
                walk(v, f"{path}.")
            else:
                out[path] = v

    walk(OmegaConf.to_container(node, resolve=True), "")
    return out


def _section_paths(node: DictConfig, prefix: str):
    """The dotted paths of a structured config's sections (its dataclass-typed nodes)."""
    for k in node.keys():
        if not OmegaConf.is_missing(node, k) and dataclasses.is_dataclass(OmegaConf.get_type(node, k)):
            yield f"{prefix}{k}"
            yield from _section_paths(node[k], f"{prefix}{k}.")


def _entry(table: str, name: Any) -> str:
    """The key of one entry of a dict-valued key: ``table.name``, or ``table[name]`` for a name
    that a dotted path would split."""
    name = str(name)
    return f"{table}[{name}]" if not name or any(c in name for c in ".[]") else f"{table}.{name}"


def _diff(key: str, old: Any, new: Any, out: dict) -> None:
    """Add ``key: (old, new)`` to ``out`` if they differ; tables (dicts; missing = {}) entry by
    entry, so one changed weight is its own key."""
    if old == new:
        return
    if isinstance(old, Mapping) or isinstance(new, Mapping):
        if all(v is None or isinstance(v, Mapping) for v in (old, new)):
            old, new = old or {}, new or {}
            for name in sorted(set(old) | set(new), key=str):
                _diff(_entry(key, name), old.get(name), new.get(name), out)
            return
    out[key] = (old, new)


def changes(saved_yaml: str, config: Any) -> dict:
    """``{key: (saved, now)}`` for every key whose value differs (missing on one side: None).

    A dict-valued key differs entry by entry: ``{"data.train_weights.accent": (0.5, 0.25)}``.
    """
    new = flatten(config)
    old = flatten(saved_yaml, frozenset(k for k, v in new.items() if isinstance(v, Mapping)))
    out: dict = {}
    for k in sorted(set(old) | set(new)):
        if k not in IGNORED:
            _diff(k, old.get(k), new.get(k), out)
    return out


def refused_keys(config: Any) -> dict:
    """:data:`REFUSED` plus the config class's ``RESUME_REFUSED`` (``{key: why}``, a class
    attribute of a recipe's Config subclass: the keys of its own sections a resume may not change).

    Raises:
        ConfigError: ``RESUME_REFUSED`` names a key the config does not have (a misspelt key
            would never be refused).
    """
    extra = getattr(type(config), "RESUME_REFUSED", {})
    unknown = sorted(set(extra) - set(flatten(config)))
    if unknown:
        raise ConfigError(f"{type(config).__name__}.RESUME_REFUSED names keys the config does not have: "
                          + ", ".join(unknown))
    return {**REFUSED, **extra}


def folder_keys(config: Any) -> tuple:
    """The config class's ``RESUME_FOLDERS``: refused keys that name a model file or folder.

    Raises:
        ConfigError: a key the config does not have, or one ``RESUME_REFUSED`` does not refuse
            (a folder key is a refused key with a way out when only the path changed).
    """
    keys = tuple(getattr(type(config), "RESUME_FOLDERS", ()))
    flat, table = flatten(config), refused_keys(config) if keys else REFUSED
    bad = sorted(k for k in keys if k not in flat or refused(k, table) is None)
    if bad:
        raise ConfigError(f"{type(config).__name__}.RESUME_FOLDERS names keys the config does not have "
                          "or RESUME_REFUSED does not refuse: " + ", ".join(bad))
    return keys


SAMPLES, SAMPLE_BYTES = 16, 4096  # per file: enough to tell two weight files of one shape apart


def fingerprint(path: str) -> Optional[str]:
    """What stays the same when a model file or folder is moved or copied, and not when its
    weights change: a hash over the (top-level) files' names and sizes, the whole of a folder's
    ``config.json``, and 16 x 4 KiB read at fixed fractions through each file (two fine-tunes
    of one model have the same names, sizes and config, but not the same bytes; files that
    differ only between the samples would pass as the same). None: an empty
    path, nothing there or a file that cannot be read (the path is then compared as text).
    Cost: a directory listing and ~64 KiB read per file."""
    if not path or not os.path.exists(path):
        return None
    folder = os.path.isdir(path)
    h = hashlib.sha256()
    try:
        files = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))) if folder else [path]
        for name in files:
            full = os.path.join(path, name) if folder else name
            size = os.path.getsize(full)
            h.update(f"{os.path.basename(name)}\0{size}\0".encode())
            with open(full, "rb") as f:
                if folder and name == "config.json":
                    h.update(f.read())
                    continue
                for i in range(SAMPLES):
                    f.seek(max(0, size - SAMPLE_BYTES) * i // max(1, SAMPLES - 1))
                    h.update(f.read(SAMPLE_BYTES))
    except OSError:
        return None
    return h.hexdigest()


def fingerprints(config: Any) -> dict:
    """``{key: fingerprint}`` of the config's :func:`folder_keys` (saved with every checkpoint)."""
    flat = flatten(config)
    return {k: fingerprint(str(flat[k] or "")) for k in folder_keys(config)}


FOLDERS_FILE = "folders.json"  # in a checkpoint: {key: fingerprint} of the run's model folders


def saved_folders(checkpoint: str) -> dict:
    """The fingerprints a checkpoint was saved with ({} for one without model-folder keys).

    Raises:
        ConfigError: the file is there but is not a JSON object (names the file).
    """
    path = os.path.join(checkpoint, FOLDERS_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); it holds the fingerprints of the run's model "
                          "folders, rewritten at every checkpoint") from e
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: expected a JSON object of model-folder fingerprints, got {type(saved).__name__}")
    return saved


def same_folders(diff: dict, saved: Mapping, now: Mapping) -> set:
    """The folder keys of ``diff`` whose path changed but whose folder did not: the fingerprint
    saved with the checkpoint (``saved``) equals the new path's (``now``)."""
    return {k for k in diff if k in now and now[k] is not None and saved.get(k) == now[k]}


def refused(key: str, table: Mapping[str, str] = REFUSED) -> Optional[str]:
    """Why ``key`` (a diff key of :func:`changes`) may not change on resume, or None. An entry
    of a dict-valued key (``data.train_weights.accent``) is refused as its key is. ``table``:
    the refused keys (:func:`refused_keys` of the run's config adds the recipe's)."""
    for k, why in table.items():
        if key == k or key.startswith((f"{k}.", f"{k}[")):
            return why
    return None


def check(diff: dict, checkpoint: str, table: Mapping[str, str] = REFUSED, moved: set = frozenset()) -> None:
    """Refuse the keys a resume may not change (``table``: :data:`REFUSED`, or
    :func:`refused_keys` of the run's config), except the model folders in ``moved``
    (:func:`same_folders`).

    Raises:
        ConfigError: naming each refused key, its saved and new value, and why.
    """
    bad = [f"  {k}: saved {old!r}, now {new!r} ({refused(k, table)})"
           for k, (old, new) in diff.items() if refused(k, table) and k not in moved]
    if bad:
        raise ConfigError(f"cannot resume {checkpoint} with these keys changed:\n" + "\n".join(bad)
                          + "\nset them back to the saved values, or start a new run from the weights "
                            "(ddptrain.load_weights on the checkpoint's model.safetensors)")


def record(output_dir: str, config_yaml: str, resumed_at: Optional[int], diff: dict) -> None:
    """Write the run's config.yaml at its start; on a resume append the keys that changed, as
    a YAML comment block (the file still loads as the starting config). Rank 0 only."""
    path = os.path.join(output_dir, "config.yaml")
    if resumed_at is None or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(config_yaml)
        return
    if not diff:
        return
    lines = [f"\n# --- resumed at step {resumed_at} ({time.strftime('%Y-%m-%dT%H:%M:%S')}); "
             f"in effect from step {resumed_at + 1}:"]
    lines += [f"#   {k}: {old!r} -> {new!r}" for k, (old, new) in diff.items()]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
