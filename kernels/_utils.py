"""Helpers shared by the Triton launchers: argument contracts, the device guard, block-size checks.

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


def check_block_size(block_size: int, name: str = "block_size") -> int:
    """Return ``block_size`` if it is a power of two >= 16 (one 128-bit vector of fp32 per lane group), else raise."""
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {block_size!r}")
    return block_size


def device_guard(t: torch.Tensor):
    """Make ``t``'s CUDA device current for the launch (Triton launches on the current device); a no-op on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
