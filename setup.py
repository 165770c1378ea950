"""Build gaengine and its compiled extension ``gaengine._C`` from ``csrc/`` (required: it holds the per-parameter
hooks of every backend, ``csrc/hot_path.cpp``).

GAENGINE_BUILD_EXT=auto (default): if the build with CUDA kernels fails, build the CPU ops alone, with a line
saying why; if that fails too, the install fails, naming the error. ``1``: the first configuration must build (no
retry). torch must be importable at build time: install with ``pip install --no-build-isolation -e .`` after
installing torch, and a C++17 compiler must be on PATH.

CUDA: when torch is a CUDA build (``torch.version.cuda``) and a toolkit is found (``CUDA_HOME``), both CUDA
>= 12.1, the same module is a ``CUDAExtension`` that also compiles ``csrc/cuda/*.cu`` and defines
``GAENGINE_WITH_CUDA``, so ``gaengine._C`` carries the ``cuda`` backend's ops too (``GAENGINE_BUILD_CUDA=0``
leaves them out). An older toolkit or torch gets the CPU ops alone, and a line that says so: the multi-tensor
kernels pass up to 27.7 KB of kernel parameters by value (``csrc/cuda/README.md``). Architectures come from
``TORCH_CUDA_ARCH_LIST`` (torch's default: the visible GPUs, or its list).

Progress: ninja prints a ``[k/n]`` line as each source file is compiled, and while one is still compiling (a
file can take minutes on a busy 2-core machine), a line every ``HEARTBEAT_S`` seconds names the files not yet
compiled and the time so far (``BuildHeartbeat``); ``make install`` shows both.

setuptools runs this file as ``__main__``; importing it under another name (the tests) defines the helpers
and builds nothing.
"""

import copy
import glob
import os
import re
import subprocess
import sys
import threading
import time

from setuptools import setup

# The multi-tensor kernels' parameter structs (20.5 KB bucket, 27.7 KB AdamW) need the 32764-byte kernel
# parameter limit of CUDA 12.1, in the toolkit that compiles them and the driver that launches them.
MIN_CUDA = (12, 1)
# -g0: no debug information (Python's own CFLAGS, which setuptools puts first, carry -g): it does not change the code
# generated, and it was a third of the compile's CPU time (csrc/hot_path.cpp: 109 s of CPU with it, 70 s without;
# gaengine._C 27.6 MB with it, 1.1 MB without). -O3 stays: -O2 compiled hot_path.cpp no faster (46 s against 47 s).
CXX_FLAGS = ["-O3", "-g0", "-fopenmp"]  # + "-std=" + cxx_standard(torch.__version__)
NVCC_FLAGS = ["-O3", "-lineinfo"]  # no fast math: the numerics are the contract
LINK_FLAGS = ["-fopenmp"]
# The torch versions gaengine supports (pyproject.toml's dependency, docs/install.md): the oldest a GPU image is
# likely to ship, up to the newest whose headers `make torch-range` compiles csrc/ against.
TORCH_FLOOR = (2, 9)
TORCH_CEILING = (2, 15)  # exclusive
TORCH_SPEC = f"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]},<{TORCH_CEILING[0]}.{TORCH_CEILING[1]}"
# Seconds between two progress lines while the build is silent (a file compiling, the link): 30 at most, so
# that a build that takes minutes per file never looks hung.
HEARTBEAT_S = 30.0


def parse_cuda_version(text):
    """``(major, minor)`` from ``nvcc --version``'s ``release 12.4, V12.4.131`` or a bare ``12.4``
    (``torch.version.cuda``); ``None`` when ``text`` is ``None`` or holds neither."""
    if not text:
        return None
    match = re.search(r"release (\d+)\.(\d+)", text) or re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)*\s*", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def nvcc_version_output(cuda_home):
    """The stdout of ``$cuda_home/bin/nvcc --version``, or ``None`` when there is no toolkit or it cannot run."""
    if not cuda_home:
        return None
    try:
        done = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                              text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def cuda_build_decision(torch_cuda, cuda_home, nvcc_output, build_cuda="1"):
    """Whether ``gaengine._C`` gets its CUDA kernels: ``(with_cuda, why)``, ``why`` the line setup prints.

    torch_cuda: ``torch.version.cuda`` (``None`` for a CPU torch). cuda_home: torch's ``CUDA_HOME`` or ``None``.
    nvcc_output: ``nvcc --version``'s stdout (``nvcc_version_output``). build_cuda: ``GAENGINE_BUILD_CUDA``.
    Pure: runs nothing, so the tests call it with made-up versions.
    """
    need = "%d.%d" % MIN_CUDA
    if build_cuda.strip() == "0":
        return False, "without CUDA kernels (GAENGINE_BUILD_CUDA=0)"
    if not torch_cuda:
        return False, "without CUDA kernels (torch is a CPU-only build)"
    if not cuda_home:
        return False, (f"without CUDA kernels (torch is a CUDA {torch_cuda} build, but no CUDA toolkit was found: "
                       "set CUDA_HOME)")
    why_needed = (f"the multi-tensor kernels pass up to 27.7 KB of kernel parameters by value, which needs CUDA >= "
                  f"{need}; building the CPU ops alone (the 'cuda' backend will be unavailable; 'triton' runs on "
                  f"CUDA tensors). Install CUDA >= {need} and reinstall to get them")
    toolkit = parse_cuda_version(nvcc_output)
    if toolkit is None:
        return False, (f"without CUDA kernels: could not read the CUDA toolkit version from {cuda_home}/bin/nvcc "
                       f"--version; {why_needed}")
    if toolkit < MIN_CUDA:
        found = f"{toolkit[0]}.{toolkit[1]}"
        return False, f"without CUDA kernels: the CUDA toolkit at {cuda_home} is {found}; {why_needed}"
    runtime = parse_cuda_version(torch_cuda)
    if runtime is None or runtime < MIN_CUDA:
        return False, f"without CUDA kernels: torch is built with CUDA {torch_cuda}; {why_needed}"
    return True, f"with CUDA kernels (toolkit {toolkit[0]}.{toolkit[1]}, torch built with CUDA {torch_cuda})"


def torch_version_problem(version):
    """Why gaengine cannot be built against torch ``version`` (``torch.__version__``, e.g. ``2.13.0+cpu`` or
    ``2.10.0a0+git1234``): a message for a torch older than :data:`TORCH_FLOOR` or unreadable, None otherwise. A
    torch at or past :data:`TORCH_CEILING` is built against (the caller warns): only the older one is refused."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        return f"gaengine: cannot read torch's version {version!r}; gaengine supports {TORCH_SPEC}"
    found = (int(match.group(1)), int(match.group(2)))
    if found < TORCH_FLOOR:
        return (f"gaengine needs {TORCH_SPEC}, found torch {version}: its compiled extension and its FSDP2, "
                "collective and autograd paths use APIs older torch releases lack. Install a supported torch first "
                f"(pip install '{TORCH_SPEC}', from the CUDA wheel index for a GPU build), then gaengine again")
    return None


def cxx_standard(version):
    """The C++ standard gaengine._C is compiled with against torch ``version``: ``c++20`` from torch 2.14 (its
    headers stop with ``#error C++20 or later compatible compiler is required``), ``c++17`` before (as built and
    tested since the extension exists)."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return "c++20" if match and (int(match.group(1)), int(match.group(2))) >= (2, 14) else "c++17"


def build_with_fallback(attempts, strict, log=print):
    """Run ``attempts``, ``[(what, build)]`` in order of preference, until one ``build()`` returns; the ``what``
    built. ``strict`` (``GAENGINE_BUILD_EXT=1``): the first failure raises. Each failure is logged with the next
    step; when every one failed, ``RuntimeError`` naming the last failure and how to go on (gaengine needs
    ``gaengine._C``)."""
    for i, (what, build) in enumerate(attempts):
        try:
            build()
        except Exception as exc:  # noqa: BLE001 - any build failure leaves the next configuration to try
            if strict:
                raise
            if i + 1 == len(attempts):
                raise RuntimeError(
                    f"gaengine: building gaengine._C {what} failed ({exc}); gaengine needs it (its per-parameter "
                    "hooks are C++). Install a C++17 compiler (g++ or clang++) and torch first, then reinstall with "
                    "`pip install --no-build-isolation -e .` (the compiler's error is above)") from exc
            log(f"gaengine: building gaengine._C {what} failed ({exc}); retrying {attempts[i + 1][0]}")
        else:
            return what
    raise ValueError("build_with_fallback needs at least one (what, build) attempt")


def format_elapsed(seconds):
    """``45 s``, ``1 min 30 s``: a duration in whole seconds, as the build's progress lines give it."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def compile_progress(sources, build_temp, since, elapsed_s, obj_extension=".o", most=2):
    """The build's progress line: which of ``sources`` are not compiled yet, ``elapsed_s`` into the build.

    sources: the extension's source paths as setuptools holds them (``csrc/hot_path.cpp``). build_temp: the folder
    the objects go to, ``<build_temp>/<source without its extension><obj_extension>``, as setuptools' compiler names
    them. since: the build's start (``time.time()``); an object written more than a second before it (slack for a
    file system's coarse timestamps) is from an earlier build. A source counts as compiled once its object is
    written (the compiler writes it when done); those left are compiling or queued (ninja runs several at once).
    elapsed_s: seconds since the build started. most: how many of those left are named. When none is left, the
    line says the module is being linked.
    """
    left = []
    for src in sources:
        obj = os.path.join(build_temp or "", os.path.splitext(src)[0] + obj_extension)
        try:
            done = os.path.getmtime(obj) >= since - 1.0
        except OSError:
            done = False
        if not done:
            left.append(src)
    took = format_elapsed(elapsed_s)
    if not left:
        return f"gaengine: still linking gaengine._C ({took})"
    named = ", ".join(left[:most]) + (f" and {len(left) - most} more" if len(left) > most else "")
    return f"gaengine: still compiling {named} ({took}; {len(sources) - len(left)} of {len(sources)} done)"


class BuildHeartbeat:
    """A progress line every ``interval_s`` seconds while the ``with`` body runs (a build step that prints
    nothing for minutes), from a daemon thread.

    describe: ``describe(elapsed_s) -> str``, the line (e.g. ``compile_progress``), called on the thread.
    log: where each line goes; the default prints and flushes (pip pipes the build's stdout, and a line left in
    Python's buffer would show only when the build ends). clock: seconds, ``time.monotonic``.
    """

    def __init__(self, describe, interval_s=HEARTBEAT_S, log=None, clock=time.monotonic):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self.describe, self.interval_s, self.clock = describe, interval_s, clock
        self.log = log or (lambda line: print(line, flush=True))
        self._stop = threading.Event()
        self._thread = None

    def _beat(self, start):
        while not self._stop.wait(self.interval_s):
            try:
                line = self.describe(self.clock() - start)
            except Exception as exc:  # noqa: BLE001 - a progress line must never stop the build
                line = f"gaengine: still building gaengine._C (progress unknown: {exc})"
            self.log(line)

    def __enter__(self):
        self._thread = threading.Thread(target=self._beat, args=(self.clock(),), name="gaengine-build-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()
        return False


# The configuration an Extension carries (what CppExtension / CUDAExtension fill in), copied for the retry.
_EXTENSION_CONFIG = ("sources", "include_dirs", "define_macros", "undef_macros", "library_dirs", "libraries",
                     "runtime_library_dirs", "extra_objects", "extra_compile_args", "extra_link_args", "language")


def fallback_build_ext(base, cpu_fallback, strict, log=print, heartbeat_s=HEARTBEAT_S, heartbeat_log=None):
    """A ``build_ext`` over ``base`` (torch's ``BuildExtension``) for the one extension ``gaengine._C``.

    Each build attempt runs under a ``BuildHeartbeat``: every ``heartbeat_s`` seconds a ``compile_progress``
    line (files not compiled yet, time so far) goes to ``heartbeat_log`` (default: printed and flushed).

    cpu_fallback: the CPU-only configuration (a ``CppExtension``) to rebuild as when the build with CUDA kernels
    fails, or ``None`` when the extension is already CPU-only. A last failure raises (``build_with_fallback``). The retry rewrites the same ``Extension`` object (setuptools keeps per-extension state from
    ``finalize_options``) and restores what a failed ``run`` leaves changed (``compiler``, ``inplace``).
    """

    class FallbackBuildExtension(base):
        def run(self):
            compiler, inplace = self.compiler, self.inplace

            def build():
                self.compiler, self.inplace = compiler, inplace
                sources = [src for ext in self.extensions for src in ext.sources]
                since = time.time()

                def progress(elapsed_s):  # on the heartbeat's thread, while base.run compiles
                    return compile_progress(sources, getattr(self, "build_temp", None), since, elapsed_s,
                                            getattr(self.compiler, "obj_extension", None) or ".o")

                with BuildHeartbeat(progress, heartbeat_s, heartbeat_log):
                    base.run(self)

            def build_cpu_only():
                for ext in self.extensions:
                    for attr in _EXTENSION_CONFIG:
                        setattr(ext, attr, copy.deepcopy(getattr(cpu_fallback, attr)))
                build()

            attempts = [("with CUDA kernels", build), ("without CUDA kernels", build_cpu_only)] if cpu_fallback \
                else [("without CUDA kernels", build)]
            build_with_fallback(attempts, strict, log)

    return FallbackBuildExtension


def main():
    build_ext_mode = os.environ.get("GAENGINE_BUILD_EXT", "auto").strip().lower()
    if build_ext_mode == "0":
        sys.exit("GAENGINE_BUILD_EXT=0 (an install without gaengine._C) is no longer possible: gaengine's "
                 "per-parameter hooks are C++ for every backend. Unset it, or set auto or 1")
    if build_ext_mode not in ("auto", "1"):
        sys.exit(f"GAENGINE_BUILD_EXT must be auto or 1, got {build_ext_mode!r}")

    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        sys.exit(f"gaengine: torch is not importable at build time ({exc}); gaengine._C is compiled against it. "
                 "Install torch first, then gaengine with `pip install --no-build-isolation -e .` (without "
                 "--no-build-isolation pip builds in a fresh environment that has no torch)")
    problem = torch_version_problem(torch.__version__)
    if problem:
        sys.exit(problem)
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= TORCH_CEILING:
        print(f"gaengine: warning: torch {torch.__version__} is newer than the versions gaengine is tested with "
              f"({TORCH_SPEC}); building against it anyway")
    cxx_flags = CXX_FLAGS + [f"-std={cxx_standard(torch.__version__)}"]
    sources = sorted(glob.glob("csrc/*.cpp"))
    with_cuda, why = cuda_build_decision(torch.version.cuda, CUDA_HOME, nvcc_version_output(CUDA_HOME),
                                         os.environ.get("GAENGINE_BUILD_CUDA", "1"))
    print(f"gaengine: building gaengine._C {why}")
    cpu_only = CppExtension("gaengine._C", sources, extra_compile_args={"cxx": list(cxx_flags)},
                            extra_link_args=list(LINK_FLAGS))
    extension = cpu_only
    if with_cuda:  # the same module, plus the cuda backend's kernels (csrc/cuda/README.md)
        extension = CUDAExtension("gaengine._C", sources + sorted(glob.glob("csrc/cuda/*.cu")),
                                  define_macros=[("GAENGINE_WITH_CUDA", None)],
                                  # csrc/cuda/kernels/adamw.cuh includes the AdamW functor as "optim/adamw.h"
                                  include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")],
                                  extra_compile_args={"cxx": list(cxx_flags), "nvcc": list(NVCC_FLAGS)},
                                  extra_link_args=list(LINK_FLAGS))
    build_ext = fallback_build_ext(BuildExtension, cpu_only if with_cuda else None, strict=build_ext_mode == "1")
    ext_modules, cmdclass = [extension], {"build_ext": build_ext.with_options(use_ninja=True)}

    # Every package lies under gaengine/ and package_dir maps only "" (the project root): setuptools then makes
    # the editable install a plain path entry (the root appended to sys.path by a .pth file) instead of a finder
    # appended to sys.meta_path after PathFinder, which lets a folder named gaengine in the working directory
    # (the clone itself, seen from its parent) shadow the package as an empty namespace package
    # (pypa/setuptools#3557). tests/test_packaging.py imports gaengine from such a folder.
    setup(
        packages=["gaengine", "gaengine.tools", "gaengine.tools.bench", "gaengine.kernels", "gaengine.integrations"],
        package_dir={"": "."},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )


if __name__ == "__main__":
    main()
