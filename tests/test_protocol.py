"""gaengine's collectives on 2 gloo ranks as one protocol (issue 41, N8, N9; ``gaengine.protocol``).

A rank that dies at any of gaengine's collectives, or drops a window the other rank goes on with, gives gaengine's
own error (``RuntimeError`` starting "gaengine:") on every surviving rank within the process group's timeout (30 s
here), never a signal and never a raw gloo message. Before: a rank that dropped a window mid-way made gloo abort a
process (SIGABRT, mismatched sizes); a death at the construction agreement or at the window's parameter-change
all-reduce surfaced as gloo's "Connection closed by peer"; a window applied on one rank and dropped on the other
went unnoticed. Where both ranks live, the test also goes on: every rank calls ``acc.zero_grad()`` and one more
window trains alike on both (their parameters bitwise equal).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gaengine
from tests.ranks import launch_scenario

pytestmark = pytest.mark.multiproc

K = 3
TIMEOUT_S = 30.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _build(model: nn.Module) -> gaengine.GradientAccumulator:
    return gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=K,
                                        max_grad_norm=None, bucket_size_mb=1e-6)  # a bucket per parameter


def _loss(model: nn.Module, rank: int, window: int, k: int) -> torch.Tensor:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * window + 10 * k + rank))
    return model(x).square().mean()


def _die() -> None:
    sys.stdout.flush()
    os._exit(3)


def _outcome(fn) -> str | None:
    """Run ``fn``; the error it raised as "Type: message" (any RuntimeError as "RuntimeError"), or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts what it was
        return f"{'RuntimeError' if isinstance(exc, RuntimeError) else type(exc).__name__}: {exc}"
    return None


def _window(acc, model, rank: int, window: int) -> None:
    for k in range(K):
        acc.backward(_loss(model, rank, window, k))
    acc.step()


def _go_on(acc, model, rank: int) -> bool:
    """Both ranks drop what they hold and train one more window: their parameters equal afterwards."""
    acc.zero_grad()
    _window(acc, model, rank, 9)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    return torch.equal(gathered[0], gathered[1])


# ------------------------------------------------------------------------------------------------ a rank dies
def _dies_at_construction_header(rank, world, out):
    if rank == 1:
        _die()
    return _outcome(lambda: _build(_model()))


def _dies_at_construction_agreement(rank, world, out):
    if rank == 1:  # past the header, dies in the settings' all_gather_object
        dist.all_gather_object = lambda *args, **kwargs: _die()
    return _outcome(lambda: _build(_model()))


def _dies_at_window_start(rank, world, out):
    model = _model()
    acc = _build(model)
    _window(acc, model, rank, 0)
    if rank == 1:  # dies before the next window's parameter-change all-reduce
        _die()
    return _outcome(lambda: _window(acc, model, rank, 1))


def _dies_at_reductions(rank, world, out):
    model = _model()
    acc = _build(model)
    if rank == 1:  # dies before its last micro-batch (the reductions' header)
        for k in range(K - 1):
            acc.backward(_loss(model, rank, 0, k))
        _die()
    return _outcome(lambda: _window(acc, model, rank, 0))


def _dies_at_stats(rank, world, out):
    model = _model()
    acc = _build(model)
    if rank == 1:  # dies where its last backward launches the remaining buckets and the stats all-reduce
        import gaengine.reduce  # noqa: PLC0415
        gaengine.reduce.launch_window_stats = lambda *args, **kwargs: _die()
    return _outcome(lambda: _window(acc, model, rank, 0))


def _dies_at_checkpoint(rank, world, out):
    model = _model()
    acc = _build(model)
    acc.backward(_loss(model, rank, 0, 0))
    if rank == 1:  # dies before the mid-window state_dict()'s agreement (its header, then all_gather_object)
        _die()
    return _outcome(acc.state_dict)


DEATHS = {"construction_header": _dies_at_construction_header,
          "construction_agreement": _dies_at_construction_agreement,
          "window_start": _dies_at_window_start, "reductions": _dies_at_reductions, "stats": _dies_at_stats,
          "checkpoint": _dies_at_checkpoint}


@pytest.mark.parametrize("where", list(DEATHS))
def test_a_rank_dying_at_a_collective_gives_gaengines_error(tmp_path, where):
    codes, results = launch_scenario(tmp_path, 2, DEATHS[where], timeout_s=TIMEOUT_S, join_s=60,
                                     abandons_group=True)
    assert codes[0] == 0 and codes[1] == 3, f"exit codes {codes} (negative: killed by a signal)"
    error = results[0]
    assert error is not None and error.startswith("RuntimeError: gaengine:"), error
    assert "Connection closed" not in error and "gloo" not in error.lower(), error


# ------------------------------------------------------------------------------------------------ a rank drops
def _drops_before_last(rank, world, out):
    """N8: rank 1 catches an error in micro-batch 1 of a window, calls zero_grad() and goes on; rank 0 goes on with
    the window. Rank 0's reductions header meets rank 1's next window-start header."""
    model = _model()
    acc = _build(model)
    errors = []
    if rank == 1:
        acc.backward(_loss(model, rank, 0, 0))
        acc.zero_grad()  # "an error in micro-batch 1": the window is dropped on this rank only
        errors.append(_outcome(lambda: _window(acc, model, rank, 1)))
    else:
        errors.append(_outcome(lambda: _window(acc, model, rank, 0)))
    return errors, _go_on(acc, model, rank)


class _Boom(Exception):
    pass


def _raise_in_backward(grad):
    raise _Boom("an error inside backward")


def _failing_backward(acc, model, rank: int, window: int, k: int) -> str | None:
    """Micro-batch ``k`` of ``window`` whose backward raises at ``model[0].weight`` (the last bucket to arrive: the
    buckets before it reduced); its outcome."""
    handle = model[0].weight.register_hook(_raise_in_backward)
    try:
        return _outcome(lambda: acc.backward(_loss(model, rank, window, k)))
    finally:
        handle.remove()


def _drops_in_last(rank, world, out):
    """Rank 1's last micro-batch raises inside backward (after the reductions' header, some buckets launched);
    it calls zero_grad() and goes on. Its zero_grad() completes the reductions, so rank 0's step() raises naming
    it."""
    model = _model()
    acc = _build(model)
    _window(acc, model, rank, 0)  # the first window learned the layout: the reducer launches during backward
    errors = []
    if rank == 1:
        for k in range(K - 1):
            acc.backward(_loss(model, rank, 1, k))
        errors.append(_failing_backward(acc, model, rank, 1, K - 1))
        acc.zero_grad()
        errors.append(_outcome(lambda: _window(acc, model, rank, 2)))
    else:
        errors.append(_outcome(lambda: _window(acc, model, rank, 1)))
        acc.zero_grad()
        errors.append(_outcome(lambda: _window(acc, model, rank, 2)))
    return errors, _go_on(acc, model, rank)


def _raise_before_update():
    raise _Boom("an error in before_update")


def _drops_after_stats(rank, world, out, first_window: bool = False):
    """Rank 1's step() raises in before_update (its reductions and stats done) and it drops the window: rank 0
    applied it. The next window's first header carries each rank's update count: both raise there. In the first
    window (``first_window``) rank 0's step() then broadcasts the layout it learned: its header meets rank 1's
    window-start header, and both raise there."""
    model = _model()
    acc = _build(model)
    if not first_window:
        _window(acc, model, rank, 0)
    errors = []
    for k in range(K):
        acc.backward(_loss(model, rank, 1, k))
    if rank == 1:
        errors.append(_outcome(lambda: acc.step(before_update=_raise_before_update)))
        acc.zero_grad()
    else:
        errors.append(_outcome(acc.step))
    if not errors[-1] or not errors[-1].startswith("RuntimeError"):  # rank 0's step() raised: it stops there
        errors.append(_outcome(lambda: _window(acc, model, rank, 2)))
    return [e for e in errors if e is not None], None


def _drops_after_stats_in_first_window(rank, world, out):
    return _drops_after_stats(rank, world, out, first_window=True)


def _drops_at_construction(rank, world, out):
    """Rank 1 closes its accumulator after a window and builds a new one, while rank 0 goes on to its next window:
    rank 1's construction header meets rank 0's window-start header."""
    model = _model()
    acc = _build(model)
    _window(acc, model, rank, 0)
    if rank == 1:
        acc.close()
        return [_outcome(lambda: _build(model))], None
    return [_outcome(lambda: _window(acc, model, rank, 1))], None


DROPS = {"before_last": _drops_before_last, "in_last": _drops_in_last, "after_stats": _drops_after_stats,
         "after_stats_first_window": _drops_after_stats_in_first_window, "construction": _drops_at_construction}


def _every_drop(rank, world, out):
    """Every case of ``DROPS`` in turn, each with its own model and accumulator (one launch)."""
    return {where: scenario(rank, world, out) for where, scenario in DROPS.items()}


def test_a_rank_dropping_a_window_gives_gaengines_error_on_every_rank(tmp_path):
    codes, results = launch_scenario(tmp_path, 2, _every_drop, timeout_s=TIMEOUT_S, join_s=90)
    assert codes == [0, 0], f"exit codes {codes} (negative: killed by a signal)"
    for where in DROPS:
        for rank in range(2):
            errors, went_on = results[rank][where]
            gaengine_errors = [e for e in errors if e is not None and e.startswith("RuntimeError: gaengine:")]
            # in_last: the rank that dropped its window completed its reductions; only the other one has an error
            assert gaengine_errors or (where == "in_last" and rank == 1), f"{where}, rank {rank}: {errors}"
            assert all(e is None or e.startswith(("RuntimeError: gaengine:", "_Boom")) for e in errors), errors
            assert went_on in (None, True), f"{where}, rank {rank}: the ranks differ after going on together"
        first = results[0][where][0][0]
        if where == "in_last":  # rank 0's step() names the rank that dropped
            assert "rank(s) 1 dropped this accumulation window" in first, first
        else:
            assert "different collectives of gaengine's" in first, first


# ------------------------------------------------------------------ every micro-batch reduces, checkpoints, close()
def _sharded(model: nn.Module, kind: str) -> gaengine.GradientAccumulator:
    """``kind``: "zero2" (zero_stage=2, a bucket per parameter) or "fsdp2" (the model fully sharded first)."""
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=K,
                                        max_grad_norm=None, bucket_size_mb=1e-6, zero_stage=2 if kind == "zero2" else 0)


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def _sharded_go_on(acc, model: nn.Module, rank: int) -> bool:
    """``_go_on`` for a sharded model (its parameters compared whole), then ``acc.close()``."""
    acc.zero_grad()
    _window(acc, model, rank, 9)
    flat = _full(model)
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    acc.close()
    return torch.equal(gathered[0], gathered[1])


def _sharded_drop(rank, kind: str, inside: bool):
    """zero_stage=2 or FSDP2, where every micro-batch reduces: after a window, rank 1 drops the next one after its
    first micro-batch (``inside``: its second micro-batch's backward raises after some buckets were reduce-scattered)
    and starts another, while rank 0 goes on with the window. Before: rank 1's next collective met rank 0's
    reduce-scatter, and gloo aborted a process (SIGABRT, 128 vs 40 bytes)."""
    model = _model()
    acc = _sharded(model, kind)
    _window(acc, model, rank, 0)
    errors = []
    if rank == 1:
        acc.backward(_loss(model, rank, 1, 0))
        if inside:
            errors.append(_failing_backward(acc, model, rank, 1, 1))
        acc.zero_grad()
        errors.append(_outcome(lambda: _window(acc, model, rank, 2)))
    else:
        errors.append(_outcome(lambda: _window(acc, model, rank, 1)))
    return errors, _sharded_go_on(acc, model, rank)


def _uneven_zero2(rank, world, out):
    """zero_stage=2, K=3: rank 0's window ends after one micro-batch (``step(force=True)``, an epoch's end) while rank
    1's holds three. Rank 0's reductions header meets rank 1's micro-batch header: both raise, nothing applied, and
    after ``zero_grad()`` on both they train on alike. Before the micro-batch header, rank 0's header met rank 1's
    reduce-scatter."""
    model = _model()
    acc = _sharded(model, "zero2")
    _window(acc, model, rank, 0)
    if rank == 0:
        acc.backward(_loss(model, rank, 1, 0))
        errors = [_outcome(lambda: acc.step(force=True))]
    else:
        errors = [_outcome(lambda: _window(acc, model, rank, 1))]
    return errors, _sharded_go_on(acc, model, rank)


def _checkpoint_mid_window(rank, world, out):
    """Rank 0 saves mid-window (``acc.state_dict()``: its agreement gathers every rank's window counters) while
    rank 1 goes on to the window's last micro-batch. Before: rank 0's all_gather_object met rank 1's header."""
    model = _model()
    acc = _build(model)
    acc.backward(_loss(model, rank, 0, 0))
    if rank == 0:
        errors = [_outcome(acc.state_dict)]
    else:
        errors = [_outcome(lambda: [acc.backward(_loss(model, rank, 0, k)) for k in range(1, K)])]
    return errors, _go_on(acc, model, rank)


def _close_after_failed_last(rank, world, out):
    """Rank 1's last micro-batch raises inside backward (some buckets all-reduced) and it calls ``acc.close()``:
    its reductions are completed (its count marked dropped), so rank 0's step() raises gaengine's count error
    naming it instead of waiting for buckets that never come; nothing is left in flight on rank 1. Before: rank 0
    waited out the timeout, and rank 1's next collective (the closing barrier) met its bucket all-reduce."""
    model = _model()
    acc = _build(model)
    _window(acc, model, rank, 0)
    if rank == 1:
        for k in range(K - 1):
            acc.backward(_loss(model, rank, 1, k))
        errors = [_failing_backward(acc, model, rank, 1, K - 1)]
        acc.close()
        return errors, all(b.work is None for b in acc.reducer.buckets) and acc.window.stats is None
    errors = [_outcome(lambda: _window(acc, model, rank, 1))]
    acc.close()
    return errors, True


def _every_sharded_case(rank, world, out):
    return {"zero2": _sharded_drop(rank, "zero2", inside=False),
            "zero2_inside_backward": _sharded_drop(rank, "zero2", inside=True),
            "fsdp2": _sharded_drop(rank, "fsdp2", inside=False),
            "zero2_uneven": _uneven_zero2(rank, world, out),
            "checkpoint": _checkpoint_mid_window(rank, world, out),
            "close": _close_after_failed_last(rank, world, out)}


def test_drops_where_every_micro_batch_reduces_checkpoints_and_close_give_gaengines_error(tmp_path):
    codes, results = launch_scenario(tmp_path, 2, _every_sharded_case, timeout_s=TIMEOUT_S, join_s=90)
    assert codes == [0, 0], f"exit codes {codes} (negative: killed by a signal)"
    for where in results[0]:
        for rank in range(2):
            errors, ok = results[rank][where]
            assert ok, f"{where}, rank {rank}: the ranks differ after going on together, or a reduction is pending"
            assert all(e is None or e.startswith(("RuntimeError: gaengine:", "_Boom")) for e in errors), errors
            if where == "close" and rank == 1:
                assert errors[0].startswith("_Boom"), errors
                continue
            assert any(e is not None and e.startswith("RuntimeError: gaengine:") for e in errors), (where, rank, errors)
    close_error = results[0]["close"][0][0]
    assert "rank(s) 1 dropped" in close_error, close_error
