"""ddptrain: plain-PyTorch distributed training for speech models.

Public API: :class:`Trainer`, :class:`Config` and :func:`load_config`, :func:`setup_distributed`,
:func:`load_weights` / :func:`save_weights`, loading large models without a full fp32 copy
(:func:`empty_weights` + :func:`load_pretrained`; weights files and exports: :mod:`ddptrain.weights`),
LoRA (:func:`apply_lora`, :func:`merge_lora`, :func:`lora_state_dict`; more in :mod:`ddptrain.lora`),
the head-sized loss of causal LMs (:func:`causal_lm_loss`), WER/CER counting in
:mod:`ddptrain.metrics`, and the speech data pieces in :mod:`ddptrain.data`.
"""

from ddptrain.checkpoint import CheckpointError
from ddptrain.config import Config, ConfigError, load_config
from ddptrain.contract import TrainingError
from ddptrain.dist import DistInfo
from ddptrain.dist import setup_for as _setup_for
from ddptrain.lora import apply_lora, lora_state_dict, merge_lora
from ddptrain.losses import causal_lm_loss
from ddptrain.trainer import Trainer
from ddptrain.weights import empty_weights, load_pretrained, load_weights, save_weights

__version__ = "0.1.0"


def setup_distributed(config: Config) -> DistInfo:
    """Join the process group now (idempotent; the Trainer calls it too).

    Call it before building rank-aware data loaders, so samplers can read the rank and world size.
    """
    return _setup_for(config)


__all__ = ["Trainer", "TrainingError", "Config", "ConfigError", "load_config", "setup_distributed",
           "load_weights", "save_weights", "CheckpointError", "DistInfo", "empty_weights", "load_pretrained",
           "apply_lora", "merge_lora", "lora_state_dict", "causal_lm_loss"]
