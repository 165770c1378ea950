"""The step's norm: gradient norm, skip flag, clip coefficient and the single coefficient of the update.

``main_grad`` holds raw sums of (loss-scaled) gradients; ``grad_denom`` (0-d fp32 on the device: the
micro-batch count x world size or the window's item count, times the loss scale) undoes both at once. The
sum of squares and the non-finite flag come either for free from the last micro-batch's accumulate (the
hooks' ``free_norm()``) or from one ``l2norm_sq`` pass over the buffer (4 B/element). Everything stays on
the device: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["CLIP_EPS", "WindowNorm", "clip_coefficient", "window_norm"]

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing (clip_grad.py, `max_norm / (total_norm + 1e-6)`).
CLIP_EPS = 1e-6


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` as a 0-d tensor on ``total_norm.device`` (torch's formula)."""
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)


@dataclass(frozen=True)
class WindowNorm:
    """0-d tensors on the buffer's device.

    grad_norm: fp32, L2 norm of the normalized gradient (before clipping).
    skipped: bool, a gradient was inf/NaN (or the norm overflowed): the update is not applied.
    clip_coef: fp32, ``min(1, max_norm / (grad_norm + 1e-6))`` (1.0 without clipping).
    coef: fp32, ``clip_coef / grad_denom``: normalization and clipping in one factor for the raw sums in
        main_grad; 1.0 when skipped, so it stays finite and the buffer's padding stays zero.
    """

    grad_norm: torch.Tensor
    skipped: torch.Tensor
    clip_coef: torch.Tensor
    coef: torch.Tensor


def window_norm(data: torch.Tensor, grad_denom: torch.Tensor, max_grad_norm: float | None, backend,
                free: tuple[torch.Tensor, torch.Tensor] | None = None) -> WindowNorm:
    """Norm, skip flag and coefficients of the window's gradient ``data / grad_denom``.

    data: (n,) fp32 main_grad, read once unless ``free`` is given. grad_denom: 0-d fp32 on ``data.device``.
    max_grad_norm: the clipping threshold, or None (no clipping). backend: its ``l2norm_sq`` makes the pass.
    free: ``(sum_sq, found_inf)`` of ``data`` already computed (0-d fp32 on the device), or None.
    """
    sum_sq, found_inf = free if free is not None else backend.l2norm_sq(data)
    grad_norm = sum_sq.sqrt() / grad_denom
    skipped = (found_inf > 0) | ~torch.isfinite(grad_norm)
    if max_grad_norm is not None:
        clip_coef = clip_coefficient(grad_norm, max_grad_norm)
    else:
        clip_coef = torch.ones((), dtype=torch.float32, device=data.device)
    # One coefficient carries normalization and clipping; kept finite so padding stays zero.
    coef = torch.where(skipped, torch.ones_like(clip_coef), clip_coef / grad_denom)
    return WindowNorm(grad_norm=grad_norm, skipped=skipped, clip_coef=clip_coef, coef=coef)
