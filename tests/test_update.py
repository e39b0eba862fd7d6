"""The optimizer backends (ddptrain/update/) and choose(): one decision for the run, the load-time
check and the memory estimator, with each refusal naming its keys and the backend that serves."""

from __future__ import annotations

import pytest
import torch

import ddptrain
from ddptrain.config import ConfigError
from ddptrain.memory import estimate_model_state
from ddptrain.update.backend import BY_NAME, Backend, backend_class
from ddptrain.update.choose import choose
from test_trainer import FrameMLP, concat, frame_loss, make_cfg, micro_batches

BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16")


def _cfg(*extra):
    return ddptrain.load_config(None, list(extra))


@pytest.mark.parametrize("extra, world, backend", [
    ((), 1, "replicated"),
    (("optim.zero=true",), 2, "replicated"),
    (BF16, 1, "masters"),
    ((*BF16, "optim.zero=true"), 1, "masters"),  # one rank: nothing to shard
    (BF16, 2, "masters"),
    ((*BF16, "optim.zero=true"), 2, "sharded"),
    ((*BF16, "optim.zero=true", "optim.shard_grads=true"), 4, "sharded"),
    ((*BF16, "optim.offload=cpu"), 1, "host"),
    ((*BF16, "optim.offload=cpu", "optim.zero=true", "optim.shard_grads=true"), 2, "host"),
])
def test_choose_names_one_backend_per_set_up(extra, world, backend):
    choice = choose(_cfg(*extra), world, torch.device("cpu"))
    assert choice.backend == backend and issubclass(backend_class(choice), Backend)
    assert backend_class(choice) is BY_NAME[backend]


@pytest.mark.parametrize("extra, world, gpu, host", [
    ((), 1, 16, 0),
    (("optim.zero=true",), 4, 8 + 8 / 4, 0),
    (BF16, 1, 16, 0),
    ((*BF16, "optim.zero=true"), 4, 4 + 12 / 4, 0),
    ((*BF16, "optim.zero=true", "optim.shard_grads=true"), 4, 2 + 2 / 4 + 12 / 4, 0),
    ((*BF16, "optim.offload=cpu"), 1, 2, 4 + 8 + 2),  # one rank: each gradient leaves as it is made
    ((*BF16, "optim.offload=cpu", "trainer.grad_accum_steps=2"), 1, 4, 4 + 8 + 2),
    ((*BF16, "optim.offload=cpu", "optim.zero=true", "optim.shard_grads=true"), 4, 2 + 2 / 4, (4 + 8 + 2) / 4),
])
def test_bytes_per_param_are_the_design_tables_and_the_estimators(extra, world, gpu, host):
    """docs/design.md's tiers, from the backend, and the estimator's figures from the same rates."""
    cfg = _cfg(*extra)
    choice = choose(cfg, world, "cuda")
    got = backend_class(choice).bytes_per_param(choice)
    assert got == {"gpu": pytest.approx(gpu), "host": pytest.approx(host)}
    n = 4000 * world
    est = estimate_model_state(n, cfg, world, device="cuda")
    state = est["params"] + est["grads"] + est["masters"] + est["optimizer"]
    assert state == pytest.approx(gpu * n) and est["host_masters"] + est["host_optimizer"] + est["host_grads"] \
        == pytest.approx(host * n)


@pytest.mark.parametrize("extra, keys, backend", [
    (("trainer.param_dtype=bf16",), ("trainer.param_dtype", "trainer.precision"), "replicated"),
    (("optim.shard_grads=true",), ("optim.shard_grads", "optim.zero"), "sharded"),
    (("optim.offload=cpu",), ("optim.offload", "trainer.param_dtype"), "host"),
    (("optim.fused_update=true",), ("optim.fused_update", "trainer.param_dtype"), "masters"),
    ((*BF16, "optim.offload=cpu", "ema.enabled=true", "ema.device=gpu"), ("ema.device", "optim.offload"), "host"),
    ((*BF16, "optim.offload=cpu", "compile.cuda_graphs=true"), ("compile.cuda_graphs", "optim.offload"), "masters"),
])
def test_a_refusal_names_its_keys_and_the_backend_that_serves(extra, keys, backend):
    with pytest.raises(ConfigError) as e:
        _cfg(*extra)
    assert all(k in str(e.value) for k in keys) and f"the {backend} backend" in str(e.value), str(e.value)


def test_the_estimator_refuses_what_the_trainer_refuses():
    """Offload on several ranks without optim.zero: the Trainer refuses it (its checkpoints are the
    sharded masters'); the estimator used to estimate it all the same."""
    cfg = _cfg(*BF16, "optim.offload=cpu")
    assert estimate_model_state(1000, cfg, 1)["host_masters"] == 4000
    with pytest.raises(ConfigError, match="optim.offload=cpu on several processes .* optim.zero=true"):
        estimate_model_state(1000, cfg, 2)


def test_a_refusal_at_load_names_the_file_and_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("optim:\n  offload: cpu\n")
    with pytest.raises(ConfigError, match=f"{path}: optim.offload=cpu needs trainer.param_dtype=bf16"):
        ddptrain.load_config(str(path))


@pytest.mark.parametrize("extra, backend, where", [
    ((), "replicated", {"weights": "gpu", "masters": None, "optimizer_state": "gpu", "sharded": False}),
    ((*BF16, "optim.fused=true"), "masters",
     {"weights": "gpu", "masters": "gpu", "optimizer_state": "gpu", "sharded": False}),
    ((*BF16, "optim.fused=true", "optim.offload=cpu"), "host",
     {"weights": "gpu", "masters": "host", "optimizer_state": "host", "sharded": False}),
])
def test_the_trainer_holds_one_backend_and_asks_it(tmp_path, extra, backend, where):
    torch.manual_seed(0)
    cfg = make_cfg(tmp_path, "trainer.max_steps=2", "ema.enabled=true", *extra)
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, [concat(a, b) for a, b in micro_batches(2)]) as trainer:
        assert not hasattr(trainer, "master")  # no flags about the backend: the backend itself
        assert trainer.backend.name == backend and trainer.backend.where() == where
        assert trainer.update.backend is trainer.backend and trainer.optimizer is trainer.backend.optimizer
        follows = trainer.backend.ema_follows()
        masters = [follows.sources.get(p, p) for p in trainer.backend.params]
        trainer.fit()
        # the EMA averaged the fp32 tensors the optimizer updated (masters where there are), in their place
        assert all(m.dtype == torch.float32 for m in masters)
        assert [e.device.type for e in trainer.ema.ema] == ["cpu"] * len(masters)
        assert all(trainer.ema.sources[i] is m for i, m in enumerate(masters))
