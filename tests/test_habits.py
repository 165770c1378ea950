"""Habits of the plain PyTorch recipe kept in a gaengine loop: each trains exactly as without it, or raises.

S1 a sharded (FSDP2, FSDP1, DTensor) model; S2 a loss already scaled by ``torch.amp.GradScaler``; S3 a leftover
``optimizer.step(); optimizer.zero_grad()`` after ``acc.step()``; S4 ``model.load_state_dict()`` (or an in-place
write) after construction; S6 ``torch.nn.utils.clip_grad_norm_`` / reading ``p.grad``; and optimizers gaengine
cannot drive. (S5, uneven micro-batch counts over ranks, is in ``tests/test_uneven_windows.py``.)
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gaengine
import gaengine.clip
from gaengine.optim import FusedAdamW
from tests.ranks import launch_scenario as launch_ranks
from tests.tolerances import recipe_grad_rtol, update_rtol

K = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _batch(w, k, dtype):
    g = torch.Generator().manual_seed(1000 * w + k)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g)


def _loss(model, w, k, dtype):
    x, y = _batch(w, k, dtype)
    return nn.functional.mse_loss(model(x).float(), y)


def _optimizer(name, params, lr=1e-2):
    if name == "fused-adamw":
        return FusedAdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, fused=name == "adamw-fused")


def _train(model, opt, acc, windows, habit, w0=0, dtype=torch.float32):
    """``windows`` windows of K micro-batches; ``habit``: a leftover ``optimizer.step(); optimizer.zero_grad()``
    after every ``acc.step()``. Asserts the optimizer's parameters hold no ``.grad`` outside ``acc.step()``."""
    for w in range(w0, w0 + windows):
        for k in range(K):
            acc.backward(_loss(model, w, k, dtype))
            assert all(q.grad is None for g in opt.param_groups for q in g["params"])
        assert acc.step() is not None
        assert all(q.grad is None and getattr(q, "main_grad", None) is None
                   for g in opt.param_groups for q in g["params"])
        if habit:
            opt.step()
            opt.zero_grad()


def _optimizer_state(opt):
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[q].items()}
            for g in opt.param_groups for q in g["params"]]


def _assert_same_run(model_a, opt_a, model_b, opt_b):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(_optimizer_state(opt_a), _optimizer_state(opt_b)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


# ---------------------------------------------------------------- S3: a leftover optimizer.step() / zero_grad()
S3_MODES = [(d, m, o) for d in DTYPES for m in (True, False) for o in ("adamw", "adamw-fused", "fused-adamw")
            if not (d == "fp32" and not m)]


@pytest.mark.parametrize("dtype,master_weights,opt_name", S3_MODES,
                         ids=[f"{d}-{'masters' if m else 'no-masters'}-{o}" for d, m, o in S3_MODES])
def test_leftover_optimizer_step_and_zero_grad_change_nothing(dtype, master_weights, opt_name):
    """On 058aedc the fp32 masters kept their .grad after acc.step(): bf16 took a second AdamW step per window."""
    runs = []
    for habit in (False, True):
        model = _mlp(DTYPES[dtype])
        opt = _optimizer(opt_name, model.parameters())
        acc = gaengine.GradientAccumulator(model, opt, K, master_weights=master_weights)
        _train(model, opt, acc, 3, habit, dtype=DTYPES[dtype])
        runs.append((model, opt))
    _assert_same_run(*runs[0], *runs[1])
    assert any(len(s) for s in _optimizer_state(runs[1][1]))  # the optimizer did step (once per window)


def _scenario_zero_habits(rank, world, out):
    """S3 and S4 at zero_stage 1 and 2 on each rank: a leftover optimizer.step() changes nothing; a
    model.load_state_dict() after construction reaches the masters (against a fresh accumulator over the loaded
    model, SGD: stateless, so the two runs must agree bitwise)."""
    results = []
    for stage in (1, 2):
        for dtype in ("bf16", "fp16"):
            for opt_name in ("adamw", "fused-adamw"):
                runs = []
                for habit in (False, True):
                    model = _mlp(DTYPES[dtype])
                    opt = _optimizer(opt_name, model.parameters())
                    acc = gaengine.GradientAccumulator(model, opt, K, zero_stage=stage)
                    _train(model, opt, acc, 2, habit, w0=10 * rank, dtype=DTYPES[dtype])
                    acc.close()
                    runs.append((model, opt))
                _assert_same_run(*runs[0], *runs[1])
            results.append(_load_after_construction(DTYPES[dtype], stage, w0=10 * rank))
    return results


@pytest.mark.multiproc
def test_zero_stages_leftover_step_and_load_after_construction(tmp_path):
    codes, results = launch_ranks(tmp_path, 2, _scenario_zero_habits, timeout_s=300, join_s=600)
    assert codes == [0, 0]
    assert all(r == [True] * 4 for r in results)


# ---------------------------------------------------------------- S4: model.load_state_dict after construction
def _load_after_construction(dtype, zero_stage=0, w0=0):
    """Train a window, load another model's weights (and write one element under no_grad), train a window; against
    an accumulator built over a model that held those weights from the start. SGD (no state): the updates must
    agree bitwise. Returns True (asserts otherwise)."""
    ckpt = _mlp(dtype, seed=1).state_dict()
    model = _mlp(dtype)
    opt = _optimizer("sgd", model.parameters())
    acc = gaengine.GradientAccumulator(model, opt, K, zero_stage=zero_stage)
    _train(model, opt, acc, 1, False, w0=w0, dtype=dtype)
    model.load_state_dict(ckpt)
    with torch.no_grad():
        model[0].weight[0, 0] = 0.5
    _train(model, opt, acc, 1, False, w0=w0 + 1, dtype=dtype)

    ref = _mlp(dtype, seed=1)
    with torch.no_grad():
        ref[0].weight[0, 0] = 0.5
    ref_opt = _optimizer("sgd", ref.parameters())
    ref_acc = gaengine.GradientAccumulator(ref, ref_opt, K, zero_stage=zero_stage)
    _train(ref, ref_opt, ref_acc, 1, False, w0=w0 + 1, dtype=dtype)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert abs(float(model[0].weight[0, 0].detach()) - 0.5) < 0.05  # not reverted to the old masters
    acc.close()
    ref_acc.close()
    return True


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_load_state_dict_after_construction_reaches_the_masters(dtype):
    """On 058aedc the first update reverted the loaded weights to the old masters."""
    assert _load_after_construction(DTYPES[dtype])


@pytest.mark.parametrize("order", ["model-first", "acc-first"])
def test_resume_in_either_order_keeps_the_fp32_masters(order):
    """Loading the model beside the accumulator's own state keeps the masters' fp32 bits (the model holds their
    rounding): the resumed run equals the uninterrupted one bitwise."""
    model = _mlp(torch.bfloat16)
    opt = _optimizer("adamw", model.parameters())
    acc = gaengine.GradientAccumulator(model, opt, K)
    _train(model, opt, acc, 2, False, dtype=torch.bfloat16)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict()})
    _train(model, opt, acc, 2, False, w0=2, dtype=torch.bfloat16)

    model2 = _mlp(torch.bfloat16, seed=5)
    opt2 = _optimizer("adamw", model2.parameters())
    acc2 = gaengine.GradientAccumulator(model2, opt2, K)
    loads = [lambda: model2.load_state_dict(saved["model"]),
             lambda: (opt2.load_state_dict(saved["opt"]), acc2.load_state_dict(saved["acc"]))]
    for load in loads if order == "model-first" else loads[::-1]:
        load()
    _train(model2, opt2, acc2, 2, False, w0=2, dtype=torch.bfloat16)
    assert torch.equal(acc2.master_buffer.data, acc.master_buffer.data)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- S2: a loss already scaled by GradScaler
@pytest.mark.parametrize("enabled", [True, False])
def test_gradscaler_scaled_loss_is_refused_with_the_window_intact(enabled):
    """On 058aedc the scale fell to 2.4e-07 while windows were skipped and a 65536x update applied, silently. A
    disabled GradScaler returns the loss as it is: nothing to refuse."""
    model = _mlp(torch.float16)
    twin = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), K)
    ref = gaengine.GradientAccumulator(twin, torch.optim.SGD(twin.parameters(), lr=0.1), K)
    scaler = torch.amp.GradScaler("cpu", enabled=enabled)
    acc.backward(_loss(model, 0, 0, torch.float16))
    ref.backward(_loss(twin, 0, 0, torch.float16))
    if enabled:
        with pytest.raises(ValueError, match=r"scaled by torch.amp.GradScaler.*acc.backward\(loss\)"):
            acc.backward(scaler.scale(_loss(model, 0, 1, torch.float16)))
        assert acc.num_micro_batches == 1
    acc.backward(scaler.scale(_loss(model, 0, 1, torch.float16)) if not enabled else _loss(model, 0, 1, torch.float16))
    ref.backward(_loss(twin, 0, 1, torch.float16))
    assert torch.equal(acc.step().grad_norm, ref.step().grad_norm)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_loss_scale_falling_to_its_floor_raises():
    """A model whose gradients overflow window after window (here a diverged loss, inf from window 2 on) backs the
    dynamic scale off: it stops at min_loss_scale with an error naming the causes, instead of falling to 0 while every
    update skips."""
    model = _mlp(torch.float16)
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3), K)
    with pytest.raises(RuntimeError, match=r"floor min_loss_scale=1: .*torch\.amp\.GradScaler.*diverged"):
        for w in range(40):
            for k in range(K):
                loss = _loss(model, w, k, torch.float16)
                acc.backward(loss * float("inf") if w >= 2 else loss)
            acc.step()
    assert w == 2 + 15, w  # from 2**16, the 16th back-off reaches the floor 1: that skipped window raises
    assert float(acc.scaler.scale) == 1.0 and acc.num_micro_batches == 0
    acc.backward(_loss(model, 0, 0, torch.float16))  # training can go on (the flag was reported once)
    acc.backward(_loss(model, 0, 1, torch.float16))
    assert not bool(acc.step().skipped)


def test_min_loss_scale_is_validated():
    model = _mlp()
    for bad in (0, -1.0, float("inf"), "1", True):
        with pytest.raises(ValueError, match="min_loss_scale must be a positive finite float"):
            gaengine.GradientAccumulator(model, None, K, min_loss_scale=bad)


# ---------------------------------------------------------------- S6: p.grad and torch's clip_grad_norm_
def test_torch_clip_grad_norm_over_accumulated_params_warns_once(monkeypatch):
    monkeypatch.setattr(gaengine.clip, "_warned", False)
    model = _mlp()
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), K)
    acc.backward(_loss(model, 0, 0, torch.float32))
    assert all(p.grad is None for p in model.parameters())  # the README: .grad is None, log result.grad_norm
    with pytest.warns(UserWarning, match=r"clip_grad_norm_ was given the parameters of a gaengine.*max_grad_norm"):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert float(norm) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # once per process
        plain = _mlp()
        _loss(plain, 0, 0, torch.float32).backward()
        expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()]))
        assert torch.allclose(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9), expected)
    acc.backward(_loss(model, 0, 1, torch.float32))
    assert float(acc.step().grad_norm) > 0


def test_gaengine_clip_grad_norm_over_accumulated_params_warns(monkeypatch):
    monkeypatch.setattr(gaengine.clip, "_warned", False)
    model = _mlp()
    acc = gaengine.GradientAccumulator(model, None, K)
    with pytest.warns(UserWarning, match=r"gaengine.clip_grad_norm_ was given"):
        gaengine.clip_grad_norm_(model.parameters(), 1.0)
    acc.close()  # released: the parameters are plain again, and nothing warns
    monkeypatch.setattr(gaengine.clip, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gaengine.clip_grad_norm_(model.parameters(), 1.0)


# ---------------------------------------------------------------- optimizers gaengine cannot drive, or their state
def test_closure_optimizer_is_refused_at_construction():
    model = _mlp()
    with pytest.raises(TypeError, match=r"LBFGS.step\(\) requires 'closure'.*no argument"):
        gaengine.GradientAccumulator(model, torch.optim.LBFGS(model.parameters()), K)

    class NeedsLoss(torch.optim.SGD):
        def step(self, loss):  # noqa: ARG002 - a signature gaengine cannot call
            return super().step()

    with pytest.raises(TypeError, match=r"NeedsLoss.step\(\) requires 'loss'"):
        gaengine.GradientAccumulator(model, NeedsLoss(model.parameters(), lr=0.1), K)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_low_precision_optimizer_state_is_widened_exactly(fused):
    """An AdamW step taken before building (bf16 state): on 058aedc the first acc.step() failed with
    "expected dtype c10::BFloat16 for 'end' but got dtype float". The state moves to the fp32 masters widened
    exactly, and the update equals torch's AdamW on fp32 masters holding that state."""
    model = _mlp(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    _loss(model, 9, 0, torch.bfloat16).backward()
    opt.step()
    opt.zero_grad()
    before = _optimizer_state(opt)
    ref_masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref_masters, lr=1e-2, fused=fused)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch casts the state to the masters' dtype
    twin = copy.deepcopy(model)

    acc = gaengine.GradientAccumulator(model, opt, 1, max_grad_norm=None)
    for old, new in zip(before, _optimizer_state(opt)):
        assert torch.equal(new["exp_avg"], old["exp_avg"].float()) and new["exp_avg"].dtype == torch.float32
    acc.backward(_loss(model, 0, 0, torch.bfloat16))
    acc.step()
    _loss(twin, 0, 0, torch.bfloat16).backward()
    for m, q in zip(ref_masters, twin.parameters()):
        m.grad = q.grad.float()
    ref_opt.step()
    for p, m in zip(model.parameters(), ref_masters):
        assert torch.equal(p, m.detach().to(torch.bfloat16))


# ---------------------------------------------------------------- S1: sharded models
def _scenario_sharded(rank, world, out):
    """Each way of sharding a model that gaengine cannot accumulate exactly, refused at construction with an error
    naming it; and a supported FSDP2 model (per-block ``fully_shard`` plus the root) trained one window of K
    micro-batches (rank r's micro-batch k is ``_batch(r, k)``). Returns the messages and the trained parameters
    (full tensors). tests/test_fsdp2.py covers the FSDP2 mode itself case by case."""
    from torch.distributed._composable.replicate import replicate as ddp_replicate
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import DeviceMesh, distribute_tensor

    messages = []

    def refused(model, params=None):
        opt = torch.optim.AdamW(params if params is not None else model.parameters(), lr=1e-3)
        try:
            gaengine.GradientAccumulator(model if params is None else params, opt, K)
        except TypeError as exc:
            messages.append(str(exc))
        else:
            messages.append(None)

    model = _mlp()
    fully_shard(model[0])  # a block sharded, the root not: its other parameters would never be reduced
    refused(model)
    mesh = DeviceMesh("cpu", list(range(world)))
    model = _mlp()
    model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh))
    refused(model)
    refused(None, [p for p in model.parameters()])
    refused(FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu")))
    refused(ddp_replicate(_mlp()))

    model = _mlp()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), K, max_grad_norm=None)
    for k in range(K):
        acc.backward(_loss(model, rank, k, torch.float32))
    acc.step()
    trained = [p.full_tensor().detach().clone() for p in model.parameters()]
    acc.close()
    dist.barrier()
    return messages, trained


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_models_are_refused(tmp_path, world):
    """On 058aedc an FSDP2 model on one rank trained nothing (grad_norm 0.0), silently. Every sharded model gaengine
    cannot accumulate exactly is refused (FSDP1, the composable replicate, DTensor parameters fully_shard did not
    make, an FSDP2 model whose root is not sharded); a supported FSDP2 model trains one window as the plain fp32
    recipe over the global batch does (within the bound of tests/tolerances.py)."""
    codes, results = launch_ranks(tmp_path, world, _scenario_sharded)
    assert codes == [0] * world
    ref = _mlp()
    for r in range(world):
        for k in range(K):
            (_loss(ref, r, k, torch.float32) / (K * world)).backward()
    # One SGD step from gradients split over K micro-batches and the ranks (each backward seeded by its own loss
    # factor): recipe_grad_rtol, then update_rtol with the step's size relative to the parameter's (norm-wise).
    grad_rtol = recipe_grad_rtol(world * K * 4, 2, 16)
    with torch.no_grad():
        rtols = [update_rtol(1, 0.1 * float(p.grad.norm() / (p - 0.1 * p.grad).norm()), grad_rtol, grad_gain=1.0,
                             step_roundings=1) for p in ref.parameters()]
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for messages, trained in results:
        fsdp2_child, dtensor_module, dtensor_params, fsdp1, replicate = messages
        assert "call fully_shard(model) on the root" in fsdp2_child
        assert "DTensor parameter" in dtensor_module and "DTensor parameter" in dtensor_params
        assert "FSDP1" in fsdp1
        assert "composable" in replicate and "replicate" in replicate
        for got, want, init, rtol in zip(trained, [p.detach() for p in ref.parameters()], _mlp().parameters(), rtols):
            assert not torch.equal(got, init.detach()), "the FSDP2 model did not train"
            assert float((got - want).norm() / want.norm()) <= rtol
