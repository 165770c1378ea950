"""The hooks' per-micro-batch source norms (issue 17, point 1): ``make_hooks(..., measure_sources=True)`` and
``Hooks.window_source_sumsq()``.

Row j of a window is this rank's sum over parameters of |g|^2 of the gradient autograd produced in micro-batch j
(arrivals of one backward combined). Reference, independent of gaengine: the plain PyTorch recipe on a copy of the
model (``loss.backward()`` per micro-batch into zeroed ``.grad``, autograd summing a parameter's arrivals), squared
and summed in fp64. Budget: ``sum_sq_rtol`` of the parameter count (``tests/tolerances.py``). The double-arrival
model of ``test_double_arrival.py`` is included: a later arrival combined with the held one is exact; one launched
on its own after its bucket had launched (the first micro-batch, before the arrivals are learned, with a bucket per
parameter) makes that micro-batch's row NaN, as documented.

Configurations: the Python hooks on torch, cpu, triton (interpreter) and the emulated cuda backend
(``tests/cuda_emu``: csrc/cuda's kernels on CPU tensors); the native hooks on cpu and on the emulated cuda backend.

Cost: with ``measure_sources`` the accumulate launches per micro-batch are the same, and the Python calls made
during a backward grow by a constant (per micro-batch and bucket), not per parameter: counted with
``sys.setprofile`` on a model of 4 and of 24 layers.
"""

from __future__ import annotations

import collections
import gc
import copy
import math
import os
import sys

import pytest
import torch
from torch import nn

try:
    import triton
except ImportError:  # the Triton configurations skip
    triton = None

from gaengine.backends import get_backend
from tests.conftest import backend_hook_params
from tests.helpers import hooks_backward, source_norm_hooks
from tests.models import SharedCheckpointed, shared_batches
from tests.tolerances import sum_sq_rtol

CONFIGS = backend_hook_params()  # every backend here with each of its hooks (tests/conftest.py)


@pytest.fixture
def backend_of():
    """``backend_of(name)``: the backend for CPU tensors of a name gaengine takes (the ``backend`` fixture's value:
    with ``cuda-emu``, "cuda" over the emulated build it installed)."""
    def get(name):
        try:
            return get_backend(name, "cpu")
        except RuntimeError as exc:
            pytest.skip(f"backend {name!r} unavailable: {exc}")
    return get


def _reference_rows(model, batches):
    """fp64 sum over parameters of |grad|^2 of each micro-batch: the plain recipe on a copy of ``model``."""
    ref = copy.deepcopy(model)
    rows = []
    for x in batches:
        ref.zero_grad(set_to_none=True)
        ref(x).backward()
        rows.append(sum(float(p.grad.double().square().sum()) for p in ref.parameters() if p.grad is not None))
    return rows


@pytest.mark.parametrize("bucket_size_mb", [1e-6, 25.0], ids=["bucket-per-param", "one-bucket"])
@pytest.mark.parametrize("backend,hot_path", CONFIGS, indirect=["backend"])
def test_rows_match_the_fp64_reference_double_arrival_included(backend, hot_path, bucket_size_mb, monkeypatch,
                                                               backend_of):
    torch.manual_seed(0)
    model = SharedCheckpointed()
    n_params = sum(p.numel() for p in model.parameters())
    hooks = source_norm_hooks(model, backend_of(backend), hot_path, bucket_size_mb, True, monkeypatch)
    batches = shared_batches(5, torch.float32)
    windows = [batches[:3], batches[3:]]  # 3 micro-batches (arrivals learned in the first), then 2
    try:
        for w, window in enumerate(windows):
            expected = _reference_rows(model, window)
            for j, x in enumerate(window):
                hooks_backward(hooks, model(x), j == len(window) - 1)
            rows = hooks.window_source_sumsq()
            assert rows.shape == (len(window),) and rows.dtype == torch.float32 and rows.device.type == "cpu"
            for j, (got, want) in enumerate(zip(rows.tolist(), expected)):
                if w == 0 and j == 0 and bucket_size_mb < 1:
                    # Arrivals not learned yet: the later arrivals of shared/nested launched after their buckets.
                    assert math.isnan(got), "a solo late arrival must make its micro-batch's row NaN"
                else:
                    assert abs(got - want) <= sum_sq_rtol(n_params) * want, (w, j, got, want)
            hooks.reset_window()
            assert hooks.window_source_sumsq().numel() == 0, "reset_window() clears the source partials"
    finally:
        hooks.close()


@pytest.mark.parametrize("backend,hot_path", CONFIGS, indirect=["backend"])
def test_off_gives_none_and_drop_clears(backend, hot_path, monkeypatch, backend_of):
    torch.manual_seed(0)
    model = SharedCheckpointed()
    backend = backend_of(backend)
    off = source_norm_hooks(model, backend, hot_path, 25.0, False, monkeypatch)
    try:
        hooks_backward(off, model(shared_batches(1, torch.float32)[0]), True)
        assert off.window_source_sumsq() is None
    finally:
        off.close()
    on = source_norm_hooks(model, backend, hot_path, 25.0, True, monkeypatch)
    try:
        for x in shared_batches(2, torch.float32):
            hooks_backward(on, model(x), False)
        assert on.window_source_sumsq().numel() == 2
        on.drop()  # zero_grad(): the window's micro-batches are forgotten
        assert on.window_source_sumsq().numel() == 0
    finally:
        on.close()


def test_a_parameter_without_gradient_counts_zero(monkeypatch, backend_of):
    """Parameters that get no gradient (``extra``, ``nested``) leave their bucket incomplete (launched at end()) or
    empty: their part of the table is zero, not left uninitialized."""
    torch.manual_seed(0)
    model = SharedCheckpointed()
    for bucket_size_mb in (1e-6, 25.0):
        hooks = source_norm_hooks(model, backend_of("cpu"), "python", bucket_size_mb, True, monkeypatch)
        try:
            x = shared_batches(1, torch.float32)[0]
            expected = copy.deepcopy(model)
            expected(x, extra=False, twice=False).backward()
            want = sum(float(p.grad.double().square().sum()) for p in expected.parameters() if p.grad is not None)
            hooks_backward(hooks, model(x, extra=False, twice=False), True)
            got = hooks.window_source_sumsq().item()
            assert abs(got - want) <= sum_sq_rtol(10**6) * want, (bucket_size_mb, got, want)
        finally:
            hooks.close()


# ----------------------------------------------------------------------------------------------------- cost
def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(layers)], nn.Linear(32, 1))


TRITON_DIR = os.path.dirname(triton.__file__) if triton is not None else None


def _in_kernel(frame) -> bool:
    """A frame of a Triton kernel body run by the interpreter (``TRITON_INTERPRET=1``): device work, not host."""
    while frame is not None:
        code = frame.f_code
        if (TRITON_DIR is not None and code.co_filename.startswith(TRITON_DIR)) or code.co_name.endswith("_kernel"):
            return True
        frame = frame.f_back
        if frame is not None and frame.f_code.co_filename == __file__:
            return False
    return False


def _count_calls(fn) -> collections.Counter:
    """Python calls (and C functions called from Python) on this thread while ``fn`` runs, by function: the CPU
    backward runs the hooks here."""
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if _in_kernel(frame):
            return
        if event == "call":
            calls[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            calls[getattr(arg, "__qualname__", repr(arg))] += 1

    gc.disable()  # a collection would run gc callbacks (hypothesis registers one) inside the count
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def _cost(layers, backend, hot_path, measure, monkeypatch):
    """(Python calls, accumulate launches) of one micro-batch's backward, after a warm-up window."""
    model = _mlp(layers)
    hooks = source_norm_hooks(model, backend, hot_path, 25.0, measure, monkeypatch)
    x = torch.randn(4, 32)
    try:
        for _ in range(2):  # warm-up: caches, lazy imports, arrivals learned
            hooks_backward(hooks, model(x).square().mean(), False)
        hooks.reset_window()
        loss = model(x).square().mean()  # the forward outside the count
        before = hooks.launches
        calls = _count_calls(lambda: hooks_backward(hooks, loss, False))
        return calls, hooks.launches - before
    finally:
        hooks.close()


@pytest.mark.parametrize("backend,hot_path", CONFIGS, indirect=["backend"])
def test_measuring_adds_no_launch_and_no_python_per_parameter(backend, hot_path, monkeypatch, backend_of):
    backend = backend_of(backend)
    extra = {}
    for layers in (4, 24):
        calls_off, launches_off = _cost(layers, backend, hot_path, False, monkeypatch)
        calls_on, launches_on = _cost(layers, backend, hot_path, True, monkeypatch)
        assert launches_on == launches_off == 1, "one bucket: one accumulate launch per micro-batch, on or off"
        calls_on.subtract(calls_off)
        extra[layers] = calls_on
    # 4 vs 24 layers (10 vs 50 parameters): the calls measuring adds do not grow with the parameter count.
    assert extra[4] == extra[24], {layers: c.most_common(8) for layers, c in extra.items()}
    if hot_path == "native" and backend.hot_path_kernels:  # C++ kernels: not one Python call more
        assert sum(extra[4].values()) == 0, extra[4].most_common(8)
