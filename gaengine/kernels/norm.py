"""Sum of squares and non-finite flag of a gradient buffer, in one read pass and a deterministic finalize.

Stage 1 (``_l2norm_sq_partial_kernel``): each program reduces ``BLOCK_SIZE * BLOCKS_PER_PROGRAM`` elements to
one fp32 partial sum of squares and one non-finite flag (1.0 if one of its elements is inf or NaN), written to
a ``(2, n_partials)`` fp32 scratch buffer. Each block is read in two half-block steps into one half-block
accumulator (8 fp32 per thread at 8 warps; 128-bit loads), and the flag keeps no per-element state: a chunk's
sum of squares is finite exactly when all its elements are finite and the sum did not overflow, so only a chunk
whose sum is inf or NaN is read a second time, to tell the two apart. That keeps stage 1 within the 32 registers
per thread of full occupancy on sm_80 / sm_90 (23-32; the full-width accumulator and flag vectors needed 48-59
at 16 blocks per program). Stage 2 (``_l2norm_sq_finalize_kernel``): one program reduces the partials in a
fixed order (a strided per-lane sum, then one ``tl.sum`` tree), so the same input gives the same bits on every
run: no atomics anywhere.

Bytes per element: 4 (fp32), 2 (bf16 | fp16) read (twice for a chunk whose sum of squares is inf or NaN); the
scratch is 8 B per ``BLOCK_SIZE * BLOCKS_PER_PROGRAM`` elements. Error against fp64: each square is fused into
its add (one rounding per term); the terms are summed by per-lane chains of at most ``2 * BLOCKS_PER_PROGRAM``
terms, then ``tl.sum`` trees; within ``tests/tolerances.py::sum_sq_rtol(n)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gaengine.kernels._utils import check_block_size, check_float_input, device_guard

__all__ = ["l2norm_sq", "BLOCK_SIZE"]

BLOCK_SIZE = 4096  # elements per loop step of a stage-1 program (16 per thread at 8 warps, read in two halves)
NUM_WARPS = 8
# Blocks reduced by one stage-1 program. Small buffers use one (every SM gets a program); large ones use
# sixteen, so a 4 G-element buffer leaves 64 Ki partials for the single-program finalize instead of 1 Mi.
LARGE_BLOCKS_PER_PROGRAM = 16
LARGE_NUMEL = 1 << 24
FINALIZE_BLOCK_SIZE = 1024
FINALIZE_NUM_WARPS = 4


@triton.jit
def _l2norm_sq_partial_kernel(
    x_ptr,  # (n_elements,) fp32 | bf16 | fp16, read
    partials_ptr,  # (2, n_partials) fp32, written: row 0 sums of squares, row 1 non-finite flags
    n_elements,
    n_partials,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64 before the multiply: buffers pass 2^31 elements
    # Within 32 registers (see the module docstring): half-block steps into a half-block accumulator, no flag
    # vector (a chunk is read again only when its sum is inf or NaN), a 64-bit base plus 32-bit offsets.
    HALF: tl.constexpr = BLOCK_SIZE // 2
    CHUNK: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_PROGRAM
    chunk_start = pid * CHUNK
    x_base = x_ptr + chunk_start
    remaining = tl.minimum(n_elements - chunk_start, CHUNK).to(tl.int32)
    sum_sq = tl.zeros([HALF], dtype=tl.float32)
    for block_start in range(0, CHUNK, BLOCK_SIZE):
        for step in tl.static_range(2):
            offsets = block_start + step * HALF + tl.arange(0, HALF)
            x = tl.load(x_base + offsets, mask=offsets < remaining, other=0.0).to(tl.float32)
            sum_sq = tl.fma(x, x, sum_sq)  # explicit: same rounding with or without fp fusion
    total = tl.sum(sum_sq, axis=0)
    found = tl.zeros([], dtype=tl.float32)
    if (total != total) | (total == float("inf")):  # an inf or NaN element, or an overflow of finite squares
        for block_start in range(0, CHUNK, BLOCK_SIZE):
            for step in tl.static_range(2):
                offsets = block_start + step * HALF + tl.arange(0, HALF)
                x = tl.load(x_base + offsets, mask=offsets < remaining, other=0.0).to(tl.float32)
                flags = ((x != x) | (tl.abs(x) == float("inf"))).to(tl.float32)
                found = tl.maximum(found, tl.max(flags, axis=0))
    tl.store(partials_ptr + pid, total)
    tl.store(partials_ptr + n_partials + pid, found)


@triton.jit
def _l2norm_sq_finalize_kernel(
    partials_ptr,  # (k, 2, n_partials) fp32, read: program t reduces table t
    out_ptr,  # (k, 2) fp32, written: [sum of squares, found_inf] of each table
    n_partials,
    BLOCK_SIZE: tl.constexpr,
):
    table = tl.program_id(0).to(tl.int64)
    partials_ptr += table * 2 * n_partials
    out_ptr += 2 * table
    offsets = tl.arange(0, BLOCK_SIZE)
    sum_sq = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    found_inf = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_SIZE):
        mask = start + offsets < n_partials
        sum_sq += tl.load(partials_ptr + start + offsets, mask=mask, other=0.0)
        found_inf = tl.maximum(found_inf, tl.load(partials_ptr + n_partials + start + offsets, mask=mask, other=0.0))
    tl.store(out_ptr, tl.sum(sum_sq, axis=0))
    tl.store(out_ptr + 1, tl.max(found_inf, axis=0))


def l2norm_sq(
    x: torch.Tensor,
    *,
    block_size: int = BLOCK_SIZE,
    blocks_per_program: int | None = None,
    finalize_block_size: int = FINALIZE_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of squares of ``x`` and whether it holds an inf or NaN, with no host sync.

    x: any shape, fp32 | bf16 | fp16, contiguous, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``);
        treated as flat, read only.
    block_size, blocks_per_program, finalize_block_size: the reduction shape (the block sizes powers of two
        >= 16; defaults: 4096, 1 below 2^24 elements else 16, 1024). The result is deterministic for a given input and shape;
        tests pass small ones to get many partials.

    Returns ``(sum_sq, found_inf)``: two 0-d fp32 tensors on ``x.device`` (views of one 2-element buffer).
    ``sum_sq`` is accumulated in fp32 (it overflows to inf past ~3.4e38 like torch's fp32 reductions);
    ``found_inf`` is 1.0 if an element of ``x`` is inf, -inf or NaN, else 0.0. Raises ``ValueError`` for a
    wrong dtype or layout, or a reduction shape of 2^31 elements or more per program.
    """
    check_float_input(x, "x")
    check_block_size(block_size)
    check_block_size(finalize_block_size, "finalize_block_size")
    n_elements = x.numel()
    if blocks_per_program is None:
        blocks_per_program = LARGE_BLOCKS_PER_PROGRAM if n_elements >= LARGE_NUMEL else 1
    if not isinstance(blocks_per_program, int) or blocks_per_program < 1:
        raise ValueError(f"blocks_per_program must be a positive int, got {blocks_per_program!r}")
    if block_size * blocks_per_program >= 1 << 31:  # the kernel addresses a program's chunk with 32-bit offsets
        raise ValueError(f"block_size * blocks_per_program must be below 2^31, got {block_size * blocks_per_program}")
    if n_elements == 0:
        out = torch.zeros(2, dtype=torch.float32, device=x.device)
        return out[0], out[1]
    out = torch.empty(2, dtype=torch.float32, device=x.device)  # both written by the finalize
    n_partials = triton.cdiv(n_elements, block_size * blocks_per_program)
    partials = torch.empty((2, n_partials), dtype=torch.float32, device=x.device)  # fully written by stage 1
    with device_guard(x):
        _l2norm_sq_partial_kernel[(n_partials,)](
            x,
            partials,
            n_elements,
            n_partials,
            BLOCK_SIZE=block_size,
            BLOCKS_PER_PROGRAM=blocks_per_program,
            num_warps=NUM_WARPS,
        )
        _l2norm_sq_finalize_kernel[(1,)](
            partials,
            out,
            n_partials,
            BLOCK_SIZE=finalize_block_size,
            num_warps=FINALIZE_NUM_WARPS,
        )
    return out[0], out[1]
