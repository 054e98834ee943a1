"""coat_ds: FP8 memory-efficient training (COAT) for DeepSpeed.

`pip install -e ".[dev]"` installs the Python package; the kernels JIT-build (ninja) on first use.
`COAT_BUILD_OPS=1 pip install --no-build-isolation .` pre-builds them, like DS_BUILD_OPS for DeepSpeed.

The checkout keeps DeepSpeed's layout: op_builder/ and csrc/ at the top, and coat_ds/op_builder and
coat_ds/csrc as links to them (as deepspeed/ops/op_builder and deepspeed/ops/csrc are), so a checkout on
PYTHONPATH, an editable install and a wheel all see them as coat_ds.op_builder and coat_ds/csrc, and nothing
but coat_ds lands in site-packages.
"""
import os

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
if os.environ.get("COAT_BUILD_OPS", "0") == "1":
    from op_builder.prebuild import extensions  # the checkout's op_builder/; needs torch (and nvcc) to build

    ext_modules, cmdclass = extensions()

setup(
    name="coat_ds",
    version="0.1.0",
    description="FP8 optimizer states and activations (COAT) for DeepSpeed",
    packages=find_packages(include=["coat_ds", "coat_ds.*"]),  # coat_ds.op_builder through its link
    package_data={"coat_ds": ["csrc/**/*.h", "csrc/**/*.cuh", "csrc/**/*.cpp", "csrc/**/*.cu"]},
    python_requires=">=3.10",
    # the lowest versions something here ran and passed; DeepSpeed also bounded above, by the newest release whose
    # internals coat_ds re-states (coat_ds/deepspeed/fence.py); `.ci/drift newest` watches for breaks
    # (docs/versions.md says what runs where and why each bound)
    install_requires=["torch>=2.11", "deepspeed>=0.19.8,<0.19.9", "transformers>=5.3", "ninja", "pybind11",
                      "tokenizers", "tqdm", "matplotlib", "numpy"],
    extras_require={
        "dev": ["pytest", "pytest-benchmark", "ruff", "accelerate", "datasets"],
        "bench": ["torchao", "bitsandbytes"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
