"""Encode a TTS corpus to VAE latents once, cached next to each manifest (examples/tts_cache.py).

    python examples/prepare_tts.py --config configs/tts_dialect.yaml            # its train/eval/test manifests
    python examples/prepare_tts.py --config configs/tts_voxcpm15.yaml my/train.jsonl my/dev.jsonl \\
        tts.path=/models/VoxCPM1.5
    python examples/prepare_tts.py --config configs/tts_voxcpm2.yaml my/train.jsonl tts.path=/models/VoxCPM2
    # VoxCPM2: each line's ref_audio is encoded too; audio below the VAE's input rate is named and refused

examples/finetune_tts.py does the same itself on rank 0 before training (a no-op once done); this
command prepares the caches beforehand, e.g. on another machine. It reads the model folder's VAE
alone (config.json and audiovae.safetensors or .pth, not the model's weights), once for all the
manifests and only when something needs encoding (or its weights were not hashed yet).
Rerunning is a no-op when nothing changed; the caches are keyed on the VAE's content
(architecture, config, a SHA-256 of its weights), so a moved or copied model folder keeps them.
Bad lines and unreadable audio are named by manifest line (``data.bad_data``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the recipe's config schema and its VAE (the recipe imports the cache, examples/tts_cache.py, not this)
import finetune_tts as ft  # noqa: E402

import ddptrain  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the recipe's YAML config (tts.* names the VAE)")
    p.add_argument("manifests", nargs="*", help="manifests to prepare (default: the config's train/eval/test ones)")
    args, rest = p.parse_known_args(argv)
    words = args.manifests + rest  # key=value overrides may come after the manifests
    manifests = [r for r in words if "=" not in r]
    cfg = ddptrain.load_config(args.config, [r for r in words if "=" in r], schema=ft.RecipeConfig)
    manifests = manifests or ft.config_manifests(cfg)
    if not manifests:
        raise SystemExit("no manifests: name some, or set data.train_manifest in the config")
    ft.prepare_manifests(cfg, manifests)  # the VAE alone, loaded once for them all (and only if needed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
