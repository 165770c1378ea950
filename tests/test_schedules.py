"""Accumulation schedules: K changing between windows, each window the exact mean of its own effective batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from gaengine.schedules import Milestones, RampUp
from tests.oracle_hooks import use_hooks
from tests.tolerances import network_rtol, rel_diff, split_batch_rtol

MBS = 2  # samples per micro-batch


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _micro_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MBS, 6, generator=g), torch.randn(MBS, 1, generator=g)) for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


# ---------------------------------------------------------------- the schedules themselves
def test_rampup_follows_megatron():
    """start 16, +16 every (96 / 3) = 32 samples, 64 after 96 samples; K = batch / (micro-batch x world)."""
    ramp = RampUp(start_batch_size=16, batch_size_increment=16, ramp_samples=96, global_batch_size=64,
                  micro_batch_size=4, world_size=2)
    expected = {0: 16, 31: 16, 32: 32, 63: 32, 64: 48, 95: 48, 96: 64, 97: 64, 10**9: 64}
    for samples, batch in expected.items():
        assert ramp.batch_size(samples) == batch, samples
        assert ramp(0, samples) == batch // 8
    assert RampUp(start_batch_size=8, batch_size_increment=8, ramp_samples=0, global_batch_size=8,
                  micro_batch_size=8)(0, 0) == 1  # no ramp at all


@pytest.mark.parametrize("kwargs,match", [
    (dict(start_batch_size=16, batch_size_increment=10, ramp_samples=96, global_batch_size=64), "multiple >= 0"),
    (dict(start_batch_size=80, batch_size_increment=16, ramp_samples=96, global_batch_size=64), "multiple >= 0"),
    (dict(start_batch_size=6, batch_size_increment=8, ramp_samples=96, global_batch_size=62), "batch size 6 is not"),
    (dict(start_batch_size=0, batch_size_increment=8, ramp_samples=96, global_batch_size=64), "start_batch_size"),
    (dict(start_batch_size=8, batch_size_increment=8, ramp_samples=-1, global_batch_size=64), "ramp_samples"),
])
def test_rampup_refuses_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RampUp(micro_batch_size=4, **kwargs)


def test_milestones_like_lightning():
    by_update = Milestones({2: 3, 5: 2})
    assert [by_update(u, 0) for u in range(7)] == [1, 1, 3, 3, 3, 2, 2]  # K = 1 before the first milestone
    by_epoch = Milestones({0: 4, 2: 8}, unit="epoch", samples_per_epoch=100)
    assert [by_epoch(0, s) for s in (0, 199, 200, 1000)] == [4, 4, 8, 8]
    assert Milestones({0: 2, 10: 4}, unit="sample")(0, 10) == 4
    for bad, match in (({}, "non-empty"), ({-1: 2}, "start"), ({0: 0}, "K of milestone 0"),
                       ({0: 2}, "unit")):
        with pytest.raises(ValueError, match=match):
            Milestones(bad, unit="update" if match != "unit" else "window")
    with pytest.raises(ValueError, match="samples_per_epoch"):
        Milestones({0: 2}, unit="epoch")


# ---------------------------------------------------------------- through the accumulator
@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_every_window_is_the_large_batch_of_its_own_size(hot_path, monkeypatch):
    use_hooks(monkeypatch, hot_path)
    model = _model()
    ref = copy.deepcopy(model)
    schedule = Milestones({0: 1, 1: 3, 2: 2, 4: 4})
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=schedule, max_grad_norm=None,
                                       micro_batch_size=MBS)
    batches = iter(_micro_batches(40))
    sizes = []
    for window in range(6):
        k = acc.accumulation_steps
        sizes.append((k, acc.effective_batch_size))
        window_batches = [next(batches) for _ in range(k)]
        results = [None]
        for b in window_batches:
            acc.backward(_loss(model, b))
            results.append(acc.step())
        assert results[:-1] == [None] * k and results[-1].num_micro_batches == k
        # The large batch of this window's size, in one fp32 backward on a copy (the window's mean loss).
        for q in ref.parameters():
            q.grad = None
        x = torch.cat([b[0] for b in window_batches])
        y = torch.cat([b[1] for b in window_batches])
        (ref(x) - y).pow(2).mean().backward()
        # k * MBS samples reduced in another order, two backward passes (seeds 1/MBS and 1/(k MBS)) of a 2-layer model.
        rtol = split_batch_rtol(k * MBS) + 2 * network_rtol(2, 8, products_per_layer=2)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel_diff(p.grad, q.grad) <= rtol, f"window {window} (K={k}): {name}"
    assert sizes == [(1, 2), (3, 6), (2, 4), (2, 4), (4, 8), (4, 8)]


def test_rampup_by_samples_and_resume_mid_window_restores_the_position():
    """A run saved mid-window and resumed into a new accumulator takes the same K in every window and ends with
    the same parameters as the run that was not interrupted."""
    def schedule():
        return RampUp(start_batch_size=2, batch_size_increment=2, ramp_samples=8, global_batch_size=6,
                      micro_batch_size=MBS)

    def run(interrupt_at=None):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=schedule(), max_grad_norm=None,
                                           micro_batch_size=MBS)
        ks, seen = [], 0
        for b in _micro_batches(30, seed=3):
            if acc.num_micro_batches == 0:
                ks.append(acc.accumulation_steps)
            acc.backward(_loss(model, b))
            acc.step()
            seen += 1
            if seen == interrupt_at:  # save mid-window, go on in a new accumulator (same model, optimizer)
                state = acc.state_dict()
                acc.close()
                acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=schedule(), max_grad_norm=None,
                                                   micro_batch_size=MBS)
                acc.load_state_dict(state)
        return ks, [p.detach().clone() for p in model.parameters()]

    ks, params = run()
    # Samples seen before each window: 0, 2, 4, 8, 14, 20 -> batches 2, 2, 4, 6, 6, 6 (+2 every 4 samples, 6 past 8)
    assert ks[:6] == [1, 1, 2, 3, 3, 3]
    ks2, params2 = run(interrupt_at=5)  # after the first of the fourth window's three micro-batches
    assert ks2 == ks
    for p, q in zip(params, params2):
        assert torch.equal(p, q)


def test_a_bad_schedule_value_raises_naming_it_with_the_window_intact():
    model = _model()
    values = iter([2, 0])
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=lambda u, s: next(values), max_grad_norm=None)
    for b in _micro_batches(2):
        acc.backward(_loss(model, b))
    assert acc.step() is not None
    with pytest.raises(ValueError, match=r"accumulation_steps schedule .* at update 1 .* must be an int >= 1, got 0"):
        acc.backward(_loss(model, _micro_batches(1)[0]))
    assert acc.num_micro_batches == 0


def test_setting_accumulation_steps_takes_effect_and_a_schedule_refuses_it():
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None)
    acc.accumulation_steps = 3  # e.g. after halving the micro-batch for memory
    results = [None]
    for b in _micro_batches(3):
        acc.backward(_loss(model, b))
        results.append(acc.step())
    assert results[:-1] == [None] * 3 and results[-1].num_micro_batches == 3
    with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1, got 0"):
        acc.accumulation_steps = 0
    scheduled = gaengine.GradientAccumulator(_model(), None, accumulation_steps=Milestones({0: 2}))
    with pytest.raises(ValueError, match="follows a schedule"):
        scheduled.accumulation_steps = 4
