"""Whole-matrix owners at ``zero_stage`` 1 and 2 (issue 44, points 2-4; ``gaengine.zero.WholeOwners``): an optimizer
gaengine has no elementwise row for (torch's Muon beside AdamW, Adafactor, schedule-free AdamW) runs on gloo ranks,
each parameter whole on one owner rank, against the same optimizers on one process with the whole batch.

The one process runs the plain recipe over the same global batch: each window's K micro-batches of d ranks' rows
are K x d micro-batches of one rank's rows there (torch DDP's equivalence), ``(loss / (K d)).backward()`` each,
``clip_grad_norm_`` over every parameter, each optimizer's ``step()``. Each micro-batch's gradient is then the same
product of the same rows on both sides (exactly, up to a power-of-two scale, for K d a power of two); what differs is
the order the K d of them are summed in (``split_batch_rtol(K d)``) and each side's clip coefficient from its own
norm (``clipped_grad_rtol``), propagated through the optimizers' updates:

* elementwise-like updates (AdamW, Adafactor, schedule-free AdamW): ``update_rtol``;
* Muon: the momentum's error, at most ``grad_rtol`` of ``||sum_j c_j |g_j| ||_F`` (its coefficients applied to the
  windows' |gradients|, ``Record``), through the Newton–Schulz map's first-order gain AT ITS INPUT (the spectral
  norm of its Jacobian there, fp64 autograd on the reference's own momentum: a property of the data, not a measured
  difference; the worst case over all inputs, ``tests.muon.newton_schulz_gain``, is some 800, far above it), times
  the adjusted learning rate, plus each side's roundings of the fp64 output into fp32 and of the two parameter
  updates. Newton–Schulz runs in fp64 on both sides (``tests.muon``), as in tests/test_optimizer_list.py.

The ranks' runs share one launch per world size (module fixtures): every test reads its part and fails when the launch
does (on c20f3af, before owners, every case here was refused at construction).
"""

from __future__ import annotations

import copy
import functools
import io
import math
import pathlib
import warnings

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn

import gaengine
from tests.helpers import one_thread
from tests.models import MuonLM
from tests.muon import NewtonSchulzCalls, newton_schulz, ns_fp64  # noqa: F401 - a fixture
from tests.ranks import launch_scenario
from tests.tolerances import clipped_grad_rtol, rel_diff, split_batch_rtol, unit_roundoff, update_rtol

K, WINDOWS, MAX_NORM, VOCAB, ROWS, SEQ = 4, 4, 0.05, 17, 2, 5
"""Micro-batches per window, updates, the clipping norm (below every window's gradient norm: each is clipped), the
vocabulary, rows per rank and micro-batch, tokens per row."""
NS = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
U = unit_roundoff(torch.float32)

try:
    import schedulefree
except ImportError:  # an optional dependency (the dev extras)
    schedulefree = None
try:
    import pytorch_optimizer
except ImportError:  # an optional dependency (the dev extras)
    pytorch_optimizer = None


def _model(seed: int = 0, n_hidden: int = 2) -> MuonLM:
    torch.manual_seed(seed)
    return MuonLM(vocab=VOCAB, n_hidden=n_hidden)


def _optimizers(name: str, model: MuonLM) -> list[torch.optim.Optimizer]:
    if name == "muon+adamw":  # torch's recipe: Muon for the 2-D hidden weights, AdamW for the rest
        return model.muon_adamw()
    if name == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    if name == "schedulefree":
        opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, warmup_steps=0)
        opt.train()  # its training mode, as its docs ask
        return [opt]
    if name == "po-lion":  # pytorch-optimizer's classes: no row in gaengine.optimizers, so whole-matrix owners
        return [pytorch_optimizer.Lion(model.parameters(), lr=1e-3, weight_decay=0.01)]
    if name == "po-lamb":
        return [pytorch_optimizer.Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)]
    if name == "po-shampoo":
        return [pytorch_optimizer.Shampoo(model.parameters(), lr=1e-2, momentum=0.9)]
    raise ValueError(name)


CASES = ["muon+adamw", "adafactor"] + (["schedulefree"] if schedulefree is not None else []) + (
    ["po-lion", "po-lamb"] if pytorch_optimizer is not None else [])
EXACT_CASES = ["po-shampoo"] if pytorch_optimizer is not None else []
"""Optimizers whose update is a matrix function of the gradient's statistics with no first-order bound here
(Shampoo's inverse fourth roots of ``G G^T + eps``: its gain is the preconditioners' conditioning). They run where
both sides see the same gradient bits: K = 1 on 2 ranks without clipping, the two ranks' micro-batch gradients
summed once on either side (one addition, commutative) and scaled by 1/2 (exact), so the owner's update must equal
the one process's bit for bit."""


def _batches(n: int, rows: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))
            for _ in range(n)]


def _loss(model, tokens, labels):
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1))


def _train(acc, model, batches, rank, k=K):
    for tokens, labels in batches:
        acc.backward(_loss(model, tokens[rank * ROWS:(rank + 1) * ROWS], labels[rank * ROWS:(rank + 1) * ROWS]))
        if acc.num_micro_batches == k:
            acc.step()


def _state_bytes(opts) -> int:
    """Bytes of every tensor of the optimizers' state (this rank's)."""
    return sum(v.numel() * v.element_size() for o in opts for s in o.state.values() for v in s.values()
               if torch.is_tensor(v))


def _memory(acc, opts) -> int:
    """This rank's optimizer state and fp32 masters, bytes."""
    masters = acc.master_buffer
    return _state_bytes(opts) + (masters.data.numel() * 4 if masters is not None else 0)


def _memory_model() -> MuonLM:
    """A bf16 model of 8 hidden matrices (Muon's) and 2 more (embedding, head: AdamW's): masters exist."""
    return _model(n_hidden=8).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------ the ranks
def _scenario(rank, world, out, stages, cases=tuple(CASES), extras=True, memory=True):
    """Each of ``cases`` at each of ``stages`` on ``world`` gloo ranks (each rank its ROWS rows of every
    micro-batch); with ``extras``, the Newton–Schulz calls counted per run (K = 1 and K = 4); with ``memory``, the
    memory of a bf16 Muon + AdamW model at zero_stage=1 after two updates; on 2 ranks the checkpoints
    (``_checkpoints``)."""
    import torch.distributed.checkpoint as dcp

    calls = NewtonSchulzCalls()
    torch_muon._zeropower_via_newtonschulz = calls
    batches = _batches(K * WINDOWS, world * ROWS)
    results = {}
    for stage in stages:
        for name in cases:
            calls.shapes.clear()
            model = _model()
            opts = _optimizers(name, model)
            acc = gaengine.GradientAccumulator(model, opts, K, max_grad_norm=MAX_NORM, zero_stage=stage)
            _train(acc, model, batches, rank)
            results[(name, stage)] = [p.detach().clone() for p in model.parameters()]
            if name == "schedulefree":  # every rank's eval() / train(), as the trainers call them
                gather = acc.sharding.gather
                issued = gather.gathers_issued
                opts[0].eval()
                results[(name, stage, "eval")] = [p.detach().clone() for p in model.parameters()]
                opts[0].train()
                results[(name, stage, "train")] = [p.detach().clone() for p in model.parameters()]
                switching = gather.gathers_issued - issued
                opts[0].train()  # already training: as HF's Trainer calls it before every step
                results[(name, stage, "gathers")] = (switching, gather.gathers_issued - issued - switching)
            if name == "muon+adamw":  # K = 4: WINDOWS windows
                results[("ns", stage, K)] = list(calls.shapes)
            acc.close()
        for name in EXACT_CASES if world == 2 else ():  # K = 1, no clipping: the same gradient bits
            with one_thread():
                model = _model()
                acc = gaengine.GradientAccumulator(model, _optimizers(name, model), 1, max_grad_norm=None,
                                                   zero_stage=stage)
                _train(acc, model, batches, rank, 1)
                results[(name, stage, "exact")] = [p.detach().clone() for p in model.parameters()]
                acc.close()
        for k in (1,) if extras else ():  # K = 1: 3 windows
            calls.shapes.clear()
            model = _model()
            acc = gaengine.GradientAccumulator(model, model.muon_adamw(), k, max_grad_norm=MAX_NORM,
                                               zero_stage=stage)
            _train(acc, model, _batches(3 * k, world * ROWS), rank, k)
            results[("ns", stage, k)] = list(calls.shapes)
            acc.close()
    if memory:
        model = _memory_model()
        opts = model.muon_adamw()
        acc = gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM, zero_stage=1)
        _train(acc, model, _batches(4, world * ROWS), rank, 2)
        results["memory"] = _memory(acc, opts)
        acc.close()
    if world == 2:
        results.update(_checkpoints(rank, out, batches))
    if world == 3:
        results.update(_refusals(rank, batches))
    return results


def _refusals(rank, batches):
    """What owners refuse, each with its message, nothing changed: a parameter that becomes trainable after
    construction (the layout is made once), and ``gaengine.full_optimizer_state_dict`` (save through DCP)."""
    out = {}
    model = _model()
    model.norm.weight.requires_grad_(False)  # frozen at construction (still in AdamW's group: allowed)
    acc = gaengine.GradientAccumulator(model, model.muon_adamw(), K, max_grad_norm=MAX_NORM, zero_stage=1)
    _train(acc, model, batches[:K], rank)
    try:
        gaengine.full_optimizer_state_dict(acc)
    except TypeError as exc:
        out["export"] = str(exc)
    before = [p.detach().clone() for p in model.parameters()]
    model.norm.weight.requires_grad_(True)
    try:
        _train(acc, model, batches[K:2 * K], rank)
    except ValueError as exc:
        out["join"] = str(exc)
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return out


def _whole_states(acc) -> dict[str, dict]:
    """Per parameter name, the optimizer state this rank holds whole, as its checkpoint saves it (``acc.state_dict()``:
    the owner's, at zero_stage >= 1; every parameter's, replicated)."""
    saved = acc.state_dict()["optimizer"]
    return {key: torch.load(io.BytesIO(entry["whole"]), weights_only=True) for key, entry in saved.items()}


def _checkpoints(rank, out, batches):
    """2 ranks: Muon + AdamW at zero_stage=1 saved through DCP after 2 windows (the states each rank owns
    recorded) and run on to 4 windows; a fresh accumulator resumed from it on the same 2 ranks and run the same 2
    windows; and the one-process checkpoint ``ckpt1`` (zero_stage=0, saved before the launch) loaded at
    zero_stage=2, the states each rank then owns recorded."""
    import torch.distributed.checkpoint as dcp

    out = pathlib.Path(out)
    runs = {}
    for resume in (False, True):
        model = _model()
        opts = model.muon_adamw()
        acc = gaengine.GradientAccumulator(model, opts, K, max_grad_norm=MAX_NORM, zero_stage=1)
        if resume:
            state = {"model": model.state_dict(), "acc": acc.state_dict()}
            dcp.load(state, checkpoint_id=str(out / "ckpt"))
            model.load_state_dict(state["model"])
            acc.load_state_dict(state["acc"])
        else:
            _train(acc, model, batches[:2 * K], rank)
            dcp.save({"model": model.state_dict(), "acc": acc.state_dict()}, checkpoint_id=str(out / "ckpt"))
            runs["saved_states"] = _whole_states(acc)
            runs["owned"] = [sum(len(g["params"]) for g in o.param_groups) for o in opts]
        _train(acc, model, batches[2 * K:], rank)
        runs["resumed" if resume else "uninterrupted"] = [p.detach().clone() for p in model.parameters()]
        acc.close()
    model = _model(seed=7)
    acc = gaengine.GradientAccumulator(model, model.muon_adamw(), K, max_grad_norm=MAX_NORM, zero_stage=2)
    state = {"model": model.state_dict(), "acc": acc.state_dict()}
    dcp.load(state, checkpoint_id=str(out / "ckpt1"))
    model.load_state_dict(state["model"])
    acc.load_state_dict(state["acc"])
    runs["loaded_from_one"] = _whole_states(acc)
    runs["params_from_one"] = [p.detach().clone() for p in model.parameters()]
    return runs


def _one_process_checkpoint(path: pathlib.Path) -> tuple[dict, list[torch.Tensor]]:
    """Muon + AdamW replicated on one process, 2 windows, saved through DCP at ``path``: its whole states and
    parameters."""
    import torch.distributed.checkpoint as dcp

    model = _model(seed=3)
    acc = gaengine.GradientAccumulator(model, model.muon_adamw(), K, max_grad_norm=MAX_NORM)
    _train(acc, model, _batches(2 * K, ROWS), 0)
    dcp.save({"model": model.state_dict(), "acc": acc.state_dict()}, checkpoint_id=str(path))
    return _whole_states(acc), [p.detach().clone() for p in model.parameters()]


def _launch(tmp_path_factory, world, stages, **kwargs):
    tmp = tmp_path_factory.mktemp(f"owners{world}")
    if world == 2:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            torch.save(_one_process_checkpoint(tmp / "ckpt1"), tmp / "one.pt")
    codes, results = launch_scenario(tmp, world, functools.partial(_scenario, stages=stages, **kwargs), join_s=300)
    return codes, results, tmp


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2, (1, 2))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 4, (2,), cases=("muon+adamw",), extras=False)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 3, (1,), cases=("muon+adamw",), extras=False, memory=False)


def test_owners_refuse_a_joining_parameter_and_the_export(three_ranks):
    """3 ranks at zero_stage=1 with Muon + AdamW: a parameter unfrozen after construction is refused naming it
    (owners lay the parameters out once) with the parameters as they were; ``gaengine.full_optimizer_state_dict``
    raises ``TypeError`` naming DCP instead (each owner holds its parameters' whole state)."""
    for result in _ok(three_ranks):
        assert "'norm.weight' became trainable" in result["join"] and "lays its parameters out once" in result["join"] \
            and "owner rank" in result["join"] and "adopts it at every zero_stage" not in result["join"]
        assert result["unchanged"]
        assert "torch.distributed.checkpoint" in result["export"] and "owner" in result["export"]


def _ok(launched):
    codes, results, _ = launched
    assert codes == [0] * len(codes), f"a rank failed: exit codes {codes}"
    return results


# ------------------------------------------------------------------------------------------------ the reference
class Record:
    """What the reference run tells the Muon bound, per Muon matrix (by name): per update, the Frobenius norm of
    ``sum_j c_j |g_j|`` over the windows so far (the momentum's coefficients on the |gradients|, torch's nesterov
    momentum), the spectral norm of the Newton–Schulz map's Jacobian at its input (the normalization included),
    and the largest entry of its output; per parameter, its largest step."""

    def __init__(self) -> None:
        self.abs_input: dict[str, list[float]] = {}
        self.jacobian: dict[str, list[float]] = {}
        self.output: dict[str, list[float]] = {}
        self.steps: dict[str, float] = {}


def _jacobian_norm(x: torch.Tensor) -> float:
    """The spectral norm of the Jacobian of ``ns_fp64`` (torch's Newton–Schulz, its input normalized) at ``x``."""
    x = x.detach().double()
    jac = torch.autograd.functional.jacobian(
        lambda v: ns_fp64(v.view(x.shape), NS, torch_muon.DEFAULT_NS_STEPS, 1e-7).reshape(-1), x.reshape(-1),
        vectorize=True)
    return float(torch.linalg.matrix_norm(jac, 2))


def plain_recipe(name: str, world: int, record: Record | None = None) -> MuonLM:
    """The same optimizers on one process over the whole batch (module docstring)."""
    model = _model()
    opts = _optimizers(name, model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = opts[0] if isinstance(opts[0], torch.optim.Muon) else None
    abs_buf = {}
    it = iter(_batches(K * WINDOWS, world * ROWS))
    for _ in range(WINDOWS):
        for _ in range(K):
            tokens, labels = next(it)
            for r in range(world):
                (_loss(model, tokens[r * ROWS:(r + 1) * ROWS], labels[r * ROWS:(r + 1) * ROWS]) / (K * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if muon is not None and record is not None:
            mu = muon.param_groups[0]["momentum"]
            for p in muon.param_groups[0]["params"]:
                g, n = p.grad.detach(), names[id(p)]
                buf = muon.state.get(p, {}).get("momentum_buffer", torch.zeros_like(p)).lerp(g, 1 - mu)
                x = g.lerp(buf, mu)
                a = abs_buf[n] = abs_buf.get(n, torch.zeros_like(p)).lerp(g.abs(), 1 - mu)
                record.abs_input.setdefault(n, []).append(float(g.abs().lerp(a, mu).norm()))
                record.jacobian.setdefault(n, []).append(_jacobian_norm(x))
                record.output.setdefault(n, []).append(float(ns_fp64(x, NS, torch_muon.DEFAULT_NS_STEPS, 1e-7)
                                                             .abs().max()))
        for o in opts:
            o.step()
            o.zero_grad()
        if record is not None:
            for n, p in model.named_parameters():
                record.steps[n] = max(record.steps.get(n, 0.0), float((p.detach() - before[n]).abs().max()))
    model.optimizers = opts  # for the calls after training (schedule-free's eval(): _eval_reference)
    return model


@functools.cache
def _reference(name: str, world: int) -> tuple[MuonLM, Record]:
    """``plain_recipe`` and its ``Record``, once per case and world size (the tests that call it patch Newton–Schulz
    in: the ``newton_schulz`` fixture)."""
    assert isinstance(torch_muon._zeropower_via_newtonschulz, NewtonSchulzCalls), "use the newton_schulz fixture"
    record = Record()
    return plain_recipe(name, world, record), record


def _lr_adjusted(p: torch.Tensor, lr: float = 0.02) -> float:
    """torch's Muon ``adjust_lr_fn=None`` ("original"): lr * sqrt(max(1, rows / cols))."""
    rows, cols = p.shape
    return lr * math.sqrt(max(1.0, rows / cols))


def muon_rtol(q: torch.Tensor, name: str, record: Record, grad_rtol: float) -> float:
    """A Muon matrix after WINDOWS updates, relative to max |q| (module docstring): per update the momentum's
    Frobenius error ``grad_rtol * abs_input`` through the Jacobian's norm, the fp64 output's rounding into the fp32
    update on each side (u of its largest entry), times the adjusted learning rate; and each side's two roundings at
    |p| (the decay and the subtraction). First order; the gradients' dependence on parameters that already differ is
    neglected, as in ``update_rtol``: valid for a few updates."""
    lr = _lr_adjusted(q)
    scale = float(q.detach().abs().max())
    total = 0.0
    for a, j, o in zip(record.abs_input[name], record.jacobian[name], record.output[name]):
        total += lr * (j * grad_rtol * a + 2 * U * o) + 2 * 2 * U * scale
    return total / scale


def _grad_rtol(world: int, n: int) -> float:
    """The window gradients of the two sides: K x world micro-batch gradients summed in another order
    (``split_batch_rtol``), each side's clip coefficient from its own norm (``clipped_grad_rtol``)."""
    return split_batch_rtol(K * world) + clipped_grad_rtol(n)


def _assert_matches(params: list[torch.Tensor], name: str, world: int, label: str,
                    against: list[torch.Tensor] | None = None) -> dict[str, float]:
    """``params`` against the reference's (or ``against``, a point of the same run: schedule-free's x) within the
    derived bound of each parameter."""
    reference, record = _reference(name, world)
    n = sum(p.numel() for p in reference.parameters())
    grad_rtol = _grad_rtol(world, n)
    muon = {f"hidden.{i}.weight" for i in range(len(reference.hidden))} if name == "muon+adamw" else set()
    measured = {}
    wanted = against if against is not None else [q for _, q in reference.named_parameters()]
    for (pname, _), q, p in zip(reference.named_parameters(), wanted, params):
        if pname in muon:
            rtol = muon_rtol(q, pname, record, grad_rtol)
        else:
            rtol = update_rtol(WINDOWS, record.steps[pname] / float(q.detach().abs().max()), grad_rtol)
        measured[pname] = rel_diff(p, q)
        print(f"{label} {pname}: {measured[pname]:.3g} <= {rtol:.3g}")
        assert measured[pname] <= rtol, f"{label} {pname}: {measured[pname]:.3g} > {rtol:.3g}"
    return measured


# ------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", CASES)
def test_two_ranks_equal_one_process(newton_schulz, two_ranks, name, stage):
    """2 gloo ranks, each parameter whole on its owner, K = 4, every window clipped, 4 updates: every rank's model
    equals the same optimizers on one process with the whole batch within the derived bound."""
    results = _ok(two_ranks)
    for rank, result in enumerate(results):
        _assert_matches(result[(name, stage)], name, 2, f"{name} zero_stage={stage} rank {rank}")


def _exact_reference(name: str, n: int) -> MuonLM:
    """``name``'s optimizer on one process over 2 ranks' rows: K = 1, no clipping, ``(loss / 2).backward()`` per
    rank's rows, one ``step()`` per window."""
    model = _model()
    [opt] = _optimizers(name, model)
    for tokens, labels in _batches(n, 2 * ROWS):
        for r in range(2):
            (_loss(model, tokens[r * ROWS:(r + 1) * ROWS], labels[r * ROWS:(r + 1) * ROWS]) / 2).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.skipif(schedulefree is None, reason="schedulefree is not installed (the dev extras)")
@pytest.mark.parametrize("stage", [1, 2])
def test_schedule_free_eval_and_train_reach_every_ranks_model(newton_schulz, two_ranks, stage):
    """Schedule-free AdamW under owners on 2 gloo ranks: after training, ``optimizer.eval()`` on every rank leaves
    every rank's whole model at the averaged point x, and ``train()`` back at y, as the one process's optimizer does
    (each rank's own parameters and the other rank's, gathered), within the same derived bound as the training; a
    ``train()`` that changes nothing issues no all-gather. Before, each rank moved only the parameters it owns: the
    others stayed at y."""
    reference, _ = _reference("schedulefree", 2)
    averaged = copy.deepcopy(reference)  # the model and its optimizer together: eval() on the copy
    averaged.optimizers[0].eval()
    moved = max(rel_diff(p, q) for p, q in zip(averaged.parameters(), reference.parameters()))
    for rank, result in enumerate(_ok(two_ranks)):
        _assert_matches(result[("schedulefree", stage, "eval")], "schedulefree", 2,
                        f"eval zero_stage={stage} rank {rank}", against=list(averaged.parameters()))
        _assert_matches(result[("schedulefree", stage, "train")], "schedulefree", 2,
                        f"train zero_stage={stage} rank {rank}")
        switching, repeated = result[("schedulefree", stage, "gathers")]
        assert switching > 0 and repeated == 0, (switching, repeated)  # a train() that changes nothing gathers nothing
    assert moved > 1e-4, moved  # eval() moves the parameters far beyond the bound: the test can tell


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", EXACT_CASES)
def test_two_ranks_equal_one_process_bit_for_bit_on_the_same_gradients(two_ranks, name, stage):
    """``EXACT_CASES`` (pytorch-optimizer's Shampoo) on 2 gloo ranks, K = 1, no clipping, 16 updates, each parameter
    whole on its owner: every rank's model equals the one process's bit for bit (the same gradient bits reach the
    same update)."""
    with one_thread():
        reference = _exact_reference(name, K * WINDOWS)
    for rank, result in enumerate(_ok(two_ranks)):
        for (pname, q), p in zip(reference.named_parameters(), result[(name, stage, "exact")]):
            assert torch.equal(p, q.detach()), f"{name} zero_stage={stage} rank {rank} {pname}: {rel_diff(p, q):.3g}"


def test_four_ranks_equal_one_process(newton_schulz, four_ranks):
    """4 gloo ranks at zero_stage=2 (the fp32 gradient sums sharded too: each owner's whole matrices)."""
    results = _ok(four_ranks)
    for rank, result in enumerate(results):
        _assert_matches(result[("muon+adamw", 2)], "muon+adamw", 4, f"zero_stage=2 rank {rank}")


def test_three_ranks_equal_one_process(newton_schulz, three_ranks):
    """An odd world size at zero_stage=1: the owners and the segments' padding (pad_unit(3) / 3 elements) as on any
    other."""
    results = _ok(three_ranks)
    for rank, result in enumerate(results):
        _assert_matches(result[("muon+adamw", 1)], "muon+adamw", 3, f"zero_stage=1 rank {rank}")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("k", [1, 4])
def test_newton_schulz_runs_once_per_window_per_matrix(two_ranks, stage, k):
    """Over the ranks, Newton–Schulz runs windows x matrices times (3 windows at K = 1, WINDOWS at K = 4; 2
    matrices), whatever K is: each matrix on its owner only, once per window, never per micro-batch."""
    results = _ok(two_ranks)
    shapes = sorted(s for result in results for s in result[("ns", stage, k)])
    model = _model()
    windows = {1: 3, K: WINDOWS}[k]
    assert shapes == sorted(tuple(p.shape) for _ in range(windows) for p in model.hidden_matrices())
    assert all(result[("ns", stage, k)] for result in results), "each rank owns one matrix of the two"


@pytest.mark.parametrize("world", [2, 4])
def test_state_and_masters_per_rank_are_one_over_d(request, world):
    """zero_stage=1, Muon + AdamW on a bf16 model of 10 matrices: each rank's optimizer state and fp32 masters are
    within 10 % of 1/d of the replicated run's (one process: a replicated rank holds the same)."""
    results = _ok(request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[world]))
    model = _memory_model()
    opts = model.muon_adamw()
    acc = gaengine.GradientAccumulator(model, opts, 2, max_grad_norm=MAX_NORM)
    _train(acc, model, _batches(4, ROWS), 0, 2)
    replicated = _memory(acc, opts)
    ratios = [r["memory"] * world / replicated for r in results]
    print(f"d={world}: replicated {replicated} B, per rank {[r['memory'] for r in results]} B, d x ratio {ratios}")
    assert all(0.9 <= x <= 1.1 for x in ratios), ratios


def _assert_states_equal(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].keys() == want[key].keys(), key
        for k, v in want[key].items():
            assert torch.equal(torch.as_tensor(got[key][k]), torch.as_tensor(v)), (key, k)


def test_checkpoint_resumes_bit_for_bit_on_the_same_ranks(two_ranks):
    """zero_stage=1 on 2 ranks, saved through DCP after 2 windows and resumed into a fresh accumulator: the next 2
    windows equal the uninterrupted run bit for bit (every Muon matrix's momentum came back to its owner)."""
    results = _ok(two_ranks)
    assert sorted(r["owned"] for r in results) == [[1, 3], [1, 4]], "one Muon matrix per rank"
    for result in results:
        for a, b in zip(result["resumed"], result["uninterrupted"]):
            assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as documented
@pytest.mark.parametrize("stage", [0, 1])
def test_checkpoint_reshards_two_ranks_to_one(two_ranks, stage):
    """The 2-rank zero_stage=1 checkpoint loaded on one process (zero_stage 0, and 1, which shards nothing there):
    every parameter's optimizer state is the one its owner saved, bit for bit, and the model the saved one."""
    import torch.distributed.checkpoint as dcp

    results = _ok(two_ranks)
    saved = {key: v for r in results for key, v in r["saved_states"].items()}
    model = _model(seed=5)
    acc = gaengine.GradientAccumulator(model, model.muon_adamw(), K, max_grad_norm=MAX_NORM, zero_stage=stage)
    state = {"model": model.state_dict(), "acc": acc.state_dict()}
    dcp.load(state, checkpoint_id=str(two_ranks[2] / "ckpt"))
    model.load_state_dict(state["model"])
    acc.load_state_dict(state["acc"])
    _assert_states_equal(_whole_states(acc), saved)
    model2 = _model()
    acc2 = gaengine.GradientAccumulator(model2, model2.muon_adamw(), K, max_grad_norm=MAX_NORM)
    _train(acc2, model2, _batches(2 * K, 2 * ROWS), 0)  # not the ranks' run: only the keys and shapes matter
    assert _whole_states(acc).keys() == _whole_states(acc2).keys()


def test_checkpoint_reshards_one_process_to_two_ranks(two_ranks):
    """A one-process (replicated) checkpoint loaded at zero_stage=2 on 2 ranks: each owner holds its parameters'
    saved state bit for bit, the ranks together every parameter's once, and every rank the saved model."""
    results = _ok(two_ranks)
    states, params = torch.load(two_ranks[2] / "one.pt")
    got = [r["loaded_from_one"] for r in results]
    assert not set(got[0]) & set(got[1])
    _assert_states_equal({k: v for g in got for k, v in g.items()}, states)
    for result in results:
        for a, b in zip(result["params_from_one"], params):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ the layout alone
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_owner_layout_holds_each_parameter_whole_on_one_rank(world):
    """``owner_layout``: every parameter lies whole in exactly one rank's range of its bucket (``param_shards`` gives
    its owner ``[0, numel)`` and every other rank nothing), the owners are the ones returned, each bucket's rank
    ranges are a multiple of ``pad_unit(d) / d``, and a rank's part of a bucket exceeds the bucket's mean by at
    most its largest parameter (Graham's bound for largest-first onto the least loaded)."""
    from gaengine.buffer import ALIGN_NUMEL
    from gaengine.zero import owner_layout, pad_unit, zero_order

    params = zero_order([torch.empty(n) for n in (700, 33, 4096, 5, 64, 1000, 128)]
                        + [torch.empty(s, dtype=torch.bfloat16) for s in ((16, 8), (8, 16), (17, 8))])
    layout, order, owners = owner_layout(params, 0.001, world)
    assert sorted(map(id, order)) == sorted(map(id, params))
    assert [p.dtype for p in order] == [p.dtype for p in params]  # grouped as given
    per_rank = [layout.param_shards(r) for r in range(world)]
    for i, p in enumerate(order):
        held = [r for r in range(world) if per_rank[r][i].numel]
        assert held == [owners[i]]
        assert (per_rank[owners[i]][i].lo, per_rank[owners[i]][i].hi) == (0, p.numel())
    for b in layout.buckets:
        assert b.shard_numel % (pad_unit(world) // world) == 0
        sizes = [sum(-(-order[i].numel() // ALIGN_NUMEL) * ALIGN_NUMEL for i in range(b.first, b.last)
                     if owners[i] == r) for r in range(world)]
        largest = max(order[i].numel() for i in range(b.first, b.last))
        assert max(sizes) <= sum(sizes) / world + largest + ALIGN_NUMEL
    again = owner_layout(params, 0.001, world)
    assert again[0] == layout and again[2] == owners  # deterministic: every rank computes the same


def test_owner_layout_refuses_bad_input():
    from gaengine.zero import owner_layout

    with pytest.raises(ValueError, match="world_size must be >= 1"):
        owner_layout([torch.empty(3)], 1.0, 0)
    mixed = [torch.empty(3), torch.empty(3, dtype=torch.bfloat16), torch.empty(3)]
    with pytest.raises(ValueError, match="grouped by dtype"):
        owner_layout(mixed, 1.0, 2)
