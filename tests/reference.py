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


def adamw_step_fp64(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, maximize,
                    grad_scale=None):
    """torch.optim.AdamW's update of one parameter, exactly in fp64 (not rounded): returns the new
    ``(param, exp_avg, exp_avg_sq)`` as fp64 tensors; ``step`` is the step count after the increment."""
    g = grad.reshape(-1).to(torch.float64) / (1.0 if grad_scale is None else float(grad_scale))
    g = -g if maximize else g
    p, m, v = (t.reshape(-1).to(torch.float64) for t in (param, exp_avg, exp_avg_sq))
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - lr / (1.0 - beta1**step) * m / (v.sqrt() / (1.0 - beta2**step) ** 0.5 + eps)
    return p, m, v
