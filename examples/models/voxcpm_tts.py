"""VoxCPM (0.5B / 1.5) and VoxCPM2 for training with ddptrain: the upstream model, its VAE kept apart.

The model is upstream's own ``voxcpm.model.voxcpm.VoxCPMModel`` (or, for VoxCPM2,
``voxcpm.model.voxcpm2.VoxCPM2Model`` with its 16 kHz-in / 48 kHz-out ``AudioVAEV2``), unchanged:
its forward computes the flow-matching ("diff") and stop losses exactly as OpenBMB's fine-tuning
script trains them. What this file adds:

* :func:`import_voxcpm`: the model module without the package's ``__init__`` files, which import
  the whole TTS app (VoxCPM2, librosa, huggingface_hub downloads). Install the model alone with
  ``pip install --no-deps voxcpm==2.0.3 einops pydantic`` (transformers and safetensors are
  ddptrain's dev dependencies already).
* Presets for random-initialised models (:data:`PRESETS`): ``voxcpm1.5`` is VoxCPM-1.5's layout
  as published (MiniCPM4 base LM of 24 layers, 8-layer residual LM, 8-layer local encoder and
  local DiT, patch size 4, a 44.1 kHz VAE at 25 latent frames/s; ~0.8B parameters); ``voxcpm2``
  is VoxCPM2's (28-layer 2048-wide base LM, 8-layer residual LM without RoPE, 12-layer local
  encoder and DiT, patch 4, the 16 kHz-in / 48 kHz-out AudioVAEV2; 2.29B parameters), its values
  those of openbmb/VoxCPM2's config.json as quoted by several public projects that load it (the
  Hugging Face file itself was not reachable when the preset was written; the built model has
  the 577 tensors and the sentinel shapes they list); ``tiny`` is a few hundred thousand
  parameters for CPU tests and the demo.
* :func:`load_pretrained`: a checkpoint folder a user already has (``config.json``,
  ``model.safetensors`` or ``pytorch_model.bin``, ``audiovae.safetensors`` or ``audiovae.pth``,
  tokenizer files), read like upstream's ``VoxCPMModel.from_local(training=True)`` but strictly
  (a missing or unexpected tensor is an error) and with the VAE returned apart: the VAE is
  frozen and only encodes audio once (examples/prepare_tts.py) and decodes samples, so it never
  sits in the trained module, its optimizer state or its gradient all-reduce. :func:`load_vae`
  reads the VAE alone (the latent cache's encoder), :func:`vae_digest` hashes what it holds.
* :func:`import_voxcpm2`: the VoxCPM2 module (see there for its one missing import).
* The architecture of a folder is upstream's own switch: config.json's ``"architecture"``
  (``voxcpm2``; absent = VoxCPM/1.5), as upstream's training script reads it; a random init takes
  its preset's (``tiny-v2``: a few hundred thousand parameters of VoxCPM2's layout, for CPU tests).
* :func:`pack_utterance`: one utterance's training sequence from cached latents, laid out as
  upstream's ``AudioFeatureProcessingPacker.process_tts_data`` lays it out from audio (and, with a
  reference recording's latents, as ``process_tts_data_with_ref``: VoxCPM2's ``ref_audio``).
* :func:`synthesize`: text -> latents (upstream's ``_inference``) -> waveform through the VAE.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import math
import os
import sys
import types
from typing import Optional, Sequence

import numpy as np
import torch

from ddptrain.weights import save_weights

AUDIO_START, AUDIO_END = 101, 102  # upstream's token ids around the audio of a TTS sequence
REF_START, REF_END = 103, 104  # VoxCPM2's token ids around a reference recording (ref_audio)
ARCHITECTURES = ("voxcpm", "voxcpm2")  # config.json's "architecture", as upstream's training script reads it
RESERVED_IDS = 128  # the character tokenizer keeps ids below this free for such special tokens


def import_voxcpm():
    """``voxcpm.model.voxcpm`` (the model module), without running ``voxcpm/__init__.py`` or
    ``voxcpm/model/__init__.py``.

    Those import the whole app (``voxcpm.core``: huggingface_hub downloads; ``voxcpm2``:
    librosa, ...); the model itself needs torch, einops, pydantic and transformers only. The
    two packages are registered as their own module objects with their ``__init__`` left unrun,
    so ``voxcpm.model.voxcpm`` and ``voxcpm.modules.*`` import normally beneath them.

    Raises:
        ImportError: voxcpm (or one of the model's own dependencies) is not installed.
    """
    if "voxcpm.model.voxcpm" in sys.modules:
        return sys.modules["voxcpm.model.voxcpm"]
    for name in ("voxcpm", "voxcpm.model", "voxcpm.training"):
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ImportError("the VoxCPM recipe needs the voxcpm package: pip install --no-deps voxcpm==2.0.3 "
                              "einops pydantic (its other dependencies are the TTS app's, not the model's)")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, sys.modules[name])
    return importlib.import_module("voxcpm.model.voxcpm")


class _NoLibrosa(types.ModuleType):
    """Stands in for librosa while ``voxcpm.model.voxcpm2`` is imported, and fails loudly if used."""

    def __getattr__(self, name):
        raise ImportError(f"librosa.{name}: VoxCPM2's own audio loading (VoxCPM2Model._encode_wav, its reference-"
                          "wav inference) needs librosa, which this recipe does not install (it reads audio with "
                          "ddptrain.data.load_audio); pip install librosa to use those upstream methods")


def import_voxcpm2():
    """``voxcpm.model.voxcpm2`` (VoxCPM2Model, its configs, AudioVAEV2), without the app's ``__init__`` files.

    The module imports librosa at its top for its own inference-time audio loading, which training
    never calls; when librosa is not installed, a placeholder that raises ImportError (naming the
    upstream method and ``pip install librosa``) on any use is put in its place for the import only.

    Raises:
        ImportError: voxcpm (or a dependency of the model itself) is not installed.
    """
    if "voxcpm.model.voxcpm2" in sys.modules:
        return sys.modules["voxcpm.model.voxcpm2"]
    import_voxcpm()
    placeholder = importlib.util.find_spec("librosa") is None and "librosa" not in sys.modules
    if placeholder:
        sys.modules["librosa"] = _NoLibrosa("librosa")
    try:
        return importlib.import_module("voxcpm.model.voxcpm2")
    finally:
        if placeholder:  # only voxcpm2's own name points at it; `import librosa` elsewhere still fails normally
            del sys.modules["librosa"]


def model_module(architecture: str):
    """The upstream module of ``architecture``: its ``VoxCPMConfig``, model class and VAE."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown VoxCPM architecture {architecture!r} (known: {', '.join(ARCHITECTURES)})")
    return import_voxcpm2() if architecture == "voxcpm2" else import_voxcpm()


def model_class(architecture: str):
    m = model_module(architecture)
    return m.VoxCPM2Model if architecture == "voxcpm2" else m.VoxCPMModel


def folder_architecture(path: str) -> str:
    """config.json's ``"architecture"`` of a checkpoint folder (``voxcpm`` when absent, as upstream reads it).

    Raises:
        ValueError: an architecture this recipe does not know (the file named).
    """
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file, encoding="utf-8") as f:
        arch = str(json.load(f).get("architecture", "voxcpm")).lower()
    if arch not in ARCHITECTURES:
        raise ValueError(f"{cfg_file}: architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    return arch


def upstream_packer_class():
    """Upstream's ``AudioFeatureProcessingPacker`` (the training script's audio -> sequence step)."""
    import_voxcpm()
    return importlib.import_module("voxcpm.training.packers").AudioFeatureProcessingPacker


# ---------------------------------------------------------------------------------- configs


def _lm(hidden, ffn, heads, kv_heads, layers, vocab, max_pos, rope_factors=None) -> dict:
    head_dim = hidden // heads
    factors = list(rope_factors) if rope_factors is not None else [1.0] * (head_dim // 2)
    return {"bos_token_id": 1, "eos_token_id": 2, "hidden_size": hidden, "intermediate_size": ffn,
            "max_position_embeddings": max_pos, "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
            "rope_scaling": {"type": "longrope", "long_factor": factors, "short_factor": list(factors),
                             "original_max_position_embeddings": max_pos},
            "vocab_size": vocab, "use_mup": False, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4,
            "rope_theta": 10000.0}


# openbmb/VoxCPM2 config.json's LongRoPE factors (long_factor = short_factor), one per rotary pair of its 128-dim heads
VOXCPM2_ROPE_FACTORS = (
    0.9977997200264581, 1.014658295992452, 1.0349680404997148, 1.059429246056193, 1.0888815016813513,
    1.1243301355211495, 1.166977103606075, 1.2182568066927284, 1.2798772354275727, 1.3538666751582975,
    1.4426259039919596, 1.5489853358570191, 1.6762658237220625, 1.8283407612492941, 2.0096956085876183,
    2.225478927469756, 2.481536379650452, 2.784415934557119, 3.1413289096347365, 3.560047844772632,
    4.048719380066383, 4.615569542115128, 5.2684819496549835, 6.014438591970396, 6.858830049237097,
    7.804668263503327, 8.851768731513417, 9.99600492938444, 11.228766118181639, 12.536757560834843,
    13.902257701387796, 15.303885189125953, 16.717837610115794, 18.119465097853947, 19.484965238406907,
    20.792956681060105, 22.02571786985731, 23.16995406772833, 24.217054535738416, 25.16289275000465,
    26.007284207271347, 26.753240849586767, 27.40615325712662, 27.973003419175363, 28.461674954469114,
    28.880393889607006, 29.237306864684626, 29.540186419591297, 29.79624387177199, 30.01202719065413,
    30.193382037992453, 30.34545697551969, 30.47273746338473, 30.579096895249787, 30.66785612408345,
    30.741845563814174, 30.80346599254902, 30.85474569563567, 30.897392663720595, 30.932841297560394,
    30.962293553185553, 30.986754758742034, 31.007064503249293, 31.02392307921529,
)


PRESETS = {
    # VoxCPM-1.5's published layout: 44.1 kHz VAE (hop 1764: 25 latent frames/s), patch 4 (6.25 LM steps/s)
    "voxcpm1.5": {
        "lm_config": _lm(1024, 4096, 16, 2, 24, 73448, 32768), "patch_size": 4, "feat_dim": 64,
        "residual_lm_num_layers": 8, "scalar_quantization_latent_dim": 256, "scalar_quantization_scale": 9,
        "encoder_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 8},
        "dit_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 8,
                       "cfm_config": {"sigma_min": 1e-6, "solver": "euler", "t_scheduler": "log-norm",
                                      "training_cfg_rate": 0.1, "inference_cfg_rate": 2.0}},
        "audio_vae_config": {"encoder_dim": 128, "encoder_rates": [2, 3, 6, 7, 7], "latent_dim": 64,
                             "decoder_dim": 2048, "decoder_rates": [7, 7, 6, 3, 2], "depthwise": True,
                             "sample_rate": 44100},
        "max_length": 4096,
    },
    # CPU tests and the demo: 16 kHz VAE (hop 640: 25 latent frames/s), patch 2
    "tiny": {
        "lm_config": _lm(64, 128, 4, 2, 2, 0, 1024), "patch_size": 2, "feat_dim": 16,
        "residual_lm_num_layers": 1, "scalar_quantization_latent_dim": 16, "scalar_quantization_scale": 9,
        "encoder_config": {"hidden_dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 1},
        "dit_config": {"hidden_dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2,
                       "cfm_config": {"sigma_min": 1e-6, "solver": "euler", "t_scheduler": "log-norm",
                                      "training_cfg_rate": 0.1, "inference_cfg_rate": 2.0}},
        "audio_vae_config": {"encoder_dim": 8, "encoder_rates": [2, 5, 8, 8], "latent_dim": 16,
                             "decoder_dim": 32, "decoder_rates": [8, 8, 5, 2], "depthwise": True,
                             "sample_rate": 16000},
        "max_length": 512,
    },
}
# VoxCPM2's published layout (openbmb/VoxCPM2 config.json): MiniCPM4 base LM of 28 layers (2048 wide, 16 heads
# of 128, 2 KV heads), an 8-layer residual LM without RoPE, 12-layer local encoder and local DiT (1024 wide,
# 16 heads of 128), patch 4, a 16 kHz-in / 48 kHz-out AudioVAEV2 (hop 640: 25 latent frames/s); ~2.3B
# parameters without the VAE. config.json's "mean_mode": false is upstream's dit_mean_mode (its default)
PRESETS["voxcpm2"] = {
    "architecture": "voxcpm2",
    "lm_config": {**_lm(2048, 6144, 16, 2, 28, 73448, 32768, VOXCPM2_ROPE_FACTORS), "kv_channels": 128},
    "patch_size": 4, "feat_dim": 64, "residual_lm_num_layers": 8, "residual_lm_no_rope": True,
    "scalar_quantization_latent_dim": 512, "scalar_quantization_scale": 9,
    "encoder_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 12, "kv_channels": 128},
    "dit_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 12, "kv_channels": 128,
                   "dit_mean_mode": False,
                   "cfm_config": {"sigma_min": 1e-6, "solver": "euler", "t_scheduler": "log-norm",
                                  "inference_cfg_rate": 2.0}},
    "audio_vae_config": {"encoder_dim": 128, "encoder_rates": [2, 5, 8, 8], "latent_dim": 64, "decoder_dim": 2048,
                         "decoder_rates": [8, 6, 5, 2, 2, 2], "sr_bin_boundaries": [20000, 30000, 40000],
                         "sample_rate": 16000, "out_sample_rate": 48000},
    "max_length": 8192,
}
# CPU tests: VoxCPM2's layout in miniature: "tiny" with a 16 kHz-in / 48 kHz-out AudioVAEV2 (hop 640
# in, 1920 out: 25 latent frames/s); the presets are deep-copied where they are used
PRESETS["tiny-v2"] = {
    **PRESETS["tiny"], "architecture": "voxcpm2",
    "audio_vae_config": {"encoder_dim": 8, "encoder_rates": [2, 5, 8, 8], "latent_dim": 16,
                         "decoder_dim": 64, "decoder_rates": [8, 6, 5, 2, 2, 2], "depthwise": True,
                         "sample_rate": 16000, "out_sample_rate": 48000, "cond_dim": 16},
}


def preset_architecture(preset: str) -> str:
    return PRESETS[preset].get("architecture", "voxcpm")


def preset_config(preset: str, vocab_size: int, dtype: str = "float32"):
    """A ``VoxCPMConfig`` of ``preset`` with the given vocabulary (the tiny preset takes the
    tokenizer's size; ``voxcpm1.5`` keeps its own 73,448 unless ``vocab_size`` is larger).

    Raises:
        ValueError: an unknown preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown VoxCPM preset {preset!r} (known: {', '.join(PRESETS)})")
    raw = copy.deepcopy(PRESETS[preset])
    arch = raw.pop("architecture", "voxcpm")
    raw["lm_config"]["vocab_size"] = max(raw["lm_config"]["vocab_size"], int(vocab_size))
    raw["dtype"] = dtype
    return model_module(arch).VoxCPMConfig.model_validate(raw)


def vae_from_config(vae_config, architecture: str = "voxcpm") -> torch.nn.Module:
    """A random-initialised ``AudioVAE`` (``AudioVAEV2`` for VoxCPM2; weights set by the caller's torch seed)."""
    model_module(architecture)
    from voxcpm.modules.audiovae import AudioVAE, AudioVAEV2

    return (AudioVAEV2 if architecture == "voxcpm2" else AudioVAE)(config=vae_config)


def char_tokenizer():
    """A character tokenizer for random-initialised models (no tokenizer files needed).

    Printable ASCII, one token per character, space as ``▁``; ids below 128 are reserved
    (upstream's audio start/end tokens are 101/102), 0 is ``<unk>``. It is the same whatever the
    data, so a run resumes with the same ids. A pretrained checkpoint brings its own tokenizer.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<reserved_{i}>": i for i in range(3, RESERVED_IDS)})
    for i, c in enumerate(chr(x) for x in range(32, 127)):
        vocab["▁" if c == " " else c] = RESERVED_IDS + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


class TextTokenizer:
    """Text -> ids as upstream's training script makes them (``model.text_tokenizer(text)``:
    the tokenizer's tokens with multi-character Chinese tokens split, no special tokens)."""

    def __init__(self, hf_tokenizer):
        vox = import_voxcpm()
        self.hf = hf_tokenizer
        self._wrapped = vox.mask_multichar_chinese_tokens(hf_tokenizer)

    def __call__(self, text: str) -> list[int]:
        return list(self._wrapped(text))

    def __len__(self) -> int:
        return len(self.hf)


# ---------------------------------------------------------------------------------- model + VAE


def build_model(config, hf_tokenizer, vae: torch.nn.Module, device: str, architecture: str = "voxcpm",
                upstream_lora=None) -> torch.nn.Module:
    """Upstream's ``VoxCPMModel`` (``VoxCPM2Model`` for ``voxcpm2``) for ``config``, with its VAE taken out again.

    The constructor needs a VAE (it reads its chunk size and sample rate) and makes the
    generation KV caches on ``device``; the VAE is then deleted from the module, as upstream's
    training script does before DDP, so it is neither trained nor saved nor all-reduced.
    ``upstream_lora`` (upstream's own ``LoRAConfig``, for bench/bench_voxcpm.py's upstream peer;
    the recipe adapts with ddptrain.lora instead) builds upstream's LoRA layers and freezes every
    other weight, as its ``from_local(training=True, lora_config=...)`` does.
    """
    model = model_class(architecture)(config, hf_tokenizer, vae, upstream_lora, device=str(device))
    del model.audio_vae
    if upstream_lora is not None:
        for name, p in model.named_parameters():
            p.requires_grad_("lora" in name)
    model.architecture = architecture  # save_pretrained writes it back into config.json
    return model


def read_config(path: str, dtype: Optional[str] = None) -> tuple:
    """``(architecture, VoxCPMConfig)`` of a checkpoint folder's config.json (``dtype`` overrides its own).

    Raises:
        FileNotFoundError: no config.json (the folder named).
    """
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path}: no config.json (a VoxCPM checkpoint folder has config.json, "
                                "model.safetensors, audiovae.safetensors/.pth and tokenizer files)")
    arch = folder_architecture(path)
    with open(cfg_file, encoding="utf-8") as f:
        config = model_module(arch).VoxCPMConfig.model_validate_json(f.read())
    if dtype is not None:
        config.dtype = dtype
    return arch, config


def _tensors(path: str, stem: str) -> dict:
    """The state dict of ``stem`` (``model`` or ``audiovae``) in a checkpoint folder, as upstream's loader finds it."""
    from safetensors.torch import load_file

    st = os.path.join(path, stem + ".safetensors")
    pt = os.path.join(path, "audiovae.pth" if stem == "audiovae" else "pytorch_model.bin")
    if os.path.exists(st):
        return load_file(st)
    if os.path.exists(pt):
        obj = torch.load(pt, map_location="cpu", weights_only=True)
        return obj.get("state_dict", obj)
    raise FileNotFoundError(f"{path}: neither {os.path.basename(st)} nor {os.path.basename(pt)}")


def _loaded_vae(config, architecture: str, path: str) -> torch.nn.Module:
    vae = vae_from_config(config.audio_vae_config or None, architecture)
    vae.load_state_dict(_tensors(path, "audiovae"), strict=True)
    return vae


def load_vae(path: str) -> torch.nn.Module:
    """The VAE of a VoxCPM checkpoint folder alone (``AudioVAE`` / ``AudioVAEV2`` by config.json's
    architecture, from its ``audio_vae_config`` and ``audiovae.safetensors`` or ``.pth``), fp32 and
    frozen: the one :func:`load_pretrained` returns, without reading the model's weights (VoxCPM2:
    2.29B parameters) or building the model.

    Raises:
        FileNotFoundError: config.json or the VAE's weights file is missing (named).
        RuntimeError: the VAE's weights do not match its config.
    """
    arch, config = read_config(path)
    return _loaded_vae(config, arch, path).float().eval().requires_grad_(False)


def vae_config(config, architecture: str) -> dict:
    """The VAE's config as upstream builds the VAE from it: config.json's ``audio_vae_config`` with
    every default filled in (upstream's default config when absent), e.g. its input ``sample_rate``."""
    vae_cfg = config.audio_vae_config
    if vae_cfg is None:
        module = model_module(architecture)
        vae_cfg = module.AudioVAEConfigV2() if architecture == "voxcpm2" else module.AudioVAEConfig()
    return json.loads(vae_cfg.model_dump_json())


def vae_digest(vae: torch.nn.Module) -> str:
    """SHA-256 of a VAE's tensors as it holds them (names, dtypes, shapes, bytes): what its latents
    depend on besides its config, whichever file (or random init) they came from."""
    h = hashlib.sha256()
    for name, t in sorted(vae.state_dict().items()):
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_pretrained(path: str, device: str, dtype: str) -> tuple:
    """``(model, vae, hf_tokenizer)`` from a VoxCPM checkpoint folder (e.g. VoxCPM1.5 or VoxCPM2;
    config.json's ``"architecture"`` picks the model class and VAE, as upstream's script does).

    Args:
        path: folder with config.json, model.safetensors (or pytorch_model.bin),
            audiovae.safetensors (or audiovae.pth) and the tokenizer files.
        device: where the model's generation caches go (the Trainer moves the weights).
        dtype: the model's compute dtype for its own casts (``bfloat16`` under bf16 autocast,
            ``float32`` otherwise); overrides config.json's.

    Raises:
        FileNotFoundError: a file is missing (named).
        RuntimeError: the weights do not match the config (missing/unexpected tensors named).
    """
    from transformers import LlamaTokenizerFast

    arch, config = read_config(path, dtype)
    vae = _loaded_vae(config, arch, path)
    hf_tok = LlamaTokenizerFast.from_pretrained(path, local_files_only=True)
    model = build_model(config, hf_tok, vae, device, arch)
    state = {k: v for k, v in _tensors(path, "model").items() if not k.startswith("audio_vae.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{path}: the weights do not match config.json: missing {missing[:8]}, "
                           f"unexpected {unexpected[:8]}")
    return model, vae.float().eval().requires_grad_(False), hf_tok


def save_pretrained(model, vae, hf_tokenizer, path: str) -> None:
    """Write a folder :func:`load_pretrained` (and upstream's ``from_local``) reads."""
    os.makedirs(path, exist_ok=True)
    raw = model.config.model_dump(exclude_none=True)  # upstream's `kv_channels: int = None` refuses an explicit null
    arch = getattr(model, "architecture", "voxcpm")
    if arch == "voxcpm2":  # upstream's marker, which its script and this recipe read to pick VoxCPM2Model
        raw["architecture"] = arch
    else:
        raw["audio_vae_config"] = vae_config_dict(vae)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=1)
    save_weights(model.state_dict(), os.path.join(path, "model.safetensors"))  # the files the umask allows (0644)
    save_weights(vae.state_dict(), os.path.join(path, "audiovae.safetensors"))
    hf_tokenizer.save_pretrained(path)


def vae_config_dict(vae) -> dict:
    return {"encoder_dim": vae.encoder_dim, "encoder_rates": list(vae.encoder_rates), "latent_dim": vae.latent_dim,
            "decoder_dim": vae.decoder_dim, "decoder_rates": list(vae.decoder_rates), "depthwise": vae.depthwise,
            "sample_rate": int(vae.sample_rate), "use_noise_block": vae.use_noise_block}


def output_rate(vae) -> int:
    """The rate of the VAE's decoded audio (VoxCPM2's 48 kHz; VoxCPM's is its input rate)."""
    return int(getattr(vae, "out_sample_rate", vae.sample_rate))


def frame_rate(vae_config) -> float:
    """Latent frames per second of audio."""
    return vae_config.sample_rate / math.prod(vae_config.encoder_rates)


# ---------------------------------------------------------------------------------- sequences


@torch.no_grad()
def encode_latents(vae, wave: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``(frames, latent_dim)`` latents of a mono waveform at the VAE's rate, as upstream's
    packer makes them: the audio right-padded to whole patches, then the VAE encoder's mean."""
    patch_len = int(vae.hop_length) * patch_size
    x = wave.reshape(1, 1, -1).float()
    if x.shape[-1] % patch_len:
        x = torch.nn.functional.pad(x, (0, patch_len - x.shape[-1] % patch_len))
    z = vae.encode(x.to(next(vae.parameters()).device), vae.sample_rate)  # (1, D, T)
    return z[0].transpose(0, 1).float().cpu()


def pack_utterance(text_ids: Sequence[int], latents: torch.Tensor, patch_size: int,
                   ref_latents: Optional[torch.Tensor] = None) -> dict:
    """One TTS training sequence, upstream's layout (``process_tts_data``, no reference audio):

    ``text ids, 101, one position per latent patch, 102``; audio features at the patch
    positions; the loss on the patch positions; the stop label 1 on the last patch. With
    ``ref_latents`` (VoxCPM2's ``ref_audio``) upstream's ``process_tts_data_with_ref`` layout:
    ``103, one position per reference patch, 104`` in front, its features in, no loss on it.

    Args:
        text_ids: the text's token ids.
        latents: ``(frames, D)``, frames a multiple of ``patch_size``.
        patch_size: latent frames per LM position.
        ref_latents: ``(ref frames, D)`` of the reference recording, or None.

    Returns:
        Tensors of length S = [ref patches + 2 +] len(text_ids) + patches + 2: ``text_tokens``,
        ``text_mask``, ``audio_mask``, ``loss_mask``, ``labels`` (int32) and ``audio_feats`` (S, P, D).
    """
    frames, dim = latents.shape
    if frames % patch_size:
        raise ValueError(f"{frames} latent frames are not whole patches of {patch_size}")
    if ref_latents is not None:
        ref = pack_reference(ref_latents, patch_size)
        seq = pack_utterance(text_ids, latents, patch_size)
        return {k: torch.cat([ref[k], seq[k]]) for k in seq}
    a, t = frames // patch_size, len(text_ids) + 1
    s = t + a + 1
    text = torch.zeros(s, dtype=torch.int32)
    text[: t - 1] = torch.as_tensor(list(text_ids), dtype=torch.int32)
    text[t - 1], text[-1] = AUDIO_START, AUDIO_END
    feats = torch.zeros(s, patch_size, dim, dtype=torch.float32)
    feats[t:t + a] = latents.float().reshape(a, patch_size, dim)
    audio = torch.zeros(s, dtype=torch.int32)
    audio[t:t + a] = 1
    text_mask = 1 - audio
    labels = torch.zeros(s, dtype=torch.int32)
    labels[-2] = 1
    return {"text_tokens": text, "text_mask": text_mask, "audio_mask": audio, "loss_mask": audio.clone(),
            "labels": labels, "audio_feats": feats}


def pack_reference(ref_latents: torch.Tensor, patch_size: int) -> dict:
    """The ``103, reference patches, 104`` prefix of a VoxCPM2 sequence (no loss, no stop label)."""
    frames, dim = ref_latents.shape
    if frames % patch_size:
        raise ValueError(f"{frames} reference latent frames are not whole patches of {patch_size}")
    r = frames // patch_size
    text = torch.zeros(r + 2, dtype=torch.int32)
    text[0], text[-1] = REF_START, REF_END
    audio = torch.zeros(r + 2, dtype=torch.int32)
    audio[1:-1] = 1
    feats = torch.zeros(r + 2, patch_size, dim, dtype=torch.float32)
    feats[1:-1] = ref_latents.float().reshape(r, patch_size, dim)
    zeros = torch.zeros(r + 2, dtype=torch.int32)
    return {"text_tokens": text, "text_mask": 1 - audio, "audio_mask": audio, "loss_mask": zeros,
            "labels": zeros.clone(), "audio_feats": feats}


@torch.no_grad()
def synthesize(model, vae, text_ids: Sequence[int], max_patches: int, timesteps: int = 10, cfg_value: float = 2.0,
               seed: int = 0) -> torch.Tensor:
    """Speak ``text_ids`` (no prompt audio): upstream's ``_inference`` loop, then the VAE.

    Runs under a forked RNG, so training's random stream is untouched.

    Returns:
        The waveform at the VAE's rate, float32 on the CPU, shape ``(samples,)``.
    """
    vox = model_module(getattr(model, "architecture", "voxcpm"))
    device = next(model.parameters()).device
    p, d = model.patch_size, model.feat_dim
    tokens = torch.tensor([*text_ids, AUDIO_START], dtype=torch.long, device=device)[None]
    n = tokens.shape[1]
    feats = torch.zeros(1, n, p, d, device=device, dtype=vox.get_dtype(model.config.dtype))
    text_mask = torch.ones(1, n, dtype=torch.int32, device=device)
    audio_mask = torch.zeros(1, n, dtype=torch.int32, device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        latents = vox.next_and_close(model._inference(tokens, text_mask, feats, audio_mask, min_len=2,
                                                         max_len=int(max_patches), inference_timesteps=timesteps,
                                                         cfg_value=cfg_value))[0]  # v2 yields 3 values
    vae_device = next(vae.parameters()).device
    wave = vae.decode(latents.to(vae_device, torch.float32))
    return wave.reshape(-1).float().cpu()


def peak_normalise(wave: np.ndarray, peak: float = 0.9) -> np.ndarray:
    m = float(np.abs(wave).max()) if wave.size else 0.0
    return wave * (peak / m) if m > 0 else wave
