"""Issue 30 item 17: examples/evaluate.py scores trained weights on test manifests, per set, with
the recipe's own model, loss and metrics, distributed like training: the ASR demo's numbers equal
those its training run reported, on 1 rank and on 2; GLM-ASR's come out of generation."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import evaluate  # noqa: E402
from _dist import run_ranks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tests/conftest.py: tiny steps, shared cores
DIGITS = os.path.join(ROOT, "examples", "data", "digits")
TINY_ASR = ["logging.progress_bar=false", "data.num_workers=0", "data.max_duration=8", "data.num_buckets=2",
            "model.d_model=32", "model.ffn_dim=64", "model.num_layers=1", "model.num_heads=2"]


def manifest(tmp_path, split: str, n: int, skip: int = 0) -> str:
    """n shipped utterances of ``split`` (base/train, accent/test, ...), with absolute audio paths."""
    out = tmp_path / f"{split.replace('/', '_')}_{skip}.jsonl"
    with open(os.path.join(DIGITS, split + ".jsonl")) as src, open(out, "w") as dst:
        for i, line in enumerate(src):
            if skip <= i < skip + n:
                item = json.loads(line)
                item["audio_filepath"] = os.path.join(DIGITS, split.split("/")[0], item["audio_filepath"])
                dst.write(json.dumps(item) + "\n")
    return str(out)


@pytest.fixture(scope="module")
def asr_run(tmp_path_factory):
    import finetune_asr

    tmp = tmp_path_factory.mktemp("asr")
    train, a, b = manifest(tmp, "base/train", 60), manifest(tmp, "base/test", 6), manifest(tmp, "accent/test", 5)
    report = finetune_asr.main(["--config", os.path.join(ROOT, "configs", "asr_demo.yaml"), f"trainer.output_dir={tmp}/run",
                                f"data.tokenizer={tmp}/tok.json", f"data.train_manifest={train}",
                                f"data.eval_manifest={a}", f"demo.test_manifests=[{a},{b}]", "trainer.max_steps=3",
                                "trainer.eval_every=0", *TINY_ASR])
    return {"tmp": tmp, "tests": [a, b], "report": report}


def asr_args(run, out):
    return ["--recipe", os.path.join(ROOT, "examples", "finetune_asr.py"), "--config",
            os.path.join(ROOT, "configs", "asr_demo.yaml"), "--weights", f"{run['tmp']}/run", "--out", out,
            f"data.tokenizer={run['tmp']}/tok.json", *TINY_ASR, *run["tests"]]


def test_asr_scores_equal_the_training_runs_report_and_name_their_set(asr_run, tmp_path, capsys):
    results = evaluate.main(asr_args(asr_run, str(tmp_path / "ev")))
    after = asr_run["report"]["after"]
    assert list(results) == asr_run["tests"]
    for m in asr_run["tests"]:
        assert results[m] == after[m], m  # the same model, reduction and rounding
    printed = capsys.readouterr()
    for m in asr_run["tests"]:
        assert f"[test {m} step 0]" in printed.err and f"{m}: " in printed.out
    saved = json.load(open(tmp_path / "ev" / "report.json"))
    assert saved["results"] == results
    assert f"report: {tmp_path / 'ev' / 'report.json'}; logs: {tmp_path / 'ev' / 'metrics.jsonl'}" in printed.out
    assert os.path.isfile(asr_run["tmp"] / "run" / "report.json")  # the training run's folder is not touched


def _two_ranks(rank, world_size, args, out):
    results = evaluate.main(args)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.mark.timeout(180)
def test_asr_two_rank_scores_equal_one_rank(asr_run, tmp_path):
    run_ranks(_two_ranks, 2, asr_args(asr_run, str(tmp_path / "ev2")), str(tmp_path / "two.json"), timeout=150)
    two = json.load(open(tmp_path / "two.json"))
    for m in asr_run["tests"]:
        for k, v in asr_run["report"]["after"][m].items():
            assert two[m][k] == pytest.approx(v, abs=2e-4), (m, k)


@pytest.fixture(scope="module")
def asr_ema_run(tmp_path_factory):
    """The ASR demo trained with an EMA (decay 0.5: far from the trained weights after 3 steps),
    its final evaluation (the report's "after") measured on the EMA."""
    import finetune_asr

    tmp = tmp_path_factory.mktemp("asr_ema")
    train, a = manifest(tmp, "base/train", 60), manifest(tmp, "base/test", 6)
    report = finetune_asr.main(["--config", os.path.join(ROOT, "configs", "asr_demo.yaml"), f"trainer.output_dir={tmp}/run",
                                f"data.tokenizer={tmp}/tok.json", f"data.train_manifest={train}",
                                f"data.eval_manifest={a}", f"demo.test_manifests=[{a}]", "trainer.max_steps=3",
                                "trainer.eval_every=0", "ema.enabled=true", "ema.decay=0.5", *TINY_ASR])
    return {"tmp": tmp, "tests": [a], "report": report}


def test_ema_weights_are_scored_as_the_training_run_scored_them_and_asked_for_by_name(asr_ema_run, asr_run, tmp_path):
    import ddptrain
    from ddptrain.checkpoint import CheckpointError

    scored = {}
    for which in ("auto", "ema", "model"):
        out = tmp_path / which
        scored[which] = evaluate.main([*asr_args(asr_ema_run, str(out)), "--which", which])
        assert json.load(open(out / "report.json"))["which"] == ("model" if which == "model" else "ema")
    a = asr_ema_run["tests"][0]
    assert scored["auto"][a] == scored["ema"][a] == asr_ema_run["report"]["after"][a]  # the EMA, as the run measured
    assert scored["model"] != scored["ema"]  # the trained weights are another model
    with pytest.raises(CheckpointError, match=r"checkpoint .*run/checkpoints/step_00000003 holds no EMA weights"):
        evaluate.main([*asr_args(asr_run, str(tmp_path / "none")), "--which", "ema"])
    with pytest.raises(ddptrain.ConfigError, match="--which ema: name the checkpoint"):
        evaluate.main(["--recipe", os.path.join(ROOT, "examples", "finetune_asr.py"), "--which", "ema", "x.jsonl"])


def test_a_recipe_without_build_eval_and_no_manifest_are_refused(asr_run, tmp_path):
    import ddptrain

    recipe = tmp_path / "train_only.py"  # a recipe that trains (build) but cannot be scored (no build_eval)
    recipe.write_text("import ddptrain\n\nclass TrainOnlyConfig(ddptrain.Config):\n    pass\n\n"
                      "def build(cfg, info):\n    raise NotImplementedError\n")
    with pytest.raises(ddptrain.ConfigError, match="defines no build_eval"):
        evaluate.main(["--recipe", str(recipe), "x.jsonl"])
    args = [a for a in asr_args(asr_run, str(tmp_path / "ev")) if a not in asr_run["tests"]]
    with pytest.raises(ddptrain.ConfigError, match="no manifest to score"):
        evaluate.main([*args, "data.eval_manifest=''"])


@pytest.mark.timeout(180)
def test_glmasr_tiny_scores_equal_the_runs_final_evaluation(tmp_path, monkeypatch):
    import finetune_glmasr as fg

    monkeypatch.chdir(ROOT)
    dev = manifest(tmp_path, "base/dev", 6)
    common = ["logging.tensorboard=false", "logging.progress_bar=false", "data.num_workers=0"]
    final = fg.main(["--config", "configs/glmasr_tiny.yaml", f"trainer.output_dir={tmp_path}/run", "trainer.max_steps=20",
                     f"data.eval_manifest={dev}", *common])
    results = evaluate.main(["--recipe", "examples/finetune_glmasr.py", "--config", "configs/glmasr_tiny.yaml",
                             "--weights", f"{tmp_path}/run", "--out", f"{tmp_path}/ev", *common, dev])
    assert set(results[dev]) == {"loss", "wer", "cer"}
    for k in ("loss", "wer", "cer"):
        assert results[dev][k] == pytest.approx(final[k], abs=1e-4), k
