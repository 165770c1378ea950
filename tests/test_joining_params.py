"""Parameters that join or leave after construction are trained exactly (issue 31, F4: gradual unfreezing).

Before, a parameter frozen at construction and later unfrozen (``requires_grad_(True)``, already in the optimizer or
added with ``optimizer.add_param_group``), or a new head added the same way, was trained on autograd's raw ``.grad``:
the sum over the micro-batches, never cleared, never clipped, not in ``grad_norm``. Now every ``zero_stage`` adopts it
at the next window boundary (layout, ``main_grad``, masters, optimizer state and hooks built again) and a frozen one
is dropped, keeping its optimizer state and fp32 master for when it joins again; each test runs the plain fp64
recipe (``loss / K`` backward, ``clip_grad_norm_`` over the trainable parameters, ``optimizer.step()``,
``zero_grad()``) beside it: ``zero_stage=0`` on one rank here, 1 and 2 on two gloo ranks below, where ranks that
change differently raise on every rank. A parameter unfrozen in the middle of a window is refused by ``step()``,
naming it, before anything is applied.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import gaengine
from tests.ranks import free_port, spawn_ranks, torchrun_rank
from tests.tolerances import FP32_EPS

K, MAX_NORM = 3, 0.5


def _batches(window: int, n: int = K):
    g = torch.Generator().manual_seed(100 + window)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x.to(next(model.parameters()).dtype)) - y.to(next(model.parameters()).dtype)).square().mean()


def _reference_window(model, optimizer, window: int) -> None:
    """The plain recipe in fp64: mean of the micro-batch means, clipped over the trainable parameters."""
    optimizer.zero_grad(set_to_none=True)
    for x, y in _batches(window):
        (_loss(model, x, y) / K).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)
    optimizer.step()


def _assert_close(model, ref, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        tol = 64 * FP32_EPS * (1.0 + float(q.detach().abs().max()))
        err = float((p.detach().double() - q.detach()).abs().max())
        assert err <= tol, f"{what}: {name} off by {err:.3e} > {tol:.3e}"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_unfrozen_then_frozen_parameters_match_the_plain_recipe(opt):
    model = _model()
    model[0].requires_grad_(False)  # frozen at construction, in the optimizer
    ref = copy.deepcopy(model).double()
    make = (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)) if opt == "sgd" else (
        lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
    optimizer, ref_opt = make(model.parameters()), make(ref.parameters())
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=MAX_NORM, backend="torch")
    for window in range(6):
        if window == 2:  # gradual unfreezing, between windows
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        if window == 4:  # and a layer frozen again
            model[2].requires_grad_(False)
            ref[2].requires_grad_(False)
        for x, y in _batches(window):
            acc.backward(_loss(model, x, y))
        result = acc.step()
        assert result is not None and not bool(result.skipped)
        _reference_window(ref, ref_opt, window)
        _assert_close(model, ref, f"{opt}, after window {window}")
        assert all(p.grad is None for p in model.parameters()), "a .grad was left behind"
    acc.close()


def test_new_head_added_with_add_param_group_matches_the_plain_recipe():
    model = _model()
    ref = copy.deepcopy(model).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=MAX_NORM, backend="torch")
    for window in range(5):
        if window == 2:  # a new head, its own param group (another learning rate)
            torch.manual_seed(1)
            model.add_module("head", nn.Linear(3, 3))
            ref.add_module("head", copy.deepcopy(model.head).double())
            optimizer.add_param_group({"params": list(model.head.parameters()), "lr": 0.1})
            ref_opt.add_param_group({"params": list(ref.head.parameters()), "lr": 0.1})
        for x, y in _batches(window):
            acc.backward(_loss(model, x, y))
        acc.step()
        _reference_window(ref, ref_opt, window)
        _assert_close(model, ref, f"after window {window}")
    acc.close()


def _bf16_sgd_trained_two_windows(model):
    """An accumulator over ``model`` (bf16, SGD: fp32 masters) after two windows of ``_batches``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=None, backend="torch")
    for window in range(2):
        for x, y in _batches(window):
            acc.backward(_loss(model, x, y).float())
        acc.step()
    return acc


def test_bf16_masters_survive_adoption():
    """bf16 parameters with fp32 masters: the masters of the parameters trained before are kept through the new
    layout (rebuilt from the bf16 model they would lose up to half a bf16 ulp per element each time)."""
    model = _model().to(torch.bfloat16)
    model[0].requires_grad_(False)
    acc = _bf16_sgd_trained_two_windows(model)
    masters = {id(s.param): s.piece.detach().clone() for s in acc.sharding.store.slots if s.master}
    model[0].requires_grad_(True)
    x, y = _batches(2)[0]
    acc.backward(_loss(model, x, y).float())  # the boundary: model[0] joins
    kept = {id(s.param): s.piece for s in acc.sharding.store.slots if s.master}
    assert set(kept) == set(masters) | {id(p) for p in model[0].parameters()}
    for key, master in masters.items():
        assert torch.equal(kept[key], master), "a master was rebuilt from its bf16 rounding"
    acc.zero_grad()
    acc.close()


def test_bf16_master_of_a_parameter_frozen_then_unfrozen_is_kept():
    """A bf16 parameter frozen, then unfrozen: it goes on from its fp32 master (a plain recipe's master copy keeps it),
    not from its bf16 rounding; an element written into the model while it was frozen goes on from the value
    written."""
    model = _model().to(torch.bfloat16)
    acc = _bf16_sgd_trained_two_windows(model)
    master = next(s.piece for s in acc.sharding.store.slots if s.param is model[0].weight).detach().clone()
    assert not torch.equal(master, model[0].weight.float()), "the master holds nothing the bf16 value does not"
    model[0].requires_grad_(False)
    for window in range(2, 4):
        if window == 3:
            with torch.no_grad():
                model[0].weight[0, 0] = 2.0  # written while frozen
        for x, y in _batches(window):
            acc.backward(_loss(model, x, y).float())
        acc.step()
    model[0].requires_grad_(True)
    x, y = _batches(4)[0]
    acc.backward(_loss(model, x, y).float())  # the boundary: model[0] joins again
    kept = next(s.piece for s in acc.sharding.store.slots if s.param is model[0].weight).detach()
    expected = master.clone()
    expected[0, 0] = 2.0
    assert torch.equal(kept, expected), "the master of a parameter frozen then unfrozen was not kept"
    acc.zero_grad()
    acc.close()


def test_parameter_unfrozen_mid_window_is_refused_by_name_before_anything_is_applied():
    model = _model()
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=MAX_NORM, backend="torch")
    batches = _batches(0)
    acc.backward(_loss(model, *batches[0]))
    model[0].requires_grad_(True)  # mid-window
    for x, y in batches[1:]:
        acc.backward(_loss(model, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'0\.weight' became trainable .* in the middle of this accumulation window"):
        acc.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "something was applied"
    acc.zero_grad()  # drops the window and the raw .grad; model[0] joins at the next window
    assert model[0].weight.grad is None
    for x, y in _batches(1):
        acc.backward(_loss(model, x, y))
    acc.step()
    assert not torch.equal(model[0].weight, before[0]), "the joined layer was not trained"
    acc.close()


def test_parameter_unfrozen_then_frozen_again_mid_window_never_has_its_raw_grad_applied():
    """Unfrozen for one micro-batch of the window, then frozen again: its .grad (autograd's, of that micro-batch)
    would be applied raw by torch's SGD, which skips only a None .grad. step() refuses it by name, nothing applied;
    zero_grad() drops it (as optimizer.zero_grad() would), and the next window trains as the plain recipe does with
    the layer frozen: the layer unchanged."""
    model = _model()
    model[0].requires_grad_(False)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.2), accumulation_steps=K,
                                       max_grad_norm=MAX_NORM, backend="torch")
    batches = _batches(0)
    acc.backward(_loss(model, *batches[0]))
    model[0].requires_grad_(True)
    acc.backward(_loss(model, *batches[1]))
    model[0].requires_grad_(False)  # frozen again, its .grad left
    for x, y in batches[2:]:
        acc.backward(_loss(model, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'0\.weight' became trainable .* frozen again since or not"):
        acc.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "something was applied"
    acc.zero_grad()
    assert model[0].weight.grad is None and model[0].bias.grad is None
    for x, y in _batches(1):
        acc.backward(_loss(model, x, y))
    acc.step()
    assert torch.equal(model[0].weight, before[0]) and torch.equal(model[0].bias, before[1]), "the frozen layer moved"
    assert not torch.equal(model[2].weight, before[2])
    acc.close()


# ---------------------------------------------------------------- several ranks: every zero_stage adopts
# Two gloo ranks, one launch for every case below. Each rank runs K micro-batches of its own per window, and the plain
# recipe beside it over every rank's micro-batches (loss / (K W), clip over the trainable parameters).
WORLD = 2
ZERO_STAGES = (1, 2)
BUCKET_MB = 4e-4  # 104 elements of fp32 gradient: several buckets, each padded to 128 and split between the ranks


def _rank_batches(window: int, rank: int):
    return _batches(1000 + WORLD * window + rank)


def _wide_model():
    """Wide enough that both ranks own ranges of the parameters, which a new layout moves between them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 24), nn.Tanh(), nn.Linear(24, 3))


def _full_masters(acc) -> dict[int, torch.Tensor]:
    """Every rank's fp32 masters, whole (each rank's ranges summed over the ranks), keyed by id of the parameter."""
    out = {}
    for s in acc.sharding.param_slots():  # layout order: the same on every rank
        whole = torch.zeros(s.param.numel(), dtype=torch.float32)
        if s.master and s.piece is not None:
            whole[s.lo:s.hi] = s.piece.detach().reshape(-1)
        torch.distributed.all_reduce(whole)
        if s.master:
            out[id(s.param)] = whole.view(s.param.shape)
    return out


def _close_errors(actual, expected) -> list[float]:
    """Per parameter: max |actual - expected| over the bound of ``_assert_close`` (<= 1 passes)."""
    return [float((a.detach().double() - e.detach()).abs().max())
            / (64 * FP32_EPS * (1.0 + float(e.detach().abs().max()))) for a, e in zip(actual, expected)]


def _changes(window: int, again: int, *models) -> None:
    """The membership program of both cases: model[0] joins at window 2; model[again] leaves at 4 and joins again
    at 5 (its optimizer state, and master, kept meanwhile)."""
    for m in models:
        if window == 2:
            m[0].requires_grad_(True)  # gradual unfreezing
        if window == 4:
            m[again].requires_grad_(False)  # frozen again
        if window == 5:
            m[again].requires_grad_(True)  # and joining again


def _sgd_fp32_case(rank: int, stage: int) -> list[float]:
    """fp32, SGD with momentum: model[0] frozen at construction, joins at window 2; model[2] leaves at 4, joins
    again at 5 (its momentum kept, as torch keeps it). Returns the worst error per window, no re-sync: the run
    accumulates its rounding over the windows as the recipe does."""
    model = _wide_model()
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=MAX_NORM,
                                       backend="torch", zero_stage=stage, bucket_size_mb=BUCKET_MB)
    worst = []
    for window in range(7):
        _changes(window, 2, model, ref)
        for x, y in _rank_batches(window, rank):
            acc.backward(_loss(model, x, y))
        assert not bool(acc.step().skipped)
        ref_opt.zero_grad(set_to_none=True)
        for r in range(WORLD):
            for x, y in _rank_batches(window, r):
                (_loss(ref, x, y) / (K * WORLD)).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], MAX_NORM)
        ref_opt.step()
        worst.append(max(_close_errors(model.parameters(), ref.parameters())))
        assert all(p.grad is None for p in model.parameters()), "a .grad was left behind"
    acc.close()
    return worst


def _adamw_bf16_case(rank: int, stage: int, out: str) -> dict:
    """bf16 parameters with fp32 masters, AdamW: model[0] frozen at construction; a bf16 head added in its own param
    group at window 1; model[0] joins at 2, leaves at 4 (its fp32 master and its moments kept), joins again at 5.
    The reference is the plain recipe on fp64 masters, its bf16 twin (the masters rounded) computing each
    micro-batch's gradient: fp64 sums, clip, fp64 AdamW. Every window starts both from the engine's masters (the
    reference's moments are its own), so the bf16 forward is the same; the masters are then compared. After the
    last window, a state_dict() round trip into a fresh accumulator, then two more windows on both: bitwise equal."""
    model = _wide_model().to(torch.bfloat16)
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model).double()
    twin = copy.deepcopy(model)
    make = lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)  # noqa: E731
    optimizer, ref_opt = make(model.parameters()), make(ref.parameters())
    options = dict(accumulation_steps=K, max_grad_norm=MAX_NORM, backend="torch", zero_stage=stage,
                   bucket_size_mb=BUCKET_MB)
    acc = gaengine.GradientAccumulator(model, optimizer, **options)
    worst = []
    for window in range(7):
        if window == 1:  # a new head, its own param group (another learning rate)
            torch.manual_seed(1)
            head = nn.Linear(3, 3).to(torch.bfloat16)
            for m, h in ((model, head), (ref, copy.deepcopy(head).double()), (twin, copy.deepcopy(head))):
                m.add_module("head", h)
            optimizer.add_param_group({"params": list(model.head.parameters()), "lr": 0.1})
            ref_opt.add_param_group({"params": list(ref.head.parameters()), "lr": 0.1})
        _changes(window, 0, model, ref, twin)
        for x, y in _rank_batches(window, rank):
            acc.backward(_loss(model, x, y).float())
        assert not bool(acc.step().skipped)
        with torch.no_grad():
            for q, m in zip(twin.parameters(), ref.parameters()):
                q.copy_(m)  # the masters' rounding, as the engine's model holds it
        sums = [torch.zeros_like(m) for m in ref.parameters()]
        for r in range(WORLD):
            for x, y in _rank_batches(window, r):
                twin.zero_grad(set_to_none=True)
                _loss(twin, x, y).float().backward()
                for s, q in zip(sums, twin.parameters()):
                    if q.grad is not None:
                        s += q.grad.double()
        for m, s in zip(ref.parameters(), sums):
            m.grad = s / (K * WORLD) if m.requires_grad else None
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], MAX_NORM)
        ref_opt.step()
        masters = _full_masters(acc)
        trained = [(masters[id(p)], m) for p, m in zip(model.parameters(), ref.parameters()) if p.requires_grad]
        worst.append(max(_close_errors(*zip(*trained))))
        if window == 4:  # model[0] frozen: the optimizer state exported whole, its own kept as torch keeps it
            exported = gaengine.full_optimizer_state_dict(acc)["state"]
            ours = [exported.get(i, {}) for i in range(len(list(ref.parameters())))]
            theirs = [ref_opt.state.get(m, {}) for g in ref_opt.param_groups for m in g["params"]]
            assert [sorted(a) for a in ours] == [sorted(b) for b in theirs], "another set of states"
            for a, b in zip(ours, theirs):
                if a:
                    worst.append(max(_close_errors([a["exp_avg"], a["exp_avg_sq"]], [b["exp_avg"], b["exp_avg_sq"]])))
                    assert float(a["step"]) == float(b["step"])
        with torch.no_grad():  # the next window starts from the engine's masters (the reference's moments kept)
            for p, m in zip(model.parameters(), ref.parameters()):
                if p.requires_grad:
                    m.copy_(masters[id(p)])
    # A state_dict() round trip after the adoptions, through torch.distributed.checkpoint as docs/checkpoints.md
    # does: into a fresh model (the values), optimizer (the same groups) and accumulator.
    path = f"{out}/checkpoint-{stage}"
    dcp.save({"acc": acc.state_dict()}, checkpoint_id=path)
    fresh = _wide_model().to(torch.bfloat16)
    fresh.add_module("head", nn.Linear(3, 3).to(torch.bfloat16))
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    fresh_opt = make([{"params": [p for n, p in fresh.named_parameters() if not n.startswith("head")]},
                      {"params": list(fresh.head.parameters()), "lr": 0.1}])
    fresh_acc = gaengine.GradientAccumulator(fresh, fresh_opt, **options)
    state = {"acc": fresh_acc.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh_acc.load_state_dict(state["acc"])
    for window in range(7, 9):
        for run_model, run_acc in ((model, acc), (fresh, fresh_acc)):
            for x, y in _rank_batches(window, rank):
                run_acc.backward(_loss(run_model, x, y).float())
            run_acc.step()
    masters, fresh_masters = _full_masters(acc), _full_masters(fresh_acc)
    resumed = (all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
               and all(torch.equal(masters[id(p)], fresh_masters[id(q)])
                       for p, q in zip(model.parameters(), fresh.parameters())))
    acc.close()
    fresh_acc.close()
    return {"worst": worst, "resumed": resumed}


def _recover(rank: int, model, acc, before: list[torch.Tensor], message: str, moved: int) -> dict:
    """After a refused window: whether it changed nothing, then zero_grad() and one more window (window 2), which must
    move ``model[moved]``'s weight and leave the ranks' parameters equal."""
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    acc.zero_grad()
    for x, y in _rank_batches(2, rank):
        acc.backward(_loss(model, x, y))
    went_on = not bool(acc.step().skipped) and not torch.equal(model[moved].weight, before[moved])  # 0.weight, 2.weight
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    torch.distributed.all_gather(gathered, flat)
    acc.close()
    return {"message": message, "unchanged": unchanged, "went_on": went_on,
            "equal": torch.equal(gathered[0], gathered[1])}


def _refused_window_case(rank: int, stage: int, mid_window: bool) -> dict:
    """Rank 0 unfreezes model[0] before window 1 (``mid_window`` False) or between its two micro-batches (True), rank 1
    does not: every rank's step() raises ValueError (naming the parameter and each rank's change; mid-window, on
    rank 1, that the ranks changed their trainable parameters differently), nothing applied on either rank. Before:
    a hang at zero_stage 0 and a refusal on one rank at 1 and 2; mid-window, rank 0 refused and rank 1 applied the
    window, and the ranks trained apart. Then every rank makes the same choice (unfrozen; mid-window: frozen again),
    zero_grad(), and they train on alike. Mid-window at zero_stage=0 only: at 1 and 2 rank 0's refusal comes before
    the norm's all-reduce that rank 1 enters (docs/accumulator.md)."""
    model = _model()
    model[0].requires_grad_(False)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.2), accumulation_steps=K,
                                       max_grad_norm=MAX_NORM, backend="torch", zero_stage=stage)
    for x, y in _rank_batches(0, rank):
        acc.backward(_loss(model, x, y))
    acc.step()
    if rank == 0 and not mid_window:
        model[0].requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    message = "none"
    try:
        for i, (x, y) in enumerate(_rank_batches(1, rank)):
            if mid_window and i == 1 and rank == 0:
                model[0].requires_grad_(True)
            acc.backward(_loss(model, x, y))
        acc.step()
    except ValueError as exc:
        message = str(exc)
    model[0].requires_grad_(not mid_window)  # the same on every rank
    return _recover(rank, model, acc, before, message, moved=2 if mid_window else 0)


def _fsdp2_case(rank: int) -> str:
    """FSDP2 shards the parameters itself, once: a parameter unfrozen later is refused by name on every rank at the
    next window's first backward, nothing accumulated (never trained on autograd's raw .grad)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    model = _wide_model()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model[0].requires_grad_(False)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.2), accumulation_steps=K,
                                       max_grad_norm=MAX_NORM, backend="torch")
    for x, y in _rank_batches(0, rank):
        acc.backward(_loss(model, x, y))
    acc.step()
    model[0].requires_grad_(True)
    x, y = _rank_batches(1, rank)[0]
    try:
        acc.backward(_loss(model, x, y))
        outcome = "none"
    except ValueError as exc:
        outcome = str(exc)
    outcome += f"|{acc.num_micro_batches}|{model[0].weight.grad is None}"
    acc.close()
    return outcome


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    with torchrun_rank(rank, world, port):
        torch.distributed.init_process_group("gloo")
        results = {}
        for stage in ZERO_STAGES:
            results["sgd-fp32", stage] = _sgd_fp32_case(rank, stage)
            results["adamw-bf16", stage] = _adamw_bf16_case(rank, stage, out)
        for stage in (0, *ZERO_STAGES):
            results["disagree", stage] = _refused_window_case(rank, stage, mid_window=False)
        results["mid-window", 0] = _refused_window_case(rank, 0, mid_window=True)
        results["fsdp2"] = _fsdp2_case(rank)
        torch.save(results, f"{out}/rank{rank}.pt")


@pytest.mark.multiproc
def test_every_zero_stage_adopts_on_several_ranks(tmp_path):
    """zero_stage 1 and 2 on 2 gloo ranks: joining (unfrozen, a head added with add_param_group), leaving and joining
    again match the plain recipe within fp32 rounding, fp32 with SGD and bf16 with fp32 masters and AdamW (their
    masters and moments carried over every new layout, the ranges of each parameter moved between the ranks); a
    state_dict() after the adoptions resumes bit for bit. Ranks that change their parameters differently raise
    ValueError on every rank, at every zero_stage, naming the parameter and each rank's change (before: a hang at
    zero_stage 0, a refusal on one rank at 1 and 2)."""
    codes = spawn_ranks(_ranks, WORLD, (free_port(), str(tmp_path)), join_s=240)
    assert codes == [0] * WORLD, f"exit codes {codes} (a negative one: killed, e.g. hung past the deadline)"
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for stage in ZERO_STAGES:
            worst = res["sgd-fp32", stage]
            assert max(worst) <= 1.0, f"rank {rank}, zero_stage={stage}, fp32 SGD: error / bound per window {worst}"
            bf16 = res["adamw-bf16", stage]
            assert max(bf16["worst"]) <= 1.0, f"rank {rank}, zero_stage={stage}, bf16 AdamW: {bf16['worst']}"
            assert bf16["resumed"], f"rank {rank}, zero_stage={stage}: the state_dict() round trip differs"
        for stage in (0, *ZERO_STAGES):
            case = res["disagree", stage]
            message = case["message"]
            assert "'0.weight'" in message and "rank 0: 2 joining" in message and "rank 1: no change" in message, (
                f"rank {rank}, zero_stage={stage}: {message}")
            assert case["unchanged"], f"rank {rank}, zero_stage={stage}: the disagreeing window was applied"
            assert case["went_on"] and case["equal"], f"rank {rank}, zero_stage={stage}: {case}"
        case = res["mid-window", 0]
        assert ("'0.weight'" if rank == 0 else "changed their trainable parameters differently") in case["message"], (
            f"rank {rank}, mid-window: {case['message']}")
        assert case["unchanged"], f"rank {rank}: the window of the mid-window change was applied"
        assert case["went_on"] and case["equal"], f"rank {rank}, mid-window: {case}"
        assert "'0.weight' became trainable" in res["fsdp2"] and res["fsdp2"].endswith("|0|True"), res["fsdp2"]
