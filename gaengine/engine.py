"""``GradientAccumulator``: fp32 flat-buffer gradient accumulation, late normalization, clipping, update.

Data flow of one accumulation window of K micro-batches (docs/design.md); this module orchestrates it, each
stage lives in the module named after it:

* ``acc.backward(loss)`` runs autograd; each parameter's post-accumulate hook takes ``p.grad`` at once and,
  when its bucket (``gaengine.bucket``) is complete, the whole bucket is added into its views of one flat
  fp32 ``main_grad`` buffer (``gaengine.buffer``; the first write of a window overwrites: no zeroing pass)
  in one launch. The hooks are C++ (``gaengine.hot_path`` over ``csrc/hot_path.cpp``: no Python per
  parameter) when ``gaengine._C`` is built, else Python (``gaengine.hooks``). In the last micro-batch on
  several ranks, each bucket's all-reduce starts as soon as it is complete (``gaengine.reduce``).
* Gradients stay raw sums. ``acc.step()`` applies the denominator once — the number of micro-batches
  (mean mode) or the total item count (item mode, ``num_items=``) — folded into the clip coefficient,
  so a partial window (``step(force=True)``) and token-count normalization are exact.
* ``step()`` makes one pass over the buffer (or none) for the sum of squares and the non-finite flag,
  computes the clip coefficient on the device (``gaengine.norm``), and runs the optimizer on fp32
  gradients (fp32 master weights for bf16/fp16 parameters, ``gaengine.update``). A non-finite gradient
  skips the update.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gaengine.backends import get_backend
from gaengine.batchnorm import WindowBatchNorm, warn_batchnorm
from gaengine.clip import OWNER_ATTR as _OWNER_ATTR, guard_torch_clip_grad_norm
from gaengine.config import AccumulatorConfig
from gaengine.buffer import FlatBuffer
from gaengine.hooks import Hooks
from gaengine.noise import NoiseEstimate, WindowNoise
from gaengine.reduce import count_mismatch_message, launch_window_stats, wait_quietly
from gaengine.scaler import (DEFAULT_MIN_LOSS_SCALE, LossScaler, guard_grad_scaler,
                             scaled_by_grad_scaler)
from gaengine.schedules import AccumulationSchedule, WindowSchedule
from gaengine.sharding import ShardingStrategy, check_sharding_optimizer, make_sharding, trainable_params
from gaengine.update import check_optimizer_step, fused_optimizer
from gaengine.window import FAILED_WINDOW, LateCounts, StepResult, Window

__all__ = ["GradientAccumulator", "StepResult"]


class GradientAccumulator:
    """Accumulate gradients of ``model`` over ``accumulation_steps`` micro-batches in fp32, then update.

    Args:
        model: an ``nn.Module`` or an iterable of Parameters, all on one device, fp32 | bf16 | fp16.
            Parameters with ``requires_grad=False`` are skipped. Must not be wrapped in DDP. A ``.grad`` already
            on a parameter (a ``loss.backward()`` before construction) is dropped with one ``UserWarning`` naming
            how many: a window holds only its own micro-batches (Megatron-Core and torch DDP start from zeroed
            gradients too).
        optimizer: a ``torch.optim.Optimizer`` built over (a subset of) the model's parameters, or None
            (then ``step()`` leaves the final, normalized and clipped gradients in ``.grad``). For bf16/fp16
            parameters it is re-pointed at fp32 master weights (param groups and hyper-parameters kept);
            the model's parameters receive the rounded master weights after every update. With masters, those
            bf16/fp16 parameters (the same ``Parameter`` objects: ``p.data`` is re-pointed, dtype and device
            unchanged, so autograd and gaengine's hooks are kept) become views of one flat buffer per dtype laid
            out like the master buffer, and the master -> model write is one flat copy per dtype (or part of
            ``gaengine.optim.FusedAdamW``'s pass). What users see: a parameter (and each tensor of
            ``model.state_dict()``) shares that buffer's storage, so ``torch.save`` of a few of them writes the
            whole buffer (``.clone()`` them first); a non-contiguous (e.g. channels_last) parameter becomes
            contiguous; ``model.load_state_dict`` (or an in-place write under ``torch.no_grad()``) after
            construction writes into the buffer and reaches the fp32 masters at the next update or ``state_dict()``
            (seen by the parameters' version counters; elements still holding their master's rounding keep the
            master's fp32 bits, so a checkpoint's model and accumulator load in either order; a write through
            ``p.data`` is not seen); ``copy.deepcopy(model)`` gives ordinary independent parameters; ``torch.compile``
            and activation checkpointing work unchanged. Moving or converting the model afterwards
            (``model.to(another device or dtype)``, ``.float()``, ``.cuda()``, ``load_state_dict(assign=True)``)
            is not supported: build the accumulator last (``step()`` raises ``RuntimeError`` when it sees the
            parameters left the buffer; a same-device, same-dtype ``.to()`` is a no-op and fine).
        lr_scheduler: stepped once after every applied (not skipped) update.
        process_group: reduce gradients across the ranks of this group; by default the global group when
            ``torch.distributed`` is initialized with more than one rank. Parameters (and, with
            ``broadcast_buffers``, buffers) are broadcast from the group's first rank at construction.
        **options: the accumulator's options, the fields of ``gaengine.AccumulatorConfig`` (``gaengine/config.py``),
            whose docstrings are their reference (units, default and its source, what raises): ``accumulation_steps``
            (K micro-batches per update, an int or a schedule), ``max_grad_norm``, ``backend``, ``master_weights``,
            ``bucket_size_mb``, ``reduce_dtype``, ``broadcast_buffers``, ``loss_scale``, ``min_loss_scale``,
            ``batchnorm``, ``max_consecutive_skips``, ``micro_batch_size``, ``measure_noise_scale``,
            ``noise_scale_ema``, ``zero_stage``, ``overlap_param_gather``, ``overlap_grad_reduce``. They are checked
            once, before anything touches the model, and kept as ``acc.config`` (frozen: what was asked at
            construction); ``acc.accumulation_steps`` (K of the current window) and ``acc.micro_batch_size`` start
            from it and are the accumulator's own to change.

    Multi-rank: only the last micro-batch of a window communicates; each bucket's all-reduce starts as
    soon as backward has produced its last gradient, overlapping the rest of backward. The denominator is
    micro-batches x world size (mean mode) or the all-reduced item count (item mode), so every rank gets
    the exact global mean. Every rank must call ``backward`` and ``step`` the same number of times.

    Raises ``ValueError`` / ``TypeError`` naming the argument for bad input (see the tests), and
    ``RuntimeError`` when a parameter already belongs to another live accumulator.

    With a fused torch optimizer (``Adam``/``AdamW``/``SGD`` with ``fused=True``) the normalization and
    clip coefficient and the skip flag reach the optimizer through its ``grad_scale``/``found_inf``
    arguments: no extra pass over the gradients and no host sync. Other optimizers get one scale pass and
    one host read of the skip flag. An ``lr_scheduler`` also costs one host read of the skip flag per
    update (it runs on the host).
    """

    def __init__(
        self,
        model: nn.Module | Iterable[torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
        accumulation_steps: int | AccumulationSchedule = 8,
        max_grad_norm: float | None = 1.0,
        lr_scheduler: Any = None,
        backend: str = "auto",
        *,
        master_weights: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_size_mb: float = 25.0,
        reduce_dtype: torch.dtype = torch.float32,
        broadcast_buffers: bool = True,
        loss_scale: str | float | None = "auto",
        min_loss_scale: float = DEFAULT_MIN_LOSS_SCALE,
        batchnorm: str | None = None,
        max_consecutive_skips: int | None = None,
        micro_batch_size: int | None = None,
        measure_noise_scale: bool = False,
        noise_scale_ema: float = 0.95,
        zero_stage: int = 0,
        overlap_param_gather: bool = False,
        overlap_grad_reduce: bool = True,
    ) -> None:
        # Every option checked once, before anything touches the model (gaengine.config: ValueError naming it).
        self.config = AccumulatorConfig(
            accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm, backend=backend,
            master_weights=master_weights, bucket_size_mb=bucket_size_mb, reduce_dtype=reduce_dtype,
            broadcast_buffers=broadcast_buffers, loss_scale=loss_scale, min_loss_scale=min_loss_scale,
            batchnorm=batchnorm, max_consecutive_skips=max_consecutive_skips, micro_batch_size=micro_batch_size,
            measure_noise_scale=measure_noise_scale, noise_scale_ema=noise_scale_ema, zero_stage=zero_stage,
            overlap_param_gather=overlap_param_gather, overlap_grad_reduce=overlap_grad_reduce)
        self.schedule = WindowSchedule(accumulation_steps)  # K per window, and the updates and samples so far
        self.max_grad_norm = self.config.max_grad_norm
        self.min_loss_scale = self.config.min_loss_scale
        if overlap_param_gather and not isinstance(model, nn.Module):
            raise ValueError("overlap_param_gather=True needs model as an nn.Module (the all-gather is waited for in "
                             f"its modules' forward pre-hooks), got a model of type {type(model).__name__}: pass the "
                             "module, or leave overlap_param_gather off")
        check_sharding_optimizer(zero_stage, optimizer)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if optimizer is not None:
            check_optimizer_step(optimizer)
        params = trainable_params(model)
        # The parameters' names (checkpoint keys) and registration order: the reference frame of state_dict().
        self.named_params = list(model.named_parameters()) if isinstance(model, nn.Module) else []
        for p in params:
            owner = getattr(p, _OWNER_ATTR, None)
            if owner is not None and owner() is not None:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} already belongs to another GradientAccumulator; "
                    "call close() on it first (two accumulators would each free the other's gradients)"
                )
        if optimizer is not None:
            ids = {id(p) for p in params}
            foreign = [q for g in optimizer.param_groups for q in g["params"] if id(q) not in ids]
            if foreign:
                raise ValueError(
                    f"optimizer holds {len(foreign)} parameter(s) that are not trainable parameters of model "
                    f"(first of shape {tuple(foreign[0].shape)}); build the optimizer over model.parameters()"
                )

        stale = [p for p in params if p.grad is not None]
        if stale:
            # Megatron-Core and torch DDP start from zeroed gradients too: a window is the sum of its own
            # micro-batches only, so a gradient left from an earlier loss.backward() must not be summed into it.
            warnings.warn(
                f"{len(stale)} of {len(params)} trainable parameters already hold a .grad (from a loss.backward() "
                "before the accumulator was built, or another accumulator); gaengine drops them so that the first "
                "window holds only its own micro-batches",
                UserWarning, stacklevel=2)
            for p in stale:
                p.grad = None
        self.device = params[0].device
        self.backend = get_backend(backend, self.device)
        self.process_group = process_group
        self.world_size = 1
        if process_group is not None or (dist.is_available() and dist.is_initialized()):
            self.world_size = dist.get_world_size(process_group)
        self.distributed = self.world_size > 1
        self.window = Window(self.device)  # the window's counters, loss sum, failed flag and stats (gaengine.window)
        self._late_counts = LateCounts(self.world_size, self.device)  # a step() that read no counts (several ranks)
        self.zero_stage = zero_stage  # as asked; sharded only on several ranks (gaengine.sharding)
        self.bucket_size_mb = float(bucket_size_mb)
        self.reduce_dtype = reduce_dtype
        self.max_consecutive_skips = max_consecutive_skips
        self.micro_batch_size = micro_batch_size
        # The noise scale's averages; the window's item count per micro-batch (item mode) and, after a mid-window
        # resume, the source norms of the micro-batches the saved window already held.
        self._noise = WindowNoise(noise_scale_ema, self.device) if measure_noise_scale else None
        self._consecutive_skips = 0
        self._auto_loss_scale = loss_scale == "auto"
        if loss_scale == "auto":
            loss_scale = "dynamic" if any(p.dtype == torch.float16 for p in params) else None
        self.scaler: LossScaler | None = None
        if loss_scale is not None:
            dynamic = loss_scale == "dynamic"
            self.scaler = LossScaler(self.device, 2.0**16 if dynamic else float(loss_scale), dynamic=dynamic,
                                     min_scale=self.min_loss_scale)
        self.window_batchnorm: WindowBatchNorm | None = None
        if isinstance(model, nn.Module):
            if batchnorm == "window":
                self.window_batchnorm = WindowBatchNorm(model)
            else:
                warn_batchnorm(model, self.accumulation_steps)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        # The layout, main_grad, the hooks (per-parameter, per-micro-batch state: gaengine.hooks), the reducer, the
        # masters and the update: one data-parallel sharding strategy (gaengine.sharding). A gradient that gaengine
        # left in .grad (step() without an optimizer, a resumed state) is cleared by the next backward.
        self._grads_left = False
        self.registered_params = params
        self.sharding: ShardingStrategy = make_sharding(
            zero_stage, self.world_size, params, optimizer, backend=self.backend, device=self.device,
            process_group=self.process_group, bucket_size_mb=self.bucket_size_mb, reduce_dtype=reduce_dtype,
            master_weights=master_weights, measure_sources=self._noise is not None,
            model=model if isinstance(model, nn.Module) else None, overlap_param_gather=overlap_param_gather,
            broadcast_buffers=broadcast_buffers)
        # One parameter per dtype tells whether the model was moved or converted afterwards (Module._apply
        # converts them all); a re-pointed bf16/fp16 one must also still be a view of its flat buffer.
        self._model_sentinels = {p.dtype: p for p in reversed(self.params)}
        self._model_error: str | None = None


        ref = weakref.ref(self)
        for p in self.params:
            setattr(p, _OWNER_ATTR, ref)
        guard_torch_clip_grad_norm()  # a habit's clip_grad_norm_ over these parameters warns (their .grad is None)
        guard_grad_scaler()  # a habit's GradScaler-scaled loss is refused by backward()

    # ------------------------------------------------------------------ the strategy's parts, as attributes
    @property
    def params(self) -> list[torch.Tensor]:
        """The trainable parameters in layout order (index i: ``main_grad``'s slice i)."""
        return self.sharding.params

    @property
    def main_grad(self) -> FlatBuffer:
        """The window's fp32 gradient sums, ``(n,)`` on the parameters' device (``meta`` at ``zero_stage=2`` on
        several ranks, where the sums live in each rank's gradient shard)."""
        return self.sharding.main_grad

    @property
    def reducer(self):
        """The bucket reducer (``gaengine.reduce``), or None on one rank."""
        return self.sharding.reducer

    @property
    def hooks(self) -> Hooks:
        """The per-parameter hooks (``gaengine.hooks``)."""
        return self.sharding.hooks

    @property
    def master_buffer(self) -> FlatBuffer | None:
        """This rank's flat fp32 master weights (``gaengine.store.ParameterStore.master_buffer``), or None."""
        return self.sharding.master_buffer

    # ------------------------------------------------------------------ hot path
    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None, **backward_kwargs: Any) -> None:
        """Backward of one micro-batch, accumulating its gradients into the fp32 buffer.

        loss: 0-d (or one-element) floating tensor that requires grad: the micro-batch's mean loss (mean
            mode), or its sum over items when ``num_items`` is given (item mode).
        num_items: number of items (e.g. tokens whose label is not -100) the summed ``loss`` covers; an int
            >= 0 or a 0-d integer/float tensor on any device (kept on the device: no sync). Either every
            micro-batch of a window passes it or none does.
        backward_kwargs: passed to ``torch.Tensor.backward`` (e.g. ``retain_graph``).

        Raises ``ValueError`` for a bad ``loss`` (one scaled by ``torch.amp.GradScaler.scale`` too) or ``num_items``
        (an int must be >= 1) and ``RuntimeError`` when the window is already complete (call ``step()``), when an earlier backward of this window raised (call
        ``zero_grad()``), or when the model was moved or converted after construction (build a new accumulator);
        in all these cases nothing is accumulated and the window is left as it was. An error raised during
        autograd (a user's hook, out of memory, a gradient arriving too late to be reduced) leaves the window
        failed and no ``.grad`` behind: ``zero_grad()`` drops it.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss must be a scalar floating tensor (reduce it with .mean() or .sum()), got {what}")
        if not loss.requires_grad:
            raise ValueError("loss does not require grad: it was computed under torch.no_grad() or from frozen parameters")
        if scaled_by_grad_scaler(loss):
            raise ValueError(
                "loss was scaled by torch.amp.GradScaler.scale(): gaengine scales the loss itself (loss_scale='auto' "
                "is dynamic for fp16) and folds the inverse scale into its update, so a second scale would make every "
                "window overflow and the updates 65536x too large. Pass the unscaled loss, acc.backward(loss), and "
                "delete the GradScaler and its unscale_/step/update calls; nothing was accumulated")
        self._check_model()
        window = self.window
        if window.failed:
            raise RuntimeError(FAILED_WINDOW)
        if self._late_counts.pending:  # the last window's per-rank counts, unread by its step()
            self._report_count_check()
        if window.num_micro_batches >= self.accumulation_steps:
            raise RuntimeError(
                f"the accumulation window already holds accumulation_steps={self.accumulation_steps} micro-batches; "
                "call acc.step() before the next acc.backward()"
            )
        window.check_next(num_items is not None)
        if num_items is not None:
            num_items = self._check_num_items(num_items)
        if self.hooks.take_stale() | self._grads_left:  # both read: take_stale() clears its flag
            self._clear_grads()
        last = window.num_micro_batches == self.accumulation_steps - 1
        # The first window (the layout and each parameter's arrivals per backward are being learned) reduces after
        # backward: a bucket whose parameter arrives twice (reentrant checkpointing) must not start early.
        armed = self.sharding.begin_backward(window, last, self.config.overlap_grad_reduce)

        if self.scaler is None and self._auto_loss_scale and torch.is_autocast_enabled(self.device.type) \
                and torch.get_autocast_dtype(self.device.type) == torch.float16:
            self.scaler = LossScaler(self.device, min_scale=self.min_loss_scale)  # fp16 autocast seen: dynamic
        self._auto_loss_scale = False
        scaled = loss if self.scaler is None else loss * self.scaler.scale

        self.hooks.begin(last, want_norm=last and not self.distributed, armed=armed)
        try:
            scaled.backward(**backward_kwargs)
            self.hooks.end()  # buckets left incomplete are launched
        except BaseException:
            # Some parameters of this micro-batch may be accumulated and others not: the window is no
            # longer a sum of whole micro-batches. zero_grad() drops it and training goes on.
            self.hooks.abort()
            window.fail()
            for p in self.params:  # what autograd left in .grad before it stopped belongs to the failed window
                p.grad = None
            raise

        counted = window.add(loss, num_items)
        if self._noise is not None:
            self._noise.add_micro_batch(counted)
        if self.sharding.end_backward(armed, last):
            self._finish_communication_launch()

    def _finish_communication_launch(self) -> None:
        """End of the last backward: launch the remaining buckets and the stats all-reduce (``gaengine.reduce``);
        the slices this rank never wrote are zeroed and count as written (the all-reduce fills them)."""
        window = self.window
        unused = [i for i, used in enumerate(window.used_with(self.hooks.accumulated)) if not used]
        window.stats = launch_window_stats(self.reducer, self.main_grad, unused, window.loss_sum, window.items(),
                                           self.process_group, extra=self._noise_terms(), count=window.num_micro_batches)

    def _noise_terms(self) -> torch.Tensor | None:
        """This rank's noise-scale terms of the window (``gaengine.noise.WindowNoise.terms``), or None."""
        if self._noise is None:
            return None
        window = self.window
        return self._noise.terms(self.hooks, window.num_micro_batches, bool(window.item_mode),
                                 None if self.scaler is None else self.scaler.scale)

    @staticmethod
    def _check_num_items(num_items: Any) -> int | torch.Tensor:
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
                raise ValueError(f"num_items must be an int or a one-element real tensor, got shape {tuple(num_items.shape)} {num_items.dtype}")
            return num_items.reshape(())
        if isinstance(num_items, bool) or not isinstance(num_items, int):
            raise ValueError(f"num_items must be an int >= 1 or a one-element tensor, got {num_items!r}")
        if num_items < 1:
            raise ValueError(
                f"num_items must be >= 1 (the items the summed loss covers), got {num_items}: a micro-batch with no "
                "items adds nothing to the gradient, so skip its acc.backward() (the window is unchanged). On several "
                "ranks, where every rank must call acc.backward() together, pass it as a tensor: "
                "num_items=torch.tensor(0)")
        return num_items

    # ------------------------------------------------------------------ update
    def step(self, force: bool = False) -> StepResult | None:
        """Finish the window: normalize, clip, update. Returns None while the window is incomplete.

        force: update on a partial window (end of an epoch); its gradient is normalized by the
            micro-batches (or items) it actually holds, so the result is exact. With no micro-batch in the
            window, returns None.

        Item mode with ``num_items`` given as tensors that add up to 0 over the window (every micro-batch was
        empty): there is nothing to normalize by, so the update is skipped on the device (``result.skipped``
        is True, ``grad_norm`` and ``loss`` are inf or NaN, the window is dropped; with dynamic loss scaling the
        scale backs off as for any skipped update). Python ints are checked in ``backward()`` instead.

        Several ranks: every rank's window must hold the same number of micro-batches. The stats all-reduce
        carries each rank's count; when they differ, every rank runs the step to its end as a skipped update
        (``result.skipped`` True; parameters, optimizer state, ``lr_scheduler``, loss scale and the schedule's count
        unchanged; the window dropped) and raises ``RuntimeError`` naming each rank's count: in this ``step()`` when
        it reads the device anyway (a non-fused optimizer, an ``lr_scheduler``, ``max_consecutive_skips``, unused
        parameters, ``force=True``), else, with no host sync here, in the next ``backward()`` or ``step()``.
        ``acc.zero_grad()`` afterwards is harmless (docs/multi-rank.md).

        Raises ``RuntimeError`` if a backward of this window failed (call ``zero_grad()``, then go on), or if
        the model was moved or converted after the accumulator was built (build a new one).
        """
        window = self.window
        k = window.num_micro_batches
        if self._late_counts.pending:  # the last window's per-rank counts, unread by its step()
            self._report_count_check()
        if k == 0 or (k < self.accumulation_steps and not force):
            return None
        self._check_model()
        if window.failed:
            raise RuntimeError(FAILED_WINDOW)

        dev = self.device
        loss_sum = window.loss_sum
        mismatch = None  # several ranks: 0-d bool on the device, the ranks' windows hold different counts
        partial = False
        if self.distributed:
            partial = window.stats is None
            if partial:  # force=True on a partial window: nothing launched yet
                self.sharding.end_partial_window(self.accumulation_steps - k)
                self._finish_communication_launch()
            self.sharding.wait_reductions()
            loss_sum, global_items = window.stats.wait()
            mismatch = window.stats.count_mismatch()
        if window.item_mode:
            if self.distributed:
                denom = num_items = global_items
            else:
                num_items = window.num_items()
                denom = window.items().float()
        else:
            denom = torch.full((), float(k * self.world_size), dtype=torch.float32, device=dev)  # a fill, no H2D copy
            num_items = None

        # Parameters with no gradient in this window (unused branches), on any rank: zeroed, and not updated.
        unwritten = (window.stats.globally_unused() if self.distributed else
                     [i for i, used in enumerate(window.used_with(self.hooks.accumulated)) if not used])
        self.sharding.zero_unused(unwritten)  # parameters with no gradient in this window (unused branches)

        # The buffer holds raw sums of (loss-scaled) gradients: one denominator undoes both.
        grad_denom = denom if self.scaler is None else denom * self.scaler.scale
        norm = self.sharding.norm(grad_denom, self.max_grad_norm)
        loss = loss_sum / denom
        loss_scale = None if self.scaler is None else self.scaler.scale.clone()
        skipped = norm.skipped if mismatch is None else norm.skipped | mismatch  # unequal counts: no rank updates
        noise: NoiseEstimate | None = None
        if self._noise is not None:  # before the update: main_grad and the scale are still the window's
            terms = window.stats.extra() if self.distributed else self._noise_terms()
            noise = self._noise.update(terms, norm.grad_norm.double().square(), denom, skipped)

        if self.optimizer is None:
            self.sharding.expose_grads(norm.coef, unwritten)
            self._grads_left = True
        else:
            self.sharding.update(norm.coef, skipped, unwritten, self.lr_scheduler)

        # The ranks' counts on the host: read now where step() reads the device anyway or ends an epoch (see the
        # docstring), else copied behind the all-reduce and read by the next backward() / step().
        counts, unread = None, False
        if mismatch is not None:
            if partial or window.stats.host_counts is not None or self._reads_skip_flag():
                counts = window.stats.read_counts()  # host read: after the skip flag's, or the unused flags', or force
            else:
                unread = True
                late_counts = window.stats.counts()
        differ = counts is not None and any(c != k for c in counts)
        scaler_state = None  # what a mismatch found later restores
        if self.scaler is not None and not differ:
            if unread and self.scaler.dynamic:
                scaler_state = (loss_scale, self.scaler.growth_tracker.clone())
            self.scaler.update(norm.skipped.to(torch.float32))
        if self.window_batchnorm is not None:
            self.window_batchnorm.end_window()
        result = StepResult(grad_norm=norm.grad_norm, clip_coef=norm.clip_coef, skipped=skipped,
                            num_micro_batches=k, num_items=num_items, loss=loss, loss_scale=loss_scale,
                            **({} if noise is None else dict(grad_noise_scale=noise.grad_noise_scale,
                                                             noise_trace_sigma=noise.trace_sigma,
                                                             noise_grad_sq=noise.grad_sq)))
        self.schedule.observe(result)
        counters = (self.schedule.update_index, self.schedule.items_seen)
        if not differ:
            self.schedule.advance(k, self.world_size, self.micro_batch_size)
        if self.max_consecutive_skips is not None and not differ:
            self._check_consecutive_skips(norm.skipped, loss_scale)
        self._reset_window()
        if self.hooks.arrival is not None:  # the first window: the layout follows its arrival order
            self._grads_left |= self.sharding.relearn_layout()  # a collective: every rank gets here
        if differ:
            self._raise_count_mismatch(counts)
        if unread:  # no host wait: read by the next backward() / step()
            self._late_counts.post(late_counts, (*counters, scaler_state))
        if self.scaler is not None and self.scaler.floor_reached():
            raise self.scaler.floor_error()
        return result

    def _reads_skip_flag(self) -> bool:
        """Whether ``step()`` reads its skip flag on the host anyway: a non-fused optimizer (it cannot skip on the
        device), an ``lr_scheduler`` (it runs on the host) or ``max_consecutive_skips``."""
        return ((self.optimizer is not None and not fused_optimizer(self.optimizer)) or self.lr_scheduler is not None
                or self.max_consecutive_skips is not None)

    def _report_count_check(self) -> None:
        """Read the last window's per-rank counts (``_late_counts``); when they differed, restore what its
        ``step()`` counted (the schedule's update count, the items seen, the loss scale) and raise ``RuntimeError``.
        Called first thing by ``backward()`` and ``step()``, so the window since is empty and stays so."""
        counts, (update_index, items_seen, scaler_state) = self._late_counts.take()
        if all(c == counts[0] for c in counts):
            return
        self.schedule.update_index, self.schedule.items_seen = update_index, items_seen
        if scaler_state is not None:
            self.scaler.scale.copy_(scaler_state[0])
            self.scaler.growth_tracker.copy_(scaler_state[1])
        self._raise_count_mismatch(counts, f" in the last window (after {update_index} updates: its step() skipped the "
                                           "update on the device without reading the counts, this call read them)")

    def _raise_count_mismatch(self, counts: list[int], found: str = "") -> None:
        """Raise the error of a window whose ranks held different micro-batch counts (``count_mismatch_message``);
        without an optimizer, the gradients ``step()`` left in ``.grad`` are dropped first."""
        if self.optimizer is None:
            self._clear_grads()
        raise RuntimeError(count_mismatch_message(counts, dist.get_rank(self.process_group), found))

    @property
    def accumulation_steps(self) -> int:
        """K, the micro-batches of the current window. With a schedule it is asked once per window, when the
        window's first ``backward()`` runs or this is read between windows; ``ValueError`` naming the schedule
        if it answers anything but an int >= 1 (the window is untouched)."""
        return self.schedule.k(self.window.num_micro_batches)

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        """Set K from the current window on (e.g. twice the micro-batches after halving them for memory, as
        ``gaengine train --auto-micro-batch`` does); ``ValueError`` for anything but an int >= 1 or while a
        schedule sets K (change the schedule instead)."""
        self.schedule.set_k(value)

    def _pull_model_writes(self) -> None:
        """Model writes since the last update (``model.load_state_dict()``, in-place under ``torch.no_grad()``)
        reach the fp32 masters (``gaengine.store.ParameterStore.pull_model_writes``)."""
        self.sharding.pull_model_writes()

    def _check_model(self) -> None:
        """Raise ``RuntimeError`` (for good) when the model was moved or converted after construction."""
        if self._model_error is None:
            moved = next(((dtype, p) for dtype, p in self._model_sentinels.items()
                          if p.dtype != dtype or p.device != self.device), None)
            try:
                self.sharding.check_model()
                if moved is not None:
                    dtype, p = moved
                    raise RuntimeError(
                        f"a model parameter of shape {tuple(p.shape)} is now {p.dtype} on {p.device}, but the "
                        f"accumulator was built for {dtype} on {self.device}: the model was moved or converted after the "
                        "GradientAccumulator was built (model.to(...), .float(), .cuda(), ...)")
            except RuntimeError as exc:
                self._model_error = (
                    f"{exc}. acc.zero_grad() cannot recover from this: the accumulator's buffers belong to the model "
                    "as it was. Call acc.close(), then build the optimizer and a new GradientAccumulator over the "
                    "model as it is now (move and convert the model first)")
        if self._model_error is not None:
            raise RuntimeError(self._model_error)

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.hooks.take_stale()
        self._grads_left = False

    def _reset_window(self) -> None:
        self.hooks.reset_window()
        self.window.reset()
        if self._noise is not None:
            self._noise.reset()

    # ------------------------------------------------------------------ lifecycle
    @property
    def num_micro_batches(self) -> int:
        """Micro-batches accumulated in the current window."""
        return self.window.num_micro_batches

    def zero_grad(self) -> None:
        """Drop the current window (its gradients, counts and loss) and any ``.grad`` left on the params.

        Always returns the accumulator to a clean window, after any error of ``backward()`` or ``step()`` (on
        several ranks it first waits for the all-reduces a failed last micro-batch had launched). It cannot
        undo moving or converting the model after construction: then build a new accumulator.
        """
        self.sharding.drain()
        if self.window.stats is not None:
            wait_quietly(self.window.stats.work)
        self.hooks.drop()
        self._clear_grads()
        self._reset_window()
        if self.hooks.arrival is not None:
            self.hooks.restart_learning()  # learn the order from a complete window
        if self.window_batchnorm is not None:
            self.window_batchnorm.reset()

    def state_dict(self) -> dict:
        """Everything needed to resume mid-window: accumulated buffer, counts, loss scale, bucket order, masters.

        Plain tensors (copied to CPU) and Python scalars: save with ``torch.save`` and load with
        ``torch.load(..., weights_only=True)``. Save the model's and the optimizer's state dicts beside it
        (the optimizer holds the master parameters after construction, so its own state dict covers them).

        At ``zero_stage >= 1`` (on any number of ranks) it also holds the optimizer's state, the master weights,
        the param groups' hyper-parameters and the ``lr_scheduler``, as ``gaengine.checkpoint.zero_state_dict``
        builds them for ``torch.distributed.checkpoint``: every rank calls it, and the model's and the
        accumulator's state dicts are then all a checkpoint needs::

            state = {"model": model.state_dict(), "acc": acc.state_dict()}
            dcp.save(state, checkpoint_id=path)
            # later, after building model, optimizer and accumulator again (any world size):
            state = {"model": model.state_dict(), "acc": acc.state_dict()}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"]); acc.load_state_dict(state["acc"])

        A state saved between windows loads on any world size and ``zero_stage >= 1``; one saved mid-window only
        on the same ones. Raises ``RuntimeError`` between the window's last ``backward`` and ``step()``.
        """
        self._pull_model_writes()  # the masters saved are the model's (after a model.load_state_dict())
        return self.sharding.state_dict(self)

    # The accumulator's own part of every state dict (the strategies' state dicts hold it, gaengine.sharding and
    # gaengine.checkpoint): what the window, the schedule, the loss scale, the noise scale and the hooks' learned
    # layout need to resume, as Python scalars and CPU tensors; checked, then restored, after the buffers.
    def scalars_state_dict(self) -> dict:
        """This rank's counters and small state: ``state_dict()`` without the buffers and the optimizer."""
        reg = {id(p): i for i, p in enumerate(self.registered_params)}
        return {
            "format": self.sharding.FORMAT,
            "param_shapes": [list(p.shape) for p in self.registered_params],
            "param_dtypes": [str(p.dtype) for p in self.registered_params],
            "accumulation_steps": self.accumulation_steps,
            "world_size": self.world_size,
            "layout_order": [reg[id(p)] for p in self.params],
            "arrival": self.hooks.arrival,
            "written": self.hooks.accumulated,
            "expected_arrivals": self.hooks.expected_arrivals,
            **self.window.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "consecutive_skips": self._consecutive_skips,
            **self.schedule.state_dict(),
            "noise_scale": (None if self._noise is None else
                            self._noise.state_dict(self.hooks, self.window.num_micro_batches)),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``; raises ``ValueError`` (changing nothing) if it was made for other parameters
        (at ``zero_stage >= 1``: ``gaengine.checkpoint.load_zero_state_dict``, also for a state saved mid-window on
        another world size, naming both)."""
        self.sharding.load_state_dict(self, state)

    def check_scalars_state(self, state: dict) -> None:
        """The checks of ``load_state_dict`` on ``scalars_state_dict()``'s part (``ValueError``, nothing changed)."""
        if (state["scaler"] is None) != (self.scaler is None):
            raise ValueError("state and this accumulator disagree on loss scaling (loss_scale differs)")
        if self._noise is not None:
            self._noise.check_state(state.get("noise_scale"), int(state["num_micro_batches"]))

    def load_scalars_state(self, state: dict) -> None:
        """Restore ``scalars_state_dict()``'s part (the layout and the buffers are restored before)."""
        if self._noise is not None:
            self.hooks.reset_window()  # no source norms of this accumulator's own window: the saved ones follow
        self.hooks.set_arrival(state["arrival"])
        self.hooks.set_all_accumulated(list(state["written"]))
        if "expected_arrivals" in state:  # absent from state dicts saved before it was learned
            self.hooks.set_expected_arrivals(list(state["expected_arrivals"]))
        self.window.load_state_dict(state)
        self._consecutive_skips = int(state["consecutive_skips"])
        self.schedule.load_state_dict(state, state["accumulation_steps"], self.window.num_micro_batches > 0)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self._noise is not None:
            self._noise.load_state_dict(state.get("noise_scale"), self.window.num_micro_batches)
        self._grads_left = True

    @property
    def effective_batch_size(self) -> int:
        """Samples per update: micro_batch_size x accumulation_steps x world size (needs micro_batch_size); with
        a schedule, the current window's."""
        if self.micro_batch_size is None:
            raise ValueError("effective_batch_size needs GradientAccumulator(..., micro_batch_size=...)")
        return self.micro_batch_size * self.accumulation_steps * self.world_size

    def _check_consecutive_skips(self, skipped: torch.Tensor, loss_scale: torch.Tensor | None) -> None:
        if not bool(skipped):  # host read: only with max_consecutive_skips set
            self._consecutive_skips = 0
            return
        self._consecutive_skips += 1
        if self._consecutive_skips < self.max_consecutive_skips:
            return
        names = {id(p): n for n, p in self.named_params}
        grads = self.sharding.grad_views()
        bad = [names.get(id(p), f"param[{i}]") for i, p in enumerate(self.params)
               if not bool(torch.isfinite(grads[i]).all())]
        scale = "none" if loss_scale is None else f"{float(loss_scale):g}"
        raise RuntimeError(
            f"{self._consecutive_skips} consecutive accumulation windows were skipped for non-finite gradients "
            f"(max_consecutive_skips={self.max_consecutive_skips}); loss scale {scale}; parameters with "
            f"non-finite gradients: {bad or 'none (the norm overflowed)'}"
        )

    def close(self) -> None:
        """Remove the hooks, drop the ``.grad`` the accumulator left on the parameters, and release them
        (another accumulator may then take them, and its first window holds only its own micro-batches).

        The parameters keep their values; re-pointed bf16/fp16 parameters stay views of the flat model buffer
        (kept alive by them), until another accumulator re-points them into its own. With ``optimizer=None``,
        read (or ``.clone()``) the gradients ``step()`` left in ``.grad`` before calling ``close()``.
        """
        for p in self.params:
            p.grad = None
        self._release()

    def _release(self) -> None:
        sharding = getattr(self, "sharding", None)  # None: the constructor raised before building it
        if sharding is None:
            return
        sharding.close()  # the hooks, the collectives in flight, the forward pre-hooks of overlap_param_gather
        if self.window_batchnorm is not None:
            self.window_batchnorm.close()
        for p in self.params:
            if getattr(p, _OWNER_ATTR, None) is not None and getattr(p, _OWNER_ATTR)() is self:
                delattr(p, _OWNER_ATTR)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._release()  # garbage collection leaves .grad alone: only an explicit close() drops it
        except Exception:
            pass
