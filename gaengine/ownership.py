"""The accumulator's hold on the model: which parameters it takes, and that the model stays as it was built.

* ``check_arguments``: the model and optimizer arguments of ``GradientAccumulator`` that its configuration
  (``gaengine.config``) cannot check alone.
* ``take``: refuse parameters another live accumulator owns or an optimizer over foreign parameters, and drop a
  ``.grad`` left from before (``UserWarning``): a window holds only its own micro-batches.
* ``claim`` / ``release``: mark each parameter with its accumulator (a weak reference, read by
  ``gaengine.clip`` and ``gaengine.verify``), and unmark it at ``close()``.
* ``ModelWatch`` (``watch_model``: over a strategy's parameters): a model moved or converted after construction
  raises, for good.
* ``Membership``: parameters that join (unfrozen, or added with ``optimizer.add_param_group``) or leave (frozen)
  after construction, found at the window boundaries (gradual unfreezing; docs/accumulator.md); what a window's stats
  all-reduce compares of them (``window_term``), and the refusal of a ``step()`` whose window a parameter joined in
  its middle (``refuse_unmanaged_grads``).
* ``RankMembership``: several ranks must change their trainable parameters alike, at the same window boundary.
"""

from __future__ import annotations

import hashlib
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gaengine.clip import OWNER_ATTR
from gaengine.protocol import WINDOW_START, RankProtocol, payload_numel
from gaengine.reduce import HostMailbox, setting_terms
from gaengine.update import check_optimizer_step
from gaengine.zero import check_zero_optimizer

if TYPE_CHECKING:  # annotations only: the strategy sits above this module
    from gaengine.sharding import ShardingStrategy

__all__ = ["Membership", "ModelWatch", "RankMembership", "check_arguments", "claim", "release", "take"]


def check_arguments(model: Any, optimizer: Any, config) -> None:
    """``TypeError`` / ``ValueError`` naming ``optimizer`` or ``overlap_param_gather`` for what the configuration
    ``config`` (an ``AccumulatorConfig``) allows only with some models or optimizers."""
    if config.overlap_param_gather and not isinstance(model, nn.Module):
        raise ValueError("overlap_param_gather=True needs model as an nn.Module (the all-gather is waited for in "
                         f"its modules' forward pre-hooks), got a model of type {type(model).__name__}: pass the "
                         "module, or leave overlap_param_gather off")
    check_zero_optimizer(optimizer, config.zero_stage)  # ValueError naming zero_stage: it cannot run on shards
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if optimizer is not None:
        check_optimizer_step(optimizer)


def take(params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None, module: nn.Module | None = None) -> None:
    """Check that ``params`` can be taken, then drop their stale ``.grad``.

    Raises ``RuntimeError`` when a parameter belongs to another live accumulator (two would each free the other's
    gradients) and ``ValueError`` when ``optimizer`` holds a parameter outside ``params`` that is not one of the
    model's frozen ones (``requires_grad=False``: of ``module``, or any, for a model given as an iterable of
    Parameters). Frozen parameters in the optimizer are accepted as torch accepts them (an optimizer over
    ``model.parameters()`` with a frozen layer): they never get a gradient, so torch's optimizers (and
    ``gaengine.optim.FusedAdamW``) skip them, as they skip any parameter whose ``.grad`` is None. A ``.grad`` already on a
    parameter (a ``loss.backward()`` before construction) is dropped with one ``UserWarning`` naming how many:
    Megatron-Core and torch DDP start from zeroed gradients too, a window is the sum of its own micro-batches only.
    """
    for p in params:
        owner = getattr(p, OWNER_ATTR, None)
        if owner is not None and owner() is not None:
            raise RuntimeError(f"a parameter of shape {tuple(p.shape)} already belongs to another GradientAccumulator; "
                               "call close() on it first (two accumulators would each free the other's gradients)")
    if optimizer is not None:
        ids = {id(p) for p in params}
        frozen = None if module is None else {id(p) for p in module.parameters() if not p.requires_grad}
        foreign = [q for g in optimizer.param_groups for q in g["params"] if id(q) not in ids
                   and (q.requires_grad or (frozen is not None and id(q) not in frozen))]
        if foreign:
            raise ValueError(
                f"optimizer holds {len(foreign)} parameter(s) that are not parameters of model (first of shape "
                f"{tuple(foreign[0].shape)}, requires_grad={foreign[0].requires_grad}): build the optimizer over "
                f"this model's parameters (model.parameters(); its frozen ones may be in it, they are skipped)")
    stale = [p for p in params if p.grad is not None]
    if stale:
        warnings.warn(
            f"{len(stale)} of {len(params)} trainable parameters already hold a .grad (from a loss.backward() "
            "before the accumulator was built, or another accumulator); gaengine drops them so that the first "
            "window holds only its own micro-batches", UserWarning, stacklevel=3)
        for p in stale:
            p.grad = None


def claim(params: list[torch.Tensor], acc: Any) -> None:
    """Mark ``params`` as ``acc``'s (a weak reference: a collected accumulator owns nothing)."""
    ref = weakref.ref(acc)
    for p in params:
        setattr(p, OWNER_ATTR, ref)


def release(params: list[torch.Tensor], acc: Any) -> None:
    """Unmark the parameters of ``params`` that ``acc`` still owns."""
    for p in params:
        owner = getattr(p, OWNER_ATTR, None)
        if owner is not None and owner() is acc:
            delattr(p, OWNER_ATTR)


class ModelWatch:
    """Whether the model was moved or converted after the accumulator was built (``model.to(...)``, ``.float()``,
    ``.cuda()``, ``load_state_dict(assign=True)``): ``Module._apply`` converts every parameter, so one per dtype
    tells, and the sharding strategy checks that re-pointed parameters are still views of their flat buffer.

    params: the trainable parameters, in layout order; device: where the accumulator was built; check_strategy:
    the strategy's own check (``gaengine.sharding.Update.check_model``), raising ``RuntimeError``.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, check_strategy) -> None:
        self.sentinels = {p.dtype: p for p in reversed(params)}
        self.device = device
        self.check_strategy = check_strategy
        self.error: str | None = None

    def check(self) -> None:
        """Raise ``RuntimeError`` (for good: the buffers belong to the model as it was) when the model moved."""
        if self.error is None:
            try:
                self.check_strategy()
                for dtype, p in self.sentinels.items():
                    if p.dtype != dtype or p.device != self.device:
                        raise RuntimeError(
                            f"a model parameter of shape {tuple(p.shape)} is now {p.dtype} on {p.device}, but the "
                            f"accumulator was built for {dtype} on {self.device}: the model was moved or converted "
                            "after the GradientAccumulator was built (model.to(...), .float(), .cuda(), ...)")
            except RuntimeError as exc:
                self.error = (
                    f"{exc}. acc.zero_grad() cannot recover from this: the accumulator's buffers belong to the model "
                    "as it was. Call acc.close(), then build the optimizer and a new GradientAccumulator over the "
                    "model as it is now (move and convert the model first)")
        if self.error is not None:
            raise RuntimeError(self.error)


def watch_model(sharding: ShardingStrategy, device: torch.device) -> ModelWatch:
    """The watch on the model being moved or converted over the strategy's parameters, with the store's own check (``gaengine.sharding.Update.check_model``, of
    the strategy's update at the time of the check). It holds the strategy, not the accumulator (garbage collection
    of the accumulator)."""
    return ModelWatch(sharding.params, device, lambda: sharding.update.check_model())


class Membership:
    """The parameters that may join or leave the accumulator after construction (gradual unfreezing).

    module: the model (an ``nn.Module``), or None for a model given as an iterable of Parameters (``params``).
    optimizer: the optimizer, or None; read at construction, before it is re-pointed at master weights, and again
    for every param group added since (``optimizer.add_param_group``), never for the pieces it holds after.

    ``candidates``: ``(name, parameter)`` of every parameter that can be trained: the module's (frozen ones
    included; names as ``named_parameters()``), or the iterable's and the optimizer's, then the parameters of the
    groups added later that the module does not hold (named ``param_groups[g][j]``). ``changes`` compares their
    ``requires_grad`` with the accumulator's parameters: one attribute read per parameter, once per window.
    """

    def __init__(self, module: nn.Module | None, params: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.module, self.optimizer = module, optimizer
        self._initial = list(params) if module is None else []  # a module is read itself (not kept: replaced ones)
        self._num_groups = 0
        self.candidates: list[tuple[str, torch.Tensor]] = []
        self.replacements = 0  # rescans that found other parameter objects in the module (fingerprint)
        self._scan(0)

    def _scan(self, first_group: int) -> None:
        """Rebuild ``candidates`` with the optimizer's param groups from ``first_group`` on."""
        if self.module is not None:
            named = list(self.module.named_parameters())
        else:
            named = [(f"param[{i}]", p) for i, p in enumerate(self._initial)]
        seen = {id(p) for _, p in named}
        extra = [(n, p) for n, p in self.candidates if id(p) not in seen and n.startswith("param_groups")]
        seen |= {id(p) for _, p in extra}
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        for g in range(first_group, len(groups)):
            for j, q in enumerate(groups[g]["params"]):
                if id(q) not in seen:
                    extra.append((f"param_groups[{g}][{j}]", q))
                    seen.add(id(q))
        self.candidates = named + extra
        self._num_groups = len(groups)

    def rescan(self) -> None:
        """Read the module's parameters again (``gaengine.replaced``: parameters replaced in the model since the
        last scan, ``load_state_dict(assign=True)`` or a layer swapped); the optimizer's param groups are read as
        ``changes`` reads them (those added since). A scan that finds other parameter objects counts in
        ``replacements`` (part of the ``fingerprint``: ranks that replaced parameters differently differ)."""
        before = [id(p) for _, p in self.candidates]
        self._scan(self._num_groups)
        if [id(p) for _, p in self.candidates] != before:
            self.replacements += 1

    def saved(self) -> tuple:
        """What ``rescan`` and ``changes`` may change (the candidates, the groups read, the replacements counted), for
        ``restore``: a refused adoption leaves the membership as it was (``gaengine.membership.adopt_changes``)."""
        return list(self.candidates), self._num_groups, self.replacements

    def restore(self, saved: tuple) -> None:
        """Put back what ``saved`` returned."""
        candidates, self._num_groups, self.replacements = saved
        self.candidates = list(candidates)

    def changes(self, managed: list[torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]],
                                                             list[tuple[str, torch.Tensor]]]:
        """``(joined, left)``: the candidates that require grad and are not in ``managed`` (the accumulator's
        parameters), and those in ``managed`` that no longer require grad or are no longer candidates (replaced in the
        module, found by ``rescan``), each as ``(name, parameter)`` (a replaced one named ``replaced[i]``, its index
        in ``managed``)."""
        if self.optimizer is not None and len(self.optimizer.param_groups) != self._num_groups:
            self._scan(self._num_groups)
        ids = {id(p) for p in managed}
        joined = [(n, p) for n, p in self.candidates if p.requires_grad and id(p) not in ids]
        left = [(n, p) for n, p in self.candidates if not p.requires_grad and id(p) in ids]
        if self.replacements:  # a rescan found other objects: a managed parameter may no longer be a candidate
            known = {id(p) for _, p in self.candidates}
            left += [(f"replaced[{i}]", p) for i, p in enumerate(managed) if id(p) not in known]
        return joined, left

    def trainable(self) -> list[torch.Tensor]:
        """The candidates that require grad, in ``candidates``' order (the module's registration order first)."""
        return [p for _, p in self.candidates if p.requires_grad]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """What ``GradientAccumulator.named_params`` holds: the module's named parameters and the later groups'
        (empty for a model given as an iterable, as at construction)."""
        return list(self.candidates) if self.module is not None else []

    def fingerprint(self) -> int:
        """A 52-bit digest of the trainable candidates (name, shape, dtype, in ``candidates``' order): equal on two
        ranks exactly when they train the same parameters (barring a digest collision, about 2^-52), and exact as
        an fp64 value (``gaengine.reduce.setting_terms``). Host only."""
        trainable: list = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.candidates if p.requires_grad]
        if self.replacements:
            trainable.append(self.replacements)
        return int.from_bytes(hashlib.blake2b(repr(trainable).encode(), digest_size=8).digest(), "little") >> 12

    def window_term(self, managed: list[torch.Tensor]) -> int:
        """The membership term of what every rank must have set alike for a window (``MEMBERSHIP_SETTING``, compared
        in its stats all-reduce): 0 where no parameter was made trainable or frozen since the window began
        (``managed``: the parameters in the layout), else the digest of the trainable set (``fingerprint``). A rank
        that unfreezes a parameter in the middle of a window refuses that window's ``step()`` itself
        (``refuse_unmanaged_grads``); with this term the other ranks refuse it too, instead of applying a window
        that rank did not."""
        joined, left = self.changes(managed)
        return self.fingerprint() if joined or left else 0

    def unmanaged_grads(self, managed: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The parameters of the model or the optimizer that the accumulator does not manage in this window (not in
        ``managed``: frozen at its start) and that hold a ``.grad``: autograd's, from a micro-batch of this window
        after they were unfrozen. The optimizer would apply such a ``.grad`` raw, frozen again or not (torch's
        optimizers skip only a ``.grad`` that is None)."""
        ids = {id(p) for p in managed}
        return [(n, p) for n, p in self.candidates if p.grad is not None and id(p) not in ids]

    def refuse_unmanaged_grads(self, managed: list[torch.Tensor]) -> None:
        """Before ``step()`` applies anything: ``ValueError`` naming a parameter that became trainable in the middle
        of this window (it holds autograd's raw ``.grad`` of part of the window, outside ``main_grad``, the norm and
        the clip): its window is not the sum of the window's micro-batches, and the optimizer would apply it raw."""
        raw = [name for name, _ in self.unmanaged_grads(managed)]
        if raw:
            raise ValueError(
                f"parameter {raw[0]!r} became trainable (requires_grad=True) in the middle of this accumulation "
                f"window (and holds a .grad, whether frozen again since or not; the optimizer would apply it): "
                f"its .grad is autograd's raw sum over part of the window, not gaengine's normalized, clipped window "
                f"gradient, so nothing was applied (the window stays open). Unfreeze parameters between windows "
                f"(after acc.step()): they join at the next window. To go on now, either freeze it again "
                f"(requires_grad_(False) and .grad = None) and call acc.step() again, or drop the window with "
                f"acc.zero_grad() (which drops that .grad too)")


_TERMS = len(setting_terms(0))  # agreement terms of the fingerprint (the chunks of its fp64 bits and their squares)
_SLOT = 4  # per rank: parameters joining, leaving, and the candidate index + 1 of the first of each (0: none)


class RankMembership:
    """Several ranks: at every window boundary each rank's trainable parameters must change alike (gradual
    unfreezing done the same way on every rank, at the same window), or the ranks' layouts, collectives and updates
    would disagree: a joined parameter's adoption is a collective the other ranks would not join (a hang, or gloo
    aborting the process on mismatched sizes), or the ranks would train different parameters apart.

    A rank that changed nothing cannot know that another one did without a message, so every window's first
    ``backward()`` runs one small all-reduce (``check``), before anything of the window is collective: each
    rank's ``Membership.fingerprint`` of the parameters it would train from this window (the agreement terms of
    ``gaengine.reduce.setting_terms``: summed over the ranks they equal W times a rank's own exactly when every rank
    has the same fingerprint), and per rank a slot saying what it changed (how many parameters join and leave, and
    which first). ``8 + 4 W`` fp64 values, waited as a stream wait on CUDA; their result is copied to host memory
    behind the device's queue (``gaengine.reduce.HostMailbox``). A rank that changed something reads it at once (a
    host read, only at a window where it changes its parameters) and adopts only when every rank asked for the
    same parameters. Otherwise no rank adopts: every rank runs the window in the layout it had (the collectives stay
    matched), and ``step()`` reads the result (copied long before: no wait for the device) and raises ``ValueError``
    on every rank, naming each rank's change (``take``), before anything is applied; the error stays until
    ``acc.zero_grad()`` drops the window (``drop``).

    The all-reduce is the header of the window's first phase of collectives (``gaengine.protocol``, ``WINDOW_START``):
    a rank at another of gaengine's collectives makes every rank raise ``gaengine.protocol.ProtocolError`` there.

    members: the accumulator's ``Membership``. world_size, rank, device, group: the ranks'. protocol: the
    accumulator's ``gaengine.protocol.RankProtocol`` (default: one of its own).
    """

    def __init__(self, members: Membership, world_size: int, rank: int, device: torch.device, group,
                 protocol: RankProtocol | None = None) -> None:
        self.members, self.world_size, self.rank, self.device, self.group = members, world_size, rank, device, group
        self.protocol = protocol if protocol is not None else RankProtocol(world_size, rank, device, group)
        assert _TERMS + _SLOT * world_size == payload_numel(world_size), "gaengine.protocol's payload is this check's"
        self.fingerprint = members.fingerprint()  # of the parameters the accumulator trains now
        self._mailbox = HostMailbox(1 + _SLOT * world_size, torch.float64, device)
        self._posted = False
        self._values: list[float] | None = None
        self._error: ValueError | None = None
        self._unchanged: torch.Tensor | None = None  # this rank's values when nothing changed

    def check(self, joined: list[tuple[str, torch.Tensor]], left: list[tuple[str, torch.Tensor]],
              window: int = 0) -> bool:
        """At a window boundary, on every rank, before anything of the window is collective: launch the all-reduce
        of what this rank would train from now (``joined``, ``left``: ``Membership.changes``), the header of window
        ``window`` (the updates so far). Returns whether this rank may adopt its change: True with no change (no
        host read); with one, whether every rank asked for the same parameters (a host read). Raises
        ``gaengine.protocol.ProtocolError`` when a rank is at another collective of gaengine's (CPU), nothing
        changed."""
        changed = bool(joined or left)
        if changed:
            position = {id(p): i for i, (_, p) in enumerate(self.members.candidates)}
            host = self._vector(self.members.fingerprint(), [
                len(joined), len(left), position[id(joined[0][1])] + 1 if joined else 0,
                position.get(id(left[0][1]), -1) + 1 if left else 0])  # 0: none, or replaced (not a candidate)
        else:  # the usual window: the same values as the last one
            if self._unchanged is None:
                self._unchanged = self._vector(self.fingerprint, [0] * _SLOT)
            host = self._unchanged.clone()  # the all-reduce writes into it (on CPU, .to() below is the same tensor)
        own = host[:_TERMS].to(self.device, non_blocking=True) * self.world_size
        data = self.protocol.open(WINDOW_START, window, host.to(self.device, non_blocking=True))
        differ = data[:_TERMS].ne(own).any().to(torch.float64).reshape(1)
        self._mailbox.post(torch.cat([differ, data[_TERMS:]]))
        self._posted, self._values, self._error = True, None, None
        return not changed or not self._read()[0]

    def _vector(self, fingerprint: int, slot: list[int]) -> torch.Tensor:
        """This rank's values: the fingerprint's agreement terms, then its slot among the ranks' (zeros elsewhere)."""
        host = torch.zeros(_TERMS + _SLOT * self.world_size, dtype=torch.float64)
        host[:_TERMS] = torch.tensor(setting_terms(fingerprint), dtype=torch.float64)
        at = _TERMS + _SLOT * self.rank
        host[at:at + _SLOT] = torch.tensor(slot, dtype=torch.float64)
        return host

    def _read(self) -> list[float]:
        if self._values is None:
            self._values = self._mailbox.read()  # host memory; on CUDA a wait for that copy only
            self._posted = False
        return self._values

    def adopted(self) -> None:
        """The accumulator adopted the change: its fingerprint is the trainable parameters' now."""
        self.fingerprint = self.members.fingerprint()
        self._unchanged = None

    def take(self) -> Exception | None:
        """``step()``, before anything is applied: the error to raise when the ranks asked for different parameters
        at this window's boundary (``ValueError``; every rank gets it at the same call), or, on CUDA, when a header of
        this window met another phase (``gaengine.protocol.ProtocolError``, read here: no host wait per window),
        else None."""
        mismatch = self.protocol.take()
        if mismatch is not None:
            return mismatch
        if self._error is None and (self._posted or self._values is not None) and self._read()[0]:
            self._error = ValueError(self._message())
        return self._error

    def drop(self) -> None:
        """``acc.zero_grad()``: the window is dropped, and its check with it; the next boundary checks again."""
        self._posted, self._values, self._error = False, None, None

    def _message(self) -> str:
        names = [n for n, _ in self.members.candidates]

        def name(index: float) -> str:
            i = int(index) - 1
            return repr(names[i]) if i < len(names) else f"a parameter this rank does not have (candidate #{i})"

        choices = []
        for r in range(self.world_size):
            n_join, n_leave, first_join, first_leave = self._values[1 + _SLOT * r:1 + _SLOT * (r + 1)]
            parts = ([f"{int(n_join)} joining (first {name(first_join)})"] if n_join else []) + (
                [f"{int(n_leave)} leaving (first {name(first_leave)})"] if n_leave else [])
            choices.append(f"rank {r}: {', '.join(parts) if parts else 'no change'}")
        return (f"gaengine: the ranks changed their trainable parameters differently before this window (requires_grad "
                f"set, or optimizer.add_param_group, on some ranks only or differently); {'; '.join(choices[:16])}"
                f"{'; ...' if len(choices) > 16 else ''} (this is rank {self.rank}). Every rank must train the same "
                "parameters, or the ranks' collectives and updates would disagree, so no rank adopted its change and "
                "nothing of this window is applied (the parameters, the optimizer state, the lr_scheduler and the loss "
                "scale are as before it). Make the same change on every rank (e.g. unfreeze at the same update index), "
                "call acc.zero_grad() to drop this window, and go on: the change is adopted at the next window")
