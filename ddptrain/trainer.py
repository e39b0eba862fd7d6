"""The Trainer: one DDP training loop you can read top to bottom.

Launch the same script any of these ways, with no code change::

    python train.py --config cfg.yaml                                 # one process (CPU or 1 GPU)
    torchrun --nproc_per_node=4 train.py --config cfg.yaml            # one node, 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
             --rdzv_endpoint=HOST:29500 train.py --config cfg.yaml     # two nodes

The loss contract (see DESIGN.md): ``loss_fn(model, batch) -> (loss_sum, num_units)``. The
loss is a *sum* over units (frames, tokens, utterances); the Trainer divides the gradient by the
global unit count of the whole optimizer step (all micro-batches, all ranks), so 1 GPU with
accumulation 4 and 4 GPUs without accumulation produce the same update.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from ddptrain import checkpoint as ckpt
from ddptrain import dist
from ddptrain.compile import apply_compile, compile_whole
from ddptrain.config import Config, to_yaml
from ddptrain.logging import RunLogger
from ddptrain.optim import build_optimizer, build_scheduler, is_zero, skips_on_device, step_unless
from ddptrain.precision import MasterWeights, Precision
from ddptrain.process import PreemptionFlag, StepPacedGC, budget_cpu_threads, prepare_loader_workers

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Any]]
MetricsFn = Callable[[nn.Module, Any], dict]  # name -> (numerator, denominator), summed over batches/ranks


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite losses, loss-scale collapse, ...)."""


class Trainer:
    """Trains any ``nn.Module`` with DDP, AMP, accumulation, clipping and checkpoint/resume.

    Args:
        model: the model (built by the user; moved to the device and wrapped in DDP here).
        loss_fn: ``(model, batch) -> (loss_sum, num_units)``; called under autocast.
        config: a :class:`ddptrain.Config` (or a subclass with extra sections).
        train_data: a DataLoader (or any re-iterable with ``len``). If its ``batch_sampler``
            has ``set_epoch/state_dict/load_state_dict`` (e.g. ``DurationBucketSampler``), a
            mid-epoch resume is O(1); otherwise consumed batches are skipped by iterating.
        eval_data: optional evaluation loader (each rank evaluates its own shard).
        metrics_fn: optional ``(model, batch) -> {name: (numerator, denominator)}`` for eval
            metrics such as WER = (word errors, reference words).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, config: Config, train_data: Iterable,
                 eval_data: Optional[Iterable] = None, metrics_fn: Optional[MetricsFn] = None):
        self.cfg, self.loss_fn, self.metrics_fn = config, loss_fn, metrics_fn
        self.train_data, self.eval_data = train_data, eval_data
        t = config.trainer
        self.info = dist.setup(config.dist.backend, config.dist.timeout_s, t.device)
        self.device = self.info.device
        torch.manual_seed(t.seed + self.info.rank)  # dropout differs per rank; DDP syncs the init
        if self.device.type == "cpu":
            budget_cpu_threads(train_data)
        torch.use_deterministic_algorithms(t.deterministic)

        self.ckpt_root = ckpt.checkpoint_root(t.output_dir)
        error = None
        try:  # every rank checks: on several nodes each writes its own rank files
            ckpt.check_writable(self.ckpt_root, config.checkpoint.min_free_gb)
        except ckpt.CheckpointError as e:
            error = e
        if dist.any_rank(error is not None, self.device):
            raise error or ckpt.CheckpointError(f"another rank cannot write to {self.ckpt_root}")

        model = model.to(self.device)
        self.recomputed: list[str] = []
        if config.recompute.enabled:
            from ddptrain.recompute import apply_recompute

            self.recomputed = apply_recompute(model, config.recompute)
        self.compiled = apply_compile(model, config.compile)  # regional: selected blocks only
        self.master: Optional[MasterWeights] = None
        if str(t.param_dtype).lower() == "bf16":  # bf16 model, fp32 masters in the optimizer
            if self.info.distributed:
                dist.broadcast_module(model)  # the masters are made here: same start on every rank
            self.master = MasterWeights(model, torch.bfloat16)
        self.module = model
        self.model = dist.wrap_ddp(model, config.dist, self.device) if self.info.distributed else model
        if config.compile.enabled and not self.compiled:  # whole model, after DDP: dynamo then
            # splits the graph at DDP's bucket boundaries so gradient all-reduce still overlaps
            self.model = compile_whole(self.model, config.compile,
                                       config.dist.bucket_cap_mb if self.info.distributed else None)
            if self.recomputed:
                warnings.warn(f"compile.enabled with recompute: the {len(self.recomputed)} checkpointed modules "
                              "run eagerly inside the compiled model; list their classes in "
                              "compile.module_classes to compile them too", stacklevel=2)
        self.optimizer = build_optimizer(model, config.optim, self.device,
                                         self.master.to_master if self.master else None)
        # the tensors whose gradients backward fills (the model's; with masters they are bf16)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._owned = ({id(p) for g in self.optimizer.optim.param_groups for p in g["params"]}
                       if is_zero(self.optimizer) else None)  # the masters this rank updates
        self.precision = Precision(t.precision, self.device, t.fp16_init_scale)
        # A fused optimizer can skip a non-finite step on the device (see train_step); fp16 keeps
        # GradScaler's own skip, other optimizers a decision on the host.
        self.skip_on_device = t.precision != "fp16" and skips_on_device(self.optimizer)

        for loader in (train_data, eval_data):
            prepare_loader_workers(loader, t.preempt_signals)
        self.batches_per_epoch = len(train_data)
        if self.batches_per_epoch == 0:
            raise ValueError("train_data is empty on rank %d" % self.info.rank)
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / t.grad_accum_steps)
        self.total_steps = t.max_steps if t.max_steps > 0 else t.max_epochs * self.steps_per_epoch
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, self.total_steps)

        self.step = 0  # optimizer steps attempted (skipped ones included: their data is consumed)
        self.epoch = 0
        self.batches_done = 0  # batches of the current epoch consumed, for mid-epoch resume
        self.unit_scale = 1.0  # loss pre-scale (1 / units per micro-batch last step): keeps fp16 in range
        self.nonfinite_in_row = 0
        self.skipped_steps = 0
        self.last_eval: dict = {}
        self.last_eval_step: Optional[int] = None
        self.preemption = PreemptionFlag(t.preempt_signals)
        self.gc = StepPacedGC(t.gc_every_steps)  # collector pauses at the same steps on all ranks
        self._last_saved_step = -1
        self._resume_rng: Optional[dict] = None
        self._last_batch: Any = None  # host copy of the last non-empty batch (see train_step)
        self._resume()
        self.logger = RunLogger(t.output_dir, config.logging, self.info.is_main, self.total_steps, self.step)
        if self.info.is_main:
            with open(os.path.join(t.output_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(config))

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train until ``max_steps`` / ``max_epochs``; evaluate and checkpoint on schedule.

        Returns:
            The last evaluation metrics (empty if there is no eval data).

        Raises:
            SystemExit: with ``trainer.preempt_exit_code`` after a preemption signal and save.
        """
        t, c = self.cfg.trainer, self.cfg.checkpoint
        window = {"loss": 0.0, "units": 0.0, "time": time.perf_counter(), "wait": 0.0, "steps": 0}
        batches = None
        preempted = False
        try:
            self.preemption.install()  # signals only set a flag; ranks agree on it every step
            self.gc.start()
            while self.step < self.total_steps:
                batches = self._epoch_iterator()
                epoch_ended = False
                while self.step < self.total_steps:
                    tic = time.perf_counter()
                    micro = [b for _, b in zip(range(t.grad_accum_steps), batches)]
                    window["wait"] += time.perf_counter() - tic  # time the loop waited for data
                    if not micro:
                        epoch_ended = True
                        break
                    out = self.train_step(micro)
                    self.step += 1
                    self.batches_done += len(micro)
                    self.gc.step(self.step)
                    window["loss"] += out["loss_sum"]
                    window["units"] += out["units"]
                    window["steps"] += 1
                    self.logger.advance(1, {"loss": out["loss_sum"] / max(out["units"], 1e-9)})

                    if self.step % self.cfg.logging.log_every == 0 or self.step == self.total_steps:
                        self._log_train(window, out)
                    if self.eval_data is not None and t.eval_every > 0 and self.step % t.eval_every == 0:
                        self.evaluate()
                        self.gc.full()
                    if out["preempt"]:  # agreed by all ranks inside train_step's all-reduce
                        preempted = True
                        break
                    if c.every_steps > 0 and self.step % c.every_steps == 0:
                        self.save()
                        self.gc.full()
                if preempted:
                    break
                if epoch_ended or self.batches_done >= self.batches_per_epoch:
                    self.epoch, self.batches_done = self.epoch + 1, 0
                    self.gc.full()
            if preempted:
                self.logger.print(f"preemption signal: saving at step {self.step} and exiting")
                self.save()
                raise SystemExit(t.preempt_exit_code)
            if self.eval_data is not None and (t.eval_every <= 0 or self.step % t.eval_every != 0):
                self.evaluate()
            if c.save_at_end and self._last_saved_step != self.step:
                self.save()
            return self.last_eval
        finally:
            # Drop the DataLoader iterator now, so its workers shut down cleanly even when an
            # exception (whose traceback keeps this frame alive) is on its way out of the process.
            batches = None  # noqa: F841
            self.preemption.restore()
            self.gc.stop()
            self.logger.close()

    def train_step(self, micro_batches: list) -> dict:
        """One optimizer step over this rank's micro-batches; collective with all ranks."""
        self.model.train()
        loss_acc = torch.zeros((), dtype=torch.float64, device=self.device)
        units_acc = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro_batches):
            weight = 1.0
            if _is_empty(batch):  # every utterance in it was skipped as bad data
                # DDP needs this rank's forward/backward to line up with the others: replay the
                # last real batch with weight 0 (zero gradient, zero units) instead of skipping
                if self._last_batch is None:
                    raise RuntimeError(f"rank {self.info.rank}, step {self.step + 1}: the first batch "
                                       "is empty (all its utterances were skipped as bad data)")
                batch, weight = self._last_batch, 0.0
            else:
                self._last_batch = batch
            batch = _to_device(batch, self.device)
            # all-reduce the gradients only on the last micro-batch: earlier ones just accumulate
            sync = i == len(micro_batches) - 1 or not self.info.distributed
            with (contextlib.nullcontext() if sync else self.model.no_sync()):
                try:
                    with self.precision.autocast():
                        loss_sum, units = self.loss_fn(self.model, batch)
                    if weight == 0.0:
                        loss_sum, units = loss_sum * 0.0, 0
                    self.precision.scale(loss_sum.float() * self.unit_scale).backward()
                except Exception as e:
                    raise RuntimeError(f"rank {self.info.rank}, step {self.step + 1}, micro-batch {i}: "
                                       f"{type(e).__name__}: {e}{_batch_ids(batch)}") from e
            loss_acc += loss_sum.detach().double()
            units_acc += torch.as_tensor(units, device=self.device).double()

        # DDP has all-reduced the gradients, so every rank holds the same ones and the same norm.
        self.precision.unscale_(self.optimizer)  # fp16: true (unscaled) gradients from here on
        grads = [p.grad for p in self.params if p.grad is not None]
        raw_norm = (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))).double()
                    if grads else torch.zeros((), dtype=torch.float64, device=self.device))
        # One small all-reduce and one host read per step (report.tolist() below): global loss
        # sum, global unit count, the preemption flag, and the (identical on every rank) gradient
        # norm. torch.full, not torch.tensor: a copy from a host scalar would block the host until
        # the backward has finished (a second sync per step, seen on a GPU).
        stop = torch.full((), float(self.preemption.requested), dtype=torch.float64, device=self.device)
        flags = torch.stack([loss_acc, units_acc, stop, raw_norm.to(self.device)])
        if self.info.distributed:
            torch.distributed.all_reduce(flags)
        loss_t, units_t, stop_t, norm_sum = flags.unbind()

        # DDP averaged the per-rank gradients of (unit_scale * loss_sum); the true gradient of the
        # step is sum_over_ranks(grad of loss_sum) / global_units. On the device, so that a fused
        # optimizer can be queued before the host has read any of it.
        factor = self.info.world_size / (units_t.clamp_min(1e-12) * self.unit_scale)
        norm_t = norm_sum / self.info.world_size * factor
        finite_t = torch.isfinite(norm_t) & torch.isfinite(loss_t) & (units_t > 0)
        clip = self.cfg.trainer.clip_grad_norm
        if clip > 0:
            factor = factor * torch.where(norm_t > clip, clip / (norm_t + 1e-6), 1.0)
        report = torch.stack([loss_t, units_t, stop_t, norm_t, finite_t.double(), factor])
        if self.skip_on_device:
            # Why: deciding on the host means reading the report before the optimizer step, and
            # the GPU then idles while the host launches it (Conformer 110M on an H200: 91-95% of
            # the bare loop's throughput before, 96-97% after; BENCHMARKS.md, fifth pass).
            self._scale_grads(grads, factor.float())
            step_unless(self.optimizer, found_inf=(~finite_t).float())
            if self.master:
                self.master.copy_to_model()  # after a skip the masters are unchanged: a no-op copy
            loss_sum, units, preempt, norm, finite, _ = report.tolist()
            stepped = finite > 0
        else:
            loss_sum, units, preempt, norm, finite, factor = report.tolist()
            stepped = False
            if finite > 0:
                self._scale_grads(grads, factor)
                stepped = self.precision.step(self.optimizer)  # fp16: False if the scaler skipped it
                if stepped and self.master:
                    self.master.copy_to_model()
            else:
                self.precision.skip()  # fp16: the scaler lowers its scale after an overflow
        if stepped:
            self.scheduler.step()  # the schedule only advances with real updates
        self.optimizer.zero_grad(set_to_none=True)
        if self.master:
            self.master.zero_model_grads()
        self._check_nonfinite(norm, stepped, loss_sum, micro_batches)
        if units > 0:
            self.unit_scale = self.info.world_size * len(micro_batches) / units
        return {"loss_sum": loss_sum, "units": units, "grad_norm": norm, "stepped": stepped,
                "preempt": preempt > 0}

    def _scale_grads(self, grads: list, factor) -> None:
        """Gradients (a float or a 0-d device tensor) x ``factor``; with masters, into their fp32
        gradients (only this rank's shard under ZeRO)."""
        if not grads:
            return
        if self.master:
            self.master.load_grads(factor, self._owned)
        else:
            torch._foreach_mul_(grads, factor)

    @torch.no_grad()
    def evaluate(self, data: Optional[Iterable] = None, prefix: str = "eval") -> dict:
        """Loss per unit and user metrics over a whole data set, reduced as sums over ranks.

        Uses the unwrapped module: DDP's forward may run collectives (buffer broadcast), and
        ranks may hold different numbers of eval batches (even none).

        Args:
            data: defaults to the Trainer's ``eval_data`` (whose result feeds keep-best-k);
                pass another loader to score, say, a test set, logged under ``prefix``.
        """
        own = data is None
        self.module.eval()
        sums: dict[str, list[float]] = {"loss": [0.0, 0.0]}
        with torch.random.fork_rng(devices=[]):  # making an iterator draws a seed: keep training's RNG
            batches = iter(self.eval_data if own else data)
        try:
            for batch in batches:
                if _is_empty(batch):
                    continue  # an empty filler batch (a rank with fewer utterances than others)
                batch = _to_device(batch, self.device)
                with self.precision.autocast():
                    loss_sum, units = self.loss_fn(self.module, batch)
                    extra = self.metrics_fn(self.module, batch) if self.metrics_fn else {}
                sums["loss"][0] += float(loss_sum)
                sums["loss"][1] += float(units)
                for k, (num, den) in extra.items():
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] += float(num)
                    acc[1] += float(den)
        finally:
            batches = None  # shut workers down now, even on an exception (see fit)
        # the same names in the same order on every rank, even one that had no eval batches
        names = sorted(set().union(*dist.all_gather_object(sorted(sums))))
        flat = dist.all_reduce_sum([v for k in names for v in sums.get(k, [0.0, 0.0])], self.device)
        result = {k: flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else float("nan")
                  for i, k in enumerate(names)}
        if own:
            self.last_eval, self.last_eval_step = result, self.step
        self.logger.log(self.step, result, prefix=prefix)
        return result

    # ------------------------------------------------------------------ checkpointing

    def save(self) -> str:
        """Collective save of the complete training state (see :func:`ddptrain.checkpoint.save_trainer_state`)."""
        c = self.cfg.checkpoint
        path = ckpt.save_trainer_state(self)
        self._last_saved_step = self.step
        if self.info.is_main:
            ckpt.prune(self.ckpt_root, c.keep_last, c.keep_best, c.best_metric, c.best_mode)
            self.logger.print(f"saved {path}")
        dist.barrier()
        return path

    def _resume(self) -> None:
        want = self.cfg.checkpoint.resume
        if want in ("", "none"):
            return
        path = dist.broadcast_object(ckpt.find_latest(self.ckpt_root) if want == "auto" else want)
        if path is None:
            return  # resume: auto on a fresh run folder starts from scratch
        ckpt.restore_trainer_state(self, path)
        if self.info.is_main:
            print(f"resumed from {path} at step {self.step} (epoch {self.epoch}, batch {self.batches_done})")

    # ------------------------------------------------------------------ helpers

    def _stateful_sampler(self):
        bs = getattr(self.train_data, "batch_sampler", None)
        if bs is not None and all(hasattr(bs, m) for m in ("state_dict", "load_state_dict", "set_epoch")):
            return bs
        return None

    def _epoch_iterator(self) -> Iterator:
        """This epoch's batches, starting after the ones already consumed (on resume).

        Creating a DataLoader iterator draws a worker seed from the global torch RNG. It is done
        inside ``fork_rng`` so it does not move the RNG that dropout uses: then a run resumed
        from a checkpoint sees exactly the random stream of the uninterrupted run, whether the
        checkpoint was taken mid-epoch or at an epoch boundary.
        """
        if self._resume_rng is not None:
            ckpt.set_rng_state(self._resume_rng)
            self._resume_rng = None
        sampler = self._stateful_sampler()
        plain = getattr(self.train_data, "sampler", None)
        if sampler is not None and self.batches_done == 0:
            sampler.set_epoch(self.epoch)  # a resumed stateful sampler starts at its saved position
        elif sampler is None and hasattr(plain, "set_epoch"):
            plain.set_epoch(self.epoch)
        if hasattr(getattr(self.train_data, "dataset", None), "set_epoch"):
            self.train_data.dataset.set_epoch(self.epoch)  # augmentation draws from (seed, epoch, index)
        self.batches_per_epoch = len(self.train_data)
        with torch.random.fork_rng(devices=[]):
            it = iter(self.train_data)
            if sampler is None:
                for _ in range(self.batches_done):  # generic loaders: skip what was consumed (O(k))
                    next(it)
        return it

    def _check_nonfinite(self, norm: float, stepped: bool, loss_sum: float, micro_batches: list) -> None:
        """Count skipped steps; abort on N non-finite steps in a row or on fp16 scale collapse.

        Under fp16 an overflowed *gradient* is routine (the scaler halves its scale and skips the
        step), so only a non-finite *loss* counts toward the abort; a scale that keeps falling is
        caught by ``fp16_min_scale`` instead.
        """
        t = self.cfg.trainer
        if not stepped:
            self.skipped_steps += 1
        bad = not math.isfinite(loss_sum) or (self.precision.mode != "fp16" and not math.isfinite(norm))
        if not bad:
            self.nonfinite_in_row = 0
        else:
            self.nonfinite_in_row += 1
            ids = "".join(_batch_ids(b) for b in micro_batches)
            self.logger.print(f"step {self.step + 1}: non-finite loss/gradient, step skipped on all ranks "
                              f"({self.nonfinite_in_row} in a row){ids}")
        if self.nonfinite_in_row >= t.max_nonfinite_steps:
            # every rank saw the same all-reduced values, so all of them arrive here together;
            # skipped steps left the parameters untouched: this is the last good state
            self.step += 1
            self.batches_done += len(micro_batches)
            self.save()
            raise TrainingError(f"{self.nonfinite_in_row} consecutive non-finite steps (limit "
                                f"trainer.max_nonfinite_steps={t.max_nonfinite_steps}) at step {self.step}; "
                                f"saved the last good state as: {ckpt.find_latest(self.ckpt_root)}")
        if self.precision.mode == "fp16" and self.precision.loss_scale() < t.fp16_min_scale:
            raise TrainingError(f"fp16 loss scale collapsed to {self.precision.loss_scale():.3g} (< "
                                f"trainer.fp16_min_scale={t.fp16_min_scale}) at step {self.step + 1}: the "
                                "gradients overflow even unscaled; try bf16 or a lower learning rate")

    def _log_train(self, window: dict, out: dict) -> None:
        now = time.perf_counter()
        elapsed = max(now - window["time"], 1e-9)
        scalars = {
            "loss": window["loss"] / max(window["units"], 1e-12),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": out["grad_norm"],
            "loss_scale": self.precision.loss_scale(),
            "steps_per_s": window["steps"] / elapsed,
            "units_per_s": window["units"] / elapsed,
            "data_wait_frac": window["wait"] / elapsed,
            "skipped_steps": self.skipped_steps,
            "epoch": self.epoch,
        }
        if self.device.type == "cuda":
            scalars["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        sampler = self._stateful_sampler()
        if sampler is not None and hasattr(sampler, "epoch_stats"):
            stats = sampler.epoch_stats()
            for k in ("padding_fraction", "batch_size_mean", "budget_fill", "step_balance"):
                if isinstance(stats.get(k), (int, float)):
                    scalars[f"data_{k}"] = stats[k]
        self.logger.log(self.step, scalars)
        window.update(loss=0.0, units=0.0, time=now, wait=0.0, steps=0)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not (batch and isinstance(batch[0], str)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _is_empty(batch: Any) -> bool:
    return isinstance(batch, dict) and "ids" in batch and len(batch["ids"]) == 0


def _batch_ids(batch: Any) -> str:
    ids = batch.get("ids") if isinstance(batch, dict) else None
    if not ids:
        return ""
    shown = list(ids[:10])
    return f" [utterances: {', '.join(map(str, shown))}{' ...' if len(ids) > 10 else ''}]"

