"""The native hot path (``csrc/hot_path.cpp``, ``gaengine/hot_path.py``): no Python per parameter, one launch per bucket.

* During ``acc.backward()`` the number of Python calls into gaengine does not grow with the number of
  parameters (counted with ``sys.setprofile``; autograd runs CPU hooks on the calling thread, so a Python hook
  would be seen). The Python fallback (``GAENGINE_HOT_PATH=python``) is measured the same way: its count grows,
  which shows that the counter sees per-parameter hooks.
* Launches per micro-batch are at most buckets + 1.
* ``torch.ops.gaengine.accumulate_bucket_`` (the CPU bucket launch) against the fp64 oracle: bitwise for an unscaled
  add; its partials (of the values written, fp64) and source partials (of the sources) within their budgets of the
  fp64 oracle, flagged where non-finite, and bitwise the same whatever else the bucket holds.
* The native and the Python hot paths give bitwise-equal buffers and updates over windows, with unused
  parameters, tied weights and several buckets; and the fallback says so once.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch
from torch import nn

import gaengine
from tests.reference import accumulate_fp64, sum_sq_fp64
from tests.tolerances import assert_bitwise_equal, sum_sq_rtol

_C = pytest.importorskip("gaengine._C")
GAENGINE_DIR = os.path.dirname(os.path.abspath(gaengine.__file__))


class Chain(nn.Module):
    """``n_params`` small parameters (16 elements each, bf16 or fp32), every one used by each forward."""

    def __init__(self, n_params: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(16, dtype=dtype) * 0.1) for _ in range(n_params))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x * w + 0.1)
        return x


def _loss(model, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (model(torch.randn(4, 16, generator=g).to(dtype)).float() ** 2).mean()


def _gaengine_calls_in_backward(acc, loss) -> int:
    """Python function calls whose code lives in the gaengine package, during ``acc.backward(loss)``."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(GAENGINE_DIR):
            calls += 1

    sys.setprofile(profile)
    try:
        acc.backward(loss)
    finally:
        sys.setprofile(None)
    return calls


def _calls_for(n_params: int, hot_path: str, monkeypatch) -> int:
    monkeypatch.setenv("GAENGINE_HOT_PATH", hot_path)
    torch.manual_seed(0)
    model = Chain(n_params)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4,
                                       backend="cpu", bucket_size_mb=1e-4)
    assert acc.hooks.native == (hot_path == "native")
    _gaengine_calls_in_backward(acc, _loss(model, 0))  # warm-up: first-use imports are not the hot path
    counts = [_gaengine_calls_in_backward(acc, _loss(model, k)) for k in (1, 2)]
    acc.close()
    assert counts[0] == counts[1]
    return counts[0]


def test_no_python_per_parameter_in_backward(monkeypatch):
    few, many = _calls_for(8, "native", monkeypatch), _calls_for(64, "native", monkeypatch)
    assert few == many, f"Python calls into gaengine grow with the parameters: {few} for 8, {many} for 64"
    # The same count on the Python hooks grows by at least one call per parameter: the counter sees hooks.
    py_few, py_many = _calls_for(8, "python", monkeypatch), _calls_for(64, "python", monkeypatch)
    assert py_many - py_few >= 56


@pytest.mark.parametrize("bucket_size_mb", [1e-4, 1e-3, 25.0], ids=["one-param-buckets", "small-buckets", "one-bucket"])
def test_launches_per_micro_batch_at_most_buckets_plus_one(bucket_size_mb):
    model = Chain(40, torch.bfloat16)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3,
                                       backend="cpu", bucket_size_mb=bucket_size_mb)
    assert acc.hooks.native
    n_buckets = acc.hooks.num_buckets
    for k in range(6):
        before = acc.hooks.launches
        acc.backward(_loss(model, k, torch.bfloat16))
        launched = acc.hooks.launches - before
        assert 1 <= launched <= n_buckets + 1, f"{launched} launches for {n_buckets} buckets"
        acc.step()
    acc.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_accumulate_bucket_against_fp64(dtype):
    sizes = [1, 127, 4097, 65540, 70000]
    offsets, cursor = [], 0
    for n in sizes:
        offsets.append(cursor)
        cursor += (n + 63) // 64 * 64
    g = torch.Generator().manual_seed(1)
    dst = torch.randn(cursor, generator=g)
    srcs = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    overwrite = [False, True, False, True, False]
    out = dst.clone()
    for j, (o, n) in enumerate(zip(offsets, sizes)):
        if overwrite[j]:
            out[o:o + n] = float("nan")  # poisoned: an overwrite must not read it
    partials = torch.full((len(sizes), 2), float("nan"), dtype=torch.float64)
    source_partials = partials.clone()
    torch.ops.gaengine.accumulate_bucket_(out, srcs, offsets, overwrite, partials, source_partials)
    for j, (o, n) in enumerate(zip(offsets, sizes)):
        exact = accumulate_fp64(dst[o:o + n], srcs[j], overwrite=overwrite[j])
        assert_bitwise_equal(out[o:o + n], exact.to(torch.float32), f"source {j}")
        # The values written: two fp64 sums of n squares (ours, the oracle's), each within (n - 1) * 2^-53 of the
        # exact sum. The sources: the AVX2 kernel sums fp32 squares four per lane before fp64 (csrc/cpu_kernels.h),
        # within the fp32 budget of tests/tolerances.py.
        for what, table, values, rtol in (("partials", partials, out[o:o + n], 2 * n * 2.0**-53),
                                          ("source partials", source_partials, srcs[j], sum_sq_rtol(n))):
            want = sum_sq_fp64(values)
            assert abs(table[j, 0].item() - want) <= rtol * want, f"{what} of source {j}"
            assert table[j, 1].item() == 0.0, f"{what} flag of source {j}"
        # The bits of a source's partials do not depend on the rest of its bucket.
        row, source_row = torch.empty(1, 2, dtype=torch.float64), torch.empty(1, 2, dtype=torch.float64)
        torch.ops.gaengine.accumulate_bucket_(dst[o:o + n].clone(), [srcs[j]], [0], [overwrite[j]], row, source_row)
        assert_bitwise_equal(row[0], partials[j], f"partials of source {j} alone")
        assert_bitwise_equal(source_row[0], source_partials[j], f"source partials of source {j} alone")


def test_accumulate_bucket_source_partials_flag_non_finite_sources():
    """A non-finite source value flags that source's source partials (and, added, its partials); a finite source
    added to a non-finite main_grad value flags only the partials of the values written."""
    dst = torch.zeros(8200)
    dst[4200] = float("inf")
    srcs = [torch.ones(4100), torch.ones(4100)]
    srcs[0][4099] = float("inf")
    partials = torch.empty(2, 2, dtype=torch.float64)
    source_partials = torch.empty(2, 2, dtype=torch.float64)
    torch.ops.gaengine.accumulate_bucket_(dst, srcs, [0, 4100], [False, False], partials, source_partials)
    assert partials[:, 1].tolist() == [1.0, 1.0]
    assert source_partials[:, 1].tolist() == [1.0, 0.0]
    assert source_partials[1, 0].item() == 4100.0


def test_accumulate_bucket_contracts():
    dst = torch.zeros(64)
    with pytest.raises(RuntimeError, match="same length"):
        torch.ops.gaengine.accumulate_bucket_(dst, [torch.ones(4)], [0, 8], [False], None)
    with pytest.raises(RuntimeError, match="outside dst"):
        torch.ops.gaengine.accumulate_bucket_(dst, [torch.ones(8)], [60], [False], None)
    assert bool((dst == 0).all())


def _run(hot_path: str, monkeypatch, dtype=torch.bfloat16, bucket_size_mb=1e-3, windows=3, k=3):
    """A model with an unused branch and a tied weight, trained over ``windows`` windows; returns its state."""
    monkeypatch.setenv("GAENGINE_HOT_PATH", hot_path)
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(16, 16, bias=False)
            self.body = Chain(12)
            self.unused = nn.Linear(16, 16)

        def forward(self, x):
            h = self.emb(x)
            h = self.body(h)
            return h @ self.emb.weight  # the tied use: two contributions summed by AccumulateGrad

    model = Tied().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=k, max_grad_norm=0.5, backend="cpu",
                                       bucket_size_mb=bucket_size_mb)
    norms = []
    for w in range(windows):
        for m in range(k):
            acc.backward(_loss(model, 10 * w + m, dtype))
        norms.append(acc.step().grad_norm)
    acc.close()
    return [p.detach().clone() for p in model.parameters()], torch.stack(norms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_equals_python_hooks(dtype, monkeypatch):
    native, native_norms = _run("native", monkeypatch, dtype)
    python, python_norms = _run("python", monkeypatch, dtype)
    assert_bitwise_equal(native_norms, python_norms, "grad norms")
    for a, b in zip(native, python):
        assert torch.equal(a, b)


def test_close_removes_the_hooks():
    model = Chain(4)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, backend="cpu")
    assert acc.hooks.native
    acc.close()
    _loss(model, 0).backward()  # a plain backward again: .grad is autograd's
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
    _loss(ref, 0).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_python_fallback_says_so_once(monkeypatch, caplog):
    monkeypatch.setenv("GAENGINE_HOT_PATH", "python")
    with caplog.at_level(logging.INFO, logger="gaengine"):
        for _ in range(2):
            acc = gaengine.GradientAccumulator(Chain(2), None, accumulation_steps=2, backend="cpu")
            assert not acc.hooks.native
            acc.close()
    assert sum("hooks run in Python" in r.getMessage() for r in caplog.records) <= 1


def test_bad_hot_path_setting(monkeypatch):
    monkeypatch.setenv("GAENGINE_HOT_PATH", "fast")
    with pytest.raises(ValueError, match="GAENGINE_HOT_PATH"):
        gaengine.GradientAccumulator(Chain(2), None, accumulation_steps=2)


class _TwoStreams(torch.nn.Module):
    """`side`'s forward (so its backward and its gradients) runs on a side stream, slowed by a sleep kernel, while
    the rest runs on the caller's stream: a bucket mixes gradients made ready on two streams."""

    def __init__(self, d=256):
        super().__init__()
        self.main = torch.nn.Linear(d, d)
        self.side = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, 1)
        self.stream = None

    def forward(self, x):
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(1_000_000)  # the side stream runs late
            s = torch.tanh(self.side(x))
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.out(torch.tanh(self.main(x)) + s).float().pow(2).mean()


@pytest.mark.cuda
@pytest.mark.parametrize("bucket_size_mb", [1e-4, 25.0], ids=["bucket-per-param", "one-bucket"])
def test_gradients_from_two_streams_equal_one_op_per_parameter(bucket_size_mb, monkeypatch):
    """The native hooks' bucket launch waits on the stream of every gradient it reads and records its own stream on
    them (csrc/hot_path.cpp), against backend='torch' (one ATen op per gradient, ordered by autograd itself)."""
    monkeypatch.setenv("GAENGINE_HOT_PATH", "native")
    results = {}
    for backend in ("auto", "torch"):
        torch.manual_seed(0)
        model = _TwoStreams().cuda().to(torch.bfloat16)
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=4, max_grad_norm=None, backend=backend,
                                           bucket_size_mb=bucket_size_mb)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):
            acc.backward(model(torch.randn(64, 256, device="cuda", generator=g, dtype=torch.bfloat16)))
            torch.cuda.empty_cache()  # freed gradients go back to the allocator at once
        results[backend] = acc.main_grad.data.clone()
        acc.close()
    assert_bitwise_equal(results["auto"], results["torch"], "main_grad")


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_window_of_empty_parameters_has_norm_zero(hot_path, monkeypatch):
    """Every parameter empty: the free-norm partials have no column (no uninitialised one read as the norm)."""
    monkeypatch.setenv("GAENGINE_HOT_PATH", hot_path)
    params = [nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0, 3))]
    acc = gaengine.GradientAccumulator(params, None, accumulation_steps=2, max_grad_norm=1.0)
    for _ in range(2):
        acc.backward(sum(p.sum() for p in params) + torch.zeros((), requires_grad=True))
    result = acc.step()
    assert float(result.grad_norm) == 0.0 and not bool(result.skipped) and float(result.clip_coef) == 1.0


# ------------------------------------------------------------------------------------------------ source norms
def check_source_rows_without_gradient(backend, monkeypatch) -> None:
    """Native hooks measuring sources, on a model whose ``extra`` and ``nested`` parameters get no gradient: their
    buckets are launched incomplete at ``end()`` (one bucket) or not at all (a bucket per parameter), and their part
    of each micro-batch's table is zeroed, so every row equals the fp64 plain recipe's (tests/test_source_norms.py
    for the reference). backend: a ``gaengine.backends.Backend`` with native hooks; also run on the emulated cuda
    backend (tests/test_cuda_emulation_engine.py)."""
    from tests.test_double_arrival import SharedCheckpointed, _batches  # noqa: PLC0415
    from tests.test_source_norms import _backward, _hooks  # noqa: PLC0415

    torch.manual_seed(0)
    model = SharedCheckpointed()
    batches = _batches(3, torch.float32)
    want = []
    for x in batches:
        expected = copy.deepcopy(model)
        expected(x, extra=False, twice=False).backward()
        want.append(sum(float(p.grad.double().square().sum()) for p in expected.parameters() if p.grad is not None))
    n_params = sum(p.numel() for p in model.parameters())
    for bucket_size_mb in (1e-6, 25.0):
        hooks = _hooks(model, backend, "native", bucket_size_mb, True, monkeypatch)
        try:
            _backward(hooks, model(batches[0]), False)  # every parameter: the tables' memory holds gradients
            hooks.reset_window()
            for j, x in enumerate(batches):
                _backward(hooks, model(x, extra=False, twice=False), j == len(batches) - 1)
            rows = hooks.window_source_sumsq().tolist()
            assert len(rows) == len(batches)
            for got, exact in zip(rows, want):
                assert abs(got - exact) <= sum_sq_rtol(n_params) * exact, (bucket_size_mb, rows, want)
        finally:
            hooks.close()


def test_source_rows_count_zero_without_gradient(monkeypatch):
    check_source_rows_without_gradient(gaengine.backends.get_backend("cpu", "cpu"), monkeypatch)
