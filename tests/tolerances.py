"""The error model every bound in the tests comes from, and the assertion helpers every kernel test uses.

Budgets (docs/tolerances.md): an unscaled accumulate is bitwise equal to torch; a scaled one is within 1 fp32
ulp of the fp64 oracle (ulp taken at the larger of the product and the result, since a fused
multiply-add and a separate multiply + add round differently); a sum of squares, a norm, a mean of micro-batches,
a model's gradients and an optimizer's updates are within the bounds of "the error model" below (unit roundoff
times a factor that grows with the number of roundings; docs/tolerances.md). A test exact by construction compares
bits (``assert_bitwise_equal``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

# Relative tolerance of an element of each input dtype against the fp64 oracle (half an ulp of its format).
RTOL = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "result") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.reshape(-1), expected.reshape(-1)
    same = (a.view(torch.int32) == e.view(torch.int32)) if a.dtype == torch.float32 else (a == e)
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(f"{what}: not bitwise equal at {i}: {a[i].item()!r} != {e[i].item()!r} "
                             f"({int((~same).sum())} of {a.numel()} differ)")


def fp32_ulp(x: torch.Tensor) -> torch.Tensor:
    """Size of one fp32 ulp at |x| (fp64 tensor), the smallest normal's ulp for tiny values."""
    ax = x.abs().to(torch.float64).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.floor(torch.log2(ax)) - 23)


def low_precision_ulp(x: torch.Tensor) -> torch.Tensor:
    """Size of one ulp of ``x``'s own dtype (bf16 or fp16) at |x| (fp64 tensor), the smallest normal's for tiny values."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[x.dtype]
    ax = x.abs().to(torch.float64).clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(ax)) - mantissa_bits)


def assert_within_ulp(actual: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, ulps: float = 1.0,
                      what: str = "result") -> None:
    """|actual - exact| <= ulps * ulp(magnitude), elementwise; exact and magnitude are fp64."""
    err = (actual.to(torch.float64) - exact).abs()
    bound = ulps * fp32_ulp(torch.maximum(magnitude.abs(), exact.abs()))
    bad = err > bound
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: off by {err[i].item():.3e} > {ulps} ulp ({bound[i].item():.3e}) at {i}")


# ------------------------------------------------------------------------------------------ the error model
# Every bound below is a relative error, first order in the unit roundoff u of the dtype that computes (the
# ``2^-p`` of a p-bit significand: Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §2.1), times
# a factor that grows with the number of roundings a result went through. A reduction is summed in an order the
# backend picks (AVX2 vs AVX-512 lane counts, oneDNN/BLAS blocking, a GPU's tree), so every bound here holds for any
# order: none is a measured margin of one machine.

_UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# The probability, under the model of ``prob_gamma``, that one reduction's rounding error exceeds its bound.
FP32_EPS = _UNIT_ROUNDOFF[torch.float32]
"""u of fp32, 2^-24 (``unit_roundoff(torch.float32)``), for the bounds written out term by term in a test."""

FAIL_PROB = 1e-9


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u of ``dtype``: the largest relative error of one rounding to nearest (Higham §2.1, Theorem 2.2).

    fp64 2^-53, fp32 2^-24, bf16 2^-8, fp16 2^-11 (half of ``torch.finfo(dtype).eps``). KeyError for another dtype.
    """
    return _UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's worst case ``gamma_n = n u / (1 - n u)`` (Lemma 3.1): |prod (1 + d_i)^(+-1) - 1| <= gamma_n for n
    roundings |d_i| <= u. A sum of n terms in ANY order (any binary tree has n - 1 additions) errs by at most
    ``gamma_{n-1} * sum |x_i|`` (Higham (4.4) and §4.2); a dot product of length n by ``gamma_n * sum |x_i y_i|``
    ((3.4)-(3.5)). ValueError when n u >= 1 (no bound)."""
    nu = max(int(n), 0) * unit_roundoff(dtype)
    if nu >= 1.0:
        raise ValueError(f"gamma(n={n}, {dtype}): n * u = {nu} >= 1, no worst-case bound; use prob_gamma")
    return nu / (1.0 - nu)


def prob_gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The probabilistic counterpart of ``gamma(n)``: ``lambda_n * sqrt(n) * u``, lambda_n about 3.8 for large n.

    Model (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5),
    2019): the rounding errors of the n operations of a reduction are independent and mean zero; as there, the
    absolute error of one rounding is uniform over its half-ulp interval, so the relative one d_k has |d_k| <= u and
    variance <= u^2 / 3. The error of a sum, in any order, is then sum_k d_k s_k over its n additions and products,
    each |s_k| <= sum |x_i|: by Bernstein's inequality it exceeds ``lambda sqrt(n) u sum |x_i|`` with probability
    at most 2 exp(-(lambda^2 / 2) / (1/3 + lambda / (3 sqrt(n)))), and lambda_n solves that = FAIL_PROB.

    Used where the worst case is too loose to test anything: ``gamma`` grows like n, so for a 66k-element norm it
    allows 4e-3 where the error is near 1e-6. The model fails for data whose roundings are correlated (adding one
    constant many times); the tests' data are random."""
    n = max(int(n), 0)
    if n == 0:
        return 0.0
    big_l = math.log(2.0 / FAIL_PROB)
    a = 2.0 * big_l / (3.0 * math.sqrt(n))
    lam = (a + math.sqrt(a * a + 8.0 * big_l / 3.0)) / 2.0  # the positive root of lam^2 - a lam - 2L/3 = 0
    return lam * math.sqrt(n) * unit_roundoff(dtype)


def sum_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Error of a ``dtype`` sum of n terms, any order, relative to ``sum |x_i|``: the smaller of the worst case
    ``gamma(n - 1)`` (rigorous; the smaller one for n below about 30) and ``prob_gamma(n - 1)``."""
    m = max(int(n) - 1, 0)
    worst = gamma(m, dtype) if m * unit_roundoff(dtype) < 0.5 else math.inf
    return min(worst, prob_gamma(m, dtype))


def dot_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Error of a ``dtype`` dot product of length n, any order, relative to ``sum |x_i y_i|``: the smaller of
    ``gamma(n)`` (Higham (3.4)-(3.5): n products and n - 1 additions) and ``prob_gamma(n)``. With an FMA, fp64
    partials or a wider accumulator fewer roundings happen; the bound still holds."""
    n = max(int(n), 1)
    worst = gamma(n, dtype) if n * unit_roundoff(dtype) < 0.5 else math.inf
    return min(worst, prob_gamma(n, dtype))


def gemm_bound(terms_abs: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 error bound of a sum of ``n`` products formed in fp32 (gamma_(n+1) times the sum of their
    magnitudes, ``terms_abs``), elementwise, as fp64 (Higham, *Accuracy and Stability of Numerical Algorithms*,
    eq. 3.5)."""
    return (n + 1) * FP32_EPS * terms_abs


def sum_sq_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Error of a ``dtype`` sum of n squares (the dot product x.x), any order, relative to the exact sum (all its
    terms are positive: ``sum |x_i x_i|`` is the sum): ``dot_rtol(n)``."""
    return dot_rtol(n, dtype)


def norm_rtol(n: int, dtype: torch.dtype = torch.float32, scalings: int = 1) -> float:
    """Error of an L2 norm of n elements computed in ``dtype`` against the exact one (fp64), relative.

    ``sqrt(s (1 + e)) = sqrt(s) (1 + e/2 + O(e^2))``: half the sum of squares' ``sum_sq_rtol(n)``, plus one rounding
    for the square root (IEEE: correctly rounded) and one per ``scalings`` (a division by the micro-batch count or
    the loss scale, ``gaengine.norm.window_norm``'s ``/ grad_denom``)."""
    return sum_sq_rtol(n, dtype) / 2 + (1 + scalings) * unit_roundoff(dtype)


def clip_coef_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Error of torch's clip coefficient ``max_norm / (norm + 1e-6)`` computed from an n-element norm, relative:
    the norm's ``norm_rtol(n)`` passes through the quotient unchanged (first order), plus the add and the divide."""
    return norm_rtol(n, dtype) + 2 * unit_roundoff(dtype)


def mean_rtol(k: int, dtype: torch.dtype = torch.float32) -> float:
    """Error of a ``dtype`` mean of k values (k micro-batches' losses or gradients accumulated, then divided or
    multiplied by 1/k), relative to the mean of their absolute values: the sum's ``sum_rtol(k)`` plus one rounding
    for the scaling (two when 1/k is itself rounded first: included)."""
    return sum_rtol(k, dtype) + 2 * unit_roundoff(dtype)


def split_batch_rtol(n_samples: int, dtype: torch.dtype = torch.float32) -> float:
    """Two gradients (or losses) of one batch of ``n_samples`` computed with the batch split differently (K
    micro-batch backward passes accumulated vs one backward over the whole batch; one process vs world ranks each
    taking a slice): each is a reduction over the samples in its own order, so each is within ``mean_rtol`` of the
    exact mean and they are within twice that of each other, relative to the mean of the per-sample terms'
    absolute values.

    Relative to the largest element instead (``rel_diff``), one more factor: the condition ``sum |t_i| /
    |sum t_i|`` of the largest element. Per-sample gradients of the tests' random data have random signs, so it is
    about ``sqrt(n_samples)`` (a random walk's |sum t_i| ~ sqrt(n) rms while sum |t_i| ~ n mean |t|); the bound
    takes ``sqrt(n_samples)`` for it. A test whose data cancel more (a gradient near zero everywhere) must not use it.
    """
    return 2 * mean_rtol(n_samples, dtype) * math.sqrt(max(int(n_samples), 1))


def clipped_grad_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Two gradients made from the same ``dtype`` sums (bitwise: the same micro-batches accumulated in the same
    order) but normalized and clipped separately, e.g. gaengine's ``main_grad * (clip_coef / K)`` against the plain
    recipe's ``.grad / K`` then ``clip_grad_norm_``: each clip coefficient is within ``clip_coef_rtol(n)`` of the
    exact one, and each side rounds its scalings (1/K and the product: two per side). A uniform relative scale, so
    no condition number enters. Without clipping pass n = 0: only the roundings remain."""
    u = unit_roundoff(dtype)
    return (2 * clip_coef_rtol(n, dtype) if n else 0.0) + 4 * u


def network_rtol(depth: int, width: int, dtype: torch.dtype = torch.float32, products_per_layer: int = 3) -> float:
    """Outputs, losses and gradients of a model of ``depth`` layers whose matmuls reduce over at most ``width``
    terms, computed in ``dtype``, against the same model in fp64, relative to the largest element.

    Each dot product errs by ``dot_rtol(width)`` of ``sum |w_i x_i|`` (Higham (3.5)), which for the tests' random
    weights and data (random signs) is about ``sqrt(width)`` times ``|sum w_i x_i|`` (see ``split_batch_rtol``).
    A forward pass makes one such product per layer, a backward two (the input's gradient, the weight's):
    ``products_per_layer`` is 3 for a gradient against fp64, 1 for an output or a loss, 2 for two gradients of the
    same fp32 forward whose backward passes round differently (a seed scaled by 1/K, ``(loss / K).backward()``,
    against an unscaled one: per side). First-order errors add along the chain, taken as not amplified by the
    layers (tanh's slope <= 1, default-initialized weights of norm about 1). A loss's final mean adds ``mean_rtol``
    of its terms."""
    return products_per_layer * depth * dot_rtol(width, dtype) * math.sqrt(max(int(width), 1))


def update_rtol(steps: int, step_over_param: float, grad_rtol: float, *, grad_gain: float = 2.0,
                step_roundings: int = 8, sides: int = 2, dtype: torch.dtype = torch.float32) -> float:
    """Parameters after ``steps`` optimizer updates from gradients within ``grad_rtol`` of each other, relative to
    the largest parameter (``rel_diff``); ``sides`` of the comparison that round in ``dtype`` (2: two fp32 runs; 1:
    one against fp64).

    On each side, each update ``p <- p (1 - lr wd) - step`` rounds twice at |p| (the decay, the subtraction) and
    ``step_roundings`` times at |step| (AdamW: lerp, addcmul, sqrt, the bias corrections, + eps, the quotient, the
    step size: 8; ``gaengine.optim.adamw_step_reference``); the step's own error from the gradient's is at most
    ``grad_gain * grad_rtol`` (AdamW's m / sqrt(v): m carries the gradient's relative error, sqrt(v) it too, so 2;
    SGD's lr * buf: 1). ``step_over_param`` is max |step| / max |p| (see ``adamw_step_over_param``). First order, and
    the gradient's dependence on a parameter that already differs is neglected: valid for a few updates."""
    u = unit_roundoff(dtype)
    return steps * (sides * 2 * u + step_over_param * (grad_gain * grad_rtol + sides * step_roundings * u))


def adamw_step_over_param(lr: float, param: torch.Tensor, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """max |AdamW step| / max |param|: Kingma & Ba (ICLR 2015, §2.1) bound the step by ``lr (1 - beta1) /
    sqrt(1 - beta2)`` when that exceeds lr (sparse gradients), by lr otherwise."""
    beta1, beta2 = betas
    bound = lr * max(1.0, (1.0 - beta1) / math.sqrt(1.0 - beta2))
    return bound / max(float(param.detach().abs().max()), torch.finfo(torch.float32).tiny)


def sgd_step_over_param(lr: float, momentum: float, grad_norm_max: float, param: torch.Tensor) -> float:
    """max |SGD step| / max |param|: the step is ``lr * buf`` with ``buf = sum_j momentum^j g_j``, so at most
    ``lr * max |g| / (1 - momentum)``, and ``max |g| <= ||g||`` (``grad_norm_max``: the clipping threshold)."""
    bound = lr * grad_norm_max / (1.0 - momentum)
    return bound / max(float(param.detach().abs().max()), torch.finfo(torch.float32).tiny)


def adamw_param_rtol(param: torch.Tensor, lr: float, steps: int, grad_rtol: float,
                     betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """``update_rtol`` of AdamW (fp32 master ``param``, the reference side): ``steps`` updates at ``lr``."""
    return update_rtol(steps, adamw_step_over_param(lr, param, betas), grad_rtol)

def recipe_grad_rtol(n_samples: int, depth: int, width: int, n_params: int = 0) -> float:
    """A window's fp32 gradient computed two ways from one global batch of ``n_samples``: split into micro-batches
    (and ranks) whose backward passes are seeded by their own loss factors, against the plain recipe's: the samples
    reduced in another order (``split_batch_rtol``), two backward passes of a ``depth``-layer, ``width``-wide model
    that round differently (``network_rtol``, 2 products per layer, per side), and, with ``n_params`` > 0, each
    side's own clip coefficient from its own n-element norm (``clip_coef_rtol``, per side)."""
    rtol = split_batch_rtol(n_samples) + 2 * network_rtol(depth, width, products_per_layer=2)
    return rtol + (2 * clip_coef_rtol(n_params) if n_params else 0.0)


def recipe_param_rtol(param: torch.Tensor, optimizer: str, lr: float, steps: int, grad_rtol: float,
                      grad_norm_max: float | None = None, momentum: float = 0.9) -> float:
    """``update_rtol`` of ``steps`` updates by ``optimizer`` ("adamw"/"adam": ``adamw_step_over_param``; "sgd":
    ``sgd_step_over_param`` with ``grad_norm_max``, the clipping threshold) from gradients ``grad_rtol`` apart;
    ``param`` is the reference side's fp32 parameter."""
    if optimizer in ("adamw", "adam"):
        return update_rtol(steps, adamw_step_over_param(lr, param), grad_rtol)
    if optimizer == "sgd":
        if grad_norm_max is None:
            raise ValueError("recipe_param_rtol: sgd needs grad_norm_max (the clipping threshold)")
        return update_rtol(steps, sgd_step_over_param(lr, momentum, grad_norm_max, param), grad_rtol, grad_gain=1.0,
                           step_roundings=3)
    raise ValueError(f"recipe_param_rtol: optimizer must be 'adamw', 'adam' or 'sgd', got {optimizer!r}")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp64 (0 when both are zero)."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    denom = b64.abs().max().item() if b64.numel() else 0.0
    num = (a64 - b64).abs().max().item() if b64.numel() else 0.0
    return 0.0 if num == 0 else num / max(denom, 1e-300)


def triton_device() -> torch.device:
    """The device the Triton kernel tests run on; call it at the top of a test module, before importing a kernel.

    CUDA when there is a GPU, else CPU under ``TRITON_INTERPRET=1`` (set by ``conftest.py``). Skips the calling
    module when triton is missing, or when there is no GPU and the interpreter is off.
    """
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)
    return device


# The multi-tensor AdamW step against the fp64 oracle (tests/reference.py adamw_step_fp64): max |a - b| / max |b|
# per tensor, fp32 masters and moments (a few fp32 roundings per element; the threshold tests/test_optim.py holds
# FusedAdamW to against torch.optim.AdamW).
ADAMW_RTOL = 1e-6

