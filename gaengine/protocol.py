"""gaengine's collectives on several ranks as one protocol: each phase opens with one header all-reduce.

A process group pairs collectives by their order on each rank, whatever they are. A rank that leaves the sequence
(catches an error mid-window, calls ``acc.zero_grad()`` and goes on; builds a new accumulator while the others are in
a window) makes its next collective meet another kind on the other ranks: with gloo an all-reduce meeting one of
another size aborts the process (``EnforceNotMet``, SIGABRT), one of the same size would mix unrelated values.

So every phase of gaengine's collectives on several ranks opens with a header all-reduce of one fixed size,
``header_numel(W)`` fp64 values, whatever the phase:

* ``CONSTRUCTION``: the accumulator's construction (``gaengine.construction.join_ranks``), before the settings'
  ``all_gather_object`` (``gaengine.reduce.check_ranks_agree``) and the parameters' broadcast;
* ``WINDOW_START``: a window's first ``backward()``, carrying the parameter-change check's values
  (``gaengine.ownership.RankMembership``: the header is that all-reduce, no collective of its own);
* ``REDUCTIONS``: the window's reductions, before the backward of its last micro-batch (``step(force=True)``: before
  a partial window's), which launches the bucket all-reduces and the stats all-reduce;
* ``MICRO_BATCH``: where every micro-batch reduces (``zero_stage=2``'s reduce-scatters, FSDP2's own), before the
  backward of each micro-batch between the window's first and its last (``RankProtocol.before_backward``), so that
  a rank that dropped the window after a micro-batch meets a header, never another rank's reduce-scatter;
* ``CHECKPOINT``: a checkpoint's agreement (``gather_objects``: ``acc.state_dict()`` mid-window, the export of a
  sharded optimizer's state, ``gaengine.checkpoint``), before its ``all_gather_object`` and the collectives after it;
* ``LAYOUT``: the end of a ``step()`` whose window learned the gradient arrival order (the first window, and the
  first after parameters join or leave), before the broadcast of the first rank's order
  (``Replicated._relearn_layout``, ``gaengine.buffer.learned_order``).

In the header each rank writes its own slot (the phase and the window: the updates so far, ``update_index``) and
zeros elsewhere, so the sum gives every rank every rank's slot exactly. Every header meets a header of the same size
(no abort): where the slots differ every rank raises ``ProtocolError`` (a ``RuntimeError``) naming each rank's phase
and window, before anything of the phase is launched. A rank that drops a window after its reductions began
(``zero_grad()`` after its last micro-batch's backward raised) completes them first, the stats all-reduce marking
its count as dropped (``DROPPED_COUNT``), so the other ranks' bucket and stats all-reduces are matched and their
``step()`` raises gaengine's count error naming it. A rank that dies: every wait of gaengine's
(``gaengine.reduce.wait_for``) turns the process group's error (a closed connection, or its timeout:
``init_process_group(timeout=...)``) into gaengine's ``RuntimeError`` saying which collective.

Host reads: on CPU tensors the header is read when it completes (a host read of a CPU tensor: no device to wait
for). On CUDA it is copied to host memory behind the device's queue (``gaengine.reduce.HostMailbox``) and read by
``step()``: no host wait per window, the mismatch reported at ``step()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gaengine.reduce import DROPPED_COUNT, Collective, HostMailbox, collective_failed, group_device, wait_for

__all__ = ["ANY_WINDOW", "CHECKPOINT", "CONSTRUCTION", "DROPPED_COUNT", "LAYOUT", "MICRO_BATCH", "PHASES",
           "REDUCTIONS", "WINDOW_START", "gather_objects",
           "ProtocolError", "RankProtocol", "header_numel", "open_phase", "payload_numel"]

CONSTRUCTION, WINDOW_START, REDUCTIONS, LAYOUT, MICRO_BATCH, CHECKPOINT = 1, 2, 3, 4, 5, 6
PHASES = {CONSTRUCTION: "building its GradientAccumulator (the construction agreement)",
          WINDOW_START: "a window's first acc.backward() (the parameter-change all-reduce)",
          REDUCTIONS: "a window's reductions (the last micro-batch's bucket and stats all-reduces)",
          LAYOUT: "the end of a step() whose window learned the layout (the layout's broadcast)",
          MICRO_BATCH: "a micro-batch's reductions inside a window (zero_stage=2's or FSDP2's reduce-scatters)",
          CHECKPOINT: "a checkpoint (acc.state_dict() mid-window, or full_optimizer_state_dict)"}
ANY_WINDOW = -1  # a header's window where the phase does not know it (LAYOUT): not compared
_SLOT = 2  # per rank: its phase, its window (update_index)


def payload_numel(world_size: int) -> int:
    """The values a header carries after the ranks' slots: the parameter-change check's (8 agreement terms of the
    trainable parameters' fingerprint, then 4 per rank: ``gaengine.ownership.RankMembership``), zeros elsewhere."""
    return 8 + 4 * world_size


def header_numel(world_size: int) -> int:
    """The fixed size of every header all-reduce on ``world_size`` ranks (fp64 values)."""
    return _SLOT * world_size + payload_numel(world_size)


class ProtocolError(RuntimeError):
    """The ranks opened different phases of gaengine's collectives (``gaengine.protocol``)."""


def _differ(slots: list[tuple[int, int]], rank: int) -> bool:
    """Whether the ranks' ``(phase, window)`` slots differ (a window of ``ANY_WINDOW`` matches any)."""
    phase, window = slots[rank]
    return any(p != phase or (w != window and ANY_WINDOW not in (w, window)) for p, w in slots)


def _message(slots: list[tuple[int, int]], rank: int) -> str:
    def where(phase: int, window: int) -> str:
        return PHASES.get(phase, f"no gaengine collective (phase code {phase})") + (
            "" if window == ANY_WINDOW else f", after {window} updates")

    windows = {w for _, w in slots if w != ANY_WINDOW}
    apart = (" The ranks have applied different numbers of updates, so their parameters differ now: load the same "
             "checkpoint on every rank (acc.zero_grad() alone does not bring them together)." if len(windows) > 1
             else "")

    shown = "; ".join(f"rank {r}: {where(*s)}" for r, s in enumerate(slots[:16])) + ("; ..." if len(slots) > 16 else "")
    return (f"gaengine: the ranks are at different collectives of gaengine's ({shown}; this is rank {rank}). A rank "
            "dropped a window that the others went on with (acc.zero_grad() after an error, on that rank only), "
            "built a new accumulator while the others were in a window, or called acc.backward()/acc.step() a "
            "different number of times. Nothing of this phase was launched and this call changed nothing (the "
            "window as it was). Every rank must drop a window together: call acc.zero_grad() on every rank (or "
            f"build the accumulators again on every rank) and go on together.{apart}")


def read_header_slots(slots: torch.Tensor) -> list[float]:
    """The ranks' header slots, ``(_SLOT * world_size,)`` fp64 on the CPU, as floats: host memory the all-reduce
    just wrote (its wait already blocked the host), so reading it is no device sync (STYLE 7's written reason; the
    tests' host-read guard allows this one read of a CPU tensor). On CUDA the slots are never read here
    (``RankProtocol`` reads them at ``step()`` from a host mailbox)."""
    if slots.device.type != "cpu":
        raise ValueError(f"read_header_slots reads CPU slots only, got a tensor on {slots.device}")
    return slots.tolist()


def open_phase(phase: int, window: int, world_size: int, rank: int, device: torch.device, group,
               payload: torch.Tensor | None = None, what: str | None = None) -> tuple[torch.Tensor, list]:
    """Launch and wait for one header all-reduce (``header_numel(world_size)`` fp64 on ``device``): this rank's
    ``phase`` and ``window`` in its slot, then ``payload`` (``(payload_numel(world_size),)`` fp64, or zeros); ``what``
    names it in the error of a failed wait. Returns ``(data, slots)``: the summed header on ``device`` and, on CPU,
    every rank's ``(phase, window)`` (on CUDA ``[]``: ``RankProtocol`` reads the slots at ``step()``). Raises
    ``ProtocolError`` on CPU when the slots differ, ``RuntimeError`` (``wait_for``) when a peer died or the group's
    timeout passed."""
    host = torch.zeros(header_numel(world_size), dtype=torch.float64)
    host[_SLOT * rank] = float(phase)
    host[_SLOT * rank + 1] = float(window)
    data = host.to(device, non_blocking=True)
    if payload is not None:
        data[_SLOT * world_size:] = payload
    work = Collective(dist.all_reduce, data, group=group)
    wait_for(work, what or f"header all-reduce of {PHASES[phase]}")
    slots: list = []
    if data.device.type == "cpu":
        values = read_header_slots(data[:_SLOT * world_size])
        slots = [(int(values[_SLOT * r]), int(values[_SLOT * r + 1])) for r in range(world_size)]
        if _differ(slots, rank):
            raise ProtocolError(_message(slots, rank))
    return data, slots


def gather_objects(obj, window: int, group, what: str) -> list:
    """``dist.all_gather_object`` of ``obj`` (picklable) as a phase of its own (``CHECKPOINT``): its header first,
    then the gather. Returns every rank's object, in group rank order. ``window``: the accumulator's updates so far
    (compared: a rank saving after another number of updates is out of step). Raises ``ProtocolError`` on every
    rank when a rank is at another of gaengine's collectives (nothing gathered; on CUDA the header's slots are read
    after its wait, one copy to host: the gather that follows is a host sync anyway), ``RuntimeError`` naming
    ``what`` when a peer died or the group's timeout passed (never gloo's or NCCL's own error)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    data, slots = open_phase(CHECKPOINT, window, world_size, rank, group_device(group), group,
                             what=f"header all-reduce of {what}")
    if data.device.type != "cpu":
        values = read_header_slots(data[:_SLOT * world_size].cpu())
        slots = [(int(values[_SLOT * r]), int(values[_SLOT * r + 1])) for r in range(world_size)]
        if _differ(slots, rank):
            raise ProtocolError(_message(slots, rank))
    gathered: list = [None] * world_size
    try:
        dist.all_gather_object(gathered, obj, group=group)
    except Exception as exc:
        raise RuntimeError(collective_failed(f"all_gather_object of {what}")) from exc
    return gathered


class RankProtocol:
    """One accumulator's headers on several ranks (module docstring): ``open`` at a window's first backward and
    before its reductions; on CUDA the last header's slots wait in host memory for ``take`` (``step()``).

    world_size, rank, device, group: the ranks'.
    """

    def __init__(self, world_size: int, rank: int, device: torch.device, group) -> None:
        self.world_size, self.rank, self.device, self.group = world_size, rank, device, group
        self.reducing = False  # this rank opened the window's reductions and has not launched its stats all-reduce
        # CUDA: each phase's last header slots, copied to host memory behind the device's queue, read by take().
        self._mailboxes = {phase: HostMailbox(_SLOT * world_size, torch.float64, device)
                           for phase in (WINDOW_START, REDUCTIONS, MICRO_BATCH)} if device.type != "cpu" else {}
        self._posted: set[int] = set()

    def open(self, phase: int, window: int, payload: torch.Tensor | None = None) -> torch.Tensor:
        """Open ``phase`` (``WINDOW_START`` or ``REDUCTIONS``) of window ``window`` (``open_phase``); returns the
        summed payload (on the device). ``ProtocolError`` (CPU) when the ranks differ: nothing launched, nothing
        changed; ``RuntimeError`` when a peer died or the group's timeout passed."""
        data, _ = open_phase(phase, window, self.world_size, self.rank, self.device, self.group, payload)
        if self._mailboxes:
            self._mailboxes[phase].post(data[:_SLOT * self.world_size])
            self._posted.add(phase)
        self.reducing = phase == REDUCTIONS
        return data[_SLOT * self.world_size:]

    def before_backward(self, window: int, index: int, last: bool, every: bool) -> None:
        """Before the backward of micro-batch ``index`` (0-based) of window ``window`` (the updates so far): its
        last (``last``) opens ``REDUCTIONS``; one between the first and the last opens ``MICRO_BATCH`` where every
        micro-batch reduces (``every``: ``Reduction.reduces_every_micro_batch``); the first opened ``WINDOW_START``
        already (``gaengine.ownership.RankMembership.check``). ``ProtocolError`` / ``RuntimeError`` as ``open``."""
        if last:
            self.open(REDUCTIONS, window)
        elif every and index > 0:
            self.open(MICRO_BATCH, window)

    def take(self) -> ProtocolError | None:
        """``step()`` on CUDA: the error of a header of this window whose ranks differed (read from host memory),
        else None. On CPU a header raised at once: None."""
        for phase in sorted(self._posted):
            values = self._mailboxes[phase].read()
            slots = [(int(values[_SLOT * r]), int(values[_SLOT * r + 1])) for r in range(self.world_size)]
            if _differ(slots, self.rank):
                self._posted.clear()
                return ProtocolError(_message(slots, self.rank))
        self._posted.clear()
        return None
