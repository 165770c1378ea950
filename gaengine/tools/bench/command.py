"""The ``gaengine bench`` command: its parser, the run of the benchmarks it selects, the tables, ``--json`` and
``--plot``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

import torch

from gaengine.tools.bench import e2e, fusion, host, kernels, memory, optimizers
from gaengine.tools.bench.common import device_name, git_sha, print_note, write_json

BENCHMARKS = ("accumulate", "l2norm", "scale", "host", "fusion", "e2e", "memory", "optimizers")
"""Names accepted by ``--only``, in the order they run."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` command to an ``argparse`` subparsers object; its ``func`` default is :func:`run`."""
    p = subparsers.add_parser(
        "bench",
        help="kernel, host-overhead and end-to-end benchmarks on this device, a table per benchmark",
        description=("Time gaengine's kernels (accumulate, l2norm_sq, scale_) against the torch ops they replace, "
                     "the host time gaengine's backward adds per parameter per micro-batch over the plain recipe "
                     "(and the launches per micro-batch of both), one bf16 Linear's backward with gradient "
                     "accumulation fusion against the unfused hooks and the plain recipe (time and error against "
                     "fp64), and an end-to-end GPT (bf16 where the device computes bf16 fast, else fp32) against the plain "
                     "recipe and torch's native fp32 accumulation, on one device; peak bandwidth is measured in "
                     "the same run. The memory table: bytes per parameter per rank of ZeRO stages 0/1/2, the plain "
                     "recipe and torch DDP on 1, 2 and 4 gloo processes on the CPU, and their bytes on the wire. The optimizers "
                     "table: torch's Muon + AdamW recipe at ZeRO stages 0/1/2 on the same processes: the optimizer "
                     "step's time, bytes on the wire, and optimizer state and masters per rank against the "
                     "replicated run."),
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
                   help=f"parameter counts of the host benchmark (default {' '.join(map(str, host.HOST_PARAM_COUNTS))}"
                        f", {' '.join(map(str, host.HOST_PARAM_COUNTS_QUICK))} quick; the per-parameter figure is the "
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
    print_note(f"wrote {path}")


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


_Section = tuple[list[dict], dict[str, object], Callable[[], None]]
"""What one benchmark gives :func:`_run`: its rows for ``--json``, its entries of the JSON's ``params``, and a
call that prints its tables."""


def _kernel_section(device: torch.device, names: Sequence[str], numel: int, warmup: int, repeats: int) -> _Section:
    """The kernel benchmarks ``names`` (of accumulate, l2norm, scale) and the copy they are measured against."""
    print_note(f"kernels: {numel:,} elements, {warmup} + {repeats} interleaved rounds ...", flush=True)
    rows, peak = kernels.bench_kernels(device, numel, names, warmup=warmup, repeats=repeats)
    params = dict(numel=numel, warmup=warmup, repeats=repeats, peak=peak,
                  bytes_per_element={"accumulate": kernels.ACCUMULATE_BYTES_PER_ELEMENT,
                                     "l2norm": kernels.L2NORM_BYTES_PER_ELEMENT,
                                     "scale": kernels.SCALE_BYTES_PER_ELEMENT,
                                     "peak": kernels.PEAK_BYTES_PER_ELEMENT})
    return rows, params, lambda: kernels.print_tables(rows, peak, repeats)


def _host_section(device: torch.device, host_params: Sequence[int] | None, quick: bool, warmup: int,
                  repeats: int) -> _Section:
    """The host benchmark over ``--host-params`` (default: the quick or full parameter counts)."""
    counts = tuple(host_params or (host.HOST_PARAM_COUNTS_QUICK if quick else host.HOST_PARAM_COUNTS))
    print_note(f"host: P = {', '.join(map(str, counts))} params x {host.HOST_PARAM_NUMEL} elements, "
               f"{', '.join(map(host.dtype_name, host.HOST_DTYPES))}, K = {host.HOST_ACCUMULATION_STEPS}, "
               f"{warmup} + {repeats} interleaved rounds ...", flush=True)
    rows, info = host.bench_host(device, counts, warmup=warmup, repeats=repeats)
    return rows, {"host": info}, lambda: host.print_tables(rows, info, device)


def _fusion_section(device: torch.device, quick: bool, warmup: int, repeats: int) -> _Section:
    """The gradient accumulation fusion benchmark on one bf16 Linear."""
    cfg = fusion.fusion_config(device.type, quick)
    print_note(f"fusion: bf16 Linear({cfg.features}, {cfg.features}), {cfg.tokens} tokens, "
               f"{warmup} + {repeats} interleaved rounds ...", flush=True)
    rows, info = fusion.bench_fusion(device, cfg, warmup=warmup, repeats=repeats)
    return [{"benchmark": "fusion", **r} for r in rows], {"fusion": info}, lambda: fusion.print_tables(rows, info)


def _e2e_section(device: torch.device, quick: bool, timed_updates: int | None) -> _Section:
    """The end-to-end GPT benchmark; ``timed_updates`` (``--e2e-updates``) replaces the config's if given."""
    cfg = e2e.e2e_config(device.type, quick)
    if timed_updates:
        cfg = e2e.E2EConfig(**{**asdict(cfg), "timed_updates": timed_updates})
    rows, info = e2e.bench_e2e(cfg, progress=lambda s: print_note(f"  {s}", "    ", flush=True))
    return rows, {"e2e": info}, lambda: e2e.print_tables(rows, info)


def _memory_section(quick: bool) -> _Section:
    """The memory table over gloo processes on the CPU (1 and 2 with ``quick``)."""
    worlds = (1, 2) if quick else memory.MEMORY_WORLD_SIZES
    print_note(f"memory: d = {', '.join(map(str, worlds))} gloo processes on the CPU ...", flush=True)
    rows, info = memory.bench_memory(memory.QUICK if quick else memory.MemoryConfig(), worlds)
    return rows, {"memory": info}, lambda: memory.print_tables(rows, info)


def _optimizers_section(quick: bool) -> _Section:
    """The Muon + AdamW rows over gloo processes on the CPU (1 and 2 with ``quick``)."""
    worlds = (1, 2) if quick else optimizers.WORLD_SIZES
    print_note(f"optimizers: Muon + AdamW, d = {', '.join(map(str, worlds))} gloo processes on the CPU ...",
               flush=True)
    rows, info = optimizers.bench_optimizers(optimizers.QUICK if quick else optimizers.OptimizersConfig(), worlds)
    return rows, {"optimizers": info}, lambda: optimizers.print_tables(rows, info)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    """Run the selected benchmarks in ``BENCHMARKS`` order, then print their tables and write --json / --plot."""
    which = list(args.only or BENCHMARKS)
    quick = bool(args.quick)
    numel = args.numel or (2**20 if quick else 2**28 if device.type == "cuda" else 2**25)
    repeats = args.repeats or (5 if quick else 15)
    warmup = 1 if quick else 3
    name = device_name(device)
    print_note(f"gaengine bench on {device} ({name}); torch {torch.__version__}, git {git_sha()}", flush=True)

    params: dict[str, object] = {"device": str(device), "device_name": name, "quick": quick, "benchmarks": which,
                                 "torch_threads": torch.get_num_threads()}
    kernel_names = [w for w in which if w not in ("host", "fusion", "e2e", "memory", "optimizers")]
    sections: list[_Section] = []
    if kernel_names:
        sections.append(_kernel_section(device, kernel_names, numel, warmup, repeats))
    if "host" in which:
        sections.append(_host_section(device, args.host_params, quick, warmup, repeats))
    if "fusion" in which:
        sections.append(_fusion_section(device, quick, warmup, repeats))
    if "e2e" in which:
        sections.append(_e2e_section(device, quick, args.e2e_updates))
    if "memory" in which:
        sections.append(_memory_section(quick))
    if "optimizers" in which:
        sections.append(_optimizers_section(quick))

    rows: list[dict] = []
    print()
    print_note(f"gaengine bench, {device} ({name}), torch {torch.__version__}")
    for section_rows, section_params, print_tables in sections:
        rows += section_rows
        params.update(section_params)
        print_tables()
    if args.json is not None:
        write_json(args.json, "gaengine bench", params, rows, [device])
    if args.plot is not None:
        _plot(rows, args.plot, f"gaengine bench, {device} ({name}), torch {torch.__version__}")
    return 0
