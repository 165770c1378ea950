"""Buckets of the flat main_grad buffer, and the Python hooks' one accumulate launch per bucket per micro-batch.

A bucket is a contiguous range of the flat fp32 buffer, cut at parameter boundaries once ``bucket_size_mb``
MiB of fp32 gradient is reached, in the buffer's layout order (the order in which backward produces
gradients). The same buckets serve two stages: the all-reduce of the window's last micro-batch
(``gaengine.reduce.BucketReducer``, one collective per bucket) and the accumulation itself (one launch per
bucket: ``BucketAccumulation`` for the Python hooks, ``csrc/hot_path.cpp`` for the native ones).

``BucketAccumulation``: the hook hands each gradient over as autograd produces it; it is held (no copy)
until the hooks (``gaengine.python_hooks``, which count bucket readiness) find every parameter of its bucket
arrived in this micro-batch, then the whole bucket is accumulated into the flat fp32 buffer by one
``backend.accumulate_bucket_`` (any backend: torch, cpu, triton, cuda) and the held gradients are dropped. With
gradients arriving in layout order (the layout is re-learned from the first window), at most about one bucket
of low-precision gradients is held at a time. Parameters that get no gradient in a micro-batch leave their
bucket incomplete; ``flush()`` at the end of backward launches what is held. A parameter whose gradient
arrives again in the same micro-batch (reentrant checkpointing of a shared layer) is combined with what is
held for it (``combine_arrival``), never held as a second source on the same slice.

Free norm (single rank): in the window's last micro-batch each launch also writes the partial sums of squares
and non-finite flags of the values it wrote into its slice of one whole-buffer table on the buffer's device
(``backend.new_bucket_partials``: ``(P, 2)`` fp64 rows per parameter on torch / cpu, ``(2, n_chunks)`` fp32
columns per chunk on triton / cuda); when every bucket was complete, that table covers every parameter, so
``step()`` finishes the norm from it (``backend.finish_norm_partials``, a fixed-order reduction) and reads the
buffer zero extra times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gaengine.buffer import FlatBuffer, FlatLayout

__all__ = ["Bucket", "BucketAccumulation", "build_buckets", "combine_arrival", "window_source_sumsq"]


@dataclass
class Bucket:
    """Parameters ``[first, last)`` of the layout and the buffer range ``[start, end)`` (elements) they cover."""

    index: int
    first: int
    last: int
    start: int
    end: int
    ready: bool = False  # armed micro-batch: every parameter final (BucketReducer)
    work: object = None
    wire: torch.Tensor | None = None
    launched_at: float | None = field(default=None, repr=False)


def build_buckets(layout: FlatLayout, bucket_size_mb: float) -> list[Bucket]:
    """Cut ``layout`` into buckets of at least ``bucket_size_mb`` MiB of fp32 gradient (the last may be smaller).

    A bucket always ends at a parameter boundary (the padding after a parameter belongs to it), so every
    parameter is in exactly one bucket and the buckets tile ``[0, layout.total_numel)``.
    """
    cap_numel = max(1, int(bucket_size_mb * 2**20) // 4)
    n = len(layout.offsets)
    buckets, first = [], 0
    for i in range(n):
        end = layout.offsets[i + 1] if i + 1 < n else layout.total_numel
        if end - layout.offsets[first] >= cap_numel or i == n - 1:
            buckets.append(Bucket(len(buckets), first, i + 1, layout.offsets[first], end))
            first = i + 1
    return buckets


def combine_arrival(main_grad: torch.Tensor, offset: int, held: torch.Tensor, overwrite: bool,
                    grad: torch.Tensor) -> torch.Tensor:
    """The fp32 value one add per arrival would leave in a parameter's slice, as a source to write over it.

    main_grad: (n,) fp32, read at ``[offset, offset + held.numel())`` unless ``overwrite``. held: the earlier
    arrival of this micro-batch, fp32 | bf16 | fp16, not yet accumulated; overwrite: whether it was to be
    written over the slice (the window's first write) or added to it. grad: the later arrival, same numel.
    Returns a new (numel,) fp32 tensor: ``float(held) + grad`` or ``(slice + held) + grad``, each one IEEE fp32
    add, bitwise what accumulating the two arrivals one after the other gives (``csrc/hot_path.cpp`` does the
    same for the native hooks).
    """
    earlier = held.reshape(-1)
    if overwrite:
        total = earlier.to(torch.float32, copy=True)
    else:
        total = main_grad[offset:offset + earlier.numel()] + earlier
    return total.add_(grad.reshape(-1))


def window_source_sumsq(backend, tables: list[torch.Tensor], inexact: list[bool],
                        device: torch.device | str | None = None,
                        extras: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """The window's per-micro-batch source norms from the source partials of its accumulate launches.

    backend: the ``gaengine.backends.Backend`` that wrote them. tables: one whole-buffer source partials table per
    micro-batch (``backend.new_bucket_partials`` of every parameter, each bucket launch having written its slice),
    in micro-batch order. inexact: per micro-batch, whether its norm is inexact (a later arrival launched on its own
    after its bucket had launched). device: where to put an empty result (no micro-batch); else the tables'.
    extras: None, or per micro-batch None or a 0-d fp32 tensor to add to its row (sources measured apart).

    Returns ``(k,)`` fp32: row j = the sum of squares of every source of micro-batch j (inf or NaN when a source
    held an inf or a NaN), NaN where ``inexact[j]``. One stack and one ``backend.finish_norm_partials`` of the
    ``k`` tables: no host sync (an inexact row costs one small host-to-device copy of the row indices).
    """
    if not tables:
        return torch.zeros(0, dtype=torch.float32, device=device if device is not None else "cpu")
    sums, _ = backend.finish_norm_partials(torch.stack(tables))
    if extras is not None and any(e is not None for e in extras):
        zero = sums.new_zeros(())
        sums = sums + torch.stack([zero if e is None else e.to(sums.dtype) for e in extras])
    if any(inexact):
        rows = torch.tensor([j for j, bad in enumerate(inexact) if bad], dtype=torch.long, device=sums.device)
        sums = sums.index_fill(0, rows, float("nan"))
    return sums


class BucketAccumulation:
    """Held gradients and launches for the buckets of one flat buffer (see the module docstring).

    main_grad: the flat fp32 buffer. buckets: its layout's buckets. backend: a ``gaengine.backends.Backend``; every
    launch is one ``backend.accumulate_bucket_``, the free norm is one ``backend.new_bucket_partials`` table over
    the whole buffer (each complete bucket's launch writes its slice along ``backend.partials_dim``), finished by
    ``backend.finish_norm_partials``. measure_sources: every micro-batch also gets a whole-buffer table of source
    partials (``accumulate_bucket_``'s ``source_partials``, written by the same launches), kept until
    ``clear_sources()`` (``source_tables()``, finished by ``window_source_sumsq``).

    acquire: None (every bucket is written into ``main_grad`` at its laid-out offsets), or a callable ``acquire(b)
    -> (end - start,)`` fp32 tensor on ``device``: bucket b's destination for this micro-batch, called once per
    bucket and micro-batch right before its first launch, offsets relative to the bucket's start (ZeRO stage 2's
    staging ring, ``gaengine.zero.ShardReducer.acquire``; the destination's padding must be zero). The launches
    then write every parameter's first arrival over its slice (the caller marks nothing written between
    micro-batches); the parameters of the bucket that had no gradient before its first launch are zeroed, and
    ``flush()`` acquires the buckets no gradient reached too and zeroes them. device: where the partials tables
    live (default: ``main_grad``'s device; ``main_grad`` may then be a layout-only buffer on ``meta``).

    Source norms and later arrivals: arrivals combined before their bucket launches are one source. When the window
    had already written the parameter, the combined value held is ``(slice + g1) + g2`` (``combine_arrival``, the
    bits of one add per arrival), not the source ``g1 + g2``: while measuring, that source is also summed apart
    (one fp32 add per later arrival), its bucket is launched in two parts (the parameters so combined last, without
    source partials) and its norm is one ``l2norm_sq`` added to the micro-batch's row: extra work only for
    parameters that get several gradients in one backward (a layer shared by reentrant-checkpointed segments).
    """

    def __init__(self, main_grad: FlatBuffer, buckets: list[Bucket], backend, measure_sources: bool = False,
                 acquire=None, device: torch.device | None = None) -> None:
        self.backend = backend
        self.data = main_grad.data
        self.layout = main_grad.layout
        self.acquire = acquire
        self.device = self.data.device if device is None else torch.device(device)
        self.buckets = buckets
        self.measure_sources = bool(measure_sources)
        self.bucket_of = [b.index for b in buckets for _ in range(b.first, b.last)]
        self._sizes = [b.last - b.first for b in buckets]
        self._numels = [int(n) for n in self.layout.numels]
        self._partials_dim = backend.partials_dim
        # Each bucket's extent in a whole-buffer partials table, and that table's format (host-only, on meta).
        self._extents = [self._extent(self._numels[b.first:b.last]) for b in buckets]
        table = backend.new_bucket_partials(self._numels, "meta")
        self._table_shape, self._table_dtype = tuple(table.shape), table.dtype
        self.launches = 0  # kernel-launching calls, for tests and benchmarks
        self._source_tables: list[torch.Tensor] = []  # one per micro-batch of the window (measure_sources)
        self._inexact: list[bool] = []  # per micro-batch: a solo late arrival left its source norm inexact
        self._extras: list[torch.Tensor | None] = []  # per micro-batch: norms of sources measured apart
        self._start(want_norm=False, sources=False)

    def _extent(self, numels: list[int]) -> int:
        """Rows or columns (``backend.partials_dim``) of the partials of one launch over sources of these numels."""
        return self.backend.new_bucket_partials(numels, "meta").shape[self._partials_dim]

    def _new_table(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A whole-buffer partials table (uninitialized; ``backend.new_bucket_partials`` of every parameter, its
        format computed once) and its slice for each bucket."""
        table = torch.empty(self._table_shape, dtype=self._table_dtype, device=self.device)
        return table, list(table.split(self._extents, self._partials_dim))

    def _start(self, want_norm: bool, sources: bool) -> None:
        self._held: list[dict[int, tuple[torch.Tensor, bool]]] = [{} for _ in self.buckets]
        self._summed: list[dict[int, torch.Tensor]] = [{} for _ in self.buckets]  # sources held apart (see above)
        self._launched = [False] * len(self.buckets)  # in this micro-batch
        self._dest: list[torch.Tensor | None] = [None] * len(self.buckets)  # acquire: each bucket's destination
        self._partials, self._partial_views = self._new_table() if want_norm else (None, None)
        self._source_views = None
        if sources:
            table, self._source_views = self._new_table()
            self._source_tables.append(table)
            self._inexact.append(False)
            self._extras.append(None)
        self._complete_launches = 0  # buckets launched whole in this micro-batch
        self._norm_complete = want_norm

    def begin(self, want_norm: bool) -> None:
        """Start a micro-batch; ``want_norm``: collect the free-norm partials (the last one, single rank)."""
        self._start(want_norm, self.measure_sources)

    def hold(self, i: int, grad: torch.Tensor, overwrite: bool) -> None:
        """Hold parameter ``i``'s gradient until its bucket is launched; a later arrival of ``i`` in the same
        micro-batch is combined with the held one (``combine_arrival``), never held as a second source."""
        b = self.bucket_of[i]
        held = self._held[b]
        if i not in held:
            held[i] = (grad, overwrite)
            return
        earlier, earlier_overwrite = held[i]
        summed = self._summed[b]
        if self._source_views is not None and (i in summed or not earlier_overwrite):
            # The combined value will include main_grad's slice: keep the source itself apart.
            source = summed.get(i)
            if source is None:
                source = earlier.reshape(-1).to(torch.float32, copy=True)
            summed[i] = source.add_(grad.reshape(-1))
        dest, base = self._target(b)  # read only when ``earlier`` adds: after the bucket's first launch
        held[i] = (combine_arrival(dest, self.layout.offsets[i] - base, earlier, earlier_overwrite, grad), True)

    def _target(self, b: int) -> tuple[torch.Tensor, int]:
        """Where bucket ``b`` is written: the flat buffer (offsets as laid out), or with ``acquire`` the
        destination acquired for it in this micro-batch (offsets relative to the bucket's start)."""
        if self.acquire is None:
            return self.data, 0
        return self._dest[b], self.buckets[b].start

    def _stage(self, b: int, held: set[int]) -> None:
        """``acquire``: bucket ``b``'s destination for this micro-batch, its parameters not in ``held`` zeroed
        (they got no gradient before its first launch)."""
        dest = self._dest[b] = self.acquire(b)
        bucket = self.buckets[b]
        for i in range(bucket.first, bucket.last):
            if i not in held:
                o = self.layout.offsets[i] - bucket.start
                dest[o:o + self._numels[i]].zero_()

    def _accumulate(self, b: int, held: list[tuple[int, torch.Tensor, bool]], partials, sources) -> None:
        dest, base = self._target(b)
        srcs = [g.reshape(-1) if g.is_contiguous() else g.contiguous().reshape(-1) for _, g, _ in held]
        offsets, flags = [self.layout.offsets[i] - base for i, _, _ in held], [ow for _, _, ow in held]
        if sources is None:
            self.backend.accumulate_bucket_(dest, srcs, offsets, flags, partials)
        else:
            self.backend.accumulate_bucket_(dest, srcs, offsets, flags, partials, source_partials=sources)
        self.launches += 1

    def _narrow(self, table: torch.Tensor | None, held, start: int = 0,
                whole: bool = False) -> tuple[torch.Tensor | None, int]:
        """The part of a bucket's ``table`` slice for the sources ``held`` (``whole``: all of the bucket's), from
        ``start``; and its end. No host work per source for a whole bucket."""
        if table is None:
            return None, start
        if whole:
            return table, table.shape[self._partials_dim]
        n = self._extent([self._numels[i] for i, _, _ in held])
        return table.narrow(self._partials_dim, start, n), start + n

    def launch(self, b: int) -> None:
        """Accumulate what bucket ``b`` holds in one launch and drop it (called when the bucket is complete, by
        ``flush()``, and for a later arrival after the bucket launched)."""
        held = [(i, g, ow) for i, (g, ow) in sorted(self._held[b].items())]  # fixed order: deterministic partials
        summed = self._summed[b]
        self._held[b], self._summed[b] = {}, {}
        complete = len(held) == self._sizes[b]
        if self.acquire is not None and self._dest[b] is None:
            self._stage(b, {i for i, _, _ in held})
        partials = None
        if self._partials is not None and complete:
            partials = self._partial_views[b]
            self._complete_launches += 1
        elif self._partials is not None:
            self._norm_complete = False  # values written that no partial covers
        sources = None
        if self._source_views is not None:
            if self._launched[b]:  # a later arrival on its own: its first arrival's source is already counted
                self._inexact[-1] = True
            else:
                sources = self._source_views[b]
        self._launched[b] = True
        if sources is None:
            self._accumulate(b, held, partials, None)
            return
        direct = [h for h in held if h[0] not in summed] if summed else held
        apart = [h for h in held if h[0] in summed] if summed else []
        whole = complete and not apart
        part, end = self._narrow(partials, direct, whole=whole)
        written, n = self._narrow(sources, direct, whole=whole)
        self._accumulate(b, direct, part, written)
        if apart:  # their values include the slice: written without source partials, their sources measured apart
            self._accumulate(b, apart, self._narrow(partials, apart, end)[0], None)
            extra = self._extras[-1]
            for i, _, _ in apart:
                sq = self.backend.l2norm_sq(summed[i])[0]
                extra = sq if extra is None else extra + sq
            self._extras[-1] = extra
        if n < sources.shape[self._partials_dim]:  # parameters without a gradient, or measured apart: zero
            sources.narrow(self._partials_dim, n, sources.shape[self._partials_dim] - n).zero_()

    def flush(self) -> None:
        """End of backward: launch every bucket still holding gradients (parameters that got none); with
        measure_sources, zero the source partials of a bucket that got no gradient at all."""
        for b, held in enumerate(self._held):
            if held:
                self.launch(b)
                continue
            if self.acquire is not None and self._dest[b] is None:
                self._stage(b, set())  # a bucket no gradient reached: staged as zeros
            if self._source_views is not None and not self._launched[b]:
                self._source_views[b].zero_()

    def norm_partials(self) -> torch.Tensor | None:
        """The last micro-batch's whole-buffer free-norm partials (``backend.new_bucket_partials``) when every
        bucket was launched whole (they then cover the whole buffer), else None."""
        if self._partials is None or not self._norm_complete or self._complete_launches != len(self.buckets):
            return None
        return self._partials

    def source_tables(self) -> tuple[list[torch.Tensor], list[bool], list[torch.Tensor | None]]:
        """The window's source partials tables, one per micro-batch begun since ``clear_sources()``, whether each
        is inexact, and each one's norm of sources measured apart (or None): ``window_source_sumsq``'s arguments."""
        return list(self._source_tables), list(self._inexact), list(self._extras)

    def clear_sources(self) -> None:
        """A new window: forget the source partials."""
        self._source_tables, self._inexact, self._extras = [], [], []

    def drop(self) -> None:
        """Forget held gradients and the window's source partials (a failed backward, ``zero_grad()``)."""
        self._start(want_norm=False, sources=False)
        self.clear_sources()
