"""Bucketed all-reduce of the flat main_grad buffer, launched while the last micro-batch's backward runs.

Buckets are contiguous ranges of the flat buffer (so each all-reduce is one call on one view, no copy),
cut at parameter boundaries once ``bucket_size_mb`` of fp32 gradient is reached, in the buffer's layout
order — the order in which backward produces gradients. A bucket's all-reduce is launched (asynchronously)
as soon as its last parameter has been accumulated in the window's last micro-batch. Buckets are launched
strictly in index order, as torch DDP's reducer does (``reducer.cpp``, ``next_bucket_``), because
collectives must be issued in the same order on every rank.

All of this is torch.distributed underneath (NCCL on GPU, gloo on CPU); gaengine owns only the bucketing
and the schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gaengine.buffer import FlatLayout

__all__ = ["Bucket", "BucketReducer", "build_buckets"]


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


class BucketReducer:
    """Launches and completes the all-reduce (sum) of each bucket of one flat fp32 buffer.

    data: (layout.total_numel,) fp32 main_grad. reduce_dtype: fp32, or bf16/fp16 on the wire (the
    reduced values are written back into the fp32 buffer). group: the process group (None: the default).
    """

    def __init__(self, data: torch.Tensor, layout: FlatLayout, bucket_size_mb: float, reduce_dtype: torch.dtype,
                 group: dist.ProcessGroup | None) -> None:
        self.data = data
        self.reduce_dtype = reduce_dtype
        self.group = group
        self.buckets = build_buckets(layout, bucket_size_mb)
        self.bucket_of = [b.index for b in self.buckets for _ in range(b.first, b.last)]
        self.next_to_launch = len(self.buckets)
        self.launch_log: list[tuple[int, float]] = []  # (bucket index, time.perf_counter()) of the current window
        self.backward_end_time: float | None = None  # when the last micro-batch's backward finished
        self.collectives_issued = 0

    def begin(self) -> None:
        """Arm for the window's last micro-batch: every bucket waits for all of its parameters."""
        for b in self.buckets:
            b.pending = b.last - b.first
            b.work = b.wire = b.launched_at = None
        self.next_to_launch = 0
        self.launch_log = []
        self.backward_end_time = None

    @property
    def armed(self) -> bool:
        return self.next_to_launch < len(self.buckets)

    def mark_ready(self, param_index: int) -> None:
        """Parameter ``param_index`` is final for this window; launch every bucket that is now complete, in order."""
        self.buckets[self.bucket_of[param_index]].pending -= 1
        self._launch_in_order()

    def flush(self) -> None:
        """End of backward: launch every bucket not launched yet (parameters that got no gradient are final)."""
        self.backward_end_time = time.perf_counter()
        for b in self.buckets[self.next_to_launch:]:
            b.pending = 0
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending == 0:
            b = self.buckets[self.next_to_launch]
            view = self.data[b.start:b.end]
            b.wire = view if self.reduce_dtype == torch.float32 else view.to(self.reduce_dtype)
            b.work = dist.all_reduce(b.wire, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            b.launched_at = time.perf_counter()
            self.launch_log.append((b.index, b.launched_at))
            self.collectives_issued += 1
            self.next_to_launch += 1

    def wait(self) -> None:
        """Wait for every launched bucket (on CUDA: the current stream waits, the host does not)."""
        for b in self.buckets:
            if b.work is None:
                continue
            wait_for(b.work, f"all-reduce of gradient bucket {b.index} ({b.end - b.start} elements)")
            if b.wire is not None and b.wire.dtype != self.data.dtype:
                self.data[b.start:b.end].copy_(b.wire)
            b.work = b.wire = None


def wait_for(work, what: str) -> None:
    """``work.wait()``, turning a peer's failure or a timeout into an error that says what happened."""
    try:
        work.wait()
    except Exception as exc:
        raise RuntimeError(
            f"gaengine: {what} failed: another rank failed, stopped mid-window, or is out of step with this one "
            "(every rank must call acc.backward() the same number of times per window and acc.step() together). "
            "The wait is bounded by the process group's timeout: torch.distributed.init_process_group(timeout=...)."
        ) from exc
