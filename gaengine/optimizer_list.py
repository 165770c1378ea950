"""Several optimizers on one model: ``GradientAccumulator(model, [muon, adamw], lr_scheduler=[s1, s2])``.

A list (or tuple) of optimizers is one update: the window's one norm over all the parameters, one clip coefficient
and one skip decision (found_inf) are the accumulator's as for one optimizer, then each optimizer steps once, in the
list's order, and each scheduler once per applied update (none for a skipped one). ``OptimizerList`` is that list
as the accumulator's stages see an optimizer (the store re-points its param groups at the fp32 masters, the
checkpoint numbers its parameters): the concatenation of the optimizers' own param groups (the same dicts: a group
re-pointed is re-pointed in its optimizer) and their states, each state entry kept by the optimizer that owns its
parameter. ``SchedulerList`` is the schedulers the same way.

Each trainable parameter belongs to exactly one optimizer of the list: ``check_coverage`` refuses a parameter in two
(they would both update it) or a trainable one in none (torch would leave it untouched, almost always a forgotten
group), naming it by its module path. One optimizer is taken as it is (``combine`` returns it unchanged).

torch's own recipe for Muon (``torch.optim.Muon``'s docstring): Muon for the 2-D hidden weights, AdamW for the
embeddings, the head, the norms and the biases, two optimizers stepped one after the other (docs/optimizers.md).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from gaengine.optimizers import elementwise_names, is_elementwise
from gaengine.update import check_optimizer_step

__all__ = ["OptimizerList", "SchedulerList", "check_coverage", "check_sharded_list", "combine"]

_MISSING = object()


def _name(optimizer: Any) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


class _ListState(MutableMapping):
    """``OptimizerList.state``: one mapping over the optimizers' ``state`` dicts (parameter -> its state dict). An
    entry lives in the state of the optimizer that owns its parameter: the one whose state holds it already, else
    whose param groups hold it, else the one that held it last (``home``: a parameter that left every group, e.g.
    frozen at ``zero_stage`` >= 1, keeps its optimizer). Reading a parameter no optimizer holds raises ``KeyError``;
    reading one a param group holds without state gives its optimizer's new empty dict (torch's ``defaultdict``)."""

    def __init__(self, owner: OptimizerList) -> None:
        self._owner = owner
        self._home: dict[int, tuple[weakref.ref, int]] = {}  # id(parameter) -> (the parameter, optimizer index)

    def _remember(self, key: Any, index: int) -> None:
        with contextlib.suppress(TypeError):  # not weakly referenceable: not a tensor, nothing to remember
            self._home[id(key)] = (weakref.ref(key), index)

    def _holder(self, key: Any) -> int | None:
        for i, opt in enumerate(self._owner.optimizers):
            if key in opt.state:
                return i
        return None

    def _owner_of(self, key: Any) -> int | None:
        held = self._holder(key)
        if held is not None:
            return held
        for i, opt in enumerate(self._owner.optimizers):
            if any(q is key for g in opt.param_groups for q in g["params"]):
                return i
        ref, index = self._home.get(id(key), (None, None))
        return index if ref is not None and ref() is key else None

    def __getitem__(self, key: Any) -> dict:
        i = self._owner_of(key)
        if i is None:
            raise KeyError(key)
        self._remember(key, i)
        return self._owner.optimizers[i].state[key]

    def get(self, key: Any, default: Any = None) -> Any:
        i = self._holder(key)
        return default if i is None else self._owner.optimizers[i].state[key]

    def __contains__(self, key: Any) -> bool:
        return self._holder(key) is not None

    def __setitem__(self, key: Any, value: dict) -> None:
        i = self._owner_of(key)
        if i is None:
            raise KeyError(f"no optimizer of the list holds this parameter (shape {tuple(getattr(key, 'shape', ()))}) "
                           "in its param groups: add it to one optimizer's param groups first")
        self._remember(key, i)
        self._owner.optimizers[i].state[key] = value

    def __delitem__(self, key: Any) -> None:
        i = self._holder(key)
        if i is None:
            raise KeyError(key)
        self._remember(key, i)
        del self._owner.optimizers[i].state[key]

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        i = self._holder(key)
        if i is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._remember(key, i)
        return self._owner.optimizers[i].state.pop(key)

    def __iter__(self) -> Iterator[Any]:
        for opt in self._owner.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._owner.optimizers)


class OptimizerList(torch.optim.Optimizer):
    """Several ``torch.optim.Optimizer``s stepped as one (module docstring). ``optimizers``: the user's, in order.

    ``param_groups``: the optimizers' groups one after another (the same dicts; read afresh at every access, so a
    group added to one optimizer with ``add_param_group`` is seen). ``state``: their states as one mapping
    (``_ListState``). ``step()``: each optimizer's ``step()`` once, in order; when every optimizer takes
    ``grad_scale``/``found_inf`` (fused torch optimizers, ``gaengine.optim.FusedAdamW``: torch.amp.GradScaler's
    protocol), so does the list, and it hands them to each. ``state_dict()``: torch's format over the concatenated
    groups (parameters numbered across the optimizers in order); ``load_state_dict`` splits it back, all or nothing
    (every part checked against its optimizer before any is loaded; a failure while loading puts every optimizer
    back as it was). ``train()`` / ``eval()``: the optimizers' own, for those that define them (schedule-free).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:  # noqa: D107 - no super().__init__:
        # the groups and the state are the optimizers' own, not copies
        self.optimizers = list(optimizers)
        self._state = _ListState(self)
        fused = all(getattr(o, "_step_supports_amp_scaling", False) and o.defaults.get("fused")
                    for o in self.optimizers)
        self._step_supports_amp_scaling = fused
        self.defaults = {"fused": True} if fused else {}
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, {})

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> _ListState:
        return self._state

    def optimizer_of_group(self, group: dict[str, Any]) -> torch.optim.Optimizer:
        """The optimizer of the list whose param groups hold ``group`` (that very dict). ``KeyError`` otherwise."""
        for o in self.optimizers:
            if any(g is group for g in o.param_groups):
                return o
        raise KeyError("the param group belongs to no optimizer of the list")

    def type_name(self) -> str:
        """How checkpoints record the list: ``gaengine.optimizer_list.OptimizerList[<each optimizer's class>]``."""
        return f"{_name(self)}[{', '.join(_name(o) for o in self.optimizers)}]"

    def __repr__(self) -> str:
        return f"OptimizerList({', '.join(type(o).__name__ for o in self.optimizers)})"

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizers": self.optimizers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["optimizers"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("OptimizerList.add_param_group: the list has no hyper-parameters of its own; add the group to "
                        "the optimizer it belongs to (acc.optimizer.optimizers[i].add_param_group(...))")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Each optimizer's ``step()`` once, in the list's order; ``grad_scale`` / ``found_inf`` set on the list (a
        fused list) are set on each for its step. ``closure``: called once first, with gradients enabled, its loss
        returned (torch's convention for the optimizers that take one without needing it, e.g. AdamW: what plain
        Lightning's automatic optimization passes); the optimizers step without it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        handed = {k: v for k, v in vars(self).items() if k in ("grad_scale", "found_inf")}
        for o in self.optimizers:
            for k, v in handed.items():
                setattr(o, k, v)
            try:
                o.step()
            finally:
                for k in handed:
                    if k in vars(o):
                        delattr(o, k)
        return loss

    def _call_all(self, name: str) -> None:
        for o in self.optimizers:
            method = getattr(o, name, None)
            if callable(method):
                method()

    def train(self) -> None:
        """Each optimizer's ``train()``, where it defines one (schedule-free: the training point)."""
        self._call_all("train")

    def eval(self) -> None:
        """Each optimizer's ``eval()``, where it defines one (schedule-free: the averaged point)."""
        self._call_all("eval")

    def _spans(self) -> list[tuple[int, int, int, int]]:
        """Per optimizer: (first group, end group, first parameter number, end parameter number) in the list's
        numbering (torch's: parameters numbered across the groups in order)."""
        spans, g0, p0 = [], 0, 0
        for o in self.optimizers:
            n_groups, n_params = len(o.param_groups), sum(len(g["params"]) for g in o.param_groups)
            spans.append((g0, g0 + n_groups, p0, p0 + n_params))
            g0, p0 = g0 + n_groups, p0 + n_params
        return spans

    def state_dict(self) -> dict[str, Any]:
        """torch's format over the list's groups: ``{"state": {number: state}, "param_groups": [...]}``, the
        parameters numbered across the optimizers in order (each optimizer's own ``state_dict()``, renumbered)."""
        state, groups = {}, []
        for o, (_, _, p0, _) in zip(self.optimizers, self._spans()):
            sd = o.state_dict()
            state.update({p0 + int(i): s for i, s in sd["state"].items()})
            groups += [{**g, "params": [p0 + int(i) for i in g["params"]]} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned into each optimizer (its part renumbered from 0, through its own
        ``load_state_dict``). ``ValueError`` naming the optimizer, before anything is loaded, when the groups or
        their sizes differ from the optimizers'; any error while loading puts every optimizer back as it was."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, (list, tuple)) or not isinstance(state, dict):
            raise ValueError("OptimizerList.load_state_dict: expected {'state': dict, 'param_groups': list}, as "
                             "OptimizerList.state_dict() returns")
        spans = self._spans()
        n_groups = spans[-1][1] if spans else 0
        if len(groups) != n_groups:
            raise ValueError(f"OptimizerList.load_state_dict: the state holds {len(groups)} param groups, the "
                             f"optimizers {n_groups} together")
        parts = []
        for i, (o, (g0, g1, p0, p1)) in enumerate(zip(self.optimizers, spans)):
            mine = groups[g0:g1]
            for saved, group in zip(mine, o.param_groups):
                numbers = list(saved.get("params", ()))
                if len(numbers) != len(group["params"]) or any(not p0 <= int(n) < p1 for n in numbers):
                    raise ValueError(f"OptimizerList.load_state_dict: optimizer {i} ({_name(o)}) has a param group "
                                     f"of {len(group['params'])} parameters numbered [{p0}, {p1}), the state "
                                     f"{numbers}: build the optimizers with the saved run's groups")
            parts.append({"state": {int(n) - p0: s for n, s in state.items() if p0 <= int(n) < p1},
                          "param_groups": [{**g, "params": [int(n) - p0 for n in g["params"]]} for g in mine]})
        before = [o.state_dict() for o in self.optimizers]
        before = [{"state": {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                             for n, s in sd["state"].items()},
                   "param_groups": [dict(g) for g in sd["param_groups"]]} for sd in before]
        try:
            for o, part in zip(self.optimizers, parts):
                o.load_state_dict(part)
        except Exception:
            for o, sd in zip(self.optimizers, before):
                o.load_state_dict(sd)
            raise


class SchedulerList:
    """Several learning-rate schedulers stepped as one (module docstring): ``step()`` steps each (a None entry is
    no scheduler); ``last_epoch`` is the sum of theirs (what ``gaengine.update.SchedulerWatch`` compares: one
    stepped outside ``acc.step()`` moves it); ``state_dict()`` / ``load_state_dict`` hold each one's, the load all or
    nothing (a failure puts every scheduler back as it was)."""

    def __init__(self, schedulers: Sequence[Any]) -> None:
        self.schedulers = list(schedulers)

    def __repr__(self) -> str:
        return f"SchedulerList({', '.join(type(s).__name__ for s in self.schedulers)})"

    def step(self) -> None:
        for s in self.schedulers:
            if s is not None:
                s.step()

    @property
    def last_epoch(self) -> int | None:
        epochs = [getattr(s, "last_epoch", None) for s in self.schedulers if s is not None]
        return sum(epochs) if epochs and all(isinstance(e, int) for e in epochs) else None

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [None if s is None else s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("schedulers") if isinstance(state_dict, dict) else None
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.schedulers) or any(
                (s is None) != (d is None) for s, d in zip(self.schedulers, saved)):
            raise ValueError(f"SchedulerList.load_state_dict: expected {{'schedulers': [...]}} with one entry per "
                             f"scheduler ({len(self.schedulers)}, None where there is none), as state_dict() returns")
        before = self.state_dict()["schedulers"]
        try:
            for s, d in zip(self.schedulers, saved):
                if s is not None:
                    s.load_state_dict(dict(d))
        except Exception:
            for s, d in zip(self.schedulers, before):
                if s is not None:
                    s.load_state_dict(d)
            raise


def check_sharded_list(optimizer: OptimizerList, where: str) -> None:
    """``ValueError`` naming the first optimizer of the list that is not elementwise (``gaengine.optimizers``'
    table) when the list is to run ``where`` (an FSDP2 model): FSDP2 gives every optimizer its DTensor shards of the
    parameters, which only an elementwise update can take. (``zero_stage`` 1 and 2 of a plain model run any list:
    whole-matrix owners, ``gaengine.zero.WholeOwners``.)"""
    for i, o in enumerate(optimizer.optimizers):
        if not is_elementwise(o):
            raise ValueError(
                f"optimizer[{i}] ({_name(o)}) is not an elementwise optimizer of gaengine.optimizers.OPTIMIZERS "
                f"({', '.join(elementwise_names())}), and {where} gives each optimizer its shards of the parameters, "
                "which only an elementwise update can take (a whole-matrix optimizer such as Muon or Adafactor needs "
                "each matrix whole). Pass the plain model instead, with zero_stage=1 or 2 (each matrix whole on one "
                "owner rank) or 0; or register the class as elementwise (gaengine.optimizers.register_optimizer) if "
                "its update of an element reads only that element")


def combine(optimizer: Any, lr_scheduler: Any, zero_stage: int = 0) -> tuple[Any, Any]:
    """``GradientAccumulator``'s ``optimizer`` and ``lr_scheduler`` as its stages take them: one optimizer (or None)
    and its scheduler unchanged; a list or tuple of optimizers as one ``OptimizerList``, with ``lr_scheduler`` None
    or a list or tuple of as many schedulers (None entries allowed) as one ``SchedulerList``.

    Raises ``TypeError`` for an entry that is not a ``torch.optim.Optimizer`` (naming its index) or whose ``step()``
    needs an argument (``gaengine.update.check_optimizer_step``: a closure optimizer such as ``LBFGS``),
    ``ValueError`` for an empty list, one optimizer twice, a scheduler list of another length, a scheduler built over
    another optimizer than the one at its index, or a list of schedulers with one optimizer. Any list runs at every
    ``zero_stage`` (a list holding an optimizer that is not elementwise on whole-matrix owners,
    ``gaengine.zero.WholeOwners``); ``zero_stage`` is accepted for the callers' sake and checks nothing more."""
    if not isinstance(optimizer, (list, tuple)):
        if isinstance(lr_scheduler, (list, tuple)):
            raise ValueError(f"lr_scheduler is a list of {len(lr_scheduler)} schedulers but optimizer is one "
                             "optimizer: pass one scheduler (torch.optim.lr_scheduler.SequentialLR chains several), or "
                             "a list of optimizers with one scheduler each")
        return optimizer, lr_scheduler
    if not optimizer:
        raise ValueError("optimizer is an empty list: pass one optimizer, a list of them, or None")
    for i, o in enumerate(optimizer):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer[{i}] must be a torch.optim.Optimizer, got {type(o).__name__}")
        if any(o is other for other in optimizer[:i]):
            raise ValueError(f"optimizer[{i}] is the same object as an earlier entry: list each optimizer once")
        check_optimizer_step(o)
    if lr_scheduler is None:
        schedulers = None
    elif not isinstance(lr_scheduler, (list, tuple)) or len(lr_scheduler) != len(optimizer):
        got = f"a list of {len(lr_scheduler)}" if isinstance(lr_scheduler, (list, tuple)) else \
            type(lr_scheduler).__name__
        raise ValueError(f"lr_scheduler must be None or a list of {len(optimizer)} schedulers (one per optimizer, "
                         f"None for an optimizer without one) with a list of {len(optimizer)} optimizers, got {got}")
    else:
        for i, (s, o) in enumerate(zip(lr_scheduler, optimizer)):
            held = getattr(s, "optimizer", o)
            if s is not None and held is not o:
                raise ValueError(f"lr_scheduler[{i}] was built over another optimizer than optimizer[{i}] "
                                 f"({type(o).__name__}): list the schedulers in the optimizers' order")
        schedulers = SchedulerList(lr_scheduler)
    return OptimizerList(optimizer), schedulers


def check_coverage(optimizer: Any, params: list[torch.Tensor], module: nn.Module | None) -> None:
    """For an ``OptimizerList``: ``ValueError`` naming the parameter (its module path, or ``param[i]`` for a list
    of parameters) when a parameter is in two optimizers of the list (or twice in one), or a trainable one
    (``params``) is in none. Nothing for one optimizer (a parameter it does not hold is not updated, as in torch)."""
    if not isinstance(optimizer, OptimizerList):
        return
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - as gaengine.sharding: only when checked

    if any(isinstance(p, DTensor) for p in params):
        check_sharded_list(optimizer, "an FSDP2 model (fully_shard)")
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)} if module is not None else {}
    names.update({id(p): f"param[{i}]" for i, p in enumerate(params) if id(p) not in names})
    owner: dict[int, int] = {}
    for i, o in enumerate(optimizer.optimizers):
        for g in o.param_groups:
            for q in g["params"]:
                if id(q) in owner:
                    name = names.get(id(q), f"a parameter of shape {tuple(q.shape)}")
                    where = (f"optimizer[{owner[id(q)]}] and optimizer[{i}]" if owner[id(q)] != i
                             else f"optimizer[{i}] twice")
                    raise ValueError(f"parameter {name!r} is in {where}: each parameter must belong to exactly one "
                                     "optimizer of the list (both would update it); remove it from all but one")
                owner[id(q)] = i
    missing = [p for p in params if id(p) not in owner]
    if missing:
        raise ValueError(f"trainable parameter {names[id(missing[0])]!r} (and {len(missing) - 1} more) is in no "
                         f"optimizer of the list: add it to one of them (e.g. AdamW for embeddings, head, norms and "
                         f"biases beside Muon's 2-D hidden weights), or freeze it (requires_grad_(False)) before "
                         f"building the accumulator")
