"""Every memory switch trains like the plain run and resumes exactly, on a model with BatchNorm.

tests/_equivalence.py is the shared harness (plain run, switched run, the switched run resumed
from its half-way checkpoint; every state-dict entry compared, BatchNorm's running statistics
and ``num_batches_tracked`` included). The switch-specific tests (what goes where, refusals,
memory held) stay in each switch's own module.
"""

from __future__ import annotations

import pytest
import torch

import _equivalence as eq
from ddptrain import activation_offload

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tiny models: one thread is fastest

BF16 = ("trainer.precision=bf16", "trainer.param_dtype=bf16", "optim.fused=true")
RECOMPUTE = ("recompute.enabled=true", "recompute.module_classes=[BNBlock]")
LORA = ("lora.enabled=true", "lora.targets=[blocks.*.proj,blocks.*.out]", "lora.rank=2", "lora.alpha=4",
        "lora.trainable=[head.*,inp.*]")


def _ema_state(trainer) -> dict:
    state = trainer.ema.state_dict()
    assert state["tensors"], "the EMA averaged nothing"
    return {**state["tensors"], "updates": state.get("updates"), "seen": state.get("seen")}


def _switched_on(trainer):
    """What shows each switch was on (asserted by the test that asked for it)."""
    return {"offload": type(trainer.backend.master).__name__ if trainer.backend.master is not None else None,
            "streamed": trainer.streamed is not None, "recomputed": bool(trainer.recomputed),
            "activation_offload": trainer.activation_offload is not None,
            "graphs": trainer.graphs.scalars()["cuda_graphs"] if trainer.graphs is not None else 0}


ONE_RANK = {
    "recompute": dict(switches={"recompute": RECOMPUTE}),
    "recompute_accum2_bf16": dict(switches={"recompute": RECOMPUTE}, base=BF16, accum=2),
    "activation_offload": dict(switches={"activation_offload": (*RECOMPUTE, "recompute.offload=cpu")}),
    "offload": dict(switches={"offload": ("optim.offload=cpu", "optim.offload_chunk_mb=0.00003")}, base=BF16,
                    accum=2),
    "streamed_base": dict(switches={"streamed_base": ("lora.base_offload=cpu",)}, base=LORA),
    "cuda_graphs": dict(switches={"cuda_graphs": ("compile.cuda_graphs=true",)}, accum=2),
}


@pytest.mark.filterwarnings("ignore:recompute.offload=cpu on a CPU device")
@pytest.mark.parametrize("case", list(ONE_RANK))
def test_one_rank_switch_equals_the_plain_run_and_resumes_exactly(tmp_path, monkeypatch, case):
    monkeypatch.setattr(activation_offload, "MIN_BYTES", 0)  # the tiny model's tensors go to the host too
    kw = dict(ONE_RANK[case])
    (ran,) = eq.check(tmp_path, probe=_switched_on, **kw)
    on = ran[next(iter(kw["switches"]))].probe
    expected = {"recompute": "recomputed", "recompute_accum2_bf16": "recomputed",
                "activation_offload": "activation_offload", "streamed_base": "streamed"}
    if case == "offload":
        assert on["offload"] == "OffloadedMasters"
    elif case == "cuda_graphs":
        assert on["graphs"] == 2  # two batch shapes (accumulation of the two halves), each captured
    else:
        assert on[expected[case]], case


def test_the_ema_leaves_training_alone_and_resumes_bit_for_bit(tmp_path):
    eq.check(tmp_path, {"ema": ("ema.enabled=true", "ema.decay=0.9")}, probe=_ema_state)


@pytest.mark.timeout(300)
def test_two_ranks_zero_offload_and_a_sharded_ema_equal_ddp_and_resume_exactly(tmp_path):
    """2 gloo ranks, bf16 parameters with fp32 masters: sharded masters (optim.zero), the
    offloaded update and a sharded EMA against DDP with replicated masters, bit for bit.
    (Sharded gradients are bitwise only without clipping; tests/test_sharded_grads.py's own
    model has had a BatchNorm, compared bit for bit, from the start.)"""
    eq.check(tmp_path / "bf16", {
        "zero": ("optim.zero=true",),
        "offload": ("optim.zero=true", "optim.offload=cpu", "optim.offload_chunk_mb=0.00003"),
        "ema_sharded": ("optim.zero=true", "ema.enabled=true", "ema.decay=0.9"),
    }, base=BF16, world=2)
