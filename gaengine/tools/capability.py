"""What this machine computes fast: the parameter dtype the tools train in when none is asked for.

On a GPU, bf16 where the device supports it (``torch.cuda.is_bf16_supported``). On a CPU, bf16 only where its
matmul is not far slower than fp32's: CPUs with a native bf16 dot product (AVX512_BF16, AMX) run bf16 about as fast
as fp32, while an AVX2-only CPU runs it through conversion, 20-30x slower (measured on a 2-core AMD EPYC: 0.6 against
16.8 GFLOP/s). Which one a CPU is cannot be read reliably from its flags alone (oneDNN may be capped by
``ONEDNN_MAX_CPU_ISA``, a hypervisor may hide AVX-512), so :func:`bf16_matmul_slowdown` measures it: a few
milliseconds of matmul in each dtype at start.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

__all__ = ["BF16_SLOWDOWN_LIMIT", "CAP_VARIABLES", "DtypeChoice", "bf16_matmul_slowdown", "choose_param_dtype",
           "cpu_capability", "environment_caps"]

CAP_VARIABLES = (("ONEDNN_MAX_CPU_ISA", "oneDNN"), ("DNNL_MAX_CPU_ISA", "oneDNN"), ("ATEN_CPU_CAPABILITY", "ATen"))
"""The environment variables that cap the instruction set a library uses, read at its first use (oneDNN: the
matmuls, whatever the CPU's flags say; ``DNNL_`` is its older name. ATen: its vectorized kernels): ``(variable,
library)``."""

BF16_SLOWDOWN_LIMIT = 2.0
"""A CPU trains in bf16 by default when its bf16 matmul takes at most this many times fp32's time: a native bf16
CPU measures 0.5-1.2x, an AVX2-only one 20-30x, so any value in between separates them."""


@dataclass(frozen=True)
class DtypeChoice:
    """The default parameter dtype of a tool run and why."""

    dtype: str
    """``"bf16"`` or ``"fp32"`` (a key of :data:`gaengine.tools.train.DTYPES`)."""
    reason: str
    """One line for the run's header, e.g. ``fp32 params: this CPU has no native bf16 matmul (AVX2; bf16 28x
    slower than fp32)``."""


def environment_caps(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """``["oneDNN capped by ONEDNN_MAX_CPU_ISA=AVX2", ...]``: each :data:`CAP_VARIABLES` set (non-empty) in
    ``environ`` (default ``os.environ``), in that order; empty when none is."""
    environ = os.environ if environ is None else environ
    return [f"{library} capped by {name}={environ[name]}" for name, library in CAP_VARIABLES
            if environ.get(name, "").strip()]


def cpu_capability() -> str:
    """The vector instruction set ATen dispatches its CPU kernels to (``torch.backends.cpu.get_cpu_capability()``:
    ``DEFAULT``, ``AVX2``, ``AVX512``, ...) and whether the CPU's flags carry a bf16 dot product (AVX512_BF16 or AMX,
    as torch detects them), e.g. ``AVX2, no bf16 instructions``, then the caps the environment sets
    (:func:`environment_caps`), e.g. ``AVX2, AVX512_BF16 in the CPU's flags, oneDNN capped by
    ONEDNN_MAX_CPU_ISA=AVX2``: the flags say what the CPU has, a cap what the libraries may use of it. Whether the
    matmul uses them is measured by :func:`bf16_matmul_slowdown`."""
    capability = torch.backends.cpu.get_cpu_capability()
    native = []
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        native.append("AVX512_BF16")
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        native.append("AMX")
    flags = f"{' + '.join(native)} in the CPU's flags" if native else "no bf16 instructions"
    return ", ".join([capability, flags, *environment_caps()])


def bf16_matmul_slowdown(size: int = 128, repeats: int = 5) -> float:
    """How many times longer a ``(size, size) @ (size, size)`` matmul takes in bf16 than in fp32 on one CPU thread:
    the best of ``repeats`` timings of each, after one warm-up. One thread, since on a loaded machine a parallel
    region waits for its slowest thread and times the load, not the arithmetic. About 2 ms in all on a CPU with
    native bf16, about 30 ms on an AVX2-only one (size 128)."""
    best = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.ones(size, size, dtype=dtype)
            b = torch.ones(size, size, dtype=dtype)
            a @ b  # warm-up: oneDNN builds its kernel on first use
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
            best[dtype] = min(times)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def choose_param_dtype(device: str | torch.device) -> DtypeChoice:
    """The parameter dtype the tools use on ``device`` when ``--dtype`` is not given (module docstring).

    ``device``: ``"cpu"``, ``"cuda"`` or a ``torch.device``. CUDA: bf16 when ``torch.cuda.is_bf16_supported()``,
    else fp32 (fp16 needs a loss scale the plain recipe does not have). CPU: bf16 when
    :func:`bf16_matmul_slowdown` is at most :data:`BF16_SLOWDOWN_LIMIT`, else fp32.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return DtypeChoice("bf16", f"bf16 params: {name} computes in bf16 natively")
        return DtypeChoice("fp32", f"fp32 params: {name} has no bf16 support")
    slowdown = bf16_matmul_slowdown()
    capability = cpu_capability()
    if slowdown <= BF16_SLOWDOWN_LIMIT:
        return DtypeChoice("bf16", f"bf16 params: this CPU multiplies bf16 about as fast as fp32 ({capability}; "
                                   f"bf16 {slowdown:.1f}x the time of fp32)")
    return DtypeChoice("fp32", f"fp32 params: this CPU has no fast bf16 matmul ({capability}; bf16 "
                               f"{slowdown:.0f}x slower than fp32)")
