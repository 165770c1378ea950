"""Buckets of the flat main_grad buffer, and the Triton path's one kernel launch per bucket per micro-batch.

A bucket is a contiguous range of the flat fp32 buffer, cut at parameter boundaries once ``bucket_size_mb``
MiB of fp32 gradient is reached, in the buffer's layout order (the order in which backward produces
gradients). The same buckets serve two stages: the all-reduce of the window's last micro-batch
(``gaengine.reduce.BucketReducer``, one collective per bucket) and, with the Triton backend, the accumulation
itself (``BucketAccumulation``, one launch per bucket).

``BucketAccumulation``: the hook hands each gradient over as autograd produces it; it is held (no copy)
until every parameter of its bucket has arrived in this micro-batch, then the whole bucket is accumulated
into the flat fp32 buffer by one launch of ``gaengine.kernels.bucket.accumulate_bucket_`` and the held
gradients are dropped. With gradients arriving in layout order (the layout is re-learned from the first
window), at most about one bucket of low-precision gradients is held at a time. Parameters that get no
gradient in a micro-batch leave their bucket incomplete; ``flush()`` at the end of backward launches what
is held.

Free norm (single rank): in the window's last micro-batch each launch also writes per-block sums of
squares and non-finite flags of the values it wrote into one ``(2, n_blocks)`` fp32 table on the buffer's
device; when every bucket was complete, that table covers every parameter, so ``step()`` finishes the norm
from it with a deterministic fixed-order reduction and reads the buffer zero extra times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gaengine.buffer import FlatBuffer, FlatLayout

__all__ = ["Bucket", "BucketAccumulation", "build_buckets"]


@dataclass
class Bucket:
    """Parameters ``[first, last)`` of the layout and the buffer range ``[start, end)`` (elements) they cover."""

    index: int
    first: int
    last: int
    start: int
    end: int
    pending: int = 0
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


class BucketAccumulation:
    """Held gradients and launches for the buckets of one flat buffer (see the module docstring)."""

    def __init__(self, main_grad: FlatBuffer, buckets: list[Bucket]) -> None:
        from gaengine.kernels import bucket as bucket_kernels  # noqa: PLC0415 - imports triton

        self._kernels = bucket_kernels
        self.data = main_grad.data
        self.layout = main_grad.layout
        self.buckets = buckets
        self.bucket_of = [b.index for b in buckets for _ in range(b.first, b.last)]
        self._sizes = [b.last - b.first for b in buckets]
        cols, start = [], 0
        for b in buckets:
            n = bucket_kernels.num_blocks(self.layout.numels[b.first:b.last])
            cols.append((start, start + n))
            start += n
        self._columns, self._n_blocks = cols, start
        self.launches = 0  # kernel-launching calls, for tests and benchmarks
        self.begin(want_norm=False)

    def begin(self, want_norm: bool) -> None:
        """Start a micro-batch; ``want_norm``: collect the free-norm partials (the last one, single rank)."""
        self._held: list[list[tuple[int, torch.Tensor, bool]]] = [[] for _ in self.buckets]
        self._remaining = list(self._sizes)
        self._partials = (torch.empty(2, self._n_blocks, dtype=torch.float32, device=self.data.device)
                          if want_norm else None)
        self._norm_complete = want_norm

    def add(self, i: int, grad: torch.Tensor, overwrite: bool, scale: float | torch.Tensor) -> list[int]:
        """Hold parameter ``i``'s gradient; returns the parameters accumulated by a launch it completed."""
        b = self.bucket_of[i]
        self._held[b].append((i, grad, overwrite))
        self._remaining[b] -= 1
        return self._launch(b, scale) if self._remaining[b] == 0 else []

    def flush(self, scale: float | torch.Tensor) -> list[int]:
        """End of backward: launch every bucket still holding gradients; returns the parameters accumulated."""
        done = []
        for b, held in enumerate(self._held):
            if held:
                done += self._launch(b, scale)
        if any(self._remaining):
            self._norm_complete = False  # some parameter got no gradient: the partials miss it
        return done

    def _launch(self, b: int, scale: float | torch.Tensor) -> list[int]:
        held = sorted(self._held[b], key=lambda item: item[0])  # fixed order: deterministic partials
        self._held[b] = []
        complete = len(held) == self._sizes[b]
        partials = None
        if self._partials is not None and complete:
            lo, hi = self._columns[b]
            partials = self._partials[:, lo:hi]
        elif self._partials is not None:
            self._norm_complete = False
        self._kernels.accumulate_bucket_(
            self.data, [g.reshape(-1) if g.is_contiguous() else g.contiguous().reshape(-1) for _, g, _ in held],
            [self.layout.offsets[i] for i, _, _ in held], scale, [ow for _, _, ow in held], partials=partials)
        self.launches += 1
        return [i for i, _, _ in held]

    def free_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum_sq, found_inf)`` of the whole buffer from the last micro-batch's partials, or None."""
        if self._partials is None or not self._norm_complete:
            return None
        return self._kernels.l2norm_sq_from_partials(self._partials)

    def drop(self) -> None:
        """Forget held gradients (a failed backward, ``zero_grad()``)."""
        self.begin(want_norm=False)
