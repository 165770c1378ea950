"""What practitioners trip over: BatchNorm, repeated skips, failing backwards, checkpointing, torch.compile."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import gaengine
from tests.models import Deep, ConvBN, TwoStage
from tests.tolerances import (adamw_param_rtol, assert_bitwise_equal, clipped_grad_rtol, network_rtol, rel_diff,
                              split_batch_rtol)


# ---------------------------------------------------------------- BatchNorm
def test_batchnorm_warns_once_per_model():
    model = ConvBN()
    with pytest.warns(UserWarning, match=r"\['bn'\].*GroupNorm or LayerNorm.*SyncBatchNorm") as caught:
        gaengine.GradientAccumulator(model, None, accumulation_steps=4).close()
    assert [w.filename for w in caught] == [__file__]  # the user's line (stacklevel), not gaengine's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gaengine.GradientAccumulator(model, None, accumulation_steps=4).close()  # not again for this model
        gaengine.GradientAccumulator(ConvBN(), None, accumulation_steps=1).close()  # K = 1: nothing to warn


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum0.1", "cumulative"])
def test_batchnorm_window_statistics_equal_the_effective_batch(momentum):
    torch.manual_seed(0)
    model = ConvBN(momentum)
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, batchnorm="window")
    x = torch.randn(3, 5, 3, 6, 6) * 2 + 0.5
    for window in range(2):
        for k in range(3):
            acc.backward(model(x[k] + window).pow(2).mean())
        acc.step()
        ref(torch.cat(list(x + window)))  # one BatchNorm forward on the concatenated batch
    assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 2
    # Per channel, 3 x 3 x 36 = 324 conv outputs (27-term dot products, perhaps another algorithm for another batch
    # size) reduced to a mean and a variance, over micro-batches or in one go.
    stats_rtol = split_batch_rtol(324) + 2 * network_rtol(1, 27, products_per_layer=1)
    assert rel_diff(model.bn.running_mean, ref.bn.running_mean) <= stats_rtol
    assert rel_diff(model.bn.running_var, ref.bn.running_var) <= stats_rtol
    # Without the window mode the running statistics follow the micro-batches and differ.
    plain = copy.deepcopy(ConvBN(momentum))
    plain.load_state_dict(ref.state_dict() | {"bn.running_mean": torch.zeros(6), "bn.running_var": torch.ones(6),
                                              "bn.num_batches_tracked": torch.tensor(0)})
    for k in range(3):
        plain(x[k])
    assert int(plain.bn.num_batches_tracked) == 3


# ---------------------------------------------------------------- repeated skips
def test_max_consecutive_skips_names_scale_and_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=1,
                                       max_consecutive_skips=2, loss_scale=8.0)
    x = torch.randn(2, 4)
    acc.backward(model(x).mean())
    assert not bool(acc.step().skipped)
    bad = model[1].bias
    bad.register_hook(lambda g: g * float("nan"))  # this parameter's gradient turns non-finite
    acc.backward(model(x).mean())
    assert bool(acc.step().skipped)
    acc.backward(model(x).mean())
    with pytest.raises(RuntimeError, match=r"2 consecutive.*loss scale 8.*\['1.bias'\]"):
        acc.step()


# ---------------------------------------------------------------- an exception inside backward
class _FailOnce(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise torch.OutOfMemoryError("simulated out of memory half-way through backward")
        return g


def test_interrupted_backward_then_zero_grad_recovers():
    torch.manual_seed(0)
    model = TwoStage(_FailOnce.apply)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 6)
    acc.backward(model(x[:2]).pow(2).mean())
    _FailOnce.armed = True  # b's gradient is accumulated, then backward dies before reaching a
    with pytest.raises(torch.OutOfMemoryError):
        acc.backward(model(x[2:]).pow(2).mean())
    with pytest.raises(RuntimeError, match="zero_grad"):
        acc.step(force=True)
    acc.zero_grad()
    for _ in range(2):  # training goes on, equal to the plain recipe from here
        for k in range(2):
            acc.backward(model(x[2 * k:2 * k + 2]).pow(2).mean())
        acc.step()
        for k in range(2):
            (ref(x[2 * k:2 * k + 2]).pow(2).mean() / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    # The same micro-batch gradients (the 1/2 is exact), each side's own norm and clip coefficient, two AdamW steps.
    n = sum(p.numel() for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p, q) <= adamw_param_rtol(q, 1e-2, 2, clipped_grad_rtol(n))


# ---------------------------------------------------------------- composability
def _accumulated_grads(model, xs):
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=len(xs), max_grad_norm=None)
    for x in xs:
        acc.backward(model(x).pow(2).mean())
    acc.step()
    grads = [p.grad.clone() for p in model.parameters()]  # close() drops the .grad the accumulator left
    acc.close()
    return grads


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_gives_eager_gradients(how):
    torch.manual_seed(0)
    eager = Deep()
    ckpt = Deep(how)
    ckpt.load_state_dict(eager.state_dict())
    xs = [torch.randn(3, 8, requires_grad=how == "reentrant") for _ in range(3)]
    for a, b in zip(_accumulated_grads(eager, xs), _accumulated_grads(ckpt, xs)):
        # The recomputed forward and its backward are the same kernels on the same inputs: the same bits.
        assert_bitwise_equal(b, a)


def test_torch_compile_gives_eager_gradients():
    torch.manual_seed(0)
    eager = Deep()
    twin = Deep()
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, backend="aot_eager")
    xs = [torch.randn(3, 8) for _ in range(3)]
    ref = _accumulated_grads(eager, xs)
    acc = gaengine.GradientAccumulator(twin, None, accumulation_steps=3, max_grad_norm=None)
    for x in xs:
        acc.backward(compiled(x).pow(2).mean())
    acc.step()
    for a, p in zip(ref, twin.parameters()):
        # aot_eager's graph (decomposed GELU, fused views) may round the forward and the backward differently.
        assert rel_diff(p.grad, a) <= 2 * network_rtol(4, 8)


def test_effective_batch_size():
    acc = gaengine.GradientAccumulator(nn.Linear(2, 2), None, accumulation_steps=8, micro_batch_size=4)
    assert acc.effective_batch_size == 32
    acc.close()
    acc = gaengine.GradientAccumulator(nn.Linear(2, 2), None, accumulation_steps=8)
    with pytest.raises(ValueError, match="micro_batch_size"):
        acc.effective_batch_size
    with pytest.raises(ValueError, match="micro_batch_size"):
        gaengine.GradientAccumulator(nn.Linear(2, 2), None, micro_batch_size=0)
