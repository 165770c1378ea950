"""Lightning with manual optimization, gaengine driven by hand: the recipe when ``training_step`` owns the loop.

    .venv/bin/python examples/lightning_manual_example.py

``automatic_optimization = False``: Lightning then forbids ``accumulate_grad_batches`` and ``gradient_clip_val``,
so K and the clip go to the ``GradientAccumulator`` the module builds in ``configure_optimizers`` (which Lightning
calls after converting the module and moving it to the device: build the accumulator last). ``training_step`` calls
``acc.backward(loss)`` (not ``self.manual_backward``) and ``acc.step(force=<epoch's last batch>)``; the scheduler
goes to gaengine (stepped once per applied update). ``strategy=GaengineStrategy()`` launches the ranks without
wrapping the model in DDP (on one process ``"auto"`` works too), and refuses ``self.manual_backward`` and
``optimizer.step()``. gaengine's state rides in Lightning's checkpoint through ``on_save_checkpoint`` and is loaded
in ``on_train_start``, after Lightning restored the optimizer. In manual optimization Lightning's ``global_step``
counts ``optimizer.step()`` calls, which this recipe makes none of: count updates from ``acc.step``'s results.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import lightning.pytorch as pl

import gaengine
from gaengine.integrations.lightning import GaengineStrategy
from lightning_example import make_data, make_net  # examples/lightning_example.py


class ManualRegression(pl.LightningModule):
    def __init__(self, accumulation_steps: int = 4, max_grad_norm: float = 1.0):
        super().__init__()
        self.automatic_optimization = False
        self.net = make_net()
        self.accumulation_steps, self.max_grad_norm = accumulation_steps, max_grad_norm
        self.acc: gaengine.GradientAccumulator | None = None
        self.updates = 0
        self._acc_state = None

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 0.95 ** update)
        if self.acc is not None:
            self.acc.close()  # a second fit: release the parameters
        self.acc = gaengine.GradientAccumulator(self, optimizer, accumulation_steps=self.accumulation_steps,
                                                max_grad_norm=self.max_grad_norm, lr_scheduler=scheduler)
        return optimizer  # Lightning saves and restores its state in checkpoints

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)  # the micro-batch mean; never divided by K
        self.acc.backward(loss)
        last = self.trainer.is_last_batch or batch_idx + 1 == self.trainer.num_training_batches
        result = self.acc.step(force=last)  # None inside a window; the partial last window exactly normalized
        if result is not None:
            self.updates += 1
            if self.trainer.is_global_zero:
                print(f"update {self.updates}: {result.num_micro_batches} micro-batches, "
                      f"loss {float(result.loss):.5f}, grad norm {float(result.grad_norm):.4f}")
        return loss.detach()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["gaengine"] = {"acc": self.acc.state_dict(), "scheduler": self.acc.lr_scheduler.state_dict(),
                                  "updates": self.updates}

    def on_load_checkpoint(self, checkpoint):
        self._acc_state = checkpoint["gaengine"]  # the accumulator is built later, in configure_optimizers

    def on_train_start(self):
        if self._acc_state is not None:  # after Lightning restored the optimizer: gaengine's state loads last
            state, self._acc_state = self._acc_state, None
            self.acc.lr_scheduler.load_state_dict(state["scheduler"])
            self.acc.load_state_dict(state["acc"])
            self.updates = state["updates"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=4)
    args = parser.parse_args(argv)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=args.epochs, strategy=GaengineStrategy(),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    model = ManualRegression(accumulation_steps=args.accumulate)
    trainer.fit(model, torch.utils.data.DataLoader(make_data(), batch_size=8))
    print(f"updates {model.updates}")


if __name__ == "__main__":
    main()
