"""DeepSpeed op builders of coat_ds's compiled ops (JIT-built with ninja on first use, or prebuilt by
`COAT_BUILD_OPS=1 pip install --no-build-isolation .`). Installed as coat_ds.op_builder (see setup.py)."""
from .adam import CPUCoatAdamBuilder, CoatAdamBuilder
from .builder import CoatCPUOpBuilder, CoatCUDAOpBuilder
from .coat_quant import CoatQuantBuilder

# the ops coat_ds uses: what COAT_BUILD_OPS=1 prebuilds and `python -m coat_ds.report` lists
ALL_OPS = {cls.NAME: cls for cls in (CPUCoatAdamBuilder, CoatAdamBuilder, CoatQuantBuilder)}

__all__ = ["ALL_OPS", "CoatAdamBuilder", "CPUCoatAdamBuilder", "CoatCPUOpBuilder", "CoatCUDAOpBuilder",
           "CoatQuantBuilder"]
