"""The window stage of the pipeline: a micro-batch's checks, the window's stats all-reduce and the window's end.

``GradientAccumulator`` drives one accumulation window (``gaengine.engine``); ``WindowEnd``, built once at
construction (``gaengine.construction``) over the window's stages (``gaengine.stages.WindowStages``: the ``Window``, the schedule,
the ranks' counts, the loss scale, the skips, the noise scale, the window's BatchNorm, the lending of the gradient),
the strategy (its accumulation, reduction and update), the membership stage (``gaengine.membership``) and the
``lr_scheduler``'s watch, is what it runs at the window's edges. It owns the loss scale (chosen at the first
``backward()`` under ``loss_scale="auto"``) and the "divided by K" warning's flag; what the engine may change at run
time (``max_grad_norm``, ``micro_batch_size``, ``min_loss_scale``, the optimizer, the ``lr_scheduler``, the parameters'
names) it is given at each call (``StepSettings``), and K it asks of the schedule, so it never holds a stale copy:

* ``check_micro_batch``: ``backward()``'s checks before anything is accumulated (and the warning for a loss the
  plain recipe divided by K); ``prepare_micro_batch``: the micro-batch made ready for autograd;
* ``launch_window_stats``: the window's last reductions and its stats all-reduce, with what every rank must hold
  alike in a window (``WINDOW_SETTINGS``);
* ``window_to_step`` / ``complete_window``: ``step()``'s (and ``begin_step()``'s) checks, then the window made
  complete for its update (its reductions waited for, its totals and denominator: ``gaengine.lending``);
* ``apply_window``: the norm and clip coefficient, the noise scale, the update (``gaengine.sharding.Update``) and the
  ``StepResult``; ``end_step``: the ranks' counts, the loss scale, the schedule and a new window;
* ``drop_reductions`` / ``raise_count_mismatch``: a dropped window's collectives matched on every rank, and the
  error of a window whose ranks disagreed.

Nothing here is public API: the engine's methods are, and their docstrings say what these raise.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gaengine.lending import CompleteWindow, step_norm, window_denominator
from gaengine.noise import NoiseEstimate
from gaengine.optimizers import takes_grad_scale
from gaengine.protocol import REDUCTIONS
from gaengine.scaler import autocast_loss_scaler, check_loss, warn_if_divided_by_k
from gaengine.update import SchedulerWatch
from gaengine.window import FAILED_WINDOW, MEMBERSHIP_SETTING, StepResult, check_num_items

if TYPE_CHECKING:  # annotations only: the strategy, the fused forwards and the membership stage sit above this module
    from gaengine.fusion import LinearFusion
    from gaengine.membership import MembershipStage
    from gaengine.sharding import ShardingStrategy
    from gaengine.stages import WindowStages

__all__ = ["WINDOW_SETTINGS", "StepSettings", "WindowEnd"]

WINDOW_SETTINGS = ("accumulation_steps", "max_grad_norm", MEMBERSHIP_SETTING)
"""The names of what every rank must hold alike in a window, compared in its stats all-reduce
(``WindowEnd.launch_window_stats``: 8 agreement terms each, ``gaengine.reduce.setting_terms``)."""


class StepSettings(NamedTuple):
    """What the engine may change at run time, read from it at each call (``GradientAccumulator``'s attributes of
    the same names): the clip threshold (None: no clipping), the samples per micro-batch (or None), the loss scale's
    floor, the optimizer and ``lr_scheduler`` (either None) and the model's ``(name, parameter)`` pairs."""

    max_grad_norm: float | None
    micro_batch_size: int | None
    min_loss_scale: float
    optimizer: Any
    lr_scheduler: Any
    named_params: list[tuple[str, torch.Tensor]]


class WindowEnd:
    """The window stage of the pipeline (module docstring): a micro-batch's checks and preparation, the window's
    stats all-reduce, ``step()``'s checks, the complete window, its update and a new window.

    stages: the window's stages (``WindowStages``). sharding: the strategy. membership: the parameters joining or
    leaving and the watches on the model (``gaengine.membership.MembershipStage``). scheduler: the ``lr_scheduler``
    stepped outside ``step()`` (``gaengine.update.SchedulerWatch``). fusion: the fused Linear forwards, or None.
    overlap_grad_reduce: the option (``gaengine.config``). device, world_size: the accumulator's.

    ``scaler``: the loss scale, this stage's own (``loss_scale="auto"`` chooses it at the first ``backward()``).
    Nothing here is public API: the engine's methods are, and their docstrings say what these raise."""

    def __init__(self, stages: WindowStages, sharding: ShardingStrategy, membership: MembershipStage,
                 scheduler: SchedulerWatch, fusion: LinearFusion | None, overlap_grad_reduce: bool,
                 device: torch.device, world_size: int) -> None:
        self.window, self.schedule = stages.window, stages.schedule
        self.counts, self.skips = stages.counts, stages.skips
        self.scaler, self.auto_loss_scale = stages.scaler, stages.auto_loss_scale
        self.noise, self.batchnorm, self.lending = stages.noise, stages.batchnorm, stages.lending
        self.sharding, self.membership, self.scheduler, self.fusion = sharding, membership, scheduler, fusion
        self.overlap_grad_reduce, self.device, self.world_size = overlap_grad_reduce, device, world_size
        self.distributed = world_size > 1
        self.divided_warned = False  # LossDividedByKWarning given (once per accumulator)

    @property
    def accumulation_steps(self) -> int:
        """K of the current window (the schedule's, asked once per window)."""
        return self.schedule.k(self.window.num_micro_batches)

    def clear_grads(self) -> None:
        """Drop the ``.grad`` the accumulator left on the parameters (the strategy's, then the window's flag)."""
        self.sharding.accumulation.clear_grads()
        self.window.grads_left = False

    def check_micro_batch(self, loss: torch.Tensor, num_items: int | torch.Tensor | None,
                          settings: StepSettings) -> int | torch.Tensor | None:
        """``backward()``'s checks before anything is accumulated (its errors; the window as it was): ``loss``, the
        model not moved, the ``lr_scheduler`` not stepped outside ``step()``, the window neither failed nor complete,
        the last window's per-rank counts (several ranks), and ``num_items`` (returned checked, or None); then the
        ``LossDividedByKWarning`` of a window's first mean-mode loss divided by K (once per accumulator)."""
        check_loss(loss)
        window, membership = self.window, self.membership
        membership.model.check()
        membership.replaced.check(window.num_micro_batches == 0)  # replaced parameters: adoptable, else ValueError
        self.scheduler.check()
        if window.failed:
            raise RuntimeError(FAILED_WINDOW)
        if self.counts.pending:  # the last window's per-rank counts, unread by its step(): RankCounts.take_error
            self.raise_count_mismatch(self.counts.take_error(self.schedule, self.scaler), settings)
        k = self.accumulation_steps
        if window.num_micro_batches >= k:
            raise RuntimeError(
                f"the accumulation window already holds accumulation_steps={k} micro-batches; "
                "call acc.step() before the next acc.backward()")
        window.check_next(num_items is not None)
        num_items = None if num_items is None else check_num_items(num_items, self.device)
        if window.num_micro_batches == 0 and num_items is None and not self.divided_warned:
            # The plain recipe's `loss / K` (mean mode; the window's K, asked of a schedule once per window):
            # LossDividedByKWarning once per accumulator, before anything is accumulated. O(1) per window.
            self.divided_warned = warn_if_divided_by_k(loss, k, stacklevel=4)  # the user's line
        return num_items

    def prepare_micro_batch(self, loss: torch.Tensor, backward_kwargs: dict[str, Any],
                            settings: StepSettings) -> tuple[torch.Tensor, bool, bool]:
        """A checked micro-batch made ready for autograd, after the window boundary's adoptions: the reductions'
        header (several ranks, ``gaengine.protocol``), the loss's graph claimed for this window, the ``.grad`` left by
        the last window dropped, the parameters' all-gathers complete (``overlap_param_gather``), the reduction
        prepared (``Reduction.begin_backward``) and the loss scale chosen at the first backward (``loss_scale="auto"``
        under fp16 autocast, its floor ``settings.min_loss_scale``). Returns ``(scaled, last, armed)``: the loss to run
        backward on (times the loss scale), whether this is the window's last micro-batch, and whether the hooks
        launch each bucket's collective as it completes."""
        window, sharding, ranks = self.window, self.sharding, self.membership.ranks
        k = self.accumulation_steps
        if ranks is not None:  # the headers of the reductions (gaengine.protocol)
            ranks.protocol.before_backward(self.schedule.update_index, window.num_micro_batches,
                                           window.num_micro_batches == k - 1,
                                           sharding.reduction.reduces_every_micro_batch)
        window.claim_graph(loss, bool(backward_kwargs.get("retain_graph") or backward_kwargs.get("create_graph")))
        if sharding.accumulation.take_stale() | window.grads_left:  # both read: take_stale() clears its flag
            self.clear_grads()
        last = window.num_micro_batches == k - 1
        # The parameters whole (their all-gathers complete, overlap_param_gather), then the reduction prepares the
        # micro-batch (Reduction.begin_backward: armed, the hooks launch each bucket's collective as it completes);
        # where the hooks restart their written flags (zero_stage=2), the window keeps which parameters it reached.
        sharding.update.wait_gathers()
        start = sharding.reduction.begin_backward(window.num_micro_batches == 0, last, self.overlap_grad_reduce)
        if start.used is not None:
            window.mark_used(start.used)
        if self.auto_loss_scale:  # the first backward: fp16 autocast makes loss_scale="auto" dynamic
            self.scaler = autocast_loss_scaler(self.device, settings.min_loss_scale)
            self.auto_loss_scale = False
        scaled = loss if self.scaler is None else loss * self.scaler.scale
        return scaled, last, start.armed

    def launch_window_stats(self, max_grad_norm: float | None) -> None:
        """The window's last reductions and its stats all-reduce (``Reduction.launch_window_stats``, with what every
        rank must hold alike, ``max_grad_norm`` among it, and the noise-scale terms), kept in the window
        (``Window.stats``)."""
        # What every rank must have set alike for this window, compared in its stats all-reduce
        # (gaengine.reduce.WindowStats.settings_mismatch): K, max_grad_norm and the parameters joined or left.
        window, sharding = self.window, self.sharding
        values = (self.accumulation_steps, max_grad_norm, self.membership.members.window_term(sharding.params))
        window.settings = tuple(zip(WINDOW_SETTINGS, values, strict=True))
        window.stats = sharding.reduction.launch_window_stats(window, None if self.noise is None else (
            self.noise.window_terms(sharding.accumulation, window, self.scaler)))
        if self.membership.ranks is not None:
            self.membership.ranks.protocol.reducing = False

    def drop_reductions(self, max_grad_norm: float | None) -> None:
        """``zero_grad()`` on several ranks after this rank opened its window's reductions (``gaengine.protocol``)
        without launching its stats all-reduce (its last micro-batch's backward raised): the buckets not launched
        and the stats all-reduce are launched, its count marked dropped, so the other ranks' collectives are matched
        and their ``step()`` raises naming this rank. The window is dropped either way: errors are ignored (a peer
        that failed too), the waits are ``zero_grad()``'s."""
        self.membership.ranks.protocol.reducing = False
        if self.window.stats is not None:
            return
        self.window.fail()  # its stats carry gaengine.reduce.DROPPED_COUNT
        with contextlib.suppress(Exception):  # the window is dropped either way
            self.launch_window_stats(max_grad_norm)

    def window_to_step(self, force: bool, lends: bool, settings: StepSettings) -> int | None:
        """``step()``'s checks (its errors, nothing changed): the window's micro-batch count k, or None while the
        window is incomplete (or empty) and not forced. lends: the window's gradient is to be lent in ``.grad``
        (``before_update``, ``begin_step``), which needs the whole gradient on every rank."""
        sharding, membership = self.sharding, self.membership
        if lends:
            sharding.rank_layout.check_lend(sharding.name)
        self.scheduler.check()
        window = self.window
        k = window.num_micro_batches
        if self.counts.pending:  # the last window's per-rank counts, unread by its step(): RankCounts.take_error
            self.raise_count_mismatch(self.counts.take_error(self.schedule, self.scaler), settings)
        if k == 0 or (k < self.accumulation_steps and not force):
            return None
        membership.model.check()
        membership.replaced.follow_storage()  # p.data = x of a parameter laid out in a flat buffer (gaengine.replaced)
        if window.failed:
            raise RuntimeError(FAILED_WINDOW)
        if membership.ranks is not None:  # the ranks changed their parameters differently at this window's start
            error = membership.ranks.take()
            if error is not None:
                raise error
        membership.members.refuse_unmanaged_grads(sharding.params)
        if self.fusion is not None:  # a hook registered mid-window on a fused parameter: RuntimeError
            self.fusion.check_window(sharding.params, settings.named_params)
        return k

    def complete_window(self, k: int, max_grad_norm: float | None) -> CompleteWindow:
        """The window of ``k`` micro-batches made complete for its update: its reductions complete (several ranks;
        ``force=True`` on a partial window: nothing is launched yet, so its reductions and stats are launched first,
        ``Reduction.end_partial_window``, and ``partial`` says so), its totals, the parameters no micro-batch reached
        (their gradient zeroed) and the denominator of its raw sums (``gaengine.lending.window_denominator``)."""
        window, sharding = self.window, self.sharding
        partial = self.distributed and window.stats is None
        if partial:
            self.membership.ranks.protocol.open(REDUCTIONS, self.schedule.update_index)  # gaengine.protocol
            sharding.reduction.end_partial_window(self.accumulation_steps - k)
            self.launch_window_stats(max_grad_norm)
        if self.distributed:
            sharding.reduction.wait()
        totals = window.totals(self.world_size)
        unwritten = sharding.accumulation.unwritten(window)
        sharding.reduction.zero_unused(unwritten)  # parameters with no gradient in this window (unused branches)
        grad_denom, invalid_items, no_items = window_denominator(
            window, totals[1], None if self.scaler is None else self.scaler.scale, self.distributed)
        return CompleteWindow(k, partial, totals, unwritten, grad_denom, invalid_items, no_items)

    def apply_window(self, lent: CompleteWindow, settings: StepSettings) -> StepResult:
        """The complete window ``lent`` applied: its norm, skip flag and clip coefficient (``Reduction.norm`` over the
        window's sums, or ``Lending.norm_of_lent`` over the gradient lent in ``.grad``, maybe edited), the noise scale
        (before the update: ``main_grad`` and the scale are still the window's), the update or, without an optimizer,
        the gradients exposed in ``.grad``, then ``end_step``. Returns the window's ``StepResult``."""
        window, sharding, max_grad_norm = self.window, self.sharding, settings.max_grad_norm
        k, partial = lent.k, lent.partial
        loss_sum, denom, num_items, mismatch = lent.totals
        norm = (sharding.reduction.norm(lent.grad_denom, max_grad_norm) if lent.grads is None else
                self.lending.norm_of_lent(lent, sharding.accumulation, max_grad_norm))
        skipped, grad_norm = step_norm(lent, norm, mismatch)
        unwritten, invalid_items = lent.unwritten, lent.invalid_items
        self.lending.lent = None
        loss_scale = None if self.scaler is None else self.scaler.scale.clone()
        noise: NoiseEstimate | None = None
        if self.noise is not None:  # before the update: main_grad and the scale are still the window's
            terms = (window.stats.extra() if self.distributed else
                     self.noise.window_terms(sharding.accumulation, window, self.scaler))
            noise = self.noise.update(terms, norm.grad_norm.double().square(), denom, skipped)
        if settings.optimizer is None:
            sharding.update.expose_grads(norm.coef, unwritten)
            window.grads_left = True
        else:
            sharding.update.apply(norm.coef, skipped, unwritten, settings.lr_scheduler)
            self.scheduler.stepped()
        if lent.keep:  # begin_step(): .grad holds the gradient as applied (edited, clipped) until the next backward
            lent.grads.lend()
            window.grads_left = True
        result = StepResult(grad_norm=grad_norm, clip_coef=norm.clip_coef, skipped=skipped,
                            num_micro_batches=k, num_items=num_items, loss=loss_sum / denom, loss_scale=loss_scale,
                            invalid_num_items=invalid_items,
                            **({} if noise is None else dict(grad_noise_scale=noise.grad_noise_scale,
                                                             noise_trace_sigma=noise.trace_sigma,
                                                             noise_grad_sq=noise.grad_sq)))
        self.end_step(result, partial, mismatch, norm.skipped, settings)
        return result

    def end_step(self, result: StepResult, partial: bool, mismatch: torch.Tensor | None, overflow: torch.Tensor,
                 settings: StepSettings) -> None:
        """After the update: the ranks' counts (read now where ``step()`` reads the device anyway or ends an epoch,
        ``partial``; else by the next ``backward()``/``step()``, which then undoes what this step counted), the loss
        scale (``overflow``: the gradient itself was non-finite), the window's BatchNorm, the schedule and the skips,
        then a new window (the strategy's too: ``end_window``). Raises the count mismatch's error, or the loss
        scale's floor error."""
        k, window, schedule, scaler = result.num_micro_batches, self.window, self.schedule, self.scaler
        optimizer = settings.optimizer
        counts = None if mismatch is None else self.counts.read(
            # read now where step() reads its skip flag on the host anyway: a non-fused optimizer (it cannot skip on
            # the device), an lr_scheduler (it runs on the host) or max_consecutive_skips
            window.stats, now=partial or window.stats.host_counts is not None or settings.lr_scheduler is not None or (
                optimizer is not None and not takes_grad_scale(optimizer)) or self.skips.limit is not None,
            saved=lambda: (schedule.update_index, schedule.items_seen, None if scaler is None or not
                           scaler.dynamic else (scaler.scale.clone(), scaler.growth_tracker.clone())))
        counts, settings_differ = counts if counts is not None else (None, [])
        differ = counts is not None and (any(c != k for c in counts) or bool(settings_differ))
        if scaler is not None and not differ:
            scaler.update(overflow.to(torch.float32))
        if self.batchnorm is not None:
            self.batchnorm.end_window()
        schedule.observe(result)
        if not differ:
            schedule.advance(k, self.world_size, settings.micro_batch_size)
            self.skips.observe(overflow, result.loss_scale,
                               lambda: self.sharding.accumulation.finite_by_param(settings.named_params))
        window.reset()  # the strategy resets the hooks' part (end_window, drain)
        if self.noise is not None:
            self.noise.reset()
        # The hooks' window is reset too; the first window's end lays the buffer out in its arrival order (a
        # collective: every rank gets here).
        window.grads_left |= self.sharding.end_window()
        if differ:
            self.raise_count_mismatch(self.counts.error(counts, differ=settings_differ), settings)
        if scaler is not None and scaler.floor_reached():
            raise scaler.floor_error()

    def raise_count_mismatch(self, error: Exception | None, settings: StepSettings) -> None:
        """Raise ``error``, that of a window whose ranks held different micro-batch counts or settings
        (``gaengine.window.RankCounts``); without an optimizer, the gradients ``step()`` left in ``.grad`` are
        dropped first. Nothing for None."""
        if error is None:
            return
        if settings.optimizer is None:
            self.clear_grads()
        raise error
