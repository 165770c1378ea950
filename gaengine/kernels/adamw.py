"""Fused AdamW step on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``): one pass per parameter.

Each program reads ``BLOCK_SIZE`` elements of grad, exp_avg (m), exp_avg_sq (v) and the param and writes m, v,
the param and, when a model parameter is attached, its bf16 | fp16 rounding. The param and its moments are
either fp32 (the master weight) or bf16 | fp16 (the model parameter updated in place, ``master_weights=False``):
then p, m, v are widened to fp32, updated with the same fp32 operations, and each rounded to nearest even
(torch's ``.to(dtype)``). Bytes per element with an fp32 gradient: fp32 param read 4 + 4 + 4 + 4, write
4 + 4 + 4 (+ 2 for a bf16 | fp16 model parameter): 28 B, or 30 B with the model write (the separate master ->
model copy it replaces moves 6 B); bf16 | fp16 param in place: read 4 + 2 + 2 + 2, write 2 + 2 + 2 = 16 B
(an fp32 scale pass 8 B + a rounding copy of the gradient 6 B + torch's fused AdamW on bf16 params 14 B = 28 B).

Device-side control, no host sync (the protocol of torch's fused optimizers with ``GradScaler``):
``grad_scale`` and ``found_inf`` are 0-d tensors read by every program through their pointers; when
``found_inf != 0`` every load and store is masked off, and the launcher advanced the step counts by
``found_inf == 0`` (a device op), so a skipped update leaves every tensor bit-identical. The bias corrections
``1 - beta ** step`` are computed in fp64 inside the kernel from the step tensor.

Numerics: the fp32 operations of torch's fused CPU AdamW (and of ``csrc/adamw_kernels.h``), in the same order:
``g = grad / grad_scale``; ``p *= 1 - lr * wd``; ``m = fma(1 - beta1, g - m, m)`` (torch's lerp);
``v = fma((1 - beta2) * g, g, v * beta2)``; ``p += (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)``, with IEEE
division and square root (``div_rn``, ``sqrt_rn``) and no other contraction (``enable_fp_fusion=False``).
The coefficients are rounded to fp32 once from their fp64 values, as torch does; ``beta ** step`` is
``exp2(step * log2(beta))`` in fp64 (torch: ``std::pow``), which can move an fp32 coefficient by one ulp.
Sources: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019 (Algorithm 2);
``torch.optim.AdamW``.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from gaengine.contract import AdamWStep
from gaengine.kernels._utils import (
    check_block_size,
    check_device_scalar,
    check_float_input,
    check_fp32_buffer,
    device_guard,
)

__all__ = ["adamw_step_", "BLOCK_SIZE"]

BLOCK_SIZE = 2048  # elements per program: 8 fp32 per thread at 8 warps, two 128-bit loads per stream per thread
NUM_WARPS = 8
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@triton.jit
def _rounded(x, TO_BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest even to bf16 (TO_BF16) or fp16, as torch's ``.to(dtype)``."""
    # One return for both (the compiler checks every return of a function against the first, the branch of a
    # constexpr condition not taken included: two returns of bf16 and fp16 fail to compile for a GPU, though the
    # interpreter runs them; tests/test_aot.py compiles both).
    if TO_BF16:
        # By integer ops (c10::BFloat16's rule, NaN -> 0x7FC0): the same bits compiled and under the
        # interpreter, whose float casts to bf16 truncate.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)
        y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(tl.float16)  # round to nearest even
    return y


@triton.jit
def _adamw_kernel(
    param_ptr,  # (n_elements,) fp32 (the master weight) | bf16 (PARAM_BF16) | fp16 (PARAM_FP16), read and written
    grad_ptr,  # (n_elements,) fp32 | bf16 | fp16, read
    exp_avg_ptr,  # (n_elements,) the param's dtype, read and written
    exp_avg_sq_ptr,  # (n_elements,) the param's dtype, read and written
    model_ptr,  # (n_elements,) bf16 (MODEL_BF16) | fp16, written when HAS_MODEL (fp32 param only); otherwise unused
    step_ptr,  # () fp32, read: the step count after this update's increment
    grad_scale_ptr,  # () fp32, read when HAS_GRAD_SCALE
    found_inf_ptr,  # () fp32, read when HAS_FOUND_INF: nothing is written unless it is 0
    n_elements,
    lr: "fp64",
    log2_beta1: "fp64",
    log2_beta2: "fp64",
    decay_factor: "fp32",  # 1 - lr * weight_decay, rounded to fp32
    lerp_coeff: "fp32",  # 1 - beta1 (LERP_SMALL) or (1 - beta1) - 1, fp32
    beta2: "fp32",
    one_minus_beta2: "fp32",
    eps: "fp32",
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    MODEL_BF16: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    PARAM_FP16: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECAY: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64 before the multiply: parameters may pass 2^31 elements
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    if HAS_FOUND_INF:
        n_elements = tl.where(tl.load(found_inf_ptr) == 0, n_elements, 0)  # a skipped step masks everything
    mask = offsets < n_elements

    # Bias corrections in fp64 from the step tensor, then the fp32 coefficients (torch: double, then float).
    step = tl.maximum(tl.load(step_ptr).to(tl.float64), 1.0)  # >= 1 once incremented; 0 only when skipped
    bias_correction1 = 1.0 - tl.exp2(step * tl.full([], log2_beta1, tl.float64))
    bias_correction2 = 1.0 - tl.exp2(step * tl.full([], log2_beta2, tl.float64))
    neg_step_size = (-(tl.full([], lr, tl.float64) / bias_correction1)).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)

    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = tl.math.div_rn(g, tl.load(grad_scale_ptr).to(tl.float32))
    if MAXIMIZE:
        g = -g
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # widening: exact
    if DECAY:
        p = p * decay_factor
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if LERP_SMALL:
        m = tl.fma(g - m, lerp_coeff, m)
    else:
        m = tl.fma(g - m, lerp_coeff, g)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.fma(g * one_minus_beta2, g, v * beta2)
    denom = tl.math.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.math.div_rn(m * neg_step_size, denom)
    if PARAM_BF16 or PARAM_FP16:  # in place: the fp32 results rounded once each (m, v fed the update unrounded)
        tl.store(exp_avg_ptr + offsets, _rounded(m, PARAM_BF16), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, _rounded(v, PARAM_BF16), mask=mask)
        tl.store(param_ptr + offsets, _rounded(p, PARAM_BF16), mask=mask)
    else:
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
        tl.store(param_ptr + offsets, p, mask=mask)
    if HAS_MODEL:
        tl.store(model_ptr + offsets, _rounded(p, MODEL_BF16), mask=mask)


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (kept as a Python float), as torch's ``float(double)`` does."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")  # beta ** step == 0 for beta == 0 and step >= 1


def _check_step(t: torch.Tensor, i: int, device: torch.device) -> None:
    if not (isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.float32 and t.device == device):
        raise ValueError(f"steps[{i}] must be a 0-d float32 tensor on {device}")


def _check_tensors(a: AdamWStep) -> None:
    """``adamw_step_``'s checks of every tensor (``ValueError`` naming the argument and the parameter index)."""
    n = len(a.params)
    device = a.params[0].device
    for name, t in (("grad_scale", a.grad_scale), ("found_inf", a.found_inf)):
        if t is not None:
            check_device_scalar(t, name, device)
    for i in range(n):
        if a.params[i].dtype in _LOW_PRECISION:  # updated in place, moments in its dtype
            for name, t in (("params", a.params[i]), ("exp_avgs", a.exp_avgs[i]), ("exp_avg_sqs", a.exp_avg_sqs[i])):
                check_float_input(t, f"{name}[{i}]")
                if t.dtype != a.params[i].dtype:
                    raise ValueError(f"{name}[{i}] must be {a.params[i].dtype} (the dtype of params[{i}]), got "
                                     f"{t.dtype}")
            if a.model_params[i] is not None:
                raise ValueError(f"model_params[{i}] must be None: params[{i}] is {a.params[i].dtype}, updated in "
                                 "place")
        else:
            for name, t in (("params", a.params[i]), ("exp_avgs", a.exp_avgs[i]), ("exp_avg_sqs", a.exp_avg_sqs[i])):
                check_fp32_buffer(t, f"{name}[{i}]")
        check_float_input(a.grads[i], f"grads[{i}]")
        _check_step(a.steps[i], i, device)
        numel = a.params[i].numel()
        tensors = [a.grads[i], a.exp_avgs[i], a.exp_avg_sqs[i]]
        model = a.model_params[i]
        if model is not None:
            check_float_input(model, f"model_params[{i}]")
            if model.dtype not in _LOW_PRECISION:
                raise ValueError(f"model_params[{i}] must be bfloat16 or float16, got {model.dtype}")
            tensors.append(model)
        if any(t.numel() != numel for t in tensors):
            raise ValueError(f"grads[{i}], exp_avgs[{i}], exp_avg_sqs[{i}] and model_params[{i}] must have the "
                             f"{numel} elements of params[{i}]")
        if any(t.device != device for t in [a.params[i], *tensors]):
            raise ValueError(f"every tensor of parameter {i} must be on {device}")



def _kernel_constants(a: AdamWStep) -> tuple[dict, dict]:
    """The scalar arguments (fp32-rounded as the C++ kernel rounds them) and the compile-time flags of every launch."""
    lerp_weight = _fp32(1.0 - a.beta1)
    lerp_small = abs(lerp_weight) < 0.5
    scalars = dict(
        lr=float(a.lr),
        log2_beta1=_log2(a.beta1),
        log2_beta2=_log2(a.beta2),
        decay_factor=_fp32(1.0 - a.lr * a.weight_decay),
        lerp_coeff=lerp_weight if lerp_small else _fp32(lerp_weight - 1.0),
        beta2=_fp32(a.beta2),
        one_minus_beta2=_fp32(1.0 - a.beta2),
        eps=_fp32(a.eps),
    )
    flags = dict(
        HAS_GRAD_SCALE=a.grad_scale is not None,
        HAS_FOUND_INF=a.found_inf is not None,
        MAXIMIZE=bool(a.maximize),
        DECAY=a.weight_decay != 0,
        LERP_SMALL=lerp_small,
    )
    return scalars, flags


def adamw_step_(*args, block_size: int = BLOCK_SIZE, **kwargs) -> None:
    """One AdamW update of every ``params[i]``, one kernel launch (one pass) per parameter.

    Arguments: ``*AdamWStep(...)`` (positional or by name; ``gaengine.contract.AdamWStep`` gives them and the
    contract), the tensors on one CUDA device (or CPU under ``TRITON_INTERPRET=1``); ``steps`` are incremented with
    one device op before the launches, and the kernels read the new value. ``grad_scale`` / ``found_inf``: any
    floating dtype. block_size: elements per program, a power of two >= 16 (tests use small ones to get many
    programs).

    Raises ``ValueError`` for a wrong dtype, layout, numel or device, before anything is written.
    """
    a = AdamWStep(*args, **kwargs)
    n = len(a.params)
    if not (len(a.grads) == len(a.exp_avgs) == len(a.exp_avg_sqs) == len(a.steps) == len(a.model_params) == n):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs, steps and model_params must have the same length")
    check_block_size(block_size)
    if n == 0:
        return
    _check_tensors(a)

    # step += 1, or step += (found_inf == 0): on the device, before the kernels read it.
    increment = 1 if a.found_inf is None else (a.found_inf == 0).to(torch.float32)
    torch._foreach_add_(a.steps, increment)

    scalars, flags = _kernel_constants(a)
    with device_guard(a.params[0]):
        for i in range(n):
            numel = a.params[i].numel()
            if numel == 0:
                continue
            model = a.model_params[i]
            _adamw_kernel[(triton.cdiv(numel, block_size),)](
                a.params[i], a.grads[i], a.exp_avgs[i], a.exp_avg_sqs[i],
                a.params[i] if model is None else model,  # never written without HAS_MODEL
                a.steps[i],
                a.params[i] if a.grad_scale is None else a.grad_scale,  # never read without HAS_GRAD_SCALE
                a.params[i] if a.found_inf is None else a.found_inf,  # never read without HAS_FOUND_INF
                numel, **scalars,
                HAS_MODEL=model is not None, MODEL_BF16=model is not None and model.dtype == torch.bfloat16,
                PARAM_BF16=a.params[i].dtype == torch.bfloat16, PARAM_FP16=a.params[i].dtype == torch.float16,
                **flags, BLOCK_SIZE=block_size, num_warps=NUM_WARPS, enable_fp_fusion=False,
            )
