"""One harness for "memory switch X trains like the plain run, and resumes exactly".

Each memory switch (ZeRO, sharded gradients, optimizer offload, activation offload, recompute,
streamed base, EMA, the CPU path of CUDA graphs) promises the same weights as the plain run, and
that its own checkpoint resumes bit for bit. The test modules used to hand-roll that comparison
each with its own model; here it is once, over one tiny model that holds a BatchNorm in each
block (issue 49 item 1: recompute updated BatchNorm's running statistics twice a step while the
weights stayed equal), and the comparison covers every entry of the state dict: weights, running
statistics and ``num_batches_tracked``, not weights and losses alone.

A run is ``steps`` optimizer steps with a checkpoint half-way; ``check()`` trains the plain run
and the switched run, compares them, then resumes the switched run from its half-way checkpoint
and asks for the uninterrupted run's losses and state bit for bit. Runs of 2 ranks (gloo, CPU)
all happen in one pair of spawned processes (a spawn costs more than the runs themselves).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

import ddptrain
from _dist import run_ranks
from ddptrain import weights
from test_trainer import FEAT, concat, frame_loss, make_cfg, micro_batches

D = 8
STEPS = 6


class BNBlock(nn.Module):
    """Linear, BatchNorm over the feature axis, GELU; residual. The unit recompute wraps."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = self.norm(self.proj(x).transpose(1, 2)).transpose(1, 2)
        return x + self.out(nn.functional.gelu(h))


class BNNet(nn.Module):
    """Per-frame regressor over (B, T, FEAT): an input projection, two BNBlocks (the largest
    ModuleList: the streamed base's blocks), a head. About 450 parameters."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(FEAT, D)
        self.blocks = nn.ModuleList([BNBlock() for _ in range(2)])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)


@dataclass
class Run:
    """What one rank's run leaves: per-step loss sums, the full state dict, and what ``probe``
    returned from the live Trainer (before its fit, after its fit)."""

    losses: list = field(default_factory=list)
    state: dict = field(default_factory=dict)
    probe: object = None


def data_for(rank: int, world: int, steps: int, accum: int) -> list:
    """Rank ``rank``'s micro-batches: the two halves of each step's batch (2 ranks), or both
    halves in a row (1 rank with accumulation 2), or their concatenation (1 rank, accumulation 1)."""
    mbs = micro_batches(steps)
    if world == 2:
        return [mb[rank] for mb in mbs]
    return [b for mb in mbs for b in mb] if accum == 2 else [concat(a, b) for a, b in mbs]


def train(out: str, overrides: tuple, rank: int = 0, world: int = 1, steps: int = STEPS, accum: int = 1,
          resume: Optional[str] = None, probe: Optional[Callable] = None) -> Run:
    """One run of BNNet; a checkpoint every ``steps // 2`` steps (the half-way one resumes)."""
    torch.manual_seed(0)
    model = BNNet()
    extra = [f"checkpoint.resume={resume}"] if resume else []
    cfg = make_cfg(out, f"trainer.max_steps={steps}", f"trainer.grad_accum_steps={accum}",
                   f"checkpoint.every_steps={steps // 2}", "checkpoint.keep_last=0", "logging.tensorboard=false",
                   "trainer.clip_grad_norm=0.5", "scheduler.name=warmup_cosine", "scheduler.warmup_steps=2",
                   *overrides, *extra)
    run = Run()
    with ddptrain.Trainer(model, frame_loss, cfg, data_for(rank, world, steps, accum)) as trainer:
        real = trainer.train_step

        def step(micro):
            result = real(micro)
            run.losses.append(result["loss_sum"])
            return result

        trainer.train_step = step
        trainer.fit()
        run.probe = probe(trainer) if probe else None
    run.state = {k: v.detach().clone() for k, v in weights.unwrap(model).state_dict().items()}
    return run


def _mid(out: str, steps: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{steps // 2:08d}")


def _all_runs(tmp: str, base: tuple, switches: dict, rank: int, world: int, steps: int, accum: int,
              probe: Optional[Callable]) -> dict:
    """The plain run once, then each switch's run and its resume from the half-way checkpoint."""
    runs = {"plain": train(os.path.join(tmp, "plain"), base, rank, world, steps, accum)}
    for name, switch in switches.items():
        out = os.path.join(tmp, name)
        runs[name] = train(out, (*base, *switch), rank, world, steps, accum, probe=probe)
        runs[name + "/resumed"] = train(out + "_resumed", (*base, *switch), rank, world, steps, accum,
                                        resume=_mid(out, steps), probe=probe)
    return runs


def _ranks_worker(rank: int, world: int, tmp: str, base: tuple, switches: dict, steps: int, accum: int,
                  probe: Optional[Callable]) -> None:
    runs = _all_runs(tmp, base, switches, rank, world, steps, accum, probe)
    torch.save(runs, os.path.join(tmp, f"runs_rank{rank}.pt"))


def assert_same_state(got: dict, want: dict, what: str, exact: bool = True) -> None:
    """Every state-dict entry: weights, BatchNorm running statistics, ``num_batches_tracked``."""
    assert got.keys() == want.keys(), what
    assert any(k.endswith("running_var") for k in want) and any(k.endswith("num_batches_tracked") for k in want)
    for k, v in want.items():
        if exact or not v.is_floating_point():
            assert torch.equal(got[k], v), f"{what}: {k} differs"
        else:
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


def check(tmp, switches: dict, base: tuple = (), world: int = 1, steps: int = STEPS, accum: int = 1,
          exact: bool = True, probe: Optional[Callable] = None) -> list[dict]:
    """Train the plain run and each switched run; assert each switch changes nothing and resumes exactly.

    Args:
        tmp: a fresh folder for the run folders.
        switches: name -> the overrides that turn that switch on (each compared with the plain run).
        base: overrides every run shares (precision, parameter dtype, ...).
        world: 1, or 2 gloo ranks in one pair of spawned processes (each rank's state is compared).
        accum: gradient accumulation steps (1 rank: the two halves of each batch in a row).
        exact: bitwise; else within fp32 rounding (a sharded update sums in another order).
            The resume is always asked to be bitwise.
        probe: ``probe(trainer)`` after each switched run's fit (to check the switch was on, or
            to return state outside the model, e.g. the EMA's, which must resume bitwise too);
            its value comes back per run in ``Run.probe``. With 2 ranks it must pickle.

    Returns:
        Per rank: ``{"plain": Run, name: Run, name + "/resumed": Run, ...}``.
    """
    tmp = str(tmp)
    if world == 1:
        ranks = [_all_runs(tmp, base, switches, 0, 1, steps, accum, probe)]
    else:
        run_ranks(_ranks_worker, world, tmp, base, switches, steps, accum, probe, timeout=240)
        ranks = [torch.load(os.path.join(tmp, f"runs_rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, runs in enumerate(ranks):
        plain = runs["plain"]
        for name in switches:
            switched, resumed = runs[name], runs[name + "/resumed"]
            what = f"rank {r}, {name}"
            assert len(switched.losses) == steps
            if exact:
                assert switched.losses == plain.losses, f"{what}: the losses differ from the plain run's"
            else:
                torch.testing.assert_close(torch.tensor(switched.losses), torch.tensor(plain.losses),
                                           rtol=1e-5, atol=1e-6, msg=what)
            assert_same_state(switched.state, plain.state, f"{what} against the plain run", exact)
            # the switched run's own half-way checkpoint, resumed in a fresh Trainer: bit for bit
            assert resumed.losses == switched.losses[steps // 2:], f"{what}: resumed losses differ"
            assert_same_state(resumed.state, switched.state, f"{what}: resumed from step {steps // 2}")
            if isinstance(switched.probe, dict):  # state outside the model (an EMA): resumed bitwise too
                assert switched.probe.keys() == resumed.probe.keys(), what
                for k, v in switched.probe.items():
                    same = torch.equal(resumed.probe[k], v) if isinstance(v, torch.Tensor) else resumed.probe[k] == v
                    assert same, f"{what}: {k} differs after the resume"
    return ranks
