"""Models and inputs several test files share (one definition each); a test file's own small model and loss stay
in that file."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.conftest import seeded_randn

# The arguments of `gaengine train` (gaengine.tools.cli) for a tiny language model that trains in seconds on CPU, one
# run (--no-benefit: tests/test_cli.py tests the benefit runs with TINY less that flag).
TINY = [
    "--micro-batch-size", "2", "--accumulation-steps", "2", "--seq-len", "16", "--n-layers", "1",
    "--d-model", "32", "--n-heads", "2", "--eval-batches", "1", "--eval-interval", "2",
    "--max-data-mb", "0.1", "--quiet", "--no-benefit",
]  # fmt: skip


class Net(nn.Module):
    """A tiny language model for the multi-rank tests: an embedding tied with the output layer (as in GPT-2), three
    residual tanh blocks, a layer no micro-batch uses and one that some ranks use (``use_side``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.unused = nn.Linear(4, 4)  # never used: must not hang any rank
        self.side = nn.Linear(16, 16)  # used by some ranks only
        self.out = nn.Linear(16, 11, bias=False)
        self.out.weight = self.emb.weight  # tied, as in GPT-2

    def forward(self, tokens, use_side=False):
        h = self.emb(tokens)
        for blk in self.blocks:
            h = h + torch.tanh(blk(h))
        if use_side:
            h = h + self.side(h)
        return self.out(h)


class MLP(nn.Module):
    """Two tanh hidden layers and a linear head: ``(..., d_in) -> (..., d_out)``."""

    def __init__(self, d_in=12, d_hidden=24, d_out=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class TinyLM(nn.Module):
    """Embedding tied with the output layer, as in GPT-2."""

    def __init__(self, vocab=17, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.emb(tokens))))


class Deep(nn.Module):
    """Three Linear+GELU blocks and a head, each block under activation checkpointing when ``how`` says so
    (``"reentrant"``, or any other value: non-reentrant)."""

    def __init__(self, how=None):
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for blk in self.blocks:
            if self.how is None:
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.how == "reentrant")
        return self.head(x)


D = 128  # a bucket past the CPU kernel's parallel grain: two sources on one slice would race


class SharedCheckpointed(nn.Module):
    """``shared`` (weight and bias) is used by two reentrant-checkpointed segments; ``nested`` inside a Function
    whose backward runs a nested backward; ``extra`` (one weight) and ``nested`` only when asked. Without them, two
    parameters miss the micro-batch and two arrive twice: as many arrivals as parameters, not all of them."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.shared = nn.Linear(D, D)
        self.mid = nn.Linear(D, D)
        self.extra = nn.Linear(D, D, bias=False)
        self.nested = nn.Parameter(torch.randn(D) * 0.1)
        self.out = nn.Linear(D, 1)

    def _seg1(self, h):
        return torch.tanh(self.shared(h))

    def _seg2(self, h):
        return torch.tanh(self.mid(self.shared(h)))

    def _seg2_alone(self, h):
        return torch.tanh(self.mid(h))

    def forward(self, x, extra=True, twice=True):
        h = self.inp(x)
        h = checkpoint(self._seg1, h, use_reentrant=True)
        h = checkpoint(self._seg2 if twice else self._seg2_alone, h, use_reentrant=True)
        if extra:
            h = h + self.extra(h)
            h = NestedBackward.apply(h, self.nested)
        return self.out(h).float().pow(2).mean()


class NestedBackward(torch.autograd.Function):
    """y = x * w; backward also runs ``torch.autograd.backward`` on a term of ``w``: w's hook fires in that nested
    pass and again when the outer pass reaches w's AccumulateGrad."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            wd = w.detach().requires_grad_(False)
            torch.autograd.backward((w * wd).sum())  # the nested pass: d/dw = w, accumulated into w.grad
        return grad * w, (grad * x).reshape(-1, D).sum(0)


def shared_batches(k_total, dtype, seed=0):
    """``k_total`` micro-batches ``(3, D)`` for ``SharedCheckpointed``, in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return [seeded_randn(3, D, generator=g).to(dtype) for _ in range(k_total)]
