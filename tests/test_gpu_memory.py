"""trainer.gpu_memory_gb: the GiB cap of the CUDA caching allocator (ddptrain/dist.py), the rule
on CPU, and the CUDA call path with torch.cuda's functions replaced."""

from __future__ import annotations

import types

import pytest
import torch

import ddptrain
from ddptrain import dist
from ddptrain.config import ConfigError

GiB = 2**30


def test_the_fraction_is_gib_of_total_memory():
    assert dist.gpu_memory_fraction(24, 80 * GiB) == 0.3
    assert dist.gpu_memory_fraction(24, 24 * GiB) == 1.0
    assert isinstance(dist.gpu_memory_fraction(16, 141 * GiB), float)  # set_per_process_memory_fraction needs a float
    rtx4090 = 25_393_692_672  # a "24 GB" RTX 3090/4090: PyTorch's OOM messages say "23.65 GiB total capacity"
    with pytest.raises(ConfigError, match=r"trainer.gpu_memory_gb=24 is more than this GPU's 23.65 GiB.*at most 23.64"):
        dist.gpu_memory_fraction(24, rtx4090)
    assert dist.gpu_memory_fraction(23, rtx4090) == pytest.approx(23 * GiB / rtx4090)


def test_config_key_default_and_rule():
    assert ddptrain.Config().trainer.gpu_memory_gb == 0
    assert ddptrain.load_config(None, ["trainer.gpu_memory_gb=24"]).trainer.gpu_memory_gb == 24.0
    with pytest.raises(ConfigError, match="trainer.gpu_memory_gb"):
        ddptrain.load_config(None, ["trainer.gpu_memory_gb=-1"])


def _fake_cuda(monkeypatch, total=141 * GiB):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d=None: calls.append(("fraction", f, d)))
    return calls


def test_a_cpu_run_ignores_the_cap_with_a_note(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a: pytest.fail("capped a CPU run"))
    dist.cap_gpu_memory(24, torch.device("cpu"))
    assert capsys.readouterr().out.strip() == "note: trainer.gpu_memory_gb=24 ignored: this run is on cpu, not a GPU"
    dist.cap_gpu_memory(24, torch.device("cpu"), quiet=True)  # every rank but rank 0
    dist.cap_gpu_memory(0, torch.device("cpu"))
    assert capsys.readouterr().out == ""
    info = dist.setup_for(ddptrain.load_config(None, ["trainer.device=cpu", "trainer.gpu_memory_gb=24"]))
    assert info.device.type == "cpu" and "ignored" in capsys.readouterr().out


def test_the_cap_is_set_on_the_ranks_device(monkeypatch):
    calls = _fake_cuda(monkeypatch)
    dist.cap_gpu_memory(24, torch.device("cuda", 3))
    assert calls == [("fraction", 24 * GiB / (141 * GiB), torch.device("cuda", 3))]
    calls.clear()
    dist.cap_gpu_memory(0, torch.device("cuda", 3))  # no cap: nothing is called
    assert calls == []
    with pytest.raises(ConfigError, match="trainer.gpu_memory_gb=200"):
        dist.cap_gpu_memory(200, torch.device("cuda", 0))
    assert calls == []  # refused before anything is set


def test_setup_caps_after_choosing_the_device(monkeypatch):
    """The Trainer's first step (dist.setup_for) caps LOCAL_RANK's GPU, after set_device and
    before anything (the model) is put on it."""
    calls = _fake_cuda(monkeypatch, total=80 * GiB)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    cfg = ddptrain.load_config(None, ["trainer.device=cuda", "trainer.gpu_memory_gb=16", "trainer.cuda_alloc_conf=''"])
    info = dist.setup_for(cfg)
    assert info.device == torch.device("cuda", 1)
    assert calls == [("set_device", torch.device("cuda", 1)), ("fraction", 0.2, torch.device("cuda", 1))]
    cfg = ddptrain.load_config(None, ["trainer.device=cuda", "trainer.gpu_memory_gb=81", "trainer.cuda_alloc_conf=''"])
    with pytest.raises(ConfigError, match="trainer.gpu_memory_gb=81"):
        dist.setup_for(cfg)


def test_the_tuners_capacity_is_the_capped_memory(monkeypatch):
    from ddptrain.preflight import CudaMemory

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 0.3)
    assert CudaMemory(torch.device("cuda", 0)).capacity() == 24 * GiB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_gpu_runs_out_at_the_cap():
    dev = torch.device("cuda", 0)
    keep = []
    try:
        dist.cap_gpu_memory(2, dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        assert torch.cuda.get_per_process_memory_fraction(dev) == pytest.approx(2 * GiB / total)
        keep += [torch.empty(GiB // 2, dtype=torch.uint8, device=dev) for _ in range(3)]  # 1.5 GiB: fits
        with pytest.raises(torch.cuda.OutOfMemoryError):
            keep.append(torch.empty(GiB, dtype=torch.uint8, device=dev))  # 2.5 GiB: over the cap
    finally:
        keep.clear()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
