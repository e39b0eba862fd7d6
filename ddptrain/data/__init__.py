"""Speech data pipeline: manifests, audio, features, tokenizer, bucketed batching, validation.

The pieces a training script needs::

    from ddptrain.data import build_dataloader, load_or_build_tokenizer

    tok = load_or_build_tokenizer(cfg.data)
    train_loader = build_dataloader(cfg.data.train_manifest, cfg.data, tok, train=True)
    train_loader.batch_sampler.set_epoch(epoch)          # before each epoch
    train_loader.batch_sampler.epoch_stats()             # padding fraction etc., for logging
    train_loader.batch_sampler.state_dict()              # into the checkpoint, per rank

File map: ``manifest.py`` (JSONL), ``audio.py`` (soundfile + resampling), ``features.py``
(fbank/log-mel, normalisation, SpecAugment; also the GPU batch path), ``tokenizer.py``
(characters, blank = 0), ``sampler.py`` (DurationBucketSampler), ``dataset.py`` (index ->
example, bad-data policy), ``collate.py`` (padding, batch keys), ``loader.py``
(build_dataloader), ``validate.py`` (checks + ``python -m ddptrain.data.validate``),
``synthetic.py`` (a generated corpus for tests and benchmarks), ``config.py`` (DataConfig).
"""

from ddptrain.data.audio import AudioError, AudioInfo, audio_info, load_audio, resample
from ddptrain.data.collate import SpeechCollator, lengths_to_padding_mask
from ddptrain.data.config import DataConfig
from ddptrain.data.dataset import BadExample, SpeechDataset
from ddptrain.data.errors import DataError, Problem
from ddptrain.data.features import BatchFeatureExtractor, compute_global_stats, spec_augment
from ddptrain.data.loader import build_dataloader
from ddptrain.data.manifest import ManifestEntry, load_manifest, parse_manifest
from ddptrain.data.sampler import DurationBucketSampler
from ddptrain.data.synthetic import write_synthetic_corpus
from ddptrain.data.tokenizer import CharTokenizer, TokenizerError, load_or_build_tokenizer
from ddptrain.data.validate import ValidationReport, validate_manifest

__all__ = [
    "AudioError", "AudioInfo", "BadExample", "BatchFeatureExtractor", "CharTokenizer", "DataConfig",
    "DataError", "DurationBucketSampler", "ManifestEntry", "Problem", "SpeechCollator", "SpeechDataset",
    "TokenizerError", "ValidationReport", "audio_info", "build_dataloader", "compute_global_stats",
    "lengths_to_padding_mask", "load_audio", "load_manifest", "load_or_build_tokenizer", "parse_manifest",
    "resample", "spec_augment", "validate_manifest", "write_synthetic_corpus",
]
