"""The engine on the CUDA kernels, executed on CPU: an emulated build of ``gaengine._C`` and the switch to use it.

``build()`` compiles what ``setup.py``'s ``CUDAExtension`` compiles, ``csrc/*.cpp`` + ``csrc/cuda/cuda_ops.cu`` in the
CUDA configuration (``GAENGINE_WITH_CUDA``: the ops' CUDA kernels, which ``torch.ops.<namespace>.*`` and
``HotPath`` dispatch to), with g++ as C++ against the shim (``include/``, first on the include path),
into a separate module ``gaengine_emu_C`` (``torch.utils.cpp_extension.load``, ninja). What makes it build on CPU:

* ``cuda_ops.cu`` is copied as ``src/cuda/cuda_ops.cpp`` next to ``kernels.cuh`` and its ``kernels/*.cuh``
  rewritten by ``rewrite.py`` (``rewrite_tree``: the ``<<<...>>>`` launches; ``cuda_ops.cu`` itself has none), a
  ``#line`` directive pointing reports at the original;
* ``torch_include/`` (searched before torch's headers): stubs of ``c10/cuda/CUDAStream.h`` (the current stream is
  the shim's null stream) and ``CUDAGuard.h`` (a no-op), and ``gaengine_emu_build.h``, force-included, which
  defines ``GAENGINE_WITH_CUDA`` and ``GAENGINE_EMULATED_CUDA``: ``csrc/op_library.h`` then makes
  ``GAENGINE_IS_CUDA_TENSOR(t)`` ``t.is_cpu()`` (the device test of every contract in ``cuda_ops.cu`` and of the
  kernel ``HotPath`` dispatches to) and registers the CUDA kernels under the CPU dispatch key of the module's own
  namespace (``csrc/module.cpp`` registers no CPU kernels there), so CPU tensors stand in for CUDA ones
  (``torch.ops.<namespace>.*`` and ``HotPath`` run the CUDA kernels on them) and a meta tensor is "not a CUDA
  tensor";
* the shim's flags (``-ffp-contract=off -fno-strict-aliasing``, ``-fsanitize=alignment``: a misaligned 128-bit
  access aborts), ``-fvisibility=hidden`` (nothing interposes between this module and ``gaengine._C``), ``-O1``.

``hot_path.cpp``'s streams are device-generic (``c10::impl::getDeviceGuardImpl``, ``c10::Event``,
``recordDataPtrOnStream``): on CPU tensors the one CPU stream, so they do nothing.

``use(monkeypatch, module)`` points ``gaengine.backends._EMULATED_CUDA_MODULE`` (the one test hook) at the module,
with fresh backend caches: ``backend="cuda"`` on a CPU device is then a ``CompiledBackend`` over its ops
(``torch.ops.<module.OP_NAMESPACE>``), the native hot path builds its ``HotPath`` (``backend.extension()``), and
``FusedAdamW(backend="cuda")`` runs its ``adamw_step_`` (``CompiledBackend.optimizer_step``). The build is
cached under ``build/cuda_emu_engine`` (ninja rebuilds what changed).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(ROOT, "csrc")
SHIM_INCLUDE = os.path.join(HERE, "include")
TORCH_STUBS = os.path.join(HERE, "torch_include")
KERNELS = os.path.join(CSRC, "cuda", "kernels.cuh")
BUILD_DIR = os.path.join(ROOT, "build", "cuda_emu_engine")
MODULE_NAME = "gaengine_emu_C"
CFLAGS = ["-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fvisibility=hidden",
          "-fsanitize=alignment", "-fno-sanitize-recover=all", "-include",
          os.path.join(TORCH_STUBS, "gaengine_emu_build.h")]
LDFLAGS = ["-fsanitize=alignment"]

sys.path.insert(0, HERE)
import rewrite  # noqa: E402


def sources(build_dir: str = BUILD_DIR, kernels: str = KERNELS) -> list[str]:
    """The translation units, after mirroring ``cuda_ops.cu`` and the rewritten ``kernels`` (the umbrella
    ``kernels.cuh`` and every ``.cuh`` below its directory, or a mutant of that tree) into ``build_dir``."""
    cuda_dir = os.path.join(build_dir, "src", "cuda")
    os.makedirs(cuda_dir, exist_ok=True)
    n_launches = rewrite.rewrite_tree(kernels, cuda_dir, require_caps=True, only_if_changed=True)
    assert n_launches > 0
    ops_path = os.path.join(CSRC, "cuda", "cuda_ops.cu")
    with open(ops_path) as f:
        ops = f.read()
    if "<<<" in ops:
        ops, _ = rewrite.rewrite(ops)
    else:
        ops = f'#line 1 "{ops_path}"\n' + ops
    rewrite._write(os.path.join(cuda_dir, "cuda_ops.cpp"), ops, only_if_changed=True)  # ninja sees nothing new
    return sorted(glob.glob(os.path.join(CSRC, "*.cpp"))) + [os.path.join(cuda_dir, "cuda_ops.cpp")]


def build(build_dir: str = BUILD_DIR, kernels: str = KERNELS, verbose: bool = False):
    """The emulated ``gaengine._C``, built (or rebuilt where its sources changed) and imported; with the
    seconds the build took. ``kernels``: the umbrella ``kernels.cuh`` of the tree to compile (a mutant tree:
    another ``build_dir``). Raises what ``torch.utils.cpp_extension.load`` raises on a compile error.

    One process at a time per ``build_dir`` (a file lock beside it): ``make test``'s pytest-xdist workers and the
    gloo ranks they start share ``build/cuda_emu_engine``, and the rewritten sources are written before torch's own
    build lock is taken; a process that waited finds the module built and loads it.
    A process loads the module once per ``(build_dir, kernels)`` and returns that module to later calls: a second
    ``cpp_extension.load`` of the same name in one process is versioned (``gaengine_emu_C_v1``), which rewrites
    ``build.ninja`` and rebuilds every object, and the next process (version 0) rebuilds them back; gloo ranks
    killed at their join deadline while waiting on such a rebuild left torch's build lock behind."""
    import filelock  # noqa: PLC0415 - torch's own dependency
    from torch.utils import cpp_extension  # noqa: PLC0415

    start = time.perf_counter()
    key = (os.path.abspath(build_dir), os.path.abspath(kernels))
    if key in _LOADED:
        return _LOADED[key], time.perf_counter() - start
    os.makedirs(os.path.dirname(key[0]), exist_ok=True)
    with filelock.FileLock(key[0] + ".lock"):
        module, seconds = _build_locked(build_dir, kernels, verbose, cpp_extension, start)
    _LOADED[key] = module
    return module, seconds


_LOADED: dict = {}  # (build_dir, kernels) -> the module this process loaded from them (build())


def _build_locked(build_dir, kernels, verbose, cpp_extension, start):
    # torch's own build lock (a FileBaton: the file "lock" in the build directory, waited on without end) is taken
    # only inside cpp_extension.load, under this process's file lock: one found here was left by a process killed
    # mid-build, and would make every later build wait forever.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(build_dir, "lock"))
    srcs = sources(build_dir, kernels)
    # "../adamw.h" and "../op_library.h" of cuda_ops.cpp resolve through csrc/cuda; the copy's own directory holds the
    # rewritten kernels.cuh, found first, and its "kernels/*.cuh" beside it (a quoted include looks beside its
    # includer first), so no unrewritten header of csrc/cuda is reached.
    includes = [SHIM_INCLUDE, TORCH_STUBS, os.path.join(CSRC, "cuda"), CSRC]
    module = cpp_extension.load(name=MODULE_NAME, sources=srcs, extra_include_paths=includes,
                                extra_cflags=CFLAGS + [f"-std={cxx_standard()}"],
                                extra_ldflags=LDFLAGS, build_directory=build_dir, verbose=verbose)
    if not module.WITH_CUDA:
        raise RuntimeError(f"{MODULE_NAME} was built without its CUDA kernels: GAENGINE_WITH_CUDA did not reach it")
    return module, time.perf_counter() - start


def cxx_standard() -> str:
    """The C++ standard ``setup.py`` builds ``gaengine._C`` with against the torch imported here (``c++17`` before
    torch 2.14, ``c++20`` from it: its headers refuse C++17), so that the emulated build compiles as the real one does.
    ``cpp_extension.load`` puts its own ``-std=`` before ``extra_cflags``; this one comes after it and wins."""
    import importlib.util  # noqa: PLC0415

    import torch  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("gaengine_setup_for_emu", os.path.join(ROOT, "setup.py"))
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    return setup.cxx_standard(torch.__version__)


def use(monkeypatch, module) -> None:
    """Make ``module`` the cuda backend's extension for the rest of the test (``monkeypatch`` undoes it)."""
    from gaengine import backends  # noqa: PLC0415

    monkeypatch.setattr(backends, "_EMULATED_CUDA_MODULE", module)
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_load_errors", {})
    monkeypatch.setattr(backends, "_announced", set())


if __name__ == "__main__":
    _, seconds = build(verbose=True)
    print(f"{MODULE_NAME}: {seconds:.1f} s")
