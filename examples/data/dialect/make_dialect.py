#!/usr/bin/env python3
"""Make the one-voice "dialect" corpus of the TTS recipe with espeak-ng.

One synthetic speaker with a regional accent that the ASR demo's digits corpus never uses:
espeak-ng's Lancashire (Lancaster) English voice ``en-gb-x-gbclan`` with the voice-quality
variant ``Alicia`` (neither is among the digits corpus's voices or variants, see
examples/data/README.md), reading short English sentences made from a fixed word list. A TTS
model fine-tuned on it (examples/finetune_tts.py) adapts to one voice and accent.

Every sentence is "<subject> <verb> <object>[ <time>]." from the lists below, so the texts share
a small vocabulary (a few minutes of audio cover it) yet every utterance is a new sentence.
Speaking rate and pitch are fixed: one speaker, one style. Audio: espeak-ng's 22,050 Hz output,
silence-trimmed as in make_digits.py, resampled to 24 kHz (the corpus is resampled again to the
VAE's rate when latents are prepared: 44.1 kHz for VoxCPM-1.5), peak 0.5, Ogg Opus.

The output is a deterministic function of the arguments (``--seed`` picks the sentences and
margins; espeak-ng, the resampler and the encoder are deterministic).

    python examples/data/dialect/make_dialect.py            # the shipped corpus (160/16/16)
    python examples/data/dialect/make_dialect.py --train 2000 --out /data/dialect
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from make_digits import espeak_bin, installed_variants, set_ogg_serial, trim  # noqa: E402

VOICE, VARIANT = "en-gb-x-gbclan", "Alicia"
WPM, PITCH = 150, 50
SAMPLE_RATE = 24000  # an Opus rate (8/12/16/24/48 kHz) above espeak-ng's 22,050 Hz
PEAK = 0.5
MARGIN_MIN, MARGIN_MAX = 0.05, 0.15

SUBJECTS = ["the old miller", "my sister", "a young farmer", "the weaver", "our neighbour", "the boatman",
            "his brother", "the little dog", "the schoolteacher", "a tired sailor", "the baker", "her cousin"]
VERBS = ["walked to", "looked at", "talked about", "painted", "carried", "found", "remembered", "sold",
         "mended", "waited by", "dreamed of", "cleaned"]
OBJECTS = ["the red barn", "a wooden boat", "the market square", "some fresh bread", "the river bank",
           "a broken wheel", "the church bell", "the wet fields", "a bag of apples", "the stone bridge",
           "the coal cart", "a warm blanket"]
TIMES = ["", "", "this morning", "after supper", "in the rain", "on sunday", "before dawn", "last winter",
         "at half past nine", "every saturday"]


def sentence(rng: np.random.Generator) -> str:
    parts = [SUBJECTS[rng.integers(len(SUBJECTS))], VERBS[rng.integers(len(VERBS))],
             OBJECTS[rng.integers(len(OBJECTS))], TIMES[rng.integers(len(TIMES))]]
    return " ".join(p for p in parts if p) + "."


def make_one(text: str, utt_id: str, out: str, margins: tuple[float, float]) -> float:
    """Synthesise ``text`` to ``out`` (Ogg Opus); returns the written file's duration."""
    tmp = tempfile.mkdtemp(prefix="dialect-")
    try:
        wav = os.path.join(tmp, "x.wav")
        import subprocess

        subprocess.run([espeak_bin(), "-v", f"{VOICE}+{VARIANT}", "-s", str(WPM), "-p", str(PITCH), "-w", wav, text],
                       check=True, capture_output=True)
        x, sr = sf.read(wav, dtype="float32")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    y = trim(x, sr, *margins)
    y = torchaudio.functional.resample(torch.from_numpy(y), sr, SAMPLE_RATE).numpy()
    y = (y * (PEAK / max(1e-6, float(np.abs(y).max())))).astype(np.float32)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    sf.write(out, y, SAMPLE_RATE, format="OGG", subtype="OPUS", compression_level=0.97)
    set_ogg_serial(out, zlib.crc32(utt_id.encode()) & 0x7FFFFFFF)  # libsndfile would pick a random one
    info = sf.info(out)
    return round(info.frames / info.samplerate, 4)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE), help="output folder (default: next to this script)")
    ap.add_argument("--train", type=int, default=160)
    ap.add_argument("--dev", type=int, default=16)
    ap.add_argument("--test", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if VARIANT not in installed_variants():
        sys.exit(f"espeak-ng has no voice variant {VARIANT!r} (espeak-ng --voices=variant)")
    seen: set[str] = set()
    for split_no, (split, n) in enumerate((("train", args.train), ("dev", args.dev), ("test", args.test))):
        rng = np.random.default_rng([args.seed, split_no])
        folder = Path(args.out) / "audio" / split
        shutil.rmtree(folder, ignore_errors=True)
        rows = []
        while len(rows) < n:
            text = sentence(rng)
            margins = tuple(float(m) for m in rng.uniform(MARGIN_MIN, MARGIN_MAX, 2))
            if text in seen:  # no sentence in two splits (or twice in one)
                continue
            seen.add(text)
            utt_id = f"dialect-{split}-{len(rows):04d}"
            rel = f"audio/{split}/{utt_id}.ogg"
            duration = make_one(text, utt_id, str(Path(args.out) / rel), margins)
            rows.append({"audio_filepath": rel, "duration": duration, "text": text,
                         "speaker": f"{VOICE}+{VARIANT}", "id": utt_id})
        with open(Path(args.out) / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{split}: {n} utterances, {sum(r['duration'] for r in rows) / 60:.1f} min")


if __name__ == "__main__":
    main()
