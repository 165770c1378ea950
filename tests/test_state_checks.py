"""Every way to change the accumulator's state is checked (issue 31: F1, F2, F3, F5, F6, F7).

Each test runs the plain PyTorch recipe beside gaengine in fp64 (the micro-batches' gradients summed, divided by the
window's micro-batches or items, an SGD step) and compares; a refused input must leave the accumulator as it was.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import gaengine
from tests.tolerances import FP32_EPS

LR = 0.1


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 5, generator=g), torch.randn(3, 2, generator=g)) for _ in range(n)]


def _loss(model: torch.nn.Module, batch, reduction: str = "mean") -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y, reduction=reduction)


def _plain_update(model: torch.nn.Module, batches, denom: float | None = None, reduction: str = "mean"):
    """The plain recipe in fp64: the window's gradient (sum over ``batches`` / ``denom``, default their count) and
    one SGD step, from ``model``'s current parameters. Returns the new parameters (fp64)."""
    ref = copy.deepcopy(model).double()
    grads = [torch.zeros_like(p) for p in ref.parameters()]
    for x, y in batches:
        loss = _loss(ref, (x.double(), y.double()), reduction)
        for g, d in zip(grads, torch.autograd.grad(loss, list(ref.parameters()))):
            g += d
    denom = len(batches) if denom is None else denom
    return [p.detach() - LR * g / denom for p, g in zip(ref.parameters(), grads)]


def _assert_params(model: torch.nn.Module, expected, what: str) -> None:
    for i, (p, e) in enumerate(zip(model.parameters(), expected)):
        # fp32 rounding of the forward/backward, the sum and the update: a few fp32 ulps of the values involved.
        tol = 64 * FP32_EPS * (1.0 + float(e.abs().max()))
        err = float((p.detach().double() - e).abs().max())
        assert err <= tol, f"{what}: parameter {i} off by {err:.3e} > {tol:.3e}"


def _acc(model, k=2, **kw):
    return gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=k,
                                        max_grad_norm=None, backend="torch", **kw)


def _snapshot(acc, model):
    return ([p.detach().clone() for p in model.parameters()], acc.num_micro_batches, acc.accumulation_steps,
            copy.deepcopy(acc.optimizer.state_dict()))


def _same_snapshot(a, b) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:3] == b[1:3]
            and str(a[3]) == str(b[3]))


# ------------------------------------------------------------------ F3: settable attributes checked on assignment
@pytest.mark.parametrize("value", [-1.0, float("nan"), 0.0, float("inf"), "1", True])
def test_max_grad_norm_checked_on_assignment(value):
    acc = _acc(_model())
    acc.max_grad_norm = 0.5
    with pytest.raises(ValueError) as constructor:
        gaengine.AccumulatorConfig(max_grad_norm=value)
    with pytest.raises(ValueError, match="max_grad_norm") as assigned:
        acc.max_grad_norm = value
    assert str(assigned.value) == str(constructor.value)
    assert acc.max_grad_norm == 0.5  # the value kept
    acc.close()


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_micro_batch_size_checked_on_assignment(value):
    acc = _acc(_model(), micro_batch_size=4)
    with pytest.raises(ValueError) as constructor:
        gaengine.AccumulatorConfig(micro_batch_size=value)
    with pytest.raises(ValueError, match="micro_batch_size") as assigned:
        acc.micro_batch_size = value
    assert str(assigned.value) == str(constructor.value)
    assert acc.micro_batch_size == 4
    acc.close()


def test_negative_max_grad_norm_never_reverses_an_update():
    """F3: ``acc.max_grad_norm = -1`` was taken and made the clip coefficient negative (the update reversed)."""
    model = _model()
    acc = _acc(model, k=1)
    with pytest.raises(ValueError, match="max_grad_norm"):
        acc.max_grad_norm = -1.0
    batch = _batches(1)[0]
    expected = _plain_update(model, [batch])
    acc.backward(_loss(model, batch))
    assert acc.step() is not None
    _assert_params(model, expected, "after a refused max_grad_norm")


# ------------------------------------------------------------------ F1: K set at run time, saved and restored
def _save(acc, model):
    return copy.deepcopy(model.state_dict()), acc.state_dict()


def _resume(saved, k, **load_kw):
    model = _model(seed=7)  # other values: the load must restore them
    model.load_state_dict(saved[0])
    acc = _acc(model, k=k)
    acc.load_state_dict(saved[1], **load_kw)
    return model, acc


def test_k_set_at_run_time_is_restored_mid_window():
    """F1: K set to 3 at run time (``gaengine train --auto-micro-batch``), saved after 1 micro-batch, resumed into
    an accumulator built with K=2: the resumed run updates after 3 micro-batches, as the uninterrupted one."""
    model = _model()
    batches = _batches(3)
    expected = _plain_update(model, batches)
    acc = _acc(model, k=2)
    acc.accumulation_steps = 3
    acc.backward(_loss(model, batches[0]))
    saved = _save(acc, model)
    acc.close()
    model, acc = _resume(saved, k=2)
    assert acc.accumulation_steps == 3
    acc.backward(_loss(model, batches[1]))
    assert acc.step() is None  # 2 of 3
    acc.backward(_loss(model, batches[2]))
    result = acc.step()
    assert result is not None and result.num_micro_batches == 3
    _assert_params(model, expected, "resumed window of K=3")
    # and the restored K is saved again as the run's
    assert acc.state_dict()  # between windows
    model2, acc2 = _resume(_save(acc, model), k=2)
    assert acc2.accumulation_steps == 3


def test_window_saved_under_another_k_is_refused_unless_told():
    """F1: a state saved 1 micro-batch into a window of K=3 (as built) loads into K=2 only with a keyword."""
    model = _model()
    batches = _batches(3)
    expected = _plain_update(model, batches)
    acc = _acc(model, k=3)
    acc.backward(_loss(model, batches[0]))
    saved = _save(acc, model)
    acc.close()
    model2 = _model(seed=7)
    model2.load_state_dict(saved[0])
    acc2 = _acc(model2, k=2)
    before = _snapshot(acc2, model2)
    with pytest.raises(ValueError, match=r"accumulation_steps=3.*accumulation_steps=2"):
        acc2.load_state_dict(saved[1])
    assert _same_snapshot(before, _snapshot(acc2, model2))  # nothing changed
    acc2.close()

    model, acc = _resume(saved, k=2, accumulation_steps="saved")
    assert acc.accumulation_steps == 3
    for b in batches[1:]:
        acc.backward(_loss(model, b))
    assert acc.step().num_micro_batches == 3
    _assert_params(model, expected, "resumed with accumulation_steps='saved'")
    acc.close()

    model, acc = _resume(saved, k=2, accumulation_steps="current")
    assert acc.accumulation_steps == 2
    acc.backward(_loss(model, batches[1]))
    assert acc.step().num_micro_batches == 2
    _assert_params(model, _plain_update(_restored(saved), batches[:2]), "resumed with accumulation_steps='current'")


def _restored(saved) -> torch.nn.Module:
    model = _model(seed=7)
    model.load_state_dict(saved[0])
    return model


# ------------------------------------------------------------------ F2: num_items checked on the device
@pytest.mark.parametrize("bad", [-6.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bad_num_items_tensor_skips_the_window(bad, backend):
    """F2: ``num_items=torch.tensor(-6)`` was applied (the update uphill), ``tensor(inf)`` gave a zero update not
    marked skipped. Either skips the window, on the device, with the reason in ``StepResult.invalid_num_items``."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=2,
                                       max_grad_norm=None, backend=backend)
    batches = _batches(2)
    acc.backward(_loss(model, batches[0], "sum"), num_items=torch.tensor(6))
    acc.backward(_loss(model, batches[1], "sum"), num_items=torch.tensor(bad))
    result = acc.step()
    assert bool(result.skipped) and bool(result.invalid_num_items)
    assert math.isnan(float(result.num_items)) and math.isnan(float(result.grad_norm))
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)  # not applied
    # the next window is clean and exact
    expected = _plain_update(model, batches, denom=12.0, reduction="sum")
    acc.backward(_loss(model, batches[0], "sum"), num_items=torch.tensor(6))
    acc.backward(_loss(model, batches[1], "sum"), num_items=torch.tensor(6))
    result = acc.step()
    assert not bool(result.skipped) and not bool(result.invalid_num_items)
    _assert_params(model, expected, "window after a skipped one")


def test_negative_count_is_not_hidden_by_the_sum():
    """F2: -6 then +10 sum to a positive 4, yet the window is not a valid mean: skipped."""
    model = _model()
    acc = _acc(model)
    batches = _batches(2)
    acc.backward(_loss(model, batches[0], "sum"), num_items=torch.tensor(-6))
    acc.backward(_loss(model, batches[1], "sum"), num_items=torch.tensor(10))
    result = acc.step()
    assert bool(result.skipped) and bool(result.invalid_num_items)


@pytest.mark.parametrize("num_items", [torch.tensor(6, device="meta"), torch.tensor(6.0, dtype=torch.float16),
                                       torch.tensor(6.0, dtype=torch.bfloat16), torch.tensor(True),
                                       torch.tensor([3, 3])], ids=["meta", "fp16", "bf16", "bool", "two-elements"])
def test_num_items_checked_on_the_host_before_autograd(num_items):
    """F5: a ``num_items`` on the meta device raised after autograd had run: the gradient stayed in the window,
    which was not marked failed, and the next ``step(force=True)`` applied it. Now refused before autograd."""
    model = _model()
    acc = _acc(model)
    batches = _batches(2)
    with pytest.raises(ValueError, match="num_items"):
        acc.backward(_loss(model, batches[0], "sum"), num_items=num_items)
    assert acc.num_micro_batches == 0
    assert acc.step(force=True) is None  # nothing was accumulated
    expected = _plain_update(model, batches, denom=5.0, reduction="sum")
    acc.backward(_loss(model, batches[0], "sum"), num_items=torch.tensor(2))
    acc.backward(_loss(model, batches[1], "sum"), num_items=3)
    acc.step()
    _assert_params(model, expected, "window after a refused num_items")


# ------------------------------------------------------------------ point 3: a failure after autograd started
def test_failure_after_autograd_marks_the_window_failed(monkeypatch):
    """Counting the micro-batch fails after its gradients reached main_grad: the window is failed (step() raises),
    zero_grad() recovers, and the next window is exact."""
    model = _model()
    acc = _acc(model)
    batches = _batches(2)
    acc.backward(_loss(model, batches[0]))

    def broken(*args, **kwargs):
        raise RuntimeError("counting failed")

    monkeypatch.setattr(acc.window, "add", broken)
    with pytest.raises(RuntimeError, match="counting failed"):
        acc.backward(_loss(model, batches[1]))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="zero_grad"):
        acc.step(force=True)
    acc.zero_grad()
    expected = _plain_update(model, batches)
    for b in batches:
        acc.backward(_loss(model, b))
    acc.step()
    _assert_params(model, expected, "window after zero_grad()")


# ------------------------------------------------------------------ F6, F7: load_state_dict checks what it loads
def _edit_meta(state: dict, edit) -> dict:
    meta = torch.load(io.BytesIO(state["meta"]), weights_only=True)
    edit(meta)
    blob = io.BytesIO()
    torch.save(meta, blob)
    return {**state, "meta": blob.getvalue()}


def test_state_of_another_optimizer_is_refused():
    """F6: a state saved over SGD loaded into an accumulator over AdamW overwrote the param groups, and the next
    step() raised ``KeyError: 'betas'``. Now ``ValueError`` naming the key, nothing changed, training goes on."""
    model = _model()
    acc = _acc(model)
    acc.backward(_loss(model, _batches(1)[0]))
    state = acc.state_dict()
    acc.close()
    model2 = _model(seed=3)
    opt = torch.optim.AdamW(model2.parameters(), lr=LR)
    acc2 = gaengine.GradientAccumulator(model2, opt, accumulation_steps=2, max_grad_norm=None, backend="torch")
    before = _snapshot(acc2, model2)
    with pytest.raises(ValueError, match="optimizer_type"):
        acc2.load_state_dict(state)
    # a state saved before the optimizer's type was recorded: its param groups' keys say it
    older = _edit_meta(state, lambda meta: meta.pop("optimizer_type"))
    with pytest.raises(ValueError, match=r"param_groups'\]\[0\]\['(amsgrad|betas|capturable|decoupled_weight_decay|"
                                         r"eps|dampening|momentum|nesterov)'\]"):
        acc2.load_state_dict(older)
    assert _same_snapshot(before, _snapshot(acc2, model2))
    for b in _batches(2):
        acc2.backward(_loss(model2, b))
    assert acc2.step() is not None  # no KeyError


@pytest.mark.parametrize("key,value", [("num_micro_batches", -1), ("num_micro_batches", 99),
                                       ("num_micro_batches", 1.5), ("items_host", -3), ("item_mode", "yes"),
                                       ("accumulation_steps", 0), ("consecutive_skips", -1),
                                       ("layout_order", [0, 0, 1, 2])])
def test_corrupt_counters_are_refused(key, value):
    """F7: ``num_micro_batches=-1`` was accepted (the next update divided 3 micro-batches' sum by 2), 99 failed
    later with a misleading error. Now ``ValueError`` naming the key before anything changes."""
    model = _model()
    batches = _batches(3)
    acc = _acc(model)
    acc.backward(_loss(model, batches[0]))
    state = _edit_meta(acc.state_dict(), lambda meta: meta["ranks"][0]["scalars"].__setitem__(key, value))
    before = _snapshot(acc, model)
    with pytest.raises(ValueError, match=repr(key).replace("[", r"\[")):
        acc.load_state_dict(state)
    assert _same_snapshot(before, _snapshot(acc, model))
    expected = _plain_update(model, batches[:2])
    acc.backward(_loss(model, batches[1]))
    assert acc.step().num_micro_batches == 2
    _assert_params(model, expected, "window after a refused state")
