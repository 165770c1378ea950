"""The window stage of the pipeline: a micro-batch's checks, the window's stats all-reduce and the window's end.

``GradientAccumulator`` drives one accumulation window (``gaengine.engine``); this module is what it runs at the
window's edges, over the accumulator's stages (the ``Window``, the schedule, the ranks' counts, the loss scale, the
noise scale, the strategy's accumulation, reduction and update):

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

from typing import TYPE_CHECKING, Any

import torch

from gaengine.lending import CompleteWindow, step_norm, window_denominator
from gaengine.noise import NoiseEstimate
from gaengine.optimizers import takes_grad_scale
from gaengine.protocol import REDUCTIONS
from gaengine.scaler import autocast_loss_scaler, check_loss, warn_if_divided_by_k
from gaengine.window import FAILED_WINDOW, MEMBERSHIP_SETTING, StepResult, check_num_items

if TYPE_CHECKING:  # annotations only: the engine sits above this module and calls it
    from gaengine.engine import GradientAccumulator

__all__ = ["WINDOW_SETTINGS", "apply_window", "check_micro_batch", "complete_window", "drop_reductions",
           "end_step", "launch_window_stats", "prepare_micro_batch", "raise_count_mismatch", "window_to_step"]

WINDOW_SETTINGS = ("accumulation_steps", "max_grad_norm", MEMBERSHIP_SETTING)
"""The names of what every rank must hold alike in a window, compared in its stats all-reduce
(``launch_window_stats``: 8 agreement terms each, ``gaengine.reduce.setting_terms``)."""


def check_micro_batch(acc: GradientAccumulator, loss: torch.Tensor,
                      num_items: int | torch.Tensor | None) -> int | torch.Tensor | None:
    """``backward()``'s checks before anything is accumulated (its errors; the window as it was): ``loss``, the
    model not moved, the ``lr_scheduler`` not stepped outside ``step()``, the window neither failed nor complete,
    the last window's per-rank counts (several ranks), and ``num_items`` (returned checked, or None); then the
    ``LossDividedByKWarning`` of a window's first mean-mode loss divided by K (once per accumulator)."""
    check_loss(loss)
    acc._model.check()
    acc._replaced.check(acc.window.num_micro_batches == 0)  # replaced parameters: adoptable, else ValueError
    acc._scheduler.check()
    window = acc.window
    if window.failed:
        raise RuntimeError(FAILED_WINDOW)
    if acc._counts.pending:  # the last window's per-rank counts, unread by its step(): RankCounts.take_error
        raise_count_mismatch(acc, acc._counts.take_error(acc.schedule, acc.scaler))
    if window.num_micro_batches >= acc.accumulation_steps:
        raise RuntimeError(
            f"the accumulation window already holds accumulation_steps={acc.accumulation_steps} micro-batches; "
            "call acc.step() before the next acc.backward()")
    window.check_next(num_items is not None)
    num_items = None if num_items is None else check_num_items(num_items, acc.device)
    if window.num_micro_batches == 0 and num_items is None and not getattr(acc, "_divided_warned", False):
        # The plain recipe's `loss / K` (mean mode; the window's K, asked of a schedule once per window):
        # LossDividedByKWarning once per accumulator, before anything is accumulated. O(1) per window.
        acc._divided_warned = warn_if_divided_by_k(loss, acc.accumulation_steps, stacklevel=4)  # the user's line
    return num_items


def prepare_micro_batch(acc: GradientAccumulator, loss: torch.Tensor,
                        backward_kwargs: dict[str, Any]) -> tuple[torch.Tensor, bool, bool]:
    """A checked micro-batch made ready for autograd, after the window boundary's adoptions: the reductions' header
    (several ranks, ``gaengine.protocol``), the loss's graph claimed for this window, the ``.grad`` left by the
    last window dropped, the parameters' all-gathers complete (``overlap_param_gather``), the reduction prepared
    (``Reduction.begin_backward``) and the loss scale chosen at the first backward (``loss_scale="auto"`` under fp16
    autocast). Returns ``(scaled, last, armed)``: the loss to run backward on (times the loss scale), whether this is
    the window's last micro-batch, and whether the hooks launch each bucket's collective as it completes."""
    window = acc.window
    if acc._ranks_members is not None:  # the headers of the reductions (gaengine.protocol)
        acc._ranks_members.protocol.before_backward(
            acc.schedule.update_index, window.num_micro_batches,
            window.num_micro_batches == acc.accumulation_steps - 1,
            acc.sharding.reduction.reduces_every_micro_batch)
    window.claim_graph(loss, bool(backward_kwargs.get("retain_graph") or backward_kwargs.get("create_graph")))
    if acc.sharding.accumulation.take_stale() | window.grads_left:  # both read: take_stale() clears its flag
        acc._clear_grads()
    last = window.num_micro_batches == acc.accumulation_steps - 1
    # The parameters whole (their all-gathers complete, overlap_param_gather), then the reduction prepares the
    # micro-batch (Reduction.begin_backward: armed, the hooks launch each bucket's collective as it completes);
    # where the hooks restart their written flags (zero_stage=2), the window keeps which parameters it reached.
    acc.sharding.update.wait_gathers()
    start = acc.sharding.reduction.begin_backward(window.num_micro_batches == 0, last,
                                                  acc.config.overlap_grad_reduce)
    if start.used is not None:
        window.mark_used(start.used)
    if acc._auto_loss_scale:  # the first backward: fp16 autocast makes loss_scale="auto" dynamic
        acc.scaler = autocast_loss_scaler(acc.device, acc.min_loss_scale)
        acc._auto_loss_scale = False
    scaled = loss if acc.scaler is None else loss * acc.scaler.scale
    return scaled, last, start.armed


def launch_window_stats(acc: GradientAccumulator) -> None:
    """The window's last reductions and its stats all-reduce (``Reduction.launch_window_stats``, with what every
    rank must hold alike and the noise-scale terms), kept in the window (``Window.stats``)."""
    # What every rank must have set alike for this window, compared in its stats all-reduce
    # (gaengine.reduce.WindowStats.settings_mismatch): K, max_grad_norm and the parameters joined or left.
    values = (acc.accumulation_steps, acc.max_grad_norm, acc._members.window_term(acc.params))
    acc.window.settings = tuple(zip(WINDOW_SETTINGS, values, strict=True))
    acc.window.stats = acc.sharding.reduction.launch_window_stats(acc.window, None if acc._noise is None else (
        acc._noise.window_terms(acc.sharding.accumulation, acc.window, acc.scaler)))
    if acc._ranks_members is not None:
        acc._ranks_members.protocol.reducing = False


def drop_reductions(acc: GradientAccumulator) -> None:
    """``zero_grad()`` on several ranks after this rank opened its window's reductions (``gaengine.protocol``)
    without launching its stats all-reduce (its last micro-batch's backward raised): the buckets not launched
    and the stats all-reduce are launched, its count marked dropped, so the other ranks' collectives are matched
    and their ``step()`` raises naming this rank. The window is dropped either way: errors are ignored (a peer
    that failed too), the waits are ``zero_grad()``'s."""
    acc._ranks_members.protocol.reducing = False
    if acc.window.stats is not None:
        return
    acc.window.fail()  # its stats carry gaengine.reduce.DROPPED_COUNT
    try:
        launch_window_stats(acc)
    except Exception:  # noqa: BLE001 - the window is dropped either way
        pass


def window_to_step(acc: GradientAccumulator, force: bool, lends: bool) -> int | None:
    """``step()``'s checks (its errors, nothing changed): the window's micro-batch count k, or None while the
    window is incomplete (or empty) and not forced. lends: the window's gradient is to be lent in ``.grad``
    (``before_update``, ``begin_step``), which needs the whole gradient on every rank."""
    if lends:
        acc.sharding.rank_layout.check_lend(acc.sharding.name)
    acc._scheduler.check()
    window = acc.window
    k = window.num_micro_batches
    if acc._counts.pending:  # the last window's per-rank counts, unread by its step(): RankCounts.take_error
        raise_count_mismatch(acc, acc._counts.take_error(acc.schedule, acc.scaler))
    if k == 0 or (k < acc.accumulation_steps and not force):
        return None
    acc._model.check()
    acc._replaced.follow_storage()  # p.data = x of a parameter laid out in a flat buffer (gaengine.replaced)
    if window.failed:
        raise RuntimeError(FAILED_WINDOW)
    if acc._ranks_members is not None:  # the ranks changed their parameters differently at this window's start
        error = acc._ranks_members.take()
        if error is not None:
            raise error
    acc._members.refuse_unmanaged_grads(acc.params)
    if acc._fusion is not None:  # a hook registered mid-window on a fused parameter: RuntimeError
        acc._fusion.check_window(acc.params, acc.named_params)
    return k


def complete_window(acc: GradientAccumulator, k: int) -> CompleteWindow:
    """The window of ``k`` micro-batches made complete for its update: its reductions complete (several ranks;
    ``force=True`` on a partial window: nothing is launched yet, so its reductions and stats are launched first,
    ``Reduction.end_partial_window``, and ``partial`` says so), its totals, the parameters no micro-batch reached
    (their gradient zeroed) and the denominator of its raw sums (``gaengine.lending.window_denominator``)."""
    window = acc.window
    partial = acc.distributed and window.stats is None
    if partial:
        acc._ranks_members.protocol.open(REDUCTIONS, acc.schedule.update_index)  # gaengine.protocol
        acc.sharding.reduction.end_partial_window(acc.accumulation_steps - k)
        launch_window_stats(acc)
    if acc.distributed:
        acc.sharding.reduction.wait()
    totals = window.totals(acc.world_size)
    unwritten = acc.sharding.accumulation.unwritten(window)
    acc.sharding.reduction.zero_unused(unwritten)  # parameters with no gradient in this window (unused branches)
    grad_denom, invalid_items, no_items = window_denominator(
        window, totals[1], None if acc.scaler is None else acc.scaler.scale, acc.distributed)
    return CompleteWindow(k, partial, totals, unwritten, grad_denom, invalid_items, no_items)


def apply_window(acc: GradientAccumulator, lent: CompleteWindow) -> StepResult:
    """The complete window ``lent`` applied: its norm, skip flag and clip coefficient (``Reduction.norm`` over the
    window's sums, or ``Lending.norm_of_lent`` over the gradient lent in ``.grad``, maybe edited), the noise scale
    (before the update: ``main_grad`` and the scale are still the window's), the update or, without an optimizer,
    the gradients exposed in ``.grad``, then ``end_step``. Returns the window's ``StepResult``."""
    window = acc.window
    k, partial = lent.k, lent.partial
    loss_sum, denom, num_items, mismatch = lent.totals
    norm = (acc.sharding.reduction.norm(lent.grad_denom, acc.max_grad_norm) if lent.grads is None else
            acc._lending.norm_of_lent(lent, acc.sharding.accumulation, acc.max_grad_norm))
    skipped, grad_norm = step_norm(lent, norm, mismatch)
    unwritten, invalid_items = lent.unwritten, lent.invalid_items
    acc._lending.lent = None
    loss_scale = None if acc.scaler is None else acc.scaler.scale.clone()
    noise: NoiseEstimate | None = None
    if acc._noise is not None:  # before the update: main_grad and the scale are still the window's
        terms = (window.stats.extra() if acc.distributed else
                 acc._noise.window_terms(acc.sharding.accumulation, window, acc.scaler))
        noise = acc._noise.update(terms, norm.grad_norm.double().square(), denom, skipped)
    if acc.optimizer is None:
        acc.sharding.update.expose_grads(norm.coef, unwritten)
        acc.window.grads_left = True
    else:
        acc.sharding.update.apply(norm.coef, skipped, unwritten, acc.lr_scheduler)
        acc._scheduler.stepped()
    if lent.keep:  # begin_step(): .grad holds the gradient as applied (edited, clipped) until the next backward
        lent.grads.lend()
        acc.window.grads_left = True
    result = StepResult(grad_norm=grad_norm, clip_coef=norm.clip_coef, skipped=skipped,
                        num_micro_batches=k, num_items=num_items, loss=loss_sum / denom, loss_scale=loss_scale,
                        invalid_num_items=invalid_items,
                        **({} if noise is None else dict(grad_noise_scale=noise.grad_noise_scale,
                                                         noise_trace_sigma=noise.trace_sigma,
                                                         noise_grad_sq=noise.grad_sq)))
    end_step(acc, result, partial, mismatch, norm.skipped)
    return result


def end_step(acc: GradientAccumulator, result: StepResult, partial: bool, mismatch: torch.Tensor | None,
             overflow: torch.Tensor) -> None:
    """After the update: the ranks' counts (read now where ``step()`` reads the device anyway or ends an epoch,
    ``partial``; else by the next ``backward()``/``step()``, which then undoes what this step counted), the loss
    scale (``overflow``: the gradient itself was non-finite), the window's BatchNorm, the schedule and the skips,
    then a new window (the strategy's too: ``end_window``). Raises the count mismatch's error, or the loss
    scale's floor error."""
    k, window, schedule, scaler = result.num_micro_batches, acc.window, acc.schedule, acc.scaler
    counts = None if mismatch is None else acc._counts.read(
        # read now where step() reads its skip flag on the host anyway: a non-fused optimizer (it cannot skip on
        # the device), an lr_scheduler (it runs on the host) or max_consecutive_skips
        window.stats, now=partial or window.stats.host_counts is not None or acc.lr_scheduler is not None or (
            acc.optimizer is not None and not takes_grad_scale(acc.optimizer)) or acc._skips.limit is not None,
        saved=lambda: (schedule.update_index, schedule.items_seen, None if scaler is None or not
                       scaler.dynamic else (scaler.scale.clone(), scaler.growth_tracker.clone())))
    counts, settings_differ = counts if counts is not None else (None, [])
    differ = counts is not None and (any(c != k for c in counts) or bool(settings_differ))
    if scaler is not None and not differ:
        scaler.update(overflow.to(torch.float32))
    if acc.window_batchnorm is not None:
        acc.window_batchnorm.end_window()
    schedule.observe(result)
    if not differ:
        schedule.advance(k, acc.world_size, acc.micro_batch_size)
        acc._skips.observe(overflow, result.loss_scale,
                           lambda: acc.sharding.accumulation.finite_by_param(acc.named_params))
    window.reset()  # the strategy resets the hooks' part (end_window, drain)
    if acc._noise is not None:
        acc._noise.reset()
    # The hooks' window is reset too; the first window's end lays the buffer out in its arrival order (a
    # collective: every rank gets here).
    window.grads_left |= acc.sharding.end_window()
    if differ:
        raise_count_mismatch(acc, acc._counts.error(counts, differ=settings_differ))
    if scaler is not None and scaler.floor_reached():
        raise scaler.floor_error()


def raise_count_mismatch(acc: GradientAccumulator, error: Exception | None) -> None:
    """Raise ``error``, that of a window whose ranks held different micro-batch counts or settings
    (``gaengine.window.RankCounts``); without an optimizer, the gradients ``step()`` left in ``.grad`` are
    dropped first. Nothing for None."""
    if error is None:
        return
    if acc.optimizer is None:
        acc._clear_grads()
    raise error
