"""``gaengine.optim.FusedLion`` on every kernel family against an fp64 Lion written here (Chen et al., "Symbolic
Discovery of Optimization Algorithms", 2023, Algorithm 2), and its row of ``gaengine.optimizers``.

The fp64 reference steps from the fused optimizer's own state each step, so the budget is one step's: the new fp32
parameter within 2 rounding errors of ``p * (1 - lr * wd) - lr * sign(c)`` (three fp32 operations), the momentum
within 3 of ``beta2 * m + (1 - beta2) * g``, except where ``c = beta1 * m + (1 - beta1) * g`` is so close to 0 that
its fp32 rounding may flip the sign (|c| within 3 roundings of |beta1 * m| + |(1 - beta1) * g|, none in these
draws: checked). bf16 parameters updated in place: within one bf16 ulp of the fp64 result. The C++ launcher (cpu),
the Triton kernel (TRITON_INTERPRET=1 without a GPU) and the CUDA launcher (the emulated build of tests/cuda_emu)
run the same fp32 operations: their results are bitwise equal to each other.
"""

from __future__ import annotations

import pytest
import torch

from gaengine import optimizers
from gaengine.optim import FusedLion
from tests.conftest import backend_device, backend_params
from tests.tolerances import assert_bitwise_equal, low_precision_ulp, unit_roundoff

SIZES = [1, 127, 4097]  # one element, a partial vector, one past a CPU block / two Triton and CUDA chunks
STEPS = 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


# tests/conftest.py's backend fixture, on every family FusedLion has a kernel for (cuda-emu: the emulated build).
ALL_BACKENDS = pytest.mark.parametrize("backend", backend_params("torch", "cpu", "triton", "cuda-emu", "cuda-gpu"),
                                       indirect=True)


def lion_fp64(p, m, g, lr, beta1, beta2, weight_decay, grad_scale=1.0):
    """One Lion update in fp64 (the paper's Algorithm 2 with decoupled weight decay): new (p, m, c)."""
    p, m, g = p.double(), m.double(), g.double() / grad_scale
    c = beta1 * m + (1 - beta1) * g
    new_p = p * (1 - lr * weight_decay) - lr * torch.sign(c)
    return new_p, beta2 * m + (1 - beta2) * g, c


def _draw(sizes, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(dtype).to(device).requires_grad_() for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(device) for n in sizes] for _ in range(STEPS)]
    return params, grads


def _set_grads(params, grads):
    """fp32 gradients: ``.grad`` of an fp32 parameter, ``.main_grad`` of a bf16/fp16 one (its fp32 gradient)."""
    for p, g in zip(params, grads):
        if p.dtype == torch.float32:
            p.grad = g
        else:
            p.main_grad = g


def _check_one_step(p_before, m_before, g, p, m, hyper, grad_scale=1.0):
    """The fused step's (p, m) against lion_fp64 from the same (p_before, m_before)."""
    lr, (beta1, beta2), wd = hyper["lr"], hyper["betas"], hyper["weight_decay"]
    p64, m64, c64 = lion_fp64(p_before, m_before, g, lr, beta1, beta2, wd, grad_scale)
    u = unit_roundoff(torch.float32)
    gs = g.double() / grad_scale
    c_bound = 3 * u * (beta1 * m_before.double().abs() + (1 - beta1) * gs.abs())
    assert not bool((c64.abs() <= c_bound).any()), "a draw with c too close to 0 for its sign to be certain"
    if p.dtype == torch.float32:
        p_bound = 2 * u * (p_before.double().abs() + lr) + 1e-300
        m_bound = 3 * u * (beta2 * m_before.double().abs() + (1 - beta2) * gs.abs()) + 1e-300
    else:  # rounded to the parameter's dtype once each
        p_bound = low_precision_ulp(p64.to(p.dtype)) + 2 * u * (p_before.double().abs() + lr)
        m_bound = low_precision_ulp(m64.to(p.dtype)) + 3 * u * (beta2 * m_before.double().abs() + gs.abs())
    assert bool(((p.double() - p64).abs() <= p_bound).all()), f"p off by {float((p.double() - p64).abs().max())}"
    assert bool(((m.double() - m64).abs() <= m_bound).all()), f"m off by {float((m.double() - m64).abs().max())}"


@ALL_BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lion_matches_fp64_lion(backend, request, dtype):
    device = backend_device(request.node.callspec.params["backend"])
    params, grads = _draw(SIZES, dtype, device, seed=1)
    opt = FusedLion(params, backend=backend, **HYPER)
    grad_scale = torch.tensor(3.0, device=device)
    opt.grad_scale = grad_scale
    for step in range(STEPS):
        before = [(p.detach().clone(),
                   opt.state[p]["exp_avg"].clone() if opt.state.get(p) else torch.zeros_like(p.detach()))
                  for p in params]
        _set_grads(params, grads[step])
        opt.step()
        for (p0, m0), p, g in zip(before, params, grads[step]):
            _check_one_step(p0, m0, g, p.detach(), opt.state[p]["exp_avg"], HYPER, grad_scale=3.0)
    assert set(opt.state[params[0]]) == {"exp_avg"}  # no step count: the table row's keeps_step=False


def _run(backend, device, dtype=torch.float32, model_dtype=None, found_inf=None):
    params, grads = _draw(SIZES, dtype, device, seed=2)
    opt = FusedLion(params, backend=backend, **HYPER)
    models = [p.detach().to(model_dtype) for p in params] if model_dtype else None
    if models:
        opt.attach_model_params(zip(params, models))
    for step in range(STEPS):
        _set_grads(params, grads[step])
        opt.found_inf = None if found_inf is None or step < STEPS - 1 else found_inf.to(device)
        opt.step()
    return params, [opt.state[p]["exp_avg"] for p in params], models


@ALL_BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_families_give_the_same_bits(backend, request, dtype):
    """cpu, triton and the CUDA launcher run the Lion functor's fp32 operations: bitwise equal to each other (here:
    to the C++ launcher's; the plain-torch reference is within the fp64 test's budget instead)."""
    backend_id = request.node.callspec.params["backend"]
    if backend_id in ("torch", "cpu"):
        pytest.skip("compared against the cpu launcher")
    device = backend_device(backend_id)
    ours = _run(backend, device, dtype, model_dtype=torch.bfloat16 if dtype == torch.float32 else None)
    ref = _run("cpu", "cpu", dtype, model_dtype=torch.bfloat16 if dtype == torch.float32 else None)
    for a, b in zip(ours[0] + ours[1] + (ours[2] or []), ref[0] + ref[1] + (ref[2] or [])):
        assert_bitwise_equal(a.detach().cpu(), b.detach(), "FusedLion result")


@ALL_BACKENDS
def test_model_write_and_skip(backend, request):
    """An attached bf16 model parameter is exactly the new master's rounding; found_inf != 0 writes no bit."""
    device = backend_device(request.node.callspec.params["backend"])
    params, states, models = _run(backend, device, model_dtype=torch.bfloat16)
    for p, model in zip(params, models):
        assert_bitwise_equal(model, p.detach().to(torch.bfloat16), "model parameter")
    skipped = _run(backend, device, model_dtype=torch.bfloat16, found_inf=torch.tensor(1.0))
    two_steps = _two_steps(backend, device)
    for a, b in zip(skipped[0] + skipped[1], two_steps[0] + two_steps[1]):
        assert_bitwise_equal(a.detach(), b.detach(), "skipped update")


def _two_steps(backend, device):
    params, grads = _draw(SIZES, torch.float32, device, seed=2)
    opt = FusedLion(params, backend=backend, **HYPER)
    for step in range(STEPS - 1):
        _set_grads(params, grads[step])
        opt.step()
    return params, [opt.state[p]["exp_avg"] for p in params]


def test_defaults_and_table_row():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = FusedLion([p])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)  # the paper's
    assert optimizers.is_elementwise(opt) and optimizers.moment_keys(opt, group) == ["exp_avg"]
    assert optimizers.step_key(opt) is None and optimizers.writes_model_params(opt) and optimizers.takes_grad_scale(opt)


@pytest.mark.parametrize("bad, name", [(dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
                                       (dict(weight_decay=float("nan")), "weight_decay"),
                                       (dict(lr=torch.tensor(1e-3)), "lr")])
def test_bad_hyperparameters_name_the_argument_and_change_nothing(bad, name):
    p = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=name):
        FusedLion([p], **bad)
    opt = FusedLion([p], lr=1e-2)
    p.grad = torch.randn(5)
    opt.step()
    before = (p.detach().clone(), opt.state[p]["exp_avg"].clone())
    opt.param_groups[0].update(bad)
    p.grad = torch.randn(5)
    with pytest.raises(ValueError, match=name):
        opt.step()
    assert_bitwise_equal(p.detach(), before[0], "param after a refused step")
    assert_bitwise_equal(opt.state[p]["exp_avg"], before[1], "exp_avg after a refused step")


def test_state_dict_round_trip():
    params, grads = _draw(SIZES, torch.float32, "cpu", seed=3)
    opt = FusedLion(params, **HYPER)
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    copies = [p.detach().clone().requires_grad_() for p in params]
    back = FusedLion(copies, **HYPER)
    back.load_state_dict(opt.state_dict())
    for p, q, g in zip(params, copies, grads[1]):
        p.grad, q.grad = g, g.clone()
    opt.step()
    back.step()
    for p, q in zip(params, copies):
        assert_bitwise_equal(q.detach(), p.detach(), "param after a state-dict round trip")


def test_the_op_names_the_known_optimizers():
    """optimizer_step_ dispatches by name: an unknown one raises, listing those gaengine._C has."""
    ops = torch.ops.gaengine
    p = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"unknown optimizer 'lamb' \(this gaengine._C has: adamw, lion"):
        ops.optimizer_step_("lamb", [p], [p.clone()], [p.clone()], [], [None], [1e-3, 0.9, 0.99, 0.0], None, None)
    with pytest.raises(RuntimeError, match="lion: hyper must hold 4 values, got 3"):
        ops.optimizer_step_("lion", [p], [p.clone()], [p.clone()], [], [None], [1e-3, 0.9, 0.99], None, None)


def _engine_run(windows, saved=None, stop=None):
    """A bf16 model, fp32 masters, FusedLion with the clip coefficient folded in, K = 2; restored from ``saved``
    (``torch.save`` bytes of the model and the accumulator) when given; stops after ``stop`` windows, returning the
    model, the accumulator and the saved bytes of that point."""
    import io  # noqa: PLC0415

    import gaengine  # noqa: PLC0415
    from tests.models import MLP  # noqa: PLC0415

    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    acc = gaengine.GradientAccumulator(model, FusedLion(model.parameters(), **HYPER), accumulation_steps=2,
                                       max_grad_norm=0.5)
    if saved is not None:
        state = torch.load(io.BytesIO(saved), weights_only=True)
        model.load_state_dict(state["model"])
        acc.load_state_dict(state["acc"])
    blob = None
    for w, batches in enumerate(windows):
        if stop is not None and w == stop:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "acc": acc.state_dict()}, buffer)
            blob = buffer.getvalue()
            break
        for x, y in batches:
            acc.backward(((model(x).float() - y) ** 2).mean())
            acc.step()
    return model, acc, blob


def test_engine_checkpoint_round_trip_keeps_lion_state_as_the_table_says():
    """GradientAccumulator + FusedLion saved after 2 windows and restored into a fresh one trains on exactly as the
    uninterrupted run; the restored state holds the row's moments and no step count (keeps_step=False)."""
    gen = torch.Generator().manual_seed(4)
    windows = [[(torch.randn(8, 12, generator=gen).bfloat16(), torch.randn(8, 5, generator=gen))
                for _ in range(2)] for _ in range(4)]
    whole, _, _ = _engine_run(windows)
    _, first, saved = _engine_run(windows, stop=2)
    first.close()
    resumed, acc, _ = _engine_run(windows[2:], saved=saved)
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), "resumed model parameter")
    opt = acc.optimizer
    assert all(set(opt.state[p]) == {"exp_avg"} for g in opt.param_groups for p in g["params"] if opt.state.get(p))
