"""The data-parallel sharding strategy: where the window's gradient lives, how it is reduced, and who updates what.

``GradientAccumulator`` runs one accumulation window the same way in every mode (``gaengine.engine``); what
differs between modes is behind one interface, ``ShardingStrategy`` (the field's name: FSDP's
``ShardingStrategy``, DeepSpeed's ZeRO stages), chosen once at construction by ``make_sharding``:

* ``Replicated``: every rank holds the whole fp32 ``main_grad``, the masters and the optimizer state; the window's
  last micro-batch all-reduces each bucket as it completes (torch DDP's schedule). One rank is this with nothing
  to reduce. The layout is re-learned from the first window's gradient arrival order.
* ``ZeroStage1`` (``zero_stage=1``): masters and optimizer state sharded; the last micro-batch reduce-scatters
  each bucket (``gaengine.zero``).
* ``ZeroStage2`` (``zero_stage=2``): the fp32 gradient sum sharded too; every micro-batch reduce-scatters into
  the rank's fp32 gradient shard through a ring of staging buffers (``gaengine.zero``).

A strategy lays the parameters out and builds, per layout, three parts, one per concern; the engine talks to
each part, never to the hooks, the reducer or the store behind them:

* ``accumulation`` (``gaengine.accumulation.Accumulation``): the layout and its hooks: ``params`` in layout order,
  ``main_grad``, this rank's views of the window's sums, and each micro-batch's start, end and failure, the
  parameters the window reached, the noise scale's source norms and the hooks' part of a state dict.
* ``reduction`` (``gaengine.reduce.Reduction``; ZeRO's ``gaengine.zero.ShardedReduction``/``StagedReduction``,
  FSDP2's ``gaengine.fsdp2.FullyShardedReduction``): what happens before and after each backward, the window's
  stats all-reduce (returned to the engine, which keeps it in its ``Window``), the reductions' completion, and the
  window's norm and non-finite flag (``gaengine.norm.window_norm``, the one norm of every mode).
* ``update`` (``Update``): the store's update (``gaengine.store.ParameterStore``: parameter buffers, masters,
  the optimizer's pieces) on this rank's gradient views, the parameters' all-gathers (ZeRO) and the scheduler; or,
  without an optimizer, the gradients left in ``.grad``.

What this rank holds of each parameter (its gradient views, the optimizer's pieces, the masters and their way into
the model, how pieces and gradients are wrapped) is the rank's layout, ``gaengine.rank_layout.RankLayout``, which the
strategy builds (``_new_rank_layout``: ``gaengine.zero.WholeParams``, ``gaengine.fsdp2.DTensorShards``, and at ZeRO
the layout class ``zero_layout_for(optimizer)`` chooses: ``gaengine.zero.EvenShards``, ``gaengine.zero.WholeOwners``
where the optimizer is not elementwise, or one registered with ``register_zero_layout``) and the store, the update
and the checkpoint ask (``rank_layout``). What a strategy
itself keeps is what is per mode: construction, building the layout and its parts (``_lay_out``,
re-learned from the arrival order at a window's end, ``end_window``), ``adopt`` (parameters joining or leaving),
its part of the state dict (the window's sums to save and how they load, ``window_sums``/``load_window_state``,
placed where the rank's layout says, ``RankLayout.window_chunks``; its meta, ``state_meta``; ``layout_to_resume``,
``optimizer_shards``, ``param_slots``) and ``close``;
``gaengine.checkpoint`` reads no mode flag of it. What the engine owns: the window (micro-batch count, items, loss
sum, which parameters it reached), the loss scale, the noise scale and the schedule.

A sharding strategy for FSDP2 models (sharded DTensor parameters whose reduce-scatter FSDP2 runs itself) is one
more implementation: its hooks write the reduce-scattered local shards, it has no reducer of its own, and its
reduction's norm and its update work on the local shards.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gaengine.accumulation import Accumulation
from gaengine.bucket import build_buckets
from gaengine.buffer import FlatBuffer, FlatLayout, copy_into, initial_order, learned_order
from gaengine.compat import composable_apis, reduce_scatter_single
from gaengine.formats import STATE_FORMAT
from gaengine.hooks import make_hooks
from gaengine.protocol import ANY_WINDOW, LAYOUT, open_phase
from gaengine.reduce import (BucketReducer, Collective, Reduction, broadcast_from_first_rank, collective_failed,
                             wait_for)
from gaengine.rank_layout import ParamSlot, RankLayout, WindowChunk
from gaengine.store import ParameterStore, reshard_state
from gaengine.update import expose_grads, step_scheduler
from gaengine.zero import (STAGING_SLOTS, EvenShards, ParamGather, ParamShard, ShardedReduction, ShardLayout,
                           ShardReducer, StagedReduction, WholeOwners, WholeParams, zero_order)

__all__ = ["Replicated", "ShardingStrategy", "Update", "ZeroStage1", "ZeroStage2", "make_sharding",
           "register_model_strategy", "register_zero_layout", "trainable_params", "zero_layout_for"]


class Update:
    """The update of one layout (module docstring), built by its strategy with each layout and each store.

    store: the ``gaengine.store.ParameterStore``, or None without an optimizer. accumulation: the layout
    (``gaengine.accumulation.Accumulation``: its ``shard_grads`` and ``chunks`` are what the store updates from).
    backend: the kernel backend (``scale_``). layout: the rank's layout (``gaengine.rank_layout.RankLayout``: the
    store's, or one the strategy builds without a store): how ``expose_grads`` wraps a parameter's local gradient and
    what it refuses. gather: the parameters' all-gathers after each update (``gaengine.zero.ParamGather``), or None.
    """

    def __init__(self, store: ParameterStore | None, accumulation: Accumulation, backend, layout: RankLayout,
                 gather: ParamGather | None = None) -> None:
        self.store = store
        self.accumulation = accumulation
        self.backend = backend
        self.layout = layout
        self.gather = gather
        if store is not None:  # the layout index of each of the store's parameters (its order is fixed)
            position = {id(p): i for i, p in enumerate(accumulation.params)}
            self._store_order = [position[id(p)] for p in store.params]

    def apply(self, coef: torch.Tensor, skipped: torch.Tensor, unwritten: list[int], lr_scheduler) -> None:
        """Run the optimizer on the window's gradient times ``coef`` (0-d fp32 on the device; skipped when
        ``skipped``, 0-d bool), write the model, step ``lr_scheduler``; a parameter in ``unwritten`` (layout
        indices) gets no update. One path for every strategy: the store's update
        (``gaengine.store.ParameterStore.update``) on this rank's gradient views, then the parameters' gathers, then
        the scheduler. Raises ``RuntimeError`` as the store's ``check_model``."""
        self.wait_gathers()
        grads: list[torch.Tensor | None] = list(self.accumulation.shard_grads)
        for i in unwritten:
            grads[i] = None
        applied = self.store.update([grads[i] for i in self._store_order], self.accumulation.chunks, coef, skipped,
                                    self.backend)
        if self.gather is not None:
            self.gather.launch()  # every bucket holding an optimized parameter; in flight with overlap_param_gather
            self.store.model_written()
        step_scheduler(lr_scheduler, applied, skipped)

    def expose_grads(self, coef: torch.Tensor, unwritten: list[int]) -> None:
        """No optimizer: ``main_grad`` scaled by ``coef`` in place (one pass) and left in ``p.grad``
        (``gaengine.update.expose_grads``: a view for an fp32 parameter, its rounding for a bf16/fp16 one, None for
        the parameters in ``unwritten``)."""
        main_grad = self.accumulation.main_grad
        self.backend.scale_(main_grad.data, coef)
        expose_grads(self.accumulation.params, main_grad, unwritten, wrap=self.layout.wrap)

    def pull_model_writes(self) -> None:
        """Model writes since the last update (``model.load_state_dict()``, in-place under ``torch.no_grad()``)
        reach the fp32 masters (``gaengine.store.ParameterStore.pull_model_writes``)."""
        if self.store is not None:
            self.store.pull_model_writes()

    def check_model(self) -> None:
        """``RuntimeError`` when re-pointed parameters left their flat buffers (the model was moved)."""
        if self.store is not None:
            self.store.check_model()

    def masters_to_model(self) -> None:
        """``GradientAccumulator.masters_to_model``: the model's writes since the last update reach the masters, then
        the masters' rounding goes into the model (nothing without masters). ``RuntimeError`` where the store holds
        1-D shards of the masters (``zero_stage`` >= 1 on several ranks: the update gathers them into the model)."""
        store = self.store
        if store is None or store.master_buffer is None:
            return
        self.layout.check_masters_to_model()
        store.pull_model_writes()  # a model write since the last update is kept, not overwritten
        store.copy_to_model()

    def check_release(self) -> None:
        """``ValueError`` unless the optimizer can be given back to the model (``close(release_optimizer=True)``): not
        where it holds 1-D shards (``zero_stage`` >= 1 on several ranks)."""
        if self.store is not None:
            self.layout.check_release()

    def release_to_model(self) -> None:
        """The optimizer given back to the model (``gaengine.store.ParameterStore.release_to_model``); nothing
        without one."""
        if self.store is not None:
            self.store.release_to_model()

    def wait_gathers(self) -> None:
        """Wait for the parameters' all-gathers still in flight (``overlap_param_gather``): the parameters whole."""
        if self.gather is not None:
            self.gather.wait()

    @property
    def writes_model(self) -> bool:
        """The optimizer rounds the masters into the model in its own pass (``gaengine.optim.FusedAdamW``)."""
        return self.store is not None and self.store.optimizer_writes_model


class ShardingStrategy(ABC):
    """What the accumulator does differently per data-parallel mode (module docstring). Built once.

    accumulation, reduction, update: the parts of the current layout (module docstring), built again with it.
    params, main_grad, hooks, reducer: the accumulation's parameters (layout order), ``main_grad`` (a
    ``(layout.total_numel,)`` fp32 ``FlatBuffer``, on ``meta`` where the sums live elsewhere: ``ZeroStage2``) and
    hooks, and the reduction's reducer (None on one rank). store: the ``gaengine.store.ParameterStore``, or None
    without an optimizer. master_buffer: the store's fp32 master weights (this rank's, a ``FlatBuffer``), or None.
    layout: the ``gaengine.zero.ShardLayout`` of the sharded strategies (None: ``Replicated``). gather: the
    parameters' all-gathers after each update (``gaengine.zero.ParamGather``), or None. rank_layout: what this rank
    holds of each parameter (``gaengine.rank_layout.RankLayout``; its ``sharded`` is recorded in a checkpoint's meta,
    ``state_meta``). reduction_type: the
    ``gaengine.reduce.Reduction`` class ``_lay_out`` builds.

    Built from the trainable ``params`` (registration order) and the ``optimizer`` (or None), with the
    accumulator's backend, device, process group and world size and the options of ``gaengine.AccumulatorConfig``
    it needs (``bucket_size_mb``, ``reduce_dtype``, ``master_weights``, ``overlap_param_gather``,
    ``broadcast_buffers``, ``gradient_accumulation_fusion``: the hooks take the fused Linears' gradients);
    ``measure_sources``: the hooks measure each micro-batch's gradient norm (the noise scale); ``model``: the module,
    for its buffers and forward pre-hooks, or None. Every strategy's state dict has one format
    (``gaengine.formats.STATE_FORMAT``). On several ranks the parameters (and, with ``broadcast_buffers``, the
    model's buffers) are broadcast from the group's first rank first.
    """

    name = "?"
    zero_stage = 0  # the ZeRO stage this implements (0: nothing sharded)
    adopts_params = False  # parameters joining or leaving after construction are laid out anew (adopt)
    fixed_layout = "lays its parameters out once, at construction (a plain model adopts it at every zero_stage)"
    """Why a parameter cannot join a strategy that does not adopt parameters, for the refusal's message."""
    reduction_type: type[Reduction] = Reduction

    accumulation: Accumulation
    reduction: Reduction
    update: Update
    store: ParameterStore | None = None
    master_buffer: FlatBuffer | None = None
    layout: ShardLayout | None = None
    gather: ParamGather | None = None

    params = property(lambda self: self.accumulation.params,
                      doc="The trainable parameters in layout order (the accumulation's).")
    main_grad = property(lambda self: self.accumulation.main_grad, doc="The window's fp32 sums (the accumulation's).")
    hooks = property(lambda self: self.accumulation.hooks, doc="The per-parameter hooks (the accumulation's).")
    reducer = property(lambda self: self.reduction.reducer, doc="The bucket reducer (the reduction's), or None.")

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None, *, backend,
                 device: torch.device, process_group: dist.ProcessGroup | None, world_size: int,
                 bucket_size_mb: float, reduce_dtype: torch.dtype, master_weights: bool,
                 measure_sources: bool, model: nn.Module | None = None, overlap_param_gather: bool = False,
                 broadcast_buffers: bool = True, gradient_accumulation_fusion: bool = False) -> None:
        if world_size > 1:  # every rank starts from the first rank's parameters (and buffers)
            broadcast_from_first_rank(self._shared_at_start(params, model if broadcast_buffers else None),
                                      process_group)
        self.optimizer = optimizer
        self.backend = backend
        self.device = device
        self.process_group = process_group
        self.world_size = world_size
        self.distributed = world_size > 1
        self.bucket_size_mb = bucket_size_mb
        self.reduce_dtype = reduce_dtype
        self.master_weights = master_weights
        self.measure_sources = measure_sources
        self.model = model
        self.overlap_param_gather = overlap_param_gather
        self.fusion = gradient_accumulation_fusion
        self.accumulation = None  # _lay_out builds it (the hooks' learned arrivals carry over from one to the next)
        self._frozen_masters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # _keep_frozen_masters

    def _shared_at_start(self, params: list[torch.Tensor], model: nn.Module | None) -> list[torch.Tensor]:
        """What every rank takes from the group's first rank at construction (several ranks): ``params`` and the
        buffers of ``model`` (None: without ``broadcast_buffers``)."""
        return list(params) + (list(model.buffers()) if model is not None else [])

    # ------------------------------------------------------------------ layout
    def _lay_out(self, order: list[torch.Tensor]) -> bool:
        """Lay ``order`` out: a new zeroed ``main_grad``, reducer, buckets and hooks, and the parts over them
        (``accumulation``, ``reduction``, ``update``; only between windows: the hooks' learned arrivals carry over).
        Returns whether the old hooks had a gradient left in ``.grad``."""
        main_grad = self._new_main_grad(order)
        reducer = self._new_reducer(main_grad) if self.distributed else None
        buckets = reducer.buckets if reducer is not None else build_buckets(main_grad.layout, self.bucket_size_mb)
        learning, expected, stale = True, {}, False
        if self.accumulation is not None:
            old = self.accumulation.hooks
            learning = self.accumulation.learning
            expected = {id(p): n for p, n in zip(old.params, old.expected_arrivals)}
            stale = old.take_stale()
            old.close()
        hooks = make_hooks(list(order), main_grad, self.backend, buckets, reducer,
                           measure_sources=self.measure_sources, acquire=self._acquire(reducer), fusion=self.fusion)
        if expected:  # arrivals per backward learned so far (a hook firing twice: reentrant checkpointing)
            hooks.set_expected_arrivals([expected.get(id(p), 1) for p in order])  # 1: a joined one
        if not learning:
            hooks.stop_learning()
        self.accumulation = Accumulation(list(order), main_grad, hooks, self.world_size, self.measure_sources,
                                         **self._new_rank_layout().grad_views(main_grad, reducer))
        self.reduction = self.reduction_type(reducer, self.accumulation, self.backend, self.process_group,
                                             self.world_size)
        self._build_update()
        return stale

    def _build_update(self) -> None:
        """The ``update`` over the current layout, store and gathers (after each of them is built)."""
        layout = self.store.layout if self.store is not None else self._new_rank_layout()
        self.update = Update(self.store, self.accumulation, self.backend, layout, self.gather)

    def _new_rank_layout(self) -> RankLayout:
        """A fresh ``gaengine.rank_layout.RankLayout`` of what this rank holds of the current layout's parameters (a
        store calls its ``hold``)."""
        return WholeParams()

    @property
    def rank_layout(self) -> RankLayout:
        """The rank's layout now (``gaengine.rank_layout.RankLayout``: the update's): what this rank holds of each
        parameter, how its pieces and gradients are wrapped, whether the optimizer state is sharded."""
        return self.update.layout

    @abstractmethod
    def _new_main_grad(self, params: list[torch.Tensor]) -> FlatBuffer:
        """A zeroed fp32 ``FlatBuffer`` over ``params`` (layout order) in this strategy's layout (``meta`` when
        layout only)."""

    def _new_reducer(self, main_grad: FlatBuffer) -> BucketReducer | None:
        """The reducer of ``main_grad``'s buckets over the process group (several ranks only), or None where the
        model reduces its gradients itself (FSDP2: ``gaengine.fsdp2``)."""
        return None

    def _acquire(self, reducer: BucketReducer | None):
        """The hooks' ``acquire(b)`` (a destination per bucket and micro-batch), or None: main_grad itself."""
        return None

    def set_layout(self, order: list[torch.Tensor]) -> bool:
        """Lay the parameters out in ``order`` (a resumed state's layout); returns ``_lay_out``'s stale flag.
        ``ValueError`` where the layout is fixed at construction and ``order`` differs."""
        if [id(p) for p in order] == [id(p) for p in self.params]:
            return False
        raise ValueError(f"{self.name}: the parameter layout is fixed at construction and cannot be changed")

    def adopt(self, params: list[torch.Tensor]) -> None:
        """Between windows, lay out ``params`` (the trainable parameters now, registration order) where the set of
        trainable parameters changed after construction (``adopts_params`` strategies only)."""
        raise NotImplementedError(f"{self.name} lays its parameters out once, at construction")

    def _keep_frozen_masters(self, params: list[torch.Tensor],
                             masters: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After a new store over ``params``: the whole fp32 masters of the parameters that left (frozen), from
        ``masters`` (``id`` -> (parameter, master)), are kept (a plain recipe's fp32 master copy keeps a frozen
        parameter's bits too); those of the parameters that join again go into the store (``keep_masters``)."""
        now = {id(p) for p in params}
        kept = {**self._frozen_masters, **{i: pm for i, pm in masters.items() if i not in now}}
        if self.store is not None:
            self.store.keep_masters({i: m for i, (_, m) in kept.items() if i in now})
        self._frozen_masters = {i: pm for i, pm in kept.items() if i not in now}

    def replaced_params(self) -> list[tuple[str, torch.Tensor]]:
        """``(name in the model, the parameter there now)`` of the parameters replaced where the model's slots do
        not tell (``gaengine.replaced``): none by default, the module's slots telling."""
        return []

    def forget(self, params: list[torch.Tensor]) -> None:
        """Drop what is kept for ``params``, parameters that left the model for good (replaced in it,
        ``gaengine.replaced``: they cannot join again as frozen ones can): their fp32 masters, each of which would
        otherwise keep its parameter and a whole fp32 copy alive across replacements."""
        for p in params:
            self._frozen_masters.pop(id(p), None)

    @staticmethod
    def _own_storage(before: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        """The parameters of ``before`` that left (not in ``params``) get their own storage (a copy of their values):
        a view of the old store's flat parameter buffer would keep that whole buffer alive while they are frozen."""
        now = {id(p) for p in params}
        with torch.no_grad():
            for p in before:
                if id(p) not in now and p.data._base is not None:
                    p.data = p.detach().clone()

    def end_window(self) -> bool:
        """After ``step()``: the hooks' window is reset (nothing written, no source partials) and, where the window
        learned the gradient arrival order (the first, and the first after an ``adopt``; ``Accumulation.drop``
        restarts the learning), ``_relearn_layout`` (a collective where the layout follows it). Returns whether a
        gradient was left in ``.grad`` by the old hooks."""
        self.accumulation.reset_window()
        return self._relearn_layout() if self.accumulation.learning else False

    def _relearn_layout(self) -> bool:
        """End of a window that learned the gradient arrival order (``end_window``): stop learning it and, where the
        layout follows it, lay the buffer out in it (rank 0's order on all ranks: a collective). Returns
        ``_lay_out``'s stale flag."""
        self.hooks.stop_learning()
        return False

    # ------------------------------------------------------------------ state dict
    # One format for every strategy (gaengine.checkpoint.accumulator_state_dict): what differs per strategy is what
    # its ranges of the parameters are (param_slots), the window's sums it saves and how they load (window_sums,
    # load_window_state; where they lie in the checkpoint is the rank layout's answer, RankLayout.window_chunks), which layout a resumed state goes on in (layout_to_resume), what the
    # meta records of it (state_meta) and where its optimizer's state lies (optimizer_shards). gaengine.checkpoint
    # asks these; it reads no flag of the strategy.
    FORMAT = STATE_FORMAT  # the tag of a state dict (gaengine.stages.StageStates.state_items)

    def finish_collectives(self) -> None:
        """Before a state dict reads the buffers: the parameters' gathers complete (``model.state_dict()`` views
        whole), and the reductions into a gradient shard."""
        self.update.wait_gathers()
        self.reduction.complete_for_state()

    def param_slots(self) -> list[ParamSlot]:
        """Per parameter (layout order), what this rank holds of it: its range, the optimizer's piece, whether it
        is optimized and has a master, and its fp32 gradient view (``gaengine.rank_layout.ParamSlot``; what
        ``gaengine.checkpoint`` reads)."""
        grads = self.accumulation.shard_grads
        out = []
        for i, p in enumerate(self.params):
            slot = (self.store.slots[self.store.index[id(p)]] if self.store is not None
                    else ParamSlot(p, 0, p.numel(), 0, None, False, False))
            out.append(dataclasses.replace(slot, grad=grads[i].view(-1)))
        return out

    def check_saveable(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Before a state dict is taken (``gaengine.checkpoint.accumulator_state_dict``): ``ValueError`` where this
        strategy cannot save ``optimizer``'s state by ranges; by default every optimizer saves."""

    def state_meta(self) -> dict[str, Any]:
        """This strategy's entries in a checkpoint's meta (``gaengine.checkpoint.accumulator_state_dict``):
        ``mode`` (its ``name``), and of the rank's layout ``sharded`` (the optimizer state is split over several ranks)
        and ``window_rows`` (each rank saves its own unreduced sums, one row per rank: ``RankLayout.window_rows``). A
        state saved mid-window resumes only where they and the world size are alike."""
        return {"mode": self.name, **self.rank_layout.state_meta()}

    def window_sums(self, mid_window: bool) -> list[WindowChunk]:
        """Per parameter (layout order), where the window's fp32 gradient sum lies in a checkpoint
        (``gaengine.store.WindowChunk``; ``gaengine.checkpoint`` wraps each in a ``FlatShard``, a template between
        windows), as the rank's layout places them (``RankLayout.window_chunks``: ``param_slots``' range ``[lo, hi)``
        of the flattened parameter, or this rank's row of unreduced sums). Mid-window the sums
        (``_window_sums_to_save``); between windows the gradient views (``dcp.load`` reads into them). A loading
        checkpoint takes the chunks where these say (``load_window_state``). Every rank calls it (``ZeroStage1``: a
        collective)."""
        slots = self.param_slots()
        sums = self._window_sums_to_save() if mid_window else [s.grad for s in slots]
        return self.rank_layout.window_chunks(slots, sums)

    def _window_sums_to_save(self) -> list[torch.Tensor]:
        """Mid-window, per parameter (layout order): the ``(hi - lo,)`` fp32 sum of the window's gradient over this
        rank's range that a checkpoint saves (``param_slots``' ranges): by default the gradient views themselves
        (one rank, a replicated run's own sums, ``ZeroStage2``'s reduced shard)."""
        return [g.view(-1) for g in self.accumulation.shard_grads]

    def load_window_state(self, sums: list[torch.Tensor], written: list[bool],
                          every_rank_written: list[list[bool]]) -> list[bool]:
        """Write a window saved mid-window into the gradient views: ``sums`` per parameter (layout order), the
        ``(hi - lo,)`` fp32 chunks ``window_sums`` placed (a chunk ``dcp.load`` already wrote in place is not
        copied). ``written``: this rank's saved written flags; ``every_rank_written``: every saving rank's, in rank
        order. Returns the written flags (layout order) the hooks resume with: by default this rank's."""
        for dst, src in zip(self.accumulation.shard_grads, sums, strict=True):
            copy_into(dst.view(-1), src)
        return written

    def layout_to_resume(self, saved: list[int], own: list[int]) -> list[int]:
        """The layout order (registration indices) a resumed state goes on in, given the ``saved`` one and this
        strategy's ``own``: by default its own (the layout is fixed at construction; a state saved between windows
        in another is remapped to it, one saved mid-window is refused). ``Replicated``: the saved one (its layout
        follows the gradient arrival order; ``set_layout`` lays it out)."""
        return own

    def optimizer_shards(self) -> tuple[list[list[ParamShard]], int] | None:
        """Where the optimizer's state lies over the ranks (``gaengine.full_optimizer_state_dict``): None where each
        rank's optimizer holds every parameter whole, numbered as the user built it (its ``state_dict()`` is the
        export); else, per rank of the process group, its ``gaengine.zero.ParamShard`` list and the ``shard_numel``
        of its flat shard."""
        return None

    def close(self) -> None:
        """Remove the hooks (and any forward pre-hooks), after the collectives in flight."""
        if self.accumulation is not None:
            self.accumulation.hooks.close()


class Replicated(ShardingStrategy):
    """Every rank holds everything; the window's last micro-batch all-reduces ``main_grad``'s buckets (one rank:
    no reduction). The store is the one-shard case (``gaengine.store.ParameterStore``): the optimizer keeps
    parameter-shaped pieces (fp32 masters of the bf16/fp16 parameters, the others themselves)."""

    name = "replicated (zero_stage=0)"
    adopts_params = True

    def __init__(self, params: list[torch.Tensor], optimizer, **kwargs) -> None:
        super().__init__(params, optimizer, **kwargs)
        self._lay_out(initial_order(params))
        if optimizer is not None:
            self.store = ParameterStore(optimizer, self.params, device=self.device, master_weights=self.master_weights,
                                        layout=self._new_rank_layout())
            self.master_buffer = self.store.master_buffer
            self._build_update()

    def _new_main_grad(self, params: list[torch.Tensor]) -> FlatBuffer:
        return FlatBuffer(FlatLayout.build(params), torch.float32, self.device)

    def _new_reducer(self, main_grad: FlatBuffer) -> BucketReducer:
        return BucketReducer(main_grad.data, main_grad.layout, self.bucket_size_mb, self.reduce_dtype,
                             self.process_group)

    def set_layout(self, order: list[torch.Tensor]) -> bool:
        if [id(p) for p in order] == [id(p) for p in self.params]:
            return False
        return self._lay_out(order)

    def adopt(self, params: list[torch.Tensor]) -> None:
        """A parameter joined (unfrozen, or in a group added with ``optimizer.add_param_group``) or left (frozen)
        between windows: everything built over the trainable parameters is built again over ``params``, as at
        construction: the layout, a zeroed ``main_grad``, the reducer and buckets, the hooks (the joined ones get
        theirs), the store (the optimizer given its model parameters back and re-pointed at new pieces; the fp32
        masters and the optimizer state of the parameters both layouts hold are kept). The next window learns the
        arrival order again and its end lays the buffer out in it (``_relearn_layout``), as the first window's.
        Several ranks: every rank must adopt alike (the joined parameters are broadcast from the first rank, as
        every trainable parameter is at construction)."""
        if self.distributed:
            old = {id(p) for p in self.params}
            broadcast_from_first_rank([p for p in params if id(p) not in old], self.process_group)
        optimized = self.store is not None
        if optimized:
            self.store.pull_model_writes()  # model writes since the last update reach the masters kept
        masters = self.store.release() if optimized else {}
        before = {id(p): p for p in self.params}
        self.store, self.master_buffer = None, None
        self._lay_out(initial_order(params))
        if optimized:
            self.store = ParameterStore(self.optimizer, self.params, device=self.device,
                                        master_weights=self.master_weights, layout=self._new_rank_layout())
            self.store.keep_masters(masters)
            self.master_buffer = self.store.master_buffer
            self._build_update()
        self._keep_frozen_masters(params, {i: (before[i], m) for i, m in masters.items()})
        self._own_storage(list(before.values()), params)
        self.hooks.restart_learning()

    def _relearn_layout(self) -> bool:
        arrival = self.hooks.arrival
        self.hooks.stop_learning()
        if self.distributed:  # the broadcast opens a phase of gaengine's collectives: its header first
            open_phase(LAYOUT, ANY_WINDOW, dist.get_world_size(self.process_group), dist.get_rank(self.process_group),
                       self.device if self.device.type == "cuda" else torch.device("cpu"), self.process_group)
        try:
            order = learned_order(arrival, len(self.params), self.device, distributed=self.distributed,
                                  group=self.process_group)
        except RuntimeError as exc:
            if not self.distributed:
                raise
            raise RuntimeError(collective_failed("broadcast of the first rank's layout order")) from exc
        if order == list(range(len(self.params))):
            return False
        return self._lay_out([self.params[i] for i in order])

    def _new_rank_layout(self) -> RankLayout:
        """``WholeParams``; on several ranks each rank's window sums are its own, unreduced until the window's last
        micro-batch, so a checkpoint saves them as its row of one per rank (``RankLayout.window_rows``)."""
        layout = WholeParams()
        if self.distributed:
            layout.window_rows = (dist.get_rank(self.process_group), self.world_size)
        return layout

    def layout_to_resume(self, saved: list[int], own: list[int]) -> list[int]:
        return saved  # the layout follows the arrival order: set_layout lays the saved one out


class _Zero(ShardingStrategy):
    """ZeRO stages 1 and 2 on several ranks (``gaengine.zero``): one ``ShardLayout`` for ``main_grad``, the reducer,
    the parameter buffers, the master shards and the optimizer pieces (the store over the rank's shard), and the
    parameters' all-gathers after each update (``gaengine.zero.ParamGather``). Built at construction, and again
    when parameters join or leave (``adopt``); never re-learned from the arrival order. Its rank layout is the class
    ``zero_layout_for(optimizer)`` (``layout_type``) over the ``ShardLayout`` that class plans."""

    staging_slots = 0  # the staging ring of a sharded gradient sum (ZeroStage2); 0: main_grad holds the sums

    @property
    def adopts_params(self) -> bool:
        """Parameters joining or leaving are laid out anew (``adopt``) where the layout class says so (even flat
        ranges); whole-matrix owners lay theirs out once (a joining parameter is refused naming it; a frozen one gets
        no gradient, so no update)."""
        return self.layout_type.adopts_params

    @property
    def fixed_layout(self) -> str:
        return self.layout_type.fixed_layout or super().fixed_layout

    def __init__(self, params: list[torch.Tensor], optimizer, **kwargs) -> None:
        super().__init__(params, optimizer, **kwargs)
        self.rank = dist.get_rank(self.process_group)
        self.layout_type = zero_layout_for(optimizer)
        self._build(zero_order(initial_order(params)))

    def _build(self, order: list[torch.Tensor]) -> None:
        """Everything over ``order`` (layout order, grouped by dtype): the layout, ``main_grad`` (and the gradient
        shard), the reducer, the hooks, the gradient views, the store (parameter buffers, masters, pieces) and the
        gathers. The store is built from the parameters' values: ``adopt`` moves the masters and the state after."""
        self.layout, order = _checked_plan(self.layout_type, order, self.bucket_size_mb, self.world_size)
        self._lay_out(order)
        self.store = ParameterStore(self.optimizer, self.params, device=self.device,
                                    master_weights=self.master_weights, layout=self._new_rank_layout())
        self.master_buffer = self.store.master_buffer
        buckets = [b for b in self.layout.buckets if any(self.store.optimized[b.first:b.last])]
        self.gather = ParamGather(self.store.param_buffers, self.layout, buckets, self.params, self.rank,
                                  self.process_group, self.reducer, self.overlap_param_gather, self.model)
        self.store.after_model_write = self._gather_model
        self._build_update()

    def _gather_model(self) -> None:
        """Every rank's part of the parameters on every rank, now: after an optimizer call outside ``step()`` wrote
        this rank's pieces (schedule-free's ``eval()`` / ``train()``; ``gaengine.store.PARAM_WRITERS``)."""
        self.gather.wait()
        self.gather.launch()
        self.gather.wait()
        self.store.model_written()

    def _new_rank_layout(self) -> RankLayout:
        return self.layout_type(self.layout, self.rank)  # zero_layout_for(optimizer), over plan's ShardLayout

    def adopt(self, params: list[torch.Tensor]) -> None:
        """A parameter joined (unfrozen, or in a group added with ``optimizer.add_param_group``) or left (frozen)
        between windows: everything is built again over ``params`` (the trainable parameters now, registration
        order) as at construction (``_build``: a new ``ShardLayout``, so every parameter's ranges may move to other
        ranks), then what the old layout held moves into the new one (``gaengine.store.reshard_state``: per old
        bucket, one all-gather per value): the fp32 masters and the optimizer state of the parameters both layouts
        hold, each rank taking its new ranges; a joined parameter starts with no state (torch creates it at its
        first update) unless the optimizer kept its state while it was frozen; a parameter that left keeps its
        state whole in ``optimizer.state[p]`` on every rank, as torch keeps a frozen parameter's, and its own copy
        of its values (it was a view of the old parameter buffer). The next window learns the arrivals per backward
        again, reducing after backward as the first one does. Every rank must adopt alike (the engine checks that
        first, ``gaengine.ownership.RankMembership``): joined parameters are broadcast from the first rank, as
        every trainable parameter is at construction. Collectives: the broadcast, one small all-reduce and the
        all-gathers, once per adoption."""
        self.update.wait_gathers()
        old = {id(p) for p in self.params}
        broadcast_from_first_rank([p for p in params if id(p) not in old], self.process_group)
        store = self.store
        store.pull_model_writes()  # model writes since the last update reach the masters that move
        states = store.release_shards()
        kept = {id(p): self.optimizer.state.pop(p) for p in params if id(p) not in old and p in self.optimizer.state}
        self.gather.close()  # its forward pre-hooks (overlap_param_gather), after anything in flight
        self.store = self.master_buffer = self.gather = None
        self._build(zero_order(initial_order(params)))
        left, masters = reshard_state(store, self.store, states, kept, self.process_group)
        self._own_storage(store.params, params)
        for p in store.params:
            if id(p) in left:
                self.optimizer.state[p] = left[id(p)]
        self._keep_frozen_masters(params, {id(p): (p, masters[id(p)]) for p in store.params if id(p) in masters})
        self.hooks.restart_learning()

    def _new_reducer(self, main_grad: FlatBuffer) -> BucketReducer:
        grad_shard = (torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.device)
                      if self.staging_slots else None)
        return ShardReducer(main_grad.data, self.layout, self.rank, self.reduce_dtype, self.process_group,
                            grad_shard, staging_slots=self.staging_slots)

    def optimizer_shards(self) -> tuple[list[list[ParamShard]], int]:
        self.rank_layout.check_export()
        return [self.layout.param_shards(r) for r in range(self.world_size)], self.layout.shard_numel

    def close(self) -> None:
        self.gather.close()  # the collectives in flight, and the forward pre-hooks of overlap_param_gather
        super().close()


class ZeroStage1(_Zero):
    """``zero_stage=1``: masters and optimizer state sharded; ``main_grad`` whole, reduce-scattered by the
    window's last micro-batch (``gaengine.zero.ShardedReduction``)."""

    name = "zero_stage=1"
    zero_stage = 1
    reduction_type = ShardedReduction

    def _new_main_grad(self, params: list[torch.Tensor]) -> FlatBuffer:
        return FlatBuffer(self.layout.layout, torch.float32, self.device)

    def _window_sums_to_save(self) -> list[torch.Tensor]:
        """Mid-window ``main_grad`` holds this rank's own unreduced sums while the rank owns only its shard of the
        update, so a checkpoint saves this rank's shard of the window's gradient summed over the ranks (a
        collective: every rank calls it): each bucket of ``main_grad`` is copied (the slices this rank did not write
        in this window zeroed: they hold an earlier window's values) and reduce-scattered in fp32 into a
        ``(shard_numel,)`` buffer; ``main_grad`` itself is not changed, so training goes on after the save. Views of
        it per parameter."""
        layout = self.layout
        written = self.accumulation.written
        out = torch.empty(layout.shard_numel, dtype=torch.float32, device=self.device)
        for b in layout.buckets:
            tmp = self.main_grad.data[b.start:b.end].clone()
            for i in range(b.first, b.last):
                if not written[i]:
                    o = layout.layout.offsets[i] - b.start
                    tmp[o:o + layout.layout.numels[i]].zero_()
            wait_for(Collective(reduce_scatter_single(), out[b.shard_offset:b.shard_offset + b.shard_numel], tmp,
                                group=self.process_group), f"reduce-scatter of the window's sums to save ({b.index})")
        return [out[s.shard_offset:s.shard_offset + s.numel] for s in layout.param_shards(self.rank)]

    def load_window_state(self, sums: list[torch.Tensor], written: list[bool],
                          every_rank_written: list[list[bool]]) -> list[bool]:
        """The saved sums are reduced over the ranks: the other ranks' ranges of ``main_grad`` hold nothing of them
        (zeroed), so the window's reduce-scatter adds each element once; every rank's range now holds the reduced
        sum of what any rank wrote, so the hooks resume with the written flags of every rank or-ed."""
        for b in self.layout.buckets:
            lo, hi = b.rank_range(self.rank)
            self.main_grad.data[b.start:lo].zero_()
            self.main_grad.data[hi:b.end].zero_()
        super().load_window_state(sums, written, every_rank_written)
        return [any(w[i] for w in every_rank_written) for i in range(len(self.params))]


class ZeroStage2(_Zero):
    """``zero_stage=2``: the fp32 gradient sum sharded; every micro-batch's buckets are staged in a ring,
    reduce-scattered and added into the rank's gradient shard (``gaengine.zero.StagedReduction``)."""

    name = "zero_stage=2"
    zero_stage = 2
    reduction_type = StagedReduction
    staging_slots = STAGING_SLOTS

    def _new_main_grad(self, params: list[torch.Tensor]) -> FlatBuffer:
        return FlatBuffer(self.layout.layout, torch.float32, torch.device("meta"))  # layout only

    def _acquire(self, reducer: BucketReducer | None):
        return reducer.acquire  # each bucket into a staging buffer of the ring


_ZERO_LAYOUTS: list[type[EvenShards]] = [EvenShards, WholeOwners]


def register_zero_layout(cls: type[EvenShards]) -> type[EvenShards]:
    """Register ``cls``, a rank layout for ``zero_stage`` 1 and 2 on several ranks (``gaengine.rank_layout.RankLayout``
    over a ``gaengine.zero.ShardLayout``: a subclass of ``gaengine.zero.EvenShards``, whose reduce-scatter, gradient
    shard, masters, all-gathers and checkpoint ranges it keeps), asked before those registered earlier and the
    built-in ones (``EvenShards`` for elementwise optimizers, then ``WholeOwners`` for any). ``cls`` answers, as
    classmethods, ``takes(optimizer) -> bool`` (it runs this optimizer) and ``plan(params, bucket_size_mb,
    world_size) -> (ShardLayout, params in its order)``; ``adopts_params`` and ``fixed_layout`` (whether joining
    parameters are laid out anew, and why not) and ``check_export()`` as ``EvenShards``'. The strategy builds
    ``cls(layout, rank)`` (``_Zero``); ``gaengine.store``, the update and ``gaengine.checkpoint`` only ask it. The
    registry is per process (every rank registers alike, before building the accumulator). Returns ``cls`` (a class
    decorator); registering a class twice keeps one entry. ``TypeError`` for a class that is not an
    ``EvenShards``."""
    if not (isinstance(cls, type) and issubclass(cls, EvenShards)):
        raise TypeError(f"register_zero_layout takes a subclass of gaengine.zero.EvenShards (a layout over a "
                        f"ShardLayout), got {cls!r}")
    if cls not in _ZERO_LAYOUTS:
        _ZERO_LAYOUTS.insert(0, cls)
    return cls


def _checked_plan(cls: type[EvenShards], params: list[torch.Tensor], bucket_size_mb: float,
                  world_size: int) -> tuple[ShardLayout, list[torch.Tensor]]:
    """``cls.plan(params, bucket_size_mb, world_size)``, checked before anything is built over it: ``ValueError``
    naming ``cls.plan`` unless it returns a ``ShardLayout`` of ``world_size`` ranks and every parameter once, laid
    out with its element count."""
    layout, order = cls.plan(params, bucket_size_mb, world_size)
    where = f"{cls.__name__}.plan (a layout registered with gaengine.sharding.register_zero_layout)"
    if not isinstance(layout, ShardLayout) or layout.world_size != world_size:
        raise ValueError(f"{where} must return a gaengine.zero.ShardLayout of world_size={world_size} and the "
                         f"parameters in its order, got {type(layout).__name__}")
    order = list(order)
    if sorted(map(id, order)) != sorted(map(id, params)) or len(order) != len(params):
        raise ValueError(f"{where} must return every one of the {len(params)} parameters once, in the layout's "
                         f"order; got {len(order)} tensor(s), not each of them once")
    if tuple(layout.layout.numels) != tuple(p.numel() for p in order):
        raise ValueError(f"{where}: its ShardLayout does not lay the returned parameters out in their order (element "
                         "counts differ); build it from that order (gaengine.zero.ShardLayout.build, owner_layout)")
    return layout, order


def zero_layout_for(optimizer) -> type[EvenShards]:
    """The layout class ``zero_stage`` 1 and 2 run ``optimizer`` on: the latest registered that ``takes`` it
    (``register_zero_layout``; built in: ``EvenShards`` for an elementwise optimizer, else ``WholeOwners``)."""
    return next(cls for cls in _ZERO_LAYOUTS if cls.takes(optimizer))


_MODEL_STRATEGIES: list[type[ShardingStrategy]] = []


def register_model_strategy(cls: type[ShardingStrategy]) -> type[ShardingStrategy]:
    """Register ``cls``, a ``ShardingStrategy`` chosen by the model rather than by ``zero_stage`` (a module that
    imports this one registers its own, so this module imports none of them). ``cls`` gives three classmethods:
    ``takes_model(model) -> bool``; ``check_taken_model(model, params)``, raising ``TypeError``/``ValueError`` for
    a model it takes but cannot accumulate exactly (called by ``trainable_params``); ``for_model(zero_stage,
    world_size, params, optimizer, **kwargs)``, the strategy (called by ``make_sharding``). Returns ``cls``, so it
    serves as a class decorator; registering a class twice keeps one entry."""
    if cls not in _MODEL_STRATEGIES:
        _MODEL_STRATEGIES.append(cls)
    return cls


def _model_strategy(model: nn.Module | None) -> type[ShardingStrategy] | None:
    """The first registered strategy that takes ``model``, or None."""
    if model is None:
        return None
    return next((cls for cls in _MODEL_STRATEGIES if cls.takes_model(model)), None)


_SHARDED_ADVICE = ("gaengine accumulates FSDP2 (fully_shard) models and plain modules; pass the plain model (gaengine "
                   "reduces across ranks itself, and zero_stage=1 or 2 shards the optimizer state and gradients), or "
                   "shard it with fully_shard (FSDP2)")


def _refuse_sharded(model: nn.Module | None, params: list[torch.Tensor]) -> None:
    """``TypeError``/``ValueError`` for a sharded model gaengine cannot accumulate exactly, each of which would
    train nothing or wrongly under gaengine's hooks, silently: FSDP1 (``FullyShardedDataParallel``: its
    reduce-scatter runs from hooks on the same AccumulateGrad nodes), the composable ``replicate``, DTensor
    parameters that ``fully_shard`` did not make (tensor parallelism, other meshes), and the FSDP2 models
    ``gaengine.fsdp2.check_fsdp2_model`` refuses (a root that is not an ``FSDPModule``, a mix of sharded and plain
    trainable parameters, ``CPUOffloadPolicy``, HSDP). A supported FSDP2 model passes (``gaengine.fsdp2``)."""
    if not dist.is_available():
        return
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel  # noqa: PLC0415 - distributed exists
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    fsdp2 = False
    for name, module in (model.named_modules() if model is not None else ()):
        where = f"model.{name}" if name else "model"
        if isinstance(module, FullyShardedDataParallel):
            raise TypeError(f"{where} is wrapped in FullyShardedDataParallel (FSDP1): it reduce-scatters FlatParameter "
                            "gradients in its own hooks on the AccumulateGrad nodes gaengine hooks, so gradients would "
                            "be lost or never reduced. Use fully_shard (FSDP2), or pass the bare module with "
                            "zero_stage=2")
        apis = composable_apis(module)
        if isinstance(module, FSDPModule) and apis <= {"fully_shard"}:
            fsdp2 = True
        elif isinstance(module, FSDPModule) or apis:
            raise TypeError(f"{where} is managed by torch.distributed composable API(s) {sorted(apis)}. "
                            f"{_SHARDED_ADVICE}")
    if fsdp2:
        strategy = _model_strategy(model)
        if strategy is None:
            raise TypeError("model is an FSDP2 (fully_shard) model, but no sharding strategy for it is registered: "
                            "import gaengine (its __init__ imports gaengine.fsdp2, which registers FullyShardedGrads)")
        strategy.check_taken_model(model, params)
        return
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if dtensors:
        raise TypeError(f"model has {len(dtensors)} DTensor parameter(s) that fully_shard did not make (the first of "
                        f"global shape {tuple(dtensors[0].shape)}, placements {tuple(dtensors[0].placements)}, "
                        "e.g. tensor parallelism or a model passed as a list of parameters); gaengine supports only "
                        "FSDP2 (fully_shard) data-parallel sharding, passed as the module. " + _SHARDED_ADVICE)


# Gradient-reducing wrappers found by class name (their packages are not imported here): Megatron-Core's and apex's
# DistributedDataParallel, DeepSpeed's engine. torch's DDP (and its subclasses) by type; FSDP1: _refuse_sharded.
_REDUCING_WRAPPERS = {"DistributedDataParallel", "DeepSpeedEngine"}


def _refuse_reducing_wrappers(model: nn.Module) -> None:
    """``TypeError`` naming the module path of the first gradient-reducing wrapper anywhere in ``model``'s tree (the
    root included): torch's ``DistributedDataParallel`` and subclasses, and modules of that class name or
    ``DeepSpeedEngine``. Its reducer would all-reduce the gradients gaengine frees in its hooks (zeros, or
    twice-reduced ones), silently; gaengine reduces across ranks itself. Lightning Fabric's ``_FabricModule`` keeps
    the DDP of ``strategy="ddp"`` in ``_forward_module``: the message then names ``gaengine.integrations.fabric``."""
    for name, module in model.named_modules():
        if not (isinstance(module, nn.parallel.DistributedDataParallel)
                or type(module).__name__ in _REDUCING_WRAPPERS):
            continue
        where = f"model.{name}" if name else "model"
        kind = f"{type(module).__module__}.{type(module).__name__}"
        fabric = type(model).__name__ == "_FabricModule"
        raise TypeError(
            f"{where} is a {kind}, a wrapper that reduces gradients across ranks in its own hooks: gaengine frees each "
            "gradient in its hook as soon as it is accumulated and reduces the window across ranks itself, so both "
            "reductions would run (or DDP's on freed gradients), silently training off the recipe. "
            + ("This is Lightning Fabric's model set up under a DDP strategy: use "
               "Fabric(strategy=gaengine.integrations.fabric.GaengineStrategy(accumulation_steps=K)) "
               "(docs/integrations/fabric.md), or leave the model out of fabric.setup (Fabric for the launch and the "
               "data only) and give GradientAccumulator the bare model"
               if fabric else
               f"Pass the module it wraps ({where}.module) instead, unwrapped, or the model built around it without "
               "the wrapper"))


def trainable_params(model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of ``model`` (a module or an iterable of tensors) that require grad, in registration order,
    checked: one device, fp32 | bf16 | fp16, no sparse gradients, no gradient-reducing wrapper (DDP) anywhere in the
    module tree, no sharded model (``TypeError`` or ``ValueError`` naming what was found and what to do)."""
    if isinstance(model, nn.Module):
        _refuse_reducing_wrappers(model)
        for name, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
                raise ValueError(
                    f"model.{name or 'self'} produces sparse gradients (sparse=True); gaengine accumulates dense "
                    "gradients into a flat fp32 buffer: build the embedding with sparse=False"
                )
        candidates = model.parameters()
    else:
        candidates = model
    params, seen = [], set()
    for p in candidates:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"model must be an nn.Module or an iterable of Parameters, got an element of type {type(p).__name__}")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    _refuse_sharded(model if isinstance(model, nn.Module) else None, params)
    if not params:
        raise ValueError("model has no trainable parameters (none with requires_grad=True)")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"model parameters must all be on one device, found {sorted(map(str, devices))}")
    bad = [p for p in params if not p.is_floating_point() or p.dtype == torch.float64]
    if bad:
        raise ValueError(f"model parameters must be float32, bfloat16 or float16, found {bad[0].dtype}")
    return params


def make_sharding(zero_stage: int, world_size: int, params: list[torch.Tensor], optimizer,
                  **kwargs) -> ShardingStrategy:
    """The strategy for ``zero_stage`` on ``world_size`` ranks: a model that a registered strategy takes
    (``register_model_strategy``: an FSDP2 model gets ``gaengine.fsdp2.FullyShardedGrads``, which raises
    ``ValueError`` with ``zero_stage > 0``) gets that one; a world of one shards nothing (``Replicated``, whose state
    dict has the one format of every strategy, so it loads a sharded run's)."""
    strategy = _model_strategy(kwargs.get("model"))
    if strategy is not None:
        return strategy.for_model(zero_stage, world_size, params, optimizer, **kwargs)
    if zero_stage == 0 or world_size == 1:
        return Replicated(params, optimizer, world_size=world_size, **kwargs)
    cls = ZeroStage1 if zero_stage == 1 else ZeroStage2
    return cls(params, optimizer, world_size=world_size, **kwargs)
