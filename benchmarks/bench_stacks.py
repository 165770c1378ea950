"""Time per update through the stacks users train with, gaengine against the same stack without it.

    python benchmarks/bench_stacks.py [--only fabric trl] [--repeats 5] [--threads 1] [--json PATH]

Model: a tiny Llama (``transformers.LlamaForCausalLM`` built from a config: ``--layers`` 2, ``--hidden`` 128,
intermediate 344, 4 heads, vocabulary 512; nothing downloaded), ``--batch`` 4 sequences of ``--seq`` 128 tokens per
micro-batch, K = 4 micro-batches per update, clipping at 1.0, AdamW.

* ``fabric``: Lightning Fabric's accumulation loop as its docs write it (``no_backward_sync``, ``fabric.backward(loss
  / K)``, ``clip_gradients``, ``optimizer.step()``, ``zero_grad()``), plain (``strategy="auto"``) against
  ``GaengineStrategy(accumulation_steps=K)``, in ``32-true``, ``bf16-true`` and ``bf16-mixed``, one process. Each
  variant trains its own copy of the same initial weights on the same micro-batches; one update of each per round,
  the order shuffled each round (:func:`time_rounds`).
* ``trl``: TRL's ``SFTTrainer`` with a PEFT LoRA adapter (r 8 on the attention and MLP projections) against
  ``gaengine_trainer(SFTTrainer)``, fp32. A ``train()`` cannot be interleaved update by update, so each run times
  its own updates (from one ``on_step_end`` to the next, the first update left out), and the runs alternate
  (plain, gaengine, plain, ...): ``--repeats`` runs each, the median update of each run.

Per variant: the min and the median milliseconds per update over the repeats, and the ratio of the medians
(gaengine / plain: > 1 slower). Wall time (``time.perf_counter``) on the CPU; a machine shared with other jobs
drifts, which interleaving cancels only in part.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, time_rounds, write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

K, CLIP, LR = 4, 1.0, 1e-3
COLUMNS = [("stack", "stack", ""), ("precision", "precision", ""), ("variant", "variant", ""),
           ("min_ms", "min ms", ".1f"), ("median_ms", "median ms", ".1f"), ("ratio", "median / plain", ".3f")]


def llama(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.seq, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


def _rows(stack: str, precision: str, samples: dict[str, list[float]]) -> list[dict]:
    plain = statistics.median(samples["plain"])
    return [{"stack": stack, "precision": precision, "variant": name, "min_ms": min(ms),
             "median_ms": statistics.median(ms), "ratio": statistics.median(ms) / plain, "samples_ms": ms}
            for name, ms in samples.items()]


def fabric_rows(args: argparse.Namespace) -> list[dict]:
    import lightning as L

    from gaengine.integrations.fabric import GaengineStrategy
    warnings.filterwarnings("ignore", message=".*(GPU available|litlogger|LeafSpec|Automatic Mixed Precision).*")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 512, (args.batch, args.seq), generator=g) for _ in range(K)]
    rows = []
    for precision in args.precisions:
        updates, fabrics = {}, []
        for name, strategy in (("plain", "auto"), ("gaengine", GaengineStrategy(accumulation_steps=K))):
            fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
            model = llama(args)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            model, optimizer = fabric.setup(model, optimizer)

            def update(fabric=fabric, model=model, optimizer=optimizer):
                for i, x in enumerate(batches):
                    with fabric.no_backward_sync(model, enabled=i < K - 1):
                        fabric.backward(model(input_ids=x, labels=x).loss / K)
                fabric.clip_gradients(model, optimizer, max_norm=CLIP)
                optimizer.step()
                optimizer.zero_grad()

            updates[name] = update
            fabrics.append(fabric)
        samples = time_rounds(updates, warmup=1, repeats=args.repeats).ms
        fabrics[1].strategy.close()
        rows += _rows("fabric", precision, samples)
    return rows


def trl_rows(args: argparse.Namespace) -> list[dict]:
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from gaengine.integrations.transformers import gaengine_trainer

    words = {f"w{i}": i + 4 for i in range(508)}
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **words}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    g = torch.Generator().manual_seed(1)
    updates = args.trl_updates + 1
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 508, (args.seq - 2,), generator=g))
             for _ in range(args.batch * K * updates)]
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM")

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, *a, **kw):
            self.ends.append(time.perf_counter())

    samples: dict[str, list[float]] = {"plain": [], "gaengine": []}
    classes = {"plain": SFTTrainer, "gaengine": gaengine_trainer(SFTTrainer)}
    for _ in range(args.repeats):
        for name, cls in classes.items():
            clock = Clock()
            config = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to=[],
                               save_strategy="no", seed=0, learning_rate=LR, disable_tqdm=True,
                               per_device_train_batch_size=args.batch, gradient_accumulation_steps=K,
                               max_steps=updates, max_grad_norm=CLIP, dataloader_num_workers=0,
                               max_length=args.seq, logging_steps=updates)
            trainer = cls(model=llama(args), args=config, train_dataset=Dataset.from_dict({"text": texts}),
                          processing_class=tokenizer, peft_config=lora, callbacks=[clock])
            trainer.train()
            steps = [(b - a) * 1e3 for a, b in zip(clock.ends, clock.ends[1:])]
            samples[name].append(statistics.median(steps))
    return _rows("trl-sft-lora", "32-true", samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=("fabric", "trl"), default=["fabric", "trl"])
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-true", "bf16-mixed"])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (fabric) or runs per variant (trl)")
    parser.add_argument("--trl-updates", type=int, default=4, help="timed updates per TRL run")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = (fabric_rows(args) if "fabric" in args.only else []) + (trl_rows(args) if "trl" in args.only else [])
    print_table(rows, COLUMNS, title=f"time per update, K = {K} (threads: {torch.get_num_threads()})")
    if args.json:
        write_json(args.json, "stacks", {k: v for k, v in vars(args).items() if k != "json"}, rows, ["cpu"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
