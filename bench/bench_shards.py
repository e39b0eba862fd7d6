"""Shards vs one file per utterance: loading throughput, file opens, storage reads; plan and resume cost.

Why: at 10^5-10^6 utterances, opening one small file per utterance is what stops data loading
from scaling (a metadata round trip each on network storage). This measures, on this machine's
disk, the same synthetic corpus read two ways through ``build_dataloader``:

1. loading: ``N`` utterances (0.5-2 s, 16 kHz FLAC, sine + noise) as ``N`` files vs as
   ``ddptrain.data.shards`` tar shards of 1,000 (windowed plan, ``data.shard_window`` 4, and the
   global plan, 0), with 1, 2 and 4 DataLoader workers, ``features: raw`` (decode only: the
   ``feature_device: gpu`` path, so the input pipeline is what is timed, not fbank). Each pass
   reads an epoch from its start, *cold* (the corpus evicted from the page cache first, per file,
   with ``POSIX_FADV_DONTNEED``: no root, no effect on other files) or warm (read just before).
   Reported: utterances/s, audio s/s, the workers' CPU time per utterance (``/proc/PID/stat``:
   on a shared machine wall time varies with the other jobs, CPU time much less), file opens
   (counted in the workers), read syscalls and bytes read from storage (``/proc/PID/io``: page-
   cache hits are not counted). Each pass times the first ``--pass-utterances`` of an epoch.
   Before them, the storage pattern alone: the utterances' bytes read in plan order by one
   thread, cold, without decoding.
2. plan: the cost of planning an epoch and of a mid-epoch resume at ``--plan-utterances``
   (10^6) from indexes alone (1,000 shard indexes, placeholder tar files without audio):
   reading the indexes, the buckets (once), one epoch's plan, and a resume (a new sampler,
   ``load_state_dict`` at the middle of the epoch, the first batch).

Run::

    python bench/bench_shards.py --warm                            # BENCHMARKS.md numbers
    python bench/bench_shards.py --utterances 2000 --workers 1     # a quick look
    python bench/bench_shards.py --plan-only

Rows go to ``--out`` (JSON lines; one per measurement, with the machine and the date).
The corpus lives under ``--root`` (default /tmp/bench_shards: ~6 GB for 10^5 utterances, files
plus shards) and is reused by later runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import soundfile as sf
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddptrain.data import DataConfig, DurationBucketSampler, build_dataloader  # noqa: E402
from ddptrain.data import audio as audio_module  # noqa: E402
from ddptrain.data import shards as shards_module  # noqa: E402
from ddptrain.data.mix import WeightedMixSampler  # noqa: E402
from ddptrain.data.shard_sampler import ShardWindowSampler  # noqa: E402
from ddptrain.data.shards import index_path, load_shards, write_shards  # noqa: E402

SR = 16000


# ---------------------------------------------------------------------- the corpus


def make_corpus(root: str, n: int, seed: int = 0) -> str:
    """``n`` FLAC files in folders of 1,000 and their manifest (reused when it exists)."""
    manifest = os.path.join(root, f"files_{n}.jsonl")
    if os.path.exists(manifest):
        return manifest
    rng = np.random.default_rng(seed)
    durations = np.round(rng.uniform(0.5, 2.0, n), 4)
    t = np.arange(2 * SR) / SR
    bank = [(0.3 * np.sin(2 * np.pi * f * t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32)
            for f in rng.uniform(100, 400, 64)]  # slices of a few tones: cheap to make, FLAC-typical size

    def write(i):
        rel = os.path.join("files", f"{i // 1000:04d}", f"u{i:07d}.flac")
        sf.write(os.path.join(root, rel), bank[i % 64][: int(durations[i] * SR)], SR, subtype="PCM_16")
        return json.dumps({"audio_filepath": rel, "duration": float(int(durations[i] * SR) / SR),
                           "text": "a b c", "id": f"u{i:07d}"})

    for d in range(0, n, 1000):
        os.makedirs(os.path.join(root, "files", f"{d // 1000:04d}"), exist_ok=True)
    with ThreadPoolExecutor(2) as pool:
        lines = list(pool.map(write, range(n), chunksize=256))
    with open(manifest + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(manifest + ".tmp", manifest)
    return manifest


def evict(paths) -> None:
    """Drop these files from the page cache (POSIX_FADV_DONTNEED), so the next read is from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass


# ---------------------------------------------------------------------- loading


def count_opens(counter):
    """Count, in every (forked) worker, the opens the two reading paths make: soundfile opens an
    audio file by path; ShardDataset opens a shard with os.open."""
    real_soundfile, real_open = audio_module.sf.SoundFile, shards_module.os.open

    class CountedSoundFile(real_soundfile):
        def __init__(self, file, *a, **kw):
            if isinstance(file, str):
                with counter.get_lock():
                    counter.value += 1
            super().__init__(file, *a, **kw)

    def counted_open(path, *a, **kw):
        with counter.get_lock():
            counter.value += 1
        return real_open(path, *a, **kw)

    audio_module.sf.SoundFile = CountedSoundFile
    shards_module.os.open = counted_open


def proc_io(pid: int) -> dict:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_pass(paths, offsets, sizes, order) -> dict:
    """Read the utterances' bytes only (no decoding), one thread, in the plan's order: the
    storage access pattern alone. ``offsets`` None: one file per utterance (open, read, close)."""
    before = proc_io(os.getpid())
    fds: dict = {}
    tic = time.perf_counter()
    total = 0
    for i in order:
        if offsets is None:
            with open(paths[i], "rb") as f:
                total += len(f.read())
        else:
            fd = fds.get(paths[i])
            if fd is None:
                fd = fds[paths[i]] = os.open(paths[i], os.O_RDONLY)
            total += len(os.pread(fd, int(sizes[i]), int(offsets[i])))
    seconds = time.perf_counter() - tic
    for fd in fds.values():
        os.close(fd)
    after = proc_io(os.getpid())
    return {"seconds": round(seconds, 2), "utterances": len(order), "utt_per_s": round(len(order) / seconds, 1),
            "mb_per_s": round(total / seconds / 1e6, 1), "file_opens": len(order) if offsets is None else len(fds),
            "storage_read_mb": round((after["read_bytes"] - before["read_bytes"]) / 1e6, 1)}


def load_pass(spec: str, workers: int, window: int, counter, limit: int = 0) -> dict:
    cfg = DataConfig(features="raw", max_duration=200.0, num_workers=workers, validate=False, pin_memory=False,
                     persistent_workers=True, shard_window=window, loader_timeout_s=0)
    tic = time.perf_counter()
    loader = build_dataloader(spec, cfg, None, train=True)
    setup = time.perf_counter() - tic
    counter.value = 0
    tic = time.perf_counter()
    it = iter(loader)
    first = None
    n = audio = 0
    for batch in it:
        first = first or time.perf_counter() - tic
        n += len(batch["ids"])
        audio += float(batch["audio_lens"].sum()) / SR
        if limit and n >= limit:
            break
    seconds = time.perf_counter() - tic
    pids = [w.pid for w in it._workers]  # persistent workers: still alive
    io = [proc_io(pid) for pid in pids]
    cpu = sum(cpu_seconds(pid) for pid in pids)
    del it
    return {"setup_s": round(setup, 3), "first_batch_s": round(first, 3), "seconds": round(seconds, 2),
            "utterances": n, "utt_per_s": round(n / seconds, 1), "audio_s_per_s": round(audio / seconds, 1),
            "worker_cpu_ms_per_utt": round(1000 * cpu / n, 3), "file_opens": int(counter.value),
            "read_syscalls": sum(x["syscr"] for x in io),
            "storage_read_mb": round(sum(x["read_bytes"] for x in io) / 1e6, 1), "batches_per_epoch": len(loader)}


# ---------------------------------------------------------------------- plan and resume


def plan_cost(root: str, n: int, per_shard: int = 1000) -> list[dict]:
    """Timings from indexes alone, at ``n`` utterances in shards of ``per_shard``."""
    folder = os.path.join(root, f"index_only_{n}")
    rng = np.random.default_rng(1)
    durations = np.clip(rng.lognormal(np.log(6), 0.6, n), 0.5, 30)
    if not os.path.isdir(folder):
        os.makedirs(folder)
        for s, start in enumerate(range(0, n, per_shard)):
            d = durations[start:start + per_shard]
            size = np.round(d * 32000).astype(np.int64) + 1024  # a member per utterance, as FLAC would be
            off = np.concatenate([[0], np.cumsum(size)[:-1]])
            path = os.path.join(folder, f"shard-{s:06d}.tar")
            with open(path, "wb") as f:
                f.truncate(int(size.sum()) + 10240)  # sparse: an index needs its tar, not the audio
            index = {"format": shards_module.INDEX_FORMAT, "version": shards_module.INDEX_VERSION,
                     "tar": os.path.basename(path), "tar_bytes": int(size.sum()) + 10240, "problems": [],
                     "keys": [f"u{start + i:07d}" for i in range(d.size)], "duration": d.round(4).tolist(),
                     "text_len": [60] * d.size, "offset": off.tolist(), "audio_ext": ["flac"] * d.size,
                     "audio_offset": (off + 512).tolist(), "audio_size": (size - 1024).tolist(),
                     "meta_ext": ["json"] * d.size, "meta_offset": (off + size - 512).tolist(),
                     "meta_size": [100] * d.size}
            with open(index_path(path), "w") as f:
                json.dump(index, f, separators=(",", ":"))
    rows = []
    tic = time.perf_counter()
    shards = load_shards(folder)
    rows.append({"what": "read indexes", "seconds": round(time.perf_counter() - tic, 3)})
    d, shard = shards.duration, shards.shard
    source = (shard % 10 == 0).astype(np.int64)  # a 10% source, for the weighted mix
    makers = {
        "DurationBucketSampler (global)": lambda **kw: DurationBucketSampler(d, **kw),
        "ShardWindowSampler (window 4)": lambda **kw: ShardWindowSampler(d, shards=shard, window_shards=4, **kw),
        "WeightedMixSampler (2 sources 0.5/0.5, window 4)": lambda **kw: WeightedMixSampler(
            d, source, [0.5, 0.5], ["small", "large"], shards=shard, window_shards=4, **kw),
    }
    for name, make in makers.items():
        for world in (1, 8):
            kw = dict(max_duration=200.0, num_buckets=30, world_size=world, rank=0, seed=0)
            tic = time.perf_counter()
            s = make(**kw)
            build = time.perf_counter() - tic
            s.set_epoch(1)
            tic = time.perf_counter()
            steps = len(s)
            plan = time.perf_counter() - tic
            state = dict(s.state_dict(), epoch=1, position=steps // 2)
            tic = time.perf_counter()
            r = make(**kw)
            r.load_state_dict(state)
            next(iter(r))
            resume = time.perf_counter() - tic
            pad = s.epoch_stats()["padding_fraction"]
            rows.append({"what": name, "world_size": world, "utterances": int(d.size), "build_s": round(build, 3),
                         "epoch_plan_s": round(plan, 3), "resume_s": round(resume, 3), "steps": steps,
                         "padding_fraction": round(pad, 5)})
            print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/bench_shards")
    p.add_argument("--utterances", type=int, default=100_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--pass-utterances", type=int, default=30_000,
                   help="utterances timed per pass (the start of an epoch); 0 = the whole epoch")
    p.add_argument("--plan-utterances", type=int, default=1_000_000)
    p.add_argument("--plan-only", action="store_true")
    p.add_argument("--loading-only", action="store_true")
    p.add_argument("--warm", action="store_true", help="also passes with the corpus in the page cache")
    p.add_argument("--out", default="bench/results/cpu_2026-12-01_shards.jsonl")
    a = p.parse_args()
    os.makedirs(a.root, exist_ok=True)
    machine = {"date": datetime.date.today().isoformat(), "host_cpus": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__, "soundfile": sf.__version__, "load_avg_start": os.getloadavg()[0]}
    out = open(a.out, "a")

    def emit(row):
        row = {"bench": "bench_shards", **machine, **row}
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()

    if not a.plan_only:
        torch.set_num_threads(1)
        tic = time.perf_counter()
        manifest = make_corpus(a.root, a.utterances)
        files = [os.path.join(a.root, json.loads(line)["audio_filepath"]) for line in open(manifest)]
        shard_dir = os.path.join(a.root, f"shards_{a.utterances}")
        if not os.path.isdir(shard_dir):
            write_shards(manifest, shard_dir + ".tmp", shard_size=1000)
            os.replace(shard_dir + ".tmp", shard_dir)
        tars = load_shards(shard_dir).paths
        print(f"corpus ready in {time.perf_counter() - tic:.0f} s: {len(files)} files, {len(tars)} shards", flush=True)
        # the storage pattern alone: bytes in plan order, one thread, cold
        entries = [json.loads(line) for line in open(manifest)]
        durs = np.array([e["duration"] for e in entries])
        st = load_shards(shard_dir)
        plan = lambda s: [i for b in s for i in b]  # noqa: E731
        reads = [("files", files, None, None, plan(DurationBucketSampler(durs, max_duration=200.0)), files),
                 ("shards, window 4", [st.paths[k] for k in st.shard], st.audio_offset, st.audio_size,
                  plan(ShardWindowSampler(st.duration, shards=st.shard, window_shards=4, max_duration=200.0)), tars),
                 ("shards, global plan", [st.paths[k] for k in st.shard], st.audio_offset, st.audio_size,
                  plan(ShardWindowSampler(st.duration, shards=st.shard, window_shards=0, max_duration=200.0)), tars)]
        for storage, where, offsets, sizes, order, paths in reads:
            evict(paths)
            emit({"kind": "read bytes", "storage": storage, "cache": "cold", "load_avg": round(os.getloadavg()[0], 2),
                  **read_pass(where, offsets, sizes, order[: a.pass_utterances or None])})
        counter = mp.Value("q", 0)
        count_opens(counter)
        setups = [("files", manifest, 0, files), ("shards, window 4", shard_dir, 4, tars),
                  ("shards, global plan", shard_dir, 0, tars)]
        for cache in ["cold"] + (["warm"] if a.warm else []):
            for workers in a.workers:
                for storage, spec, window, paths in setups:
                    evict(paths) if cache == "cold" else warm(paths)
                    row = load_pass(spec, workers, window, counter, a.pass_utterances)
                    emit({"kind": "loading", "storage": storage, "workers": workers, "cache": cache,
                          "load_avg": round(os.getloadavg()[0], 2), **row})
    if not a.loading_only:
        for row in plan_cost(a.root, a.plan_utterances):
            emit({"kind": "plan", **row})


if __name__ == "__main__":
    main()
