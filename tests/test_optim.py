"""``gaengine.optim.FusedAdamW`` against ``torch.optim.AdamW`` (the reference), on every kernel path.

Budgets: over 10 updates the fp32 parameters are within 1e-6 relative (``tests/tolerances.py::rel_diff``)
of the default ``torch.optim.AdamW`` fed ``grad / grad_scale``; the C++ kernel is bitwise equal to
``torch.optim.AdamW(fused=True)`` on CPU outside torch's scalar tail (x86-64); the C++ (AVX2 and portable)
and Triton paths give the same bits; attached bf16/fp16 model parameters are bitwise ``master.to(dtype)``;
a skipped update (``found_inf``) changes no bit anywhere. The Triton path runs on CPU tensors under
``TRITON_INTERPRET=1`` without a GPU (small tensors), on CUDA tensors with one.
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gaengine
from gaengine.backends import get_backend
from gaengine.optim import FusedAdamW
from tests.tolerances import assert_bitwise_equal, rel_diff

RTOL = 1e-6
SIZES = [1, 127, 4097]  # one element, a partial vector, one past a CPU block / two Triton blocks
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _backend_params() -> list:
    out = [pytest.param("torch", torch.device("cpu"), id="torch")]
    for name, device in (("cpu", torch.device("cpu")), ("triton", TRITON_DEVICE)):
        try:
            get_backend(name, device)
            available = name != "cpu" or hasattr(get_backend("cpu")._C, "adamw_step_")
        except RuntimeError:
            available = False
        marks = [pytest.mark.skip(reason=f"backend {name!r} unavailable")] if not available else []
        if name == "triton":
            marks.append(pytest.mark.interpreter)
        out.append(pytest.param(name, device, id=name, marks=marks))
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
        pytest.skip("gaengine._C.adamw_step_ unavailable")
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


def _special_grads(n: int, dtype: torch.dtype, k: int) -> torch.Tensor:
    """Gradients with the values a division shortcut gets wrong: +-0, subnormals, tiny and huge magnitudes
    (a huge one makes v = inf), in otherwise random vectors, so vector lanes mix them with normal values."""
    g = torch.randn(n) * 5
    specials = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1e-35, 2.0**-101, 2.0**-99, 1e30, -2.0**100, 2.0**99])
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(k))[: 4 * len(specials)]
    g[idx] = specials.repeat(4)
    return g.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else g.to(dtype)  # finite in fp16 too


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: 1e30 / 2^-30 overflows, as it should
@pytest.mark.parametrize("grad_scale", [2.5, 2.0**-30, 3.0e7], ids=["scale2.5", "scale2^-30", "scale3e7"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["g-fp32", "g-bf16", "g-fp16"])
@pytest.mark.parametrize("model_dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16-model", "fp16-model"])
def test_cpu_and_triton_kernels_agree_bitwise(model_dtype, grad_dtype, grad_scale):
    """The C++ and Triton kernels are two implementations of one specification: the same bits (on CPU tensors).

    The Triton kernel divides with IEEE division (div_rn); the C++ one replaces the two divisions by a scalar
    with Markstein's correction where that is exact, and divides elsewhere: special values and grad scales
    outside [2^-20, 2^20] take those other paths. beta2 = 1 - 1e-13 makes sqrt(1 - beta2^t) < 2^-20."""
    if TRITON_DEVICE.type != "cpu" or not (_available("cpu") and _available("triton")):
        pytest.skip("needs both kernels on CPU tensors (gaengine._C and the Triton interpreter)")
    from gaengine import _C
    from gaengine.kernels import adamw

    n = 3000
    tensors = {}
    for name in ("cpu", "triton"):
        torch.manual_seed(0)
        p, m, v = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01
        step = torch.tensor(3.0)
        model = None if model_dtype is None else torch.full((n,), float("nan"), dtype=model_dtype)
        for k in range(4):
            g = _special_grads(n, grad_dtype, k) if k % 2 else (torch.randn(n) * 5).to(grad_dtype)
            beta2 = 1.0 - 1e-13 if k == 3 else 0.999
            args = ([p], [g], [m], [v], [step], [model], 1e-2, 0.9, beta2, 1e-8, 0.1, k == 2,
                    torch.tensor(grad_scale), torch.tensor(0.0))
            _C.adamw_step_(*args) if name == "cpu" else adamw.adamw_step_(*args, block_size=512)
        tensors[name] = [p, m, v, step] + ([model] if model is not None else [])
    for a, b, what in zip(tensors["cpu"], tensors["triton"], ["param", "exp_avg", "exp_avg_sq", "step", "model"]):
        if a.dtype != torch.float32:
            a, b = a.view(torch.int16), b.view(torch.int16)  # bits, not values
        assert_bitwise_equal(b, a, f"triton vs cpu: {what}")
    p, finite = tensors["cpu"][0], tensors["cpu"][0].isfinite()  # 1e30 / 2^-30 overflows: some params are NaN
    if model_dtype is not None:
        assert_bitwise_equal(tensors["cpu"][4][finite].view(torch.int16), p[finite].to(model_dtype).view(torch.int16),
                             "model == master.to(dtype)")


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "misaligned"])
def test_large_param_streams_the_model_write_exactly(offset, model_dtype):
    """From 2^20 elements the C++ kernel writes the model copy with non-temporal stores, after peeling
    elements up to a 16-byte boundary: the bits are those of the cached path and of master.to(dtype)."""
    if not _available("cpu"):
        pytest.skip("gaengine._C.adamw_step_ unavailable")
    from gaengine import _C

    n = (1 << 20) + 13
    runs = []
    for attach in (True, False):
        torch.manual_seed(0)
        p, m, v, step = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01, torch.tensor(1.0)
        buf = torch.full((n + offset,), float("nan"), dtype=model_dtype)
        model = buf[offset:] if attach else None
        g = torch.randn(n)
        _C.adamw_step_([p], [g], [m], [v], [step], [model], 1e-2, 0.9, 0.999, 1e-8, 0.1, False, None, None)
        runs.append((p, m, v, model, buf))
    (p, m, v, model, buf), (p0, m0, v0, _, _) = runs
    for a, b, what in ((p, p0, "param"), (m, m0, "exp_avg"), (v, v0, "exp_avg_sq")):
        assert_bitwise_equal(a, b, what)
    assert_bitwise_equal(model, p.to(model_dtype), "streamed model == master.to(dtype)")
    assert bool(buf[:offset].isnan().all())  # nothing written before the view


_PORTABLE_CHECK = textwrap.dedent("""
    import torch
    from gaengine import _C
    torch.manual_seed(0)
    n = 4097 + 13
    p, m, v, step = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01, torch.tensor(2.0)
    model = torch.empty(n, dtype=torch.bfloat16)
    specials = torch.tensor([0.0, -0.0, 1e-40, 1e-35, 2.0**-101, 2.0**-99, 1e30, -2.0**100])
    for k in range(4):
        g = torch.randn(n) * 3
        g[torch.randperm(n)[:64]] = specials.repeat(8)
        _C.adamw_step_([p], [g.to(torch.bfloat16)], [m], [v], [step], [model], 1e-2, 0.3 if k == 1 else 0.9,
                       1.0 - 1e-13 if k == 3 else 0.999, 1e-8, 0.1, False,
                       torch.tensor(2.0**-30 if k == 2 else 0.7), None)
    torch.save([p, m, v, step, model], __import__("sys").argv[1])
""")


def test_portable_and_avx2_kernels_give_the_same_bits(tmp_path):
    """The portable kernel divides; the AVX2 one uses Markstein's correction where exact: same bits, special
    gradients (+-0, subnormal, tiny, huge), grad scales outside [2^-20, 2^20] and a tiny sqrt(bc2) included."""
    if not _available("cpu"):
        pytest.skip("gaengine._C.adamw_step_ unavailable")
    root = Path(__file__).resolve().parent.parent
    out = {}
    for isa in ("auto", "portable"):
        env = {**os.environ, "GAENGINE_CPU_ISA": isa}
        path = tmp_path / f"{isa}.pt"
        proc = subprocess.run([sys.executable, "-c", _PORTABLE_CHECK, str(path)], env=env, cwd=root,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[isa] = torch.load(path)
    for a, b, what in zip(out["auto"], out["portable"], ["param", "exp_avg", "exp_avg_sq", "step", "model"]):
        if a.dtype != torch.float32:
            a, b = a.view(torch.int16), b.view(torch.int16)  # bits, not values (some params overflow to NaN)
        assert_bitwise_equal(b, a, f"portable vs auto: {what}")


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


def test_low_precision_param_with_grad_raises_before_writing():
    p = nn.Parameter(torch.randn(8).to(torch.bfloat16))
    q = nn.Parameter(torch.randn(8))
    before = q.detach().clone()
    opt = FusedAdamW([q, p])
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    with pytest.raises(ValueError, match="float32"):
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


# adamw_step_'s TORCH_CHECKs (csrc/adamw.cpp) on gaengine._C directly, in a child process
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
]


def test_cpu_extension_contract_errors():
    if not _available("cpu"):
        pytest.skip("gaengine._C.adamw_step_ unavailable")
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
        pytest.skip("gaengine._C.adamw_step_ unavailable")
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


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 48), nn.Linear(48, 48), nn.Linear(48, 7)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


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
        assert rel_diff(a.float(), b.float()) <= 2.0**-8, name  # bf16 params: at most an ulp apart
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
