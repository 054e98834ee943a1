"""coat_ds: FP8 memory-efficient training (COAT) for DeepSpeed."""
from .optim import CoatAdamW
from .inject import inject, revert

__version__ = "0.1.0"
__all__ = ["CoatAdamW", "__version__"]
