"""ddptrain: plain-PyTorch distributed training for speech models."""
