"""Kernel benchmarks (``accumulate``, ``l2norm``, ``scale``): each gaengine backend that loads on the device
against the eager torch recipe it replaces, and the peak copy, timed in interleaved rounds; a table per kernel.

The accumulate family also times what ``measure_noise_scale=True`` costs the accumulate pass: one
``accumulate_bucket_`` of the same gradient as ``NUM_VIEWS`` parameters, without and with the source norms
(``source_partials``, the per-micro-batch squared norms of ``gaengine.noise``) written in the same pass; the
table's note gives the on / off time ratio (issue 17: within 10 %).
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any, Callable, Sequence

import torch

from gaengine.backends import get_backend
from gaengine.tools.bench import plausible
from gaengine.tools.bench.common import (RATIO_NOTE, display_rows, gb_per_s, print_note, print_table, ratio_stats,
                                         time_interleaved)

ACCUMULATE_BYTES_PER_ELEMENT = 10  # read bf16 grad 2 + read fp32 main_grad 4 + write fp32 main_grad 4
L2NORM_BYTES_PER_ELEMENT = 4  # read fp32 4
SCALE_BYTES_PER_ELEMENT = 8  # read fp32 4 + write fp32 4
PEAK_BYTES_PER_ELEMENT = 8  # fp32 dst.copy_(src): read 4 + write 4 (the "% of copy" reference)
NUM_VIEWS = 16  # per-parameter views of the flat buffer for the foreach baselines (clip_grad_norm_'s kernels)


def _backends(device: torch.device) -> dict[str, Any]:
    """gaengine backends that load and run on ``device``: torch; cpu on CPU; triton and cuda on CUDA.

    Triton on CPU tensors (the interpreter) is a correctness tool, not a benchmark: it is left out.
    """
    names = ("torch", "cpu") if device.type == "cpu" else ("torch", "triton", "cuda")
    found = {}
    for name in names:
        try:
            found[name] = get_backend(name, device)
        except RuntimeError as exc:
            print_note(f"skipping backend {name!r} on {device}: {str(exc).splitlines()[0]}")
    return found


def _split_views(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` contiguous views of flat ``x`` (the last one odd-sized), like a model's per-parameter grads."""
    base = x.numel() // n
    sizes = [base] * (n - 1) + [x.numel() - base * (n - 1)]
    return list(x.split(sizes))


_Variants = list[tuple[str, Callable[[], object]]]
"""``[(label, fn)]`` of one kernel benchmark, each ``fn()`` one call of the timed op."""


def _accumulate_variants(backends: dict[str, Any], main_grad: torch.Tensor, grad: torch.Tensor) -> _Variants:
    """The eager ``main_grad.add_(grad.float())`` and each backend's ``accumulate_``, checked bitwise first."""
    variants = [("torch: main_grad.add_(grad.float())", lambda: main_grad.add_(grad.float()))]
    for name, b in backends.items():
        expected = main_grad.clone().add_(grad.float())
        actual = b.accumulate_(main_grad.clone(), grad)
        if not torch.equal(actual.view(torch.int32), expected.view(torch.int32)):
            raise AssertionError(f"backend {name!r}: accumulate_ is not bitwise equal to the eager recipe")
        variants.append((f"gaengine {name}: accumulate_", lambda b=b: b.accumulate_(main_grad, grad)))
    return variants


def _bucket_variants(backends: dict[str, Any], main_grad: torch.Tensor, grad: torch.Tensor,
                     device: torch.device) -> _Variants:
    """Each backend's ``accumulate_bucket_`` of ``grad`` as ``NUM_VIEWS`` parameters, without and with the source
    norms (``measure_noise_scale``); the norms are checked against fp64 first."""
    variants: _Variants = []
    srcs = _split_views(grad, NUM_VIEWS)
    offsets = [0, *itertools.accumulate(s.numel() for s in srcs)][:-1]
    reference = float(grad.double().square().sum())
    for name, b in backends.items():
        table = b.new_bucket_partials([s.numel() for s in srcs], device)
        b.accumulate_bucket_(main_grad.clone(), srcs, offsets, False, None, table)
        sum_sq = float(b.finish_norm_partials(table)[0])
        if abs(sum_sq - reference) > 1e-2 * reference:  # a sanity bound, as for l2norm below
            raise AssertionError(f"backend {name!r}: source norms {sum_sq} != fp64 {reference}")
        variants.append((f"gaengine {name}: accumulate_bucket_ ({NUM_VIEWS} grads), noise scale off",
                         lambda b=b: b.accumulate_bucket_(main_grad, srcs, offsets, False)))
        variants.append((f"gaengine {name}: accumulate_bucket_ ({NUM_VIEWS} grads), noise scale on",
                         lambda b=b, table=table: b.accumulate_bucket_(main_grad, srcs, offsets, False, None,
                                                                        table)))
    return variants


def _l2norm_variants(backends: dict[str, Any], main_grad: torch.Tensor) -> _Variants:
    """torch's norm, ``clip_grad_norm_``'s foreach norm and each backend's ``l2norm_sq``, checked against fp64."""
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
    return variants


def _scale_variants(backends: dict[str, Any], x: torch.Tensor, coef: torch.Tensor) -> _Variants:
    """torch's ``mul_``, ``clip_grad_norm_``'s foreach multiply and each backend's ``scale_``."""
    x_views = _split_views(x, NUM_VIEWS)
    variants = [("torch: x.mul_(coef)", lambda: x.mul_(coef)),
                (f"torch: _foreach_mul_({NUM_VIEWS} views, coef) (clip_grad_norm_)",
                 lambda: torch._foreach_mul_(x_views, coef))]
    variants += [(f"gaengine {name}: scale_", lambda b=b: b.scale_(x, coef)) for name, b in backends.items()]
    return variants


def _kernel_rows(plan: dict[str, tuple[int, _Variants]], samples: dict, peak: dict, device: torch.device) -> list[dict]:
    """One row per variant from its timed ``samples`` (ms per round): time, GB/s, % of the copy, ratio to the
    benchmark's first variant, and for a noise-scale-on variant its per-round time over the off one's."""
    numel = peak["numel"]
    rows = []
    for bench, (nbytes, variants) in plan.items():
        baseline = samples[(bench, variants[0][0])]
        for i, (label, _) in enumerate(variants):
            t = samples[(bench, label)]
            ms = statistics.median(t)
            gbs = gb_per_s(numel, nbytes, ms)
            rows.append({"benchmark": bench, "variant": label, "device": str(device), "numel": numel,
                         "bytes_per_element": nbytes, "ms": ms, "min_ms": min(t), "max_ms": max(t), "gb_s": gbs,
                         "pct_of_copy": 100.0 * gbs / peak["gb_s"], **ratio_stats(baseline, t, baseline=i == 0)})
            if label.endswith("noise scale on"):  # per round, the time with the source norms over the time without
                off = samples[(bench, label.removesuffix("on") + "off")]
                on_off = [a / b for a, b in zip(t, off)]
                quartiles = statistics.quantiles(on_off, n=4, method="inclusive") if len(on_off) > 1 else on_off * 3
                rows[-1].update(noise_on_off=statistics.median(on_off), noise_on_off_p25=quartiles[0],
                                noise_on_off_p75=quartiles[2])
    return rows


def bench_kernels(device: torch.device, numel: int, which: Sequence[str], *, warmup: int = 3,
                  repeats: int = 15) -> tuple[list[dict], dict]:
    """Time the kernel benchmarks in ``which`` (of accumulate, l2norm, scale) and the copy, interleaved.

    Returns the rows (one per variant; the first row of each benchmark is its torch baseline; ``pct_of_copy``: GB/s
    as a percentage of the copy's) and the copy, ``{"op", "ms", "gb_s", "bytes_per_element", "numel"}`` (``peak``
    in the JSON: a streaming reference, not a ceiling, see :func:`print_tables`). Each gaengine backend is checked
    against the torch result before it is timed (accumulate bitwise, the norm within 1e-2 of fp64).
    """
    g = torch.Generator(device=device).manual_seed(0)
    main_grad = torch.randn(numel, generator=g, device=device)
    grad = torch.randn(numel, generator=g, device=device).to(torch.bfloat16)
    x = torch.randn(numel, generator=g, device=device)
    coef = torch.tensor(1.0 - 2.0**-10, device=device)  # < 1 so that repeated calls stay finite
    src, dst = torch.randn(numel, generator=g, device=device), torch.empty(numel, device=device)
    backends = _backends(device)

    # benchmark -> (bytes per element, [(variant, fn)]); the first variant is the torch baseline.
    plan: dict[str, tuple[int, _Variants]] = {}
    if "accumulate" in which:
        plan["accumulate bf16->fp32"] = (ACCUMULATE_BYTES_PER_ELEMENT, _accumulate_variants(backends, main_grad, grad)
                                         + _bucket_variants(backends, main_grad, grad, device))
    if "l2norm" in which:
        plan["l2norm_sq fp32"] = (L2NORM_BYTES_PER_ELEMENT, _l2norm_variants(backends, main_grad))
    if "scale" in which:
        plan["scale_ fp32"] = (SCALE_BYTES_PER_ELEMENT, _scale_variants(backends, x, coef))

    peak_name = "peak: fp32 dst.copy_(src)"
    fns = {peak_name: lambda: dst.copy_(src)}
    for bench, (_, variants) in plan.items():
        fns.update({(bench, label): fn for label, fn in variants})
    samples = time_interleaved(fns, device=device, warmup=warmup, repeats=repeats)

    peak_ms = statistics.median(samples[peak_name])
    bound = plausible.bandwidth_bound([("fp32 dst.copy_(src)", numel, PEAK_BYTES_PER_ELEMENT, samples[peak_name])],
                                      device)
    peak = {"op": "fp32 dst.copy_(src)", "ms": peak_ms, "numel": numel, "bytes_per_element": PEAK_BYTES_PER_ELEMENT,
            "gb_s": gb_per_s(numel, PEAK_BYTES_PER_ELEMENT, peak_ms), "bound_gb_s": bound.value}
    rows = _kernel_rows(plan, samples, peak, device)
    plausible.mark(rows, lambda r: plausible.check_bandwidth(r["gb_s"], bound,
                                                             working_set_bytes=numel * r["bytes_per_element"]))
    return rows, peak


KERNEL_COLUMNS = [("variant", "variant", "s"), ("ms", "ms", ".3f"), ("gb_s", "GB/s", ".1f"),
                  ("pct_of_copy", "% of copy", ".0f"), ("ratio_text", "vs torch [p25-p75]", "s")]
"""``(key, header, format)`` of each kernel benchmark's table (one table per benchmark); a long variant wraps."""


def print_tables(rows: Sequence[dict], peak: dict, repeats: int) -> None:
    """One table per kernel benchmark, its bytes model in the title, then what the columns mean.

    ``% of copy`` is a kernel's GB/s over the GB/s of an fp32 ``dst.copy_(src)`` of the same size timed in the same
    rounds: the streaming bandwidth of a plain copy here, not a ceiling. It passes 100 % where the kernel's bytes
    stay in cache (buffers that fit in it: small ``--numel``, ``--quick`` on a CPU), or where the copy moves more
    than its bytes model counts (on a CPU a store to a line not in cache reads it first, write-allocate: ~12 B per
    element counted as 8, which an in-place kernel, its lines already read, does not pay); the note says so.
    """
    for bench in dict.fromkeys(r["benchmark"] for r in rows):
        some = [r for r in rows if r["benchmark"] == bench]
        print_table(display_rows(some), KERNEL_COLUMNS,
                    f"{bench}: {some[0]['numel']:,} elements, {some[0]['bytes_per_element']} B/element",
                    wrap=("variant",))
        for r in some:
            if "noise_on_off" in r:
                print_note(f"measure_noise_scale, {r['variant'].split(':')[0]}: on / off = {r['noise_on_off']:.3f}x "
                           f"the time [{r['noise_on_off_p25']:.3f}-{r['noise_on_off_p75']:.3f}] (median per-round "
                           "ratio of the accumulate_bucket_ with the source norms to the one without)")
    for line in plausible.invalid_note(rows):
        print_note(line)
    above = [r for r in rows if r["valid"] and r["pct_of_copy"] > 100.0]
    print_note(f"kernels: ms = median of {repeats} interleaved rounds; GB/s by the benchmark's bytes model "
               f"(accumulate {ACCUMULATE_BYTES_PER_ELEMENT}, l2norm {L2NORM_BYTES_PER_ELEMENT}, scale "
               f"{SCALE_BYTES_PER_ELEMENT} B/element); % of copy = GB/s / the GB/s of {peak['op']} timed in the same "
               f"rounds, {peak['gb_s']:.1f} GB/s ({peak['bytes_per_element']} B/element, {peak['ms']:.3f} ms): a "
               "plain copy's streaming bandwidth here, not a ceiling; vs torch = median per-round ratio of the "
               f"table's first row (the torch baseline) to the variant's time, > 1: faster. {RATIO_NOTE}.")
    if above:
        print_note(f"% of copy above 100 ({len(above)} of {len(rows)} rows): not faster than memory. Either the "
                   f"kernel's buffers stayed in cache ({above[0]['numel']:,} elements: "
                   f"{above[0]['numel'] * 4 / 2**20:,.0f} MiB per fp32 buffer) or the copy moved more than its "
                   f"{peak['bytes_per_element']} B/element: on a CPU each store to a line not in cache reads it "
                   "first (write-allocate, ~12 B/element), which an in-place kernel, its lines already read, does "
                   "not pay.")
