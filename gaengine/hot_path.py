"""``NativeHooks``: ``gaengine._C.HotPath`` (``csrc/hot_path.cpp``) behind ``gaengine.hooks.Hooks``.

``csrc/hot_path.cpp`` builds two objects over one core: ``HotPathCore`` owns main_grad's slots, the window's counts,
the held gradients and the bucket launches, and takes each gradient handed to ``arrive(i, grad)``; ``HotPath`` is
that core fed by C++ hooks on the AccumulateGrad nodes, with gradient accumulation fusion (which needs those hooks).
``NativeHooks`` builds ``hot_path_class``: ``HotPath``; FSDP2's ``gaengine.fsdp2.NativeShardHooks`` builds the core
and hands it each shard.

No Python runs per parameter per micro-batch. ``HotPath`` registers a C++ post-hook on each parameter's
AccumulateGrad node (the nodes are kept alive, as torch DDP's Reducer keeps them) that takes ``p.grad`` at once,
holds it until every parameter of its bucket has arrived as often as learned, and then accumulates the whole
bucket into the flat fp32 ``main_grad`` with one launch (micro-batch 0 of a window writes, later ones add). In
the window's last micro-batch it also writes the free-norm partials (one rank) and, on several ranks, calls back
into Python once per complete bucket to start that bucket's all-reduce (``BucketReducer.bucket_ready``). Python
is otherwise entered once per ``acc.backward()`` (``begin`` / ``end``) and once per ``acc.step()``.

Each bucket launch is one call of the ``torch.library`` op ``accumulate_bucket_`` in the backend's
``hot_path_namespace``, made from C++ through the dispatcher: for ``cpu`` and ``cuda`` the extension's own ops
(``torch.ops.gaengine``; ``main_grad``'s device picks the kernel: CPU, one parallel region per bucket,
``csrc/cpu_ops.cpp``; CUDA, one multi-tensor kernel per bucket on the current stream, ``csrc/cuda/``, when
``gaengine._C`` was built against a CUDA torch); for ``torch`` and ``triton`` the backend's own
``accumulate_bucket_``, registered as the kernel of an op of the same schema (``gaengine.contract.
register_bucket_kernel``: one Python call per bucket, with the GIL). The partials
tables (free norm, sources) have the backend's layout (``Backend.new_bucket_partials`` of all parameters:
``(P, 2)`` fp64 rows on ``cpu`` and ``torch``, ``(2, n_chunks)`` fp32 columns on ``cuda`` and ``triton``), each
launch writing its bucket's slice; the backend finishes them (``finish_norm_partials``).

With ``measure_sources``, every launch also writes the partials of its sources' own squares (the per-micro-batch
norms of the gradient noise scale, issue 17) into one table per micro-batch, kept until the window's
``window_source_sumsq()``: no extra launch per micro-batch, no Python per parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gaengine import bucket as _bucket
from gaengine.backends import load_extension
from gaengine.bucket import Bucket
from gaengine.buffer import FlatBuffer

if TYPE_CHECKING:  # annotations only: the reducer sits above the hooks, which call it once per complete bucket
    from gaengine.reduce import BucketReducer

__all__ = ["NativeHooks"]


def load_native(backend=None):
    """The compiled module whose ``HotPath`` runs ``backend``'s hooks (``backend.extension()``;
    ``gaengine._C`` when no backend is given), or the reason it cannot be used, as a string: ``(module, None)`` or
    ``(None, why)``. A module built from other sources is refused when it is loaded (``load_extension``)."""
    return backend.extension() if backend is not None else load_extension()


class NativeHooks:
    """``gaengine.hooks.Hooks`` over ``gaengine._C.HotPath`` (see ``Hooks`` for the methods).

    params: the trainable parameters in layout order. main_grad: the flat fp32 buffer. backend: the backend whose
    ``accumulate_bucket_`` the launches call (``Backend.hot_path_namespace``). buckets: the
    layout's buckets (contiguous runs of parameters). reducer: a multi-rank run's ``BucketReducer`` (called once per
    complete bucket of an armed micro-batch), or None. measure_sources: write the per-micro-batch source partials
    (``window_source_sumsq``). acquire: None, or ``acquire(b)`` -> bucket b's destination per micro-batch
    (``HotPath.set_acquire``; main_grad may then be on ``meta``). fusion: the backward of
    ``torch.ops.gaengine.fused_linear`` writes these parameters' gradients into main_grad (``gaengine.fusion``;
    ``HotPath.set_fusion``, undone by ``close()``). Raises ``RuntimeError`` with the reason when ``gaengine._C``
    cannot run the hooks.
    """

    #: The ``gaengine._C`` class built over the parameters: ``HotPath`` (C++ hooks on their AccumulateGrad nodes).
    hot_path_class = "HotPath"
    native = True
    sources_reduced_by: float | None = None  # this rank's own micro-batch (FSDP2's hooks: its divide factor)

    def __init__(self, params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
                 reducer: BucketReducer | None, measure_sources: bool = False, acquire=None,
                 fusion: bool = False) -> None:
        _C, why = load_native(backend)
        if _C is None:
            raise RuntimeError(why)
        self.backend = backend
        self.params = list(params)
        # acquire (ZeRO stage 2's staging ring, gaengine.zero.ShardReducer.acquire): main_grad may be layout only.
        self._device = self.params[0].device if acquire is not None else main_grad.data.device
        bucket_of = [b.index for b in buckets for _ in range(b.first, b.last)]
        callback = reducer.bucket_ready if reducer is not None else None
        # The backend's partials layout, on the meta device (shapes only): the table of all parameters, and each
        # parameter's extent along partials_dim (a launch's table is a slice of the whole one).
        numels = [p.numel() for p in self.params]
        dim = backend.partials_dim
        whole = backend.new_bucket_partials(numels, "meta")
        extents = [backend.new_bucket_partials([n], "meta").shape[dim] for n in numels]
        self._hot = getattr(_C, self.hot_path_class)(self.params, main_grad.data, list(main_grad.layout.offsets),
                                                     bucket_of, whole, dim, extents, callback,
                                                     backend.hot_path_namespace(_C))
        self._hot.set_arrival([])
        if acquire is not None:
            self._hot.set_acquire(acquire, [b.start for b in buckets])
        self._hot.set_measure_sources(bool(measure_sources))
        if fusion:
            self._hot.set_fusion(True)
        self._fused = [bool(fusion)] * len(self.params)
        self.measure_sources = bool(measure_sources)
        self.num_buckets = len(buckets)

    def set_fused(self, which: list[bool]) -> None:
        """Gradient accumulation fusion per parameter: ``which[i]`` False unregisters parameter i, whose
        ``fused_linear`` gradient then goes through autograd (its hooks, then this HotPath's AccumulateGrad hook) as
        unfused; True registers it again (``HotPath.set_fused``, called only when ``which`` changed). Takes effect at
        the next backward; ``ValueError`` for a length other than the parameters'."""
        which = [bool(w) for w in which]
        if which != self._fused:
            self._hot.set_fused(which)
            self._fused = which

    def begin(self, last: bool, want_norm: bool, armed: bool) -> None:
        self._hot.begin(want_norm, armed)

    def end(self) -> None:
        self._hot.end()

    def abort(self) -> None:
        self._hot.abort()

    @property
    def accumulated(self) -> list[bool]:
        return self._hot.written()

    def set_all_accumulated(self, values: list[bool]) -> None:
        if len(values) != len(self.params):
            raise ValueError(f"accumulated has {len(values)} entries for {len(self.params)} parameters")
        self._hot.set_all_written([bool(v) for v in values])

    @property
    def arrival(self) -> list[int] | None:
        return self._hot.arrival()

    def set_arrival(self, order: list[int] | None) -> None:
        self._hot.set_arrival(None if order is None else [int(i) for i in order])

    def stop_learning(self) -> None:
        self._hot.set_arrival(None)

    def restart_learning(self) -> None:
        self._hot.set_arrival([])

    def take_stale(self) -> bool:
        return self._hot.take_stale()

    @property
    def expected_arrivals(self) -> list[int]:
        return self._hot.expected_arrivals()

    def set_expected_arrivals(self, values: list[int]) -> None:
        if len(values) != len(self.params) or any(int(v) < 1 for v in values):
            raise ValueError(f"expected_arrivals must hold {len(self.params)} ints >= 1, got {values!r}")
        self._hot.set_expected_arrivals([int(v) for v in values])

    def free_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        partials = self._hot.norm_partials()
        return None if partials is None else self.backend.finish_norm_partials(partials)

    def window_source_sumsq(self) -> torch.Tensor | None:
        """``(k,)`` fp32 on main_grad's device: row j the sum over parameters of |source|^2 of the window's j-th
        micro-batch, NaN where that micro-batch's sources were not measured exactly (a later arrival launched on
        its own after its bucket, or a backward that raised); None when not measuring (see ``gaengine.hooks.Hooks``).
        One reduction of the micro-batches' tables, here; nothing per micro-batch."""
        if not self.measure_sources:
            return None
        tables, inexact = self._hot.source_partials()
        return _bucket.window_source_sumsq(self.backend, tables, inexact, device=self._device)

    def reset_window(self) -> None:
        """A new window: the written flags and the source partials are cleared (the free-norm partials are re-made
        by the last ``begin``)."""
        self._hot.set_all_written([False] * len(self.params))
        self._hot.clear_sources()

    def drop(self) -> None:
        self._hot.abort()
        self._hot.clear_sources()

    def close(self) -> None:
        self._hot.close()

    @property
    def launches(self) -> int:
        return self._hot.launches()
