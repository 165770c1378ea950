"""Helpers for the parts of gradient accumulation practitioners trip over.

* ``split_batch``: cut one batch (tensors, nested in tuples, lists and dicts) into micro-batches along
  dim 0, with the row count of each, so uneven splits can be weighted exactly (item mode).
* ``scale_lr``: the linear and square-root learning-rate scaling rules for a larger effective batch.
* ``find_micro_batch_size``: the largest micro-batch that fits in memory, found by halving on
  out-of-memory errors, and the accumulation steps that reach the target effective batch.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["MicroBatches", "split_batch", "scale_lr", "find_micro_batch_size", "is_oom_error"]

logger = logging.getLogger("gaengine")


# ---------------------------------------------------------------------------------------- split_batch
class MicroBatches(list):
    """The micro-batches of one batch, in order (a ``list``), and their row counts in ``sizes``.

    Each element has the structure of the batch that was split; its tensors are views (no copy) of
    consecutive rows of the batch's tensors. ``sizes[k]`` is the number of rows (dim-0 length) of
    micro-batch ``k``; ``sum(sizes)`` is the batch's row count.
    """

    def __init__(self, micro_batches: list, sizes: tuple[int, ...]) -> None:
        super().__init__(micro_batches)
        self.sizes: tuple[int, ...] = tuple(sizes)

    @property
    def uneven(self) -> bool:
        """True when the micro-batches do not all hold the same number of rows."""
        return len(set(self.sizes)) > 1

    def __repr__(self) -> str:
        return f"MicroBatches(n={len(self)}, sizes={list(self.sizes)})"


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _collect_rows(obj: Any, path: str, rows: dict[str, int]) -> None:
    """Record the dim-0 length of every tensor leaf of ``obj`` under its path (``batch['x'][1]``)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise ValueError(f"batch: {path} is a 0-d tensor; split_batch splits along dim 0, so every tensor "
                             "needs at least one dimension (give per-row values a leading batch dimension)")
        rows[path] = obj.shape[0]
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect_rows(value, f"{path}[{key!r}]", rows)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            _collect_rows(value, f"{path}[{i}]", rows)
    elif obj is not None:
        raise TypeError(f"batch: {path} is a {type(obj).__name__}; split_batch splits tensors (nested in tuples, "
                        "lists and dicts) and passes None through. Convert per-row data to tensors, or keep "
                        "non-tensor data out of the batch")


def _rebuild(obj: Any, start: int, stop: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[start:stop]
    if isinstance(obj, Mapping):
        items = {key: _rebuild(value, start, stop) for key, value in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:  # a mapping type that cannot be built from a dict (e.g. defaultdict)
            return items
    if isinstance(obj, tuple):
        parts = [_rebuild(value, start, stop) for value in obj]
        return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)  # namedtuples keep their type
    if isinstance(obj, list):
        return [_rebuild(value, start, stop) for value in obj]
    return obj  # None


def split_batch(batch: Any, num_micro_batches: int | None = None, *,
                micro_batch_size: int | None = None) -> MicroBatches:
    """Split ``batch`` along dim 0 into micro-batches; give exactly one of the two sizes.

    batch: a tensor, or tuples / lists / dicts (any ``Mapping``; namedtuples and dict subclasses keep their
        type) nested to any depth whose tensor leaves all have the same dim-0 length N (the rows). ``None``
        leaves are passed through to every micro-batch. Tensors are sliced, not copied: ``(N, ...)`` →
        views ``(n_k, ...)`` on the same device with the same dtype.
    num_micro_batches: K, split into K micro-batches whose sizes differ by at most one row (the first
        ``N % K`` get one extra row, as ``torch.tensor_split``). Requires ``K <= N``.
    micro_batch_size: m, split into ``ceil(N / m)`` micro-batches of m rows; the last holds the remainder
        ``N - (ceil(N / m) - 1) * m`` rows. ``m > N`` gives one micro-batch of N rows.

    Returns ``MicroBatches``: a list of the micro-batches (same structure as ``batch``) with their row
    counts in ``.sizes``. When the sizes differ, a mean loss per micro-batch no longer weights every row
    equally (the engine's mean mode averages micro-batch means); weight them exactly with item mode:
    ``acc.backward(loss_sum, num_items=size)`` (or ``loss_mean * size`` with ``num_items=size``).

    Raises ``ValueError`` naming the argument when both or neither of ``num_micro_batches`` and
    ``micro_batch_size`` are given, either is not an int >= 1, ``num_micro_batches`` exceeds the rows, the
    batch holds no tensor or has no rows, a tensor is 0-d, or the tensors disagree on their dim-0 length;
    ``TypeError`` for a leaf that is neither a tensor nor None.
    """
    if (num_micro_batches is None) == (micro_batch_size is None):
        raise ValueError("give exactly one of num_micro_batches and micro_batch_size, got "
                         f"num_micro_batches={num_micro_batches!r}, micro_batch_size={micro_batch_size!r}")
    rows: dict[str, int] = {}
    _collect_rows(batch, "batch", rows)
    if not rows:
        raise ValueError("batch holds no tensor: nothing to split")
    lengths = set(rows.values())
    if len(lengths) > 1:
        by_length: dict[int, str] = {}
        for path, n in rows.items():
            by_length.setdefault(n, path)
        detail = ", ".join(f"{path} has {n}" for n, path in sorted(by_length.items()))
        raise ValueError(f"batch: tensors disagree on their dim-0 length (rows): {detail}; every tensor must have "
                         "the same number of rows to be split into micro-batches")
    n_rows = lengths.pop()
    if n_rows == 0:
        raise ValueError("batch has 0 rows (dim 0 of its tensors is empty): nothing to split")

    if num_micro_batches is not None:
        k = _check_positive_int("num_micro_batches", num_micro_batches)
        if k > n_rows:
            raise ValueError(f"num_micro_batches={k} exceeds the batch's {n_rows} rows: a micro-batch would be empty")
        base, extra = divmod(n_rows, k)
        sizes = [base + 1] * extra + [base] * (k - extra)
    else:
        m = _check_positive_int("micro_batch_size", micro_batch_size)
        full, rest = divmod(n_rows, m)
        sizes = [m] * full + ([rest] if rest else [])

    micro, start = [], 0
    for size in sizes:
        micro.append(_rebuild(batch, start, start + size))
        start += size
    return MicroBatches(micro, tuple(sizes))


# ---------------------------------------------------------------------------------------- scale_lr
LR_SCALING_RULES = ("linear", "sqrt")


def scale_lr(base_lr: float, base_batch_size: int, effective_batch_size: int, rule: str = "linear") -> float:
    """Learning rate for ``effective_batch_size`` given one tuned at ``base_batch_size``.

    The effective batch of an update is ``micro_batch_size * accumulation_steps * world_size`` (rows or
    samples; use the same unit for both sizes). Gradient accumulation changes the effective batch, not
    the per-step noise of a micro-batch, so the rules apply to it unchanged.

    rule:
      * ``"linear"``: ``base_lr * effective / base``. Goyal et al. 2017, "Accurate, Large Minibatch SGD:
        Training ImageNet in 1 Hour" (arXiv:1706.02677), §2.1, for SGD with momentum; they pair it with a
        gradient warmup over the first epochs, and it breaks down beyond ~8k images on ImageNet.
      * ``"sqrt"``: ``base_lr * sqrt(effective / base)``, keeping the variance of the update constant.
        Krizhevsky 2014, "One weird trick for parallelizing convolutional neural networks"
        (arXiv:1404.5997), §5; Hoffer et al. 2017, "Train longer, generalize better" (arXiv:1705.08741),
        §4. Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"
        (arXiv:2205.10287) derive it for Adam / RMSprop, so it is the usual starting point for AdamW.

    Both rules are heuristics for a starting point, not guarantees; re-tune near the critical batch size.

    base_lr: finite float >= 0. base_batch_size, effective_batch_size: ints >= 1.
    Returns the scaled learning rate (a Python float). Raises ``ValueError`` naming the argument.
    """
    if isinstance(base_lr, bool) or not isinstance(base_lr, (int, float)) or not math.isfinite(base_lr) or base_lr < 0:
        raise ValueError(f"base_lr must be a finite float >= 0, got {base_lr!r}")
    _check_positive_int("base_batch_size", base_batch_size)
    _check_positive_int("effective_batch_size", effective_batch_size)
    ratio = effective_batch_size / base_batch_size
    if rule == "linear":
        return float(base_lr) * ratio
    if rule == "sqrt":
        return float(base_lr) * math.sqrt(ratio)
    raise ValueError(f"rule must be one of {LR_SCALING_RULES}, got {rule!r}")


# ---------------------------------------------------------------------------------------- find_micro_batch_size
# Substrings of RuntimeError messages that mean an allocation failed: CUDA and MPS ("CUDA out of memory",
# "CUDA error: out of memory", "MPS backend out of memory") and the CPU allocator
# ("DefaultCPUAllocator: can't allocate memory").
_OOM_MESSAGES = ("out of memory", "can't allocate memory")


def is_oom_error(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class) and for a
    ``RuntimeError`` whose message reports a failed allocation (``out of memory``, ``can't allocate memory``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _OOM_MESSAGES)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _check_micro_batch_sizes(step_fn: Any, target_batch_size: Any, start: Any, min_size: Any) -> tuple[int, int, int]:
    """Check ``find_micro_batch_size``'s arguments; return ``(target, min_size, first size tried)``.

    Raises ``TypeError`` for a ``step_fn`` that is not callable, ``ValueError`` naming the argument otherwise.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable as step_fn(micro_batch_size), got {type(step_fn).__name__}")
    target = _check_positive_int("target_batch_size", target_batch_size)
    min_size = _check_positive_int("min_size", min_size)
    size = target if start is None else _check_positive_int("start", start)
    if size > target:
        raise ValueError(f"start={size} exceeds target_batch_size={target}: a micro-batch larger than the "
                         "effective batch is never needed")
    if min_size > size:
        raise ValueError(f"min_size={min_size} exceeds the first size tried ({size}); lower min_size or raise start")
    return target, min_size, size


def _out_of_memory_in(step_fn: Callable[[int], Any], size: int) -> RuntimeError | None:
    """Run ``step_fn(size)``: None if it ran; on an out-of-memory error a ``RuntimeError`` with its type and message.

    Only the message is kept: the exception's traceback pins the failed step's frames and tensors, and it is
    gone when this returns. Any other exception propagates unchanged.
    """
    try:
        step_fn(size)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried; others re-raised
        if not is_oom_error(exc):
            raise
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return None


def find_micro_batch_size(
    step_fn: Callable[[int], Any],
    target_batch_size: int,
    start: int | None = None,
    *,
    min_size: int = 1,
) -> tuple[int, int]:
    """Largest micro-batch size that runs, by halving on out-of-memory errors, and its accumulation steps.

    step_fn: called as ``step_fn(micro_batch_size)``; it should run one representative training step
        (forward, ``acc.backward``, and an optimizer step if its state must fit too) on a micro-batch of
        that many rows, and leave no state behind — e.g. end with ``acc.zero_grad()`` in a ``finally``, so
        a half-done backward is not left in the accumulation window. Its return value is ignored.
    target_batch_size: the effective batch (rows per update, on this rank) to reach, int >= 1.
    start: the first size tried (default ``target_batch_size``); ``min_size <= start <= target_batch_size``.
    min_size: the smallest size tried, int >= 1.

    Sizes tried: ``start, start // 2, start // 4, ...`` (never below ``min_size``, which is tried last). On
    an out-of-memory error (``is_oom_error``: ``torch.OutOfMemoryError`` — which is also
    ``torch.cuda.OutOfMemoryError`` — or a ``RuntimeError`` whose message says ``out of memory``), the
    exception and its traceback are dropped (they hold the failed step's tensors), ``gc.collect()`` runs,
    ``torch.cuda.empty_cache()`` runs if CUDA is initialized, and the next size is tried. Any other
    exception propagates unchanged. The first size that runs is returned: the largest of the sequence.

    Returns ``(micro_batch_size, accumulation_steps)`` with ``accumulation_steps = ceil(target /
    micro_batch_size)``. A size that divides the target is not preferred over a larger one that does not
    (a divisor can be much smaller — a prime target has none but 1 — and each halving already costs
    throughput). When it does not divide, ``split_batch(batch, micro_batch_size=size)`` of a
    ``target_batch_size``-row batch gives exactly ``accumulation_steps`` micro-batches, the last one
    holding the remainder, and the effective batch is exactly ``target_batch_size``; weight the uneven
    micro-batches with item mode (``acc.backward(loss_sum, num_items=rows)``) so the update equals the
    large-batch one. (Drawing ``accumulation_steps`` full micro-batches instead gives an effective batch of
    ``micro_batch_size * accumulation_steps``, at most ``micro_batch_size - 1`` rows above the target.)

    Raises ``ValueError`` naming the argument for bad sizes, and ``RuntimeError`` (chained from the last
    out-of-memory error) when even ``min_size`` runs out of memory.
    """
    target, min_size, size = _check_micro_batch_sizes(step_fn, target_batch_size, start, min_size)
    tried: list[int] = []
    while True:
        tried.append(size)
        last_error = _out_of_memory_in(step_fn, size)
        if last_error is None:
            steps = -(-target // size)
            logger.info("gaengine: micro_batch_size=%d fits (tried %s); accumulation_steps=%d for target %d",
                        size, tried, steps, target)
            return size, steps
        _free_memory()
        if size == min_size:
            raise RuntimeError(
                f"find_micro_batch_size: out of memory even at min_size={min_size} (tried {tried}); the model, "
                "its optimizer state or the step itself does not fit: shard or offload, recompute activations, "
                "or shorten sequences"
            ) from last_error
        logger.info("gaengine: micro_batch_size=%d ran out of memory, trying %d", size, max(min_size, size // 2))
        size = max(min_size, size // 2)
