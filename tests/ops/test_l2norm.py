"""``l2norm_sq`` (sum of squares and the non-finite flag, one pass, no host sync) and ``finish_norm_partials`` on
every backend, against the fp64 oracle: within ``sum_sq_rtol(n)`` (``tests/tolerances.py``), the same bits every
run, ``found_inf`` for an inf or a NaN anywhere and never for a finite overflow. The partials are the ones each
backend's bucket accumulate writes (``OpBackend.accumulate_bucket_``: per source fp64 rows for torch and cpu, per
chunk fp32 columns for triton and cuda)."""

from __future__ import annotations

import math

import pytest
import torch

from gaengine import ops as public_ops
from tests.ops.conftest import DTYPE_PARAMS, DTYPES, at_offset, grad_like, main_grad
from tests.reference import sum_sq_fp64
from tests.tolerances import assert_bitwise_equal, sum_sq_rtol

SIZES = [0, 1, 127, 4097, 3 * 4096 + 5, 3 * 16384 + 5, 65537 + 3, 1_000_003]
CASES = [pytest.param(n, dt, id=f"n{n}-{name}") for n in SIZES for name, dt in DTYPES.items()]


def l2norm_sq(backend, via, x):
    return public_ops.l2norm_sq(x, backend=backend.public_name) if via == "ops" else backend.ops.l2norm_sq(x)


def check_sum_sq(x, sum_sq, found_inf):
    for t in (sum_sq, found_inf):
        assert t.dim() == 0 and t.dtype == torch.float32 and t.device == x.device
    exact = sum_sq_fp64(x)
    rtol = sum_sq_rtol(x.numel())
    assert abs(sum_sq.item() - exact) <= rtol * exact, f"sum_sq {sum_sq.item()!r} vs fp64 {exact!r} (rtol {rtol:.2e})"
    assert found_inf.item() == 0.0


# ------------------------------------------------------------------------------------------------ l2norm_sq


@pytest.mark.parametrize("via", ["backend", "ops"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("n, dtype", CASES)
def test_matches_fp64_and_is_deterministic(backend, n, dtype, offset, via):
    backend.require(n)
    x = at_offset(grad_like(n, dtype, backend.device), offset)
    sum_sq, found_inf = l2norm_sq(backend, via, x)
    check_sum_sq(x, sum_sq, found_inf)
    assert_bitwise_equal(torch.stack(l2norm_sq(backend, via, x)), torch.stack((sum_sq, found_inf)), "second run")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the Triton interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("via", ["backend", "ops"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_found_inf(backend, dtype, bad, position, via):
    n = 200_003 if backend.max_numel is None or backend.max_numel >= 200_003 else 4097  # CPU: four norm chunks
    x = grad_like(n, dtype, backend.device)
    x[{"first": 0, "middle": n // 2, "last": n - 1}[position]] = bad
    sum_sq, found_inf = l2norm_sq(backend, via, x)
    assert found_inf.item() == 1.0, f"{bad} at {position} not found"
    assert not math.isfinite(sum_sq.item())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_finite_overflow_is_not_found_inf(backend):
    # Squares of fp32 max overflow the fp32 sum, not a gradient: the flag stays 0 and sum_sq reads inf, as
    # torch.dot's would.
    for x in (torch.full((1000,), torch.finfo(torch.float32).max), torch.full((5,), 1e20)):
        sum_sq, found_inf = backend.ops.l2norm_sq(x.to(backend.device))
        assert found_inf.item() == 0.0 and sum_sq.item() == float("inf")


def test_empty_and_shaped(backend):
    for dtype in DTYPES.values():
        sum_sq, found_inf = backend.ops.l2norm_sq(torch.empty(0, 3, dtype=dtype, device=backend.device))
        assert sum_sq.item() == 0.0 and found_inf.item() == 0.0
    x = grad_like(4097, torch.float32, backend.device)
    flat = torch.stack(backend.ops.l2norm_sq(x))
    assert_bitwise_equal(torch.stack(backend.ops.l2norm_sq(x.view(17, 241))), flat, "2-d view")
    check_sum_sq(x, *flat)


# ------------------------------------------------------------------------------------ finish_norm_partials

NUMELS = [1, 127, 4097, 128, 129, 64, 3 * 128 + 5]  # 7 sources: odd sizes, a block plus one


def _bucket(backend, numels, dtype, fill=0.0):
    """A flat buffer (each slice at a multiple of 64 elements, padding zero) and one source per numel."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += (n + 63) // 64 * 64
    dst = torch.full((max(total, 1),), fill, device=backend.device)
    return dst, [grad_like(n, dtype, backend.device) for n in numels], offsets


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["overwrite", "overwrite-then-add"])
def test_finish_partials_gives_the_norm_of_the_buffer(backend, dtype, micro_batches):
    dst, srcs, offsets = _bucket(backend, NUMELS, dtype)
    if micro_batches == 2:
        backend.accumulate_bucket_(dst, srcs, offsets, [True] * len(srcs))
        srcs = [grad_like(s.numel(), dtype, backend.device) for s in srcs]
    partials = backend.new_partials(backend.num_partials(NUMELS))
    backend.accumulate_bucket_(dst, srcs, offsets, [micro_batches == 1] * len(srcs), partials=partials)
    assert not bool(partials.isnan().any()), "a partial was not written"
    sum_sq, found_inf = backend.ops.finish_norm_partials(partials)
    for t in (sum_sq, found_inf):
        assert t.dim() == 0 and t.dtype == torch.float32 and t.device == dst.device
    exact = sum_sq_fp64(dst)  # the whole buffer: its padding is zero
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(dst.numel()) * exact, (sum_sq.item(), exact)
    assert found_inf.item() == 0.0
    again = torch.stack(backend.ops.finish_norm_partials(partials))
    assert_bitwise_equal(again, torch.stack((sum_sq, found_inf)), "second finish")


def test_finish_partials_of_two_buckets_in_one_table(backend):
    # The engine's pattern: one table for the whole buffer, a slice per bucket, one finish at the end.
    dst, srcs, offsets = _bucket(backend, NUMELS, torch.bfloat16)
    n_a, n_b = backend.num_partials(NUMELS[:3]), backend.num_partials(NUMELS[3:])
    table = backend.new_partials(n_a + n_b)
    backend.accumulate_bucket_(dst, srcs[:3], offsets[:3], [True] * 3, partials=backend.partials_slice(table, 0, n_a))
    backend.accumulate_bucket_(dst, srcs[3:], offsets[3:], [True] * 4,
                               partials=backend.partials_slice(table, n_a, n_a + n_b))
    sum_sq, found_inf = backend.ops.finish_norm_partials(table)
    exact = sum_sq_fp64(dst)
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(dst.numel()) * exact
    assert found_inf.item() == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the Triton interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("where", ["src-first", "src-tail", "dst"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_finish_partials_finds_non_finite_values_written(backend, bad, where):
    dst, srcs, offsets = _bucket(backend, NUMELS, torch.float16)
    if where == "src-first":
        srcs[2][5] = bad  # near the start of the 4097-element source
    elif where == "src-tail":
        srcs[2][-1] = bad  # its last element
    else:
        dst[offsets[6] + 2] = bad  # already in main_grad, carried by the add
    partials = backend.new_partials(backend.num_partials(NUMELS))
    backend.accumulate_bucket_(dst, srcs, offsets, [False] * len(srcs), partials=partials)
    sum_sq, found_inf = backend.ops.finish_norm_partials(partials)
    assert found_inf.item() == 1.0 and not math.isfinite(sum_sq.item())
    assert int((backend.non_finite_flags(partials) == 1.0).sum()) == 1, "exactly one partial saw the value"


def test_finish_no_partials_is_zero(backend):
    sum_sq, found_inf = backend.ops.finish_norm_partials(backend.new_partials(0))
    assert sum_sq.item() == 0.0 and found_inf.item() == 0.0
