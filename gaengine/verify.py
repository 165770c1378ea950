"""``verify_equivalence``: does accumulating K micro-batches give the gradient of the whole batch?

It runs the batch twice on the same model — once whole with plain ``loss.backward()``, once split into
micro-batches through ``GradientAccumulator`` — and compares the two gradients parameter by parameter in
fp64. It catches the setups where accumulation is *not* equivalent to the large batch: BatchNorm in train
mode (micro-batch statistics), a summed loss averaged as if it were a mean, a per-micro-batch mean over a
varying number of tokens, anything else whose forward depends on the other rows of the batch. The model
is left exactly as it was: gradients, buffers (BatchNorm running statistics), training modes and the
global RNG state are restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gaengine.engine import _OWNER_ATTR, GradientAccumulator
from gaengine.utils import split_batch

__all__ = ["verify_equivalence", "EquivalenceReport", "ParameterDiff", "GRAD_RTOL"]

# Relative tolerance of a parameter's gradient (max |engine - reference| / max |reference|), keyed by the
# parameter's dtype. Neither side is exact: the whole batch and the micro-batches reduce the same per-row
# terms in a different order and in differently shaped kernels.
#
# * fp32: 1e-5. The reduction over rows is reordered (one reduction of N rows vs K of N/K plus an fp32 sum
#   of K); with unit roundoff u = 2^-24 ≈ 6e-8 the typical error grows like sqrt(N)·u (6e-6 at 10^4 rows;
#   the worst case N·u is not approached by blocked reductions): measured under 5e-7 for a 3-layer MLP on
#   24 to 1024 rows. A setup that is wrong (BatchNorm statistics, a mis-weighted mean) is off by 1e-3 to
#   1e-1 or more, so the margin goes both ways.
# * bf16 / fp16: the forward and backward run in the low-precision format on both sides, and each rounding
#   of an activation or a gradient (unit roundoff 2^-8 for bf16, 2^-11 for fp16) can land differently when
#   the kernel sees N rows instead of N/K; the errors compound through the layers, and both final ``.grad``
#   values are rounded once more (one ulp apart: up to 2^-7 for bf16). 2^-5 (bf16) and 2^-8 (fp16) allow
#   eight unit roundoffs, which a correct setup of a few layers stays under (measured: a 3-layer tanh MLP,
#   32 to 1024 rows, K = 4 to 16, stays under 2^-6 in bf16 and 2^-9 in fp16) and a wrong one does not (a
#   wrong setup moves gradients by percents to tens of percents).
# Roundoff scales with the terms being summed, not with their sum: a gradient that is zero in exact
# arithmetic (the bias of a layer followed by BatchNorm) is all roundoff on both sides. So a parameter is
# held to ``rtol * max(max |its reference|, max |reference of any parameter|)``.
# Pass ``rtol=`` to verify_equivalence for autocast (fp32 parameters, low-precision compute: use the
# autocast dtype's entry) or for deep models.
GRAD_RTOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 2.0**-5,
    torch.float16: 2.0**-8,
}


@dataclass(frozen=True)
class ParameterDiff:
    """The comparison of one parameter's gradient (all numbers in fp64, as Python floats).

    name: the parameter's name in ``model.named_parameters()``. shape, dtype: the parameter's.
    max_abs: ``max |engine - reference|`` over the elements (gradient units).
    max_rel: ``max_abs / max |reference|`` (0 when both are zero; inf when only the reference is zero).
    rtol: its relative tolerance (``GRAD_RTOL`` of its dtype, or ``rtol=``).
    bound: the largest ``max_abs`` that passes, ``rtol * max(max |reference|, model_scale)``, where
        ``model_scale`` is the largest ``|reference|`` element of the whole model: differences below ``rtol``
        of the model's largest gradient are roundoff even in a parameter whose own gradient is tiny (or
        zero in exact arithmetic). passed: ``max_abs <= bound`` (a NaN difference fails).
    A parameter that receives no gradient on a side (``.grad`` None) counts as a zero gradient there.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    max_abs: float
    max_rel: float
    rtol: float
    bound: float
    passed: bool

    @property
    def badness(self) -> float:
        """``max_abs / bound``: above 1 fails; inf for a NaN difference."""
        if self.max_abs == 0:
            return 0.0
        if math.isnan(self.max_abs) or self.bound == 0:
            return math.inf
        return self.max_abs / self.bound


@dataclass(frozen=True)
class EquivalenceReport:
    """What ``verify_equivalence`` found.

    parameters: one ``ParameterDiff`` per trainable parameter, in ``named_parameters()`` order.
    passed: every parameter is within its tolerance.
    worst: name of the parameter closest to (or furthest past) its bound (largest ``badness``).
    mode: how the micro-batches were weighted: ``"mean"`` (equal micro-batches, mean losses),
        ``"rows"`` (uneven split, mean losses weighted by their row counts in item mode) or ``"items"``
        (``num_items_fn`` given: summed losses normalized by the total item count).
    micro_batch_sizes: rows per micro-batch.
    reference_loss, engine_loss: the whole-batch loss (normalized like the gradient) and the engine's
        window loss (``StepResult.loss``), as floats.
    """

    parameters: tuple[ParameterDiff, ...]
    passed: bool
    worst: str
    mode: str
    micro_batch_sizes: tuple[int, ...]
    reference_loss: float
    engine_loss: float

    @property
    def max_abs(self) -> float:
        """Largest ``max_abs`` over the parameters."""
        return max((d.max_abs for d in self.parameters), default=0.0)

    @property
    def max_rel(self) -> float:
        """Largest ``max_rel`` over the parameters."""
        return max((d.max_rel for d in self.parameters), default=0.0)

    @property
    def failed(self) -> list[str]:
        """Names of the parameters outside their tolerance."""
        return [d.name for d in self.parameters if not d.passed]

    def table(self) -> str:
        """One row per parameter: name, shape, dtype, max abs diff, max rel diff, rtol, abs bound, ok/FAIL."""
        header = ("parameter", "shape", "dtype", "max abs diff", "max rel diff", "rtol", "abs bound", "")
        rows = [header] + [
            (d.name, "x".join(map(str, d.shape)) or "scalar", str(d.dtype).replace("torch.", ""),
             f"{d.max_abs:.3e}", f"{d.max_rel:.3e}", f"{d.rtol:.1e}", f"{d.bound:.3e}", "ok" if d.passed else "FAIL")
            for d in self.parameters
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        align = ["<", "<", "<", ">", ">", ">", ">", "<"]
        lines = ["  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(r, align, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        worst = next(d for d in self.parameters if d.name == self.worst)
        verdict = "PASSED" if self.passed else f"FAILED ({len(self.failed)} of {len(self.parameters)} parameters)"
        sizes = self.micro_batch_sizes
        rows = f"{sizes[0]}" if len(set(sizes)) == 1 else f"{list(sizes)}"
        summary = (f"gradient equivalence {verdict}: {len(sizes)} micro-batches of {rows} rows, mode {self.mode!r}; "
                   f"worst parameter {self.worst!r} (max abs diff {worst.max_abs:.3e}, max rel diff "
                   f"{worst.max_rel:.3e}); loss {self.reference_loss:.6g} whole batch vs {self.engine_loss:.6g} accumulated")
        return f"{summary}\n{self.table()}"


def _max_abs(x: torch.Tensor | None) -> float:
    return 0.0 if x is None or x.numel() == 0 else x.detach().abs().max().to(torch.float64).item()


def _diff(name: str, p: torch.Tensor, engine: torch.Tensor | None, reference: torch.Tensor | None,
          rtol: float, model_scale: float) -> ParameterDiff:
    """engine: p.shape, p.dtype or fp32, or None; reference: p.shape fp64, or None (None = zero gradient)."""
    zeros = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
    e = zeros if engine is None else engine.detach().to(torch.float64)
    r = zeros if reference is None else reference
    max_abs = _max_abs(e - r)
    scale = _max_abs(r)
    if max_abs == 0 or math.isnan(max_abs):
        max_rel = max_abs
    else:
        max_rel = max_abs / scale if scale > 0 else math.inf
    bound = rtol * max(scale, model_scale)
    passed = max_abs <= bound  # NaN compares False: a NaN gradient fails
    return ParameterDiff(name, tuple(p.shape), p.dtype, max_abs, max_rel, rtol, bound, passed)


def _to_float(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} must return a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must return a number or a one-element tensor, got {type(value).__name__}")
    return float(value)


def verify_equivalence(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    accumulation_steps: int,
    *,
    num_items_fn: Callable[[Any], int | torch.Tensor] | None = None,
    backend: str = "auto",
    rtol: float | None = None,
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
    rtol: one relative tolerance for every parameter instead of the dtype-keyed ``GRAD_RTOL``.

    Reference: ``loss_fn(model, batch).backward()`` in plain PyTorch (in item mode the summed loss's
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

    Both passes start from the same buffers and the same RNG state. Stochastic layers (dropout) compare
    equal only if they draw the same masks for a row in a micro-batch as in the whole batch (true on CPU
    for plain dropout, not in general): disable them for the check if they make it fail.

    The model is left exactly as it was: every parameter's ``.grad`` (the same tensor object, untouched),
    the parameters (no optimizer runs), every buffer (BatchNorm running statistics are restored), every
    module's ``training`` flag, and the global CPU and CUDA RNG states.

    Returns an ``EquivalenceReport``; ``str(report)`` is a summary line and a per-parameter table.
    Raises ``TypeError`` if ``model`` is not an ``nn.Module``, ``ValueError`` naming the argument for bad
    ``accumulation_steps`` / ``batch`` / ``rtol`` or a non-scalar loss, ``RuntimeError`` when a
    ``GradientAccumulator`` is attached to the model or ``torch.distributed`` runs more than one rank (the
    check is local to one process); exceptions from ``loss_fn`` propagate (the model is restored first).
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
    micro = split_batch(batch, accumulation_steps)
    mode = "items" if num_items_fn is not None else ("rows" if micro.uneven else "mean")

    all_params = list(model.parameters())
    saved_grads = [p.grad for p in all_params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    saved_modes = [(m, m.training) for m in model.modules()]
    device = named[0][1].device
    rng_devices = [device] if device.type == "cuda" else []

    def restore_buffers() -> None:
        with torch.no_grad():
            for b, saved in saved_buffers:
                b.copy_(saved)

    acc = None
    with torch.random.fork_rng(devices=rng_devices), torch.enable_grad():
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if rng_devices else None
        try:
            # ---- reference: the whole batch, plain PyTorch
            for p in all_params:
                p.grad = None  # backward accumulates into an existing .grad in place: never touch the saved one
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a one-element tensor (reduce the loss with .mean() or .sum())")
            loss.backward()
            denom = _to_float(num_items_fn(batch), "num_items_fn") if num_items_fn is not None else 1.0
            reference = {id(p): (None if p.grad is None else p.grad.detach().to(torch.float64) / denom) for _, p in named}
            reference_loss = float(loss.detach().to(torch.float64).reshape(())) / denom

            # ---- engine: the same batch in micro-batches, same starting buffers and RNG state
            for p in all_params:
                p.grad = None
            restore_buffers()
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)
            # The parameters, not the module: a BatchNorm warning is the user's accumulator's to give (it
            # fires once per module). No loss scaling: the reference backward is unscaled too, so fp16
            # gradients underflow alike, and a dynamic scale's first windows would overflow and skip.
            acc = GradientAccumulator([p for _, p in named], None, accumulation_steps=len(micro), max_grad_norm=None,
                                      backend=backend, loss_scale=None)
            for mb, rows in zip(micro, micro.sizes):
                if mode == "items":
                    acc.backward(loss_fn(model, mb), num_items=num_items_fn(mb))
                elif mode == "rows":
                    acc.backward(loss_fn(model, mb) * rows, num_items=rows)
                else:
                    acc.backward(loss_fn(model, mb))
            result = acc.step()
            engine = {id(p): p.grad for _, p in named}
            engine_loss = float(result.loss)
        finally:
            if acc is not None:
                acc.close()
            for p, g in zip(all_params, saved_grads):
                p.grad = g
            restore_buffers()
            for m, training in saved_modes:
                m.training = training

    model_scale = max(_max_abs(g) for g in reference.values())
    diffs = tuple(
        _diff(name, p, engine[id(p)], reference[id(p)],
              GRAD_RTOL.get(p.dtype, 1e-5) if rtol is None else float(rtol), model_scale)
        for name, p in named
    )

    worst = max(diffs, key=lambda d: d.badness).name
    return EquivalenceReport(parameters=diffs, passed=all(d.passed for d in diffs), worst=worst, mode=mode,
                             micro_batch_sizes=micro.sizes, reference_loss=reference_loss, engine_loss=engine_loss)
