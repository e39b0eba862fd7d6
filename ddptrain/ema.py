"""Exponential moving average (EMA) of the trained weights: fp32, sharded as the optimizer is, swapped in to evaluate.

With ``ema.enabled`` the Trainer keeps, beside the weights it trains, ``ema = decay * ema +
(1 - decay) * weights`` of every trainable tensor, updated after every ``ema.every_steps``
applied optimizer updates (a step skipped as non-finite, or by fp16's loss scaler, does not
count). Evaluation, and so ``checkpoint.keep_best``, runs on the EMA weights (``ema.evaluate``);
the model's own weights are put back bit for bit afterwards. A LoRA run averages what it trains:
the adapters (and ``lora.trainable``), never the frozen base.

What is averaged: the fp32 weights the optimizer updates. Under ``trainer.param_dtype: bf16``
those are the fp32 masters, not their bf16 rounding (an update of 1e-5 relative would round away
in bf16, and so would the EMA's). The EMA is always fp32: 4 B per trainable parameter.

Where it lives and who holds what:

- Replicated weights (one rank, DDP, bf16 with replicated masters): every rank holds the whole
  EMA on the training device and updates it identically; a checkpoint saves it once
  (``trainer.pt``, key ``ema``).
- Sharded (``optim.zero`` on several ranks: ZeroRedundancyOptimizer's partition, or the sharded
  fp32 masters, with or without offload): each rank holds and updates the EMA of its own
  partition only (4/N B per parameter) and saves it in ``ema_rank{r}.pt``, keyed by tensor name,
  so a resume on another number of ranks re-partitions it (:meth:`load_resharded`). The whole
  EMA is assembled only to evaluate (each owner broadcasts its tensors into every rank's model,
  in place) and, offline, to export (``python -m ddptrain.weights export``, reading the files).
- ``ema.device``: ``auto`` keeps it beside the masters (host memory under ``optim.offload:
  cpu``, where the update is a host ``lerp`` from the host masters; the training device
  otherwise), ``cpu`` puts it in host memory whatever the masters do: each update then copies
  the fp32 weights down through two pinned buffers of :data:`CHUNK_ELEMS`, averaging one chunk on
  the host while the next one copies; the GPU's queue drains meanwhile, once every
  ``every_steps`` updates. In host memory, every rank first checks that its node holds all its
  ranks' shares (beside offloaded masters, their check counts the EMA: ddptrain/update/host.py).

The update on the device is one ``torch._foreach_lerp_`` over the rank's tensors with a host
number as the weight: no host synchronisation (the Trainer already knows on the host whether the
step was applied). ``lerp(ema, w, 1 - decay)`` is ``decay * ema + (1 - decay) * w``.

Decay warm-up (``ema.warmup``, off by default): the n-th update (from 0) uses
``min(decay, (1 + n) / (10 + n))`` (TensorFlow's ``ExponentialMovingAverage(num_updates=...)``
rule, also latent diffusion's), so a from-scratch run's random start fades in a few hundred updates.
Off by default because ddptrain's users mostly fine-tune: their start is a good pretrained model,
and the warm-up would discard it after the first few updates in favour of the early, noisiest
fine-tuned weights.

Checkpoints: besides the state above (exact fp32, so a resumed run's EMA equals the
uninterrupted run's bit for bit), ``meta.json`` says ``"ema": {"updates": n, "evaluated": bool}``:
whether the checkpoint's metrics measured the EMA weights; ``python -m ddptrain.weights export``
and ``python -m ddptrain.average`` then export the EMA weights by default (``--weights model``:
the trained ones), and so does ``examples/evaluate.py`` score them (``--which``);
``ddptrain.load_weights(model, checkpoint, which="ema")`` loads them into a model. A run resumed
with ``ema.enabled`` from a checkpoint without an EMA starts one from the resumed weights;
``ema.decay``, ``every_steps``, ``warmup`` and ``device`` may change on resume (from the resumed
step on).

Using it by hand: ``with trainer.ema.swapped(): ...`` runs anything on the EMA weights (every
rank together when sharded).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed
from torch import nn

from ddptrain import dist
from ddptrain.checkpoint import saved_states
from ddptrain.config import EmaConfig
from ddptrain.process import agree_on_host_memory
from ddptrain.update.backend import EmaFollows

CHUNK_ELEMS = 8 * 2**20  # ema.device=cpu with the weights on a GPU: fp32 elements per staged copy (32 MiB, two buffers)

__all__ = ["ExponentialMovingAverage", "build", "saved_ema", "host_parts", "CHUNK_ELEMS"]


class ExponentialMovingAverage:
    """The EMA of a model's trainable tensors (this rank's partition when sharded).

    Args:
        cfg: the ``ema`` config section (read at every update: a resume may change it).
        module: the model (unwrapped, prepared: LoRA'd, bf16 under masters): its trainable
            parameters are averaged, named by their state-dict keys (tied tensors: every key).
        follows: what the optimizer backend updates (``Backend.ema_follows()``,
            :class:`ddptrain.update.backend.EmaFollows`): the fp32 masters where it has them, which
            of them this rank updates, and where they live; None: the parameters, all of them.
        device: the training device.

    Raises:
        ValueError: a trainable parameter without a state-dict key (nothing could save it).
    """

    def __init__(self, cfg: EmaConfig, module: nn.Module, follows: Optional[EmaFollows] = None,
                 device: torch.device = torch.device("cpu")):
        self.cfg = cfg
        keys: dict[int, list[str]] = {}
        for k, v in module.state_dict(keep_vars=True).items():
            keys.setdefault(id(v), []).append(k)
        # the model's trainable tensors in parameter order: the order every ddptrain partition uses
        self.params = [p for p in module.parameters() if p.requires_grad]
        nameless = [i for i, p in enumerate(self.params) if id(p) not in keys]
        if nameless:
            raise ValueError(f"trainable parameters {nameless[:10]} (in module.parameters() order) have no "
                             "state-dict key: the EMA could not save them")
        self.names = [keys[id(p)] for p in self.params]
        follows = follows or EmaFollows()
        self.sources = [follows.sources.get(p, p) for p in self.params]  # the fp32 tensors the optimizer updates
        self.sharded = follows.sharded
        self.restore = follows.restore  # the trained weights back from the masters
        self.mine = [i for i, p in enumerate(self.params) if follows.mine is None or id(p) in follows.mine]
        self.owners = [dist.get_rank()] * len(self.params)
        if self.sharded:  # who broadcasts each tensor into the model to evaluate
            for rank, theirs in enumerate(dist.all_gather_object(self.mine)):
                for i in theirs:
                    self.owners[i] = rank
        beside = follows.on_host  # masters in host memory: their check counted the EMA's memory
        host = beside if cfg.device == "auto" else cfg.device == "cpu"
        self.device = torch.device("cpu") if host else device
        # weights on a GPU averaged in host memory: copied down chunk by chunk (_update_staged)
        self.staged = self.device.type == "cpu" and any(self.sources[i].device.type != "cpu" for i in self.mine)
        if host and not beside:
            agree_on_host_memory(host_parts(sum(self.sources[i].numel() for i in self.mine), self.staged),
                                 device, "ema.device=cpu", "keep the EMA on the GPU (ema.device=auto)")
        self.ema = [self._copy(self.sources[i]) for i in self.mine]
        self._buffers: Optional[list[torch.Tensor]] = None
        self._stash: Optional[list] = None
        self.updates = 0  # EMA updates applied
        self.seen = 0  # applied optimizer updates since the EMA started (every_steps counts these)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device, torch.float32, copy=True)

    # ------------------------------------------------------------------ the update

    def decay(self) -> float:
        """The decay of the next update (``ema.warmup``: ``min(decay, (1 + n) / (10 + n))``)."""
        d = float(self.cfg.decay)
        return min(d, (1 + self.updates) / (10 + self.updates)) if self.cfg.warmup else d

    @torch.no_grad()
    def step(self) -> bool:
        """Count one applied optimizer update; on every ``ema.every_steps``-th, move the EMA toward
        the weights. Call it only after an update that was applied (never after a skipped one).

        Returns:
            Whether the EMA moved.
        """
        self.seen += 1
        if self.seen % int(self.cfg.every_steps):
            return False
        weight = 1.0 - self.decay()
        if self.staged:
            self._update_staged(weight)
        elif self.ema:
            sources = [self.sources[i].detach() for i in self.mine]
            sources = [s if s.device == self.device and s.dtype == torch.float32 else s.to(self.device, torch.float32)
                       for s in sources]
            torch._foreach_lerp_(self.ema, sources, weight)
        self.updates += 1
        return True

    def _update_staged(self, weight: float) -> None:
        """The host EMA from weights on a GPU: chunk ``j + 1`` copies into one pinned buffer while
        the host averages chunk ``j`` from the other."""
        cuda = any(self.sources[i].is_cuda for i in self.mine)
        if self._buffers is None:
            self._buffers = [torch.empty(CHUNK_ELEMS, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        chunks = []
        for e, i in zip(self.ema, self.mine):
            src = self.sources[i].detach().reshape(-1)
            chunks += [(e.view(-1), src, a, min(a + CHUNK_ELEMS, src.numel())) for a in range(0, src.numel(), CHUNK_ELEMS)]
        landed: list = [None, None]

        def queue(j: int) -> None:
            _, src, a, b = chunks[j]
            self._buffers[j % 2][:b - a].copy_(src[a:b], non_blocking=cuda)
            if cuda:
                landed[j % 2] = torch.cuda.Event()
                landed[j % 2].record()

        if chunks:
            queue(0)
        for j, (e, _, a, b) in enumerate(chunks):
            if j + 1 < len(chunks):
                queue(j + 1)  # its buffer's last chunk (j - 1) was averaged in the previous pass
            if cuda:
                landed[j % 2].synchronize()
            e[a:b].lerp_(self._buffers[j % 2][:b - a], weight)

    @torch.no_grad()
    def reset(self) -> None:
        """Start over from the weights as they are now (a resume from a checkpoint without an EMA)."""
        for e, i in zip(self.ema, self.mine):
            e.copy_(self.sources[i].detach())
        self.updates = self.seen = 0

    # ------------------------------------------------------------------ evaluating on it

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the EMA into the model's parameters (rounded to their dtype); collective when sharded.
        The trained weights come back with :meth:`swap_out`: from the fp32 masters where there are
        masters, else from a host copy taken here."""
        if self._stash is not None:
            raise RuntimeError("the EMA weights are swapped in already")
        own = set(self.mine)
        # only copies of the trained weights that nothing else holds: parameters without a master (a
        # fp32 model; under ZeRO every rank's, since the broadcast below overwrites them all) and
        # this rank's fp32-kept ones (BatchNorm) whose master is the parameter itself
        self._stash = [(p, p.detach().to("cpu", copy=True)) for i, p in enumerate(self.params)
                       if self.restore is None or (self.sources[i] is p and i in own)]
        for e, i in zip(self.ema, self.mine):
            self.params[i].copy_(e)
        if self.sharded:
            works = [torch.distributed.broadcast(p.data, src=r, async_op=True) for p, r in zip(self.params, self.owners)]
            for w in works:
                w.wait()

    @torch.no_grad()
    def swap_out(self) -> None:
        """The trained weights back, bit for bit (collective when sharded with masters)."""
        if self._stash is None:
            raise RuntimeError("the EMA weights are not swapped in")
        for p, saved in self._stash:
            p.copy_(saved)
        self._stash = None
        if self.restore is not None:
            self.restore()  # the parameters are the masters rounded, as after every step

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """``with ema.swapped():`` the model holds the EMA weights inside the block."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    # ------------------------------------------------------------------ checkpoints

    def meta(self) -> dict:
        """What a checkpoint's meta.json says of the EMA: whether its metrics measured it."""
        return {"updates": self.updates, "evaluated": bool(self.cfg.evaluate)}

    def state_dict(self) -> dict:
        """This rank's EMA tensors by state-dict key (every rank's when replicated), and the counters."""
        tensors = {}
        for e, i in zip(self.ema, self.mine):
            tensors.update(dict.fromkeys(self.names[i], e))
        return {"tensors": tensors, "updates": self.updates, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by the same partition (the same world size, or replicated).

        Raises:
            ValueError: a key missing or left over, a tensor missing, unexpected or of another shape.
        """
        s = dict(state)
        tensors, updates, seen = s.pop("tensors"), s.pop("updates"), s.pop("seen")
        if s:
            raise ValueError(f"EMA state has unexpected key(s) {sorted(s)}")
        known = {k for i in self.mine for k in self.names[i]}
        extra = sorted(set(tensors) - known)
        if extra:
            raise ValueError(f"the saved EMA holds tensors this rank does not train: {extra[:10]}")
        self._check_all(self._copy_in(tensors))
        self.updates, self.seen = int(updates), int(seen)

    def load_resharded(self, old_states, meta: dict) -> None:
        """Collect this rank's tensors from the EMA shards of another number of ranks, read one at a time."""
        loaded: set = set()
        updates = seen = 0
        for k in range(len(old_states)):
            old = old_states[k]
            loaded |= self._copy_in(old["tensors"])
            updates, seen = old["updates"], old["seen"]  # the same on every rank
            del old
        self._check_all(loaded)
        self.updates, self.seen = int(updates), int(seen)

    @torch.no_grad()
    def _copy_in(self, tensors: dict) -> set:
        """Copy the saved tensors of this rank's partition into the EMA; returns which were there."""
        loaded = set()
        for e, i in zip(self.ema, self.mine):
            name = next((k for k in self.names[i] if k in tensors), None)
            if name is None:
                continue
            saved = tensors[name]
            if tuple(saved.shape) != tuple(e.shape):
                raise ValueError(f"saved EMA {name} has shape {tuple(saved.shape)}, the model's {tuple(e.shape)}")
            e.copy_(saved)
            loaded.add(i)
        return loaded

    def _check_all(self, loaded: set) -> None:
        missing = [self.names[i][0] for i in self.mine if i not in loaded]
        if missing:
            raise ValueError(f"the saved EMA lacks {missing[:10]} (of this rank's tensors)")


def host_parts(elements: int, staged: bool) -> dict[str, int]:
    """Host bytes of an EMA of ``elements`` fp32 values, named for the host-memory check: the
    copy, and the two pinned staging buffers when the weights it averages are on a GPU."""
    parts = {"EMA of the weights (ema.device=cpu)": 4 * int(elements)}
    if staged:
        parts["EMA staging buffers"] = 2 * 4 * CHUNK_ELEMS
    return parts


def build(cfg: EmaConfig, module: nn.Module, follows: Any, device: torch.device) -> Optional[ExponentialMovingAverage]:
    """The Trainer's EMA of what the optimizer backend updates (``follows``), or None when ``ema.enabled`` is off."""
    return ExponentialMovingAverage(cfg, module, follows, device) if cfg.enabled else None


def saved_ema(checkpoint: str) -> dict:
    """The EMA a checkpoint folder holds, by state-dict key (fp32; every rank's shard together),
    memory-mapped so a tool reads one tensor at a time; {} when it has none.

    Raises:
        CheckpointError: not a complete checkpoint, or a file that does not match its checksum.
    """
    out: dict = {}
    for state in saved_states(checkpoint, "ema"):
        out.update(state["tensors"])
    return out
