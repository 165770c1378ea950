"""``PythonHooks``: the accumulator's per-parameter hooks in Python, behind ``gaengine.hooks.Hooks``.

One ``register_post_accumulate_grad_hook`` per parameter (after autograd's AccumulateGrad has summed every use
of the parameter in this autograd pass). They run where the native hooks (``gaengine.hot_path``) cannot: a
backend whose kernels launch from Python (``triton``) or an install without ``gaengine._C``.

grad: ``param.shape`` fp32 | bf16 | fp16, dense, read once and released at once (``param.grad = None``).
main_grad: ``(layout.total_numel,)`` fp32 on the parameters' device; the first write of a window to a
parameter overwrites its view (no zeroing pass), later ones add. Every backend accumulates the same way: the
gradients are held until their bucket is complete and a whole bucket is accumulated per launch
(``gaengine.bucket.BucketAccumulation``: ``backend.accumulate_bucket_``, with the free-norm partials in the
last micro-batch on one rank). Bucket readiness is counted here, once: a bucket is complete when each of its
parameters has arrived as often as learned (``expected_arrivals``), which launches it and, in an armed
micro-batch, tells the reducer (``bucket_ready``, once per bucket).

Raises ``RuntimeError`` (from the hook, through autograd) when a gradient arrives outside ``acc.backward()``,
``ValueError`` for a sparse gradient (both drop that gradient), and ``RuntimeError`` from ``end()`` when a
gradient arrived more often than learned after its bucket's all-reduce started.
"""

from __future__ import annotations

import weakref

import torch

from gaengine.bucket import Bucket, BucketAccumulation, window_source_sumsq
from gaengine.buffer import FlatBuffer
from gaengine.reduce import BucketReducer

__all__ = ["PythonHooks"]


class PythonHooks:
    """``gaengine.hooks.Hooks`` in Python, for ``params`` (layout order) over one ``main_grad`` buffer.

    params: the trainable parameters in layout order (index i is main_grad's slice i). backend: the
    accumulate backend (``gaengine.backends``). buckets: the layout's buckets (contiguous runs of parameters).
    reducer: the ``BucketReducer`` of a multi-rank run, or None. measure_sources: the accumulate launches also
    write the per-micro-batch source partials (``window_source_sumsq``). acquire: None, or ``acquire(b)`` -> bucket
    b's destination for the micro-batch (``gaengine.bucket.BucketAccumulation``; ZeRO stage 2's staging ring):
    main_grad is then only read for its layout and may live on ``meta``.
    """

    native = False  # per-parameter work runs in Python (one hook call per parameter)

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
