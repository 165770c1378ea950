"""Benchmark: accumulate a bf16 gradient into an fp32 main_grad, every backend against the eager recipe.

    python benchmarks/bench_accumulate.py [--numel 50000000] [--device cpu|cuda|all] [--json PATH]

Operation: ``main_grad += float(grad)`` (micro-batch k > 0 of an accumulation window, scale 1).
Bytes model (docs/design.md): 10 B/element = read grad 2 + read main_grad 4 + write main_grad 4. Every row's
GB/s uses this model, so the eager baseline ``main_grad.add_(grad.float())`` (tests/reference.py; it
really moves 18 B/element plus a fresh temporary) shows as slow as it is.
Peak: fp32 ``a.add_(b)`` on the same device in the same run, 12 B/element (read 4 + 4, write 4): the
bandwidth a streaming read-read-write kernel can reach here. ``% of peak`` = GB/s / peak GB/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gb_per_s, print_table, time_ms, write_json  # noqa: E402

from gaengine.backends import get_backend  # noqa: E402
from gaengine.tools.bench import plausible  # noqa: E402
from tests.reference import eager_accumulate_  # noqa: E402

ACCUMULATE_BYTES_PER_ELEMENT = 10  # read bf16 grad 2 + read fp32 main_grad 4 + write fp32 main_grad 4
PEAK_BYTES_PER_ELEMENT = 12  # fp32 a.add_(b): read 4 + read 4 + write 4


def backends_for(device: torch.device) -> list[str]:
    """Backends that can run on ``device``: torch everywhere, cpu on CPU, triton on CUDA (when they load)."""
    names = ["torch"] + (["cpu"] if device.type == "cpu" else ["triton"] if device.type == "cuda" else [])
    available = []
    for name in names:
        try:
            get_backend(name, device)
        except RuntimeError as exc:
            print(f"skipping backend {name!r} on {device}: {exc}")
            continue
        available.append(name)
    return available


def bench_device(device: torch.device, numel: int, warmup: int, repeats: int) -> tuple[list[dict], dict]:
    main_grad = torch.randn(numel, dtype=torch.float32, device=device)
    grad = torch.randn(numel, dtype=torch.float32, device=device).to(torch.bfloat16)

    # Peak: fp32 a.add_(b), same size, same device, same run.
    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    peak = time_ms(lambda: a.add_(b), device=device, warmup=warmup, repeats=repeats)
    peak_gbs = gb_per_s(numel, PEAK_BYTES_PER_ELEMENT, peak["median_ms"])
    bound = plausible.bandwidth_bound([("fp32 a.add_(b)", numel, PEAK_BYTES_PER_ELEMENT, [peak["min_ms"]])], device)
    del a, b

    variants = {"eager: main_grad.add_(grad.float())": lambda: eager_accumulate_(main_grad, grad)}
    for name in backends_for(device):
        backend = get_backend(name, device)
        # Sanity, untimed: an unscaled accumulate is bitwise equal to the eager recipe.
        expected, actual = eager_accumulate_(main_grad.clone(), grad), backend.accumulate_(main_grad.clone(), grad)
        if not torch.equal(actual.view(torch.int32), expected.view(torch.int32)):
            raise AssertionError(f"backend {name!r} is not bitwise equal to the eager accumulate")
        del expected, actual
        variants[name] = lambda backend=backend: backend.accumulate_(main_grad, grad)

    rows, eager_ms = [], None
    for label, fn in variants.items():
        t = time_ms(fn, device=device, warmup=warmup, repeats=repeats)
        eager_ms = eager_ms or t["median_ms"]
        gbs = gb_per_s(numel, ACCUMULATE_BYTES_PER_ELEMENT, t["median_ms"])
        rows.append({"device": str(device), "backend": label, "ms": t["median_ms"], "min_ms": t["min_ms"],
                     "max_ms": t["max_ms"], "gb_s": gbs, "speedup_vs_eager": eager_ms / t["median_ms"],
                     "pct_of_peak": 100.0 * gbs / peak_gbs})
    plausible.mark(rows, lambda r: plausible.check_bandwidth(r["gb_s"], bound,
                                                             working_set_bytes=numel * ACCUMULATE_BYTES_PER_ELEMENT))
    peak_info = {"device": str(device), "op": "fp32 a.add_(b)", "ms": peak["median_ms"], "gb_s": peak_gbs,
                 "bytes_per_element": PEAK_BYTES_PER_ELEMENT, "bound_gb_s": bound.value}
    return rows, peak_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="elements in the buffer (default 50M)")
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                        help="all (default): CPU, plus CUDA when available")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device == "cuda" or (args.device == "all" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device")
        devices.append(torch.device("cuda"))

    all_rows, peaks = [], []
    for device in devices:
        rows, peak = bench_device(device, args.numel, args.warmup, args.repeats)
        all_rows += rows
        peaks.append(peak)
        title = (f"accumulate bf16 -> fp32, {args.numel:,} elements on {device} "
                 f"(bytes model {ACCUMULATE_BYTES_PER_ELEMENT} B/element; peak = fp32 a.add_(b) "
                 f"{peak['gb_s']:.1f} GB/s at {PEAK_BYTES_PER_ELEMENT} B/element, {peak['ms']:.2f} ms)")
        print_table(rows, [("backend", "backend", "s"), ("ms", "ms (median)", ".2f"), ("gb_s", "GB/s", ".1f"),
                           ("speedup_vs_eager", "vs eager", ".2f"), ("pct_of_peak", "% of peak", ".0f")], title)
        for line in plausible.invalid_note(rows, "backend"):
            print(line)

    if args.json:
        params = {"numel": args.numel, "src_dtype": "bfloat16", "dst_dtype": "float32",
                  "bytes_per_element": ACCUMULATE_BYTES_PER_ELEMENT, "warmup": args.warmup,
                  "repeats": args.repeats, "peaks": peaks}
        write_json(args.json, "accumulate", params, all_rows, devices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
