"""The error model of ``tests/tolerances.py`` against fp64, on random data summed in several orders.

Each bound must hold for every order a backend may pick (torch's own reduction, a sequential loop, the same loop
reversed, a pairwise tree, a dot product, sorted descending: the worst order for positive terms), and must grow
with the number of terms: a fixed multiple of u is exceeded by a long sequential sum.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.tolerances import (gamma, mean_rtol, norm_rtol, prob_gamma, sum_rtol, sum_sq_rtol, unit_roundoff)

SIZES = [2, 7, 100, 4097, 2**17]
# bf16 only up to 100 terms: a bf16 sum of thousands stalls (the accumulator's ulp outgrows the terms), its rounding
# errors correlated, outside the model; gaengine sums bf16 values in fp32.
CASES = [(n, torch.float32) for n in SIZES] + [(n, torch.bfloat16) for n in SIZES if n <= 100]


def _sequential(x: torch.Tensor) -> torch.Tensor:
    """Column sums of ``x`` (n, c), each a left-to-right sequence of n - 1 additions in x's dtype (c sums at once:
    one vector add per row)."""
    acc = x[0].clone()
    for row in x[1:]:
        acc += row
    return acc


def _pairwise(x: torch.Tensor) -> torch.Tensor:
    """Column sums of ``x`` (n, c) by a binary tree of additions in x's dtype (odd rows carried up)."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        top = x[:half] + x[half:2 * half]
        x = torch.cat([top, x[2 * half:]]) if x.shape[0] % 2 else top
    return x[0]


ORDERS = {
    "torch.sum": lambda x: x.sum(0),
    "sequential": _sequential,
    "reversed": lambda x: _sequential(x.flip(0)),
    "pairwise": _pairwise,
    "sorted-descending": lambda x: _sequential(x.gather(0, x.abs().argsort(0, descending=True))),
}


def _columns(n: int, c: int, dtype: torch.dtype, positive: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64)
    return (x.abs() if positive else x).to(dtype)


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("positive", [True, False], ids=["positive", "signed"])
@pytest.mark.parametrize("n,dtype", CASES, ids=[f"n{n}-{str(d)[6:]}" for n, d in CASES])
def test_sum_within_sum_rtol(n, dtype, positive, order):
    """|fl(sum x) - sum x| <= sum_rtol(n) * sum |x| for 16 columns of n terms each, in this order."""
    x = _columns(n, 16, dtype, positive)
    got = ORDERS[order](x).to(torch.float64)
    x64 = x.to(torch.float64)
    exact, magnitude = x64.sum(0), x64.abs().sum(0)
    ratio = ((got - exact).abs() / magnitude).max().item()
    assert ratio <= sum_rtol(n, dtype), f"{order}: error {ratio:.3e} of sum |x| > {sum_rtol(n, dtype):.3e}"


@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
def test_sum_of_squares_and_norm_within_their_bounds(n):
    """torch.dot, a sequential and a pairwise sum of squares within sum_sq_rtol(n); the norms within norm_rtol(n)."""
    x = _columns(n, 16, torch.float32, positive=False, seed=1)
    x64 = x.to(torch.float64)
    exact = (x64 * x64).sum(0)
    sums = {"dot": torch.stack([torch.dot(x[:, j], x[:, j]) for j in range(x.shape[1])]),
            "sequential": _sequential(x * x), "pairwise": _pairwise(x * x), "torch.sum": (x * x).sum(0)}
    for name, s in sums.items():
        err = ((s.to(torch.float64) - exact).abs() / exact).max().item()
        assert err <= sum_sq_rtol(n), f"{name}: {err:.3e} > {sum_sq_rtol(n):.3e}"
        norm = (s.sqrt() / 3.0).to(torch.float64)  # the engine's sqrt(sum_sq) / grad_denom
        err = ((norm - exact.sqrt() / 3.0).abs() / (exact.sqrt() / 3.0)).max().item()
        assert err <= norm_rtol(n), f"{name} norm: {err:.3e} > {norm_rtol(n):.3e}"
    linalg = torch.linalg.vector_norm(x, dim=0).to(torch.float64)
    assert ((linalg - exact.sqrt()).abs() / exact.sqrt()).max().item() <= norm_rtol(n, scalings=0)


def test_mean_of_micro_batches_within_mean_rtol():
    """K fp32 gradients accumulated in order and divided by K (the engine's window), elementwise vs fp64."""
    for k in (2, 3, 8, 64):
        g = _columns(k, 4096, torch.float32, positive=False, seed=k)
        got = (_sequential(g) / k).to(torch.float64)
        g64 = g.to(torch.float64)
        err = ((got - g64.sum(0) / k).abs() / (g64.abs().sum(0) / k)).max().item()
        assert err <= mean_rtol(k), (k, err, mean_rtol(k))


def test_the_factor_must_grow_with_n():
    """A long sequential fp32 sum of positive terms errs by far more than a short one may: a bound whose factor did
    not grow with n (here: the bound of 64 terms) fails on it, while ``sum_rtol(n)`` holds."""
    n = 2**17
    x = _columns(n, 64, torch.float32, positive=True, seed=2)
    x64 = x.to(torch.float64)
    ratio = ((_sequential(x).to(torch.float64) - x64.sum(0)).abs() / x64.sum(0)).max().item()
    assert ratio <= sum_rtol(n)
    assert ratio > sum_rtol(64), f"{ratio:.3e} <= {sum_rtol(64):.3e}: the growth with n would go untested"


def test_the_model_s_pieces():
    """gamma is Higham's n u / (1 - n u) and refuses n u >= 1; the probabilistic factor grows like sqrt(n) and is the
    smaller one past a few dozen terms; u is half of finfo's eps."""
    u = unit_roundoff(torch.float32)
    assert u == torch.finfo(torch.float32).eps / 2 and unit_roundoff(torch.bfloat16) == 2.0**-8
    assert gamma(10) == 10 * u / (1 - 10 * u)
    with pytest.raises(ValueError, match="n \\* u"):
        gamma(300, torch.bfloat16)
    assert sum_rtol(2) == gamma(1) and sum_rtol(1) == 0.0
    assert sum_rtol(10**6) == prob_gamma(10**6 - 1) < gamma(10**6 - 1) / 100
    assert math.isclose(prob_gamma(4 * 10**6) / prob_gamma(10**6), 2.0, rel_tol=1e-2)
