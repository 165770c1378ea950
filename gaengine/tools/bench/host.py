"""Host benchmark (``host``): the host time gaengine's backward adds per parameter per micro-batch over the
plain recipe, and the launches per micro-batch of both; a table, and the fit over P against the CPU target.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from gaengine.engine import GradientAccumulator
from gaengine.tools.bench.common import (RATIO_NOTE, Elapsed, display_rows, print_note, print_table, ratio_stats,
                                         sync, time_rounds, without_kineto_log)

HOST_PARAM_COUNTS = (64, 256, 1024)
"""P of the ``host`` benchmark: the slope of the added time over P is its per-parameter figure."""
HOST_PARAM_COUNTS_QUICK = (32, 128, 512)  # ``--quick``: the same fit, a quarter of the parameters
HOST_PARAM_NUMEL = 32  # elements per parameter: kernel time ~0, so the host's time per parameter dominates
HOST_ACCUMULATION_STEPS = 8  # K micro-batches per timed window
HOST_DTYPES = (torch.bfloat16, torch.float32)
HOST_TARGET_US = 1.0
"""CPU target: host microseconds gaengine adds per parameter per micro-batch over the plain recipe."""


def machine_load() -> tuple[float, int]:
    """``(load average over the last minute, CPUs this process may run on)``: ``os.getloadavg`` counts the runnable
    threads of every process, this one's included; ``(nan, cpus)`` where the system has none (Windows)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        return os.getloadavg()[0], cpus
    except (AttributeError, OSError):
        return float("nan"), cpus


def target_verdict(slope_us: float, threads: int, load: float, cpus: int) -> str:
    """The host benchmark's CPU target line for a measured ``slope_us`` (us per parameter per micro-batch) on
    ``threads`` torch threads, with the machine's ``load`` average over ``cpus`` CPUs (:func:`machine_load`).

    The target holds for the conditions it was set for: the benchmark's torch threads on CPUs no other process
    takes. With more runnable threads than CPUs (``load > cpus``: the benchmark's threads wait for a core, and the
    host time measured is the wait), the target is not judged: the line says so, and the load, instead of "NOT met".
    """
    target = f"CPU target <= {HOST_TARGET_US:g} us ({threads} torch thread{'s' if threads != 1 else ''}, idle CPUs)"
    if load == load and load > cpus:  # not NaN, and loaded
        return (f"{target}: not judged, the machine was loaded (load average {load:.1f} over {cpus} CPUs: other "
                "processes took the cores); rerun on an idle machine")
    seen = f"load average {load:.1f} over {cpus} CPUs" if load == load else "load unknown"
    return f"{target}: {'met' if slope_us <= HOST_TARGET_US else 'NOT met'} ({seen})"


HOST_VARIANTS = {"plain": "(b) plain: loss.backward() into .grad", "gaengine": "(a) gaengine: acc.backward(loss)"}

# ATen ops that touch no data (views, metadata, allocation): not counted as accumulate ops; their
# children (if any, e.g. a ``contiguous`` that copies) are.
_NO_DATA_OPS = frozenset(
    "aten::" + n for n in ("detach", "detach_", "view", "view_as", "_unsafe_view", "as_strided", "select", "slice",
                           "narrow", "reshape", "_reshape_alias", "expand", "expand_as", "alias", "t", "transpose",
                           "unsqueeze", "squeeze", "flatten", "contiguous", "empty", "empty_like", "empty_strided",
                           "lift_fresh", "resolve_conj", "resolve_neg", "is_nonzero", "item", "_local_scalar_dense"))
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


def dtype_name(dtype: torch.dtype) -> str:
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


def _profile_launches(fn: Callable[[], object], device: torch.device) -> dict[str, int | None]:
    """Run ``fn`` once under ``torch.profiler``; count what it launched.

    ``accumulate_ops``: see :func:`_accumulate_ops`. On CUDA also ``launch_calls`` (host calls of
    ``cudaLaunchKernel``/``cuLaunchKernel`` and their ``Ex`` forms: Triton launches through the driver API)
    and ``gpu_kernels`` (kernel events on the device, memcpy/memset left out).
    """
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with without_kineto_log():
        with profile(activities=activities) as prof:
            fn()
            sync(device)
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
    (``acc.hooks.launches``: one per complete bucket, on every backend)."""
    return acc.hooks.launches, "acc.hooks.launches"


def _num_buckets(acc) -> int:
    """Buckets of ``acc``'s flat buffer (the ones its hooks launch and its reducer all-reduces)."""
    return acc.hooks.num_buckets


class _HostVariant:
    """One variant of the host benchmark on its own P parameters: windows of K micro-batches, backward timed."""

    def __init__(self, variant: str, num_params: int, numel: int, dtype: torch.dtype, device: torch.device,
                 k: int) -> None:
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

    def window(self) -> Elapsed:
        """One window; returns the wall seconds of its K backward calls (forward untimed; on CUDA the wait for
        the device at the window's end is counted, so no queued work is left out), for :func:`time_rounds`."""
        total = 0.0
        for i in range(self.k):
            loss = _host_loss(self.params, self.c)
            if i == 0:
                sync(self.device)
            t0 = time.perf_counter()
            self._backward(loss)
            if i == self.k - 1:
                sync(self.device)
            total += time.perf_counter() - t0
        self.end_window()
        return Elapsed(total)

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


@dataclass(frozen=True)
class _HostRun:
    """What one host run measured, keyed ``(dtype, P, variant)``, and the setting it ran in.

    seconds: wall seconds of each round's window; launches: ``_HostVariant.launches()``; buckets: gaengine's
    bucket count (gaengine variants only); backend, hooks: the accumulator's backend name and hooks, as text.
    """

    device: torch.device
    numel: int
    k: int
    seconds: dict[tuple, list[float]]
    launches: dict[tuple, dict]
    buckets: dict[tuple, int]
    backend: str
    hooks: str

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def target(self) -> str | None:
        """The CPU target as shown in the rows; None off the CPU."""
        return f"<= {HOST_TARGET_US:.1f}" if self.cpu else None


def _run_host(device: torch.device, param_counts: Sequence[int], numel: int, dtypes: Sequence[torch.dtype], k: int,
              warmup: int, repeats: int) -> _HostRun:
    """Build every (dtype, P, variant), time their windows in interleaved rounds, then profile their launches."""
    variants = {(dt, n, v): _HostVariant(v, n, numel, dt, device, k)
                for dt in dtypes for n in param_counts for v in HOST_VARIANTS}
    try:
        timed = time_rounds({key: hv.window for key, hv in variants.items()}, warmup=warmup, repeats=repeats)
        seconds = {key: [ms * 1e-3 for ms in t] for key, t in timed.ms.items()}
        launches = {key: hv.launches() for key, hv in variants.items()}
        buckets = {key: _num_buckets(hv.acc) for key, hv in variants.items() if hv.acc is not None}
        some = next(hv.acc for hv in variants.values() if hv.acc is not None)
        backend = some.backend.name
        hooks = getattr(some, "hooks", None)
        hooks = "none" if hooks is None else f"{type(hooks).__name__} (native={getattr(hooks, 'native', '?')})"
    finally:
        for hv in variants.values():
            hv.close()
    return _HostRun(device, numel, k, seconds, launches, buckets, backend, hooks)


def _launches_shown(lc: dict, variant: str, cpu: bool) -> object:
    """The ``launches_per_mb`` column: launches on CUDA; on the CPU, (b)'s accumulate ops or gaengine's own count."""
    if not cpu:  # driver-API launches (Triton) may be untraced: never fewer than the kernels seen
        return max(lc["launch_calls"] or 0, lc["gpu_kernels"] or 0)
    if variant == "plain":
        return lc["accumulate_ops"]
    return "n/a" if lc["gaengine_launches"] is None else lc["gaengine_launches"]


def _measured_row(run: _HostRun, dt: torch.dtype, n: int, v: str, diffs: Sequence[float]) -> dict:
    """The row of variant ``v`` at (``dt``, P = ``n``); ``diffs``: per round, (a)'s window seconds minus (b)'s."""
    name, numel, k, cpu = dtype_name(dt), run.numel, run.k, run.cpu
    tb, t = run.seconds[(dt, n, "plain")], run.seconds[(dt, n, v)]
    lc = run.launches[(dt, n, v)]
    ms = statistics.median(t) * 1e3
    return {
        "benchmark": f"host, {n} {name} params x {numel}",
        "variant": HOST_VARIANTS[v],
        "key": f"host-{name}-{n}-{v}",
        "device": str(run.device),
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
        "target": run.target if v == "gaengine" else None,
        "launches_per_mb": _launches_shown(lc, v, cpu),
        "accumulate_ops_per_mb": lc["accumulate_ops"],
        "launch_calls_per_mb": lc["launch_calls"],
        "gpu_kernels_per_mb": lc["gpu_kernels"],
        "model_launch_calls_per_mb": lc.get("model_launch_calls"),
        "gaengine_launches_per_mb": lc["gaengine_launches"],
        "gaengine_launches_mean_per_mb": lc["gaengine_launches_mean"],
        "gaengine_launches_source": lc["gaengine_launches_source"],
        "buckets": run.buckets.get((dt, n, v)),
        "backend": run.backend if v == "gaengine" else None,
        "hooks": run.hooks if v == "gaengine" else None,
    }


def _fit_over_p(param_counts: Sequence[int], added_per_mb_us: Sequence[float]) -> tuple[float, float]:
    """``(slope, intercept)`` of the added us per micro-batch over P; through the origin for a single P."""
    if len(param_counts) >= 2:
        return _least_squares(list(param_counts), added_per_mb_us)
    return added_per_mb_us[0] / param_counts[0], 0.0


def _fit_row(run: _HostRun, name: str, param_counts: Sequence[int], slope: float, intercept: float) -> dict:
    """The row of dtype ``name``'s fit over P: the added us per parameter per micro-batch against the target."""
    return {
        "benchmark": f"host, {name}, fit over P={','.join(map(str, param_counts))}",
        "variant": "(a) - (b): slope of added us/micro-batch over P",
        "key": f"host-{name}-fit",
        "device": str(run.device),
        "dtype": name,
        "param_numel": run.numel,
        "accumulation_steps": run.k,
        "added_us_per_param_mb": slope,
        "intercept_us_per_mb": intercept,
        "target_us": HOST_TARGET_US if run.cpu else None,
        "target": run.target,
        "backend": run.backend,
    }


def _host_info(run: _HostRun, param_counts: Sequence[int], dtypes: Sequence[torch.dtype], warmup: int,
               repeats: int, fits: dict[str, dict]) -> dict:
    """The run's facts: its setting, the fits, and what the model, ``ms``, ``added`` and ``launches`` measure."""
    return {
        "param_counts": list(param_counts), "param_numel": run.numel, "dtypes": [dtype_name(d) for d in dtypes],
        "accumulation_steps": run.k, "warmup": warmup, "repeats": repeats, "backend": run.backend,
        "hooks": run.hooks, "target_us_per_param_mb": HOST_TARGET_US if run.cpu else None, "fit": fits,
        "threads": torch.get_num_threads(), **dict(zip(("load_average", "cpus"), machine_load())),
        "model": "P leaf params of param_numel elements, loss = (stack(params) * c).sum(); backward: fill, mul, "
                 "one select per param, P AccumulateGrad nodes",
        "ms": "wall time of the K backward calls of one window (forward and update untimed; on CUDA the device "
              "is synchronized before the first and after the last), median over rounds",
        "added": "median over rounds of (t_a - t_b) / (P * K); fit: least-squares slope of median (t_a - t_b) / K "
                 "over P",
        "launches": ("CUDA: kernel launches during micro-batch 1's backward, the model's own included: "
                     "cudaLaunchKernel/cuLaunchKernel(+Ex) calls, or the GPU kernels seen if more (Triton's "
                     "driver-API launches may go untraced); model_launch_calls_per_mb: the same backward through "
                     "torch.autograd.grad, no AccumulateGrad" if not run.cpu else
                     "CPU: (b) data-touching ATen ops inside AccumulateGrad (aten::add_ per param) during "
                     "micro-batch 1's backward; (a) gaengine's own count of kernel-launching calls over that "
                     "micro-batch (acc.hooks.launches)"),
    }


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
    run = _run_host(device, param_counts, numel, dtypes, k, warmup, repeats)
    rows: list[dict] = []
    fits: dict[str, dict] = {}
    for dt in dtypes:
        added_per_mb_us = []
        for n in param_counts:
            tb, ta = run.seconds[(dt, n, "plain")], run.seconds[(dt, n, "gaengine")]
            diffs = [a - b for a, b in zip(ta, tb)]
            added_per_mb_us.append(statistics.median(diffs) / k * 1e6)
            rows += [_measured_row(run, dt, n, v, diffs) for v in ("plain", "gaengine")]
        slope, intercept = _fit_over_p(param_counts, added_per_mb_us)
        fits[dtype_name(dt)] = {"slope_us_per_param_mb": slope, "intercept_us_per_mb": intercept,
                                "added_us_per_mb": dict(zip(param_counts, added_per_mb_us))}
        rows.append(_fit_row(run, dtype_name(dt), param_counts, slope, intercept))
    return rows, _host_info(run, param_counts, dtypes, warmup, repeats, fits)


HOST_COLUMNS = [("dtype", "dtype", "s"), ("num_params", "P", "d"), ("name", "variant", "s"),
                ("ms", "ms/window", ".3f"), ("ratio_text", "vs (b) [p25-p75]", "s"),
                ("launches_per_mb", "launches/mb", ""), ("buckets", "buckets", "d")]
"""Columns of the host benchmark's first table (its measured rows); ``name`` is the variant's label up to its
colon, ``(b) plain`` or ``(a) gaengine`` (the full labels follow the tables)."""
HOST_PER_PARAM_COLUMNS = [("dtype", "dtype", "s"), ("num_params", "P", "d"), ("name", "variant", "s"),
                          ("us_per_param_mb", "us/param/mb", ".2f"),
                          ("added_us_per_param_mb", "added us/param/mb", ".2f")]
"""Columns of its second table: the same rows per parameter per micro-batch."""


def print_tables(rows: Sequence[dict], info: dict, device: torch.device) -> None:
    """The host benchmark's measured rows (two tables), what the columns mean, and its fit over P against the
    target."""
    measured = [{**r, "name": r["variant"].split(":")[0]} for r in display_rows(rows) if not r["key"].endswith("-fit")]
    print_table(measured, HOST_COLUMNS, keep=3, title=(
        f"host: P leaf params x {info['param_numel']} elements, K = {info['accumulation_steps']} micro-batches per "
        f"window, backward only; gaengine backend {info['backend']}, hooks {info['hooks']}"))
    print_table(measured, HOST_PER_PARAM_COLUMNS, keep=3,
                title="host per parameter: the same windows per parameter per micro-batch")
    for label in HOST_VARIANTS.values():
        print_note(f"  {label}", indent="      ")
    print_note(f"host: {info['model']} (kernel time ~0: host time dominates). ms/window = {info['ms']}, "
               f"{info['repeats']} interleaved rounds; vs (b) = median per-round ratio (b) / variant, > 1: faster. "
               f"{RATIO_NOTE}.")
    print_note(f"host: launches/mb = {info['launches']}; buckets = gaengine's buckets (a bucketed accumulate needs "
               "buckets + the model's own launches).")
    print_note(f"host: us/param/mb = ms/window / (P * K); added us/param/mb = {info['added']}.")
    for name, fit in info["fit"].items():
        added = ", ".join(f"P={n}: {us / n:.2f}" for n, us in fit["added_us_per_mb"].items())
        line = (f"host {name}: gaengine adds {fit['slope_us_per_param_mb']:.2f} us per parameter per micro-batch "
                f"(least-squares slope over P; intercept {fit['intercept_us_per_mb']:.1f} us per micro-batch; "
                f"per P: {added} us)")
        if device.type == "cpu":
            load, cpus = info.get("load_average", float("nan")), info.get("cpus", 1)
            line += "; " + target_verdict(fit["slope_us_per_param_mb"], info.get("threads", 1), load, cpus)
        print_note(line + ".")
