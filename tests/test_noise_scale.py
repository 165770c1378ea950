"""The gradient noise scale (``measure_noise_scale=True``) against an fp64 oracle, and the adaptive schedule.

The oracle: linear regression with Gaussian noise, ``loss_i = (w . x_i + b - y_i)^2 / 2``, whose per-sample
gradients ``r_i [x_i, 1]`` (``r_i`` the residual) the test computes exhaustively in fp64 from the parameters the
model holds before each window. From them it forms each micro-batch's gradient, the window's, the unbiased
estimates of McCandlish et al. (arXiv 1812.06162, eqs. A.2-A.3) and their bias-corrected moving averages written
as explicit weighted sums (not the recursion the engine runs).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import math
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gaengine
from gaengine.schedules import Adaptive
from tests import emulated_cuda
from tests.conftest import seeded_randn
from tests.oracle_hooks import use_hooks
from tests.ranks import spawn_ranks
from tests.tolerances import gamma, network_rtol, rel_diff, split_batch_rtol


D = 6  # features
EMA = 0.8
ORACLE_RTOL = 1e-3  # issue 17: the estimator within 1e-3 relative of the fp64 oracle


# ---------------------------------------------------------------- the problem and its oracle
def _model(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(D, 1)


def _micro_batch(window: int, rank: int, k: int, mode: str, noise: float = 1.0):
    """(x, y, n): deterministic from (window, rank, k); n = 4 in mean mode, 1..6 items in item mode."""
    n = 4 if mode == "mean" else 1 + (7 * window + 3 * rank + 5 * k) % 6
    g = torch.Generator().manual_seed(1000 * window + 100 * rank + k)
    x = seeded_randn(n, D, generator=g)
    w_star = torch.linspace(-1.0, 1.0, D)
    y = x @ w_star + 0.5 + noise * seeded_randn(n, generator=g)
    return x, y.unsqueeze(1), n


def _loss(model, x, y, mode):
    per_sample = 0.5 * (model(x) - y).pow(2)
    return per_sample.mean() if mode == "mean" else per_sample.sum()


def _per_sample_grads(params64: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(n, D + 1) fp64: the gradient of each sample's loss w.r.t. (weight, bias), from the closed form."""
    w, b = params64[:D], params64[D]
    r = x.double() @ w + b - y.double().squeeze(1)
    return torch.cat([r.unsqueeze(1) * x.double(), r.unsqueeze(1)], dim=1)


def _window_estimate(params64, batches, mode):
    """Eqs. A.2-A.3 for one window. batches: [(x, y, n)] over every rank and micro-batch. Returns (S, G2)."""
    sums = [_per_sample_grads(params64, x, y).sum(0) for x, y, _ in batches]
    sizes = [float(n) for _, _, n in batches]
    if mode == "mean":  # B counts micro-batches: each micro-batch's gradient is its mean; one "sample" each
        small = [s / n for s, n in zip(sums, sizes)]
        big = torch.stack(small).mean(0)
        sizes = [1.0] * len(batches)
    else:
        small = [s / n for s, n in zip(sums, sizes)]
        big = torch.stack(sums).sum(0) / sum(sizes)
    total = sum(sizes)
    mean_small = sum(float(g @ g) for g in small) / len(small)
    mean_inv = sum(1.0 / n for n in sizes) / len(sizes)
    big_sq = float(big @ big)
    trace = (mean_small - big_sq) / (mean_inv - 1.0 / total)
    return trace, big_sq - trace / total


def _averaged(values: list[float], ema: float) -> float:
    """Bias-corrected EMA as an explicit sum: sum_t (1 - a) a^(T-1-t) v_t / (1 - a^T)."""
    t = len(values)
    return sum((1 - ema) * ema ** (t - 1 - i) * v for i, v in enumerate(values)) / (1 - ema**t)


def _oracle(params_before, windows, mode, ema=EMA):
    """Per window, the (B_simple, tr Sigma, |G|^2) the accumulator must report. windows: per window, the list of
    (x, y, n) of all ranks and micro-batches, or None for a skipped window."""
    traces, grads, out = [], [], []
    for params64, batches in zip(params_before, windows):
        if batches is not None:
            s, g2 = _window_estimate(params64, batches, mode)
            traces.append(s)
            grads.append(g2)
        s_avg, g_avg = _averaged(traces, ema), _averaged(grads, ema)
        out.append((s_avg / g_avg, s_avg, g_avg))
    return out


def _flat64(model) -> torch.Tensor:
    return torch.cat([model.weight.detach().reshape(-1), model.bias.detach().reshape(-1)]).double()


# ---------------------------------------------------------------- one run (one process or one rank)
PLAN = [3, 3, 2, 3, 3, 3]  # micro-batches per window (K = 3; the third window is partial: step(force=True))
POISONED = 3  # this window's second micro-batch has a NaN loss: the update is skipped, the averages stay


def _run(mode, rank=0, backend="torch", resume_at=None, loss_scale=None, plan=PLAN, poisoned=POISONED, zero_stage=0,
         fusion=False):
    """Train ``plan`` windows with SGD; returns the parameters before each window, each window's estimates and
    the batches this rank used. resume_at: (window, micro-batch): save the state there, then go on in a new model,
    optimizer and accumulator loaded from it. fusion: gradient_accumulation_fusion."""
    def build(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=3, max_grad_norm=None, backend=backend,
                                           measure_noise_scale=True, noise_scale_ema=EMA, loss_scale=loss_scale,
                                           zero_stage=zero_stage, gradient_accumulation_fusion=fusion)
        return opt, acc

    model = _model()
    opt, acc = build(model)
    params_before, estimates, used = [], [], []
    for w, k_window in enumerate(plan):
        params_before.append(_flat64(model))
        batches = []
        for k in range(k_window):
            if resume_at == (w, k):
                buf = io.BytesIO()
                torch.save({"acc": acc.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, buf)
                acc.close()
                buf.seek(0)
                state = torch.load(buf, weights_only=True)
                model = _model(seed=99)  # other values: everything must come from the state
                model.load_state_dict(state["model"])
                opt, acc = build(model)
                opt.load_state_dict(state["opt"])
                acc.load_state_dict(state["acc"])
            x, y, n = _micro_batch(w, rank, k, mode)
            batches.append((x, y, n))
            loss = _loss(model, x, y, mode)
            if w == poisoned and k == 1:
                loss = loss * float("nan")
            acc.backward(loss, num_items=n if mode == "items" else None)
            r = acc.step(force=k == k_window - 1)
        assert r is not None and r.num_micro_batches == k_window
        assert bool(r.skipped) == (w == poisoned)
        estimates.append(tuple(float(t) for t in (r.grad_noise_scale, r.noise_trace_sigma, r.noise_grad_sq)))
        used.append(batches)
    return {"params_before": params_before, "estimates": estimates, "batches": used}


def _check_against_oracle(results, mode, plan=PLAN, poisoned=POISONED):
    """results: one ``_run`` per rank (same parameters everywhere). Returns the largest relative error."""
    world = len(results)
    windows = [None if w == poisoned else [b for res in results for b in res["batches"][w]] for w in range(len(plan))]
    expected = _oracle(results[0]["params_before"], windows, mode)
    worst = 0.0
    for res in results:
        for w, (got, want) in enumerate(zip(res["estimates"], expected)):
            for name, g, e in zip(("B_simple", "tr(Sigma)", "|G|^2"), got, want):
                err = abs(g - e) / abs(e)
                worst = max(worst, err)
                assert err <= ORACLE_RTOL, f"window {w}, {world} rank(s), {mode}: {name} {g} vs oracle {e}"
    return worst


@pytest.mark.parametrize("mode", ["mean", "items"])
def test_matches_fp64_oracle_one_process(mode, backend):
    worst = _check_against_oracle([_run(mode, backend=backend, loss_scale=128.0 if mode == "mean" else None)], mode)
    print(f"oracle, 1 rank, {mode}, {backend}: max relative error {worst:.2e}")


@pytest.mark.parametrize("mode", ["mean", "items"])
@pytest.mark.parametrize("at", [(2, 1), (4, 2)], ids=["partial-window", "full-window"])
def test_mid_window_resume_is_exact(mode, at, backend):
    """Saved after some micro-batches of a window and resumed in a new accumulator: the same estimates as the
    oracle (and so as the run that was not interrupted)."""
    worst = _check_against_oracle([_run(mode, backend=backend, resume_at=at)], mode)
    print(f"oracle, resumed at {at}, {mode}, {backend}: max relative error {worst:.2e}")


@pytest.mark.parametrize("mode", ["mean", "items"])
@pytest.mark.parametrize("at", [None, (2, 1)], ids=["uninterrupted", "resumed-mid-window"])
def test_matches_fp64_oracle_with_gradient_accumulation_fusion(mode, at):
    """The model's one Linear fused (its weight and bias gradients from the fused op, each micro-batch's measured
    in the fp32 tensor its bucket then adds): the estimates of the fp64 oracle, uninterrupted and resumed."""
    worst = _check_against_oracle([_run(mode, backend="cpu", resume_at=at, fusion=True,
                                        loss_scale=128.0 if mode == "mean" else None)], mode)
    print(f"oracle, fused, resumed at {at}, {mode}: max relative error {worst:.2e}")


def test_one_window_of_single_samples_is_the_sample_covariance():
    """Micro-batches of one item each: the first window's tr(Sigma) is exactly the trace of the sample covariance
    of the per-sample gradients (torch.cov, Bessel-corrected), and |G|^2 = |mean|^2 - tr(Sigma) / N."""
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=12, max_grad_norm=None,
                                       measure_noise_scale=True)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(12, D, generator=g), torch.randn(12, 1, generator=g)
    for i in range(12):
        acc.backward(_loss(model, x[i:i + 1], y[i:i + 1], "items"), num_items=1)
    r = acc.step()
    per_sample = _per_sample_grads(_flat64(model), x, y)
    trace = float(torch.cov(per_sample.T).trace())
    mean = per_sample.mean(0)
    assert rel_diff(r.noise_trace_sigma, torch.tensor(trace)) <= ORACLE_RTOL
    assert rel_diff(r.noise_grad_sq, torch.tensor(float(mean @ mean) - trace / 12)) <= ORACLE_RTOL


def test_one_micro_batch_on_one_rank_is_not_measured():
    """A window of one micro-batch on one rank holds no small batch besides the big one: NaN, the averages stay."""
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=1, max_grad_norm=None,
                                       measure_noise_scale=True)
    x, y, _ = _micro_batch(0, 0, 0, "mean")
    acc.backward(_loss(model, x, y, "mean"))
    r = acc.step()
    assert all(math.isnan(float(t)) for t in (r.grad_noise_scale, r.noise_trace_sigma, r.noise_grad_sq))
    assert float(acc._noise.scale.decay_pow) == 1.0
    plain = gaengine.GradientAccumulator(_model(), None, accumulation_steps=1)
    plain.backward(plain.params[0].sum() + plain.params[1].sum())
    r = plain.step()
    assert r.grad_noise_scale is None and r.noise_trace_sigma is None and r.noise_grad_sq is None


# ---------------------------------------------------------------- several ranks (gloo processes)
def _rank_worker(rank, world, init_file, mode, out, zero_stage):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # zero_stage >= 1 saves through torch.distributed.checkpoint (tests/test_zero.py): no resume here.
        result = _run(mode, rank=rank, resume_at=None if zero_stage else (4, 1), zero_stage=zero_stage)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears the group down while a peer's collectives are still in flight
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [0, 1, 2], ids=["replicated", "zero1", "zero2"])
@pytest.mark.parametrize("mode", ["mean", "items"])
def test_matches_fp64_oracle_two_ranks(tmp_path, mode, zero_stage):
    """Two gloo ranks, each with its own micro-batches (replicated: resumed mid-window): the small batches are the
    micro-batches of both ranks (their terms summed in the window's stats all-reduce), the big batch the window
    across ranks. With zero_stage 1 and 2 the same: each rank measures its micro-batches as they are accumulated
    (before any reduce-scatter), the window's norm comes from the shards."""
    world = 2
    codes = spawn_ranks(_rank_worker, world, (str(tmp_path / "store"), mode, str(tmp_path), zero_stage), join_s=180)
    assert codes == [0, 0]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    worst = _check_against_oracle(results, mode)
    print(f"oracle, 2 ranks, zero_stage {zero_stage}, {mode}: max relative error {worst:.2e}")


# ---------------------------------------------------------------- cost: no Python per parameter, no launch
def _wide(n_layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n_layers)])


@contextlib.contextmanager
def _count_python_calls(counter: list[int]):
    def profile(frame, event, arg):
        if event == "call":
            counter[0] += 1

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def _cost(n_layers: int, measure: bool) -> tuple[int, int]:
    """(Python function calls, accumulate launches) of the second window (layout learned) of K = 3."""
    model = _wide(n_layers)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=None,
                                       measure_noise_scale=measure)
    x = torch.randn(2, 8)
    for _ in range(3):
        acc.backward(model(x).pow(2).mean())
    acc.step()
    calls, launches = [0], acc.hooks.launches
    for _ in range(3):
        loss = model(x).pow(2).mean()
        with _count_python_calls(calls):
            acc.backward(loss)
            acc.step()
    return calls[0], acc.hooks.launches - launches


@pytest.mark.parametrize("hot_path", ["native", "python"])
def test_measuring_adds_no_python_per_parameter_and_no_launch(hot_path, monkeypatch):
    """Counted: the accumulate launches of a window are the same with and without measuring; the Python calls
    measuring adds do not grow with the number of parameters (2 vs 48; with the native hooks, a fixed count)."""
    use_hooks(monkeypatch, hot_path)
    extra = {}
    for n_layers in (1, 24):
        calls_off, launches_off = _cost(n_layers, False)
        calls_on, launches_on = _cost(n_layers, True)
        assert launches_on == launches_off, f"{2 * n_layers} parameters: measuring changed the launches"
        extra[n_layers] = calls_on - calls_off
    assert extra[1] == extra[24], f"Python calls added by measuring grow with the parameters: {extra}"


def test_no_host_sync_with_the_noise_scale_and_the_adaptive_schedule():
    from tests.helpers import forbid_host_reads  # noqa: PLC0415

    for mode in ("mean", "items-tensor", "items-int"):
        model = _model()
        acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                           accumulation_steps=Adaptive(k_min=2, k_max=8, initial=3),
                                           max_grad_norm=1.0, measure_noise_scale=True)
        for w in range(5):
            for k in range(acc.accumulation_steps):
                x, y, n = _micro_batch(w, 0, k, "items")
                num_items = None if mode == "mean" else (torch.tensor(n) if mode == "items-tensor" else n)
                loss = _loss(model, x, y, "mean" if mode == "mean" else "items")
                with forbid_host_reads():
                    acc.backward(loss, num_items=num_items)
                    r = acc.step()
        assert math.isfinite(float(r.grad_noise_scale)), mode


# ---------------------------------------------------------------- the adaptive schedule
MBS = 8  # samples per micro-batch in the schedule tests (mean mode: B_simple counts micro-batches)


def _adaptive_run(noise: float, offset: float, windows: int = 12, every: int = 2, lr_rule=None, check_exact=False):
    """Mean mode, micro-batches of MBS samples of y = x.w* + noise, the model offset from w* by ``offset``.
    Returns the K of each window (and checks each window against its large batch when asked)."""
    model = _model()
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1.0, 1.0, D) + offset)
        model.bias.fill_(0.5)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    schedule = Adaptive(k_min=2, k_max=16, every=every, initial=4, lr_rule=lr_rule,
                        optimizer=opt if lr_rule else None)
    acc = gaengine.GradientAccumulator(model, None if check_exact else opt, accumulation_steps=schedule,
                                       max_grad_norm=None, measure_noise_scale=True, micro_batch_size=MBS)
    g = torch.Generator().manual_seed(7)
    w_star = torch.linspace(-1.0, 1.0, D)
    ks, lrs = [], []
    for w in range(windows):
        k = acc.accumulation_steps
        ks.append(k)
        lrs.append(opt.param_groups[0]["lr"])
        assert acc.effective_batch_size == k * MBS
        xs, ys = [], []
        for _ in range(k):
            x = torch.randn(MBS, D, generator=g)
            y = (x @ w_star + 0.5 + noise * torch.randn(MBS, generator=g)).unsqueeze(1)
            xs.append(x)
            ys.append(y)
            acc.backward(_loss(model, x, y, "mean"))
            r = acc.step()
        assert r.num_micro_batches == k
        if check_exact:  # the large batch of this window's size, one fp32 backward on a copy
            for q in ref.parameters():
                q.grad = None
            _loss(ref, torch.cat(xs), torch.cat(ys), "mean").backward()
            # k * MBS samples reduced in another order; two backward passes of one linear layer (seeds 1/MBS, 1/(k MBS)).
            rtol = split_batch_rtol(k * MBS) + 2 * network_rtol(1, D, products_per_layer=2)
            for p, q in zip(model.parameters(), ref.parameters()):
                assert rel_diff(p.grad, q.grad) <= rtol, f"window {w} (K={k})"
    return ks, lrs


def test_adaptive_moves_k_down_on_a_low_noise_problem():
    """No label noise, far from the optimum: B_simple ~ D + 1 samples, under one micro-batch of 8: K -> k_min."""
    ks, _ = _adaptive_run(noise=0.0, offset=3.0)
    assert ks[0] == 4 and ks[-1] == 2 and ks == sorted(ks, reverse=True), ks


def test_adaptive_moves_k_up_on_a_high_noise_problem_and_every_window_is_exact():
    """Label noise 10 near the optimum: B_simple is thousands of samples, K climbs to k_max, and every window's
    gradient is the large batch of that window's size (within ``split_batch_rtol`` of one backward over the whole
    window)."""
    ks, _ = _adaptive_run(noise=10.0, offset=0.05, check_exact=True)
    assert ks[0] == 4 and ks[-1] == 16 and ks == sorted(ks), ks
    changes = [w for w in range(1, len(ks)) if ks[w] != ks[w - 1]]
    assert all(b - a >= 2 for a, b in zip(changes, changes[1:])), f"K changed more often than every=2: {ks}"
    assert changes[0] >= 2, "the first estimate is read one window late (after window 0, used from window 2)"


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_adaptive_moves_the_learning_rate_with_the_effective_batch(rule):
    ks, lrs = _adaptive_run(noise=10.0, offset=0.05, lr_rule=rule)
    for k, lr in zip(ks, lrs):
        ratio = k / 4
        want = 1e-3 * (ratio if rule == "linear" else math.sqrt(ratio))
        # Python floats: at most a division, a square root and a product per change of K, two roundings for want.
        assert abs(lr - want) <= gamma(3 * len(ks) + 2, torch.float64) * want, (ks, lrs)


def test_adaptive_target_counts_samples_per_micro_batch_and_ranks():
    """K = B_simple / (world size x samples per micro-batch), rounded, clamped; no estimate: no change."""
    schedule = Adaptive(k_min=2, k_max=16, world_size=2)
    assert schedule.target(80.0, 8.0) == 5  # 80 items over 2 ranks x 8 items per micro-batch
    assert schedule.target(88.0, 8.0) == 6  # 5.5 rounds to even (Python's round)
    assert schedule.target(10.0, 8.0) == 2 and schedule.target(1e6, 8.0) == 16  # clamped
    assert schedule.target(float("nan"), 8.0) is None and schedule.target(-3.0, 1.0) is None


def test_adaptive_resume_takes_the_same_k():
    """The schedule's position is in the accumulator's state: a run resumed at a window boundary picks the same K."""
    def build(state=None):
        model = _model()
        sched = Adaptive(k_min=2, k_max=16, initial=4)
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=sched, max_grad_norm=None,
                                           measure_noise_scale=True)
        if state is not None:
            model.load_state_dict(state["model"])
            acc.load_state_dict(state["acc"])
        return model, acc

    def window(model, acc, w):
        k = acc.accumulation_steps
        for i in range(k):
            x, y, _ = _micro_batch(w, 0, i, "mean", noise=10.0)
            acc.backward(_loss(model, x, y, "mean"))
            acc.step()
        return k

    model, acc = build()
    straight = [window(model, acc, w) for w in range(8)]
    model, acc = build()
    ks = [window(model, acc, w) for w in range(4)]
    buf = io.BytesIO()
    torch.save({"acc": acc.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    acc.close()
    model, acc = build(torch.load(buf, weights_only=True))
    ks += [window(model, acc, w) for w in range(4, 8)]
    assert ks == straight and len(set(ks)) > 1, (ks, straight)


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("value", [0.0, 1.0, -0.5, 1.5, "0.9", True, float("nan")])
def test_noise_scale_ema_outside_the_open_unit_interval_is_refused(value):
    with pytest.raises(ValueError, match=r"noise_scale_ema must be a float in \(0, 1\)"):
        gaengine.GradientAccumulator(_model(), None, measure_noise_scale=True, noise_scale_ema=value)


def test_bad_measure_flag_and_adaptive_without_measuring_are_refused():
    with pytest.raises(ValueError, match="measure_noise_scale must be True or False"):
        gaengine.GradientAccumulator(_model(), None, measure_noise_scale="yes")
    with pytest.raises(ValueError, match="measure_noise_scale=True"):
        gaengine.GradientAccumulator(_model(), None, accumulation_steps=Adaptive(k_min=2, k_max=4))


@pytest.mark.parametrize("kwargs,match", [
    (dict(k_min=4, k_max=2), "k_min must be <= k_max"),
    (dict(k_min=0, k_max=2), "k_min must be an int >= 1"),
    (dict(k_min=2, k_max=2.5), "k_max must be an int >= 1"),
    (dict(k_min=2, k_max=4, every=0), "every must be an int >= 1"),
    (dict(k_min=1, k_max=4), "k_min must be >= 2 on one rank"),
    (dict(k_min=2, k_max=4, initial=1), r"initial must be in \[k_min, k_max\]"),
    (dict(k_min=1, k_max=4, world_size=0), "world_size must be an int >= 1"),
    (dict(k_min=2, k_max=4, lr_rule="cubic", optimizer=None), "lr_rule must be None or one of"),
    (dict(k_min=2, k_max=4, lr_rule="linear"), "pass optimizer="),
])
def test_adaptive_refuses_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Adaptive(**kwargs)
    assert Adaptive(k_min=1, k_max=4, world_size=2).k == 1  # two ranks: two small batches even at K = 1


def test_resume_with_another_ema_is_refused():
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, measure_noise_scale=True)
    state = acc.state_dict()
    other = gaengine.GradientAccumulator(_model(), None, accumulation_steps=2, measure_noise_scale=True,
                                         noise_scale_ema=0.5)
    with pytest.raises(ValueError, match="noise_scale_ema=0.95"):
        other.load_state_dict(state)


# ---------------------------------------------------------------- the benchmark variant
def test_bench_accumulate_times_the_noise_scale_on_and_off(capsys):
    """``gaengine bench --only accumulate``: each backend's bucket accumulate without and with the source norms,
    checked against fp64 before it is timed, and the on / off ratio printed under the table."""
    from gaengine.tools.bench import kernels  # noqa: PLC0415

    rows, peak = kernels.bench_kernels(torch.device("cpu"), 2**14, ["accumulate"], warmup=1, repeats=3)
    on = [r for r in rows if r["variant"].endswith("noise scale on")]
    off = [r for r in rows if r["variant"].endswith("noise scale off")]
    assert len(on) == len(off) >= 1 and all(r["noise_on_off"] > 0 for r in on)
    kernels.print_tables(rows, peak, 3)
    text = capsys.readouterr().out
    for r in on:
        name = r["variant"].split(":")[0]
        assert f"measure_noise_scale, {name}: on / off = {r['noise_on_off']:.3f}x the time" in text


# ---------------------------------------------------------------- the emulated CUDA backend (CUDA kernels on CPU)
@pytest.mark.parametrize("mode", ["mean", "items"])
def test_matches_fp64_oracle_on_the_emulated_cuda_backend(request, monkeypatch, mode):
    """backend="cuda" with csrc/cuda's kernels run on CPU tensors (tests/cuda_emu, native hooks): the source norms
    come from the bucket kernel's per-chunk partials; the estimates match the oracle as on the other backends.
    Skipped where no C++ compiler builds the emulation (tests/conftest.py's ``emulated_cuda_module``)."""
    emulated_cuda.install(request, monkeypatch, as_default=False)
    worst = _check_against_oracle([_run(mode, backend="cuda", resume_at=(2, 1))], mode)
    print(f"oracle, emulated cuda, {mode}: max relative error {worst:.2e}")
