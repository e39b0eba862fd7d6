"""The optimizer step and where model state lives."""
