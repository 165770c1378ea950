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

from tests import poison  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not _has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (not a pytest it started: the env var is inherited)
        _heavy_files_first(items)


def _heavy_files_first(items) -> None:
    """Under pytest-xdist (``make test``: ``--dist loadfile``, a file's tests on one worker, files handed out in
    collection order), the files holding a multi-process or slow test go first, each file's tests kept together and
    in their order: the longest files start while the short ones still fill the other worker, instead of one of
    them starting last and running alone. Every worker sorts the same collection the same way."""
    heavy = {item.nodeid.split("::")[0] for item in items
             if item.get_closest_marker("multiproc") is not None or item.get_closest_marker("slow") is not None}
    position = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.nodeid.split("::")[0] not in heavy, position[item.nodeid]))


@pytest.fixture(scope="module")
def setup_py():
    """``setup.py`` imported under another name than ``__main__``: its helpers, no ``setup()`` call."""
    from tests.helpers import load_file  # noqa: PLC0415 - the engine imported only once a test asks for setup.py

    return load_file("gaengine_setup_under_test", os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.py"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# Every test's floating torch.empty / torch.empty_like / Tensor.new_empty comes back NaN-filled (tests/poison.py), in
# this process and in the gloo ranks it starts (they inherit GAENGINE_POISON): a missing write shows.
os.environ[poison.ENV] = "1"
# gaengine._C's own scratch tables too (csrc/scratch.h), read at its first allocation: set before any test runs.
os.environ[poison.SCRATCH_ENV] = "1"


@pytest.fixture(autouse=True)
def _poison_allocations():
    undo = poison.install()
    yield
    undo()


# ---------------------------------------------------------------- the backends that exist here
BACKENDS = ("torch", "cpu", "triton", "cuda-emu", "cuda-gpu")
"""Every backend a test can run, by test id: ``torch`` (the plain-PyTorch reference backend, CPU tensors), ``cpu``
(``gaengine._C``), ``triton`` (``gaengine.kernels``: CUDA tensors with a GPU, else CPU tensors under
``TRITON_INTERPRET=1``), ``cuda-emu`` (the ``cuda`` backend over the emulated build of ``gaengine._C``,
``tests/cuda_emu``: csrc/cuda's kernels on CPU tensors) and ``cuda-gpu`` (the ``cuda`` backend on a GPU). An id never
says just ``cuda``: ``pytest_collection_modifyitems`` skips items with a ``cuda`` keyword where there is no GPU."""

_BACKEND_MARKS = {"triton": [pytest.mark.interpreter], "cuda-gpu": [pytest.mark.cuda]}


def backend_params(*ids: str) -> list:
    """``pytest.param`` of each backend id of ``ids`` (all of ``BACKENDS`` when none), with its marks: the values of a
    ``backend`` parametrization, e.g. ``@pytest.mark.parametrize("backend", backend_params("torch", "cpu"),
    indirect=True)`` for a test that runs only those."""
    unknown = set(ids) - set(BACKENDS)
    assert not unknown, f"no backend {sorted(unknown)} (tests/conftest.py BACKENDS)"
    return [pytest.param(i, id=i, marks=_BACKEND_MARKS.get(i, [])) for i in (ids or BACKENDS)]


NATIVE_HOOKS = ("torch", "cpu", "triton", "cuda-emu", "cuda-gpu")
"""The backends the native hooks drive (every one: ``cpu`` and ``cuda``'s bucket kernels are ``gaengine._C``'s, the
``torch`` and ``triton`` ones registered as kernels of an op of the same schema, ``Backend.hot_path_namespace``);
every backend also runs the Python hooks."""


def backend_hook_params(*ids: str) -> list:
    """``pytest.param(backend_id, hot_path)`` of each backend of ``ids`` (all when none) with each of its hooks
    ("python": the oracle of ``tests/oracle_hooks.py``, and "native" for ``NATIVE_HOOKS``: ``use_hooks``), id ``<backend>-<hooks>``: the values of
    ``@pytest.mark.parametrize("backend,hot_path", backend_hook_params(), indirect=["backend"])``."""
    return [pytest.param(p.values[0], hooks, id=f"{p.id}-{hooks}", marks=p.marks)
            for p in backend_params(*ids) for hooks in ("python", "native")
            if hooks == "python" or p.values[0] in NATIVE_HOOKS]


def backend_name(backend_id: str) -> str:
    """The name gaengine takes for a backend id (``GradientAccumulator(backend=...)``, ``get_backend``)."""
    return "cuda" if backend_id.startswith("cuda-") else backend_id


def seeded_randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """``torch.randn(*shape)`` drawn from the CPU ``generator`` (the same numbers on every machine), then placed on
    torch's default device: a GPU while a ``cuda-gpu`` test runs (the ``backend`` fixture), else the CPU."""
    return torch.randn(*shape, generator=generator, device="cpu").to(torch.get_default_device())


def backend_device(backend_id: str) -> torch.device:
    """Where the backend's tensors live here: a GPU for ``cuda-gpu``, and for ``triton`` when there is one."""
    gpu = backend_id == "cuda-gpu" or (backend_id == "triton" and _has_cuda)
    return torch.device("cuda" if gpu else "cpu")


@pytest.fixture(params=backend_params())
def backend(request) -> str:
    """Each backend that exists here (``BACKENDS``) for a model on CPU tensors (``cuda-gpu``: CUDA ones, torch's
    default device while the test runs), as the name
    gaengine takes (``backend_name``), skipped where it cannot load; ``cuda-emu`` installs the emulated build for the
    test (``monkeypatch``). The id is ``request.node.callspec.params["backend"]``. Files whose tensors follow
    ``backend_device`` (``tests/ops``, ``tests/test_op_table.py``) parametrize their own fixture with
    ``backend_params()``."""
    backend_id = request.param
    if backend_id == "cuda-emu":
        emu_engine, module = request.getfixturevalue("emulated_cuda_module")
        emu_engine.use(request.getfixturevalue("monkeypatch"), module)
    from gaengine.backends import get_backend  # noqa: PLC0415

    try:
        get_backend(backend_name(backend_id), "cuda" if backend_id == "cuda-gpu" else "cpu")
    except RuntimeError as exc:
        pytest.skip(f"backend {backend_id!r} unavailable here: {exc}")
    if backend_id == "cuda-gpu":
        # The test's models and tensors made without a device go to the GPU (torch.set_default_device); data drawn
        # from a CPU generator is moved with .to(backend_device(...)) by the test.
        torch.set_default_device("cuda")
        request.addfinalizer(lambda: torch.set_default_device(None))
    return backend_name(backend_id)


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
        module, _ = emu_engine.build()  # under a file lock: the pytest-xdist workers share build/cuda_emu_engine
    except Exception as exc:  # noqa: BLE001 - a compile error: the report is the compiler's stderr
        pytest.fail(f"the emulated build of gaengine._C failed:\n{str(exc)[-8000:]}")
    return emu_engine, module


# ---------------------------------------------------------------- progress of `make test` (pytest -q)
# pytest -q prints dots without file names and ends a line only when it is full, and the multi-process tests
# (marker multiproc: gloo ranks started as processes) take several seconds each, minutes in all on a 2-core
# machine: the log would sit on one percentage as if hung. Under -q, before the first multi-process test of each
# file, a line names that file's share; a file with another slow part names it in a module-level PROGRESS_NOTE.
# (Without -q every line already starts with its file's name.)
MULTIPROC_TEST_S = 6
"""Rough seconds per multi-process test on a 2-core machine (some 40 of them took about 4 minutes in ``make test``):
the basis of the estimate printed, not a limit."""

_announcements: dict[str, str] = {}  # node id of a file's first multi-process test -> the line printed before it
_config = None


def pytest_configure(config):
    global _config
    _config = config


def _will_skip(item) -> bool:
    return any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True) for m in item.iter_markers())


def multiproc_line(path: str, count: int) -> str:
    """The line printed before the first of ``count`` multi-process tests of the file ``path``."""
    seconds = count * MULTIPROC_TEST_S
    when = "under a minute" if seconds < 60 else f"about {round(seconds / 60)} minute{'s' if seconds >= 90 else ''}"
    return f"{path}: {count} multi-process test{'s' if count > 1 else ''} (gloo), {when}"


def pytest_collection_finish(session):
    """Plan the lines over the tests that will run (after -k/-m deselection; known skips left out), under -q."""
    _announcements.clear()
    if session.config.option.verbose >= 0:
        return
    files: dict[str, list[str]] = {}
    noted: dict[str, list[str]] = {}  # files that name their own slow part (a module-level PROGRESS_NOTE)
    for item in session.items:
        path = item.nodeid.split("::")[0]
        if getattr(getattr(item, "module", None), "PROGRESS_NOTE", None) and not _will_skip(item):
            noted.setdefault(path, []).append(item.nodeid)
        elif item.get_closest_marker("multiproc") is not None and not _will_skip(item):
            files.setdefault(path, []).append(item.nodeid)
    _announcements.update({ids[0]: multiproc_line(path, len(ids)) for path, ids in files.items()})
    for path, ids in noted.items():
        note = session.items[[i.nodeid for i in session.items].index(ids[0])].module.PROGRESS_NOTE
        _announcements[ids[0]] = f"{path}: {len(ids)} tests, {note}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    line = _announcements.pop(nodeid, None)
    if line is None or _config is None or _config.pluginmanager.get_plugin("terminalreporter") is None:
        return  # not a first multi-process test, or no terminal (e.g. an xdist worker)
    writer = _config.get_terminal_writer()
    if writer.width_of_current_line:
        writer.line()  # end the line of dots
    writer.line(line)
    writer.flush()
