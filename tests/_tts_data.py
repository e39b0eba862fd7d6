"""The shipped espeak-ng dialect corpora (examples/data/dialect/<dialect>), copied in parts for TTS tests."""

import json
import os
import shutil

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "data")
CORPUS = os.path.join(DATA, "dialect", "lancashire")


def copy_split(root: str, split: str, n: int, corpus: str = CORPUS) -> str:
    """The first ``n`` lines of a shipped split of ``corpus`` (a folder of manifests), their audio
    copied under ``root``; the manifest path."""
    os.makedirs(os.path.join(root, "audio", split), exist_ok=True)
    rows = [json.loads(x) for x in open(os.path.join(corpus, f"{split}.jsonl"))][:n]
    for r in rows:
        os.makedirs(os.path.dirname(os.path.join(root, r["audio_filepath"])), exist_ok=True)
        shutil.copy(os.path.join(corpus, r["audio_filepath"]), os.path.join(root, r["audio_filepath"]))
    path = os.path.join(root, f"{split}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path
