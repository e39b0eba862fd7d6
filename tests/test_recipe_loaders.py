"""Every recipe's loaders are the library's: ``DurationBucketSampler.from_config`` and
``make_loader`` (ddptrain/data/loader.py), so a setting of the ``data:`` section means the same
in every recipe. Before, the copies drifted: the HF recipe dropped ``data.loader_timeout_s`` (a
stuck batch hung instead of erroring), its and the TTS recipe's samplers dropped settings
(``data.tail``, ``data.shuffle``, ``data.quadratic_duration``)."""

from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import ddptrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

# settings that differ from the defaults, so a recipe that drops one is caught
DATA = ["data.num_workers=2", "data.tail=duplicate", "data.shuffle=false", "data.quadratic_duration=40",
        "data.bucket_sort_pool=3", "data.sync_buckets=false", "data.seed=5", "data.loader_timeout_s=77",
        "data.prefetch_factor=3", "data.persistent_workers=false", "data.num_buckets=3"]


def assert_library_loader(loader, data, train=True, **overrides):
    s = loader.batch_sampler
    want = dict(max_batch_size=data.max_batch_size, quadratic_duration=data.quadratic_duration,
                num_buckets=data.num_buckets, sort_pool=data.bucket_sort_pool, sync_buckets=data.sync_buckets,
                shuffle=data.shuffle and train, tail=data.tail if train else "exact", seed=data.seed)
    assert {k: getattr(s, k) for k in want} == {**want, **overrides}
    assert (loader.num_workers, loader.timeout, loader.prefetch_factor, loader.persistent_workers) == (2, 77, 3, False)
    assert loader.data_config is not None


def test_hf_synthetic_loader_is_the_librarys():
    import finetune_hf_model as fhm

    cfg = ddptrain.load_config(None, [*DATA, "data.max_duration=60"], schema=fhm.FinetuneConfig)
    small = {m: dataclasses.replace(c, utterances=60) for m, c in fhm.SYNTHETIC.items()}
    assert_library_loader(fhm.build_synthetic_loader(cfg.hf, cfg.data, 1, 0, corpus=small["wav2vec2"]), cfg.data)
    cfg.hf.model = "whisper"
    whisper = fhm.build_synthetic_loader(cfg.hf, cfg.data, 1, 0, corpus=small["whisper"])
    # its lengths are tokens: a fixed number of windows per batch, no seconds budget
    assert_library_loader(whisper, cfg.data, max_batch_size=cfg.hf.batch_size, quadratic_duration=0.0)


def test_glmasr_synthetic_loader_is_the_librarys():
    import finetune_glmasr as fg

    cfg = ddptrain.load_config(os.path.join(ROOT, "configs", "glmasr.yaml"), DATA, schema=fg.RecipeConfig)
    layout = fg.PromptLayout((3, 4, 5), (6, 7), 1, 2, 0, (2,))
    loader = fg.build_synthetic_loader(cfg, layout, 300, 1, 0, 8192,
                                       corpus=dataclasses.replace(fg.SYNTHETIC, utterances=60))
    assert_library_loader(loader, cfg.data)
    # the recipe's cost: whole 30 s windows, plus the quadratic term the library adds
    assert set(np.unique(loader.batch_sampler.durations)) <= {30.0}


def test_tts_loaders_are_the_librarys():
    import finetune_tts as ft
    from tts_cache import CachedUtterance

    cfg = ddptrain.load_config(os.path.join(ROOT, "configs", "tts_dialect.yaml"), [*DATA, "data.max_duration=10"],
                               schema=ft.RecipeConfig)
    layout = SimpleNamespace(audio_vae_config=SimpleNamespace(sample_rate=16000, encoder_rates=[10, 10]),
                             patch_size=2, max_length=600)  # 160 latent frames a second
    utts = [CachedUtterance(f"t{i}", "ab" * i, f"/nowhere/t{i}.npy", 40 * i, "tts.jsonl", i) for i in range(1, 9)]
    assert_library_loader(ft.build_loader(utts, cfg, list, layout, True, 1, 0), cfg.data)
    assert_library_loader(ft.build_loader(utts, cfg, list, layout, False, 1, 0), cfg.data, train=False)
    # named sources (the dialect workflow): the library's mix of them, with the same settings
    named = ft.Utterances(utts, ["base", "dialect"], [0] * 5 + [1] * 3)
    mixed = ft.build_loader(named, cfg, list, layout, True, 1, 0)
    assert_library_loader(mixed, cfg.data)
    sampler = mixed.batch_sampler
    assert type(sampler).__name__ == "WeightedMixSampler" and sampler.names == ["base", "dialect"]
    assert_library_loader(ft.build_loader(named, cfg, list, layout, False, 1, 0), cfg.data, train=False)


@pytest.mark.parametrize("recipe,config,key", [
    ("finetune_hf_model", None, "hf.synthetic_utterances=60"),
    ("finetune_hf_model", None, "hf.chars_per_second=15"),
    ("finetune_glmasr", "glmasr.yaml", "glmasr.synthetic_utterances=60"),
])
def test_recipe_configs_hold_no_benchmark_keys(recipe, config, key):
    """A benchmark's corpus size and shape are its own arguments (``corpus=`` of the recipe's
    ``build_synthetic_loader``, a ``ddptrain.data.SyntheticCorpus``), not keys of a recipe's config."""
    module = __import__(recipe)
    schema = getattr(module, "FinetuneConfig", None) or module.RecipeConfig
    with pytest.raises(ddptrain.ConfigError, match=key.split("=")[0].split(".")[1]):
        ddptrain.load_config(config and os.path.join(ROOT, "configs", config), [key], schema=schema)


@pytest.mark.parametrize("key", ["data.spec_augment=true", "data.feature_device=gpu", "data.speed_perturb=[0.9,1.1]"])
def test_tts_refuses_augmentation_and_gpu_features_that_would_do_nothing(key):
    """TTS trains on VAE latents cached before training: there are no features to compute on the
    GPU or to mask in evaluation, no audio to perturb; such a key is refused, not ignored."""
    import finetune_tts as ft

    with pytest.raises(ddptrain.ConfigError, match="TTS trains on VAE latents cached before training"):
        ddptrain.load_config(os.path.join(ROOT, "configs", "tts_dialect.yaml"), [key], schema=ft.RecipeConfig)
