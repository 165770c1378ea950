"""Triton kernels (``gaengine.kernels``): their block-size and reduction-shape options, argument checks and lazy import.

The values of each op on every backend are tested in ``tests/ops/``; here, small blocks (many programs) and small
norm shapes (many partials, a looping finalize), against the fp64 oracles of ``tests/reference.py``.

Without a GPU the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set by ``conftest.py`` before
triton is imported); with one, the same tests run on CUDA tensors. Budgets (``tests/tolerances.py``):
unscaled accumulate and overwrite are bitwise equal to torch, scaled accumulate is within 1 fp32 ulp,
the sum of squares is within ``sum_sq_rtol(n)`` and deterministic, ``scale_`` is bitwise equal to torch.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tests.tolerances import assert_bitwise_equal, sum_sq_rtol, triton_device

DEVICE = triton_device()  # skips this module without triton, or without a GPU and the interpreter

from tests.reference import sum_sq_fp64  # noqa: E402

from gaengine.kernels import accumulate, norm, scale  # noqa: E402

pytestmark = pytest.mark.interpreter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK = accumulate.BLOCK_SIZE
SIZES = [1, 127, 4097, 3 * BLOCK + 5]  # one element, under a block, one past a block, a ragged last block
assert norm.BLOCK_SIZE == scale.BLOCK_SIZE == BLOCK
# A scale that is exact in fp32 but not a power of two, so the product rounds.
SCALE = float(torch.tensor(0.3, dtype=torch.float32))


def _cases(sizes=SIZES, dtypes=DTYPES):
    return [pytest.param(n, dtypes[d], id=f"n{n}-{d}") for n in sizes for d in dtypes]


def _grad(n: int, dtype: torch.dtype) -> torch.Tensor:
    """(n,) gradient-like values in ``dtype`` on DEVICE, of mixed magnitudes so adds round."""
    return (torch.randn(n) * torch.logspace(-3, 2, n)).to(dtype).to(DEVICE)


def _main_grad(n: int) -> torch.Tensor:
    return (torch.randn(n) * 10).to(DEVICE)


# --- accumulate_ -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_accumulate_many_programs_and_any_shape(dtype):
    # A small block gives 33 programs over 4097 elements; dst (17, 241) is treated as flat.
    dst, src = _main_grad(4097).view(17, 241), _grad(4097, dtype)
    expected = dst.clone().view(-1).add_(src)
    accumulate.accumulate_(dst, src, block_size=128)
    assert_bitwise_equal(dst, expected.view(17, 241), "dst + src, block 128")
    s = torch.tensor(0.125, device=DEVICE)
    accumulate.accumulate_(dst, src, s, overwrite=True, block_size=128)
    assert_bitwise_equal(dst.view(-1), src.float() * 0.125, "src * 0.125, block 128")


@pytest.mark.parametrize(
    "dst, src, scale, match",
    [
        pytest.param(torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), 1.0, "dst must be float32", id="dst-bf16"),
        pytest.param(torch.zeros(8, 2).t(), torch.zeros(16), 1.0, "dst must be contiguous", id="dst-strided"),
        pytest.param(torch.zeros(8), torch.zeros(8, dtype=torch.float64), 1.0, "src must be", id="src-fp64"),
        pytest.param(torch.zeros(8), torch.zeros(7), 1.0, "7 elements", id="numel"),
        pytest.param(torch.zeros(8), torch.zeros(8), torch.ones(1), "scale must be a 0-d", id="scale-1d"),
    ],
)
def test_accumulate_rejects_bad_arguments(dst, src, scale, match):
    before = dst.clone()
    with pytest.raises(ValueError, match=match):
        accumulate.accumulate_(dst, src, scale)
    assert torch.equal(dst, before)


# --- l2norm_sq --------------------------------------------------------------------------------------------

# Small reduction shapes: many partials (4097 elements -> 129 partials) and a finalize that loops 9 times.
SMALL_SHAPE = dict(block_size=16, blocks_per_program=2, finalize_block_size=16)


def _check_sum_sq(x, sum_sq, found_inf):
    for t in (sum_sq, found_inf):
        assert t.dim() == 0 and t.dtype == torch.float32 and t.device == x.device
    exact = sum_sq_fp64(x)
    rtol = sum_sq_rtol(x.numel())
    assert abs(sum_sq.item() - exact) <= rtol * exact, f"sum_sq {sum_sq.item()!r} vs fp64 {exact!r} (rtol {rtol:.2e})"
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("n, dtype", _cases(sizes=[127, 4097]))
def test_l2norm_sq_many_partials(n, dtype):
    x = _grad(n, dtype)
    _check_sum_sq(x, *norm.l2norm_sq(x, **SMALL_SHAPE))
    _check_sum_sq(x, *norm.l2norm_sq(x, block_size=16, blocks_per_program=16))  # the large-buffer loop


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_l2norm_sq_found_inf(dtype, bad, where):
    n = 4097
    x = _grad(n, dtype)
    x[{"first": 0, "middle": n // 2, "last": n - 1}[where]] = bad
    for shape in ({}, SMALL_SHAPE):
        sum_sq, found_inf = norm.l2norm_sq(x, **shape)
        assert found_inf.item() == 1.0, f"{bad} at {where} not found with {shape or 'default shape'}"
        assert not math.isfinite(sum_sq.item())


@pytest.mark.parametrize("shape", [{}, SMALL_SHAPE], ids=["default", "small-blocks"])
def test_l2norm_sq_deterministic(shape):
    x = _grad(3 * BLOCK + 5, torch.float32)
    first = torch.stack(norm.l2norm_sq(x, **shape))
    for _ in range(2):
        assert_bitwise_equal(torch.stack(norm.l2norm_sq(x, **shape)), first, "second run")


def test_l2norm_sq_rejects_bad_arguments():
    with pytest.raises(ValueError, match="x must be float32"):
        norm.l2norm_sq(torch.zeros(4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        norm.l2norm_sq(torch.zeros(4, 2, device=DEVICE).t())
    with pytest.raises(ValueError, match="power of two"):
        norm.l2norm_sq(torch.zeros(4, device=DEVICE), block_size=100)


# --- scale_ -----------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the interpreter
def test_scale_many_programs_and_special_values():
    x = _main_grad(4097)
    x[:4] = torch.tensor([float("inf"), float("nan"), -0.0, 3.0e38])
    coef = torch.tensor(1.5, device=DEVICE)
    expected = x.clone().mul_(coef)
    assert_bitwise_equal(scale.scale_(x, coef, block_size=64), expected, "x * 1.5, block 64")


def test_scale_rejects_host_coef():
    x = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="coef must be a 0-d"):
        scale.scale_(x, 0.5)
    with pytest.raises(ValueError, match="coef must be a 0-d"):
        scale.scale_(x, torch.ones(1, device=DEVICE))


# --- packaging ----------------------------------------------------------------------------------------------


def test_importing_the_package_does_not_import_triton():
    code = "import sys, gaengine.kernels, gaengine.kernels._utils; sys.exit('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"import gaengine.kernels imported triton (or failed): {result.stderr[-2000:]}"
