"""The CUDA configuration of ``gaengine._C``, compiled on machines with no GPU and a CPU-only torch.

On a CUDA build of torch, ``setup.py`` makes ``gaengine._C`` a ``CUDAExtension`` over ``csrc/*.cpp`` +
``csrc/cuda/*.cu`` with ``GAENGINE_WITH_CUDA`` defined. Nothing else on CI compiles that configuration
(``csrc/module.cpp``'s ``WITH_CUDA``, ``csrc/cuda/cuda_ops.cu`` with the CUDA kernels of the ``torch.library`` ops
that Python calls and ``csrc/hot_path.cpp`` dispatches to), so a mistake there would only show on the GPU machine,
where it breaks the whole build. This module compiles (``-c``, no link) those translation units with the
machine's host compiler and ``nvcc`` (``sm_90``), with the flags ``torch.utils.cpp_extension.BuildExtension`` would
use, in parallel:

* ``.cpp``: ``$CXX`` (or ``c++`` / ``g++``, as torch's ninja build) + Python's ``CFLAGS CCSHARED`` (without
  ``-g`` / ``-O*``) + ``-DGAENGINE_WITH_CUDA`` + the includes + setup.py's ``cxx`` flags + the flags
  ``BuildExtension`` appends (``-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C``, the ABI flags of
  torch versions that still add them); ``-O0`` for setup.py's ``-O3`` (compile time: the front end finds the
  errors).
* ``.cu``: ``nvcc`` + ``-DGAENGINE_WITH_CUDA`` + the includes + torch's ``COMMON_NVCC_FLAGS`` +
  ``--compiler-options '-fPIC'`` + setup.py's ``nvcc`` flags (``-O3`` replaced by ``-O0``: host side only) + the
  same appended defines + ``-gencode=arch=compute_90,code=sm_90`` + the ``-std`` BuildExtension appends when
  there is none (setup.py gives nvcc none): read from ``cpp_extension.py``, ``c++20`` in torch 2.13.
* includes: ``GAENGINE_EXTRA_CUDA_INCLUDE`` (``os.pathsep``-separated dirs, first: e.g. cuBLAS's, cuSPARSE's and
  cuSOLVER's ``include`` dirs of pip's ``nvidia-cublas``, ``nvidia-cusparse``, ``nvidia-cusolver``, where the
  toolkit has only the compiler), ``include_paths("cuda")`` (a CPU torch has no ``CUDA_HOME``: then
  ``include_paths("cpu")`` + the toolkit's ``include``), Python's include dir, and last a stub dir for the generated
  headers a CPU wheel lacks. ``cuda_ops.cu`` compiles ``wgrad_accumulate_``'s cuBLAS kernel only where
  ``cublas_v2.h`` is found (``__has_include``); ``test_cublas_kernel_compiled_where_the_headers_are`` checks that
  the object calls ``cublasGemmEx`` exactly then (a CI machine with nvcc alone compiles it without).

A compile error fails that source's test with the command and the compiler's stderr. ``test_cross_object_symbols``
then checks with ``nm`` that every ``gaengine::`` function one object calls is defined by another (a declaration
that no longer matches its definition in ``cuda_ops.cu`` links into a ``.so`` that fails at import). Skipped when ``nvcc`` or
the host compiler is not found. The ``.cpp`` files that read no CUDA switch (``CUDA_SWITCHES``, in them or in a csrc
header they include) preprocess to the same text as in the CPU build ``make install`` compiled, so only
``module.cpp`` and the ``.cu`` are compiled here, and the cross-object check takes the other definitions from the
CPU build's ``gaengine._C``. About 45 s on 2 cores, nvcc the critical path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest
from torch.utils import cpp_extension

from tests.helpers import NVCC  # the same nvcc the PTX tests use

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))  # setup.py's glob, in its order
CU_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
CUDA_SWITCHES = ("GAENGINE_WITH_CUDA", "WITH_CUDA")  # the macros setup.py's CUDAExtension defines (and tests)


def _includes_closure(src: str) -> list[str]:
    """``src`` and the csrc files it includes with ``#include "..."``, transitively."""
    seen, todo = [], [os.path.realpath(src)]
    while todo:
        path = todo.pop()
        if path in seen or not os.path.exists(path):
            continue
        seen.append(path)
        with open(path) as f:
            for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.MULTILINE):
                todo.append(os.path.realpath(os.path.join(os.path.dirname(path), name)))
    return seen


def _changes_with_cuda(src: str) -> bool:
    """Whether ``src`` (or a csrc header it includes) reads one of ``CUDA_SWITCHES``: the other ``.cpp`` files
    preprocess to the same text in the CUDA configuration as in the CPU build that ``make install`` compiled and
    linked into the ``gaengine._C`` the suite imports, so compiling them again would check nothing new."""
    for path in _includes_closure(src):
        with open(path) as f:
            if re.search(r"\b(%s)\b" % "|".join(CUDA_SWITCHES), f.read()):
                return True
    return False


CPP_CUDA_SOURCES = [src for src in CPP_SOURCES if _changes_with_cuda(src)]
ARCH_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]  # as torch's _get_cuda_arch_flags for "9.0"
COMPILE_TIMEOUT_S = 600

# The flags of setup.py's extension (kept in step with it by hand: setup.py runs setup() at import).
SETUP_DEFINES = ["-DGAENGINE_WITH_CUDA"]
SETUP_CXX_FLAGS = ["-O3", "-g0", "-std=c++17", "-fopenmp"]
SETUP_NVCC_FLAGS = ["-O3", "-lineinfo"]
SETUP_INCLUDE_DIRS = [os.path.join(ROOT, "csrc")]  # setup.py's CUDAExtension include_dirs ("optim/adamw.h")

# Headers that torch's CMake build generates for its CUDA configuration and a CPU wheel does not ship
# (torch/include has c10/cuda/*.h and ATen/cuda/*.h, but not these). c10/cuda/CUDAMacros.h includes the first
# unconditionally, so without it nothing that includes c10/cuda compiles; ATen/cuda/CUDAContext.h includes the
# second. The stubs hold only what the templates (*.h.in in torch's source tree) define: no shared-library
# export switch (it matters only on Windows), and none of the optional libraries. They live in their own include
# dir, searched last, and are written only when the wheel lacks the header, so a CUDA torch's real ones win.
GENERATED_HEADER_STUBS = {
    "c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n"
    "// Stub of the header torch's CMake build generates (C10_CUDA_BUILD_SHARED_LIBS is only read on Windows).\n",
    "ATen/cuda/CUDAConfig.h": "#pragma once\n"
    "// Stub of the header torch's CMake build generates: no optional library in this compile-only check.\n"
    "#define AT_CUDNN_ENABLED() 0\n"
    "#define AT_CUSPARSELT_ENABLED() 0\n"
    "#define AT_HIPSPARSELT_ENABLED() 0\n"
    "#define AT_ROCM_ENABLED() 0\n"
    "#define AT_MAGMA_ENABLED() 0\n"
    '#define NVCC_FLAGS_EXTRA ""\n',
}


def _find_cxx() -> str | None:
    """The host compiler of torch's ninja build (``$CXX``, else ``c++``), or ``g++``."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    return next((p for p in map(shutil.which, names + ["c++", "g++"]) if p), None)


CXX = _find_cxx()
if NVCC is None or CXX is None:
    pytest.skip(f"needs nvcc and a host C++ compiler (nvcc: {NVCC}, c++: {CXX})", allow_module_level=True)


def _toolkit_include() -> str | None:
    """The CUDA toolkit's include dir: ``$CUDA_HOME``, ``$CUDA_PATH``, nvcc's own ``TOP`` (nvcc may be a
    wrapper script on the PATH), ``/usr/local/cuda``: the first that has ``cuda_runtime.h``."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no TOP from nvcc: the other candidates
        dry = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ TOP=(.+)$", dry.stderr + dry.stdout, re.MULTILINE)
        if m:
            homes.append(m.group(1).strip())
    homes += [os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "/usr/local/cuda"]
    for home in filter(None, homes):
        for inc in (os.path.join(home, "include"), os.path.join(home, "targets", "x86_64-linux", "include")):
            if os.path.isfile(os.path.join(inc, "cuda_runtime.h")):
                return os.path.realpath(inc)
    return None


def _torch_include_paths() -> list[str]:
    try:  # a CUDA torch: exactly CUDAExtension's include_dirs
        return cpp_extension.include_paths(device_type="cuda")
    except (OSError, TypeError, RuntimeError):  # a CPU torch: no CUDA_HOME (_join_cuda_home raises)
        paths = cpp_extension.include_paths()
        inc = _toolkit_include()
        if inc is None:
            pytest.skip(f"no CUDA toolkit include dir with cuda_runtime.h found for {NVCC}")
        return paths + [inc]


def _torch_default_std() -> str:
    """The ``-std`` BuildExtension appends to a flag list with none (``append_std17_if_no_std_present``)."""
    try:
        m = re.search(r"cpp_flag_prefix\s*\+\s*['\"](c\+\+\d+)['\"]", inspect.getsource(cpp_extension))
    except (OSError, TypeError):
        m = None
    return m.group(1) if m else "c++17"


def _with_std(flags: list[str]) -> list[str]:
    return flags if any(f.startswith("-std=") for f in flags) else flags + [f"-std={_torch_default_std()}"]


def _abi_flags() -> list[str]:
    """``-D_GLIBCXX_USE_CXX11_ABI=`` / pybind11 ABI defines, from the torch versions whose BuildExtension adds
    them (2.13 adds none: torch's headers set them)."""
    flags = []
    for name in ("_get_glibcxx_abi_build_flags",):
        fn = getattr(cpp_extension, name, None)
        if fn is not None:
            flags += list(fn())
    return flags


def _python_cflags() -> list[str]:
    """Python's ``CFLAGS CCSHARED`` (setuptools' compiler_so, which torch's ninja build passes), without the
    ``-g`` and ``-O*`` that only cost time here."""
    flags = shlex.split(" ".join(filter(None, (sysconfig.get_config_var("CFLAGS"),
                                               sysconfig.get_config_var("CCSHARED")))))
    return [f for f in flags if f != "-g" and not re.fullmatch(r"-O\w*", f)]


def _python_includes() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths.get("include"), paths.get("platinclude")) if p))


def _extra_includes() -> list[str]:
    return [d for d in os.environ.get("GAENGINE_EXTRA_CUDA_INCLUDE", "").split(os.pathsep) if d]


def _write_stubs(stub_dir: str, include_dirs: list[str]) -> list[str]:
    written = []
    for rel, text in GENERATED_HEADER_STUBS.items():
        if any(os.path.isfile(os.path.join(d, rel)) for d in include_dirs):
            continue
        path = os.path.join(stub_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        written.append(rel)
    return written


def _commands(out_dir: str) -> dict[str, list[str]]:
    """One compile command per translation unit of the CUDAExtension, keyed by its path under the repo."""
    stub_dir = os.path.join(out_dir, "generated_header_stubs")
    includes = SETUP_INCLUDE_DIRS + _extra_includes() + _torch_include_paths() + _python_includes()
    _write_stubs(stub_dir, includes)
    inc_flags = [f"-I{d}" for d in includes + [stub_dir]]
    appended = ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"] + _abi_flags()

    def out(src: str) -> str:
        return os.path.join(out_dir, os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")

    cmds = {}
    for src in CU_SOURCES:  # the longest first
        nvcc_flags = [f if f != "-O3" else "-O0" for f in SETUP_NVCC_FLAGS] + appended
        flags = (cpp_extension.COMMON_NVCC_FLAGS + ["--compiler-options", "-fPIC"] + nvcc_flags + ARCH_FLAGS)
        ccbin = ["-ccbin", os.environ["CC"]] if os.environ.get("CC") else []
        cmds[os.path.relpath(src, ROOT)] = ([NVCC] + SETUP_DEFINES + inc_flags + _with_std(flags) + ccbin
                                            + ["-c", src, "-o", out(src)])
    for src in CPP_CUDA_SOURCES:
        cxx_flags = _with_std([f if f != "-O3" else "-O0" for f in SETUP_CXX_FLAGS] + appended)
        cmds[os.path.relpath(src, ROOT)] = ([CXX] + _python_cflags() + SETUP_DEFINES + inc_flags + cxx_flags
                                            + ["-c", src, "-o", out(src)])
    return cmds


def _compile(cmd: list[str]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return -1, f"timed out after {COMPILE_TIMEOUT_S} s\n{err}", time.monotonic() - t0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile every translation unit in parallel: {source: (returncode, output, seconds, cmd, object)}."""
    out_dir = str(tmp_path_factory.mktemp("cuda_build"))
    cmds = _commands(out_dir)
    workers = max(1, min(len(cmds), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {src: pool.submit(_compile, cmd) for src, cmd in cmds.items()}
        results = {src: fut.result() + (cmd, cmd[-1]) for (src, fut), cmd in zip(futures.items(), cmds.values())}
    for src, (rc, _, secs, _, _) in results.items():
        print(f"{src}: rc={rc} in {secs:.1f} s", file=sys.stderr)
    return results


def _error_excerpt(output: str, limit: int = 12000) -> str:
    """The compiler's output from a little before its first error (torch's headers warn a lot under c++17)."""
    m = re.search(r"(error|Error)\b", output)
    start = 0 if m is None else max(0, output.rfind("\n", 0, max(0, m.start() - 2000)) + 1)
    excerpt = output[start:start + limit]
    return ("[...]\n" if start else "") + excerpt + ("\n[...]" if start + limit < len(output) else "")


def test_sources_found():
    assert CPP_SOURCES and CU_SOURCES, f"no csrc/*.cpp or csrc/cuda/*.cu under {ROOT}"
    # module.cpp registers the CUDA kernels under GAENGINE_WITH_CUDA: the selection must find it
    assert os.path.join(ROOT, "csrc", "module.cpp") in CPP_CUDA_SOURCES, CPP_CUDA_SOURCES


def test_the_selection_sees_a_switch_in_an_included_header(tmp_path):
    """A .cpp that reads no switch itself but includes a header that does is compiled in the CUDA configuration."""
    (tmp_path / "a.cpp").write_text('#include "b.h"\nint f() { return 1; }\n')
    (tmp_path / "b.h").write_text('#pragma once\n#include "c.h"\n')
    (tmp_path / "c.h").write_text("#if defined(GAENGINE_WITH_CUDA)\nint g();\n#endif\n")
    (tmp_path / "d.cpp").write_text('#include "b2.h"\n')
    (tmp_path / "b2.h").write_text("// WITH_CUDAX is another name\n")
    assert _changes_with_cuda(str(tmp_path / "a.cpp"))
    assert not _changes_with_cuda(str(tmp_path / "d.cpp"))


@pytest.mark.parametrize("source", [os.path.relpath(s, ROOT) for s in CU_SOURCES + CPP_CUDA_SOURCES])
def test_compiles_with_cuda(compiled, source):
    rc, output, secs, cmd, _ = compiled[source]
    assert rc == 0, (f"{source} does not compile in the CUDA configuration (GAENGINE_WITH_CUDA, as setup.py's "
                     f"CUDAExtension builds it on a GPU machine); rc={rc} after {secs:.1f} s\n"
                     f"$ {shlex.join(cmd)}\n{_error_excerpt(output)}")


def _symbols(nm: str, obj: str, *args: str) -> set[str]:
    out = subprocess.run([nm, "-C", *args, obj], capture_output=True, text=True, check=True).stdout
    # "<address> <type> <name>" (no address when undefined)
    return {m.group(1) for m in re.finditer(r"^\s*(?:[0-9a-fA-F]+\s+)?[A-Za-z?-]\s+(.+)$", out, re.MULTILINE)}


def test_cross_object_symbols(compiled):
    """Every ``gaengine::`` function an object calls is defined in one of the objects: a declaration in
    ``module.cpp`` (``register_hot_path``) that no longer matches its definition in ``hot_path.cpp`` links into a
    ``.so`` with an undefined symbol, which fails only at import on the GPU machine."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs nm")
    if any(rc != 0 for rc, *_ in compiled.values()):
        pytest.skip("a source does not compile (see test_compiles_with_cuda)")
    objects = [obj for *_, obj in compiled.values()]
    defined = set().union(*(_symbols(nm, o, "--defined-only") for o in objects))
    # The translation units compiled alike in both configurations: their definitions as the CPU build linked them
    # into gaengine._C (its symbol table, hidden ones included; it includes the CPU configuration's module.cpp, whose
    # few definitions are the CUDA one's less the CUDA registrations).
    if len(CPP_CUDA_SOURCES) < len(CPP_SOURCES):
        cpu_build = glob.glob(os.path.join(ROOT, "gaengine", "_C*.so"))
        if not cpu_build:
            pytest.skip("needs the CPU build's gaengine._C (make install) for the sources compiled alike in both")
        defined |= _symbols(nm, cpu_build[0], "--defined-only")
    missing = {}
    for src, (*_, obj) in compiled.items():
        undefined = {s for s in _symbols(nm, obj, "--undefined-only") if s.startswith("gaengine::")}
        if undefined - defined:
            missing[src] = sorted(undefined - defined)
    assert not missing, f"gaengine:: symbols used but defined in no object of the CUDA build: {missing}"
    assert any(s.startswith("gaengine::register_hot_path(") for s in defined), "register_hot_path not defined"


def test_cublas_kernel_compiled_where_the_headers_are(compiled):
    """``cuda_ops.cu`` calls ``cublasGemmEx`` (``wgrad_accumulate_``'s CUDA kernel, registered under the CUDA key)
    exactly when ``cublas_v2.h`` is on the include path; otherwise the op has no compiled CUDA kernel and
    ``gaengine.fusion.register_triton_wgrad`` registers the Triton one."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs nm")
    source = os.path.join("csrc", "cuda", "cuda_ops.cu")
    rc, _, _, cmd, obj = compiled[source]
    if rc != 0:
        pytest.skip("cuda_ops.cu does not compile (see test_compiles_with_cuda)")
    include_dirs = [a[2:] for a in cmd if a.startswith("-I")]
    has_headers = any(os.path.isfile(os.path.join(d, "cublas_v2.h")) for d in include_dirs)
    calls = "cublasGemmEx" in _symbols(nm, obj, "--undefined-only")
    assert calls == has_headers, (f"cublas_v2.h {'found' if has_headers else 'not found'} on the include path, but "
                                  f"the object {'calls' if calls else 'does not call'} cublasGemmEx")
