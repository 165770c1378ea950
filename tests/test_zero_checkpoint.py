"""Sharded checkpoints through torch.distributed.checkpoint: real gloo processes saving on one world size and
loading on others, checked against the values every rank would hold unsharded (computed independently here)."""

from __future__ import annotations

import datetime
import math
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from gaengine.checkpoint import FlatShard, Piece, gather_full, load_shard_state_dict, pieces_in_ranges, \
    shard_state_dict

pytestmark = pytest.mark.multiproc

# Odd sizes: a single element, sizes around the padding quantum, a parameter longer than one rank's share.
SHAPES = [(1,), (127,), (3, 5), (4097,), (2, 64), (33,)]
NUMELS = [math.prod(s) for s in SHAPES]
KEYS = [f"p{i}" for i in range(len(SHAPES))]
QUANTUM = 8  # elements; the engine pads buckets to lcm(world, 128), a smaller one cuts more parameters here


def _layout(world: int) -> tuple[list[int], int, list[list[tuple[int, int, int]]]]:
    """Two buckets, each padded to a multiple of QUANTUM * world and split evenly; parameter starts aligned to 4.

    Returns (param_offsets, shard_numel, ranges per rank as (flat_start, flat_end, shard_offset))."""
    buckets = [[0, 1, 2], [3, 4, 5]]
    offsets, pos, ranges = [0] * len(NUMELS), 0, [[] for _ in range(world)]
    shard_numel = 0
    for bucket in buckets:
        start = pos
        for i in bucket:
            offsets[i] = pos
            pos = -(-(pos + NUMELS[i]) // 4) * 4
        q = QUANTUM * world
        pos = start + -(-(pos - start) // q) * q
        share = (pos - start) // world
        for r in range(world):
            ranges[r].append((start + r * share, start + (r + 1) * share, shard_numel))
        shard_numel += share
    return offsets, shard_numel, ranges


def _full(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(SHAPES[i], generator=g, dtype=torch.float64).float()


def _rank_pieces(world: int, rank: int) -> tuple[int, list[Piece]]:
    offsets, shard_numel, ranges = _layout(world)
    return shard_numel, pieces_in_ranges(offsets, NUMELS, ranges[rank])


# ---------------------------------------------------------------- worker side
def _protocol(rank: int, world: int, path: str, mode: str) -> dict:
    shard_numel, pieces = _rank_pieces(world, rank)
    shard = torch.full((shard_numel,), float("nan"))  # poisoned: a piece left unwritten shows
    if mode == "save":
        for piece in pieces:
            shard[piece.offset:piece.offset + piece.length] = _full(piece.param).reshape(-1)[
                piece.start:piece.start + piece.length]
    state = {"acc": {"moments": shard_state_dict(shard, pieces, NUMELS, KEYS), "step": torch.tensor(7.0)}}
    if mode == "save":
        dcp.save(state, checkpoint_id=path)
        return {}
    dcp.load(state, checkpoint_id=path)
    before = shard.clone()
    load_shard_state_dict(shard, pieces, NUMELS, KEYS, state["acc"]["moments"])  # in place: nothing to copy
    assert torch.equal(shard.nan_to_num(0.0), before.nan_to_num(0.0))
    all_pieces = [_rank_pieces(world, r)[1] for r in range(world)]
    return {"pieces": [(p.param, p.start, p.length) for p in pieces],
            "values": {p.param: shard[p.offset:p.offset + p.length].clone() for p in pieces},
            "step": state["acc"]["step"].clone(),
            "gathered": gather_full(shard, all_pieces, [torch.Size(s) for s in SHAPES],
                                    group=dist.group.WORLD if world > 1 else None)}


SCENARIOS = {"protocol": _protocol}


def _worker(rank, world, init_file, scenario, path, mode, out):
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(SCENARIOS[scenario](rank, world, path, mode), os.path.join(out, f"{mode}{world}_rank{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if world > 1:
            dist.destroy_process_group()


def _launch(tmp_path, world, scenario, mode, join_s=120):
    path = str(tmp_path / "ckpt")
    init = str(tmp_path / f"store_{mode}{world}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, init, scenario, path, mode, str(tmp_path)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{scenario} {mode} on {world}: {len(alive)} rank(s) hung"
    assert [p.exitcode for p in procs] == [0] * world, f"{scenario} {mode} on {world} failed (see stderr)"
    return [torch.load(tmp_path / f"{mode}{world}_rank{r}.pt") for r in range(world)]


# ---------------------------------------------------------------- tests
def test_layout_cuts_parameters_and_covers_each_once():
    """The test layout itself: some parameter is cut between ranks, and every element has exactly one owner."""
    for world in (1, 2, 3):
        seen = [torch.zeros(n, dtype=torch.int32) for n in NUMELS]
        cut = False
        for rank in range(world):
            for p in _rank_pieces(world, rank)[1]:
                seen[p.param][p.start:p.start + p.length] += 1
                cut |= p.length < NUMELS[p.param]
        assert all(bool((s == 1).all()) for s in seen)
        assert cut or world == 1


def test_dcp_save_on_two_ranks_loads_on_three_and_one(tmp_path):
    """Per-parameter FlatShards written by 2 ranks are read back exactly by 3 ranks and by 1 (and gathered whole)."""
    _launch(tmp_path, 2, "protocol", "save")
    for world in (3, 1):
        results = _launch(tmp_path, world, "protocol", "load")
        covered = [0] * len(NUMELS)
        for rank, res in enumerate(results):
            assert float(res["step"]) == 7.0
            for param, start, length in res["pieces"]:
                expect = _full(param).reshape(-1)[start:start + length]
                assert torch.equal(res["values"][param], expect), (world, rank, param)
                covered[param] += length
            for i, t in enumerate(res["gathered"]):
                assert torch.equal(t, _full(i)), (world, rank, i)
        assert covered == NUMELS


def test_load_shard_state_dict_from_whole_tensors_and_errors():
    """A whole (unsharded) state fills each piece with its slice; a wrong key, size or chunk is refused before
    anything is written."""
    world, rank = 3, 1
    shard_numel, pieces = _rank_pieces(world, rank)
    shard = torch.full((shard_numel,), float("nan"))
    load_shard_state_dict(shard, pieces, NUMELS, KEYS, {k: _full(i) for i, k in enumerate(KEYS)})
    for p in pieces:
        assert torch.equal(shard[p.offset:p.offset + p.length], _full(p.param).reshape(-1)[p.start:p.start + p.length])
    before = shard.clone()
    full = {k: _full(i) for i, k in enumerate(KEYS)}
    with pytest.raises(ValueError, match=r"exp_avg\['p3'\] is missing"):
        load_shard_state_dict(shard, pieces, NUMELS, KEYS, {k: v for k, v in full.items() if k != "p3"}, "exp_avg")
    with pytest.raises(ValueError, match=r"'p0'\] has 2 elements"):
        load_shard_state_dict(shard, pieces, NUMELS, KEYS, {**full, "p0": torch.zeros(2)})
    other = shard_state_dict(torch.zeros(_rank_pieces(2, 0)[0]), _rank_pieces(2, 0)[1], NUMELS, KEYS)
    with pytest.raises(ValueError, match="this rank owns"):
        load_shard_state_dict(shard, pieces, NUMELS, KEYS, other)
    assert torch.equal(shard.nan_to_num(0.0), before.nan_to_num(0.0))


def test_flat_shard_refuses_torch_ops_and_pickling():
    s = FlatShard(torch.arange(3.0), 10, 4)
    assert s.shape == (10,) and s.dtype == torch.float32 and "chunk=[4, 7)" in repr(s)
    with pytest.raises(NotImplementedError, match="FlatShard.local"):
        s + 1
    with pytest.raises(TypeError, match="dcp.save"):
        torch.save(s, "/dev/null")
    with pytest.raises(ValueError, match="does not lie in"):
        FlatShard(torch.arange(3.0), 5, 4)
