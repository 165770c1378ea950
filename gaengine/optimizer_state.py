"""How a checkpoint holds one optimized parameter's optimizer state: the optimizer table's answer
(``gaengine.optimizers``), so that ``gaengine.checkpoint`` only moves the items to and from DCP.

Two forms, chosen per optimizer by ``state_form`` (a list of optimizers: all of them elementwise, or not):

* ``RangedMoments`` (the elementwise optimizers of ``gaengine.optimizers.OPTIMIZERS``): ``{"initialized": 0-d,
  "step": 0-d fp64, <moment>: chunk}``, each moment this rank's range ``[lo, hi)`` of the flattened parameter (a
  chunk: ``gaengine.checkpoint.FlatShard``), so it loads on any layout and world size, range by range.
* ``WholeState`` (any other optimizer: Muon, Adafactor, Shampoo, a class with no row): ``{"initialized", "step",
  "whole": bytes}``, the parameter's whole state as ``torch.save`` bytes of CPU copies, saved by the rank that holds
  the parameter whole (its owner at ``zero_stage`` >= 1, every rank replicated) and loaded by the one that holds it
  then, at any world size.

Each form is given the checkpoint's entry of the parameter (``gaengine.checkpoint``'s ``_Entry``), which answers
``key``, ``group``, ``piece``, ``lo``, ``hi``, ``chunk(local)`` (a chunk of this rank's range), ``take(value, what)``
(this rank's elements of a loaded value, checked), ``flat(t, what)`` (a piece's or state tensor's local elements,
flat, in place) and ``shaped(local)`` (a loaded tensor shaped and wrapped like the piece). A layout that holds a
parameter's state otherwise is a new form here and its choice in ``state_form``; ``gaengine.checkpoint`` is
unchanged.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

from gaengine import optimizers, state_checks

__all__ = ["RangedMoments", "WholeState", "cpu_copy", "state_form"]


def cpu_copy(value: Any) -> Any:
    """A tensor's detached CPU copy; anything else as it is."""
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


class RangedMoments:
    """An elementwise optimizer's state by ranges (module docstring)."""

    def save(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], e) -> dict[str, Any]:
        """``e``'s state as a checkpoint holds it: ``initialized`` and ``step`` (0-d), each moment a chunk of this
        rank's range (zeros where the optimizer has not stepped the piece yet)."""
        moment_keys = optimizers.moment_keys(optimizer, optimizer.param_groups[e.group])
        ready = all(isinstance(state.get(k), torch.Tensor) for k in moment_keys) and bool(state)
        step = optimizers.step_key(optimizer, optimizer.param_groups[e.group])  # None: keeps no step count
        entry: dict[str, Any] = {
            "initialized": torch.tensor(float(ready)),
            "step": torch.tensor(float(state[step]) if ready and step in state else 0.0,
                                 dtype=torch.float64),  # host read: once per checkpoint
        }
        for k in moment_keys:
            local = e.flat(state[k], f"optimizer state {k!r} of {e.key}") if ready else \
                torch.zeros(e.hi - e.lo, dtype=e.piece.dtype, device=e.flat(e.piece.data, e.key).device)
            entry[k] = e.chunk(local)
        return entry

    def load(self, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], legacy: Mapping[str, Any],
             e) -> dict[str, Any] | None:
        """The state of ``e``'s piece as saved (``saved``: the checkpoint's ``state['optimizer']``; ``step`` and the
        moments shaped like the piece), or None where the saved run had not stepped it; ``ValueError`` when it is
        missing or of another range. ``legacy`` (an earlier format's whole states in the meta) is not read."""
        entry = saved.get(e.key)
        if not isinstance(entry, dict):
            raise ValueError(f"state['optimizer'][{e.key!r}] is missing: it was saved with another optimizer, "
                             "or take the state dict from this run's accumulator (acc.state_dict()) before "
                             "dcp.load")
        if not float(entry["initialized"]):
            return None
        group = optimizer.param_groups[e.group]
        moments = {}
        for k in optimizers.moment_keys(optimizer, group):  # a chunk is taken as is (no copy)
            value = entry.get(k)
            if not isinstance(value, torch.Tensor):
                raise state_checks.corrupt(f"state['optimizer'][{e.key!r}][{k!r}]", "the moment saved with it "
                                           "(a tensor)", "missing" if k not in entry else type(value).__name__)
            t = e.take(value, "state['optimizer']")
            moments[k] = e.shaped(t if t is _local_of(value) else t.clone())
        step = optimizers.step_key(optimizer, group)  # None: the optimizer keeps no step count (its table row)
        return {**({step: torch.tensor(float(entry["step"]), dtype=torch.float32)} if step else {}), **moments}


def _local_of(value: torch.Tensor) -> torch.Tensor | None:
    """A chunk's local tensor (what ``take`` returns as is, a view of where ``dcp.load`` wrote), or None for a plain
    tensor (whose slice ``take`` returns is copied)."""
    return getattr(value, "local", None)


class WholeState:
    """Any other optimizer's state, whole per parameter (module docstring)."""

    def save(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], e) -> dict[str, Any]:
        """``initialized``, ``step`` (0-d, as a ranged entry's; the step, if any, is in the state) and ``whole``,
        ``torch.save`` bytes of the state with its tensors as CPU copies (any shapes: Adafactor's row and column
        factors, Shampoo's preconditioners)."""
        blob = io.BytesIO()
        torch.save({k: cpu_copy(v) for k, v in state.items()}, blob)
        return {"initialized": torch.tensor(float(bool(state))), "step": torch.tensor(0.0, dtype=torch.float64),
                "whole": blob.getvalue()}

    def load(self, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], legacy: Mapping[str, Any],
             e) -> dict[str, Any] | None:
        """The saved whole state of ``e``'s parameter (a state saved before these entries kept it in the meta's
        ``optimizer_state``, ``legacy``), None where it had none; ``ValueError`` naming the key when it is missing or
        does not decode."""
        entry = saved.get(e.key)
        if entry is None and not saved:  # saved before: whole states in the meta, or none at all
            return dict(legacy.get(e.key, {})) or None
        if not isinstance(entry, Mapping) or "whole" not in entry:
            raise ValueError(f"state['optimizer'][{e.key!r}] is missing or holds no 'whole' state: it was saved with "
                             "another optimizer, or take the state dict from this run's accumulator (acc.state_dict()) "
                             "before dcp.load")
        blob = entry["whole"]
        try:
            loaded = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
        except Exception as exc:
            raise state_checks.corrupt(f"state['optimizer'][{e.key!r}]['whole']", "torch.save bytes of the "
                                       "parameter's optimizer state", type(blob).__name__) from exc
        if not isinstance(loaded, dict):
            raise state_checks.corrupt(f"state['optimizer'][{e.key!r}]['whole']", "a dict", type(loaded).__name__)
        return loaded or None


def state_form(optimizer: Any) -> RangedMoments | WholeState:
    """How a checkpoint holds ``optimizer``'s per-parameter state: ``RangedMoments`` for an elementwise one
    (``gaengine.optimizers.is_elementwise``; a list: every one of it), else ``WholeState``."""
    return RangedMoments() if optimizers.is_elementwise(optimizer) else WholeState()
