"""The loss contract's errors (ddptrain/contract.py, ddptrain/guard.py): a loss_fn that breaks
it is named with what it returned, on every rank at the same step, and never exits quietly."""

from __future__ import annotations

import os

import pytest
import torch

import ddptrain
from _dist import run_ranks
from test_trainer import FrameMLP, frame_loss, make_cfg, micro_batches


def _fit(tmp, loss_fn, *extra):
    torch.manual_seed(0)
    data = micro_batches(3)[0] * 3
    ddptrain.Trainer(FrameMLP(), loss_fn, make_cfg(tmp, "trainer.max_steps=6", *extra), data).fit()


def test_shape_1_loss_is_named_with_rank_and_step(tmp_path):
    def loss_fn(model, batch):
        loss, units = frame_loss(model, batch)
        return loss.reshape(1), units

    with pytest.raises(ddptrain.TrainingError, match=r"rank 0, step 1, micro-batch 0: loss_fn's loss_sum must be "
                                                     r"a 0-d tensor.*shape \(1,\)"):
        _fit(tmp_path, loss_fn)


@pytest.mark.parametrize("units", [-3, float("nan"), "12", True])
def test_bad_host_unit_counts_are_named(tmp_path, units):
    with pytest.raises(ddptrain.TrainingError, match=r"num_units must be a count >= 0.*returned"):
        _fit(tmp_path, lambda m, b: (frame_loss(m, b)[0], units))


def test_negative_tensor_units_stop_training(tmp_path):
    with pytest.raises(ddptrain.TrainingError, match="loss_fn returned a negative num_units"):
        _fit(tmp_path, lambda m, b: (frame_loss(m, b)[0], -frame_loss(m, b)[1]))


def test_zero_units_every_step_is_an_error_not_a_quiet_exit(tmp_path):
    with pytest.raises(ddptrain.TrainingError, match=r"num_units=0 on every rank for 3 steps in a row"):
        _fit(tmp_path, lambda m, b: (frame_loss(m, b)[0], 0), "trainer.max_nonfinite_steps=3")


def test_not_a_pair_is_named(tmp_path):
    with pytest.raises(ddptrain.TrainingError, match=r"must return \(loss_sum, num_units\), it returned a tensor"):
        _fit(tmp_path, lambda m, b: frame_loss(m, b)[0])


def _zero_units_on_one_rank(rank, world, out):
    # rank 1's micro-batches have no units, rank 0's do: a legal step (global units > 0)
    torch.manual_seed(0)
    data = [mb[rank] for mb in micro_batches(3)]
    loss = (lambda m, b: frame_loss(m, b)) if rank == 0 else (lambda m, b: (frame_loss(m, b)[0] * 0, 0))
    t = ddptrain.Trainer(FrameMLP(), loss, make_cfg(os.path.join(out, "r"), "trainer.max_steps=3"), data)
    t.fit()
    assert t.skipped_steps == 0


@pytest.mark.timeout(120)
def test_zero_units_on_one_rank_only_is_fine(tmp_path):
    run_ranks(_zero_units_on_one_rank, 2, str(tmp_path))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensor_units_are_named_and_never_stepped_on(tmp_path, bad):
    """issue 30, item 13: NaN units were reported as a non-finite loss/gradient, and inf units
    applied a zero-gradient step (AdamW's weight decay and moments moved)."""
    torch.manual_seed(0)
    model = FrameMLP()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = lambda m, b: (frame_loss(m, b)[0], frame_loss(m, b)[1] * bad)  # noqa: E731
    t = ddptrain.Trainer(model, loss_fn, make_cfg(tmp_path, "trainer.max_steps=3"), micro_batches(3)[0])
    with pytest.raises(ddptrain.TrainingError, match=r"step 1: loss_fn returned a non-finite num_units \(NaN or "
                                                     r"inf\) on 1 micro-batch"):
        t.fit()
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), f"{k} moved: a step was applied"


@pytest.mark.parametrize("where", ["train", "eval"])
def test_infinite_host_units_are_refused(tmp_path, where):
    inf = lambda m, b: (frame_loss(m, b)[0], float("inf"))  # noqa: E731
    torch.manual_seed(0)
    data = micro_batches(3)[0]
    t = ddptrain.Trainer(FrameMLP(), inf if where == "train" else frame_loss, make_cfg(tmp_path, "trainer.max_steps=1"),
                         data)
    with pytest.raises(ddptrain.TrainingError, match=r"num_units must be a count >= 0.*returned inf"):
        t.fit() if where == "train" else (setattr(t, "loss_fn", inf), t.evaluate(data))
