"""How long the ranks of a step wait for each other, from the batch plan alone (no GPU).

Every training step ends in an all-reduce, so a step lasts as long as the costliest of its
``W`` batches and the other ranks idle for the difference. With ``c[s][r]`` the cost of rank
``r``'s batch at step ``s`` (model FLOPs of the padded batch, ``flops.Flops``), the
scaling efficiency that the imbalance alone leaves is

    balance = sum_s mean_r c[s][r] / sum_s max_r c[s][r]

(1.0 = no waiting). This script computes it over whole epochs of the benchmark's synthetic
corpora (bench/workloads.py, examples/finetune_hf_model.py: wav2vec2 durations lognormal median 7 s,
Whisper transcripts lognormal median 60 tokens, Conformer on the wav2vec2 durations) for several
world sizes, with ``data.sync_buckets`` on and off, and for Whisper also the plain random
batches the example used before (``DistributedSampler``). It assumes step time proportional to
FLOPs: fixed per-step costs make the real loss smaller, lower kernel efficiency on small shapes
makes it larger. The models are built on the meta device (parameter counts only).

    python bench/bench_balance.py                    # table on stdout
    python bench/bench_balance.py --worlds 2,4,8 --epochs 3 --json out.json
    # your own data: the sampler's own cost model (padded seconds, + d^2/q with --quadratic)
    python bench/bench_balance.py --manifest train.jsonl --budget 200 --worlds 2,8

Needs transformers for the wav2vec2 / Whisper rows (a benchmark dependency, as in bench/workloads.py);
the manifest mode needs only ddptrain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..")]

import ddptrain  # noqa: E402
from ddptrain.data import DurationBucketSampler  # noqa: E402
from ddptrain.data.sampler import padded_cost  # noqa: E402


def batch_cost(workload: str, flops, lengths: np.ndarray, batch: np.ndarray) -> float:
    """FLOPs of one padded batch; ``lengths`` are seconds (wav2vec2, conformer) or tokens
    (whisper). Workload ``manifest``: ``flops`` is the sampler, and the cost its own
    ``batch size x cost(longest)`` in padded seconds."""
    n, longest = len(batch), float(lengths[batch].max())
    if workload == "manifest":
        return n * float(padded_cost(longest, flops.quadratic_duration))
    if workload == "wav2vec2":
        return flops.wav2vec2(n, int(round(longest * 16000)))
    if workload == "whisper":
        return flops.whisper(n, int(longest))
    return flops.conformer(n, int(round(longest * 100)))


def balance(costs: np.ndarray) -> float:
    """costs: (steps, W) -> sum of step means / sum of step maxima."""
    return float(costs.mean(axis=1).sum() / costs.max(axis=1).sum())


def plan_costs(workload, flops, samplers, epochs) -> tuple[np.ndarray, float]:
    """(steps x W cost matrix over ``epochs`` epochs, padding fraction of the plan); one sampler per rank."""
    lengths = samplers[0].durations
    rows, real, padded = [], 0.0, 0.0
    for epoch in range(epochs):
        per_rank = []
        for s in samplers:
            s.set_epoch(epoch)
            per_rank.append([np.asarray(b) for b in s])
        for step in zip(*per_rank):
            rows.append([batch_cost(workload, flops, lengths, b) for b in step])
            for b in step:
                real += lengths[b].sum()
                padded += len(b) * lengths[b].max()
    return np.array(rows), 1 - real / padded


def random_costs(workload, flops, lengths, batch, world, epochs, seed=0) -> tuple[np.ndarray, float]:
    """Random fixed-size batches (torch's DistributedSampler + drop_last), for comparison."""
    rows, real, padded = [], 0.0, 0.0
    for epoch in range(epochs):
        perm = np.random.default_rng([seed, epoch]).permutation(len(lengths))
        per_step = batch * world
        for s in range(len(perm) // per_step):
            step = [perm[s * per_step + r * batch: s * per_step + (r + 1) * batch] for r in range(world)]
            rows.append([batch_cost(workload, flops, lengths, b) for b in step])
            for b in step:
                real += lengths[b].sum()
                padded += len(b) * lengths[b].max()
    return np.array(rows), 1 - real / padded


def workload_samplers(workload: str, budget: float, batch: int):
    """(``samplers(world, sync)`` -> one batch sampler per rank, Flops): the very samplers the
    benchmark's loaders use (``workloads.make_loader``), so the plans cannot drift apart."""
    from workloads import build, make_loader

    exp = {"batch": batch, "budget": budget, "workers": 0}
    with torch.device("meta"):
        model, _, flops = build(workload, "large", exp, torch.device("meta"))

    def samplers(world: int, sync: bool) -> list:
        data = ddptrain.load_config(None, [f"data.max_duration={budget}", "data.num_workers=0",
                                           f"data.sync_buckets={sync}"]).data
        return [make_loader(workload, "large", exp, model, flops, r, world, data).batch_sampler for r in range(world)]

    return samplers, flops


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="wav2vec2,whisper,conformer")
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--budget", type=float, default=500.0, help="data.max_duration (wav2vec2, conformer, manifest)")
    p.add_argument("--batch", type=int, default=24, help="windows per batch (whisper)")
    p.add_argument("--manifest", default="", help="a training manifest instead of the synthetic corpora")
    p.add_argument("--quadratic", type=float, default=0.0, help="data.quadratic_duration (manifest mode)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows = []
    print(f"{'workload':9s} {'W':>2s} {'plan':22s} {'steps':>6s} {'balance':>8s} {'padding':>8s}")
    for workload in (["manifest"] if a.manifest else a.workloads.split(",")):
        if a.manifest:
            from ddptrain.data.manifest import load_manifest

            lengths = np.array([e.duration for e in load_manifest(a.manifest)], dtype=np.float64)
            data = ddptrain.load_config(None, []).data
            kw = dict(max_duration=a.budget, quadratic_duration=a.quadratic, num_buckets=data.num_buckets,
                      sort_pool=data.bucket_sort_pool, seed=data.seed)
            flops = DurationBucketSampler(lengths, **kw)  # its cost function

            def samplers(world, sync):
                return [DurationBucketSampler(lengths, world_size=world, rank=r, sync_buckets=sync, **kw)
                        for r in range(world)]
        else:
            samplers, flops = workload_samplers(workload, a.budget, a.batch)
        for world in [int(w) for w in a.worlds.split(",")]:
            plans = [("sync_buckets=true", lambda: plan_costs(workload, flops, samplers(world, True), a.epochs)),
                     ("sync_buckets=false", lambda: plan_costs(workload, flops, samplers(world, False), a.epochs))]
            if workload == "whisper":
                lengths = samplers(1, True)[0].durations
                plans.append(("random batches", lambda: random_costs(workload, flops, lengths, a.batch, world, a.epochs)))
            for name, fn in plans:
                costs, pad = fn()
                row = {"workload": workload, "world_size": world, "plan": name, "steps": len(costs),
                       "balance": round(balance(costs), 4), "padding_frac": round(float(pad), 4)}
                rows.append(row)
                print(f"{workload:9s} {world:2d} {name:22s} {len(costs):6d} {row['balance']:8.4f} {pad:8.4f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
