"""Evaluation over sources (ddptrain/regression.py): <metric>/mean for keep-best over all sources,
and the regression gate that names the source worse than the base by more than the margin."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ddptrain
from ddptrain.config import ConfigError, load_config
from ddptrain.data import CharTokenizer
from ddptrain.regression import read_baseline, source_means
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches

SOURCES = ["data.eval_sources={a: a.jsonl, b: b.jsonl}"]


class FakeWER:
    """metrics_fn whose wer/a, wer/b follow a script: row k is the k-th full evaluation's."""

    def __init__(self, rows):
        self.rows, self.evals = rows, -1

    def __call__(self, model, batch):
        if batch["first"]:
            self.evals += 1
        a, b = self.rows[min(self.evals, len(self.rows) - 1)]
        return {"wer": (a + b, 2), "wer/a": (a, 1), "wer/b": (b, 1)}


def eval_batches():
    batches = [b for mb in micro_batches(2) for b in mb]
    return [dict(b, first=i == 0) for i, b in enumerate(batches)]


def fit(tmp, rows, *extra, metrics=None):
    torch.manual_seed(0)
    metrics = metrics or FakeWER(rows)
    t = ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(tmp, *SOURCES, *extra), micro_batches(4)[0] * 4,
                         eval_data=eval_batches(), metrics_fn=metrics)
    t.fit()
    t.close()
    return t, metrics


def evals(tmp):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(tmp, "metrics.jsonl"))) if r["split"] == "eval"}


def test_source_means_count_each_source_once():
    result = {"wer": 0.1, "wer/a": 0.2, "wer/b": 0.4, "cer/a": 0.1, "cer/b": float("nan"), "loss": 1.0}
    assert source_means(result, ["a", "b"]) == pytest.approx({"wer/mean": 0.3, "cer/mean": 0.1})
    assert source_means(result, ["a"]) == {"wer/mean": 0.2, "cer/mean": 0.1}
    assert source_means({"wer": 0.1}, ["a"]) == {}


def test_the_gate_measures_the_base_and_names_the_regressing_source(tmp_path, capsys):
    rows = [(0.20, 0.30), (0.21, 0.30), (0.25, 0.28), (0.30, 0.20)]  # step 0 (the base), 2, 4; then 6
    run = tmp_path / "run"
    fit(run, rows, "trainer.max_steps=4", "trainer.eval_every=2", "eval.baseline=measure",
        "eval.regression_margin=0.02")
    err = capsys.readouterr().err
    assert "regression at step 4: source 'a' wer/a=0.2500 is worse than the base's 0.2000 by more than " \
           "eval.regression_margin=0.02" in err
    assert "source 'b'" not in err and "regression at step 2" not in err  # within the margin / better
    logged = evals(run)
    assert logged[0]["wer/a"] == 0.2 and "regressed" not in logged[0]  # the base, measured before training
    assert (logged[2]["regressed/a"], logged[2]["regressed/b"], logged[2]["regressed"]) == (0, 0, 0)
    assert (logged[4]["regressed/a"], logged[4]["regressed/b"], logged[4]["regressed"]) == (1, 0, 1)
    assert logged[4]["wer/mean"] == pytest.approx(0.265)
    assert read_baseline(str(run / "eval_baseline.json"))["wer/a"] == 0.2
    assert any(e.tag == "eval/regressed/a" for e in _tb_scalars(run))  # a flag in TensorBoard too
    # a resume compares with the base measured at step 0 (not a new measurement of the trained model)
    fit(run, rows[3:], "trainer.max_steps=6", "trainer.eval_every=2", "eval.baseline=measure",
        "eval.regression_margin=0.02", "checkpoint.resume=auto")
    assert "source 'a' wer/a=0.3000 is worse than the base's 0.2000" in capsys.readouterr().err
    assert evals(run)[6]["regressed/a"] == 1


def _tb_scalars(run):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    folder = run / "tensorboard"
    out = []
    for name in os.listdir(folder):
        for event in EventFileLoader(str(folder / name)).Load():
            out += [v for v in event.summary.value] if event.HasField("summary") else []
    return out


def test_a_baseline_file_a_missing_source_and_the_max_mode(tmp_path, capsys):
    meta = tmp_path / "meta.json"  # a checkpoint's meta.json: its metrics are the base's
    meta.write_text(json.dumps({"step": 9, "metrics": {"acc/a": 0.9}}))
    rows = [(0.85, 0.5)]

    def acc(model, batch):
        return {"acc/a": (rows[0][0], 1), "acc/b": (rows[0][1], 1)}

    fit(tmp_path / "run", rows, "trainer.max_steps=2", f"eval.baseline={meta}", "eval.regression_metric=acc",
        "eval.regression_mode=max", "eval.regression_margin=0.01", metrics=acc)
    err = capsys.readouterr().err
    assert "source 'a' acc/a=0.8500 is worse than the base's 0.9000 by more than eval.regression_margin=0.01" in err
    assert "eval.baseline has no acc/b: source 'b' is not checked for regressions" in err
    assert not (tmp_path / "run" / "eval_baseline.json").exists()


def test_gate_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="eval.baseline: cannot read .*nowhere.json"):
        fit(tmp_path / "r1", [(0.1, 0.1)], f"eval.baseline={tmp_path}/nowhere.json")
    with pytest.raises(ConfigError, match="eval.baseline compares evaluations .* no eval_data"):
        ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(tmp_path / "r2", "eval.baseline=measure"), micro_batches(2)[0])
    with pytest.raises(ConfigError, match="data.eval_sources may not name a source 'mean'"):
        load_config(None, ["data.eval_sources={mean: x, b: y}"])
    with pytest.raises(ConfigError, match="eval.regression_mode"):
        load_config(None, ["eval.regression_mode=lower"])
    fit(tmp_path / "r3", [(0.1, 0.1)], "trainer.max_steps=2", "checkpoint.every_steps=2", "eval.baseline=measure")
    os.remove(tmp_path / "r3" / "eval_baseline.json")
    with pytest.raises(ConfigError, match=r"resumes at step 2 and .*eval_baseline.json does not exist"):
        fit(tmp_path / "r3", [(0.1, 0.1)], "trainer.max_steps=4", "eval.baseline=measure", "checkpoint.resume=auto")


def test_keep_best_ranks_checkpoints_by_the_mean_over_sources(tmp_path):
    # the probe of best_metric at the start, then steps 2..8: a's best is at step 4, b's at step 6,
    # the mean over both is best at step 2
    rows = [(0.9, 0.9), (0.20, 0.30), (0.10, 0.60), (0.50, 0.05), (0.45, 0.45)]
    run = tmp_path / "run"
    fit(run, rows, "trainer.max_steps=8", "trainer.eval_every=2", "checkpoint.every_steps=2",
        "checkpoint.keep_last=1", "checkpoint.keep_best=1", "checkpoint.best_metric=wer/mean")
    kept = sorted(os.listdir(run / "checkpoints"))
    kept = [k for k in kept if k.startswith("step_")]
    assert kept == ["step_00000002", "step_00000008"]
    meta = json.load(open(run / "checkpoints" / "step_00000002" / "meta.json"))
    assert meta["metrics"]["wer/mean"] == pytest.approx(0.25)


@pytest.mark.timeout(600)
def test_the_asr_demo_mix_with_temperature_a_cap_keep_best_and_the_gate(tmp_path, monkeypatch):
    """The shipped configs/asr_demo_mix.yaml on subsets of the shipped digits, tiny model, with the
    dialect workflow's keys: the base replayed at a temperature under a cap, keep-best over the
    mean of the sources, the base model measured at step 0 and each evaluation checked against it."""
    from test_evaluate import ROOT, TINY_ASR, manifest

    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    import finetune_asr

    acc, base = manifest(tmp_path, "accent/train", 24), manifest(tmp_path, "base/train", 60)
    acc_dev, base_dev = manifest(tmp_path, "accent/dev", 4), manifest(tmp_path, "base/dev", 4)
    CharTokenizer.build(f"{acc},{base}").save(str(tmp_path / "tok.json"))
    run = tmp_path / "run"
    finetune_asr.main(["--config", os.path.join(ROOT, "configs", "asr_demo_mix.yaml"), f"trainer.output_dir={run}",
                       f"data.tokenizer={tmp_path}/tok.json", f"data.train_sources={{accent: {acc}, base: {base}}}",
                       f"data.eval_sources={{accent: {acc_dev}, base: {base_dev}}}", "data.train_weights.accent=0.8",
                       "data.train_weights.base=0.2", "data.mix_temperature=2", "data.source_caps={base: {epochs: 0.2}}",
                       "model.init_from=''", "demo.test_manifests=[]", "trainer.max_steps=12", "trainer.eval_every=4",
                       "checkpoint.every_steps=4", "checkpoint.keep_best=1", "checkpoint.best_metric=wer/mean",
                       "eval.baseline=measure", "eval.regression_margin=0.5", *TINY_ASR])
    logged = evals(run)
    assert sorted(logged) == [0, 4, 8, 12]
    assert read_baseline(str(run / "eval_baseline.json"))["wer/accent"] == logged[0]["wer/accent"]
    for step in (4, 8, 12):
        assert logged[step]["wer/mean"] == pytest.approx((logged[step]["wer/accent"] + logged[step]["wer/base"]) / 2)
        assert {"regressed/accent", "regressed/base", "regressed"} <= set(logged[step])


def test_a_gate_that_would_check_nothing_is_refused_at_the_start(tmp_path):
    """A typo'd or whole-set regression_metric, or no named eval sources: refused before a step."""
    for i, metric in enumerate(["wre", "loss"]):  # loss: produced for the whole set only
        with pytest.raises(ConfigError, match=rf"eval.regression_metric='{metric}' is not a metric this run's "
                                              r"evaluation produces per eval source .*it produces per source: wer"):
            fit(tmp_path / f"m{i}", [(0.1, 0.1)], "trainer.max_steps=2", "eval.baseline=measure",
                f"eval.regression_metric={metric}")
        assert not (tmp_path / f"m{i}" / "eval_baseline.json").exists()
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"wer/a": 0.1, "wer/b": 0.2, "loss": 1.0}))
    with pytest.raises(ConfigError, match=rf"eval.regression_metric='loss': the base's metrics in {base} have no "
                                          r"loss/<source> .*per-source metrics there: wer"):
        fit(tmp_path / "f1", [(0.1, 0.1)], f"eval.baseline={base}", "eval.regression_metric=loss")
    base.write_text(json.dumps({"cer/a": 0.1}))  # a base with the metric, a run without it: the probe finds out
    metrics = FakeWER([(0.1, 0.1)])
    with pytest.raises(ConfigError, match=r"eval.regression_metric='cer' is not a metric .*it produces per source: wer"):
        fit(tmp_path / "f2", [], "trainer.max_steps=2", f"eval.baseline={base}", "eval.regression_metric=cer",
            metrics=metrics)
    assert metrics.evals == 0 and not list((tmp_path / "f2").glob("checkpoints/step_*"))  # the probe only, no step
    with pytest.raises(ConfigError, match=r"eval.baseline='measure' compares eval.regression_metric per eval source "
                                          r"\(wer/<source>\), and this run's evaluation has no named sources \(a single "
                                          r"data.eval_manifest\): name them with data.eval_sources"):
        ddptrain.Trainer(FrameMLP(), frame_loss, make_cfg(tmp_path / "s", "eval.baseline=measure"),
                         micro_batches(2)[0], eval_data=eval_batches(), metrics_fn=FakeWER([(0.1, 0.1)]))
