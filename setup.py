"""Build gaengine, with the optional compiled extension ``gaengine._C`` from ``csrc/``.

GAENGINE_BUILD_EXT=auto (default): build the extension, and fall back to a pure-Python install with a
warning if the build fails. ``1``: the build must succeed. ``0``: skip it (the ``torch`` and ``triton``
backends still work). torch must be importable at build time: install with
``pip install --no-build-isolation -e .`` after installing torch.

CUDA: when torch is a CUDA build (``torch.version.cuda``) and a toolkit is found (``CUDA_HOME``), the same
module is a ``CUDAExtension`` that also compiles ``csrc/cuda/*.cu`` and defines ``GAENGINE_WITH_CUDA``, so
``gaengine._C`` carries the ``cuda`` backend's ops too (``GAENGINE_BUILD_CUDA=0`` leaves them out).
Architectures come from ``TORCH_CUDA_ARCH_LIST`` (torch's default: the visible GPUs, or its list).
"""

import glob
import os
import sys

from setuptools import setup

BUILD_EXT = os.environ.get("GAENGINE_BUILD_EXT", "auto").strip().lower()
if BUILD_EXT not in ("auto", "0", "1"):
    sys.exit(f"GAENGINE_BUILD_EXT must be auto, 0 or 1, got {BUILD_EXT!r}")

ext_modules, cmdclass = [], {}
if BUILD_EXT != "0":
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        if BUILD_EXT == "1":
            raise
        print(f"gaengine: torch not importable at build time ({exc}); building without gaengine._C")
    else:
        sources = sorted(glob.glob("csrc/*.cpp"))
        with_cuda = (bool(torch.version.cuda) and CUDA_HOME is not None
                     and os.environ.get("GAENGINE_BUILD_CUDA", "1").strip() != "0")
        if sources:
            extra_compile_args = {"cxx": ["-O3", "-std=c++17", "-fopenmp"]}
            extension, define_macros = CppExtension, []
            if with_cuda:  # the same module, plus the cuda backend's kernels (csrc/cuda/README.md)
                sources += sorted(glob.glob("csrc/cuda/*.cu"))
                extra_compile_args["nvcc"] = ["-O3", "-lineinfo"]  # no fast math: the numerics are the contract
                extension, define_macros = CUDAExtension, [("GAENGINE_WITH_CUDA", None)]
            print(f"gaengine: building gaengine._C {'with' if with_cuda else 'without'} CUDA kernels")
            ext_modules.append(
                extension(
                    "gaengine._C",
                    sources,
                    define_macros=define_macros,
                    extra_compile_args=extra_compile_args,
                    extra_link_args=["-fopenmp"],
                )
            )

            class OptionalBuildExtension(BuildExtension):
                """In ``auto`` mode a failed build leaves a working pure-Python install."""

                def run(self):
                    try:
                        super().run()
                    except Exception as exc:  # noqa: BLE001
                        if BUILD_EXT == "1":
                            raise
                        print(f"gaengine: building gaengine._C failed ({exc}); the 'cpu' backend is unavailable")

            cmdclass["build_ext"] = OptionalBuildExtension.with_options(use_ninja=True)

setup(
    packages=["gaengine", "gaengine.kernels"],
    package_dir={"gaengine": "gaengine", "gaengine.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
