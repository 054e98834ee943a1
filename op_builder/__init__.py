"""DeepSpeed op builders of coat_ds's compiled ops (JIT-built with ninja on first use, or prebuilt by
`COAT_BUILD_OPS=1 pip install --no-build-isolation .`)."""
from .adam import CPUCoatAdamBuilder, CoatAdamBuilder
from .builder import CoatCPUOpBuilder, CoatCUDAOpBuilder
from .coat_quant import CoatQuantBuilder

__all__ = ["CoatAdamBuilder", "CPUCoatAdamBuilder", "CoatCPUOpBuilder", "CoatCUDAOpBuilder", "CoatQuantBuilder"]
