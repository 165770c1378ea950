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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["AccumulationSchedule", "Milestones", "RampUp", "check_accumulation_steps"]


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
