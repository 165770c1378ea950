"""Accumulate a low-precision gradient into an fp32 main_grad buffer: ``dst = (0 if overwrite else dst) + src * scale``.

Bytes per element (bf16 src): 6 B when overwriting (read 2, write 4: micro-batch 0 of a window, no zeroing
pass), 10 B when adding (read 2 + 4, write 4).

Numerics: ``src`` is widened to fp32 (exact) as it is loaded. Unscaled, each element is one IEEE fp32 add,
bitwise equal to ``dst.add_(src)`` in torch (and to ``src.float()`` when overwriting). Scaled, each element
is one fused multiply-add (one rounding: within 0.5 fp32 ulp of the exact value, and the same bits on GPU
and under the interpreter), or one multiply when overwriting.

Shape: ``BLOCK_SIZE`` (4096) elements per program at 8 warps, processed in two half-block steps (each loaded,
combined and stored before the next), all global accesses of the data 128-bit; 26-32 registers per thread on
sm_80 / sm_90, which allows full occupancy (the whole block at once needed 34-40 when adding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gaengine.kernels._utils import (
    check_block_size,
    check_float_input,
    check_fp32_buffer,
    device_guard,
    scale_args,
)

__all__ = ["accumulate_", "BLOCK_SIZE"]

# Elements per program: 16 per thread at 8 warps, in two half-block steps of 8 (two 128-bit loads of dst, one or
# two of src, two 128-bit stores per step), so that a program fits the 32 registers of full occupancy (26-32).
BLOCK_SIZE = 4096
NUM_WARPS = 8


@triton.jit
def _accumulate_kernel(
    dst_ptr,  # (n_elements,) fp32, read unless OVERWRITE, written
    src_ptr,  # (n_elements,) fp32 | bf16 | fp16, read
    scale_ptr,  # () fp32 | any float, read when SCALE_IS_PTR; otherwise unused
    scale,  # fp32 scalar, used when HAS_SCALE and not SCALE_IS_PTR
    n_elements,
    HAS_SCALE: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    OVERWRITE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64 before the multiply: buffers pass 2^31 elements
    if HAS_SCALE and SCALE_IS_PTR:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        s = scale
    # Two half-block steps, each loaded, combined and stored before the next: 8 values per thread live at 8
    # warps instead of 16 (the full block at once needs 34-40 registers when adding, over the 32 of full
    # occupancy). Addresses are a 64-bit base per program plus 32-bit offsets, and the mask a 32-bit compare.
    HALF: tl.constexpr = BLOCK_SIZE // 2
    start = pid * BLOCK_SIZE
    src_base = src_ptr + start
    dst_base = dst_ptr + start
    remaining = tl.minimum(n_elements - start, BLOCK_SIZE).to(tl.int32)
    for step in tl.static_range(2):
        offsets = step * HALF + tl.arange(0, HALF)
        mask = offsets < remaining
        grad = tl.load(src_base + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            if OVERWRITE:
                out = grad * s
            else:
                out = tl.fma(grad, s, tl.load(dst_base + offsets, mask=mask, other=0.0))
        else:
            if OVERWRITE:
                out = grad
            else:
                out = tl.load(dst_base + offsets, mask=mask, other=0.0) + grad
        tl.store(dst_base + offsets, out, mask=mask)


def accumulate_(
    dst: torch.Tensor,
    src: torch.Tensor,
    scale: float | torch.Tensor = 1.0,
    overwrite: bool = False,
    *,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """``dst = (0 if overwrite else dst) + float(src) * scale``, in place, in one pass; returns ``dst``.

    dst: any shape, fp32, contiguous, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``); treated as
        flat, accumulated (or, with ``overwrite``, written) in place.
    src: same numel and device as ``dst``, fp32 | bf16 | fp16, contiguous; read only.
    scale: a Python float (rounded to fp32, as torch does for an fp32 tensor times a Python scalar; ``1.0``
        compiles the multiply away) or a 0-d floating tensor on ``dst.device``, read inside the kernel through
        its pointer, so the host never waits for it.
    overwrite: write ``src * scale`` without reading ``dst`` (the first micro-batch of a window).
    block_size: elements per program, a power of two >= 16 (tests use small ones to get many programs).

    Raises ``ValueError`` for a wrong dtype, layout, numel, device or scale, before anything is written.
    """
    check_fp32_buffer(dst, "dst")
    check_float_input(src, "src")
    check_block_size(block_size)
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements but dst has {dst.numel()}; they must match")
    if src.device != dst.device:
        raise ValueError(f"src is on {src.device} but dst is on {dst.device}; they must match")
    scale_ptr, scale_value, has_scale, scale_is_ptr = scale_args(scale, dst)
    n_elements = dst.numel()
    if n_elements == 0:
        return dst
    grid = (triton.cdiv(n_elements, block_size),)
    with device_guard(dst):
        _accumulate_kernel[grid](
            dst,
            src,
            scale_ptr,
            scale_value,
            n_elements,
            HAS_SCALE=has_scale,
            SCALE_IS_PTR=scale_is_ptr,
            OVERWRITE=bool(overwrite),
            BLOCK_SIZE=block_size,
            num_warps=NUM_WARPS,
        )
    return dst
