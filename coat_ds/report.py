"""`python -m coat_ds.report`: this environment and what each compiled op will do in it, as one Markdown table
to paste into a bug report (like DeepSpeed's `ds_report`). It builds nothing unless asked to (`--build`)."""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import platform
import sys

import torch

# environment variables that change what coat_ds runs; listed when set
SETTINGS = ("COAT_DISABLE_OPS", "COAT_ACT_REFERENCE", "COAT_BUILD_OPS", "TORCH_CUDA_ARCH_LIST", "DS_ACCELERATOR")


def _dist(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def versions(*extra: str) -> dict[str, str | None]:
    """What results files record as `versions`: python, torch, CUDA (None on a CPU build), coat_ds, DeepSpeed,
    transformers and each distribution named in `extra` (benchmarks/common.py adds the rest)."""
    import coat_ds

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "coat_ds": coat_ds.__version__, **{name: _dist(name) for name in ("deepspeed", "transformers", *extra)}}


def _versions() -> list[tuple[str, str]]:
    import coat_ds
    from torch.utils.cpp_extension import CUDA_HOME

    from .deepspeed.fence import summary

    v = versions()
    return [("python", f"{v['python']} ({sys.executable})"),
            ("coat_ds", f"{v['coat_ds']} ({os.path.dirname(coat_ds.__file__)})"),
            ("torch", f"{v['torch']} ({os.path.dirname(torch.__file__)})"),
            ("CUDA (PyTorch's)", v["cuda"] or "none: a CPU build of PyTorch"),
            ("CUDA toolkit", CUDA_HOME or "not found"),
            ("DeepSpeed", v["deepspeed"]),
            ("DeepSpeed internals", summary()),
            ("transformers", v["transformers"])]


def _hardware() -> list[tuple[str, str]]:
    from deepspeed.accelerator import get_accelerator

    from .activation.gemm import FP8_GEMM_CAPABILITY

    acc = get_accelerator()
    rows = [("accelerator", f"{acc.device_name()} (DeepSpeed's; fp16: {_yes(acc.is_fp16_supported())}, "
                            f"bf16: {_yes(acc.is_bf16_supported())})"),
            ("CPU", f"{platform.machine()}, {os.cpu_count()} cores")]
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    gpus = [f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})" for i, (major, minor) in enumerate(caps)]
    need = "sm_{}{}+".format(*FP8_GEMM_CAPABILITY)
    fp8 = [_yes(cap >= FP8_GEMM_CAPABILITY) for cap in caps]
    rows += [("GPUs", "; ".join(gpus) or "none"),
             (f"FP8 GEMMs ({need})", "; ".join(fp8) + ("" if all(fp8) else "; without them the GEMMs run in bf16")
              if caps else "no GPU")]
    return rows


def _ops(build: bool) -> list[tuple[str, str]]:
    from torch.utils.cpp_extension import is_ninja_available

    from .op_builder import ALL_OPS
    from .kernels.loader import load_op, op_status

    jit_root = os.path.dirname(next(iter(ALL_OPS.values()))().jit_dir())
    rows = [("ninja (JIT builds)", _yes(is_ninja_available())), ("JIT cache", jit_root), _locks(jit_root)]
    for name, cls in ALL_OPS.items():
        status = op_status(cls.__name__)
        runs = status.runs
        if build and not runs.startswith("reference"):
            module = load_op(cls.__name__)
            runs = "kernel (loaded)" if module is not None else "reference: its build failed (see the warning)"
            if hasattr(module, "simd"):
                runs += f", {module.simd()} code path"
        doc = f" · {cls.__doc__}" if cls.__doc__ else ""
        rows.append((f"op {name}", f"built: {status.built}; compatible: {_yes(status.problem is None)}; "
                                   f"runs: {runs}{doc}"))
    return rows


def _locks(jit_root: str) -> tuple[str, str]:
    """torch's JIT lock files in the cache: a build running now, or one stopped mid-way (jit_lock.py)."""
    from .op_builder.jit_lock import TORCH_LOCK

    found = sorted(glob.glob(os.path.join(jit_root, "*", TORCH_LOCK)))
    return ("JIT locks", "none" if not found else f"{', '.join(found)}: a build running now, or one stopped mid-way "
            "(coat_ds's ops remove theirs as they load; DeepSpeed's wait for them: remove them if no build runs)")


def rows(build: bool = False) -> list[tuple[str, str]]:
    """(item, value) rows of the report; `build` JIT-builds and loads the ops that can build here."""
    settings = ", ".join(f"{k}={os.environ[k]}" for k in SETTINGS if k in os.environ) or "none"
    return [*_versions(), *_hardware(), *_ops(build), ("settings", settings)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coat_ds.report", description=__doc__)
    parser.add_argument("--build", action="store_true",
                        help="JIT-build (about a minute each) and load every op that can build here")
    table = rows(parser.parse_args(argv).build)
    width = max(len(item) for item, _ in table)
    print(f"| {'coat_ds report':<{width}} | |\n|{'-' * (width + 2)}|---|")
    for item, value in table:
        print(f"| {item:<{width}} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
