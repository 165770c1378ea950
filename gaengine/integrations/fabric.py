"""gaengine inside Lightning Fabric: a ``Strategy`` and a ``Precision`` plugin (``pip install gaengine[lightning]``).

Switching is one line, the strategy, in the loop Fabric's docs write::

    fabric = lightning.Fabric(strategy=GaengineStrategy(accumulation_steps=8), precision="bf16-mixed")
    model, optimizer = fabric.setup(model, optimizer)
    for i, batch in enumerate(loader):
        is_accumulating = (i + 1) % 8 != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            fabric.backward(model(batch) / 8)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()

``fabric.setup`` (``setup_module_and_optimizers``) builds one ``gaengine.GradientAccumulator`` over the converted,
moved module and its one optimizer, the model never wrapped in DDP (gaengine all-reduces the window's gradient
itself, in its K-th micro-batch, or at ``optimizer.step()`` for a shorter window). ``fabric.backward(loss)`` is
``acc.backward(loss, num_items=...)`` with one item per window, so the window's gradient is the sum of the gradients
of the losses the loop passed (averaged over the ranks), exactly plain Fabric's ``.grad`` whatever the loop does:
``loss / K`` or Fabric's docs' unscaled sum, a partial last window, a loop whose windows are shorter than the
strategy's K, a mid-window ``optimizer.zero_grad()`` (which drops the window, as plain Fabric's drops the
``.grad``). A loop window longer than K is refused at its K+1-th backward (inside ``no_backward_sync(enabled=True)``
on several processes: at its K-th), naming ``accumulation_steps``, nothing accumulated by it. ``fabric.clip_gradients
(..., max_norm=c)`` sets the window's clip; ``optimizer.step()`` is ``acc.step(force=True)``: clip, update, in fp32.

This module also holds what the Trainer's plugin (``gaengine.integrations.lightning``) shares with Fabric's:
``InnerPrecision`` (the dtype parts of Lightning's plugin, the skipped updates) and ``check_strategy_options``.
Lightning imports only here and there (``import gaengine`` never imports it). docs/integrations/fabric.md has the
switch, what changes in the numbers and what is refused.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch
from torch import Tensor

try:
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
    from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("gaengine.integrations.fabric needs Lightning (the `lightning` package 2.6.x): "
                      "pip install 'gaengine[lightning]'") from exc

from gaengine import AccumulatorConfig, GradientAccumulator, StepResult

__all__ = ["GaenginePrecision", "GaengineStrategy"]

# GradientAccumulator's arguments that Fabric's loop sets: refused as strategy options.
_FABRIC_OWNS = {
    "max_grad_norm": "fabric.clip_gradients(model, optimizer, max_norm=...) before optimizer.step()",
    "lr_scheduler": "your loop (scheduler.step() after optimizer.step(), as in plain Fabric)",
    "process_group": "Fabric's launch (every rank of the Fabric's world takes part)",
    "model": "fabric.setup(model, optimizer)",
    "optimizer": "fabric.setup(model, optimizer)",
}


def check_strategy_options(strategy: str, options: dict[str, Any], owned: dict[str, str]) -> None:
    """``ValueError`` for an option of ``owned`` (naming what sets it instead: ``owned[name]``) or a ``zero_stage``
    other than 0 (a sharded accumulator's state goes through ``torch.distributed.checkpoint``, which Lightning's
    checkpoints do not use); then ``gaengine.AccumulatorConfig``'s checks of the rest (``TypeError``/``ValueError``
    naming the field). ``strategy`` names the strategy in the messages."""
    for name, owner in owned.items():
        if name in options:
            raise ValueError(f"{strategy}({name}=...): set it through {owner}, not the strategy")
    if options.get("zero_stage", 0) != 0:
        raise ValueError(
            f"{strategy}(zero_stage={options['zero_stage']!r}): only zero_stage=0 is supported inside Lightning (a "
            "sharded accumulator's state dict is saved with torch.distributed.checkpoint, which Lightning's "
            "checkpoints do not use); drop zero_stage, or drive gaengine yourself")
    config = {"accumulation_steps": 1, "max_grad_norm": None, **options}
    AccumulatorConfig(**config)


class InnerPrecision:
    """What gaengine's Lightning precision plugins (the Trainer's and Fabric's) share: the plugin that
    ``precision=...`` made (``inner``), kept for dtypes only (``convert_module``, ``convert_input``,
    ``forward_context``: autocast for ``"bf16-mixed"``/``"16-mixed"``, the module cast for ``"bf16-true"``/
    ``"16-true"``), the accumulator it routes backward and update through, and the skipped updates.

    A subclass sets ``composable`` (the plugin classes it accepts as ``inner``: fp32, half and mixed) and
    ``double`` (its 64-bit plugin, named in the refusal) and lists this class before Lightning's ``Precision``.
    ``inner`` None is fp32; any other plugin raises ``ValueError`` naming it; a ``MixedPrecision``'s
    ``GradScaler`` is dropped (gaengine scales fp16 losses itself, dynamically).
    """

    composable: tuple[type, ...] = ()
    double: type | None = None

    def __init__(self, inner: Any = None) -> None:
        super().__init__()
        if inner is None:
            inner = self.composable[0]()
        if isinstance(inner, InnerPrecision):
            inner = inner.inner
        if type(inner) not in self.composable:
            raise ValueError(
                f"gaengine cannot compose with the precision plugin {type(inner).__name__} "
                f"(precision={getattr(inner, 'precision', '?')!r}): gaengine owns the backward, the fp32 gradient sum, "
                "the loss scale and the update, which that plugin also wants to own. Use precision= "
                "'32-true', 'bf16-true', '16-true', 'bf16-mixed' or '16-mixed'"
                + (" (gaengine keeps fp32 master weights and fp32 gradient sums itself; 64-bit parameters are not "
                   "supported)" if self.double is not None and isinstance(inner, self.double) else ""))
        if getattr(inner, "scaler", None) is not None:
            inner.scaler = None  # gaengine's own dynamic loss scale replaces torch.amp.GradScaler
        self.inner = inner
        self.precision = inner.precision
        self.accumulator: GradientAccumulator | None = None
        self.last_result: StepResult | None = None
        self._closed = True  # no open accumulator
        self._skipped: bool | None = None  # host copy of last_result.skipped, read on first access
        self._num_skipped = 0

    # ------------------------------------------------------------------ skipped updates
    def _settle(self) -> None:
        if self._skipped is None and self.last_result is not None:
            self._skipped = bool(self.last_result.skipped)  # host read: once per update, after its step
            self._num_skipped += self._skipped

    def _record(self, result: StepResult | None) -> None:
        """Keep ``result`` (an applied window's, or None when nothing was stepped) as ``last_result``."""
        if result is not None:
            self._settle()  # the previous update's flag into num_skipped (computed long ago: no wait)
            self.last_result, self._skipped = result, None

    @property
    def update_was_skipped(self) -> bool:
        """Whether the last update was skipped for a non-finite window gradient (False before the first)."""
        self._settle()
        return bool(self._skipped)

    @property
    def num_skipped(self) -> int:
        """Updates skipped so far (non-finite window gradients), over every run with this plugin."""
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
        """Route backward/step/clip through ``accumulator`` (called by the strategy's set-up)."""
        self.accumulator = accumulator
        self._closed = False

    def close(self) -> None:
        """Close the accumulator (its hooks leave the parameters, which plain PyTorch or another accumulator may
        then train); it stays readable as ``accumulator`` (``state_dict()``, counters)."""
        if self.accumulator is not None and not self._closed:
            self.accumulator.close()
        self._closed = True

    def teardown(self) -> None:
        self.close()
        self.inner.teardown()


class GaenginePrecision(InnerPrecision, Precision):
    """Fabric ``Precision`` plugin whose ``backward``, ``optimizer_step`` and clipping go through a
    ``gaengine.GradientAccumulator`` (built and attached by ``GaengineStrategy``'s set-up; used alone it raises).

    inner: the plugin that ``Fabric(precision=...)`` made: Fabric's ``Precision`` (``"32-true"``, also for None),
        ``HalfPrecision`` (``"bf16-true"``, ``"16-true"``) or ``MixedPrecision`` (``"bf16-mixed"``, ``"16-mixed"``:
        its ``GradScaler`` dropped); any other plugin (``"64-true"``, bitsandbytes, transformer-engine) raises
        ``ValueError`` naming it.

    After every ``optimizer.step()``, ``last_result`` holds gaengine's ``StepResult`` (``grad_norm``,
    ``clip_coef``, ``skipped``, ``loss``: 0-d tensors on the device); a window with a non-finite gradient (or an
    fp16 overflow) is skipped on the device, ``update_was_skipped``/``num_skipped`` say so.
    """

    composable = (Precision, HalfPrecision, MixedPrecision)
    double = DoublePrecision

    def __init__(self, inner: Precision | None = None) -> None:
        super().__init__(inner)
        self.accumulation_steps = 1
        self._clip: tuple[float, bool, Tensor] | None = None  # this window's clip_gradients: max_norm, raise, norm
        self._no_sync: bool | None = None  # inside fabric.no_backward_sync: its `enabled`
        self._no_items: Tensor | None = None  # 0-d fp64 zero on the device: num_items of a window's later micro-batches
        self._kept_class: tuple[torch.optim.Optimizer, type] | None = None  # keep_optimizer_class: (optimizer, class)

    def _acc(self) -> GradientAccumulator:
        if self.accumulator is None:
            raise RuntimeError(
                "GaengineStrategy has no accumulator: set up the model and its optimizer with "
                "fabric.setup(model, optimizer) (or fabric.setup_module(model), then fabric.setup_optimizers(optimizer)) "
                "before fabric.backward / optimizer.step; a model set up without an optimizer only evaluates")
        return self.accumulator

    @contextmanager
    def no_sync(self, enabled: bool) -> Iterator[None]:
        """``fabric.no_backward_sync(model, enabled)``: the backwards inside are ``enabled`` (accumulating: not a
        window's last) or not (the window's last), which ``backward`` checks against K."""
        self._no_sync = bool(enabled)
        try:
            yield
        finally:
            self._no_sync = None

    def backward(self, tensor: Tensor, model: torch.nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward(loss)``: ``acc.backward(loss, num_items=...)`` in gaengine's item mode with one item
        per window (1 for the window's first micro-batch, 0 for the others), so the window's gradient is the sum of
        the gradients of the losses the loop passed, as plain Fabric's ``.grad`` is (averaged over the ranks, as
        DDP's), however many micro-batches the loop put in it: a loop window of K (``loss / K``), a shorter one (the
        epoch's last, or a loop whose K is smaller than the strategy's), or one after a mid-window
        ``optimizer.zero_grad()``. ``args``: ``torch.Tensor.backward``'s (``gradient``, ``retain_graph``, ...).

        Raises ``ValueError``, nothing accumulated and the window kept, when the window already holds K micro-batches
        (K: ``GaengineStrategy(accumulation_steps=K)``), or inside ``fabric.no_backward_sync(model, enabled=True)``
        when this backward would be the window's K-th: the loop accumulates more micro-batches than K."""
        acc = self._acc()
        self.restore_optimizer_class()
        k, n = self.accumulation_steps, acc.num_micro_batches
        if n >= k or (self._no_sync and n + 1 >= k):
            where = (f"inside fabric.no_backward_sync(model, enabled=True) at the window's micro-batch {n + 1}"
                     if n < k else f"with {n} micro-batches in the window and no optimizer.step() since")
            raise ValueError(
                f"fabric.backward {where}, but GaengineStrategy(accumulation_steps={k}): the loop accumulates more "
                f"micro-batches than the strategy's K. Give the strategy your loop's K (the fabric.backward calls "
                f"between two optimizer.step() calls; a larger K is fine); nothing was accumulated by this call and "
                f"the window's {n} micro-batch(es) are kept (optimizer.step() applies them)")
        for name, value in zip(("gradient", "retain_graph", "create_graph", "inputs"), args):
            kwargs[name] = value
        if n == 0:
            acc.backward(tensor, num_items=1, **kwargs)
            return
        if self._no_items is None or self._no_items.device != acc.device:
            self._no_items = torch.zeros((), dtype=torch.float64, device=acc.device)
        acc.backward(tensor, num_items=self._no_items, **kwargs)

    def drop_window(self) -> None:
        """``optimizer.zero_grad()`` (Fabric's wrapper, or the optimizer set up): in the middle of a window it drops
        the window (``acc.zero_grad()``), as plain Fabric's drops the ``.grad`` accumulated so far; between windows
        (after ``optimizer.step()``) nothing is held and nothing changes."""
        acc = self.accumulator
        if acc is not None and not self._closed and acc.num_micro_batches:
            acc.zero_grad()

    def keep_optimizer_class(self, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` (set up, its accumulator built) the class ``_DroppingZeroGrad(type(optimizer))`` until
        Fabric has wrapped it: Fabric's wrapper subclasses the optimizer's class at that moment, so its
        ``zero_grad()`` then reaches ``drop_window``. The optimizer gets its own class back at the next call into
        the strategy (``restore_optimizer_class``: every gaengine type check sees the user's class)."""
        self._kept_class = (optimizer, type(optimizer))
        optimizer.__class__ = _dropping_zero_grad(type(optimizer))

    def restore_optimizer_class(self) -> None:
        """Undo ``keep_optimizer_class`` (idempotent)."""
        if self._kept_class is not None:
            optimizer, cls = self._kept_class
            optimizer.__class__ = cls
            self._kept_class = None

    def clip_gradients_norm(self, optimizer: Any, max_norm: float, norm_type: float,
                            error_if_nonfinite: bool) -> Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)``: the window's L2 clipping threshold, applied by
        the next ``optimizer.step()`` to the normalized fp32 window gradient. Returns a 0-d fp32 tensor on the
        device that the step fills with the window's gradient norm before clipping (NaN until then). Raises
        ``ValueError`` (nothing changed) for ``norm_type`` other than 2 or ``max_norm <= 0``."""
        self._check_optimizer(optimizer)
        if float(norm_type) != 2.0:
            raise ValueError(f"fabric.clip_gradients(norm_type={norm_type!r}): GaengineStrategy clips by the L2 norm of "
                             "the window's normalized gradient only (one coefficient folded into the update); use "
                             "norm_type=2")
        if not max_norm > 0:
            raise ValueError(f"fabric.clip_gradients(max_norm={max_norm!r}): expected a positive float (the window "
                             "gradient's largest L2 norm)")
        acc = self._acc()
        norm = torch.full((), float("nan"), dtype=torch.float32, device=acc.device)
        self._clip = (float(max_norm), bool(error_if_nonfinite), norm)
        return norm

    def _check_optimizer(self, optimizer: Any) -> None:
        acc = self._acc()
        self.restore_optimizer_class()
        if optimizer is not acc.optimizer:
            raise ValueError(f"optimizer {type(optimizer).__name__} is not the one set up with this model "
                             "(fabric.setup(model, optimizer)): GaengineStrategy drives one optimizer")

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> None:
        """``optimizer.step()``: ``acc.step(force=True)``, the window (full or partial) normalized by the
        micro-batches it holds, clipped by ``clip_gradients``' ``max_norm``, applied in fp32. Raises
        ``ValueError`` (the window kept) for a closure or other arguments to ``step``; with
        ``clip_gradients(..., error_if_nonfinite=True)`` (Fabric's default), ``RuntimeError`` after a window whose
        gradient norm was not finite (its update skipped: parameters and optimizer state unchanged), as torch's
        ``clip_grad_norm_`` raises there."""
        self._check_optimizer(optimizer)
        if kwargs:
            raise ValueError(
                f"optimizer.step() got {sorted(kwargs)}: GaengineStrategy runs the optimizer once per window on the "
                "accumulated gradient (a closure optimizer such as LBFGS re-evaluates the loss, which a window of "
                "micro-batches cannot do); call optimizer.step() with no argument")
        acc = self._acc()
        clip, self._clip = self._clip, None
        acc.max_grad_norm = None if clip is None else clip[0]
        result = acc.step(force=True)
        acc.max_grad_norm = None
        self._record(result)
        if result is not None and clip is not None:
            clip[2].copy_(result.grad_norm)
            if clip[1] and self.update_was_skipped:
                raise RuntimeError(
                    f"The total norm of order 2.0 for gradients from `parameters` is non-finite "
                    f"({float(result.grad_norm)}), so it cannot be clipped (fabric.clip_gradients(..., "
                    "error_if_nonfinite=True)). gaengine skipped this update: parameters and optimizer state are "
                    "unchanged and the window is dropped; pass error_if_nonfinite=False to go on past such windows")


class _GaengineSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: gaengine reduces in the window's last micro-batch anyway; the flag lets the
    precision check the loop's windows against K."""

    def __init__(self, strategy: GaengineStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool):
        return self.strategy.precision.no_sync(enabled)


class GaengineStrategy(DDPStrategy):
    """Lightning Fabric ``Strategy`` that accumulates, clips and updates through ``gaengine.GradientAccumulator``.

    ``lightning.Fabric(strategy=GaengineStrategy(accumulation_steps=K), precision=...)``: one process
    (``devices=1``) or the DDP-style launch on several (``devices=N``, ``num_nodes``, or processes started by
    ``torchrun``), the model never wrapped in DDP (gaengine reduces). ``Fabric(precision=...)`` gives the dtypes
    (``GaenginePrecision``).

    Args:
        accumulation_steps: K, the micro-batches per window of your loop (an int >= 1): the ``fabric.backward``
            calls between two ``optimizer.step()`` calls, whose multiple ends ``no_backward_sync``. The window's
            all-reduce overlaps its K-th backward; a shorter loop window trains the same (reduced at
            ``optimizer.step()``), a longer one is refused (``ValueError`` at its K+1-th backward).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend,
            timeout, start_method: as Fabric's ``DDPStrategy`` (which this subclasses for its launch and process
            group).
        **accumulator_options: keywords of ``gaengine.GradientAccumulator`` (the fields of
            ``gaengine.AccumulatorConfig``, checked here), e.g. ``backend``, ``master_weights``, ``bucket_size_mb``,
            ``reduce_dtype``, ``loss_scale``. Refused with ``ValueError`` naming what sets them instead:
            ``max_grad_norm`` (``fabric.clip_gradients``), ``lr_scheduler``, ``process_group``, and ``zero_stage``
            other than 0.

    ``fabric.setup(model, optimizer)`` builds the accumulator (``.accumulator``) over the converted, moved module
    and its one optimizer (``ValueError`` for several); ``fabric.setup_module(model)`` alone leaves the model
    unwrapped for evaluation, and a later ``fabric.setup_optimizers(optimizer)`` builds it. It is closed at the
    strategy's ``teardown``; ``close()`` closes it sooner (the model then trains under plain PyTorch again).
    Checkpoints: put the accumulator in Fabric's state, after the optimizer:
    ``fabric.save(path, {"model": model, "optimizer": optimizer, "gaengine": fabric.strategy.accumulator})``.
    """

    strategy_name = "gaengine"

    def __init__(self, accumulation_steps: int, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen",
                 **accumulator_options: Any) -> None:
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"GaengineStrategy(accumulation_steps={accumulation_steps!r}): expected an int >= 1, the "
                             "micro-batches per window of your loop (the K your loss is divided by)")
        check_strategy_options("GaengineStrategy", accumulator_options, _FABRIC_OWNS)
        self.accumulation_steps = accumulation_steps
        self.accumulator_options = dict(accumulator_options)
        self._module: torch.nn.Module | None = None
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._backward_sync_control = _GaengineSyncControl(self)

    # ------------------------------------------------------------------ precision: always gaengine's
    @property
    def precision(self) -> GaenginePrecision:
        if self._precision is None:
            self._precision = GaenginePrecision()
            self._precision.accumulation_steps = self.accumulation_steps
        return self._precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        if plugin is None:
            self._precision = None
            return
        self._precision = GaenginePrecision(plugin)
        self._precision.accumulation_steps = getattr(self, "accumulation_steps", 1)

    @property
    def accumulator(self) -> GradientAccumulator | None:
        """The ``GradientAccumulator`` that ``fabric.setup`` built (closed after ``teardown``/``close``), or None."""
        return self.precision.accumulator

    # ------------------------------------------------------------------ launch; no DDP wrap
    def _configure_launcher(self) -> None:
        """Fabric's launcher; on one process (known once Fabric set the devices) the strategy also counts as a
        ``SingleDeviceStrategy``, for which Fabric asks no ``fabric.launch()`` (and makes ``no_backward_sync`` a
        no-op) as for its own one-device strategy. Every method stays this class's."""
        super()._configure_launcher()
        if self.num_nodes * self.num_processes == 1 and not isinstance(self, SingleDeviceStrategy):
            self.__class__ = _one_device(type(self))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Several processes: DDP's (``fabric.setup_dataloaders`` gives each rank a ``DistributedSampler``). One
        process: None, so your sampler is kept, as under Fabric's one-device strategy (a ``DistributedSampler`` of
        one replica would reshuffle with its own seed: another data order than plain Fabric's)."""
        if self.num_nodes * self.num_processes == 1:
            return None
        return super().distributed_sampler_kwargs

    def setup_environment(self) -> None:
        """Several processes: Fabric's DDP set-up (ranks, process group). One process: no process group (an
        initialized one of size 1 would outlive the Fabric and stand in the way of the next
        ``init_process_group``)."""
        if self.num_nodes * self.num_processes > 1:
            super().setup_environment()
            return
        self._set_world_ranks()
        self.accelerator.setup_device(self.root_device)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module as it is (no DDP: gaengine all-reduces the window's gradient itself), kept for a later
        ``setup_optimizer``."""
        self._module = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Build the accumulator over the module set up last and ``optimizer`` (``ValueError`` with no module set
        up, or when one was already built: one model, one optimizer per strategy)."""
        if self._module is None:
            raise ValueError("fabric.setup_optimizers(optimizer) before any model: GaengineStrategy builds its "
                             "accumulator over the model and its optimizer; call fabric.setup(model, optimizer)")
        precision = self.precision
        if precision.accumulator is not None and not precision._closed:
            raise ValueError("GaengineStrategy already accumulates for a model and optimizer set up earlier: one "
                             "model and one optimizer per Fabric (use a Fabric per model)")
        acc = GradientAccumulator(self._module, optimizer, accumulation_steps=self.accumulation_steps,
                                  max_grad_norm=None, **{"loss_scale": precision.loss_scale, **self.accumulator_options})
        precision.attach(acc)
        precision.keep_optimizer_class(optimizer)  # Fabric's wrapper, built next, takes its zero_grad
        return optimizer

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: the module unwrapped and the accumulator over it and its one
        optimizer (``ValueError`` for several)."""
        if len(optimizers) != 1:
            raise ValueError(f"GaengineStrategy needs exactly one optimizer per model, got {len(optimizers)}: "
                             "fabric.setup(model, optimizer)")
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizers[0])], scheduler

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)``: ``GaenginePrecision.clip_gradients_norm``."""
        return self.precision.clip_gradients_norm(optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             clip_val: float | int) -> None:
        """``fabric.clip_gradients(..., clip_val=...)``: ``ValueError`` (gaengine clips by the norm only)."""
        raise ValueError(f"fabric.clip_gradients(clip_val={clip_val!r}): GaengineStrategy clips by the L2 norm of the "
                         "window's normalized gradient only (one coefficient folded into the update); use "
                         "fabric.clip_gradients(model, optimizer, max_norm=...)")

    def close(self) -> None:
        """Close the accumulator now (its hooks leave the parameters); it stays readable as ``accumulator``."""
        self.precision.restore_optimizer_class()
        self.precision.close()

    def get_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` through Fabric's wrapper (``fabric.save``), the optimizer's own class back first."""
        self.precision.restore_optimizer_class()
        return super().get_optimizer_state(optimizer)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """``fabric.save``: Fabric's, the optimizer's own class back first (the accumulator's state names it)."""
        self.precision.restore_optimizer_class()
        return super().save_checkpoint(*args, **kwargs)

    def teardown(self) -> None:
        self.close()
        super().teardown()


@functools.cache
def _dropping_zero_grad(cls: type) -> type:
    """``cls`` (an optimizer class) whose ``zero_grad`` first calls the Fabric strategy's ``drop_window`` when it
    is called on Fabric's wrapper (which holds the strategy as ``_strategy``), then ``cls``'s own. Named as ``cls``
    (its module and qualified name too), so Fabric's wrapper class is named as before."""

    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = self.__dict__.get("_strategy")
        if isinstance(strategy, GaengineStrategy):
            strategy.precision.drop_window()
        return cls.zero_grad(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"zero_grad": zero_grad, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


@functools.cache
def _one_device(cls: type) -> type:
    """``cls`` that Fabric also takes for a ``SingleDeviceStrategy`` (no ``launch()`` needed); ``cls``'s methods
    first in the MRO."""
    return type(cls.__name__, (cls, SingleDeviceStrategy), {"__module__": cls.__module__, "__doc__": cls.__doc__})
