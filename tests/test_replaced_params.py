"""A parameter replaced in the model after the accumulator was built is noticed (issue 41, N2).

``model.load_state_dict(sd, assign=True)``, a layer swapped for a new one, or ``p.data`` of another shape: the
model then computes with tensors the accumulator and the optimizer do not hold (the new ones kept autograd's raw
``.grad`` and never trained). gaengine refuses the next ``acc.backward()`` with a ``ValueError`` naming the
parameter, the window as it was; going on as the message says (values loaded in place, the layer put back) trains as
the plain recipe does in fp64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from tests.models import MLP
from tests.tolerances import RTOL

K = 2
LR = 0.1


def _setup(dtype=torch.float32):
    torch.manual_seed(0)
    model = MLP(6, 8, 3).to(dtype)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=K,
                                       max_grad_norm=None, backend="torch")
    return model, acc


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _loss(model, batch):
    dtype = next(model.parameters()).dtype
    return nn.functional.mse_loss(model(batch[0].to(dtype)), batch[1].to(dtype))


def _plain(model, windows) -> list[torch.Tensor]:
    """The plain recipe in fp64 from ``model``'s values: per window, the mean of its micro-batches' gradients and an
    SGD step."""
    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for window in windows:
        opt.zero_grad()
        for b in window:
            (_loss(ref, b) / len(window)).backward()
        opt.step()
    return [p.detach() for p in ref.parameters()]


def _assert_close(model, expected, eps, what):
    for (name, p), e in zip(model.named_parameters(), expected):
        # a few roundings of the forward, backward, sum and update in the parameters' dtype (fp32: the sum in fp32)
        tol = 64 * eps * (1.0 + float(e.abs().max()))
        err = float((p.detach().double() - e).abs().max())
        assert err <= tol, f"{what}: {name} off by {err:.3e} > {tol:.3e}"


def _window(acc):
    return acc.num_micro_batches, acc.main_grad.data.clone()


def _same_window(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master-weights"])
def test_load_state_dict_assign_is_refused_naming_the_parameter(dtype):
    """After ``load_state_dict(sd, assign=True)`` the model's parameters are new objects: the next ``backward()``
    raises naming one, the window as it was. Loading in place, as the message says, trains as the plain recipe."""
    model, acc = _setup(dtype)
    batches = _batches(3 * K)
    for b in batches[:K]:
        acc.backward(_loss(model, b))
    assert acc.step() is not None
    torch.manual_seed(3)
    other = MLP(6, 8, 3).to(dtype).state_dict()  # a checkpoint's values
    held = list(model.parameters())
    model.load_state_dict(copy.deepcopy(other), assign=True)
    assert all(p is not q for p, q in zip(model.parameters(), held))
    before = _window(acc)
    with pytest.raises(ValueError, match=r"parameter 'fc1\.weight' is another tensor.*assign=True"):
        acc.backward(_loss(model, batches[K]))
    assert _same_window(before, _window(acc))
    # the way on the message gives: the held parameters back, the checkpoint's values loaded in place
    for module, name in ((model.fc1, "weight"), (model.fc1, "bias"), (model.fc2, "weight"), (model.fc2, "bias"),
                         (model.head, "weight"), (model.head, "bias")):
        setattr(module, name, held.pop(0))
    model.load_state_dict(other)
    expected = _plain(model, [batches[K:2 * K], batches[2 * K:]])
    for b in batches[K:]:
        acc.backward(_loss(model, b))
        acc.step()
    eps = RTOL[torch.float32] if dtype == torch.float32 else RTOL[torch.bfloat16]
    _assert_close(model, expected, eps, f"{dtype} after load in place")
    acc.close()


def test_swapped_layer_is_refused_mid_window_with_the_window_kept():
    """``model.head = nn.Linear(...)`` in the middle of a window: the next micro-batch's ``backward()`` raises
    naming the layer's parameter, before anything of it is accumulated; the layer put back, the window completes as
    the plain recipe's."""
    model, acc = _setup()
    batches = _batches(K)
    expected = _plain(model, [batches])
    acc.backward(_loss(model, batches[0]))
    before = _window(acc)
    old = model.head
    model.head = nn.Linear(8, 3)
    with pytest.raises(ValueError, match=r"parameter 'head\.weight' is another tensor.*layer replaced"):
        acc.backward(_loss(model, batches[1]))
    assert _same_window(before, _window(acc))
    assert all(p.grad is None for p in model.head.parameters())
    model.head = old
    acc.backward(_loss(model, batches[1]))
    assert acc.step() is not None
    _assert_close(model, expected, RTOL[torch.float32], "window completed after the layer was put back")
    acc.close()


def _after_one_window():
    """A model and its accumulator one window in (a window boundary), and the next micro-batch."""
    model, acc = _setup()
    batches = _batches(K + 1)
    for b in batches[:K]:
        acc.backward(_loss(model, b))
    assert acc.step() is not None
    return model, acc, batches


def test_swapped_layer_at_a_window_boundary_is_refused():
    model, acc, batches = _after_one_window()
    model.fc2 = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"parameter 'fc2\.weight'"):
        acc.backward(_loss(model, batches[K]))
    assert acc.num_micro_batches == 0
    acc.close()


def test_parameter_data_of_another_shape_is_refused_at_the_window_start():
    model, acc, batches = _after_one_window()
    with torch.no_grad():
        model.head.bias.data = torch.zeros(5)
    model.head.weight.data = torch.zeros(5, 8)
    with pytest.raises(ValueError, match=r"parameter 'head\.(weight|bias)' is now \(5"):
        acc.backward(model(batches[K][0]).pow(2).mean())  # the output has 5 columns now
    acc.close()


def test_an_unrelated_model_built_meanwhile_is_not_a_replacement():
    """Registering parameters elsewhere (another model built between micro-batches) makes the watch look again, and
    find nothing replaced: the window trains as the plain recipe's."""
    model, acc = _setup()
    batches = _batches(K)
    expected = _plain(model, [batches])
    acc.backward(_loss(model, batches[0]))
    unrelated = MLP(3, 3, 3)
    acc.backward(_loss(model, batches[1]))
    assert acc.step() is not None and unrelated is not None
    _assert_close(model, expected, RTOL[torch.float32], "window with another model built in it")
    acc.close()
