"""The multi-tensor AdamW step on every backend: ``gaengine.backends.adamw_step_reference`` (torch),
``torch.ops.gaengine.adamw_step_`` (cpu; cuda, emulated and on a GPU), ``gaengine.kernels.adamw.adamw_step_``
(triton), called through ``OpBackend.adamw_step_`` (``conftest.py``). ``FusedAdamW``-level tests live in
``tests/test_optim.py``.

Oracles: ``tests/reference.py``'s fp64 AdamW (every backend, fp32 masters: within ``ADAMW_RTOL`` of
``tests/tolerances.py``), and the CPU kernel, bit for bit, for the other fused kernels (triton, cuda: the same fp32
operations in the same order), fp32 masters with bf16/fp16 model copies and bf16/fp16 parameters updated in place.
Sizes with a tail, an empty parameter, one over many blocks, and an unaligned one (the scalar path).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DTYPES
from tests.reference import adamw_step_fp64
from tests.tolerances import ADAMW_RTOL, assert_bitwise_equal, rel_diff

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


def test_many_params_one_increment_each(backend):
    n = 400 + 384  # cuda: kMaxAdamWEntries = 384 per launch, three launches; empty parameters' steps count too
    sizes = [i % 7 for i in range(n)]
    state = adamw_state(backend.device, sizes, [("fp32", "bf16", "fp16")[i % 3] for i in range(n)],
                        [(None, "bf16", "fp16")[i % 3] for i in range(n)])
    start = to(state, "cpu")
    for k in range(2):
        before = to(state, "cpu")
        backend.adamw_step_(*state, *HYPER["default"], None, None)
        assert_step_against_fp64(before, state, "default", what=f"step {k} of 784 params")
    for i in range(n):
        assert float(state[4][i]) == float(start[4][i]) + 2, f"steps[{i}]"
    if backend.name in FUSED:
        import gaengine._C  # noqa: F401, PLC0415 - registers torch.ops.gaengine

        for _ in range(2):
            torch.ops.gaengine.adamw_step_(*start, *HYPER["default"], None, None)
        assert_state_bitwise(state, start, "two steps of 784 params")
