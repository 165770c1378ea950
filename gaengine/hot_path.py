"""``NativeHooks``: ``gaengine._C.HotPath`` (``csrc/hot_path.cpp``) behind ``gaengine.hooks.Hooks``.

No Python runs per parameter per micro-batch. ``HotPath`` registers a C++ post-hook on each parameter's
AccumulateGrad node (the nodes are kept alive, as torch DDP's Reducer keeps them) that takes ``p.grad`` at once,
holds it until every parameter of its bucket has arrived as often as learned, and then accumulates the whole
bucket into the flat fp32 ``main_grad`` with one launch (micro-batch 0 of a window writes, later ones add). In
the window's last micro-batch it also writes the free-norm partials (one rank) and, on several ranks, calls back
into Python once per complete bucket to start that bucket's all-reduce (``BucketReducer.bucket_ready``). Python
is otherwise entered once per ``acc.backward()`` (``begin`` / ``end``) and once per ``acc.step()``.

Kernels, by the backend's ``hot_path_kernels`` (``gaengine.backends``):

* ``cpu``: CPU tensors, one parallel region per bucket (``accumulate_bucket_cpu`` in ``csrc/cpu_ops.cpp``);
  partials are per-parameter fp64 ``(P, 2)`` rows, bitwise equal to the Python path's ``accumulate_sumsq_``.
* ``cuda``: CUDA tensors, one multi-tensor kernel per bucket on the current stream (``csrc/cuda/``), when
  ``gaengine._C`` was built against a CUDA torch; partials are per-chunk ``(2, n_chunks)`` fp32.
* ``aten`` (the ``torch`` backend): any device, one ATen ``copy_`` / ``add_`` per gradient issued from C++ (no
  free norm).

The backend finishes the partials (``finish_norm_partials``).
"""

from __future__ import annotations

import torch

from gaengine.backends import _load_cuda_kernels
from gaengine.bucket import Bucket
from gaengine.buffer import FlatBuffer
from gaengine.reduce import BucketReducer

__all__ = ["NativeHooks"]


def load_native():
    """``gaengine._C`` if it loads and has ``HotPath``; else the reason it cannot be used, as a string."""
    try:
        from gaengine import _C  # noqa: PLC0415 - lazy: ``import gaengine`` does not load the extension
    except ImportError as exc:
        return None, f"gaengine._C is not built ({exc})"
    if not hasattr(_C, "HotPath"):
        return None, "gaengine._C predates HotPath: rebuild it with pip install --no-build-isolation -e ."
    return _C, None


class NativeHooks:
    """``gaengine.hooks.Hooks`` over ``gaengine._C.HotPath`` (see ``Hooks`` for the methods).

    params: the trainable parameters in layout order. main_grad: the flat fp32 buffer. backend: a backend with
    ``hot_path_kernels`` ("cpu" | "cuda" | "aten"). buckets: the layout's buckets (contiguous runs of parameters).
    reducer: a multi-rank run's ``BucketReducer`` (called once per complete bucket of an armed micro-batch), or
    None. Raises ``RuntimeError`` with the reason when ``gaengine._C`` cannot run the hooks.
    """

    native = True

    def __init__(self, params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
                 reducer: BucketReducer | None) -> None:
        _C, why = load_native()
        if _C is None:
            raise RuntimeError(why)
        kernels = backend.hot_path_kernels
        if kernels == "cuda":
            _C = _load_cuda_kernels()  # the cuda backend's extension: gaengine._C (or the tests' emulated build)
        self.backend = backend
        self.params = list(params)
        self.kernels = kernels
        bucket_of = [b.index for b in buckets for _ in range(b.first, b.last)]
        callback = reducer.bucket_ready if reducer is not None else None
        self._hot = _C.HotPath(self.params, main_grad.data, list(main_grad.layout.offsets), bucket_of, kernels,
                               callback)
        self._hot.set_arrival([])
        self.num_buckets = len(buckets)

    def begin(self, last: bool, want_norm: bool, armed: bool) -> None:
        self._hot.begin(want_norm, armed)

    def end(self) -> None:
        self._hot.end()

    def abort(self) -> None:
        self._hot.abort()

    @property
    def written(self) -> list[bool]:
        return self._hot.written()

    def set_written(self, index: int, value: bool) -> None:
        self._hot.set_written(index, value)

    def set_all_written(self, values: list[bool]) -> None:
        if len(values) != len(self.params):
            raise ValueError(f"written has {len(values)} entries for {len(self.params)} parameters")
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

    def reset_window(self) -> None:
        """A new window: the written flags are cleared (the partials are re-made by the last ``begin``)."""
        self._hot.set_all_written([False] * len(self.params))

    def drop(self) -> None:
        self._hot.abort()

    def close(self) -> None:
        self._hot.close()

    @property
    def launches(self) -> int:
        return self._hot.launches()
