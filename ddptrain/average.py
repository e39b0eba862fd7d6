"""Checkpoint averaging: the last N or the best N checkpoints of a run, averaged into one weights file.

Command line::

    python -m ddptrain.average runs/x --last 5 -o runs/x/last5.safetensors
    python -m ddptrain.average runs/x --best 3 --metric wer --mode min -o runs/x/best3.safetensors
    python -m ddptrain.average runs/x/checkpoints/step_00001000 runs/x/checkpoints/step_00002000 -o avg.safetensors

Why: the weights of the last few updates scatter around a minimum, and their mean usually sits
closer to it than any one of them; averaging the last (or the best) few checkpoints is a standard
final step of ESPnet, fairseq and NeMo recipes. ``--best`` ranks by a metric the checkpoints'
``meta.json`` holds (their evaluation at save time, as ``checkpoint.keep_best`` does: keep the
checkpoints you will average with ``keep_best``); ``--metric`` and ``--mode`` default to the run's
``checkpoint.best_metric`` and ``best_mode``.

What is averaged, from each checkpoint: its ``model.safetensors`` (what
:func:`ddptrain.weights.read_weights` reads: the fp32 masters under replicated masters, the bf16
weights under sharded masters, whatever number of ranks saved it; a trainable-only checkpoint's
trainable tensors), or, with ``--weights ema``, its EMA (``ema.enabled``; the shards of every
rank) over it. ``--weights auto`` (the default) takes the EMA when the checkpoints' metrics
measured it (see ddptrain/ema.py), as ``python -m ddptrain.weights export`` does.

The output is one safetensors file in the checkpoints' own layout and header (a trainable-only
LoRA average still names its base model, its fingerprint and the LoRA scalings), so
``ddptrain.load_weights(model, file)`` loads it and ``python -m ddptrain.weights export file
out/`` merges its adapters. Arithmetic: the tensors summed in fp32 in checkpoint order (oldest
first), divided by N, cast to the dtype they are stored in (``--dtype`` to another); integer
tensors (BatchNorm's ``num_batches_tracked``) come from the newest checkpoint. Memory: one tensor
at a time, read from each checkpoint, summed and written (:func:`ddptrain.weights.save_streamed`).
The checkpoints must be of one model: another tensor name, shape or dtype, LoRA set-up or base
model is refused, naming the file and the tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch
from omegaconf import OmegaConf

from ddptrain.checkpoint import CheckpointError, checkpoint_root, list_complete, read_meta, run_id_of
from ddptrain.weights import DTYPES, SafetensorsSource, checkpoint_ema, read_header, save_streamed, weights_file, \
    weights_info

__all__ = ["select", "average", "main"]


def _run_defaults(checkpoint: str) -> tuple[str, str]:
    """The run's ``checkpoint.best_metric`` and ``best_mode`` (from the checkpoint's config.yaml)."""
    try:
        c = OmegaConf.load(os.path.join(checkpoint, "config.yaml")).checkpoint
        return str(c.best_metric), str(c.best_mode).lower()
    except Exception:  # a checkpoint without (or with a damaged) config: the Trainer's defaults
        return "loss", "min"


def select(run: str, last: int = 0, best: int = 0, metric: Optional[str] = None,
           mode: Optional[str] = None) -> list[tuple[str, Optional[float]]]:
    """The checkpoints of ``run`` to average: the ``last`` newest, or the ``best`` by ``metric``.

    Args:
        run: a run folder or its ``checkpoints`` folder; only the checkpoints of the run that wrote
            the newest one count (never another run's left in the folder).
        last, best: how many (exactly one of them > 0).
        metric, mode: ``best``'s ranking (``min``: lower is better); default: the run's
            ``checkpoint.best_metric`` / ``best_mode``.

    Returns:
        ``[(checkpoint path, metric value or None)]``, oldest first.

    Raises:
        CheckpointError: no checkpoints, or fewer than asked for (naming the metrics they hold).
    """
    if (last > 0) == (best > 0):
        raise ValueError("select: give one of last= or best= (> 0)")
    root = run if list_complete(run) else checkpoint_root(run)
    found = list_complete(root)
    if not found:
        raise CheckpointError(f"{run}: no complete checkpoint there (pass a run folder, its checkpoints folder, "
                              "or the checkpoint folders to average)")
    owner = run_id_of(found[-1][1])
    found = [(s, p) for s, p in found if run_id_of(p) == owner]
    if last:
        if len(found) < last:
            raise CheckpointError(f"{run} has {len(found)} checkpoints of its run, fewer than --last {last}")
        return [(p, None) for _, p in found[-last:]]
    default_metric, default_mode = _run_defaults(found[-1][1])
    metric, mode = metric or default_metric, (mode or default_mode).lower()
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} is not min or max")
    scored, seen = [], set()
    for step, path in found:
        metrics = read_meta(path).get("metrics", {})
        seen.update(metrics)
        if metric in metrics:
            value = float(metrics[metric])
            scored.append(((value if mode == "min" else -value, -step), step, path, value))  # ties: the newer
    if len(scored) < best:
        held = ", ".join(sorted(seen)) or ("none: saved without an evaluation at their step (checkpoint.keep_best "
                                           "evaluates before each save)")
        raise CheckpointError(f"{run}: {len(scored)} of its {len(found)} checkpoints hold metric {metric!r}, fewer than "
                              f"--best {best} (their metrics: {held})")
    chosen = sorted(scored)[:best]
    return [(path, value) for _, _, path, value in sorted(chosen, key=lambda c: c[1])]


def average(checkpoints: list[str], out: str, weights: str = "auto", dtype: Optional[str] = None) -> dict:
    """Average the weights of ``checkpoints`` (in this order; the last counts as the newest) into
    the safetensors file ``out``.

    Args:
        checkpoints: checkpoint folders (or weights files).
        weights: ``model`` | ``ema`` | ``auto`` (see the module docstring).
        dtype: ``bf16`` | ``fp16`` | ``fp32`` for the floating tensors; default: as stored.

    Returns:
        ``{"written": out, "averaged": [files], "weights": "ema" | "model"}``.

    Raises:
        CheckpointError: an unreadable checkpoint, or checkpoints that are not of one model (the
            message names the file and the tensor); ``auto`` over checkpoints of which only some
            measured their EMA.
    """
    if not checkpoints:
        raise CheckpointError("nothing to average: no checkpoints given")
    files = [weights_file(c) for c in checkpoints]
    twice = sorted({f for f in files if files.count(f) > 1})
    if twice:
        raise CheckpointError(f"checkpoints given twice: {twice}")
    emas = [checkpoint_ema(f, weights) for f in files]
    if weights == "auto" and any(emas) and not all(emas):
        plain = [f for f, e in zip(files, emas) if not e]
        raise CheckpointError(f"--weights auto: some checkpoints' metrics measured their EMA, not those of {plain}: "
                              "pass --weights ema or --weights model")
    first, info = files[0], weights_info(files[0])
    for f in files[1:]:
        other = weights_info(f)
        for key, what in (("trainable_only", "trainable-only or full"), ("base_fingerprint", "base model"),
                          ("lora_scalings", "LoRA layers and scalings")):
            if other[key] != info[key]:
                raise CheckpointError(f"{f} and {first} differ in {what} ({other[key]!r} vs {info[key]!r}): "
                                      "they are not checkpoints of one model")
    sources = [SafetensorsSource(f) for f in files]
    try:
        names = sources[0].keys()
        for f, src, ema in zip(files, sources, emas):
            extra, missing = sorted(set(src.keys()) - set(names)), sorted(set(names) - set(src.keys()))
            if extra or missing:
                raise CheckpointError(f"{f} " + (f"has tensors {first} lacks: {extra[:10]}" if extra else
                                                 f"lacks tensors {first} has: {missing[:10]}"))
            for k in names:
                if (src.shape(k), src.dtype(k)) != (sources[0].shape(k), sources[0].dtype(k)):
                    raise CheckpointError(f"{f}: tensor {k} is {src.dtype(k)} {src.shape(k)}, in {first} it is "
                                          f"{sources[0].dtype(k)} {sources[0].shape(k)}")
            stray = sorted(set(ema) - set(names))
            if stray:
                raise CheckpointError(f"{f}: its EMA has tensors its weights lack: {stray[:10]}")
        cast = DTYPES[dtype] if dtype else None
        out_dtype = {k: cast if cast is not None and sources[0].dtype(k).is_floating_point else sources[0].dtype(k)
                     for k in names}

        def averaged():
            for k in names:
                if not sources[0].dtype(k).is_floating_point:
                    yield sources[-1].get(k)  # a counter: the newest checkpoint's
                    continue
                total = None
                for src, ema in zip(sources, emas):
                    t = ema[k] if k in ema else src.get(k)
                    if total is None:
                        total = t.to(torch.float32, copy=True)
                    else:
                        total += t.to(torch.float32)
                yield total.div_(len(sources)).to(out_dtype[k])

        metadata = dict(read_header(first)[1], writer="ddptrain.average", **{
            "ddptrain.averaged_from": json.dumps([os.path.abspath(f) for f in files]),
            "ddptrain.weights": "ema" if emas[0] else "model"})
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        save_streamed(out, [(k, out_dtype[k], sources[0].shape(k)) for k in names], averaged(), metadata)
    finally:
        for src in sources:
            src.close()
    return {"written": out, "averaged": list(checkpoints), "weights": "ema" if emas[0] else "model"}


def main(argv: Optional[list[str]] = None) -> int:
    """``ddptrain-average`` (``python -m ddptrain.average``): see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m ddptrain.average",
                                description="Average the weights of a run's last N or best N checkpoints (or of the "
                                            "checkpoint folders given) into one safetensors file, one tensor at a time.")
    p.add_argument("paths", nargs="+", help="a run folder (with --last or --best), or the checkpoint folders to average")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--last", type=int, default=0, metavar="N", help="the N newest checkpoints of the run")
    which.add_argument("--best", type=int, default=0, metavar="N", help="the N best checkpoints by --metric")
    p.add_argument("--metric", default=None, help="the meta.json metric --best ranks by (default: the run's "
                                                  "checkpoint.best_metric)")
    p.add_argument("--mode", choices=["min", "max"], default=None, help="min: lower is better (default: the run's "
                                                                        "checkpoint.best_mode)")
    p.add_argument("-o", "--output", required=True, help="the safetensors file to write")
    p.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                   help="ema: each checkpoint's EMA weights; model: its trained weights; auto (default): the EMA when "
                        "the checkpoints' evaluation measured it")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: as stored)")
    args = p.parse_args(argv)
    if (args.last or args.best) and len(args.paths) != 1:
        p.error("--last / --best take one run folder")
    if args.last < 0 or args.best < 0:
        p.error("--last / --best take a number > 0")
    values: dict = {}
    if args.last or args.best:
        chosen = select(args.paths[0], args.last, args.best, args.metric, args.mode)
        paths = [c for c, _ in chosen]
        values = {c: v for c, v in chosen if v is not None}
    else:
        paths = args.paths
    report = average(paths, args.output, args.weights, args.dtype)
    if values:
        report["metric"] = values
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
