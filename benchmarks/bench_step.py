"""Benchmark: the optimizer update of one accumulation window, the engine against the standard recipe.

    python benchmarks/bench_step.py [--numel 50000000] [--params 5] [--device cpu|cuda] [--json PATH]

Model: ``--params`` flat bf16 ``nn.Parameter``s totalling ``--numel`` elements (50 M by default). Each window
accumulates K = 4 micro-batches of synthetic bf16 gradients (the backward of ``sum(p * g)``, untimed); only
the update that follows is timed, from "gradients ready" to "bf16 model parameters hold the new weights":

(a) engine: ``acc.step()`` of ``GradientAccumulator(params, FusedAdamW(...), accumulation_steps=4,
    max_grad_norm=1.0)``: the norm and non-finite flag come from the last micro-batch's accumulate (the
    partials of the backend's bucket accumulate, ``accumulate_bucket_``), so the update reads no
    buffer for them; the clip coefficient and the skip flag are computed on the device, then FusedAdamW runs
    with the coefficient folded in (``grad_scale``) and the bf16 model write in the same pass
    (``attach_model_params``, wired by the engine). A window in which some parameter got no gradient in the
    last micro-batch falls back to one norm pass (+4 B).
(b) recipe (research/pytorch_native.md): fp32 master weights with fp32 ``.grad`` (the accumulated window),
    ``torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)``, ``torch.optim.AdamW(masters,
    fused=True).step()``, then ``torch._foreach_copy_(model_params, masters)``.

Bytes model, per parameter (each pass's own reads and writes, fp32 = 4 B, bf16 = 2 B):
  engine  30 B = FusedAdamW: read grad, m, v, master 16, write m, v, master 12, write bf16 model 2
               (the norm rides on the last accumulate, which reads and writes those bytes anyway)
  recipe  46 B = clip_grad_norm_: norm read grad 4 + clip grad *= coef read 4 write 4
               + fused AdamW: read grad, m, v, master 16, write m, v, master 12
               + master -> model copy: read 4 write 2
So the bytes alone predict a 46 / 30 = 1.53x speedup at equal bandwidth (not counted: the read-for-ownership
of the recipe's bf16 copy, +2 B, which the engine's non-temporal model stores avoid for large parameters).
The indented rows time each pass by itself (same bytes model per pass), to show where the rest comes from.
On a 2-core CPU the AdamW kernels are compute-bound when memory is fast (each divides and takes a square root
per element) and memory-bound when other processes take the bandwidth; torch's CPU norm and fp32 -> bf16
copy fall further behind in the second case, so the measured speedup moves between the bytes ratio and ~2x.
Peak: fp32 ``a.add_(b)`` (12 B/element) on the same device; ``% of peak`` = GB/s / peak. All rows are timed in
interleaved rounds (one call of each per round), and a speedup is the median of the per-round ratios, so a
machine shared with other processes shifts every row alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gb_per_s, print_table, time_interleaved, write_json  # noqa: E402

from gaengine import GradientAccumulator, ops  # noqa: E402
from gaengine.tools.bench import plausible  # noqa: E402
from gaengine.optim import FusedAdamW  # noqa: E402

K = 4  # micro-batches per window
MAX_GRAD_NORM = 1.0
LR, WEIGHT_DECAY = 1e-4, 0.01
ENGINE_BYTES = 16 + 12 + 2  # FusedAdamW reads; its writes; bf16 model write (norm: free, from the last accumulate)
RECIPE_BYTES = 4 + 8 + 16 + 12 + 6  # norm; clip R+W; fused AdamW reads; its writes; master -> model copy
NORM_BYTES = 4  # the engine's norm + non-finite flag over the fp32 main_grad
FUSED_ADAMW_STEP_BYTES = 16 + 12 + 2
CLIP_BYTES = 4 + 8  # clip_grad_norm_: the norm, then grad *= coef
TORCH_ADAMW_STEP_BYTES = 16 + 12
COPY_BYTES = 4 + 2  # fp32 master -> bf16 model
PEAK_BYTES = 12  # fp32 a.add_(b)


def split(numel: int, n_params: int) -> list[int]:
    """``n_params`` sizes adding up to ``numel``; the last one odd-sized (not a multiple of any block)."""
    base = numel // n_params
    sizes = [base] * n_params
    sizes[-1] += numel - base * n_params
    return sizes


def make_grads(sizes: list[int], device: torch.device, seed: int) -> list[list[torch.Tensor]]:
    """K micro-batches of bf16 gradients per parameter (their window's norm is above 1: clipping is active)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [[(torch.randn(n, generator=g) * 1e-3).to(device=device, dtype=torch.bfloat16) for n in sizes]
            for _ in range(K)]


def bench(numel: int, n_params: int, device: torch.device, warmup: int, repeats: int) -> tuple[list[dict], dict]:
    sizes = split(numel, n_params)
    micro_grads = make_grads(sizes, device, seed=0)

    # (a) the engine: bf16 model parameters; the accumulator keeps fp32 masters and the fp32 main_grad.
    g0 = torch.Generator().manual_seed(1)
    model_a = [nn.Parameter(torch.randn(n, generator=g0).to(device=device, dtype=torch.bfloat16)) for n in sizes]
    fused = FusedAdamW(model_a, lr=LR, weight_decay=WEIGHT_DECAY)
    acc = GradientAccumulator(model_a, fused, accumulation_steps=K, max_grad_norm=MAX_GRAD_NORM)
    writes_model = acc.sharding.update.writes_model

    def engine_window() -> None:  # untimed: K backward passes whose gradients are the synthetic ones
        for grads in micro_grads:
            acc.backward(sum((p * g).sum() for p, g in zip(model_a, grads)))

    # FusedAdamW.step() alone, on its own fp32 masters whose .grad holds the window's fp32 gradient, each attached
    # to a bf16 model parameter: the pass acc.step() runs (the engine's masters hold no .grad outside acc.step(),
    # so stepping the engine's optimizer here would update nothing: a no-op, as the first GPU run timed).
    g0 = torch.Generator().manual_seed(1)
    model_c = [torch.randn(n, generator=g0).to(device=device, dtype=torch.bfloat16) for n in sizes]
    masters_c = [nn.Parameter(p.float()) for p in model_c]
    for m, *gs in zip(masters_c, *micro_grads):
        m.grad = sum(g.float() for g in gs) / K
    fused_c = FusedAdamW(masters_c, lr=LR, weight_decay=WEIGHT_DECAY)
    fused_c.attach_model_params(zip(masters_c, model_c))
    grad_scale, found_inf = torch.tensor(2.0, device=device), torch.tensor(0.0, device=device)

    def fused_step_alone() -> None:
        fused_c.grad_scale, fused_c.found_inf = grad_scale, found_inf
        try:
            fused_c.step()
        finally:
            del fused_c.grad_scale, fused_c.found_inf

    # (b) the standard recipe: fp32 masters with fp32 grads (the accumulated window, made once, untimed).
    g0 = torch.Generator().manual_seed(1)
    model_b = [torch.randn(n, generator=g0).to(device=device, dtype=torch.bfloat16) for n in sizes]
    masters = [nn.Parameter(p.float()) for p in model_b]
    for m, *gs in zip(masters, *micro_grads):
        m.grad = sum(g.float() for g in gs) / K
    ref = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(masters, MAX_GRAD_NORM, foreach=True)

    def copy_to_model() -> None:
        with torch.no_grad():
            torch._foreach_copy_(model_b, masters)

    def recipe_update() -> None:
        clip()
        ref.step()
        copy_to_model()

    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    variants = {  # name -> (setup, fn, bytes per parameter, baseline name for the speedup)
        "(b) recipe: clip_grad_norm_ + AdamW(fused) + master->bf16 copy": (None, recipe_update, RECIPE_BYTES, "b"),
        "    clip_grad_norm_(foreach=True)": (None, clip, CLIP_BYTES, None),
        "    torch AdamW(fused=True).step()": (None, ref.step, TORCH_ADAMW_STEP_BYTES, None),
        "    torch._foreach_copy_(model, masters)": (None, copy_to_model, COPY_BYTES, None),
        "(a) engine: acc.step() = FusedAdamW (norm from the accumulate; clip, skip, bf16 write fused)": (
            engine_window, acc.step, ENGINE_BYTES, "b"),
        "    l2norm_sq(main_grad) + non-finite flag (only when a param misses the last micro-batch)": (None, lambda: ops.l2norm_sq(acc.main_grad.data), NORM_BYTES,
                                                       None),
        "    FusedAdamW.step() on fp32 masters with .grad (grad_scale, found_inf, bf16 write)": (
            None, fused_step_alone, FUSED_ADAMW_STEP_BYTES, "torch-step"),
        "peak: fp32 a.add_(b)": (None, lambda: a.add_(b), PEAK_BYTES, None),
    }
    # Each timed update must change the parameters it updates (a no-op would not): the two that only one row
    # touches are compared before and after the rounds.
    updated = {names: [t.detach().clone() for t in ts] for names, ts in (("engine", model_a), ("fused", model_c))}
    # In their order each round (not shuffled), each with its untimed setup right before it.
    samples = time_interleaved({k: (v[0], v[1]) for k, v in variants.items()}, device=device, warmup=warmup,
                               repeats=repeats, shuffle=False)
    acc.close()
    unchanged = {k for k, ts in (("engine", model_a), ("fused", model_c))
                 if all(torch.equal(a, b) for a, b in zip(updated[k], ts))}
    names = list(variants)
    baselines = {"b": names[0], "torch-step": names[2]}
    peak_name = names[-1]
    peak_gbs = gb_per_s(numel, PEAK_BYTES, statistics.median(samples[peak_name]))
    bound = plausible.bandwidth_bound([("fp32 a.add_(b)", numel, PEAK_BYTES, samples[peak_name])], device)
    no_op = {names[4]: "engine", names[6]: "fused"}
    rows = []
    for name, (_, _, nbytes, base) in variants.items():
        if name == peak_name:
            continue
        ms = statistics.median(samples[name])
        gbs = gb_per_s(numel, nbytes, ms)
        # Speedup: the median over rounds of the per-round ratio (both timed seconds apart, same conditions).
        speedup = None
        if base is not None:
            speedup = statistics.median(x / y for x, y in zip(samples[baselines[base]], samples[name]))
        rows.append({"device": str(device), "variant": name, "bytes_per_param": nbytes, "ms": ms,
                     "min_ms": min(samples[name]), "max_ms": max(samples[name]), "gb_s": gbs, "speedup": speedup,
                     "pct_of_peak": 100.0 * gbs / peak_gbs, "baseline": baselines.get(base)})

    def check(row: dict) -> str | None:
        if no_op.get(row["variant"]) in unchanged:
            return ("a no-op: the parameters it updates are bit for bit what they were before "
                    f"{warmup + repeats} calls")
        reason = plausible.check_bandwidth(row["gb_s"], bound, working_set_bytes=numel * row["bytes_per_param"])
        if reason is None and row["baseline"] in invalid:
            reason = f"its baseline ({row['baseline'].strip()}) is an invalid measurement"
        return reason

    invalid: set[str] = set()
    for row in rows:  # baselines come first: a ratio to an invalid baseline is invalid too
        if plausible.mark([row], check):
            invalid.add(row["variant"])
    info = {"device": str(device), "peak_op": "fp32 a.add_(b)", "peak_ms": statistics.median(samples[peak_name]),
            "peak_gb_s": peak_gbs, "bound_gb_s": bound.value, "bound_margin": plausible.MARGIN,
            "engine_writes_model_in_optimizer": writes_model, "param_sizes": sizes}
    return rows, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="parameters in total (default 50M)")
    parser.add_argument("--params", type=int, default=5, help="number of parameter tensors (default 5)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
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
                       ("min_ms", "ms (min)", ".1f"), ("gb_s", "GB/s", ".1f"), ("speedup", "speedup", ".2f"),
                       ("pct_of_peak", "% of peak", ".0f")], title)
    for line in plausible.invalid_note(rows):
        print(line)
    print(f"\nplausibility: every GB/s against {plausible.MARGIN}x the best round of the peak "
          f"({info['bound_gb_s']:.1f} GB/s); an invalid row shows no figure.")
    print("\nspeedup: median of per-round ratios; (a) against (b) the recipe, FusedAdamW.step() against torch "
          "AdamW(fused=True).step(). Indented rows: each pass alone.")
    if args.json:
        params = {"numel": args.numel, "n_params": args.params, "accumulation_steps": K, "max_grad_norm": MAX_GRAD_NORM,
                  "engine_bytes_per_param": ENGINE_BYTES, "recipe_bytes_per_param": RECIPE_BYTES,
                  "warmup": args.warmup, "repeats": args.repeats, **info}
        write_json(args.json, "step", params, rows, [device])
    return 0


if __name__ == "__main__":
    sys.exit(main())
