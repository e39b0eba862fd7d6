"""trainer.cuda_alloc_conf: PyTorch's CUDA allocator settings, applied only where the user set none."""

import os

import ddptrain
from ddptrain import dist


def test_sets_the_allocator_conf_when_unset(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    dist.configure_allocator("expandable_segments:True")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_keeps_the_users_settings(monkeypatch):
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        monkeypatch.setenv(var, "max_split_size_mb:256")
        dist.configure_allocator("expandable_segments:True")
        assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") in (None, "max_split_size_mb:256")
        assert os.environ[var] == "max_split_size_mb:256"


def test_empty_leaves_pytorchs_defaults(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    dist.configure_allocator("")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_config_default_and_override():
    assert ddptrain.Config().trainer.cuda_alloc_conf == "expandable_segments:True"
    cfg = ddptrain.load_config(None, ["trainer.cuda_alloc_conf=''"])
    assert cfg.trainer.cuda_alloc_conf == ""
