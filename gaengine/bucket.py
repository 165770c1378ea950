"""Buckets of the flat main_grad buffer, and the Triton path's one kernel launch per bucket per micro-batch.

A bucket is a contiguous range of the flat fp32 buffer, cut at parameter boundaries once ``bucket_size_mb``
MiB of fp32 gradient is reached, in the buffer's layout order (the order in which backward produces
gradients). The same buckets serve two stages: the all-reduce of the window's last micro-batch
(``gaengine.reduce.BucketReducer``, one collective per bucket) and, with the Triton backend, the accumulation
itself (``BucketAccumulation``, one launch per bucket).

``BucketAccumulation``: the hook hands each gradient over as autograd produces it; it is held (no copy)
until the hooks (``gaengine.python_hooks``, which count bucket readiness) find every parameter of its bucket
arrived in this micro-batch, then the whole bucket is accumulated into the flat fp32 buffer by one launch of ``gaengine.kernels.bucket.accumulate_bucket_`` and the held
gradients are dropped. With gradients arriving in layout order (the layout is re-learned from the first
window), at most about one bucket of low-precision gradients is held at a time. Parameters that get no
gradient in a micro-batch leave their bucket incomplete; ``flush()`` at the end of backward launches what
is held. A parameter whose gradient arrives again in the same micro-batch (reentrant checkpointing of a
shared layer) is combined with what is held for it (``combine_arrival``), never held as a second source on
the same slice.

Free norm (single rank): in the window's last micro-batch each launch also writes per-block sums of
squares and non-finite flags of the values it wrote into one ``(2, n_blocks)`` fp32 table on the buffer's
device; when every bucket was complete, that table covers every parameter, so ``step()`` finishes the norm
from it (the backend's ``finish_norm_partials``, a deterministic fixed-order reduction) and reads the buffer
zero extra times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gaengine.buffer import FlatBuffer, FlatLayout

__all__ = ["Bucket", "BucketAccumulation", "build_buckets", "combine_arrival"]


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
        self._held: list[dict[int, tuple[torch.Tensor, bool]]] = [{} for _ in self.buckets]
        self._partials = (torch.empty(2, self._n_blocks, dtype=torch.float32, device=self.data.device)
                          if want_norm else None)
        self._complete_launches = 0  # buckets launched whole in this micro-batch
        self._norm_complete = want_norm

    def hold(self, i: int, grad: torch.Tensor, overwrite: bool) -> None:
        """Hold parameter ``i``'s gradient until its bucket is launched; a later arrival of ``i`` in the same
        micro-batch is combined with the held one (``combine_arrival``), never held as a second source."""
        held = self._held[self.bucket_of[i]]
        if i in held:
            held[i] = (combine_arrival(self.data, self.layout.offsets[i], *held[i], grad), True)
        else:
            held[i] = (grad, overwrite)

    def launch(self, b: int) -> None:
        """Accumulate what bucket ``b`` holds in one launch and drop it (called when the bucket is complete)."""
        held = [(i, g, ow) for i, (g, ow) in sorted(self._held[b].items())]  # fixed order: deterministic partials
        self._held[b] = {}
        partials = None
        if self._partials is not None and len(held) == self._sizes[b]:
            lo, hi = self._columns[b]
            partials = self._partials[:, lo:hi]
            self._complete_launches += 1
        elif self._partials is not None:
            self._norm_complete = False  # values written that no partial column covers
        self._kernels.accumulate_bucket_(
            self.data, [g.reshape(-1) if g.is_contiguous() else g.contiguous().reshape(-1) for _, g, _ in held],
            [self.layout.offsets[i] for i, _, _ in held], 1.0, [ow for _, _, ow in held], partials=partials)
        self.launches += 1

    def flush(self) -> None:
        """End of backward: launch every bucket still holding gradients (parameters that got none)."""
        for b, held in enumerate(self._held):
            if held:
                self.launch(b)

    def norm_partials(self) -> torch.Tensor | None:
        """The last micro-batch's ``(2, n_blocks)`` fp32 free-norm partials when every bucket was launched whole
        (they then cover the whole buffer), else None."""
        if self._partials is None or not self._norm_complete or self._complete_launches != len(self.buckets):
            return None
        return self._partials

    def drop(self) -> None:
        """Forget held gradients (a failed backward, ``zero_grad()``)."""
        self.begin(want_norm=False)
