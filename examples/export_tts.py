"""Export a TTS run (examples/finetune_tts.py) in upstream VoxCPM's own layouts, for its inference API.

    # a model folder: config.json, model.safetensors (LoRA adapters merged in), audiovae.safetensors, tokenizer
    python examples/export_tts.py runs/tts_voxcpm2 /models/VoxCPM2-mine
    # a LoRA run's adapter alone, for the base folder it was trained on: the best checkpoint's
    python examples/export_tts.py runs/dialects/scots runs/dialects/scots/adapter --lora --best

Which checkpoint: a checkpoint folder, or a run folder: its newest complete checkpoint, or with
``--best`` the best by the run's ``checkpoint.best_metric`` (keep-best's ranking, e.g.
``loss/mean`` over the eval sources: ``ddptrain.average.select``). With ``ema.enabled``, the EMA
weights when the checkpoint's evaluation measured them (``--weights``, as ``ddptrain-weights``).

A model folder is what upstream's ``VoxCPM(path)`` and ``VoxCPM2Model.from_local(path)`` load:
the files of the run's ``tts.path`` other than its weights (config.json, audiovae.*, tokenizer
files: copied), or for a random init (``tts.preset``) those of the preset, its random VAE
(``tts.vae_seed``: the one the latent cache was encoded with) and the character tokenizer; and
``model.safetensors``: the trained weights, adapters merged (``ddptrain.weights.export_merged``),
in one file (upstream's loader reads no shards).

An adapter (``--lora``) is what upstream's LoRA API loads on top of the base folder:

* ``lora_weights.safetensors``: every ``lora_A`` / ``lora_B`` under the model's own names
  (``base_lm.layers.0.self_attn.q_proj.lora_A``: upstream's LoRALinear keeps nn.Linear's names,
  as ddptrain's does), the file name ``VoxCPM2Model.load_lora_weights(folder)`` looks for;
* ``lora_config.json``: ``{"base_model": the base folder (tts.path), "lora_config": upstream's
  LoRAConfig fields}`` (enable_lm / enable_dit / enable_proj and their target names, r, alpha),
  the file upstream's LoRA WebUI reads. Upstream's LoRAConfig has one r and one alpha and adapts
  layers by their last name inside the LMs, the DiT or the projections; adapters it could not
  rebuild are refused, naming them, since its loader would skip them silently.

Loading one (docs/dialects.md runs this)::

    info = json.load(open("adapter/lora_config.json"))
    tts = VoxCPM(info["base_model"], lora_config=LoRAConfig(**info["lora_config"]), lora_weights_path="adapter",
                 enable_denoiser=False, optimize=False)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import types
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import finetune_tts as ft  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain.average import select  # noqa: E402
from ddptrain.weights import SafetensorsSource, export_adapters, export_merged, weights_file, weights_info  # noqa: E402
from models import voxcpm_tts as vt  # noqa: E402

LORA_WEIGHTS, LORA_CONFIG = "lora_weights.safetensors", "lora_config.json"  # upstream's file names
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
LM_PREFIXES, DIT_PREFIX = ("base_lm.", "residual_lm."), "feat_decoder.estimator."  # where upstream's LoRAConfig reaches


def checkpoint_folder(path: str, best: bool = False) -> str:
    """The checkpoint ``path`` names: itself, a run folder's newest, or (``best``) its best by its best_metric."""
    return select(path, best=1)[0][0] if best else os.path.dirname(weights_file(path))


def run_config(checkpoint: str):
    """The recipe config the checkpoint was saved under (its config.yaml)."""
    return ddptrain.load_config(os.path.join(checkpoint, "config.yaml"), schema=ft.RecipeConfig)


def export_folder(checkpoint: str, out: str, dtype: Optional[str] = None, weights: str = "auto") -> list[str]:
    """Write a model folder upstream's ``from_local`` loads (see the module docstring); the files written."""
    cfg = run_config(checkpoint)
    os.makedirs(out, exist_ok=True)
    if cfg.tts.path:
        for name in sorted(os.listdir(cfg.tts.path)):
            src = os.path.join(cfg.tts.path, name)
            if os.path.isfile(src) and name not in WEIGHT_FILES and not name.startswith(("model-", ".")):
                shutil.copy2(src, os.path.join(out, name))
    else:  # a random init: the preset's config, the VAE of tts.vae_seed and the character tokenizer
        b = ft.build_model(cfg, types.SimpleNamespace(device=torch.device("cpu")))
        vt.save_pretrained(b.model, b.vae, b.tokenizer.hf, out)
    tmp = os.path.join(out, ".export")
    [merged] = export_merged(checkpoint, tmp, dtype, max_shard_gb=1e6, weights=weights)  # one file
    os.replace(merged, os.path.join(out, "model.safetensors"))
    shutil.rmtree(tmp)
    return sorted(os.path.join(out, n) for n in os.listdir(out))


def upstream_lora_config(file: str, architecture: str, dropout: float = 0.0) -> dict:
    """Upstream's ``LoRAConfig`` fields for the adapters in ``file`` (a checkpoint's weights).

    Raises:
        ddptrain.ConfigError: adapters upstream's LoRAConfig cannot rebuild (named): outside the LMs,
            the DiT and the model's own projections, or with more than one rank or alpha.
    """
    scalings = weights_info(file)["lora_scalings"]
    with SafetensorsSource(file) as src:
        ranks = {layer: src.shape(f"{layer}.lora_A")[0] for layer in scalings if f"{layer}.lora_A" in src}
    lm, dit, proj, outside = set(), set(), set(), []
    for layer in ranks:
        last = layer.rsplit(".", 1)[-1]
        if layer.startswith(LM_PREFIXES):
            lm.add(last)
        elif layer.startswith(DIT_PREFIX):
            dit.add(last)
        elif "." not in layer:
            proj.add(layer)
        else:
            outside.append(layer)
    alphas = {round(scalings[layer] * r, 6) for layer, r in ranks.items()}
    if outside or len(set(ranks.values())) != 1 or len(alphas) != 1:
        raise ddptrain.ConfigError(
            f"{file}: upstream's LoRAConfig adapts q/k/v/o-style layers of base_lm/residual_lm, "
            f"feat_decoder.estimator and the top-level projections with one r and one alpha; these adapters do not "
            f"fit it: {outside[:6] or f'ranks {sorted(set(ranks.values()))}, alphas {sorted(alphas)}'}")
    (r,), (alpha,) = set(ranks.values()), alphas
    cfg = {"enable_lm": bool(lm), "enable_dit": bool(dit), "enable_proj": bool(proj), "r": int(r),
           "alpha": int(alpha) if float(alpha).is_integer() else alpha, "dropout": float(dropout)}
    cfg.update({k: sorted(v) for k, v in (("target_modules_lm", lm), ("target_modules_dit", dit),
                                           ("target_proj_modules", proj)) if v})
    vt.model_module(architecture).LoRAConfig.model_validate(cfg)  # upstream accepts it (e.g. an integer alpha)
    return cfg


def export_lora(checkpoint: str, out: str, dtype: Optional[str] = None, weights: str = "auto") -> list[str]:
    """Write ``lora_weights.safetensors`` + ``lora_config.json`` (see the module docstring); the files written.

    Raises:
        ddptrain.ConfigError: the run adapted a random init (no base folder to load it on), or
            :func:`upstream_lora_config`'s.
    """
    cfg = run_config(checkpoint)
    if not cfg.tts.path:
        raise ddptrain.ConfigError(f"{checkpoint} adapted a random init (tts.preset={cfg.tts.preset}), not a model "
                                   "folder upstream can load: export that base with this command first (no --lora) "
                                   "and train the adapters with tts.path set to it")
    lora = upstream_lora_config(weights_file(checkpoint), ft.architecture(cfg), cfg.lora.dropout)
    path = export_adapters(checkpoint, out, LORA_WEIGHTS, dtype, weights)
    info = {"base_model": os.path.abspath(cfg.tts.path), "lora_config": lora}
    with open(os.path.join(out, LORA_CONFIG), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return [path, os.path.join(out, LORA_CONFIG)]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its newest, or --best)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--lora", action="store_true", help="the adapter alone (lora_weights.safetensors, lora_config.json)")
    p.add_argument("--best", action="store_true", help="a run folder's best checkpoint by its checkpoint.best_metric")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast floating tensors")
    p.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                   help="ema: the EMA weights (ema.enabled); model: the trained ones; auto: the EMA when evaluated")
    args = p.parse_args(argv)
    checkpoint = checkpoint_folder(args.checkpoint, args.best)
    files = (export_lora if args.lora else export_folder)(checkpoint, args.out, args.dtype, args.weights)
    print(json.dumps({"checkpoint": checkpoint, "written": files}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
