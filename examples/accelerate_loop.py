"""An Accelerate training loop whose gradient accumulation runs through gaengine.

The loop is Accelerate's own (``accelerator.accumulate``, ``backward``, ``clip_grad_norm_``, ``optimizer.step``,
``scheduler.step``, ``zero_grad``); the one changed line builds ``GaengineAccelerator`` instead of ``Accelerator``.
A tiny causal LM learns padded byte sequences of mixed lengths; each micro-batch passes its summed token loss with
its token count (``backward(loss_sum, num_items=n)``), so every update is the exact token mean of its window, the
partial window at the end of each epoch included. Runs in seconds on CPU (a GPU is used when there is one)::

    python examples/accelerate_loop.py                  # or: --epochs 2 --sequences 200 --sequential

docs/integrations/accelerate.md explains what changes and what is refused.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from gaengine.integrations.accelerate import GaengineAccelerator

VOCAB, SEQ, IGNORE = 64, 24, -100


class TinyCausalLM(nn.Module):
    """Next-token prediction from the current token and a running mean of the earlier ones: (B, T) int64 ->
    (B, T, VOCAB) fp32 logits."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(2 * width, width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        prefix = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1, device=ids.device).view(1, -1, 1)
        return self.out(torch.tanh(self.mix(torch.cat([h, prefix], -1))))


def padded_sequences(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of 4..SEQ tokens that repeat a short random motif, right-padded to SEQ; labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, SEQ + 1, (), generator=g))
        motif = torch.randint(1, VOCAB, (int(torch.randint(2, 5, (), generator=g)),), generator=g)
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = motif.repeat(SEQ)[:length]
        labels = ids.clone()
        labels[length:] = IGNORE
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's summed next-token cross-entropy and its token count (labels that are not -100)."""
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    loss_sum = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1),
                                           ignore_index=IGNORE, reduction="sum")
    return loss_sum, labels.ne(IGNORE).sum()


def train(epochs: int = 2, sequences: int = 200, micro_batch_size: int = 8, accumulation_steps: int = 4,
          sequential: bool = False, seed: int = 0, log=print) -> TinyCausalLM:
    torch.manual_seed(seed)
    accelerator = GaengineAccelerator(gradient_accumulation_steps=accumulation_steps)   # was: Accelerator(...)
    model = TinyCausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(padded_sequences(sequences, seed), batch_size=micro_batch_size,
                                         shuffle=not sequential, generator=torch.Generator().manual_seed(seed))
    updates_per_epoch = math.ceil(len(loader) / accumulation_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * updates_per_epoch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    log(f"{len(loader)} micro-batches of {micro_batch_size} per epoch, K = {accumulation_steps}: "
        f"{updates_per_epoch} updates per epoch")
    update = 0
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss_sum, n_tokens = token_loss_sum(model, batch)
                accelerator.backward(loss_sum, num_items=n_tokens)          # no division by K
                grad_norm = None
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if grad_norm is not None:  # a window ended: its exact token-mean loss, read only when logging
                result = optimizer.last_result
                update += 1
                skipped = "  skipped" if bool(result.skipped) else ""
                log(f"update {update}  loss {float(result.loss):.6f}  grad norm {float(grad_norm):.6f}  "
                    f"lr {lr:.3e}  micro-batches {result.num_micro_batches}{skipped}")
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--sequential", action="store_true", help="no shuffling (the test checks the first update)")
    args = parser.parse_args(argv)
    train(args.epochs, args.sequences, args.micro_batch_size, args.accumulation_steps, args.sequential)


if __name__ == "__main__":
    main()
