"""CoatAdamW and its reference step."""
from .coat_adamw import CoatAdamW
from ..kernels.adam_reference import adamw_step_reference

__all__ = ["CoatAdamW", "adamw_step_reference"]
