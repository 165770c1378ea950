"""Per-parameter post-accumulate hooks: each gradient goes into the flat fp32 main_grad as autograd makes it.

``PythonHooks`` registers one ``register_post_accumulate_grad_hook`` per parameter (after autograd's
AccumulateGrad has summed every use of the parameter in this backward) and owns all per-parameter,
per-micro-batch state of the accumulator; the engine reaches that state only through its methods, so a
native implementation with the same interface can take its place.

grad: ``param.shape`` fp32 | bf16 | fp16, dense, read once and released at once (``param.grad = None``).
main_grad: ``(layout.total_numel,)`` fp32 on the parameters' device; the first write of a window to a
parameter overwrites its view (no zeroing pass), later ones add. Backends: ``triton`` holds gradients until
their bucket is complete and accumulates a whole bucket per launch (``gaengine.bucket.BucketAccumulation``);
the others make one ``accumulate_`` call per parameter. Free norm (last micro-batch, one rank): the Triton
launches write per-block partials, the ``cpu`` backend per-parameter fp64 ``(P, 2)`` sums of squares and
non-finite counts, so ``step()`` needs no pass over the buffer when every parameter got a gradient.

In the window's last micro-batch on several ranks, every parameter whose gradient is final is reported to
the ``BucketReducer`` (``mark_ready``), which launches each bucket's all-reduce once all of its parameters
are final, while backward goes on.

A hook may fire more than once per parameter in one backward (a layer shared by segments under reentrant
activation checkpointing: each segment's backward is its own autograd pass). A later arrival is added to what
the micro-batch already wrote or holds for that parameter, and counts toward readiness only up to the number of
arrivals per backward learned for it (``expected_arrivals``, as torch DDP's ``static_graph`` learns it): a bucket
is complete once each of its parameters has arrived that often.

Raises ``RuntimeError`` (from the hook, through autograd) when a gradient arrives outside
``acc.backward()``, or arrives more often than learned after its bucket's all-reduce started, and
``ValueError`` for a sparse gradient; all drop the offending gradient.
"""

from __future__ import annotations

import weakref

import torch

from gaengine.bucket import Bucket, BucketAccumulation
from gaengine.buffer import FlatBuffer
from gaengine.reduce import BucketReducer

__all__ = ["PythonHooks"]


class PythonHooks:
    """Hooks and per-parameter state for ``params`` (layout order) over one ``main_grad`` buffer.

    params: the trainable parameters in layout order (index i is main_grad's slice i). backend: the
    accumulate backend (``gaengine.backends``). buckets: the layout's buckets (Triton: one launch each).
    reducer: the ``BucketReducer`` of a multi-rank run, or None.

    State, per window: ``written[i]`` (parameter i was written this window: the next write adds),
    ``arrival`` (layout indices in first-arrival order while the layout is being learned, else None), and
    the stale flag (a hook fired outside ``acc.backward()``: other parameters may hold ``.grad``).
    ``launches``: kernel-launching calls of the accumulate path since construction; ``num_buckets``: buckets
    of the layout.
    """

    native = False  # per-parameter work runs in Python (one hook call per parameter)

    def __init__(self, params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
                 reducer: BucketReducer | None) -> None:
        self.params = list(params)
        self.main_grad = main_grad
        self.backend = backend
        self.reducer = reducer
        self.num_buckets = len(buckets)
        # The Triton backend accumulates a whole bucket per launch (the same buckets the reducer uses).
        self.bucket_accumulation = BucketAccumulation(main_grad, buckets) if backend.name == "triton" else None
        self._written = [False] * len(self.params)
        self._arrivals = [0] * len(self.params)  # hook calls per parameter in this micro-batch
        self.expected_arrivals = [1] * len(self.params)  # hook calls per backward, learned (>= 1)
        self._arrival: list[int] | None = []  # first-arrival order of the first window, then None
        self._late: list[str] = []
        self._in_backward = False
        self._armed = False
        self._stale = False
        self._norm_partials: torch.Tensor | None = None  # (P, 2) fp64 sums of squares / flags, CPU free norm
        self._norm_arrivals = 0
        self._launches = 0
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
        count = self._arrivals[i] = self._arrivals[i] + 1
        counts = count <= self.expected_arrivals[i]  # toward its bucket's readiness
        if not counts:
            self.expected_arrivals[i] = count  # later micro-batches wait for this many arrivals
            if self._armed and self.reducer.launched(i):
                # Too late to be reduced. Backward goes on so that every such parameter is learned; end() raises.
                self._late.append(f"parameter {i} (shape {tuple(param.shape)}) received its gradient {count} times "
                                  "in one backward")
                return
        overwrite = count == 1 and not self._written[i]
        if overwrite:
            self._written[i] = True
            if self._arrival is not None:
                self._arrival.append(i)
        if self.bucket_accumulation is not None:
            done = self.bucket_accumulation.add(i, grad, overwrite, counts)  # held until its bucket is full
        else:
            # Each arrival goes in at once: a later one adds to what the earlier one wrote.
            if self._norm_partials is not None:  # last micro-batch, one rank: the norm comes with the pass
                self.backend.accumulate_sumsq_(self.main_grad.flat_views[i], grad, 1.0, overwrite,
                                               self._norm_partials, i)  # row i: the values written last
                self._norm_arrivals += count == 1
            else:
                self.backend.accumulate_(self.main_grad.flat_views[i], grad, 1.0, overwrite)
            self._launches += 1
            done = (i,) if count == self.expected_arrivals[i] and counts else ()
        self._mark_final(done)

    def _mark_final(self, indices) -> None:
        """Parameters whose window gradient is complete: in the last micro-batch this may launch buckets'
        all-reduces while backward goes on."""
        if self._armed:
            for j in indices:
                self.reducer.mark_ready(j)

    # ------------------------------------------------------------------ one backward
    def begin(self, last: bool, want_norm: bool, armed: bool) -> None:
        """Start of ``acc.backward()``'s autograd call.

        last: the window's last micro-batch. want_norm: collect the free norm (last micro-batch, one rank).
        armed: this micro-batch launches bucket all-reduces (the reducer was armed with ``begin()``). Only
        this flag arms the hooks: a reducer left armed by a failed last micro-batch launches nothing later.
        """
        self._armed = armed and self.reducer is not None
        self._arrivals = [0] * len(self.params)
        self._late: list[str] = []  # arrivals too late to be reduced (armed micro-batch), raised by end()
        if self.bucket_accumulation is not None:
            self.bucket_accumulation.begin(want_norm, self.expected_arrivals)
        elif want_norm and self.backend.name == "cpu":
            # Per-parameter sums of squares from the last micro-batch's accumulate: step() reads no buffer.
            self._norm_partials = torch.empty(len(self.params), 2, dtype=torch.float64)
            self._norm_arrivals = 0
        self._in_backward = True

    def end(self) -> None:
        """Autograd returned normally: launch the buckets left incomplete and report their params final."""
        try:
            if self._late:
                more = f" (and {len(self._late) - 1} more late arrival(s))" if len(self._late) > 1 else ""
                raise RuntimeError(
                    f"{self._late[0]}{more} (a layer shared by reentrant-checkpointed segments, or a graph that "
                    "changed) after its bucket's all-reduce had started, so the window cannot be reduced exactly. The "
                    "accumulator has learned the new counts: call acc.zero_grad() and run the window again")
            if self.bucket_accumulation is not None:
                self._mark_final(self.bucket_accumulation.flush(1.0))  # buckets left incomplete
        finally:
            self._in_backward = False

    def abort(self) -> None:
        """Autograd raised: the micro-batch is partly accumulated (the engine marks the window failed)."""
        self._in_backward = False

    # ------------------------------------------------------------------ window state
    @property
    def written(self) -> list[bool]:
        """A copy: ``written[i]``, parameter i holds a gradient of this window (the next write adds)."""
        return list(self._written)

    def set_written(self, index: int, value: bool) -> None:
        self._written[index] = value

    def set_all_written(self, values: list[bool]) -> None:
        if len(values) != len(self.params):
            raise ValueError(f"written has {len(values)} entries for {len(self.params)} parameters")
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

    def take_stale(self) -> bool:
        """Whether a hook fired outside ``acc.backward()`` since the last call (the flag is cleared)."""
        stale, self._stale = self._stale, False
        return stale

    def free_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum_sq, found_inf)`` of the whole buffer, 0-d fp32 on its device, when the last micro-batch's
        accumulate covered every parameter; else None (``step()`` then reads the buffer once)."""
        if self.bucket_accumulation is not None:
            return self.bucket_accumulation.free_norm() if all(self._written) else None
        if self._norm_partials is not None and self._norm_arrivals == len(self.params):
            # Every parameter was written in the last micro-batch: fixed-order sum of its partials.
            sums = self._norm_partials.sum(0)
            return sums[0].to(torch.float32), (sums[1] > 0).to(torch.float32)
        return None

    def reset_window(self) -> None:
        """A new window: nothing written, no free-norm partials."""
        self._norm_partials = None
        self._norm_arrivals = 0
        self._written = [False] * len(self.params)

    def drop(self) -> None:
        """``zero_grad()``: forget gradients held for incomplete buckets."""
        if self.bucket_accumulation is not None:
            self.bucket_accumulation.drop()

    def set_expected_arrivals(self, values: list[int]) -> None:
        """Restore learned arrivals per backward (a new layout, ``load_state_dict``)."""
        if len(values) != len(self.params) or any(int(v) < 1 for v in values):
            raise ValueError(f"expected_arrivals must hold {len(self.params)} ints >= 1, got {values!r}")
        self.expected_arrivals = [int(v) for v in values]

    @property
    def launches(self) -> int:
        """Kernel-launching calls of the accumulate path since construction (per bucket with Triton)."""
        if self.bucket_accumulation is not None:
            return self.bucket_accumulation.launches
        return self._launches

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
