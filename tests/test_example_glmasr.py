"""examples/finetune_glmasr.py on a tiny random GlmAsr saved to a folder and loaded back offline.

The folder holds what a user downloads: config.json, safetensors weights and a tokenizer (a
byte-level BPE trained here, with the released model's special tokens). Checked: the training
forward equals the HF forward at the target positions, the placeholders and features equal what
``GlmAsrProcessor`` makes, the loss covers transcript + EOS only, the loss falls, a resumed run
equals an uninterrupted one, WER/CER come out of greedy generation (batched = one at a time, 2
ranks = 1 rank), long audio is split or refused by manifest line, recompute and the frozen
encoder behave. transformers is a dev dependency (setup.py), so all of this runs in CI.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import finetune_glmasr as fg  # noqa: E402
from _dist import run_ranks  # noqa: E402
from transformers import AutoTokenizer, GlmAsrForConditionalGeneration, GlmAsrProcessor, WhisperFeatureExtractor  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain.data import DataError, write_synthetic_corpus  # noqa: E402
from models.glmasr import GlmAsrForTraining, tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tests/conftest.py: tiny steps, shared cores

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|begin_of_audio|>", "<|end_of_audio|>"]


def make_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts) + ["Please transcribe this audio into text"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A model folder (tiny random GlmAsr + tokenizer) and manifests of synthetic speech."""
    root = tmp_path_factory.mktemp("glmasr")
    train = write_synthetic_corpus(str(root / "data"), [1.1, 1.6, 0.9, 1.3], seed=1)
    long = write_synthetic_corpus(str(root / "long"), [1.0, 31.5], seed=2)
    texts = [json.loads(line)["text"] for m in (train, long) for line in open(m)]
    tok = make_tokenizer(texts)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), tok.convert_tokens_to_ids("<|pad|>"), tok.eos_token_id)
    model = GlmAsrForConditionalGeneration(cfg)
    folder = root / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"root": root, "model": str(folder), "train": train, "long": long}


def recipe_config(assets, tmp_path, *overrides):
    return ddptrain.load_config(os.path.join(ROOT, "configs", "glmasr.yaml"), [
        f"glmasr.path={assets['model']}", f"data.train_manifest={assets['train']}", f"trainer.output_dir={tmp_path}/run",
        "trainer.precision=fp32", "trainer.param_dtype=fp32", "trainer.device=cpu", "compile.enabled=false",
        "data.num_workers=0", "data.max_duration=60", "data.max_batch_size=2", "data.num_buckets=1",
        "logging.tensorboard=false", "logging.progress_bar=false", "logging.log_every=1",
        "scheduler.name=constant", "scheduler.warmup_steps=0", "optim.lr=3e-3", "trainer.eval_every=0", "checkpoint.keep_last=0",
        "glmasr.max_new_tokens=24", *overrides], schema=fg.RecipeConfig)


def built(assets, tmp_path, *overrides):
    cfg = recipe_config(assets, tmp_path, *overrides)
    info = ddptrain.setup_distributed(cfg)
    return (cfg, *fg.build(cfg, info))


def first_batch(loader):
    return next(iter(loader))


def hf_logits(hf, batch):
    """The HF model's own forward on the same batch (padding mask, input_features_mask)."""
    ids = batch["input_ids"]
    attn = (torch.arange(ids.shape[1])[None, :] < torch.tensor(
        [int(p) + n for p, n in zip(batch["prompt_lens"], target_counts(batch))])[:, None]).long()
    feats = batch["features"]
    mask = (torch.arange(feats.shape[1])[None, :] < batch["chunk_frames"][:, None]).long()
    return hf(input_ids=ids, input_features=feats.transpose(1, 2), input_features_mask=mask,
              attention_mask=attn).logits


def target_counts(batch):
    rows = batch["pred_index"] // batch["input_ids"].shape[1]
    return torch.bincount(rows, minlength=batch["input_ids"].shape[0]).tolist()


@pytest.mark.parametrize("encoder_length", ["window", "batch"])
def test_training_forward_equals_the_hf_forward_at_the_targets(assets, tmp_path, encoder_length):
    cfg, model, objective, train, _, tok = built(assets, tmp_path, f"glmasr.encoder_length={encoder_length}",
                                                 "data.max_batch_size=4", f"data.train_manifest={assets['long']}", "data.max_duration=200")
    batch = first_batch(train)
    assert len(batch["ids"]) == 2 and batch["chunk_frames"].numel() == 3  # 31.5 s: two chunks
    t = batch["features"].shape[1]
    assert t == 3000 if encoder_length == "window" else (t % 8 == 0 and t == 3000)  # a full chunk is in it
    model.eval()
    ours = model(batch["input_ids"], batch["features"], batch["audio_src"], batch["audio_dst"], batch["pred_index"])
    ref = hf_logits(model.hf, batch).flatten(0, 1)[batch["pred_index"]]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # the labels are the transcript + EOS, each the token after its predicting position
    assert torch.equal(batch["labels"], batch["input_ids"].flatten()[batch["pred_index"] + 1])
    ends = [int(batch["prompt_lens"][i]) + n - 1 for i, n in enumerate(target_counts(batch))]
    assert [int(batch["input_ids"][i, e]) for i, e in enumerate(ends)] == [tok.eos_token_id] * 2


def test_cut_windows_equal_the_hf_forward_on_short_audio(assets, tmp_path):
    cfg, model, objective, train, _, tok = built(assets, tmp_path, "glmasr.encoder_length=batch")
    batch = first_batch(train)
    t = batch["features"].shape[1]
    assert t % 8 == 0 and t < 3000 and t >= int(batch["chunk_frames"].max())
    model.eval()
    ours = model(batch["input_ids"], batch["features"], batch["audio_src"], batch["audio_dst"], batch["pred_index"])
    torch.testing.assert_close(ours, hf_logits(model.hf, batch).flatten(0, 1)[batch["pred_index"]],
                               atol=1e-4, rtol=1e-4)


def test_placeholders_and_features_equal_the_glmasr_processor(assets, tmp_path):
    cfg, model, objective, train, _, tok = built(assets, tmp_path, "data.max_batch_size=4",
                                                 f"data.train_manifest={assets['long']}", "data.shuffle=false", "data.max_duration=200")
    batch = first_batch(train)
    from ddptrain.data import load_audio, load_manifest

    by_id = {e.id: e for e in load_manifest(assets["long"])}
    waves = [load_audio(by_id[i].audio_filepath, 16000).numpy() for i in batch["ids"]]
    proc = GlmAsrProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tok)
    ref = proc(text=["<|pad|>"] * len(waves), audio=waves, sampling_rate=16000)
    counts = (batch["input_ids"] == model.config.audio_token_id).sum(1)
    assert counts.tolist() == (ref["input_ids"] == model.config.audio_token_id).sum(1).tolist()
    torch.testing.assert_close(batch["features"], ref["input_features"].transpose(1, 2), atol=2e-4, rtol=1e-4)
    assert batch["chunk_frames"].tolist() == ref["input_features_mask"].sum(1).tolist()


def test_loss_is_summed_over_transcript_and_eos_tokens_only(assets, tmp_path):
    cfg, model, objective, train, _, tok = built(assets, tmp_path)
    batch = first_batch(train)
    loss, units = objective(model, batch)
    expect = sum(len(tok.encode(t, add_special_tokens=False)) + 1 for t in batch["texts"])
    assert units == expect
    logits = model(batch["input_ids"], batch["features"], batch["audio_src"], batch["audio_dst"], batch["pred_index"])
    mean = torch.nn.functional.cross_entropy(logits, batch["labels"])
    torch.testing.assert_close(loss / units, mean)


def read_losses(run):
    return [r["loss"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r.get("split") == "train"]


def train_run(assets, tmp_path, out, steps, *overrides, before=None):
    cfg, model, objective, train, evals, _ = built(assets, tmp_path, f"trainer.output_dir={out}",
                                                   f"trainer.max_steps={steps}", *overrides)
    trainer = ddptrain.Trainer(model, objective, cfg, train, eval_data=evals, metrics_fn=objective.error_counts)
    if before is not None:
        before.update(trainer.evaluate())
    result = trainer.fit()
    return trainer, result


@pytest.mark.timeout(240)
def test_loss_falls_and_wer_comes_out_of_generation(assets, tmp_path):
    start: dict = {}
    trainer, result = train_run(assets, tmp_path, tmp_path / "a", 30, "glmasr.encoder_length=batch",
                                f"data.eval_manifest={assets['train']}", before=start)
    losses = read_losses(tmp_path / "a")
    assert losses[-1] < 0.3 * losses[0], losses
    assert set(result) >= {"loss", "wer", "cer"}
    assert result["loss"] < 0.3 * start["loss"]
    # the transcripts moved towards the references (the random model's are garbage) ...
    assert result["cer"] < 0.9 < start["cer"], (start, result)
    # ... and WER/CER are the error counts of decoded transcripts: recompute them by hand
    objective = trainer.loss_fn
    hyps, refs = [], []
    for batch in trainer.eval_data:
        hyps += objective.transcripts(trainer.module, batch)
        refs += batch["texts"]
    words, chars = ddptrain.metrics.word_errors(refs, hyps), ddptrain.metrics.char_errors(refs, hyps)
    assert result["wer"] == pytest.approx(words[0] / words[1])
    assert result["cer"] == pytest.approx(chars[0] / chars[1])


@pytest.mark.timeout(120)
def test_resumed_run_equals_uninterrupted(assets, tmp_path):
    # 2 batches per epoch: the checkpoint at step 3 is mid-epoch (sampler position and RNG resume)
    kw = ("checkpoint.every_steps=3", "glmasr.encoder_length=batch")
    ref, _ = train_run(assets, tmp_path, tmp_path / "full", 5, *kw)
    train_run(assets, tmp_path, tmp_path / "part", 3, *kw)
    resumed, _ = train_run(assets, tmp_path, tmp_path / "part", 5, *kw, "checkpoint.resume=auto")
    assert resumed.step == 5
    assert read_losses(tmp_path / "part")[-2:] == read_losses(tmp_path / "full")[-2:]
    for (name, a), (_, b) in zip(ref.module.state_dict().items(), resumed.module.state_dict().items()):
        assert torch.equal(a, b), name


def test_batched_generation_equals_one_at_a_time(assets, tmp_path):
    cfg, model, objective, train, _, tok = built(assets, tmp_path, "data.max_batch_size=4", "glmasr.encoder_length=batch",
                                                 f"data.train_manifest={assets['long']}", "data.max_duration=200")
    model.eval()
    batch = first_batch(train)
    both = model.transcribe(batch, batch["features"], 12, objective.layout.eos_ids, objective.layout.pad_id)
    single = []
    for ex in (train.dataset[i] for i in range(len(train.dataset))):
        b = train.collate_fn([ex])
        single.append((ex["id"], model.transcribe(b, b["features"], 12, objective.layout.eos_ids,
                                                  objective.layout.pad_id)[0]))
    single = dict(single)
    assert both == [single[i] for i in batch["ids"]]
    assert all(len(x) > 0 for x in both)


def _eval_ranks(rank, world_size, assets, tmp, out):
    cfg, model, objective, train, evals, _ = built(assets, tmp, f"trainer.output_dir={tmp}/r{world_size}",
                                                   f"data.eval_manifest={assets['train']}", "data.max_batch_size=1")
    trainer = ddptrain.Trainer(model, objective, cfg, train, eval_data=evals, metrics_fn=objective.error_counts)
    result = trainer.evaluate()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"result": result, "batches": len(evals)}, f)


@pytest.mark.timeout(180)
def test_two_rank_generation_eval_equals_one_rank(assets, tmp_path):
    _eval_ranks(0, 1, assets, str(tmp_path), str(tmp_path / "one.json"))
    run_ranks(_eval_ranks, 2, assets, str(tmp_path), str(tmp_path / "two.json"), timeout=150)
    one, two = (json.load(open(tmp_path / f)) for f in ("one.json", "two.json"))
    assert two["batches"] == 2 and one["batches"] == 4  # each rank decoded its own half
    for k in ("loss", "wer", "cer"):
        assert two["result"][k] == pytest.approx(one["result"][k], rel=1e-5), k


def test_long_audio_refused_with_the_manifest_line(assets, tmp_path):
    with pytest.raises(DataError, match=r"manifest.jsonl:2.*longer than the 30 s window"):
        built(assets, tmp_path, "glmasr.long_audio=refuse", f"data.train_manifest={assets['long']}", "data.max_duration=200")


def test_gpu_feature_path_gives_the_worker_loss(assets, tmp_path):
    _, model, obj_w, train_w, _, _ = built(assets, tmp_path, "data.shuffle=false")
    _, _, obj_g, train_g, _, _ = built(assets, tmp_path, "data.shuffle=false", "data.feature_device=gpu")
    bw, bg = first_batch(train_w), first_batch(train_g)
    assert "features" not in bg and bg["num_frames"] == 3000
    lw, nw = obj_w(model, bw)
    lg, ng = obj_g(model, bg)
    assert nw == ng
    torch.testing.assert_close(lg, lw, atol=1e-4, rtol=1e-5)


def test_eval_features_are_not_spec_augmented_with_gpu_features(assets, tmp_path):
    """feature_device=gpu: the objective computes features with the training loader's extractor;
    they follow the model's mode (before, evaluation and generation saw SpecAugment masks)."""
    aug = ("data.shuffle=false", "data.spec_augment=true", "data.time_mask_ratio=0.5", "data.freq_mask_width=60",
           f"data.eval_manifest={assets['train']}")
    _, model, obj_w, _, evals_w, _ = built(assets, tmp_path, *aug)
    _, _, obj_g, _, evals_g, _ = built(assets, tmp_path, *aug, "data.feature_device=gpu")
    bw, bg = first_batch(evals_w), first_batch(evals_g)
    model.eval()
    with torch.no_grad():
        lw, _ = obj_w(model, bw)  # worker features of an evaluation loader: never masked
        lg, _ = obj_g(model, bg)
    torch.testing.assert_close(lg, lw, atol=1e-4, rtol=1e-5)
    masked = obj_g.features(model.train(), bg)
    assert not torch.equal(masked, obj_g.features(model.eval(), bg)), "training lost SpecAugment"


def test_recompute_gives_the_same_gradients_and_frozen_encoder_stays_fixed(assets, tmp_path):
    from ddptrain.config import RecomputeConfig
    from ddptrain.recompute import apply_recompute

    cfg, model, objective, train, _, _ = built(assets, tmp_path)
    batch = first_batch(train)

    def grads(m):
        m.zero_grad()
        objective(m, batch)[0].backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = grads(model)
    names = apply_recompute(model, RecomputeConfig(enabled=True, module_classes=["GlmAsrEncoderLayer",
                                                                                  "LlamaDecoderLayer"]))
    assert len(names) == 4
    again = grads(model)
    assert plain.keys() == again.keys()
    for n in plain:
        torch.testing.assert_close(again[n], plain[n], atol=1e-6, rtol=1e-5)

    _, frozen, obj, train_f, _, _ = built(assets, tmp_path, "glmasr.freeze_encoder=true")
    trainer = ddptrain.Trainer(frozen, obj, recipe_config(assets, tmp_path, "glmasr.freeze_encoder=true",
                                                          "trainer.max_steps=1", f"trainer.output_dir={tmp_path}/f"),
                               train_f)
    before = {n: p.detach().clone() for n, p in frozen.named_parameters()}
    trainer.fit()
    after = dict(frozen.named_parameters())
    enc = [n for n in before if ".audio_tower." in n]
    assert enc and all(torch.equal(before[n], after[n]) for n in enc)
    assert not torch.equal(before["hf.model.multi_modal_projector.linear_1.weight"],
                           after["hf.model.multi_modal_projector.linear_1.weight"])


@pytest.mark.parametrize("features", ["worker", "gpu"])
def test_padded_indices_give_the_unpadded_loss_units_and_gradients(assets, tmp_path, features):
    kw = ("data.shuffle=false", "glmasr.encoder_length=batch", f"data.feature_device={features}")
    _, model, obj_a, train_a, _, _ = built(assets, tmp_path, *kw, "glmasr.pad_indices=off")
    _, _, obj_b, train_b, _, _ = built(assets, tmp_path, *kw, "glmasr.pad_indices=on", "glmasr.target_pad_multiple=16")
    a, b = first_batch(train_a), first_batch(train_b)
    assert a["ids"] == b["ids"]
    bsz, length = b["input_ids"].shape
    rows = (b["features"] if features == "worker" else b["audio"]).shape[0]
    t = b["features"].shape[1] if features == "worker" else b["num_frames"]
    # the index lists' lengths follow the tensor shapes: one audio entry per embedding of the rows
    assert b["audio_src"].numel() == b["audio_dst"].numel() == rows * t // 8 > a["audio_src"].numel()
    assert b["labels"].numel() % 16 == 0 and b["labels"].numel() > a["labels"].numel()
    assert (b["audio_dst"] == bsz * length).sum() == b["audio_dst"].numel() - a["audio_dst"].numel()
    assert (b["labels"] == -100).sum() == b["labels"].numel() - a["labels"].numel()
    if features == "gpu":
        assert b["audio"].shape[1] == t * 160 and torch.equal(b["audio_lens"], a["audio_lens"])

    def run(obj, batch):
        model.zero_grad()
        loss, units = obj(model, batch)
        loss.backward()
        return loss.detach(), units, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    la, ua, ga = run(obj_a, a)
    lb, ub, gb = run(obj_b, b)
    assert int(ua) == int(ub) == a["labels"].numel()
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-6, rtol=1e-4)


def test_padded_batches_of_one_shape_share_one_cuda_graph_key():
    # compile.cuda_graphs keys a batch by its tensors' shapes: unpadded, the audio and target index
    # lists are as long as each batch's own audio and transcripts, so no two batches would share one
    from ddptrain.cuda_graphs import batch_key

    layout = fg.PromptLayout((10, 11), (12,), 50, 2, 2, (2,))

    def batch(collate, seconds, tokens):
        return collate([{"id": f"u{i}", "text": "x", "audio": torch.randn(int(s * 16000)),
                         "tokens": torch.arange(3, 3 + k)} for i, (s, k) in enumerate(zip(seconds, tokens))])

    for multiple, same in ((0, False), (32, True)):
        collate = fg.GlmAsrCollator(layout, None, "batch", 64, frame_pad_multiple=400, target_pad_multiple=multiple)
        a, b = batch(collate, (3.1, 2.2), (9, 5)), batch(collate, (3.6, 2.9), (12, 10))
        assert a["input_ids"].shape == b["input_ids"].shape and a["num_frames"] == b["num_frames"]
        assert (a["audio_src"].shape == b["audio_src"].shape) == same
        assert (batch_key(a) == batch_key(b)) == same, multiple


@pytest.mark.timeout(120)
def test_cuda_graphs_replay_padded_batches_with_the_eager_losses(assets, tmp_path):
    # on the CPU compile.cuda_graphs runs its bookkeeping on the key's buffers (backend "rerun"):
    # glmasr.pad_indices=auto pads with it on, so the repeated shapes replay, and losses are eager's
    kw = ("glmasr.encoder_length=batch", "glmasr.frame_pad_multiple=400", "data.shuffle=false")
    train_run(assets, tmp_path, tmp_path / "eager", 6, *kw, "glmasr.pad_indices=on")
    trainer, _ = train_run(assets, tmp_path, tmp_path / "graphs", 6, *kw, "compile.cuda_graphs=true")
    graphs = trainer.graphs  # one shape (4 s of frames, 64 positions): one graph, all but the first replay it
    assert len(graphs.graphs) == 1 and graphs.replayed == graphs.total - 1 == 5 and not graphs.eager_only
    assert read_losses(tmp_path / "graphs") == pytest.approx(read_losses(tmp_path / "eager"), rel=1e-6)


def test_training_forward_prepares_no_hf_mask(assets, tmp_path, monkeypatch):
    # HF's mask preparation (create_causal_mask) checks position_ids for packed sequences with a
    # device-to-host copy on every call: a sync per step, and a capture compile.cuda_graphs cannot make
    import transformers.masking_utils as masking

    _, model, objective, train, _, _ = built(assets, tmp_path)
    batch = first_batch(train)

    def refused(*args, **kwargs):
        raise AssertionError("the training forward called create_causal_mask")

    import transformers.models.llama.modeling_llama as llama

    monkeypatch.setattr(masking, "create_causal_mask", refused)
    monkeypatch.setattr(llama, "create_causal_mask", refused)  # the name the Llama decoder imported
    loss, units = objective(model, batch)
    loss.backward()
    assert int(units) > 0 and torch.isfinite(loss)
