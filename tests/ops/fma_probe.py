"""Whether ``tl.fma`` rounds once where the Triton kernels run here (``interpreter_fma_rounds_once``).

Triton 3.8's interpreter (``TRITON_INTERPRET=1``, the CPU tensors of this suite) computes ``tl.fma(x, y, z)`` as
numpy's ``x * y + z``: two roundings; 3.9's rounds once, as a GPU's fma always does. The AdamW kernel's moments use
``tl.fma`` (as ``csrc/optim/adamw.h`` uses ``std::fma``), so its bits equal the CPU kernel's only where the fma is
one; the other kernels' tests compare with tolerances or use products that are exact. Measured once per process.
"""

from __future__ import annotations

import functools

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
