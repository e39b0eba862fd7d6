"""The shipped espeak-ng dialect corpus (examples/data/dialect), copied in parts for TTS tests."""

import json
import os
import shutil

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "data", "dialect")


def copy_split(root: str, split: str, n: int) -> str:
    """The first ``n`` lines of a shipped split, their audio copied under ``root``; the manifest path."""
    os.makedirs(os.path.join(root, "audio", split), exist_ok=True)
    rows = [json.loads(x) for x in open(os.path.join(CORPUS, f"{split}.jsonl"))][:n]
    for r in rows:
        shutil.copy(os.path.join(CORPUS, r["audio_filepath"]), os.path.join(root, r["audio_filepath"]))
    path = os.path.join(root, f"{split}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path
