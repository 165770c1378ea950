"""Shared benchmark helpers: timing (warmup + median), a bytes model to GB/s, a table, a results JSON.

Every benchmark states its bytes model (bytes moved per element, by the kernel's own reads and writes),
times each variant with ``time_ms`` (CUDA-synchronized when the tensors live on a GPU), prints
``print_table`` with ``ms | GB/s | ratio vs the torch baseline | % of measured peak`` and, with
``--json PATH``, writes ``write_json`` (results plus torch version, git SHA and device name).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # so that ``python benchmarks/x.py`` can import ``tests.reference``
    sys.path.insert(0, str(REPO_ROOT))


def _sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], *, device: torch.device | str | None = None, warmup: int = 3,
            repeats: int = 15) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed one by one.

    Returns ``{"median_ms", "min_ms", "max_ms"}`` in milliseconds of wall time per call (the device is
    synchronized before and after each timed call when ``device`` is a CUDA device).
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    samples_ms = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples_ms.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(samples_ms), "min_ms": min(samples_ms), "max_ms": max(samples_ms)}


def gb_per_s(numel: int, bytes_per_element: float, ms: float) -> float:
    """Bandwidth by a bytes model: ``numel * bytes_per_element`` bytes in ``ms`` milliseconds, in GB/s (1e9)."""
    return numel * bytes_per_element / (ms * 1e-3) / 1e9


def git_sha() -> str:
    """The repository's HEAD commit (with ``-dirty`` when the tree has changes), or ``"unknown"``."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device | str) -> str:
    """Human-readable name of ``device``: the GPU's name, or the CPU model with the thread count."""
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
    """Versions and machine facts recorded next to every result."""
    env: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "devices": {str(torch.device(d)): device_name(d) for d in devices},
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton  # noqa: PLC0415

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
    return env


def print_table(rows: Sequence[dict[str, object]], columns: Sequence[tuple[str, str, str]],
                title: str | None = None) -> None:
    """Print ``rows`` as a Markdown table; ``columns`` are ``(key, header, format)``, e.g. ``("ms", "ms", ".2f")``."""
    cells = [[("" if row.get(key) is None else format(row[key], fmt)) for key, _, fmt in columns] for row in rows]
    left = [bool(rows) and isinstance(rows[0].get(key), str) for key, _, _ in columns]  # text left, numbers right
    headers = [header for _, header, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.ljust(w) if lj else v.rjust(w) for v, w, lj in zip(c, widths, left)) + " |")


def write_json(path: str | os.PathLike, benchmark: str, params: dict[str, object], rows: Sequence[dict[str, object]],
               devices: Sequence[torch.device | str]) -> None:
    """Write ``{"benchmark", "params", "environment", "results"}`` to ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": benchmark, "params": params, "environment": environment(devices), "results": list(rows)}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
