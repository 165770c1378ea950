"""The emulated cuda backend (``tests/cuda_emu``: csrc/cuda's kernels built for CPU tensors) for the tests that run
their own cases on it, in the test's process and in the gloo ranks it starts.

The build itself is ``tests/conftest.py``'s session fixture ``emulated_cuda_module`` (built or loaded once per
session, skipping the test where no C++ compiler is found); ``install`` makes it the ``cuda`` backend's extension for
one test, ``install_in_rank`` does the same in a rank that test spawned (``tests/ranks.py``).
"""

from __future__ import annotations

import os
import sys

import pytest

EMU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu")


def install(request, monkeypatch, *, as_default: bool):
    """For the rest of the test (``monkeypatch`` undoes it): the session's emulated build (``emulated_cuda_module``,
    through ``request``; the test skips without a compiler) as the cuda backend's extension, the native hooks
    (``tests.oracle_hooks.use_hooks``), and ``GAENGINE_BACKEND=cuda`` when ``as_default`` (``backend="auto"`` then
    picks it, here and in the ranks the test spawns, which inherit the environment), else no ``GAENGINE_BACKEND``.
    Returns the module."""
    from tests.oracle_hooks import use_hooks  # noqa: PLC0415 - gaengine imported only when a test asks

    emu_engine, module = request.getfixturevalue("emulated_cuda_module")
    emu_engine.use(monkeypatch, module)
    use_hooks(monkeypatch, "native")
    if as_default:
        monkeypatch.setenv("GAENGINE_BACKEND", "cuda")
    else:
        monkeypatch.delenv("GAENGINE_BACKEND", raising=False)
    return module


def install_in_rank():
    """In a rank process of a test that called ``install``: the session's build loaded (a no-op ninja run: the
    parent built it) and made the cuda backend's extension for the rest of the process, which is the test's alone
    (never undone). Returns the module."""
    if EMU_DIR not in sys.path:
        sys.path.insert(0, EMU_DIR)
    import engine as emu_engine  # noqa: PLC0415 - tests/cuda_emu/engine.py

    module, _ = emu_engine.build()
    emu_engine.use(pytest.MonkeyPatch(), module)
    return module
