"""The FP8 AdamW step in plain PyTorch (kept here for optim's users; it lives with the kernels it specifies)."""
from ..ops.reference_adam import adamw_step_reference

__all__ = ["adamw_step_reference"]
