"""gaengine inside Lightning's ``Trainer``: a ``Strategy`` and a ``Precision`` plugin (``pip install gaengine[lightning]``).

Switching is one argument::

    trainer = lightning.pytorch.Trainer(accumulate_grad_batches=8, gradient_clip_val=1.0,
                                        strategy=GaengineStrategy())

Lightning's own loop decides the accumulation windows (``handles_gradient_accumulation`` is False, as for DDP):
``training_step``, ``on_before_backward`` and ``on_after_backward`` run once per micro-batch; ``optimizer_step``,
``optimizer_zero_grad``, ``on_before_optimizer_step`` and the ``Callback`` hooks of those names once per update, at
the window's last micro-batch or the epoch's last batch (the partial last window's update included), as under plain
Lightning. The precision plugin's ``backward``, ``optimizer_step`` and ``clip_gradients`` go through one
``gaengine.GradientAccumulator`` that the strategy builds over the ``LightningModule`` and its one optimizer once
both are on the device, and closes when ``fit`` ends:

* ``backward``: ``acc.backward(loss * K)``. Lightning divides every closure loss by ``accumulate_grad_batches`` (K)
  before backward (``ClosureResult.from_training_step_output``), the partial last window included
  (Lightning-AI/pytorch-lightning#19987); multiplying by K undoes it exactly for the gradient (the gradient reaching
  the loss is ``1 * K / K = 1``, both products exact in fp32), so gaengine receives the micro-batch mean and
  normalizes each window by the micro-batches it really holds.
* ``optimizer_step`` (once per update, inside ``LightningModule.optimizer_step``'s ``optimizer.step(closure)``): the
  closure (the window's last ``training_step`` and backward), then ``acc.step(force=True)``, which runs
  ``on_before_optimizer_step`` and ``configure_gradient_clipping`` with the window's normalized gradient in the
  parameters' ``.grad`` (when either hook is overridden; what they write to it reaches the update), then clips and
  updates on fp32 gradients.
* ``clip_gradients``: ``gradient_clip_val`` (through ``configure_gradient_clipping``, Lightning's hook) becomes the
  window's ``max_grad_norm``; gaengine clips the normalized fp32 window gradient by its L2 norm.

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
    from lightning.pytorch.overrides.distributed import _sync_module_states
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("gaengine.integrations.lightning needs Lightning (the `lightning` package 2.6.x): "
                      "pip install 'gaengine[lightning]'") from exc

from gaengine import GradientAccumulator
from gaengine.integrations.fabric import InnerPrecision, check_strategy_options

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


def _hook_overridden(trainer: pl.Trainer, model: pl.LightningModule, name: str) -> bool:
    """Whether ``model`` or one of the trainer's callbacks overrides the hook ``name``."""
    return is_overridden(name, model) or any(is_overridden(name, cb, pl.Callback) for cb in trainer.callbacks)


class GaenginePrecision(InnerPrecision, Precision):
    """Lightning ``Precision`` plugin whose ``backward``, ``optimizer_step`` and ``clip_gradients`` go through a
    ``gaengine.GradientAccumulator`` (built and attached by ``GaengineStrategy``; used alone it raises).

    inner: the plugin that ``Trainer(precision=...)`` made, kept for what is about dtypes only (``convert_module``,
        ``convert_input``, ``forward_context``: autocast for ``"bf16-mixed"``/``"16-mixed"``, the module cast for
        ``"bf16-true"``/``"16-true"``); ``None`` is fp32 (``"32-true"``). Accepted: Lightning's ``Precision``,
        ``HalfPrecision`` and ``MixedPrecision`` (its ``GradScaler`` is dropped: gaengine scales fp16 losses
        itself, dynamically). Any other plugin raises ``ValueError`` naming it.

    In ``on_before_optimizer_step`` (the module's and the callbacks') and ``configure_gradient_clipping``, the
    parameters' ``.grad`` hold the window's gradient, normalized and before clipping, as under plain Lightning
    (``lightning.pytorch.utilities.grad_norm(self)`` works): for fp32 parameters views of gaengine's fp32
    ``main_grad``, normalized in place (one pass over the buffer, no memory); for bf16/fp16 ones a copy rounded to
    their dtype (2 B/parameter while the hooks run). Only when a hook of those names is overridden; released when
    they return (``GradientAccumulator.step(before_update=...)``). A hook that changes them (a clamp in
    ``configure_gradient_clipping``) changes the update, as in plain Lightning; the clip's norm is then the changed
    gradient's.

    After every applied window, ``last_result`` holds gaengine's ``StepResult`` (``grad_norm``, ``clip_coef``,
    ``skipped``, ``loss``; 0-d tensors on the device). A window with a non-finite gradient (or, under
    ``"16-mixed"``, one that overflowed the loss scale) is skipped on the device: parameters, optimizer state and
    the rest unchanged; ``update_was_skipped`` says so for the last update and ``num_skipped`` counts them (each
    read from the device once per update, when first asked), and ``GaengineStrategy`` then holds the step-interval
    schedulers.
    """

    composable = (Precision, HalfPrecision, MixedPrecision)
    double = DoublePrecision

    def __init__(self, inner: Precision | None = None) -> None:
        super().__init__(inner)
        self._clip_val: float | None = None
        self._pending_state: dict | None = None

    def _acc(self) -> GradientAccumulator:
        if self.accumulator is None:
            raise RuntimeError("GaenginePrecision has no accumulator: use it through strategy=GaengineStrategy(), which "
                               "builds one over the LightningModule and its optimizer")
        return self.accumulator

    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``acc.backward(tensor * K)``: Lightning's closure loss is the micro-batch loss divided by
        ``accumulate_grad_batches`` (K); gaengine takes the micro-batch mean and normalizes the window itself.
        At a window's first micro-batch, K is read from the Trainer (``GradientAccumulationScheduler``), and a
        window left open by an epoch cut short is dropped with a warning (plain Lightning zeroes it there too).
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
        acc = self._acc()
        trainer = model.trainer
        k = trainer.accumulate_grad_batches
        if acc.num_micro_batches and trainer.fit_loop.epoch_loop.batch_idx % k == 0:
            # A window left open by an epoch cut short (on_train_batch_start returned -1): plain Lightning zeroes
            # those gradients at the next window's start; so does gaengine.
            warnings.warn(f"dropping an unfinished accumulation window of {acc.num_micro_batches} micro-batch(es) "
                          "left by the previous epoch (it ended without its last batch), as Lightning's zero_grad "
                          "does", UserWarning, stacklevel=2)
            acc.zero_grad()
        if acc.num_micro_batches == 0 and acc.accumulation_steps != k:
            acc.accumulation_steps = k  # GradientAccumulationScheduler: K per epoch
        acc.backward(tensor * k if k != 1 else tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """One update, where Lightning steps (a window's last micro-batch, the epoch's last batch): the closure
        (``training_step``, backward), then ``acc.step(force=True)`` with ``on_before_optimizer_step`` and
        ``configure_gradient_clipping`` run on the window's gradient, then the clip and the update.

        Raises ``RuntimeError`` under manual optimization (``optimizer.step()``: call ``acc.step()``) and
        ``ValueError`` for keyword arguments to ``optimizer.step`` (gaengine runs the optimizer itself)."""
        if not model.automatic_optimization:
            raise RuntimeError(
                "optimizer.step() under GaengineStrategy with manual optimization: call self.acc.step(force=...) on "
                f"your GradientAccumulator instead (it runs the optimizer at the window's end); {_MANUAL_RECIPE}")
        if kwargs:
            raise ValueError(f"optimizer.step() got keyword arguments {sorted(kwargs)} that gaengine cannot pass on: "
                             "acc.step() runs the optimizer itself; remove them from LightningModule.optimizer_step")
        acc = self._acc()
        closure_result = closure()

        def before_update() -> None:  # Lightning's _after_closure: on_before_optimizer_step, then the clip's hook
            self._clip_val = None
            self._after_closure(model, optimizer)
            acc.max_grad_norm = self._clip_val

        if _hook_overridden(model.trainer, model, "on_before_optimizer_step") or is_overridden(
                "configure_gradient_clipping", model):
            result = acc.step(force=True, before_update=before_update)  # .grad: the window's gradient, in the hooks
        else:
            before_update()  # nobody reads .grad there: no pass over the buffer
            result = acc.step(force=True)
        self._record(result)
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
    in ``setup`` (after the module is converted and moved, and the optimizer built), as ``.accumulator``, and closes
    it when ``fit`` ends (``teardown``, errors included): the model then trains with plain PyTorch or under another
    Trainer, and the closed accumulator stays readable (``state_dict()`` for ``trainer.save_checkpoint``, its
    counters) until the next fit. ``test``, ``validate`` and ``predict`` need no accumulator. Manual optimization
    (``automatic_optimization = False``): the strategy only launches the ranks and leaves the model unwrapped; you
    build and drive the accumulator (examples/lightning_manual_example.py).

    Lightning's loop decides the windows (``handles_gradient_accumulation`` is False, as for ``DDPStrategy``):
    every hook runs as often as under plain Lightning, and ``trainer.global_step`` counts every applied update, the
    partial last window's included.

    A skipped update (non-finite window gradient, fp16 overflow) holds the step-interval schedulers (the module's
    ``lr_scheduler_step`` hook is routed through ``GaenginePrecision.update_was_skipped`` while fitting), as the
    Accelerate and Hugging Face integrations do; ``global_step`` still counts it.
    """

    strategy_name = "gaengine"

    def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", **accumulator_options: Any) -> None:
        check_strategy_options("GaengineStrategy", accumulator_options, _TRAINER_OWNS)
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
        """The ``GradientAccumulator`` of the current or last fit (automatic optimization; closed once the fit
        ended), else None."""
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

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's set-up (module converted and moved, optimizer built), then, when fitting, the accumulator over
        them (an earlier fit's, still open after an error, is closed first). ``test``/``validate``/``predict`` on one
        process: the module converted and moved, nothing else (no process group, nothing to synchronize)."""
        if trainer.state.fn != TrainerFn.FITTING and self.world_size == 1:
            self.accelerator.setup(trainer)
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self.setup_precision_plugin()
        else:
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
        if len(self.optimizers) != 1:  # Lightning's own rule for automatic optimization (several: manual only)
            raise ValueError(f"GaengineStrategy needs exactly one optimizer from configure_optimizers, got "
                             f"{len(self.optimizers)}: return gaengine.optimizer_list.OptimizerList([opt_a, opt_b]) "
                             "(one optimizer that steps each of them once per update, docs/optimizers.md), or use "
                             f"manual optimization with GradientAccumulator(self, [opt_a, opt_b]); {_MANUAL_RECIPE}")
        precision = self.precision_plugin
        precision.close()  # an earlier fit's, if still open: its hooks leave the parameters
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
        """End of every ``fit``/``test``/``validate``/``predict`` (an error's included): the module's own
        ``lr_scheduler_step`` back, the accumulator closed (``GaenginePrecision.close``), then Lightning's."""
        self._restore_scheduler_hook()
        self.precision_plugin.close()  # before Lightning moves the module to the CPU
        super().teardown()

    def on_train_start(self) -> None:
        super().on_train_start()
        self.precision_plugin.apply_pending_state()  # after Lightning restored the optimizer

