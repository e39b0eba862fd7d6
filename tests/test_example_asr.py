"""End to end: examples/finetune_asr.py under torchrun with 2 gloo ranks on shipped utterances.

Checks that a checkpoint and a TensorBoard event file appear, that a second launch resumes from
the checkpoint, and that the CTC loss goes down on a tiny set the model can overfit.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "examples", "data", "digits", "base")


def tiny_manifest(tmp_path, n=12):
    """The first n shipped base-train utterances, with absolute audio paths."""
    out = tmp_path / "tiny.jsonl"
    with open(os.path.join(BASE, "train.jsonl")) as src, open(out, "w") as dst:
        for line, _ in zip(src, range(n)):
            item = json.loads(line)
            item["audio_filepath"] = os.path.join(BASE, item["audio_filepath"])
            dst.write(json.dumps(item) + "\n")
    return str(out)


def launch(tmp_path, manifest, steps, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", "finetune_asr.py"), "--config", os.path.join(ROOT, "configs", "asr_demo.yaml"),
           f"trainer.output_dir={tmp_path}/run", f"data.tokenizer={tmp_path}/tok.json",
           f"data.train_manifest={manifest}", f"data.eval_manifest={manifest}", f"demo.test_manifests=[{manifest}]",
           f"trainer.max_steps={steps}", "trainer.eval_every=0", "checkpoint.every_steps=10", "logging.log_every=2",
           "logging.progress_bar=false", "data.max_duration=8", "data.num_buckets=2", "data.num_workers=1",
           "data.spec_augment=false", "model.dropout=0.0", "optim.lr=3e-3", "scheduler.name=constant",
           "model.d_model=64", "model.ffn_dim=128", "model.num_layers=2", "model.num_heads=2", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.timeout(600)
def test_asr_example_two_ranks_checkpoints_resumes_and_learns(tmp_path):
    manifest = tiny_manifest(tmp_path)
    log = launch(tmp_path, manifest, steps=30)
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step_00000030" / "COMPLETE").exists()
    assert glob.glob(str(run / "tensorboard" / "events.out.tfevents.*"))
    assert "WER" in log and (run / "report.json").exists()

    records = [json.loads(l) for l in open(run / "metrics.jsonl")]
    train = [r["loss"] for r in records if r["split"] == "train"]
    assert train[-1] < 0.7 * train[0], f"loss did not go down on a 12-utterance set: {train}"

    log2 = launch(tmp_path, manifest, steps=34, extra=("checkpoint.resume=auto",))
    assert "resumed from" in log2 and "step_00000030" in log2
    assert (run / "checkpoints" / "step_00000034" / "COMPLETE").exists()


def _in_process_args(tmp_path, manifest, *extra):
    return ["--config", os.path.join(ROOT, "configs", "asr_demo.yaml"), f"trainer.output_dir={tmp_path}/run",
            f"data.tokenizer={tmp_path}/tok.json", f"data.train_manifest={manifest}", f"data.eval_manifest={manifest}",
            f"demo.test_manifests=[{manifest}]", "trainer.max_steps=2", "trainer.eval_every=0",
            "logging.progress_bar=false", "data.max_duration=8", "data.num_buckets=2", "data.num_workers=0",
            "model.d_model=32", "model.ffn_dim=64", "model.num_layers=1", "model.num_heads=2", *extra]


def test_eval_features_are_not_spec_augmented_with_gpu_features(tmp_path):
    """feature_device=gpu: the objective's extractor follows the model's mode, so evaluation
    (and the keep-best choice) sees unmasked features; training still sees masks."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch

    import ddptrain
    from ddptrain.data import build_dataloader, load_or_build_tokenizer
    from finetune_asr import ASRConfig, CTCObjective

    manifest = tiny_manifest(tmp_path, n=4)
    cfg = ddptrain.load_config(None, [f"data.train_manifest={manifest}", f"data.tokenizer={tmp_path}/t.json",
                                      "data.feature_device=gpu", "data.spec_augment=true", "data.num_workers=0",
                                      "data.time_mask_ratio=0.3", "data.freq_mask_width=30"], schema=ASRConfig)
    tok = load_or_build_tokenizer(cfg.data)
    loader = build_dataloader(manifest, cfg.data, tok, train=True)
    objective = CTCObjective(tok, loader.feature_extractor)
    batch = next(iter(loader))
    model = torch.nn.Identity()
    model.eval()
    a, _ = objective._features(model, batch)
    b, _ = objective._features(model, batch)
    assert torch.equal(a, b), "evaluation features were masked at random"
    model.train()
    c, _ = objective._features(model, batch)
    assert not torch.equal(a, c), "training features lost SpecAugment"


def test_test_set_metrics_after_fit_reach_metrics_jsonl(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import finetune_asr

    manifest = tiny_manifest(tmp_path, n=4)
    finetune_asr.main(_in_process_args(tmp_path, manifest))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    test_rows = [r for r in rows if r["split"] == "test"]
    assert test_rows and "wer" in test_rows[0] and test_rows[0]["step"] == 2


def test_resuming_a_finished_run_keeps_its_report(tmp_path):
    """issue 30, item 2: the report of a resumed run keeps the before-fine-tuning numbers, and the
    version it replaces goes to the run's archive."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import finetune_asr

    manifest = tiny_manifest(tmp_path, n=4)
    finetune_asr.main(_in_process_args(tmp_path / "one", manifest, "trainer.max_steps=1"))
    args = _in_process_args(tmp_path, manifest, f"model.init_from={tmp_path}/one/run")
    first = finetune_asr.main(args)
    assert first["before"]
    again = finetune_asr.main(args + ["checkpoint.resume=auto"])  # a finished run, resumed
    report = json.load(open(tmp_path / "run" / "report.json"))
    assert report["before"] == first["before"] == again["before"]
    archived = glob.glob(str(tmp_path / "run" / "archive" / "*" / "report.json"))
    assert all(json.load(open(p))["before"] == first["before"] for p in archived)


def test_the_training_log_has_model_flops_and_audio_seconds(tmp_path):
    """issue 31 item 3: the recipe passes its FLOPs helper, so every training line has TFLOP/s per
    GPU (no MFU on CPU) and audio seconds per second, with features from the loader or the GPU;
    from audio, the FLOPs are those of the frames the extractor makes."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch

    import ddptrain
    import finetune_asr
    from ddptrain.data import build_dataloader, load_or_build_tokenizer

    manifest = tiny_manifest(tmp_path, n=4)
    for where in ("worker", "gpu"):
        finetune_asr.main(_in_process_args(tmp_path / where, manifest, f"data.feature_device={where}"))
        rows = [json.loads(line) for line in open(tmp_path / where / "run" / "metrics.jsonl")]
        r = [r for r in rows if r["split"] == "train"][-1]
        assert r["tflops_per_gpu"] > 0 and r["audio_s_per_s"] > 0 and r["samples_per_s"] > 0 and "mfu" not in r

    cfg = ddptrain.load_config(None, [f"data.train_manifest={manifest}", f"data.tokenizer={tmp_path}/t.json",
                                      "data.feature_device=gpu", "data.num_workers=0"], schema=finetune_asr.ASRConfig)
    loader = build_dataloader(manifest, cfg.data, load_or_build_tokenizer(cfg.data), train=True)
    batch, ext = next(iter(loader)), loader.feature_extractor
    flops = finetune_asr.model_flops(finetune_asr.ConformerCTC(cfg.model), ext)
    with torch.no_grad():
        feats = ext(batch["audio"], batch["audio_lens"])["features"]
    assert flops.of_batch(batch) == flops.conformer(*feats.shape[:2]) == flops.of_batch({"features": feats})
