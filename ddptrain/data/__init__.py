"""Speech data pipeline: manifests, audio, features, tokenizer, bucketed batching, validation.

The pieces a training script needs (a recipe with its own dataset and collator builds its loader
with ``DurationBucketSampler.from_config`` and ``make_loader``, never a DataLoader of its own)::

    from ddptrain.data import build_dataloader, load_or_build_tokenizer

    tok = load_or_build_tokenizer(cfg.data)
    train_loader = build_dataloader(cfg.data.train_manifest, cfg.data, tok, train=True)
    train_loader.batch_sampler.set_epoch(epoch)          # before each epoch
    train_loader.batch_sampler.epoch_stats()             # padding fraction etc., for logging
    train_loader.batch_sampler.state_dict()              # into the checkpoint, per rank

File map: ``manifest.py`` (JSONL; the one mapping of key spellings, ``data.fields``),
``durations.py`` (a missing ``duration`` from the audio header, cached), ``audio.py`` (soundfile +
resampling), ``features.py`` (fbank/log-mel, normalisation, SpecAugment; also the GPU batch path), ``tokenizer.py``
(characters, blank = 0), ``sampler.py`` (DurationBucketSampler; ``from_config``: the one
translation of the config to batching), ``dataset.py`` (index -> example, bad-data policy),
``collate.py`` (padding, batch keys), ``loader.py`` (build_dataloader; ``make_loader``: the one
DataLoader of a config, for recipes with their own dataset and collator), ``validate.py`` (checks + ``python -m ddptrain.data.validate``),
``synthetic.py`` (the synthetic corpus for tests and benchmarks, in memory or on disk), ``config.py`` (DataConfig);
``shards.py`` (tar shards + index: ``python -m ddptrain.data.shards`` writes them; ShardDataset),
``shard_sampler.py`` (ShardWindowSampler: batches planned within windows of shards), ``mix.py``
(named sources mixed by weight: WeightedMixSampler, MixedDataset; ``source_sampler`` for a recipe's own dataset).
"""

# Exports are imported on first use (PEP 562), not here: ``python -m ddptrain.data.validate``
# and ``python -m ddptrain.data.features`` would otherwise find their module already imported
# by this package and run it twice (runpy's RuntimeWarning), and ``import ddptrain`` stays cheap.
_EXPORTS = {
    "AudioError": "audio", "AudioInfo": "audio", "audio_info": "audio", "load_audio": "audio", "resample": "audio",
    "SpeechCollator": "collate", "lengths_to_padding_mask": "collate",
    "DataConfig": "config",
    "BadExample": "dataset", "SpeechDataset": "dataset",
    "DataError": "errors", "Problem": "errors",
    "BatchFeatureExtractor": "features", "compute_global_stats": "features", "spec_augment": "features",
    "build_dataloader": "loader", "make_loader": "loader",
    "ManifestEntry": "manifest", "load_manifest": "manifest", "parse_manifest": "manifest",
    "DurationBucketSampler": "sampler",
    "ShardDataset": "shards", "ShardSet": "shards", "load_shards": "shards", "write_shards": "shards",
    "ShardWindowSampler": "shard_sampler",
    "MixedDataset": "mix", "WeightedMixSampler": "mix", "source_sampler": "mix",
    "SyntheticCorpus": "synthetic", "SyntheticSpeech": "synthetic", "write_synthetic_corpus": "synthetic",
    "CharTokenizer": "tokenizer", "TokenizerError": "tokenizer", "load_or_build_tokenizer": "tokenizer",
    "ValidationReport": "validate", "validate_manifest": "validate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(f"ddptrain.data.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddptrain.data' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
