"""examples/finetune_tts.py, tts_cache.py and prepare_tts.py: VoxCPM (upstream's model code) on the tiny preset.

A handful of utterances of the shipped dialect corpus, copied to a temporary folder. Checked:
the latent cache is idempotent and names bad audio with its manifest line; it is prepared with the VAE
alone, loaded once, to the latents the whole model's load gave, bitwise; it is keyed on the VAE's
content (a moved or re-exported model folder keeps it, other VAE weights do not); upstream VoxCPM's JSONL
reads unchanged (ref_audio, dataset_id passed through); batches are exactly
what upstream's own packer makes from the audio; the loss is upstream's total times the
loss-masked frames; the loss falls and samples reach wav files and TensorBoard; a resumed run
equals the uninterrupted one; LoRA adapts only the named layers and recompute changes nothing;
the benchmark's CPU dry run runs. voxcpm is installed by `make install` (pip --no-deps).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_tts as ft  # noqa: E402
import tts_cache  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain.data import DataError  # noqa: E402
from _tts_data import copy_split  # noqa: E402
from models import voxcpm_tts as vt  # noqa: E402

vt.import_voxcpm()  # upstream's model code, imported now: the module's frozen heap holds it (see pytestmark)


# One intra-op thread (on 2 shared cores, 2 threads made these tiny steps many times slower) and
# a frozen import-time heap (the Trainer's epoch-end full GC): tests/conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")


def copy_corpus(root, n_train=6):
    return {"train": copy_split(str(root / "data"), "train", n_train), "dev": copy_split(str(root / "data"), "dev", 2)}


FRESH = 3  # utterances of a fresh corpus: each costs a VAE encoding per cache (re)build


@pytest.fixture()
def fresh_corpus(tmp_path):
    """A small corpus of this test's own, for the tests that change its audio or build caches."""
    return copy_corpus(tmp_path, FRESH)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One corpus for the tests that only read it: its latent cache (next to the manifests) is
    encoded by the first of them and reused by the rest, as a user's second run would."""
    return copy_corpus(tmp_path_factory.mktemp("tts"))


def recipe_config(corpus, tmp_path, *overrides):
    return ddptrain.load_config(os.path.join(ROOT, "configs", "tts_dialect.yaml"), [
        f"data.train_manifest={corpus['train']}", f"data.eval_manifest={corpus['dev']}", "tts.test_manifests=[]",
        f"trainer.output_dir={tmp_path}/run", "trainer.device=cpu", "data.max_duration=9", "data.num_buckets=2",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_every=1", "trainer.eval_every=0",
        "tts.num_samples=0", "checkpoint.every_steps=0", "scheduler.warmup_steps=0", "optim.lr=3e-3",
        *overrides], schema=ft.RecipeConfig)


def logged(run_dir, split="train"):
    return [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if f'"split": "{split}"' in x]


# ------------------------------------------------------------------------------ the latent cache


def test_prepare_is_idempotent(fresh_corpus, tmp_path):
    corpus = fresh_corpus
    cfg = recipe_config(corpus, tmp_path)
    first = ft.prepare_manifest(cfg, corpus["train"])
    assert first["encoded"] == FRESH and first["written"]
    folder = first["dir"]
    stamps = {f: os.stat(f).st_mtime_ns for f in glob.glob(os.path.join(folder, "*"))}
    again = ft.prepare_manifest(cfg, corpus["train"])
    assert (again["encoded"], again["reused"], again["written"]) == (0, FRESH, False)
    assert {f: os.stat(f).st_mtime_ns for f in glob.glob(os.path.join(folder, "*"))} == stamps  # nothing rewritten
    # changed audio is encoded again, the rest is kept
    row = json.loads(open(corpus["train"]).readline())
    audio = os.path.join(os.path.dirname(corpus["train"]), row["audio_filepath"])
    wave, sr = __import__("soundfile").read(audio)
    __import__("soundfile").write(audio, wave[: len(wave) // 2], sr, format="OGG", subtype="OPUS")
    third = ft.prepare_manifest(cfg, corpus["train"])
    assert (third["encoded"], third["reused"]) == (1, FRESH - 1)
    # another VAE starts the cache over; the recipe refuses a cache of another VAE
    other = recipe_config(corpus, tmp_path, "tts.vae_seed=1")
    with pytest.raises(DataError, match="another VAE"):
        tts_cache.read_cache(corpus["train"], ft.vae_spec(other), 2)
    assert ft.prepare_manifest(other, corpus["train"])["encoded"] == FRESH


def model_folder(cfg, path):
    """The run's random init saved as a download of its model is laid out (examples/export_tts.py's base)."""
    b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
    vt.save_pretrained(b.model, b.vae, b.tokenizer.hf, str(path))
    return str(path)


@pytest.mark.parametrize("preset", ["tiny", "tiny-v2"])
def test_prepare_loads_the_vae_alone_once_and_encodes_as_the_whole_model_did(fresh_corpus, tmp_path, preset,
                                                                              monkeypatch):
    import prepare_tts

    corpus = fresh_corpus
    folder = model_folder(recipe_config(corpus, tmp_path, f"tts.preset={preset}"), tmp_path / "model")
    whole_model_load, loads = vt.load_pretrained, []
    monkeypatch.setattr(vt, "load_pretrained", lambda *a, **k: pytest.fail("prepare read the whole model"))
    monkeypatch.setattr(vt, "load_vae", lambda path, real=vt.load_vae: loads.append(path) or real(path))
    argv = ["--config", os.path.join(ROOT, "configs", "tts_dialect.yaml"), corpus["train"], corpus["dev"],
            f"tts.path={folder}"]
    assert prepare_tts.main(argv) == 0 and loads == [folder]  # once, for both manifests
    ft._VAE_DIGESTS.clear()  # a later run: the caches are current, their record spares the VAE's hash
    assert prepare_tts.main(argv) == 0 and loads == [folder]
    # the latents, bitwise, against those of the VAE the whole model's load returned (the path before)
    old_vae = whole_model_load(folder, "cpu", "float32")[1]
    cfg = recipe_config(corpus, tmp_path, f"tts.path={folder}")
    for m in (corpus["train"], corpus["dev"]):
        old_manifest = m.replace(".jsonl", "_old.jsonl")
        shutil.copy(m, old_manifest)

        def old_path():
            torch.set_num_threads(1)
            return old_vae, lambda vae, wave: vt.encode_latents(vae, wave, 2)

        tts_cache.prepare(old_manifest, ft.vae_spec(cfg), 2, old_path, encode_ref=preset == "tiny-v2", log=lambda _: 0)
        new, old = ft.read_latent_cache(cfg, m, 2), tts_cache.read_cache(old_manifest, ft.vae_spec(cfg), 2,
                                                                         encode_ref=preset == "tiny-v2")
        assert [(u.id, u.frames) for u in new] == [(u.id, u.frames) for u in old] and new
        for a, b in zip(new, old):
            assert np.load(a.latent_path).tobytes() == np.load(b.latent_path).tobytes(), a.id


@pytest.mark.parametrize("preset", ["tiny", "tiny-v2"])
def test_the_cache_follows_the_vaes_content_not_its_path(fresh_corpus, tmp_path, monkeypatch, preset):
    corpus, train = fresh_corpus, fresh_corpus["train"]
    random_init = recipe_config(corpus, tmp_path, f"tts.preset={preset}")
    assert ft.prepare_manifest(random_init, train)["encoded"] == FRESH
    # the folder that random init is exported to holds the same VAE: its latents are reused
    folder = model_folder(random_init, tmp_path / "base")
    assert ft.prepare_manifest(recipe_config(corpus, tmp_path, f"tts.path={folder}"), train)["encoded"] == 0
    # copied elsewhere (another path, a new modification time): reused, and read by the recipe
    moved = str(tmp_path / "elsewhere" / "base")
    shutil.copytree(folder, moved, copy_function=shutil.copy)
    cfg = recipe_config(corpus, tmp_path, f"tts.path={moved}")
    again = ft.prepare_manifest(cfg, train)
    assert (again["encoded"], again["reused"]) == (0, FRESH)
    ft._VAE_DIGESTS.clear()  # a later run reads the weights' hash from the cache's record, not the file
    monkeypatch.setattr(vt, "vae_digest", lambda vae: pytest.fail("the VAE was hashed again"))
    assert len(ft.read_latent_cache(cfg, train, 2)) == FRESH
    monkeypatch.undo()
    # other VAE weights: the reader refuses the cache naming the hash, prepare encodes it again
    vae_file = os.path.join(moved, "audiovae.safetensors")
    state = load_file(vae_file)
    name = sorted(state)[0]
    state[name] = state[name] + 0.01
    save_file(state, vae_file)
    st = os.stat(vae_file)
    os.utime(vae_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a rewrite as a later run sees it
    with pytest.raises(DataError, match=r"another VAE or patch size: vae\.sha256: [0-9a-f]{64} \(this run: "):
        ft.read_latent_cache(cfg, train, 2)
    assert ft.prepare_manifest(cfg, train)["encoded"] == FRESH
    # a cache of the first format (keyed on the VAE file's path, size and time) is taken over unencoded
    meta_file = os.path.join(tts_cache.cache_dir(train), "meta.json")
    legacy = {"format": tts_cache.LEGACY_FORMAT, "vae": ft.vae_source(cfg), "patch_size": 2,
              **({"ref_audio": "encoded"} if preset == "tiny-v2" else {})}
    open(meta_file, "w").write(json.dumps(legacy))
    ft._VAE_DIGESTS.clear()
    with pytest.raises(DataError, match="another format"):
        ft.read_latent_cache(cfg, train, 2)
    assert ft.prepare_manifest(cfg, train)["encoded"] == 0
    assert json.load(open(meta_file))["format"] == tts_cache.CACHE_FORMAT
    assert len(ft.read_latent_cache(cfg, train, 2)) == FRESH


def test_prepare_names_unreadable_audio(fresh_corpus, tmp_path):
    corpus = fresh_corpus
    root = os.path.dirname(corpus["train"])
    with open(os.path.join(root, "audio", "broken.ogg"), "wb") as f:
        f.write(b"OggS" + os.urandom(300))
    lines = open(corpus["train"]).read().splitlines()
    lines.insert(2, json.dumps({"audio_filepath": "audio/broken.ogg", "duration": 2.0, "text": "a broken file.", "id": "broken"}))
    lines.append(json.dumps({"audio_filepath": "audio/missing.ogg", "duration": 1.0, "text": "no file.", "id": "missing"}))
    bad = os.path.join(root, "bad.jsonl")
    open(bad, "w").write("\n".join(lines) + "\n")
    cfg = recipe_config(corpus, tmp_path)
    with pytest.raises(DataError) as e:
        ft.prepare_manifest(cfg, bad)
    msg = str(e.value)
    assert f"{bad}:3 (id broken)" in msg and "broken.ogg" in msg
    assert f"{bad}:{FRESH + 2} (id missing)" in msg and "missing.ogg" in msg  # the last line
    report = ft.prepare_manifest(recipe_config(corpus, tmp_path, "data.bad_data=skip"), bad)
    assert (report["encoded"], report["skipped"]) == (FRESH, 2)
    assert len(tts_cache.read_cache(bad, ft.vae_spec(cfg), 2)) == FRESH


def test_upstream_voxcpm_jsonl_is_read_unchanged(fresh_corpus, tmp_path):
    """upstream's {"audio", "text", "ref_audio", "dataset_id"} without durations: the cache is
    built from it (durations from the headers) and ref_audio / dataset_id reach the cached utterances."""
    root = os.path.dirname(fresh_corpus["train"])
    rows = [json.loads(x) for x in open(fresh_corpus["train"])]
    upstream = [{"audio": r["audio_filepath"], "text": r["text"], "dataset_id": k % 2,
                 **({"ref_audio": rows[0]["audio_filepath"]} if k else {})} for k, r in enumerate(rows)]
    path = os.path.join(root, "upstream.jsonl")
    open(path, "w").writelines(json.dumps(r) + "\n" for r in upstream)
    cfg = recipe_config(fresh_corpus, tmp_path)
    assert ft.prepare_manifest(cfg, path)["encoded"] == FRESH
    utts = tts_cache.read_cache(path, ft.vae_spec(cfg), 2)
    ref = os.path.join(root, rows[0]["audio_filepath"])
    assert [(u.text, u.ref_audio, u.dataset_id) for u in utts] == [
        (r["text"], ref if k else None, k % 2) for k, r in enumerate(rows)]
    assert [u.id for u in utts] == [f"{path}:{k + 1}" for k in range(FRESH)]
    again = ft.prepare_manifest(cfg, path)  # durations from the header cache, latents reused
    assert (again["encoded"], again["written"]) == (0, False)


# ------------------------------------------------------------------------------ batches and the loss


def test_batches_equal_the_upstream_packer(corpus, tmp_path):
    cfg = recipe_config(corpus, tmp_path, "data.pad_to_multiple=1")
    info = ddptrain.setup_distributed(cfg)
    b, objective, train, _, _ = ft.build(cfg, info)
    batch = next(iter(train))
    by_id = {e.id: e for e in ddptrain.data.load_manifest(corpus["train"])}
    packer = vt.upstream_packer_class()(dataset_cnt=1, max_len=b.layout.max_length, patch_size=b.layout.patch_size,
                                        feat_dim=b.layout.feat_dim, audio_vae=b.vae)
    waves = [ddptrain.data.load_audio(by_id[i].audio_filepath, 16000) for i in batch["ids"]]
    n = max(len(w) for w in waves)
    texts = [b.tokenizer(by_id[i].text) for i in batch["ids"]]
    m = max(len(t) for t in texts)
    ref = packer(audio_tokens=torch.stack([torch.nn.functional.pad(w, (0, n - len(w)), value=-100) for w in waves]),
                 text_tokens=torch.tensor([t + [-100] * (m - len(t)) for t in texts], dtype=torch.int32),
                 task_ids=torch.ones(len(waves), dtype=torch.long), dataset_ids=torch.zeros(len(waves), dtype=torch.long),
                 is_prompts=[False] * len(waves))
    assert len(batch["ids"]) >= 2
    for key in ("text_tokens", "text_mask", "audio_mask", "loss_mask", "labels"):
        assert torch.equal(batch[key], ref[key].to(torch.int32)), key
    torch.testing.assert_close(batch["audio_feats"], ref["audio_feats"], rtol=1e-5, atol=1e-6)  # same VAE, same audio
    assert batch["frames"] == int(ref["loss_mask"].sum()) * b.layout.patch_size
    # the loss: upstream's diff + stop (a mean over frames / patches) times the loss-masked frames
    b.model.train()
    torch.manual_seed(5)
    loss_sum, units = objective(b.model, batch)
    torch.manual_seed(5)
    out = b.model(batch["text_tokens"], batch["text_mask"], batch["audio_feats"], batch["audio_mask"],
                  batch["loss_mask"], batch["position_ids"], batch["labels"])
    assert units == batch["frames"]
    torch.testing.assert_close(loss_sum / units, out["loss/diff"] + out["loss/stop"])


def test_batches_of_one_padded_shape_share_one_cuda_graph_key():
    # compile.cuda_graphs keys host numbers by value: frames and patches (the loss's units) are
    # tensors, or every batch of a bucket would capture a graph of its own and none would replay
    from ddptrain.cuda_graphs import batch_key

    collate = ft.TTSCollator(2, pad_multiple=32)
    a = collate([{"id": "a", "text_ids": list(range(200, 210)), "latents": torch.randn(40, 8)},
                 {"id": "b", "text_ids": list(range(200, 212)), "latents": torch.randn(30, 8)}])
    b = collate([{"id": "c", "text_ids": list(range(200, 205)), "latents": torch.randn(20, 8)},
                 {"id": "d", "text_ids": list(range(200, 206)), "latents": torch.randn(24, 8)}])
    assert a["text_mask"].shape == b["text_mask"].shape and int(a["frames"]) != int(b["frames"])
    assert batch_key(a) == batch_key(b)
    assert int(a["frames"]) == int(a["loss_mask"].sum()) * 2 and int(a["patches"]) == int(a["loss_mask"].sum())


def test_loss_falls_and_samples_are_written(corpus, tmp_path):
    cfg = ["trainer.max_steps=16", "trainer.eval_every=16", "tts.num_samples=1", "tts.sample_timesteps=2",
           "tts.sample_max_ratio=0.5",
           "logging.tensorboard=true", "logging.log_every=4"]
    test = copy_split(str(tmp_path / "data"), "test", 2)  # the config's test set kept: issue 49 item 15
    summary = ft.main(["--config", os.path.join(ROOT, "configs", "tts_dialect.yaml"),
                       *recipe_config_args(corpus, tmp_path), *cfg, f"tts.test_manifests=[{test}]"])
    report = json.load(open(f"{tmp_path}/run/report.json"))  # written at the very end: the run ran to it
    assert set(report["test"]) == {test} and set(report["test"][test]) == {"loss", "diff", "stop"}
    losses = [r["loss"] for r in logged(f"{tmp_path}/run")]
    assert losses[-1] < 0.6 * losses[0], losses
    assert set(summary["eval"]) == {"loss", "diff", "stop"}
    assert summary["eval"]["loss"] == pytest.approx(summary["eval"]["diff"] + summary["eval"]["stop"], rel=1e-6)
    wavs = glob.glob(f"{tmp_path}/run/samples/step_0000016/*.wav")
    assert len(wavs) == 1 and __import__("soundfile").info(wavs[0]).samplerate == 16000
    from tensorboard.backend.event_processing.event_accumulator import AUDIO, EventAccumulator

    tags = EventAccumulator(f"{tmp_path}/run/tensorboard", size_guidance={AUDIO: 0}).Reload().Tags()["audio"]
    assert any(t.startswith("samples/") for t in tags) and any(t.startswith("reference/") for t in tags)


def recipe_config_args(corpus, tmp_path):
    return [f"data.train_manifest={corpus['train']}", f"data.eval_manifest={corpus['dev']}", "tts.test_manifests=[]",
            f"trainer.output_dir={tmp_path}/run", "trainer.device=cpu", "data.max_duration=9", "data.num_buckets=2",
            "logging.progress_bar=false", "scheduler.warmup_steps=0", "optim.lr=3e-3", "checkpoint.every_steps=0"]


def test_resume_equals_uninterrupted(corpus, tmp_path):
    base = ["logging.tensorboard=false", "logging.log_every=1", "trainer.eval_every=0", "tts.num_samples=0",
            "data.eval_manifest=''", "trainer.max_steps=6", "checkpoint.keep_last=0"]
    args = lambda out: ["--config", os.path.join(ROOT, "configs", "tts_dialect.yaml"),  # noqa: E731
                        *recipe_config_args(corpus, tmp_path), *base, f"trainer.output_dir={out}"]
    ft.main(args(f"{tmp_path}/whole"))
    ft.main(args(f"{tmp_path}/parts") + ["trainer.max_steps=4", "scheduler.decay_steps=6"])  # stops at step 4 (saved)
    ft.main(args(f"{tmp_path}/parts") + ["checkpoint.resume=auto", "scheduler.decay_steps=6"])
    whole = {r["step"]: r["loss"] for r in logged(f"{tmp_path}/whole")}
    parts = {r["step"]: r["loss"] for r in logged(f"{tmp_path}/parts")}
    assert [whole[s] for s in (5, 6)] == [parts[s] for s in (5, 6)]  # bitwise: data order, noise, t, CFG drops
    from safetensors.torch import load_file

    a = load_file(f"{tmp_path}/whole/checkpoints/step_00000006/model.safetensors")
    c = load_file(f"{tmp_path}/parts/checkpoints/step_00000006/model.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)


def test_lora_adapts_the_named_layers_and_recompute_changes_nothing(corpus, tmp_path):
    lora = recipe_config(corpus, tmp_path, "lora.enabled=true", "lora.rank=4", "lora.alpha=8",
                         f"lora.targets={json.dumps(ft_lora_targets())}", "trainer.max_steps=1")
    info = ddptrain.setup_distributed(lora)
    b, objective, train, _, _ = ft.build(lora, info)
    trainer = ft.TTSTrainer(b.model, objective, lora, train)
    trainable = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainer.adapted) == 4 * (2 + 1 + 2)  # q/k/v/o of 2 base-LM, 1 residual-LM and 2 DiT layers
    trainer.fit()
    trainer.close()
    # recompute of the MiniCPM layers: the same loss and gradients
    grads = []
    for on in (False, True):
        cfg = recipe_config(corpus, tmp_path / str(on), f"recompute.enabled={str(on).lower()}",
                            "recompute.module_classes=[MiniCPMDecoderLayer]")
        b, objective, train, _, _ = ft.build(cfg, info)
        t = ft.TTSTrainer(b.model, objective, cfg, train)
        assert len(t.recomputed) == (2 + 1 + 1 + 2 if on else 0)
        batch = next(iter(train))
        torch.manual_seed(3)
        loss, _ = objective(t.model, batch)
        loss.backward()
        grads.append([p.grad.clone() for p in t.module.parameters()])
        t.close()
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1)


def ft_lora_targets():
    return yaml_list(os.path.join(ROOT, "configs", "tts_voxcpm15_lora.yaml"), "lora", "targets")


def yaml_list(path, section, key):
    from omegaconf import OmegaConf

    return list(OmegaConf.load(path)[section][key])


def test_prepare_command_fills_the_cache_the_recipe_reads(corpus, tmp_path, capsys):
    import prepare_tts  # the command imports the recipe, the recipe only the cache: no cycle

    cfg = recipe_config(corpus, tmp_path)
    assert prepare_tts.main(["--config", os.path.join(ROOT, "configs", "tts_dialect.yaml"), corpus["train"],
                             "data.num_workers=0"]) == 0
    assert len(tts_cache.read_cache(corpus["train"], ft.vae_spec(cfg), 2)) == 6


def test_loader_refuses_sequences_longer_than_the_model(corpus, tmp_path):
    cfg = recipe_config(corpus, tmp_path)
    info = ddptrain.setup_distributed(cfg)
    b = ft.build_model(cfg, info)
    ft.prepare_manifest(cfg, corpus["train"], b.vae)
    utts = tts_cache.read_cache(corpus["train"], ft.vae_spec(cfg), 2)
    b.layout.max_length = 40
    with pytest.raises(DataError, match=r"train.jsonl:\d+ \(id dialect-train-\d+\): \d+ positions"):
        ft.build_loader(utts, cfg, b.tokenizer, b.layout, True, 1, 0)


@pytest.mark.timeout(120)
def test_bench_dry_run(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_voxcpm

    out = tmp_path / "rows.jsonl"
    assert bench_voxcpm.main(["--dry", "--inline", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in open(out)]
    assert [r["peer"] for r in rows] == ["upstream", "ddptrain", "ddptrain_best"]
    for r in rows:
        assert "voxcpm" in r["workload"] and r["audio_s_per_s"] > 0 and r["samples_per_s"] > 0 and r["steps"] == 2
        assert 0 <= r["padding_fraction"] < 1 and np.isfinite(r["loss"]) and r["mfu"] > 0
    assert rows[1]["prepare_s"] > 0 and "compile.enabled=true" in rows[2]["ov"]
