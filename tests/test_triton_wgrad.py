"""The Triton weight-gradient kernel of gradient accumulation fusion (``gaengine/kernels/wgrad.py``): ``dw (+)= scale *
dY^T @ X`` and ``db (+)= scale * dY.sum(0)`` into fp32 main_grad, against an fp64 torch oracle.

Without a GPU it runs on CPU tensors under ``TRITON_INTERPRET=1`` (conftest.py); small shapes, not multiples of any
tile, so that every program has a ragged edge somewhere. Budget (``tests/tolerances.py``): each element within
``dot_rtol(tokens + 2)`` of ``|scale| * sum |dY| |X| + |old|`` (the token sum, the scale and the epilogue's add).
"""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import dot_rtol, triton_device

DEVICE = triton_device()  # skips this module without triton, or without a GPU and the interpreter

from gaengine.kernels import wgrad  # noqa: E402

pytestmark = pytest.mark.interpreter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE = float(torch.tensor(0.3, dtype=torch.float32))  # exact in fp32, not a power of two: the product rounds
# (out, in, tokens): under one 64-tile, across 64- and 128-tiles with ragged edges, a token step not a multiple of 32
SHAPES = [(5, 3, 1), (130, 67, 150)]


def _operands(out_features, in_features, tokens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(tokens, out_features, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype).to(DEVICE)
    old_w = (torch.randn(out_features, in_features, generator=gen) * 4).to(DEVICE)
    old_b = (torch.randn(out_features, generator=gen) * 4).to(DEVICE)
    return g, x, old_w, old_b


def _assert_within_bound(result, g, x, old, scale, overwrite, bias=False):
    """|result - exact| <= dot_rtol(tokens + 2) * (|scale| sum |dY||X| + |old|), all in fp64."""
    g64, x64 = g.double().cpu(), x.double().cpu()
    products = g64.sum(0) if bias else g64.t() @ x64
    magnitude = g64.abs().sum(0) if bias else g64.abs().t() @ x64.abs()
    base = torch.zeros_like(products) if overwrite else old.double().cpu()
    exact = base + float(scale) * products
    bound = dot_rtol(g.shape[0] + 2) * (abs(float(scale)) * magnitude + base.abs())
    err = (result.double().cpu() - exact).abs()
    assert bool(torch.isfinite(result).all()), "a write read the poisoned old values"
    worst = err.argmax()
    assert bool((err <= bound).all()), (f"max error {err.flatten()[worst].item():.3e}, bound there "
                                        f"{bound.flatten()[worst].item():.3e}")


@pytest.mark.parametrize("config", [0, 4], ids=["config0", "config4"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("scale", [1.0, SCALE], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}-t{t}" for o, i, t in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_against_fp64(dtype, shape, scale, overwrite, config):
    g, x, old_w, old_b = _operands(*shape, dtype)
    dw, db = old_w.clone(), old_b.clone()
    if overwrite:  # a write must not read them
        dw.fill_(float("nan")), db.fill_(float("nan"))
    wgrad.wgrad_accumulate_(dw, db, g, x, overwrite, overwrite, scale, config=wgrad.CONFIGS[config])
    _assert_within_bound(dw, g, x, old_w, scale, overwrite)
    _assert_within_bound(db, g, x, old_b, scale, overwrite, bias=True)


def test_a_tensor_scale_is_read_in_the_kernel_and_equals_the_float():
    g, x, old_w, old_b = _operands(70, 40, 33, torch.bfloat16)
    by_float = (old_w.clone(), old_b.clone())
    by_tensor = (old_w.clone(), old_b.clone())
    wgrad.wgrad_accumulate_(*by_float, g, x, False, False, SCALE)
    wgrad.wgrad_accumulate_(*by_tensor, g, x, False, False, torch.tensor(SCALE, device=DEVICE))
    assert torch.equal(by_float[0], by_tensor[0]) and torch.equal(by_float[1], by_tensor[1])


def test_window_of_micro_batches_writes_then_adds():
    """Three micro-batches of a window (write, add, add) against the fp64 sum of the three dY^T X."""
    parts = [_operands(33, 20, 17, torch.bfloat16, seed=s)[:2] for s in range(3)]
    dw = torch.full((33, 20), float("nan"), device=DEVICE)
    db = torch.full((33,), float("nan"), device=DEVICE)
    for k, (g, x) in enumerate(parts):
        wgrad.wgrad_accumulate_(dw, db, g, x, k == 0, k == 0)
    g_all, x_all = torch.cat([g for g, _ in parts]), torch.cat([x for _, x in parts])
    _assert_within_bound(dw, g_all, x_all, None, 1.0, True)
    _assert_within_bound(db, g_all, x_all, None, 1.0, True, bias=True)


def test_strided_rows_mixed_dtypes_and_one_of_the_two():
    """grad_output as a column slice of a wider tensor (row stride != out: read in place); an fp32 input with a bf16
    grad_output (multiplied in fp32); the weight alone, then the bias alone."""
    g_wide, x, old_w, old_b = _operands(50, 24, 40, torch.bfloat16)
    g = g_wide[:, 7:30]
    old_w, old_b = old_w[:23].contiguous(), old_b[:23].contiguous()
    x32 = x.float()
    dw = old_w.clone()
    wgrad.wgrad_accumulate_(dw, None, g, x32, False, False)
    _assert_within_bound(dw, g, x32, old_w, 1.0, False)
    db = old_b.clone()
    wgrad.wgrad_accumulate_(None, db, g, x32, False, False, SCALE)
    _assert_within_bound(db, g, x32, old_b, SCALE, False, bias=True)


def test_no_tokens_writes_zeros_or_keeps_the_sum():
    g, x = torch.empty(0, 6, device=DEVICE), torch.empty(0, 4, device=DEVICE)
    dw, db = torch.full((6, 4), float("nan"), device=DEVICE), torch.full((6,), float("nan"), device=DEVICE)
    wgrad.wgrad_accumulate_(dw, db, g, x, True, True)
    assert not dw.any() and not db.any()
    kept_w, kept_b = torch.randn(6, 4, device=DEVICE), torch.randn(6, device=DEVICE)
    dw, db = kept_w.clone(), kept_b.clone()
    wgrad.wgrad_accumulate_(dw, db, g, x, False, False)
    assert torch.equal(dw, kept_w) and torch.equal(db, kept_b)


@pytest.mark.parametrize("change, match", [
    (dict(dw=torch.zeros(3, 5, dtype=torch.bfloat16)), "dw must be float32"),
    (dict(dw=torch.zeros(5, 3)), r"dw must be a float32 tensor of shape \(3, 5\)"),
    (dict(db=torch.zeros(4)), r"db must be a float32 tensor of shape \(3,\)"),
    (dict(grad_output=torch.zeros(4, 3, dtype=torch.int32)), "grad_output must be a 2-d float32, bfloat16 or "
                                                             "float16 tensor"),
    (dict(input=torch.zeros(2, 4, 5)), "input must be a 2-d"),
    (dict(input=torch.zeros(6, 5)), "same rows"),
], ids=["dw-dtype", "dw-shape", "db-shape", "grad-dtype", "input-3d", "rows"])
def test_bad_arguments_raise_before_anything_is_written(change, match):
    args = dict(dw=torch.ones(3, 5), db=torch.ones(3), grad_output=torch.ones(4, 3), input=torch.ones(4, 5))
    args.update(change)
    args = {k: v.to(DEVICE) for k, v in args.items()}
    before = {k: v.clone() for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        wgrad.wgrad_accumulate_(args["dw"], args["db"], args["grad_output"], args["input"], False, False)
    assert all(torch.equal(args[k], before[k]) for k in args)


# --- behind the op: torch.ops.<namespace>.wgrad_accumulate_ and the fused engine ---------------------------------
_KEPT: list = []
SCHEMA = ("wgrad_accumulate_(Tensor(a!)? dw, Tensor(b!)? db, Tensor grad_output, Tensor input, bool overwrite_w, "
          "bool overwrite_b) -> ()")  # csrc/wgrad.h's kWgradAccumulateSchema


def test_register_triton_wgrad_fills_a_key_without_a_kernel_only():
    """On an op with no kernel for the key (as gaengine._C's wgrad_accumulate_ has none for CUDA), the Triton kernel
    becomes it; a key with a compiled kernel keeps it."""
    from gaengine import fusion  # noqa: PLC0415

    key = "CUDA" if DEVICE.type == "cuda" else "CPU"
    definition = torch.library.Library("gaengine_wgrad_test", "DEF")
    definition.define(SCHEMA)
    _KEPT.append(definition)  # alive as long as the registration made on it (fusion._TRITON_LIBRARIES)
    assert fusion.register_triton_wgrad("gaengine_wgrad_test", key)
    assert fusion.register_triton_wgrad("gaengine_wgrad_test", key)  # a second call does nothing
    g, x, old_w, old_b = _operands(40, 9, 21, torch.bfloat16)
    dw, db = old_w.clone(), old_b.clone()
    torch.ops.gaengine_wgrad_test.wgrad_accumulate_(dw, db, g, x, False, False)
    _assert_within_bound(dw, g, x, old_w, 1.0, False)
    _assert_within_bound(db, g, x, old_b, 1.0, False, bias=True)
    _C = pytest.importorskip("gaengine._C", reason="gaengine._C is not built")
    assert fusion.register_triton_wgrad(_C.OP_NAMESPACE, "CPU")  # the C++ kernel is there
    assert (_C.OP_NAMESPACE, "CPU") not in fusion._TRITON_LIBRARIES


def _engine_child() -> None:
    """In a process of its own (the swap cannot be undone: a destroyed override leaves the dispatcher's entry
    dangling): gaengine._C's CPU kernel of wgrad_accumulate_ swapped for the interpreted Triton one, a fused and an
    unfused window; prints what test_the_fused_engine_on_the_triton_kernel checks, as JSON."""
    import json  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    import gaengine  # noqa: PLC0415
    from gaengine import _C, fusion  # noqa: PLC0415
    from tests.tolerances import rel_diff  # noqa: PLC0415

    calls = []
    launcher = wgrad.wgrad_accumulate_
    wgrad.wgrad_accumulate_ = lambda *a, **k: (calls.append(a[4]), launcher(*a, **k))[1]

    def window(fuse):
        torch.manual_seed(1)
        lin = torch.nn.Linear(96, 64).bfloat16()
        xs = [torch.randn(16, 96).bfloat16() for _ in range(8)]
        gs = [torch.randn(16, 64).bfloat16() for _ in range(8)]
        acc = gaengine.GradientAccumulator(lin, None, backend="cpu", accumulation_steps=8, max_grad_norm=None,
                                           gradient_accumulation_fusion=fuse)
        for x, g in zip(xs, gs):
            acc.backward((lin(x).float() * g.float()).sum())  # dY = g exactly
        views = dict(zip((id(p) for p in acc.params), acc.main_grad.views))
        w, b = views[id(lin.weight)].clone(), views[id(lin.bias)].clone()
        acc.zero_grad()
        acc.close()
        return (rel_diff(w, sum(g.double().t() @ x.double() for x, g in zip(xs, gs))),
                rel_diff(b, sum(g.double().sum(0) for g in gs)))

    (plain_w, _) = window(False)
    library = torch.library.Library(_C.OP_NAMESPACE, "IMPL")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library.impl("wgrad_accumulate_", fusion._triton_wgrad_accumulate_, "CPU")
    fused_w, fused_b = window(True)
    print(json.dumps({"fused_w": fused_w, "fused_b": fused_b, "plain_w": plain_w, "calls": calls,
                      "overridden": any("Overriding" in str(w.message) for w in caught)}))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="swaps the CPU kernel of gaengine._C for the interpreted one")
def test_the_fused_engine_on_the_triton_kernel():
    """The whole fused path (fused_linear's C++ backward -> HotPath -> the dispatcher) reaching the Triton kernel, as
    it does for CUDA parameters: here, in a child process, the CPU key's kernel is swapped for it under the
    interpreter. A bf16 Linear(96, 64) over a window of K = 8: within fp32 rounding (``dot_rtol``) of the fp64 sum
    of dY^T X and 50x closer
    than the unfused path (which rounds each micro-batch's dW to bf16); every micro-batch ran the Triton kernel once,
    the first writing."""
    pytest.importorskip("gaengine._C", reason="gaengine._C is not built")
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", "from tests.test_triton_wgrad import _engine_child; _engine_child()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["overridden"]
    assert r["calls"] == [True] + [False] * 7  # micro-batch 0 writes, the rest add
    # 8 micro-batches of 16 rows of exact bf16 products summed in fp32, relative to the largest element: dot_rtol
    # with the random-sign condition sqrt(rows) (tests/test_fusion.py _fp32_sum_rtol)
    rows = 8 * 16
    bound = dot_rtol(rows) * rows**0.5
    assert r["fused_w"] <= bound and r["fused_b"] <= bound, (r, bound)
    assert r["plain_w"] >= 50 * r["fused_w"], r
