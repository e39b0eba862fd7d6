"""Issue 31's profiles are ready for their GPU call: bench/profiling.py reports kernel time by
category, the GPU's idle share, host time per step and the floor at zero host time (with MFU
there), the model benches' ``--profile`` puts it on their rows (VoxCPM dry-run on CPU, where the
"kernels" are aten ops), plan ``profile1`` profiles every workload of the issue on one GPU, and
bench/profile_table.py turns the rows into BENCHMARKS' table.

Why: a GPU call is spent once; a profile that lacks a field, or a plan that breaks after the
first job, costs the whole call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import gpu_session  # noqa: E402
import profile_table  # noqa: E402
import profiling  # noqa: E402
from flops import PEAK_BF16  # noqa: E402
from measure import TimedLoss  # noqa: E402


@pytest.mark.parametrize("name, category", [
    # seen in a Whisper-large-v3 profile (rows h100x1_2026-12-07_s17b_*)
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0", "attention"),
    ("nvjet_sm90_tst_256x144_64x4_1x2_h_bz_coopA_bias_TNT", "gemm"),
    ("triton_red_fused__to_copy_add_native_layer_norm_backward_view_8", "norm"),
    ("triton_poi_fused_gelu_gelu_backward_view_2", "elementwise/other"),
    ("triton_poi_fused__to_copy_view_3", "dtype/copy"),
    ("triton_poi_fused_0", "elementwise/other"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda", "dtype/copy"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata", "optimizer/foreach"),
])
def test_kernel_categories_follow_what_a_kernel_does_not_a_word_in_its_name(name, category):
    assert profiling.categorize(name) == category


def test_union_of_kernel_intervals_and_the_idle_gaps_between_them():
    total, gaps = profiling._union_ns([(30, 40, 2), (0, 10, 0), (5, 20, 1)])
    assert total == 30  # [0, 20] and [30, 40]
    assert gaps == [(10, 1, 2)]  # 20 -> 30, after interval 1 (it ended last), before interval 2
    assert profiling._union_ns([]) == (0, [])


def test_profile_reports_kernel_time_idle_host_and_the_floor_on_cpu():
    lin = torch.nn.Linear(64, 64)

    def step(x):
        lin(x).square().sum().backward()

    p = profiling.profile_steps(step, [torch.randn(32, 64), torch.randn(32, 64)], flops=[1e6, 3e6])
    cats = p["kernel_ms_per_step_by_category"]
    assert p["steps"] == 2 and "gemm" in cats  # aten::addmm / mm
    assert p["floor_ms"] == p["kernel_ms_per_step"] == pytest.approx(sum(cats.values()), abs=0.01 * len(cats))
    assert 0 < p["floor_ms"] <= p["wall_ms_per_step"]
    assert p["floor_ratio"] == pytest.approx(p["wall_ms_per_step"] / p["floor_ms"])
    assert p["gpu_busy_frac_of_wall"] + p["gpu_idle_frac_of_wall"] == pytest.approx(1.0)
    assert p["host_ms_per_step"] == pytest.approx(p["wall_ms_per_step"])  # no device to wait for
    assert p["flops_per_step"] == 2e6
    assert p["mfu_at_floor"] == pytest.approx(2e6 / (p["floor_ms"] / 1e3) / PEAK_BF16)
    assert p["mfu_at_floor"] >= p["mfu_profiled"] > 0
    assert "mfu_at_floor" not in profiling.profile_steps(step, [torch.randn(4, 64)], flops=[None])
    assert set(profiling.summary(p)) >= {"wall_ms_per_step", "floor_ms", "floor_ratio", "top_categories_ms"}


class Event:
    """A kineto event as profile_steps reads it (name, device, start and duration in ns)."""

    def __init__(self, name, cuda, start, dur):
        self._name, self._cuda, self._start, self._dur = name, cuda, start, dur

    def name(self):
        return self._name

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._cuda else torch.autograd.DeviceType.CPU

    def start_ns(self):
        return self._start

    def duration_ns(self):
        return self._dur


def test_gpu_step_times_from_kineto_events():
    """Two steps in 10 ms of wall time: 4 ms of kernels (one idle gap of 2 ms), the host 5 ms in
    a sync and a blocking copy that overlap by 1 ms."""
    ms = 1_000_000
    events = [Event("nvjet_sm90_tst_128x256_gemm", True, 0, 3 * ms), Event("triton_poi_fused_add", True, 5 * ms, ms),
              Event("## Call CompiledFxGraph abc ##", True, 0, 6 * ms),  # an annotation, not a kernel
              Event("cudaLaunchKernel", False, 0, ms // 100),  # the host's own work
              Event("cudaStreamSynchronize", False, 4 * ms, 3 * ms), Event("cudaMemcpyAsync", False, 6 * ms, 3 * ms)]
    p = profiling.step_times(events, wall=0.010, n=2, flops=[2e12, 2e12])
    assert p["kernel_ms_per_step_by_category"] == {"gemm": 1.5, "elementwise/other": 0.5}
    assert p["floor_ms"] == p["kernel_ms_per_step"] == pytest.approx(2.0) and p["floor_ratio"] == pytest.approx(2.5)
    assert p["gpu_busy_frac_of_wall"] == pytest.approx(0.4) and p["gpu_idle_frac_of_wall"] == pytest.approx(0.6)
    assert p["host_wait_ms_per_step"] == pytest.approx(2.5) and p["host_ms_per_step"] == pytest.approx(2.5)
    assert p["largest_idle_gaps"] == [{"ms": 2.0, "after": "nvjet_sm90_tst_128x256_gemm",
                                       "before": "triton_poi_fused_add"}]
    assert p["runtime_calls_per_step"] == {"cudaStreamSynchronize": {"calls": 0.5, "ms": 1.5},
                                           "cudaMemcpyAsync": {"calls": 0.5, "ms": 1.5}}
    assert p["mfu_at_floor"] == pytest.approx(2e12 / 2e-3 / PEAK_BF16)
    assert profiling.step_times(events[3:], 0.01, 2) == {"wall_ms_per_step": 5.0, "note": "no CUDA events"}


def test_diagnose_warms_up_on_the_first_batch_and_reads_flops_from_stats():
    seen = []
    batches = [{"x": torch.ones(2), "stats": {"flops": float(i)}} for i in range(4)]
    out = profiling.diagnose({"profile": True, "profile_steps": 2}, lambda b: seen.append(b["stats"]["flops"]),
                             iter(batches))
    assert seen == [0.0, 1.0, 2.0] and out["profile"]["steps"] == 2
    assert out["profile"]["flops_per_step"] == 1.5  # batches 1 and 2, not the warm-up
    assert profiling.diagnose({}, None, iter([])) == {}


def test_timed_loss_keeps_the_last_batches_as_the_loss_got_them():
    timed = TimedLoss(lambda m, b: (b["x"].sum(), 1), stats=lambda b: b.pop("stats"), keep=2)
    for i in range(3):
        timed(None, {"x": torch.full((2,), float(i)), "stats": {"n": i}})
    assert [float(b["x"][0]) for b in timed.recent] == [1.0, 2.0]
    assert [b["stats"]["n"] for b in timed.recent] == [1, 2]  # copied before the stats were taken off
    assert len(TimedLoss(lambda m, b: None).recent) == 0


@pytest.mark.timeout(180)
def test_voxcpm_profile_option_on_cpu(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_voxcpm.py"), "--dry", "--inline", "--peers",
                           "ddptrain_best_md320", "--profile", "--profile-steps", "2", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "PROFILE ddptrain_best_md320" in proc.stdout
    row = json.loads(out.read_text().splitlines()[-1])
    p = row["profile"]
    assert p["steps"] == 2 and p["floor_ms"] > 0 and p["floor_ratio"] >= 1.0
    assert p["kernel_ms_per_step_by_category"] and p["host_ms_per_step"] > 0
    assert p["flops_per_step"] > 0 and p["mfu_at_floor"] >= p["mfu_profiled"] > 0
    line = profile_table.line(row)
    assert line[0] == "voxcpm_tiny_dry" and line[3] != "no profile"


def test_profile1_profiles_every_workload_of_the_issue_on_one_gpu(tmp_path):
    (stage,) = gpu_session.SCRIPT_PLANS["profile1"]
    labels = [j.label for j in stage]
    assert labels == ["vox_prof", "glm_cut_prof", "glm_win30_prof", "b9_lora_prof", "wh_prof", "w2v_prof"]
    os.makedirs(tmp_path / "logs")
    for job in stage:
        assert job.gpus == "0"
        if isinstance(job, gpu_session.Script):
            assert "--profile" in job.args, job.label
        else:
            assert all(e.get("profile") for e in job.experiments()), job.label
        for dry in (False, True):
            cmd = gpu_session.job_cmd(job, str(tmp_path), dry, 29500, str(tmp_path / "scratch"))
            assert os.path.exists(next(c for c in cmd if c.startswith(BENCH))) and not any("{" in c for c in cmd)
    assert sum(j.timeout for j in stage) > 530  # the budget, not the timeouts, bounds the call


ROWS = [
    {"workload": "voxcpm15_tts", "peer": "ddptrain_best_md320", "elapsed_s": 4.0, "steps": 8, "mfu": 0.073,
     "profile": {"wall_ms_per_step": 480.0, "kernel_ms_per_step": 120.0, "gpu_idle_frac_of_wall": 0.75,
                 "host_ms_per_step": 450.0, "floor_ms": 120.0, "floor_ratio": 4.0, "mfu_at_floor": 0.29,
                 "kernel_ms_per_step_by_category": {"gemm": 70.0, "elementwise/other": 30.0, "attention": 12.0,
                                                    "optimizer/foreach": 8.0}}},
    {"workload": "glmasr_cut", "peer": "ddptrain_bf16_compile_cut", "step_ms": [230.0, 900.0, 232.0], "mfu": 0.26,
     "profile": {"wall_ms_per_step": 236.0, "kernel_ms_per_step": 180.0, "gpu_idle_frac_of_wall": 0.2,
                 "host_ms_per_step": 200.0, "floor_ms": 180.0, "floor_ratio": 236 / 180,
                 "kernel_ms_per_step_by_category": {"gemm": 100.0}}},
    {"workload": "glm4v_9b", "name": "lora_ddptrain", "lora": True, "tokens_per_step": 8192, "step_ms_all": [1410.0],
     "step_ms_median": 1410.0, "mfu": 0.259, "profile": {"floor_ms": 1300.0, "floor_ratio": None}},
    {"workload": "whisper", "name": "ddptrain_b24", "error": "did not finish within 150 s"},
    {"workload": "wav2vec2", "name": "ddptrain_500", "step_ms_median": 190.0},
]


def test_profile_table_from_a_results_file(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert profile_table.main([str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| workload | peer | step ms") and lines[1].startswith("|---|")
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in lines[2:]]
    assert len(cells) == len(ROWS) and all(len(c) == len(profile_table.HEADER) for c in cells)
    vox, cut, b9, wh, w2v = cells
    assert vox == ["VoxCPM-1.5", "ddptrain_best_md320", "500.0", "480.0", "120.0", "75.0%", "450.0",
                   "gemm 70.0, elementwise/other 30.0, attention 12.0", "120.0 (4.00x)", "7.3%", "29.0%"]
    assert cut[:3] == ["GLM-ASR-Nano, cut windows", "ddptrain_bf16_compile_cut", "232.0"]  # the median step
    assert cut[8] == "180.0 (1.31x)" and cut[10] == "-"
    assert b9[:3] == ["GLM-4.1V-9B LoRA, 8192 tokens", "lora_ddptrain", "1410.0"] and b9[8] == "1300.0"
    assert wh[2] == "error: did not finish within 150 s"
    assert w2v[2:4] == ["190.0", "no profile"]


def test_profile_table_names_a_line_that_is_not_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        profile_table.read_rows([str(path)])
