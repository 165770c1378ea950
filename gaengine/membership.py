"""Parameters joining or leaving the accumulator after construction: the membership stage of the pipeline.

A parameter unfrozen (``requires_grad_(True)``) or added with ``optimizer.add_param_group`` joins at the next window
boundary, a frozen one leaves (gradual unfreezing; docs/accumulator.md). ``gaengine.ownership.Membership`` finds the
changes and ``RankMembership`` checks that every rank makes them alike; this module decides what the accumulator does
with them at a window's first ``backward()`` (``adopt_changes``: the strategy lays everything out again,
``ShardingStrategy.adopt``), what a window's stats all-reduce compares of them (``membership_term``), and refuses a
``step()`` whose window a parameter joined in its middle (``refuse_unmanaged_grads``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gaengine import ownership
from gaengine.ownership import Membership, RankMembership
from gaengine.window import Window

if TYPE_CHECKING:  # annotations only: the strategy sits above this module
    from gaengine.sharding import ShardingStrategy

__all__ = ["adopt_changes", "join_refused", "membership_term", "refuse_unmanaged_grads", "unmanaged_grads"]


def membership_term(members: Membership, managed: list[torch.Tensor]) -> int:
    """The membership term of what every rank must have set alike for a window (``MEMBERSHIP_SETTING``, compared in
    its stats all-reduce): 0 where no parameter was made trainable or frozen since the window began (``managed``:
    the parameters in the layout), else the digest of the trainable set (``Membership.fingerprint``). A rank that
    unfreezes a parameter in the middle of a window refuses that window's ``step()`` itself
    (``refuse_unmanaged_grads``); with this term the other ranks refuse it too, instead of applying a window that
    rank did not."""
    joined, left = members.changes(managed)
    return members.fingerprint() if joined or left else 0


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
            raise ValueError(join_refused(joined[0][0], f"{sharding.name} lays its parameters out once, "
                                          "at construction (a plain model adopts it at every zero_stage)"))
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


def unmanaged_grads(members: Membership, managed: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The parameters of the model or the optimizer that the accumulator does not manage in this window (not in
    ``managed``: frozen at its start) and that hold a ``.grad``: autograd's, from a micro-batch of this window after
    they were unfrozen. The optimizer would apply such a ``.grad`` raw, frozen again or not (torch's optimizers skip
    only a ``.grad`` that is None)."""
    ids = {id(p) for p in managed}
    return [(n, p) for n, p in members.candidates if p.grad is not None and id(p) not in ids]


def refuse_unmanaged_grads(members: Membership, managed: list[torch.Tensor]) -> None:
    """Before ``step()`` applies anything: ``ValueError`` naming a parameter that became trainable in the middle of
    this window (it holds autograd's raw ``.grad`` of part of the window, outside ``main_grad``, the norm and the
    clip): its window is not the sum of the window's micro-batches, and the optimizer would apply it raw."""
    raw = [name for name, _ in unmanaged_grads(members, managed)]
    if raw:
        raise ValueError(
            f"parameter {raw[0]!r} became trainable (requires_grad=True) in the middle of this accumulation window "
            f"(and holds a .grad, whether frozen again since or not; the optimizer would apply it): "
            f"its .grad is autograd's raw sum over part of the window, not gaengine's normalized, clipped window "
            f"gradient, so nothing was applied (the window stays open). Unfreeze parameters between windows "
            f"(after acc.step()): they join at the next window. To go on now, either freeze it again "
            f"(requires_grad_(False) and .grad = None) and call acc.step() again, or drop the window with "
            f"acc.zero_grad() (which drops that .grad too)")
