#!/usr/bin/env python3
"""Make the one-voice dialect corpora of the TTS recipe with espeak-ng.

Each dialect is one synthetic speaker with a regional accent (an espeak-ng voice and a
voice-quality variant, see :data:`DIALECTS`) reading short English sentences made from a fixed
word list, with the dialect's own words swapped in (its lexical substitutions). A TTS model
fine-tuned on one (examples/finetune_tts.py) adapts to one voice, accent and vocabulary; one LoRA
adapter per dialect on one base is the workflow of docs/dialects.md.

* ``lancashire``: espeak-ng's Lancashire (Lancaster) English voice ``en-gb-x-gbclan``, variant
  ``Alicia``; the word list as it is (neither voice nor variant is among the digits corpus's).
* ``scots``: ``en-gb-scotland``, variant ``Hugo`` (not among the digits corpus's variants), with
  Scots words: "the wee dug keeked at the kirk bell", "oor neebor blethered aboot the drookit
  fields afore dawn".

Every sentence is "<subject> <verb> <object>[ <time>]." from the lists below (after the
dialect's substitutions), so the texts share a small vocabulary (a few minutes of audio cover
it) yet every utterance is a new sentence. Speaking rate and pitch are fixed: one speaker, one
style. Audio: espeak-ng's 22,050 Hz output, silence-trimmed as in make_digits.py, resampled to
24 kHz (the corpus is resampled again to the VAE's rate when latents are prepared: 44.1 kHz for
VoxCPM-1.5, 16 kHz for VoxCPM2), peak 0.5, Ogg Opus.

The output is a deterministic function of the arguments (``--seed`` picks the sentences and
margins; espeak-ng, the resampler and the encoder are deterministic).

    python examples/data/dialect/make_dialect.py lancashire     # the shipped corpora (160/16/16)
    python examples/data/dialect/make_dialect.py scots --train 120
    python examples/data/dialect/make_dialect.py scots --train 2000 --out /data/scots
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

# name -> voice, variant, speaking rate (words/min), pitch, utterance-id prefix, and the dialect's
# words for entries of the lists above (what is spoken and written in the manifest)
DIALECTS = {
    # "dialect": the ids of the first corpus, kept so that its files stay byte for byte (the Ogg
    # serial number is set from the id)
    "lancashire": {"voice": "en-gb-x-gbclan", "variant": "Alicia", "wpm": 150, "pitch": 50, "ids": "dialect",
                   "words": {}},
    "scots": {"voice": "en-gb-scotland", "variant": "Hugo", "wpm": 145, "pitch": 45, "ids": "scots", "words": {
        "the old miller": "the auld miller", "my sister": "ma sister", "a young farmer": "a young fermer",
        "the weaver": "the wabster", "our neighbour": "oor neebor", "his brother": "his brither",
        "the little dog": "the wee dug", "the schoolteacher": "the dominie", "a tired sailor": "a wabbit sailor",
        "the baker": "the baxter", "walked to": "walked tae", "looked at": "keeked at",
        "talked about": "blethered aboot", "found": "fund", "remembered": "minded", "sold": "selt",
        "waited by": "bided by", "dreamed of": "dreamt o", "the red barn": "the reid byre",
        "a wooden boat": "a widden boat", "the market square": "the mercat square",
        "some fresh bread": "some fresh breid", "the river bank": "the burn side", "the church bell": "the kirk bell",
        "the wet fields": "the drookit fields", "a bag of apples": "a poke o apples",
        "the stone bridge": "the stane brig", "the coal cart": "the coal cairt", "this morning": "this mornin",
        "after supper": "efter supper", "in the rain": "in the smirr", "before dawn": "afore dawn",
        "at half past nine": "at hauf nine", "every saturday": "ilka saturday"}},
}


def sentence(rng: np.random.Generator, words: dict) -> str:
    parts = [SUBJECTS[rng.integers(len(SUBJECTS))], VERBS[rng.integers(len(VERBS))],
             OBJECTS[rng.integers(len(OBJECTS))], TIMES[rng.integers(len(TIMES))]]
    return " ".join(words.get(p, p) for p in parts if p) + "."


def make_one(dialect: dict, text: str, utt_id: str, out: str, margins: tuple[float, float]) -> float:
    """Synthesise ``text`` in ``dialect``'s voice to ``out`` (Ogg Opus); returns the written file's duration."""
    import subprocess

    tmp = tempfile.mkdtemp(prefix="dialect-")
    try:
        wav = os.path.join(tmp, "x.wav")
        subprocess.run([espeak_bin(), "-v", f"{dialect['voice']}+{dialect['variant']}", "-s", str(dialect["wpm"]),
                        "-p", str(dialect["pitch"]), "-w", wav, text], check=True, capture_output=True)
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
    ap.add_argument("dialect", choices=sorted(DIALECTS), help="which dialect (voice, variant, words: DIALECTS)")
    ap.add_argument("--out", default=None, help="output folder (default: the dialect's folder next to this script)")
    ap.add_argument("--train", type=int, default=160)
    ap.add_argument("--dev", type=int, default=16)
    ap.add_argument("--test", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    d = DIALECTS[args.dialect]
    out = Path(args.out or HERE / args.dialect)
    if d["variant"] not in installed_variants():
        sys.exit(f"espeak-ng has no voice variant {d['variant']!r} (espeak-ng --voices=variant)")
    seen: set[str] = set()
    for split_no, (split, n) in enumerate((("train", args.train), ("dev", args.dev), ("test", args.test))):
        rng = np.random.default_rng([args.seed, split_no])
        folder = out / "audio" / split
        shutil.rmtree(folder, ignore_errors=True)
        rows = []
        while len(rows) < n:
            text = sentence(rng, d["words"])
            margins = tuple(float(m) for m in rng.uniform(MARGIN_MIN, MARGIN_MAX, 2))
            if text in seen:  # no sentence in two splits (or twice in one)
                continue
            seen.add(text)
            utt_id = f"{d['ids']}-{split}-{len(rows):04d}"
            rel = f"audio/{split}/{utt_id}.ogg"
            duration = make_one(d, text, utt_id, str(out / rel), margins)
            rows.append({"audio_filepath": rel, "duration": duration, "text": text,
                         "speaker": f"{d['voice']}+{d['variant']}", "id": utt_id})
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{split}: {n} utterances, {sum(r['duration'] for r in rows) / 60:.1f} min")


if __name__ == "__main__":
    main()
