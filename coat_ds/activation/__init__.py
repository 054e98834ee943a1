"""COAT's FP8 activation flow: config, autograd Functions (over the kernels.quant ops), FP8 GEMMs, weight cache."""
from .config import ActivationConfig

__all__ = ["ActivationConfig"]
