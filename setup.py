"""Build gaengine, with the optional compiled extension ``gaengine._C`` from ``csrc/``.

GAENGINE_BUILD_EXT=auto (default): build the extension, and fall back to a pure-Python install with a
warning if the build fails. ``1``: the build must succeed. ``0``: skip it (the ``torch`` and ``triton``
backends still work). torch must be importable at build time: install with
``pip install --no-build-isolation -e .`` after installing torch.
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
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        if BUILD_EXT == "1":
            raise
        print(f"gaengine: torch not importable at build time ({exc}); building without gaengine._C")
    else:
        sources = sorted(glob.glob("csrc/*.cpp"))
        if sources:
            ext_modules.append(
                CppExtension(
                    "gaengine._C",
                    sources,
                    extra_compile_args={"cxx": ["-O3", "-std=c++17", "-fopenmp"]},
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
