"""No stale gradient enters a window, and every error says how to go on.

What a new user hits: a ``.grad`` left from a ``loss.backward()`` before the accumulator was built, a failed window
followed by ``close()`` and a new accumulator, a model converted after construction, ``num_items=0``. Each test
compares against the plain recipe on a fresh copy of the model (fp32 ``.grad`` accumulated by autograd), on the
default backend with the native hooks and with the Python oracle (``tests/oracle_hooks.py``), and on the emulated
cuda backend (``tests/cuda_emu``: csrc/cuda's kernels and the native hot path on CPU tensors) as the default backend.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from gaengine import backends
from tests import emulated_cuda
from tests.oracle_hooks import use_hooks
from tests.tolerances import assert_bitwise_equal, rel_diff, split_batch_rtol

K = 4

# (backend id of tests/conftest.py's BACKENDS, hooks): "default" takes whatever backend="auto" picks here.
HOT_PATHS = [pytest.param(("default", "native"), id="native"), pytest.param(("default", "python"), id="python"),
             pytest.param(("cuda-emu", "native"), id="cuda-emu-native")]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batches(n=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _loss(model, x):
    return model(x).float().pow(2).mean()


def _plain_window_grads(model, batches):
    """The plain recipe's window gradient: mean of the micro-batch gradients, fp32, on a fresh copy."""
    ref = copy.deepcopy(model).float()
    for q in ref.parameters():
        q.grad = None
    for x in batches:
        (_loss(ref, x) / len(batches)).backward()
    return [q.grad for q in ref.parameters()]


def _window(acc, model, batches):
    for x in batches:
        acc.backward(_loss(model, x))
    return acc.step(force=True)


def _assert_grads(model, expected, what, rtol=None):
    """Bitwise by default: K = 4 (``(loss / 4).backward()`` is exact), no clipping, the same adds in the same order."""
    for (name, p), e in zip(model.named_parameters(), expected):
        assert p.grad is not None, f"{what}: {name} has no gradient"
        if rtol is None:
            assert_bitwise_equal(p.grad.float(), e, f"{what}: {name}")
        else:
            assert rel_diff(p.grad.float(), e) <= rtol, f"{what}: {name}"


@pytest.fixture(params=HOT_PATHS)
def hot_path(request, monkeypatch):
    """The hooks the test's accumulators take (``backend="auto"``); with ``cuda-emu``, backend "auto" is the cuda
    backend over the emulated build (``GAENGINE_BACKEND=cuda``, ``tests/emulated_cuda.py``)."""
    backend_id, hooks = request.param
    if backend_id == "cuda-emu":
        module = emulated_cuda.install(request, monkeypatch, as_default=True)
        chosen = backends.get_backend("auto", "cpu")
        assert chosen.name == "cuda" and chosen._C is module, chosen.name
    else:
        use_hooks(monkeypatch, hooks)
    return hooks


def test_grad_present_at_construction_is_dropped_with_one_warning(hot_path):
    model = _model()
    batches = _batches()
    expected = _plain_window_grads(model, batches)
    _loss(model, batches[0]).backward()  # a .grad on every parameter, from before the accumulator
    model[2].bias.grad = None
    with pytest.warns(UserWarning, match=r"3 of 4 trainable parameters already hold a \.grad.*drops them"):
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    assert all(p.grad is None for p in model.parameters())
    _window(acc, model, batches)
    _assert_grads(model, expected, "first window")


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_close_leaves_no_grad_and_a_new_accumulator_starts_clean(hot_path, optimizer):
    model = _model()
    batches = _batches()
    opt = None if optimizer is None else torch.optim.SGD(model.parameters(), lr=0.0)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=None)
    _window(acc, model, batches)  # optimizer=None leaves the final gradients in .grad
    acc.close()
    assert all(p.grad is None for p in model.parameters())
    other = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    _window(other, model, batches)
    _assert_grads(model, _plain_window_grads(model, batches), "the new accumulator's window")


def _failing_hook(grad):
    raise ValueError("a user's tensor hook failed")


@pytest.mark.parametrize("then", ["close", "zero_grad"])
def test_failed_window_leaves_no_grad_behind(hot_path, then):
    model = _model()
    batches = _batches()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    acc.backward(_loss(model, batches[0]))
    handle = model[0].weight.register_hook(_failing_hook)  # fails after the last layer's gradients arrived
    with pytest.raises(ValueError, match="a user's tensor hook failed"):
        acc.backward(_loss(model, batches[1]))
    handle.remove()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"call acc\.zero_grad\(\) to drop it, then go on"):
        acc.backward(_loss(model, batches[1]))
    with pytest.raises(RuntimeError, match=r"call acc\.zero_grad\(\) to drop it, then go on"):
        acc.step(force=True)
    if then == "close":
        acc.close()
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    else:
        acc.zero_grad()
    _window(acc, model, batches)
    _assert_grads(model, _plain_window_grads(model, batches), f"after {then}")


def test_model_converted_after_construction_says_to_build_a_new_accumulator(hot_path):
    model = _model().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=None)
    batches = [x.to(torch.bfloat16) for x in _batches()]
    for x in batches:
        acc.backward(_loss(model, x))
    model.to(torch.float32)
    build_new = r"moved or converted.*acc\.zero_grad\(\) cannot recover.*acc\.close\(\).*new GradientAccumulator"
    with pytest.raises(RuntimeError, match=build_new):
        acc.step()
    with pytest.raises(RuntimeError, match=build_new):  # not "the window already holds 4 micro-batches"
        acc.backward(_loss(model, batches[0].float()))
    acc.zero_grad()
    with pytest.raises(RuntimeError, match=build_new):
        acc.backward(_loss(model, batches[0].float()))
    acc.close()
    # The new accumulator over the converted model is correct: one update equals the plain fp32 recipe's.
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=None)
    fp32_batches = [x.float() for x in batches]
    _window(acc, model, fp32_batches)
    for x in fp32_batches:
        (_loss(ref, x) / K).backward()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # bitwise gradients, the same AdamW
        assert_bitwise_equal(p.detach(), q.detach(), name)


def test_fp32_model_moved_to_another_dtype_is_refused_for_good(hot_path):
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    model.to(torch.float16)
    with pytest.raises(RuntimeError, match=r"now torch\.float16 on cpu.*new GradientAccumulator"):
        acc.backward(_loss(model, _batches(1)[0].half()))


@pytest.mark.parametrize("bad", [0, -3])
def test_num_items_zero_or_negative_int_raises_in_backward_with_the_window_intact(hot_path, bad):
    model = _model()
    batches = _batches()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    sums = [model(x).float().pow(2).sum() for x in batches]  # item mode: 4 items per micro-batch
    acc.backward(sums[0], num_items=4)
    with pytest.raises(ValueError, match=r"num_items must be >= 1.*skip its acc\.backward\(\).*torch\.tensor\(0\)"):
        acc.backward(model(batches[1]).float().pow(2).sum(), num_items=bad)
    for x in batches[1:]:
        acc.backward(model(x).float().pow(2).sum(), num_items=4)
    acc.step()
    ref = copy.deepcopy(model)
    for q in ref.parameters():
        q.grad = None
    (sum(ref(x).pow(2).sum() for x in batches) / 16).backward()  # autograd sums the 4 branches in its own order
    _assert_grads(model, [q.grad for q in ref.parameters()], "the window after the refused micro-batch",
                  rtol=split_batch_rtol(K))


def test_num_items_tensors_adding_up_to_zero_skip_the_update(hot_path):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=1.0)
    batches = _batches(4)
    for x in batches[:2]:
        acc.backward(model(x).pow(2).sum() * 0, num_items=torch.tensor(0))
    result = acc.step()
    assert bool(result.skipped)
    assert not torch.isfinite(result.loss)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    # The next window is an ordinary one.
    for x in batches[2:]:
        acc.backward(model(x).pow(2).sum(), num_items=torch.tensor(4))
    assert not bool(acc.step().skipped)
