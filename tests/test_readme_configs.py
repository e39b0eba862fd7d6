"""Issue 49 item 15: every config the README names runs to its end in a test (tiny where needed).

The configs no other test runs to the end run here through their recipe's own ``main()`` on the
CPU, each with its own switches (precision, param_dtype, compile, LoRA, optimizer, scheduler,
batch budgets) and only these overrides: a tiny model (the Conformer's dims shrunk,
``glmasr.preset=tiny``, a tiny random VoxCPM saved as a download is laid out), a few shipped
utterances, ``trainer.max_steps=2``, the run folder and tokenizer under tmp. Three settings are
changed because they cannot run here at a test's cost:

- ``data.num_workers=0`` (the configs: 4 or 6 loader processes per loader): forking and joining
  them on 2 shared cores made ~40 s of this module's ~65 s; loader workers are tested elsewhere
  (tests/test_loader.py, the 2-rank recipe runs).
- ``configs/glmasr.yaml``'s ``compile.enabled: true`` stays on, with ``compile.backend=eager``:
  dynamo still captures the config's module classes (the regional path, guards, recompiles), with
  no code generation: with the config's 200 tokens the run compiled 13 variants (train, eval,
  generation's cache states), and even ``aot_eager`` took ~40 s of them here, inductor's C++ more.
  Its evaluation generates ``glmasr.max_new_tokens=8`` tokens (the config: 200; a random model
  never stops early).
- The TTS configs' samples use ``tts.sample_timesteps=2``, ``tts.sample_max_ratio=0.5``.

The guard test reads README.md and the docs/ pages it links for every config they name and
fails when one is run to its end by no test: here, or by the test named in ``COVERED``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddptrain  # noqa: E402
from _tts_data import copy_split  # noqa: E402
from test_evaluate import manifest  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tests/conftest.py: tiny steps, shared cores

# The README's configs run to their end by another test (file::test).
COVERED = {
    "asr_demo.yaml": "tests/test_demo.py::test_demo_both_stages_short",
    "asr_demo_accent.yaml": "tests/test_demo.py::test_demo_both_stages_short",
    "asr_demo_mix.yaml": "tests/test_regression.py::test_the_asr_demo_mix_with_temperature_a_cap_keep_best_and_the_gate",
    "glmasr_tiny.yaml": "tests/test_glmasr_tiny.py::test_the_tiny_config_trains_on_the_digits_and_reports_wer",
    "tts_dialect.yaml": "tests/test_example_tts.py::test_loss_falls_and_samples_are_written",
    "tts_voxcpm2.yaml": "tests/test_example_tts_v2.py::test_full_fine_tune_from_the_folder",
    "tts_voxcpm2_dialect.yaml": "tests/test_tts_dialects.py::test_adapter_per_dialect_loads_on_the_base_with_upstreams_api",
}
# The TTS configs run here, each with the tiny preset of its architecture (its tts.path's model).
TTS_ARCH = {"tts_voxcpm15.yaml": "tiny", "tts_voxcpm15_lora.yaml": "tiny", "tts_voxcpm2_lora.yaml": "tiny-v2"}
# The README's configs run to their end by this module's tests.
RUN_HERE = {"asr_gpu.yaml": "test_asr_gpu", "glmasr.yaml": "test_glmasr", **{c: "test_tts" for c in TTS_ARCH}}
COMMON = ["trainer.max_steps=2", "data.num_workers=0", "logging.progress_bar=false", "logging.tensorboard=false"]


def named_configs() -> set[str]:
    """Every configs/*.yaml README.md and the docs/ pages it links name (bare names included)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    texts = [readme] + [open(os.path.join(ROOT, p)).read()
                        for p in sorted(set(re.findall(r"\((docs/[\w/.-]+\.md)(?:#[\w-]*)?\)", readme)))]
    shipped = set(os.listdir(os.path.join(ROOT, "configs")))
    return {n for t in texts for n in re.findall(r"(?<![\w.-])(?:configs/)?([\w.-]+\.yaml)\b", t) if n in shipped}


def test_every_config_the_readme_names_runs_to_its_end_in_a_test():
    named = named_configs()
    assert {"asr_gpu.yaml", "tts_voxcpm2_lora.yaml", "tts_voxcpm2_dialect.yaml"} <= named  # the parse finds them
    missing = named - set(COVERED) - set(RUN_HERE)
    assert not missing, f"README.md names {sorted(missing)}: run each to its end in a test and list it here"
    assert all(callable(globals().get(test)) for test in RUN_HERE.values())
    for config, test in COVERED.items():  # each named test still exists and still runs its config
        path, name = test.split("::")
        source = open(os.path.join(ROOT, path)).read()
        assert f"def {name}(" in source and config[:-5] in source, f"{config}: {test} is gone or runs another config"


def finite(metrics: dict) -> None:
    assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics


def train_losses(run) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["split"] == "train"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("digits")
    return {"tmp": tmp, "train": manifest(tmp, "base/train", 8), "dev": manifest(tmp, "base/dev", 2)}


@pytest.fixture(scope="module")
def tts_folders(tmp_path_factory):
    """Per preset: a corpus of 4 + 2 shipped utterances and a tiny random VoxCPM (tiny: 1.5's
    architecture, tiny-v2: VoxCPM2's) saved in a download's layout, as the configs' tts.path."""
    import finetune_tts as ft
    from models import voxcpm_tts as vt

    out = {}
    for preset in sorted(set(TTS_ARCH.values())):
        root = tmp_path_factory.mktemp(preset)
        data = {"train": copy_split(str(root / "data"), "train", 4), "dev": copy_split(str(root / "data"), "dev", 2)}
        cfg = ddptrain.load_config(os.path.join(ROOT, "configs", "tts_dialect.yaml"), [
            f"tts.preset={preset}", f"trainer.output_dir={root}/unused", f"data.train_manifest={data['train']}"],
            schema=ft.RecipeConfig)
        b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
        vt.save_pretrained(b.model, b.vae, b.tokenizer.hf, str(root / "model"))
        out[preset] = {**data, "path": str(root / "model")}
    return out


@pytest.mark.timeout(120)
def test_asr_gpu(digits, tmp_path, capsys):
    import finetune_asr

    d, run = digits, tmp_path / "run"
    report = finetune_asr.main([
        "--config", os.path.join(ROOT, "configs", "asr_gpu.yaml"), f"trainer.output_dir={run}",
        f"data.tokenizer={tmp_path}/tok.json", f"data.train_manifest={d['train']}", f"data.eval_manifest={d['dev']}",
        f"demo.test_manifests=[{d['dev']}]", "model.d_model=32", "model.ffn_dim=64", "model.num_layers=1",
        "model.num_heads=2", *COMMON])
    assert json.load(open(run / "report.json")) == report  # written last: the run reached its end
    assert set(report["after"]) == {d["dev"]} and set(report["after"][d["dev"]]) == {"loss", "wer", "cer"}
    finite(report["after"][d["dev"]])
    assert len(train_losses(run)) >= 1 and all(map(math.isfinite, train_losses(run)))
    assert (run / "checkpoints" / "step_00000002" / "COMPLETE").exists()


@pytest.mark.timeout(180)
def test_glmasr(digits, tmp_path, capsys):
    import finetune_glmasr as fg

    d, run = digits, tmp_path / "run"
    result = fg.main(["--config", os.path.join(ROOT, "configs", "glmasr.yaml"), f"trainer.output_dir={run}",
                      "glmasr.preset=tiny", f"data.train_manifest={d['train']}", f"data.eval_manifest={d['dev']}",
                      "compile.backend=eager", "glmasr.max_new_tokens=8", *COMMON])
    # the recipe returns fit's final evaluation (it writes no report.json): WER/CER of generation
    assert set(result) == {"loss", "wer", "cer"}
    finite(result)
    assert "compiled 4 modules" in capsys.readouterr().out  # the config's compile switch stayed on
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [2]
    assert all(map(math.isfinite, train_losses(run))) and train_losses(run)
    assert (run / "checkpoints" / "step_00000002" / "COMPLETE").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", list(TTS_ARCH))
def test_tts(config, tts_folders, tmp_path, capsys):
    import finetune_tts as ft

    f, run = tts_folders[TTS_ARCH[config]], tmp_path / "run"
    summary = ft.main(["--config", os.path.join(ROOT, "configs", config), f"tts.path={f['path']}",
                       f"trainer.output_dir={run}", f"data.train_manifest={f['train']}",
                       f"data.eval_manifest={f['dev']}", f"tts.test_manifests=[{f['dev']}]",
                       "tts.sample_timesteps=2", "tts.sample_max_ratio=0.5", *COMMON])
    report = json.load(open(run / "report.json"))  # written last: the run reached its end
    assert report["test"].keys() == {f["dev"]} and set(report["test"][f["dev"]]) == {"loss", "diff", "stop"}
    assert report["eval"] == summary["eval"]
    finite(report["test"][f["dev"]])
    finite(report["eval"])
    assert all(map(math.isfinite, train_losses(run))) and train_losses(run)
    printed = capsys.readouterr().out
    assert ("LoRA" in printed) == ("lora" in config)  # the config's LoRA switch as it has it
    assert len(os.listdir(run / "samples" / "step_0000002")) == 2  # tts.num_samples: 2, as configured
