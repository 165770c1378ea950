"""A sharding layout the library does not ship, defined in this file only and plugged in through
``gaengine.sharding.register_zero_layout`` (issue 43: a new layout touches neither gaengine/engine.py nor
gaengine/checkpoint.py): ``RoundRobinOwners``, whole-matrix owners placed round-robin over the layout order instead of
largest first.

On 2 gloo ranks at ``zero_stage`` 1 and 2, with AdamW alone (which the built-in layouts would cut into even flat
ranges) and with torch's Muon + AdamW recipe (which they would place largest first), each rank's optimizer holds
exactly the parameters the round-robin rule gives it, and:

* trained K = 1 without clipping, every rank's model equals the plain PyTorch recipe on one process bit for bit: each
  rank's micro-batch gradient is the same product of the same rows on both sides, the two are summed once
  (commutative) and scaled by 1/2 (exact), and the owner runs the same optimizer on the same bits (one intra-op
  thread on both sides: a CPU kernel's summation order may follow the thread count);
* saved through DCP mid-run (K = 2: between windows at stage 1, mid-window at stage 2, ``SAVED_AFTER``) and resumed
  into a fresh accumulator on the same ranks, the run goes on bit for bit as the uninterrupted one.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

import gaengine
from gaengine.rank_layout import RankLayout
from gaengine.zero import WholeOwners, largest_first, owner_layout
from tests.models import MuonLM
from tests.helpers import one_thread
from tests.ranks import launch_scenario

VOCAB, ROWS, SEQ, WINDOWS = 17, 2, 5, 4
CASES = ["adamw", "muon+adamw"]
STAGES = [1, 2]
SAVED_AFTER = {1: 1, 2: 2}
"""The micro-batch (K = 2) after which a checkpoint is saved: between windows at stage 1 (mid-window it saves the
window's sum reduced over the ranks, which resumes within fp32 rounding order only: docs/checkpoints.md), mid-window
at stage 2 (one micro-batch into the second window)."""


class RoundRobinOwners(WholeOwners):
    """Whole-matrix owners placed round-robin: the j-th parameter of a bucket (layout order) on rank ``j % d``, for
    every optimizer (AdamW included, whose moments a checkpoint then saves as the owner's whole range)."""

    @staticmethod
    def place(sizes, held):
        return [j % len(held) for j in range(len(sizes))]

    @classmethod
    def takes(cls, optimizer) -> bool:
        return True


class DroppingPlan(RoundRobinOwners):
    """A broken layout: its plan leaves the last parameter out. It takes only an optimizer marked ``bad_plan``."""

    @classmethod
    def takes(cls, optimizer) -> bool:
        return getattr(optimizer, "bad_plan", False)

    @classmethod
    def plan(cls, params, bucket_size_mb, world_size):
        return owner_layout(params[:-1], bucket_size_mb, world_size)[:2]


def _model() -> MuonLM:
    torch.manual_seed(0)
    return MuonLM(vocab=VOCAB)


def _optimizers(name: str, model: MuonLM):
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)]
    return model.muon_adamw()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (2 * ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (2 * ROWS, SEQ),
                                                                                  generator=g)) for _ in range(n)]


def _loss(model, tokens, labels, rank):
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    return nn.functional.cross_entropy(model(tokens[rows]).reshape(-1, VOCAB), labels[rows].reshape(-1))


def _acc(name: str, stage: int, k: int):
    model = _model()
    opts = _optimizers(name, model)
    return model, gaengine.GradientAccumulator(model, opts if len(opts) > 1 else opts[0], k, max_grad_norm=None,
                                               zero_stage=stage)


def _owned(acc, model) -> list[str]:
    """The model's parameters this rank's optimizer holds a piece of (the layout's ownership map, this rank's part)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(s.param)] for s in acc.sharding.param_slots() if s.piece is not None)


def _scenario(rank, world, out):
    import torch.distributed.checkpoint as dcp

    from gaengine.sharding import register_zero_layout

    register_zero_layout(RoundRobinOwners)  # this rank's process only: every rank registers alike
    register_zero_layout(DroppingPlan)  # asked first; takes only an optimizer marked bad_plan
    torch.set_num_threads(1)
    results = {}
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters())
    opt.bad_plan = True
    try:
        gaengine.GradientAccumulator(model, opt, 1, zero_stage=1)
    except ValueError as exc:
        results["bad plan"] = str(exc)
    results["bad plan unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not any(
        opt.state.values()) and all(p.data._base is None for p in model.parameters())
    batches = _batches(2 * WINDOWS)
    for name in CASES:
        for stage in STAGES:
            model, acc = _acc(name, stage, 1)
            results[(name, stage, "owned")] = _owned(acc, model)
            for w, (tokens, labels) in enumerate(batches[:WINDOWS]):
                acc.backward(_loss(model, tokens, labels, rank))
                if w == 0:  # the layout refuses to lend the gradient in .grad: no rank holds it whole
                    try:
                        acc.step(before_update=lambda: None)
                    except ValueError as exc:
                        results[(name, stage, "lend")] = str(exc)
                acc.step()
            results[(name, stage, "trained")] = [p.detach().clone() for p in model.parameters()]
            acc.close()
            path = str(pathlib.Path(out) / f"ckpt-{name}-{stage}")
            saved_after = SAVED_AFTER[stage]
            for resume in (False, True):
                model, acc = _acc(name, stage, 2)
                if resume:
                    state = {"model": model.state_dict(), "acc": acc.state_dict()}
                    dcp.load(state, checkpoint_id=path)
                    model.load_state_dict(state["model"])
                    acc.load_state_dict(state["acc"])
                for j, (tokens, labels) in enumerate(batches):
                    if resume and j <= saved_after:
                        continue
                    acc.backward(_loss(model, tokens, labels, rank))
                    if acc.num_micro_batches == 2:
                        acc.step()
                    if j == saved_after and not resume:
                        dcp.save({"model": model.state_dict(), "acc": acc.state_dict()}, checkpoint_id=path)
                results[(name, stage, "resumed" if resume else "uninterrupted")] = [
                    p.detach().clone() for p in model.parameters()]
                acc.close()
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    codes, results = launch_scenario(tmp_path_factory.mktemp("new_layout"), 2, _scenario, join_s=240)
    assert codes == [0, 0], f"a rank failed: exit codes {codes}"
    return results


def _plain_recipe(name: str) -> MuonLM:
    """The same optimizers on one process over both ranks' rows: K = 1, ``(loss / 2).backward()`` per rank's rows,
    each optimizer's ``step()`` per window (module docstring)."""
    with one_thread():
        model = _model()
        opts = _optimizers(name, model)
        for tokens, labels in _batches(2 * WINDOWS)[:WINDOWS]:
            for r in range(2):
                (_loss(model, tokens, labels, r) / 2).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    return model


def _round_robin_map() -> dict[str, int]:
    """The owner of each parameter by the round-robin rule, by hand: the layout order is the reverse registration
    order grouped by dtype (one fp32 bucket for this small model), the j-th on rank ``j % 2``."""
    names = [n for n, _ in _model().named_parameters()][::-1]
    return {n: j % 2 for j, n in enumerate(names)}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", CASES)
def test_the_registered_layout_places_the_parameters(two_ranks, name, stage):
    """Each rank's optimizer holds exactly the parameters the round-robin rule gives it (every one whole, on one
    rank): the registered layout, not the built-in ones, placed them. The rule's map differs from largest first's
    (both Muon matrices land on rank 1 here, one per rank there), and AdamW alone would be cut into even flat ranges
    held by both ranks, so a layout that was ignored fails here."""
    want = _round_robin_map()
    for rank, result in enumerate(two_ranks):
        assert result[(name, stage, "owned")] == sorted(n for n, r in want.items() if r == rank), (name, stage, rank)
    model = _model()
    sizes = [p.numel() for p in model.parameters()][::-1]  # ALIGN_NUMEL-rounding keeps their order here
    by_size = dict(zip([n for n, _ in model.named_parameters()][::-1], largest_first(sizes, [0, 0])))
    assert by_size != want


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", CASES)
def test_the_registered_layout_trains_as_the_plain_recipe(two_ranks, name, stage):
    """K = 1, no clipping, 4 updates on 2 ranks: every rank's model equals the plain recipe's bit for bit."""
    reference = _plain_recipe(name)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(reference.parameters(), _model().parameters()))
    assert moved > 1e-3  # the updates moved the model: equality below is not equality of the start
    for rank, result in enumerate(two_ranks):
        for (pname, q), p in zip(reference.named_parameters(), result[(name, stage, "trained")]):
            assert torch.equal(p, q.detach()), f"{name} zero_stage={stage} rank {rank} {pname}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", CASES)
def test_the_registered_layout_refuses_to_lend_the_gradient_and_keeps_the_window(two_ranks, name, stage):
    """``step(before_update=...)`` needs the whole gradient on every rank, which the layout does not hold: refused
    with a ``ValueError`` naming the call, the mode and what to do, and the window applied by the next ``step()``
    is the whole one (the same run equals the plain recipe: test_the_registered_layout_trains_as_the_plain_recipe)."""
    for result in two_ranks:
        message = result[(name, stage, "lend")]
        assert "step(before_update=...)" in message and f"zero_stage={stage}" in message \
            and "use zero_stage=0" in message, message


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", CASES)
def test_the_registered_layout_resumes_a_dcp_checkpoint_bit_for_bit(two_ranks, name, stage):
    """Saved through DCP mid-run (K = 2, ``SAVED_AFTER``) and resumed into a fresh accumulator on the same 2 ranks:
    the micro-batches after it end where the uninterrupted run does, bit for bit."""
    for rank, result in enumerate(two_ranks):
        for a, b in zip(result[(name, stage, "resumed")], result[(name, stage, "uninterrupted")]):
            assert torch.equal(a, b), (name, stage, rank)


def test_a_registered_plan_that_drops_a_parameter_is_refused(two_ranks):
    """A registered layout whose ``plan`` leaves a parameter out is refused at construction with a ``ValueError``
    naming its ``plan`` and what it must return, before anything is built over it (the model's parameters as they
    were, in their own storage; the optimizer without state)."""
    for result in two_ranks:
        assert "DroppingPlan.plan" in result["bad plan"] and "every one of the 9 parameters once" in result["bad plan"]
        assert result["bad plan unchanged"]


def test_register_zero_layout_refuses_what_is_not_a_zero_layout():
    """``register_zero_layout`` takes a subclass of ``gaengine.zero.EvenShards`` only: anything else is refused naming
    what it expected, and the registry is unchanged."""
    from gaengine import sharding

    before = list(sharding._ZERO_LAYOUTS)
    for bad in (object, "RoundRobinOwners", RankLayout, WholeOwners(None, 0)):
        with pytest.raises(TypeError, match="subclass of gaengine.zero.EvenShards"):
            sharding.register_zero_layout(bad)
    assert sharding._ZERO_LAYOUTS == before


def test_owner_layout_refuses_a_placement_that_is_not_one_rank_per_parameter():
    """A ``place`` rule returning a rank outside ``[0, d)`` or the wrong count is refused naming ``place``."""
    params = [torch.zeros(5), torch.zeros(7)]
    for bad in (lambda sizes, held: [2] * len(sizes), lambda sizes, held: [0]):
        with pytest.raises(ValueError, match="place must return one rank in"):
            owner_layout(params, 1.0, 2, place=bad)
