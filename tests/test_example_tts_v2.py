"""examples/finetune_tts.py on VoxCPM2 (upstream's VoxCPM2Model): a tiny random one on the CPU.

A tiny random VoxCPM2 is saved in the layout of a downloaded folder (config.json with
``"architecture": "voxcpm2"``, model.safetensors, audiovae.safetensors, tokenizer files), which
upstream's own ``from_local`` reads back, and the recipe trains from it: full and LoRA, the loss
falling, a sample written at the VAE's 48 kHz; LoRA adapts exactly the layers upstream's v2 LoRA config adapts, r and alpha as upstream's;
a manifest's ref_audio reaches the batch exactly as upstream's packer puts it; a data.sample_rate
or an audio file below the VAE's input rate is refused naming the file; a text prefix reaches the
tokenizer unchanged; the latent cache (ref_audio latents included) is reused when nothing changed.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_tts as ft  # noqa: E402
import tts_cache  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain.data import DataError  # noqa: E402
from _tts_data import copy_split  # noqa: E402
from models import voxcpm_tts as vt  # noqa: E402

vt.import_voxcpm2()  # upstream's model code, imported now: the module's frozen heap holds it (see pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")

FULL, LORA = (os.path.join(ROOT, "configs", f"tts_voxcpm2{s}.yaml") for s in ("", "_lora"))


def with_ref(manifest, ref_row=0):
    """Every line of ``manifest`` given the ``ref_row``-th line's audio as its ref_audio (upstream's key)."""
    rows = [json.loads(x) for x in open(manifest)]
    for r in rows:
        r["ref_audio"] = rows[ref_row]["audio_filepath"]
    open(manifest, "w").writelines(json.dumps(r) + "\n" for r in rows)
    return manifest


def cpu_args(train, tmp_path, *more):
    return [f"data.train_manifest={train}", "data.eval_manifest=''", f"trainer.output_dir={tmp_path}/run",
            "trainer.device=cpu", "trainer.precision=fp32", "trainer.param_dtype=fp32", "data.max_duration=9",
            "data.num_buckets=2", "data.num_workers=0", "logging.progress_bar=false", "logging.tensorboard=false",
            "logging.log_every=1", "trainer.eval_every=0", "tts.num_samples=0", "checkpoint.every_steps=0",
            "scheduler.warmup_steps=0", "optim.lr=3e-3", *more]


def config(path, train, tmp_path, *more):
    return ddptrain.load_config(path, cpu_args(train, tmp_path, *more), schema=ft.RecipeConfig)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tts2")
    return {"root": root, "train": with_ref(copy_split(str(root / "data"), "train", 4))}


@pytest.fixture(scope="module")
def folder(corpus):
    """A tiny random VoxCPM2 saved as a user's download of openbmb/VoxCPM2 is laid out."""
    cfg = config(FULL, corpus["train"], corpus["root"])
    b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
    path = str(corpus["root"] / "VoxCPM2")
    vt.save_pretrained(b.model, b.vae, b.tokenizer.hf, path)
    return path


def losses(run_dir):
    return [json.loads(x)["loss"] for x in open(os.path.join(run_dir, "metrics.jsonl")) if '"split": "train"' in x]


def test_tiny_folder_is_read_like_a_download(folder):
    assert {"config.json", "model.safetensors", "audiovae.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    raw = json.load(open(os.path.join(folder, "config.json")))
    assert raw["architecture"] == "voxcpm2" and raw["audio_vae_config"]["sample_rate"] == 16000
    model, vae, _ = vt.load_pretrained(folder, "cpu", "float32")
    assert type(model).__name__ == "VoxCPM2Model" and type(vae).__name__ == "AudioVAE"  # AudioVAEV2's class name
    assert (vae.sample_rate, vae.out_sample_rate, vt.output_rate(vae)) == (16000, 48000, 48000)
    # upstream's own loader reads the same folder to the same weights
    up = vt.model_class("voxcpm2").from_local(folder, optimize=False, training=True, device="cpu")
    ours = model.state_dict()
    theirs = {k: v for k, v in up.state_dict().items() if not k.startswith("audio_vae.")}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k].to(ours[k].dtype)) for k in ours)
    assert all(torch.equal(v, up.audio_vae.state_dict()[k]) for k, v in vae.state_dict().items())


def test_full_fine_tune_from_the_folder(corpus, folder, tmp_path):
    ft.main(["--config", FULL, *cpu_args(corpus["train"], tmp_path, f"tts.path={folder}", "trainer.max_steps=8",
                                         f"data.eval_manifest={corpus['train']}", "trainer.eval_every=8",
                                         "tts.num_samples=1", "tts.sample_timesteps=2", "tts.sample_max_ratio=0.5")])
    got = losses(f"{tmp_path}/run")
    assert len(got) == 8 and got[-1] < 0.7 * got[0], got
    import soundfile as sf

    [wav] = os.listdir(f"{tmp_path}/run/samples/step_0000008")
    assert sf.info(f"{tmp_path}/run/samples/step_0000008/{wav}").samplerate == 48000  # the VAE's output rate


def upstream_lora_names(r=32, alpha=32):
    """The Linear layers upstream's VoxCPM2 LoRA wraps with its v2 config (enable_lm, enable_dit)."""
    m = vt.import_voxcpm2()
    cfg = vt.preset_config("tiny-v2", len(vt.char_tokenizer()))
    vae = vt.vae_from_config(cfg.audio_vae_config, "voxcpm2")
    model = m.VoxCPM2Model(cfg, vt.char_tokenizer(), vae, m.LoRAConfig(enable_lm=True, enable_dit=True, r=r,
                                                                        alpha=alpha), device="cpu")
    from voxcpm.modules.layers.lora import LoRALinear

    return {n for n, mod in model.named_modules() if isinstance(mod, LoRALinear)}


def test_lora_targets_rank_and_alpha_are_upstreams(corpus, folder, tmp_path):
    cfg = config(LORA, corpus["train"], tmp_path, f"tts.path={folder}", "trainer.max_steps=8", "optim.lr=1e-2")
    # upstream's conf/voxcpm_v2/voxcpm_finetune_lora.yaml: r 32, alpha 32, enable_lm + enable_dit
    assert (cfg.lora.rank, cfg.lora.alpha) == (32, 32)
    info = ddptrain.setup_distributed(cfg)
    b, objective, train, _, _ = ft.build(cfg, info)
    trainer = ft.TTSTrainer(b.model, objective, cfg, train)
    assert set(trainer.adapted) == upstream_lora_names()
    assert len(trainer.adapted) == 4 * (2 + 1 + 2)  # q/k/v/o of 2 base-LM, 1 residual-LM and 2 DiT layers
    trainable = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    trainer.fit()
    trainer.close()
    got = losses(f"{tmp_path}/run")
    assert len(got) == 8 and got[-1] < 0.9 * got[0], got


def test_ref_audio_reaches_the_batch_as_upstream_packs_it(corpus, tmp_path):
    cfg = config(FULL, corpus["train"], tmp_path)
    ft.prepare_manifest(cfg, corpus["train"])
    utts = ft.read_latent_cache(cfg, corpus["train"], 2)
    u = utts[1]
    assert u.ref_latent_path and u.ref_frames > 0 and u.ref_audio.endswith("dialect-train-0000.ogg")
    b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
    ids = b.tokenizer(u.text)
    ds = ft.LatentDataset([u], [ids])
    batch = ft.TTSCollator(2)([ds[0]])
    packer = vt.upstream_packer_class()(dataset_cnt=1, max_len=b.layout.max_length, patch_size=2,
                                        feat_dim=b.layout.feat_dim, audio_vae=b.vae)
    by_id = {e.id: e for e in ddptrain.data.load_manifest(corpus["train"])}
    wave = ddptrain.data.load_audio(by_id[u.id].audio_filepath, 16000)[None]
    ref_wave = ddptrain.data.load_audio(u.ref_audio, 16000)[None]
    ref = packer(audio_tokens=wave, text_tokens=torch.tensor([ids], dtype=torch.int32),
                 task_ids=torch.ones(1, dtype=torch.long), dataset_ids=torch.zeros(1, dtype=torch.long),
                 is_prompts=[False], ref_audio_tokens=ref_wave)
    assert batch["text_tokens"][0, 0] == vt.REF_START and vt.REF_END in batch["text_tokens"][0].tolist()
    for key in ("text_tokens", "text_mask", "audio_mask", "loss_mask", "labels"):
        assert torch.equal(batch[key], ref[key].to(torch.int32)), key
    torch.testing.assert_close(batch["audio_feats"], ref["audio_feats"], rtol=1e-5, atol=1e-6)
    assert batch["frames"] == u.frames  # the loss on the target only, not on the reference


def test_text_prefix_passes_through(corpus, tmp_path):
    root = corpus["root"] / "prefix"
    train = with_ref(copy_split(str(root), "train", 1))
    rows = [json.loads(x) for x in open(train)]
    text = "(A calm old man, slow and warm)" + rows[0]["text"]
    rows[0]["text"] = text
    open(train, "w").writelines(json.dumps(r) + "\n" for r in rows)
    cfg = config(FULL, train, tmp_path)
    ft.prepare_manifest(cfg, train)
    [u] = ft.read_latent_cache(cfg, train, 2)
    assert u.text == text
    b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
    loader = ft.build_loader([u], cfg, b.tokenizer, b.layout, False, 1, 0)
    batch = next(iter(loader))
    ids = b.tokenizer(text)
    start = u.ref_frames // 2 + 2  # after 103, the reference's patches, 104
    assert batch["text_tokens"][0, start:start + len(ids)].tolist() == ids
    assert ids[:len(b.tokenizer("(A calm"))] == b.tokenizer("(A calm")


def write_wav(path, rate, seconds=1.0):
    import soundfile as sf

    t = np.arange(int(rate * seconds)) / rate
    sf.write(path, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate)
    return path


def test_sample_rate_disagreement_is_refused_naming_the_file(corpus, folder, tmp_path):
    with pytest.raises(ddptrain.ConfigError, match=rf"data.sample_rate=48000 .*16000 Hz \({folder}/config.json"):
        ft.build_model(config(FULL, corpus["train"], tmp_path, f"tts.path={folder}", "data.sample_rate=48000"), None)
    low = write_wav(str(tmp_path / "phone.wav"), 8000)
    ok = write_wav(str(tmp_path / "ok.wav"), 24000)
    train = tmp_path / "low.jsonl"
    train.write_text(json.dumps({"audio": low, "text": "a phone call"}) + "\n"
                     + json.dumps({"audio": ok, "text": "fine", "ref_audio": low}) + "\n"
                     + json.dumps({"audio": ok, "text": "fine too"}) + "\n")
    cfg = config(FULL, str(train), tmp_path, f"tts.path={folder}")
    with pytest.raises(DataError) as e:
        ft.prepare_manifest(cfg, str(train))
    assert f"audio {low} is recorded at 8000 Hz, below the VAE's input rate of 16000 Hz" in str(e.value)
    assert f"ref_audio {low} is recorded at 8000 Hz" in str(e.value) and "low.jsonl:2" in str(e.value)
    skipped = ft.prepare_manifest(config(FULL, str(train), tmp_path, f"tts.path={folder}", "data.bad_data=skip"),
                                  str(train))
    assert (skipped["encoded"], skipped["skipped"]) == (1, 2)  # 24 kHz is resampled, as for VoxCPM-1.5


def test_latent_cache_holds_the_references_and_is_reused(corpus, tmp_path):
    root = corpus["root"] / "cache"
    train = with_ref(copy_split(str(root), "train", 2))
    cfg = config(FULL, train, tmp_path)
    first = ft.prepare_manifest(cfg, train)
    assert (first["encoded"], first["written"]) == (2, True)
    again = ft.prepare_manifest(cfg, train)
    assert (again["encoded"], again["written"]) == (0, False)
    utts = ft.read_latent_cache(cfg, train, 2)
    assert all(np.load(u.ref_latent_path).shape == (u.ref_frames, 16) for u in utts)
    assert np.array_equal(np.load(utts[0].ref_latent_path), np.load(utts[0].latent_path))  # its own audio as reference
    meta = json.load(open(os.path.join(tts_cache.cache_dir(train), "meta.json")))
    assert meta["ref_audio"] == "encoded" and meta["vae"]["architecture"] == "voxcpm2"
    assert meta["vae_source"]["preset"] == "tiny-v2"
    with pytest.raises(DataError, match="another VAE"):  # a 1.5 reader (no references) is not handed this cache
        tts_cache.read_cache(train, ft.vae_spec(cfg), 2)
    rows = [json.loads(x) for x in open(train)]
    rows[1]["ref_audio"] = rows[1]["audio_filepath"]  # a changed reference: that line is encoded again
    open(train, "w").writelines(json.dumps(r) + "\n" for r in rows)
    third = ft.prepare_manifest(cfg, train)
    assert (third["encoded"], third["reused"]) == (1, 1)


def test_the_voxcpm2_preset_has_the_published_layout():
    # the checkpoint's tensors: 577, these shapes (public listings of openbmb/VoxCPM2's model.safetensors)
    layout = vt.preset_config("voxcpm2", 0, "bfloat16")
    with torch.device("meta"):
        vae = vt.vae_from_config(layout.audio_vae_config, "voxcpm2")
        model = vt.build_model(layout, vt.char_tokenizer(), vae, "cpu", "voxcpm2")
    state = model.state_dict()
    assert len(state) == 577 and 2.28e9 < sum(p.numel() for p in model.parameters()) < 2.30e9
    shapes = {"base_lm.embed_tokens.weight": (73448, 2048), "base_lm.layers.27.self_attn.q_proj.weight": (2048, 2048),
              "base_lm.layers.0.self_attn.k_proj.weight": (256, 2048), "stop_head.weight": (2, 2048),
              "feat_encoder.encoder.layers.11.self_attn.q_proj.weight": (2048, 1024),
              "base_lm.layers.0.mlp.gate_proj.weight": (6144, 2048)}
    assert {k: tuple(state[k].shape) for k in shapes} == shapes
    assert (vae.sample_rate, vae.out_sample_rate, vae.hop_length, vt.frame_rate(layout.audio_vae_config)) == (
        16000, 48000, 640, 25.0)
    assert model.residual_lm.config.no_rope and len(model.feat_decoder.estimator.decoder.layers) == 12


@pytest.mark.parametrize("preset, kv", [("tiny", 0), ("tiny-v2", 0), ("tiny-v2", 32)])
def test_analytic_flops_match_the_counted_ones(preset, kv):
    # the MFU of the recipe's log and of bench/bench_voxcpm.py: VoxCPM2's DiT sees 2P+3 tokens, and with
    # kv_channels its layers attend wider than they are. Counted on attention's math kernel (the CPU's
    # fused one is not counted), which computes a causal LM's whole S x S: the analytic count's half more
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from models.train_flops import VoxCpmFlops

    arch = vt.preset_architecture(preset)
    layout = vt.preset_config(preset, 512, "float32")
    if kv:
        for part in (layout.lm_config, layout.encoder_config, layout.dit_config):
            part.kv_channels = kv
        rope = layout.lm_config.rope_scaling  # one factor per rotary pair of the wider heads
        rope.long_factor, rope.short_factor = [1.0] * (kv // 2), [1.0] * (kv // 2)
    torch.manual_seed(0)
    model = vt.build_model(layout, vt.char_tokenizer(), vt.vae_from_config(layout.audio_vae_config, arch), "cpu",
                           arch).train()
    # long enough that the LM's attention is a good part of the FLOPs
    batch = ft.TTSCollator(2)([{"id": str(i), "text_ids": list(range(200, 230 + i)), "latents": torch.randn(160 + 2 * i, 16)}
                               for i in range(3)])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _ = ft.TTSObjective()(model, batch)
        loss.backward()
    flops = VoxCpmFlops(model, layout)
    b, s = batch["text_mask"].shape
    masked = sum(6.0 * n * d * b * s * s for _, n, d, local in flops.parts if local is None)
    assert 0.99 < (flops(b, s) + masked) / counter.get_total_flops() < 1.02
    assert VoxCpmFlops(model, layout, lora=True)(b, s) < 0.8 * flops(b, s)  # frozen weights: no weight gradients


@pytest.mark.timeout(150)
def test_bench_dry_run_voxcpm2(tmp_path):
    # bench/bench_voxcpm.py --arch voxcpm2: upstream's LoRA step (2 accumulated micro-batches, references in
    # front) against the recipe's LoRA config, both on tiny-v2 with the same adapters
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_voxcpm

    out = tmp_path / "rows.jsonl"
    assert bench_voxcpm.main(["--arch", "voxcpm2", "--dry", "--inline", "--ref-audio", "--peers",
                              "upstream_lora,ddptrain_lora", "--out", str(out)]) == 0
    up, ddp = [json.loads(x) for x in open(out)]
    assert (up["peer"], ddp["peer"]) == ("upstream_lora", "ddptrain_lora")
    for r in (up, ddp):
        assert r["workload"] == "voxcpm2_tiny_dry" and r["ref_audio"] and r["steps"] == 2 and r["samples_per_s"] > 0
        assert np.isfinite(r["loss"]) and r["mfu"] > 0 and 0 < r["trainable"] < r["params"] / 2
    assert (up["name"], up["batch"], up["grad_accum"], up["samples_per_step"]) == ("upstream_lora_b4x2", 4, 2, 8)
    assert up["trainable"] == ddp["trainable"] and up["params"] == ddp["params"]  # the same r 32 adapters, same layers
    assert ddp["adapted_modules"] == 4 * (2 + 1 + 2)  # q/k/v/o of the base LM, the residual LM and the DiT
