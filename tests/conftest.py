import os
import sys

# Triton kernels run on CPU tensors under the interpreter when no GPU is present; this must be set
# before triton is first imported (it is read when a kernel is decorated).
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def emulated_cuda_module():
    """``(engine, module)``: the emulated build of ``gaengine._C`` (``tests/cuda_emu/engine.py``: csrc/cuda's kernels
    on CPU tensors), built or loaded once per session; ``engine.use(monkeypatch, module)`` makes it the cuda
    backend's extension. Skips without a C++ compiler; fails with the compiler's report on a build error."""
    emu_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu")
    if emu_dir not in sys.path:
        sys.path.insert(0, emu_dir)
    import build as emu_build  # noqa: PLC0415
    import engine as emu_engine  # noqa: PLC0415

    if emu_build.find_cxx() is None:
        pytest.skip("no C++ compiler ($CXX, g++, c++, clang++) to build the emulated cuda backend")
    try:
        module, _ = emu_engine.build()
    except Exception as exc:  # noqa: BLE001 - a compile error: the report is the compiler's stderr
        pytest.fail(f"the emulated build of gaengine._C failed:\n{str(exc)[-8000:]}")
    return emu_engine, module
