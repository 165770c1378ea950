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
           "time_interleaved", "time_ms", "time_rounds", "tiny_e2e_config", "write_json"]


def tiny_e2e_config(device: str, dtype: str | None = None):
    """The smallest end-to-end configuration that runs every code path (``run_gpu.sh``'s dry run): a 1-layer,
    32-wide GPT, 2 sequences of 16 tokens, K = 2, one warm-up and one timed update; ``dtype`` (``bf16`` | ``fp32``)
    or the machine's choice (:func:`gaengine.tools.bench.e2e_config`)."""
    from dataclasses import replace  # noqa: PLC0415

    from gaengine.tools.bench import e2e_config  # noqa: PLC0415

    base = e2e_config(device, quick=True)
    return replace(base, n_layers=1, d_model=32, n_heads=2, seq_len=16, micro_batch_size=2, accumulation_steps=2,
                   warmup_updates=1, timed_updates=1, dtype=dtype or base.dtype)
