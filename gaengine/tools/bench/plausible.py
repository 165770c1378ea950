"""No impossible figure: every timed figure of a benchmark checked against the physical bound measured in the same
run, and a figure over its bound reported as an invalid measurement with its likely cause, never as a result.

Bounds:

* **Bandwidth.** A kernel cannot move its bytes (its bytes model: its own reads and writes) faster than memory
  streams them. The reference is the best round (the fastest of ``repeats``) of the streaming op each benchmark
  times in the same rounds (``a.add_(b)``, 12 B/element; ``dst.copy_(src)``, 8 B/element counted). On a CPU a
  ``copy_`` store to a line not yet in cache reads that line first (write-allocate), so a copy moves 12 B/element
  while it counts 8: its bandwidth is taken as 12/8 of the counted one (:data:`WRITE_ALLOCATE`); ``add_`` has
  already read the line it writes and moves what it counts.
* **Arithmetic.** A model cannot compute faster than the device's matmul: model FLOP/s (e.g. 6 x parameters x
  tokens/s for a transformer's forward and backward) against the best round of a square matmul timed in the same
  run, in the model's dtype (:func:`matmul_peak`).

Margin (:data:`MARGIN` = 1.25, the same for both): the best round of a streaming op is not the memory's rated
bandwidth, and a kernel with more streams can come closer to it. The largest such headroom on record: on the H100
gaengine ran on, fp32 ``a.add_(b)`` reached 2.83 TB/s of the HBM3's rated 3.35 TB/s (84 %), so no kernel can beat
the best ``add_`` by more than 3.35 / 2.83 = 1.18x; on this project's 2-core CPU torch's own fused AdamW (7 streams)
reads 1.06x the median ``add_``. 1.25 covers both with room for one round's noise (a figure is a median, its bound
the best round). Every impossible figure on record is far above it: ``FusedAdamW.step()`` timed as a no-op read
4.08x the H100's ``add_`` and 27.5x this CPU's; a CUDA call timed without waiting for its kernels reads its launch
time only (microseconds against the milliseconds of the work: 10x and more for buffers of 10 M elements or more).

``check_bandwidth`` / ``check_flops`` return the reason a figure is impossible (or None); ``mark`` applies them to
result rows: an impossible row keeps its measured figures under ``row["invalid"]`` (with ``reason``), and its
figure columns become None, so that no table and no reader of the JSON takes them for a result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Bound", "FIGURE_KEYS", "MARGIN", "WRITE_ALLOCATE", "bandwidth_bound", "cache_bytes", "check_bandwidth",
           "check_flops", "invalid_note", "mark", "matmul_peak", "moved_bytes_per_element"]

MARGIN = 1.25
"""How far above the best measured bound a figure may read before it is impossible (derivation: module docstring)."""

WRITE_ALLOCATE = 12 / 8
"""On a CPU, bytes a ``copy_`` into lines not in cache really moves per byte it counts (read-for-ownership)."""

FIGURE_KEYS = ("gb_s", "pct_of_peak", "pct_of_copy", "speedup", "speedup_vs_eager", "ratio_vs_torch",
               "tokens_per_s", "tflop_s", "pct_of_matmul")
"""Row fields that are results derived from a timing; an invalid row has them moved under ``row["invalid"]``."""


def moved_bytes_per_element(op: str, counted: float, device_type: str) -> float:
    """Bytes per element the streaming ``op`` really moves on ``device_type`` when its model counts ``counted``:
    a CPU copy (``copy_``) pays a read of every line it writes (:data:`WRITE_ALLOCATE`), nothing else does."""
    return counted * WRITE_ALLOCATE if device_type == "cpu" and "copy_" in op else counted


@dataclass(frozen=True)
class Bound:
    """A physical bound measured in the run: ``value`` in ``unit`` (``GB/s`` or ``TFLOP/s``), reached by ``op``.

    ``limit`` = ``value`` x :data:`MARGIN`: what no valid figure exceeds.
    """

    value: float
    unit: str
    op: str
    device_type: str = "cpu"
    cache_bytes: int | None = None

    @property
    def limit(self) -> float:
        return self.value * MARGIN


def cache_bytes(device: torch.device | str) -> int | None:
    """The largest cache in front of ``device``'s memory, in bytes: the GPU's L2, the CPU's last-level cache (from
    ``/sys``), or None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or None
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            size = int(text.rstrip("KMG")) * scale
        except ValueError:
            continue
        best = size if best is None else max(best, size)
    return best


def bandwidth_bound(peaks: Iterable[tuple[str, int, float, Sequence[float]]], device: torch.device | str) -> Bound:
    """The best bandwidth measured in this run: over ``peaks``, each ``(op, numel, counted bytes per element,
    timed ms per round)``, the fastest round's bytes really moved (:func:`moved_bytes_per_element`) per second.

    Raises ValueError when no peak has a timed round.
    """
    device = torch.device(device)
    best: tuple[float, str] | None = None
    for op, numel, counted, samples in peaks:
        if not samples:
            continue
        gbs = numel * moved_bytes_per_element(op, counted, device.type) / (min(samples) * 1e-3) / 1e9
        if best is None or gbs > best[0]:
            best = (gbs, op)
    if best is None:
        raise ValueError("bandwidth_bound needs at least one peak with a timed round")
    return Bound(best[0], "GB/s", best[1], device.type, cache_bytes(device))


_NOT_THE_WORK = ("the timed call did not do the work its bytes model counts (a no-op: e.g. an optimizer step on "
                 "parameters that hold no gradient), or returned before that work finished (a CUDA call timed "
                 "without synchronizing or without events around it)")


def check_bandwidth(gb_s: float, bound: Bound, *, working_set_bytes: int | None = None) -> str | None:
    """Why ``gb_s`` (a figure by a bytes model) is impossible against ``bound``, or None when it is within
    ``bound.limit``. ``working_set_bytes``: the bytes the timed call touches, to name the cache as the cause when
    they fit in it."""
    if gb_s <= bound.limit:
        return None
    why = (f"{gb_s:,.1f} GB/s is {gb_s / bound.value:.2f}x the best bandwidth measured in this run "
           f"({bound.value:,.1f} GB/s, {bound.op}), above the {MARGIN}x margin: ")
    if working_set_bytes is not None and bound.cache_bytes is not None and working_set_bytes <= bound.cache_bytes:
        return why + (f"its {working_set_bytes / 2**20:,.1f} MiB fit in the {bound.cache_bytes / 2**20:,.0f} MiB "
                      "cache (time it on buffers several times the cache), or " + _NOT_THE_WORK)
    return why + _NOT_THE_WORK


def check_flops(tflop_s: float, bound: Bound) -> str | None:
    """Why ``tflop_s`` (model FLOP/s in TFLOP/s) is impossible against the matmul ``bound``, or None."""
    if tflop_s <= bound.limit:
        return None
    return (f"{tflop_s:,.2f} TFLOP/s is {tflop_s / bound.value:.2f}x the best matmul measured in this run "
            f"({bound.value:,.2f} TFLOP/s, {bound.op}), above the {MARGIN}x margin: the FLOP count credits work "
            "the timed call did not do, or the timing did not wait for it (a CUDA call timed without "
            "synchronizing)")


def mark(rows: Sequence[dict], check: Callable[[dict], str | None]) -> list[dict]:
    """Apply ``check`` (row -> reason or None) to each row, in place: an impossible row gets ``valid`` False and
    ``invalid`` = {``reason``, and its :data:`FIGURE_KEYS` as measured}, those keys set to None; a possible row
    gets ``valid`` True. Returns the invalid rows."""
    bad = []
    for row in rows:
        reason = check(row)
        row["valid"] = reason is None
        if reason is not None:
            row["invalid"] = {"reason": reason, **{k: row[k] for k in FIGURE_KEYS if row.get(k) is not None}}
            for k in FIGURE_KEYS:
                if k in row:
                    row[k] = None
            bad.append(row)
    return bad


def invalid_note(rows: Sequence[dict], label: str = "variant") -> list[str]:
    """One line per invalid row of ``rows`` (after :func:`mark`): ``INVALID MEASUREMENT <label>: <reason>``."""
    return [f"INVALID MEASUREMENT, not a result: {r.get(label)}: {r['invalid']['reason']}"
            for r in rows if r.get("valid") is False]


def matmul_peak(device: torch.device | str, dtype: torch.dtype, *, n: int | None = None, repeats: int = 5) -> Bound:
    """The device's arithmetic bound, measured: the best of ``repeats`` rounds of an ``n x n @ n x n`` matmul in
    ``dtype`` (2 n^3 FLOPs; ``n``: 8192 on CUDA, 512 on CPU), in TFLOP/s. CUDA rounds are timed with events around
    a synchronized region."""
    from gaengine.tools.bench.common import time_rounds  # noqa: PLC0415 - common imports nothing from here

    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    samples = time_rounds({"mm": lambda: a @ b}, device=device, warmup=1, repeats=repeats).ms["mm"]
    return Bound(2 * n**3 / (min(samples) * 1e-3) / 1e12, "TFLOP/s", f"{dtype} {n}x{n} matmul", device.type)



def _stored_bound(params: dict, device: str) -> Bound | None:
    """The bandwidth bound a results file's ``params`` recorded for ``device``: ``bound_gb_s`` when the run wrote
    it (the best round), else its peak op's median (``peak``, ``peaks``, or ``peak_ms``/``peak_gb_s`` of
    bench_step), the op's moved bytes counted (:func:`moved_bytes_per_element`)."""
    device_type = torch.device(device).type
    if params.get("bound_gb_s"):
        return Bound(float(params["bound_gb_s"]), "GB/s", str(params.get("peak_op", "peak")), device_type)
    peaks = list(params.get("peaks") or [])
    if isinstance(params.get("peak"), dict):
        peaks.append({"device": params.get("device", device), **params["peak"]})
    if params.get("peak_gb_s"):
        peaks.append({"device": params.get("device", device), "op": params.get("peak_op", "peak"),
                      "gb_s": params["peak_gb_s"], "bytes_per_element": None})
    for peak in peaks:
        if torch.device(peak.get("device", device)).type != device_type or not peak.get("gb_s"):
            continue
        counted = peak.get("bytes_per_element")
        if peak.get("bound_gb_s"):
            return Bound(float(peak["bound_gb_s"]), "GB/s", str(peak["op"]), device_type)
        factor = moved_bytes_per_element(peak["op"], counted, device_type) / counted if counted else 1.0
        return Bound(float(peak["gb_s"]) * factor, "GB/s", f"{peak['op']} (median)", device_type)
    return None


def check_payload(payload: dict) -> list[tuple[str, str]]:
    """Re-read a results file's ``payload`` (``write_json``'s ``{"benchmark", "params", "results"}``, or
    ``run_gpu.sh``'s per-device file, whose ``steps`` each hold one) and return ``(row, reason)`` for every row
    whose GB/s is over the bound its own run measured, or that the run itself marked invalid."""
    if "steps" in payload:
        return [(f"{name}: {row}", why) for name, step in payload["steps"].items()
                if isinstance(step.get("results"), dict) for row, why in check_payload(step["results"])]
    params = payload.get("params", {})
    found = []
    for row in payload.get("results", []):
        label = " / ".join(str(row[k]) for k in ("benchmark", "variant", "backend") if row.get(k))
        if row.get("valid") is False:
            found.append((label, row.get("invalid", {}).get("reason", "marked invalid by its run")))
            continue
        if row.get("gb_s") is None:
            continue
        bound = _stored_bound(params, row.get("device", params.get("device", "cpu")))
        if bound is None:
            continue
        reason = check_bandwidth(float(row["gb_s"]), bound)
        if reason is not None:
            found.append((label, reason))
    return found
