"""The checks of a saved accumulator state before a byte of it is written (``acc.load_state_dict``,
``gaengine.checkpoint.upgrade``): every field's type and range, and the meta blob's encoding.

A state dict comes from a file: it may be truncated, have flipped bits, miss keys or hold values of another type or
range. ``gaengine.checkpoint`` reads a state in two phases, as a transaction: these checks, then the writes. A check
raises ``ValueError`` naming the key (``state['meta']['ranks'][0]['scalars']['written']``, ...) and what it must
hold, so a refused state leaves the accumulator exactly as it was, and no raw unpickling, ``KeyError``,
``IndexError`` or ``TypeError`` reaches the user.

The meta blob is ``torch.save`` bytes: a zip archive whose records carry a CRC-32 each (``torch.save`` writes them).
``read_meta`` checks them with the standard library's ``zipfile`` (``ZipFile.testzip``) before ``torch.load`` reads
the blob, so a flipped bit in a record is refused instead of decoding to another value; a truncated blob has no
central directory and is refused the same way.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["check_hooks_state", "check_lr_scheduler", "check_meta", "check_param_groups", "check_parts",
           "check_plain_state", "check_scaler_state", "check_tensor", "corrupt", "read_meta"]

_FIX = "the state dict is corrupt or not an acc.state_dict(); load another checkpoint"


def corrupt(key: str, expected: str, got: Any) -> ValueError:
    """The ``ValueError`` of a field ``key`` (as written: ``state['meta']['world_size']``) that must be ``expected``
    and holds ``got`` (shown shortened)."""
    shown = repr(got)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return ValueError(f"{key} must be {expected}, got {shown}: {_FIX}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Records torch.save writes as directories: none (an entry flagged a directory, e.g. by a flipped attribute bit, is
# read by torch's zip reader as empty, and its tensor as whatever memory held).
_DIRECTORY_ATTR = 0x10


def read_meta(state: Mapping[str, Any], key: str = "state['meta']") -> dict[str, Any]:
    """The meta blob ``state['meta']`` decoded: ``torch.save`` bytes of a dict (plain containers, numbers, CPU
    tensors; read with ``weights_only=True``). ``ValueError`` naming ``key`` when it is missing, not bytes, not a
    whole zip archive (truncated), a record fails its CRC-32 (flipped bits), or it does not decode to a dict."""
    if "meta" not in state:
        raise ValueError(f"{key} is missing: {_FIX}")
    blob = state["meta"]
    if isinstance(blob, io.BytesIO):  # DCP may hand a BYTE_IO entry back as a stream
        blob = blob.getvalue()
    if not isinstance(blob, (bytes, bytearray)):
        raise corrupt(key, "the bytes acc.state_dict() saved (torch.save of the meta dict)", type(blob).__name__)
    try:
        with zipfile.ZipFile(io.BytesIO(bytes(blob))) as archive:
            bad = archive.testzip()  # reads every record and checks its CRC-32
            dirs = [info.filename for info in archive.infolist()
                    if info.is_dir() or info.external_attr & _DIRECTORY_ATTR]
    except Exception as exc:  # zipfile raises BadZipFile, EOFError, ValueError, NotImplementedError ... on bad bytes
        raise ValueError(f"{key} does not decode ({len(blob)} bytes: {type(exc).__name__}: {exc}); it is truncated "
                         f"or damaged: {_FIX}") from None
    if bad is not None or dirs:
        what = f"its record {bad!r} fails its CRC-32" if bad is not None else f"its record {dirs[0]!r} is damaged"
        raise ValueError(f"{key} does not decode ({len(blob)} bytes): {what}, the bytes were changed: {_FIX}")
    try:
        meta = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    except Exception as exc:  # unpickling, miniz, UnicodeDecodeError ...: bytes torch cannot read
        raise ValueError(f"{key} does not decode ({len(blob)} bytes: {type(exc).__name__}: {exc}): {_FIX}") from None
    if not isinstance(meta, dict):
        raise corrupt(key, "torch.save bytes of a dict", type(meta).__name__)
    return meta


def _need(mapping: Mapping[str, Any], name: str, where: str) -> Any:
    if not isinstance(mapping, Mapping) or name not in mapping:
        raise ValueError(f"{where}[{name!r}] is missing: {_FIX}")
    return mapping[name]


def check_meta(meta: dict[str, Any], strategy_keys: Sequence[str]) -> None:
    """``ValueError`` naming the key unless ``meta`` (``read_meta``) holds what a ``STATE_FORMAT`` state's meta holds
    (``gaengine.checkpoint.accumulator_state_dict``): ``world_size`` an int >= 1, the strategy's entries
    (``strategy_keys``: ``mode`` None or a str, ``sharded`` and ``window_rows`` bools), ``params`` a list of (key,
    shape, dtype, optimized, master) entries, ``param_groups`` a list of dicts, ``optimizer_type`` None or a str,
    ``lr_scheduler`` None or a dict, ``optimizer_state`` a dict of dicts, ``ranks`` a non-empty list of
    ``{"scalars": dict}`` whose first ``num_micro_batches`` is an int >= 0 (read before the scalars' own checks)."""
    where = "state['meta']"
    world = _need(meta, "world_size", where)
    if not _is_int(world) or world < 1:
        raise corrupt(f"{where}['world_size']", "an int >= 1", world)
    for name in strategy_keys:
        value = _need(meta, name, where)
        if name == "mode" and not (value is None or isinstance(value, str)):
            raise corrupt(f"{where}['mode']", "None or the name of a sharding strategy", value)
        if name != "mode" and not isinstance(value, bool):
            raise corrupt(f"{where}[{name!r}]", "True or False", value)
    params = _need(meta, "params", where)
    if not isinstance(params, (list, tuple)):
        raise corrupt(f"{where}['params']", "a list of (key, shape, dtype, optimized, master weights)", params)
    for i, p in enumerate(params):
        ok = (isinstance(p, (list, tuple)) and len(p) == 5 and isinstance(p[0], str) and isinstance(p[1], (list, tuple))
              and all(_is_int(d) and d >= 0 for d in p[1]) and isinstance(p[2], str) and isinstance(p[3], bool)
              and isinstance(p[4], bool))
        if not ok:
            raise corrupt(f"{where}['params'][{i}]", "(key: str, shape: list of ints, dtype: str, optimized: bool, "
                          "master weights: bool)", p)
    groups = _need(meta, "param_groups", where)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        raise corrupt(f"{where}['param_groups']", "a list of dicts (the optimizer's param groups)", groups)
    opt_type = meta.get("optimizer_type")  # absent from states saved before it was recorded
    if opt_type is not None and not isinstance(opt_type, str):
        raise corrupt(f"{where}['optimizer_type']", "None or the optimizer's class name", opt_type)
    sched = _need(meta, "lr_scheduler", where)
    if sched is not None and not isinstance(sched, dict):
        raise corrupt(f"{where}['lr_scheduler']", "None or the lr_scheduler's state dict", sched)
    whole = _need(meta, "optimizer_state", where)
    if not isinstance(whole, dict) or not all(isinstance(v, dict) for v in whole.values()):
        raise corrupt(f"{where}['optimizer_state']", "a dict of the optimizer's per-parameter state dicts", whole)
    ranks = _need(meta, "ranks", where)
    if not isinstance(ranks, (list, tuple)) or not ranks:
        raise corrupt(f"{where}['ranks']", "a non-empty list (one entry per saving rank)", ranks)
    for r, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not isinstance(entry.get("scalars"), dict):
            raise corrupt(f"{where}['ranks'][{r}]", "a dict holding 'scalars', a dict", entry)
        n = entry["scalars"].get("num_micro_batches")
        if not _is_int(n) or n < 0:
            raise corrupt(f"{where}['ranks'][{r}]['scalars']['num_micro_batches']", "an int >= 0", n)


def check_parts(state: Mapping[str, Any], mid_window: bool) -> None:
    """``ValueError`` naming the key unless the state's tensor parts are dicts: ``master``, ``optimizer`` (its
    entries dicts too) and, mid-window, ``window_grad`` (between windows it may hold ``None``s: a template)."""
    for name in ("master", "optimizer", "window_grad"):
        value = _need(state, name, "state")
        if not isinstance(value, Mapping):
            raise corrupt(f"state[{name!r}]", "a dict keyed by parameter name", type(value).__name__)
    for key, entry in state["optimizer"].items():
        if not isinstance(entry, Mapping):
            raise corrupt(f"state['optimizer'][{key!r}]", "a dict of the parameter's optimizer state",
                          type(entry).__name__)
        for name in ("initialized", "step"):
            value = _need(entry, name, f"state['optimizer'][{key!r}]")
            if not (_is_number(value) or isinstance(value, bool)
                    or (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex())):
                raise corrupt(f"state['optimizer'][{key!r}][{name!r}]", "a number or a one-element tensor", value)


def check_tensor(value: Any, key: str, dtype: torch.dtype | None = None) -> None:
    """``ValueError`` naming ``key`` unless ``value`` is a floating tensor (of ``dtype`` where given)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise corrupt(key, "a floating-point tensor", got)
    if dtype is not None and value.dtype != dtype:
        raise corrupt(key, f"a {dtype} tensor", value.dtype)


# The scalars gaengine.stages.StageStates.load_state_items reads without a default (the others are absent from some
# earlier states).
_SCALAR_KEYS = ("num_micro_batches", "accumulation_steps", "item_mode", "items_host", "items_dev", "loss_sum",
                "failed_backward", "consecutive_skips", "layout_order", "arrival", "written", "scaler")


def check_hooks_state(state: Mapping[str, Any], n_params: int) -> None:
    """``ValueError`` naming the key unless the scalars hold every key ``StageStates.load_state_items`` reads
    (``_SCALAR_KEYS``) and the hooks' part is in range: ``written`` ``n_params``
    bools, ``expected_arrivals`` None (a state saved before it was learned) or ``n_params`` ints >= 1, ``arrival``
    None or layout indices in ``[0, n_params)``, ``window_used`` None or ``n_params`` bools. A state saved
    mid-window must have a parameter written or used: a window of micro-batches none of whose gradients reached a
    parameter is one whose flags were cleared (loading it would drop the saved window's sums)."""
    for name in _SCALAR_KEYS:
        if name not in state:
            raise ValueError(f"state[{name!r}] is missing: {_FIX}")
    written = state.get("written")
    if not isinstance(written, (list, tuple)) or len(written) != n_params or not all(
            isinstance(w, bool) for w in written):
        raise corrupt("state['written']", f"a list of {n_params} bools, one per parameter", written)
    expected = state.get("expected_arrivals")
    if expected is not None and (not isinstance(expected, (list, tuple)) or len(expected) != n_params or not all(
            _is_int(v) and v >= 1 for v in expected)):
        raise corrupt("state['expected_arrivals']", f"None or a list of {n_params} ints >= 1 (gradient arrivals per "
                      "backward)", expected)
    arrival = state["arrival"]
    if arrival is not None and (not isinstance(arrival, (list, tuple)) or not all(
            _is_int(i) and 0 <= i < n_params for i in arrival)):
        raise corrupt("state['arrival']", f"None or a list of layout indices in [0, {n_params})", arrival)
    used = state.get("window_used")
    if used is not None and (not isinstance(used, (list, tuple)) or len(used) != n_params or not all(
            isinstance(u, bool) for u in used)):
        raise corrupt("state['window_used']", f"None or a list of {n_params} bools", used)
    n = state.get("num_micro_batches")
    if n and n_params and not any(written) and not any(used or ()):
        raise ValueError(f"state['written'] is all False in a state saved {n} micro-batch(es) into a window: no "
                         "parameter holds a gradient sum, so the window's sums would be dropped on load. "
                         f"{_FIX[0].upper()}{_FIX[1:]}, or one saved between windows")


def check_scaler_state(state: Any) -> None:
    """``ValueError`` naming the key unless ``state`` (``state['scaler']``, not None) is the loss scaler's state:
    ``scale`` a finite one-element floating tensor > 0, ``growth_tracker`` a one-element tensor, ``dynamic`` a
    bool (``gaengine.scaler.LossScaler.state_dict``)."""
    if not isinstance(state, Mapping):
        raise corrupt("state['scaler']", "None or the loss scaler's state dict", state)
    scale = _need(state, "scale", "state['scaler']")
    if (not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.is_floating_point()
            or not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all())):
        raise corrupt("state['scaler']['scale']", "a one-element floating tensor, finite and > 0", scale)
    tracker = _need(state, "growth_tracker", "state['scaler']")
    if not isinstance(tracker, torch.Tensor) or tracker.numel() != 1:
        raise corrupt("state['scaler']['growth_tracker']", "a one-element tensor", tracker)
    if not isinstance(_need(state, "dynamic", "state['scaler']"), bool):
        raise corrupt("state['scaler']['dynamic']", "True or False", state["dynamic"])


def _same_kind(saved: Any, mine: Any) -> bool:
    """Whether a saved hyper-parameter can stand where this optimizer holds ``mine``: a number for a number (or a
    one-element tensor: a tensor learning rate), a bool for a bool, a sequence of as many numbers for one."""
    if isinstance(mine, bool):
        return isinstance(saved, bool)
    if _is_number(mine) or (isinstance(mine, torch.Tensor) and mine.numel() == 1):
        return _is_number(saved) or (isinstance(saved, torch.Tensor) and saved.numel() == 1)
    if isinstance(mine, (list, tuple)) and all(_is_number(v) for v in mine):
        return isinstance(saved, (list, tuple)) and len(saved) == len(mine) and all(_is_number(v) for v in saved)
    return True  # None, a str, ...: the optimizer's own options, taken as saved


def check_param_groups(saved: Sequence[dict[str, Any]], optimizer: torch.optim.Optimizer | None) -> None:
    """``ValueError`` naming the key when a saved param group's hyper-parameter is of another kind than this
    optimizer's (``_same_kind``: ``lr`` a str, ``betas`` of one number, ...): torch's ``Optimizer.load_state_dict``
    takes them as they are and the next step would fail or train otherwise. The keys themselves are checked by
    ``gaengine.checkpoint._check_optimizer``."""
    if optimizer is None:
        return
    for g, (group, mine) in enumerate(zip(saved, optimizer.param_groups)):
        for name, value in group.items():
            if name in mine and name != "params" and not _same_kind(value, mine[name]):
                raise corrupt(f"state['meta']['param_groups'][{g}][{name!r}]",
                              f"of the kind this optimizer holds ({mine[name]!r})", value)


def check_lr_scheduler(saved: dict[str, Any] | None, scheduler: Any) -> None:
    """``ValueError`` naming the key when the saved ``lr_scheduler`` state would not load into ``scheduler``
    without changing it into something else: ``last_epoch`` not an int, or a per-group list (``base_lrs``,
    ``_last_lr``) of another length than ``scheduler``'s."""
    if saved is None or scheduler is None or not hasattr(scheduler, "state_dict"):
        return
    mine = scheduler.state_dict()
    for name in ("last_epoch", "_step_count"):
        if name in mine and name in saved and not _is_int(saved[name]):
            raise corrupt(f"state['meta']['lr_scheduler'][{name!r}]", "an int", saved[name])
    for name in ("base_lrs", "_last_lr"):
        if isinstance(mine.get(name), list) and name in saved and (
                not isinstance(saved[name], (list, tuple)) or len(saved[name]) != len(mine[name])):
            raise corrupt(f"state['meta']['lr_scheduler'][{name!r}]", f"a list of {len(mine[name])} (one per param "
                          "group)", saved[name])


_PLAIN_KEYS = ("param_shapes", "param_dtypes", "world_size", "master", "main_grad", "layout_order")


def check_plain_state(state: Mapping[str, Any]) -> None:
    """``ValueError`` naming the key unless ``state`` holds what a ``PLAIN_FORMAT`` state held: ``param_shapes``
    (lists of ints), ``param_dtypes`` (strs), ``world_size`` (an int >= 1), ``master`` (None or an fp32 tensor),
    ``main_grad`` (an fp32 tensor) and ``layout_order`` (a list); the scalars are checked by
    ``StageStates.check_state_items`` after."""
    for name in _PLAIN_KEYS:
        _need(state, name, "state")
    shapes, dtypes = state["param_shapes"], state["param_dtypes"]
    if not isinstance(shapes, (list, tuple)) or not all(
            isinstance(s, (list, tuple)) and all(_is_int(d) for d in s) for s in shapes):
        raise corrupt("state['param_shapes']", "a list of shapes (lists of ints)", shapes)
    if not isinstance(dtypes, (list, tuple)) or not all(isinstance(d, str) for d in dtypes):
        raise corrupt("state['param_dtypes']", "a list of dtype names", dtypes)
    if not _is_int(state["world_size"]) or state["world_size"] < 1:
        raise corrupt("state['world_size']", "an int >= 1", state["world_size"])
    if state["master"] is not None:
        check_tensor(state["master"], "state['master']", torch.float32)
    check_tensor(state["main_grad"], "state['main_grad']", torch.float32)
    if not isinstance(state["layout_order"], (list, tuple)):
        raise corrupt("state['layout_order']", "a list of registration indices", state["layout_order"])
