"""Sharded optimizer state (ZeRO-1) and sharded gradient sums (ZeRO-2) over the flat buffers.

``GradientAccumulator(..., zero_stage=1 | 2)`` on a process group of d > 1 ranks. Everything is laid out by one
``ShardLayout``, built once at construction and never re-learned (the shards, the masters and the optimizer
state live on it):

* **Layout.** The trainable parameters in reverse registration order (the order backward usually produces their
  gradients), grouped by dtype (bf16, then fp16, then fp32: an all-gather moves one dtype). Within a dtype, cut
  into buckets of ``bucket_size_mb`` MiB of fp32 gradient at parameter boundaries; each parameter starts on a
  multiple of ``ALIGN_NUMEL`` (as ``gaengine.buffer.FlatLayout``), and each bucket's length is padded to a
  multiple of ``pad_unit(d) = lcm(8 d, 128)`` elements (Megatron-Core pads to lcm(d, 128); ours is a multiple
  of it, so each shard is a multiple of 8 elements: 16-byte aligned in bf16/fp16, 32 in fp32). Padding is zero
  and stays zero.
* **Shards.** Rank r owns, in every bucket b of length n_b, the contiguous range
  ``[b.start + r n_b / d, b.start + (r + 1) n_b / d)`` of the flat buffer. Its *shard* is the concatenation of
  those ranges over the buckets (``shard_numel`` elements, ``ShardBucket.shard_offset`` where bucket b's range
  starts in it). A range may cut a parameter in two: ``ParamShard`` gives, per parameter and rank, the
  (possibly empty) range ``[lo, hi)`` of the flattened parameter it owns and where that lies in the shard.
* **Stage 1.** ``main_grad`` is the whole fp32 buffer (4 B/param) and accumulates the window locally with no
  communication in micro-batches 0 .. K-2. In the last micro-batch each complete bucket is reduce-scattered (in
  place: rank r's range of the bucket receives the sum; ``reduce_dtype`` on the wire, written back to fp32)
  while backward goes on, exactly where stage 0 all-reduces. Rank r's gradient shard is its ranges of
  ``main_grad``. Bytes on the wire: a ring reduce-scatter plus an all-gather of the parameters move what one
  ring all-reduce moves (2 (d-1)/d n), fewer with bf16 parameters.
* **Stage 2.** The fp32 gradient sum itself is sharded: a ``(shard_numel,)`` fp32 buffer per rank (4/d B/param).
  Every micro-batch's backward writes its gradients into the flat ``main_grad`` (written over, not added: it is
  a staging buffer), each complete bucket is reduce-scattered in place as soon as it is complete (in
  ``reduce_dtype``), and the rank's reduced range is added into its fp32 shard (the first micro-batch of a
  window writes): fp32 accumulation, K reductions per window instead of one - it trades communication for
  memory. The reductions of micro-batch k overlap the rest of its backward and the next forward; the next
  ``acc.backward()`` waits for them before writing the staging buffer again. Staging: today the whole flat
  buffer (the C++ hot path writes one flat buffer), so stage 2 saves the window's fp32 sum only against a
  design where main_grad is also the accumulator; bounding the staging to the buckets in flight needs the hot
  path to write bucket by bucket into a small ring (see the README).
* **Parameters.** Every trainable parameter (the same ``Parameter`` object, ``p.data`` re-pointed as
  ``gaengine.update.MasterWeights`` does) becomes a view of one flat buffer per dtype laid out like its span of
  ``main_grad`` (``param_buffers[dtype]``, covering ``ShardLayout.dtype_spans[dtype]``).
* **Masters and optimizer state.** For bf16/fp16 parameters with ``master_weights=True``: one fp32 buffer per
  dtype holding rank r's ranges of that dtype's buckets (``master_shards[dtype]``, 4/d B/param). The optimizer is
  re-pointed at one 1-D ``nn.Parameter`` per (parameter, rank) range that is not empty (``pieces``): a view of
  the master shard (bf16/fp16 with masters), or of the rank's range of the parameter buffer itself (fp32
  parameters; bf16/fp16 with ``master_weights=False``, updated in place). Each piece stays in its parameter's
  param group, so hyper-parameters are kept per group, and its state (8 B/param of AdamW moments, 12/d with the
  masters) exists on one rank only. Only elementwise optimizers can run on pieces: ``torch.optim.Adam``,
  ``AdamW``, ``SGD`` (fused or not) and ``gaengine.optim.FusedAdamW``; anything else raises ``ValueError``
  naming ``zero_stage``. A parameter no rank used in the window gets no update (its pieces' ``.grad`` is None),
  as with torch's optimizers.
* **Step.** Each rank takes the sum of squares and the non-finite flag of its gradient shard; one all-reduce of
  those two floats gives every rank the global norm and skip decision (no host read). The pieces are updated
  with normalization and clipping folded in (``grad_scale``/``found_inf`` for fused optimizers), the masters
  rounded into the rank's range of the parameter buffer (or written by ``FusedAdamW`` in its pass), then each
  bucket of the parameter buffers is all-gathered in place. ``overlap_param_gather=True`` leaves those gathers
  in flight: a forward pre-hook on every module that owns a parameter of a bucket waits for that bucket, so the
  gather overlaps the next forward (a parameter used in the forward of a module that does not own it must be
  owned by a module that runs earlier; ``acc.backward()``, ``step()`` and ``state_dict()`` wait for all).

A world of one accepts ``zero_stage`` and shards nothing (stage 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gaengine.bucket import Bucket
from gaengine.buffer import ALIGN_NUMEL, FlatLayout

__all__ = ["ZERO_STAGES", "ParamShard", "ShardBucket", "ShardLayout", "pad_unit", "zero_order"]

ZERO_STAGES = (0, 1, 2)
_DTYPE_ORDER = (torch.bfloat16, torch.float16, torch.float32)


def pad_unit(world_size: int) -> int:
    """Elements every bucket's length is a multiple of: ``lcm(8 d, 128)``, a multiple of Megatron-Core's
    ``lcm(d, 128)`` that makes each of the d shards a multiple of 8 elements (16-byte aligned in bf16)."""
    return math.lcm(8 * world_size, 128)


def zero_order(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` (already in layout order, e.g. reverse registration order) grouped by dtype, bf16, fp16, fp32,
    keeping their order within a dtype (a stable sort)."""
    return sorted(params, key=lambda p: _DTYPE_ORDER.index(p.dtype))


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class ShardBucket:
    """Bucket ``index``: parameters ``[first, last)`` of the layout over the flat range ``[start, end)`` (elements;
    ``end - start`` a multiple of ``pad_unit(d)``), all of ``dtype``. ``shard_numel = (end - start) / d``: each
    rank's part of it; ``shard_offset``: where that part starts in a rank's shard (the same on every rank)."""

    index: int
    first: int
    last: int
    start: int
    end: int
    dtype: torch.dtype
    shard_numel: int
    shard_offset: int

    def rank_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``[lo, hi)`` of ``main_grad`` (and of the layout) that ``rank`` owns in this bucket."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(frozen=True)
class ParamShard:
    """The part of parameter ``index`` (layout order) that one rank owns.

    lo, hi: the range ``[lo, hi)`` of the flattened parameter (0 <= lo <= hi <= numel; ``lo == hi``: nothing).
    bucket: its bucket. shard_offset: where element ``lo`` lies in the rank's shard (gradient shard at stage 2,
    master shard offsets are relative to the dtype's first bucket, see ``ShardLayout.master_offset``).
    """

    index: int
    bucket: int
    lo: int
    hi: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class ShardLayout:
    """The sharded layout of the flat buffers over ``world_size`` ranks (see the module docstring).

    layout: the padded ``FlatLayout`` of ``main_grad`` (offsets of the parameters in layout order; the buffer's
        length ``layout.total_numel`` is the sum of the padded buckets). buckets: ``ShardBucket``s tiling it.
    dtypes: per parameter. dtype_spans: dtype -> ``(start, end)``, the contiguous range of the flat buffer its
        buckets cover (the parameter buffer of that dtype is laid out like it). shard_numel: each rank's shard.
    """

    world_size: int
    layout: FlatLayout
    buckets: tuple[ShardBucket, ...]
    dtypes: tuple[torch.dtype, ...]
    dtype_spans: dict[torch.dtype, tuple[int, int]]
    shard_numel: int

    @classmethod
    def build(cls, params: Sequence[torch.Tensor], bucket_size_mb: float, world_size: int) -> ShardLayout:
        """Lay ``params`` (in layout order, grouped by dtype: ``zero_order``) out in buckets of at least
        ``bucket_size_mb`` MiB of fp32 gradient (the last of each dtype may be smaller), each padded to a multiple
        of ``pad_unit(world_size)``. Raises ``ValueError`` if the params are not grouped by dtype."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        dtypes = tuple(p.dtype for p in params)
        seen: list[torch.dtype] = []
        for dt in dtypes:
            if not seen or seen[-1] != dt:
                if dt in seen:
                    raise ValueError("params must be grouped by dtype (gaengine.zero.zero_order)")
                seen.append(dt)
        cap = max(1, int(bucket_size_mb * 2**20) // 4)
        unit = pad_unit(world_size)
        offsets: list[int] = []
        buckets: list[ShardBucket] = []
        spans: dict[torch.dtype, tuple[int, int]] = {}
        cursor = shard_cursor = 0
        first = 0
        local = 0  # next free element relative to the open bucket's start
        n = len(params)
        for i, p in enumerate(params):
            offsets.append(cursor + local)
            local = _round_up(local + p.numel(), ALIGN_NUMEL)
            closes = i == n - 1 or dtypes[i + 1] != dtypes[i] or local >= cap
            if closes:
                length = _round_up(local, unit)
                share = length // world_size
                buckets.append(ShardBucket(len(buckets), first, i + 1, cursor, cursor + length, dtypes[i], share,
                                           shard_cursor))
                lo, _ = spans.get(dtypes[i], (cursor, cursor))
                spans[dtypes[i]] = (lo, cursor + length)
                cursor += length
                shard_cursor += share
                first, local = i + 1, 0
        layout = FlatLayout(tuple(offsets), tuple(p.numel() for p in params), tuple(p.shape for p in params), cursor)
        return cls(world_size, layout, tuple(buckets), dtypes, spans, shard_cursor)

    def hook_buckets(self) -> list[Bucket]:
        """The buckets as ``gaengine.bucket.Bucket`` (what the hooks and the reducer count readiness over)."""
        return [Bucket(b.index, b.first, b.last, b.start, b.end) for b in self.buckets]

    def bucket_of(self, index: int) -> ShardBucket:
        for b in self.buckets:
            if b.first <= index < b.last:
                return b
        raise IndexError(f"parameter index {index} out of range ({len(self.dtypes)} parameters)")

    def param_shards(self, rank: int) -> list[ParamShard]:
        """Per parameter (layout order), the range ``rank`` owns (``lo == hi`` when none)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        out = []
        for b in self.buckets:
            r_lo, r_hi = b.rank_range(rank)
            for i in range(b.first, b.last):
                o, n = self.layout.offsets[i], self.layout.numels[i]
                lo, hi = max(o, r_lo), min(o + n, r_hi)
                if hi <= lo:
                    lo = hi = min(max(r_lo - o, 0), n)
                    out.append(ParamShard(i, b.index, lo, hi, b.shard_offset + max(o - r_lo, 0)))
                else:
                    out.append(ParamShard(i, b.index, lo - o, hi - o, b.shard_offset + lo - r_lo))
        return out

    def dtype_shard_span(self, dtype: torch.dtype) -> tuple[int, int]:
        """The range ``[lo, hi)`` of a rank's shard that ``dtype``'s buckets cover (the same on every rank)."""
        bs = [b for b in self.buckets if b.dtype == dtype]
        if not bs:
            return 0, 0
        return bs[0].shard_offset, bs[-1].shard_offset + bs[-1].shard_numel

    def master_offset(self, shard: ParamShard) -> int:
        """Where ``shard`` starts in its dtype's master shard (``master_shards[dtype]``, which holds the rank's
        part of that dtype's buckets only)."""
        return shard.shard_offset - self.dtype_shard_span(self.dtypes[shard.index])[0]
