"""The step's norm: gradient norm, skip flag, clip coefficient and the single coefficient of the update.

``main_grad`` holds raw sums of (loss-scaled) gradients; ``grad_denom`` (0-d fp32 on the device: the
micro-batch count x world size or the window's item count, times the loss scale) undoes both at once. The
sum of squares and the non-finite flag come either for free from the last micro-batch's accumulate (the
hooks' ``free_norm()``) or from one ``l2norm_sq`` pass over this rank's chunks of the buffer (4 B/element),
summed over the ranks by one all-reduce of two floats where each rank holds a shard (ZeRO) or by the window's
stats all-reduce (FSDP2): ``window_norm`` is the one norm of every sharding strategy, called by each strategy's
reduction (``gaengine.reduce.Reduction.norm``). Everything stays on the device: no host sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


__all__ = ["CLIP_EPS", "WindowNorm", "clip_coefficient", "local_sum_sq", "window_norm"]

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


def local_sum_sq(chunks: Sequence[torch.Tensor], backend,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(sum_sq, found_inf)`` over ``chunks`` (contiguous fp32 tensors; 0-d fp32 on ``device``): the
    backend's one ``l2norm_sq`` pass over a single one; one multi-tensor ``torch._foreach_norm`` over several (a
    non-finite value making the sum non-finite, which is then the flag); zeros over none."""
    chunks = [c for c in chunks if c.numel()]
    if len(chunks) == 1:
        return backend.l2norm_sq(chunks[0])
    if chunks:
        sum_sq = torch.stack(torch._foreach_norm(chunks)).float().square().sum()
        return sum_sq, (~torch.isfinite(sum_sq)).float()
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return zero, zero


def window_norm(chunks: Sequence[torch.Tensor], grad_denom: torch.Tensor, max_grad_norm: float | None, backend, *,
                free: tuple[torch.Tensor, torch.Tensor] | None = None,
                over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> WindowNorm:
    """Norm, skip flag and coefficients of the window's gradient ``sum / grad_denom``: the one norm of every
    sharding strategy, which differ only in the ``chunks`` a rank holds and whether they are summed over the ranks.

    chunks: the contiguous fp32 tensors holding this rank's part of the window's raw gradient sums (the whole
        ``main_grad`` where every rank holds it reduced; a rank's shard under ZeRO; the local shards under FSDP2),
        read once (``local_sum_sq``) unless ``free`` is given.
    grad_denom: 0-d fp32 on the device. max_grad_norm: the clipping threshold, or None (no clipping).
    backend: its ``l2norm_sq`` makes the pass.
    free: ``(sum_sq, found_inf)`` of the chunks already computed (0-d fp32 on the device: the hooks' free norm of the
        last accumulate, or a sum the window's stats all-reduce already carried), or None.
    over_ranks: sums a ``(2,)`` fp32 device tensor ``[sum_sq, found_inf]`` over the ranks (one all-reduce, no host
        read) and returns it, where each rank holds only its shard; None where ``chunks`` are the whole gradient.
    """
    sum_sq, found_inf = free if free is not None else local_sum_sq(chunks, backend, grad_denom.device)
    if over_ranks is not None:
        sums = over_ranks(torch.stack([sum_sq.float(), found_inf.float()]))
        sum_sq, found_inf = sums[0], sums[1]
    grad_norm = sum_sq.sqrt() / grad_denom
    skipped = (found_inf > 0) | ~torch.isfinite(grad_norm)
    if max_grad_norm is not None:
        clip_coef = clip_coefficient(grad_norm, max_grad_norm)
    else:
        clip_coef = torch.ones((), dtype=torch.float32, device=grad_denom.device)
    # One coefficient carries normalization and clipping; kept finite so padding stays zero.
    coef = torch.where(skipped, torch.ones_like(clip_coef), clip_coef / grad_denom)
    return WindowNorm(grad_norm=grad_norm, skipped=skipped, clip_coef=clip_coef, coef=coef)
