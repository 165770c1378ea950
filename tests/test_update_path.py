"""The update path: fp16 loss scaling, no host syncs in step() and the hooks, resume mid-window."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import gaengine
from tests.conftest import backend_name, backend_params
from tests.helpers import forbid_host_reads
from tests.tolerances import (adamw_param_rtol, assert_bitwise_equal, clip_coef_rtol, clipped_grad_rtol, norm_rtol,
                              rel_diff, unit_roundoff)


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def _batch(seed, n=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g).to(dtype), torch.randn(n, 4, generator=g).to(dtype)


def _mse(model, x, y):
    return ((model(x).float() - y.float()) ** 2).mean()


# ---------------------------------------------------------------- fp16 dynamic loss scaling
def test_fp16_dynamic_loss_scaling_matches_gradscaler_recipe():
    """fp16 params: the engine vs GradScaler + fp32 master grads + clip_grad_norm_ + AdamW on the same gradients."""
    K, windows, overflow_window = 2, 5, 2
    model = _mlp(torch.float16)
    twin = copy.deepcopy(model)
    n = sum(p.numel() for p in model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in twin.parameters()]
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                       accumulation_steps=K, max_grad_norm=1.0)
    assert acc.scaler is not None and acc.scaler.dynamic  # "auto" picks dynamic for fp16 params
    ref_opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    for w in range(windows):
        for k in range(K):
            x, y = _batch(10 * w + k, dtype=torch.float16)
            boost = 1e5 if (w == overflow_window and k == 1) else 1.0  # overflows fp16 gradients
            acc.backward(_mse(model, x, y) * boost)
            r = acc.step()
            scaled = scaler.scale(_mse(twin, x, y) * boost / K)
            scaled.backward()
            for m, p in zip(masters, twin.parameters()):  # fp32 main grads, as GradScaler needs
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None
        scaler.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(masters, 1.0)
        scale_before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(masters, twin.parameters()):
                p.copy_(m)
        assert float(r.loss_scale) == scale_before
        assert bool(r.skipped) == (w == overflow_window)
        if not bool(r.skipped):  # the same fp16 gradients (the scales are powers of two), two fp32 norms
            assert rel_diff(r.grad_norm, ref_norm) <= 2 * norm_rtol(n)
        assert float(acc.scaler.scale) == scaler.get_scale()  # backed off once, identically
    assert scaler.get_scale() == 2.0**15
    masters_engine = acc.optimizer.param_groups[0]["params"]
    # Four applied updates from gradients scaled by two clip coefficients; the fp16 params are the masters' roundings,
    # so one fp16 ulp (2 u of |p|) apart where the masters straddle a rounding boundary.
    master_rtol = [adamw_param_rtol(b, 1e-3, windows - 1, 2 * clip_coef_rtol(n)) for b in masters]
    for p, q, rtol in zip(model.parameters(), twin.parameters(), master_rtol):
        assert rel_diff(p.float(), q.float()) <= 2 * unit_roundoff(torch.float16) + rtol
    for a, b, rtol in zip(masters_engine, masters, master_rtol):
        assert rel_diff(a, b) <= rtol


def test_static_loss_scale_and_none():
    model = _mlp()
    ref = copy.deepcopy(model)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, loss_scale=1024.0)
    for k in range(2):
        acc.backward(_mse(model, *_batch(k)))
    r = acc.step()
    assert float(r.loss_scale) == 1024.0 and float(acc.scaler.scale) == 1024.0
    for k in range(2):
        (_mse(ref, *_batch(k)) / 2).backward()
    for p, q in zip(model.parameters(), ref.parameters()):  # 1024, 1/2: powers of two, the same adds
        assert_bitwise_equal(p.grad, q.grad)
    acc.close()
    assert gaengine.GradientAccumulator(model, None, loss_scale=None).scaler is None


# ---------------------------------------------------------------- no host sync
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("mode", ["mean", "items-tensor"])
def test_no_host_sync_in_hooks_and_step(dtype, mode):
    model = _mlp(dtype)
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                       accumulation_steps=3, max_grad_norm=1.0)
    applied = []
    for w in range(4):  # fp16 starts at a 2**16 loss scale and backs off on overflow: some windows skip
        for k in range(3):
            x, y = _batch(k + 3 * w, dtype=dtype)
            loss = _mse(model, x, y)
            n = torch.tensor(4) if mode == "items-tensor" else None
            if n is not None:
                loss = loss * 4
            with forbid_host_reads():
                acc.backward(loss, num_items=n)
                r = acc.step()
        applied.append(not bool(r.skipped) and bool(torch.isfinite(r.grad_norm)))
    assert applied[-1] and (all(applied) or dtype == torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_no_host_sync_fused_adamw_without_masters(dtype):
    """master_weights=False + FusedAdamW: coef as grad_scale, the skip as found_inf, the fp32 views as main_grad."""
    import gaengine.optim  # noqa: PLC0415

    model = _mlp(dtype)
    opt = gaengine.optim.FusedAdamW(model.parameters(), lr=1e-3)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=3, max_grad_norm=1.0, master_weights=False)
    applied = []
    for w in range(4):  # fp16 starts at a 2**16 loss scale and backs off on overflow: some windows skip
        for k in range(3):
            x, y = _batch(k + 3 * w, dtype=dtype)
            with forbid_host_reads():
                acc.backward(_mse(model, x, y))
                r = acc.step()
        applied.append(not bool(r.skipped))
    assert applied[-1] and (all(applied) or dtype == torch.float16)
    assert all(s["exp_avg"].dtype == dtype for s in opt.state.values())


def test_patched_reads_are_caught():
    """The guard itself works: a non-fused optimizer's skip decision is a host read and is reported."""
    model = _mlp()
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=1)
    acc.backward(_mse(model, *_batch(0)))
    with pytest.raises(AssertionError, match="host read"), forbid_host_reads():
        acc.step()


def _copy_run_state(src_model, src_acc, dst_model, dst_acc) -> None:
    """Make run ``dst`` start the next window exactly where run ``src`` is: model parameters, the optimizer's
    parameters (the fp32 masters when there are any) and every optimizer state tensor, copied on the device."""
    with torch.no_grad():
        for a, b in zip(src_model.parameters(), dst_model.parameters()):
            b.copy_(a)
        src_params = [q for g in src_acc.optimizer.param_groups for q in g["params"]]
        dst_params = [q for g in dst_acc.optimizer.param_groups for q in g["params"]]
        assert len(src_params) == len(dst_params)
        for a, b in zip(src_params, dst_params):
            b.copy_(a)
            for key, value in src_acc.optimizer.state[a].items():
                if isinstance(value, torch.Tensor):
                    dst_acc.optimizer.state[b][key].copy_(value)


@pytest.mark.cuda
@pytest.mark.parametrize("backend_id", backend_params("triton", "cuda-gpu"))  # the GPU's (tests/conftest.py)
@pytest.mark.parametrize("variant", ["torch-fused", "gaengine-fused", "no-master", "gaengine-no-master"])
def test_no_device_sync_on_cuda(backend_id, variant):
    """On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` raises at any synchronizing CUDA call (a copy to
    the host, a blocking host-to-device copy, a stream synchronize) inside the hooks and ``step()``.

    The numbers are checked against a reference on the SAME device: the same engine with ``backend="torch"``
    (the plain-torch reference backend) on the same GPU, started from the same state each window. Not against
    a CPU run: a bf16 GEMM on the GPU and one on the CPU round differently (5.6e-5 relative was measured on an
    H100), which no kernel of ours can close. On one device the forward and backward passes are the same cuBLAS
    calls on bit-identical inputs (deterministic), and every backend's unscaled accumulate is bitwise
    ``dst.add_(src)`` (the Backend contract), so both runs hold the same fp32 gradient sums. What may differ:

    * the norm: each backend's sum of squares is within ``sum_sq_rtol(n)`` of the exact one
      (tests/tolerances.py), so the two norms (square roots: half the relative error each) are within
      ``sum_sq_rtol(n)`` of each other: about 5e-6 for this model's n = 420;
    * hence the clip coefficient (same relative bound) and the clipped gradient (plus one fp32 rounding);
      the fp32 masters after one AdamW update from gradients ``clipped_grad_rtol(n)`` apart are within
      ``adamw_param_rtol`` (AdamW's ``m / sqrt(v)`` would cancel a common factor, but the carried moments do not);
    * bf16 parameters (the model, or the optimizer's own with master_weights=False): one bf16 ulp more (2 u of
      max |p|), since a last-bit difference of the master can flip a rounding.

    The runs are re-synchronized after each window (``_copy_run_state``), so these one-window bounds hold in
    every window; three windows are run (the first creates the optimizer state, the next ones read it)."""
    import gaengine.optim  # noqa: PLC0415
    from tests.tolerances import sum_sq_rtol  # noqa: PLC0415

    def make(engine_backend):
        model = _mlp(torch.bfloat16).to("cuda")
        params = model.parameters()
        opt = (gaengine.optim.FusedAdamW(params, lr=1e-3) if variant.startswith("gaengine")
               else torch.optim.AdamW(params, lr=1e-3, fused=True))
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=3, max_grad_norm=0.5,
                                           backend=engine_backend, master_weights=not variant.endswith("no-master"))
        return model, acc

    model, acc = make(backend_name(backend_id))
    ref_model, ref_acc = make("torch")
    n = sum(p.numel() for p in model.parameters())
    batches = [tuple(t.cuda() for t in _batch(i, dtype=torch.bfloat16)) for i in range(9)]
    torch.cuda.synchronize()
    for w in range(3):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for k in range(3):
                acc.backward(_mse(model, *batches[3 * w + k]))
            result = acc.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for k in range(3):
            ref_acc.backward(_mse(ref_model, *batches[3 * w + k]))
        ref_result = ref_acc.step()
        assert not bool(result.skipped) and not bool(ref_result.skipped)
        assert rel_diff(result.grad_norm, ref_result.grad_norm) <= sum_sq_rtol(n), f"window {w}: grad_norm"
        masters = [q for g in acc.optimizer.param_groups for q in g["params"]]
        ref_masters = [q for g in ref_acc.optimizer.param_groups for q in g["params"]]
        # one AdamW update (the runs re-synchronized each window) from the same sums clipped on each side; bf16: the
        # two masters that close round to the same bf16 value or to neighbours, one bf16 ulp (2 u) of max |p| apart
        bf16_ulp = 2 * unit_roundoff(torch.bfloat16)
        for i, (a, b) in enumerate(zip(masters, ref_masters)):
            bound = adamw_param_rtol(b.float(), 1e-3, 1, clipped_grad_rtol(n))
            bound += 0.0 if a.dtype == torch.float32 else bf16_ulp  # fp32 masters, or the bf16 params themselves
            assert rel_diff(a, b) <= bound, f"window {w}: optimizer param {i} ({a.dtype})"
        for i, (a, b) in enumerate(zip(model.parameters(), ref_model.parameters())):
            bound = bf16_ulp + adamw_param_rtol(b.float(), 1e-3, 1, clipped_grad_rtol(n))
            assert rel_diff(a.float(), b.float()) <= bound, f"window {w}: model param {i} (bf16: one rounding)"
        _copy_run_state(model, acc, ref_model, ref_acc)


# ---------------------------------------------------------------- resume mid-window
_RESUME_SCRIPT = textwrap.dedent(r"""
    import sys, torch
    from torch import nn
    import gaengine
    mode, path = sys.argv[1], sys.argv[2]
    K, WINDOWS, STOP_WINDOW, STOP_MICRO = 3, 4, 2, 2   # stop after micro-batch 2 of window 2 (0-based: 1 done)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=0.5, lr_scheduler=sched)
    def micro(w, k):
        g = torch.Generator().manual_seed(100 * w + k)
        x, y = torch.randn(4, 8, generator=g).bfloat16(), torch.randn(4, 4, generator=g)
        return ((model(x).float() - y) ** 2).sum(), 4
    start = (0, 0)
    if mode == "resume":
        ck = torch.load(path + ".ckpt", weights_only=True)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"]); sched.load_state_dict(ck["sched"])
        acc.load_state_dict(ck["acc"])
        start = (STOP_WINDOW, STOP_MICRO)
    for w in range(start[0], WINDOWS):
        for k in range(start[1] if w == start[0] else 0, K):
            if mode == "stop" and (w, k) == (STOP_WINDOW, STOP_MICRO):
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "acc": acc.state_dict()}, path + ".ckpt")
                sys.exit(0)
            loss, n = micro(w, k)
            acc.backward(loss, num_items=n)
            acc.step()
    torch.save([p.detach().clone() for p in model.parameters()] +
               [q.detach().clone() for q in opt.param_groups[0]["params"]], path + ".final")
""")


def test_resume_mid_window_in_new_process_is_bit_identical(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_RESUME_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for mode, name in (("full", "a"), ("stop", "b"), ("resume", "b")):
        subprocess.run([sys.executable, str(script), mode, str(tmp_path / name)], check=True, env=env, timeout=120)
    full = torch.load(tmp_path / "a.final", weights_only=True)
    resumed = torch.load(tmp_path / "b.final", weights_only=True)
    assert len(full) == len(resumed) == 8
    for a, b in zip(full, resumed):
        assert torch.equal(a, b)


def test_state_dict_from_another_model_is_refused():
    model = _mlp()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=None)
    acc.backward(_mse(model, *_batch(0)))
    before = acc.main_grad.data.clone()
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    other_acc = gaengine.GradientAccumulator(other, None, accumulation_steps=3)
    with pytest.raises(ValueError, match="another model"):
        acc.load_state_dict(other_acc.state_dict())
    with pytest.raises(ValueError, match="state"):
        acc.load_state_dict({"format": "something else"})
    assert torch.equal(acc.main_grad.data, before) and acc.num_micro_batches == 1


# ---------------------------------------------------------------- the parameter store: one path, both layouts
# Odd sizes; over 3 ranks and 1e-3 MiB buckets: parameters cut by a rank boundary, and in the last bucket
# parameters that lie past a rank's range (that rank owns none of them).
_STORE_SHAPES = [(1,), (127,), (33, 5), (4097,), (3,), (70,), (5,)]


def _store_optimizer(name, params):
    from gaengine.optim import FusedAdamW  # noqa: PLC0415

    if name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-1, momentum=0.9)
    return FusedAdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("layout", ["shaped", "flat-d1", "flat-d3"])  # one rank's store; every rank of d
@pytest.mark.parametrize("opt", ["adamw-foreach", "adamw-fused", "sgd", "fused-adamw"])
@pytest.mark.parametrize("dtype,masters", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False),
                                           (torch.float16, True), (torch.float16, False)],
                         ids=["fp32", "bf16-masters", "bf16", "fp16-masters", "fp16"])
def test_store_update_matches_the_plain_recipe(layout, opt, dtype, masters):
    """``ParameterStore.update`` with parameter-shaped pieces (the replicated store) or with 1-D pieces over a
    ``ShardLayout`` of d ranks (the sharded store; every rank's store built here, no collective needed: each
    rank's own range of the parameters is what it writes), against the plain recipe on the same gradients: fp32
    masters (or the params themselves) stepped by the same optimizer on ``grad * coef``, bit for bit on the ranges
    each rank owns. Three updates: a plain one, a skipped one, one with a parameter without gradient. A leftover
    ``optimizer.step()`` after each changes nothing."""
    from gaengine.buffer import FlatBuffer, FlatLayout  # noqa: PLC0415
    from gaengine.store import ParameterStore  # noqa: PLC0415
    from gaengine.zero import EvenShards, ShardLayout, WholeParams  # noqa: PLC0415

    torch.manual_seed(3)
    values = [torch.randn(*shape).to(dtype) for shape in _STORE_SHAPES]
    world = 3 if layout == "flat-d3" else 1
    ranks = []  # per rank: (its params, its optimizer, its store, its fp32 gradient buffer, its gradient views)
    for rank in range(world):
        params = [nn.Parameter(v.clone()) for v in values]
        optimizer = _store_optimizer(opt, params)
        shard = ShardLayout.build(params, 1e-3, world) if layout != "shaped" else None  # 1e-3 MiB: several buckets
        store = ParameterStore(optimizer, params, device=torch.device("cpu"), master_weights=masters,
                               layout=EvenShards(shard, rank) if shard is not None else WholeParams())
        grad_buf = FlatBuffer(shard.layout if shard is not None else FlatLayout.build(params), torch.float32,
                              torch.device("cpu"))
        if shard is None:
            grads, chunks = grad_buf.views, [grad_buf.data]
        else:  # this rank's range of each parameter, and of each bucket (stage 1's layout)
            grads = [v[s.lo:s.hi] for v, s in zip(grad_buf.flat_views, store.slots)]
            chunks = [grad_buf.data[slice(*b.rank_range(rank))] for b in shard.buckets]
        for piece, s, p in zip(store.pieces, store.slots, params):
            assert (piece is None) == (s.hi == s.lo and shard is not None)
            assert s.optimized and s.master == (masters and dtype != torch.float32)  # owned here or not
            if piece is not None:
                assert piece.shape == (p.shape if shard is None else torch.Size([s.hi - s.lo]))
                assert piece.dtype == (torch.float32 if masters else dtype)
        ranks.append((params, optimizer, store, grad_buf, grads, chunks))
    owned = [0] * len(values)  # every element of every parameter is owned by exactly one rank
    for _, _, store, _, _, _ in ranks:
        for j, s in enumerate(store.slots):
            owned[j] += s.hi - s.lo
    assert owned == [v.numel() for v in values]

    # The plain recipe: fp32 masters (or the params themselves) and the same optimizer.
    with_masters = masters or dtype == torch.float32
    ref_params = [v.clone() for v in values]
    ref_held = [nn.Parameter(v.float()) for v in ref_params] if with_masters else [nn.Parameter(v) for v in ref_params]
    ref_opt = _store_optimizer(opt, ref_held)
    coef = torch.tensor(0.5)  # a power of two: grad / (1 / coef) == grad * coef, exactly
    g = torch.Generator().manual_seed(7)
    for update in range(3):
        raw = [torch.randn(*shape, generator=g) for shape in _STORE_SHAPES]
        skipped = torch.tensor(update == 1)
        unused = 2 if update == 2 else None
        for params, optimizer, store, grad_buf, grads, chunks in ranks:
            for view, r in zip(grad_buf.views, raw):
                view.copy_(r)
            applied = store.update([None if j == unused else v for j, v in enumerate(grads)], chunks, coef,
                                   skipped, gaengine.backends.get_backend("torch"))
            assert applied in (None, update != 1)
            assert all(piece is None or (piece.grad is None and not hasattr(piece, "main_grad"))
                       for piece in store.pieces)
        if update != 1:
            for j, (q, r) in enumerate(zip(ref_held, raw)):
                if j == unused:
                    q.grad = None
                elif opt == "fused-adamw" and not with_masters:
                    q.main_grad = r * 0.5  # FusedAdamW reads the fp32 gradient of a bf16/fp16 param
                else:
                    q.grad = (r * 0.5).to(q.dtype)
            ref_opt.step()
            for q in ref_held:
                q.grad = None
                q.__dict__.pop("main_grad", None)
            ref_params = [q.detach().to(dtype) for q in ref_held]
        for params, optimizer, store, _, _, _ in ranks:
            for j, (p, s, r) in enumerate(zip(params, store.slots, ref_params)):
                assert torch.equal(p.reshape(-1)[s.lo:s.hi], r.reshape(-1)[s.lo:s.hi]), (update, j)
                if s.master and s.piece is not None:
                    assert torch.equal(s.piece.detach().reshape(-1), ref_held[j].detach().reshape(-1)[s.lo:s.hi])
            before = [p.detach().clone() for p in params]
            optimizer.step()  # a leftover step: no piece holds a gradient
            assert all(torch.equal(p, b) for p, b in zip(params, before))
