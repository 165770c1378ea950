"""Build the CUDA emulation binaries: csrc/cuda/kernels.cuh and its kernels/*.cuh rewritten (rewrite.py), then g++ over
the drivers.

Variants (``VARIANTS``):

* ``o2``:   ``-O2`` + ``-fsanitize=alignment`` (a misaligned 128-bit access aborts): the full case list, fast.
* ``asan``: ``-O1 -g`` + ``-fsanitize=address,undefined`` (out-of-bounds global, heap, stack and ``__shared__``
  accesses, overflows, misalignment; every report aborts).

Both: ``-std=c++17 -ffp-contract=off -fno-strict-aliasing`` (no contraction the source does not write; the
kernels read a ``uint4`` as eight 16-bit values, which nvcc allows), the shim's include dir first, then the
rewritten kernels (``src/kernels.cuh`` and ``src/kernels/*.cuh``), ``csrc/`` (the CPU reference kernels) and torch's
include dir (``c10/util/BFloat16.h``, ``Half.h``; nothing is linked from torch).

From Python: ``build(variant, out_dir, kernels=KERNELS, targets=TARGETS) -> {target: binary path}`` (``kernels``: the
umbrella header; it and every ``.cuh`` below its directory are rewritten, ``rewrite.rewrite_tree``);
``find_cxx()`` (``$CXX``, else ``g++``, ``c++``, ``clang++`` on ``PATH``; None when there is none).
Command line: ``python tests/cuda_emu/build.py --variant o2 --out build/cuda_emu [--kernels PATH]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNELS = os.path.join(ROOT, "csrc", "cuda", "kernels.cuh")
SHIM_INCLUDE = os.path.join(HERE, "include")
TARGETS = ("run_kernels", "shim_selftest")
COMMON_FLAGS = ["-std=c++17", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
                "-Wno-format-zero-length"]
VARIANTS = {
    "o2": ["-O2", "-fsanitize=alignment", "-fno-sanitize-recover=all"],
    "asan": ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
}

sys.path.insert(0, HERE)
import rewrite  # noqa: E402


def find_cxx() -> str | None:
    env = os.environ.get("CXX")
    if env:
        path = shutil.which(shlex.split(env)[0])
        if path:
            return env
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return name
    return None


def torch_include() -> str:
    from torch.utils.cpp_extension import include_paths  # noqa: PLC0415

    return include_paths()[0]


class BuildError(RuntimeError):
    pass


def build(variant: str, out_dir: str, kernels: str = KERNELS, targets=TARGETS, jobs: int = 2) -> dict[str, str]:
    cxx = find_cxx()
    if cxx is None:
        raise BuildError("no C++ compiler ($CXX, g++, c++, clang++)")
    src_dir = os.path.join(out_dir, "src")
    os.makedirs(src_dir, exist_ok=True)
    try:
        rewrite.rewrite_tree(kernels, src_dir, require_caps=True)
    except rewrite.RewriteError as e:
        raise BuildError(f"{kernels}: {e}") from None
    includes = ["-I", SHIM_INCLUDE, "-I", src_dir, "-I", os.path.join(ROOT, "csrc"), "-isystem", torch_include()]
    flags = COMMON_FLAGS + VARIANTS[variant]

    def one(target: str) -> tuple[str, str]:
        binary = os.path.join(out_dir, f"{target}-{variant}")
        cmd = [*shlex.split(cxx), *flags, *includes, os.path.join(HERE, f"{target}.cpp"), "-o", binary]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{shlex.join(cmd)}\n{proc.stderr[-6000:]}")
        return target, binary

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(pool.map(one, targets))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="o2")
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "cuda_emu"))
    parser.add_argument("--kernels", default=KERNELS)
    parser.add_argument("--target", action="append", choices=TARGETS, help="default: all")
    args = parser.parse_args(argv)
    try:
        binaries = build(args.variant, args.out, args.kernels, tuple(args.target or TARGETS))
    except BuildError as e:
        print(e, file=sys.stderr)
        return 1
    for binary in binaries.values():
        print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
