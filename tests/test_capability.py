"""The tools' default parameter dtype (``gaengine.tools.capability``): bf16 where the machine multiplies bf16 fast,
fp32 where it does not, the reason printed in ``gaengine train``'s header; ``--dtype`` still forces any dtype."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import pytest
import torch

from gaengine.tools import capability
from gaengine.tools.bench import e2e_config
from gaengine.tools.cli import main
from tests.models import TINY


def _best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize("slowdown,expected", [(0.6, "bf16"), (1.9, "bf16"), (2.1, "fp32"), (28.0, "fp32")])
def test_cpu_choice_follows_the_measured_slowdown(monkeypatch, slowdown, expected):
    monkeypatch.setattr(capability, "bf16_matmul_slowdown", lambda: slowdown)
    choice = capability.choose_param_dtype("cpu")
    assert choice.dtype == expected
    assert choice.reason.startswith(f"{expected} params: ")
    assert torch.backends.cpu.get_cpu_capability() in choice.reason  # which machine it was


def test_measured_slowdown_agrees_with_a_larger_matmul():
    """The start-up probe (128^3, one thread) against an independent, larger measurement (384^3): both on the same
    side of the limit, so the probe's few milliseconds decide as a longer look would."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(384, 384).to(dtype), torch.randn(384, 384).to(dtype)
            a @ b
            times[dtype] = _best_of(lambda: a @ b)
    finally:
        torch.set_num_threads(threads)
    reference = times[torch.bfloat16] / times[torch.float32]
    if 0.5 * capability.BF16_SLOWDOWN_LIMIT < reference < 2 * capability.BF16_SLOWDOWN_LIMIT:
        pytest.skip(f"bf16 is {reference:.1f}x fp32 here: too close to the limit for two timings to agree")
    probe = capability.bf16_matmul_slowdown()
    assert (probe <= capability.BF16_SLOWDOWN_LIMIT) == (reference <= capability.BF16_SLOWDOWN_LIMIT), (probe, reference)
    assert torch.get_num_threads() == threads  # the probe restores torch's thread count


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA caps x86 ISAs")
def test_an_avx2_cpu_trains_in_fp32():
    """oneDNN capped at AVX2 (what an AVX2-only CPU has: no bf16 dot product) in a fresh process: the default
    becomes fp32, and says why."""
    code = ("from gaengine.tools.capability import choose_param_dtype; c = choose_param_dtype('cpu'); "
            "print(c.dtype); print(c.reason)")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    dtype, reason = out.splitlines()[:2]
    assert dtype == "fp32", reason
    assert reason.startswith("fp32 params: this CPU has no fast bf16 matmul (AVX2")
    # The line names the caps: the CPU's flags may carry AVX512_BF16 that oneDNN was told not to use.
    assert "oneDNN capped by ONEDNN_MAX_CPU_ISA=AVX2, ATen capped by ATEN_CPU_CAPABILITY=avx2;" in reason, reason


def test_the_capability_line_names_each_cap_the_environment_sets(monkeypatch):
    """Without a cap the line is the ISA and the flags alone; each variable set adds its library and value."""
    for name, _ in capability.CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    plain = capability.cpu_capability()
    assert "capped" not in plain and capability.environment_caps() == []
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert capability.cpu_capability() == plain + ", oneDNN capped by ONEDNN_MAX_CPU_ISA=AVX2"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert capability.cpu_capability() == plain + (", oneDNN capped by ONEDNN_MAX_CPU_ISA=AVX2, ATen capped by "
                                                   "ATEN_CPU_CAPABILITY=default")
    monkeypatch.setattr(capability, "bf16_matmul_slowdown", lambda: 28.0)
    assert "ATen capped by ATEN_CPU_CAPABILITY=default; bf16 28x slower" in capability.choose_param_dtype("cpu").reason


@pytest.mark.parametrize("forced", [None, "bf16", "fp32"])
def test_train_header_names_the_dtype_and_why(tmp_path, capsys, monkeypatch, forced):
    monkeypatch.setattr(capability, "bf16_matmul_slowdown", lambda: 28.0)  # an AVX2-only CPU
    args = ["train", "--steps", "1", *TINY, "--threads", "1", "--out", str(tmp_path / "run")]
    assert main(args + (["--dtype", forced] if forced else [])) == 0
    stdout = capsys.readouterr().out
    first = stdout.splitlines()[0]
    if forced is None:
        assert first.startswith("gaengine train: fp32 params: this CPU has no fast bf16 matmul")
        assert "28x slower than fp32" in " ".join(stdout.split())  # the header wraps at 100 columns
    else:
        assert first == f"gaengine train: {forced} params (--dtype)"
    assert f"{forced or 'fp32'} params on cpu" in stdout  # the summary's model line: the dtype the run used


def test_bench_e2e_follows_the_choice(monkeypatch):
    for slowdown, dtype in ((28.0, "fp32"), (0.8, "bf16")):
        monkeypatch.setattr(capability, "bf16_matmul_slowdown", lambda s=slowdown: s)
        assert e2e_config("cpu").dtype == dtype
        assert e2e_config("cpu", quick=True).dtype == dtype
