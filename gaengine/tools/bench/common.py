"""The shared part of every benchmark: the timing loop, ratios and their spread, a bytes model to GB/s,
the environment of a run (versions, git SHA, device name), a table, a results JSON; kineto's log kept off
stderr while a benchmark profiles. ``benchmarks/*.py`` import these through ``benchmarks/common.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gaengine.tools import WIDTH, fill

PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the repository root in a checkout / editable install


def sync(device: torch.device | str | None) -> None:
    """Wait for ``device``'s queued work when it is a CUDA device; nothing otherwise."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _events(device: torch.device | str | None) -> tuple | None:
    """A start and an end ``torch.cuda.Event`` (timing enabled) on ``device``'s current stream when it is a CUDA
    device, else None: a CUDA call is timed by events recorded around it, inside a region synchronized before and
    after (the host clock alone would read the launches of an asynchronous call, not its kernels)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


class Elapsed(float):
    """Seconds a benchmark function measured itself, returned by it to :func:`time_rounds` in place of the wall
    time of the whole call: for a call that holds untimed work between its timed parts (the host benchmark's
    window times its K backward calls, not the forwards between them). Its CPU time is not known (None)."""


@dataclass(frozen=True)
class Rounds:
    """What :func:`time_rounds` measured: name -> one entry per timed round, in round order.

    ``ms``: wall milliseconds of each call (``time.perf_counter``; on a CUDA device the elapsed time of CUDA events
    recorded around it), or what the function returned as
    :class:`Elapsed`; ``cpu_ms``: this process's CPU milliseconds over the same call (``time.process_time``:
    every thread of the process; time spent descheduled is left out), None for an :class:`Elapsed` call.
    """

    ms: dict[Hashable, list[float]]
    cpu_ms: dict[Hashable, list[float | None]]


Timed = Callable[[], object] | tuple[Callable[[], object] | None, Callable[[], object]]
"""A function to time, or ``(setup, fn)``: ``setup()`` (untimed, may be None) runs right before each ``fn()``."""


def time_rounds(fns: Mapping[Hashable, Timed], *, device: torch.device | str | None = None, warmup: int = 3,
                repeats: int = 15, shuffle: bool = True) -> Rounds:
    """The timing loop of every benchmark: each function once per round, ``warmup`` untimed rounds, then
    ``repeats`` timed ones, so that all of them see the same machine.

    fns: name -> ``fn`` or ``(setup, fn)`` (:data:`Timed`); ``setup()`` runs untimed before each call of ``fn``.
    On a CUDA ``device`` the device is synchronized before and after each timed call, and the call is timed by CUDA
    events recorded right before and after it (its ``ms``: the events' elapsed time). A function
    that times only part of its call returns :class:`Elapsed` seconds, taken instead of the call's wall time.
    On a shared machine the bandwidth one process gets drifts by 2x from one second to the next; per-round
    ratios cancel that drift. With ``shuffle`` (the default) the order is shuffled each round (seeded: the same
    orders every run), so that no function always runs first or after the same neighbour (whose data may still
    sit in a cache, or whose temporaries the allocator must hand back); without it every round runs ``fns`` in
    their order (for functions that must run in sequence, e.g. each feeding the next round's state).
    Returns the :class:`Rounds`. Raises ValueError for ``warmup`` < 0 or ``repeats`` < 1.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"time_rounds needs warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    items = [(name, fn if isinstance(fn, tuple) else (None, fn)) for name, fn in fns.items()]
    wall: dict[Hashable, list[float]] = {name: [] for name, _ in items}
    cpu: dict[Hashable, list[float | None]] = {name: [] for name, _ in items}
    order = random.Random(0)
    for r in range(warmup + repeats):
        if shuffle:
            order.shuffle(items)
        for name, (setup, fn) in items:
            if setup is not None:
                setup()
            sync(device)
            events = _events(device)
            t0, c0 = time.perf_counter(), time.process_time()
            if events:
                events[0].record()
            out = fn()
            if events:
                events[1].record()
            sync(device)
            t1, c1 = time.perf_counter(), time.process_time()
            if r >= warmup:
                own = isinstance(out, Elapsed)
                seconds = events[0].elapsed_time(events[1]) * 1e-3 if events else t1 - t0
                wall[name].append((float(out) if own else seconds) * 1e3)
                cpu[name].append(None if own else (c1 - c0) * 1e3)
    return Rounds(wall, cpu)


def time_ms(fn: Callable[[], object], *, device: torch.device | str | None = None, warmup: int = 3,
            repeats: int = 15) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed one by one (:func:`time_rounds`).

    Returns ``{"median_ms", "min_ms", "max_ms"}`` in milliseconds of wall time per call (the device is
    synchronized before and after each timed call when ``device`` is a CUDA device).
    """
    samples_ms = time_rounds({"fn": fn}, device=device, warmup=warmup, repeats=repeats).ms["fn"]
    return {"median_ms": statistics.median(samples_ms), "min_ms": min(samples_ms), "max_ms": max(samples_ms)}


def time_interleaved(fns: dict[Hashable, Timed], *, device: torch.device | str | None = None,
                     warmup: int = 3, repeats: int = 15, shuffle: bool = True) -> dict[Hashable, list[float]]:
    """Name -> the ``repeats`` timed wall milliseconds per call of :func:`time_rounds` (every function once per
    round, round after round; shuffled each round unless ``shuffle=False``)."""
    return time_rounds(fns, device=device, warmup=warmup, repeats=repeats, shuffle=shuffle).ms


def gb_per_s(numel: int, bytes_per_element: float, ms: float) -> float:
    """Bandwidth by a bytes model: ``numel * bytes_per_element`` bytes in ``ms`` milliseconds, in GB/s (1e9)."""
    return numel * bytes_per_element / (ms * 1e-3) / 1e9


def git_sha() -> str:
    """HEAD of the checkout this package runs from (``-dirty`` when tracked files changed), or ``"unknown"``."""
    if not (PACKAGE_ROOT / ".git").exists():  # an installed wheel: no repository to ask
        return "unknown"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PACKAGE_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device | str) -> str:
    """Human-readable name of ``device``: the GPU's name, or the CPU model with the core and thread counts."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, torch threads={torch.get_num_threads()})"


def environment(devices: Sequence[torch.device | str]) -> dict[str, object]:
    """Versions and machine facts recorded next to every result (torch, triton, CUDA, git SHA, device names)."""
    env: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "devices": {str(torch.device(d)): device_name(d) for d in devices},
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton  # noqa: PLC0415 - optional, and only its version is read

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
    return env


MIN_WRAP = 24
"""A wrapped table column (``print_table``'s ``wrap``) is no narrower than this many characters."""


def print_note(text: str, indent: str = "  ", *, flush: bool = False) -> None:
    """Print ``text`` wrapped to :data:`~gaengine.tools.WIDTH` columns (:func:`gaengine.tools.fill`), the lines
    after the first indented by ``indent``."""
    print(fill(text, indent), flush=flush)


def print_table(rows: Sequence[dict[str, object]], columns: Sequence[tuple[str, str, str]],
                title: str | None = None, *, width: int = WIDTH, keep: int = 1, wrap: Sequence[str] = ()) -> None:
    """Print ``rows`` as a Markdown table; ``columns`` are ``(key, header, format)``, e.g. ``("ms", "ms", ".2f")``.

    A missing or None value prints as an empty cell; text columns are left-aligned, numbers right-aligned. The
    title is wrapped (:func:`print_note`). A table wider than ``width`` columns is fitted: first the text of the
    columns whose keys are in ``wrap`` is wrapped at spaces onto continuation rows (the row's other cells empty,
    the text indented by two spaces), down to :data:`MIN_WRAP` characters; a table still too wide is dealt into
    several, left to right, each repeating the first ``keep`` columns (the rows' names), the later ones titled
    ``<title up to its first ':'> (continued)``.
    """
    cells = [[("" if row.get(key) is None else format(row[key], fmt)) for key, _, fmt in columns] for row in rows]
    left = [any(isinstance(row.get(key), str) for row in rows) for key, _, _ in columns]
    headers = [header for _, header, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def table_width(indices: Sequence[int]) -> int:  # "| " + cells joined by " | " + " |"
        return sum(widths[i] + 3 for i in indices) + 1

    lines = [[[v] for v in c] for c in cells]  # row -> column -> the cell's lines
    for i, (key, _, _) in enumerate(columns):
        over = table_width(range(len(columns))) - width
        if key not in wrap or over <= 0 or not cells:
            continue
        target = max(MIN_WRAP, widths[i] - over)
        for row in lines:
            row[i] = textwrap.wrap(row[i][0], target, subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False) or [""]
        widths[i] = max(len(headers[i]), *(len(line) for row in lines for line in row[i]))
    physical = [[[col[j] if j < len(col) else "" for col in row] for j in range(max(len(col) for col in row))]
                for row in lines]

    keep = max(1, min(keep, len(columns)))
    parts = [list(range(keep))]
    for i in range(keep, len(columns)):
        if len(parts[-1]) > keep and table_width(parts[-1] + [i]) > width:
            parts.append(list(range(keep)))
        parts[-1].append(i)
    for n, part in enumerate(parts):
        if title or n:
            print()
            print_note(title if n == 0 else f"{title.split(':')[0] if title else 'table'} (continued)")
        print("| " + " | ".join(headers[i].ljust(widths[i]) for i in part) + " |")
        print("|" + "|".join("-" * (widths[i] + 2) for i in part) + "|")
        for row in physical:
            for line in row:
                print("| " + " | ".join(line[i].ljust(widths[i]) if left[i] else line[i].rjust(widths[i])
                                        for i in part) + " |")


def write_json(path: str | os.PathLike, benchmark: str, params: dict[str, object], rows: Sequence[dict[str, object]],
               devices: Sequence[torch.device | str]) -> None:
    """Write ``{"benchmark", "params", "environment", "results"}`` to ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": benchmark, "params": params, "environment": environment(devices), "results": list(rows)}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print()
    print_note(f"wrote {path}")


def median_ratio(baseline_ms: Sequence[float], ms: Sequence[float]) -> float:
    """Median over rounds of ``baseline / variant`` (> 1: the variant is faster)."""
    return statistics.median(b / v for b, v in zip(baseline_ms, ms))


MIN_ROUNDS = 5
"""A ratio from fewer timed rounds than this is reported as noise, whatever its value."""


def ratio_stats(baseline_ms: Sequence[float], ms: Sequence[float], *, baseline: bool = False) -> dict[str, object]:
    """The per-round ratios ``baseline / variant`` (> 1: the variant is faster) summarized for a result row.

    ``ratio_vs_torch``: their median; ``ratio_p25``/``ratio_p75``: the quartiles (``statistics.quantiles``,
    inclusive), the spread printed beside it; ``ratio_min``/``ratio_max``; ``ratio_rounds``; ``ratio_noise``:
    True when the figure is below the noise, i.e. fewer than :data:`MIN_ROUNDS` rounds or a spread from the
    25th to the 75th percentile that contains 1.0 (half the rounds on either side of "as fast"). ``baseline``:
    the row is the baseline itself (every ratio is 1 by definition, never noise).
    """
    ratios = [b / v for b, v in zip(baseline_ms, ms)]
    if not ratios:
        raise ValueError("ratio_stats needs at least one round")
    p25, _, p75 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    noise = not baseline and (len(ratios) < MIN_ROUNDS or p25 <= 1.0 <= p75)
    return {"ratio_vs_torch": statistics.median(ratios), "ratio_p25": p25, "ratio_p75": p75,
            "ratio_min": min(ratios), "ratio_max": max(ratios), "ratio_rounds": len(ratios), "ratio_noise": noise,
            "ratio_baseline": baseline}


def ratio_text(row: dict) -> str:
    """A row's ratio as printed: ``7.70x [7.12-8.03]`` (median [25th-75th percentile of the per-round ratios]),
    ``~1 (noise) [...]`` when the spread contains 1, ``noise (2 rounds) [...]`` when too few rounds ran,
    ``1 (baseline)`` for the baseline itself, empty for a row without a ratio."""
    if row.get("ratio_vs_torch") is None:
        return ""
    if row.get("ratio_baseline"):
        return "1 (baseline)"
    if "ratio_p25" not in row:
        return f"{row['ratio_vs_torch']:.2f}x"
    spread = f"[{row['ratio_p25']:.2f}-{row['ratio_p75']:.2f}]"
    if row["ratio_rounds"] < MIN_ROUNDS:
        return f"noise ({row['ratio_rounds']} rounds) {spread}"
    if row["ratio_noise"]:
        return f"~1 (noise) {spread}"
    return f"{row['ratio_vs_torch']:.2f}x {spread}"



RATIO_NOTE = ("[p25-p75]: 25th to 75th percentile of the per-round ratios; '~1 (noise)': that spread contains 1, "
               f"'noise (n rounds)': fewer than {MIN_ROUNDS} rounds, too few to tell")


def display_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows with their printed ratio (:func:`ratio_text`) added."""
    return [{**r, "ratio_text": ratio_text(r)} for r in rows]


# kineto (torch.profiler's backend) writes its own log straight to file descriptor 2 at every profiler start and
# stop, e.g. ``USDT:2026-11-23 15:53:10 16485:16485 SyncActivityProfilerHandler.cpp:52] profiler_start``.
_KINETO_LOG_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def without_kineto_log():
    """Run the block with file descriptor 2 captured, then pass on to stderr every line but kineto's own log.

    Kineto prints from C++ (not through Python's ``sys.stderr``, and whatever ``KINETO_LOG_LEVEL`` says in this
    torch: its profiler_start / profiler_stop lines show at the default level), so only the descriptor catches
    it; a warning the profiled code writes meanwhile is kept, in order.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured.read().splitlines(keepends=True)
                            if not _KINETO_LOG_LINE.match(line))
            if kept:
                sys.stderr.write(kept.decode(errors="replace"))
                sys.stderr.flush()
