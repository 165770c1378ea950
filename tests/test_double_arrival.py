"""A parameter whose AccumulateGrad hook fires more than once in one ``acc.backward()``.

A layer shared by two segments under reentrant activation checkpointing (``use_reentrant=True``) gets one
arrival per segment: each segment's backward is its own autograd pass. So does a parameter used inside a custom
autograd Function whose backward runs a nested backward. A later arrival must be added to what the micro-batch
already wrote or holds for the parameter, never become a second source on the same slice nor a second count
toward its bucket's readiness.

References, both independent of gaengine: one ATen op per arrival (``copy_`` on the window's first arrival,
``add_`` after it, fp32, in post-accumulate hooks on a copy of the model: the bits gaengine must produce), and the
plain recipe (fp32 ``.grad`` accumulated by autograd, divided by K).
"""

from __future__ import annotations

import copy

import pytest
import torch

import gaengine
from tests.conftest import backend_hook_params
from tests.models import SharedCheckpointed, shared_batches
from tests.oracle_hooks import use_hooks
from tests.tolerances import assert_bitwise_equal, norm_rtol, rel_diff

def _per_arrival_reference(model):
    """Hooks on ``model``'s params doing one ATen op per arrival into fp32 sums: the bits gaengine must produce."""
    sums: dict[str, torch.Tensor] = {}
    written: set[str] = set()

    def make(name):
        def hook(p):
            g = p.grad.reshape(-1)
            p.grad = None
            if name not in written:
                written.add(name)
                sums[name] = torch.empty(g.numel(), dtype=torch.float32).copy_(g)
            else:
                sums[name].add_(g)
        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(make(name))
    return sums, written


def _main_grad_by_name(acc, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: acc.main_grad.flat_views[i] for i, p in enumerate(acc.params)}, \
        {names[id(p)] for p, w in zip(acc.params, acc.hooks.accumulated) if w}


def _index(acc, param):
    return next(i for i, p in enumerate(acc.params) if p is param)


CONFIGS = backend_hook_params()  # every backend here with each of its hooks (tests/conftest.py)


@pytest.mark.parametrize("bucket_size_mb", [1e-6, 25.0], ids=["bucket-per-param", "one-bucket"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend,hot_path", CONFIGS, indirect=["backend"])
def test_double_arrival_equals_one_op_per_arrival(backend, hot_path, dtype, bucket_size_mb, monkeypatch):
    use_hooks(monkeypatch, hot_path)
    torch.manual_seed(0)
    model = SharedCheckpointed().to(dtype)
    ref = copy.deepcopy(model)
    sums, ref_written = _per_arrival_reference(ref)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=None, backend=backend,
                                       bucket_size_mb=bucket_size_mb)
    assert acc.hooks.native == (hot_path == "native")
    batches = shared_batches(9, dtype)
    for window in range(3):  # the first window learns the layout and the arrivals; later ones use both
        sums.clear()
        ref_written.clear()
        for k in range(3):
            x = batches[window * 3 + k]
            extra = k != 2  # `extra` and `nested` miss the last micro-batch
            acc.backward(model(x, extra=extra))
            ref(x, extra=extra).backward()
        got, written = _main_grad_by_name(acc, model)
        assert written == ref_written == {n for n, _ in model.named_parameters()}
        for name in written:
            assert_bitwise_equal(got[name], sums[name], f"window {window}: {name}")
        # The free norm must cover every parameter: `shared` arriving twice cannot stand in for `extra`, `nested`
        # (without them it is over 80% smaller). An fp32 norm of n elements, in whatever order the backend sums.
        result = acc.step()
        expected_norm = torch.sqrt(sum((s.double() / 3).pow(2).sum() for s in sums.values()))
        n = sum(p.numel() for p in model.parameters())
        assert rel_diff(result.grad_norm.double(), expected_norm) <= norm_rtol(n), f"window {window}"
        acc.zero_grad()


@pytest.mark.parametrize("bucket_size_mb", [1e-6, 25.0], ids=["bucket-per-param", "one-bucket"])
@pytest.mark.parametrize("backend,hot_path", CONFIGS, indirect=["backend"])
def test_double_arrival_equals_the_plain_recipe(backend, hot_path, bucket_size_mb, monkeypatch):
    """fp32 through the whole engine, against autograd's own fp32 ``.grad`` accumulation divided by K."""
    use_hooks(monkeypatch, hot_path)
    torch.manual_seed(0)
    model = SharedCheckpointed()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=4, max_grad_norm=None, backend=backend,
                                       bucket_size_mb=bucket_size_mb)
    batches = shared_batches(8, torch.float32, seed=1)
    for window in range(2):
        for k in range(4):
            acc.backward(model(batches[window * 4 + k]))
            ref(batches[window * 4 + k]).backward()
        acc.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # The same fp32 adds in the same order on both sides, then an exact 1/4: bitwise.
            assert_bitwise_equal(p.grad, q.grad / 4, f"window {window}: {name}")
        ref.zero_grad(set_to_none=True)
        acc.zero_grad()


def test_double_arrival_through_the_optimizer_and_a_new_layout(monkeypatch):
    """AdamW over three windows, the layout re-learned after the first: parameters equal the plain recipe's."""
    torch.manual_seed(0)
    model = SharedCheckpointed()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=None, bucket_size_mb=1e-4)
    batches = shared_batches(6, torch.float32, seed=2)
    for window in range(3):
        for k in range(2):
            acc.backward(model(batches[window * 2 + k]))
            ref(batches[window * 2 + k]).backward()  # the nested pass is not scaled by a loss factor: divide after
        acc.step()
        for q in ref.parameters():
            q.grad /= 2
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # bitwise gradients, the same fused AdamW
        assert_bitwise_equal(p.detach(), q.detach(), name)


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_arrivals_per_backward_are_learned_and_survive_a_state_dict(hot_path, monkeypatch):
    use_hooks(monkeypatch, hot_path)
    torch.manual_seed(0)
    model = SharedCheckpointed()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None)
    acc.backward(model(shared_batches(1, torch.float32)[0]))
    learned = {i for i, n in enumerate(acc.hooks.expected_arrivals) if n == 2}
    assert learned == {_index(acc, model.shared.weight), _index(acc, model.shared.bias), _index(acc, model.nested)}
    state = acc.state_dict()
    acc.close()
    other = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None)
    other.load_state_dict(state)
    assert other.hooks.expected_arrivals[_index(other, model.shared.weight)] == 2
