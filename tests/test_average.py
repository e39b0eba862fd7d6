"""ddptrain/average.py: the last N and the best N checkpoints (min and max metrics) averaged into one
file equal to the hand average; sharded-master (2 ranks), trainable-only LoRA and EMA checkpoints;
checkpoints of different models refused naming the file and tensor; the streamed writer."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ddptrain
from _dist import run_ranks
from ddptrain import average, weights
from ddptrain import checkpoint as ckpt
from ddptrain.average import main
from test_trainer import FEAT, FrameMLP, frame_loss, make_cfg, micro_batches

STEPS = 5


def _score(model, batch):
    """A metric the run maximises (any number that moves will do): the mean prediction."""
    pred = model(batch["x"]).float()
    return {"score": (float(pred.sum()), pred.numel())}


def _run(out, *extra, model=None, steps=STEPS):
    torch.manual_seed(0)
    data = [b for mb in micro_batches(steps) for b in mb][:steps]
    cfg = make_cfg(out, f"trainer.max_steps={steps}", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
                   "trainer.eval_every=1", *extra)
    trainer = ddptrain.Trainer(model or FrameMLP(), frame_loss, cfg, data, eval_data=data[:2], metrics_fn=_score)
    trainer.fit()
    return trainer


def _hand_average(files, dtype=None, ema=None):
    tensors = [load_file(f) for f in files]
    out = {}
    for k, first in tensors[0].items():
        parts = [(e[k] if e and k in e else t[k]) for t, e in zip(tensors, ema or [None] * len(files))]
        total = parts[0].float().clone()
        for p in parts[1:]:
            total += p.float()
        out[k] = (total / len(parts)).to(dtype or first.dtype)
    return out


def _steps(run):
    return [p for _, p in ckpt.list_complete(str(run / "checkpoints"))]


def test_the_last_n_average_is_the_hand_average(tmp_path, capsys):
    _run(tmp_path / "run")
    assert main([str(tmp_path / "run"), "--last", "3", "-o", str(tmp_path / "avg.safetensors")]) == 0
    report = json.loads(capsys.readouterr().out)
    last3 = _steps(tmp_path / "run")[-3:]
    assert report["averaged"] == last3 and report["weights"] == "model"
    got, want = load_file(str(tmp_path / "avg.safetensors")), _hand_average([f"{p}/model.safetensors" for p in last3])
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    mean = torch.stack([load_file(f"{p}/model.safetensors")["net.0.weight"] for p in last3]).mean(0)
    torch.testing.assert_close(got["net.0.weight"], mean)
    assert not torch.equal(got["net.0.weight"], load_file(f"{last3[-1]}/model.safetensors")["net.0.weight"])
    # loadable as weights, naming what it averaged
    model = FrameMLP()
    ddptrain.load_weights(model, str(tmp_path / "avg.safetensors"))
    assert json.loads(weights.read_header(str(tmp_path / "avg.safetensors"))[1]["ddptrain.averaged_from"]) == \
        [os.path.abspath(f"{p}/model.safetensors") for p in last3]


def test_the_best_n_are_picked_by_the_logged_metric_in_min_and_max_mode(tmp_path):
    _run(tmp_path / "run")
    scored = [(ckpt.read_meta(p)["metrics"], p) for p in _steps(tmp_path / "run")]
    assert all("loss" in m and "score" in m for m, _ in scored) and len(scored) == STEPS
    lowest = sorted(scored, key=lambda s: s[0]["loss"])[:2]
    highest = sorted(scored, key=lambda s: -s[0]["score"])[:2]
    picked = average.select(str(tmp_path / "run"), best=2)  # the run's checkpoint.best_metric=loss, min
    assert [p for p, _ in picked] == sorted(p for _, p in lowest)
    assert [v for _, v in picked] == [m["loss"] for m, _ in sorted(lowest, key=lambda s: s[1])]
    picked = average.select(str(tmp_path / "run"), best=2, metric="score", mode="max")
    assert [p for p, _ in picked] == sorted(p for _, p in highest)
    assert {p for p, _ in picked} != {p for _, p in lowest}  # the two rankings differ here
    assert main([str(tmp_path / "run"), "--best", "2", "--metric", "score", "--mode", "max", "-o",
                 str(tmp_path / "best.safetensors")]) == 0
    want = _hand_average([f"{p}/model.safetensors" for p, _ in picked])
    got = load_file(str(tmp_path / "best.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in want.items())


def _sharded_worker(rank, world, out):
    torch.manual_seed(0)
    data = [mb[rank] for mb in micro_batches(3)]
    cfg = make_cfg(os.path.join(out, "zero"), "trainer.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
                   "optim.zero=true", "trainer.precision=bf16", "trainer.param_dtype=bf16", "ema.enabled=true",
                   "ema.decay=0.5")
    ddptrain.Trainer(FrameMLP(), frame_loss, cfg, data).fit()


@pytest.mark.timeout(180)
def test_sharded_master_checkpoints_average_their_weights_and_their_ema_shards(tmp_path):
    """Two ranks with sharded masters: model.safetensors holds the bf16 weights (the average is
    bf16, summed in fp32), and each rank's ema_rank{r}.pt its shard of the EMA (gathered here)."""
    run_ranks(_sharded_worker, 2, str(tmp_path))
    last2 = _steps(tmp_path / "zero")[-2:]
    files = [f"{p}/model.safetensors" for p in last2]
    out = average.average(last2, str(tmp_path / "avg.safetensors"), weights="model")
    assert out["weights"] == "model"
    got, want = load_file(str(tmp_path / "avg.safetensors")), _hand_average(files)
    assert all(v.dtype == torch.bfloat16 and torch.equal(got[k], v) for k, v in want.items())
    emas = []
    for p in last2:
        shards = [torch.load(f"{p}/ema_rank{r}.pt", weights_only=False)["tensors"] for r in range(2)]
        emas.append({**shards[0], **shards[1]})
    assert average.average(last2, str(tmp_path / "ema.safetensors"))["weights"] == "ema"  # auto: as evaluated
    got, want = load_file(str(tmp_path / "ema.safetensors")), _hand_average(files, ema=emas)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert not all(torch.equal(got[k], load_file(files[-1])[k]) for k in want)


def test_trainable_only_lora_checkpoints_average_into_a_trainable_only_file(tmp_path):
    from test_lora import _base_file, _run as lora_run, Tiny

    base = _base_file(tmp_path)
    lora_run(tmp_path / "run", base, 6)  # a checkpoint every 2 steps: 2, 4, 6
    steps = _steps(tmp_path / "run")
    assert main([str(tmp_path / "run"), "--last", "2", "-o", str(tmp_path / "avg.safetensors"), "--dtype", "bf16"]) == 0
    files = [f"{p}/model.safetensors" for p in steps[-2:]]
    got, want = load_file(str(tmp_path / "avg.safetensors")), _hand_average(files, dtype=torch.bfloat16)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], v) for k, v in want.items() if not k.endswith((".lora_A", ".lora_B")))
    # the adapters: stacked along the rank (the exact mean of B @ A; test_lora_average_is_the_mean_of_the_updates)
    layers = {k[: -len(".lora_A")] for k in want if k.endswith(".lora_A")}
    saved = [load_file(f) for f in files]
    for layer in layers:
        a, b = got[f"{layer}.lora_A"], got[f"{layer}.lora_B"]
        assert torch.equal(a, torch.cat([t[f"{layer}.lora_A"].float() for t in saved]).bfloat16())
        assert torch.equal(b, (torch.cat([t[f"{layer}.lora_B"].float() for t in saved], dim=1) / 2).bfloat16())
    info = weights.weights_info(str(tmp_path / "avg.safetensors"))
    assert info["trainable_only"] and info["base_model"] == os.path.abspath(base)
    assert info == {**weights.weights_info(files[0])}
    model = Tiny()
    ddptrain.load_weights(model, str(tmp_path / "avg.safetensors"))  # the base from its path, then the average
    assert all(torch.equal(model.state_dict()[k], v.float()) for k, v in got.items())
    weights.export_merged(str(tmp_path / "avg.safetensors"), str(tmp_path / "merged"))
    assert set(load_file(str(tmp_path / "merged" / "model.safetensors"))) == set(Tiny().state_dict())


class Wider(FrameMLP):
    def __init__(self):
        super().__init__()
        self.net[0] = nn.Linear(FEAT, 16, bias=False)


def test_checkpoints_of_different_models_and_bad_requests_are_refused(tmp_path):
    a = _run(tmp_path / "a", steps=2)
    _run(tmp_path / "b", model=Wider(), steps=2)
    one, other = _steps(tmp_path / "a")[-1], _steps(tmp_path / "b")[-1]
    out = str(tmp_path / "x.safetensors")
    with pytest.raises(ckpt.CheckpointError, match=rf"{other}/model.safetensors lacks tensors .*net.0.bias"):
        average.average([one, other], out)
    with pytest.raises(ckpt.CheckpointError, match="given twice"):
        average.average([one, one], out)
    with pytest.raises(ckpt.CheckpointError, match="fewer than --last 3"):
        average.select(str(tmp_path / "a"), last=3)
    with pytest.raises(ckpt.CheckpointError, match="hold metric 'wer'.*their metrics: loss, score"):
        average.select(str(tmp_path / "a"), best=1, metric="wer")
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        average.select(str(tmp_path / "nothing"), last=1)
    with pytest.raises(ckpt.CheckpointError, match="holds no EMA weights"):
        average.average([_steps(tmp_path / "a")[0], one], out, weights="ema")
    assert not os.path.exists(out)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a"), str(tmp_path / "b"), "--last", "2", "-o", out])
    assert a.step == 2


def test_a_shape_or_dtype_mismatch_names_the_file_and_the_tensor(tmp_path):
    torch.manual_seed(0)
    good = tmp_path / "good.safetensors"
    ddptrain.save_weights({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, str(good))
    for name, tensors, why in (("shape", {"w": torch.zeros(3, 2), "b": torch.zeros(3)}, r"tensor w is torch.float32 \(3, 2\)"),
                               ("dtype", {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(3)},
                                "tensor w is torch.bfloat16")):
        bad = tmp_path / f"{name}.safetensors"
        ddptrain.save_weights(tensors, str(bad))
        with pytest.raises(ckpt.CheckpointError, match=rf"{bad}: {why}"):
            average.average([str(good), str(bad)], str(tmp_path / "out.safetensors"))


def test_the_streamed_writer_writes_what_safetensors_reads_and_refuses_a_wrong_tensor(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "n": torch.tensor(7),
               "empty": torch.zeros(0, 2), "f16": torch.randn(2, 2).half()}
    path = str(tmp_path / "s.safetensors")
    weights.save_streamed(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], iter(tensors.values()),
                          {"note": "x"})
    got = load_file(path)
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert weights.read_header(path)[1]["note"] == "x" and weights.read_header(path)[2] % 8 == 0
    with pytest.raises(ckpt.CheckpointError, match="tensor a is torch.float32 \\(3, 4\\), its header says torch.float32 \\(4, 3\\)"):
        weights.save_streamed(str(tmp_path / "t.safetensors"), [("a", torch.float32, (4, 3))], [tensors["a"]])
    assert os.listdir(tmp_path) == ["s.safetensors"]  # nothing half-written left


def test_an_average_of_fewer_than_two_checkpoints_is_refused_not_copied(tmp_path, capsys):
    """issue 49 item 3: a run folder without --last/--best, --last 0 or 1, or one checkpoint
    wrote a copy of the newest checkpoint reported as averaged."""
    _run(tmp_path / "run", steps=3)
    out = str(tmp_path / "avg.safetensors")
    for argv, why in (([], "is a run folder.*--last N or --best N"), (["--last", "0"], "--last 0: averaging takes 2"),
                      (["--last", "1"], "--last 1: averaging takes 2"), (["--best", "1"], "--best 1: averaging takes 2")):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "run"), *argv, "-o", out])
        assert e.value.code == 2 and re.search(why, capsys.readouterr().err), argv
    with pytest.raises(SystemExit):
        main([str(tmp_path / "run" / "checkpoints"), "-o", out])  # the checkpoints folder: a run folder too
    assert "is a run folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([_steps(tmp_path / "run")[-1], "-o", out])
    assert "two or more checkpoint folders" in capsys.readouterr().err
    with pytest.raises(ckpt.CheckpointError, match="averaging needs two or more checkpoints"):
        average.average([_steps(tmp_path / "run")[-1]], out)
    assert not os.path.exists(out)
    assert main([*_steps(tmp_path / "run")[-2:], "-o", out]) == 0  # two checkpoint folders: averaged


def test_lora_average_is_the_mean_of_the_updates_not_of_a_and_b(tmp_path):
    """issue 49 item 3: mean(B) @ mean(A) is not mean(B @ A); the average's merged weights equal
    the mean of the checkpoints' merged weights, and load into a model without adapters."""
    from test_lora import _base_file, _run as lora_run, Tiny

    base = _base_file(tmp_path)
    lora_run(tmp_path / "run", base, 6)
    steps = _steps(tmp_path / "run")
    out = str(tmp_path / "avg.safetensors")
    report = average.average(steps, out, weights="model")
    merged = []
    for p in steps:
        model = Tiny()
        ddptrain.load_weights(model, p)
        merged.append(ddptrain.lora.merged_state_dict(model))
    want = {k: sum(m[k].float() for m in merged) / len(merged) for k in merged[0]}
    model = Tiny()
    ddptrain.load_weights(model, out)  # adapters of rank 3r added from the file
    got = ddptrain.lora.merged_state_dict(model)
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k].float(), v, rtol=0, atol=2e-6, msg=k)
    weights.export_merged(out, str(tmp_path / "merged"))
    exported = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert all(torch.allclose(exported[k].float(), v, atol=2e-6) for k, v in want.items())
    r = load_file(f"{steps[0]}/model.safetensors")["blocks.0.q_proj.lora_A"].shape[0]
    assert len(steps) == 3 and report["lora"]["rank"] == f"{r} -> {3 * r}"


def test_the_output_never_overwrites_a_checkpoint_an_input_or_a_file_without_force(tmp_path, capsys):
    """issue 49 item 7: -o inside a checkpoint replaced its weights (the next resume called it
    damaged); -o onto a file overwrote it silently; -o onto a folder was an IsADirectoryError."""
    _run(tmp_path / "run", steps=3)
    steps = _steps(tmp_path / "run")
    before = {p: open(f"{p}/model.safetensors", "rb").read() for p in steps}
    for out, why in ((f"{steps[-1]}/model.safetensors", "is inside the checkpoint"),
                     (f"{steps[0]}/avg.safetensors", "is inside the checkpoint"),
                     (str(tmp_path / "run"), "is a folder: name the .safetensors file")):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "run"), "--last", "2", "-o", out])
        assert e.value.code == 2 and why in capsys.readouterr().err, out
    plain = [str(tmp_path / f"w{i}.safetensors") for i in range(2)]  # weights files outside any checkpoint
    for p, f in zip(steps, plain):
        ddptrain.save_weights(load_file(f"{p}/model.safetensors"), f)
    with pytest.raises(ckpt.CheckpointError, match="is one of the files read"):
        average.average(plain, plain[1], force=True)
    assert {p: open(f"{p}/model.safetensors", "rb").read() for p in steps} == before
    assert sorted(os.listdir(steps[0])) == sorted(os.listdir(steps[1]))  # nothing written into a checkpoint
    assert ckpt.newest_intact(str(tmp_path / "run" / "checkpoints")) == steps[-1]
    out = tmp_path / "avg.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "run"), "--last", "2", "-o", str(out)])
    assert "exists: pass --force" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    assert main([str(tmp_path / "run"), "--last", "2", "-o", str(out), "--force"]) == 0
    assert set(load_file(str(out))) == set(load_file(f"{steps[-1]}/model.safetensors"))
