"""Several optimizers on one model (issue 44, point 1): ``GradientAccumulator(model, [muon, adamw], lr_scheduler=[s1,
s2])`` against torch's own Muon + AdamW recipe (``torch.optim.Muon``'s docstring: Muon for the 2-D hidden weights,
AdamW for the embedding, head, norm and biases; two optimizers, ``clip_grad_norm_`` over all the parameters,
``loss / K``), on one process and on 2 gloo ranks; torch's Adafactor and schedule-free AdamW alone in the same style;
what is refused (a parameter in two optimizers or in none, closure optimizers; whole-matrix optimizers at
``zero_stage`` >= 1 run: tests/test_zero_owners.py) and that a refusal changes nothing; ``state_dict`` round trips of every optimizer.

Newton–Schulz runs in fp64 on both sides here (the ``newton_schulz`` fixture: torch's iteration with its bf16 cast
made an fp64 one, the same function on both sides; the model, the optimizers' state and the gradients stay fp32): torch's
own bf16 iteration turns an fp32 rounding difference of the momentum into a whole bf16 ulp wherever the momentum sits
near a bf16 rounding boundary, and its five iterations can grow a difference of their input some 800-fold
(``newton_schulz_gain``), so in bf16 or fp32 their own roundings would hide the window's gradient, which is what is
tested.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn

import gaengine
from tests.models import MuonLM
from tests.muon import NewtonSchulzCalls, newton_schulz, newton_schulz_gain, ns_fp64  # noqa: F401 - a fixture
from tests.ranks import launch_scenario
from tests.tolerances import (adamw_param_rtol, clipped_grad_rtol, dot_rtol, recipe_grad_rtol, recipe_param_rtol,
                              rel_diff, unit_roundoff, update_rtol)

K, WINDOWS, MAX_NORM, VOCAB, ROWS, SEQ = 4, 5, 0.05, 17, 3, 5
"""Micro-batches per window (a power of two: ``loss / K`` scales each micro-batch's backward exactly, so both sides sum
the same values), updates, the clipping norm (below the windows' gradient norms: every window is clipped), the
vocabulary, rows per micro-batch, tokens per row."""


def _batches(n: int, rows: int = ROWS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))
            for _ in range(n)]


def _loss(model, tokens, labels):
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1))


def _model(seed: int = 0) -> MuonLM:
    torch.manual_seed(seed)
    return MuonLM(vocab=VOCAB)


class Record:
    """What the plain recipe's run tells the tolerance: per update, the largest step of each parameter, and for each
    Muon matrix the ratio ``||sum_j c_j |g_j| ||_F / ||sum_j c_j g_j||_F`` of its Newton–Schulz input (the momentum's
    coefficients ``c_j`` applied to the windows' |gradients|: how much an elementwise relative error of the gradients
    can grow relative to the input, cancellation included)."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}  # parameter name -> its largest step
        self.cancellation: dict[str, float] = {}  # Muon matrix name -> the largest ratio


def plain_recipe(model: MuonLM, batches, k: int = K, windows: int = WINDOWS, clip: float | None = MAX_NORM,
                 record: Record | None = None) -> MuonLM:
    """torch's Muon + AdamW recipe with gradient accumulation: ``(loss / k).backward()`` per micro-batch,
    ``clip_grad_norm_`` over all the parameters, then each optimizer's ``step()`` and ``zero_grad()``."""
    opts = model.muon_adamw()
    muon = opts[0]
    abs_buf = {id(p): torch.zeros_like(p) for p in model.hidden_matrices()}
    it = iter(batches)
    for _ in range(windows):
        for _ in range(k):
            (_loss(model, *next(it)) / k).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if record is not None:  # the momentum of torch's Muon (nesterov): buf.lerp_(g, 1 - mu); g.lerp(buf, mu)
            mu = muon.param_groups[0]["momentum"]
            for i, p in enumerate(model.hidden_matrices()):
                g = p.grad.detach()
                state = muon.state.get(p, {})
                buf = state.get("momentum_buffer", torch.zeros_like(p)).lerp(g, 1 - mu)
                abs_buf[id(p)].lerp_(g.abs(), 1 - mu)
                ratio = g.abs().lerp(abs_buf[id(p)], mu).norm() / g.lerp(buf, mu).norm()
                name = f"hidden.{i}.weight"
                record.cancellation[name] = max(record.cancellation.get(name, 1.0), float(ratio))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if record is not None:
            for n, p in model.named_parameters():
                record.steps[n] = max(record.steps.get(n, 0.0), float((p.detach() - before[n]).abs().max()))
    return model


def muon_param_rtol(p: torch.Tensor, lr_adjusted: float, grad_rtol: float, cancellation: float,
                    updates: int = WINDOWS, ns_steps: int = torch_muon.DEFAULT_NS_STEPS) -> float:
    """A Muon matrix ``p`` (the reference's, after ``updates`` updates) of two runs whose window gradients agree
    elementwise within ``grad_rtol``, relative to max |p|, first order (as ``update_rtol``). Per update: the decay
    and the subtraction round twice per side at |p| (fp32); the Newton–Schulz input (the momentum) differs by at
    most ``grad_rtol * cancellation`` of its Frobenius norm (``Record``), its normalization to norm 1 doubles that,
    and the iterations grow it by at most ``newton_schulz_gain``; each side's fp64 iterations add their own
    roundings (per iteration three products of length at most max(p.shape), each within ``dot_rtol`` of its terms,
    the iterate's Frobenius norm F at most sqrt(min(p.shape)) times the singular values' bound 1.2 of
    ``newton_schulz_gain``'s intervals: ``gram``, ``b gram + c gram^2`` and its product with X err by at most
    ``dot_rtol (F^2 + |c| F^4 + (|b| F^2 + |c| F^4) F)``), grown by the gain too. The step is ``lr_adjusted`` times
    the output, whose largest entry is at most its Frobenius norm."""
    u = unit_roundoff(torch.float32)
    gain = newton_schulz_gain(ns_steps=ns_steps)
    a, b, c = torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C
    f = math.sqrt(min(p.shape)) * 1.2
    per_iteration = dot_rtol(max(p.shape), torch.float64) * (f**2 + abs(c) * f**4 + (abs(b) * f**2 + abs(c) * f**4) * f)
    output = gain * (2 * grad_rtol * cancellation + 2 * ns_steps * per_iteration)
    scale = max(float(p.detach().abs().max()), torch.finfo(torch.float32).tiny)
    return updates * (2 * 2 * u + lr_adjusted * output / scale)


def _lr_adjusted(p: torch.Tensor, lr: float = 0.02) -> float:
    """torch's Muon ``adjust_lr_fn=None`` ("original"): lr * sqrt(max(1, rows / cols))."""
    rows, cols = p.shape
    return lr * math.sqrt(max(1.0, rows / cols))


def _assert_matches(model: MuonLM, reference: MuonLM, record: Record, grad_rtol: float) -> dict[str, float]:
    """Every parameter of ``model`` within its derived tolerance of ``reference``'s; returns the measured errors."""
    muon_ids = {id(p) for p in reference.hidden_matrices()}
    measured = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if id(q) in muon_ids:
            rtol = muon_param_rtol(q, _lr_adjusted(q), grad_rtol, record.cancellation[name])
        else:  # AdamW: its step bounded by the reference's largest one (update_rtol's step_over_param)
            rtol = update_rtol(WINDOWS, record.steps[name] / float(q.detach().abs().max()), grad_rtol)
        measured[name] = rel_diff(p, q)
        print(f"{name}: {measured[name]:.3g} <= {rtol:.3g}")
        assert measured[name] <= rtol, f"{name}: {measured[name]:.3g} > {rtol:.3g}"
    return measured


def test_newton_schulz_gain_bounds_the_iteration():
    """The gain is a bound: a relative perturbation of the input grows by less than twice the gain (the
    normalization, then the five iterations) in the output."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)
    e = torch.randn(16, 8, generator=g, dtype=torch.float64) * 1e-9 * x.norm()
    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    out, out_e = (ns_fp64(m, coefficients, torch_muon.DEFAULT_NS_STEPS, 0.0) for m in (x, x + e))
    assert 1.0 < (out_e - out).norm() / (e.norm() / x.norm()) <= 2 * newton_schulz_gain()


# ------------------------------------------------------------------------------------------------ one process
def test_muon_adamw_equals_plain_recipe(newton_schulz):
    """torch's Muon + AdamW recipe, K = 4, clipping on, 5 updates, fp32: gaengine with the two optimizers as a list
    equals the plain recipe within fp32 rounding (every window clipped: a missing or doubled clip is ~1e-2 off)."""
    batches = _batches(K * WINDOWS)
    record = Record()
    reference = plain_recipe(_model(), batches, record=record)
    model = _model()
    acc = gaengine.GradientAccumulator(model, model.muon_adamw(), K, max_grad_norm=MAX_NORM)
    clipped = []
    for w in range(WINDOWS):
        for tokens, labels in batches[w * K:(w + 1) * K]:
            acc.backward(_loss(model, tokens, labels))
        clipped.append(float(acc.step().grad_norm) > MAX_NORM)
    assert all(clipped), "every window must be clipped for the test to see the clip coefficient"
    n = sum(p.numel() for p in model.parameters())
    _assert_matches(model, reference, record, clipped_grad_rtol(n))


@pytest.mark.parametrize("k", [1, 4])
def test_newton_schulz_runs_once_per_window_per_matrix(newton_schulz, k):
    """Newton–Schulz runs windows x matrices times, whatever K is (never once per micro-batch)."""
    model = _model()
    acc = gaengine.GradientAccumulator(model, model.muon_adamw(), k, max_grad_norm=MAX_NORM)
    for tokens, labels in _batches(k * 3):
        acc.backward(_loss(model, tokens, labels))
        if acc.num_micro_batches == 0 or acc.num_micro_batches == k:
            acc.step()
    assert newton_schulz.shapes == [tuple(p.shape) for _ in range(3) for p in model.hidden_matrices()]


def test_schedulers_step_once_per_applied_update():
    """Each scheduler steps once per applied update; a skipped window (a non-finite gradient) steps none."""
    model = _model()
    opts = model.muon_adamw()
    scheds = [torch.optim.lr_scheduler.StepLR(opts[0], 1, gamma=0.5), torch.optim.lr_scheduler.StepLR(opts[1], 1,
                                                                                                       gamma=0.9)]
    acc = gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM, lr_scheduler=scheds)
    batches = _batches(6)
    for i, (tokens, labels) in enumerate(batches):
        loss = _loss(model, tokens, labels)
        acc.backward(loss * float("inf") if i == 2 else loss)  # the second window is non-finite
        if acc.num_micro_batches == 0 or acc.num_micro_batches == 2:
            acc.step()
    assert [s.last_epoch for s in scheds] == [2, 2]
    assert opts[0].param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    assert opts[1].param_groups[0]["lr"] == pytest.approx(3e-3 * 0.81)


def test_scheduler_stepped_outside_is_refused():
    model = _model()
    opts = model.muon_adamw()
    scheds = [None, torch.optim.lr_scheduler.StepLR(opts[1], 1)]
    acc = gaengine.GradientAccumulator(model, opts, 1, lr_scheduler=scheds)
    acc.backward(_loss(model, *_batches(1)[0]))
    acc.step()
    scheds[1].step()
    with pytest.raises(RuntimeError, match="stepped outside acc.step"):
        acc.backward(_loss(model, *_batches(1)[0]))


# ------------------------------------------------------------------------------------------------ refusals
def _snapshot(model, opts):
    return ([p.detach().clone() for p in model.parameters()],
            [copy.deepcopy(o.state_dict()) for o in opts])


def _assert_same(before, after):
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    for a, b in zip(before[1], after[1]):
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for n in a["state"]:
            for key, v in a["state"][n].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][n][key])), (n, key)


def test_parameter_in_two_optimizers_is_refused():
    model = _model()
    muon, _ = model.muon_adamw()
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2 or p is model.hidden[0].weight
                               or p is model.emb.weight or p is model.head.weight])
    _loss(model, *_batches(1)[0]).backward()  # a .grad left from before: a refusal must not drop it
    before = _snapshot(model, [muon, adamw])
    grads = [p.grad.clone() for p in model.parameters()]
    groups = [[list(g["params"]) for g in o.param_groups] for o in (muon, adamw)]
    with pytest.raises(ValueError, match=r"parameter 'hidden.0.weight' is in optimizer\[0\] and optimizer\[1\].*"
                                         r"exactly one"):
        gaengine.GradientAccumulator(model, [muon, adamw])
    _assert_same(before, _snapshot(model, [muon, adamw]))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert [[list(g["params"]) for g in o.param_groups] for o in (muon, adamw)] == groups  # not re-pointed
    with pytest.warns(UserWarning, match="9 of 9 trainable parameters already hold a .grad"):  # built now: dropped
        gaengine.GradientAccumulator(model, model.muon_adamw()).close()  # nothing was taken by the refusal


def test_trainable_parameter_in_no_optimizer_is_refused():
    model = _model()
    muon, _ = model.muon_adamw()
    adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if p.ndim != 2 and n != "norm.bias"])
    with pytest.raises(ValueError, match=r"trainable parameter 'emb.weight' \(and 2 more\) is in no optimizer.*"
                                         r"add it to one of them.*or freeze it"):
        gaengine.GradientAccumulator(model, (muon, adamw))
    model.emb.requires_grad_(False)
    model.head.requires_grad_(False)
    model.norm.bias.requires_grad_(False)
    gaengine.GradientAccumulator(model, (muon, adamw)).close()  # frozen: not trainable, nothing to refuse


@pytest.mark.parametrize("bad, match", [
    ([], "empty list"),
    (["sgd"], r"optimizer\[0\] must be a torch.optim.Optimizer"),
])
def test_bad_lists_are_refused(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gaengine.GradientAccumulator(_model(), bad)


def test_bad_scheduler_lists_are_refused():
    model = _model()
    opts = model.muon_adamw()
    with pytest.raises(ValueError, match=r"lr_scheduler must be None or a list of 2 schedulers"):
        gaengine.GradientAccumulator(model, opts, lr_scheduler=torch.optim.lr_scheduler.StepLR(opts[0], 1))
    with pytest.raises(ValueError, match=r"lr_scheduler\[0\] was built over another optimizer"):
        gaengine.GradientAccumulator(model, opts, lr_scheduler=[torch.optim.lr_scheduler.StepLR(opts[1], 1), None])
    with pytest.raises(ValueError, match=r"lr_scheduler is a list of 1 schedulers but optimizer is one optimizer"):
        gaengine.GradientAccumulator(model, opts[1], lr_scheduler=[torch.optim.lr_scheduler.StepLR(opts[1], 1)])


def test_closure_optimizer_in_a_list_is_refused():
    model = _model()
    muon, adamw = model.muon_adamw()
    lbfgs = torch.optim.LBFGS(adamw.param_groups[0]["params"])
    with pytest.raises(TypeError, match=r"LBFGS.step\(\) requires 'closure'.*closure optimizer"):
        gaengine.GradientAccumulator(model, [muon, lbfgs])


# ------------------------------------------------------------------------------------------------ state dicts
def _train(acc, model, batches):
    for i, (tokens, labels) in enumerate(batches):
        acc.backward(_loss(model, tokens, labels))
        if acc.num_micro_batches == 0 or acc.num_micro_batches == acc.accumulation_steps:
            acc.step()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as documented
def test_state_dict_round_trips_every_optimizer(newton_schulz, tmp_path):
    """Saved after 2 windows (and mid-window) through DCP, loaded into a fresh accumulator with fresh optimizers
    and schedulers: both go on bit for bit as the run that never stopped."""
    import torch.distributed.checkpoint as dcp

    batches = _batches(2 * 9)

    def build():
        model = _model()
        opts = model.muon_adamw()
        scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9) for o in opts]
        return model, opts, gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM, lr_scheduler=scheds)

    model, opts, acc = build()
    _train(acc, model, batches[:5])  # two windows and one micro-batch: mid-window
    dcp.save({"model": model.state_dict(), "acc": acc.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    _train(acc, model, batches[5:])

    model2, opts2, acc2 = build()
    state = {"model": model2.state_dict(), "acc": acc2.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    model2.load_state_dict(state["model"])
    acc2.load_state_dict(state["acc"])
    assert opts2[0].state_dict()["state"].keys() == {0, 1}  # Muon's two matrices hold their momentum
    _train(acc2, model2, batches[5:])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for o, o2 in zip(opts, opts2):
        for s, s2 in zip(o.state.values(), o2.state.values()):
            for key in s:
                assert torch.equal(torch.as_tensor(s[key]), torch.as_tensor(s2[key])), key
        assert o.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


def test_refused_load_changes_nothing(newton_schulz):
    """A state saved with the optimizers in the other order is refused naming the key, and the accumulator, the
    model, both optimizers and both schedulers are bit for bit as they were."""
    model = _model()
    muon, adamw = model.muon_adamw()
    acc = gaengine.GradientAccumulator(model, [muon, adamw], 2, max_grad_norm=MAX_NORM)
    _train(acc, model, _batches(4))
    saved = acc.state_dict()

    other = _model()
    o_muon, o_adamw = other.muon_adamw()
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1) for o in (o_adamw, o_muon)]
    acc_other = gaengine.GradientAccumulator(other, [o_adamw, o_muon], 2, max_grad_norm=MAX_NORM,
                                             lr_scheduler=scheds)
    _train(acc_other, other, _batches(4, seed=2))
    before = _snapshot(other, [o_adamw, o_muon])
    sched_before = [s.state_dict() for s in scheds]
    with pytest.raises(ValueError, match=r"state\['meta'\]"):
        acc_other.load_state_dict(saved)
    _assert_same(before, _snapshot(other, [o_adamw, o_muon]))
    assert [s.state_dict() for s in scheds] == sched_before


def test_optimizer_list_load_is_all_or_nothing():
    """``OptimizerList.load_state_dict`` (what the checkpoint calls) loads every optimizer or none: a part that
    fails in the second optimizer's own loader puts the first back as it was, bit for bit (the state saved differs
    from the one held: one more update)."""
    model = _model()
    muon, adamw = model.muon_adamw()
    acc = gaengine.GradientAccumulator(model, [muon, adamw], 1)
    _train(acc, model, _batches(2))
    saved = acc.optimizer.state_dict()
    _train(acc, model, _batches(1, seed=3))
    before = _snapshot(model, [muon, adamw])

    def refuse(optimizer, state_dict):
        raise RuntimeError("AdamW's loader refuses its part")

    adamw.register_load_state_dict_pre_hook(refuse)  # AdamW's own load fails after Muon's part is loaded
    with pytest.raises(RuntimeError, match="AdamW's loader refuses its part"):
        acc.optimizer.load_state_dict(saved)
    _assert_same(before, _snapshot(model, [muon, adamw]))


# ------------------------------------------------------------------------------------------------ other optimizers
def _single(make, k: int = K, windows: int = WINDOWS):
    """One optimizer alone (``make(model)``), the plain recipe against gaengine: K micro-batches, clipping on."""
    batches = _batches(k * windows)
    reference = _model()
    ref_opt = make(reference)
    getattr(ref_opt, "train", lambda: None)()  # schedule-free: its training mode, as its docs ask
    steps = {n: 0.0 for n, _ in reference.named_parameters()}
    it = iter(batches)
    for _ in range(windows):
        for _ in range(k):
            (_loss(reference, *next(it)) / k).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        before = {n: p.detach().clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        for n, p in reference.named_parameters():
            steps[n] = max(steps[n], float((p.detach() - before[n]).abs().max()))
    model = _model()
    opt = make(model)
    acc = gaengine.GradientAccumulator(model, opt, k, max_grad_norm=MAX_NORM)
    getattr(opt, "train", lambda: None)()
    _train(acc, model, batches)
    n = sum(p.numel() for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        rtol = update_rtol(windows, steps[name] / float(q.detach().abs().max()), clipped_grad_rtol(n))
        print(f"{name}: {rel_diff(p, q):.3g} <= {rtol:.3g}")
        assert rel_diff(p, q) <= rtol, f"{name}: {rel_diff(p, q):.3g} > {rtol:.3g}"
    return opt


def test_adafactor_equals_plain_recipe():
    """torch's Adafactor (row and column factors of 2-D parameters) alone, zero_stage=0."""
    _single(lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2))


def test_schedule_free_equals_plain_recipe():
    """Schedule-free AdamW alone, zero_stage=0, in its training mode."""
    schedulefree = pytest.importorskip("schedulefree")
    _single(lambda m: schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2, warmup_steps=0))


def test_elementwise_list_at_zero_stage_1_on_one_rank():
    """A list of elementwise optimizers (SGD with momentum beside AdamW: one keeps a step count, one does not) runs
    at zero_stage=1 and saves its state by ranges, equal to the same list at zero_stage=0."""
    def build(stage):
        model = _model()
        hidden = {id(p) for p in model.hidden_matrices()}
        opts = [torch.optim.SGD(model.hidden_matrices(), lr=0.1, momentum=0.9),
                torch.optim.AdamW([p for p in model.parameters() if id(p) not in hidden], lr=3e-3)]
        return model, gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM, zero_stage=stage)

    (m0, acc0), (m1, acc1) = build(0), build(1)
    for model, acc in ((m0, acc0), (m1, acc1)):
        _train(acc, model, _batches(6))
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    m2, acc2 = build(1)
    m2.load_state_dict(m1.state_dict())
    acc2.load_state_dict(copy.deepcopy(acc1.state_dict()))  # a copy: the state dict holds views of acc1's state
    for model, acc in ((m1, acc1), (m2, acc2)):
        _train(acc, model, _batches(4, seed=5))
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_bf16_model_masters_for_every_optimizer():
    """A bf16 model: every optimizer of the list is re-pointed at fp32 master weights (its param groups hold fp32
    pieces), and the model holds their rounding after the update."""
    model = _model().to(torch.bfloat16)
    opts = model.muon_adamw()
    acc = gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM)
    _train(acc, model, _batches(4))
    held = [q for o in opts for g in o.param_groups for q in g["params"]]
    assert held and all(q.dtype == torch.float32 for q in held)
    by_shape = {}
    for q in held:
        by_shape.setdefault(tuple(q.shape), []).append(q)
    for p in model.parameters():
        assert any(torch.equal(q.to(torch.bfloat16), p) for q in by_shape[tuple(p.shape)])


# ------------------------------------------------------------------------------------------------ two ranks
def _two_rank_scenario(rank, world, out, batches):
    """zero_stage=0 (replicated) on ``world`` gloo ranks: each rank's micro-batch is its rows of the global one."""
    torch_muon._zeropower_via_newtonschulz = NewtonSchulzCalls()
    model = _model()
    acc = gaengine.GradientAccumulator(model, model.muon_adamw(), K, max_grad_norm=MAX_NORM)
    rows = ROWS * 2 // world
    for tokens, labels in batches:
        acc.backward(_loss(model, tokens[rank * rows:(rank + 1) * rows], labels[rank * rows:(rank + 1) * rows]))
        if acc.num_micro_batches == K:
            acc.step()
    return [p.detach().clone() for p in model.parameters()]


def test_muon_adamw_two_ranks_equal_one_process(newton_schulz, tmp_path):
    """2 gloo ranks at zero_stage=0, each with half of every micro-batch, against the plain recipe on one process
    with the whole batch: within the recipe's gradient rounding (the samples summed in another order) propagated
    through the optimizers."""
    batches = _batches(K * WINDOWS, rows=2 * ROWS)
    record = Record()
    reference = plain_recipe(_model(), batches, record=record)
    codes, results = launch_scenario(tmp_path, 2, functools.partial(_two_rank_scenario, batches=batches))
    assert codes == [0, 0]
    n = sum(p.numel() for p in reference.parameters())
    grad_rtol = recipe_grad_rtol(K * 2 * ROWS * SEQ, depth=len(reference.hidden) + 2, width=16, n_params=n)
    for result in results:
        model = _model()
        with torch.no_grad():
            for p, v in zip(model.parameters(), result):
                p.copy_(v)
        _assert_matches(model, reference, record, grad_rtol)


def test_fused_list_takes_the_clip_coefficient_as_grad_scale(monkeypatch):
    """A list whose every optimizer is fused takes ``grad_scale``/``found_inf`` (no scaling pass: each fused
    optimizer divides by the list's ``grad_scale`` in its own kernel) and trains as the same list unfused, whose
    gradients are scaled first: within AdamW's update error from gradients a few roundings apart (the division
    against the product by the coefficient, and torch's fused AdamW rounding sqrt(v) / sqrt(bc2) differently)."""
    def run(fused):
        model = _model()
        hidden = {id(p) for p in model.hidden_matrices()}
        opts = [torch.optim.AdamW(model.hidden_matrices(), lr=1e-2, fused=fused),
                torch.optim.AdamW([p for p in model.parameters() if id(p) not in hidden], lr=1e-2, fused=fused)]
        acc = gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM)
        scales = []
        step = torch.optim.AdamW.step

        def spy(self, *args, **kwargs):
            scales.append(getattr(self, "grad_scale", None) is not None)
            return step(self, *args, **kwargs)

        monkeypatch.setattr(torch.optim.AdamW, "step", spy)
        _train(acc, model, _batches(8))
        monkeypatch.setattr(torch.optim.AdamW, "step", step)
        return model, scales

    (fused, scales), (plain, plain_scales) = run(True), run(False)
    assert scales == [True] * 8 and plain_scales == [False] * 8  # 4 windows x 2 optimizers
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert rel_diff(p, q) <= adamw_param_rtol(q, 1e-2, 4, 4 * unit_roundoff(torch.float32))


def _sharded_list_scenario(rank, world, out, batches):
    """The same list of elementwise optimizers (SGD with momentum, AdamW) at zero_stage 0 and 1 on ``world`` gloo
    ranks, each rank its rows of every micro-batch; zero_stage=1 saved after 2 windows and resumed into a fresh
    accumulator. Returns each run's parameters (zero_stage=1 gathered whole on every rank)."""
    results = {}
    for name, stage, resume in (("replicated", 0, False), ("zero1", 1, False), ("zero1-resumed", 1, True)):
        model = _model()
        hidden = {id(p) for p in model.hidden_matrices()}
        opts = [torch.optim.SGD(model.hidden_matrices(), lr=0.1, momentum=0.9),
                torch.optim.AdamW([p for p in model.parameters() if id(p) not in hidden], lr=1e-2)]
        acc = gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM, zero_stage=stage)
        rows = ROWS * 2 // world
        for i, (tokens, labels) in enumerate(batches):
            if resume and i == 4:  # between windows: a fresh model, optimizers and accumulator take the state
                state = copy.deepcopy({"model": model.state_dict(), "acc": acc.state_dict()})
                model = _model()
                opts = [torch.optim.SGD(model.hidden_matrices(), lr=0.1, momentum=0.9),
                        torch.optim.AdamW([p for p in model.parameters()
                                           if all(p is not q for q in model.hidden_matrices())], lr=1e-2)]
                acc = gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM, zero_stage=stage)
                model.load_state_dict(state["model"])
                acc.load_state_dict(state["acc"])
            acc.backward(_loss(model, tokens[rank * rows:(rank + 1) * rows], labels[rank * rows:(rank + 1) * rows]))
            if acc.num_micro_batches == 2:
                acc.step()
        results[name] = [p.detach().clone() for p in model.parameters()]
    return results


def test_elementwise_list_at_zero_stage_1_on_two_ranks(tmp_path):
    """SGD + AdamW as a list at zero_stage=1 on 2 gloo ranks (each rank updates its flat range with the optimizer
    that owns the parameter) against the same list replicated: the same reduced sums, the clip coefficient from a
    norm summed over the shards (``clipped_grad_rtol``) through each optimizer's update; resumed from a state saved
    mid-run, bit for bit the uninterrupted zero_stage=1 run."""
    batches = _batches(2 * 4, rows=2 * ROWS)
    codes, results = launch_scenario(tmp_path, 2, functools.partial(_sharded_list_scenario, batches=batches))
    assert codes == [0, 0]
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    hidden = {name for name, p in model.named_parameters() if any(p is q for q in model.hidden_matrices())}
    for result in results:
        for (name, _), got, want, resumed in zip(model.named_parameters(), result["zero1"], result["replicated"],
                                                 result["zero1-resumed"]):
            rtol = (recipe_param_rtol(want, "sgd", 0.1, 4, clipped_grad_rtol(n), grad_norm_max=MAX_NORM)
                    if name in hidden else adamw_param_rtol(want, 1e-2, 4, clipped_grad_rtol(n)))
            assert rel_diff(got, want) <= rtol, name
            assert torch.equal(resumed, got), name
