"""Sharded checkpoints through torch.distributed.checkpoint: real gloo processes saving on one world size and
loading on others, checked against the values every rank would hold unsharded (computed independently here)."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import gaengine
from gaengine.checkpoint import (PLAIN_FORMAT, FlatShard, Piece, gather_full, load_shard_state_dict, pieces_in_ranges,
                                 shard_state_dict, upgrade)
from tests.ranks import launch_scenario as launch
from tests.tolerances import clip_coef_rtol, gamma, recipe_param_rtol, rel_diff, split_batch_rtol, unit_roundoff

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
def _protocol(rank: int, world: int, cfg: dict) -> dict:
    path, mode = cfg["path"], cfg["mode"]
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


# A training run saved and resumed: fp32 Net (tied embedding, an unused layer) over G global micro-batches per update,
# rank r of W taking micro-batches r*K .. r*K+K-1 (K = G / W), so every world size trains on the same global batch.
G, B, STEPS, MAX_NORM, LR = 6, 2, 3, 0.05, 1e-2


def _train_data():
    g = torch.Generator().manual_seed(77)
    return (torch.randint(0, 11, (STEPS, G * B, 5), generator=g), torch.randint(0, 11, (STEPS, G * B, 5), generator=g))


def _groups(model):
    """Two param groups, the biases first (no weight decay), so an export must number by the groups as built."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
            {"params": [p for n, p in named if n.endswith("weight")]}]


def _build(stage, world):
    from tests.models import Net  # noqa: PLC0415

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=G // world, max_grad_norm=MAX_NORM,
                                       lr_scheduler=sched, zero_stage=stage)
    return model, opt, acc


def _mean_loss(model, tokens, labels):
    return torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 11), labels.reshape(-1))


def _save(model, acc, path):
    """The issue's pattern: the model's and the accumulator's state dicts are the whole checkpoint."""
    dcp.save({"model": model.state_dict(), "acc": acc.state_dict()}, checkpoint_id=path)


def _load(model, acc, path):
    """DCP's in-place pattern: the new run's own state dicts, filled by dcp.load, then loaded back."""
    state = {"model": model.state_dict(), "acc": acc.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    acc.load_state_dict(state["acc"])


def _train(rank: int, world: int, cfg: dict) -> dict:
    """Train to the end, saving at cfg["saves"] = {(update, micro-batch): path}, or first loading cfg["load"]."""
    model, _, acc = _build(cfg["stage"], world)
    k_steps = G // world
    if cfg.get("load"):
        try:
            _load(model, acc, cfg["load"])
        except ValueError as exc:
            if cfg.get("expect_refusal"):
                return {"error": str(exc)}
            raise
    tokens, labels = _train_data()
    saves = dict(cfg.get("saves", {}))
    for update in range(acc.schedule.update_index, STEPS):
        for k in range(acc.num_micro_batches, k_steps):
            lo = (rank * k_steps + k) * B
            acc.backward(_mean_loss(model, tokens[update, lo:lo + B], labels[update, lo:lo + B]))
            if (update, k + 1) in saves and k + 1 < k_steps:
                _save(model, acc, saves[update, k + 1])
        acc.step()
        if (update + 1, 0) in saves:
            _save(model, acc, saves[update + 1, 0])
    return {"params": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "optimizer": gaengine.full_optimizer_state_dict(acc),
            "lr": acc.optimizer.param_groups[0]["lr"]}


def _snapshot(model, acc) -> dict:
    """Everything a resume must restore, as plain tensors: the model, the optimizer state gathered whole, and this
    rank's master weights by parameter key with the first element of the range it holds."""
    from gaengine.checkpoint import _entries  # noqa: PLC0415 - which master range this rank holds

    masters = {e.key: (e.lo, e.piece.detach().reshape(-1).clone()) for e in _entries(acc)
               if e.master and e.piece is not None}
    return {"params": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "optimizer": gaengine.full_optimizer_state_dict(acc), "masters": masters}


def _bf16_resume(rank: int, world: int, cfg: dict) -> dict:
    """bf16 parameters with fp32 master weights: save after the first update (cfg["save"]) or load (cfg["load"]);
    the state just saved or just loaded, and the parameters after the last update."""
    from tests.models import Net  # noqa: PLC0415

    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    opt = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    k_steps = G // world
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=k_steps, max_grad_norm=MAX_NORM,
                                       lr_scheduler=sched, zero_stage=cfg["stage"])
    tokens, labels = _train_data()
    snapshot = None
    if cfg.get("load"):
        _load(model, acc, cfg["load"])
        snapshot = _snapshot(model, acc)
    for update in range(acc.schedule.update_index, STEPS):
        for k in range(k_steps):
            lo = (rank * k_steps + k) * B
            logits = model(tokens[update, lo:lo + B]).float().reshape(-1, 11)
            acc.backward(torch.nn.functional.cross_entropy(logits, labels[update, lo:lo + B].reshape(-1)))
        acc.step()
        if update == 0 and cfg.get("save"):
            _save(model, acc, cfg["save"])
            snapshot = _snapshot(model, acc)
    return {"snapshot": snapshot, "final": {n: t.detach().clone() for n, t in model.state_dict().items()}}


SCENARIOS = {"protocol": _protocol, "train": _train, "bf16_resume": _bf16_resume}


def _scenario(name, cfg, rank, world, out):
    return SCENARIOS[name](rank, world, cfg)


def _launch(tmp_path, world, name, cfg):
    """Run scenario ``name`` on ``world`` gloo ranks (``tests.ranks.launch_scenario``); the ranks' results."""
    out = tmp_path / f"{name}{world}_{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    codes, results = launch(out, world, functools.partial(_scenario, name, cfg), join_s=240)
    assert codes == [0] * world, f"{name} on {world} rank(s) failed (see stderr)"
    return results


def _reference() -> tuple[dict, dict, float]:
    """The plain recipe in one process: each global micro-batch's fp32 gradient summed, divided by G, clipped by
    clip_grad_norm_, torch.optim.AdamW, StepLR; the final parameters, optimizer state dict and lr."""
    from tests.models import Net  # noqa: PLC0415

    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    opt = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    tokens, labels = _train_data()
    for update in range(STEPS):
        sums = [None] * len(params)
        for m in range(G):
            model.zero_grad(set_to_none=True)
            _mean_loss(model, tokens[update, m * B:(m + 1) * B], labels[update, m * B:(m + 1) * B]).backward()
            sums = [s if p.grad is None else p.grad.clone() if s is None else s + p.grad for s, p in zip(sums, params)]
        for p, s in zip(params, sums):
            p.grad = None if s is None else s / G
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        sched.step()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}, opt.state_dict(), opt.param_groups[0]["lr"]


def _check_against_reference(result: dict, reference: tuple, what: str) -> None:
    from tests.models import Net  # noqa: PLC0415

    ref_params, ref_opt, ref_lr = reference
    # StepLR's lr: at most STEPS + 1 fp64 roundings on each side.
    assert result["lr"] == pytest.approx(ref_lr, rel=2 * gamma(STEPS + 1, torch.float64)), what
    # The same unscaled micro-batch gradients summed over G in another order (over ranks), each side's own clip
    # coefficient; STEPS AdamW updates. The moments carry the gradients' error (v twice), 3 roundings per update.
    n = sum(t.numel() for name, t in ref_params.items() if name != "out.weight")  # tied to emb.weight
    grad_rtol = split_batch_rtol(G) + 2 * clip_coef_rtol(n)
    moment_rtol = STEPS * (2 * grad_rtol + 3 * unit_roundoff())
    for name, t in ref_params.items():
        assert rel_diff(result["params"][name], t) <= recipe_param_rtol(t, "adamw", LR, STEPS, grad_rtol), \
            f"{what}: parameter {name}"
    # The export loads into torch.optim.AdamW over the unsharded model, and holds the reference's state.
    model = Net()
    opt = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=0.1)
    opt.load_state_dict(result["optimizer"])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1], what
    assert sorted(result["optimizer"]["state"]) == sorted(ref_opt["state"]), what  # unused parameters: no state
    for i, ref_state in ref_opt["state"].items():
        got = opt.state_dict()["state"][i]
        assert float(got["step"]) == float(ref_state["step"]), f"{what}: step of parameter {i}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_diff(got[key], ref_state[key]) <= moment_rtol, f"{what}: {key} of parameter {i}"


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
    path = str(tmp_path / "ckpt")
    _launch(tmp_path, 2, "protocol", {"path": path, "mode": "save"})
    for world in (3, 1):
        results = _launch(tmp_path, world, "protocol", {"path": path, "mode": "load"})
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


@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
def test_zero_checkpoint_reshards_between_windows_and_resumes_mid_window(tmp_path, stage):
    """Saved on 2 ranks between windows, a run continues on 3 ranks and on 1; saved mid-window, it continues on 2
    and is refused on 3, naming both world sizes; every finished run (and the uninterrupted one that saved) matches
    the plain recipe in one process within 1e-5, and gaengine.full_optimizer_state_dict loads into
    torch.optim.AdamW with the reference's state."""
    boundary, mid = str(tmp_path / "boundary"), str(tmp_path / "mid")
    reference = _reference()
    runs = {"uninterrupted on 2": _launch(tmp_path, 2, "train", {"stage": stage, "saves": {(1, 0): boundary,
                                                                                            (1, 1): mid}})}
    for world in (3, 1):
        runs[f"between windows, 2 -> {world}"] = _launch(tmp_path, world, "train", {"stage": stage, "load": boundary})
    runs["mid-window, 2 -> 2"] = _launch(tmp_path, 2, "train", {"stage": stage, "load": mid})
    for what, results in runs.items():
        for rank, result in enumerate(results):
            _check_against_reference(result, reference, f"stage {stage}, {what}, rank {rank}")
    refused = _launch(tmp_path, 3, "train", {"stage": stage, "load": mid, "expect_refusal": True})
    for result in refused:
        assert "saved mid-window" in result["error"] and "on 2 rank(s)" in result["error"], result
        assert "this run has 3 rank(s)" in result["error"] and "between windows" in result["error"]


def _whole_masters(results: list[dict]) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master, assembled from the ranks' ranges (each element held by exactly one rank)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for result in results:
        for key, (lo, values) in result["snapshot"]["masters"].items():
            pieces.setdefault(key, []).append((lo, values))
    whole = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        assert [lo for lo, _ in parts] == list(itertools.accumulate([0] + [v.numel() for _, v in parts[:-1]])), key
        whole[key] = torch.cat([v for _, v in parts])
    return whole


@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
def test_bf16_masters_and_moments_survive_resharding_exactly(tmp_path, stage):
    """bf16 parameters with fp32 masters, saved on 2 ranks after the first update: loaded on 2, 3 or 1 rank(s), the
    masters (assembled from the ranks' ranges), the optimizer state (gathered whole) and the parameters are
    bitwise the ones saved; resumed on 2, the run ends bitwise where the uninterrupted one does."""
    path = str(tmp_path / "ckpt")
    saved = _launch(tmp_path, 2, "bf16_resume", {"stage": stage, "save": path})
    masters = _whole_masters(saved)
    assert masters and all(t.dtype == torch.float32 for t in masters.values())
    for world in (2, 3, 1):
        loaded = _launch(tmp_path, world, "bf16_resume", {"stage": stage, "load": path})
        got = _whole_masters(loaded)
        assert got.keys() == masters.keys()
        for key, t in masters.items():
            assert torch.equal(got[key], t), (world, key)
        for result in loaded:
            snap, ref = result["snapshot"], saved[0]["snapshot"]
            for name, t in ref["params"].items():
                assert torch.equal(snap["params"][name], t), (world, name)
            assert snap["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
            assert snap["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
            for i, state in ref["optimizer"]["state"].items():
                for key, t in state.items():
                    assert torch.equal(snap["optimizer"]["state"][i][key], t), (world, i, key)
        if world == 2:
            for rank in range(2):
                for name, t in saved[rank]["final"].items():
                    assert torch.equal(loaded[rank]["final"][name], t), (rank, name)


# ---------------------------------------------------------------- one format for every zero_stage
def _train_torch_save(stage: int, save_at=None, load=None) -> dict:
    """``_train`` on one rank, in this process, through the plain recipe's torch.save / torch.load(weights_only=True)
    of the model's, the optimizer's and the accumulator's state dicts (the optimizer's loaded too: a habit that must
    change nothing); saves to ``save_at = (update, micro-batch, path)`` or first loads ``load``."""
    model, opt, acc = _build(stage, 1)
    if load is not None:
        ckpt = torch.load(load, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        acc.load_state_dict(ckpt["acc"])
    tokens, labels = _train_data()
    for update in range(acc.schedule.update_index, STEPS):
        for k in range(acc.num_micro_batches, G):
            acc.backward(_mean_loss(model, tokens[update, k * B:(k + 1) * B], labels[update, k * B:(k + 1) * B]))
            if save_at is not None and save_at[:2] == (update, k + 1):
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "acc": acc.state_dict()},
                           save_at[2])
        acc.step()
    return {"params": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "optimizer": gaengine.full_optimizer_state_dict(acc), "lr": acc.optimizer.param_groups[0]["lr"]}


def _assert_same_run(got: dict, want: dict, what: str) -> None:
    assert got["lr"] == want["lr"], what
    for name, t in want["params"].items():
        assert torch.equal(got["params"][name], t), f"{what}: parameter {name}"
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys(), what
    for i, state in want["optimizer"]["state"].items():
        for key, t in state.items():
            assert torch.equal(got["optimizer"]["state"][i][key], t), f"{what}: {key} of parameter {i}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as documented
@pytest.mark.parametrize("saved,loaded", [(0, 1), (0, 2), (1, 0), (2, 0)], ids=lambda s: f"stage{s}")
def test_one_rank_state_loads_at_every_zero_stage_mid_window(tmp_path, saved, loaded):
    """One rank: a state saved mid-window at one zero_stage resumes at another, through torch.save and through DCP,
    bit for bit where the uninterrupted run ends (every zero_stage is the replicated strategy on one rank); the
    uninterrupted run matches the plain recipe within 1e-5."""
    path = str(tmp_path / "ckpt.pt")
    uninterrupted = _train_torch_save(saved, save_at=(1, 2, path))
    _check_against_reference(uninterrupted, _reference(), f"stage {saved} on one rank")
    _assert_same_run(_train_torch_save(loaded, load=path), uninterrupted, f"torch.save stage {saved} -> {loaded}")
    dcp_path = str(tmp_path / "dcp")
    _train(0, 1, {"stage": saved, "saves": {(1, 2): dcp_path}})
    _assert_same_run(_train(0, 1, {"stage": loaded, "load": dcp_path}), uninterrupted,
                     f"DCP stage {saved} -> {loaded}")


def test_replicated_state_round_trips_through_torch_save_as_plain_tensors(tmp_path):
    """zero_stage=0 on one rank: torch.save writes the state's FlatShards as plain CPU tensors (read back with
    weights_only=True), copies taken at save (training on does not change the file), and copy.deepcopy copies."""
    import copy  # noqa: PLC0415

    model, opt, acc = _build(0, 1)
    tokens, labels = _train_data()
    acc.backward(_mean_loss(model, tokens[0, :B], labels[0, :B]))
    state = acc.state_dict()
    grads = {k: v.local.clone() for k, v in state["window_grad"].items()}
    copied = copy.deepcopy(state)
    torch.save(state, tmp_path / "acc.pt")
    acc.backward(_mean_loss(model, tokens[0, B:2 * B], labels[0, B:2 * B]))  # the buffers move on
    back = torch.load(tmp_path / "acc.pt", weights_only=True)
    for key, t in grads.items():
        assert type(back["window_grad"][key]) is torch.Tensor and torch.equal(back["window_grad"][key], t), key
        assert torch.equal(copied["window_grad"][key].local, t), key
    _, _, other = _build(0, 1)
    with pytest.raises(ValueError, match="another model or optimizer"):
        other.load_state_dict({**back, "meta": _build_other_meta()})


def _build_other_meta() -> bytes:
    """The meta blob of an accumulator over another model (one Linear)."""
    model = torch.nn.Linear(3, 2)
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters()), accumulation_steps=2)
    return acc.state_dict()["meta"]


def _cross_modes(rank: int, world: int, cfg: dict) -> dict:
    """2 ranks: replicated and zero_stage=1 runs saving through DCP, resumed in the other mode between windows and
    in the same mode mid-window; a mid-window state of the other mode is refused."""
    d = cfg["dir"]
    out = {"replicated": _train(rank, world, {"stage": 0, "saves": {(1, 0): f"{d}/r_boundary", (1, 1): f"{d}/r_mid"}}),
           "stage1": _train(rank, world, {"stage": 1, "saves": {(1, 0): f"{d}/z_boundary"}})}
    out["replicated -> stage1 between windows"] = _train(rank, world, {"stage": 1, "load": f"{d}/r_boundary"})
    out["stage1 -> replicated between windows"] = _train(rank, world, {"stage": 0, "load": f"{d}/z_boundary"})
    out["replicated mid-window -> replicated"] = _train(rank, world, {"stage": 0, "load": f"{d}/r_mid"})
    try:
        _train(rank, world, {"stage": 1, "load": f"{d}/r_mid"})
        out["refused"] = None
    except CheckpointException as exc:  # dcp.load's own check, on every rank: the rows' size differs
        out["refused"] = str(exc)
    _, _, acc = _build(1, world)
    try:  # a replicated state of gaengine's earlier plain format is upgraded only by a replicated run
        upgrade({"format": PLAIN_FORMAT}, acc)
        out["plain refused"] = None
    except ValueError as exc:
        out["plain refused"] = str(exc)
    return out


SCENARIOS["cross_modes"] = _cross_modes


def test_two_rank_replicated_and_zero1_states_load_in_each_other(tmp_path):
    """2 ranks through DCP: a replicated state saved between windows resumes at zero_stage=1 and the reverse, each
    within 1e-5 of the plain recipe in one process; a replicated state saved mid-window resumes on 2 replicated
    ranks bit for bit where the uninterrupted run ends, and is refused at zero_stage=1 (DCP: the window's rows)."""
    reference = _reference()
    results = _launch(tmp_path, 2, "cross_modes", {"dir": str(tmp_path)})
    for rank, result in enumerate(results):
        for what in ("replicated", "stage1", "replicated -> stage1 between windows",
                     "stage1 -> replicated between windows", "replicated mid-window -> replicated"):
            _check_against_reference(result[what], reference, f"{what}, rank {rank}")
        _assert_same_run(result["replicated mid-window -> replicated"], result["replicated"], f"rank {rank}")
        refused = result["refused"]
        assert refused is not None and "Size mismatch" in refused and "acc.window_grad" in refused, refused
        refused = result["plain refused"]
        assert refused is not None and "zero_stage=1 on 2 rank(s)" in refused and "zero_stage=0" in refused, refused


def test_every_strategy_tags_its_scalars_with_the_one_format():
    """The strategies' FORMAT (the tag of the stages' state items) is gaengine.checkpoint.STATE_FORMAT."""
    from gaengine.checkpoint import STATE_FORMAT  # noqa: PLC0415
    from gaengine.sharding import Replicated, ZeroStage1, ZeroStage2  # noqa: PLC0415

    assert {Replicated.FORMAT, ZeroStage1.FORMAT, ZeroStage2.FORMAT} == {STATE_FORMAT}
    model, _, acc = _build(2, 1)
    assert acc.state_dict()["format"] == acc.state_parts().stages.state_items()["format"] == STATE_FORMAT
