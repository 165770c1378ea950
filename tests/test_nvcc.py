"""The CUDA kernels of ``csrc/cuda/kernels.cuh``: compiled with the machine's nvcc, and run on a GPU when there is one.

Without a GPU (and with a CPU-only torch) the header is still compiled: a small harness instantiates every
kernel, ``nvcc -ptx`` and ``ptxas -v`` (nvcc's, as ``-Xptxas -v`` runs it) build it for sm_80 and sm_90, and
the tests read the PTX (128-bit ``ld.global.v4`` / ``st.global.v4`` accesses in every streaming kernel) and
ptxas's report (no stack frame, no spills, registers within the full-occupancy budget of 32 per thread at
256 threads).
Skipped when no ``nvcc`` is found (``PATH``, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``).

``pytest.mark.cuda`` tests run the ``cuda`` backend (``gaengine._C`` built with CUDA) on a GPU against the
fp64 oracles of ``tests/reference.py`` with the budgets of ``tests/tolerances.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import torch

from tests.reference import accumulate_fp64, sum_sq_fp64
from tests.tolerances import assert_bitwise_equal, assert_within_ulp, sum_sq_rtol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS_DIR = os.path.join(ROOT, "csrc", "cuda")
ARCHS = {"sm80": "sm_80", "sm90": "sm_90"}
FULL_OCCUPANCY_REGISTERS = 65536 // 2048  # sm_80 / sm_90: 64 K registers and 2048 threads per SM
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
"""


def _find_nvcc() -> str | None:
    candidates = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


NVCC = _find_nvcc()


def _kernel_id(mangled: str) -> str | None:
    """Readable id of a kernel from its mangled name: ``accumulate-bf16-add-scaled``, ``norm-partial-fp16``..."""
    types = {v: k for k, v in CUDA_TYPES.items()}
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


EXPECTED_KERNELS = sorted(
    [f"accumulate-{dt}-{mode}{scaled}" for dt in DTYPES for mode in ("add", "overwrite") for scaled in ("", "-scaled")]
    + [f"norm-partial-{dt}" for dt in DTYPES] + ["norm-finalize", "scale"]
)


def _vector_accesses(ptx: str, op: str) -> int:
    """128-bit global accesses (``ld`` or ``st``) in one kernel's PTX: ``.v4`` of a 32-bit type, or ``.v2`` of 64."""
    return len(re.findall(rf"\b{op}\.global(?:\.[\w:]+)*\.(?:v4\.[bfu]32|v2\.[bfu]64)\b", ptx))


def _compile(arch: str, workdir) -> dict:
    """{kernel id: {"ptx", "regs", "stack_bytes", "spill_bytes"}} for the harness compiled for ``arch``."""
    harness = workdir / "harness.cu"
    harness.write_text(HARNESS)
    common = [NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-I", KERNELS_DIR, str(harness)]
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
        kernels[_kernel_id(name)] = {"ptx": chunk, "mangled": name}
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
    assert regs <= FULL_OCCUPANCY_REGISTERS, (
        f"{kernel} {arch_id}: {regs} registers per thread; 8 blocks of 256 threads need <= {FULL_OCCUPANCY_REGISTERS}")


def test_cuda_backend_raises_clearly_where_it_is_not_built():
    from gaengine import backends  # noqa: PLC0415

    try:
        from gaengine import _C  # noqa: PLC0415
    except ImportError:
        _C = None
    if torch.version.cuda and _C is not None and hasattr(_C, "accumulate_cuda_"):
        pytest.skip("this build has the CUDA ops")
    with pytest.raises(RuntimeError, match="backend 'cuda' could not be loaded: .*(CPU-only|without its CUDA ops)"):
        backends.get_backend("cuda", "cuda")


# --- on a GPU: the cuda backend against fp64 -------------------------------------------------------------------

SIZES = [1, 127, 4097, 3 * 16384 + 5]  # one element, under a vector group, odd, several norm chunks plus a tail
SCALE = float(torch.tensor(0.3, dtype=torch.float32))


def _cases():
    return [pytest.param(n, DTYPES[d], id=f"n{n}-{d}") for n in SIZES for d in DTYPES]


@pytest.fixture(scope="module")
def cuda_backend():
    from gaengine.backends import get_backend  # noqa: PLC0415

    return get_backend("cuda", "cuda")


def _grad(n, dtype):
    return (torch.randn(n) * torch.logspace(-3, 2, n)).to(dtype).cuda()


def _poison(n):
    return torch.full((n,), float("nan"), device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])  # 1: the scalar path of every kernel
@pytest.mark.parametrize("n, dtype", _cases())
def test_cuda_accumulate_matches_torch_and_fp64(cuda_backend, n, dtype, offset):
    dst = (torch.randn(n + offset) * 10).cuda()[offset:]
    src = _grad(n + offset, dtype)[offset:]
    expected = dst.clone().add_(src)
    exact = accumulate_fp64(expected, src, SCALE)
    assert_bitwise_equal(cuda_backend.accumulate_(dst, src), expected, "dst + src")
    out = cuda_backend.accumulate_(_poison(n + offset)[offset:], src, 1.0, True)
    assert_bitwise_equal(out, src.float(), "overwrite")
    cuda_backend.accumulate_(dst, src, SCALE)
    assert_within_ulp(dst, exact, src.double() * SCALE, what="dst + src * scale")
    out = cuda_backend.accumulate_(_poison(n), src, torch.tensor(SCALE, device="cuda"), True)
    assert_within_ulp(out, src.double() * SCALE, src.double() * SCALE, what="src * scale tensor, overwrite")


@pytest.mark.cuda
@pytest.mark.parametrize("n, dtype", _cases())
def test_cuda_l2norm_sq_within_tolerance_and_deterministic(cuda_backend, n, dtype):
    x = _grad(n, dtype)
    sum_sq, found_inf = cuda_backend.l2norm_sq(x)
    exact = sum_sq_fp64(x)
    assert abs(sum_sq.item() - exact) <= sum_sq_rtol(n) * exact and found_inf.item() == 0.0
    again = torch.stack(cuda_backend.l2norm_sq(x))
    assert_bitwise_equal(again, torch.stack((sum_sq, found_inf)), "second run")
    x[n // 2] = float("nan")
    assert cuda_backend.l2norm_sq(x)[1].item() == 1.0


@pytest.mark.cuda
@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
def test_cuda_scale_bitwise_equal_to_torch(cuda_backend, n):
    x = (torch.randn(n) * 10).cuda()
    coef = torch.tensor(SCALE, device="cuda")
    expected = x.clone().mul_(coef)
    assert_bitwise_equal(cuda_backend.scale_(x, coef), expected, "x * coef")


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
