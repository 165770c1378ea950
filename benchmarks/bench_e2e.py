"""Benchmark: end-to-end training throughput and peak memory of a bf16 GPT, gaengine against the torch recipes.

    python benchmarks/bench_e2e.py [--device cpu|cuda] [--quick] [--timed-updates 5] [--n-layers 4 ...]
                                   [--threads N] [--json PATH]

The byte-level GPT of ``gaengine/tools/model.py`` in bf16, K = 8 micro-batches per update, AdamW (lr 1e-3, betas
(0.9, 0.95), weight decay 0.1), clipping at 1.0, the same seed, initialization and micro-batches (random
bytes) for every variant:

(a)  gaengine: ``GradientAccumulator`` + ``gaengine.optim.FusedAdamW`` (fp32 main_grad, fp32 masters,
     clip folded into the update, bf16 model written in the optimizer pass)
(a') gaengine: ``GradientAccumulator`` + ``torch.optim.AdamW(fused=True)`` (+ a master -> bf16 copy)
(a'') gaengine, ``master_weights=False``: fp32 main_grad, ``torch.optim.AdamW(fused=True)`` on the bf16 params
     (bf16 m and v, as in (b)); at the update one fp32 pass normalizes and clips, each gradient is rounded
     once to bf16 (a transient copy while the optimizer runs)
(b)  plain recipe: bf16 ``.grad`` accumulated by ``(loss / K).backward()``, ``clip_grad_norm_``, fused AdamW
     on the bf16 params (bf16 m and v), ``zero_grad(set_to_none=True)``  <- the baseline of the ratio
(c)  torch-native fp32 accumulation: ``p.grad_dtype = torch.float32`` on every bf16 param (autograd casts
     each incoming grad and accumulates in fp32), fp32 master copies whose ``.grad`` is the param's fp32
     ``.grad`` (no copy), ``clip_grad_norm_`` + fused AdamW on the masters, ``zero_grad``, then
     ``torch._foreach_copy_(params, masters)``. Same precision as (a): the like-for-like comparison.

Bytes of gradient + optimizer state per parameter (no activations): (a), (a'), (c): fp32 grad 4 + fp32 master 4
+ fp32 m, v 8 = 16 B; (a''): fp32 grad 4 + bf16 m, v 4 = 8 B; (b): bf16 grad 2 + bf16 m, v 4 = 6 B. Every
variant also holds the bf16 model (2 B). An fp32 gradient sum (4 B) plus AdamW's two moments kept at least
in bf16 (4 B) is 8 B: no exact fp32-accumulating AdamW holds less than (b)'s 6 B unless its moments drop below
8 bits each.

Throughput: all variants in one process, each on its own model, one update of each per round (the same
micro-batches), ``--timed-updates`` rounds after ``--warmup-updates``; update ms is the median, tokens/s =
tokens per update / median ms, the ratio is the median of per-round speedups over (b); the same by process
CPU time too (with ``--threads 1`` it leaves out time spent descheduled on a shared machine). Memory: each variant
again in a fresh subprocess (a short run), so its peak is its own: CUDA ``max_memory_allocated``; CPU peak
RSS (``VmHWM``) and its growth above the RSS once model and data exist, and the peak of live tensor bytes
(``torch.profiler`` allocation events, a second run of the same updates); and an exact count of the
gradient/optimizer/master storages at their high point (the end of a window's last backward).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

import torch  # noqa: E402

from gaengine.tools.bench import E2E_VARIANTS, E2EConfig, bench_e2e, e2e_config  # noqa: E402

COLUMNS = [("variant", "variant", "s"), ("ms", "ms / update", ".1f"), ("tokens_per_s", "tokens/s", ",.0f"),
           ("ratio_vs_torch", "vs (b)", ".3f"), ("cpu_ms", "CPU ms / update", ".1f"),
           ("ratio_cpu_time", "vs (b), CPU time", ".3f"), ("peak_mib", "peak MiB", ",.1f"),
           ("peak_delta_mib", "peak delta MiB", ",.1f"), ("peak_live_mib", "peak live MiB", ",.1f"),
           ("state_mib", "state MiB", ",.2f"),
           ("state_bytes_per_param", "state B/param", ".1f"), ("final_loss", "last loss", ".4f")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model, two timed updates (smoke test)")
    parser.add_argument("--variants", nargs="+", choices=list(E2E_VARIANTS), default=list(E2E_VARIANTS))
    for field in ("n_layers", "d_model", "n_heads", "seq_len", "micro_batch_size", "accumulation_steps",
                  "warmup_updates", "timed_updates", "seed"):
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=None,
                            help=f"override the device's default {field}")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (workers inherit it)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    cfg = asdict(e2e_config(args.device, args.quick))
    cfg.update({k: v for k, v in vars(args).items() if k in cfg and v is not None})
    cfg = E2EConfig(**cfg)
    rows, info = bench_e2e(cfg, args.variants, progress=lambda s: print(s, file=sys.stderr, flush=True))
    c = info["config"]
    title = (f"end to end on {args.device}: {info['num_params']:,}-parameter bf16 GPT ({c['n_layers']} layers, "
             f"d_model {c['d_model']}), {c['micro_batch_size']} x {c['seq_len']} tokens x K={c['accumulation_steps']}"
             f" = {info['tokens_per_update']:,} tokens per update; {c['timed_updates']} timed updates after "
             f"{c['warmup_updates']}, variants interleaved; torch threads={torch.get_num_threads()}")
    print_table(rows, COLUMNS, title)
    print("ms: median wall time per update; vs (b): median per-round speedup over (b); CPU ms: process CPU time "
          "(with one torch thread it leaves out time spent descheduled on a shared machine; with more threads it "
          "also counts their spin-waits).")
    print(f"memory: {info['memory']}.\nstate: {info['state']}.")
    if args.json:
        params = {"device": args.device, **info}
        write_json(args.json, "e2e", params, rows, [args.device])
    return 0


if __name__ == "__main__":
    sys.exit(main())
