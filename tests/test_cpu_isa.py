"""The compiled CPU backend's implementation choices: ``GAENGINE_CPU_ISA=portable`` (the non-AVX2 path an old
x86-64 or an aarch64 CPU runs) keeps every contract, an unknown ISA is refused, and the norms' bits do not depend on
the thread count. The ops' values on the default ISA are tested per operation in ``tests/ops/``.
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

from gaengine.backends import get_backend  # noqa: E402
from tests.child_contracts import skip_or_fail_on_crash  # noqa: E402
from tests.tolerances import assert_bitwise_equal  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_PARAMS = [pytest.param(dt, id=name) for name, dt in DTYPES.items()]


def grad_like(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, dtype=torch.float32).to(dtype)


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


# ------------------------------------------------------------------------------- accumulate_bucket_ free norm


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_bucket_partials_same_bits_for_any_thread_count(dtype):
    dst0, src = torch.randn(1_000_003), grad_like(1_000_003, dtype) * 3.7
    threads = torch.get_num_threads()
    dsts, sums = [], []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            dst, partials = dst0.clone(), torch.zeros(1, 2, dtype=torch.float64)
            get_backend("cpu").accumulate_bucket_(dst, [src], [0], [False], partials)
            dsts.append(dst)
            sums.append(partials[0, 0].clone())
    finally:
        torch.set_num_threads(threads)
    for t, d, s in zip((2, 3), dsts[1:], sums[1:]):
        assert_bitwise_equal(d, dsts[0], f"dst with {t} threads vs 1")
        assert s.item() == sums[0].item(), f"sum_sq with {t} threads vs 1: {s.item()!r} != {sums[0].item()!r}"


# ---------------------------------------------------------------------------- portable (non-AVX2) fallback

_PORTABLE_CHECK = textwrap.dedent(
    """
    import torch
    import gaengine._C  # registers torch.ops.gaengine
    ops = torch.ops.gaengine
    from tests.reference import accumulate_fp64, sum_sq_fp64
    from tests.tolerances import assert_bitwise_equal, assert_within_ulp, sum_sq_rtol
    torch.manual_seed(0)
    for n in (1, 127, 4097, 65540, 200_003):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            dst, src = torch.randn(n), torch.randn(n).to(dtype)
            out = dst.clone(); ops.accumulate_(out, src, 1.0, False)
            assert_bitwise_equal(out, dst.clone().add_(src), "portable add")
            out = torch.full((n,), float("nan")); ops.accumulate_(out, src, 1.0, True)
            assert_bitwise_equal(out, src.float(), "portable overwrite")
            out = dst.clone(); ops.accumulate_(out, src, 1 / 3, False)
            assert_within_ulp(out, accumulate_fp64(dst, src, 1 / 3), src.double() / 3, what="portable scaled")
            sum_sq, found_inf = ops.l2norm_sq(src)
            assert abs(sum_sq.item() - sum_sq_fp64(src)) <= sum_sq_rtol(n) * sum_sq_fp64(src)
            assert found_inf.item() == 0.0
            for ow in (False, True):
                out, ref = dst.clone(), dst.clone()
                ops.accumulate_(ref, src, 1.0, ow)
                partials = torch.zeros(1, 2, dtype=torch.float64)
                ops.accumulate_bucket_(out, [src], [0], [ow], partials)
                assert_bitwise_equal(out, ref, "portable accumulate_bucket_")
                assert abs(partials[0, 0].item() - sum_sq_fp64(ref)) <= sum_sq_rtol(n) * sum_sq_fp64(ref)
                assert partials[0, 1].item() == 0.0
            src[n // 2] = float("nan")
            assert ops.l2norm_sq(src)[1].item() == 1.0
            partials = torch.zeros(1, 2, dtype=torch.float64)
            ops.accumulate_bucket_(dst.clone(), [src], [0], [False], partials)
            assert partials[0, 1].item() == 1.0
        x = torch.randn(n); expected = x.clone().mul_(torch.tensor(0.37))
        ops.scale_(x, torch.tensor(0.37)); assert_bitwise_equal(x, expected, "portable scale")
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
