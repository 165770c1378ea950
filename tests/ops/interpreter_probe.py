"""What the Triton interpreter (``TRITON_INTERPRET=1``, the CPU tensors of this suite) does unlike a GPU, measured.

``interpreter_fma_rounds_once``: whether ``tl.fma`` rounds once where the Triton kernels run here. Triton 3.8's interpreter (``TRITON_INTERPRET=1``, the CPU tensors of this suite) computes ``tl.fma(x, y, z)`` as
numpy's ``x * y + z``: two roundings; 3.9's rounds once, as a GPU's fma always does. The AdamW kernel's moments use
``tl.fma`` (as ``csrc/optim/adamw.h`` uses ``std::fma``), so its bits equal the CPU kernel's only where the fma is
one; the other kernels' tests compare with tolerances or use products that are exact.

``interpreter_scalar_loop_error``: why a kernel cannot loop to a runtime scalar argument here (``for start in
range(0, n, BLOCK)``, as the norm's finalize kernel and the bucket kernel's tail chunk do), or None where it can.
Triton 3.5's interpreter (with torch 2.9) passes the scalar as a one-element numpy array and takes its index with
``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"; NumPy 2.3
still converts it); Triton 3.8 squeezes the array first. A GPU compiles the loop and never meets it.

Each measured once per process.
"""

from __future__ import annotations

import functools

import numpy

import torch
import triton
import triton.language as tl


@triton.jit
def _fma_kernel(x_ptr, minus_one_ptr, out_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, tl.fma(x, x, tl.load(minus_one_ptr)))


@functools.cache
def interpreter_fma_rounds_once(device: str = "cpu") -> bool:
    """``fma(x, x, -1)`` for ``x = 1 + 2^-12``: ``2^-11 + 2^-24`` when rounded once; two roundings give ``2^-11``
    (``x * x = 1 + 2^-11 + 2^-24`` is a tie in fp32, rounded to even)."""
    x = torch.tensor([1.0 + 2.0**-12], dtype=torch.float32, device=device)
    minus_one = torch.tensor([-1.0], dtype=torch.float32, device=device)
    out = torch.zeros(1, dtype=torch.float32, device=device)
    _fma_kernel[(1,)](x, minus_one, out)
    return float(out.item()) == 2.0**-11 + 2.0**-24


@triton.jit
def _scalar_loop_kernel(out_ptr, n, BLOCK: tl.constexpr):
    count = 0
    for _start in range(0, n, BLOCK):
        count += 1
    tl.store(out_ptr, count)


@functools.cache
def interpreter_scalar_loop_error(device: str = "cpu") -> str | None:
    """None where a kernel loops ``range(0, n, BLOCK)`` over a runtime ``n`` (``n = 5``, ``BLOCK = 2``: 3
    iterations); else what went wrong, naming the Triton and NumPy versions."""
    out = torch.zeros(1, dtype=torch.int32, device=device)
    try:
        _scalar_loop_kernel[(1,)](out, 5, BLOCK=2)
    except Exception as exc:  # noqa: BLE001 - the interpreter wraps the cause in its own error type
        cause = exc.__cause__ or exc
        return (f"Triton {triton.__version__}'s interpreter cannot loop to a runtime scalar argument with NumPy "
                f"{numpy.__version__}: {type(cause).__name__}: {cause}")
    if int(out.item()) != 3:
        return f"Triton {triton.__version__}'s interpreter looped {int(out.item())} times for range(0, 5, 2), not 3"
    return None
