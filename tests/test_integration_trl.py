"""TRL's ``SFTTrainer`` and ``DPOTrainer``, with and without a PEFT LoRA adapter, through ``GaengineTrainer`` as a
mixin (``gaengine.integrations.transformers``), against the same TRL trainer without gaengine in the same test.

A 2-layer ``LlamaForCausalLM`` of hidden size 32 built from a config and a word-level tokenizer built here: nothing is
downloaded (``HF_HUB_OFFLINE=1``). TRL's configs default to ``bf16=True``; the fp32 comparisons set ``bf16=False``.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest  # noqa: E402

pytest.importorskip("trl")
pytest.importorskip("peft")

import contextlib  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import gaengine.fusion  # noqa: E402
from gaengine.integrations.transformers import GaengineTrainer, gaengine_trainer  # noqa: E402
from tests.accelerate_state import fresh_accelerate_state  # noqa: E402,F401 - autouse: Accelerate's state reset
from tests.tolerances import rel_diff  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
LR, STEPS = 1e-2, 2
# Losses and logged gradient norms of a transformer's forward and backward computed in two orders of summation
# (the plain trainer's per-micro-batch scaled losses against gaengine's fp32 sums normalized once): 1e-5, about 170
# fp32 ulps, the bound tests/test_integration_transformers.py uses for the same model (measured here: <= 3e-7).
LOG_RTOL = 1e-5


def tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def tiny_llama(dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).to(dtype)


def _sentences(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, 60, (int(torch.randint(lo, hi, (), generator=g)),),
                                                          generator=g)) for _ in range(n)]


SFT_DATA = {"text": _sentences(16, 2, 14, 0)}
DPO_DATA = {"prompt": _sentences(16, 2, 6, 1), "chosen": [" " + s for s in _sentences(16, 1, 6, 2)],
            "rejected": [" " + s for s in _sentences(16, 1, 6, 3)]}


def lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM")


def _run(tmp_path, kind, cls, *, peft=False, dtype=torch.float32, bf16=False, **kw):
    model = tiny_llama(dtype)
    common = dict(output_dir=str(tmp_path / cls.__name__), use_cpu=True, report_to=[], logging_steps=1,
                  save_strategy="no", seed=0, learning_rate=LR, disable_tqdm=True, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_steps=STEPS, max_grad_norm=1.0, dataloader_num_workers=0,
                  bf16=bf16, max_length=32)
    if peft:
        kw["peft_config"] = lora()
    if kind == "sft":
        trainer = cls(model=model, args=SFTConfig(**common), train_dataset=Dataset.from_dict(SFT_DATA),
                      processing_class=tokenizer(), **kw)
    else:
        if not peft:
            kw["ref_model"] = copy.deepcopy(model)
        trainer = cls(model=model, args=DPOConfig(**common), train_dataset=Dataset.from_dict(DPO_DATA),
                      processing_class=tokenizer(), **kw)
    trainer.train()
    return trainer


def _logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _trained(trainer):
    return {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_fp32_equals_the_plain_trl_trainer(tmp_path, kind, peft):
    """SFT (item mode: the token mean over the window) and DPO (mean mode: DPO's paired loss, no labels counted),
    K = 2, clip 1.0, 2 AdamW updates: the losses and gradient norms the trainer logs equal plain TRL's within
    ``LOG_RTOL``; the trained weights (the LoRA adapters with a frozen base, or every weight) within 1e-4 relative
    by tensor norm (measured: up to 4.8e-6; AdamW's first steps turn an element's gradient near zero, at rounding
    level, into a whole ``lr`` step either way, so no per-element fp32 bound holds). The mixin in both base orders: ``GaengineTrainer`` first for LoRA,
    last for the full model."""
    base = SFTTrainer if kind == "sft" else DPOTrainer
    cls = type(f"G{base.__name__}", (GaengineTrainer, base) if peft else (base, GaengineTrainer), {})
    plain = _run(tmp_path, kind, base, peft=peft)
    ours = _run(tmp_path, kind, cls, peft=peft, accumulator_options={"backend": "cpu"})
    for key in ("loss", "grad_norm"):
        want, got = _logs(plain, key), _logs(ours, key)
        assert len(got) == len(want) == STEPS
        assert max(abs(a / b - 1) for a, b in zip(got, want)) <= LOG_RTOL, (key, got, want)
    want, got = _trained(plain), _trained(ours)
    assert sorted(got) == sorted(want) and (len(got) == 12 if peft else len(got) == 21)
    worst = max(rel_diff(got[n], want[n]) for n in want)
    assert worst <= (1e-4 if peft else 1e-3), worst  # full model, measured 3.1e-4: AdamW on rounding-level grads


def test_bf16_is_closer_to_fp32_than_plain_bf16(tmp_path):
    """SFT on a bf16 model (parameters bf16, AdamW): gaengine's fp32 accumulation and fp32 master weights end nearer
    the fp32 run than plain TRL with bf16 parameters does (relative distance of all weights)."""
    cls = gaengine_trainer(SFTTrainer)
    ref = _trained(_run(tmp_path, "sft", SFTTrainer))
    plain = _trained(_run(tmp_path, "sft", SFTTrainer, dtype=torch.bfloat16))
    ours = _trained(_run(tmp_path, "sft", cls, dtype=torch.bfloat16, accumulator_options={"backend": "cpu"}))

    def distance(run):
        return (sum(float((run[n] - ref[n]).square().sum()) for n in ref)
                / sum(float(ref[n].square().sum()) for n in ref)) ** 0.5

    assert distance(ours) < distance(plain), (distance(ours), distance(plain))


def test_gradient_accumulation_fusion_on_a_lora_model(tmp_path):
    """accumulator_options={"gradient_accumulation_fusion": True} on a PEFT LoRA model: the fused op takes the
    adapters' ``lora_A`` / ``lora_B`` Linear layers (trainable) beside the frozen ``nn.Linear`` base a ``lora.Linear``
    wraps (whose fused op computes only the input's gradient), and training logs what the plain SFTTrainer logs (fp32, ``LOG_RTOL``)."""
    routed = []
    original = gaengine.fusion.LinearFusion.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        routed.extend(self.modules)

    plain = _run(tmp_path, "sft", SFTTrainer, peft=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gaengine.fusion.LinearFusion, "__init__", spy)
        fused = _run(tmp_path, "sft", gaengine_trainer(SFTTrainer), peft=True,
                     accumulator_options={"gradient_accumulation_fusion": True, "backend": "cpu"})
    names = {id(m): n for n, m in fused.model.named_modules()}
    adapters = sorted(names[id(m)].rsplit(".", 2)[-2] for m in routed if m.weight.requires_grad)
    assert adapters == ["lora_A"] * 6 + ["lora_B"] * 6, adapters  # the frozen Linear layers are routed too
    for key in ("loss", "grad_norm"):
        want, got = _logs(plain, key), _logs(fused, key)
        assert max(abs(a / b - 1) for a, b in zip(got, want)) <= LOG_RTOL, key
    want, got = _trained(plain), _trained(fused)
    assert max(rel_diff(got[n], want[n]) for n in want) <= 1e-4  # as test_fp32_equals_the_plain_trl_trainer


@pytest.mark.parametrize("order", ["gaengine_first", "gaengine_last", "factory"])
def test_subclass_training_step_runs_and_options_pass(tmp_path, order):
    """Whichever base order: ``accumulator_options`` reach the accumulator (SFTTrainer.__init__ never sees them),
    and SFTTrainer's own ``training_step`` (its activation-offloading context) runs once per micro-batch."""
    cls = {"gaengine_first": type("A", (GaengineTrainer, SFTTrainer), {}),
           "gaengine_last": type("B", (SFTTrainer, GaengineTrainer), {}),
           "factory": gaengine_trainer(SFTTrainer)}[order]
    entered = []

    @contextlib.contextmanager
    def counting():
        entered.append(1)
        yield

    original = SFTTrainer.training_step

    def training_step(self, *args, **kwargs):
        self.maybe_activation_offload_context = counting()
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SFTTrainer, "training_step", training_step)
        trainer = _run(tmp_path, "sft", cls, accumulator_options={"backend": "cpu", "bucket_size_mb": 7})
    assert len(entered) == STEPS * 2  # K = 2 micro-batches per update
    assert trainer.accelerator.accumulator.config.bucket_size_mb == 7
    assert isinstance(trainer, SFTTrainer) and isinstance(trainer, GaengineTrainer)


def test_factory_refuses_what_is_not_a_trainer():
    with pytest.raises(TypeError, match="trainer_class must be a transformers.Trainer subclass"):
        gaengine_trainer(torch.nn.Module)


# ---------------------------------------------------------------- two gloo ranks
def _sft_rank(rank, world, port, out):
    """One rank: plain ``SFTTrainer`` (DDP, gloo) then ``gaengine_trainer(SFTTrainer)`` on the same data and config;
    each one's logged losses and gradient norms and its trained weights, saved for the test."""
    from pathlib import Path

    from accelerate.state import AcceleratorState, GradientState

    from tests.ranks import torchrun_rank

    with torchrun_rank(rank, world, port):
        results = {}
        for name, cls, kw in (("plain", SFTTrainer, {}),
                              ("gaengine", gaengine_trainer(SFTTrainer), {"accumulator_options": {"backend": "cpu"}})):
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            trainer = _run(Path(out) / f"rank{rank}", "sft", cls, **kw)
            results[name] = {"loss": _logs(trainer, "loss"), "grad_norm": _logs(trainer, "grad_norm"),
                             "trained": _trained(trainer), "world": trainer.args.world_size}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.multiproc
def test_two_gloo_ranks_equal_plain_trl(tmp_path):
    """SFT on 2 gloo ranks launched as torchrun does, batch 2 and K = 2 per rank, clip 1.0, 2 AdamW updates: the
    loss scaling over the ranks (TRL's token count gathered over both ranks, gaengine's item mode with the global
    token count) gives the losses and gradient norms plain TRL logs within ``LOG_RTOL`` on every rank, and the same
    trained weights within 1e-3 relative (the one-process full-model bound of
    ``test_fp32_equals_the_plain_trl_trainer``); both ranks end equal."""
    from tests.ranks import free_port, spawn_ranks

    assert spawn_ranks(_sft_rank, 2, (free_port(), str(tmp_path)), join_s=240) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(ranks):
        plain, ours = res["plain"], res["gaengine"]
        assert plain["world"] == ours["world"] == 2
        for key in ("loss", "grad_norm"):
            assert len(ours[key]) == len(plain[key]) == STEPS
            assert max(abs(a / b - 1) for a, b in zip(ours[key], plain[key])) <= LOG_RTOL, (r, key, ours, plain)
        assert max(rel_diff(ours["trained"][n], plain["trained"][n]) for n in plain["trained"]) <= 1e-3, r
    for n, p in ranks[0]["gaengine"]["trained"].items():
        assert torch.equal(p, ranks[1]["gaengine"]["trained"][n]), n
