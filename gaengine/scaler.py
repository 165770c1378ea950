"""Dynamic fp16 loss scaling that never leaves the device.

Defaults are ``torch.amp.GradScaler``'s (``amp/grad_scaler.py``): initial scale 2**16, growth x2 after 2000
consecutive clean updates, backoff x0.5 on an overflow; and DeepSpeed's floor, ``min_loss_scale`` 1: reaching it
raises (``floor_reached``, ``floor_error``) instead of skipping every update while the scale falls to 0. The update is torch's own fused
``torch._amp_update_scale_`` kernel, driven by the engine's on-device ``found_inf`` flag, so no value is
read on the host. The engine folds the inverse scale into its late normalization (the step's single
coefficient), so unscaling costs no pass over the gradients.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from gaengine.reduce import HostMailbox

__all__ = ["DEFAULT_MIN_LOSS_SCALE", "ConsecutiveSkips", "LossDividedByKWarning", "LossScaler", "autocast_loss_scaler",
           "check_loss", "check_min_loss_scale", "choose_loss_scaler", "constant_divisor", "guard_grad_scaler",
           "scaled_by_grad_scaler", "warn_if_divided_by_k"]

_GRAD_SCALER_MARK = "_gaengine_scaled_by_grad_scaler"

# The floor of the dynamic loss scale (DeepSpeed's ``min_loss_scale`` default): a scale that keeps falling below 1
# means the gradients overflow with the loss unscaled, which is a bug (a loss scaled twice) or divergence, not data.
DEFAULT_MIN_LOSS_SCALE = 1.0


def check_min_loss_scale(value) -> float:
    """``min_loss_scale`` as a float; ``ValueError`` naming it unless a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"min_loss_scale must be a positive finite float (the dynamic loss scale's floor, "
                         f"{DEFAULT_MIN_LOSS_SCALE:g} by default as DeepSpeed's), got {value!r}")
    return float(value)


def guard_grad_scaler() -> None:
    """Mark the tensor ``torch.amp.GradScaler.scale`` returns (an enabled scaler, one tensor), so that
    ``GradientAccumulator.backward`` can refuse a loss that a plain-recipe GradScaler already scaled before anything
    is accumulated (``scaled_by_grad_scaler``). Called by ``GradientAccumulator.__init__``; idempotent; the scaler
    itself is unchanged."""
    original = torch.amp.GradScaler.scale
    if getattr(original, "_gaengine_guard", False):
        return

    @functools.wraps(original)
    def scale(self, outputs):
        scaled = original(self, outputs)
        if isinstance(scaled, torch.Tensor) and scaled is not outputs:  # a disabled scaler returns its input
            setattr(scaled, _GRAD_SCALER_MARK, True)
        return scaled

    scale._gaengine_guard = True
    torch.amp.GradScaler.scale = scale


def scaled_by_grad_scaler(loss: torch.Tensor) -> bool:
    """Whether ``loss`` is the output of an enabled ``torch.amp.GradScaler.scale`` (see ``guard_grad_scaler``)."""
    return getattr(loss, _GRAD_SCALER_MARK, False)


class LossScaler:
    """Loss scale state on ``device``.

    scale: 0-d fp32 tensor, multiplies each micro-batch's loss. dynamic: grow/back off after each
    update; a static scaler keeps ``scale`` fixed. growth_tracker: 0-d int32 tensor, clean updates in a row.
    """

    def __init__(self, device: torch.device, init_scale: float = 2.0**16, dynamic: bool = True,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = DEFAULT_MIN_LOSS_SCALE) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"loss_scale must be a positive finite float, 'dynamic' or None, got {init_scale!r}")
        self.dynamic = dynamic
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.min_scale = check_min_loss_scale(min_scale)
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        # Whether a back-off reached min_scale: a device flag, posted to the host without waiting after every
        # update, read by floor_reached().
        self._below = torch.zeros((), dtype=torch.bool, device=device)
        self._below_host = HostMailbox(1, torch.bool, device)

    def update(self, found_inf: torch.Tensor) -> None:
        """After a window: back off if ``found_inf`` (0-d fp32, 1.0 = overflow), else count towards growth. A
        back-off that reaches ``min_scale`` holds the scale there and sets the flag ``floor_reached()`` reads (DeepSpeed
        raises on an overflow at its ``min_loss_scale`` too).
        On the device: no host read."""
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, self.growth_factor,
                                     self.backoff_factor, self.growth_interval)
            self._below |= (found_inf > 0) & (self.scale <= self.min_scale)
            self.scale.clamp_(min=self.min_scale)
            self._below_host.post(self._below)

    def floor_reached(self) -> bool:
        """True once a back-off reached ``min_scale``: the gradients overflowed with the loss scaled by twice
        ``min_scale`` or less. Never waits for the device: on CUDA it answers from the last flag that has reached
        the host (that of this window or, while its copy is in flight, an earlier one: the floor is then seen one
        window later, at the next ``step()``)."""
        if not self._below_host.ready() or not self._below_host.read()[0]:
            return False
        self._below.zero_()  # reported once: training may go on (a lower learning rate, a smaller floor)
        return True

    def floor_error(self) -> RuntimeError:
        """The error ``GradientAccumulator.step()`` raises once ``floor_reached()``."""
        return RuntimeError(
            f"the dynamic loss scale fell to its floor min_loss_scale={self.min_scale:g}: the gradients overflowed "
            "(inf/NaN) even with the loss barely scaled, after backing off window after window. Likely causes: "
            "(1) the loss given to acc.backward() was already scaled by torch.amp.GradScaler (scaler.scale(loss)): "
            "remove the GradScaler and its scale/unscale_/step/update calls, gaengine scales the loss itself "
            "(loss_scale='auto'); (2) the model diverged (an inf/NaN loss): lower the learning rate, check the "
            "data, resume from a checkpoint. This window was skipped (no parameter changed) and dropped; training can "
            "go on. To let the scale fall further, pass a smaller min_loss_scale")

    def state_dict(self) -> dict:
        return {"scale": self.scale.detach().clone().cpu(), "growth_tracker": self.growth_tracker.detach().clone().cpu(),
                "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])
        self.dynamic = bool(state["dynamic"])


def choose_loss_scaler(loss_scale: str | float | None, params: list[torch.Tensor], device: torch.device,
                       min_scale: float) -> LossScaler | None:
    """The scaler ``loss_scale`` asks for: ``"auto"`` is dynamic when a parameter is fp16 (else none until
    ``autocast_loss_scaler`` sees fp16 autocast), ``"dynamic"``, a float (static) or None (no scaling). The dynamic
    scaler starts at 2**16, torch.amp.GradScaler's default ``init_scale``."""
    if loss_scale == "auto":
        loss_scale = "dynamic" if any(p.dtype == torch.float16 for p in params) else None
    if loss_scale is None:
        return None
    dynamic = loss_scale == "dynamic"
    return LossScaler(device, 2.0**16 if dynamic else float(loss_scale), dynamic=dynamic, min_scale=min_scale)


def autocast_loss_scaler(device: torch.device, min_scale: float) -> LossScaler | None:
    """A dynamic scaler when fp16 autocast is on for ``device``'s type (``loss_scale="auto"``'s first backward),
    else None."""
    if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.float16:
        return LossScaler(device, min_scale=min_scale)
    return None


def check_loss(loss: Any) -> None:
    """``ValueError`` for a ``loss`` that ``GradientAccumulator.backward`` cannot take: not a one-element floating
    tensor, not requiring grad, or already scaled by ``torch.amp.GradScaler.scale`` (gaengine scales it itself)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss must be a scalar floating tensor (reduce it with .mean() or .sum()), got {what}")
    if not loss.requires_grad:
        raise ValueError("loss does not require grad: it was computed under torch.no_grad() or from frozen parameters")
    if scaled_by_grad_scaler(loss):
        raise ValueError(
            "loss was scaled by torch.amp.GradScaler.scale(): gaengine scales the loss itself (loss_scale='auto' "
            "is dynamic for fp16) and folds the inverse scale into its update, so a second scale would make every "
            "window overflow and the updates 65536x too large. Pass the unscaled loss, acc.backward(loss), and "
            "delete the GradScaler and its unscale_/step/update calls; nothing was accumulated")


class LossDividedByKWarning(UserWarning):
    """The loss given to ``GradientAccumulator.backward`` was divided by K, the window's accumulation steps: the
    plain recipe's ``loss = loss / K`` (every accumulation tutorial, HF Trainer's ``training_step``), which under
    gaengine makes the gradient K times smaller (gaengine divides each window's sum itself). Raised as a warning
    once per accumulator (``warn_if_divided_by_k``). When the division is meant (a loss term weighted by 1/K
    that happens to equal K's inverse), silence it by its category::

        warnings.filterwarnings("ignore", category=gaengine.scaler.LossDividedByKWarning)
    """


_DIVISION_NODES = {"DivBackward0": False, "DivBackward1": False, "MulBackward0": True, "MulBackward1": True}
# Relative slack for K read back from a multiplication by 1 / K: the factor is rounded once (to fp64 for a Python
# float, fp32 for a float tensor: 2^-24), so its inverse lands within a few fp32 ulps of K; a different
# divisor (K - 1, K + 1 for K < 2^20) is far outside.
_K_RTOL = 2.0**-20


def _constant_factor(node: Any, name: str) -> float | None:
    """The value of ``node``'s saved operand ``name`` (``_saved_other`` / ``_saved_self``) when it is a constant: a
    Python number, or a one-element CPU tensor that needs no gradient (torch wraps a Python scalar operand so);
    else None. A CPU tensor is read without a device sync; any other tensor is not read."""
    try:
        value = getattr(node, name)
    except (AttributeError, RuntimeError):  # not saved by this torch version, or freed
        return None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if (isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu"
            and not value.requires_grad and not value.is_complex()):
        return float(value.item())
    return None


def constant_divisor(loss: torch.Tensor) -> float | None:
    """The constant ``d`` that ``loss``'s last autograd node divides it by, ``loss = x / d`` (``DivBackward``) or
    ``loss = x * (1 / d)`` (``MulBackward``, either operand), or None: another last node, an operand that needs a
    gradient or lives on a device (never read: no sync), or a torch that does not expose the node's saved operands
    (``grad_fn._saved_other``, read as torch 2.x names it). O(1): one attribute read, one CPU scalar."""
    node = loss.grad_fn
    multiplies = _DIVISION_NODES.get(type(node).__name__)
    if multiplies is None:
        return None
    names = ("_saved_other", "_saved_self") if multiplies else ("_saved_other",)
    for name in names:
        factor = _constant_factor(node, name)
        if factor is not None and factor != 0.0 and math.isfinite(factor):
            return 1.0 / factor if multiplies else factor
    return None


def warn_if_divided_by_k(loss: torch.Tensor, k: int, stacklevel: int = 3) -> bool:
    """Warn (:class:`LossDividedByKWarning`) when ``loss``'s last operation divides it by ``k`` (``k`` >= 2, the
    window's accumulation steps; :func:`constant_divisor`), the plain recipe's ``loss / K``; returns whether it
    warned. ``GradientAccumulator.backward`` calls it at a window's first micro-batch, in mean mode, until it
    has warned once."""
    divisor = constant_divisor(loss) if k >= 2 else None
    if divisor is None or abs(divisor - k) > _K_RTOL * k:
        return False
    warnings.warn(
        f"acc.backward(loss): the loss was divided by {k}, this window's accumulation steps K (the plain recipe's "
        f"`loss = loss / K`, as in HF Trainer's training_step). gaengine divides each window's gradient sum by its "
        f"micro-batches itself, so this gradient is K = {k} times smaller than the window's mean (and the "
        f"updates, the clipping and the logged grad_norm change with it). Pass the micro-batch mean as it is, "
        f"acc.backward(loss), and delete the division. If the division is meant, silence this warning with "
        f"warnings.filterwarnings('ignore', category=gaengine.scaler.LossDividedByKWarning). Warned once per "
        f"accumulator", LossDividedByKWarning, stacklevel=stacklevel)
    return True


class ConsecutiveSkips:
    """``max_consecutive_skips``: raise ``RuntimeError`` once that many windows in a row were skipped for non-finite
    gradients, instead of skipping on silently. ``limit``: an int >= 1, or None (never)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.count = 0

    def observe(self, skipped: torch.Tensor, loss_scale: torch.Tensor | None, finite_by_param) -> None:
        """After an update: ``skipped`` (0-d bool on the device, read on the host). ``finite_by_param()`` gives
        ``[(name, finite)]`` for the error, which names the scale and the parameters with non-finite gradients."""
        if self.limit is None:
            return
        if not bool(skipped):  # host read: only with max_consecutive_skips set
            self.count = 0
            return
        self.count += 1
        if self.count < self.limit:
            return
        bad = [name for name, finite in finite_by_param() if not finite]
        scale = "none" if loss_scale is None else f"{float(loss_scale):g}"
        raise RuntimeError(
            f"{self.count} consecutive accumulation windows were skipped for non-finite gradients "
            f"(max_consecutive_skips={self.limit}); loss scale {scale}; parameters with "
            f"non-finite gradients: {bad or 'none (the norm overflowed)'}")
