"""coat_ds: FP8 memory-efficient training (COAT) for DeepSpeed."""
from .optim import CoatAdamW
from .hf import inject, revert
from .deepspeed import register as _register_deepspeed

_register_deepspeed()  # "type": "CoatAdamW" in DeepSpeed configs, ZeRO support, partition layouts

__version__ = "0.1.0"
__all__ = ["CoatAdamW", "inject", "revert", "__version__"]
