"""Fused Lion step on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``): one pass per parameter.

Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023, Algorithm 2, decoupled weight decay):
``c = beta1 * m + (1 - beta1) * g``; ``p = p * (1 - lr * wd)``; ``p = p - lr * sign(c)``;
``m = beta2 * m + (1 - beta2) * g``. The fp32 operations of the Lion functor (``csrc/optim/lion.h``) in its order,
each rounded once (``enable_fp_fusion=False``), the coefficients rounded to fp32 once from their fp64 values, the
gradient divided by ``grad_scale`` with the IEEE division: the same bits as the C++ and CUDA launchers. The param
and ``exp_avg`` are fp32 (masters) or bf16 | fp16 (updated in place: widened, updated in fp32, each rounded to
nearest even); an attached bf16 | fp16 model parameter receives the new fp32 param's rounding. ``found_inf != 0``
masks every load and store (no host sync). Bytes per element, fp32 param and grad: 12 read + 8 written (+ 2 for
a model write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gaengine.kernels._utils import check_block_size, check_device_scalar, check_float_input, device_guard
from gaengine.kernels.adamw import _fp32, _rounded

__all__ = ["BLOCK_SIZE", "lion_step_"]

BLOCK_SIZE = 2048
NUM_WARPS = 8
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@triton.jit
def _lion_kernel(
    param_ptr,  # (n_elements,) fp32 | bf16 (PARAM_BF16) | fp16 (PARAM_FP16), read and written
    grad_ptr,  # (n_elements,) fp32 | bf16 | fp16, read
    exp_avg_ptr,  # (n_elements,) the param's dtype, read and written
    model_ptr,  # (n_elements,) bf16 (MODEL_BF16) | fp16, written when HAS_MODEL (fp32 param only)
    grad_scale_ptr,  # () fp32, read when HAS_GRAD_SCALE
    found_inf_ptr,  # () fp32, read when HAS_FOUND_INF: nothing is written unless it is 0
    n_elements,
    lr: "fp32",
    beta1: "fp32",
    one_minus_beta1: "fp32",
    beta2: "fp32",
    one_minus_beta2: "fp32",
    decay_factor: "fp32",
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    MODEL_BF16: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    PARAM_FP16: tl.constexpr,
    DECAY: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    if HAS_FOUND_INF:
        n_elements = tl.where(tl.load(found_inf_ptr) == 0, n_elements, 0)  # a skipped step masks everything
    mask = offsets < n_elements
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = tl.math.div_rn(g, tl.load(grad_scale_ptr).to(tl.float32))
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    c = m * beta1 + g * one_minus_beta1
    if DECAY:
        p = p * decay_factor
    sign = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0)).to(tl.float32)
    p = p - sign * lr
    m = m * beta2 + g * one_minus_beta2
    if PARAM_BF16 or PARAM_FP16:
        tl.store(exp_avg_ptr + offsets, _rounded(m, PARAM_BF16), mask=mask)
        tl.store(param_ptr + offsets, _rounded(p, PARAM_BF16), mask=mask)
    else:
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
        tl.store(param_ptr + offsets, p, mask=mask)
    if HAS_MODEL:
        tl.store(model_ptr + offsets, _rounded(p, MODEL_BF16), mask=mask)


def _check_tensors(params, grads, exp_avgs, model_params, grad_scale, found_inf) -> None:
    """The launcher's checks of every tensor (``ValueError`` naming the argument and the parameter index)."""
    device = params[0].device
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is not None:
            check_device_scalar(t, name, device)
    for i, (p, g, m, model) in enumerate(zip(params, grads, exp_avgs, model_params)):
        for name, t in (("params", p), ("exp_avgs", m), ("grads", g)):
            check_float_input(t, f"{name}[{i}]")
        if p.dtype not in (torch.float32, *_LOW_PRECISION) or m.dtype != p.dtype:
            raise ValueError(f"params[{i}] must be float32, bfloat16 or float16 and exp_avgs[{i}] of its dtype, got "
                             f"{p.dtype} and {m.dtype}")
        if model is not None and (p.dtype != torch.float32 or model.dtype not in _LOW_PRECISION):
            raise ValueError(f"model_params[{i}] must be bfloat16 or float16 beside a float32 params[{i}], got "
                             f"{model.dtype} beside {p.dtype}")
        tensors = [g, m]
        if model is not None:
            check_float_input(model, f"model_params[{i}]")
            tensors.append(model)
        if any(t.numel() != p.numel() or t.device != device for t in tensors) or p.device != device:
            raise ValueError(f"grads[{i}], exp_avgs[{i}] and model_params[{i}] must have the {p.numel()} elements "
                             f"of params[{i}], every tensor on {device}")


def lion_step_(params, grads, states, steps, model_params, hyper, grad_scale=None, found_inf=None, *,
               block_size: int = BLOCK_SIZE) -> None:
    """One Lion update of every ``params[i]``, one kernel launch (one pass) per parameter.

    The arguments of every fused elementwise optimizer's kernel (``gaengine.optim.FusedElementwiseOptimizer``):
    params, grads (lists of tensors on one CUDA device, or CPU under ``TRITON_INTERPRET=1``), states (``[exp_avgs]``),
    steps (``[]``: Lion keeps none), model_params (None or a bf16 | fp16 tensor each), hyper
    (``[lr, beta1, beta2, weight_decay]``), grad_scale / found_inf (None or 0-d tensors on the device).
    block_size: elements per program, a power of two >= 16.

    Raises ``ValueError`` for a wrong dtype, layout, numel or device, before anything is written.
    """
    (exp_avgs,) = states
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(model_params) == n) or len(steps) != 0:
        raise ValueError("params, grads, exp_avgs and model_params must have the same length (steps empty)")
    check_block_size(block_size)
    if n == 0:
        return
    _check_tensors(params, grads, exp_avgs, model_params, grad_scale, found_inf)
    lr, beta1, beta2, weight_decay = (float(h) for h in hyper)
    scalars = dict(lr=_fp32(lr), beta1=_fp32(beta1), one_minus_beta1=_fp32(1.0 - beta1), beta2=_fp32(beta2),
                   one_minus_beta2=_fp32(1.0 - beta2), decay_factor=_fp32(1.0 - lr * weight_decay))
    with device_guard(params[0]):
        for p, g, m, model in zip(params, grads, exp_avgs, model_params):
            if p.numel() == 0:
                continue
            _lion_kernel[(triton.cdiv(p.numel(), block_size),)](
                p, g, m, p if model is None else model,
                p if grad_scale is None else grad_scale, p if found_inf is None else found_inf,
                p.numel(), **scalars,
                HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                HAS_MODEL=model is not None, MODEL_BF16=model is not None and model.dtype == torch.bfloat16,
                PARAM_BF16=p.dtype == torch.bfloat16, PARAM_FP16=p.dtype == torch.float16,
                DECAY=weight_decay != 0, BLOCK_SIZE=block_size, num_warps=NUM_WARPS, enable_fp_fusion=False,
            )
