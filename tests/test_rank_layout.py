"""The rank's layout (``gaengine.rank_layout.RankLayout``) is the one object the parameter store asks what this rank
holds: a layout the library does not ship (each parameter held whole by one rank, the whole-matrix owners that matrix
optimizers need at ZeRO) is one subclass, and the store updates over it as the plain recipe does, unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gaengine.backends import get_backend
from gaengine.buffer import FlatBuffer, FlatLayout
from gaengine.rank_layout import Mastered, ParamSlot, RankLayout, copy_all
from gaengine.store import ParameterStore

_SHAPES = [(33, 5), (127,), (4, 4), (70,), (3,)]


class _WholeOwners(RankLayout):
    """Parameter j held whole by rank ``j % world``: its piece shaped like it (its fp32 master, or itself), nothing
    of it on the other ranks. Nothing is laid out in flat buffers; the masters of the owned parameters lie in one fp32
    buffer and are rounded into the parameters themselves."""

    sharded = True

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def hold(self, params, optimized, mastered, device):
        self.param_buffers = {}
        owned = [j % self.world == self.rank for j in range(len(params))]
        with_master = [p for p, opt, mine in zip(params, optimized, owned) if opt and mine and p.dtype in mastered]
        master_of = {}
        if with_master:
            self.master_buffer = FlatBuffer(FlatLayout.build(with_master), torch.float32, device)
            copy_all(self.master_buffer.views, [p.detach() for p in with_master])
            master_of = {id(p): v for p, v in zip(with_master, self.master_buffer.views)}
        slots, entries = [], []
        for p, opt, mine in zip(params, optimized, owned):
            master = opt and p.dtype in mastered
            piece = None
            if opt and mine:
                piece = nn.Parameter(master_of[id(p)]) if master else p
                if master:
                    entries.append(Mastered(p, piece, master_of[id(p)], p.data))
            slots.append(ParamSlot(p, 0, p.numel() if mine else 0, 0, piece, opt, master))
        return slots, entries

    def kept_in_groups(self, q):
        return None  # held whole by another rank, or frozen


@pytest.mark.parametrize("fused", [False, True], ids=["adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-masters"])
def test_a_new_layout_is_one_subclass_and_the_store_updates_over_it_as_the_plain_recipe(dtype, fused):
    """Two ranks' stores over ``_WholeOwners`` (built here, no collective needed: each rank updates only the
    parameters it owns), three updates (a plain one, a skipped one, one with a parameter without gradient), against
    the plain recipe on the same gradients: fp32 masters (or the fp32 parameters) stepped by the same AdamW on
    ``grad * coef``, bit for bit on each parameter's owner; the other ranks' copies untouched by the update."""
    torch.manual_seed(5)
    values = [torch.randn(*shape).to(dtype) for shape in _SHAPES]
    world, ranks = 2, []
    for rank in range(world):
        params = [nn.Parameter(v.clone()) for v in values]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=not fused, fused=fused or None)
        store = ParameterStore(optimizer, params, device=torch.device("cpu"), master_weights=True,
                               layout=_WholeOwners(rank, world))
        held = [q for g in optimizer.param_groups for q in g["params"]]
        assert len(held) == sum(j % world == rank for j in range(len(params)))  # only the owned pieces
        ranks.append((params, store))
    ref_held = [nn.Parameter(v.float()) for v in values]
    ref_opt = torch.optim.AdamW(ref_held, lr=1e-2, weight_decay=0.1, foreach=not fused, fused=fused or None)
    coef = torch.tensor(0.5)  # a power of two: the scale pass and grad_scale give grad * coef exactly
    g = torch.Generator().manual_seed(9)
    for update in range(3):
        raw = [torch.randn(*shape, generator=g) for shape in _SHAPES]
        skipped = torch.tensor(update == 1)
        unused = 1 if update == 2 else None
        for params, store in ranks:
            before = [p.detach().clone() for p in params]
            grads = [None if j == unused else r.clone() for j, r in enumerate(raw)]
            store.update(grads, [x for x in grads if x is not None], coef, skipped, get_backend("torch"))
            for j, (p, b) in enumerate(zip(params, before)):
                if store.slots[j].piece is None:
                    assert torch.equal(p, b), (update, j)  # another rank's parameter: not this rank's update
        if update != 1:
            for j, (q, r) in enumerate(zip(ref_held, raw)):
                q.grad = None if j == unused else r * 0.5
            ref_opt.step()
        for params, store in ranks:
            for j, (p, s) in enumerate(zip(params, store.slots)):
                if s.piece is not None:
                    assert torch.equal(p.detach(), ref_held[j].detach().to(dtype)), (update, j)
                    assert torch.equal(s.piece.detach().float(), ref_held[j].detach()), (update, j)


@pytest.mark.parametrize("layout", ["whole-owners", "replicated-rows"])
def test_where_the_window_sums_lie_in_a_checkpoint_is_the_layouts_answer(layout):
    """``RankLayout.window_chunks`` places each rank's window sums in the checkpoint's tensors (what
    ``ShardingStrategy.window_sums`` hands ``gaengine.checkpoint``): for two ranks' layouts, every saved tensor is
    assembled from the chunks both ranks give and compared with the independent reference, exactly once per element:
    a whole-matrix owner's sums at their parameter's place, nothing from the other rank (``_WholeOwners``, a layout
    the library does not ship, placed by the default answer); a replicated run's own unreduced sums as row ``r`` of a
    ``(world x numel,)`` tensor (``WholeParams`` with ``window_rows``), as ``torch.stack`` of the ranks' sums."""
    from gaengine.zero import WholeParams  # noqa: PLC0415

    torch.manual_seed(11)
    world = 2
    params = [nn.Parameter(torch.randn(shape)) for shape in _SHAPES]
    sums = [[torch.randn(p.numel()) for p in params] for _ in range(world)]  # each rank's own fp32 sums
    assembled = [None] * len(params)
    writes = [None] * len(params)
    for rank in range(world):
        if layout == "whole-owners":
            rank_layout = _WholeOwners(rank, world)
        else:
            rank_layout = WholeParams()
            rank_layout.window_rows = (rank, world)
        slots, _ = rank_layout.hold(params, [True] * len(params), set(), torch.device("cpu"))
        local = [s[slot.lo:slot.hi] for s, slot in zip(sums[rank], slots)]
        for j, chunk in enumerate(rank_layout.window_chunks(slots, local)):
            if assembled[j] is None:
                assembled[j] = torch.full((chunk.numel,), float("nan"))
                writes[j] = torch.zeros(chunk.numel, dtype=torch.int64)
            assert chunk.own == (layout == "replicated-rows")
            assembled[j][chunk.start:chunk.start + chunk.local.numel()] = chunk.local
            writes[j][chunk.start:chunk.start + chunk.local.numel()] += 1
    for j, p in enumerate(params):
        if layout == "whole-owners":
            expected = sums[j % world][j]  # the owner's sums, the parameter's whole range
        else:
            expected = torch.stack([sums[r][j] for r in range(world)]).flatten()
        assert torch.equal(writes[j], torch.ones_like(writes[j])), (layout, j)
        assert torch.equal(assembled[j], expected), (layout, j)


class _TrainModeSGD(torch.optim.SGD):
    """SGD with schedule-free's ``train()`` (``gaengine.store.PARAM_WRITERS``): it flips a param-group setting, as
    ``schedulefree``'s optimizers flip ``train_mode``."""

    def train(self) -> None:
        for group in self.param_groups:
            group["train_mode"] = not group.get("train_mode", False)


@pytest.mark.parametrize("answers", [False, True], ids=["default-answers", "layout-answers"])
def test_the_store_asks_the_layout_how_to_wrap_gradients_and_whether_to_follow_writes(answers):
    """``ParameterStore`` reads no mode flag: it gives each piece's gradient through ``RankLayout.grad_wrapper``'s
    function (called once per piece with a gradient; None by default: no call) and wraps the optimizer's
    ``PARAM_WRITERS`` where ``RankLayout.follows_param_writes`` says so (a ``train()`` that changed a group setting
    then reaches ``after_model_write`` once; by default, fp32 pieces that are the model's own whole parameters, it is
    the optimizer's own method). The update itself is the plain recipe's SGD step on ``grad * coef``, bit for bit."""
    from gaengine.zero import WholeParams  # noqa: PLC0415

    calls = []

    class Answering(WholeParams):
        def grad_wrapper(self):
            return (lambda piece, grad: calls.append(piece) or grad) if answers else None

        def follows_param_writes(self, mastered):
            return answers

    torch.manual_seed(3)
    values = [torch.randn(*shape) for shape in _SHAPES]
    params = [nn.Parameter(v.clone()) for v in values]
    optimizer = _TrainModeSGD(params, lr=0.1)
    store = ParameterStore(optimizer, params, device=torch.device("cpu"), master_weights=True, layout=Answering())
    gathers = []
    store.after_model_write = lambda: gathers.append(1)
    ref = [nn.Parameter(v.clone()) for v in values]
    ref_opt = torch.optim.SGD(ref, lr=0.1)
    raw = [torch.randn(*shape) for shape in _SHAPES]
    grads = [None if j == 1 else r.clone() for j, r in enumerate(raw)]
    store.update(grads, [x for x in grads if x is not None], torch.tensor(0.5), torch.tensor(False),
                 get_backend("torch"))
    for j, (q, r) in enumerate(zip(ref, raw)):
        q.grad = None if j == 1 else r * 0.5
    ref_opt.step()
    for p, q in zip(params, ref):
        assert torch.equal(p.detach(), q.detach())
    assert [id(q) for q in calls] == ([id(p) for j, p in enumerate(params) if j != 1] if answers else [])
    optimizer.train()
    assert gathers == ([1] if answers else [])
    assert ("train" in vars(optimizer)) == answers


@pytest.mark.parametrize("adopts", [False, True], ids=["refused", "adopted"])
def test_whether_a_replaced_parameter_is_adopted_is_the_layouts_answer(adopts):
    """``gaengine.replaced.ReplacedParams`` asks the rank's layout (``RankLayout.adopts_replaced``), not the strategy's
    ``zero_stage``: a strategy that adopts parameters, at ``zero_stage`` 0, over ``WholeParams`` (every parameter
    whole on this rank) takes a layer's replaced weight in at the window start; over a layout the library does not
    ship (``_WholeOwners``, the default answer) the same replacement is refused with a ``ValueError`` naming it,
    nothing pending."""
    from types import SimpleNamespace  # noqa: PLC0415

    from gaengine.replaced import ReplacedParams  # noqa: PLC0415
    from gaengine.zero import WholeParams  # noqa: PLC0415

    model = nn.Linear(3, 2)
    layout = WholeParams() if adopts else _WholeOwners(0, 2)
    strategy = SimpleNamespace(name="a stand-in strategy", adopts_params=True, zero_stage=0, store=None,
                               rank_layout=layout, update=SimpleNamespace(writes_model=False),
                               replaced_params=lambda: [])
    watch = ReplacedParams(model, list(model.parameters()), None, strategy)
    model.weight = nn.Parameter(torch.randn(2, 3))
    if adopts:
        watch.check(window_start=True)
        assert watch.pending == ["weight"]
    else:
        with pytest.raises(ValueError, match=r"'?weight'?.*does not adopt a replaced parameter"):
            watch.check(window_start=True)
        assert watch.pending == []
