"""The training loops the benchmark compares, each timed the same way on the same workloads.

* ``ddptrain``: ``ddptrain.Trainer`` with the experiment's config overrides ``ov``.
* ``bare``: the plain DDP loop a careful user writes (autocast bf16, fused AdamW, clip 1.0,
  ``loss.item()`` every 10 steps, no other host sync), on the same batches as ddptrain.
* ``hf``: ``transformers.Trainer`` as its users run it (bf16, DDP through accelerate, its default
  fused AdamW, clip 1.0; ``hf_group``: ``group_by_length`` sampling for wav2vec2).
* ``hf_compile``: the same with ``torch_compile=True`` (the whole model through inductor), the
  HF Trainer's own fastest setting.
* ``hf_ds2``: the same with DeepSpeed ZeRO-2 (``deepspeed`` must be installed; it is not on the
  machines used so far, so this peer has not been run).

Every peer returns one row from ``measure.summarize``. ``hf``/``bare``/``ddptrain`` share the
workload code (``workloads.py``); the HF peers feed HF-style inputs (``input_values``,
``input_features``, ``labels``) built from the same synthetic datasets.
"""

from __future__ import annotations

import functools
import itertools
import time

import torch

import ddptrain
from ddptrain.optim import param_groups
from measure import (GcPauses, ReplayLoader, TimedLoader, TimedLoss, TimedSteps, graph_counts, mem_now, mem_peak,
                     mem_reset, summarize, sync, to_device, world)
from profiling import diagnose
from workloads import SR, StatsCollate, build, fhm, hf_cfg, make_loader


def run_ddptrain(workload, preset, exp, W, N, tmp) -> dict:
    """ddptrain.Trainer.fit() for ``W + N + 1`` steps; the row times steps ``W`` to ``W + N``."""
    rank, ws, local = world()
    name = exp["name"]
    ov = ["trainer.precision=bf16", "trainer.clip_grad_norm=1.0", f"trainer.max_steps={W + N + 1}",
          f"trainer.output_dir={tmp}/{name}", "checkpoint.save_at_end=false", "logging.tensorboard=false",
          "logging.progress_bar=false", "logging.log_every=100000", "optim.lr=1e-5",
          f"data.max_duration={exp.get('budget', 400)}", f"data.num_workers={exp.get('workers', 4)}",
          *exp.get("ov", [])]
    if exp.get("compile_backend"):
        ov.append(f"compile.backend={exp['compile_backend']}")
    cfg = ddptrain.load_config(None, ov, schema=fhm.FinetuneConfig)
    info = ddptrain.setup_distributed(cfg)
    model, loss_fn, flops = build(workload, preset, exp, info.device)
    # same_data (diagnostic): every rank trains on rank 0's batches, so no rank waits for a
    # slower one at the step's all-reduce because its batch happened to be costlier
    raw = make_loader(workload, preset, exp, model, flops, 0 if exp.get("same_data") else info.rank,
                      info.world_size, cfg.data)
    loader = ReplayLoader(raw, exp["replay"]) if exp.get("replay") else TimedLoader(raw)
    # a diagnostic steps again over the last timed batches (their shapes compiled already)
    diag = exp.get("profile") or exp.get("syncs") or exp.get("gaps")
    keep = exp.get("profile_steps", 3) + 1 if diag else 0
    # a replayed CUDA graph runs no loss_fn: time the Trainer's steps instead of the loss calls
    timed = TimedSteps(keep=keep) if cfg.compile.cuda_graphs else TimedLoss(loss_fn, keep=keep)
    mem_reset()
    trainer = ddptrain.Trainer(model, loss_fn if cfg.compile.cuda_graphs else timed, cfg, loader)
    if cfg.compile.cuda_graphs:
        timed.attach(trainer)
    if exp.get("nocomm") and ws > 1:
        ddp = getattr(trainer.model, "_orig_mod", trainer.model)  # under a whole-model compile
        ddp.register_comm_hook(state=None, hook=_no_allreduce)
    mem_init = mem_now()
    with GcPauses() as pauses:
        trainer.fit()
    sync()
    mem_rest = mem_now()
    peak = mem_peak()
    calls = timed.calls
    elapsed, stats, steps = timed.window(W, N)
    waits = sum(loader.waits[W + 1:W + N + 1])
    from ddptrain.memory import estimate_model_state

    est = estimate_model_state(trainer.module, cfg, ws)
    extra = {"mem_after_init_gb": mem_init / 1e9, "mem_at_rest_gb": mem_rest / 1e9,
             "recomputed_modules": len(trainer.recomputed), "compiled_modules": len(trainer.compiled),
             "estimate_gb": {k: round(v / 1e9, 3) for k, v in est.items() if not k.startswith("num_")},
             "num_params": est["num_params"], "num_trainable": est["num_trainable"],
             "ddp_wrapped": trainer.info.distributed, **pauses.summary(calls[W][0], calls[W + N][0]),
             **timed.sensors.summary(W, W + N), **graph_counts(trainer)}
    extra.update(diagnose(exp, lambda b: trainer.train_step([b]), itertools.cycle(list(timed.recent))))
    rec = summarize(exp, workload, ws, elapsed, stats, waits, steps,
                    {"peak_alloc_gb": peak["peak_alloc_gb"], "peak_reserved_gb": peak["peak_reserved_gb"]}, extra)
    del trainer, model, loader, timed
    return rec


def _no_allreduce(state, bucket):
    """DDP comm hook for the ``nocomm`` diagnostic: the bucket's local gradients, unreduced."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def run_bare(workload, preset, exp, W, N, tmp) -> dict:
    """The plain loop a careful user writes: DDP, autocast bf16, fused AdamW, clip 1.0, loss.item()
    only every ``item_every`` (10) steps; the loss is the per-rank mean."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, ws, local = world()
    dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(dev)
    if ws > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    module, loss_fn, flops = build(workload, preset, exp, dev)
    mem_reset()
    model = DDP(module, device_ids=[local] if dev.type == "cuda" else None,
                gradient_as_bucket_view=exp.get("bucket_view", False)) if ws > 1 else module
    opt = torch.optim.AdamW(param_groups(module, 0.01), lr=1e-5, fused=dev.type == "cuda")
    params = [p for p in module.parameters() if p.requires_grad]
    loader = make_loader(workload, preset, exp, module, flops, rank, ws)
    if exp.get("replay"):
        loader = ReplayLoader(loader, exp["replay"])
    ac = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step(batch):
        batch = to_device(batch, dev)
        with ac:
            loss_sum, units = loss_fn(model, batch)
        loss = loss_sum / units
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    it = iter(loader)
    stats, waits, times = [], 0.0, []
    model.train()
    for i in range(W + N):
        if i == W:
            sync()
            t0 = time.perf_counter()
        t = time.perf_counter()
        batch = next(it)
        if i >= W:
            waits += time.perf_counter() - t
            stats.append(batch["stats"])
        loss = step(batch)
        if i % exp.get("item_every", 10) == 0:  # item_every=1: a host sync every step, as ddptrain has
            loss.item()
        times.append(time.perf_counter())
    sync()
    elapsed = time.perf_counter() - t0
    peak = mem_peak()
    steps = [b - a for a, b in zip(times[W:-1], times[W + 1:])]
    extra = {"mem_at_rest_gb": mem_now() / 1e9, **diagnose(exp, step, it)}
    rec = summarize(exp, workload, ws, elapsed, stats, waits, steps, peak, extra)
    del it, model, module, opt, loader
    return rec


# DeepSpeed ZeRO-2 as HF users configure it ("auto": the Trainer fills in its own values)
DS_ZERO2 = {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": "auto", "allgather_bucket_size": 5e8},
            "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "zero_allow_untested_optimizer": True}


def run_hf(workload, preset, exp, W, N, tmp, mode: str = "eager") -> dict:
    """transformers.Trainer as its users run it (bf16, its default fused AdamW, clip 1.0, DDP via
    accelerate); ``mode`` ``compile``: ``torch_compile=True``; ``ds2``: DeepSpeed ZeRO-2.

    Raises:
        RuntimeError: ``ds2`` without deepspeed installed, or ``conformer`` (not an HF model).
    """
    if workload == "conformer":
        raise RuntimeError("the HF peers train HF models (wav2vec2, whisper), not the Conformer")
    if mode == "ds2":
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise RuntimeError("peer hf_ds2 needs deepspeed, which is not installed here") from e
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_pt_utils import LengthGroupedSampler

    rank, ws, local = world()
    dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    module, _, flops = build(workload, preset, exp, dev)
    h = hf_cfg(workload, preset, exp)
    dataset = fhm.synthetic_speech(h.model, module.config)
    durations = dataset.durations if workload == "wav2vec2" else None
    inner = StatsCollate(functools.partial(_hf_collate, workload=workload), workload, flops,
                         drop=("audio", "audio_lens", "tokens", "token_lens"))
    record = {"stats": [], "t": {}}
    workers = exp.get("workers", 4)

    class BenchTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            if exp.get("hf_group") and durations is not None:  # group_by_length with known lengths
                return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                            lengths=[int(d * SR) for d in durations])
            return super()._get_train_sampler(train_dataset)

        def get_train_dataloader(self):
            if not exp.get("replay"):
                return super().get_train_dataloader()
            # the same replay methodology as the other peers, over HF's own batch order
            B = self.args.per_device_train_batch_size
            if durations is not None and exp.get("hf_group"):
                idx = list(LengthGroupedSampler(B, lengths=[int(d * SR) for d in durations]))
                batches = [idx[i:i + B] for i in range(0, len(idx) - B + 1, B)]
            else:
                perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
                batches = [perm[i:i + B] for i in range(0, len(perm) - B + 1, B)]
            dl = torch.utils.data.DataLoader(dataset, batch_sampler=batches[rank::ws], collate_fn=inner,
                                             num_workers=workers, pin_memory=torch.cuda.is_available(),
                                             prefetch_factor=4 if workers else None)
            return ReplayLoader(dl, exp["replay"])

        def training_step(self, model, inputs, num_items_in_batch=None):
            s = inputs["stats"]  # do not mutate: a replayed batch is yielded again
            inputs = {k: v for k, v in inputs.items() if k != "stats"}
            if W <= self.state.global_step < W + N:
                record["stats"].append(s)
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (W, W + N):
                sync()
                record["t"][state.global_step] = time.perf_counter()

    kw = {}
    if mode == "compile":
        kw.update(torch_compile=True, torch_compile_backend=exp.get("compile_backend") or "inductor")
    elif mode == "ds2":
        kw.update(deepspeed=DS_ZERO2)
    args = TrainingArguments(
        output_dir=f"{tmp}/{exp['name']}", per_device_train_batch_size=int(exp.get("batch", 8)), bf16=True,
        max_steps=W + N, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0, logging_steps=100000,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=workers,
        dataloader_pin_memory=True, dataloader_prefetch_factor=4 if workers else None,
        ddp_find_unused_parameters=False, remove_unused_columns=False, seed=0,
        use_cpu=not torch.cuda.is_available(), **kw)
    mem_reset()
    trainer = BenchTrainer(model=module, args=args, train_dataset=dataset, data_collator=inner, callbacks=[Clock()])
    trainer.train()
    sync()
    elapsed = record["t"][W + N] - record["t"][W]
    peak = mem_peak()
    rec = summarize(exp, workload, ws, elapsed, record["stats"], 0.0, [], peak,
                    {"hf_group": bool(exp.get("hf_group")), "hf_mode": mode, "hf_optim": getattr(args.optim, "value", str(args.optim))})
    rec["data_wait_frac"] = None  # not measured inside HF's loop
    del trainer, module
    return rec


def _hf_collate(examples, workload):
    """HF model inputs (+ the lengths StatsCollate counts, dropped before the model sees them)."""
    tl = [e["tokens"].numel() for e in examples]
    labels = torch.full((len(examples), max(tl)), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        labels[i, : tl[i]] = e["tokens"]
    if workload == "wav2vec2":
        lens = [e["audio"].numel() for e in examples]
        x = torch.zeros(len(examples), max(lens))
        mask = torch.zeros(len(examples), max(lens), dtype=torch.long)
        for i, e in enumerate(examples):
            x[i, : lens[i]] = e["audio"]
            mask[i, : lens[i]] = 1
        return {"input_values": x, "attention_mask": mask, "labels": labels,
                "audio": x, "audio_lens": torch.tensor(lens), "token_lens": torch.tensor(tl)}
    feats = torch.stack([e["features"].T for e in examples])  # (B, mel, 3000)
    return {"input_features": feats, "labels": labels, "tokens": labels, "token_lens": torch.tensor(tl)}


PEERS = {"ddptrain": run_ddptrain, "bare": run_bare, "hf": run_hf,
         "hf_compile": functools.partial(run_hf, mode="compile"), "hf_ds2": functools.partial(run_hf, mode="ds2")}
