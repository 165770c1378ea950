"""``gaengine.optim.FusedAdamW`` against ``torch.optim.AdamW`` (the reference), on every kernel path.

Budgets: over 10 updates the fp32 parameters are within 1e-6 relative (``tests/tolerances.py::rel_diff``)
of the default ``torch.optim.AdamW`` fed ``grad / grad_scale``; the C++ kernel is bitwise equal to
``torch.optim.AdamW(fused=True)`` on CPU outside torch's scalar tail (x86-64); attached bf16/fp16 model parameters are bitwise ``master.to(dtype)``;
a skipped update (``found_inf``) changes no bit anywhere. The Triton path runs on CPU tensors under
``TRITON_INTERPRET=1`` without a GPU (small tensors), on CUDA tensors with one. The kernels themselves (every
backend against the fp64 AdamW; C++ AVX2, C++ portable and Triton giving the same bits on special values; the
streamed model write): ``tests/ops/test_adamw.py``.
"""

from __future__ import annotations

import copy
import platform

import pytest
import torch
from torch import nn

import gaengine
from gaengine.backends import get_backend
from gaengine.optim import FusedAdamW
from tests.conftest import backend_device, backend_params
from tests.tolerances import (
    assert_bitwise_equal,
    low_precision_ulp,
    rel_diff,
    unit_roundoff,
)
from tests.models import SmallMLP as _MLP

RTOL = 1e-6
SIZES = [1, 127, 4097]  # one element, a partial vector, one past a CPU block / two Triton blocks
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _backend_params() -> list:
    """``(name, device)`` of tests/conftest.py's backends that FusedAdamW is tested on here, each on the device its
    tensors live on (``backend_device``), skipped where it cannot load. (The cuda backends' kernel is tested at the
    op level, tests/ops/test_adamw.py, and through the engine in tests/test_cuda_emulation_engine.py.)"""
    out = []
    for p in backend_params("torch", "cpu", "triton"):
        name, device = p.values[0], backend_device(p.values[0])
        try:
            get_backend(name, device)
            marks = list(p.marks)
        except RuntimeError:
            marks = [*p.marks, pytest.mark.skip(reason=f"backend {name!r} unavailable")]
        out.append(pytest.param(name, device, id=p.id, marks=marks))
    return out


BACKENDS = _backend_params()


def _available(name: str) -> bool:
    return any(b.id == name and not any(m.name == "skip" for m in b.marks) for b in BACKENDS)


def _params(device, sizes=SIZES, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g).to(device)) for n in sizes]


def _grads(params, step: int, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    # Mixed magnitudes, so the moments and the updates round in every binade.
    return [(torch.randn(p.shape, generator=g) * torch.logspace(-3, 1, p.numel()).reshape(p.shape)).to(p.device)
            for p in params]


def _step_both_and_compare(opt, ours, ref_opt, ref, steps=10) -> None:
    """``steps`` updates of ``opt`` and ``ref_opt`` on the same gradients, then ours within RTOL of ref."""
    for k in range(steps):
        for p, q, g in zip(ours, ref, _grads(ours, k)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert rel_diff(p, q) <= RTOL


def _state_tensors(opt) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in (s["step"], s["exp_avg"], s["exp_avg_sq"])]


# ------------------------------------------------------------------------------------- against torch AdamW


@pytest.mark.parametrize("model_dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16-model", "fp16-model"])
@pytest.mark.parametrize("grad_scale", [None, 0.37, 1024.0], ids=["unscaled", "scale0.37", "scale1024"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["wd0", "wd0.05"])
@pytest.mark.parametrize("backend, device", BACKENDS)
def test_ten_updates_match_torch_adamw(backend, device, weight_decay, grad_scale, model_dtype):
    ours, ref = _params(device), _params(device)
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=weight_decay, backend=backend)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=weight_decay)
    models = None
    if model_dtype is not None:
        models = [p.detach().to(model_dtype) for p in ours]
        opt.attach_model_params(list(zip(ours, models)))
    for k in range(10):
        grads = _grads(ours, k)
        for p, q, g in zip(ours, ref, grads):
            p.grad = g.clone()
            q.grad = g.clone() if grad_scale is None else g / grad_scale  # torch AdamW fed grad / scale
        if grad_scale is not None:
            opt.grad_scale = torch.tensor(grad_scale, device=device)
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            assert rel_diff(p, q) <= RTOL, f"update {k}, param {i}: {rel_diff(p, q):.2e}"
            if models is not None:
                assert_bitwise_equal(models[i], p.detach().to(model_dtype), f"model param {i} after update {k}")
    for p, q in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_diff(opt.state[p][key], ref_opt.state[q][key]) <= RTOL
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == 10.0
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].device == p.device


@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.9)], ids=["default-betas", "beta1-0.3"])  # lerp weight >= 0.5
@pytest.mark.parametrize("backend, device", BACKENDS)
def test_betas_and_maximize_match_torch(backend, device, betas, maximize):
    ours, ref = _params(device), _params(device)
    opt = FusedAdamW(ours, lr=3e-3, betas=betas, eps=1e-6, weight_decay=0.1, maximize=maximize, backend=backend)
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, betas=betas, eps=1e-6, weight_decay=0.1, maximize=maximize)
    _step_both_and_compare(opt, ours, ref_opt, ref)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="torch's fused CPU kernel contracts to FMA on x86-64")
@pytest.mark.parametrize("n", [4096, 4097, 100_003], ids=lambda n: f"n{n}")
def test_cpu_kernel_is_bitwise_torch_fused(n):
    """Same bits as ``torch.optim.AdamW(fused=True)`` on CPU, grad_scale/found_inf protocol included, except
    torch's scalar tail (its last ``n % 16`` elements skip the FMAs its vector loop uses)."""
    if not _available("cpu"):
        pytest.skip("gaengine._C unavailable")
    ours, ref = _params("cpu", [n]), _params("cpu", [n])
    opt = FusedAdamW(ours, lr=1e-3, weight_decay=0.01, backend="cpu")
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    body = n - n % 16
    for k in range(10):
        g = _grads(ours, k)[0] * 300.0
        ours[0].grad, ref[0].grad = g.clone(), g.clone()
        for o in (opt, ref_opt):
            o.grad_scale, o.found_inf = torch.tensor(300.0), torch.tensor(float(k == 4))
            o.step()
            del o.grad_scale, o.found_inf
        assert_bitwise_equal(ours[0].detach()[:body], ref[0].detach()[:body], f"param after update {k}")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(opt.state[ours[0]][key][:body], ref_opt.state[ref[0]][key][:body], key)
        assert rel_diff(ours[0], ref[0]) <= RTOL
    assert opt.state[ours[0]]["step"].item() == ref_opt.state[ref[0]]["step"].item() == 9.0


# --------------------------------------------------------------------------------------- param groups


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_param_groups_with_their_own_lr_and_weight_decay(backend, device):
    ours, ref = _params(device, [33, 65, 7]), _params(device, [33, 65, 7])

    def groups(ps):
        return [{"params": [ps[0]], "lr": 1e-1, "weight_decay": 0.0},
                {"params": [ps[1]], "lr": 1e-3, "betas": (0.8, 0.99)},
                {"params": [ps[2]]}]

    opt = FusedAdamW(groups(ours), lr=1e-2, weight_decay=0.3, backend=backend)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.3)
    _step_both_and_compare(opt, ours, ref_opt, ref)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_param_without_grad_is_untouched(backend, device):
    ps = _params(device, [10, 20])
    before = ps[1].detach().clone()
    opt = FusedAdamW(ps, lr=0.1, backend=backend)
    ps[0].grad = torch.ones_like(ps[0])
    opt.step()
    assert ps[1] not in opt.state
    assert_bitwise_equal(ps[1].detach(), before, "param without a gradient")


# --------------------------------------------------------------------------------------- skipped update


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_skipped_update_changes_no_bit(backend, device):
    ps = _params(device)
    models = [p.detach().to(torch.bfloat16) for p in ps]
    opt = FusedAdamW(ps, lr=1e-2, weight_decay=0.1, backend=backend)
    opt.attach_model_params(list(zip(ps, models)))
    for k in range(3):  # build up a state first
        for p, g in zip(ps, _grads(ps, k)):
            p.grad = g
        opt.step()
    snapshot = [t.detach().clone() for t in [*ps, *models, *_state_tensors(opt)]]
    for p, g in zip(ps, _grads(ps, 3)):
        p.grad = g * float("inf")  # what a skipped window looks like: non-finite gradients
    opt.grad_scale = torch.tensor(0.5, device=device)
    opt.found_inf = torch.tensor(1.0, device=device)
    opt.step()
    for before, after in zip(snapshot, [*ps, *models, *_state_tensors(opt)]):
        assert_bitwise_equal(after.detach(), before, "a tensor of a skipped update")
    opt.found_inf = torch.tensor(0.0, device=device)  # the next real update goes on from the same state
    for p, g in zip(ps, _grads(ps, 4)):
        p.grad = g
    opt.step()
    assert all(s["step"].item() == 4.0 for s in opt.state.values())
    for p, model in zip(ps, models):
        assert_bitwise_equal(model, p.detach().to(torch.bfloat16), "model param after the next update")


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_first_update_skipped_leaves_zero_state(backend, device):
    ps = _params(device, [5])
    before = ps[0].detach().clone()
    opt = FusedAdamW(ps, backend=backend)
    ps[0].grad = torch.full_like(ps[0], float("nan"))
    opt.found_inf = torch.tensor(1.0, device=device)
    opt.step()
    assert_bitwise_equal(ps[0].detach(), before, "param")
    assert opt.state[ps[0]]["step"].item() == 0.0
    assert not opt.state[ps[0]]["exp_avg"].any() and not opt.state[ps[0]]["exp_avg_sq"].any()


# --------------------------------------------------------------------------------------- no host sync


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_step_never_syncs_with_the_host(backend, device, monkeypatch):
    ps = _params(device)
    models = [p.detach().to(torch.bfloat16) for p in ps]
    opt = FusedAdamW(ps, lr=1e-2, backend=backend)
    opt.attach_model_params(list(zip(ps, models)))
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    opt.step()  # state created, kernels loaded: the next step is the hot path
    for p, g in zip(ps, _grads(ps, 1)):
        p.grad = g
    opt.grad_scale = torch.tensor(2.0, device=device)
    opt.found_inf = torch.tensor(0.0, device=device)

    def forbidden(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"host sync in FusedAdamW.step(): Tensor.{name}")
        return fail

    for name in ("item", "__bool__", "cpu", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    opt.step()
    monkeypatch.undo()
    assert all(s["step"].item() == 2.0 for s in opt.state.values())


# --------------------------------------------------------------------------------------- state dicts


def _train(opt, params, steps, seed):
    for k in range(steps):
        for p, g in zip(params, _grads(params, k, seed=seed)):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("direction", ["fused-to-torch", "torch-to-fused"])
def test_state_dict_round_trips_with_torch_adamw(direction):
    backend = "cpu" if _available("cpu") else "torch"
    first_ps = _params("cpu")
    first = (FusedAdamW(first_ps, lr=1e-2, weight_decay=0.05, backend=backend) if direction == "fused-to-torch"
             else torch.optim.AdamW(first_ps, lr=1e-2, weight_decay=0.05))
    _train(first, first_ps, 5, seed=2)
    state = copy.deepcopy(first.state_dict())

    second_ps = [nn.Parameter(p.detach().clone()) for p in first_ps]
    second = (torch.optim.AdamW(second_ps, lr=0.5) if direction == "fused-to-torch"
              else FusedAdamW(second_ps, lr=0.5, backend=backend))
    second.load_state_dict(state)
    assert second.param_groups[0]["lr"] == 1e-2 and second.param_groups[0]["weight_decay"] == 0.05
    for i, (p, q) in enumerate(zip(first_ps, second_ps)):
        s, t = first.state[p], second.state[q]
        assert t["step"].item() == s["step"].item() == 5.0
        assert t["step"].dtype == torch.float32 and t["step"].dim() == 0
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(t[key], s[key], key)
            if direction == "torch-to-fused":  # FusedAdamW copies (torch's loader may alias the caller's tensors)
                assert t[key].data_ptr() != state["state"][i][key].data_ptr()

    # Continued training from the loaded state matches continuing the original optimizer.
    _train(first, first_ps, 5, seed=3)
    _train(second, second_ps, 5, seed=3)
    for p, q in zip(first_ps, second_ps):
        assert rel_diff(q, p) <= RTOL
    assert all(s["step"].item() == 10.0 for s in second.state.values())
    # And the state of the second one loads back into the first kind.
    again = (FusedAdamW if direction == "fused-to-torch" else torch.optim.AdamW)(first_ps)
    again.load_state_dict(second.state_dict())
    assert again.param_groups[0]["lr"] == 1e-2


def test_state_dict_has_torch_adamw_keys():
    ps = _params("cpu", [4])
    opt = FusedAdamW(ps)
    ps[0].grad = torch.ones(4)
    opt.step()
    ours = opt.state_dict()
    ref_ps = _params("cpu", [4])
    ref = torch.optim.AdamW(ref_ps, fused=True)
    ref_ps[0].grad = torch.ones(4)
    ref.step()
    theirs = ref.state_dict()
    assert set(ours["state"][0]) == set(theirs["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(ours["param_groups"][0]) == set(theirs["param_groups"][0])
    assert {k: v for k, v in ours["param_groups"][0].items()} == {k: v for k, v in theirs["param_groups"][0].items()}
    assert opt.defaults["fused"] is True and FusedAdamW._step_supports_amp_scaling


def test_load_state_dict_rejects_amsgrad():
    ps = _params("cpu", [4])
    ref = torch.optim.AdamW(ps, amsgrad=True)
    ps[0].grad = torch.ones(4)
    ref.step()
    opt = FusedAdamW(_params("cpu", [4]))
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(ref.state_dict())
    assert not opt.state


# --------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-1e-3), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(lr=torch.tensor(1e-3)), "lr"),
    (dict(betas=(1.0, 0.999)), "betas"),
    (dict(betas=(0.9, -0.1)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(amsgrad=True), "amsgrad"),
    (dict(backend="gpu"), "backend"),
], ids=["lr-negative", "lr-nan", "lr-tensor", "beta1-1", "beta2-negative", "betas-short", "eps-negative",
        "wd-negative", "amsgrad", "backend"])
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        FusedAdamW(_params("cpu", [3]), **kwargs)


def test_bad_param_group_raises_and_is_not_added():
    opt = FusedAdamW(_params("cpu", [3]))
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": _params("cpu", [2]), "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_integer_params_are_rejected():
    with pytest.raises(ValueError, match="floating point"):
        FusedAdamW([torch.zeros(3, dtype=torch.int64)])


def test_float64_param_with_grad_raises_before_writing():
    p = nn.Parameter(torch.randn(8, dtype=torch.float64))
    q = nn.Parameter(torch.randn(8))
    before = q.detach().clone()
    opt = FusedAdamW([q, p])
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    with pytest.raises(ValueError, match="float32 .*bfloat16 or float16 parameters, got one of dtype torch.float64"):
        opt.step()
    assert_bitwise_equal(q.detach(), before, "fp32 param of the failed step")


def test_tensor_lr_set_later_raises():
    ps = _params("cpu", [3])
    opt = FusedAdamW(ps)
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    ps[0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="lr"):
        opt.step()


def test_attach_model_params_validates():
    ps = _params("cpu", [4, 6])
    opt = FusedAdamW(ps)
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.attach_model_params([(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        opt.attach_model_params([(ps[0], torch.zeros(4))])
    with pytest.raises(ValueError, match="shape"):
        opt.attach_model_params([(ps[0], torch.zeros(5, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="tuple"):
        opt.attach_model_params([ps[0]])
    assert not opt._model_params


# adamw_step_'s TORCH_CHECKs (csrc/optimizer_step.cpp, the CPU launcher) on gaengine._C directly, in a child process
# (tests/child_contracts.py): skipped where every extension's failed TORCH_CHECK crashes, failed where only ours
# does. check(): a refused call writes nothing.
_ADAMW_SETUP = (
    "p, m, v, s = torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(())\n"
    "snap = [t.clone() for t in (p, m, v, s)]\n"
    "def check(): assert all(torch.equal(a, b) for a, b in zip((p, m, v, s), snap)), 'state was written'\n"
)
_ADAMW_TAIL = "1e-3, 0.9, 0.999, 1e-8, 0.0, False"
_ADAMW_RAW_CONTRACTS = [
    ("grads-numel", f"_C.adamw_step_([p], [torch.zeros(5)], [m], [v], [s], [None], {_ADAMW_TAIL}, None, None)",
     r"grads\[0\]"),
    ("params-fp64", f"_C.adamw_step_([p.double()], [p], [m], [v], [s], [None], {_ADAMW_TAIL}, None, None)",
     r"params\[0\] must be float32"),
    ("params-strided", f"_C.adamw_step_([torch.zeros(4, 2)[:, 0]], [p], [m], [v], [s], [None], {_ADAMW_TAIL}, "
     "None, None)", r"params\[0\] must be contiguous"),
    ("grads-int", f"_C.adamw_step_([p], [p.int()], [m], [v], [s], [None], {_ADAMW_TAIL}, None, None)",
     r"grads\[0\] must be float32, bfloat16 or float16"),
    ("moments-fp64", f"_C.adamw_step_([p], [p], [m.double()], [v], [s], [None], {_ADAMW_TAIL}, None, None)",
     r"exp_avgs\[0\] and exp_avg_sqs\[0\] must be float32"),
    ("step-1d", f"_C.adamw_step_([p], [p], [m], [v], [torch.zeros(1)], [None], {_ADAMW_TAIL}, None, None)",
     r"steps\[0\] must be a 0-d float32 CPU tensor"),
    ("model-fp32", f"_C.adamw_step_([p], [p], [m], [v], [s], [torch.zeros(4)], {_ADAMW_TAIL}, None, None)",
     r"model_params\[0\]"),
    ("model-numel", f"_C.adamw_step_([p], [p], [m], [v], [s], [torch.zeros(5, dtype=torch.bfloat16)], "
     f"{_ADAMW_TAIL}, None, None)", r"model_params\[0\] must have the 4 elements"),
    ("found-inf-1d", f"_C.adamw_step_([p], [p], [m], [v], [s], [None], {_ADAMW_TAIL}, None, torch.zeros(1))",
     "found_inf"),
    ("grad-scale-fp64", f"_C.adamw_step_([p], [p], [m], [v], [s], [None], {_ADAMW_TAIL}, "
     "torch.ones((), dtype=torch.float64), None)", "grad_scale must be a 0-d float32 tensor"),
    ("lengths", f"_C.adamw_step_([p], [], [m], [v], [s], [None], {_ADAMW_TAIL}, None, None)",
     "must have the same length"),
    ("moments-mix", f"_C.adamw_step_([p.half()], [p], [m], [v], [s], [None], {_ADAMW_TAIL}, None, None)",
     r"exp_avgs\[0\] and exp_avg_sqs\[0\] must be float16 \(the dtype of params\[0\]\), got Float"),
    ("model-in-place", f"_C.adamw_step_([p.bfloat16()], [p], [m.bfloat16()], [v.bfloat16()], [s], "
     f"[torch.zeros(4, dtype=torch.bfloat16)], {_ADAMW_TAIL}, None, None)", r"model_params\[0\] must be None"),
]


def test_cpu_extension_contract_errors():
    if not _available("cpu"):
        pytest.skip("gaengine._C unavailable")
    from tests.child_contracts import check_raw_contracts  # noqa: PLC0415

    check_raw_contracts([(case_id, _ADAMW_SETUP, call, regex) for case_id, call, regex in _ADAMW_RAW_CONTRACTS])


def _snapshot(opt: FusedAdamW, params) -> list[torch.Tensor]:
    """Every tensor step() may write: the parameters and each state tensor (by value)."""
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [t.clone() for t in opt.state[p].values() if isinstance(t, torch.Tensor)] if p in opt.state else []
    return out


def _assert_unchanged(opt: FusedAdamW, params, before: list[torch.Tensor], n_states: int) -> None:
    assert sum(1 for p in params if p in opt.state and opt.state[p]) == n_states, "state created by a refused step"
    after = _snapshot(opt, params)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert_bitwise_equal(a, b, "parameter / state after a refused step")


def _stepped_twice(backend: str = "auto"):
    """Two parameter groups, each stepped once (state exists), then fresh gradients: ready for a third step."""
    ps = _params("cpu", [4, 6, 5])
    opt = FusedAdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 1e-2}], lr=1e-3, backend=backend)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in ps:
        p.grad = torch.randn_like(p)
    return opt, ps


def _bad_state_dtype(opt, ps):
    opt.state[ps[2]]["exp_avg"] = opt.state[ps[2]]["exp_avg"].double()


def _bad_state_numel(opt, ps):
    opt.state[ps[2]]["exp_avg_sq"] = torch.zeros(7)


def _bad_state_strided(opt, ps):
    opt.state[ps[2]]["exp_avg"] = torch.zeros(5, 2)[:, 0]


def _bad_step_shape(opt, ps):
    opt.state[ps[2]]["step"] = torch.ones(1)


def _bad_step_dtype(opt, ps):
    opt.state[ps[2]]["step"] = torch.ones((), dtype=torch.float64)


def _bad_step_type(opt, ps):
    opt.state[ps[2]]["step"] = 1


def _bad_grad_scale(opt, ps):
    opt.grad_scale = torch.ones(2)


def _bad_found_inf(opt, ps):
    opt.found_inf = torch.zeros(3)


def _non_tensor_found_inf(opt, ps):
    opt.found_inf = 0.0


def _bad_betas_later(opt, ps):
    opt.param_groups[1]["betas"] = (0.9, 1.5)


def _strided_param(opt, ps):
    ps[2].data = torch.zeros(5, 2)[:, 0]


def _model_param_changed(opt, ps):
    model = torch.zeros(5, dtype=torch.bfloat16)
    opt.attach_model_params([(ps[2], model)])
    model.data = torch.zeros(5)  # fp32 now: the fused kernel cannot write it


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize(
    "spoil, error, message",
    [
        pytest.param(_bad_state_dtype, ValueError, r"state\['exp_avg'\] of param_groups\[1\]\['params'\]\[0\] "
                     "must be a contiguous float32", id="exp_avg-fp64"),
        pytest.param(_bad_state_numel, ValueError, r"state\['exp_avg_sq'\].*5 elements", id="exp_avg_sq-numel"),
        pytest.param(_bad_state_strided, ValueError, r"state\['exp_avg'\].*contiguous=False", id="exp_avg-strided"),
        pytest.param(_bad_step_shape, ValueError, r"state\['step'\].*must be a 0-d float32", id="step-1d"),
        pytest.param(_bad_step_dtype, ValueError, r"state\['step'\].*must be a 0-d float32", id="step-fp64"),
        pytest.param(_bad_step_type, ValueError, r"state\['step'\].*must be a tensor", id="step-int"),
        pytest.param(_bad_grad_scale, ValueError, "grad_scale must be a 0-d", id="grad_scale-2"),
        pytest.param(_bad_found_inf, ValueError, "found_inf must be a 0-d", id="found_inf-3"),
        pytest.param(_non_tensor_found_inf, TypeError, "found_inf must be a 0-d tensor or None", id="found_inf-float"),
        pytest.param(_bad_betas_later, ValueError, r"betas\[1\] must be in \[0, 1\)", id="betas-set-later"),
        pytest.param(_strided_param, ValueError, r"param_groups\[1\]\['params'\]\[0\] must be contiguous",
                     id="param-strided"),
        pytest.param(_model_param_changed, ValueError, "model param attached to param_groups", id="model-param-fp32"),
    ],
)
def test_step_refuses_bad_input_before_writing_anything(spoil, error, message, backend):
    """step() checks every argument its kernel takes, in Python, for every group before any is updated: the
    first group (valid) is not stepped either, and no state is created or written."""
    if backend == "auto" and not _available("cpu"):
        pytest.skip("gaengine._C unavailable")
    opt, ps = _stepped_twice(backend)
    spoil(opt, ps)
    before = _snapshot(opt, ps)
    with pytest.raises(error, match=message):
        opt.step()
    _assert_unchanged(opt, ps, before, n_states=3)


def test_step_refuses_a_bad_param_before_creating_any_state():
    """The first step: a valid parameter before the bad one gets no state (nothing is created, then refused)."""
    good, bad = nn.Parameter(torch.randn(4)), nn.Parameter(torch.zeros(5, 2)[:, 0])
    opt = FusedAdamW([good, bad])
    good.grad, bad.grad = torch.ones(4), torch.ones(5)
    before = _snapshot(opt, [good, bad])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] must be contiguous"):
        opt.step()
    _assert_unchanged(opt, [good, bad], before, n_states=0)


def test_step_never_reaches_a_failed_torch_check(monkeypatch):
    """The bad steps above stop in Python: no kernel is called with them (a spy that fails if it is)."""
    for spoil in (_bad_state_dtype, _bad_step_shape, _bad_grad_scale, _strided_param, _model_param_changed):
        opt, ps = _stepped_twice("torch")

        def spy(*args, **kwargs):
            raise AssertionError("a kernel was called with arguments Python should have refused")

        monkeypatch.setattr(opt, "_kernel", lambda device: spy)
        spoil(opt, ps)
        with pytest.raises((ValueError, TypeError)):
            opt.step()


# --------------------------------------------------------------------------------------- with the engine


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["no-clip", "clip"])
def test_engine_with_fused_adamw_matches_torch_fused_adamw(max_grad_norm):
    """bf16 model + fp32 masters: FusedAdamW gets the clip coefficient and the skip flag through the fused
    protocol (grad_scale / found_inf); the result equals the same run with torch.optim.AdamW(fused=True)."""
    torch.manual_seed(0)
    model_a = _MLP().to(torch.bfloat16)
    model_b = copy.deepcopy(model_a)
    acc_a = gaengine.GradientAccumulator(model_a, FusedAdamW(model_a.parameters(), lr=1e-2, weight_decay=0.1),
                                         accumulation_steps=3, max_grad_norm=max_grad_norm)
    acc_b = gaengine.GradientAccumulator(model_b, torch.optim.AdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1,
                                                                    fused=True),
                                         accumulation_steps=3, max_grad_norm=max_grad_norm)
    for k in range(12):
        x, y = torch.randn(8, 16).to(torch.bfloat16), torch.randn(8, 7)
        if k == 7:
            x[0, 0] = float("nan")  # this window is skipped by both
        for model, acc in ((model_a, acc_a), (model_b, acc_b)):
            acc.backward(((model(x).float() - y) ** 2).mean())
            result = acc.step()
        if result is not None and k == 8:
            assert bool(result.skipped)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert a.dtype == torch.bfloat16
        # bf16 params from fp32 masters a few fp32 roundings apart: each element at most one bf16 ulp of its own apart
        assert bool(((a.double() - b.double()).abs() <= low_precision_ulp(b.detach())).all()), name
    # The engine re-points the optimizers at the fp32 masters, in the model's parameter order.
    masters_a, masters_b = acc_a.optimizer.param_groups[0]["params"], acc_b.optimizer.param_groups[0]["params"]
    assert all(m.dtype == torch.float32 for m in masters_a)
    for a, b in zip(masters_a, masters_b):
        assert rel_diff(a, b) <= RTOL
    for p, master in zip(model_a.parameters(), masters_a):
        assert_bitwise_equal(p.detach(), master.detach().to(torch.bfloat16), "model == rounded master")


def test_engine_fp32_model_with_fused_adamw():
    torch.manual_seed(0)
    model_a = _MLP()
    model_b = copy.deepcopy(model_a)
    acc_a = gaengine.GradientAccumulator(model_a, FusedAdamW(model_a.parameters(), lr=1e-2), accumulation_steps=2)
    acc_b = gaengine.GradientAccumulator(model_b, torch.optim.AdamW(model_b.parameters(), lr=1e-2, fused=True),
                                         accumulation_steps=2)
    for _ in range(8):
        x, y = torch.randn(8, 16), torch.randn(8, 7)
        for model, acc in ((model_a, acc_a), (model_b, acc_b)):
            acc.backward(((model(x) - y) ** 2).mean())
            acc.step()
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert rel_diff(a, b) <= RTOL


def test_grad_scaler_protocol():
    """torch.amp.GradScaler drives FusedAdamW like torch's fused AdamW: unscale in the kernel, skip on inf."""
    ours, ref = _params("cpu", [64]), _params("cpu", [64])
    opts = [FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2, fused=True)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in opts]
    for k in range(6):
        for ps, opt, scaler in zip((ours, ref), opts, scalers):
            loss = (ps[0] * (torch.arange(64.0) - k)).sum() * (float("inf") if k == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert rel_diff(ours[0], ref[0]) <= RTOL
    assert opts[0].state[ours[0]]["step"].item() == opts[1].state[ref[0]]["step"].item() == 5.0


# ------------------------------------------------------------------- bf16/fp16 parameters updated in place
# No master weights (GradientAccumulator(master_weights=False)): the parameter, exp_avg and exp_avg_sq are all
# bf16 | fp16, the gradient fp32. The specification: torch.optim.AdamW in fp32 on fp32 copies of p, m, v with the
# same fp32 gradient, then each of p, m, v rounded to the parameter dtype (round to nearest even, .to(dtype)).

IN_PLACE_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
IN_PLACE_CASES = {  # lr, betas, weight_decay, maximize, grad_scale
    "default": (1e-2, (0.9, 0.999), 0.0, False, None),
    "wd-scale": (1e-2, (0.9, 0.999), 0.1, False, 37.5),
    "maximize-lerp-large": (3e-3, (0.3, 0.95), 0.05, True, 0.25),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype != torch.float32 else t.view(torch.int32)


def _in_place_state(n: int, dtype: torch.dtype, seed: int = 0):
    """A bf16 | fp16 param with a non-trivial state (step 2) and its fp32 gradient source."""
    g = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(n, generator=g).to(dtype))
    m = (torch.randn(n, generator=g) * 0.1).to(dtype)
    v = (torch.rand(n, generator=g) * 0.01).to(dtype)
    return p, m, v


def _reference_step(p, m, v, step, grad, lr, betas, wd, maximize, grad_scale, *, fused_torch: bool):
    """The specification: one torch.optim.AdamW (``fused_torch``) or one fp32 FusedAdamW ("cpu" kernel, bitwise
    torch's fused CPU AdamW outside its scalar tail) step on fp32 copies of p, m, v at ``step``, each rounded back
    to p's dtype. Returns (p, m, v) in p's dtype."""
    ref = nn.Parameter(p.detach().float())
    kwargs = dict(lr=lr, betas=betas, weight_decay=wd, maximize=maximize)
    opt = (torch.optim.AdamW([ref], fused=True, **kwargs) if fused_torch
           else FusedAdamW([ref], backend="cpu" if _available("cpu") else "torch", **kwargs))
    opt.state[ref] = {"step": torch.tensor(float(step)), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    ref.grad = grad.clone()
    if grad_scale is not None:
        opt.grad_scale = torch.tensor(grad_scale)
    opt.step()
    state = opt.state[ref]
    return ref.detach().to(p.dtype), state["exp_avg"].to(p.dtype), state["exp_avg_sq"].to(p.dtype)


@pytest.mark.parametrize("case", IN_PLACE_CASES)
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", IN_PLACE_DTYPES)
@pytest.mark.parametrize("backend, device", BACKENDS)
def test_in_place_update_matches_rounded_fp32_reference(backend, device, dtype, n, case):
    """Three updates of a bf16 | fp16 parameter from fp32 gradients, each against the specification applied to
    the current state. C++ and Triton: bitwise equal to the fp32 kernel's result rounded (the same fp32
    operations), and to torch.optim.AdamW(fused=True)'s rounded, outside torch's scalar tail (x86-64: its last
    n % 16 elements skip an FMA, a few fp32 ulps that may flip one rounding: within 1 ulp of the dtype there).
    The plain-torch fallback (eager lerp / addcmul, a few fp32 ulps off the fused kernels): within 1 ulp."""
    lr, betas, wd, maximize, grad_scale = IN_PLACE_CASES[case]
    p, m0, v0 = _in_place_state(n, dtype)
    p = nn.Parameter(p.detach().to(device))
    opt = FusedAdamW([p], lr=lr, betas=betas, weight_decay=wd, maximize=maximize, backend=backend)
    opt.state[p] = {"step": torch.tensor(2.0, device=device), "exp_avg": m0.to(device), "exp_avg_sq": v0.to(device)}
    bitwise = backend in ("cpu", "triton")
    body = n - n % 16 if platform.machine() in ("x86_64", "AMD64") else 0
    for k in range(3):
        grad = _grads([p], k)[0].float() * (grad_scale or 1.0)  # fp32, as a loss-scaled sum would leave it
        before = [t.detach().cpu().clone() for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
        p.main_grad = grad.to(device)
        if grad_scale is not None:
            opt.grad_scale = torch.tensor(grad_scale, device=device)
        opt.step()
        del p.main_grad
        ours = [p.detach().cpu(), opt.state[p]["exp_avg"].cpu(), opt.state[p]["exp_avg_sq"].cpu()]
        assert all(t.dtype == dtype for t in ours)
        spec = _reference_step(*before, 2 + k, grad.cpu(), lr, betas, wd, maximize, grad_scale, fused_torch=False)
        torch_ref = _reference_step(*before, 2 + k, grad.cpu(), lr, betas, wd, maximize, grad_scale, fused_torch=True)
        for what, a, b, t in zip(("param", "exp_avg", "exp_avg_sq"), ours, spec, torch_ref):
            if bitwise:
                assert_bitwise_equal(_bits(a), _bits(b), f"update {k}: {what} vs the rounded fp32 kernel")
                assert_bitwise_equal(_bits(a[:body]), _bits(t[:body]), f"update {k}: {what} vs rounded torch fused")
            diff = (a.double() - t.double()).abs()
            assert bool((diff <= low_precision_ulp(t)).all()), f"update {k}: {what} off by {float(diff.max())}"
    assert opt.state[p]["step"].item() == 5.0


@pytest.mark.parametrize("dtype", IN_PLACE_DTYPES)
@pytest.mark.parametrize("backend, device", BACKENDS)
def test_in_place_skipped_update_changes_no_bit(backend, device, dtype):
    p, _, _ = _in_place_state(127, dtype)
    p = nn.Parameter(p.detach().to(device))
    opt = FusedAdamW([p], lr=1e-2, weight_decay=0.1, backend=backend)
    p.main_grad = torch.randn(127, device=device)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == dtype and opt.state[p]["exp_avg_sq"].dtype == dtype
    snapshot = [t.detach().clone() for t in (p, *opt.state[p].values())]
    p.main_grad = torch.full((127,), float("inf"), device=device)
    opt.grad_scale = torch.tensor(0.5, device=device)
    opt.found_inf = torch.tensor(1.0, device=device)
    opt.step()
    for before, after in zip(snapshot, (p, *opt.state[p].values())):
        assert_bitwise_equal(_bits(after.detach()), _bits(before), "a tensor of a skipped in-place update")


def test_in_place_matches_torch_fused_adamw_on_bf16_params():
    """FusedAdamW on bf16 params with fp32 gradients vs torch.optim.AdamW(fused=True) on the same bf16 params, fed
    the gradients rounded to bf16 (torch's fused kernel takes grads in the param dtype; it also computes in fp32
    and rounds p, m, v back). Five updates, torch re-synced to our state before each, so the budget is one
    update's: the only difference is the gradient's rounding (|dg| <= 2^-8 |g|, bf16's unit roundoff). m = lerp(m, g, 1 - beta1) moves by
    (1 - beta1)|dg| and v by about 2(1 - beta2)|g||dg|, plus one rounding each to bf16 on both sides; the param
    moves by lr x (a ratio m_hat / sqrt(v_hat) perturbed by ~2^-7 relative), far below a bf16 ulp of |p| ~ 1 at
    lr = 1e-3, so it can differ by one flipped rounding: 1 ulp."""
    dtype = torch.bfloat16
    ours = [nn.Parameter(p.detach()) for p in (_in_place_state(n, dtype, seed=n)[0] for n in SIZES)]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedAdamW(ours, lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    beta1, beta2 = 0.9, 0.999
    for k in range(5):
        grads = _grads(ours, k)
        for p, q, g in zip(ours, ref, grads):
            p.main_grad, q.grad = g, g.to(dtype)
        opt.step()
        ref_opt.step()
        for i, (p, q, g) in enumerate(zip(ours, ref, grads)):
            del p.main_grad
            assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == dtype
            diff = (p.detach().double() - q.detach().double()).abs()
            assert bool((diff <= low_precision_ulp(q.detach())).all()), f"update {k}, param {i}: {float(diff.max())}"
            s, t = opt.state[p], ref_opt.state[q]
            g64, dg = g.double().abs(), unit_roundoff(dtype) * g.double().abs()  # g.to(dtype): one rounding
            for key, moved in (("exp_avg", (1 - beta1) * dg), ("exp_avg_sq", 2 * (1 - beta2) * g64 * dg * 1.01)):
                a, b = s[key].double(), t[key].double()
                bound = moved + low_precision_ulp(s[key]) + low_precision_ulp(t[key])
                assert bool(((a - b).abs() <= bound).all()), f"update {k}, param {i}: {key}"
            assert s["step"].item() == t["step"].item() == k + 1
        with torch.no_grad():  # re-sync: the next update starts from our state on both sides
            for p, q in zip(ours, ref):
                q.copy_(p)
                ref_opt.state[q]["exp_avg"].copy_(opt.state[p]["exp_avg"])
                ref_opt.state[q]["exp_avg_sq"].copy_(opt.state[p]["exp_avg_sq"])


@pytest.mark.parametrize("dtype", IN_PLACE_DTYPES)
def test_in_place_state_dict_round_trips_with_torch_adamw(dtype):
    """bf16 | fp16 moments load into torch.optim.AdamW over the same params unchanged (torch keeps them in the
    param dtype) and back into FusedAdamW in that dtype, bitwise; training goes on from the loaded state."""
    ps = [nn.Parameter(_in_place_state(n, dtype, seed=n)[0].detach()) for n in SIZES]
    opt = FusedAdamW(ps, lr=1e-2, weight_decay=0.05)
    for k in range(3):
        for p, g in zip(ps, _grads(ps, k)):
            p.main_grad = g
        opt.step()
    for p in ps:
        del p.main_grad
    saved = copy.deepcopy(opt.state_dict())
    torch_ps = [nn.Parameter(p.detach().clone()) for p in ps]
    torch_opt = torch.optim.AdamW(torch_ps, lr=0.5)
    torch_opt.load_state_dict(saved)
    back_ps = [nn.Parameter(p.detach().clone()) for p in ps]
    back = FusedAdamW(back_ps, lr=0.5)
    back.load_state_dict(torch_opt.state_dict())
    assert back.param_groups[0]["lr"] == 1e-2
    for p, q, r in zip(ps, torch_ps, back_ps):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch_opt.state[q][key].dtype == back.state[r][key].dtype == dtype
            assert_bitwise_equal(_bits(torch_opt.state[q][key]), _bits(opt.state[p][key]), f"torch {key}")
            assert_bitwise_equal(_bits(back.state[r][key]), _bits(opt.state[p][key]), f"back {key}")
        assert back.state[r]["step"].item() == 3.0
    for a, b in ((opt, ps), (back, back_ps)):  # the same next update from the original and the reloaded state
        for p, g in zip(b, _grads(b, 3)):
            p.main_grad = g
        a.step()
    for p, r in zip(ps, back_ps):
        assert_bitwise_equal(_bits(r.detach()), _bits(p.detach()), "param after the update from the loaded state")


@pytest.mark.parametrize("spoil, message", [
    pytest.param(lambda opt, p: opt.state[p].update(exp_avg=opt.state[p]["exp_avg"].float()),
                 r"state\['exp_avg'\] of param_groups\[0\]\['params'\]\[1\] must be a contiguous float16 tensor "
                 r"\(the parameter's dtype\).*torch.float32.*kept in its dtype", id="fp16-param-fp32-exp_avg"),
    pytest.param(lambda opt, p: opt.state[p].update(exp_avg_sq=opt.state[p]["exp_avg_sq"].bfloat16()),
                 r"state\['exp_avg_sq'\].*must be a contiguous float16.*torch.bfloat16", id="fp16-param-bf16-v"),
])
def test_in_place_state_of_another_dtype_raises_in_python(spoil, message, monkeypatch):
    """An fp16 parameter with an fp32 gradient and moments in another dtype: refused by step() in Python, naming
    the parameter, before any kernel (C++ or Triton) is called and before anything is written."""
    q = nn.Parameter(torch.randn(4))
    p = nn.Parameter(torch.randn(6).half())
    opt = FusedAdamW([q, p], backend="cpu" if _available("cpu") else "torch")
    q.grad, p.main_grad = torch.randn(4), torch.randn(6)
    opt.step()
    spoil(opt, p)
    before = _snapshot(opt, [q, p])

    def spy(*args, **kwargs):
        raise AssertionError("a kernel was called with arguments Python should have refused")

    monkeypatch.setattr(opt, "_kernel", lambda device: spy)
    with pytest.raises(ValueError, match=message):
        opt.step()
    _assert_unchanged(opt, [q, p], before, n_states=2)


def test_load_state_dict_keeps_fp32_moments_of_a_bf16_param_for_masters():
    """A master-weights checkpoint (fp32 moments) loaded into FusedAdamW over bf16 params keeps them fp32 (the
    masters GradientAccumulator swaps in take them unrounded); torch's bf16 moments stay bf16."""
    p = nn.Parameter(torch.randn(8).bfloat16())
    master = nn.Parameter(p.detach().float())
    fp32_opt = FusedAdamW([master])
    master.grad = torch.randn(8)
    fp32_opt.step()
    opt = FusedAdamW([p])
    opt.load_state_dict(fp32_opt.state_dict())
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert_bitwise_equal(opt.state[p]["exp_avg"], fp32_opt.state[master]["exp_avg"], "fp32 exp_avg kept")


# ------------------------------------------------------------------------------------- flat state, one call per group
def _three_groups(device, per_group=12, seed=0):
    """Three param groups of ``per_group`` params of assorted shapes, each group with its own lr / weight_decay."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (7,), (2, 3, 4), (1,), (65,), (4, 4)]
    groups = []
    for j, (lr, wd) in enumerate(((1e-2, 0.0), (3e-3, 0.1), (5e-2, 0.01))):
        params = [nn.Parameter(torch.randn(shapes[(i + j) % len(shapes)], generator=g).to(device))
                  for i in range(per_group)]
        groups.append({"params": params, "lr": lr, "weight_decay": wd})
    return groups


def _clone_groups(groups):
    return [{**grp, "params": [nn.Parameter(p.detach().clone()) for p in grp["params"]]} for grp in groups]


def _all_params(groups):
    return [p for grp in groups for p in grp["params"]]


def _assert_flat_moments(opt):
    """Each group's moments: contiguous, shaped like the param, views of one flat fp32 buffer of that group
    ([exp_avg | exp_avg_sq], aligned starts, zero padding); no two groups share a buffer; steps are 0-d."""
    storages = []
    for group in opt.param_groups:
        states = [opt.state[p] for p in group["params"]]
        flat_ptr = states[0]["exp_avg"].untyped_storage().data_ptr()
        used = set()
        for p, s in zip(group["params"], states):
            assert s["step"].dim() == 0 and s["step"].dtype == torch.float32
            for key in ("exp_avg", "exp_avg_sq"):
                t = s[key]
                assert t.shape == p.shape and t.is_contiguous() and t.dtype == torch.float32
                assert t.untyped_storage().data_ptr() == flat_ptr
                assert t.storage_offset() % gaengine.buffer.ALIGN_NUMEL == 0
                used.update(range(t.storage_offset(), t.storage_offset() + t.numel()))
            assert s["exp_avg_sq"].storage_offset() > s["exp_avg"].storage_offset()
        flat = torch.empty(0, device=states[0]["exp_avg"].device).set_(states[0]["exp_avg"].untyped_storage())
        padding = torch.ones(flat.numel(), dtype=torch.bool)
        padding[sorted(used)] = False
        assert not bool(flat[padding.to(flat.device)].any())
        storages.append(flat_ptr)
    assert len(set(storages)) == len(storages)


def _train_groups(opt, params, steps, seed):
    for k in range(steps):
        for p, g in zip(params, _grads(params, k, seed=seed)):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_one_kernel_call_per_param_group_per_step(backend, device):
    """3 groups x 12 params with their own lr / weight_decay: one kernel call per group per step, each with the
    whole group's lists and the group's hyper-parameters, and the result within RTOL of torch's AdamW."""
    groups = _three_groups(device)
    ref_groups = _clone_groups(groups)
    opt = FusedAdamW(groups, backend=backend)
    kernel = opt._kernel(device)
    calls = []

    def counting(params, *args):
        calls.append((len(params), args[5], args[9]))  # list length, lr, weight_decay
        return kernel(params, *args)

    opt._kernels[device] = counting
    ref = torch.optim.AdamW(ref_groups)
    ours, theirs = _all_params(groups), _all_params(ref_groups)
    for k in range(4):
        for p, q, g in zip(ours, theirs, _grads(ours, k)):
            p.grad, q.grad = g.clone(), g.clone()
        calls.clear()
        opt.step()
        ref.step()
        assert calls == [(12, grp["lr"], grp["weight_decay"]) for grp in groups], calls
    for p, q in zip(ours, theirs):
        assert rel_diff(p, q) <= RTOL
    _assert_flat_moments(opt)


def test_moments_created_later_get_their_own_flat_buffer():
    """A param of the group that first gets a gradient in a later step gets moments in a new flat buffer."""
    ps = _params("cpu", [5, 9, 70])
    opt = FusedAdamW(ps, backend="cpu" if _available("cpu") else "torch")
    ps[0].grad, ps[1].grad = torch.randn(5), torch.randn(9)
    opt.step()
    s0, s1 = opt.state[ps[0]], opt.state[ps[1]]
    assert s0["exp_avg"].untyped_storage().data_ptr() == s1["exp_avg_sq"].untyped_storage().data_ptr()
    assert ps[2] not in opt.state or not opt.state[ps[2]]
    ps[2].grad = torch.randn(70)
    opt.step()
    s2 = opt.state[ps[2]]
    assert s2["exp_avg"].untyped_storage().data_ptr() != s0["exp_avg"].untyped_storage().data_ptr()
    assert s2["exp_avg"].shape == ps[2].shape and float(s0["step"]) == 2.0 and float(s2["step"]) == 1.0


def _save_load(obj):
    import io  # noqa: PLC0415

    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


def test_flat_state_dict_round_trips_through_torch_adamw_and_torch_save():
    """FusedAdamW (flat moments, 3 groups) -> torch.save / torch.load(weights_only=True) -> torch.optim.AdamW ->
    torch.save / torch.load -> FusedAdamW (flat again): the moments are bit-identical at every hop and training
    continues as the uninterrupted optimizer does."""
    backend = "cpu" if _available("cpu") else "torch"
    groups = _three_groups("cpu")
    opt = FusedAdamW(groups, backend=backend)
    ours = _all_params(groups)
    _train_groups(opt, ours, 3, seed=4)
    _assert_flat_moments(opt)

    saved = _save_load(opt.state_dict())
    for i, p in enumerate(ours):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(saved["state"][i][key], opt.state[p][key], key)
    torch_groups = _clone_groups(groups)
    torch_opt = torch.optim.AdamW(torch_groups)
    torch_opt.load_state_dict(saved)
    theirs = _all_params(torch_groups)
    assert [g["lr"] for g in torch_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    _train_groups(opt, ours, 2, seed=5)
    _train_groups(torch_opt, theirs, 2, seed=5)
    for p, q in zip(ours, theirs):
        assert rel_diff(q, p) <= RTOL

    back_groups = _clone_groups(torch_groups)
    back = FusedAdamW(back_groups, backend=backend)
    back.load_state_dict(_save_load(torch_opt.state_dict()))
    _assert_flat_moments(back)
    back_params = _all_params(back_groups)
    for p, q in zip(theirs, back_params):
        assert float(back.state[q]["step"]) == 5.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(back.state[q][key], torch_opt.state[p][key], key)
            assert back.state[q][key].data_ptr() != torch_opt.state[p][key].data_ptr()
    _train_groups(back, back_params, 2, seed=6)
    _train_groups(torch_opt, theirs, 2, seed=6)
    for p, q in zip(theirs, back_params):
        assert rel_diff(q, p) <= RTOL
    _assert_flat_moments(back)


@pytest.mark.cuda
def test_one_cuda_kernel_launch_per_param_group():
    """On a GPU: ``opt.step()`` of 3 groups x 20 params launches exactly 3 CUDA kernels (csrc/cuda's multi-tensor
    AdamW, one launch per list of up to 384 params), counted by torch.profiler; no memcpy or memset either."""
    from torch.autograd import DeviceType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from gaengine.backends import cuda_kernels_unusable  # noqa: PLC0415

    why = cuda_kernels_unusable()
    if why is not None:
        pytest.skip(f"no CUDA kernels in gaengine._C (the Triton path launches once per parameter): {why}")
    device = torch.device("cuda")
    groups = _three_groups(device, per_group=20)
    opt = FusedAdamW(groups, backend="auto")
    params = _all_params(groups)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()  # creates the state (one fill per group buffer) and loads the kernel
    torch.cuda.synchronize()
    _assert_flat_moments(opt)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert len(gpu) == len(opt.param_groups) == 3, [e.name for e in gpu]
