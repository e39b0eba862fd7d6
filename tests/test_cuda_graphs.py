"""compile.cuda_graphs (ddptrain/cuda_graphs.py) on the CPU, where its ``rerun`` backend runs each
shape's loss on the shape's static buffers: the same keys, copies, scale and weight tensors, kept
gradients and fallbacks as on a GPU, so a run must train to exactly the eager run's weights.
The GPU side (real capture and replay, same losses as eager) is bench/check_cuda_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

import ddptrain
from ddptrain.config import ConfigError
from ddptrain.cuda_graphs import GraphedSteps, _Unknown, batch_key, for_run
from test_trainer import FrameMLP, ListLoader, frame_loss, make_batch, make_cfg, micro_batches, params_of

GRAPHS = ("compile.cuda_graphs=true",)


def _train(tmp, data, loss=frame_loss, *extra, dropout=0.0):
    torch.manual_seed(0)
    model = FrameMLP(dropout=dropout)
    cfg = make_cfg(tmp, "checkpoint.save_at_end=false", *extra)
    trainer = ddptrain.Trainer(model, loss, cfg, data)
    trainer.fit()
    return params_of(model), trainer


def _assert_same(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between eager and cuda_graphs"


def test_batch_key_is_shapes_dtypes_and_host_values():
    a = {"x": torch.zeros(2, 3), "n": 4, "ids": ["a", "b"], "flag": None}
    assert batch_key(a) == batch_key({"x": torch.ones(2, 3), "n": 4, "ids": ["c", "d"], "flag": None})
    assert batch_key(a) != batch_key({"x": torch.zeros(2, 4), "n": 4, "ids": ["a", "b"], "flag": None})
    assert batch_key(a) != batch_key({"x": torch.zeros(2, 3, dtype=torch.float64), "n": 4, "ids": ["a", "b"],
                                      "flag": None})
    assert batch_key(a) != batch_key({"x": torch.zeros(2, 3), "n": 5, "ids": ["a", "b"], "flag": None})
    assert batch_key(a) != batch_key({"x": torch.zeros(2, 3), "n": 4, "ids": ["a"], "flag": None})
    assert batch_key(a) != batch_key({"n": 4, "x": torch.zeros(2, 3), "ids": ["a", "b"], "flag": None})
    with pytest.raises(_Unknown, match="object"):
        batch_key({"x": torch.zeros(1), "thing": object()})


@pytest.mark.parametrize("extra", [(), ("trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.fused=true"),
                                   ("compile.cuda_graph_warmup=2", "trainer.clip_grad_norm=0.05")])
def test_graphed_run_trains_to_the_eager_weights(tmp_path, extra):
    """Accumulation of two shapes per step, dropout, a changing unit pre-scale: replays, captures
    and warm-up steps together give the eager run's weights bit for bit."""
    data = [b for mb in micro_batches(6) for b in mb]
    common = ("trainer.max_steps=6", "trainer.grad_accum_steps=2", *extra)
    eager, _ = _train(tmp_path / "eager", data, frame_loss, *common, dropout=0.2)
    graphed, trainer = _train(tmp_path / "graphs", data, frame_loss, *common, *GRAPHS, dropout=0.2)
    _assert_same(eager, graphed)
    warm = 2 if "compile.cuda_graph_warmup=2" in extra else 1
    assert trainer.graphs.scalars()["cuda_graphs"] == 2  # two shapes, each captured once
    assert trainer.graphs.replayed == 12 - 2 * warm  # every micro-batch after each shape's warm-up
    assert all(p.grad is not None for p in trainer.update.params)  # kept for the graphs to write into


def test_empty_batch_stand_in_and_device_side_skip(tmp_path):
    """An empty batch (all utterances skipped) replays the last real one with weight 0, and a
    non-finite batch is skipped on the device (fused AdamW): as in the eager run."""
    gen = torch.Generator().manual_seed(3)
    data = [{**make_batch(gen, 2, 5), "ids": ["u1", "u2"]} for _ in range(8)]
    data[4] = {"ids": []}
    data[6]["x"] = data[6]["x"].clone()
    data[6]["x"][0, 0, 0] = float("nan")
    extra = ("trainer.max_steps=8", "optim.fused=true", "trainer.max_nonfinite_steps=3")
    eager, eager_trainer = _train(tmp_path / "eager", data, frame_loss, *extra)
    graphed, trainer = _train(tmp_path / "graphs", data, frame_loss, *extra, *GRAPHS)
    _assert_same(eager, graphed)
    assert trainer.skip_on_device and trainer.skipped_steps == eager_trainer.skipped_steps == 2  # no units; NaN
    assert trainer.graphs.replayed == 7  # step 1 warms the shape up; 2 captures it; 2-8 replay it


def test_resume_with_graphs_is_exact(tmp_path):
    gen = torch.Generator().manual_seed(7)
    data = ListLoader([make_batch(gen, 2, 5 + i % 2) for i in range(4)])
    run = lambda name, *extra: _train(tmp_path / name, data, frame_loss, "trainer.max_steps=8",  # noqa: E731
                                      "checkpoint.every_steps=4", "checkpoint.keep_last=0", *GRAPHS, *extra,
                                      dropout=0.2)[0]
    full = run("full")
    mid = tmp_path / "full" / "checkpoints" / "step_00000004"
    resumed = run("resumed", f"checkpoint.resume={mid}")
    _assert_same(full, resumed)


def test_unfit_shapes_fall_back_to_eager_with_a_warning(tmp_path):
    """A host unit count that changes within one shape, a batch holding an unknown object, and
    more shapes than compile.cuda_graph_max all run eagerly, each said once; the weights are eager's."""
    class Tag:  # not a tensor, number or string: the batch cannot be keyed
        pass

    gen = torch.Generator().manual_seed(5)
    batches = [make_batch(gen, 2, 4 + i % 3) for i in range(9)]
    tagged = [{**b, "tag": Tag()} if i % 3 == 2 else b for i, b in enumerate(batches)]

    def host_units(model, batch):  # a host count that differs between batches of one shape
        loss, units = frame_loss(model, batch)
        return loss, int(units)

    for loss in (frame_loss, host_units):
        extra = ("trainer.max_steps=9", "compile.cuda_graph_max=1")
        eager, _ = _train(tmp_path / f"eager_{loss.__name__}", tagged, loss, *extra)
        torch.manual_seed(0)
        model = FrameMLP()
        trainer = ddptrain.Trainer(model, loss, make_cfg(tmp_path / f"g_{loss.__name__}", *extra, *GRAPHS,
                                                         "checkpoint.save_at_end=false"), tagged)
        said = []
        trainer.graphs.say = said.append
        trainer.fit()
        _assert_same(eager, params_of(model))
        text = "\n".join(said)
        assert "a batch holds a Tag" in text
        if loss is host_units:
            assert "host unit count changed within one shape" in text and trainer.graphs.replayed == 0
        else:
            assert "compile.cuda_graph_max=1" in text and trainer.graphs.scalars()["cuda_graphs"] == 1
            assert trainer.graphs.replayed == 2  # shape 1 of 3: batches 1 (warm-up), 4 (capture), 7


def test_refused_set_ups(tmp_path):
    with pytest.raises(ConfigError, match="recompute.enabled"):
        make_cfg(tmp_path, *GRAPHS, "recompute.enabled=true", "recompute.module_classes=[Linear]")
    with pytest.raises(ConfigError, match="optim.offload"):
        make_cfg(tmp_path, *GRAPHS, "trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.offload=cpu")
    with pytest.raises(ConfigError, match="one process"):
        for_run(make_cfg(tmp_path, *GRAPHS), None, world_size=2)
    with pytest.raises(ConfigError, match="cuda_graph_warmup"):
        make_cfg(tmp_path, *GRAPHS, "compile.cuda_graph_warmup=0")


def test_capture_failure_leaves_no_gradient_behind():
    """A failed capture restores the gradients that did not exist before it (none of them ran)."""
    model = torch.nn.Linear(3, 1)
    steps = GraphedSteps(model, frame_loss, ddptrain.precision.Precision("fp32", torch.device("cpu")),
                         list(model.parameters()), torch.device("cpu"))
    said = []
    steps.say = said.append

    def broken(model, batch):
        raise ValueError("host sync")

    steps.loss_fn = broken
    steps.seen[("k",)] = 1
    assert steps._capture(("k",), {"x": torch.zeros(1)}, "here", 1.0, 1.0) is None
    assert all(p.grad is None for p in model.parameters()) and ("k",) in steps.eager_only
    assert "its capture failed (ValueError: host sync)" in said[0]
    assert steps.reasons == [said[0].split("runs eagerly: ", 1)[1]]  # kept for the bench rows
