"""Functional gradient-buffer ops for code that manages its own flat buffers.

The backend is chosen by the tensors' device (``auto``, see ``gaengine.backends``) unless ``backend=``
names one. Each op validates its arguments in Python, before any kernel (and any call into ``gaengine._C``),
and raises ``ValueError`` (``gaengine.contract.ContractError``) or ``TypeError`` naming the bad one; ``dst``
is untouched when it raises.
"""

from __future__ import annotations

import torch

from gaengine.backends import get_backend
from gaengine.contract import Scale, check_accumulate_args, check_grad_tensor, check_scale_args

__all__ = ["accumulate_", "l2norm_sq", "scale_"]


def accumulate_(dst: torch.Tensor, src: torch.Tensor, scale: Scale = 1.0, *, overwrite: bool = False,
                backend: str = "auto") -> torch.Tensor:
    """``dst = (0 if overwrite else dst) + src * scale``, in place; returns ``dst``.

    dst: fp32, contiguous, any shape, accumulated in place. src: fp32 | bf16 | fp16, same numel and
    device, read only. scale: Python float or 0-d fp32 tensor on ``dst.device`` (read on the device).
    overwrite: write instead of add (micro-batch 0 of a window: no separate zeroing pass).
    """
    check_accumulate_args(dst, src, scale)
    return get_backend(backend, dst.device).accumulate_(dst, src, scale, overwrite)


def l2norm_sq(x: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of squares of ``x`` and its non-finite flag, in one pass with no host sync.

    x: fp32 | bf16 | fp16, any shape. Returns ``(sum_of_squares, found_inf)``: 0-d fp32 tensors on
    ``x.device``; ``found_inf`` is 1.0 if ``x`` contains an inf or NaN, else 0.0.
    """
    check_grad_tensor(x)
    return get_backend(backend, x.device).l2norm_sq(x)


def scale_(x: torch.Tensor, coef: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``x *= coef`` in place; x: fp32 contiguous; coef: 0-d fp32 tensor on ``x.device``. Returns ``x``."""
    check_scale_args(x, coef)
    return get_backend(backend, x.device).scale_(x, coef.to(torch.float32))
