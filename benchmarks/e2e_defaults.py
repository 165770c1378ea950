"""The e2e rows that decide gaengine's defaults: a bf16 GPT trained three ways, with and without fusion.

    python benchmarks/e2e_defaults.py [--device cpu|cuda] [--tiny] [--models 86M 304M] [--updates 10]
                                      [--json PATH]

Models (the byte-level GPT of :mod:`gaengine.tools.model`, bf16 parameters): ``86M`` = 12 layers x 768 (GPT-2
small with the byte vocabulary), ``304M`` = 24 x 1024; 8 sequences of 1024 tokens per micro-batch, K = 8 on
CUDA (on CPU: 2 sequences of 128 tokens; ``--tiny``: one 1-layer, 32-wide model, 2 x 16 tokens, K = 2, for the
dry run of ``run_gpu.sh``). Variants, each on its own copy of the same initial weights, fed the same
micro-batches, AdamW (lr 1e-3, betas (0.9, 0.95), weight decay 0.1), clipping at 1.0:

* ``gaengine``: ``GradientAccumulator`` + ``gaengine.optim.FusedAdamW`` (fp32 main_grad and masters);
* ``gaengine-fusion``: the same with ``gradient_accumulation_fusion=True`` (dW straight into fp32, docs/fusion.md);
* ``plain``: the plain bf16 recipe (bf16 ``.grad`` of ``(loss / K).backward()``, ``clip_grad_norm_``, fused
  AdamW on the bf16 parameters); the baseline of the ratio;
* ``native-fp32``: torch's own ``grad_dtype=torch.float32`` accumulation with fp32 masters, where this torch has
  it (:func:`gaengine.compat.has_grad_dtype`; left out with a note otherwise).

Per variant: tokens/s (tokens per update / the median update over interleaved rounds, one update of each per
round, on CUDA timed by events in synchronized regions), the median per-round speedup over ``plain``, the device
memory the variant holds after its first update and the peak above it during an update (CUDA; None on CPU), the
loss after the last update, and its model FLOP/s (6 x parameters x tokens/s) checked against the best bf16 matmul
measured in the same run (:mod:`gaengine.tools.bench.plausible`): an impossible figure is an invalid row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, time_rounds, tiny_e2e_config, write_json  # noqa: E402

import torch  # noqa: E402

from gaengine import GradientAccumulator, compat  # noqa: E402
from gaengine.optim import FusedAdamW  # noqa: E402
from gaengine.tools.bench import e2e, plausible  # noqa: E402

MODELS = {"86M": (12, 768, 12), "304M": (24, 1024, 16)}
"""Name -> (layers, width, heads)."""
VARIANTS = ("gaengine", "gaengine-fusion", "plain", "native-fp32")


def _config(device: str, model: str, tiny: bool) -> e2e.E2EConfig:
    if tiny:
        return tiny_e2e_config(device, dtype="bf16")
    layers, width, heads = MODELS[model]
    seq, mb = (1024, 8) if device == "cuda" else (128, 2)
    return e2e.E2EConfig(device=device, n_layers=layers, d_model=width, n_heads=heads, seq_len=seq,
                         micro_batch_size=mb, accumulation_steps=8, warmup_updates=2, timed_updates=10, dtype="bf16")


def _gaengine(cfg: e2e.E2EConfig, fusion: bool):
    model = e2e._e2e_model(cfg)
    opt = FusedAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=cfg.accumulation_steps, max_grad_norm=1.0,
                              gradient_accumulation_fusion=fusion)

    def accumulate(window):
        total = torch.zeros((), device=cfg.device)
        for x, y in window:
            loss = model(x, y)
            acc.backward(loss)
            total += loss.detach()
        return total

    return model, accumulate, acc.step


def _build(variant: str, cfg: e2e.E2EConfig):
    if variant in ("gaengine", "gaengine-fusion"):
        return _gaengine(cfg, variant == "gaengine-fusion")
    b = e2e._build_variant(variant, cfg)
    return b.model, b.accumulate, b.update


def bench_model(cfg: e2e.E2EConfig, variants: list[str], matmul: plausible.Bound) -> list[dict]:
    """One row per variant of ``cfg``'s model (see the module docstring)."""
    cuda = cfg.device == "cuda"
    windows = e2e._e2e_windows(cfg, cfg.warmup_updates + cfg.timed_updates)
    built, resident = {}, {}
    for v in variants:
        before = torch.cuda.memory_allocated() if cuda else None
        built[v] = _build(v, cfg)
        resident[v] = None if not cuda else torch.cuda.memory_allocated() - before
    losses = {v: [] for v in variants}
    peaks = {v: [] for v in variants}

    def update(v):
        model, accumulate, step = built[v]
        window = windows[len(losses[v])]

        def run():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
            losses[v].append(accumulate(window) / cfg.accumulation_steps)
            step()
            if cuda:
                peaks[v].append(torch.cuda.max_memory_allocated() - start)
        return run

    ms = time_rounds({v: update(v) for v in variants}, device=torch.device(cfg.device), warmup=cfg.warmup_updates,
                     repeats=cfg.timed_updates, shuffle=False).ms
    n_params = sum(p.numel() for p in built[variants[0]][0].parameters())
    rows = []
    for v in variants:
        median_ms = statistics.median(ms[v])
        tokens_per_s = cfg.tokens_per_update / (median_ms * 1e-3)
        rows.append({"model": f"{cfg.n_layers}x{cfg.d_model}", "variant": v, "device": cfg.device,
                     "params": n_params, "ms": median_ms, "tokens_per_s": tokens_per_s,
                     "speedup": (statistics.median(p / x for p, x in zip(ms["plain"], ms[v]))
                                 if "plain" in ms else None),
                     "tflop_s": 6 * n_params * tokens_per_s / 1e12,
                     "resident_mib": None if resident[v] is None else resident[v] / 2**20,
                     "peak_above_mib": max(peaks[v]) / 2**20 if peaks[v] else None,
                     "final_loss": float(losses[v][-1])})
    plausible.mark(rows, lambda r: plausible.check_flops(r["tflop_s"], matmul))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="one tiny model, one timed update (dry runs)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--updates", type=int, default=None, help="timed updates per variant (default 10)")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    variants = [v for v in VARIANTS if v != "native-fp32" or compat.has_grad_dtype()]
    if len(variants) < len(VARIANTS):
        print(f"native-fp32 left out: torch {torch.__version__} has no Tensor.grad_dtype")
    matmul = plausible.matmul_peak(args.device, torch.bfloat16, n=256 if args.tiny else None)
    rows = []
    for model in (args.models[:1] if args.tiny else args.models):
        cfg = _config(args.device, model, args.tiny)
        if args.updates:
            cfg = replace(cfg, timed_updates=args.updates)
        rows += bench_model(cfg, variants, matmul)
    print_table(rows, [("model", "model", "s"), ("variant", "variant", "s"), ("tokens_per_s", "tokens/s", ",.0f"),
                       ("speedup", "vs plain", ".2f"), ("tflop_s", "TFLOP/s", ".3f"),
                       ("resident_mib", "resident MiB", ",.0f"), ("peak_above_mib", "peak above MiB", ",.0f"),
                       ("final_loss", "last loss", ".4f")],
                f"e2e defaults on {args.device}: bf16 GPT, three ways (gaengine with and without fusion); matmul "
                f"bound {matmul.value:.2f} TFLOP/s ({matmul.op})")
    for line in plausible.invalid_note(rows):
        print(line)
    if args.json:
        write_json(args.json, "e2e-defaults", {"device": args.device, "tiny": args.tiny, "variants": variants,
                                               "matmul_tflop_s": matmul.value}, rows, [args.device])
    return 0


if __name__ == "__main__":
    sys.exit(main())
