"""The accumulator's hold on the model: which parameters it takes, and that the model stays as it was built.

* ``check_arguments``: the model and optimizer arguments of ``GradientAccumulator`` that its configuration
  (``gaengine.config``) cannot check alone.
* ``take``: refuse parameters another live accumulator owns or an optimizer over foreign parameters, and drop a
  ``.grad`` left from before (``UserWarning``): a window holds only its own micro-batches.
* ``claim`` / ``release``: mark each parameter with its accumulator (a weak reference, read by
  ``gaengine.clip`` and ``gaengine.verify``), and unmark it at ``close()``.
* ``ModelWatch``: a model moved or converted after construction raises, for good.
* ``Membership``: parameters that join (unfrozen, or added with ``optimizer.add_param_group``) or leave (frozen)
  after construction, found at the window boundaries (gradual unfreezing; docs/accumulator.md).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from gaengine.clip import OWNER_ATTR
from gaengine.update import check_optimizer_step
from gaengine.zero import check_zero_optimizer

__all__ = ["Membership", "ModelWatch", "check_arguments", "claim", "release", "take"]


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
    the strategy's own check (``ShardingStrategy.check_model``), raising ``RuntimeError``.
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
        self._initial = list(params)
        self._num_groups = 0
        self.candidates: list[tuple[str, torch.Tensor]] = []
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

    def changes(self, managed: list[torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]],
                                                             list[tuple[str, torch.Tensor]]]:
        """``(joined, left)``: the candidates that require grad and are not in ``managed`` (the accumulator's
        parameters), and those in ``managed`` that no longer require grad, each as ``(name, parameter)``."""
        if self.optimizer is not None and len(self.optimizer.param_groups) != self._num_groups:
            self._scan(self._num_groups)
        ids = {id(p) for p in managed}
        joined = [(n, p) for n, p in self.candidates if p.requires_grad and id(p) not in ids]
        left = [(n, p) for n, p in self.candidates if not p.requires_grad and id(p) in ids]
        return joined, left

    def trainable(self) -> list[torch.Tensor]:
        """The candidates that require grad, in ``candidates``' order (the module's registration order first)."""
        return [p for _, p in self.candidates if p.requires_grad]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """What ``GradientAccumulator.named_params`` holds: the module's named parameters and the later groups'
        (empty for a model given as an iterable, as at construction)."""
        return list(self.candidates) if self.module is not None else []
