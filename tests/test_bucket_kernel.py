"""``kernels/bucket.py``: a bucket of gradients accumulated into one flat buffer with one launch, and its free norm.

Oracles: per-tensor torch (``dst[slice].add_(src)``: bitwise for unscaled), ``tests/reference.py`` fp64 for
scaled (within 1 fp32 ulp) and for the norm (within ``sum_sq_rtol``). The buffers come from
``gaengine.buffer.FlatLayout`` (parameter starts aligned to ``ALIGN_NUMEL``), are NaN-poisoned where the
kernel must not read, and carry odd sizes (1, 127, 4097, a block plus one) and a bucket boundary inside a
parameter. Runs under ``TRITON_INTERPRET=1`` on CPU tensors, on CUDA tensors when there is a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.tolerances import assert_bitwise_equal, assert_within_ulp, sum_sq_rtol, triton_device

DEVICE = triton_device()  # skips this module without triton, or without a GPU and the interpreter

from gaengine.buffer import FlatLayout  # noqa: E402
from tests.reference import accumulate_fp64, sum_sq_fp64  # noqa: E402

from gaengine.kernels import bucket  # noqa: E402

pytestmark = pytest.mark.interpreter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK = 128  # small blocks: many programs, full chunks and tails, at interpreter speed
NUMELS = [1, 127, 4097, BLOCK, BLOCK + 1, 64, 3 * BLOCK + 5]  # 7 parameters
SCALE = float(torch.tensor(0.3, dtype=torch.float32))  # exact in fp32, not a power of two: products round


def _grads(numels, dtype):
    """Gradient-like values of mixed magnitudes (so adds round), one tensor per numel, on DEVICE."""
    return [(torch.randn(n) * torch.logspace(-3, 2, n)).to(dtype).to(DEVICE) for n in numels]


def _buffer(numels, fill=None):
    """(offsets, dst): a flat fp32 buffer laid out by FlatLayout; random, or ``fill`` (NaN poisons it)."""
    layout = FlatLayout.build([torch.empty(n) for n in numels])
    if fill is None:
        dst = (torch.randn(layout.total_numel) * 10).to(DEVICE)
    else:
        dst = torch.full((layout.total_numel,), fill, dtype=torch.float32, device=DEVICE)
    return list(layout.offsets), dst


def _per_tensor_torch(dst, srcs, offsets, overwrite):
    """The oracle for unscaled accumulation: one torch op per tensor."""
    out = dst.clone()
    for src, o, w in zip(srcs, offsets, overwrite):
        view = out[o:o + src.numel()]
        view.copy_(src) if w else view.add_(src)
    return out


def _padding_mask(numels, offsets, total):
    covered = torch.zeros(total, dtype=torch.bool, device=DEVICE)
    for n, o in zip(numels, offsets):
        covered[o:o + n] = True
    return ~covered


# --- accumulation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("overwrite", [False, True, "mixed"], ids=["add", "overwrite", "mixed-flags"])
def test_unscaled_bitwise_equal_to_per_tensor_torch(dtype, overwrite):
    srcs = _grads(NUMELS, dtype)
    offsets, dst = _buffer(NUMELS)
    flags = [i % 2 == 0 for i in range(len(srcs))] if overwrite == "mixed" else [overwrite] * len(srcs)
    for i, w in enumerate(flags):  # overwritten slices are poisoned: reading one would leave a NaN
        if w:
            dst[offsets[i]:offsets[i] + NUMELS[i]] = float("nan")
    expected = _per_tensor_torch(dst, srcs, offsets, flags)
    out = bucket.accumulate_bucket_(dst, srcs, offsets, 1.0, flags if overwrite == "mixed" else overwrite,
                                    block_size=BLOCK)
    assert out is dst
    assert_bitwise_equal(dst, expected, f"bucket {overwrite}")


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_scaled_within_one_ulp(dtype, scale_kind, overwrite):
    srcs = _grads(NUMELS, dtype)
    offsets, dst = _buffer(NUMELS, float("nan") if overwrite else None)
    exact, product = dst.to(torch.float64), torch.zeros_like(dst, dtype=torch.float64)
    for src, o in zip(srcs, offsets):
        sl = slice(o, o + src.numel())
        exact[sl] = accumulate_fp64(dst[sl], src, SCALE, overwrite=overwrite)
        product[sl] = src.to(torch.float64) * SCALE
    s = torch.tensor(SCALE, device=DEVICE) if scale_kind == "tensor" else SCALE
    bucket.accumulate_bucket_(dst, srcs, offsets, s, overwrite, block_size=BLOCK)
    pad = _padding_mask(NUMELS, offsets, dst.numel())
    assert_within_ulp(dst[~pad], exact[~pad], product[~pad], what=f"bucket * {SCALE} ({scale_kind})")
    if overwrite:
        assert bool(dst[pad].isnan().all()), "the kernel wrote into the padding between parameters"


def test_mixed_dtypes_one_launch_per_dtype_and_default_block_size():
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32]
    numels = [4097, 1, 2 * bucket.BLOCK_SIZE + 3, 127, bucket.BLOCK_SIZE]
    srcs = [g for n, d in zip(numels, dtypes) for g in _grads([n], d)]
    offsets, dst = _buffer(numels)
    expected = _per_tensor_torch(dst, srcs, offsets, [False] * len(srcs))
    with _count_launches() as launches:
        bucket.accumulate_bucket_(dst, srcs, offsets)
    assert len(launches) == 3, f"expected one launch per source dtype (3), got {len(launches)}"
    assert launches == [bucket.num_blocks([numels[i] for i in idx]) for idx in ([0, 3], [1, 4], [2])]
    assert_bitwise_equal(dst, expected, "mixed-dtype bucket")


def test_bucket_boundary_inside_a_parameter_and_unaligned_views():
    # Parameter 2 is split between two buckets: its second half is a view starting at an odd element, so
    # neither the source (not 16-byte aligned) nor the dst offset (odd) allows vector accesses in that launch.
    srcs = _grads(NUMELS, torch.bfloat16)
    offsets, dst = _buffer(NUMELS)
    expected = _per_tensor_torch(dst, srcs, offsets, [False] * len(srcs))
    cut = 1001
    first = (srcs[:2] + [srcs[2][:cut]], offsets[:2] + [offsets[2]])
    second = ([srcs[2][cut:]] + srcs[3:], [offsets[2] + cut] + offsets[3:])
    assert srcs[2][cut:].data_ptr() % 16 != 0
    for bucket_srcs, bucket_offsets in (first, second):
        bucket.accumulate_bucket_(dst, bucket_srcs, bucket_offsets, block_size=BLOCK)
    assert_bitwise_equal(dst, expected, "two buckets sharing a parameter")


def test_empty_bucket_and_empty_tensors():
    dst = torch.zeros(64, device=DEVICE)
    assert bucket.accumulate_bucket_(dst, [], []) is dst
    src = _grads([5], torch.float32)[0]
    empty = torch.empty(0, dtype=torch.bfloat16, device=DEVICE)
    bucket.accumulate_bucket_(dst, [empty, src, empty], [0, 8, 8], block_size=BLOCK)
    assert_bitwise_equal(dst[8:13], src, "around empty tensors")
    assert int(dst.count_nonzero()) == int(src.count_nonzero())


# --- one launch ----------------------------------------------------------------------------------------------


class _count_launches:
    """Context manager: replaces the kernel with a wrapper that counts launches (programs per launch)."""

    def __enter__(self):
        self.kernel, launches = bucket._accumulate_bucket_kernel, []
        kernel = self.kernel

        class Counting:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append(grid[0])
                    return kernel[grid](*args, **kwargs)

                return launch

        bucket._accumulate_bucket_kernel = Counting()
        self.launches = launches
        return launches

    def __exit__(self, *exc):
        bucket._accumulate_bucket_kernel = self.kernel


@pytest.mark.parametrize("n_tensors", [1, 7, 40])
def test_one_launch_for_a_bucket_of_n_tensors(n_tensors):
    numels = [NUMELS[i % len(NUMELS)] for i in range(n_tensors)]
    srcs = _grads(numels, torch.bfloat16)
    offsets, dst = _buffer(numels)
    expected = _per_tensor_torch(dst, srcs, offsets, [False] * n_tensors)
    with _count_launches() as launches:
        bucket.accumulate_bucket_(dst, srcs, offsets, block_size=BLOCK)
    assert len(launches) == 1, f"{n_tensors} tensors took {len(launches)} launches"
    assert launches[0] == bucket.num_blocks(numels, BLOCK) == sum(math.ceil(n / BLOCK) for n in numels)
    assert_bitwise_equal(dst, expected, f"{n_tensors} tensors")


# --- free norm ------------------------------------------------------------------------------------------------


def _poisoned_partials(n_blocks):
    return torch.full((2, n_blocks), float("nan"), dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_partials_give_the_norm_of_the_resulting_buffer(dtype, scaled):
    srcs = _grads(NUMELS, dtype)
    offsets, dst = _buffer(NUMELS, 0.0)
    bucket.accumulate_bucket_(dst, srcs, offsets, 1.0, True, block_size=BLOCK)  # micro-batch 0
    srcs = _grads(NUMELS, dtype)
    partials = _poisoned_partials(bucket.num_blocks(NUMELS, BLOCK))
    bucket.accumulate_bucket_(dst, srcs, offsets, SCALE if scaled else 1.0, False, partials=partials, block_size=BLOCK)
    assert not bool(partials.isnan().any()), "a partial was not written"
    sum_sq, found_inf = bucket.l2norm_sq_from_partials(partials)
    for t in (sum_sq, found_inf):
        assert t.dim() == 0 and t.dtype == torch.float32 and t.device == dst.device
    exact = sum_sq_fp64(dst)  # the whole buffer: its padding is zero
    rtol = sum_sq_rtol(dst.numel())
    assert abs(sum_sq.item() - exact) <= rtol * exact, f"sum_sq {sum_sq.item()!r} vs fp64 {exact!r} (rtol {rtol:.2e})"
    assert found_inf.item() == 0.0


def test_partials_of_two_buckets_in_one_whole_buffer_table():
    # The engine's pattern: one (2, n_blocks_total) table, a column slice per bucket, one finalize at the end.
    numels_a, numels_b = NUMELS[:3], NUMELS[3:]
    srcs = _grads(NUMELS, torch.bfloat16)
    offsets, dst = _buffer(NUMELS, 0.0)
    n_a, n_b = bucket.num_blocks(numels_a, BLOCK), bucket.num_blocks(numels_b, BLOCK)
    partials = _poisoned_partials(n_a + n_b)
    bucket.accumulate_bucket_(dst, srcs[:3], offsets[:3], 1.0, True, partials=partials[:, :n_a], block_size=BLOCK)
    bucket.accumulate_bucket_(dst, srcs[3:], offsets[3:], 1.0, True, partials=partials[:, n_a:], block_size=BLOCK)
    sum_sq, found_inf = bucket.l2norm_sq_from_partials(partials)
    exact = sum_sq_fp64(dst)
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(dst.numel()) * exact
    assert found_inf.item() == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("where", ["src-full-chunk", "src-tail", "dst"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_partials_find_non_finite_values_written(bad, where):
    srcs = _grads(NUMELS, torch.float16)
    offsets, dst = _buffer(NUMELS, 0.0)
    if where == "src-full-chunk":
        srcs[2][5] = bad  # inside the first full chunk of the 4097-element parameter
    elif where == "src-tail":
        srcs[2][-1] = bad  # in its masked last chunk
    else:
        dst[offsets[6] + 2] = bad  # already in main_grad, carried by the add
    partials = _poisoned_partials(bucket.num_blocks(NUMELS, BLOCK))
    bucket.accumulate_bucket_(dst, srcs, offsets, partials=partials, block_size=BLOCK)
    sum_sq, found_inf = bucket.l2norm_sq_from_partials(partials)
    assert found_inf.item() == 1.0 and not math.isfinite(sum_sq.item())
    assert int((partials[1] == 1.0).sum()) == 1, "exactly one program saw the non-finite value"


def test_partials_and_finalize_are_deterministic():
    srcs = _grads(NUMELS, torch.bfloat16)
    offsets, start = _buffer(NUMELS)
    results = []
    for _ in range(3):
        dst = start.clone()
        partials = _poisoned_partials(bucket.num_blocks(NUMELS, BLOCK))
        bucket.accumulate_bucket_(dst, srcs, offsets, torch.tensor(SCALE, device=DEVICE), partials=partials,
                                  block_size=BLOCK)
        results.append((dst, partials, torch.stack(bucket.l2norm_sq_from_partials(partials))))
    for dst, partials, total in results[1:]:
        assert_bitwise_equal(dst, results[0][0], "dst, second run")
        assert_bitwise_equal(partials, results[0][1], "partials, second run")
        assert_bitwise_equal(total, results[0][2], "finalized norm, second run")


def test_finalize_of_no_partials_is_zero():
    sum_sq, found_inf = bucket.l2norm_sq_from_partials(torch.empty(2, 0, device=DEVICE))
    assert sum_sq.item() == 0.0 and found_inf.item() == 0.0


# --- contracts ------------------------------------------------------------------------------------------------


def _bad_calls():
    src = torch.zeros(8, device=DEVICE)
    return [
        pytest.param(dict(srcs=[src, src], dst_offsets=[0]), "dst_offsets has 1 entries", id="offsets-count"),
        pytest.param(dict(srcs=[src], dst_offsets=[60]), "outside dst", id="past-the-end"),
        pytest.param(dict(srcs=[src], dst_offsets=[-1]), "outside dst", id="negative-offset"),
        pytest.param(dict(srcs=[src, src], dst_offsets=[0, 4]), "overlap", id="overlap"),
        pytest.param(dict(srcs=[src.double()], dst_offsets=[0]), r"srcs\[0\] must be", id="src-fp64"),
        pytest.param(dict(srcs=[torch.zeros(4, 2, device=DEVICE).t()], dst_offsets=[0]), "contiguous",
                     id="src-strided"),
        pytest.param(dict(srcs=[src], dst_offsets=[0], overwrite=[True, False]), "overwrite has 2 flags", id="flags"),
        pytest.param(dict(srcs=[src], dst_offsets=[0], scale=torch.ones(1, device=DEVICE)), "scale must be a 0-d",
                     id="scale-1d"),
        pytest.param(dict(srcs=[src], dst_offsets=[0], partials=torch.zeros(2, 2, device=DEVICE)),
                     r"partials must be a \(2, 1\)", id="partials-shape"),
    ]


@pytest.mark.parametrize("kwargs, match", _bad_calls())
def test_rejects_bad_arguments_before_writing(kwargs, match):
    dst = torch.zeros(64, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        bucket.accumulate_bucket_(dst, **kwargs)
    assert int(dst.count_nonzero()) == 0


def test_rejects_bad_dst_and_partials_table():
    with pytest.raises(ValueError, match="dst must be float32"):
        bucket.accumulate_bucket_(torch.zeros(8, dtype=torch.bfloat16, device=DEVICE), [], [])
    with pytest.raises(ValueError, match="contiguous"):
        bucket.l2norm_sq_from_partials(torch.zeros(4, 2, device=DEVICE).t())
