"""fp64 oracles and the plain-PyTorch recipes gaengine is judged against (tests and benchmarks import these)."""

from __future__ import annotations

import torch


def accumulate_fp64(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, overwrite: bool = False) -> torch.Tensor:
    """Exact value of ``(0 if overwrite else dst) + src * scale`` in fp64 (not rounded)."""
    base = torch.zeros_like(dst, dtype=torch.float64) if overwrite else dst.to(torch.float64)
    return base + src.to(torch.float64).reshape(dst.shape) * float(scale)


def sum_sq_fp64(x: torch.Tensor) -> float:
    x64 = x.reshape(-1).to(torch.float64)
    return float(torch.dot(x64, x64)) if x64.numel() else 0.0


def eager_accumulate_(main_grad: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The eager baseline: ``main_grad.add_(grad.float())`` (a cast pass, a temporary, an add pass)."""
    return main_grad.add_(grad.float())
