"""The bucket accumulate: sources accumulated into slices of one flat fp32 buffer in one launch (per source dtype,
or per kernel capacity), on every backend (``OpBackend.accumulate_bucket_``, ``conftest.py``).

Oracles: per-tensor torch (``dst[slice].add_(src)`` / ``copy_``: bitwise, unscaled), the fp64 oracle rounded once
(the same bits), and within 1 fp32 ulp of it when scaled (backends whose bucket op takes a scale: torch, triton).
Buffers are NaN-poisoned where the kernel must not read (overwritten slices, padding between parameters), slices
start at multiples of 64 elements (``gaengine/buffer.py``'s ``ALIGN_NUMEL``) or one past (unaligned), sizes are
odd (1, 127, 4097, a block plus one, several 4096-element chunks), and a bucket boundary falls inside a parameter.
The free-norm partials the op writes are tested in ``test_l2norm.py``; the source partials (the per-micro-batch
gradient norms) after those; last, the CPU kernel through ``torch.ops.gaengine`` where its own partials (fp64 rows,
sources past one 65536-element norm chunk) and contract messages are checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.ops.conftest import DTYPE_PARAMS, DTYPES, grad_like
from tests.reference import accumulate_fp64, sum_sq_fp64
from tests.tolerances import assert_bitwise_equal, assert_within_ulp, sum_sq_rtol

NAN = float("nan")
NUMELS = [1, 127, 4097, 128, 129, 64, 3 * 128 + 5, 3 * 4096 + 5]
SCALE = float(torch.tensor(0.3, dtype=torch.float32))  # exact in fp32, not a power of two: products round
LAYOUTS = {"fp32": ["fp32"], "bf16": ["bf16"], "fp16": ["fp16"], "mixed": ["bf16", "fp32", "fp16"]}


def bucket(backend, numels, dtypes, overwrite, unaligned=False):
    """(dst, srcs, offsets): a NaN-poisoned buffer whose slices to add into hold data (padding and slices to
    overwrite stay NaN: a read of them shows up), and the sources (dtypes cycled)."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total + int(unaligned))
        total += (n + 1 + 63) // 64 * 64
    dst = torch.full((max(total, 1),), NAN, device=backend.device)
    for o, n, w in zip(offsets, numels, overwrite):
        if not w:
            dst[o:o + n] = torch.randn(n, device=backend.device) * 10
    srcs = []
    for i, n in enumerate(numels):
        src = grad_like(n + 1, DTYPES[dtypes[i % len(dtypes)]], backend.device)
        srcs.append(src[1:] if unaligned else src[:n])  # unaligned: one element past a 16-byte boundary
    return dst, srcs, offsets


def expected_bucket(dst, srcs, offsets, overwrite):
    """torch's result (one op per slice) and the fp64 oracle rounded once to fp32."""
    expected, oracle = dst.clone(), dst.clone()
    for src, o, w in zip(srcs, offsets, overwrite):
        before = dst[o:o + src.numel()]
        expected[o:o + src.numel()] = src.float() if w else before.clone().add_(src)
        oracle[o:o + src.numel()] = accumulate_fp64(before, src, 1.0, w).to(torch.float32)
    return expected, oracle


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("mode", ["add", "overwrite", "mixed-flags"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unscaled_bitwise_equal_to_torch_and_fp64(backend, layout, mode, unaligned):
    flags = {"add": [False] * len(NUMELS), "overwrite": [True] * len(NUMELS),
             "mixed-flags": [i % 2 == 0 for i in range(len(NUMELS))]}[mode]
    dst, srcs, offsets = bucket(backend, NUMELS, LAYOUTS[layout], flags, unaligned)
    expected, oracle = expected_bucket(dst, srcs, offsets, flags)
    assert backend.accumulate_bucket_(dst, srcs, offsets, flags) is dst
    assert_bitwise_equal(dst, expected, "bucket vs torch (padding untouched)")
    assert_bitwise_equal(dst, oracle, "bucket vs fp64 rounded once")
    flipped = [not w for w in flags]  # the next micro-batch: add into the slices just overwritten
    expected, _ = expected_bucket(dst, srcs, offsets, flipped)
    backend.accumulate_bucket_(dst, srcs, offsets, flipped)
    assert_bitwise_equal(dst, expected, "second micro-batch")


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_scaled_within_one_ulp(backend, dtype, scale_kind, overwrite):
    flags = [overwrite] * len(NUMELS)
    dst, srcs, offsets = bucket(backend, NUMELS, [{v: k for k, v in DTYPES.items()}[dtype]], flags)
    exact, product = dst.to(torch.float64), torch.full_like(dst, NAN, dtype=torch.float64)
    for src, o in zip(srcs, offsets):
        sl = slice(o, o + src.numel())
        exact[sl] = accumulate_fp64(dst[sl], src, SCALE, overwrite=overwrite)
        product[sl] = src.to(torch.float64) * SCALE
    s = torch.tensor(SCALE, device=backend.device) if scale_kind == "tensor" else SCALE
    backend.accumulate_bucket_(dst, srcs, offsets, flags, scale=s)
    written = ~torch.isnan(product)
    assert_within_ulp(dst[written], exact[written], product[written], what=f"bucket * {SCALE} ({scale_kind})")
    assert bool(dst[~written].isnan().all()), "the kernel wrote into the padding between parameters"


def test_bucket_boundary_inside_a_parameter(backend):
    # Source 2 is split between two buckets: its second half is a view starting at an odd element, so neither the
    # source (not 16-byte aligned) nor the dst offset (odd) allows vector accesses in that launch.
    flags = [False] * len(NUMELS)
    dst, srcs, offsets = bucket(backend, NUMELS, ["bf16"], flags)
    expected, _ = expected_bucket(dst, srcs, offsets, flags)
    cut = 1001
    assert srcs[2][cut:].data_ptr() % 16 != 0
    backend.accumulate_bucket_(dst, srcs[:2] + [srcs[2][:cut]], offsets[:2] + [offsets[2]], [False] * 3)
    backend.accumulate_bucket_(dst, [srcs[2][cut:]] + srcs[3:], [offsets[2] + cut] + offsets[3:],
                               [False] * (len(NUMELS) - 2))
    assert_bitwise_equal(dst, expected, "two buckets sharing a parameter")


@pytest.mark.parametrize("n_sources", [1, 40, 600], ids=lambda k: f"{k}-sources")
def test_many_sources_and_empty_ones(backend, n_sources):
    """600 sources: past the cuda kernel's 512 entries per launch; empty sources among them take no entry."""
    numels = [0] + [(NUMELS[i % 7] if n_sources <= 40 else 1 + i % 3) for i in range(n_sources)] + [0]
    flags = [i % 2 == 0 for i in range(len(numels))]
    dst, srcs, offsets = bucket(backend, numels, ["fp32", "bf16", "fp16"], flags)
    expected, oracle = expected_bucket(dst, srcs, offsets, flags)
    partials = backend.new_partials(backend.num_partials(numels))
    backend.accumulate_bucket_(dst, srcs, offsets, flags, partials=partials)
    assert_bitwise_equal(dst, expected, f"{n_sources} sources")
    assert_bitwise_equal(dst, oracle, f"{n_sources} sources vs fp64")


def test_empty_bucket_and_empty_sources(backend):
    dst = torch.zeros(64, device=backend.device)
    assert backend.accumulate_bucket_(dst, [], [], []) is dst
    src = grad_like(5, torch.float32, backend.device)
    empty = torch.empty(0, dtype=torch.bfloat16, device=backend.device)
    backend.accumulate_bucket_(dst, [empty, src, empty], [0, 8, 13], [False, False, True])
    assert_bitwise_equal(dst[8:13], src, "around empty sources")
    assert int(dst.count_nonzero()) == int(src.count_nonzero())


def test_deterministic_with_partials(backend):
    flags = [False] * len(NUMELS)
    start, srcs, offsets = bucket(backend, NUMELS, ["bf16"], flags)
    results = []
    for _ in range(3):
        dst = start.clone()
        partials = backend.new_partials(backend.num_partials(NUMELS))
        backend.accumulate_bucket_(dst, srcs, offsets, flags, partials=partials)
        results.append((dst, partials, torch.stack(backend.ops.finish_norm_partials(partials))))
    for dst, partials, total in results[1:]:
        assert_bitwise_equal(dst, results[0][0], "dst, second run")
        assert_bitwise_equal(partials, results[0][1], "partials, second run")
        assert_bitwise_equal(total, results[0][2], "finished norm, second run")


# --------------------------------------------------------------------------------------------- source_partials
# The per-micro-batch gradient norms of the noise scale (issue 17): ``source_partials`` (the format of ``partials``,
# ``backend.ops.new_bucket_partials``) receives, in the same launch, the sums of squares and non-finite flags of
# the sources' own values. Oracle: the fp64 sum of float(src)^2, within ``sum_sq_rtol(n)``; the values written and
# their ``partials`` are bit for bit those of the same call without ``source_partials``.


def _source_case(backend, layout, numels=NUMELS):
    flags = [i % 2 == 0 for i in range(len(numels))]  # writes and adds: the sources' norms ignore what dst held
    dst, srcs, offsets = bucket(backend, numels, LAYOUTS[layout], flags)
    dst = torch.nan_to_num(dst, nan=3.0)  # the free norm of the values written must be finite here
    return dst, srcs, offsets, flags


def _nan_table(ops, srcs, device):
    return ops.new_bucket_partials([s.numel() for s in srcs], device).fill_(NAN)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_source_partials_are_the_sources_norm(backend, layout):
    ops = backend.ops
    dst, srcs, offsets, flags = _source_case(backend, layout)
    plain_dst, plain_partials = dst.clone(), _nan_table(ops, srcs, dst.device)
    ops.accumulate_bucket_(plain_dst, srcs, offsets, flags, plain_partials)
    partials, sources = _nan_table(ops, srcs, dst.device), _nan_table(ops, srcs, dst.device)
    assert ops.accumulate_bucket_(dst, srcs, offsets, flags, partials, source_partials=sources) is dst
    assert_bitwise_equal(dst, plain_dst, "dst with source_partials vs without")
    assert_bitwise_equal(partials, plain_partials, "partials with source_partials vs without")
    assert not bool(sources.isnan().any()), "a source partial was not written"
    sum_sq, found_inf = ops.finish_norm_partials(sources)
    exact = sum(sum_sq_fp64(s) for s in srcs)
    n = sum(s.numel() for s in srcs)
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(n) * exact, (sum_sq.item(), exact)
    assert found_inf.item() == 0.0
    if backend.partials_layout == "rows":  # one row per source: each is that source's own norm
        for j, src in enumerate(srcs):
            assert abs(sources[j, 0].item() - sum_sq_fp64(src)) <= sum_sq_rtol(src.numel()) * sum_sq_fp64(src)


def test_source_partials_alone_and_in_a_whole_buffer_table(backend):
    """Without ``partials``; two buckets writing column/row slices of one table finished once (the hooks' use)."""
    ops = backend.ops
    dst, srcs, offsets, flags = _source_case(backend, "mixed")
    dim = ops.partials_dim
    first = ops.new_bucket_partials([s.numel() for s in srcs[:3]], "meta").shape[dim]
    table = _nan_table(ops, srcs, dst.device)
    ops.accumulate_bucket_(dst, srcs[:3], offsets[:3], flags[:3], source_partials=table.narrow(dim, 0, first))
    ops.accumulate_bucket_(dst, srcs[3:], offsets[3:], flags[3:],
                           source_partials=table.narrow(dim, first, table.shape[dim] - first))
    sum_sq, _ = ops.finish_norm_partials(table)
    exact = sum(sum_sq_fp64(s) for s in srcs)
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(sum(s.numel() for s in srcs)) * exact


def test_finish_a_stack_of_source_tables_in_one_call(backend):
    """k micro-batches' tables stacked: ``finish_norm_partials`` gives (k,) rows, each the bits of its own finish."""
    ops = backend.ops
    tables, exact = [], []
    for k in range(3):
        dst, srcs, offsets, flags = _source_case(backend, "bf16")
        srcs = [s * (k + 1) for s in srcs]
        table = _nan_table(ops, srcs, dst.device)
        ops.accumulate_bucket_(dst, srcs, offsets, flags, source_partials=table)
        tables.append(table)
        exact.append(sum(sum_sq_fp64(s) for s in srcs))
    sums, flags_found = ops.finish_norm_partials(torch.stack(tables))
    assert sums.shape == (3,) and sums.dtype == torch.float32 and flags_found.shape == (3,)
    for k, table in enumerate(tables):
        assert_bitwise_equal(sums[k], ops.finish_norm_partials(table)[0], f"stacked row {k} vs its own finish")
        assert abs(sums[k].item() - exact[k]) <= sum_sq_rtol(sum(NUMELS)) * exact[k]
    assert not bool(flags_found.any())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the Triton interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("where", ["src", "dst"])
def test_source_partials_flag_the_sources_non_finite_values_only(backend, where):
    ops = backend.ops
    dst, srcs, offsets, flags = _source_case(backend, "fp32")
    if where == "src":
        srcs[2][-1] = float("inf")
    else:
        dst[offsets[1] + 3] = float("nan")  # in main_grad, added to: the values written see it, the sources do not
    partials, sources = _nan_table(ops, srcs, dst.device), _nan_table(ops, srcs, dst.device)
    ops.accumulate_bucket_(dst, srcs, offsets, flags, partials, source_partials=sources)
    assert ops.finish_norm_partials(partials)[1].item() == 1.0
    assert int((backend.non_finite_flags(partials) == 1.0).sum()) == 1, "exactly one partial saw the value"
    sum_sq, found_inf = ops.finish_norm_partials(sources)
    assert found_inf.item() == (1.0 if where == "src" else 0.0)
    assert int((backend.non_finite_flags(sources) == 1.0).sum()) == (where == "src"), "the source partials flagged"
    assert math.isfinite(sum_sq.item()) == (where == "dst")


def test_source_partials_refused_in_the_wrong_format(backend):
    ops = backend.ops
    dst, srcs, offsets, flags = _source_case(backend, "fp32")
    before = dst.clone()
    wrong = ops.new_bucket_partials([s.numel() for s in srcs[:2]], dst.device)
    with pytest.raises(ValueError, match="source_partials must be"):
        ops.accumulate_bucket_(dst, srcs, offsets, flags, source_partials=wrong)
    assert_bitwise_equal(dst, before, "dst after a refused call")


def test_refuses_overlapping_slices_before_writing(backend):
    dst = torch.zeros(256, device=backend.device)
    srcs = [torch.ones(100, device=backend.device), torch.ones(100, device=backend.device)]
    with pytest.raises(ValueError, match="overlap"):
        backend.ops.accumulate_bucket_(dst, srcs, [0, 64], [False, False])
    assert not bool(dst.any())


# --------------------------------------------------------------------------- the CPU kernel through torch.ops.gaengine
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cpu_kernel_rows_against_fp64_past_a_norm_chunk(dtype):
    """The CPU kernel (``torch.ops.gaengine.accumulate_bucket_``): sources past one norm chunk (65536), each row of
    its partials (fp64, of the values written) within the fp64 summation bound, and the same bits alone."""
    pytest.importorskip("gaengine._C")
    sizes = [1, 127, 4097, 65540, 70000]
    offsets, cursor = [], 0
    for n in sizes:
        offsets.append(cursor)
        cursor += (n + 63) // 64 * 64
    g = torch.Generator().manual_seed(1)
    dst = torch.randn(cursor, generator=g)
    srcs = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    overwrite = [False, True, False, True, False]
    out = dst.clone()
    for j, (o, n) in enumerate(zip(offsets, sizes)):
        if overwrite[j]:
            out[o:o + n] = float("nan")  # poisoned: an overwrite must not read it
    partials = torch.full((len(sizes), 2), float("nan"), dtype=torch.float64)
    source_partials = partials.clone()
    torch.ops.gaengine.accumulate_bucket_(out, srcs, offsets, overwrite, partials, source_partials)
    for j, (o, n) in enumerate(zip(offsets, sizes)):
        exact = accumulate_fp64(dst[o:o + n], srcs[j], overwrite=overwrite[j])
        assert_bitwise_equal(out[o:o + n], exact.to(torch.float32), f"source {j}")
        # The values written: two fp64 sums of n squares (ours, the oracle's), each within (n - 1) * 2^-53 of the
        # exact sum. The sources: the AVX2 kernel sums fp32 squares four per lane before fp64 (csrc/cpu_kernels.h),
        # within the fp32 budget of tests/tolerances.py.
        for what, table, values, rtol in (("partials", partials, out[o:o + n], 2 * n * 2.0**-53),
                                          ("source partials", source_partials, srcs[j], sum_sq_rtol(n))):
            want = sum_sq_fp64(values)
            assert abs(table[j, 0].item() - want) <= rtol * want, f"{what} of source {j}"
            assert table[j, 1].item() == 0.0, f"{what} flag of source {j}"
        # The bits of a source's partials do not depend on the rest of its bucket.
        row, source_row = torch.empty(1, 2, dtype=torch.float64), torch.empty(1, 2, dtype=torch.float64)
        torch.ops.gaengine.accumulate_bucket_(dst[o:o + n].clone(), [srcs[j]], [0], [overwrite[j]], row, source_row)
        assert_bitwise_equal(row[0], partials[j], f"partials of source {j} alone")
        assert_bitwise_equal(source_row[0], source_partials[j], f"source partials of source {j} alone")


def test_cpu_kernel_contracts():
    pytest.importorskip("gaengine._C")
    dst = torch.zeros(64)
    with pytest.raises(RuntimeError, match="same length"):
        torch.ops.gaengine.accumulate_bucket_(dst, [torch.ones(4)], [0, 8], [False], None)
    with pytest.raises(RuntimeError, match="outside dst"):
        torch.ops.gaengine.accumulate_bucket_(dst, [torch.ones(8)], [60], [False], None)
    assert bool((dst == 0).all())
