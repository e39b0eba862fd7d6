"""The multi-GPU plans of issue 22 (bench/MULTI_GPU_PLAN.md) are ready to run: every plan
constructs for its machine, its jobs' commands name real scripts with a row file, and each new
code path dry-runs on CPU with tiny models on 2 gloo ranks: a scaling job (bench/run.py under
torchrun, per-GPU memory/clock/power columns), the VoxCPM 4-vs-1 jobs (sharded latents, one
GPU on the N-GPU run's batches) through bench/gpu_session.py, and the GLM-ASR driver
(bench/multi/glmasr.py: bench_glmasr's peers sharded over ranks, one row for all).

Why: those plans wait for 2- and 4-GPU machines that are rarely lent; a broken plan found then
costs the device time of a whole call.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import gpu_session  # noqa: E402

# machine kind -> the plans of MULTI_GPU_PLAN.md that run on it
KINDS = {"nvidia-h200-x2": (2, ["scaling2", "glmasr2"]), "nvidia-h200-x4": (4, ["scaling4", "glmasr4", "large4"])}


def rows(path):
    return [json.loads(x) for x in open(path).read().splitlines() if x.strip()]


def plan(name):
    return {**gpu_session.PLANS, **gpu_session.SCRIPT_PLANS}[name]


def test_every_issue22_plan_fits_its_machine_and_names_real_scripts(tmp_path):
    from run import check_experiments

    os.makedirs(tmp_path / "logs")
    for kind, (gpus, names) in KINDS.items():
        for name in names:
            used = set()
            for stage in plan(name):
                gpu_session.check_stage(stage)
                for job in stage:
                    used |= set(job.gpus.split(","))
                    if not isinstance(job, gpu_session.Script):
                        check_experiments(job.experiments())
                    for dry in (False, True):
                        cmd = gpu_session.job_cmd(job, str(tmp_path), dry, 29500, str(tmp_path / "scratch"))
                        n = len(job.gpus.split(","))
                        assert (f"--nproc_per_node={min(n, 2) if dry else n}" in cmd) == (n > 1), (name, job.label)
                        script = next(c for c in cmd if c.startswith(BENCH))
                        assert os.path.exists(script), script
                        assert not any("{" in c for c in cmd), cmd  # every placeholder filled
                        assert any(os.path.join("rows", f"{job.label}.jsonl") in c for c in cmd)
            assert used <= {str(i) for i in range(gpus)}, f"{name} uses GPUs {used}, {kind} has {gpus}"


def test_jobs_of_a_stage_may_not_share_a_gpu_unawares():
    s = gpu_session.Script
    gpu_session.check_stage([s("a", "0,1", ["x.py"], 1), s("b", "0,1", ["x.py"], 1), s("c", "2", ["x.py"], 1)])
    with pytest.raises(ValueError, match="a .GPUs 0. and b .GPUs 0,1. would share a GPU"):
        gpu_session.check_stage([s("a", "0", ["x.py"], 1), s("b", "0,1", ["x.py"], 1)])


def test_scaling_compares_with_the_as_world_row_else_the_same_name():
    got = gpu_session.scaling([
        {"workload": "w", "name": "b24_as2", "world_size": 1, "samples_per_s": 50.0},
        {"workload": "w", "name": "b24", "world_size": 1, "samples_per_s": 40.0},
        {"workload": "w", "name": "b24", "world_size": 2, "samples_per_s": 90.0},
        {"workload": "g", "peer": "ddp", "world_size": 1, "samples_per_s": 10.0},
        {"workload": "g", "peer": "ddp", "world_size": 4, "samples_per_s": 36.0},
        {"workload": "g", "peer": "ddp", "world_size": 2, "error": "OOM"},
    ])
    assert [(e["name"], e["world_size"], e["baseline"], round(e["efficiency"], 3)) for e in got] == [
        ("b24", 2, "b24_as2", 0.9), ("ddp", 4, "ddp", 0.9)]


def test_a_job_that_dies_without_a_row_leaves_an_error_row(tmp_path):
    job = gpu_session.Script("boom", "0,1", ["bench_voxcpm.py"], 5)
    os.makedirs(tmp_path / "rows")
    gpu_session.collect(job, str(tmp_path), -9, "did not finish within 5 s (start, compile and steps): killed", "tail")
    (row,) = rows(tmp_path / "results.jsonl")
    assert row["name"] == "boom" and row["world_size"] == 2 and "did not finish" in row["error"] and row["job"] == "boom"


def test_a_job_that_times_out_without_a_row_leaves_an_error_row_and_the_next_job_runs(tmp_path, monkeypatch):
    """A timed-out Job (not a Script) used to crash collect, and with it every later job of the call."""
    slow = gpu_session.Job("slow", "0", "whisper", [gpu_session.E("a", "ddptrain")], 1)
    fast = gpu_session.Job("fast", "0", "conformer", [gpu_session.E("b", "ddptrain")], 60)
    scripts = {"slow": "import time; time.sleep(60)",
               "fast": "import json, sys; open(sys.argv[1], 'a').write(json.dumps({'workload': 'conformer', "
                       "'name': 'b', 'samples_per_s': 1.0}) + '\\n')"}
    monkeypatch.setattr(gpu_session, "job_cmd", lambda job, out, dry, port, scratch: [
        sys.executable, "-c", scripts[job.label], os.path.join(out, "rows", f"{job.label}.jsonl")])
    for d in ("rows", "logs"):
        os.makedirs(tmp_path / d)
    failed = gpu_session.run_stage([slow, fast], str(tmp_path), True, __import__("time").time(), 120)
    got = rows(tmp_path / "results.jsonl")
    assert failed == 1 and [r["job"] for r in got] == ["slow", "fast"]
    assert got[0]["workload"] == "whisper" and "did not finish within 1 s" in got[0]["error"]
    assert got[1]["name"] == "b" and "error" not in got[1]


def test_voxcpm_plan_stays_in_one_epoch_on_four_ranks():
    """large4's VoxCPM jobs: 5 + 10 steps a rank on 4 ranks (and 4x that on one GPU) within one
    epoch of the 3,200-utterance plan, else the 1-GPU run would not see the 4-GPU run's batches."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import bench_voxcpm as bv
    import finetune_tts as ft
    import tts_cache

    import ddptrain
    from models import voxcpm_tts as vt

    vox = next(j for s in plan("large4") for j in s if j.label == "vox4").args
    opt = lambda k: int(vox[vox.index(k) + 1])  # noqa: E731
    layout = vt.preset_config("voxcpm1.5", 0, "bfloat16")
    speech = bv.corpus(opt("--utterances"), layout.lm_config.vocab_size, layout.audio_vae_config.sample_rate)
    d = speech.durations
    hop, patch = math.prod(layout.audio_vae_config.encoder_rates), layout.patch_size
    utts = [tts_cache.CachedUtterance(str(i), str(i), "-", -(-int(x * layout.audio_vae_config.sample_rate)
                                                               // (hop * patch)) * patch, "synthetic", i + 1)
            for i, x in enumerate(d)]
    ov = [o for o in bv.OVERRIDES[vox[vox.index("--peer") + 1]] if o.startswith("data.")] + ["data.num_workers=0"]
    cfg = ddptrain.load_config(os.path.join(ROOT, "configs", "tts_voxcpm15.yaml"), ov, schema=ft.RecipeConfig)
    by_text = {str(i): speech.tokens(i).tolist() for i in range(len(d))}
    per_rank = [len(ft.build_loader(utts, cfg, by_text.__getitem__, layout, True, 4, r)) for r in range(4)]
    assert min(per_rank) >= opt("--warmup") + opt("--steps") + 1, per_rank


@pytest.mark.timeout(120)
def test_scaling_job_on_two_ranks_reports_every_gpu(tmp_path):
    assert gpu_session.main(["scaling2", "--dry", "--jobs", "cf2", "--out", str(tmp_path)]) == 0
    (r,) = rows(tmp_path / "results.jsonl")
    assert r["workload"] == "conformer" and r["world_size"] == 2 and r["samples_per_s"] > 0 and "error" not in r
    assert len(r["peak_alloc_gb_per_gpu"]) == len(r["sm_clock_mhz_per_gpu"]) == len(r["power_w_per_gpu"]) == 2
    assert r["job"] == "cf2" and not os.path.exists(tmp_path / "rows")  # merged, then removed


@pytest.mark.timeout(150)
def test_voxcpm_four_vs_one_jobs_dry_run_on_identical_work(tmp_path):
    assert gpu_session.main(["large4", "--dry", "--jobs", "vox*", "--out", str(tmp_path)]) == 0
    by = {r["peer"]: r for r in rows(tmp_path / "results.jsonl")}
    one, two = by["ddptrain_best_md320_as2"], by["ddptrain_best_md320"]
    assert (one["world_size"], one["as_world"], two["world_size"]) == (1, 2, 2)
    assert len(two["peak_alloc_gb_per_gpu"]) == len(two["samples_per_s_per_rank"]) == 2
    # the same batches: as many utterances, as much audio, the same padding
    for key in ("padding_fraction",):
        assert one[key] == pytest.approx(two[key])
    assert (one["samples"], one["audio_s"]) == (two["samples"], two["audio_s"])
    assert "ddptrain_best_md320 x2" in gpu_session.table(str(tmp_path / "results.jsonl"))


def glmasr_two_ranks(tmp_path, peer, *extra):
    out = tmp_path / "glm.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={29400 + os.getpid() % 500}",
           os.path.join(BENCH, "multi", "glmasr.py"), "--peer", peer, "--out", str(out), "--tmp", str(tmp_path / "t"),
           "--preset", "tiny", "--batch", "2", "--warmup", "1", "--steps", "2", "--workers", "0", *extra]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (row,) = rows(out)
    return row


@pytest.mark.timeout(120)
def test_glmasr_driver_shards_ddptrain_over_two_ranks(tmp_path):
    # the plan's peer without its compiled layers (aot_eager would add ~15 s here; the plan's
    # own dry run, `gpu_session.py glmasr4 --dry`, compiles them)
    row = glmasr_two_ranks(tmp_path, gpu_session.GLM_DDP, "--ov=compile.enabled=false")
    assert row["peer"] == gpu_session.GLM_DDP and row["world_size"] == 2 and row["batch"] == 2
    assert row["samples_per_step"] == 4 and len(row["peak_alloc_gb_per_gpu"]) == 2
    a, b = row["audio_s_per_rank"]
    assert a != b  # each rank its own share of the batch plan, not rank 0's
    assert row["samples_per_s"] == pytest.approx(4 * row["steps"] / row["elapsed_s"])


@pytest.mark.timeout(200)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the HF + ZeRO-2 peer needs deepspeed")
def test_glmasr_driver_runs_the_hf_deepspeed_peer_on_two_ranks(tmp_path):
    row = glmasr_two_ranks(tmp_path, gpu_session.GLM_DS2)
    assert row["peer"] == "hf_ds2" and row["world_size"] == 2 and len(row["samples_per_s_per_rank"]) == 2
