"""LoRA on a 9B decoder with its frozen base resident on the GPU or streamed from host memory.

The model is bench_9b's GLM-4.1V-9B text decoder (``TextLM`` on the real text config: 40 layers,
4096-d, 13696 FFN, 32 query / 2 KV heads, 151,552-token vocabulary; ~9.4B parameters), random
init in bf16, made on the GPU (fast; the Trainer then moves a streamed base to pinned host
memory) or with ``--build-on host`` on the CPU (the base never visits the GPU; a slow random
init). LoRA r=16 on ``q/k/v/o_proj``, ``trainer.param_dtype: bf16``, recompute on every decoder
layer. Each ``lora.base_offload`` mode of ``--modes`` runs in its own process: 1 warm-up + 5
timed steps on one 4096-token sequence, then on one 8192-token sequence (the same Trainer). A
row per mode and length: tokens/s, peak allocated GPU memory over the steps
(``setup_peak_alloc_gib``: over the set-up), the streaming counters and every step's loss,
compared with the first resident-base run (``loss_max_rel_diff_vs_none``; ``loss_first_step_equal``
is a forward of identical weights, which must be bitwise equal; ``--modes none,none,cpu`` also
measures how far two resident runs drift apart through non-deterministic kernels). The fields of
bench/results: workload, peer, world_size, batch, tokens_per_s, peak_alloc_gb (1e9 bytes),
gpu_memory_gb.

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


def build(preset: str, dev: torch.device):
    """bench_9b's text decoder with its head, built on ``dev`` in bf16 (seeded: the same in every mode)."""
    import bench_9b

    cfg = bench_9b.glm4v_config(preset)  # with_vision: the 9B text config (TextLM drops the vision tower)
    if preset == "tiny":
        cfg.text_config.num_hidden_layers = 4  # more blocks than ring buffers: the ring cycles
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
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


def run_mode(mode: str, run: int, preset: str, gpu_memory_gb: float, tmp: str, steps: int, build_on: str,
             partial: str) -> None:
    """One process, one mode: the rows of both sequence lengths (or an error row), appended to
    ``partial`` as each is measured (a run cut short keeps what it measured)."""
    dev = torch.device("cuda", 0) if preset == "real" else torch.device("cpu")
    if dev.type == "cuda" and gpu_memory_gb > 0:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(gpu_memory_gb * 2**30 / total, dev)
    ov = [f"trainer.output_dir={tmp}/{mode}{run}", "trainer.precision=bf16", "trainer.param_dtype=bf16",
          f"trainer.device={dev.type}", "trainer.clip_grad_norm=1.0", "trainer.max_steps=1000",
          "checkpoint.save_at_end=false", "checkpoint.start_over=true", "logging.tensorboard=false",
          "logging.progress_bar=false", "logging.log_every=100000", "optim.lr=1e-4", "recompute.enabled=true",
          "recompute.module_classes=[Glm4vTextDecoderLayer]", "lora.enabled=true",
          f"lora.targets={json.dumps(TARGETS)}", "lora.rank=16", "lora.alpha=32", f"lora.base_offload={mode}"]
    cfg = ddptrain.load_config(None, ov)
    t0 = time.perf_counter()
    model, mcfg = build(preset, dev if build_on == "gpu" else torch.device("cpu"))
    built_s = time.perf_counter() - t0
    _say(f"{mode}: built on {build_on} in {built_s:.0f}s")
    base = {"peer": f"ddptrain_base_offload_{mode}", "base_offload": mode, "run": run, "world_size": 1, "batch": 1,
            "preset": preset, "gpu_memory_gb": gpu_memory_gb or None, "build_s": round(built_s, 1),
            "built_on": build_on, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    seq = None
    try:
        t0 = time.perf_counter()
        trainer = ddptrain.Trainer(model, lambda m, b: m(**b), cfg, [None])
        base["setup_s"] = round(time.perf_counter() - t0, 1)
        _say(f"{mode}: Trainer set up in {base['setup_s']}s")
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
                _say(f"{mode}: {seq} tokens, step {len(times)}: {times[-1] * 1e3:.0f} ms, loss {losses[-1]:.6f}")
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
            _append(partial, row)
        trainer.close()
    except Exception as e:  # an out-of-memory error on a capped GPU is a result: this mode does not fit
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
        _append(partial, dict(base, workload=f"glm4v_9b_text_lora_{(seq or 0) // 1024}k" if preset == "real"
                              else "tiny", seq=seq, error=f"{type(e).__name__}: {str(e)[:400]}",
                              peak_alloc_gib=round(peak, 2)))


def _say(msg: str) -> None:
    print(f"[check_streamed_base {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _append(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(rows: list[dict]) -> None:
    """Every row of a later run gets the step-by-step loss comparison with the first resident-base
    run (``--modes none,none,cpu`` also measures how far two resident runs drift apart)."""
    runs = sorted({r["run"] for r in rows if r.get("base_offload") == "none" and "losses" in r})
    if not runs:
        return
    plain = {r["seq"]: r for r in rows if r["run"] == runs[0] and "losses" in r}
    for r in rows:
        ref = plain.get(r.get("seq"))
        if r["run"] == runs[0] or "losses" not in r or ref is None:
            continue
        diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], ref["losses"])]
        r.update(loss_first_step_equal=r["losses"][0] == ref["losses"][0],
                 loss_bitwise_equal=r["losses"] == ref["losses"], loss_max_rel_diff_vs_none=max(diffs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/check_streamed_base.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results file (JSON lines, appended)")
    p.add_argument("--tiny", action="store_true", help="a 4-layer tiny decoder on CPU, 64/128 tokens (same code)")
    p.add_argument("--gpu-memory-gb", type=float, default=0.0, help="cap the GPU at this many GiB (0: no cap)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="lora.base_offload modes, comma-separated, one process each (none,none,cpu: also the drift "
                        "of two resident runs)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per sequence length (after 1 warm-up)")
    p.add_argument("--tmp", default="/tmp/check_streamed_base", help="scratch folder for run folders")
    p.add_argument("--build-on", choices=["gpu", "host"], default="gpu",
                   help="where the random model is made: gpu (fast; the Trainer then moves a streamed base to the "
                        "host) or host (slow random init on the CPU; the base never visits the GPU)")
    p.add_argument("--mode", help=argparse.SUPPRESS)  # a child process: run this mode, append its rows
    p.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)  # the child's place in --modes
    args = p.parse_args(argv)
    preset = "tiny" if args.tiny else "real"
    partial = args.out + ".partial"  # the children's rows, compared and moved to --out at the end
    if args.mode:
        run_mode(args.mode, args.run, preset, args.gpu_memory_gb, args.tmp, args.steps, args.build_on, partial)
        return 0
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if args.tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if os.path.exists(partial):
        os.remove(partial)  # left by a run that was cut short
    for run, mode in enumerate(args.modes.split(",")):
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--out", args.out, "--tmp", args.tmp,
               "--steps", str(args.steps), "--gpu-memory-gb", str(args.gpu_memory_gb), "--build-on", args.build_on]
        cmd += ["--run", str(run)] + (["--tiny"] if args.tiny else [])
        t0 = time.time()
        done = len(_read(partial))
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 and len(_read(partial)) == done:
            _append(partial, {"workload": "glm4v_9b_text_lora", "peer": f"ddptrain_base_offload_{mode}",
                              "base_offload": mode, "run": run, "error": f"child exited with {proc.returncode}",
                              "gpu_memory_gb": args.gpu_memory_gb or None})
        _say(f"{mode}: rc={proc.returncode} in {time.time() - t0:.0f}s")
    rows = _read(partial)
    compare(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.remove(partial)
    for r in rows:
        print(json.dumps({k: r.get(k) for k in ("workload", "peer", "tokens_per_s", "peak_alloc_gib", "error",
                                                "loss_first_step_equal", "loss_max_rel_diff_vs_none")}))
    return 1 if any("error" in r for r in rows) and not args.gpu_memory_gb else 0


if __name__ == "__main__":
    sys.exit(main())
