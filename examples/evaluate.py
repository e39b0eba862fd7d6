"""Score trained weights on test manifests, distributed like training: per-set WER/CER (and loss).

    # the ASR demo's stage-1 model (its newest checkpoint) on both test sets
    python examples/evaluate.py --recipe examples/finetune_asr.py --config configs/asr_demo.yaml \\
        --weights runs/asr_demo/base examples/data/digits/base/test.jsonl examples/data/digits/accent/test.jsonl
    # GLM-ASR: a checkpoint of a fine-tuning run, on 8 GPUs (each rank decodes its share)
    torchrun --nproc_per_node=8 examples/evaluate.py --recipe examples/finetune_glmasr.py \\
        --config configs/glmasr.yaml glmasr.path=/models/GLM-ASR-Nano-2512 --weights runs/glmasr test.jsonl
    # an exported GLM-ASR folder (glmasr.export_dir) is a model folder: glmasr.path=EXPORT, no --weights
    # a run trained with ema.enabled: its EMA weights, or its trained ones (default auto: as keep_best ranked)
    python examples/evaluate.py --recipe ... --config ... --weights runs/x --which ema test.jsonl

The recipe (``--recipe``) builds the model, the loss and the metrics as for training, through its
``build_eval(cfg, info, manifests)``; ``--weights`` (a checkpoint folder, a run folder: its newest
complete checkpoint, or a ``.safetensors`` file, LoRA adapters included: ``lora.enabled`` adds
none of its own) are loaded with ``ddptrain.load_weights``; ``--which`` picks the checkpoint's EMA
weights (``ema``: an error naming the checkpoint folder when it has none), its trained weights
(``model``), or (``auto``, the default) the EMA when the checkpoint's own evaluation measured it, so
the scores match the training run's, as ``python -m ddptrain.weights export`` chooses. Each manifest
is scored by ``Trainer.evaluate`` (each rank its share, sums over ranks) and logged as ``[test
MANIFEST step 0]``; rank 0 prints one line per set and writes ``report.json`` in ``--out`` (a run
folder of its own: the training run's stays as it was). Without manifests, ``data.eval_manifest``
is scored. ``key=value`` overrides follow the config; with the TTS recipe, evaluation noise follows
``trainer.seed``, so two models scored with one seed see the same flow-matching draws.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddptrain  # noqa: E402
from ddptrain import runfolder  # noqa: E402
from ddptrain.tune import load_recipe  # noqa: E402


def main(argv: list[str]) -> dict:
    """Returns ``{manifest: {metric: value}}`` (on every rank).

    Raises:
        ConfigError: no manifest to score, or a recipe without ``build_eval``.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="the training recipe (examples/finetune_asr.py, finetune_glmasr.py)")
    parser.add_argument("--config", help="the training YAML config; key=value overrides follow")
    parser.add_argument("--weights", default="", help="checkpoint folder, run folder or .safetensors file "
                        "(default: the weights the config itself builds, e.g. glmasr.path)")
    parser.add_argument("--which", choices=["auto", "ema", "model"], default="auto",
                        help="with --weights: ema: the checkpoint's EMA weights (ema.enabled); model: its trained "
                             "weights; auto (default): the EMA when the checkpoint's evaluation measured it")
    parser.add_argument("--out", default="runs/evaluate", help="this evaluation's run folder (logs, report.json)")
    args, rest = parser.parse_known_args(argv)
    overrides, manifests = [a for a in rest if "=" in a], [a for a in rest if "=" not in a]
    if args.which == "ema" and not args.weights:
        raise ddptrain.ConfigError("--which ema: name the checkpoint whose EMA to score with --weights")
    module, schema, _ = load_recipe(args.recipe)
    if not callable(getattr(module, "build_eval", None)):
        raise ddptrain.ConfigError(f"--recipe {args.recipe}: defines no build_eval(cfg, info, manifests)")
    # a run of its own: no resume from, and no clobbering of, the training run's folder; no EMA of
    # its own either: the weights loaded (the EMA ones with --which ema) are what is scored; no
    # adapters of its own (LoRA adapters come with --weights: load_weights adds them), and no base to
    # gate against (eval.baseline)
    cfg = ddptrain.load_config(args.config, [*overrides, f"trainer.output_dir={args.out}", "checkpoint.resume=none",
                                             "checkpoint.keep_best=0", "ema.enabled=false", "lora.enabled=false",
                                             "eval.baseline=none"], schema=schema)
    manifests = manifests or [m for m in [cfg.data.eval_manifest] if m]
    if not manifests:
        raise ddptrain.ConfigError("no manifest to score: name test manifests after the options, or set data.eval_manifest")
    info = ddptrain.setup_distributed(cfg)
    model, loss_fn, metrics_fn, loaders = module.build_eval(cfg, info, manifests)
    which = None  # the weights the config builds
    if args.weights:
        report = ddptrain.load_weights(model, args.weights, which=args.which)
        which = report["weights"]  # ema or model
        if info.is_main:
            print(f"loaded {report['loaded']} tensors from {args.weights} ({which} weights)")
    trainer = ddptrain.Trainer(model, loss_fn, cfg, loaders[manifests[0]], metrics_fn=metrics_fn)
    results = {m: {k: round(v, 4) for k, v in trainer.evaluate(loaders[m], prefix="test", name=m).items()}
               for m in manifests}
    trainer.close()
    if info.is_main:
        for m, r in results.items():
            print(f"{m}: " + "  ".join(f"{k.upper()} {v:.2%}" if k in ("wer", "cer") else f"{k} {v:.4f}"
                                        for k, v in r.items()))
        runfolder.write_file(args.out, "report.json",
                             json.dumps({"weights": args.weights, "which": which, "results": results}, indent=1))
        print(f"report: {os.path.join(args.out, 'report.json')}; logs: {os.path.join(args.out, 'metrics.jsonl')}"
              + (f", TensorBoard: tensorboard --logdir {os.path.join(args.out, 'tensorboard')}"
                 if cfg.logging.tensorboard else ""))
    ddptrain.dist.teardown()
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
