"""bench/bench_9b.py still runs: its plan's jobs dry-run on CPU with a tiny GLM-4.1V (vision tower
fed synthetically, LoRA through the config, recompute, the supervised-positions loss), the
multi-GPU full fine-tune plan on 2 gloo ranks with sharded masters, and the HF Trainer + peft
peer where peft is installed. The FLOP model is checked against the real model's sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

pytest.importorskip("transformers")
import bench_9b  # noqa: E402
from ddptrain.memory import PRESETS  # noqa: E402


def test_flop_model_counts_the_real_decoder():
    """The analytic per-layer weight count equals the HF model's decoder layer (biases aside)."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextDecoderLayer

    cfg = bench_9b.glm4v_config("real")
    with torch.device("meta"):
        layer = Glm4vTextDecoderLayer(cfg.text_config, 0)
    weights = sum(p.numel() for n, p in layer.named_parameters() if n.endswith("proj.weight"))
    t = cfg.text_config
    hd = t.hidden_size // t.num_attention_heads
    assert weights == t.hidden_size * hd * (2 * t.num_attention_heads + 2 * t.num_key_value_heads) \
        + 3 * t.hidden_size * t.intermediate_size
    batch = {"input_ids": torch.zeros(1, 8192, dtype=torch.long), "labels": torch.zeros(1, 8192, dtype=torch.long),
             "pixel_values": torch.zeros(3136, 1176)}
    lora, full = bench_9b.step_flops(cfg, batch, True, True), bench_9b.step_flops(cfg, batch, False, True)
    p_t = weights * t.num_hidden_layers * 8192  # 8.2e9 decoder weights x 8k tokens
    assert 4 * p_t < lora < 6 * p_t and 6 * p_t < full < 8 * p_t  # 2x / 3x forward, plus attention (8k tokens) and head


@pytest.mark.timeout(300)
def test_plan_dry_runs_on_cpu(tmp_path):
    out = tmp_path / "rows.jsonl"
    jobs = ["lora_ddptrain", "lora_ddptrain_compiled", "full9b_zero"] + (
        ["lora_hf_peft"] if importlib.util.find_spec("peft") else [])
    assert bench_9b.main(["plan", "--dry", "--jobs", ",".join(jobs), "--out", str(out), "--tmp", str(tmp_path)]) == 0
    rows = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    check = rows.pop("lora_ddptrain_compiled_vs_eager")  # the plan ran both: it compared them
    assert sorted(rows) == sorted(jobs)
    compiled = rows["lora_ddptrain_compiled"]
    assert compiled["compiled"] == 2 and compiled["compile_eager_fallbacks"] == 0 and rows["lora_ddptrain"]["compiled"] == 0
    assert check["ok"] and check["steps"] == 3 and check["max_loss_rel_diff"] <= bench_9b.CHECK_RTOL["tiny"]
    lora, zero = rows["lora_ddptrain"], rows["full9b_zero"]
    for r in (lora, zero):
        assert "error" not in r and "9b" in r["workload"] and r["steps"] == 2 and r["tokens_per_s"] > 0
        assert {"workload", "peer", "world_size", "batch", "samples_per_s", "audio_s_per_s", "peak_alloc_gb",
                "mfu"} <= set(r)
    assert lora["adapted_layers"] == 12 and 0 < lora["num_trainable"] < 0.1 * lora["num_params"]
    assert zero["world_size"] == 2 and zero["num_trainable"] == zero["num_params"]
    assert lora["recomputed"] == zero["recomputed"] == 2
    # the peers' shared targets: the row trains exactly their adapters (the job itself refuses otherwise)
    assert lora["num_trainable"] == bench_9b.lora_trainable(bench_9b.build({"model": "9b"}, "tiny", torch.device("meta")))
    if "lora_hf_peft" in rows:  # the same adapters through peft
        assert rows["lora_hf_peft"]["num_trainable"] == lora["num_trainable"]
        assert rows["lora_hf_peft"]["adapted_layers"] == lora["adapted_layers"]


def test_both_peers_adapt_the_same_decoder_layers_and_never_the_vision_tower(monkeypatch):
    """ddptrain's globs and peft's regex select the same layers: attention and MLP projections of
    every decoder layer (6 a layer), none of the vision tower; at the real shape that is the 47.6M
    adapter parameters both rows record (ddptrain.memory's preset). Targets that differ are refused."""
    real = bench_9b.build({"model": "9b"}, "real", torch.device("meta"))
    layers = bench_9b.lora_layers(real)
    assert len(layers) == 6 * 40 and not any("visual" in n for n in layers)
    assert any(n.endswith("visual.blocks.0.attn.qkv") for n, _ in real.named_modules())  # what "q/k/v" is there
    assert bench_9b.lora_trainable(real) == 47_595_520 == PRESETS["glm4v-9b-lora"]["trainable"]
    monkeypatch.setattr(bench_9b, "PEFT_TARGETS", bench_9b.PEFT_TARGETS + r"|.*visual\.blocks\.\d+\.attn\.qkv")
    with pytest.raises(ValueError, match=r"only ddptrain's \[\], only peft's \['model.visual.blocks.0.attn.qkv'"):
        bench_9b.lora_layers(real)
    with pytest.raises(RuntimeError, match="peft trains 21,299,200 parameters, the shared LoRA targets 47,595,520"):
        bench_9b.check_trainable("peft", 21_299_200, 47_595_520)


def test_compiled_vs_eager_check_fails_on_a_different_loss_or_a_missing_row():
    row = lambda name, losses, norms: {"name": name, "losses": losses, "grad_norms": norms}  # noqa: E731
    eager = row("lora_ddptrain", [5.0, 4.9], [2.0, 2.1])
    same = bench_9b.compare_losses([eager, row("lora_ddptrain_compiled", [5.0, 4.9], [2.0, 2.1])],
                                   "lora_ddptrain_compiled", "lora_ddptrain", 1e-2)
    assert same["ok"] and same["max_loss_rel_diff"] == 0.0
    for losses, norms in (([5.0, 4.7], [2.0, 2.1]), ([5.0, 4.9], [2.0, 2.5]), ([5.0, float("nan")], [2.0, 2.1]),
                          ([5.0], [2.0])):
        got = bench_9b.compare_losses([eager, row("lora_ddptrain_compiled", losses, norms)],
                                      "lora_ddptrain_compiled", "lora_ddptrain", 1e-2)
        assert not got["ok"], (losses, norms)
    missing = bench_9b.compare_losses([eager], "lora_ddptrain_compiled", "lora_ddptrain", 1e-2)
    assert not missing["ok"] and "lora_ddptrain_compiled" in missing["error"]
