"""Optimizer calls that write parameters outside ``step()`` reach the model (``gaengine.store.PARAM_WRITERS``):
schedule-free AdamW's ``eval()`` / ``train()`` on a bf16 model, against the plain master-weight recipe (an fp32
master copy the optimizer holds, rounded into the bf16 model after every call that writes it) in the same test."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gaengine

schedulefree = pytest.importorskip("schedulefree")

K, STEPS = 4, 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(STEPS, K, 8, 8, generator=g).to(torch.bfloat16),
            torch.randn(STEPS, K, 8, 4, generator=g).to(torch.bfloat16))


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x).float(), y.float())


def _recipe():
    """The plain recipe: bf16 model for forward and backward, fp32 masters in the optimizer, each micro-batch's bf16
    gradient summed into the master's fp32 .grad, divided by K, the masters rounded into the model after every
    optimizer call that writes them."""
    model, (xs, ys) = _model(), _data()
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = schedulefree.AdamWScheduleFree(masters, lr=1e-2, warmup_steps=0)
    opt.train()

    def to_model():
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)

    for s in range(STEPS):
        for k in range(K):
            _loss(model, xs[s, k], ys[s, k]).backward()
            for p, m in zip(model.parameters(), masters):
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None
        for m in masters:
            m.grad.div_(K)
        opt.step()
        opt.zero_grad()
        to_model()
    return model, opt, to_model


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("as_list", [False, True], ids=["optimizer", "list-of-optimizers"])
def test_schedule_free_eval_and_train_reach_the_bf16_model(as_list):
    """After 3 updates, ``optimizer.eval()`` leaves the model holding the rounding of the averaged point x as the
    recipe does (bit for bit), and ``optimizer.train()`` the interpolation y again. Before this, eval() moved the
    masters only: the model kept the training point (moved by 0.0; the recipe moves it by ~2e-3). Given to the
    accumulator in a list (``GradientAccumulator(model, [opt])``), the user still calls ``opt.eval()`` on the optimizer
    they built: that call reaches the model too (before, only the list's own ``eval()`` did)."""
    ref, ref_opt, ref_to_model = _recipe()
    model, (xs, ys) = _model(), _data()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, warmup_steps=0)
    opt.train()
    acc = gaengine.GradientAccumulator(model, [opt] if as_list else opt, accumulation_steps=K, max_grad_norm=None,
                                       backend="cpu")
    for s in range(STEPS):
        for k in range(K):
            acc.backward(_loss(model, xs[s, k], ys[s, k]))
        acc.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)  # the same training point before eval()
    training = _params(model)
    ref_opt.eval()
    ref_to_model()
    opt.eval()
    moved = max(float((p.float() - q.float()).abs().max()) for p, q in zip(model.parameters(), training))
    assert moved > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    ref_opt.train()
    ref_to_model()
    opt.train()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    acc.close(release_optimizer=True)
    assert opt.param_groups[0]["params"][0] is next(model.parameters())  # given back to the model
    assert not any(name in vars(opt) for name in ("eval", "train"))  # the wrappers are gone


def test_masters_to_model_after_a_write_gaengine_cannot_see():
    """A hand-written write into the optimizer's parameters (the fp32 masters) reaches the model through the one
    public call, ``acc.masters_to_model()``: the model then holds the masters' rounding."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=1, backend="cpu")
    with torch.no_grad():
        for m in (p for g in opt.param_groups for p in g["params"]):
            m.mul_(0.5)
    masters = [m.detach().clone() for g in opt.param_groups for m in g["params"]]
    assert not all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), masters))
    acc.masters_to_model()
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(p, m.to(p.dtype))
    acc.close()
