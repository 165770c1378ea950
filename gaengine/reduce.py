"""Cross-rank reduction: the bucketed all-reduce of main_grad, the window's stats, the initial broadcast.

Buckets (``gaengine.bucket``) are contiguous ranges of the flat fp32 main_grad buffer, so each all-reduce
is one call on one view, no copy. A bucket's all-reduce (sum) is launched asynchronously as soon as its
last parameter has been accumulated in the window's last micro-batch, overlapping the rest of backward.
Buckets are launched strictly in index order, as torch DDP's reducer does (``reducer.cpp``,
``next_bucket_``), because collectives must be issued in the same order on every rank.

At the end of the last backward, ``launch_window_stats`` zeroes the slices this rank never wrote, launches
the buckets still pending and one more all-reduce of ``(loss_sum, items, used[0..P), counts[0..W), settings,
extra)`` in
fp64 on the device: ``step()`` gets the global loss and item count from it, the parameters no rank produced a
gradient for (``WindowStats.globally_unused``), which get no update, as with torch DDP, every rank's micro-batch
count (``WindowStats.count_mismatch``: the ranks' windows must hold equal counts), whether the ranks still agree on
the settings they may change at run time (``WindowStats.settings_mismatch``) and the sums of any extra
per-rank values (the noise scale's small-batch terms, ``gaengine.noise``).

``Reduction`` is a sharding strategy's part for all of this (``gaengine.sharding``): what the engine calls before
and after each backward, the stats, and the window's norm (``gaengine.norm.window_norm``), per layout; ZeRO's and
FSDP2's reductions override what differs (``gaengine.zero``, ``gaengine.fsdp2``).

All of this is torch.distributed underneath (NCCL on GPU, gloo on CPU); gaengine owns only the bucketing
and the schedule.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from gaengine.bucket import Bucket, build_buckets
from gaengine.buffer import FlatBuffer, FlatLayout
from gaengine.compat import BACKWARD_TLS, BACKWARD_TLS_KEY, tensor_use_count
from gaengine.norm import WindowNorm, window_norm

__all__ = ["DROPPED_COUNT", "BackwardStart", "BucketReducer", "Collective", "HostMailbox", "Reduction", "WindowStats",
           "broadcast_from_first_rank", "check_ranks_agree", "count_mismatch_message", "launch_window_stats",
           "collective_failed", "group_device", "setting_terms", "settle", "wait_for", "wait_quietly"]

DROPPED_COUNT = -1  # the micro-batch count a rank that dropped its window sends in the stats all-reduce
SETTLE_TIMEOUT_S = 1.0  # the longest Collective.wait() waits for a backend thread to let go of the tensors
_SETTLE_POLL_S = 5e-5


class Collective:
    """One asynchronous collective gaengine launches: torch's work handle, and the tensors it reads and writes,
    held here until the backend has let go of them.

    Why: gloo runs a collective on a worker thread of the process group, which drops the work (its tensors and the
    thread-local state it captured at the launch) a little after ``wait()`` has returned, a third of the time on a
    loaded 2-core machine. Dropping a reference to a Python object takes the GIL (a tensor's, through torch's
    ``TensorImpl::decref_pyobject``; the ``contextvars`` context a backward keeps in the thread-local state); a
    worker thread that takes it once the interpreter has begun to finalize is ended by Python inside a C++
    destructor, and the process aborts with ``terminate called without an active exception``. So:

    * the collective is launched with that context taken out of the thread-local state (put back at once): the
      reductions the hooks launch during backward capture no Python object;
    * ``wait()`` also waits, for CPU tensors, until no other thread holds them (``settle``).

    When ``step()`` and ``state_dict()`` return, nothing gaengine launched is in flight or holds a Python object
    on a backend thread (``overlap_param_gather``'s all-gathers apart, which ``gaengine.zero.ParamGather``
    waits for at the latest at interpreter exit). On CUDA ``wait()`` stays a stream wait: no host sync.

    fn: a ``torch.distributed`` collective, called as ``fn(*tensors, async_op=True, **kwargs)`` on aliases of
    ``tensors`` made here (``detach()``: the same memory, a tensor object only this and the collective hold).
    """

    __slots__ = ("tensors", "work")

    def __init__(self, fn: Callable, *tensors: torch.Tensor, **kwargs) -> None:
        self.tensors = tuple(t.detach() for t in tensors)
        is_key, get, remove, stash = BACKWARD_TLS
        stashed = None
        if all(BACKWARD_TLS) and is_key(BACKWARD_TLS_KEY):
            stashed = get(BACKWARD_TLS_KEY)
            remove(BACKWARD_TLS_KEY)
        try:
            self.work = fn(*self.tensors, async_op=True, **kwargs)
        finally:
            if stashed is not None:
                stash(BACKWARD_TLS_KEY, stashed)

    def wait(self) -> None:
        """Wait for the collective (raising what torch's ``work.wait()`` raises), then ``settle`` its tensors."""
        if self.work is not None:
            self.work.wait()
            self.work = None  # torch's handle holds the tensors too
        if self.tensors and settle(self.tensors):
            self.tensors = ()


def settle(tensors: Iterable[torch.Tensor], timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait (host; sleeping, so the GIL is free for the thread that needs it) until no C++ reference but its Python
    object's holds any CPU tensor of ``tensors`` (aliases only ``Collective`` holds), for at most ``timeout_s``.
    Returns whether they all settled. CUDA tensors are not waited for (that would be a host sync); nor is anything
    where torch does not count references (``Tensor._use_count``)."""
    if tensor_use_count is None:
        return True
    pending = [t for t in tensors if t.device.type == "cpu"]
    deadline = None
    while True:
        pending = [t for t in pending if tensor_use_count(t) > 1]
        if not pending:
            return True
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout_s
        elif now >= deadline:
            return False
        time.sleep(_SETTLE_POLL_S)


class BucketReducer:
    """Launches and completes the all-reduce (sum) of each bucket of one flat fp32 buffer.

    data: (layout.total_numel,) fp32 main_grad. reduce_dtype: fp32, or bf16/fp16 on the wire (the
    reduced values are written back into the fp32 buffer). group: the process group (None: the default).
    """

    collective = "all-reduce"  # what wait() names in its errors

    def __init__(self, data: torch.Tensor, layout: FlatLayout, bucket_size_mb: float, reduce_dtype: torch.dtype,
                 group: dist.ProcessGroup | None, buckets: list[Bucket] | None = None) -> None:
        self.data = data
        self.reduce_dtype = reduce_dtype
        self.group = group
        self.buckets = build_buckets(layout, bucket_size_mb) if buckets is None else buckets
        self.bucket_of = [b.index for b in self.buckets for _ in range(b.first, b.last)]
        self.next_to_launch = len(self.buckets)
        self.launch_log: list[tuple[int, float]] = []  # (bucket index, time.perf_counter()) of the current window
        self.backward_end_time: float | None = None  # when the last micro-batch's backward finished
        self.collectives_issued = 0

    def begin(self) -> None:
        """Arm for the window's last micro-batch: no bucket is ready yet."""
        for b in self.buckets:
            b.ready = False
            b.work = b.wire = b.launched_at = None
        self.next_to_launch = 0
        self.launch_log = []
        self.backward_end_time = None

    @property
    def armed(self) -> bool:
        return self.next_to_launch < len(self.buckets)

    def bucket_ready(self, b: int) -> None:
        """Every parameter of bucket ``b`` is final for this window (the hooks, which count readiness, call it
        once per complete bucket); launch every ready bucket, in order."""
        self.buckets[b].ready = True
        self._launch_in_order()

    def flush(self) -> None:
        """End of backward: launch every bucket not launched yet (parameters that got no gradient are final)."""
        self.backward_end_time = time.perf_counter()
        for b in self.buckets[self.next_to_launch:]:
            b.ready = True
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].ready:
            b = self.buckets[self.next_to_launch]
            self._launch(b)
            b.launched_at = time.perf_counter()
            self.launch_log.append((b.index, b.launched_at))
            self.collectives_issued += 1
            self.next_to_launch += 1

    def _launch(self, b: Bucket) -> None:
        """Start bucket ``b``'s collective: ``b.wire`` (the bucket, in ``reduce_dtype``) and ``b.work``."""
        view = self.data[b.start:b.end]
        b.wire = view if self.reduce_dtype == torch.float32 else view.to(self.reduce_dtype)
        b.work = Collective(dist.all_reduce, b.wire, op=dist.ReduceOp.SUM, group=self.group)

    def _finish(self, b: Bucket) -> None:
        """Bucket ``b``'s collective completed: its result into ``data`` (fp32) when the wire was narrower."""
        if b.wire is not None and b.wire.dtype != self.data.dtype:
            self.data[b.start:b.end].copy_(b.wire)

    def drain(self) -> None:
        """Drop the window (``zero_grad()`` after a failed last micro-batch): wait for the all-reduces already
        launched, so that none still writes into main_grad when the next window does, ignoring their errors (a
        peer that failed too), and launch nothing more."""
        for b in self.buckets:
            if b.work is not None:
                wait_quietly(b.work)
            b.work = b.wire = None
        self.next_to_launch = len(self.buckets)

    def wait(self) -> None:
        """Wait for every launched bucket (on CUDA: the current stream waits, the host does not)."""
        for b in self.buckets:
            if b.work is None:
                continue
            wait_for(b.work, f"{self.collective} of gradient bucket {b.index} ({b.end - b.start} elements)")
            self._finish(b)
            b.work = b.wire = None


def wait_quietly(work) -> None:
    """Wait for a collective of a window being dropped, ignoring its error (a peer that failed too): nothing may
    still write into its buffer when the next window does."""
    try:
        work.wait()
    except Exception:  # noqa: BLE001 - the window is dropped either way
        pass


def collective_failed(what: str) -> str:
    """gaengine's message for a collective (``what``) that failed: a peer died, left, or the group's timeout."""
    return (f"gaengine: {what} failed: another rank failed, stopped mid-window, or is out of step with this one "
            "(every rank must call acc.backward() the same number of times per window and acc.step() together). "
            "The wait is bounded by the process group's timeout: torch.distributed.init_process_group(timeout=...).")


def wait_for(work, what: str) -> None:
    """``work.wait()``, turning a peer's failure or a timeout into an error that says what happened."""
    try:
        work.wait()
    except Exception as exc:
        raise RuntimeError(collective_failed(what)) from exc


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take their tensors: CUDA (the current device) when its backend is NCCL, else
    CPU (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


@dataclass
class WindowStats:
    """The window's stats all-reduce, launched at the end of the last backward.

    data: (2 + P + W + 8S + E + T,) fp64 on the device: the loss sum, the item count, per parameter (layout order)
    1.0 where this rank produced a gradient, per rank of the group (group rank order) its micro-batch count in the
    window (this rank writes its own slot, the others 0), per setting the ranks must agree on its 8 agreement terms
    (``setting_terms``), then the E extra values and the T tail values (all summed over ranks once ``wait()``
    returned: every rank then holds every rank's count).
    locally_unused: layout indices of the parameters this rank got no gradient for in the window.
    num_extra: E, the extra values (the noise scale's small-batch terms, ``gaengine.noise``). num_tail: T, the
    sharding strategy's own values (``gaengine.fsdp2``: the local shards' sum of squares and non-finite flag).
    num_ranks: W, the group's size. rank: this rank's index in the group. count: this rank's micro-batches.
    settings: the S settings' names and this rank's values (``launch_window_stats``); own_terms: ``(8S,)`` fp64 on
    the device, W times this rank's agreement terms (what every rank's sum equals when all ranks agree).
    host_counts: the W counts once a host read brought them over (``globally_unused``, ``read_counts``), else None.
    """

    data: torch.Tensor
    work: object
    locally_unused: list[int]
    num_extra: int = 0
    num_tail: int = 0
    num_ranks: int = 0
    rank: int = 0
    count: int = 0
    settings: tuple[tuple[str, object], ...] = ()
    own_terms: torch.Tensor | None = None
    host_counts: list[int] | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the all-reduce; returns the global ``(loss_sum, items)``, 0-d fp32 on the device."""
        wait_for(self.work, "all-reduce of the window's loss and item count")
        return self.data[0].float(), self.data[1].float()

    def counts(self) -> torch.Tensor:
        """Every rank's micro-batch count in the window (after ``wait()``): ``(W,)`` fp64 on the device."""
        end = self.data.numel() - self.num_extra - self.num_tail - SETTING_TERMS * len(self.settings)
        return self.data[end - self.num_ranks:end]

    def count_mismatch(self) -> torch.Tensor:
        """0-d bool on the device, no host read: True when some rank's window holds another number of micro-batches
        than this rank's (every rank computes the same flag: if the counts are not all equal, each rank sees one
        that differs from its own)."""
        return self.counts().ne(float(self.count)).any()

    def settings_mismatch(self) -> torch.Tensor:
        """``(S,)`` bool on the device, no host read (after ``wait()``): per setting, whether the ranks' values differ.
        Each rank compares the summed agreement terms with W times its own: for chunks c_r (``setting_terms``),
        sum_r c_r = W c and sum_r c_r^2 = W c^2 together mean the chunks' variance over ranks is 0, i.e. every rank
        holds c (exact: integers below 2^53). So every rank computes the same flags."""
        if not self.settings:
            return torch.zeros(0, dtype=torch.bool, device=self.data.device)
        end = self.data.numel() - self.num_extra - self.num_tail
        summed = self.data[end - SETTING_TERMS * len(self.settings):end]
        return summed.ne(self.own_terms).view(len(self.settings), SETTING_TERMS).any(dim=1)

    def mismatch(self) -> torch.Tensor:
        """0-d bool on the device, no host read: the ranks' micro-batch counts or settings differ (no rank may
        apply this window)."""
        flag = self.count_mismatch()
        return flag | self.settings_mismatch().any() if self.settings else flag

    def disagreement(self) -> torch.Tensor:
        """``(W + S,)`` fp64 on the device: every rank's count, then 1.0 per setting the ranks disagree on (what
        ``gaengine.window.RankCounts`` reads on the host)."""
        return torch.cat([self.counts(), self.settings_mismatch().double()])

    def read_counts(self) -> list[int]:
        """The W counts on the host (after ``wait()``): the ones ``globally_unused`` read, else one host read."""
        if self.host_counts is None:
            self.host_counts = [int(c) for c in self.counts().tolist()]  # host read: see GradientAccumulator.step
        return self.host_counts

    def globally_unused(self) -> list[int]:
        """Parameters no rank produced a gradient for (after ``wait()``). Reads the flags on the host only on a
        rank that has locally unused parameters (torch DDP's find_unused_parameters pays the same read); the
        ranks' micro-batch counts come over in the same read (``host_counts``)."""
        if not self.locally_unused:
            return []
        n = len(self.locally_unused)
        values = torch.cat([self.data[2:][self.locally_unused], self.counts()]).tolist()  # host read: .grad None
        self.host_counts = [int(c) for c in values[n:]]
        return [i for i, f in zip(self.locally_unused, values[:n]) if f == 0.0]

    def extra(self) -> torch.Tensor:
        """The extra values summed over ranks (after ``wait()``): ``(E,)`` fp64 on the device."""
        end = self.data.numel() - self.num_tail
        return self.data[end - self.num_extra:end]

    def tail(self) -> torch.Tensor:
        """The strategy's tail values summed over ranks (after ``wait()``): ``(T,)`` fp64 on the device."""
        return self.data[self.data.numel() - self.num_tail:]


class HostMailbox:
    """Host memory that a small device tensor is copied into behind the device's queued work, without a host wait
    (``post``), and read later (``ready``, ``read``): a flag or a few counts reported one call late instead of a
    sync now.

    numel, dtype: the tensors posted. device: theirs; on CUDA the buffer is pinned, the copy is non-blocking and an
    event marks its end, so ``read`` waits for that copy only (the device has later work queued behind it), never
    for the device to drain, and ``ready`` does not wait at all. The buffer is read through a NumPy view made here:
    host memory, no tensor read.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self._host = torch.zeros(numel, dtype=dtype, pin_memory=device.type == "cuda")
        self._view = self._host.numpy()
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._posted = False

    def post(self, value: torch.Tensor) -> None:
        """Start copying ``value`` (``numel`` elements on the device) into host memory; no host wait."""
        self._host.copy_(value.reshape(-1), non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._posted = True

    def ready(self) -> bool:
        """Whether a ``post`` has landed in host memory and was not read yet (never waits)."""
        return self._posted and (self._event is None or self._event.query())

    def read(self) -> list:
        """The values of the last ``post`` as Python numbers (waiting on CUDA for that copy only)."""
        if not self._posted:
            raise RuntimeError("gaengine: HostMailbox.read() before post() (a bug)")
        if self._event is not None:
            self._event.synchronize()
        self._posted = False
        return self._view.tolist()


def count_mismatch_message(counts: list[int], rank: int, found: str = "") -> str:
    """The error every rank raises when the ranks' windows held different numbers of micro-batches.

    counts: every rank's micro-batch count in the window (group rank order); rank: this rank's index in the group;
    found: where it was found, when that was not the step that raises."""
    dropped = [r for r, c in enumerate(counts) if c == DROPPED_COUNT]
    if dropped:
        return (f"gaengine: rank(s) {', '.join(map(str, dropped[:8]))} dropped this accumulation window{found} "
                f"(acc.zero_grad(), or acc.close(), after an error in its last micro-batch, on that rank only) while "
                f"this rank (rank "
                f"{rank} of {len(counts)}) completed it: no rank applied this update (the parameters, the optimizer "
                "state, the lr_scheduler and the loss scale are unchanged on every rank) and the window is dropped "
                "here too. Every rank must drop a window together: catch the error on every rank (or none), call "
                "acc.zero_grad() on every rank and go on together")
    shown = ", ".join(f"{r}: {c}" for r, c in enumerate(counts[:16])) + (", ..." if len(counts) > 16 else "")
    hi, lo = max(counts), min(counts)
    fewest = [r for r, c in enumerate(counts) if c == lo]
    most = [r for r, c in enumerate(counts) if c == hi]
    ranks = lambda rs: ", ".join(map(str, rs[:8])) + (", ..." if len(rs) > 8 else "")  # noqa: E731
    return (
        f"gaengine: the ranks' accumulation windows held different numbers of micro-batches{found}: this rank "
        f"(rank {rank} of {len(counts)}) held {counts[rank]}; the most was {hi} (rank(s) {ranks(most)}), the fewest "
        f"{lo} (rank(s) {ranks(fewest)}); per rank {{{shown}}}. Unequal windows are normalized differently on each "
        "rank (the ranks' parameters would drift apart silently) and leave the ranks at different points of their "
        "epoch, so no rank applied this update: the parameters, the optimizer state, the lr_scheduler and the loss "
        "scale are unchanged on every rank, and the window is dropped (acc.zero_grad() is harmless; training can go "
        "on). Every rank must call acc.backward() the same number of times per window and acc.step() together: give "
        "every rank the same number of micro-batches per epoch, e.g. torch.utils.data.DistributedSampler(dataset, "
        "drop_last=True) and the same batch size on every rank, or stop every rank at the smallest count."
    )


SETTING_TERMS = 8  # per setting: 4 chunks of its 64 bits, then their squares (setting_terms)
NONE_SETTING = -1.0  # how None is encoded (no setting the ranks compare takes a negative value)


def setting_terms(value: int | float | None) -> list[float]:
    """The 8 agreement terms of one setting's value (an int, a float, or None: encoded as ``NONE_SETTING``): the 4
    16-bit chunks c of its float64 bits, then c^2. Summed over W ranks they stay exact integers in fp64 (W c^2 <
    2^53 for W < 2^21), so ``WindowStats.settings_mismatch`` compares bit patterns exactly, in the stats all-reduce
    that runs anyway (no collective of its own)."""
    bits = struct.unpack("<Q", struct.pack("<d", NONE_SETTING if value is None else float(value)))[0]
    chunks = [float((bits >> (16 * i)) & 0xFFFF) for i in range(4)]
    return chunks + [c * c for c in chunks]


def launch_window_stats(reducer: BucketReducer | None, main_grad: FlatBuffer, locally_unused: list[int],
                        loss_sum: torch.Tensor, items: torch.Tensor,
                        group: dist.ProcessGroup | None, extra: torch.Tensor | None = None,
                        count: int = 0, tail: torch.Tensor | None = None,
                        settings: tuple[tuple[str, object], ...] = ()) -> WindowStats:
    """End of the last backward: zero the never-written slices, launch the remaining buckets (``reducer``: None
    when the gradients were reduced elsewhere, FSDP2's reduce-scatter) and the stats.

    locally_unused: layout indices this rank wrote no gradient for in the window (their slices of
    ``main_grad`` are zeroed here, so the all-reduce sums zeros for them). loss_sum, items: 0-d, this rank's
    window loss sum (fp32) and item count (fp64), on the device. The stats all-reduce carries them and, per
    parameter, whether this rank produced a gradient for it, so a parameter no rank used gets no update; and, per
    rank, its micro-batch count (``count``: this rank's, written into its own slot; one slot per rank, so the sum
    gives every rank each rank's count exactly, in the same all-reduce: ``WindowStats.count_mismatch``).
    extra: ``(E,)`` fp64 on the device, more per-rank values to sum in the same all-reduce, or None; tail: ``(T,)``
    likewise, the sharding strategy's (``WindowStats.tail``), or None. settings: ``(name, value)`` pairs of what
    every rank must have set alike (the window's K, ``max_grad_norm``: changed at run time on one rank only they
    would train the ranks apart), compared in the same all-reduce (``WindowStats.settings_mismatch``).
    """
    for i in locally_unused:
        main_grad.flat_views[i].zero_()
    if reducer is not None:  # None: the gradients were reduced by someone else (FSDP2's reduce-scatter)
        reducer.flush()
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    num_params = len(main_grad.flat_views)
    terms = [t for _, value in settings for t in setting_terms(value)]
    # used flags, the counts, the settings' terms, then W times those terms (the sums they must equal): one copy
    host = torch.zeros(num_params + num_ranks + 2 * len(terms), dtype=torch.float64)
    host[:num_params] = 1.0
    host[locally_unused] = 0.0
    host[num_params + rank] = float(count)
    at = num_params + num_ranks
    host[at:at + len(terms)] = torch.tensor(terms, dtype=torch.float64)
    host[at + len(terms):] = host[at:at + len(terms)] * num_ranks
    host = host.to(loss_sum.device, non_blocking=True)
    parts = [loss_sum.double().reshape(1), items.double().reshape(1), host[:at + len(terms)]]
    for more in (extra, tail):
        if more is not None:
            parts.append(more.double().reshape(-1))
    data = torch.cat(parts)
    work = Collective(dist.all_reduce, data, group=group)
    if reducer is not None:
        reducer.collectives_issued += 1
    return WindowStats(data, work, locally_unused, 0 if extra is None else extra.numel(),
                       0 if tail is None else tail.numel(), num_ranks, rank, count, tuple(settings),
                       host[at + len(terms):])


def _first_rank(group: dist.ProcessGroup | None) -> int:
    """Global rank of the first rank of ``group`` (None: the default group), the source of every broadcast."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def broadcast_from_first_rank(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` (parameters, buffers; any dtype, on the group's device) with the first rank's."""
    src = _first_rank(group)
    with torch.no_grad():
        for t in tensors:
            wait_for(Collective(dist.broadcast, t, src=src, group=group), f"broadcast from rank {src} of the "
                     "parameters and buffers at construction")


def check_ranks_agree(settings: dict, group: dist.ProcessGroup | None) -> None:
    """Several ranks, at construction, before any other collective: every rank's ``settings`` (name -> a picklable
    value: the parameters' names, shapes, dtypes and order, K, ``max_grad_norm``, ``bucket_size_mb``, ...) must be
    equal, or the collectives that follow disagree on sizes (gloo aborts the process: ``EnforceNotMet``) or the
    ranks train apart (another ``max_grad_norm``). One ``all_gather_object``; ``ValueError`` on every rank naming
    the first setting that differs and each rank's value."""
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    try:
        dist.all_gather_object(gathered, settings, group=group)
    except Exception as exc:
        raise RuntimeError(collective_failed("all_gather_object of the accumulators' settings at construction")
                           ) from exc
    for name in settings:
        values = [g.get(name) for g in gathered]
        if any(v != values[0] for v in values):
            if name == "parameters":
                at = next(i for i in range(max(len(v) for v in values))
                          if len({repr(v[i]) if i < len(v) else "(none)" for v in values}) > 1)
                shown = [f"rank {r}: {len(v)} parameters, #{at} {v[at] if at < len(v) else '(none)'}"
                         for r, v in enumerate(values)]
            else:
                shown = [f"rank {r}: {v!r}" for r, v in enumerate(values)]
            raise ValueError(f"the ranks built their accumulators with different {name} ({'; '.join(shown)}): every "
                             "rank must build the same model, optimizer and options (a difference makes the "
                             "collectives disagree or the ranks train apart)")


class BackwardStart(NamedTuple):
    """What ``Reduction.begin_backward`` returns to the engine. armed: the reducer is armed now (the hooks launch each
    bucket's collective as it completes). used: the hooks' written flags of the window's micro-batches so far, which
    the engine's window keeps (``gaengine.window.Window.mark_used``) because the hooks restart them now
    (``zero_stage=2``'s staging), or None: the hooks keep them for the whole window."""

    armed: bool
    used: list[bool] | None = None


class Reduction:
    """The reduction of the window's gradient sums over the ranks and the window's norm, one per layout of a
    sharding strategy (``gaengine.sharding``; ``ShardingStrategy.reduction``), the engine's one way to the reducer.

    This class is the replicated schedule: the window's last micro-batch all-reduces ``main_grad``'s buckets as they
    complete (torch DDP's), and every rank then holds the whole reduced gradient, so the norm is this rank's own
    (``gaengine.norm.window_norm`` over ``accumulation.chunks``, or the hooks' free norm on one rank). ZeRO's
    (``gaengine.zero.ShardedReduction``, ``StagedReduction``) and FSDP2's (``gaengine.fsdp2``) override what differs.

    reducer: the ``BucketReducer`` of ``main_grad``'s buckets, or None (one rank, or a model that reduces its
    gradients itself). accumulation: the layout and its hooks (``gaengine.accumulation.Accumulation``). backend: the
    kernel backend (``l2norm_sq``). group: the process group. world_size: its ranks.
    """

    # The norm's sum over the ranks (``gaengine.norm.window_norm``'s ``over_ranks``): None where every rank holds the
    # whole reduced gradient; a method where each holds a shard (``gaengine.zero.ShardedReduction.over_ranks``).
    over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Every micro-batch's backward reduces (zero_stage=2, FSDP2): each opens a header (gaengine.protocol.MICRO_BATCH).
    reduces_every_micro_batch = False

    def __init__(self, reducer: BucketReducer | None, accumulation, backend, group: dist.ProcessGroup | None,
                 world_size: int) -> None:
        self.reducer = reducer
        self.accumulation = accumulation
        self.backend = backend
        self.group = group
        self.world_size = world_size

    # ------------------------------------------------------------------ micro-batches
    def begin_backward(self, first: bool, last: bool, overlap: bool) -> BackwardStart:
        """Before a micro-batch's backward (``first``/``last``: the window's first/last micro-batch); ``overlap``:
        reductions may launch during backward (``overlap_grad_reduce``). The first window (the layout and each
        parameter's arrivals per backward are being learned) reduces after backward: a bucket whose parameter
        arrives twice (reentrant checkpointing) must not start early."""
        armed = self.reducer is not None and last and overlap and not self.accumulation.learning
        if armed:
            self.reducer.begin()
        return BackwardStart(armed)

    def end_backward(self, armed: bool, last: bool) -> bool:
        """After a backward that did not raise. Returns True when the window's last reductions must be launched
        now, with the stats all-reduce (several ranks, the window's last micro-batch): the engine then calls
        ``launch_window_stats``."""
        if self.reducer is None or not last:
            return False
        if not armed:
            self.reducer.begin()
        return True

    def launch_window_stats(self, window, extra: torch.Tensor | None) -> WindowStats:
        """End of the window's last backward on several ranks (or ``step(force=True)`` after ``end_partial_window``):
        launch the remaining reductions and the stats all-reduce (``launch_window_stats``: the loss sum, the items,
        each rank's micro-batch count, ``extra`` terms such as the noise scale's), returned (the engine keeps it in
        ``window.stats``; ``window`` is a ``gaengine.window.Window``, read only). The slices this rank never wrote are
        zeroed and count as written (the all-reduce fills them)."""
        if window.failed and self.reducer is not None and not self.reducer.armed and not any(
                b.work is not None for b in self.reducer.buckets):  # acc.zero_grad() of a window whose reductions
            self.reducer.begin()  # began on this rank (gaengine.protocol): every bucket, then the stats
        return launch_window_stats(self.reducer, self.accumulation.main_grad, self._locally_unused(window),
                                   window.loss_sum, window.items(), self.group, extra=extra,
                                   count=DROPPED_COUNT if window.failed else window.num_micro_batches,
                                   settings=window.settings)

    def _locally_unused(self, window) -> list[int]:
        """Layout indices of the parameters this rank wrote no gradient for in ``window``."""
        return [i for i, used in enumerate(window.used_with(self.accumulation.written)) if not used]

    def end_partial_window(self, missing: int) -> None:
        """``step(force=True)`` on several ranks, a window ``missing`` micro-batches short of K: arm the reducer for
        the launch of the window's reductions (the engine launches them with the stats next)."""
        self.reducer.begin()

    def wait(self) -> None:
        """Complete the window's reductions (on CUDA: a stream wait, no host sync)."""
        if self.reducer is not None:
            self.reducer.wait()

    def drain(self) -> None:
        """Drop the window (``acc.zero_grad()``): wait (errors ignored) for every reduction in flight."""
        if self.reducer is not None:
            self.reducer.drain()

    def complete_for_state(self) -> None:
        """Before a state dict reads the window's sums: the reductions that write into them mid-window complete
        (``zero_stage=2``); nothing here (mid-window nothing is in flight)."""

    # ------------------------------------------------------------------ step
    def zero_unused(self, unwritten: list[int]) -> None:
        """Zero the gradient of the parameters no micro-batch of the window reached (layout indices)."""
        for i in unwritten:
            self.accumulation.main_grad.flat_views[i].zero_()

    def norm(self, grad_denom: torch.Tensor, max_grad_norm: float | None) -> WindowNorm:
        """The window's ``WindowNorm``, global over the ranks, on the device: ``gaengine.norm.window_norm`` over
        this rank's ``accumulation.chunks`` (the hooks' free norm where they took it), summed over the ranks by
        ``over_ranks`` where each holds a shard."""
        return window_norm(self.accumulation.chunks, grad_denom, max_grad_norm, self.backend,
                           free=self.accumulation.free_norm(), over_ranks=self.over_ranks)
