"""DeepSpeed integration: `"type": "CoatAdamW"` in configs, ZeRO 0-3 with partition-independent FP8
groups, Offload, checkpoints that resume and re-partition. `import coat_ds` registers everything."""
from .config import CoatSection, coat_section
from .optimizer_type import validate_params
from .registration import initialize, register

__all__ = ["CoatSection", "coat_section", "initialize", "register", "validate_params"]
