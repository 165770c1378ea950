"""The test oracle of the per-parameter hooks: ``gaengine.hooks.Hooks`` written in Python.

gaengine ships one hook implementation, the C++ hot path (``csrc/hot_path.cpp``, ``gaengine.hot_path.NativeHooks``;
``gaengine.fsdp2.NativeShardHooks`` over FSDP2's shards). This module writes the same contract a second time,
independently, in plain Python: one ``register_post_accumulate_grad_hook`` per parameter, gradients held until
their bucket is complete, one ``backend.accumulate_bucket_`` per bucket. Tests run both and compare them, and run
the whole suite's hook-parametrized cases on each (``use_hooks``: the ``hot_path`` value "python" selects this
oracle, "native" the library's hooks).

Selecting the oracle replaces ``gaengine.hooks.make_hooks`` and ``gaengine.fsdp2.make_shard_hooks`` wherever a
gaengine module holds them (``install``), in this process and, through ``GAENGINE_TEST_HOOKS=python`` in the
environment, in every rank ``tests/ranks.py`` spawns (``install_from_environment``, run by the rank launcher).

Contract (as the native hooks'): grad ``param.shape`` fp32 | bf16 | fp16, dense, read once and released at once
(``param.grad = None``). main_grad: ``(layout.total_numel,)`` fp32 on the parameters' device; the first write of a
window to a parameter overwrites its view (no zeroing pass), later ones add. A bucket is complete when each of
its parameters has arrived as often as learned (``expected_arrivals``), which launches it and, in an armed
micro-batch, tells the reducer (``bucket_ready``, once per bucket). A parameter whose gradient arrives again in
the same micro-batch (reentrant checkpointing of a shared layer) is combined with what is held for it
(``combine_arrival``). Raises ``RuntimeError`` (from the hook, through autograd) when a gradient arrives outside
``acc.backward()``, ``ValueError`` for a sparse gradient (both drop that gradient), and ``RuntimeError`` from
``end()`` when a gradient arrived more often than learned after its bucket's all-reduce started.

Free norm (single rank): in the window's last micro-batch each launch also writes the partial sums of squares and
non-finite flags of the values it wrote into its slice of one whole-buffer table (``backend.new_bucket_partials``);
when every bucket was complete, ``free_norm()`` finishes it (``backend.finish_norm_partials``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref

import torch

from gaengine.bucket import Bucket, window_source_sumsq
from gaengine.buffer import FlatBuffer
from gaengine.fsdp2 import _local_shard
from gaengine.reduce import BucketReducer

__all__ = ["BucketAccumulation", "PythonHooks", "ShardHooks", "combine_arrival", "hooks_selected", "install",
           "install_from_environment", "uninstall", "use_hooks"]

ENV = "GAENGINE_TEST_HOOKS"
"""Set to "python" by ``use_hooks``; the rank launcher (``tests/ranks.py``) then installs the oracle in each rank."""

HOT_PATHS = ("native", "python")


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


class PythonHooks:
    """``gaengine.hooks.Hooks`` in Python, for ``params`` (layout order) over one ``main_grad`` buffer.

    params: the trainable parameters in layout order (index i is main_grad's slice i). backend: the
    accumulate backend (``gaengine.backends``). buckets: the layout's buckets (contiguous runs of parameters).
    reducer: the ``BucketReducer`` of a multi-rank run, or None. measure_sources: the accumulate launches also
    write the per-micro-batch source partials (``window_source_sumsq``). acquire: None, or ``acquire(b)`` -> bucket
    b's destination for the micro-batch (``BucketAccumulation``; ZeRO stage 2's staging ring):
    main_grad is then only read for its layout and may live on ``meta``.
    """

    native = False  # per-parameter work runs in Python (one hook call per parameter)
    sources_reduced_by: float | None = None  # this rank's own micro-batch (ShardHooks: FSDP2's divide factor)

    def __init__(self, params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
                 reducer: BucketReducer | None, measure_sources: bool = False, acquire=None) -> None:
        self.params = list(params)
        self.main_grad = main_grad
        self.backend = backend
        self.reducer = reducer
        self.num_buckets = len(buckets)
        self._bucket_of = [b.index for b in buckets for _ in range(b.first, b.last)]
        self._bucket_params = [range(b.first, b.last) for b in buckets]
        # One launch per complete bucket (the same buckets the reducer uses), on every backend.
        self.measure_sources = bool(measure_sources)
        self.device = self.params[0].device if acquire is not None and self.params else main_grad.data.device
        self._accumulation = BucketAccumulation(main_grad, buckets, backend, self.measure_sources, acquire,
                                                self.device)
        self._written = [False] * len(self.params)
        self._arrivals = [0] * len(self.params)  # hook calls per parameter in this micro-batch
        self.expected_arrivals = [1] * len(self.params)  # hook calls per backward, learned (>= 1)
        self._pending = [0] * len(buckets)  # per bucket: arrivals still expected in this micro-batch
        self._arrival: list[int] | None = []  # first-arrival order of the first window, then None
        self._late: list[str] = []  # arrivals too late to be reduced (armed micro-batch), raised by end()
        self._in_backward = False
        self._armed = False
        self._stale = False
        self._handles = []
        ref = weakref.ref(self)
        for i, p in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(ref, i)))

    @staticmethod
    def _make_hook(ref: weakref.ref, i: int):
        def hook(param: torch.Tensor) -> None:
            hooks = ref()
            if hooks is not None:
                hooks._accumulate(i, param)

        return hook

    # ------------------------------------------------------------------ hot path
    def _accumulate(self, i: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if not self._in_backward:
            # Nothing is accumulated; gradients autograd already left on other parameters are dropped at
            # the next acc.backward(), so the window stays intact.
            param.grad = None
            self._stale = True
            raise RuntimeError(
                "a gradient reached a parameter managed by GradientAccumulator outside acc.backward(); "
                "call acc.backward(loss) instead of loss.backward() (or acc.close() to detach the accumulator)"
            )
        if grad.layout != torch.strided:
            param.grad = None
            raise ValueError(
                f"parameter {i} (shape {tuple(param.shape)}) received a {grad.layout} gradient; gaengine "
                "accumulates dense gradients only (build embeddings with sparse=False)"
            )
        param.grad = None  # the parameter lets go of its low-precision gradient at once
        b = self._bucket_of[i]
        count = self._arrivals[i] = self._arrivals[i] + 1
        counts = count <= self.expected_arrivals[i]  # toward its bucket's readiness
        if not counts:
            self.expected_arrivals[i] = count  # later micro-batches wait for this many arrivals
            if self._armed and self._pending[b] == 0:
                # Too late to be reduced. Backward goes on so that every such parameter is learned; end() raises.
                self._late.append(f"parameter {i} (shape {tuple(param.shape)}) received its gradient {count} times "
                                  "in one backward")
                return
        overwrite = count == 1 and not self._written[i]
        if overwrite:
            self._written[i] = True
            if self._arrival is not None:
                self._arrival.append(i)
        self._accumulation.hold(i, grad, overwrite)  # a later arrival is combined with the held one
        if self._pending[b] == 0:
            self._accumulation.launch(b)  # its bucket was launched already: this arrival goes on its own
        if counts:
            self._pending[b] -= 1
            if self._pending[b] == 0:  # every parameter of bucket b has arrived as often as expected
                self._accumulation.launch(b)
                if self._armed:
                    self.reducer.bucket_ready(b)  # starts its all-reduce, in bucket order

    # ------------------------------------------------------------------ one backward
    def begin(self, last: bool, want_norm: bool, armed: bool) -> None:
        """Start of ``acc.backward()``'s autograd call.

        last: the window's last micro-batch. want_norm: collect the free norm (last micro-batch, one rank).
        armed: this micro-batch launches bucket all-reduces (the reducer was armed with ``begin()``). Only
        this flag arms the hooks: a reducer left armed by a failed last micro-batch launches nothing later.
        """
        self._armed = armed and self.reducer is not None
        self._arrivals = [0] * len(self.params)
        self._pending = [sum(self.expected_arrivals[j] for j in r) for r in self._bucket_params]
        self._late = []
        self._accumulation.begin(want_norm)
        self._in_backward = True

    def end(self) -> None:
        """Autograd returned normally: launch the buckets left incomplete; raise for late arrivals."""
        try:
            if self._late:
                more = f" (and {len(self._late) - 1} more late arrival(s))" if len(self._late) > 1 else ""
                raise RuntimeError(
                    f"{self._late[0]}{more} (a layer shared by reentrant-checkpointed segments, or a graph that "
                    "changed) after its bucket's all-reduce had started, so the window cannot be reduced exactly. The "
                    "accumulator has learned the new counts: call acc.zero_grad() and run the window again")
            self._accumulation.flush()  # buckets left incomplete (parameters that got no gradient)
        finally:
            self._in_backward = False

    def abort(self) -> None:
        """Autograd raised: the micro-batch is partly accumulated (the engine marks the window failed)."""
        self._in_backward = False
        self.drop()

    # ------------------------------------------------------------------ window state
    @property
    def accumulated(self) -> list[bool]:
        """A copy: ``accumulated[i]``, parameter i's slice of the destination holds a gradient sum (``Hooks``)."""
        return list(self._written)

    def set_all_accumulated(self, values: list[bool]) -> None:
        if len(values) != len(self.params):
            raise ValueError(f"accumulated has {len(values)} entries for {len(self.params)} parameters")
        self._written = [bool(v) for v in values]

    @property
    def arrival(self) -> list[int] | None:
        """A copy of the first-arrival order (layout indices) while learning the layout, else None."""
        return None if self._arrival is None else list(self._arrival)

    def set_arrival(self, order: list[int] | None) -> None:
        """Restore a saved ``arrival`` (``load_state_dict``); None stops learning."""
        self._arrival = None if order is None else list(order)

    def stop_learning(self) -> None:
        self._arrival = None

    def restart_learning(self) -> None:
        self._arrival = []

    def set_expected_arrivals(self, values: list[int]) -> None:
        """Restore learned arrivals per backward (a new layout, ``load_state_dict``)."""
        if len(values) != len(self.params) or any(int(v) < 1 for v in values):
            raise ValueError(f"expected_arrivals must hold {len(self.params)} ints >= 1, got {values!r}")
        self.expected_arrivals = [int(v) for v in values]

    def take_stale(self) -> bool:
        """Whether a hook fired outside ``acc.backward()`` since the last call (the flag is cleared)."""
        stale, self._stale = self._stale, False
        return stale

    def free_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum_sq, found_inf)`` of the whole buffer, 0-d fp32 on its device, when the last micro-batch's
        accumulate covered every parameter; else None (``step()`` then reads the buffer once)."""
        partials = self._accumulation.norm_partials()
        return None if partials is None else self.backend.finish_norm_partials(partials)

    def window_source_sumsq(self) -> torch.Tensor | None:
        """``(k,)`` fp32 on main_grad's device: this rank's sum of squares of the gradients autograd produced in each
        of the window's ``k`` micro-batches (see ``gaengine.hooks.Hooks``), NaN for a micro-batch a later arrival made
        inexact; None unless ``measure_sources``. One reduction of the partials the accumulate launches wrote."""
        if not self.measure_sources:
            return None
        tables, inexact, extras = self._accumulation.source_tables()
        return window_source_sumsq(self.backend, tables, inexact, self.device, extras)

    def reset_window(self) -> None:
        """A new window: nothing written, no source partials."""
        self._written = [False] * len(self.params)
        self._accumulation.clear_sources()

    def drop(self) -> None:
        """``zero_grad()``, a failed backward: forget gradients held for incomplete buckets and the source partials."""
        self._accumulation.drop()

    @property
    def launches(self) -> int:
        """Kernel-launching calls of the accumulate path since construction (one per bucket launch)."""
        return self._accumulation.launches

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class _LocalGrad:
    """What ``PythonHooks`` reads of a parameter: the local shard of its reduced gradient as ``grad``, the local
    shape for its messages."""

    __slots__ = ("grad", "shape")

    def __init__(self, grad: torch.Tensor, shape: torch.Size) -> None:
        self.grad = grad
        self.shape = shape


class ShardHooks(PythonHooks):
    """``PythonHooks`` over FSDP2's sharded parameters (``params``: DTensors, layout order).

    FSDP2 calls each hook itself after it assigned or added the reduce-scattered shard to ``p.grad`` (a DTensor
    whose local tensor is this rank's ``(local shape)`` shard, in the sharded parameter's dtype); the hook takes
    ``p.grad.to_local()``, sets ``p.grad = None`` (FSDP2 assigns afresh at the next micro-batch), and accumulates
    the local shard exactly as the Python hooks accumulate a whole gradient: one launch per complete bucket (an
    FSDP2 parameter group) into ``main_grad``'s local-shard layout. There is no reducer (FSDP2 reduces)."""

    def __init__(self, params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
                 measure_sources: bool = False, divide_factor=lambda: 1.0) -> None:
        super().__init__(params, main_grad, backend, buckets, None, measure_sources)
        self._divide_factor = divide_factor

    @property
    def sources_reduced_by(self) -> float:
        """f: what the hooks accumulate (and measure, ``measure_sources``) is this rank's shard of each micro-batch's
        gradient summed over the ranks and divided by f, FSDP2's divide factor (``gaengine.noise.WindowNoise``
        takes the global micro-batch as the small batch)."""
        return self._divide_factor()

    def _accumulate(self, i: int, param: torch.Tensor) -> None:
        local = _local_shard(param)
        if local is not None:
            super()._accumulate(i, _LocalGrad(local, local.shape))


# ---------------------------------------------------------------------------------------------- selecting the oracle
def _oracle_make_hooks(params, main_grad, backend, buckets, reducer, measure_sources=False, acquire=None,
                       fusion=False):
    """``gaengine.hooks.make_hooks``'s signature, building ``PythonHooks`` (which take no fused gradients)."""
    if fusion:
        raise RuntimeError("gradient_accumulation_fusion needs the native hooks; the Python oracle takes none")
    return PythonHooks(params, main_grad, backend, buckets, reducer, measure_sources, acquire)


def _oracle_make_shard_hooks(params, main_grad, backend, buckets, measure_sources=False, divide_factor=lambda: 1.0):
    """``gaengine.fsdp2.make_shard_hooks``'s signature, building ``ShardHooks``."""
    return ShardHooks(params, main_grad, backend, buckets, measure_sources, divide_factor)


def _replacements():
    import gaengine.fsdp2  # noqa: PLC0415 - the library's factories, wherever a gaengine module holds them
    import gaengine.hooks  # noqa: PLC0415

    return {gaengine.hooks.make_hooks: _oracle_make_hooks, gaengine.fsdp2.make_shard_hooks: _oracle_make_shard_hooks}


def install(setattr_=setattr) -> list[tuple[object, str, object]]:
    """Make every loaded gaengine module (and test module) build the oracle's hooks: each module attribute that is one
    of the library's hook factories is replaced (``setattr_(module, name, oracle)``: ``monkeypatch.setattr`` to undo it at the test's
    end). Returns what was replaced, ``(module, name, original)``, for ``uninstall``; ``AssertionError`` when fewer
    than the two factories were found (the library's factories moved)."""
    replaced = []
    for original, oracle in _replacements().items():
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] not in ("gaengine", "tests") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr_(module, attr, oracle)
                    replaced.append((module, attr, original))
    assert len(replaced) >= 2, "no hook factory of gaengine found to replace (tests/oracle_hooks.py install)"
    return replaced


def uninstall(replaced: list[tuple[object, str, object]]) -> None:
    """Undo ``install``."""
    for module, attr, original in replaced:
        setattr(module, attr, original)


@contextlib.contextmanager
def hooks_selected(hot_path: str):
    """Inside a rank that runs several cases: ``hot_path``'s hooks ("native" or "python") for the block."""
    assert hot_path in HOT_PATHS, f"hot_path must be one of {HOT_PATHS}, got {hot_path!r}"
    replaced = install() if hot_path == "python" else []
    try:
        yield
    finally:
        uninstall(replaced)


def use_hooks(monkeypatch, hot_path: str) -> None:
    """Run this test on ``hot_path``'s hooks: "native" (the library's, the default) or "python" (this oracle), here
    and in the ranks it spawns (``GAENGINE_TEST_HOOKS``); undone at the test's end by ``monkeypatch``."""
    assert hot_path in HOT_PATHS, f"hot_path must be one of {HOT_PATHS}, got {hot_path!r}"
    if hot_path == "python":
        monkeypatch.setenv(ENV, "python")
        install(monkeypatch.setattr)
    else:
        monkeypatch.delenv(ENV, raising=False)


def install_from_environment() -> None:
    """In a spawned rank: install the oracle when the test that spawned it selected it (``use_hooks``)."""
    if os.environ.get(ENV) == "python":
        install()

