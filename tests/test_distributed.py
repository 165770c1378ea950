"""Multi-rank accumulation as real processes on CPU with gloo, against one process and torch DDP + no_sync().

The ranks' accumulators take the default backend (``backend="auto"``); the ``cuda-emu`` cases make it the cuda backend
over the emulated build (``tests/cuda_emu``: csrc/cuda's kernels and the native hot path on CPU tensors, armed last
micro-batches calling the reducer from ``HotPath``), in every rank (``tests/emulated_cuda.py``).
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time

import pytest
import torch
from torch import nn

import gaengine
from gaengine import backends
from gaengine.reduce import BucketReducer
from tests import emulated_cuda
from tests.models import D, Net, SharedCheckpointed
from tests.oracle_hooks import use_hooks
from tests.ranks import launch_scenario
from tests.tolerances import (mean_rtol, recipe_grad_rtol, recipe_param_rtol, rel_diff, split_batch_rtol, sum_rtol,
                              unit_roundoff, update_rtol)

pytestmark = pytest.mark.multiproc

K, B, STEPS, MAX_NORM = 3, 2, 3, 0.05
NET_DEPTH, NET_WIDTH = 5, 16  # Net's matmuls (embedding, 3 blocks, the tied output), as tests/tolerances.py counts


def _net_grad_rtol(world, n_params=0):
    """Net's window gradient on ``world`` ranks against one process: ``recipe_grad_rtol`` over the global batch's
    tokens, each side's clip coefficient when ``n_params`` is given."""
    return recipe_grad_rtol(world * K * B * 5, NET_DEPTH, NET_WIDTH, n_params)


def _data(world):
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, 11, (STEPS, world * K * B, 5), generator=g)
    labels = torch.randint(0, 11, (STEPS, world * K * B, 5), generator=g)
    return tokens, labels


def _mean_loss(model, tokens, labels, **kw):
    return nn.functional.cross_entropy(model(tokens, **kw).reshape(-1, 11), labels.reshape(-1))


def _micro(tokens, labels, step, rank, k):
    """Micro-batch k of `rank` in update `step`: rows laid out rank-major, so one process sees them in order."""
    lo = (rank * K + k) * B
    return tokens[step, lo:lo + B], labels[step, lo:lo + B]


def _make_opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


# ---------------------------------------------------------------- worker side
def _scenario_equivalence(rank, world, out):
    # Python entered from the hooks: bucket_ready once per complete bucket. Counted on the class: every re-layout
    # makes a new reducer. (This worker process is the test's alone.)
    calls = {"bucket_ready": 0}
    for name in calls:
        original = getattr(BucketReducer, name)

        def counted(self, *args, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *args)

        setattr(BucketReducer, name, counted)
    torch.manual_seed(0)
    model = Net()
    ddp_model = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, _make_opt(model.parameters()), accumulation_steps=K,
                                       max_grad_norm=MAX_NORM, bucket_size_mb=0.0005)
    ddp = nn.parallel.DistributedDataParallel(ddp_model, find_unused_parameters=True)
    ddp_opt = _make_opt(ddp.parameters())
    tokens, labels = _data(world)
    issued, launches, norms = [], [], []
    ready_calls = []
    for step in range(STEPS):
        calls["bucket_ready"] = 0
        for k in range(K):
            before = acc.reducer.collectives_issued
            acc.backward(_mean_loss(model, *_micro(tokens, labels, step, rank, k)))
            issued.append(acc.reducer.collectives_issued - before)
            if k == K - 1:
                launches.append(([t for _, t in acc.reducer.launch_log], acc.reducer.backward_end_time))
            r = acc.step()
            if k < K - 1:
                with ddp.no_sync():
                    (_mean_loss(ddp, *_micro(tokens, labels, step, rank, k)) / K).backward()
            else:
                (_mean_loss(ddp, *_micro(tokens, labels, step, rank, k)) / K).backward()
        norms.append(float(r.grad_norm))
        ready_calls.append((calls["bucket_ready"], acc.hooks.native))
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "ddp_params": [p.detach().clone() for p in ddp_model.parameters()],
            "issued": issued, "num_buckets": len(acc.reducer.buckets), "launches": launches, "norms": norms,
            "ready_calls": ready_calls}


def _scenario_items_unused(rank, world, out):
    """Item mode with different token counts per rank; a side branch used by rank 0 only; bf16 on the wire."""
    results = {}
    for reduce_dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Net()
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None,
                                           bucket_size_mb=0.002, reduce_dtype=reduce_dtype)
        tokens, labels = _data(world)
        for k in range(K):
            t, l = _micro(tokens, labels, 0, rank, k)
            l = l.clone()
            l[:, (rank + k) % 5 + 1:] = -100  # a different number of real tokens on every rank and micro-batch
            loss_sum = nn.functional.cross_entropy(model(t, use_side=rank == 0).reshape(-1, 11), l.reshape(-1),
                                                   ignore_index=-100, reduction="sum")
            acc.backward(loss_sum, num_items=torch.tensor(int((l != -100).sum())))
        r = acc.step()
        results[str(reduce_dtype)] = {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
                                      "num_items": float(r.num_items), "loss": float(r.loss)}
        acc.close()
    return results


def _scenario_rank_fails(rank, world, out):
    torch.manual_seed(0)
    model = Net()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=K, max_grad_norm=None)
    tokens, labels = _data(world)
    acc.backward(_mean_loss(model, *_micro(tokens, labels, 0, rank, 0)))
    if rank == 1:  # this rank stops mid-window; os._exit: a gloo group torn down at exit may abort (-6) under load
        sys.stdout.flush()
        os._exit(3)
    start = time.perf_counter()
    try:
        for k in range(1, K):
            acc.backward(_mean_loss(model, *_micro(tokens, labels, 0, rank, k)))
        acc.step()
    except RuntimeError as exc:
        return {"error": str(exc), "elapsed": time.perf_counter() - start}
    return {"error": None}


def _shared_batch(window, rank, k, world, k_steps):
    g = torch.Generator().manual_seed(1000 * window + k_steps * rank + k)
    return torch.randn(3, D, generator=g)


def _scenario_double_arrival(rank, world, out):
    """A layer shared by two reentrant-checkpointed segments (its hook fires twice per backward), one bucket per
    parameter. Phase 1, K=1: every micro-batch is armed, the first window learns the arrivals. Phase 2, K=2: the
    graph changes so that `shared` arrives twice for the first time in an armed micro-batch, after its bucket's
    all-reduce started: every rank raises, zero_grad(), and the retried window is exact."""
    results = {}
    for phase, k_steps in (("k1", 1), ("graph-change", 2)):
        torch.manual_seed(0)
        model = SharedCheckpointed()
        acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           accumulation_steps=k_steps, max_grad_norm=None, bucket_size_mb=1e-6)
        errors = []
        for window in range(3):
            twice = [phase == "k1" or window == 2 and k == 1 for k in range(k_steps)]
            for attempt in range(2):
                try:
                    for k in range(k_steps):
                        acc.backward(model(_shared_batch(window, rank, k, world, k_steps), twice=twice[k]))
                    acc.step()
                    break
                except RuntimeError as exc:
                    errors.append((window, attempt, str(exc)))
                    acc.zero_grad()
        results[phase] = {"params": [p.detach().clone() for p in model.parameters()], "errors": errors}
        acc.close()
    return results


SCENARIOS = {"equivalence": _scenario_equivalence, "items_unused": _scenario_items_unused,
             "rank_fails": _scenario_rank_fails, "double_arrival": _scenario_double_arrival}


def _on_backend(backend_id, scenario, rank, world, out):
    """In a rank: ``scenario`` with the default backend of ``backend_id`` ("default": whatever ``backend="auto"``
    picks; "cuda-emu": the emulated cuda build, installed here, with ``GAENGINE_BACKEND=cuda`` from the parent)."""
    if backend_id == "cuda-emu":
        module = emulated_cuda.install_in_rank()
        chosen = backends.get_backend("auto", "cpu")  # what the scenarios' accumulators get
        assert chosen.name == "cuda" and chosen._C is module, chosen.name
    return scenario(rank, world, out)


def _launch(tmp_path, world, name, backend_id="default", **kw):
    """The scenario ``SCENARIOS[name]`` on ``world`` gloo ranks (``tests.ranks.launch_scenario``) on the default
    backend of ``backend_id`` (``_use_backend`` chose it in this process)."""
    scenario = functools.partial(_on_backend, backend_id, SCENARIOS[name])
    return launch_scenario(tmp_path, world, scenario, abandons_group=name == "rank_fails", **kw)


def _use_backend(request, monkeypatch, backend_id):
    """In the test: ``backend_id``'s default backend for the ranks it starts (they inherit the environment);
    "cuda-emu" builds or loads the emulated build first (the test skips without a C++ compiler)."""
    if backend_id == "cuda-emu":
        emulated_cuda.install(request, monkeypatch, as_default=True)


BACKEND_IDS = [pytest.param("default", id="default"), pytest.param("cuda-emu", id="cuda-emu")]


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("world,backend_id", [pytest.param(2, "default", id="2"), pytest.param(3, "default", id="3"),
                                              pytest.param(2, "cuda-emu", id="2-cuda-emu")])
def test_ranks_equal_one_process_and_ddp(tmp_path, world, backend_id, request, monkeypatch):
    _use_backend(request, monkeypatch, backend_id)
    codes, results = _launch(tmp_path, world, "equivalence", backend_id)
    assert codes == [0] * world
    # One process over world*K micro-batches, plain recipe (fp32).
    torch.manual_seed(0)
    ref = Net()
    opt = _make_opt(ref.parameters())
    tokens, labels = _data(world)
    for step in range(STEPS):
        for rank in range(world):
            for k in range(K):
                (_mean_loss(ref, *_micro(tokens, labels, step, rank, k)) / (world * K)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    n = sum(q.numel() for q in ref.parameters())
    for rank, res in enumerate(results):
        for p, q, d in zip(res["params"], ref.parameters(), res["ddp_params"]):
            rtol = recipe_param_rtol(q, "adamw", 1e-2, STEPS, _net_grad_rtol(world, n))
            assert rel_diff(p, q) <= rtol, f"rank {rank} vs one process"
            assert rel_diff(p, d) <= rtol, f"rank {rank} vs DDP no_sync"
        assert res["norms"] == results[0]["norms"]  # identical decisions on every rank
        # Communication only in the last micro-batch: buckets + one stats all-reduce.
        for step in range(STEPS):
            per_micro = res["issued"][step * K:(step + 1) * K]
            assert per_micro[:-1] == [0] * (K - 1)
            assert per_micro[-1] == res["num_buckets"] + 1
        # Overlap: once the bucket order is learned from the first window, buckets' all-reduces start
        # before backward ends (in the first window the unused parameters sit in bucket 0 and hold it back).
        assert res["num_buckets"] >= 4
        for times, end in res["launches"][1:]:
            early = sum(t < end for t in times)
            assert early >= 1, f"no all-reduce launched before the end of backward ({len(times)} buckets)"
        # The hooks (native or Python: readiness is counted there, once) tell the reducer at most once per bucket
        # per window (the rest is launched by the flush), never per parameter; the first window, which learns the
        # layout and the arrivals, reduces after backward.
        for step, (bucket_ready, native) in enumerate(res["ready_calls"]):
            assert bucket_ready <= res["num_buckets"]
            assert bucket_ready >= 1 or step == 0


@pytest.mark.parametrize("backend_id", BACKEND_IDS)
def test_item_mode_unused_and_tied_params(tmp_path, backend_id, request, monkeypatch):
    world = 2
    _use_backend(request, monkeypatch, backend_id)
    codes, results = _launch(tmp_path, world, "items_unused", backend_id)
    assert codes == [0] * world
    torch.manual_seed(0)
    ref = Net()
    tokens, labels = _data(world)
    total, loss = 0, 0.0
    micro = []
    for rank in range(world):
        for k in range(K):
            t, l = _micro(tokens, labels, 0, rank, k)
            l = l.clone()
            l[:, (rank + k) % 5 + 1:] = -100
            micro.append((t, l, rank == 0))
            total += int((l != -100).sum())
    loss = sum(nn.functional.cross_entropy(ref(t, use_side=s).reshape(-1, 11), l.reshape(-1), ignore_index=-100,
                                           reduction="sum") for t, l, s in micro) / total
    loss.backward()
    # A bf16 wire rounds each rank's sum once and sums world of them in bf16, on top of the fp32 bound.
    fp32_tol = _net_grad_rtol(world)
    tols = (("torch.float32", fp32_tol),
            ("torch.bfloat16", fp32_tol + unit_roundoff(torch.bfloat16) + sum_rtol(world, torch.bfloat16)))
    for rank, res in enumerate(results):
        for dtype, tol in tols:
            got = res[dtype]
            assert got["num_items"] == total
            # The same fp32 token sums per micro-batch, summed over the ranks and divided by the count: two means.
            assert abs(got["loss"] - float(loss.detach())) <= 2 * mean_rtol(world * K) * abs(float(loss.detach()))
            for name, q in ref.named_parameters():
                expected = q.grad if q.grad is not None else torch.zeros_like(q)
                if name.startswith("unused"):  # no rank used it: no gradient, like one process
                    assert got["grads"][name] is None and q.grad is None
                    continue
                assert rel_diff(got["grads"][name], expected) <= tol, f"rank {rank} {dtype} {name}"


def test_rank_failing_mid_window_raises_on_the_others(tmp_path):
    codes, results = _launch(tmp_path, 2, "rank_fails", timeout_s=5, join_s=90)
    assert codes[1] == 3
    assert codes[0] == 0 and results[0]["error"] is not None
    assert "another rank failed, stopped mid-window" in results[0]["error"]
    assert results[0]["elapsed"] < 60


@pytest.mark.parametrize("world,hot_path,backend_id", [
    pytest.param(2, "native", "default", id="2-native"), pytest.param(3, "native", "default", id="3-native"),
    pytest.param(2, "python", "default", id="2-python"), pytest.param(2, "native", "cuda-emu", id="2-cuda-emu-native")])
def test_double_arrival_on_several_ranks_equals_one_process(tmp_path, world, hot_path, backend_id, request,
                                                            monkeypatch):
    use_hooks(monkeypatch, hot_path)  # the spawned ranks inherit it
    _use_backend(request, monkeypatch, backend_id)  # cuda-emu: the native hooks (hot_path), on the emulated build

    codes, results = _launch(tmp_path, world, "double_arrival", backend_id)
    assert codes == [0] * world
    for phase, k_steps in (("k1", 1), ("graph-change", 2)):
        torch.manual_seed(0)
        ref = SharedCheckpointed()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        step_over_param = [0.0] * len(list(ref.parameters()))  # the largest SGD step's max |lr g| / max |p|
        for window in range(3):
            for rank in range(world):
                for k in range(k_steps):
                    twice = phase == "k1" or window == 2 and k == 1
                    ref(_shared_batch(window, rank, k, world, k_steps), twice=twice).backward()
            for i, q in enumerate(ref.parameters()):
                q.grad /= world * k_steps  # the window mean (the nested pass is not scaled by a loss factor)
                step_over_param[i] = max(step_over_param[i], 0.1 * float(q.grad.abs().max() / q.abs().max()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        # The same unscaled micro-batch gradients, summed over k and the ranks in another order; three SGD steps.
        grad_rtol = split_batch_rtol(world * k_steps)
        for rank, res in enumerate(results):
            got = res[phase]
            for p, q, ratio in zip(got["params"], ref.parameters(), step_over_param):
                rtol = update_rtol(3, ratio, grad_rtol, grad_gain=1.0, step_roundings=1)
                assert rel_diff(p, q) <= rtol, f"{phase}: rank {rank} vs one process"
            if phase == "k1":
                assert got["errors"] == []
            else:  # the new double arrival came after its bucket's all-reduce started: refused once, then exact
                assert [(w, a) for w, a, _ in got["errors"]] == [(2, 0)]
                assert "2 times in one backward" in got["errors"][0][2] and "acc.zero_grad()" in got["errors"][0][2]
