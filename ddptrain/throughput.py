"""Where a training step's time goes, as the log shows it: rates, model FLOPs and MFU, data and all-reduce waits.

Every logged training line (metrics.jsonl, TensorBoard ``train/...``, the console) has, over the
steps since the previous logged one:

* ``steps_per_s``, ``units_per_s`` (the loss contract's units: frames, tokens, ...; all ranks);
* ``samples_per_s`` and ``audio_s_per_s`` (all ranks) when the batches say so: utterances from
  ``ids``, seconds from ``audio_lens`` (samples at ``data.sample_rate``) or ``feature_lens``
  (frames at ``data.frame_shift_ms``), the keys of ddptrain.data's batches;
* ``tflops_per_gpu`` with ``Trainer(flops_fn=...)`` (model FLOPs of forward + backward of each
  micro-batch, recomputation not counted), and ``mfu``: that over the GPU's dense bf16 peak
  (:data:`PEAK_BF16_TFLOPS` by device name, or ``logging.peak_tflops``). On CPU, or a GPU the
  table does not know, MFU is left out rather than guessed (and off a GPU the printed line leaves
  ``tflops_per_gpu`` out too; metrics.jsonl keeps it: ddptrain/logging.py);
* ``data_wait_frac``: rank 0's share of the wall time spent waiting for its loader, and with
  several ranks ``data_wait_frac_min`` / ``_max`` over the ranks;
* with DDP on several ranks, ``allreduce_frac_min`` / ``_max``: each rank's share of the wall time
  between the end of its backward (its last gradient bucket ready) and the end of the gradient
  all-reduce, i.e. communication not hidden behind the backward plus waiting for slower ranks.

Reading them: a high ``data_wait_frac_max`` is data-bound (more loader workers, features on the
GPU); a high ``allreduce_frac_min`` (every rank waits) is communication-bound (check the link:
``dist.preflight``; larger ``dist.bucket_cap_mb``, ``dist.comm_hook: bf16``); ``_max`` well above
``_min`` is imbalance (a rank waits for a costlier batch: ``data.sync_buckets``); both small with
a low ``mfu`` is the compute path itself (host-bound launches, small kernels: ``compile``).

Nothing here adds a host sync per step: FLOPs and audio seconds come from the host copy of the
batch, the all-reduce timing is a pair of CUDA events per step read at log steps, and the ranks
exchange their figures in one small all-reduce per logged line.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, Callable, Optional

import torch

from ddptrain import dist
from ddptrain.contract import batch_ids, is_empty

FlopsFn = Callable[[Any], float]  # batch (host copy) -> model FLOPs of its forward + backward

# Dense (not sparse) bf16 tensor-core peak per GPU in TFLOP/s, from NVIDIA's datasheets, with
# fp32 accumulation (what PyTorch's bf16 matmuls use; half the fp16-accumulate figure on GeForce
# cards). The first pattern found in torch.cuda.get_device_name() wins: specific names first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"B200", 2250.0),
    (r"H200 NVL|H100 NVL", 835.5),
    (r"H100 PCIe", 756.0),
    (r"GH200|H200|H100|H800", 989.4),  # SXM
    (r"A100|A800", 312.0),
    (r"L40S", 362.05),
    (r"L40\b", 181.05),
    (r"L4\b", 121.0),
    (r"A10\b", 125.0),
    (r"RTX 6000 Ada", 364.2),
    (r"RTX A6000", 154.8),
    (r"RTX 4090", 165.2),
    (r"RTX 3090", 71.0),
)


def dense_peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a GPU named ``device_name`` (:data:`PEAK_BF16_TFLOPS`), or None."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> Optional[float]:
    """FLOP/s that MFU is measured against: ``logging.peak_tflops`` if set, the device's table
    entry on a GPU, None otherwise (a CPU, an unknown GPU: no MFU is better than a made-up one)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = dense_peak_tflops(torch.cuda.get_device_name(device))
    return tflops * 1e12 if tflops else None


class AllReduceTimer:
    """Times, per optimizer step, how long a rank waits for DDP's gradient all-reduce after its
    backward: from the moment its last gradient bucket is ready to the moment every bucket is
    reduced (the all-reduces run in order, so the last one's end is the end of all).

    It works as a wrapper around DDP's communication hook (:meth:`wrap`, see ``dist.wrap_ddp``):
    only the last bucket of a backward is touched, with a CUDA event at each end (host clock on
    CPU), read at log steps by :meth:`take`. Cost: DDP runs a Python hook per bucket instead of
    its C++ all-reduce (``logging.allreduce_share: false`` turns it off).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[list] = []  # [start, end] per step; the all-reduce's callback fills in end

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: after the backward's kernels / after the all-reduce
        return event

    def wrap(self, hook: Callable) -> Callable:
        """``hook(state, bucket) -> Future`` (DDP's comm hook signature), timed."""
        def timed(state, bucket):
            if not bucket.is_last():
                return hook(state, bucket)
            mark = [self._now(), None]
            self.pending.append(mark)

            def done(fut):
                mark[1] = self._now()  # a CUDA future's callback runs on a stream that waited for it
                return fut.value()
            return hook(state, bucket).then(done)
        return timed

    def take(self) -> float:
        """Seconds waited over the finished steps since the last call (their marks are dropped)."""
        done = [m for m in self.pending if m[1] is not None]
        self.pending = [m for m in self.pending if m[1] is None]
        if not self.cuda:
            return sum(end - start for start, end in done)
        for _, end in done:
            end.synchronize()  # at a log step, after the step's own sync: done already, or nearly
        return sum(start.elapsed_time(end) for start, end in done) / 1e3


class ThroughputWindow:
    """Sums over the steps since the last logged one: loss, units, samples, audio seconds, model
    FLOPs, data wait, all-reduce wait and wall time.

    Args:
        flops_fn: ``(batch) -> float`` model FLOPs of one micro-batch, or None.
        peak: the FLOP/s of one GPU that MFU divides by (:func:`peak_flops`), or None.
        timer: the DDP all-reduce timer, or None.
        world_size, rank, device: this process's place; with ``world_size > 1``
            :meth:`scalars` is a collective that every rank calls at the same steps.
        sample_rate, frame_shift_ms: what turns ``audio_lens`` / ``feature_lens`` into seconds.
    """

    def __init__(self, flops_fn: Optional[FlopsFn] = None, peak: Optional[float] = None,
                 timer: Optional[AllReduceTimer] = None, world_size: int = 1, rank: int = 0,
                 device: torch.device = torch.device("cpu"), sample_rate: int = 16000, frame_shift_ms: float = 10.0):
        self.flops_fn, self.peak, self.timer = flops_fn, peak, timer
        self.world_size, self.rank, self.device = world_size, rank, device
        self.sample_rate, self.frame_shift_s = sample_rate, frame_shift_ms / 1000
        self.reset()

    @classmethod
    def for_run(cls, config, info, flops_fn: Optional[FlopsFn],
                timer: Optional[AllReduceTimer]) -> "ThroughputWindow":
        """The window of a Trainer's run (``logging.peak_tflops``, ``data.sample_rate`` / ``frame_shift_ms``)."""
        peak = peak_flops(info.device, config.logging.peak_tflops)
        if flops_fn is not None and peak is None and info.device.type == "cuda" and info.is_main:
            print(f"note: MFU is not logged: no dense bf16 peak is known for {torch.cuda.get_device_name(info.device)!r}; "
                  "set logging.peak_tflops to this GPU's figure", file=sys.stderr, flush=True)
        return cls(flops_fn, peak, timer, info.world_size, info.rank, info.device,
                   config.data.sample_rate, config.data.frame_shift_ms)

    def reset(self) -> None:
        """Start a new window now (also at the start of ``fit``: set-up time is not a step's)."""
        self.loss = self.units = self.wait = 0.0
        self.samples = self.audio_s = self.flops = 0.0
        self.steps = 0
        if self.timer is not None:
            self.timer.take()  # waits before this window (a pre-flight step) are not in it
        self.start = time.perf_counter()

    def add(self, loss_sum: float, units: float, wait_s: float, batches: list = ()) -> None:
        """One step: its global loss and units, this rank's data wait and its host micro-batches."""
        self.loss += loss_sum
        self.units += units
        self.wait += wait_s
        self.steps += 1
        for b in batches:
            if is_empty(b):
                continue  # replayed with weight 0: no work counted
            self.samples += len(b["ids"]) if isinstance(b, dict) and "ids" in b else 0
            self.audio_s += self._seconds(b)
            if self.flops_fn is not None:
                try:
                    self.flops += float(self.flops_fn(b))
                except Exception as e:
                    raise RuntimeError(f"rank {self.rank}: flops_fn failed on a batch{batch_ids(b)}: "
                                       f"{type(e).__name__}: {e}") from e

    def _seconds(self, batch: Any) -> float:
        """Audio seconds of a ddptrain.data batch, from host lengths only (a CUDA tensor would sync)."""
        if not isinstance(batch, dict):
            return 0.0
        for key, seconds in (("audio_lens", 1.0 / self.sample_rate), ("feature_lens", self.frame_shift_s)):
            lens = batch.get(key)
            if isinstance(lens, torch.Tensor) and lens.device.type == "cpu":
                return float(lens.sum()) * seconds
        return 0.0

    def scalars(self) -> dict:
        """The window's loss per unit, rates and shares; starts a new window. Collective with
        several ranks: the ranks' counts are summed and their shares gathered in one all-reduce."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        wait, comm = self.wait / elapsed, (self.timer.take() / elapsed if self.timer is not None else None)
        counts = [self.samples, self.audio_s, self.flops]
        if self.world_size > 1:
            shares = [0.0] * (2 * self.world_size)  # each rank fills its own slots; the sum gathers them
            shares[self.rank], shares[self.world_size + self.rank] = wait, comm or 0.0
            total = dist.all_reduce_sum(counts + shares, self.device)
            counts, waits, comms = total[:3], total[3:3 + self.world_size], total[3 + self.world_size:]
        samples, audio_s, flops = counts
        out = {"loss": self.loss / max(self.units, 1e-12), "steps_per_s": self.steps / elapsed,
               "units_per_s": self.units / elapsed, "data_wait_frac": wait}
        if samples:
            out["samples_per_s"] = samples / elapsed
        if audio_s:
            out["audio_s_per_s"] = audio_s / elapsed
        if self.flops_fn is not None:
            per_gpu = flops / elapsed / self.world_size
            out["tflops_per_gpu"] = per_gpu / 1e12
            if self.peak:
                out["mfu"] = per_gpu / self.peak
        if self.world_size > 1:
            out.update(data_wait_frac_min=min(waits), data_wait_frac_max=max(waits))
            if comm is not None:
                out.update(allreduce_frac_min=min(comms), allreduce_frac_max=max(comms))
        self.reset()
        return out
