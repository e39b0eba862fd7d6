"""The GPU benchmark tools still run: a tiny CPU dry run of the runner, failures reported.

A broken attribute in a peer (the deferred-sync prototype read ``Trainer._stop_requested`` long
after it was gone) used to become an error row in a results file and an exit status of 0, so
nothing noticed until a GPU session had been spent on it.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)


def run_bench(tmp_path, exps, workload="conformer"):
    out = tmp_path / "r.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_models.py"), "--workload", workload,
                        "--preset", "tiny", "--warmup", "1", "--steps", "2", "--out", str(out),
                        "--tmp", str(tmp_path / "t"), "--exps", json.dumps(exps)],
                       env=env, capture_output=True, text=True, timeout=120)
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return p, rows


@pytest.mark.timeout(150)
def test_tiny_dry_run_of_ddptrain_and_bare_has_no_error_rows(tmp_path):
    exps = [{"name": "ddp", "peer": "ddptrain", "budget": 40, "workers": 0},
            {"name": "bare", "peer": "bare", "budget": 40, "workers": 0}]
    p, rows = run_bench(tmp_path, exps)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [r["name"] for r in rows] == ["ddp", "bare"]
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["steps"] == 2 and r["samples_per_s"] > 0


@pytest.mark.timeout(150)
def test_a_failed_experiment_is_a_nonzero_exit_and_an_error_row(tmp_path):
    exps = [{"name": "bad", "peer": "ddptrain", "budget": 40, "workers": 0, "ov": ["trainer.grad_accum_steps=0"]}]
    p, rows = run_bench(tmp_path, exps)
    assert p.returncode == 1
    assert len(rows) == 1 and "grad_accum_steps" in rows[0]["error"]


def test_removed_or_misspelt_experiment_keys_are_refused():
    import bench_models

    with pytest.raises(ValueError, match="x1: unknown experiment key.*deferred"):
        bench_models.check_experiments([{"name": "x1", "peer": "ddptrain", "deferred": 1}])
    with pytest.raises(ValueError, match="unknown peer"):
        bench_models.check_experiments([{"name": "x2", "peer": "deepspeed2"}])


def test_every_plan_uses_known_experiment_keys():
    import bench_models
    import gpu_session

    for plan, stages in gpu_session.PLANS.items():
        for stage in stages:
            for job in stage:
                defaults = job[7] if len(job) > 7 else {}
                bench_models.check_experiments([dict(defaults, **e) for e in job[3]])
