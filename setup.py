"""Build the CUDA extension `kernels` from kernels.cu and bindings.cpp:

    python setup.py build_ext --inplace

Targets sm_90a (H100/H200: the matmul's wgmma path needs the "a" variant) unless
TORCH_CUDA_ARCH_LIST says otherwise, e.g. TORCH_CUDA_ARCH_LIST="8.0;9.0a". Without 9.0a in the list
the matmul runs its mma.sync kernel everywhere. Where PyTorch has no CUDA or nvcc is missing, nothing is built,
the command exits 0, and the PyTorch paths of train.py, inference.py and test_ops.py still work.
"""
import os
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

if torch.version.cuda is None or CUDA_HOME is None:
    why = "PyTorch was built without CUDA" if torch.version.cuda is None else "nvcc / CUDA_HOME not found"
    print(f"setup.py: {why}: CUDA kernels not built; the PyTorch paths still work.")
    sys.exit(0)

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
# kernels.cu picks the wgmma matmul on a compute-capability-9.0 GPU only when its code was built.
wgmma = ["-DKERNELS_SM90A"] if "9.0a" in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";") else []

setup(
    name="kernels",
    ext_modules=[
        CUDAExtension(
            name="kernels",
            sources=["bindings.cpp", "kernels.cu"],
            # -lineinfo keeps source lines for profilers and compute-sanitizer; no fast-math,
            # so the kernels keep IEEE fp32 semantics like PyTorch's.
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo", *wgmma]},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
