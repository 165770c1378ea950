"""Parameters that join or leave after construction are trained exactly (issue 31, F4: gradual unfreezing).

Before, a parameter frozen at construction and later unfrozen (``requires_grad_(True)``, already in the optimizer or
added with ``optimizer.add_param_group``), or a new head added the same way, was trained on autograd's raw ``.grad``:
the sum over the micro-batches, never cleared, never clipped, not in ``grad_norm``. Now ``zero_stage=0`` adopts it at
the next window boundary (layout, ``main_grad``, masters and hooks built again) and a frozen one is dropped; each
test runs the plain fp64 recipe (``loss / K`` backward, ``clip_grad_norm_`` over the trainable parameters,
``optimizer.step()``, ``zero_grad()``) beside it. A parameter unfrozen in the middle of a window is refused by
``step()``, naming it, before anything is applied.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from tests.tolerances import FP32_EPS

K, MAX_NORM = 3, 0.5


def _batches(window: int, n: int = K):
    g = torch.Generator().manual_seed(100 + window)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x.to(next(model.parameters()).dtype)) - y.to(next(model.parameters()).dtype)).square().mean()


def _reference_window(model, optimizer, window: int) -> None:
    """The plain recipe in fp64: mean of the micro-batch means, clipped over the trainable parameters."""
    optimizer.zero_grad(set_to_none=True)
    for x, y in _batches(window):
        (_loss(model, x, y) / K).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)
    optimizer.step()


def _assert_close(model, ref, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        tol = 64 * FP32_EPS * (1.0 + float(q.detach().abs().max()))
        err = float((p.detach().double() - q.detach()).abs().max())
        assert err <= tol, f"{what}: {name} off by {err:.3e} > {tol:.3e}"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_unfrozen_then_frozen_parameters_match_the_plain_recipe(opt):
    model = _model()
    model[0].requires_grad_(False)  # frozen at construction, in the optimizer
    ref = copy.deepcopy(model).double()
    make = (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)) if opt == "sgd" else (
        lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
    optimizer, ref_opt = make(model.parameters()), make(ref.parameters())
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=MAX_NORM, backend="torch")
    for window in range(6):
        if window == 2:  # gradual unfreezing, between windows
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        if window == 4:  # and a layer frozen again
            model[2].requires_grad_(False)
            ref[2].requires_grad_(False)
        for x, y in _batches(window):
            acc.backward(_loss(model, x, y))
        result = acc.step()
        assert result is not None and not bool(result.skipped)
        _reference_window(ref, ref_opt, window)
        _assert_close(model, ref, f"{opt}, after window {window}")
        assert all(p.grad is None for p in model.parameters()), "a .grad was left behind"
    acc.close()


def test_new_head_added_with_add_param_group_matches_the_plain_recipe():
    model = _model()
    ref = copy.deepcopy(model).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=MAX_NORM, backend="torch")
    for window in range(5):
        if window == 2:  # a new head, its own param group (another learning rate)
            torch.manual_seed(1)
            model.add_module("head", nn.Linear(3, 3))
            ref.add_module("head", copy.deepcopy(model.head).double())
            optimizer.add_param_group({"params": list(model.head.parameters()), "lr": 0.1})
            ref_opt.add_param_group({"params": list(ref.head.parameters()), "lr": 0.1})
        for x, y in _batches(window):
            acc.backward(_loss(model, x, y))
        acc.step()
        _reference_window(ref, ref_opt, window)
        _assert_close(model, ref, f"after window {window}")
    acc.close()


def test_bf16_masters_survive_adoption():
    """bf16 parameters with fp32 masters: the masters of the parameters trained before are kept through the new
    layout (rebuilt from the bf16 model they would lose up to half a bf16 ulp per element each time)."""
    model = _model().to(torch.bfloat16)
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=None, backend="torch")
    for window in range(2):
        for x, y in _batches(window):
            acc.backward(_loss(model, x, y).float())
        acc.step()
    masters = {id(s.param): s.piece.detach().clone() for s in acc.sharding.store.slots if s.master}
    model[0].requires_grad_(True)
    x, y = _batches(2)[0]
    acc.backward(_loss(model, x, y).float())  # the boundary: model[0] joins
    kept = {id(s.param): s.piece for s in acc.sharding.store.slots if s.master}
    assert set(kept) == set(masters) | {id(p) for p in model[0].parameters()}
    for key, master in masters.items():
        assert torch.equal(kept[key], master), "a master was rebuilt from its bf16 rounding"
    acc.zero_grad()
    acc.close()


def test_parameter_unfrozen_mid_window_is_refused_by_name_before_anything_is_applied():
    model = _model()
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=MAX_NORM, backend="torch")
    batches = _batches(0)
    acc.backward(_loss(model, *batches[0]))
    model[0].requires_grad_(True)  # mid-window
    for x, y in batches[1:]:
        acc.backward(_loss(model, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'0\.weight' became trainable .* in the middle of this accumulation window"):
        acc.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "something was applied"
    acc.zero_grad()  # drops the window and the raw .grad; model[0] joins at the next window
    assert model[0].weight.grad is None
    for x, y in _batches(1):
        acc.backward(_loss(model, x, y))
    acc.step()
    assert not torch.equal(model[0].weight, before[0]), "the joined layer was not trained"
    acc.close()
