"""Parameters joining or leaving the accumulator after construction: the membership stage of the pipeline.

A parameter unfrozen (``requires_grad_(True)``) or added with ``optimizer.add_param_group`` joins at the next window
boundary, a frozen one leaves (gradual unfreezing; docs/accumulator.md). ``gaengine.ownership.Membership`` finds the
changes, ``RankMembership`` checks that every rank makes them alike, and ``Membership.window_term`` /
``Membership.refuse_unmanaged_grads`` are what a window's stats all-reduce compares of them and the refusal of a
``step()`` whose window a parameter joined in its middle; this module decides what the accumulator does with them at a
window's first ``backward()``: ``adopt_changes`` (the strategy lays everything out again, ``ShardingStrategy.adopt``),
and ``adopt``, which then claims and watches the new layout's parameters for the accumulator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gaengine import ownership
from gaengine.ownership import Membership, RankMembership
from gaengine.replaced import ReplacedParams
from gaengine.window import Window

if TYPE_CHECKING:  # annotations only: the strategy sits above this module
    from gaengine.sharding import ShardingStrategy

__all__ = ["MembershipStage", "adopt_changes", "join_refused"]


def join_refused(name: str, why: str) -> str:
    """The message of a parameter that became trainable but cannot join (``why``), and how to go on."""
    return (f"parameter {name!r} became trainable (requires_grad=True, or in a param group added with "
            f"optimizer.add_param_group) after the GradientAccumulator was built, but {why}, so gaengine cannot "
            f"adopt it and will not let it train on autograd's raw .grad. Nothing was accumulated or applied. "
            f"To go on: acc.step(force=True) (or acc.zero_grad()), acc.close(), then build the optimizer and a new "
            f"GradientAccumulator with the parameters trainable as you want them")


def adopt_changes(members: Membership, ranks: RankMembership | None, sharding: ShardingStrategy, window: Window,
                  owner: Any, window_id: int, fp16_needs_scale: bool, rescan: bool = False) -> bool:
    """At a window boundary (its first ``backward()``): the parameters unfrozen or added with
    ``optimizer.add_param_group`` since the last window join, the frozen ones leave; the strategy lays everything out
    again (``ShardingStrategy.adopt``, at every ``zero_stage``), so a joined parameter is accumulated, normalized,
    clipped and updated like the others from this window on, never on autograd's raw ``.grad``. Several ranks
    (``ranks``): every rank must change alike, checked first by one small all-reduce every window
    (``RankMembership.check``, the window's header ``window_id``); where they differ no rank adopts and ``step()``
    raises on every rank. The joined parameters are taken for ``owner`` (the accumulator: ``gaengine.ownership``),
    the left ones released, the ``.grad`` the accumulator left (``window.grads_left``) dropped. Returns whether the
    strategy laid the parameters out anew (the accumulator then claims them and watches them again).

    rescan: parameters were replaced in the model (``gaengine.replaced``): the module is read again first
    (``Membership.rescan``).

    ``ValueError`` naming the parameter, nothing changed (the membership as it was, a rescan undone), where the
    strategy lays out its parameters once (FSDP2), for an optimizer that writes the model itself, or an fp16
    parameter without a loss scale (``fp16_needs_scale``: ``loss_scale='auto'`` chose none at construction);
    ``RuntimeError`` likewise for a joined parameter another accumulator holds."""
    saved = members.saved()
    try:
        if rescan:
            members.rescan()
        joined, left = _checked_changes(members, ranks, sharding, window_id, fp16_needs_scale)
    except BaseException:
        members.restore(saved)
        raise
    if joined is None:
        return False
    if sharding.accumulation.take_stale() | window.grads_left:
        sharding.accumulation.clear_grads()
        window.grads_left = False
    for _, p in left:
        p.grad = None
    ownership.release([p for _, p in left], owner)
    sharding.adopt(members.trainable())
    known = {id(p) for _, p in members.candidates}
    sharding.forget([p for _, p in left if id(p) not in known])  # replaced: their fp32 masters are not kept
    return True


def _checked_changes(members: Membership, ranks: RankMembership | None, sharding: ShardingStrategy, window_id: int,
                     fp16_needs_scale: bool):
    """``adopt_changes``' checks, before anything is changed but the membership: ``(joined, left)`` to adopt, or
    ``(None, None)`` where nothing is adopted (no change, the ranks differ, or the parameters left under a strategy
    that lays them out once); its errors."""
    joined, left = members.changes(sharding.params)
    if ranks is not None and not ranks.check(joined, left, window_id):
        return None, None  # the ranks differ: this window runs in the layout every rank has; step() raises on each
    if not joined and not left:
        return None, None
    if not sharding.adopts_params:
        if joined:
            raise ValueError(join_refused(joined[0][0], f"{sharding.name} {sharding.fixed_layout}"))
        return None, None  # a frozen parameter gets no gradient: no update, as a parameter no micro-batch reaches
    if sharding.update.writes_model:
        raise ValueError(join_refused(
            (joined or left)[0][0], "an optimizer that writes the model itself (gaengine.optim.FusedAdamW with "
            "master weights) keeps its pieces for good"))
    if fp16_needs_scale and any(p.dtype == torch.float16 for _, p in joined):
        raise ValueError(join_refused(joined[0][0], "an fp16 parameter needs the loss scale that "
                                      "loss_scale='auto' chose against at construction"))
    ownership.take([p for _, p in joined], None)  # another accumulator's: RuntimeError; a stale .grad dropped
    return joined, left


class MembershipStage:
    """The membership stage (module docstring): ``members`` (``gaengine.ownership.Membership``), ``ranks`` (their
    check on several ranks, ``RankMembership``, else None) and, once ``watch`` has run after the strategy is built,
    ``model`` (``ownership.ModelWatch``: the model moved or converted) and ``replaced`` (``ReplacedParams``) over the
    strategy's current parameters."""

    def __init__(self, members: Membership, ranks: RankMembership | None) -> None:
        self.members, self.ranks = members, ranks
        self.model: ownership.ModelWatch | None = None
        self.replaced: ReplacedParams | None = None

    @classmethod
    def build(cls, params: list[torch.Tensor], optimizer: Any, module: Any, world_size: int, process_group: Any,
              device: torch.device) -> MembershipStage:
        """The stage at construction, before the strategy: parameters joining (unfrozen, a param group added) or
        leaving (frozen) after construction, found at the window boundaries and adopted by the strategy
        (``gaengine.ownership.Membership``, ``adopt``, docs/accumulator.md); on several ranks every rank must change
        them alike (one small all-reduce per window boundary, ``gaengine.ownership.RankMembership``). Its watches are
        set once the strategy is built (``watch``)."""
        members = ownership.Membership(module, params, optimizer)
        ranks = RankMembership(members, world_size, dist.get_rank(process_group), device, process_group) if (
            world_size > 1) else None
        return cls(members, ranks)

    def watch(self, sharding: ShardingStrategy, optimizer: Any, device: torch.device) -> None:
        """Watch the strategy's parameters (in their current layout): the model moved or converted, parameters
        replaced in the module (adopted or refused)."""
        self.model = ownership.watch_model(sharding, device)
        self.replaced = ReplacedParams(self.members.module, sharding.params, optimizer, sharding)

    def adopt(self, sharding: ShardingStrategy, window: Window, owner: Any, window_id: int, fp16_needs_scale: bool,
              optimizer: Any, device: torch.device) -> bool:
        """At a window boundary (its first ``backward()``): the parameters joined or left since, and those replaced in
        the model (``gaengine.replaced``: they join, the old leave), are adopted (``adopt_changes``: ``ValueError``
        naming one that cannot join, nothing changed), then claimed for ``owner`` and watched like the others.
        Returns whether the strategy laid them out anew (the accumulator's ``registered_params`` and
        ``named_params`` then follow ``members.trainable()`` / ``members.named()``)."""
        if not adopt_changes(self.members, self.ranks, sharding, window, owner, window_id, fp16_needs_scale,
                             rescan=bool(self.replaced.pending)):
            return False
        self.watch(sharding, optimizer, device)
        ownership.claim(sharding.params, owner)
        if self.ranks is not None:
            self.ranks.adopted()
        return True
