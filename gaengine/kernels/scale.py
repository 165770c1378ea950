"""Scale a gradient buffer in place by a device scalar: ``x *= coef`` (the clip coefficient, never read on the host).

Bytes per element: 8 (read 4, write 4). Numerics: one fp32 multiply per element, bitwise equal to
``x.mul_(coef)`` in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gaengine.kernels._utils import check_block_size, check_device_scalar, check_fp32_buffer, device_guard

__all__ = ["scale_", "BLOCK_SIZE"]

BLOCK_SIZE = 4096  # elements per program: 16 fp32 per thread at 8 warps
NUM_WARPS = 8


@triton.jit
def _scale_kernel(
    x_ptr,  # (n_elements,) fp32, read and written
    coef_ptr,  # () fp32 | any float, read
    n_elements,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64 before the multiply: buffers pass 2^31 elements
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    coef = tl.load(coef_ptr).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(x_ptr + offsets, x * coef, mask=mask)


def scale_(x: torch.Tensor, coef: torch.Tensor, *, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """``x *= coef`` in place; returns ``x``.

    x: any shape, fp32, contiguous, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``); treated as flat.
    coef: 0-d floating tensor on ``x.device`` (fp32 for results bitwise equal to torch), read inside the kernel
        through its pointer.
    block_size: elements per program, a power of two >= 16.

    Raises ``ValueError`` for a wrong dtype, layout or coef.
    """
    check_fp32_buffer(x, "x")
    check_device_scalar(coef, "coef", x.device)
    check_block_size(block_size)
    n_elements = x.numel()
    if n_elements == 0:
        return x
    with device_guard(x):
        _scale_kernel[(triton.cdiv(n_elements, block_size),)](
            x, coef, n_elements, BLOCK_SIZE=block_size, num_warps=NUM_WARPS
        )
    return x
