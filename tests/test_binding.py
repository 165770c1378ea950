"""The binding surface of ``gaengine._C``: its ops are reached only as ``torch.ops.gaengine.*`` (one backend class,
``CompiledBackend``, for ``cpu`` and ``cuda``); its pybind11 module holds only what is not an op; and a module built
from other sources than this gaengine is refused when it loads, with one message (``ABI_VERSION``).
"""

from __future__ import annotations

import os
import re
import sys
import types

import pytest
import torch

import gaengine
from gaengine import backends
from gaengine.buffer import FlatBuffer, FlatLayout
from gaengine.hooks import make_hooks
from gaengine.hot_path import load_native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_abi_version() -> int:
    """``GAENGINE_ABI_VERSION`` as ``csrc/op_library.h`` defines it (read from the source, not the module)."""
    with open(os.path.join(ROOT, "csrc", "op_library.h")) as f:
        found = re.findall(r"^#define GAENGINE_ABI_VERSION (\d+)$", f.read(), re.MULTILINE)
    assert len(found) == 1, found
    return int(found[0])


def test_python_expects_the_abi_version_the_sources_define():
    assert backends.EXTENSION_ABI_VERSION == _source_abi_version()


def test_the_built_module_binds_only_what_is_not_an_op():
    """No pybind11 entry point for an op: the module's public names are HotPath, HotPathCore and three constants, and
    every op of the operation table that has a kernel is a torch.ops.gaengine op with a CPU kernel."""
    _C = pytest.importorskip("gaengine._C", reason="gaengine._C is not built")
    assert {name for name in dir(_C) if not name.startswith("_")} == {"ABI_VERSION", "HotPath", "HotPathCore",
                                                                      "OP_NAMESPACE", "WITH_CUDA"}
    assert _C.ABI_VERSION == _source_abi_version() and _C.OP_NAMESPACE == "gaengine"
    for op in ("accumulate_", "l2norm_sq", "scale_", "accumulate_bucket_", "adamw_step_", "optimizer_step_",
               "wgrad_accumulate_"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gaengine::{op}", "CPU"), op


def test_cpu_and_cuda_are_one_class_over_the_dispatcher():
    pytest.importorskip("gaengine._C", reason="gaengine._C is not built")
    cpu = backends.get_backend("cpu")
    assert type(cpu) is backends.CompiledBackend and cpu.hot_path_kernels == "cpu"
    dst, src = torch.zeros(5), torch.arange(5, dtype=torch.float32).bfloat16()
    cpu.accumulate_(dst, src, torch.tensor(0.5))  # a tensor scale: read by the CPU kernel
    assert torch.equal(dst, torch.arange(5, dtype=torch.float32) * 0.5)


@pytest.fixture
def stale_extension(monkeypatch):
    """``gaengine._C`` replaced by ``make(abi_version)``'s module (None: one built before the version was compiled
    in), with fresh backend caches."""
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_load_errors", {})
    monkeypatch.setattr(backends, "_announced", set())
    monkeypatch.delenv("GAENGINE_BACKEND", raising=False)

    def make(abi_version):
        fake = types.ModuleType("gaengine._C")
        fake.__file__ = "/stale/gaengine/_C.so"
        fake.HotPath = lambda *args, **kwargs: pytest.fail("a stale HotPath was built")
        fake.OP_NAMESPACE, fake.WITH_CUDA = "gaengine", False
        if abi_version is not None:
            fake.ABI_VERSION = abi_version
        monkeypatch.setitem(sys.modules, "gaengine._C", fake)
        monkeypatch.setattr(gaengine, "_C", fake, raising=False)
        return fake

    return make


@pytest.mark.parametrize("found", [None, "older", "newer"])
def test_a_stale_extension_is_refused_at_load_with_one_message(stale_extension, found, caplog):
    expected = backends.EXTENSION_ABI_VERSION
    version = {None: None, "older": expected - 1, "newer": expected + 1}[found]
    stale_extension(version)
    message = (f"/stale/gaengine/_C.so was built from other sources than this gaengine (ABI_VERSION {version}, "
               f"this gaengine needs {expected}): rebuild it with `make install`")
    assert backends.load_extension()[0] is None and backends.load_extension()[1].startswith(message)
    with pytest.raises(RuntimeError, match=re.escape(f"backend 'cpu' could not be loaded: {message}")):
        backends.get_backend("cpu")
    with caplog.at_level("INFO", logger="gaengine"):
        assert backends.get_backend("auto", "cpu").name == "torch"  # auto falls back, saying why once
    assert any(message in record.getMessage() for record in caplog.records)
    assert load_native() == (None, backends.load_extension()[1])
    main_grad = FlatBuffer(FlatLayout.build([]), torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"hooks \(gaengine._C, csrc/hot_path.cpp\) cannot run for backend "
                                           rf"'torch': {re.escape(message)}.*reinstall"):
        make_hooks([], main_grad, backends.get_backend("auto", "cpu"), [], None)


def test_an_extension_of_these_sources_loads(stale_extension):
    module = stale_extension(backends.EXTENSION_ABI_VERSION)
    assert backends.load_extension() == (module, None)
