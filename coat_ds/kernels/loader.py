"""Loads coat_ds's compiled ops through their DeepSpeed op builders, once per process.

A build that fails (no compiler, no CUDA toolkit) is reported with one warning and the callers fall
back to the plain-PyTorch reference, so a CPU-only machine still trains, only slower."""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from types import ModuleType


def _disabled() -> bool:
    return os.environ.get("COAT_DISABLE_OPS", "0") == "1"


@functools.lru_cache(maxsize=None)
def load_op(builder_name: str) -> ModuleType | None:
    """The compiled module of `coat_ds.op_builder.<builder_name>`, or None (warned once) if it cannot be built.

    COAT_DISABLE_OPS=1 forces the reference path (for tests that compare the two)."""
    if _disabled():
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


@dataclass(frozen=True)
class OpStatus:
    """What load_op would do with one op here, found without building it."""

    built: str  # "prebuilt" (COAT_BUILD_OPS=1), "JIT cache" (an earlier JIT build) or "no"
    problem: str | None  # why it cannot build here; None: it can
    runs: str  # "kernel", "kernel, JIT-built on first use" or "reference: <why>"


def op_status(builder_name: str) -> OpStatus:
    """load_op's decision for `coat_ds.op_builder.<builder_name>`, in the same order, without building."""
    from torch.utils.cpp_extension import is_ninja_available

    from .. import op_builder

    builder = getattr(op_builder, builder_name)()
    problem = builder.incompatibility()
    prebuilt = builder.prebuilt()
    cached = problem is None and not prebuilt and builder.jit_cached() is not None
    built = "prebuilt" if prebuilt else "JIT cache" if cached else "no"
    if _disabled() or problem is not None:
        runs = f"reference: {'COAT_DISABLE_OPS=1' if _disabled() else problem}"
    elif prebuilt:
        runs = "kernel"
    elif not is_ninja_available():
        runs = "reference: ninja is missing (JIT builds need it)"
    else:
        runs = "kernel" if cached else "kernel, JIT-built on first use"
    return OpStatus(built, problem, runs)
