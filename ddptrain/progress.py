"""The loop's own state, as stateful objects a checkpoint saves and restores.

The Trainer hands :mod:`ddptrain.checkpoint` a dict of objects with ``state_dict()`` /
``load_state_dict()`` (torchtitan's ``states``, torchtune's ``TrainingProgress``); the two
defined here are the ones torch has no class for: the loop's counters and the RNG streams.
Each ``load_state_dict`` pops every key it knows and refuses what is left over, so a checkpoint
of another version fails loudly instead of half-loading.

Per-rank objects (the RNG streams, the sampler position, a ZeRO shard) may also define
``load_resharded(old_states, meta)``: the checkpointer calls it instead of ``load_state_dict``
when the checkpoint was written by another number of processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass
class TrainingProgress:
    """Where the loop is, and the counters that decide what it does next."""

    step: int = 0  # optimizer steps attempted (skipped ones included: their data is consumed)
    epoch: int = 0
    batches_done: int = 0  # batches of the current epoch consumed by this rank
    epoch_batches: int = 0  # batches per rank of the current epoch (a resharded epoch differs)
    unit_scale: float = 1.0  # loss pre-scale (1 / units per micro-batch of the last step): keeps fp16 in range
    skipped_steps: int = 0  # steps not applied (non-finite, or no units), over the whole run
    nonfinite_in_row: int = 0  # consecutive non-finite steps (abort at trainer.max_nonfinite_steps)
    empty_in_row: int = 0  # consecutive steps whose loss_fn returned 0 units on every rank
    schedule_steps: int = 0  # the horizon the LR schedule was built for (kept across resumes)
    last_eval: dict = field(default_factory=dict)
    last_eval_step: int = -1
    run_id: str = ""  # the run that owns the checkpoints (see checkpoint.RunFolder)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        s = dict(state)
        for f in dataclasses.fields(self):
            if f.name not in s:
                raise ValueError(f"training progress state is missing {f.name!r}")
            setattr(self, f.name, s.pop(f.name))
        if s:
            raise ValueError(f"training progress state has unexpected key(s) {sorted(s)}")
        if self.epoch_batches and self.batches_done >= self.epoch_batches:  # saved at an epoch's last batch
            self.epoch, self.batches_done = self.epoch + 1, 0


class RNGStreams:
    """This process's random streams (Python, NumPy, torch CPU and CUDA) as a stateful object.

    Saved per rank, so a resume on the same number of processes continues every stream exactly.
    On another number of processes there is no old stream that belongs to a new rank: each rank
    is then reseeded from ``(seed, step, rank)`` — deterministic, different per rank, and the
    same on every relaunch with that world size (:meth:`load_resharded`).

    Args:
        seed: ``trainer.seed``.
        rank: this process's rank.
    """

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank = int(seed), int(rank)
        self.pending: Optional[dict] = None  # a loaded state, applied by the Trainer at its first epoch iterator

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Keep ``state`` to apply later: the Trainer builds more of itself (and draws from the
        streams) between loading a checkpoint and starting the loop."""
        self.pending = dict(state)

    def load_resharded(self, old_states: Sequence, meta: dict) -> None:
        digest = hashlib.blake2b(f"{self.seed}/{meta['step']}/{self.rank}".encode(), digest_size=8).digest()
        self.pending = {"reseed": int.from_bytes(digest, "little") & (2**63 - 1)}

    def apply_pending(self) -> None:
        if self.pending is None:
            return
        state, self.pending = self.pending, None
        if "reseed" in state:
            s = state["reseed"]
            random.seed(s)
            np.random.seed(s % 2**32)
            torch.manual_seed(s)  # CUDA too
            return
        random.setstate(_tuplify(state["python"]))
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class SamplerPosition:
    """A stateful batch sampler's state with the position the loop has *consumed*.

    The DataLoader prefetches, so the sampler's own count runs ahead of training; what a resume
    needs is the number of batches the loop took (``progress.batches_done``). Every rank of an
    epoch is at the same position, so after a change of world size any old rank's state will do:
    the sampler re-deals what the old ranks had not reached (``DurationBucketSampler``).
    """

    def __init__(self, sampler: Any, progress: TrainingProgress):
        self.sampler, self.progress = sampler, progress

    def state_dict(self) -> dict:
        return dict(self.sampler.state_dict(), position=self.progress.batches_done, epoch=self.progress.epoch)

    def load_state_dict(self, state: dict) -> None:
        p = self.progress  # loaded before the per-rank states
        self.sampler.load_state_dict(dict(state, epoch=p.epoch, position=p.batches_done))

    def load_resharded(self, old_states: Sequence, meta: dict) -> None:
        self.load_state_dict(old_states[0])


class LoaderPosition:
    """The position in a loader without a stateful sampler (e.g. torch's DistributedSampler),
    where a resume skips the consumed batches by iterating. That is exact on the same number of
    processes; on another one only at an epoch boundary, since such a sampler has no global plan
    to re-deal the rest of an epoch."""

    def __init__(self, progress: TrainingProgress):
        self.progress = progress

    def state_dict(self) -> dict:
        return {"position": self.progress.batches_done}

    def load_state_dict(self, state: dict) -> None:
        pass  # the position is the progress record's

    def load_resharded(self, old_states: Sequence, meta: dict) -> None:
        if self.progress.batches_done:
            raise ValueError(f"the checkpoint stopped mid-epoch (batch {self.progress.batches_done}) on "
                             f"{meta['world_size']} processes, and this loader's sampler cannot re-deal the "
                             "rest of an epoch over another number: resume on the same number, from a "
                             "checkpoint at an epoch boundary, or use DurationBucketSampler")


def _numpy_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
