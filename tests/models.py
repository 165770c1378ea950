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

# ----------------------------------------------------------------------------------------------------- the model


class OddSizesNet(nn.Module):
    """Odd sizes (a 4773-element weight: two bucket chunks; 1, 37, 65, 129 elements), a tied weight (``enc.weight``
    used twice: AccumulateGrad sums both uses, one arrival), an empty parameter (0 elements, used), and optionally
    an unused branch (no gradient: its bucket is launched incomplete in ``end()``, the norm needs a pass)."""

    def __init__(self, dtype: torch.dtype, unused: bool):
        super().__init__()
        self.enc = nn.Linear(37, 129)
        self.mid = nn.Linear(129, 65)
        self.out = nn.Linear(65, 1)
        self.gain = nn.Parameter(torch.randn(1) * 0.5 + 1)
        self.empty = nn.Parameter(torch.zeros(0))
        self.unused = nn.Linear(5, 3) if unused else None
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x))
        back = h @ self.enc.weight  # the tied use
        y = self.out(torch.tanh(self.mid(h))) * self.gain + self.empty.sum()
        return y.float().pow(2).sum(-1) + 0.1 * back.float().pow(2).mean(-1)  # per item


class ManySmallParams(nn.Module):
    """800 parameters of 1..23 elements, alternately fp32 and bf16: more sources than one bucket launch takes (512:
    a split launch, its partials columns after the first launch's) and more parameters than one AdamW launch takes
    (384) in each of its two dtype groups. Plus two pairs used through torch.cat, whose second gradient autograd
    hands over as a view 3 elements into the cat's gradient (12 or 6 bytes off 16: the bucket kernel's unaligned
    path)."""

    def __init__(self, n: int = 800):
        super().__init__()
        dtypes = (torch.float32, torch.bfloat16)
        self.ws = nn.ParameterList(nn.Parameter((torch.randn(1 + i % 23) * 0.3).to(dtypes[i % 2])) for i in range(n))
        self.pairs = nn.ParameterList(nn.Parameter((torch.randn(n_el) * 0.1).to(dtype))
                                      for dtype in dtypes for n_el in (3, 4097))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.float().mean(-1, keepdim=True)
        total = sum(torch.tanh(w.float() * s).sum(-1) for w in self.ws)
        for a, b in zip(self.pairs[0::2], self.pairs[1::2]):
            c = torch.cat([a, b]).float()
            total = total + (c * c.roll(1) * s).sum(-1)
        return total.pow(2)


class HoldsWrapped(nn.Module):
    """A plain module holding a DDP-wrapped layer inside (as Lightning Fabric's ``_FabricModule`` holds one)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.body = nn.Sequential(inner)

    def forward(self, x):
        return self.body(self.head(x))


class ThreeBlocks(nn.Module):
    """Three blocks (each its own ``fully_shard`` group, tests/test_fsdp2.py) and a side head no case calls in
    ``unused``. ``d_out`` = 5 rows shard unevenly over 2, 3 and 4 ranks (a rank may hold none of a bias)."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.l0 = nn.Linear(d_in, hidden)
        self.l1 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)
        self.side = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        out = self.head(h)
        return out + self.side(h) if use_side else out


class TiedLinears(nn.Module):
    """A tied embedding / LM head (one contribution fused, one through AccumulateGrad) and a Linear used twice."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.head(h)


class CheckpointedLinears(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)  # used by two checkpointed segments: two arrivals per backward when reentrant
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=self.reentrant)
        return self.out(h)


class Chain(nn.Module):
    """``n_params`` small parameters (16 elements each, bf16 or fp32), every one used by each forward."""

    def __init__(self, n_params: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(16, dtype=dtype) * 0.1) for _ in range(n_params))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x * w + 0.1)
        return x


class TwoStreams(torch.nn.Module):
    """`side`'s forward (so its backward and its gradients) runs on a side stream, slowed by a sleep kernel, while
    the rest runs on the caller's stream: a bucket mixes gradients made ready on two streams."""

    def __init__(self, d=256):
        super().__init__()
        self.main = torch.nn.Linear(d, d)
        self.side = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, 1)
        self.stream = None

    def forward(self, x):
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(1_000_000)  # the side stream runs late
            s = torch.tanh(self.side(x))
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.out(torch.tanh(self.main(x)) + s).float().pow(2).mean()

# ---------------------------------------------------------------- models and data


class RegressionModel(nn.Module):
    """y = a x + b with an MSE loss: the Trainer test suite's regression model (tests/trainer/test_trainer.py)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Parameter(torch.zeros((), dtype=dtype))
        self.b = nn.Parameter(torch.zeros((), dtype=dtype))
        self.poison = False  # a test sets it to make the loss non-finite

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        loss = nn.functional.mse_loss(y.float(), labels)
        return (loss * float("inf") if self.poison else loss, y)

# ---------------------------------------------------------------- the model parameters in one flat buffer per dtype


class MixedDtypes(nn.Module):
    """bf16, fp16 and fp32 parameters. ``head`` is registered first and used last, so the gradients arrive in
    an order other than the initial layout's (reverse registration) and the layout is re-learned."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 4).to(torch.float16)
        self.body = nn.Linear(8, 16).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)  # fp32
        self.emb = nn.Linear(8, 8, bias=False).to(torch.bfloat16)

    def forward(self, x):
        h = torch.tanh(self.body(self.emb(x.bfloat16()))).float()
        return self.head(self.norm(h).half()).float()


class SmallMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 48), nn.Linear(48, 48), nn.Linear(48, 7)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class ConvBN(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6, momentum=momentum)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class TwoStage(nn.Module):
    """Two linear stages with ``middle`` (a function of the hidden activations, e.g. an ``autograd.Function``'s
    ``apply`` that fails its backward on demand) between them."""

    def __init__(self, middle=None):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 2)
        self.middle = middle

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h if self.middle is None else self.middle(h))


class TinyRegressor(torch.nn.Module):
    """4 -> 3 -> 2, tanh; parameters in ``dtype``, the forward in fp32."""

    def __init__(self, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter((torch.randn(3, 4, generator=g) * 0.5).to(dtype))
        self.b1 = torch.nn.Parameter((torch.randn(3, generator=g) * 0.1).to(dtype))
        self.w2 = torch.nn.Parameter((torch.randn(2, 3, generator=g) * 0.5).to(dtype))
        self.b2 = torch.nn.Parameter((torch.randn(2, generator=g) * 0.1).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(x, self.w1.float(), self.b1.float()))
        return nn.functional.linear(h, self.w2.float(), self.b2.float())


class WideMLP(nn.Module):
    """``d_in`` -> 16 -> 4 with tanh, the forward in the parameters' dtype, the output fp32."""

    def __init__(self, d_in: int):
        super().__init__()
        self.a = nn.Linear(d_in, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)))).float()


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.fc(x))))

# ---------------------------------------------------------------- gradient accumulation fusion


class TiedPair(nn.Module):
    """Two Linears and a head tied to an embedding (its gradient part fused, part through AccumulateGrad)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 12)
        self.fc = nn.Linear(12, 16)
        self.out = nn.Linear(16, 12)
        self.head = nn.Linear(12, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.out(torch.tanh(self.fc(self.emb(idx))))))


class FlatParams(nn.Module):
    """Parameters whose sizes are multiples of lcm(8 d, 128) for d = 2, 3, 4: no bucket padding, so the bytes of
    stage 0 and stage 1 compare exactly."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(48, 32, bias=False)  # 1536 elements
        self.b = nn.Linear(32, 12, bias=False)  # 384
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)))).float()


class TiedChain(nn.Module):
    """A ``Chain`` between an input layer and its tied use as the output (two contributions summed by
    AccumulateGrad), and a layer no forward uses."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(16, 16, bias=False)
        self.body = Chain(12)
        self.unused = nn.Linear(16, 16)

    def forward(self, x):
        h = self.emb(x)
        h = self.body(h)
        return h @ self.emb.weight  # the tied use: two contributions summed by AccumulateGrad


class MuonLM(nn.Module):
    """A small language model laid out for torch's Muon + AdamW recipe: an embedding, ``n_hidden`` 2-D hidden weights
    (``hidden.i.weight``, Muon's) with biases, a LayerNorm and a head (AdamW's). ``muon_adamw(model)`` builds the
    two optimizers as ``torch.optim.Muon``'s docstring does."""

    def __init__(self, vocab=17, d=8, width=16, n_hidden=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        dims = [d] + [width] * (n_hidden - 1) + [d]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))

    def hidden_matrices(self):
        return [layer.weight for layer in self.hidden]

    def muon_adamw(self, muon_lr=0.02, adamw_lr=3e-3):
        hidden = {id(p) for p in self.hidden_matrices()}
        muon = torch.optim.Muon(self.hidden_matrices(), lr=muon_lr, momentum=0.95)
        adamw = torch.optim.AdamW([p for p in self.parameters() if id(p) not in hidden], lr=adamw_lr,
                                  weight_decay=0.01)
        return [muon, adamw]
