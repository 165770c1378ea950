"""gaengine inside Lightning's ``Trainer``: a ``Strategy`` and a ``Precision`` plugin (``pip install gaengine[lightning]``).

Switching is one argument::

    trainer = lightning.pytorch.Trainer(accumulate_grad_batches=8, gradient_clip_val=1.0,
                                        strategy=GaengineStrategy())

The pattern is Lightning's own DeepSpeed integration (``lightning/pytorch/strategies/deepspeed.py`` and
``plugins/precision/deepspeed.py``): the strategy says ``handles_gradient_accumulation``, so Lightning routes every
micro-batch's closure through the precision plugin's ``optimizer_step``, and the plugin's ``backward``,
``optimizer_step`` and ``clip_gradients`` go through one ``gaengine.GradientAccumulator`` that the strategy builds
over the ``LightningModule`` and its one optimizer once both are on the device:

* ``backward``: ``acc.backward(loss * K)``. Lightning divides every closure loss by ``accumulate_grad_batches`` (K)
  before backward (``ClosureResult.from_training_step_output``), the partial last window included
  (Lightning-AI/pytorch-lightning#19987); multiplying by K undoes it exactly for the gradient (the gradient reaching
  the loss is ``1 * K / K = 1``, both products exact in fp32), so gaengine receives the micro-batch mean and
  normalizes each window by the micro-batches it really holds.
* ``clip_gradients``: ``gradient_clip_val`` (through ``configure_gradient_clipping``, Lightning's hook) becomes the
  window's ``max_grad_norm``; gaengine clips the normalized fp32 window gradient by its L2 norm.
* ``optimizer_step``: runs the closure (``training_step`` + backward) on every micro-batch and, at the window's last
  micro-batch or the epoch's last batch, ``acc.step(force=...)``: normalize, clip, update on fp32 gradients.

K is ``Trainer(accumulate_grad_batches=K)``, read at the start of every window, so Lightning's
``GradientAccumulationScheduler`` (and ``accumulate_grad_batches={epoch: K}``) changes it between epochs. The model
is never wrapped in DDP: on several processes (the DDP-style launch: ``devices=N``, ``torchrun``, gloo on CPU or
NCCL on GPU) gaengine all-reduces the window's gradient itself, in the last micro-batch only.

Lightning imports only here (``import gaengine`` never imports it). docs/integrations/lightning.md has the
one-diff switch, what changes in the numbers and what is refused; examples/lightning_example.py and
examples/lightning_manual_example.py run.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import Tensor

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("gaengine.integrations.lightning needs Lightning (the `lightning` package 2.6.x): "
                      "pip install 'gaengine[lightning]'") from exc

from gaengine import AccumulatorConfig, GradientAccumulator, StepResult

__all__ = ["GaenginePrecision", "GaengineStrategy"]

# GradientAccumulator's arguments that the Trainer sets (or the strategy does): refused as strategy options.
_TRAINER_OWNS = {
    "accumulation_steps": "Trainer(accumulate_grad_batches=K) (or Lightning's GradientAccumulationScheduler)",
    "max_grad_norm": "Trainer(gradient_clip_val=...)",
    "lr_scheduler": "LightningModule.configure_optimizers (Lightning steps the schedulers)",
    "process_group": "the strategy's launch (every rank of the Trainer's world takes part)",
    "model": "the LightningModule given to Trainer.fit",
    "optimizer": "LightningModule.configure_optimizers",
}

_MANUAL_RECIPE = "examples/lightning_manual_example.py and docs/integrations/lightning.md show the recipe"


def _final_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch being run is the epoch's last: the data ran out, or ``limit_train_batches`` is reached
    (the condition of Lightning's ``_TrainingEpochLoop._num_ready_batches_reached``, on which Lightning steps)."""
    loop = trainer.fit_loop.epoch_loop
    return bool(trainer.is_last_batch) or loop.batch_idx + 1 >= trainer.num_training_batches


class GaenginePrecision(Precision):
    """Lightning ``Precision`` plugin whose ``backward``, ``optimizer_step`` and ``clip_gradients`` go through a
    ``gaengine.GradientAccumulator`` (built and attached by ``GaengineStrategy``; used alone it raises).

    inner: the plugin that ``Trainer(precision=...)`` made, kept for what is about dtypes only (``convert_module``,
        ``convert_input``, ``forward_context``: autocast for ``"bf16-mixed"``/``"16-mixed"``, the module cast for
        ``"bf16-true"``/``"16-true"``); ``None`` is fp32 (``"32-true"``). Accepted: Lightning's ``Precision``,
        ``HalfPrecision`` and ``MixedPrecision`` (its ``GradScaler`` is dropped: gaengine scales fp16 losses
        itself, dynamically). Any other plugin raises ``ValueError`` naming it.

    After every applied window, ``last_result`` holds gaengine's ``StepResult`` (``grad_norm``, ``clip_coef``,
    ``skipped``, ``loss``; 0-d tensors on the device). A window with a non-finite gradient (or, under
    ``"16-mixed"``, one that overflowed the loss scale) is skipped on the device: parameters, optimizer state and
    the rest unchanged; ``update_was_skipped`` says so for the last update and ``num_skipped`` counts them (each
    read from the device once per update, when first asked), and ``GaengineStrategy`` then holds the step-interval
    schedulers.
    """

    def __init__(self, inner: Precision | None = None) -> None:
        super().__init__()
        if inner is None:
            inner = Precision()
        if isinstance(inner, GaenginePrecision):
            inner = inner.inner
        if type(inner) not in (Precision, HalfPrecision, MixedPrecision):
            raise ValueError(
                f"GaengineStrategy cannot compose with the precision plugin {type(inner).__name__} "
                f"(precision={getattr(inner, 'precision', '?')!r}): gaengine owns the backward, the fp32 gradient sum, "
                "the loss scale and the update, which that plugin also wants to own. Use Trainer(precision=...) with "
                "'32-true', 'bf16-true', '16-true', 'bf16-mixed' or '16-mixed'"
                + (" (gaengine keeps fp32 master weights and fp32 gradient sums itself; 64-bit parameters are not "
                   "supported)" if isinstance(inner, DoublePrecision) else ""))
        if isinstance(inner, MixedPrecision):
            inner.scaler = None  # gaengine's own dynamic loss scale replaces torch.amp.GradScaler
        self.inner = inner
        self.precision = inner.precision
        self.accumulator: GradientAccumulator | None = None
        self.last_result: StepResult | None = None
        self._clip_val: float | None = None
        self._pending_state: dict | None = None
        self._skipped: bool | None = None  # host copy of last_result.skipped, read on first access
        self._num_skipped = 0

    # ------------------------------------------------------------------ skipped updates
    def _settle(self) -> None:
        if self._skipped is None and self.last_result is not None:
            self._skipped = bool(self.last_result.skipped)  # host read: once per update, after its step
            self._num_skipped += self._skipped

    @property
    def update_was_skipped(self) -> bool:
        """Whether the last update was skipped for a non-finite window gradient (False before the first)."""
        self._settle()
        return bool(self._skipped)

    @property
    def num_skipped(self) -> int:
        """Updates skipped so far (non-finite window gradients), over every fit with this plugin."""
        self._settle()
        return self._num_skipped

    # ------------------------------------------------------------------ dtypes: the inner plugin's
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.inner.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    def tensor_init_context(self):
        return self.inner.tensor_init_context()

    def module_init_context(self):
        return self.inner.module_init_context()

    def forward_context(self):
        return self.inner.forward_context()

    @property
    def loss_scale(self) -> str | None:
        """gaengine's ``loss_scale`` for this precision: ``"dynamic"`` for ``"16-mixed"`` (the backward runs outside
        the autocast region, where gaengine's ``"auto"`` would not see fp16), else ``"auto"``."""
        return "dynamic" if self.precision == "16-mixed" else "auto"

    # ------------------------------------------------------------------ the accumulator
    def attach(self, accumulator: GradientAccumulator) -> None:
        """Route backward/step/clip through ``accumulator`` (called by ``GaengineStrategy.setup``)."""
        self.accumulator = accumulator

    def _acc(self) -> GradientAccumulator:
        if self.accumulator is None:
            raise RuntimeError("GaenginePrecision has no accumulator: use it through strategy=GaengineStrategy(), which "
                               "builds one over the LightningModule and its optimizer")
        return self.accumulator

    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``acc.backward(tensor * K)``: Lightning's closure loss is the micro-batch loss divided by
        ``accumulate_grad_batches`` (K); gaengine takes the micro-batch mean and normalizes the window itself.
        Under manual optimization (``self.manual_backward``) it raises ``RuntimeError``: call your accumulator's
        ``backward`` instead."""
        if not model.automatic_optimization or optimizer is None:
            raise RuntimeError(
                "self.manual_backward(loss) under GaengineStrategy with manual optimization: the strategy builds no "
                "accumulator then (it only launches the ranks without wrapping the model in DDP). Call "
                f"self.acc.backward(loss) on the GradientAccumulator you built in configure_optimizers; {_MANUAL_RECIPE}")
        if is_overridden("backward", model):
            warnings.warn("LightningModule.backward is overridden but GaengineStrategy ignores it: gaengine runs the "
                          "backward (acc.backward) to accumulate the gradients in fp32", UserWarning, stacklevel=2)
        k = model.trainer.accumulate_grad_batches
        self._acc().backward(tensor * k if k != 1 else tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """One micro-batch: the closure (``training_step``, backward), then, at the window's last micro-batch or
        the epoch's last batch, ``on_before_optimizer_step``, ``configure_gradient_clipping`` and ``acc.step``.

        Raises ``RuntimeError`` under manual optimization (``optimizer.step()``: call ``acc.step()``) and
        ``ValueError`` when ``training_step`` returns ``None`` (a skipped micro-batch; as DeepSpeed's plugin)."""
        if not model.automatic_optimization:
            raise RuntimeError(
                "optimizer.step() under GaengineStrategy with manual optimization: call self.acc.step(force=...) on "
                f"your GradientAccumulator instead (it runs the optimizer at the window's end); {_MANUAL_RECIPE}")
        if kwargs:
            raise ValueError(f"optimizer.step() got keyword arguments {sorted(kwargs)} that gaengine cannot pass on: "
                             "acc.step() runs the optimizer itself; remove them from LightningModule.optimizer_step")
        acc = self._acc()
        trainer = model.trainer
        if acc.num_micro_batches and trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0:
            # A window left open by an epoch cut short (on_train_batch_start returned -1): plain Lightning zeroes
            # those gradients at the next window's start; so does gaengine.
            warnings.warn(f"dropping an unfinished accumulation window of {acc.num_micro_batches} micro-batch(es) "
                          "left by the previous epoch (it ended without its last batch), as Lightning's zero_grad "
                          "does", UserWarning, stacklevel=2)
            acc.zero_grad()
        if acc.num_micro_batches == 0 and acc.accumulation_steps != trainer.accumulate_grad_batches:
            acc.accumulation_steps = trainer.accumulate_grad_batches  # GradientAccumulationScheduler: K per epoch
        closure_result = closure()
        if closure_result is None:
            raise ValueError("training_step returned None (skip this micro-batch), which GaengineStrategy does not "
                             "support: every micro-batch of a window must reach acc.backward() (on several ranks, "
                             "the same number on every rank). Return the loss; mask its items instead")
        final = _final_batch(trainer)
        if acc.num_micro_batches < acc.accumulation_steps and not final:
            return closure_result
        self._clip_val = None
        self._after_closure(model, optimizer)  # on_before_optimizer_step; configure_gradient_clipping -> clip_gradients
        acc.max_grad_norm = self._clip_val
        result = acc.step(force=final)
        if result is not None:
            self._settle()  # the previous update's flag into num_skipped (computed long ago: no wait)
            self.last_result, self._skipped = result, None
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Set the window's L2 clipping threshold (gaengine clips the normalized fp32 gradient in ``acc.step``).
        ``clip_val <= 0`` disables clipping; ``gradient_clip_algorithm="value"`` raises ``ValueError``."""
        if clip_val is None or clip_val <= 0:
            return
        if GradClipAlgorithmType(gradient_clip_algorithm) != GradClipAlgorithmType.NORM:
            raise ValueError(
                f"gradient_clip_algorithm={str(gradient_clip_algorithm.value if isinstance(gradient_clip_algorithm, GradClipAlgorithmType) else gradient_clip_algorithm)!r}: "
                "GaengineStrategy clips by the L2 norm of the window's normalized gradient only (one coefficient "
                "folded into the update); use Trainer(gradient_clip_algorithm='norm') or leave it unset")
        self._clip_val = float(clip_val)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"accumulator": acc.state_dict()}`` (plain tensors and scalars), saved by Lightning in every
        checkpoint under this class's name; ``{}`` before the accumulator exists."""
        if self.accumulator is None:
            return {}
        return {"accumulator": self.accumulator.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the accumulator's state until ``apply_pending_state`` (Lightning restores this plugin before the
        optimizer; gaengine's state loads last, after the optimizer's, as docs/checkpoints.md orders it)."""
        self._pending_state = state_dict.get("accumulator")

    def apply_pending_state(self) -> None:
        """Load the accumulator's state restored from a checkpoint, if any (``GaengineStrategy.on_train_start``)."""
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._acc().load_state_dict(state)

    def teardown(self) -> None:
        self.inner.teardown()


class GaengineStrategy(DDPStrategy):
    """Lightning ``Strategy`` that accumulates, clips and updates through ``gaengine.GradientAccumulator``.

    ``Trainer(strategy=GaengineStrategy(), accumulate_grad_batches=K, gradient_clip_val=c)``: one process
    (``devices=1``) or the DDP-style launch on several (``devices=N``, ``num_nodes``, or processes started by
    ``torchrun``), the model never wrapped in DDP (gaengine reduces). ``Trainer(precision=...)`` gives the dtypes
    (``GaenginePrecision``).

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, process_group_backend, timeout,
            start_method: as Lightning's ``DDPStrategy`` (which this subclasses for its launch and process group).
        **accumulator_options: keywords of ``gaengine.GradientAccumulator`` (the fields of
            ``gaengine.AccumulatorConfig``, checked here: ``ValueError``/``TypeError`` naming the field), e.g.
            ``backend``, ``master_weights``, ``bucket_size_mb``, ``reduce_dtype``, ``loss_scale``. Refused with
            ``ValueError``, naming what sets them instead: ``accumulation_steps`` (``accumulate_grad_batches``),
            ``max_grad_norm`` (``gradient_clip_val``), ``lr_scheduler``, ``process_group``; and ``zero_stage`` other
            than 0 (its state dict needs ``torch.distributed.checkpoint``, which Lightning's checkpoint does not use).

    Automatic optimization: the strategy builds the accumulator over the ``LightningModule`` and its one optimizer
    in ``setup`` (after the module is converted and moved, and the optimizer built), as ``.accumulator``; it
    stays after ``fit`` (``trainer.save_checkpoint`` holds its state) and is closed by the next ``fit``'s set-up. Manual optimization (``automatic_optimization = False``): the strategy only launches the ranks
    and leaves the model unwrapped; you build and drive the accumulator (examples/lightning_manual_example.py).

    ``handles_gradient_accumulation`` is True inside an epoch (Lightning calls ``optimizer_step`` on every
    micro-batch and leaves the windows to gaengine) and False on the epoch's final batch, where Lightning's own rule
    (step on the final batch, counted in ``global_step``, step-interval schedulers stepped) is the one gaengine
    follows: so ``trainer.global_step`` counts every applied update, the partial last window's included.

    A skipped update (non-finite window gradient, fp16 overflow) holds the step-interval schedulers (the module's
    ``lr_scheduler_step`` hook is routed through ``GaenginePrecision.update_was_skipped`` while fitting), as the
    Accelerate and Hugging Face integrations do; ``global_step`` still counts it.
    """

    strategy_name = "gaengine"

    def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", **accumulator_options: Any) -> None:
        for name, owner in _TRAINER_OWNS.items():
            if name in accumulator_options:
                raise ValueError(f"GaengineStrategy({name}=...): set it through {owner}, not the strategy")
        if accumulator_options.get("zero_stage", 0) != 0:
            raise ValueError(
                f"GaengineStrategy(zero_stage={accumulator_options['zero_stage']!r}): only zero_stage=0 is supported "
                "inside Lightning (a sharded accumulator's state dict is saved with torch.distributed.checkpoint, which "
                "Lightning's checkpoint does not use); drop zero_stage, or drive gaengine yourself with manual "
                "optimization")
        AccumulatorConfig(accumulation_steps=1, max_grad_norm=None, **accumulator_options)  # checked once, here
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self.accumulator_options = dict(accumulator_options)

    # ------------------------------------------------------------------ precision: always gaengine's
    @property
    def precision_plugin(self) -> GaenginePrecision:
        if self._precision_plugin is None:
            self._precision_plugin = GaenginePrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else GaenginePrecision(plugin)

    @property
    def accumulator(self) -> GradientAccumulator | None:
        """The ``GradientAccumulator`` of the current fit (automatic optimization), else None."""
        return self.precision_plugin.accumulator

    # ------------------------------------------------------------------ launch; no DDP wrap
    def setup_environment(self) -> None:
        """Several processes: Lightning's DDP set-up (ranks, process group). One process: no process group at all
        (an initialized one of size 1 would outlive ``fit`` and stand in the way of the next
        ``init_process_group``)."""
        if self.num_nodes * self.num_processes > 1:
            super().setup_environment()
            return
        reset_seed()
        self.set_world_ranks()
        self.accelerator.setup_device(self.root_device)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # gaengine all-reduces the window's gradient itself; DDP's reducer would see freed .grad

    def configure_ddp(self) -> None:
        """No DDP wrap (DDPStrategy's would wrap the model; gaengine reduces the window itself)."""

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Nothing: DDPStrategy's prepares DDP's reducer for the backward, which this strategy has none of."""

    def post_backward(self, closure_loss: Tensor) -> None:
        """Nothing: DDPStrategy's checks DDP's unused parameters; gaengine's stats all-reduce finds them."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        module = self.lightning_module
        trainer = None if module is None else getattr(module, "_trainer", None)
        if trainer is None or not trainer.training or trainer.num_training_batches in (0, float("inf")):
            return True
        return not _final_batch(trainer)

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's set-up (module converted and moved, optimizer built), then the accumulator over them."""
        super().setup(trainer)
        connector = getattr(trainer, "_accelerator_connector", None)
        if self.world_size == 1 and connector is not None:
            # One process: keep the user's sampler, as Lightning's single-device strategy does (a DDPStrategy would
            # swap in a shuffling DistributedSampler of one replica: another data order than strategy="auto").
            connector.use_distributed_sampler = False
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        if not module.automatic_optimization:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"GaengineStrategy needs exactly one optimizer from configure_optimizers, got "
                             f"{len(self.optimizers)}")
        precision = self.precision_plugin
        if precision.accumulator is not None:  # an earlier fit's: its hooks leave the parameters
            precision.accumulator.close()
        options = {"loss_scale": precision.loss_scale, **self.accumulator_options}
        acc = GradientAccumulator(module, self.optimizers[0], accumulation_steps=trainer.accumulate_grad_batches,
                                  max_grad_norm=None, **options)
        precision.attach(acc)
        self._hold_schedulers_on_skip(module, trainer)

    def _hold_schedulers_on_skip(self, module: pl.LightningModule, trainer: pl.Trainer) -> None:
        """Route ``module.lr_scheduler_step`` (Lightning's hook that steps each scheduler; the user's override or
        Lightning's default) through a check: a step-interval scheduler does not step after a skipped update, as
        Accelerate's and the Hugging Face Trainer's schedulers do not. Epoch-interval schedulers step as Lightning
        steps them. The module's own method comes back in ``teardown``."""
        self._restore_scheduler_hook()
        stepping = module.lr_scheduler_step
        precision = self.precision_plugin

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            per_step = any(c.scheduler is scheduler and c.interval == "step" for c in trainer.lr_scheduler_configs)
            if per_step and precision.update_was_skipped:
                return
            stepping(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step
        self._held_module = module

    def _restore_scheduler_hook(self) -> None:
        module = getattr(self, "_held_module", None)
        if module is not None:
            vars(module).pop("lr_scheduler_step", None)
            self._held_module = None

    def teardown(self) -> None:
        self._restore_scheduler_hook()
        super().teardown()

    def on_train_start(self) -> None:
        super().on_train_start()
        self.precision_plugin.apply_pending_state()  # after Lightning restored the optimizer

