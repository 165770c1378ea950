"""CUDA >= 12.1, toolkit and driver: what the build and the backends do with an older one (csrc/cuda/README.md).

The multi-tensor kernels pass up to 27.7 KB of kernel parameters by value. An older toolkit cannot compile them:
``setup.py`` then builds the CPU ops alone (``cuda_build_decision``), and in ``auto`` mode any failed CUDA build
is retried without CUDA (``fallback_build_ext``). An older driver refuses every launch: ``gaengine.backends``
decides once (``cuda_kernels_unusable``) that the ``cuda`` backend cannot load, so ``auto`` picks ``triton``, a
``cuda`` asked for by name raises, and the native hot path and ``FusedAdamW`` follow. No GPU and no CUDA torch
needed: the versions, ``torch.cuda.is_available`` and the extension's ops are monkeypatched; nothing is built.
"""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import torch
from setuptools import Extension

import gaengine
from gaengine import backends
from gaengine.buffer import FlatBuffer, FlatLayout
from gaengine.hooks import make_hooks
from gaengine.optim import FusedAdamW
from tests.helpers import NVCC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvcc_says(version: str) -> str:
    """``nvcc --version``'s stdout for a toolkit ``version`` (the format of 11.x to 13.x)."""
    return ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
            f"Cuda compilation tools, release {version}, V{version}.99\nBuild cuda_{version}.r{version}/compiler.1_0\n")


# ----------------------------------------------------------------------------------------------- build time
@pytest.mark.parametrize("toolkit, with_cuda", [("11.8", False), ("12.0", False), ("12.1", True), ("12.4", True),
                                                ("13.0", True)],
                         ids=["toolkit11.8-cpu-only", "toolkit12.0-cpu-only", "toolkit12.1", "toolkit12.4",
                              "toolkit13.0"])
def test_toolkit_version_decides_the_cuda_kernels(setup_py, toolkit, with_cuda):
    built, why = setup_py.cuda_build_decision(toolkit, "/usr/local/cuda", nvcc_says(toolkit))
    assert built is with_cuda
    if with_cuda:
        assert why.startswith("with CUDA kernels") and toolkit in why
    else:  # the line names the toolkit found, the version needed, and what is built instead
        assert why.startswith("without CUDA kernels") and f"is {toolkit};" in why
        assert "CUDA >= 12.1" in why and "CPU ops alone" in why and "27.7 KB" in why


@pytest.mark.parametrize("nvcc_output", [None, "", "nvcc: command not found", "release twelve"],
                         ids=["none", "empty", "not-found", "garbled"])
def test_unparsable_toolkit_version_builds_cpu_only(setup_py, nvcc_output):
    built, why = setup_py.cuda_build_decision("12.4", "/opt/cuda", nvcc_output)
    assert not built
    assert "could not read the CUDA toolkit version from /opt/cuda/bin/nvcc --version" in why
    assert "CUDA >= 12.1" in why and "CPU ops alone" in why


@pytest.mark.parametrize("torch_cuda", ["11.8", "12.0", "twelve"])
def test_torch_cuda_runtime_below_12_1_builds_cpu_only(setup_py, torch_cuda):
    built, why = setup_py.cuda_build_decision(torch_cuda, "/usr/local/cuda", nvcc_says("12.4"))
    assert not built
    assert f"torch is built with CUDA {torch_cuda};" in why and "CUDA >= 12.1" in why


@pytest.mark.parametrize("torch_cuda, cuda_home, build_cuda, expected", [
    ("12.4", "/usr/local/cuda", "0", "GAENGINE_BUILD_CUDA=0"),
    ("12.4", "/usr/local/cuda", " 0 ", "GAENGINE_BUILD_CUDA=0"),
    (None, None, "1", "torch is a CPU-only build"),
    ("12.4", None, "1", "no CUDA toolkit was found: set CUDA_HOME"),
], ids=["build-cuda-0", "build-cuda-0-spaces", "cpu-torch", "no-toolkit"])
def test_no_cuda_kernels_without_a_cuda_setup(setup_py, torch_cuda, cuda_home, build_cuda, expected):
    built, why = setup_py.cuda_build_decision(torch_cuda, cuda_home, nvcc_says("12.4"), build_cuda)
    assert not built and why.startswith("without CUDA kernels") and expected in why


@pytest.mark.parametrize("text, version", [
    (nvcc_says("12.4"), (12, 4)), (nvcc_says("11.8"), (11, 8)), ("12.1", (12, 1)), (" 13.0 ", (13, 0)),
    ("12.8.1", (12, 8)), ("12", None), ("abc", None), (None, None),
], ids=["nvcc-12.4", "nvcc-11.8", "bare-12.1", "spaces-13.0", "patch-12.8.1", "major-only", "garbage", "none"])
def test_parse_cuda_version(setup_py, text, version):
    assert setup_py.parse_cuda_version(text) == version


def test_parse_cuda_version_reads_this_machines_nvcc(setup_py):
    if NVCC is None:
        pytest.skip("no nvcc found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(NVCC)))
    assert setup_py.parse_cuda_version(setup_py.nvcc_version_output(cuda_home)) is not None
    assert setup_py.nvcc_version_output("/nonexistent/cuda") is None
    assert setup_py.nvcc_version_output(None) is None


def test_build_and_load_agree_on_the_minimum(setup_py):
    assert setup_py.MIN_CUDA == (backends.MIN_CUDA_DRIVER // 1000, backends.MIN_CUDA_DRIVER % 1000 // 10)


def test_build_with_fallback_tries_the_next_configuration(setup_py):
    log, ran = [], []

    def fails():
        ran.append("cuda")
        raise RuntimeError("nvcc: error: too many kernel parameters")

    attempts = [("with CUDA kernels", fails), ("without CUDA kernels", lambda: ran.append("cpu"))]
    what = setup_py.build_with_fallback(attempts, strict=False, log=log.append)
    assert what == "without CUDA kernels" and ran == ["cuda", "cpu"]
    assert log == ["gaengine: building gaengine._C with CUDA kernels failed (nvcc: error: too many kernel "
                   "parameters); retrying without CUDA kernels"]


def test_build_with_fallback_strict_raises_at_the_first_failure(setup_py):
    ran = []

    def fails():
        ran.append("cuda")
        raise RuntimeError("nvcc failed")

    with pytest.raises(RuntimeError, match="nvcc failed"):
        attempts = [("with CUDA kernels", fails), ("without CUDA kernels", lambda: ran.append("cpu"))]
        setup_py.build_with_fallback(attempts, strict=True, log=print)
    assert ran == ["cuda"]


def test_build_with_fallback_all_failing_raises_saying_how_to_go_on(setup_py):
    """gaengine._C is required: when no configuration builds, the install fails, naming the error and the fix."""
    log = []

    def fails():
        raise OSError("no compiler")

    with pytest.raises(RuntimeError, match=r"without CUDA kernels failed \(no compiler\).*needs it.*C\+\+17 "
                                           r"compiler.*--no-build-isolation"):
        setup_py.build_with_fallback([("with CUDA kernels", fails), ("without CUDA kernels", fails)],
                                     strict=False, log=log.append)
    assert len(log) == 1 and "retrying without CUDA kernels" in log[0]


class FakeBuildExt:
    """What ``fallback_build_ext`` needs of setuptools' ``build_ext``: ``extensions``, ``compiler``, ``inplace``
    and a ``run`` that fails on ``.cu`` sources and, like setuptools', leaves a failed run's state behind."""

    def __init__(self, extensions):
        self.extensions, self.compiler, self.inplace, self.built = extensions, None, True, []

    def run(self):
        assert self.compiler is None and self.inplace, "a failed run's compiler / inplace was not restored"
        ext = self.extensions[0]
        self.built.append((list(ext.sources), list(ext.define_macros), sorted(ext.extra_compile_args)))
        self.compiler, self.inplace = object(), False  # setuptools' run: new_compiler(), then inplace off
        if any(src.endswith(".cu") for src in ext.sources):
            raise RuntimeError("nvcc: error: formal parameter space overflowed")
        self.inplace = True


def _extensions():
    cuda = Extension("gaengine._C", ["csrc/a.cpp", "csrc/cuda/k.cu"], define_macros=[("GAENGINE_WITH_CUDA", None)],
                     extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]}, libraries=["cudart"])
    cpu = Extension("gaengine._C", ["csrc/a.cpp"], extra_compile_args={"cxx": ["-O3"]})
    return cuda, cpu


def test_auto_build_retries_cpu_only_when_the_cuda_build_fails(setup_py):
    cuda, cpu = _extensions()
    log = []
    cmd = setup_py.fallback_build_ext(FakeBuildExt, cpu, strict=False, log=log.append)([cuda])
    cmd.run()
    assert cmd.built == [(["csrc/a.cpp", "csrc/cuda/k.cu"], [("GAENGINE_WITH_CUDA", None)], ["cxx", "nvcc"]),
                         (["csrc/a.cpp"], [], ["cxx"])]
    assert cmd.extensions == [cuda] and cuda.libraries == []  # the same Extension, now the CPU configuration
    assert cmd.inplace  # the retry ran with the original inplace, so an editable install gets the module
    assert log == ["gaengine: building gaengine._C with CUDA kernels failed (nvcc: error: formal parameter space "
                   "overflowed); retrying without CUDA kernels"]


def test_strict_build_does_not_retry(setup_py):
    cuda, cpu = _extensions()
    cmd = setup_py.fallback_build_ext(FakeBuildExt, cpu, strict=True)([cuda])
    with pytest.raises(RuntimeError, match="formal parameter space"):
        cmd.run()
    assert len(cmd.built) == 1 and cuda.sources[-1].endswith(".cu")


def test_cpu_only_build_failure_fails_the_install(setup_py):
    cuda, _ = _extensions()  # a CPU-only configuration that fails (its .cu stands for any failure)
    log = []
    cmd = setup_py.fallback_build_ext(FakeBuildExt, None, strict=False, log=log.append)([cuda])
    with pytest.raises(RuntimeError, match="building gaengine._C without CUDA kernels failed .*formal parameter"):
        cmd.run()
    assert len(cmd.built) == 1 and log == []


# ------------------------------------------------------------------------------------------------ load time
@pytest.mark.parametrize("driver, problem", [(11080, "11.8"), (12000, "12.0"), (12010, None), (12040, None),
                                             (13000, None), (None, None)],
                         ids=["driver11.8", "driver12.0", "driver12.1", "driver12.4", "driver13.0", "unknown"])
def test_cuda_driver_problem(driver, problem):
    why = backends.cuda_driver_problem(driver)
    if problem is None:
        assert why is None
    else:
        assert f"supports CUDA {problem} (cudaDriverGetVersion() = {driver})" in why
        assert "CUDA >= 12.1" in why and "Update the NVIDIA driver" in why and "backend='triton'" in why


def test_cuda_driver_version_on_a_cpu_torch_is_unknown():
    if torch.version.cuda:
        pytest.skip("a CUDA torch reports its driver")
    assert backends._cuda_driver_version() is None


@pytest.fixture
def cuda_machine(monkeypatch):
    """A CUDA torch on a machine with a GPU, as far as ``gaengine.backends`` can tell; ``driver(v)`` sets what
    ``cudaDriverGetVersion`` reports. Fresh backend caches; ``gaengine._C`` is a module built with CUDA, its ops in
    a namespace of their own (never called)."""
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_load_errors", {})
    monkeypatch.setattr(backends, "_announced", set())
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake = types.ModuleType("gaengine._C")
    fake.HotPath = lambda *args, **kwargs: pytest.fail("HotPath was built")
    fake.OP_NAMESPACE, fake.ABI_VERSION, fake.WITH_CUDA = "gaengine_fake_cuda", backends.EXTENSION_ABI_VERSION, True
    monkeypatch.setitem(sys.modules, "gaengine._C", fake)
    monkeypatch.setattr(gaengine, "_C", fake, raising=False)
    monkeypatch.delenv("GAENGINE_BACKEND", raising=False)

    def driver(version):
        monkeypatch.setattr(backends, "_cuda_driver_version", lambda: version)

    return driver


def test_old_driver_auto_picks_triton_and_says_why(cuda_machine, caplog):
    cuda_machine(12000)
    triton_loads = backends._load("triton") is not None
    with caplog.at_level(logging.INFO, logger="gaengine"):
        first = backends.get_backend("auto", "cuda")
        second = backends.get_backend("auto", "cuda")
    assert first is second and first.name == ("triton" if triton_loads else "torch")
    lines = [r.getMessage() for r in caplog.records if r.name == "gaengine"]
    assert len(lines) == 1, lines  # logged once
    assert "cuda unavailable" in lines[0] and "CUDA 12.0 (cudaDriverGetVersion() = 12000)" in lines[0]
    assert "CUDA >= 12.1" in lines[0]


def test_old_driver_cuda_by_name_raises(cuda_machine):
    cuda_machine(12000)
    with pytest.raises(RuntimeError, match=r"backend 'cuda' could not be loaded: the CUDA driver supports CUDA 12\.0 "
                                           r"\(cudaDriverGetVersion\(\) = 12000\), .*CUDA >= 12\.1.*backend='triton'"):
        backends.get_backend("cuda", "cuda")
    assert "CUDA 12.0" in backends.cuda_kernels_unusable()


def test_old_driver_fused_adamw_does_not_choose_adamw_step_cuda(cuda_machine):
    cuda_machine(12000)
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(RuntimeError, match=r"CUDA 12\.0 .*CUDA >= 12\.1"):
        FusedAdamW(params, backend="cuda")._kernel(torch.device("cuda"))
    if backends._load("triton") is not None:
        from gaengine.kernels.adamw import adamw_step_

        kernel = FusedAdamW(params)._kernel(torch.device("cuda"))
        assert kernel.backend == "triton" and kernel.step is adamw_step_


def test_old_driver_native_hot_path_refuses_the_cuda_kernels(cuda_machine, monkeypatch):
    cuda_machine(12000)
    # the cuda backend as if loaded before the driver was seen (its partials in rows: the fake module has no ops)
    cuda_backend = backends.CompiledBackend("cuda", gaengine._C, "cuda", backends.RowPartials(),
                                            problem=backends.cuda_kernels_unusable)
    layout = FlatLayout.build([])
    main_grad = FlatBuffer(layout, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"cannot run for backend 'cuda': the CUDA driver supports CUDA 12\.0"):
        make_hooks([], main_grad, cuda_backend, [], None)


@pytest.mark.parametrize("driver", [12010, 12040, None], ids=["driver12.1", "driver12.4", "unknown"])
def test_new_driver_keeps_the_cuda_kernels(cuda_machine, driver):
    cuda_machine(driver)
    assert backends.cuda_kernels_unusable() is None
    assert backends.get_backend("auto", "cuda").name == "cuda"
    assert backends.get_backend("cuda", "cuda") is backends.get_backend("auto", "cuda")
    kernel = FusedAdamW([torch.nn.Parameter(torch.zeros(3))])._kernel(torch.device("cuda"))
    # the compiled module's op (never called here)
    assert kernel.backend == "cuda" and kernel.where == f"torch.ops.{gaengine._C.OP_NAMESPACE}.adamw_step_"


def test_no_gpu_skips_the_driver_query(cuda_machine, monkeypatch):
    cuda_machine(0)  # what cudaDriverGetVersion reports with no driver installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.cuda_kernels_unusable() is None  # nothing can launch, and nothing is refused for it
