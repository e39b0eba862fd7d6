"""ddptrain: plain-PyTorch distributed training and fine-tuning for speech models."""

from setuptools import find_packages, setup

setup(
    name="ddptrain",
    version="0.1.0",
    description="Plain-PyTorch DDP training loop for speech models: AMP, checkpointing, ZeRO, bucketing",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ddptrain", "ddptrain.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch==2.11.0",
        "torchaudio==2.11.0",
        "numpy",
        "soundfile",
        "safetensors",
        "tensorboard",
        "omegaconf>=2.3",
        "tqdm",
    ],
    # transformers: the GLM-ASR and Whisper/wav2vec2 recipes (examples/) and their tests; ddptrain never imports it.
    # accelerate: transformers 5's Trainer refuses to run without it (the HF peers and parity checks in bench/, tests/)
    # einops, pydantic: what VoxCPM's model code needs (the TTS recipe); `make install` adds voxcpm itself with
    # --no-deps, since its declared dependencies are its whole TTS app (gradio, funasr, modelscope, ...)
    extras_require={"dev": ["pytest", "pytest-timeout", "transformers>=5.0", "accelerate>=1.1", "einops",
                            "pydantic>=2"]},
    # the `python -m ddptrain.X` tools as commands (tests/test_entry_points.py: one per tool, each target callable)
    entry_points={"console_scripts": [
        "ddptrain-average = ddptrain.average:main",
        "ddptrain-config = ddptrain.config:main",
        "ddptrain-features = ddptrain.data.features:main",
        "ddptrain-memory = ddptrain.memory:main",
        "ddptrain-shards = ddptrain.data.shards:main",
        "ddptrain-tune = ddptrain.tune:main",
        "ddptrain-validate = ddptrain.data.validate:main",
        "ddptrain-weights = ddptrain.weights:main",
    ]},
    license="Apache-2.0",
)
