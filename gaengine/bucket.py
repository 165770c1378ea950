"""Buckets of the flat main_grad buffer: the unit of accumulation and of reduction.

A bucket is a contiguous range of the flat fp32 buffer, cut at parameter boundaries once ``bucket_size_mb``
MiB of fp32 gradient is reached, in the buffer's layout order (the order in which backward produces
gradients). The same buckets serve two stages: the accumulation (``csrc/hot_path.cpp`` holds each gradient as
autograd produces it and accumulates a whole bucket per launch, ``accumulate_bucket_``, once every parameter of
the bucket has arrived) and the all-reduce of the window's last micro-batch (``gaengine.reduce.BucketReducer``,
one collective per bucket).

``window_source_sumsq`` finishes the per-micro-batch source norms (the gradient noise scale) from the source
partials the bucket launches wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gaengine.buffer import FlatLayout

__all__ = ["Bucket", "build_buckets", "window_source_sumsq"]


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
