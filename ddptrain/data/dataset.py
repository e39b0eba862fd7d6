"""SpeechDataset: index -> one example (audio or features, tokens), with the bad-data policy.

Runs inside DataLoader workers. Two things it exists to guarantee:

* Bad data never becomes a silent zero tensor. A failure to load an utterance is a
  :class:`DataError` naming the manifest line, the utterance id and the file (the DataLoader
  re-raises it in the training process, with its type). Under ``bad_data: skip`` the example
  becomes a :class:`BadExample`, which the collator drops and lists in ``batch["skipped_ids"]``
  so the Trainer can count and log them. If most of what a worker loads fails, skipping is not
  a policy any more but a broken set-up, and that is an error too.
* Memory stays flat with many workers. Manifest entries are stored as a few numpy arrays
  rather than a list of Python objects: forked workers touching Python objects bump their
  reference counts, which copies the pages, so a list of a million entries slowly becomes
  ``num_workers`` lists of a million entries (pytorch/pytorch#13246).

And one thing for exact resume: augmentation (speed perturbation, SpecAugment on worker-side
features) is a pure function of ``(data.seed, epoch, index)``, drawn from a generator seeded
from those three, never from a worker's own RNG. A worker's RNG depends on which worker loads an
utterance and how much it has loaded before, which a resumed run (fresh workers, another
position), another ``num_workers`` and persistent workers (one stream across epochs) all
change; the epoch is the one piece of training state this needs, and :meth:`SpeechDataset.set_epoch`
puts it into shared memory, where persistent workers see it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.config import check_section
from ddptrain.data.audio import load_audio
from ddptrain.data.config import DataConfig
from ddptrain.data.errors import DataError, Problem
from ddptrain.data.features import BatchFeatureExtractor
from ddptrain.data.manifest import ManifestEntry

log = logging.getLogger(__name__)

# Under bad_data=skip, a worker that has seen at least this many failures, making up at least
# this share of what it loaded, raises instead of skipping: that is a broken path or codec,
# not a few bad files, and training on the rest would quietly train on the wrong data.
SKIP_LIMIT_COUNT = 20
SKIP_LIMIT_FRACTION = 0.5


@dataclass(frozen=True)
class BadExample:
    """Stand-in for an utterance that failed to load under ``bad_data: skip``."""

    id: str
    reason: str


class PackedStrings:
    """An immutable list of strings stored as one UTF-8 byte array plus offsets."""

    def __init__(self, items: Sequence[str]):
        encoded = [s.encode("utf-8") for s in items]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=self._offsets[1:])
        self._data = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self._data[self._offsets[i] : self._offsets[i + 1]].tobytes().decode("utf-8")


class SpeechDataset(Dataset):
    """Map-style dataset over manifest entries.

    Args:
        entries: the utterances (already validated, usually).
        cfg: data config: audio, features, augmentation and ``bad_data`` policy.
        tokenizer: ``CharTokenizer`` (or anything with ``encode``); ``None`` = no tokens.
        train: apply speed perturbation and SpecAugment (training only), seeded from
            ``cfg.seed``, the epoch (:meth:`set_epoch`) and the index.

    ``dataset[i]`` is a dict with ``id``, ``text``, ``tokens`` (int64 tensor, if a tokenizer is
    set), ``dataset_id`` and ``ref_audio`` (upstream VoxCPM's keys, passed through: only when some
    line has them, ``None`` on the others) and either ``features`` (T, F) float32 (``feature_device: worker``) or ``audio`` (S,)
    float32 at ``cfg.sample_rate`` (``features: raw`` or ``feature_device: gpu``); or a
    :class:`BadExample` under ``bad_data: skip``.
    """

    # the pass-through keys, None when no entry has them (ShardDataset: never)
    ref_audios: Optional[PackedStrings] = None
    dataset_id_values: Optional[list] = None  # the distinct dataset_id values (a few), indexed by dataset_id_index
    dataset_id_index: Optional[np.ndarray] = None

    def __init__(self, entries: Sequence[ManifestEntry], cfg: DataConfig, tokenizer=None, train: bool = False):
        self.ids = PackedStrings([e.id for e in entries])
        self.paths = PackedStrings([e.audio_filepath for e in entries])
        self.texts = PackedStrings([e.text for e in entries])
        self.sources = PackedStrings([e.source for e in entries])
        self.lines = np.array([e.line for e in entries], dtype=np.int64)
        self.durations = np.array([e.duration for e in entries], dtype=np.float64)
        self.offsets = np.array([e.offset for e in entries], dtype=np.float64)
        self.is_segment = np.array([e.is_segment for e in entries], dtype=bool)
        if any(e.ref_audio for e in entries):
            self.ref_audios = PackedStrings([e.ref_audio or "" for e in entries])
        if any(e.dataset_id is not None for e in entries):
            # a table of the few distinct values plus an index array: not one Python object per entry
            self.dataset_id_values = list(dict.fromkeys(e.dataset_id for e in entries))
            where = {v: k for k, v in enumerate(self.dataset_id_values)}
            self.dataset_id_index = np.array([where[e.dataset_id] for e in entries], dtype=np.int32)
        self._setup(cfg, tokenizer, train)

    def _setup(self, cfg: DataConfig, tokenizer, train: bool) -> None:
        """What does not depend on where the audio is stored (``ShardDataset`` shares it)."""
        cfg = check_section(cfg, "data")  # a DataConfig built in Python gets load_config's checks
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.train = train
        self.speeds = [float(s) for s in cfg.speed_perturb] if train else []
        self.extractor: Optional[BatchFeatureExtractor] = None
        if cfg.features != "raw" and cfg.feature_device == "worker":
            self.extractor = BatchFeatureExtractor(cfg).train(train)
        self._loaded = 0
        self._failed = 0
        self.seed = int(cfg.seed)
        # shared memory: DataLoader workers, forked or spawned, persistent or not, read the
        # value the training process writes
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.ids)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose augmentation ``dataset[i]`` draws; call it before each epoch
        (the Trainer does, next to the sampler's ``set_epoch``).

        Raises:
            ValueError: a negative epoch.
        """
        if int(epoch) != epoch or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._epoch.fill_(int(epoch))

    def _augmentation_rng(self, i: int) -> torch.Generator:
        # SeedSequence mixes the three numbers, so neighbouring indices or epochs get unrelated streams
        seed = np.random.SeedSequence([self.seed, int(self._epoch), i]).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(seed))

    def __getitem__(self, i: int):
        try:
            example = self._load(int(i))
        except Exception as e:  # noqa: BLE001 - every failure is named, then raised or counted
            reason = str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e}"
            problem = Problem(self.sources[i], int(self.lines[i]), self.ids[i], reason)
            msg = str(problem)
            if self.cfg.bad_data == "error":
                raise DataError(msg + "  [data.bad_data=skip skips such utterances]", [problem]) from e
            self._loaded += 1
            self._failed += 1
            if self._failed >= SKIP_LIMIT_COUNT and self._failed >= SKIP_LIMIT_FRACTION * self._loaded:
                raise DataError(f"{self._failed} of {self._loaded} utterances failed to load in this worker; "
                                f"this is not a few bad files but a broken set-up. Last: {msg}") from e
            log.warning("skipping bad utterance: %s", msg)
            return BadExample(self.ids[i], msg)
        self._loaded += 1
        return example

    def _load(self, i: int) -> dict:
        rng = self._augmentation_rng(i) if self.train else None
        speed = self.speeds[int(torch.randint(len(self.speeds), (), generator=rng))] if self.speeds else 1.0
        wave, text, uid = self._read(i, speed)
        out = {"id": uid, "text": text}
        if self.dataset_id_index is not None:
            out["dataset_id"] = self.dataset_id_values[int(self.dataset_id_index[i])]
        if self.ref_audios is not None:
            out["ref_audio"] = self.ref_audios[i] or None
        if self.tokenizer is not None:
            out["tokens"] = torch.tensor(self.tokenizer.encode(text), dtype=torch.int64)
        if self.extractor is None:
            out["audio"] = wave
            return out
        with torch.no_grad():
            f = self.extractor(wave[None], torch.tensor([wave.numel()]), generator=rng)
        n = int(f["feature_lens"][0])
        if n == 0:
            raise DataError(f"{self.paths[i]}: audio of {wave.numel()} samples is shorter than one feature frame")
        # Whisper's padded frames are model input (the silence it was trained on): keep the window
        out["features"] = f["features"][0] if self.extractor.kind == "whisper_logmel" else f["features"][0, :n]
        return out

    def _read(self, i: int, speed: float) -> tuple[torch.Tensor, str, str]:
        """Utterance ``i``'s waveform (at ``cfg.sample_rate``, sped up by ``speed``), transcript and
        id: the one place that knows where an utterance is stored (``ShardDataset`` overrides it)."""
        text = self.texts[i]
        if not text.strip():
            raise DataError("empty text")
        seg = bool(self.is_segment[i])
        wave = load_audio(self.paths[i], self.cfg.sample_rate, float(self.offsets[i]),
                          float(self.durations[i]) if seg else None, speed)
        if not seg:
            self._check_duration(i, wave, speed, self.paths[i])
        return wave, text, self.ids[i]

    def _check_duration(self, i: int, wave: torch.Tensor, speed: float, where: str) -> None:
        # the sampler's budget trusts the manifest duration: a file much longer than its line
        # says would silently blow the batch budget (and the GPU memory) later
        cfg = self.cfg
        seconds = wave.numel() * speed / cfg.sample_rate
        if abs(seconds - self.durations[i]) > cfg.duration_tolerance + 1.0 / cfg.sample_rate:
            raise DataError(f"duration mismatch: the manifest says {self.durations[i]:.3f}s, "
                            f"{where} has {seconds:.3f}s")
