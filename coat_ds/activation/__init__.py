"""COAT's FP8 activation flow: config, fused ops (kernels + reference), autograd Functions, modules."""
from .config import ActivationConfig

__all__ = ["ActivationConfig"]
