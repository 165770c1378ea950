"""The Triton path through the engine: one launch per bucket, the free norm, determinism (interpreter on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from gaengine.backends import get_backend
from tests.tolerances import rel_diff

pytestmark = pytest.mark.interpreter

try:
    get_backend("triton", "cuda" if torch.cuda.is_available() else "cpu")
except RuntimeError as exc:  # pragma: no cover
    pytest.skip(f"triton backend unavailable: {exc}", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(24, 24) for _ in range(6)], nn.Linear(24, 3)).to(DEVICE)


def _run(model, backend, K=3, windows=2, bucket_size_mb=0.004, skip_last_layer_last_micro=False):
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=0.1, backend=backend,
                                       bucket_size_mb=bucket_size_mb)
    results, launches = [], []
    for w in range(windows):
        for k in range(K):
            x = torch.randn(4, 24, generator=torch.Generator().manual_seed(10 * w + k)).to(DEVICE)
            h = x
            for i, layer in enumerate(model):
                if skip_last_layer_last_micro and k == K - 1 and i == 3:
                    continue  # this layer gets no gradient in the last micro-batch
                h = torch.tanh(layer(h)) if i < len(model) - 1 else layer(h)
            before = acc.hooks.launches
            acc.backward(h.pow(2).mean())
            launches.append(acc.hooks.launches - before)
            r = acc.step()
        results.append(r)
    grads = [p.grad.clone() for p in model.parameters()]
    n_buckets = acc.hooks.num_buckets
    acc.close()
    return results, grads, launches, n_buckets


def test_one_launch_per_bucket_and_free_norm(monkeypatch):
    model = _model()
    ref_results, ref_grads, _, _ = _run(copy.deepcopy(model), "torch")
    calls = []
    backend = get_backend("triton", DEVICE)
    original = backend.l2norm_sq
    monkeypatch.setattr(backend, "l2norm_sq", lambda x: calls.append(x.numel()) or original(x))
    results, grads, launches, n_buckets = _run(model, "triton")
    assert n_buckets >= 3
    assert all(n <= n_buckets + 1 for n in launches), (launches, n_buckets)  # not one per parameter (14)
    assert calls == []  # every window's norm came from the last micro-batch's partials: no extra pass
    for r, q in zip(results, ref_results):
        assert rel_diff(r.grad_norm, q.grad_norm) <= 1e-5 and bool(r.clip_coef < 1)
    for g, q in zip(grads, ref_grads):
        assert rel_diff(g, q) <= 1e-5


def test_free_norm_is_deterministic():
    a, _, _, _ = _run(_model(), "triton")
    b, _, _, _ = _run(_model(), "triton")
    for x, y in zip(a, b):
        assert torch.equal(x.grad_norm, y.grad_norm)


def test_missing_gradient_falls_back_to_a_full_norm(monkeypatch):
    model = _model()
    ref_results, ref_grads, _, _ = _run(copy.deepcopy(model), "torch", skip_last_layer_last_micro=True)
    calls = []
    backend = get_backend("triton", DEVICE)
    original = backend.l2norm_sq
    monkeypatch.setattr(backend, "l2norm_sq", lambda x: calls.append(x.numel()) or original(x))
    results, grads, _, _ = _run(model, "triton", skip_last_layer_last_micro=True)
    assert len(calls) == 2  # one full pass per window: the partials missed a parameter
    for r, q in zip(results, ref_results):
        assert rel_diff(r.grad_norm, q.grad_norm) <= 1e-5
    for g, q in zip(grads, ref_grads):
        assert rel_diff(g, q) <= 1e-5
