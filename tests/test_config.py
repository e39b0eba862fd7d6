"""Config loading: defaults, YAML, overrides, and errors that name the key and its origin."""

from dataclasses import dataclass, field

import pytest

import ddptrain
from ddptrain.config import ConfigError, load_config


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.5\ntrainer:\n  precision: bf16\n")
    cfg = load_config(str(path), ["optim.lr=0.25", "data.speed_perturb=[0.9,1.1]"])
    assert cfg.optim.lr == 0.25 and cfg.trainer.precision == "bf16"
    assert cfg.data.speed_perturb == [0.9, 1.1]
    assert cfg.optim.weight_decay == ddptrain.Config().optim.weight_decay


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lrr: 0.5\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*optim\.lrr"):
        load_config(str(path))


@pytest.mark.parametrize("override,pattern", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("trainer.max_steps=ten", "bad value for 'trainer.max_steps'"),
    ("trainer.precision=fp8", "trainer.precision='fp8' is not one of"),
    ("optim.lr", "not of the form key=value"),
    ("nosuchsection.x=1", "unknown config key 'nosuchsection"),
    ("data=5", "override 'data=5': bad value for 'data': a section takes keys"),
    ("trainer.grad_accum_steps=0", r"trainer.grad_accum_steps=0 must be >= 1"),
    ("logging.log_every=0", r"logging.log_every=0 must be >= 1"),
    ("dist.timeout_s=0", r"dist.timeout_s=0.0 must be >= 1"),
])
def test_bad_overrides(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(str(bad))
    listed = tmp_path / "list.yaml"
    listed.write_text("- trainer\n- optim\n")
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping"):
        load_config(str(listed))


def test_user_schema_extension():
    @dataclass
    class ModelCfg:
        width: int = 8

    @dataclass
    class MyConfig(ddptrain.Config):
        model: ModelCfg = field(default_factory=ModelCfg)

    cfg = load_config(None, ["model.width=16"], schema=MyConfig)
    assert cfg.model.width == 16 and cfg.optim.name == "adamw"
    with pytest.raises(ConfigError, match="model.depth"):
        load_config(None, ["model.depth=2"], schema=MyConfig)
