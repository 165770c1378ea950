"""A parameter replaced in the model after the accumulator was built is noticed (issue 41, N2 and point 2).

``model.load_state_dict(sd, assign=True)``, a layer swapped for a new one, or ``p.data`` of another shape: the
model then computes with tensors the accumulator does not hold (before, the new ones kept autograd's raw ``.grad``
and never trained). The plain recipe trains the new objects only once the optimizer is pointed at them (it steps the
objects it holds), with no optimizer state for them. gaengine does the same: between windows, in the replicated mode,
a replacement the optimizer holds is adopted at the next window's first ``backward()`` and trains as the plain fp64
recipe with the same swap and the same optimizer edit (fp32, and bf16 with fp32 masters; SGD with momentum: the new
objects start with no momentum buffer, the others keep theirs); a replacement the optimizer does not hold (the plain
recipe would silently not train it), one in the middle of a window, or one under ZeRO on several ranks, raises
``ValueError`` naming the parameter, the window as it was.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import gaengine
from tests.models import MLP
from tests.tolerances import RTOL

K = 2
LR = 0.1


def _setup(dtype=torch.float32):
    torch.manual_seed(0)
    model = MLP(6, 8, 3).to(dtype)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=K,
                                       max_grad_norm=None, backend="torch")
    return model, acc


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _loss(model, batch):
    dtype = next(model.parameters()).dtype
    return nn.functional.mse_loss(model(batch[0].to(dtype)), batch[1].to(dtype))


def _plain(model, windows) -> list[torch.Tensor]:
    """The plain recipe in fp64 from ``model``'s values: per window, the mean of its micro-batches' gradients and an
    SGD step."""
    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for window in windows:
        opt.zero_grad()
        for b in window:
            (_loss(ref, b) / len(window)).backward()
        opt.step()
    return [p.detach() for p in ref.parameters()]


def _assert_close(model, expected, eps, what):
    for (name, p), e in zip(model.named_parameters(), expected):
        # a few roundings of the forward, backward, sum and update in the parameters' dtype (fp32: the sum in fp32)
        tol = 64 * eps * (1.0 + float(e.abs().max()))
        err = float((p.detach().double() - e).abs().max())
        assert err <= tol, f"{what}: {name} off by {err:.3e} > {tol:.3e}"


def _window(acc):
    return acc.num_micro_batches, acc.main_grad.data.clone()


def _same_window(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master-weights"])
def test_load_state_dict_assign_is_refused_naming_the_parameter(dtype):
    """After ``load_state_dict(sd, assign=True)`` the model's parameters are new objects: the next ``backward()``
    raises naming one, the window as it was. Loading in place, as the message says, trains as the plain recipe."""
    model, acc = _setup(dtype)
    batches = _batches(3 * K)
    for b in batches[:K]:
        acc.backward(_loss(model, b))
    assert acc.step() is not None
    torch.manual_seed(3)
    other = MLP(6, 8, 3).to(dtype).state_dict()  # a checkpoint's values
    held = list(model.parameters())
    model.load_state_dict(copy.deepcopy(other), assign=True)
    assert all(p is not q for p, q in zip(model.parameters(), held))
    before = _window(acc)
    with pytest.raises(ValueError, match=r"parameter 'fc1\.weight' is another tensor.*assign=True.*the "
                                         r"optimizer still holds the old object.*plain recipe would not train it"):
        acc.backward(_loss(model, batches[K]))
    assert _same_window(before, _window(acc))
    # the way on the message gives: the held parameters back, the checkpoint's values loaded in place
    for module, name in ((model.fc1, "weight"), (model.fc1, "bias"), (model.fc2, "weight"), (model.fc2, "bias"),
                         (model.head, "weight"), (model.head, "bias")):
        setattr(module, name, held.pop(0))
    model.load_state_dict(other)
    expected = _plain(model, [batches[K:2 * K], batches[2 * K:]])
    for b in batches[K:]:
        acc.backward(_loss(model, b))
        acc.step()
    eps = RTOL[torch.float32] if dtype == torch.float32 else RTOL[torch.bfloat16]
    _assert_close(model, expected, eps, f"{dtype} after load in place")
    acc.close()


def test_swapped_layer_is_refused_mid_window_with_the_window_kept():
    """``model.head = nn.Linear(...)`` in the middle of a window: the next micro-batch's ``backward()`` raises
    naming the layer's parameter, before anything of it is accumulated; the layer put back, the window completes as
    the plain recipe's."""
    model, acc = _setup()
    batches = _batches(K)
    expected = _plain(model, [batches])
    acc.backward(_loss(model, batches[0]))
    before = _window(acc)
    old = model.head
    model.head = nn.Linear(8, 3)
    with pytest.raises(ValueError, match=r"parameter 'head\.weight' is another tensor.*layer replaced.*in the "
                                         r"middle of an accumulation window"):
        acc.backward(_loss(model, batches[1]))
    assert _same_window(before, _window(acc))
    assert all(p.grad is None for p in model.head.parameters())
    model.head = old
    acc.backward(_loss(model, batches[1]))
    assert acc.step() is not None
    _assert_close(model, expected, RTOL[torch.float32], "window completed after the layer was put back")
    acc.close()


def _after_one_window():
    """A model and its accumulator one window in (a window boundary), and the next micro-batch."""
    model, acc = _setup()
    batches = _batches(K + 1)
    for b in batches[:K]:
        acc.backward(_loss(model, b))
    assert acc.step() is not None
    return model, acc, batches


def test_swapped_layer_at_a_window_boundary_is_refused():
    model, acc, batches = _after_one_window()
    model.fc2 = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"parameter 'fc2\.weight'"):
        acc.backward(_loss(model, batches[K]))
    assert acc.num_micro_batches == 0
    acc.close()


def test_parameter_data_of_another_shape_is_refused_at_the_window_start():
    model, acc, batches = _after_one_window()
    with torch.no_grad():
        model.head.bias.data = torch.zeros(5)
    model.head.weight.data = torch.zeros(5, 8)
    with pytest.raises(ValueError, match=r"parameter 'head\.(weight|bias)' is now \(5"):
        acc.backward(model(batches[K][0]).pow(2).mean())  # the output has 5 columns now
    acc.close()


def test_an_unrelated_model_built_meanwhile_is_not_a_replacement():
    """Registering parameters elsewhere (another model built between micro-batches) makes the watch look again, and
    find nothing replaced: the window trains as the plain recipe's."""
    model, acc = _setup()
    batches = _batches(K)
    expected = _plain(model, [batches])
    acc.backward(_loss(model, batches[0]))
    unrelated = MLP(3, 3, 3)
    acc.backward(_loss(model, batches[1]))
    assert acc.step() is not None and unrelated is not None
    _assert_close(model, expected, RTOL[torch.float32], "window with another model built in it")
    acc.close()


MOMENTUM = 0.9


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _swap(how: str, model, optimizer, dtype, source) -> None:
    """Between windows, the same on the accumulator's model and the reference: ``assign``: a checkpoint's values
    loaded with ``assign=True`` and the optimizer's group pointed at the new objects; ``layer``: the head replaced by a
    new ``nn.Linear`` given to the optimizer with ``add_param_group`` (the old head stays in its group, gradient-less:
    skipped). The new values are drawn in ``source`` (the run's dtype: the reference gets the same values)."""
    torch.manual_seed(3)
    if how == "assign":
        other = MLP(6, 8, 3).to(source)
        model.load_state_dict({k: v.to(dtype) for k, v in other.state_dict().items()}, assign=True)
        optimizer.param_groups[0]["params"] = list(model.parameters())
    else:
        head = nn.Linear(8, 3).to(source)
        model.head = head.to(dtype)
        optimizer.add_param_group({"params": list(model.head.parameters())})


@pytest.mark.parametrize("how", ["assign", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master-weights"])
def test_replacement_the_optimizer_holds_trains_as_the_plain_recipe(how, dtype):
    """Replaced between windows 2 and 3 and given to the optimizer as the plain recipe needs: adopted at window 3's
    first backward, every window after matches the plain fp64 recipe that does the same (the new objects start with
    no momentum buffer, the others keep theirs). Before: refused (and, before that, the new ones never trained)."""
    torch.manual_seed(0)
    model = MLP(6, 8, 3).to(dtype)
    ref = copy.deepcopy(model).double()
    optimizer, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=None, backend="torch")
    windows = 5
    batches = _batches(windows * K)
    at_swap = None
    for w in range(windows):
        if w == 2:
            _swap(how, model, optimizer, dtype, dtype)
            _swap(how, ref, ref_opt, torch.float64, dtype)
            at_swap = [p.detach().clone() for p in ref.parameters()]
        window = batches[w * K:(w + 1) * K]
        for b in window:
            acc.backward(_loss(model, b))
        assert acc.step() is not None
        ref_opt.zero_grad()
        for b in window:
            (_loss(ref, b) / K).backward()
        ref_opt.step()
        moved = 0.0 if at_swap is None else max(float((q.detach() - a).abs().max())
                                                for q, a in zip(ref.parameters(), at_swap))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            e = q.detach()
            if dtype == torch.float32:  # a few fp32 roundings of the forward, backward, sum and update
                tol = 64 * RTOL[torch.float32] * (1.0 + float(e.abs().max()))
            else:  # the bf16 rounding of the masters, and the bf16 forward's gradient error in each update since
                tol = RTOL[torch.bfloat16] * (float(e.abs().max()) + 4 * moved)
            err = float((p.detach().double() - e).abs().max())
            assert err <= tol, f"{how}, {dtype}, window {w}: {name} off by {err:.3e} > {tol:.3e}"
    if at_swap is not None:  # the replacement trained: it moved by far more than the bound
        assert moved > 10 * RTOL[torch.bfloat16] * max(float(q.detach().abs().max()) for q in ref.parameters())
    assert {id(p) for p in acc.params} == {id(p) for p in model.parameters()}
    acc.close()


def test_replaced_layer_without_optimizer_gets_the_window_gradient():
    """No optimizer: ``step()`` leaves the window's mean gradient in ``.grad``; a head swapped between windows gets it
    as the plain recipe's ``loss / K`` backward gives it (fp64), and the old head gets none."""
    torch.manual_seed(0)
    model = MLP(6, 8, 3)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None, backend="torch")
    batches = _batches(2 * K)
    for b in batches[:K]:
        acc.backward(_loss(model, b))
    acc.step()
    old = model.head
    model.head = nn.Linear(8, 3)
    ref = copy.deepcopy(model).double()
    for b in batches[K:]:
        acc.backward(_loss(model, b))
        (_loss(ref, b) / K).backward()
    acc.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        tol = 64 * RTOL[torch.float32] * (1.0 + float(q.grad.abs().max()))
        assert p.grad is not None, f"{name}: no gradient"
        err = float((p.grad.double() - q.grad).abs().max())
        assert err <= tol, f"{name}: .grad off by {err:.3e} > {tol:.3e}"
    assert old.weight.grad is None and old.bias.grad is None
    acc.close()


def test_refused_replacement_leaves_the_accumulator_as_it_was():
    """A refusal at a window start (the optimizer holds the old head) changes nothing: the same parameters, layout and
    optimizer; the head put back, the window trains as the plain recipe's."""
    model, acc = _setup()
    batches = _batches(2 * K)
    for b in batches[:K]:
        acc.backward(_loss(model, b))
    acc.step()
    params, groups = list(acc.params), [list(g["params"]) for g in acc.optimizer.param_groups]
    old = model.head
    model.head = nn.Linear(8, 3)
    for _ in range(2):  # refused again, not half adopted by the first refusal
        with pytest.raises(ValueError, match=r"'head\.weight'.*optimizer still holds the old object"):
            acc.backward(_loss(model, batches[K]))
    assert [id(p) for p in acc.params] == [id(p) for p in params]
    assert [[id(q) for q in g["params"]] for g in acc.optimizer.param_groups] == [[id(q) for q in g] for g in groups]
    assert acc.num_micro_batches == 0
    model.head = old
    expected = _plain(model, [batches[K:]])
    for b in batches[K:]:
        acc.backward(_loss(model, b))
    acc.step()
    _assert_close(model, expected, RTOL[torch.float32], "after the head was put back")
    acc.close()


def _rank_case(rank: int, stage: int, swap_on: tuple[int, ...]) -> dict:
    """2 ranks, ``zero_stage=stage``: one window, then the ranks in ``swap_on`` swap the head (the same new values
    on every rank) and give it to the optimizer with ``add_param_group``; two more windows. Returns each window's
    outcome and the parameters after each, beside the plain fp64 recipe over both ranks' micro-batches (the mean of
    every rank's micro-batch means) with the same swap."""
    torch.manual_seed(0)
    model = MLP(6, 8, 3)
    ref = copy.deepcopy(model).double()
    optimizer, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=None, backend="torch",
                                       zero_stage=stage)
    world = torch.distributed.get_world_size()
    out = {"outcomes": [], "errors": [], "kept": []}
    for w in range(3):
        every = [_batches(K, seed=100 * w + r) for r in range(world)]
        if w == 1:
            _swap("layer", ref, ref_opt, torch.float64, torch.float32)
            if rank in swap_on:
                _swap("layer", model, optimizer, torch.float32, torch.float32)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            for b in every[rank]:
                acc.backward(_loss(model, b))
            acc.step()
            out["outcomes"].append("applied")
        except ValueError as exc:
            out["outcomes"].append(str(exc))
            out["kept"].append(all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before)))
            return out
        ref_opt.zero_grad()
        for r in range(world):
            for b in every[r]:
                (_loss(ref, b) / (K * world)).backward()
        ref_opt.step()
        out["errors"].append(max(float((p.detach().double() - q.detach()).abs().max())
                                 / (64 * RTOL[torch.float32] * (1.0 + float(q.detach().abs().max())))
                                 for p, q in zip(model.parameters(), ref.parameters())))
    acc.close()
    return out


def _zero1_after_one_window(rank: int):
    """A model and its ``zero_stage=1`` accumulator one window in (every parameter lives in the flat parameter
    buffer)."""
    torch.manual_seed(0)
    model = MLP(6, 8, 3)
    acc = gaengine.GradientAccumulator(model, _sgd(model.parameters()), accumulation_steps=K, max_grad_norm=None,
                                       backend="torch", zero_stage=1)
    for b in _batches(K, seed=7 + rank):
        acc.backward(_loss(model, b))
    acc.step()
    return model, acc


def _zero_data_case(rank: int) -> str:
    """``zero_stage=1``: ``p.data = x`` on every rank is refused naming it at the next backward (ZeRO does not adopt
    it), nothing accumulated."""
    model, acc = _zero1_after_one_window(rank)
    model.fc1.weight.data = model.fc1.weight.detach().clone()
    with pytest.raises(ValueError) as refused:  # not raising fails this rank, and the test
        acc.backward(_loss(model, _batches(1, seed=9)[0]))
    acc.close()
    return f"{refused.value}|{acc.num_micro_batches}"


def _zero_data_mid_window_case(rank: int) -> dict:
    """``zero_stage=1``, ``p.data = x`` on every rank between a window's two micro-batches: nothing is read per
    micro-batch, so the second backward runs, and the ``step()`` ending the window refuses it naming the parameter,
    before anything is applied: the parameters bit for bit as before the window, its micro-batches kept."""
    model, acc = _zero1_after_one_window(rank)
    before = [p.detach().clone() for p in model.parameters()]
    batches = _batches(K, seed=9 + rank)
    acc.backward(_loss(model, batches[0]))
    model.fc1.weight.data = model.fc1.weight.detach().clone()
    acc.backward(_loss(model, batches[1]))
    with pytest.raises(ValueError) as refused:  # not raising fails this rank, and the test
        acc.step()
    out = {"error": str(refused.value), "micro_batches": acc.num_micro_batches,
           "kept": all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before))}
    acc.zero_grad()
    acc.close()
    return out


def _on_two_ranks(rank, world, out):
    return {"adopted": _rank_case(rank, 0, (0, 1)), "one rank": _rank_case(rank, 0, (0,)),
            "zero1": _rank_case(rank, 1, (0, 1)), "zero1 data": _zero_data_case(rank),
            "zero1 data mid-window": _zero_data_mid_window_case(rank)}


@pytest.mark.multiproc
def test_replacement_on_two_ranks(tmp_path):
    """2 gloo ranks. ``zero_stage=0``, both ranks swapping alike: adopted, every window matches the plain fp64 recipe
    over both ranks' micro-batches. Only rank 0 swapping: no rank adopts and both ranks' ``step()`` raise (before the
    fingerprint counted replacements, rank 0 alone would adopt: its broadcast meeting rank 1's all-reduce).
    ``zero_stage=1``: refused naming the parameter on both ranks, nothing applied; ``p.data = x`` there too (every
    parameter lives in ZeRO's flat parameter buffer), at a window start (refused by its first backward) and between
    two micro-batches (refused by the ``step()`` ending the window, nothing applied, the window kept)."""
    from tests.ranks import launch_scenario  # noqa: PLC0415

    codes, results = launch_scenario(tmp_path, 2, _on_two_ranks, timeout_s=30, join_s=90)
    assert codes == [0, 0], f"exit codes {codes}"
    for rank, res in enumerate(results):
        adopted = res["adopted"]
        assert adopted["outcomes"] == ["applied"] * 3, (rank, adopted["outcomes"])
        assert max(adopted["errors"]) <= 1.0, f"rank {rank}: error / bound per window {adopted['errors']}"
        one = res["one rank"]
        assert one["outcomes"][0] == "applied" and "changed their trainable parameters differently" in (
            one["outcomes"][1]), (rank, one["outcomes"])
        assert one["kept"] == [True], f"rank {rank}: the disagreeing window was applied"
        zero1 = res["zero1"]
        assert "'head.weight'" in zero1["outcomes"][1] and "zero_stage=1 does not adopt" in zero1["outcomes"][1], (
            rank, zero1["outcomes"])
        assert zero1["kept"] == [True]
        data = res["zero1 data"]
        assert "'fc1.weight' has another storage" in data and "zero_stage=1 does not adopt" in data, data
        assert data.endswith("|0"), data
        mid = res["zero1 data mid-window"]
        assert "'fc1.weight' has another storage" in mid["error"] and "zero_stage=1 does not adopt" in mid["error"], (
            rank, mid)
        assert mid["micro_batches"] == K and mid["kept"], (rank, mid)


def _bf16_beside_plain():
    """A bf16 model with fp32 masters and its accumulator (SGD with momentum), beside the plain recipe's fp64 copy
    and its optimizer: ``(model, ref, ref_opt, acc)``."""
    torch.manual_seed(0)
    model = MLP(6, 8, 3).to(torch.bfloat16)
    ref = copy.deepcopy(model).double()
    acc = gaengine.GradientAccumulator(model, _sgd(model.parameters()), accumulation_steps=K, max_grad_norm=None,
                                       backend="torch")
    return model, ref, _sgd(ref.parameters()), acc


def test_parameter_data_replaced_in_a_flat_buffer_trains_as_the_plain_recipe():
    """bf16 parameters with fp32 masters live in a flat parameter buffer; ``p.data = x`` (same shape and dtype, the
    same object) gives one another storage, between windows and in the middle of one. The plain recipe's optimizer
    steps the same object from ``x`` (its momentum and the gradient it holds kept): so does gaengine, every window
    against the plain fp64 recipe doing the same. Before: the updates went into the buffer the model no longer read,
    and the parameter silently never trained again."""
    model, ref, ref_opt, acc = _bf16_beside_plain()
    batches = _batches(4 * K)
    g = torch.Generator().manual_seed(5)
    at_change = None
    for w in range(4):
        ref_opt.zero_grad()
        for k, b in enumerate(batches[w * K:(w + 1) * K]):
            if (w, k) in ((1, 0), (2, 1)):  # between windows, and in the middle of one
                layer, ref_layer = (model.fc1, ref.fc1) if w == 1 else (model.head, ref.head)
                new = torch.randn(layer.weight.shape, generator=g).to(torch.bfloat16)
                layer.weight.data = new.clone()
                ref_layer.weight.data = new.double()
                at_change = at_change or [p.detach().clone() for p in ref.parameters()]
            acc.backward(_loss(model, b))
            (_loss(ref, b) / K).backward()
        assert acc.step() is not None
        ref_opt.step()
        moved = 0.0 if at_change is None else max(float((q.detach() - a).abs().max())
                                                  for q, a in zip(ref.parameters(), at_change))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            e = q.detach()
            tol = RTOL[torch.bfloat16] * (float(e.abs().max()) + 4 * moved)  # as the replacement test above
            err = float((p.detach().double() - e).abs().max())
            assert err <= tol, f"window {w}: {name} off by {err:.3e} > {tol:.3e}"
    assert moved > 10 * RTOL[torch.bfloat16] * max(float(q.detach().abs().max()) for q in ref.parameters())
    acc.close()


def _data_case(name: str, mid_window: bool) -> float:
    """bf16 with fp32 masters: ``p.data = x`` (same shape and dtype) on the parameter ``name``, at window 1's start or
    between its two micro-batches; the largest error / bound over the parameters after each of 3 windows against the
    plain fp64 recipe doing the same."""
    model, ref, ref_opt, acc = _bf16_beside_plain()
    batches = _batches(3 * K)
    worst, at_change = 0.0, None
    for w in range(3):
        ref_opt.zero_grad()
        for k, b in enumerate(batches[w * K:(w + 1) * K]):
            if (w, k) == (1, 1 if mid_window else 0):
                p, q = model.get_parameter(name), ref.get_parameter(name)
                new = torch.randn(p.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
                p.data = new.clone()
                q.data = new.double()
                at_change = [r.detach().clone() for r in ref.parameters()]
            acc.backward(_loss(model, b))
            (_loss(ref, b) / K).backward()
        assert acc.step() is not None
        ref_opt.step()
        moved = 0.0 if at_change is None else max(float((r.detach() - a).abs().max())
                                                  for r, a in zip(ref.parameters(), at_change))
        for p, q in zip(model.parameters(), ref.parameters()):
            tol = RTOL[torch.bfloat16] * (float(q.detach().abs().max()) + 4 * moved)  # as the tests above
            worst = max(worst, float((p.detach().double() - q.detach()).abs().max()) / tol)
    acc.close()
    return worst


@pytest.mark.parametrize("mid_window", [False, True], ids=["window-start", "mid-window"])
def test_parameter_data_replaced_on_any_parameter_trains_as_the_plain_recipe(mid_window):
    """``p.data = x`` on each parameter in turn, the one the store checks for a moved model (the first laid out of
    its dtype) included: followed (at the window's first backward, or mid-window at the ``step()`` ending it, nothing
    being read per micro-batch), every window as the plain fp64 recipe's. Before: on the first laid-out parameter,
    ``RuntimeError`` "the model was moved or converted", for good."""
    names = [n for n, _ in MLP(6, 8, 3).named_parameters()]
    errors = {n: _data_case(n, mid_window) for n in names}
    assert max(errors.values()) <= 1.0, errors


def test_state_dict_after_parameter_data_mid_window_saves_its_values():
    """``p.data = x`` in the middle of a window, then ``acc.state_dict()`` before any other call: the fp32 masters
    saved are ``x``'s values (exact: a bf16 value is an fp32 value), as the model's state dict saved beside it holds
    them. Before: the masters of the values before ``x``."""
    model, acc = _setup(torch.bfloat16)
    batches = _batches(K)
    acc.backward(_loss(model, batches[0]))
    new = torch.randn(model.head.bias.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    model.head.bias.data = new.clone()
    state = acc.state_dict()
    assert torch.equal(state["master"]["head.bias"].local.reshape(new.shape), new.float())
    assert torch.equal(model.head.bias.detach(), new)  # the model still holds x (back in its buffer)
    acc.backward(_loss(model, batches[1]))
    assert acc.step() is not None
    acc.close()


def _held_back(model, held: dict) -> None:
    """Put the parameter objects of ``held`` (name -> Parameter) back into their slots of ``model``."""
    for name, p in held.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)


def test_refused_fp16_replacement_leaves_the_accumulator_as_it_was():
    """An fp32 model whose accumulator has no loss scale (``loss_scale='auto'`` chose none): a checkpoint loaded in
    fp16 with ``assign=True``, the optimizer pointed at the new objects, is refused at the next window's first
    ``backward()`` (an fp16 parameter needs a loss scale), twice alike, and changes nothing: the parameters, the
    window, the fp32 sums and the optimizer bit for bit; the old parameters put back, the next windows train as the
    plain fp64 recipe. Before: the refusal had already taken the new parameters as the model's (the membership read
    again), so the old ones were refused too after being put back."""
    model, acc = _setup()
    batches = _batches(3 * K)
    for b in batches[:K]:
        acc.backward(_loss(model, b))
    assert acc.step() is not None
    held = dict(model.named_parameters())
    groups = [list(g["params"]) for g in acc.optimizer.param_groups]

    def snapshot():
        return ([id(p) for p in acc.params], [(n, id(p)) for n, p in acc.named_params], acc.num_micro_batches,
                acc.main_grad.data.clone(), [p.detach().clone() for p in held.values()],
                [[id(q) for q in g["params"]] for g in acc.optimizer.param_groups])

    before = snapshot()
    model.load_state_dict({k: v.half() for k, v in model.state_dict().items()}, assign=True)
    acc.optimizer.param_groups[0]["params"] = list(model.parameters())
    messages = []
    for _ in range(2):
        with pytest.raises(ValueError, match=r"parameter 'fc1\.weight'.*fp16 parameter needs the loss scale") as e:
            acc.backward(model(batches[K][0].half()).float().pow(2).mean())
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    acc.optimizer.param_groups[0]["params"] = groups[0]
    after = snapshot()
    assert after[:3] == before[:3] and after[5] == before[5]
    assert torch.equal(after[3], before[3]) and all(torch.equal(a, b) for a, b in zip(after[4], before[4]))
    _held_back(model, held)
    expected = _plain(model, [batches[K:2 * K], batches[2 * K:]])
    for b in batches[K:]:
        acc.backward(_loss(model, b))
        acc.step()
    _assert_close(model, expected, RTOL[torch.float32], "after the fp32 parameters were put back")
    acc.close()


def test_replaced_parameters_and_their_masters_are_released():
    """bf16 with fp32 masters, the head replaced by a new layer between windows three times, the optimizer pointed
    at the model's parameters each time (plain SGD: no state keyed by the old objects): once adopted, nothing of
    gaengine's keeps an old head's parameters (or, with them, their fp32 masters) alive. Before: the first ones stayed
    alive for good (the membership's list of the parameters at construction) and each replaced one's fp32 master was
    kept as a frozen parameter's, with its parameter."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    torch.manual_seed(0)
    model = MLP(6, 8, 3).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, max_grad_norm=None, backend="torch")
    batches = _batches(K)
    old = []
    for _ in range(4):
        for b in batches:
            acc.backward(_loss(model, b))
        assert acc.step() is not None
        if len(old) < 6:
            old += [weakref.ref(p) for p in model.head.parameters()]
            model.head = nn.Linear(8, 3).to(torch.bfloat16)
            optimizer.param_groups[0]["params"] = list(model.parameters())
    gc.collect()
    assert [r() is None for r in old] == [True] * len(old)
    assert {id(p) for p in acc.params} == {id(p) for p in model.parameters()}
    acc.close()


def _fsdp2_case(rank: int, world: int, out) -> dict:
    """An FSDP2 model (``fully_shard`` per block and the root) on the gloo ranks, one window in; then
    ``model.load_state_dict(copies of its own state dict, assign=True)`` (new DTensor parameters, which FSDP2 takes
    as its sharded parameters) at a window start and in the middle of the next window, each time the next
    ``backward()`` tried (its message, or "accepted", and the window's micro-batches before and after it) and the
    original parameters put back (``assign=True`` of the objects the accumulator holds): the window then completes."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from tests.models import ThreeBlocks  # noqa: PLC0415

    torch.manual_seed(0)
    model = ThreeBlocks(6, 8, 5)
    mesh = init_device_mesh("cpu", (world,))
    for block in (model.l0, model.l1, model.head, model.side):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=K,
                                       max_grad_norm=None, backend="torch")
    g = torch.Generator().manual_seed(11 + rank)
    x = [torch.randn(4, 6, generator=g) for _ in range(2 * K)]
    for b in x[:K]:
        acc.backward(model(b).pow(2).mean())
    assert acc.step() is not None
    originals = dict(model.named_parameters())
    result = {}
    for where, b in (("window start", x[K]), ("mid-window", x[K + 1])):
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
        before = acc.num_micro_batches
        try:
            acc.backward(model(b).pow(2).mean())
            result[where] = ("accepted", before, acc.num_micro_batches)
        except ValueError as exc:
            result[where] = (str(exc), before, acc.num_micro_batches)
        model.load_state_dict(originals, assign=True)  # the way on: the parameters the accumulator holds, back
        acc.backward(model(b).pow(2).mean())
    result["completed"] = acc.step() is not None
    acc.close()
    return result


@pytest.mark.multiproc
def test_fsdp2_replacement_is_refused_naming_the_parameter(tmp_path):
    """2 gloo ranks, an FSDP2 model: ``load_state_dict(assign=True)`` puts new DTensor parameters in the model, which
    FSDP2 takes for its own (and gaengine's hooks are on the old ones). The next ``backward()`` raises on every rank
    naming a parameter, at a window start and mid-window, nothing accumulated (FSDP2's layout is not rebuilt for a
    replacement). Before: not noticed (the new parameters kept FSDP2's raw reduce-scattered ``.grad``)."""
    from tests.ranks import launch_scenario  # noqa: PLC0415

    codes, results = launch_scenario(tmp_path, 2, _fsdp2_case, timeout_s=30, join_s=90)
    assert codes == [0, 0], f"exit codes {codes}"
    for rank, res in enumerate(results):
        assert res.pop("completed"), f"rank {rank}: the window put back did not complete"
        for where, (message, before, after) in res.items():
            assert re.search(r"parameter '(l0|l1|head|side)\.(weight|bias)' is another tensor.*assign=True", message), (
                rank, where, message)
            assert "fsdp2 (fully_shard) does not adopt" in message or "middle of an accumulation window" in message, (
                rank, where, message)
            assert after == before, (rank, where, before, after)
        assert "middle of an accumulation window" in res["mid-window"][0] and res["mid-window"][1] == 1
