"""What a resumed run may change, and the record of what it changed.

A checkpoint is saved with its config (``config.yaml`` in the checkpoint folder). Resuming with
another config is compared key by key:

* refused (:data:`REFUSED`): keys the saved state means something else under — the precision
  and parameter dtype (loss-scaler state, master weights), the optimizer's kind and sharding
  (its state's layout), and the data keys that define the epoch plan (the saved position would
  point at other batches). The error names every such key, saved vs now.
* applied: everything else. Optimizer hyperparameters (``optim.lr``, ``weight_decay``,
  betas, ...) are re-applied over the checkpoint's from the resumed step on; the LR schedule
  keeps the horizon of the run that started it, so a new ``trainer.max_steps`` lengthens or
  shortens the run without re-stretching the schedule (past its end the rate stays at the
  floor); ``scheduler.*`` keys reshape it from the resumed step on.

The run folder's ``config.yaml`` is written once, when the run starts; every resume that
changes keys appends a comment block to it (the file still loads as the starting config), and
each checkpoint holds the config it was saved under.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from omegaconf import OmegaConf

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
}
# keys that differ between a run and its resume by their nature
IGNORED = ("checkpoint.resume", "checkpoint.start_over")


def flatten(cfg: Any) -> dict:
    """``{"section.key": value}`` of a config object or a YAML text."""
    node = OmegaConf.create(cfg) if isinstance(cfg, str) else OmegaConf.structured(cfg)
    out: dict = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(OmegaConf.to_container(node, resolve=True), "")
    return out


def changes(saved_yaml: str, config: Any) -> dict:
    """``{key: (saved, now)}`` for every key whose value differs (missing on one side: None)."""
    old, new = flatten(saved_yaml), flatten(config)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k not in IGNORED and old.get(k) != new.get(k)}


def check(diff: dict, checkpoint: str) -> None:
    """Refuse the keys a resume may not change.

    Raises:
        ConfigError: naming each refused key, its saved and new value, and why.
    """
    bad = [f"  {k}: saved {old!r}, now {new!r} ({REFUSED[k]})" for k, (old, new) in diff.items() if k in REFUSED]
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
