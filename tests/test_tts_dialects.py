"""The dialect workflow of docs/dialects.md on a tiny VoxCPM2: one base folder, one LoRA adapter per
shipped dialect (Lancashire, Scots) trained with base replay mixed in (configs/tts_voxcpm2_dialect.yaml:
mix_temperature, a cap on the base source), evaluated per source, exported by examples/export_tts.py
and loaded on top of the base by upstream's own API (``voxcpm.core.VoxCPM(..., lora_config,
lora_weights_path)``): every adapter tensor loaded equals the trained one, upstream builds exactly
the adapted layers with ddptrain's scaling, and the adapted model computes what the merged export
computes. The regression gate's warning names the source worse than the base by more than the
margin. The Python snippet of docs/dialects.md runs as written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import export_tts  # noqa: E402
import finetune_tts as ft  # noqa: E402

import ddptrain  # noqa: E402
from _tts_data import DATA, copy_split  # noqa: E402
from ddptrain.weights import read_weights  # noqa: E402
from models import voxcpm_tts as vt  # noqa: E402

vt.import_voxcpm2()  # upstream's model code (and through it voxcpm.core's imports), before the heap is frozen

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")

CONFIG = os.path.join(ROOT, "configs", "tts_voxcpm2_dialect.yaml")
DIALECTS = ("lancashire", "scots")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few lines of the shipped base-language source (digits/base) and of each dialect."""
    root = tmp_path_factory.mktemp("dialects")
    out = {"root": root, "base": {s: copy_split(str(root / "base"), s, n, os.path.join(DATA, "digits", "base"))
                                  for s, n in (("train", 6), ("dev", 3))}}
    for d in DIALECTS:
        out[d] = {s: copy_split(str(root / d), s, n, os.path.join(DATA, "dialect", d)) for s, n in (("train", 4),
                                                                                                   ("dev", 2))}
    return out


def cpu_args(corpus, dialect, run, *more):
    c = corpus
    return [f"data.train_sources.base={c['base']['train']}", f"data.eval_sources.base={c['base']['dev']}",
            f"data.train_sources.{dialect}={c[dialect]['train']}", f"data.eval_sources.{dialect}={c[dialect]['dev']}",
            f"trainer.output_dir={run}", "trainer.device=cpu", "trainer.precision=fp32", "trainer.param_dtype=fp32",
            "data.max_duration=9", "data.num_buckets=2", "data.num_workers=0", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.log_every=1", "tts.num_samples=0", "scheduler.warmup_steps=0",
            "optim.lr=1e-2", "trainer.max_steps=4", "trainer.eval_every=2", "checkpoint.every_steps=2", *more]


@pytest.fixture(scope="module")
def base(corpus):
    """The base model folder: a tiny random VoxCPM2 saved as a user's download is laid out."""
    cfg = ddptrain.load_config(CONFIG, cpu_args(corpus, "lancashire", corpus["root"] / "unused"),
                               schema=ft.RecipeConfig)
    b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
    path = str(corpus["root"] / "VoxCPM2-base")
    vt.save_pretrained(b.model, b.vae, b.tokenizer.hf, path)
    return path


def evals(run):
    return [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["split"] == "eval"]


def upstream_with_adapter(adapter: str):
    """Upstream's inference pipeline with the adapter loaded as its LoRA WebUI loads one."""
    from voxcpm.core import VoxCPM
    from voxcpm.model.voxcpm2 import LoRAConfig

    info = json.load(open(os.path.join(adapter, "lora_config.json")))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # upstream prints what it loaded
        tts = VoxCPM(info["base_model"], lora_config=LoRAConfig(**info["lora_config"]), lora_weights_path=adapter,
                     enable_denoiser=False, optimize=False, device="cpu")
    return tts, info, err.getvalue()


@pytest.mark.parametrize("dialect", DIALECTS)
def test_adapter_per_dialect_loads_on_the_base_with_upstreams_api(corpus, base, dialect, tmp_path):
    run = tmp_path / "run"
    ft.main(["--config", CONFIG, *cpu_args(corpus, dialect, run, f"tts.path={base}")])
    logged = evals(run)
    # per source, the base measured before the first step, and loss/mean over the two sources
    assert [r["step"] for r in logged] == [0, 2, 4]
    for r in logged:
        assert r["loss/mean"] == pytest.approx((r["loss/base"] + r[f"loss/{dialect}"]) / 2)
    assert logged[-1][f"loss/{dialect}"] < logged[0][f"loss/{dialect}"]
    assert json.load(open(run / "eval_baseline.json"))[f"loss/{dialect}"] == logged[0][f"loss/{dialect}"]

    adapter = str(tmp_path / "adapter")
    export_tts.main([str(run), adapter, "--lora", "--best"])
    assert sorted(os.listdir(adapter)) == ["lora_config.json", "lora_weights.safetensors"]
    best = min(logged[1:], key=lambda r: (r["loss/mean"], -r["step"]))["step"]
    _, trained = read_weights(str(run / "checkpoints" / f"step_{best:08d}"))
    assert set(trained) and all(k.endswith((".lora_A", ".lora_B")) for k in trained)

    tts, info, said = upstream_with_adapter(adapter)
    assert info["base_model"] == os.path.abspath(base)
    assert info["lora_config"] == {"enable_lm": True, "enable_dit": True, "enable_proj": False, "r": 32, "alpha": 32,
                                   "dropout": 0.0, "target_modules_lm": ["k_proj", "o_proj", "q_proj", "v_proj"],
                                   "target_modules_dit": ["k_proj", "o_proj", "q_proj", "v_proj"]}
    assert f"Loaded {len(trained)} LoRA parameters, skipped 0" in said
    model = tts.tts_model
    loaded = model.get_lora_state_dict()
    assert loaded.keys() == trained.keys()  # upstream built exactly the adapted layers
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert any(k.endswith(".lora_B") and trained[k].abs().sum() > 0 for k in trained)  # trained, not the zero init
    from voxcpm.modules.layers.lora import LoRALinear

    assert {float(m.scaling) for m in model.modules() if isinstance(m, LoRALinear)} == {1.0}  # alpha / r, as ours

    # the adapted upstream model computes what the merged export (a plain model folder) computes
    merged = str(tmp_path / "merged")
    export_tts.main([str(run / "checkpoints" / f"step_{best:08d}"), merged])
    plain = vt.model_class("voxcpm2").from_local(merged, optimize=False, device="cpu")
    cfg = ddptrain.load_config(str(run / "config.yaml"), schema=ft.RecipeConfig)
    b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
    dev = ft.read_latent_cache(cfg, corpus[dialect]["dev"], b.layout.patch_size)
    batch = next(iter(ft.build_loader(dev, cfg, b.tokenizer, b.layout, False, 1, 0)))
    outs = []
    for m in (model, plain):
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(ft.TTSObjective().outputs(m.eval(), batch))
    for k in ("loss/diff", "loss/stop"):
        torch.testing.assert_close(outs[0][k], outs[1][k], rtol=1e-4, atol=1e-5)


def test_the_gate_warns_naming_the_source_worse_than_the_base(corpus, base, tmp_path, capsys):
    baseline = tmp_path / "base_metrics.json"  # a base far better on 'base' than any model: it must regress
    baseline.write_text(json.dumps({"loss/base": 0.0, "loss/scots": 1e9}))
    run = tmp_path / "run"
    ft.main(["--config", CONFIG, *cpu_args(corpus, "scots", run, f"tts.path={base}", f"eval.baseline={baseline}",
                                           "trainer.max_steps=2", "checkpoint.keep_best=0")])
    said = capsys.readouterr()
    said = said.out + said.err
    assert re.search(r"WARNING: regression at step 2: source 'base' loss/base=\d+\.\d+ is worse than the base's "
                     r"0\.0000 by more than eval\.regression_margin=0\.02", said), said
    assert "source 'scots'" not in said
    [r] = evals(run)
    assert (r["regressed/base"], r["regressed/scots"], r["regressed"]) == (1, 0, 1)


def test_the_walkthroughs_python_snippet_runs(corpus, base, tmp_path, monkeypatch):
    """docs/dialects.md's snippet, as written, in a folder holding its adapter path."""
    for d in DIALECTS:
        run = tmp_path / "runs" / "dialects" / d
        ft.main(["--config", CONFIG, *cpu_args(corpus, d, run, f"tts.path={base}", "trainer.max_steps=2")])
        export_tts.main([str(run), str(run / "adapter"), "--lora", "--best"])
    doc = open(os.path.join(ROOT, "docs", "dialects.md")).read()
    [snippet] = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert '"runs/dialects/scots/adapter"' in snippet
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "docs/dialects.md", "exec"), namespace)
    import soundfile as sf

    info = sf.info(str(tmp_path / "scots.wav"))
    assert info.samplerate == 48000 and info.frames > 0  # VoxCPM2 decodes at 48 kHz
    model = namespace["tts"].tts_model
    assert model.lora_config.r == 32
    _, lancashire = read_weights(str(tmp_path / "runs" / "dialects" / "lancashire"))
    assert all(torch.equal(v, lancashire[k]) for k, v in model.get_lora_state_dict().items())  # swapped in
    from voxcpm.modules.layers.lora import LoRALinear

    assert {float(m.scaling) for m in model.modules() if isinstance(m, LoRALinear)} == {0.0}  # the base alone


def test_evaluate_scores_each_test_set_with_and_without_the_adapter(corpus, base, tmp_path):
    """examples/evaluate.py with this recipe (docs/dialects.md, step 3): one line per set; the
    adapter comes from --weights (a trainable-only checkpoint on the base it names)."""
    import evaluate

    run = tmp_path / "run"
    ft.main(["--config", CONFIG, *cpu_args(corpus, "scots", run, f"tts.path={base}")])
    sets = [corpus["base"]["dev"], corpus["scots"]["train"]]
    args = [a for a in cpu_args(corpus, "scots", run, f"tts.path={base}") if not a.startswith("trainer.output_dir")]
    common = ["--recipe", os.path.join(ROOT, "examples", "finetune_tts.py"), "--config", CONFIG, *args]
    alone = evaluate.main([*common, "--out", str(tmp_path / "ev_base"), *sets])
    adapted = evaluate.main([*common, "--weights", str(run), "--out", str(tmp_path / "ev_scots"), *sets])
    assert set(alone) == set(adapted) == set(sets) and {"loss", "diff", "stop"} <= set(alone[sets[1]])
    assert adapted[sets[1]]["loss"] < alone[sets[1]]["loss"]  # the adapter learned the Scots it trained on
