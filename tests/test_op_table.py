"""The operation table (``gaengine.backends.OPS``): every backend available here has every op as its own code (each
op's numbers on every backend, against the fp64 oracle: ``tests/ops/``, one file per op); the ``torch.library`` ops
of ``gaengine._C`` (``torch.ops.gaengine.*``: dispatch by device, fake implementations, ``torch.compile``); and no
module outside ``gaengine/backends.py`` branching on a backend's name.

Backends: ``torch`` (the reference), ``cpu`` (``gaengine._C``), ``triton`` (CPU tensors under ``TRITON_INTERPRET=1``,
set by ``conftest.py``), ``cuda-emu`` (the cuda backend over ``tests/cuda_emu/engine.py``'s emulated build, CUDA
kernels executed on CPU tensors) and ``cuda-gpu``: ``tests/conftest.py``'s list.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch

from gaengine import backends
from gaengine.backends import OPS, Backend, ReferenceBackend, get_backend
from gaengine.optim import adamw_step_reference
from tests.conftest import backend_name, backend_params
from tests.reference import sum_sq_fp64
from tests.tolerances import adamw_param_rtol, assert_bitwise_equal, rel_diff, sum_sq_rtol

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _op_namespace() -> str | None:
    """``torch.ops``' namespace of gaengine._C's ops ("gaengine"), or None when the extension is not built."""
    try:
        from gaengine import _C  # noqa: PLC0415
    except ImportError:
        return None
    return _C.OP_NAMESPACE


@pytest.fixture(params=backend_params())
def backend(request, monkeypatch) -> Backend:
    """Each backend of ``tests/conftest.py``'s list as its ``Backend`` (``DEVICE``'s; the emulated cuda one on CPU
    tensors), skipped where it cannot load."""
    if request.param == "cuda-emu":
        emu_engine, module = request.getfixturevalue("emulated_cuda_module")
        emu_engine.use(monkeypatch, module)
        return get_backend("cuda", "cpu")
    try:
        return get_backend(backend_name(request.param), DEVICE)
    except RuntimeError as exc:
        pytest.skip(f"backend {request.param!r} unavailable: {exc}")


def _function(obj, op: str):
    f = getattr(obj, op)
    return getattr(f, "__func__", f)


def test_the_interface_is_abstract_and_is_the_operation_table():
    """``Backend`` (gaengine.contract) is the contract alone: it cannot be instantiated, and its abstract methods are
    exactly the operation table."""
    assert set(Backend.__abstractmethods__) == set(OPS)
    with pytest.raises(TypeError, match="abstract"):
        Backend()


def test_every_backend_runs_its_own_kernel_for_every_op(backend):
    """Each op of a backend is its own code, not the torch reference's (a subclass of ``ReferenceBackend`` would
    silently inherit it). The reference itself (``torch``) is the yardstick, not checked."""
    assert isinstance(backend, Backend)
    if backend.name == "torch":
        pytest.skip("the reference: every op is its own by definition")
    assert not isinstance(backend, ReferenceBackend)
    for op in OPS:
        assert _function(backend, op) is not _function(ReferenceBackend, op), f"{backend.name}.{op}"


# ------------------------------------------------------------ the inputs of test_ops_dispatch_on_cpu_tensors
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NUMELS = (1, 127, 0, 4097, 65)  # one element, a partial vector, an empty source, one past a block, an odd tail


def _bucket(dtype: torch.dtype, seed: int = 0):
    """dst (gaps between slices NaN: never read or written), sources, offsets at multiples of 64 and per-source
    overwrite flags (an overwritten slice starts NaN: it must not be read)."""
    g = torch.Generator().manual_seed(seed)
    offsets, total = [], 0
    for n in NUMELS:
        offsets.append(total)
        total += -(-n // 64) * 64 + 64
    srcs = [torch.randn(n, generator=g).to(dtype) for n in NUMELS]
    overwrite = [j % 2 == 0 for j in range(len(NUMELS))]
    dst = torch.full((total,), float("nan"))
    for src, o, ow in zip(srcs, offsets, overwrite):
        if not ow:
            dst[o:o + src.numel()] = torch.randn(src.numel(), generator=g)
    return dst, srcs, offsets, overwrite


def _adamw_state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sizes = (1, 127, 4097)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g).to(dt) for n, dt in zip(sizes, DTYPES.values())]
    return params, grads


# ----------------------------------------------------------------------------------------- torch.ops.gaengine.*
NAMESPACE = _op_namespace()
ops = getattr(torch.ops, NAMESPACE) if NAMESPACE is not None else None
needs_ops = pytest.mark.skipif(ops is None, reason="gaengine._C is not built")


@needs_ops
def test_ops_dispatch_on_cpu_tensors():
    dst, src = torch.randn(4097), torch.randn(4097).bfloat16()
    expected = dst.clone().add_(src)
    ops.accumulate_(dst, src, 1.0, False)
    assert_bitwise_equal(dst, expected, "accumulate_")
    sum_sq, found_inf = ops.l2norm_sq(dst)
    assert abs(sum_sq.item() - sum_sq_fp64(dst)) <= sum_sq_rtol(dst.numel()) * sum_sq_fp64(dst)
    assert found_inf.item() == 0.0
    ops.scale_(dst, torch.tensor(0.5))
    assert_bitwise_equal(dst, expected * 0.5, "scale_")
    bucket, srcs, offsets, overwrite = _bucket(torch.float16)
    want = bucket.clone()
    get_backend("torch").accumulate_bucket_(want, srcs, offsets, overwrite)
    partials = torch.empty(len(srcs), 2, dtype=torch.float64)
    ops.accumulate_bucket_(bucket, srcs, offsets, overwrite, partials)
    assert_bitwise_equal(bucket, want, "accumulate_bucket_")
    params, grads = _adamw_state()
    ours = [p.clone() for p in params]
    args = lambda ps: (ps, [g.clone() for g in grads], [torch.zeros_like(p) for p in ps],  # noqa: E731
                       [torch.zeros_like(p) for p in ps], [torch.zeros(()) for _ in ps], [None] * len(ps),
                       1e-2, 0.9, 0.999, 1e-8, 0.1, False, None, None)
    ops.adamw_step_(*args(ours))
    adamw_step_reference(*args(params))
    for a, b in zip(ours, params):  # one AdamW update from the same gradients, each rounding in its own way
        assert rel_diff(a, b) <= adamw_param_rtol(b, 1e-2, 1, 0.0)


TORCH_OPS = ("accumulate_", "l2norm_sq", "scale_", "accumulate_bucket_", "adamw_step_", "optimizer_step_")


@needs_ops
def test_ops_have_cpu_kernels():
    assert NAMESPACE == "gaengine"
    for op in TORCH_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gaengine::{op}", "CPU"), op


def test_emulated_build_registers_the_cuda_kernels_under_its_own_namespace(emulated_cuda_module):
    """csrc/cuda/cuda_ops.cu's kernels in the emulated build: registered under the module's own name and the CPU key
    (its CPU tensors stand in for CUDA ones, so torch.ops.<namespace>.* runs them), with no CUDA key; the CUDA
    partials layout's own ops beside them."""
    emulated_module = emulated_cuda_module[1]
    namespace = emulated_module.OP_NAMESPACE
    assert namespace == emulated_module.__name__.rpartition(".")[2] and namespace.startswith("gaengine_emu_C")
    assert emulated_module.WITH_CUDA
    for op in TORCH_OPS + ("sum_partials",):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{op}", "CPU"), op
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{op}", "CUDA"), op
    assert getattr(torch.ops, namespace).bucket_num_chunks([4096, 4097, 0]) == 3


@needs_ops
def test_fake_implementations_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    with FakeTensorMode():
        x = torch.empty(4097, dtype=torch.bfloat16)
        sum_sq, found_inf = ops.l2norm_sq(x)
        assert sum_sq.shape == () and sum_sq.dtype == torch.float32 and found_inf.dtype == torch.float32
        dst = torch.empty(4097)
        assert ops.accumulate_(dst, x, 1.0, True) is None
        assert ops.scale_(dst, torch.tensor(2.0)) is None
        assert ops.accumulate_bucket_(dst, [x], [0], [True], None) is None
        p = torch.empty(3)
        assert ops.adamw_step_([p], [p], [p.clone()], [p.clone()], [torch.empty(())], [None], 1e-3, 0.9, 0.999,
                               1e-8, 0.0, False, None, None) is None
        assert ops.optimizer_step_("lion", [p], [p], [p.clone()], [], [None], [1e-4, 0.9, 0.99, 0.0], None,
                                   None) is None


@needs_ops
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_torch_compile_traces_the_ops(compiler):
    def accumulate_and_norm(dst, src):
        ops.accumulate_(dst, src, 1.0, False)
        return ops.l2norm_sq(dst)

    torch._dynamo.reset()
    compiled = torch.compile(accumulate_and_norm, backend=compiler, fullgraph=True)
    src = torch.randn(4097).bfloat16()
    dst_eager = torch.randn(4097)
    dst_compiled = dst_eager.clone()
    try:
        got = compiled(dst_compiled, src)
    except Exception as exc:  # noqa: BLE001 - inductor needs a working C++ toolchain; aot_eager must trace
        if compiler == "inductor" and "CppCompileError" in type(exc).__name__:
            pytest.skip(f"inductor cannot compile here: {type(exc).__name__}")
        raise
    want = accumulate_and_norm(dst_eager, src)
    assert_bitwise_equal(dst_compiled, dst_eager, "dst")
    assert_bitwise_equal(got[0], want[0], "sum_sq")
    assert_bitwise_equal(got[1], want[1], "found_inf")


# --------------------------------------------------------------------------------------- nothing branches on names
def test_no_module_outside_backends_compares_a_backend_name():
    """``backend.name`` (or ``.backend.name``) is never compared outside ``gaengine/backends.py``: the engine asks the
    backend (its ops, ``hot_path_kernels``, ``partials_dim``), not its name."""
    offenders = []
    for folder in ("gaengine",):  # gaengine/kernels/ (the Triton kernels) included
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for file in files:
                path = os.path.join(dirpath, file)
                if not file.endswith(".py") or os.path.samefile(path, backends.__file__):
                    continue
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if not isinstance(node, ast.Compare):
                        continue
                    for side in (node.left, *node.comparators):
                        if (isinstance(side, ast.Attribute) and side.attr == "name"
                                and "backend" in ast.unparse(side.value).lower()):
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_the_adamw_kernels_are_the_optimizers_not_a_backend_op():
    """The AdamW step is not an op of the table: no backend has it as an op, and ``gaengine.optim.adamw_kernel`` is
    the AdamW kernel the backend ``get_backend`` chooses gives (``Backend.optimizer_step(FusedAdamW.STEP)``)."""
    from gaengine.optim import FusedAdamW, adamw_kernel  # noqa: PLC0415

    assert "adamw_step_" not in OPS and not hasattr(Backend, "adamw_step_")
    for name in ("auto", "torch", "cpu"):
        kernel, chosen = adamw_kernel(name, "cpu"), get_backend(name, "cpu")
        assert kernel.backend == chosen.name
        assert kernel.where == chosen.optimizer_step(FusedAdamW.STEP)[1]
        assert not hasattr(chosen, "adamw_step_")
    assert adamw_kernel("torch", "cpu").step is adamw_step_reference
    with pytest.raises(ValueError, match="backend must be one of"):
        adamw_kernel("fast", "cpu")
