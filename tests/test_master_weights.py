"""``master_weights=False`` (the optimizer updates bf16/fp16 parameters in place) and optimizers over a subset.

The reference is the plain PyTorch recipe with exact accumulation: each micro-batch's low-precision gradients
from ``torch.autograd.grad`` on a twin model, summed in fp64, normalized and clipped in fp64 (torch's
``clip_grad_norm_`` formula), rounded once to the parameter dtype, then torch's own ``AdamW``/``SGD`` step.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gaengine
from gaengine.optim import FusedAdamW
from tests.models import Deep, MixedDtypes as _Mixed
from tests.oracle_hooks import use_hooks
from tests.tolerances import clip_coef_rtol, low_precision_ulp, mean_rtol, unit_roundoff

K = 4
MAX_NORM = 0.05  # small enough that clipping is active in these windows


def _mlp(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def _batch(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=g).to(dtype), torch.randn(6, 4, generator=g)


def _loss(model, x, y):
    return ((model(x).float() - y) ** 2).mean()


def _reference_grads(twin: nn.Module, window: int, dtype, loss_scale: float) -> tuple[list[torch.Tensor], float]:
    """fp64 window-mean gradients of ``twin`` (its low-precision per-micro-batch grads summed exactly) and the
    clip coefficient ``min(1, max_norm / (norm + 1e-6))`` of torch's ``clip_grad_norm_``."""
    params = list(twin.parameters())
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for k in range(K):
        x, y = _batch(100 * window + k, dtype)
        grads = torch.autograd.grad(_loss(twin, x, y) * loss_scale, params)
        for s, g in zip(sums, grads):
            s += g.double()
    means = [s / (K * loss_scale) for s in sums]
    norm = math.sqrt(sum(float((m * m).sum()) for m in means))
    return means, min(1.0, MAX_NORM / (norm + 1e-6))


def _coef_rtol(model: nn.Module) -> float:
    """The engine's clip coefficient against the fp64 one of ``_reference_grads``: an fp32 norm of n elements
    (``clip_coef_rtol``) of fp32 sums of K gradients (``mean_rtol(K)``)."""
    return clip_coef_rtol(sum(p.numel() for p in model.parameters())) + mean_rtol(K)


def _windows(acc, model, twin, dtype, loss_scale, n_windows=3):
    """Drive ``acc`` over ``n_windows`` windows of K micro-batches; yield ``(w, result, means, coef)`` per window,
    ``means``/``coef`` the fp64 reference gradients and clip coefficient of ``twin`` (``_reference_grads``)."""
    for w in range(n_windows):
        for k in range(K):
            x, y = _batch(100 * w + k, dtype)
            acc.backward(_loss(model, x, y))
        result = acc.step()
        means, coef = _reference_grads(twin, w, dtype, loss_scale or 1.0)
        yield w, result, means, coef


@pytest.mark.parametrize("dtype,loss_scale,opt_name", [
    (torch.bfloat16, None, "adamw-fused"),
    (torch.bfloat16, None, "sgd"),
    (torch.float16, 1024.0, "adamw-fused"),
])
def test_no_master_matches_plain_recipe_with_exact_accumulation(dtype, loss_scale, opt_name):
    """Three windows: every parameter within one ulp of its dtype of the reference after each update.

    The two paths differ in one rounding only (fp32 sum + fp32 scale vs the exact value, each rounded once
    to ``dtype``), so a gradient element may differ by one ulp of ``dtype`` and the parameter, after the same
    torch optimizer, by at most one ulp.
    """
    model = _mlp(dtype)
    twin = copy.deepcopy(model)

    def make_opt(params):
        if opt_name == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, fused=True)

    opt = make_opt(model.parameters())
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=MAX_NORM,
                                       master_weights=False, loss_scale=loss_scale)
    assert acc.master_buffer is None
    ref_opt = make_opt(twin.parameters())
    clipped = []
    for w, result, means, coef in _windows(acc, model, twin, dtype, loss_scale):
        clipped.append(coef < 1.0)
        for p, m in zip(twin.parameters(), means):
            p.grad = (m * coef).to(dtype)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert not bool(result.skipped)
        assert math.isclose(float(result.clip_coef), coef, rel_tol=_coef_rtol(model))
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert p.dtype == dtype and p.grad is None
            diff = (p.double() - q.double()).abs()
            assert bool((diff <= low_precision_ulp(q)).all()), f"window {w}, {name}: max diff {float(diff.max())}"
    assert any(clipped)
    if opt_name == "adamw-fused":
        assert opt.state[model[0].weight]["exp_avg"].dtype == dtype  # state in the parameter dtype


@pytest.mark.parametrize("opt_cls", ["torch-fused", "gaengine-fused"])
def test_no_master_skip_leaves_params_and_state_bit_identical(opt_cls):
    model = _mlp(torch.bfloat16)
    opt = (FusedAdamW(model.parameters(), lr=1e-2) if opt_cls == "gaengine-fused"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, master_weights=False)
    for k in range(2):
        acc.backward(_loss(model, *_batch(k, torch.bfloat16)))
    assert not bool(acc.step().skipped)
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {n: t.clone() for n, t in opt.state[p].items()} for p in model.parameters()}
    acc.backward(_loss(model, *_batch(7, torch.bfloat16)))
    acc.backward(_loss(model, *_batch(8, torch.bfloat16)) * float("nan"))
    result = acc.step()
    assert bool(result.skipped)
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p, before) and p.grad is None
        for n, t in opt.state[p].items():
            assert torch.equal(t, state[id(p)][n]), n
    for k in range(2):  # the next window starts clean and applies
        acc.backward(_loss(model, *_batch(20 + k, torch.bfloat16)))
    assert not bool(acc.step().skipped)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), params))


@pytest.mark.parametrize("opt_cls", ["torch-fused", "gaengine-fused"])
def test_no_master_saves_the_master_buffer(opt_cls):
    """Persistent bytes per parameter beyond the fp32 main_grad: bf16 m, v (4 B) vs fp32 master + m, v (16 B)."""
    def extra_bytes_per_param(master_weights):
        model = _mlp(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        opt = (FusedAdamW(model.parameters(), lr=1e-3) if opt_cls == "gaengine-fused"
               else torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=1, master_weights=master_weights)
        acc.backward(_loss(model, *_batch(0, torch.bfloat16)))
        acc.step()
        masters = 0 if acc.master_buffer is None else n * 4  # the flat master buffer holds one fp32 per element
        moments = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
        return (masters + moments) / n

    assert extra_bytes_per_param(False) == 4.0
    assert extra_bytes_per_param(True) == 12.0


def _rounded_fp32_adamw(params, grads, states, lr):
    """The specification of FusedAdamW on bf16/fp16 params: torch.optim.AdamW(fused=True) in fp32 on fp32 copies
    of each param and its m, v (states: [(step, m, v)]) with the fp32 gradient, then p, m, v rounded to the
    param dtype. Returns [(p, m, v)] in the param dtype."""
    refs = [nn.Parameter(p.detach().float()) for p in params]
    opt = torch.optim.AdamW(refs, lr=lr, fused=True)
    for r, g, (step, m, v) in zip(refs, grads, states):
        r.grad = g
        opt.state[r] = {"step": step.clone(), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    opt.step()
    return [(r.detach().to(p.dtype), opt.state[r]["exp_avg"].to(p.dtype), opt.state[r]["exp_avg_sq"].to(p.dtype))
            for r, p in zip(refs, params)]


@pytest.mark.parametrize("dtype,loss_scale", [(torch.bfloat16, None), (torch.float16, 1024.0)], ids=["bf16", "fp16"])
def test_no_master_fused_adamw_matches_plain_recipe_with_exact_accumulation(dtype, loss_scale):
    """master_weights=False with FusedAdamW: the bf16/fp16 params are updated in place from the fp32 main_grad
    (normalization and clipping as grad_scale, no scale pass, no rounding copy of the gradient, no master).

    Reference: the exact fp64 window mean, clipped (torch's clip_grad_norm_ formula), as an fp32 gradient, then
    the specification (torch AdamW in fp32 on fp32 copies of p, m, v; each rounded to ``dtype``), on a twin
    re-synced to the engine's parameters and moments after each window so that each window is compared alone.
    The engine's gradient is an fp32 sum divided in the kernel by grad_scale = 1 / coef (a few fp32 ulps from the
    exact mean x coef); AdamW's m / sqrt(v) cancels a relative error common to the gradient to first order, so
    p, m and v land within one rounding of ``dtype`` of the reference: 1 ulp."""
    model = _mlp(dtype)
    twin = copy.deepcopy(model)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=MAX_NORM,
                                       master_weights=False, loss_scale=loss_scale)
    assert acc.master_buffer is None and acc.optimizer.param_groups[0]["params"][0] is model[0].weight
    params = list(model.parameters())
    states = [(torch.zeros(()), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    clipped = []
    for w, result, means, coef in _windows(acc, model, twin, dtype, loss_scale):
        clipped.append(coef < 1.0)
        expected = _rounded_fp32_adamw(list(twin.parameters()), [(m * coef).float() for m in means], states, 1e-2)
        assert not bool(result.skipped)
        assert math.isclose(float(result.clip_coef), coef, rel_tol=_coef_rtol(model))
        for i, (p, (ep, em, ev)) in enumerate(zip(params, expected)):
            state = opt.state[p]
            assert p.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == dtype
            assert p.grad is None and not hasattr(p, "main_grad")
            assert state["step"].item() == w + 1
            for what, a, e in (("param", p.detach(), ep), ("exp_avg", state["exp_avg"], em),
                               ("exp_avg_sq", state["exp_avg_sq"], ev)):
                diff = (a.double() - e.double()).abs()
                assert bool((diff <= low_precision_ulp(e)).all()), f"window {w}, param {i} {what}: {float(diff.max())}"
        with torch.no_grad():  # re-sync the twin (its parameters feed the next window's reference gradients)
            for p, q in zip(params, twin.parameters()):
                q.copy_(p)
        states = [(opt.state[p]["step"].clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                  for p in params]
    assert any(clipped)


def test_no_master_fused_adamw_takes_no_extra_pass_and_leaves_no_grad():
    """No scale pass over main_grad (it still holds the raw sums after step) and no rounded gradient copy: the
    optimizer gets the fp32 views as p.main_grad with grad_scale = 1 / coef; both are gone after the step."""
    model = _mlp(torch.bfloat16)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=MAX_NORM, master_weights=False)
    seen = {}

    def spy_step(*args, **kwargs):
        views = {id(p): v for p, v in zip(acc.params, acc.main_grad.views)}  # the layout of this window
        seen["grads"] = [(getattr(p, "main_grad", None), p.grad, views[id(p)]) for p in model.parameters()]
        seen["grad_scale"] = opt.grad_scale.clone()
        sums = acc.main_grad.data.clone()
        out = FusedAdamW.step(opt, *args, **kwargs)
        seen["unscaled"] = torch.equal(sums, acc.main_grad.data)  # not scaled in place: still the raw window sums
        return out

    opt.step = spy_step
    for k in range(2):
        acc.backward(_loss(model, *_batch(k, torch.bfloat16)))
    result = acc.step()
    for main_grad, grad, view in seen["grads"]:
        assert grad is None and main_grad.dtype == torch.float32 and main_grad.data_ptr() == view.data_ptr()
    # 1 / (clip / K) in fp32: K = 2 makes clip / K exact, the reciprocal rounds once.
    assert float(seen["grad_scale"]) == pytest.approx(2.0 / float(result.clip_coef), rel=unit_roundoff())
    assert seen["unscaled"]
    assert all(p.grad is None and not hasattr(p, "main_grad") for p in model.parameters())
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_no_master_fused_adamw_rounds_loaded_fp32_moments_once():
    """A master-weights checkpoint (fp32 moments) loaded into FusedAdamW over bf16 params before the accumulator:
    master_weights=False keeps m, v in the param dtype, so they are rounded once (as torch.optim.AdamW's loader
    does) and the update runs."""
    model = _mlp(torch.bfloat16)
    masters = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    fp32_opt = FusedAdamW(masters, lr=1e-2)
    for m in masters:
        m.grad = torch.randn_like(m)
    fp32_opt.step()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(fp32_opt.state_dict())
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=1, master_weights=False)
    for p, m in zip(model.parameters(), masters):
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["exp_avg"], fp32_opt.state[m]["exp_avg"].to(torch.bfloat16))
    acc.backward(_loss(model, *_batch(0, torch.bfloat16)))
    assert not bool(acc.step().skipped)
    assert all(s["step"].item() == 2.0 for s in opt.state.values())


@pytest.mark.parametrize("master_weights", [True, False])
def test_optimizer_over_a_subset_of_low_precision_params(master_weights):
    """The optimizer holds the first layer only: the second takes part in the norm but is left untouched."""
    dtype = torch.bfloat16
    model = _mlp(dtype)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2, fused=True)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=MAX_NORM,
                                       master_weights=master_weights)
    frozen = [p.detach().clone() for p in model[2].parameters()]
    for k in range(K):
        acc.backward(_loss(model, *_batch(k, dtype)))
    result = acc.step()
    means, coef = _reference_grads(twin, 0, dtype, 1.0)  # norm over every trainable parameter
    assert math.isclose(float(result.clip_coef), coef, rel_tol=_coef_rtol(model))
    for p, before in zip(model[2].parameters(), frozen):
        assert torch.equal(p, before) and p.grad is None
    if master_weights:
        refs = [p.detach().float().requires_grad_(True) for p in twin[0].parameters()]
        grads = [(m * coef).float() for m in means[:2]]
    else:
        refs = list(twin[0].parameters())
        grads = [(m * coef).to(dtype) for m in means[:2]]
    for r, g in zip(refs, grads):
        r.grad = g
    torch.optim.AdamW(refs, lr=1e-2, fused=True).step()
    for p, r in zip(model[0].parameters(), refs):
        expected = r.detach().to(dtype)
        diff = (p.double() - expected.double()).abs()
        assert bool((diff <= low_precision_ulp(expected)).all()), float(diff.max())


def _mixed_batch(w, k):
    g = torch.Generator().manual_seed(1000 * w + k)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _mixed_loss(model, w, k):
    x, y = _mixed_batch(w, k)
    return ((model(x) - y) ** 2).mean()


def _piece(acc, p):
    """The optimizer's parameter for model parameter ``p`` (its fp32 master, or ``p`` itself)."""
    store = acc.sharding.store
    return store.pieces[store.index[id(p)]]


def _assert_model_is_flat(model, acc):
    """Every optimized low-precision param is a view of its dtype's parameter buffer, at its master's offset in
    the master buffer (the bf16 range first, then the fp16 one), and the padding of both is zero."""
    store = acc.sharding.store
    master = acc.master_buffer.data
    start = {}
    cursor = 0
    for dtype, buf in store.param_buffers.items():
        start[dtype] = cursor
        cursor += buf.numel()
    assert cursor == master.numel()
    for p in model.parameters():
        piece = _piece(acc, p)
        if p.dtype == torch.float32:
            assert piece is p  # optimized as it is: not re-pointed, no master
            continue
        buf = store.param_buffers[p.dtype]
        assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() and p.is_contiguous()
        assert piece.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
        assert piece.shape == p.shape and piece.dtype == torch.float32
        assert p.storage_offset() + start[p.dtype] == piece.storage_offset()  # same offsets as the masters
        assert torch.equal(p, piece.detach().to(p.dtype))
    for dtype, buf in store.param_buffers.items():  # the padding is zero
        used = torch.zeros(buf.numel(), dtype=torch.bool)
        for p in model.parameters():
            if p.dtype == dtype:
                used[p.storage_offset():p.storage_offset() + p.numel()] = True
        assert not bool(buf[~used].any())
        assert not bool(master[start[dtype]:][:buf.numel()][~used].any())


def test_low_precision_params_become_views_of_one_flat_buffer_per_dtype():
    torch.manual_seed(0)
    model = _Mixed()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                       accumulation_steps=2, loss_scale=None)
    assert set(acc.sharding.store.param_buffers) == {torch.bfloat16, torch.float16}
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1])  # same objects, same values
    _assert_model_is_flat(model, acc)
    # the master buffer holds the bf16 params first, then the fp16 ones, each range ALIGN_NUMEL-aligned
    n_bf16 = acc.sharding.store.param_buffers[torch.bfloat16].numel()
    assert n_bf16 % gaengine.buffer.ALIGN_NUMEL == 0
    assert all(_piece(acc, p).storage_offset() >= n_bf16 for p in model.head.parameters())


def _reference_window(twin, masters, opt, w, k_steps):
    """The plain recipe with exact fp32 accumulation: per-micro-batch low-precision grads summed in fp32 in
    arrival order, divided by K (a power of two: exact), torch's fused AdamW on fp32 masters, rounded once."""
    params = list(twin.parameters())
    sums = None
    for k in range(k_steps):
        grads = torch.autograd.grad(_mixed_loss(twin, w, k), params)
        grads = [g.float() for g in grads]
        sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
    for m, s in zip(masters, sums):
        m.grad = s / k_steps
    opt.step()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_accumulation_after_repointing_relearn_and_resume_is_bitwise_the_plain_recipe(hot_path, monkeypatch):
    """The re-pointed parameters keep their AccumulateGrad nodes and gaengine's hooks on them: every backward is
    accumulated (p.grad released) before and after the layout re-learn and after a mid-window load_state_dict
    into a fresh model / optimizer / accumulator, and every window is bit-identical to the plain recipe."""
    if hot_path == "native":
        from gaengine.hot_path import load_native  # noqa: PLC0415
        if load_native()[0] is None:
            pytest.skip("gaengine._C not built")
    use_hooks(monkeypatch, hot_path)
    K = 2
    torch.manual_seed(0)
    model = _Mixed()
    twin = copy.deepcopy(model)
    masters = [p.detach().float().requires_grad_(True) for p in twin.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)

    def build(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        return opt, gaengine.GradientAccumulator(m, opt, accumulation_steps=K, max_grad_norm=None, loss_scale=None)

    opt, acc = build(model)
    initial = [id(p) for p in acc.params]
    saved = None
    for w in range(4):
        for k in range(K):
            if (w, k) == (2, 1):  # mid-window: resume everything in a fresh model, optimizer and accumulator
                saved = {"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict()}
                saved = torch.load(_round_trip(saved), weights_only=True)
                acc.close()
                torch.manual_seed(123)
                model = _Mixed()  # other initial values, overwritten by the load
                opt, acc = build(model)
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
                acc.load_state_dict(saved["acc"])
                _assert_model_is_flat(model, acc)
            acc.backward(_mixed_loss(model, w, k))
            assert all(p.grad is None for p in model.parameters())  # the hooks took every gradient
            assert all(bool(acc.main_grad.views[i].any()) for i in range(len(acc.params)))
        assert acc.step() is not None
        _reference_window(twin, masters, ref_opt, w, K)
        if w == 0:
            assert [id(p) for p in acc.params] != initial  # the layout was re-learned after the first window
        _assert_model_is_flat(model, acc)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"window {w}: {name}"
    assert saved is not None


def _round_trip(obj):
    import io  # noqa: PLC0415

    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return f


@pytest.mark.parametrize("opt_name", ["torch-fused", "gaengine-fused"])
def test_model_state_dict_deepcopy_to_and_close_with_flat_params(opt_name):
    torch.manual_seed(0)
    model = _mlp(torch.bfloat16)
    opt = (FusedAdamW(model.parameters(), lr=1e-2) if opt_name == "gaengine-fused"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2)
    buf = acc.sharding.store.param_buffers[torch.bfloat16]

    def window(seed):
        for k in range(2):
            acc.backward(_loss(model, *_batch(seed + k, torch.bfloat16)))
        assert not bool(acc.step().skipped)

    window(0)
    # model.state_dict(): saved and loaded back with weights_only=True
    state = model.state_dict()
    loaded = torch.load(_round_trip(state), weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # model.load_state_dict copies into the parameters in place: into the flat buffer
    params = list(model.parameters())
    new = {k: torch.randn_like(v) for k, v in state.items()}
    model.load_state_dict(new)
    for (name, p), q in zip(model.named_parameters(), params):
        assert p is q and torch.equal(p, new[name])
        view = buf[p.storage_offset():p.storage_offset() + p.numel()].view(p.shape)
        assert torch.equal(view, new[name]) and p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    # deepcopy: independent, ordinary parameters with equal values
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q) and q.untyped_storage().data_ptr() != buf.data.untyped_storage().data_ptr()
    with torch.no_grad():
        for q in twin.parameters():
            q.zero_()
    assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())
    # .to() to the same device and dtype is a no-op: the parameters stay views
    model.to("cpu").to(torch.bfloat16)
    assert all(p.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr() for p in model.parameters())
    acc.load_state_dict(acc.state_dict())  # the masters were not changed by model.load_state_dict: restored
    window(10)
    _assert_flat_mlp(model, acc)
    # close(): the parameters keep their values and stay views of the (now unowned) flat buffer
    values = [p.detach().clone() for p in model.parameters()]
    acc.close()
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))
    assert all(p.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr() for p in model.parameters())
    # ... and another accumulator takes them over (re-pointed into its own buffer) and trains
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    acc = gaengine.GradientAccumulator(model, opt2, accumulation_steps=2)
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))
    window(20)
    _assert_flat_mlp(model, acc)
    assert any(not torch.equal(p, v) for p, v in zip(model.parameters(), values))


def _assert_flat_mlp(model, acc):
    buf = acc.sharding.store.param_buffers[torch.bfloat16]
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert torch.equal(p, _piece(acc, p).detach().to(p.dtype))


@pytest.mark.parametrize("opt_name", ["torch-fused", "gaengine-fused"])
@pytest.mark.parametrize("convert", ["float", "half"])
def test_converting_the_model_after_building_the_accumulator_raises(opt_name, convert):
    model = _mlp(torch.bfloat16)
    opt = (FusedAdamW(model.parameters(), lr=1e-2) if opt_name == "gaengine-fused"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=1)
    acc.backward(_loss(model, *_batch(0, torch.bfloat16)))
    getattr(model, convert)()  # the parameters leave the flat bf16 buffer
    dtype = next(model.parameters()).dtype
    low_masters = [s.piece for s in acc.sharding.param_slots() if s.master]
    masters = [m.detach().clone() for m in low_masters]
    with pytest.raises(RuntimeError, match="no longer a view.*moved or converted"):
        acc.step()
    with pytest.raises(RuntimeError, match="no longer a view.*moved or converted"):  # found before autograd runs
        acc.backward(_loss(model, *_batch(0, dtype)))
    assert low_masters and all(torch.equal(m, b) for m, b in zip(low_masters, masters))  # nothing was updated


def test_model_write_is_one_flat_copy_and_bumps_versions(monkeypatch):
    """Without FusedAdamW the master -> model write is one copy_ per dtype over the whole range (no foreach)."""
    model = _Mixed()
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                       accumulation_steps=1, loss_scale=None)

    def no_foreach(*args, **kwargs):
        raise AssertionError("torch._foreach_copy_ called")

    monkeypatch.setattr(torch, "_foreach_copy_", no_foreach)
    versions = [p._version for p in model.parameters()]
    acc.backward(_mixed_loss(model, 0, 0))
    acc.step()
    for (name, p), v in zip(model.named_parameters(), versions):
        if p.dtype != torch.float32:  # written in place by the flat copy: autograd sees it
            assert p._version > v, name
    _assert_model_is_flat(model, acc)


@pytest.mark.parametrize("how", ["compile", "reentrant", "non-reentrant"])
def test_compile_and_checkpointing_with_flat_low_precision_params(how):
    """torch.compile (aot_eager) and activation checkpointing over re-pointed bf16 params: the same updates
    as the eager model, bit for bit, for three windows (the compiled graph reads the updated buffer)."""
    def run(how):
        torch.manual_seed(0)
        model = Deep(None if how == "compile" else how).to(torch.bfloat16)  # the checkpointing variants
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=None)
        fwd = torch.compile(model, backend="aot_eager") if how == "compile" else model
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            for _ in range(2):
                x = torch.randn(3, 8, generator=g).bfloat16().requires_grad_(how == "reentrant")
                acc.backward(fwd(x).float().pow(2).mean())
            acc.step()
        _assert_flat_mlp(model, acc)
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(None), run(how)):
        assert torch.equal(a, b)


def test_verify_equivalence_on_a_model_with_flat_params():
    """verify_equivalence on a model whose bf16 params are views of a closed accumulator's flat buffer: it passes,
    leaves the values and the views as they were, and the model trains again under a new accumulator."""
    model = _mlp(torch.bfloat16)
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                       accumulation_steps=2)
    for k in range(2):
        acc.backward(_loss(model, *_batch(k, torch.bfloat16)))
    acc.step()
    acc.close()
    ptrs = [p.data_ptr() for p in model.parameters()]
    values = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(16, 8, generator=g).bfloat16(), torch.randn(16, 4, generator=g))
    report = gaengine.verify_equivalence(model, lambda m, b: _loss(m, *b), batch, 4)
    assert report.passed, str(report)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))
