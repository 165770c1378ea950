"""The accumulation: one layout's parameters, the window's fp32 sums they accumulate into, and the hooks that write.

A sharding strategy (``gaengine.sharding``) lays the trainable parameters out and builds, per layout, one
``Accumulation``: the parameters in layout order, ``main_grad`` (the ``gaengine.buffer.FlatBuffer`` of the window's
gradient sums), this rank's views of those sums (what its update, norm and checkpoint read) and the per-parameter
hooks (``gaengine.hooks``) that add each micro-batch's gradients into them. It is the engine's one way to the hooks:
the micro-batch's start, end and failure, the parameters the window reached, the stale-``.grad`` flag, the noise
scale's source norms and the hooks' part of a state dict. The reduction of the sums over the ranks and the window's
norm are the strategy's ``reduction`` (``gaengine.reduce.Reduction``), the update its ``update``
(``gaengine.sharding.Update``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gaengine.buffer import FlatBuffer
from gaengine.hooks import Hooks

__all__ = ["Accumulation"]


class Accumulation:
    """One layout of the window's gradient sums and the hooks writing them (module docstring); built by the sharding
    strategy with every layout (``ShardingStrategy._lay_out``), never by the engine.

    params: the trainable parameters in layout order (index i: ``main_grad``'s slice i, the hooks' index i).
    main_grad: the ``(layout.total_numel,)`` fp32 ``FlatBuffer`` of the window's sums (on ``meta`` where they live
        in the rank's gradient shard: ``zero_stage=2``). hooks: the per-parameter hooks over it. world_size: the
        ranks of the process group. measure_sources: the hooks measure each micro-batch's gradient norm (the noise
        scale).
    shard_grads: per parameter, the fp32 view of the window's sum over the range this rank updates, shaped like
        its piece of the store (default ``main_grad.views``: every rank updates every parameter whole).
    chunks: the contiguous fp32 tensors holding this rank's ``shard_grads`` (scaled in place by the update, read by
        the norm; default ``[main_grad.data]``).
    grad_views: per parameter, the 1-D fp32 gradient this rank holds for it (default ``main_grad.flat_views``).
    """

    def __init__(self, params: list[torch.Tensor], main_grad: FlatBuffer, hooks: Hooks, world_size: int,
                 measure_sources: bool, shard_grads: Sequence[torch.Tensor] | None = None,
                 chunks: list[torch.Tensor] | None = None, grad_views: list[torch.Tensor] | None = None) -> None:
        self.params = params
        self.main_grad = main_grad
        self.hooks = hooks
        self.world_size = world_size
        self.measure_sources = measure_sources
        self.shard_grads = main_grad.views if shard_grads is None else shard_grads
        self.chunks = [main_grad.data] if chunks is None else chunks
        self.grad_views = main_grad.flat_views if grad_views is None else grad_views

    # ------------------------------------------------------------------ one micro-batch
    def take_stale(self) -> bool:
        """Whether a hook fired outside ``acc.backward()`` since the last call (``Hooks.take_stale``: the flag is
        cleared); the engine then clears the ``.grad`` autograd left."""
        return self.hooks.take_stale()

    def clear_grads(self) -> None:
        """Drop the ``.grad`` left on the parameters (what ``step()`` without an optimizer, ``begin_step()`` or autograd
        outside ``acc.backward()`` left there), and the hooks' stale flag with it."""
        for p in self.params:
            p.grad = None
        self.hooks.take_stale()

    def finite_by_param(self, named_params: list[tuple[str, torch.Tensor]]) -> list[tuple[str, bool]]:
        """Per parameter (layout order): its name (from ``named_params``, else ``param[i]``) and whether its window
        gradient is finite (host reads: the error of ``max_consecutive_skips``)."""
        names = {id(p): n for n, p in named_params}
        return [(names.get(id(p), f"param[{i}]"), bool(torch.isfinite(g).all()))
                for i, (p, g) in enumerate(zip(self.params, self.grad_views))]

    def set_fused(self, which: list[bool]) -> None:
        """Gradient accumulation fusion per parameter (layout order): ``which[i]`` False gives parameter i its
        ordinary gradient from ``fused_linear``'s backward (``NativeHooks.set_fused``; ``gaengine.fusion``)."""
        self.hooks.set_fused(which)

    def begin(self, last: bool, armed: bool) -> None:
        """Right before a micro-batch's autograd call (``last``: the window's last micro-batch; ``armed``: the
        reduction's ``begin_backward`` armed the reducer): the hooks start the micro-batch (``Hooks.begin``),
        writing the free-norm partials on the last micro-batch of one rank."""
        self.hooks.begin(last, want_norm=last and self.world_size == 1, armed=armed)

    def end(self) -> None:
        """Autograd returned: the hooks launch the buckets left incomplete (``Hooks.end``; ``RuntimeError`` when a
        gradient arrived more often than learned after its bucket's reduction started)."""
        self.hooks.end()

    def abort(self) -> None:
        """A micro-batch's backward (or its counting) raised: the hooks drop what they hold (``Hooks.abort``)."""
        self.hooks.abort()

    # ------------------------------------------------------------------ the window
    @property
    def written(self) -> list[bool]:
        """Per parameter (layout order): a gradient reached it since the hooks' flags last restarted (a copy)."""
        return self.hooks.accumulated

    @property
    def learning(self) -> bool:
        """The hooks are learning the gradient arrival order (the first window, and the first after an adopt or a
        ``drop``): such a window reduces after backward, as a parameter may arrive more than once."""
        return self.hooks.arrival is not None

    def restart_written(self) -> None:
        """Every parameter's next write overwrites its slice (``zero_stage=2``'s staging, per micro-batch)."""
        self.hooks.set_all_accumulated([False] * len(self.params))

    def unwritten(self, window) -> list[int]:
        """Layout indices of the parameters no gradient reached in ``window`` (a ``gaengine.window.Window``) on any
        rank (``Window.unwritten`` with the hooks' written flags)."""
        return window.unwritten(self.hooks.accumulated, self.world_size)

    def free_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum_sq, found_inf)`` of ``main_grad`` from the last micro-batch's accumulate (one rank), or None."""
        return self.hooks.free_norm()

    def reset_window(self) -> None:
        """After ``step()``: nothing written, no source partials (``Hooks.reset_window``)."""
        self.hooks.reset_window()

    def drop(self) -> None:
        """Drop the window (``acc.zero_grad()``, after the reductions in flight): the hooks drop what they hold and
        reset their window, and learn the arrival order again from a complete window where they were learning it."""
        self.hooks.drop()
        self.hooks.reset_window()
        if self.learning:
            self.hooks.restart_learning()

    # ------------------------------------------------------------------ the noise scale
    def source_norms(self) -> torch.Tensor | None:
        """``(k,)`` fp32: the hooks' source norms of the window's micro-batches since the last reset
        (``Hooks.window_source_sumsq``: one reduction, once per window and per checkpoint), or None without
        ``measure_sources``."""
        return self.hooks.window_source_sumsq()

    def sources_reduced_by(self) -> float | None:
        """The factor f the hooks' sources are reduced by (they are this rank's shard of the micro-batch's gradient
        summed over the ranks divided by f: FSDP2's ``NativeShardHooks.sources_reduced_by``), or None: this rank's own
        micro-batch (``gaengine.noise.WindowNoise.terms``)."""
        return self.hooks.sources_reduced_by

    # ------------------------------------------------------------------ state dict
    def state(self) -> dict[str, Any]:
        """The hooks' part of ``gaengine.stages.StageStates.state_items``: ``arrival`` (the first-arrival order while
        the layout is learned, else None), ``written`` (per parameter, layout order: its slice holds a sum) and
        ``expected_arrivals`` (per parameter: arrivals per backward, learned)."""
        return {"arrival": self.hooks.arrival, "written": self.hooks.accumulated,
                "expected_arrivals": self.hooks.expected_arrivals}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()``'s part of ``state`` (checked before, ``StageStates.check_state_items``); with
        ``measure_sources`` the hooks' window is reset first (no source norms of their own: a resumed window's
        are the noise scale's). ``expected_arrivals`` is absent from states saved before it was learned."""
        if self.measure_sources:
            self.hooks.reset_window()
        self.hooks.set_arrival(state["arrival"])
        self.hooks.set_all_accumulated(list(state["written"]))
        if "expected_arrivals" in state:
            self.hooks.set_expected_arrivals(list(state["expected_arrivals"]))
