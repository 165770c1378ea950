"""No impossible figure (gaengine.tools.bench.plausible): a planted unsynchronized timing and a planted no-op are
reported as invalid measurements, their real counterparts timed in the same rounds are not; the committed H100 run's
``FusedAdamW.step()`` row (a no-op, 4.08x the copy it was measured with) is flagged when its file is re-read, and no
other committed row is; ``benchmarks/bench_step.py``'s ``FusedAdamW.step()`` row times the real update; CUDA rounds
are timed inside synchronized regions (a fake asynchronous device)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gaengine.tools.bench import common, plausible
from tests.helpers import load_file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Several times the CPU's last-level cache, so that every timed call streams from memory.
NUMEL = max(4 * (plausible.cache_bytes("cpu") or 32 * 2**20) // 4, 2**22)


def _bound(samples_ms, numel):
    return plausible.bandwidth_bound([("fp32 a.add_(b)", numel, 12, samples_ms)], "cpu")


def test_planted_unsynchronized_timing_is_invalid():
    """A call that hands its copy to another thread (as a CUDA launch hands its kernel to the device) and returns
    is timed without waiting for the copy: invalid. The same copy waited for, in the same rounds: valid."""
    a, b = torch.randn(NUMEL), torch.randn(NUMEL)
    src, dst = torch.randn(NUMEL), torch.empty(NUMEL)
    with ThreadPoolExecutor(1) as stream:
        pending = []

        def unsynchronized():
            pending.append(stream.submit(dst.copy_, src))

        def synchronized():
            stream.submit(dst.copy_, src).result()

        def drain():  # untimed: the previous round's copy finishes before anything else is timed
            while pending:
                pending.pop().result()

        samples = common.time_rounds({"peak": (drain, lambda: a.add_(b)), "unsync": (drain, unsynchronized),
                                      "sync": (drain, synchronized)}, warmup=1, repeats=5).ms
        drain()
    bound = _bound(samples["peak"], NUMEL)
    figures = {k: common.gb_per_s(NUMEL, 8, min(samples[k])) for k in ("unsync", "sync")}
    reason = plausible.check_bandwidth(figures["unsync"], bound, working_set_bytes=8 * NUMEL)
    assert reason is not None and "without synchronizing" in reason, (figures, bound)
    assert plausible.check_bandwidth(figures["sync"], bound, working_set_bytes=8 * NUMEL) is None, (figures, bound)


def test_planted_no_op_is_invalid_and_marked():
    """torch's fused AdamW on parameters without a gradient updates nothing; timed with the bytes of a real step
    (28 B/parameter) it is invalid, and ``mark`` moves its figures out of the row. The real step is valid."""
    n = NUMEL // 4  # 28 B/parameter: still several times the cache
    params = [torch.nn.Parameter(torch.randn(n // 2)) for _ in range(2)]
    no_grad = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    real, noop = (torch.optim.AdamW(ps, lr=1e-4, fused=True) for ps in (params, no_grad))
    a, b = torch.randn(n), torch.randn(n)
    samples = common.time_rounds({"peak": lambda: a.add_(b), "real": real.step, "noop": noop.step},
                                 warmup=1, repeats=5).ms
    bound = _bound(samples["peak"], n)
    rows = [{"variant": k, "gb_s": common.gb_per_s(n, 28, sorted(samples[k])[2]), "speedup": 1.0}
            for k in ("real", "noop")]
    bad = plausible.mark(rows, lambda r: plausible.check_bandwidth(r["gb_s"], bound, working_set_bytes=28 * n))
    assert [r["variant"] for r in bad] == ["noop"], (rows, bound)
    assert rows[1]["gb_s"] is None and rows[1]["speedup"] is None and rows[1]["invalid"]["gb_s"] > bound.limit
    assert "no-op" in rows[1]["invalid"]["reason"]
    assert rows[0]["valid"] and rows[0]["gb_s"] is not None


def test_check_flops():
    bound = plausible.Bound(100.0, "TFLOP/s", "bf16 matmul", "cuda")
    assert plausible.check_flops(100.0 * plausible.MARGIN, bound) is None
    assert "1.30x" in plausible.check_flops(130.0, bound)


def test_committed_results_h100_fused_adamw_row_flagged():
    """Re-reading the committed results: the H100 run's FusedAdamW.step() row (a no-op) is the one flagged."""
    h100 = json.loads((RESULTS / "nvidia-h100-80gb-hbm3-step.json").read_text())
    found = plausible.check_payload(h100)
    assert [row for row, _ in found] == ["    FusedAdamW.step() (grad_scale, found_inf, bf16 write)"], found
    assert "4.08x" in found[0][1]
    others = [p for p in RESULTS.glob("*.json") if p.name != "nvidia-h100-80gb-hbm3-step.json"]
    assert others
    for path in others:
        assert plausible.check_payload(json.loads(path.read_text())) == [], path


def _bench_step():
    return load_file("bench_step", ROOT / "benchmarks" / "bench_step.py")


def test_bench_step_fused_adamw_row_times_the_real_update():
    """The row steps parameters that hold a gradient: they change, so the row is not a no-op; it is a figure
    within the bound and no faster than the bytes allow against torch's own fused AdamW step timed beside it."""
    bench_step = _bench_step()
    rows, info = bench_step.bench(1_000_000, 3, torch.device("cpu"), warmup=1, repeats=3)
    row = next(r for r in rows if "FusedAdamW.step()" in r["variant"])
    assert row.get("valid") is True, row
    assert row["gb_s"] <= info["bound_gb_s"] * plausible.MARGIN


class _FakeStream:
    """An asynchronous fake CUDA device: work is queued to a thread; synchronize and events wait in order."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1)
        self.last = None

    def enqueue(self, fn):
        self.last = self.pool.submit(fn)

    def synchronize(self, device=None):
        if self.last is not None:
            self.last.result()


def test_cuda_rounds_are_synchronized_and_event_timed(monkeypatch):
    """On a CUDA device a round waits for the device's queued work: a call that only enqueues 50 ms of device
    work is timed at >= 50 ms, by events recorded on the stream around it."""
    stream = _FakeStream()
    recorded = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            recorded.append(self)
            stream.enqueue(lambda: setattr(self, "t", time.perf_counter()))

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "synchronize", stream.synchronize)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    samples = common.time_rounds({"work": lambda: stream.enqueue(lambda: time.sleep(0.05))}, device="cuda",
                                 warmup=0, repeats=2).ms["work"]
    stream.pool.shutdown()
    assert len(recorded) == 4
    assert all(ms >= 50.0 for ms in samples), samples
