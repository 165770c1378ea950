"""gaengine inside Lightning's ``Trainer`` (``gaengine.integrations.lightning``): Lightning's own accumulation
scenarios, run through Lightning itself on CPU, offline, on a tiny regression model, each against the plain
single-process large-batch recipe computed here (one backward over the window's samples, torch's clip, torch's
optimizer and scheduler: no gaengine).

Tolerances: fp32 parameters within 1e-5 relative of the recipe's (the recipe reduces the window in one backward,
gaengine sums micro-batch gradients: fp32 rounding order only). bf16 parameters (``precision="bf16-true"``): the
recipe computes each micro-batch's gradient from the same bf16 parameters by plain ``loss.backward()``, sums them in
fp64 and keeps fp32 master weights; gaengine's fp32 masters are within 1e-5 relative of those (one fp32 rounding of
the final gradient per update), and the bf16 parameters are the masters rounded once (at most one bf16 ulp from the
recipe's rounding of its own masters)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402

import gaengine  # noqa: E402
from gaengine.integrations.lightning import GaenginePrecision, GaengineStrategy  # noqa: E402
from gaengine.optimizer_list import OptimizerList  # noqa: E402
from tests.lightning_recipe import (BATCH, GAMMA, LR, MOMENTUM, RTOL, _assert_model_close,  # noqa: E402
                                    _assert_params_close, _data, _lr_lambda, _net, _restore_environ,
                                    _rows_one_process, _rows_two_ranks, _windows, reference)
from tests.ranks import free_port, spawn_ranks  # noqa: E402
from tests.tolerances import RTOL as DTYPE_RTOL, rel_diff  # noqa: E402

__all__ = ["_restore_environ"]  # the autouse fixture, imported: Lightning sets launch variables in this process

warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|litlogger|GPU available).*")


class Regression(pl.LightningModule):
    """Lightning's scenario model: mean-squared error, SGD with momentum, a step-interval LambdaLR. Records the
    parameters after every batch and the number of backward calls."""

    def __init__(self, dtype: torch.dtype = torch.float32, returns_none_at: int | None = None,
                 poison_at: int | None = None):
        super().__init__()
        self.net = _net()
        self.dtype_ = dtype
        self.returns_none_at = returns_none_at
        self.poison_at = poison_at  # this batch's loss is multiplied by inf: a non-finite window
        self.after_batch: list[list[torch.Tensor]] = []
        self.backward_calls = 0
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        if batch_idx == self.returns_none_at:
            return None
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x.to(self.dtype_)), y.to(self.dtype_))
        return loss * float("inf") if batch_idx == self.poison_at else loss

    def on_before_backward(self, loss):
        self.backward_calls += 1

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after_batch.append([p.detach().float().clone() for p in self.net.parameters()])
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(x, y, batch_size=BATCH):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _trainer(strategy="gaengine", **kw) -> pl.Trainer:
    if strategy == "gaengine":
        strategy = GaengineStrategy()
    kw.setdefault("max_epochs", 1)
    return pl.Trainer(accelerator="cpu", devices=kw.pop("devices", 1), strategy=strategy, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=kw.pop("enable_checkpointing", False), num_sanity_val_steps=0, **kw)


PRECISIONS = {"32-true": torch.float32, "bf16-true": torch.bfloat16}


# ---------------------------------------------------------------- Lightning's scenarios, one process


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,fraction", [(3, 1.0), (3, 0.8), (4, 1.0), (4, 0.7)],
                         ids=["K3-all", "K3-0.8", "K4-all", "K4-0.7"])
def test_gradient_accumulation_scheduling_last_batch(k, fraction, precision):
    """Lightning's ``test_gradient_accumulation_scheduling_last_batch``: 10 batches (or ``limit_train_batches`` of
    them), K = 3 or 4, so the epoch ends in a partial window. Weights change only on a window's last batch and on the
    epoch's last, every change the large-batch recipe's; ``global_step`` and the step-interval LambdaLR count the
    partial window's update too. bf16 parameters (``precision="bf16-true"``): gaengine's fp32 masters within RTOL of
    the recipe's, the bf16 parameters those masters rounded once (``_assert_model_close``)."""
    x, y = _data(20)
    dtype = PRECISIONS[precision]
    model = Regression(dtype)
    trainer = _trainer(accumulate_grad_batches=k, limit_train_batches=fraction, precision=precision)
    trainer.fit(model, _loader(x, y))
    n_batches = int(10 * fraction)
    windows = _windows(n_batches, [k])
    assert len(model.after_batch) == n_batches
    ref, ref_lrs = reference(x, y, windows, dtype=dtype)
    assert trainer.global_step == len(windows) == math.ceil(n_batches / k)
    masters = trainer.optimizers[0].param_groups[0]["params"]
    assert all(m.dtype == torch.float32 for m in masters)
    _assert_params_close(masters, ref[-1], f"fp32 masters after {len(windows)} updates")
    for p, m in zip(model.net.parameters(), masters):
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))
    initial = [p.detach().to(dtype).float() for p in _net().parameters()]
    before, update = initial, 0
    for b, after in enumerate(model.after_batch):
        closes = b == windows[update][-1]
        changed = any(not torch.equal(a, p) for a, p in zip(after, before))
        assert changed == closes, f"batch {b}: weights {'changed' if changed else 'unchanged'}"
        if closes:
            _assert_model_close(after, ref[update], f"update {update}, batches {windows[update]}", dtype)
            assert model.lrs[b] == pytest.approx(ref_lrs[update + 1] if update + 1 < len(ref_lrs)
                                                 else LR * GAMMA ** (update + 1))
            update += 1
        before = after


@pytest.mark.parametrize("k,fraction", [(3, 1.0), (4, 0.7)], ids=["K3-all", "K4-0.7"])
@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_lightning_own_accumulation_fails_the_check(k, fraction, precision):
    """The naive path, Lightning's own accumulation (no gaengine): it divides the partial last window by K
    (Lightning-AI/pytorch-lightning#19987), so its last update is off the recipe's by far more than the tolerance,
    while its full windows agree in fp32 (the check can tell them apart). bf16 parameters: its last update fails
    the one-bf16-rounding check of the bf16 rows above (its full windows are not compared: without master weights
    its bf16 updates round the parameters, not only the masters)."""
    dtype = PRECISIONS[precision]
    x, y = _data(20)
    model = Regression(dtype)
    trainer = _trainer(strategy="auto", accumulate_grad_batches=k, limit_train_batches=fraction, precision=precision)
    trainer.fit(model, _loader(x, y))
    windows = _windows(int(10 * fraction), [k])
    ref, _ = reference(x, y, windows, dtype=dtype)
    ends = [w[-1] for w in windows]
    if dtype != torch.float32:
        with pytest.raises(AssertionError, match="bf16 ulp"):
            _assert_model_close(model.after_batch[ends[-1]], ref[-1], "Lightning's partial window", dtype)
        return
    _assert_params_close(model.after_batch[ends[-2]], ref[-2], "Lightning's full windows")
    worst = max(rel_diff(a, e) for a, e in zip(model.after_batch[ends[-1]], ref[-1]))
    assert worst > 100 * RTOL, f"Lightning's partial window agrees with the recipe ({worst:.2e}): the check cannot fail"


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_backward_calls(precision):
    """Lightning's ``test_backward_calls``: 6 batches at K = 2 run 6 backward calls and 3 updates; ``max_steps=6``
    (two epochs of 6 batches) runs 12 backward calls and stops at global_step 6, where the recipe ends."""
    x, y = _data(12)
    dtype = PRECISIONS[precision]
    model = Regression(dtype)
    trainer = _trainer(accumulate_grad_batches=2, precision=precision)
    trainer.fit(model, _loader(x, y))
    assert (model.backward_calls, trainer.global_step) == (6, 3)
    model = Regression(dtype)
    trainer = _trainer(accumulate_grad_batches=2, max_epochs=-1, max_steps=6, precision=precision)
    trainer.fit(model, _loader(x, y))
    assert (model.backward_calls, trainer.global_step) == (12, 6)
    ref, _ = reference(x, y, _windows(6, [2, 2]), dtype=dtype)
    _assert_model_close(model.after_batch[-1], ref[-1], "after 6 updates over 2 epochs", dtype)


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_gradient_accumulation_scheduler_and_milestones(precision):
    """Lightning's ``GradientAccumulationScheduler({1: 2, 3: 4})`` over 4 epochs of 10 batches gives 23 updates (10,
    5, 5, 3: the last epoch ends in a partial window of 2), each the recipe's; gaengine's own
    ``Milestones({1: 2, 3: 4}, unit="epoch")`` in a plain loop gives the same windows and the same parameters."""
    x, y = _data(20)
    dtype = PRECISIONS[precision]
    ks = [1, 2, 2, 4]
    windows = _windows(10, ks)
    assert len(windows) == 23
    ref, _ = reference(x, y, windows, dtype=dtype)

    model = Regression(dtype)
    trainer = _trainer(max_epochs=4, callbacks=[GradientAccumulationScheduler({1: 2, 3: 4})], precision=precision)
    trainer.fit(model, _loader(x, y))
    assert trainer.global_step == 23
    _assert_model_close(model.after_batch[-1], ref[-1], "Lightning + GradientAccumulationScheduler, 23 updates",
                        dtype)
    if dtype != torch.float32:
        return  # the plain gaengine loop below checks the schedule's windows, dtype aside

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    acc = gaengine.GradientAccumulator(net, opt, accumulation_steps=gaengine.schedules.Milestones(
        {1: 2, 3: 4}, unit="epoch", samples_per_epoch=10), max_grad_norm=None, lr_scheduler=sched)
    sizes = []
    for _ in range(4):
        for xb, yb in _loader(x, y):
            acc.backward(nn.functional.mse_loss(net(xb), yb))
            result = acc.step()
            sizes += [] if result is None else [result.num_micro_batches]
        result = acc.step(force=True)
        sizes += [] if result is None else [result.num_micro_batches]
    acc.close()
    assert sizes == [len(w) for w in windows]
    _assert_params_close(list(net.parameters()), ref[-1], "gaengine + Milestones, 23 updates")


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_gradient_clip_val(precision):
    """``Trainer(gradient_clip_val=0.05)``: every window's normalized gradient clipped to L2 norm 0.05 (the recipe
    clips with torch's ``clip_grad_norm_``), the partial window's too; without it the parameters differ (the clip is
    active)."""
    x, y = _data(20)
    dtype = PRECISIONS[precision]
    model = Regression(dtype)
    trainer = _trainer(accumulate_grad_batches=3, gradient_clip_val=0.05, precision=precision)
    trainer.fit(model, _loader(x, y))
    windows = _windows(10, [3])
    ref, _ = reference(x, y, windows, clip=0.05, dtype=dtype)
    unclipped, _ = reference(x, y, windows, dtype=dtype)
    assert rel_diff(ref[-1][0], unclipped[-1][0]) > 1e-2
    _assert_model_close(model.after_batch[-1], ref[-1], "clipped, 4 updates", dtype)
    result = trainer.strategy.precision_plugin.last_result
    assert result.num_micro_batches == 1 and float(result.clip_coef) < 1.0


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_checkpoint_resume(tmp_path, precision):
    """``ModelCheckpoint`` saves gaengine's state (under ``GaenginePrecision``) with the model and the optimizer;
    ``fit(ckpt_path=...)`` from the end of epoch 1 ends bit for bit where the uninterrupted 2-epoch run does
    (bf16: the fp32 masters, which the bf16 model cannot carry, come back from gaengine's state), and that run is
    the recipe's."""
    x, y = _data(20)
    dtype = torch.float32 if precision == "32-true" else torch.bfloat16
    whole = Regression(dtype)
    trainer = _trainer(accumulate_grad_batches=3, max_epochs=2, precision=precision)
    trainer.fit(whole, _loader(x, y))
    ref, _ = reference(x, y, _windows(10, [3, 3]), dtype=dtype)
    _assert_params_close(trainer.optimizers[0].param_groups[0]["params"], ref[-1], "uninterrupted, 8 updates")

    first = Regression(dtype)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="epoch{epoch}", save_top_k=-1)
    trainer = _trainer(accumulate_grad_batches=3, max_epochs=1, precision=precision, callbacks=[ckpt],
                       enable_checkpointing=True)
    trainer.fit(first, _loader(x, y))
    path = ckpt.best_model_path or os.path.join(tmp_path, os.listdir(tmp_path)[0])
    saved = torch.load(path, weights_only=False)
    assert "accumulator" in saved["GaenginePrecision"]

    resumed = Regression(dtype)
    trainer = _trainer(accumulate_grad_batches=3, max_epochs=2, precision=precision)
    trainer.fit(resumed, _loader(x, y), ckpt_path=path)
    assert trainer.global_step == 8
    masters = trainer.optimizers[0].param_groups[0]["params"]
    for a, b in zip(list(resumed.parameters()) + masters,
                    list(whole.parameters()) + [m for m in _masters_of(whole)]):
        assert torch.equal(a, b)


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader that Lightning resumes in the middle of an epoch: it has ``state_dict`` / ``load_state_dict``
    (Lightning's ``_Stateful``), saved in the checkpoint with the loops, so the resumed epoch goes on with the batch
    after the last one run (a plain DataLoader restarts the epoch from its first batch: Lightning's own rule, with
    or without gaengine)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._yielded, self._skip = 0, 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._yielded += 1
                yield batch

    def state_dict(self):
        return {"yielded": self._yielded}

    def load_state_dict(self, state):
        self._skip = state["yielded"]


class _SaveMidWindow(pl.Callback):
    """``trainer.save_checkpoint`` after batch ``batch`` of the first epoch (inside a window); records how many
    micro-batches the window held then."""

    def __init__(self, batch: int, path: str):
        self.batch, self.path, self.held = batch, path, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.batch:
            trainer.save_checkpoint(self.path)
            acc = getattr(trainer.strategy, "accumulator", None)
            self.held = None if acc is None else acc.num_micro_batches


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_mid_epoch_and_mid_window_checkpoint_resume(tmp_path, precision):
    """K = 3, 2 epochs of 10 batches. ``ModelCheckpoint(every_n_train_steps=1)`` saves in the middle of the first
    epoch (after update 1, batch 2), and ``trainer.save_checkpoint`` after batch 4 saves in the middle of a window
    (its 2 micro-batches in gaengine's state). ``fit(ckpt_path=...)`` from either ends bit for bit where the
    uninterrupted run does (parameters and fp32 masters), and that run is the large-batch recipe's. Lightning's own
    accumulation resumed from its mid-window checkpoint does not end where its own uninterrupted run does (the
    window's ``.grad`` is not in the checkpoint): the check can fail."""
    dtype = PRECISIONS[precision]
    x, y = _data(20)

    def loader():
        return ResumableLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)

    whole = Regression(dtype)
    trainer = _trainer(accumulate_grad_batches=3, max_epochs=2, precision=precision)
    trainer.fit(whole, loader())
    ref, _ = reference(x, y, _windows(10, [3, 3]), dtype=dtype)
    _assert_params_close(_masters_of(whole), ref[-1], "uninterrupted, 8 updates")
    final = [p.detach().clone() for p in list(whole.parameters()) + _masters_of(whole)]

    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    mid = _SaveMidWindow(4, str(tmp_path / "mid-window.ckpt"))
    trainer = _trainer(accumulate_grad_batches=3, max_epochs=1, precision=precision, callbacks=[ckpt, mid],
                       enable_checkpointing=True)
    trainer.fit(Regression(dtype), loader())
    assert mid.held == 2
    for name, batches_left in (("step=1.ckpt", 17), ("mid-window.ckpt", 15)):
        resumed = Regression(dtype)
        trainer = _trainer(accumulate_grad_batches=3, max_epochs=2, precision=precision)
        trainer.fit(resumed, loader(), ckpt_path=str(tmp_path / name))
        assert trainer.global_step == 8 and len(resumed.after_batch) == batches_left, name
        got = list(resumed.parameters()) + _masters_of(resumed)
        assert all(torch.equal(a, b) for a, b in zip(got, final)), f"resumed from {name}"

    if dtype != torch.float32:
        return
    plain = Regression()
    _trainer(strategy="auto", accumulate_grad_batches=3, max_epochs=2).fit(plain, loader())
    mid = _SaveMidWindow(4, str(tmp_path / "plain-mid.ckpt"))
    _trainer(strategy="auto", accumulate_grad_batches=3, max_epochs=1, callbacks=[mid]).fit(Regression(), loader())
    resumed = Regression()
    _trainer(strategy="auto", accumulate_grad_batches=3, max_epochs=2).fit(resumed, loader(),
                                                                          ckpt_path=str(tmp_path / "plain-mid.ckpt"))
    worst = max(rel_diff(a, b) for a, b in zip(resumed.parameters(), plain.parameters()))
    assert worst > 100 * RTOL, f"Lightning's own resume from a mid-window checkpoint ends where it should ({worst:.2e})"


def _masters_of(module: Regression) -> list[torch.Tensor]:
    return module.trainer.optimizers[0].param_groups[0]["params"]


# ---------------------------------------------------------------- mixed precision, skipped windows


def reference_amp(x, y, windows: list[list[int]], autocast_dtype: torch.dtype):
    """torch's own AMP recipe, no gaengine, no Lightning: fp32 parameters, each micro-batch's forward under
    ``torch.autocast("cpu", autocast_dtype)`` and the backward of its mean loss, the micro-batch gradients summed in
    fp64 and divided by their count (the window's mean; dividing each loss by the count before its backward would
    round the low-precision backward differently, by up to one rounding of the gradient: not the bound checked here);
    fp16: ``torch.amp.GradScaler`` (init scale 2^16) scales each loss, unscales, skips a non-finite window's step and
    its scheduler step (the scale went down). Returns the parameters after every update (None when skipped)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    scaler = torch.amp.GradScaler("cpu", enabled=autocast_dtype == torch.float16)
    after = []
    for batches in windows:
        grads = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
        for b in batches:
            r = _rows_one_process(b)[0]
            model.zero_grad()
            with torch.autocast("cpu", dtype=autocast_dtype):
                loss = nn.functional.mse_loss(model(x[r]), y[r])
            scaler.scale(loss).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad.double()
        for g, p in zip(grads, model.parameters()):
            p.grad = (g / len(batches)).float()
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(opt)
        scaler.update()
        skipped = scaler.is_enabled() and scaler.get_scale() < scale
        if not skipped:
            sched.step()
        after.append(None if skipped else [p.detach().clone() for p in model.parameters()])
    return after


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_through_gaengine_precision(precision):
    """``bf16-mixed`` and ``16-mixed`` on CPU (Lightning's ``MixedPrecision``: autocast in the forward, fp32
    parameters) through ``GaenginePrecision``: Lightning's ``GradScaler`` dropped, 16-mixed scaled by gaengine's
    dynamic loss scale. K = 3 over 10 batches (a partial last window): after every update the parameters are torch's
    own AMP recipe's within RTOL (the same autocast forward per micro-batch; fp32 summation order only), and the
    updates fp16 skipped are the recipe's. Lightning's own accumulation under the same plugin fails the check on the
    partial window (divided by K)."""
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    x, y = _data(20)
    windows = _windows(10, [3])
    ref = reference_amp(x, y, windows, dtype)
    ends = [w[-1] for w in windows]

    model = Regression()
    trainer = _trainer(accumulate_grad_batches=3, plugins=[MixedPrecision(precision, "cpu")])
    trainer.fit(model, _loader(x, y))
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, GaenginePrecision) and isinstance(plugin.inner, MixedPrecision)
    assert plugin.precision == precision and plugin.inner.scaler is None  # no Lightning GradScaler
    assert (trainer.strategy.accumulator.scaler is not None) == (dtype == torch.float16)  # gaengine's loss scale
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert trainer.global_step == len(windows)
    assert plugin.num_skipped == sum(r is None for r in ref)
    for update, (b, want) in enumerate(zip(ends, ref)):
        if want is not None:
            _assert_params_close(model.after_batch[b], want, f"{precision}, update {update}")

    naive = Regression()
    _trainer(strategy="auto", accumulate_grad_batches=3, plugins=[MixedPrecision(precision, "cpu")]).fit(
        naive, _loader(x, y))
    worst = max(rel_diff(a, e) for a, e in zip(naive.after_batch[ends[-1]], ref[-1]))
    assert worst > 100 * RTOL, f"Lightning's own {precision} accumulation agrees with the recipe ({worst:.2e})"


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_non_finite_window_is_skipped_and_holds_the_scheduler(precision):
    """A non-finite loss in batch 4 (window 1 of batches 3-5; K = 3, 10 batches): gaengine skips that update on the
    device (parameters unchanged through batch 5), ``num_skipped`` reports it, ``global_step`` counts it (4, as the
    Hugging Face Trainer's ``global_step`` and Accelerate's ``step`` count a skipped update), and the step-interval
    LambdaLR does not step on it (as in Accelerate and the HF integration): the remaining updates are the recipe's
    run without that window, learning rates included. Lightning's own accumulation turns the parameters NaN."""
    dtype = PRECISIONS[precision]
    x, y = _data(20)
    windows = _windows(10, [3])
    model = Regression(dtype, poison_at=4)
    trainer = _trainer(accumulate_grad_batches=3, precision=precision)
    trainer.fit(model, _loader(x, y))
    plugin = trainer.strategy.precision_plugin
    assert trainer.global_step == 4 and plugin.num_skipped == 1 and not plugin.update_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(model.after_batch[5], model.after_batch[2]))
    assert model.lrs[5] == model.lrs[2] == pytest.approx(LR * GAMMA)  # held: the skipped update did not step it
    kept = [w for i, w in enumerate(windows) if i != 1]
    ref, ref_lrs = reference(x, y, kept, dtype=dtype)
    for update, (w, want) in enumerate(zip(kept, ref)):
        _assert_model_close(model.after_batch[w[-1]], want, f"update {update} of the recipe without window 1", dtype)
    assert [model.lrs[w[-1]] for w in kept] == pytest.approx([LR * GAMMA ** (i + 1) for i in range(len(kept))])
    assert ref_lrs == pytest.approx([LR * GAMMA ** i for i in range(len(kept))])

    naive = Regression(poison_at=4)
    _trainer(strategy="auto", accumulate_grad_batches=3).fit(naive, _loader(x, y))
    assert not all(bool(p.isfinite().all()) for p in naive.after_batch[-1])


# ---------------------------------------------------------------- the hook contract of plain Lightning


class CountingSGD(torch.optim.SGD):
    """SGD counting ``zero_grad`` calls (Lightning's ``test_trainer_accumulate_grad_batches_zero_grad`` patches
    ``SGD.zero_grad`` to count them)."""

    zero_grads = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        CountingSGD.zero_grads += 1
        super().zero_grad(set_to_none)


class Hooked(Regression):
    """Records every optimization hook as ``(hook, epoch, batch_idx)``, whether ``optimizer_step`` changed the
    weights and which learning rate it used; ``warmup``: a linear warm-up over 3 updates set in ``optimizer_step``
    (Lightning's documented recipe)."""

    def __init__(self, warmup: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__(dtype)
        self.warmup = warmup
        self.calls: list[tuple[str, int, int]] = []
        self.step_changed: list[bool] = []
        self.step_lrs: list[float] = []

    def _record(self, hook: str, batch_idx: int | None = None) -> None:
        loop = self.trainer.fit_loop.epoch_loop
        self.calls.append((hook, self.current_epoch, loop.batch_idx if batch_idx is None else batch_idx))

    def training_step(self, batch, batch_idx):
        self._record("training_step", batch_idx)
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss):
        super().on_before_backward(loss)
        self._record("on_before_backward")

    def on_after_backward(self):
        self._record("on_after_backward")

    def on_before_zero_grad(self, optimizer):
        self._record("on_before_zero_grad")

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self._record("optimizer_zero_grad", batch_idx)
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_optimizer_step(self, optimizer):
        self._record("on_before_optimizer_step")

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.warmup:
            for group in optimizer.param_groups:
                group["lr"] = LR * min(1.0, (self.trainer.global_step + 1) / 3)
        before = [p.detach().clone() for p in self.net.parameters()]
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self._record("optimizer_step", batch_idx)
        self.step_changed.append(any(not torch.equal(a, p) for a, p in zip(before, self.net.parameters())))
        self.step_lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = CountingSGD(self.parameters(), lr=LR, momentum=MOMENTUM)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda),
                                                   "interval": "step"}}


class HookCallback(pl.Callback):
    """The ``Callback`` hooks of the same names, recorded as ``(hook, epoch, batch_idx)``."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []

    def _record(self, trainer, hook):
        self.calls.append((hook, trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx))

    def on_before_backward(self, trainer, pl_module, loss):
        self._record(trainer, "on_before_backward")

    def on_after_backward(self, trainer, pl_module):
        self._record(trainer, "on_after_backward")

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self._record(trainer, "on_before_zero_grad")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._record(trainer, "on_before_optimizer_step")


def _hooked_run(strategy: str, **kw) -> tuple[Hooked, HookCallback, pl.Trainer, int]:
    x, y = _data(20)
    model, callback = Hooked(warmup=kw.pop("warmup", False)), HookCallback()
    CountingSGD.zero_grads = 0
    trainer = _trainer(strategy=strategy, callbacks=[callback] + kw.pop("callbacks", []), **kw)
    trainer.fit(model, _loader(x, y))
    return model, callback, trainer, CountingSGD.zero_grads


@pytest.mark.parametrize("kw,n_updates", [
    (dict(accumulate_grad_batches=2), 5),
    (dict(accumulate_grad_batches=3), 4),
    (dict(accumulate_grad_batches=4, limit_train_batches=0.7), 2),
    (dict(max_epochs=4, callbacks=[GradientAccumulationScheduler({1: 2, 3: 4})]), 23),
], ids=["K2", "K3-last-batch", "K4-0.7-last-batch", "scheduler-1:2-3:4"])
def test_hooks_run_as_in_plain_lightning(kw, n_updates):
    """Lightning's ``test_gradient_accumulation_scheduling_last_batch``, ``test_no_batch_idx_gradient_accumulation``
    and ``test_trainer_accumulate_grad_batches_zero_grad`` / ``_with_callback``, against plain Lightning in the same
    test: ``training_step``, ``on_before_backward`` and ``on_after_backward`` run once per micro-batch;
    ``optimizer_step``, ``on_before_optimizer_step``, ``on_before_zero_grad`` and ``optimizer_zero_grad`` (and
    ``SGD.zero_grad``, and the ``Callback`` hooks of those names) once per update, at the same (epoch, batch_idx),
    the epoch's last partial window included; every ``optimizer_step`` changes the weights; ``global_step`` and the
    learning rates (a warm-up set in ``optimizer_step`` and a step-interval LambdaLR) are plain Lightning's at every
    update. Without a partial window (K = 2) the parameters after every update are plain Lightning's too."""
    kw = dict(kw)
    callbacks = kw.pop("callbacks", [])
    plain, plain_cb, plain_trainer, plain_zero = _hooked_run("auto", warmup=True, callbacks=callbacks, **kw)
    ours, ours_cb, trainer, zero = _hooked_run("gaengine", warmup=True,
                                               callbacks=[GradientAccumulationScheduler({1: 2, 3: 4})]
                                               if callbacks else [], **kw)
    assert plain_trainer.global_step == n_updates
    assert ours.calls == plain.calls
    assert ours_cb.calls == plain_cb.calls
    assert sum(c[0] == "optimizer_step" for c in ours.calls) == n_updates
    assert (trainer.global_step, zero) == (plain_trainer.global_step, plain_zero) == (n_updates, n_updates)
    assert ours.step_changed == [True] * n_updates
    assert ours.step_lrs == plain.step_lrs
    if kw.get("accumulate_grad_batches") == 2:
        for update, (a, b) in enumerate(zip(ours.after_batch, plain.after_batch)):
            _assert_params_close(a, b, f"batch {update}, against plain Lightning")


class GradLogger(Regression):
    """The standard recipe: ``grad_norm(self, norm_type=2)`` in ``on_before_optimizer_step``; also keeps each
    parameter's ``.grad`` there and whether any ``.grad`` is left after the update."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__(dtype)
        self.norms: list[dict[str, torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []
        self.grad_left_after: list[bool] = []

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(grad_norm(self, norm_type=2))
        self.grads.append([p.grad.detach().float().clone() for p in self.net.parameters()])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.grad_left_after.append(any(p.grad is not None for p in self.parameters()))


def _fit_plain_and_gaengine(module_cls, precision: str, n_samples: int, clip: float) -> tuple:
    """``module_cls(dtype)`` fitted by plain Lightning and by gaengine (K = 3, ``gradient_clip_val=clip``) on the
    first ``n_samples`` of ``_data``: the two modules, plain first."""
    x, y = _data(n_samples)
    runs = []
    for strategy in ("auto", "gaengine"):
        model = module_cls(PRECISIONS[precision])
        _trainer(strategy=strategy, accumulate_grad_batches=3, gradient_clip_val=clip, precision=precision).fit(
            model, _loader(x, y))
        runs.append(model)
    return tuple(runs)


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_grad_norm_in_on_before_optimizer_step(precision):
    """``grad_norm(self)`` in ``on_before_optimizer_step`` returns plain Lightning's norms: the window's gradient,
    normalized and before clipping (``gradient_clip_val`` active), K = 3 over 10 batches. fp32: every full window's
    per-parameter gradients are plain Lightning's within RTOL, and the partial last window's are plain Lightning's
    times 3 (Lightning divides that one-batch window by K = 3; gaengine by the 1 it holds). bf16
    (``precision="bf16-true"``, ``.grad`` in the parameters' dtype): the first window's gradients within one bf16
    rounding of plain Lightning's (later ones differ as the weights do: Lightning updates bf16 weights without
    fp32 masters). gaengine releases ``.grad`` right after the update (plain Lightning keeps it until the next
    window's ``zero_grad``: a documented difference)."""
    dtype = PRECISIONS[precision]
    plain, ours = _fit_plain_and_gaengine(GradLogger, precision, 20, clip=0.05)
    assert len(ours.norms) == len(plain.norms) == 4
    assert all(set(o) == set(p) and o for o, p in zip(ours.norms, plain.norms))
    assert not any(ours.grad_left_after)
    if dtype != torch.float32:
        for i, (a, b) in enumerate(zip(ours.grads[0], plain.grads[0])):
            d = rel_diff(a, b)
            assert d <= DTYPE_RTOL[torch.bfloat16], f"bf16 window 0, parameter {i}: {d:.3e}"
        return
    for window in range(3):
        _assert_params_close(ours.grads[window], plain.grads[window], f"window {window} gradient")
        for name, value in ours.norms[window].items():
            assert abs(value - plain.norms[window][name]) <= RTOL * plain.norms[window][name], name
    _assert_params_close(ours.grads[3], [3 * g for g in plain.grads[3]], "the partial window's gradient x 3")
    assert float(ours.norms[0]["grad_2.0_norm_total"]) > 0.05  # the clip was active: the norm logged is before it


class Evaluated(Regression):
    """``validation_step``, ``test_step`` (the mean-squared error, logged) and ``predict_step`` (the outputs)."""

    def _mse(self, batch):
        return nn.functional.mse_loss(self.net(batch[0].to(self.dtype_)), batch[1].to(self.dtype_)).float()

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", self._mse(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_mse", self._mse(batch))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0].to(self.dtype_)).float()


def _evaluate(model: Evaluated, strategy, x, y) -> tuple:
    trainer = _trainer(strategy=strategy)
    loader = _loader(x, y)
    return (trainer.validate(model, loader, verbose=False), trainer.test(model, loader, verbose=False),
            torch.cat(trainer.predict(model, loader)))


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_validate_test_predict_with_and_without_fit(precision):
    """``trainer.validate()``, ``test()`` and ``predict()`` under ``GaengineStrategy`` on one process (they raised
    ``ValueError: Default process group has not been initialized``): on a fresh model, after a ``fit``, and on the
    fitting Trainer itself, each returns what plain Lightning (``strategy="auto"``) returns for the same model."""
    x, y = _data(12)
    fresh = Evaluated()
    assert _evaluate(fresh, GaengineStrategy(), x, y)[:2] == _evaluate(fresh, "auto", x, y)[:2]
    assert torch.equal(_evaluate(fresh, GaengineStrategy(), x, y)[2], _evaluate(fresh, "auto", x, y)[2])

    dtype = PRECISIONS[precision]
    model = Evaluated(dtype)
    trainer = _trainer(accumulate_grad_batches=3, precision=precision)
    trainer.fit(model, _loader(x, y))
    same_trainer = (trainer.validate(model, _loader(x, y), verbose=False),
                    trainer.test(model, _loader(x, y), verbose=False))
    ours, plain = _evaluate(model, GaengineStrategy(), x, y), _evaluate(model, "auto", x, y)
    assert ours[:2] == plain[:2] == same_trainer
    assert torch.equal(ours[2], plain[2])


def test_refit_by_another_trainer_then_plain_pytorch():
    """A model fitted by one Trainer is fitted again by another (it raised ``a parameter ... already belongs to
    another GradientAccumulator``): the accumulator is closed when ``fit`` ends. K = 2 over 10 batches (no partial
    window, where plain Lightning is exact), two fits of one epoch each: the parameters after every update are
    plain Lightning's doing the same two fits. Then the model trains with plain PyTorch: ``loss.backward()`` leaves
    ``.grad`` (gaengine's hooks are gone), equal to the plain-fitted model's, and a new ``GradientAccumulator`` can
    take its parameters."""
    x, y = _data(20)
    fitted = {}
    for strategy in ("auto", "gaengine"):
        model = Regression()
        for _ in range(2):
            _trainer(strategy=strategy, accumulate_grad_batches=2).fit(model, _loader(x, y))
        fitted[strategy] = model
    ours, plain = fitted["gaengine"], fitted["auto"]
    assert len(ours.after_batch) == len(plain.after_batch) == 20
    for b, (a, e) in enumerate(zip(ours.after_batch, plain.after_batch)):
        _assert_params_close(a, e, f"batch {b} of the two fits, against plain Lightning")
    grads = {}
    for name, model in fitted.items():
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model.net(x), y).backward()
        grads[name] = [p.grad for p in model.net.parameters()]
    assert all(g is not None for g in grads["gaengine"])
    _assert_params_close(grads["gaengine"], grads["auto"], "plain PyTorch gradient after the fits")
    ours.zero_grad(set_to_none=True)
    gaengine.GradientAccumulator(ours, torch.optim.SGD(ours.parameters(), lr=LR), accumulation_steps=2).close()


# ---------------------------------------------------------------- refusals


def test_strategy_refuses_what_the_trainer_sets():
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        GaengineStrategy(accumulation_steps=4)
    with pytest.raises(ValueError, match="gradient_clip_val"):
        GaengineStrategy(max_grad_norm=1.0)
    with pytest.raises(ValueError, match="zero_stage"):
        GaengineStrategy(zero_stage=1)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        GaengineStrategy(bucket_size_mb=-1)
    with pytest.raises(TypeError, match="no_such_option"):
        GaengineStrategy(no_such_option=1)


def test_precision_plugins_that_cannot_compose():
    """``precision="64-true"`` (and any plugin but Lightning's 32/16/bf16 ones) is refused, naming it."""
    with pytest.raises(ValueError, match="DoublePrecision.*64-true"):
        _trainer(precision="64-true")
    with pytest.raises(RuntimeError, match="GaengineStrategy"):
        GaenginePrecision()._acc()


def test_clip_by_value_refused_window_kept():
    """``gradient_clip_algorithm="value"`` raises ``ValueError`` at the first window's end; the window's gradients
    are still in the accumulator (nothing lost, nothing applied)."""
    x, y = _data(12)
    model = Regression()
    trainer = _trainer(accumulate_grad_batches=2, gradient_clip_val=0.1, gradient_clip_algorithm="value")
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        trainer.fit(model, _loader(x, y))
    assert trainer.strategy.accumulator.num_micro_batches == 2
    assert all(torch.equal(a, b) for a, b in zip(model.net.parameters(), _net().parameters()))


def test_training_step_returning_none_skips_the_micro_batch():
    """``training_step`` returning None (one process: Lightning's way to skip a micro-batch) runs no backward for it;
    gaengine normalizes the window by the micro-batches that ran (batches 0 and 2 of window 0, K = 3), so every
    update is the recipe's over the batches that ran. (Plain Lightning divides that window by K = 3 anyway.)"""
    x, y = _data(20)
    model = Regression(returns_none_at=1)
    trainer = _trainer(accumulate_grad_batches=3)
    trainer.fit(model, _loader(x, y))
    windows = [[0, 2], [3, 4, 5], [6, 7, 8], [9]]
    ref, _ = reference(x, y, windows)
    assert trainer.global_step == 4 and model.backward_calls == 9
    for update, w in enumerate(windows):
        _assert_params_close(model.after_batch[w[-1]], ref[update], f"update {update}, batches {w}")


class ManualMisuse(Regression):
    def __init__(self, call: str):
        super().__init__()
        self.automatic_optimization = False
        self.call = call

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        if self.call == "manual_backward":
            self.manual_backward(loss)
        else:
            self.optimizers().step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


@pytest.mark.parametrize("call", ["manual_backward", "step"])
def test_manual_optimization_misuse(call):
    """Manual optimization under ``GaengineStrategy``: ``self.manual_backward`` and ``optimizer.step()`` raise,
    naming the accumulator's ``backward`` / ``step`` and the recipe."""
    x, y = _data(4)
    trainer = _trainer()
    with pytest.raises(RuntimeError, match="acc.backward" if call == "manual_backward" else "acc.step"):
        trainer.fit(ManualMisuse(call), _loader(x, y))


# ---------------------------------------------------------------- two gloo processes


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    results = {}
    x, y = _data(40)
    for name, kw in (("K3", dict(accumulate_grad_batches=3)),
                     ("K4-clip-bf16", dict(accumulate_grad_batches=4, gradient_clip_val=0.05,
                                           precision="bf16-true"))):
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        model = Evaluated(dtype)
        trainer = _trainer(devices=world, strategy=GaengineStrategy(process_group_backend="gloo"),
                           use_distributed_sampler=False, **kw)
        dataset = torch.utils.data.TensorDataset(x, y)
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        trainer.fit(model, torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler))
        val = trainer.validate(model, torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler),
                               verbose=False)[0]["val_mse"]
        results[name] = dict(val_mse=val,global_step=trainer.global_step, world=trainer.world_size,
                             params=[p.detach().float().clone() for p in model.net.parameters()],
                             masters=[m.detach().clone() for m in trainer.optimizers[0].param_groups[0]["params"]],
                             wrapped=type(trainer.strategy.model).__name__)
    torch.save(results, f"{out}.{rank}")


@pytest.mark.multiproc
def test_two_gloo_processes(tmp_path):
    """2 processes launched as torchrun does (``LOCAL_RANK``, ``MASTER_PORT``), ``Trainer(devices=2)``: a
    ``DistributedSampler`` without shuffling gives each rank 10 micro-batches of 2 (rank r: samples r, r + 2, ...), K = 3 and 4 (a
    partial last window), clipped and bf16 in the second case. The model is not wrapped in DDP; every rank ends
    with the parameters of the single-process recipe over the global micro-batches of 4 samples; ``validate()``
    on the fitting Trainer then gives each rank the mean-squared error of its samples under those parameters."""
    out = str(tmp_path / "res")
    assert spawn_ranks(_rank_main, 2, (free_port(), out), join_s=240) == [0, 0]
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    x, y = _data(40)
    for name, k, clip, dtype in (("K3", 3, None, torch.float32), ("K4-clip-bf16", 4, 0.05, torch.bfloat16)):
        windows = _windows(10, [k])
        ref, _ = reference(x, y, windows, clip=clip, dtype=dtype, rows=_rows_two_ranks)
        for r, res in enumerate(ranks):
            got = res[name]
            assert (got["global_step"], got["world"], got["wrapped"]) == (len(windows), 2, "Evaluated"), (name, r)
            _assert_params_close(got["masters"], ref[-1], f"{name}, rank {r}")
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"]))
        net = _net().to(dtype)
        with torch.no_grad():
            for p, q in zip(net.parameters(), ranks[0][name]["params"]):
                p.copy_(q)
        for r, res in enumerate(ranks):  # validate() after fit, on each rank's half of the samples
            rows = torch.arange(r, 40, 2).view(-1, BATCH)  # its batches; Lightning averages their logged mse
            want = sum(float(nn.functional.mse_loss(net(x[b].to(dtype)), y[b].to(dtype)).float()) for b in rows)
            want /= len(rows)  # each batch's mse in the model's dtype, as validation_step computes it: fp32 order only
            assert abs(res[name]["val_mse"] - want) <= RTOL * want, (name, r, res[name]["val_mse"], want)


# ---------------------------------------------------------------- configure_gradient_clipping and closures


class Clamped(Regression):
    """A user's own clamp of every ``.grad`` in ``configure_gradient_clipping``, then Lightning's norm clip."""

    CLAMP = 0.02

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        for p in self.parameters():
            p.grad.clamp_(-self.CLAMP, self.CLAMP)
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=["fp32", "bf16"])
def test_clamp_in_configure_gradient_clipping(precision):
    """``.grad`` holds the window's gradient in an overridden ``configure_gradient_clipping`` (without
    ``on_before_optimizer_step`` overridden: before, it was None there and the clamp raised ``AttributeError``),
    and the user's clamp changes the update as in plain Lightning, the norm clip (active) then taken over the
    clamped gradient. K = 3 over 9 batches (full windows), plain Lightning in the same test: fp32 every update within
    RTOL; bf16 (``bf16-true``) the first update within one bf16 rounding (plain Lightning updates bf16 weights
    without fp32 masters, so later ones drift apart by that)."""
    dtype = PRECISIONS[precision]
    x, y = _data(18)
    plain, ours = (m.after_batch for m in _fit_plain_and_gaengine(Clamped, precision, 18, clip=0.03))
    unclamped = Regression(dtype)
    _trainer(accumulate_grad_batches=3, gradient_clip_val=0.03, precision=precision).fit(unclamped, _loader(x, y))
    assert max(rel_diff(a, b) for a, b in zip(unclamped.after_batch[2], plain[2])) > 1e-2  # the clamp matters
    if dtype != torch.float32:
        for i, (a, b) in enumerate(zip(ours[2], plain[2])):
            assert rel_diff(a, b) <= DTYPE_RTOL[torch.bfloat16], f"bf16 update 0, parameter {i}"
        return
    for b in (2, 5, 8):
        _assert_params_close(ours[b], plain[b], f"after batch {b}")


class LBFGSRegression(Regression):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


def test_closure_optimizer_refused_at_fit_start():
    """An optimizer whose ``step()`` requires a closure (``torch.optim.LBFGS``) is refused when ``fit`` starts (the
    strategy's set-up builds the accumulator), before any ``training_step``, with the message docs/integrations/
    lightning.md documents; the model is untouched and the next plain fit trains it."""
    x, y = _data(8)
    model = LBFGSRegression()
    with pytest.raises(TypeError, match=r"LBFGS\.step\(\) requires 'closure'.*closure optimizer"):
        _trainer(accumulate_grad_batches=2).fit(model, _loader(x, y))
    assert model.backward_calls == 0 and not model.after_batch
    assert all(torch.equal(a, b) for a, b in zip(model.net.parameters(), _net().parameters()))
    _trainer(strategy="auto", accumulate_grad_batches=2).fit(model, _loader(x, y))
    assert model.after_batch


# ---------------------------------------------------------------- several optimizers (issue 44)
class TwoOptimizers(Regression):
    """SGD with momentum for the first layer, AdamW for the rest, returned as one
    ``gaengine.optimizer_list.OptimizerList`` (automatic optimization steps one optimizer per update; the list steps
    each of its own once), with a LambdaLR over the list."""

    def configure_optimizers(self):
        first = list(self.net[0].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in first)]
        opt = OptimizerList([torch.optim.SGD(first, lr=LR, momentum=MOMENTUM), torch.optim.AdamW(rest, lr=1e-2)])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_optimizer_list_trains_as_plain_lightning():
    """An ``OptimizerList`` of two optimizers from ``configure_optimizers``: GaengineStrategy trains as plain
    Lightning with the same list, bit for bit after every batch (K = 4, a power of two: Lightning's ``loss / K``
    scales each backward exactly, and gaengine's 1/K of the sum is the same value; 12 batches, full windows)."""
    x, y = _data(12 * BATCH)
    runs = []
    for strategy in ("auto", "gaengine"):
        model = TwoOptimizers()
        _trainer(strategy=strategy, accumulate_grad_batches=4).fit(model, _loader(x, y))
        runs.append(model)
    plain, ours = runs
    assert len(ours.after_batch) == len(plain.after_batch) == 12
    for got, want in zip(ours.after_batch, plain.after_batch):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert plain.after_batch[3][0].ne(plain.after_batch[0][0]).any()  # the windows did update


class TwoReturned(Regression):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=LR), torch.optim.AdamW(self.net[2].parameters())]


def test_two_optimizers_under_automatic_optimization_are_refused_as_lightning_does():
    """Two optimizers returned under automatic optimization: refused by Lightning itself, under GaengineStrategy as
    under plain Lightning (it steps several optimizers only under manual optimization), before anything trains."""
    x, y = _data(4 * BATCH)
    with pytest.raises(Exception) as plain:
        _trainer(strategy="auto", accumulate_grad_batches=2).fit(TwoReturned(), _loader(x, y))
    with pytest.raises(type(plain.value), match=r"manual optimization") as ours:
        _trainer(accumulate_grad_batches=2).fit(TwoReturned(), _loader(x, y))
    assert str(ours.value) == str(plain.value)
