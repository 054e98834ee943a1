"""Checkpoints of CoatAdamW engines: what the files hold, read back whole per parameter (files.py), loaded at the
same or another world size (load.py), DeepSpeed's universal form (universal.py), an atomic save (save.py).
CheckpointError, what a refused checkpoint raises, is the name users catch: coat_ds.deepspeed.checkpoint has it."""
from .files import CheckpointError

__all__ = ["CheckpointError"]
