"""examples/finetune_tts.py on 2 gloo ranks, and LoRA runs that save and resume adapters only.

The tiny random-init VoxCPM on a few utterances of the shipped dialect corpus (copied to a
temporary folder; the latent caches are prepared once, in the test process). Checked:

* 2 ranks (the recipe's ``main`` in each spawned process, under a timeout; an error on one rank
  ends both): the loss falls, the ranks' batches of an epoch are disjoint and cover the epoch,
  every rank takes the same number of steps and ends with the same weights, a checkpoint is one
  folder with one weights file (per-rank state files for both ranks), rank 0 alone logs, and a
  run stopped mid-epoch and resumed on 2 ranks equals the uninterrupted one (losses, weights);
* LoRA with ``checkpoint.trainable_only``: the weights file holds the adapters only; stopped
  mid-run and resumed, the run equals the uninterrupted one (losses and adapters), with the
  frozen base rebuilt from its source: random init (same seed) or a VoxCPM checkpoint folder
  (``tts.path``), whose base + adapters ``ddptrain.load_weights`` composes again; a resume onto
  other frozen weights is refused, not silently run.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_tts as ft  # noqa: E402
import tts_cache  # noqa: E402

import ddptrain  # noqa: E402
from _dist import run_ranks  # noqa: E402
from _tts_data import copy_split  # noqa: E402
from models import voxcpm_tts as vt  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "tts_dialect.yaml")
LORA_TARGETS = ('["base_lm.layers.*.self_attn.[qkvo]_proj",'
                '"feat_decoder.estimator.decoder.layers.*.self_attn.[qkvo]_proj"]')


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned ranks inherit it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_args(train: str, out: str, *extra) -> list[str]:
    return ["--config", CONFIG, f"data.train_manifest={train}", "data.eval_manifest=''", "tts.test_manifests=[]",
            f"trainer.output_dir={out}", "trainer.device=cpu", "data.max_duration=9", "data.num_buckets=2",
            "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_every=1", "trainer.eval_every=0",
            "tts.num_samples=0", "checkpoint.every_steps=0", "checkpoint.keep_last=0", "scheduler.warmup_steps=0",
            "optim.lr=3e-3", *extra]


def logged_losses(run_dir) -> dict:
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if '"split": "train"' in x]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step logged twice (more than one rank logging?): {steps}"
    return {r["step"]: r["loss"] for r in rows}


def weights(run_dir, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(run_dir, "checkpoints", f"step_{step:08d}", "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


# ------------------------------------------------------------------------------ 2 ranks

STEPS, STOP = 6, 3  # the uninterrupted run; the interrupted one stops (and saves) at STOP, mid-epoch


def _two_rank_worker(rank: int, world: int, train: str, tmp: str) -> None:
    import ddptrain.dist

    # the three launches below share one process group (the test helper ends it): keep main's teardown off
    ddptrain.dist.teardown = lambda: None
    built, seen = {}, []
    build, call = ft.build, ft.TTSObjective.__call__

    def recording_build(cfg, info):
        out = build(cfg, info)
        built.update(model=out[0].model, sampler=out[2].batch_sampler, batches=len(out[2]))
        return out

    def recording_call(self, model, batch):
        if model.training:
            seen.append([built["sampler"].epoch, batch["ids"]])
        return call(self, model, batch)

    ft.build, ft.TTSObjective.__call__ = recording_build, recording_call
    runs = [("whole", [f"trainer.max_steps={STEPS}"]),
            ("first", [f"trainer.max_steps={STOP}", f"scheduler.decay_steps={STEPS}"]),
            ("resumed", [f"trainer.max_steps={STEPS}", "checkpoint.resume=auto", f"scheduler.decay_steps={STEPS}"])]
    for name, extra in runs:
        seen.clear()
        ft.main(run_args(train, os.path.join(tmp, "whole" if name == "whole" else "parts"), *extra))
        digest = float(sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(built["model"].parameters())))
        with open(os.path.join(tmp, f"{name}_rank{rank}.json"), "w") as f:
            json.dump({"seen": seen, "batches_per_epoch": built["batches"], "digest": digest}, f)


@pytest.mark.timeout(240)
def test_two_ranks_train_on_disjoint_data_and_resume_exactly(tmp_path):
    train = copy_split(str(tmp_path / "data"), "train", 14)
    ft.prepare_manifest(ddptrain.load_config(CONFIG, run_args(train, "x")[2:], schema=ft.RecipeConfig), train)
    run_ranks(_two_rank_worker, 2, train, str(tmp_path), timeout=200)
    res = {(name, r): json.load(open(tmp_path / f"{name}_rank{r}.json"))
           for name in ("whole", "first", "resumed") for r in range(2)}
    whole = [res["whole", r] for r in range(2)]
    # equal steps: every rank ran STEPS optimizer steps (one micro-batch each), and its loader has
    # as many batches per epoch as the other's
    assert [len(w["seen"]) for w in whole] == [STEPS, STEPS]
    per_epoch = whole[0]["batches_per_epoch"]
    assert whole[1]["batches_per_epoch"] == per_epoch and per_epoch < STEPS, "the run crosses an epoch"
    assert STOP < per_epoch, "the interrupted run stops mid-epoch"
    # disjoint data: within an epoch no utterance reaches both ranks; the first epoch covers all
    for epoch in (0, 1):
        ids = [{u for e, b in w["seen"] if e == epoch for u in b} for w in whole]
        assert not ids[0] & ids[1], f"epoch {epoch}: utterances on both ranks: {ids[0] & ids[1]}"
        if epoch == 0:
            assert len(ids[0] | ids[1]) == 14 and sum(len(b) for w in whole for e, b in w["seen"] if e == 0) == 14
    assert whole[0]["digest"] == whole[1]["digest"], "the ranks ended with different weights"
    # the resumed run took up where the first stopped: the same batches, rank by rank
    for r in range(2):
        assert res["first", r]["seen"] + res["resumed", r]["seen"] == whole[r]["seen"], f"rank {r}'s batches"
    # one checkpoint folder per save, one weights file, both ranks' own states
    ckpts = sorted(os.listdir(tmp_path / "whole" / "checkpoints"))
    assert ckpts == [f"step_{STEPS:08d}"], ckpts
    files = set(os.listdir(tmp_path / "whole" / "checkpoints" / ckpts[0]))
    assert {"model.safetensors", "trainer.pt", "COMPLETE", "rng_rank0.pt", "rng_rank1.pt", "sampler_rank0.pt",
            "sampler_rank1.pt"} <= files and not any("rank2" in f or f.startswith(".tmp") for f in files), files
    assert sorted(os.listdir(tmp_path / "parts" / "checkpoints")) == [f"step_{STOP:08d}", f"step_{STEPS:08d}"]
    # it trains; the resumed run equals the uninterrupted one
    a, b = logged_losses(tmp_path / "whole"), logged_losses(tmp_path / "parts")
    assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == list(range(1, STEPS + 1))
    assert a[STEPS] < 0.8 * a[1], a
    assert [b[s] for s in range(1, STEPS + 1)] == pytest.approx([a[s] for s in range(1, STEPS + 1)], rel=1e-5)
    assert_same_weights(weights(tmp_path / "whole", STEPS), weights(tmp_path / "parts", STEPS))
    assert res["resumed", 0]["digest"] == pytest.approx(whole[0]["digest"], rel=1e-6)


# ------------------------------------------------------------------------------ LoRA, trainable-only checkpoints

LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", f"lora.targets={LORA_TARGETS}",
        "checkpoint.trainable_only=true"]


def lora_runs(train: str, tmp, steps: int, stop: int, *extra) -> tuple[str, str]:
    """An uninterrupted LoRA run of ``steps`` and one stopped at ``stop`` then resumed: (whole, parts) dirs."""
    whole, parts = os.path.join(tmp, "whole"), os.path.join(tmp, "parts")
    ft.main(run_args(train, whole, *LORA, *extra, f"trainer.max_steps={steps}"))
    ft.main(run_args(train, parts, *LORA, *extra, f"trainer.max_steps={stop}", f"scheduler.decay_steps={steps}"))
    ft.main(run_args(train, parts, *LORA, *extra, f"trainer.max_steps={steps}", f"scheduler.decay_steps={steps}",
                     "checkpoint.resume=auto"))
    return whole, parts


def assert_adapters_resume_exactly(whole: str, parts: str, steps: int, stop: int) -> None:
    from ddptrain.weights import weights_info

    for run, step in ((whole, steps), (parts, stop), (parts, steps)):
        saved = weights(run, step)
        assert saved and all(k.endswith((".lora_A", ".lora_B")) for k in saved), sorted(saved)[:5]
        assert len(saved) == 2 * 4 * (2 + 2)  # A and B of q/k/v/o in 2 base-LM and 2 DiT layers
        assert weights_info(os.path.join(run, "checkpoints", f"step_{step:08d}"))["trainable_only"]
    assert any(bool(v.abs().sum()) for k, v in weights(parts, stop).items() if k.endswith("lora_B")), "B trained"
    a, b = logged_losses(whole), logged_losses(parts)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert [b[s] for s in sorted(b)] == [a[s] for s in sorted(a)]  # bitwise
    w, p = weights(whole, steps), weights(parts, steps)
    assert w.keys() == p.keys() and all(torch.equal(w[k], p[k]) for k in w)


def test_lora_random_init_saves_adapters_only_and_resumes_exactly(tmp_path):
    train = copy_split(str(tmp_path / "data"), "train", 6)
    base = [f"checkpoint.base_model={tmp_path}/random-init"]  # no base file: the frozen weights are the seed's
    whole, parts = lora_runs(train, tmp_path, 4, 2, *base)
    assert_adapters_resume_exactly(whole, parts, 4, 2)
    # a resume onto other frozen weights (another seed) is refused, not trained on
    with pytest.raises(ddptrain.CheckpointError, match="frozen weights differ"):
        ft.main(run_args(train, parts, *LORA, *base, "trainer.max_steps=5", "checkpoint.resume=auto",
                         "trainer.seed=1"))


def test_lora_on_a_checkpoint_folder_rebuilds_the_base_from_it(tmp_path):
    train = copy_split(str(tmp_path / "data"), "train", 6)
    cfg = ddptrain.load_config(CONFIG, run_args(train, str(tmp_path / "x"))[2:], schema=ft.RecipeConfig)
    b = ft.build_model(cfg, ddptrain.setup_distributed(cfg))
    folder = str(tmp_path / "VoxCPM-tiny")
    vt.save_pretrained(b.model, b.vae, b.tokenizer.hf, folder)
    whole, parts = lora_runs(train, tmp_path, 4, 2, f"tts.path={folder}",
                             f"checkpoint.base_model={folder}/model.safetensors")
    assert_adapters_resume_exactly(whole, parts, 4, 2)
    # base (from the folder the header names) + adapters compose into the trained model again
    from ddptrain.weights import weights_info

    ckpt = os.path.join(parts, "checkpoints", "step_00000004")
    assert weights_info(ckpt)["base_model"] == os.path.abspath(f"{folder}/model.safetensors")
    torch.manual_seed(7)  # a plain model with other weights: load_weights brings the base and adds the adapters
    model = vt.build_model(b.layout, b.tokenizer.hf, b.vae, "cpu")
    ddptrain.load_weights(model, ckpt)
    from safetensors.torch import load_file

    state, adapters, base = model.state_dict(), weights(whole, 4), load_file(f"{folder}/model.safetensors")
    assert set(state) == set(base) | set(adapters)
    assert all(torch.equal(state[k], v) for k, v in {**base, **adapters}.items())


# ------------------------------------------------------------------------------ bad data


def test_bad_data_is_named_by_manifest_line_and_skipped_on_request(tmp_path):
    """Bad lines and unreadable audio (prepare_tts) and utterances the model or the batch budget
    cannot take (build_loader) go through ddptrain.data.validate's report: every one named as
    ``file:line (id ...)``, all listed under ``data.bad_data=error``, left out under ``skip``."""
    train = copy_split(str(tmp_path / "data"), "train", 4)
    lines = open(train).read().splitlines()
    first = json.loads(lines[0])
    lines += ["{not json", lines[0],  # lines 5 and 6: malformed, a duplicate id
              json.dumps({**first, "audio_filepath": "audio/gone.ogg", "id": "gone"}),  # 7: no audio file
              json.dumps({**first, "text": "x" * 600, "id": "long"})]  # 8: text longer than the model takes
    open(train, "w").write("\n".join(lines) + "\n")
    cfg = lambda *o: ddptrain.load_config(CONFIG, run_args(train, str(tmp_path / "run"), *o)[2:],  # noqa: E731
                                          schema=ft.RecipeConfig)
    with pytest.raises(ddptrain.data.DataError) as e:
        ft.prepare_manifest(cfg(), train)
    msg = str(e.value)
    assert f"{train}:5: bad line" in msg and f"{train}:6 (id {first['id']}): duplicate id" in msg
    assert not os.path.exists(tts_cache.cache_dir(train)), "bad lines stop the run before any encoding"
    fixed = _without(train, 5, 6)  # the bad lines gone: "gone" is line 5 now
    with pytest.raises(ddptrain.data.DataError, match=rf"{fixed}:5 \(id gone\): missing audio file: .*gone.ogg"):
        ft.prepare_manifest(cfg(), fixed)
    report = ft.prepare_manifest(cfg("data.bad_data=skip"), train)
    assert (report["encoded"], report["skipped"]) == (5, 3)
    b = ft.build_model(cfg(), ddptrain.setup_distributed(cfg()))
    utts = tts_cache.read_cache(train, ft.vae_spec(cfg()), b.layout.patch_size)
    assert sorted(u.line for u in utts) == [1, 2, 3, 4, 8]
    with pytest.raises(ddptrain.data.DataError) as e:
        ft.build_loader(utts, cfg("tts.max_text_tokens=56", "data.max_duration=4.1"), b.tokenizer, b.layout, True, 1, 0)
    msg = str(e.value)
    assert f"{train}:8 (id long): " in msg and "exceed the model's max_length" in msg
    assert "tts.max_text_tokens=56" in msg
    assert f"{train}:2 (id " in msg and "max_duration=4.1s" in msg  # the longest of the four: 4.32 s
    assert f"{train}:3 (id " in msg and "57 text tokens" in msg and f"{train}:1 (id " not in msg
    loader = ft.build_loader(utts, cfg("data.bad_data=skip"), b.tokenizer, b.layout, True, 1, 0)
    assert sorted(u.line for u in loader.dataset.utts) == [1, 2, 3, 4]


def _without(manifest: str, *numbers: int) -> str:
    """A copy of ``manifest`` without the given (1-based) lines, next to it."""
    out = manifest.replace(".jsonl", "_fixed.jsonl")
    with open(out, "w") as f:
        f.writelines(x for i, x in enumerate(open(manifest), 1) if i not in numbers)
    return out
