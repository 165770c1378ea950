"""Bad input gets a clear error naming the argument, and the window already accumulated stays intact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from tests.tolerances import rel_diff


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    return ((model(torch.randn(4, 6, generator=g)) - torch.randn(4, 3, generator=g)) ** 2).mean()


def _assert_window_intact(acc, model, ref, done):
    """Finish the window and compare with the plain recipe over the same micro-batches."""
    for k in range(done, acc.accumulation_steps):
        acc.backward(_loss(model, k))
    acc.step()
    for k in range(acc.accumulation_steps):
        (_loss(ref, k) / acc.accumulation_steps).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p.grad, q.grad) <= 1e-6


@pytest.fixture
def started():
    """An accumulator (optimizer=None, K=3) holding one accumulated micro-batch, and its reference twin."""
    model = _model()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=None, backend="torch")
    acc.backward(_loss(model, 0))
    yield acc, model, ref
    acc.close()


@pytest.mark.parametrize("value", [0, -2, 2.0, "4", True], ids=["zero", "negative", "float", "str", "bool"])
def test_accumulation_steps(value):
    with pytest.raises(ValueError, match="accumulation_steps"):
        gaengine.GradientAccumulator(_model(), None, accumulation_steps=value)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "x"], ids=["zero", "negative", "nan", "inf", "str"])
def test_max_grad_norm(value):
    with pytest.raises(ValueError, match="max_grad_norm"):
        gaengine.GradientAccumulator(_model(), None, max_grad_norm=value)


def test_no_trainable_params():
    model = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gaengine.GradientAccumulator(model, None)


def test_params_on_several_devices():
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        gaengine.GradientAccumulator([a, b], None)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        gaengine.GradientAccumulator(_model(), None, backend="fast")


def test_ddp_wrapped_model(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(_model())
        with pytest.raises(TypeError, match="DistributedDataParallel.*freed"):
            gaengine.GradientAccumulator(ddp, None)
    finally:
        dist.destroy_process_group()


def test_second_accumulator_on_same_params(started):
    acc, model, ref = started
    with pytest.raises(RuntimeError, match="already belongs to another GradientAccumulator"):
        gaengine.GradientAccumulator(model, None, accumulation_steps=3)
    _assert_window_intact(acc, model, ref, done=1)


def test_second_accumulator_allowed_after_close():
    model = _model()
    gaengine.GradientAccumulator(model, None).close()
    gaengine.GradientAccumulator(model, None).close()


def test_optimizer_with_foreign_params():
    model = _model()
    stranger = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD(list(model.parameters()) + [stranger], lr=0.1)
    with pytest.raises(ValueError, match="optimizer holds 1 parameter"):
        gaengine.GradientAccumulator(model, opt)


def test_sparse_embedding_refused():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="sparse"):
        gaengine.GradientAccumulator(model, None)


def test_sparse_gradient_in_backward(started):
    acc, model, ref = started
    emb_weight = nn.Parameter(torch.randn(10, 4))
    acc2 = gaengine.GradientAccumulator([emb_weight], None, accumulation_steps=2)
    with pytest.raises(ValueError, match="sparse|dense"):
        acc2.backward(nn.functional.embedding(torch.tensor([1, 2]), emb_weight, sparse=True).sum())
    acc2.close()
    _assert_window_intact(acc, model, ref, done=1)


@pytest.mark.parametrize("kind", ["vector", "no-grad", "int", "not-tensor"])
def test_bad_loss(started, kind):
    acc, model, ref = started
    x = torch.randn(4, 6)
    loss = {
        "vector": lambda: (model(x) ** 2).mean(0),
        "no-grad": lambda: (model(x) ** 2).mean().detach(),
        "int": lambda: torch.tensor(3),
        "not-tensor": lambda: 1.0,
    }[kind]()
    with pytest.raises(ValueError, match="loss"):
        acc.backward(loss)
    _assert_window_intact(acc, model, ref, done=1)


def test_mixing_num_items_in_a_window(started):
    acc, model, ref = started
    with pytest.raises(ValueError, match="num_items"):
        acc.backward(_loss(model, 1) * 4, num_items=4)
    _assert_window_intact(acc, model, ref, done=1)


@pytest.mark.parametrize("value", [-1, 2.5, torch.ones(2)], ids=["negative", "float", "vector"])
def test_bad_num_items(value):
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2)
    with pytest.raises(ValueError, match="num_items"):
        acc.backward(_loss(model, 0), num_items=value)
    assert acc.num_micro_batches == 0


def test_zero_items_in_total():
    model = _model()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None)
    acc.backward(_loss(model, 0) * 0, num_items=0)
    acc.backward(_loss(model, 1) * 0, num_items=0)
    with pytest.raises(ValueError, match="num_items adds up to 0"):
        acc.step()
    assert acc.num_micro_batches == 2  # window kept: the user decides (zero_grad() drops it)
    acc.zero_grad()
    acc.backward(_loss(model, 0) * 4, num_items=4)
    acc.backward(_loss(model, 1) * 4, num_items=4)
    acc.step()
    for k in range(2):
        (_loss(ref, k) / 2).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p.grad, q.grad) <= 1e-6


def test_backward_on_full_window(started):
    acc, model, ref = started
    acc.backward(_loss(model, 1))
    acc.backward(_loss(model, 2))
    with pytest.raises(RuntimeError, match="call acc.step"):
        acc.backward(_loss(model, 3))
    _assert_window_intact(acc, model, ref, done=3)


def test_plain_loss_backward_is_refused(started):
    acc, model, ref = started
    with pytest.raises(RuntimeError, match="acc.backward"):
        _loss(model, 1).backward()
    _assert_window_intact(acc, model, ref, done=1)
