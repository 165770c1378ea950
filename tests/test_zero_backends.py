"""ZeRO stages 1 and 2 on every backend's hooks, and ``overlap_param_gather`` at stage 2, as real gloo ranks against the
plain PyTorch recipe in one process (``tests/zero_scenarios.py``'s ``plain_recipe``: fp32 gradients summed over the
world's micro-batches, divided by their count or the items, ``clip_grad_norm_``, a torch optimizer on fp32 masters).

``tests/test_zero.py`` runs its configurations on the default backend (``cpu``, the native hooks); here each backend
id of ``tests/conftest.py`` that the stages had never run on: ``triton`` (the interpreter on CPU tensors), ``cuda-emu``
(the cuda backend over the emulated build, native hooks) and ``cpu`` with the Python hooks (``GAENGINE_HOT_PATH=
python``). Public API only: the ranks report the model's parameters after the last window (with
``overlap_param_gather``, after the next forward, whose pre-hooks wait for the gathers), not the accumulator's
internals. One launch of 2 ranks per test, three configurations each, so a test stays within seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

import gaengine
from tests import emulated_cuda
from tests.conftest import backend_name, backend_params
from tests.models import Net
from tests.oracle_hooks import use_hooks
from tests.tolerances import rel_diff
from tests.zero_scenarios import (BASE, K, launch, make_optimizer, masters_rtol, micro_batch, micro_loss, plain_recipe,
                                  token_data, window_sizes)

pytestmark = pytest.mark.multiproc

WORLD = 2
CONFIGS = {
    "s1-fused-adamw": dict(stage=1, opt="fused-adamw"),
    "s2-items-partial": dict(stage=2, items=True, partial=True),
    "s2-overlap": dict(stage=2, overlap=True),
}
# Each backend's hooks: the id, GAENGINE_HOT_PATH for its ranks.
HOOKS = {"triton": "python", "cuda-emu": "native", "cpu": "python"}


def _cfg(name):
    return {**BASE, **CONFIGS[name]}


def _run_config(rank, world, backend, name):
    """One configuration of ``CONFIGS`` on this rank: the model's parameters after the last window."""
    cfg = _cfg(name)
    torch.manual_seed(0)
    model = Net().to(cfg["dtype"])
    opt = make_optimizer(cfg["opt"], list(model.parameters()))
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=cfg["clip"],
                                       bucket_size_mb=0.0005, zero_stage=cfg["stage"],
                                       overlap_param_gather=cfg["overlap"], backend=backend)
    data = token_data(world)
    skipped = []
    for step, k_steps in enumerate(window_sizes(cfg)):
        for k in range(k_steps):
            t, l = micro_batch(data, step, rank, k)
            acc.backward(micro_loss(model, t, l, cfg["items"], use_side=rank == 0),
                         num_items=torch.tensor(int((l != -100).sum())) if cfg["items"] else None)
        skipped.append(bool(acc.step(force=k_steps < K).skipped))
    if cfg["overlap"]:
        model(data[0][0, :1], use_side=True)  # the next forward: every module's pre-hook waits for its gather
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "skipped": skipped,
           "hooks": type(acc.hooks).__name__}
    acc.close()
    return out


def _scenario(rank, world, arg):
    """``arg``: (backend id, configuration names); each configuration's result on this rank."""
    backend_id, names = arg
    if backend_id == "cuda-emu":
        emulated_cuda.install_in_rank()
    return {name: _run_config(rank, world, backend_name(backend_id), name) for name in names}


def _check(results, name):
    cfg = _cfg(name)
    ref, ref_skipped, _ = plain_recipe(WORLD, cfg)
    n = sum(t.numel() for t in ref.values())
    for rank, res in enumerate(results):
        run = res[name]
        assert run["skipped"] == ref_skipped, f"{name} rank {rank}: skip decisions"
        for pname, expected in ref.items():
            got = run["params"].get(pname)
            if got is None:  # out.weight: tied to emb.weight, one parameter
                continue
            assert rel_diff(got, expected) <= masters_rtol(cfg, WORLD, expected, n), \
                f"{name} rank {rank} {pname}: vs the plain recipe in one process"
            assert torch.equal(got, results[0][name]["params"][pname]), f"{name} rank {rank} {pname}: ranks differ"


@pytest.mark.parametrize("backend_id", backend_params(*HOOKS))
def test_zero_stages_on_each_backends_hooks_match_one_process(tmp_path, monkeypatch, request, backend_id):
    if backend_id == "cuda-emu":
        request.getfixturevalue("emulated_cuda_module")  # built once, here: the ranks load it; skips without a compiler
    use_hooks(monkeypatch, HOOKS[backend_id])  # the spawned ranks inherit it
    results = launch(tmp_path, WORLD, _scenario, (backend_id, list(CONFIGS)))
    hooks = {res[name]["hooks"] for res in results for name in CONFIGS}
    assert len(hooks) == 1, hooks
    for name in CONFIGS:
        _check(results, name)


def test_overlap_param_gather_at_stage2_on_the_default_backend(tmp_path, monkeypatch):
    """Stage 2 with the gathers left in flight after ``step()`` on the default backend and hooks (``auto``)."""
    use_hooks(monkeypatch, "native")
    monkeypatch.delenv("GAENGINE_BACKEND", raising=False)
    results = launch(tmp_path, WORLD, _scenario, ("auto", ["s2-overlap"]))
    _check(results, "s2-overlap")
