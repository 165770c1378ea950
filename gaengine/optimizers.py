"""What gaengine knows about each optimizer it supports, in one table (``OPTIMIZERS``).

Per optimizer class (``OptimizerSpec``):

* **elementwise**: its update of an element reads only that element's gradient, parameter and state, so it can
  run on any flat range of the parameters: ZeRO (``zero_stage >= 1``) runs only these, and a checkpoint saves
  their state per element (``gaengine.checkpoint``). Only the exact class is: a subclass may not be elementwise.
* **moments**: the state tensors it keeps per parameter besides ``step`` (shaped like the parameter), and those it
  keeps only when a param-group flag is set (``if_group``: key -> flag).
* **keeps_step**: its state holds a ``step`` counter beside the moments (Adam, AdamW; not SGD, not Lion), under the
  key ``STEP_KEY``; **step_device**: where a new one lives (``new_step``): ``"always"`` a 0-d fp32 tensor on the
  parameter's device (gaengine's fused optimizers), ``"fused"`` there when the param group is fused or capturable,
  else a CPU scalar of torch's scalar dtype (torch's Adam/AdamW: ``torch.optim.optimizer._get_scalar_dtype``).
* **writes_model**: it takes the fp32 gradient of a bf16/fp16 parameter as ``p.main_grad`` and writes the rounded
  fp32 master into the model parameter in its own pass (``attach_model_params``; ``gaengine.store``). Subclasses
  inherit it.
* **grad_scale**: when its ``step()`` takes ``grad_scale``/``found_inf`` (torch.amp.GradScaler's protocol, which
  gaengine uses to fold normalization, clipping and the skip into the update): ``"fused"`` with ``fused=True``.

torch's Adam, AdamW and SGD are listed here; ``gaengine.optim`` adds ``FusedAdamW`` and ``FusedLion`` when it is
imported (``register_optimizer``). Adding an optimizer is one ``register_optimizer`` call beside its class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OPTIMIZERS", "OptimizerSpec", "STEP_KEY", "elementwise_names", "is_elementwise", "keeps_step",
           "moment_keys", "new_step", "register_optimizer", "step_key", "takes_grad_scale", "writes_model_params"]

STEP_KEY = "step"
"""The state key of the step counter of every optimizer that keeps one (``keeps_step``), torch's."""


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """One row of ``OPTIMIZERS`` (module docstring)."""

    name: str
    """How messages name it: ``torch.optim.AdamW``."""
    elementwise: bool
    moments: tuple[str, ...] = ()
    """State tensors kept per parameter in every param group."""
    if_group: dict[str, str] = field(default_factory=dict)
    """State tensor -> the param-group flag under which it is kept (``{"max_exp_avg_sq": "amsgrad"}``)."""
    keeps_step: bool = True
    step_device: str = "fused"
    """Where a new step count lives (``new_step``): ``"always"`` on the parameter's device, or ``"fused"``."""
    writes_model: bool = False
    grad_scale: str = "fused"
    """``"fused"``: ``step()`` takes ``grad_scale``/``found_inf`` when built with ``fused=True``."""


OPTIMIZERS: dict[type, OptimizerSpec] = {
    torch.optim.Adam: OptimizerSpec(name="torch.optim.Adam", elementwise=True, moments=("exp_avg", "exp_avg_sq"),
                                    if_group={"max_exp_avg_sq": "amsgrad"}),
    torch.optim.AdamW: OptimizerSpec(name="torch.optim.AdamW", elementwise=True, moments=("exp_avg", "exp_avg_sq"),
                                     if_group={"max_exp_avg_sq": "amsgrad"}),
    torch.optim.SGD: OptimizerSpec(name="torch.optim.SGD", elementwise=True, keeps_step=False,
                                   if_group={"momentum_buffer": "momentum"}),
}


def register_optimizer(cls: type, spec: OptimizerSpec) -> None:
    """Add (or replace) ``cls``'s row of ``OPTIMIZERS``."""
    OPTIMIZERS[cls] = spec


def _of_group(optimizer: Any, group: dict[str, Any] | None) -> Any:
    """The optimizer that holds param group ``group``: ``optimizer`` itself, or for a list of optimizers
    (``gaengine.optimizer_list.OptimizerList``) the one of the list whose groups hold it (``group`` None: the list,
    when all its optimizers are of one class, else ``KeyError``)."""
    inner = getattr(optimizer, "optimizer_of_group", None)
    if inner is None:
        return optimizer
    if group is not None:
        return inner(group)
    classes = {type(o) for o in optimizer.optimizers}
    if len(classes) != 1:
        raise KeyError("a list of optimizers of several classes: name the param group")
    return optimizer.optimizers[0]


def each_optimizer(optimizer: Any) -> list[Any]:
    """The optimizers of a list of optimizers (``gaengine.optimizer_list.OptimizerList``), else ``[optimizer]``."""
    return list(optimizer.optimizers) if hasattr(optimizer, "optimizer_of_group") else [optimizer]


def _spec(optimizer: Any, exact: bool) -> OptimizerSpec | None:
    if exact:
        return OPTIMIZERS.get(type(optimizer))
    return next((OPTIMIZERS[c] for c in type(optimizer).__mro__ if c in OPTIMIZERS), None)


def is_elementwise(optimizer: Any) -> bool:
    """``optimizer``'s exact class is an elementwise one of ``OPTIMIZERS`` (a list of optimizers: each one's is)."""
    if hasattr(optimizer, "optimizer_of_group"):
        return all(is_elementwise(o) for o in optimizer.optimizers)
    spec = _spec(optimizer, exact=True)
    return spec is not None and spec.elementwise


def elementwise_names() -> list[str]:
    """The names of the elementwise optimizers, for messages."""
    return [s.name for s in OPTIMIZERS.values() if s.elementwise]


def moment_keys(optimizer: Any, group: dict[str, Any]) -> list[str]:
    """The state tensors an elementwise ``optimizer`` keeps per parameter of param group ``group`` (besides
    ``step``). ``KeyError`` for an optimizer that is not elementwise."""
    optimizer = _of_group(optimizer, group)
    spec = _spec(optimizer, exact=True)
    if spec is None or not spec.elementwise:
        raise KeyError(f"{type(optimizer).__name__} is not an elementwise optimizer of gaengine.optimizers.OPTIMIZERS")
    return list(spec.moments) + [k for k, flag in spec.if_group.items() if group.get(flag)]


def keeps_step(optimizer: Any, group: dict[str, Any] | None = None) -> bool:
    """An elementwise ``optimizer``'s state holds a ``step`` beside its moments (``keeps_step``); for a list of
    optimizers, the one holding param group ``group``. ``KeyError`` for an optimizer that is not elementwise."""
    optimizer = _of_group(optimizer, group)
    spec = _spec(optimizer, exact=True)
    if spec is None or not spec.elementwise:
        raise KeyError(f"{type(optimizer).__name__} is not an elementwise optimizer of gaengine.optimizers.OPTIMIZERS")
    return spec.keeps_step


def step_key(optimizer: Any, group: dict[str, Any] | None = None) -> str | None:
    """The state key of an elementwise ``optimizer``'s step count (``STEP_KEY``), or None when it keeps none (a list
    of optimizers: the one holding param group ``group``). ``KeyError`` for an optimizer that is not elementwise."""
    return STEP_KEY if keeps_step(optimizer, group) else None


def new_step(optimizer: Any, group: dict[str, Any], device: torch.device, value: float) -> torch.Tensor:
    """A step count of value ``value`` as ``optimizer`` creates it at a parameter's first update (``step_device``):
    a 0-d fp32 tensor on ``device`` for a row with ``"always"`` and for a fused or capturable param ``group``
    (torch: fp64 for a capturable one where the default dtype is fp64); else a CPU scalar of torch's scalar dtype
    (fp64 where the default dtype is fp64, else fp32: ``torch.optim.optimizer._get_scalar_dtype``)."""
    optimizer = _of_group(optimizer, group)
    spec = _spec(optimizer, exact=False)
    fused = bool(group.get("fused")) or (spec is not None and spec.step_device == "always")
    if fused or group.get("capturable"):
        dtype = torch.float32 if fused or torch.get_default_dtype() != torch.float64 else torch.float64
        return torch.tensor(value, dtype=dtype, device=device)
    return torch.tensor(value, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)


def writes_model_params(optimizer: Any) -> bool:
    """``optimizer`` writes the rounded masters into the model itself (``writes_model``: ``gaengine.optim.FusedAdamW``
    and its subclasses)."""
    spec = _spec(optimizer, exact=False)
    return spec is not None and spec.writes_model


def takes_grad_scale(optimizer: Any) -> bool:
    """``optimizer.step()`` takes ``grad_scale``/``found_inf``: a ``"fused"`` row of ``OPTIMIZERS`` (or an optimizer
    outside the table, such as torch's other fused ones) built with ``fused=True`` that follows torch.amp.GradScaler's
    protocol (``_step_supports_amp_scaling``)."""
    spec = _spec(optimizer, exact=False)
    if spec is not None and spec.grad_scale != "fused":
        return False
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False) and optimizer.defaults.get("fused"))
