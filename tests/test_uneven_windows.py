"""Ranks whose accumulation windows hold different numbers of micro-batches (issue 21, S5), as real gloo processes.

An epoch of 5 micro-batches on one rank and 6 on another with K = 2 ends in a window of 1 micro-batch (stepped
with ``force=True``) on the first and a full window of 2 on the second; the same for 5, 6, 6 and 6, 5, 5 on three
ranks. The window's stats all-reduce carries every rank's count: no rank may apply that update (parameters,
optimizer state, lr_scheduler and loss scale unchanged), every rank raises a ``RuntimeError`` naming the counts and
the fix, and after ``acc.zero_grad()`` the next window of equal counts trains exactly as the plain recipe in one
process (and bit for bit as gaengine trained without the uneven window). Every ``zero_stage``, and the ways the
counts reach the host (``GradientAccumulator.step``): read in the step that raises (an lr_scheduler reads the skip
flag, a rank with unused parameters reads their flags, a partial window), or read by the next ``backward()`` /
``step()`` (a fused optimizer: no host read in ``step()``). One launch per world size runs every case.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import gaengine
from tests.models import Net, WideMLP as _MLP
from tests.ranks import launch_scenario as launch_ranks
from tests.tolerances import recipe_grad_rtol, recipe_param_rtol, rel_diff

pytestmark = pytest.mark.multiproc

K, B, D, MAX_NORM, LR = 2, 3, 8, 0.05, 1e-2
AFTER = 100  # the data of the window after the uneven one
# variant -> (model, dtype, optimizer, lr_scheduler): "fused" reads the counts at the next call on a full window,
# "sched" in the step (the scheduler reads the skip flag), "unused" in the step (the unused parameters' flags),
# "fp16" later, with a dynamic loss scale that must stay as it was.
VARIANTS = {"fused": ("mlp", torch.float32, "adamw", False), "sched": ("mlp", torch.float32, "sgd", True),
            "unused": ("net", torch.float32, "adamw", False), "fp16": ("mlp", torch.float16, "adamw", False)}
CASES = {  # world -> (per-rank micro-batches in the epoch, zero_stage, variant)
    2: [(counts, stage, variant) for counts in ((5, 6), (6, 5)) for stage in (0, 1, 2) for variant in VARIANTS]
    + [((1, 2), 0, "fused"), ((2, 1), 2, "sched")],  # the uneven window is the first (it learns the layout)
    3: [(counts, stage, variant) for counts in ((5, 6, 6), (6, 5, 5)) for stage in (0, 1, 2)
        for variant in ("fused", "sched")],
}


def _model(kind, dtype):
    torch.manual_seed(0)
    return (_MLP(D) if kind == "mlp" else Net()).to(dtype)


def _loss(kind, model, window, rank, k):
    g = torch.Generator().manual_seed(1000 * window + 10 * rank + k)
    if kind == "mlp":
        x, y = torch.randn(B, D, generator=g), torch.randn(B, 4, generator=g)
        return nn.functional.mse_loss(model(x), y)
    tokens, labels = torch.randint(0, 11, (B, 5), generator=g), torch.randint(0, 11, (B, 5), generator=g)
    return nn.functional.cross_entropy(model(tokens).float().reshape(-1, 11), labels.reshape(-1))


def _optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _build(variant, stage):
    kind, dtype, opt_name, with_sched = VARIANTS[variant]
    model = _model(kind, dtype)
    opt = _optimizer(opt_name, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if with_sched else None
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=MAX_NORM, lr_scheduler=sched,
                                       bucket_size_mb=0.0005, zero_stage=stage)
    return model, opt, sched, acc


def _state(model, opt, sched, acc):
    """What an update changes: parameters, optimizer state, learning rate, loss scale, the schedule's position."""
    acc.sharding.update.wait_gathers()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "opt": [t.detach().clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)],
            "lr": [g["lr"] for g in opt.param_groups], "sched": None if sched is None else sched.last_epoch,
            "scale": None if acc.scaler is None else (acc.scaler.scale.clone(), acc.scaler.growth_tracker.clone()),
            "update_index": acc.schedule.update_index, "items_seen": acc.schedule.items_seen}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _window(kind, model, acc, window, rank):
    for k in range(K):
        acc.backward(_loss(kind, model, window, rank, k))
        r = acc.step()
    return r


def _run_case(rank, world, counts, stage, variant):
    kind = VARIANTS[variant][0]
    full = min(counts) // K  # windows every rank completes before the uneven one
    model, opt, sched, acc = _build(variant, stage)
    errors = []

    def call(what, fn):
        try:
            fn()
        except RuntimeError as exc:
            errors.append((what, str(exc)))

    before = _state(model, opt, sched, acc) if full == 0 else None
    for i in range(counts[rank]):  # the epoch, as a training loop runs it
        loss = _loss(kind, model, i // K, rank, i % K)
        call(f"backward {i}", lambda: acc.backward(loss))
        call(f"step {i}", acc.step)
        if i == full * K - 1:
            before = _state(model, opt, sched, acc)
    call("step force", lambda: acc.step(force=True))
    after = _state(model, opt, sched, acc)
    acc.zero_grad()
    result = _window(kind, model, acc, AFTER, rank)  # equal counts again: trains as usual
    trained = {"params": [p.detach().clone() for p in model.parameters()], "skipped": bool(result.skipped)}
    acc.close()

    # gaengine over the same windows without the uneven one: the state after it must be this one, bit for bit.
    model, opt, sched, acc = _build(variant, stage)
    for w in range(full):
        _window(kind, model, acc, w, rank)
    same = _state(model, opt, sched, acc)
    _window(kind, model, acc, AFTER, rank)
    acc.sharding.update.wait_gathers()
    clean = [p.detach().clone() for p in model.parameters()]
    acc.close()
    return {"errors": errors, "before": before, "after": after, "same": same, "trained": trained, "clean": clean}


def _scenario(cases, rank, world, out):
    return {case: _run_case(rank, world, *case) for case in cases}


def _reference(world, counts, variant):
    """The plain recipe in one process (fp32): the windows every rank completed, then the window after."""
    kind, _, opt_name, with_sched = VARIANTS[variant]
    model = _model(kind, torch.float32)
    opt = _optimizer(opt_name, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if with_sched else None
    for window in [*range(min(counts) // K), AFTER]:
        for rank in range(world):
            for k in range(K):
                (_loss(kind, model, window, rank, k) / (world * K)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


def _reference_rtol(q, world, counts, variant):
    """The ranks' parameter ``q`` against ``_reference``'s: ``recipe_grad_rtol`` (the global batch's samples, the
    model's depth and width, each side's clip coefficient) through the optimizer's updates (tests/tolerances.py)."""
    kind, _, opt_name, _ = VARIANTS[variant]
    depth, width, samples = (2, 16, world * K * B) if kind == "mlp" else (5, 16, world * K * B * 5)
    n = sum(p.numel() for p in _model(kind, torch.float32).parameters())
    grad_rtol = recipe_grad_rtol(samples, depth, width, n)
    steps = min(counts) // K + 1
    return recipe_param_rtol(q, opt_name, LR if opt_name == "adamw" else 0.1, steps, grad_rtol,
                             grad_norm_max=MAX_NORM)


def _expected_call(counts, rank, variant):
    """Where the rank raises: a partial window at its own step(force=True) (it reads the counts); a full window in
    its step() when that step reads the device anyway, else at the next call (step(force=True) of an empty window)."""
    if counts[rank] % K:
        return "step force"
    if variant in ("sched", "unused"):
        return f"step {counts[rank] - 1}"
    return "step force"


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_windows_raise_on_every_rank_and_update_nothing(tmp_path, world):
    cases = CASES[world]
    codes, results = launch_ranks(tmp_path, world, functools.partial(_scenario, cases), timeout_s=30, join_s=400)
    assert codes == [0] * world, "a rank failed or hung (see the captured stderr)"
    for case in cases:
        counts, stage, variant = case
        ref = _reference(world, counts, variant) if VARIANTS[variant][1] == torch.float32 else None
        for rank, res in enumerate(r[case] for r in results):
            where = f"{case} rank {rank}"
            assert len(res["errors"]) == 1, f"{where}: {res['errors']}"
            call, msg = res["errors"][0]
            assert call == _expected_call(counts, rank, variant), f"{where}: raised at {call}"
            per_rank = ", ".join(f"{r}: {c % K or K}" for r, c in enumerate(counts))
            assert f"this rank (rank {rank} of {world}) held {counts[rank] % K or K}" in msg, f"{where}: {msg}"
            assert f"per rank {{{per_rank}}}" in msg and "the most was 2" in msg and "the fewest 1" in msg, msg
            assert "no rank applied this update" in msg and "DistributedSampler(dataset, drop_last=True)" in msg, msg
            before, after, same = res["before"], res["after"], res["same"]
            if not before["opt"]:  # a first window: torch's optimizer makes its state (zeros, step 0) when it skips
                assert all(not t.any() for t in after["opt"]), where
                before, after, same = ({**st, "opt": []} for st in (before, after, same))
            assert _equal(before, after), f"{where}: the uneven window changed the state"
            assert _equal(after, same), f"{where}: the state differs from the run without it"
            assert not res["trained"]["skipped"], where
            assert _equal(res["trained"]["params"], res["clean"]), f"{where}: the next window trained otherwise"
            if ref is not None:
                for p, q in zip(res["trained"]["params"], ref):
                    assert rel_diff(p, q) <= _reference_rtol(q, world, counts, variant), \
                        f"{where}: vs the plain recipe in one process"
