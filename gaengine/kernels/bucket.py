"""Accumulate a bucket of gradients into slices of one flat fp32 buffer with one kernel launch.

``dst[offset_i : offset_i + numel_i] = (0 if overwrite_i else dst[...]) + srcs[i] * scale`` for every source
``i`` of a bucket, in one launch per source dtype (one launch for a bucket of same-dtype gradients, the usual
case), instead of one launch per parameter. The launch reads two small tables (apex ``multi_tensor_apply``'s
chunk table, flattened):

* a tensor table, ``(n_tensors, 4)`` int64: ``[source address, dst offset, numel, overwrite]``, rebuilt each
  call (the gradients are new tensors every micro-batch) and copied to the device from pinned memory without
  a host sync;
* a block table, ``(n_blocks, 2)`` int32: ``[tensor index, chunk index]``, one row per ``BLOCK_SIZE`` chunk of
  every source, built on the host from the numels alone and cached per bucket shape.

Each program handles one chunk: a full chunk with unmasked accesses (128-bit vector loads and stores when the
pointers are 16-byte aligned, see ``DST_ALIGNED`` / ``SRC_ALIGNED``), the last chunk of a tensor masked.

"Free norm": given ``partials`` (``(2, n_blocks)`` fp32), each program also writes the sum of squares and the
non-finite flag of the values it wrote (after accumulation), so the last micro-batch's accumulate yields the
buffer's norm with no extra read of it; ``l2norm_sq_from_partials`` finishes it with the deterministic
finalize of ``gaengine/kernels/norm.py``. Given ``source_partials`` (the same format), each program also writes,
in the same pass, the sum of squares and the non-finite flag of the source values it read (the per-micro-batch
gradient norms of the noise scale), so measuring them costs no extra launch and no extra read.

Bytes per element, numerics: as ``gaengine/kernels/accumulate.py`` (6 B overwriting, 10 B adding, bf16 source;
an unscaled add is one IEEE fp32 add, bitwise equal to torch; a scaled one is one fused multiply-add), plus
8 B per ``BLOCK_SIZE`` elements of partials, plus 16 B per tensor and 8 B per block of tables.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from gaengine.kernels import norm
from gaengine.kernels._utils import (
    check_block_size,
    check_float_input,
    check_fp32_buffer,
    device_guard,
    scale_args,
)

__all__ = ["accumulate_bucket_", "l2norm_sq_from_partials", "num_blocks", "BLOCK_SIZE"]

BLOCK_SIZE = 2048  # elements per program: 8 per thread at 8 warps (4096 needs 33-40 registers, and spills)
NUM_WARPS = 8
TAIL_SIZE = 256  # elements per step over a tensor's last chunk: one per thread at 8 warps (masked, scalar)
TENSOR_TABLE_COLUMNS = 4  # source address, dst offset, numel, overwrite
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_BLOCK_TABLE_CACHE_SIZE = 64
_block_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()


@triton.jit
def _non_finite(x):
    """1.0 where x is NaN or +-inf, else 0.0 (fp32)."""
    return ((x != x) | (tl.abs(x) == float("inf"))).to(tl.float32)


@triton.jit
def _full_chunk(src_ptr, out_ptr, chunk_start, overwrite, s, HAS_SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One whole chunk of ``BLOCK_SIZE`` elements, unmasked: written, and its partials (sum of squares and
    non-finite flag of the values written, then of the sources). The partials are left out by the compiler when
    the caller's WRITE_ flags are off."""
    offsets = chunk_start + tl.arange(0, BLOCK_SIZE)
    keep = (tl.zeros([BLOCK_SIZE], dtype=tl.int64) + overwrite) == 0
    grad = tl.load(src_ptr + offsets).to(tl.float32)
    acc = tl.load(out_ptr + offsets, mask=keep, other=0.0)  # skipped when overwriting
    if HAS_SCALE:
        out = tl.where(keep, tl.fma(grad, s, acc), grad * s)
    else:
        out = tl.where(keep, acc + grad, grad)
    tl.store(out_ptr + offsets, out)
    return (tl.sum(out * out, axis=0), tl.max(_non_finite(out), axis=0),
            tl.sum(grad * grad, axis=0), tl.max(_non_finite(grad), axis=0))


@triton.jit
def _tail_chunk(src_ptr, out_ptr, chunk_start, numel, overwrite, s, HAS_SCALE: tl.constexpr,
                WRITE_PARTIALS: tl.constexpr, WRITE_SOURCE_PARTIALS: tl.constexpr, TAIL_SIZE: tl.constexpr):
    """The last, partial chunk of a tensor, ``TAIL_SIZE`` masked elements a step: written, and its partials (as
    ``_full_chunk``'s)."""
    sum_sq_lanes = tl.zeros([TAIL_SIZE], dtype=tl.float32)
    non_finite_lanes = tl.zeros([TAIL_SIZE], dtype=tl.float32)
    src_sum_sq_lanes = tl.zeros([TAIL_SIZE], dtype=tl.float32)
    src_non_finite_lanes = tl.zeros([TAIL_SIZE], dtype=tl.float32)
    for tail_start in range(0, numel - chunk_start, TAIL_SIZE):
        offsets = chunk_start + tail_start + tl.arange(0, TAIL_SIZE)
        mask = offsets < numel
        keep = (tl.zeros([TAIL_SIZE], dtype=tl.int64) + overwrite) == 0
        grad = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        acc = tl.load(out_ptr + offsets, mask=mask & keep, other=0.0)
        if HAS_SCALE:
            out = tl.where(keep, tl.fma(grad, s, acc), grad * s)
        else:
            out = tl.where(keep, acc + grad, grad)
        tl.store(out_ptr + offsets, out, mask=mask)
        if WRITE_PARTIALS:
            out = tl.where(mask, out, 0.0)  # lanes past the end add nothing to the partials
            sum_sq_lanes += out * out
            non_finite_lanes = tl.maximum(non_finite_lanes, _non_finite(out))
        if WRITE_SOURCE_PARTIALS:  # masked lanes loaded 0.0: they add nothing
            src_sum_sq_lanes += grad * grad
            src_non_finite_lanes = tl.maximum(src_non_finite_lanes, _non_finite(grad))
    return (tl.sum(sum_sq_lanes, axis=0), tl.max(non_finite_lanes, axis=0),
            tl.sum(src_sum_sq_lanes, axis=0), tl.max(src_non_finite_lanes, axis=0))


@triton.jit
def _accumulate_bucket_kernel(
    dst_ptr,  # (dst_numel,) fp32: slices read unless overwritten, written
    tensor_table_ptr,  # (n_tensors, 4) int64, read: source address, dst offset, numel, overwrite
    block_table_ptr,  # (n_blocks, 2) int32, read: tensor index, chunk index within the tensor
    scale_ptr,  # () any float, read when SCALE_IS_PTR; otherwise unused
    scale,  # fp32 scalar, used when HAS_SCALE and not SCALE_IS_PTR
    partials_ptr,  # (2, partials_stride) fp32, written when WRITE_PARTIALS: sums of squares, non-finite flags
    partials_stride,  # elements between the two rows of partials
    source_partials_ptr,  # (2, source_partials_stride) fp32, written when WRITE_SOURCE_PARTIALS: of the sources
    source_partials_stride,  # elements between the two rows of source_partials
    block_offset,  # global index of this launch's first block (one launch per source dtype)
    SRC_DTYPE: tl.constexpr,  # tl.float32 | tl.bfloat16 | tl.float16: the dtype of every source of this launch
    HAS_SCALE: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    WRITE_SOURCE_PARTIALS: tl.constexpr,
    DST_ALIGNED: tl.constexpr,  # dst is 16-byte aligned and every dst offset is a multiple of 4 elements
    SRC_ALIGNED: tl.constexpr,  # every source address is a multiple of 16 bytes
    BLOCK_SIZE: tl.constexpr,
    TAIL_SIZE: tl.constexpr,  # elements per step over the last, masked chunk of a tensor
):
    block = block_offset + tl.program_id(0).to(tl.int64)  # int64 before any multiply
    tensor = tl.load(block_table_ptr + 2 * block).to(tl.int64)
    chunk = tl.load(block_table_ptr + 2 * block + 1).to(tl.int64)
    row = tensor_table_ptr + 4 * tensor
    src_address = tl.load(row)
    dst_offset = tl.load(row + 1)
    numel = tl.load(row + 2)
    overwrite = tl.load(row + 3)
    src_ptr = src_address.to(tl.pointer_type(SRC_DTYPE))
    if SRC_ALIGNED:  # the cast from an integer drops what the host checked: every source is 16-byte aligned
        src_ptr = tl.multiple_of(src_ptr, 16)
    if DST_ALIGNED:  # dst is 16-byte aligned and every offset is a multiple of 4 fp32 (gaengine/buffer.py: 64)
        dst_offset = tl.multiple_of(dst_offset, 4)
    out_ptr = dst_ptr + dst_offset
    chunk_start = chunk * BLOCK_SIZE
    s = 1.0
    if HAS_SCALE:
        if SCALE_IS_PTR:
            s = tl.load(scale_ptr).to(tl.float32)
        else:
            s = scale
    if chunk_start + BLOCK_SIZE <= numel:  # a full chunk: no element mask, so 128-bit vector accesses
        sum_sq, non_finite, src_sum_sq, src_non_finite = _full_chunk(
            src_ptr, out_ptr, chunk_start, overwrite, s, HAS_SCALE, BLOCK_SIZE)
    else:  # the last chunk of a tensor: masked, TAIL_SIZE elements a step (a runtime trip count: not unrolled)
        sum_sq, non_finite, src_sum_sq, src_non_finite = _tail_chunk(
            src_ptr, out_ptr, chunk_start, numel, overwrite, s, HAS_SCALE, WRITE_PARTIALS, WRITE_SOURCE_PARTIALS,
            TAIL_SIZE)
    if WRITE_PARTIALS:
        tl.store(partials_ptr + block, sum_sq)
        tl.store(partials_ptr + partials_stride + block, non_finite)
    if WRITE_SOURCE_PARTIALS:
        tl.store(source_partials_ptr + block, src_sum_sq)
        tl.store(source_partials_ptr + source_partials_stride + block, src_non_finite)


def num_blocks(numels: Sequence[int], block_size: int = BLOCK_SIZE) -> int:
    """Programs (and partials columns) of one ``accumulate_bucket_`` call over sources of these numels."""
    return sum(triton.cdiv(int(n), block_size) for n in numels)


def _block_table(numels: tuple[int, ...], order: tuple[int, ...], block_size: int,
                 device: torch.device) -> torch.Tensor:
    """(n_blocks, 2) int32 on ``device``: [tensor index, chunk index] of every chunk, tensors in ``order``.

    Host-only integer work, cached per bucket shape (the same bucket is accumulated every micro-batch).
    """
    key = (numels, order, block_size, device)
    table = _block_tables.get(key)
    if table is not None:
        _block_tables.move_to_end(key)
        return table
    rows = [(i, c) for i in order for c in range(triton.cdiv(numels[i], block_size))]
    table = _to_device(torch.tensor(rows, dtype=torch.int32).reshape(-1, 2), device)
    _block_tables[key] = table
    if len(_block_tables) > _BLOCK_TABLE_CACHE_SIZE:
        _block_tables.popitem(last=False)
    return table


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host table to ``device`` without a host sync (pinned memory, ``non_blocking``)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _check_bucket_args(dst: torch.Tensor, srcs: list, dst_offsets: Sequence[int], overwrite,
                       block_size: int) -> tuple[list[int], list[bool], tuple[int, ...]]:
    """``accumulate_bucket_``'s checks of ``dst``, ``srcs``, ``dst_offsets``, ``overwrite`` and ``block_size``
    (``ValueError`` naming the argument); returns the offsets, the per-source overwrite flags and the numels."""
    check_fp32_buffer(dst, "dst")
    check_block_size(block_size)
    offsets = [int(o) for o in dst_offsets]
    if len(offsets) != len(srcs):
        raise ValueError(f"dst_offsets has {len(offsets)} entries but srcs has {len(srcs)}; they must match")
    flags = [bool(overwrite)] * len(srcs) if isinstance(overwrite, bool) else [bool(f) for f in overwrite]
    if len(flags) != len(srcs):
        raise ValueError(f"overwrite has {len(flags)} flags but srcs has {len(srcs)}; they must match")
    numels = tuple(s.numel() if isinstance(s, torch.Tensor) else -1 for s in srcs)
    for i, src in enumerate(srcs):
        check_float_input(src, f"srcs[{i}]")
        if src.device != dst.device:
            raise ValueError(f"srcs[{i}] is on {src.device} but dst is on {dst.device}; they must match")
        if offsets[i] < 0 or offsets[i] + numels[i] > dst.numel():
            raise ValueError(f"dst_offsets[{i}] = {offsets[i]} puts {numels[i]} elements outside dst "
                             f"({dst.numel()} elements)")
    spans = sorted((offsets[i], offsets[i] + numels[i], i) for i in range(len(srcs)) if numels[i])
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"the dst slices of srcs[{i}] and srcs[{j}] overlap")
    return offsets, flags, numels


def _check_partials(dst: torch.Tensor, partials, source_partials, total_blocks: int) -> None:
    """``ValueError`` unless each of ``partials`` / ``source_partials`` is None or a ``(2, total_blocks)`` fp32
    tensor on ``dst``'s device with unit column stride."""
    for name, table in (("partials", partials), ("source_partials", source_partials)):
        if table is not None and not (isinstance(table, torch.Tensor) and table.dtype == torch.float32
                                      and tuple(table.shape) == (2, total_blocks) and table.stride(1) == 1
                                      and table.device == dst.device):
            got = (f"a {tuple(table.shape)} {table.dtype} tensor on {table.device}"
                   if isinstance(table, torch.Tensor) else type(table).__name__)
            raise ValueError(f"{name} must be a (2, {total_blocks}) float32 tensor on {dst.device} with "
                             f"unit column stride, got {got}")


def _launch_tables(dst: torch.Tensor, srcs: list, offsets: list[int], flags: list[bool], numels: tuple[int, ...],
                   block_size: int) -> tuple[dict[torch.dtype, list[int]], torch.Tensor, torch.Tensor]:
    """The sources grouped by dtype (one launch each, in order of first appearance; within it, sources in the order
    given; empty sources left out), the block table over that order and the tensor table, on ``dst``'s device."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, src in enumerate(srcs):
        if numels[i]:
            groups.setdefault(src.dtype, []).append(i)
    order = tuple(i for members in groups.values() for i in members)
    block_table = _block_table(numels, order, block_size, dst.device)
    tensor_table = _to_device(
        torch.tensor([[s.data_ptr(), o, n, f] for s, o, n, f in zip(srcs, offsets, numels, flags)],
                     dtype=torch.int64).reshape(-1, TENSOR_TABLE_COLUMNS),
        dst.device,
    )
    return groups, block_table, tensor_table


def accumulate_bucket_(
    dst: torch.Tensor,
    srcs: Sequence[torch.Tensor],
    dst_offsets: Sequence[int],
    scale: float | torch.Tensor = 1.0,
    overwrite: bool | Sequence[bool] = False,
    *,
    partials: torch.Tensor | None = None,
    source_partials: torch.Tensor | None = None,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """``dst[o_i : o_i + n_i] = (0 if overwrite_i else dst[o_i : o_i + n_i]) + srcs[i] * scale`` for every ``i``.

    One kernel launch per source dtype (one for a bucket of same-dtype gradients); returns ``dst``.

    dst: any shape, fp32, contiguous, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``); treated as flat.
        Only the slices named by ``dst_offsets`` are read and written; the rest (padding) is untouched.
    srcs: contiguous fp32 | bf16 | fp16 tensors on ``dst.device``, any shapes, read only.
    dst_offsets: element offset of each source's slice in ``dst``; slices may not overlap or pass the end.
        Multiples of 4 with a 16-byte aligned ``dst`` (``gaengine/buffer.py`` starts every parameter at a
        multiple of ``ALIGN_NUMEL`` = 64) give 128-bit stores; other offsets work, with narrower accesses.
    scale: a Python float (``1.0`` compiles the multiply away) or a 0-d floating tensor on ``dst.device``,
        read inside the kernel.
    overwrite: one flag for all sources or one per source: write ``src * scale`` without reading ``dst``
        (the first micro-batch of a window).
    partials: None, or a ``(2, num_blocks(numels, block_size))`` fp32 tensor on ``dst.device`` whose rows may
        be strided (a column slice of a whole-buffer table): written with, per program, the sum of squares
        (row 0) and the non-finite flag (row 1, 1.0 or 0.0) of the values it wrote. Programs are numbered
        by source dtype in order of first appearance, then by source, then by chunk.
    source_partials: None, or a table of the same format as ``partials``: written in the same pass with the sum
        of squares and the non-finite flag of each program's source values (``float(src)``, before the add and any
        scale), not of the values written: the per-micro-batch gradient norms of the noise scale.
    block_size: elements per program, a power of two >= 16.

    Raises ``ValueError`` for a wrong dtype, layout, device, offset, overlap, flag count, scale or partials
    shape, before anything is written. No host sync: the tables are built from Python ints and copied
    from pinned memory.
    """
    srcs = list(srcs)
    offsets, flags, numels = _check_bucket_args(dst, srcs, dst_offsets, overwrite, block_size)
    scale_ptr, scale_value, has_scale, scale_is_ptr = scale_args(scale, dst)
    total_blocks = num_blocks(numels, block_size)
    _check_partials(dst, partials, source_partials, total_blocks)
    if total_blocks == 0:
        return dst

    groups, block_table, tensor_table = _launch_tables(dst, srcs, offsets, flags, numels, block_size)
    dst_aligned = dst.data_ptr() % 16 == 0 and all(o % 4 == 0 for o in offsets)
    partials_arg = partials if partials is not None else dst  # never written: WRITE_PARTIALS is False
    source_arg = source_partials if source_partials is not None else dst  # never written then
    block_offset = 0
    with device_guard(dst):
        for dtype, members in groups.items():
            group_blocks = num_blocks([numels[i] for i in members], block_size)
            _accumulate_bucket_kernel[(group_blocks,)](
                dst, tensor_table, block_table, scale_ptr, scale_value,
                partials_arg, partials.stride(0) if partials is not None else 0,
                source_arg, source_partials.stride(0) if source_partials is not None else 0, block_offset,
                SRC_DTYPE=_TL_DTYPES[dtype], HAS_SCALE=has_scale, SCALE_IS_PTR=scale_is_ptr,
                WRITE_PARTIALS=partials is not None, WRITE_SOURCE_PARTIALS=source_partials is not None,
                DST_ALIGNED=dst_aligned, SRC_ALIGNED=all(srcs[i].data_ptr() % 16 == 0 for i in members),
                BLOCK_SIZE=block_size, TAIL_SIZE=min(TAIL_SIZE, block_size), num_warps=NUM_WARPS,
            )
            block_offset += group_blocks
    return dst


def l2norm_sq_from_partials(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish a norm from the partials of ``accumulate_bucket_`` calls: ``(sum_sq, found_inf)``, no host sync.

    partials: ``(2, n)`` fp32, contiguous (row 0 sums of squares, row 1 non-finite flags), for example one
        table for the whole buffer whose column slices were passed to each bucket's call; or a contiguous stack
        ``(k, 2, n)`` of ``k`` such tables (one per micro-batch), finished in one launch; read only.

    Returns fp32 tensors on ``partials.device``, 0-d (``(k,)`` for a stack): the sum of row 0, reduced in a fixed
    order by the finalize kernel of ``gaengine/kernels/norm.py`` (the same bits every run), and 1.0 if a flag is
    set, else 0.0. Raises ``ValueError`` for a wrong dtype, shape or layout.
    """
    if not (isinstance(partials, torch.Tensor) and partials.dtype == torch.float32 and partials.dim() in (2, 3)
            and partials.shape[-2] == 2 and partials.is_contiguous()):
        got = (f"a {tuple(partials.shape)} {partials.dtype} tensor" if isinstance(partials, torch.Tensor)
               else type(partials).__name__)
        raise ValueError(f"partials must be a contiguous (2, n) or (k, 2, n) float32 tensor, got {got}")
    tables, n_partials = partials.shape[:-2], partials.shape[-1]
    if n_partials == 0 or partials.numel() == 0:
        out = torch.zeros(*tables, 2, dtype=torch.float32, device=partials.device)
        return out[..., 0], out[..., 1]
    out = torch.empty(*tables, 2, dtype=torch.float32, device=partials.device)  # all written by the finalize
    with device_guard(partials):
        norm._l2norm_sq_finalize_kernel[(max(1, partials.numel() // (2 * n_partials)),)](
            partials, out, n_partials, BLOCK_SIZE=norm.FINALIZE_BLOCK_SIZE, num_warps=norm.FINALIZE_NUM_WARPS
        )
    return out[..., 0], out[..., 1]
