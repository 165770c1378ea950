"""``gaengine bench``: the kernel, host-overhead and end-to-end benchmarks on one device, a table per benchmark.

    gaengine bench [--device cpu|cuda] [--only accumulate l2norm scale host fusion e2e memory] [--quick]
                   [--threads N] [--host-params P ...] [--json PATH] [--plot PNG]

Each benchmark prints its own tables with the columns it has: a kernel ``variant | ms | GB/s | % of copy | vs
torch``; the host benchmark ``dtype | P | variant | ms/window | vs (b) | launches/mb | buckets`` and, per parameter
per micro-batch, ``us/param/mb | added us/param/mb``; the end-to-end one ``variant | ms/update | tokens/s | vs
plain`` and ``variant | peak, peak delta and peak live MiB | state MiB | state B/param``; the memory one the bytes
per parameter by what holds them, then the formula and the bytes on the wire. Every line fits in
:data:`gaengine.tools.WIDTH` (100) columns: notes wrap, a long variant wraps onto a continuation row, a table too
wide for its columns is split (``print_table``). Every ratio is the median of per-round ratios, printed with the
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

Copy: ``dst.copy_(src)`` of fp32 buffers of the same size on the same device in the same rounds, 8 B/element
(read 4 + write 4): the streaming bandwidth a plain copy reaches now (``peak`` in the JSON). ``% of copy`` = GB/s /
the copy's GB/s (``pct_of_copy``); it is a reference, not a ceiling: above 100 % the kernel's buffers stayed in
cache (a small ``--numel``) or, on a CPU, the copy paid a read of every line it wrote (write-allocate) that an
in-place kernel does not, and a note under the tables says so.
All kernel rows and the copy are timed in interleaved rounds (one call of each per round, in a shuffled
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
:data:`HOST_TARGET_US` (1.0 us), which holds for the benchmark's torch threads on CPUs no other process takes:
on a loaded machine (load average over the CPUs) the line says so instead of judging it
(:func:`gaengine.tools.bench.host.target_verdict`). ``launches/mb`` over micro-batch 1's backward (the steady state): on CUDA
kernel launches from ``torch.profiler`` (``cudaLaunchKernel``/``cuLaunchKernel`` calls, or the kernels seen
when more), the model's own fill and mul included, for both variants; on CPU the plain recipe's data-touching
ATen ops inside AccumulateGrad (one ``aten::add_`` per parameter) and gaengine's own count,
``acc.hooks.launches``. ``buckets``: gaengine's buckets;
a bucketed accumulate needs buckets + the model's own launches per micro-batch.

Fusion (``fusion``, :mod:`gaengine.tools.bench.fusion`): one bf16 ``Linear(d, d)``'s backward per micro-batch
(d = 512, 512 tokens on CPU; 4096, 8192 tokens on CUDA; 128, 64 with ``--quick``) in three variants timed in
interleaved rounds, the forward untimed: the plain recipe (``loss.backward()``, ``.grad += dW`` in bf16, the
baseline), gaengine's hooks (a bf16 ``dW`` added into the fp32 ``main_grad``) and ``gradient_accumulation_fusion``
(``dW`` written or added straight into fp32, docs/fusion.md); beside each its accumulated gradient's relative
error against the fp64 sum after all its backward passes. A variant that cannot run here (the fused one without
``gaengine._C``, or on CUDA without triton) is left out with a note.

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

Memory (``memory``): bytes per parameter per rank held by the parameters, the gradient (``.grad``, ``main_grad``
or stage 2's fp32 shard), stage 2's staging ring (S bucket-sized fp32 buffers), the master weights and the optimizer state, for the plain
recipe, torch DDP and gaengine's ZeRO stages 0/1/2 on d = 1, 2, 4 ``gloo`` processes on the CPU (1, 2 with
``--quick``), measured from the storages each recipe allocated (deduplicated) and printed next to the formula
(stage 1: 2 + 4 + 12/d, stage 2: 2 + 16/d + S x bucket staging), with the bytes each rank sends per window (the
collectives' tensor sizes under a ring algorithm). See :mod:`~gaengine.tools.bench.memory`.

One module per family (:mod:`~gaengine.tools.bench.kernels`, :mod:`~gaengine.tools.bench.host`,
:mod:`~gaengine.tools.bench.e2e`, :mod:`~gaengine.tools.bench.memory`), each with its benchmark, its columns and its tables; the command in
:mod:`~gaengine.tools.bench.command`; the shared part in :mod:`~gaengine.tools.bench.common`: the timing loop,
ratios and their spread, ``gb_per_s``, ``environment``, ``print_table``, ``write_json``, the ones
``benchmarks/*.py`` import, through ``benchmarks/common.py``.
"""

from __future__ import annotations

from gaengine.tools.bench.command import BENCHMARKS, add_parser, run
from gaengine.tools.bench.common import (MIN_ROUNDS, device_name, environment, gb_per_s, git_sha, print_table,
                                         ratio_stats, ratio_text, time_interleaved, time_ms, write_json)
from gaengine.tools.bench.e2e import E2E_VARIANTS, E2EConfig, bench_e2e, e2e_config
from gaengine.tools.bench.host import (HOST_ACCUMULATION_STEPS, HOST_PARAM_NUMEL, HOST_TARGET_US, HOST_VARIANTS,
                                       bench_host)
from gaengine.tools.bench.kernels import bench_kernels
from gaengine.tools.bench.memory import MemoryConfig, bench_memory

__all__ = [
    "BENCHMARKS",
    "E2EConfig",
    "MIN_ROUNDS",
    "E2E_VARIANTS",
    "HOST_ACCUMULATION_STEPS",
    "HOST_PARAM_NUMEL",
    "HOST_TARGET_US",
    "HOST_VARIANTS",
    "MemoryConfig",
    "add_parser",
    "bench_kernels",
    "bench_host",
    "bench_e2e",
    "bench_memory",
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
