"""Hugging Face's Trainer with gaengine's accumulation: ``GaengineTrainer`` in place of ``Trainer``, one line.

A 2-layer ``LlamaForCausalLM`` built from a config (nothing is downloaded) learns padded sequences of mixed lengths.
Everything is set in ``TrainingArguments`` as usual: ``gradient_accumulation_steps`` is gaengine's K,
``max_grad_norm`` its clipping threshold, the optimizer and the scheduler are the ones the Trainer builds. The loss
of each update is the exact token mean over its window (item mode, on by default for causal LMs), the epoch's last,
partial window included; ``grad_norm`` and ``learning_rate`` in the log are gaengine's. Runs in seconds on CPU::

    python examples/hf_trainer.py                      # or: --epochs 1 --sequences 72 --sequential

docs/integrations/transformers.md explains what changes and what is refused.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: no download

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from gaengine.integrations.transformers import GaengineTrainer  # noqa: E402

VOCAB, SEQ = 128, 32


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def padded_sequences(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of 4..SEQ tokens repeating a short random motif, right-padded; labels -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, SEQ + 1, (), generator=g))
        motif = torch.randint(1, VOCAB, (int(torch.randint(2, 6, (), generator=g)),), generator=g)
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = motif.repeat(SEQ)[:length]
        mask = (torch.arange(SEQ) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def train(epochs: float = 2, sequences: int = 144, micro_batch_size: int = 4, accumulation_steps: int = 4,
          sequential: bool = False, output_dir: str | None = None) -> GaengineTrainer:
    output_dir = output_dir or tempfile.mkdtemp(prefix="gaengine-hf-")
    args = TrainingArguments(
        output_dir=output_dir, num_train_epochs=epochs, per_device_train_batch_size=micro_batch_size,
        gradient_accumulation_steps=accumulation_steps, max_grad_norm=1.0, learning_rate=3e-3,
        lr_scheduler_type="cosine", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        train_sampling_strategy="sequential" if sequential else "random", seed=0)
    trainer = GaengineTrainer(model=tiny_llama(), args=args, train_dataset=padded_sequences(sequences))  # was: Trainer
    trainer.train()
    return trainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--sequences", type=int, default=144)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--sequential", action="store_true", help="no shuffling (the test checks the first update)")
    args = parser.parse_args(argv)
    trainer = train(args.epochs, args.sequences, args.micro_batch_size, args.accumulation_steps, args.sequential)
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"update {entry['step']}  loss {entry['loss']:.6f}  grad norm {entry['grad_norm']:.6f}  "
                  f"lr {entry['learning_rate']:.3e}  skipped {entry['skipped_updates']}")


if __name__ == "__main__":
    main()
