"""The single-tensor accumulate ``accumulate_`` (``gaengine.ops.accumulate_``), and the free norm of one source
through ``accumulate_bucket_``'s partials, on every backend against the fp64 oracle.

Budgets (``tests/tolerances.py``, the same for every backend): an unscaled accumulate is bitwise equal to torch's
``dst.add_(src)``, an overwrite bitwise equal to ``src.float()``; a scaled one is within 1 fp32 ulp of the fp64
value; the sum of squares of the bucket op's partials is within ``sum_sq_rtol(n)`` of the fp64 sum of the values
written, and its ``dst`` is ``accumulate_``'s, bit for bit. Sizes: empty, one element, a partial vector, one past a
block, a ragged last block, several norm chunks, a large odd size (slow backends skip the largest, see
``conftest.py``); sources aligned and one element off a 16-byte boundary (the kernels' scalar paths).
"""

from __future__ import annotations

import pytest
import torch

from gaengine import ops as public_ops
from tests.ops.conftest import DTYPE_PARAMS, DTYPES, at_offset, grad_like, main_grad, poisoned
from tests.reference import accumulate_fp64, sum_sq_fp64
from tests.tolerances import assert_bitwise_equal, assert_within_ulp, sum_sq_rtol

# Empty, 1, a partial vector, one past a block (4096), a ragged last block, past one CPU norm chunk (65536) and a
# large odd size: none a multiple of a vector width (8), an unroll (32), a block (4096) or a norm chunk.
SIZES = [0, 1, 127, 4097, 3 * 4096 + 5, 65537 + 3, 1_000_003]
CASES = [pytest.param(n, dt, id=f"n{n}-{name}") for n in SIZES for name, dt in DTYPES.items()]
OFFSETS = [pytest.param(0, id="aligned"), pytest.param(1, id="unaligned")]


def fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


# Scales exact in fp32 but not powers of two (products round), as a float or a 0-d tensor read on the device.
SCALES = [pytest.param(fp32(1 / 3), id="third"), pytest.param(0.125, id="eighth"),
          pytest.param(fp32(-7.3e-5), id="neg-tiny"), pytest.param("tensor", id="tensor0.3")]
TENSOR_SCALE = fp32(0.3)
# Python floats that fp32 cannot hold: only the cpu kernel multiplies by the float as given; torch, triton and cuda
# round it to fp32 first, a second rounding that can pass the 1-ulp budget (see test_scale_not_held_by_fp32).
DOUBLE_SCALES = [pytest.param(1 / 3, id="third64"), pytest.param(-7.3e-5, id="neg-tiny64")]


def accumulate(backend, via: str, dst, src, scale=1.0, overwrite=False):
    if via == "ops":
        return public_ops.accumulate_(dst, src, scale, overwrite=overwrite, backend=backend.public_name)
    return backend.ops.accumulate_(dst, src, scale, overwrite)


# ---------------------------------------------------------------------------------------------- accumulate_


@pytest.mark.parametrize("via", ["backend", "ops"])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("n, dtype", CASES)
def test_unscaled_is_bitwise_torch(backend, n, dtype, offset, via):
    backend.require(n)
    dst, src = at_offset(main_grad(n, backend.device), offset), at_offset(grad_like(n, dtype, backend.device), offset)
    expected = dst.clone().add_(src)
    out = accumulate(backend, via, dst, src)
    assert out is dst
    assert_bitwise_equal(dst, expected, "dst + src")


@pytest.mark.parametrize("via", ["backend", "ops"])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("n, dtype", CASES)
def test_overwrite_is_bitwise_copy(backend, n, dtype, offset, via):
    backend.require(n)
    dst, src = at_offset(poisoned(n, backend.device), offset), at_offset(grad_like(n, dtype, backend.device), offset)
    accumulate(backend, via, dst, src, overwrite=True)
    assert_bitwise_equal(dst, src.float(), "overwrite")


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("n, dtype", CASES)
def test_scaled_within_1ulp(backend, n, dtype, scale, overwrite):
    backend.require(n)
    device = backend.device
    dst, src = (poisoned(n, device) if overwrite else main_grad(n, device)), grad_like(n, dtype, device)
    value = TENSOR_SCALE if scale == "tensor" else scale
    exact = accumulate_fp64(dst, src, value, overwrite)
    s = torch.tensor(TENSOR_SCALE, dtype=torch.float32, device=device) if scale == "tensor" else scale
    assert backend.ops.accumulate_(dst, src, s, overwrite) is dst
    assert_within_ulp(dst, exact, src.to(torch.float64) * value, what=f"dst + src * {value} ({type(s).__name__})")


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("scale", DOUBLE_SCALES)
@pytest.mark.parametrize("n, dtype", [c for c in CASES if c.values[0] in (1, 127, 65537 + 3)])
def test_scale_not_held_by_fp32(backend, n, dtype, scale, overwrite):
    """The contract (gaengine/backends.py): a Python float scale is taken as its nearest fp32 value, as torch takes
    it; the result is within 1 fp32 ulp of the exact ``dst + src * fp32(scale)`` on every backend."""
    backend.require(n)
    device = backend.device
    dst, src = (poisoned(n, device) if overwrite else main_grad(n, device)), grad_like(n, dtype, device)
    scale32 = torch.tensor(scale, dtype=torch.float32).item()
    exact = accumulate_fp64(dst, src, scale32, overwrite)
    backend.ops.accumulate_(dst, src, scale, overwrite)
    assert_within_ulp(dst, exact, src.to(torch.float64) * scale32, what=f"dst + src * fp32({scale!r})")


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_scaled_unaligned_tensor_scale_overwrite(backend, dtype, offset):
    n = 4097
    src = at_offset(grad_like(n, dtype, backend.device), offset)
    out = at_offset(poisoned(n, backend.device), offset)
    backend.ops.accumulate_(out, src, torch.tensor(TENSOR_SCALE, device=backend.device), True)
    product = src.double() * TENSOR_SCALE
    assert_within_ulp(out, product, product, what="src * scale tensor, overwrite")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_tensor_scale_and_any_shape_via_ops(backend, dtype):
    device = backend.device
    dst, src = main_grad(37 * 29, device).view(37, 29), grad_like(37 * 29, dtype, device).reshape(29, 37)
    coef = torch.tensor(0.3, dtype=torch.float32, device=device)  # the scale is coef's fp32 value
    exact = accumulate_fp64(dst, src, coef.item(), False)
    public_ops.accumulate_(dst, src, coef, backend=backend.public_name)
    assert_within_ulp(dst.reshape(-1), exact.reshape(-1), src.to(torch.float64).reshape(-1) * coef.item())


def test_view_into_flat_buffer_touches_only_the_view(backend):
    flat = main_grad(10_000, backend.device)
    before = flat.clone()
    view, src = flat[1003:1003 + 4097], grad_like(4097, torch.bfloat16, backend.device)  # odd offset: unaligned
    expected = view.clone().add_(src)
    backend.ops.accumulate_(view, src)
    assert_bitwise_equal(flat[1003:1003 + 4097], expected, "view")
    assert_bitwise_equal(flat[:1003], before[:1003], "before the view")
    assert_bitwise_equal(flat[1003 + 4097:], before[1003 + 4097:], "after the view")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the Triton interpreter
def test_special_values_bitwise_equal_to_torch(backend):
    tiny = torch.finfo(torch.float32).tiny
    dst = torch.tensor([0.0, -0.0, 1.0, float("inf"), -3.0e38, tiny, 1.0, -2.5], device=backend.device)
    src = torch.tensor([-0.0, -0.0, float("-inf"), 1.0, -3.0e38, -tiny / 4, 2.0**-24, 2.5], device=backend.device)
    expected = dst.clone().add_(src)  # -0 + -0, inf, overflow to -inf, a subnormal, a tie to even
    assert_bitwise_equal(backend.ops.accumulate_(dst, src), expected, "special values")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_empty_is_a_no_op(backend, dtype):
    dst = torch.empty(0, device=backend.device)
    src = torch.empty(0, dtype=dtype, device=backend.device)
    assert backend.ops.accumulate_(dst, src, 0.5) is dst
    assert backend.ops.accumulate_(dst, src, 1.0, True) is dst


# --------------------------------------------------------------- the free norm of one source, accumulate_bucket_
# The per-parameter accumulate_sumsq_ is gone: the free norm comes from the bucket op's partials (a bucket of one
# source here, large sizes included; several sources and tables in test_l2norm.py).

SUMSQ_SIZES = [0, 1, 127, 4097, 1_000_003]
SUMSQ_CASES = [pytest.param(n, dt, id=f"n{n}-{name}") for n in SUMSQ_SIZES for name, dt in DTYPES.items()]
SUMSQ_MODES = [pytest.param(False, id="add"), pytest.param(True, id="overwrite")]


def one_source_norm(backend, dst, src, overwrite):
    """``accumulate_bucket_`` of the one source ``src`` into ``dst`` with NaN-poisoned partials: (sum_sq, found_inf,
    partials)."""
    ops = backend.ops
    partials = ops.new_bucket_partials([src.numel()], dst.device).fill_(float("nan"))
    flat = dst.view(-1)
    assert ops.accumulate_bucket_(flat, [src.reshape(-1)], [0], [overwrite], partials) is flat
    sum_sq, found_inf = ops.finish_norm_partials(partials)
    return sum_sq, found_inf, partials


@pytest.mark.parametrize("overwrite", SUMSQ_MODES)
@pytest.mark.parametrize("n, dtype", SUMSQ_CASES)
def test_sumsq_dst_is_accumulate_and_sum_is_fp64(backend, n, dtype, overwrite):
    backend.require(n)
    device = backend.device
    dst, src = main_grad(n, device), grad_like(n, dtype, device)
    expected = dst.clone()
    backend.ops.accumulate_(expected, src, 1.0, overwrite)
    sum_sq, found_inf, partials = one_source_norm(backend, dst, src, overwrite)
    assert_bitwise_equal(dst, expected, "dst vs accumulate_")
    assert_bitwise_equal(dst, (src.float() if overwrite else expected), "dst vs torch")
    assert not bool(partials.isnan().any()), "a partial was not written"
    exact = sum_sq_fp64(dst)  # the oracle of the values written
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(n) * exact, (sum_sq.item(), exact)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_sumsq_any_shape_and_empty(backend, dtype):
    device = backend.device
    dst, src = main_grad(37 * 29, device).view(37, 29), grad_like(37 * 29, dtype, device).reshape(29, 37)
    expected = dst.clone()
    backend.ops.accumulate_(expected, src)
    sum_sq, _, _ = one_source_norm(backend, dst, src, False)
    assert_bitwise_equal(dst, expected)
    exact = sum_sq_fp64(dst)
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(dst.numel()) * exact
    sum_sq, found_inf, _ = one_source_norm(backend, torch.empty(0, device=device),
                                           torch.empty(0, dtype=dtype, device=device), False)
    assert sum_sq.item() == 0.0 and found_inf.item() == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the Triton interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_sumsq_found_inf(backend, dtype, bad, position):
    n = 200_003 if backend.max_numel is None or backend.max_numel >= 200_003 else 4097  # CPU: four norm chunks
    dst, src = main_grad(n, backend.device), grad_like(n, dtype, backend.device)
    src[{"first": 0, "middle": n // 2, "last": n - 1}[position]] = bad
    sum_sq, found_inf, partials = one_source_norm(backend, dst, src, False)
    assert found_inf.item() == 1.0
    assert not torch.isfinite(sum_sq)
    assert int((backend.non_finite_flags(partials) == 1.0).sum()) == 1, "exactly one partial saw the value"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_sumsq_flags_only_the_written_values(backend):
    # An inf in dst that an overwrite replaces is not counted; huge finite values do not set the flag.
    device = backend.device
    dst, src = main_grad(5000, device), grad_like(5000, torch.float32, device)
    dst[17] = float("inf")
    sum_sq, found_inf, _ = one_source_norm(backend, dst, src, True)
    assert found_inf.item() == 0.0 and torch.isfinite(sum_sq)
    big = torch.full((1000,), torch.finfo(torch.float32).max, device=device)
    sum_sq, found_inf, partials = one_source_norm(backend, torch.zeros(1000, device=device), big, False)
    assert found_inf.item() == 0.0
    if backend.partials_layout == "rows":  # fp64 rows keep the sum finite (fp32 chunk sums read inf)
        exact = 1000 * torch.finfo(torch.float32).max ** 2  # an fp64 sum of 1000 squares
        assert partials[0, 0].item() == pytest.approx(exact, rel=sum_sq_rtol(1000, torch.float64))
