"""A recipe's own refused resume keys: ``RESUME_REFUSED`` on its Config subclass (ddptrain/resume.py)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

import ddptrain
from ddptrain import resume
from ddptrain.config import to_yaml
from test_trainer import FrameMLP, frame_loss, micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@dataclass
class ToySection:
    path: str = "a"
    note: str = ""


@dataclass
class ToyConfig(ddptrain.Config):
    toy: ToySection = field(default_factory=ToySection)
    RESUME_REFUSED: ClassVar[dict[str, str]] = {"toy.path": "the saved weights came from this model"}


@dataclass
class FolderConfig(ToyConfig):
    RESUME_FOLDERS: ClassVar[tuple[str, ...]] = ("toy.path",)


def _run(tmp, steps, *extra, schema=ToyConfig):
    torch.manual_seed(0)
    cfg = ddptrain.load_config(None, [f"trainer.output_dir={tmp}", "logging.progress_bar=false",
                                      f"trainer.max_steps={steps}", *extra], schema=schema)
    t = ddptrain.Trainer(FrameMLP(), frame_loss, cfg, micro_batches(4)[0] * 2)
    t.fit()
    t.close()
    return t


def test_the_trainer_refuses_a_recipe_key_by_name_and_applies_the_others(tmp_path):
    _run(tmp_path, 2)
    with pytest.raises(ddptrain.ConfigError, match=re.escape("toy.path: saved 'a', now 'b' (the saved weights came")):
        _run(tmp_path, 4, "checkpoint.resume=auto", "toy.path=b")
    t = _run(tmp_path, 4, "checkpoint.resume=auto", "toy.note=x")  # not refused: applied and recorded
    assert t.step == 4 and "#   toy.note: '' -> 'x'" in (tmp_path / "config.yaml").read_text()


def test_a_misspelt_refused_key_is_an_error():
    @dataclass
    class Misspelt(ToyConfig):
        RESUME_REFUSED: ClassVar[dict[str, str]] = {"toy.pth": "typo"}

    with pytest.raises(ddptrain.ConfigError, match=r"Misspelt.RESUME_REFUSED .* toy.pth"):
        resume.refused_keys(Misspelt())
    assert resume.refused_keys(ddptrain.Config()) == resume.REFUSED  # the base config adds none


def _refusal(recipe_config, key, value):
    saved, now = recipe_config(), recipe_config()
    section, leaf = key.split(".")
    setattr(getattr(now, section), leaf, value)
    diff = resume.changes(to_yaml(saved), now)
    with pytest.raises(ddptrain.ConfigError) as e:
        resume.check(diff, "ckpt", resume.refused_keys(now))
    return str(e.value), getattr(getattr(saved, section), leaf)


@pytest.mark.parametrize("key, value", [("tts.path", "/models/other"), ("tts.vae_seed", 7), ("tts.preset", "voxcpm1.5")])
def test_tts_refuses_another_model_or_vae(key, value):
    import finetune_tts as ft

    message, old = _refusal(ft.RecipeConfig, key, value)
    assert f"{key}: saved {old!r}, now {value!r}" in message


@pytest.mark.parametrize("key, value", [("glmasr.path", "/models/other"), ("glmasr.preset", "tiny")])
def test_glmasr_refuses_another_model(key, value):
    import finetune_glmasr as fg

    message, old = _refusal(fg.RecipeConfig, key, value)
    assert f"{key}: saved {old!r}, now {value!r}" in message


def _model_folder(path, weights: bytes = bytes(range(256)) * 512):
    os.makedirs(path)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_moved_model_folder_resumes_and_another_model_at_the_new_path_does_not(tmp_path):
    run, a = tmp_path / "run", _model_folder(tmp_path / "a")
    _run(run, 2, f"toy.path={a}", schema=FolderConfig)
    moved = tmp_path / "elsewhere" / "a"
    shutil.copytree(a, moved)
    shutil.rmtree(a)  # gone from where the run started: a copy on another node
    t = _run(run, 4, "checkpoint.resume=auto", f"toy.path={moved}", schema=FolderConfig)
    assert t.step == 4 and f"#   toy.path: '{a}' -> '{moved}'" in (run / "config.yaml").read_text()
    # same names, sizes and config.json, other weights (another fine-tune of the same model
    # differs at nearly every byte; the fingerprint samples 16 places per file)
    b = _model_folder(tmp_path / "b", torch.randn(32768, generator=torch.Generator().manual_seed(1)).numpy().tobytes())
    with pytest.raises(ddptrain.ConfigError, match=re.escape(f"toy.path: saved '{moved}', now '{b}'")):
        _run(run, 6, "checkpoint.resume=auto", f"toy.path={b}", schema=FolderConfig)


def test_fingerprints_follow_content_not_place(tmp_path):
    a = _model_folder(tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    assert resume.fingerprint(str(a)) == resume.fingerprint(str(tmp_path / "copy"))
    (tmp_path / "copy" / "config.json").write_text('{"hidden_size": 9}')
    assert resume.fingerprint(str(a)) != resume.fingerprint(str(tmp_path / "copy"))
    assert resume.fingerprint(str(a / "model.safetensors")) is not None  # a single file works too
    assert resume.fingerprint("") is None and resume.fingerprint(str(tmp_path / "missing")) is None


def test_folder_keys_must_be_refused_keys_of_the_config(tmp_path):
    @dataclass
    class NotRefused(ToyConfig):
        RESUME_FOLDERS: ClassVar[tuple[str, ...]] = ("toy.note",)

    @dataclass
    class Misspelt(ToyConfig):
        RESUME_FOLDERS: ClassVar[tuple[str, ...]] = ("toy.pth",)

    for cls, key in ((NotRefused, "toy.note"), (Misspelt, "toy.pth")):
        with pytest.raises(ddptrain.ConfigError, match=rf"{cls.__name__}.RESUME_FOLDERS .* {key}"):
            resume.folder_keys(cls())


def test_a_damaged_folders_file_is_named(tmp_path):
    (tmp_path / resume.FOLDERS_FILE).write_text("{not json")
    with pytest.raises(ddptrain.ConfigError, match=re.escape(str(tmp_path / resume.FOLDERS_FILE))):
        resume.saved_folders(str(tmp_path))
    assert resume.saved_folders(str(tmp_path / "none")) == {}
