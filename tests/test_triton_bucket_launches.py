"""``gaengine/kernels/bucket.py``: one launch per source dtype for a bucket of gradients, and its argument checks.

The values (bitwise, within 1 ulp, the free norm) on every backend are tested in ``tests/ops/test_accumulate_bucket.py``
and ``tests/ops/test_l2norm.py``; here, the Triton launch structure.

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

from tests.tolerances import assert_bitwise_equal, triton_device

DEVICE = triton_device()  # skips this module without triton, or without a GPU and the interpreter

from gaengine.buffer import FlatLayout  # noqa: E402

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


# --- accumulation -------------------------------------------------------------------------------------------


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


# --- one launch ----------------------------------------------------------------------------------------------


class _count_launches:
    """Context manager: replaces the kernel with a wrapper that counts launches (programs per launch); with
    ``run=False`` the launches are counted, not run (their values are tested elsewhere)."""

    def __init__(self, run: bool = True):
        self.run = run

    def __enter__(self):
        self.kernel, launches = bucket._accumulate_bucket_kernel, []
        kernel, run = self.kernel, self.run

        class Counting:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append(grid[0])
                    return kernel[grid](*args, **kwargs) if run else None

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


@pytest.mark.parametrize("n_dtypes", [1, 2], ids=["bf16", "bf16-fp16"])
def test_804_small_sources_one_launch_per_dtype(n_dtypes):
    """A bucket of many small parameters (804: past the cuda kernel's 512 entries per launch, which splits it in
    two there, ``tests/cuda_emu/run_kernels.cpp``): the Triton kernel has no entry cap, so the launches are one
    per source dtype, 2 for two dtypes, each of its sources' blocks. Counted, not run (804 programs take a minute
    under the interpreter); the values of a 600-source bucket on every backend, triton included:
    ``tests/ops/test_accumulate_bucket.py`` test_many_sources_and_empty_ones."""
    numels = [1 + i % 3 for i in range(804)]
    dtypes = [(torch.bfloat16, torch.float16)[i % n_dtypes] for i in range(804)]
    srcs = [torch.ones(n, dtype=d, device=DEVICE) for n, d in zip(numels, dtypes)]
    offsets, dst = _buffer(numels)
    with _count_launches(run=False) as launches:
        bucket.accumulate_bucket_(dst, srcs, offsets, block_size=BLOCK)
    assert len(launches) == n_dtypes, f"804 sources of {n_dtypes} dtype(s) took {len(launches)} launches"
    assert launches == [bucket.num_blocks(numels[k::n_dtypes], BLOCK) for k in range(n_dtypes)]
    assert sum(launches) == 804


# --- free norm ------------------------------------------------------------------------------------------------


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
