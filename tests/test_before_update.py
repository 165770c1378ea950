"""``acc.step(before_update=fn)`` and ``acc.begin_step()``: the window's gradient lent in ``.grad``.

* ``fn`` calling what would change the window (``step``, ``begin_step``, ``zero_grad``, ``close``, ``backward``,
  ``state_dict``, ``load_state_dict``) is refused naming the call, the window bit for bit as it was.
* ``.grad`` edits made by ``fn`` (in place, a replaced ``.grad``, ``.grad = None``, torch's ``clip_grad_norm_``)
  reach the update for fp32 and bf16 parameters alike: against the plain fp64 recipe doing the same edit.

The parameters' gradients are exact in every dtype (``loss = sum(w * x)`` with small integer ``x``: each micro-batch's
gradient is ``x``, its sums exact in bf16 and fp32), so the only roundings are the normalization, the edit of a
bf16 rounding and the clip, each bounded from the dtypes' unit roundoff.
"""

from __future__ import annotations

import pytest
import torch

import gaengine
from tests.tolerances import RTOL, clip_coef_rtol, norm_rtol, unit_roundoff

K, LR = 3, 0.5
SHAPES = [(8,), (4,), (3,)]


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _inputs():
    """K micro-batches, one integer tensor per parameter (values in [-8, 8]: sums of K of them exact in bf16)."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(-8, 9, s, generator=g).double() for s in SHAPES] for _ in range(K)]


def _loss(params, xs):
    return sum((p * x.to(p.dtype)).sum() for p, x in zip(params, xs))


MASK = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.5, 1.0, 0.0])


def _edit(params):
    """The edit a user's hook makes: a mask in place on the first parameter, the second's ``.grad`` replaced by twice
    itself, the third's dropped (no update)."""
    params[0].grad.mul_(MASK.to(params[0].grad.dtype))
    params[1].grad = params[1].grad * 2
    params[2].grad = None


def _reference(dtype, max_norm):
    """The plain recipe in fp64: ``(loss / K).backward()`` per micro-batch, the same edit, torch's clip, SGD. Returns
    the parameters after the update, the edited gradient's norm and the clip coefficient."""
    params = [torch.nn.Parameter(p.detach().double()) for p in _params(dtype)]
    opt = torch.optim.SGD(params, lr=LR)
    for xs in _inputs():
        (_loss(params, xs) / K).backward()
    _edit(params)
    norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    opt.step()
    return [p.detach() for p in params], float(norm), min(1.0, max_norm / (float(norm) + 1e-6))


def _gaengine(dtype, max_norm, how, edit=_edit):
    """The same under gaengine, ``edit(params)`` made in ``before_update`` (``how="before_update"``) or between
    ``begin_step()`` and ``step()`` (``how="begin_step"``). Returns the optimizer's parameters after the update (fp32
    masters for bf16) and the step's result."""
    params = _params(dtype)
    opt = torch.optim.SGD(params, lr=LR)
    acc = gaengine.GradientAccumulator(params, opt, accumulation_steps=K, max_grad_norm=max_norm, backend="torch")
    masters = [p for g in opt.param_groups for p in g["params"]]
    for xs in _inputs():
        acc.backward(_loss(params, xs))
    if how == "before_update":
        result = acc.step(before_update=lambda: edit(params))
    else:
        assert acc.begin_step()
        edit(params)
        result = acc.step()
    acc.close()
    return [m.detach() for m in masters], result


@pytest.mark.parametrize("how", ["before_update", "begin_step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_edits_of_grad_reach_the_update_for_every_dtype(dtype, how):
    """The plain recipe's edit (mask in place, ``.grad`` replaced, ``.grad = None``), then a clip at a threshold the
    edited gradient exceeds: gaengine's parameters, ``grad_norm`` and ``clip_coef`` are the fp64 recipe's.

    Bound per element of the update ``lr * c * g_e``: the edited gradient's own error (fp32: the normalization's
    rounding and the fp32 ``.grad`` itself, 2u; bf16: the rounding of ``.grad`` to bf16, which an edited element
    keeps, RTOL[bf16] + 2u), the clip coefficient's ``clip_coef_rtol(n)`` over the n edited elements, and the update
    itself (a product and a subtraction: the parameter's ulp). Before the change the bf16 edit was ignored (the masked
    elements moved) and the fp32 replaced ``.grad`` and ``.grad = None`` were (the bias at half its update, the
    dropped parameter moved)."""
    max_norm = 1.0
    ref, ref_norm, ref_coef = _reference(dtype, max_norm)
    got, result = _gaengine(dtype, max_norm, how)
    start = [p.detach().double() for p in _params(dtype)]
    u = unit_roundoff(torch.float32)
    n = sum(s[0] for s in SHAPES[:2])
    grad_rtol = (RTOL[dtype] if dtype != torch.float32 else 0.0) + 2 * u
    assert ref_coef < 0.5  # the clip acts: its coefficient must come from the edited gradient
    assert result.grad_norm.item() == pytest.approx(ref_norm, rel=grad_rtol + norm_rtol(n))
    assert result.clip_coef.item() == pytest.approx(ref_coef, rel=grad_rtol + clip_coef_rtol(n))
    for i, (g, r, s) in enumerate(zip(got, ref, start)):
        step = (r - s).abs()
        bound = step * (grad_rtol + clip_coef_rtol(n) + 2 * u) + s.abs() * u + 1e-300
        diff = (g.double() - r).abs()
        assert bool((diff <= bound).all()), f"param {i}: {diff.max():.3e} > {bound.max():.3e}"
    assert torch.equal(got[2].double(), start[2])  # .grad = None: not updated
    assert torch.equal(got[0].double()[MASK == 0], start[0][MASK == 0])  # masked: not updated


def test_torch_clip_grad_norm_inside_before_update_is_applied():
    """``torch.nn.utils.clip_grad_norm_`` called on ``.grad`` inside ``before_update`` (the habit of a framework's
    hook) clips what is applied, fp32 and bf16 alike: the update is the fp64 recipe's clipped one."""
    for dtype in (torch.float32, torch.bfloat16):
        masters, _ = _gaengine(dtype, None, "before_update",
                               edit=lambda params: torch.nn.utils.clip_grad_norm_(params, 0.25))
        ref = [torch.nn.Parameter(p.detach().double()) for p in _params(dtype)]
        for xs in _inputs():
            (_loss(ref, xs) / K).backward()
        torch.nn.utils.clip_grad_norm_(ref, 0.25)
        torch.optim.SGD(ref, lr=LR).step()
        start = [p.detach().double() for p in _params(dtype)]
        for m, r, s in zip(masters, ref, start):
            step = (r.detach() - s).abs()
            bound = step * (RTOL[dtype] + clip_coef_rtol(15, dtype) + 4 * unit_roundoff()) + s.abs() * unit_roundoff()
            assert bool(((m.detach().double() - r.detach()).abs() <= bound).all()), dtype


def _window(acc, params):
    """What a refused call must leave as it was: the window's sums, its count, every ``.grad``."""
    return (acc.main_grad.data.clone(), acc.num_micro_batches,
            [None if p.grad is None else p.grad.clone() for p in params])


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    for x, y in zip(a[2], b[2]):
        assert (x is None and y is None) or torch.equal(x, y)


CALLS = {
    "acc.step()": lambda acc, params, state: acc.step(force=True),
    "acc.begin_step()": lambda acc, params, state: acc.begin_step(force=True),
    "acc.zero_grad()": lambda acc, params, state: acc.zero_grad(),
    "acc.close()": lambda acc, params, state: acc.close(),
    "acc.backward()": lambda acc, params, state: acc.backward(_loss(params, _inputs()[0])),
    "acc.state_dict()": lambda acc, params, state: acc.state_dict(),
    "acc.load_state_dict()": lambda acc, params, state: acc.load_state_dict(state),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_window_changing_calls_inside_before_update_are_refused(call):
    """Each call from inside ``fn`` raises ``RuntimeError`` naming it, the window (sums, count, ``.grad``) bit for bit
    as before the call; ``fn`` catching it, the update is applied once, bit for bit the update of a twin whose ``fn``
    makes no call. Before the change ``zero_grad``/``close``/``step`` ran (the window dropped, or applied twice)."""
    def run(make_call):
        params = _params(torch.float32)
        opt = torch.optim.SGD(params, lr=LR)
        acc = gaengine.GradientAccumulator(params, opt, accumulation_steps=K + 1, max_grad_norm=1.0, backend="torch")
        for xs in _inputs():
            acc.backward(_loss(params, xs))
        state = acc.state_dict()

        def fn():
            if make_call:
                before = _window(acc, params)
                with pytest.raises(RuntimeError, match=rf"{call.replace('(', '[(]').replace(')', '[)]')} was called "
                                                       "from inside acc.step\\(before_update"):
                    CALLS[call](acc, params, state)
                _assert_same(_window(acc, params), before)

        result = acc.step(force=True, before_update=fn)
        assert result is not None and acc.num_micro_batches == 0
        acc.close()
        return [p.detach().clone() for p in params]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_refused_call_not_caught_leaves_the_window_open():
    """``fn`` not catching the refusal: ``step()`` raises it, nothing is applied, the window keeps its micro-batches
    and its sums (bit for bit here: the denominator 4 is a power of two, so the normalization is undone exactly),
    and a second ``step()`` applies it as a twin without the failed call does."""
    def build():
        params = _params(torch.float32)
        acc = gaengine.GradientAccumulator(params, torch.optim.SGD(params, lr=LR), accumulation_steps=4,
                                           max_grad_norm=None, backend="torch")
        for xs in _inputs() + _inputs()[:1]:
            acc.backward(_loss(params, xs))
        return params, acc

    params, acc = build()
    before = _window(acc, params)
    start = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"acc\.zero_grad\(\) was called from inside"):
        acc.step(before_update=acc.zero_grad)
    _assert_same(_window(acc, params), before)
    assert all(torch.equal(p, s) for p, s in zip(params, start))
    acc.step()
    twin_params, twin = build()
    twin.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params))


def test_begin_step_lends_until_step_and_refuses_what_would_change_the_window():
    """Between ``begin_step()`` and ``step()``: ``backward``, ``state_dict`` and ``load_state_dict`` raise naming
    themselves (nothing changed); ``zero_grad()`` drops the window and its ``.grad``. After ``step()`` the ``.grad``
    hold the clipped gradient applied (as torch's ``clip_grad_norm_`` leaves it) until the next ``backward()``."""
    params = _params(torch.float32)
    acc = gaengine.GradientAccumulator(params, torch.optim.SGD(params, lr=LR), accumulation_steps=K,
                                       max_grad_norm=0.5, backend="torch")
    assert acc.begin_step(force=True) is False  # an empty window: nothing lent
    for xs in _inputs():
        acc.backward(_loss(params, xs))
    state = None
    assert acc.begin_step()
    lent = _window(acc, params)
    for call in ("acc.backward()", "acc.state_dict()", "acc.load_state_dict()"):
        with pytest.raises(RuntimeError, match=rf"{call.replace('(', '[(]').replace(')', '[)]')} was called while "
                                               "the window's gradient is lent"):
            CALLS[call](acc, params, state)
        _assert_same(_window(acc, params), lent)
    grads = [p.grad.clone() for p in params]
    result = acc.step()
    coef = result.clip_coef.item()
    assert coef < 1
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g * coef, rtol=4 * unit_roundoff(), atol=0)
    acc.backward(_loss(params, _inputs()[0]))
    assert all(p.grad is None for p in params)
    acc.backward(_loss(params, _inputs()[1]))
    acc.backward(_loss(params, _inputs()[2]))
    assert acc.begin_step()
    acc.zero_grad()
    assert acc.num_micro_batches == 0 and all(p.grad is None for p in params)
    acc.close()
