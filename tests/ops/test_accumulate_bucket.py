"""The bucket accumulate: sources accumulated into slices of one flat fp32 buffer in one launch (per source dtype,
or per kernel capacity), on every backend (``OpBackend.accumulate_bucket_``, ``conftest.py``).

Oracles: per-tensor torch (``dst[slice].add_(src)`` / ``copy_``: bitwise, unscaled), the fp64 oracle rounded once
(the same bits), and within 1 fp32 ulp of it when scaled (backends whose bucket op takes a scale: torch, triton).
Buffers are NaN-poisoned where the kernel must not read (overwritten slices, padding between parameters), slices
start at multiples of 64 elements (``gaengine/buffer.py``'s ``ALIGN_NUMEL``) or one past (unaligned), sizes are
odd (1, 127, 4097, a block plus one, several 4096-element chunks), and a bucket boundary falls inside a parameter.
The free-norm partials the op writes are tested in ``test_l2norm.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DTYPE_PARAMS, DTYPES, grad_like
from tests.reference import accumulate_fp64
from tests.tolerances import assert_bitwise_equal, assert_within_ulp

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
