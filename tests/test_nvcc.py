"""The CUDA kernels of ``csrc/cuda/kernels.cuh``: compiled with the machine's nvcc, and run on a GPU when there is one.

Without a GPU (and with a CPU-only torch) the header is still compiled: a small harness instantiates every
kernel, ``nvcc -ptx`` and ``ptxas -v`` (nvcc's, as ``-Xptxas -v`` runs it) build it for sm_80 and sm_90, and
the tests read the PTX (128-bit ``ld.global.v4`` / ``st.global.v4`` accesses in every streaming kernel) and
ptxas's report (no stack frame, no spills, registers within the full-occupancy budget of 32 per thread at
256 threads).
Skipped when no ``nvcc`` is found (``PATH``, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``).

The multi-tensor kernels (``accumulate_bucket_kernel``, ``optimizer_multi_kernel`` for every functor of
``csrc/optim/all.h``: ``adamw-multi``, ``lion-multi``, ...) take their tensor list by value
as one kernel-parameter struct: the tests also read each kernel's ``.param`` bytes from the PTX and check them
against the 32764-byte limit of CUDA >= 12.1 on sm_70+ (``static_assert`` in the header too).

``pytest.mark.cuda`` tests run the ``cuda`` backend (``gaengine._C`` built with CUDA) on a GPU against the
fp64 oracles of ``tests/reference.py`` with the budgets of ``tests/tolerances.py``, the multi-tensor AdamW against
``torch.ops.gaengine.adamw_step_`` on CPU (bitwise) and ``torch.optim.AdamW(fused=True)`` on CUDA.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests.child_contracts import check_raw_contracts
from tests.helpers import NVCC
from tests.reference import adamw_step_fp64, sum_sq_fp64
from tests.tolerances import ADAMW_RTOL, assert_bitwise_equal, rel_diff, sum_sq_rtol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS_DIR = os.path.join(ROOT, "csrc", "cuda")
CSRC_DIR = os.path.join(ROOT, "csrc")  # the optimizer functors: "optim/<name>.h"


def _optimizer_functors() -> list[str]:
    """The functors of csrc/optim/all.h's OptimizerList, in its order (AdamW, Lion, ...)."""
    with open(os.path.join(CSRC_DIR, "optim", "all.h")) as f:
        listed = re.search(r"OptimizerList<([^>]*)>", f.read()).group(1)
    return [name.strip() for name in listed.split(",")]


# The multi-tensor optimizer kernels: one per functor and param_t, "adamw-multi" (fp32 masters), "adamw-multi-bf16"
# and "adamw-multi-fp16" (params updated in place), and the same for every other functor.
OPTIMIZER_KERNELS = tuple(f"{name.lower()}-multi{suffix}" for name in _optimizer_functors()
                          for suffix in ("", "-bf16", "-fp16"))
ARCHS = {"sm80": "sm_80", "sm90": "sm_90"}
FULL_OCCUPANCY_REGISTERS = 65536 // 2048  # sm_80 / sm_90: 64 K registers and 2048 threads per SM
# Kernels held to a lower occupancy on purpose (kernels/optimizer.cuh), with their register budget: the multi-tensor
# optimizers run 4 blocks of 256 threads per SM (kOptimizerMinBlocksPerSm), 64 registers: AdamW's two IEEE
# divisions, square root and the double pow of the bias corrections do not fit in 32 without spilling, and 1024
# threads per SM, each with its independent 16-byte loads in flight (grad, param, each state), still saturate HBM.
REGISTER_BUDGET = {k: 65536 // (4 * 256) for k in OPTIMIZER_KERNELS}
# The bucket accumulate writing both partials tables (values written and sources: the last micro-batch of a window
# measured for the noise scale, once per window) carries two more accumulators: 4 blocks per SM, 64 registers.
REGISTER_BUDGET["bucket-accumulate-partials-sources"] = 65536 // (4 * 256)
KERNEL_PARAM_LIMIT_BYTES = 32764  # CUDA >= 12.1 on sm_70+ (kernels/common.cuh kMaxKernelParamBytes)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CUDA_TYPES = {"fp32": "f", "bf16": "13__nv_bfloat16", "fp16": "6__half"}  # as mangled in kernel names
ELEMS_PER_VECTOR = {"fp32": 4, "bf16": 8, "fp16": 8}  # values of the source in one 128-bit load

# Every kernel the cuda backend launches: the launchers are instantiated for each source type, which
# instantiates each kernel template (4 accumulate variants per type).
HARNESS = r"""
#include "kernels.cuh"
namespace g = gaengine::cuda;
#define INSTANTIATE(T)                                                                                        \
  template cudaError_t g::launch_accumulate<T>(float*, const T*, int64_t, float, const float*, bool,         \
                                               cudaStream_t);                                                 \
  template cudaError_t g::launch_l2norm_sq<T>(const T*, int64_t, float*, float*, cudaStream_t);
INSTANTIATE(float)
INSTANTIATE(__nv_bfloat16)
INSTANTIATE(__half)
cudaError_t (*const keep_launch_scale)(float*, int64_t, const float*, cudaStream_t) = g::launch_scale;
cudaError_t (*const keep_launch_accumulate_bucket)(float*, const g::BucketEntry*, int, float*, cudaStream_t, int*,
                                                   int64_t, float*, int64_t) = g::launch_accumulate_bucket;
cudaError_t (*const keep_launch_sum_partials)(const float*, int64_t, float*, float*, cudaStream_t) =
    g::launch_sum_partials;
using LaunchAdamW = cudaError_t (*)(const g::AdamWEntry*, int, const g::AdamWHyper&, const float*, const float*,
                                    unsigned int*, cudaStream_t, int*);
LaunchAdamW const keep_launch_adamw_multi = g::launch_adamw_multi<float>;  // fp32 masters
// Every functor of csrc/optim/all.h, for fp32 masters and bf16 | fp16 params in place.
#include "optim/all.h"
template <class... Fs>
const void* const* keep_optimizers(gaengine::optim::OptimizerList<Fs...>) {
  static const void* const keep[] = {reinterpret_cast<const void*>(&g::launch_optimizer_multi<Fs, float>)...,
                                     reinterpret_cast<const void*>(&g::launch_optimizer_multi<Fs, __nv_bfloat16>)...,
                                     reinterpret_cast<const void*>(&g::launch_optimizer_multi<Fs, __half>)...};
  return keep;
}
const void* const* const keep_all_optimizers = keep_optimizers(gaengine::optim::AllOptimizers{});
"""


def _kernel_id(mangled: str) -> str | None:
    """Readable id of a kernel from its mangled name: ``accumulate-bf16-add-scaled``, ``norm-partial-fp16``..."""
    types = {v: k for k, v in CUDA_TYPES.items()}
    m = re.search(r"accumulate_bucket_kernelILb([01])ELb([01])E", mangled)
    if m:  # <kPartials, kSource>: the partials of the values written, of the sources
        return "bucket-accumulate" + ("-partials" if m.group(1) == "1" else "") + (
            "-sources" if m.group(2) == "1" else "")
    m = re.search(r"optimizer_multi_kernelINS_5optim\d+([A-Z]\w*?)E(f|13__nv_bfloat16|6__half)E", mangled)
    if m:  # <F, param_t>: float (fp32 masters) is "adamw-multi"; bf16 | fp16 params updated in place get a suffix
        return f"{m.group(1).lower()}-multi" + ("" if m.group(2) == "f" else f"-{types[m.group(2)]}")
    m = re.search(r"accumulate_kernelI(f|13__nv_bfloat16|6__half)Lb([01])ELb([01])E", mangled)
    if m:
        return f"accumulate-{types[m.group(1)]}-{'overwrite' if m.group(2) == '1' else 'add'}" + (
            "-scaled" if m.group(3) == "1" else "")
    m = re.search(r"l2norm_sq_partial_kernelI(f|13__nv_bfloat16|6__half)E", mangled)
    if m:
        return f"norm-partial-{types[m.group(1)]}"
    if "l2norm_sq_finalize_kernel" in mangled:
        return "norm-finalize"
    if "scale_kernel" in mangled:
        return "scale"
    return None


BUCKET_KERNELS = ("bucket-accumulate", "bucket-accumulate-partials", "bucket-accumulate-sources",
                  "bucket-accumulate-partials-sources")
EXPECTED_KERNELS = sorted(
    [f"accumulate-{dt}-{mode}{scaled}" for dt in DTYPES for mode in ("add", "overwrite") for scaled in ("", "-scaled")]
    + [f"norm-partial-{dt}" for dt in DTYPES] + ["norm-finalize", "scale"]
    + list(BUCKET_KERNELS) + list(OPTIMIZER_KERNELS)
)
MULTI_TENSOR_KERNELS = (*BUCKET_KERNELS, *OPTIMIZER_KERNELS)
PTX_PARAM_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "b32": 4, "u32": 4, "s32": 4,
                   "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def _vector_accesses(ptx: str, op: str) -> int:
    """128-bit global accesses (``ld`` or ``st``) in one kernel's PTX: ``.v4`` of a 32-bit type, or ``.v2`` of 64."""
    return len(re.findall(rf"\b{op}\.global(?:\.[\w:]+)*\.(?:v4\.[bfu]32|v2\.[bfu]64)\b", ptx))


def _vector64_accesses(ptx: str, op: str) -> int:
    """64-bit global accesses (``ld`` or ``st``) in one kernel's PTX: ``.v2`` of a 32-bit type."""
    return len(re.findall(rf"\b{op}\.global(?:\.[\w:]+)*\.v2\.[bfu]32\b", ptx))


def _param_bytes(ptx: str) -> int:
    """Bytes of kernel parameters declared by one ``.entry`` (each aligned to its ``.align`` or its size)."""
    header = ptx[:ptx.index(")")]
    total = 0
    for m in re.finditer(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(?:\.ptr\s+(?:\.\w+\s+)*)?"
                         r"(?:\.align\s+\d+\s+)?\w+(?:\[(\d+)\])?", header):
        size = PTX_PARAM_BYTES[m.group(2)]
        align = int(m.group(1) or size)
        total = (total + align - 1) // align * align + size * int(m.group(3) or 1)
    return total


def _compile(arch: str, workdir) -> dict:
    """{kernel id: {"ptx", "regs", "stack_bytes", "spill_bytes"}} for the harness compiled for ``arch``."""
    harness = workdir / "harness.cu"
    harness.write_text(HARNESS)
    common = [NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-I", KERNELS_DIR, "-I", CSRC_DIR, str(harness)]
    ptx_path = workdir / f"harness_{arch}.ptx"
    subprocess.run([*common, "-ptx", "-o", str(ptx_path)], check=True, capture_output=True, text=True, timeout=300)
    cubin = str(workdir / f"harness_{arch}.cubin")
    ptxas = os.path.join(os.path.dirname(os.path.realpath(NVCC)), "ptxas")
    if os.access(ptxas, os.X_OK):  # assemble the PTX just read: what nvcc -cubin -Xptxas -v runs, without the front end
        cmd = [ptxas, "-v", "-O3", f"-arch={arch}", str(ptx_path), "-o", cubin]
    else:
        cmd = [*common, "-cubin", "-Xptxas", "-v", "-o", cubin]
    report = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stderr
    kernels: dict = {}
    for chunk in re.split(r"(?=^\.visible \.entry )", ptx_path.read_text(), flags=re.M)[1:]:
        name = re.match(r"\.visible \.entry (\w+)", chunk).group(1)
        chunk = chunk.split("\n.func ")[0]  # a device function (pow's) emitted after the entry is not part of it
        kernels[_kernel_id(name)] = {"ptx": chunk, "mangled": name, "param_bytes": _param_bytes(chunk)}
    current = None
    for line in report.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if m:
            current = _kernel_id(m.group(1))
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current in kernels:
            kernels[current].update(stack_bytes=int(m.group(1)), spill_bytes=int(m.group(2)) + int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current in kernels:
            kernels[current]["regs"] = int(m.group(1))
    return kernels


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Both arches compiled once per session."""
    if NVCC is None:
        pytest.skip("no nvcc found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    results = {}
    for arch_id, arch in ARCHS.items():
        try:
            results[arch_id] = _compile(arch, tmp_path_factory.mktemp(arch_id))
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"nvcc failed for {arch}:\n{exc.stderr[-4000:]}")
    return results


def _kernel_params(select=lambda k: True):
    return [pytest.param(k, a, id=f"{k}-{a}") for k in EXPECTED_KERNELS if select(k) for a in ARCHS]


@pytest.mark.parametrize("arch_id", ARCHS)
def test_every_kernel_is_compiled(compiled, arch_id):
    assert sorted(k for k in compiled[arch_id] if k) == EXPECTED_KERNELS
    assert None not in compiled[arch_id], "a kernel the tests do not know about"


@pytest.mark.parametrize("kernel, arch_id", _kernel_params(lambda k: k != "norm-finalize"))
def test_streaming_accesses_are_128_bit(compiled, kernel, arch_id):
    ptx = compiled[arch_id][kernel]["ptx"]
    loads, stores = _vector_accesses(ptx, "ld"), _vector_accesses(ptx, "st")
    if kernel.startswith("accumulate-"):
        dt = kernel.split("-")[1]
        # One vector of the source, plus ELEMS/4 fp32 vectors of dst when adding; ELEMS/4 stored.
        dst_vectors = ELEMS_PER_VECTOR[dt] // 4
        expected_loads = 1 + (0 if "-overwrite" in kernel else dst_vectors)
        assert loads >= expected_loads, f"{kernel} {arch_id}: {loads} 128-bit loads, expected {expected_loads}"
        assert stores >= dst_vectors, f"{kernel} {arch_id}: {stores} 128-bit stores, expected {dst_vectors}"
    elif kernel.startswith("norm-partial-"):
        assert loads >= 1, f"{kernel} {arch_id}: no 128-bit load"
    elif kernel.startswith("bucket-accumulate"):
        # One source-dtype path each: fp32 adds 1 src + 1 dst vector, stores 1; bf16 and fp16 add 1 src + 2 dst
        # vectors, store 2 (each path also has its overwrite branch, which loads no dst).
        expected_loads, expected_stores = (1 + 1) + 2 * (1 + 2), 1 + 2 * 2
        assert loads >= expected_loads, f"{kernel} {arch_id}: {loads} 128-bit loads, expected {expected_loads}"
        assert stores >= expected_stores, f"{kernel} {arch_id}: {stores} 128-bit stores, expected {expected_stores}"
    elif kernel in OPTIMIZER_KERNELS and kernel.endswith("-multi"):
        # Nine grad x model paths, each with float4 loads and stores of param and each state (AdamW: exp_avg and
        # exp_avg_sq; every functor has at least one).
        streams = 3 if kernel.startswith("adamw-") else 2
        assert loads >= 9 * streams and stores >= 9 * streams, (
            f"{kernel} {arch_id}: {loads} 128-bit loads, {stores} stores")
    elif kernel in OPTIMIZER_KERNELS:
        # bf16 | fp16 params in place, three grad paths: the fp32 gradient as a float4; four 16-bit p and states per
        # thread and step as 64-bit accesses (one ld / st.global.v2.u32 each), loaded and stored on every path.
        streams = 3 if kernel.startswith("adamw-") else 2
        loads64, stores64 = _vector64_accesses(ptx, "ld"), _vector64_accesses(ptx, "st")
        assert loads >= 1, f"{kernel} {arch_id}: no float4 load of the fp32 gradient"
        assert loads64 >= 3 * streams and stores64 >= 3 * streams, (
            f"{kernel} {arch_id}: {loads64} 64-bit loads, {stores64} stores")
    else:  # scale
        assert loads >= 1 and stores >= 1, f"{kernel} {arch_id}: {loads} 128-bit loads, {stores} stores"


@pytest.mark.parametrize("kernel, arch_id", _kernel_params())
def test_nothing_spills(compiled, kernel, arch_id):
    info = compiled[arch_id][kernel]
    assert "stack_bytes" in info, f"{kernel} {arch_id}: no ptxas report for {info['mangled']}"
    assert info["stack_bytes"] == 0 and info["spill_bytes"] == 0, (
        f"{kernel} {arch_id}: {info['stack_bytes']} B stack frame, {info['spill_bytes']} B spilled")
    assert not re.search(r"^\s*\.local\b", info["ptx"], re.M), f"{kernel} {arch_id}: .local memory in the PTX"


@pytest.mark.parametrize("kernel, arch_id", _kernel_params(lambda k: k != "norm-finalize"))  # finalize: one block
def test_registers_allow_full_occupancy(compiled, kernel, arch_id):
    regs = compiled[arch_id][kernel]["regs"]
    budget = REGISTER_BUDGET.get(kernel, FULL_OCCUPANCY_REGISTERS)
    assert regs <= budget, f"{kernel} {arch_id}: {regs} registers per thread, over its budget of {budget}"


@pytest.mark.parametrize("kernel, arch_id", _kernel_params())
def test_kernel_parameters_fit_the_limit(compiled, kernel, arch_id):
    size = compiled[arch_id][kernel]["param_bytes"]
    assert 0 < size <= KERNEL_PARAM_LIMIT_BYTES, f"{kernel} {arch_id}: {size} bytes of kernel parameters"
    if kernel in MULTI_TENSOR_KERNELS:  # the tensor table really travels by value (more than the old 4 KB limit)
        assert size > 4096, f"{kernel} {arch_id}: only {size} bytes of parameters: where is the tensor table?"


@pytest.mark.parametrize("kernel, arch_id", _kernel_params(lambda k: k in MULTI_TENSOR_KERNELS))
def test_multi_tensor_kernels_are_deterministic_and_ieee(compiled, kernel, arch_id):
    """No float atomics (each chunk writes its own partials slot); AdamW: one counter atomic, IEEE div / sqrt."""
    ptx = compiled[arch_id][kernel]["ptx"]
    atomics = re.findall(r"(?<![\w.])(?:atom|red)\.[\w.]+", ptx)  # not bar.red (__syncthreads_or)
    if kernel in OPTIMIZER_KERNELS:
        # AdamW keeps step counts (the last block's counter); a functor without them has no atomic at all.
        allowed = [["atom.global.add.u32"]] if kernel.startswith("adamw-") else [[], ["atom.global.add.u32"]]
        assert atomics in allowed, f"{kernel} {arch_id}: {atomics}"
        assert "div.rn.f32" in ptx, f"{kernel} {arch_id}: no IEEE fp32 division (grad_scale)"
        if kernel.startswith("adamw-"):
            assert "sqrt.rn.f32" in ptx, f"{kernel} {arch_id}: no IEEE fp32 sqrt"
        assert not re.search(r"\b(?:div\.(?:approx|full)|sqrt\.approx|rsqrt)\.", ptx), f"{kernel} {arch_id}: fast math"
    else:
        assert atomics == [], f"{kernel} {arch_id}: atomics {atomics}"
    assert ".ftz" not in ptx, f"{kernel} {arch_id}: flush-to-zero arithmetic"


def test_cuda_backend_raises_clearly_where_it_is_not_built():
    from gaengine import backends  # noqa: PLC0415

    try:
        from gaengine import _C  # noqa: PLC0415
    except ImportError:
        _C = None
    if torch.version.cuda and _C is not None and _C.WITH_CUDA:
        pytest.skip("this build has the CUDA kernels")
    with pytest.raises(RuntimeError, match="backend 'cuda' could not be loaded: .*(CPU-only|without its CUDA kernels)"):
        backends.get_backend("cuda", "cuda")


# --- on a GPU: the cuda backend against fp64 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_backend():
    from gaengine.backends import get_backend  # noqa: PLC0415

    return get_backend("cuda", "cuda")


def _grad(n, dtype):
    return (torch.randn(n) * torch.logspace(-3, 2, n)).to(dtype).cuda()


@pytest.mark.cuda
def test_cuda_contracts_name_the_argument(cuda_backend):
    with pytest.raises(RuntimeError, match="src must be a CUDA tensor"):
        cuda_backend.accumulate_(torch.zeros(4, device="cuda"), torch.zeros(4))
    with pytest.raises(RuntimeError, match="dst must be float32"):
        cuda_backend.accumulate_(torch.zeros(4, device="cuda", dtype=torch.bfloat16), torch.zeros(4, device="cuda"))
    with pytest.raises(RuntimeError, match="coef must be a 0-d tensor"):
        cuda_backend.scale_(torch.zeros(4, device="cuda"), torch.ones(1, device="cuda"))
    sum_sq, found_inf = cuda_backend.l2norm_sq(torch.empty(0, device="cuda"))
    assert sum_sq.item() == 0.0 and found_inf.item() == 0.0


# --- on a GPU: the multi-tensor ops (one launch for a list of tensors) -------------------------------------------

DEVICE = "cuda"
BUCKET_CHUNK_NUMEL = 4096  # kernels/bucket.cuh kBucketChunkNumel: one partials column per chunk of each source
MAX_BUCKET_ENTRIES = 512  # kernels/bucket.cuh kMaxBucketEntries: non-empty sources per launch
BUCKET_SIZES = [1, 127, 4097, 3 * BUCKET_CHUNK_NUMEL + 5]  # one element, a tail only, a chunk + 1, several chunks
BUCKET_DTYPES = {"fp32": ["fp32"] * 4, "bf16": ["bf16"] * 4, "fp16": ["fp16"] * 4,
                 "mixed": ["bf16", "fp32", "fp16", "bf16"]}
OVERWRITE = [False, True, False, True]
NAN = float("nan")


@pytest.fixture(scope="module")
def cuda_ops():
    """``torch.ops.gaengine``, whose ops run their CUDA kernels on CUDA tensors."""
    from gaengine import _C  # noqa: PLC0415

    if not _C.WITH_CUDA:
        raise RuntimeError("gaengine._C was built without its CUDA kernels: rebuild it against a CUDA torch")
    return torch.ops.gaengine


def _source(n: int, dtype: str, unaligned: bool) -> torch.Tensor:
    """(n,) gradient on DEVICE, spanning 5 decades; unaligned: starts 1 element past a 16-byte boundary."""
    x = (torch.randn(n + 1) * torch.logspace(-3, 2, n + 1)).to(DTYPES[dtype]).to(DEVICE)
    return x[1:] if unaligned else x[:n]


def _bucket(numels, dtypes, overwrite, unaligned=False):
    """A NaN-poisoned main_grad buffer and the bucket's sources: each slice starts at a multiple of 64 elements
    (gaengine/buffer.py's ALIGN_NUMEL), + 1 when unaligned; the slices to add into hold data, the padding and the
    slices to overwrite hold NaN (a read of them shows up)."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total + int(unaligned))
        total += (n + 1 + 63) // 64 * 64
    dst = torch.full((max(total, 1),), NAN, device=DEVICE)
    for o, n, ow in zip(offsets, numels, overwrite):
        if not ow:
            dst[o:o + n] = torch.randn(n, device=DEVICE) * 10
    srcs = [_source(n, dt, unaligned) for n, dt in zip(numels, dtypes)]
    return dst, srcs, offsets


def _chunk_sums_fp64(dst, srcs, offsets):
    """Exact (float64) sum of squares of the values in each chunk of each source's slice, in partials order."""
    sums = []
    for src, o in zip(srcs, offsets):
        for start in range(0, src.numel(), BUCKET_CHUNK_NUMEL):
            sums.append(sum_sq_fp64(dst[o + start:o + min(start + BUCKET_CHUNK_NUMEL, src.numel())]))
    return torch.tensor(sums, dtype=torch.float64)


@pytest.mark.cuda
def test_cuda_bucket_partials_within_tolerance_and_deterministic(cuda_ops):
    dst, srcs, offsets = _bucket(BUCKET_SIZES, BUCKET_DTYPES["mixed"], OVERWRITE)
    n_chunks = cuda_ops.bucket_num_chunks([s.numel() for s in srcs])
    assert n_chunks == sum(-(-n // BUCKET_CHUNK_NUMEL) for n in BUCKET_SIZES)
    before = dst.clone()
    partials = torch.full((2, n_chunks), NAN, device=DEVICE)
    cuda_ops.accumulate_bucket_(dst, srcs, offsets, OVERWRITE, partials)
    exact = _chunk_sums_fp64(dst, srcs, offsets)  # of the values written
    err = (partials[0].double().cpu() - exact).abs()
    assert bool((err <= sum_sq_rtol(BUCKET_CHUNK_NUMEL) * exact).all()), f"per-chunk sums off by {err.max():.3e}"
    assert partials[1].eq(0).all()
    sum_sq, found_inf = cuda_ops.sum_partials(partials)
    total = float(exact.sum())
    assert abs(sum_sq.item() - total) <= sum_sq_rtol(sum(BUCKET_SIZES)) * total and found_inf.item() == 0.0

    # The same inputs give the same bits, also into a column slice of a larger table (strided rows).
    table = torch.full((2, n_chunks + 5), NAN, device=DEVICE)
    dst.copy_(before)
    cuda_ops.accumulate_bucket_(dst, srcs, offsets, OVERWRITE, table[:, 3:3 + n_chunks])
    assert_bitwise_equal(table[:, 3:3 + n_chunks].contiguous(), partials, "second run, strided partials")
    assert table[:, :3].isnan().all() and table[:, 3 + n_chunks:].isnan().all(), "a column outside the slice written"
    assert_bitwise_equal(torch.stack(cuda_ops.sum_partials(partials)), torch.stack((sum_sq, found_inf)), "sum")

    # The sources' partials in the same launch: the values written and their partials unchanged (bitwise), the
    # sources' per-chunk sums within budget of the fp64 oracle.
    written = dst.clone()
    both, sources = torch.full_like(partials, NAN), torch.full_like(partials, NAN)
    dst.copy_(before)
    cuda_ops.accumulate_bucket_(dst, srcs, offsets, OVERWRITE, both, sources)
    assert_bitwise_equal(dst, written, "dst with source partials")
    assert_bitwise_equal(both, partials, "partials with source partials")
    exact = torch.tensor([sum_sq_fp64(s[start:start + BUCKET_CHUNK_NUMEL]) for s in srcs
                          for start in range(0, s.numel(), BUCKET_CHUNK_NUMEL)], dtype=torch.float64)
    err = (sources[0].double().cpu() - exact).abs()
    assert bool((err <= sum_sq_rtol(BUCKET_CHUNK_NUMEL) * exact).all()), f"source sums off by {err.max():.3e}"
    assert sources[1].eq(0).all()

    srcs[2][BUCKET_CHUNK_NUMEL] = float("inf")  # chunk 1 of source 2 (its last element): partials column 3
    dst.copy_(before)
    cuda_ops.accumulate_bucket_(dst, srcs, offsets, OVERWRITE, partials, sources)
    assert partials[1].cpu().tolist() == [1.0 if j == 3 else 0.0 for j in range(n_chunks)]
    assert sources[1].cpu().tolist() == [1.0 if j == 3 else 0.0 for j in range(n_chunks)]
    assert cuda_ops.sum_partials(partials)[1].item() == 1.0


@pytest.mark.cuda
def test_cuda_bucket_contracts_name_the_argument_and_write_nothing(cuda_ops):
    # In a child process (tests/child_contracts.py): on an image where a failed TORCH_CHECK crashes, it must not
    # take the test run down with it.
    setup = ("dst = torch.zeros(256, device='cuda'); good = torch.ones(64, device='cuda')\n"
             "def check():\n    assert dst.eq(0).all(), 'dst written before raising'\n")
    calls = [
        ("[good, torch.ones(64)], [0, 64], [False, False], None", r"srcs\[1\] must be a CUDA tensor"),
        ("[good, torch.ones(64, device='cuda', dtype=torch.float64)], [0, 64], [False, False], None",
         r"srcs\[1\] must be float32, bfloat16 or float16"),
        ("[good, torch.ones(8, 8, device='cuda').t()], [0, 64], [False, False], None", r"srcs\[1\] must be contiguous"),
        ("[good, good], [0], [False, False], None", r"offsets has 1 entries but srcs has 2"),
        ("[good, good], [0, 64], [False], None", r"overwrite has 1 flags but srcs has 2"),
        ("[good, good], [0, 200], [False, False], None", r"offsets\[1\] = 200 puts the 64 elements of srcs\[1\] out"),
        ("[good, good], [0, 32], [False, False], None", r"the dst slices of srcs\[0\] and srcs\[1\] overlap"),
        ("[good, good], [0, 64], [False, False], torch.zeros(2, 3, device='cuda')", r"partials must be a \(2, 2\)"),
        ("[good, good], [0, 64], [False, False], torch.zeros(2, 2)", r"partials must be a CUDA tensor"),
    ]
    cases = [(f"bucket-{i}", setup, f"torch.ops.gaengine.accumulate_bucket_(dst, {args})", match)
             for i, (args, match) in enumerate(calls)]
    cases += [
        ("bucket-dst-dtype", setup, "torch.ops.gaengine.accumulate_bucket_(dst.bfloat16(), [good], [0], [False], None)",
         "dst must be float32"),
        ("num-chunks", "", "torch.ops.gaengine.bucket_num_chunks([1, -1])", r"numels\[1\] must be >= 0"),
        ("sum-partials", "", "torch.ops.gaengine.sum_partials(torch.zeros(3, 4, device='cuda'))",
         r"partials must have shape \(2, n_chunks\)"),
    ]
    check_raw_contracts(cases)


# AdamW: sizes with a tail, an empty parameter, one over many blocks, and an unaligned one (scalar path).
ADAMW_SIZES = [1, 127, 0, 4097, 70 * 4096 + 3, 1000]
ADAMW_GRADS = ["fp32", "bf16", "fp16", "fp32", "bf16", "fp16"]
ADAMW_MODELS = [None, "bf16", "fp16", "bf16", None, "fp16"]
ADAMW_HYPER = {  # lr, beta1, beta2, eps, weight_decay, maximize; beta1 = 0.3: torch's lerp with weight >= 0.5
    "default": (1e-3, 0.9, 0.999, 1e-8, 1e-2, False),
    "lerp-large-maximize": (1e-2, 0.3, 0.95, 1e-6, 0.0, True),
}


@pytest.mark.cuda
def test_cuda_adamw_contracts_name_the_argument(cuda_ops):
    setup = ("d = 'cuda'; n = [5, 7, 9]; adamw_step_ = torch.ops.gaengine.adamw_step_\n"
             "ps = [torch.randn(k, device=d) for k in n]; gs = [torch.randn(k, device=d) for k in n]\n"
             "ms = [torch.zeros(k, device=d) for k in n]; vs = [torch.zeros(k, device=d) for k in n]\n"
             "steps = [torch.zeros((), device=d) for k in n]; models = [None] * 3\n"
             "before = [t.clone() for t in ps + ms + vs + steps]\n"
             "def check():\n"
             "    assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs + steps, before)), 'written before raising'\n")
    hyper = "1e-3, 0.9, 0.999, 1e-8, 1e-2, False"
    cases = [
        ("adamw-grad-device", setup, f"adamw_step_(ps, gs[:2] + [gs[2].cpu()], ms, vs, steps, models, {hyper}, "
         "None, None)", r"grads\[2\] must be a CUDA tensor"),
        ("adamw-found-inf", setup, f"adamw_step_(ps, gs, ms, vs, steps, models, {hyper}, None, "
         "torch.zeros(1, device=d))", "found_inf must be a 0-d float32 tensor"),
        ("adamw-lengths", setup, f"adamw_step_(ps, gs, ms, vs, steps, models[:-1], {hyper}, None, None)",
         "must have the same length"),
        ("adamw-moments-mix", setup, f"adamw_step_([p.half() for p in ps], gs, ms, vs, steps, models, {hyper}, "
         "None, None)", r"exp_avgs\[0\] and exp_avg_sqs\[0\] must be float16 \(the dtype of params\[0\]\)"),
    ]
    check_raw_contracts(cases)


@pytest.mark.cuda
def test_fused_adamw_uses_the_cuda_kernel_and_matches_torch_fused(cuda_ops, monkeypatch):
    from gaengine.optim import FusedAdamW  # noqa: PLC0415

    monkeypatch.delenv("GAENGINE_BACKEND", raising=False)
    torch_params = [torch.nn.Parameter(torch.randn(n, device=DEVICE)) for n in (1, 127, 4097, 3 * 4096 + 5)]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in torch_params]
    reference = torch.optim.AdamW(torch_params, lr=1e-3, weight_decay=1e-2, fused=True)
    opt = FusedAdamW(ours, lr=1e-3, weight_decay=1e-2, backend="auto")
    assert opt._kernel(torch.device(DEVICE)).backend == "cuda"  # torch.ops.gaengine.adamw_step_'s CUDA kernel
    assert FusedAdamW(ours, backend="cuda")._kernel(torch.device(DEVICE)).backend == "cuda"
    for step in range(1, 4):
        for p, q in zip(torch_params, ours):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        # The fp64 oracle of this step from our state before it (zero moments at the first step).
        expected = [adamw_step_fp64(q, q.grad, opt.state[q].get("exp_avg", torch.zeros_like(q)),
                                    opt.state[q].get("exp_avg_sq", torch.zeros_like(q)), step, 1e-3, 0.9, 0.999, 1e-8,
                                    1e-2, False) for q in ours]
        reference.step()
        opt.step()
        for q, want in zip(ours, expected):  # a few fp32 roundings per element (tests/tolerances.py ADAMW_RTOL)
            for got, exact, what in zip((q, opt.state[q]["exp_avg"], opt.state[q]["exp_avg_sq"]), want,
                                        ("param", "exp_avg", "exp_avg_sq")):
                assert rel_diff(got, exact.reshape(got.shape)) <= ADAMW_RTOL, f"step {step}, {q.numel()}: {what}"
    for p, q in zip(torch_params, ours):
        # torch's own fused kernel, another rounding of the same update: the parameters within a few fp32 ulps (its
        # moments are not compared: on torch 2.11's CUDA build a one-element exp_avg_sq came out 1.3e-5 off ours,
        # which the fp64 oracle above holds to ADAMW_RTOL).
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
        assert opt.state[q]["step"].item() == reference.state[p]["step"].item() == 3.0
