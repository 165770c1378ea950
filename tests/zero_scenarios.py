"""The ZeRO scenarios' pieces that ``tests/test_zero.py`` and ``tests/test_zero_backends.py`` share: the data, micro-
batches and loss of ``tests.models.Net`` over a world of gloo ranks, the optimizers, a configuration's defaults
(``BASE``) and its windows, the launch of a scenario on the ranks, and the reference: the plain PyTorch recipe in one
process (``plain_recipe``) with the tolerance of the ranks' masters against it (``masters_rtol``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import gaengine.optim
from tests.models import Net
from tests.ranks import launch_scenario
from tests.tolerances import clip_coef_rtol, recipe_param_rtol, split_batch_rtol, sum_rtol, unit_roundoff

K, B, STEPS, MAX_NORM, LR = 3, 2, 3, 0.05, 1e-2
"""Micro-batches per window, rows per micro-batch, windows, the clipping norm, the optimizers' learning rate."""


BASE = dict(stage=1, items=False, dtype=torch.float32, opt="adamw-fused", clip=MAX_NORM, masters=True,
            partial=False, nonfinite=False, scheduler=False, reduce_dtype=torch.float32, overlap=False,
            dropped=False, schedule=None)
"""A configuration's defaults, each test file's configurations overriding some: stage 1, mean mode, fp32, fused torch
AdamW, clipping at ``MAX_NORM``, fp32 masters, ``STEPS`` full windows of ``K``, an fp32 wire."""


def token_data(world):
    """``(tokens, labels)``, each ``(STEPS, world * K * B, 5)`` int64 over a vocabulary of 11 for ``tests.models.Net``:
    every rank's micro-batches of every window; labels -100 past a different length in every row (item mode)."""
    g = torch.Generator().manual_seed(321)
    tokens = torch.randint(0, 11, (STEPS, world * K * B, 5), generator=g)
    labels = torch.randint(0, 11, (STEPS, world * K * B, 5), generator=g)
    for step in range(STEPS):  # a different number of real tokens in every micro-batch (item mode)
        for row in range(world * K * B):
            labels[step, row, (step + row) % 5 + 1:] = -100
    return tokens, labels


def micro_batch(data, step, rank, k):
    """Micro-batch ``k`` of ``rank`` in window ``step``: ``B`` rows, laid out rank-major, so one process sees the
    world's micro-batches in order."""
    tokens, labels = data
    lo = (rank * K + k) * B
    return tokens[step, lo:lo + B], labels[step, lo:lo + B]


def micro_loss(model, tokens, labels, item_mode, use_side):
    """fp32 cross-entropy of ``model(tokens, use_side=use_side)``: summed over the real tokens in item mode, else the
    mean over every token (labels -100 counted as class 0)."""
    logits = model(tokens, use_side=use_side).float().reshape(-1, 11)
    if item_mode:
        return nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    return nn.functional.cross_entropy(logits, labels.reshape(-1).clamp_min(0))


def make_optimizer(name, params):
    """The optimizer ``name`` over ``params`` in two groups (matrices; vectors without weight decay at ``LR / 2``):
    "adamw-fused" (``torch.optim.AdamW(fused=True)``), "fused-adamw" (``gaengine.optim.FusedAdamW``), "adam",
    "sgd" (momentum 0.9)."""
    groups = [{"params": [p for p in params if p.dim() > 1]},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": LR / 2}]
    if name == "adamw-fused":
        return torch.optim.AdamW(groups, lr=LR, weight_decay=0.1, fused=True)
    if name == "fused-adamw":
        return gaengine.optim.FusedAdamW(groups, lr=LR, weight_decay=0.1)
    if name == "adam":
        return torch.optim.Adam(groups, lr=LR, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    raise AssertionError(name)


def window_sizes(cfg):
    """Micro-batches of each window: K, or the schedule's, and the last one partial (K - 1, stepped with
    force=True)."""
    if cfg["schedule"] is not None:
        return list(cfg["schedule"])
    return [K - 1 if cfg["partial"] and w == STEPS - 1 else K for w in range(STEPS)]


def is_poisoned(cfg, step, rank, k):
    """Whether ``cfg`` makes this micro-batch's loss infinite (``nonfinite``: rank 1's first of window 1)."""
    return cfg["nonfinite"] and step == 1 and rank == 1 and k == 0


def plain_recipe(world, cfg):
    """The plain recipe in one process over all ranks' micro-batches. Optimizer: torch's (``torch.optim.AdamW(fused=
    True)`` stands for ``gaengine.optim.FusedAdamW``). Without master weights, a torch optimizer updates the bf16/
    fp16 parameters from the gradient rounded to their dtype; FusedAdamW's in-place update is AdamW on fp32
    copies of p, m and v, each rounded back to the parameter's dtype after the step."""
    torch.manual_seed(0)
    model = Net().to(cfg["dtype"])
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    low_no_masters = not cfg["masters"] and cfg["dtype"] != torch.float32
    on_model = low_no_masters and cfg["opt"] != "fused-adamw"  # a torch optimizer on the bf16/fp16 parameters
    opt = make_optimizer("adamw-fused" if cfg["opt"] == "fused-adamw" else cfg["opt"], params if on_model else masters)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if cfg["scheduler"] else None
    data = token_data(world)
    scale = 2.0**16 if cfg["dtype"] == torch.float16 else 1.0  # GradScaler's initial scale
    skipped = []
    for step, k_steps in enumerate(window_sizes(cfg)):
        sums = [None] * len(params)
        items, poisoned = 0, False
        for rank in range(world):
            for k in range(k_steps):
                t, l = micro_batch(data, step, rank, k)
                poisoned |= is_poisoned(cfg, step, rank, k)
                items += int((l != -100).sum())
                model.zero_grad(set_to_none=True)
                (micro_loss(model, t, l, cfg["items"], use_side=rank == 0) * scale).backward()
                for i, p in enumerate(params):
                    if p.grad is not None:
                        sums[i] = p.grad.float() if sums[i] is None else sums[i] + p.grad.float()
        denom = (items if cfg["items"] else world * k_steps) * scale
        found_inf = poisoned or not all(torch.isfinite(s).all() for s in sums if s is not None)
        skipped.append(found_inf)
        if found_inf:
            scale /= 2 if cfg["dtype"] == torch.float16 else 1
            continue
        for m, s in zip(masters, sums):
            m.grad = None if s is None else s / denom
        if cfg["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(masters, cfg["clip"])
        if on_model:
            for p, m in zip(params, masters):
                p.grad = None if m.grad is None else m.grad.to(p.dtype)
        opt.step()
        if sched is not None:
            sched.step()
        with torch.no_grad():
            if on_model:
                for p, m in zip(params, masters):
                    m.copy_(p)
            elif low_no_masters:  # p, m, v rounded to the parameter's dtype after every step
                for m in masters:
                    for t in [m] + [v for v in opt.state[m].values() if v.dim() > 0]:
                        t.copy_(t.to(cfg["dtype"]))
            for p, m in zip(params, masters):
                p.copy_(m)
    return {n: m.detach() for (n, _), m in zip(model.named_parameters(), masters)}, skipped, \
        [g["lr"] for g in opt.param_groups]


def masters_rtol(cfg, world, expected, n):
    """The masters of ``cfg`` on ``world`` ranks against ``plain_recipe``: the same micro-batch gradients summed over
    the ranks in another order, each side's clip coefficient (n elements), a bf16/fp16 wire's rounding of each
    rank's sum and its sum over the ranks; the updates (fp32 SGD at lr 0.1, or AdamW/Adam at LR); without masters
    a bf16/fp16 parameter and its moments are rounded after every update, where a last-bit difference may flip a
    rounding: one ulp (2 u) per update."""
    windows = window_sizes(cfg)
    grad_rtol = split_batch_rtol(world * max(windows)) + (2 * clip_coef_rtol(n) if cfg["clip"] else 0.0)
    if cfg["reduce_dtype"] != torch.float32:
        grad_rtol += unit_roundoff(cfg["reduce_dtype"]) + sum_rtol(world, cfg["reduce_dtype"])
    sgd = cfg["opt"] == "sgd"
    rtol = recipe_param_rtol(expected, "sgd" if sgd else "adamw", 0.1 if sgd else LR, len(windows), grad_rtol,
                             grad_norm_max=cfg["clip"])
    if not cfg["masters"] and cfg["dtype"] != torch.float32:
        rtol += len(windows) * 2 * unit_roundoff(cfg["dtype"])
    return rtol


def launch(tmp_path, world, scenario, arg=None):
    """``scenario(rank, world, arg)`` on ``world`` gloo ranks (``tests.ranks.launch_scenario``): every result."""
    codes, results = launch_scenario(tmp_path, world, functools.partial(_with_arg, scenario, arg), join_s=240)
    assert codes == [0] * world, f"{scenario.__name__}: a rank failed (see the captured stderr)"
    return results


def _with_arg(scenario, arg, rank, world, out):
    return scenario(rank, world, arg)
