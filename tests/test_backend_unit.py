"""A kernel backend is one unit: ``Counted``, defined in this file alone, is registered through the one extension point
(``gaengine.backends.register_backend``: its name, its device types) and runs a whole accumulation window, its
clipping and the fused optimizers' steps (``FusedAdamW``, ``FusedLion``: ``Backend.optimizer_step``) with nothing in
gaengine told about it; every one of its kernels counts its calls, so a registration the engine or an optimizer
ignored (or a per-backend table an optimizer kept) fails here. Its kernels are the torch reference's; the results are
checked against the plain PyTorch recipe (``torch.optim.AdamW``) and an fp64 Lion written here, within the budgets of
``tests/tolerances.py``. Also: the registration's refusals leave the registry as it was, a backend that cannot load
or run on a device says so by name, registering one changes no ``"auto"`` choice, and no optimizer module keeps a
table keyed by backend names.
"""

from __future__ import annotations

import ast
import collections
import copy
from pathlib import Path

import pytest
import torch

import gaengine
from gaengine import backends
from gaengine.backends import Backend, ReferenceBackend, get_backend, register_backend
from gaengine.contract import FusedStep
from gaengine.optim import FusedAdamW, FusedLion
from tests.conftest import seeded_randn
from tests.models import MLP
from tests.tolerances import (adamw_param_rtol, clip_coef_rtol, network_rtol, norm_rtol, rel_diff, split_batch_rtol,
                              unit_roundoff)

ROOT = Path(__file__).resolve().parents[1]


class Counted(Backend):
    """A backend of its own: the torch reference's kernels, each call counted in ``calls`` (op name, or
    ``"step:<optimizer>"`` for a fused optimizer's step). CPU tensors; the hooks are ``gaengine._C``'s, which call
    its ``accumulate_bucket_`` registered as an op (``Backend.hot_path_namespace``)."""

    name = "counted"
    partials_dim = ReferenceBackend.partials_dim

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._ref = ReferenceBackend()

    def _call(self, op, *args, **kwargs):
        self.calls[op] += 1
        return getattr(self._ref, op)(*args, **kwargs)

    def accumulate_(self, dst, src, scale=1.0, overwrite=False):
        return self._call("accumulate_", dst, src, scale, overwrite)

    def l2norm_sq(self, x):
        return self._call("l2norm_sq", x)

    def scale_(self, x, coef):
        return self._call("scale_", x, coef)

    def accumulate_bucket_(self, dst, srcs, offsets, overwrite, partials=None, source_partials=None):
        return self._call("accumulate_bucket_", dst, srcs, offsets, overwrite, partials, source_partials)

    def new_bucket_partials(self, numels, device):
        return self._call("new_bucket_partials", numels, device)

    def finish_norm_partials(self, partials):
        return self._call("finish_norm_partials", partials)

    def extension(self):
        return backends.load_extension()

    def optimizer_step(self, step: FusedStep):
        reference, where = super().optimizer_step(step)  # the optimizer's plain-torch step

        def counted(*args, **kwargs):
            self.calls[f"step:{step.name}"] += 1
            reference(*args, **kwargs)

        return counted, f"counted {where}"


# One instance for the process: the hot path's op gaengine_counted::accumulate_bucket_ is registered once and calls it.
COUNTED = Counted()


@pytest.fixture
def counted(monkeypatch):
    """``COUNTED`` registered as ``"counted"`` (CPU tensors) for this test, its counts zeroed; the registry and the
    backend caches are restored afterwards."""
    pytest.importorskip("gaengine._C", reason="the hooks are gaengine._C's")
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "_instances", dict(backends._instances))
    monkeypatch.setattr(backends, "_load_errors", dict(backends._load_errors))
    monkeypatch.delenv("GAENGINE_BACKEND", raising=False)
    register_backend("counted", lambda: COUNTED, device_types=("cpu",))
    COUNTED.calls.clear()
    return COUNTED


def _mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def test_a_window_and_fused_adamw_run_on_a_backend_registered_here(counted):
    """GradientAccumulator(backend="counted") + FusedAdamW(backend="counted"): every bucket accumulated, the norm
    finished and the AdamW step run by the registered backend's kernels, and the parameters those of the plain recipe
    (one large batch, ``clip_grad_norm_``, ``torch.optim.AdamW``) within the budget of ``tests/tolerances.py``."""
    K, B, windows, max_norm, lr = 3, 4, 2, 0.05, 1e-2
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, FusedAdamW(model.parameters(), lr=lr, weight_decay=0.1,
                                                         backend="counted"),
                                       accumulation_steps=K, max_grad_norm=max_norm, backend="counted")
    assert acc.backend is counted
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1)
    n = sum(p.numel() for p in model.parameters())
    grad_rtol = split_batch_rtol(K * B) + 2 * network_rtol(3, 24, products_per_layer=2) + 2 * clip_coef_rtol(n)
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(windows):
            x, y = seeded_randn(K * B, 12, generator=gen), seeded_randn(K * B, 5, generator=gen)
            for k in range(K):
                acc.backward(_mse(model, x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]))
                result = acc.step()
            _mse(ref, x, y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            assert not bool(result.skipped) and float(result.clip_coef) < 1.0  # clipping is active
            assert rel_diff(result.grad_norm, ref_norm) <= grad_rtol + 2 * norm_rtol(n)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel_diff(p, q) <= adamw_param_rtol(q, lr, windows, grad_rtol), name
    finally:
        acc.close()
    calls = counted.calls
    assert calls["accumulate_bucket_"] >= K * windows, calls  # the hot path called its bucket kernel
    assert calls["finish_norm_partials"] >= windows, calls  # the window's norm from its partials
    assert calls["step:adamw"] == windows, calls  # FusedAdamW ran its AdamW step, once per window


def _lion_fp64(p, m, g, lr, beta1, beta2, weight_decay):
    """One Lion update in fp64 (Chen et al. 2023, Algorithm 2, decoupled weight decay): new (p, m) and c."""
    p, m, g = p.double(), m.double(), g.double()
    c = beta1 * m + (1 - beta1) * g
    return p * (1 - lr * weight_decay) - lr * torch.sign(c), beta2 * m + (1 - beta2) * g, c


def test_fused_lion_runs_the_registered_backends_step(counted):
    """FusedLion(backend="counted"): its step is the registered backend's kernel (counted once per ``step()``),
    and each step's parameters and momentum are within a few fp32 roundings of an fp64 Lion from the same state."""
    lr, (beta1, beta2), wd = 1e-2, (0.9, 0.99), 0.1
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=gen).requires_grad_() for n in (1, 127, 513)]
    opt = FusedLion(params, lr=lr, betas=(beta1, beta2), weight_decay=wd, backend="counted")
    u = unit_roundoff(torch.float32)
    for step in range(3):
        before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone() if opt.state.get(p)
                   else torch.zeros_like(p.detach())) for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        assert counted.calls["step:lion"] == step + 1
        for (p0, m0), p in zip(before, params):
            p64, m64, c64 = _lion_fp64(p0, m0, p.grad, lr, beta1, beta2, wd)
            g = p.grad.double().abs()
            assert not bool((c64.abs() <= 3 * u * (beta1 * m0.double().abs() + (1 - beta1) * g)).any()), \
                "a draw with c too close to 0 for its fp32 sign to be certain"
            assert bool(((p.detach().double() - p64).abs() <= 2 * u * (p0.double().abs() + lr)).all())
            m = opt.state[p]["exp_avg"].double()
            assert bool(((m - m64).abs() <= 3 * u * (beta2 * m0.double().abs() + (1 - beta2) * g) + 1e-300).all())


def test_registering_changes_no_auto_choice_and_the_device_types_hold(counted):
    """A backend registered without ``auto_for`` is picked by name only; asked for on a device type it was not
    registered for, ``get_backend`` raises ``RuntimeError`` naming the backend and the device."""
    assert "counted" in backends.BACKEND_NAMES and get_backend("auto", "cpu") is not counted
    assert get_backend("counted", "cpu") is counted
    with pytest.raises(RuntimeError, match=r"backend 'counted' runs on CPU tensors only, got device meta"):
        get_backend("counted", "meta")
    with pytest.raises(RuntimeError, match="backend 'counted' runs on CPU tensors only"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(2, device="meta"))], backend="counted")._kernel(
            torch.device("meta"))


def test_a_backend_that_cannot_load_says_why_by_name_and_auto_passes_it_by(counted, monkeypatch):
    def broken():
        raise ImportError("its kernels are not built")

    register_backend("broken", broken, auto_for=("cpu",), auto_rank=99)  # auto tries it first on CPU
    with pytest.raises(RuntimeError, match="backend 'broken' could not be loaded: its kernels are not built"):
        get_backend("broken", "cpu")
    monkeypatch.setattr(backends, "_announced", set())
    assert get_backend("auto", "cpu") is get_backend("cpu", "cpu")  # the next candidate: gaengine's own


def test_a_refused_registration_leaves_the_registry_as_it_was(counted):
    before = dict(backends._REGISTRY)
    for name, factory, what in (("auto", Counted, "name must be a Python identifier other than 'auto'"),
                                ("two words", Counted, "name must be a Python identifier"),
                                ("counted", Counted, "a backend 'counted' is already registered"),
                                ("other", None, "factory must be a callable")):
        with pytest.raises(ValueError, match=what):
            register_backend(name, factory)
        assert backends._REGISTRY == before and tuple(backends.BACKEND_NAMES) == ("auto", *before)


def _backend_keyed_dicts(source: str, label: str, names: set[str]) -> list[str]:
    """``label:line`` of each dict display in ``source`` with two or more backend names among its string keys."""
    found = []
    for node in ast.walk(ast.parse(source, label)):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if len(keys & names) >= 2:
                found.append(f"{label}:{node.lineno}")
    return found


def test_no_optimizer_module_keeps_a_table_of_backends():
    """The fused optimizers (``gaengine/optim.py``) and their kernels (``gaengine/kernels/``) hold no dict keyed by
    backend names: a new backend is found through the registry (``Backend.optimizer_step``), not added to a table
    per optimizer."""
    names = {n for n in backends.BACKEND_NAMES if n != "auto"}
    assert _backend_keyed_dicts('T = {"torch": f, "cpu": g}', "probe", names) == ["probe:1"]  # the checker sees one
    files = [ROOT / "gaengine" / "optim.py", *sorted((ROOT / "gaengine" / "kernels").glob("*.py"))]
    offenders = [hit for path in files for hit in _backend_keyed_dicts(path.read_text(), str(path.relative_to(ROOT)),
                                                                       names)]
    assert not offenders, offenders
