"""Sharded checkpoints of the ZeRO stages through ``torch.distributed.checkpoint`` (DCP), and a full export.

At ``zero_stage >= 1`` each rank holds one contiguous range of the flat fp32 buffer of every bucket (the
masters, the optimizer's moments and, at stage 2, the gradient sum). The ranges depend on the world size
(buckets are padded to split evenly) and may cut a parameter in two, so a rank's range is not a ``DTensor``
``Shard`` placement. A checkpoint therefore stores every parameter's flattened tensor as one DCP tensor of
shape ``(numel,)`` and each rank writes the chunk it owns (``FlatShard``); DCP reads back whatever chunks the
loading ranks own, at any world size, straight into their flat buffers.

``FlatShard`` implements DCP's chunk protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, the one ``DTensor`` and torchrec's ``LocalShardsWrapper`` implement; source:
``torch/distributed/checkpoint/planner_helpers.py`` and ``utils.py``): the save planner asks it for its
write items, the load planner for its chunks, and both read or write the chunk through the view it returns.

The functions here are plain: a rank's flat shard and its ``Piece`` list in, per-parameter ``FlatShard``
views out (``shard_state_dict``), back (``load_shard_state_dict``), or gathered whole on every rank
(``gather_full``). ``GradientAccumulator.state_dict`` builds on them at ``zero_stage >= 1``;
``full_optimizer_state_dict`` gathers a state dict ``torch.optim.AdamW`` loads, for export.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["FlatShard", "Piece", "full_optimizer_state_dict", "gather_full", "load_shard_state_dict",
           "pieces_in_ranges", "shard_state_dict"]


class FlatShard(torch.Tensor):
    """One parameter's flattened tensor as DCP sees it: global shape ``(numel,)``, this rank's chunk a view.

    local: ``(length,)`` tensor, the chunk ``[start, start + length)`` of the flattened parameter; usually a view
        of the rank's flat shard buffer, so ``dcp.load`` writes into that buffer in place. ``length`` may be 0
        (the rank owns none of this parameter): it then writes and reads nothing.
    numel: elements of the whole parameter (all ranks' chunks together cover ``[0, numel)`` exactly once;
        DCP's save planner checks that and refuses overlaps or gaps).
    start: first element of the chunk inside the flattened parameter.

    Dtype and device are ``local``'s. It is a placeholder for checkpointing only: ``local`` holds the data;
    any torch operation on the wrapper itself raises ``NotImplementedError`` (use ``.local``).
    """

    local: torch.Tensor
    start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, numel: int, start: int) -> FlatShard:
        if local.dim() != 1:
            raise ValueError(f"FlatShard: local must be 1-D, got shape {tuple(local.shape)}")
        if not 0 <= start <= start + local.numel() <= numel:
            raise ValueError(f"FlatShard: chunk [{start}, {start + local.numel()}) does not lie in [0, {numel})")
        r = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        r.local, r.start = local, int(start)
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
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size()))
                for chunk in self._chunks()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"FlatShard(numel={self.shape[0]}, chunk=[{self.start}, {self.start + self.local.numel()}), "
                f"dtype={self.dtype}, device={self.device})")

    def __reduce_ex__(self, protocol):
        raise TypeError("a gaengine FlatShard holds one rank's chunk of a sharded tensor: save it with "
                        "torch.distributed.checkpoint (dcp.save), or export whole tensors with "
                        "gaengine.full_optimizer_state_dict")


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
        dist.all_gather_into_tensor(gathered, shard.contiguous(), group=group)
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


def full_optimizer_state_dict(acc: Any, device: torch.device | str | None = "cpu") -> dict[str, Any]:
    """Gather ``acc``'s optimizer state into the state dict of an unsharded optimizer over the model's parameters.

    acc: a ``GradientAccumulator`` with an optimizer, at any ``zero_stage``. At ``zero_stage >= 1`` every rank
        of its process group must call this (it all-gathers each moment); at stage 0 it only copies.
    device: where the returned tensors live (default CPU); None: the optimizer state's device.

    Returns ``{"state": {i: {"step": 0-d fp32, "exp_avg": <param's shape> fp32, ...}}, "param_groups": [...]}``
    numbered as ``torch.optim.Optimizer.state_dict`` numbers the parameters of the optimizer the user built
    (its param groups, in order, with their hyper-parameters): ``torch.optim.AdamW(<same groups>).
    load_state_dict(...)`` loads it (torch then casts the moments to each parameter's dtype). The tensors are
    copies. Raises ``ValueError`` when ``acc`` has no optimizer.
    """
    optimizer = getattr(acc, "optimizer", None)
    if optimizer is None:
        raise ValueError("full_optimizer_state_dict: acc has no optimizer (GradientAccumulator(..., optimizer=None))")
    gather = getattr(acc, "_full_optimizer_state", None)
    if gather is not None and getattr(acc, "zero_stage", 0) >= 1:
        return gather(device)
    saved = optimizer.state_dict()
    target = device

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to(device=value.device if target is None else target, copy=True)
        return value

    return {"state": {i: {k: copy(v) for k, v in s.items()} for i, s in saved["state"].items()},
            "param_groups": [dict(g) for g in saved["param_groups"]]}
