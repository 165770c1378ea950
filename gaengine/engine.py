"""``GradientAccumulator``: fp32 flat-buffer gradient accumulation, late normalization, clipping, update.

This module is the pipeline's driver: it runs one accumulation window of K micro-batches (docs/design.md has the
data flow) and calls each stage, which owns its work and its state. ``backward()`` runs autograd while the hooks add
each bucket of gradients into the fp32 ``main_grad`` (``gaengine.hooks``, ``gaengine.bucket``); ``step()`` applies
the window's one denominator (micro-batches, or items with ``num_items=``) folded into the clip coefficient
(``gaengine.lending``, ``gaengine.norm``), then updates (``gaengine.store``). The stages are built at construction
(``gaengine.construction``): the window's checks, stats and end are ``gaengine.window_end.WindowEnd``'s (it owns the
loss scale), parameters joining or leaving ``gaengine.membership.MembershipStage``'s, what differs between modes
(replicated, ZeRO-1/2, FSDP2) the sharding strategy's (``gaengine.sharding``), K ``gaengine.schedules``'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from gaengine import ownership
from gaengine.backends import get_backend
from gaengine.clip import guard_torch_clip_grad_norm
from gaengine.config import AccumulatorConfig, CheckedSetting, check_max_grad_norm, check_optional_count
from gaengine.construction import init_window, join_ranks, release
from gaengine.fusion import LinearFusion, check_fusion
from gaengine.membership import MembershipStage
from gaengine.optimizer_list import check_coverage, combine as combine_optimizers
from gaengine.reduce import wait_quietly
from gaengine.scaler import check_min_loss_scale, guard_grad_scaler
from gaengine.schedules import AccumulationSchedule
from gaengine.sharding import ShardingStrategy, make_sharding, trainable_params
from gaengine.stages import AccumulatorParts, StageStates, WindowStages
from gaengine.update import SchedulerWatch
from gaengine.window import StepResult, foreign_gradient_error, warn_dropped_window
from gaengine.window_end import StepSettings, WindowEnd

__all__ = ["GradientAccumulator", "StepResult"]


class GradientAccumulator:
    """Accumulate gradients of ``model`` over ``accumulation_steps`` micro-batches in fp32, then update.

    Args:
        model: an ``nn.Module`` or an iterable of Parameters, all on one device, fp32 | bf16 | fp16.
            Parameters with ``requires_grad=False`` are skipped. No DDP (or other gradient-reducing
            wrapper) anywhere in its module tree: ``TypeError`` naming its path. A ``.grad`` already
            on a parameter (a ``loss.backward()`` before construction) is dropped with one ``UserWarning`` naming
            how many: a window holds only its own micro-batches (Megatron-Core and torch DDP start from zeroed
            gradients too).
        optimizer: a ``torch.optim.Optimizer`` built over (a subset of) the model's parameters, frozen ones
            included (``requires_grad=False``: never given a gradient, so the optimizer skips them), or None
            (then ``step()`` leaves the final, normalized and clipped gradients in ``.grad``). For bf16/fp16
            parameters it is re-pointed at fp32 master weights (param groups and hyper-parameters kept), and those
            parameters (the same ``Parameter`` objects, ``p.data`` re-pointed) become views of one flat buffer per
            dtype that receives the rounded masters after every update: what that means for ``model.state_dict()``,
            ``model.load_state_dict`` after construction, ``copy.deepcopy`` and ``torch.compile`` is in
            docs/accumulator.md. Build the accumulator last: a model moved or converted afterwards (``.to()`` to
            another device or dtype, ``.float()``) makes ``backward()``/``step()`` raise ``RuntimeError``.
            Or a list or tuple of optimizers (``torch.optim.Muon`` beside ``torch.optim.AdamW``, as torch documents
            Muon), each trainable parameter in exactly one (``ValueError`` naming it otherwise): one window's norm,
            clip coefficient and skip decision, then each steps once, in order; ``acc.optimizer`` is then their
            ``gaengine.optimizer_list.OptimizerList`` (``.optimizers``: yours). docs/optimizers.md.
        lr_scheduler: stepped once after every applied (not skipped) update; with a list of optimizers, None or a
            list of as many schedulers (None entries allowed), each built over the optimizer at its index.
        process_group: reduce gradients across the ranks of this group; by default the global group when
            ``torch.distributed`` is initialized with more than one rank. Parameters (and, with
            ``broadcast_buffers``, buffers) are broadcast from the group's first rank at construction.
        **options: the accumulator's options, the fields of ``gaengine.AccumulatorConfig`` (``gaengine/config.py``),
            whose docstrings are their reference (units, default and its source, what raises): ``accumulation_steps``
            (K micro-batches per update, an int or a schedule), ``max_grad_norm``, ``backend``, ``master_weights``,
            ``bucket_size_mb``, ``reduce_dtype``, ``broadcast_buffers``, ``loss_scale``, ``min_loss_scale``,
            ``batchnorm``, ``max_consecutive_skips``, ``micro_batch_size``, ``measure_noise_scale``,
            ``noise_scale_ema``, ``zero_stage``, ``overlap_param_gather``, ``overlap_grad_reduce``,
            ``gradient_accumulation_fusion``. They are checked
            once, before anything touches the model, and kept as ``acc.config`` (frozen: what was asked at
            construction); ``acc.accumulation_steps`` (K of the current window), ``acc.max_grad_norm`` (the clip
            threshold the next ``step()`` uses, None: no clipping; the trainer integrations set it) and
            ``acc.micro_batch_size`` start from it and are the accumulator's own to change.

    Multi-rank: replicated and ``zero_stage=1`` communicate only in a window's last micro-batch (``zero_stage=2``
    and FSDP2 in every one), each bucket's reduction overlapping the rest of backward; the denominator is global,
    so every rank gets the exact global mean (docs/multi-rank.md). Raises ``ValueError`` / ``TypeError`` naming the
    argument for bad input, ``RuntimeError`` when a parameter already belongs to another live accumulator. A fused
    torch optimizer (``fused=True``) gets the normalization x clip coefficient and the skip flag as
    ``grad_scale``/``found_inf``: no extra pass, no host sync (docs/performance.md).
    """

    def __init__(self, model: nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                 accumulation_steps: int | AccumulationSchedule = 8, max_grad_norm: float | None = 1.0,
                 lr_scheduler: Any = None, backend: str = "auto", *, process_group: dist.ProcessGroup | None = None,
                 **options: Any) -> None:
        # Every option checked once, before anything touches the model (gaengine.config: ValueError naming it).
        self.config = config = AccumulatorConfig.from_options(
            accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm, backend=backend, **options)
        optimizer, lr_scheduler = combine_optimizers(optimizer, lr_scheduler, config.zero_stage)  # a list: one
        ownership.check_arguments(model, optimizer, config)
        module = model if isinstance(model, nn.Module) else None
        params = trainable_params(model)
        check_coverage(optimizer, params, module)  # a list: each trainable parameter in exactly one optimizer
        ownership.take(params, optimizer, module)  # another accumulator's parameters raise; a stale .grad is dropped
        # The parameters' names (checkpoint keys) and registration order: the reference frame of state_dict().
        self.named_params = list(module.named_parameters()) if module is not None else []
        self.registered_params = params
        self.device = params[0].device
        self.backend = get_backend(backend, self.device)
        if config.gradient_accumulation_fusion:
            check_fusion(model, self.backend, self.device)  # ValueError naming the option
        self.process_group = process_group
        self.world_size = join_ranks(config, process_group, self.named_params or [
            (f"param[{i}]", p) for i, p in enumerate(params)], self.backend)
        self.distributed = self.world_size > 1
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self._scheduler = SchedulerWatch(lr_scheduler)  # stepped outside step(): RuntimeError
        # The accumulator's own to change (the config keeps what was asked): the clip threshold, the samples per
        # micro-batch (gaengine train --auto-micro-batch halves it), the loss scale's floor.
        self.max_grad_norm, self.micro_batch_size = config.max_grad_norm, config.micro_batch_size
        self.min_loss_scale = config.min_loss_scale
        self.zero_stage, self.bucket_size_mb = config.zero_stage, config.bucket_size_mb  # zero_stage: as asked
        st = init_window(config, accumulation_steps, params, module, self.device, self.world_size, process_group,
                         self.backend)  # the window's stages (gaengine.stages.WindowStages)
        self.window, self.schedule, self._skips, self._noise = st.window, st.schedule, st.skips, st.noise
        self.window_batchnorm, self._lending = st.batchnorm, st.lending
        self._init_sharding(params, optimizer, module, st)
        ownership.claim(self.params, self)
        guard_torch_clip_grad_norm()  # a habit's clip_grad_norm_ over these parameters warns (their .grad is None)
        guard_grad_scaler()  # a habit's GradScaler-scaled loss is refused by backward()

    def _init_sharding(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                       module: nn.Module | None, stages: WindowStages) -> None:
        """The membership stage (``gaengine.membership``), one data-parallel sharding strategy (``gaengine.sharding``:
        the layout, ``main_grad``, the hooks, the reducer, the masters, the update), the fused Linear forwards
        (``gradient_accumulation_fusion``, until ``close()``: ``gaengine.fusion``), then the window stage over them."""
        config = self.config
        self._membership = MembershipStage.build(params, optimizer, module, self.world_size, self.process_group,
                                                 self.device)
        self.sharding: ShardingStrategy = make_sharding(
            config.zero_stage, self.world_size, params, optimizer, backend=self.backend, device=self.device,
            process_group=self.process_group, bucket_size_mb=config.bucket_size_mb, reduce_dtype=config.reduce_dtype,
            master_weights=config.master_weights, measure_sources=self._noise is not None, model=module,
            overlap_param_gather=config.overlap_param_gather, broadcast_buffers=config.broadcast_buffers,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        self._fusion = LinearFusion(module, self.backend.extension()[0].OP_NAMESPACE) if (
            config.gradient_accumulation_fusion) else None
        if self._fusion is not None:  # a layer whose weight or bias holds a user hook is not fused
            self._fusion.follow_hooks(self.sharding.accumulation, self.params)
        self._membership.watch(self.sharding, self.optimizer, self.device)  # the model moved, parameters replaced
        self._window_end = WindowEnd(stages, self.sharding, self._membership, self._scheduler, self._fusion,
                                     config.overlap_grad_reduce, self.device, self.world_size)

    # ------------------------------------------------------------------ the strategy's parts (gaengine.sharding)
    params = property(lambda self: self.sharding.params,
                      doc="The trainable parameters in layout order (index i: ``main_grad``'s slice i).")
    main_grad = property(lambda self: self.sharding.main_grad, doc=(
        "The window's fp32 gradient sums, ``(n,)`` on the parameters' device (``meta`` where they live in each "
        "rank's gradient shard: ``zero_stage=2`` on several ranks), a ``gaengine.buffer.FlatBuffer``."))
    reducer = property(lambda self: self.sharding.reducer,
                       doc="The bucket reducer (``gaengine.reduce``), or None on one rank.")
    hooks = property(lambda self: self.sharding.hooks, doc=(
        "The per-parameter hooks (``gaengine.hooks.Hooks``), for inspection (``launches``, ``native``); the "
        "accumulator itself reaches them only through the strategy's ``accumulation`` (``gaengine.accumulation``)."))
    master_buffer = property(lambda self: self.sharding.master_buffer, doc=(
        "This rank's flat fp32 master weights (``gaengine.store.ParameterStore.master_buffer``), or None."))
    scaler = property(lambda self: self._window_end.scaler, doc="The loss scale (``gaengine.scaler.LossScaler``) or "
                      "None: the window stage's (``loss_scale='auto'`` chooses it at the first ``backward()``).")

    _settings = property(lambda self: StepSettings(self.max_grad_norm, self.micro_batch_size, self.min_loss_scale,
                                                   self.optimizer, self.lr_scheduler, self.named_params))

    # ------------------------------------------------------------------ hot path
    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None, **backward_kwargs: Any) -> None:
        """Backward of one micro-batch, accumulating its gradients into the fp32 buffer.

        loss: 0-d (or one-element) floating tensor that requires grad: the micro-batch's mean loss (mean
            mode), or its sum over items when ``num_items`` is given (item mode).
        num_items: number of items (e.g. tokens whose label is not -100) the summed ``loss`` covers; an int
            >= 0 or a 0-d integer/float tensor on any device (kept on the device: no sync). Either every
            micro-batch of a window passes it or none does.
        backward_kwargs: passed to ``torch.Tensor.backward`` (e.g. ``retain_graph``).

        Raises ``ValueError`` for a bad ``loss`` (one scaled by ``torch.amp.GradScaler.scale`` too) or ``num_items``,
        or a parameter replaced in the model and not adopted (``gaengine.replaced``: ``load_state_dict(assign=True)``,
        a layer swapped), ``RuntimeError`` when the window is complete (call ``step()``), failed (call
        ``zero_grad()``) or the model moved (build a new accumulator): nothing accumulated, the window as it was. An
        error during autograd leaves the window failed and no ``.grad`` behind: ``zero_grad()`` drops it; a loss whose
        graph reaches another accumulator's parameters (a GAN's generator loss through the discriminator) raises
        ``RuntimeError`` naming one and the two ways on (docs/pitfalls.md). Warns
        (``gaengine.scaler.LossDividedByKWarning``, once per accumulator) when a window's first ``loss`` in mean mode
        was divided by K (``loss / K``, ``loss * (1 / K)``): gaengine divides by K itself.
        """
        self._lending.refuse_in_before_update("acc.backward()", "add a micro-batch to the window being applied")
        self._lending.refuse_lent("acc.backward()")
        end, settings, members = self._window_end, self._settings, self._membership
        num_items = end.check_micro_batch(loss, num_items, settings)
        window = self.window
        if window.num_micro_batches == 0:  # a window boundary: parameters unfrozen or frozen since are adopted
            if members.adopt(self.sharding, window, self, self.schedule.update_index,
                             self.scaler is None and self.config.loss_scale == "auto", self.optimizer, self.device):
                self.registered_params, self.named_params = members.members.trainable(), members.members.named()
            if self._fusion is not None:  # hooks registered or removed since: fused or not from this window on
                self._fusion.follow_hooks(self.sharding.accumulation, self.params)
        scaled, last, armed = end.prepare_micro_batch(loss, backward_kwargs, settings)
        self.sharding.accumulation.begin(last, armed)
        try:
            scaled.backward(**backward_kwargs)
            self.sharding.accumulation.end()  # buckets left incomplete are launched
            # From here the micro-batch's gradients are in main_grad: counting it must not fail silently either.
            counted = window.add(loss, num_items)
            if self._noise is not None:
                self._noise.add_micro_batch(counted)
            if self.sharding.reduction.end_backward(armed, last):
                end.launch_window_stats(self.max_grad_norm)
        except BaseException as exc:
            # Some parameters of this micro-batch may be accumulated and others not, or all of them without the
            # micro-batch counted: the window is no longer a sum of whole, counted micro-batches. zero_grad()
            # drops it and training goes on.
            self.sharding.accumulation.abort()
            window.fail()
            for p in self.params:  # what autograd left in .grad before it stopped belongs to the failed window
                p.grad = None
            foreign = foreign_gradient_error(exc, loss, self)  # another accumulator's parameter reached (a GAN)
            if foreign is not None:
                raise foreign from exc
            raise

    # ------------------------------------------------------------------ update
    def step(self, force: bool = False, *, before_update: Callable[[], None] | None = None) -> StepResult | None:
        """Finish the window: normalize, clip, update. Returns None while the window is incomplete.

        force: update on a partial window (end of an epoch); its gradient is normalized by the
            micro-batches (or items) it actually holds, so the result is exact. With no micro-batch in the
            window, returns None.
        before_update: called once, with no arguments, after the window's gradient is complete (reduced over the
            ranks) and before it is clipped and applied, with every parameter's ``.grad`` holding the window's
            normalized gradient: for an fp32 parameter a view of ``main_grad``, normalized in place (one pass over
            the buffer, 8 B/element, no extra memory); for a bf16/fp16 one its rounding to the parameter's dtype (a
            copy, 2 B/element while the call runs); None for a parameter no micro-batch reached. It may read them,
            edit them (in place, or by setting ``.grad``; None: that parameter is not updated) and set
            ``max_grad_norm``: the edited gradient, whatever the dtype, is what is clipped and applied (an element a
            bf16/fp16 edit left equal to its rounding keeps its fp32 value; ``gaengine.update.WindowGrads``), and
            ``grad_norm``, the skip flag and the clip coefficient are the edited gradient's (one more pass over
            ``main_grad``). The ``.grad`` are released when it returns. Without an edit the update differs from one
            without ``before_update`` by fp32 rounding only (normalization and clip are two multiplications). Calling
            ``step``, ``begin_step``, ``zero_grad``, ``close``, ``backward``, ``state_dict`` or ``load_state_dict``
            from inside it raises ``RuntimeError`` naming the call, nothing changed. If it raises, ``main_grad`` is
            multiplied back (the window's sums within one fp32 rounding of what they were, exactly for a power-of-two
            denominator; edits in place of fp32 ``.grad`` stay, scaled back), nothing is applied and the window
            stays open. Replicated accumulators only (``zero_stage=0``, not
            FSDP2): other ones raise ``ValueError`` before touching the window. The trainer integrations use it to
            run their frameworks' "before the optimizer step" hooks; ``begin_step()`` lends the same ``.grad``
            until ``step()`` (Accelerate's loop).

        Item mode whose tensor ``num_items`` add up to 0 over the window: nothing to normalize by, so the update is
        skipped on the device (``result.skipped``; ``grad_norm`` and ``loss`` inf or NaN; the window dropped; the
        loss scale kept: the gradient did not overflow). A negative, NaN or inf count likewise
        (``result.invalid_num_items``; ``grad_norm``, ``loss`` and ``num_items`` NaN).

        Several ranks: every rank's window must hold the same number of micro-batches; when they differ, every
        rank skips the update (``result.skipped``; parameters, optimizer, ``lr_scheduler``, loss scale and schedule
        unchanged) and raises ``RuntimeError`` naming each rank's count, in this ``step()`` or, with no host read
        here, in the next ``backward()``/``step()`` (docs/multi-rank.md).

        Raises ``RuntimeError`` if a backward of this window failed (call ``zero_grad()``, then go on), or if
        the model was moved or converted after the accumulator was built (build a new one).
        """
        self._lending.refuse_in_before_update("acc.step()", "apply the window twice")
        lent = self._lending.lent  # begin_step() lent it already
        if lent is None:
            k = self._window_end.window_to_step(force, before_update is not None, self._settings)
            if k is None:
                return None
            lent = self._window_end.complete_window(k, self.max_grad_norm)
            if before_update is not None:
                self._lending.lend(lent, False, self.sharding.accumulation, self.named_params)
        if before_update is not None:
            self._lending.run_before_update(lent, before_update, self.sharding.accumulation)
        return self._window_end.apply_window(lent, self._settings)  # max_grad_norm as before_update left it

    # ------------------------------------------------------------------ the window's gradient lent in .grad
    def begin_step(self, force: bool = False) -> bool:
        """The first half of ``step()``: complete the window and lend its normalized gradient in ``.grad``, for code
        that reads or edits ``.grad`` between the last ``backward()`` and the update (a plain Accelerate loop's
        ``torch.nn.utils.clip_grad_norm_``, a gradient mask). The next ``step()`` applies what ``.grad`` holds then.

        force: as ``step()``'s (a partial window). Returns True when the gradient is lent (or was already), False
        (nothing done) while the window is incomplete and not forced, or empty.

        ``.grad`` is what ``step(before_update=fn)`` gives ``fn`` (docs/accumulator.md, "Reading and editing the
        window's gradient"): an fp32 parameter's is its view of ``main_grad`` (zero-copy), a bf16/fp16 one's its
        rounding (a copy, 2 B/element), None where no micro-batch reached it; edits of any dtype reach the update
        (``gaengine.update.WindowGrads``), and the norm, the skip flag and the clip are those of the edited gradient.
        Unlike ``before_update``'s, these ``.grad`` stay after ``step()``, holding the gradient as applied (edited,
        times the clip coefficient: what ``torch.nn.utils.clip_grad_norm_`` leaves), until the next ``backward()``
        or ``zero_grad()``. Meanwhile ``backward()``, ``state_dict()`` and ``load_state_dict()`` raise
        ``RuntimeError`` (nothing changed); ``zero_grad()`` drops the window. On several ranks every rank calls it
        (a partial window's reductions are launched here). Raises what ``step()`` raises before applying anything,
        and ``ValueError`` where the strategy does not hold the whole gradient (``zero_stage`` >= 1, FSDP2).
        """
        self._lending.refuse_in_before_update("acc.begin_step()", "lend the window again")
        if self._lending.lent is not None:
            return True
        k = self._window_end.window_to_step(force, True, self._settings)
        if k is None:
            return False
        lent = self._window_end.complete_window(k, self.max_grad_norm)
        self._lending.lend(lent, True, self.sharding.accumulation, self.named_params)
        return True

    @property
    def accumulation_steps(self) -> int:
        """K, the micro-batches of the current window. With a schedule it is asked once per window, when the
        window's first ``backward()`` runs or this is read between windows; ``ValueError`` naming the schedule
        if it answers anything but an int >= 1 (the window is untouched)."""
        return self.schedule.k(self.window.num_micro_batches)

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        """Set K from the current window on (e.g. twice the micro-batches after halving them for memory, as
        ``gaengine train --auto-micro-batch`` does); ``ValueError`` for anything but an int >= 1, while a
        schedule sets K (change the schedule instead), or below the micro-batches the current window already holds
        (call ``step(force=True)`` or ``zero_grad()`` first): the window's K is never less than its count."""
        n = self.window.num_micro_batches
        if not isinstance(value, bool) and isinstance(value, int) and 1 <= value < n:
            raise ValueError(f"accumulation_steps={value} is less than the {n} micro-batches the current window "
                             "already holds; call acc.step(force=True) (or acc.zero_grad()) first, then set it")
        self.schedule.set_k(value)

    # The accumulator's own settings, checked on assignment with the constructor's check and message
    # (gaengine.config.CheckedSetting): a bad value is refused where it is set, not at the next step().
    max_grad_norm = CheckedSetting(check_max_grad_norm, doc=(
        "The clip threshold the next ``step()`` uses (a positive finite float), or None: no clipping. Set it between "
        "or during windows (the trainer integrations do); ``ValueError`` naming ``max_grad_norm`` for 0, a negative, "
        "NaN, inf, a bool or a non-number, as ``GradientAccumulator(max_grad_norm=...)`` (the value kept)."))
    micro_batch_size = CheckedSetting(lambda value: check_optional_count("micro_batch_size", value), doc=(
        "Samples per micro-batch (an int >= 1), or None; ``gaengine train --auto-micro-batch`` halves it. "
        "``ValueError`` naming ``micro_batch_size`` for anything else, as the constructor (the value kept)."))
    min_loss_scale = CheckedSetting(check_min_loss_scale, doc=(
        "The dynamic loss scale's floor (a positive finite float), applied from the next update on. ``ValueError`` "
        "naming ``min_loss_scale`` for anything else, as the constructor (the value kept)."),
        then=lambda acc, value: setattr(acc.scaler, "min_scale", value) if getattr(acc, "scaler", None) else None)

    # ------------------------------------------------------------------ lifecycle
    num_micro_batches = property(lambda self: self.window.num_micro_batches,
                                 doc="Micro-batches accumulated in the current window (an int).")

    def zero_grad(self) -> None:
        """Drop the current window (its gradients, counts and loss) and any ``.grad`` left on the params.

        Always returns the accumulator to a clean window, after any error of ``backward()`` or ``step()`` (on
        several ranks it first waits for the all-reduces a failed last micro-batch had launched). It cannot
        undo moving or converting the model after construction: then build a new accumulator. A window whose
        gradient ``begin_step()`` lent is dropped likewise. ``RuntimeError`` from inside
        ``step(before_update=...)`` (nothing changed).
        """
        self._lending.refuse_in_before_update("acc.zero_grad()", "drop the window being applied")
        self._lending.lent = None
        if (ranks := self._membership.ranks) is not None and ranks.protocol.reducing:
            self._window_end.drop_reductions(self.max_grad_norm)  # the other ranks' matched (gaengine.protocol)
        self.sharding.reduction.drain()  # the reductions in flight (errors ignored)
        self.sharding.accumulation.drop()  # the hooks' window and what they hold
        if self.window.stats is not None:
            wait_quietly(self.window.stats.work)
        self._window_end.clear_grads()
        # unfrozen mid-window (frozen again or not): autograd's raw .grad,
        for _, p in self._membership.members.unmanaged_grads(self.params):
            p.grad = None  # dropped as optimizer.zero_grad() drops every .grad of its groups
        self.window.reset()  # the strategy resets the hooks' part (end_window, drain)
        if self._noise is not None:
            self._noise.reset()
        if ranks is not None:
            ranks.drop()
        if self.window_batchnorm is not None:
            self.window_batchnorm.reset()

    def state_dict(self) -> dict:
        """Everything needed to resume, mid-window included: the window's fp32 sums and counts, the fp32 masters,
        the optimizer's state and param groups, the ``lr_scheduler``, the loss scale, the bucket order and the
        schedule's position. One format for every ``zero_stage`` and FSDP2 models
        (``gaengine.checkpoint.accumulator_state_dict``), in
        ``torch.distributed.checkpoint``'s form: one ``gaengine.checkpoint.FlatShard`` per flattened parameter, each
        rank holding its range. Save it with ``dcp.save({"model": model.state_dict(), "acc": acc.state_dict()}, ...)``
        or, where a rank holds every value whole (``zero_stage=0``, one rank), ``torch.save`` (plain CPU tensors,
        ``torch.load(..., weights_only=True)``). Saved between windows it loads on any world size and ``zero_stage``,
        mid-window on the same ones, bit-identically (docs/checkpoints.md; an FSDP2 model's with
        ``get_model_state_dict``, docs/fsdp2.md). Every rank calls it. Raises ``RuntimeError`` between the window's
        last ``backward`` and ``step()``; on an FSDP2 model, ``ValueError`` for an optimizer that is not elementwise.
        """
        self._lending.refuse_in_before_update("acc.state_dict()", "save the window's normalized, maybe edited gradient as "
                                      "its sums")
        self._lending.refuse_lent("acc.state_dict()")  # main_grad holds the normalized gradient, maybe edited
        from gaengine.checkpoint import accumulator_state_dict  # noqa: PLC0415 - imports DCP (about 2 s)

        self._membership.replaced.follow_storage(refuse=False)  # p.data = x mid-window: the masters saved take x
        self.sharding.update.pull_model_writes()  # the masters saved are the model's (after a model.load_state_dict())
        return accumulator_state_dict(self.state_parts())

    def load_state_dict(self, state: dict, *, accumulation_steps: str | None = None) -> None:
        """Restore a ``state_dict()`` of any ``zero_stage`` and world size (after ``dcp.load`` into this run's own
        ``state_dict()``, or ``torch.load`` of a replicated run's file), through
        ``gaengine.checkpoint.load_accumulator_state_dict``. A state of an earlier gaengine's format is refused
        (``ValueError`` naming it): ``gaengine.checkpoint.upgrade`` converts it.

        K: a K the saved run set at run time (``acc.accumulation_steps = K``) is restored; else this accumulator
        keeps its own (a schedule's window keeps the K it was saved under). A state saved mid-window under another K
        than the one this accumulator would go on with is refused (``ValueError`` naming both) unless
        ``accumulation_steps`` says how to go on: "saved" (the saved window's K, from now on) or "current" (this
        accumulator's K: the window completes after that many micro-batches).

        Raises ``ValueError`` naming the key, before anything is changed, if it is of another format, was made for
        other parameters (names, shapes, dtypes), another optimizer type or param-group keys, other master weights
        or loss scaling, saved mid-window on another world size or sharding strategy (naming both), or is corrupt:
        a meta blob that does not decode (truncated, a flipped bit: its records' CRC-32), a key missing, a value of
        another type or out of range (counters, written flags, arrivals, tensors' sizes and dtypes;
        ``gaengine.state_checks``)."""
        self._lending.refuse_in_before_update("acc.load_state_dict()", "replace the window being applied")
        self._lending.refuse_lent("acc.load_state_dict()")
        if accumulation_steps not in (None, "saved", "current"):
            raise ValueError(f"accumulation_steps must be None, 'saved' or 'current' (how a window saved under another "
                             f"K goes on), got {accumulation_steps!r}")
        from gaengine.checkpoint import load_accumulator_state_dict  # noqa: PLC0415 - imports DCP

        load_accumulator_state_dict(self.state_parts(accumulation_steps), state)
        self._scheduler.stepped()  # the scheduler as restored

    def state_parts(self, accumulation_steps: str | None = None) -> AccumulatorParts:
        """The accumulator's parts as ``gaengine.checkpoint`` reads and writes them (``gaengine.stages``): the
        strategy, the optimizer, the ``lr_scheduler``, the parameters, the process group and the window's stages
        (``StageStates``, each stage giving and taking its own state items). accumulation_steps: as
        ``load_state_dict``'s. Built anew for each call (a re-layout or the loss scale chosen at the first
        ``backward()`` replaces parts); nothing is copied."""
        stages = StageStates(self.window, self.schedule, self.scaler, self._skips, self._noise, self.sharding,
                             self.registered_params, self.world_size, self.config.accumulation_steps,
                             accumulation_steps)
        return AccumulatorParts(self.sharding, self.optimizer, self.lr_scheduler, self.registered_params,
                                self.named_params, self.process_group, self.world_size, self.device, stages)

    @property
    def effective_batch_size(self) -> int:
        """Samples per update: micro_batch_size x accumulation_steps x world size (needs micro_batch_size); with
        a schedule, the current window's."""
        if self.micro_batch_size is None:
            raise ValueError("effective_batch_size needs GradientAccumulator(..., micro_batch_size=...)")
        return self.micro_batch_size * self.accumulation_steps * self.world_size

    def masters_to_model(self) -> None:
        """Round the fp32 master weights into the model's bf16/fp16 parameters now (one copy per dtype, on the
        device; nothing without masters).

        The update does this after every ``optimizer.step()``, and so do the optimizer methods gaengine knows write
        parameters (``gaengine.store.PARAM_WRITERS``: schedule-free's ``optimizer.eval()`` / ``train()``). Call it
        after any other call that writes the parameters the re-pointed optimizer holds (the fp32 masters), e.g. a
        hand-written weight averaging over ``optimizer.param_groups``, so that the model holds their rounding, as it
        would in plain training. A write into the model itself needs nothing: the next update merges it into the
        masters. Raises ``RuntimeError`` when the model was moved or converted since construction, and at
        ``zero_stage`` >= 1 on several ranks (each rank holds a shard of the masters).
        """
        self._membership.replaced.follow_storage()  # p.data = x since the window began: into its buffer first
        self.sharding.update.masters_to_model()

    def close(self, *, release_optimizer: bool = False) -> None:
        """Remove the hooks, drop the ``.grad`` the accumulator left on the parameters, and release them
        (another accumulator may then take them, and its first window holds only its own micro-batches).

        The parameters keep their values; re-pointed bf16/fp16 parameters stay views of the flat model buffer
        (kept alive by them), until another accumulator re-points them into its own. With ``optimizer=None``,
        read (or ``.clone()``) the gradients ``step()`` left in ``.grad`` before calling ``close()``.

        release_optimizer: False (default): the optimizer stays re-pointed at the fp32 masters (the closed
            accumulator's ``state_dict()`` still reads them). True: the optimizer is given back to the model, as
            plain training of the model would hold it: its param groups hold the model's parameters again, their
            state keyed by them in their dtype (bf16/fp16 moments rounded once, as ``Optimizer.load_state_dict``
            casts), the model holding the masters' rounding; plain ``loss.backward()`` / ``optimizer.step()`` then
            train on. ``ValueError`` (before anything is closed) at ``zero_stage`` >= 1 on several ranks, where the
            optimizer holds 1-D shards.

        A window still holding micro-batches is dropped with one ``UserWarning`` naming how many (garbage collection
        of an open accumulator warns the same way): call ``step(force=True)`` first to apply them.
        """
        self._lending.refuse_in_before_update("acc.close()", "release the parameters in the middle of their update")
        update = self.sharding.update if release_optimizer else None
        if update is not None:
            update.check_release()  # ValueError: the optimizer holds 1-D shards
        warn_dropped_window(self.window, "acc.close()")
        if (ranks := self._membership.ranks) is not None and (self.window.failed or ranks.protocol.reducing):
            self.zero_grad()  # a failed micro-batch's reductions complete first: the other ranks' are matched
        self._lending.lent = None
        if update is not None:
            update.release_to_model()
        for p in self.params:
            p.grad = None
        release(self, self.sharding, self._fusion, self.window_batchnorm)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            warn_dropped_window(getattr(self, "window", None), "garbage collection of the GradientAccumulator")
            release(self, getattr(self, "sharding", None), getattr(self, "_fusion", None), self.window_batchnorm)  # .grad kept
        except Exception:
            pass
