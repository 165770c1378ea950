"""The complete window on its way to the update: its denominator, its norm and clip, and its gradient lent in ``.grad``.

``GradientAccumulator.step()`` completes a window (its reductions waited for), then turns its raw fp32 sums into the
update's one coefficient: the denominator (``window_denominator``: micro-batches x ranks, or the window's items, x
the loss scale; an item count that is 0, negative or not finite skips the update on the device), the norm, skip flag
and clip coefficient (``gaengine.norm.window_norm`` through the strategy's reduction, or ``Lending.norm_of_lent``
over a lent, maybe edited gradient), and what ``StepResult`` reports of them (``step_norm``). ``Lending`` lends the
window's normalized gradient in ``.grad`` (``begin_step()``, ``step(before_update=fn)``; ``gaengine.update.
WindowGrads``), takes it back, and refuses the calls that would change the window meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gaengine.norm import WindowNorm, window_norm
from gaengine.update import WindowGrads
from gaengine.window import Window

if TYPE_CHECKING:  # annotations only: the accumulation sits above this module
    from gaengine.accumulation import Accumulation

__all__ = ["CompleteWindow", "Lending", "step_norm", "window_denominator"]


@dataclass
class CompleteWindow:
    """A complete window on its way to the update (``step()``; ``begin_step()`` keeps it between the two calls): its
    micro-batch count ``k``, whether ``step()`` launched its reductions (``partial``), ``Window.totals``, the
    parameters without a gradient (``unwritten``), the denominator of its raw sums (``grad_denom``, 0-d fp32) and
    the item-mode flags (``invalid_items``, ``no_items``: 0-d bool, or None); ``grads``: the gradient lent in
    ``.grad`` (``main_grad`` normalized in place by ``divisor``), or None; ``keep``: lent by ``begin_step()``, so
    ``.grad`` holds the applied gradient after ``step()`` too."""

    k: int
    partial: bool
    totals: tuple
    unwritten: list[int]
    grad_denom: torch.Tensor
    invalid_items: torch.Tensor | None
    no_items: torch.Tensor | None
    grads: WindowGrads | None = None
    divisor: torch.Tensor | None = None
    keep: bool = False


def window_denominator(window: Window, denom: torch.Tensor, loss_scale: torch.Tensor | None,
                       distributed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_denom, invalid_items, no_items)`` of a complete window whose totals' denominator is ``denom`` (0-d fp32
    on the device: micro-batches x ranks, or the items over all micro-batches and ranks). A negative, NaN or inf
    num_items tensor made the item count NaN (``Window.add``; on several ranks the all-reduced count, so every rank
    agrees); tensors may also add up to 0. Either way the update is skipped, on the device, and the sums are taken as
    they are (denominator 1), so that the skip flag says whether the gradient itself overflowed (what the loss scale
    and max_consecutive_skips follow). The buffer holds raw sums of loss-scaled gradients (``loss_scale``, 0-d fp32,
    or None): one denominator undoes both."""
    invalid_items = no_items = None
    norm_denom = denom
    if window.item_mode and (distributed or window.items_dev is not None):
        invalid_items, no_items = ~torch.isfinite(denom) | (denom < 0), denom == 0
        norm_denom = torch.where(invalid_items | no_items, torch.ones_like(denom), denom)
    grad_denom = norm_denom if loss_scale is None else norm_denom * loss_scale
    return grad_denom, invalid_items, no_items


def step_norm(complete: CompleteWindow, norm: WindowNorm,
              mismatch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``StepResult`` reports of the window's ``norm``: ``(skipped, grad_norm)``, 0-d on the device. skipped: a
    non-finite gradient, the ranks' counts differ (``mismatch``) or the items are invalid; grad_norm as the
    denominator makes it then: NaN for invalid items, inf for none."""
    skipped = norm.skipped if mismatch is None else norm.skipped | mismatch  # unequal counts: no rank updates
    grad_norm = norm.grad_norm
    invalid_items, no_items = complete.invalid_items, complete.no_items
    if invalid_items is not None:
        skipped = skipped | invalid_items | no_items
        grad_norm = torch.where(invalid_items, torch.full_like(grad_norm, float("nan")),
                                torch.where(no_items, torch.full_like(grad_norm, float("inf")), grad_norm))
    return skipped, grad_norm


class Lending:
    """The window's gradient lent in ``.grad`` (``begin_step()``, ``step(before_update=fn)``): what is lent
    (``lent``, a ``CompleteWindow``, or None) and whether ``fn`` runs (``in_before_update``). backend: the kernel
    backend (``scale_``)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.lent: CompleteWindow | None = None
        self.in_before_update = False

    def refuse_in_before_update(self, call: str, effect: str) -> None:
        """``RuntimeError`` naming ``call`` when it is made from inside ``step(before_update=fn)``'s ``fn``: it would
        ``effect`` in the middle of the window's update. Nothing is changed by the refused call."""
        if self.in_before_update:
            raise RuntimeError(
                f"{call} was called from inside acc.step(before_update=...), while the window is being applied: it "
                f"would {effect}. Refused; nothing was changed (the window and its .grad are as they were). "
                f"before_update may read and edit .grad and set acc.max_grad_norm; call {call} after step() returns")

    def refuse_lent(self, call: str) -> None:
        """``RuntimeError`` naming ``call`` while ``begin_step()`` lends the window's gradient in ``.grad`` (its
        ``main_grad`` is normalized and being edited). Nothing is changed by the refused call."""
        if self.lent is not None:
            raise RuntimeError(
                f"{call} was called while the window's gradient is lent in .grad (acc.begin_step(), or inside "
                f"step(before_update=...)): call acc.step() to apply it, or acc.zero_grad() to drop it, first. "
                f"Nothing was changed")

    def lend(self, complete: CompleteWindow, keep: bool, accumulation: Accumulation,
             named_params: list[tuple[str, torch.Tensor]]) -> None:
        """``main_grad`` normalized in place (one pass; a denominator of 0 items: nothing to undo) and lent in
        ``.grad`` (``gaengine.update.WindowGrads``; ``named_params`` name the parameters in its errors)."""
        main_grad = accumulation.main_grad
        complete.divisor = torch.where(complete.grad_denom > 0, complete.grad_denom,
                                       torch.ones_like(complete.grad_denom))
        self.backend.scale_(main_grad.data, complete.divisor.reciprocal())
        names = {id(p): n for n, p in named_params}
        params = accumulation.params
        complete.grads = WindowGrads(params, [names.get(id(p), f"param[{i}]") for i, p in enumerate(params)],
                                     main_grad, complete.unwritten)
        complete.keep = keep
        self.lent = complete

    def unlend(self, accumulation: Accumulation) -> None:
        """``lend`` undone: ``.grad`` released and ``main_grad`` multiplied back (the raw sums within one fp32
        rounding; exactly where the denominator is a power of two)."""
        lent, self.lent = self.lent, None
        lent.grads.release()
        self.backend.scale_(accumulation.main_grad.data, lent.divisor)

    def run_before_update(self, complete: CompleteWindow, before_update: Callable[[], None],
                          accumulation: Accumulation) -> None:
        """``before_update()`` with the gradient lent; the window-changing calls refuse meanwhile
        (``refuse_in_before_update``). If it raises: a window lent by ``step()`` itself is given back (``unlend``:
        nothing applied, the window open), one lent by ``begin_step()`` stays lent."""
        self.in_before_update = True
        try:
            before_update()
        except BaseException:
            if not complete.keep:
                self.unlend(accumulation)
            raise
        finally:
            self.in_before_update = False

    def norm_of_lent(self, complete: CompleteWindow, accumulation: Accumulation,
                     max_grad_norm: float | None) -> WindowNorm:
        """The lent gradient taken back (``WindowGrads.take_back``), then its norm, skip flag and clip
        coefficient from one pass over the normalized, edited ``main_grad``. ``coef`` is the clip alone (the
        normalization is done); a window lent by ``begin_step()`` is clipped here (one pass) so that its ``.grad``
        holds the clipped gradient after the update, and ``coef`` is 1."""
        complete.unwritten = complete.grads.take_back()
        if not complete.keep:
            complete.grads.release()
        data = accumulation.main_grad.data
        one = torch.ones((), dtype=torch.float32, device=data.device)
        norm = window_norm(accumulation.chunks, one, max_grad_norm, self.backend)
        coef = torch.where(norm.skipped, one, norm.clip_coef)
        if complete.keep and max_grad_norm is not None:
            self.backend.scale_(data, coef)
            coef = one
        return WindowNorm(grad_norm=norm.grad_norm, skipped=norm.skipped, clip_coef=norm.clip_coef, coef=coef)
