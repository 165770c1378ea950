"""Benchmark: the optimizer update of one accumulation window, the engine against the standard recipe.

    python benchmarks/bench_step.py [--numel 50000000] [--params 5] [--device cpu|cuda] [--json PATH]

Model: ``--params`` flat bf16 ``nn.Parameter``s totalling ``--numel`` elements (50 M by default). Each window
accumulates K = 4 micro-batches of synthetic bf16 gradients (the backward of ``sum(p * g)``, untimed); only
the update that follows is timed, from "gradients ready" to "bf16 model parameters hold the new weights":

(a) engine: ``acc.step()`` of ``GradientAccumulator(params, FusedAdamW(...), accumulation_steps=4,
    max_grad_norm=1.0)``: one norm pass over the fp32 main_grad buffer, the clip coefficient and the skip flag
    on the device, then FusedAdamW with the coefficient folded in (``grad_scale``) and the bf16 model write in
    the same pass (``attach_model_params``, wired by the engine).
(b) recipe (research/pytorch_native.md): fp32 master weights with fp32 ``.grad`` (the accumulated window),
    ``torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)``, ``torch.optim.AdamW(masters,
    fused=True).step()``, then ``torch._foreach_copy_(model_params, masters)``.

Bytes model, per parameter (each pass's own reads and writes, fp32 = 4 B, bf16 = 2 B):
  engine  34 B = norm + non-finite flag: read main_grad 4
               + FusedAdamW: read grad, m, v, master 16, write m, v, master 12, write bf16 model 2
  recipe  46 B = clip_grad_norm_: norm read grad 4 + clip grad *= coef read 4 write 4
               + fused AdamW: read grad, m, v, master 16, write m, v, master 12
               + master -> model copy: read 4 write 2
So the bytes alone predict a 46 / 34 = 1.35x speedup at equal bandwidth. Two more rows time the optimizer
step by itself (FusedAdamW 30 B with the model write, torch fused AdamW 28 B), to show each kernel's bandwidth.
Peak: fp32 ``a.add_(b)`` (12 B/element) on the same device in the same run; ``% of peak`` = GB/s / peak.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gb_per_s, print_table, time_ms, write_json  # noqa: E402

from gaengine import GradientAccumulator  # noqa: E402
from gaengine.optim import FusedAdamW  # noqa: E402

K = 4  # micro-batches per window
MAX_GRAD_NORM = 1.0
LR, WEIGHT_DECAY = 1e-4, 0.01
ENGINE_BYTES = 4 + 16 + 12 + 2  # norm; FusedAdamW reads; its writes; bf16 model write
RECIPE_BYTES = 4 + 8 + 16 + 12 + 6  # norm; clip R+W; fused AdamW reads; its writes; master -> model copy
FUSED_ADAMW_STEP_BYTES = 16 + 12 + 2
TORCH_ADAMW_STEP_BYTES = 16 + 12
PEAK_BYTES = 12  # fp32 a.add_(b)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_with_setup(setup: Callable[[], object], fn: Callable[[], object], device: torch.device, warmup: int,
                    repeats: int) -> dict[str, float]:
    """Like ``common.time_ms``, but runs ``setup()`` untimed before every call of ``fn``."""
    samples_ms = []
    for i in range(warmup + repeats):
        setup()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            samples_ms.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(samples_ms), "min_ms": min(samples_ms), "max_ms": max(samples_ms)}


def split(numel: int, n_params: int) -> list[int]:
    """``n_params`` sizes adding up to ``numel``; the last one odd-sized (not a multiple of any block)."""
    base = numel // n_params
    sizes = [base] * n_params
    sizes[-1] += numel - base * n_params
    return sizes


def make_grads(sizes: list[int], device: torch.device, seed: int) -> list[list[torch.Tensor]]:
    """K micro-batches of bf16 gradients per parameter, roughly unit scale (so clipping is active)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [[(torch.randn(n, generator=g) * 1e-3).to(device=device, dtype=torch.bfloat16) for n in sizes]
            for _ in range(K)]


def bench(numel: int, n_params: int, device: torch.device, warmup: int, repeats: int) -> tuple[list[dict], dict]:
    sizes = split(numel, n_params)
    micro_grads = make_grads(sizes, device, seed=0)

    # Peak: fp32 a.add_(b), same size, same device, same run.
    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    peak = time_ms(lambda: a.add_(b), device=device, warmup=warmup, repeats=repeats)
    peak_gbs = gb_per_s(numel, PEAK_BYTES, peak["median_ms"])
    del a, b

    # (a) the engine.
    g0 = torch.Generator().manual_seed(1)
    model = [nn.Parameter(torch.randn(n, generator=g0).to(device=device, dtype=torch.bfloat16)) for n in sizes]
    fused = FusedAdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    acc = GradientAccumulator(model, fused, accumulation_steps=K, max_grad_norm=MAX_GRAD_NORM)

    def engine_window() -> None:
        for grads in micro_grads:
            acc.backward(sum((p * g).sum() for p, g in zip(model, grads)))

    engine = time_with_setup(engine_window, acc.step, device, warmup, repeats)
    writes_model = getattr(acc, "_optimizer_writes_model", False)
    # FusedAdamW's step alone, on the engine's state (masters keep their main_grad views as .grad).
    fused.grad_scale = torch.tensor(2.0, device=device)
    fused.found_inf = torch.tensor(0.0, device=device)
    fused_step = time_ms(fused.step, device=device, warmup=warmup, repeats=repeats)
    del fused.grad_scale, fused.found_inf
    acc.close()
    del acc, fused, model

    # (b) the standard recipe: fp32 masters with fp32 grads (the accumulated window, untimed).
    g0 = torch.Generator().manual_seed(1)
    model = [torch.randn(n, generator=g0).to(device=device, dtype=torch.bfloat16) for n in sizes]
    masters = [nn.Parameter(p.float()) for p in model]
    for m, *gs in zip(masters, *micro_grads):
        m.grad = sum(g.float() for g in gs) / K
    ref = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def recipe_update() -> None:
        torch.nn.utils.clip_grad_norm_(masters, MAX_GRAD_NORM, foreach=True)
        ref.step()
        with torch.no_grad():
            torch._foreach_copy_(model, masters)

    recipe = time_ms(recipe_update, device=device, warmup=warmup, repeats=repeats)
    torch_step = time_ms(ref.step, device=device, warmup=warmup, repeats=repeats)
    del ref, masters, model

    rows = []
    for label, t, nbytes, base in (
        ("(b) recipe: clip_grad_norm_ + AdamW(fused) + master->bf16 copy", recipe, RECIPE_BYTES, recipe),
        ("(a) engine: acc.step() = norm + FusedAdamW (clip, skip, bf16 write fused)", engine, ENGINE_BYTES, recipe),
        ("    torch AdamW(fused=True).step() alone", torch_step, TORCH_ADAMW_STEP_BYTES, torch_step),
        ("    FusedAdamW.step() alone (grad_scale, found_inf, bf16 write)", fused_step, FUSED_ADAMW_STEP_BYTES,
         torch_step),
    ):
        gbs = gb_per_s(numel, nbytes, t["median_ms"])
        rows.append({"device": str(device), "variant": label, "bytes_per_param": nbytes, "ms": t["median_ms"],
                     "min_ms": t["min_ms"], "max_ms": t["max_ms"], "gb_s": gbs,
                     "speedup": base["median_ms"] / t["median_ms"], "pct_of_peak": 100.0 * gbs / peak_gbs})
    info = {"device": str(device), "peak_op": "fp32 a.add_(b)", "peak_ms": peak["median_ms"], "peak_gb_s": peak_gbs,
            "engine_writes_model_in_optimizer": writes_model, "param_sizes": sizes}
    return rows, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="parameters in total (default 50M)")
    parser.add_argument("--params", type=int, default=5, help="number of parameter tensors (default 5)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    rows, info = bench(args.numel, args.params, device, args.warmup, args.repeats)
    title = (f"update of one window (K={K}), {args.numel:,} bf16 params in {args.params} tensors on {device}, "
             f"torch threads={torch.get_num_threads()}; peak = fp32 a.add_(b) {info['peak_gb_s']:.1f} GB/s; "
             f"engine writes the bf16 model in the optimizer pass: {info['engine_writes_model_in_optimizer']}")
    print_table(rows, [("variant", "variant", "s"), ("bytes_per_param", "B/param", "d"), ("ms", "ms (median)", ".1f"),
                       ("gb_s", "GB/s", ".1f"), ("speedup", "vs baseline", ".2f"), ("pct_of_peak", "% of peak", ".0f")],
                title)
    print("\nvs baseline: rows (a)/(b) against (b) the recipe; the two 'alone' rows against torch AdamW(fused).step().")
    if args.json:
        params = {"numel": args.numel, "n_params": args.params, "accumulation_steps": K, "max_grad_norm": MAX_GRAD_NORM,
                  "engine_bytes_per_param": ENGINE_BYTES, "recipe_bytes_per_param": RECIPE_BYTES,
                  "warmup": args.warmup, "repeats": args.repeats, **info}
        write_json(args.json, "step", params, rows, [device])
    return 0


if __name__ == "__main__":
    sys.exit(main())
