"""The hooks stage: each gradient goes into the flat fp32 main_grad as autograd makes it.

One interface, ``Hooks``, and one implementation, built by ``make_hooks``: ``gaengine.hot_path.NativeHooks``, C++
post-hooks on each parameter's AccumulateGrad node (``csrc/hot_path.cpp``), no Python per parameter, for every
backend: the ``cpu`` and ``cuda`` bucket kernels are ``gaengine._C``'s ops, the ``torch`` and ``triton`` ones
registered as kernels of an op of the same schema (``Backend.hot_path_namespace``). Over FSDP2's shards the same hot
path's core, with no hooks of its own, takes the shards FSDP2's hooks hand it (``gaengine.fsdp2.NativeShardHooks``).
``gaengine._C`` is required: an install without it raises at construction, saying how to build it. (The tests hold a
second, independent implementation in Python as their oracle: ``tests/oracle_hooks.py``.)

``measure_sources``: every accumulate launch then also writes the partial sums of squares of its sources (the
gradients autograd made in this micro-batch), kept per micro-batch until ``window_source_sumsq()`` finishes them
(the per-micro-batch norms of the gradient noise scale).

The hooks own the per-parameter, per-micro-batch state of the accumulator, and are its only owner: the
``accumulated`` flags of the window, the first-arrival order while the layout is learned, the arrivals per backward
learned per parameter, bucket readiness (counted once, in the hooks: the reducer is told once per complete
bucket), the held gradients, the free-norm partials of the last micro-batch and the source partials of the
window's micro-batches (finished by the backend's ``finish_norm_partials``). The engine reaches that state only
through ``Hooks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from gaengine.bucket import Bucket
from gaengine.buffer import FlatBuffer
from gaengine.hot_path import NativeHooks, load_native

if TYPE_CHECKING:  # annotations only: the reducer sits above the hooks, which call it once per complete bucket
    from gaengine.reduce import BucketReducer

__all__ = ["Hooks", "NativeHooks", "check_native_hooks", "make_hooks", "native_hooks_problem"]


@runtime_checkable
class Hooks(Protocol):
    """The accumulator's per-parameter hooks over ``params`` (layout order: index i is main_grad's slice i).

    A gradient that arrives again in the same micro-batch (reentrant checkpointing of a shared layer) is added to
    what that micro-batch holds or wrote for the parameter. Raises from autograd (``RuntimeError``) for a gradient
    outside ``acc.backward()`` and (``ValueError``) for a sparse one, dropping that gradient; ``end()`` raises
    ``RuntimeError`` when a gradient arrived more often than learned after its bucket's all-reduce started.
    """

    native: bool  # per-parameter work in C++ (no Python per parameter)
    sources_reduced_by: float | None  # f: the sources are the micro-batch summed over the ranks / f; None: own
    params: list[torch.Tensor]
    num_buckets: int

    def begin(self, last: bool, want_norm: bool, armed: bool) -> None:
        """Start of one micro-batch's autograd call. want_norm: write the free-norm partials (the window's last
        micro-batch on one rank). armed: tell the reducer of each bucket completed in it (last, several ranks)."""

    def end(self) -> None:
        """Autograd returned: launch the buckets left incomplete (parameters that got no gradient)."""

    def abort(self) -> None:
        """Autograd raised: drop what is held (the engine marks the window failed)."""

    @property
    def accumulated(self) -> list[bool]:
        """A copy: ``accumulated[i]``, parameter i's slice of the destination holds a gradient sum, so its next
        gradient is added to it (else written over it). The destination is main_grad for the whole window, or, where
        a bucket is staged per micro-batch (``acquire``: ZeRO stage 2), that micro-batch's staging buffer: then the
        flags restart every micro-batch, and which parameters the window reached is the window's to keep
        (``gaengine.window.Window.used``)."""

    def set_all_accumulated(self, values: list[bool]) -> None: ...

    @property
    def arrival(self) -> list[int] | None:
        """First-arrival order (layout indices) while the layout is learned, else None."""

    def set_arrival(self, order: list[int] | None) -> None: ...

    def stop_learning(self) -> None: ...

    def restart_learning(self) -> None: ...

    @property
    def expected_arrivals(self) -> list[int]:
        """Per parameter: gradient arrivals per backward, learned (>= 1)."""

    def set_expected_arrivals(self, values: list[int]) -> None: ...

    def take_stale(self) -> bool:
        """Whether a hook fired outside ``acc.backward()`` since the last call (the flag is cleared)."""

    def free_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum_sq, found_inf)`` of the whole buffer, 0-d fp32 on its device, when the last micro-batch's
        accumulate covered every parameter; else None (``step()`` then reads the buffer once)."""

    def window_source_sumsq(self) -> torch.Tensor | None:
        """(k,) fp32 on main_grad's device: row j = this rank's sum over parameters of |source|^2 of the j-th
        micro-batch of the window (source = the gradient autograd produced for a parameter in that backward,
        arrivals of one backward combined into one source, loss-scaled as produced, before any normalization).
        Finished from the partials written by the accumulate launches with one reduction at this call (called once
        per window by step()); None when measure_sources is False. A row is NaN when that micro-batch's norm is
        inexact: a later arrival launched on its own after its bucket had launched (double arrival). A
        non-finite source gives an inf or NaN row. Cleared by reset_window()/drop()."""

    def reset_window(self) -> None:
        """A new window: nothing written, no source partials."""

    def drop(self) -> None:
        """``zero_grad()``: forget gradients held for incomplete buckets and the window's source partials."""

    @property
    def launches(self) -> int:
        """Kernel-launching calls of the accumulate path since construction."""

    def close(self) -> None:
        """Remove the hooks (idempotent)."""


def native_hooks_problem(backend) -> str | None:
    """Why the hooks cannot run for ``backend`` (``gaengine._C`` does not load, or lacks the backend's kernels), or
    None when they can."""
    _, why = load_native(backend)
    return why or backend.kernels_problem()


def check_native_hooks(backend) -> None:
    """``RuntimeError`` naming why the hooks cannot run for ``backend`` and how to go on; nothing when they can."""
    why = native_hooks_problem(backend)
    if why is not None:
        raise RuntimeError(
            f"gaengine's per-parameter hooks (gaengine._C, csrc/hot_path.cpp) cannot run for backend "
            f"{backend.name!r}: {why}. gaengine._C is built by the install: reinstall with a C++ compiler and torch "
            "present (pip install --no-build-isolation -e .), and run `gaengine info` to see what loads")


def make_hooks(params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
               reducer: BucketReducer | None, measure_sources: bool = False, acquire=None,
               fusion: bool = False) -> Hooks:
    """The accumulator's hooks over ``params`` (layout order): ``NativeHooks`` (the module docstring).

    acquire: None, or ``acquire(b)`` -> bucket b's destination per micro-batch (ZeRO stage 2's staging ring,
    ``gaengine.zero.ShardReducer.acquire``; ``HotPath.set_acquire``).
    fusion: gradient accumulation fusion (``gaengine.fusion``): the hooks take the fused Linears' gradients
    (``HotPath.set_fusion``).

    Raises ``RuntimeError`` when the hooks cannot run (``check_native_hooks``).
    """
    check_native_hooks(backend)
    return NativeHooks(params, main_grad, backend, buckets, reducer, measure_sources, acquire=acquire, fusion=fusion)
