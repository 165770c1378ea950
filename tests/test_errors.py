"""Bad input gets a clear error naming the argument, and the window already accumulated stays intact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from tests.conftest import backend_params
from tests.tolerances import assert_bitwise_equal, mean_rtol, network_rtol, rel_diff
from tests.models import HoldsWrapped as _Holder


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    return ((model(torch.randn(4, 6, generator=g)) - torch.randn(4, 3, generator=g)) ** 2).mean()


def _assert_window_intact(acc, model, ref, done):
    """Finish the window and compare with the plain recipe over the same micro-batches (no clipping)."""
    K = acc.accumulation_steps
    for k in range(done, K):
        acc.backward(_loss(model, k))
    acc.step()
    for k in range(K):
        (_loss(ref, k) / K).backward()
    # K = 3: ``(loss / 3).backward()`` rounds its backward differently from ``loss.backward()`` then 1/3, per side
    # (a 2-layer model of width 8), and the two sides' means of K round differently.
    rtol = 2 * network_rtol(2, 8, products_per_layer=2) + 2 * mean_rtol(K)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_diff(p.grad, q.grad) <= rtol


@pytest.fixture
def started():
    """An accumulator (optimizer=None, K=3) holding one accumulated micro-batch, and its reference twin."""
    model = _model()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=None, backend="torch")
    acc.backward(_loss(model, 0))
    yield acc, model, ref
    acc.close()


@pytest.mark.parametrize("value", [0, -2, 2.0, "4", True], ids=["zero", "negative", "float", "str", "bool"])
def test_accumulation_steps(value):
    with pytest.raises(ValueError, match="accumulation_steps"):
        gaengine.GradientAccumulator(_model(), None, accumulation_steps=value)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "x"], ids=["zero", "negative", "nan", "inf", "str"])
def test_max_grad_norm(value):
    with pytest.raises(ValueError, match="max_grad_norm"):
        gaengine.GradientAccumulator(_model(), None, max_grad_norm=value)


def test_no_trainable_params():
    model = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gaengine.GradientAccumulator(model, None)


def test_params_on_several_devices():
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        gaengine.GradientAccumulator([a, b], None)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        gaengine.GradientAccumulator(_model(), None, backend="fast")


def test_ddp_wrapped_model(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(_model())
        with pytest.raises(TypeError, match="DistributedDataParallel.*freed"):
            gaengine.GradientAccumulator(ddp, None)
    finally:
        dist.destroy_process_group()


def test_ddp_nested_in_a_plain_module(tmp_path):
    """A DDP anywhere in the module tree is refused with its module path and what to pass instead (before, only a
    DDP at the top was: this one was accepted and both reductions ran)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _Holder(nn.parallel.DistributedDataParallel(_model()))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=r"model\.body\.0 is a torch\.nn\.parallel\.distributed\."
                                            r"DistributedDataParallel.*Pass the module it wraps \(model\.body\.0\.module\)"):
            gaengine.GradientAccumulator(model, opt)
        gaengine.GradientAccumulator(model.body[0].module, torch.optim.SGD(model.body[0].module.parameters(), lr=0.1)).close()
    finally:
        dist.destroy_process_group()


def test_second_accumulator_on_same_params(started):
    acc, model, ref = started
    with pytest.raises(RuntimeError, match="already belongs to another GradientAccumulator"):
        gaengine.GradientAccumulator(model, None, accumulation_steps=3)
    _assert_window_intact(acc, model, ref, done=1)


def test_second_accumulator_allowed_after_close():
    """After ``close()`` the parameters are free: a second accumulator takes them and its window's gradients are
    the plain recipe's (K = 2: ``(loss / 2).backward()`` halves exactly, so bit for bit)."""
    model = _model()
    ref = copy.deepcopy(model)
    first = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, backend="torch")
    first.backward(_loss(model, 7))  # a window the first one never finishes
    first.zero_grad()
    first.close()
    assert all(p.grad is None for p in model.parameters())
    second = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, backend="torch")
    for k in range(2):
        second.backward(_loss(model, k))
    assert second.step() is not None
    for k in range(2):
        (_loss(ref, k) / 2).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bitwise_equal(p.grad, q.grad)
    second.close()


def test_optimizer_with_foreign_params():
    model = _model()
    stranger = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD(list(model.parameters()) + [stranger], lr=0.1)
    with pytest.raises(ValueError, match="optimizer holds 1 parameter"):
        gaengine.GradientAccumulator(model, opt)


def test_sparse_embedding_refused():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="sparse"):
        gaengine.GradientAccumulator(model, None)


def test_sparse_gradient_in_backward(started):
    acc, model, ref = started
    emb_weight = nn.Parameter(torch.randn(10, 4))
    acc2 = gaengine.GradientAccumulator([emb_weight], None, accumulation_steps=2)
    with pytest.raises(ValueError, match="sparse|dense"):
        acc2.backward(nn.functional.embedding(torch.tensor([1, 2]), emb_weight, sparse=True).sum())
    acc2.close()
    _assert_window_intact(acc, model, ref, done=1)


@pytest.mark.parametrize("kind", ["vector", "no-grad", "int", "not-tensor"])
def test_bad_loss(started, kind):
    acc, model, ref = started
    x = torch.randn(4, 6)
    loss = {
        "vector": lambda: (model(x) ** 2).mean(0),
        "no-grad": lambda: (model(x) ** 2).mean().detach(),
        "int": lambda: torch.tensor(3),
        "not-tensor": lambda: 1.0,
    }[kind]()
    with pytest.raises(ValueError, match="loss"):
        acc.backward(loss)
    _assert_window_intact(acc, model, ref, done=1)


def test_mixing_num_items_in_a_window(started):
    acc, model, ref = started
    with pytest.raises(ValueError, match="num_items"):
        acc.backward(_loss(model, 1) * 4, num_items=4)
    _assert_window_intact(acc, model, ref, done=1)


@pytest.mark.parametrize("value", [-1, 2.5, torch.ones(2)], ids=["negative", "float", "vector"])
def test_bad_num_items(value):
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2)
    with pytest.raises(ValueError, match="num_items"):
        acc.backward(_loss(model, 0), num_items=value)
    assert acc.num_micro_batches == 0


def test_zero_items_in_total():
    model = _model()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None)
    # An int 0 is refused by backward() itself, before autograd runs: the window is untouched.
    with pytest.raises(ValueError, match="num_items must be >= 1"):
        acc.backward(_loss(model, 0) * 0, num_items=0)
    assert acc.num_micro_batches == 0 and all(p.grad is None for p in model.parameters())
    acc.backward(_loss(model, 0) * 4, num_items=4)
    acc.backward(_loss(model, 1) * 4, num_items=4)
    acc.step()
    for k in range(2):
        (_loss(ref, k) / 2).backward()
    for p, q in zip(model.parameters(), ref.parameters()):  # 4 and 1/8, 1/2: powers of two, the same adds
        assert_bitwise_equal(p.grad, q.grad)


def test_backward_on_full_window(started):
    acc, model, ref = started
    acc.backward(_loss(model, 1))
    acc.backward(_loss(model, 2))
    with pytest.raises(RuntimeError, match="call acc.step"):
        acc.backward(_loss(model, 3))
    _assert_window_intact(acc, model, ref, done=3)


def test_plain_loss_backward_is_refused(started):
    acc, model, ref = started
    with pytest.raises(RuntimeError, match="acc.backward"):
        _loss(model, 1).backward()
    _assert_window_intact(acc, model, ref, done=1)


# ------------------------------------------------------------------ gaengine.ops / clip_grad_norm_: checked in Python
# Bad input to the public functions is refused in Python before any kernel (and any call into gaengine._C, whose
# failed TORCH_CHECKs crash some images: csrc/README.md), with a ValueError or TypeError naming the argument.


def _strided(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(n, 2, dtype=dtype)[:, 0]


# Every way in: gaengine.ops with a backend name, and a backend's own methods. The contracts are the same for each.
VIAS = ["ops-auto", "ops-torch", "ops-cpu", "backend-cpu"]


def _via(via: str):
    """``(accumulate_, l2norm_sq, scale_)`` through ``via``: ``gaengine.ops`` with ``backend=<name>`` ("ops-*"), or
    the methods of ``get_backend(<name>)`` ("backend-*"); the cpu ones skip where gaengine._C is not built."""
    kind, name = via.split("-")
    if name == "cpu":
        pytest.importorskip("gaengine._C", reason="gaengine._C is not built (pip install --no-build-isolation -e .)")
    if kind == "ops":
        return (lambda dst, src, scale=1.0: gaengine.ops.accumulate_(dst, src, scale, backend=name),
                lambda x: gaengine.ops.l2norm_sq(x, backend=name),
                lambda x, coef: gaengine.ops.scale_(x, coef, backend=name))
    from gaengine.backends import get_backend  # noqa: PLC0415

    b = get_backend(name)
    return b.accumulate_, b.l2norm_sq, b.scale_


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize(
    "make, error, message",
    [
        pytest.param(lambda d: (d.double(), torch.zeros(4)), ValueError, "dst must be float32", id="dst-fp64"),
        pytest.param(lambda d: (_strided(4), torch.zeros(4)), ValueError, "dst must be contiguous", id="dst-strided"),
        pytest.param(lambda d: (d, torch.zeros(4, dtype=torch.int32)), ValueError,
                     "src must be float32, bfloat16 or float16", id="src-int32"),
        pytest.param(lambda d: (d, torch.zeros(4, dtype=torch.float64)), ValueError,
                     "src must be float32, bfloat16 or float16", id="src-fp64"),
        pytest.param(lambda d: (d, torch.zeros(3)), ValueError, "src has 3 elements but dst has 4", id="numel"),
        pytest.param(lambda d: (d, torch.ones(3, dtype=torch.bfloat16)), ValueError, "src has 3 elements but dst has 4",
                     id="numel-bf16"),
        pytest.param(lambda d: (d, torch.zeros(4, device="meta")), ValueError,
                     {"ops": "src is on meta but dst is on cpu", "backend": "src must be a CPU tensor, got device meta"},
                     id="src-meta"),
        pytest.param(lambda d: (d, [0.0] * 4), TypeError, "src must be a torch.Tensor", id="src-list"),
    ],
)
def test_accumulate_bad_input(make, error, message, via):
    """``message``: what every way in says, or by way in ("ops", "backend") where they word it differently."""
    accumulate_, _, _ = _via(via)
    message = message[via.split("-")[0]] if isinstance(message, dict) else message
    dst = torch.randn(4)
    before = dst.clone()
    bad_dst, src = make(dst)
    with pytest.raises(error, match=message):
        accumulate_(bad_dst, src)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize(
    "scale, error, message",
    [
        pytest.param(torch.ones(2), ValueError, r"scale must be a Python float or a 0-d float32 tensor on cpu, got a "
                     r"\(2,\)", id="vector"),
        pytest.param(torch.tensor(2.0, dtype=torch.float64), ValueError, "scale must be .* torch.float64 tensor",
                     id="fp64"),
        pytest.param(torch.tensor(2.0, device="meta"), ValueError, "scale must be .* on meta", id="meta"),
        pytest.param("2", TypeError, "scale must be a Python float", id="str"),
        pytest.param(None, TypeError, "scale must be a Python float", id="none"),
    ],
)
def test_accumulate_bad_scale(scale, error, message, via):
    accumulate_, _, _ = _via(via)
    dst = torch.randn(4)
    before = dst.clone()
    with pytest.raises(error, match=message):
        accumulate_(dst, torch.ones(4, dtype=torch.bfloat16), scale)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("via", VIAS)
def test_l2norm_sq_bad_input(via):
    _, l2norm_sq, _ = _via(via)
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16, got torch.int64"):
        l2norm_sq(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16, got torch.float64"):
        l2norm_sq(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        l2norm_sq([1.0, 2.0])


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize(
    "make_x, coef, error, message",
    [
        pytest.param(lambda: torch.randn(4).to(torch.bfloat16), torch.tensor(2.0), ValueError,
                     "x must be a contiguous float32 tensor", id="x-bf16"),
        pytest.param(lambda: _strided(4), torch.tensor(2.0), ValueError, r"x must be a contiguous float32 tensor.*"
                     "contiguous=False", id="x-strided"),
        pytest.param(lambda: torch.randn(4), torch.ones(2), ValueError, r"coef must be a 0-d tensor on cpu.*\(2,\)",
                     id="coef-vector"),
        pytest.param(lambda: torch.randn(4), torch.ones(1), ValueError, r"coef must be a 0-d tensor on cpu.*\(1,\)",
                     id="coef-1d"),
        pytest.param(lambda: torch.randn(4), torch.tensor(2.0, device="meta"), ValueError,
                     "coef must be a 0-d tensor on cpu .* on meta", id="coef-meta"),
        pytest.param(lambda: torch.randn(4), torch.tensor(2 + 0j), ValueError, "coef must be a real tensor",
                     id="coef-complex"),
        pytest.param(lambda: torch.randn(4), 2.0, TypeError, "coef must be a 0-d tensor on cpu", id="coef-float"),
    ],
)
def test_scale_bad_input(make_x, coef, error, message, via):
    _, _, scale_ = _via(via)
    x = make_x()
    before = x.clone()
    with pytest.raises(error, match=message):
        scale_(x, coef)
    assert torch.equal(x, before)


def test_contract_error_is_a_value_error_and_a_runtime_error():
    """Code written against the compiled ops' TORCH_CHECK (RuntimeError) keeps catching the Python checks."""
    from gaengine.backends import ContractError  # noqa: PLC0415

    assert issubclass(ContractError, ValueError) and issubclass(ContractError, RuntimeError)
    with pytest.raises(RuntimeError, match="src has 3 elements"):
        gaengine.ops.accumulate_(torch.zeros(4), torch.zeros(3))


_F64 = torch.float64


@pytest.mark.parametrize(
    "partials",
    [torch.zeros(2, 2, dtype=_F64), torch.zeros(1, 2), "rows", torch.zeros(1, 3, dtype=_F64), torch.zeros(2, dtype=_F64),
     torch.zeros(1, 4, dtype=_F64)[:, ::2], torch.zeros(1, 2, dtype=_F64, device="meta")],
    ids=["rows-n2", "fp32", "str", "shape-n3", "1d", "strided", "meta"],
)
@pytest.mark.parametrize("backend", backend_params("torch", "cpu"), indirect=True)
def test_accumulate_bucket_bad_partials(backend, partials):
    """The free-norm partials of ``accumulate_bucket_`` in the row layout (torch, cpu): refused in Python
    (``ValueError`` naming the argument) before any kernel, nothing written."""
    from gaengine.backends import get_backend  # noqa: PLC0415

    dst = torch.randn(8)
    before = dst.clone()
    partials_before = partials.clone() if isinstance(partials, torch.Tensor) and not partials.is_meta else None
    with pytest.raises(ValueError, match=r"partials must be a \(1, 2\) torch.float64 tensor on cpu"):
        get_backend(backend).accumulate_bucket_(dst, [torch.ones(8, dtype=torch.bfloat16)], [0], [False], partials)
    assert torch.equal(dst, before)
    if partials_before is not None:
        assert torch.equal(partials, partials_before)


def test_clip_grad_norm_float64_grads_go_to_torch():
    """float64 gradients (which the fused l2norm_sq does not take) are clipped by torch's implementation."""
    ours = [nn.Parameter(torch.randn(10, dtype=torch.float64)) for _ in range(2)]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, ref):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    total = gaengine.clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert total.dtype == torch.float64 and torch.equal(total, expected)
    for p, q in zip(ours, ref):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(max_norm="1.0"), "max_norm must be a float", id="max_norm-str"),
        pytest.param(dict(max_norm=None), "max_norm must be a float", id="max_norm-none"),
        pytest.param(dict(max_norm=torch.ones(2)), "max_norm must be a float or a one-element", id="max_norm-vector"),
        pytest.param(dict(max_norm=1.0, norm_type="two"), "norm_type must be a float or 'inf'", id="norm_type-str"),
    ],
)
def test_clip_grad_norm_bad_arguments(kwargs, message):
    p = nn.Parameter(torch.randn(6))
    p.grad = torch.randn(6) * 10
    before = p.grad.clone()
    with pytest.raises(TypeError, match=message):
        gaengine.clip_grad_norm_([p], **kwargs)
    assert torch.equal(p.grad, before)


def test_clip_grad_norm_accepts_inf_norm_type_like_torch():
    p, q = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))
    p.grad = torch.randn(6) * 10
    q.grad = p.grad.clone()
    assert torch.equal(gaengine.clip_grad_norm_([p], 1.0, norm_type="inf"),
                       torch.nn.utils.clip_grad_norm_([q], 1.0, norm_type="inf"))
    assert torch.equal(p.grad, q.grad)
