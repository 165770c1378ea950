"""``benchmarks/run_gpu.sh`` proven on the CPU (``DRY_RUN=1``): every Python step it runs on a GPU runs here at
tiny sizes to the end and writes its results, so that an import, an attribute or a version difference fails in CI
and not on a lent GPU; one results file for the device and a summary table come out; the checkout is left as it
was (the script commits and writes nothing there); a failing step does not stop the ones after it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"
STEPS = ["bench-kernels", "bench-host", "bench-fusion", "bench-e2e", "bench-memory", "bench-accumulate", "bench-step",
         "e2e-defaults", "train-fusion-off", "train-fusion-on", "profile-e2e"]
WITH_JSON = [s for s in STEPS if not s.startswith("train-")]

pytestmark = [pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"), pytest.mark.multiproc]


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True).stdout if (ROOT / ".git").exists() else ""


def _run(tmp_path: Path, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "DRY_RUN": "1", "PYTHON": python, "LOG_DIR": str(tmp_path / "logs"),
               "RESULTS_DIR": str(tmp_path / "results"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=1200)


def _steps(tmp_path: Path) -> dict[str, int]:
    lines = (tmp_path / "logs" / "steps.tsv").read_text().splitlines()
    return {line.split("\t")[0]: int(line.split("\t")[1]) for line in lines}


@pytest.mark.slow
def test_dry_run_runs_every_step_to_the_end(tmp_path):
    before = _git_status()
    proc = _run(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert _steps(tmp_path) == dict.fromkeys(STEPS, 0), out[-6000:]
    payload = json.loads((tmp_path / "results" / "dry-run-cpu.json").read_text())
    assert list(payload["steps"]) == STEPS
    for name in WITH_JSON:  # each step's own JSON, with rows
        results = payload["steps"][name]["results"]
        assert results and results["results"], name
    memory = payload["steps"]["bench-memory"]["results"]["results"]
    assert any(r.get("fsdp2") for r in memory) and not all(r.get("fsdp2") for r in memory)  # ZeRO and FSDP2 rows
    e2e = {r["variant"] for r in payload["steps"]["e2e-defaults"]["results"]["results"]}
    assert {"gaengine", "gaengine-fusion", "plain"} <= e2e
    summary = (tmp_path / "results" / "dry-run-cpu-summary.md").read_text()
    for name in STEPS:
        assert f"| {name} " in summary, summary
    assert _git_status() == before  # nothing written into the checkout, nothing committed


def test_a_failing_step_does_not_stop_the_next(tmp_path):
    """A PYTHON that fails bench_step.py: that step is recorded as failed, the step after it still runs, the
    summary still comes out, and the script exits 1 naming the failed step."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\nfor a in "$@"; do [[ "$a" == *bench_step.py ]] && exit 3; done\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    proc = _run(tmp_path, python=str(wrapper), ONLY="bench-step e2e-defaults")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert _steps(tmp_path) == {"bench-step": 3, "e2e-defaults": 0}, out[-4000:]
    assert "FAILED steps: bench-step (exit 3)" in out
    assert (tmp_path / "results" / "dry-run-cpu-summary.md").exists()
