"""``scale_`` (``x *= coef``, coef a 0-d tensor read on the device) on every backend: bitwise equal to torch's
``x.mul_(coef)`` (one fp32 multiply), for odd sizes, unaligned views and special values."""

from __future__ import annotations

import pytest
import torch

from gaengine import ops as public_ops
from tests.ops.conftest import at_offset, main_grad
from tests.tolerances import assert_bitwise_equal

SIZES = [0, 1, 127, 4097, 3 * 4096 + 5, 3 * 16384 + 5, 65537 + 3, 1_000_003]
SCALE = float(torch.tensor(0.3, dtype=torch.float32))


def scale(backend, via, x, coef):
    if via == "ops":
        return public_ops.scale_(x, coef, backend=backend.public_name)
    return backend.ops.scale_(x, coef)


@pytest.mark.parametrize("via", ["backend", "ops"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("coef", [0.37, SCALE], ids=["coef0.37", "coef0.3"])
@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
def test_bitwise_torch(backend, n, coef, offset, via):
    backend.require(n)
    x, c = at_offset(main_grad(n, backend.device), offset), torch.tensor(coef, device=backend.device)
    expected = x.clone().mul_(c)
    assert scale(backend, via, x, c) is x
    assert_bitwise_equal(x, expected, "x * coef")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the Triton interpreter
def test_special_values(backend):
    x = main_grad(4097, backend.device)
    x[:4] = torch.tensor([float("inf"), float("nan"), -0.0, 3.0e38])
    coef = torch.tensor(1.5, device=backend.device)
    expected = x.clone().mul_(coef)
    assert_bitwise_equal(backend.ops.scale_(x, coef), expected, "x * 1.5")


def test_non_fp32_coef_is_read_as_fp32(backend):
    """A float64 coef is cast first, with torch's rounding (inf past fp32's range), as ``x.mul_(coef)`` does."""
    for value in (0.1, 1e300):
        x = main_grad(1000, backend.device)
        coef = torch.tensor(value, dtype=torch.float64, device=backend.device)
        expected = x.clone().mul_(coef.float())
        public_ops.scale_(x, coef, backend=backend.public_name)
        assert_bitwise_equal(x, expected, f"x * {value}")
