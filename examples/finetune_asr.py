"""Fine-tune a Conformer-CTC speech recogniser with ddptrain (the README's main job).

    # stage 1: train on the base voices of the shipped digits corpus
    python examples/finetune_asr.py --config configs/asr_demo.yaml
    # stage 2: adapt to unseen accents, starting from the stage-1 weights
    python examples/finetune_asr.py --config configs/asr_demo_accent.yaml
    # or replay the base voices too, each source a weighted share of every epoch (eval: wer/<source>)
    python examples/finetune_asr.py --config configs/asr_demo_mix.yaml data.train_weights.accent=0.75 \
        data.train_weights.base=0.25
    # the same on 2 processes (CPU: gloo; GPUs: nccl), or on your own data
    torchrun --nproc_per_node=2 examples/finetune_asr.py --config configs/asr_demo.yaml
    python examples/finetune_asr.py --config configs/asr_demo.yaml \\
        data.train_manifest=my/train.jsonl data.eval_manifest=my/dev.jsonl demo.test_manifests=[my/test.jsonl]

Everything is in the config (see configs/*.yaml and docs/config.md); any key can
be overridden as ``key=value``. The model lives in examples/models, not in the library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddptrain  # noqa: E402
from ddptrain import metrics, runfolder  # noqa: E402
from ddptrain.data import build_dataloader, load_or_build_tokenizer  # noqa: E402
from models.conformer_ctc import ConformerCTC, ConformerCTCConfig, ctc_greedy_decode  # noqa: E402
from models.train_flops import Flops  # noqa: E402


@dataclass
class ModelConfig(ConformerCTCConfig):
    init_from: str = ""  # weights to start from: .safetensors file, checkpoint folder or run folder
    init_strict: bool = True  # false: load matching tensors only (e.g. a new vocabulary)


@dataclass
class DemoConfig:
    test_manifests: list[str] = field(default_factory=list)  # reported at the end (and before, if init_from)
    report: str = "report.json"  # final WER/CER summary, written inside trainer.output_dir


@dataclass
class ASRConfig(ddptrain.Config):
    model: ModelConfig = field(default_factory=ModelConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)


class CTCObjective:
    """The loss contract for CTC: (sum of per-utterance CTC losses, number of target tokens).

    Also computes features on the GPU when ``data.feature_device: gpu`` (the loader then yields
    padded audio), so training and evaluation share one path; the extractor's ``for_model``
    masks (SpecAugment) only while the model trains (``Trainer.evaluate`` sets ``eval()``).
    """

    def __init__(self, tokenizer, feature_extractor=None):
        self.tokenizer = tokenizer
        self.features = feature_extractor

    def _features(self, model, batch):
        if self.features is None:
            return batch["features"], batch["feature_lens"]
        out = self.features.for_model(model, batch)
        return out["features"], out["feature_lens"]

    def __call__(self, model, batch):
        feats, lens = self._features(model, batch)
        log_probs, out_lens = model(feats, lens)
        loss = torch.nn.functional.ctc_loss(
            log_probs.float().transpose(0, 1), batch["tokens"], out_lens, batch["token_lens"],
            blank=0, reduction="sum", zero_infinity=True)
        return loss, batch["token_lens"].sum()

    def error_counts(self, model, batch):
        """Eval metrics as (numerator, denominator) pairs: corpus WER and CER, reduced by the Trainer;
        with named sources (``data.eval_sources``) also ``wer/<source>`` and ``cer/<source>``."""
        feats, lens = self._features(model, batch)
        log_probs, out_lens = model(feats, lens)
        hyps = [self.tokenizer.decode(ids) for ids in ctc_greedy_decode(log_probs, out_lens)]
        refs = batch["texts"]
        out = {"wer": metrics.word_errors(refs, hyps), "cer": metrics.char_errors(refs, hyps)}
        for name in sorted(set(batch.get("sources", ()))):
            mine = [i for i, s in enumerate(batch["sources"]) if s == name]
            out[f"wer/{name}"] = metrics.word_errors([refs[i] for i in mine], [hyps[i] for i in mine])
            out[f"cer/{name}"] = metrics.char_errors([refs[i] for i in mine], [hyps[i] for i in mine])
        return out


def build(cfg: ASRConfig) -> tuple:
    """The recipe's pieces: ``(model, objective, train loader, eval loader or None, tokenizer)``.

    Call it after ``ddptrain.setup_distributed(cfg)`` (the samplers read the rank and world size);
    it sets ``cfg.model.vocab_size`` from the tokenizer. ``python -m ddptrain.tune --recipe
    examples/finetune_asr.py`` measures per-bucket batch budgets on what it returns.
    """
    is_main = ddptrain.dist.get_rank() == 0
    tokenizer = load_or_build_tokenizer(cfg.data) if is_main else None
    ddptrain.dist.barrier()  # rank 0 may have just built and saved it
    tokenizer = tokenizer or load_or_build_tokenizer(cfg.data)
    cfg.model.vocab_size = tokenizer.vocab_size
    # named sources (data.train_sources / eval_sources) or manifests / shards
    train_loader = build_dataloader(cfg.data.train_sources or cfg.data.train_manifest, cfg.data, tokenizer, train=True)
    eval_set = cfg.data.eval_sources or cfg.data.eval_manifest
    eval_loader = build_dataloader(eval_set, cfg.data, tokenizer, train=False) if eval_set else None

    torch.manual_seed(cfg.trainer.seed)  # the same initial weights on every rank and every run
    model = ConformerCTC(cfg.model)
    if cfg.model.init_from:
        report = ddptrain.load_weights(model, cfg.model.init_from, strict=cfg.model.init_strict)
        if is_main:
            print(f"initialised {report['loaded']} tensors from {cfg.model.init_from}"
                  + (f" (skipped: {report['missing'] + report['mismatched']})" if not cfg.model.init_strict else ""))
    return model, CTCObjective(tokenizer, train_loader.feature_extractor), train_loader, eval_loader, tokenizer


def model_flops(model: ConformerCTC, extractor=None) -> Flops:
    """The Conformer's training FLOPs per batch (the log's MFU); with ``extractor`` (features on
    the GPU) a batch carries audio, and its frames are those the extractor will make of it."""
    def frames_of(samples: int) -> int:
        frames = int(extractor.num_frames(torch.tensor(samples)))
        return -(-frames // extractor.pad_to_multiple) * extractor.pad_to_multiple
    return Flops("conformer", model, frames_of=frames_of if extractor is not None else None)


def build_eval(cfg: ASRConfig, info, manifests: list[str]) -> tuple:
    """examples/evaluate.py's pieces: ``(model, loss_fn, metrics_fn, {manifest: eval loader})``.

    The model is built as :func:`build` builds it (``model.init_from`` loaded, if set); evaluate.py
    then loads the weights to score. The tokenizer is the training run's (``data.tokenizer``).
    """
    tokenizer = load_or_build_tokenizer(cfg.data) if info.is_main else None
    ddptrain.dist.barrier()
    tokenizer = tokenizer or load_or_build_tokenizer(cfg.data)
    cfg.model.vocab_size = tokenizer.vocab_size
    loaders = {m: build_dataloader(m, cfg.data, tokenizer, train=False) for m in manifests}
    model = ConformerCTC(cfg.model)
    if cfg.model.init_from:
        ddptrain.load_weights(model, cfg.model.init_from, strict=cfg.model.init_strict)
    objective = CTCObjective(tokenizer, next(iter(loaders.values())).feature_extractor)
    return model, objective, objective.error_counts, loaders


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (keys: see docs/config.md)")
    args, overrides = parser.parse_known_args(argv)
    cfg = ddptrain.load_config(args.config, overrides, schema=ASRConfig)
    info = ddptrain.setup_distributed(cfg)  # samplers below need the rank and world size
    model, objective, train_loader, eval_loader, tokenizer = build(cfg)
    trainer = ddptrain.Trainer(model, objective, cfg, train_loader, eval_data=eval_loader,
                               metrics_fn=objective.error_counts,
                               flops_fn=model_flops(model, objective.features).of_batch)  # MFU in the log
    if info.is_main:
        print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; "
              f"{len(train_loader)} batches/epoch/rank on {info.world_size} process(es), device {trainer.device}")

    tests = {path: build_dataloader(path, cfg.data, tokenizer, train=False) for path in cfg.demo.test_manifests}
    summary = {"before": {}, "after": {}}
    if cfg.model.init_from and trainer.step == 0:  # the starting point, for a before/after comparison
        summary["before"] = {p: evaluate_on(trainer, loader, p) for p, loader in tests.items()}
    elif trainer.step > 0:  # a resume: the run's first launch measured the starting point
        summary["before"] = {p: v for p, v in previous_report(cfg).get("before", {}).items() if p in tests}
    start = time.time()
    trainer.fit()
    summary["train_seconds"] = round(time.time() - start, 1)
    summary["after"] = {p: evaluate_on(trainer, loader, p) for p, loader in tests.items()}
    trainer.close()  # after the test-set evaluations: they are logged too
    if info.is_main:
        print_summary(summary)
        runfolder.write_file(cfg.trainer.output_dir, cfg.demo.report, json.dumps(summary, indent=1))  # keeps the old one
        out = cfg.trainer.output_dir  # where a new user looks for the outputs: said last
        print(f"report: {os.path.join(out, cfg.demo.report)}; logs: {os.path.join(out, 'metrics.jsonl')}"
              + (f", TensorBoard: tensorboard --logdir {os.path.join(out, 'tensorboard')}"
                 if cfg.logging.tensorboard else ""))
    ddptrain.dist.teardown()
    return summary


def previous_report(cfg: ASRConfig) -> dict:
    """The report an earlier launch of this run wrote ({} if none)."""
    try:
        with open(os.path.join(cfg.trainer.output_dir, cfg.demo.report)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def evaluate_on(trainer: ddptrain.Trainer, loader, name: str = "") -> dict:
    """WER/CER of the current model on one test set (same reduction as periodic evaluation),
    logged as ``[test NAME step N]`` (``name``: the manifest)."""
    return {k: round(v, 4) for k, v in trainer.evaluate(loader, prefix="test", name=name).items()}


def print_summary(summary: dict) -> None:
    print("\n=== results (corpus WER / CER, greedy CTC) ===")
    for path, after in summary["after"].items():
        line = f"{path}: WER {after['wer']:.2%}  CER {after['cer']:.2%}"
        before = summary["before"].get(path)
        if before:
            line += f"   (before fine-tuning: WER {before['wer']:.2%}  CER {before['cer']:.2%})"
        print(line)
    print(f"training time: {summary['train_seconds']} s")


if __name__ == "__main__":
    main(sys.argv[1:])
