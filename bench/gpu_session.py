"""Run a named plan of benchmark jobs on a GPU machine inside one time-boxed call.

A plan is a list of stages; the jobs of a stage run at the same time (jobs on different GPUs),
jobs that share a GPU one after the other, stages one after the other. Every experiment runs in
its own process (``bench/run.py``; a later experiment in a shared process was seen to run up to
14% slower), with a hard timeout (its process group is killed), so the call always ends and
returns what was measured: ``OUT/results.jsonl`` (one row per experiment), ``OUT/logs.tar.gz``
(every job's log) and a table on stdout. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and
friends). The exit status is 1 when an experiment failed or a job timed out.

    python3 bench/gpu_session.py peers1 --out "$OUT" --budget 540 --no-calib
    python3 bench/gpu_session.py peers1 --out /tmp/o --dry        # tiny models on CPU, same code paths
    python3 bench/gpu_session.py peers1 --out /tmp/o --dry --jobs 'cf*'   # only the Conformer jobs

The plans below are the current ones, one per question of BENCHMARKS.md; the plans that
produced the older rows (call1 ... call24) are in git history (``git show 7d7474f:bench/gpu_session.py``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field, replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

P = ["trainer.param_dtype=bf16"]  # bf16 model + fp32 master weights
WHISPER_BLOCKS = "[WhisperEncoderLayer,WhisperDecoderLayer]"
W2V_COMPILE = ["compile.enabled=true", "compile.module_classes=[Wav2Vec2EncoderLayerStableLayerNorm,"
               "Wav2Vec2FeatureEncoder,Wav2Vec2FeatureProjection,Wav2Vec2PositionalConvEmbedding]"]


@dataclass
class Job:
    """One process launch (torchrun when ``gpus`` lists several) running ``exps`` on ``workload``.

    Each experiment times a replay of ``steps`` batches after ``steps + 1`` warm-up steps (the
    first pass over the batches compiles and caches every shape), unless it sets its own.
    """

    label: str
    gpus: str  # CUDA_VISIBLE_DEVICES, e.g. "0" or "0,1"
    workload: str
    exps: list
    timeout: float  # seconds per process
    steps: int = 12
    env: dict = field(default_factory=dict)  # extra environment (e.g. NCCL settings)

    def experiments(self) -> list:
        return [dict({"replay": self.steps, "warmup": self.steps + 1, "steps": self.steps}, **e) for e in self.exps]


def E(name, peer, **kw):
    return dict(name=name, peer=peer, **kw)


def wh(name, *extra_ov, **kw):
    """ddptrain on Whisper-large-v3 at 24 windows per GPU, compiled whole with bf16 params (its best)."""
    return E(name, "ddptrain", batch=24, ov=P + ["compile.enabled=true", *extra_ov], **kw)


def w2v(name, *extra_ov, **kw):
    """ddptrain on wav2vec2-large at 500 s per GPU, blocks and front end compiled, bf16 params."""
    return E(name, "ddptrain", budget=500, ov=P + W2V_COMPILE + list(extra_ov), **kw)


PLANS = {
    # (a) against peers on one GPU, each at the same batch: ddptrain's best setting, the HF
    # Trainer eager and with torch_compile=True, the bare loop. One H200, ~9 minutes.
    #   python3 bench/gpu_session.py peers1 --out $OUT --budget 560 --no-calib
    "peers1": [
        [
            Job("wh_ddp", "0", "whisper", [wh("ddptrain_b24")], 220),
            Job("wh_hf", "0", "whisper", [E("hf_b24", "hf", batch=24)], 200),
            Job("wh_hfc", "0", "whisper", [E("hf_compile_b24", "hf_compile", batch=24)], 260),
            Job("w2v_ddp", "0", "wav2vec2", [w2v("ddptrain_500")], 200, steps=16),
            Job("w2v_hf", "0", "wav2vec2", [E("hf_gbl_b48", "hf", batch=48, hf_group=1)], 150, steps=16),
            Job("w2v_hfc", "0", "wav2vec2", [E("hf_compile_gbl_b48", "hf_compile", batch=48, hf_group=1)], 200,
                steps=16),
            Job("cf_ddp", "0", "conformer", [E("ddptrain_fp32", "ddptrain", budget=600)], 120, steps=24),
            Job("cf_bare", "0", "conformer", [E("bare", "bare", budget=600)], 120, steps=24),
        ],
    ],
    # (b) scaling on identical work: one GPU trains on the 2-GPU run's batches (as_world=2),
    # then 2 GPUs: default, 4 NCCL channels, the all-reduce after the backward. Two H200s.
    #   python3 bench/gpu_session.py scaling2 --out $OUT --budget 560 --no-calib
    "scaling2": [
        [
            Job("wh1", "0", "whisper", [wh("ddptrain_b24_as2", as_world=2)], 200, steps=24),
            Job("w2v1", "1", "wav2vec2", [w2v("ddptrain_500_as2", as_world=2)], 200, steps=24),
        ],
        [
            Job("wh2", "0,1", "whisper", [wh("ddptrain_b24")], 140),
            Job("wh2c4", "0,1", "whisper", [wh("ddptrain_b24_nch4")], 140, env={"NCCL_MAX_NCHANNELS": "4"}),
            Job("wh2o", "0,1", "whisper", [wh("ddptrain_b24_noov", "compile.ddp_overlap=false")], 140),
            Job("w2v2", "0,1", "wav2vec2", [w2v("ddptrain_500")], 160),
        ],
    ],
    # (b) the same at 4 GPUs (one GPU trains on the 4-GPU run's 48 batches). Four H200s.
    #   python3 bench/gpu_session.py scaling4 --out $OUT --budget 560 --no-calib
    "scaling4": [
        [
            Job("wh1", "0", "whisper", [wh("ddptrain_b24_as4", as_world=4)], 220, steps=48),
            Job("w2v1", "1", "wav2vec2", [w2v("ddptrain_500_as4", as_world=4)], 220, steps=48),
        ],
        [
            Job("wh4", "0,1,2,3", "whisper", [wh("ddptrain_b24")], 150),
            Job("w2v4", "0,1,2,3", "wav2vec2", [w2v("ddptrain_500")], 150),
        ],
    ],
    # (c) memory and ZeRO: model state at rest and throughput, plain DDP vs ZeRO, 2 GPUs, and the
    # 1-GPU reference for the memory estimator. Two H200s.
    #   python3 bench/gpu_session.py zero2 --out $OUT --budget 480 --no-calib
    "zero2": [
        [Job("wh1", "0", "whisper", [E("ddptrain_b16", "ddptrain", batch=16, ov=P + ["compile.enabled=true"])], 200)],
        [
            Job("wh2", "0,1", "whisper", [E("ddptrain_b16", "ddptrain", batch=16, ov=P + ["compile.enabled=true"])], 160),
            Job("wh2z", "0,1", "whisper", [E("ddptrain_b16_zero", "ddptrain", batch=16,
                                             ov=P + ["compile.enabled=true", "optim.zero=true"])], 160),
        ],
    ],
    # (d) recompute: Whisper-large-v3, 16 windows, one GPU, the checkpointed blocks compiled
    # inside their recompute regions; every 2nd layer and every layer against none. One H200.
    #   python3 bench/gpu_session.py recompute1 --out $OUT --budget 560 --no-calib
    "recompute1": [
        [
            Job("rc0", "0", "whisper", [E("ddptrain_b16", "ddptrain", batch=16, ov=P + [
                "compile.enabled=true", f"compile.module_classes={WHISPER_BLOCKS}"])], 180),
            Job("rc2", "0", "whisper", [E("ddptrain_b16_rc2", "ddptrain", batch=16, ov=P + [
                "compile.enabled=true", f"compile.module_classes={WHISPER_BLOCKS}", "recompute.enabled=true",
                f"recompute.module_classes={WHISPER_BLOCKS}", "recompute.every_k=2"])], 180),
            Job("rc1", "0", "whisper", [E("ddptrain_b16_rc1", "ddptrain", batch=16, ov=P + [
                "compile.enabled=true", f"compile.module_classes={WHISPER_BLOCKS}", "recompute.enabled=true",
                f"recompute.module_classes={WHISPER_BLOCKS}", "recompute.every_k=1"])], 180),
        ],
    ],
}


def env_for(gpus: str, dry: bool) -> dict:
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1" if dry else "4", TOKENIZERS_PARALLELISM="false")
    if not dry:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH", ""), ROOT) if p])
    return env


def dry_experiment(e: dict) -> dict:
    """The CPU dry-run form of an experiment: tiny batches, two replayed steps, no workers, and
    compilation traced without code generation (inductor's CPU code generation fails on some
    bf16 graphs)."""
    small = {"batch": 2} if "batch" in e else {}
    if e.get("peer") == "ddptrain" or "budget" in e:
        small["budget"] = 40
    out = dict(e, workers=0, profile_steps=1, compile_backend="aot_eager", **small)
    if out.get("replay"):
        out["replay"] = 2
    out["warmup"], out["steps"] = 1, 2
    return out


def job_cmd(job: Job, out_dir: str, dry: bool, port: int) -> list:
    """The command line of a job (torchrun for several GPUs or ``ddp1``); its experiments go to a file."""
    exps = job.experiments()
    if dry:
        exps = [dry_experiment(e) for e in exps]
    exps_file = os.path.join(out_dir, "logs", f"{job.label}.exps.json")
    with open(exps_file, "w") as f:
        json.dump(exps, f)
    py = sys.executable
    n = len(job.gpus.split(","))
    # ddp1 (diagnostic): one GPU under torchrun, so the Trainer makes a process group of one and
    # wraps the model in DDP: the cost of being a DDP rank, without a second rank
    ddp1 = any(e.get("ddp1") for e in exps)
    launch = ([py, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={port}"]
              if n > 1 or ddp1 else [py])
    return launch + [os.path.join(HERE, "run.py"), "--workload", job.workload, "--exps", "@" + exps_file,
                     "--out", os.path.join(out_dir, "results.jsonl"), "--tag", job.label,
                     "--preset", "tiny" if dry else "large", "--tmp", os.path.join(out_dir, "tmp")]


def one_per_process(stage: list) -> list:
    """Split every job of several experiments into one job (process) per experiment, in order;
    each keeps the job's timeout (the call's budget still bounds the whole stage)."""
    out = []
    for job in stage:
        if len(job.exps) == 1:
            out.append(job)
        else:
            out += [replace(job, label=f"{job.label}-{i}", exps=[e]) for i, e in enumerate(job.exps)]
    return out


def run_stage(stage: list, out_dir: str, dry: bool, t_start: float, budget_s: float) -> int:
    """Start the stage's jobs; jobs that share a GPU run in order. Returns the number of jobs
    that failed or timed out, once all have ended."""
    by_gpu: dict[str, list] = {}
    for job in stage:
        by_gpu.setdefault(job.gpus, []).append(job)
    port = 29500 + int(time.time()) % 1000
    failed = 0

    def start(job):
        nonlocal port
        left = budget_s - (time.time() - t_start)
        timeout = min(job.timeout, max(10, left - 5))
        port += 1
        logf = open(os.path.join(out_dir, "logs", f"{job.label}.log"), "w")
        print(f"[{time.time() - t_start:6.1f}s] start {job.label} on GPU {job.gpus}, timeout {timeout:.0f}s", flush=True)
        env = dict(env_for(job.gpus, dry), **job.env)
        p = subprocess.Popen(job_cmd(job, out_dir, dry, port), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        os.set_blocking(p.stdout.fileno(), False)
        return [p, job.label, time.time() + timeout, logf, ""]

    active = [(start(q.pop(0)), q) for q in by_gpu.values()]
    while active:
        time.sleep(0.2 if dry else 0.5)
        still = []
        for r, q in active:
            p, label, deadline, logf, _ = r
            try:
                chunk = p.stdout.read()
            except (TypeError, OSError):
                chunk = None
            if chunk:
                logf.write(chunk)
                r[4] += chunk
                *lines, r[4] = r[4].split("\n")
                for ln in lines:
                    if ln.startswith(("RESULT", "PROFILE", "SYNCS", "CALIB", "GAP")) or "Error" in ln or "error:" in ln:
                        print(f"[{label}] {ln[:1500]}", flush=True)
            if p.poll() is None and time.time() > deadline:
                print(f"[{label}] TIMEOUT: killing", flush=True)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.poll() is not None:
                try:
                    rest = p.stdout.read() or ""
                except (TypeError, OSError):  # a killed job's pipe can end mid-character
                    rest = ""
                logf.write(rest)
                logf.close()
                print(f"[{time.time() - t_start:6.1f}s] end {label} rc={p.returncode}", flush=True)
                failed += p.returncode != 0
                if q:
                    still.append((start(q.pop(0)), q))
            else:
                still.append((r, q))
        active = still
    return failed


def table(results_path: str) -> str:
    """The results file as a fixed-width table (one line per row)."""
    if not os.path.exists(results_path):
        return "(no results)"
    rows = [json.loads(x) for x in open(results_path) if x.strip()]
    hdr = f"{'workload':9s} {'gpus':>4s} {'name':22s} {'smp/s':>8s} {'audio-s/s':>10s} {'pad':>5s} {'MFU':>6s} " \
          f"{'peakGB':>7s} {'restGB':>7s} {'wait':>6s} {'idle':>6s} {'step ms':>8s} {'SM MHz':>7s} {'degC':>8s}"
    out = [hdr]
    for r in rows:
        if "error" in r:
            out.append(f"{r['workload']:9s} {r['world_size']:4d} {r['name']:22s} ERROR {r['error'][:90]}")
            continue
        idle = r.get("profile", {}).get("gpu_idle_frac_of_wall")
        wait = r.get("data_wait_frac")
        out.append(f"{r['workload']:9s} {r['world_size']:4d} {r['name']:22s} {r['samples_per_s']:8.1f} "
                   f"{r['audio_s_per_s']:10.1f} {r['padding_frac']:5.3f} {r['mfu']:6.3f} {r['peak_alloc_gb']:7.1f} "
                   f"{r.get('mem_at_rest_gb', float('nan')):7.2f} {wait if wait is None else round(wait, 3)!s:>6s} "
                   f"{idle if idle is None else round(idle, 3)!s:>6s} {r.get('step_ms_median') or 0:8.0f} "
                   f"{r.get('sm_clock_mhz', [None] * 3)[1]!s:>7s} {'-'.join(map(str, r.get('gpu_temp_c', []))):>8s}")
    return "\n".join(out)


def select(stages: list, stage_ids: str, jobs: str) -> list:
    """The stages (by index, ``"0,2"``) and jobs (label glob, ``"cf*"``) to run; empty = all.

    Raises:
        ValueError: naming a stage index out of range or a glob that matches no job.
    """
    pick = [int(s) for s in stage_ids.split(",")] if stage_ids else list(range(len(stages)))
    bad = [i for i in pick if not 0 <= i < len(stages)]
    if bad:
        raise ValueError(f"--stages {stage_ids}: the plan has stages 0-{len(stages) - 1}")
    chosen = [[j for j in stages[i] if not jobs or fnmatch.fnmatch(j.label, jobs)] for i in pick]
    if jobs and not any(chosen):
        raise ValueError(f"--jobs {jobs!r} matches no job of the plan")
    return [s for s in chosen if s]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", choices=sorted(PLANS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole plan")
    ap.add_argument("--dry", action="store_true", help="tiny models on CPU")
    ap.add_argument("--stages", default="", help="comma-separated stage indices to run (default all)")
    ap.add_argument("--jobs", default="", help="only the jobs whose label matches this glob")
    ap.add_argument("--no-calib", action="store_true", help="skip nvidia-smi and bench/calib.py")
    ap.add_argument("--shared-process", action="store_true",
                    help="run a job's experiments in one process (see one_per_process)")
    a = ap.parse_args(argv)
    from run import check_experiments  # a stale plan fails here, before any device time is spent

    stages = select(PLANS[a.plan], a.stages, a.jobs)
    for stage in stages:
        for job in stage:
            check_experiments(job.experiments())
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    t0 = time.time()
    if not a.dry and not a.no_calib:
        subprocess.run("nvidia-smi; nvidia-smi topo -m", shell=True)
        subprocess.run([sys.executable, os.path.join(HERE, "calib.py")], env=env_for("0", False))
    failed = 0
    for i, stage in enumerate(stages):
        if time.time() - t0 > a.budget - 20:
            print(f"skipping stage {i}: budget spent", flush=True)
            failed += len(stage)
            continue
        failed += run_stage(stage if a.shared_process else one_per_process(stage), a.out, a.dry, t0, a.budget)
    with tarfile.open(os.path.join(a.out, "logs.tar.gz"), "w:gz") as tar:
        tar.add(os.path.join(a.out, "logs"), arcname="logs")
    shutil.rmtree(os.path.join(a.out, "logs"))
    print(f"total {time.time() - t0:.0f}s, {failed} job(s) failed")
    print(table(os.path.join(a.out, "results.jsonl")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
