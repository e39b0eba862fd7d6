"""Issue 30 item 15: a recipe without weights to load refuses to start, unless a random init is asked
for by name; a missing or incomplete model folder is named with what a downloaded one holds and the
command that downloads it (before, transformers' "Repo id must be in the form" or "install
sentencepiece", or a 2.1B random init on the host)."""

from __future__ import annotations

import os
import re
import sys

import pytest

import ddptrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_glmasr as fg  # noqa: E402
import finetune_tts as ft  # noqa: E402

GLM_DOWNLOAD = "hf download zai-org/GLM-ASR-Nano-2512 --local-dir /models/GLM-ASR-Nano-2512"
VOX_DOWNLOAD = "hf download openbmb/VoxCPM1.5 --local-dir /models/VoxCPM1.5"


def glmasr(tmp_path, *overrides):
    cfg = ddptrain.load_config(os.path.join(ROOT, "configs", "glmasr.yaml"), [
        f"trainer.output_dir={tmp_path}/run", "trainer.device=cpu", *overrides], schema=fg.RecipeConfig)
    return fg.build(cfg, ddptrain.setup_distributed(cfg))


def test_glmasr_without_a_path_refuses_instead_of_a_random_init(tmp_path, monkeypatch):
    monkeypatch.setattr(fg, "load_hf_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ddptrain.ConfigError, match=re.escape(GLM_DOWNLOAD)) as e:
        glmasr(tmp_path)
    assert "glmasr.path is not set" in str(e.value) and "glmasr.preset=tiny" in str(e.value)


def test_glmasr_missing_and_empty_folders_say_what_a_download_holds(tmp_path):
    with pytest.raises(ddptrain.ConfigError, match=r"glmasr.path='.*/nowhere' is not a folder.*config.json.*"
                       + re.escape(GLM_DOWNLOAD)):
        glmasr(tmp_path, f"glmasr.path={tmp_path}/nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ddptrain.ConfigError, match=r"lacks config.json, the weights \(model\*.safetensors\), the "
                       r"tokenizer .*" + re.escape(GLM_DOWNLOAD)):
        glmasr(tmp_path, f"glmasr.path={tmp_path}/empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ddptrain.ConfigError, match=r"lacks the tokenizer \(tokenizer.json"):
        glmasr(tmp_path, f"glmasr.path={tmp_path}/empty")


def test_glmasr_path_and_preset_together_are_refused(tmp_path):
    with pytest.raises(ddptrain.ConfigError, match=r"glmasr.preset='tiny': the preset is a random init"):
        glmasr(tmp_path, f"glmasr.path={tmp_path}", "glmasr.preset=tiny")


def test_glmasr_random_init_by_name_still_builds(tmp_path, monkeypatch):
    class Built(Exception):
        pass

    def load(path, preset, *a):
        raise Built(path, preset)

    monkeypatch.setattr(fg, "load_hf_model", load)
    with pytest.raises(Built) as e:
        glmasr(tmp_path, "glmasr.preset=published")  # the benchmark's synthetic random init
    assert e.value.args == ("", "published")


def tts(tmp_path, config, *overrides):
    return ddptrain.load_config(os.path.join(ROOT, "configs", config), [
        f"trainer.output_dir={tmp_path}/run", *overrides], schema=ft.RecipeConfig)


def test_tts_lora_without_a_path_refuses(tmp_path):
    with pytest.raises(ddptrain.ConfigError, match=r"LoRA adapts downloaded weights.*" + re.escape(VOX_DOWNLOAD)):
        tts(tmp_path, "tts_voxcpm15_lora.yaml")
    # the tiny preset's random init stays allowed (tests), and so does the CPU demo
    tts(tmp_path, "tts_voxcpm15_lora.yaml", "tts.preset=tiny")
    tts(tmp_path, "tts_dialect.yaml")


def test_tts_missing_and_incomplete_folders_say_what_a_download_holds(tmp_path):
    with pytest.raises(ddptrain.ConfigError, match=r"tts.path.*is not a folder.*audiovae.*" + re.escape(VOX_DOWNLOAD)):
        tts(tmp_path, "tts_voxcpm15.yaml", f"tts.path={tmp_path}/nowhere")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = tts(tmp_path, "tts_voxcpm15.yaml", f"tts.path={tmp_path}/m")
    with pytest.raises(ddptrain.ConfigError, match=r"lacks model.safetensors \(or pytorch_model.bin\), "
                       r"audiovae.safetensors \(or audiovae.pth\), the tokenizer \(tokenizer.json\).*" + re.escape(VOX_DOWNLOAD)):
        ft.build_model(cfg, ddptrain.setup_distributed(cfg))
