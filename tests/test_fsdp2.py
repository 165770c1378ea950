"""FSDP2 (``fully_shard``) models under the accumulator (gaengine.fsdp2), as real gloo processes on 1-4 ranks.

The reference of every configuration is the plain PyTorch recipe in one fp32 process over the same global
micro-batches (``_reference``): each micro-batch's loss (mean loss / (k x d) in mean mode, summed loss / the
window's global item count in item mode) backpropagated into fp32 ``.grad``, ``clip_grad_norm_``, a torch optimizer,
a window with a non-finite gradient skipped. FSDP2's own recipe (``set_requires_gradient_sync`` on the last
micro-batch, fp32) is the second reference of the mean case, run on the ranks. Target: ``_param_rtol`` (the error
model of tests/tolerances.py) after 3 updates. One process group per world size runs every case (imports and the group cost seconds per spawn).

bf16 sharded parameters: FSDP2 casts each micro-batch's reduced shard to the parameter's dtype before the hook
sees it (torch ``_fsdp_collectives.py``, ``foreach_reduce``), so one bf16 rounding per micro-batch is inherent.
With ``reduce_dtype=fp32`` the window's sum then differs from the fp64 sum of the exact micro-batch gradients G_k
by at most ``sum_k 2^-9 |G_k|`` per element (round to nearest: half a bf16 ulp, 2^-9 relative) plus the fp32
terms ``(K + d) 2^-24 sum_k |G_k|`` (the d-term fp32 reduce and the K fp32 adds): ``_bf16_bound``. FSDP2's own
accumulation of bf16 sharded parameters (``.grad +=`` in bf16) also rounds every running sum and breaks that bound;
the test shows it.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gaengine
from tests import poison
from tests.oracle_hooks import hooks_selected
from tests.ranks import free_port, spawn_ranks
from tests.tolerances import recipe_grad_rtol, recipe_param_rtol, rel_diff
from tests.models import ThreeBlocks

pytestmark = pytest.mark.multiproc

K, B, T, IN, HID, OUT, STEPS, LR, MAX_NORM = 3, 2, 4, 6, 10, 5, 3, 1e-2, 0.05
BF16_K = 16


def _net() -> ThreeBlocks:
    return ThreeBlocks(IN, HID, OUT)


def _data(world: int, steps: int = STEPS, k: int = K, seed: int = 7):
    """Inputs ``(steps, world, k, B, T, IN)`` and labels ``(steps, world, k, B, T)``, a different number of real
    tokens (label != -100) in every micro-batch and on every rank."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, world, k, B, T, IN, generator=g)
    labels = torch.randint(0, OUT, (steps, world, k, B, T), generator=g)
    for s in range(steps):
        for r in range(world):
            for j in range(k):
                labels[s, r, j, :, (s + 2 * r + j) % T + 1:] = -100
    return xs, labels


def _loss(model, x, labels, items: bool, use_side: bool):
    logits = model(x, use_side=use_side).float().reshape(-1, OUT)
    if items:
        return nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    return nn.functional.cross_entropy(logits, labels.reshape(-1).clamp_min(0))


def _optimizer(name: str, params):
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    raise AssertionError(name)


class _Schedule:
    """K per window: 1, 3, 2 (``accumulation_steps`` as a schedule)."""

    def __call__(self, update_index: int, items_seen: int) -> int:
        return (1, 3, 2)[update_index % 3]


_BASE = dict(items=False, clip=MAX_NORM, opt="adamw-fused", partial=False, nonfinite=False, loss_scale=None,
             unused=False, schedule=False, scheduler=False, hot_path="native")
CASES = {
    "mean": {},
    "items": dict(items=True),
    "partial-sgd-sched": dict(partial=True, opt="sgd", scheduler=True, clip=None),
    "items-partial-noclip": dict(items=True, partial=True, clip=None, opt="adamw"),
    "fp16-loss-scale": dict(loss_scale="dynamic"),
    "nonfinite-one-rank": dict(nonfinite=True, opt="adamw"),
    "nonfinite-fused-scaled": dict(nonfinite=True, loss_scale=2.0**10),
    "unused": dict(unused=True),
    "schedule-items": dict(schedule=True, items=True),
    "items-python-hooks": dict(items=True, hot_path="python"),  # the oracle, tests/oracle_hooks.py
}
WORLD_CASES = {1: ["mean", "items-partial-noclip"], 2: list(CASES), 3: ["items-partial-noclip"],
               4: ["items"]}
WORLD_NOISE = {1: ["noise-items"], 2: ["noise-mean", "noise-items"], 3: ["noise-mean"], 4: []}


def _window_sizes(cfg) -> list[int]:
    sizes = [_Schedule()(s, 0) for s in range(STEPS)] if cfg["schedule"] else [K] * STEPS
    if cfg["partial"]:
        sizes[-1] = K - 1  # the last window ends early: step(force=True)
    return sizes


def _shard(model: nn.Module, world: int, **kwargs) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in (model.l0, model.l1, model.head, model.side):
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().float().clone() for p in model.parameters()]


def _run_case(rank: int, world: int, cfg: dict) -> dict:
    with hooks_selected(cfg["hot_path"]):
        return _run_case_on_hooks(rank, world, cfg)


def _run_case_on_hooks(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    model = _shard(_net(), world)
    opt = _optimizer(cfg["opt"], model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if cfg["scheduler"] else None
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=_Schedule() if cfg["schedule"] else K,
                                       max_grad_norm=cfg["clip"], lr_scheduler=sched, loss_scale=cfg["loss_scale"])
    assert type(acc.sharding).__name__ == "FullyShardedGrads"
    xs, labels = _data(world)
    out = {"skipped": [], "norms": []}
    for s, k in enumerate(_window_sizes(cfg)):
        for j in range(k):
            x = xs[s, rank, j].clone()
            if cfg["nonfinite"] and s == 1 and rank == 0 and j == 1:
                x[0, 0, 0] = float("inf")
            loss = _loss(model, x, labels[s, rank, j], cfg["items"], not cfg["unused"])
            n = int((labels[s, rank, j] != -100).sum())
            acc.backward(loss, num_items=torch.tensor(n) if cfg["items"] else None)
        res = acc.step(force=k < (_Schedule()(s, 0) if cfg["schedule"] else K))
        out["skipped"].append(bool(res.skipped))
        out["norms"].append(float(res.grad_norm))
    out["params"] = _full(model)
    out["grads_left"] = [p.grad is not None for p in model.parameters()]
    out["hooks"] = type(acc.sharding.hooks).__name__
    acc.close()
    return out


def _fsdp2_recipe(rank: int, world: int) -> list[torch.Tensor]:
    """FSDP2's own recipe of the mean case: sync on the last micro-batch only, fp32, clip_grad_norm_ over the
    DTensor gradients."""
    torch.manual_seed(0)
    model = _shard(_net(), world)
    opt = _optimizer("adamw-fused", model.parameters())
    xs, labels = _data(world)
    for s in range(STEPS):
        for j in range(K):
            model.set_requires_gradient_sync(j == K - 1)
            (_loss(model, xs[s, rank, j], labels[s, rank, j], False, True) / K).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _full(model)


def _bf16_windows(rank: int, world: int) -> dict:
    """bf16 sharded parameters (reduce_dtype fp32), one window of BF16_K micro-batches: gaengine's main_grad shards
    before the step, then 2 more updates with masters; and FSDP2's own bf16 ``.grad`` accumulation of the same
    window (the wrong recipe)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    xs, labels = _data(world, steps=3, k=BF16_K, seed=11)
    out = {}
    torch.manual_seed(0)
    model = _shard(_net().to(torch.bfloat16), world, mp_policy=mp_policy)
    acc = gaengine.GradientAccumulator(model, _optimizer("adamw-fused", model.parameters()),
                                       accumulation_steps=BF16_K, max_grad_norm=None)
    assert acc.master_buffer is not None
    order = {id(p): i for i, p in enumerate(model.parameters())}
    for s in range(3):
        for j in range(BF16_K):
            acc.backward(_loss(model, xs[s, rank, j].bfloat16(), labels[s, rank, j], False, True))
        if s == 0:
            out["main_grad"] = {order[id(p)]: v.clone() for p, v in zip(acc.params, acc.main_grad.views)}
        acc.step()
    out["params"] = _full(model)
    masters = [m for m in acc.optimizer.param_groups[0]["params"]]
    out["masters_rounded"] = all(bool((m.to_local().bfloat16() == p.to_local()).all())
                                 for m, p in zip(masters, model.parameters()))
    acc.close()
    torch.manual_seed(0)
    model = _shard(_net().to(torch.bfloat16), world, mp_policy=mp_policy)
    for j in range(BF16_K):
        _loss(model, xs[0, rank, j].bfloat16(), labels[0, rank, j], False, True).backward()
    out["fsdp2_bf16"] = {i: p.grad.to_local().float().clone() for i, p in enumerate(model.parameters())}
    return out


NOISE_PLAN = [3, 3, 2, 3]  # micro-batches per window (K = 3): the third window partial (step(force=True))
NOISE_POISONED = 3  # this window's second micro-batch has a NaN loss on rank 0: skipped, the averages stay
NOISE_EMA = 0.8
NOISE_RTOL = 1e-3  # issue 17's bound of the estimator against the fp64 oracle
NOISE_CASES = {"noise-mean": "mean", "noise-items": "items"}


def _noise_run(rank: int, world: int, mode: str) -> dict:
    """``measure_noise_scale=True`` over ``NOISE_PLAN`` (SGD; a static loss scale of 128 in mean mode): the full
    parameters before each window and each window's (B_simple, tr Sigma, |G|^2)."""
    torch.manual_seed(0)
    model = _shard(_net(), world)
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulation_steps=K,
                                       max_grad_norm=None, measure_noise_scale=True, noise_scale_ema=NOISE_EMA,
                                       loss_scale=128.0 if mode == "mean" else None)
    xs, labels = _data(world, steps=len(NOISE_PLAN), seed=5)
    out = {"before": [], "estimates": []}
    for s, k in enumerate(NOISE_PLAN):
        out["before"].append(_full(model))
        for j in range(k):
            loss = _loss(model, xs[s, rank, j], labels[s, rank, j], mode == "items", True)
            if s == NOISE_POISONED and j == 1 and rank == 0:
                loss = loss * float("nan")
            acc.backward(loss, num_items=int((labels[s, rank, j] != -100).sum()) if mode == "items" else None)
        res = acc.step(force=True)
        assert res.num_micro_batches == k and bool(res.skipped) == (s == NOISE_POISONED)
        out["estimates"].append(tuple(float(t) for t in (res.grad_noise_scale, res.noise_trace_sigma,
                                                          res.noise_grad_sq)))
    acc.close()
    return out


def _refusals(rank: int, world: int) -> dict:
    """Every model and option the accumulator refuses; each entry: (exception type, message) or None."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp._common_utils import TrainingState
    from torch.distributed.tensor import Shard, distribute_tensor

    def attempt(build):
        try:
            model, kwargs = build()
            opt = kwargs.pop("optimizer", None) or torch.optim.AdamW(model.parameters(), lr=LR)
            acc = gaengine.GradientAccumulator(model, opt, **kwargs)
            if getattr(model, "_sync_off", False):
                acc.backward(model(torch.randn(2, IN)).sum())
            if getattr(model, "_export", False):
                gaengine.full_optimizer_state_dict(acc)
            if getattr(model, "_state", False):
                acc.state_dict()
            if getattr(model, "_load", None) is not None:  # refused with the window's gradients kept
                acc.backward(_loss(model, torch.randn(2, 3, IN), torch.zeros(2, 3, dtype=torch.long), False, True))
                before = acc.main_grad.data.clone()
                try:
                    acc.load_state_dict(model._load)
                finally:
                    assert torch.equal(acc.main_grad.data, before) and acc.num_micro_batches == 1
            acc.close()
            return None
        except (TypeError, ValueError, RuntimeError) as exc:
            return type(exc).__name__, str(exc)

    mesh = init_device_mesh("cpu", (world,))

    def fsdp1():  # FSDP1 needs an accelerator to be built; the refusal reads the module's type only
        torch.manual_seed(0)
        wrapped = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
        nn.Module.__init__(wrapped)
        wrapped._fsdp_wrapped_module = _net()
        wrapped.training_state = TrainingState.IDLE
        return wrapped, {}

    def foreign_dtensor():
        torch.manual_seed(0)
        m = _net()
        m.l0.weight = nn.Parameter(distribute_tensor(m.l0.weight.detach(), mesh, [Shard(0)]))
        return m, {}

    def child_only():
        torch.manual_seed(0)
        m = _net()
        fully_shard(m.l0, mesh=mesh)
        return m, {}

    def mixed():
        torch.manual_seed(0)
        m = _net()
        fully_shard(m, mesh=mesh, ignored_params={m.side.weight})
        return m, {}

    def offload():
        torch.manual_seed(0)
        return _shard(_net(), world, offload_policy=CPUOffloadPolicy(pin_memory=False)), {}

    def zero():
        torch.manual_seed(0)
        return _shard(_net(), world), {"zero_stage": 1}

    def reduce_dtype():
        torch.manual_seed(0)
        return _shard(_net(), world), {"reduce_dtype": torch.bfloat16}

    def fused_adamw():
        torch.manual_seed(0)
        m = _shard(_net(), world)
        return m, {"optimizer": gaengine.optim.FusedAdamW(m.parameters(), lr=LR)}

    def sync_off():
        torch.manual_seed(0)
        m = _shard(_net(), world)
        m.set_requires_gradient_sync(False)
        m._sync_off = True
        return m, {}

    def full_export():  # gaengine's flat export has no layout to read here: torch's own export is named
        torch.manual_seed(0)
        m = _shard(_net(), world)
        m._export = True
        return m, {}

    def non_elementwise_state():  # acc.state_dict() cuts the optimizer's state into ranges: elementwise only
        torch.manual_seed(0)
        m = _shard(_net(), world)
        m._state = True
        return m, {"optimizer": torch.optim.Adagrad(m.parameters(), lr=LR)}

    def old_format():  # the per-rank format of FSDP2 models before STATE_FORMAT: refused, saying what to do
        from gaengine.formats import FSDP2_FORMAT

        torch.manual_seed(0)
        m = _shard(_net(), world)
        m._load = {"format": FSDP2_FORMAT, "main_grad": torch.zeros(3), "master": None}
        return m, {"accumulation_steps": K}

    def other_model():  # acc.state_dict() of another model (l0.weight frozen there): refused, the window kept
        torch.manual_seed(0)
        other = _shard(_net(), world)
        other.l0.weight.requires_grad_(False)
        saver = gaengine.GradientAccumulator(other, torch.optim.AdamW(other.parameters(), lr=LR),
                                             accumulation_steps=K)
        state = saver.state_dict()
        saver.close()
        torch.manual_seed(0)
        m = _shard(_net(), world)
        m._load = state
        return m, {"accumulation_steps": K}

    import gaengine.optim  # noqa: F401

    out = {name: attempt(build) for name, build in [
        ("fsdp1", fsdp1), ("foreign-dtensor", foreign_dtensor), ("root-not-fsdp", child_only), ("mixed", mixed),
        ("cpu-offload", offload), ("zero-stage", zero), ("reduce-dtype", reduce_dtype),
        ("fused-adamw", fused_adamw), ("sync-off", sync_off), ("full-export", full_export),
        ("non-elementwise-state", non_elementwise_state), ("old-format", old_format),
        ("other-model", other_model)]}
    return out


def _rank_dies(rank: int, world: int) -> dict:
    """Rank 1 stops after the first micro-batch of a window; rank 0 must raise within the group's timeout."""
    torch.manual_seed(0)
    model = _shard(_net(), world)
    acc = gaengine.GradientAccumulator(model, _optimizer("adamw", model.parameters()), accumulation_steps=K)
    xs, labels = _data(world)
    acc.backward(_loss(model, xs[0, rank, 0], labels[0, rank, 0], False, True))
    if rank == 1:
        return {"died": True}
    start = time.monotonic()
    try:
        for j in range(1, K):
            acc.backward(_loss(model, xs[0, rank, j], labels[0, rank, j], False, True))
        acc.step()
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - any error of the collectives counts, its type is recorded
        return {"raised": type(exc).__name__, "after_s": time.monotonic() - start}


def _checkpoint(rank: int, world: int, out_dir: str) -> dict:
    """``torch.distributed.checkpoint`` of the model's state dict and ``acc.state_dict()`` (which holds the
    optimizer's state, docs/fsdp2.md): on 2 ranks, a window, a save between windows, one micro-batch, a save
    mid-window, the window finished; then a fresh model, optimizer and accumulator resume the mid-window save. On 3
    ranks: the save between windows resumed (DCP reshards the ranges), one more window."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def build():
        torch.manual_seed(0)
        model = _shard(_net(), world)
        opt = _optimizer("adamw-fused", model.parameters())
        return model, opt, gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=MAX_NORM)

    def save(model, opt, acc, name):
        dcp.save({"model": get_model_state_dict(model), "acc": acc.state_dict()},
                 checkpoint_id=os.path.join(out_dir, name))

    def load(model, opt, acc, name):
        state = {"model": get_model_state_dict(model), "acc": acc.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(out_dir, name))
        set_model_state_dict(model, state["model"])
        acc.load_state_dict(state["acc"])

    xs, labels = _data(world)

    def micro(model, acc, s, j):
        acc.backward(_loss(model, xs[s, rank, j], labels[s, rank, j], False, True))

    model, opt, acc = build()
    if world == 3:
        load(model, opt, acc, "between")
        for j in range(K):
            micro(model, acc, 1, j)
        acc.step()
        return {"params": _full(model)}
    for j in range(K):
        micro(model, acc, 0, j)
    acc.step()
    save(model, opt, acc, "between")
    micro(model, acc, 1, 0)
    save(model, opt, acc, "mid")
    for j in range(1, K):
        micro(model, acc, 1, j)
    acc.step()
    went_on = _full(model)
    acc.close()
    model, opt, acc = build()
    load(model, opt, acc, "mid")
    for j in range(1, K):
        micro(model, acc, 1, j)
    acc.step()
    return {"went_on": went_on, "resumed": _full(model)}


def _resume_run(rank: int, world: int, out_dir: str, what: str) -> dict:
    """A window, one micro-batch of the next, a save (DCP of the model's state dict and ``acc.state_dict()``, which
    holds the optimizer's state, as docs/fsdp2.md says), the window finished and one more; then a fresh model,
    optimizer and accumulator load the save and finish the same windows. what="bf16": bf16 sharded parameters with
    fp32 masters (``master_weights=True``, fused AdamW); "bf16-dcp": the same, the model and optimizer saved through
    torch's ``get_state_dict`` instead;
    what="noise": fp32, SGD, ``measure_noise_scale=True``. Returns both runs' full parameters, fp32 masters and
    noise estimates of the windows after the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = what.startswith("bf16")
    torch_optim = what == "bf16-dcp"  # the optimizer through torch's get_state_dict; else in acc.state_dict()
    xs, labels = _data(world, seed=13)
    where = os.path.join(out_dir, f"resume-{what}")

    def build():
        torch.manual_seed(0)
        if bf16:
            model = _shard(_net().to(torch.bfloat16), world, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
            opt = _optimizer("adamw-fused", model.parameters())
            acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=MAX_NORM,
                                               master_weights=True)
            assert acc.master_buffer is not None
        else:
            model = _shard(_net(), world)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=None,
                                               measure_noise_scale=True, noise_scale_ema=NOISE_EMA)
        return model, opt, acc

    def micro(model, acc, s, j):
        x = xs[s, rank, j].bfloat16() if bf16 else xs[s, rank, j]
        acc.backward(_loss(model, x, labels[s, rank, j], False, True))

    def finish(model, acc) -> dict:
        out = {"estimates": []}
        for s, first in ((1, 1), (2, 0)):
            for j in range(first, K):
                micro(model, acc, s, j)
            res = acc.step()
            if not bf16:
                out["estimates"].append(tuple(float(t) for t in (res.grad_noise_scale, res.noise_trace_sigma,
                                                                  res.noise_grad_sq)))
        out["params"] = _full(model)
        out["masters"] = None if acc.master_buffer is None else acc.master_buffer.data.clone()
        acc.close()
        return out

    model, opt, acc = build()
    for j in range(K):
        micro(model, acc, 0, j)
    acc.step()
    micro(model, acc, 1, 0)
    if torch_optim:
        state_model, state_opt = get_state_dict(model, opt)
        dcp.save({"model": state_model, "optim": state_opt, "acc": acc.state_dict()}, checkpoint_id=where)
    else:
        dcp.save({"model": get_model_state_dict(model), "acc": acc.state_dict()}, checkpoint_id=where)
    went_on = finish(model, acc)
    model, opt, acc = build()
    if torch_optim:
        state_model, state_opt = get_state_dict(model, opt)
        state = {"model": state_model, "optim": state_opt, "acc": acc.state_dict()}
        dcp.load(state, checkpoint_id=where)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = {"model": get_model_state_dict(model), "acc": acc.state_dict()}
        dcp.load(state, checkpoint_id=where)
        set_model_state_dict(model, state["model"])
    acc.load_state_dict(state["acc"])
    return {"went_on": went_on, "resumed": finish(model, acc)}


def _worker(rank: int, world: int, init_file: str, out_dir: str, plan: list[str]) -> None:
    poison.install_if_asked()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=5 if "dies" in plan else 60))
    results = {}
    try:
        for name in plan:
            if name in CASES:
                results[name] = _run_case(rank, world, {**_BASE, **CASES[name]})
            elif name == "fsdp2-recipe":
                results[name] = _fsdp2_recipe(rank, world)
            elif name == "bf16":
                results[name] = _bf16_windows(rank, world)
            elif name in NOISE_CASES:
                results[name] = _noise_run(rank, world, NOISE_CASES[name])
            elif name == "refusals":
                results[name] = _refusals(rank, world)
            elif name == "checkpoint":
                results[name] = _checkpoint(rank, world, out_dir)
            elif name.startswith("resume-"):
                results[name] = _resume_run(rank, world, out_dir, name.removeprefix("resume-"))
            elif name == "dies":
                results[name] = _rank_dies(rank, world)
            if name != "dies":
                dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    if "dies" in plan:
        os._exit(0)  # a gloo group whose peer is gone cannot be torn down cleanly
    dist.destroy_process_group()


def _launch(tmp_path, world: int, plan: list[str], join_s: float = 240) -> list[dict]:
    store = str(tmp_path / f"store-{world}-{time.monotonic_ns()}")  # one file per group: a used one may remain
    codes = spawn_ranks(_worker, world, (store, str(tmp_path), plan), join_s=join_s)
    assert codes == [0] * world, f"ranks exited with {codes}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


# ---------------------------------------------------------------- references (one process, fp32)
def _reference(cfg: dict, world: int, divide_partial_by_k: bool = False) -> dict:
    """The plain fp32 large-batch recipe over the global micro-batches (module docstring).
    divide_partial_by_k: the wrong recipe (a partial window divided by K instead of its own count)."""
    torch.manual_seed(0)
    model = _net()
    opt = _optimizer(cfg["opt"], model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if cfg["scheduler"] else None
    xs, labels = _data(world)
    skipped = []
    grad_norm_max = 0.0
    for s, k in enumerate(_window_sizes(cfg)):
        denom_k = K if divide_partial_by_k else k
        total = sum(int((labels[s, r, j] != -100).sum()) for r in range(world) for j in range(k))
        for r in range(world):
            for j in range(k):
                x = xs[s, r, j].clone()
                if cfg["nonfinite"] and s == 1 and r == 0 and j == 1:
                    x[0, 0, 0] = float("inf")
                loss = _loss(model, x, labels[s, r, j], cfg["items"], not cfg["unused"])
                (loss / (total if cfg["items"] else denom_k * world)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        bad = not all(bool(torch.isfinite(g).all()) for g in grads)
        skipped.append(bad)
        if not bad:  # bounds SGD's step (tests/tolerances.py sgd_step_over_param)
            grad_norm_max = max(grad_norm_max, float(torch.stack([g.norm() for g in grads]).norm()))
        if not bad:
            if cfg["clip"] is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            opt.step()
            if sched is not None:
                sched.step()
        opt.zero_grad(set_to_none=True)
    return {"params": [p.detach().clone() for p in model.parameters()], "skipped": skipped,
            "grad_norm_max": grad_norm_max if cfg["clip"] is None else min(grad_norm_max, cfg["clip"])}


def _param_rtol(q, world: int, opt: str = "adamw-fused", clip: float | None = MAX_NORM, grad_norm_max: float = MAX_NORM,
                steps: int = STEPS) -> float:
    """A parameter after ``steps`` windows on ``world`` ranks against the one-process recipe: ``recipe_grad_rtol``
    over the global batch's tokens (Net: 3 layers of width HID; each side's clip coefficient when clipping) through
    ``steps`` updates (tests/tolerances.py)."""
    n = sum(p.numel() for p in _net().parameters())
    grad_rtol = recipe_grad_rtol(world * K * B * T, 3, HID, n if clip is not None else 0)
    sgd = opt == "sgd"
    return recipe_param_rtol(q, "sgd" if sgd else "adamw", 0.1 if sgd else LR, steps, grad_rtol,
                             grad_norm_max=grad_norm_max)


def _check_case(name: str, world: int, results: list[dict]) -> None:
    cfg = {**_BASE, **CASES[name]}
    ref = _reference(cfg, world)
    for rank, res in enumerate(results):
        got = res[name]
        assert got["skipped"] == ref["skipped"], f"{name} rank {rank}: skipped {got['skipped']} != {ref['skipped']}"
        for i, (p, q) in enumerate(zip(got["params"], ref["params"])):
            rtol = _param_rtol(q, world, cfg["opt"], cfg["clip"], ref["grad_norm_max"])
            assert rel_diff(p, q) <= rtol, f"{name} rank {rank} param {i}: {rel_diff(p, q):.2e} from the reference"
        assert not any(got["grads_left"]), f"{name}: a .grad left on a parameter"
        # The one hot path's core (csrc/hot_path.cpp's HotPathCore) wherever gaengine._C is built; the Python hooks
        # asked for
        want = "NativeShardHooks" if cfg["hot_path"] == "native" else "ShardHooks"
        assert got["hooks"] == want, f"{name} rank {rank}: hooks {got['hooks']}, expected {want}"
        assert repr(got["norms"]) == repr(results[0][name]["norms"]), f"{name}: ranks disagree on the norm"
    if cfg["partial"] and not cfg["items"]:  # the wrong recipe (the partial window divided by K) fails the check
        wrong = _reference(cfg, world, divide_partial_by_k=True)
        assert any(rel_diff(p, q) > _param_rtol(q, world, cfg["opt"], cfg["clip"], wrong["grad_norm_max"])
                   for p, q in zip(results[0][name]["params"], wrong["params"]))
    if cfg["unused"]:  # the side head never got a gradient: no update (AdamW's weight decay would move it)
        torch.manual_seed(0)
        fresh = _net()
        assert torch.equal(results[0][name]["params"][6], fresh.side.weight.detach())


def _bf16_bound(world: int, results: list[dict]) -> None:
    """gaengine's fp32 window sum of bf16 shards within ``_bf16_bound``'s per-element bound of the fp64 sum of the
    exact micro-batch gradients; FSDP2's own bf16 ``.grad`` accumulation outside it."""
    torch.manual_seed(0)
    model = _net().to(torch.bfloat16)
    xs, labels = _data(world, steps=3, k=BF16_K, seed=11)
    exact, absum = None, None
    for j in range(BF16_K):  # G_j = (1/d) sum_r g_jr in fp64, g_jr the rank's bf16 gradient (FSDP2's AVG)
        g_j = None
        for r in range(world):
            model.zero_grad(set_to_none=True)
            _loss(model, xs[0, r, j].bfloat16(), labels[0, r, j], False, True).backward()
            g = [p.grad.double() / world for p in model.parameters()]
            g_j = g if g_j is None else [a + b for a, b in zip(g_j, g)]
        exact = g_j if exact is None else [a + b for a, b in zip(exact, g_j)]
        absum = [a.abs() for a in g_j] if absum is None else [a + b.abs() for a, b in zip(absum, g_j)]
    ratios_ours, ratios_fsdp2 = [], []
    for rank, res in enumerate(results):
        got = res["bf16"]
        for i, (e, a) in enumerate(zip(exact, absum)):
            chunk_e = torch.chunk(e, world, dim=0)[rank] if rank < len(torch.chunk(e, world, dim=0)) else e[:0]
            chunk_a = torch.chunk(a, world, dim=0)[rank] if rank < len(torch.chunk(a, world, dim=0)) else a[:0]
            bound = 2.0**-9 * chunk_a + (BF16_K + world) * 2.0**-24 * chunk_a + 1e-30
            for store, ratios in ((got["main_grad"][i], ratios_ours), (got["fsdp2_bf16"][i], ratios_fsdp2)):
                if chunk_e.numel():
                    ratios.append(float(((store.double() - chunk_e).abs() / bound).max()))
        assert got["masters_rounded"], f"rank {rank}: the bf16 parameters are not their masters' rounding"
    assert max(ratios_ours) <= 1.0, f"gaengine's fp32 accumulation exceeds the bound: {max(ratios_ours):.3f}"
    assert max(ratios_fsdp2) > 1.0, "FSDP2's bf16 accumulation should break the one-rounding-per-micro-batch bound"


def _noise_oracle(world: int, mode: str, before: list[list[torch.Tensor]], global_small: bool = True) -> list:
    """Per window, the (B_simple, tr Sigma, |G|^2) the accumulator must report, in fp64 (McCandlish et al., arXiv
    1812.06162, eqs. A.2-A.3, with the bias-corrected moving averages written as explicit weighted sums).

    The small batch is the global micro-batch k: ``G_k = U_k / n_k``, ``U_k`` the sum over ranks of the gradients
    of rank r's micro-batch k (of its summed loss, ``n_k`` its items summed over ranks, in item mode; of its mean
    loss, ``n_k = d``, in mean mode: a rank's micro-batch is the unit, as without FSDP2); the big batch is the
    window, ``sum_k U_k / N``. global_small=False: the wrong recipe, each rank's micro-batch as a small batch."""
    xs, labels = _data(world, steps=len(NOISE_PLAN), seed=5)
    model = _net().double()
    traces, grads, out = [], [], []
    for s, k in enumerate(NOISE_PLAN):
        if s != NOISE_POISONED:
            with torch.no_grad():
                for p, v in zip(model.parameters(), before[s]):
                    p.copy_(v.double())
            units, sizes = [], []  # one (U, n) per small batch
            for j in range(k):
                for r in range(world):
                    model.zero_grad(set_to_none=True)
                    logits = model(xs[s, r, j].double()).reshape(-1, OUT)
                    lab = labels[s, r, j].reshape(-1)
                    if mode == "items":
                        nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum").backward()
                        n = float((lab != -100).sum())
                    else:
                        nn.functional.cross_entropy(logits, lab.clamp_min(0)).backward()
                        n = 1.0
                    u = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                    if global_small and r > 0:
                        units[-1], sizes[-1] = units[-1] + u, sizes[-1] + n
                    else:
                        units.append(u)
                        sizes.append(n)
            total = sum(sizes)
            big = torch.stack(units).sum(0) / total
            mean_small = sum(float((u / n) @ (u / n)) for u, n in zip(units, sizes)) / len(units)
            trace = (mean_small - float(big @ big)) / (sum(1.0 / n for n in sizes) / len(sizes) - 1.0 / total)
            traces.append(trace)
            grads.append(float(big @ big) - trace / total)
        t = len(traces)
        avg = [sum((1 - NOISE_EMA) * NOISE_EMA ** (t - 1 - i) * v for i, v in enumerate(vals)) / (1 - NOISE_EMA**t)
               for vals in (traces, grads)]
        out.append((avg[0] / avg[1], avg[0], avg[1]))
    return out


def _check_noise(world: int, name: str, results: list[dict]) -> float:
    """Every rank's estimates within NOISE_RTOL of the oracle; the per-rank small batch (the wrong recipe) not."""
    mode = NOISE_CASES[name]
    before = results[0][name]["before"]
    want = _noise_oracle(world, mode, before)
    worst = 0.0
    for rank, res in enumerate(results):
        assert res[name]["estimates"] == results[0][name]["estimates"], f"{name}: ranks disagree"
        for w, (got, exp) in enumerate(zip(res[name]["estimates"], want)):
            for what, g, e in zip(("B_simple", "tr(Sigma)", "|G|^2"), got, exp):
                err = abs(g - e) / abs(e)
                worst = max(worst, err)
                assert err <= NOISE_RTOL, f"{name} rank {rank} window {w}: {what} {g} vs the fp64 oracle's {e}"
    if world > 1:
        wrong = _noise_oracle(world, mode, before, global_small=False)
        got = results[0][name]["estimates"][0][0]
        assert abs(got - wrong[0][0]) / abs(wrong[0][0]) > NOISE_RTOL, "the per-rank small batch passes too"
    print(f"noise scale, FSDP2, {world} rank(s), {mode}: max relative error {worst:.2e} against the fp64 oracle")
    return worst


def _check_refusals(results: list[dict]) -> None:
    expect = {"fsdp1": ("TypeError", "FullyShardedDataParallel (FSDP1)"),
              "foreign-dtensor": ("TypeError", "fully_shard did not make"),
              "root-not-fsdp": ("TypeError", "call fully_shard(model) on the root"),
              "mixed": ("TypeError", "mixes FSDP2-sharded and plain trainable parameters"),
              "cpu-offload": ("ValueError", "CPUOffloadPolicy"),
              "zero-stage": ("ValueError", "zero_stage=1"),
              "reduce-dtype": ("ValueError", "reduce_dtype"),
              "fused-adamw": ("ValueError", "FusedAdamW"),
              "sync-off": ("RuntimeError", "set_requires_gradient_sync(True)"),
              "full-export": ("TypeError", "get_optimizer_state_dict"),
              "non-elementwise-state": ("ValueError", "needs an elementwise optimizer"),
              "old-format": ("ValueError", "gaengine.GradientAccumulator/fsdp2/1 state dict, saved per rank"),
              "other-model": ("ValueError", "state was saved for another model or optimizer")}
    for rank, res in enumerate(results):
        for name, (kind, words) in expect.items():
            got = res["refusals"][name]
            assert got is not None, f"rank {rank}: {name} was accepted"
            assert got[0] == kind and words in got[1], f"rank {rank}: {name}: {got}"


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fsdp2_against_plain_recipe(tmp_path, world):
    plan = list(WORLD_CASES[world]) + WORLD_NOISE[world]
    if world in (1, 2):
        plan += ["refusals", "bf16"]
    if world == 2:
        plan += ["fsdp2-recipe"]
    results = _launch(tmp_path, world, plan)
    for name in WORLD_CASES[world]:
        _check_case(name, world, results)
    for name in WORLD_NOISE[world]:
        _check_noise(world, name, results)
    if "refusals" in plan:
        _check_refusals(results)
    if "bf16" in plan:
        _bf16_bound(world, results)
    if "fsdp2-recipe" in plan:  # the second reference: FSDP2's own fp32 recipe
        for res in results:
            for p, q in zip(res["mean"]["params"], res["fsdp2-recipe"]):
                assert rel_diff(p, q) <= _param_rtol(q, world)


def test_rank_dying_mid_window(tmp_path):
    results = _launch(tmp_path, 2, ["dies"], join_s=60)
    got = results[0]["dies"]
    assert got["raised"] is not None and got["after_s"] < 30, got
    assert results[1]["dies"] == {"died": True}



def test_checkpoint_2_ranks_to_3(tmp_path):
    """Saved on 2 ranks between windows and loaded on 3: the plain recipe's window 0 on 2 ranks' micro-batches, then
    window 1 on 3 ranks', within ``_param_rtol``. Saved and resumed mid-window on 2 ranks: bit for bit what going on gave."""
    two = _launch(tmp_path, 2, ["checkpoint"])
    for res in two:
        for a, b in zip(res["checkpoint"]["resumed"], res["checkpoint"]["went_on"]):
            assert torch.equal(a, b), "a mid-window resume is not exact"
    three = _launch(tmp_path, 3, ["checkpoint"])
    torch.manual_seed(0)
    model = _net()
    opt = _optimizer("adamw-fused", model.parameters())
    for s, world in ((0, 2), (1, 3)):
        xs, labels = _data(world)
        for r in range(world):
            for j in range(K):
                (_loss(model, xs[s, r, j], labels[s, r, j], False, True) / (K * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for res in three:
        for p, q in zip(res["checkpoint"]["params"], model.parameters()):
            assert rel_diff(p, q) <= _param_rtol(q.detach(), 3, steps=2)


def _check_resume(name: str, results: list[dict]) -> None:
    """The resumed run's parameters, fp32 masters and noise estimates equal the uninterrupted run's bit for bit."""
    for rank, res in enumerate(results):
        went_on, resumed = res[name]["went_on"], res[name]["resumed"]
        for i, (a, b) in enumerate(zip(resumed["params"], went_on["params"])):
            assert torch.equal(a, b), f"{name} rank {rank} param {i}: the resumed run differs"
        assert resumed["estimates"] == went_on["estimates"], f"{name} rank {rank}: noise estimates differ"
        if went_on["masters"] is not None:
            assert torch.equal(resumed["masters"], went_on["masters"]), f"rank {rank}: the fp32 masters differ"
            assert not torch.equal(went_on["masters"].bfloat16().float(), went_on["masters"]), "no fp32 bits"


def test_mid_window_resume_noise_scale(tmp_path):
    """fp32, ``measure_noise_scale=True``, saved mid-window on 2 ranks and resumed by a fresh model, optimizer and
    accumulator: the window's sums and the noise scale's moving averages come back. The reference is the
    uninterrupted run: parameters and both windows' noise estimates equal bit for bit."""
    results = _launch(tmp_path, 2, ["resume-noise"])
    _check_resume("resume-noise", results)
    for res in results:
        estimates = res["resume-noise"]["went_on"]["estimates"]
        assert len(estimates) == 2 and all(math.isfinite(v) for est in estimates for v in est)


def test_mid_window_resume_bf16_masters(tmp_path):
    """bf16 sharded parameters with fp32 masters (``master_weights=True``), saved mid-window on 2 ranks (DCP of the
    model's state dict and ``acc.state_dict()``, which holds the masters and the optimizer's moments) and resumed by
    a fresh model, optimizer and accumulator: the masters' fp32 bits (not the bf16 model's rounding) come back. The
    reference is the uninterrupted run: parameters and masters equal bit for bit."""
    _check_resume("resume-bf16", _launch(tmp_path, 2, ["resume-bf16"]))


@pytest.mark.xfail(strict=True, reason="bf16 FSDP2 parameters with masters: the optimizer holds fp32 master "
                   "DTensors that are not the model's parameters, so torch's get_state_dict(model, optimizer) "
                   "raises KeyError (no FQN for them); acc.state_dict() saves them instead (docs/fsdp2.md)")
def test_mid_window_resume_bf16_masters_get_state_dict(tmp_path):
    """As ``test_mid_window_resume_bf16_masters``, the model and optimizer saved through ``get_state_dict``."""
    _check_resume("resume-bf16-dcp", _launch(tmp_path, 2, ["resume-bf16-dcp"]))


def test_gaengine_train_fsdp_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m gaengine train --fsdp` (gloo on CPU, fp32, 3 updates): the demo GPT sharded
    per block plus the root trains, prints the usual summary once, and its window losses and gradient norms are
    the plain fp32 recipe's in one process over both ranks' micro-batches (each rank samples its own half of the
    training bytes from the same seed, as ``gaengine.tools.train`` does), within 1e-5 relative."""
    import json
    import subprocess

    from gaengine.tools.data import load_corpus, sample_batch
    from gaengine.tools.train import TrainConfig, _optimizer, _scheduler, build_model

    shape = dict(micro_batch_size=2, accumulation_steps=2, seq_len=16, n_layers=2, d_model=32, n_heads=2)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "gaengine", "train", "--fsdp", "--steps", "3", "--dtype", "fp32", "--device", "cpu",
           "--eval-batches", "1", "--eval-interval", "2", "--max-data-mb", "0.1", "--quiet", "--out", str(out),
           *[a for k, v in shape.items() for a in ("--" + k.replace("_", "-"), str(v))]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("sharded with") == 1 and proc.stdout.count("2 rank(s)") == 1  # one summary, rank 0's
    assert proc.stdout.count("\nmode: FSDP2 over 2 ranks (") == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and not any(r["skipped"] for r in train)

    config = TrainConfig(steps=3, dtype="fp32", device="cpu", **shape)
    corpus = load_corpus(None, max_bytes=int(0.1 * 2**20), min_split_bytes=config.seq_len + 1)
    n, world, k = corpus.train.numel(), 2, config.accumulation_steps
    shards = [corpus.train[r * n // world:(r + 1) * n // world] for r in range(world)]
    gens = [torch.Generator().manual_seed(config.seed) for _ in range(world)]
    model = build_model(config)
    opt = _optimizer(model, config)
    sched = _scheduler(opt, config)
    for record in train:
        window_loss = 0.0
        for r in range(world):
            for _ in range(k):
                x, y = sample_batch(shards[r], config.micro_batch_size, config.seq_len, gens[r])
                loss = model(x, y) / (k * world)
                loss.backward()
                window_loss += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        # Not from tests/tolerances.py: a 2-layer GPT after updates whose parameters already differ, a drift its
        # update_rtol neglects; 1e-5 relative is a documented choice for this end-to-end check.
        assert abs(record["loss"] - window_loss) <= 1e-5 * abs(window_loss), (record, window_loss)
        assert abs(record["grad_norm"] - norm) <= 1e-5 * norm, (record, norm)


def test_gaengine_train_fsdp_refusals(tmp_path, capsys):
    """``--fsdp`` in one process (nothing to shard over), with ``zero_stage`` > 0 or ``auto_micro_batch``: each a
    clear error naming the option, before any training."""
    from gaengine.tools.cli import main
    from gaengine.tools.train import TrainConfig

    with pytest.raises(ValueError, match="leave zero_stage at 0"):
        TrainConfig(fsdp=True, zero_stage=1)
    with pytest.raises(ValueError, match="auto_micro_batch is single-process only"):
        TrainConfig(fsdp=True, auto_micro_batch=True)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--fsdp", "--steps", "1", "--quiet", "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert exc.value.code == 2 and "run it as torchrun --nproc-per-node N" in capsys.readouterr().err


@pytest.mark.cuda
def test_shard_hooks_wait_for_a_gradient_from_another_stream(tmp_path):
    """One rank on a GPU (NCCL): every backward runs on a side stream that starts late (``torch.cuda._sleep``), and
    FSDP2 reduce-scatters on its own stream and calls the shard hooks there; their accumulate into ``main_grad`` must
    be ordered after both (as the native hooks order theirs, csrc/hot_path.cpp). Against the plain fp32 recipe on the
    same GPU (backward on the current stream, ``.grad`` summed by autograd), within ``recipe_param_rtol`` after two
    updates."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = _net().cuda()
        model = copy.deepcopy(plain)
        mesh = init_device_mesh("cuda", (1,))
        for block in (model.l0, model.l1, model.head, model.side):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=None)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
        g = torch.Generator(device="cuda").manual_seed(3)
        side = torch.cuda.Stream()
        grad_norm_max = 0.0
        for _ in range(2):
            batches = [(torch.randn(B * T, IN, device="cuda", generator=g),
                        torch.randn(B * T, OUT, device="cuda", generator=g)) for _ in range(K)]
            for x, y in batches:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(2_000_000)  # the side stream's gradients come late
                    acc.backward(nn.functional.mse_loss(model(x), y))
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.empty_cache()  # freed gradients go back to the allocator at once
                (nn.functional.mse_loss(plain(x), y) / K).backward()
            assert acc.step() is not None
            grad_norm_max = max(grad_norm_max, float(torch.stack([q.grad.norm() for q in plain.parameters()
                                                                   if q.grad is not None]).norm()))
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)
        grad_rtol = recipe_grad_rtol(K * B * T, 3, HID)  # (loss / K).backward() against loss.backward(), no clip
        for p, q in zip(model.parameters(), plain.parameters()):
            rtol = recipe_param_rtol(q.detach(), "sgd", LR, 2, grad_rtol, grad_norm_max=grad_norm_max, momentum=0.0)
            assert rel_diff(p.full_tensor(), q) <= rtol
        acc.close()
    finally:
        dist.destroy_process_group()
