"""Loads coat_ds's compiled ops through their DeepSpeed op builders, once per process.

A build that fails (no compiler, no CUDA toolkit) is reported with one warning and the callers fall
back to the plain-PyTorch reference, so a CPU-only machine still trains, only slower."""
from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType


@functools.lru_cache(maxsize=None)
def load_op(builder_name: str) -> ModuleType | None:
    """The compiled module of `coat_ds.op_builder.<builder_name>`, or None (warned once) if it cannot be built.

    COAT_DISABLE_OPS=1 forces the reference path (for tests that compare the two)."""
    if os.environ.get("COAT_DISABLE_OPS", "0") == "1":
        return None
    try:
        from .. import op_builder

        builder = getattr(op_builder, builder_name)()
        reason = builder.incompatibility()
        if reason is not None:
            raise RuntimeError(f"{builder.name} cannot build here: {reason}")
        return builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
        warnings.warn(f"coat_ds: could not build {builder_name} ({type(exc).__name__}: {exc}); "
                      "using the plain-PyTorch reference instead (slow)", RuntimeWarning, stacklevel=2)
        return None
