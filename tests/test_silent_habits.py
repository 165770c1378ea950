"""Habits of the plain PyTorch recipe that used to train silently wrong in a gaengine loop, each now exact or an
error, checked against the plain fp64 large-batch recipe (one batch of all the window's micro-batches, one
``loss.backward()``, ``optimizer.step()``, ``scheduler.step()``):

* ``lr_scheduler=`` given to the accumulator and also stepped by the user (its learning rate decayed twice as fast);
* ``acc.backward(loss, retain_graph=True)`` twice through one graph (counted as two micro-batches);
* a window left open at the end (``acc.close()`` and garbage collection dropped its micro-batches without a word);
* an optimizer over ``model.parameters()`` with a frozen layer (refused; torch and Lightning accept it);
* ``loss / K`` kept from the plain recipe (a gradient K times smaller): ``LossDividedByKWarning`` once.
"""

from __future__ import annotations

import copy
import gc
import re
import warnings

import pytest
import torch
from torch import nn

import gaengine
from tests.tolerances import RTOL, rel_diff

K = 3
LR = 0.1
# fp32 against fp64 after a few SGD updates of a 8-16-4 MLP: each gradient element is a sum of at most
# (batch 4 x K micro-batches) x fan-in 16 fp32 products, relative error <= ~(12 + 16) * 2^-24 per update when
# nothing cancels; the parameters move by LR x gradient ~ 10% of themselves per update, so the error stays of that
# order over the few updates here. 2^7 fp32 ulps (7.6e-6) bounds it with room for the cancellations of tanh' and
# the mse's differences; the wrong results below are off by 1e-2 and more.
PLAIN_RTOL = 2.0**7 * RTOL[torch.float32]


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _micro_batch(i, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g).to(dtype)


def _loss(model, i):
    x, y = _micro_batch(i, next(model.parameters()).dtype)
    return nn.functional.mse_loss(model(x), y)


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _plain_fp64(model, windows, frozen=(), scheduler=True):
    """The large-batch recipe in fp64: per window (a list of micro-batch indices), the mean loss over all its
    samples, ``backward()``, SGD, then the scheduler; ``frozen``: names of parameters with requires_grad=False."""
    ref = copy.deepcopy(model).double()
    for name, p in ref.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    sched = _scheduler(opt) if scheduler else None
    for window in windows:
        xs, ys = zip(*(_micro_batch(i, torch.float64) for i in window))
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return ref


def _assert_plain(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_diff(p.detach().double(), q.detach()) <= PLAIN_RTOL, name


def _setup(scheduler=True):
    model = _mlp()
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = _scheduler(opt) if scheduler else None
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=None, lr_scheduler=sched)
    return model, start, opt, sched, acc


# ---------------------------------------------------------------- lr_scheduler= and the user's scheduler.step()
def test_scheduler_given_to_the_accumulator_and_stepped_by_the_user_raises_naming_both():
    model, start, opt, sched, acc = _setup()
    for i in range(K):
        acc.backward(_loss(model, i))
    assert acc.step() is not None
    sched.step()  # the plain recipe's habit: the accumulator already stepped it
    with pytest.raises(RuntimeError, match=r"lr_scheduler \(StepLR\) was stepped outside acc.step\(\)") as err:
        acc.backward(_loss(model, K))
    assert "last_epoch is 2" in str(err.value) and "left it at 1" in str(err.value)
    assert "Remove your scheduler.step()" in str(err.value)
    assert acc.num_micro_batches == 0  # nothing accumulated
    acc.close()


def test_scheduler_stepped_by_the_user_at_the_window_end_raises_with_the_window_intact():
    model, start, opt, sched, acc = _setup()
    for i in range(K):
        acc.backward(_loss(model, i))
    acc.step()
    for i in range(K, 2 * K):
        acc.backward(_loss(model, i))
    sched.step()  # stepped once more, before the accumulator's step
    with pytest.raises(RuntimeError, match="stepped outside acc.step()"):
        acc.step()
    assert acc.num_micro_batches == K  # the window as it was
    sched.last_epoch -= 1  # undo the habit (as a fixed loop would not have done it); the window goes on
    sched._last_lr = [LR * 0.5]
    for group in opt.param_groups:
        group["lr"] = LR * 0.5
    assert acc.step() is not None
    _assert_plain(model, _plain_fp64(start, [range(K), range(K, 2 * K)]))
    acc.close()


def test_scheduler_only_the_accumulator_steps_equals_the_plain_recipe_and_resumes():
    model, start, opt, sched, acc = _setup()
    windows = [range(w * K, (w + 1) * K) for w in range(3)]
    for window in windows[:2]:
        for i in window:
            acc.backward(_loss(model, i))
        assert acc.step() is not None
    state = {"acc": acc.state_dict(), "model": copy.deepcopy(model.state_dict())}
    acc.close()
    # Resume: a fresh scheduler restored before the first update is no habit to refuse.
    model2 = _mlp()
    model2.load_state_dict(state["model"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR, momentum=0.9)
    sched2 = _scheduler(opt2)
    acc2 = gaengine.GradientAccumulator(model2, opt2, accumulation_steps=K, max_grad_norm=None, lr_scheduler=sched2)
    acc2.load_state_dict(state["acc"])
    for i in windows[2]:
        acc2.backward(_loss(model2, i))
    assert acc2.step() is not None
    assert sched2.last_epoch == 3
    _assert_plain(model2, _plain_fp64(start, windows))
    acc2.close()


# ---------------------------------------------------------------- retain_graph=True twice through one graph
def test_second_backward_through_a_retained_graph_raises_with_the_window_intact():
    model, start, opt, sched, acc = _setup()
    loss = _loss(model, 0)
    acc.backward(loss, retain_graph=True)
    with pytest.raises(RuntimeError, match="already accumulated in this window") as err:
        acc.backward(loss, retain_graph=True)
    assert "holds its 1 micro-batch(es)" in str(err.value)
    with pytest.raises(RuntimeError, match="already accumulated in this window"):
        acc.backward(loss * 2.0)  # another loss sharing the retained graph
    assert acc.num_micro_batches == 1
    for i in range(1, K):  # new forwards: the window goes on, nothing lost
        acc.backward(_loss(model, i), retain_graph=True)
    assert acc.step() is not None
    _assert_plain(model, _plain_fp64(start, [range(K)]))
    acc.close()


def test_retained_graphs_are_forgotten_at_the_window_end():
    model, start, opt, sched, acc = _setup()
    trunk = torch.zeros(4, 4, requires_grad=True)  # a leaf reached by every micro-batch is not a shared graph
    for w in range(2):
        for i in range(w * K, (w + 1) * K):
            acc.backward(_loss(model, i) + (trunk * 0).sum(), retain_graph=True)
        assert acc.step() is not None
    _assert_plain(model, _plain_fp64(start, [range(K), range(K, 2 * K)]))
    acc.close()


# ---------------------------------------------------------------- a window left open at the end
def _run_epochs(model, acc, epochs, n):
    for _ in range(epochs):
        for i in range(n):
            acc.backward(_loss(model, i))
            acc.step()


def test_close_with_an_open_window_warns_how_many_were_dropped():
    model, start, opt, sched, acc = _setup()
    _run_epochs(model, acc, 1, K + 2)  # one update, then 2 micro-batches left in the window
    with pytest.warns(UserWarning, match=r"acc.close\(\) dropped the 2 micro-batch\(es\).*step\(force=True\)"):
        acc.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.close()  # said once
    # What the warning asks for is the plain recipe: the last partial window applied.
    model, start, opt, sched, acc = _setup()
    _run_epochs(model, acc, 1, K + 2)
    assert acc.step(force=True) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.close()
    _assert_plain(model, _plain_fp64(start, [range(K), range(K, K + 2)]))


def test_garbage_collected_open_window_warns_and_zero_grad_does_not():
    model, start, opt, sched, acc = _setup()
    acc.backward(_loss(model, 0))
    with pytest.warns(UserWarning, match=r"garbage collection of the GradientAccumulator dropped the 1 micro"):
        del acc
        gc.collect()
    model, start, opt, sched, acc = _setup()
    acc.backward(_loss(model, 0))
    acc.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.close()


def test_epoch_end_force_step_equals_the_plain_recipe_over_epochs():
    """Two epochs of K + 2 micro-batches: with ``step(force=True)`` at each epoch's end (as the docs' loops do),
    the windows are the plain recipe's (K, then 2, per epoch); without it they straddle the epochs."""
    model, start, opt, sched, acc = _setup()
    for _ in range(2):
        _run_epochs(model, acc, 1, K + 2)
        assert acc.step(force=True) is not None
    acc.close()
    _assert_plain(model, _plain_fp64(start, [range(K), range(K, K + 2)] * 2))


# ---------------------------------------------------------------- an optimizer over model.parameters(), a layer frozen
FROZEN = ("0.weight", "0.bias")


def _frozen_run(opt_name, dtype, windows, zero_grad_between=False):
    """The MLP with its first layer frozen, the optimizer over all of ``model.parameters()`` (as torch and
    Lightning take it), K micro-batches per window through the accumulator."""
    model = _mlp(dtype)
    start = copy.deepcopy(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=LR, momentum=0.9) if opt_name == "sgd" else
           torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=opt_name == "adamw-fused"))
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=None)
    for window in windows:
        for i in window:
            acc.backward(_loss(model, i))
        assert acc.step() is not None
    return model, start, opt, acc


@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "adamw-fused"])
def test_frozen_layer_in_the_optimizer_is_accepted_and_left_alone(opt_name):
    windows = [range(w * K, (w + 1) * K) for w in range(3)]
    model, start, opt, acc = _frozen_run(opt_name, torch.float32, windows)
    # The plain fp64 recipe with the same frozen layer and the same optimizer over every parameter.
    ref = copy.deepcopy(start).double()
    for name, p in ref.named_parameters():
        p.requires_grad_(name not in FROZEN)
    ref_opt = (torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9) if opt_name == "sgd" else
               torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))
    for window in windows:
        xs, ys = zip(*(_micro_batch(i, torch.float64) for i in window))
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start.parameters()):
        if name in FROZEN:
            assert torch.equal(p, p0) and p.grad is None and p not in opt.state, name  # untouched, as torch
        else:
            tol = PLAIN_RTOL if opt_name == "sgd" else 2.0**10 * RTOL[torch.float32]  # AdamW divides by sqrt(v)
            assert rel_diff(p.detach().double(), q.detach()) <= tol, name
    # It resumes too: the frozen parameters stay in the optimizer's param groups.
    state = acc.state_dict()
    acc.load_state_dict(state)
    acc.close()


def test_frozen_bf16_layer_in_the_optimizer_with_master_weights():
    model, start, opt, acc = _frozen_run("adamw", torch.bfloat16, [range(K)])
    for name, p in model.named_parameters():
        if name in FROZEN:
            assert torch.equal(p, dict(start.named_parameters())[name])
    assert sum(len(g["params"]) for g in opt.param_groups) == 4  # the frozen two kept, skipped
    acc.close()


def test_optimizer_over_another_models_parameters_is_still_refused():
    model = _mlp()
    other = _mlp()
    for p in other.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=LR)
    with pytest.raises(ValueError, match=r"optimizer holds 4 parameter\(s\) that are not parameters of model"):
        gaengine.GradientAccumulator(model, opt, accumulation_steps=K)


# ---------------------------------------------------------------- the plain recipe's `loss / K`
_DIVIDED = r"divided by {k}, this window's accumulation steps K.*`loss = loss / K`.*{k} times smaller.*delete the division.*LossDividedByKWarning"


def _divided_window(acc, model, divide, first=0):
    """One window of ``acc`` whose every micro-batch loss goes through ``divide``, the warnings recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(acc.accumulation_steps):
            acc.backward(divide(_loss(model, first + i)))
        acc.step()
    return [w for w in caught if issubclass(w.category, gaengine.scaler.LossDividedByKWarning)]


class _TrainerLike:
    """HF Trainer's training_step as transformers writes it without num_items_in_batch: the micro-batch mean
    divided by ``self.current_gradient_accumulation_steps`` (an int), then the backward."""

    def __init__(self, acc, k):
        self.acc, self.current_gradient_accumulation_steps = acc, k

    def training_step(self, model, i):
        loss = _loss(model, i)
        loss = loss / self.current_gradient_accumulation_steps
        self.acc.backward(loss)
        return loss.detach()


@pytest.mark.parametrize("divide", [lambda loss: loss / K, lambda loss: loss * (1 / K), lambda loss: (1 / K) * loss,
                                    lambda loss: loss.div(float(K)), lambda loss: loss / torch.tensor(float(K))],
                         ids=["loss / K", "loss * (1 / K)", "(1 / K) * loss", "loss.div(K)", "loss / tensor(K)"])
def test_loss_divided_by_k_warns_once_naming_habit_effect_and_fix(divide):
    model, start, opt, sched, acc = _setup(scheduler=False)
    caught = _divided_window(acc, model, divide)
    assert len(caught) == 1 and caught[0].filename == __file__  # the user's line (stacklevel)
    assert re.search(_DIVIDED.format(k=K), str(caught[0].message), re.S)
    assert _divided_window(acc, model, divide, first=K) == []  # once per accumulator
    # What the warning says is so: the window's gradient is K times smaller than the plain recipe's, the fp64
    # mean of the window's micro-batches' losses (one backward, no accumulator).
    plain = copy.deepcopy(start).double()
    nn.functional.mse_loss(plain(torch.cat([_micro_batch(i, torch.float64)[0] for i in range(K)])),
                           torch.cat([_micro_batch(i, torch.float64)[1] for i in range(K)])).backward()
    acc.close()
    model = _mlp()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    for i in range(K):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gaengine.scaler.LossDividedByKWarning)
            acc.backward(divide(_loss(model, i)))
    acc.step()  # optimizer=None: the window's gradient is left in .grad
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert rel_diff(p.grad.double() * K, q.grad) <= PLAIN_RTOL, name
    acc.close()


def test_loss_divided_by_accumulation_steps_as_hf_trainer_writes_it_warns():
    model, start, opt, sched, acc = _setup(scheduler=False)
    trainer = _TrainerLike(acc, K)
    with pytest.warns(gaengine.scaler.LossDividedByKWarning, match=r"divided by 3, this window's"):
        trainer.training_step(model, 0)
    acc.zero_grad()
    acc.close()


@pytest.mark.parametrize("divide", [lambda loss: loss / (K + 1), lambda loss: loss / (K - 1), lambda loss: loss * K,
                                    lambda loss: loss * (1 / (K + 1)), lambda loss: loss, lambda loss: loss.mean() * 2,
                                    lambda loss: loss / loss.detach().abs().clamp_min(1.0) * 1.0],
                         ids=["/(K+1)", "/(K-1)", "*K", "*1/(K+1)", "as is", "*2", "/tensor then *1"])
def test_loss_divided_by_another_number_does_not_warn(divide):
    model, start, opt, sched, acc = _setup(scheduler=False)
    assert _divided_window(acc, model, divide) == []


def test_loss_divided_by_k_is_silenced_by_its_category_and_not_checked_in_item_mode():
    model, start, opt, sched, acc = _setup(scheduler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=gaengine.scaler.LossDividedByKWarning)
        for i in range(K):
            acc.backward(_loss(model, i) / K)
        acc.step()
    acc.close()
    # Item mode: the loss is a sum and gaengine divides by num_items (a trainer may divide a sum by its ranks).
    model, start, opt, sched, acc = _setup(scheduler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(K):
            acc.backward(_loss(model, i) * 4 / K, num_items=4)
        acc.zero_grad()
        acc.close()


def test_loss_divided_by_the_scheduled_k_warns_at_that_window():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = gaengine.GradientAccumulator(model, opt, max_grad_norm=None,
                                       accumulation_steps=gaengine.schedules.Milestones({0: 2, 1: 4}, unit="update"))
    assert _divided_window(acc, model, lambda loss: loss / 4) == []  # K = 2 in the first window: 4 is not K
    caught = _divided_window(acc, model, lambda loss: loss / 4, first=2)  # K = 4 now
    assert len(caught) == 1 and "divided by 4" in str(caught[0].message)
