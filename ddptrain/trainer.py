"""The Trainer: one DDP training loop you can read top to bottom.

Launch the same script any of these ways, with no code change::

    python train.py --config cfg.yaml                                 # one process (CPU or 1 GPU)
    torchrun --nproc_per_node=4 train.py --config cfg.yaml            # one node, 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
             --rdzv_endpoint=HOST:29500 train.py --config cfg.yaml     # two nodes

The loss contract (see docs/design.md): ``loss_fn(model, batch) -> (loss_sum, num_units)``. The
loss is a *sum* over units (frames, tokens, utterances); the Trainer divides the gradient by the
global unit count of the whole optimizer step (all micro-batches, all ranks), so 1 GPU with
accumulation 4 and 4 GPUs without accumulation produce the same update.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ddptrain import checkpoint as ckpt
from ddptrain import cuda_graphs, dist, ema, preflight, regression, resume, runfolder, weights
from ddptrain.config import Config, ConfigError, check_config, to_yaml
from ddptrain.contract import batch_ids, check_loss_output, is_empty, to_device
from ddptrain.guard import StepGuard
from ddptrain.logging import RunLogger, data_scalars
from ddptrain.metrics import reduce_ratios
from ddptrain.optim import apply_hparams, build_scheduler
from ddptrain.prepare import prepare_model, prepare_step
from ddptrain.process import PreemptionFlag, StepPacedGC, budget_cpu_threads, prepare_loader_workers
from ddptrain.progress import LoaderPosition, RNGStreams, SamplerPosition, TrainingProgress
from ddptrain.steps import StepStream, StepSums, forward_backward, stateful_sampler
from ddptrain.throughput import FlopsFn, ThroughputWindow

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Any]]
MetricsFn = Callable[[nn.Module, Any], dict]  # name -> (numerator, denominator), summed over batches/ranks


class Trainer:
    """Trains any ``nn.Module`` with DDP, AMP, accumulation, clipping and checkpoint/resume.

    Args:
        model: the model (built by the user; moved to the device and wrapped in DDP here).
        loss_fn: ``(model, batch) -> (loss_sum, num_units)``; called under autocast.
        config: a :class:`ddptrain.Config` (or a subclass with extra sections).
        train_data: a DataLoader (or any re-iterable with ``len``). If its ``batch_sampler``
            has ``set_epoch/state_dict/load_state_dict`` (e.g. ``DurationBucketSampler``), a
            mid-epoch resume is O(1) and may change the number of processes; otherwise consumed
            batches are skipped by iterating. A ``dataset`` with ``set_epoch`` is told the epoch.
        eval_data: optional evaluation loader (each rank evaluates its own shard).
        metrics_fn: optional ``(model, batch) -> {name: (numerator, denominator)}`` for eval
            metrics such as WER = (word errors, reference words).
        flops_fn: optional ``(batch) -> float``: model FLOPs of the forward + backward of one
            micro-batch, called on its host copy; the log then shows ``tflops_per_gpu`` and
            ``mfu`` (ddptrain/throughput.py; the recipes' helpers: examples/models/train_flops.py).

    The run folder (``trainer.output_dir``) is held from here to the end of :meth:`fit` (see
    ddptrain/runfolder.py); the logger stays open for evaluations after ``fit`` until
    :meth:`close` (or the end of a ``with Trainer(...) as trainer:`` block).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, config: Config, train_data: Iterable,
                 eval_data: Optional[Iterable] = None, metrics_fn: Optional[MetricsFn] = None,
                 flops_fn: Optional[FlopsFn] = None):
        config = check_config(config)  # a Config built in Python gets load_config's checks too
        self.cfg, self.loss_fn, self.metrics_fn = config, loss_fn, metrics_fn
        self.train_data, self.eval_data = train_data, eval_data
        t = config.trainer
        self.info = dist.setup_for(config)
        self.device = self.info.device
        torch.manual_seed(t.seed + self.info.rank)  # dropout differs per rank; DDP syncs the init
        torch.use_deterministic_algorithms(t.deterministic)
        self.progress = TrainingProgress()
        self.rng = RNGStreams(t.seed, self.info.rank)
        self._lock: Optional[runfolder.FolderLock] = None
        self.logger: Optional[RunLogger] = None
        try:
            self.ckpt_root = ckpt.checkpoint_root(t.output_dir)
            self._folders = resume.fingerprints(config)  # the recipe's model folders, saved with each checkpoint
            self._lock, resume_from, self.progress.run_id = runfolder.open_run(config, self.info.is_main, self.device)
            self._setup_model(model)
            self._setup_optimizer()
            self._setup_data()
            changed = self._resume(resume_from) if resume_from else {}
            self.gate = regression.gate_for(config, self.eval_data, self.progress.step, self.info.is_main)
            window = ThroughputWindow.for_run(config, self.info, flops_fn, self.allreduce_timer)
            self.logger = RunLogger(t.output_dir, config.logging, self.info.is_main,
                                    self.total_steps, self.progress.step, window)
            self.guard.say = self.stream.say = self.logger.print
            if self.graphs is not None:
                self.graphs.say = self.logger.print
            dist.preflight(config.dist, self.info, self.logger, self.progress.step)  # a slow GPU link, named now
            if self.info.is_main:
                resume.record(t.output_dir, to_yaml(config), self.progress.step if resume_from else None, changed)
        except BaseException:
            self.close()
            raise
        self._last_saved_step = self.progress.step if resume_from else -1
        self._last_batch: Any = None  # host copy of the last non-empty batch (see train_step)

    # ------------------------------------------------------------------ set-up, in three steps

    def _setup_model(self, model: nn.Module) -> None:
        """Device, LoRA, recompute, compile, master weights, DDP (ddptrain/prepare.py; the tuner's too)."""
        cfg, info = self.cfg, self.info
        # logging.allreduce_share: how long each rank waits for DDP's gradient all-reduce
        m = self.prepared = prepare_model(model, cfg, info, time_allreduce=cfg.logging.allreduce_share)
        self.allreduce_timer = m.allreduce_timer
        self.module, self.model, self.backend, self.streamed = m.module, m.model, m.backend, m.streamed
        self.adapted, self.recomputed, self.compiled = m.adapted, m.recomputed, m.compiled
        self.activation_offload = m.activation_offload

    def _setup_optimizer(self) -> None:
        """Optimizer (built by the backend), precision policy, the update, the EMA, CUDA graphs."""
        s = self.one_step = prepare_step(self.prepared, self.loss_fn, self.cfg, self.info)  # all preflight sees
        self.optimizer, self.precision, self.update = s.optimizer, s.precision, s.update
        self.guard = StepGuard(self.cfg.trainer, self.precision, self.progress)  # prints through the logger, once made
        self.ema = ema.build(self.cfg.ema, self.module, self.backend.ema_follows(), self.device)  # ema.enabled, else None
        self.graphs = cuda_graphs.for_run(self.cfg, s, self.info.world_size)  # compile.cuda_graphs, else None

    def _setup_data(self) -> None:
        """Loader workers, run length and schedule horizon, signals, GC, CPU threads."""
        t = self.cfg.trainer
        if self.device.type == "cpu":
            budget_cpu_threads(self.train_data)
        for loader in (self.train_data, self.eval_data):
            prepare_loader_workers(loader, t.preempt_signals)
        if len(self.train_data) == 0:
            raise ValueError("train_data is empty on rank %d" % self.info.rank)
        if self.cfg.checkpoint.keep_best > 0 and self.eval_data is None:
            raise ConfigError("checkpoint.keep_best ranks checkpoints by an eval metric, and this run has no eval_data")
        lengths = getattr(stateful_sampler(self.train_data), "epoch_lengths", None)  # capped mixes shrink
        epochs = lengths(t.max_epochs) if lengths else [len(self.train_data)] * t.max_epochs
        self.total_steps = t.max_steps if t.max_steps > 0 else sum(math.ceil(n / t.grad_accum_steps) for n in epochs)
        self.progress.schedule_steps = self.total_steps
        self.scheduler = build_scheduler(self.optimizer, self.cfg.scheduler, self.total_steps)
        self.preemption = PreemptionFlag(t.preempt_signals)
        self.gc = StepPacedGC(t.gc_every_steps)  # collector pauses at the same steps on all ranks
        self.stream = StepStream(self.train_data, self.progress, self.rng, t, self.gc.full)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train until ``max_steps`` / ``max_epochs``; evaluate and checkpoint on schedule.

        Returns:
            The last evaluation metrics (empty if there is no eval data).

        Raises:
            SystemExit: with ``trainer.preempt_exit_code`` after a preemption signal and save.
            TrainingError: non-finite steps in a row, fp16 scale collapse, a broken loss_fn.
        """
        t, c, p = self.cfg.trainer, self.cfg.checkpoint, self.progress
        dist.follow_progress(p)  # this rank's heartbeat says its step; a timeout names the silent rank
        try:
            # trainer.preflight: an out-of-memory error now, not in hours
            preflight.before_fit(t.preflight, self.one_step, self.train_data, self.logger.print)
            if c.keep_best > 0 or self.gate is not None and self.gate.baseline is not None:
                self.evaluate(max_batches=1)  # an unknown best_metric or regression_metric fails now
            if self.gate is not None and self.gate.baseline is None:
                self.evaluate()  # eval.baseline=measure: the base model's metrics, before its first step
            self.preemption.install()  # signals only set a flag; ranks agree on it every step
            self.gc.start()
            self.logger.window.reset()  # the first logged rates count steps, not set-up
            self.model.train()  # train_step repeats it only after an evaluation
            for micro in self.stream:  # until trainer.max_steps / max_epochs
                out = self.train_step(micro)
                self.gc.step(p.step)
                self._log_step(out, micro)
                if self.eval_data is not None and t.eval_every > 0 and p.step % t.eval_every == 0:
                    self.evaluate()
                    self.gc.full()
                if out["stop"]:  # decided from values every rank shares: all ranks stop here
                    self._stop(out["stop"])
                if c.every_steps > 0 and p.step % c.every_steps == 0:
                    if c.keep_best > 0 and p.last_eval_step != p.step:
                        self.evaluate()  # keep_best ranks checkpoints by their metrics: each needs one
                    self.save()
                    self.gc.full()
            if self.eval_data is not None and p.last_eval_step != p.step:
                self.evaluate()
            if c.save_at_end and self._last_saved_step != p.step:
                self.save()
            return p.last_eval
        except RuntimeError as e:
            stalled = dist.peer_timeout(e)  # a collective timed out: name the rank that stopped answering
            if stalled is None:
                raise
            raise stalled from e
        finally:
            dist.follow_progress(None)  # no step to watch outside fit (a rank-0-only export after it)
            self.gc.stop()
            self.logger.flush()
            self._release_folder()
            self.stream.stop_workers()
            self.preemption.restore()  # last: it may hand a signal to the host's handler, which may raise

    def train_step(self, micro_batches: list) -> dict:
        """One optimizer step over this rank's micro-batches; collective with all ranks."""
        p = self.progress
        if not (self.model.training and self.module.training):
            self.model.train()  # after an evaluation; a walk over every module costs ms a step
        sums = StepSums(self.device)
        for i, batch in enumerate(micro_batches):
            weight = 1.0
            if is_empty(batch):  # every utterance in it was skipped as bad data
                # DDP needs this rank's forward/backward to line up with the others: replay the
                # last real batch with weight 0 (zero gradient, zero units) instead of skipping
                if self._last_batch is None:
                    raise RuntimeError(f"rank {self.info.rank}, step {p.step + 1}: the first batch "
                                       "is empty (all its utterances were skipped as bad data)")
                batch, weight = self._last_batch, 0.0
            else:
                self._last_batch = batch
            # all-reduce the gradients only on the last micro-batch: earlier ones just accumulate
            last = i == len(micro_batches) - 1
            sync = last or not self.info.distributed
            self.update.before_backward(last)
            if self.graphs is not None:  # compile.cuda_graphs: one process, a graph per batch shape
                self.graphs(batch, self._where(i), sums, p.unit_scale, weight)
                continue
            with (contextlib.nullcontext() if sync else self.model.no_sync()):
                forward_backward(self.model, self.loss_fn, self.precision, to_device(batch, self.device),
                                 self._where(i), sums, p.unit_scale, weight)
        out = self.update(*sums.totals(), self.preemption.requested, p.unit_scale)
        if out["stepped"]:
            self.scheduler.step()  # the schedule only advances with real updates
            if self.ema is not None:
                self.ema.step()  # and so does the EMA (every ema.every_steps of them)
        p.step += 1
        p.batches_done += len(micro_batches)
        if out["units"] > 0:
            p.unit_scale = self.info.world_size * len(micro_batches) / out["units"]
        ids = "" if math.isfinite(out["loss_sum"] + out["grad_norm"]) else "".join(map(batch_ids, micro_batches))
        verdict = self.guard.judge(out["stepped"], out["loss_sum"], out["units"], out["grad_norm"], out["negative"], ids)
        out["stop"] = verdict or ("preempt" if out["preempt"] else None)
        return out

    def _stop(self, reason: str) -> None:
        """Save what is worth saving, then leave ``fit`` the way ``reason`` asks."""
        if reason == "preempt":
            self.logger.print(f"preemption signal: saving at step {self.progress.step} and exiting")
            self.preemption.acknowledge()  # the SystemExit below is this signal's ending
            self.save()
            raise SystemExit(self.cfg.trainer.preempt_exit_code)
        # after non-finite steps the parameters are untouched: the last good state
        raise self.guard.error(reason, self.save() if reason == "nonfinite" else None)

    @torch.no_grad()
    def evaluate(self, data: Optional[Iterable] = None, prefix: str = "eval", max_batches: int = 0,
                 name: str = "") -> dict:
        """Loss per unit and user metrics over a whole data set, reduced as sums over ranks.

        Uses the unwrapped module: DDP's forward may run collectives (buffer broadcast), and
        ranks may hold different numbers of eval batches (even none). With ``ema.enabled`` it
        scores the EMA weights (``ema.evaluate``; ddptrain/ema.py), the trained ones put back after.

        Args:
            data: defaults to the Trainer's ``eval_data`` (whose result feeds keep-best-k);
                pass another loader to score, say, a test set, logged under ``prefix``.
            max_batches: > 0: a probe of that many batches per rank, neither logged nor kept.
            name: which data set ``data`` is (a test manifest), logged with the result.

        Raises:
            ConfigError: ``checkpoint.keep_best`` ranks by a metric this evaluation does not produce.
        """
        own, p = data is None, self.progress
        self.module.eval()
        sums: dict[str, list[float]] = {"loss": [0.0, 0.0]}
        with torch.random.fork_rng(devices=[]):  # making an iterator draws a seed: keep training's RNG
            batches = iter(self.eval_data if own else data)
        averaged = self.ema is not None and self.cfg.ema.evaluate
        if averaged:
            self.ema.swap_in()  # evaluate the EMA weights; the trained ones come back in `finally`
        try:
            for i, batch in enumerate(batches):
                if max_batches and i >= max_batches:
                    break
                if is_empty(batch):
                    continue  # an empty filler batch (a rank with fewer utterances than others)
                batch = to_device(batch, self.device)
                with self.precision.autocast():
                    loss_sum, units = check_loss_output(self.loss_fn(self.module, batch),
                                                        f"rank {self.info.rank}, evaluation batch {i}", host=True)
                    extra = self.metrics_fn(self.module, batch) if self.metrics_fn else {}
                for k, (num, den) in [("loss", (loss_sum, units)), *extra.items()]:
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] += float(num)
                    acc[1] += float(den)
        finally:
            batches = None  # shut workers down now, even on an exception (see _steps)
            if averaged:
                self.ema.swap_out()
        result = reduce_ratios(sums, self.device)
        c = self.cfg.checkpoint
        # a probe's batches need not hold every eval source: a per-source name counts if its source exists
        sources = regression.eval_sources(self.cfg, self.eval_data if own else data)
        result.update(regression.source_means(result, sources))  # <metric>/mean: keep-best over all sources
        if own and self.gate is not None and not self.gate.checked:
            self.gate.check_metric(result, sources)  # before the base is kept: a typo checks nothing
        if own and not max_batches and self.gate is not None:
            result.update(self.gate.review(result, p.step, sources, self.logger.print))
        if own and c.keep_best > 0 and not ckpt.produces(result, c.best_metric, sources if max_batches else ()):
            raise ConfigError(f"checkpoint.best_metric={c.best_metric!r} is not a metric this run's evaluation "
                              f"produces ({', '.join(result)}); checkpoint.keep_best needs one of them")
        if own and not max_batches:
            p.last_eval, p.last_eval_step = result, p.step
        if not max_batches:
            self.logger.log(p.step, result, prefix=prefix, name=name)
        return result

    # ------------------------------------------------------------------ checkpointing

    def _states(self) -> tuple[dict, dict]:
        """The stateful objects a checkpoint holds: shared by all ranks, and per rank."""
        sampler = stateful_sampler(self.train_data)
        shared = {"scheduler": self.scheduler, "precision": self.precision, "progress": self.progress}
        per_rank = {"rng": self.rng, "sampler": SamplerPosition(sampler, self.progress) if sampler
                    else LoaderPosition(self.progress)}
        mine, theirs = self.backend.states()  # the optimizer: saved once, or each rank its shard
        shared.update(mine)
        per_rank.update(theirs)
        if self.ema is not None:  # sharded as the optimizer is
            (per_rank if self.ema.sharded else shared)["ema"] = self.ema
        return shared, per_rank

    def save(self) -> str:
        """Collective save of the complete training state (see ddptrain/checkpoint.py)."""
        c, p = self.cfg.checkpoint, self.progress
        metrics = p.last_eval if p.last_eval_step == p.step else {}
        meta = {"epoch": p.epoch, "zero": self.cfg.optim.zero and self.info.world_size > 1, "run_id": p.run_id,
                "metrics": {k: v for k, v in metrics.items() if math.isfinite(v)}}
        if self.ema is not None:
            meta["ema"] = self.ema.meta()  # whether the metrics measured the EMA (exports follow that)
        tensors, header = weights.weights_to_save(self.module, self.backend.weights(self.module), c.trainable_only,
                                                  c.base_model)
        files = {weights.WEIGHTS: lambda path: weights.save_weights(tensors, path, header),
                 "config.yaml": to_yaml(self.cfg)}
        if self._folders:  # a resume may then name the same folder at another path
            files[resume.FOLDERS_FILE] = json.dumps(self._folders)
        path = ckpt.save(self.ckpt_root, p.step, *self._states(), meta, self.device, files=files)
        self._last_saved_step = p.step
        if self.info.is_main:
            ckpt.prune(self.ckpt_root, c.keep_last, c.keep_best, c.best_metric, c.best_mode, p.run_id)
            self.logger.print(f"saved {path}")
        dist.barrier()
        return path

    def _resume(self, path: str) -> dict:
        """Load the checkpoint at ``path``; apply and return the config keys that changed."""
        p, run_id = self.progress, self.progress.run_id
        try:
            with open(os.path.join(path, "config.yaml")) as f:
                diff = resume.changes(f.read(), self.cfg)
        except FileNotFoundError:
            diff = {}
        moved = resume.same_folders(diff, resume.saved_folders(path), self._folders)
        resume.check(diff, path, resume.refused_keys(self.cfg), moved)
        shared, per_rank = self._states()
        saved_ema = ckpt.read_meta(path).get("ema")
        fresh = self.ema is not None and saved_ema is None  # ema.enabled since this checkpoint
        if self.ema is None and saved_ema is not None and self.info.is_main:
            # said now: this run's checkpoints hold no EMA, and pruning later deletes the ones that do
            print(f"WARNING: {path} holds an EMA of the weights ({saved_ema.get('updates', '?')} updates) and "
                  "ema.enabled=false: this run drops it (its checkpoints hold no EMA, and checkpoint.keep_last / "
                  "keep_best pruning deletes the older ones that do). To keep it, resume with ema.enabled=true, or "
                  f"copy it out first: ddptrain-weights export {path} OUT --weights ema")
        for states in (shared, per_rank) if fresh else ():
            states.pop("ema", None)  # nothing saved to load into it
        meta = ckpt.load(path, shared, per_rank, self.info.world_size, self.info.rank)
        source, saved = weights.read_weights(path)
        weights.apply_weights(self.module, source, saved, strict=True, expect=weights.resume_keys(self.module, source))
        self.backend.load_weights(saved, self.module)  # the fp32 masters from the weights file, if any
        if fresh:
            self.ema.reset()  # it starts from the resumed weights
            if self.info.is_main:
                print(f"{path} holds no EMA (ema.enabled was off): the EMA starts from its weights")
        p.run_id = run_id  # a resume into another folder is a new run there
        apply_hparams(self.optimizer, self.scheduler, self.cfg.optim, self.cfg.scheduler, p.schedule_steps)
        if self.info.is_main:
            moved = f", resharded from {meta['world_size']} to {self.info.world_size} processes (RNG reseeded " \
                    "from seed, step and rank)" if meta["world_size"] != self.info.world_size else ""
            print(f"resumed from {path} at step {p.step} (epoch {p.epoch}, batch {p.batches_done}){moved}")
        return diff

    def _release_folder(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def close(self) -> None:
        """Flush and close the logs and release the run folder (also at the end of a ``with``)."""
        if self.logger is not None:
            self.logger.close()
        self._release_folder()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    step = property(lambda self: self.progress.step, doc="optimizer steps taken (see also .progress)")
    skipped_steps = property(lambda self: self.progress.skipped_steps)
    skip_on_device = property(lambda self: self.update.on_device, doc="non-finite steps are skipped on the device")

    def _where(self, micro: int) -> str:
        return f"rank {self.info.rank}, step {self.progress.step + 1}, micro-batch {micro}"

    def _log_step(self, out: dict, micro: list) -> None:
        p = self.progress
        self.logger.step_done(p.step, out["loss_sum"], out["units"], self.stream.wait_s, p.step == self.total_steps,
                              lambda: {"lr": self.optimizer.param_groups[0]["lr"], "grad_norm": out["grad_norm"],
                                       "loss_scale": self.precision.loss_scale(), "skipped_steps": p.skipped_steps,
                                       "epoch": p.epoch, **self.prepared.fallbacks.scalars(self.logger.print),
                                       **(self.graphs.scalars() if self.graphs is not None else {}),
                                       **data_scalars(stateful_sampler(self.train_data), self.device)}, batches=micro)
