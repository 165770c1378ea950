"""``gaengine bench``: the kernel, host-overhead and end-to-end benchmarks on one device, a table per benchmark.

    gaengine bench [--device cpu|cuda] [--only accumulate l2norm scale host e2e] [--quick] [--threads N]
                   [--host-params P ...] [--json PATH] [--plot PNG]

Each benchmark prints its own table with the columns it has: a kernel ``variant | ms | GB/s | % of peak | vs
torch``, the host benchmark ``dtype | P | variant | ms/window | us/param/mb | added us/param/mb | vs (b) |
launches/mb | buckets``, the end-to-end one ``variant | ms/update | tokens/s | vs plain | peak, peak delta and
peak live MiB | state MiB | state B/param``. Every ratio is the median of per-round ratios, printed with the
25th to 75th percentile of them (:func:`ratio_text`); one whose spread contains 1, or that comes from fewer than
:data:`MIN_ROUNDS` rounds, is printed as noise, not as a figure (:func:`ratio_stats`). The JSON (``--json``)
holds every row with all its fields.

Kernel benchmarks, on flat buffers of ``--numel`` elements (2^25 on CPU, 2^28 on CUDA; 2^20 with ``--quick``),
each gaengine backend that loads on the device (``torch``; ``cpu`` on CPU; ``triton``, ``cuda`` on CUDA) against
the eager torch recipe it replaces. GB/s comes from one bytes model per benchmark (the kernel's own reads and
writes), so a baseline that moves more bytes shows as slow as it is:

* ``accumulate`` bf16 -> fp32, 10 B/element (read grad 2 + read main_grad 4 + write main_grad 4); baseline
  ``main_grad.add_(grad.float())`` (the expression of ``tests.reference.eager_accumulate_``, written out here
  because an installed package has no ``tests``: a cast pass, a temporary, an add).
* ``l2norm`` sum of squares + non-finite flag of an fp32 buffer, 4 B/element (read 4); baselines
  ``torch.linalg.vector_norm(x)`` and ``clip_grad_norm_``'s ``torch._foreach_norm`` over per-parameter views
  followed by the norm of the stacked norms. Neither torch baseline returns a non-finite flag.
* ``scale`` ``x *= coef`` with a 0-d device coefficient, 8 B/element (read 4 + write 4); baselines
  ``x.mul_(coef)`` and ``clip_grad_norm_``'s ``torch._foreach_mul_`` over per-parameter views.

Peak: ``dst.copy_(src)`` of fp32 buffers of the same size on the same device in the same run, 8 B/element
(read 4 + write 4): the streaming bandwidth this device reaches now. ``% of peak`` = GB/s / peak GB/s.
All kernel rows and the peak are timed in interleaved rounds (one call of each per round, in a shuffled
order); ``ms`` is the median over rounds, and a ratio is the median of the per-round ratios ``baseline ms /
variant ms`` (> 1: faster than torch), so a machine shared with other processes shifts every row alike.

Host (``host``): the host time gaengine's backward adds per parameter per micro-batch over the plain recipe,
where it is paid (autograd calls gaengine's post-accumulate hook once per parameter per micro-batch). P leaf
parameters of 32 elements (P = 64, 256, 1024; 32, 128, 512 with ``--quick``; ``--host-params``), bf16 and
fp32, loss ``(stack(params) * c).sum()``: backward is one fill, one mul, one select and one AccumulateGrad
per parameter, each handed a dense gradient. Per parameter per micro-batch the kernels move 6 B/element for
(b) (read the bf16 gradient, read + write ``.grad``) and 10 B/element for (a) (read it, read + write the fp32
main_grad): 192 B vs 320 B, nanoseconds; what is measured is host time. (b) ``loss.backward()`` into
``.grad``; (a) ``GradientAccumulator(params, AdamW(fused=True), accumulation_steps=8)`` with the default
backend, ``acc.backward(loss)``. Each round times one window of every (dtype, P, variant) in a shuffled
order: the wall time of its K = 8 backward calls (forward and update untimed; on CUDA the device is
synchronized before the first and after the last). ``added us/param/mb`` = the median per-round ``(t_a -
t_b) / (P * K)``; the per-parameter figure is the least-squares slope of ``(t_a - t_b) / K`` over P (the
intercept, a fixed cost per micro-batch, printed beside it), against the CPU target of
:data:`HOST_TARGET_US` (1.0 us). ``launches/mb`` over micro-batch 1's backward (the steady state): on CUDA
kernel launches from ``torch.profiler`` (``cudaLaunchKernel``/``cuLaunchKernel`` calls, or the kernels seen
when more), the model's own fill and mul included, for both variants; on CPU the plain recipe's data-touching
ATen ops inside AccumulateGrad (one ``aten::add_`` per parameter) and gaengine's own count,
``acc.hooks.launches``. ``buckets``: gaengine's buckets;
a bucketed accumulate needs buckets + the model's own launches per micro-batch.

End-to-end (``e2e``): the byte-level GPT of :mod:`gaengine.tools.model` in bf16, K = 8 micro-batches per update,
AdamW (lr 1e-3, betas (0.9, 0.95), weight decay 0.1), clipping at 1.0, the same initialization and micro-batches
for every variant. Variants (see :data:`E2E_VARIANTS`): gaengine with ``gaengine.optim.FusedAdamW`` and with
``torch.optim.AdamW(fused=True)``; the plain recipe (bf16 ``.grad`` accumulation of ``(loss / K).backward()``,
``clip_grad_norm_``, fused AdamW on the bf16 params, ``zero_grad(set_to_none=True)``); torch's native fp32
accumulation (``param.grad_dtype = torch.float32``, fp32 master weights with ``master.grad = param.grad``,
``clip_grad_norm_`` and fused AdamW on the masters, then ``torch._foreach_copy_(params, masters)``).
Throughput: every variant on its own model in this process, one update of each per round, round after round;
``ms`` is the median update, tokens/s = tokens per update / that median, the ratio is the median per-round
speedup over the plain recipe. Memory: each variant again in a fresh subprocess (RSS is per process), a short
run: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the process's peak RSS (``VmHWM``) and its growth
above the RSS once the model and data exist; and on both an exact count of gradient + optimizer-state +
master-weight bytes at their high point (the end of a window's last backward), deduplicated by storage.

The generic helpers (``time_ms``, ``time_interleaved``, ``gb_per_s``, ``environment``, ``print_table``,
``write_json``) are the ones ``benchmarks/*.py`` import, through ``benchmarks/common.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "BENCHMARKS",
    "E2EConfig",
    "MIN_ROUNDS",
    "E2E_VARIANTS",
    "add_parser",
    "bench_kernels",
    "bench_host",
    "bench_e2e",
    "device_name",
    "e2e_config",
    "environment",
    "gb_per_s",
    "git_sha",
    "print_table",
    "ratio_stats",
    "ratio_text",
    "run",
    "time_interleaved",
    "time_ms",
    "write_json",
]

BENCHMARKS = ("accumulate", "l2norm", "scale", "host", "e2e")
"""Names accepted by ``--only``, in the order they run."""

ACCUMULATE_BYTES_PER_ELEMENT = 10  # read bf16 grad 2 + read fp32 main_grad 4 + write fp32 main_grad 4
L2NORM_BYTES_PER_ELEMENT = 4  # read fp32 4
SCALE_BYTES_PER_ELEMENT = 8  # read fp32 4 + write fp32 4
PEAK_BYTES_PER_ELEMENT = 8  # fp32 dst.copy_(src): read 4 + write 4
NUM_VIEWS = 16  # per-parameter views of the flat buffer for the foreach baselines (clip_grad_norm_'s kernels)

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the repository root in a checkout / editable install


# ---------------------------------------------------------------------------------------------------- helpers
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


def time_interleaved(fns: dict[str, Callable[[], object]], *, device: torch.device | str | None = None,
                     warmup: int = 3, repeats: int = 15) -> dict[str, list[float]]:
    """Time every function once per round, round after round, so that all of them see the same machine.

    Returns name -> the ``repeats`` timed milliseconds of wall time per call (``warmup`` untimed rounds first;
    the device is synchronized around each call when ``device`` is a CUDA device). On a shared machine the
    bandwidth one process gets drifts by 2x from one second to the next; per-round ratios cancel that drift.
    The order is shuffled each round (seeded), so that no function always runs first or after the same
    neighbour (whose data may still sit in a cache, or whose temporaries the allocator must hand back).
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    order = random.Random(0)
    for r in range(warmup + repeats):
        order.shuffle(items)
        for name, fn in items:
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if r >= warmup:
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return samples


def gb_per_s(numel: int, bytes_per_element: float, ms: float) -> float:
    """Bandwidth by a bytes model: ``numel * bytes_per_element`` bytes in ``ms`` milliseconds, in GB/s (1e9)."""
    return numel * bytes_per_element / (ms * 1e-3) / 1e9


def git_sha() -> str:
    """HEAD of the checkout this package runs from (``-dirty`` when tracked files changed), or ``"unknown"``."""
    if not (_PACKAGE_ROOT / ".git").exists():  # an installed wheel: no repository to ask
        return "unknown"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_PACKAGE_ROOT, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_PACKAGE_ROOT,
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


def print_table(rows: Sequence[dict[str, object]], columns: Sequence[tuple[str, str, str]],
                title: str | None = None) -> None:
    """Print ``rows`` as a Markdown table; ``columns`` are ``(key, header, format)``, e.g. ``("ms", "ms", ".2f")``.

    A missing or None value prints as an empty cell; text columns are left-aligned, numbers right-aligned.
    """
    cells = [[("" if row.get(key) is None else format(row[key], fmt)) for key, _, fmt in columns] for row in rows]
    left = [any(isinstance(row.get(key), str) for row in rows) for key, _, _ in columns]
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


def _median_ratio(baseline_ms: Sequence[float], ms: Sequence[float]) -> float:
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


# ---------------------------------------------------------------------------------------------------- kernels
def _backends(device: torch.device) -> dict[str, Any]:
    """gaengine backends that load and run on ``device``: torch; cpu on CPU; triton and cuda on CUDA.

    Triton on CPU tensors (the interpreter) is a correctness tool, not a benchmark: it is left out.
    """
    from gaengine.backends import get_backend  # noqa: PLC0415 - keeps ``import gaengine.tools.bench`` light

    names = ("torch", "cpu") if device.type == "cpu" else ("torch", "triton", "cuda")
    found = {}
    for name in names:
        try:
            found[name] = get_backend(name, device)
        except RuntimeError as exc:
            print(f"skipping backend {name!r} on {device}: {str(exc).splitlines()[0]}")
    return found


def _split_views(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` contiguous views of flat ``x`` (the last one odd-sized), like a model's per-parameter grads."""
    base = x.numel() // n
    sizes = [base] * (n - 1) + [x.numel() - base * (n - 1)]
    return list(x.split(sizes))


def bench_kernels(device: torch.device, numel: int, which: Sequence[str], *, warmup: int = 3,
                  repeats: int = 15) -> tuple[list[dict], dict]:
    """Time the kernel benchmarks in ``which`` (of accumulate, l2norm, scale) and the peak copy, interleaved.

    Returns the rows (one per variant; the first row of each benchmark is its torch baseline) and the peak
    ``{"op", "ms", "gb_s", "bytes_per_element", "numel"}``. Each gaengine backend is checked against the torch
    result before it is timed (accumulate bitwise, the norm within 1e-2 of fp64).
    """
    g = torch.Generator(device=device).manual_seed(0)
    main_grad = torch.randn(numel, generator=g, device=device)
    grad = torch.randn(numel, generator=g, device=device).to(torch.bfloat16)
    x = torch.randn(numel, generator=g, device=device)
    coef = torch.tensor(1.0 - 2.0**-10, device=device)  # < 1 so that repeated calls stay finite
    src, dst = torch.randn(numel, generator=g, device=device), torch.empty(numel, device=device)
    backends = _backends(device)

    # benchmark -> (bytes per element, [(variant, fn)]); the first variant is the torch baseline.
    plan: dict[str, tuple[int, list[tuple[str, Callable[[], object]]]]] = {}
    if "accumulate" in which:
        variants = [("torch: main_grad.add_(grad.float())", lambda: main_grad.add_(grad.float()))]
        for name, b in backends.items():
            expected = main_grad.clone().add_(grad.float())
            actual = b.accumulate_(main_grad.clone(), grad)
            if not torch.equal(actual.view(torch.int32), expected.view(torch.int32)):
                raise AssertionError(f"backend {name!r}: accumulate_ is not bitwise equal to the eager recipe")
            variants.append((f"gaengine {name}: accumulate_", lambda b=b: b.accumulate_(main_grad, grad)))
        del expected, actual
        plan["accumulate bf16->fp32"] = (ACCUMULATE_BYTES_PER_ELEMENT, variants)
    if "l2norm" in which:
        views = _split_views(main_grad, NUM_VIEWS)
        variants = [
            ("torch: linalg.vector_norm(x)", lambda: torch.linalg.vector_norm(main_grad)),
            (f"torch: _foreach_norm({NUM_VIEWS} views) + norm (clip_grad_norm_)",
             lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(views)))),
        ]
        reference = float(torch.linalg.vector_norm(main_grad.double())) ** 2
        for name, b in backends.items():
            sum_sq, found_inf = b.l2norm_sq(main_grad)
            # 1e-2: a sanity bound, not the tests' tolerance (on one CPU thread torch.dot's fp32 sum of 2^25
            # squares, the torch backend's, is off by 1.3e-3).
            if abs(float(sum_sq) - reference) > 1e-2 * reference or float(found_inf) != 0.0:
                raise AssertionError(f"backend {name!r}: l2norm_sq {float(sum_sq)} != fp64 {reference}")
            variants.append((f"gaengine {name}: l2norm_sq (+ non-finite flag)", lambda b=b: b.l2norm_sq(main_grad)))
        plan["l2norm_sq fp32"] = (L2NORM_BYTES_PER_ELEMENT, variants)
    if "scale" in which:
        x_views = _split_views(x, NUM_VIEWS)
        variants = [("torch: x.mul_(coef)", lambda: x.mul_(coef)),
                    (f"torch: _foreach_mul_({NUM_VIEWS} views, coef) (clip_grad_norm_)",
                     lambda: torch._foreach_mul_(x_views, coef))]
        variants += [(f"gaengine {name}: scale_", lambda b=b: b.scale_(x, coef)) for name, b in backends.items()]
        plan["scale_ fp32"] = (SCALE_BYTES_PER_ELEMENT, variants)

    peak_name = "peak: fp32 dst.copy_(src)"
    fns = {peak_name: lambda: dst.copy_(src)}
    for bench, (_, variants) in plan.items():
        fns.update({(bench, label): fn for label, fn in variants})
    samples = time_interleaved(fns, device=device, warmup=warmup, repeats=repeats)

    peak_ms = statistics.median(samples[peak_name])
    peak = {"op": "fp32 dst.copy_(src)", "ms": peak_ms, "numel": numel, "bytes_per_element": PEAK_BYTES_PER_ELEMENT,
            "gb_s": gb_per_s(numel, PEAK_BYTES_PER_ELEMENT, peak_ms)}
    rows = []
    for bench, (nbytes, variants) in plan.items():
        baseline = samples[(bench, variants[0][0])]
        for i, (label, _) in enumerate(variants):
            t = samples[(bench, label)]
            ms = statistics.median(t)
            gbs = gb_per_s(numel, nbytes, ms)
            rows.append({"benchmark": bench, "variant": label, "device": str(device), "numel": numel,
                         "bytes_per_element": nbytes, "ms": ms, "min_ms": min(t), "max_ms": max(t), "gb_s": gbs,
                         "pct_of_peak": 100.0 * gbs / peak["gb_s"], **ratio_stats(baseline, t, baseline=i == 0)})
    return rows, peak


# ---------------------------------------------------------------------------------------------------- host
HOST_PARAM_COUNTS = (64, 256, 1024)
"""P of the ``host`` benchmark: the slope of the added time over P is its per-parameter figure."""
HOST_PARAM_COUNTS_QUICK = (32, 128, 512)  # ``--quick``: the same fit, a quarter of the parameters
HOST_PARAM_NUMEL = 32  # elements per parameter: kernel time ~0, so the host's time per parameter dominates
HOST_ACCUMULATION_STEPS = 8  # K micro-batches per timed window
HOST_DTYPES = (torch.bfloat16, torch.float32)
HOST_TARGET_US = 1.0
"""CPU target: host microseconds gaengine adds per parameter per micro-batch over the plain recipe."""
HOST_VARIANTS = {"plain": "(b) plain: loss.backward() into .grad", "gaengine": "(a) gaengine: acc.backward(loss)"}

# ATen ops that touch no data (views, metadata, allocation): not counted as accumulate ops; their
# children (if any, e.g. a ``contiguous`` that copies) are.
_NO_DATA_OPS = frozenset(
    "aten::" + n for n in ("detach", "detach_", "view", "view_as", "_unsafe_view", "as_strided", "select", "slice",
                           "narrow", "reshape", "_reshape_alias", "expand", "expand_as", "alias", "t", "transpose",
                           "unsqueeze", "squeeze", "flatten", "contiguous", "empty", "empty_like", "empty_strided",
                           "lift_fresh", "resolve_conj", "resolve_neg", "is_nonzero", "item", "_local_scalar_dense"))
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")


def _host_model(num_params: int, numel: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """``num_params`` leaf parameters of ``numel`` elements and a constant ``c``; the same values for a seed."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g).to(device=device, dtype=dtype))
              for _ in range(num_params)]
    c = torch.randn(num_params, numel, generator=g).to(device=device, dtype=dtype)
    return params, c


def _host_loss(params: Sequence[torch.Tensor], c: torch.Tensor) -> torch.Tensor:
    """``(stack(params) * c).sum()``: backward is one fill, one mul, one select per parameter, then P
    AccumulateGrad nodes, each handed a dense (numel,) gradient."""
    return (torch.stack(list(params)) * c).sum()


def _accumulate_ops(events) -> int:
    """Data-touching ATen ops run inside AccumulateGrad nodes (post-accumulate hooks included), views and
    allocations left out (their children counted)."""

    def count(e) -> int:
        if e.name.startswith("aten::") and e.name not in _NO_DATA_OPS:
            return 1
        return sum(count(ch) for ch in e.cpu_children)

    return sum(count(ch) for e in events if e.name == _ACCUMULATE_GRAD for ch in e.cpu_children)


# kineto (torch.profiler's backend) writes its own log straight to file descriptor 2 at every profiler start and
# stop, e.g. ``USDT:2026-11-23 15:53:10 16485:16485 SyncActivityProfilerHandler.cpp:52] profiler_start``.
_KINETO_LOG_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_kineto_log():
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


def _profile_launches(fn: Callable[[], object], device: torch.device) -> dict[str, int | None]:
    """Run ``fn`` once under ``torch.profiler``; count what it launched.

    ``accumulate_ops``: see :func:`_accumulate_ops`. On CUDA also ``launch_calls`` (host calls of
    ``cudaLaunchKernel``/``cuLaunchKernel`` and their ``Ex`` forms: Triton launches through the driver API)
    and ``gpu_kernels`` (kernel events on the device, memcpy/memset left out).
    """
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with _without_kineto_log():
        with profile(activities=activities) as prof:
            fn()
            _sync(device)
        events = prof.events()
    out: dict[str, int | None] = {"accumulate_ops": _accumulate_ops(events), "launch_calls": None,
                                  "gpu_kernels": None}
    if cuda:
        device_types = (torch.autograd.DeviceType.CUDA,)
        out["launch_calls"] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU
                                  and "LaunchKernel" in e.name and e.name.startswith("cu"))
        out["gpu_kernels"] = sum(1 for e in events if e.device_type in device_types
                                 and not e.name.startswith(("Memcpy", "Memset")))
    return out


def _gaengine_launches(acc) -> tuple[int, str]:
    """gaengine's own count of kernel-launching calls of its accumulate path since construction
    (``acc.hooks.launches``: per bucket on the native and Triton paths, per parameter on the Python hooks)."""
    return acc.hooks.launches, "acc.hooks.launches"


def _num_buckets(acc) -> int:
    """Buckets of ``acc``'s flat buffer (the ones its hooks launch and its reducer all-reduces)."""
    return acc.hooks.num_buckets


class _HostVariant:
    """One variant of the host benchmark on its own P parameters: windows of K micro-batches, backward timed."""

    def __init__(self, variant: str, num_params: int, numel: int, dtype: torch.dtype, device: torch.device,
                 k: int) -> None:
        from gaengine import GradientAccumulator  # noqa: PLC0415

        self.variant, self.device, self.k = variant, device, k
        self.params, self.c = _host_model(num_params, numel, dtype, device)
        hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "fused": True}
        self.opt = torch.optim.AdamW(self.params, **hyper)
        self.acc = None
        if variant == "gaengine":
            self.acc = GradientAccumulator(self.params, self.opt, accumulation_steps=k, max_grad_norm=1.0)
            self._backward = self.acc.backward
        else:
            self._backward = lambda loss: loss.backward()

    def end_window(self) -> None:
        """The update (untimed): ``acc.step()``, or ``opt.step()`` + ``zero_grad(set_to_none=True)``."""
        if self.acc is not None:
            self.acc.step()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def window(self) -> float:
        """One window; returns the wall seconds of its K backward calls (forward untimed; on CUDA the wait for
        the device at the window's end is counted, so no queued work is left out)."""
        total = 0.0
        for i in range(self.k):
            loss = _host_loss(self.params, self.c)
            if i == 0:
                _sync(self.device)
            t0 = time.perf_counter()
            self._backward(loss)
            if i == self.k - 1:
                _sync(self.device)
            total += time.perf_counter() - t0
        self.end_window()
        return total

    def launches(self) -> dict[str, object]:
        """Profile micro-batch 1 of a window (steady state: not the window's first, which overwrites, nor its
        last); gaengine's own launch count over that micro-batch and, per micro-batch, over the whole window."""
        out: dict[str, object] = {}
        own0, source = _gaengine_launches(self.acc) if self.acc is not None else (None, None)
        for i in range(self.k):
            loss = _host_loss(self.params, self.c)
            if i == 1:
                before, _ = _gaengine_launches(self.acc) if self.acc is not None else (None, None)
                out.update(_profile_launches(lambda: self._backward(loss), self.device))
                after, _ = _gaengine_launches(self.acc) if self.acc is not None else (None, None)
                out["gaengine_launches"] = None if before is None or after is None else after - before
            else:
                self._backward(loss)
        own1, _ = _gaengine_launches(self.acc) if self.acc is not None else (None, None)
        out["gaengine_launches_mean"] = None if own0 is None or own1 is None else (own1 - own0) / self.k
        out["gaengine_launches_source"] = source
        self.end_window()
        if self.device.type == "cuda":  # the model's own backward (no AccumulateGrad): fill, mul
            loss = _host_loss(self.params, self.c)
            out["model_launch_calls"] = _profile_launches(
                lambda: torch.autograd.grad(loss, self.params), self.device)["launch_calls"]
        return out

    def close(self) -> None:
        if self.acc is not None:
            self.acc.close()


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(slope, intercept)`` of the least-squares line through ``(xs, ys)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")
    return slope, my - slope * mx


def bench_host(device: torch.device, param_counts: Sequence[int] = HOST_PARAM_COUNTS, *,
               numel: int = HOST_PARAM_NUMEL, dtypes: Sequence[torch.dtype] = HOST_DTYPES,
               k: int = HOST_ACCUMULATION_STEPS, warmup: int = 3, repeats: int = 15) -> tuple[list[dict], dict]:
    """Host time gaengine adds per parameter per micro-batch over the plain recipe, and launches per micro-batch.

    For each dtype and P in ``param_counts``: P leaf parameters of ``numel`` elements, loss
    ``(stack(params) * c).sum()`` (kernel time ~0: what backward costs is host time per parameter). (b)
    ``loss.backward()`` accumulating ``.grad``; (a) ``GradientAccumulator(params, AdamW(fused=True), K)``
    with the default backend, ``acc.backward(loss)``. Each round times one window (K backward calls, forward
    untimed, the update untimed) of every (dtype, P, variant), in a shuffled order; ``warmup`` rounds first.
    Returns the rows (per dtype: (b) and (a) for each P, then the fit over P) and the run's facts.
    """
    if len(param_counts) < 1 or min(param_counts) < 1:
        raise ValueError(f"param_counts must be >= 1, got {param_counts}")
    if k < 3:
        raise ValueError(f"k must be >= 3 (micro-batch 1 is profiled as the steady state), got {k}")
    variants = {(dt, n, v): _HostVariant(v, n, numel, dt, device, k)
                for dt in dtypes for n in param_counts for v in HOST_VARIANTS}
    try:
        items = list(variants.items())
        order = random.Random(0)
        seconds: dict[tuple, list[float]] = {key: [] for key in variants}
        for r in range(warmup + repeats):
            order.shuffle(items)
            for key, hv in items:
                t = hv.window()
                if r >= warmup:
                    seconds[key].append(t)
        launches = {key: hv.launches() for key, hv in variants.items()}
        buckets = {key: _num_buckets(hv.acc) for key, hv in variants.items() if hv.acc is not None}
        some = next(hv.acc for hv in variants.values() if hv.acc is not None)
        backend = some.backend.name
        hooks = getattr(some, "hooks", None)
        hooks = "none" if hooks is None else f"{type(hooks).__name__} (native={getattr(hooks, 'native', '?')})"
    finally:
        for hv in variants.values():
            hv.close()

    cpu = device.type == "cpu"
    target = f"<= {HOST_TARGET_US:.1f}" if cpu else None
    rows: list[dict] = []
    fits: dict[str, dict] = {}
    for dt in dtypes:
        name = _dtype_name(dt)
        added_per_mb_us = []
        for n in param_counts:
            tb, ta = seconds[(dt, n, "plain")], seconds[(dt, n, "gaengine")]
            diffs = [a - b for a, b in zip(ta, tb)]
            added_per_mb_us.append(statistics.median(diffs) / k * 1e6)
            for v, t in (("plain", tb), ("gaengine", ta)):
                lc = launches[(dt, n, v)]
                if not cpu:  # driver-API launches (Triton) may be untraced: never fewer than the kernels seen
                    shown = max(lc["launch_calls"] or 0, lc["gpu_kernels"] or 0)
                elif v == "plain":
                    shown = lc["accumulate_ops"]
                else:
                    shown = "n/a" if lc["gaengine_launches"] is None else lc["gaengine_launches"]
                ms = statistics.median(t) * 1e3
                row = {
                    "benchmark": f"host, {n} {name} params x {numel}",
                    "variant": HOST_VARIANTS[v],
                    "key": f"host-{name}-{n}-{v}",
                    "device": str(device),
                    "dtype": name,
                    "num_params": n,
                    "param_numel": numel,
                    "accumulation_steps": k,
                    "ms": ms,
                    "min_ms": min(t) * 1e3,
                    "max_ms": max(t) * 1e3,
                    "window_ms": [s * 1e3 for s in t],
                    **ratio_stats(tb, t, baseline=v == "plain"),
                    "us_per_param_mb": ms * 1e3 / (n * k),
                    "added_us_per_param_mb": (statistics.median(diffs) / (n * k) * 1e6) if v == "gaengine" else None,
                    "target_us": HOST_TARGET_US if cpu and v == "gaengine" else None,
                    "target": target if v == "gaengine" else None,
                    "launches_per_mb": shown,
                    "accumulate_ops_per_mb": lc["accumulate_ops"],
                    "launch_calls_per_mb": lc["launch_calls"],
                    "gpu_kernels_per_mb": lc["gpu_kernels"],
                    "model_launch_calls_per_mb": lc.get("model_launch_calls"),
                    "gaengine_launches_per_mb": lc["gaengine_launches"],
                    "gaengine_launches_mean_per_mb": lc["gaengine_launches_mean"],
                    "gaengine_launches_source": lc["gaengine_launches_source"],
                    "buckets": buckets.get((dt, n, v)),
                    "backend": backend if v == "gaengine" else None,
                    "hooks": hooks if v == "gaengine" else None,
                }
                rows.append(row)
        if len(param_counts) >= 2:
            slope, intercept = _least_squares(list(param_counts), added_per_mb_us)
        else:
            slope, intercept = added_per_mb_us[0] / param_counts[0], 0.0
        fits[name] = {"slope_us_per_param_mb": slope, "intercept_us_per_mb": intercept,
                      "added_us_per_mb": dict(zip(param_counts, added_per_mb_us))}
        rows.append({
            "benchmark": f"host, {name}, fit over P={','.join(map(str, param_counts))}",
            "variant": "(a) - (b): slope of added us/micro-batch over P",
            "key": f"host-{name}-fit",
            "device": str(device),
            "dtype": name,
            "param_numel": numel,
            "accumulation_steps": k,
            "added_us_per_param_mb": slope,
            "intercept_us_per_mb": intercept,
            "target_us": HOST_TARGET_US if cpu else None,
            "target": target,
            "backend": backend,
        })
    info = {
        "param_counts": list(param_counts), "param_numel": numel, "dtypes": [_dtype_name(d) for d in dtypes],
        "accumulation_steps": k, "warmup": warmup, "repeats": repeats, "backend": backend, "hooks": hooks,
        "target_us_per_param_mb": HOST_TARGET_US if cpu else None, "fit": fits,
        "model": "P leaf params of param_numel elements, loss = (stack(params) * c).sum(); backward: fill, mul, "
                 "one select per param, P AccumulateGrad nodes",
        "ms": "wall time of the K backward calls of one window (forward and update untimed; on CUDA the device "
              "is synchronized before the first and after the last), median over rounds",
        "added": "median over rounds of (t_a - t_b) / (P * K); fit: least-squares slope of median (t_a - t_b) / K "
                 "over P",
        "launches": ("CUDA: kernel launches during micro-batch 1's backward, the model's own included: "
                     "cudaLaunchKernel/cuLaunchKernel(+Ex) calls, or the GPU kernels seen if more (Triton's "
                     "driver-API launches may go untraced); model_launch_calls_per_mb: the same backward through "
                     "torch.autograd.grad, no AccumulateGrad" if not cpu else
                     "CPU: (b) data-touching ATen ops inside AccumulateGrad (aten::add_ per param) during "
                     "micro-batch 1's backward; (a) gaengine's own count of kernel-launching calls over that "
                     "micro-batch (acc.hooks.launches)"),
    }
    return rows, info


# ---------------------------------------------------------------------------------------------------- end to end
E2E_VARIANTS = {
    "gaengine-fused": "(a) gaengine: GradientAccumulator + gaengine.optim.FusedAdamW",
    "gaengine-torch": "(a') gaengine: GradientAccumulator + torch AdamW(fused=True)",
    "gaengine-lean": "(a'') gaengine, master_weights=False: torch AdamW(fused) on bf16 (bf16 m, v)",
    "plain": "(b) plain: bf16 .grad, (loss/K).backward(), clip, AdamW(fused) on bf16",
    "native-fp32": "(c) native: grad_dtype=fp32, clip, AdamW(fused) on fp32 masters",
}
"""End-to-end variants: key -> label. The plain recipe ``plain`` is the baseline of the ratio."""

E2E_BASELINE = "plain"


@dataclass(frozen=True, kw_only=True)
class E2EConfig:
    """Shape and length of the end-to-end benchmark; every variant runs this same configuration."""

    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    n_layers: int = 4
    """Transformer blocks of the GPT."""
    d_model: int = 256
    """Residual width."""
    n_heads: int = 4
    """Attention heads."""
    seq_len: int = 128
    """Tokens (bytes) per sequence; also the model's context length."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    accumulation_steps: int = 8
    """Micro-batches per update (K)."""
    warmup_updates: int = 1
    """Untimed updates of every variant first (optimizer state allocated, kernels warmed up); >= 1."""
    timed_updates: int = 5
    """Timed rounds; each round times one update of every variant, one after the other."""
    seed: int = 0
    """Initialization and data seed (the same for every variant)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "micro_batch_size", "accumulation_steps",
                     "warmup_updates", "timed_updates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")

    @property
    def tokens_per_update(self) -> int:
        """``micro_batch_size * seq_len * accumulation_steps`` (every position is a predicted token)."""
        return self.micro_batch_size * self.seq_len * self.accumulation_steps


def e2e_config(device: str, quick: bool = False) -> E2EConfig:
    """The end-to-end configuration for ``device``: GPT-2 small (124 M with the byte vocabulary: 85 M) on CUDA,
    a 3.3 M-parameter GPT on CPU (about 30 s for the four variants on two cores), a tiny one with ``quick``."""
    if quick:
        return E2EConfig(device=device, n_layers=2, d_model=64, n_heads=2, seq_len=32, micro_batch_size=2,
                         warmup_updates=1, timed_updates=MIN_ROUNDS)
    if device == "cuda":
        return E2EConfig(device=device, n_layers=12, d_model=768, n_heads=12, seq_len=1024, micro_batch_size=8,
                         warmup_updates=2, timed_updates=10)
    return E2EConfig(device=device)


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``; else the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process image: Linux ``VmHWM``, else ``ru_maxrss``.

    ``VmHWM`` starts afresh at ``exec``; ``ru_maxrss`` does not (Linux carries the parent's RSS at ``fork``
    into the child's ``ru_maxrss``), so a child started by a large parent would report the parent's size.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS


def _state_bytes(tensors: Sequence[torch.Tensor | None], exclude: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those of ``exclude`` (the model params)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters (fp32 masters, when it holds them), their grads, and its state tensors."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out += [p, p.grad]
            out += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


@dataclass
class _Variant:
    """One end-to-end variant on its own model: ``accumulate(window) -> loss sum``, ``update()``, ``state()``."""

    model: torch.nn.Module
    accumulate: Callable[[list], torch.Tensor]
    update: Callable[[], None]
    state: Callable[[], list]  # tensors holding its gradients and optimizer state


def _e2e_model(cfg: E2EConfig) -> torch.nn.Module:
    """The bf16 GPT of ``cfg``, initialized from ``cfg.seed`` in fp32 (the same weights for every variant)."""
    from gaengine.tools.model import GPT, GPTConfig  # noqa: PLC0415

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig(context_len=cfg.seq_len, n_layers=cfg.n_layers, d_model=cfg.d_model,
                              n_heads=cfg.n_heads))
    return model.to(device=cfg.device, dtype=torch.bfloat16).train()


def _e2e_windows(cfg: E2EConfig, n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``n`` windows of K micro-batches ``(x, y)`` of random bytes, ``(micro_batch_size, seq_len)`` int64 each."""
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, 256, (n, cfg.accumulation_steps, cfg.micro_batch_size, cfg.seq_len + 1), generator=g)
    tokens = tokens.to(cfg.device)
    return [[(mb[:, :-1], mb[:, 1:]) for mb in window] for window in tokens]


def _build_variant(variant: str, cfg: E2EConfig, model: torch.nn.Module | None = None) -> _Variant:
    """The update path of ``variant`` (a key of :data:`E2E_VARIANTS`) over ``model`` (default: a fresh one)."""
    from gaengine import GradientAccumulator  # noqa: PLC0415
    from gaengine.optim import FusedAdamW  # noqa: PLC0415

    model = _e2e_model(cfg) if model is None else model
    params = list(model.parameters())
    k = cfg.accumulation_steps
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    max_norm = 1.0

    def accumulate_plain(window):
        loss_sum = torch.zeros((), device=cfg.device)
        for x, y in window:
            loss = model(x, y)
            (loss / k).backward()
            loss_sum += loss.detach()
        return loss_sum

    if variant in ("gaengine-fused", "gaengine-torch", "gaengine-lean"):
        opt = FusedAdamW(params, **hyper) if variant == "gaengine-fused" else torch.optim.AdamW(
            params, **hyper, fused=True)
        acc = GradientAccumulator(model, opt, accumulation_steps=k, max_grad_norm=max_norm,
                                  master_weights=variant != "gaengine-lean")

        def accumulate(window):
            loss_sum = torch.zeros((), device=cfg.device)
            for x, y in window:
                loss = model(x, y)
                acc.backward(loss)
                loss_sum += loss.detach()
            return loss_sum

        def state():
            buffers = [acc.main_grad.data] + ([acc.master_buffer.data] if acc.master_buffer is not None else [])
            return buffers + _optimizer_tensors(opt) + [p.grad for p in params]

        return _Variant(model, accumulate, acc.step, state)

    if variant == "plain":
        opt = torch.optim.AdamW(params, **hyper, fused=True)

        def update():
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _Variant(model, accumulate_plain, update, lambda: _optimizer_tensors(opt))

    if variant == "native-fp32":
        if not hasattr(torch.Tensor, "grad_dtype"):
            raise RuntimeError(f"torch {torch.__version__} has no Tensor.grad_dtype (added in 2.10): no native "
                               "fp32 accumulation of bf16 gradients to compare with")
        for p in params:
            p.grad_dtype = torch.float32  # autograd casts each incoming bf16 grad, then accumulates in fp32
        masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        opt = torch.optim.AdamW(masters, **hyper, fused=True)

        def update():
            for m, p in zip(masters, params):
                m.grad = p.grad  # the fp32 .grad itself (no copy)
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            with torch.no_grad():
                torch._foreach_copy_(params, masters)  # fp32 master -> bf16 model

        return _Variant(model, accumulate_plain, update,
                        lambda: _optimizer_tensors(opt) + [p.grad for p in params])

    raise ValueError(f"unknown e2e variant {variant!r}; expected one of {sorted(E2E_VARIANTS)}")


def e2e_throughput(cfg: E2EConfig, variants: Sequence[str]) -> dict[str, dict]:
    """Train every variant in this process on its own model, round-robin: one update of each per round.

    Round ``r`` feeds every variant the same window of micro-batches. Returns variant -> ``{"update_ms": [wall
    ms of each timed round], "cpu_ms": [process CPU ms of each timed round], "losses": [window mean loss of
    every update]}``. With one torch thread, CPU time leaves out the time this process waited descheduled on a
    CPU shared with other jobs (with more threads it also counts their spin-waits); it does not remove their
    competition for memory bandwidth.
    """
    built = {v: _build_variant(v, cfg) for v in variants}
    windows = _e2e_windows(cfg, cfg.warmup_updates + cfg.timed_updates)
    out = {v: {"update_ms": [], "cpu_ms": [], "losses": []} for v in variants}
    device = torch.device(cfg.device)
    for i, window in enumerate(windows):
        for v, b in built.items():
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss_sum = b.accumulate(window)
            b.update()
            _sync(device)
            if i >= cfg.warmup_updates:
                out[v]["update_ms"].append((time.perf_counter() - t0) * 1e3)
                out[v]["cpu_ms"].append((time.process_time() - c0) * 1e3)
            out[v]["losses"].append(loss_sum / cfg.accumulation_steps)
    for v in variants:
        out[v]["losses"] = torch.stack(out[v]["losses"]).float().tolist()  # one host read, after timing
    return out


def _peak_live_cpu_bytes(run: Callable[[], None]) -> int:
    """Peak bytes of CPU tensors allocated inside ``run()`` and alive at once: the largest running total of
    ``torch.profiler``'s allocation events (``profile_memory=True``). Tensors that existed before ``run`` are
    not counted; no allocator slack, unlike RSS."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp, _without_kineto_log():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events
                if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0), default=0)


def _e2e_memory_worker(variant: str, cfg: E2EConfig) -> dict:
    """In a fresh process: ``warmup_updates + 1`` updates of ``variant``; its peak memory and state bytes.

    A tiny model of the same variant trains first, so that lazy imports and first-use allocations of torch's
    kernels (about 150 MiB of RSS on CPU, whatever the model size) happen before the baseline is taken. On
    CPU the same updates then run again on a fresh model under ``torch.profiler`` for the peak of live tensor
    bytes (after the RSS peak was read: the profiler's own buffers do not count).
    """
    device = torch.device(cfg.device)
    tiny = replace(cfg, n_layers=1, d_model=8 * cfg.n_heads, seq_len=8, micro_batch_size=1, accumulation_steps=2)
    warm = _build_variant(variant, tiny)
    for window in _e2e_windows(tiny, 2):
        warm.accumulate(window)
        warm.update()
    del warm, window
    gc.collect()
    model = _e2e_model(cfg)
    windows = _e2e_windows(cfg, cfg.warmup_updates + 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_bytes = torch.cuda.memory_allocated()
    else:
        base_bytes = _rss_bytes()
    state_bytes = 0

    def train(model: torch.nn.Module) -> None:
        nonlocal state_bytes
        b = _build_variant(variant, cfg, model)
        for i, window in enumerate(windows):
            b.accumulate(window)
            if i == len(windows) - 1:  # the high point of gradient + optimizer state (optimizer state exists by now)
                state_bytes = _state_bytes(b.state(), exclude=list(b.model.parameters()))
            b.update()
        _sync(device)

    train(model)
    num_params = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        peak_bytes, kind = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
        live_bytes = peak_bytes - base_bytes
    else:
        peak_bytes, kind = _peak_rss_bytes(), "peak RSS (VmHWM)"
        del model
        gc.collect()
        fresh = _e2e_model(cfg)
        live_bytes = _peak_live_cpu_bytes(lambda: train(fresh))
    return {"variant": variant, "num_params": num_params, "peak_bytes": peak_bytes,
            "peak_delta_bytes": peak_bytes - base_bytes, "peak_kind": kind, "state_bytes": state_bytes,
            "peak_live_bytes": live_bytes}


_WORKER_MARK = "GAENGINE_E2E_RESULT "


def _run_memory_subprocess(variant: str, cfg: E2EConfig) -> dict:
    """``_e2e_memory_worker`` in a fresh interpreter, so its peak is its own; raises with its stderr on failure."""
    code = ("import json, sys; from gaengine.tools import bench; cfg = bench.E2EConfig(**json.loads(sys.argv[2])); "
            f"print({_WORKER_MARK!r} + json.dumps(bench._e2e_memory_worker(sys.argv[1], cfg)))")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # the parent's thread count
    proc = subprocess.run([sys.executable, "-c", code, variant, json.dumps(asdict(cfg))], capture_output=True,
                          text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(_WORKER_MARK):
            return json.loads(line[len(_WORKER_MARK):])
    raise RuntimeError(f"e2e memory run of {variant!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def bench_e2e(cfg: E2EConfig, variants: Sequence[str] = tuple(E2E_VARIANTS), *,
              progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
    """Throughput of every variant (in this process, interleaved) and its peak memory (a fresh subprocess each).

    Returns one row per variant (median update ms, tokens/s at that median, the median per-round speedup over
    the plain recipe, peak memory, state bytes, losses) and the run's facts (parameter count, what memory means).
    """
    variants = list(dict.fromkeys([*variants, E2E_BASELINE]))  # the baseline always runs
    progress = progress or (lambda s: None)
    progress(f"e2e throughput: {len(variants)} variants x ({cfg.warmup_updates} + {cfg.timed_updates}) updates, "
             "interleaved")
    timing = e2e_throughput(cfg, variants)
    memory = {}
    for v in variants:
        progress(f"e2e memory: {v} (fresh process)")
        memory[v] = _run_memory_subprocess(v, cfg)
    base_ms = timing[E2E_BASELINE]["update_ms"]
    mib = 2.0**20
    rows = []
    for v in variants:
        t, m = timing[v], memory[v]
        ms = statistics.median(t["update_ms"])
        rows.append({
            "benchmark": f"e2e GPT bf16, K={cfg.accumulation_steps}",
            "variant": E2E_VARIANTS[v],
            "key": v,
            "device": cfg.device,
            "ms": ms,
            "min_ms": min(t["update_ms"]),
            "max_ms": max(t["update_ms"]),
            "update_ms": t["update_ms"],
            "cpu_ms": statistics.median(t["cpu_ms"]),
            "cpu_ms_runs": t["cpu_ms"],
            "ratio_cpu_time": _median_ratio(timing[E2E_BASELINE]["cpu_ms"], t["cpu_ms"]),
            "tokens_per_s": cfg.tokens_per_update / (ms * 1e-3),
            **ratio_stats(base_ms, t["update_ms"], baseline=v == E2E_BASELINE),
            "peak_mib": m["peak_bytes"] / mib,
            "peak_delta_mib": m["peak_delta_bytes"] / mib,
            "peak_live_mib": m["peak_live_bytes"] / mib,
            "state_mib": m["state_bytes"] / mib,
            "state_bytes_per_param": m["state_bytes"] / m["num_params"],
            "final_loss": t["losses"][-1],
            "losses": t["losses"],
        })
    if cfg.device == "cuda":
        how = ("peak = torch.cuda.max_memory_allocated of the variant's own process; peak delta = that minus the "
               "memory allocated once the bf16 model and the data were on the device (after a tiny warm-up model); "
               "peak live = peak delta (the caching allocator's count is already of live tensors)")
    else:
        how = ("peak = peak RSS (VmHWM) of the variant's own fresh process (one process per variant: RSS "
               "is not shared); peak delta = that minus the RSS once the bf16 model and the data were built, after "
               "a tiny model of the same variant trained first (torch runtime and first-use allocations excluded): "
               "activations, gradients, optimizer state, master weights, temporaries, allocator slack; peak live = "
               "the peak of the CPU tensor bytes allocated after the model and the data, alive at once, from "
               "torch.profiler's allocation events in a second run of the same updates (no allocator slack)")
    info = {"config": asdict(cfg), "num_params": memory[E2E_BASELINE]["num_params"],
            "tokens_per_update": cfg.tokens_per_update, "memory": how,
            "state": ("bytes of gradients + optimizer state + master weights + flat buffers at the end of a "
                      "window's last backward, distinct storages, model params excluded (exact count)")}
    return rows, info


# ---------------------------------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` command to an ``argparse`` subparsers object; its ``func`` default is :func:`run`."""
    p = subparsers.add_parser(
        "bench",
        help="kernel, host-overhead and end-to-end benchmarks on this device, a table per benchmark",
        description=("Time gaengine's kernels (accumulate, l2norm_sq, scale_) against the torch ops they replace, "
                     "the host time gaengine's backward adds per parameter per micro-batch over the plain recipe "
                     "(and the launches per micro-batch of both), and an end-to-end bf16 GPT against the plain "
                     "recipe and torch's native fp32 accumulation, on one device; peak bandwidth is measured in "
                     "the same run."),
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, default=None, metavar="NAME",
                   help=f"run only these benchmarks, of {', '.join(BENCHMARKS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes and few rounds (tests, smoke runs)")
    p.add_argument("--numel", type=int, default=None, metavar="N",
                   help="kernel buffer elements (default 2^25 on CPU, 2^28 on CUDA, 2^20 with --quick)")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="timed rounds of the kernels and the host benchmark (default 15, 5 quick)")
    p.add_argument("--host-params", type=int, nargs="+", default=None, metavar="P",
                   help=f"parameter counts of the host benchmark (default {' '.join(map(str, HOST_PARAM_COUNTS))}, "
                        f"{' '.join(map(str, HOST_PARAM_COUNTS_QUICK))} quick; the per-parameter figure is the "
                        "slope over them)")
    p.add_argument("--e2e-updates", type=int, default=None, metavar="N",
                   help="timed e2e rounds, one update of each variant per round (default 5 CPU, 10 CUDA, 5 quick)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch.set_num_threads for every benchmark (e2e subprocesses too); default: torch's. On a "
                        "CPU shared with other jobs use 1: several OpenMP threads wait on each other whenever one "
                        "of them is descheduled")
    p.add_argument("--json", metavar="PATH", type=Path, default=None,
                   help="write results, device name, torch/triton versions and git SHA as JSON")
    p.add_argument("--plot", metavar="PNG", type=Path, default=None, help="write a bar chart of the ratios")
    p.set_defaults(func=run)
    return p


def _plot(rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in rows if r.get("ratio_vs_torch") is not None]  # not the host fit rows
    labels = [f"{r['benchmark']}: {r['variant']}" for r in rows]
    ratios = [r["ratio_vs_torch"] for r in rows]
    colors = ["tab:blue" if r["variant"].startswith(("gaengine", "(a")) else "tab:gray" for r in rows]
    fig, ax = plt.subplots(figsize=(12, 0.32 * len(rows) + 1.8))
    y = range(len(rows))[::-1]
    ax.barh(list(y), ratios, color=colors)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel("speedup over the torch baseline (median per-round ratio; e2e: over the plain recipe); > 1 is faster",
                  fontsize=8)
    ax.set_title(textwrap.fill(title, 120), fontsize=8)
    for yi, v in zip(y, ratios):
        ax.text(v, yi, f" {v:.2f}", va="center", fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


KERNEL_COLUMNS = [("variant", "variant", "s"), ("ms", "ms", ".3f"), ("gb_s", "GB/s", ".1f"),
                  ("pct_of_peak", "% of peak", ".0f"), ("ratio_text", "vs torch [p25-p75]", "s")]
"""``(key, header, format)`` of each kernel benchmark's table (one table per benchmark)."""

HOST_COLUMNS = [("dtype", "dtype", "s"), ("num_params", "P", "d"), ("variant", "variant", "s"),
                ("ms", "ms/window", ".3f"), ("us_per_param_mb", "us/param/mb", ".2f"),
                ("added_us_per_param_mb", "added us/param/mb", ".2f"), ("ratio_text", "vs (b) [p25-p75]", "s"),
                ("launches_per_mb", "launches/mb", ""), ("buckets", "buckets", "d")]
"""Columns of the host benchmark's table (its measured rows)."""

E2E_COLUMNS = [("key", "variant", "s"), ("ms", "ms/update", ",.1f"), ("tokens_per_s", "tokens/s", ",.0f"),
               ("ratio_text", "vs plain [p25-p75]", "s"), ("peak_mib", "peak MiB", ",.1f"),
               ("peak_delta_mib", "peak delta MiB", ",.1f"), ("peak_live_mib", "peak live MiB", ",.1f"),
               ("state_mib", "state MiB", ",.2f"), ("state_bytes_per_param", "state B/param", ".1f")]
"""Columns of the end-to-end table; the variants' full labels follow it as a legend."""

_RATIO_NOTE = ("[p25-p75]: 25th to 75th percentile of the per-round ratios; '~1 (noise)': that spread contains 1, "
               f"'noise (n rounds)': fewer than {MIN_ROUNDS} rounds, too few to tell")


def _display(rows: Sequence[dict]) -> list[dict]:
    """The rows with their printed ratio (:func:`ratio_text`) added."""
    return [{**r, "ratio_text": ratio_text(r)} for r in rows]


def _print_kernel_tables(rows: Sequence[dict], peak: dict, repeats: int) -> None:
    """One table per kernel benchmark, its bytes model in the title, then what the columns mean."""
    for bench in dict.fromkeys(r["benchmark"] for r in rows):
        some = [r for r in rows if r["benchmark"] == bench]
        print_table(_display(some), KERNEL_COLUMNS,
                    f"{bench}: {some[0]['numel']:,} elements, {some[0]['bytes_per_element']} B/element")
    print(f"kernels: ms = median of {repeats} interleaved rounds; GB/s by the benchmark's bytes model (accumulate "
          f"{ACCUMULATE_BYTES_PER_ELEMENT}, l2norm {L2NORM_BYTES_PER_ELEMENT}, scale {SCALE_BYTES_PER_ELEMENT} "
          f"B/element); % of peak = GB/s / the measured peak, {peak['op']} at {peak['gb_s']:.1f} GB/s "
          f"({peak['bytes_per_element']} B/element, {peak['ms']:.3f} ms); vs torch = median per-round ratio of the "
          f"table's first row (the torch baseline) to the variant's time, > 1: faster. {_RATIO_NOTE}.")


def _print_host_tables(rows: Sequence[dict], info: dict, device: torch.device) -> None:
    """The host benchmark's measured rows, what the columns mean, and its fit over P against the target."""
    measured = [r for r in rows if not r["key"].endswith("-fit")]
    print_table(_display(measured), HOST_COLUMNS,
                f"host: P leaf params x {info['param_numel']} elements, K = {info['accumulation_steps']} micro-batches "
                f"per window, backward only; gaengine backend {info['backend']}, hooks {info['hooks']}")
    print(f"host: {info['model']} (kernel time ~0: host time dominates). ms/window = {info['ms']}, "
          f"{info['repeats']} interleaved rounds; us/param/mb = ms/window / (P * K); added us/param/mb = "
          f"{info['added']}; vs (b) = median per-round ratio (b) / variant, > 1: faster. {_RATIO_NOTE}.")
    print(f"host: launches/mb = {info['launches']}; buckets = gaengine's buckets (a bucketed accumulate needs "
          "buckets + the model's own launches).")
    for name, fit in info["fit"].items():
        added = ", ".join(f"P={n}: {us / n:.2f}" for n, us in fit["added_us_per_mb"].items())
        line = (f"host {name}: gaengine adds {fit['slope_us_per_param_mb']:.2f} us per parameter per micro-batch "
                f"(least-squares slope over P; intercept {fit['intercept_us_per_mb']:.1f} us per micro-batch; "
                f"per P: {added} us)")
        if device.type == "cpu":
            met = fit["slope_us_per_param_mb"] <= HOST_TARGET_US
            line += f"; CPU target <= {HOST_TARGET_US:g} us: {'met' if met else 'NOT met'}"
        print(line + ".")


def _print_e2e_table(rows: Sequence[dict], info: dict) -> None:
    """The end-to-end table, the variants' labels, and what each column means."""
    c = info["config"]
    print_table(_display(rows), E2E_COLUMNS,
                f"e2e: {info['num_params']:,}-parameter GPT in bf16 ({c['n_layers']} layers, d_model {c['d_model']}), "
                f"{c['micro_batch_size']} x {c['seq_len']} tokens x K={c['accumulation_steps']} = "
                f"{info['tokens_per_update']:,} tokens per update on {c['device']}")
    for r in rows:
        print(f"  {r['key']}: {r['variant']}")
    print(f"e2e: {c['timed_updates']} timed rounds after {c['warmup_updates']}, one update of every variant per "
          "round; ms/update = median; tokens/s = tokens per update / that median; vs plain = median per-round "
          f"ratio of the plain recipe's (b) update time to the variant's, > 1: faster. {_RATIO_NOTE}.")
    print(f"e2e memory: {info['memory']}. state = {info['state']}; state B/param = state / parameters.")


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks ``args`` selects (from :func:`add_parser`), print one table; returns 0 (2: no CUDA).

    ``--threads`` holds only for the run: torch's thread count is restored afterwards.
    """
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gaengine bench: error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    which = list(args.only or BENCHMARKS)
    quick = bool(args.quick)
    numel = args.numel or (2**20 if quick else 2**28 if device.type == "cuda" else 2**25)
    repeats = args.repeats or (5 if quick else 15)
    warmup = 1 if quick else 3
    name = device_name(device)
    print(f"gaengine bench on {device} ({name}); torch {torch.__version__}, git {git_sha()}", flush=True)

    rows: list[dict] = []
    params: dict[str, object] = {"device": str(device), "device_name": name, "quick": quick, "benchmarks": which,
                                 "torch_threads": torch.get_num_threads()}
    kernels = [w for w in which if w not in ("host", "e2e")]
    peak = None
    if kernels:
        print(f"kernels: {numel:,} elements, {warmup} + {repeats} interleaved rounds ...", flush=True)
        kernel_rows, peak = bench_kernels(device, numel, kernels, warmup=warmup, repeats=repeats)
        rows += kernel_rows
        params.update(numel=numel, warmup=warmup, repeats=repeats, peak=peak,
                      bytes_per_element={"accumulate": ACCUMULATE_BYTES_PER_ELEMENT, "l2norm": L2NORM_BYTES_PER_ELEMENT,
                                         "scale": SCALE_BYTES_PER_ELEMENT, "peak": PEAK_BYTES_PER_ELEMENT})
    host_info = None
    if "host" in which:
        counts = tuple(args.host_params or (HOST_PARAM_COUNTS_QUICK if quick else HOST_PARAM_COUNTS))
        print(f"host: P = {', '.join(map(str, counts))} params x {HOST_PARAM_NUMEL} elements, "
              f"{', '.join(map(_dtype_name, HOST_DTYPES))}, K = {HOST_ACCUMULATION_STEPS}, {warmup} + {repeats} "
              "interleaved rounds ...", flush=True)
        host_rows, host_info = bench_host(device, counts, warmup=warmup, repeats=repeats)
        rows += host_rows
        params["host"] = host_info
    e2e_info = None
    if "e2e" in which:
        cfg = e2e_config(device.type, quick)
        if args.e2e_updates:
            cfg = E2EConfig(**{**asdict(cfg), "timed_updates": args.e2e_updates})
        e2e_rows, e2e_info = bench_e2e(cfg, progress=lambda s: print(f"  {s}", flush=True))
        rows += e2e_rows
        params["e2e"] = e2e_info

    print(f"\ngaengine bench, {device} ({name}), torch {torch.__version__}")
    if kernels:
        _print_kernel_tables(kernel_rows, peak, repeats)
    if host_info is not None:
        _print_host_tables(host_rows, host_info, device)
    if e2e_info is not None:
        _print_e2e_table(e2e_rows, e2e_info)
    if args.json is not None:
        write_json(args.json, "gaengine bench", params, rows, [device])
    if args.plot is not None:
        _plot(rows, args.plot, f"gaengine bench, {device} ({name}), torch {torch.__version__}")
    return 0
