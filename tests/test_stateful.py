"""Random programs of the public API against an fp64 reference of the plain recipe (issue 31, point 7).

A ``hypothesis`` ``RuleBasedStateMachine`` drives one ``GradientAccumulator`` (fp32, bf16 or fp16 parameters; backend
``cpu`` or ``torch``; SGD with momentum) through random sequences of ``backward`` (random micro-batch sizes, mean or
item mode, ``num_items`` as ints or tensors, now and then a negative/NaN/inf count or a NaN loss), ``step``,
``step(force=True)``, ``zero_grad``, ``state_dict`` round trips through ``torch.save`` into a fresh model, optimizer
and accumulator, and run-time changes of K and ``max_grad_norm``. Beside it the test keeps the plain recipe in fp64:
each micro-batch's gradient (the same autograd call on the same parameters, in their dtype, times the loss scale the
recipe's own dynamic scaler holds), summed over the window, divided by its micro-batches or items, clipped as
``torch.nn.utils.clip_grad_norm_`` does, and SGD's update; a window with a non-finite gradient or an invalid count is
skipped (and an overflow halves the loss scale, as ``torch.amp.GradScaler``). After every step the optimizer's
parameters (the fp32 masters of bf16/fp16 parameters) must be within the rounding budget the test carries along
(fp32 unit roundoff per operation, summed over the updates); the model's bf16/fp16 parameters must be the masters
rounded to nearest.

The parameters are bf16/fp16 but the forward computes in fp32 (``.float()``): on a CPU without AVX-512 bf16 matmuls
are ~28x slower, and what is tested here is the accumulator, not the matmul.

Bounded for CI (``GAENGINE_HYPOTHESIS_PROFILE=ci``, the default: well under a minute on 2 cores); ``=long`` runs many
more and longer programs (``make``-free: ``GAENGINE_HYPOTHESIS_PROFILE=long pytest tests/test_stateful.py``).
"""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import gaengine
from tests.tolerances import FP32_EPS
from tests.models import TinyRegressor as Tiny

LR, MOMENTUM = 0.05, 0.5
GROWTH_INTERVAL = 2000  # torch.amp.GradScaler's (and gaengine's "dynamic"): never reached by these programs
PROFILES = {
    "ci": dict(max_examples=100, stateful_step_count=40),
    "long": dict(max_examples=1500, stateful_step_count=60),
}
PROFILE = os.environ.get("GAENGINE_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(f"GAENGINE_HYPOTHESIS_PROFILE must be one of {sorted(PROFILES)}, got {PROFILE!r}")


# A micro-batch: its rows, its num_items (in item mode: an int, an int64 or float32 tensor, now and then a negative,
# NaN or inf tensor), and now and then a NaN loss.
ROWS = st.integers(1, 4)
COUNT = st.one_of(st.integers(1, 9).map(int), st.integers(0, 9).map(lambda n: ("tensor", n)),
                  st.integers(1, 9).map(lambda n: ("float", n)),
                  st.integers(0, 9).map(lambda i: [("bad", -6.0), ("bad", math.nan), ("bad", math.inf)][i] if i < 3
                                        else ("tensor", i)))
NAN_LOSS = st.integers(0, 49).map(lambda n: n == 0)


def _loss(model: Tiny, x: torch.Tensor, y: torch.Tensor, item_mode: bool) -> torch.Tensor:
    return F.mse_loss(model(x), y, reduction="sum" if item_mode else "mean")


class AccumulatorMachine(RuleBasedStateMachine):
    """One accumulator and the fp64 plain recipe beside it (see the module docstring)."""

    # What the programs of this session did (printed by test_report_examples).
    counts = dict(programs=0, calls=0, updates=0, skipped_nonfinite=0, skipped_count=0, round_trips=0, refused=0)

    @initialize(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
                backend=st.sampled_from(["cpu", "torch"]), k=st.integers(1, 4),
                max_norm=st.sampled_from([None, 0.05, 1.0]), seed=st.integers(0, 2**16))
    def build(self, dtype, backend, k, max_norm, seed):
        AccumulatorMachine.counts["programs"] += 1
        self.dtype, self.backend, self.built_k, self.built_max_norm = dtype, backend, k, max_norm
        self.data = torch.Generator().manual_seed(seed)
        self.model, self.acc = self._new(seed, None)
        # The plain recipe: fp64 masters, SGD's momentum buffers, the window's gradients, K, the clip, the scale.
        self.ref = [p.detach().double().clone() for p in self.model.parameters()]
        self.buf: list[torch.Tensor] | None = None
        self.err = [torch.zeros_like(p) for p in self.ref]  # the rounding budget of each master element
        self.buf_err = [torch.zeros_like(p) for p in self.ref]
        self.window: list[tuple[list[torch.Tensor], float | None, bool]] = []  # (grads, items, invalid count)
        self.item_mode: bool | None = None
        self.k, self.max_norm = k, max_norm
        self.scale = 65536.0 if dtype == torch.float16 else None
        self.updates = 0

    def _new(self, seed: int, saved: bytes | None):
        model = Tiny(self.dtype, seed)
        if saved is not None:
            state = torch.load(io.BytesIO(saved), weights_only=True)
            model.load_state_dict(state["model"])
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=self.built_k,
                                           max_grad_norm=self.built_max_norm, backend=self.backend)
        if saved is not None:
            acc.load_state_dict(state["acc"])
        return model, acc

    def teardown(self):
        acc = getattr(self, "acc", None)
        if acc is not None:
            acc.close()

    # ------------------------------------------------------------------ the public API
    @precondition(lambda self: len(self.window) < self.k)
    @rule(rows=ROWS, item_mode=st.booleans(), count=COUNT, nan_loss=NAN_LOSS)
    def backward(self, rows, item_mode, count, nan_loss):
        if self.item_mode is not None:
            item_mode = self.item_mode
        x = torch.randn(rows, 4, generator=self.data)
        y = torch.randn(rows, 2, generator=self.data)
        num_items, items, invalid = None, None, False
        if item_mode:
            if isinstance(count, int):
                num_items, items = count, float(count)
            else:
                kind, n = count
                dtype = torch.int64 if kind == "tensor" else torch.float32
                num_items, items, invalid = torch.tensor(n, dtype=dtype), float(n), kind == "bad"
        poison = math.nan if nan_loss else 1.0
        # The plain recipe's gradient of this micro-batch: the same autograd on the same parameters, the loss scaled
        # by the recipe's own scale (exactly undone: a power of two).
        scale = 1.0 if self.scale is None else self.scale
        loss = _loss(self.model, x, y, item_mode) * poison
        grads = torch.autograd.grad(loss * torch.tensor(scale), list(self.model.parameters()))
        self.window.append(([g.double() / scale for g in grads], items, invalid))
        self.item_mode = item_mode
        if self.scale is not None:
            assert float(self.acc.scaler.scale) == self.scale, "loss scale differs from the recipe's"
        self.acc.backward(_loss(self.model, x, y, item_mode) * poison, num_items=num_items)

    @rule(item_mode=st.booleans(), micro_batches=st.lists(st.tuples(ROWS, COUNT, NAN_LOSS), min_size=4, max_size=4))
    def complete_window(self, item_mode, micro_batches):
        """The usual loop: the window's remaining micro-batches, then step()."""
        for rows, count, nan_loss in micro_batches[:max(0, self.k - len(self.window))]:
            self.backward(rows, item_mode, count, nan_loss)
        self.step(force=False)

    @precondition(lambda self: len(self.window) >= self.k)
    @rule()
    def backward_on_a_full_window(self):
        x, y = torch.randn(1, 4, generator=self.data), torch.randn(1, 2, generator=self.data)
        AccumulatorMachine.counts["refused"] += 1
        with pytest.raises(RuntimeError, match="call acc.step"):
            self.acc.backward(_loss(self.model, x, y, bool(self.item_mode)),
                              num_items=1 if self.item_mode else None)

    @rule(force=st.booleans())
    def step(self, force):
        result = self.acc.step(force=force)
        n = len(self.window)
        if n == 0 or (n < self.k and not force):
            assert result is None
            return
        assert result is not None and result.num_micro_batches == n
        self._reference_step(result)

    @rule()
    def zero_grad(self):
        self.acc.zero_grad()
        self.window, self.item_mode = [], None

    @rule(k=st.integers(1, 4))
    def set_accumulation_steps(self, k):
        if k < len(self.window):  # never below the window's count
            AccumulatorMachine.counts["refused"] += 1
            with pytest.raises(ValueError, match="already holds"):
                self.acc.accumulation_steps = k
            return
        self.acc.accumulation_steps = k
        self.k = k

    @rule(max_norm=st.sampled_from([None, 0.05, 0.3, 1.0, 10.0]))
    def set_max_grad_norm(self, max_norm):
        self.acc.max_grad_norm = max_norm
        self.max_norm = max_norm

    @rule(seed=st.integers(0, 2**16))
    def round_trip(self, seed):
        """Save (model and accumulator, through ``torch.save``), resume into a fresh model, optimizer and
        accumulator built as at the start: K set at run time comes back with the state, max_grad_norm is the
        caller's to set again."""
        AccumulatorMachine.counts["round_trips"] += 1
        blob = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "acc": self.acc.state_dict()}, blob)
        self.acc.close()
        self.model, self.acc = self._new(seed, blob.getvalue())
        self.acc.max_grad_norm = self.max_norm

    @invariant()
    def same_window(self):
        AccumulatorMachine.counts["calls"] += 1
        if hasattr(self, "acc"):
            assert self.acc.num_micro_batches == len(self.window)
            assert self.acc.accumulation_steps == self.k

    # ------------------------------------------------------------------ the plain recipe
    def _reference_step(self, result):
        grads, items, invalid = zip(*self.window)
        n = len(self.window)
        self.window, self.item_mode = [], None
        total = [sum(g[i] for g in grads) for i in range(len(self.ref))]
        abs_total = [sum(g[i].abs() for g in grads) for i in range(len(self.ref))]
        overflow = not all(bool(torch.isfinite(t).all()) for t in total)
        denom = float(n) if items[0] is None else sum(items)
        bad_count = any(invalid)
        skip = overflow or bad_count or denom == 0
        assert bool(result.skipped) == skip, f"skipped={bool(result.skipped)}, the recipe skips: {skip}"
        if bad_count:
            assert bool(result.invalid_num_items)
        if self.scale is not None and overflow:
            self.scale /= 2  # GradScaler's back-off; growth after GROWTH_INTERVAL clean windows is never reached
        if skip:
            AccumulatorMachine.counts["skipped_count" if bad_count else "skipped_nonfinite"] += 1
            self._check_params()
            return
        g = [t / denom for t in total]
        norm = math.sqrt(sum(float((t * t).sum()) for t in g))
        assert math.isclose(float(result.grad_norm), norm, rel_tol=64 * FP32_EPS * math.sqrt(n), abs_tol=1e-30)
        coef = 1.0 if self.max_norm is None else min(1.0, self.max_norm / (norm + 1e-6))
        first = self.buf is None
        if first:
            self.buf = [coef * t for t in g]
        else:
            self.buf = [MOMENTUM * b + coef * t for b, t in zip(self.buf, g)]
        # The budget: fp32 sums of n terms (n + 2 roundings of the terms' magnitudes), the coefficient (a few
        # roundings of the norm), then one rounding per operation of momentum and the update.
        for i, (b, p) in enumerate(zip(self.buf, self.ref)):
            grad_err = (n + 2) * FP32_EPS * coef * abs_total[i] / denom + 8 * FP32_EPS * coef * g[i].abs()
            self.buf_err[i] = (0 if first else MOMENTUM) * self.buf_err[i] + grad_err + 2 * FP32_EPS * b.abs()
            self.ref[i] = p - LR * b
            self.err[i] = self.err[i] + LR * self.buf_err[i] + 2 * FP32_EPS * (self.ref[i].abs() + LR * b.abs())
        self.updates += 1
        AccumulatorMachine.counts["updates"] += 1
        self._check_params()

    def _check_params(self):
        masters = [p for group in self.acc.optimizer.param_groups for p in group["params"]]
        for i, (m, p, ref, err) in enumerate(zip(masters, self.model.parameters(), self.ref, self.err)):
            assert m.dtype == torch.float32 and m.shape == ref.shape
            off = (m.detach().double() - ref).abs()
            bound = 2 * err + 1e-30
            assert bool((off <= bound).all()), (
                f"parameter {i} ({self.dtype}, {self.backend}, after {self.updates} updates) off the fp64 recipe by "
                f"{float(off.max()):.3e}, budget {float(bound.max()):.3e}")
            assert torch.equal(p.detach(), m.detach().to(p.dtype)), f"parameter {i} is not its master rounded"


AccumulatorMachine.TestCase.settings = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], **PROFILES[PROFILE])
TestAccumulatorMachine = AccumulatorMachine.TestCase


def test_report_examples(capsys):
    """What the machine's programs did in this session (all zero when this test runs alone)."""
    with capsys.disabled():
        print(f"\ntest_stateful ({PROFILE} profile): " + ", ".join(f"{k} {v}" for k, v in
                                                                 AccumulatorMachine.counts.items()))
