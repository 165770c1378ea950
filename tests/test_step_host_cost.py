"""What ``acc.step()`` issues per update on the host, counted (issue 45, item 4), on the CPU backend with
``gaengine.optim.FusedAdamW``: operators launched (top-level ATen ops under ``torch.profiler``), allocations (its
memory events), host reads of device values (``item`` / ``_local_scalar_dense`` / ``is_nonzero``) and Python
function calls (``sys.setprofile``), each at two parameter counts, so that the per-parameter cost is the slope.

Budget enforced: per parameter 0 operators, 0 allocations, 0 host reads and 0 Python calls (``PY_CALLS_PER_PARAM``:
8 before ``FusedElementwiseOptimizer.step`` checked its lists list by list and looked states up by ``id``, with
no ``Tensor.__hash__`` per lookup);
per update at most ``OPS_PER_UPDATE`` operators and 0 host reads. Not counted here: the ``cuda`` backend under the
emulated runtime (tests/emulated_cuda.py), nor one micro-batch's backward.
"""

from __future__ import annotations

import collections
import sys

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from gaengine import GradientAccumulator
from gaengine.optim import FusedAdamW
from gaengine.tools.bench.common import without_kineto_log

PY_CALLS_PER_PARAM = 0
OPS_PER_UPDATE = 32  # 26 counted on this branch, for any parameter count
HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")


def _count(n_params: int) -> dict[str, int]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, dtype=torch.bfloat16)) for _ in range(n_params)]
    acc = GradientAccumulator(params, FusedAdamW(params, lr=1e-3), accumulation_steps=2, max_grad_norm=1.0,
                              backend="cpu")

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
    return {"python": sum(calls.values()),
            "ops": sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")),
            "allocs": sum(1 for e in events if e.name == "[memory]" and e.cpu_memory_usage > 0),
            "host_reads": sum(1 for e in aten if e.name in HOST_READS)}


def test_step_host_cost_within_budget():
    small, large = _count(2), _count(18)
    per_param = {k: (large[k] - small[k]) / 16 for k in small}
    assert per_param["ops"] == 0 and per_param["allocs"] == 0 and per_param["host_reads"] == 0, (small, large)
    assert per_param["python"] <= PY_CALLS_PER_PARAM, (small, large)
    assert large["ops"] <= OPS_PER_UPDATE and large["host_reads"] == 0, large
