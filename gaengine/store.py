"""The parameter store: the model's parameters as the optimizer sees them, the fp32 master weights, and the update.

One ``ParameterStore`` per accumulator with an optimizer, in every mode, built by the sharding strategy
(``gaengine.sharding``, ``gaengine.fsdp2``) over the rank's layout (``gaengine.rank_layout.RankLayout``), which
answers everything that differs by mode: which parameters are laid out in flat buffers, the range ``[lo, hi)`` of
each parameter this rank holds, the shape of its piece, where the masters live and how their rounding reaches the
model. The store itself never asks which mode it is. The layouts: ``gaengine.zero.WholeParams`` (replicated and one
rank: every range is the whole parameter, the one-shard case of a ``gaengine.zero.ShardLayout``),
``gaengine.zero.EvenShards`` (ZeRO: rank r of d owns its range of every bucket of a ``ShardLayout``) and
``gaengine.fsdp2.DTensorShards`` (FSDP2 models, whose parameters are DTensors whose local shards this rank holds).

* **Parameter buffers.** The laid-out parameters (the same ``Parameter`` objects, ``p.data`` re-pointed: autograd
  keeps their AccumulateGrad nodes and the hooks on them) become views of one flat buffer per dtype laid out like
  the dtype's span of the layout (``param_buffers[dtype]``; Megatron-Core's distributed optimizer re-points its
  parameters the same way). Padding is zero and stays zero. On d > 1 ranks every trainable parameter is laid out
  (the bucket all-gathers write the buffers, ``gaengine.zero.ParamGather``); on one, only those that need a flat
  buffer: the bf16/fp16 parameters the optimizer holds, when they have masters (one flat master -> model copy).
  FSDP2's parameters are never laid out (FSDP2 owns their storage).
* **Masters.** With ``master_weights=True``, one fp32 buffer (``master_buffer``, 4/d B/param) holds the rank's
  range of every bucket of the bf16/fp16 dtypes the optimizer holds, laid out like the rank's shard (FSDP2: the
  local shards of the bf16/fp16 parameters the optimizer holds, one after another).
  ``model.load_state_dict()`` after construction reaches the masters (``pull_model_writes``).
* **Pieces.** The optimizer is re-pointed at one parameter per (parameter, rank range), ``pieces``: on d > 1
  ranks a 1-D ``nn.Parameter`` (a view of the master buffer, or of the rank's range of the parameter buffer
  itself: fp32, or bf16/fp16 without masters, updated in place) for each range that is not empty; on one rank a
  parameter SHAPED like its model parameter (its fp32 master, or the model parameter itself), so any torch
  optimizer works and state built before the accumulator follows its parameter (to fp32 for a master, to the
  parameter's dtype without one: torch's ``Optimizer.load_state_dict`` casts it the same way); FSDP2 likewise,
  each piece a DTensor like its parameter (the parameter, or an fp32 master DTensor over its local master shard).
  Each piece stays in its parameter's param group (hyper-parameters per group).
* **Update** (``update``): every piece gets its gradient (the fp32 view the strategy hands over: its fp32 value,
  its rounding to a bf16/fp16 piece, or, for ``gaengine.optim.FusedAdamW`` without masters, ``p.main_grad``),
  the optimizer steps with the window's normalization x clip coefficient and the skip flag folded in (a fused
  torch optimizer and ``FusedAdamW`` through ``grad_scale``/``found_inf``: no pass, no host sync; any other one
  scale pass over the gradient and one host read of the skip flag), then the masters are rounded into the model
  (one multi-tensor copy; ``FusedAdamW`` writes the rounding in its own pass). The gradients exist only for that
  call: outside it no piece holds a ``.grad`` (or ``main_grad``), so a leftover ``optimizer.step()`` /
  ``optimizer.zero_grad()`` after ``acc.step()`` changes nothing (torch's optimizers skip a parameter without one).
* **Methods that write parameters** (``PARAM_WRITERS``): an optimizer method other than ``step()`` that moves the
  parameters it holds (schedule-free's ``eval()`` / ``train()``, which swap the parameters between the averaged
  point and the training point) moves the fp32 masters of a re-pointed optimizer, not the model. While the store
  holds the optimizer, those methods of the instance are wrapped (``_wrap_writers``): when the call wrote a master
  (the master buffer's version counter moved), the masters are rounded into the model at once, as plain training
  leaves the model. A method gaengine does not know writes parameters needs ``GradientAccumulator.masters_to_model()``
  after it (docs/accumulator.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gaengine.buffer import FlatBuffer
from gaengine.compat import all_gather_single
from gaengine.optimizers import STEP_KEY, each_optimizer, keeps_step, moment_keys, new_step, takes_grad_scale, writes_model_params
from gaengine.reduce import Collective, wait_for
from gaengine.rank_layout import ParamSlot, RankLayout, WindowChunk
from gaengine.update import LOW_PRECISION, convert_state, merge_model_write, param_versions, step_optimizer

__all__ = ["PARAM_WRITERS", "ParamSlot", "ParameterStore", "WindowChunk", "reshard_state"]

PARAM_WRITERS = ("eval", "train")
"""Optimizer methods known to write the parameters the optimizer holds outside ``step()``: the schedule-free
convention (``schedulefree.AdamWScheduleFree.eval()`` sets each parameter to the averaged point x, ``train()`` back
to the interpolation y; Defazio et al., *The Road Less Scheduled*, 2024), which HF's Trainer and Accelerate call
around training and evaluation. torch's own optimizers define neither."""


def _group_settings(optimizer) -> list[dict]:
    """The scalar settings of ``optimizer``'s param groups (flags and hyper-parameters, no tensors): alike on every
    rank, so what a call changed in them is a decision every rank takes alike."""
    return [{k: v for k, v in g.items() if isinstance(v, (bool, int, float, str))} for g in optimizer.param_groups]


class ParameterStore:
    """The parameter buffers, fp32 masters and optimizer pieces of one rank, and the update (module docstring).

    optimizer: re-pointed at ``pieces`` (param groups, hyper-parameters and, on one rank, existing state kept).
    params: every trainable parameter, in the order the update's ``grads`` come in. master_weights: keep fp32
    masters for the bf16/fp16 parameters the optimizer holds; False: the optimizer updates them in place
    (``reads_main_grad`` for ``FusedAdamW``, which takes the fp32 gradient as ``p.main_grad``, else
    ``normalize_before_rounding``: each gradient is rounded once, at its final scale).
    layout: the rank's layout (``gaengine.rank_layout.RankLayout``, fresh: the store calls its ``hold`` once), which
    lays out ``params`` and builds the masters and the pieces (``slots``).

    Attributes: ``pieces[j]`` (the optimizer's parameter for ``params[j]``'s range, or None); ``optimized[j]``;
    ``param_buffers[dtype]`` (the laid-out parameters' storage); ``master_buffer`` (``FlatBuffer`` of the fp32
    masters, ``views[k]`` the k-th master piece, or None); ``group_params`` (the optimizer's param groups as
    built, model parameters, before re-pointing); ``optimizer_writes_model`` (``FusedAdamW`` rounds the masters
    into the model in its pass).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *, device: torch.device,
                 master_weights: bool, layout: RankLayout) -> None:
        self.optimizer = optimizer
        self.device = device
        self.params = list(params)
        self.index = {id(p): j for j, p in enumerate(self.params)}
        held = {id(q) for g in optimizer.param_groups for q in g["params"]}
        self.optimized = [id(p) in held for p in self.params]
        low = [p for p, opt in zip(self.params, self.optimized) if opt and p.dtype in LOW_PRECISION]
        fused_adamw = writes_model_params(optimizer)  # gaengine.optim.FusedAdamW
        self.reads_main_grad = fused_adamw and not master_weights and bool(low)
        self.normalize_before_rounding = not fused_adamw and not master_weights and bool(low)
        mastered = {p.dtype for p in low} if master_weights else set()
        self.layout = layout
        self.slots, self._mastered = layout.hold(self.params, self.optimized, mastered, device)
        self.pieces: list[torch.Tensor | None] = [s.piece for s in self.slots]
        self.param_buffers = layout.param_buffers
        self.master_buffer: FlatBuffer | None = layout.master_buffer
        self._repoint_optimizer()
        self.optimizer_writes_model = fused_adamw and self.master_buffer is not None
        if self.optimizer_writes_model:
            optimizer.attach_model_params([(m.piece, m.view) for m in self._mastered])
        self._versions = param_versions(self._version_tensors())
        # Set by a sharded strategy: what brings every rank's part of the model to every rank after a PARAM_WRITERS
        # call wrote this rank's (ZeRO's all-gather of the parameter buffers, a collective: every rank calls the
        # method, as the trainers do).
        self.after_model_write: Callable[[], None] | None = None
        self._wrapped: list[tuple[object, str, object]] = []
        self._wrap_writers()

    def _written_version(self) -> int:
        """A host-side sum of version counters that an in-place write of the pieces bumps: the fp32 masters' buffer,
        or without masters the pieces themselves (views of the parameter buffers, or the parameters)."""
        if self.master_buffer is not None:
            return self.master_buffer.data._version
        return sum(q._version for q in self.pieces if q is not None)

    def _wrap_writers(self) -> None:
        """Wrap the optimizer instance's ``PARAM_WRITERS`` methods (those its class defines; for a list of
        optimizers, each one's: a user calls them on the optimizer they built, and the list's own call each) so that
        a call that wrote the pieces reaches the model: the fp32 masters rounded into it (``copy_to_model``; one
        host-side integer compared, no device work when nothing was written), and on sharded ranks every rank's part
        gathered (``after_model_write``: a collective, issued when the call changed the param groups' settings,
        schedule-free's ``train_mode``, which every rank's optimizer holds alike, whichever pieces the rank holds; a
        call that changes nothing, the Trainer's ``train()`` before every step, gathers nothing). Nothing where the
        layout says the pieces are the model's own parameters, whole on this rank (``RankLayout.follows_param_writes``):
        the optimizer then writes the model itself."""
        if not self.layout.follows_param_writes(self.master_buffer is not None):
            return
        for optimizer in each_optimizer(self.optimizer):
            for name in PARAM_WRITERS:
                method = getattr(type(optimizer), name, None)
                if not callable(method) or name in vars(optimizer):
                    continue
                bound = getattr(optimizer, name)

                def wrapper(*args, _bound=bound, _optimizer=optimizer, **kwargs):
                    before, mode = self._written_version(), _group_settings(_optimizer)
                    out = _bound(*args, **kwargs)
                    if self.master_buffer is not None and self._written_version() != before:
                        self.copy_to_model()
                    if self.after_model_write is not None and _group_settings(_optimizer) != mode:
                        self.after_model_write()  # the same on every rank (their groups alike), whatever it holds
                    return out

                wrapper.__doc__ = bound.__doc__
                setattr(optimizer, name, wrapper)
                self._wrapped.append((optimizer, name, wrapper))

    def _unwrap_writers(self) -> None:
        """The optimizers' own ``PARAM_WRITERS`` methods again (``release``)."""
        for optimizer, name, wrapper in self._wrapped:
            if vars(optimizer).get(name) is wrapper:
                delattr(optimizer, name)
        self._wrapped = []

    def _repoint_optimizer(self) -> None:
        """The optimizer re-pointed at the pieces (a parameter it holds that is not trainable stays where the layout
        keeps it, ``RankLayout.kept_in_groups``); state built before the accumulator follows its parameter."""
        optimizer = self.optimizer
        self.group_params: list[list[torch.Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        piece_of = {id(p): piece for p, piece in zip(self.params, self.pieces)}
        for group_ in optimizer.param_groups:
            group_["params"] = [q2 for q2 in (piece_of[id(q)] if id(q) in piece_of else self.layout.kept_in_groups(q)
                                              for q in group_["params"]) if q2 is not None]
        for p, piece in zip(self.params, self.pieces):
            if piece is not None and p.dtype in LOW_PRECISION and p in optimizer.state:
                state = optimizer.state.pop(p) if piece is not p else optimizer.state[p]
                optimizer.state[piece] = state
                convert_state(state, p, piece.dtype)  # exact to fp32; rounded once to the param dtype

    def model_views(self) -> list[torch.Tensor]:
        """Per master (``_mastered``' order), the model tensor its rounding goes into (``RankLayout.model_views``)."""
        return self.layout.model_views(self._mastered)

    def _version_tensors(self) -> list[torch.Tensor]:
        """The tensors whose version counters tell a model write (``pull_model_writes``;
        ``RankLayout.version_tensors``)."""
        return self.layout.version_tensors(self._mastered)

    # ------------------------------------------------------------------ a new layout (parameters joined or left)
    def release(self) -> dict[int, torch.Tensor]:
        """Undo the constructor's re-pointing of the optimizer, for a new store over other parameters (pieces shaped
        like their parameters: ``gaengine.zero.WholeParams``): each piece in its param group is its model parameter
        again, the state kept on a master piece is keyed by the parameter again (fp32, as it is: the new store's ``convert_state`` to fp32 is then
        exact). Returns the fp32 masters, copies keyed by ``id`` of their parameter (``keep_masters``)."""
        self._unwrap_writers()
        param_of = {id(piece): p for p, piece in zip(self.params, self.pieces) if piece is not None}
        for group in self.optimizer.param_groups:
            group["params"] = [param_of.get(id(q), q) for q in group["params"]]
        for p, piece in zip(self.params, self.pieces):
            if piece is not None and piece is not p and piece in self.optimizer.state:
                self.optimizer.state[p] = self.optimizer.state.pop(piece)
        return {id(m.param): m.master.detach().clone() for m in self._mastered}

    def release_to_model(self) -> None:
        """Give the optimizer back to the model for good (pieces shaped like their parameters,
        ``RankLayout.check_release``; ``GradientAccumulator.close`` with ``release_optimizer=True``): the model's writes since the last update reach the masters, the masters'
        rounding is in the model, then ``release``; each re-keyed state takes its parameter's dtype (moments rounded to
        bf16/fp16 once, as ``torch.optim.Optimizer.load_state_dict`` casts them), so the optimizer is the one plain
        training of the model would hold."""
        self.pull_model_writes()
        if self.master_buffer is not None and not self.optimizer_writes_model:
            self.copy_to_model()
        self.release()
        for p in self.params:
            state = self.optimizer.state.get(p)
            if state and p.dtype in LOW_PRECISION:
                convert_state(state, p, p.dtype)

    def release_shards(self) -> dict[int, dict]:
        """Undo the constructor's re-pointing of the optimizer on several ranks (a store over other parameters
        follows, ``reshard_state``): the param groups the optimizer had when this store was built hold their model
        parameters again (groups added since hold theirs already), and the state of this rank's pieces leaves the
        optimizer, returned keyed by ``id`` of the piece's model parameter."""
        self._unwrap_writers()
        for group, params in zip(self.optimizer.param_groups, self.group_params):
            group["params"] = list(params)
        states = {}
        for p, piece in zip(self.params, self.pieces):
            state = self.optimizer.state.pop(piece, None) if piece is not None else None
            if state:
                states[id(p)] = state
        return states

    def keep_masters(self, masters: dict[int, torch.Tensor]) -> None:
        """fp32 masters kept from before this store (``release`` of the store it replaces, or of a parameter frozen
        since and now joining again), whole and keyed by ``id`` of their parameter: each of this rank's master pieces
        takes its range of its parameter's (the store started from the bf16/fp16 rounding the model holds), except
        where the model no longer holds the master's rounding (written while it was frozen: ``merge_model_write``)."""
        with torch.no_grad():
            for s in self.slots:
                master = masters.get(id(s.param))
                if master is not None and s.master and s.piece is not None:
                    piece = s.piece.view(-1)
                    piece.copy_(master.reshape(-1)[s.lo:s.hi])
                    merge_model_write(piece, s.param.detach().reshape(-1)[s.lo:s.hi])

    # ------------------------------------------------------------------ the model
    def check_model(self) -> None:
        """Raise ``RuntimeError`` when the re-pointed parameters no longer live where the layout put them (the model
        was moved or converted after the accumulator was built: ``RankLayout.check_storage``)."""
        self.layout.check_storage()

    def pull_model_writes(self, every: bool = False) -> None:
        """Copy into their fp32 masters the bf16/fp16 parameters written since the masters were last rounded into
        the model: ``model.load_state_dict()`` or an in-place write under ``torch.no_grad()`` after construction
        (exact: a bf16/fp16 value is an fp32 value). Without it the next update would start from the old masters
        and revert the write. Seen through each parameter's version counter (bumped by every in-place op; a write
        through ``p.data`` is not seen): one host-side integer per parameter, no device work unless one changed.
        An element that still holds its master's rounding keeps the master (``merge_model_write``), so loading the
        model of a checkpoint beside the accumulator's own masters, in either order, keeps their fp32 bits.
        every: merge every master, changed or not (after the masters themselves were overwritten)."""
        versions = param_versions(self._version_tensors())
        if versions == self._versions and not every:
            return
        for m, view, new, old in zip(self._mastered, self.model_views(), versions, self._versions):
            if new != old or every:
                merge_model_write(m.master, view)
        self._versions = versions

    def merge_params(self, params: Sequence[torch.Tensor]) -> None:
        """The fp32 masters of ``params`` (model parameters with masters, one rank's store) take the values those
        hold now, written where their version counters do not tell (``gaengine.replaced``: a parameter whose
        ``p.data = x`` was put back into its place in the parameter buffer, ``x``'s values copied there): as
        ``pull_model_writes`` merges a write (``merge_model_write``)."""
        ids = {id(p) for p in params}
        for m in self._mastered:
            if id(m.param) in ids:
                merge_model_write(m.master, m.param.detach() if m.view is None else m.view)

    def model_written(self) -> None:
        """The masters' rounding is in the model now: the version counters ``pull_model_writes`` compares with."""
        self._versions = param_versions(self._version_tensors())

    def copy_to_model(self) -> None:
        """Round the fp32 masters into the model (``RankLayout.copy_masters``: one ``copy_`` per dtype or bucket
        range of the parameter buffers, one multi-tensor copy for more; FSDP2: into the local shards), bumping the
        parameters' version counters as an in-place op would. Raises ``RuntimeError`` as ``check_model``."""
        self.check_model()
        self.layout.copy_masters(self._mastered)
        self.model_written()

    # ------------------------------------------------------------------ the update
    def update(self, grads: Sequence[torch.Tensor | None], chunks: Sequence[torch.Tensor], coef: torch.Tensor,
               skipped: torch.Tensor, backend) -> bool | None:
        """Run the optimizer on the window's gradient times ``coef``, skipped when ``skipped``; returns whether it
        stepped (None: decided on the device, ``gaengine.update.step_optimizer``).

        grads: per parameter (``params``' order) the fp32 view of the window's raw gradient sum of its range,
        shaped like its piece, or None: no gradient in the window (no update, as torch's optimizers do).
        chunks: the contiguous fp32 tensors that hold those views, scaled in place by ``coef`` when the optimizer
        cannot take it (one pass: the backend's ``scale_`` for one, ``torch._foreach_mul_`` for several).
        coef: 0-d fp32 (normalization x clip coefficient), skipped: 0-d bool, both on the device. Raises
        ``RuntimeError`` as ``check_model`` before anything is written.
        """
        optimizer = self.optimizer
        self.check_model()
        self.pull_model_writes()  # model.load_state_dict() since the last update reaches the masters
        scaled = not takes_grad_scale(optimizer) or self.normalize_before_rounding
        if scaled:
            chunks = [c for c in chunks if c.numel()]
            if len(chunks) == 1:
                backend.scale_(chunks[0], coef)  # one fp32 pass: normalization and clipping
            elif chunks:
                torch._foreach_mul_(chunks, coef)  # one multi-tensor launch over the ranges
        targets = []  # the pieces handed a gradient: none of them keeps one after the step
        wrap = self.layout.grad_wrapper()  # None: no Python call per parameter where it wraps nothing
        for piece, grad in zip(self.pieces, grads):
            if piece is None:
                continue  # trainable but not optimized (counted in the norm, left alone), or nothing owned here
            targets.append(piece)
            if grad is None:
                piece.grad = None
            elif piece.dtype == torch.float32:
                piece.grad = grad if wrap is None else wrap(piece, grad)  # the view itself
            elif self.reads_main_grad:
                piece.main_grad = grad  # FusedAdamW reads the fp32 gradient in place, no copy
            else:  # rounded once, at its final scale (normalize_before_rounding)
                piece.grad = grad.to(piece.dtype) if wrap is None else wrap(piece, grad.to(piece.dtype))
        try:
            applied = step_optimizer(optimizer, coef, skipped, scaled)
        finally:
            for piece in targets:
                piece.grad = None
                if hasattr(piece, "main_grad"):
                    del piece.main_grad
        if self.master_buffer is not None and not self.optimizer_writes_model:
            # A skipped update left the masters unchanged, and the model already holds their rounding:
            # copying unconditionally is bit-identical and needs no host read of the skip flag.
            self.copy_to_model()
        self.model_written()
        return applied


def reshard_state(old: ParameterStore, new: ParameterStore, states: dict[int, dict], kept: dict[int, dict],
                  group) -> tuple[dict[int, dict], dict[int, torch.Tensor]]:
    """Several ranks, a new layout (parameters joined or left: ``gaengine.sharding`` ``_Zero.adopt``): move the fp32
    masters and the optimizer state ``old`` held into ``new``. A collective: every rank calls it alike.

    old: the store of the old layout, released (``release_shards``), whose return value is ``states``: its pieces'
    optimizer state (this rank's 1-D ranges), keyed by ``id`` of the model parameter. new: the store of the new
    layout, over the same optimizer, built from the model's values (its masters the bf16/fp16 rounding). kept: the
    whole, parameter-shaped state the optimizer kept for a parameter of ``new`` while it was frozen (what this
    function returned then), keyed by ``id``; sliced locally.

    Which old parameters have state, and their ``step``, come from one all-reduce (only the ranks owning a range of
    a parameter know). Then, per bucket of the old layout and per value (the masters, each moment
    ``gaengine.optimizers`` lists for the optimizer), every rank's range is all-gathered in fp32 (one bucket at a
    time: ``d`` x its shard on the device) and each rank copies out the ranges the new layout gives it: into its new
    master pieces, and into the new state of its pieces (in the piece's dtype), with ``step`` as the optimizer makes
    it (``_step_tensor``). A parameter with no state on any rank (never updated, or just added) gets none, as torch
    gives a parameter before its first update.

    Returns, for the parameters ``old`` optimized that ``new`` does not hold (frozen since), keyed by ``id``, the same
    on every rank, parameter-shaped: their whole optimizer state, in the dtype of their pieces (fp32 with masters;
    torch keeps a frozen parameter's state), and their whole fp32 masters (``keep_masters`` when they join again)."""
    optimizer = new.optimizer
    group_of = {id(q): g for g, members in enumerate(new.group_params) for q in members}
    has_state, steps = _known_states(old, states, new.device, group)
    fresh, left, left_masters = _move_buckets(old, new, states, has_state, group_of, group)
    pieces = {id(s.piece): s for s in new.slots if s.piece is not None}
    new_slots = {id(s.param): s for s in new.slots}
    for j, p in enumerate(old.params):
        if not (has_state[j] and old.optimized[j]):
            continue
        target = new_slots.get(id(p))
        g = optimizer.param_groups[group_of[id(p)]]
        uses_step = keeps_step(optimizer, g)  # per group: a list of optimizers may mix them
        if target is None:
            left.setdefault(id(p), {})
            if uses_step:
                left[id(p)][STEP_KEY] = _step_tensor(optimizer, g, p.device, steps[j])
        elif target.piece is not None and uses_step:
            fresh.setdefault(id(target.piece), {})[STEP_KEY] = _step_tensor(optimizer, g, target.piece.device,
                                                                            steps[j])
    for s in new.slots:  # a parameter that joins again: the state kept while it was frozen, sliced
        state = kept.get(id(s.param))
        if state and s.piece is not None:
            fresh[id(s.piece)] = {k: v if not torch.is_tensor(v) else v.clone() if k == STEP_KEY else
                                  v.detach().reshape(-1)[s.lo:s.hi].to(s.piece.dtype).clone()
                                  for k, v in state.items()}
    for piece_id, state in fresh.items():
        optimizer.state[pieces[piece_id].piece] = state
    return left, left_masters


def _known_states(old: ParameterStore, states: dict[int, dict], device: torch.device,
                  group) -> tuple[list[float], list[float]]:
    """Per old parameter, whether any rank holds optimizer state for it and its ``step`` (one all-reduce of
    ``2 x`` parameters fp64 values, MAX over the ranks; a host read, once per adoption)."""
    n = len(old.params)
    known = torch.zeros(2 * n, dtype=torch.float64)  # per old parameter: has state, its step
    for j, p in enumerate(old.params):
        state = states.get(id(p))
        if state:
            known[j] = 1.0
            if torch.is_tensor(state.get(STEP_KEY)) or isinstance(state.get(STEP_KEY), (int, float)):
                known[n + j] = float(state[STEP_KEY])  # a host read, once per adoption
    known = known.to(device)
    wait_for(Collective(dist.all_reduce, known, op=dist.ReduceOp.MAX, group=group),
             "all-reduce of the optimizer state known for the parameters (adoption)")
    known_host = known.tolist()  # a host read, once per adoption
    return known_host[:n], known_host[n:]


def _move_buckets(old: ParameterStore, new: ParameterStore, states: dict[int, dict], has_state: list[float],
                  group_of: dict[int, int], group) -> tuple[dict[int, dict], dict[int, dict], dict[int, torch.Tensor]]:
    """Per bucket of the old layout and per value (the masters, then each moment), every rank's range all-gathered
    in fp32 and copied out where the new layout puts it: into the new master pieces; the new pieces' moments
    (``id`` of the piece -> state); the whole moments and masters of the parameters ``new`` does not hold (``id`` of
    the parameter -> state, -> master)."""
    optimizer, device = new.optimizer, new.device
    shards = old.layout.shards  # the old store's ShardLayout (gaengine.zero.EvenShards)
    world = shards.world_size
    new_slots = {id(s.param): s for s in new.slots}
    fresh: dict[int, dict] = {}  # id(new piece) -> its state
    left: dict[int, dict] = {}  # id(parameter) -> its whole state
    left_masters: dict[int, torch.Tensor] = {}  # id(parameter) -> its whole master
    offsets = shards.layout.offsets
    for b in shards.buckets:
        members = range(b.first, b.last)
        keys = sorted({k for j in members if has_state[j]
                       for k in moment_keys(optimizer, optimizer.param_groups[group_of[id(old.params[j])]])})
        if any(old.slots[j].master for j in members):
            keys.insert(0, "")  # "": the masters
        for key in keys:
            mine = torch.zeros(b.shard_numel, dtype=torch.float32, device=device)
            for j in members:
                s = old.slots[j]
                src = (s.piece if s.master else None) if key == "" else states.get(id(s.param), {}).get(key)
                if s.piece is not None and s.hi > s.lo and src is not None:
                    at = s.shard_offset - b.shard_offset
                    mine[at:at + s.hi - s.lo] = src.detach().reshape(-1)
            whole = torch.empty(world * b.shard_numel, dtype=torch.float32, device=device)  # the bucket [start, end)
            Collective(all_gather_single(), whole, mine, group=group).wait()
            for j in members:
                p, s = old.params[j], old.slots[j]
                values = whole[offsets[j] - b.start:offsets[j] - b.start + p.numel()]
                target = new_slots.get(id(p))
                if key == "":
                    if s.master and target is None:
                        left_masters[id(p)] = values.view(p.shape).clone()
                    elif s.master and target.master and target.piece is not None:
                        with torch.no_grad():
                            target.piece.view(-1).copy_(values[target.lo:target.hi])
                elif not has_state[j] or not old.optimized[j]:
                    continue
                elif target is None:  # frozen since: its whole state stays with the optimizer
                    dtype = torch.float32 if s.master else p.dtype
                    left.setdefault(id(p), {})[key] = values.to(dtype).view(p.shape).clone()
                elif target.piece is not None:
                    fresh.setdefault(id(target.piece), {})[key] = values[target.lo:target.hi].to(
                        target.piece.dtype).clone()
    return fresh, left, left_masters


def _step_tensor(optimizer: torch.optim.Optimizer, group: dict, device: torch.device, value: float) -> torch.Tensor:
    """A ``step`` as the optimizer creates it at a parameter's first update (its row of ``gaengine.optimizers``:
    ``new_step``)."""
    return new_step(optimizer, group, device, value)
