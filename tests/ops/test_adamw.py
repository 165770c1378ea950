"""The multi-tensor AdamW step of every kernel family (each backend's ``optimizer_step(FusedAdamW.STEP)``; not an op):
``gaengine.optim.adamw_step_reference`` (torch), ``torch.ops.gaengine.adamw_step_`` (cpu; cuda, emulated and on a
GPU), ``gaengine.kernels.adamw.adamw_step_`` (triton), each the one ``gaengine.optim.adamw_kernel`` picks for the
backend, called through ``OpBackend.adamw_step_`` (``conftest.py``); the bitwise cpu-vs-triton cases call the two
kernels directly. ``FusedAdamW``-level tests live in ``tests/test_optim.py``.

Oracles: ``tests/reference.py``'s fp64 AdamW (every backend, fp32 masters: within ``ADAMW_RTOL`` of
``tests/tolerances.py``), and the CPU kernel, bit for bit, for the other fused kernels (triton, cuda: the same fp32
operations in the same order), fp32 masters with bf16/fp16 model copies and bf16/fp16 parameters updated in place.
Sizes with a tail, an empty parameter, one over many blocks, and an unaligned one (the scalar path).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.ops.conftest import DTYPES, HAS_GPU, TRITON_DEVICE
from tests.reference import adamw_step_fp64
from tests.tolerances import ADAMW_RTOL, assert_bitwise_equal

SIZES = [1, 127, 0, 4097, 70 * 4096 + 3, 1000]
SMALL_SIZES = [1, 127, 0, 4097, 3 * 2048 + 5, 1000]  # the Triton interpreter's
GRADS = ["fp32", "bf16", "fp16", "fp32", "bf16", "fp16"]
MODELS = [None, "bf16", "fp16", "bf16", None, "fp16"]
HYPER = {  # lr, beta1, beta2, eps, weight_decay, maximize; beta1 = 0.3: torch's lerp with weight >= 0.5
    "default": (1e-3, 0.9, 0.999, 1e-8, 1e-2, False),
    "lerp-large-maximize": (1e-2, 0.3, 0.95, 1e-6, 0.0, True),
}
# Bitwise equal to the CPU kernel, another implementation of the same fp32 operations in the same order (the CPU
# kernel itself is held to the fp64 oracle alone: compared with itself a check could not fail).
FUSED = ("triton", "cuda-emu", "cuda-gpu")


# The tests that compare the Triton kernel's bits with the CPU kernel's: skipped where the interpreter's tl.fma
# rounds twice (tests/ops/interpreter_probe.py: Triton 3.8, with torch 2.14), which no GPU does.
TRITON_BITWISE = ("test_masters_against_fp64_and_the_cpu_kernel", "test_in_place_bitwise_equal_to_cpu_kernel",
                  "test_found_inf_skips_everything", "test_many_params_one_increment_each",
                  "test_cpu_and_triton_kernels_agree_bitwise", "test_in_place_cpu_and_triton_kernels_agree_bitwise")


@pytest.fixture(autouse=True)
def _triton_fma_rounds_once(request):
    if request.node.originalname not in TRITON_BITWISE or "triton" not in request.node.name or HAS_GPU:
        return
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return  # the test skips on its own
    from tests.ops.interpreter_probe import interpreter_fma_rounds_once  # noqa: PLC0415

    if not interpreter_fma_rounds_once():
        import triton  # noqa: PLC0415

        pytest.skip(f"Triton {triton.__version__}'s interpreter rounds tl.fma twice (x * y + z in numpy): the AdamW "
                    "kernel's bits cannot equal the CPU kernel's here; a GPU's fma rounds once (Triton 3.9's "
                    "interpreter too)")


def sizes_for(backend, sizes=SIZES):
    return sizes if backend.max_numel is None or backend.max_numel >= max(sizes) else SMALL_SIZES


def adamw_state(device, sizes, grads=GRADS, models=MODELS):
    """The argument lists of adamw_step_ on ``device``: params (the last unaligned), grads, moments, steps, models."""
    params = [torch.randn(n + 1)[1:] if i == len(sizes) - 1 else torch.randn(n) for i, n in enumerate(sizes)]
    grad_list = [torch.randn(n).to(DTYPES[g]) for n, g in zip(sizes, grads)]
    exp_avgs = [torch.randn(n) * 0.1 for n in sizes]
    exp_avg_sqs = [torch.rand(n) * 0.01 for n in sizes]
    steps = [torch.tensor(float(i % 3)) for i in range(len(sizes))]
    model_list = [None if m is None else p.to(DTYPES[m]) for p, m in zip(params, models)]
    state = (params, grad_list, exp_avgs, exp_avg_sqs, steps, model_list)
    return to(state, device)


def to(state, device):
    out = []
    for ts in state:
        copies = []
        for t in ts:
            if t is None:
                copies.append(None)
            elif t.numel() and t.data_ptr() % 16:  # keep an unaligned param unaligned
                buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
                buf[1:] = t.to(device)
                copies.append(buf[1:])
            else:
                copies.append(t.to(device, copy=True))
        out.append(copies)
    return tuple(out)


def assert_state_bitwise(actual, expected, what, names=("params", "grads", "exp_avgs", "exp_avg_sqs", "steps",
                                                          "model_params")):
    for name, xs, ys in zip(names, actual, expected):
        for i, (x, y) in enumerate(zip(xs, ys)):
            if x is not None:
                bits = (lambda t: t.view(torch.int16) if t.element_size() == 2 else t)  # noqa: E731
                assert_bitwise_equal(bits(x.cpu()), bits(y.cpu()), f"{what}: {name}[{i}]")


def assert_step_against_fp64(before, after, hyper, grad_scale=None, what="step"):
    """Each fp32 master and moment of ``after`` within ``ADAMW_RTOL`` of one fp64 AdamW step from ``before``, and
    every step count incremented by one. The error of ``exp_avg = beta1 * m + (1 - beta1) * g`` is relative to its
    operands (``beta1 * |m| + (1 - beta1) * |g|``, the sum's forward error bound), not to a result that cancels:
    a one-element parameter with ``m ~ -g / 9`` has a tiny result and fp32 roundings of its two terms."""
    beta1 = HYPER[hyper][1]
    for i in range(len(before[0])):
        t = float(before[4][i]) + 1
        assert float(after[4][i]) == t, f"{what}: steps[{i}]"
        p, m, v = adamw_step_fp64(before[0][i], before[1][i], before[2][i], before[3][i], t, *HYPER[hyper],
                                  grad_scale)
        g = before[1][i].to(torch.float64).abs() / (1.0 if grad_scale is None else float(grad_scale))
        m_operands = beta1 * before[2][i].to(torch.float64).abs() + (1.0 - beta1) * g
        for name, x, exact, scale in (("param", after[0][i], p, p), ("exp_avg", after[2][i], m, m_operands),
                                      ("exp_avg_sq", after[3][i], v, v)):
            err = (x.cpu().to(torch.float64) - exact).abs().max().item() if exact.numel() else 0.0
            bound = ADAMW_RTOL * (max(exact.abs().max().item(), scale.abs().max().item()) if exact.numel() else 0.0)
            assert err <= bound, f"{what}: {name}[{i}] off the fp64 oracle by {err:.2e} > {bound:.2e}"


def fresh_grads(state, *others):
    for g, *gs in zip(state[1], *[o[1] for o in others]):
        new = torch.randn(g.numel()).to(g.dtype)
        g.copy_(new)
        for x in gs:
            x.copy_(new)


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
@pytest.mark.parametrize("hyper", HYPER)
def test_masters_against_fp64_and_the_cpu_kernel(backend, hyper, scaled):
    pytest.importorskip("gaengine._C")
    import gaengine._C  # noqa: F401, PLC0415 - registers torch.ops.gaengine

    sizes = sizes_for(backend)
    state = adamw_state(backend.device, sizes)
    reference = to(state, "cpu")
    for step in range(3):
        grad_scale = torch.tensor(1024.0 * (step + 1)) if scaled else None
        if scaled:  # the gradients as a loss-scaled backward leaves them
            for g, g_ref in zip(state[1], reference[1]):
                g.mul_(grad_scale.item())
                g_ref.copy_(g)
        before = to(state, "cpu")
        backend.adamw_step_(*state, *HYPER[hyper], None if grad_scale is None else grad_scale.to(backend.device),
                            torch.zeros((), device=backend.device))
        torch.ops.gaengine.adamw_step_(*reference, *HYPER[hyper], grad_scale, torch.tensor(0.0))
        assert_step_against_fp64(before, state, hyper, grad_scale, f"step {step}")
        for i in range(len(sizes)):
            if state[5][i] is not None:
                assert_bitwise_equal(state[5][i], state[0][i].to(state[5][i].dtype), "model = master.to(dtype)")
        if backend.name in FUSED:
            assert_state_bitwise(state, reference, f"step {step} vs the CPU kernel")
        fresh_grads(state, reference)


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
@pytest.mark.parametrize("hyper", HYPER)
def test_in_place_bitwise_equal_to_cpu_kernel(backend, hyper, scaled):
    """bf16 and fp16 params updated in place (m, v in their dtype), mixed with fp32 masters in one call (one launch
    per param dtype), against the CPU kernel: bitwise (the fused kernels)."""
    if backend.name not in FUSED:
        pytest.skip(f"{backend.name}: not a fused kernel other than the CPU one (torch's fp32 copies round "
                    "differently; the CPU kernel is the yardstick here)")
    import gaengine._C  # noqa: F401, PLC0415 - registers torch.ops.gaengine

    sizes = sizes_for(backend, [1, 127, 4097, 70 * 4096 + 3, 1000, 4096])
    param_dtypes = [torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
    grads = ["fp32", "fp32", "bf16", "fp32", "fp16", "fp32"]
    params, grad_list, exp_avgs, exp_avg_sqs, steps, models = adamw_state(backend.device, sizes, grads,
                                                                          [None] * len(sizes))
    cast = lambda ts: [t.to(d) for t, d in zip(ts, param_dtypes)]  # noqa: E731
    state = (cast(params), grad_list, cast(exp_avgs), cast(exp_avg_sqs), steps, models)
    reference = to(state, "cpu")
    for step in range(3):
        grad_scale = torch.tensor(512.0 * (step + 1)) if scaled else None
        backend.adamw_step_(*state, *HYPER[hyper], None if grad_scale is None else grad_scale.to(backend.device),
                            torch.zeros((), device=backend.device))
        torch.ops.gaengine.adamw_step_(*reference, *HYPER[hyper], grad_scale, torch.tensor(0.0))
        assert_state_bitwise(state, reference, f"step {step}")
        fresh_grads(state, reference)


def test_found_inf_skips_everything(backend):
    state = adamw_state(backend.device, sizes_for(backend))
    before = to(state, "cpu")
    backend.adamw_step_(*state, *HYPER["default"], None, torch.tensor(1.0, device=backend.device))
    assert_state_bitwise(state, before, "skipped step")
    backend.adamw_step_(*state, *HYPER["default"], None, torch.tensor(0.0, device=backend.device))
    assert_step_against_fp64(before, state, "default", what="step after the skip")
    if backend.name in FUSED:
        import gaengine._C  # noqa: F401, PLC0415 - registers torch.ops.gaengine

        torch.ops.gaengine.adamw_step_(*before, *HYPER["default"], None, None)
        assert_state_bitwise(state, before, "step after the skip")


def _cuda_adamw_entries() -> int:
    """``kMaxOptimizerEntries`` of ``csrc/cuda/kernels/optimizer.cuh`` (AdamW's ``kMaxAdamWEntries``): the parameters
    one cuda AdamW launch takes."""
    header = Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "kernels" / "optimizer.cuh"
    found = re.search(r"constexpr int kMaxOptimizerEntries = (\d+);", header.read_text())
    assert found, f"no kMaxOptimizerEntries in {header}"
    return int(found.group(1))


def test_many_params_one_increment_each(backend):
    # The count follows from the cuda kernel's entries per launch (not a measured number): two full launches and a
    # third partial one (16 more), so every launch boundary is crossed; empty parameters' steps count too.
    n = 2 * _cuda_adamw_entries() + 16
    sizes = [i % 7 for i in range(n)]
    state = adamw_state(backend.device, sizes, [("fp32", "bf16", "fp16")[i % 3] for i in range(n)],
                        [(None, "bf16", "fp16")[i % 3] for i in range(n)])
    start = to(state, "cpu")
    for k in range(2):
        before = to(state, "cpu")
        backend.adamw_step_(*state, *HYPER["default"], None, None)
        assert_step_against_fp64(before, state, "default", what=f"step {k} of {n} params")
    for i in range(n):
        assert float(state[4][i]) == float(start[4][i]) + 2, f"steps[{i}]"
    if backend.name in FUSED:
        import gaengine._C  # noqa: F401, PLC0415 - registers torch.ops.gaengine

        for _ in range(2):
            torch.ops.gaengine.adamw_step_(*start, *HYPER["default"], None, None)
        assert_state_bitwise(state, start, f"two steps of {n} params")


# ------------------------------------------------------------------------ the CPU and Triton kernels, directly
# Special gradients (+-0, subnormals, tiny and huge magnitudes), grad scales outside [2^-20, 2^20] and a tiny
# sqrt(1 - beta2^t): the paths where the C++ kernel's division shortcut (Markstein's correction, AVX2) and its IEEE
# fallback part; the C++ and Triton kernels are two implementations of one specification (the same bits), and the
# portable C++ kernel gives the AVX2 one's bits. (FusedAdamW, the optimizer over these kernels, against
# torch.optim.AdamW: tests/test_optim.py.)
IN_PLACE_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _need_both_kernels_on_cpu() -> None:
    """Skip unless gaengine._C (which registers torch.ops.gaengine) and the Triton interpreter both run here."""
    if TRITON_DEVICE.type != "cpu":
        pytest.skip("needs both kernels on CPU tensors (a GPU is present: triton runs on CUDA tensors)")
    pytest.importorskip("gaengine._C")
    from gaengine.backends import get_backend  # noqa: PLC0415

    try:
        get_backend("triton", "cpu")
    except RuntimeError as exc:
        pytest.skip(f"the Triton interpreter is unavailable: {exc}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype != torch.float32 else t.view(torch.int32)


def _in_place_state(n: int, dtype: torch.dtype, seed: int = 0):
    """A bf16 | fp16 param with a non-trivial moment state, as its optimizer would hold it."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(dtype)
    m = (torch.randn(n, generator=g) * 0.1).to(dtype)
    v = (torch.rand(n, generator=g) * 0.01).to(dtype)
    return p, m, v


def _special_grads(n: int, dtype: torch.dtype, k: int) -> torch.Tensor:
    """Gradients with the values a division shortcut gets wrong: +-0, subnormals, tiny and huge magnitudes
    (a huge one makes v = inf), in otherwise random vectors, so vector lanes mix them with normal values."""
    g = torch.randn(n) * 5
    specials = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1e-35, 2.0**-101, 2.0**-99, 1e30, -2.0**100, 2.0**99])
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(k))[: 4 * len(specials)]
    g[idx] = specials.repeat(4)
    return g.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else g.to(dtype)  # finite in fp16 too


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: 1e30 / 2^-30 overflows, as it should
@pytest.mark.parametrize("grad_scale", [2.5, 2.0**-30, 3.0e7], ids=["scale2.5", "scale2^-30", "scale3e7"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["g-fp32", "g-bf16", "g-fp16"])
@pytest.mark.parametrize("model_dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16-model", "fp16-model"])
def test_cpu_and_triton_kernels_agree_bitwise(model_dtype, grad_dtype, grad_scale):
    """The C++ and Triton kernels are two implementations of one specification: the same bits (on CPU tensors).

    The Triton kernel divides with IEEE division (div_rn); the C++ one replaces the two divisions by a scalar
    with Markstein's correction where that is exact, and divides elsewhere: special values and grad scales
    outside [2^-20, 2^20] take those other paths. beta2 = 1 - 1e-13 makes sqrt(1 - beta2^t) < 2^-20."""
    _need_both_kernels_on_cpu()
    from gaengine.kernels import adamw  # noqa: PLC0415

    n = 3000
    tensors = {}
    for name in ("cpu", "triton"):
        torch.manual_seed(0)
        p, m, v = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01
        step = torch.tensor(3.0)
        model = None if model_dtype is None else torch.full((n,), float("nan"), dtype=model_dtype)
        for k in range(4):
            g = _special_grads(n, grad_dtype, k) if k % 2 else (torch.randn(n) * 5).to(grad_dtype)
            beta2 = 1.0 - 1e-13 if k == 3 else 0.999
            args = ([p], [g], [m], [v], [step], [model], 1e-2, 0.9, beta2, 1e-8, 0.1, k == 2,
                    torch.tensor(grad_scale), torch.tensor(0.0))
            torch.ops.gaengine.adamw_step_(*args) if name == "cpu" else adamw.adamw_step_(*args, block_size=512)
        tensors[name] = [p, m, v, step] + ([model] if model is not None else [])
    for a, b, what in zip(tensors["cpu"], tensors["triton"], ["param", "exp_avg", "exp_avg_sq", "step", "model"]):
        if a.dtype != torch.float32:
            a, b = a.view(torch.int16), b.view(torch.int16)  # bits, not values
        assert_bitwise_equal(b, a, f"triton vs cpu: {what}")
    p, finite = tensors["cpu"][0], tensors["cpu"][0].isfinite()  # 1e30 / 2^-30 overflows: some params are NaN
    if model_dtype is not None:
        assert_bitwise_equal(tensors["cpu"][4][finite].view(torch.int16), p[finite].to(model_dtype).view(torch.int16),
                             "model == master.to(dtype)")


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "misaligned"])
def test_large_param_streams_the_model_write_exactly(offset, model_dtype):
    """From 2^20 elements the C++ kernel writes the model copy with non-temporal stores, after peeling
    elements up to a 16-byte boundary: the bits are those of the cached path and of master.to(dtype)."""
    pytest.importorskip("gaengine._C")  # registers torch.ops.gaengine

    n = (1 << 20) + 13
    runs = []
    for attach in (True, False):
        torch.manual_seed(0)
        p, m, v, step = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01, torch.tensor(1.0)
        buf = torch.full((n + offset,), float("nan"), dtype=model_dtype)
        model = buf[offset:] if attach else None
        g = torch.randn(n)
        torch.ops.gaengine.adamw_step_([p], [g], [m], [v], [step], [model], 1e-2, 0.9, 0.999, 1e-8, 0.1, False, None,
                                       None)
        runs.append((p, m, v, model, buf))
    (p, m, v, model, buf), (p0, m0, v0, _, _) = runs
    for a, b, what in ((p, p0, "param"), (m, m0, "exp_avg"), (v, v0, "exp_avg_sq")):
        assert_bitwise_equal(a, b, what)
    assert_bitwise_equal(model, p.to(model_dtype), "streamed model == master.to(dtype)")
    assert bool(buf[:offset].isnan().all())  # nothing written before the view


_PORTABLE_CHECK = textwrap.dedent("""
    import torch
    import gaengine._C  # noqa: F401 - registers torch.ops.gaengine
    torch.manual_seed(0)
    n = 4097 + 13
    p, m, v, step = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01, torch.tensor(2.0)
    model = torch.empty(n, dtype=torch.bfloat16)
    specials = torch.tensor([0.0, -0.0, 1e-40, 1e-35, 2.0**-101, 2.0**-99, 1e30, -2.0**100])
    for k in range(4):
        g = torch.randn(n) * 3
        g[torch.randperm(n)[:64]] = specials.repeat(8)
        torch.ops.gaengine.adamw_step_([p], [g.to(torch.bfloat16)], [m], [v], [step], [model], 1e-2,
                                       0.3 if k == 1 else 0.9, 1.0 - 1e-13 if k == 3 else 0.999, 1e-8, 0.1, False,
                                       torch.tensor(2.0**-30 if k == 2 else 0.7), None)
    in_place = []  # bf16 | fp16 params updated in place (no master) from fp32 gradients
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(1)
        q, qs = torch.randn(n).to(dtype), torch.tensor(2.0)
        qm, qv = (torch.randn(n) * 0.1).to(dtype), (torch.rand(n) * 0.01).to(dtype)
        for k in range(3):
            g = torch.randn(n) * 3
            g[torch.randperm(n)[:64]] = specials.repeat(8)
            torch.ops.gaengine.adamw_step_([q], [g], [qm], [qv], [qs], [None], 1e-2, 0.9, 0.999, 1e-8, 0.1, k == 1,
                                           torch.tensor(2.0**-30 if k == 2 else 0.7), None)
        in_place += [q, qm, qv]
    torch.save([p, m, v, step, model] + in_place, __import__("sys").argv[1])
""")


def test_portable_and_avx2_kernels_give_the_same_bits(tmp_path):
    """The portable kernel divides; the AVX2 one uses Markstein's correction where exact: same bits, special
    gradients (+-0, subnormal, tiny, huge), grad scales outside [2^-20, 2^20] and a tiny sqrt(bc2) included;
    also for bf16 | fp16 params updated in place (portable: c10 rounding; AVX2: bit ops / F16C)."""
    pytest.importorskip("gaengine._C")
    root = Path(__file__).resolve().parents[2]
    out = {}
    for isa in ("auto", "portable"):
        env = {**os.environ, "GAENGINE_CPU_ISA": isa}
        path = tmp_path / f"{isa}.pt"
        proc = subprocess.run([sys.executable, "-c", _PORTABLE_CHECK, str(path)], env=env, cwd=root,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[isa] = torch.load(path)
    names = ["param", "exp_avg", "exp_avg_sq", "step", "model"] + [
        f"in-place {d} {w}" for d in ("bf16", "fp16") for w in ("param", "exp_avg", "exp_avg_sq")]
    assert len(out["auto"]) == len(names)
    for a, b, what in zip(out["auto"], out["portable"], names):
        if a.dtype != torch.float32:
            a, b = a.view(torch.int16), b.view(torch.int16)  # bits, not values (some params overflow to NaN)
        assert_bitwise_equal(b, a, f"portable vs auto: {what}")


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g-fp32", "g-bf16"])
@pytest.mark.parametrize("dtype", IN_PLACE_DTYPES)
def test_in_place_cpu_and_triton_kernels_agree_bitwise(dtype, grad_dtype):
    """Special gradients (+-0, subnormal, tiny, huge), grad scales in and outside [2^-20, 2^20] (the AVX2 path's
    Markstein division and its IEEE fallback), maximize, a tiny sqrt(bc2): the same bits from both kernels."""
    _need_both_kernels_on_cpu()
    from gaengine.kernels import adamw  # noqa: PLC0415

    n = 3000
    out = {}
    for name in ("cpu", "triton"):
        torch.manual_seed(0)  # the same gradients for both
        p, m, v = _in_place_state(n, dtype)
        p, step = p.detach(), torch.tensor(3.0)
        for k in range(4):
            g = _special_grads(n, grad_dtype, k) if k % 2 else (torch.randn(n) * 5).to(grad_dtype)
            args = ([p], [g], [m], [v], [step], [None], 1e-2, 0.9, 1.0 - 1e-13 if k == 3 else 0.999, 1e-8, 0.1,
                    k == 2, torch.tensor((2.5, 2.0**-30, 3.0e7, 0.7)[k]), torch.tensor(0.0))
            torch.ops.gaengine.adamw_step_(*args) if name == "cpu" else adamw.adamw_step_(*args, block_size=512)
        out[name] = (p, m, v, step)
    for a, b, what in zip(out["cpu"], out["triton"], ("param", "exp_avg", "exp_avg_sq", "step")):
        assert_bitwise_equal(_bits(b), _bits(a), f"triton vs cpu: {what}")


def _bad_second_param(case: str):
    """``AdamWStep`` arguments of two parameters of 4 elements, the first valid, the second (or a shared argument)
    broken as ``case`` says, by name (``block_size`` among them for the block-size case)."""
    p, g, m, v = ([torch.randn(4), torch.randn(4)] for _ in range(4))
    steps, models = [torch.tensor(1.0), torch.tensor(1.0)], [None, None]
    kwargs = {}
    if case == "lengths":
        models = [None]
    elif case == "block-size":
        kwargs["block_size"] = 100
    elif case == "grad-scale-1d":
        kwargs["grad_scale"] = torch.ones(1)
    elif case == "params-fp64":
        p[1] = p[1].double()
    elif case == "in-place-moment-dtype":
        p[1], v[1] = p[1].bfloat16(), v[1].bfloat16()  # exp_avgs[1] stays fp32
    elif case == "in-place-with-model":
        p[1], m[1], v[1] = p[1].bfloat16(), m[1].bfloat16(), v[1].bfloat16()
        models[1] = torch.zeros(4, dtype=torch.bfloat16)
    elif case == "grads-int":
        g[1] = g[1].int()
    elif case == "step-1d":
        steps[1] = torch.ones(1)
    elif case == "model-fp32":
        models[1] = torch.zeros(4)
    elif case == "grads-numel":
        g[1] = torch.randn(5)
    elif case == "grads-device":
        g[1] = g[1].to("meta")
    args = {"params": p, "grads": g, "exp_avgs": m, "exp_avg_sqs": v, "steps": steps, "model_params": models,
            "lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, "maximize": False,
            "grad_scale": None, "found_inf": None}
    return {**args, **kwargs}


TRITON_CHECKS = {
    "lengths": "must have the same length",
    "block-size": "block_size must be a power of two >= 16, got 100",
    "grad-scale-1d": r"grad_scale must be a 0-d floating tensor on cpu, got a \(1,\)",
    "params-fp64": "params\\[1\\] must be float32, got torch.float64",
    "in-place-moment-dtype": r"exp_avgs\[1\] must be torch.bfloat16 \(the dtype of params\[1\]\), got torch.float32",
    "in-place-with-model": r"model_params\[1\] must be None: params\[1\] is torch.bfloat16, updated in place",
    "grads-int": r"grads\[1\] must be float32, bfloat16 or float16, got torch.int32",
    "step-1d": r"steps\[1\] must be a 0-d float32 tensor on cpu",
    "model-fp32": r"model_params\[1\] must be bfloat16 or float16, got torch.float32",
    "grads-numel": r"grads\[1\], exp_avgs\[1\], exp_avg_sqs\[1\] and model_params\[1\] must have the 4 elements",
    "grads-device": "every tensor of parameter 1 must be on cpu",
}


@pytest.mark.parametrize("case", TRITON_CHECKS)
def test_triton_launcher_refuses_bad_arguments_before_writing(case):
    """The Triton launcher's checks (``gaengine.kernels.adamw``): ``ValueError`` naming the argument, and nothing
    written, the valid first parameter and every step count included (each bitwise equal to its copy from before)."""
    pytest.importorskip("triton")
    from gaengine.kernels import adamw  # noqa: PLC0415

    args = _bad_second_param(case)
    block_size = args.pop("block_size", adamw.BLOCK_SIZE)
    before = {name: [t.clone() for t in args[name]] for name in ("params", "exp_avgs", "exp_avg_sqs", "steps")}
    with pytest.raises(ValueError, match=TRITON_CHECKS[case]):
        adamw.adamw_step_(**args, block_size=block_size)
    for name, copies in before.items():
        for i, (t, copy) in enumerate(zip(args[name], copies)):
            assert_bitwise_equal(_bits(t), _bits(copy), f"{case}: {name}[{i}]")
