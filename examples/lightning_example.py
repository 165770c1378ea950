"""Lightning's Trainer accumulating through gaengine: automatic optimization, one argument changed.

    .venv/bin/python examples/lightning_example.py                 # one process, a few seconds on CPU
    .venv/bin/python examples/lightning_example.py --devices 2     # two processes (gloo), Lightning's DDP launch

A small regression MLP on synthetic data, ``Trainer(accumulate_grad_batches=4, gradient_clip_val=1.0)``: 10
micro-batches per epoch, so each epoch has two full windows of 4 and a partial one of 2, which gaengine normalizes by
the 2 micro-batches it holds (Lightning's own accumulation would divide it by 4). Each applied update prints its
loss and gradient norm (gaengine's ``StepResult``, read by a callback), and the run ends with ``trainer.global_step``.
Needs ``pip install gaengine[lightning]``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import lightning.pytorch as pl

from gaengine.integrations.lightning import GaengineStrategy

FEATURES = 8


def make_data(samples: int = 80, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``samples`` rows of ``x`` (FEATURES,) and a noisy nonlinear target ``y`` (1,)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    y = torch.sin(x @ torch.randn(FEATURES, 1, generator=g)) + 0.05 * torch.randn(samples, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


class Regression(pl.LightningModule):
    """Unchanged from a plain Lightning module: returns the micro-batch's mean loss, one optimizer, a scheduler
    stepped per update (``interval="step"``)."""

    def __init__(self):
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 0.95 ** update)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PrintUpdates(pl.Callback):
    """Prints gaengine's ``StepResult`` of every applied update (rank 0)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        result = trainer.strategy.precision_plugin.last_result
        if result is not None and trainer.global_step != getattr(self, "_printed", 0):
            self._printed = trainer.global_step
            if trainer.is_global_zero:
                print(f"update {trainer.global_step}: {result.num_micro_batches} micro-batches, "
                      f"loss {float(result.loss):.5f}, grad norm {float(result.grad_norm):.4f}"
                      f"{' (skipped)' if bool(result.skipped) else ''}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=4)
    args = parser.parse_args(argv)

    loader = torch.utils.data.DataLoader(make_data(), batch_size=8 // args.devices)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0,
        strategy=GaengineStrategy(),               # the one change: strategy="auto" / "ddp" before
        callbacks=[PrintUpdates()], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False)
    trainer.fit(Regression(), loader)
    if trainer.is_global_zero:
        print(f"global_step {trainer.global_step}")


if __name__ == "__main__":
    main()
