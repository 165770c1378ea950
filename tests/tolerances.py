"""One dtype-keyed tolerance table and the assertion helpers every kernel test uses.

Budgets (STYLE.md §2): an unscaled accumulate is bitwise equal to torch; a scaled one is within 1 fp32
ulp of the fp64 oracle (ulp taken at the larger of the product and the result, since a fused
multiply-add and a separate multiply + add round differently); a sum of squares is within a relative
tolerance that grows with the number of terms.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

# Relative error per term of a float32 reduction, against fp64 (unit roundoff of fp32).
FP32_EPS = 2.0**-24

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


def sum_sq_rtol(n: int) -> float:
    """Relative tolerance of an fp32 sum of ``n`` squares against fp64: grows like sqrt(n)*eps, floored."""
    return 4 * FP32_EPS * max(1.0, math.sqrt(n)) + 1e-7


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
