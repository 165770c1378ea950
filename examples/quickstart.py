"""The README's Quick start, complete: a tiny byte-level language model trained through gaengine on CPU.

    python examples/quickstart.py                 # 2 epochs, 16 updates, a few seconds on one CPU core
    python examples/quickstart.py --epochs 1 --windows 600

``TinyLM`` and ``byte_windows`` are small stand-ins for your model and data: ``TinyLM`` predicts the next byte
from the previous 16 (an embedding, one hidden layer), and ``byte_windows`` cuts random windows out of the
source of Python's ``argparse`` module, served by a ``torch.utils.data.DataLoader``. ``quickstart()`` is the
README's snippet line for line. An epoch of 2000 windows in micro-batches of 32 is 63 micro-batches, not a
multiple of ``accumulation_steps=8``, so each epoch ends with a partial window of 7, which
``acc.step(force=True)`` normalizes by the micro-batches it holds.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gaengine

CONTEXT = 16
"""Bytes the model sees before the one it predicts."""


class TinyLM(nn.Module):
    """Next-byte prediction from the previous ``CONTEXT`` bytes: an embedding, one hidden layer, 256 logits.

    forward(x, y): x (B, CONTEXT) int64 bytes, y (B,) int64 next bytes; returns the mean cross-entropy over the
    micro-batch, an fp32 0-d tensor (nats per byte).
    """

    def __init__(self, d_model: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.mlp = nn.Sequential(nn.Linear(CONTEXT * d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, 256))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.embed(x).flatten(1))
        return F.cross_entropy(logits.float(), y)


def byte_windows(num_windows: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``num_windows`` random ``(CONTEXT bytes, next byte)`` pairs, int64, from the source of ``argparse``."""
    data = torch.frombuffer(bytearray(Path(argparse.__file__).read_bytes()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - CONTEXT, (num_windows,), generator=g)
    windows = data[starts[:, None] + torch.arange(CONTEXT + 1)]
    return torch.utils.data.TensorDataset(windows[:, :-1], windows[:, -1])


def print_update(loss: torch.Tensor, grad_norm: torch.Tensor, skipped: torch.Tensor) -> None:
    """Print one update; reading the three 0-d tensors here is the loop's one host sync per update."""
    print(f"loss {loss.item():.4f}  grad norm {grad_norm.item():.3f}" + ("  skipped" if skipped.item() else ""))


def quickstart(model: nn.Module, loader, epochs: int, log=print_update) -> None:
    """The README's Quick start: train ``model`` on ``loader`` for ``epochs`` through a GradientAccumulator."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)   # or gaengine.optim.FusedAdamW
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * math.ceil(len(loader) / 8))
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=8, max_grad_norm=1.0,
                                       lr_scheduler=scheduler)
    for epoch in range(epochs):
        for x, y in loader:
            loss = model(x, y)                       # mean over the micro-batch
            acc.backward(loss)                       # or: acc.backward(loss_sum, num_items=n_tokens)
            result = acc.step()                      # None until the window is complete
            if result is not None:
                log(result.loss, result.grad_norm, result.skipped)   # 0-d tensors, still on the device
        result = acc.step(force=True)                # end of epoch: the partial window, exactly normalized
        if result is not None:
            log(result.loss, result.grad_norm, result.skipped)
    acc.close()                                  # end of training: the hooks removed (warns if a window is left)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--windows", type=int, default=2000, help="training windows per epoch")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="initialization, data and shuffling seed")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = TinyLM().to(torch.bfloat16)
    loader = torch.utils.data.DataLoader(byte_windows(args.windows, args.seed), batch_size=args.micro_batch_size,
                                         shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    print(f"TinyLM, {sum(p.numel() for p in model.parameters()):,} bf16 parameters; {len(loader)} micro-batches "
          f"of {args.micro_batch_size} per epoch, 8 per update")
    quickstart(model, loader, args.epochs)


if __name__ == "__main__":
    main()
