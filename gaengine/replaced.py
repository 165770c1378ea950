"""Parameters replaced in the model after the accumulator was built: noticed before the next micro-batch's
backward, and refused naming the parameter.

The accumulator, its hooks and the optimizer hold parameter objects. ``model.load_state_dict(sd, assign=True)``
puts new ``Parameter`` objects in the model, ``model.fc = nn.Linear(...)`` a new layer, ``p.data = x`` may give a
parameter another shape or dtype: from then on the model computes with tensors the accumulator does not hold. Left
alone, the new ones would keep autograd's raw ``.grad`` and never be updated (the optimizer steps the old objects),
and the old ones would get no gradient: a silently frozen layer.

gaengine does not adopt a replaced parameter (the optimizer, its state and the fp32 masters belong to the old one);
``ReplacedParams.check`` raises ``ValueError`` naming it, before anything of the micro-batch is accumulated, and
says how to go on (docs/accumulator.md).

Cost: the module's slots are read again only when a parameter or a submodule was registered anywhere since the last
check (``torch.nn`` calls the global registration hooks installed here, an int increment each, from
``Module.__setattr__``: ``load_state_dict(assign=True)`` and a layer swap go through it), so an ordinary micro-batch
pays one int comparison; the shapes and dtypes are compared once per window (one list comparison).
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
    FSDP2 itself swaps in and out of the modules around forward and backward) is watched for shape and dtype only.
    Build a new one after the accumulator lays its parameters out again (``adopt``)."""

    def __init__(self, module: nn.Module | None, params: list[torch.Tensor]) -> None:
        _install()
        self.module = module
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

    def check(self, window_start: bool) -> None:
        """Before a micro-batch's backward: ``ValueError`` naming the first parameter of the model that is no longer
        the one the accumulator holds (another object in its slot, its layer replaced) or whose shape or dtype
        changed (``window_start``: checked at a window's first micro-batch only). Nothing changed either way."""
        if self._seen != _generation:
            self._check_slots()
            self._seen = _generation
        if window_start and [(p.shape, p.dtype) for p in self.params] != self._kinds:
            i = next(i for i, p in enumerate(self.params) if (p.shape, p.dtype) != self._kinds[i])
            name = next((n for n, _, _, q in self._slots if q is self.params[i]), f"params[{i}]")
            shape, dtype = self._kinds[i]
            raise ValueError(_refused(name, f"is now {tuple(self.params[i].shape)} {self.params[i].dtype}, the "
                                      f"accumulator laid it out as {tuple(shape)} {dtype} (p.data = ... of another "
                                      "shape or dtype)"))

    def _check_slots(self) -> None:
        for name, owner, leaf, p in self._slots:
            try:
                now = self.module.get_parameter(name)
            except AttributeError:
                now = None
            if now is not p or owner._parameters.get(leaf) is not p:
                what = "was removed from the model" if now is None else "is another tensor than the one the " \
                       "accumulator holds (model.load_state_dict(..., assign=True), or its layer replaced: " \
                       "model.layer = nn.Linear(...))"
                raise ValueError(_refused(name, what))


def _is_dtensor(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - imported by torch.distributed anyway

    return isinstance(p, DTensor)


def _refused(name: str, what: str) -> str:
    return (f"parameter {name!r} {what}. The accumulator, its hooks and the optimizer hold the parameter as it was "
            f"at construction, so the new one would keep autograd's raw .grad and never be updated, and the old one "
            f"would get no gradient; gaengine does not adopt a replaced parameter. Nothing of this micro-batch was "
            f"accumulated: the window is as it was. To go on: put the parameter back, or load values in place "
            f"(model.load_state_dict(sd) without assign=True copies into the parameters the accumulator holds); or "
            f"acc.step(force=True) (or acc.zero_grad()), acc.close(), then build the optimizer and a new "
            f"GradientAccumulator over the model as it is now (docs/accumulator.md)")
