"""``verify_equivalence``: does accumulating K micro-batches give the gradient of the whole batch?

It runs the batch twice on the same model — once whole with plain ``loss.backward()``, once split into
micro-batches through ``GradientAccumulator`` — and makes two comparisons per parameter, in fp64:

* **engine**: the engine's final gradient against the micro-batch gradients autograd handed it, captured by a
  tensor hook and summed exactly (fp64) with the engine's weights — the plain recipe with exact accumulation.
  Both sides hold the same low-precision terms, so the only differences are the engine's own roundings (fp32
  sums, one fp32 scale, one rounding to the parameter's dtype), bounded per element in every dtype
  (``engine_bound``). A wrong denominator, a dropped micro-batch or a sum kept in bf16 is far outside it.
* **setup**: that exact sum against the whole batch's gradient. It catches the setups where accumulation is
  *not* equivalent to the large batch: BatchNorm in train mode (micro-batch statistics), a summed loss
  averaged as if it were a mean, a per-micro-batch mean over a varying number of tokens, anything else whose
  forward depends on the other rows of the batch. Both sides run the model's own forward and backward in
  its dtype, in differently shaped kernels, so the tolerance is the dtype's (``GRAD_RTOL``).

How, exactly:

Whole batch: ``loss_fn(model, batch).backward()`` in plain PyTorch (in item mode the summed loss's
gradient divided by ``num_items_fn(batch)``). Engine: ``GradientAccumulator(params, None,
accumulation_steps=K, max_grad_norm=None, backend=backend, loss_scale=None)`` over the trainable
parameters, fed the micro-batches; ``step()`` leaves the final gradients in ``.grad``. Neither side
scales the loss, so fp16 gradients underflow alike. Weighting of the micro-batches:
  * ``num_items_fn`` given: ``acc.backward(loss_fn(model, mb), num_items=num_items_fn(mb))`` (``"items"``).
  * equal micro-batches: ``acc.backward(loss_fn(model, mb))``, the mean of the micro-batch means
    (``"mean"``) — the engine's default, and equal to the whole-batch mean for a per-row mean loss.
  * uneven micro-batches: the mean of means would weight the rows of a small micro-batch more, so the
    check uses item mode with the row counts: ``acc.backward(loss_fn(model, mb) * rows,
    num_items=rows)`` (``"rows"``), which is exact for a per-row mean. Train the same way.
Micro-batch sum: a tensor hook on each parameter (it runs before autograd's AccumulateGrad, so before the
engine's hooks) adds the gradient of each micro-batch's backward, in the parameter's dtype as autograd
produced it, into fp64, and divides by the engine's denominator (K, the rows, or the sum of the
micro-batches' items): what the plain ``loss.backward()`` recipe accumulates, without its rounding.

Two comparisons per parameter, both must pass:
  * engine: ``|engine - micro-batch sum| <= engine_bound(...)`` per element, the engine's own rounding
    (fp32 sums and scale, then one rounding to the parameter's dtype: u = 2^-8 bf16, 2^-11 fp16,
    2^-24 fp32). It holds in every dtype on a correct engine and fails on a wrong denominator, a dropped
    micro-batch or a sum kept in bf16. It does not depend on the setup, since both sides hold the same terms.
  * setup: ``max |micro-batch sum - whole batch| <= rtol * max(max |whole batch|, largest |whole batch|
    in the model)``, rtol from ``GRAD_RTOL`` (1e-5 fp32, 2^-3 bf16, 2^-6 fp16) or ``rtol=``.

Both passes start from the same buffers and the same RNG state. Stochastic layers (dropout) compare
equal only if they draw the same masks for a row in a micro-batch as in the whole batch (true on CPU
for plain dropout, not in general): disable them for the check if they make it fail.

The model is left exactly as it was: gradients, buffers (BatchNorm running statistics), training modes and
the global RNG state are restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gaengine.clip import OWNER_ATTR as _OWNER_ATTR
from gaengine.fusion import observes_fusion
from gaengine.utils import MicroBatches, split_batch

__all__ = ["verify_equivalence", "engine_bound", "EquivalenceReport", "ParameterDiff", "GRAD_RTOL"]

# Setup check: relative tolerance of a parameter's gradient (max |micro-batch sum - whole batch| / max |whole
# batch|), keyed by the parameter's dtype. Neither side is exact: the whole batch and the micro-batches reduce
# the same per-row terms in a different order and in differently shaped kernels.
#
# * fp32: 1e-5. The reduction over rows is reordered (one reduction of N rows vs K of N/K plus an fp32 sum
#   of K); with unit roundoff u = 2^-24 ≈ 6e-8 the typical error grows like sqrt(N)·u (6e-6 at 10^4 rows;
#   the worst case N·u is not approached by blocked reductions): measured under 5e-7 for a 3-layer MLP on
#   24 to 1024 rows. A setup that is wrong (BatchNorm statistics, a mis-weighted mean) is off by 1e-3 to
#   1e-1 or more, so the margin goes both ways.
# * bf16 / fp16: 32 unit roundoffs, 2^-3 (bf16, u = 2^-8) and 2^-6 (fp16, u = 2^-11). Each side rounds every
#   activation and gradient on its own, and a kernel that reduces N rows in the low-precision format itself
#   (the CPU embedding backward adds each token's row into a bf16 gradient) errs like N·u on the whole batch
#   but N/K·u per micro-batch. Measured on the built-in GPT of ``gaengine verify`` (16 x 64 tokens, K = 4,
#   seeds 0-7, CPU): the tied embedding up to 5.4e-2 = 14 u in bf16 and 2.9e-3 = 6 u in fp16, every other
#   parameter about 1 u (the old 2^-5 failed 4 of seeds 0-5 in bf16). So only a setup error above 2^-3 (bf16)
#   or 2^-6 (fp16) is told from rounding in those formats: check the setup in fp32 for a sharp answer. The
#   engine check does not depend on this table.
# Roundoff scales with the terms being summed, not with their sum: a gradient that is zero in exact
# arithmetic (the bias of a layer followed by BatchNorm) is all roundoff on both sides. So a parameter is
# held to ``rtol * max(max |its whole-batch gradient|, max |whole-batch gradient of any parameter|)``.
# Pass ``rtol=`` to verify_equivalence for autocast (fp32 parameters, low-precision compute: use the
# autocast dtype's entry) or for deep models.
GRAD_RTOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 2.0**-3,
    torch.float16: 2.0**-6,
}


def engine_bound(total: torch.Tensor, abs_total: torch.Tensor, num_terms: int, dtype: torch.dtype) -> torch.Tensor:
    """The largest ``|engine - total|`` per element that rounding explains (Higham's standard model).

    total: fp64, the parameter's shape: ``sum_k w_k g_k``, the micro-batch gradients ``g_k`` (as autograd produced
        them, in the parameter's dtype) weighted by the engine's normalization ``w_k`` (1/K, 1/rows or 1/items),
        summed exactly. abs_total: fp64, the same shape: ``sum_k w_k |g_k|``. num_terms: K, the number of
        gradients summed (one per micro-batch; more where a gradient arrives twice in one backward).
    dtype: the parameter's, which its final ``.grad`` is rounded to.
    Returns fp64, the same shape: ``u·|total| + 2(K+1)·2^-24·abs_total + tiny·eps``, where

    * ``2(K+1)·2^-24·abs_total`` bounds the fp32 work: K conversions to fp32 (exact from bf16/fp16), K-1 fp32
      additions (recursive summation errs at most (K-1)·2^-24·sum |terms|) and one fp32 scale by the
      denominator's reciprocal (two roundings), (K+1)·2^-24·abs_total to first order; the factor 2 covers the
      higher-order terms;
    * ``u·|total|`` is the one rounding of the fp32 result to ``dtype``, unit roundoff ``u = eps/2``: 2^-8
      (bf16), 2^-11 (fp16), 2^-24 (fp32, where ``.grad`` is the fp32 buffer itself: a margin of one ulp);
    * ``tiny·eps`` (one subnormal step of ``dtype``: 2^-133 bf16, 2^-24 fp16, 2^-149 fp32) covers the same
      roundings where the values are subnormal, and makes the bound positive where ``total`` is 0.

    A sum kept in bf16 rounds K-1 more times at 2^-8 (a relative error up to (K-1)·2^-8 instead of 2^-8), a
    dropped micro-batch is off by ``w_k·g_k``, a wrong denominator by a factor: all far outside it.
    """
    info = torch.finfo(dtype)
    fp32_ops = 2 * (num_terms + 1) * 2.0**-24
    return total.abs() * (info.eps / 2) + abs_total * fp32_ops + info.tiny * info.eps


@dataclass(frozen=True)
class ParameterDiff:
    """The two comparisons of one parameter's gradient (all numbers in fp64, as Python floats).

    name: the parameter's name in ``model.named_parameters()``. shape, dtype: the parameter's.

    Setup (the micro-batch gradients summed exactly vs the whole batch's gradient, gradient units):
    max_abs: ``max |micro-batch sum - whole batch|`` over the elements.
    max_rel: ``max_abs / max |whole batch|`` (0 when both are zero; inf when only the whole batch's is zero).
    rtol: its relative tolerance (``GRAD_RTOL`` of its dtype, or ``rtol=``).
    bound: the largest ``max_abs`` that passes, ``rtol * max(max |whole batch|, model_scale)``, where
        ``model_scale`` is the largest ``|whole batch|`` element of the whole model: differences below ``rtol``
        of the model's largest gradient are roundoff even in a parameter whose own gradient is tiny (or
        zero in exact arithmetic).

    Engine (the final ``.grad`` vs the micro-batch gradients summed exactly, weighted as the engine weights them):
    engine_max_abs: ``max |engine - micro-batch sum|`` over the elements (gradient units).
    engine_badness: ``max |engine - micro-batch sum| / engine_bound`` over the elements: at most 1 is rounding.

    passed: ``max_abs <= bound`` and ``engine_badness <= 1`` (a NaN difference fails).
    A parameter that receives no gradient on a side (``.grad`` None) counts as a zero gradient there.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    max_abs: float
    max_rel: float
    rtol: float
    bound: float
    engine_max_abs: float
    engine_badness: float

    @property
    def setup_badness(self) -> float:
        """``max_abs / bound``: above 1 fails; inf for a NaN difference."""
        if self.max_abs == 0:
            return 0.0
        if math.isnan(self.max_abs) or self.bound == 0:
            return math.inf
        return self.max_abs / self.bound

    @property
    def setup_passed(self) -> bool:
        return self.max_abs <= self.bound  # NaN compares False: a NaN gradient fails

    @property
    def engine_passed(self) -> bool:
        return self.engine_badness <= 1.0

    @property
    def passed(self) -> bool:
        return self.setup_passed and self.engine_passed

    @property
    def badness(self) -> float:
        """The larger of ``setup_badness`` and ``engine_badness``: above 1 fails; inf for NaN."""
        engine = math.inf if math.isnan(self.engine_badness) else self.engine_badness
        return max(self.setup_badness, engine)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(
        dtype, str(dtype).replace("torch.", ""))


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _result(d: "ParameterDiff") -> str:
    """A row's ``result``: ``FAIL``, ``ok``, or for a bf16 / fp16 parameter ``ok*`` (``_ROUNDED``: its ratio is one
    rounding's, a legend line says)."""
    if not d.passed:
        return "FAIL"
    return _ROUNDED if d.dtype in _LOW_PRECISION else "ok"


def _tol(x: float) -> str:
    """``2^-3`` for a power of two, else ``1.0e-05``."""
    m, e = math.frexp(x)
    return f"2^{e - 1}" if m == 0.5 else f"{x:.1e}"


# Below the table: what each column measures and what "ok" is held to (the values of u, K and rtol are in the
# summary above it).
_LEGEND = (
    "max |diff|: max over the elements of |whole batch - micro-batch gradients summed in fp64|;",
    "  abs bound: rtol * max(max |whole|, largest |whole| in the model); setup/bound: their ratio.",
    "engine/bound: max over the elements of |engine - micro-batch sum| / its bound,",
    "  u*|sum| + 2(K+1)*2^-24*sum|g_k| + a subnormal step (u, K and rtol: see the summary).",
    "result: ok when both ratios are <= 1, the most that rounding explains. In bf16 and fp16 the engine's",
    "  one rounding of its fp32 sum errs up to u*|sum| by itself, so the worst element sits near 1: that",
    "  is rounding, and passes; a dropped micro-batch or a wrong denominator is many times over.",
)
# The result cell of a passing bf16 / fp16 row (short: the table fits in 100 columns), and the legend's line for it:
# there engine/bound is the engine's gap in units of the most one rounding of its fp32 sum to the parameter's dtype
# can err (u*|sum|), so 0.996 reads as that one rounding.
_ROUNDED = "ok*"
_ROUNDED_LEGEND = (
    "ok*: a {dtype} row's engine/bound is its gap in units of what one rounding of the fp32 sum to {dtype}",
    "  can err (u*|sum|): up to 1 is that one rounding, which every {dtype} gradient has.",
)


@dataclass(frozen=True)
class EquivalenceReport:
    """What ``verify_equivalence`` found.

    parameters: one ``ParameterDiff`` per trainable parameter, in ``named_parameters()`` order.
    passed: every parameter passes both comparisons. engine_passed, setup_passed: every parameter passes that one.
    worst: name of the parameter closest to (or furthest past) a bound (largest ``badness``).
    mode: how the micro-batches were weighted: ``"mean"`` (equal micro-batches, mean losses),
        ``"rows"`` (uneven split, mean losses weighted by their row counts in item mode) or ``"items"``
        (``num_items_fn`` given: summed losses normalized by the total item count).
    micro_batch_sizes: rows per micro-batch.
    reference_loss, engine_loss: the whole-batch loss (normalized like the gradient) and the engine's
        window loss (``StepResult.loss``), as floats.
    """

    parameters: tuple[ParameterDiff, ...]
    worst: str
    mode: str
    micro_batch_sizes: tuple[int, ...]
    reference_loss: float
    engine_loss: float

    @property
    def passed(self) -> bool:
        return self.engine_passed and self.setup_passed

    @property
    def engine_passed(self) -> bool:
        return all(d.engine_passed for d in self.parameters)

    @property
    def setup_passed(self) -> bool:
        return all(d.setup_passed for d in self.parameters)

    @property
    def max_abs(self) -> float:
        """Largest ``max_abs`` over the parameters (setup)."""
        return max((d.max_abs for d in self.parameters), default=0.0)

    @property
    def max_rel(self) -> float:
        """Largest ``max_rel`` over the parameters (setup)."""
        return max((d.max_rel for d in self.parameters), default=0.0)

    @property
    def engine_badness(self) -> float:
        """Largest ``engine_badness`` over the parameters (NaN if any is NaN)."""
        values = [d.engine_badness for d in self.parameters]
        return math.nan if any(map(math.isnan, values)) else max(values, default=0.0)

    @property
    def failed(self) -> list[str]:
        """Names of the parameters outside a bound."""
        return [d.name for d in self.parameters if not d.passed]

    def table(self) -> str:
        """One row per parameter, then a legend that says what each column measures and what ``ok`` is held to.

        Columns: parameter, shape, dtype; the setup comparison's ``max |diff|`` (``max_abs``), its ``abs bound``
        (``bound``) and their ratio ``setup/bound`` (``setup_badness``); the engine comparison's ``engine/bound``
        (``engine_badness``); ``result``, ``ok`` when both ratios are at most 1 (``ok*`` for a bf16 or fp16
        parameter, whose ``engine/bound`` near 1 is the one rounding of its fp32 sum, a line under the legend
        says), else ``FAIL``. Ratios are given to 3 significant digits, the gradient differences and bounds in
        gradient units.
        """
        header = ("parameter", "shape", "dtype", "max |diff|", "abs bound", "setup/bound", "engine/bound", "result")
        rows = [header] + [
            (d.name, "x".join(map(str, d.shape)) or "scalar", _short(d.dtype), f"{d.max_abs:.3e}", f"{d.bound:.3e}",
             f"{d.setup_badness:.3g}", f"{d.engine_badness:.3g}", _result(d))
            for d in self.parameters
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        align = ["<", "<", "<", ">", ">", ">", ">", "<"]
        lines = ["  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(r, align, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
        rounded = dict.fromkeys(_short(d.dtype) for d in self.parameters if d.dtype in _LOW_PRECISION)
        return "\n".join(lines + list(_LEGEND) + [line.format(dtype=dt) for dt in rounded for line in _ROUNDED_LEGEND])

    def summary(self) -> str:
        """The verdict and its reason, then each comparison with its worst parameter and the bound it used."""
        sizes, k = self.micro_batch_sizes, len(self.micro_batch_sizes)
        rows = f"{sizes[0]}" if len(set(sizes)) == 1 else f"{list(sizes)}"
        reason = {(False, True): "the engine's accumulation is wrong (beyond rounding)",
                  (True, False): "the setup is not equivalent to the whole batch",
                  (False, False): "the engine's accumulation is wrong and the setup is not equivalent"}
        verdict = "PASSED" if self.passed else f"FAILED: {reason[self.engine_passed, self.setup_passed]}"

        def check(what: str, badness: Callable[[ParameterDiff], float], passed: Callable[[ParameterDiff], bool],
                  bound: str) -> list[str]:
            worst = max(self.parameters, key=lambda d: math.inf if math.isnan(badness(d)) else badness(d))
            bad = sum(not passed(d) for d in self.parameters)
            state = "ok" if bad == 0 else f"FAIL in {bad} of {len(self.parameters)} parameters"
            return [f"  {what}: {state}", f"    worst {worst.name!r} at {badness(worst):.3g} times its bound,", bound]

        units = {d.dtype: _tol(torch.finfo(d.dtype).eps / 2) for d in self.parameters}
        rtols = {(d.dtype, d.rtol): None for d in self.parameters}
        return "\n".join([
            f"gradient equivalence {verdict}",
            f"  {k} micro-batches of {rows} rows, mode {self.mode!r}; loss {self.reference_loss:.6g} whole batch, "
            f"{self.engine_loss:.6g} accumulated",
            *check("engine vs the micro-batch gradients summed in fp64", lambda d: d.engine_badness,
                   lambda d: d.engine_passed, f"    u*|sum| + 2(K+1)*2^-24*sum|g_k| + a subnormal step per element; "
                   f"K = {k}, u = {', '.join(f'{u} ({_short(dt)})' for dt, u in units.items())}"),
            *check("whole batch vs the micro-batches", lambda d: d.setup_badness, lambda d: d.setup_passed,
                   "    rtol * max(max |whole|, largest |whole| in the model); rtol = "
                   + ", ".join(f"{_tol(r)} ({_short(dt)})" for dt, r in rtols)),
        ])

    def __str__(self) -> str:
        return f"{self.summary()}\n{self.table()}"


def _max_abs(x: torch.Tensor | None) -> float:
    return 0.0 if x is None or x.numel() == 0 else x.detach().abs().max().to(torch.float64).item()


def _diff(name: str, p: torch.Tensor, whole: torch.Tensor | None, total: torch.Tensor | None,
          abs_total: torch.Tensor | None, num_terms: int, engine: torch.Tensor | None, rtol: float,
          model_scale: float) -> ParameterDiff:
    """whole, total, abs_total: p.shape fp64, or None; engine: p.shape, p.dtype or fp32, or None (None = zero)."""
    zeros = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
    w, t, a = (zeros if x is None else x for x in (whole, total, abs_total))
    e = zeros if engine is None else engine.detach().to(torch.float64)
    max_abs = _max_abs(t - w)
    scale = _max_abs(w)
    if max_abs == 0 or math.isnan(max_abs):
        max_rel = max_abs
    else:
        max_rel = max_abs / scale if scale > 0 else math.inf
    engine_badness = _max_abs((e - t) / engine_bound(t, a, num_terms, p.dtype))
    return ParameterDiff(name, tuple(p.shape), p.dtype, max_abs, max_rel, rtol, rtol * max(scale, model_scale),
                         _max_abs(e - t), engine_badness)


def _to_float(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} must return a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must return a number or a one-element tensor, got {type(value).__name__}")
    return float(value)



def _checked_parameters(model: Any, accumulation_steps: Any, rtol: Any) -> list[tuple[str, nn.Parameter]]:
    """Check ``verify_equivalence``'s arguments and setting; return the model's trainable named parameters.

    Raises what ``verify_equivalence`` documents: ``TypeError`` for a non-module, ``ValueError`` for bad
    ``accumulation_steps`` / ``rtol`` or no trainable parameter, ``RuntimeError`` for a live accumulator on the
    model or a multi-rank ``torch.distributed``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError("model must be an nn.Module (loss_fn is called as loss_fn(model, batch)), "
                        f"got {type(model).__name__}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0):
        raise ValueError(f"rtol must be a float >= 0 or None, got {rtol!r}")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters (none with requires_grad=True)")
    for name, p in named:
        owner = getattr(p, _OWNER_ATTR, None)
        if owner is not None and owner() is not None:
            raise RuntimeError(f"parameter {name!r} belongs to a live GradientAccumulator: run verify_equivalence "
                               "before creating it, or call its close() first")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # A GradientAccumulator built now would broadcast the parameters and all-reduce the gradients over
        # every rank (a collective this call may be making alone), while the reference is this rank's batch.
        raise RuntimeError("verify_equivalence is a single-process check, but torch.distributed is initialized with "
                           f"{dist.get_world_size()} ranks: run it before init_process_group (or in a "
                           "separate single-process job)")
    return named


class _ModelState:
    """What ``verify_equivalence`` must leave as it found: every ``.grad`` object, buffer and ``training`` flag."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads = [p.grad for p in self.params]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.modes = [(m, m.training) for m in model.modules()]

    def clear_grads(self) -> None:
        """Set every parameter's ``.grad`` to None (the saved tensors are kept, untouched)."""
        for p in self.params:
            p.grad = None

    def restore_buffers(self) -> None:
        """Copy the saved values back into the buffers (BatchNorm running statistics)."""
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)

    def restore(self) -> None:
        """Put back the saved ``.grad`` objects, buffer values and training modes."""
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.restore_buffers()
        for m, training in self.modes:
            m.training = training


class _MicroBatchSums:
    """The micro-batch gradients autograd produced, per parameter (keyed by ``id(p)``), summed exactly in fp64.

    total: ``sum_k g_k``; abs_total: ``sum_k |g_k|``; num_terms: how many terms each sum holds (``engine_bound``'s
    K). Filled by hooks on the parameters (``capture``) and, for fused layers, on the layers (``capture_fused``).
    """

    def __init__(self) -> None:
        self.total: dict[int, torch.Tensor] = {}
        self.abs_total: dict[int, torch.Tensor] = {}
        self.num_terms: dict[int, int] = {}

    def add(self, key: int, g: torch.Tensor, g_abs: torch.Tensor, terms: int) -> None:
        """Add one gradient ``g`` (fp64) and its ``g_abs`` to parameter ``key``'s sums, counting ``terms`` terms."""
        if key in self.total:
            self.total[key] += g
            self.abs_total[key] += g_abs
        else:
            self.total[key], self.abs_total[key] = g, g_abs
        self.num_terms[key] = self.num_terms.get(key, 0) + terms

    def capture(self, key: int) -> Callable[[torch.Tensor], None]:
        """A parameter tensor hook adding each gradient it sees to parameter ``key``'s sums."""
        def hook(grad: torch.Tensor | None) -> None:  # runs before AccumulateGrad, so before the engine's hooks
            if grad is None:
                return
            g = grad.detach().to(torch.float64, copy=True)  # never alias the tensor autograd goes on with
            self.add(key, g, g.abs(), 1)
        return observes_fusion(hook)  # a fused layer's terms come from capture_fused: its weight stays fused

    def capture_fused(self, module: nn.Module) -> Callable[..., None]:
        """The micro-batch terms of a fused layer's weight and bias (module forward hook, then an output hook)."""
        transposed = not isinstance(module, nn.Linear)  # transformers' Conv1D: weight (in, out)

        def forward_hook(mod: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            x = inputs[0].detach()
            device_type = x.device.type
            if torch.is_autocast_enabled(device_type) and x.is_floating_point() and x.dtype != torch.float64:
                x = x.to(torch.get_autocast_dtype(device_type))  # the operand the fused op multiplies
            x = x.reshape(-1, x.shape[-1]).to(torch.float64)

            def output_hook(grad: torch.Tensor) -> None:
                dy = grad.detach().reshape(-1, grad.shape[-1]).to(torch.float64)
                weight, bias = mod.weight, mod.bias
                if weight.requires_grad:
                    pair = (x, dy) if transposed else (dy, x)
                    self.add(id(weight), pair[0].t() @ pair[1], pair[0].abs().t() @ pair[1].abs(), dy.shape[0] + 1)
                if bias is not None and bias.requires_grad:
                    self.add(id(bias), dy.sum(0), dy.abs().sum(0), dy.shape[0] + 1)

            if output.requires_grad:
                output.register_hook(output_hook)
        return forward_hook

    def normalize(self, denom: float) -> None:
        """Divide the sums by the engine's normalization (K, the rows or the items), in fp64."""
        for key in self.total:
            self.total[key] /= denom
            self.abs_total[key] /= denom


def _whole_batch_gradients(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any,
                           named: list[tuple[str, nn.Parameter]], num_items_fn: Callable[[Any], Any] | None,
                           ) -> tuple[dict[int, torch.Tensor | None], float]:
    """The plain-PyTorch reference: ``loss_fn(model, batch).backward()`` once over the whole batch.

    Returns ``{id(p): fp64 gradient or None}`` and the loss as a float, both divided by ``num_items_fn(batch)``
    in item mode. Raises ``ValueError`` for a loss that is not a one-element tensor.
    """
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn must return a one-element tensor (reduce the loss with .mean() or .sum())")
    loss.backward()
    denom = _to_float(num_items_fn(batch), "num_items_fn") if num_items_fn is not None else 1.0
    whole = {id(p): (None if p.grad is None else p.grad.detach().to(torch.float64) / denom) for _, p in named}
    return whole, float(loss.detach().to(torch.float64).reshape(())) / denom


def _accumulated_gradients(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], micro: MicroBatches,
                           mode: str, named: list[tuple[str, nn.Parameter]], sums: _MicroBatchSums, *,
                           num_items_fn: Callable[[Any], Any] | None, backend: str,
                           gradient_accumulation_fusion: bool) -> tuple[dict[int, torch.Tensor | None], float, float]:
    """Feed the micro-batches through a ``GradientAccumulator``, capturing their gradients into ``sums``.

    Weights them by ``mode`` (see ``verify_equivalence``). Returns ``{id(p): final .grad}``, the engine's window
    loss and its normalization (K, the rows or the items of the micro-batches). The accumulator and the hooks are
    gone when it returns or raises.
    """
    # The parameters, not the module: a BatchNorm warning is the user's accumulator's to give (it
    # fires once per module). No loss scaling: the reference backward is unscaled too, so fp16
    # gradients underflow alike, and a dynamic scale's first windows would overflow and skip.
    from gaengine.engine import GradientAccumulator  # noqa: PLC0415 - verify sits above the engine it checks

    acc = GradientAccumulator(model if gradient_accumulation_fusion else [p for _, p in named], None,
                              accumulation_steps=len(micro), max_grad_norm=None, backend=backend,
                              loss_scale=None, gradient_accumulation_fusion=gradient_accumulation_fusion)
    handles = []
    try:
        handles = [p.register_hook(sums.capture(id(p))) for _, p in named]
        if gradient_accumulation_fusion:
            handles += [m.register_forward_hook(sums.capture_fused(m)) for m in acc._fusion.modules]
        engine_denom = 0.0
        for mb, rows in zip(micro, micro.sizes):
            if mode == "items":
                num_items = num_items_fn(mb)
                engine_denom += _to_float(num_items, "num_items_fn")
                acc.backward(loss_fn(model, mb), num_items=num_items)
            elif mode == "rows":
                engine_denom += rows
                acc.backward(loss_fn(model, mb) * rows, num_items=rows)
            else:
                engine_denom += 1
                acc.backward(loss_fn(model, mb))
        result = acc.step()
        return {id(p): p.grad for _, p in named}, float(result.loss), engine_denom
    finally:
        for h in handles:
            h.remove()
        acc.close()


def _both_passes(model, loss_fn, batch, micro: MicroBatches, mode: str, named, sums, num_items_fn, backend: str,
                 gradient_accumulation_fusion: bool):
    """The whole batch in plain PyTorch, then the micro-batches through the engine, from the same buffers and RNG
    state; the model restored after (``_ModelState``), also when ``loss_fn`` raises. Returns the whole batch's
    gradients and loss, the engine's gradients, loss and denominator (``sums`` collects the micro-batch terms)."""
    state = _ModelState(model)
    device = named[0][1].device
    rng_devices = [device] if device.type == "cuda" else []

    with torch.random.fork_rng(devices=rng_devices), torch.enable_grad():
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if rng_devices else None
        try:
            state.clear_grads()  # backward accumulates into an existing .grad in place: never touch the saved one
            whole, reference_loss = _whole_batch_gradients(model, loss_fn, batch, named, num_items_fn)

            # The engine: the same batch in micro-batches, same starting buffers and RNG state.
            state.clear_grads()
            state.restore_buffers()
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)
            engine, engine_loss, engine_denom = _accumulated_gradients(
                model, loss_fn, micro, mode, named, sums, num_items_fn=num_items_fn, backend=backend,
                gradient_accumulation_fusion=gradient_accumulation_fusion)
        finally:
            state.restore()

    return whole, reference_loss, engine, engine_loss, engine_denom


def verify_equivalence(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    accumulation_steps: int,
    *,
    num_items_fn: Callable[[Any], int | torch.Tensor] | None = None,
    backend: str = "auto",
    rtol: float | None = None,
    gradient_accumulation_fusion: bool = False,
) -> EquivalenceReport:
    """Compare the gradient of ``batch`` with the gradient accumulated over ``accumulation_steps`` micro-batches.

    model: the ``nn.Module`` to check, in the training mode you train it in (BatchNorm in train mode is
        exactly what this catches). No ``GradientAccumulator`` may be attached to it (create yours after
        the check, or ``close()`` it first).
    loss_fn: ``loss_fn(model, batch_or_micro_batch) -> 0-d tensor``: the mean loss over the rows, or, when
        ``num_items_fn`` is given, the loss summed over items.
    batch: tensors nested in tuples / lists / dicts with a common dim 0 (see ``split_batch``), split with
        ``split_batch(batch, accumulation_steps)`` (sizes differ by at most one row).
    accumulation_steps: K, the number of micro-batches (1 <= K <= rows).
    num_items_fn: ``num_items_fn(batch_or_micro_batch) -> int | 0-d tensor``: the item count (e.g. tokens
        whose label is not -100) that a summed loss covers. Selects item mode.
    backend: the engine backend (``"auto" | "torch" | "cpu" | "triton"``).
    rtol: one relative tolerance of the setup comparison for every parameter instead of the dtype-keyed
        ``GRAD_RTOL``. The engine comparison's bound is derived, not chosen (``engine_bound``).
    gradient_accumulation_fusion: build the engine with it (``gaengine.fusion``: the model's ``nn.Linear`` and
        transformers ``Conv1D`` layers write their weight and bias gradients straight into the fp32 buffer; needs
        the native hooks, ``ValueError`` from the accumulator otherwise). A fused layer's gradient reaches no
        tensor hook, so its micro-batch terms are taken from the layer itself: a forward hook keeps its input X
        (cast as autocast casts it) and a hook on its output its gradient dY, and the micro-batch sum gains
        ``dY^T X`` (Conv1D: ``X^T dY``) and the row sum of ``dY``, in fp64; their fp32 GEMM sums N rows, so such a
        parameter's bound counts N + K terms (N: the rows of all micro-batches) over ``sum |dY|^T |X|``.

    How the two passes run and compare (the weighting of the micro-batches, the micro-batch sum, both bounds): the
    module docstring.

    The model is left exactly as it was: every parameter's ``.grad`` (the same tensor object, untouched),
    the parameters (no optimizer runs), every buffer (BatchNorm running statistics are restored), every
    module's ``training`` flag, and the global CPU and CUDA RNG states.

    Returns an ``EquivalenceReport``; ``str(report)`` is a summary (the verdict and its reason, each
    comparison's worst parameter and its bound) and a per-parameter table.
    Raises ``TypeError`` if ``model`` is not an ``nn.Module``, ``ValueError`` naming the argument for bad
    ``accumulation_steps`` / ``batch`` / ``rtol`` or a non-scalar loss, ``RuntimeError`` when a
    ``GradientAccumulator`` is attached to the model or ``torch.distributed`` runs more than one rank (the
    check is local to one process); exceptions from ``loss_fn`` propagate (the model is restored first).
    """
    named = _checked_parameters(model, accumulation_steps, rtol)
    micro = split_batch(batch, accumulation_steps)
    mode = "items" if num_items_fn is not None else ("rows" if micro.uneven else "mean")
    sums = _MicroBatchSums()
    whole, reference_loss, engine, engine_loss, engine_denom = _both_passes(
        model, loss_fn, batch, micro, mode, named, sums, num_items_fn, backend, gradient_accumulation_fusion)
    sums.normalize(engine_denom)
    model_scale = max(_max_abs(g) for g in whole.values())
    diffs = tuple(
        _diff(name, p, whole[id(p)], sums.total.get(id(p)), sums.abs_total.get(id(p)), sums.num_terms.get(id(p), 0),
              engine[id(p)], GRAD_RTOL.get(p.dtype, 1e-5) if rtol is None else float(rtol), model_scale)
        for name, p in named
    )
    worst = max(diffs, key=lambda d: d.badness).name
    return EquivalenceReport(parameters=diffs, worst=worst, mode=mode, micro_batch_sizes=micro.sizes,
                             reference_loss=reference_loss, engine_loss=engine_loss)
