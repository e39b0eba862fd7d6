"""GPU training-throughput benchmark: HF speech models under four training loops.

Workloads (random-initialised from configs, synthetic in-memory data; nothing is downloaded):

* ``wav2vec2``: Wav2Vec2ForCTC, wav2vec2-large-lv60 layout (315M), raw 16 kHz audio with
  lognormal durations (median 7 s, clipped 1-20 s), CNN front end frozen.
* ``whisper``: WhisperForConditionalGeneration, Whisper-large-v3 layout (1.54B, 128 mel bins,
  30 s windows), lognormal transcript lengths (median 60 tokens).
* ``conformer``: the examples' Conformer-CTC at GPU size (80-bin fbank, same durations).

Peers (``peer`` of an experiment):

* ``hf``: transformers.Trainer (bf16, DDP through accelerate, fused AdamW, clip 1.0;
  ``group_by_length`` sampling for wav2vec2 when ``hf_group``).
* ``bare``: a hand-written DDP loop (autocast bf16, fused AdamW, clip 1.0, loss.item() every 10
  steps, no other host sync), batches from the same sampler as ddptrain.
* ``ddptrain``: ddptrain.Trainer with the overrides ``ov`` (ddptrain config keys).

Run one process per GPU (torchrun) or plain python for one GPU; experiments run one after the
other in the process and append one JSON line each to ``--out`` (rank 0)::

    torchrun --nproc_per_node=2 bench/bench_models.py --workload whisper --out r.jsonl \\
        --exps '[{"name": "ddp_b24", "peer": "ddptrain", "batch": 24, "ov": ["dist.comm_hook=bf16"]}]'

Measured per experiment: samples/s, audio-seconds/s (real, i.e. without padding), padding
fraction, model TFLOP/s per GPU and MFU (analytic FLOPs of the padded batches actually computed,
see ``Flops``; peak = 989.4 TFLOP/s dense bf16 per H100/H200 SXM), peak memory (max over ranks),
data wait, and optionally (``profile``) a torch.profiler breakdown of a few steps: GPU idle
share, kernel-time categories, top kernels, and the host syncs of one step (``syncs``).

Other experiment keys: ``replay: K`` times every peer on a second pass over the same K batches
(steady state: cuDNN plans for every shape already built, see ``ReplayLoader``); ``sdpa: no_cudnn``
turns cuDNN attention off;
``workers``, ``budget`` (wav2vec2 padded seconds per batch), ``batch``, ``hf_group``, ``ov``
(ddptrain config overrides); ``nocomm: 1`` (diagnostic, ddptrain on >1 GPU) gives DDP a comm hook
that skips the all-reduce, so the step keeps DDP's bucketing and graph splits but not NCCL —
the ranks then train apart, only the time counts; ``same_data: 1`` (diagnostic) gives every
rank rank 0's batches, which takes the cost imbalance between ranks' batches out of the step;
``as_world: N`` on one GPU trains on the batches of an N-GPU run (``Interleave``).
``bench/gpu_session.py`` holds the plans that produced BENCHMARKS.md; results of 2026-11-29
and 2026-11-30 are in ``bench/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import finetune_hf_model as fhm  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain.optim import param_groups  # noqa: E402

PEAK_BF16 = 989.4e12  # dense bf16 tensor-core peak of one H100/H200 SXM (datasheet)
SR = 16000


# ------------------------------------------------------------------------------------ FLOPs


class Flops:
    """Analytic training FLOPs (forward + backward = 3x forward for trained weights) of one padded batch.

    Linear layers: ``6 * params * tokens``; attention (QK^T and AV): ``12 * layers * d * T^2``
    per sequence; convolutions counted exactly from their output lengths (a frozen front end:
    forward only; a layer whose input needs no gradient: forward + weight gradient = 2x).
    """

    def __init__(self, kind: str, model):
        self.kind = kind
        c = model.config if hasattr(model, "config") else None
        if kind == "wav2vec2":
            self.convs = [(k, s) for k, s in zip(c.conv_kernel, c.conv_stride)]
            self.dims = [1] + list(c.conv_dim)
            fe = model.wav2vec2.feature_extractor
            self.fe_trained = any(p.requires_grad for p in fe.parameters())
            fe_ids = {id(p) for p in fe.parameters()}
            self.p_train = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in fe_ids)
            self.layers, self.d = c.num_hidden_layers, c.hidden_size
        elif kind == "whisper":
            enc, dec = model.model.encoder, model.model.decoder
            self.p_enc = sum(p.numel() for p in enc.layers.parameters())
            self.p_dec = sum(p.numel() for p in dec.layers.parameters())
            self.p_ckv = sum(p.numel() for lyr in dec.layers
                             for m in (lyr.encoder_attn.k_proj, lyr.encoder_attn.v_proj) for p in m.parameters())
            self.n_enc, self.n_dec, self.d = c.encoder_layers, c.decoder_layers, c.d_model
            self.mel, self.vocab, self.src = c.num_mel_bins, c.vocab_size, c.max_source_positions
        elif kind == "conformer":
            cc = model.cfg
            conv_ids = {id(p) for p in model.subsampling.conv.parameters()}
            self.p_enc = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in conv_ids)
            self.layers, self.d, self.ch, self.fdim = cc.num_layers, cc.d_model, cc.subsampling_channels, cc.input_dim
        else:
            raise ValueError(kind)

    def wav2vec2(self, batch: int, samples: int) -> float:
        n, cnn = samples, 0.0
        for i, (k, s) in enumerate(self.convs):
            n = (n - k) // s + 1
            cnn += 2.0 * n * k * self.dims[i] * self.dims[i + 1]
        cnn *= 3.0 if self.fe_trained else 1.0
        t = n
        return batch * (cnn + 6.0 * self.p_train * t + 12.0 * self.layers * self.d * t * t)

    def whisper(self, batch: int, dec_len: int) -> float:
        d, t, L = self.d, self.src, dec_len
        conv = 2 * (2.0 * 2 * t * self.mel * 3 * d) + 3 * (2.0 * t * d * 3 * d)  # conv1: fwd+wgrad, conv2: 3x
        enc = 6.0 * self.p_enc * t + 12.0 * self.n_enc * d * t * t
        dec = 6.0 * (self.p_dec - self.p_ckv) * L + 6.0 * self.p_ckv * t + 12.0 * self.n_dec * d * (L * L + L * t)
        head = 6.0 * self.vocab * d * L
        return batch * (conv + enc + dec + head)

    def conformer(self, batch: int, frames: int) -> float:
        t1 = (frames - 1) // 2
        f1 = (self.fdim - 1) // 2
        t2, f2 = (t1 - 1) // 2, (f1 - 1) // 2
        conv = 2 * 2.0 * t1 * f1 * 9 * self.ch + 3 * 2.0 * t2 * f2 * 9 * self.ch * self.ch
        return batch * (conv + 6.0 * self.p_enc * t2 + 12.0 * self.layers * self.d * t2 * t2)


class StatsCollate:
    """Adds ``stats`` (host floats: real/padded audio seconds, samples, tokens, FLOPs) to each batch,
    computed in the DataLoader worker from the padded shapes, so measuring needs no host sync."""

    def __init__(self, inner, kind: str, flops: Flops, drop: tuple = ()):
        self.inner, self.kind, self.flops, self.drop = inner, kind, flops, drop

    def __call__(self, examples):
        b = self.inner(examples)
        s = {"n": 0, "audio_s": 0.0, "padded_s": 0.0, "tokens": 0, "flops": 0.0}
        if self.kind == "wav2vec2":
            n, t = b["audio"].shape
            s.update(n=n, audio_s=float(b["audio_lens"].sum()) / SR, padded_s=n * t / SR, flops=self.flops.wav2vec2(n, t))
        elif self.kind == "whisper":
            n, L = b["tokens"].shape
            s.update(n=n, audio_s=30.0 * n, padded_s=30.0 * n, flops=self.flops.whisper(n, L))
        else:
            n, t = b["features"].shape[:2]
            s.update(n=n, audio_s=float(b["feature_lens"].sum()) / 100, padded_s=n * t / 100,
                     flops=self.flops.conformer(n, t))
        if "token_lens" in b:
            s["tokens"] = int(b["token_lens"].sum())
        b["stats"] = s
        for k in self.drop:  # helper keys the HF model must not receive
            b.pop(k, None)
        return b


# ------------------------------------------------------------------------------------ helpers


def log(*a):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*a, flush=True)


def world() -> tuple[int, int, int]:
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reduce(values: list[float], op: str = "sum") -> list[float]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX)
    return t.tolist()


def to_device(b, dev):
    if isinstance(b, torch.Tensor):
        return b.to(dev, non_blocking=True)
    if isinstance(b, dict):
        return {k: to_device(v, dev) for k, v in b.items()}
    return b


def hf_cfg(workload: str, preset: str, exp: dict) -> fhm.HFConfig:
    h = fhm.HFConfig(model="whisper" if workload == "whisper" else "wav2vec2", preset=preset)
    h.batch_size = int(exp.get("batch", 8))
    h.attn_implementation = exp.get("attn", "sdpa")
    return h


def build(workload: str, preset: str, exp: dict, dev):
    """(model on dev, loss_fn, Flops) for a workload; the model is initialised on the device."""
    torch.manual_seed(0)
    with torch.device(dev):
        if workload == "conformer":
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "models"))
            from conformer_ctc import ConformerCTC, ConformerCTCConfig

            size = dict(d_model=512, num_heads=8, ffn_dim=2048, num_layers=17, vocab_size=256,
                        subsampling_channels=512) if preset == "large" else dict(d_model=32, num_heads=2,
                                                                                 ffn_dim=64, num_layers=2)
            model = ConformerCTC(ConformerCTCConfig(**size))
            loss = conformer_loss
        else:
            model = fhm.build_model(hf_cfg(workload, preset, exp))
            loss = fhm.loss_for(model)
    model.to(dev)  # a few HF parameters (torch.Tensor(...) legacy constructors) ignore the default device
    return model, loss, Flops(workload, model)


def conformer_loss(model, batch):
    log_probs, out_lens = model(batch["features"], batch["feature_lens"])
    loss = F.ctc_loss(log_probs.float().transpose(0, 1), batch["tokens"], out_lens, batch["token_lens"],
                      blank=0, reduction="sum", zero_infinity=True)
    return loss, batch["token_lens"].sum()


class SyntheticFbank(torch.utils.data.Dataset):
    """Random 80-bin fbank frames (100/s) + character targets, for the Conformer workload."""

    def __init__(self, durations, vocab=256, cps=15.0):
        self.d, self.vocab, self.cps = np.asarray(durations), vocab, cps

    def __len__(self):
        return len(self.d)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(int(i))
        d = float(self.d[i])
        return {"id": str(i), "text": "", "features": torch.randn(int(d * 100), 80, generator=g),
                "tokens": torch.randint(1, self.vocab, (max(1, int(d * self.cps)),), generator=g)}


class Interleave:
    """The batches ``N`` ranks would get, in step order (rank 0 step 0, rank 1 step 0, rank 0
    step 1, ...): a 1-GPU run over it does exactly the work of the ``N``-GPU run, which is what
    a scaling efficiency needs (the ``N``-GPU plan has other batches than the 1-GPU plan)."""

    def __init__(self, loaders):
        self.loaders, self.dataset = loaders, loaders[0].dataset

    def __len__(self):
        return sum(len(x) for x in self.loaders)

    def __iter__(self):
        for step in zip(*self.loaders):
            yield from step


def make_loader(workload: str, preset: str, exp: dict, model, flops: Flops, rank: int, ws: int, data_cfg=None):
    if exp.get("as_world", 1) > 1 and ws == 1:  # see Interleave
        n = exp["as_world"]
        one = dict(exp, as_world=1)
        return Interleave([make_loader(workload, preset, one, model, flops, r, n, data_cfg) for r in range(n)])
    data_cfg = data_cfg or ddptrain.load_config(None, [f"data.max_duration={exp.get('budget', 400)}",
                                                       f"data.num_workers={exp.get('workers', 4)}"]).data
    wrap = lambda c: StatsCollate(c, workload, flops)  # noqa: E731
    h = hf_cfg(workload, preset, exp)
    if workload == "conformer":
        from ddptrain.data import DurationBucketSampler, SpeechCollator

        durs = fhm.synthetic_durations(h, data_cfg.seed)
        sampler = DurationBucketSampler(durs, max_duration=data_cfg.max_duration, num_buckets=data_cfg.num_buckets,
                                        sort_pool=data_cfg.bucket_sort_pool, sync_buckets=data_cfg.sync_buckets,
                                        seed=data_cfg.seed, world_size=ws, rank=rank)
        # targets must be below the model's vocabulary: CPU ctc_loss does not check, and an
        # out-of-range target writes outside its buffers (the tiny preset's heap corruption)
        return torch.utils.data.DataLoader(SyntheticFbank(durs, vocab=model.cfg.vocab_size), batch_sampler=sampler,
                                           collate_fn=wrap(SpeechCollator(mode="features", num_mel_bins=80, pad_to_multiple=1)),
                                           num_workers=data_cfg.num_workers, pin_memory=torch.cuda.is_available(),
                                           prefetch_factor=data_cfg.prefetch_factor if data_cfg.num_workers else None)
    return fhm.build_synthetic_loader(h, data_cfg, ws, rank, getattr(model, "config", None), collate_wrapper=wrap)


class TimedLoader:
    """Wraps a DataLoader: same ``len``/``batch_sampler``/``sampler``; records the host's wait for each batch."""

    def __init__(self, loader):
        self.loader, self.waits = loader, []
        self.batch_sampler, self.sampler = loader.batch_sampler, loader.sampler

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        while True:
            t = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                return
            self.waits.append(time.perf_counter() - t)
            yield b


class GpuSensors:
    """This process's GPU as NVML reports it: SM clock, temperature, power, throttle reasons.

    Why: session 4 saw a later experiment run up to 14% slower than the first on the same GPUs;
    a hot GPU clocking down would look just like that (and like a communication overhead when a
    cold 1-GPU run is compared with a warm 2-GPU one). Sampled once per step; off when NVML is
    not there (CPU, or no pynvml).
    """

    def __init__(self):
        self.samples: list = []
        self.ok = torch.cuda.is_available()

    def sample(self) -> None:
        if not self.ok:
            return
        try:
            mask = 0
            try:  # private helper: the NVML handle of the current device (honours CUDA_VISIBLE_DEVICES)
                import pynvml

                mask = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(torch.cuda._get_pynvml_handler())
            except Exception:
                pass
            self.samples.append((torch.cuda.clock_rate(), torch.cuda.temperature(), torch.cuda.power_draw() / 1e3, mask))
        except Exception as e:  # no NVML: say so once, then stop trying
            log(f"GPU sensors off: {type(e).__name__}: {e}")
            self.ok = False

    def summary(self, i0: int, i1: int) -> dict:
        got = [x for x in self.samples[i0:i1] if x]
        if not got:
            return {}
        clocks = [c for c, _, _, _ in got]
        mask = 0
        for *_, m in got:
            mask |= int(m)
        # this rank's GPU only (no collective here: a rank without NVML must not hang the others)
        return {"sm_clock_mhz": [min(clocks), round(sum(clocks) / len(clocks)), max(clocks)],
                "gpu_temp_c": [got[0][1], got[-1][1]], "power_w_mean": round(sum(p for _, _, p, _ in got) / len(got)),
                "throttle_reasons_mask": hex(mask)}


class TimedLoss:
    """Wraps the loss: records the host time and the batch stats at every call (= every step start)."""

    def __init__(self, fn):
        self.fn, self.calls, self.sensors = fn, [], GpuSensors()

    def __call__(self, model, batch):
        self.calls.append((time.perf_counter(), batch.get("stats", {})))
        self.sensors.sample()
        return self.fn(model, batch)


class GcPauses:
    """Records each Python garbage collection (host start time, generation, duration) while active.

    Why: an automatic collection on one rank stalls every rank at the next all-reduce; this
    shows whether the pauses land inside the timed steps (``trainer.gc_every_steps`` paces them).
    """

    def __init__(self):
        self.events, self._start = [], None

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.events.append((self._start, info["generation"], time.perf_counter() - self._start))
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)

    def summary(self, t0: float, t1: float) -> dict:
        ev = [(g, d) for t, g, d in self.events if t0 <= t < t1]
        return {"gc_count": len(ev), "gc_ms_total": round(1e3 * sum(d for _, d in ev), 1),
                "gc_pauses_over_1ms": [[g, round(1e3 * d, 1)] for g, d in ev if d > 1e-3]}


class ReplayLoader:
    """Yields the first ``k`` batches of ``loader``, then the same ``k`` batches again, forever.

    Why: speech batches have new shapes all the time, and the first time a shape is seen cuDNN
    (convolutions, its SDPA attention) builds an execution plan on the host. A training run
    reaches the steady state where every (quantised) shape is cached; a 20-step benchmark does
    not. Measuring the second pass over the same ``k`` batches times every peer in that steady
    state, on identical batches. Batches stay pinned in host memory after the first pass.
    """

    def __init__(self, loader, k: int):
        self.loader, self.k = loader, k
        self.batch_sampler = self.sampler = None  # the Trainer treats it as a plain iterable
        self.dataset = getattr(loader, "dataset", None)
        self.waits = []

    def __len__(self):
        return 10 ** 6

    def __iter__(self):
        cache, it = [], iter(self.loader)
        for _ in range(self.k):
            t = time.perf_counter()
            b = next(it)
            self.waits.append(time.perf_counter() - t)
            cache.append(b)
            yield b
        del it
        while True:
            for b in cache:
                self.waits.append(0.0)
                yield b


def summarize(exp, workload, ws, elapsed, stats, waits_s, step_times, mem, extra) -> dict:
    tot = {k: sum(float(s.get(k, 0)) for s in stats) for k in ("n", "audio_s", "padded_s", "tokens", "flops")}
    keys = ["n", "audio_s", "padded_s", "tokens", "flops"]
    g = dict(zip(keys, reduce([tot[k] for k in keys], "sum")))
    elapsed = reduce([elapsed], "max")[0]
    wait = reduce([waits_s], "max")[0]
    m = dict(zip(mem, reduce([mem[k] for k in mem], "max")))
    per_gpu_tflops = g["flops"] / elapsed / ws / 1e12
    rec = {
        "workload": workload, "name": exp["name"], "peer": exp["peer"], "world_size": ws,
        "batch": exp.get("batch"), "budget": exp.get("budget"), "ov": exp.get("ov", []),
        "replay": exp.get("replay"), "sdpa": exp.get("sdpa", "default"),
        "steps": len(stats), "elapsed_s": round(elapsed, 3),
        "samples_per_s": g["n"] / elapsed, "audio_s_per_s": g["audio_s"] / elapsed,
        "padded_s_per_s": g["padded_s"] / elapsed, "tokens_per_s": g["tokens"] / elapsed,
        "padding_frac": 1 - g["audio_s"] / g["padded_s"] if g["padded_s"] else 0.0,
        "samples_per_step_per_gpu": g["n"] / max(len(stats), 1) / ws,
        "tflops_per_gpu": per_gpu_tflops, "mfu": per_gpu_tflops * 1e12 / PEAK_BF16,
        "data_wait_frac": wait / elapsed, "step_ms_median": 1e3 * statistics.median(step_times) if step_times else None,
        "step_ms_all": [round(1e3 * t, 1) for t in step_times],
        **{k: round(v / 1e9, 3) for k, v in m.items()},
        **extra,
    }
    return rec


def mem_reset():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def mem_now() -> float:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0.0


def mem_peak() -> dict:
    if not torch.cuda.is_available():
        return {"peak_alloc_gb": 0.0, "peak_reserved_gb": 0.0}
    return {"peak_alloc_gb": float(torch.cuda.max_memory_allocated()),
            "peak_reserved_gb": float(torch.cuda.max_memory_reserved())}


# ------------------------------------------------------------------------------------ profiling


def categorize(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "splitk")):
        return "gemm"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if "conv" in n or "implicit" in n or "cudnn" in n or "winograd" in n:
        return "conv"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer/foreach"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    if "copy" in n or "cast" in n:
        return "dtype/copy"
    if "norm" in n:
        return "norm"
    if "reduce" in n or "softmax" in n or "ctc" in n:
        return "reduce/softmax/loss"
    return "elementwise/other"


def gap_owners(step_fn, batches: list, top: int = 6, min_ms: float = 0.5, gpu_cats=("kernel", "gpu_memcpy", "gpu_memset")) -> list:
    """What the host was doing while the GPU sat idle: the ``top`` longest GPU idle gaps of the
    steps, each with the project frames (ddptrain/, bench/, examples/; from ``with_stack``) and
    host ops that overlap it most. Stack recording slows the host, so the gaps here are longer
    than in an unprofiled step: use it to attribute gaps, not to size them."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts, with_stack=True) as prof:
        for b in batches:
            step_fn(b)
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if isinstance(e, dict) and "dur" in e]
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in gpu_cats)
    host = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") not in gpu_cats
            and e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "user_annotation")]
    gaps, end = [], None
    for s, e, name in gpu:  # times in microseconds
        if end is not None and s - end > min_ms * 1e3:
            gaps.append((end, s, name))
        end = e if end is None else max(end, e)
    gaps.sort(key=lambda g: g[0] - g[1])
    out = []
    for a, b, after in gaps[:top]:
        over: dict = {}
        for s, e, name in host:
            o = min(e, b) - max(s, a)
            mine = any(k in name for k in ("ddptrain/", "bench/", "examples/")) and "site-packages" not in name
            if o > 0.05 * (b - a) and (mine or ".py(" not in name):
                over[name[:100]] = max(over.get(name[:100], 0), o)
        ranked = sorted(over.items(), key=lambda kv: -kv[1])[:14]
        out.append({"gap_ms": round((b - a) / 1e3, 2), "next": after[:70],
                    "host": [(n, round(o / 1e3, 2)) for n, o in ranked]})
    return out


def profile_steps(step_fn, batches: list) -> dict:
    """Run ``step_fn(batch)`` for each batch under torch.profiler (CUDA activity only) and report the
    GPU busy/idle share over the span of the steps, kernel time by category and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        for b in batches:
            step_fn(b)
        return {}
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for b in batches:
            step_fn(b)
        sync()
        wall = time.perf_counter() - t0
    ivals, cats, names, runtime, kname = [], {}, {}, {}, []
    for e in prof.profiler.kineto_results.events():
        dur = e.duration_ns()
        if e.device_type() == DeviceType.CUDA:
            s = e.start_ns()
            ivals.append((s, s + dur))
            kname.append(e.name()[:80])
            c = categorize(e.name())
            cats[c] = cats.get(c, 0) + dur
            k = e.name()[:120]
            t, n = names.get(k, (0, 0))
            names[k] = (t + dur, n + 1)
        else:
            k = e.name()
            if k.startswith("cuda") and ("Synchronize" in k or "Memcpy" in k or "StreamWait" in k):
                t, n = runtime.get(k, (0, 0))
                runtime[k] = (t + dur, n + 1)
    if not ivals:
        return {"wall_ms": wall * 1e3, "note": "no CUDA events"}
    order = sorted(range(len(ivals)), key=lambda i: ivals[i])
    busy, (cur_s, cur_e), last = 0, ivals[order[0]], order[0]
    gaps = []  # (idle ns, kernel before, kernel after): where the GPU waits for the host
    for i in order[1:]:
        s, e = ivals[i]
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, kname[last], kname[i]))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        if e >= cur_e:
            last = i
    busy += cur_e - cur_s
    ivals = [ivals[i] for i in order]
    span = ivals[-1][1] - ivals[0][0]
    total = sum(cats.values())
    n = len(batches)
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:15]
    gaps.sort(key=lambda g: -g[0])
    return {
        "steps": n, "wall_ms_per_step": wall * 1e3 / n, "gpu_span_ms_per_step": span / 1e6 / n,
        "gpu_busy_ms_per_step": busy / 1e6 / n, "gpu_idle_frac_of_wall": 1 - busy / 1e9 / wall,
        "gpu_idle_frac_of_span": 1 - busy / span,
        "kernel_ms_per_step_by_category": {k: round(v / 1e6 / n, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "kernel_share_by_category": {k: round(v / total, 4) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k, "ms_per_step": round(t / 1e6 / n, 3), "calls_per_step": c / n} for k, (t, c) in top],
        "runtime_calls_per_step": {k: {"calls": c / n, "ms": round(t / 1e6 / n, 3)} for k, (t, c) in runtime.items()},
        "idle_gaps_over_1ms_ms_per_step": round(sum(g[0] for g in gaps if g[0] > 1e6) / 1e6 / n, 2),
        "largest_idle_gaps": [{"ms": round(g / 1e6, 2), "after": a, "before": b} for g, a, b in gaps[:12]],
    }


def count_syncs(step_fn, batch) -> list:
    """Host syncs of one step, by the Python line that caused them (torch.cuda sync debug mode)."""
    if not torch.cuda.is_available():
        return []
    sync()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            step_fn(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sync()
    where: dict = {}
    for x in w:
        if "synchroniz" in str(x.message).lower():
            k = f"{os.path.relpath(x.filename) if x.filename.startswith('/') else x.filename}:{x.lineno}"
            where[k] = where.get(k, 0) + 1
    return sorted(where.items(), key=lambda kv: -kv[1])


# ------------------------------------------------------------------------------------ peers


def run_ddptrain(workload, preset, exp, W, N, tmp) -> dict:
    rank, ws, local = world()
    name = exp["name"]
    ov = ["trainer.precision=bf16", "trainer.clip_grad_norm=1.0", f"trainer.max_steps={W + N + 1}",
          f"trainer.output_dir={tmp}/{name}", "checkpoint.save_at_end=false", "logging.tensorboard=false",
          "logging.progress_bar=false", "logging.log_every=100000", "optim.lr=1e-5",
          f"data.max_duration={exp.get('budget', 400)}", f"data.num_workers={exp.get('workers', 4)}",
          *exp.get("ov", [])]
    cfg = ddptrain.load_config(None, ov, schema=fhm.FinetuneConfig)
    info = ddptrain.setup_distributed(cfg)
    model, loss_fn, flops = build(workload, preset, exp, info.device)
    # same_data (diagnostic): every rank trains on rank 0's batches, so no rank waits for a
    # slower one at the step's all-reduce because its batch happened to be costlier
    raw = make_loader(workload, preset, exp, model, flops, 0 if exp.get("same_data") else info.rank,
                      info.world_size, cfg.data)
    loader = ReplayLoader(raw, exp["replay"]) if exp.get("replay") else TimedLoader(raw)
    timed = TimedLoss(loss_fn)
    mem_reset()
    trainer = ddptrain.Trainer(model, timed, cfg, loader)
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
    elapsed = calls[W + N][0] - calls[W][0]
    stats = [s for _, s in calls[W:W + N]]
    steps = [calls[i + 1][0] - calls[i][0] for i in range(W, W + N)]
    waits = sum(loader.waits[W + 1:W + N + 1])
    from ddptrain.memory import estimate_model_state

    est = estimate_model_state(trainer.module, cfg, ws)
    extra = {"mem_after_init_gb": mem_init / 1e9, "mem_at_rest_gb": mem_rest / 1e9,
             "recomputed_modules": len(trainer.recomputed), "compiled_modules": len(trainer.compiled),
             "estimate_gb": {k: round(v / 1e9, 3) for k, v in est.items() if not k.startswith("num_")},
             "num_params": est["num_params"], "num_trainable": est["num_trainable"],
             "ddp_wrapped": trainer.info.distributed, **pauses.summary(calls[W][0], calls[W + N][0]),
             **timed.sensors.summary(W, W + N)}
    if exp.get("profile") or exp.get("syncs") or exp.get("gaps"):
        it = iter(loader.loader if isinstance(loader, TimedLoader) else loader)
        batches = [next(it) for _ in range(exp.get("profile_steps", 3) + 1)]
        step = lambda b: trainer.train_step([b])  # noqa: E731
        step(batches[0])
        if exp.get("syncs"):
            extra["syncs"] = count_syncs(step, batches[0])
        if exp.get("profile"):
            extra["profile"] = profile_steps(step, batches[1:])
        if exp.get("gaps"):
            try:  # a diagnostic: its failure must not lose the timed result
                extra["gaps"] = gap_owners(step, batches[1:3])
            except Exception as e:  # noqa: BLE001
                extra["gaps"] = f"{type(e).__name__}: {e}"
        del it, batches
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
    only every 10 steps; the loss is the per-rank mean."""
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
    extra = {"mem_at_rest_gb": mem_now() / 1e9}
    if exp.get("profile") or exp.get("syncs") or exp.get("gaps"):
        batches = [next(it) for _ in range(exp.get("profile_steps", 3) + 1)]
        step(batches[0])
        if exp.get("syncs"):
            extra["syncs"] = count_syncs(step, batches[0])
        if exp.get("profile"):
            extra["profile"] = profile_steps(step, batches[1:])
        if exp.get("gaps"):
            try:  # a diagnostic: its failure must not lose the timed result
                extra["gaps"] = gap_owners(step, batches[1:3])
            except Exception as e:  # noqa: BLE001
                extra["gaps"] = f"{type(e).__name__}: {e}"
    rec = summarize(exp, workload, ws, elapsed, stats, waits, steps, peak, extra)
    del it, model, module, opt, loader
    return rec


def run_hf(workload, preset, exp, W, N, tmp) -> dict:
    """transformers.Trainer as its users run it (bf16, fused AdamW, clip 1.0, DDP via accelerate)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_pt_utils import LengthGroupedSampler

    rank, ws, local = world()
    dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    module, _, flops = build(workload, preset, exp, dev)
    h = hf_cfg(workload, preset, exp)
    if workload == "wav2vec2":
        durations = fhm.synthetic_durations(h)
        dataset = fhm.SyntheticAudio(durations, module.config.vocab_size, h.chars_per_second)
    else:
        durations = None
        dataset = fhm.SyntheticWindows(fhm.synthetic_token_counts(h), module.config.num_mel_bins)
    inner = StatsCollate(_HFCollate(workload), workload, flops, drop=("audio", "audio_lens", "tokens", "token_lens"))
    record = {"stats": [], "t": {}}

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
                                             num_workers=exp.get("workers", 4), pin_memory=torch.cuda.is_available(),
                                             prefetch_factor=4 if exp.get("workers", 4) else None)
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

    args = TrainingArguments(
        output_dir=f"{tmp}/{exp['name']}", per_device_train_batch_size=int(exp.get("batch", 8)), bf16=True,
        max_steps=W + N, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0, logging_steps=100000,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=exp.get("workers", 4),
        dataloader_pin_memory=True, dataloader_prefetch_factor=4, ddp_find_unused_parameters=False,
        remove_unused_columns=False, seed=0, use_cpu=not torch.cuda.is_available())
    mem_reset()
    trainer = BenchTrainer(model=module, args=args, train_dataset=dataset, data_collator=inner,
                           callbacks=[Clock()])
    trainer.train()
    sync()
    elapsed = record["t"][W + N] - record["t"][W]
    peak = mem_peak()
    rec = summarize(exp, workload, ws, elapsed, record["stats"], 0.0, [], peak, {"hf_group": bool(exp.get("hf_group"))})
    rec["data_wait_frac"] = None  # not measured inside HF's loop
    del trainer, module
    return rec


def _hf_collate(examples, workload):
    if workload == "wav2vec2":
        lens = [e["audio"].numel() for e in examples]
        x = torch.zeros(len(examples), max(lens))
        mask = torch.zeros(len(examples), max(lens), dtype=torch.long)
        for i, e in enumerate(examples):
            x[i, : lens[i]] = e["audio"]
            mask[i, : lens[i]] = 1
        tl = [e["tokens"].numel() for e in examples]
        labels = torch.full((len(examples), max(tl)), -100, dtype=torch.long)
        for i, e in enumerate(examples):
            labels[i, : tl[i]] = e["tokens"]
        return {"input_values": x, "attention_mask": mask, "labels": labels,
                "audio": x, "audio_lens": torch.tensor(lens), "token_lens": torch.tensor(tl)}
    feats = torch.stack([e["features"].T for e in examples])  # (B, mel, 3000)
    tl = [e["tokens"].numel() for e in examples]
    labels = torch.full((len(examples), max(tl)), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        labels[i, : tl[i]] = e["tokens"]
    return {"input_features": feats, "labels": labels, "tokens": labels, "token_lens": torch.tensor(tl)}


class _HFCollate:
    def __init__(self, workload):
        self.workload = workload

    def __call__(self, examples):
        return _hf_collate(examples, self.workload)


PEERS = {"ddptrain": run_ddptrain, "bare": run_bare, "hf": run_hf}
# Every key an experiment may set: a key nothing reads (a removed option, a typo) is refused up
# front instead of being ignored, so a stale plan fails before it costs device time.
EXPERIMENT_KEYS = {"name", "peer", "batch", "budget", "ov", "workers", "replay", "warmup", "steps", "sdpa",
                   "attn", "hf_group", "as_world", "same_data", "nocomm", "ddp1", "item_every", "bucket_view",
                   "profile", "profile_steps", "syncs", "gaps"}


def check_experiments(exps: list) -> None:
    """Raises:
        ValueError: naming the experiment and key, for an unknown key or peer or a missing name.
    """
    for i, e in enumerate(exps):
        label = e.get("name", f"experiment {i}")
        if "name" not in e or "peer" not in e:
            raise ValueError(f"{label}: every experiment needs 'name' and 'peer'")
        if e["peer"] not in PEERS:
            raise ValueError(f"{label}: unknown peer {e['peer']!r} (known: {sorted(PEERS)})")
        unknown = sorted(set(e) - EXPERIMENT_KEYS)
        if unknown:
            raise ValueError(f"{label}: unknown experiment key(s) {unknown} (known: {sorted(EXPERIMENT_KEYS)})")


def main(argv=None) -> int:
    """Runs the experiments; returns 1 when any of them failed (its row then holds the error)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=["wav2vec2", "whisper", "conformer"])
    p.add_argument("--exps", required=True, help="JSON list of experiments, or @file.json")
    p.add_argument("--out", required=True, help="JSON-lines file to append results to (rank 0)")
    p.add_argument("--preset", default="large", choices=["large", "tiny"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tmp", default="/tmp/ddptrain_bench")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    exps = json.load(open(a.exps[1:])) if a.exps.startswith("@") else json.loads(a.exps)
    check_experiments(exps)
    failed = 0
    rank, ws, local = world()
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    try:  # only the wav2vec2 / Whisper workloads and the HF peer need it
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    meta = {"torch": torch.__version__, "ddptrain_from": os.path.relpath(os.path.dirname(ddptrain.__file__)), "transformers": tf_version, "tag": a.tag,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d")}
    for exp in exps:
        W, N = exp.get("warmup", a.warmup), exp.get("steps", a.steps)
        t = time.time()
        if torch.cuda.is_available():  # exp "sdpa": "no_cudnn" -> flash / memory-efficient kernels only
            torch.backends.cuda.enable_cudnn_sdp(exp.get("sdpa") != "no_cudnn")
        try:
            rec = PEERS[exp["peer"]](a.workload, a.preset, exp, W, N, a.tmp)
            rec.update(meta, wall_total_s=round(time.time() - t, 1))
        except Exception as e:  # one failed experiment must not cost the others
            import traceback

            traceback.print_exc()
            rec = {"workload": a.workload, "name": exp["name"], "peer": exp["peer"], "world_size": ws,
                   "error": f"{type(e).__name__}: {str(e)[:2000]}", **meta}
            if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
                rec["oom"] = True
            failed += 1
        gc.collect()
        torch._dynamo.reset()  # every experiment compiles from scratch, no recompile limit carried over
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if rank == 0:
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            short = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
                     if k not in ("profile", "syncs", "ov", "gaps")}
            print("RESULT", json.dumps(short), flush=True)
            if "profile" in rec:
                pr = rec["profile"]
                print("PROFILE", exp["name"], json.dumps({k: pr.get(k) for k in (
                    "wall_ms_per_step", "gpu_busy_ms_per_step", "gpu_idle_frac_of_wall",
                    "kernel_ms_per_step_by_category", "runtime_calls_per_step", "idle_gaps_over_1ms_ms_per_step", "largest_idle_gaps")}), flush=True)
            if "syncs" in rec:
                print("SYNCS", exp["name"], json.dumps(rec["syncs"][:12]), flush=True)
            gaps = rec.get("gaps", [])
            for g in gaps if isinstance(gaps, list) else [gaps]:  # a string: the diagnostic failed
                print("GAP", exp["name"], json.dumps(g), flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
