"""What ``acc.step()`` issues per update on the host, counted (issue 45, item 4), on the CPU backend with
``gaengine.optim.FusedAdamW``: operators launched (top-level ATen ops under ``torch.profiler``), allocations (its
memory events), host reads of device values (``item`` / ``_local_scalar_dense`` / ``is_nonzero``) and Python
function calls (``sys.setprofile``), each at two parameter counts, so that the per-parameter cost is the slope.

Budget enforced: per parameter 0 operators, 0 allocations, 0 host reads and 0 Python calls (``PY_CALLS_PER_PARAM``:
8 before ``FusedElementwiseOptimizer.step`` checked its lists list by list and looked states up by ``id``, with
no ``Tensor.__hash__`` per lookup);
per update at most ``OPS_PER_UPDATE`` operators and 0 host reads.

The same on the ``cuda`` backend under the emulated CUDA runtime (tests/emulated_cuda.py: csrc/cuda's kernels
built for CPU tensors, each ``gaengine`` op call one multi-tensor launch, as on a GPU), with ``FusedAdamW(backend=
"cuda")``: per parameter 0 operators (so 0 launches), 0 allocations, 0 host reads, 0 Python calls; per update at
most ``EMU_OPS_PER_UPDATE`` operators and ``EMU_LAUNCHES_PER_UPDATE`` gaengine kernel calls. One micro-batch's
backward: tests/test_hot_path.py (no Python per parameter, launches per micro-batch at most buckets + 1).
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from gaengine import GradientAccumulator
from gaengine.optim import FusedAdamW
from gaengine.tools.bench.common import without_kineto_log
from tests import emulated_cuda

PY_CALLS_PER_PARAM = 0
OPS_PER_UPDATE = 32  # 26 counted on this branch, for any parameter count
EMU_OPS_PER_UPDATE = 32  # 26 counted on the emulated cuda backend, for any parameter count
# gaengine's own op calls per update (each one kernel launch, or one per kMaxOptimizerEntries parameters for the
# optimizer's multi-tensor launch: 18 fit in one): 2 counted, the clip's scale pass and the AdamW launch.
EMU_LAUNCHES_PER_UPDATE = 4
HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")


def _count(n_params: int, backend: str = "cpu") -> dict[str, int]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, dtype=torch.bfloat16)) for _ in range(n_params)]
    acc = GradientAccumulator(params, FusedAdamW(params, lr=1e-3, backend=backend), accumulation_steps=2,
                              max_grad_norm=1.0, backend=backend)

    def window():
        for _ in range(2):
            acc.backward(sum((p.float() * (i + 1)).sum() for i, p in enumerate(params)))

    for _ in range(2):  # state created, every lazy path taken
        window()
        acc.step()
    before = [p.detach().clone() for p in params]
    window()
    calls = collections.Counter()

    def tracer(frame, event, arg):
        if event == "call":
            calls[frame.f_code.co_name] += 1

    sys.setprofile(tracer)
    try:
        acc.step()
    finally:
        sys.setprofile(None)
    assert not all(torch.equal(a, p) for a, p in zip(before, params))  # the counted step updated the model
    window()
    with without_kineto_log(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        acc.step()
    acc.close()
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    namespace = acc.backend.extension()[0].OP_NAMESPACE if backend == "cuda" else None
    ops = [e for e in events if e.name.startswith(("aten::", f"{namespace}::"))]
    return {"python": sum(calls.values()),
            "ops": sum(1 for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")),
            "launches": sum(1 for e in events if namespace is not None and e.name.startswith(f"{namespace}::")),
            "allocs": sum(1 for e in events if e.name == "[memory]" and e.cpu_memory_usage > 0),
            "host_reads": sum(1 for e in aten if e.name in HOST_READS)}


def test_step_host_cost_within_budget():
    small, large = _count(2), _count(18)
    per_param = {k: (large[k] - small[k]) / 16 for k in small}
    assert per_param["ops"] == 0 and per_param["allocs"] == 0 and per_param["host_reads"] == 0, (small, large)
    assert per_param["python"] <= PY_CALLS_PER_PARAM, (small, large)
    assert large["ops"] <= OPS_PER_UPDATE and large["host_reads"] == 0, large


def test_step_host_cost_on_the_emulated_cuda_backend(request, monkeypatch):
    emulated_cuda.install(request, monkeypatch, as_default=False)
    small, large = _count(2, "cuda"), _count(18, "cuda")
    per_param = {k: (large[k] - small[k]) / 16 for k in small}
    assert all(v == 0 for v in per_param.values()), (small, large)  # launches, ops, allocs, host reads, Python
    assert large["launches"] > 0, large  # the kernels ran through the emulated extension's ops
    assert large["launches"] <= EMU_LAUNCHES_PER_UPDATE and large["ops"] <= EMU_OPS_PER_UPDATE, large
    assert large["host_reads"] == 0, large
