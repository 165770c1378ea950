"""The accumulator's stages as a checkpoint sees them: each stage gives and takes its own state items.

A state dict (``GradientAccumulator.state_dict``, ``gaengine.checkpoint``) is made of the stages' own parts: the
window's counters (``gaengine.window.Window``), the schedule's position (``gaengine.schedules.WindowSchedule``), the
loss scale (``gaengine.scaler.LossScaler``) and the run of skipped windows (``ConsecutiveSkips``), the noise scale
(``gaengine.noise.WindowNoise``) and the hooks' learned layout (``gaengine.accumulation.Accumulation``, through the
strategy); the buffers, masters and optimizer state are the strategy's (``ShardingStrategy.param_slots``).
``StageStates`` gathers the first group's items into one dict of Python scalars and CPU tensors, checks a saved one
and gives each stage back its items; ``AccumulatorParts`` is everything ``gaengine.checkpoint`` reads of an
accumulator, built by the accumulator for each state call (``GradientAccumulator.state_parts``), so that
checkpointing never calls back into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gaengine import state_checks
from gaengine.formats import STATE_FORMAT
from gaengine.batchnorm import WindowBatchNorm
from gaengine.noise import WindowNoise
from gaengine.scaler import ConsecutiveSkips, LossScaler
from gaengine.schedules import AccumulationSchedule, WindowSchedule
from gaengine.window import RankCounts, Window

if TYPE_CHECKING:  # annotations only: the strategy and the lending sit above this module
    import torch.distributed as dist

    from gaengine.lending import Lending
    from gaengine.sharding import ShardingStrategy

__all__ = ["AccumulatorParts", "HasParts", "StageStates", "WindowStages"]


@dataclass
class WindowStages:
    """The window's stages, built at construction (``gaengine.construction.init_window``) for the window stage
    (``gaengine.window_end.WindowEnd``): the window's counters (``gaengine.window.Window``), K per window and the
    updates so far (``gaengine.schedules.WindowSchedule``), the counts a ``step()`` left unread (several ranks,
    ``RankCounts``), the skipped windows in a row, the loss scale (None: none, or not chosen yet:
    ``auto_loss_scale``), the noise scale and the window's BatchNorm (either None where not asked) and the lending of
    the window's gradient in ``.grad`` (``gaengine.lending.Lending``)."""

    window: Window
    schedule: WindowSchedule
    counts: RankCounts
    skips: ConsecutiveSkips
    scaler: LossScaler | None
    auto_loss_scale: bool
    noise: WindowNoise | None
    batchnorm: WindowBatchNorm | None
    lending: Lending


@dataclass
class StageStates:
    """The window's stages and their state items (module docstring): what ``state_items`` returns is the ``scalars``
    entry of every rank in a checkpoint's meta.

    window, schedule, scaler (None without loss scaling), skips, noise (None without ``measure_noise_scale``): the
    accumulator's stages. sharding: its strategy (the hooks' part, ``sharding.accumulation``, and the layout order
    of ``sharding.params``). registered_params: the trainable parameters in registration order. world_size: the
    ranks. configured_k: ``accumulation_steps`` as the accumulator was built (an int or a schedule). keep_k:
    ``load_state_dict``'s ``accumulation_steps`` (None, "saved" or "current": ``WindowSchedule.resolve_load``).
    """

    window: Window
    schedule: WindowSchedule
    scaler: LossScaler | None
    skips: ConsecutiveSkips
    noise: WindowNoise | None
    sharding: ShardingStrategy
    registered_params: list[torch.Tensor]
    world_size: int
    configured_k: int | AccumulationSchedule
    keep_k: str | None = None

    def state_items(self) -> dict[str, Any]:
        """This rank's counters and small state: the parameters' shapes and dtypes, K, the world size, the layout
        order (registration indices), the hooks', the window's, the loss scale's, the skips', the schedule's and the
        noise scale's items."""
        accumulation = self.sharding.accumulation
        reg = {id(p): i for i, p in enumerate(self.registered_params)}
        window = self.window
        return {
            "format": STATE_FORMAT,
            "param_shapes": [list(p.shape) for p in self.registered_params],
            "param_dtypes": [str(p.dtype) for p in self.registered_params],
            "accumulation_steps": self.schedule.k(window.num_micro_batches),
            "world_size": self.world_size,
            "layout_order": [reg[id(p)] for p in self.sharding.params],
            **accumulation.state(),  # arrival, written, expected_arrivals
            **window.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "consecutive_skips": self.skips.count,
            **self.schedule.state_dict(),
            "noise_scale": (None if self.noise is None else self.noise.state_dict(
                accumulation.source_norms() if window.num_micro_batches else None, window.num_micro_batches)),
        }

    def resumed_k(self, state: dict[str, Any]) -> int:
        """The K the accumulator goes on with after loading ``state`` (``WindowSchedule.resolve_load``)."""
        return self.schedule.resolve_load(state, int(state["num_micro_batches"]), self.keep_k)

    def check_state_items(self, state: dict[str, Any]) -> None:
        """The checks of ``load_state_dict`` on ``state_items()``' part (``ValueError`` naming the key, nothing
        changed): the counters' ranges, the layout's, K (``resumed_k``), the loss scaling."""
        def bad(key: str, expected: str) -> ValueError:
            return ValueError(f"state[{key!r}] must be {expected}, got {state.get(key)!r}: the state dict is corrupt "
                              "or not an acc.state_dict(); load another checkpoint")

        n_params = len(self.registered_params)
        k = state.get("accumulation_steps")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise bad("accumulation_steps", "an int >= 1")
        k_set = state.get("accumulation_steps_set")
        if k_set is not None and (isinstance(k_set, bool) or not isinstance(k_set, int) or k_set < 1):
            raise bad("accumulation_steps_set", "None or an int >= 1")
        Window.check_state(state, k, n_params)
        for key in ("update_index", "items_seen", "consecutive_skips"):
            value = state.get(key, 0 if key != "consecutive_skips" else None)  # read by load_state_items
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, "an int >= 0")
        order = state.get("layout_order")
        if not isinstance(order, (list, tuple)) or not all(type(i) is int for i in order) or (
                sorted(order) != list(range(n_params))):
            raise bad("layout_order", f"a permutation of range({n_params}) (the parameters' registration indices)")
        state_checks.check_hooks_state(state, n_params)  # written, expected_arrivals, arrival, window_used
        self.resumed_k(state)  # ValueError naming both Ks
        if "scaler" not in state or (state["scaler"] is None) != (self.scaler is None):
            raise ValueError("state['scaler'] and this accumulator disagree on loss scaling (loss_scale differs)")
        if state["scaler"] is not None:
            state_checks.check_scaler_state(state["scaler"])
        if self.noise is not None:
            self.noise.check_state(state.get("noise_scale"), int(state["num_micro_batches"]))

    def load_state_items(self, state: dict[str, Any]) -> None:
        """Give each stage back its items of ``state`` (checked by ``check_state_items``; the layout and the buffers
        are restored before). The window marks the ``.grad`` left on the parameters as the accumulator's
        (``Window.grads_left``: the next ``backward()`` clears them)."""
        self.sharding.accumulation.load_state(state)
        self.window.load_state_dict(state)
        self.skips.count = int(state["consecutive_skips"])
        k = self.resumed_k(state)
        self.schedule.load_state_dict(state, k, self.window.num_micro_batches > 0,
                                      set_at_run_time=k != self.configured_k)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.noise is not None:
            self.noise.load_state_dict(state.get("noise_scale"), self.window.num_micro_batches)
        self.window.grads_left = True


@dataclass
class AccumulatorParts:
    """Everything ``gaengine.checkpoint`` reads and writes of one accumulator (``GradientAccumulator.state_parts``).

    sharding: the strategy (the rank's slots, masters, window sums and layout). optimizer, lr_scheduler: the
    accumulator's (either may be None). registered_params: the trainable parameters in registration order;
    named_params: the module's ``(name, parameter)`` pairs (the checkpoint keys), empty for a list of parameters.
    process_group, world_size, device: the accumulator's. stages: the window's stages (``StageStates``).
    """

    sharding: ShardingStrategy
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    registered_params: list[torch.Tensor]
    named_params: list[tuple[str, torch.Tensor]]
    process_group: dist.ProcessGroup | None
    world_size: int
    device: torch.device
    stages: StageStates

    @property
    def params(self) -> list[torch.Tensor]:
        """The trainable parameters in layout order (the strategy's)."""
        return self.sharding.params

    @property
    def window(self) -> Window:
        """The accumulation window (``gaengine.window.Window``)."""
        return self.stages.window

    @property
    def schedule(self) -> WindowSchedule:
        """The window schedule (``update_index``: the updates so far, the protocol's window number)."""
        return self.stages.schedule


class HasParts(Protocol):
    """What ``gaengine.checkpoint``'s public functions (``full_optimizer_state_dict``, ``upgrade``) ask of an
    accumulator (a ``GradientAccumulator``), so that checkpointing never names the engine: its ``optimizer`` (None
    without one), its parts (``state_parts``: ``AccumulatorParts``) and its ``state_dict()``."""

    optimizer: torch.optim.Optimizer | None

    def state_parts(self, accumulation_steps: str | None = None) -> AccumulatorParts: ...

    def state_dict(self) -> dict: ...
