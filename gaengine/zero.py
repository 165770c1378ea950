"""Sharded optimizer state (ZeRO-1) and sharded gradient sums (ZeRO-2) over the flat buffers.

Stages after Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (arXiv
1910.02054, P_os and P_os+g), with Megatron-Core's distributed optimizer's schedule (one reduce-scatter per window
in the last micro-batch, overlapped with backward; ``overlap_param_gather``), keeping gaengine's fp32 accumulation.

``GradientAccumulator(..., zero_stage=1 | 2)`` on a process group of d > 1 ranks. Everything is laid out by one
``ShardLayout``, built at construction and never re-learned from the arrival order (the shards, the masters and the
optimizer state live on it); built again when parameters join or leave between windows (gradual unfreezing:
``gaengine.sharding`` ``_Zero.adopt`` moves the masters and the optimizer state to their new ranges):

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
  No full-size ``main_grad`` exists (the engine's is layout only, on ``meta``): each bucket of a micro-batch is
  written (over, not added) into a staging buffer the hooks ``acquire`` right before its accumulate launch
  (``ShardReducer.acquire``: offsets relative to the bucket's start, the parameters no gradient reached zeroed),
  reduce-scattered in place as soon as it is complete (in ``reduce_dtype``), and the rank's reduced range is added
  into its fp32 shard (the first micro-batch of a window writes): fp32 accumulation, K reductions per window
  instead of one - it trades communication for memory. The staging buffers form a ring of ``STAGING_SLOTS``
  (S = 2) buffers of the largest bucket's length: acquiring one when none is free completes the reduce-scatter of
  the earliest launched bucket holding one (``work.wait()``; on CUDA a stream wait, no host sync), so
  ``main_grad`` costs 4/d B/param plus S x bucket (``gaengine bench --only memory`` measures it). When no bucket
  holding one has been launched yet (the first window, which learns the layout and reduces after backward, or
  buckets completing out of order) a buffer is added and dropped again once free. The reductions of micro-batch
  k overlap the rest of its backward and the next forward; the next ``acc.backward()`` completes them first.
* **Parameters** (``gaengine.store.ParameterStore``, which also holds them on one rank). Every trainable
  parameter (the same ``Parameter`` object, ``p.data`` re-pointed) becomes a view of one flat buffer per dtype
  laid out like its span of ``main_grad`` (``param_buffers[dtype]``, covering ``ShardLayout.dtype_spans[dtype]``):
  fp32 parameters too, so each tensor of ``model.state_dict()`` shares its dtype's buffer (``.clone()`` before
  ``torch.save`` of a few).
* **Masters and optimizer state.** For bf16/fp16 parameters with ``master_weights=True``: one fp32 buffer
  holding rank r's ranges of the bf16/fp16 buckets, laid out like its shard (``ParameterStore.master_buffer``,
  4/d B/param). The optimizer is
  re-pointed at one 1-D ``nn.Parameter`` per (parameter, rank) range that is not empty (``pieces``): a view of
  the master shard (bf16/fp16 with masters), or of the rank's range of the parameter buffer itself (fp32
  parameters; bf16/fp16 with ``master_weights=False``, updated in place). Each piece stays in its parameter's
  param group, so hyper-parameters are kept per group, and its state (8 B/param of AdamW moments, 12/d with the
  masters) exists on one rank only. Only elementwise optimizers (``gaengine.optimizers.is_elementwise``) run on
  these 1-D pieces (``EvenShards``). A parameter no rank used in the window gets no update (its pieces' ``.grad``
  is None), as with torch's optimizers.
* **Whole-matrix owners** (``owner_layout``, ``WholeOwners``): for any other optimizer (Muon, Adafactor,
  Shampoo, a class gaengine has no row for) or a list holding one, every parameter is placed so that one rank's
  range of its bucket holds it whole: that rank, its *owner* (chosen largest first onto the least loaded rank),
  receives its whole reduced gradient (the same reduce-scatter, the same stage-2 gradient shard), holds its whole
  fp32 master and the optimizer's piece shaped like it (2-D stays 2-D), and its optimizer steps on it once per
  window after the window's norm, clip and skip; the all-gather brings it to the others. Everything above holds
  unchanged; only the pieces' shapes and the placement differ. Parameters joining later are refused (laid out
  once).
* **Step.** Each rank takes the sum of squares and the non-finite flag of its gradient shard; one all-reduce of
  those two floats gives every rank the global norm and skip decision (no host read). The pieces are updated
  with normalization and clipping folded in (``grad_scale``/``found_inf`` for fused optimizers), the masters
  rounded into the rank's range of the parameter buffer (or written by ``FusedAdamW`` in its pass), then each
  bucket of the parameter buffers is all-gathered in place. ``overlap_param_gather=True`` leaves those gathers
  in flight: a forward pre-hook on every module that owns a parameter of a bucket waits for that bucket, so the
  gather overlaps the next forward (a parameter used in the forward of a module that does not own it must be
  owned by a module that runs earlier; ``acc.backward()``, ``step()`` and ``state_dict()`` wait for all, and at
  the latest the interpreter's exit, with or without ``acc.close()``).

A world of one accepts ``zero_stage`` and shards nothing (stage 0).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import increment_version

from gaengine.bucket import Bucket
from gaengine.buffer import ALIGN_NUMEL, FlatBuffer, FlatLayout
from gaengine.compat import all_gather_single, reduce_scatter_single
from gaengine.optimizers import is_elementwise
from gaengine.rank_layout import Mastered, ParamSlot, RankLayout, copy_all
from gaengine.reduce import BackwardStart, BucketReducer, Collective, Reduction, WindowStats, wait_for, wait_quietly
from gaengine.update import LOW_PRECISION

__all__ = ["STAGING_SLOTS", "ZERO_STAGES", "EvenShards", "ParamGather", "ParamShard", "ShardBucket", "ShardLayout",
           "ShardReducer", "ShardedReduction", "StagedReduction", "WholeOwners", "WholeParams", "check_zero_optimizer",
           "largest_first", "owner_layout", "pad_unit", "zero_order"]

ZERO_STAGES = (0, 1, 2)
STAGING_SLOTS = 2  # stage 2: bucket-sized fp32 staging buffers in the ring (``ShardReducer.acquire``)
_DTYPE_ORDER = (torch.bfloat16, torch.float16, torch.float32)


def pad_unit(world_size: int) -> int:
    """Elements every bucket's length is a multiple of: ``lcm(8 d, 128)``, a multiple of Megatron-Core's
    ``lcm(d, 128)`` that makes each of the d shards a multiple of 8 elements (16-byte aligned in bf16)."""
    return math.lcm(8 * world_size, 128)


def zero_order(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` (already in layout order, e.g. reverse registration order) grouped by dtype, bf16, fp16, fp32,
    keeping their order within a dtype (a stable sort)."""
    return sorted(params, key=lambda p: _DTYPE_ORDER.index(p.dtype))


def _grouped_dtypes(params: Sequence[torch.Tensor], world_size: int) -> tuple[torch.dtype, ...]:
    """The parameters' dtypes; ``ValueError`` for ``world_size < 1`` or parameters not grouped by dtype."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    dtypes = tuple(p.dtype for p in params)
    seen: list[torch.dtype] = []
    for dt in dtypes:
        if not seen or seen[-1] != dt:
            if dt in seen:
                raise ValueError("params must be grouped by dtype (gaengine.zero.zero_order)")
            seen.append(dt)
    return dtypes


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
    bucket: its bucket. shard_offset: where element ``lo`` lies in the rank's shard (the gradient shard at stage
    2; the store's master shard starts where the first low-precision dtype's span begins,
    ``ShardLayout.dtype_shard_span``).
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
        dtypes = _grouped_dtypes(params, world_size)
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


class _FlatParams(RankLayout):
    """The layouts over a ``ShardLayout`` (``gaengine.rank_layout.RankLayout``): the laid-out parameters become views of
    one flat buffer per dtype laid out like the dtype's span of the layout (``param_buffers[dtype]``, the same
    ``Parameter`` objects, ``p.data`` re-pointed: autograd keeps their AccumulateGrad nodes and the hooks on them;
    Megatron-Core's distributed optimizer re-points its parameters the same way; padding zero and staying zero), and
    the fp32 masters (``master_buffer``) hold this rank's range of every bucket of the mastered dtypes, laid out like
    the rank's shard. A subclass says which parameters are laid out (``_laid``) and how a piece is shaped
    (``_piece_shape``, ``_owns``, ``_own_piece``, ``_model_view``)."""

    rank = 0

    def _laid(self, params: Sequence[torch.Tensor], optimized: Sequence[bool],
              mastered: set[torch.dtype]) -> tuple[list[torch.Tensor], ShardLayout | None]:
        """The parameters laid out in flat buffers (layout order) and their ``ShardLayout`` (None: none)."""
        raise NotImplementedError(f"{type(self).__name__} must define _laid (which parameters are laid out; "
                                  "every _FlatParams layout does)")

    def _piece_shape(self, p: torch.Tensor, s: ParamShard) -> torch.Size:
        """The shape of the optimizer's piece of ``p``'s range ``s``."""
        raise NotImplementedError(f"{type(self).__name__} must define _piece_shape (the shape of a piece; "
                                  "every _FlatParams layout does)")

    def _owns(self, lo: int, hi: int) -> bool:
        """Whether an optimized parameter whose range here is ``[lo, hi)`` gets a piece on this rank."""
        raise NotImplementedError(f"{type(self).__name__} must define _owns (whether a range gets a piece here; "
                                  "every _FlatParams layout does)")

    def _own_piece(self, p: torch.Tensor, flat: torch.Tensor | None) -> torch.Tensor:
        """The piece of an optimized parameter without a master: ``flat`` is its range of the parameter buffer (None
        where it is not laid out)."""
        raise NotImplementedError(f"{type(self).__name__} must define _own_piece (a piece without a master; "
                                  "every _FlatParams layout does)")

    def _model_view(self, p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """The model tensor a master's rounding goes into, given ``p``'s range of the parameter buffer ``flat``."""
        raise NotImplementedError(f"{type(self).__name__} must define _model_view (where a master's rounding goes; "
                                  "every _FlatParams layout does)")

    def hold(self, params, optimized, mastered, device):
        laid, shards = self._laid(params, optimized, mastered)
        self.shards = shards
        ranges = {id(p): s for p, s in zip(laid, shards.param_shards(self.rank))} if shards is not None else {}
        position = {id(p): k for k, p in enumerate(laid)}
        self._lay_out_params(laid, device)
        self._copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (model ranges, master ranges)
        master_of = self._master_ranges(laid, ranges, mastered, device) if mastered else {}
        slots, entries = [], []
        for p, opt in zip(params, optimized):
            s = ranges.get(id(p))
            lo, hi = (s.lo, s.hi) if s is not None else (0, p.numel())
            flat = None
            if s is not None:
                o = shards.layout.offsets[position[id(p)]] - shards.dtype_spans[p.dtype][0]
                flat = self.param_buffers[p.dtype][o + lo:o + hi]
            master = opt and p.dtype in mastered  # whether or not this rank owns any of it
            piece = None
            if opt and self._owns(lo, hi):
                if master:  # aliases the master buffer
                    piece = nn.Parameter(master_of[id(p)], requires_grad=True)
                    entries.append(Mastered(p, piece, master_of[id(p)], self._model_view(p, flat)))
                else:
                    piece = self._own_piece(p, flat)
            slots.append(ParamSlot(p, lo, hi, s.shard_offset if s is not None else 0, piece, opt, master))
        self._low_params = [m.param for m in entries]
        return slots, entries

    def _lay_out_params(self, laid: list[torch.Tensor], device: torch.device) -> None:
        """The parameter buffers: the laid-out parameters re-pointed at views of one flat buffer per dtype."""
        self.param_buffers: dict[torch.dtype, torch.Tensor] = {}
        self._firsts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dtype's buffer, its first param): check_storage
        if self.shards is None:
            return
        offsets = self.shards.layout.offsets
        with torch.no_grad():
            for dtype, (lo, hi) in self.shards.dtype_spans.items():
                buf = torch.zeros(hi - lo, dtype=dtype, device=device)
                group = [(k, p) for k, p in enumerate(laid) if p.dtype == dtype]
                for k, p in group:
                    view = buf[offsets[k] - lo:offsets[k] - lo + p.numel()].view(p.shape)
                    view.copy_(p.detach())
                    p.data = view  # same Parameter, dtype and device: autograd and the hooks are kept
                self.param_buffers[dtype] = buf
                self._firsts.append((buf, group[0][1]))

    def _master_ranges(self, laid: list[torch.Tensor], ranges: dict, mastered: set,
                       device: torch.device) -> dict[int, torch.Tensor]:
        """The masters: the rank's range of each bucket of the mastered dtypes, laid out like the rank's shard,
        starting as the (exact) fp32 values of the parameters. Returns each master, keyed by ``id`` of its parameter
        (shaped like its piece)."""
        shards, rank = self.shards, self.rank
        spans = [shards.dtype_shard_span(dt) for dt in sorted(mastered, key=lambda dt: LOW_PRECISION.index(dt))]
        m_lo, m_hi = spans[0][0], spans[-1][1]  # bf16 then fp16: adjacent in the shard (zero_order)
        ranged = [(p, ranges[id(p)]) for p in laid
                  if p.dtype in mastered and self._owns(ranges[id(p)].lo, ranges[id(p)].hi)]
        flat = FlatLayout(tuple(s.shard_offset - m_lo for _, s in ranged), tuple(s.numel for _, s in ranged),
                          tuple(self._piece_shape(p, s) for p, s in ranged), m_hi - m_lo)
        self.master_buffer = FlatBuffer(flat, torch.float32, device)
        for b in shards.buckets:  # the rank's range of each bucket
            if b.dtype in mastered:
                r_lo, r_hi = b.rank_range(rank)
                span_lo = shards.dtype_spans[b.dtype][0]
                self._copies[0].append(self.param_buffers[b.dtype][r_lo - span_lo:r_hi - span_lo])
                self._copies[1].append(self.master_buffer.data[b.shard_offset - m_lo:
                                                               b.shard_offset - m_lo + b.shard_numel])
        copy_all(self._copies[1], self._copies[0])
        return {id(p): v for (p, _), v in zip(ranged, self.master_buffer.views)}

    def copy_masters(self, mastered):
        """One ``copy_`` per bucket range of the mastered dtypes (one multi-tensor copy for more than two), then the
        parameters' version counters bumped (``p.data = view`` gave each its own)."""
        copy_all(*self._copies)
        increment_version(self._low_params)

    def check_storage(self) -> None:
        """``RuntimeError`` when the re-pointed parameters no longer live in the flat parameter buffers (the model was
        moved or converted after the accumulator was built: ``model.to(other device or dtype)``, ``.float()``, ...).
        One parameter per dtype is looked at: ``Module._apply`` moves them all. Another storage of the same dtype
        and device (``p.data = x``) is not a move: ``gaengine.replaced`` puts it back or refuses it, naming the
        parameter."""
        for buf, first in self._firsts:
            if first.device != buf.device or first.dtype != buf.dtype:
                raise RuntimeError(
                    f"a {buf.dtype} model parameter of shape {tuple(first.shape)} is no longer a view of the "
                    f"accumulator's flat {buf.dtype} buffer (it is {first.dtype} on {first.device}): the model was "
                    "moved or converted after the GradientAccumulator was built (model.to(...), .float(), "
                    ".cuda(), ...). Move and convert the model first, then build the optimizer and the accumulator"
                )


class WholeParams(_FlatParams):
    """Every rank holds every parameter whole (replicated, and one rank): the one-shard case, d = 1. Only the
    parameters that need a flat buffer are laid out (the bf16/fp16 ones the optimizer holds, when they have masters:
    one flat master -> model copy per dtype, one bucket per dtype); the optimizer's pieces are shaped like their
    parameters (the fp32 master, or the parameter itself), so any torch optimizer works, state built before the
    accumulator follows its parameter, and the optimizer can be given back to the model."""

    holds_whole_grad = True  # replicated: the window's last micro-batch all-reduces the whole gradient

    def adopts_replaced(self) -> bool:
        """True: every parameter is held whole here, its piece shaped like it (``RankLayout.adopts_replaced``)."""
        return True

    def _laid(self, params, optimized, mastered):
        laid = zero_order([p for p, opt in zip(params, optimized) if opt and p.dtype in mastered])
        whole_mb = sum(p.numel() + ALIGN_NUMEL for p in laid) * 4 / 2**20 + 1  # one bucket per dtype
        return laid, ShardLayout.build(laid, whole_mb, 1) if laid else None

    def _piece_shape(self, p, s):
        return p.shape

    def _owns(self, lo, hi):
        return True

    def _own_piece(self, p, flat):
        return p  # an fp32 parameter, or bf16/fp16 without masters, updated as it is

    def _model_view(self, p, flat):
        return p


class EvenShards(_FlatParams):
    """ZeRO's even flat shards (module docstring): every trainable parameter laid out by ``shards`` (a ``ShardLayout``
    of d > 1 ranks, in the store's order), this ``rank`` owning its range of every bucket; the optimizer's pieces are
    1-D ``nn.Parameter``s, one per non-empty (parameter, rank) range: a view of the master shard, or of the rank's
    range of the parameter buffer itself (fp32, or bf16/fp16 without masters, updated in place)."""

    sharded = True
    adopts_params = True
    """Parameters joining or leaving between windows are laid out anew (``plan`` again, the state moved:
    ``gaengine.sharding`` ``_Zero.adopt``); False: the layout is made once, and a joining parameter is refused with
    ``fixed_layout``."""
    fixed_layout = ""  # why the layout is made once (the refusal's message), where it does not adopt

    def __init__(self, shards: ShardLayout, rank: int) -> None:
        self.shards, self.rank = shards, rank

    # What the ZeRO strategy asks a layout class before it builds one (``gaengine.sharding.register_zero_layout``).
    @classmethod
    def takes(cls, optimizer) -> bool:
        """Whether this layout runs ``optimizer`` (a torch optimizer or a ``gaengine.OptimizerList``): the
        elementwise ones only (``gaengine.optimizers.is_elementwise``), whose update runs on any flat range."""
        return optimizer is None or is_elementwise(optimizer)

    @classmethod
    def plan(cls, params: Sequence[torch.Tensor], bucket_size_mb: float,
             world_size: int) -> tuple[ShardLayout, list[torch.Tensor]]:
        """The ``ShardLayout`` of ``params`` (layout order, grouped by dtype: ``zero_order``) over ``world_size``
        ranks and the parameters in its order (``ShardLayout.build``: even flat ranges, ``params`` as given). The
        strategy then builds ``cls(layout, rank)``."""
        return ShardLayout.build(params, bucket_size_mb, world_size), list(params)

    def check_export(self) -> None:
        """``TypeError`` where ``gaengine.full_optimizer_state_dict`` cannot gather the optimizer's state by this
        layout's ranges (``ShardLayout.param_shards``); nothing here: the pieces are those ranges."""

    def _laid(self, params, optimized, mastered):
        return list(params), self.shards

    def _piece_shape(self, p, s):
        return torch.Size([s.numel])

    def _owns(self, lo, hi):
        return hi > lo

    def _own_piece(self, p, flat):
        return nn.Parameter(flat)  # updated in place

    def _model_view(self, p, flat):
        return flat

    def grad_views(self, main_grad, reducer):
        """The rank's shard: at stage 2 its fp32 gradient shard (``reducer.grad_shard``, one chunk, the per-parameter
        views its ranges); at stage 1 its ranges of ``main_grad``, one chunk per bucket."""
        shards = self.shards.param_shards(self.rank)
        grad_shard = reducer.grad_shard
        if grad_shard is not None:  # stage 2: no full-size main_grad exists
            views = [grad_shard[s.shard_offset:s.shard_offset + s.numel] for s in shards]
            return {"shard_grads": views, "chunks": [grad_shard], "grad_views": views}
        offsets = self.shards.layout.offsets
        return {"shard_grads": [main_grad.data[offsets[s.index] + s.lo:offsets[s.index] + s.hi] for s in shards],
                "chunks": [main_grad.data[slice(*b.rank_range(self.rank))] for b in self.shards.buckets]}

    def kept_in_groups(self, q):
        return None  # a frozen parameter the optimizer held has no range here

    def check_masters_to_model(self) -> None:
        raise RuntimeError("masters_to_model() on several ranks at zero_stage >= 1: each rank holds a shard of "
                           "the fp32 masters; the update gathers them into the model")

    def check_release(self) -> None:
        raise ValueError("close(release_optimizer=True) at zero_stage >= 1 on several ranks: the optimizer holds "
                         "1-D shards of the parameters; gather its state with "
                         "gaengine.full_optimizer_state_dict first, or close() without it")


def largest_first(sizes: Sequence[int], held: Sequence[int]) -> list[int]:
    """The owners of one bucket's parameters (``owner_layout``'s default ``place``): Graham's
    largest-processing-time-first rule (as Megatron-Core's and torchtitan's sharded Muon balance whole matrices), the
    parameters by size, largest first (ties by position), each onto the rank holding the fewest elements of the bucket
    so far (ties: the fewest of all buckets, ``held`` plus the bucket's, then the lowest rank). sizes: each parameter's
    elements in its segment (``ALIGN_NUMEL``-rounded), in layout order; held: per rank, the elements it holds of the
    earlier buckets. Returns each parameter's rank, in ``sizes``' order; deterministic."""
    world = len(held)
    load = [0] * world
    out = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        r = min(range(world), key=lambda r: (load[r], held[r] + load[r], r))
        out[j] = r
        load[r] += sizes[j]
    return out


def owner_layout(params: Sequence[torch.Tensor], bucket_size_mb: float, world_size: int,
                 place: Callable[[Sequence[int], Sequence[int]], list[int]] = largest_first,
                 ) -> tuple[ShardLayout, list[torch.Tensor], list[int]]:
    """The whole-matrix owners' ``ShardLayout`` (``WholeOwners``): a layout of ``params`` (layout order, grouped by
    dtype: ``zero_order``) in which each rank's range of every bucket holds whole parameters only, so that the
    reduce-scatter, the gradient shard (stage 2), the masters, the all-gathers and the checkpoint's ranges of
    ``EvenShards`` give each parameter whole to one rank, its owner, and nothing of it to the others.

    Buckets: within a dtype, parameters in layout order, a bucket closing once it holds at least ``bucket_size_mb``
    MiB of fp32 gradient and at least ``2 d`` times its dtype's largest parameter (so the greedy below can balance
    it). Owners: ``place(sizes, held)`` per bucket (``largest_first`` by default: Graham's rule; any deterministic
    rule gives every rank the same layout), given the bucket's parameters' ``ALIGN_NUMEL``-rounded sizes in layout
    order and the elements each rank holds of the earlier buckets, returning one rank per parameter (``ValueError``
    otherwise). Rank r's range of the bucket (its *segment*) holds its
    parameters in layout order, each starting on a multiple of ``ALIGN_NUMEL``; every segment has the length of the
    longest, rounded up to ``pad_unit(d) / d`` (the bucket then a multiple of ``pad_unit(d)``): padding is zero and
    stays zero, and by ``largest_first``'s bound (Graham 1969) a segment exceeds the bucket's mean by at most one
    parameter, so the masters and the gradient shard are 1/d of the whole up to that.

    Returns the layout, ``params`` in its order (within a bucket by owner, then layout order: the hooks' buckets
    are ranges of it) and each parameter's owner rank (in that order). ``ValueError`` for ``world_size < 1`` or
    parameters not grouped by dtype."""
    dtypes = _grouped_dtypes(params, world_size)
    cap = max(1, int(bucket_size_mb * 2**20) // 4)
    seg_unit = pad_unit(world_size) // world_size
    largest = {dt: max(p.numel() for p, d in zip(params, dtypes) if d == dt) for dt in set(dtypes)}
    groups: list[list[int]] = []  # each bucket's parameter indices (into params)
    size = 0
    for i, p in enumerate(params):
        if not groups or dtypes[groups[-1][0]] != p.dtype or size >= max(cap, 2 * world_size * largest[p.dtype]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += _round_up(p.numel(), ALIGN_NUMEL)
    total = [0] * world_size  # elements held per rank over every bucket
    order: list[torch.Tensor] = []
    owners: list[int] = []
    offsets: list[int] = []
    buckets: list[ShardBucket] = []
    spans: dict[torch.dtype, tuple[int, int]] = {}
    cursor = shard_cursor = 0
    for members in groups:
        sizes = [_round_up(params[i].numel(), ALIGN_NUMEL) for i in members]
        placed = place(sizes, list(total))
        if len(placed) != len(members) or not all(isinstance(r, int) and 0 <= r < world_size for r in placed):
            raise ValueError(f"place must return one rank in [0, {world_size}) per parameter of the bucket "
                             f"({len(members)}), got {placed!r}")
        owner_of = dict(zip(members, placed))
        load = [0] * world_size
        for r, n in zip(placed, sizes):
            load[r] += n
            total[r] += n
        seg = _round_up(max(max(load), 1), seg_unit)
        first = len(order)
        for r in range(world_size):
            at = cursor + r * seg
            for i in members:
                if owner_of[i] == r:
                    order.append(params[i])
                    owners.append(r)
                    offsets.append(at)
                    at += _round_up(params[i].numel(), ALIGN_NUMEL)
        dtype = dtypes[members[0]]
        buckets.append(ShardBucket(len(buckets), first, len(order), cursor, cursor + world_size * seg, dtype, seg,
                                   shard_cursor))
        lo, _ = spans.get(dtype, (cursor, cursor))
        spans[dtype] = (lo, cursor + world_size * seg)
        cursor += world_size * seg
        shard_cursor += seg
    layout = FlatLayout(tuple(offsets), tuple(p.numel() for p in order), tuple(p.shape for p in order), cursor)
    return (ShardLayout(world_size, layout, tuple(buckets), tuple(p.dtype for p in order), spans, shard_cursor),
            order, owners)


class WholeOwners(EvenShards):
    """Whole-matrix owners (``owner_layout``): every parameter held whole by one rank, its owner, for the optimizers
    whose update needs the whole parameter (Muon's Newton–Schulz, Adafactor's row and column factors, Shampoo's
    preconditioners, any optimizer ``gaengine.optimizers`` has no elementwise row for). ``EvenShards`` over an owner
    layout (its reduce-scatter, gradient shard, masters, all-gathers and checkpoint ranges unchanged): only the
    pieces differ, each shaped like its parameter (a 2-D matrix stays 2-D), and so do the gradients the optimizer
    reads; a rank's optimizer holds its owned parameters only. Which rank owns which parameter is ``place`` (a
    subclass with another rule is another layout: ``gaengine.sharding.register_zero_layout``)."""

    adopts_params = False
    fixed_layout = ("lays its parameters out once, at construction: each whole on one owner rank for the optimizer "
                    "that is not elementwise (a list of elementwise optimizers adopts it at zero_stage 1 and 2)")
    place = staticmethod(largest_first)  # owner_layout's placement rule: (sizes, held) -> one rank per parameter

    @classmethod
    def takes(cls, optimizer) -> bool:
        """Any optimizer: each parameter is whole on its owner (``gaengine.sharding`` asks the elementwise
        ``EvenShards`` first)."""
        return True

    @classmethod
    def plan(cls, params, bucket_size_mb, world_size):
        """``owner_layout`` with this class's ``place``: each parameter whole in one rank's range of its bucket."""
        layout, order, _ = owner_layout(params, bucket_size_mb, world_size, place=cls.place)
        return layout, order

    def check_export(self) -> None:
        raise TypeError("gaengine.full_optimizer_state_dict gathers an elementwise optimizer's moments by ranges; at "
                        "zero_stage >= 1 on several ranks this optimizer's state is held whole by each parameter's "
                        "owner rank (whole-matrix owners): save it with acc.state_dict() through "
                        "torch.distributed.checkpoint, which loads at any world size")

    def _piece_shape(self, p, s):
        return p.shape

    def _own_piece(self, p, flat):
        return nn.Parameter(flat.view(p.shape))  # updated in place

    def _model_view(self, p, flat):
        return flat.view(p.shape)

    def grad_views(self, main_grad, reducer):
        """``EvenShards``' views, each owned parameter's shaped like it (an empty 1-D view where another rank owns
        it)."""
        views = super().grad_views(main_grad, reducer)
        shapes = self.shards.layout.shapes
        views["shard_grads"] = [g.view(shapes[i]) if g.numel() else g for i, g in enumerate(views["shard_grads"])]
        return views

    def check_masters_to_model(self) -> None:
        raise RuntimeError("masters_to_model() on several ranks at zero_stage >= 1: each rank holds the fp32 masters "
                           "of the parameters it owns; the update gathers them into the model")

    def check_release(self) -> None:
        raise ValueError("close(release_optimizer=True) at zero_stage >= 1 on several ranks: each rank's optimizer "
                         "holds only the parameters it owns (whole-matrix owners); close() without it")


def _reduce_scatter(output: torch.Tensor, inp: torch.Tensor, group) -> Collective:
    return Collective(reduce_scatter_single(), output, inp, op=dist.ReduceOp.SUM, group=group)


def _all_gather(output: torch.Tensor, inp: torch.Tensor, group) -> Collective:
    return Collective(all_gather_single(), output, inp, group=group)


def _finish_in_flight(pending: dict[int, Collective], reducer: BucketReducer) -> None:
    """Wait (errors ignored) for the all-gathers in ``pending`` and the reductions of ``reducer`` still in flight:
    ``ParamGather.close()``, and the last chance (``weakref.finalize``) when the state is collected or the
    interpreter exits with it alive (a script that ends without ``acc.close()``, ``overlap_param_gather``'s
    gathers in flight). It must not refer to the state itself."""
    for work in pending.values():
        wait_quietly(work)
    pending.clear()
    reducer.drain()


class ShardReducer(BucketReducer):
    """The reduce-scatter of ``main_grad``'s buckets: ``gaengine.reduce.BucketReducer`` (the same launch order,
    readiness and waits) with rank ``rank``'s range of each bucket receiving the sum.

    data: ``(layout.total_numel,)`` fp32 main_grad (stage 1: the window's sums; stage 2: one micro-batch's
    gradients, a staging buffer). shard: the ``ShardLayout``. reduce_dtype: fp32, or bf16/fp16 on the wire (the
    bucket is rounded once, reduce-scattered in place in that dtype, and the rank's range written back in fp32).
    grad_shard: stage 2's ``(shard_numel,)`` fp32 gradient shard, into which ``wait()`` adds (or, for a bucket
    launched with ``overwrite``, writes) the rank's reduced range; None at stage 1, where the reduced range stays
    in ``data`` (in place).
    """

    collective = "reduce-scatter"

    def __init__(self, data: torch.Tensor, shard: ShardLayout, rank: int, reduce_dtype: torch.dtype, group,
                 grad_shard: torch.Tensor | None = None, staging_slots: int = 0) -> None:
        super().__init__(data, shard.layout, 0.0, reduce_dtype, group, buckets=shard.hook_buckets())
        self.shard = shard
        self.rank = rank
        self.grad_shard = grad_shard
        self.overwrite = True  # stage 2: the launches of the window's first micro-batch write the shard
        self._overwrite_of: list[bool] = [True] * len(self.buckets)
        # Stage 2's staging ring (``acquire``): bucket-sized fp32 buffers, free or lent to one bucket each.
        self.staging_slots = min(int(staging_slots), len(self.buckets)) if grad_shard is not None else 0
        self._slot_numel = max((b.end - b.start for b in self.buckets), default=0)
        self._free: list[torch.Tensor] = [torch.zeros(self._slot_numel, dtype=torch.float32, device=grad_shard.device)
                                          for _ in range(self.staging_slots)]
        self._lent: dict[int, torch.Tensor] = {}  # bucket index -> its buffer, in the order lent
        self._staging: list[torch.Tensor | None] = [None] * len(self.buckets)  # bucket index -> its staging view
        self._padding: list[torch.Tensor | None] = []  # per bucket: its padding elements (relative), or None
        if self.staging_slots:
            layout = shard.layout
            for b in self.buckets:
                covered = torch.zeros(b.end - b.start, dtype=torch.bool)
                for i in range(b.first, b.last):
                    o = layout.offsets[i] - b.start
                    covered[o:o + layout.numels[i]] = True
                gaps = (~covered).nonzero().flatten()
                self._padding.append(gaps.to(grad_shard.device) if gaps.numel() else None)

    @property
    def staging_buffers(self) -> list[torch.Tensor]:
        """Stage 2's staging buffers allocated now (free or lent), for tests and the memory bench."""
        return self._free + list(self._lent.values())

    def acquire(self, b: int) -> torch.Tensor:
        """Stage 2: a ``(end - start,)`` fp32 staging buffer for bucket ``b``'s micro-batch gradients (the hooks
        call it once per bucket and micro-batch, right before its first accumulate launch; its padding is zeroed,
        its parameters' slices hold stale values the launch writes over). A free buffer of the ring if there is
        one; else the reduce-scatter of the earliest launched bucket holding one is completed first (``work.wait()``:
        on CUDA the current stream waits, the host does not); when no bucket holding one has been launched yet (the
        first window, reduced after backward, or buckets completing out of order) a buffer is added, and dropped
        again once free, so the ring holds ``staging_slots`` buffers between micro-batches."""
        view = self._staging[b]
        if view is not None:
            return view
        if not self._free:
            launched = [c for c in self._lent if self.buckets[c].work is not None]
            if launched:
                self._complete(self.buckets[min(launched)])  # buckets launch in index order: the earliest
            else:
                self._free.append(torch.empty(self._slot_numel, dtype=torch.float32, device=self.grad_shard.device))
        buf = self._free.pop()
        bucket = self.buckets[b]
        view = self._staging[b] = buf[:bucket.end - bucket.start]
        self._lent[b] = buf
        if self._padding[b] is not None:
            view.index_fill_(0, self._padding[b], 0.0)
        return view

    def _release(self, b: int) -> None:
        """Bucket ``b``'s staging buffer back to the ring (dropped when the ring has its ``staging_slots``)."""
        buf = self._lent.pop(b, None)
        self._staging[b] = None
        if buf is not None and len(self._free) + len(self._lent) < self.staging_slots:
            self._free.append(buf)

    def _complete(self, b: Bucket) -> None:
        wait_for(b.work, f"{self.collective} of gradient bucket {b.index} ({b.end - b.start} elements)")
        self._finish(b)
        b.work = b.wire = None

    def drain(self) -> None:
        super().drain()
        self.release_staging()

    def release_staging(self) -> None:
        """Every staging buffer back to the ring: between micro-batches, after ``wait()`` or ``drain()`` (what a
        failed backward acquired and never launched)."""
        for c in list(self._lent):
            self._release(c)

    def begin(self) -> None:
        """Arm for a micro-batch that reduces (stage 1: the window's last; stage 2: every one). The previous
        micro-batch's reductions must be complete (``wait()``)."""
        if any(b.work is not None for b in self.buckets):
            raise RuntimeError("gaengine: a reduce-scatter of the previous micro-batch is still pending (a bug)")
        super().begin()

    def _rank_slice(self, b: Bucket) -> slice:
        n = self.shard.buckets[b.index].shard_numel
        return slice(self.rank * n, (self.rank + 1) * n)

    def _launch(self, b: Bucket) -> None:
        view = self._staging[b.index] if self.staging_slots else self.data[b.start:b.end]
        b.wire = view if self.reduce_dtype == torch.float32 else view.to(self.reduce_dtype)
        b.work = _reduce_scatter(b.wire[self._rank_slice(b)], b.wire, self.group)  # in place
        self._overwrite_of[b.index] = self.overwrite

    def _finish(self, b: Bucket) -> None:
        """The rank's reduced range back into ``data`` in fp32 (stage 1, when the wire is bf16/fp16), or into
        ``grad_shard`` (stage 2: written by the window's first micro-batch, added by the others)."""
        reduced = b.wire[self._rank_slice(b)]
        if self.grad_shard is not None:
            sb = self.shard.buckets[b.index]
            dst = self.grad_shard[sb.shard_offset:sb.shard_offset + sb.shard_numel]
            if self._overwrite_of[b.index]:
                dst.copy_(reduced)
            else:
                dst.add_(reduced)
            self._release(b.index)
        elif b.wire.dtype != self.data.dtype:
            self.data[b.start:b.end][self._rank_slice(b)].copy_(reduced)


def check_zero_optimizer(optimizer, zero_stage: int) -> None:
    """Raise ``ValueError`` naming ``zero_stage`` unless ``optimizer`` can be sharded: an optimizer (not None) with
    no state yet. Any optimizer whose ``step()`` needs no argument runs: an elementwise one
    (``gaengine.optimizers.is_elementwise``) on even flat ranges (``EvenShards``), any other on whole-matrix owners
    (``WholeOwners``). ``zero_stage=0``: any."""
    if not zero_stage:
        return
    if optimizer is None:
        raise ValueError(f"zero_stage={zero_stage} shards the optimizer state and needs an optimizer; with "
                         "optimizer=None (gradients left in .grad) use zero_stage=0")
    if any(optimizer.state.values()):
        raise ValueError(f"zero_stage={zero_stage} needs an optimizer with no state yet (its state is sharded over "
                         "the ranks when the accumulator is built); build the accumulator before the first update "
                         "and restore a checkpoint through acc.load_state_dict")


class ShardedReduction(Reduction):
    """``zero_stage=1``'s reduction (``gaengine.reduce.Reduction``): the window's last micro-batch reduce-scatters
    each bucket of ``main_grad`` as it completes (``ShardReducer``), so each rank holds its shard of the reduced
    gradient (``accumulation.chunks``: its range of each bucket) and the norm sums the ranks' shards."""

    def over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        """The norm's ``(2,)`` fp32 ``[sum_sq, found_inf]`` of this rank's shard summed over the group by one
        all-reduce of two values on the device, in place (no host read; ``gaengine.norm.window_norm``)."""
        wait_for(Collective(dist.all_reduce, sums, group=self.group), "all-reduce of the gradient norm")
        return sums


class StagedReduction(ShardedReduction):
    """``zero_stage=2``'s reduction: every micro-batch's buckets are staged in a ring, reduce-scattered and added
    into the rank's fp32 gradient shard (``ShardReducer`` with ``grad_shard`` and ``staging_slots``)."""

    reduces_every_micro_batch = True
    # A micro-batch's backward began (begin_backward) and has not launched all its buckets (end_backward, or the
    # window's stats): whether the reducer was armed for it; None: no such micro-batch (drain).
    _round: bool | None = None

    def begin_backward(self, first: bool, last: bool, overlap: bool) -> BackwardStart:
        """The previous micro-batch's reductions complete into the gradient shard (the staging buffers are about to
        be written again); every parameter's next write overwrites its staging slice, so the hooks' written flags
        restart: those of the micro-batches so far go back to the engine's window (``BackwardStart.used``)."""
        used = None if first else self.accumulation.written
        self.reducer.wait()
        self.reducer.release_staging()  # what a failed backward staged and never launched
        self.reducer.overwrite = first
        self.accumulation.restart_written()
        armed = overlap and not self.accumulation.learning  # every micro-batch reduces
        if armed:
            self.reducer.begin()
        self._round = armed
        return BackwardStart(armed, used)

    def end_backward(self, armed: bool, last: bool) -> bool:
        """Launch the buckets not launched yet (the hooks' ``end()`` staged every bucket, zeroing the slices no
        gradient reached)."""
        self._round = None
        if not armed:
            self.reducer.begin()
        self.reducer.flush()
        return last

    def end_partial_window(self, missing: int) -> None:
        """``step(force=True)`` on a window of k < K micro-batches: reduce-scatter ``missing`` (K - k) rounds of
        zeros, every bucket in order as a micro-batch would (added into the gradient shard: zeros when every rank's
        window is as short), so that every rank issues K rounds and then the stats all-reduce per window, whatever
        its count. A rank whose window holds more micro-batches is reduce-scattering them meanwhile: the
        collectives stay matched one to one, and the stats tell every rank that the counts differ. Then complete
        the last reductions."""
        reducer = self.reducer
        for _ in range(missing):
            reducer.wait()
            reducer.overwrite = False
            reducer.begin()
            for b in reducer.buckets:
                reducer.acquire(b.index).zero_()  # a bucket of the ring (the earliest launched one completes first)
                reducer.bucket_ready(b.index)  # launched at once: every bucket before it was
        reducer.wait()

    def complete_for_state(self) -> None:
        """The last micro-batch's reduce-scatters complete into the gradient shard."""
        self.reducer.wait()

    def launch_window_stats(self, window, extra: torch.Tensor | None) -> WindowStats:
        """``Reduction.launch_window_stats``: the buckets not launched yet go with the stats (a dropped last
        micro-batch's too), so no micro-batch is left for ``drain`` to complete."""
        self._round = None
        return super().launch_window_stats(window, extra)

    def drain(self) -> None:
        """Drop the window (``acc.zero_grad()``). A micro-batch whose backward failed after it began launches its
        buckets not launched yet first, as zeros and in order (on the other ranks that micro-batch's backward
        reduce-scatters every bucket: those are matched one to one, never met by this rank's next header; their
        window goes on and meets this rank's next header, ``gaengine.protocol``, raising there on every rank). Then
        every reduction in flight is waited for, errors ignored (a peer that failed too)."""
        if self._round is not None:
            armed, self._round = self._round, None
            reducer = self.reducer
            with contextlib.suppress(Exception):  # the window is dropped either way (a peer that failed too)
                if not armed:
                    reducer.begin()
                for b in reducer.buckets[reducer.next_to_launch:]:
                    reducer.acquire(b.index).zero_()
                    reducer.bucket_ready(b.index)  # launched at once, in order: every bucket before it was
        super().drain()

    def zero_unused(self, unwritten: list[int]) -> None:
        """Nothing to do: the staging zeroes the slices no gradient reached before every reduce-scatter."""


class ParamGather:
    """The all-gathers of the parameter buffers after each update (module docstring, **Step**).

    param_buffers: dtype -> the flat parameter buffer laid out like ``shard.dtype_spans[dtype]``
    (``gaengine.store.ParameterStore.param_buffers``). buckets: the ``ShardBucket``s to gather (those that hold an
    optimized parameter), in bucket order. params: the parameters in layout order (their version counters are
    bumped by each gather). reducer: the gradient reducer, whose reductions in flight ``close`` also waits for.
    overlap: leave the gathers in flight after ``launch`` (``overlap_param_gather``): a forward pre-hook on every
    module of ``model`` that owns a parameter of a bucket waits for that bucket.

    pending: bucket index -> its gather in flight. gathers_issued: the count of the all-gathers issued (read by
    benchmarks/bench_ddp.py). exit_wait: the ``weakref.finalize`` that waits for everything in
    flight when the object is collected or the interpreter exits with it alive.
    """

    def __init__(self, param_buffers: dict[torch.dtype, torch.Tensor], shard: ShardLayout, buckets: list[ShardBucket],
                 params: list[torch.Tensor], rank: int, group, reducer: BucketReducer, overlap: bool,
                 model: torch.nn.Module | None) -> None:
        self.param_buffers = param_buffers
        self.shard = shard
        self.buckets = buckets
        self.params = params
        self.rank = rank
        self.group = group
        self.reducer = reducer
        self.overlap = overlap
        self.gathers_issued = 0
        self.pending: dict[int, Collective] = {}
        self._handles = []
        # Nothing of this state may be in flight when the interpreter finalizes (a backend thread letting go of a
        # tensor then aborts the process, see gaengine.reduce.Collective): waited at exit, or when collected.
        self.exit_wait = weakref.finalize(self, _finish_in_flight, self.pending, reducer)
        if overlap and model is not None:
            index = {id(p): i for i, p in enumerate(params)}
            bucket_of = [b.index for b in shard.buckets for _ in range(b.first, b.last)]
            for module in model.modules():
                mine = sorted({bucket_of[index[id(q)]] for q in module.parameters(recurse=False) if id(q) in index})
                if mine:
                    self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(mine)))

    def _make_pre_hook(self, buckets: list[int]):
        def pre_hook(module, args):
            if self.pending:
                self.wait(buckets)
        return pre_hook

    def launch(self) -> None:
        """All-gather every bucket, in place in its parameter buffer, in bucket order; waited at once unless
        ``overlap`` (then by the forward pre-hooks or ``wait``). The parameters' version counters are bumped, as an
        in-place op would."""
        for b in self.buckets:
            span_lo = self.shard.dtype_spans[b.dtype][0]
            out = self.param_buffers[b.dtype][b.start - span_lo:b.end - span_lo]
            lo = self.rank * b.shard_numel
            self.pending[b.index] = _all_gather(out, out[lo:lo + b.shard_numel], self.group)
            self.gathers_issued += 1
        increment_version(self.params)
        if not self.overlap:
            self.wait()

    def wait(self, buckets: list[int] | None = None) -> None:
        """Wait for the all-gathers in flight (of ``buckets``, or all); on CUDA the stream waits."""
        for b in (list(self.pending) if buckets is None else buckets):
            work = self.pending.pop(b, None)
            if work is not None:
                wait_for(work, f"all-gather of parameter bucket {b}")

    def close(self) -> None:
        """Remove the forward pre-hooks, after waiting (errors ignored) for the gathers and the gradient
        reductions still in flight, so that no collective of this accumulator outlives it (a process group torn
        down under a pending gloo collective aborts the process). Without ``close()`` the same wait runs when
        the object is collected or, at the latest, when the interpreter exits (``exit_wait``)."""
        _finish_in_flight(self.pending, self.reducer)
        for h in self._handles:
            h.remove()
        self._handles = []
