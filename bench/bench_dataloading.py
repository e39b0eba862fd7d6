"""Input-pipeline throughput: where does data loading stop keeping a GPU busy?

Why: a training step that waits for data wastes the GPU, and the fix (more workers, or moving
features to the GPU) depends on which stage costs what. This measures, on a synthetic corpus
with LibriSpeech-like durations written as 16 kHz FLAC (and a 44.1 kHz copy for resampling):

1. per-stage cost in one thread (what one DataLoader worker does per utterance): FLAC decode,
   44.1 -> 16 kHz resampling, speed perturbation, fbank (+ utterance normalisation), SpecAugment;
2. end-to-end DataLoader throughput (``build_dataloader``, DurationBucketSampler batches,
   collate, fbank in the workers, training mode) for 0, 1, 2... workers, in utterances/s and
   seconds of audio per second, and per worker;
3. the ``feature_device: gpu`` split: workers only decode (raw audio batches), and
   ``BatchFeatureExtractor`` computes fbank for the whole padded batch: timed here on the CPU
   and, when CUDA is available, on the GPU.

Read the result as: a model that trains on A seconds of audio per second of wall time needs
about A / (audio s/s per worker) workers on the worker path, or A / (decode-only audio s/s per
worker) workers plus a slice of GPU time on the GPU path.

Run::

    python bench/bench_dataloading.py                 # BENCHMARKS.md numbers (2-core CPU)
    python bench/bench_dataloading.py --utterances 400 --workers 0 1 2 4 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddptrain.data.config import DataConfig  # noqa: E402
from ddptrain.data.features import BatchFeatureExtractor, spec_augment  # noqa: E402
from ddptrain.data.synthetic import SyntheticCorpus, synth_waveform, write_synthetic_corpus  # noqa: E402

try:  # the file-based parts need soundfile; --batch-only runs without it (e.g. on a GPU box)
    import soundfile as sf

    from ddptrain.data import CharTokenizer, build_dataloader, load_audio, load_manifest
except ImportError:  # pragma: no cover
    sf = None


def best_of(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def stage_costs(entries, folder44) -> list[tuple[str, float]]:
    """Seconds of audio processed per second, one thread, per stage."""
    torch.set_num_threads(1)  # a DataLoader worker runs with one intra-op thread
    audio_s = sum(e.duration for e in entries)
    ext = BatchFeatureExtractor(DataConfig()).eval()
    waves = [load_audio(e.audio_filepath, 16000) for e in entries]
    paths44 = [os.path.join(folder44, os.path.basename(e.audio_filepath)) for e in entries]
    out = []
    out.append(("decode FLAC 16 kHz (soundfile)",
                best_of(lambda: [sf.read(e.audio_filepath, dtype="float32") for e in entries])))
    out.append(("decode FLAC 44.1 kHz + resample to 16 kHz",
                best_of(lambda: [load_audio(p, 16000) for p in paths44])))
    out.append(("speed perturbation 0.9 (resample)",
                best_of(lambda: [load_audio(e.audio_filepath, 16000, speed=0.9) for e in entries]) - out[0][1]))

    def fbank():
        with torch.no_grad():
            for w in waves:
                ext(w[None], torch.tensor([w.numel()]))

    out.append(("fbank 80 + utterance CMVN (B=1)", best_of(fbank)))
    feats = [ext(w[None], torch.tensor([w.numel()]))["features"] for w in waves]

    def specaug():
        for f in feats:
            spec_augment(f, torch.tensor([f.shape[1]]), 2, 27, 2, 0.05)

    out.append(("SpecAugment", best_of(specaug)))
    torch.set_num_threads(os.cpu_count() or 1)
    return [(name, audio_s / max(t, 1e-9)) for name, t in out]


def loader_throughput(manifest, cfg, tok, workers: int, epochs: int = 2) -> tuple[float, float]:
    """(utterances/s, audio s/s) over the last epoch (the first one warms workers up)."""
    loader = build_dataloader(manifest, replace(cfg, num_workers=workers), tok, train=True)
    sampler = loader.batch_sampler
    utts, secs, elapsed = 0, 0.0, 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        utts, secs = 0, 0.0
        for b in loader:
            utts += len(b["ids"])
            lens = b["feature_lens"] if "feature_lens" in b else b["audio_lens"]
            secs += float(lens.sum()) / (100.0 if "feature_lens" in b else cfg.sample_rate)
        elapsed = time.perf_counter() - t
    return utts / elapsed, secs / elapsed


def batch_fbank(waves: list, device: str, batch_seconds: float = 200.0) -> float:
    """Audio s/s of BatchFeatureExtractor on length-sorted padded batches of ~batch_seconds."""
    ext = BatchFeatureExtractor(DataConfig()).eval().to(device)
    waves = sorted(waves, key=lambda w: w.numel())
    batches = []
    i = 0
    while i < len(waves):
        j = i + 1
        while j < len(waves) and (j + 1 - i) * waves[j].numel() / 16000 <= batch_seconds:
            j += 1
        group = waves[i:j]
        lens = torch.tensor([w.numel() for w in group])
        x = torch.zeros(len(group), int(lens.max()))
        for row, w in zip(x, group):
            row[: w.numel()] = w
        batches.append((x.to(device), lens.to(device)))
        i = j
    audio_s = sum(w.numel() for w in waves) / 16000

    def run():
        with torch.no_grad():
            for x, lens in batches:
                ext(x, lens)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run()  # warm-up (cuFFT plans, allocator)
    return audio_s / best_of(run)


def synthetic_waves(durations) -> list:
    rng = np.random.default_rng(0)
    return [torch.from_numpy(synth_waveform(float(d), 16000, rng)[:, 0]) for d in durations]


def batch_table(waves) -> None:
    """BatchFeatureExtractor throughput per device and batch size (the feature_device: gpu path)."""
    print("| device | batch of ~50 s | ~200 s | ~800 s |")
    print("|---|---|---|---|")
    devices = [("CPU, 1 thread", "cpu", 1), (f"CPU, {os.cpu_count()} threads", "cpu", os.cpu_count() or 1)]
    if torch.cuda.is_available():
        devices.append((torch.cuda.get_device_name(), "cuda", os.cpu_count() or 1))
    for name, dev, threads in devices:
        torch.set_num_threads(threads)
        rates = [batch_fbank(waves, dev, s) for s in (50.0, 200.0, 800.0)]
        print(f"| {name} | " + " | ".join(f"{r:,.0f} audio s/s" for r in rates) + " |")
    torch.set_num_threads(os.cpu_count() or 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--utterances", type=int, default=96)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-only", action="store_true",
                   help="only the BatchFeatureExtractor table, on in-memory audio (no soundfile needed)")
    a = p.parse_args()
    d = SyntheticCorpus(utterances=a.utterances, median_s=12.0, sigma=0.5, min_s=1.0, max_s=35.0).lengths(a.seed)[0]
    if a.batch_only:
        print(f"{a.utterances} synthetic utterances, {d.sum() / 60:.1f} min; torch {torch.__version__}, "
              f"{os.cpu_count()} CPU cores\n")
        batch_table(synthetic_waves(d))
        return
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        manifest = write_synthetic_corpus(os.path.join(tmp, "c16"), d, 16000, "flac", a.seed)
        write_synthetic_corpus(os.path.join(tmp, "c44"), d[:24], 44100, "flac", a.seed)
        print(f"corpus: {a.utterances} utterances, {d.sum() / 60:.1f} min of 16 kHz FLAC "
              f"(written in {time.perf_counter() - t:.1f}s); torch {torch.__version__}, "
              f"{os.cpu_count()} CPU cores\n")
        entries = load_manifest(manifest)
        tok = CharTokenizer.build(entries)

        print("Per-stage cost, one thread (audio seconds processed per second):\n")
        print("| stage | audio s/s |")
        print("|---|---|")
        for name, rate in stage_costs(entries[:24], os.path.join(tmp, "c44", "audio")):
            print(f"| {name} | {rate:,.0f} |")

        cfg = DataConfig(max_duration=200.0, num_buckets=10, spec_augment=True, speed_perturb=[0.9, 1.0, 1.1],
                         pin_memory=False, persistent_workers=True, prefetch_factor=4)
        print("\nDataLoader end to end (training mode: speed perturbation 0.9/1.0/1.1, fbank 80, "
              "utterance CMVN, SpecAugment, max_duration 200 s):\n")
        print("| features | workers | utterances/s | audio s/s | audio s/s per worker |")
        print("|---|---|---|---|---|")
        for mode, c in [("fbank in workers", cfg), ("raw audio (gpu path)", replace(cfg, feature_device="gpu"))]:
            for w in a.workers:
                utt, sec = loader_throughput(manifest, c, tok, w)
                per = sec / max(w, 1)
                print(f"| {mode} | {w} | {utt:.1f} | {sec:,.0f} | {per:,.0f}{' (main process)' if w == 0 else ''} |")

        print("\nBatchFeatureExtractor on whole padded batches (the feature_device: gpu path):\n")
        batch_table([load_audio(e.audio_filepath, 16000) for e in entries])


if __name__ == "__main__":
    main()
