"""The gradient noise scale of an accumulation window, measured for free (``measure_noise_scale=True``).

McCandlish, Kaplan, Amodei et al., *An Empirical Model of Large-Batch Training* (arXiv 1812.06162), appendix A.1:
a gradient averaged over B samples has ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, so the squared norms of a small batch
and of a big batch give unbiased estimates of the true gradient's squared norm ``|G|^2`` and of the trace of the
per-sample gradient covariance ``tr(Sigma)`` (eqs. A.2-A.3); ``B_simple = tr(Sigma) / |G|^2`` is the batch size
above which more data per update stops paying.

An accumulation window has both for free. The small batches are its micro-batches, one per rank: their squared
norms ``source_sumsq`` come from the accumulate pass (``Hooks.window_source_sumsq()``, no extra pass over memory).
The big batch is the whole window across ranks, whose squared norm ``step()`` computes anyway. With micro-batch k
holding ``n_k`` samples (its ``num_items`` in item mode; 1 in mean mode, where batch sizes count micro-batches)
and ``N = sum_k n_k`` over the window and all ranks (M micro-batches in all, those with ``n_k > 0``)::

    |g_k|^2   = source_sumsq_k / (n_k * loss_scale)^2        item mode: the gradient of the summed loss / n_k
              = source_sumsq_k / loss_scale^2                mean mode
    |G_big|^2 = the window's normalized gradient's squared norm (before clipping)
    S  = (mean_k |g_k|^2 - |G_big|^2) / (mean_k (1 / n_k) - 1 / N)          estimates tr(Sigma)
    G2 = |G_big|^2 - S / N                                                   estimates |G|^2

Since ``E|g_k|^2 = |G|^2 + tr(Sigma) / n_k`` and ``E|G_big|^2 = |G|^2 + tr(Sigma) / N``, both are unbiased for any
micro-batch sizes; with equal sizes (``n_k = B_small``, ``N = B_big``) they are eqs. A.2-A.3 with the mean over the
window's micro-batches as the small-batch estimate. With ``zero_stage`` 1 or 2 every norm is there as
without sharding: each rank's micro-batch norms are taken as the hooks accumulate them, before any reduce-scatter,
and the window's norm comes from the shards. With an FSDP2 model (``gaengine.fsdp2``) the hooks see only this
rank's shard of each micro-batch's gradient already summed over the ranks (FSDP2 reduce-scatters every
micro-batch), so the small batch is the global micro-batch: its ``n_k`` is the sum over ranks (items in item mode;
d micro-batches in mean mode, so that ``B_simple`` keeps the unit of the other modes, a rank's micro-batch) and its
squared norm the sum over ranks of the shards' sums of squares, both summed in the window's stats all-reduce
before they are combined (``WindowNoise.global_terms``). A window of one micro-batch on one rank has no small batch
apart from the big one (the denominator is 0): it leaves the averages unchanged, as does a skipped window (a
non-finite gradient) and one whose source norms are unknown (NaN rows, see ``Hooks.window_source_sumsq``).

The paper advises averaging numerator and denominator separately, not the ratio: ``NoiseScale`` keeps
exponential moving averages of S and G2 (decay ``ema``), each divided by ``1 - ema^t`` (t: windows averaged so
far) as Adam corrects its moments, so the first window reports its own estimate. Everything stays on the device:
no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NoiseEstimate", "NoiseScale", "check_noise_scale_ema", "WindowNoise"]


def check_noise_scale_ema(value: object) -> float:
    """``value`` as the averages' decay: a float in (0, 1); ``ValueError`` naming ``noise_scale_ema`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ValueError(f"noise_scale_ema must be a float in (0, 1) (the decay of the noise scale's moving "
                         f"averages, e.g. 0.95), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class NoiseEstimate:
    """The averaged estimates after a window: 0-d fp32 tensors on the accumulator's device (NaN until a window
    could be measured).

    grad_noise_scale: ``B_simple = trace_sigma / grad_sq``, in samples (item mode: items, as ``num_items``
        counts them) or in micro-batches (mean mode).
    trace_sigma: the bias-corrected moving average of ``tr(Sigma)``, the trace of the per-sample gradient
        covariance (units of squared gradient, x items in item mode, x micro-batches in mean mode).
    grad_sq: the bias-corrected moving average of ``|G|^2``, the true gradient's squared L2 norm.
    """

    grad_noise_scale: torch.Tensor
    trace_sigma: torch.Tensor
    grad_sq: torch.Tensor


class NoiseScale:
    """Bias-corrected moving averages of tr(Sigma) and |G|^2 over accumulation windows (see the module docstring).

    ema: decay of both averages, a float in (0, 1) (``ValueError`` otherwise). device: where the state lives.
    State: three 0-d fp64 tensors on ``device`` (the two averages and ``ema^t``), in ``state_dict()``.
    """

    def __init__(self, ema: float, device: torch.device | str) -> None:
        self.ema = check_noise_scale_ema(ema)
        self.device = torch.device(device)
        self.trace_avg = torch.zeros((), dtype=torch.float64, device=self.device)
        self.grad_sq_avg = torch.zeros((), dtype=torch.float64, device=self.device)
        self.decay_pow = torch.ones((), dtype=torch.float64, device=self.device)  # ema ** (windows averaged)

    @staticmethod
    def small_batch_terms(source_sumsq: torch.Tensor, sizes: torch.Tensor | None,
                          loss_scale: torch.Tensor | None) -> torch.Tensor:
        """This rank's share of the small-batch terms: ``(3,)`` fp64 on the device, summed over ranks as is.

        source_sumsq: ``(k,)`` fp32, the squared norms of the window's micro-batch gradients as produced
            (loss-scaled; of the summed loss in item mode). sizes: ``(k,)`` fp64 items per micro-batch (item
            mode) or None (mean mode: one micro-batch each). loss_scale: 0-d fp32 or None.
        Returns ``[sum_k |g_k|^2, sum_k 1 / n_k, M]`` over the micro-batches with ``n_k > 0``.
        """
        sq = source_sumsq.to(torch.float64)
        if loss_scale is not None:
            sq = sq / loss_scale.to(torch.float64).square()
        if sizes is None:
            count = torch.full((), float(sq.numel()), dtype=torch.float64, device=sq.device)  # a fill, no copy
            return torch.stack([sq.sum(), count, count])
        present = sizes > 0  # an empty micro-batch (num_items=0 as a tensor) is no sample of the gradient
        inv = torch.where(present, 1.0 / sizes.clamp(min=1e-300), torch.zeros_like(sizes))
        return torch.stack([torch.where(present, sq * inv.square(), torch.zeros_like(sq)).sum(), inv.sum(),
                            present.to(torch.float64).sum()])

    def update(self, terms: torch.Tensor, big_sq: torch.Tensor, total: torch.Tensor,
               skipped: torch.Tensor) -> NoiseEstimate:
        """Average in one window; returns the estimates after it.

        terms: ``(3,)`` fp64, ``small_batch_terms`` summed over ranks. big_sq: 0-d, the window's normalized
        gradient's squared norm (before clipping, loss scale undone). total: 0-d, N (items in item mode,
        micro-batches x world size in mean mode). skipped: 0-d bool, the update was skipped.
        """
        big = big_sq.to(torch.float64)
        n = total.to(torch.float64)
        sum_g, sum_inv, count = terms.unbind()
        denom = sum_inv / count - 1.0 / n
        trace = (sum_g / count - big) / denom
        grad_sq = big - trace / n
        ok = ~skipped & (denom > 0) & torch.isfinite(trace) & torch.isfinite(grad_sq)
        a = self.ema
        # Only a measured window moves the averages and their bias correction (Adam's 1 - beta^t).
        self.trace_avg = torch.where(ok, a * self.trace_avg + (1.0 - a) * trace, self.trace_avg)
        self.grad_sq_avg = torch.where(ok, a * self.grad_sq_avg + (1.0 - a) * grad_sq, self.grad_sq_avg)
        self.decay_pow = torch.where(ok, self.decay_pow * a, self.decay_pow)
        return self.estimate()

    def estimate(self) -> NoiseEstimate:
        """The current estimates (NaN before any measured window): 0-d fp32 on the device, no host sync."""
        correction = 1.0 - self.decay_pow  # 0 before the first measured window: 0 / 0 = NaN
        trace = self.trace_avg / correction
        grad_sq = self.grad_sq_avg / correction
        return NoiseEstimate(grad_noise_scale=(trace / grad_sq).to(torch.float32),
                             trace_sigma=trace.to(torch.float32), grad_sq=grad_sq.to(torch.float32))

    def state_dict(self) -> dict:
        """The averages as CPU tensors (and the decay, checked on load)."""
        return {"ema": self.ema, "trace_avg": self.trace_avg.detach().cpu().clone(),
                "grad_sq_avg": self.grad_sq_avg.detach().cpu().clone(),
                "decay_pow": self.decay_pow.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; ``ValueError`` when it was saved with another ``noise_scale_ema``."""
        if float(state["ema"]) != self.ema:
            raise ValueError(f"state was saved with noise_scale_ema={state['ema']}, this accumulator has {self.ema}: "
                             "build it with the same noise_scale_ema to resume the averages")
        self.trace_avg = state["trace_avg"].to(self.device, torch.float64)
        self.grad_sq_avg = state["grad_sq_avg"].to(self.device, torch.float64)
        self.decay_pow = state["decay_pow"].to(self.device, torch.float64)


class WindowNoise:
    """The accumulator's noise-scale bookkeeping: the averages (``NoiseScale``), and per window the item count of
    each micro-batch (item mode) and, after a mid-window resume, the source norms of the micro-batches the saved
    window already held (the hooks measure only those since the resume).

    ema: as ``NoiseScale``. device: where the averages and the terms live.
    """

    def __init__(self, ema: float, device: torch.device | str) -> None:
        self.scale = NoiseScale(ema, device)
        self.device = self.scale.device
        self.sizes: list[int | float | torch.Tensor] = []  # items per micro-batch of the window (item mode)
        self.carry: torch.Tensor | None = None  # (j,) fp32: source norms of a window saved mid-window
        self.per_micro_batch = False  # terms() gave per-micro-batch rows to sum over ranks (global micro-batches)

    @property
    def ema(self) -> float:
        return self.scale.ema

    def reset(self) -> None:
        """A new window."""
        self.sizes = []
        self.carry = None

    def add_micro_batch(self, num_items: int | torch.Tensor | None) -> None:
        """One micro-batch of the window ended: its item count (item mode; a 0-d fp64 device tensor or a Python
        number), or None (mean mode)."""
        if num_items is not None:
            self.sizes.append(num_items)

    def sources(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """``(k,)`` fp32 on the device: the source norms of the window's micro-batches so far, a resumed window's
        first; ``rows``: the hooks' (``Hooks.window_source_sumsq()``, through
        ``gaengine.accumulation.Accumulation.source_norms``), which hold only the ones since the resume."""
        if self.carry is not None:
            rows = self.carry if rows is None or rows.numel() == 0 else torch.cat([self.carry, rows])
        return rows

    def window_terms(self, accumulation: Any, window: Any, scaler: Any) -> torch.Tensor:
        """``terms`` of this rank's window: the hooks' source norms (``accumulation``, a
        ``gaengine.accumulation.Accumulation``, and the factor its sources are reduced by), ``window``'s micro-batch
        count and item mode (a ``gaengine.window.Window``), the loss scale of ``scaler`` (or None)."""
        return self.terms(accumulation.source_norms(), accumulation.sources_reduced_by(), window.num_micro_batches,
                          bool(window.item_mode), None if scaler is None else scaler.scale)

    def terms(self, rows: torch.Tensor | None, reduced_by: float | None, num_micro_batches: int, item_mode: bool,
              loss_scale: torch.Tensor | None) -> torch.Tensor:
        """This rank's small-batch terms of the window, from the hooks' source norms ``rows`` (``sources``; one
        reduction, once per window) and the items of each micro-batch; summed over ranks as they are (the window's
        stats all-reduce).

        The small batch is this rank's micro-batch: ``(3,)`` fp64 on the device (``NoiseScale.small_batch_terms``).
        When the hooks' sources are shards of the global micro-batch (``reduced_by`` = f, not None:
        ``ShardingStrategy.sources_reduced_by``, from ``gaengine.fsdp2.NativeShardHooks``, whose sources are this rank's
        shard of the sum over ranks of the micro-batch's gradients divided by FSDP2's divide factor f), the small
        batch is the global micro-batch k: its squared norm and its size are sums over ranks, combined only after
        the sum (``global_terms``). Then
        ``(2k,)`` fp64: ``[f^2 |shard_k|^2 / loss_scale^2 for k] + [n_k of this rank for k]`` (n_k: items in item
        mode, 1 in mean mode), and ``update`` combines the summed rows.
        ``RuntimeError`` when the hooks measured another number of micro-batches than the window holds (a bug)."""
        rows = self.sources(rows)
        if rows is None or rows.numel() != num_micro_batches:
            raise RuntimeError(
                f"gaengine: the hooks measured {0 if rows is None else rows.numel()} micro-batch gradient norms for "
                f"a window of {num_micro_batches} micro-batches; the noise scale cannot be measured (a bug: "
                "please report it with the backend and `gaengine info`)")
        sizes = None
        if item_mode:
            if all(not isinstance(s, torch.Tensor) for s in self.sizes):
                sizes = torch.tensor(self.sizes, dtype=torch.float64).to(self.device, non_blocking=True)
            else:
                sizes = torch.stack([s if isinstance(s, torch.Tensor) else
                                     torch.full((), float(s), dtype=torch.float64, device=self.device)
                                     for s in self.sizes])
        self.per_micro_batch = reduced_by is not None
        if reduced_by is None:
            return NoiseScale.small_batch_terms(rows, sizes, loss_scale)
        sq = rows.to(torch.float64) * (float(reduced_by) ** 2)
        if loss_scale is not None:
            sq = sq / loss_scale.to(torch.float64).square()
        if sizes is None:
            sizes = torch.ones(num_micro_batches, dtype=torch.float64, device=sq.device)
        return torch.cat([sq, sizes.to(sq.device)])

    @staticmethod
    def global_terms(rows: torch.Tensor) -> torch.Tensor:
        """The small-batch terms of global micro-batches: ``rows`` ``(2k,)`` fp64, ``terms()``'s per-micro-batch
        rows summed over the ranks (``[|G_k|^2 x n_k^2 ...] + [n_k ...]``, ``G_k`` the global micro-batch's
        normalized gradient: item mode ``sum_r g_rk / n_k`` with ``n_k = sum_r n_rk`` items, mean mode
        ``sum_r g_rk / d`` with ``n_k = d`` micro-batches). Returns ``(3,)`` fp64 as
        ``NoiseScale.small_batch_terms``: ``[sum_k |G_k|^2, sum_k 1 / n_k, M]`` over the ``n_k > 0``."""
        k = rows.numel() // 2
        return NoiseScale.small_batch_terms(rows[:k], rows[k:], None)

    def update(self, terms: torch.Tensor, big_sq: torch.Tensor, total: torch.Tensor,
               skipped: torch.Tensor) -> NoiseEstimate:
        """``NoiseScale.update``: average in the window. terms: ``terms()`` summed over ranks (per-micro-batch
        rows are combined here, ``global_terms``)."""
        if self.per_micro_batch:
            terms = self.global_terms(terms)
        return self.scale.update(terms, big_sq, total, skipped)

    def state_dict(self, rows: torch.Tensor | None, num_micro_batches: int) -> dict:
        """The averages and, mid-window, the source norms (``rows``: the hooks', as ``sources`` takes them; None
        between windows) and sizes of the micro-batches so far."""
        rows = self.sources(rows) if num_micro_batches else None
        return {**self.scale.state_dict(), "sources": None if rows is None else rows.detach().cpu().clone(),
                "sizes": [float(s) for s in self.sizes]}

    def check_state(self, state: dict | None, num_micro_batches: int) -> None:
        """``ValueError`` (nothing changed) for a state this cannot resume: another ``noise_scale_ema``, or one
        saved mid-window without the noise scale (its micro-batches' norms are unknown)."""
        if state is not None and float(state["ema"]) != self.ema:
            raise ValueError(f"state was saved with noise_scale_ema={state['ema']}, this accumulator has "
                             f"{self.ema}: build it with the same noise_scale_ema to resume the averages")
        if state is None and num_micro_batches:
            raise ValueError("state was saved mid-window without measure_noise_scale, so the norms of its micro-batches "
                             "are unknown: resume it without measure_noise_scale, or from a state saved between windows")

    def load_state_dict(self, state: dict | None, num_micro_batches: int) -> None:
        """Restore ``state_dict()`` (checked by ``check_state``); the hooks' own window must be reset before."""
        self.reset()
        if state is None:
            return
        self.scale.load_state_dict(state)
        rows = state["sources"]
        self.carry = None if rows is None or not num_micro_batches else rows.to(self.device)
        self.sizes = [int(s) if float(s).is_integer() else float(s) for s in state["sizes"]]
