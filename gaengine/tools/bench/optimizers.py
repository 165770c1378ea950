"""Muon + AdamW through gaengine at ZeRO stages 0/1/2 on d gloo ranks: the optimizer step's time, the bytes on the
wire per window, and the optimizer state and masters each rank holds, against the replicated run
(``gaengine bench --only optimizers``).

The recipe is torch's own (``torch.optim.Muon``'s documentation): Muon (lr 2e-2, its defaults otherwise) for the 2-D
hidden weights, AdamW (lr 1e-3, weight decay 0.1) for everything else (here the biases), one
``GradientAccumulator(model, [muon, adamw], zero_stage=s)``. The model is the memory table's bf16 stack of
``Linear(width, width)`` layers (``gaengine.tools.bench.memory.MemoryConfig``), at least 8 of them, so the weights
can be balanced over the ranks: at ``zero_stage`` 1 and 2 each weight has one owner rank that runs Muon on the whole
matrix (``docs/optimizers.md``). K = 2 micro-batches per window, clipping at 1.0, ``windows`` windows; the first is
untimed.

Columns (the largest over the ranks, except ``step ms``: the median over the timed windows of the slowest rank):

* ``step ms``: ``acc.step()``'s wall time, the window's norm, clip, optimizer steps and the gathering of the
  updated parameters (the ranks run as processes on this CPU's cores, one thread each);
* ``wire B/param``: the bytes one rank sends per window in gaengine's collectives, per model parameter, counted as a
  ring algorithm sends them (``gaengine.tools.bench.memory.ring_bytes``; a reduce to one rank or a broadcast from
  one rank sends (d-1)/d n, as a chain does);
* ``masters`` / ``optim``: bytes per model parameter of the fp32 master weights and of the optimizers' state tensors
  on one rank, and ``vs replicated``: their sum over the same sum at ``zero_stage`` 0 with the same d (ideal:
  1/d, shown times d: 1.0 is an even split).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from gaengine.tools.bench import memory
from gaengine.tools.bench.common import print_note, print_table

WORLD_SIZES = (1, 2, 4)
STAGES = (0, 1, 2)


@dataclass(frozen=True)
class OptimizersConfig:
    """The run of the Muon + AdamW rows.

    model: the memory table's model (its ``layers`` >= 8 weights to balance). windows: windows per run (>= 2; the
    first is untimed).
    """

    model: memory.MemoryConfig = memory.MemoryConfig(width=256, layers=8, bucket_size_mb=0.25)
    windows: int = 4

    def __post_init__(self) -> None:
        if self.model.layers < 8:
            raise ValueError(f"OptimizersConfig.model.layers must be >= 8 (weights to balance over the ranks), got "
                             f"{self.model.layers}")
        if isinstance(self.windows, bool) or not isinstance(self.windows, int) or self.windows < 2:
            raise ValueError(f"OptimizersConfig.windows must be an int >= 2 (the first is untimed), got "
                             f"{self.windows!r}")


QUICK = OptimizersConfig(memory.MemoryConfig(width=64, layers=8, bucket_size_mb=0.25), windows=3)


def muon_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon + AdamW recipe over ``model``: Muon for its 2-D weights, AdamW for the rest."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(others, lr=1e-3, weight_decay=0.1)]


@contextlib.contextmanager
def _collectives_log(log: list[tuple[str, int]]):
    """``memory._wire_log`` plus the collectives a whole-matrix owner layout may use: ``reduce`` and ``broadcast``
    (logged as a reduce-scatter's share, (d-1)/d n), ``all_gather`` into a list (its output: d times the input)."""
    extra = {"reduce": 0, "broadcast": 0, "all_gather": 1}
    originals = {}
    for name, arg in extra.items():
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def record(*args, _fn=fn, _name=name, _arg=arg, **kwargs):
            t = args[_arg] if len(args) > _arg else kwargs.get("tensor")
            n = t.numel() * t.element_size()
            if _name == "all_gather":
                n *= dist.get_world_size(kwargs.get("group"))
            log.append(("all_gather" if _name == "all_gather" else "reduce_scatter", n))
            return _fn(*args, **kwargs)

        setattr(dist, name, record)
    try:
        with memory._wire_log(log):
            yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _measure(cfg: OptimizersConfig, stage: int, world: int, rank: int) -> dict[str, Any]:
    from gaengine import GradientAccumulator  # noqa: PLC0415

    mc = cfg.model
    model = memory._model(mc)
    optimizers = muon_adamw(model)
    acc = GradientAccumulator(model, optimizers, accumulation_steps=mc.accumulation_steps, max_grad_norm=1.0,
                              bucket_size_mb=mc.bucket_size_mb, zero_stage=stage)
    g = torch.Generator().manual_seed(rank)
    step_ms: list[float] = []
    log: list[tuple[str, int]] = []
    row: dict[str, Any] = {}
    for window in range(cfg.windows):
        last = window == cfg.windows - 1
        with _collectives_log(log) if last else contextlib.nullcontext():
            for _ in range(mc.accumulation_steps):
                x = torch.randn(mc.batch, mc.width, generator=g).to(torch.bfloat16)
                acc.backward(model(x).float().square().mean())
            if world > 1:
                dist.barrier()  # every rank starts the timed step together
            start = time.perf_counter()
            acc.step()
            elapsed = time.perf_counter() - start
        if window > 0:
            step_ms.append(1e3 * elapsed)
        if last:
            seen: set[int] = set()
            memory._nbytes(list(model.parameters()), seen)  # the model's own storage is not a master
            row["masters"] = memory._nbytes([q for o in optimizers for group in o.param_groups
                                             for q in group["params"]], seen)
            row["optim"] = memory._nbytes([t for o in optimizers for t in memory._state_tensors(o)], seen)
    acc.close()
    return {**row, "wire": memory.ring_bytes(log, world), "step_ms": statistics.median(step_ms)}


def _measure_stages(rank: int, world: int, cfg: OptimizersConfig, stages: Sequence[int]) -> dict[int, dict]:
    """Each of ``stages`` on this rank; a stage this build refuses for these optimizers: its error's message."""
    results = {}
    for stage in stages:
        try:
            results[stage] = _measure(cfg, stage, world, rank)
        except ValueError as e:  # the row says why
            results[stage] = {"refused": str(e)}
    return results


def _run_world(cfg: OptimizersConfig, world: int, stages: Sequence[int]) -> list[dict]:
    return memory.run_world("optimizers", _measure_stages, world, (cfg, stages))


def bench_optimizers(cfg: OptimizersConfig, worlds: Sequence[int] = WORLD_SIZES,
                     progress: Callable[[str], None] = lambda s: None) -> tuple[list[dict], dict]:
    """The Muon + AdamW rows (module docstring): one per (stage, d), stages 1 and 2 only for d > 1 (one rank
    shards nothing). Returns ``(rows, info)``; a row a stage refuses holds ``refused`` (the error's message) and
    no figures."""
    numel = sum(p.numel() for p in memory._model(cfg.model).parameters())
    rows = []
    for world in worlds:
        progress(f"optimizers: {world} rank(s) ...")
        stages = STAGES if world > 1 else (0,)
        ranks = _run_world(cfg, world, stages)
        replicated = max(r[0]["masters"] + r[0]["optim"] for r in ranks)
        for stage in stages:
            row: dict[str, Any] = {"benchmark": "optimizers", "variant": f"Muon + AdamW, zero_stage {stage}",
                                   "stage": stage, "world": world}
            if "refused" in ranks[0][stage]:
                rows.append({**row, "refused": ranks[0][stage]["refused"]})
                continue
            held = max(r[stage]["masters"] + r[stage]["optim"] for r in ranks)
            rows.append({**row, "step_ms": max(r[stage]["step_ms"] for r in ranks),
                         "wire": max(r[stage]["wire"] for r in ranks) / numel,
                         **{c: max(r[stage][c] for r in ranks) / numel for c in ("masters", "optim")},
                         "vs_replicated": held / replicated, "vs_replicated_times_d": world * held / replicated})
    return rows, {"numel": numel, "config": asdict(cfg)}


def print_tables(rows: Sequence[dict], info: dict) -> None:
    """The rows as one table; a refused row's figures are empty and its reason follows the table."""
    columns = [("variant", "optimizers", "s"), ("world", "d", "d"), ("step_ms", "step ms", ".2f"),
               ("wire", "wire B/param/window", ".3f"), ("masters", "masters B/param", ".3f"),
               ("optim", "optim B/param", ".3f"), ("vs_replicated", "vs replicated", ".3f"),
               ("vs_replicated_times_d", "x d", ".3f")]
    mc = info["config"]["model"]
    print_table(rows, columns, keep=2, title=(
        f"optimizers: Muon (2-D weights) + AdamW (biases) through one GradientAccumulator, {info['numel']:,} bf16 "
        f"parameters in {mc['layers']} Linear({mc['width']}, {mc['width']}) layers, fp32 masters, K = "
        f"{mc['accumulation_steps']}, clip 1.0; largest over the ranks"))
    for row in rows:
        if row.get("refused"):
            print_note(f"optimizers: zero_stage {row['stage']} on {row['world']} ranks refused: {row['refused']}")
    print_note("optimizers: step ms = acc.step() (norm, clip, both optimizers' steps, the parameters' gathering), "
               "median over the timed windows of the slowest rank; vs replicated = (masters + optim) over the same "
               "at zero_stage 0 on as many ranks, x d = that times d (1.0: an even split).")
