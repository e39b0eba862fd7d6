"""The training log's rates, MFU and time shares (ddptrain/throughput.py), and dist.preflight's
all-reduce check (ddptrain/dist.py): the values on CPU, on 1 rank and on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import ddptrain
from ddptrain import dist
from ddptrain.throughput import AllReduceTimer, ThroughputWindow, dense_peak_tflops, peak_flops
from test_trainer import FrameMLP, frame_loss, make_batch, make_cfg

from _dist import run_ranks

FLOPS, PEAK_TFLOPS = 3.0e6, 2.0e-5  # a fake model and a fake GPU: MFU is then of order 1


def speech_batches(n: int, seed: int = 0) -> list[dict]:
    """FrameMLP batches that also carry what ddptrain.data's batches do: ids and feature_lens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = make_batch(gen, 3, 8)
        b.update(ids=[f"u{i}_{k}" for k in range(3)], feature_lens=b["lens"].clone())
        out.append(b)
    return out


class SlowLoader:
    """A re-iterable loader that sleeps before each batch, as a loader starved of workers does."""

    def __init__(self, batches: list, sleep_s: float):
        self.batches, self.sleep_s = batches, sleep_s

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            time.sleep(self.sleep_s)
            yield b


def rows(folder, split="train") -> list[dict]:
    return [r for r in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if r["split"] == split]


def test_peak_table_and_override():
    assert dense_peak_tflops("NVIDIA H200") == 989.4
    assert dense_peak_tflops("NVIDIA H100 PCIe") == 756.0  # not the SXM figure
    assert dense_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert dense_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert dense_peak_tflops("NVIDIA L40S") == 362.05 and dense_peak_tflops("NVIDIA L40") == 181.05
    assert dense_peak_tflops("NVIDIA L4") == 121.0 and dense_peak_tflops("NVIDIA A10") == 125.0
    assert dense_peak_tflops("NVIDIA GeForce RTX 4090") == 165.2
    assert dense_peak_tflops("NVIDIA GeForce RTX 3090") == 71.0
    assert dense_peak_tflops("NVIDIA A10G") is None and dense_peak_tflops("Tesla T4") is None
    assert peak_flops(torch.device("cpu")) is None  # no MFU on CPU unless asked for
    assert peak_flops(torch.device("cpu"), 2.5) == 2.5e12


def test_log_lines_and_tensorboard_show_rates_and_mfu(tmp_path):
    """MFU = model FLOPs per second / peak, with the steps per second of the same line."""
    torch.manual_seed(0)
    batches = speech_batches(4)
    cfg = make_cfg(tmp_path, "trainer.max_steps=4", "trainer.grad_accum_steps=2", "logging.log_every=2",
                   f"logging.peak_tflops={PEAK_TFLOPS}")
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, batches, flops_fn=lambda b: FLOPS * len(b["ids"])) as t:
        t.fit()
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [2, 4]
    per_step = {"flops": 2 * 3 * FLOPS, "samples": 2 * 3}  # 2 micro-batches of 3 utterances
    epoch_s = sum(float(b["feature_lens"].sum()) for b in batches) * 0.01  # frames of 10 ms; each line: one epoch
    for r in logged:
        rate = r["steps_per_s"]
        assert r["tflops_per_gpu"] == pytest.approx(per_step["flops"] * rate / 1e12, rel=1e-9)
        assert r["mfu"] == pytest.approx(per_step["flops"] * rate / (PEAK_TFLOPS * 1e12), rel=1e-9)
        assert r["samples_per_s"] == pytest.approx(per_step["samples"] * rate, rel=1e-9)
        assert r["audio_s_per_s"] == pytest.approx(epoch_s / 2 * rate, rel=1e-9)
        assert 0 <= r["data_wait_frac"] < 1
        assert "allreduce_frac_max" not in r and "data_wait_frac_max" not in r  # one rank
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    for tag in ("mfu", "tflops_per_gpu", "samples_per_s", "audio_s_per_s", "data_wait_frac"):
        assert [e.value for e in scalars.Scalars(f"train/{tag}")] == pytest.approx([r[tag] for r in logged]), tag


def test_no_mfu_without_a_peak_on_cpu(tmp_path):
    cfg = make_cfg(tmp_path, "trainer.max_steps=2")
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, speech_batches(2), flops_fn=lambda b: FLOPS) as t:
        t.fit()
    r = rows(tmp_path)[-1]
    assert r["tflops_per_gpu"] > 0 and "mfu" not in r


def test_data_wait_share_rises_when_the_loader_sleeps(tmp_path):
    share = {}
    for sleep in (0.0, 0.15):
        cfg = make_cfg(tmp_path / str(sleep), "trainer.max_steps=4", "logging.log_every=4",
                       "checkpoint.save_at_end=false")
        with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, SlowLoader(speech_batches(4), sleep)) as t:
            t.fit()
        share[sleep] = rows(tmp_path / str(sleep))[-1]["data_wait_frac"]
    assert share[0.15] > 0.5 and share[0.0] < share[0.15] - 0.3, share


def test_allreduce_timer_measures_only_the_last_bucket():
    class Bucket:
        def __init__(self, last):
            self.last = last

        def is_last(self):
            return self.last

    pending = []

    def hook(state, bucket):  # a stand-in for DDP's all-reduce: it completes when the test says so
        fut = torch.futures.Future()
        pending.append(fut)
        return fut

    timer = AllReduceTimer(torch.device("cpu"))
    timed = timer.wrap(hook)
    timed(None, Bucket(False))
    out = timed(None, Bucket(True))
    assert len(timer.pending) == 1 and timer.take() == 0.0  # not finished: kept for the next window
    time.sleep(0.05)
    for fut in pending:
        fut.set_result(torch.ones(2))
    assert torch.equal(out.wait(), torch.ones(2))  # the value DDP reads is the hook's own
    assert 0.04 < timer.take() < 5.0 and timer.pending == [] and timer.take() == 0.0


def test_bus_bandwidth_is_nccl_tests_convention():
    assert dist.bus_bandwidth(10**9, 1.0, 2) == pytest.approx(1.0)
    assert dist.bus_bandwidth(10**9, 1.0, 4) == pytest.approx(1.5)
    assert dist.expected_busbw(torch.device("cpu"), 2, 2) == (0.0, "CPU")  # no figure: never a warning


class Lines:
    """A RunLogger stand-in that keeps what rank 0 would log and print."""

    def __init__(self):
        self.logged, self.printed = [], []

    def log(self, step, scalars, prefix="train", name=""):
        self.logged.append((step, prefix, scalars))

    def print(self, text):
        self.printed.append(text)


def _two_rank_worker(rank, world, out):
    torch.manual_seed(0)
    cfg = make_cfg(os.path.join(out, "run"), "trainer.max_steps=4", "logging.log_every=4", "dist.preflight=always",
                   "dist.bucket_cap_mb=1", "checkpoint.save_at_end=false")
    # rank 1's loader is slow: it waits for data, and rank 0 waits for it at the all-reduce
    loader = SlowLoader(speech_batches(4, seed=rank), 0.2 if rank == 1 else 0.0)
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, loader, flops_fn=lambda b: FLOPS) as t:
        assert t.allreduce_timer is not None
        t.fit()
    # the warning path, with an expected figure no link reaches
    lines = Lines()
    cfg.dist.expected_busbw_gbps = 1e9
    figures = dist.preflight(cfg.dist, t.info, lines)
    with open(os.path.join(out, f"preflight{rank}.json"), "w") as f:
        json.dump({"figures": figures, "printed": lines.printed}, f)


@pytest.mark.timeout(150)
def test_two_ranks_log_wait_shares_and_the_preflight(tmp_path, capfd):
    run_ranks(_two_rank_worker, 2, str(tmp_path), timeout=120)
    err = capfd.readouterr().err
    r = rows(tmp_path / "run")[-1]
    assert r["data_wait_frac_max"] > 0.5 and r["data_wait_frac_min"] < 0.2, r  # rank 1 waits for data
    assert r["data_wait_frac"] == r["data_wait_frac_min"]  # rank 0's own
    assert r["allreduce_frac_max"] > 0.4 and r["allreduce_frac_min"] < r["allreduce_frac_max"], r  # rank 0 waits
    assert r["samples_per_s"] == pytest.approx(2 * 3 * r["steps_per_s"], rel=1e-9)  # both ranks' utterances
    assert r["tflops_per_gpu"] == pytest.approx(FLOPS * r["steps_per_s"] / 1e12, rel=1e-9)  # per GPU
    (check,) = rows(tmp_path / "run", "dist")  # logged once, on rank 0, before the first step
    assert check["step"] == 0 and check["bucket_mb"] == 1 and check["allreduce_busbw_gbps"] > 0
    assert "expected_busbw_gbps" not in check and "WARNING: dist.preflight" not in err  # CPU: no figure, no warning
    warned = [json.load(open(tmp_path / f"preflight{k}.json")) for k in (0, 1)]
    assert all(w["figures"]["expected_busbw_gbps"] == 1e9 for w in warned)
    (text,) = warned[0]["printed"]
    assert "NCCL_P2P_LEVEL" in text and f"{warned[0]['figures']['allreduce_busbw_gbps']:.1f} GB/s" in text


def test_a_broken_flops_fn_is_named_with_the_batch(tmp_path):
    cfg = make_cfg(tmp_path, "trainer.max_steps=1")
    with ddptrain.Trainer(FrameMLP(), frame_loss, cfg, speech_batches(1), flops_fn=lambda b: b["tokens"]) as t:
        with pytest.raises(RuntimeError, match=r"flops_fn failed on a batch \[utterances: u0_0.*KeyError"):
            t.fit()
