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
``PLANS`` hold ``bench/run.py`` experiments; ``SCRIPT_PLANS`` launch the other bench scripts
(GLM-ASR, the 9B model, VoxCPM-1.5 and VoxCPM2), each job one process (or torchrun) that appends its own rows.
bench/MULTI_GPU_PLAN.md says which plan to run on which machine, in what order.
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
import tempfile
import time
from dataclasses import dataclass, field, replace

from profile_table import read_rows
from profile_table import table as profile_table

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


@dataclass
class Script:
    """One launch of another bench script (torchrun when ``gpus`` lists several) that appends its
    own JSON rows; ``{rows}`` and ``{tmp}`` in ``args`` become the job's row file and scratch
    folder. In ``--dry`` runs ``dry_args`` are appended and at most 2 ranks run (gloo, CPU)."""

    label: str
    gpus: str
    args: list  # the script (relative to bench/) and its arguments
    timeout: float  # seconds for the process (start, compile, steps); then its group is killed
    dry_args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)


def E(name, peer, **kw):
    return dict(name=name, peer=peer, **kw)


def wh(name, *extra_ov, **kw):
    """ddptrain on Whisper-large-v3 at 24 windows per GPU, compiled whole with bf16 params (its best)."""
    return E(name, "ddptrain", batch=24, ov=P + ["compile.enabled=true", *extra_ov], **kw)


def w2v(name, *extra_ov, **kw):
    """ddptrain on wav2vec2-large at 500 s per GPU, blocks and front end compiled, bf16 params."""
    return E(name, "ddptrain", budget=500, ov=P + W2V_COMPILE + list(extra_ov), **kw)


def cf(name, **kw):
    """ddptrain on the GPU Conformer at 600 s per GPU, fp32 params (its best, bench/NOTES.md item 28)."""
    return E(name, "ddptrain", budget=600, **kw)


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
    # then 2 GPUs: default, 4 NCCL channels, the all-reduce after the backward. Rows carry each
    # GPU's SM clock and power (the power-cap question). Two H200s, ~7 minutes.
    #   python3 bench/gpu_session.py scaling2 --out $OUT --budget 480 --no-calib
    "scaling2": [
        [
            Job("wh1", "0", "whisper", [wh("ddptrain_b24_as2", as_world=2)], 200, steps=24),
            Job("w2v1", "1", "wav2vec2", [w2v("ddptrain_500_as2", as_world=2)], 200, steps=24),
            Job("cf1", "1", "conformer", [cf("ddptrain_fp32_as2", as_world=2)], 100, steps=48),
        ],
        [
            Job("wh2", "0,1", "whisper", [wh("ddptrain_b24")], 140),
            Job("w2v2", "0,1", "wav2vec2", [w2v("ddptrain_500")], 140),
            Job("cf2", "0,1", "conformer", [cf("ddptrain_fp32")], 100, steps=24),
            Job("wh2c4", "0,1", "whisper", [wh("ddptrain_b24_nch4")], 120, env={"NCCL_MAX_NCHANNELS": "4"}),
            Job("wh2o", "0,1", "whisper", [wh("ddptrain_b24_noov", "compile.ddp_overlap=false")], 120),
        ],
    ],
    # (b) 1, 2 and 4 GPUs on one 4-GPU machine: each 1-GPU run trains on the batches of the
    # 2- or 4-GPU run (as_world), the 2-GPU runs on GPU pairs side by side. Four H200s, ~7 minutes.
    #   python3 bench/gpu_session.py scaling4 --out $OUT --budget 480 --no-calib
    "scaling4": [
        [
            Job("wh1a2", "0", "whisper", [wh("ddptrain_b24_as2", as_world=2)], 200, steps=24),
            Job("wh1a4", "1", "whisper", [wh("ddptrain_b24_as4", as_world=4)], 220, steps=48),
            Job("w2v1a2", "2", "wav2vec2", [w2v("ddptrain_500_as2", as_world=2)], 200, steps=24),
            Job("cf1a2", "2", "conformer", [cf("ddptrain_fp32_as2", as_world=2)], 100, steps=48),
            Job("w2v1a4", "3", "wav2vec2", [w2v("ddptrain_500_as4", as_world=4)], 220, steps=48),
            Job("cf1a4", "3", "conformer", [cf("ddptrain_fp32_as4", as_world=4)], 100, steps=96),
        ],
        [
            Job("wh2", "0,1", "whisper", [wh("ddptrain_b24")], 140),
            Job("w2v2", "2,3", "wav2vec2", [w2v("ddptrain_500")], 140),
            Job("cf2", "2,3", "conformer", [cf("ddptrain_fp32")], 100, steps=24),
        ],
        [
            Job("wh4", "0,1,2,3", "whisper", [wh("ddptrain_b24")], 150),
            Job("w2v4", "0,1,2,3", "wav2vec2", [w2v("ddptrain_500")], 150),
            Job("cf4", "0,1,2,3", "conformer", [cf("ddptrain_fp32")], 100, steps=24),
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


# ---------------------------------------------------------------- plans of other bench scripts

# GLM-ASR (issue 22, item 1): configs/glmasr.yaml's set-up against the HF Trainer + DeepSpeed
# ZeRO-2, 16 utterances per GPU, 30 warm-up steps (most decoder lengths seen once) + 20 timed
GLM = ["--warmup", "30", "--steps", "20", "--out", "{rows}", "--tmp", "{tmp}"]
GLM_DRY = ["--preset", "tiny", "--warmup", "1", "--steps", "2", "--batch", "2", "--workers", "0",
           "--ov=compile.backend=aot_eager"]  # inductor's CPU code generation takes minutes


def glm(label, gpus, peer, timeout):
    return Script(label, gpus, ["multi/glmasr.py", "--peer", peer, *GLM], timeout, GLM_DRY)


GLM_DDP, GLM_DS2 = "ddptrain_bf16_compile", "hf_ds2"

# the 10B full fine-tune (item 2): ZeRO with sharded masters, recompute, one 8192-token sequence per GPU
def b9(label, gpus, job, timeout):
    return Script(label, gpus, ["bench_9b.py", "job", job, "--out", "{rows}", "--tmp", "{tmp}"], timeout, ["--dry"])


# VoxCPM-1.5 (item 3): the 4.10x set-up (bf16 + masters, compiled layers, 320 padded latent
# seconds per GPU), 3,200 utterances so that 5 + 10 steps on each of 4 ranks stay in one epoch
VOX = ["bench_voxcpm.py", "--peer", "ddptrain_best_md320", "--utterances", "3200", "--warmup", "5", "--steps", "10",
       "--row", "{rows}", "--tmp", "{tmp}"]

# issue 31 item 1: a profile of every workload's ddptrain best after its timed steps (kernel time
# by category, GPU idle share, host time, the floor at zero host time); fewer timed steps than
# the throughput plans, enough warm-up to compile the shapes the profiled steps replay
PROF_GLM = ["--warmup", "24", "--steps", "8", "--out", "{rows}", "--tmp", "{tmp}", "--profile"]
PROF_VOX = ["bench_voxcpm.py", "--peer", "ddptrain_best_md320", "--utterances", "1000", "--warmup", "5", "--steps",
            "8", "--row", "{rows}", "--tmp", "{tmp}", "--profile"]

# VoxCPM2 (item 5): upstream's step vs ddptrain on one GPU, each job one bench_voxcpm.py process running
# its peer in a subprocess (an out-of-memory peer leaves an error row, the bench's timeout 10 s inside the
# job's); 640 utterances so upstream's 11 steps of 32 stay in one epoch; upstream 3 + 8 steps, ddptrain 5 + 10
V2 = ["bench_voxcpm.py", "--arch", "voxcpm2", "--utterances", "640", "--out", "{rows}"]
V2_UP, V2_DDP = ["--warmup", "3", "--steps", "8", "--grad-accum", "1"], ["--warmup", "5", "--steps", "10"]


def v2(label, peer, timeout, *more):
    return Script(label, "0", V2 + ["--peers", peer, "--timeout", str(timeout - 10), *more], timeout,
                  ["--dry", "--inline"])


SCRIPT_PLANS = {
    # (issue 31) the profiles, bench/run.py jobs and scripts mixed, in the issue's order of value.
    # Each job's start, compile, steps and profile on a fresh H200, from the rows' wall times
    # (calls s7e, s8c, s9b, 21b, 24) less the steps left out: VoxCPM ~70 s (1,000 utterances
    # encoded in ~18 s), GLM-ASR cut ~85 s, 30 s windows ~80 s, 9B LoRA ~60 s (not timed
    # before: a guess), Whisper ~55 s, wav2vec2 ~90 s (its cold compile): ~440 s of 530; a
    # job the budget cuts short is the last, the least valuable. Timeouts leave each ~1.7x.
    # One H200; the table: python3 bench/profile_table.py $OUT/results.jsonl (printed at the end).
    #   python3 bench/gpu_session.py profile1 --out $OUT --budget 530 --no-calib
    "profile1": [
        [Script("vox_prof", "0", PROF_VOX, 140, ["--dry"]),
         Script("glm_cut_prof", "0", ["multi/glmasr.py", "--peer", "ddptrain_bf16_compile_cut", *PROF_GLM], 150,
                GLM_DRY),
         Script("glm_win30_prof", "0", ["multi/glmasr.py", "--peer", GLM_DDP, *PROF_GLM], 140, GLM_DRY),
         Script("b9_lora_prof", "0", ["bench_9b.py", "job", "lora_ddptrain", "--out", "{rows}", "--tmp", "{tmp}",
                                      "--profile"], 150, ["--dry"]),
         Job("wh_prof", "0", "whisper", [wh("ddptrain_b24", profile=True)], 150, steps=6),
         Job("w2v_prof", "0", "wav2vec2", [w2v("ddptrain_500", profile=True)], 160, steps=8)],
    ],
    # (issue 31) after the profiles, one H200, in order of value: VoxCPM-1.5's best with
    # compile.recompile_limit 32 (its s12b row likely ran some MiniCPM layers eagerly; the row's
    # compile_eager_fallbacks says now) and its profile; VoxCPM2's full and LoRA rows again with
    # the limit (s12c hit it; upstream's rows stand); the 9B LoRA step with its decoder layers
    # compiled, profiled, then its eager twin (the plan compares their per-step losses and gradient
    # norms: the lora_ddptrain_compiled_vs_eager row); the sharded-gradient memory check if time
    # remains. Seconds from the rows' times (s12b, s12c) + the variants past torch's old limit of 8
    # that now compile (~15 s a VoxCPM job, a guess): VoxCPM-1.5 ~85 (s12b's ~70), VoxCPM2 ~95
    # (s12c wall 69.5 + ~8 start) and LoRA ~135 (112.3 + ~8), 9B compiled ~110 (eager ~60 with
    # its profile, + inductor on the decoder layer, a guess) and eager ~60, sharded grads ~40
    # (1.6B parameters, 6 short runs): ~525 s. A job the budget cuts short is the last.
    #   python3 bench/gpu_session.py perf1 --out $OUT --budget 540 --no-calib
    "perf1": [
        [Script("vox15_prof", "0", PROF_VOX, 150, ["--dry"]),
         v2("v2_ddp", "ddptrain_best_md320", 170, *V2_DDP),
         v2("v2_lora_ddp", "ddptrain_lora_md320", 200, *V2_DDP),
         Script("b9_lora_compiled", "0", ["bench_9b.py", "plan", "--jobs", "lora_ddptrain_compiled,lora_ddptrain",
                                          "--profile", "--out", "{rows}", "--tmp", "{tmp}"], 300, ["--dry"]),
         Script("sharded_grads", "0", ["check_sharded_grads.py", "--out", "{rows}"], 90,
                ["--d", "32", "--layers", "2", "--worlds", "2"])],
    ],
    # (a, b) GLM-ASR on 1 and 2 GPUs, both peers; then the 10B full fine-tune on 2 GPUs (the
    # estimate: 10 B/param of model state + 2 B/param of master gradients = 123.5 GB of 150).
    # Two H200s, ~6 minutes.
    #   python3 bench/gpu_session.py glmasr2 --out $OUT --budget 450 --no-calib
    "glmasr2": [
        [glm("glm_ddp1", "0", GLM_DDP, 200), glm("glm_ds1", "1", GLM_DS2, 170)],
        [glm("glm_ddp2", "0,1", GLM_DDP, 200), glm("glm_ds2", "0,1", GLM_DS2, 170),
         b9("b9_zero2", "0,1", "full9b_zero2", 200)],
    ],
    # (a, b) GLM-ASR on 1, 2 (a GPU pair) and 4 GPUs, both peers. Four H200s, ~6 minutes.
    #   python3 bench/gpu_session.py glmasr4 --out $OUT --budget 420 --no-calib
    "glmasr4": [
        [glm("glm_ddp1", "0", GLM_DDP, 200), glm("glm_ds1", "1", GLM_DS2, 170),
         glm("glm_ddp2", "2,3", GLM_DDP, 200), glm("glm_ds2", "2,3", GLM_DS2, 170)],
        [glm("glm_ddp4", "0,1,2,3", GLM_DDP, 220), glm("glm_ds4", "0,1,2,3", GLM_DS2, 190)],
    ],
    # VoxCPM2 (2.29B, issue 32 item 5) on one H200, in order of value: full fine-tuning (ddptrain's best
    # against upstream at the largest batch its memory plausibly holds, then 16), LoRA (upstream's r 32
    # alpha 32 against configs/tts_voxcpm2_lora.yaml), then a 24 GB card (23 GiB cap): ddptrain with the
    # optimizer on the host and recompute against upstream at batch 1 (its fp32 weights, gradients and
    # AdamW are 16 B/param = 36.6 GB: expected out of memory, the row says so). Seconds estimated from
    # the VoxCPM-1.5 rows (bench/results/*voxcpm*) x ~2.5 per step; memory from saved-activation bytes
    # per LM position measured on CPU (VoxCPM-1.5 9.7 MB, which reproduces its 37.3 GB upstream b16 row;
    # VoxCPM2 18.4 MB): upstream b32 ~130 of 150 GB. ~510 s in all.
    #   python3 bench/gpu_session.py voxcpm2 --out $OUT --budget 540 --no-calib
    "voxcpm2": [
        [v2("v2_ddp", "ddptrain_best_md320", 200, *V2_DDP),  # ~100 s (compile ~50 s), ~92 GB
         v2("v2_up_b32", "upstream", 130, "--batch", "32", *V2_UP),  # ~75 s
         v2("v2_up_b16", "upstream", 100, "--batch", "16", *V2_UP)],  # ~50 s, ~85 GB
        [v2("v2_24gb_ddp", "ddptrain_offload_rc_md320", 190, "--gpu-memory-gb", "23", "--warmup", "3", "--steps", "8"),  # ~115 s
         v2("v2_24gb_up_b1", "upstream", 60, "--batch", "1", "--gpu-memory-gb", "23", *V2_UP)],  # ~30 s to its OOM
        [v2("v2_lora_ddp", "ddptrain_lora_md320", 170, *V2_DDP),  # ~90 s
         v2("v2_lora_up_b32", "upstream_lora", 100, "--batch", "32", *V2_UP)],  # ~50 s, ~100 GB
    ],
    # (b, c) the 10B full fine-tune on 2 and 4 GPUs; VoxCPM on 4 GPUs against one GPU trained on
    # the 4-GPU run's batches (as_world 4). Four H200s, ~5 minutes.
    #   python3 bench/gpu_session.py large4 --out $OUT --budget 360 --no-calib
    "large4": [
        [b9("b9_zero2", "0,1", "full9b_zero2", 200),
         Script("vox1a4", "2", VOX + ["--as-world", "4"], 260, ["--dry", "--as-world", "2"])],
        [b9("b9_zero4", "0,1,2,3", "full9b_zero", 200), Script("vox4", "0,1,2,3", VOX, 200, ["--dry"])],
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


def ranks(job, dry: bool) -> int:
    """Processes the job launches: one per GPU; at most 2 (gloo on CPU) in a dry run."""
    n = len(job.gpus.split(","))
    return min(n, 2) if dry else n


def job_cmd(job, out_dir: str, dry: bool, port: int, scratch: str = "") -> list:
    """The command line of a job (torchrun for several GPUs or ``ddp1``); its rows go to
    ``OUT/rows/LABEL.jsonl`` (merged into ``OUT/results.jsonl`` as the job ends), its run folders
    to ``scratch`` (not under OUT, which comes back from the machine: latents, run folders)."""
    scratch = scratch or os.path.join(out_dir, "tmp")
    py = sys.executable
    n = ranks(job, dry)
    rows = os.path.join(out_dir, "rows", f"{job.label}.jsonl")
    torchrun = [py, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={port}"]
    if isinstance(job, Script):
        tmp = os.path.join(scratch, job.label)
        args = [a.replace("{rows}", rows).replace("{tmp}", tmp) for a in job.args + (job.dry_args if dry else [])]
        return (torchrun if n > 1 else [py]) + [os.path.join(HERE, args[0])] + args[1:]
    exps = job.experiments()
    if dry:
        exps = [dry_experiment(e) for e in exps]
    exps_file = os.path.join(out_dir, "logs", f"{job.label}.exps.json")
    with open(exps_file, "w") as f:
        json.dump(exps, f)
    # ddp1 (diagnostic): one GPU under torchrun, so the Trainer makes a process group of one and
    # wraps the model in DDP: the cost of being a DDP rank, without a second rank
    ddp1 = any(e.get("ddp1") for e in exps)
    return (torchrun if n > 1 or ddp1 else [py]) + [
        os.path.join(HERE, "run.py"), "--workload", job.workload, "--exps", "@" + exps_file, "--out", rows,
        "--tag", job.label, "--preset", "tiny" if dry else "large", "--tmp", scratch]


def collect(job, out_dir: str, rc: int, why: str, log_tail: str) -> None:
    """Appends the job's rows to ``OUT/results.jsonl`` (one writer, so rows of jobs running side
    by side never interleave); a job that failed without a row leaves an error row instead."""
    path = os.path.join(out_dir, "rows", f"{job.label}.jsonl")
    got = [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []
    if not got:
        # a Job names its workload, a Script only its script: getattr's default would be evaluated
        # (and a Job has no args) even when the attribute exists
        workload = job.workload if isinstance(job, Job) else os.path.basename(job.args[0]).split(".")[0]
        got = [{"workload": workload, "name": job.label,
                "world_size": len(job.gpus.split(",")), "error": why or f"exit status {rc} and no row",
                "log_tail": log_tail[-1500:]}]
    with open(os.path.join(out_dir, "results.jsonl"), "a") as f:
        for r in got:
            r.setdefault("job", job.label)
            f.write(json.dumps(r) + "\n")


def one_per_process(stage: list) -> list:
    """Split every job of several experiments into one job (process) per experiment, in order;
    each keeps the job's timeout (the call's budget still bounds the whole stage)."""
    out = []
    for job in stage:
        if isinstance(job, Script) or len(job.exps) == 1:
            out.append(job)
        else:
            out += [replace(job, label=f"{job.label}-{i}", exps=[e]) for i, e in enumerate(job.exps)]
    return out


def check_stage(stage: list) -> None:
    """Jobs of one stage run at the same time unless they name the same GPUs: two that name
    overlapping but different GPU sets ("0" and "0,1") would share a GPU unawares.

    Raises:
        ValueError: naming the two jobs.
    """
    for i, a in enumerate(stage):
        for b in stage[i + 1:]:
            if a.gpus != b.gpus and set(a.gpus.split(",")) & set(b.gpus.split(",")):
                raise ValueError(f"jobs {a.label} (GPUs {a.gpus}) and {b.label} (GPUs {b.gpus}) would share a GPU")


@dataclass
class Running:
    """A started job: its process, deadline, log file, the unfinished last line of its output
    and the output's tail (for an error row)."""

    proc: subprocess.Popen
    job: object
    timeout: float
    deadline: float
    log: object
    partial: str = ""
    tail: str = ""


def run_stage(stage: list, out_dir: str, dry: bool, t_start: float, budget_s: float, scratch: str = "") -> int:
    """Start the stage's jobs; jobs that share a GPU run in order. Returns the number of jobs
    that failed or timed out, once all have ended."""
    check_stage(stage)
    by_gpu: dict[str, list] = {}
    for job in stage:
        by_gpu.setdefault(job.gpus, []).append(job)
    port = 29500 + int(time.time()) % 1000
    failed = 0

    def start(job) -> Running:
        nonlocal port
        left = budget_s - (time.time() - t_start)
        timeout = min(job.timeout, max(10, left - 5))
        port += 1
        os.makedirs(os.path.join(scratch or os.path.join(out_dir, "tmp"), job.label), exist_ok=True)
        logf = open(os.path.join(out_dir, "logs", f"{job.label}.log"), "w")
        print(f"[{time.time() - t_start:6.1f}s] start {job.label} on GPU {job.gpus}, timeout {timeout:.0f}s", flush=True)
        env = dict(env_for(job.gpus, dry), **job.env)
        p = subprocess.Popen(job_cmd(job, out_dir, dry, port, scratch), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        os.set_blocking(p.stdout.fileno(), False)
        return Running(p, job, timeout, time.time() + timeout, logf)

    active = [(start(q.pop(0)), q) for q in by_gpu.values()]
    while active:
        time.sleep(0.2 if dry else 0.5)
        still = []
        for r, q in active:
            label, why = r.job.label, ""
            try:
                chunk = r.proc.stdout.read()
            except (TypeError, OSError):
                chunk = None
            if chunk:
                r.log.write(chunk)
                r.tail = (r.tail + chunk)[-3000:]
                *lines, r.partial = (r.partial + chunk).split("\n")
                for ln in lines:
                    if ln.startswith(("RESULT", "PROFILE", "SYNCS", "CALIB", "GAP")) or "Error" in ln or "error:" in ln:
                        print(f"[{label}] {ln[:1500]}", flush=True)
            if r.proc.poll() is None and time.time() > r.deadline:
                print(f"[{label}] TIMEOUT: killing", flush=True)
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
                why = f"did not finish within {r.timeout:.0f} s (start, compile and steps): killed"
            if r.proc.poll() is not None:
                try:
                    rest = r.proc.stdout.read() or ""
                except (TypeError, OSError):  # a killed job's pipe can end mid-character
                    rest = ""
                r.log.write(rest)
                r.log.close()
                print(f"[{time.time() - t_start:6.1f}s] end {label} rc={r.proc.returncode}", flush=True)
                collect(r.job, out_dir, r.proc.returncode, why, r.tail + rest)
                failed += r.proc.returncode != 0
                if q:
                    still.append((start(q.pop(0)), q))
            else:
                still.append((r, q))
        active = still
    return failed


def label_of(r: dict) -> str:
    return r.get("name") or r.get("peer") or "?"


def table(results_path: str) -> str:
    """The results file as a fixed-width table (one line per row), then the scaling summary."""
    if not os.path.exists(results_path):
        return "(no results)"
    rows = [json.loads(x) for x in open(results_path) if x.strip()]
    hdr = f"{'workload':12s} {'gpus':>4s} {'name':24s} {'smp/s':>8s} {'audio-s/s':>10s} {'MFU':>6s} " \
          f"{'peakGB/GPU':>16s} {'restGB':>7s} {'step ms':>8s} {'SM MHz/GPU':>20s} {'W/GPU':>16s}"
    out = [hdr]
    num = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
    per = lambda v: "/".join(num(x, ".0f") for x in v) if isinstance(v, list) else "-"  # noqa: E731
    for r in rows:
        head = f"{str(r.get('workload')):12s} {r.get('world_size', 0):4d} {label_of(r)[:24]:24s}"
        if "error" in r or "skipped" in r:
            out.append(f"{head} {'ERROR' if 'error' in r else 'SKIPPED'} {str(r.get('error', r.get('skipped')))[:90]}")
            continue
        peaks = r.get("peak_alloc_gb_per_gpu") or [r.get("peak_alloc_gb")]
        clocks = r.get("sm_clock_mhz_per_gpu") or [r.get("sm_clock_mhz", [None] * 3)[1]]
        out.append(f"{head} {num(r.get('samples_per_s'), '8.1f'):>8s} {num(r.get('audio_s_per_s'), '10.1f'):>10s} "
                   f"{num(r.get('mfu'), '6.3f'):>6s} {per(peaks):>16s} {num(r.get('mem_at_rest_gb'), '7.2f'):>7s} "
                   f"{num(r.get('step_ms_median'), '8.0f'):>8s} {per(clocks):>20s} "
                   f"{per(r.get('power_w_per_gpu') or [r.get('power_w_mean')]):>16s}")
    eff = scaling(rows)
    if eff:
        out += ["", "scaling: samples/s at N GPUs / (N x the 1-GPU row's)"]
        out += [f"  {e['workload']} {e['name']} x{e['world_size']}: {e['efficiency']:.1%} (1 GPU: {e['baseline']})"
                for e in eff]
    return "\n".join(out)


def scaling(rows: list) -> list:
    """Scaling efficiency of every multi-GPU row against its 1-GPU row of the same call: the row
    named ``NAME_asN`` (one GPU trained on the N-GPU run's batches) where there is one, else the
    1-GPU row of the same name."""
    ok = [r for r in rows if "error" not in r and r.get("samples_per_s")]
    one = {(r["workload"], label_of(r)): r for r in ok if r.get("world_size") == 1}
    out = []
    for r in ok:
        n = r.get("world_size", 1)
        base = one.get((r["workload"], f"{label_of(r)}_as{n}")) or one.get((r["workload"], label_of(r)))
        if n > 1 and base:
            out.append({"workload": r["workload"], "name": label_of(r), "world_size": n, "baseline": label_of(base),
                        "efficiency": r["samples_per_s"] / (n * base["samples_per_s"])})
    return out


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
    ap.add_argument("plan", choices=sorted(PLANS) + sorted(SCRIPT_PLANS))
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

    stages = select({**PLANS, **SCRIPT_PLANS}[a.plan], a.stages, a.jobs)
    for stage in stages:
        check_stage(stage)
        for job in stage:
            if isinstance(job, Script):
                if not os.path.exists(os.path.join(HERE, job.args[0])):
                    raise ValueError(f"job {job.label}: no script bench/{job.args[0]}")
            else:
                check_experiments(job.experiments())
    for sub in ("logs", "rows"):
        os.makedirs(os.path.join(a.out, sub), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="gpu_session_")
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
        failed += run_stage(stage if a.shared_process else one_per_process(stage), a.out, a.dry, t0, a.budget, scratch)
    with tarfile.open(os.path.join(a.out, "logs.tar.gz"), "w:gz") as tar:
        tar.add(os.path.join(a.out, "logs"), arcname="logs")
    for done in (os.path.join(a.out, "logs"), os.path.join(a.out, "rows"), scratch):  # rows: now in results.jsonl
        shutil.rmtree(done, ignore_errors=True)
    print(f"total {time.time() - t0:.0f}s, {failed} job(s) failed")
    print(table(os.path.join(a.out, "results.jsonl")))
    results = os.path.join(a.out, "results.jsonl")
    rows = read_rows([results]) if os.path.exists(results) else []
    if any("profile" in r for r in rows):
        print("\nprofiles (bench/profile_table.py):\n" + profile_table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
