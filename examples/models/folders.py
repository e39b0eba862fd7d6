"""Checks of a downloaded model folder, before any library tries to read it.

transformers and upstream loaders fail on a missing or incomplete folder with messages about
something else ("Repo id must be in the form ...", "install sentencepiece"), so the recipes
check the folder first and say what a downloaded one holds and how to get it.
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

import ddptrain


def download_command(model_id: str) -> str:
    """The command that puts ``model_id`` in ``/models/<name>``: huggingface_hub's CLI (``hf``, installed
    with transformers)."""
    return f"hf download {model_id} --local-dir /models/{model_id.split('/')[-1]}"


def check_model_folder(key: str, path: str, needs: dict[str, Sequence[str]], model_id: str) -> None:
    """Refuse a model folder that is missing or lacks a file the recipe reads.

    Args:
        key: the config key that named the folder (``glmasr.path``).
        path: the folder.
        needs: what a downloaded folder holds: a label -> file name patterns, any one of which will do.
        model_id: the Hugging Face model id the folder is a download of.

    Raises:
        ConfigError: ``path`` is not a folder, or a needed file is not in it; the message lists what a
            downloaded folder holds and the command that downloads it.
    """
    holds = "; ".join(f"{label}" for label in needs)
    how = f"a downloaded {model_id} folder holds {holds}. Download it with: {download_command(model_id)}"
    if not os.path.isdir(path):
        raise ddptrain.ConfigError(f"{key}={path!r} is not a folder: {how}")
    missing = [label for label, patterns in needs.items()
               if not any(glob.glob(os.path.join(glob.escape(path), p)) for p in patterns)]
    if missing:
        raise ddptrain.ConfigError(f"{key}={path!r} lacks {', '.join(missing)}: {how}")
