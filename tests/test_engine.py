"""GradientAccumulator against the plain PyTorch recipe and fp64 references (single process, CPU), on every backend
that exists here (the ``backend`` fixture of ``tests/conftest.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from gaengine.backends import get_backend
from tests.conftest import seeded_randn
from tests.models import MLP, TinyLM
from tests.tolerances import (RTOL, adamw_param_rtol, clip_coef_rtol, clipped_grad_rtol, mean_rtol, network_rtol,
                              norm_rtol, recipe_param_rtol, rel_diff, sgd_step_over_param, split_batch_rtol,
                              unit_roundoff, update_rtol)


def _mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _numel(model):
    return sum(p.numel() for p in model.parameters())


# MLP's gradients: micro-batch backward passes (their seeds 1/(B*5)) against one over the window (1/(K*B*5)): two
# backward passes that round differently, and the samples reduced in another order (tests/tolerances.py).
def _split_grad_rtol(n_samples, depth=3, width=24):
    return split_batch_rtol(n_samples) + 2 * network_rtol(depth, width, products_per_layer=2)


def _make_pair(seed=0, **kw):
    torch.manual_seed(seed)
    model = MLP(**kw)
    return model, copy.deepcopy(model)


# ---------------------------------------------------------------- equivalence with the large batch
@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd"])
def test_k_micro_batches_equal_one_large_batch(backend, opt_name):
    K, B, steps, max_norm = 4, 3, 3, 0.05
    model, ref = _make_pair()

    def make_opt(params):
        if opt_name == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **({"fused": True} if opt_name == "adamw-fused" else {"foreach": True}))

    acc = gaengine.GradientAccumulator(model, make_opt(model.parameters()), accumulation_steps=K,
                                       max_grad_norm=max_norm, backend=backend)
    ref_opt = make_opt(ref.parameters())
    gen = torch.Generator().manual_seed(1)
    n = _numel(model)
    grad_rtol = _split_grad_rtol(K * B) + 2 * clip_coef_rtol(n)  # clipping is active: two coefficients
    if opt_name == "sgd":
        def param_rtol(q):
            return update_rtol(steps, sgd_step_over_param(0.1, 0.9, max_norm, q), grad_rtol, grad_gain=1.0,
                               step_roundings=3)
    else:
        def param_rtol(q):
            return adamw_param_rtol(q, 1e-2, steps, grad_rtol)
    for _ in range(steps):
        x, y = seeded_randn(K * B, 12, generator=gen), seeded_randn(K * B, 5, generator=gen)
        with torch.no_grad():  # fp64 oracle of the window's loss: the model's weights, the whole batch
            want_loss = _mse(copy.deepcopy(model).double(), x.double(), y.double())
        results = []
        for k in range(K):
            acc.backward(_mse(model, x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]))
            results.append(acc.step())
        assert results[:-1] == [None] * (K - 1)
        _mse(ref, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        r = results[-1]
        assert r.num_micro_batches == K and not bool(r.skipped)
        assert rel_diff(r.grad_norm, ref_norm) <= _split_grad_rtol(K * B) + 2 * norm_rtol(n)
        assert float(r.clip_coef) < 1.0  # clipping is active in this test
        assert r.loss.shape == () and r.loss.dtype == torch.float32
        # fp32 forward, mean of B * 5 squares, mean of K micro-batch means vs fp64 (a square doubles the error).
        loss_rtol = 2 * network_rtol(3, 24, products_per_layer=1) + mean_rtol(B * 5) + mean_rtol(K)
        assert rel_diff(r.loss, want_loss) <= loss_rtol
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_diff(p, q) <= param_rtol(q), name
    acc.close()


def test_partial_window_force_is_exact(backend):
    K, B, done = 5, 2, 3
    model, ref = _make_pair()
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulation_steps=K,
                                       max_grad_norm=None, backend=backend)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y = torch.randn(done * B, 12), torch.randn(done * B, 5)
    losses = []
    for k in range(done):
        loss = _mse(model, x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        losses.append(loss.detach())
        acc.backward(loss)
        assert acc.step() is None
    r = acc.step(force=True)
    assert r.num_micro_batches == done
    _mse(ref, x, y).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):  # one plain SGD step (no momentum) from split gradients
        step_over_param = 0.5 * float(q.grad.abs().max()) / float(q.abs().max())
        assert rel_diff(p, q) <= update_rtol(1, step_over_param, _split_grad_rtol(done * B), grad_gain=1.0,
                                             step_roundings=1)
    assert rel_diff(r.loss, torch.stack(losses).mean()) <= 2 * mean_rtol(done)  # the same fp32 losses, two means
    assert acc.step(force=True) is None  # an empty window does nothing


def test_item_mode_padded_sequences_equal_token_mean(backend):
    """Variable-length sequences padded with label -100: the window's gradient is the mean over all real tokens."""
    torch.manual_seed(3)
    model = TinyLM()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=None, backend=backend)
    micro = []
    for length, n_real in [(7, 7), (7, 2), (5, 4)]:  # very different token counts per micro-batch
        tokens = torch.randint(0, 17, (2, length))
        labels = torch.randint(0, 17, (2, length))
        labels[:, n_real:] = -100
        micro.append((tokens, labels))
    total = 0
    for tokens, labels in micro:
        logits = model(tokens)
        loss_sum = nn.functional.cross_entropy(logits.reshape(-1, 17), labels.reshape(-1), ignore_index=-100, reduction="sum")
        n = int((labels != -100).sum())
        total += n
        acc.backward(loss_sum, num_items=n)
    r = acc.step()
    assert r.num_items == total
    # Reference: token mean over the whole window in one go.
    ref_loss = sum(nn.functional.cross_entropy(ref(t).reshape(-1, 17), l.reshape(-1), ignore_index=-100, reduction="sum")
                   for t, l in micro) / total
    ref_loss.backward()
    # Sums over tokens: the same per-micro-batch sums, the division by the token count in another place.
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p.grad, q.grad) <= _split_grad_rtol(total, depth=2, width=17)
    assert rel_diff(r.loss, ref_loss.detach()) <= 2 * mean_rtol(len(micro))  # the same fp32 sums, two means
    # The mean of per-micro-batch means (what a naive recipe computes) is measurably different here.
    naive = torch.stack([nn.functional.cross_entropy(ref(t).reshape(-1, 17), l.reshape(-1), ignore_index=-100)
                         for t, l in micro]).mean()
    assert rel_diff(naive, ref_loss) > 1e-3


def test_item_mode_with_device_tensor_counts():
    model, ref = _make_pair()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, backend="torch")
    x, y = torch.randn(6, 12), torch.randn(6, 5)
    acc.backward(((model(x[:4]) - y[:4]) ** 2).sum(), num_items=torch.tensor(20))
    acc.backward(((model(x[4:]) - y[4:]) ** 2).sum(), num_items=torch.tensor(10))
    r = acc.step()
    assert isinstance(r.num_items, torch.Tensor) and float(r.num_items) == 30
    (((ref(x) - y) ** 2).sum() / 30).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p.grad, q.grad) <= _split_grad_rtol(6)


# ---------------------------------------------------------------- fidelity of fp32 accumulation
def test_fidelity_64_bf16_gradients(backend):
    """The same 64 bf16 gradients: engine (fp32 buffer) vs bf16 .grad accumulation, both against fp64."""
    n, K = 4096, 64
    gen = torch.Generator().manual_seed(7)
    grads = [(seeded_randn(n, generator=gen) * 1e-2 + 1e-3).to(torch.bfloat16) for _ in range(K)]
    param = nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    acc = gaengine.GradientAccumulator([param], None, accumulation_steps=K, max_grad_norm=None, backend=backend)
    bf16_sum = torch.zeros(n, dtype=torch.bfloat16)
    for g in grads:
        acc.backward((param * g).sum())  # d/dparam = g exactly, in bf16
        bf16_sum += g
    acc.step()
    exact = torch.stack([g.double() for g in grads]).sum(0) / K
    engine_err = rel_diff(acc.main_grad.views[0], exact)
    bf16_err = rel_diff(bf16_sum.double() / K, exact)
    print(f"relative error vs fp64 after {K} micro-batches: engine {engine_err:.2e}, bf16 .grad {bf16_err:.2e}")
    # An fp32 mean of K values, within mean_rtol(K) of sum |g| / K elementwise; rel_diff divides by max |exact|.
    magnitude = torch.stack([g.double().abs() for g in grads]).sum(0) / K
    assert engine_err <= mean_rtol(K) * magnitude.max().item() / exact.abs().max().item()
    assert bf16_err > 100 * max(engine_err, 1e-9)


def test_tied_weight_receives_both_uses_once():
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    assert model.out.weight is model.emb.weight
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, backend="torch")
    assert len(acc.params) == 3  # the tied weight is one parameter
    tokens = torch.randint(0, 17, (2, 2, 6))
    for k in range(2):
        acc.backward(model(tokens[k]).logsumexp(-1).mean())
    acc.step()
    for k in range(2):
        (ref(tokens[k]).logsumexp(-1).mean() / 2).backward()
    # The same two backward passes, the 1/2 (exact) applied before or after: the two uses' sum in another order.
    assert rel_diff(model.emb.weight.grad, ref.emb.weight.grad) <= _split_grad_rtol(2, depth=2, width=17)
    # Both uses contribute: the gradient differs from either use alone.
    assert rel_diff(model.emb.weight.grad, ref.emb.weight.grad * 0.5) > 0.1


# ---------------------------------------------------------------- clipping and non-finite gradients
def test_clipping_matches_torch(backend):
    model, ref = _make_pair()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=0.01, backend=backend)
    x, y = torch.randn(8, 12), torch.randn(8, 5)
    for k in range(2):
        acc.backward(_mse(model, x[4 * k:4 * k + 4], y[4 * k:4 * k + 4]))
    r = acc.step()
    for k in range(2):
        (_mse(ref, x[4 * k:4 * k + 4], y[4 * k:4 * k + 4]) / 2).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    n = _numel(model)
    # (loss / 2).backward(): a power of two, so the same gradients and sums on both sides; two fp32 norms.
    assert rel_diff(r.grad_norm, ref_norm) <= 2 * norm_rtol(n)
    assert rel_diff(r.clip_coef, torch.clamp(0.01 / (ref_norm + 1e-6), max=1.0)) <= 2 * clip_coef_rtol(n)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p.grad, q.grad) <= clipped_grad_rtol(n)


@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach", "sgd-momentum"])
def test_nan_in_one_micro_batch_skips_update(opt_name):
    model, _ = _make_pair()

    def make_opt(params):
        if opt_name == "sgd-momentum":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, **({"fused": True} if opt_name == "adamw-fused" else {"foreach": True}))

    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=3, max_grad_norm=1.0, lr_scheduler=sched, backend="torch")
    x, y = torch.randn(9, 12), torch.randn(9, 5)

    def window(poison: bool):
        for k in range(3):
            loss = _mse(model, x[3 * k:3 * k + 3], y[3 * k:3 * k + 3])
            if poison and k == 1:
                loss = loss * torch.tensor(float("nan"))
            acc.backward(loss)
        return acc.step()

    assert not bool(window(False).skipped)  # one real update so the optimizer has state
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())
    lr_before = opt.param_groups[0]["lr"]
    r = window(True)
    assert bool(r.skipped)
    for p, q in zip(model.parameters(), params_before):
        assert torch.equal(p, q)
    state_after = opt.state_dict()
    for key, st in state_before["state"].items():
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(state_after["state"][key][name]), torch.as_tensor(value)), name
    assert opt.param_groups[0]["lr"] == lr_before  # the scheduler is not stepped on a skipped update
    # The next window starts clean and applies.
    r = window(False)
    assert not bool(r.skipped) and bool(torch.isfinite(r.grad_norm))
    assert opt.param_groups[0]["lr"] == lr_before * 0.5
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ---------------------------------------------------------------- master weights and optimizer=None
def test_bf16_params_get_fp32_master_weights():
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    ref32 = MLP()
    ref32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    group_keys = set(opt.param_groups[0]) - {"params"}
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=None, backend="torch")
    assert set(opt.param_groups[0]) - {"params"} == group_keys
    assert all(q.dtype == torch.float32 for g in opt.param_groups for q in g["params"])
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    for _ in range(5):
        for k in range(2):
            acc.backward(_mse(model, x[2 * k:2 * k + 2].bfloat16(), y[2 * k:2 * k + 2].bfloat16()))
        acc.step()
    masters = opt.param_groups[0]["params"]  # re-pointed in place: same order as model.parameters()
    moved = []
    for p, q in zip(model.parameters(), masters):
        # The model holds the bf16 rounding of its fp32 master, which keeps updates smaller than a bf16 ulp.
        assert q.shape == p.shape
        assert torch.equal(p, q.detach().to(torch.bfloat16))
        moved.append(rel_diff(q, p.float()))
    assert max(moved) > 0


def test_optimizer_none_leaves_final_grads():
    model, ref = _make_pair()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, backend="torch")
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    for window in range(2):  # grads exposed after window 0 must not leak into window 1
        for k in range(2):
            acc.backward(_mse(model, x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))
        acc.step()
    _mse(ref, x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and rel_diff(p.grad, q.grad) <= _split_grad_rtol(4)


def test_unused_parameter_gets_no_update():
    class WithUnused(MLP):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(3, 3)

    torch.manual_seed(0)
    model = WithUnused()
    before = model.unused.weight.detach().clone()
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5, fused=True),
                                       accumulation_steps=2, backend="torch")
    for _ in range(2):
        acc.backward(_mse(model, torch.randn(2, 12), torch.randn(2, 5)))
    r = acc.step()
    assert not bool(r.skipped)
    assert torch.equal(model.unused.weight, before)  # like torch: a param whose grad is None is not stepped


# ---------------------------------------------------------------- drop-in clip_grad_norm_
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_clip_grad_norm_drop_in(dtype):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s, dtype=dtype)) for s in [(1,), (127,), (33, 31)]]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        g = torch.randn_like(p)
        p.grad, t.grad = g.clone(), g.clone()
    orig = [p.grad.double() for p in params]
    exact = torch.cat([g.reshape(-1) for g in orig]).norm()
    exact_coef = min(1.0, 0.5 / (float(exact) + 1e-6))
    total = gaengine.clip_grad_norm_(params, 0.5)
    ref_total = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    assert total.dim() == 0 and total.dtype == torch.float32
    # fp32 sums of squares: within an fp32 norm's bound of fp64, so no further than torch in fp32 (whose own error
    # may be anything from 0 to that bound), closer than torch's bf16 norm for bf16 grads.
    n = sum(p.numel() for p in params)
    assert rel_diff(total, exact) <= norm_rtol(n, scalings=0)
    assert rel_diff(total, exact) <= rel_diff(ref_total, exact) + norm_rtol(n, scalings=0)
    for p, t, g in zip(params, twins, orig):
        clipped = g * exact_coef
        if dtype == torch.float32:
            assert rel_diff(p.grad, t.grad) <= clipped_grad_rtol(n)
        else:  # within one bf16 rounding of the exactly clipped gradient (its fp32 coefficient's error on top)
            assert rel_diff(p.grad, clipped) <= unit_roundoff(torch.bfloat16) + clip_coef_rtol(n)
    with pytest.raises(RuntimeError, match="non-finite"):
        params[0].grad[0] = float("inf")
        gaengine.clip_grad_norm_(params, 0.5, error_if_nonfinite=True)


@pytest.mark.parametrize("skip_in_last", [False, True], ids=["all-params", "param-missing-in-last"])
def test_cpu_free_norm_from_the_last_accumulate(monkeypatch, skip_in_last):
    """backend 'cpu', one rank: the last micro-batch's accumulate yields the norm; step() reads no buffer."""
    try:
        backend = get_backend("cpu", "cpu")
    except RuntimeError:
        pytest.skip("backend 'cpu' unavailable")
    calls = []
    original = backend.l2norm_sq
    monkeypatch.setattr(backend, "l2norm_sq", lambda x: calls.append(x.numel()) or original(x))
    model, ref = _make_pair()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=0.05, backend="cpu")
    x, y = torch.randn(9, 12), torch.randn(9, 5)

    def fwd(m, k):
        h = torch.tanh(m.fc1(x[3 * k:3 * k + 3]))
        if not (skip_in_last and k == 2):
            h = torch.tanh(m.fc2(h))
        return ((m.head(h) - y[3 * k:3 * k + 3]) ** 2).mean()

    for k in range(3):
        acc.backward(fwd(model, k))
    r = acc.step()
    for k in range(3):
        (fwd(ref, k) / 3).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert calls == ([acc.main_grad.data.numel()] if skip_in_last else [])
    # (loss / 3).backward() against loss.backward() then 1/3: backward passes that round differently; two norms.
    n = _numel(model)
    grad_rtol = 2 * network_rtol(3, 24, products_per_layer=2) + 2 * mean_rtol(3)
    assert rel_diff(r.grad_norm, ref_norm) <= grad_rtol + 2 * norm_rtol(n)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p.grad, q.grad) <= grad_rtol + 2 * clip_coef_rtol(n)


# ---------------------------------------------------------------- step(before_update=...)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_before_update_writes_reach_the_update(dtype):
    """A ``before_update`` that clamps every ``.grad`` in place (a ``configure_gradient_clipping`` hook) and sets the
    clip changes the update as the plain recipe does (fp64 oracle: the window's mean gradient from plain backward on
    the same parameters, clamped, its L2 norm, ``clip_grad_norm_``'s coefficient, one SGD step from the same fp32
    weights): ``result.grad_norm`` is the clamped gradient's norm and the parameters the recipe's, within the mean's
    rounding (bf16: one bf16 rounding of the gradient more). The clamp threshold is a bf16 value (both sides clamp
    at the same number) below the largest gradient, so it clamps part of each parameter (before, the bf16 copies'
    writes were lost, and the norm and clip ignored the clamp)."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 6) for _ in range(3)]
    torch.manual_seed(1)
    net = nn.Linear(6, 5).to(dtype)
    masters = [p.detach().double() for p in net.parameters()]  # the converted weights, the update's start
    oracle = [torch.zeros(p.shape, dtype=torch.float64) for p in net.parameters()]
    for x in xs:
        net.zero_grad()
        net(x.to(dtype)).float().square().mean().backward()
        for o, p in zip(oracle, net.parameters()):
            o += p.grad.double()
    oracle = [o / 3 for o in oracle]
    clamp = float(torch.tensor(0.5 * max(float(o.abs().max()) for o in oracle)).to(torch.bfloat16))
    clamped = [o.clamp(-clamp, clamp) for o in oracle]
    assert all(bool((o.abs() > clamp).any()) for o in oracle)
    norm = float(torch.sqrt(sum((c * c).sum() for c in clamped)))
    max_norm = 0.5 * norm
    expected = [m - 0.1 * (max_norm / (norm + 1e-6)) * c for m, c in zip(masters, clamped)]
    net.zero_grad()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    acc = gaengine.GradientAccumulator(net, opt, accumulation_steps=3, max_grad_norm=None)
    for x in xs:
        acc.backward(net(x.to(dtype)).float().square().mean())

    def fn():
        for p in net.parameters():
            p.grad.clamp_(-clamp, clamp)
        acc.max_grad_norm = max_norm

    result = acc.step(before_update=fn)
    grad_rtol = split_batch_rtol(3) / 2 + (RTOL[torch.bfloat16] if dtype == torch.bfloat16 else 0.0)
    assert rel_diff(result.grad_norm.double(), torch.tensor(norm, dtype=torch.float64)) <= grad_rtol + norm_rtol(35)
    got = opt.param_groups[0]["params"]  # fp32 (the masters, for bf16)
    n_params = sum(p.numel() for p in got)
    for a, b in zip(got, expected):
        bound = recipe_param_rtol(b.float(), "sgd", 0.1, 1, grad_rtol + clipped_grad_rtol(n_params),
                                  grad_norm_max=max_norm, momentum=0.0)
        assert rel_diff(a, b) <= bound, (rel_diff(a, b), bound)
    acc.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_before_update_sees_the_normalized_window_gradient(dtype):
    """``step(force=True, before_update=fn)`` on a partial window of 3 micro-batches (K = 4), one parameter unused:
    inside ``fn`` every used parameter's ``.grad`` is the window's mean gradient (fp64 oracle: plain backward per
    micro-batch on the same parameters, summed in fp64, divided by 3; fp32 within the mean's rounding, bf16 within
    one bf16 rounding more), the unused one's is None; ``fn`` sets the clip; afterwards ``.grad`` is None and the
    parameters are those of a twin accumulator stepped without ``before_update`` with the same clip
    (``recipe_param_rtol``; bf16 parameters one bf16 ulp more). An
    ``fn`` that raises leaves the window open (3 micro-batches) and the parameters unchanged."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 6) for _ in range(3)]

    def build():
        torch.manual_seed(1)
        net = nn.ModuleDict({"a": nn.Linear(6, 5), "unused": nn.Linear(2, 2)}).to(dtype)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        return net, gaengine.GradientAccumulator(net, opt, accumulation_steps=4, max_grad_norm=None)

    oracle_net, oracle_acc = build()
    oracle_acc.close()  # the same (converted) parameters, trained by plain backward
    oracle = [torch.zeros(p.shape, dtype=torch.float64) for p in oracle_net["a"].parameters()]
    for x in xs:
        oracle_net.zero_grad()
        oracle_net["a"](x.to(dtype)).float().square().mean().backward()
        for o, p in zip(oracle, oracle_net["a"].parameters()):
            o += p.grad.double()
    oracle = [o / 3 for o in oracle]

    runs = {}
    for name in ("hooked", "plain", "raising"):
        net, acc = build()
        for x in xs:
            acc.backward(net["a"](x.to(dtype)).float().square().mean())
        seen = {}

        def fn():
            seen["grads"] = [None if p.grad is None else p.grad.detach().clone() for p in net.parameters()]
            acc.max_grad_norm = 0.01
            if name == "raising":
                raise KeyError("from the hook")

        if name == "plain":
            acc.max_grad_norm = 0.01
            acc.step(force=True)
        elif name == "raising":
            before = [p.detach().clone() for p in net.parameters()]
            with pytest.raises(KeyError):
                acc.step(force=True, before_update=fn)
            assert acc.num_micro_batches == 3
            assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
        else:
            result = acc.step(force=True, before_update=fn)
            assert float(result.clip_coef) < 1.0
            grads = dict(zip([n for n, _ in net.named_parameters()], seen["grads"]))
            assert grads["unused.weight"] is None and grads["unused.bias"] is None
            # the same micro-batch gradients, their mean of 3 taken in fp32 (half split_batch_rtol: the sum's error
            # with the random-sign condition), and for bf16 one rounding of it to bf16
            grad_rtol = split_batch_rtol(3) / 2 + (RTOL[torch.bfloat16] if dtype == torch.bfloat16 else 0.0)
            for g, o in zip([grads["a.weight"], grads["a.bias"]], oracle):
                assert g.dtype == dtype
                d = rel_diff(g.double(), o)
                assert d <= grad_rtol, (d, grad_rtol)
        assert all(p.grad is None for p in net.parameters())
        runs[name] = [p.detach().float().clone() for p in net.parameters()]
        acc.close()
    # one SGD update from the same sums clipped at 0.01 on each side (clipped_grad_rtol); bf16: the two fp32 masters
    # that close round to the same bf16 value or to neighbours, one bf16 ulp (2 RTOL[bf16]) apart
    n_params = sum(p.numel() for p in runs["plain"][:2])
    for a, b in zip(runs["hooked"], runs["plain"]):
        bound = recipe_param_rtol(b, "sgd", 0.1, 1, clipped_grad_rtol(n_params), grad_norm_max=0.01, momentum=0.0)
        assert rel_diff(a, b) <= (bound if dtype == torch.float32 else 2 * RTOL[torch.bfloat16] + bound)

