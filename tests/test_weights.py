"""ddptrain/weights.py: weights files written and read whole (loadable without ddptrain; mismatches
refused with a diff unless not strict; corrupt files named), and streamed: a model built on the
meta device and filled tensor by tensor from local safetensors (one file, or Hugging Face shards)
equals ``load_state_dict``; peak host memory stays near one bf16 copy (measured in a subprocess:
its VmHWM), where the usual fp32 build + ``load_file`` needs several; bad files and mismatches are
named; a checkpoint's file is checked against its SHA256SUMS by every reader."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddptrain import checkpoint as ckpt
from ddptrain import weights
from ddptrain.checkpoint import CheckpointError
from ddptrain.weights import SafetensorsSource, empty_weights, load_pretrained, write_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(nn.Module):
    """Tied embedding/head, a BatchNorm (stays fp32), a non-persistent buffer, an int buffer."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.norm = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, tok):
        h = self.body(self.emb(tok) + self.table.sum())
        return self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))


# ----------------------------------------------------------------------------- whole files


class Tied(nn.Module):
    def __init__(self, vocab=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.out = nn.Linear(4, vocab)
        self.out.weight = self.emb.weight  # tied weights must still save and load


def test_weights_load_without_ddptrain(tmp_path):
    model = Tied()
    weights.save_weights(model, str(tmp_path / "m.safetensors"))
    fresh = Tied()
    fresh.load_state_dict(load_file(str(tmp_path / "m.safetensors")))  # plain safetensors + torch
    assert torch.equal(fresh.emb.weight, model.emb.weight)


def test_mismatch_is_refused_with_a_diff_unless_not_strict(tmp_path):
    weights.save_weights(Tied(vocab=10), str(tmp_path / "m.safetensors"))
    with pytest.raises(ckpt.CheckpointError) as err:
        weights.load_weights(Tied(vocab=12), str(tmp_path / "m.safetensors"))
    msg = str(err.value)
    assert "shape mismatch" in msg and "emb.weight: checkpoint (10, 4) vs model (12, 4)" in msg
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ckpt.CheckpointError, match="(?s)missing in checkpoint.*unexpected in checkpoint"):
        weights.load_weights(model, str(tmp_path / "m.safetensors"))
    # strict=False: a new output vocabulary keeps the fitting tensors and skips the others
    class Bigger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 12)

    source = Tied(vocab=10)
    weights.save_weights(source, str(tmp_path / "m.safetensors"))
    partial = Bigger()
    report = weights.load_weights(partial, str(tmp_path / "m.safetensors"), strict=False)
    assert report["loaded"] == 1 and torch.equal(partial.emb.weight, source.emb.weight)
    assert sorted(m.split(":")[0] for m in report["mismatched"]) == ["out.bias", "out.weight"]


def test_corrupt_weights_file_is_named(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ckpt.CheckpointError, match="cannot read weights.*m.safetensors"):
        weights.load_weights(Tied(), str(path))


# ----------------------------------------------------------------------------- streamed, tensor by tensor


def _saved(tmp_path, dtype=torch.float32):
    torch.manual_seed(0)
    ref = Net()
    ref.norm.running_mean.uniform_()
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ref.state_dict().items()}
    state["head.weight"] = state["head.weight"].clone()  # tied tensors are stored twice, as save_weights does
    path = str(tmp_path / "model.safetensors")
    save_file(state, path)
    return ref, path


def test_meta_model_filled_in_bf16_equals_load_state_dict_and_keeps_ties(tmp_path):
    ref, path = _saved(tmp_path)
    with empty_weights():
        model = Net()
    assert all(p.is_meta for p in model.parameters()) and not model.table.is_meta
    report = load_pretrained(model, path, dtype=torch.bfloat16)
    assert report["missing"] == [] and report["unexpected"] == []
    assert model.head.weight is model.emb.weight  # still tied: one tensor, loaded once
    assert model.body[0].weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.float32
    assert model.norm.num_batches_tracked.dtype == torch.int64
    for k, v in ref.state_dict().items():
        got = model.state_dict()[k]
        want = v.to(torch.bfloat16) if v.is_floating_point() and not k.startswith("norm.") else v
        assert torch.equal(got, want), k
    assert isinstance(model.body[0].weight, nn.Parameter) and model.body[0].weight.requires_grad


def test_existing_storage_is_filled_in_place_and_hf_shards_load(tmp_path):
    ref, path = _saved(tmp_path)
    with SafetensorsSource(path) as src:
        files = write_shards(((k, src.get(k)) for k in src.keys()), str(tmp_path / "hf"), max_shard_bytes=3000)
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    assert len(files) > 3 and set(index["weight_map"]) == set(load_file(path))
    model = Net().to(torch.float64)
    weight = model.body[0].weight
    load_pretrained(model, str(tmp_path / "hf"))
    assert model.body[0].weight is weight and weight.dtype == torch.float64  # in place, own dtype
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v.to(model.state_dict()[k].dtype), msg=k)


def test_mismatches_are_named(tmp_path):
    _, path = _saved(tmp_path)
    with empty_weights():
        model = Net(vocab=51)
    with pytest.raises(CheckpointError, match=r"emb.weight has shape \(50, 16\), the model's has \(51, 16\)"):
        load_pretrained(model, path)

    class Extra(Net):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)

    with empty_weights():
        model = Extra()
    with pytest.raises(CheckpointError, match=r"missing in the file \(2\): extra.bias, extra.weight"):
        load_pretrained(model, path)
    with pytest.raises(CheckpointError, match="still on the meta device.*extra"):
        load_pretrained(model, path, strict=False)
    report = load_pretrained(Net(), path, rename=lambda k: None if k.startswith("body.0.") else k, strict=False)
    assert report["missing"] == ["body.0.bias", "body.0.weight"] and report["unexpected"] == []
    model = Net()
    with pytest.raises(CheckpointError, match=r"not in the model \(2\): body.0.bias, body.0.weight"):
        load_pretrained(model, path, rename=lambda k: k.replace("body.0.", "gone."), skip=["body.0.weight",
                                                                                             "body.0.bias"])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="cannot read weights .*bad.safetensors"):
        load_pretrained(Net(), str(bad))


_MEASURE = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from safetensors.torch import load_file
    from ddptrain.weights import empty_weights, load_pretrained
    path, mode = sys.argv[1], sys.argv[2]
    def build():
        return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(12)])
    def status(key):  # kB; VmHWM is this process's own peak (getrusage's survives fork and exec)
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) * 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the current RSS
    except OSError:
        pass
    before = status("VmRSS")
    if mode == "ddptrain":
        with empty_weights():
            model = build()
        load_pretrained(model, path, dtype=torch.bfloat16)
    else:  # the usual way: build in fp32, read the whole file, cast
        model = build()
        model.load_state_dict(load_file(path))
        model = model.to(torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    print(status("VmHWM") - before)
""")


@pytest.mark.timeout(120)
def test_peak_host_memory_stays_near_one_bf16_copy(tmp_path):
    """50M parameters stored in bf16: building on the meta device and loading raises peak RSS by
    about the bf16 weights (100 MB); the fp32 build + load_file + cast needs well over twice that."""
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(12)])
    path = str(tmp_path / "w.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, path)
    bf16 = sum(p.numel() for p in model.parameters()) * 2
    del model
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    peak = {mode: int(subprocess.run([sys.executable, "-c", _MEASURE, path, mode], env=env, check=True,
                                     capture_output=True, text=True).stdout.split()[-1])
            for mode in ("ddptrain", "usual")}
    mib = {k: f"{v / 2**20:.0f} MiB" for k, v in peak.items()}
    assert peak["ddptrain"] < 1.1 * bf16 + (16 << 20), f"{mib} for {bf16 / 2**20:.0f} MiB of bf16 weights"
    assert peak["usual"] > 2.5 * bf16, f"the usual path peaked at only {mib}"


def test_every_reader_checks_a_checkpoints_file_against_its_checksums(tmp_path):
    """load_weights checked SHA256SUMS; the streamed readers (load_pretrained, the export) read a
    checkpoint's damaged file without a word."""
    ref, _ = _saved(tmp_path)
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    weights.save_weights(ref, str(step / "model.safetensors"))
    sums = ckpt.sha256_files([str(step / "model.safetensors")])
    (step / ckpt.CHECKSUMS).write_text("".join(f"{d}  {os.path.basename(p)}\n" for p, d in sums.items()))
    (step / ckpt.COMPLETE).write_text("ok\n")
    with open(step / "model.safetensors", "r+b") as f:  # the last byte: tensor data, the header still valid
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    damaged = r"step_00000002 is damaged: model.safetensors.*changed after it was saved"
    for read in (lambda: load_pretrained(Net(), str(step)), lambda: load_pretrained(Net(), str(tmp_path / "run")),
                 lambda: weights.export_merged(str(step), str(tmp_path / "out")),
                 lambda: weights.load_weights(Net(), str(step))):
        with pytest.raises(CheckpointError, match=damaged):
            read()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_written_weights_files_follow_the_umask_like_any_new_file(tmp_path, mask):
    """safetensors' writer leaves its files 0600 (a private temporary file renamed into place):
    a checkpoint or an export then could not be read by the group the run folder is shared with."""
    from test_lora import _base_file, _run  # a LoRA run with checkpoints, as test_lora.py makes them

    old = os.umask(mask)
    try:
        base = _base_file(tmp_path)
        _run(tmp_path / "run", base, 2)
        run = str(tmp_path / "run")
        written = [base, os.path.join(run, "checkpoints", "step_00000002", "model.safetensors"),
                   *weights.export_merged(run, str(tmp_path / "shards"), max_shard_gb=1e-6),
                   *weights.export_merged(run, str(tmp_path / "merged")),
                   weights.export_adapters(run, str(tmp_path / "adapters"))]
        with open(tmp_path / "plain.txt", "w"):  # what any new file gets under this umask
            pass
    finally:
        os.umask(old)
    want = os.stat(tmp_path / "plain.txt").st_mode & 0o777
    assert want == 0o666 & ~mask and len(written) > 5
    assert {f: oct(os.stat(f).st_mode & 0o777) for f in written} == {f: oct(want) for f in written}


def test_exports_never_overwrite_a_checkpoint_and_refuse_a_non_empty_folder_unless_forced(tmp_path, capsys):
    """issue 49 item 7: `python -m ddptrain.weights export CKPT CKPT` replaced the checkpoint's
    weights (the next resume called it damaged); an export into a folder that held files left its
    old config.json and shards beside the new weights."""
    from test_lora import _base_file, _run  # a LoRA run with trainable-only checkpoints

    base = _base_file(tmp_path)
    _run(tmp_path / "run", base, 2)
    step = str(tmp_path / "run" / "checkpoints" / "step_00000002")
    before = sorted(os.listdir(step)), open(os.path.join(step, "model.safetensors"), "rb").read()
    note = tmp_path / "note.txt"
    note.write_text("a file")
    for argv, why in ((["export", step, step], "is inside the checkpoint"),
                      (["export", step, os.path.join(step, "sub")], "is inside the checkpoint"),
                      (["adapters", step, step, "--name", "model.safetensors", "--force"], "is inside the checkpoint"),
                      (["export", step, str(tmp_path)], "holds .*base.safetensors, which this export reads"),
                      (["export", step, base], "holds .*base.safetensors, which this export reads"),
                      (["export", step, str(note)], "is a file, not a folder")):
        with pytest.raises(SystemExit) as e:
            weights.main(argv)
        assert e.value.code == 2 and re.search(why, capsys.readouterr().err), argv
    assert (sorted(os.listdir(step)), open(os.path.join(step, "model.safetensors"), "rb").read()) == before
    assert not ckpt.damage(step)

    out = tmp_path / "out"
    assert weights.main(["export", step, str(out), "--max-shard-gb", "1e-6"]) == 0  # several shards + index
    (out / "config.json").write_text('{"another": "model"}')
    with pytest.raises(SystemExit):
        weights.main(["export", step, str(out)])
    assert "is not empty (config.json, model-00001-of" in capsys.readouterr().err
    assert weights.main(["export", step, str(out), "--force"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # no stale shard, index or config.json beside it
    (out / "sub").mkdir()
    with pytest.raises(SystemExit):
        weights.main(["export", step, str(out), "--force"])
    assert "holds folders (sub)" in capsys.readouterr().err

    adapters = tmp_path / "adapters"
    assert weights.main(["adapters", step, str(adapters)]) == 0
    with pytest.raises(SystemExit):
        weights.main(["adapters", step, str(adapters)])
    assert "adapters.safetensors exists: pass --force" in capsys.readouterr().err
    assert weights.main(["adapters", step, str(adapters), "--force"]) == 0
