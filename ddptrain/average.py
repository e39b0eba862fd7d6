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
model is refused, naming the file and the tensor. Fewer than two checkpoints, or a run folder
without ``--last`` / ``--best``, are refused (a "average" of one is a copy:
``python -m ddptrain.weights export`` writes one checkpoint's weights).

LoRA adapters (``lora.enabled``; full or trainable-only checkpoints): a layer's update is
``scaling * B @ A``, and the mean of the N checkpoints' updates is not ``mean(B) @ mean(A)``
(the cross terms; measured 8e-4 off against 0.035 between two checkpoints). The average holds
the exact mean instead, as one adapter of rank N*r: ``A`` = the N ``A`` stacked (rows), ``B`` =
the N ``B`` side by side (columns) divided by N, so ``scaling * B @ A = mean(scaling * B_i @ A_i)``
(PEFT's ``add_weighted_adapter(combination_type="cat")``). ``ddptrain.load_weights`` adds an
adapter of that rank to a model without adapters (``examples/evaluate.py --weights`` does), and
``python -m ddptrain.weights export`` merges it into the base; to train on from it, export the
merged weights and use them as the base model.

The output: never inside a checkpoint folder (it would change that checkpoint's files) nor one
of the inputs; an existing file is replaced only with ``--force``
(:func:`ddptrain.weights.check_output`).
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
from ddptrain.config import cli_prog
from ddptrain.weights import DTYPES, SafetensorsSource, check_output, checkpoint_ema, read_header, save_streamed, \
    weights_file, weights_info

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


def average(checkpoints: list[str], out: str, weights: str = "auto", dtype: Optional[str] = None,
            force: bool = False) -> dict:
    """Average the weights of ``checkpoints`` (in this order; the last counts as the newest) into
    the safetensors file ``out``.

    Args:
        checkpoints: two or more checkpoint folders (or weights files).
        weights: ``model`` | ``ema`` | ``auto`` (see the module docstring).
        dtype: ``bf16`` | ``fp16`` | ``fp32`` for the floating tensors; default: as stored.
        force: replace ``out`` if it exists.

    Returns:
        ``{"written": out, "averaged": [files], "weights": "ema" | "model"}``, and for LoRA
        checkpoints ``"lora": {"layers": n, "rank": "r -> N*r"}`` (see the module docstring).

    Raises:
        CheckpointError: fewer than two checkpoints; an unreadable checkpoint, or checkpoints that
            are not of one model (the message names the file and the tensor); ``auto`` over
            checkpoints of which only some measured their EMA; an ``out`` that is inside a
            checkpoint, is an input, is a folder, or exists (without ``force``).
    """
    if len(checkpoints) < 2:
        raise CheckpointError(f"averaging needs two or more checkpoints, got {len(checkpoints)} ({checkpoints}): "
                              "an average of one is a copy (`python -m ddptrain.weights export CKPT OUT/` writes one "
                              "checkpoint's weights)")
    files = [weights_file(c) for c in checkpoints]
    twice = sorted({f for f in files if files.count(f) > 1})
    if twice:
        raise CheckpointError(f"checkpoints given twice: {twice}")
    check_output(out, files, force=force)
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
        # LoRA pairs are stacked along their rank, not averaged (see the module docstring)
        layers = {k[: -len(".lora_A")] for k in names if k.endswith(".lora_A")} & set(info["lora_scalings"])
        stacked = {f"{layer}.lora_{ab}": 0 if ab == "A" else 1 for layer in layers for ab in "AB"}  # key -> dim
        shape = {k: list(sources[0].shape(k)) for k in names}
        ranks = sorted({shape[f"{layer}.lora_A"][0] for layer in layers})
        for k, dim in stacked.items():
            shape[k][dim] *= len(sources)

        def averaged():
            for k in names:
                if not sources[0].dtype(k).is_floating_point:
                    yield sources[-1].get(k)  # a counter: the newest checkpoint's
                    continue
                parts = (ema[k] if k in ema else src.get(k) for src, ema in zip(sources, emas))
                if k in stacked:  # A: the N A's as rows; B: the N B's as columns, / N
                    t = torch.cat([p.to(torch.float32) for p in parts], dim=stacked[k])
                    yield (t.div_(len(sources)) if k.endswith(".lora_B") else t).to(out_dtype[k])
                    continue
                total = None
                for t in parts:
                    if total is None:
                        total = t.to(torch.float32, copy=True)
                    else:
                        total += t.to(torch.float32)
                yield total.div_(len(sources)).to(out_dtype[k])

        metadata = dict(read_header(first)[1], writer="ddptrain.average", **{
            "ddptrain.averaged_from": json.dumps([os.path.abspath(f) for f in files]),
            "ddptrain.weights": "ema" if emas[0] else "model"})
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        save_streamed(out, [(k, out_dtype[k], tuple(shape[k])) for k in names], averaged(), metadata)
    finally:
        for src in sources:
            src.close()
    report = {"written": out, "averaged": list(checkpoints), "weights": "ema" if emas[0] else "model"}
    if layers:
        report["lora"] = {"layers": len(layers), "rank": f"{'/'.join(map(str, ranks))} -> "
                                                         f"{'/'.join(str(r * len(sources)) for r in ranks)}"}
    return report


def main(argv: Optional[list[str]] = None) -> int:
    """``ddptrain-average`` (``python -m ddptrain.average``): see the module docstring."""
    p = argparse.ArgumentParser(prog=cli_prog("ddptrain.average"),
                                description="Average the weights of a run's last N or best N checkpoints (or of the "
                                            "checkpoint folders given) into one safetensors file, one tensor at a time.")
    p.add_argument("paths", nargs="+", help="a run folder (with --last or --best), or the checkpoint folders to average")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--last", type=int, default=None, metavar="N", help="the N (2 or more) newest checkpoints of "
                                                                          "the run")
    which.add_argument("--best", type=int, default=None, metavar="N", help="the N (2 or more) best checkpoints by "
                                                                          "--metric")
    p.add_argument("--metric", default=None, help="the meta.json metric --best ranks by (default: the run's "
                                                  "checkpoint.best_metric)")
    p.add_argument("--mode", choices=["min", "max"], default=None, help="min: lower is better (default: the run's "
                                                                        "checkpoint.best_mode)")
    p.add_argument("-o", "--output", required=True, help="the safetensors file to write (not inside a checkpoint)")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                   help="ema: each checkpoint's EMA weights; model: its trained weights; auto (default): the EMA when "
                        "the checkpoints' evaluation measured it")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: as stored)")
    args = p.parse_args(argv)
    picked = args.last if args.last is not None else args.best
    if picked is not None and len(args.paths) != 1:
        p.error("--last / --best take one run folder")
    if picked is not None and picked < 2:
        p.error(f"--{'last' if args.last is not None else 'best'} {picked}: averaging takes 2 or more checkpoints "
                "(one checkpoint's weights: python -m ddptrain.weights export CKPT OUT/)")
    values: dict = {}
    try:
        if picked is not None:
            chosen = select(args.paths[0], args.last or 0, args.best or 0, args.metric, args.mode)
            paths = [c for c, _ in chosen]
            values = {c: v for c, v in chosen if v is not None}
        else:
            runs = [r for r in args.paths if os.path.isdir(r) and not os.path.isfile(os.path.join(r, "model.safetensors"))
                    and (list_complete(r) or list_complete(checkpoint_root(r)))]
            if runs:
                p.error(f"{runs[0]} is a run folder (or its checkpoints folder): pick its checkpoints with --last N or "
                        "--best N, or pass the checkpoint folders to average")
            if len(args.paths) < 2:
                p.error("give two or more checkpoint folders (or --last N / --best N with a run folder)")
            paths = args.paths
        report = average(paths, args.output, args.weights, args.dtype, args.force)
    except CheckpointError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if values:
        report["metric"] = values
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
