"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models: fp32 accumulation of FSDP2's reduce-scattered shards.

FSDP2 shards every parameter over the data-parallel ranks (ZeRO-3) and reduce-scatters each micro-batch's
gradient itself (sync every micro-batch, its default). It then calls each sharded parameter's Python
post-accumulate-grad hooks itself, right after it assigned the shard to ``.grad`` (torch
``fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``; the sharded DTensor parameters never enter
autograd, so hooks on their AccumulateGrad nodes never fire). ``FullyShardedGrads`` is the sharding strategy
(``gaengine.sharding.ShardingStrategy``) built on that hook:

* **Hooks** (``make_shard_hooks``: ``NativeShardHooks``, the core of the one native hot path, ``csrc/hot_path.cpp``'s
  ``HotPathCore``, each Python hook FSDP2 calls handing the shard to ``HotPathCore.arrive``): each hook adds
  ``p.grad.to_local()`` (this rank's shard of the micro-batch's reduced gradient, in the sharded parameter's dtype)
  into one flat fp32
  ``main_grad`` laid out over the local shards (local numels, possibly 0) and sets ``p.grad = None``. A bucket is
  one FSDP2 parameter group: its hooks fire back to back in one ``foreach_reduce``, so a group costs one
  accumulate launch, on the stream FSDP2 runs them on (its ``post_reduce_stream`` on CUDA, before it records the
  event ``finalize_backward`` waits on). The parameters are never re-pointed (FSDP2 all-gathers from their
  storage).
* **Normalization.** FSDP2 divides each reduced gradient by its divide factor ``f`` (the data-parallel size d by
  default, its ``ReduceOp.AVG``; ``set_gradient_divide_factor`` changes it), so ``main_grad`` holds the window's
  raw sum over ranks and micro-batches divided by ``f``; the engine's denominator (micro-batches x d in mean mode,
  the global item count in item mode) is divided by ``f`` once in the norm
  (``FullyShardedReduction.norm``; exact for partial windows and schedules, no look-ahead over the window).
* **Noise scale** (``measure_noise_scale``): the hooks measure each micro-batch's local shard as they accumulate
  it; the small batch is the global micro-batch, whose terms are summed over ranks before they are combined
  (``gaengine.noise.WindowNoise.global_terms``).
* **Step.** One pass over the local buffer for the sum of squares and the non-finite flag at the end of the last
  backward, summed over the ranks in the window's one stats all-reduce (with the loss, the item count, the
  per-rank micro-batch counts and the noise-scale terms), the norm, clip coefficient and skip flag on the device; the user's optimizer runs over the DTensor
  parameters with ``.grad`` set to DTensor views of the buffer (a fused torch optimizer takes the coefficient and
  the skip flag as ``grad_scale``/``found_inf``). fp32 sharded parameters are their own masters; bf16/fp16 ones
  get an fp32 master shard (a DTensor over a view of one flat ``master_buffer``) that the optimizer updates, its
  rounding copied into the parameter's local shard in place.

What is refused (``check_fsdp2_model``, ``TypeError``/``ValueError`` at construction, on any world size): a root
that is not an ``FSDPModule``, trainable parameters ``fully_shard`` does not manage, ``CPUOffloadPolicy``, HSDP
(2-D meshes) and other meshes than the accumulator's group, ``replicate()``; in ``FullyShardedGrads``:
``zero_stage > 0``, ``reduce_dtype`` other than fp32 (FSDP2's ``MixedPrecisionPolicy.reduce_dtype`` sets the
wire), ``overlap_param_gather`` and ``gaengine.optim.FusedAdamW``. A model whose
gradient sync was turned off behind the accumulator's back (``set_requires_gradient_sync(False)``,
``set_requires_all_reduce(False)``) is refused at the next ``backward()`` (``RuntimeError``).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch import nn

from gaengine.bucket import Bucket
from gaengine.buffer import FlatBuffer, FlatLayout
from gaengine.compat import composable_apis, fsdp_param_groups
from gaengine.accumulation import Accumulation
from gaengine.norm import WindowNorm, local_sum_sq, window_norm
from gaengine.hooks import check_native_hooks
from gaengine.hot_path import NativeHooks
from gaengine.optimizers import elementwise_names, is_elementwise, writes_model_params
from gaengine.reduce import BackwardStart, Reduction, WindowStats, launch_window_stats
from gaengine.sharding import ShardingStrategy, register_model_strategy
from gaengine.rank_layout import Mastered, ParamSlot, RankLayout, copy_all
from gaengine.store import ParameterStore

__all__ = ["DTensorShards", "FullyShardedGrads", "FullyShardedReduction", "NativeShardHooks", "check_fsdp2_model", "make_shard_hooks", "fsdp2_param_groups", "is_fsdp2_model"]


def is_fsdp2_model(model: nn.Module | None) -> bool:
    """Whether ``model`` or one of its submodules is an FSDP2 module (``fully_shard``)."""
    if model is None or not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - only when distributed exists

    return any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp2_param_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups of ``model`` (``FSDPParamGroup``, one per ``fully_shard`` call that holds
    parameters), in module registration order. Reads FSDP2's state through ``FSDPModule._get_fsdp_state()``."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups.extend(g for g in fsdp_param_groups(module._get_fsdp_state()) if g.fsdp_params)
    return groups


def check_fsdp2_model(model: nn.Module, params: list[torch.Tensor]) -> None:
    """``TypeError``/``ValueError`` for an FSDP2 model gaengine cannot accumulate exactly (module docstring);
    ``params``: the model's trainable parameters."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule  # noqa: PLC0415
    from torch.distributed.fsdp._fully_shard._fsdp_param import HSDPMeshInfo  # noqa: PLC0415

    for name, module in model.named_modules():
        others = sorted(composable_apis(module) - {"fully_shard"})
        if others:
            raise TypeError(f"model.{name or 'self'} is managed by torch.distributed composable API(s) {others} "
                            "besides fully_shard; gaengine accumulates only FSDP2 (fully_shard) data-parallel "
                            "sharding: apply fully_shard alone")
    if not isinstance(model, FSDPModule):
        raise TypeError(f"model is a {type(model).__name__} whose submodules use FSDP2 (fully_shard), but the root "
                        "is not an FSDPModule: call fully_shard(model) on the root as well (after the per-block "
                        "fully_shard calls), so that every trainable parameter is sharded by FSDP2")
    groups = fsdp2_param_groups(model)
    managed = {id(fp.sharded_param) for g in groups for fp in g.fsdp_params}
    plain = [p for p in params if id(p) not in managed]
    if plain:
        names = {id(p): n for n, p in model.named_parameters()}
        raise TypeError(f"model mixes FSDP2-sharded and plain trainable parameters: {len(plain)} are not managed by "
                        f"fully_shard (the first: {names.get(id(plain[0]), tuple(plain[0].shape))!s}). FSDP2 reduces "
                        "only its own parameters' gradients, so these would never be averaged across ranks: call "
                        "fully_shard(model) on the root as well, or freeze them (requires_grad=False)")
    for g in groups:
        for fp in g.fsdp_params:
            if fp.offload_to_cpu:
                raise ValueError(f"model.{fp._param_fqn} is sharded with offload_policy=CPUOffloadPolicy(): gaengine "
                                 "accumulates FSDP2's gradient shards on the parameters' device and does not support "
                                 "CPU offload; build fully_shard without offload_policy")
        if isinstance(g.mesh_info, HSDPMeshInfo):
            raise ValueError(f"model.{g._module_fqn or 'self'} is sharded over a 2-D mesh (HSDP: replicate and shard "
                             "dims); gaengine supports FSDP2 over a 1-D data-parallel mesh only: build fully_shard "
                             "with a 1-D DeviceMesh")
    del CPUOffloadPolicy


class DTensorShards(RankLayout):
    """The rank's layout of FSDP2 models (``gaengine.rank_layout.RankLayout``): every parameter a DTensor
    (``fully_shard``) whose local shard this rank holds, in storage FSDP2 owns (never re-pointed: FSDP2 all-gathers
    from it). Nothing is laid out: a piece is shaped like its parameter (its DTensor, or an fp32 master DTensor over a
    view of ``master_buffer``, one fp32 buffer over the local shards of the bf16/fp16 parameters the optimizer holds,
    with the parameter's mesh, placements, global shape and stride), the gradients are shaped like the local shards
    and wrapped the same way, and the masters are rounded into the local shards, found afresh each time (FSDP2 may
    give a parameter a new local tensor, ``reset_sharded_param``)."""

    sharded = True

    def hold(self, params, optimized, mastered, device):
        self.param_buffers = {}  # FSDP2 owns the parameters' storage: nothing is laid out
        low = [p for p, opt in zip(params, optimized) if opt and p.dtype in mastered]
        master_of: dict[int, torch.Tensor] = {}
        if low:  # one fp32 buffer over their local shards (a local shard may be empty), their exact fp32 values
            locals_ = [self.local(p) for p in low]
            self.master_buffer = FlatBuffer(FlatLayout.build(locals_), torch.float32, device)
            copy_all(self.master_buffer.views, locals_)
            master_of = {id(p): v for p, v in zip(low, self.master_buffer.views)}
        slots, entries = [], []
        for p, opt in zip(params, optimized):
            master = id(p) in master_of
            piece = None
            if master:
                piece = nn.Parameter(self.wrap(p, master_of[id(p)]), requires_grad=True)
                entries.append(Mastered(p, piece, master_of[id(p)], None))
            elif opt:
                piece = p
            slots.append(ParamSlot(p, 0, self.local(p).numel(), 0, piece, opt, master))
        return slots, entries

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s local shard now (``to_local()``), or ``t`` where it is not a DTensor (a piece's plain state)."""
        return t.to_local() if hasattr(t, "to_local") else t

    def grad_wrapper(self):
        """``wrap``: each piece's gradient a DTensor over the local shard (``RankLayout.grad_wrapper``)."""
        return self.wrap

    def wrap(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A DTensor over ``local`` (this rank's shard, shaped like ``p``'s) laid out like ``p``; no communication."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - only for FSDP2 models

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def model_views(self, mastered):
        return [self.local(m.param) for m in mastered]

    def version_tensors(self, mastered):
        return self.model_views(mastered)


def _local_shard(param: torch.Tensor) -> torch.Tensor | None:
    """Take ``param.grad`` (FSDP2's reduced shard) from the parameter and return its local tensor, or None: the
    parameter lets go of it (FSDP2 assigns a fresh ``.grad`` on the next synced micro-batch)."""
    grad = param.grad
    if grad is None:
        return None
    param.grad = None
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    if local.is_cuda:  # the shard came from FSDP2's reduce-scatter stream; the bucket's accumulate reads it on
        local.record_stream(torch.cuda.current_stream())  # this one (post_reduce_stream): no early reuse
    return local


class NativeShardHooks(NativeHooks):
    """``gaengine.hot_path.NativeHooks`` over FSDP2's sharded parameters (``params``: DTensors, layout order): the
    core of the one hot path (``csrc/hot_path.cpp``'s ``HotPathCore``, no AccumulateGrad hooks), over the local
    shards' layout. FSDP2 calls a Python post-accumulate-grad hook per parameter after its reduce-scatter (the
    sharded parameters never enter autograd); the hook hands the local shard to ``HotPathCore.arrive``, which holds
    and accumulates it as ``HotPath``'s AccumulateGrad hooks do: one launch per complete bucket (an FSDP2 parameter
    group) into ``main_grad``. There is no reducer (FSDP2 reduces), and no gradient accumulation fusion (refused
    for FSDP2 models, ``gaengine.fusion``)."""

    hot_path_class = "HotPathCore"

    def __init__(self, params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
                 measure_sources: bool = False, divide_factor=lambda: 1.0) -> None:
        super().__init__([p.to_local() for p in params], main_grad, backend, buckets, None, measure_sources)
        self._divide_factor = divide_factor
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(ref, i)) for i, p in enumerate(params)]

    @staticmethod
    def _make_hook(ref: weakref.ref, i: int):
        def hook(param: torch.Tensor) -> None:
            hooks = ref()
            local = _local_shard(param) if hooks is not None else None
            if local is not None:
                hooks.arrive(i, local)

        return hook

    def arrive(self, index: int, grad: torch.Tensor) -> None:
        """Parameter ``index``'s gradient (its local shard's shape, on its device), handed over as ``HotPath``'s
        AccumulateGrad hook hands ``p.grad`` over (``HotPathCore.arrive``: ``ValueError`` for another shape or
        device, ``IndexError`` for an index out of range)."""
        self._hot.arrive(index, grad)

    @property
    def sources_reduced_by(self) -> float:
        """f: what the hooks accumulate (and measure, ``measure_sources``) is this rank's shard of each micro-batch's
        gradient summed over the ranks and divided by f, FSDP2's divide factor (``gaengine.noise.WindowNoise``
        takes the global micro-batch as the small batch)."""
        return self._divide_factor()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().close()


def make_shard_hooks(params: list[torch.Tensor], main_grad: FlatBuffer, backend, buckets: list[Bucket],
                     measure_sources: bool = False, divide_factor=lambda: 1.0) -> NativeShardHooks:
    """The hooks over FSDP2's sharded parameters (``NativeShardHooks``); ``RuntimeError`` when the native hooks
    cannot run (``gaengine.hooks.check_native_hooks``)."""
    check_native_hooks(backend)
    return NativeShardHooks(params, main_grad, backend, buckets, measure_sources, divide_factor)


@register_model_strategy
class FullyShardedGrads(ShardingStrategy):
    """FSDP2 models (module docstring): ``main_grad`` over the local shards, FSDP2's reduce-scatter output
    accumulated by ``NativeShardHooks``, the window's norm summed over the ranks in its stats all-reduce
    (``FullyShardedReduction``), the update over the DTensor parameters (``gaengine.sharding.Update``, its
    gradients wrapped as DTensors).

    params: the trainable sharded parameters (``check_fsdp2_model`` passed), the model (an ``FSDPModule`` root) as
    ``model``. main_grad: ``(sum of local numels, aligned)`` fp32 on the parameters' device. master_buffer: the
    fp32 master shards of the bf16/fp16 parameters the optimizer holds (``master_weights=True``), or None.
    Raises ``ValueError`` naming the option for ``reduce_dtype`` other than fp32, ``overlap_param_gather``,
    ``gaengine.optim.FusedAdamW``, and a process group whose size is not FSDP2's shard group's.
    ``measure_noise_scale`` (``measure_sources``): the hooks measure each micro-batch's local shard, and the small
    batch is the global micro-batch (``gaengine.noise.WindowNoise.global_terms``).
    """

    name = "fsdp2 (fully_shard)"

    @classmethod
    def takes_model(cls, model: nn.Module | None) -> bool:
        """Whether ``model`` is an FSDP2 model (``gaengine.sharding.register_model_strategy``)."""
        return is_fsdp2_model(model)

    @classmethod
    def check_taken_model(cls, model: nn.Module, params: list[torch.Tensor]) -> None:
        """``check_fsdp2_model``: the FSDP2 models this strategy cannot accumulate exactly are refused."""
        check_fsdp2_model(model, params)

    @classmethod
    def for_model(cls, zero_stage: int, world_size: int, params: list[torch.Tensor], optimizer,
                  **kwargs) -> FullyShardedGrads:
        """The strategy of an FSDP2 model (``gaengine.sharding.make_sharding``); ``ValueError`` for
        ``zero_stage > 0``."""
        if zero_stage:
            raise ValueError(f"zero_stage={zero_stage} with an FSDP2 (fully_shard) model: FSDP2 already shards the "
                             "parameters, gradients and optimizer state, and gaengine accumulates its reduce-scattered "
                             "shards; leave zero_stage=0")
        return cls(params, optimizer, world_size=world_size, **kwargs)

    def __init__(self, params: list[torch.Tensor], optimizer, *, world_size: int, model: nn.Module,
                 broadcast_buffers: bool = True, **kwargs) -> None:
        super().__init__(params, optimizer, world_size=world_size, model=model, broadcast_buffers=broadcast_buffers,
                         **kwargs)
        if self.reduce_dtype != torch.float32:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} has no effect on an FSDP2 model: FSDP2 runs the "
                             "reduce-scatter in its MixedPrecisionPolicy's reduce_dtype. Leave reduce_dtype at "
                             "torch.float32 and build fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=..., "
                             "reduce_dtype=torch.bfloat16)) for a bf16 wire (gaengine still accumulates in fp32)")
        if self.overlap_param_gather:
            raise ValueError("overlap_param_gather=True is a zero_stage option; FSDP2 all-gathers the parameters "
                             "itself (its forward prefetching): leave overlap_param_gather off")
        if optimizer is not None and writes_model_params(optimizer):
            raise ValueError("optimizer is a gaengine.optim.FusedAdamW, which updates flat parameter pieces, not "
                             "FSDP2's DTensor parameters: use torch.optim.AdamW(..., fused=True) (it takes "
                             "gaengine's coefficient and skip flag as grad_scale/found_inf, with no extra pass)")
        self.groups = fsdp2_param_groups(model)
        sizes = {g.mesh_info.shard_mesh_size for g in self.groups}
        if sizes != {world_size}:
            raise ValueError(f"process_group has {world_size} rank(s) but the model is sharded over "
                             f"{sorted(sizes)} rank(s): pass process_group= the group of fully_shard's mesh "
                             "(mesh.get_group())")

        # Layout: FSDP2's groups in reverse registration order (the order backward reduces them), each a bucket.
        trainable = {id(p) for p in params}
        order, bounds = [], []
        for g in reversed(self.groups):
            mine = [fp.sharded_param for fp in g.fsdp_params if id(fp.sharded_param) in trainable]
            if mine:
                bounds.append((len(order), len(order) + len(mine)))
                order.extend(mine)
        self._sharded = [(fp, fp.sharded_param) for g in self.groups for fp in g.fsdp_params
                         if id(fp.sharded_param) in trainable]  # replaced_params
        main_grad = self._new_main_grad(order)
        layout = main_grad.layout
        offsets = list(layout.offsets) + [layout.total_numel]
        buckets = [Bucket(b, first, last, offsets[first], offsets[last]) for b, (first, last) in enumerate(bounds)]
        hooks = make_shard_hooks(order, main_grad, self.backend, buckets, self.measure_sources,
                                 divide_factor=self._divide_factor)
        self.accumulation = Accumulation(order, main_grad, hooks, world_size, self.measure_sources)
        self.reduction = FullyShardedReduction(self.accumulation, self.backend, self.process_group, world_size,
                                               self.groups, self._divide_factor)
        if optimizer is not None:  # the optimizer over the DTensor parameters, or their fp32 master DTensors
            self.store = ParameterStore(optimizer, self.params, device=self.device, master_weights=self.master_weights,
                                        layout=self._new_rank_layout())
            self.master_buffer = self.store.master_buffer
        self._build_update()

    def replaced_params(self) -> list[tuple[str, torch.Tensor]]:
        """The trainable sharded parameters FSDP2 holds as other objects than at construction
        (``model.load_state_dict(sd, assign=True)``: FSDP2's load hook takes the new DTensor as its sharded parameter,
        ``FSDPParam.reset_sharded_param``), each ``(name in the model, the new parameter)``; ``gaengine.replaced``
        refuses them (this strategy lays its parameters out once). A layer swapped for a new module is no FSDP2
        parameter: its slot tells."""
        prefix = {id(m): n for n, m in self.model.named_modules()}
        out = []
        for fp, p in self._sharded:
            if fp.sharded_param is not p:
                module, leaf = fp._module_info.module, fp._module_info.param_name
                out.append((f"{prefix[id(module)]}.{leaf}" if prefix.get(id(module)) else leaf, fp.sharded_param))
        return out

    def _shared_at_start(self, params: list[torch.Tensor], model: nn.Module | None) -> list[torch.Tensor]:
        """FSDP2's shards differ per rank by construction: only the model's buffers are broadcast."""
        return list(model.buffers()) if model is not None else []

    # ------------------------------------------------------------------ layout
    def _new_rank_layout(self) -> RankLayout:
        return DTensorShards()

    def _new_main_grad(self, params: list[torch.Tensor]) -> FlatBuffer:
        return FlatBuffer(FlatLayout.build([p.to_local() for p in params]), torch.float32, self.device)

    # ------------------------------------------------------------------ step
    def _divide_factor(self) -> float:
        """The factor FSDP2 divided every reduced gradient by (``set_gradient_divide_factor``, else its data-parallel
        size: ``_get_gradient_divide_factors`` in torch's ``_fsdp_collectives.py``); one for the whole model
        (``ValueError`` when the groups differ)."""
        factors = {float(g.gradient_divide_factor) if g.gradient_divide_factor is not None
                   else float(g.mesh_info.shard_mesh_size) for g in self.groups}
        if len(factors) != 1:
            raise ValueError(f"the model's FSDP2 groups divide their gradients by different factors {sorted(factors)} "
                             "(set_gradient_divide_factor on some modules only): call "
                             "model.set_gradient_divide_factor(f) on the root, or not at all")
        return factors.pop()

    def param_slots(self) -> list[ParamSlot]:
        """Per parameter (layout order), what this rank holds of it (``ShardingStrategy.param_slots``): its local
        shard as the range ``[lo, hi)`` of the flattened parameter (fully_shard's ``Shard(0)``: rows
        ``[r * ceil(n / d), ...)`` of ``n``, so a contiguous range), the optimizer's piece (the DTensor parameter or its
        fp32 master DTensor) and the window's fp32 sum of that range. ``ValueError`` for a parameter sharded on
        another dim (``shard_placement_fn``): its local shard is not one range of the flattened parameter."""
        slots = super().param_slots()
        return [dataclasses.replace(s, lo=lo, hi=lo + s.grad.numel()) for s, lo in
                zip(slots, (self._shard_start(s.param) for s in slots))]

    @staticmethod
    def _shard_start(p: torch.Tensor) -> int:
        """Where ``p``'s local shard starts in the flattened parameter (fully_shard's ``Shard(0)`` chunks)."""
        from torch.distributed.tensor import Shard  # noqa: PLC0415 - only for FSDP2 models

        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"acc.state_dict() saves FSDP2 parameters sharded on dim 0 (fully_shard's default); a "
                             f"parameter of shape {tuple(p.shape)} is sharded as {p.placements}: build fully_shard "
                             "without shard_placement_fn")
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // rows if rows else 0
        chunk = -(-rows // p.device_mesh.size())
        start = min(p.device_mesh.get_coordinate()[0] * chunk, rows) * per_row
        if start + p.to_local().numel() > p.numel():
            raise RuntimeError(f"a local shard of {p.to_local().numel()} elements from {start} passes the end of a "
                               f"parameter of {p.numel()} (FSDP2's chunks are not torch.chunk's): please report it")
        return start

    def check_saveable(self, optimizer: torch.optim.Optimizer | None) -> None:
        """``acc.state_dict()`` saves this rank's ranges of the fp32 masters, of the optimizer's moments and of the
        window's sums, resharded by ``torch.distributed.checkpoint`` (docs/fsdp2.md): ``ValueError`` for an
        optimizer whose update is not elementwise (``gaengine.optimizers.is_elementwise``): its state over the
        DTensor parameters cannot be cut into ranges; save it with torch's ``get_optimizer_state_dict``."""
        if optimizer is not None and not is_elementwise(optimizer):
            raise ValueError(f"acc.state_dict() on an FSDP2 model saves the optimizer's state by ranges of the "
                             f"flattened parameters, which needs an elementwise optimizer ({', '.join(elementwise_names())}); "
                             f"{type(optimizer).__name__} is not one: save the model and this optimizer with "
                             "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) instead")

    def optimizer_shards(self):
        """No export through gaengine: the optimizer is the user's, over the DTensor parameters. ``TypeError`` naming
        torch's export instead."""
        raise TypeError("an FSDP2 (fully_shard) model's optimizer state is its own optimizer's over the DTensor "
                        "parameters: export it with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict("
                        "model, optimizer, options=StateDictOptions(full_state_dict=True)), not "
                        "gaengine.full_optimizer_state_dict")


class FullyShardedReduction(Reduction):
    """``FullyShardedGrads``' reduction (``gaengine.reduce.Reduction``): FSDP2 reduce-scatters every micro-batch
    itself, so there is no reducer; the window's stats all-reduce carries the local shards' sum of squares and
    non-finite flag (its ``tail``), and the norm divides the denominator by FSDP2's divide factor (``main_grad``
    holds the sum over the ranks divided by it).

    groups: FSDP2's parameter groups of the model (``fsdp2_param_groups``). divide_factor: returns the factor FSDP2
    divided every reduced gradient by (``FullyShardedGrads._divide_factor``).
    """

    reduces_every_micro_batch = True

    def __init__(self, accumulation: Accumulation, backend, group, world_size: int, groups: list,
                 divide_factor) -> None:
        super().__init__(None, accumulation, backend, group, world_size)
        self.groups = groups
        self.divide_factor = divide_factor
        self._stats: WindowStats | None = None  # the window's stats all-reduce, whose tail norm reads

    def begin_backward(self, first: bool, last: bool, overlap: bool) -> BackwardStart:
        """``RuntimeError`` when FSDP2's gradient sync was turned off behind the accumulator's back (its hooks
        would see one window sum late, or nothing); else nothing to arm (FSDP2 reduces every micro-batch)."""
        off = [g for g in self.groups if not g.reduce_grads or not g.all_reduce_grads]
        if off:
            raise RuntimeError(
                f"FSDP2's gradient sync is off on model.{off[0]._module_fqn or 'self'} "
                "(model.set_requires_gradient_sync(False) or set_requires_all_reduce(False) was called): gaengine "
                "accumulates FSDP2's reduce-scattered shard of every micro-batch in fp32 itself. Call "
                "model.set_requires_gradient_sync(True) and let gaengine own the sync policy; nothing was accumulated")
        return BackwardStart(False)

    def end_backward(self, armed: bool, last: bool) -> bool:
        return self.world_size > 1 and last  # the stats all-reduce (gaengine.reduce.launch_window_stats)

    def end_partial_window(self, missing: int) -> None:
        """Nothing to launch: FSDP2 reduced every micro-batch the window holds."""

    def launch_window_stats(self, window, extra: torch.Tensor | None) -> WindowStats:
        """The window's stats all-reduce (``Reduction.launch_window_stats``) also carries the local shards' sum of
        squares and non-finite flag (its ``tail``, read by ``norm``): one all-reduce per window. When backward
        returns FSDP2 has reduced the last micro-batch and the hooks have added it (on CUDA, FSDP2's
        ``finalize_backward`` made the current stream wait for them), so ``main_grad`` holds the window; the
        parameters this rank wrote nothing for are zeroed first (as the base does)."""
        main_grad = self.accumulation.main_grad
        unused = self._locally_unused(window)
        for i in unused:
            main_grad.flat_views[i].zero_()
        sum_sq, found_inf = local_sum_sq(self.accumulation.chunks, self.backend, main_grad.data.device)
        tail = torch.stack([sum_sq.double().reshape(()), found_inf.double().reshape(())])
        self._stats = launch_window_stats(None, main_grad, unused, window.loss_sum, window.items(), self.group,
                                          extra=extra, count=window.num_micro_batches, settings=window.settings,
                                          tail=tail)
        return self._stats

    def norm(self, grad_denom: torch.Tensor, max_grad_norm: float | None) -> WindowNorm:
        """``gaengine.norm.window_norm`` of the local shards: their sum of squares and non-finite flag summed over
        the group by the window's stats all-reduce (``launch_window_stats``; the hooks' free norm, or one pass, on
        one rank), the denominator divided by FSDP2's divide factor."""
        if self.world_size > 1:  # summed over the ranks in the window's stats all-reduce (launch_window_stats)
            stats, self._stats = self._stats, None
            both = stats.tail()
            free = both[0].float(), both[1].float()
        else:
            free = self.accumulation.free_norm()
        return window_norm(self.accumulation.chunks, grad_denom / self.divide_factor(), max_grad_norm, self.backend,
                           free=free)
