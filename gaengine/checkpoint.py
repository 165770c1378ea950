"""The accumulator's state dict, one format for every sharding strategy, through ``torch.distributed.checkpoint``
(DCP) or ``torch.save``; and a full export of a sharded optimizer.

At ``zero_stage >= 1`` each rank holds one contiguous range of the flat fp32 buffer of every bucket (the
masters, the optimizer's moments and, at stage 2, the gradient sum). The ranges depend on the world size
(buckets are padded to split evenly) and may cut a parameter in two, so a rank's range is not a ``DTensor``
``Shard`` placement. A checkpoint therefore stores every parameter's flattened tensor as one DCP tensor of
shape ``(numel,)`` and each rank writes the chunk it owns (``FlatShard``); DCP reads back whatever chunks the
loading ranks own, at any world size, straight into their flat buffers. The replicated strategy is the
one-shard case: every rank's chunk is the whole parameter (DCP's save planner writes a chunk that several ranks
hold once), so a checkpoint of any strategy saved between windows loads into any other on any world size.

``FlatShard`` implements DCP's chunk protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, the one ``DTensor`` and torchrec's ``LocalShardsWrapper`` implement; source:
``torch/distributed/checkpoint/planner_helpers.py`` and ``utils.py``): the save planner asks it for its
write items, the load planner for its chunks, and both read or write the chunk through the view it returns.

The functions here are plain: a rank's flat shard and its ``Piece`` list in, per-parameter ``FlatShard``
views out (``shard_state_dict``), back (``load_shard_state_dict``), or gathered whole on every rank
(``gather_full``). ``accumulator_state_dict`` / ``load_accumulator_state_dict`` are
``GradientAccumulator.state_dict`` / ``load_state_dict``: an adapter between the stages' own state items and DCP.
They take the accumulator's parts (``gaengine.stages.AccumulatorParts``: the strategy, the optimizer, the
``lr_scheduler``, the parameters and the window's stages, whose ``StageStates`` gives and takes their items) and
never call back into the accumulator; the strategy is reached through its methods only (``param_slots``,
``finish_collectives``, ``state_meta``, ``window_sums``, ``load_window_state``, ``layout_to_resume``, ``set_layout``,
``optimizer_shards``, ``check_saveable``) and its rank's layout (``rank_layout``: ``gaengine.rank_layout.RankLayout``,
which wraps and unwraps a piece's local elements and says whether every rank holds the whole gradient), never a
mode flag: what differs per mode is the strategy's or the layout's answer. How an optimizer's per-parameter state
is held (by ranges, or whole by the rank that holds the parameter) is the optimizer's answer
(``gaengine.optimizer_state.state_form``). ``full_optimizer_state_dict`` gathers a state dict ``torch.optim.AdamW``
loads, for export.
``upgrade`` brings a state dict of an earlier gaengine's format (``gaengine.formats``) to today's.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from gaengine import optimizers, state_checks
from gaengine.buffer import FlatLayout, copy_into
from gaengine.compat import all_gather_single
from gaengine.optimizer_state import cpu_copy, state_form
from gaengine.formats import FSDP2_FORMAT, OLD_FORMATS, PLAIN_FORMAT, STATE_FORMAT, ZERO_FORMAT
from gaengine.protocol import gather_objects
from gaengine.reduce import Collective, wait_for
from gaengine.stages import AccumulatorParts, HasParts
from gaengine.rank_layout import RankLayout

__all__ = ["PLAIN_FORMAT", "STATE_FORMAT", "ZERO_FORMAT", "FlatShard", "Piece", "accumulator_state_dict",
           "full_optimizer_state_dict", "gather_full", "load_accumulator_state_dict", "load_shard_state_dict",
           "pieces_in_ranges", "shard_state_dict", "upgrade"]


class FlatShard(torch.Tensor):
    """One parameter's flattened tensor as DCP sees it: global shape ``(numel,)``, this rank's chunk a view.

    local: ``(length,)`` tensor, the chunk ``[start, start + length)`` of the flattened parameter; usually a view
        of the rank's flat shard buffer, so ``dcp.load`` writes into that buffer in place. ``length`` may be 0
        (the rank owns none of this parameter): it then writes and reads nothing.
    numel: elements of the whole parameter (all ranks' chunks together cover ``[0, numel)`` exactly once;
        DCP's save planner checks that and refuses overlaps or gaps).
    start: first element of the chunk inside the flattened parameter.

    template: only a place to load into: ``dcp.save`` writes ``None`` under its key (one small entry, no data),
        ``dcp.load`` reads the checkpoint's chunks into ``local`` or, where the checkpoint holds ``None``, puts
        ``None`` in the state dict in its place. (The window gradient of a state saved between windows.)
    own: ``local`` is this rank's own value of a tensor that holds one row per rank (``numel`` = world size x the
        row's elements; the unreduced window sums of a replicated run on several ranks, which differ per rank).

    Dtype and device are ``local``'s. It is a placeholder for checkpointing only: ``local`` holds the data;
    any torch operation on the wrapper itself raises ``NotImplementedError`` (use ``.local``).

    ``torch.save`` (and ``copy.deepcopy``) take it as a plain tensor where this rank's chunk is the whole value it
    holds: a chunk covering the whole tensor (a replicated run: one rank, or every rank holding everything) or an
    ``own`` row, pickled as a ``(length,)`` CPU copy of ``local`` (``torch.load(..., weights_only=True)`` reads
    it back; the loaders take a plain tensor as the whole value); a template as a 0-element fp32 tensor. A chunk
    of a sharded tensor (``zero_stage >= 1`` on several ranks) refuses ``torch.save`` with a ``TypeError``: save
    it with DCP.
    """

    local: torch.Tensor
    start: int
    template: bool
    own: bool

    @staticmethod
    def __new__(cls, local: torch.Tensor, numel: int, start: int, template: bool = False,
                own: bool = False) -> FlatShard:
        if local.dim() != 1:
            raise ValueError(f"FlatShard: local must be 1-D, got shape {tuple(local.shape)}")
        if not 0 <= start <= start + local.numel() <= numel:
            raise ValueError(f"FlatShard: chunk [{start}, {start + local.numel()}) does not lie in [0, {numel})")
        r = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        r.local, r.start, r.template, r.own = local, int(start), bool(template), bool(own)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"{func} on a gaengine FlatShard: it only places a chunk in a DCP checkpoint; "
                                  "its data is FlatShard.local")

    def _chunks(self) -> list[ChunkStorageMetadata]:
        if self.local.numel() == 0:
            return []
        return [ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=torch.Size([self.local.numel()]))]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self.template:
            return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]  # resolved to None below
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size()))
                for chunk in self._chunks()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor | None:
        # A template's save item is BYTE_IO (no offset) and writes None; a load reads chunks (with offsets) into local.
        return None if self.template and index.offset is None else self.local

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"FlatShard(numel={self.shape[0]}, chunk=[{self.start}, {self.start + self.local.numel()}), "
                f"dtype={self.dtype}, device={self.device})")

    @property
    def whole(self) -> bool:
        """This rank's chunk is the whole value it holds: the whole tensor, or an ``own`` row."""
        return self.own or (self.start == 0 and self.local.numel() == self.shape[0])

    def _plain(self) -> torch.Tensor:
        if self.template:
            return torch.zeros(0)
        if not self.whole:
            raise TypeError("a gaengine FlatShard holds one rank's chunk of a sharded tensor: save it with "
                            "torch.distributed.checkpoint (dcp.save), or export whole tensors with "
                            "gaengine.full_optimizer_state_dict")
        return self.local.detach().cpu().clone()

    def __reduce_ex__(self, protocol):
        return self._plain().__reduce_ex__(protocol)  # a plain tensor: torch.load(weights_only=True) reads it

    def __deepcopy__(self, memo) -> FlatShard:
        return FlatShard(self.local.detach().clone(), self.shape[0], self.start, self.template, self.own)


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in one rank's flat shard.

    param: index of the parameter (into the ``numels`` / ``keys`` lists the functions below take).
    start: first element inside the parameter's flattened tensor.
    length: elements, >= 1.
    offset: first element inside the rank's flat shard tensor.
    """

    param: int
    start: int
    length: int
    offset: int


def pieces_in_ranges(param_offsets: Sequence[int], numels: Sequence[int],
                     ranges: Sequence[tuple[int, int, int]]) -> list[Piece]:
    """The ``Piece`` list of one rank.

    param_offsets, numels: each parameter's first element and element count in the flat (padded) buffer.
    ranges: the rank's ranges of that buffer as ``(flat_start, flat_end, shard_offset)``: elements
        ``[flat_start, flat_end)`` of the flat buffer are elements ``[shard_offset, shard_offset + flat_end -
        flat_start)`` of the rank's flat shard (one range per bucket for a bucketed layout).

    Returns the pieces ordered by range, then by offset; padding (elements of no parameter) is left out.
    """
    order = sorted(range(len(numels)), key=lambda i: param_offsets[i])
    pieces = []
    for lo, hi, shard_offset in ranges:
        for i in order:
            a, b = max(lo, param_offsets[i]), min(hi, param_offsets[i] + numels[i])
            if a < b:
                pieces.append(Piece(i, a - param_offsets[i], b - a, shard_offset + a - lo))
    return pieces


def shard_state_dict(shard: torch.Tensor, pieces: Sequence[Piece], numels: Sequence[int],
                     keys: Sequence[str]) -> dict[str, FlatShard]:
    """Per-parameter views of a rank's flat shard that DCP saves and loads in place.

    shard: ``(S,)`` the rank's flat shard (any dtype and device; the views share its storage).
    pieces: the rank's ``Piece`` list (at most one piece per parameter); numels: every parameter's element
        count; keys: every parameter's key in the returned dict (e.g. its name in the model).

    Returns ``{keys[i]: FlatShard}`` for every parameter, with an empty chunk for those the rank holds none of
    (every rank then holds the same keys, as DCP needs).
    """
    if len(numels) != len(keys):
        raise ValueError(f"numels and keys must have one entry per parameter, got {len(numels)} and {len(keys)}")
    owned: dict[int, Piece] = {}
    for piece in pieces:
        if piece.param in owned:
            raise ValueError(f"pieces hold parameter {piece.param} twice; a rank's shard holds one range of it")
        owned[piece.param] = piece
    out = {}
    for i, (numel, key) in enumerate(zip(numels, keys)):
        piece = owned.get(i)
        if piece is None:
            out[key] = FlatShard(shard[:0], numel, 0)
        else:
            out[key] = FlatShard(shard[piece.offset:piece.offset + piece.length], numel, piece.start)
    return out


def load_shard_state_dict(shard: torch.Tensor, pieces: Sequence[Piece], numels: Sequence[int],
                          keys: Sequence[str], state: Mapping[str, torch.Tensor], what: str = "state") -> None:
    """Write ``state`` (as ``shard_state_dict`` returned it, then filled by ``dcp.load``) into ``shard``.

    A ``FlatShard`` that is a view of ``shard`` already holds the loaded values (nothing is copied); one of
    another storage is copied in; a whole tensor (a full, unsharded state, e.g. ``torch.load`` of an export)
    gives each piece its slice of the flattened tensor.

    Raises ``ValueError`` naming ``what`` and the key when a key is missing or a value does not have the
    parameter's element count or this rank's chunk, before anything is written.
    """
    owned = {piece.param: piece for piece in pieces}
    copies = []
    for i, (numel, key) in enumerate(zip(numels, keys)):
        value = state.get(key) if isinstance(state, Mapping) else None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what}[{key!r}] is missing or not a tensor: the checkpoint was saved for another "
                             "model or optimizer; build them as the saved run did")
        if value.numel() != numel:
            raise ValueError(f"{what}[{key!r}] has {value.numel()} elements, the parameter has {numel}: it "
                             "belongs to another model")
        piece = owned.get(i)
        if piece is None:
            continue
        dst = shard[piece.offset:piece.offset + piece.length]
        if isinstance(value, FlatShard):
            if value.start != piece.start or value.local.numel() != piece.length:
                raise ValueError(
                    f"{what}[{key!r}] holds elements [{value.start}, {value.start + value.local.numel()}), this rank "
                    f"owns [{piece.start}, {piece.start + piece.length}): take the state dict from this run's "
                    "accumulator (acc.state_dict()) before dcp.load")
            src = value.local
        else:
            src = value.detach().reshape(-1)[piece.start:piece.start + piece.length]
        if src.data_ptr() != dst.data_ptr() or src.device != dst.device:
            copies.append((dst, src))
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)


def gather_full(shard: torch.Tensor, all_pieces: Sequence[Sequence[Piece]], shapes: Sequence[torch.Size],
                group: dist.ProcessGroup | None = None, device: torch.device | str | None = "cpu"
                ) -> list[torch.Tensor]:
    """Every parameter's whole tensor from all ranks' flat shards (a collective: every rank calls it).

    shard: ``(S,)`` this rank's flat shard; every rank's has the same S (the layout pads them to it).
    all_pieces: ``all_pieces[r]`` is rank r's ``Piece`` list (computed locally: the layout is the same on
        every rank). shapes: every parameter's shape.
    device: where the returned tensors live (default CPU, so an export does not hold a second copy of the
        state on the accelerator); None: ``shard``'s device.

    Returns one tensor per parameter, ``shapes[i]``, ``shard``'s dtype. One ``all_gather_into_tensor`` of
    ``world x S`` elements (peak memory: that buffer on ``shard``'s device).
    """
    world = len(all_pieces)
    if world > 1:
        gathered = torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)
        # returns with no backend thread holding them
        wait_for(Collective(all_gather_single(), gathered, shard.contiguous(), group=group),
                 f"all-gather of a flat shard ({world} x {shard.numel()} elements)")
        rows = gathered.view(world, shard.numel())
    else:
        rows = shard.reshape(1, -1)
    target = rows.device if device is None else torch.device(device)
    out = [torch.empty(int(torch.Size(s).numel()), dtype=shard.dtype, device=target) for s in shapes]
    filled = [0] * len(shapes)
    for r, pieces in enumerate(all_pieces):
        for piece in pieces:
            out[piece.param][piece.start:piece.start + piece.length] = rows[r, piece.offset:piece.offset + piece.length]
            filled[piece.param] += piece.length
    missing = [i for i, (n, t) in enumerate(zip(filled, out)) if n != t.numel()]
    if missing:
        raise ValueError(f"the pieces cover {filled[missing[0]]} of the {out[missing[0]].numel()} elements of "
                         f"parameter {missing[0]}: the layout's ranges must cover every parameter once")
    return [t.view(s) for t, s in zip(out, shapes)]


def full_optimizer_state_dict(acc: HasParts, device: torch.device | str | None = "cpu") -> dict[str, Any]:
    """Gather ``acc``'s optimizer state into the state dict of an unsharded optimizer over the model's parameters.

    acc: a ``GradientAccumulator`` with an optimizer, at any ``zero_stage``. Sharded (``zero_stage >= 1`` on
        several ranks), every rank of its process group must call it: each state tensor is all-gathered once
        (``world x shard`` elements on the device at a time) and every rank gets the whole state dict.
    device: where the returned tensors live (default CPU); None: the optimizer state's device.

    Returns ``{"state": {i: {"step": 0-d fp32, "exp_avg": <param's shape>, ...}}, "param_groups": [...]}``,
    numbered as ``torch.optim.Optimizer.state_dict`` numbers the parameters of the optimizer the user built (its
    param groups in order, with their current hyper-parameters), so ``torch.optim.AdamW(<the same groups>)
    .load_state_dict(...)`` loads it (torch then casts the moments to each parameter's dtype). With master
    weights the moments are those of the fp32 masters. A parameter that has had no update yet has no entry,
    as in torch; a frozen one, the state the optimizer kept for it (frozen after training), whole. The tensors are
    copies. Raises ``ValueError`` when ``acc`` has no optimizer.
    """
    optimizer = getattr(acc, "optimizer", None)
    if optimizer is None:
        raise ValueError("full_optimizer_state_dict: acc has no optimizer (GradientAccumulator(..., optimizer=None))")
    acc = acc.state_parts()  # the strategy, the parameters and the process group

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to(device=value.device if device is None else device, copy=True)
        return value

    sharding = acc.sharding
    shards = sharding.optimizer_shards()
    if shards is None:  # one shard: the optimizer holds parameter-shaped tensors, numbered like the user's groups
        saved = optimizer.state_dict()
        return {"state": {i: {k: copy(v) for k, v in s.items()} for i, s in saved["state"].items()},
                "param_groups": [{k: copy(v) for k, v in g.items()} for g in saved["param_groups"]]}

    full, ready = _gather_moments(acc, optimizer, shards, device)
    return _number_like_torch(acc, optimizer, full, ready, copy)


def _gather_moments(acc: AccumulatorParts, optimizer: torch.optim.Optimizer, shards,
                    device) -> tuple[dict, dict[int, float]]:
    """Every moment of a sharded optimizer gathered whole (``gather_full``), per key a list over the parameters in
    layout order, and the step of each parameter some rank has updated (a host read: an export)."""
    per_rank, shard_numel = shards
    world = acc.world_size
    params = acc.params
    slots = acc.sharding.param_slots()
    all_pieces = [[Piece(s.index, s.lo, s.numel, s.shard_offset) for s in rank_shards if s.numel]
                  for rank_shards in per_rank]
    group_of = {id(q): g for g, group in enumerate(optimizer.param_groups) for q in group["params"]}
    steps: dict[int, float] = {}
    moment_keys: set[str] = set()
    for i, slot in enumerate(slots):
        piece = slot.piece
        state = optimizer.state.get(piece) if piece is not None else None
        if state:
            keys = optimizers.moment_keys(optimizer, optimizer.param_groups[group_of[id(piece)]])
            moment_keys.update(keys)
            steps[i] = float(state["step"]) if "step" in state else 0.0  # host read: an export
    gathered = [(steps, sorted(moment_keys))]
    if world > 1:
        gathered = gather_objects((steps, sorted(moment_keys)), acc.schedule.update_index, acc.process_group,
                                  "the optimizer state's steps (full_optimizer_state_dict)")
    ready = {i: s for d, _ in gathered for i, s in d.items()}
    full: dict[str, list[torch.Tensor]] = {}
    for key in sorted({k for _, keys in gathered for k in keys}):
        buf = torch.zeros(shard_numel, dtype=torch.float32, device=acc.device)
        for s in slots:
            state = optimizer.state.get(s.piece) if s.piece is not None else None
            if state and isinstance(state.get(key), torch.Tensor):
                buf[s.shard_offset:s.shard_offset + s.hi - s.lo] = state[key].reshape(-1)
        full[key] = gather_full(buf, all_pieces, [p.shape for p in params], group=acc.process_group, device=device)
    return full, ready


def _number_like_torch(acc: AccumulatorParts, optimizer: torch.optim.Optimizer, full: dict, ready: dict[int, float],
                       copy) -> dict[str, Any]:
    """The gathered state numbered as ``torch.optim.Optimizer.state_dict`` numbers the user's param groups as built
    (a frozen parameter: the whole state the optimizer kept for it), with the groups' hyper-parameters."""
    slots = acc.sharding.param_slots()
    dtype_of = [s.piece.dtype if s.piece is not None else (torch.float32 if s.master else s.param.dtype)
                for s in slots]
    layout_index = {id(p): i for i, p in enumerate(acc.params)}
    state_out, groups_out, n = {}, [], 0
    for g, members in enumerate(acc.sharding.store.group_params):  # the model's parameters of each group, as built
        ids = []
        keys = optimizers.moment_keys(optimizer, optimizer.param_groups[g])
        for p in members:
            i = layout_index.get(id(p))
            if i is None:  # frozen: the whole state the optimizer kept for it (frozen after training), if any
                if optimizer.state.get(p):
                    state_out[n] = {k: copy(v) for k, v in optimizer.state[p].items()}
            elif i in ready:
                state_out[n] = {"step": torch.tensor(ready[i], dtype=torch.float32),
                                **{k: full[k][i].to(dtype_of[i]) for k in keys if k in full}}
            ids.append(n)
            n += 1
        hyper = optimizer.param_groups[g]
        groups_out.append({**{k: copy(v) for k, v in hyper.items() if k != "params"}, "params": ids})
    return {"state": state_out, "param_groups": groups_out}


# ---------------------------------------------------------------------------------------------------------------
# GradientAccumulator.state_dict(): one format for every sharding strategy, in DCP's form

# (STATE_FORMAT, its tag, and the earlier formats' are in gaengine.formats.)


@dataclass
class _Entry:
    """One trainable parameter as the checkpoint sees it (see ``_entries``).

    key: its name in the model (``model.named_parameters``), or ``param<i>`` by registration order.
    layout_index: its index in ``acc.params`` (layout order). numel, shape, dtype: the parameter's.
    lo, hi: the range of the flattened parameter this rank owns (the whole parameter when nothing is sharded).
    piece: the optimizer's parameter holding that range (``None``: not optimized, or nothing owned).
    group: index of the piece's param group (-1 without a piece). master: the parameter has fp32 master weights.
    grad: ``(hi - lo,)`` fp32 view of the window's gradient sum for that range (stage 2: the gradient shard;
        stage 1: this rank's range of ``main_grad``; unsharded: the whole ``main_grad`` view).
    shard_offset: where ``lo`` lies in the rank's gradient shard (sharded). All from
    ``acc.sharding.param_slots()`` (``gaengine.rank_layout.ParamSlot``). layout: the rank's layout
    (``acc.sharding.rank_layout``: a piece's local elements, ``RankLayout.local``, and a loaded state tensor wrapped
    like the piece, ``RankLayout.wrap``).
    """

    key: str
    layout_index: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype
    lo: int
    hi: int
    piece: torch.Tensor | None
    group: int
    optimized: bool
    master: bool
    grad: torch.Tensor
    shard_offset: int
    layout: RankLayout

    # What the optimizer state's form (gaengine.optimizer_state) asks of the entry it saves or loads.
    def chunk(self, local: torch.Tensor) -> FlatShard:
        """``local``, this rank's ``(hi - lo,)`` elements, as the chunk ``[lo, hi)`` of the ``(numel,)`` tensor."""
        return FlatShard(local, self.numel, self.lo)

    def take(self, value: Any, what: str) -> torch.Tensor:
        """This rank's elements of a loaded ``value`` (``_take``)."""
        return _take(value, self, what)

    def flat(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t``'s elements this rank holds, flat and in place (``_flat``)."""
        return _flat(self, t, what)

    def shaped(self, local: torch.Tensor) -> torch.Tensor:
        """A loaded state tensor shaped and wrapped like the piece (``_shaped_like``)."""
        return _shaped_like(self, local)


def _param_keys(acc: AccumulatorParts) -> dict[int, str]:
    """id(parameter) -> its checkpoint key: its name in the model (the first, for a tied parameter), else
    ``param<i>`` with i its registration order."""
    names: dict[int, str] = {}
    for name, p in acc.named_params:
        names.setdefault(id(p), name)
    return {id(p): names.get(id(p), f"param{i}") for i, p in enumerate(acc.registered_params)}


def _entries(acc: AccumulatorParts) -> list[_Entry]:
    """The ``_Entry`` of every trainable parameter, in registration order (the same on every rank and world)."""
    keys = _param_keys(acc)
    optimizer = acc.optimizer
    groups = optimizer.param_groups if optimizer is not None else []
    group_of = {id(q): g for g, group in enumerate(groups) for q in group["params"]}
    out = []
    layout = acc.sharding.rank_layout
    for i, s in enumerate(acc.sharding.param_slots()):  # what this rank holds of each parameter
        p, piece = s.param, s.piece
        out.append(_Entry(keys[id(p)], i, p.numel(), p.shape, p.dtype, s.lo, s.hi, piece,
                          group_of.get(id(piece), -1) if piece is not None else -1, s.optimized, s.master, s.grad,
                          s.shard_offset, layout))
    order = {id(p): j for j, p in enumerate(acc.registered_params)}
    return sorted(out, key=lambda e: order[id(acc.params[e.layout_index])])


def _flat(e: _Entry, t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``'s elements this rank holds (``e``'s piece, or its state), flat and in place (``RankLayout.local``: the
    local shard of an FSDP2 piece); ``ValueError`` when not contiguous."""
    t = e.layout.local(t)
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; gaengine checkpoints read and write it in place")
    return t.view(-1)


def _shaped_like(e: _Entry, local: torch.Tensor) -> torch.Tensor:
    """A loaded optimizer state tensor for ``e``'s piece from this rank's ``local`` elements: shaped like the piece's
    local elements and wrapped like the piece (``RankLayout.wrap``: a DTensor for an FSDP2 piece)."""
    piece = e.piece
    return e.layout.wrap(piece, local.view(e.layout.local(piece).shape))


def accumulator_state_dict(acc: AccumulatorParts) -> dict[str, Any]:
    """``acc.state_dict()`` for every sharding strategy (see ``GradientAccumulator.state_dict``).

    Returns ``{"format": STATE_FORMAT, "meta": bytes, "master": {key: FlatShard}, "optimizer": {key: {...}},
    "window_grad": {key: FlatShard}}``, keyed by parameter name (``_param_keys``):

    * ``master``: each parameter with fp32 master weights, ``(numel,)`` fp32, this rank's range ``[lo, hi)``
      (``ShardingStrategy.param_slots``: the whole parameter unsharded, a view of the masters).
    * ``optimizer``: each optimized parameter this rank holds a range of, in the form the optimizer's state takes
      (``gaengine.optimizer_state.state_form``): for the elementwise optimizers of ``gaengine.optimizers.OPTIMIZERS``
      ``{"initialized": 0-d, "step": 0-d fp64, <moment>: FlatShard (numel,) in the state's dtype}`` (views of the
      optimizer's state); for any other (held whole by one rank: every rank replicated, the owner at ``zero_stage``
      >= 1) ``{"initialized", "step", "whole": bytes}``, the parameter's whole state as ``torch.save`` bytes of CPU
      copies, saved by the rank that holds it and loaded by the one that holds it then, at any world size.
    * ``window_grad``: the window's fp32 gradient sum, as the strategy places it (``ShardingStrategy.window_sums``).
      Between windows a template (``FlatShard.template``: DCP saves ``None``). Mid-window this rank's range of the
      sum over the ranks (``(numel,)``; sharded strategies, and one rank), or, for a replicated run on several
      ranks, this rank's own unreduced sum as its row of a ``(world x numel,)`` tensor (``FlatShard.own``), so the
      resume is bit-identical.
    * ``meta``: ``torch.save`` bytes of the world size, the strategy's entries (``ShardingStrategy.state_meta``: its
      name as ``mode``, whether it is sharded and keeps rows), each parameter's (key, shape, dtype, optimized, master
      weights), the param groups'
      hyper-parameters, the ``lr_scheduler``'s state, and ``ranks``: the accumulator's scalars
      (``gaengine.stages.StageStates.state_items``) of every rank mid-window on several ranks, else of this rank only.

    Every rank must call it mid-window on several ranks (an all-gather of the scalars; at ``zero_stage=1`` also a
    reduce-scatter of the window's sums); between windows it runs no collective. ``RuntimeError`` between the
    window's last ``acc.backward()`` and ``acc.step()`` (the window's reductions are in flight).
    """
    acc.sharding.check_saveable(acc.optimizer)
    if acc.window.stats is not None:
        raise RuntimeError("state_dict() was called after the window's last acc.backward() and before acc.step(): "
                           "the window's reductions are in flight; call acc.step() first, then save")
    sharding = acc.sharding
    world = acc.world_size
    group = acc.process_group
    mid_window = acc.window.num_micro_batches > 0
    sharding.finish_collectives()  # the parameters (model.state_dict() views) whole, the gradient shard reduced
    entries = _entries(acc)
    optimizer = acc.optimizer
    form = state_form(optimizer) if optimizer is not None else None  # how each parameter's state is held

    per_rank: dict[str, Any] = {"scalars": acc.stages.state_items()}  # with the window's (gaengine.window)
    ranks = [per_rank]
    if mid_window and world > 1:  # each rank resumes its own window counters
        ranks = gather_objects(per_rank, acc.schedule.update_index, group, "the ranks' window counters "
                               "(acc.state_dict() mid-window)")
    masters, opt_state, window = {}, {}, {}
    window_shards = [FlatShard(c.local, c.numel, c.start, template=not mid_window, own=c.own)  # per layout index
                     for c in sharding.window_sums(mid_window)]  # mid-window at stage 1: a collective
    for e in entries:
        owned = e.piece is not None
        if e.master:
            masters[e.key] = FlatShard(_flat(e, e.piece.data, e.key) if owned else e.grad[:0].new_empty(0),
                                       e.numel, e.lo)
        if e.optimized and owned:
            opt_state[e.key] = form.save(optimizer, optimizer.state.get(e.piece) or {}, e)
        window[e.key] = window_shards[e.layout_index]
    return {"format": STATE_FORMAT, "meta": _meta_blob(acc, entries, ranks), "master": masters,
            "optimizer": opt_state, "window_grad": window}


def _meta_blob(acc: AccumulatorParts, entries: list[_Entry], ranks: list) -> bytes:
    """The ``torch.save`` bytes of a checkpoint's meta (``accumulator_state_dict``'s docstring)."""
    optimizer = acc.optimizer
    meta = {
        "world_size": acc.world_size, **acc.sharding.state_meta(),
        "params": [(e.key, list(e.shape), str(e.dtype), e.optimized, e.master) for e in entries],
        "param_groups": ([] if optimizer is None else
                         [{k: cpu_copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]),
        "optimizer_type": _optimizer_type(optimizer),
        "lr_scheduler": None if acc.lr_scheduler is None else acc.lr_scheduler.state_dict(),
        "optimizer_state": {},  # where an earlier gaengine kept whole states (gaengine.optimizer_state.WholeState)
        "ranks": ranks,
    }
    blob = io.BytesIO()
    torch.save(meta, blob)
    return blob.getvalue()


def _take(value: Any, e: _Entry, what: str, start: int | None = None, size: int | None = None,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """The loaded values of ``e``'s range from ``value``: a ``FlatShard`` whose chunk is ``[start, start + hi - lo)``
    of ``size`` elements (default: ``[lo, hi)`` of ``numel``), or a whole tensor of ``numel`` elements (a plain
    state, ``torch.load``); floating point, of ``dtype`` where given (``ValueError`` naming the key otherwise)."""
    start, size = (e.lo if start is None else start), (e.numel if size is None else size)
    if isinstance(value, torch.Tensor):
        state_checks.check_tensor(value.local if isinstance(value, FlatShard) else value, f"{what}[{e.key!r}]", dtype)
    if isinstance(value, FlatShard):
        if value.start != start or value.local.numel() != e.hi - e.lo or value.shape[0] != size:
            held = f"[{value.start}, {value.start + value.local.numel()}) of {value.shape[0]}"
            raise ValueError(f"{what}[{e.key!r}] holds elements {held}, this rank owns [{start}, "
                             f"{start + e.hi - e.lo}) of {size}: take the state dict from this run's accumulator "
                             "(acc.state_dict()) before dcp.load")
        return value.local
    if not isinstance(value, torch.Tensor) or value.numel() != e.numel:
        got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what}[{e.key!r}] must be a tensor of {e.numel} elements, got {got}")
    return value.detach().reshape(-1)[e.lo:e.hi]


def _read_meta(state: dict[str, Any]) -> dict[str, Any]:
    """The meta blob of a state (``gaengine.state_checks.read_meta``: ``ValueError`` naming ``state['meta']`` for
    bytes that do not decode)."""
    return state_checks.read_meta(state)  # plain containers, numbers, CPU tensors


def load_accumulator_state_dict(acc: AccumulatorParts, state: dict[str, Any]) -> None:
    """``acc.load_state_dict(state)`` of what ``accumulator_state_dict`` returned, on any sharding strategy (see
    ``GradientAccumulator.load_state_dict``): after ``dcp.load`` into this run's own ``acc.state_dict()`` (any world
    size and strategy), or ``torch.load`` of one rank's ``torch.save`` (FlatShards whose chunk is this rank's whole
    value come back as plain tensors).

    Checks everything before writing: raises ``ValueError`` (changing nothing) for a state of another format (one
    of an earlier gaengine: naming it and ``upgrade``), model, optimizer layout, ``master_weights`` or number of
    param groups, or saved mid-window on another world size or strategy (naming both)."""
    _check_format(state)
    meta = _read_meta(state)
    state_checks.check_meta(meta, list(acc.sharding.state_meta()))
    entries = _entries(acc)
    _check_model(acc, meta, entries)
    scalars, ranks, mid_window = _resume_scalars(acc, meta)
    state_checks.check_parts(state, mid_window)
    state_checks.check_lr_scheduler(meta["lr_scheduler"], acc.lr_scheduler)
    order = acc.sharding.layout_to_resume(list(scalars["layout_order"]), _layout_order(acc))
    adopt = order != _layout_order(acc)
    _remap_layout(scalars, order, mid_window)
    masters, loaded, grads = _checked_values(acc, state, meta, entries, mid_window)
    # Write. The lr_scheduler first: its own load_state_dict is the one write not checked above, so a failure
    # puts its state back and changes nothing else.
    _load_lr_scheduler(acc.lr_scheduler, meta["lr_scheduler"])
    sharding = acc.sharding
    if adopt:  # a new main_grad in the saved layout (the loaded sums are views of the old one: copied below)
        sharding.set_layout([acc.registered_params[i] for i in order])
        entries = _entries(acc)
    with torch.no_grad():
        if mid_window:  # the hooks resume with the written flags the strategy returns
            sums = [grads[e.key] for e in sorted(entries, key=lambda e: e.layout_index)]
            scalars["written"] = sharding.load_window_state(sums, list(scalars["written"]),
                                                            [list(r["scalars"]["written"]) for r in ranks])
        for dst, src in masters:
            copy_into(dst, src)
        if masters and sharding.store is not None:
            sharding.store.copy_to_model()
    _load_optimizer(acc, meta, entries, loaded)
    acc.stages.load_state_items(scalars)


def _load_lr_scheduler(scheduler: Any, saved: dict[str, Any] | None) -> None:
    """``scheduler.load_state_dict(saved)`` (None: nothing saved), put back as it was and ``ValueError`` naming
    ``state['meta']['lr_scheduler']`` when it raises (a scheduler of another type whose loader misses a key)."""
    if scheduler is None or saved is None:
        return
    before = scheduler.state_dict()
    try:
        scheduler.load_state_dict(dict(saved))
    except Exception as exc:
        scheduler.load_state_dict(before)
        raise ValueError(f"state['meta']['lr_scheduler'] does not load into this {type(scheduler).__name__} "
                         f"({type(exc).__name__}: {exc}): the state was saved with another lr_scheduler, or is "
                         "corrupt; build the lr_scheduler the saved run used") from None


def _check_format(state: Any) -> None:
    """``ValueError`` unless ``state`` is a ``STATE_FORMAT`` state dict, naming an earlier gaengine's format and what
    to do with it."""
    if isinstance(state, dict) and state.get("format") == FSDP2_FORMAT:
        raise ValueError(f"state is a {FSDP2_FORMAT} state dict, saved per rank by an earlier gaengine from an FSDP2 "
                         f"model; this one saves and loads FSDP2 state as {STATE_FORMAT} (with the optimizer's state, "
                         "through torch.distributed.checkpoint, docs/fsdp2.md) and does not convert it. To go on: "
                         "load the model and optimizer as they were saved, build a new accumulator, and continue from "
                         "the window boundary the save followed")
    if isinstance(state, dict) and state.get("format") in OLD_FORMATS:
        raise ValueError(f"state is a {state['format']} state dict, saved by an earlier gaengine; this one loads "
                         f"{STATE_FORMAT}: convert it with gaengine.checkpoint.upgrade(state, acc), then load or "
                         "save the result (docs/checkpoints.md)")
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state is not a {STATE_FORMAT} state dict (got format {got!r}): load what "
                         "acc.state_dict() returns (after dcp.load or torch.load)")


def _check_model(acc: AccumulatorParts, meta: dict[str, Any], entries: list[_Entry]) -> None:
    """``ValueError`` when the state was saved for another model, optimizer layout, ``master_weights`` or number of
    param groups, or another optimizer type (``_check_optimizer``)."""
    mine = [(e.key, list(e.shape), str(e.dtype), e.optimized, e.master) for e in entries]
    if [tuple(p) for p in meta["params"]] != mine:
        diff = next((a, b) for a, b in zip([tuple(p) for p in meta["params"]] + [None] * len(mine),
                                           mine + [None] * len(meta["params"])) if a != b)
        raise ValueError(f"state was saved for another model or optimizer (state['meta']['params']): (key, shape, "
                         f"dtype, optimized, master weights) {diff[0]} in the state, {diff[1]} here. Build the model, "
                         "the optimizer's param groups and master_weights as the saved run did")
    optimizer = acc.optimizer
    n_groups = 0 if optimizer is None else len(optimizer.param_groups)
    if len(meta["param_groups"]) != n_groups:
        raise ValueError(f"state['meta']['param_groups'] holds {len(meta['param_groups'])} optimizer param groups, "
                         f"this accumulator's optimizer {n_groups}: build the optimizer with the saved run's groups")
    _check_optimizer(meta, optimizer)
    state_checks.check_param_groups(meta["param_groups"], optimizer)


def _resume_scalars(acc: AccumulatorParts, meta: dict[str, Any]) -> tuple[dict[str, Any], list[dict], bool]:
    """This rank's saved scalars (checked, ``StageStates.check_state_items``), every saving rank's entries, and
    whether the state was saved mid-window; ``ValueError`` for a window saved on another world size or strategy."""
    sharding = acc.sharding
    saved_world, world = int(meta["world_size"]), acc.world_size
    saved_scalars = meta["ranks"][0]["scalars"]
    mid_window = int(saved_scalars["num_micro_batches"]) > 0
    mine = sharding.state_meta()  # the strategy's entries: its name (mode), and how it saves a window
    saved_mode = meta["mode"] or sharding.name
    if mid_window and (saved_world != world or {**{k: meta[k] for k in mine}, "mode": saved_mode} != mine):
        raise ValueError(
            f"state was saved mid-window ({saved_scalars['num_micro_batches']} micro-batches into a window) on "
            f"{saved_world} rank(s) with {saved_mode}; this run has {world} rank(s) with {sharding.name}. A window's "
            "micro-batches belong to their ranks, so it resumes only on the same world size and sharding: resume it "
            "there, or go back to a checkpoint saved between windows (after acc.step()), which loads on any world "
            "size and zero_stage")
    rank = dist.get_rank(acc.process_group) if world > 1 else 0
    ranks = meta["ranks"]
    if mid_window and len(ranks) != world:
        raise ValueError(f"state['meta']['ranks'] of a state saved mid-window holds the window counters of "
                         f"{len(ranks)} rank(s), this run has {world}: save it with every rank calling "
                         "acc.state_dict()")
    scalars = dict(ranks[rank if mid_window else 0]["scalars"])
    if mid_window and scalars.get("window_used") is None and "window_used" in ranks[rank]:
        scalars["window_used"] = ranks[rank]["window_used"]  # saved beside the scalars before gaengine.window
    acc.stages.check_state_items(scalars)
    if mid_window:  # every saving rank's written flags are read (ShardingStrategy.load_window_state)
        for r, entry in enumerate(ranks):
            written = entry["scalars"].get("written")
            if not isinstance(written, (list, tuple)) or len(written) != len(acc.registered_params) or not all(
                    isinstance(w, bool) for w in written):
                raise state_checks.corrupt(f"state['meta']['ranks'][{r}]['scalars']['written']",
                                           f"a list of {len(acc.registered_params)} bools", written)
    return scalars, ranks, mid_window


def _remap_layout(scalars: dict[str, Any], order: list[int], mid_window: bool) -> None:
    """The per-parameter scalars saved in their layout order remapped to ``order``, the layout the strategy resumes
    in (``ShardingStrategy.layout_to_resume``); ``ValueError`` for a state saved mid-window in another layout."""
    saved_order = list(scalars["layout_order"])
    if saved_order == order:
        return
    if mid_window:
        raise ValueError("state was saved mid-window with another parameter layout; resume it as it was saved")
    pos = {reg: j for j, reg in enumerate(saved_order)}
    remap = [pos[reg] for reg in order]
    for key in ("written", "expected_arrivals"):
        if scalars.get(key) is not None:
            scalars[key] = [scalars[key][j] for j in remap]
    if scalars.get("arrival") is not None:
        back = {j: i for i, j in enumerate(remap)}
        scalars["arrival"] = [back[j] for j in scalars["arrival"]]
    scalars["layout_order"] = order


def _checked_values(acc: AccumulatorParts, state: dict[str, Any], meta: dict[str, Any], entries: list[_Entry],
                    mid_window: bool) -> tuple[list, dict[int, dict[str, Any]], dict[str, torch.Tensor]]:
    """Every value to load, each checked against this rank's range before any is written: ``(master view, saved
    chunk)`` pairs, the optimizer state per piece (``id``), and mid-window the window's sums per key."""
    optimizer = acc.optimizer
    masters: list[tuple[torch.Tensor, torch.Tensor]] = []
    grads: dict[str, torch.Tensor] = {}
    loaded: dict[int, dict[str, Any]] = {}
    where = acc.sharding.window_sums(False) if mid_window else None  # the chunk each saved window sum must hold
    form = state_form(optimizer) if optimizer is not None else None  # how each parameter's state is held
    for e in entries:
        owned = e.piece is not None
        if e.master and owned:
            saved = _take(state["master"].get(e.key), e, "state['master']", dtype=torch.float32)
            masters.append((_flat(e, e.piece.data, e.key), saved))
        if e.optimized and owned:
            value = form.load(optimizer, state["optimizer"], meta["optimizer_state"], e)
            if value is not None:
                loaded[id(e.piece)] = value
        if mid_window:
            grad = state["window_grad"].get(e.key)
            if grad is None:
                raise ValueError(f"state['window_grad'][{e.key!r}] is missing for a state saved mid-window")
            chunk = where[e.layout_index]
            grads[e.key] = _take(grad, e, "state['window_grad']", chunk.start, chunk.numel, torch.float32)
    return masters, loaded, grads


def _load_optimizer(acc: AccumulatorParts, meta: dict[str, Any], entries: list[_Entry],
                    loaded: dict[int, dict[str, Any]]) -> None:
    """The optimizer's state and param groups as saved (``Optimizer.load_state_dict``); the state of a parameter the
    accumulator does not train is kept."""
    optimizer = acc.optimizer
    if optimizer is None:
        return
    held = {id(e.piece) for e in entries if e.piece is not None}
    numbered, opt_groups, index = {}, [], 0
    for g, group in enumerate(optimizer.param_groups):
        ids = []
        for q in group["params"]:
            if id(q) in loaded:
                numbered[index] = loaded[id(q)]
            elif id(q) not in held and optimizer.state.get(q):
                numbered[index] = optimizer.state[q]  # a parameter the accumulator does not train: kept
            ids.append(index)
            index += 1
        opt_groups.append({**meta["param_groups"][g], "params": ids})
    optimizer.load_state_dict({"state": numbered, "param_groups": opt_groups})


def _optimizer_type(optimizer: torch.optim.Optimizer | None) -> str | None:
    """The optimizer's class as ``module.qualname`` (what a state dict's optimizer part was made by), or None."""
    if optimizer is None:
        return None
    type_name = getattr(optimizer, "type_name", None)  # a list of optimizers names each one's class
    return type_name() if callable(type_name) else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _check_optimizer(meta: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> None:
    """``ValueError`` naming the key when the state's optimizer is of another type (``optimizer_type``; states saved
    before it was recorded are not checked for it) or a param group has other hyper-parameter keys than this
    optimizer's: torch's ``Optimizer.load_state_dict`` would take the saved groups as they are, and the next step
    fail (``KeyError: 'betas'``) or run another optimizer's update. The number of groups is checked before."""
    saved_type = meta.get("optimizer_type")
    mine = _optimizer_type(optimizer)
    if saved_type is not None and saved_type != mine:
        raise ValueError(f"state['meta']['optimizer_type'] is {saved_type}, this accumulator's optimizer is {mine}: "
                         "build the optimizer the saved run used, or load only the model's state dict and start the "
                         "optimizer afresh")
    for g, saved in enumerate(meta["param_groups"]):
        keys = set(optimizer.param_groups[g]) - {"params"}
        missing, extra = sorted(keys - set(saved)), sorted(set(saved) - keys)
        if missing or extra:
            key = (missing or extra)[0]
            where = "missing from the state" if missing else "in the state, not in this optimizer's groups"
            raise ValueError(f"state['meta']['param_groups'][{g}][{key!r}] is {where}: the state was saved with "
                             f"another optimizer ({len(missing)} key(s) missing, {len(extra)} extra); build the "
                             "optimizer the saved run used")


def _layout_order(acc: AccumulatorParts) -> list[int]:
    reg = {id(p): i for i, p in enumerate(acc.registered_params)}
    return [reg[id(p)] for p in acc.params]


# ---------------------------------------------------------------------------------------------------------------
# State dicts of earlier gaengine versions


def upgrade(state: dict[str, Any], acc: HasParts | None = None) -> dict[str, Any]:
    """``state``, a state dict saved by an earlier gaengine, in today's format (``gaengine.formats.STATE_FORMAT``,
    what ``acc.state_dict()`` returns and ``acc.load_state_dict`` loads); a ``STATE_FORMAT`` state as it is.

    * ``ZERO_FORMAT`` (``zero_stage >= 1`` before ``STATE_FORMAT``, DCP): after ``dcp.load`` into this run's
      ``acc.state_dict()`` as always, ``acc.load_state_dict(upgrade(state))``; ``acc`` is not needed. The same
      tensors, a new meta blob (its ranges were the reduced sums: the mode, no per-rank window rows).
    * ``PLAIN_FORMAT`` (``zero_stage=0`` before ``STATE_FORMAT``: ``torch.save``d whole CPU tensors in the saved
      run's flat layout, the optimizer's state dict saved beside it): its values are laid out by ``acc``, a
      replicated accumulator (``zero_stage=0`` or one rank) over the saved run's model. Load the model's and the
      optimizer's state dicts first, then ``upgrade(state, acc)`` loads ``state`` into ``acc`` (the masters of the
      flat layout before ``gaengine.store`` moved into the store's) and returns ``acc.state_dict()``: views of
      ``acc``'s buffers, to ``torch.save`` (or ``dcp.save``) at once; loading it into ``acc`` again changes nothing.

    Raises ``ValueError`` (``acc`` unchanged) for a format gaengine never wrote, an ``FSDP2_FORMAT`` state (it held
    no optimizer state: refused as ``acc.load_state_dict`` refuses it, saying what to do), a ``PLAIN_FORMAT`` state
    without ``acc`` or with a sharded one (load it replicated, save, then load that anywhere), or of another model
    or world size."""
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt == STATE_FORMAT:
        return state
    if fmt == ZERO_FORMAT:
        meta = _read_meta(state)
        for key, ok in (("zero_stage", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                        ("sharded", lambda v: isinstance(v, bool))):
            if key not in meta or not ok(meta[key]):
                raise state_checks.corrupt(f"state['meta'][{key!r}]", "what a zero_stage state saved (an int >= 0 "
                                           "for zero_stage, a bool for sharded)", meta.get(key, "missing"))
        meta["mode"] = f"zero_stage={meta['zero_stage']}" if meta["sharded"] else None  # one rank: replicated
        meta["window_rows"] = False
        meta["optimizer_state"] = {}
        blob = io.BytesIO()
        torch.save(meta, blob)
        return {**state, "format": STATE_FORMAT, "meta": blob.getvalue()}
    if fmt == PLAIN_FORMAT:
        _load_plain_state(None if acc is None else acc.state_parts(), state)
        return acc.state_dict()
    if fmt == FSDP2_FORMAT:
        _check_format(state)  # raises: not convertible, and what to do instead
    got = fmt if isinstance(state, dict) else type(state).__name__
    raise ValueError(f"state has format {got!r}, none that gaengine wrote ({', '.join((STATE_FORMAT, *OLD_FORMATS))}):"
                     " pass a state dict gaengine saved")


def _load_plain_state(acc: AccumulatorParts | None, state: dict[str, Any]) -> None:
    """Load a ``PLAIN_FORMAT`` state into ``acc`` (``upgrade``): ``main_grad`` and ``master`` whole CPU tensors in
    the saved layout, the scalars beside them. ``ValueError``, nothing changed, for another model or world size,
    or an ``acc`` that is not replicated."""
    # The format of a replicated run: it loads where every rank holds the whole buffers in one flat layout
    # (RankLayout.holds_whole_grad).
    if acc is None or not acc.sharding.rank_layout.holds_whole_grad:
        where = ("no acc" if acc is None else f"acc is {acc.sharding.name} on {acc.world_size} rank(s)")
        raise ValueError(f"state is a {PLAIN_FORMAT} state dict (zero_stage=0, saved by an earlier gaengine): "
                         f"upgrade(state, acc) lays it out by a replicated accumulator (zero_stage=0, or one rank), "
                         f"{where}. Upgrade it there, then save acc.state_dict() (it loads at any zero_stage)")
    state_checks.check_plain_state(state)
    sharding = acc.sharding
    registration = acc.registered_params
    shapes = [list(p.shape) for p in registration]
    dtypes = [str(p.dtype) for p in registration]
    if [list(s) for s in state["param_shapes"]] != shapes or state["param_dtypes"] != dtypes:
        raise ValueError(
            f"state was saved for {len(state['param_shapes'])} parameters of shapes/dtypes "
            f"{list(zip(state['param_shapes'], state['param_dtypes']))[:4]}..., but this accumulator has "
            f"{len(shapes)} of {list(zip(shapes, dtypes))[:4]}...: it belongs to another model"
        )
    if state["world_size"] != sharding.world_size:
        raise ValueError(f"state was saved with world_size={state['world_size']}, this run has {sharding.world_size}")
    master, buffer = state["master"], sharding.master_buffer
    if master is not None and buffer is not None and master.numel() != buffer.data.numel():
        master = _masters_of_flat_layout(sharding.store, buffer.data, master)
    if (master is None) != (buffer is None) or (buffer is not None and master.numel() != buffer.data.numel()):
        raise ValueError("state's master weights do not match this accumulator's (optimizer or master_weights differ)")
    acc.stages.check_state_items(state)
    if state["main_grad"].numel() != sharding.main_grad.data.numel():
        raise ValueError(f"state['main_grad'] has {state['main_grad'].numel()} elements, this accumulator's main_grad "
                         f"{sharding.main_grad.data.numel()}: it belongs to another model or layout")
    sharding.set_layout([registration[i] for i in state["layout_order"]])  # .grad left is cleared: load_state_items
    with torch.no_grad():
        sharding.main_grad.data.copy_(state["main_grad"])
        if buffer is not None:
            buffer.data.copy_(master)
            sharding.store.copy_to_model()
    acc.stages.load_state_items(state)


def _masters_of_flat_layout(store: Any, buffer: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """The fp32 masters of a state dict saved before ``gaengine.store`` (one ``FlatLayout`` over the bf16, then
    the fp16 masters, in layout order at construction, each ``ALIGN_NUMEL``-aligned, where the store pads each
    dtype's span to a whole bucket), moved into the layout of ``store`` (``gaengine.store.ParameterStore``, its
    masters in ``buffer``); ``saved`` as it is when it is not that layout either (then the caller's size check
    refuses it)."""
    slots = [s for s in store.slots if s.master]
    slots = [s for dtype in (torch.bfloat16, torch.float16) for s in slots if s.param.dtype == dtype]
    old = FlatLayout.build([s.param for s in slots])
    if old.total_numel != saved.numel():
        return saved
    out = torch.zeros_like(buffer, device="cpu")
    base = buffer.storage_offset()
    for s, offset, numel in zip(slots, old.offsets, old.numels):
        at = s.piece.storage_offset() - base
        out[at:at + numel] = saved[offset:offset + numel]
    return out
