"""Fine-tune VoxCPM (0.5B / 1.5) or VoxCPM2 text-to-speech on one voice or dialect with ddptrain.Trainer.

    # the CPU demo: a tiny random-init VoxCPM on the shipped Lancashire-English corpus
    # (on this project's shared 2-core CPU machine: 1 min 17 s in one run, 5 min 19 s at a load average of 3-4)
    python examples/finetune_tts.py --config configs/tts_dialect.yaml
    # the VoxCPM1.5 folder (config.json, model.safetensors, audiovae.safetensors or .pth, tokenizer files)
    hf download openbmb/VoxCPM1.5 --local-dir /models/VoxCPM1.5
    # VoxCPM1.5 from that folder, full fine-tuning on your data, 8 GPUs
    torchrun --nproc_per_node=8 examples/finetune_tts.py --config configs/tts_voxcpm15.yaml \\
        tts.path=/models/VoxCPM1.5 data.train_manifest=my/train.jsonl data.eval_manifest=my/dev.jsonl
    # the same with LoRA r=8 on q/k/v/o of both LMs and the DiT (upstream's LoRA recipe)
    torchrun --nproc_per_node=8 examples/finetune_tts.py --config configs/tts_voxcpm15_lora.yaml tts.path=...
    # VoxCPM2 (hf download openbmb/VoxCPM2 --local-dir /models/VoxCPM2): full, or LoRA r=32 alpha=32
    torchrun --nproc_per_node=8 examples/finetune_tts.py --config configs/tts_voxcpm2_lora.yaml \
        tts.path=/models/VoxCPM2 data.train_manifest=my/train.jsonl
    # one LoRA adapter per dialect on one base, base replay, a regression gate: docs/dialects.md;
    # a run in upstream's layouts (a model folder, or a LoRA adapter): examples/export_tts.py

VoxCPM2 is picked as upstream's training script picks it: by ``"architecture": "voxcpm2"`` in
tts.path's config.json (random init: ``tts.preset=tiny-v2``). Then a manifest line's ``ref_audio``
is encoded into the latent cache beside its audio and put in front of the sequence as upstream
does (``103, reference patches, 104, text, 101, target patches, 102``; no loss on the reference);
control / voice-design prefixes in the text (``(a calm voice)Hello``) reach the tokenizer
unchanged. The VAE's input rate is read from the model (config.json ``audio_vae_config``): a
data.sample_rate that disagrees with it is refused at start naming that file, and audio or
ref_audio recorded below it is a bad line naming the audio file (higher rates are resampled, as
for 1.5). Samples are written at the VAE's output rate (48 kHz).

The model is upstream's ``voxcpm.model.voxcpm.VoxCPMModel`` (``pip install --no-deps
voxcpm==2.0.3 einops pydantic``; see examples/models/voxcpm_tts.py), its loss its own forward's:
flow matching of the latent patches ("diff") plus the stop head's cross-entropy ("stop").

Data: JSONL manifests, NeMo's (``audio_filepath``, ``text``, optional ``duration``/``offset``/``id``)
or upstream VoxCPM's unchanged (``audio``, ``text``, optional ``duration``, ``ref_audio``,
``dataset_id``: passed through to the cached utterances); a missing duration is read from the
audio header once (ddptrain/data/manifest.py, ``data.fields`` for keys of other names). Named
sources (``data.train_sources`` / ``data.eval_sources``, e.g. a dialect with the base language
replayed: docs/dialects.md) are mixed and capped as the library mixes them (``data.train_weights``,
``data.mix_temperature``, ``data.source_caps``: ddptrain/data/mix.py); evaluation then scores each
source (``loss/<source>``, ``diff/<source>``, ``stop/<source>``, and ``loss/mean`` over them), which
keep-best and the regression gate (``eval.baseline``) read.
The audio is encoded to VAE latents once (examples/tts_cache.py, run here on rank 0 first: a
no-op when the cache is current; ``python examples/prepare_tts.py`` does it beforehand), so
training reads small latent files and the VAE never enters the trained module. Batches come
from ``DurationBucketSampler``: ``data.max_duration`` budgets padded seconds of *latent* audio
per batch (batch size x the longest utterance's latent frames / the VAE's frame rate), and
``tts.max_text_tokens`` caps batch size x the longest text. An utterance that cannot be batched
(longer than the model's ``max_length`` positions, or alone over either budget) is named with its
manifest line; ``data.bad_data`` decides (``error``: list them all and stop; ``skip``: leave them
out), through ``ddptrain.data.validate``'s bad-data report.

The loss contract: ``loss_fn -> (loss_sum, latent frames)``. Upstream's forward returns two means
per batch: the flow-matching error averaged over the loss-masked latent frames, and the stop
cross-entropy averaged over the loss-masked patches (P = patch_size frames each). This recipe
returns ``(w_diff * diff + w_stop * stop) * frames`` with ``frames`` the loss-masked latent
frames, i.e. the diff error summed over frames plus every patch's stop term counted once for
each of its P frames. For one batch, loss_sum / frames is exactly upstream's total
``diff + stop``; over accumulation and GPUs ddptrain divides by the step's total frames, so a
long utterance weighs by its length instead of every batch counting the same.

Evaluation: the loss (and its ``diff``/``stop`` parts) on the eval set under a fixed seed (the
flow-matching noise and time steps are random: with a fixed seed successive evaluations are
comparable, and training's random stream is left as it was); then ``tts.num_samples`` eval
texts synthesised (upstream's inference loop, classifier-free guidance ``tts.sample_cfg``,
``tts.sample_timesteps`` Euler steps) and decoded through the VAE: written to
``output_dir/samples/step_N/ID.wav`` and logged to TensorBoard as audio (``samples/ID``; the
VAE's reconstruction of the reference as ``reference/ID``, once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddptrain  # noqa: E402
from ddptrain import runfolder  # noqa: E402
from ddptrain.config import above, at_least, one_of, satisfies  # noqa: E402
from ddptrain.data import DataError, DurationBucketSampler, Problem, make_loader  # noqa: E402
from ddptrain.data.manifest import split_paths  # noqa: E402
from ddptrain.data.mix import source_sampler  # noqa: E402
from ddptrain.data.sampler import budget_lengths, sampler_settings  # noqa: E402
from ddptrain.data.validate import budget_problems, keep_good  # noqa: E402
from models import voxcpm_tts as vt  # noqa: E402
from models.folders import check_model_folder, download_command  # noqa: E402
from models.train_flops import VoxCpmFlops  # noqa: E402
from tts_cache import CachedUtterance, prepare, read_cache, recorded_vae  # noqa: E402


MODEL_ID = "openbmb/VoxCPM1.5"  # the Hugging Face model id tts.path is a download of (or openbmb/VoxCPM2)
# what the recipe reads from tts.path (upstream's loader would fail on the first missing one)
MODEL_FILES = {"config.json": ("config.json",), "model.safetensors (or pytorch_model.bin)": (
    "model.safetensors", "pytorch_model.bin"), "audiovae.safetensors (or audiovae.pth)": (
    "audiovae.safetensors", "audiovae.pth"), "the tokenizer (tokenizer.json)": ("tokenizer.json",)}


@dataclass
class TTSConfig:
    path: str = ""  # VoxCPM checkpoint folder (config.json, model.safetensors, audiovae.*, tokenizer); "" = random init from preset
    preset: str = "tiny"  # random init: tiny (CPU tests, demo) | voxcpm1.5 (published layout, ~0.8B) | voxcpm2 (published layout, 2.3B) | tiny-v2 (VoxCPM2, tests)
    vae_seed: int = 0  # random init: seed of the random VAE's weights (the latent cache records it)
    diff_weight: float = 1.0  # weight of the flow-matching loss (upstream lambdas["loss/diff"])
    stop_weight: float = 1.0  # weight of the stop loss (upstream lambdas["loss/stop"])
    max_text_tokens: int = 0  # batch size x longest text (tokens) <= this; 0 = no limit
    test_manifests: list[str] = field(default_factory=list)  # scored (loss) after training
    num_samples: int = 2  # at every evaluation: synthesise this many eval texts (rank 0); 0 = none
    sample_timesteps: int = 10  # Euler steps of the flow-matching sampler
    sample_cfg: float = 2.0  # classifier-free guidance of the sampler
    sample_max_ratio: float = 2.0  # a sample stops after this many times its reference's patches (if the stop head has not)
    sample_seed: int = 42  # noise seed of the samples (the same at every evaluation)
    eval_seed: int = 1234  # evaluation losses are computed under this seed (comparable across evaluations)
    report: str = "report.json"  # final eval/test losses, written inside trainer.output_dir


@dataclass
class RecipeConfig(ddptrain.Config):
    tts: TTSConfig = field(default_factory=TTSConfig)
    # a resume refuses these changed (ddptrain/resume.py): the weights and the latent cache belong to them
    RESUME_REFUSED: ClassVar[dict[str, str]] = {
        "tts.path": "the saved weights were trained from this model, on latents of its VAE",
        "tts.preset": "random init: the saved weights have this preset's layout",
        "tts.vae_seed": "random init: the latents were encoded by the random VAE of this seed",
    }
    RESUME_FOLDERS: ClassVar[tuple[str, ...]] = ("tts.path",)  # moved or copied elsewhere: still accepted
    # checked at load with the library's (ddptrain/config.py RULES), each error naming its key
    RULES: ClassVar[dict] = {
        "tts.path": satisfies("a VoxCPM checkpoint folder | \"\"", lambda v: not v or os.path.isdir(v),
                              f"is not a folder: a downloaded {MODEL_ID} folder holds {'; '.join(MODEL_FILES)}. "
                              f"Download it with: {download_command(MODEL_ID)}"),
        "tts.preset": one_of(*vt.PRESETS),
        **{f"tts.{k}": at_least(0) for k in ("max_text_tokens", "num_samples", "vae_seed", "sample_seed", "eval_seed",
                                             "diff_weight", "stop_weight")},
        "tts.sample_timesteps": at_least(1),
        "tts.sample_max_ratio": above(0),
    }
    RULES_TOGETHER: ClassVar[list] = [
        # the adapters of a random base are worthless, and the published layout's random init is slow
        (("lora.enabled", "tts.path", "tts.preset"),
         lambda lora, path, preset: not lora or bool(path) or preset.startswith("tiny"),
         f"LoRA adapts downloaded weights: set tts.path to a {MODEL_ID} folder ({download_command(MODEL_ID)}, then "
         f"tts.path=/models/{MODEL_ID.split('/')[-1]}); only tts.preset=tiny or tiny-v2 (tests) trains adapters on a "
         "random init"),
        (("data.spec_augment", "data.speed_perturb", "data.feature_device"),
         lambda augment, speeds, device: not augment and not speeds and device == "worker",
         "TTS trains on VAE latents cached before training (examples/prepare_tts.py): data.spec_augment, "
         "data.speed_perturb and data.feature_device=gpu would do nothing; leave them off"),
    ]


def compute_dtype(cfg) -> str:
    """The model's own cast dtype: upstream trains with ``dtype: bfloat16`` under bf16 autocast."""
    return "bfloat16" if cfg.trainer.precision == "bf16" else "float32"


# ---------------------------------------------------------------------------------- the VAE and its cache


def vae_source(cfg) -> dict:
    """Where the VAE's weights come from, found without loading anything: tts.path's VAE weights
    file with its size and modification time, or a random VAE's preset, seed and config. The latent
    cache records it beside :func:`vae_spec`, as the memo of the weights' hash."""
    t = cfg.tts
    if t.path:
        for name in ("audiovae.safetensors", "audiovae.pth"):
            f = os.path.join(os.path.abspath(t.path), name)
            if os.path.isfile(f):
                st = os.stat(f)
                return {"file": f, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        raise ddptrain.ConfigError(f"tts.path={t.path!r} has neither audiovae.safetensors nor audiovae.pth")
    return {"preset": t.preset, "seed": t.vae_seed, "config": vt.PRESETS[t.preset]["audio_vae_config"]}


_VAE_DIGESTS: dict = {}  # (vae_source, architecture, config) -> the VAE's SHA-256, for this process


def vae_spec(cfg, manifest: Optional[str] = None, get_vae: Optional[Callable[[], torch.nn.Module]] = None) -> dict:
    """What the latents depend on: the VAE's architecture, its config as upstream builds the VAE
    (input sample rate, strides, ...) and a SHA-256 of its weights as loaded (``vt.vae_digest``),
    so a moved, copied or re-exported model folder, or the folder a random init was exported to
    (examples/export_tts.py), keeps its latent caches.

    The hash is computed once per weights file (path, size, modification time) or random VAE: it
    comes from this process's earlier call, else from ``manifest``'s cache when that recorded the
    same :func:`vae_source`, else from the VAE itself (``get_vae()``, or :func:`load_vae`).
    """
    layout, arch = model_layout(cfg), architecture(cfg)
    spec = {"architecture": arch, "config": vt.vae_config(layout, arch)}
    memo = json.dumps([vae_source(cfg), spec], sort_keys=True)
    if memo not in _VAE_DIGESTS:
        recorded = recorded_vae(manifest, vae_source(cfg)) if manifest else None
        if isinstance(recorded, dict) and recorded.get("sha256") and {k: recorded.get(k) for k in spec} == spec:
            _VAE_DIGESTS[memo] = recorded["sha256"]
        else:
            _VAE_DIGESTS[memo] = vt.vae_digest((get_vae or (lambda: load_vae(cfg)))())
    return {**spec, "sha256": _VAE_DIGESTS[memo]}


def architecture(cfg) -> str:
    """``voxcpm2`` or ``voxcpm``: tts.path's config.json ``"architecture"`` (upstream's switch), or the preset's."""
    if cfg.tts.path:
        check_model_folder("tts.path", cfg.tts.path, MODEL_FILES, MODEL_ID)
        return vt.folder_architecture(cfg.tts.path)
    return vt.preset_architecture(cfg.tts.preset)


def model_layout(cfg):
    """The VoxCPMConfig of the run (from tts.path's config.json, or the preset); for VoxCPM2 the
    VAE's input rate checked against data.sample_rate."""
    arch = architecture(cfg)
    if cfg.tts.path:
        with open(os.path.join(cfg.tts.path, "config.json"), encoding="utf-8") as f:
            layout = vt.model_module(arch).VoxCPMConfig.model_validate_json(f.read())
    else:
        layout = vt.preset_config(cfg.tts.preset, 0, compute_dtype(cfg))
    if arch == "voxcpm2":
        check_sample_rate(cfg, layout)
    return layout


def vae_input_rate(layout) -> int:
    """The VAE's input rate as the model reads it (config.json's audio_vae_config, or upstream's default)."""
    vae_cfg = layout.audio_vae_config or vt.model_module("voxcpm2").AudioVAEConfigV2()
    return int(vae_cfg.sample_rate)


def check_sample_rate(cfg, layout) -> None:
    """Refuse a data.sample_rate that disagrees with the VAE's input rate (upstream's users get garbage
    from exactly this), naming the model's config file.

    Raises:
        ddptrain.ConfigError: the two rates differ.
    """
    rate = vae_input_rate(layout)
    if cfg.data.sample_rate != rate:
        where = os.path.join(cfg.tts.path, "config.json") if cfg.tts.path else f"tts.preset={cfg.tts.preset}"
        raise ddptrain.ConfigError(
            f"data.sample_rate={cfg.data.sample_rate} disagrees with the VAE's input rate {rate} Hz ({where}: "
            f"audio_vae_config.sample_rate); the audio is encoded at the VAE's rate, so set data.sample_rate={rate}")


def random_vae(cfg):
    torch.manual_seed(cfg.tts.vae_seed)
    vae = vt.vae_from_config(model_layout(cfg).audio_vae_config, architecture(cfg))
    return vae.float().eval().requires_grad_(False)


def load_vae(cfg) -> torch.nn.Module:
    """The run's VAE alone: tts.path's VAE weights file (not the model's), or the random VAE of
    tts.vae_seed, the caller's random stream left as it was."""
    if cfg.tts.path:
        return vt.load_vae(cfg.tts.path)
    with torch.random.fork_rng(devices=[]):
        return random_vae(cfg)


def prepare_manifests(cfg, manifests: Sequence[str], vae=None, device: Optional[torch.device] = None) -> list[dict]:
    """Bring each manifest's latent cache up to date for this run's VAE (a no-op when current).

    The VAE (``vae``, or :func:`load_vae`: tts.path's VAE alone) is loaded at most once for all of
    them, and only when an utterance needs encoding or the hash of weights not seen before is due.
    """
    layout = model_layout(cfg)
    patch, v2 = layout.patch_size, architecture(cfg) == "voxcpm2"
    dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    held = [vae]

    def get_vae():
        if held[0] is None:
            held[0] = load_vae(cfg)
        return held[0]

    def encoder():
        if dev.type == "cpu":  # the VAE's small convolutions lose much to competing threads (20x on 2 busy cores)
            torch.set_num_threads(1)
        return get_vae().to(dev), lambda m, wave: vt.encode_latents(m, wave, patch)

    threads = torch.get_num_threads()
    try:
        return [prepare(m, vae_spec(cfg, m, get_vae), patch, encoder, cfg.data.bad_data, fields=cfg.data.fields,
                        encode_ref=v2, min_sample_rate=vae_input_rate(layout) if v2 else 0,
                        vae_source=vae_source(cfg)) for m in manifests]
    finally:
        torch.set_num_threads(threads)


def prepare_manifest(cfg, manifest: str, vae=None, device: Optional[torch.device] = None) -> dict:
    """:func:`prepare_manifests` of one manifest."""
    return prepare_manifests(cfg, [manifest], vae, device)[0]


def spec_manifests(spec) -> list[str]:
    """The manifests of a data spec: a manifest (or comma-separated manifests), or ``{name: manifests}``."""
    if isinstance(spec, dict):
        return [m for paths in spec.values() for m in split_paths(paths)]
    return split_paths(spec) if spec else []


def config_manifests(cfg) -> list[str]:
    """Every manifest the run reads (training and evaluation sources included), each once."""
    d = cfg.data
    found = [*spec_manifests(d.train_sources or d.train_manifest), *spec_manifests(d.eval_sources or d.eval_manifest),
             *cfg.tts.test_manifests]
    return list(dict.fromkeys(found))


# ---------------------------------------------------------------------------------- batches


def read_latent_cache(cfg, manifest: str, patch_size: int) -> list[CachedUtterance]:
    """``manifest``'s cached utterances for this run (with their ref_audio latents for VoxCPM2)."""
    return read_cache(manifest, vae_spec(cfg, manifest), patch_size, encode_ref=architecture(cfg) == "voxcpm2")


@dataclass
class Utterances:
    """The cached utterances of a data spec; with named sources (``data.train_sources`` /
    ``eval_sources``) their names and each utterance's source number."""

    utts: list[CachedUtterance]
    names: Optional[list[str]] = None
    source_of: Optional[list[int]] = None


def read_sources(cfg, spec, patch_size: int) -> Utterances:
    """The cached utterances of ``spec``: a manifest path (or comma-separated paths), or ``{name: manifests}``."""
    if not isinstance(spec, dict):
        return Utterances([u for m in spec_manifests(spec) for u in read_latent_cache(cfg, m, patch_size)])
    utts, source_of = [], []
    for s, paths in enumerate(spec.values()):
        for m in split_paths(paths):
            got = read_latent_cache(cfg, m, patch_size)
            utts += got
            source_of += [s] * len(got)
    return Utterances(utts, [str(n) for n in spec], source_of)


class LatentDataset(Dataset):
    """Cached utterances -> ``{"id", "text_ids", "latents", "ref_latents"}`` (read from their .npy;
    ``ref_latents`` None without a cached ref_audio), and ``"source"`` (its source's name) with
    named sources."""

    def __init__(self, utts: Sequence[CachedUtterance], text_ids: Sequence[list[int]],
                 sources: Optional[Sequence[str]] = None):
        self.utts, self.text_ids = list(utts), list(text_ids)
        self.sources = list(sources) if sources is not None else None

    def __len__(self) -> int:
        return len(self.utts)

    def __getitem__(self, i: int) -> dict:
        u = self.utts[i]
        try:
            z = np.load(u.latent_path)
            r = np.load(u.ref_latent_path) if u.ref_latent_path else None
        except (OSError, ValueError) as e:
            raise DataError(f"{u.source}:{u.line} (id {u.id}): cannot read latent file {u.latent_path}: {e}") from None
        out = {"id": u.id, "text_ids": self.text_ids[i], "latents": torch.from_numpy(z),
               "ref_latents": None if r is None else torch.from_numpy(r)}
        if self.sources is not None:
            out["source"] = self.sources[i]
        return out


class TTSCollator:
    """Examples -> one padded batch of upstream's sequences (:func:`voxcpm_tts.pack_utterance`).

    Batch keys: ``ids``; ``text_tokens``, ``text_mask``, ``audio_mask``, ``loss_mask``,
    ``labels``, ``position_ids`` (B, S); ``audio_feats`` (B, S, P, D); ``frames`` (0-d int64: the
    loss-masked latent frames, the loss's units) and ``patches`` (0-d int64), counted here so a
    step needs no device sync, and tensors so batches of one shape share one captured graph
    (``compile.cuda_graphs`` keys host numbers by value); ``sources`` (each utterance's source
    name) with named sources.
    Padding (to a multiple of ``pad_multiple``) has every mask at 0.
    """

    def __init__(self, patch_size: int, pad_multiple: int = 1):
        self.patch, self.multiple = patch_size, max(1, pad_multiple)

    def __call__(self, examples: Sequence[dict]) -> dict:
        batch: dict = {"ids": [e["id"] for e in examples]}
        if not examples:
            return batch  # an evaluation filler: the Trainer skips it
        seqs = [vt.pack_utterance(e["text_ids"], e["latents"], self.patch, e.get("ref_latents")) for e in examples]
        s = -(-max(len(q["labels"]) for q in seqs) // self.multiple) * self.multiple
        for key in ("text_tokens", "text_mask", "audio_mask", "loss_mask", "labels"):
            out = torch.zeros(len(seqs), s, dtype=torch.int32)
            for b, q in enumerate(seqs):
                out[b, :len(q[key])] = q[key]
            batch[key] = out
        feats = torch.zeros(len(seqs), s, *seqs[0]["audio_feats"].shape[1:])
        for b, q in enumerate(seqs):
            feats[b, :len(q["labels"])] = q["audio_feats"]
        batch["audio_feats"] = feats
        batch["position_ids"] = torch.arange(s).repeat(len(seqs), 1)  # unused by the model, as upstream
        patches = batch["loss_mask"].sum(dtype=torch.int64)
        batch.update(patches=patches, frames=patches * self.patch)
        if "source" in examples[0]:
            batch["sources"] = [e["source"] for e in examples]
        return batch


def build_loader(utterances: Utterances | Sequence[CachedUtterance], cfg, tokenizer, layout, train: bool,
                 world_size: int, rank: int) -> DataLoader:
    """Cached utterances -> a bucketed DataLoader of TTS batches; named sources (:func:`read_sources`)
    are mixed as the ``data:`` section says (``data.train_weights`` or their sizes, through
    ``data.mix_temperature``, capped by ``data.source_caps``: ddptrain/data/mix.py), and every
    batch names each utterance's source (``batch["sources"]``, for per-source evaluation).

    Raises:
        DataError: under ``data.bad_data: error``, every utterance that cannot be batched, named
            with its manifest line (``skip`` leaves them out and prints them on rank 0): its
            sequence (text + patches + 2) exceeds the model's ``max_length``, its latent audio
            alone exceeds ``data.max_duration`` or its text alone ``tts.max_text_tokens``; or no
            utterance left.
    """
    named = utterances if isinstance(utterances, Utterances) else Utterances(list(utterances))
    utts = named.utts
    data, t = cfg.data, cfg.tts
    rate = vt.frame_rate(layout.audio_vae_config)
    source = ", ".join(dict.fromkeys(u.source for u in utts)) or "(no manifest)"
    # the library's budget check, the seconds counted as the sampler counts them
    # a reference recording's latents are sequence positions too: counted in the batch budget
    problems = budget_problems(utts, [(u.frames + u.ref_frames) / rate for u in utts], data,
                               cost_unit="of latent audio")
    ids = {}  # by object: an id may repeat across sources
    for u in utts:
        x = ids[id(u)] = tokenizer(u.text)
        n = len(x) + u.frames // layout.patch_size + 2 + (u.ref_frames // layout.patch_size + 2 if u.ref_latent_path
                                                          else 0)
        if n > layout.max_length:
            problems.append(Problem(u.source, u.line, u.id, f"{n} positions (text + latent patches [+ ref_audio "
                                    "patches] + 2 [+ 2]) exceed the "
                                    f"model's max_length {layout.max_length}"))
        if 0 < t.max_text_tokens < len(x):
            problems.append(Problem(u.source, u.line, u.id, f"too long: {len(x)} text tokens do not fit in a batch of "
                                    f"tts.max_text_tokens={t.max_text_tokens}"))
    # the shared bad-data policy (ddptrain/data/validate.py): one problem per line, in manifest
    # order, the bad ones dropped; our own headline, since `python -m ddptrain.data.validate`
    # (the default one's advice) knows nothing of max_length or the latent budgets
    keep = keep_good(utts, problems, data.bad_data, source, f"{source}: {{summary}} for this model and batch "
                     "budget (data.bad_data=skip leaves them out):", print if rank == 0 else None)
    text_ids = [ids[id(u)] for u in keep]
    seconds = np.array([(u.frames + u.ref_frames) / rate for u in keep])
    tokens = np.array([len(x) for x in text_ids], dtype=np.float64)
    if named.names is None:
        sampler = DurationBucketSampler.from_config(seconds, data, train, tokens=tokens, max_tokens=t.max_text_tokens,
                                                    world_size=world_size, rank=rank)
        return make_loader(LatentDataset(keep, text_ids), sampler, TTSCollator(layout.patch_size,
                                                                               data.pad_to_multiple), data, train)
    number = {id(u): s for u, s in zip(utts, named.source_of)}
    source_of = np.array([number[id(u)] for u in keep], dtype=np.int64)
    # a source's hours (data.source_caps) are its target audio; the budget also counts the reference
    sampler = source_sampler(budget_lengths(seconds, data, train), source_of, named.names, data, train,
                             seconds=np.array([u.frames / rate for u in keep]), tokens=tokens,
                             max_tokens=t.max_text_tokens, **sampler_settings(data, train, world_size, rank))
    return make_loader(LatentDataset(keep, text_ids, [named.names[s] for s in source_of]), sampler,
                       TTSCollator(layout.patch_size, data.pad_to_multiple), data, train)


# ---------------------------------------------------------------------------------- objective


class TTSObjective:
    """The loss contract for VoxCPM (see the module docstring): ``((w_d diff + w_s stop) * frames, frames)``.

    ``progress`` (step / total steps) feeds the forward's ``progress`` as upstream's script does
    (it moves the noisy-condition and mean-mode schedules; a no-op for VoxCPM-1.5's settings).
    """

    def __init__(self, diff_weight: float = 1.0, stop_weight: float = 1.0):
        self.wd, self.ws = diff_weight, stop_weight
        self.progress = lambda: 0.0
        self._last: Optional[tuple] = None  # evaluation: the parts of the batch just scored

    def outputs(self, model, batch) -> dict:
        return model(batch["text_tokens"], batch["text_mask"], batch["audio_feats"], batch["audio_mask"],
                     batch["loss_mask"], batch["position_ids"], batch["labels"], progress=self.progress())

    def __call__(self, model, batch):
        out = self.outputs(model, batch)
        frames = batch["frames"]
        if not model.training:  # metrics() reads the parts of this same forward
            self._last = (id(batch), out)
        return (self.wd * out["loss/diff"] + self.ws * out["loss/stop"]) * frames, frames

    def metrics(self, model, batch) -> dict:
        """Eval metrics as (numerator, denominator): the diff loss per frame, the stop loss per patch;
        with named sources (``batch["sources"]``) also ``loss/<source>``, ``diff/<source>`` and
        ``stop/<source>`` of each source's utterances, which the regression gate and ``loss/mean``
        read (ddptrain/regression.py). Upstream's forward returns batch means, so a batch that
        mixes sources is scored again, one forward per source."""
        out = self._last[1] if self._last and self._last[0] == id(batch) else self.outputs(model, batch)
        self._last = None
        frames, patches = int(batch["frames"]), int(batch["patches"])
        result = self._parts(out, frames, patches, with_loss=False)
        names = batch.get("sources") or []
        for name in sorted(set(names)):
            rows = [i for i, n in enumerate(names) if n == name]
            if len(rows) == len(names):
                result.update(self._parts(out, frames, patches, name))
                continue
            sub = {k: v[rows] if torch.is_tensor(v) and v.dim() else v for k, v in batch.items()}
            part = int(sub["loss_mask"].sum())
            result.update(self._parts(self.outputs(model, sub), part * frames // max(1, patches), part, name))
        return result

    def _parts(self, out: dict, frames: int, patches: int, source: str = "", with_loss: bool = True) -> dict:
        diff, stop, tail = float(out["loss/diff"]), float(out["loss/stop"]), f"/{source}" if source else ""
        parts = {f"diff{tail}": (diff * frames, frames), f"stop{tail}": (stop * patches, patches)}
        if with_loss:  # the Trainer sums the run's own "loss" from __call__
            parts[f"loss{tail}"] = ((self.wd * diff + self.ws * stop) * frames, frames)
        return parts


# ---------------------------------------------------------------------------------- samples


class SampleWriter:
    """Synthesises a few eval texts at each evaluation: wav files and TensorBoard audio (rank 0)."""

    def __init__(self, vae, tokenizer, utts: Sequence[CachedUtterance], cfg, patch_size: int):
        self.vae, self.tok, self.utts, self.cfg, self.patch = vae, tokenizer, list(utts), cfg, patch_size
        self.sample_rate = vt.output_rate(vae)  # VoxCPM2 decodes at 48 kHz
        self._logged_references = False

    def __call__(self, module, step: int, logger) -> list[str]:
        import soundfile as sf

        t = self.cfg.tts
        folder = os.path.join(self.cfg.trainer.output_dir, "samples", f"step_{step:07d}")
        os.makedirs(folder, exist_ok=True)
        written = []
        for u in self.utts:
            limit = max(4, math.ceil(t.sample_max_ratio * u.frames / self.patch))
            wave = vt.synthesize(module, self.vae, self.tok(u.text), limit, t.sample_timesteps, t.sample_cfg,
                                 t.sample_seed).numpy()
            wave = vt.peak_normalise(wave)
            path = os.path.join(folder, f"{u.id}.wav")
            sf.write(path, wave, self.sample_rate)
            written.append(path)
            if logger is not None and logger.tb is not None:
                logger.tb.add_audio(f"samples/{u.id}", torch.from_numpy(wave)[None], step, self.sample_rate)
                if not self._logged_references:
                    z = torch.from_numpy(np.load(u.latent_path)).T[None].to(next(self.vae.parameters()).device)
                    with torch.no_grad(), torch.autocast(z.device.type, enabled=False):
                        ref = vt.peak_normalise(self.vae.decode(z.float()).reshape(-1).cpu().numpy())
                    logger.tb.add_audio(f"reference/{u.id}", torch.from_numpy(ref)[None], step, self.sample_rate)
        self._logged_references = True
        if logger is not None:
            logger.print(f"samples: {len(written)} wav file(s) in {folder}")
        return written


class TTSTrainer(ddptrain.Trainer):
    """The Trainer, with evaluations under a fixed seed followed by synthesised samples."""

    samples: Optional[SampleWriter] = None
    eval_seed: int = 0

    def evaluate(self, data=None, prefix: str = "eval", max_batches: int = 0, name: str = "") -> dict:
        """:meth:`ddptrain.Trainer.evaluate` (its arguments) under ``tts.eval_seed``, then samples."""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # training's random stream continues untouched
            torch.manual_seed(self.eval_seed)
            result = super().evaluate(data, prefix, max_batches, name=name)
            if data is None and not max_batches and self.samples is not None and self.info.is_main:
                with self.precision.autocast():
                    self.samples(self.module, self.progress.step, self.logger)
        return result


# ---------------------------------------------------------------------------------- main


@dataclass
class Built:
    model: torch.nn.Module
    vae: torch.nn.Module
    tokenizer: vt.TextTokenizer
    layout: object  # VoxCPMConfig


def build_model(cfg, info) -> Built:
    """The model (VAE removed), the VAE and the tokenizer for ``cfg``."""
    model_layout(cfg)  # the folder's files, and VoxCPM2's VAE rate against data.sample_rate, before any loading
    device = str(info.device)
    if cfg.tts.path:
        model, vae, hf_tok = vt.load_pretrained(cfg.tts.path, device, compute_dtype(cfg))
    else:
        vae, hf_tok = random_vae(cfg), vt.char_tokenizer()
        torch.manual_seed(cfg.trainer.seed)  # the same initial weights on every rank and every run
        model = vt.build_model(vt.preset_config(cfg.tts.preset, len(hf_tok), compute_dtype(cfg)), hf_tok, vae, device,
                               architecture(cfg))
    return Built(model, vae, vt.TextTokenizer(hf_tok), model.config)


def build(cfg, info) -> tuple:
    """(Built, objective, train loader, eval loader or None, eval utterances): prepares the
    latent caches on rank 0 first."""
    b = build_model(cfg, info)
    if info.is_main:
        prepare_manifests(cfg, config_manifests(cfg), b.vae, info.device)
    ddptrain.dist.barrier()  # the other ranks read the caches rank 0 just wrote
    patch = b.layout.patch_size
    d = cfg.data
    train = build_loader(read_sources(cfg, d.train_sources or d.train_manifest, patch), cfg, b.tokenizer, b.layout,
                         True, info.world_size, info.rank)
    evals = read_sources(cfg, d.eval_sources or d.eval_manifest, patch)
    loader = build_loader(evals, cfg, b.tokenizer, b.layout, False, info.world_size, info.rank) if evals.utts else None
    return b, TTSObjective(cfg.tts.diff_weight, cfg.tts.stop_weight), train, loader, evals.utts


def build_eval(cfg, info, manifests: list[str]) -> tuple:
    """examples/evaluate.py's pieces: ``(model, loss_fn, metrics_fn, {manifest: eval loader})``, the
    latent caches prepared on rank 0 first; each manifest is scored on its own (one set, one source)."""
    b = build_model(cfg, info)
    if info.is_main:
        prepare_manifests(cfg, manifests, b.vae, info.device)
    ddptrain.dist.barrier()
    loaders = {m: build_loader(read_latent_cache(cfg, m, b.layout.patch_size), cfg, b.tokenizer, b.layout, False,
                               info.world_size, info.rank) for m in manifests}
    objective = TTSObjective(cfg.tts.diff_weight, cfg.tts.stop_weight)
    return b.model, objective, objective.metrics, loaders


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (configs/tts_*.yaml)")
    args, overrides = parser.parse_known_args(argv)
    cfg = ddptrain.load_config(args.config, overrides, schema=RecipeConfig)
    info = ddptrain.setup_distributed(cfg)
    b, objective, train, evals, eval_utts = build(cfg, info)
    trainer = TTSTrainer(b.model, objective, cfg, train, eval_data=evals, metrics_fn=objective.metrics,
                         flops_fn=VoxCpmFlops(b.model, b.layout, cfg.lora.enabled).of_batch)  # MFU in the log
    trainer.eval_seed = cfg.tts.eval_seed
    objective.progress = lambda: trainer.progress.step / max(1, trainer.total_steps)
    if info.is_main and cfg.tts.num_samples and eval_utts:
        chosen = sorted(eval_utts, key=lambda u: u.id)[:cfg.tts.num_samples]
        trainer.samples = SampleWriter(b.vae.to(trainer.device), b.tokenizer, chosen, cfg, b.layout.patch_size)
    if info.is_main:
        n = sum(p.numel() for p in b.model.parameters())
        k = sum(p.numel() for p in b.model.parameters() if p.requires_grad)
        name = "VoxCPM2" if architecture(cfg) == "voxcpm2" else "VoxCPM"
        print(f"{name}: {n:,} parameters ({k:,} trained{', LoRA' if trainer.adapted else ''}), VAE apart "
              f"({sum(p.numel() for p in b.vae.parameters()):,}); {len(train)} batches/epoch/rank on "
              f"{info.world_size} process(es), device {trainer.device}; recomputed {len(trainer.recomputed)}, "
              f"compiled {len(trainer.compiled)} modules")
    start = time.time()
    summary = {"eval": trainer.fit()}
    summary["train_seconds"] = round(time.time() - start, 1)
    patch = b.layout.patch_size
    summary["test"] = {m: trainer.evaluate(build_loader(read_latent_cache(cfg, m, patch), cfg, b.tokenizer, b.layout,
                                                        False, info.world_size, info.rank), prefix="test", name=m)
                       for m in cfg.tts.test_manifests}
    trainer.close()  # after the test-set evaluations: they are logged too
    if info.is_main:
        runfolder.write_file(cfg.trainer.output_dir, cfg.tts.report, json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        out = cfg.trainer.output_dir  # where a new user looks for the outputs: said last
        print(f"report: {os.path.join(out, cfg.tts.report)}; logs: {os.path.join(out, 'metrics.jsonl')}"
              + (f", TensorBoard: tensorboard --logdir {os.path.join(out, 'tensorboard')}"
                 if cfg.logging.tensorboard else ""))
    ddptrain.dist.teardown()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
