"""A Linear's weight (and bias) gradient accumulated straight into fp32 main_grad (gradient accumulation fusion):
``dw = (0 if overwrite_w else dw) + scale * grad_output^T @ input`` and ``db = (0 if overwrite_b else db) + scale *
grad_output.sum(0)``, the Triton kernel behind ``torch.ops.gaengine.wgrad_accumulate_`` (``csrc/wgrad.h``).

The weight kernel is the Triton matmul tutorial's loop (grouped program order, an fp32 accumulator in registers over
the token dimension) with a C-load epilogue: the fp32 ``dw`` tile is read once and written once, after the loop
(``beta = 1``; on micro-batch 0 of a window, ``overwrite_w``, it is written without being read). No low-precision
weight gradient exists at any point. This is apex's ``wgrad_gemm_accum_fp32`` (one ``cublasGemmEx``: bf16 A and B,
fp32 C, ``beta = 1``) that Megatron-Core's ``gradient_accumulation_fusion`` calls, as a portable kernel.

Bytes per weight element and micro-batch: 8 (read 4 + write 4 of fp32 ``dw``; 4 when overwriting), plus the operand
reads, ``tokens * (out + in) * 2`` B in bf16 for the whole GEMM times the tile re-reads.

Numerics: bf16 | fp16 operands go to ``tl.dot`` as they are (products exact in fp32, fp32 accumulation); fp32
operands with ``input_precision="ieee"`` (no TF32). Against the fp64 sum, each element is within the fp32 error
bound of a ``tokens``-term sum (``gamma_tokens * sum |dY| |X|``). The epilogue adds the old ``dw`` with one rounding
(unscaled: one IEEE add; scaled: one fused multiply-add ``fma(acc, scale, dw)``, or one multiply when overwriting).

Tiles: autotuned over ``CONFIGS`` on a GPU, keyed on the problem's sizes and dtypes (``dw`` is restored after each
timed try, so autotuning adds nothing). Under ``TRITON_INTERPRET=1`` the first config (or the one passed) runs
without timing. ``tests/test_aot.py`` compiles every config for sm_80 and sm_90 and reads the PTX (tensor-core
``mma``, no spills).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gaengine.kernels._utils import FLOAT_DTYPES, check_fp32_buffer, device_guard, scale_args

__all__ = ["wgrad_accumulate_", "CONFIGS", "BIAS_BLOCK_OUT", "BIAS_BLOCK_TOKENS", "BIAS_NUM_WARPS"]


def _config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
                         num_warps=num_warps, num_stages=num_stages)


# (out tile, in tile, token step, warps, pipeline stages): the Triton matmul tutorial's fp16 shapes for sm_80/sm_90,
# at most 64 fp32 accumulator values per thread, so that the epilogue's loaded C tile fits beside them without spills
# (128 x 128 at 4 warps, the tutorial's, spills 96-248 B on sm_80/sm_90 with the C load: tests/test_aot.py). The
# first fits every shape a transformer's Linears take; the smaller ones are for narrow layers (few output tiles on
# 108-132 SMs). Each is compiled and checked ahead of time (tests/test_aot.py).
CONFIGS = [
    _config(128, 128, 32, 8, 4),
    _config(128, 128, 64, 8, 3),
    _config(64, 128, 32, 4, 4),
    _config(128, 64, 32, 4, 4),
    _config(64, 64, 64, 4, 3),
]

# The bias gradient: BIAS_BLOCK_OUT output features per program, BIAS_BLOCK_TOKENS tokens per step.
BIAS_BLOCK_OUT = 128
BIAS_BLOCK_TOKENS = 8
BIAS_NUM_WARPS = 4

_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _wgrad_kernel(
    dw_ptr,  # (M, N) fp32 contiguous, read unless OVERWRITE, written
    dy_ptr,  # (K, M) fp32 | bf16 | fp16, rows of stride stride_dy, read (dY: grad_output, tokens x out)
    x_ptr,  # (K, N) fp32 | bf16 | fp16, rows of stride stride_x, read (X: input, tokens x in)
    scale_ptr,  # () any float, read when SCALE_IS_PTR; otherwise unused
    scale,  # fp32 scalar, used when HAS_SCALE and not SCALE_IS_PTR
    M,  # out features
    N,  # in features
    K,  # tokens
    stride_dy,
    stride_x,
    DOT_DTYPE: tl.constexpr,  # the operands' common dtype (fp32 when they differ)
    HAS_SCALE: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    OVERWRITE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped program order (the matmul tutorial's): GROUP_M rows of tiles share their dY columns in L2.
    pid = tl.program_id(0).to(tl.int64)  # int64 before the multiplies: a weight passes 2^31 elements
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # A = dY^T: A[m, k] = dY[k, m], contiguous along m; B = X: B[k, n], contiguous along n.
    a_ptrs = dy_ptr + offs_k[None, :] * stride_dy + offs_m[:, None]
    b_ptrs = x_ptr + offs_k[:, None] * stride_x + offs_n[None, :]
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m & (offs_k[None, :] < k_left), other=0.0).to(DOT_DTYPE)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n, other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
        a_ptrs += BLOCK_K * stride_dy
        b_ptrs += BLOCK_K * stride_x

    # Epilogue: C loaded once, added (beta = 1) with one rounding, stored once.
    if HAS_SCALE and SCALE_IS_PTR:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        s = scale
    dw_ptrs = dw_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m & mask_n
    if OVERWRITE:
        out = acc * s if HAS_SCALE else acc
    else:
        old = tl.load(dw_ptrs, mask=mask, other=0.0)
        out = tl.fma(acc, s, old) if HAS_SCALE else old + acc
    tl.store(dw_ptrs, out, mask=mask)


@triton.jit
def _bias_grad_kernel(
    db_ptr,  # (M,) fp32, read unless OVERWRITE, written
    dy_ptr,  # (K, M) fp32 | bf16 | fp16, rows of stride stride_dy, read
    scale_ptr,
    scale,
    M,
    K,
    stride_dy,
    HAS_SCALE: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    OVERWRITE: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs_m = pid * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    offs_k = tl.arange(0, BLOCK_TOKENS)
    mask_m = offs_m < M
    ptrs = dy_ptr + offs_k[:, None] * stride_dy + offs_m[None, :]
    acc = tl.zeros((BLOCK_TOKENS, BLOCK_OUT), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_TOKENS)):
        mask = (offs_k[:, None] < K - k * BLOCK_TOKENS) & mask_m[None, :]
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += BLOCK_TOKENS * stride_dy
    total = tl.sum(acc, axis=0)
    if HAS_SCALE and SCALE_IS_PTR:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        s = scale
    if OVERWRITE:
        out = total * s if HAS_SCALE else total
    else:
        old = tl.load(db_ptr + offs_m, mask=mask_m, other=0.0)
        out = tl.fma(total, s, old) if HAS_SCALE else old + total
    tl.store(db_ptr + offs_m, out, mask=mask_m)


# On a GPU: the best of CONFIGS for each problem size and dtype, timed once (dw restored after every timed run).
_wgrad_autotuned = triton.autotune(CONFIGS, key=["M", "N", "K", "DOT_DTYPE", "OVERWRITE"],
                                   restore_value=["dw_ptr"])(_wgrad_kernel)


def _check_operand(t: torch.Tensor, name: str) -> None:
    if not (isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in FLOAT_DTYPES):
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-d float32, bfloat16 or float16 tensor, got {got}")


def _check_main_grad(t: torch.Tensor, name: str, shape: tuple, device: torch.device) -> None:
    check_fp32_buffer(t, name)
    if tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"{name} must be a float32 tensor of shape {shape} on {device}, got shape {tuple(t.shape)} "
                         f"on {t.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its features (rows may have any stride); a copy only when it has not."""
    return t if t.stride(1) == 1 else t.contiguous()


def _check_wgrad_args(dw, db, grad_output: torch.Tensor, input: torch.Tensor) -> tuple[int, int, int]:
    """``wgrad_accumulate_``'s checks (``ValueError`` naming the argument); returns ``(tokens, out, in)``."""
    _check_operand(grad_output, "grad_output")
    _check_operand(input, "input")
    tokens, out_features = grad_output.shape
    in_features = input.shape[1]
    if input.shape[0] != tokens:
        raise ValueError(f"grad_output and input must have the same rows (tokens), got {tokens} and "
                         f"{input.shape[0]}")
    if input.device != grad_output.device:
        raise ValueError(f"input is on {input.device} but grad_output is on {grad_output.device}; they must match")
    device = grad_output.device
    if dw is not None:
        _check_main_grad(dw, "dw", (out_features, in_features), device)
    if db is not None:
        _check_main_grad(db, "db", (out_features,), device)
    return tokens, out_features, in_features


def _launch_weight_grad(dw: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, scale_ptr, scale_value,
                        overwrite: bool, config: triton.Config | None, common: dict) -> None:
    """The weight-gradient launch of ``wgrad_accumulate_``: ``config``, else autotuned (``CONFIGS[0]`` under the
    interpreter). dy: (tokens, out), x: (tokens, in), features of stride 1."""
    tokens, out_features = dy.shape
    in_features = x.shape[1]
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    dot_dtype = _DOT_DTYPES[dy.dtype] if dy.dtype == x.dtype else tl.float32
    if interpret and dot_dtype == tl.bfloat16:
        # Triton 3.9's interpreter multiplies bf16 tiles as their uint16 storage (integers): widen them
        # first. Exact, like the GPU's bf16 products into an fp32 accumulator; only the sum's order differs.
        dot_dtype = tl.float32
    args = (dw, dy, x, scale_ptr, scale_value, out_features, in_features, tokens, dy.stride(0), x.stride(0))
    meta = dict(DOT_DTYPE=dot_dtype, OVERWRITE=overwrite, **common)
    chosen = config if config is not None else CONFIGS[0] if interpret else None
    if chosen is None:
        def grid(m):
            return (triton.cdiv(out_features, m["BLOCK_M"]) * triton.cdiv(in_features, m["BLOCK_N"]),)
        _wgrad_autotuned[grid](*args, **meta)
    else:
        kw = chosen.kwargs
        grid = (triton.cdiv(out_features, kw["BLOCK_M"]) * triton.cdiv(in_features, kw["BLOCK_N"]),)
        _wgrad_kernel[grid](*args, **meta, **kw, num_warps=chosen.num_warps, num_stages=chosen.num_stages)


def wgrad_accumulate_(
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    grad_output: torch.Tensor,
    input: torch.Tensor,
    overwrite_w: bool,
    overwrite_b: bool,
    scale: float | torch.Tensor = 1.0,
    *,
    config: triton.Config | None = None,
) -> None:
    """``dw = (0 if overwrite_w else dw) + scale * fp32(grad_output)^T @ fp32(input)`` and ``db = (0 if overwrite_b
    else db) + scale * fp32(grad_output).sum(0)``, in place: the arguments of ``torch.ops.gaengine.wgrad_accumulate_``.

    dw: (out, in) fp32 contiguous (a Linear weight's main_grad view), or None; written, or read and written.
    db: (out,) fp32 contiguous (its bias's main_grad view), or None.
    grad_output: (tokens, out) fp32 | bf16 | fp16, read; input: (tokens, in) fp32 | bf16 | fp16, read; both 2-d, on
        ``dw``'s device (a CUDA device, or CPU under ``TRITON_INTERPRET=1``), any row stride (features of stride 1
        are read in place; others are copied once). Operands of different dtypes are multiplied in fp32.
    overwrite_w, overwrite_b: write without reading (the first contribution of an accumulation window); with no
        tokens, a write is of zeros.
    scale: a Python float (rounded to fp32; ``1.0`` compiles the multiply away) or a 0-d floating tensor on the
        device, read inside the kernel so the host never waits for it.
    config: one of ``CONFIGS`` to run instead of autotuning (tests); under the interpreter the default is
        ``CONFIGS[0]``.

    Raises ``ValueError`` naming the argument for a wrong dtype, shape, layout or device, before anything is written.
    """
    tokens, out_features, in_features = _check_wgrad_args(dw, db, grad_output, input)
    target = dw if dw is not None else db
    if target is None:
        return
    scale_ptr, scale_value, has_scale, scale_is_ptr = scale_args(scale, target)
    if tokens == 0:  # the micro-batch's gradient is zero
        for t, overwrite in ((dw, overwrite_w), (db, overwrite_b)):
            if t is not None and overwrite:
                t.zero_()
        return
    dy = _rows(grad_output)
    common = dict(HAS_SCALE=has_scale, SCALE_IS_PTR=scale_is_ptr)
    with device_guard(target):
        if dw is not None and dw.numel():
            _launch_weight_grad(dw, dy, _rows(input), scale_ptr, scale_value, bool(overwrite_w), config, common)
        if db is not None and db.numel():
            grid = (triton.cdiv(out_features, BIAS_BLOCK_OUT),)
            _bias_grad_kernel[grid](db, dy, scale_ptr, scale_value, out_features, tokens, dy.stride(0),
                                    OVERWRITE=bool(overwrite_b), BLOCK_OUT=BIAS_BLOCK_OUT,
                                    BLOCK_TOKENS=BIAS_BLOCK_TOKENS, num_warps=BIAS_NUM_WARPS, **common)
