"""Hugging Face Accelerate through gaengine: ``GaengineAccelerator``, an ``accelerate.Accelerator`` subclass.

A loop written for Accelerate runs unchanged; only the constructor changes::

    accelerator = GaengineAccelerator(gradient_accumulation_steps=4)        # was: Accelerator(...)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)                 # or accelerator.backward(loss_sum, num_items=n_tokens)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

What changes (docs/integrations/accelerate.md):

* ``prepare(model, optimizer)`` builds one ``gaengine.GradientAccumulator`` over the model and the optimizer; the
  model is placed on the device and wrapped for mixed precision as Accelerate does, never in torch DDP (gaengine
  all-reduces the window's fp32 gradient itself, once, overlapped with the last micro-batch's backward).
* ``backward(loss)`` does not divide by K: gaengine normalizes once per window, by the micro-batches the window
  holds (the partial window at the end of the dataloader included), or by the items of the whole window across
  ranks with ``backward(loss_sum, num_items=n)``.
* The prepared optimizer's ``step()`` at a synchronizing step (``accelerator.sync_gradients``: every K-th batch and
  the dataloader's last) ends the window: ``acc.step(force=True)``; elsewhere it does nothing, as Accelerate's does.
  ``zero_grad()`` at a synchronizing step drops what the window holds (Accelerate's ``zero_grad`` drops the
  ``.grad`` there too), elsewhere nothing.
* ``clip_grad_norm_(parameters, max_norm)`` sets gaengine's clipping threshold (``max_grad_norm``) and, at a
  synchronizing step, ends the window there to return its norm (0-d fp32 tensor, after normalization, before
  clipping): the norm needs the reduced window, and gaengine computes it with the update. ``optimizer.step()``
  afterwards finds the window applied and does nothing.
* At a synchronizing step, ``backward()`` leaves the window's gradient in ``.grad`` (normalized; clipped once
  ``clip_grad_norm_`` ran) until ``optimizer.zero_grad()``, where a plain Accelerate loop reads it: a copy per update,
  ``window_grads=False`` turns it off. Mid-window ``.grad`` is None.
* ``no_sync`` is a null context: there is no DDP reducer to silence, and gaengine communicates only in a window's
  last micro-batch anyway.
* ``mixed_precision="fp16"`` keeps Accelerate's autocast but not its ``GradScaler``: gaengine's dynamic loss scaling
  (``loss_scale="dynamic"``) scales the loss, finds non-finite gradients and skips that update; the scheduler then
  does not step (``optimizer.step_was_skipped``).
* The prepared scheduler (``GaengineScheduler``) steps as Accelerate's does: ``num_processes`` times per applied
  update (once with ``split_batches``), not on a skipped update; the learning rate of every update is plain
  Accelerate's.
* ``save_state`` / ``load_state`` carry gaengine's state (fp32 master weights, loss scale, the window so far) inside
  the optimizer's state dict, loaded after the model's and the optimizer's own.

Refused with ``ValueError`` naming the argument: DeepSpeed, FSDP, Megatron-LM, XLA and tensor/context parallelism
(each owns the gradients gaengine owns), LOMO optimizers (their update runs inside backward), and an optimizer
prepared before its model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType

import gaengine
from gaengine.checkpoint import FlatShard
from gaengine.config import AccumulatorConfig
from gaengine.optimizer_list import OptimizerList

__all__ = ["GaengineAccelerator", "GaengineOptimizer", "GaengineScheduler"]

_STATE_KEY = "gaengine"  # the accumulator's state inside the prepared optimizer's state dict
_OPTIMIZER_KEY = "optimizer"

_REFUSED_TYPES = {
    DistributedType.DEEPSPEED: "deepspeed_plugin (DeepSpeed)",
    DistributedType.FSDP: "fsdp_plugin (FSDP)",
    DistributedType.MEGATRON_LM: "megatron_lm_plugin (Megatron-LM)",
    DistributedType.XLA: "an XLA device",
}


def check_accumulator_options(options: Mapping[str, Any] | None, name: str = "accumulator_options") -> dict[str, Any]:
    """The ``GradientAccumulator`` keywords of ``options``, checked now (before any model is touched).

    Accepted: the fields of ``gaengine.AccumulatorConfig`` (``zero_stage``, ``backend``, ``bucket_size_mb``,
    ``loss_scale``, ...) and ``process_group``. Raises ``TypeError`` naming ``name`` for a key that is not one of
    them or for ``lr_scheduler`` (the framework steps the scheduler), ``ValueError`` from ``AccumulatorConfig`` for a
    bad value (naming the field).
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{name} must be a mapping of GradientAccumulator keywords, got {type(options).__name__}")
    options = dict(options)
    allowed = set(AccumulatorConfig.__dataclass_fields__) | {"process_group"}
    unknown = sorted(set(options) - allowed)
    if "lr_scheduler" in unknown:
        raise TypeError(f"{name} must not hold 'lr_scheduler': prepare the scheduler with the accelerator (or let the "
                        "Trainer build it); it is stepped once per applied update")
    if unknown:
        raise TypeError(f"{name} has unknown GradientAccumulator keyword(s) {unknown}; accepted: {sorted(allowed)}")
    AccumulatorConfig(**{k: v for k, v in options.items() if k != "process_group"})  # ValueError naming the field
    return options


def _check_max_norm(max_norm: Any) -> float | None:
    """``clip_grad_norm_``'s ``max_norm`` as gaengine's ``max_grad_norm``: inf means no clipping (None)."""
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"max_norm must be a float > 0 (or inf: no clipping), got {max_norm!r}") from None
    if isinstance(max_norm, bool) or value != value or value <= 0:
        raise ValueError(f"max_norm must be a float > 0 (or inf: no clipping), got {max_norm!r}")
    return None if value == float("inf") else value


class GaengineOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: its ``step()`` at a synchronizing step ends gaengine's accumulation window.

    Wraps the user's ``torch.optim.Optimizer`` (``self.optimizer``, re-pointed by gaengine at fp32 master weights for
    bf16/fp16 parameters) and the ``gaengine.GradientAccumulator`` built over it (``self.accumulator``).
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so a scheduler built over this object
    changes the learning rate gaengine's update uses.

    * ``step()``: when ``sync_gradients`` is set, ``accumulator.step(force=True)`` (a partial window is normalized by
      what it holds) unless ``accelerator.clip_grad_norm_`` already applied this window; otherwise nothing.
      ``last_result`` is the ``gaengine.StepResult`` of the last applied window (None before the first).
    * ``step_was_skipped``: the last window's update was skipped (a non-finite gradient; or Accelerate's
      ``_is_overflow`` set by a caller), read from the device on first access after each update (one host sync),
      so Accelerate's scheduler and the Trainer do not step on it; ``num_skipped`` counts them.
    * ``zero_grad()``: at a synchronizing step, drops what the window holds (Accelerate's ``zero_grad`` drops the
      ``.grad`` there) and the window's gradient from ``.grad``; elsewhere nothing. ``set_to_none`` is accepted and
      ignored.
    * ``window_grads``: the parameters whose ``.grad`` holds the window's gradient (``GaengineAccelerator``'s
      ``window_grads``), scaled by the clip coefficient when the window is applied, released by ``zero_grad()`` or
      the next ``backward()``.
    * ``state_dict()`` / ``load_state_dict()``: ``{"optimizer": <the wrapped optimizer's>, "gaengine":
      accumulator.state_dict()}``, loaded in that order (the model's state first, by Accelerate and the Trainer). A
      plain optimizer state dict (no ``"gaengine"`` key) loads into the wrapped optimizer alone.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accumulator: gaengine.GradientAccumulator | None,
                 device_placement: bool = True) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.accumulator = accumulator
        self.last_result: gaengine.StepResult | None = None
        self._window_applied = False  # clip_grad_norm_ ran this window's step(); optimizer.step() is then a no-op
        self._skipped: bool | None = None  # host copy of last_result.skipped, read on first access
        self._num_skipped = 0

    def apply_window(self) -> gaengine.StepResult | None:
        """End the accumulation window now: ``accumulator.step(force=True)`` (it applies what ``.grad`` holds where
        ``accumulator.begin_step()`` lent the window's gradient there); None if it held no micro-batch."""
        result = self.accumulator.step(force=True)
        if result is not None:
            self._settle()  # the previous window's skip flag into num_skipped (computed long ago: no wait)
            self.last_result = result
            self._skipped = None
            self._window_applied = True
        return result

    def _settle(self) -> None:
        if self._skipped is None and self.last_result is not None:
            self._skipped = bool(self.last_result.skipped)  # host read: once per update
            self._num_skipped += self._skipped

    @property
    def num_skipped(self) -> int:
        """Updates skipped so far for a non-finite gradient (windows applied through this optimizer)."""
        self._settle()
        return self._num_skipped

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("closure is not supported: gaengine runs the optimizer once per accumulation window, "
                             "from the gradients it accumulated; call optimizer.step() without a closure")
        if not self.gradient_state.sync_gradients:
            return
        if self._window_applied:
            self._window_applied = False
            return
        self.apply_window()
        self._window_applied = False

    def release_grads(self) -> None:
        """``.grad`` = None for the accumulator's parameters (the applied window's gradient left there by
        ``accumulator.begin_step()``)."""
        for p in self.accumulator.params:
            p.grad = None

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        if not self._window_applied and self.accumulator.num_micro_batches:
            self.accumulator.zero_grad()  # the window dropped, its lent .grad with it
        else:
            self.release_grads()

    @property
    def step_was_skipped(self) -> bool:
        """The last window's update was skipped (a non-finite gradient), or Accelerate's own flag ``_is_overflow``
        is set (gaengine leaves it False: only a caller setting it, as Accelerate's scheduler tests do, makes it
        count, as in plain Accelerate, whose ``step_was_skipped`` is that flag)."""
        if self._is_overflow:
            return True
        if self.last_result is None:
            return False
        self._settle()
        return self._skipped

    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()`` (``state``, ``param_groups``: the keys of plain Accelerate's)
        with gaengine's state under ``"gaengine"``: ``accumulator.state_dict()`` as plain tensors (``_plain_state``),
        which alias the live state as torch's optimizer state dicts do. Raises ``RuntimeError`` at ``zero_stage`` >=
        1 and mid-window on several ranks (one file cannot hold what differs per rank)."""
        acc = self.accumulator
        if acc.config.zero_stage > 0:
            raise RuntimeError(
                f"the prepared optimizer's state_dict() cannot hold gaengine's state at zero_stage="
                f"{acc.config.zero_stage}: it is sharded over the ranks and every rank must save its part; save "
                "{'model': model.state_dict(), 'acc': accelerator.accumulator.state_dict()} with "
                "torch.distributed.checkpoint on every rank instead (docs/checkpoints.md)")
        if acc.world_size > 1 and acc.num_micro_batches > 0:
            raise RuntimeError(
                f"save between windows on several ranks (this window holds {acc.num_micro_batches} micro-batch(es) "
                "whose sums differ per rank, and one file is written): call save_state after optimizer.step() at a "
                "synchronizing step")
        return {**self.optimizer.state_dict(), _STATE_KEY: _plain_state(acc.state_dict())}

    def load_state_dict(self, state_dict: dict) -> None:
        """A ``state_dict()`` of this class (its ``"gaengine"`` entry loaded last: it restores the fp32 masters and
        the window), one of an earlier gaengine (``{"optimizer": ..., "gaengine": ...}``), or a plain optimizer
        state dict (no ``"gaengine"`` key: the wrapped optimizer alone)."""
        if _STATE_KEY not in state_dict:
            self.optimizer.load_state_dict(state_dict)
            return
        plain = state_dict.get(_OPTIMIZER_KEY) if "state" not in state_dict else {
            k: v for k, v in state_dict.items() if k != _STATE_KEY}
        self.optimizer.load_state_dict(plain)
        self.accumulator.load_state_dict(state_dict[_STATE_KEY])  # last: it restores the fp32 masters and the window
        self._window_applied = False


def _plain_state(value: Any) -> Any:
    """``accumulator.state_dict()`` with each ``gaengine.checkpoint.FlatShard`` (a placeholder for DCP that refuses
    tensor operations) replaced by its data: ``local``, where this rank's chunk is the whole value (one rank at
    ``zero_stage=0``, which ``state_dict`` checks), or None for a template (the window's gradient between windows:
    ``load_state_dict`` takes None there, as after ``dcp.load``)."""
    if isinstance(value, FlatShard):
        return None if value.template else value.local
    if isinstance(value, dict):
        return {k: _plain_state(v) for k, v in value.items()}
    return value


class GaengineScheduler(AcceleratedScheduler):
    """The prepared learning-rate scheduler: ``step()`` steps the wrapped scheduler exactly as Accelerate's own
    ``AcceleratedScheduler`` does, so the learning rate of every update is plain Accelerate's.

    * At a synchronizing step (``sync_gradients``) whose update was applied: ``num_processes`` times with
      ``split_batches=False`` (Accelerate's convention: a schedule is counted in one process's batches, and one
      update consumes ``num_processes`` of them; a ``OneCycleLR`` stops at its ``total_steps``), once with
      ``split_batches=True``.
    * At a skipped update (a non-finite gradient, the ``GaengineOptimizer``'s ``step_was_skipped``, one host read per
      update): nothing.
    * Off a synchronizing step: only Accelerate's ``adjust_scheduler`` bookkeeping (``_step_count`` advanced).
    * Built with ``step_scheduler_with_optimizer=False``: every call steps once.
    """


class GaengineAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose gradient accumulation runs through ``gaengine.GradientAccumulator``.

    Args:
        *args, **kwargs: ``accelerate.Accelerator``'s own (``gradient_accumulation_steps``, ``mixed_precision``,
            ``gradient_accumulation_plugin``, ``step_scheduler_with_optimizer``, ...).
        accumulation_steps: K for gaengine when it differs from Accelerate's ``gradient_accumulation_steps`` (the
            Trainer sets Accelerate's to 1 and marks the window's end itself); default: Accelerate's.
        max_grad_norm: gaengine's clipping threshold until ``clip_grad_norm_`` sets one; default None (no
            clipping, as a plain Accelerate loop that never calls ``clip_grad_norm_``).
        accumulator_options: further ``GradientAccumulator`` keywords (``zero_stage``, ``backend``,
            ``bucket_size_mb``, ``reduce_dtype``, ``loss_scale``, ``process_group``, ...), checked here.
        window_grads: True (default): at a synchronizing step, ``backward()`` leaves the window's gradient in
            ``.grad`` (normalized by the window's micro-batches or items, in the parameters' dtype; scaled by the clip
            coefficient once ``clip_grad_norm_`` applied the window), where a plain Accelerate loop reads it, until
            ``optimizer.zero_grad()`` or the next ``backward()``. It costs one pass over the window's fp32 gradient
            and a ``.grad`` per parameter (the memory plain Accelerate's ``.grad`` takes) per update. Not at
            ``zero_stage`` >= 1 (each rank holds a shard), nor for a partial window on several ranks (reduced only
            when applied). False: ``.grad`` stays None.

    Raises ``ValueError`` naming the argument for DeepSpeed (``deepspeed_plugin``), FSDP (``fsdp_plugin``),
    Megatron-LM (``megatron_lm_plugin``), XLA and ``parallelism_config`` with tensor or context parallelism (each of
    them owns the gradients gaengine owns); ``TypeError`` / ``ValueError`` for bad ``accumulator_options``.

    One accumulator per accelerator: ``prepare`` a model before (or together with) its optimizer, and one
    optimizer; the accumulator is ``accelerator.accumulator`` (None before ``prepare``).
    """

    def __init__(self, *args: Any, accumulation_steps: int | None = None, max_grad_norm: float | None = None,
                 accumulator_options: Mapping[str, Any] | None = None, window_grads: bool = True,
                 **kwargs: Any) -> None:
        if not isinstance(window_grads, bool):
            raise TypeError(f"window_grads must be True or False, got {window_grads!r}")
        self.window_grads = window_grads
        for name in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"):
            if kwargs.get(name) is not None:
                raise ValueError(_refusal(name))
        parallelism = kwargs.get("parallelism_config")
        if parallelism is not None and (getattr(parallelism, "tp_enabled", False)
                                        or getattr(parallelism, "cp_enabled", False)
                                        or getattr(parallelism, "dp_shard_enabled", False)):
            raise ValueError(_refusal("parallelism_config"))
        self._accumulator_options = check_accumulator_options(accumulator_options)
        for name, value in (("accumulation_steps", accumulation_steps), ("max_grad_norm", max_grad_norm)):
            if value is not None:
                if name in self._accumulator_options:
                    raise TypeError(f"{name} given both as an argument and in accumulator_options; pass it once")
                self._accumulator_options[name] = value
        AccumulatorConfig(**{k: v for k, v in self._accumulator_options.items() if k != "process_group"})
        super().__init__(*args, **kwargs)
        refused = _REFUSED_TYPES.get(self.distributed_type)
        if refused is not None:  # set by `accelerate launch` / the environment rather than an argument
            raise ValueError(_refusal(refused))
        # fp16: Accelerate's autocast stays, its GradScaler goes: gaengine scales the loss itself (a second scaler
        # would scale twice; gaengine refuses a GradScaler-scaled loss).
        self.scaler = None
        self.accumulator: gaengine.GradientAccumulator | None = None

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        """Accelerate's ``prepare``; several optimizers in one call (``prepare(model, muon, adamw)``, as plain
        Accelerate takes them) become one accumulator over their list (``gaengine.optimizer_list.OptimizerList``:
        one window's norm, clip coefficient and skip, then each optimizer steps once; docs/optimizers.md), and the
        one prepared optimizer is returned in each of their places: the first ``step()`` of a window ends it (every
        optimizer steps), a second one finds the window empty and does nothing, as ``zero_grad()`` twice. Raises what
        ``GradientAccumulator`` raises for the list (a parameter in two optimizers or a trainable one in none,
        naming it)."""
        fresh = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)
                 and not isinstance(a, AcceleratedOptimizer) and not getattr(a, "_is_accelerate_prepared", False)]
        if len(fresh) < 2:
            return super().prepare(*args, device_placement=device_placement)
        combined = OptimizerList([args[i] for i in fresh])
        keep = [i for i in range(len(args)) if i not in fresh[1:]]
        placement = None if device_placement is None else [device_placement[i] for i in keep]
        out = super().prepare(*[combined if i == fresh[0] else args[i] for i in keep], device_placement=placement)
        prepared = dict(zip(keep, out if len(keep) > 1 else (out,)))
        return tuple(prepared[fresh[0]] if i in fresh else prepared[i] for i in range(len(args)))

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Place ``model`` on the device and wrap its forward for mixed precision, as Accelerate does, but never in
        torch DDP (``evaluation_mode=True`` in Accelerate's terms): gaengine reduces the gradients itself."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError("model is wrapped in DistributedDataParallel: pass the bare model to prepare(); gaengine "
                            "all-reduces the gradients itself")
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        """Build the ``gaengine.GradientAccumulator`` over ``optimizer`` and the prepared model holding its
        parameters; returns the ``GaengineOptimizer`` that ends its windows.

        Raises ``ValueError`` when no prepared model holds the optimizer's parameters (prepare the model first or in
        the same ``prepare`` call, before the optimizer), when a second optimizer is prepared, or for a LOMO optimizer
        (its update runs inside backward, with no gradient to accumulate).
        """
        if isinstance(optimizer, GaengineOptimizer) or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if type(optimizer).__name__ in ("Lomo", "AdaLomo"):
            raise ValueError(f"optimizer: {type(optimizer).__name__} updates the parameters inside backward (no "
                             "gradient is accumulated); use a torch.optim optimizer with gaengine")
        if self.accumulator is not None:
            raise ValueError("optimizer: GaengineAccelerator drives one accumulator, and an optimizer was prepared "
                             "already; pass every optimizer to one prepare() call (prepare(model, muon, adamw): one "
                             "accumulator over their list, docs/optimizers.md)")
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        model = next((m for m in self._models if ids <= {id(p) for p in m.parameters()}), None)
        if model is None:
            raise ValueError("optimizer: no prepared model holds its parameters; pass the model to prepare() before "
                             "the optimizer, e.g. prepare(model, optimizer, ...)")
        if device_placement is None:
            device_placement = self.device_placement
        options = dict(self._accumulator_options)
        options.setdefault("accumulation_steps", self.gradient_accumulation_steps)
        options.setdefault("max_grad_norm", None)
        if self.state.mixed_precision == "fp16":
            options.setdefault("loss_scale", "dynamic")
        process_group = options.pop("process_group", None)
        # Accelerate moves the optimizer's state to the device first (AcceleratedOptimizer.__init__); gaengine is
        # built last, after every move of the model and the optimizer (docs: build the accumulator last).
        wrapped = GaengineOptimizer(optimizer, None, device_placement=device_placement)
        wrapped.accumulator = self.accumulator = gaengine.GradientAccumulator(
            model, optimizer, process_group=process_group, **options)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> GaengineScheduler:
        """Wrap ``scheduler`` in a ``GaengineScheduler``: it steps as Accelerate's ``AcceleratedScheduler`` does
        (``num_processes`` times per applied update, once with ``split_batches``, not on a skipped update). A
        scheduler prepared already is returned as it is."""
        if getattr(scheduler, "_is_accelerate_prepared", False) or isinstance(scheduler, AcceleratedScheduler):
            if scheduler not in self._schedulers:
                self._schedulers.append(scheduler)
            return scheduler
        optimizers = self._optimizers
        for opt in self._optimizers:
            if getattr(scheduler, "optimizer", None) is opt.optimizer:
                optimizers = opt
                break
        wrapped = GaengineScheduler(scheduler, optimizers, step_with_optimizer=self.step_scheduler_with_optimizer,
                                    split_batches=self.split_batches)
        self._schedulers.append(wrapped)
        return wrapped

    def free_memory(self, *objects: Any):
        """Accelerate's ``free_memory`` (it forgets the prepared objects), the accumulator closed and forgotten too,
        so that a later ``prepare`` builds a new one (the Trainer calls this at the start of every ``train()``)."""
        if self.accumulator is not None:
            for opt in self._optimizers:
                if isinstance(opt, GaengineOptimizer):
                    opt.release_grads()
            self.accumulator.close()
            self.accumulator = None
        return super().free_memory(*objects)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """Accelerate's ``get_state_dict``, each tensor of gaengine's model cloned: bf16/fp16 parameters are views of
        one flat buffer (shared storage), which safetensors refuses to save (``save_state``, ``save_model``)."""
        state = super().get_state_dict(model, unwrap=unwrap)
        if self.accumulator is None:
            return state
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def save_state(self, output_dir: str | None = None, safe_serialization: bool | None = None,
                   **save_model_func_kwargs: Any):
        """Accelerate's ``save_state``; gaengine's state travels in the prepared optimizer's state dict.

        ``safe_serialization`` (Accelerate's default True) defaults to False when the model's parameters share one
        storage (bf16/fp16 parameters become views of gaengine's flat buffer, and safetensors refuses to load shared
        tensors into a model); ``load_state`` reads either format.
        """
        if safe_serialization is None:
            safe_serialization = not self._shares_storage()
        return super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)

    def _shares_storage(self) -> bool:
        if self.accumulator is None:
            return False
        seen = set()
        for model in self._models:
            for p in model.parameters():
                ptr = p.untyped_storage().data_ptr()
                if ptr in seen:
                    return True
                seen.add(ptr)
        return False

    # ------------------------------------------------------------------ the accumulation path
    def _gaengine_optimizer(self) -> GaengineOptimizer:
        for opt in self._optimizers:
            if isinstance(opt, GaengineOptimizer):
                return opt
        models = "a model was" if self._models else "nothing was"
        raise RuntimeError(f"accelerator.backward() needs the optimizer: {models} prepared without one, which serves "
                           "evaluation, unwrap_model and saving, but gaengine accumulates the gradients into the "
                           "optimizer's update. Pass the optimizer to prepare (accelerator.prepare(model, optimizer, "
                           "...), or prepare(optimizer) after the model) before accelerator.backward()")

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None, **kwargs: Any) -> None:
        """Backward of one micro-batch into gaengine's fp32 window: ``accumulator.backward(loss, num_items)``; at a
        synchronizing step (``window_grads``, ``zero_stage=0``) then ``accumulator.begin_step(force=True)``: the
        window's gradient lent in ``.grad`` for the loop to read and edit before ``optimizer.step()`` or
        ``clip_grad_norm_`` applies it.

        loss: 0-d floating tensor, the micro-batch's mean loss, or its sum over items with ``num_items``. Not divided
            by K: the window is normalized once, by the micro-batches it holds, or by its items over all micro-batches
            and ranks (``num_items``: the items this micro-batch's summed loss covers, an int >= 1 or a 0-d tensor).
        kwargs: passed to ``torch.Tensor.backward`` (``retain_graph``, ...); ``learning_rate`` (LOMO) is refused.

        Raises what ``GradientAccumulator.backward`` raises (``ValueError`` for a bad loss or ``num_items``, nothing
        accumulated; ``RuntimeError`` for a second ``backward`` at a synchronizing step, whose window's gradient is
        lent: call ``optimizer.step()`` or ``optimizer.zero_grad()`` first), and ``RuntimeError`` naming the missing
        optimizer before one is prepared.
        """
        if "learning_rate" in kwargs:
            raise ValueError("learning_rate: LOMO's fused backward-update is not supported by gaengine")
        acc = self._gaengine_optimizer().accumulator
        acc.backward(loss, num_items=num_items, **kwargs)
        if self.window_grads and acc.config.zero_stage == 0 and self._ends_window(acc):
            acc.begin_step(force=True)

    def _ends_window(self, acc: gaengine.GradientAccumulator) -> bool:
        """Whether this micro-batch ends gaengine's window: a synchronizing step (``sync_gradients``) where the
        window holds K micro-batches, the dataloader ends, or the caller marks the windows' ends itself (Accelerate's
        ``gradient_accumulation_steps`` is not gaengine's K: the Trainer's). A loop without ``accumulate()`` keeps
        ``sync_gradients`` set at every micro-batch: its window ends with K."""
        if not self.sync_gradients:
            return False
        return (acc.num_micro_batches >= acc.accumulation_steps or self.gradient_state.end_of_dataloader
                or self.gradient_accumulation_steps != acc.accumulation_steps)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2) -> torch.Tensor | None:
        """Set gaengine's clipping threshold to ``max_norm`` (``inf``: no clipping) and, at a synchronizing step, end
        the window to return its norm.

        Returns the window's L2 gradient norm (0-d fp32 tensor on the device, after normalization by the window's
        micro-batches or items and before clipping), with the update applied (the following ``optimizer.step()``
        does nothing); None off a synchronizing step (the threshold applies to the window's end) or when the window
        is empty. Parameters not under gaengine go to Accelerate's own ``clip_grad_norm_``.

        Raises ``ValueError`` for ``norm_type`` other than 2 (gaengine's norm is L2) or ``max_norm`` <= 0.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self.accumulator is None or not params:
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        ours = {id(p) for p in self.accumulator.params}
        if not any(id(p) in ours for p in params):
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type must be 2 (gaengine clips the L2 norm of the window's gradient), got "
                             f"{norm_type!r}")
        self.accumulator.max_grad_norm = _check_max_norm(max_norm)
        if not self.sync_gradients:
            return None
        result = self._gaengine_optimizer().apply_window()
        return None if result is None else result.grad_norm

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module):
        """A null context: the model is not in DDP, and gaengine communicates only in a window's last micro-batch."""
        yield


def _refusal(argument: str) -> str:
    return (f"{argument} cannot be combined with gaengine: it owns the gradients (their accumulation, reduction and "
            "sharding) that gaengine accumulates into its fp32 buffer. Drop it and use gaengine's own data "
            "parallelism (GradientAccumulator(..., zero_stage=1|2) for sharded optimizer state), or use the plain "
            "accelerate.Accelerator")
