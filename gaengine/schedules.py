"""Accumulation schedules: the number of micro-batches K of each accumulation window, changing during training.

``GradientAccumulator(..., accumulation_steps=schedule)`` takes any callable ``schedule(update_index, items_seen)
-> K`` besides an int. It is called once at the start of every window (the first ``acc.backward()`` of the window,
and at construction): ``update_index`` is the number of windows stepped so far (applied or skipped updates),
``items_seen`` the samples those windows consumed over all ranks (``micro_batch_size`` x micro-batches x world
size; micro-batches x world size when the accumulator has no ``micro_batch_size``). Every rank computes the same K
from the same arguments, so no communication is needed. K holds for the whole window, which is normalized by the
micro-batches it really holds, so every window is the exact mean over its own effective batch.

Two ready-made schedules:

* ``RampUp``: Megatron-LM's ``--rampup-batch-size <start> <increment> <ramp-samples>`` (``RampupBatchsizeNum
  MicroBatches`` in megatron/core/num_microbatches_calculator.py): the global batch starts at ``start_batch_size``
  and grows by ``batch_size_increment`` every ``ramp_samples / ((global - start) / increment)`` samples, reaching
  ``global_batch_size`` after ``ramp_samples`` samples; K = global batch / (micro_batch_size x world size).
* ``Milestones``: Lightning's ``GradientAccumulationScheduler({epoch: K})``, keyed by updates, samples or epochs:
  from each milestone on, its K (K = 1 before the first milestone when it is not 0, as Lightning does).

And one that listens: ``Adaptive`` sets K so that the effective batch tracks the gradient noise scale the
accumulator measures (``measure_noise_scale=True``, ``gaengine.noise``). A schedule with an ``observe(result)``
method is handed every ``StepResult`` by ``step()``; one with ``state_dict()`` / ``load_state_dict()`` is saved and
restored with the accumulator's state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gaengine.utils import LR_SCALING_RULES, scale_lr

__all__ = ["AccumulationSchedule", "Adaptive", "Milestones", "RampUp", "WindowSchedule", "check_accumulation_steps"]


class AccumulationSchedule(Protocol):
    """``(update_index, items_seen) -> K``: micro-batches of the window that starts now (an int >= 1)."""

    def __call__(self, update_index: int, items_seen: int) -> int: ...


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_accumulation_steps(value: object, where: str = "accumulation_steps") -> int:
    """``value`` as K: an int >= 1; raises ``ValueError`` naming ``where`` (the argument, or the schedule)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class RampUp:
    """Megatron-LM's batch-size ramp-up as an accumulation schedule (see the module docstring).

    start_batch_size, batch_size_increment, global_batch_size: samples per update over all ranks (ints >= 1;
    ``global_batch_size - start_batch_size`` a multiple of the increment). ramp_samples: samples over which the
    batch grows (int >= 0). micro_batch_size: samples per micro-batch on one rank; world_size: ranks. Every batch
    of the ramp must be a multiple of ``micro_batch_size * world_size`` (Megatron asserts the same).
    Raises ``ValueError`` naming the field.
    """

    start_batch_size: int
    batch_size_increment: int
    ramp_samples: int
    global_batch_size: int
    micro_batch_size: int
    world_size: int = 1
    _samples_per_increment: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("start_batch_size", "batch_size_increment", "global_batch_size", "micro_batch_size",
                     "world_size"):
            _positive_int(name, getattr(self, name))
        _positive_int("ramp_samples", self.ramp_samples, minimum=0)
        diff = self.global_batch_size - self.start_batch_size
        if diff < 0 or diff % self.batch_size_increment:
            raise ValueError(
                f"global_batch_size - start_batch_size ({self.global_batch_size} - {self.start_batch_size}) must be a "
                f"multiple >= 0 of batch_size_increment ({self.batch_size_increment})")
        unit = self.micro_batch_size * self.world_size
        for b in range(self.start_batch_size, self.global_batch_size + 1, self.batch_size_increment):
            if b % unit:
                raise ValueError(f"the ramp's batch size {b} is not a multiple of micro_batch_size x world_size = "
                                 f"{self.micro_batch_size} x {self.world_size}: change start_batch_size or "
                                 "batch_size_increment")
        increments = diff // self.batch_size_increment
        object.__setattr__(self, "_samples_per_increment",
                           self.ramp_samples / increments if increments else float("inf"))

    def batch_size(self, samples: int) -> int:
        """The global batch (samples per update) after ``samples`` consumed samples."""
        if samples > self.ramp_samples:
            return self.global_batch_size
        steps = int(samples / self._samples_per_increment)
        return min(self.start_batch_size + steps * self.batch_size_increment, self.global_batch_size)

    def __call__(self, update_index: int, items_seen: int) -> int:
        return self.batch_size(items_seen) // (self.micro_batch_size * self.world_size)


@dataclass(frozen=True)
class Milestones:
    """K from milestones: ``{start: K}`` from ``start`` on (Lightning's ``GradientAccumulationScheduler``).

    milestones: a non-empty mapping of ints >= 0 to ints >= 1. unit: what the keys count: ``"update"``
    (``update_index``), ``"sample"`` (``items_seen``) or ``"epoch"`` (``items_seen // samples_per_epoch``).
    Raises ``ValueError`` naming the argument.
    """

    milestones: Mapping[int, int]
    unit: str = "update"
    samples_per_epoch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.milestones, Mapping) or not self.milestones:
            raise ValueError(f"milestones must be a non-empty mapping {{start: K}}, got {self.milestones!r}")
        for start, k in self.milestones.items():
            _positive_int("a milestone's start", start, minimum=0)
            check_accumulation_steps(k, f"the K of milestone {start}")
        if self.unit not in ("update", "sample", "epoch"):
            raise ValueError(f"unit must be 'update', 'sample' or 'epoch', got {self.unit!r}")
        if self.unit == "epoch":
            _positive_int("samples_per_epoch", self.samples_per_epoch)
        table = dict(sorted(self.milestones.items()))
        table.setdefault(0, 1)  # Lightning: K = 1 before the first milestone
        object.__setattr__(self, "milestones", dict(sorted(table.items())))

    def __call__(self, update_index: int, items_seen: int) -> int:
        if self.unit == "update":
            at = update_index
        elif self.unit == "sample":
            at = items_seen
        else:
            at = items_seen // self.samples_per_epoch
        return next(k for start, k in reversed(self.milestones.items()) if start <= at)


@dataclass(kw_only=True, eq=False)
class Adaptive:
    """K such that the effective batch tracks the measured gradient noise scale ``B_simple`` (McCandlish et al.,
    arXiv 1812.06162: the batch above which more data per update stops paying).

    Use with ``GradientAccumulator(..., accumulation_steps=Adaptive(...), measure_noise_scale=True)`` (the
    accumulator refuses it otherwise). At the start of every window K is ``round(B_simple / (world_size x
    samples per micro-batch))``, clamped to ``[k_min, k_max]``, where the samples per micro-batch are the window's
    ``num_items / (micro-batches x world_size)`` in item mode and 1 in mean mode (``B_simple`` counts micro-batches
    there); K stays as it is while no estimate exists (NaN) and changes at most once every ``every`` updates.

    No host sync: ``step()`` hands the window's result to ``observe``, which starts a non-blocking copy of
    ``B_simple`` (and the window's samples per micro-batch) into host memory (pinned on CUDA) and records a CUDA
    event. The schedule reads that copy one window later: K of window t comes from the estimate after window
    t - 2, whose copy the device has finished long before, since it was queued before the whole of window t - 1.
    Reading it waits on the copy's event only if the host runs more than a whole window ahead of the device
    (the device then still has that window queued, so it never idles); the value is the same on every rank,
    which every rank needs to agree on K.

    k_min, k_max: ints >= 1, ``k_min <= k_max``; on one rank ``k_min >= 2``: a window of one micro-batch on one rank
    has no small batch besides the big one, so nothing would be measured and K would stay at 1 for good.
    every: int >= 1, updates between two changes of K. initial: K of
    the first windows (before an estimate can be read), in ``[k_min, k_max]``; ``k_min`` by default.
    world_size: the accumulator's ranks (int >= 1).
    lr_rule: None, or ``"linear"`` / ``"sqrt"``: when K changes from K0 to K1, each param group's ``"lr"`` of
        ``optimizer`` is multiplied by ``gaengine.scale_lr(1, K0, K1, lr_rule)`` (the effective batch moves by
        K1 / K0). LR schedulers that compute from the current ``lr`` (StepLR, ExponentialLR, MultiStepLR, ...)
        keep the factor; those that recompute from their own ``base_lrs`` (LambdaLR, OneCycleLR) need it there
        too: pass them as ``lr_scheduler``.
    optimizer: the ``torch.optim.Optimizer`` whose learning rate moves (required with ``lr_rule``).
    lr_scheduler: None, or a torch LR scheduler over ``optimizer`` whose ``base_lrs`` move by the same factor.

    Raises ``ValueError`` naming the field. State (``state_dict()``): K, when it last changed, and the readings,
    so a resumed run takes the same K in every window.
    """

    k_min: int
    k_max: int
    every: int = 1
    initial: int | None = None
    world_size: int = 1
    lr_rule: str | None = None
    optimizer: Any = None
    lr_scheduler: Any = None
    needs_noise_scale = True  # GradientAccumulator refuses this schedule without measure_noise_scale=True

    def __post_init__(self) -> None:
        _positive_int("k_min", self.k_min)
        _positive_int("k_max", self.k_max)
        if self.k_min > self.k_max:
            raise ValueError(f"k_min must be <= k_max, got k_min={self.k_min} > k_max={self.k_max}")
        if self.k_min == 1 and self.world_size == 1:
            raise ValueError("k_min must be >= 2 on one rank (world_size=1): a window of one micro-batch on one rank "
                             "cannot measure the noise scale (no small batch besides the big one), so K would stay 1")
        _positive_int("every", self.every)
        _positive_int("world_size", self.world_size)
        if self.initial is None:
            self.initial = self.k_min
        _positive_int("initial", self.initial)
        if not self.k_min <= self.initial <= self.k_max:
            raise ValueError(f"initial must be in [k_min, k_max] = [{self.k_min}, {self.k_max}], got {self.initial}")
        if self.lr_rule is not None:
            if self.lr_rule not in LR_SCALING_RULES:
                raise ValueError(f"lr_rule must be None or one of {LR_SCALING_RULES}, got {self.lr_rule!r}")
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise ValueError(f"lr_rule={self.lr_rule!r} moves an optimizer's learning rate: pass "
                                 f"optimizer=<the torch.optim.Optimizer>, got {self.optimizer!r}")
        self.k = self.initial  # K of the latest window asked for
        self._asked: tuple[int, int] | None = None  # (update_index, K) of the latest call: asking again is free
        self._changed_at = 0  # update_index of the latest change of K
        self._observed = 0  # windows observed
        # Two host slots of (B_simple, samples per micro-batch), pinned where CUDA is, written by non-blocking copies
        # and read through a numpy view of the same memory.
        self._slots = torch.full((2, 2), math.nan, dtype=torch.float32, pin_memory=torch.cuda.is_available())
        self._host = self._slots.numpy()
        self._events: list = [None, None]

    def observe(self, result: Any) -> None:
        """Start the non-blocking copy of the window's ``B_simple`` (``result``: the ``StepResult``)."""
        gns = result.grad_noise_scale
        if gns is None:
            raise ValueError("Adaptive needs GradientAccumulator(..., measure_noise_scale=True)")
        micro_batches = float(result.num_micro_batches * self.world_size)
        if isinstance(result.num_items, torch.Tensor):
            per_micro_batch = result.num_items.to(gns.device, torch.float32) / micro_batches
        else:  # a fill on the device (mean mode: one sample per micro-batch), no host-to-device copy
            items = micro_batches if result.num_items is None else float(result.num_items)
            per_micro_batch = torch.full((), items / micro_batches, dtype=torch.float32, device=gns.device)
        slot = self._observed % 2
        self._slots[slot].copy_(torch.stack([gns.float(), per_micro_batch]), non_blocking=True)
        if gns.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        self._observed += 1

    def _reading(self) -> tuple[float, float] | None:
        """``(B_simple, samples per micro-batch)`` after the window before the last observed one, or None."""
        if self._observed < 2:
            return None
        slot = (self._observed - 2) % 2
        event = self._events[slot]
        if event is not None and not event.query():
            event.synchronize()  # the host runs over a window ahead: the device still has that window to run
        b, per_micro_batch = self._host[slot]  # host memory: no device read
        return float(b), float(per_micro_batch)

    def target(self, b_simple: float, per_micro_batch: float) -> int | None:
        """K whose effective batch is closest to ``b_simple``, clamped to ``[k_min, k_max]``; None when
        ``b_simple`` is not a positive finite number."""
        if not (math.isfinite(b_simple) and b_simple > 0 and math.isfinite(per_micro_batch) and per_micro_batch > 0):
            return None
        k = round(b_simple / (self.world_size * per_micro_batch))
        return min(max(k, self.k_min), self.k_max)

    def __call__(self, update_index: int, items_seen: int) -> int:
        if self._asked is not None and self._asked[0] == update_index:
            return self._asked[1]
        if update_index - self._changed_at >= self.every:
            reading = self._reading()
            k = None if reading is None else self.target(*reading)
            if k is not None and k != self.k:
                if self.lr_rule is not None:
                    factor = scale_lr(1.0, self.k, k, self.lr_rule)
                    for group in self.optimizer.param_groups:
                        if isinstance(group["lr"], torch.Tensor):
                            group["lr"].mul_(factor)
                        else:
                            group["lr"] *= factor
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.base_lrs = [lr * factor for lr in self.lr_scheduler.base_lrs]
                self.k, self._changed_at = k, update_index
        self._asked = (update_index, self.k)
        return self.k

    def state_dict(self) -> dict:
        """K, its latest change, the latest call and the readings not yet used (host floats)."""
        for event in self._events:
            if event is not None:
                event.synchronize()  # saving a checkpoint: the copies must have landed
        return {"k": self.k, "asked": self._asked, "changed_at": self._changed_at, "observed": self._observed,
                "readings": self._host.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.k, self._changed_at, self._observed = int(state["k"]), int(state["changed_at"]), int(state["observed"])
        self._asked = None if state["asked"] is None else tuple(int(v) for v in state["asked"])
        self._events = [None, None]
        self._host[:] = state["readings"]


class WindowSchedule:
    """The accumulator's K: a fixed int or a schedule, and the position the schedule is asked at.

    accumulation_steps: an int >= 1 (checked by ``gaengine.AccumulatorConfig``) or an ``AccumulationSchedule``.
    update_index: windows stepped so far; items_seen: the samples they consumed over all ranks (the schedule's
    arguments). A schedule is asked once per window, when ``k(0)`` is read with the window still empty.
    """

    def __init__(self, accumulation_steps: int | AccumulationSchedule) -> None:
        self.schedule: AccumulationSchedule | None = None
        self.update_index = 0
        self.items_seen = 0
        self._k_update = 0  # the update whose window self._k was set for
        self.set_at_run_time = False  # a fixed K set by set_k (or restored from a state where it was)
        if callable(accumulation_steps):
            self.schedule, self._k_update = accumulation_steps, -1
        else:
            self._k = accumulation_steps

    def k(self, num_micro_batches: int) -> int:
        """K of the current window, which holds ``num_micro_batches`` so far. ``ValueError`` naming the schedule
        if it answers anything but an int >= 1 (nothing changed)."""
        if self.schedule is not None and self._k_update != self.update_index and num_micro_batches == 0:
            self._k = check_accumulation_steps(
                self.schedule(self.update_index, self.items_seen),
                f"accumulation_steps schedule {self.schedule!r} at update {self.update_index} (its value)")
            self._k_update = self.update_index
        return self._k

    def set_k(self, value: object) -> None:
        """Set K from the current window on; ``ValueError`` for anything but an int >= 1 or while a schedule
        sets K (change the schedule instead)."""
        if self.schedule is not None:
            raise ValueError("accumulation_steps follows a schedule here; change the schedule instead of setting it")
        self._k = check_accumulation_steps(value)
        self.set_at_run_time = True

    def advance(self, num_micro_batches: int, world_size: int, micro_batch_size: int | None) -> None:
        """A window of ``num_micro_batches`` per rank was stepped: one update more, and its samples
        (``micro_batch_size`` x micro-batches x world size, or micro-batches x world size without it)."""
        self.update_index += 1
        self.items_seen += num_micro_batches * world_size * (micro_batch_size or 1)

    def observe(self, result) -> None:
        """An adaptive schedule (``Adaptive``) reads each window's ``StepResult``."""
        observe = getattr(self.schedule, "observe", None)
        if observe is not None:
            observe(result)

    def state_dict(self) -> dict:
        """The position, the schedule's own state, and ``accumulation_steps_set``: the fixed K as set at run time
        (``set_k``), or None (K as built, or a schedule). The window's K is saved beside it by the accumulator."""
        return {"update_index": self.update_index, "items_seen": self.items_seen,
                "schedule": getattr(self.schedule, "state_dict", lambda: None)(),
                "accumulation_steps_set": self._k if self.set_at_run_time else None}

    def resolve_load(self, state: dict, num_micro_batches: int, keep: str | None) -> int:
        """The K this accumulator goes on with after loading ``state`` (whose window holds ``num_micro_batches``
        under ``state["accumulation_steps"]``): the saved run's K as set at run time, else this accumulator's (a
        schedule's window keeps its saved K). ``keep`` (``load_state_dict(..., accumulation_steps=)``): "saved"
        takes the saved window's K, "current" this accumulator's. ``ValueError`` naming both values when the saved
        window holds micro-batches under a K other than the one it would go on with and ``keep`` is None."""
        saved_k, saved_set = int(state["accumulation_steps"]), state.get("accumulation_steps_set")
        if keep == "saved":
            return saved_k
        if self.schedule is not None:
            if keep == "current" and num_micro_batches:
                return check_accumulation_steps(self.schedule(int(state.get("update_index", 0)),
                                                              int(state.get("items_seen", 0))),
                                                f"accumulation_steps schedule {self.schedule!r} (its value)")
            return saved_k  # mid-window the window keeps the K it started with; at a boundary the schedule is asked
        k = self._k if keep == "current" or saved_set is None else int(saved_set)
        if num_micro_batches and k != saved_k and keep is None:
            raise ValueError(
                f"state was saved {num_micro_batches} micro-batch(es) into a window of accumulation_steps={saved_k}, "
                f"this accumulator has accumulation_steps={k}: the resumed window would update after {k} "
                f"micro-batches, the saved run after {saved_k}. Pass acc.load_state_dict(state, "
                f"accumulation_steps='saved') to go on with {saved_k}, or accumulation_steps='current' to complete "
                f"the window (and go on) with {k}")
        return k

    def load_state_dict(self, state: dict, k: int, mid_window: bool, set_at_run_time: bool = False) -> None:
        """Restore ``state_dict()``'s part of an accumulator state; ``k``: the K to go on with (``resolve_load``).
        Mid-window the window keeps it; at a boundary a schedule says the next one. ``set_at_run_time``: a fixed
        ``k`` counts as set at run time (saved as such by the next ``state_dict()``)."""
        self.update_index = int(state.get("update_index", 0))
        self.items_seen = int(state.get("items_seen", 0))
        if self.schedule is None:
            self._k = int(k)
            self.set_at_run_time = self.set_at_run_time or set_at_run_time
        else:
            self._k, self._k_update = int(k), (self.update_index if mid_window else -1)
        if state.get("schedule") is not None and hasattr(self.schedule, "load_state_dict"):
            self.schedule.load_state_dict(state["schedule"])
