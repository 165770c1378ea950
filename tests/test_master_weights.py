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
from tests.tolerances import low_precision_ulp

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
    for w in range(3):
        for k in range(K):
            x, y = _batch(100 * w + k, dtype)
            acc.backward(_loss(model, x, y))
        result = acc.step()
        means, coef = _reference_grads(twin, w, dtype, loss_scale or 1.0)
        clipped.append(coef < 1.0)
        for p, m in zip(twin.parameters(), means):
            p.grad = (m * coef).to(dtype)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert not bool(result.skipped)
        assert math.isclose(float(result.clip_coef), coef, rel_tol=1e-5)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert p.dtype == dtype and p.grad is None
            diff = (p.double() - q.double()).abs()
            assert bool((diff <= low_precision_ulp(q)).all()), f"window {w}, {name}: max diff {float(diff.max())}"
    assert any(clipped)
    if opt_name == "adamw-fused":
        assert opt.state[model[0].weight]["exp_avg"].dtype == dtype  # state in the parameter dtype


def test_no_master_skip_leaves_params_and_state_bit_identical():
    model = _mlp(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
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


def test_no_master_saves_the_master_buffer():
    """Persistent bytes per parameter beyond the fp32 main_grad: bf16 m, v (4 B) vs fp32 master + m, v (16 B)."""
    def extra_bytes_per_param(master_weights):
        model = _mlp(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=1, master_weights=master_weights)
        acc.backward(_loss(model, *_batch(0, torch.bfloat16)))
        acc.step()
        masters = 0 if acc.master_buffer is None else n * 4  # the flat master buffer holds one fp32 per element
        moments = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
        return (masters + moments) / n

    assert extra_bytes_per_param(False) == 4.0
    assert extra_bytes_per_param(True) == 12.0


def test_fused_adamw_refuses_master_weights_false():
    model = _mlp(torch.bfloat16)
    with pytest.raises(ValueError, match="master_weights=False.*FusedAdamW"):
        gaengine.GradientAccumulator(model, FusedAdamW(model.parameters()), master_weights=False)
    # the parameters are free for another accumulator (the refused one registered nothing that lingers)
    gaengine.GradientAccumulator(model, FusedAdamW(model.parameters()), master_weights=True)


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
    assert math.isclose(float(result.clip_coef), coef, rel_tol=1e-5)
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
