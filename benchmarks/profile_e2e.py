"""Where one end-to-end update goes: host vs device time, per variant of ``gaengine bench``'s e2e benchmark.

    python benchmarks/profile_e2e.py [--device cpu|cuda] [--quick] [--variants plain gaengine-fused native-fp32]
                                     [--tiny] [--rounds 8] [--json PATH] [--trace-dir DIR]

The variants of :data:`gaengine.tools.bench.E2E_VARIANTS`, each on its own model with the same micro-batches,
are timed interleaved (one update of each per round, ``--rounds`` rounds after 3 warm-up updates; on CUDA by
events inside synchronized regions, ``time_rounds``); the ratio is the median per-round speedup over the first
variant. Then one update of each runs under ``torch.profiler`` and its row gives: the wall ms under the
profiler, the device kernel ms (sum of the CUDA kernels' durations; on CPU none: the host runs the kernels) and
their count, and the host ms spent in autograd's ``AccumulateGrad`` (post-accumulate hooks included) and in
``Optimizer.step``. ``--trace-dir`` writes a Chrome trace per variant there. The repository's own copy of the
profile the first GPU runs took from outside the repository: it goes wherever ``run_gpu.sh`` goes.
"""

from __future__ import annotations

import argparse
import collections
import statistics
from dataclasses import asdict
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, time_rounds, tiny_e2e_config, write_json  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gaengine.tools.bench import E2E_VARIANTS, e2e  # noqa: E402
from gaengine.tools.bench.common import sync, without_kineto_log  # noqa: E402

HOST_EVENTS = ("torch::autograd::AccumulateGrad", "Optimizer.step")
"""Host events whose time is summed per variant (a prefix match: ``Optimizer.step#AdamW.step``)."""


def profile_e2e(cfg: e2e.E2EConfig, variants: list[str], rounds: int, trace_dir: Path | None = None) -> list[dict]:
    """One row per variant: ``ms`` (median update), ``ratio`` (median per-round speedup over ``variants[0]``),
    ``profiled_wall_ms``, ``kernel_ms``, ``kernels``, ``host_ms`` (event name -> ms)."""
    device = cfg.device
    built = {v: e2e._build_variant(v, cfg) for v in variants}
    windows = e2e._e2e_windows(cfg, 2)

    def one(b) -> None:
        b.accumulate(windows[0])
        b.update()

    samples = time_rounds({v: (lambda b=b: one(b)) for v, b in built.items()}, device=torch.device(device),
                          warmup=3, repeats=rounds, shuffle=False).ms
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rows = []
    for v, b in built.items():
        with without_kineto_log(), profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            one(b)
            sync(device)
            wall = (time.perf_counter() - t0) * 1e3
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        host: dict[str, float] = collections.defaultdict(float)
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU:
                for name in HOST_EVENTS:
                    if e.name.startswith(name):
                        host[name] += e.time_range.elapsed_us() / 1e3
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace_dir / f"{v}.json"))
        rows.append({"variant": v, "device": device, "ms": statistics.median(samples[v]),
                     "ratio": statistics.median(p / x for p, x in zip(samples[variants[0]], samples[v])),
                     "profiled_wall_ms": wall, "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3,
                     "kernels": len(kernels), **{f"host_ms {n}": host.get(n, 0.0) for n in HOST_EVENTS}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="the quick e2e model of `gaengine bench --quick`")
    parser.add_argument("--tiny", action="store_true", help="a 1-layer, 32-wide model, K = 2 (dry runs)")
    parser.add_argument("--variants", nargs="+", choices=list(E2E_VARIANTS),
                        default=["plain", "gaengine-fused", "native-fp32"])
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    parser.add_argument("--json", metavar="PATH", default=None)
    parser.add_argument("--trace-dir", type=Path, default=None, help="write a Chrome trace per variant here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    cfg = tiny_e2e_config(args.device) if args.tiny else e2e.e2e_config(args.device, args.quick)
    rows = profile_e2e(cfg, args.variants, args.rounds, args.trace_dir)
    print_table(rows, [("variant", "variant", "s"), ("ms", "ms/update", ".1f"), ("ratio", f"vs {args.variants[0]}", ".2f"),
                       ("profiled_wall_ms", "wall ms (profiled)", ".1f"), ("kernel_ms", "kernel ms", ".1f"),
                       ("kernels", "kernels", "d")]
                + [(f"host_ms {n}", f"host ms {n.split('::')[-1]}", ".1f") for n in HOST_EVENTS],
                f"one e2e update on {args.device}, {args.rounds} interleaved rounds, then one profiled update each")
    if args.json:
        write_json(args.json, "profile_e2e", {"device": args.device, "config": asdict(cfg), "rounds": args.rounds},
                   rows, [args.device])
    return 0


if __name__ == "__main__":
    sys.exit(main())
