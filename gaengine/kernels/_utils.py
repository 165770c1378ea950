"""Helpers shared by the Triton launchers: argument contracts, the device guard and block-size checks. (The
arguments of the multi-tensor AdamW step every AdamW kernel takes, ``AdamWStep``, are written in
``gaengine.contract``; the triton backend gives ``gaengine.kernels.<name>.<name>_step_`` as a fused optimizer's
kernel, ``Backend.optimizer_step``.)

Nothing here imports triton, so the contracts can be checked (and tested) without it.
"""

from __future__ import annotations

import contextlib

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fp32_buffer(x: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` unless ``x`` is a contiguous fp32 tensor (a flat main_grad buffer or a view of one)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_float_input(x: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` unless ``x`` is a contiguous fp32 | bf16 | fp16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_device_scalar(t: torch.Tensor, name: str, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``t`` is a 0-d floating tensor on ``device`` (read by the kernel, not the host)."""
    if not (isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point() and t.device == device):
        got = f"a {tuple(t.shape)} {t.dtype} tensor on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 0-d floating tensor on {device}, got {got}")


def scale_args(scale: float | torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, float, bool, bool]:
    """The launch arguments of a ``scale`` (a Python float or a 0-d floating tensor on ``dst.device``).

    Returns ``(scale_ptr, scale_value, has_scale, scale_is_ptr)``: for a tensor, its pointer (read inside the
    kernel, so the host never waits for it) and ``1.0``; for a float, ``dst`` as a pointer that is never read
    (``HAS_SCALE`` or ``SCALE_IS_PTR`` is False) and the value, with ``has_scale`` False for ``1.0``.
    Raises ``ValueError`` for a tensor that is not a 0-d floating tensor on ``dst.device``.
    """
    scale_is_ptr = isinstance(scale, torch.Tensor)
    if scale_is_ptr:
        check_device_scalar(scale, "scale", dst.device)
        return scale, 1.0, True, True
    scale_value = float(scale)
    return dst, scale_value, scale_value != 1.0, False


def check_block_size(block_size: int, name: str = "block_size") -> int:
    """Return ``block_size`` if it is a power of two >= 16 (one 128-bit vector of fp32 per lane group), else raise."""
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {block_size!r}")
    return block_size


def device_guard(t: torch.Tensor):
    """Make ``t``'s CUDA device current for the launch (Triton launches on the current device); a no-op on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
