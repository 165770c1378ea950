"""Shared benchmark helpers for the scripts in this folder: the timing loop (``time_rounds``: warmup, then
rounds of every variant, with an optional untimed setup per call), a bytes model to GB/s, a table, a results
JSON with versions, git SHA and device name.

One copy of each helper lives in :mod:`gaengine.tools.bench.common` (``gaengine bench`` needs them from an
installed package); this module re-exports them and puts the repository root on ``sys.path`` so that
``python benchmarks/x.py`` can import ``tests.reference``, where the tests get their torch baselines.

Every benchmark states its bytes model (bytes moved per element, by the kernel's own reads and writes),
times each variant with ``time_rounds`` (``time_ms`` and ``time_interleaved`` are its summaries;
CUDA-synchronized when the tensors live on a GPU), prints ``print_table`` with ``ms | GB/s | ratio vs the
torch baseline | % of measured peak`` and, with ``--json PATH``, writes ``write_json`` (results plus
torch/triton versions, git SHA and device name).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from gaengine.tools.bench.common import (  # noqa: E402
    Elapsed,
    device_name,
    environment,
    gb_per_s,
    git_sha,
    print_table,
    time_interleaved,
    time_ms,
    time_rounds,
    write_json,
)

__all__ = ["REPO_ROOT", "Elapsed", "device_name", "environment", "gb_per_s", "git_sha", "print_table",
           "time_interleaved", "time_ms", "time_rounds", "write_json"]
