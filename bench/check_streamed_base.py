"""LoRA on a 9B decoder with its frozen base resident on the GPU or streamed from host memory.

The model is bench_9b's GLM-4.1V-9B text decoder (``TextLM`` on the real text config: 40 layers,
4096-d, 13696 FFN, 32 query / 2 KV heads, 151,552-token vocabulary; ~9.4B parameters), random
init, built in bf16 on the host (the streamed base never visits the GPU). LoRA r=16 on
``q/k/v/o_proj``, ``trainer.param_dtype: bf16``, recompute on every decoder layer. Each
``lora.base_offload`` mode (``none``, ``cpu``) runs in its own process: 1 warm-up + 5 timed
steps on one 4096-token sequence, then on one 8192-token sequence (the same Trainer), and reports
tokens/s, peak allocated GPU memory, the streaming counters, and every step's loss. The parent
compares the modes' losses step by step (``loss_max_rel_diff_vs_none``; ``loss_first_step_equal``
is the forward of identical weights, which must be bitwise equal) and appends one row per mode and
length to ``--out`` (fields of bench/results: workload, peer, world_size, batch, tokens_per_s,
peak_alloc_gb (1e9 bytes), gpu_memory_gb).

    python3 bench/check_streamed_base.py --out "$OUT/streamed_base.jsonl"                   # one H200
    python3 bench/check_streamed_base.py --gpu-memory-gb 23 --out "$OUT/streamed_24g.jsonl"  # a 24 GB card
    python3 bench/check_streamed_base.py --tiny --out /tmp/sb.jsonl                          # CPU, tiny

``--gpu-memory-gb G`` caps this process's caching allocator at G GiB
(``torch.cuda.set_per_process_memory_fraction``) before anything lands on the GPU: a resident
base that does not fit then fails with an ``error`` row, as it would on the small card.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import ddptrain  # noqa: E402

TARGETS = ["*language_model.layers.*.self_attn.[qkvo]_proj"]
SEQS = {"real": (4096, 8192), "tiny": (64, 128)}
MODES = ("none", "cpu")


def build(preset: str):
    """bench_9b's text decoder with its head, on the host in bf16 (seeded: the same in every mode)."""
    import bench_9b

    cfg = bench_9b.glm4v_config(preset)  # with_vision: the 9B text config (TextLM drops the vision tower)
    if preset == "tiny":
        cfg.text_config.num_hidden_layers = 4  # more blocks than ring buffers: the ring cycles
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return bench_9b.WithLoss(bench_9b.TextLM(cfg)), cfg
    finally:
        torch.set_default_dtype(old)


def batch(cfg, seq: int, dev: torch.device) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, min(cfg.text_config.vocab_size, cfg.image_start_token_id) - 1, (1, seq), generator=g)
    labels = ids.clone()
    labels[0, :16] = -100  # a short prompt, then supervised tokens
    return {"input_ids": ids.to(dev), "labels": labels.to(dev)}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_mode(mode: str, preset: str, gpu_memory_gb: float, tmp: str, steps: int) -> list[dict]:
    """One process, one mode: the rows of both sequence lengths (or an error row)."""
    dev = torch.device("cuda", 0) if preset == "real" else torch.device("cpu")
    if dev.type == "cuda" and gpu_memory_gb > 0:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(gpu_memory_gb * 2**30 / total, dev)
    ov = [f"trainer.output_dir={tmp}/{mode}", "trainer.precision=bf16", "trainer.param_dtype=bf16",
          f"trainer.device={dev.type}", "trainer.clip_grad_norm=1.0", "trainer.max_steps=1000",
          "checkpoint.save_at_end=false", "checkpoint.start_over=true", "logging.tensorboard=false",
          "logging.progress_bar=false", "logging.log_every=100000", "optim.lr=1e-4", "recompute.enabled=true",
          "recompute.module_classes=[Glm4vTextDecoderLayer]", "lora.enabled=true",
          f"lora.targets={json.dumps(TARGETS)}", "lora.rank=16", "lora.alpha=32", f"lora.base_offload={mode}"]
    cfg = ddptrain.load_config(None, ov)
    t0 = time.perf_counter()
    model, mcfg = build(preset)
    built_s = time.perf_counter() - t0
    rows, base = [], {"peer": f"ddptrain_base_offload_{mode}", "base_offload": mode, "world_size": 1, "batch": 1,
                      "preset": preset, "gpu_memory_gb": gpu_memory_gb or None, "build_s": round(built_s, 1),
                      "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    seq = None
    try:
        t0 = time.perf_counter()
        trainer = ddptrain.Trainer(model, lambda m, b: m(**b), cfg, [None])
        base["setup_s"] = round(time.perf_counter() - t0, 1)
        if dev.type == "cuda":
            base["setup_peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        sb = trainer.streamed
        if sb is not None:
            base.update(ring_gib=round(sb.device_bytes() / 2**30, 3), host_base_gib=round(sb.host_bytes() / 2**30, 2),
                        streamed_blocks=len(sb.blocks))
        for seq in SEQS[preset]:
            b = batch(mcfg, seq, dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            before = dict(sb.stats) if sb is not None else {}
            times, losses = [], []
            for _ in range(1 + steps):
                _sync(dev)
                t = time.perf_counter()
                out = trainer.train_step([b])
                _sync(dev)
                times.append(time.perf_counter() - t)
                losses.append(out["loss_sum"] / max(out["units"], 1))
            med = statistics.median(times[1:])
            row = dict(base, workload=f"glm4v_9b_text_lora_{seq // 1024}k" if preset == "real" else f"tiny_lora_{seq}",
                       seq=seq, steps=steps, tokens_per_s=seq / med, step_ms_median=round(1e3 * med, 1),
                       step_ms_all=[round(1e3 * x, 1) for x in times], losses=losses)
            if dev.type == "cuda":
                peak = torch.cuda.max_memory_allocated(dev)
                row.update(peak_alloc_gib=round(peak / 2**30, 2), peak_alloc_gb=round(peak / 1e9, 2),
                           at_rest_gib=round(torch.cuda.memory_allocated(dev) / 2**30, 2))
            else:
                row.update(peak_alloc_gib=0.0, peak_alloc_gb=0.0)
            if sb is not None:
                copied = sb.stats["copied_bytes"] - before["copied_bytes"]
                row["copied_gb_per_step"] = round(copied / (1 + steps) / 1e9, 4)
                row["ring_reuses_per_step"] = (sb.stats["reused"] - before["reused"]) / (1 + steps)
                row["on_demand"] = sb.stats["on_demand"]
            rows.append(row)
        trainer.close()
    except Exception as e:  # an out-of-memory error on a capped GPU is a result: this mode does not fit
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
        rows.append(dict(base, workload=f"glm4v_9b_text_lora_{(seq or 0) // 1024}k" if preset == "real" else "tiny",
                         seq=seq, error=f"{type(e).__name__}: {str(e)[:400]}", peak_alloc_gib=round(peak, 2)))
    return rows


def compare(rows: list[dict]) -> None:
    """Each offloaded row gets the step-by-step loss comparison with the resident base's row."""
    plain = {r["seq"]: r for r in rows if r["base_offload"] == "none" and "losses" in r}
    for r in rows:
        ref = plain.get(r.get("seq"))
        if r["base_offload"] == "none" or "losses" not in r or ref is None:
            continue
        diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], ref["losses"])]
        r.update(loss_first_step_equal=r["losses"][0] == ref["losses"][0],
                 loss_bitwise_equal=r["losses"] == ref["losses"], loss_max_rel_diff_vs_none=max(diffs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/check_streamed_base.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results file (JSON lines, appended)")
    p.add_argument("--tiny", action="store_true", help="a 4-layer tiny decoder on CPU, 64/128 tokens (same code)")
    p.add_argument("--gpu-memory-gb", type=float, default=0.0, help="cap the GPU at this many GiB (0: no cap)")
    p.add_argument("--modes", default=",".join(MODES), help="lora.base_offload modes, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per sequence length (after 1 warm-up)")
    p.add_argument("--tmp", default="/tmp/check_streamed_base", help="scratch folder for run folders")
    p.add_argument("--mode", help=argparse.SUPPRESS)  # a child process: run this mode, print its rows
    args = p.parse_args(argv)
    preset = "tiny" if args.tiny else "real"
    if args.mode:
        for row in run_mode(args.mode, preset, args.gpu_memory_gb, args.tmp, args.steps):
            print("ROW " + json.dumps(row), flush=True)
        return 0
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if args.tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--out", args.out, "--tmp", args.tmp,
               "--steps", str(args.steps), "--gpu-memory-gb", str(args.gpu_memory_gb)]
        cmd += ["--tiny"] if args.tiny else []
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode != 0 and not got:
            got = [{"workload": "glm4v_9b_text_lora", "peer": f"ddptrain_base_offload_{mode}", "base_offload": mode,
                    "error": f"child exited with {proc.returncode}", "gpu_memory_gb": args.gpu_memory_gb or None}]
        print(f"[check_streamed_base] {mode}: rc={proc.returncode} in {time.time() - t0:.0f}s", flush=True)
        rows += got
    compare(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for r in rows:
        print(json.dumps({k: r.get(k) for k in ("workload", "peer", "tokens_per_s", "peak_alloc_gib", "error",
                                                "loss_first_step_equal", "loss_max_rel_diff_vs_none")}))
    return 1 if any("error" in r for r in rows) and not args.gpu_memory_gb else 0


if __name__ == "__main__":
    sys.exit(main())
