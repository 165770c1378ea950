"""The plain large-batch recipe that the Lightning Trainer's and Fabric's integration tests
(tests/test_integration_lightning.py, tests/test_integration_fabric.py) check every update against: the regression
data and model of Lightning's accumulation scenarios, their windows and each rank's rows, the recipe itself (one
backward over the window's samples, torch's clip, optimizer and scheduler: no gaengine, no Lightning) and the
comparisons, with the fixture that keeps the launch variables Lightning sets out of later tests."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.tolerances import rel_diff

N_FEATURES, BATCH, LR, MOMENTUM, GAMMA = 5, 2, 0.2, 0.5, 0.9
RTOL = 1e-5


@pytest.fixture(autouse=True)
def _restore_environ():
    """Lightning's Trainer sets launch variables in this process (LOCAL_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT,
    ...) and OMP_NUM_THREADS: each test leaves os.environ as it found it, so later tests in the same pytest worker
    (Accelerate's, which would start a process group from them) never see them."""
    saved = dict(os.environ)
    yield
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _data(n_samples: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, N_FEATURES, generator=g)
    y = (x @ torch.randn(N_FEATURES, 1, generator=g)).tanh() + 0.1 * torch.randn(n_samples, 1, generator=g)
    return x, y


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))


def _lr_lambda(step: int) -> float:
    return GAMMA ** step


def _windows(n_batches: int, ks: list[int]) -> list[list[int]]:
    """Batch indices of each window of one epoch of ``n_batches`` with K = ``ks[epoch]``: full windows of K, and
    the epoch's last batch closes a partial one (Lightning's rule)."""
    out = []
    for k in ks:
        out += [list(range(i, min(i + k, n_batches))) for i in range(0, n_batches, k)]
    return out


def _rows_one_process(b: int) -> list[torch.Tensor]:
    """The rows of batch ``b`` of one process: one micro-batch of ``BATCH`` consecutive samples."""
    return [torch.arange(b * BATCH, (b + 1) * BATCH)]


def _rows_two_ranks(b: int) -> list[torch.Tensor]:
    """The rows of global batch ``b`` on 2 ranks under a ``DistributedSampler`` (no shuffle: rank r takes
    samples r, r + 2, ...): rank r's micro-batch holds samples 4b + r and 4b + 2 + r."""
    return [torch.tensor([4 * b + r, 4 * b + 2 + r]) for r in range(2)]


def _micro_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``Regression`` module's loss in the model's dtype (``training_step``)."""
    return nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))


def reference(x, y, windows: list[list[int]], clip: float | None = None, dtype=torch.float32,
              rows=_rows_one_process, loss=_micro_loss):
    """The plain single-process large-batch recipe, no gaengine: per window, the mean loss over the window's
    samples, one backward (bf16: each micro-batch's gradient from the bf16 model, summed in fp64, divided by the
    micro-batches), torch's ``clip_grad_norm_``, ``SGD`` on fp32 (master) weights and a ``LambdaLR`` stepped once per
    update. ``rows(b)``: the micro-batches (row indices) of batch ``b``; ``loss(model, x, y, dtype)``: a bf16
    micro-batch's loss. Returns the fp32 parameters after every
    update and the learning rate each update used."""
    masters = [p.detach().to(dtype).float() for p in _net().parameters()]  # bf16: the converted model's values
    model = _net().to(dtype)
    opt = torch.optim.SGD(masters, lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    after, lrs = [], []
    for batches in windows:
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        micro = [r for b in batches for r in rows(b)]
        if dtype == torch.float32:
            whole = torch.cat(micro)
            model.zero_grad()
            nn.functional.mse_loss(model(x[whole]), y[whole]).backward()
            grads = [p.grad.double() for p in model.parameters()]
        else:
            grads = [torch.zeros_like(m, dtype=torch.float64) for m in masters]
            for r in micro:
                model.zero_grad()
                loss(model, x[r], y[r], dtype).backward()
                for g, p in zip(grads, model.parameters()):
                    g += p.grad.double()
            grads = [g / len(micro) for g in grads]
        for m, g in zip(masters, grads):
            m.grad = g.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        after.append([m.detach().clone() for m in masters])
    return after, lrs


def _assert_params_close(actual: list[torch.Tensor], expected: list[torch.Tensor], what: str, rtol=RTOL):
    for i, (a, e) in enumerate(zip(actual, expected)):
        d = rel_diff(a, e)
        assert d <= rtol, f"{what}, parameter {i}: relative difference {d:.3e} > {rtol:g}"


def _assert_model_close(actual: list[torch.Tensor], expected: list[torch.Tensor], what: str, dtype: torch.dtype):
    """The module's parameters (as recorded, in fp32) against the recipe's fp32 (master) parameters: fp32 within
    RTOL; bf16 parameters are gaengine's fp32 masters (within RTOL of the recipe's) rounded to bf16 once, so each
    element lies within one bf16 ulp (2^-7 relative) of the recipe's master: the bound one bf16 rounding allows."""
    if dtype == torch.float32:
        _assert_params_close(actual, expected, what)
        return
    for i, (a, e) in enumerate(zip(actual, expected)):
        ulp = torch.finfo(torch.bfloat16).eps * e.abs().clamp_min(1e-30)
        worst = float(((a - e).abs() / ulp).max())
        assert worst <= 1.0, f"{what}, parameter {i}: {worst:.2f} bf16 ulp from the recipe's master"
