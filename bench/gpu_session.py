"""Run a named plan of bench_models.py jobs on a 2-GPU machine inside one time-boxed call.

A plan is a list of stages; the jobs of a stage run at the same time (1-GPU jobs on different
GPUs), stages one after the other; each experiment runs in its own process (see
``one_per_process``). Every process has a hard timeout (its process group is killed) so the
call always ends and returns what was measured. Results: ``OUT/results.jsonl`` (one
line per experiment, see bench_models.py), ``OUT/logs.tar.gz`` (every job's full log), and a
table on stdout. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).

    python3 bench/gpu_session.py call1 --out "$OUT"
    python3 bench/gpu_session.py call1 --out /tmp/o --dry   # tiny models on CPU, same code paths
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WR = ["recompute.enabled=true", "recompute.module_classes=[WhisperEncoderLayer,WhisperDecoderLayer]"]
WC = ["compile.enabled=true", "compile.module_classes=[WhisperEncoderLayer,WhisperDecoderLayer]"]
VC = ["compile.enabled=true", "compile.module_classes=[Wav2Vec2EncoderLayerStableLayerNorm,Wav2Vec2FeatureEncoder,"
      "Wav2Vec2FeatureProjection,Wav2Vec2PositionalConvEmbedding]"]
P = ["trainer.param_dtype=bf16"]


def E(name, peer, **kw):
    return dict(name=name, peer=peer, **kw)


# Helpers for the plans of session 4 on (call 13 and later); earlier plans are kept as written.
WW = P + ["compile.enabled=true"]  # Whisper's best setting: whole-model compile, bf16 params
CD = P + ["compile.enabled=true", "compile.dynamic=true", "compile.module_classes=[ConformerLayer]"]


def wh(name, *extra_ov, **kw):
    """A ddptrain Whisper experiment at 24 windows per GPU, compiled whole with bf16 params."""
    return E(name, "ddptrain", batch=24, ov=WW + list(extra_ov), **kw)


def w2v(name, *extra_ov, **kw):
    """A ddptrain wav2vec2 experiment at 500 s per GPU, its blocks compiled, bf16 params."""
    return E(name, "ddptrain", budget=500, ov=P + VC + list(extra_ov), **kw)


def job(label, gpus, workload, exps, timeout, steps=12, env=None):
    """A job that times a replay of ``steps`` batches after ``steps`` + 1 warm-up steps (the
    first pass over them compiles and caches every shape)."""
    j = (label, gpus, workload, exps, timeout, steps + 1, steps, {"replay": steps})
    return j + (env,) if env else j


# Each job: (label, gpus, workload, experiments, timeout_s[, warmup, steps[, defaults[, env]]])
PLANS = {
    "call1": [
        [  # stage A: one GPU each, concurrently
            ("wh1", "0", "whisper", [
                E("ddp_b8", "ddptrain", batch=8, profile=1, syncs=1),
                E("bare_b8", "bare", batch=8, profile=1, syncs=1),
                E("ddp_b24", "ddptrain", batch=24, profile=1),
                E("ddp_b24_rc1", "ddptrain", batch=24, ov=WR + ["recompute.every_k=1"]),
                E("ddp_b24_rc2", "ddptrain", batch=24, ov=WR + ["recompute.every_k=2"]),
                E("hf_b8", "hf", batch=8),
            ], 190),
            ("w2v1", "1", "wav2vec2", [
                E("ddp_400", "ddptrain", budget=400, profile=1, syncs=1),
                E("bare_400", "bare", budget=400, profile=1, syncs=1),
                E("ddp_600", "ddptrain", budget=600),
                E("hf_gbl_b48", "hf", batch=48, hf_group=1),
            ], 110),
            ("wh1b", "1", "whisper", [
                E("ddp_b16", "ddptrain", batch=16),
                E("ddp_b32_rc2", "ddptrain", batch=32, ov=WR + ["recompute.every_k=2"]),
            ], 75),
        ],
        [  # stage B: Whisper on 2 GPUs
            ("wh2", "0,1", "whisper", [
                E("ddp_b8", "ddptrain", batch=8, profile=1),
                E("bare_b8", "bare", batch=8),
                E("ddp_b24", "ddptrain", batch=24, profile=1),
                E("ddp_b24_bf16hook", "ddptrain", batch=24, ov=["dist.comm_hook=bf16"]),
                E("ddp_b24_zero", "ddptrain", batch=24, ov=["optim.zero=true"]),
                E("hf_b8", "hf", batch=8),
            ], 160),
        ],
        [  # stage C: wav2vec2 on 2 GPUs
            ("w2v2", "0,1", "wav2vec2", [
                E("ddp_400", "ddptrain", budget=400, profile=1),
                E("bare_400", "bare", budget=400),
                E("ddp_400_bf16hook", "ddptrain", budget=400, ov=["dist.comm_hook=bf16"]),
                E("hf_gbl_b48", "hf", batch=48, hf_group=1),
            ], 110),
        ],
    ],
    # call 2: steady state (replay: every peer times its second pass over the same batches),
    # recompute at a batch that fits without it, best settings (its "_def" experiments ran the
    # deferred-sync prototype, since removed: they now run the plain Trainer)
    "call2": [
        [
            ("wh1", "0", "whisper", [
                E("ddp_b8", "ddptrain", batch=8),
                E("ddp_b8_def", "ddptrain", batch=8, profile=1),
                E("bare_b8", "bare", batch=8, profile=1),
                E("hf_b8", "hf", batch=8),
                E("best_b32_rc2_def", "ddptrain", batch=32, profile=1, ov=WR + ["recompute.every_k=2"]),
            ], 130, 9, 8, {"replay": 8}),
            ("w2v1", "1", "wav2vec2", [
                E("ddp_400", "ddptrain", budget=400),
                E("ddp_400_def", "ddptrain", budget=400, profile=1),
                E("bare_400", "bare", budget=400),
                E("hf_gbl_b48", "hf", batch=48, hf_group=1),
            ], 70, 9, 8, {"replay": 8}),
            ("wh1b", "1", "whisper", [
                E("ddp_b16_rc0_def", "ddptrain", batch=16),
                E("ddp_b16_rc1_def", "ddptrain", batch=16, ov=WR + ["recompute.every_k=1"]),
                E("ddp_b16_rc2_def", "ddptrain", batch=16, ov=WR + ["recompute.every_k=2"]),
            ], 75, 9, 8, {"replay": 8}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("ddp_b8", "ddptrain", batch=8),
                E("bare_b8", "bare", batch=8),
                E("hf_b8", "hf", batch=8),
                E("best_b32_rc2_def_hook", "ddptrain", batch=32, profile=1,
                  ov=WR + ["recompute.every_k=2", "dist.comm_hook=bf16"]),
                E("best_zero", "ddptrain", batch=32,
                  ov=WR + ["recompute.every_k=2", "dist.comm_hook=bf16", "optim.zero=true"]),
            ], 125, 7, 6, {"replay": 6}),
        ],
        [
            ("w2v2", "0,1", "wav2vec2", [
                E("ddp_400", "ddptrain", budget=400),
                E("bare_400", "bare", budget=400),
                E("hf_gbl_b48", "hf", batch=48, hf_group=1),
                E("best_400_def_hook", "ddptrain", budget=400, profile=1, ov=["dist.comm_hook=bf16"]),
            ], 70, 9, 8, {"replay": 8}),
        ],
    ],
    # call 3 (session 2): cheap knobs measured before building on them: flash instead of cuDNN
    # attention, whole-model torch.compile, and ZeRO with parameters_as_bucket_view
    "call3": [
        [
            ("wh1", "0", "whisper", [
                E("ddp_b16", "ddptrain", batch=16, profile=1),
                E("ddp_b16_flash", "ddptrain", batch=16, sdpa="no_cudnn", profile=1),
                E("ddp_b16_compile", "ddptrain", batch=16, ov=["compile.enabled=true"]),
            ], 330, 9, 8, {"replay": 8}),
            ("w2v1", "1", "wav2vec2", [
                E("ddp_400", "ddptrain", budget=400, syncs=1),
                E("ddp_400_flash", "ddptrain", budget=400, sdpa="no_cudnn"),
                E("ddp_400_compile", "ddptrain", budget=400, ov=["compile.enabled=true"]),
            ], 330, 9, 8, {"replay": 8}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("b32_rc2_hook", "ddptrain", batch=32, ov=WR + ["recompute.every_k=2", "dist.comm_hook=bf16"]),
                E("b32_rc2_hook_zero", "ddptrain", batch=32,
                  ov=WR + ["recompute.every_k=2", "dist.comm_hook=bf16", "optim.zero=true"]),
                E("b32_rc2_hook_zero_bv", "ddptrain", batch=32,
                  ov=WR + ["recompute.every_k=2", "dist.comm_hook=bf16", "optim.zero=true", "optim.zero_bucket_view=true"]),
            ], 200, 7, 6, {"replay": 6}),
        ],
    ],
    # call 4 (session 2): regional torch.compile of the repeated blocks (ddptrain.compile), with and
    # without activation checkpointing, against the HF Trainer in the same run
    "call4": [
        [
            ("wh1", "0", "whisper", [
                E("comp_b16", "ddptrain", batch=16, profile=1, ov=WC),
                E("comp_b16_rc1", "ddptrain", batch=16, ov=WC + WR + ["recompute.every_k=1"]),
                E("comp_b16_rc2", "ddptrain", batch=16, ov=WC + WR + ["recompute.every_k=2"]),
                E("eager_b16_rc1", "ddptrain", batch=16, ov=WR + ["recompute.every_k=1"]),
            ], 300, 9, 8, {"replay": 8}),
            ("w2v1", "1", "wav2vec2", [
                E("comp_400", "ddptrain", budget=400, profile=1, ov=VC),
                E("comp_600", "ddptrain", budget=600, ov=VC),
            ], 150, 9, 8, {"replay": 8}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("hf_b8", "hf", batch=8),
                E("comp_b16", "ddptrain", batch=16, ov=WC),
                E("comp_b24_rc2_hook", "ddptrain", batch=24, ov=WC + WR + ["recompute.every_k=2", "dist.comm_hook=bf16"]),
            ], 200, 7, 6, {"replay": 6}),
        ],
        [
            ("w2v2", "0,1", "wav2vec2", [
                E("hf_gbl_b48", "hf", batch=48, hf_group=1),
                E("comp_400", "ddptrain", budget=400, ov=VC),
                E("comp_600", "ddptrain", budget=600, ov=VC),
            ], 150, 9, 8, {"replay": 8}),
        ],
    ],
    # call 5 (session 2): bf16 model + fp32 master weights (trainer.param_dtype=bf16), with
    # whole-model and regional compile; activation checkpointing cost; ZeRO; peers in the same run
    "call5": [
        [
            ("wh1", "0", "whisper", [
                E("eager_b16_p16", "ddptrain", batch=16, ov=P),
                E("eager_b16_p16_rc1", "ddptrain", batch=16, ov=P + WR + ["recompute.every_k=1"]),
                E("whole_b16_p16", "ddptrain", batch=16, profile=1, ov=P + ["compile.enabled=true"]),
                E("reg_b16_p16", "ddptrain", batch=16, ov=P + WC),
                E("reg_b16_p16_rc1", "ddptrain", batch=16, ov=P + WC + WR + ["recompute.every_k=1"]),
            ], 330, 9, 8, {"replay": 8}),
            ("w2v1", "1", "wav2vec2", [
                E("comp_400_p16", "ddptrain", budget=400, profile=1, ov=P + VC),
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
            ], 150, 9, 8, {"replay": 8}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("hf_b8", "hf", batch=8),
                E("whole_b16_p16", "ddptrain", batch=16, ov=P + ["compile.enabled=true"]),
                E("whole_b16_p16_zero", "ddptrain", batch=16, ov=P + ["compile.enabled=true", "optim.zero=true"]),
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
            ], 230, 7, 6, {"replay": 6}),
        ],
        [
            ("w2v2", "0,1", "wav2vec2", [
                E("hf_gbl_b48", "hf", batch=48, hf_group=1),
                E("comp_400_p16", "ddptrain", budget=400, ov=P + VC),
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
            ], 140, 9, 8, {"replay": 8}),
        ],
    ],
    # call 6 (session 2): Whisper batch 24/28 on 1 and 2 GPUs (scaling at the best batch), larger
    # DDP buckets, the HF Trainer again in the same run
    "call6": [
        [
            ("wh1", "0", "whisper", [
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
            ], 120, 7, 6, {"replay": 6}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("hf_b8", "hf", batch=8),
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
                E("whole_b24_p16_cap200", "ddptrain", batch=24, ov=P + ["compile.enabled=true", "dist.bucket_cap_mb=200"]),
                E("whole_b28_p16_cap200", "ddptrain", batch=28, ov=P + ["compile.enabled=true", "dist.bucket_cap_mb=200"]),
            ], 250, 7, 6, {"replay": 6}),
        ],
    ],
    # call 7 (session 2): where the 2-GPU overhead goes (profile), and gradient accumulation 2
    # (one all-reduce per two micro-batches)
    "call7": [
        [
            ("wh2", "0,1", "whisper", [
                E("whole_b24_p16_acc2", "ddptrain", batch=24, ov=P + ["compile.enabled=true", "trainer.grad_accum_steps=2"]),
                E("whole_b24_p16", "ddptrain", batch=24, profile=1, ov=P + ["compile.enabled=true"]),
            ], 185, 8, 6, {"replay": 6}),
        ],
    ],
    # call 8 (session 3): where the 2-GPU overhead of compiled Whisper goes: DDP graph splits
    # without communication (nocomm), one graph with the all-reduce after the backward
    # (compile.ddp_overlap=false), fewer NCCL channels; the Conformer workload on CUDA
    "call8": [
        [
            ("wh1", "0", "whisper", [
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
            ], 120, 7, 6, {"replay": 6}),
            ("cf1", "1", "conformer", [
                E("eager", "ddptrain", budget=600),
                E("p16", "ddptrain", budget=600, ov=P),
                E("p16_comp", "ddptrain", budget=600, ov=P + ["compile.enabled=true", "compile.module_classes=[ConformerLayer]"]),
            ], 240, 9, 8, {"replay": 8}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
                E("whole_b24_p16_noovl", "ddptrain", batch=24, ov=P + ["compile.enabled=true", "compile.ddp_overlap=false"]),
                E("whole_b24_p16_nocomm", "ddptrain", batch=24, nocomm=1, ov=P + ["compile.enabled=true"]),
            ], 230, 7, 6, {"replay": 6}),
        ],
        [
            ("wh2_nch8", "0,1", "whisper", [
                E("whole_b24_p16_nch8", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
            ], 100, 7, 6, {"replay": 6}, {"NCCL_MAX_NCHANNELS": "8"}),
        ],
        [
            ("cf2", "0,1", "conformer", [
                E("eager", "ddptrain", budget=600),
                E("p16", "ddptrain", budget=600, ov=P),
            ], 90, 9, 8, {"replay": 8}),
        ],
    ],
    # call 9 (session 3): is the 2-GPU overhead the cost imbalance between the ranks' batches
    # (same_data: every rank gets rank 0's batches)? Where does the GPU idle (profile gaps)?
    # wav2vec2 1 vs 2 GPUs in the same call
    "call9": [
        [
            ("wh1", "0", "whisper", [
                E("whole_b24_p16", "ddptrain", batch=24, profile=1, ov=P + ["compile.enabled=true"]),
            ], 130, 7, 6, {"replay": 6}),
            ("w2v1", "1", "wav2vec2", [
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
            ], 130, 9, 8, {"replay": 8}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("whole_b24_p16_same", "ddptrain", batch=24, same_data=1, ov=P + ["compile.enabled=true"]),
                E("whole_b24_p16", "ddptrain", batch=24, profile=1, ov=P + ["compile.enabled=true"]),
            ], 170, 7, 6, {"replay": 6}),
        ],
        [
            ("w2v2", "0,1", "wav2vec2", [
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
                E("comp_500_p16_same", "ddptrain", budget=500, same_data=1, ov=P + VC),
            ], 150, 9, 8, {"replay": 8}),
        ],
    ],
    # call 10 (session 3): data.sync_buckets (now the default; Whisper bucketed by transcript
    # length) against unsynchronised batches, 1 vs 2 GPUs, and the HF Trainer in the same call
    "call10": [
        [
            ("wh1", "0", "whisper", [
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
            ], 120, 7, 6, {"replay": 6}),
            ("w2v1", "1", "wav2vec2", [
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
            ], 120, 9, 8, {"replay": 8}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("hf_b8", "hf", batch=8),
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
                E("whole_b24_p16_nosync", "ddptrain", batch=24, ov=P + ["compile.enabled=true", "data.sync_buckets=false"]),
            ], 200, 7, 6, {"replay": 6}),
        ],
        [
            ("w2v2", "0,1", "wav2vec2", [
                E("hf_gbl_b48", "hf", batch=48, hf_group=1),
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
                E("comp_500_p16_nosync", "ddptrain", budget=500, ov=P + VC + ["data.sync_buckets=false"]),
            ], 190, 9, 8, {"replay": 8}),
        ],
    ],
    # call 11 (session 3): scaling on identical work: one GPU trains on exactly the batches
    # the 2-GPU run gets (as_world=2: both ranks' batches, in step order)
    "call11": [
        [
            ("wh1", "0", "whisper", [
                E("whole_b24_p16_as2", "ddptrain", batch=24, as_world=2, ov=P + ["compile.enabled=true"]),
            ], 130, 13, 12, {"replay": 12}),
            ("w2v1", "1", "wav2vec2", [
                E("comp_500_p16_as2", "ddptrain", budget=500, as_world=2, ov=P + VC),
            ], 130, 17, 16, {"replay": 16}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
            ], 90, 7, 6, {"replay": 6}),
        ],
        [
            ("w2v2", "0,1", "wav2vec2", [
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
            ], 80, 9, 8, {"replay": 8}),
        ],
    ],
    # call 12 (session 4 ran stages 0-1 as "call 12a", in the shared-process mode; stages 2-3 were
    # replaced by calls 13 and 15): scaling on identical work with longer
    # replays (one GPU trains on the 2-GPU run's 24 batches), sync vs unsync buckets over 12
    # steps, the Conformer compiled with dynamic shapes. Two device calls:
    #   python3 bench/gpu_session.py call12 --stages 0,1 --out $OUT --budget 560 --no-calib
    #   python3 bench/gpu_session.py call12 --stages 2,3 --out $OUT --budget 560 --no-calib
    # Timeouts allow for a fresh machine (inductor compiles everything from scratch).
    "call12": [
        [
            ("wh1", "0", "whisper", [
                E("whole_b24_p16_as2", "ddptrain", batch=24, as_world=2, ov=P + ["compile.enabled=true"]),
            ], 200, 25, 24, {"replay": 24}),
            ("w2v1", "1", "wav2vec2", [
                E("comp_500_p16_as2", "ddptrain", budget=500, as_world=2, ov=P + VC),
            ], 220, 25, 24, {"replay": 24}),
        ],
        [
            ("wh2", "0,1", "whisper", [
                E("whole_b24_p16", "ddptrain", batch=24, ov=P + ["compile.enabled=true"]),
                E("whole_b24_p16_nosync", "ddptrain", batch=24, ov=P + ["compile.enabled=true", "data.sync_buckets=false"]),
            ], 300, 13, 12, {"replay": 12}),
        ],
        [
            ("w2v2", "0,1", "wav2vec2", [
                E("comp_500_p16", "ddptrain", budget=500, ov=P + VC),
                E("comp_500_p16_nosync", "ddptrain", budget=500, ov=P + VC + ["data.sync_buckets=false"]),
            ], 300, 13, 12, {"replay": 12}),
        ],
        [
            ("cf1", "0", "conformer", [
                E("p16_comp_dyn", "ddptrain", budget=600, ov=P + ["compile.enabled=true", "compile.dynamic=true",
                                                                  "compile.module_classes=[ConformerLayer]"]),
            ], 200, 9, 8, {"replay": 8}),
        ],
    ],
    # Calls 12-17 ran with a job's experiments in one process: to repeat them as they ran, add
    # --shared-process.
    # call 13 (session 4): Whisper's 2-GPU overhead on identical work, in one call. Stage 1: the
    # 1-GPU baseline on the 2-GPU run's 24 batches (profiled), and the same with Python's
    # automatic GC (GPU 1). Stage 2: 2 GPUs with paced GC (the default now, profiled), with
    # automatic GC, and with neither communication nor batch differences (nocomm + same_data).
    #   python3 bench/gpu_session.py call13 --out $OUT --budget 560 --no-calib
    "call13": [
        [
            job("wh1", "0", "whisper", [wh("whole_b24_p16_as2", as_world=2, profile=1)], 220, steps=24),
            job("wh1g", "1", "whisper", [wh("whole_b24_p16_as2_gc0", "trainer.gc_every_steps=0", as_world=2)], 220, steps=24),
        ],
        [
            job("wh2", "0,1", "whisper", [
                wh("whole_b24_p16", profile=1),
                wh("whole_b24_p16_gc0", "trainer.gc_every_steps=0"),
                wh("whole_b24_p16_nocomm_same", nocomm=1, same_data=1),
            ], 330),
        ],
    ],
    # call 15 (session 4): where Whisper's 2-GPU overhead comes from. Call 13 seemed to show it is
    # neither the all-reduce nor batch imbalance (2 GPUs without all-reduce, same data: 587 ms vs
    # 497 on one GPU; call 16 overturned that: 514 ms when run first in its process). Stage 1:
    # one GPU as a DDP rank of a group of one (ddp1), with dynamo's DDP graph splits and with
    # one graph. Stage 2: the plain 1-GPU baselines again on this machine
    # (Whisper and wav2vec2). Stage 3: wav2vec2 on 2 GPUs, sync vs unsync buckets.
    #   python3 bench/gpu_session.py call15 --out $OUT --budget 540 --no-calib
    "call15": [
        [
            job("wh1d", "0", "whisper", [wh("whole_b24_p16_as2_ddp1", as_world=2, ddp1=1)], 200, steps=24),
            job("wh1o", "1", "whisper", [wh("whole_b24_p16_as2_ddp1_noov", "compile.ddp_overlap=false", as_world=2,
                                            ddp1=1)], 200, steps=24),
        ],
        [
            job("wh1", "0", "whisper", [wh("whole_b24_p16_as2", as_world=2)], 200, steps=24),
            job("w2v1", "1", "wav2vec2", [w2v("comp_500_p16_as2", as_world=2)], 200, steps=24),
        ],
        [
            job("w2v2", "0,1", "wav2vec2", [w2v("comp_500_p16"), w2v("comp_500_p16_nosync", "data.sync_buckets=false")],
                240),
        ],
    ],
    # call 16 (session 4): is the 2-GPU kernel slowdown NCCL's? Call 13's profile: on 2 GPUs the
    # GEMMs take 9% longer than on one (358 vs 329 ms a step) while NCCL kernels sit on the GPU
    # for 164 ms of each step, yet 2 GPUs without all-reduce were not faster (587 ms, but run
    # third in its process). Profile 2 GPUs without all-reduce (first in the process this time),
    # then with 8x larger DDP buckets (8x fewer all-reduce kernels waiting for the peer).
    #   python3 bench/gpu_session.py call16 --out $OUT --budget 420 --no-calib
    "call16": [
        [
            job("wh2", "0,1", "whisper", [
                wh("whole_b24_p16_nocomm_same", nocomm=1, same_data=1, profile=1),
                wh("whole_b24_p16_bucket200", "dist.bucket_cap_mb=200", profile=1),
            ], 380),
        ],
    ],
    # call 17 (session 4): call 16 showed that without the all-reduce 2 GPUs scale at 97% and
    # the GEMMs are as fast as on one GPU: the all-reduce's NCCL kernels, resident on the GPU
    # while they wait for the peer, slow the backward down. Fewer NCCL channels = fewer SMs taken.
    # Each variant in its own process (call 13/16: a later experiment in a process ran 4-14% slower).
    #   python3 bench/gpu_session.py call17 --out $OUT --budget 280 --no-calib
    "call17": [
        [job("wh2", "0,1", "whisper", [wh("whole_b24_p16")], 135)],
        [job("wh2c4", "0,1", "whisper", [wh("whole_b24_p16_nch4")], 135, env={"NCCL_MAX_NCHANNELS": "4"})],
    ],
    # call 18 (prepared in session 4, not yet run): how to keep the all-reduce's NCCL kernels
    # from slowing the backward (fourth pass: GEMMs +9% while they wait on the GPU). 1-GPU
    # baselines on the 2-GPU batches first, then Whisper on 2 GPUs: default, 2 and 4 NCCL
    # channels, all-reduce after the backward. Each in its own process (the default now).
    #   python3 bench/gpu_session.py call18 --out $OUT --budget 560 --no-calib
    "call18": [
        [
            job("wh1", "0", "whisper", [wh("whole_b24_p16_as2", as_world=2)], 200, steps=24),
            job("w2v1", "1", "wav2vec2", [w2v("comp_500_p16_as2", as_world=2)], 200, steps=24),
        ],
        [
            job("wh2", "0,1", "whisper", [wh("whole_b24_p16")], 140),
            job("wh2c2", "0,1", "whisper", [wh("whole_b24_p16_nch2")], 140, env={"NCCL_MAX_NCHANNELS": "2"}),
            job("wh2c4", "0,1", "whisper", [wh("whole_b24_p16_nch4")], 140, env={"NCCL_MAX_NCHANNELS": "4"}),
            job("wh2o", "0,1", "whisper", [wh("whole_b24_p16_noov", "compile.ddp_overlap=false")], 140),
        ],
    ],
    # call 19 (prepared in session 4, not yet run): DDP bucket size for Whisper; for wav2vec2
    # (shorter steps: the all-reduce is a larger share of them) 4 channels and one bucket.
    #   python3 bench/gpu_session.py call19 --out $OUT --budget 560 --no-calib
    "call19": [
        [
            job("wh2", "0,1", "whisper", [
                wh("whole_b24_p16"),
                wh("whole_b24_p16_bucket100", "dist.bucket_cap_mb=100"),
                wh("whole_b24_p16_bucket400", "dist.bucket_cap_mb=400"),
            ], 140),
            job("w2v2", "0,1", "wav2vec2", [w2v("comp_500_p16")], 160),
            job("w2v2c4", "0,1", "wav2vec2", [w2v("comp_500_p16_nch4")], 160, env={"NCCL_MAX_NCHANNELS": "4"}),
            # one 630 MB bucket: the all-reduce after the backward
            job("w2v2b", "0,1", "wav2vec2", [w2v("comp_500_p16_bucket1000", "dist.bucket_cap_mb=1000")], 160),
        ],
    ],
    # call 20 (prepared in session 4, for when nvidia-h200-x4 is lent): scaling at 4 GPUs on
    # identical work (as_world=4: one GPU trains on the 4-GPU run's 48 batches = 12 steps).
    #   python3 bench/gpu_session.py call20 --out $OUT --budget 560 --no-calib   (kind nvidia-h200-x4)
    "call20": [
        [
            job("wh1", "0", "whisper", [wh("whole_b24_p16_as4", as_world=4)], 220, steps=48),
            job("w2v1", "1", "wav2vec2", [w2v("comp_500_p16_as4", as_world=4)], 220, steps=48),
        ],
        [
            job("wh4", "0,1,2,3", "whisper", [wh("whole_b24_p16")], 150),
            job("w2v4", "0,1,2,3", "wav2vec2", [w2v("comp_500_p16")], 150),
            job("wh4c4", "0,1,2,3", "whisper", [wh("whole_b24_p16_nch4")], 150, env={"NCCL_MAX_NCHANNELS": "4"}),
        ],
    ],
    # call 21 (session 5: only one GPU lent, multi-GPU kinds withheld): the compiled Conformer
    # with dynamic shapes against eager and the bare loop (owed since call 8a); Whisper's 1-GPU
    # MFU with the GPU sensors recorded (first run of GpuSensors).
    #   python3 bench/gpu_session.py call21 --out $OUT --budget 330 --no-calib
    "call21": [
        [
            job("cf1e", "0", "conformer", [E("p16", "ddptrain", budget=600, ov=P, profile=1)], 150, steps=16),
            job("cf1b", "0", "conformer", [E("bare", "bare", budget=600)], 150, steps=16),
            job("cf1c", "0", "conformer", [E("p16_comp_dyn", "ddptrain", budget=600, ov=CD, profile=1)], 240, steps=16),
            job("wh1", "0", "whisper", [wh("whole_b24_p16")], 200, steps=24),
        ],
    ],
    # call 21b: is the in-process slowdown of later experiments (fourth pass) there on one GPU,
    # and does the SM clock or temperature follow it? The same experiment three times in one
    # process; run with --shared-process.
    #   python3 bench/gpu_session.py call21b --out $OUT/b --budget 230 --no-calib --shared-process
    "call21b": [
        [job("wh1s", "0", "whisper", [wh("whole_b24_p16_r1"), wh("whole_b24_p16_r2"), wh("whole_b24_p16_r3")],
             220, steps=16)],
    ],
    # call 22 (session 5, one GPU): why ddptrain's eager Conformer step is slower than the bare
    # loop's (call 21: 145 vs 129 ms, 27% of the step GPU-idle). Host syncs and profiles of
    # ddptrain with fp32 and with bf16 params, the bare loop with its loss read every 10 steps
    # and every step (the cost of one host sync a step), the compile with fp32 params.
    #   python3 bench/gpu_session.py call22 --out $OUT --budget 420 --no-calib
    "call22": [
        [
            job("cf_fp32", "0", "conformer", [E("fp32", "ddptrain", budget=600, profile=1, syncs=1)], 150, steps=24),
            job("cf_p16", "0", "conformer", [E("p16", "ddptrain", budget=600, ov=P, profile=1, syncs=1)], 150, steps=24),
            job("cf_bare", "0", "conformer", [E("bare", "bare", budget=600, profile=1, syncs=1)], 150, steps=24),
            job("cf_bare1", "0", "conformer", [E("bare_item1", "bare", budget=600, item_every=1)], 150, steps=24),
            job("cf_cfp32", "0", "conformer", [E("fp32_comp_dyn", "ddptrain", budget=600, ov=CD[1:])], 200, steps=24),
        ],
    ],
    # call 23 (session 5, one GPU): after the fix of the second host sync (trainer.py: the
    # preemption flag made with torch.full), ddptrain vs the bare loop again, with the host work
    # that overlaps each long GPU idle gap (gap_owners); the fp32 run twice for the noise.
    #   python3 bench/gpu_session.py call23 --out $OUT --budget 300 --no-calib
    "call23": [
        [
            job("cf_fp32", "0", "conformer", [E("fp32", "ddptrain", budget=600, profile=1, syncs=1, gaps=1)], 150, steps=24),
            job("cf_bare", "0", "conformer", [E("bare", "bare", budget=600, profile=1, gaps=1)], 150, steps=24),
            job("cf_fp32b", "0", "conformer", [E("fp32_again", "ddptrain", budget=600)], 150, steps=24),
            job("cf_p16", "0", "conformer", [E("p16", "ddptrain", budget=600, ov=P)], 150, steps=24),
        ],
    ],
    # call 24 (session 5, one GPU): the step decided on the device (fused AdamW's found_inf, no
    # host sync before the optimizer) against the session-start code, which the device command
    # puts first on PYTHONPATH from a copy (.old/ddptrain, git archive eeae3e8) in alternate
    # invocations; the bare loop in each as the noise gauge. call24w: wav2vec2 (bf16 params with
    # fp32 masters: the masters' path of the change on CUDA), once each.
    #   python3 bench/gpu_session.py call24 --out $OUT/new1 --budget 150 --no-calib
    "call24": [
        [
            job("cf_fp32", "0", "conformer", [E("fp32", "ddptrain", budget=600)], 120, steps=24),
            job("cf_bare", "0", "conformer", [E("bare", "bare", budget=600)], 120, steps=24),
        ],
    ],
    "call24w": [
        [job("w2v1", "0", "wav2vec2", [w2v("comp_500_p16")], 200, steps=16)],
    ],
    # call 14 (session 4, not run: call 15 took its wav2vec2 part; its Conformer jobs are still
    # owed): wav2vec2 sync vs unsync buckets on 2 GPUs against the 1-GPU baseline
    # on the same batches, in one call; the Conformer compiled with dynamic shapes, 1 and 2 GPUs.
    #   python3 bench/gpu_session.py call14 --out $OUT --budget 560 --no-calib
    "call14": [
        [
            job("w2v1", "0", "wav2vec2", [w2v("comp_500_p16_as2", as_world=2, profile=1)], 220, steps=24),
            job("cf1", "1", "conformer", [E("p16_comp_dyn_as2", "ddptrain", budget=600, as_world=2, ov=CD)], 220, steps=16),
        ],
        [
            job("w2v2", "0,1", "wav2vec2", [w2v("comp_500_p16"), w2v("comp_500_p16_nosync", "data.sync_buckets=false")],
                280),
        ],
        [
            job("cf2", "0,1", "conformer", [E("p16_comp_dyn", "ddptrain", budget=600, ov=CD)], 150, steps=8),
        ],
    ],
}


def env_for(gpus: str, dry: bool) -> dict:
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4", TOKENIZERS_PARALLELISM="false")
    if not dry:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH", ""), ROOT) if p])
    return env


def job_cmd(label, gpus, workload, exps, out_dir, dry, warmup, steps, port):
    n = len(gpus.split(","))
    exps_file = os.path.join(out_dir, "logs", f"{label}.exps.json")
    if dry:  # tiny sizes on CPU
        small = {"batch": 2} if workload == "whisper" else {"budget": 40, "batch": 4}
        exps = [dict(e, workers=1, profile_steps=1, **small) for e in exps]
        exps = [dict(e, replay=2) if e.get("replay") else e for e in exps]
        # inductor's CPU (C++) code generation fails on some bf16 graphs here: trace only
        exps = [dict(e, ov=e["ov"] + ["compile.backend=aot_eager"]) if "compile.enabled=true" in e.get("ov", [])
                else e for e in exps]
    with open(exps_file, "w") as f:
        json.dump(exps, f)
    py = sys.executable
    # ddp1 (diagnostic): one GPU under torchrun, so the Trainer makes a process group of one and
    # wraps the model in DDP: the cost of being a DDP rank, without a second rank
    ddp1 = any(e.get("ddp1") for e in exps)
    launch = ([py, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={port}"]
              if n > 1 or ddp1 else [py])
    return launch + [os.path.join(HERE, "bench_models.py"), "--workload", workload, "--exps", "@" + exps_file,
                     "--out", os.path.join(out_dir, "results.jsonl"), "--tag", label,
                     "--warmup", str(1 if dry else warmup), "--steps", str(2 if dry else steps),
                     "--preset", "tiny" if dry else "large"]


def one_per_process(stage):
    """Split every job of several experiments into one job (process) per experiment, in order.

    Why: in the fourth pass a later experiment in a process ran 1-14% slower than the first
    (the same no-all-reduce run: 587 ms third in its process, 514 ms first in another), which
    had made two earlier conclusions wrong. A process per experiment costs ~15 s of start-up.
    Each process keeps the job's timeout; the call's budget still bounds the whole stage.
    """
    out = []
    for job in stage:
        exps = job[3]
        if len(exps) == 1:
            out.append(job)
            continue
        for i, e in enumerate(exps):
            out.append((f"{job[0]}-{i}", job[1], job[2], [e], *job[4:]))
    return out


def run_stage(stage, out_dir, dry, t_start, budget_s):
    """Start the stage's jobs; jobs that share a GPU run in order. Returns when all have ended."""
    by_gpu: dict[str, list] = {}
    for job in stage:
        by_gpu.setdefault(job[1], []).append(job)
    queues = list(by_gpu.values())
    running = []  # (proc, label, deadline, logfile, queue)
    port = 29500 + int(time.time()) % 1000

    def start(job):
        nonlocal port
        label, gpus, workload, exps, timeout = job[:5]
        warmup, steps = (job[5], job[6]) if len(job) > 6 else (4, 12)
        if len(job) > 7:  # job-wide defaults for every experiment
            exps = [dict(job[7], **e) for e in exps]
        left = budget_s - (time.time() - t_start)
        timeout = min(timeout, max(10, left - 5))
        port += 1
        cmd = job_cmd(label, gpus, workload, exps, out_dir, dry, warmup, steps, port)
        logf = open(os.path.join(out_dir, "logs", f"{label}.log"), "w")
        print(f"[{time.time() - t_start:6.1f}s] start {label} on GPU {gpus}, timeout {timeout:.0f}s", flush=True)
        env = env_for(gpus, dry)
        if len(job) > 8:  # extra environment for this job (e.g. NCCL settings)
            env.update(job[8])
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1, start_new_session=True)
        os.set_blocking(p.stdout.fileno(), False)
        return [p, label, time.time() + timeout, logf, ""]

    active = []
    for q in queues:
        active.append((start(q.pop(0)), q))
    while active:
        time.sleep(0.5)
        still = []
        for r, q in active:
            p, label, deadline, logf, buf = r
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
                if q:
                    still.append((start(q.pop(0)), q))
            else:
                still.append((r, q))
        active = still


def table(results_path: str) -> str:
    if not os.path.exists(results_path):
        return "(no results)"
    rows = [json.loads(x) for x in open(results_path) if x.strip()]
    hdr = f"{'workload':9s} {'gpus':>4s} {'name':18s} {'smp/s':>8s} {'audio-s/s':>10s} {'pad':>5s} {'MFU':>6s} " \
          f"{'peakGB':>7s} {'restGB':>7s} {'wait':>6s} {'idle':>6s} {'step ms':>8s} {'SM MHz':>7s} {'degC':>8s}"
    out = [hdr]
    for r in rows:
        if "error" in r:
            out.append(f"{r['workload']:9s} {r['world_size']:4d} {r['name']:18s} ERROR {r['error'][:90]}")
            continue
        idle = r.get("profile", {}).get("gpu_idle_frac_of_wall")
        wait = r.get("data_wait_frac")
        out.append(f"{r['workload']:9s} {r['world_size']:4d} {r['name']:18s} {r['samples_per_s']:8.1f} "
                   f"{r['audio_s_per_s']:10.1f} {r['padding_frac']:5.3f} {r['mfu']:6.3f} {r['peak_alloc_gb']:7.1f} "
                   f"{r.get('mem_at_rest_gb', float('nan')):7.2f} {wait if wait is None else round(wait, 3)!s:>6s} "
                   f"{idle if idle is None else round(idle, 3)!s:>6s} {r.get('step_ms_median') or 0:8.0f} "
                   f"{r.get('sm_clock_mhz', [None] * 3)[1]!s:>7s} {'-'.join(map(str, r.get('gpu_temp_c', []))):>8s}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("plan", choices=sorted(PLANS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole plan")
    ap.add_argument("--dry", action="store_true", help="tiny models on CPU")
    ap.add_argument("--stages", default="", help="comma-separated stage indices to run (default all)")
    ap.add_argument("--no-calib", action="store_true")
    ap.add_argument("--shared-process", action="store_true",
                    help="run a job's experiments in one process (before session 4's finding; see one_per_process)")
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    t0 = time.time()
    if not a.dry and not a.no_calib:
        subprocess.run("nvidia-smi; nvidia-smi topo -m", shell=True)
        subprocess.run([sys.executable, os.path.join(HERE, "calib.py")], env=env_for("0", False))
    stages = PLANS[a.plan]
    pick = [int(s) for s in a.stages.split(",")] if a.stages else range(len(stages))
    for i in pick:
        if time.time() - t0 > a.budget - 20:
            print(f"skipping stage {i}: budget spent", flush=True)
            continue
        run_stage(stages[i] if a.shared_process else one_per_process(stages[i]), a.out, a.dry, t0, a.budget)
    with tarfile.open(os.path.join(a.out, "logs.tar.gz"), "w:gz") as tar:
        tar.add(os.path.join(a.out, "logs"), arcname="logs")
    import shutil

    shutil.rmtree(os.path.join(a.out, "logs"))
    print(f"total {time.time() - t0:.0f}s")
    print(table(os.path.join(a.out, "results.jsonl")))


if __name__ == "__main__":
    main()
