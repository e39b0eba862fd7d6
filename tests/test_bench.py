"""The benchmark tools still run: every bench module imports, every current plan constructs, a
plan's Conformer jobs dry-run on CPU with tiny models, and failures are reported.

Why: a broken attribute in a peer (the deferred-sync prototype read ``Trainer._stop_requested``
long after it was gone) used to become an error row in a results file and an exit status of 0,
so nothing noticed until a GPU session had been spent on it.
"""

import importlib
import importlib.util
import json
import os
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

MODULES = ["flops", "measure", "profiling", "workloads", "peers", "run", "gpu_session", "check_flops",
           "bench_balance", "bench_padding", "bench_dataloading", "bench_9b", "bench_glmasr",
           "bench_voxcpm", "bench_shards", "calib", "nccl_probe", "check_offload", "check_activation_offload",
           "check_sharded_grads", "check_streamed_base", "profile_table", "check_cuda_graphs", "bench_fused_update",
           "check_backends"]


def rows(path):
    return [json.loads(x) for x in open(path).read().splitlines() if x.strip()]


def test_every_bench_module_imports():
    for name in MODULES:
        importlib.import_module(name)
    listed = sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py"))
    assert listed == sorted(MODULES), "a bench/ file was added or removed: list it here"


def test_every_current_plan_constructs(tmp_path):
    import gpu_session
    from run import check_experiments

    os.makedirs(tmp_path / "logs")
    for plan, stages in gpu_session.PLANS.items():
        assert stages and all(stages), f"plan {plan} has an empty stage"
        for stage in stages:
            for job in stage:
                check_experiments(job.experiments())
                for dry in (False, True):
                    cmd = gpu_session.job_cmd(job, str(tmp_path), dry, 29500)
                    assert os.path.join(BENCH, "run.py") in cmd and ("tiny" in cmd) == dry
                    exps = json.load(open(tmp_path / "logs" / f"{job.label}.exps.json"))
                    check_experiments(exps)
                    assert [e["name"] for e in exps] == [e["name"] for e in job.exps]


@pytest.mark.timeout(180)
def test_dry_run_of_a_plans_conformer_jobs_on_cpu(tmp_path, capsys):
    import gpu_session

    rc = gpu_session.main(["peers1", "--dry", "--jobs", "cf*", "--out", str(tmp_path)])
    if rc != 0:
        with tarfile.open(tmp_path / "logs.tar.gz") as tar:
            logs = {m.name: tar.extractfile(m).read().decode()[-3000:] for m in tar.getmembers() if m.isfile()}
        pytest.fail(f"the dry run failed; job logs:\n{json.dumps(logs, indent=1)}")
    got = rows(tmp_path / "results.jsonl")
    assert sorted(r["peer"] for r in got) == ["bare", "ddptrain"]
    for r in got:
        assert "error" not in r, r["error"]
        assert r["workload"] == "conformer" and r["steps"] == 2 and r["samples_per_s"] > 0
        assert r["gpu"] == "cpu" and r["torch"] and r["date"]


def test_a_failed_experiment_is_an_error_row_and_exit_status_1(tmp_path):
    import run

    exps = [{"name": "bad", "peer": "ddptrain", "budget": 40, "workers": 0, "ov": ["trainer.grad_accum_steps=0"]}]
    out = tmp_path / "r.jsonl"
    assert run.main(["--workload", "conformer", "--preset", "tiny", "--out", str(out), "--tmp", str(tmp_path),
                     "--exps", json.dumps(exps)]) == 1
    (row,) = rows(out)
    assert row["name"] == "bad" and "grad_accum_steps" in row["error"]


def test_removed_or_misspelt_experiment_keys_are_refused():
    from run import check_experiments, load_experiments

    with pytest.raises(ValueError, match="x1: unknown experiment key.*deferred"):
        check_experiments([{"name": "x1", "peer": "ddptrain", "deferred": 1}])
    with pytest.raises(ValueError, match="x2: unknown peer 'deepspeed2'"):
        check_experiments([{"name": "x2", "peer": "deepspeed2"}])
    with pytest.raises(ValueError, match="expected a JSON list"):
        load_experiments('{"name": "x3", "peer": "bare"}')


def test_hf_peers_say_what_they_cannot_run():
    import peers

    with pytest.raises(RuntimeError, match="not the Conformer"):
        peers.PEERS["hf"]("conformer", "tiny", {"name": "x", "peer": "hf"}, 1, 2, "/tmp")
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(RuntimeError, match="needs deepspeed"):
            peers.PEERS["hf_ds2"]("whisper", "tiny", {"name": "x", "peer": "hf_ds2"}, 1, 2, "/tmp")


def test_plan_selection_names_what_does_not_exist():
    import gpu_session

    stages = gpu_session.PLANS["peers1"]
    assert [j.label for s in gpu_session.select(stages, "", "cf*") for j in s] == ["cf_ddp", "cf_bare"]
    with pytest.raises(ValueError, match="matches no job"):
        gpu_session.select(stages, "", "nothing*")
    with pytest.raises(ValueError, match="stages 0-0"):
        gpu_session.select(stages, "3", "")


def test_balance_tool_on_the_shipped_manifest(capsys):
    import bench_balance

    got = bench_balance.main(["--manifest", os.path.join(ROOT, "examples/data/digits/base/train.jsonl"),
                              "--budget", "60", "--worlds", "2", "--epochs", "1"])
    by_plan = {r["plan"]: r["balance"] for r in got}
    assert 0 < by_plan["sync_buckets=false"] < by_plan["sync_buckets=true"] <= 1


@pytest.mark.timeout(240)
def test_dry_run_of_the_hf_trainer_peer_where_accelerate_is_installed(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the HF Trainer needs it (the dev extra installs it; an older .venv may lack it)
    import gpu_session

    assert gpu_session.main(["peers1", "--dry", "--jobs", "wh_hf", "--out", str(tmp_path)]) == 0
    (row,) = rows(tmp_path / "results.jsonl")
    assert row["peer"] == "hf" and row["hf_mode"] == "eager" and row["steps"] == 2 and row["samples_per_s"] > 0


@pytest.mark.timeout(240)
def test_glmasr_hf_grouped_peer_uses_the_hf_trainers_length_grouping(tmp_path):
    # the HF Trainer's group_by_length (its best setting for variable lengths) must pad less
    # than its random batches on the same corpus, or the peer is not what its name says
    pytest.importorskip("accelerate")  # the HF Trainer needs it (the dev extra installs it; an older .venv may lack it)
    import bench_glmasr

    out = tmp_path / "r.jsonl"
    rc = bench_glmasr.main(["--preset", "tiny", "--warmup", "1", "--steps", "3", "--workers", "0",
                            "--peers", "hf,hf_grouped", "--out", str(out)])
    assert rc == 0
    # audio seconds per padded decoder position: the share of a batch that is not padding (a
    # grouped batch of long utterances is long too, so its padded length alone says nothing)
    fill = {r["peer"]: r["audio_s_per_s"] / r["samples_per_s"] / r["mean_decoder_length"] for r in rows(out)}
    assert fill["hf_grouped"] > 1.3 * fill["hf"]


def test_glmasr_ddptrain_peer_is_timed_at_the_trainers_step(tmp_path):
    # measure.TimedSteps: the clock and the batch stats at each train_step, the stats taken out of
    # the batch before the Trainer sees it (compile.cuda_graphs keys host numbers by value)
    import bench_glmasr

    out = tmp_path / "r.jsonl"
    assert bench_glmasr.main(["--preset", "tiny", "--warmup", "1", "--steps", "3", "--workers", "0",
                              "--peers", "ddptrain_cut", "--out", str(out)]) == 0
    (row,) = rows(out)
    assert "error" not in row, row.get("error")
    assert len(row["step_ms"]) == 3 and all(ms > 0 for ms in row["step_ms"])
    assert row["samples_per_s"] > 0 and row["audio_s_per_s"] > 0


def test_a_peer_process_that_fails_or_runs_too_long_is_an_error_row(tmp_path):
    # measure.peer_row: how bench_glmasr.py and bench_voxcpm.py run each peer
    from measure import peer_row

    row_file = str(tmp_path / "row.json")
    write = f"import json; json.dump({{'peer': 'p', 'x': 1}}, open({row_file!r}, 'w'))"
    assert peer_row([sys.executable, "-c", write], row_file, 60, peer="p") == (True, {"peer": "p", "x": 1})
    ok, row = peer_row([sys.executable, "-c", "print('half way'); raise SystemExit(3)"], str(tmp_path / "no.json"), 60,
                       peer="p", batch=2)
    assert not ok and (row["peer"], row["batch"]) == ("p", 2) and "half way" in row["error"]
    slow = "import time; print('started', flush=True); time.sleep(60)"
    ok, row = peer_row([sys.executable, "-c", slow], str(tmp_path / "no.json"), 3, peer="slow")
    assert not ok and row["error"] == "did not finish within 3 s" and "started" in row["tail"]


def test_a_voxcpm_peer_that_ran_out_of_memory_is_a_readable_error_row():
    import bench_voxcpm as bv

    tail = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
    row = bv.failed_row({"peer": "upstream", "batch": 32, "error": tail})
    assert row["error"].startswith("torch.OutOfMemoryError") and row["oom"] and row["tail"] == tail
    assert row["batch"] == 32
    row = bv.failed_row({"peer": "p", "error": "Traceback\nValueError: bad\n"})
    assert row["error"] == "ValueError: bad" and not row["oom"]
    # a timeout keeps its own message; the output's tail decides whether memory ran out first
    row = bv.failed_row({"peer": "p", "error": "did not finish within 9 s", "tail": "CUDA out of memory"})
    assert row["error"] == "did not finish within 9 s" and row["oom"]


def test_upstreams_length_filter_drops_what_its_script_drops():
    # scripts/train_voxcpm_finetune.py: max_sample_len = max_batch_tokens // batch_size over
    # compute_sample_lengths' text + ceil(ceil(seconds x fps) / patch) + 2 (+ the reference's + 2)
    import math

    import bench_voxcpm as bv

    speech = bv.corpus(40, 512, 16000)
    length = lambda i: len(speech.tokens(i)) + math.ceil(math.ceil(speech.durations[i] * 25) / 4) + 2  # noqa: E731
    lengths = [length(i) for i in range(40)]
    limit = sorted(lengths)[20]
    keep = bv.upstream_keep(speech, 4, 4 * limit + 3, 25.0, 4, ref=False)  # 4 * limit + 3 // 4 == limit
    assert keep == [i for i in range(40) if lengths[i] <= limit] and 20 <= len(keep) < 40
    assert bv.upstream_keep(speech, 4, 0, 25.0, 4, ref=False) == list(range(40))
    with_ref = bv.upstream_keep(speech, 4, 4 * limit + 3, 25.0, 4, ref=True)  # each also carries the next one's audio
    assert with_ref == [i for i in range(40) if lengths[i] + lengths[(i + 1) % 40] - len(speech.tokens((i + 1) % 40))
                        <= limit]


def test_the_voxcpm2_plan_names_peers_the_bench_knows_and_times_out_inside_its_jobs():
    import bench_voxcpm as bv
    import gpu_session

    jobs = [j for stage in gpu_session.SCRIPT_PLANS["voxcpm2"] for j in stage]
    peers = set(bv.OVERRIDES) | set(bv.UPSTREAM_PEERS)
    for job in jobs:
        opt = lambda k: job.args[job.args.index(k) + 1]  # noqa: E731
        assert job.gpus == "0" and opt("--arch") == "voxcpm2" and opt("--peers") in peers, job.label
        assert float(opt("--timeout")) < job.timeout, f"{job.label}: the bench must write its row before the kill"
    assert {j.args[j.args.index("--peers") + 1] for j in jobs} >= {
        "ddptrain_best_md320", "upstream", "ddptrain_lora_md320", "upstream_lora", "ddptrain_offload_rc_md320"}


def test_the_perf1_plan_runs_what_issue_31_asks_next_in_order_on_one_gpu():
    import bench_9b
    import bench_voxcpm as bv
    import gpu_session

    (stage,) = gpu_session.SCRIPT_PLANS["perf1"]
    assert [j.label for j in stage] == ["vox15_prof", "v2_ddp", "v2_lora_ddp", "b9_lora_compiled", "sharded_grads"]
    assert all(j.gpus == "0" and os.path.exists(os.path.join(BENCH, j.args[0])) for j in stage)
    opt = lambda job, k: job.args[job.args.index(k) + 1]  # noqa: E731
    vox, v2, v2_lora, b9, _ = stage
    assert opt(vox, "--peer") == "ddptrain_best_md320" and "--profile" in vox.args and "--arch" not in vox.args
    for job, peer in ((v2, "ddptrain_best_md320"), (v2_lora, "ddptrain_lora_md320")):
        assert opt(job, "--arch") == "voxcpm2" and opt(job, "--peers") == peer and peer in bv.OVERRIDES
        assert float(opt(job, "--timeout")) < job.timeout
    jobs = opt(b9, "--jobs").split(",")
    assert b9.args[1] == "plan" and "--profile" in b9.args and jobs[0] == "lora_ddptrain_compiled"
    assert bench_9b.COMPILED_VS_EAGER["lora_ddptrain_compiled"] in jobs  # the plan then compares them
    assert sum(j.timeout for j in stage[:-1]) < 1100  # each ~1.7x its estimate; --budget 540 bounds the call


def test_timed_loss_windows_the_timed_steps():
    from measure import TimedLoss

    timed = TimedLoss(lambda model, batch: batch["n"], stats=lambda batch: {"n": batch["n"]})
    assert [timed(None, {"n": i}) for i in range(4)] == [0, 1, 2, 3]
    t = [c[0] for c in timed.calls]
    elapsed, stats, steps = timed.window(1, 2)
    assert elapsed == t[3] - t[1] and stats == [{"n": 1}, {"n": 2}] and steps == [t[2] - t[1], t[3] - t[2]]
    elapsed, stats, steps = timed.window(2, 2, end=t[3] + 5.0)  # the last step closed by the caller's clock
    assert elapsed == t[3] + 5.0 - t[2] and stats == [{"n": 2}, {"n": 3}] and steps[-1] == 5.0


def test_named_peers_and_rows_are_shared_by_the_model_benches(tmp_path, monkeypatch):
    from measure import append_row, named_peers

    overrides = {"a": ["old"]}
    assert named_peers("a,b", ["c=x.y=1,z.w=[p,q]", "a=k=v"], overrides) == ["a", "b", "c"]
    assert overrides == {"a": ["k=v"], "c": ["x.y=1", "z.w=[p,q]"]}  # a [list] value keeps its commas
    out = tmp_path / "new" / "rows.jsonl"
    append_row(str(out), {"x": 1})
    monkeypatch.setenv("RANK", "1")  # the other ranks of a run write nothing
    append_row(str(out), {"x": 2})
    assert rows(out) == [{"x": 1}]


@pytest.mark.timeout(240)
def test_check_sharded_grads_runs_on_cpu(tmp_path):
    """The script plays rank 0 of N under a fake group with its own comm hook; a Trainer default
    that takes the hook slot (the all-reduce timer did, in call s12b) must not break it."""
    import subprocess
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, os.path.join(BENCH, "check_sharded_grads.py"), "--out", str(out),
                           "--d", "32", "--layers", "2", "--worlds", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=220, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    got = rows(out)
    assert [(r["world_size"], r["shard_grads"]) for r in got] == [(2, False), (2, True)]
    assert got[1]["buckets"] >= 1
