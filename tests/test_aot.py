"""Every Triton kernel of ``gaengine.kernels``, compiled ahead of time for sm_80 and sm_90, read back: no GPU needed.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` runs the whole NVIDIA pipeline on
the host (ptxas ships in the triton wheel). For each kernel variant that runs in practice the tests read:

* the PTX: on 16-byte aligned buffers, every global load and store of the gradient data is a 128-bit vector
  access (``ld.global.v4.b32`` / ``st.global.v4.b32``: four fp32, or eight bf16 | fp16);
* the cubin (``cuobjdump --dump-resource-usage``): no spills (a 0-byte stack frame, where ptxas puts them,
  no local memory, no ``.local`` in the PTX) and a register count that allows full occupancy for the ``num_warps`` used;
* for the weight-gradient GEMM (``gaengine/kernels/wgrad.py``, every autotuned config): tensor-core instructions
  (``mma.sync`` on sm_80, ``mma.sync`` or ``wgmma.mma_async`` on sm_90) on bf16 | fp16 operands, the fp32 C tile's
  epilogue load and store in 128-bit vectors, no spills; a GEMM tile holds its accumulator in registers by design, so
  full occupancy is not asked of it.

The alignment the kernels are compiled for is the one the flat buffer guarantees: ``gaengine/buffer.py``
starts every parameter at a multiple of ``ALIGN_NUMEL`` = 64 elements (256 bytes in fp32, 128 in bf16), so
main_grad views, their numels' padding and fresh gradients (the caching allocator returns 512-byte aligned
blocks) are 16-byte aligned. That is the ``tt.divisibility = 16`` attribute below, the specialization
Triton's launcher itself applies to a pointer whose address is a multiple of 16 and to an integer that is a
multiple of 16; ``n_elements`` gets it only when the numel is a multiple of 16 (the accumulate and norm
kernels are not vectorized on other numels; the bucket kernel is, except for each tensor's last chunk).

``triton.compile`` needs real ``JITFunction``s, and under ``TRITON_INTERPRET=1`` (set by ``conftest.py`` on
machines without a GPU) ``@triton.jit`` builds interpreter objects instead, triton's own ``tl.sum`` /
``tl.max`` included. So the compilation runs once per session in a subprocess with ``TRITON_INTERPRET``
unset (this file run as a script, ``python tests/test_aot.py OUT.json``), which writes a summary of each
compiled variant; the tests read it. Triton's cache (``~/.triton/cache``) makes repeated sessions fast.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

ARCHS = {"sm80": 80, "sm90": 90}
# What `make test` (pytest -q) prints before this file (tests/conftest.py): the compiles take minutes on 2 cores.
PROGRESS_NOTE = "ahead-of-time Triton compiles for sm_80 and sm_90 (a subprocess each), a few minutes"
# Per-SM limits of sm_80 (A100) and sm_90 (H100): CUDA C++ Programming Guide, "Compute capabilities" table.
REGS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
REG_ALLOC_UNIT = 8  # registers per thread are allocated in units of 256 per warp, i.e. 8 per thread
SRC_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TL_TYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def full_occupancy_registers(num_warps: int) -> int:
    """Most registers per thread that still let an SM hold its maximum number of threads of this kernel.

    blocks/SM = min(MAX_BLOCKS_PER_SM, MAX_THREADS_PER_SM // threads_per_block); the bound is
    REGS_PER_SM / (threads_per_block * blocks/SM), rounded down to the allocation unit. 32 for 4, 8 or 16 warps.
    """
    threads_per_block = 32 * num_warps
    blocks_per_sm = min(MAX_BLOCKS_PER_SM, MAX_THREADS_PER_SM // threads_per_block)
    bound = REGS_PER_SM // (threads_per_block * blocks_per_sm)
    return bound // REG_ALLOC_UNIT * REG_ALLOC_UNIT


@dataclass(frozen=True)
class Case:
    """One compiled kernel variant.

    signature: argument name -> Triton type (``"constexpr"`` for constexprs), in the kernel's order.
    constexprs: values of the constexprs (dtypes as ``"tl.bfloat16"`` strings, resolved in the subprocess).
    aligned: arguments given ``tt.divisibility = 16`` (16-byte aligned pointers, integers multiple of 16).
    v4_loads, v4_stores: 128-bit accesses the PTX must contain at least (None: not checked).
    other_loads: global loads that are not 128-bit allowed at most (None: not checked), e.g. a scalar scale.
    """

    id: str
    module: str
    kernel: str
    signature: dict
    constexprs: dict
    aligned: tuple
    num_warps: int
    v4_loads: int | None = None
    v4_stores: int | None = None
    other_loads: int | None = None
    single_program: bool = False  # launched with one program: occupancy does not apply
    num_stages: int | None = None  # software pipeline stages (the GEMM's config); None: Triton's default
    mma: bool = False  # the PTX must hold tensor-core instructions
    occupancy: bool = True  # checked against the full-occupancy register bound (not for a GEMM tile)
    regs_cap: int | None = None  # registers per thread allowed instead of the full-occupancy bound


def _accesses(n_elements: int, num_warps: int, nbytes: int) -> int:
    """128-bit accesses per thread to move ``n_elements`` values of ``nbytes`` each over one program."""
    return n_elements // (32 * num_warps) * nbytes // 16


def _cases() -> list[Case]:
    # Kept in sync with the launchers by test_cases_match_the_launchers (block sizes, warps).
    block, warps = 4096, 8  # gaengine/kernels/accumulate.py, norm.py, scale.py
    cases = []
    acc_sig = {"dst_ptr": "*fp32", "src_ptr": None, "scale_ptr": "*fp32", "scale": "fp32", "n_elements": "i64",
               "HAS_SCALE": "constexpr", "SCALE_IS_PTR": "constexpr", "OVERWRITE": "constexpr",
               "BLOCK_SIZE": "constexpr"}
    modes = {  # name: HAS_SCALE, SCALE_IS_PTR, OVERWRITE
        "add": (False, False, False),
        "add-scaled": (True, False, False),
        "add-scaled-ptr": (True, True, False),
        "overwrite": (False, False, True),
        "overwrite-scaled-ptr": (True, True, True),
    }
    for dt in SRC_BYTES:
        for mode, (has_scale, scale_is_ptr, overwrite) in modes.items():
            loads = _accesses(block, warps, SRC_BYTES[dt]) + (0 if overwrite else _accesses(block, warps, 4))
            cases.append(Case(
                f"accumulate-{dt}-{mode}", "accumulate", "_accumulate_kernel", {**acc_sig, "src_ptr": TL_TYPES[dt]},
                {"HAS_SCALE": has_scale, "SCALE_IS_PTR": scale_is_ptr, "OVERWRITE": overwrite, "BLOCK_SIZE": block},
                ("dst_ptr", "src_ptr", "scale_ptr", "n_elements"), warps,
                v4_loads=loads, v4_stores=_accesses(block, warps, 4), other_loads=int(scale_is_ptr),
            ))
    norm_sig = {"x_ptr": None, "partials_ptr": "*fp32", "n_elements": "i64", "n_partials": "i32",
                "BLOCK_SIZE": "constexpr", "BLOCKS_PER_PROGRAM": "constexpr"}
    for dt in SRC_BYTES:
        for bpp in (1, 16):  # gaengine/kernels/norm.py: 1 below LARGE_NUMEL, LARGE_BLOCKS_PER_PROGRAM above
            cases.append(Case(
                f"norm-partial-{dt}-x{bpp}", "norm", "_l2norm_sq_partial_kernel", {**norm_sig, "x_ptr": TL_TYPES[dt]},
                {"BLOCK_SIZE": block, "BLOCKS_PER_PROGRAM": bpp}, ("x_ptr", "partials_ptr", "n_elements"), warps,
                v4_loads=_accesses(block, warps, SRC_BYTES[dt]), other_loads=0,
            ))
    cases.append(Case(
        "norm-finalize", "norm", "_l2norm_sq_finalize_kernel",
        {"partials_ptr": "*fp32", "out_ptr": "*fp32", "n_partials": "i32", "BLOCK_SIZE": "constexpr"},
        {"BLOCK_SIZE": 1024}, ("partials_ptr", "out_ptr"), 4,  # n_partials: any count, scalar loads are fine
        single_program=True,
    ))
    cases.append(Case(
        "scale", "scale", "_scale_kernel",
        {"x_ptr": "*fp32", "coef_ptr": "*fp32", "n_elements": "i64", "BLOCK_SIZE": "constexpr"},
        {"BLOCK_SIZE": block}, ("x_ptr", "coef_ptr", "n_elements"), warps,
        v4_loads=_accesses(block, warps, 4), v4_stores=_accesses(block, warps, 4), other_loads=1,
    ))
    bucket_block, bucket_warps = 2048, 8  # gaengine/kernels/bucket.py
    bucket_sig = {"dst_ptr": "*fp32", "tensor_table_ptr": "*i64", "block_table_ptr": "*i32", "scale_ptr": "*fp32",
                  "scale": "fp32", "partials_ptr": "*fp32", "partials_stride": "i64", "source_partials_ptr": "*fp32",
                  "source_partials_stride": "i64", "block_offset": "i64",
                  **{name: "constexpr" for name in ("SRC_DTYPE", "HAS_SCALE", "SCALE_IS_PTR", "WRITE_PARTIALS",
                                                    "WRITE_SOURCE_PARTIALS", "DST_ALIGNED", "SRC_ALIGNED",
                                                    "BLOCK_SIZE", "TAIL_SIZE")}}
    # Modes: a plain micro-batch; the last one's free norm (scaled, as gaengine.ops may); measuring the noise scale
    # (source partials every micro-batch, and with the free norm in the last one).
    bucket_modes = {"add": (False, False, False, False), "scaled-ptr-partials": (True, True, True, False),
                    "add-sources": (False, False, False, True), "partials-sources": (False, False, True, True)}
    for dt, tl_dtype in (("fp32", "tl.float32"), ("bf16", "tl.bfloat16"), ("fp16", "tl.float16")):
        for mode, (has_scale, scale_is_ptr, partials, sources) in bucket_modes.items():
            # The full-chunk path: the source and dst (read unless overwriting: one predicated load) in 128-bit
            # accesses; the tables, the scale and each tensor's masked last chunk take scalar accesses.
            cases.append(Case(
                f"bucket-{dt}-{mode}", "bucket", "_accumulate_bucket_kernel", bucket_sig,
                {"SRC_DTYPE": tl_dtype, "HAS_SCALE": has_scale, "SCALE_IS_PTR": scale_is_ptr,
                 "WRITE_PARTIALS": partials, "WRITE_SOURCE_PARTIALS": sources, "DST_ALIGNED": True,
                 "SRC_ALIGNED": True, "BLOCK_SIZE": bucket_block, "TAIL_SIZE": 256},
                ("dst_ptr", "tensor_table_ptr", "block_table_ptr", "scale_ptr", "partials_ptr", "source_partials_ptr"),
                bucket_warps,
                v4_loads=(_accesses(bucket_block, bucket_warps, SRC_BYTES[dt])
                          + _accesses(bucket_block, bucket_warps, 4)),
                v4_stores=_accesses(bucket_block, bucket_warps, 4),
            ))
    cases += _wgrad_cases()
    cases += _optimizer_cases()
    return cases


def _wgrad_cases() -> list[Case]:
    """The weight-gradient GEMM (every autotuned config on bf16; the first on fp16, fp32 and the scaled overwrite of
    micro-batch 0) and its bias kernel. Aligned: the pointers, the sizes a transformer's Linears have (multiples of
    16) and the row strides; the token count any. C's epilogue: one 128-bit load (adding) and store per 4 values."""
    from gaengine.kernels import wgrad  # noqa: PLC0415 - imports triton (a test that reads CASES has it)

    sig = {"dw_ptr": "*fp32", "dy_ptr": None, "x_ptr": None, "scale_ptr": "*fp32", "scale": "fp32", "M": "i32",
           "N": "i32", "K": "i32", "stride_dy": "i32", "stride_x": "i32",
           **{name: "constexpr" for name in ("DOT_DTYPE", "HAS_SCALE", "SCALE_IS_PTR", "OVERWRITE", "BLOCK_M",
                                             "BLOCK_N", "BLOCK_K", "GROUP_M")}}
    aligned = ("dw_ptr", "dy_ptr", "x_ptr", "M", "N", "stride_dy", "stride_x")
    variants = [(dt, i, "add") for i in range(len(wgrad.CONFIGS)) for dt in ("bf16",)]
    variants += [("fp16", 0, "add"), ("fp32", 0, "add"), ("bf16", 0, "overwrite-scaled-ptr")]
    cases = []
    for dt, i, mode in variants:
        config = wgrad.CONFIGS[i]
        overwrite = mode != "add"
        c_values = config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] // (32 * config.num_warps)
        cases.append(Case(
            f"wgrad-{dt}-config{i}-{mode}", "wgrad", "_wgrad_kernel",
            {**sig, "dy_ptr": TL_TYPES[dt], "x_ptr": TL_TYPES[dt]},
            {"DOT_DTYPE": {"fp32": "tl.float32", "bf16": "tl.bfloat16", "fp16": "tl.float16"}[dt],
             "HAS_SCALE": overwrite, "SCALE_IS_PTR": overwrite, "OVERWRITE": overwrite, **config.kwargs},
            aligned, config.num_warps, v4_loads=0 if overwrite else c_values // 4, v4_stores=c_values // 4,
            num_stages=config.num_stages, mma=dt != "fp32", occupancy=False,
        ))
    bias_sig = {"db_ptr": "*fp32", "dy_ptr": "*bf16", "scale_ptr": "*fp32", "scale": "fp32", "M": "i32", "K": "i32",
                "stride_dy": "i32", **{name: "constexpr" for name in ("HAS_SCALE", "SCALE_IS_PTR", "OVERWRITE",
                                                                      "BLOCK_OUT", "BLOCK_TOKENS")}}
    for mode, flags in (("add", (False, False, False)), ("overwrite-scaled-ptr", (True, True, True))):
        cases.append(Case(
            f"wgrad-bias-bf16-{mode}", "wgrad", "_bias_grad_kernel", bias_sig,
            {"HAS_SCALE": flags[0], "SCALE_IS_PTR": flags[1], "OVERWRITE": flags[2],
             "BLOCK_OUT": wgrad.BIAS_BLOCK_OUT, "BLOCK_TOKENS": wgrad.BIAS_BLOCK_TOKENS},
            ("db_ptr", "dy_ptr", "M", "stride_dy"), wgrad.BIAS_NUM_WARPS,
        ))
    return cases


# An update kernel holds each of its 3-5 streams' 8 values per thread, and AdamW's fp64 bias corrections: 36-64
# registers measured (triton 3.9), under the full-occupancy 32. The cap is half occupancy at 8 warps (4 blocks of
# 256 threads per SM): a kernel past it fails here; whether half occupancy reaches the copy bandwidth is the GPU
# bench's figure (bench_step.py's FusedAdamW row against add_, checked by gaengine/tools/bench/plausible.py).
OPTIMIZER_REGS = 64


def _optimizer_cases() -> list[Case]:
    """The fused optimizers' kernels (``gaengine/kernels/adamw.py``, ``lion.py``) as ``acc.step()`` launches them: a
    grad scale and found_inf on device, fp32 master weights written to a bf16 model, or bf16 | fp16 parameters
    updated in place. Every stream of the block in 128-bit vectors: ``BLOCK_SIZE`` elements over ``NUM_WARPS`` warps."""
    block, warps = 2048, 8  # gaengine/kernels/adamw.py, lion.py (checked by test_cases_match_the_launchers)
    head = {"adamw": ("param_ptr", "grad_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "model_ptr", "step_ptr"),
            "lion": ("param_ptr", "grad_ptr", "exp_avg_ptr", "model_ptr")}
    scalars = {"adamw": {"lr": "fp64", "log2_beta1": "fp64", "log2_beta2": "fp64", "decay_factor": "fp32",
                         "lerp_coeff": "fp32", "beta2": "fp32", "one_minus_beta2": "fp32", "eps": "fp32"},
               "lion": {"lr": "fp32", "beta1": "fp32", "one_minus_beta1": "fp32", "beta2": "fp32",
                        "one_minus_beta2": "fp32", "decay_factor": "fp32"}}
    flags = {"adamw": ("HAS_GRAD_SCALE", "HAS_FOUND_INF", "HAS_MODEL", "MODEL_BF16", "PARAM_BF16", "PARAM_FP16",
                       "MAXIMIZE", "DECAY", "LERP_SMALL", "BLOCK_SIZE"),
             "lion": ("HAS_GRAD_SCALE", "HAS_FOUND_INF", "HAS_MODEL", "MODEL_BF16", "PARAM_BF16", "PARAM_FP16",
                      "DECAY", "BLOCK_SIZE")}
    cases = []
    for name in ("adamw", "lion"):
        for dt in ("fp32", "bf16", "fp16"):  # fp32: masters written to a bf16 model; bf16 | fp16: in place
            states = [a for a in head[name] if a.startswith("exp_avg")]
            sig = {a: TL_TYPES[dt] for a in ("param_ptr", "grad_ptr", *states)}
            sig["model_ptr"] = "*bf16" if dt == "fp32" else TL_TYPES[dt]
            sig = {a: sig.get(a, "*fp32") for a in head[name]}  # step_ptr: fp32
            sig |= {"grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "n_elements": "i64", **scalars[name]}
            sig |= {f: "constexpr" for f in flags[name]}
            values = {f: False for f in flags[name]}
            values |= {"HAS_GRAD_SCALE": True, "HAS_FOUND_INF": True, "DECAY": True, "BLOCK_SIZE": block,
                       "HAS_MODEL": dt == "fp32", "MODEL_BF16": dt == "fp32", "PARAM_BF16": dt == "bf16",
                       "PARAM_FP16": dt == "fp16"}
            streams = 2 + len(states)  # param, grad and each state, read and (but the grad) written
            nbytes = SRC_BYTES[dt]
            stores = (streams - 1) * _accesses(block, warps, nbytes) + (_accesses(block, warps, 2) if dt == "fp32"
                                                                           else 0)
            cases.append(Case(
                f"{name}-{dt}", name, f"_{name}_kernel", sig, values,
                (*head[name], "grad_scale_ptr", "found_inf_ptr", "n_elements"), warps,
                v4_loads=streams * _accesses(block, warps, nbytes), v4_stores=stores, regs_cap=OPTIMIZER_REGS,
            ))
    return cases


def _all_cases() -> list[Case]:
    try:
        return _cases()
    except ImportError:  # no triton: the compiled fixture skips every test
        return []


CASES = _all_cases()

# --- the compiler side: runs in a subprocess without TRITON_INTERPRET ---------------------------------------------

_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")


def _access_bits(qualifiers: str) -> int:
    """Width in bits of one PTX global access from its qualifiers (``.v4.b32`` -> 128, ``.b16`` -> 16)."""
    vec = re.search(r"\.v(\d)\b", qualifiers)
    width = re.search(r"\.[bfsu](\d+)\b", qualifiers)
    return (int(vec.group(1)) if vec else 1) * (int(width.group(1)) if width else 0)


def _summarize(kernel, num_warps: int) -> dict:
    """What the tests read from one compiled kernel: its global accesses, registers and spills."""
    import triton  # noqa: PLC0415

    ptx = kernel.asm["ptx"]
    accesses = collections.Counter(f"{op}{_access_bits(q)}" for op, q in _ACCESS.findall(ptx))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        cuobjdump = triton.knobs.nvidia.cuobjdump.path
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    res = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return {
        "accesses": dict(accesses),
        "ptx_local": bool(re.search(r"^\s*\.local\b", ptx, re.M)),
        "regs": int(res["REG"]),
        "stack_bytes": int(res["STACK"]),
        "local_bytes": int(res["LOCAL"]),
        "shared_bytes": int(kernel.metadata.shared),
        "mma": len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\b", ptx)),
        "num_warps": num_warps,
    }


def _compile(case: Case, arch: int) -> dict:
    import importlib  # noqa: PLC0415

    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    fn = getattr(importlib.import_module(f"gaengine.kernels.{case.module}"), case.kernel)
    names = list(case.signature)
    constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
                  for k, v in case.constexprs.items()}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in case.aligned}
    src = ASTSource(fn=fn, signature=case.signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": case.num_warps}
    if case.num_stages is not None:
        options["num_stages"] = case.num_stages
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return _summarize(kernel, case.num_warps)


def _compile_all(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "AOT compilation needs TRITON_INTERPRET unset"
    results = {}
    for case in CASES:
        for arch_id, arch in ARCHS.items():
            try:
                results[f"{case.id}-{arch_id}"] = _compile(case, arch)
            except Exception as exc:  # reported by the test of this case, the others still run
                results[f"{case.id}-{arch_id}"] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


# --- the tests ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Summaries of every case for every arch, from one subprocess per session."""
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("aot") / "compiled.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"AOT compile subprocess failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _params(select=lambda c: True):
    return [pytest.param(case, arch_id, id=f"{case.id}-{arch_id}")
            for case in CASES if select(case) for arch_id in ARCHS]


def _get(compiled, case, arch_id) -> dict:
    result = compiled[f"{case.id}-{arch_id}"]
    assert "error" not in result, f"{case.id} did not compile for {arch_id}: {result.get('error')}"
    return result


@pytest.mark.parametrize("case, arch_id", _params(lambda c: c.v4_loads is not None or c.v4_stores is not None))
def test_global_accesses_are_128_bit_vectors(compiled, case, arch_id):
    r = _get(compiled, case, arch_id)
    acc = r["accesses"]
    v4_loads, v4_stores = acc.get("ld128", 0), acc.get("st128", 0)
    other_loads = sum(n for k, n in acc.items() if k.startswith("ld") and k != "ld128")
    if case.v4_loads is not None:
        assert v4_loads >= case.v4_loads, (
            f"{case.id} {arch_id}: {v4_loads} 128-bit loads per thread, expected {case.v4_loads} (accesses: {acc})")
    if case.v4_stores is not None:
        assert v4_stores >= case.v4_stores, (
            f"{case.id} {arch_id}: {v4_stores} 128-bit stores per thread, expected {case.v4_stores} (accesses: {acc})")
    if case.other_loads is not None:
        assert other_loads <= case.other_loads, (
            f"{case.id} {arch_id}: {other_loads} narrower global loads, at most {case.other_loads} allowed "
            f"(accesses: {acc})")


@pytest.mark.parametrize("case, arch_id", _params())
def test_nothing_spills(compiled, case, arch_id):
    r = _get(compiled, case, arch_id)
    # ptxas spills registers to the stack frame (STL/LDL in the SASS): a kernel with none has a 0-byte frame.
    assert r["stack_bytes"] == 0 and r["local_bytes"] == 0, (
        f"{case.id} {arch_id}: {r['stack_bytes']} B stack frame (register spills), {r['local_bytes']} B local memory")
    assert not r["ptx_local"], f"{case.id} {arch_id}: the PTX declares .local memory"


@pytest.mark.parametrize("case, arch_id", _params(lambda c: c.mma))
def test_gemm_runs_on_tensor_cores(compiled, case, arch_id):
    r = _get(compiled, case, arch_id)
    assert r["mma"] > 0, (
        f"{case.id} {arch_id}: no mma.sync / wgmma.mma_async in the PTX (the GEMM is not on tensor cores)")


@pytest.mark.parametrize("case, arch_id", _params(lambda c: c.occupancy and not c.single_program))
def test_registers_allow_full_occupancy(compiled, case, arch_id):
    r = _get(compiled, case, arch_id)
    if case.regs_cap is not None:
        assert r["regs"] <= case.regs_cap, f"{case.id} {arch_id}: {r['regs']} registers per thread, cap {case.regs_cap}"
        return
    bound = full_occupancy_registers(r["num_warps"])
    assert r["regs"] <= bound, (
        f"{case.id} {arch_id}: {r['regs']} registers per thread; full occupancy at {r['num_warps']} warps "
        f"allows {bound} ({REGS_PER_SM} / ({32 * r['num_warps']} threads x "
        f"{min(MAX_BLOCKS_PER_SM, MAX_THREADS_PER_SM // (32 * r['num_warps']))} blocks))")


def test_full_occupancy_register_bound():
    assert [full_occupancy_registers(w) for w in (1, 2, 4, 8, 16, 32)] == [64, 32, 32, 32, 32, 32]


def test_cases_match_the_launchers():
    pytest.importorskip("triton")
    from gaengine.kernels import accumulate, adamw, bucket, lion, norm, scale, wgrad  # noqa: PLC0415

    for case in CASES:
        module = {"accumulate": accumulate, "norm": norm, "scale": scale, "bucket": bucket, "wgrad": wgrad,
                  "adamw": adamw, "lion": lion}[case.module]
        assert hasattr(module, case.kernel), f"{case.module}.{case.kernel} is gone"
        fn = getattr(module, case.kernel)
        arg_names = getattr(fn, "arg_names", None) or list(fn.fn.__code__.co_varnames[:fn.fn.__code__.co_argcount])
        assert list(case.signature) == list(arg_names), f"{case.id}: signature out of date: {arg_names}"
        if case.module == "wgrad":
            continue  # built from wgrad.CONFIGS and its BIAS_* constants directly
        if "BLOCK_SIZE" in case.constexprs and case.kernel != "_l2norm_sq_finalize_kernel":
            assert case.constexprs["BLOCK_SIZE"] == module.BLOCK_SIZE, f"{case.id}: BLOCK_SIZE out of date"
            assert case.num_warps == module.NUM_WARPS, f"{case.id}: num_warps out of date"
    assert norm.FINALIZE_BLOCK_SIZE == 1024 and norm.FINALIZE_NUM_WARPS == 4
    assert bucket.TAIL_SIZE == 256


if __name__ == "__main__":
    _compile_all(sys.argv[1])
