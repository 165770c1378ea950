"""The native hot path (``csrc/hot_path.cpp``, ``gaengine/hot_path.py``): no Python per parameter, one launch per bucket.

* During ``acc.backward()`` the number of Python calls into gaengine does not grow with the number of
  parameters (counted with ``sys.setprofile``; autograd runs CPU hooks on the calling thread, so a Python hook
  would be seen). The Python hooks of the test oracle (``tests/oracle_hooks.py``) are measured the same way: their
  count grows, which shows that the counter sees per-parameter hooks.
* Launches per micro-batch are at most buckets + 1.
* (The CPU bucket launch's numbers and contracts, ``torch.ops.gaengine.accumulate_bucket_``: the op's own file,
  ``tests/ops/test_accumulate_bucket.py``.)
* The native hooks and the Python oracle give bitwise-equal buffers and updates over windows, with unused
  parameters, tied weights and several buckets.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

import gaengine
from tests.conftest import backend_params
from tests.oracle_hooks import use_hooks
from tests.tolerances import assert_bitwise_equal, sum_sq_rtol
from tests.models import Chain, TiedChain, TwoStreams as _TwoStreams

_C = pytest.importorskip("gaengine._C")
GAENGINE_DIR = os.path.dirname(os.path.abspath(gaengine.__file__))


def _loss(model, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (model(torch.randn(4, 16, generator=g).to(dtype)).float() ** 2).mean()


def _gaengine_calls_in_backward(acc, loss) -> int:
    """Python function calls whose code lives in the gaengine package, during ``acc.backward(loss)``."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(GAENGINE_DIR):
            calls += 1

    sys.setprofile(profile)
    try:
        acc.backward(loss)
    finally:
        sys.setprofile(None)
    return calls


def _calls_for(n_params: int, hot_path: str, monkeypatch) -> int:
    use_hooks(monkeypatch, hot_path)
    torch.manual_seed(0)
    model = Chain(n_params)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4,
                                       backend="cpu", bucket_size_mb=1e-4)
    assert acc.hooks.native == (hot_path == "native")
    _gaengine_calls_in_backward(acc, _loss(model, 0))  # warm-up: first-use imports are not the hot path
    counts = [_gaengine_calls_in_backward(acc, _loss(model, k)) for k in (1, 2)]
    acc.close()
    assert counts[0] == counts[1]
    return counts[0]


def test_no_python_per_parameter_in_backward(monkeypatch):
    few, many = _calls_for(8, "native", monkeypatch), _calls_for(64, "native", monkeypatch)
    assert few == many, f"Python calls into gaengine grow with the parameters: {few} for 8, {many} for 64"
    # The same count on the Python hooks grows by at least one call per parameter: the counter sees hooks.
    py_few, py_many = _calls_for(8, "python", monkeypatch), _calls_for(64, "python", monkeypatch)
    assert py_many - py_few >= 56


@pytest.mark.parametrize("bucket_size_mb", [1e-4, 1e-3, 25.0], ids=["one-param-buckets", "small-buckets", "one-bucket"])
def test_launches_per_micro_batch_at_most_buckets_plus_one(bucket_size_mb):
    model = Chain(40, torch.bfloat16)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3,
                                       backend="cpu", bucket_size_mb=bucket_size_mb)
    assert acc.hooks.native
    n_buckets = acc.hooks.num_buckets
    for k in range(6):
        before = acc.hooks.launches
        acc.backward(_loss(model, k, torch.bfloat16))
        launched = acc.hooks.launches - before
        assert 1 <= launched <= n_buckets + 1, f"{launched} launches for {n_buckets} buckets"
        acc.step()
    acc.close()


def _run(hot_path: str, monkeypatch, dtype=torch.bfloat16, bucket_size_mb=1e-3, windows=3, k=3):
    """A model with an unused branch and a tied weight, trained over ``windows`` windows; returns its state."""
    use_hooks(monkeypatch, hot_path)
    torch.manual_seed(0)

    model = TiedChain().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=k, max_grad_norm=0.5, backend="cpu",
                                       bucket_size_mb=bucket_size_mb)
    norms = []
    for w in range(windows):
        for m in range(k):
            acc.backward(_loss(model, 10 * w + m, dtype))
        norms.append(acc.step().grad_norm)
    acc.close()
    return [p.detach().clone() for p in model.parameters()], torch.stack(norms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_equals_python_hooks(dtype, monkeypatch):
    native, native_norms = _run("native", monkeypatch, dtype)
    python, python_norms = _run("python", monkeypatch, dtype)
    assert_bitwise_equal(native_norms, python_norms, "grad norms")
    for a, b in zip(native, python):
        assert torch.equal(a, b)


def test_close_removes_the_hooks():
    model = Chain(4)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, backend="cpu")
    assert acc.hooks.native
    acc.close()
    _loss(model, 0).backward()  # a plain backward again: .grad is autograd's
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
    _loss(ref, 0).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("bucket_size_mb", [1e-4, 25.0], ids=["bucket-per-param", "one-bucket"])
def test_gradients_from_two_streams_equal_one_op_per_parameter(bucket_size_mb, monkeypatch):
    """The native hooks' bucket launch waits on the stream of every gradient it reads and records its own stream on
    them (csrc/hot_path.cpp), against backend='torch' (one ATen op per gradient, ordered by autograd itself)."""
    results = {}
    for backend in ("auto", "torch"):
        # The reference: backend 'torch' on the Python oracle (one ATen op per gradient, launched from Python).
        use_hooks(monkeypatch, "native" if backend == "auto" else "python")
        torch.manual_seed(0)
        model = _TwoStreams().cuda().to(torch.bfloat16)
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=4, max_grad_norm=None, backend=backend,
                                           bucket_size_mb=bucket_size_mb)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):
            acc.backward(model(torch.randn(64, 256, device="cuda", generator=g, dtype=torch.bfloat16)))
            torch.cuda.empty_cache()  # freed gradients go back to the allocator at once
        results[backend] = acc.main_grad.data.clone()
        acc.close()
    assert_bitwise_equal(results["auto"], results["torch"], "main_grad")


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_window_of_empty_parameters_has_norm_zero(hot_path, monkeypatch):
    """Every parameter empty: the free-norm partials have no column (no uninitialised one read as the norm)."""
    use_hooks(monkeypatch, hot_path)
    params = [nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0, 3))]
    acc = gaengine.GradientAccumulator(params, None, accumulation_steps=2, max_grad_norm=1.0)
    for _ in range(2):
        acc.backward(sum(p.sum() for p in params) + torch.zeros((), requires_grad=True))
    result = acc.step()
    assert float(result.grad_norm) == 0.0 and not bool(result.skipped) and float(result.clip_coef) == 1.0


# ------------------------------------------------------------------------------------------------ source norms
@pytest.mark.parametrize("backend", backend_params("cpu", "cuda-emu"), indirect=True)
def test_source_rows_count_zero_without_gradient(backend, monkeypatch):
    """Native hooks measuring sources, on a model whose ``extra`` and ``nested`` parameters get no gradient: their
    buckets are launched incomplete at ``end()`` (one bucket) or not at all (a bucket per parameter), and their part
    of each micro-batch's table is zeroed, so every row equals the fp64 plain recipe's (tests/test_source_norms.py
    for the reference). On the cpu backend and on the emulated cuda backend (``tests/cuda_emu``: the CUDA kernels'
    per-chunk tables on CPU tensors; tests/test_source_norms.py runs its own cases there too)."""
    from tests.helpers import hooks_backward, source_norm_hooks  # noqa: PLC0415
    from tests.models import SharedCheckpointed, shared_batches  # noqa: PLC0415

    backend = gaengine.backends.get_backend(backend, "cpu")
    torch.manual_seed(0)
    model = SharedCheckpointed()
    batches = shared_batches(3, torch.float32)
    want = []
    for x in batches:
        expected = copy.deepcopy(model)
        expected(x, extra=False, twice=False).backward()
        want.append(sum(float(p.grad.double().square().sum()) for p in expected.parameters() if p.grad is not None))
    n_params = sum(p.numel() for p in model.parameters())
    for bucket_size_mb in (1e-6, 25.0):
        hooks = source_norm_hooks(model, backend, "native", bucket_size_mb, True, monkeypatch)
        try:
            hooks_backward(hooks, model(batches[0]), False)  # every parameter: the tables' memory holds gradients
            hooks.reset_window()
            for j, x in enumerate(batches):
                hooks_backward(hooks, model(x, extra=False, twice=False), j == len(batches) - 1)
            rows = hooks.window_source_sumsq().tolist()
            assert len(rows) == len(batches)
            for got, exact in zip(rows, want):
                assert abs(got - exact) <= sum_sq_rtol(n_params) * exact, (bucket_size_mb, rows, want)
        finally:
            hooks.close()


# ------------------------------------------------------------------- every backend behind the one hot path
def test_the_torch_backend_runs_in_the_native_hot_path_one_call_per_bucket(monkeypatch):
    """backend="torch" takes the native hooks: HotPath calls the reference's accumulate_bucket_ (registered as
    torch.ops.<namespace>_torch.accumulate_bucket_) once per complete bucket, never per parameter, and the window
    equals the plain recipe's summed .grad bitwise (fp32, unscaled: one IEEE add per micro-batch in both)."""
    from gaengine.backends import ReferenceBackend

    use_hooks(monkeypatch, "native")
    calls = []
    original = ReferenceBackend.accumulate_bucket_
    monkeypatch.setattr(ReferenceBackend, "accumulate_bucket_",
                        lambda self, dst, srcs, *a, **k: (calls.append(len(srcs)), original(self, dst, srcs, *a, **k)))
    torch.manual_seed(0)
    model = Chain(6)
    plain = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, backend="torch", accumulation_steps=3, max_grad_norm=None,
                                       bucket_size_mb=1e-3)  # several buckets of several parameters
    assert acc.hooks.native
    for k in range(3):
        acc.backward(_loss(model, k))
        _loss(plain, k).backward()
    buckets = acc.hooks.num_buckets
    assert 1 < buckets < 6 and len(calls) == 3 * buckets and sum(calls) == 3 * 6, (buckets, calls)
    for ours, p in zip(model.weights, plain.weights):
        i = next(j for j, q in enumerate(acc.params) if q is ours)  # layout order
        assert_bitwise_equal(acc.main_grad.views[i].view_as(p), p.grad, f"parameter {i}")
    acc.zero_grad()
    acc.close()


def test_hot_path_refuses_a_namespace_without_the_op():
    """op_namespace must name a namespace that defines accumulate_bucket_: ValueError naming it."""
    w = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"op_namespace no_such_namespace defines no accumulate_bucket_"):
        _C.HotPath([w], torch.zeros(64), [0], [0], torch.empty(1, 2, dtype=torch.float64), 0, [1], None,
                   "no_such_namespace")


def test_hot_path_core_takes_handed_over_gradients():
    """HotPathCore (FSDP2's shards): no AccumulateGrad hooks; arrive(i, grad) holds and accumulates as HotPath's hook
    does (micro-batch 0 writes, later ones add: the fp64 sum of what was handed over, exact in fp32 here), and its
    contracts name the argument."""
    params = [torch.zeros(3, 4), torch.zeros(5)]
    main_grad = torch.full((128,), float("nan"))
    backend = gaengine.backends.get_backend("cpu")
    table = backend.new_bucket_partials([12, 5], "meta")
    hot = _C.HotPathCore(params, main_grad, [0, 64], [0, 0], table, backend.partials_dim, [1, 1], None, "gaengine")
    grads = [[torch.full((3, 4), 0.5 * (k + 1)), torch.full((5,), 0.25 * (k + 1))] for k in range(3)]
    hot.set_arrival(None)
    for k in range(3):
        hot.begin(False, False)
        for i in (1, 0):
            hot.arrive(i, grads[k][i].clone())
        hot.end()
    for i, (offset, p) in enumerate(zip((0, 64), params)):
        want = sum(g[i].double() for g in grads)
        assert torch.equal(main_grad[offset:offset + p.numel()].double().view_as(p), want)
    with pytest.raises(ValueError, match=r"grad of parameter 1 must have shape \[5\]"):
        hot.arrive(1, torch.zeros(4))
    with pytest.raises(IndexError, match="index 2 out of range for 2 parameters"):
        hot.arrive(2, torch.zeros(5))
    hot.close()


def _one_parameter_hot_path(cls, param):
    backend = gaengine.backends.get_backend("cpu")
    return cls([param], torch.zeros(64), [0], [0], backend.new_bucket_partials([param.numel()], "meta"),
               backend.partials_dim, [1], None)


def test_hot_path_and_its_core_each_refuse_the_other_way_in():
    """How a gradient arrives is which object is built, with no mode argument: the core registers no hook (a
    backward leaves p.grad as the plain recipe does), has no fusion and takes gradients only through arrive();
    HotPath (hooks on AccumulateGrad, fusion) has no arrive() and refuses a parameter it cannot hook, naming it and
    the core as the way to hand gradients over."""
    for cls in (_C.HotPath, _C.HotPathCore):  # the hot path's mode argument is gone
        with pytest.raises(TypeError, match="incompatible constructor arguments"):
            cls([nn.Parameter(torch.zeros(4))], torch.zeros(64), [0], [0], torch.empty(1, 2, dtype=torch.float64), 0,
                [1], None, "gaengine", True)
    w = nn.Parameter(torch.ones(4))
    core = _one_parameter_hot_path(_C.HotPathCore, w)
    assert not hasattr(core, "set_fusion") and not hasattr(core, "set_fused")
    core.begin(False, False)
    (w * torch.arange(4.0)).sum().backward()  # the plain recipe's p.grad, which the core does not take
    core.end()
    assert torch.equal(w.grad, torch.arange(4.0)) and core.launches() == 0
    core.close()
    hooked = _one_parameter_hot_path(_C.HotPath, w)
    assert not hasattr(hooked, "arrive")
    w.grad = None
    hooked.begin(False, False)
    (w * torch.arange(4.0)).sum().backward()  # taken by HotPath's AccumulateGrad hook
    hooked.end()
    assert w.grad is None and hooked.launches() == 1
    hooked.close()
    with pytest.raises(ValueError, match=r"params\[0\] must be a leaf tensor that requires grad .*HotPathCore"):
        _one_parameter_hot_path(_C.HotPath, torch.zeros(4))
