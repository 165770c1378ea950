"""Two accumulators on one graph (issue 41, N10): a GAN's generator loss runs through the discriminator, so its
backward reaches the discriminator's parameters, which another accumulator holds.

The error names what happened and the two ways on; each way (the discriminator frozen for the generator's
windows, or ``acc.backward(loss, inputs=...)``) trains as the plain GAN recipe does in fp64 (docs/pitfalls.md).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gaengine
from tests.tolerances import RTOL

K = 2
LR = 0.1
ITERATIONS = 3


def _nets(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 3))
    disc = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    return gen, disc


def _batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 2, generator=g), torch.randn(4, 3, generator=g) + 1.0) for _ in range(2 * K * ITERATIONS)]


def _d_loss(gen, disc, z, real):
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = gen(z).detach()
    return bce(disc(real), torch.ones(len(real), 1, dtype=real.dtype)) + bce(disc(fake), torch.zeros(len(z), 1,
                                                                                                       dtype=z.dtype))


def _g_loss(gen, disc, z):
    return nn.functional.binary_cross_entropy_with_logits(disc(gen(z)), torch.ones(len(z), 1, dtype=z.dtype))


def _plain(gen, disc, batches) -> list[torch.Tensor]:
    """The plain GAN recipe with gradient accumulation, in fp64: each window zeroes its optimizer's gradients, sums
    ``loss / K`` over K micro-batches and steps (the generator's backward also fills the discriminator's ``.grad``,
    which the discriminator's next ``zero_grad()`` drops)."""
    gen, disc = copy.deepcopy(gen).double(), copy.deepcopy(disc).double()
    g_opt, d_opt = torch.optim.SGD(gen.parameters(), lr=LR), torch.optim.SGD(disc.parameters(), lr=LR)
    it = iter(batches)
    for _ in range(ITERATIONS):
        d_opt.zero_grad()
        for _ in range(K):
            z, real = next(it)
            (_d_loss(gen, disc, z.double(), real.double()) / K).backward()
        d_opt.step()
        g_opt.zero_grad()
        for _ in range(K):
            z, _ = next(it)
            (_g_loss(gen, disc, z.double()) / K).backward()
        g_opt.step()
    return [p.detach() for p in [*gen.parameters(), *disc.parameters()]]


def _accumulators(gen, disc):
    acc_g = gaengine.GradientAccumulator(gen, torch.optim.SGD(gen.parameters(), lr=LR), accumulation_steps=K,
                                         max_grad_norm=None, backend="torch")
    acc_d = gaengine.GradientAccumulator(disc, torch.optim.SGD(disc.parameters(), lr=LR), accumulation_steps=K,
                                         max_grad_norm=None, backend="torch")
    return acc_g, acc_d


@pytest.mark.parametrize("way", ["freeze", "inputs"])
def test_gan_recipe_trains_as_the_plain_recipe(way):
    gen, disc = _nets()
    expected = _plain(gen, disc, _batches())
    acc_g, acc_d = _accumulators(gen, disc)
    it = iter(_batches())
    for _ in range(ITERATIONS):
        for _ in range(K):
            z, real = next(it)
            acc_d.backward(_d_loss(gen, disc, z, real))
        assert acc_d.step() is not None
        if way == "freeze":  # the discriminator frozen for the generator's window, between its own windows
            disc.requires_grad_(False)
        for _ in range(K):
            z, _ = next(it)
            if way == "freeze":
                acc_g.backward(_g_loss(gen, disc, z))
            else:
                acc_g.backward(_g_loss(gen, disc, z), inputs=list(gen.parameters()))
        assert acc_g.step() is not None
        disc.requires_grad_(True)
    for i, (p, e) in enumerate(zip([*gen.parameters(), *disc.parameters()], expected)):
        # fp32 against fp64 through 2 x ITERATIONS SGD steps of a few small layers: a few dozen fp32 roundings
        tol = 64 * RTOL[torch.float32] * (1.0 + float(e.abs().max()))
        err = float((p.detach().double() - e).abs().max())
        assert err <= tol, f"{way}: parameter {i} off by {err:.3e} > {tol:.3e}"
    acc_g.close()
    acc_d.close()


def test_generator_loss_through_the_other_accumulator_names_what_happened():
    """Without either way the error says which parameter of which accumulator was reached, and how to go on; the
    discriminator's window (mid-window here) is kept bit for bit, and the generator's goes on after zero_grad()."""
    gen, disc = _nets()
    acc_g, acc_d = _accumulators(gen, disc)
    batches = _batches()
    acc_d.backward(_d_loss(gen, disc, *batches[0]))
    d_window = acc_d.main_grad.data.clone()
    with pytest.raises(RuntimeError) as err:
        acc_g.backward(_g_loss(gen, disc, batches[1][0]))
    message = str(err.value)
    for needed in ("another GradientAccumulator", "parameter '", "inside this accumulator's (A's) backward",
                   "requires_grad_(False)", "inputs=", "docs/pitfalls.md"):
        assert needed in message, f"{needed!r} not in: {message}"
    assert any(f"parameter {name!r}" in message for name, _ in disc.named_parameters())
    assert acc_d.num_micro_batches == 1 and torch.equal(acc_d.main_grad.data, d_window)
    assert all(p.grad is None for p in disc.parameters())
    acc_g.zero_grad()
    for z, _ in batches[2:2 + K]:
        acc_g.backward(_g_loss(gen, disc, z), inputs=list(gen.parameters()))
    assert acc_g.step() is not None
    acc_d.backward(_d_loss(gen, disc, *batches[1]))  # the discriminator's window completes
    assert acc_d.step() is not None
    acc_g.close()
    acc_d.close()
