"""Hugging Face Transformers through gaengine: ``GaengineTrainer``, a ``transformers.Trainer`` subclass.

Switching is one line (docs/integrations/transformers.md)::

    trainer = GaengineTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)   # was: Trainer(...)
    trainer.train()

Everything comes from ``TrainingArguments`` as before: ``gradient_accumulation_steps`` is gaengine's K,
``max_grad_norm`` its clipping threshold (0: none), the optimizer and the scheduler are those the Trainer builds
(``optim``, ``learning_rate``, ``lr_scheduler_type``, ...), ``bf16`` / ``fp16`` Accelerate's autocast (fp16 with
gaengine's dynamic loss scaling instead of a ``GradScaler``). What changes:

* **Item mode where the Trainer means a token mean.** The Trainer hands ``num_items_in_batch`` (the window's label
  count) to the loss when the batch has ``labels`` and the model's forward takes ``**kwargs`` (or the model sets
  ``accepts_loss_kwargs=True``), or a ``compute_loss_func`` is given. When the loss is then divided by it (every
  causal LM of transformers, the label smoother, a ``compute_loss_func`` that uses it), each micro-batch's loss is
  the sum over its labels that are not -100 (``labels[..., 1:]`` when the model's loss shifts them, as every causal
  LM's does, seen on the first micro-batch whatever ``loss_type`` says; or ``shift_labels``), and
  ``num_items`` their count, so the window's gradient is the exact token mean over its micro-batches and all ranks.
  Otherwise (the count not passed, or a loss that ignores it: a model's own mean behind ``**kwargs``): mean mode,
  the mean of the micro-batch means. Whether the loss is divided by the count is seen on the first micro-batch of
  ``train()``: the loss depends on the count or not. ``item_mode=False`` forces mean mode.
* **Partial windows are exact**: the epoch's last window is normalized by the micro-batches (or tokens) it holds,
  not by ``gradient_accumulation_steps``.
* **The Trainer's log is gaengine's**: ``grad_norm`` is the window's norm after normalization, before clipping;
  ``learning_rate`` the one the update used; ``loss`` the window's loss normalized like its gradient. A skipped
  update (non-finite gradient) does not step the scheduler, and the count of skipped updates since the last log is
  logged as ``skipped_updates``.
* **Checkpoints**: the ``save_steps`` checkpoints hold the real optimizer's state and gaengine's (fp32 master
  weights, loss scale) in ``optimizer.pt``; ``train(resume_from_checkpoint=...)`` resumes exactly.
* **Multi-rank**: under ``torchrun`` the model is not wrapped in DDP; gaengine all-reduces the window's fp32
  gradient once, overlapped with the last micro-batch's backward. ``accumulator_options={"zero_stage": 1}`` shards
  the optimizer state (checkpoints through the Trainer are refused there: use ``torch.distributed.checkpoint``).

* **Any Trainer subclass** (TRL's ``SFTTrainer``, ``DPOTrainer``, ...): ``gaengine_trainer(SFTTrainer)`` returns
  ``GaengineSFTTrainer``, the same as writing ``class GaengineSFTTrainer(GaengineTrainer, SFTTrainer): pass`` (or
  the bases the other way round): the subclass's own ``training_step`` and
  ``compute_loss`` run as they do without gaengine (TRL's activation-offloading context, DPO's paired loss), since
  gaengine replaces only what ``Trainer.training_step`` hands to ``accelerator.backward`` (docs/integrations/trl.md).
* **Closed when ``train()`` returns** (errors included): hooks removed, the optimizer given back to the model's
  parameters (``GradientAccumulator.close(release_optimizer=True)``), the model holding the masters' rounding; a
  second trainer, a plain ``Trainer`` or plain PyTorch trains the model next.

Refused with ``ValueError`` naming the ``TrainingArguments`` field: ``deepspeed``, ``fsdp`` / ``fsdp_config``,
``parallelism_config``, layer-wise optimizers (``optim="*_layerwise"``, ``"lomo"``, ``"adalomo"``: they update inside
backward, with no gradient to accumulate), and several GPUs in one process (``n_gpu > 1``, torch ``DataParallel``).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

from gaengine.integrations.accelerate import GaengineAccelerator, GaengineOptimizer, check_accumulator_options

__all__ = ["GaengineTrainer", "gaengine_trainer"]

_IGNORE_INDEX = -100  # transformers' label for "no target" (loss_utils.fixed_cross_entropy)
_LAYERWISE = ("lomo", "adalomo")


def _refuse_arguments(args: Any) -> None:
    """``ValueError`` naming the ``TrainingArguments`` field that cannot compose with gaengine."""
    why = ("cannot be combined with gaengine: it owns the gradients (their accumulation, reduction and sharding) that "
           "gaengine accumulates into its fp32 buffer")
    if args.deepspeed:
        raise ValueError(f"TrainingArguments.deepspeed={args.deepspeed!r} {why}. Drop it; for sharded optimizer "
                         "state use GaengineTrainer(..., accumulator_options={'zero_stage': 1})")
    if args.fsdp or getattr(args, "fsdp_config", None) and args.fsdp_config.get("fsdp_version"):
        raise ValueError(f"TrainingArguments.fsdp={args.fsdp!r} {why}. Drop it; for sharded optimizer state use "
                         "GaengineTrainer(..., accumulator_options={'zero_stage': 1})")
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError(f"TrainingArguments.parallelism_config {why}; gaengine runs data parallelism only")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim.endswith("_layerwise") or optim in _LAYERWISE:
        raise ValueError(f"TrainingArguments.optim={optim!r} updates each parameter inside backward (a layer-wise "
                         "optimizer): there is no gradient to accumulate. Pick an optimizer that steps once per "
                         "update, e.g. optim='adamw_torch_fused'")
    if args.n_gpu > 1:
        raise ValueError(f"n_gpu={args.n_gpu}: the Trainer would wrap the model in torch DataParallel, which gaengine "
                         "cannot accumulate through; launch one process per GPU with torchrun (gaengine reduces across "
                         "them) or set CUDA_VISIBLE_DEVICES to one GPU")


_OPTIONS = ("item_mode", "accumulator_options")  # gaengine's own keywords of a Gaengine trainer's constructor


@dataclass
class _MicroBatch:
    """One ``training_step`` in flight: what ``Trainer.training_step``'s ``accelerator.backward(loss)`` is to do."""

    items: torch.Tensor | None  # the labels this micro-batch's loss covers, or None (mean mode)
    counted: bool  # compute_loss was handed a count
    count: torch.Tensor | None  # the first micro-batch's count, a 0-d fp32 tensor that requires grad
    num_items_in_batch: Any  # the Trainer's own count of the window's items
    logged: torch.Tensor | None = None  # what training_step returns, set by the backward


class _TrainerAccelerator(GaengineAccelerator):
    """The ``GaengineAccelerator`` of a Gaengine trainer: ``backward(loss)`` called from ``Trainer.training_step``
    (under any subclass's own ``training_step``) runs the trainer's micro-batch backward
    (``GaengineTrainer._backward_micro_batch``); any other call is ``GaengineAccelerator.backward``."""

    def __init__(self, *args: Any, trainer: Trainer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer = weakref.ref(trainer)

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None, **kwargs: Any) -> None:
        trainer = self._trainer()
        step = getattr(trainer, "_micro_batch", None)
        if step is None or step.logged is not None or num_items is not None:
            super().backward(loss, num_items=num_items, **kwargs)
            return
        trainer._backward_micro_batch(step, loss, kwargs)


class GaengineTrainer(Trainer):
    """``transformers.Trainer`` whose accumulation, clipping and update run through ``gaengine.GradientAccumulator``.

    Args:
        *args, **kwargs: ``transformers.Trainer``'s own (``model``, ``args``, ``train_dataset``, ...).
        item_mode: None (default): item mode when the Trainer passes ``num_items_in_batch`` to the loss (a batch with
            ``labels``, and a forward taking ``**kwargs`` or ``accepts_loss_kwargs=True``, or a ``compute_loss_func``)
            and the loss is divided by it, seen on the first micro-batch of ``train()`` (the loss depends on the
            count); else mean mode. False: always mean mode (the micro-batch mean loss, normalized by the window's
            micro-batches); True: item mode, ``ValueError`` at the first micro-batch where the count is not passed or
            the loss ignores it.
        accumulator_options: further ``GradientAccumulator`` keywords (``zero_stage``, ``backend``, ``bucket_size_mb``,
            ``reduce_dtype``, ``loss_scale``, ...); ``accumulation_steps`` and ``max_grad_norm`` come from
            ``TrainingArguments`` and are refused here (``TypeError``).

    The accumulator is ``trainer.accelerator.accumulator`` once training started; the last window's
    ``gaengine.StepResult`` is ``trainer.optimizer.last_result``. When a callback overrides ``on_pre_optimizer_step``
    or ``on_optimizer_step``, ``.grad`` holds the window's gradient there as in the plain Trainer (normalized, clipped
    when ``max_grad_norm`` > 0; a copy per update, ``GaengineAccelerator(window_grads=True)``), but gaengine has
    already updated the parameters in ``on_pre_optimizer_step`` when it clips (the update comes with the norm).
    Elsewhere, mid-window, ``.grad`` is None.

    **As a mixin** for any ``Trainer`` subclass, in either base order: ``class GaengineSFTTrainer(GaengineTrainer,
    SFTTrainer): pass`` or ``(SFTTrainer, GaengineTrainer)``, or ``gaengine_trainer(SFTTrainer)``. ``item_mode`` and
    ``accumulator_options`` are taken before any base's ``__init__`` runs (``__init_subclass__`` wraps each subclass's
    ``__init__``), so a base that refuses unknown keywords never sees them. ``training_step`` calls the next
    ``training_step`` of the MRO (the subclass's own, e.g. TRL's activation-offloading context, which runs
    ``Trainer.training_step``): gaengine changes only the count ``compute_loss`` is handed (item mode) and what
    ``Trainer.training_step``'s ``accelerator.backward(loss)`` does, so a subclass's ``compute_loss`` (DPO's paired
    loss) runs as it does without gaengine. ``loss_is_scaled_for_ga`` is set True on the instance (``DPOTrainer``'s
    class attribute False would divide the loss by K a second time).

    The accumulator is closed when ``train()`` returns or raises (``close(release_optimizer=True)``): hooks removed,
    the optimizer holding the model's parameters again, the model holding the masters' rounding.

    Raises ``ValueError`` naming the ``TrainingArguments`` field for what cannot compose (see the module docstring),
    ``TypeError`` / ``ValueError`` for bad ``accumulator_options``.
    """

    # gaengine normalizes the window itself: the Trainer must not divide the loss by gradient_accumulation_steps.
    loss_is_scaled_for_ga = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__init__
        if getattr(init, "_gaengine_takes_options", False):
            return

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if not getattr(self, "_gaengine_options_taken", False):
                GaengineTrainer._take_options(self, **{k: kwargs.pop(k) for k in _OPTIONS if k in kwargs})
            init(self, *args, **kwargs)

        __init__._gaengine_takes_options = True
        cls.__init__ = __init__

    def _take_options(self, item_mode: bool | None = None, accumulator_options: Mapping[str, Any] | None = None) -> None:
        """Check and keep gaengine's constructor keywords (``TypeError`` / ``ValueError`` as the class says)."""
        if item_mode not in (None, True, False):
            raise TypeError(f"item_mode must be None (automatic), True or False, got {item_mode!r}")
        options = check_accumulator_options(accumulator_options)
        for name, field in (("accumulation_steps", "gradient_accumulation_steps"), ("max_grad_norm", "max_grad_norm")):
            if name in options:
                raise TypeError(f"accumulator_options must not hold {name!r}: set TrainingArguments.{field} instead")
        self._item_mode = item_mode
        self._accumulator_options = options
        self._gaengine_options_taken = True

    def __init__(self, *args: Any, item_mode: bool | None = None,
                 accumulator_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if not getattr(self, "_gaengine_options_taken", False):
            self._take_options(item_mode, accumulator_options)
        self.loss_is_scaled_for_ga = True  # over a base's class attribute (DPOTrainer's False)
        self._micro_batch: _MicroBatch | None = None
        self._loss_divides_by_items: bool | None = None  # settled on the first micro-batch of each train()
        self._shift_settled = False  # whether the labels the loss uses are (_get_num_items_in_batch)
        self._logged_skips = 0
        super().__init__(*args, **kwargs)
        model = self.model
        # Which labels the loss predicts (the rule of Trainer._get_num_items_in_batch): causal LMs shift them. A first
        # guess from loss_type, settled on the first micro-batch of train() by the loss itself (_settle_shift).
        self._shifts_labels = (LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
                               and not getattr(getattr(model, "config", None), "is_encoder_decoder", False))

    # ------------------------------------------------------------------ set-up
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # The Trainer's own Accelerator arguments, kept to build the GaengineAccelerator from the same ones.
        args = super()._build_accelerator_args(**kwargs)
        self._accelerator_args = dict(args)
        return args

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's set-up, then its Accelerator replaced by a ``GaengineAccelerator`` built from the same
        arguments (Accelerate's state is process-wide, so both see the same processes and devices), with
        ``accumulation_steps=args.gradient_accumulation_steps`` and ``max_grad_norm=args.max_grad_norm``."""
        _refuse_arguments(self.args)
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # set by `accelerate launch` rather than an argument
            raise ValueError("DeepSpeed / FSDP (from the accelerate config or the environment) cannot be combined with "
                             "gaengine: launch without them, e.g. with torchrun")
        max_norm = self.args.max_grad_norm
        self.accelerator = _TrainerAccelerator(
            **self._accelerator_args, trainer=self, accumulation_steps=self.args.gradient_accumulation_steps,
            max_grad_norm=max_norm if max_norm and max_norm > 0 else None,
            accumulator_options=self._accumulator_options)
        gather = self.gather_function
        self.gather_function = (self.accelerator.gather_for_metrics if not hasattr(gather, "keywords")
                                else type(gather)(self.accelerator.gather_for_metrics, **gather.keywords))

    # ------------------------------------------------------------------ one micro-batch
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; whether the loss is normalized by ``num_items_in_batch`` is looked at again on
        the first micro-batch (``model_init`` may build another model)."""
        self._loss_divides_by_items = None
        self._shift_settled = False
        if isinstance(self.accelerator, GaengineAccelerator):
            self.accelerator.window_grads = self._callbacks_read_grads()
        try:
            return super().train(*args, **kwargs)
        finally:
            self._close_accumulator()

    def _close_accumulator(self) -> None:
        """The accumulator closed as ``train()`` returns or raises: its hooks removed, the optimizer given back to
        the model's parameters (``close(release_optimizer=True)``; at ``zero_stage`` >= 1 on several ranks, where the
        optimizer holds shards, only closed), the window's ``.grad`` dropped. ``trainer.accelerator.accumulator``
        stays readable (``state_dict()``); the next ``train()`` builds a new one."""
        acc = getattr(self.accelerator, "accumulator", None)
        if acc is None:
            return
        opt = self.optimizer
        if isinstance(opt, GaengineOptimizer):
            opt.release_grads()
        sharded = acc.config.zero_stage > 0 and acc.world_size > 1
        acc.close(release_optimizer=not sharded)

    def _callbacks_read_grads(self) -> bool:
        """Whether a callback overrides ``on_pre_optimizer_step`` or ``on_optimizer_step`` (where the plain Trainer's
        ``.grad`` holds the window's gradient): only then is it put in ``.grad``, a copy per update."""
        hooks = ("on_pre_optimizer_step", "on_optimizer_step")
        return any(getattr(type(cb), name, None) is not getattr(TrainerCallback, name)
                   for cb in self.callback_handler.callbacks for name in hooks)

    def _micro_batch_items(self, inputs: Mapping[str, Any], num_items_in_batch: Any) -> torch.Tensor | None:
        """The items this micro-batch's loss covers (labels that are not -100, counted as the Trainer counts them)
        when the Trainer hands ``num_items_in_batch`` to the loss, else None (mean mode)."""
        # The Trainer counts items, and passes them to the model's forward (model_accepts_loss_kwargs: **kwargs or
        # accepts_loss_kwargs=True) or to compute_loss_func, only when the batch has labels.
        passed = num_items_in_batch is not None and ("labels" in inputs or "shift_labels" in inputs)
        if self._item_mode is False or (self._item_mode is None and not passed):
            return None
        if not passed:
            raise ValueError("item_mode=True needs the Trainer to pass num_items_in_batch to the loss: a model whose "
                             "forward takes **kwargs (or sets accepts_loss_kwargs=True), or a compute_loss_func, and "
                             "a batch with 'labels'; use item_mode=None")
        if "shift_labels" in inputs:
            labels = inputs["shift_labels"]
        else:
            labels = inputs["labels"][..., 1:] if self._shifts_labels else inputs["labels"]
        return labels.ne(_IGNORE_INDEX).sum()

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The Trainer's count of the window's items, after the first window of ``train()`` settled which labels
        the model's loss uses (``_settle_shift``): the Trainer then counts them as the loss does, so its
        ``num_items_in_batch`` (and the loss it logs) and gaengine's ``num_items`` are the true token counts."""
        if not self._shift_settled and batch_samples and self._item_mode is not False and (
                self.model_accepts_loss_kwargs and "labels" in batch_samples[0]):
            self._shift_settled = True
            with self.compute_loss_context_manager():
                self._settle_shift(self.model, self._prepare_inputs(batch_samples[0]))
            self._loss_shifts_labels = self._shifts_labels
        return super()._get_num_items_in_batch(batch_samples, device)

    def _settle_shift(self, model: nn.Module, inputs: Mapping[str, Any]) -> None:
        """Whether the model's own loss predicts ``labels[..., 1:]`` (a causal LM's shift) or every label, seen on
        the first micro-batch of ``train()`` and kept in ``_shifts_labels`` (which ``_micro_batch_items`` counts).

        ``loss_type`` does not always say it: ``GPT2LMHeadModel``'s is None, yet its loss is transformers' default,
        ``ForCausalLMLoss``, which shifts. So the loss is asked: in eval mode (no dropout: the same function twice),
        without gradients, once with ``num_items_in_batch=1`` (its sum over the labels it uses) and once without (its
        mean over them); their ratio is the number of labels it used, compared with the two counts. Two extra
        forwards and one host read, once per ``train()``; skipped (``loss_type``'s answer kept) where the two counts
        agree, with ``shift_labels`` (counted as given), a label smoother or a ``compute_loss_func`` (their loss
        without a count is not the model's mean), or when the ratio is not finite (no label used)."""
        labels = inputs.get("labels")
        if ("shift_labels" in inputs or not isinstance(labels, torch.Tensor) or labels.dim() < 2
                or self.label_smoother is not None or self.compute_loss_func is not None):
            return
        every, shifted = int(labels.ne(_IGNORE_INDEX).sum()), int(labels[..., 1:].ne(_IGNORE_INDEX).sum())
        if every == shifted or shifted == 0:
            return
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                one = torch.ones((), device=self.args.device)
                total = self.compute_loss(model, dict(inputs), num_items_in_batch=one) / self._loss_factor(True)
                mean = self.compute_loss(model, dict(inputs))
        finally:
            model.train(training)
        used = float(total) / float(mean)  # host read: once per train()
        if math.isfinite(used):
            self._shifts_labels = abs(used - shifted) < abs(used - every)

    def _loss_factor(self, counted: bool) -> int:
        """What ``compute_loss`` multiplies a loss by when it passed a count (``num_processes`` with
        ``average_tokens_across_devices``: the Trainer's count is all-gathered over the ranks and DDP averages)."""
        if counted and self.args.average_tokens_across_devices and (
                self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return self.accelerator.num_processes
        return 1

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch: the next ``training_step`` of the class's MRO (a subclass's own, then
        ``Trainer.training_step``: ``model.train()``, ``_prepare_inputs``, ``compute_loss``, ``accelerator.backward``)
        with gaengine's count handed to ``compute_loss`` and gaengine's backward (``_backward_micro_batch``); returns
        the micro-batch's share of the window's loss (detached), what the Trainer adds up and logs.

        Item mode (the loss is the Trainer's token mean: normalized by the ``num_items_in_batch`` it passes):
        ``compute_loss`` gets ``num_items_in_batch=1``, so its loss is the micro-batch's sum, handed to
        ``accelerator.backward(loss_sum, num_items=n)``. Mean mode: ``compute_loss`` without a count, the model's
        micro-batch mean, ``accelerator.backward(loss)``. Which one is settled on the first micro-batch of ``train()``
        (``_backward_micro_batch``). The window's end (``clip_grad_norm_`` at the Trainer's synchronizing step)
        normalizes, clips and updates. ``RuntimeError`` when the MRO's ``training_step`` never called
        ``accelerator.backward`` (nothing was accumulated).
        """
        items = self._micro_batch_items(inputs, num_items_in_batch)
        counted = items is not None and self._loss_divides_by_items is not False  # compute_loss gets a count
        count = None
        if counted and self._loss_divides_by_items is None:
            count = items.clamp_min(1).to(device=self.args.device, dtype=torch.float32).requires_grad_()
        passed = count if count is not None else torch.ones((), device=self.args.device) if counted else None
        step = self._micro_batch = _MicroBatch(items, counted, count, num_items_in_batch)
        try:
            super().training_step(model, inputs, num_items_in_batch=passed)
        finally:
            self._micro_batch = None
        if step.logged is None:
            raise RuntimeError(f"{type(self).__name__}.training_step returned without calling "
                               "accelerator.backward(loss): nothing was accumulated for this micro-batch")
        return step.logged

    def _backward_micro_batch(self, step: _MicroBatch, loss: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """``Trainer.training_step``'s ``accelerator.backward(loss)`` for the micro-batch ``step``: gaengine's
        backward, with the micro-batch's item count in item mode; sets ``step.logged``.

        On the first micro-batch of ``train()`` in item mode, ``compute_loss`` was handed a 0-d fp32 count that
        requires grad: a loss normalized by it (transformers' ``fixed_cross_entropy``, TRL's SFT loss, the label
        smoother, a ``compute_loss_func`` honouring it) depends on it, a loss that ignores it (a mean computed by the
        model, ``**kwargs`` swallowing the count) does not; one autograd pass from the loss to that tensor tells
        which, once per ``train()``. Either way the value is the micro-batch's mean: a dependent loss becomes its sum
        (the mean times the count), item mode; else mean mode from here on.
        """
        if step.count is not None:
            divides = loss.requires_grad and torch.autograd.grad(
                loss, step.count, retain_graph=True, allow_unused=True)[0] is not None
            if not divides and self._item_mode:
                raise ValueError("item_mode=True, but the loss does not depend on the num_items_in_batch the "
                                 "Trainer passes (the model returns a mean of its own): use item_mode=None")
            self._loss_divides_by_items = divides
            if divides:
                loss = loss * step.count.detach()
        # compute_loss multiplies a loss it passed a count to by num_processes (the Trainer's count is all-gathered
        # over the ranks, and DDP averages them); gaengine sums over the ranks and counts the items itself.
        factor = self._loss_factor(step.counted)
        items = step.items if self._loss_divides_by_items else None
        GaengineAccelerator.backward(self.accelerator, loss if factor == 1 else loss / factor, num_items=items,
                                     **kwargs)
        # What the Trainer sums over the window and averages over ranks: the window's loss, as its own recipe logs.
        if items is None:
            step.logged = loss.detach() / factor / self.current_gradient_accumulation_steps
        else:
            step.logged = loss.detach() / step.num_items_in_batch

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with ``skipped_updates`` (non-finite windows gaengine skipped since the last training
        log) beside ``loss`` and ``grad_norm``."""
        opt = self.optimizer
        if "loss" in logs and isinstance(opt, GaengineOptimizer):
            logs["skipped_updates"] = opt.num_skipped - self._logged_skips
            self._logged_skips = opt.num_skipped
        super().log(logs, start_time)


def gaengine_trainer(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) with gaengine's
    accumulation: ``type("Gaengine" + name, (GaengineTrainer, trainer_class), {})``, the class's own
    ``training_step`` / ``compute_loss`` kept (``GaengineTrainer``'s docstring: a mixin in either base order). Its constructor takes the class's own
    arguments plus ``item_mode`` and ``accumulator_options`` (``GaengineTrainer``'s). ``trainer_class`` itself
    (``Trainer``) gives ``GaengineTrainer``; a class that already has the mixin is returned as it is.

    Raises ``TypeError`` when ``trainer_class`` is not a ``transformers.Trainer`` subclass.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"trainer_class must be a transformers.Trainer subclass (e.g. trl.SFTTrainer), got "
                        f"{trainer_class!r}")
    if issubclass(trainer_class, GaengineTrainer):
        return trainer_class
    if trainer_class is Trainer:
        return GaengineTrainer
    name = trainer_class.__name__
    return type(f"Gaengine{name}", (GaengineTrainer, trainer_class),
                {"__module__": trainer_class.__module__, "__qualname__": f"Gaengine{name}"})
