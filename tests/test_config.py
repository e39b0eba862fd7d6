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


def test_a_removed_key_is_refused_naming_it_and_what_to_set_instead(tmp_path):
    """data.bucket_budgets (per-bucket budget files) is gone: a config that still sets it is told
    to use the single data.max_duration that python -m ddptrain.tune prints, not just "unknown"."""
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  bucket_budgets: runs/asr/budgets.json\n")
    want = r"'data\.bucket_budgets' is no longer a config key: .*python -m ddptrain\.tune.*data\.max_duration"
    with pytest.raises(ConfigError, match=r"c\.yaml: " + want):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"override 'data\.bucket_budgets=b\.json': " + want):
        load_config(None, ["data.bucket_budgets=b.json"])


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


@dataclass
class ModelCfg:
    """A recipe's own config section (the schema extensions below)."""

    width: int = 8


@dataclass
class MyConfig(ddptrain.Config):
    model: ModelCfg = field(default_factory=ModelCfg)


def test_user_schema_extension():
    cfg = load_config(None, ["model.width=16"], schema=MyConfig)
    assert cfg.model.width == 16 and cfg.optim.name == "adamw"
    with pytest.raises(ConfigError, match="model.depth"):
        load_config(None, ["model.depth=2"], schema=MyConfig)


# --------------------------------------------- choice values reach their users in canonical form


def test_best_mode_in_capitals_keeps_the_best_checkpoint(tmp_path):
    import json
    import os

    from ddptrain import checkpoint as ckpt

    cfg = load_config(None, ["checkpoint.best_mode=MIN"])
    for step, loss in [(1, 1.0), (2, 3.0), (3, 2.0), (4, 2.5)]:
        path = tmp_path / f"step_{step}"
        path.mkdir()
        (path / "meta.json").write_text(json.dumps({"run_id": "r", "metrics": {"loss": loss}}))
        (path / ckpt.COMPLETE).write_text("")
    ckpt.prune(str(tmp_path), keep_last=1, keep_best=1, metric="loss", mode=cfg.checkpoint.best_mode,
               run_id="r")
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_4"]  # the lowest loss and the newest


def test_comm_hook_in_capitals_installs_the_bf16_hook(monkeypatch):
    import torch
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from ddptrain.dist import wrap_ddp

    cfg = load_config(None, ["dist.comm_hook=BF16"])
    hooks = []
    monkeypatch.setattr(DistributedDataParallel, "register_comm_hook", lambda self, state, hook: hooks.append(hook))
    tdist.init_process_group("gloo", rank=0, world_size=1, store=tdist.HashStore())
    try:
        wrap_ddp(torch.nn.Linear(2, 2), cfg.dist, torch.device("cpu"))
    finally:
        tdist.destroy_process_group()
    assert hooks == [default_hooks.bf16_compress_hook]


def test_precision_in_capitals_autocasts_to_bf16():
    import torch

    from ddptrain.precision import Precision

    cfg = load_config(None, ["trainer.precision=BF16"])
    assert Precision(cfg.trainer.precision, torch.device("cpu")).dtype == torch.bfloat16


def test_scheduler_name_in_mixed_case_decays_after_warmup():
    import math

    import torch

    from ddptrain.optim import build_scheduler

    cfg = load_config(None, ["scheduler.name=Warmup_Cosine", "scheduler.warmup_steps=2"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, cfg.scheduler, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[2:] == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)])


# ------------------------------------------------------------ every key is checked at load


def test_every_key_of_the_schema_is_in_the_table():
    import dataclasses

    from ddptrain.config import RULES, Config

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            yield from keys(type(default), f"{prefix}{f.name}.") if dataclasses.is_dataclass(default) \
                else [f"{prefix}{f.name}"]

    assert sorted(keys(Config)) == sorted(RULES)


@pytest.mark.parametrize("override,pattern", [
    ("optim.betas=[0.9]", r"optim.betas=\[0.9\] must have 2 values, not 1"),
    ("optim.betas=[0.9,1.0]", r"optim.betas=\[0.9, 1.0\] item 1 \(1.0\) must be in \[0, 1\)"),
    ("trainer.max_epochs=0", "trainer.max_epochs must be >= 1 when trainer.max_steps=0"),
    ("optim.lr=0", "optim.lr=0.0 must be > 0"),
    ("optim.lr=nan", "optim.lr=nan must be finite"),
    ("optim.eps=0", "optim.eps=0.0 must be > 0"),
    ("scheduler.warmup_steps=-1", "scheduler.warmup_steps=-1 must be >= 0"),
    ("scheduler.min_lr_ratio=1.5", r"scheduler.min_lr_ratio=1.5 must be in \[0, 1\]"),
    ("trainer.clip_grad_norm=-1", "trainer.clip_grad_norm=-1.0 must be >= 0"),
    ("trainer.eval_every=-1", "trainer.eval_every=-1 must be >= 0"),
    ("checkpoint.every_steps=-5", "checkpoint.every_steps=-5 must be >= 0"),
    ("data.sample_rate=0", "data.sample_rate=0 must be > 0"),
    ("data.max_duration=0", "data.max_duration=0.0 must be > 0"),
    ("data.num_buckets=0", "data.num_buckets=0 must be >= 1"),
    ("data.frame_shift_ms=0", "data.frame_shift_ms=0.0 must be > 0"),
    ("data.frame_length_ms=0.05", "data.frame_length_ms / data.frame_shift_ms are under 2 / 1 samples"),
    ("data.time_mask_ratio=2", r"data.time_mask_ratio=2.0 must be in \[0, 1\]"),
    ("data.prefetch_factor=0", "data.prefetch_factor=0 must be >= 1"),
    ("data.speed_perturb=[0.9,0]", r"data.speed_perturb=\[0.9, 0.0\] item 1 \(0.0\) must be > 0"),
    ("data.tail=exact", "data.tail='exact' is not one of split, duplicate, drop"),
    ("data.features=mfcc", "data.features='mfcc' is not one of fbank, logmel, "),
    ("data.normalize=global", "data.normalize=global needs data.global_stats"),
    ("trainer.preempt_signals=[SIGTERM,SIGFOO]", r"item 1 \('SIGFOO'\) 'SIGFOO' is not a signal name"),
    ("trainer.preempt_signals=[SIGKILL]", "SIGKILL cannot be caught"),
    ("trainer.device=gpu", "trainer.device='gpu' is not one of auto, cpu, cuda"),
    ("trainer.param_dtype=bf16", "trainer.param_dtype=bf16 needs trainer.precision=bf16"),
    ("recompute.enabled=true", "recompute.enabled=true needs recompute.module_classes or recompute.name_globs"),
])
def test_bad_values_name_the_key_and_the_override(override, pattern):
    with pytest.raises(ConfigError, match=rf"^override '{override[:12]}.*{pattern}"):
        load_config(None, [override])


def test_a_bad_value_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  betas: [0.9, 0.98, 0.999]\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: optim\.betas=\[0.9, 0.98, 0.999\] must have 2 values"):
        load_config(str(path))
    path.write_text("trainer:\n  max_epochs: 0\n")  # fixed by an override: fine
    assert load_config(str(path), ["trainer.max_steps=3"]).trainer.max_epochs == 0


def test_choices_signals_and_keywords_are_stored_canonical():
    cfg = load_config(None, ["trainer.preempt_signals=[term,sigusr1,SIGINT]", "optim.fused=True",
                             "compile.dynamic=FALSE", "data.tail=Split", "checkpoint.resume=AUTO",
                             "data.features=Whisper_LogMel", "data.normalize=NONE"])
    assert cfg.trainer.preempt_signals == ["SIGTERM", "SIGUSR1", "SIGINT"]
    assert (cfg.optim.fused, cfg.compile.dynamic, cfg.data.tail, cfg.checkpoint.resume, cfg.data.features) == \
        ("true", "false", "split", "auto", "whisper_logmel")
    assert load_config(None, ["checkpoint.resume=runs/Auto/step_5"]).checkpoint.resume == "runs/Auto/step_5"


def test_canonical_signal_names_install():
    import signal

    from ddptrain.process import PreemptionFlag

    flag = PreemptionFlag(load_config(None, ["trainer.preempt_signals=[usr1]"]).trainer.preempt_signals)
    assert flag.signals == [signal.SIGUSR1]


def test_check_section_normalises_a_data_config_built_in_python():
    from ddptrain.config import check_section
    from ddptrain.data.config import DataConfig

    mine = DataConfig(features="LogMel", bad_data="SKIP")
    got = check_section(mine, "data")
    assert (got.features, got.bad_data) == ("logmel", "skip")
    assert mine.features == "LogMel"  # the caller's object is left as it was
    assert check_section(DataConfig(), "data") == DataConfig()
    with pytest.raises(ConfigError, match=r"^data.speed_perturb=\[1.1, -1.0\] item 1"):
        check_section(DataConfig(speed_perturb=[1.1, -1.0]), "data")
    with pytest.raises(ConfigError, match="data.max_duration='200' must be a number"):
        check_section(DataConfig(max_duration="200"), "data")


@pytest.mark.parametrize("name", ["asr_demo.yaml", "asr_demo_accent.yaml", "asr_gpu.yaml"])
def test_shipped_configs_load(name, monkeypatch):
    import importlib
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "examples"))
    schema = importlib.import_module("finetune_asr").ASRConfig
    load_config(os.path.join(root, "configs", name), schema=schema)


# ------------------------------------------------------------------ a recipe's rules, in the one table


@dataclass
class _Toy:
    n: int = 1
    name: str = "a{x}"


def _toy_schema(rules=None, together=None):
    from typing import ClassVar

    @dataclass
    class ToyRecipe(ddptrain.Config):
        toy: _Toy = field(default_factory=_Toy)
        RULES: ClassVar[dict] = rules or {}
        RULES_TOGETHER: ClassVar[list] = together or []

    return ToyRecipe


def test_a_recipes_rules_are_checked_at_load_naming_key_and_origin():
    from ddptrain.config import at_least, one_of, reference_markdown, satisfies

    schema = _toy_schema(
        {"toy.n": at_least(1), "toy.name": satisfies("holds {x} once", lambda v: v.count("{x}") == 1,
                                                     "must contain {x} exactly once"),
         "data.features": one_of("logmel", "fbank")},  # a library key: the library's rule first, then the recipe's
        [(("toy.n", "data.max_batch_size"), lambda n, b: b == 0 or n <= b, "toy.n must not exceed data.max_batch_size")])
    assert load_config(None, ["toy.n=3"], schema=schema).toy.n == 3
    with pytest.raises(ConfigError, match=r"override 'toy.n=0': toy.n=0 must be >= 1"):
        load_config(None, ["toy.n=0"], schema=schema)
    with pytest.raises(ConfigError, match=r"toy.name='b' must contain \{x\} exactly once"):
        load_config(None, ["toy.name=b"], schema=schema)
    with pytest.raises(ConfigError, match=r"data.features='raw' is not one of logmel, fbank"):
        load_config(None, ["data.features=raw"], schema=schema)
    assert load_config(None, ["data.features=LOGMEL"], schema=schema).data.features == "logmel"  # canonical first
    with pytest.raises(ConfigError, match="toy.n must not exceed data.max_batch_size"):
        load_config(None, ["toy.n=3", "data.max_batch_size=2"], schema=schema)
    assert "| `toy.name` | `'a{x}'` | holds {x} once |" in reference_markdown(schema)
    assert load_config(None, ["data.features=raw"]).data.features == "raw"  # the library's schema: not the recipe's rules


def test_a_recipe_rule_for_a_key_the_config_lacks_is_an_error():
    from ddptrain.config import at_least

    with pytest.raises(ConfigError, match=r"ToyRecipe.RULES names keys the config does not have: toy.m"):
        load_config(None, schema=_toy_schema({"toy.m": at_least(1)}))
    with pytest.raises(ConfigError, match=r"names keys the config does not have: toy.k"):
        load_config(None, schema=_toy_schema(together=[(("toy.k",), lambda k: True, "")]))


# --------------------------------------------- a Config built in Python is checked too (issue 30, item 5)


def _python_config(tmp_path, **trainer):
    cfg = ddptrain.Config()
    cfg.trainer.output_dir = str(tmp_path)
    cfg.trainer.max_steps = 2
    cfg.logging.progress_bar = False
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


def _python_trainer(cfg):
    import torch
    from torch import nn

    torch.manual_seed(0)
    data = [{"x": torch.randn(4, 3), "y": torch.randn(4)} for _ in range(2)]
    loss = lambda m, b: (((m(b["x"]).squeeze(-1) - b["y"]) ** 2).sum(), 4)  # noqa: E731
    return ddptrain.Trainer(nn.Linear(3, 1), loss, cfg, data, eval_data=data[:1])


def test_the_trainer_checks_a_config_built_in_python(tmp_path):
    import os

    cfg = _python_config(tmp_path / "a", precision="BF16")
    cfg.checkpoint.best_mode, cfg.checkpoint.keep_best = "MIN", 1
    t = _python_trainer(cfg)
    assert t.cfg.checkpoint.best_mode == "min" and t.cfg.trainer.precision == "bf16"
    assert cfg.checkpoint.best_mode == "MIN"  # the caller's object is left as it was
    t.fit()
    cfg = _python_config(tmp_path / "b", max_steps=0, max_epochs=0)
    with pytest.raises(ConfigError, match="trainer.max_epochs must be >= 1 when trainer.max_steps=0"):
        _python_trainer(cfg)
    assert not os.path.exists(tmp_path / "b" / "checkpoints" / "step_00000000")
    cfg = _python_config(tmp_path / "c")
    cfg.optim.lr = -1.0
    with pytest.raises(ConfigError, match=r"optim.lr=-1.0 must be > 0"):
        _python_trainer(cfg)


# --------------------------------------------- errors that say what to change (issue 30, items 10 and 11)


def test_a_weight_for_a_source_that_does_not_exist_names_it_and_the_sources():
    sources = "data.train_sources={accent: a.jsonl, base: b.jsonl}"
    with pytest.raises(ConfigError, match=r"data.train_weights names 'acent', which is not a source of "
                                          r"data.train_sources \(accent, base\)"):
        load_config(None, [sources, "data.train_weights={acent: 1, base: 1}"])
    with pytest.raises(ConfigError, match=r"data.train_weights has no weight for 'base' \(sources: accent, base\)"):
        load_config(None, [sources, "data.train_weights={accent: 1}"])
    with pytest.raises(ConfigError, match=r"data.train_weights names 'a', .* \(none: weights need named sources"):
        load_config(None, ["data.train_weights={a: 1}"])


@pytest.mark.parametrize("override,key,want", [("data.train_weights=[1,2]", "data.train_weights", "a mapping"),
                                               ("optim.betas={a: 1}", "optim.betas", "a list"),
                                               ("data.eval_sources=[x.jsonl]", "data.eval_sources", "a mapping")])
def test_a_list_for_a_mapping_or_the_reverse_names_the_key(tmp_path, override, key, want):
    with pytest.raises(ConfigError, match=rf"override '{override.replace('[', '.').replace(']', '.')}': "
                                          rf"{key} takes {want}"):
        load_config(None, [override])
    path = tmp_path / "c.yaml"
    section, leaf = key.split(".")
    path.write_text(f"{section}:\n  {leaf}: {override.split('=', 1)[1]}\n")
    with pytest.raises(ConfigError, match=rf"c.yaml: {key} takes {want}"):
        load_config(str(path))


# --------------------------------------------- a typo'd attribute on a Python-built config (issue 49, item 4)


def test_a_typod_attribute_on_a_python_built_config_is_an_unknown_key(tmp_path):
    import os

    from ddptrain.config import check_config, check_section
    from ddptrain.data.config import DataConfig

    cfg = _python_config(tmp_path / "a")
    cfg.trainer.max_step = 5
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.max_step' \(an attribute set in Python that "
                                          r"TrainerConfig does not have\): did you mean 'trainer.max_steps'\?"):
        _python_trainer(cfg)
    assert not os.path.exists(tmp_path / "a" / "checkpoints")
    cfg = _python_config(tmp_path / "b")
    cfg.optimm = cfg.optim  # a section name misspelt
    with pytest.raises(ConfigError, match=r"unknown config key 'optimm' .*did you mean 'optim'\?"):
        check_config(cfg)
    loaded = load_config(None, ["trainer.max_steps=3"])  # a loaded config changed in Python: the same
    loaded.ema.decayy = 0.9
    with pytest.raises(ConfigError, match=r"unknown config key 'ema.decayy' .*did you mean 'ema.decay'\?"):
        check_config(loaded)
    data = check_section(DataConfig(), "data")  # a section checked once, then given a typo: checked again
    data.max_duraton = 10.0
    with pytest.raises(ConfigError, match=r"unknown config key 'data.max_duraton' .*did you mean 'data.max_duration'"):
        check_section(data, "data")
    with pytest.raises(ConfigError, match=r"unknown config key 'data.zzz' \(an attribute set in Python that "
                                          r"DataConfig does not have\)$"):  # nothing close: no guess
        check_section(_with(DataConfig(), zzz=1), "data")


def _with(obj, **attrs):
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def test_a_recipes_own_sections_are_checked_for_typos_too():
    from ddptrain.config import check_config

    cfg = load_config(None, ["model.width=16"], schema=MyConfig)
    assert check_config(cfg).model.width == 16  # its own sections and keys are known
    cfg.model.widht = 4
    with pytest.raises(ConfigError, match=r"unknown config key 'model.widht' .*ModelCfg.*did you mean 'model.width'\?"):
        check_config(cfg)
    with pytest.raises(ConfigError, match=r"unknown config key 'model.widht' .*did you mean 'model.width'\?"):
        load_config(None, ["model.widht=4"], schema=MyConfig)  # the YAML/override path suggests it too


@pytest.mark.parametrize("yaml_text,key,value", [("trainer: 5\n", "trainer", "5"),
                                                  ("optim:\n  lr: 0.1\ndata: [1, 2]\n", "data", "[1, 2]")])
def test_a_value_for_a_whole_section_in_a_file_names_the_section(tmp_path, yaml_text, key, value):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == (f"{path}: bad value for '{key}': a section takes keys below it ({key}.key=value on the "
                              f"command line; in YAML, indented key: value lines under {key}:), not a value ({value})")
