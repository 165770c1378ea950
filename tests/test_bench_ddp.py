"""``python benchmarks/bench_ddp.py --quick`` end to end (2 gloo ranks as processes, every variant: gaengine stage 0,
ZeRO stages 1 and 2, torch DDP; compute, serial, overlap): it exits 0, prints a row per variant, writes its JSON,
and the collectives it counts add up (stage 0: a launch per bucket + the stats all-reduce; the ZeRO compute rows: the
stats all-reduce alone, every reduce-scatter and all-gather answered at once). The script itself stops when a timed
update was skipped or a bulk collective escaped its no-op (the ZeRO compute variant once tripped gaengine's per-rank
micro-batch count check that way). Timings are never asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_ddp.py"
K = 4

VARIANTS = [
    "gaengine, no communication (1-rank group)",
    "gaengine, all-reduces after backward",
    "gaengine, buckets overlapped with backward",
    "torch DDP + no_sync(), no communication",
    "torch DDP + no_sync()",
    "gaengine stage 1 (last micro-batch), no reduce-scatter/all-gather",
    "gaengine stage 1, reduce-scatters after backward",
    "gaengine stage 1, reduce-scatters overlapped with backward",
    "gaengine stage 2 (whole window), no reduce-scatter/all-gather",
    "gaengine stage 2, reduce-scatters after backward",
    "gaengine stage 2, reduce-scatters overlapped with backward",
]


@pytest.mark.multiproc
def test_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "ddp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True,
                          text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    header = proc.stdout.splitlines()[0]
    assert header.startswith(f"2 gloo ranks on CPU, 0.1 M fp32 parameters, K = {K}, "), header
    buckets = int(re.search(r"gaengine's (\d+) buckets of 0\.1 MiB", header).group(1))
    assert buckets >= 2  # the quick model spans several buckets, as the full one does
    for variant in VARIANTS:
        assert f"| {variant} " in proc.stdout, variant

    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "ddp"
    assert {k: payload["params"][k] for k in ("world", "K", "windows", "quick", "bucket_mb")} == {
        "world": 2, "K": K, "windows": 2, "quick": True, "bucket_mb": 0.1}
    rows = {row["variant"]: row for row in payload["results"]}
    assert list(rows) == VARIANTS
    assert all(row["ms"] > 0 for row in rows.values())
    calls = {v: rows[v]["calls"] for v in VARIANTS}
    assert calls[VARIANTS[0]] == 0 and calls[VARIANTS[3]] == 0
    assert calls[VARIANTS[1]] == calls[VARIANTS[2]] == buckets + 1  # each bucket's all-reduce + the stats
    assert calls[VARIANTS[4]] >= 1
    # ZeRO: the compute rows keep only the stats all-reduce; stage 1 reduce-scatters B buckets once per window,
    # stage 2 K times, and both all-gather the parameters (G buckets): 1 + B + G and 1 + K B + G.
    assert calls[VARIANTS[5]] == calls[VARIANTS[8]] == 1
    assert calls[VARIANTS[6]] == calls[VARIANTS[7]] and calls[VARIANTS[9]] == calls[VARIANTS[10]]
    zero_buckets, rest = divmod(calls[VARIANTS[9]] - calls[VARIANTS[6]], K - 1)
    assert rest == 0 and zero_buckets >= 2
    assert calls[VARIANTS[6]] - 1 - zero_buckets >= 1  # the all-gathers


def test_windows_below_two_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--windows", "1"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "--windows must be >= 2" in proc.stderr
