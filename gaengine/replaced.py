"""Parameters replaced in the model after the accumulator was built: noticed before the next micro-batch's
backward, adopted at a window boundary where the plain recipe would train them, refused naming them elsewhere.

The accumulator, its hooks and the optimizer hold parameter objects. ``model.load_state_dict(sd, assign=True)``
puts new ``Parameter`` objects in the model, ``model.fc = nn.Linear(...)`` a new layer, ``p.data = x`` may give a
parameter another shape or dtype: from then on the model computes with tensors the accumulator does not hold. Left
alone, the new ones would keep autograd's raw ``.grad`` and never be updated, and the old ones would get no gradient.

What the plain recipe (``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``) does then: the optimizer
holds the old objects, so the new ones never train either, unless the user points the optimizer at them
(``optimizer.param_groups[g]["params"] = list(model.parameters())``, or ``optimizer.add_param_group`` with the new
layer's parameters); the new ones then start with no optimizer state (torch keys it by the parameter object: the old
one's state stays with the old object, which the optimizer skips while it gets no gradient). gaengine does exactly
that, and nothing silently:

* at a window's first ``backward()``, in the replicated mode (``zero_stage=0``, or one rank; an optimizer that
  rounds its masters into the model itself excepted), a replaced parameter is adopted like a joining parameter
  (``gaengine.ownership.Membership``; the strategy lays everything out again, its value wins, on several ranks the
  first rank's, broadcast) when there is no optimizer or the optimizer holds the new object; its optimizer state is
  what the optimizer holds for the new object (none, unless the user put some there), as in the plain recipe;
* ``ValueError`` naming it, nothing of the micro-batch accumulated and the window as it was, when the optimizer
  still holds only the old object (the plain recipe would silently not train the new one), in the middle of a
  window (part of the window's gradient belongs to the old object), under ZeRO on several ranks or FSDP2 (their
  layouts are not rebuilt for a replacement; FSDP2 swaps its own parameters in and out of the modules, so there the
  strategy says which of its sharded parameters are other objects now, ``ShardingStrategy.replaced_params``), for a
  parameter removed from the model, or for a shape or dtype changed in place (``p.data = x`` of another shape: the
  optimizer state and fp32 master of the object would not fit it).

``p.data = x`` of the same shape and dtype keeps the object (the plain recipe's optimizer steps it from ``x``, its
state and ``.grad`` kept) and only matters where the accumulator laid the parameter out in a flat parameter buffer
(bf16/fp16 with fp32 masters; every parameter under ZeRO): the updates would go into the buffer, which the model no
longer reads. ``ReplacedParams.follow_storage`` (at every window's first ``backward()``, and in ``step()``,
``state_dict()`` and ``masters_to_model()``, before anything reads the buffer) puts it back in its place with ``x``'s
values, its master taking them, in the replicated mode; elsewhere it refuses naming it, nothing applied. In the
middle of a window that is the ``step()`` ending it: the micro-batches since ``x`` was set computed with ``x``, as the
plain recipe's do, and their gradients reached the same object's hooks.

Cost: nothing per parameter in the middle of a window (one int comparison per micro-batch: the module's slots are read
again only when a parameter or a submodule was registered anywhere since the last check, ``torch.nn`` calling the
global registration hooks installed here, an int increment each, from ``Module.__setattr__``:
``load_state_dict(assign=True)`` and a layer swap go through it); once per window, one ``data_ptr()`` per parameter
laid out in a flat buffer and one list comparison of the shapes and dtypes.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ReplacedParams"]

_generation = 0  # parameters and submodules registered on any module so far (the global hooks below)
_installed = False


def _registered(*_args) -> None:
    """``torch.nn``'s global parameter- and module-registration hook: counts; changes nothing."""
    global _generation
    _generation += 1


def _install() -> None:
    global _installed
    if not _installed:
        nn.modules.module.register_module_parameter_registration_hook(_registered)
        nn.modules.module.register_module_module_registration_hook(_registered)
        _installed = True


class ReplacedParams:
    """The watch over the accumulator's parameters (``params``, layout order) in ``module`` (None: a model given as
    an iterable of parameters, whose slots are not watched). A DTensor parameter (an FSDP2 model, whose parameters
    FSDP2 itself swaps in and out of the modules around forward and backward) is watched for shape and dtype, and
    through FSDP2's own record of its sharded parameters (``sharding.replaced_params()``).
    ``optimizer``: the accumulator's (or None); ``sharding``: its ``gaengine.sharding.ShardingStrategy``, read at each
    check (whether it adopts a replacement: ``adopts``). Build a new one after the accumulator lays its parameters
    out again.

    ``pending``: the names of the parameters replaced that the last ``check`` found adoptable (empty: none); the
    accumulator adopts them at that micro-batch (``gaengine.ownership.Membership.rescan``)."""

    def __init__(self, module: nn.Module | None, params: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer | None = None, sharding=None) -> None:
        _install()
        self.module, self.optimizer, self.sharding = module, optimizer, sharding
        self.params = list(params)
        self._kinds = [(p.shape, p.dtype) for p in self.params]
        held = {id(p) for p in self.params if not _is_dtensor(p)}
        self._slots: list[tuple[str, nn.Module, str, torch.Tensor]] = []  # (name in the model, owner, leaf name, p)
        if module is not None:
            for prefix, owner in module.named_modules(remove_duplicate=False):
                for leaf, p in owner._parameters.items():
                    if p is not None and id(p) in held:
                        self._slots.append((f"{prefix}.{leaf}" if prefix else leaf, owner, leaf, p))
        self._seen = _generation
        self.pending: list[str] = []
        # The parameters re-pointed at views of a flat parameter buffer (``gaengine.store``: bf16/fp16 with fp32
        # masters, every parameter under ZeRO): (index, the view, its data_ptr). ``p.data = x`` leaves the buffer.
        store = getattr(sharding, "store", None)
        buffers = {dt: buf.untyped_storage().data_ptr() for dt, buf in store.param_buffers.items()} if (
            store is not None) else {}
        self._views = [(i, p.data, p.data_ptr()) for i, p in enumerate(self.params)
                       if p.dtype in buffers and not _is_dtensor(p)
                       and p.untyped_storage().data_ptr() == buffers[p.dtype]]
        self._laid = [self.params[i] for i, _, _ in self._views]
        self._ptrs = [ptr for _, _, ptr in self._views]

    def adopts(self) -> bool:
        """Whether the accumulator adopts a replaced parameter at a window boundary: a strategy whose layout, store
        and hooks are built again for joining parameters (``adopts_params``), over a rank layout that holds every
        parameter whole on this rank (``RankLayout.adopts_replaced``: the replicated mode, one rank or
        ``zero_stage=0``), with an optimizer that does not round its masters into the model itself."""
        sharding = self.sharding
        return (sharding is not None and sharding.adopts_params and sharding.rank_layout.adopts_replaced()
                and not sharding.update.writes_model)

    def check(self, window_start: bool) -> None:
        """Before a micro-batch's backward (``window_start``: the window's first): find the parameters of the model
        that are no longer the ones the accumulator holds (another object in their slot, their layer replaced). At a
        window start, where ``adopts()`` and the optimizer (if any) holds every new trainable object, their names go
        to ``pending`` (adopted by the accumulator at this micro-batch). Else ``ValueError`` naming the first, and one
        naming a parameter whose shape or dtype changed in place (checked at a window start): nothing changed. A
        replacement found adoptable at this window's start and not adopted (several ranks that replaced differently:
        no rank adopts, and ``step()`` raises on every rank, ``gaengine.ownership.RankMembership``) is not refused
        again in the window: the ranks' collectives stay matched up to that ``step()``.

        In the middle of a window nothing is read per parameter: a ``p.data = x`` there is followed (or refused) by
        the ``step()`` that ends the window (``follow_storage``), before anything is applied."""
        if window_start:
            self.follow_storage()
        if self.pending and not window_start:
            return
        self.pending = []
        if self._seen != _generation:
            replaced = self._replaced_slots() + (self.sharding.replaced_params() if self.sharding is not None else [])
            if not replaced:
                self._seen = _generation
            else:  # looked at again at every micro-batch until adopted (the accumulator then builds a new watch)
                self._refuse_or_adopt(replaced, window_start)
        if window_start and [(p.shape, p.dtype) for p in self.params] != self._kinds:
            i = next(i for i, p in enumerate(self.params) if (p.shape, p.dtype) != self._kinds[i])
            name = next((n for n, _, _, q in self._slots if q is self.params[i]), f"params[{i}]")
            shape, dtype = self._kinds[i]
            self.pending = []
            raise ValueError(_refused(name, f"is now {tuple(self.params[i].shape)} {self.params[i].dtype}, the "
                                      f"accumulator laid it out as {tuple(shape)} {dtype} (p.data = ... of another "
                                      "shape or dtype: the parameter's optimizer state and fp32 master would not fit "
                                      "it, in the plain recipe too)"))

    def follow_storage(self, refuse: bool = True) -> None:
        """At every window's first backward, ``step()``, ``state_dict()`` and ``masters_to_model()``: a parameter laid
        out in a flat parameter buffer whose storage was replaced (``p.data = x``, same shape and dtype: the same
        object, so the plain recipe's optimizer steps it from ``x`` with its state and the gradient it holds) is put
        back into its place in the buffer with ``x``'s values, in place (``ParameterStore.merge_params``: its fp32
        master takes them), in the replicated mode; elsewhere ``ValueError`` naming
        it, nothing changed. Left alone, the updates would go into the buffer, which the model no longer reads: the
        parameter would silently never train again. One ``data_ptr()`` per laid-out parameter. ``refuse=False``
        (``state_dict()``, a collective on several ranks): where it is not adopted, leave it to the next
        ``backward()`` or ``step()`` to refuse, rather than raise on some ranks only."""
        if [p.data_ptr() for p in self._laid] == self._ptrs:
            return
        moved = [(i, view) for i, view, ptr in self._views if self.params[i].data_ptr() != ptr
                 and _fits(self.params[i], view)]  # another shape, dtype or device: check's or the model watch's
        if not moved:
            return
        if not self.adopts():
            if not refuse:
                return
            i = moved[0][0]
            name = next((n for n, _, _, q in self._slots if q is self.params[i]), f"params[{i}]")
            raise ValueError(
                f"parameter {name!r} has another storage (p.data = ...) than the flat parameter buffer the accumulator "
                f"laid it out in, and {self.sharding.name} does not adopt it: the updates would go into the buffer, "
                "which the model no longer reads, so the parameter would silently never train again. Nothing of "
                "this call was accumulated or applied: the window is as it was. Write values in place instead "
                "(with torch.no_grad(): p.copy_(x)). To go on now: acc.zero_grad() (it drops the window), "
                "acc.close(), then build the optimizer and a new GradientAccumulator over the model as it is now "
                "(docs/accumulator.md)")
        with torch.no_grad():
            for i, view in moved:
                p = self.params[i]
                view.copy_(p.detach())  # not through p: autograd may hold p at its version (a forward since)
                p.data = view
        if self.sharding.store is not None:
            self.sharding.store.merge_params([self.params[i] for i, _ in moved])  # the fp32 masters take them

    def _replaced_slots(self) -> list[tuple[str, torch.Tensor | None]]:
        """``(name, the model's parameter in that slot now, or None where it was removed)`` of every slot whose
        parameter is not the one the accumulator holds."""
        out = []
        for name, owner, leaf, p in self._slots:
            try:
                now = self.module.get_parameter(name)
            except AttributeError:
                now = None
            if now is not p or owner._parameters.get(leaf) is not p:
                out.append((name, now))
        return out

    def _refuse_or_adopt(self, replaced: list[tuple[str, torch.Tensor | None]], window_start: bool) -> None:
        name, now = replaced[0]
        if now is None:
            raise ValueError(_refused(name, "was removed from the model", adoptable=False))
        what = ("is another tensor than the one the accumulator holds (model.load_state_dict(..., assign=True), or "
                "its layer replaced: model.layer = nn.Linear(...))")
        if not window_start:
            raise ValueError(_refused(name, f"{what}, in the middle of an accumulation window (its micro-batches so "
                                            "far are the old parameter's)", adoptable=self.adopts()))
        if not self.adopts():
            raise ValueError(_refused(name, f"{what}, and {self.sharding.name} does not adopt a replaced parameter",
                                      adoptable=False))
        if self.optimizer is not None:
            held = {id(q) for g in self.optimizer.param_groups for q in g["params"]}
            missing = [(n, p) for n, p in replaced if p is not None and p.requires_grad and id(p) not in held]
            if missing:
                raise ValueError(_refused(missing[0][0], f"{what}, and the optimizer still holds the old object, not "
                                                          "the new one: the plain recipe would not train it either "
                                                          "(optimizer.step() updates the old one, which gets no "
                                                          "gradient)"))
        removed = [n for n, p in replaced if p is None]
        if removed:
            raise ValueError(_refused(removed[0], "was removed from the model", adoptable=False))
        self.pending = [n for n, _ in replaced]


def _fits(p: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``p`` (given another storage) can go back into its place ``view`` as it is: same shape, dtype and
    device."""
    return p.shape == view.shape and p.dtype == view.dtype and p.device == view.device


def _is_dtensor(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - imported by torch.distributed anyway

    return isinstance(p, DTensor)


def _refused(name: str, what: str, adoptable: bool = True) -> str:
    way = ("Replace parameters between windows (after acc.step()), and point the optimizer at the new ones as the "
           "plain recipe must (optimizer.param_groups[g][\"params\"] = list(model.parameters()), or "
           "optimizer.add_param_group({\"params\": list(new_layer.parameters())})): the next window's first backward() adopts them "
           "(the replicated mode, zero_stage=0). Or " if adoptable else "")
    return (f"parameter {name!r} {what}. The accumulator, its hooks and the optimizer hold the parameter as it was, "
            f"so the new one would keep autograd's raw .grad and never be updated, and the old one would get no "
            f"gradient. Nothing of this micro-batch was accumulated: the window is as it was. To go on: {way}put the "
            f"parameter back, or load values in place (model.load_state_dict(sd) without assign=True copies into the "
            f"parameters the accumulator holds); or acc.step(force=True) (or acc.zero_grad()), acc.close(), then build "
            f"the optimizer and a new GradientAccumulator over the model as it is now (docs/accumulator.md)")
