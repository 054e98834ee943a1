"""COAT's FP8 activation flow: config, fused ops (kernels + reference), autograd Functions, modules."""
from .config import ActivationConfig
from .layer import CoatDecoderLayer

__all__ = ["ActivationConfig", "CoatDecoderLayer"]
