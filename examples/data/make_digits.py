#!/usr/bin/env python3
"""Make the connected-digit demo speech data set with espeak-ng.

TIDIGITS-style utterances ("three oh seven nine", 1-7 digits from the
eleven words zero/oh/one..nine) spoken by espeak-ng voices and voice
variants, with speaking rate and pitch varied per utterance.  Two disjoint
voice sets are made:

* ``base``   -- the voices a model is trained on (General American and
  Southern British English and their close relatives);
* ``accent`` -- unseen accents for the adaptation / fine-tuning demo: English
  dialect voices (Scottish, Caribbean, West Midlands) and foreign-accented
  English (German, French, Dutch, Polish and Hindi voices reading the English
  digit words respelled in their own orthography, so the result is
  intelligible English with that language's sounds, not a misreading of
  English spelling).

Each set gets train/dev/test NeMo-style JSONL manifests (one JSON object per
line: ``audio_filepath`` relative to the manifest's folder, ``duration`` in
seconds measured from the written file, ``text`` in lower-case words,
``speaker`` = voice+variant, ``id``) and 16 kHz mono audio under
``<set>/audio/<split>/``.

The output is a deterministic function of the arguments (the per-utterance
choices come from ``--seed``; espeak-ng, the resampler and the encoders are
deterministic), independent of ``--jobs``.

espeak-ng must be installed (Debian/Ubuntu: ``apt-get install espeak-ng``).
MBROLA voices are rejected (they are listed by espeak-ng but usually not
installed).

Examples::

    # the shipped set (see examples/data/README.md)
    python examples/data/make_digits.py
    # a 10x larger set as FLAC somewhere else
    python examples/data/make_digits.py --n 15000 --format flac --out /data/digits
    # only the base set, two voices, another seed
    python examples/data/make_digits.py --sets base --voices en-us,en --seed 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio

SAMPLE_RATE = 16000

# The eleven TIDIGITS words; "zero" and "oh" are both used for 0.
WORDS = ["zero", "oh", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

# Base voices: what the model is trained on.  en = Southern British (gmw/en),
# en-gb-x-rp is close to it; en-us-nyc is close to en-us.
BASE_VOICES = ["en-us", "en", "en-gb-x-rp", "en-us-nyc"]

# Accent voices: disjoint from the base voices, for the adaptation demo.
ACCENT_VOICES = [
    "en-gb-scotland",  # Scottish English: rhotic, trilled r, monophthong oh/eight, "tʉ" two
    "en-029",  # Caribbean English: "t" for "th" (three -> tree), different vowels
    "en-gb-x-gbcwmd",  # West Midlands: five -> "foiv", nine -> "noin", one -> "wun"
    "de",  # German-accented English (respelled below): "v" one, "z" six/seven
    "fr-fr",  # French-accented English: uvular r, final stress
    "nl",  # Dutch-accented English
    "pl",  # Polish-accented English
    "hi",  # Hindi-accented (Indian) English, respelled in Devanagari: retroflex t
]
# Further accent voices that work (respelled below), not in the default set:
# en-gb-x-gbclan (Lancaster; too close to the base voices to be a real shift),
# es, it, ru (strong shifts).  Use them with --accent-voices.
EXTRA_ACCENT_VOICES = ["en-gb-x-gbclan", "es", "it", "ru"]

# How a non-English voice is told to say each English digit word: the English
# pronunciation respelled in the voice's own orthography.  Check with
# `make_digits.py --show-ipa`.  English voices get the words as they are.
# (Never give espeak-ng numerals: "307" is read "three hundred and seven".)
RESPELL: dict[str, dict[str, str]] = {
    "de": dict(zero="sihro", oh="oh", one="wann", two="tuh", three="sri", four="fohr",
               five="feif", six="sicks", seven="säwen", eight="eht", nine="nein"),
    "fr-fr": dict(zero="ziro", oh="o", one="ouane", two="tou", three="sri", four="for",
                  five="faïve", six="sixe", seven="sévène", eight="eïte", nine="naïne"),
    "es": dict(zero="síro", oh="óu", one="uán", two="tú", three="tri", four="for",
               five="fáif", six="sics", seven="séven", eight="éit", nine="náin"),
    "it": dict(zero="ziro", oh="ou", one="uan", two="tù", three="tri", four="for",
               five="faiv", six="sics", seven="seven", eight="eit", nine="nain"),
    "hi": dict(zero="ज़ीरो", oh="ओ", one="वन", two="टू", three="थ्री", four="फ़ोर",
               five="फ़ाइव", six="सिक्स", seven="सेवन", eight="एट", nine="नाइन"),
    "ru": dict(zero="зи́роу", oh="о́у", one="ва́н", two="ту́", three="сри́", four="фо́р",
               five="фа́йв", six="си́кс", seven="се́вен", eight="э́йт", nine="на́йн"),
    "pl": dict(zero="ziro", oh="ou", one="łan", two="tu", three="sri", four="for",
               five="fajf", six="siks", seven="sewen", eight="ejt", nine="najn"),
    "nl": dict(zero="ziero", oh="oo", one="wan", two="toe", three="srie", four="foor",
               five="faaif", six="siks", seven="sevven", eight="eet", nine="naain"),
}

# espeak-ng voice variants (files under espeak-ng-data/voices/!v) used for both
# sets.  Chosen to be clean speech: variants with heavy echo, whisper, breath-only
# voicing, robot effects or the fast_test hack are left out.
VARIANTS = [
    # male
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8",
    "Alex", "Andy", "antonio", "david", "ed", "edward", "Gene", "iven", "Mike", "max",
    "paul", "pedro", "quincy", "rob", "robert", "travis", "Denis", "michel", "miguel",
    "klatt", "klatt2", "klatt3",
    # female
    "f1", "f2", "f3", "f4", "f5", "Andrea", "Annie", "aunty", "belinda", "linda",
    "steph", "anika",
]

SPLITS = ("train", "dev", "test")
SET_IDS = {"base": 0, "accent": 1}

# Default split sizes for --n (= base train size) 1500.
DEFAULT_N = 1500
DEFAULT_FRACTIONS = {
    ("base", "train"): 1.0,
    ("base", "dev"): 200 / 1500,
    ("base", "test"): 200 / 1500,
    ("accent", "train"): 300 / 1500,
    ("accent", "dev"): 100 / 1500,
    ("accent", "test"): 100 / 1500,
}

FORMATS = {  # --format -> (extension, soundfile format, subtype, compression_level)
    # Ogg Opus at ~16 kbit/s (libsndfile 1.2: compression_level 0.97; 0.99 and
    # above switch Opus to narrowband); ~8x smaller than FLAC, and the 80-bin
    # fbank features of speech frames stay within ~0.7 (natural log) of the
    # original on average.
    "ogg": ("ogg", "OGG", "OPUS", 0.97),
    "flac": ("flac", "FLAC", "PCM_16", None),
    "wav": ("wav", "WAV", "PCM_16", None),
}

# Speaking rate: above ~195 words/min some 7-digit strings have more characters
# (+ repeats) than character CTC can emit at 40 ms frames.
MIN_WPM, MAX_WPM = 120, 185
MIN_PITCH, MAX_PITCH = 35, 65  # espeak-ng -p (0-99, default 50)
MAX_GAP = 2  # espeak-ng -g: extra pause between words, in 10 ms units (at 175 wpm)
MIN_DIGITS, MAX_DIGITS = 1, 7
# Silence trimming: keep everything within TRIM_DB of the loudest 5 ms frame,
# plus a margin drawn uniformly from [MARGIN_MIN, MARGIN_MAX] seconds at each end;
# margins grow evenly where needed so that no utterance is shorter than MIN_DURATION.
TRIM_DB = -50.0
MARGIN_MIN, MARGIN_MAX = 0.05, 0.15
MIN_DURATION = 0.5
PEAK = 0.5  # peak-normalise to this (-6 dBFS: headroom for the lossy codec's overshoot)


@dataclass
class Utt:
    id: str
    set: str
    split: str
    voice: str
    variant: str
    wpm: int
    pitch: int
    gap: int
    margin_start: float
    margin_end: float
    words: list[str]
    path: str  # relative to the set's folder (where the manifests are)

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def speaker(self) -> str:
        return f"{self.voice}+{self.variant}"

    def spoken(self) -> str:
        table = RESPELL.get(self.voice)
        return " ".join(table[w] if table else w for w in self.words)


# ----------------------------------------------------------------------------
# espeak-ng voices


def espeak_bin() -> str:
    exe = shutil.which("espeak-ng")
    if not exe:
        sys.exit("espeak-ng not found (Debian/Ubuntu: apt-get install espeak-ng)")
    return exe


def installed_variants() -> set[str]:
    """Variant names from `espeak-ng --voices=variant` (File column, '!v/NAME')."""
    out = subprocess.run([espeak_bin(), "--voices=variant"], capture_output=True,
                         text=True, check=True).stdout
    names = set()
    for line in out.splitlines()[1:]:
        i = line.find("!v/")
        if i >= 0:
            # the file name may contain one space ("Mr serious"); columns are
            # separated by two or more spaces
            names.add(re.split(r"\s{2,}", line[i + 3:].strip())[0])
    return names


def installed_voices() -> dict[str, str]:
    """Language code and file name -> voice file, from `espeak-ng --voices`."""
    out = subprocess.run([espeak_bin(), "--voices"], capture_output=True, text=True,
                         check=True).stdout
    voices = {}
    for line in out.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 5:
            continue
        lang, vfile = parts[1], parts[4]  # VoiceName (4th column) has no spaces
        voices.setdefault(lang.lower(), vfile)
        voices.setdefault(vfile.split("/")[-1].lower(), vfile)
    return voices


def check_voices(voices: list[str], variants: list[str]) -> None:
    known = installed_voices()
    errors = []
    for v in voices:
        vfile = known.get(v.lower())
        if vfile is None:
            errors.append(f"voice {v!r} is not in `espeak-ng --voices`")
        elif vfile.startswith("mb/"):
            errors.append(f"voice {v!r} is an MBROLA voice ({vfile}); not supported")
        elif v.split("-")[0] != "en" and v not in RESPELL:
            errors.append(f"voice {v!r} is not English and has no RESPELL table "
                          "(it would misread English spelling)")
    ok_variants = installed_variants()
    for var in variants:
        # espeak-ng silently ignores an unknown +variant, so check the name
        if var not in ok_variants:
            errors.append(f"variant {var!r} is not in `espeak-ng --voices=variant` "
                          "(names are case-sensitive)")
    if errors:
        sys.exit("\n".join(errors))


# ----------------------------------------------------------------------------
# planning (deterministic, in the main process)


def plan(set_name: str, split: str, n: int, voices: list[str], variants: list[str],
         seed: int, ext: str) -> list[Utt]:
    rng = np.random.default_rng([seed, SET_IDS[set_name], SPLITS.index(split)])
    # every voice gets the same share of the split (+-1), in random order
    voice_of = rng.permutation(np.resize(np.arange(len(voices)), n))
    utts = []
    for i in range(n):
        k = int(rng.integers(MIN_DIGITS, MAX_DIGITS + 1))
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), size=k)]
        uid = f"{set_name}-{split}-{i:05d}"
        utts.append(Utt(
            id=uid, set=set_name, split=split,
            voice=voices[int(voice_of[i])],
            variant=variants[int(rng.integers(len(variants)))],
            wpm=int(rng.integers(MIN_WPM, MAX_WPM + 1)),
            pitch=int(rng.integers(MIN_PITCH, MAX_PITCH + 1)),
            gap=int(rng.integers(0, MAX_GAP + 1)),
            margin_start=round(float(rng.uniform(MARGIN_MIN, MARGIN_MAX)), 3),
            margin_end=round(float(rng.uniform(MARGIN_MIN, MARGIN_MAX)), 3),
            words=words,
            path=f"audio/{split}/{uid}.{ext}",
        ))
    return utts


# ----------------------------------------------------------------------------
# synthesis (worker processes)


def synthesize(utt: Utt, wpm: int, tmpdir: str) -> tuple[np.ndarray, int]:
    """espeak-ng -> float32 waveform at its native rate (22,050 Hz)."""
    wav = os.path.join(tmpdir, f"{utt.id}.wav")
    # -w writes a proper WAV header (--stdout's header carries a bogus size);
    # -b 1: the text is UTF-8 (Devanagari, Cyrillic respellings)
    cmd = [espeak_bin(), "-b", "1", "-v", f"{utt.voice}+{utt.variant}", "-s", str(wpm),
           "-p", str(utt.pitch), "-g", str(utt.gap), "-w", wav, utt.spoken()]
    subprocess.run(cmd, check=True, capture_output=True)
    x, sr = sf.read(wav, dtype="float32", always_2d=False)
    os.remove(wav)
    return x, sr


def trim(x: np.ndarray, sr: int, margin_start: float, margin_end: float) -> np.ndarray:
    hop = max(1, int(sr * 0.005))
    n = len(x) // hop
    rms = np.sqrt((x[: n * hop].reshape(n, hop).astype(np.float64) ** 2).mean(1) + 1e-20)
    db = 20 * np.log10(rms / rms.max())
    loud = np.nonzero(db > TRIM_DB)[0]
    speech = (loud[-1] + 1 - loud[0]) * hop / sr
    short = MIN_DURATION + 0.005 - (speech + margin_start + margin_end)
    if short > 0:
        margin_start += short / 2
        margin_end += short / 2
    start = max(0, loud[0] * hop - int(margin_start * sr))
    end = min(len(x), (loud[-1] + 1) * hop + int(margin_end * sr))
    y = x[start:end]
    # pad with zeros where espeak's own silence was shorter than the margin
    pad0 = int(margin_start * sr) - loud[0] * hop
    pad1 = (loud[-1] + 1) * hop + int(margin_end * sr) - len(x)
    return np.pad(y, (max(0, pad0), max(0, pad1)))


def ctc_frames(num_samples: int) -> int:
    """Output frames of the example model: 25 ms / 10 ms fbank, then 4x subsampling
    by two Conv2d(kernel 3, stride 2, no padding) -- 40 ms frames."""
    t = 1 + (num_samples - 400) // 160 if num_samples >= 400 else 0
    return max(0, ((t - 1) // 2 - 1) // 2)


def ctc_min_frames(text: str) -> int:
    """Frames character CTC needs: one per character, plus a blank between repeats."""
    return len(text) + sum(a == b for a, b in zip(text, text[1:]))


def _ogg_crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
        table.append(r & 0xFFFFFFFF)
    return table


_OGG_CRC = _ogg_crc_table()


def set_ogg_serial(path: str, serial: int) -> None:
    """Give every page of a one-stream Ogg file this stream serial number.

    libsndfile picks a random serial number for each Ogg stream, so without
    this the same audio would give different bytes on every run.
    """
    data = bytearray(Path(path).read_bytes())
    pos = 0
    while pos < len(data):
        if data[pos:pos + 4] != b"OggS":
            raise ValueError(f"{path}: not an Ogg page at byte {pos}")
        nseg = data[pos + 26]
        size = 27 + nseg + sum(data[pos + 27:pos + 27 + nseg])
        data[pos + 14:pos + 18] = serial.to_bytes(4, "little")
        data[pos + 22:pos + 26] = b"\0\0\0\0"
        crc = 0
        for b in data[pos:pos + size]:
            crc = ((crc << 8) & 0xFFFFFFFF) ^ _OGG_CRC[(crc >> 24) ^ b]
        data[pos + 22:pos + 26] = crc.to_bytes(4, "little")
        pos += size
    Path(path).write_bytes(bytes(data))


def make_one(job: tuple[Utt, str, str]) -> dict:
    utt, root, fmt = job
    ext, sf_format, subtype, level = FORMATS[fmt]
    tmpdir = tempfile.mkdtemp(prefix="digits-")
    try:
        wpm = utt.wpm
        while True:
            x, sr = synthesize(utt, wpm, tmpdir)
            y = trim(x, sr, utt.margin_start, utt.margin_end)
            y = torchaudio.functional.resample(torch.from_numpy(y), sr, SAMPLE_RATE).numpy()
            y = y * (PEAK / max(1e-6, float(np.abs(y).max())))
            # never seen at <= 185 wpm, but keep the CTC guarantee: slow down
            if ctc_frames(len(y)) >= ctc_min_frames(utt.text) + 2 or wpm <= 80:
                break
            wpm -= 15
        out = os.path.join(root, utt.set, utt.path)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        y = y.astype(np.float32)
        # Opus at ~16 kbit/s very rarely (about 1 in 2,000 here) decodes with a
        # click up to full scale; read the file back and, if its peak grew by
        # more than 30%, write it again at a higher bitrate.
        for lvl in ([level, 0.95, 0.9] if level is not None else [None]):
            sf.write(out, y, SAMPLE_RATE, format=sf_format, subtype=subtype,
                     compression_level=lvl)
            z, _ = sf.read(out, dtype="float32")
            if float(np.abs(z).max()) <= 1.3 * PEAK:
                break
        if sf_format == "OGG":
            set_ogg_serial(out, zlib.crc32(utt.id.encode()) & 0x7FFFFFFF)
        info = sf.info(out)  # duration measured from the written file
        return dict(id=utt.id, duration=round(info.frames / info.samplerate, 4), wpm=wpm)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


# ----------------------------------------------------------------------------


def show_ipa(voices: list[str]) -> None:
    for v in voices:
        spoken = " ".join(RESPELL[v][w] for w in WORDS) if v in RESPELL else " ".join(WORDS)
        ipa = subprocess.run([espeak_bin(), "-b", "1", "-q", "--ipa", "-v", v, spoken],
                             capture_output=True, text=True, check=True).stdout.strip()
        print(f"{v:16s} {ipa}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "digits"),
                    help="output folder (default: examples/data/digits next to this script)")
    ap.add_argument("--n", type=int, default=DEFAULT_N,
                    help="base train utterances; the other splits scale with it "
                         "(base dev/test n*2/15, accent train n/5, accent dev/test n/15)")
    for s, sp in DEFAULT_FRACTIONS:
        ap.add_argument(f"--{s}-{sp}", type=int, default=None, metavar="N",
                        help=f"{s} {sp} utterances (overrides --n)")
    ap.add_argument("--voices", default=",".join(BASE_VOICES),
                    help="comma-separated base voices (default: %(default)s)")
    ap.add_argument("--accent-voices", default=",".join(ACCENT_VOICES),
                    help="comma-separated accent voices (default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated espeak-ng variants, used for both sets")
    ap.add_argument("--sets", default="base,accent", help="which sets to make")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=sorted(FORMATS), default="ogg",
                    help="ogg = Ogg Opus ~16 kbit/s (default), flac, wav (16-bit PCM)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="worker processes (output does not depend on it)")
    ap.add_argument("--show-ipa", action="store_true",
                    help="print what each voice says for the eleven words, and exit")
    args = ap.parse_args()

    voice_sets = {"base": [v for v in args.voices.split(",") if v],
                  "accent": [v for v in args.accent_voices.split(",") if v]}
    variants = [v for v in args.variants.split(",") if v]
    sets = [s for s in args.sets.split(",") if s]
    for s in sets:
        if s not in voice_sets:
            sys.exit(f"unknown set {s!r} (base, accent)")
    overlap = set(voice_sets["base"]) & set(voice_sets["accent"])
    if overlap and len(sets) == 2:
        sys.exit(f"base and accent voices must be disjoint; both have {sorted(overlap)}")
    check_voices([v for s in sets for v in voice_sets[s]], variants)
    if args.show_ipa:
        show_ipa([v for s in sets for v in voice_sets[s]])
        return

    torch.set_num_threads(1)
    root = os.path.abspath(args.out)
    ext = FORMATS[args.format][0]
    jobs, plans = [], {}
    for s in sets:
        for sp in SPLITS:
            n = getattr(args, f"{s}_{sp}")
            if n is None:
                n = round(args.n * DEFAULT_FRACTIONS[(s, sp)])
            utts = plan(s, sp, n, voice_sets[s], variants, args.seed, ext)
            plans[(s, sp)] = utts
            # start from a clean split folder so no stale files survive
            shutil.rmtree(os.path.join(root, s, "audio", sp), ignore_errors=True)
            jobs += [(u, root, args.format) for u in utts]

    t0 = time.time()
    results = {}
    with get_context("spawn").Pool(args.jobs, initializer=torch.set_num_threads,
                                   initargs=(1,)) as pool:
        for i, r in enumerate(pool.imap_unordered(make_one, jobs, chunksize=8)):
            results[r["id"]] = r
            if (i + 1) % 500 == 0 or i + 1 == len(jobs):
                print(f"  {i + 1}/{len(jobs)} utterances, {time.time() - t0:.0f} s",
                      file=sys.stderr)

    for (s, sp), utts in plans.items():
        path = os.path.join(root, s, f"{sp}.jsonl")
        total = 0.0
        with open(path, "w", encoding="utf-8") as f:
            for u in utts:
                r = results[u.id]
                total += r["duration"]
                f.write(json.dumps(dict(audio_filepath=u.path, duration=r["duration"],
                                        text=u.text, speaker=u.speaker, id=u.id)) + "\n")
        slowed = sum(results[u.id]["wpm"] != u.wpm for u in utts)
        print(f"{path}: {len(utts)} utterances, {total / 60:.1f} min"
              + (f" ({slowed} slowed down to fit CTC)" if slowed else ""))
    with open(os.path.join(root, "generation.json"), "w") as f:
        json.dump(dict(command=" ".join(["python", "examples/data/make_digits.py"]
                                        + sys.argv[1:]),
                       seed=args.seed, format=args.format, voices=voice_sets,
                       variants=variants, sets=sets,
                       espeak_ng=subprocess.run([espeak_bin(), "--version"],
                                                capture_output=True, text=True).stdout.strip(),
                       libsndfile=sf.__libsndfile_version__,
                       wpm=[MIN_WPM, MAX_WPM], pitch=[MIN_PITCH, MAX_PITCH],
                       digits=[MIN_DIGITS, MAX_DIGITS], trim_db=TRIM_DB,
                       margin_s=[MARGIN_MIN, MARGIN_MAX],
                       min_duration_s=MIN_DURATION), f, indent=1)
        f.write("\n")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
