"""``gaengine.integrations.accelerate.GaengineAccelerator``: Accelerate's own loop, run by Accelerate, against the
plain single-process fp64 large-batch recipe computed here.

The scenario is Accelerate's ``test_sync.py`` (``test_gradient_accumulation_with_opt_and_scheduler``): its
``RegressionModel`` (y = a x + b) and ``RegressionDataset``, 80 samples, batch 16, K = 2, so the dataloader's 5
batches make two full windows and a partial one; AdamW and ``LambdaLR(epoch ** 0.65)``. The reference runs each
window as one batch (the concatenation of the window's micro-batches, whatever their count) in fp64. Accelerate's own
recipe divides every loss by K, the partial window's too, and fails the same check.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.test_utils.training import RegressionDataset, RegressionModel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gaengine.integrations.accelerate import GaengineAccelerator, GaengineOptimizer  # noqa: E402
from tests.ranks import free_port, spawn_ranks, torchrun_rank  # noqa: E402
from tests.tolerances import (  # noqa: E402
    RTOL, adamw_step_over_param, clip_coef_rtol, clipped_grad_rtol, mean_rtol, network_rtol, norm_rtol, rel_diff,
    sgd_step_over_param, split_batch_rtol, update_rtol)

N, BATCH, K, LR = 80, 16, 2, 1e-3
# bf16: each micro-batch's gradient rounded to bf16 once (at most RTOL[bf16] = 2^-8 relative), their fp32 mean no
# further than that: the bound stated for bf16
BF16_RTOL = RTOL[torch.bfloat16]


def _lam(step):
    return step**0.65  # Accelerate's test_sync.py schedule


from tests.accelerate_state import fresh_accelerate_state  # noqa: E402,F401 - autouse: Accelerate's state reset


def _mse(model, batch):
    out = model(batch["x"])
    return torch.nn.functional.mse_loss(out, batch["y"].to(out.dtype))


def _run(accelerator, *, dtype=torch.float32, optim="adamw", max_norm=None, record_batches=False):
    """Accelerate's loop as its users write it; returns per applied update: the (fp32 master) parameters, the lr the
    update used, the norm clip_grad_norm_ returned, and (``record_batches``) the batches each window held."""
    torch.manual_seed(42)
    model = RegressionModel().to(dtype)
    if optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=_lam)
    loader = DataLoader(RegressionDataset(length=N, seed=42), batch_size=BATCH)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    updates, window = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            window.append({k: v.clone() for k, v in batch.items()})
            accelerator.backward(_mse(model, batch))
            norm = None
            if max_norm is not None and accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            opt.zero_grad()
            if accelerator.sync_gradients:
                params = [p.detach().float().clone() for g in opt.param_groups for p in g["params"]]
                updates.append({"params": params, "lr": lr, "norm": None if norm is None else float(norm),
                                "batches": window if record_batches else None, "micro": len(window)})
                window = []
    return updates, model, opt


def _reference(windows, *, optim="adamw", max_norm=None, lr_steps_per_update=1):
    """fp64, one process: each window as one batch (the mean over all its samples), AdamW (or SGD) and LambdaLR
    stepped ``lr_steps_per_update`` times per update; returns per update the parameters, the lr and the norm."""
    torch.manual_seed(42)
    model = RegressionModel().double()
    opt = (torch.optim.AdamW(model.parameters(), lr=LR) if optim == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=_lam)
    out = []
    for batches in windows:
        x = torch.cat([b["x"] for b in batches]).double()
        y = torch.cat([b["y"] for b in batches]).double()
        torch.nn.functional.mse_loss(model(x), y).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad for p in model.parameters()]))
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad()
        for _ in range(lr_steps_per_update):
            sched.step()
        out.append({"params": [p.detach().clone() for p in model.parameters()], "lr": lr, "norm": float(norm)})
    return out


def _windows():
    batches = list(DataLoader(RegressionDataset(length=N, seed=42), batch_size=BATCH))
    return [batches[i:i + K] for i in range(0, len(batches), K)]


def _max_rel(updates, ref):
    return max(rel_diff(p, q.float()) for u, r in zip(updates, ref) for p, q in zip(u["params"], r["params"]))


def _fp64_grad_rtol(n_samples, clipped=False):
    """An fp32 window gradient of the regression model (y = a x + b: one layer, width 1) over ``n_samples``
    against the fp64 one: half of ``split_batch_rtol`` (one side rounds), the layer's own products, and with
    clipping the fp32 side's clip coefficient from its 2-element norm."""
    return split_batch_rtol(n_samples) / 2 + network_rtol(1, 1) + (clip_coef_rtol(2) if clipped else 0.0)


def _assert_fp64_params(updates, ref, *, optim="adamw", max_norm=None, n_samples=K * BATCH):
    """The fp32 parameters after update t within ``update_rtol`` of t + 1 updates of the fp64 reference's (one side
    rounds), at the largest lr used so far; ``n_samples`` bounds a window's samples (the partial ones hold fewer)."""
    grad_rtol = _fp64_grad_rtol(n_samples, clipped=max_norm is not None)
    for t, (u, r) in enumerate(zip(updates, ref, strict=True)):
        lr = max(x["lr"] for x in ref[:t + 1])
        for i, (p, q) in enumerate(zip(u["params"], r["params"])):
            q = q.float()
            if optim == "adamw":
                bound = update_rtol(t + 1, adamw_step_over_param(lr, q), grad_rtol, sides=1)
            else:  # plain SGD (no momentum), its gradient at most max_norm or the reference's largest norm
                g_max = max_norm if max_norm is not None else max(x["norm"] for x in ref[:t + 1])
                bound = update_rtol(t + 1, sgd_step_over_param(lr, 0.0, g_max, q), grad_rtol, grad_gain=1.0,
                                    step_roundings=3, sides=1)
            assert rel_diff(p, q) <= bound, f"update {t}, param {i}: {rel_diff(p, q):.3e} > {bound:.3e}"


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sync_scenario_matches_full_batch_fp64(dtype):
    """test_sync.py's AdamW + LambdaLR loop: after every update (the end-of-dataloader partial window included) the
    parameters equal the fp64 full-batch reference, and the lr advanced once per applied update."""
    updates, model, opt = _run(GaengineAccelerator(cpu=True, gradient_accumulation_steps=K), dtype=dtype)
    assert isinstance(opt, GaengineOptimizer) and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    assert [u["micro"] for u in updates] == [2, 2, 1]  # the fifth batch is a partial window, stepped
    ref = _reference(_windows())
    assert [u["lr"] for u in updates] == [r["lr"] for r in ref]  # the same LambdaLR, the same steps: exact
    assert [u["lr"] for u in updates] == [0.0, LR, LR * 2**0.65]  # LambdaLR's own base_lr * lambda(step)
    if dtype == torch.float32:
        _assert_fp64_params(updates, ref)
    else:
        assert _max_rel(updates, ref) <= BF16_RTOL


def test_accelerate_own_recipe_fails_the_reference():
    """Accelerate's backward divides by K, the partial window's loss too: the same loop and check fail on the last
    update (and only there), so the check above can fail."""
    updates, _, _ = _run(Accelerator(cpu=True, gradient_accumulation_steps=K), optim="sgd")
    ref = _reference(_windows(), optim="sgd")
    _assert_fp64_params(updates[:2], ref[:2], optim="sgd")
    assert _max_rel(updates, ref) > 1e-2


def test_clip_grad_norm_returns_the_window_norm_and_clips():
    """``clip_grad_norm_`` at the window's end returns gaengine's norm of the normalized window gradient (the fp64
    full-batch norm: no division by K, the partial window normalized by its one micro-batch) and clips with it; SGD,
    where a wrong scale would show in the parameters."""
    max_norm = 0.5
    updates, _, _ = _run(GaengineAccelerator(cpu=True, gradient_accumulation_steps=K), optim="sgd", max_norm=max_norm)
    ref = _reference(_windows(), optim="sgd", max_norm=max_norm)
    # the fp32 window gradient's error (unclipped: the norm is taken before clipping) plus the norm's own
    norm_rel = _fp64_grad_rtol(K * BATCH) + norm_rtol(2)
    assert [u["norm"] for u in updates] == pytest.approx([r["norm"] for r in ref], rel=norm_rel)
    assert min(r["norm"] for r in ref) > max_norm  # every update was clipped
    _assert_fp64_params(updates, ref, optim="sgd", max_norm=max_norm)


def test_backward_item_mode_is_the_exact_item_mean():
    """``backward(loss_sum, num_items=n)``: micro-batches with different numbers of valid items (a mask, as padded
    tokens), the window's gradient is the sum over the window's valid items over their count, as one fp64 batch."""
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=3)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ref = torch.nn.Linear(4, 1).double()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model, opt = accelerator.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g), torch.arange(6) < n) for n in (6, 1, 3)]
    for x, y, mask in micro:
        loss_sum = ((model(x) - y)[mask] ** 2).sum()
        accelerator.backward(loss_sum, num_items=torch.tensor(int(mask.sum())))
    opt.step()
    x = torch.cat([m[0][m[2]] for m in micro]).double()
    y = torch.cat([m[1][m[2]] for m in micro]).double()
    token_mean = ((ref(x) - y) ** 2).mean()
    mean_of_means = sum(((ref(a.double()) - b.double())[m] ** 2).mean() for a, b, m in micro) / len(micro)
    n_items = x.shape[0]
    # each residual a dot product of length 6 ([w, b, -1] . [x, 1, y]) in fp32, squared (twice its error), then a
    # mean of positive terms over the items
    loss_rel = 2 * network_rtol(1, 6, products_per_layer=1) + mean_rtol(n_items)
    assert float(opt.last_result.loss) == pytest.approx(token_mean.item(), rel=loss_rel)
    assert abs(mean_of_means.item() / token_mean.item() - 1) > 1e-2  # the two recipes differ on this data
    token_mean.backward()
    ref_opt.step()
    # one SGD update (lr 0.5, no momentum) from an fp32 gradient whose backward reduces the items in its own order
    grad_rtol = split_batch_rtol(n_items) / 2 + network_rtol(1, 6)
    g_norm = float(torch.linalg.vector_norm(torch.cat([q.grad.reshape(-1) for q in ref.parameters()])))
    for p, q in zip(model.parameters(), ref.parameters()):
        q = q.detach().float()
        bound = update_rtol(1, sgd_step_over_param(0.5, 0.0, g_norm, q), grad_rtol, grad_gain=1.0, step_roundings=3,
                            sides=1)
        assert rel_diff(p, q) <= bound


def test_no_sync_is_a_null_context_and_zero_grad_drops_at_sync():
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with accelerator.no_sync(model):
        accelerator.backward(model(torch.ones(2, 3)).sum())
    assert accelerator.accumulator.num_micro_batches == 1  # accumulated, nothing reduced (there is no DDP)
    accelerator.gradient_state._set_sync_gradients(False)
    opt.zero_grad()  # off a synchronizing step: Accelerate's zero_grad does nothing, nor does gaengine's
    assert accelerator.accumulator.num_micro_batches == 1
    accelerator.gradient_state._set_sync_gradients(True)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()  # at a synchronizing step Accelerate drops the .grad: gaengine drops the window
    assert accelerator.accumulator.num_micro_batches == 0
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_fp16_uses_gaengine_loss_scaling_and_a_skip_holds_the_scheduler():
    """``mixed_precision="fp16"``: no GradScaler (``accelerator.scaler`` is None, the prepared optimizer has none),
    gaengine scales dynamically; a non-finite micro-batch skips the update: parameters kept, ``step_was_skipped``,
    and Accelerate's scheduler does not step."""
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="fp16")
    assert accelerator.scaler is None
    model = torch.nn.Linear(4, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda s: 1.0 / (s + 1))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    assert opt.scaler is None and accelerator.accumulator.scaler is not None  # gaengine's dynamic loss scale
    x = torch.ones(2, 4, dtype=torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    accelerator.gradient_state._set_sync_gradients(False)
    accelerator.backward(model(x).float().mean())
    accelerator.gradient_state._set_sync_gradients(True)
    accelerator.backward(model(x).float().mean() * float("inf"))  # a non-finite gradient in the window
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    assert accelerator.optimizer_step_was_skipped
    assert opt.param_groups[0]["lr"] == lr
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_at_a_synchronizing_step_is_the_window_gradient(dtype):
    """Inside ``accumulate()`` at a synchronizing step, after ``backward()``: ``.grad`` holds the window's gradient
    (before ``clip_grad_norm_``) and the clipped one (after it, before ``optimizer.step()``), as in plain Accelerate's
    run of the same loop (test_sync.py's model and data, K = 2, windows of 2, 2 and 1 micro-batches, clipped at
    0.5): within ``clipped_grad_rtol`` of the largest (fp32: Accelerate sums g1/2 + g2/2, gaengine (g1 + g2) / 2,
    each clipped with its own coefficient), one bf16 rounding (BF16_RTOL) for bf16 parameters (both runs), and the
    norms clip_grad_norm_ returns within two fp32 ``norm_rtol``.
    The partial last window: Accelerate divides its one micro-batch by K (its documented difference), so its
    gradient is compared times K. ``optimizer.zero_grad()`` leaves ``.grad`` None, as Accelerate's does."""
    def run(accelerator_cls):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = accelerator_cls(cpu=True, gradient_accumulation_steps=K)
        torch.manual_seed(42)
        model = RegressionModel().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = DataLoader(RegressionDataset(length=N, seed=42), batch_size=BATCH)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        seen, micro = [], 0
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(_mse(model, batch))
                micro += 1
                if accelerator.sync_gradients:
                    before = [p.grad.float().clone() for p in model.parameters()]
                    norm = float(accelerator.clip_grad_norm_(model.parameters(), 0.5))
                    after = [p.grad.float().clone() for p in model.parameters()]
                    seen.append((before, after, norm, micro))
                    micro = 0
                opt.step()
                opt.zero_grad()
                assert all(p.grad is None for p in model.parameters()) or not accelerator.sync_gradients
        return seen

    got, want = run(GaengineAccelerator), run(Accelerator)
    assert [g[3] for g in got] == [w[3] for w in want] == [2, 2, 1]
    # fp32: the same micro-batch sums (a backward seeded by 1/K = 1/2 is exact), scaled and clipped on each side
    # (clipped_grad_rtol: before clipping n = 0, after it each side's own coefficient from its 2-element norm), the
    # norms each side's own fp32 2-element norm; bf16: one bf16 rounding
    fp32 = dtype == torch.float32
    # bf16 after the clip: plain Accelerate multiplies its bf16 .grad by the clip coefficient cast to bf16 (two more
    # roundings on top of the .grad's own), gaengine rounds the clipped fp32 window gradient to bf16 once
    tol_before, tol_after = (clipped_grad_rtol(0), clipped_grad_rtol(2)) if fp32 else (BF16_RTOL, 4 * BF16_RTOL)
    tol_norm = 2 * norm_rtol(2) if fp32 else BF16_RTOL
    for (before, after, norm, micro), (w_before, w_after, w_norm, _) in zip(got, want):
        if micro < K:  # undo Accelerate's division of a partial window by K, then clip as torch does
            w_before = [w * (K / micro) for w in w_before]
            w_norm = float(torch.linalg.vector_norm(torch.stack([w.double() for w in w_before])))
            w_after = [w * min(1.0, 0.5 / (w_norm + 1e-6)) for w in w_before]
        for g, w in zip(before, w_before):
            assert rel_diff(g, w) <= tol_before
        for g, w in zip(after, w_after):
            assert rel_diff(g, w) <= tol_after
        assert norm == pytest.approx(w_norm, rel=tol_norm)


def test_window_grads_false_leaves_grad_none():
    """``window_grads=False``: no copy, ``.grad`` None at a synchronizing step; the update is the same."""
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=1, window_grads=False)
    model = torch.nn.Linear(3, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.gradient_state._set_sync_gradients(True)
    accelerator.backward(model(torch.ones(2, 3)).sum())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="window_grads"):
        GaengineAccelerator(cpu=True, window_grads="yes")


# ---------------------------------------------------------------- Accelerate's scheduler and test_sync.py scenarios
SCHEDULES = {
    "lambda": lambda opt, total: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=_lam),
    # total_steps = the windows the loop runs: Accelerate's num_processes steps per update (and its adjust_scheduler
    # bookkeeping off a synchronizing step) reach it early, where it must stop stepping (AcceleratedScheduler.step)
    "onecycle": lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=10 * LR, total_steps=total),
}


def _sync_scenario(accelerator_cls, *, split_batches=False, dispatch_batches=False, sync_each_batch=False,
                   schedule="lambda", step_with_optimizer=True):
    """test_sync.py's test_gradient_accumulation_with_opt_and_scheduler loop (RegressionModel, 80 samples, batch 16,
    K = 2, AdamW, a prepared scheduler), run by ``accelerator_cls``; returns per batch the learning rate after the
    loop's ``scheduler.step()``, whether the update was applied, and the parameters after it. Its ``.grad`` checks
    mid-window are left out (gaengine frees ``.grad``)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerator_cls(
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=dispatch_batches),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=K, sync_each_batch=sync_each_batch),
        step_scheduler_with_optimizer=step_with_optimizer, cpu=True)
    torch.manual_seed(42)
    model = RegressionModel()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = SCHEDULES[schedule](opt, -(-N // BATCH // K))
    loader = DataLoader(RegressionDataset(length=N, seed=42), batch_size=BATCH)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    out = []
    for batch in loader:
        with accelerator.accumulate(model):
            out_ = model(batch["x"])
            accelerator.backward(torch.nn.functional.mse_loss(out_, batch["y"]))
            opt.step()
            sched.step()
            opt.zero_grad()
            out.append({"lr": opt.param_groups[0]["lr"], "sync": accelerator.sync_gradients,
                        "params": [p.detach().clone() for p in model.parameters()]})
    return out


def _same_run(got, want, grad_rtol):
    """gaengine's run against plain Accelerate's: the same learning rate after every batch (bitwise: the same
    scheduler stepped the same number of times), the same synchronizing steps, and after every update the same
    parameters within ``update_rtol`` of that many AdamW updates (at the run's largest lr) from window gradients
    ``grad_rtol`` apart, up to the first window Accelerate divides by K with fewer than K micro-batches."""
    assert [g["sync"] for g in got] == [w["sync"] for w in want]
    assert [g["lr"] for g in got] == [w["lr"] for w in want]
    lr_max = max([LR] + [w["lr"] for w in want])
    micro, steps = 0, 0
    for g, w in zip(got, want):
        micro += 1
        if g["sync"]:
            if micro < K:
                return
            steps += 1
            for a, b in zip(g["params"], w["params"]):
                bound = update_rtol(steps, adamw_step_over_param(lr_max, b), grad_rtol)
                assert rel_diff(a, b) <= bound, f"update {steps}: {rel_diff(a, b):.3e} > {bound:.3e}"
            micro = 0


@pytest.mark.parametrize("schedule,split_batches,step_with_optimizer",
                         [("lambda", False, True), ("onecycle", False, True), ("lambda", True, True),
                          ("lambda", False, False)], ids=["lambda", "onecycle", "split-batches", "no-step-with-opt"])
def test_scheduler_steps_as_accelerate_on_one_process(schedule, split_batches, step_with_optimizer):
    """test_sync.py's scheduler loop on one process: gaengine's learning rate after every batch is plain
    Accelerate's, and its parameters after every full window equal Accelerate's within ``update_rtol`` (fp32: both
    sum the same two micro-batch gradients, in fp32, gaengine without Accelerate's division by K before the sum:
    the scalings' roundings, ``clipped_grad_rtol(0)``, and two backward passes seeded differently, ``network_rtol``
    of the 1-wide regression layer)."""
    kw = dict(schedule=schedule, split_batches=split_batches, step_with_optimizer=step_with_optimizer)
    grad_rtol = clipped_grad_rtol(0) + 2 * network_rtol(1, 1, products_per_layer=2)
    _same_run(_sync_scenario(GaengineAccelerator, **kw), _sync_scenario(Accelerator, **kw), grad_rtol)


def test_dataloader_break_sets_the_gradient_state_as_accelerate():
    """test_sync.py's test_dataloader_break: iterating a second prepared dataloader inside the first, the gradient
    state (the active dataloader, end_of_dataloader) is Accelerate's at every batch."""
    def run(accelerator_cls):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = accelerator_cls(cpu=True)
        first, second = accelerator.prepare(DataLoader(RegressionDataset(length=80), batch_size=16),
                                            DataLoader(RegressionDataset(length=96), batch_size=16))
        names, state = {id(first): "first", id(second): "second", id(None): None}, accelerator.gradient_state
        seen = [names[id(state.active_dataloader)]]
        for i, _ in enumerate(first):
            seen.append((names[id(state.active_dataloader)], state.end_of_dataloader))
            if i == 1:
                for _ in second:
                    seen.append((names[id(state.active_dataloader)], state.end_of_dataloader))
        return seen + [names[id(state.active_dataloader)]]

    assert run(GaengineAccelerator) == run(Accelerator)


# ---------------------------------------------------------------- checkpoints
def test_save_state_load_state_resume_mid_window_exactly(tmp_path):
    """bf16 parameters (their fp32 masters live in gaengine's state): save_state after the first micro-batch of the
    second window, load_state into a fresh run, go on: the parameters end bit-identical to the uninterrupted run."""
    def setup():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=K)
        torch.manual_seed(42)
        model = RegressionModel().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=_lam)
        loader = DataLoader(RegressionDataset(length=N, seed=42), batch_size=BATCH)
        return (accelerator, *accelerator.prepare(model, opt, sched, loader))

    def train(accelerator, model, opt, sched, batches, stop=None):
        for i, batch in enumerate(batches):
            with accelerator.accumulate(model):
                accelerator.backward(_mse(model, batch))
                opt.step()
                sched.step()
                opt.zero_grad()
            if stop is not None and i == stop:
                return

    accelerator, model, opt, sched, loader = setup()
    train(accelerator, model, opt, sched, loader)
    full = ([p.detach().clone() for p in model.parameters()]
            + [p.detach().clone() for p in opt.param_groups[0]["params"]])

    accelerator, model, opt, sched, loader = setup()
    train(accelerator, model, opt, sched, loader, stop=2)  # windows [0, 1] applied, batch 2 in the window
    assert accelerator.accumulator.num_micro_batches == 1
    accelerator.save_state(str(tmp_path / "ckpt"))
    step = accelerator.step

    accelerator, model, opt, sched, loader = setup()
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert accelerator.accumulator.num_micro_batches == 1 and accelerator.step == step
    train(accelerator, model, opt, sched, accelerator.skip_first_batches(loader, 3))
    resumed = ([p.detach().clone() for p in model.parameters()]
               + [p.detach().clone() for p in opt.param_groups[0]["params"]])
    assert all(torch.equal(a, b) for a, b in zip(full, resumed))


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("argument", ["deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"])
def test_refuses_engines_that_own_the_gradients(argument):
    with pytest.raises(ValueError, match=argument):
        GaengineAccelerator(cpu=True, **{argument: object()})


def test_bad_options_and_calls_are_refused_and_keep_the_window():
    with pytest.raises(TypeError, match="accumulator_options.*'buckets'"):
        GaengineAccelerator(cpu=True, accumulator_options={"buckets": 3})
    with pytest.raises(TypeError, match="lr_scheduler"):
        GaengineAccelerator(cpu=True, accumulator_options={"lr_scheduler": None})
    with pytest.raises(ValueError, match="zero_stage"):
        GaengineAccelerator(cpu=True, accumulator_options={"zero_stage": 5})
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="prepare"):
        accelerator.backward(model(torch.ones(1, 3)).sum())
    with pytest.raises(ValueError, match="optimizer: no prepared model"):
        accelerator.prepare(opt, model)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(1, 3)).sum())
    accelerator.gradient_state._set_sync_gradients(True)
    with pytest.raises(ValueError, match="norm_type"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)
    with pytest.raises(ValueError, match="max_norm"):
        accelerator.clip_grad_norm_(model.parameters(), 0.0)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: None)
    assert accelerator.accumulator.num_micro_batches == 1  # nothing lost
    assert float(accelerator.clip_grad_norm_(model.parameters(), float("inf"))) > 0


# ---------------------------------------------------------------- two gloo ranks

def _rank_main(rank, world, port, out):
    with torchrun_rank(rank, world, port):
        # Accelerate's own recipe on the same ranks: DDP, K-divided losses (the partial window's too), its scheduler
        # stepped num_processes times per update.
        plain, _, _ = _run(Accelerator(cpu=True, gradient_accumulation_steps=K), record_batches=True)
        result = {"accelerate": plain}
        for dtype in (torch.float32, torch.bfloat16):
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=K)
            assert accelerator.num_processes == world and dist.get_backend() == "gloo"
            updates, model, _ = _run(accelerator, dtype=dtype, record_batches=True)
            result[dtype] = {"updates": updates, "ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel)}
        # A save in the middle of a window on several ranks is refused (each rank's window sum differs).
        accelerator.gradient_state._set_sync_gradients(False)
        accelerator.backward(_mse(model, next(iter(accelerator._dataloaders[0]))))
        try:
            accelerator._optimizers[0].state_dict()
            result["mid_window_save"] = "saved"
        except RuntimeError as e:
            result["mid_window_save"] = str(e)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()


SYNC_SCENARIOS = ([dict(split_batches=sb, dispatch_batches=db, sync_each_batch=se)
                   for sb in (False, True) for db in (False, True) for se in (False, True)]
                  + [dict(schedule="onecycle"), dict(step_with_optimizer=False)])


def _scenarios_rank_main(rank, world, port, out):
    with torchrun_rank(rank, world, port):
        results = [(_sync_scenario(GaengineAccelerator, **kw), _sync_scenario(Accelerator, **kw))
                   for kw in SYNC_SCENARIOS]
        assert AcceleratorState().num_processes == world
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()


@pytest.mark.multiproc
def test_two_gloo_ranks_scheduler_and_sync_scenarios(tmp_path):
    """test_sync.py's test_gradient_accumulation_with_opt_and_scheduler on 2 gloo ranks, every combination of
    split_batches, dispatch_batches and sync_each_batch it runs, and the OneCycleLR and
    step_scheduler_with_optimizer=False cases of Accelerate's test_scheduler.py: on each rank gaengine's learning
    rate after every batch is plain Accelerate's (its scheduler stepped num_processes times per update, once with
    split_batches), and after every full window its parameters equal Accelerate's (DDP, averaged over the ranks)
    within ``update_rtol`` (DDP averages the ranks' gradients, gaengine all-reduces its window sums: the window's
    samples reduced in another order, ``split_batch_rtol``)."""
    world = 2
    assert spawn_ranks(_scenarios_rank_main, world, (free_port(), str(tmp_path)), join_s=180) == [0] * world
    for rank in range(world):
        for kw, (got, want) in zip(SYNC_SCENARIOS, torch.load(tmp_path / f"rank{rank}.pt"), strict=True):
            try:
                _same_run(got, want, split_batch_rtol(world * K * BATCH))
            except AssertionError as e:
                raise AssertionError(f"rank {rank}, {kw}: {e}") from e


@pytest.mark.multiproc
def test_two_gloo_ranks_match_one_fp64_process(tmp_path):
    """Two ranks under Accelerate's launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...): the model is not
    wrapped in DDP, gaengine all-reduces; each rank's parameters after every update (the end-of-dataloader partial
    window included) equal one fp64 process running each window over both ranks' micro-batches as one batch, with
    fp32 parameters (1e-6) and bf16 parameters (their fp32 masters, within BF16_RTOL). The LambdaLR steps as plain
    Accelerate's does (num_processes times per update), so every update's learning rate is the one Accelerate's own
    ``Accelerator`` uses on the same ranks, and the reference steps it so too. Accelerate's own run fails the
    parameter check (its backward divides the partial window by K)."""
    world = 2
    assert spawn_ranks(_rank_main, world, (free_port(), str(tmp_path)), join_s=120) == [0] * world
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all("save between windows on several ranks" in r["mid_window_save"] for r in results)
    for dtype in (torch.float32, torch.bfloat16):
        assert not any(r[dtype]["ddp"] for r in results)
        per_rank = [r[dtype]["updates"] for r in results]
        assert [u["micro"] for u in per_rank[0]] == [2, 1]  # 3 batches per rank (even_batches): a full, a partial
        windows = [[b for r in range(world) for b in per_rank[r][w]["batches"]] for w in range(len(per_rank[0]))]
        ref = _reference(windows, lr_steps_per_update=world)
        for rank, updates in enumerate(per_rank):
            assert [u["lr"] for u in updates] == [u["lr"] for u in results[rank]["accelerate"]]
            assert [u["lr"] for u in updates] == [r["lr"] for r in ref]  # the same LambdaLR steps: exact
            if dtype == torch.float32:
                _assert_fp64_params(updates, ref, n_samples=world * K * BATCH)
            else:
                assert _max_rel(updates, ref) <= BF16_RTOL
    plain = results[0]["accelerate"]
    windows = [[b for r in range(world) for b in results[r]["accelerate"][w]["batches"]] for w in range(len(plain))]
    assert _max_rel(plain, _reference(windows, lr_steps_per_update=world)) > 1e-2


def test_import_gaengine_imports_no_framework():
    """``import gaengine`` and ``import gaengine.integrations`` load none of the frameworks; each integration module
    loads its own only when imported."""
    import subprocess

    code = ("import sys, gaengine, gaengine.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_more_refusals_name_their_argument():
    """Each remaining error of the integration: a TypeError/ValueError naming what was wrong, raised before anything
    is accumulated or built."""
    from types import SimpleNamespace

    with pytest.raises(TypeError, match="accumulator_options must be a mapping"):
        GaengineAccelerator(cpu=True, accumulator_options=[("zero_stage", 1)])
    with pytest.raises(TypeError, match="max_grad_norm given both"):
        GaengineAccelerator(cpu=True, max_grad_norm=1.0, accumulator_options={"max_grad_norm": 2.0})
    with pytest.raises(ValueError, match="parallelism_config"):
        GaengineAccelerator(cpu=True, parallelism_config=SimpleNamespace(tp_enabled=True, cp_enabled=False))
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=2)
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        accelerator.prepare_model(ddp)

    class Lomo(torch.optim.SGD):  # stands for lomo_optim.Lomo, matched by name as Accelerate does
        pass

    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="optimizer: Lomo"):
        accelerator.prepare(model, Lomo(model.parameters(), lr=0.1))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=2, accumulator_options={"zero_stage": 1})
    model = torch.nn.Linear(3, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="an optimizer was prepared already; pass every optimizer to one prepare"):
        accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="learning_rate"):
        accelerator.backward(model(torch.ones(1, 3)).sum(), learning_rate=0.1)
    accelerator.gradient_state._set_sync_gradients(True)
    accelerator.backward(model(torch.ones(1, 3)).sum())
    with pytest.raises(TypeError, match="max_norm"):
        accelerator.clip_grad_norm_(model.parameters(), "one")
    with pytest.raises(RuntimeError, match="zero_stage=1"):
        opt.state_dict()
    assert accelerator.accumulator.num_micro_batches == 1  # nothing lost
    opt.step()
    assert opt.last_result.num_micro_batches == 1


# ---------------------------------------------------------------- editing .grad at a synchronizing step
def _edit_at_sync(model, max_norm=0.05):
    """What plain Accelerate users do between ``backward`` and ``optimizer.step()`` at a synchronizing step: a
    gradient mask in place (``a`` frozen by zeroing its gradient) and torch's own ``clip_grad_norm_``."""
    model.a.grad.mul_(0.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _run_edited(accelerator_cls, dtype, *, fused_clip=None):
    """test_sync.py's model and data, 64 samples in batches of 16, K = 2 (two full windows), SGD; at each
    synchronizing step the edit (``_edit_at_sync``), then ``accelerator.clip_grad_norm_(..., fused_clip)`` when
    given. Returns per update the parameters (fp32 masters under gaengine) and the norm the fused clip returned."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerator_cls(cpu=True, gradient_accumulation_steps=K)
    torch.manual_seed(42)
    model = RegressionModel().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(RegressionDataset(length=64, seed=42), batch_size=BATCH)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    out = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_mse(model, batch))
            norm = None
            if accelerator.sync_gradients:
                _edit_at_sync(model)
                if fused_clip is not None:
                    norm = float(accelerator.clip_grad_norm_(model.parameters(), fused_clip))
            opt.step()
            opt.zero_grad()
            if accelerator.sync_gradients:
                out.append(([p.detach().float().clone() for g in opt.param_groups for p in g["params"]], norm))
    return out


def _edited_reference():
    """The same two windows in fp64, one process: each window's mean gradient, the same mask and clip, SGD."""
    torch.manual_seed(42)
    model = RegressionModel().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(DataLoader(RegressionDataset(length=64, seed=42), batch_size=BATCH))
    out = []
    for i in range(0, len(batches), K):
        x = torch.cat([b["x"] for b in batches[i:i + K]]).double()
        y = torch.cat([b["y"] for b in batches[i:i + K]]).double()
        torch.nn.functional.mse_loss(model(x), y).backward()
        _edit_at_sync(model)
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_grad_edits_at_a_synchronizing_step_change_the_update_as_in_plain_accelerate():
    """A mask in place on ``.grad`` and ``torch.nn.utils.clip_grad_norm_`` called directly at a synchronizing step
    change gaengine's update exactly as plain Accelerate's (the same loop run by both in this test, fp32): the masked
    parameter never moves on either side, and both are within ``update_rtol`` (SGD, clipped at 0.05) of the fp64
    recipe doing the same edit, hence within twice that of each other. Before the change both edits were ignored
    (``.grad`` was a copy): the masked parameter moved and the clip did not act."""
    got, plain, ref = _run_edited(GaengineAccelerator, torch.float32), _run_edited(Accelerator, torch.float32), \
        _edited_reference()
    grad_rtol = _fp64_grad_rtol(K * BATCH, clipped=True)
    for t, ((g, _), (p, _), r) in enumerate(zip(got, plain, ref, strict=True)):
        for i, (a, b, c) in enumerate(zip(g, p, r)):
            bound = update_rtol(t + 1, sgd_step_over_param(0.1, 0.0, 0.05, c.float()), grad_rtol, grad_gain=1.0,
                                step_roundings=3, sides=1)
            assert rel_diff(a, c.float()) <= bound, f"gaengine, update {t}, param {i}"
            assert rel_diff(b, c.float()) <= bound, f"plain Accelerate, update {t}, param {i}"
            assert rel_diff(a, b) <= 2 * bound, f"update {t}, param {i}"
    torch.manual_seed(42)
    a0 = RegressionModel().a.detach()
    assert all(torch.equal(g[0], a0) for g, _ in got)  # masked: never moved, as plain Accelerate's
    assert all(torch.equal(p[0], a0) for p, _ in plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_clip_after_edits_clips_the_edited_gradient(dtype):
    """``accelerator.clip_grad_norm_`` after the edits stays the fused path (it applies the window) and returns the
    norm of the edited gradient, as plain Accelerate's does: at most the 0.05 torch's clip left, within the dtype's
    rounding of the ``.grad`` the edit was made on (bf16 parameters: a bf16 ``.grad``, as in plain Accelerate), and
    the masked parameter's fp32 master never moves."""
    got = _run_edited(GaengineAccelerator, dtype, fused_clip=1.0)
    plain = _run_edited(Accelerator, torch.float32, fused_clip=1.0)
    torch.manual_seed(42)
    a0 = RegressionModel().to(dtype).a.detach().float()
    for (params, norm), (_, plain_norm) in zip(got, plain, strict=True):
        assert norm == pytest.approx(plain_norm, rel=RTOL[dtype] + 2 * norm_rtol(2))
        assert torch.equal(params[0], a0)


# ---------------------------------------------------------------- the prepared optimizer's state dict
def test_optimizer_state_dict_is_an_ordinary_state_dict():
    """The prepared optimizer's ``state_dict()``: plain Accelerate's keys plus ``"gaengine"``, every value an
    ordinary tensor or Python value, so ``==`` comparisons work (Accelerate's test_state_checkpointing does
    ``opt_state == opt_state2``); its ``state`` after K = 1 Adam steps is plain Accelerate's within the rounding of
    one Adam step; after save_state / load_state into a fresh run the two state dicts compare equal, and a state
    saved mid-window resumes (``test_save_state_load_state_resume_mid_window_exactly``). Before the change the
    ``"gaengine"`` entry held placeholders whose ``==`` raised ``NotImplementedError``."""
    def setup(accelerator_cls, tmp=None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = accelerator_cls(cpu=True)
        torch.manual_seed(42)
        model = RegressionModel()
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        loader = DataLoader(RegressionDataset(length=32, seed=42), batch_size=BATCH)
        return (accelerator, *accelerator.prepare(model, opt, loader))

    def train(accelerator, model, opt, loader):
        for batch in loader:
            accelerator.backward(_mse(model, batch))
            opt.step()
            opt.zero_grad()

    def plain_values(value):
        if isinstance(value, dict):
            return all(plain_values(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return all(plain_values(v) for v in value)
        return type(value) in (torch.Tensor, torch.nn.Parameter, int, float, str, bytes, bool, type(None))

    accelerator, model, opt, loader = setup(GaengineAccelerator)
    train(accelerator, model, opt, loader)
    state = opt.state_dict()
    p_acc, p_model, p_opt, p_loader = setup(Accelerator)
    train(p_acc, p_model, p_opt, p_loader)
    plain = p_opt.state_dict()
    assert set(state) == set(plain) | {"gaengine"}
    assert plain_values(state)
    assert state == opt.state_dict()
    assert state["param_groups"] == plain["param_groups"]
    for i, moments in plain["state"].items():
        assert set(state["state"][i]) == set(moments)
        for key, value in moments.items():
            assert rel_diff(state["state"][i][key], value) <= 8 * RTOL[torch.float32] * 2, (i, key)

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        accelerator.save_state(tmp)
        state = opt.state_dict()
        accelerator, model, opt, loader = setup(GaengineAccelerator)
        accelerator.load_state(tmp)
        assert opt.state_dict() == state


def test_prepare_without_an_optimizer_serves_evaluation_and_saving(tmp_path):
    """``prepare(model)`` alone: evaluation, ``unwrap_model``, ``get_state_dict`` and ``save_model`` work as in
    plain Accelerate (the same outputs and tensors); a later ``accelerator.backward`` raises ``RuntimeError`` naming
    the optimizer it needs and how to prepare it, and preparing the optimizer afterwards trains."""
    results = {}
    for cls in (GaengineAccelerator, Accelerator):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = cls(cpu=True)
        torch.manual_seed(42)
        model = accelerator.prepare(RegressionModel())
        with torch.no_grad():
            out = model(torch.arange(4.0))
        assert accelerator.unwrap_model(model) is model
        accelerator.save_model(model, str(tmp_path / cls.__name__))
        results[cls] = (out, {k: v.clone() for k, v in accelerator.get_state_dict(model).items()})
        if cls is GaengineAccelerator:
            with pytest.raises(RuntimeError, match=r"accelerator\.backward\(\) needs the optimizer: a model was "
                                                   r"prepared without one"):
                accelerator.backward(_mse(model, {"x": torch.ones(2), "y": torch.ones(2)}))
            opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
            accelerator.gradient_state._set_sync_gradients(True)
            before = [p.detach().clone() for p in model.parameters()]
            accelerator.backward(_mse(model, {"x": torch.ones(2), "y": torch.full((2,), 3.0)}))  # a = b = 0
            opt.step()
            assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    (g_out, g_sd), (p_out, p_sd) = results[GaengineAccelerator], results[Accelerator]
    assert torch.equal(g_out, p_out) and g_sd.keys() == p_sd.keys()
    assert all(torch.equal(g_sd[k], p_sd[k]) for k in p_sd)
    assert sorted(os.listdir(tmp_path / "GaengineAccelerator")) == sorted(os.listdir(tmp_path / "Accelerator"))


def test_overflow_flag_set_by_a_caller_holds_the_scheduler_as_in_accelerate():
    """Accelerate's test_scheduler.py marks a skipped step by setting the prepared optimizer's ``_is_overflow`` (what
    plain Accelerate's ``step_was_skipped`` returns): the scheduler then holds, under gaengine as in plain
    Accelerate (the learning rates after each ``scheduler.step()`` compared between the two). Before the change
    gaengine ignored the flag and the scheduler stepped."""
    def run(cls):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = cls(cpu=True)
        model = torch.nn.Linear(2, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda n: 1 - n / 10)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        lrs = []
        for overflow in (False, True, False):
            opt._is_overflow = overflow
            sched.step()
            lrs.append(sched.get_last_lr()[0])
        return lrs

    assert run(GaengineAccelerator) == run(Accelerator) == [0.9, 0.9, 0.8]


# ---------------------------------------------------------------- several optimizers (issue 44)
def _two_optimizer_run(accelerator, length=64):
    """Accelerate's loop with two optimizers, as plain Accelerate takes them (``prepare(model, opt_a, opt_b, ...)``,
    each stepped and zeroed): SGD with momentum for ``a``, AdamW with a LambdaLR for ``b``; returns the parameters
    after each synchronizing step."""
    torch.manual_seed(42)
    model = RegressionModel()
    sgd = torch.optim.SGD([model.a], lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW([model.b], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lr_lambda=_lam)
    loader = DataLoader(RegressionDataset(length=length, seed=42), batch_size=BATCH)
    model, sgd, adamw, sched, loader = accelerator.prepare(model, sgd, adamw, sched, loader)
    out = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_mse(model, batch))
            sgd.step()
            adamw.step()
            sched.step()
            sgd.zero_grad()
            adamw.zero_grad()
            if accelerator.sync_gradients:
                out.append([model.a.detach().clone(), model.b.detach().clone()])
    return out


def test_two_optimizers_train_as_plain_accelerate():
    """``prepare(model, sgd, adamw, scheduler, loader)`` on GaengineAccelerator trains as plain Accelerate with the
    same two optimizers, bit for bit: K = 2 (a power of two: Accelerate's ``loss / K`` scales each backward exactly,
    and gaengine's 1/K of the sum is the same value), full windows only (64 samples, batch 16)."""
    want = _two_optimizer_run(Accelerator(cpu=True, gradient_accumulation_steps=K))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=K)
    got = _two_optimizer_run(accelerator)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a, b), (a, b)
    assert [type(o).__name__ for o in accelerator.accumulator.optimizer.optimizers] == ["SGD", "AdamW"]


def test_two_optimizers_over_one_parameter_are_refused_naming_it():
    accelerator = GaengineAccelerator(cpu=True, gradient_accumulation_steps=K)
    model = RegressionModel()
    with pytest.raises(ValueError, match=r"parameter 'a' is in optimizer\[0\] and optimizer\[1\]"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW([model.a]))
