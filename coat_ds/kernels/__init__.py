"""Compiled kernels behind the signatures of their plain-PyTorch references (falling back to them), one
family per pair of modules: `adam` + `adam_reference` (the FP8 optimizer step), `quant` + `quant_reference`
(the FP8 activation ops, torch.library custom ops through `custom_op`); `loader` builds them."""
from .adam import adamw_step, dequantize, quantize
from .loader import load_op

__all__ = ["adamw_step", "dequantize", "quantize", "load_op"]
