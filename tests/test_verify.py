"""verify_equivalence: passes where accumulation equals the large batch, fails on the classic pitfalls,
tells an engine bug from rounding in every dtype, and leaves the model (grads, buffers, modes, RNG) exactly
as it was."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

import gaengine
from gaengine.utils import split_batch
from gaengine.verify import GRAD_RTOL, EquivalenceReport, verify_equivalence
from tests.conftest import seeded_randn
from tests.helpers import ENGINE_BUGS, plant_engine_bug
from tests.models import MLP, TinyLM, BNNet, TiedPair as _TiedLinears
from tests.tolerances import RTOL, mean_rtol, network_rtol

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _regression(n_rows=24, d_in=12, d_out=5, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return seeded_randn(n_rows, d_in, generator=gen).to(dtype), seeded_randn(n_rows, d_out, generator=gen).to(dtype)


class DropNet(MLP):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.fc1(x))))


def _snapshot(model):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def _assert_unchanged(model, snap):
    for n, p in model.named_parameters():
        assert torch.equal(p, snap["params"][n]), n
        obj, values = snap["grads"][n]
        assert p.grad is obj, f"{n}: .grad is not the same tensor object"
        if values is not None:
            assert torch.equal(p.grad, values), n
    for n, b in model.named_buffers():
        assert torch.equal(b, snap["buffers"][n]), n
    assert {n: m.training for n, m in model.named_modules()} == snap["modes"]
    assert torch.equal(torch.get_rng_state(), snap["rng"])


# ---------------------------------------------------------------- equivalent setups pass
@pytest.mark.parametrize("n_rows,k,mode", [(24, 4, "mean"), (23, 4, "rows"), (24, 1, "mean"), (7, 7, "mean")],
                         ids=["even", "uneven", "k1", "one-row-each"])
def test_mlp_passes(backend, n_rows, k, mode):
    torch.manual_seed(0)
    model = MLP()
    report = verify_equivalence(model, _mse, _regression(n_rows), k, backend=backend)
    assert isinstance(report, EquivalenceReport)
    assert report.passed, str(report)
    assert report.mode == mode and sum(report.micro_batch_sizes) == n_rows and len(report.micro_batch_sizes) == k
    assert [d.name for d in report.parameters] == [n for n, _ in model.named_parameters()]
    assert report.max_rel <= GRAD_RTOL[torch.float32] and report.failed == []  # the library's documented threshold
    assert report.engine_passed and report.engine_badness <= 1
    # Two fp32 forward passes of the MLP (3 layers, width 24) over differently shaped batches, squared (twice the
    # outputs' error) and averaged over n_rows * 5 terms in two ways.
    loss_rtol = 2 * 2 * network_rtol(3, 24, products_per_layer=1) + 2 * mean_rtol(n_rows * 5)
    assert math.isclose(report.engine_loss, report.reference_loss, rel_tol=loss_rtol)


def test_item_mode_token_counts_pass_and_mean_of_means_fails():
    """Padded sequences: a summed loss over real tokens with num_items_fn is exact; a per-micro-batch token
    mean (the naive recipe) is not, because the micro-batches hold different numbers of real tokens."""
    torch.manual_seed(3)
    model = TinyLM()
    tokens = torch.randint(0, 17, (6, 7))
    labels = torch.randint(0, 17, (6, 7))
    for row, n_real in enumerate([7, 7, 2, 1, 5, 6]):
        labels[row, n_real:] = -100
    batch = {"tokens": tokens, "labels": labels}

    def loss_sum(m, b):
        logits = m(b["tokens"])
        return nn.functional.cross_entropy(logits.reshape(-1, 17), b["labels"].reshape(-1), ignore_index=-100,
                                           reduction="sum")

    def token_mean(m, b):
        logits = m(b["tokens"])
        return nn.functional.cross_entropy(logits.reshape(-1, 17), b["labels"].reshape(-1), ignore_index=-100)

    report = verify_equivalence(model, loss_sum, batch, 3, num_items_fn=lambda b: (b["labels"] != -100).sum(),
                                backend="torch")
    assert report.passed and report.mode == "items", str(report)
    naive = verify_equivalence(model, token_mean, batch, 3, backend="torch")
    assert not naive.passed and naive.mode == "mean"
    assert naive.max_rel > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_model_passes_with_its_tolerance(dtype):
    torch.manual_seed(0)
    model = MLP().to(dtype)
    report = verify_equivalence(model, _mse, _regression(64, dtype=dtype), 4, backend="torch")
    assert report.passed, str(report)
    assert all(d.rtol == GRAD_RTOL[dtype] for d in report.parameters)
    assert report.max_rel > 0  # not bitwise: the tolerance is doing work
    # rtol=1e-7: not a bound of ours but a setup tolerance far below one rounding of the model's dtype, to fail it.
    strict = verify_equivalence(model, _mse, _regression(64, dtype=dtype), 4, backend="torch", rtol=1e-7)
    assert not strict.passed and strict.engine_passed and not strict.setup_passed  # rtol= is the setup's alone
    assert str(strict).startswith("gradient equivalence FAILED: the setup is not equivalent to the whole batch")


# ---------------------------------------------------------------- the pitfalls fail
def test_batchnorm_in_train_mode_fails():
    torch.manual_seed(0)
    model = BNNet().train()
    report = verify_equivalence(model, _mse, _regression(32), 4, backend="torch")
    assert not report.passed
    assert report.max_rel > 1e-3  # far outside the fp32 tolerance, not a rounding effect
    assert "fc.weight" in report.failed and "head.weight" in report.failed
    # The bias in front of BatchNorm has a zero gradient in exact arithmetic: all roundoff, judged as such.
    assert "fc.bias" not in report.failed
    # Eval mode uses the running statistics: no dependence on the other rows, equivalent again.
    model.eval()
    assert verify_equivalence(model, _mse, _regression(32), 4, backend="torch").passed


def test_summed_loss_treated_as_mean_fails():
    """reduction='sum' without num_items: the engine averages the K micro-batch sums, off by a factor K."""
    torch.manual_seed(0)
    model = MLP()

    def sse(m, b):
        return ((m(b[0]) - b[1]) ** 2).sum()

    report = verify_equivalence(model, sse, _regression(24), 4, backend="torch")
    assert not report.passed and len(report.failed) == len(report.parameters)
    assert all(math.isclose(d.max_rel, 0.75, rel_tol=1e-4) for d in report.parameters)  # 1 - 1/K
    fixed = verify_equivalence(model, sse, _regression(24), 4, num_items_fn=lambda b: b[0].shape[0], backend="torch")
    assert fixed.passed, str(fixed)


def test_dropout_with_different_rng_fails():
    """Each call of the loss draws augmentation noise first, so the micro-batches' dropout masks come from a
    different part of the RNG stream than the whole batch's."""
    torch.manual_seed(0)
    model = DropNet().train()

    def noisy_loss(m, b):
        x, y = b
        x = x + 0.01 * torch.randn(3, x.shape[1])[:1]  # consumes RNG per call, not per row
        return ((m(x) - y) ** 2).mean()

    snap = _snapshot(model)
    report = verify_equivalence(model, noisy_loss, _regression(24), 4, backend="torch")
    assert not report.passed
    _assert_unchanged(model, snap)
    model.eval()
    # Without dropout the per-call noise alone still differs; without the noise, eval mode is equivalent.
    assert not verify_equivalence(model, noisy_loss, _regression(24), 4, backend="torch").passed
    assert verify_equivalence(model, _mse, _regression(24), 4, backend="torch").passed


def test_nan_gradient_fails():
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    report = verify_equivalence(model, _mse, _regression(8), 2, backend="torch")
    assert not report.passed and report.worst in report.failed


# ---------------------------------------------------------------- engine bugs are told from rounding, in every dtype
K = 4
BUGS = ENGINE_BUGS


def _plain_micro_grads(model, batch, k):
    """Plain PyTorch: each micro-batch's ``loss.backward()`` on its own, the gradients as autograd produces them
    (the parameters' dtype). The model's ``.grad`` are left None."""
    grads = []
    for mb in split_batch(batch, k):
        model.zero_grad(set_to_none=True)
        _mse(model, mb).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return grads


def _expected_engine_grad(micro_grads, name, dtype, bug):
    """The final ``.grad`` a correct (bug=None) or planted-bug engine gives, simulated in fp32 from the
    micro-batch gradients: a sum in order, the scale 1/K (exact for K = 4), one rounding to ``dtype``; fp64."""
    terms = [g[name].float() for g in micro_grads]
    if bug == "dropped-micro-batch":
        del terms[1]
    total = torch.zeros_like(terms[0])
    for t in terms:
        total = total + t
        if bug == "bf16-sum":
            total = total.bfloat16().float()
    scale = {"divided-twice": 1 / K**2, "not-divided": 1.0}.get(bug, 1 / K)
    return (total * scale).to(dtype).double()


@pytest.mark.parametrize("bug", [None, *BUGS], ids=["correct", *BUGS])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_engine_bugs_fail_and_rounding_passes(monkeypatch, dtype, bug):
    """The engine comparison passes a correct engine in every dtype (the difference it measures is nonzero in
    bf16/fp16: the bound does work) and fails each planted bug. Its measured difference is checked against an
    independent plain-PyTorch oracle, the micro-batch gradients summed in fp64 and the engine simulated in fp32."""
    torch.manual_seed(0)
    model = MLP().to(dtype)
    batch = _regression(64, dtype=dtype)
    micro_grads = _plain_micro_grads(model, batch, K)
    if bug is not None:
        plant_engine_bug(monkeypatch, bug)
    report = verify_equivalence(model, _mse, batch, K, backend="torch")

    assert report.setup_passed, str(report)  # the setup is fine: a planted bug is the engine's alone
    assert report.passed == report.engine_passed == (bug is None), str(report)
    for d in report.parameters:
        exact = sum(g[d.name].double() for g in micro_grads) / K  # the plain recipe, summed without rounding
        expected = _expected_engine_grad(micro_grads, d.name, dtype, bug)
        assert math.isclose(d.engine_max_abs, (expected - exact).abs().max().item(), rel_tol=1e-9), d.name
        if bug is None:
            # An independent rounding budget: one rounding to dtype plus K fp32 ulps of the terms.
            budget = RTOL[dtype] * exact.abs().max().item() + 2 * K * RTOL[torch.float32] * max(
                g[d.name].double().abs().max().item() for g in micro_grads)
            assert d.engine_max_abs <= budget, d.name
        elif bug in ("divided-twice", "not-divided"):  # off by a factor K: far outside any rounding
            assert d.engine_max_abs >= 0.5 * exact.abs().max().item(), d.name
    if bug is None:
        assert report.engine_badness <= 1
        assert (report.engine_badness > 0.5) == (dtype != torch.float32)  # low precision: near its bound
    else:
        assert report.engine_badness > 2 and report.failed
        assert str(report).startswith("gradient equivalence FAILED: the engine's accumulation is wrong (beyond "
                                      "rounding)\n")
        assert report.worst in report.failed


def _tied_loss(model, batch):
    idx, target = batch
    return nn.functional.cross_entropy(model(idx).float(), target)


@pytest.mark.parametrize("bug", [None, "not-divided"], ids=["correct", "not-divided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fusion_engine_passes_with_the_layers_terms_and_fails_a_planted_bug(monkeypatch, dtype, bug):
    """With gradient_accumulation_fusion the fused layers' terms (taken from their inputs and output gradients) make
    the micro-batch sum: a correct engine passes in fp32 and bf16, also for the tied embedding (one term fused, one
    through AccumulateGrad), and its measured difference is within the independent rounding budget of
    test_engine_bugs_fail_and_rounding_passes (the plain recipe's micro-batch gradients from autograd, an oracle
    independent of both hooks); a window coefficient never applied fails."""
    gen = torch.Generator().manual_seed(3)
    model = _TiedLinears().to(dtype)
    batch = (torch.randint(0, 10, (16,), generator=gen), torch.randint(0, 10, (16,), generator=gen))
    micro = split_batch(batch, K)
    plain = []
    for mb in micro:  # the plain recipe's micro-batch gradients, in the parameters' dtype
        model.zero_grad(set_to_none=True)
        _tied_loss(model, mb).backward()
        plain.append({n: p.grad.double() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    if bug is not None:
        monkeypatch.setattr(type(gaengine.backends.get_backend("cpu", torch.device("cpu"))), "scale_",
                            lambda self, x, coef: x)
    report = verify_equivalence(model, _tied_loss, batch, K, backend="cpu", gradient_accumulation_fusion=True)
    assert report.setup_passed, str(report)
    assert report.engine_passed == (bug is None), str(report)
    assert all("forward" not in m.__dict__ for m in model.modules())  # the accumulator closed
    if bug is None:
        for d in report.parameters:  # as test_engine_bugs_fail_and_rounding_passes: one rounding to dtype plus
            exact = sum(g[d.name] for g in plain) / K  # 2K fp32 ulps of the terms (here 4 rows per fused GEMM)
            budget = RTOL[dtype] * exact.abs().max().item() + 2 * K * RTOL[torch.float32] * max(
                g[d.name].abs().max().item() for g in plain)
            assert d.engine_max_abs <= budget, d.name


# ---------------------------------------------------------------- the model is left exactly as it was
def test_grads_buffers_modes_and_rng_restored():
    torch.manual_seed(0)
    model = BNNet().train()
    model.head.eval()  # a mixed mode must survive too
    for i, p in enumerate(model.parameters()):
        if i % 2 == 0:
            p.grad = torch.randn_like(p)  # a half-accumulated window of the user's own loop
    model(torch.randn(5, 12))  # move the running statistics off their initial values
    snap = _snapshot(model)
    report = verify_equivalence(model, _mse, _regression(16), 4, backend="torch")
    assert not report.passed
    _assert_unchanged(model, snap)
    assert any(p.grad is None for p in model.parameters())


def test_model_restored_when_loss_fn_raises():
    torch.manual_seed(0)
    model = BNNet().train()
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    snap = _snapshot(model)
    calls = []

    def flaky(m, b):
        calls.append(b[0].shape[0])
        if len(calls) == 3:  # the second micro-batch, after the reference and one accumulated micro-batch
            raise RuntimeError("boom")
        return _mse(m, b)

    with pytest.raises(RuntimeError, match="boom"):
        verify_equivalence(model, flaky, _regression(16), 4, backend="torch")
    _assert_unchanged(model, snap)
    # The accumulator was closed: the parameters can be checked again and taken by a new accumulator,
    # which still gives its once-per-model BatchNorm warning (verify_equivalence did not use it up).
    assert verify_equivalence(model, _mse, _regression(16), 4, backend="torch").passed is False
    with pytest.warns(UserWarning, match="BatchNorm"):
        gaengine.GradientAccumulator(model, None, accumulation_steps=2).close()


def test_frozen_and_unused_parameters():
    class Partial(MLP):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(3, 3)

    torch.manual_seed(0)
    model = Partial()
    model.fc1.requires_grad_(False)
    report = verify_equivalence(model, _mse, _regression(12), 3, backend="torch")
    names = [d.name for d in report.parameters]
    assert "fc1.weight" not in names and "unused.weight" in names
    assert report.passed, str(report)
    unused = next(d for d in report.parameters if d.name == "unused.weight")
    assert unused.max_abs == 0 and unused.passed
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- report rendering
def test_report_table_and_str():
    torch.manual_seed(0)
    report = verify_equivalence(BNNet(), _mse, _regression(10), 3, backend="torch")
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "gradient equivalence FAILED: the setup is not equivalent to the whole batch"
    assert "[4, 3, 3] rows" in lines[1] and "mode 'rows'" in lines[1]
    assert lines[2] == "  engine vs the micro-batch gradients summed in fp64: ok"
    assert lines[4].endswith("K = 3, u = 2^-24 (fp32)")
    assert lines[5].startswith("  whole batch vs the micro-batches: FAIL in ")
    assert lines[6].startswith(f"    worst {report.worst!r} at ") and lines[7].endswith("rtol = 1.0e-05 (fp32)")
    assert re.split(r"\s{2,}", lines[8]) == list(TABLE_COLUMNS)
    assert lines[10 + len(report.parameters)].startswith("max |diff|: ")  # the legend follows the rows
    row = next(line for line in lines if line.startswith("fc.weight"))
    assert "16x12" in row and "fp32" in row and row.endswith("FAIL")
    assert report.table() in text and report.summary() in text
    ok = verify_equivalence(MLP(), _mse, _regression(8), 2, backend="torch")
    assert str(ok).startswith("gradient equivalence PASSED\n  2 micro-batches of 4 rows")


TABLE_COLUMNS = ("parameter", "shape", "dtype", "max |diff|", "abs bound", "setup/bound", "engine/bound", "result")


def test_table_names_every_column_and_says_what_ok_is_held_to():
    """Issue 34: every column of the table has a name (the verdict's too), each measured one is explained in a
    legend below the table, with what "ok" is held to, and the ratio to the bound is a column of its own, so a bf16
    row at 0.996 of its bound reads as the rounding it is. The ratios are checked against the report's raw
    numbers (max |diff| / abs bound; the engine's badness)."""
    torch.manual_seed(0)
    report = verify_equivalence(BNNet(), _mse, _regression(10), 3, backend="torch")
    lines = report.table().splitlines()
    header, rule = lines[0], lines[1]
    assert re.split(r"\s{2,}", header) == list(TABLE_COLUMNS)
    assert len(rule.split()) == len(TABLE_COLUMNS)  # one rule per column: none without a name
    rows, legend = lines[2:2 + len(report.parameters)], lines[2 + len(report.parameters):]
    for d, row in zip(report.parameters, rows):
        cells = re.split(r"\s{2,}", row)
        assert len(cells) == len(TABLE_COLUMNS) and cells[0] == d.name
        # the table prints 3 significant digits (".3g"): half a unit in the third, relative to a leading digit >= 1
        digits_rtol = 0.5 * 10.0 ** (1 - 3)
        assert float(cells[5]) == pytest.approx(d.max_abs / d.bound, rel=digits_rtol)
        assert float(cells[6]) == pytest.approx(d.engine_badness, rel=digits_rtol)
        assert cells[7] == ("ok" if d.max_abs <= d.bound and d.engine_badness <= 1 else "FAIL")
    assert [line.split(" ")[0] for line in legend if not line.startswith("  ")] == \
        ["max", "engine/bound:", "result:"]
    text = "\n".join(legend)
    for column in TABLE_COLUMNS[3:]:
        assert f"{column}:" in text, column  # each measured column and the verdict explained
    assert "result: ok when both ratios are <= 1, the most that rounding explains" in text
    assert all(len(line) <= 100 for line in legend)
    assert "rounding:" not in text  # fp32: no rounding line


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_low_precision_rows_say_their_ratio_is_one_rounding(dtype, name):
    """A bf16 / fp16 row's engine/bound near 1 is the engine's one rounding of its fp32 sum (u*|sum| at most): each
    passing row's result is marked ``ok*``, and a line under the legend says what the marked ratio measures. The one-rounding claim
    is checked on the numbers: the engine's gap over the fp64 sum is at most u*|sum| plus the fp32 work, which is
    what engine/bound <= 1 measures (``engine_badness``), and a row at 1 is not a FAIL."""
    torch.manual_seed(0)
    report = verify_equivalence(MLP().to(dtype), _mse, tuple(t.to(dtype) for t in _regression(8)), 2,
                                backend="torch")
    lines = report.table().splitlines()
    rows = lines[2:2 + len(report.parameters)]
    for d, row in zip(report.parameters, rows):
        cells = re.split(r"\s{2,}", row)
        assert cells[2] == name
        assert cells[7] == ("ok*" if d.passed else "FAIL"), row
    legend = "\n".join(lines[2 + len(report.parameters):])
    assert f"ok*: a {name} row's engine/bound is its gap in units of what one rounding of the fp32 sum" in legend
    assert all(len(line) <= 100 for line in lines)


# ---------------------------------------------------------------- bad input
def test_bad_input():
    model = MLP()
    batch = _regression(8)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        verify_equivalence(list(model.parameters()), _mse, batch, 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1"):
            verify_equivalence(model, _mse, batch, bad)
    with pytest.raises(ValueError, match="num_micro_batches=9 exceeds the batch's 8 rows"):
        verify_equivalence(model, _mse, batch, 9)
    with pytest.raises(ValueError, match="rtol must be a float >= 0"):
        verify_equivalence(model, _mse, batch, 2, rtol=-1.0)
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="loss_fn must return a one-element tensor"):
        verify_equivalence(model, lambda m, b: (m(b[0]) - b[1]) ** 2, batch, 2)
    _assert_unchanged(model, snap)
    with pytest.raises(ValueError, match="no trainable parameters"):
        verify_equivalence(copy.deepcopy(model).requires_grad_(False), _mse, batch, 2)


def test_refuses_a_model_with_a_live_accumulator():
    model = MLP()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, backend="torch")
    with pytest.raises(RuntimeError, match="belongs to a live GradientAccumulator"):
        verify_equivalence(model, _mse, _regression(8), 2)
    acc.close()
    assert verify_equivalence(model, _mse, _regression(8), 2, backend="torch").passed


def test_refuses_to_run_under_multi_rank_distributed(monkeypatch):
    """The engine would broadcast and all-reduce over every rank; the check is local to one process."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    model = MLP()
    snap = _snapshot(model)
    with pytest.raises(RuntimeError, match="single-process check.*2 ranks"):
        verify_equivalence(model, _mse, _regression(8), 2)
    _assert_unchanged(model, snap)
