"""Configuration of the speech data pipeline (the ``data:`` section of a ddptrain config).

This dataclass is the single place where data behaviour is switched. Every field has its
default next to a comment that says what it does; ``ddptrain.data`` reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    # --- manifests (JSONL: audio_filepath|audio|audio_path, text|transcript|sentence [, duration, offset, id, ...]: manifest.py)
    train_manifest: str = ""  # training manifest path (several: comma-separated); or shards: a .tar, a folder or glob of them
    eval_manifest: str = ""  # evaluation manifest path ("" = no evaluation data)
    fields: dict[str, str] = field(default_factory=dict)  # manifest keys of other names, {field: key}, e.g. {audio: wav, text: normalized}; fields: audio, text, duration, offset, id, speaker, lang, dataset_id, ref_audio
    # --- named sources and shards (mix.py, shards.py)
    train_sources: dict[str, str] = field(default_factory=dict)  # instead of train_manifest: {name: manifest or shards}, mixed by train_weights
    train_weights: dict[str, float] = field(default_factory=dict)  # {name: weight}: each source's share of every epoch's utterances; {} = by size
    source_caps: dict[str, dict[str, float]] = field(default_factory=dict)  # {name: {epochs: x} or {hours: x}}: a source stops being drawn once the run has drawn x times its utterances (epochs; 1.0 = each once) or x hours of its audio; later epochs are shorter, and when every drawn source is capped the run ends (mix.py)
    mix_temperature: float = 1.0  # share of source s = b_s^(1/T) / sum_r b_r^(1/T), b = its train_weights entry (or, without train_weights, its utterances): 1 = as given, > 1 flattens toward uniform (.inf = uniform over sources with b > 0), < 1 sharpens (mix.py)
    eval_sources: dict[str, str] = field(default_factory=dict)  # instead of eval_manifest: {name: manifest or shards}; batches carry each utterance's source name
    shard_window: int = 4  # plan batches within windows of this many shards (locality); 0 = over all shards at once
    tokenizer: str = ""  # tokenizer file; "" = build a character tokenizer from train_manifest
    unk_token: str = ""  # map unknown characters to this token; "" = unknown chars are an error
    # --- audio and features
    sample_rate: int = 16000  # everything is resampled to this rate
    features: str = "fbank"  # fbank: Kaldi-compatible; logmel; whisper_logmel: as Whisper's own (30 s windows); raw: the waveform
    num_mel_bins: int = 80  # mel bins for fbank / logmel
    frame_length_ms: float = 25.0  # analysis window for fbank / logmel
    frame_shift_ms: float = 10.0  # hop between frames (10 ms = 100 frames/s)
    normalize: str = "utterance"  # mean/variance normalisation per utterance, global (global_stats) or none
    global_stats: str = ""  # JSON with "mean"/"std" lists, for normalize=global (see features.py)
    feature_device: str = "worker"  # worker: on the CPU, in DataLoader workers; gpu: the whole padded batch
    # --- augmentation (training only)
    speed_perturb: list[float] = field(default_factory=list)  # e.g. [0.9, 1.0, 1.1]; [] = off
    spec_augment: bool = False  # SpecAugment time and frequency masks
    freq_masks: int = 2  # number of frequency masks
    freq_mask_width: int = 27  # max width of each frequency mask (bins)
    time_masks: int = 2  # number of time masks
    time_mask_ratio: float = 0.05  # max width of each time mask, as a fraction of the utterance
    # --- batching (DurationBucketSampler)
    max_duration: float = 200.0  # seconds of *padded* audio per batch (per rank): B * longest <= this
    max_batch_size: int = 0  # cap on utterances per batch; 0 = no cap
    quadratic_duration: float = 0.0  # >0: cost = d + d^2/q, so long utterances get smaller batches
    num_buckets: int = 30  # duration buckets (equal total duration per bucket)
    bucket_sort_pool: int = 8  # sort shuffled utterances in pools of this many batches (less padding); 0 = off
    sync_buckets: bool = True  # the ranks' batches of one step come from one bucket (equal cost: no rank waits)
    shuffle: bool = True  # shuffle within buckets and across batches (seed + epoch)
    tail: str = "split"  # how all ranks get equal batch counts (sampler.py; eval: exact)
    seed: int = 0  # sampler seed (same on every rank)
    # --- loading
    num_workers: int = 2  # DataLoader worker processes
    pin_memory: bool = True  # pinned host memory for faster host-to-GPU copies (CUDA only)
    prefetch_factor: int = 4  # batches prefetched per worker
    persistent_workers: bool = True  # keep workers alive between epochs
    pad_to_multiple: int = 8  # pad time to a multiple of this (tensor cores)
    token_pad_multiple: int = 1  # pad target tokens to a multiple of this (fewer shapes: compile.cuda_graphs keys)
    loader_timeout_s: float = 300.0  # a batch that takes longer than this is an error, not a hang; 0 = none
    # --- validation
    bad_data: str = "error"  # error: list every bad line, stop; skip: drop them, report the count
    validate: bool = True  # validate manifests before training (file, header, duration, text)
    validate_decode: bool = False  # also decode every file when validating (finds corrupt bodies; slow)
    duration_tolerance: float = 0.1  # seconds of allowed mismatch between manifest and file header
    output_frame_rate: float = 25.0  # model output frames per second (CTC check: text must fit); 0 = off
    max_utterance_duration: float = 0.0  # reject longer utterances; 0 = whatever fits max_duration
