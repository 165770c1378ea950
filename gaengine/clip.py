"""Drop-in ``clip_grad_norm_`` whose norm is one fused pass per gradient and never leaves the device."""

from __future__ import annotations

import functools
import numbers
import types
import warnings
from collections.abc import Iterable

import torch

from gaengine.backends import get_backend
from gaengine.norm import clip_coefficient

__all__ = ["OWNER_ATTR", "clip_grad_norm_", "clip_coefficient", "guard_torch_clip_grad_norm"]

# The attribute a GradientAccumulator sets on each parameter it owns: a weakref to it.
OWNER_ATTR = "_gaengine_accumulator"
_warned = False

# The dtypes the backends' l2norm_sq takes; any other gradient (float64, complex) goes to torch's clip_grad_norm_.
_FUSED_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def warn_if_accumulated(params: list[torch.Tensor], caller: str) -> None:
    """Warn once per process when ``params`` holds a parameter of a live ``GradientAccumulator`` with no ``.grad``:
    ``caller`` (a clip over ``.grad``) would return a norm of 0 and clip nothing, while gaengine clips itself."""
    global _warned
    if _warned:
        return
    for p in params:
        owner = getattr(p, OWNER_ATTR, None) if isinstance(p, torch.Tensor) else None
        if owner is not None and owner() is not None and p.grad is None:
            _warned = True
            warnings.warn(
                f"{caller} was given the parameters of a gaengine.GradientAccumulator, whose .grad is None "
                "(gaengine accumulates into its fp32 main_grad and frees .grad as it goes), so it returns a norm of "
                "0 and clips nothing. gaengine clips the window's gradient itself: set "
                "GradientAccumulator(max_grad_norm=...) (1.0 by default), delete this call, and log "
                "result.grad_norm and result.clip_coef from acc.step()", UserWarning, stacklevel=3)
            return


def guard_torch_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` (the name torch, HF Transformers, Accelerate and Lightning call)
    warn once (``warn_if_accumulated``) when a GradientAccumulator's parameters are passed to it, then run torch's
    own. Called by ``GradientAccumulator.__init__``; idempotent. A reference taken before (``from
    torch.nn.utils import clip_grad_norm_``) keeps torch's function, without the warning."""
    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_gaengine_guard", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters, *args, **kwargs):
        if not isinstance(parameters, torch.Tensor):
            generator = isinstance(parameters, types.GeneratorType)
            parameters = list(parameters)
            warn_if_accumulated(parameters, "torch.nn.utils.clip_grad_norm_")
            if generator:  # torch warns about an empty generator itself
                parameters = (p for p in parameters)
        else:
            warn_if_accumulated([parameters], "torch.nn.utils.clip_grad_norm_")
        return original(parameters, *args, **kwargs)

    clip_grad_norm_._gaengine_guard = True
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a global L2 norm of at most ``max_norm``, in place.

    Same signature and result as ``torch.nn.utils.clip_grad_norm_``: returns the total norm of all
    gradients (before clipping) as a 0-d fp32 tensor on the gradients' device, and scales every ``.grad``
    by ``min(1, max_norm / (total_norm + 1e-6))`` with no host sync. The L2 norm of each gradient is one
    pass of the backend's ``l2norm_sq`` (fp32 | bf16 | fp16 grads, fp32 sums). Other ``norm_type`` values,
    gradients on several devices, sparse gradients and gradients of other dtypes (float64) go to torch's own
    implementation. ``foreach`` is accepted for compatibility; the scaling uses ``torch._foreach_mul_``.

    Raises ``TypeError`` naming ``max_norm`` / ``norm_type`` when it is not a number, before any gradient is
    read; and ``RuntimeError`` like torch when ``error_if_nonfinite`` and the norm is inf or NaN (this reads
    the norm on the host, as torch does).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (numbers.Real, torch.Tensor)):
        raise TypeError(f"max_norm must be a float, got {type(max_norm).__name__}")
    if isinstance(max_norm, torch.Tensor) and (max_norm.numel() != 1 or max_norm.is_complex()):
        raise TypeError(f"max_norm must be a float or a one-element real tensor, got shape "
                        f"{tuple(max_norm.shape)} {max_norm.dtype}")
    try:
        norm_type = float(norm_type)  # a float, or a string float() reads ("inf"), as torch takes
    except (TypeError, ValueError):
        raise TypeError(f"norm_type must be a float or 'inf', got {norm_type!r}") from None
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    warn_if_accumulated(params, "gaengine.clip_grad_norm_")
    grads = [p.grad for p in params if p.grad is not None]
    if (float(norm_type) != 2.0 or not grads or len({g.device for g in grads}) > 1
            or any(g.is_sparse or g.dtype not in _FUSED_GRAD_DTYPES for g in grads)):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    backend = get_backend("auto", grads[0].device)
    total_sq = torch.stack([backend.l2norm_sq(g)[0] for g in grads]).sum()
    total_norm = total_sq.sqrt()
    if error_if_nonfinite and not bool(torch.isfinite(total_norm)):  # host read, only when asked (as torch)
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    coef = clip_coefficient(total_norm, float(max_norm))
    torch._foreach_mul_(grads, coef)
    return total_norm
