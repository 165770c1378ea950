"""The compiled CPU backend ``gaengine._C`` against the fp64 oracles (tests/reference.py).

Budgets (tests/tolerances.py): an unscaled accumulate is bitwise equal to torch's ``dst.add_(src)``, an
overwrite bitwise equal to ``src.float()``; a scaled one is within 1 fp32 ulp of the fp64 value; a sum of
squares is within ``sum_sq_rtol(n)`` and has the same bits for any thread count. Every op is reached
through ``get_backend("cpu")`` and through ``gaengine.ops``. Bad input to those is refused in Python
(``ValueError`` / ``TypeError``, nothing written, ``gaengine._C`` never called); the C++ contracts themselves are
checked on ``gaengine._C`` in a child process (``tests/child_contracts.py``), so a crashing image cannot take
the test run down.
Skipped as a whole when the extension is not built (``GAENGINE_BUILD_EXT=0``, or a failed ``auto`` build).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

_C = pytest.importorskip("gaengine._C", reason="gaengine._C is not built (pip install --no-build-isolation -e .)")

from gaengine import ops  # noqa: E402
from gaengine.backends import get_backend  # noqa: E402
from tests import child_contracts  # noqa: E402
from tests.child_contracts import check_raw_contracts, skip_or_fail_on_crash  # noqa: E402
from tests.reference import accumulate_fp64, sum_sq_fp64  # noqa: E402
from tests.tolerances import assert_bitwise_equal, assert_within_ulp, sum_sq_rtol  # noqa: E402

# 1, a partial vector, a partial block, just past one norm chunk (65536), and a large odd size: none is a
# multiple of the vector width (8), the unroll (32), the parallel block (4096) or the norm chunk.
SIZES = [1, 127, 4097, 65537 + 3, 1_000_003]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [pytest.param(n, dt, id=f"n{n}-{name}") for n in SIZES for name, dt in DTYPES.items()]
DTYPE_PARAMS = [pytest.param(dt, id=name) for name, dt in DTYPES.items()]
VIA = ["backend", "ops"]


def poisoned(n: int) -> torch.Tensor:
    """An fp32 buffer full of NaN: a slot the kernel forgets to write shows up at once."""
    return torch.full((n,), float("nan"), dtype=torch.float32)


def grad_like(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, dtype=torch.float32).to(dtype)


def accumulate(via: str, dst, src, scale=1.0, overwrite=False):
    if via == "ops":
        return ops.accumulate_(dst, src, scale, overwrite=overwrite, backend="cpu")
    return get_backend("cpu").accumulate_(dst, src, scale, overwrite)


def l2norm_sq(via: str, x):
    return ops.l2norm_sq(x, backend="cpu") if via == "ops" else get_backend("cpu").l2norm_sq(x)


def scale(via: str, x, coef):
    return ops.scale_(x, coef, backend="cpu") if via == "ops" else get_backend("cpu").scale_(x, coef)


def test_backend_is_the_extension():
    backend = get_backend("cpu")
    assert backend.name == "cpu" and backend._C is _C


# ---------------------------------------------------------------------------------------------- accumulate_


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("n, dtype", CASES)
def test_accumulate_unscaled_is_bitwise_torch(n, dtype, via):
    dst, src = torch.randn(n), grad_like(n, dtype)
    expected = dst.clone().add_(src)
    out = accumulate(via, dst, src)
    assert out is dst
    assert_bitwise_equal(dst, expected, "dst + src")


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("n, dtype", CASES)
def test_accumulate_overwrite_is_bitwise_copy(n, dtype, via):
    dst, src = poisoned(n), grad_like(n, dtype)
    accumulate(via, dst, src, overwrite=True)
    assert_bitwise_equal(dst, src.float(), "overwrite")


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("scale_value", [1 / 3, 0.125, -7.3e-5], ids=["third", "eighth", "neg-tiny"])
@pytest.mark.parametrize("n, dtype", CASES)
def test_accumulate_scaled_within_1ulp(n, dtype, scale_value, overwrite):
    dst, src = (poisoned(n) if overwrite else torch.randn(n)), grad_like(n, dtype)
    exact = accumulate_fp64(dst, src, scale_value, overwrite)
    accumulate("backend", dst, src, scale_value, overwrite)
    assert_within_ulp(dst, exact, src.to(torch.float64) * scale_value, what=f"dst + src * {scale_value}")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_accumulate_tensor_scale_and_any_shape_via_ops(dtype):
    dst, src = torch.randn(37, 29), grad_like(37 * 29, dtype).reshape(29, 37)
    coef = torch.tensor(0.3, dtype=torch.float32)  # the scale is coef's fp32 value, 0.300000011920929
    exact = accumulate_fp64(dst, src, coef.item(), False)
    ops.accumulate_(dst, src, coef, backend="cpu")
    assert_within_ulp(dst.reshape(-1), exact.reshape(-1), src.to(torch.float64).reshape(-1) * coef.item())


def test_accumulate_empty():
    dst = torch.empty(0)
    for dtype in DTYPES.values():
        _C.accumulate_(dst, torch.empty(0, dtype=dtype), 1.0, False)
        _C.accumulate_(dst, torch.empty(0, dtype=dtype), 0.5, True)


def test_accumulate_view_into_flat_buffer_touches_only_the_view():
    flat = torch.randn(10_000)
    before = flat.clone()
    view, src = flat[1003:1003 + 4097], grad_like(4097, torch.bfloat16)  # odd offset: unaligned vectors
    expected = view.clone().add_(src)
    get_backend("cpu").accumulate_(view, src)
    assert_bitwise_equal(flat[1003:1003 + 4097], expected, "view")
    assert_bitwise_equal(flat[:1003], before[:1003], "before the view")
    assert_bitwise_equal(flat[1003 + 4097:], before[1003 + 4097:], "after the view")


# ------------------------------------------------------------------------------------------------ l2norm_sq


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("n, dtype", CASES)
def test_l2norm_sq_matches_fp64(n, dtype, via):
    x = grad_like(n, dtype)
    sum_sq, found_inf = l2norm_sq(via, x)
    for t in (sum_sq, found_inf):
        assert t.dim() == 0 and t.dtype == torch.float32 and t.device.type == "cpu"
    exact = sum_sq_fp64(x)
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(n) * exact, (sum_sq.item(), exact)
    assert found_inf.item() == 0.0


def test_l2norm_sq_empty():
    for dtype in DTYPES.values():
        sum_sq, found_inf = _C.l2norm_sq(torch.empty(0, dtype=dtype))
        assert sum_sq.item() == 0.0 and found_inf.item() == 0.0


def test_l2norm_sq_of_huge_finite_values_is_not_found_inf():
    # Squares of fp32 max overflow fp32, not the fp64 accumulator: the flag stays 0 (and sum_sq reads inf,
    # as torch.dot's would).
    x = torch.full((1000,), torch.finfo(torch.float32).max)
    sum_sq, found_inf = get_backend("cpu").l2norm_sq(x)
    assert found_inf.item() == 0.0 and sum_sq.item() == float("inf")


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("via", VIA)
def test_l2norm_sq_found_inf(dtype, bad, position, via):
    n = 200_003  # four norm chunks, the last one with a scalar tail
    x = grad_like(n, dtype)
    x[{"first": 0, "middle": n // 2, "last": n - 1}[position]] = bad
    sum_sq, found_inf = l2norm_sq(via, x)
    assert found_inf.item() == 1.0
    assert not torch.isfinite(sum_sq)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_l2norm_sq_same_bits_for_any_thread_count(dtype):
    x = grad_like(1_000_003, dtype) * 3.7
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(get_backend("cpu").l2norm_sq(x)[0])
    finally:
        torch.set_num_threads(threads)
    for t, r in zip((2, 3), results[1:]):
        assert_bitwise_equal(r, results[0], f"sum_sq with {t} threads vs 1")


# --------------------------------------------------------------------------------------------------- scale_


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
def test_scale_is_bitwise_torch(n, via):
    x, coef = torch.randn(n), torch.tensor(0.37)
    expected = x.clone().mul_(coef)
    out = scale(via, x, coef)
    assert out is x
    assert_bitwise_equal(x, expected, "x * coef")


def test_scale_empty_and_non_fp32_coef():
    _C.scale_(torch.empty(0), torch.tensor(2.0))
    x = torch.randn(1000)
    expected = x.clone().mul_(torch.tensor(0.1, dtype=torch.float64).float())
    _C.scale_(x, torch.tensor(0.1, dtype=torch.float64))  # read as float, like torch's x.mul_(coef)
    assert_bitwise_equal(x, expected)


# ----------------------------------------------------------------------------------------- accumulate_sumsq_

SUMSQ_SIZES = [1, 127, 4097, 1_000_003]
SUMSQ_CASES = [pytest.param(n, dt, id=f"n{n}-{name}") for n in SUMSQ_SIZES for name, dt in DTYPES.items()]
SUMSQ_MODES = [pytest.param(1.0, False, id="add"), pytest.param(1.0, True, id="overwrite"),
               pytest.param(1 / 3, False, id="scaled-add"), pytest.param(-0.125, True, id="scaled-overwrite")]


def sumsq_partials(rows: int = 3) -> torch.Tensor:
    return torch.full((rows, 2), float("nan"), dtype=torch.float64)  # a slot left unwritten shows up at once


@pytest.mark.parametrize("scale_value, overwrite", SUMSQ_MODES)
@pytest.mark.parametrize("n, dtype", SUMSQ_CASES)
def test_accumulate_sumsq_dst_is_accumulate_and_sum_is_fp64(n, dtype, scale_value, overwrite):
    dst, src = torch.randn(n), grad_like(n, dtype)
    expected = dst.clone()
    get_backend("cpu").accumulate_(expected, src, scale_value, overwrite)
    partials = sumsq_partials()
    out = get_backend("cpu").accumulate_sumsq_(dst, src, scale_value, overwrite, partials, 1)
    assert out is dst
    assert_bitwise_equal(dst, expected, "dst vs accumulate_")
    if scale_value == 1.0:
        assert_bitwise_equal(dst, (src.float() if overwrite else expected), "dst vs torch")
    exact = sum_sq_fp64(dst)  # the oracle of the values written
    assert abs(partials[1, 0].item() - exact) <= sum_sq_rtol(n) * exact, (partials[1, 0].item(), exact)
    assert partials[1, 1].item() == 0.0
    assert torch.isnan(partials[0]).all() and torch.isnan(partials[2]).all(), "other rows must be untouched"


@pytest.mark.parametrize("n, dtype", SUMSQ_CASES)
def test_accumulate_sumsq_torch_base_agrees(n, dtype):
    dst, src = torch.randn(n), grad_like(n, dtype)
    dst_ref, p_ref, p = dst.clone(), sumsq_partials(2), sumsq_partials(2)
    get_backend("torch").accumulate_sumsq_(dst_ref, src, 1.0, False, p_ref, 0)
    get_backend("cpu").accumulate_sumsq_(dst, src, 1.0, False, p, 0)
    assert_bitwise_equal(dst, dst_ref, "cpu dst vs torch base")
    assert abs(p[0, 0].item() - p_ref[0, 0].item()) <= sum_sq_rtol(n) * p_ref[0, 0].item()
    assert p[0, 1].item() == p_ref[0, 1].item() == 0.0
    assert torch.isnan(p[1]).all() and torch.isnan(p_ref[1]).all()


def test_accumulate_sumsq_tensor_scale_and_empty():
    dst, src = torch.randn(37, 29), grad_like(37 * 29, torch.bfloat16).reshape(29, 37)
    coef = torch.tensor(0.3, dtype=torch.float32)
    expected = dst.clone()
    get_backend("cpu").accumulate_(expected, src, coef)
    partials = sumsq_partials(1)
    get_backend("cpu").accumulate_sumsq_(dst, src, coef, False, partials, 0)
    assert_bitwise_equal(dst, expected)
    exact = sum_sq_fp64(dst)
    assert abs(partials[0, 0].item() - exact) <= sum_sq_rtol(dst.numel()) * exact
    for dtype in DTYPES.values():
        partials = sumsq_partials(1)
        _C.accumulate_sumsq_(torch.empty(0), torch.empty(0, dtype=dtype), 1.0, False, partials, 0)
        assert partials.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_accumulate_sumsq_found_inf(dtype, bad, position, backend):
    n = 200_003  # four norm chunks, the last one with a scalar tail
    dst, src = torch.randn(n), grad_like(n, dtype)
    src[{"first": 0, "middle": n // 2, "last": n - 1}[position]] = bad
    partials = torch.zeros(2, 2, dtype=torch.float64)
    get_backend(backend).accumulate_sumsq_(dst, src, 1.0, False, partials, 1)
    assert partials[1, 1].item() == 1.0
    assert not torch.isfinite(partials[1, 0])
    assert partials[0].tolist() == [0.0, 0.0]


def test_accumulate_sumsq_flags_only_the_written_values():
    # An inf in dst that an overwrite replaces is not counted; huge finite values do not set the flag.
    dst, src = torch.randn(5000), grad_like(5000, torch.float32)
    dst[17] = float("inf")
    partials = torch.zeros(1, 2, dtype=torch.float64)
    _C.accumulate_sumsq_(dst, src, 1.0, True, partials, 0)
    assert partials[0, 1].item() == 0.0 and torch.isfinite(partials[0, 0])
    big = torch.full((1000,), torch.finfo(torch.float32).max)
    _C.accumulate_sumsq_(torch.zeros(1000), big, 1.0, False, partials, 0)
    # fp64 partials keep the sum finite (l2norm_sq's fp32 result would read inf)
    assert partials[0, 1].item() == 0.0
    assert partials[0, 0].item() == pytest.approx(1000 * torch.finfo(torch.float32).max ** 2, rel=1e-12)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_accumulate_sumsq_same_bits_for_any_thread_count(dtype):
    dst0, src = torch.randn(1_000_003), grad_like(1_000_003, dtype) * 3.7
    threads = torch.get_num_threads()
    dsts, sums = [], []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            dst, partials = dst0.clone(), torch.zeros(1, 2, dtype=torch.float64)
            get_backend("cpu").accumulate_sumsq_(dst, src, 1.0, False, partials, 0)
            dsts.append(dst)
            sums.append(partials[0, 0].clone())
    finally:
        torch.set_num_threads(threads)
    for t, d, s in zip((2, 3), dsts[1:], sums[1:]):
        assert_bitwise_equal(d, dsts[0], f"dst with {t} threads vs 1")
        assert s.item() == sums[0].item(), f"sum_sq with {t} threads vs 1: {s.item()!r} != {sums[0].item()!r}"


_F64 = torch.float64


@pytest.mark.parametrize(
    "partials, index, message",
    [
        (torch.zeros(2, 2), 0, "partials must be (a )?float64"),
        (torch.zeros(2, 3, dtype=_F64), 0, r"partials must have shape \(n, 2\)"),
        (torch.zeros(4, dtype=_F64), 0, r"partials must have shape \(n, 2\)"),
        (torch.zeros(2, 4, dtype=_F64)[:, :2], 0, "partials must be contiguous"),
        (torch.zeros(2, 2, dtype=_F64), 2, "index 2 is out of range"),
        (torch.zeros(2, 2, dtype=_F64), -1, "index -1 is out of range"),
        (torch.zeros(2, 2, dtype=_F64, device="meta"), 0, "partials (must be a CPU tensor|is on meta)"),
    ],
    ids=["fp32", "shape-n3", "1d", "strided", "index-past-end", "index-negative", "meta"],
)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_accumulate_sumsq_contract_errors_name_the_argument(partials, index, message, backend):
    """Through the backends: refused in Python (``ValueError``) before ``gaengine._C`` is called."""
    dst = torch.randn(8)
    before, partials_before = dst.clone(), partials.clone() if partials.device.type == "cpu" else None
    with pytest.raises(ValueError, match=message):
        get_backend(backend).accumulate_sumsq_(dst, torch.ones(8, dtype=torch.bfloat16), 1.0, False, partials, index)
    assert_bitwise_equal(dst, before, "dst after a refused call")
    if partials_before is not None:
        assert_bitwise_equal(partials, partials_before, "partials after a refused call")


# --------------------------------------------------------------------------------------------------- errors


def strided(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(n, 2, dtype=dtype)[:, 0]


# The C++ contracts themselves (TORCH_CHECK in csrc/cpu_ops.cpp), called on gaengine._C directly. They run in a
# child process (tests/child_contracts.py): on an image whose extensions crash on a failed TORCH_CHECK the child
# dies, and the test skips when a plain load_inline extension crashes the same way, or fails when it does not.
# Each setup defines check(): the refused call wrote nothing.
_KEEP = "dst = torch.randn(4); before = dst.clone()\ndef check(): assert torch.equal(dst, before), 'dst was written'\n"
_KEEP_X = "x = torch.randn(4); before = x.clone()\ndef check(): assert torch.equal(x, before), 'x was written'\n"
_KEEP_SUMSQ = ("dst = torch.randn(8); before = dst.clone()\n"
               "def check(): assert torch.equal(dst, before), 'dst was written'\n")
_RAW_CONTRACTS = [
    ("dst-fp64", "", "_C.accumulate_(torch.zeros(4, dtype=torch.float64), torch.zeros(4), 1.0, False)",
     "dst must be float32"),
    ("dst-bf16", "", "_C.accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), 1.0, False)",
     "dst must be float32"),
    ("src-int32", _KEEP, "_C.accumulate_(dst, torch.zeros(4, dtype=torch.int32), 1.0, False)",
     "src must be float32, bfloat16 or float16"),
    ("src-fp64", _KEEP, "_C.accumulate_(dst, torch.zeros(4, dtype=torch.float64), 1.0, False)",
     "src must be float32, bfloat16 or float16"),
    ("dst-strided", "", "_C.accumulate_(strided(4), torch.zeros(4), 1.0, False)", "dst must be contiguous"),
    ("src-strided", _KEEP, "_C.accumulate_(dst, strided(4, torch.bfloat16), 1.0, False)", "src must be contiguous"),
    ("numel-mismatch", _KEEP, "_C.accumulate_(dst, torch.ones(3, dtype=torch.bfloat16), 1.0, False)",
     "src has 3 elements but dst has 4"),
    ("dst-meta", "", "_C.accumulate_(torch.zeros(4, device='meta'), torch.zeros(4), 1.0, False)",
     "dst must be a CPU tensor"),
    ("src-meta", _KEEP, "_C.accumulate_(dst, torch.zeros(4, device='meta'), 1.0, False)", "src must be a CPU tensor"),
    ("norm-int64", "", "_C.l2norm_sq(torch.zeros(4, dtype=torch.int64))", "x must be float32, bfloat16 or float16"),
    ("norm-strided", "", "_C.l2norm_sq(strided(4))", "x must be contiguous"),
    ("norm-meta", "", "_C.l2norm_sq(torch.zeros(4, device='meta'))", "x must be a CPU tensor"),
    ("scale-bf16", "", "_C.scale_(torch.zeros(4, dtype=torch.bfloat16), torch.tensor(1.0))", "x must be float32"),
    ("scale-strided", "", "_C.scale_(strided(4), torch.tensor(1.0))", "x must be contiguous"),
    ("coef-1d", _KEEP_X, "_C.scale_(x, torch.ones(1))", "coef must be a 0-d tensor"),
    ("coef-meta", _KEEP_X, "_C.scale_(x, torch.tensor(1.0, device='meta'))", "coef must be a CPU tensor"),
    ("sumsq-numel", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(3), 1.0, False, torch.zeros(1, 2, "
     "dtype=torch.float64), 0)", "src has 3 elements but dst has 8"),
    ("sumsq-fp32", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, torch.zeros(2, 2), 0)",
     "partials must be (a )?float64"),
    ("sumsq-shape-n3", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, torch.zeros(2, 3, "
     "dtype=torch.float64), 0)", r"partials must have shape \(n, 2\)"),
    ("sumsq-1d", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, torch.zeros(4, "
     "dtype=torch.float64), 0)", r"partials must have shape \(n, 2\)"),
    ("sumsq-strided", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, torch.zeros(2, 4, "
     "dtype=torch.float64)[:, :2], 0)", "partials must be contiguous"),
    ("sumsq-index-past-end", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, torch.zeros(2, 2, "
     "dtype=torch.float64), 2)", "index 2 is out of range"),
    ("sumsq-index-negative", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, torch.zeros(2, 2, "
     "dtype=torch.float64), -1)", "index -1 is out of range"),
    ("sumsq-meta", _KEEP_SUMSQ, "_C.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, torch.zeros(2, 2, "
     "dtype=torch.float64, device='meta'), 0)", "partials must be a CPU tensor"),
]


def test_raw_cpp_contracts_name_the_argument():
    """Every TORCH_CHECK of gaengine._C's CPU ops raises RuntimeError naming the argument and writes nothing."""
    check_raw_contracts(_RAW_CONTRACTS)


def test_raw_contract_child_reports_a_wrong_message():
    """The child harness itself: a case whose message does not match is reported, not silently passed."""
    with pytest.raises(AssertionError, match="norm-int64: expected RuntimeError matching 'no such message'"):
        check_raw_contracts([("norm-int64", "", "_C.l2norm_sq(torch.zeros(4, dtype=torch.int64))", "no such message")])


_SEGFAULT = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"


def test_raw_contract_child_crash_skips_when_every_extension_crashes(monkeypatch):
    monkeypatch.setattr(child_contracts, "control_crashes", lambda: (True, "control died of SIGSEGV"))
    with pytest.raises(pytest.skip.Exception, match="crash on a failed TORCH_CHECK"):
        check_raw_contracts([("crash", "", _SEGFAULT, "")])


def test_raw_contract_child_crash_fails_when_only_ours_crashes(monkeypatch):
    monkeypatch.setattr(child_contracts, "control_crashes", lambda: (False, "control exit 0: raised RuntimeError"))
    with pytest.raises(pytest.fail.Exception, match=r"in case 'crash'\) died of SIGSEGV.*the crash is gaengine's"):
        check_raw_contracts([("crash", "", _SEGFAULT, "")])


def test_control_extension_raises_runtime_error():
    """The control itself (a load_inline module failing a TORCH_CHECK; built once, about 30 s): on a healthy
    image it raises RuntimeError; where it crashes, this test skips with the reason the raw-contract tests give."""
    crashed, detail = child_contracts.control_crashes()
    if crashed:
        pytest.skip(child_contracts.CRASH_SKIP_REASON)
    assert "raised RuntimeError: control: a failed TORCH_CHECK" in detail, detail


# The same contracts through the public functions (the backend and gaengine.ops): refused in Python, with a
# ValueError naming the argument (also a RuntimeError: gaengine.backends.ContractError), before gaengine._C is
# called, so no failed TORCH_CHECK is ever reached from them.
_PUBLIC_CONTRACTS = [
    pytest.param(lambda d: (torch.zeros(4, dtype=torch.float64), torch.zeros(4)), "dst must be float32", id="dst-fp64"),
    pytest.param(lambda d: (d, torch.zeros(4, dtype=torch.int32)), "src must be float32, bfloat16 or float16",
                 id="src-int32"),
    pytest.param(lambda d: (d, torch.zeros(4, dtype=torch.float64)), "src must be float32, bfloat16 or float16",
                 id="src-fp64"),
    pytest.param(lambda d: (strided(4), torch.zeros(4)), "dst must be contiguous", id="dst-strided"),
    pytest.param(lambda d: (d, torch.ones(3, dtype=torch.bfloat16)), "src has 3 elements but dst has 4",
                 id="numel-mismatch"),
    pytest.param(lambda d: (d, torch.zeros(4, device="meta")), "src must be a CPU tensor|src is on meta",
                 id="src-meta"),
]


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("args, message", _PUBLIC_CONTRACTS)
def test_public_accumulate_refuses_bad_input_in_python(args, message, via):
    dst = torch.randn(4)
    before = dst.clone()
    bad_dst, src = args(dst)
    with pytest.raises(ValueError, match=message):
        accumulate(via, bad_dst, src)
    assert_bitwise_equal(dst, before, "dst after a refused call")


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize(
    "x, message",
    [
        pytest.param(torch.zeros(4, dtype=torch.int64), "x must be float32, bfloat16 or float16", id="int64"),
        pytest.param(torch.zeros(4, dtype=torch.float64), "x must be float32, bfloat16 or float16", id="fp64"),
    ],
)
def test_public_l2norm_sq_refuses_bad_input_in_python(x, message, via):
    with pytest.raises(ValueError, match=message):
        l2norm_sq(via, x)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize(
    "make_x, coef, message",
    [
        pytest.param(lambda: torch.zeros(4, dtype=torch.bfloat16), torch.tensor(1.0), "x must be a contiguous float32",
                     id="x-bf16"),
        pytest.param(lambda: strided(4), torch.tensor(1.0), "x must be a contiguous float32", id="x-strided"),
        pytest.param(lambda: torch.randn(4), torch.ones(1), "coef must be a 0-d tensor", id="coef-1d"),
        pytest.param(lambda: torch.randn(4), torch.tensor(1.0, device="meta"), "coef must be a 0-d tensor on cpu",
                     id="coef-meta"),
        pytest.param(lambda: torch.randn(4), torch.tensor(1 + 1j), "coef must be a real tensor", id="coef-complex"),
    ],
)
def test_public_scale_refuses_bad_input_in_python(make_x, coef, message, via):
    x = make_x()
    before = x.clone()
    with pytest.raises(ValueError, match=message):
        scale(via, x, coef)
    assert_bitwise_equal(x, before, "x after a refused call")


@pytest.mark.parametrize("via", VIA)
def test_public_functions_refuse_non_tensors_with_type_error(via):
    dst = torch.randn(4)
    before = dst.clone()
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        accumulate(via, dst, [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match="scale must be a Python float"):
        accumulate(via, dst, torch.ones(4), "2")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        l2norm_sq(via, [1.0])
    with pytest.raises(TypeError, match="coef must be a 0-d tensor"):
        scale(via, dst, 2.0)
    assert_bitwise_equal(dst, before, "dst after refused calls")


def test_cpu_backend_never_reaches_a_failed_torch_check(monkeypatch):
    """Every bad call above stops in Python: gaengine._C is not even called (a spy that fails if it is)."""
    backend = get_backend("cpu")

    class Spy:
        def __getattr__(self, name):
            raise AssertionError(f"gaengine._C.{name} was called with arguments Python should have refused")

    monkeypatch.setattr(backend, "_C", Spy())
    dst, partials = torch.randn(8), torch.zeros(2, 2, dtype=torch.float64)
    bad_calls = [
        lambda: backend.accumulate_(dst, torch.ones(3)),
        lambda: backend.accumulate_(dst, torch.ones(8, dtype=torch.float64)),
        lambda: backend.accumulate_(torch.zeros(8, device="meta"), torch.ones(8, device="meta")),
        lambda: backend.accumulate_(dst, torch.ones(8), torch.ones(2)),
        lambda: backend.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, partials, 2),
        lambda: backend.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, partials, 0.5),
        lambda: backend.accumulate_sumsq_(dst, torch.ones(8), 1.0, False, partials.float(), 0),
        lambda: backend.l2norm_sq(torch.zeros(8, dtype=torch.int32)),
        lambda: backend.l2norm_sq(torch.zeros(8, device="meta")),
        lambda: backend.scale_(dst, torch.ones(2)),
        lambda: backend.scale_(strided(8), torch.tensor(1.0)),
        lambda: backend.scale_(dst.to(torch.bfloat16), torch.tensor(1.0)),
    ]
    for call in bad_calls:
        with pytest.raises((ValueError, TypeError)):
            call()


def test_scale_takes_a_float64_coef_out_of_float_range():
    """The kernel reads coef as a float; a float64 coef is cast first (torch's rounding: inf past the range), not
    handed to ``coef.item<float>()``, which throws for it."""
    x = torch.randn(8)
    expected = x.clone().mul_(torch.tensor(1e300, dtype=torch.float64))
    assert_bitwise_equal(get_backend("cpu").scale_(x, torch.tensor(1e300, dtype=torch.float64)), expected, "x * 1e300")


def test_failed_contract_leaves_dst_untouched():
    dst = torch.randn(4)
    before = dst.clone()
    with pytest.raises(ValueError, match="src has 3 elements"):
        get_backend("cpu").accumulate_(dst, torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="src has 3 elements"):  # ContractError: also what TORCH_CHECK raised
        get_backend("cpu").accumulate_(dst, torch.ones(3, dtype=torch.bfloat16))
    assert_bitwise_equal(dst, before)


# ---------------------------------------------------------------------------- portable (non-AVX2) fallback

_PORTABLE_CHECK = textwrap.dedent(
    """
    import torch
    from gaengine import _C
    from tests.reference import accumulate_fp64, sum_sq_fp64
    from tests.tolerances import assert_bitwise_equal, assert_within_ulp, sum_sq_rtol
    torch.manual_seed(0)
    for n in (1, 127, 4097, 65540, 200_003):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            dst, src = torch.randn(n), torch.randn(n).to(dtype)
            out = dst.clone(); _C.accumulate_(out, src, 1.0, False)
            assert_bitwise_equal(out, dst.clone().add_(src), "portable add")
            out = torch.full((n,), float("nan")); _C.accumulate_(out, src, 1.0, True)
            assert_bitwise_equal(out, src.float(), "portable overwrite")
            out = dst.clone(); _C.accumulate_(out, src, 1 / 3, False)
            assert_within_ulp(out, accumulate_fp64(dst, src, 1 / 3), src.double() / 3, what="portable scaled")
            sum_sq, found_inf = _C.l2norm_sq(src)
            assert abs(sum_sq.item() - sum_sq_fp64(src)) <= sum_sq_rtol(n) * sum_sq_fp64(src)
            assert found_inf.item() == 0.0
            for scale, ow in ((1.0, False), (1.0, True), (1 / 3, False)):
                out, ref = dst.clone(), dst.clone()
                _C.accumulate_(ref, src, scale, ow)
                partials = torch.zeros(2, 2, dtype=torch.float64)
                _C.accumulate_sumsq_(out, src, scale, ow, partials, 1)
                assert_bitwise_equal(out, ref, "portable accumulate_sumsq_")
                assert abs(partials[1, 0].item() - sum_sq_fp64(ref)) <= sum_sq_rtol(n) * sum_sq_fp64(ref)
                assert partials[1, 1].item() == 0.0
            src[n // 2] = float("nan")
            assert _C.l2norm_sq(src)[1].item() == 1.0
            partials = torch.zeros(1, 2, dtype=torch.float64)
            _C.accumulate_sumsq_(dst.clone(), src, 1.0, False, partials, 0)
            assert partials[0, 1].item() == 1.0
        x = torch.randn(n); expected = x.clone().mul_(torch.tensor(0.37))
        _C.scale_(x, torch.tensor(0.37)); assert_bitwise_equal(x, expected, "portable scale")
    print("ok")
    """
)


def _run_with_isa(isa: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "GAENGINE_CPU_ISA": isa, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _PORTABLE_CHECK], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)


def test_portable_fallback_keeps_the_contract():
    """GAENGINE_CPU_ISA=portable forces the non-AVX2 path (the one an old x86-64 or an aarch64 CPU runs)."""
    proc = _run_with_isa("portable")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_unknown_isa_is_refused():
    proc = _run_with_isa("avx9000")  # a failed TORCH_CHECK (csrc/cpu_isa.h) in the child
    skip_or_fail_on_crash(proc, "the GAENGINE_CPU_ISA=avx9000 child")
    assert proc.returncode != 0 and "GAENGINE_CPU_ISA must be auto, avx2 or portable" in proc.stderr
