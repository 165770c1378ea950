"""Memory per parameter per rank, and bytes on the wire per window, of the ZeRO stages against the plain recipe and
torch DDP, measured from the tensors each recipe allocated (``gaengine bench --only memory``).

Every recipe trains the same bf16 model (``MemoryConfig``: a stack of ``Linear`` layers) on d ranks, d = 1, 2, 4,
as real ``gloo`` processes on the CPU (the bytes do not depend on the device), with AdamW (lr 1e-3, weight decay
0.1), K = 2 micro-batches per window and clipping at 1.0, for two windows; the state is counted at its high
point, after the second window's last backward and before its update (the window's gradients and the optimizer
state of the first update are both alive).

Recipes (rows):

* ``plain``: bf16 parameters, bf16 ``.grad`` accumulated by ``(loss / K).backward()``, ``torch.optim.AdamW`` on
  the bf16 parameters (bf16 moments): 2 + 2 + 4 = 8 B/param (on one rank).
* ``torch DDP``: the plain recipe in ``DistributedDataParallel(gradient_as_bucket_view=True)`` with ``no_sync()``
  for micro-batches 0 .. K-2: the gradients are views of DDP's buckets, 8 B/param.
* ``gaengine stage 0/1/2``: ``GradientAccumulator(zero_stage=s)`` with fp32 master weights and
  ``torch.optim.AdamW``: stage 0 is 2 + 4 + 4 + 8 = 18 B/param; stage 1 is 2 + 4 + 12/d (the masters' 4 and the
  moments' 8 sharded); stage 2 is 2 + 16/d (the fp32 gradient sum sharded too) plus the staging its micro-batches
  are written into before they are reduce-scattered: a ring of ``gaengine.zero.STAGING_SLOTS`` buffers of the
  largest bucket (S x bucket, fewer with fewer buckets; ``gaengine.zero.ShardReducer.acquire``), so it shrinks with
  ``bucket_size_mb``, not with d. A world of one shards nothing (every stage is stage 0 there).

Columns, bytes per model parameter on one rank (the largest over the ranks; ranks differ only by padding):
``params`` (the parameters' storage), ``grad`` (what holds the window's gradient: ``.grad`` or DDP's buckets; the
fp32 ``main_grad``; at stage 2 the fp32 gradient shard), ``staging`` (stage 2's ring of bucket buffers), ``masters`` (the
optimizer's parameters that are not the model's: fp32 master weights or their shards), ``optim`` (the optimizer's
state tensors), ``total`` and the ``formula`` above. Every tensor is counted once by its storage
(``untyped_storage().nbytes()``, deduplicated by data pointer: views of one flat buffer count once, padding
included), in the first of those columns that holds it.

Bytes on the wire per window and rank (``wire B/param``): the tensors handed to the collectives during the second
window (gaengine's ``all_reduce``, ``reduce_scatter``, ``all_gather`` calls, recorded by wrapping those functions of
``torch.distributed``; DDP's through a communication hook), counted as a ring algorithm sends them: an all-reduce of
n bytes sends 2 (d-1)/d n per rank, a reduce-scatter of an n-byte input and an all-gather of an n-byte output
(d-1)/d n. Stage 1 sends what stage 0 sends (a reduce-scatter plus an all-gather of bf16 parameters is less than an
fp32 all-reduce); stage 2 reduce-scatters every micro-batch.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gaengine.tools.bench.common import print_note, print_table

MEMORY_WORLD_SIZES = (1, 2, 4)
MEMORY_STAGES = (0, 1, 2)
COLUMNS = ("params", "grad", "staging", "masters", "optim")


@dataclass(frozen=True)
class MemoryConfig:
    """The model and the run of the memory table.

    width: features of each ``Linear(width, width)`` layer. layers: how many. batch: rows per micro-batch.
    accumulation_steps: K micro-batches per window. bucket_size_mb: gaengine's bucket size (MiB of fp32 gradient).
    """

    width: int = 512
    layers: int = 8
    batch: int = 4
    accumulation_steps: int = 2
    bucket_size_mb: float = 1.0  # one layer per bucket by default (8 buckets), QUICK: 4 buckets

    def __post_init__(self) -> None:
        for name in ("width", "layers", "batch", "accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryConfig.{name} must be an int >= 1, got {value!r}")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"MemoryConfig.bucket_size_mb must be > 0, got {self.bucket_size_mb!r}")


QUICK = MemoryConfig(width=256, layers=4, bucket_size_mb=0.25)


def staging_bytes(cfg: MemoryConfig, world: int) -> tuple[int, int]:
    """Stage 2's staging on ``world`` ranks: ``(buffers, bytes of each)``, ``STAGING_SLOTS`` (at most one per bucket)
    fp32 buffers of the largest bucket of the model's ``gaengine.zero.ShardLayout``."""
    from gaengine.buffer import initial_order  # noqa: PLC0415
    from gaengine.zero import STAGING_SLOTS, ShardLayout, zero_order  # noqa: PLC0415

    layout = ShardLayout.build(zero_order(initial_order(list(_model(cfg).parameters()))), cfg.bucket_size_mb, world)
    return min(STAGING_SLOTS, len(layout.buckets)), 4 * max(b.end - b.start for b in layout.buckets)


def formula(recipe: str, stage: int | None, world: int, staging: tuple[int, float] = (0, 0.0)) -> tuple[str, float]:
    """The bytes per parameter per rank a recipe should hold: ``(expression, value)`` (module docstring).
    staging: stage 2's ``(buffers, B/param of each)`` (``staging_bytes`` over the parameter count)."""
    if recipe in ("plain", "ddp"):
        return "2 + 2 + 4", 8.0
    if stage == 0 or world == 1:
        return "2 + 4 + 4 + 8", 18.0
    if stage == 1:
        return f"2 + 4 + 12/{world}", 6.0 + 12.0 / world
    slots, each = staging
    return f"2 + 16/{world} + {slots} x {each:.3g} staging", 2.0 + 16.0 / world + slots * each


def _model(cfg: MemoryConfig) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(cfg.layers) for m in (nn.Linear(cfg.width, cfg.width), nn.Tanh())]
    return nn.Sequential(*layers).to(torch.bfloat16)


def _nbytes(tensors: Sequence[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (data pointers), which this adds to."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


@contextlib.contextmanager
def _wire_log(log: list[tuple[str, int]]):
    """Record ``(kind, bytes)`` of every all-reduce, reduce-scatter (input) and all-gather (output) issued through
    ``torch.distributed`` while active."""
    wrapped = {"all_reduce": ("all_reduce", 0), "reduce_scatter_tensor": ("reduce_scatter", 1),
               "reduce_scatter_single": ("reduce_scatter", 1), "all_gather_into_tensor": ("all_gather", 0),
               "all_gather_single": ("all_gather", 0)}
    originals = {}
    for name, (kind, arg) in wrapped.items():
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def record(*args, _fn=fn, _kind=kind, _arg=arg, **kwargs):
            # FSDP2 passes its tensors by keyword (``reduce_scatter_single(output=..., input=...)``).
            t = args[_arg] if len(args) > _arg else kwargs.get(("output", "input")[_arg],
                                                                 kwargs.get(("output_tensor", "input_tensor")[_arg]))
            log.append((_kind, t.numel() * t.element_size()))
            return _fn(*args, **kwargs)

        setattr(dist, name, record)
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def ring_bytes(log: Sequence[tuple[str, int]], world: int) -> float:
    """Bytes one rank sends for the logged collectives under a ring algorithm (module docstring)."""
    share = (world - 1) / world
    return sum(2 * share * n if kind == "all_reduce" else share * n for kind, n in log)


def _measure_gaengine(cfg: MemoryConfig, stage: int, world: int, rank: int) -> dict[str, Any]:
    from gaengine import GradientAccumulator  # noqa: PLC0415

    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=cfg.accumulation_steps, max_grad_norm=1.0,
                              bucket_size_mb=cfg.bucket_size_mb, zero_stage=stage)
    g = torch.Generator().manual_seed(rank)
    log: list[tuple[str, int]] = []
    for window in range(2):
        with _wire_log(log) if window == 1 else contextlib.nullcontext():
            for _ in range(cfg.accumulation_steps):
                x = torch.randn(cfg.batch, cfg.width, generator=g).to(torch.bfloat16)
                acc.backward(model(x).float().square().mean())
            if window == 1:
                seen: set[int] = set()
                shard = getattr(acc.reducer, "grad_shard", None)
                row = {"params": _nbytes(list(model.parameters()), seen)}
                if shard is not None:  # stage 2: the fp32 sum is the shard, micro-batches stage in a ring
                    row["grad"] = _nbytes([shard], seen)
                    row["staging"] = _nbytes(acc.reducer.staging_buffers, seen)
                else:
                    row["grad"] = _nbytes([acc.main_grad.data], seen)
                    row["staging"] = 0
                row["masters"] = _nbytes([q for group in opt.param_groups for q in group["params"]], seen)
                row["optim"] = _nbytes(_state_tensors(opt), seen)
            acc.step()
    acc.close()
    return {**row, "wire": ring_bytes(log, world)}


def _measure_plain(cfg: MemoryConfig, world: int, rank: int, ddp: bool) -> dict[str, Any]:
    model = _model(cfg)
    params = list(model.parameters())
    log: list[tuple[str, int]] = []
    net: nn.Module = model
    if ddp:
        net = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)

        def counting_hook(state, bucket):
            log.append(("all_reduce", bucket.buffer().numel() * bucket.buffer().element_size()))
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        net.register_comm_hook(None, counting_hook)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    k = cfg.accumulation_steps
    for window in range(2):
        if window == 1:
            log.clear()
        for m in range(k):
            x = torch.randn(cfg.batch, cfg.width, generator=g).to(torch.bfloat16)
            sync = contextlib.nullcontext() if not ddp or m == k - 1 else net.no_sync()
            with sync:
                (net(x).float().square().mean() / k).backward()
        if window == 1:
            seen: set[int] = set()
            row = {"params": _nbytes(params, seen), "grad": _nbytes([p.grad for p in params], seen), "staging": 0,
                   "masters": 0, "optim": _nbytes(_state_tensors(opt), seen)}
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {**row, "wire": ring_bytes(log, world)}


FSDP2_RECIPES = {
    # key: (variant, gaengine accumulates, sync on the last micro-batch only, FSDP2's reduce_dtype)
    "fsdp2-every": ("FSDP2 sync every", False, False, torch.float32),
    "fsdp2-last-bf16": ("FSDP2 sync last, bf16 reduce", False, True, torch.bfloat16),
    "fsdp2-last-fp32": ("FSDP2 sync last, fp32 reduce", False, True, torch.float32),
    "gaengine-fsdp2-fp32": ("gaengine fsdp2, fp32 reduce", True, False, torch.float32),
    "gaengine-fsdp2-bf16": ("gaengine fsdp2, bf16 reduce", True, False, torch.bfloat16),
}
"""The FSDP2 rows (d > 1): FSDP2's usual recipe (fp32 sharded parameters, ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=...)``, ``fully_shard`` on each ``Linear`` then the root, ``torch.optim.AdamW`` over the DTensors);
FSDP2 alone syncing every micro-batch or only the last one (``set_requires_gradient_sync``), and gaengine's
``FullyShardedGrads`` (``gaengine.fsdp2``) on the same model."""


def fsdp2_formula(key: str, world: int, k: int) -> dict[str, Any]:
    """What an FSDP2 row should measure (``FSDP2_RECIPES``), per parameter per rank: ``grad_formula``/``grad_value``
    (the window's gradient at its largest: the fp32 shard 4/d when FSDP2 reduce-scatters every micro-batch, whether
    FSDP2 adds into ``.grad`` or gaengine into ``main_grad``; the whole model's unsharded gradient between the
    micro-batches of a sync-last window, 2 B in bf16 (``reduce_dtype`` equal to ``param_dtype``: autograd
    accumulates ``.grad`` of the unsharded bf16 parameters) or 4 B in fp32 (FSDP2's ``unsharded_accumulated_grad``));
    ``total_value`` (those plus the fp32 parameter shards 4/d and the AdamW moments 8/d); ``reduce_value`` (bytes
    each rank sends per window in reduce-scatters, ring: K or 1 of them of r (d-1)/d, r the ``reduce_dtype``'s
    bytes)."""
    _, _, last, reduce_dtype = FSDP2_RECIPES[key]
    r = torch.finfo(reduce_dtype).bits // 8
    grad_formula, grad_value = (("2", 2.0) if reduce_dtype == torch.bfloat16 else ("4", 4.0)) if last else \
        (f"4/{world}", 4.0 / world)
    share = (world - 1) / world
    reduce_formula = f"{r} x {world - 1}/{world}" if last else f"{k} x {r} x {world - 1}/{world}"
    return {"grad_formula": grad_formula, "grad_value": grad_value, "total_value": grad_value + 12.0 / world,
            "formula": f"4/{world} + {grad_formula} + 8/{world}", "reduce_formula": reduce_formula,
            "reduce_value": (1 if last else k) * r * share}


def _fsdp2_model(cfg: MemoryConfig, world: int, reduce_dtype: torch.dtype) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    model = _model(cfg).float()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _fsdp2_grads(model: nn.Module) -> list[torch.Tensor]:
    """The tensors that hold an FSDP2 model's gradient: each sharded parameter's ``.grad`` (its local shard), and,
    between the micro-batches of a sync-last window, the unsharded parameter's ``.grad`` and FSDP2's fp32
    ``unsharded_accumulated_grad`` (read from FSDP2's ``FSDPParam``, private attributes)."""
    from gaengine.fsdp2 import fsdp2_param_groups  # noqa: PLC0415

    held = []
    for group in fsdp2_param_groups(model):
        for fp in group.fsdp_params:
            if fp.sharded_param.grad is not None:
                held.append(fp.sharded_param.grad.to_local())
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                held.append(unsharded.grad)
            if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                held.append(fp.unsharded_accumulated_grad)
    return held


def _local(tensors) -> list[torch.Tensor]:
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _measure_fsdp2(cfg: MemoryConfig, key: str, world: int, rank: int) -> dict[str, Any]:
    """One ``FSDP2_RECIPES`` row on this rank: the columns at the high point of the second window (the gradient at
    its largest over the window's micro-batches, measured after each backward), and the collectives' bytes."""
    from gaengine import GradientAccumulator  # noqa: PLC0415

    _, through_gaengine, last, reduce_dtype = FSDP2_RECIPES[key]
    model = _fsdp2_model(cfg, world, reduce_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    k = cfg.accumulation_steps
    acc = GradientAccumulator(model, opt, accumulation_steps=k, max_grad_norm=1.0) if through_gaengine else None
    g = torch.Generator().manual_seed(rank)
    log: list[tuple[str, int]] = []
    for window in range(2):
        grad_bytes = 0
        with _wire_log(log) if window == 1 else contextlib.nullcontext():
            for m in range(k):
                x = torch.randn(cfg.batch, cfg.width, generator=g)
                if acc is not None:
                    acc.backward(model(x).float().square().mean())
                else:
                    if last:
                        model.set_requires_gradient_sync(m == k - 1)
                    (model(x).float().square().mean() / k).backward()
                held = [acc.main_grad.data] if acc is not None else _fsdp2_grads(model)
                grad_bytes = max(grad_bytes, _nbytes(held, set()))
            if window == 1:
                seen: set[int] = set()
                row = {"params": _nbytes(_local(model.parameters()), seen), "grad": grad_bytes, "staging": 0}
                row["masters"] = _nbytes(_local(q for group in opt.param_groups for q in group["params"]), seen)
                row["optim"] = _nbytes(_local(_state_tensors(opt)), seen)
            if acc is not None:
                acc.step()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
    if acc is not None:
        acc.close()
    share = (world - 1) / world
    return {**row, "wire": ring_bytes(log, world),
            "reduce_wire": sum(share * n for kind, n in log if kind == "reduce_scatter"),
            "gather_wire": sum(share * n for kind, n in log if kind == "all_gather")}


def _measure_all(rank: int, world: int, cfg: MemoryConfig) -> dict[str, dict]:
    """Every recipe's row on this rank (``bench_memory``)."""
    results = {}
    if world == 1:
        results["plain"] = _measure_plain(cfg, world, rank, ddp=False)
    else:
        results["ddp"] = _measure_plain(cfg, world, rank, ddp=True)
    for stage in MEMORY_STAGES:
        results[f"stage{stage}"] = _measure_gaengine(cfg, stage, world, rank)
    if world > 1:
        for key in FSDP2_RECIPES:
            results[key] = _measure_fsdp2(cfg, key, world, rank)
    return results


def _rank_main(rank: int, world: int, init_file: str, measure: Callable, args: tuple, out_dir: str) -> None:
    """One spawned rank of ``run_world``: one thread, a gloo group (several ranks), ``measure(rank, world, *args)``
    saved as ``rank{rank}.pt`` in ``out_dir``."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    try:
        torch.save(measure(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
        if world > 1:
            dist.barrier()  # no rank tears the group down while a peer's collectives are still in flight
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_world(name: str, measure: Callable, world: int, args: tuple, timeout_s: float = 600.0) -> list[dict]:
    """``measure(rank, world, *args)`` (a module-level function: the ranks are spawned) on ``world`` processes, one
    thread each, in one gloo group; returns what each returned, in rank order. ``RuntimeError`` naming benchmark
    ``name`` when a process fails or outlives ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix=f"gaengine-bench-{name}-") as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, world, os.path.join(tmp, "store"), measure, args, tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive or any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{name} benchmark on {world} ranks failed (exit codes "
                               f"{[p.exitcode for p in procs]}; see the ranks' tracebacks above)")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def _run_world(cfg: MemoryConfig, world: int) -> list[dict[str, dict]]:
    return run_world("memory", _measure_all, world, (cfg,))


def bench_memory(cfg: MemoryConfig, worlds: Sequence[int] = MEMORY_WORLD_SIZES,
                 progress: Callable[[str], None] = lambda s: None) -> tuple[list[dict], dict]:
    """Measure every recipe on every world size (module docstring). Returns ``(rows, info)``: one row per (recipe,
    d) with bytes per parameter per column (the largest over the ranks), ``total``, ``formula``/``formula_value``,
    ``wire`` (bytes per parameter per window and rank) and ``wire_vs_stage0``; info holds the parameter count."""
    numel = sum(p.numel() for p in _model(cfg).parameters())
    rows = []
    for world in worlds:
        progress(f"memory: {world} rank(s) ...")
        ranks = _run_world(cfg, world)
        stage0_wire = max(r["stage0"]["wire"] for r in ranks)
        for key in ranks[0]:
            if key in FSDP2_RECIPES:
                per = {c: max(r[key][c] for r in ranks) / numel for c in COLUMNS}
                rows.append({
                    "benchmark": "memory", "variant": FSDP2_RECIPES[key][0], "fsdp2": key,
                    "recipe": "gaengine" if FSDP2_RECIPES[key][1] else "fsdp2", "stage": None, "world": world,
                    **per, "total": sum(per.values()), **fsdp2_formula(key, world, cfg.accumulation_steps),
                    **{w: max(r[key][w] for r in ranks) / numel for w in ("wire", "reduce_wire", "gather_wire")},
                })
                continue
            recipe, stage = (key, None) if key in ("plain", "ddp") else ("gaengine", int(key[-1]))
            per = {c: max(r[key][c] for r in ranks) / numel for c in COLUMNS}
            slots, each = staging_bytes(cfg, world) if stage == 2 and world > 1 else (0, 0)
            expr, value = formula(recipe, stage, world, (slots, each / numel))
            wire = max(r[key]["wire"] for r in ranks)
            rows.append({
                "benchmark": "memory", "variant": {"plain": "plain", "ddp": "torch DDP"}.get(key, f"gaengine stage {stage}"),
                "recipe": recipe, "stage": stage, "world": world, **per, "total": sum(per.values()),
                "formula": expr, "formula_value": value, "wire": wire / numel,
                "wire_vs_stage0": None if stage0_wire == 0 else wire / stage0_wire,
            })
    return rows, {"numel": numel, "config": asdict(cfg)}


def print_tables(rows: Sequence[dict], info: dict) -> None:
    """Two tables of the same rows: the bytes per parameter per rank by what holds them, with their total and the
    formula's value; then the formula and the bytes each rank sends per window. Then the FSDP2 rows in a table of
    their own (``print_fsdp2_table``)."""
    fsdp2_rows = [r for r in rows if r.get("fsdp2")]
    rows = [r for r in rows if not r.get("fsdp2")]
    bytes_columns = [("variant", "recipe", "s"), ("world", "d", "d")] + [(c, c, ".3f") for c in COLUMNS] + [
        ("total", "total B/param", ".3f"), ("formula_value", "= formula", ".3f")]
    print_table(rows, bytes_columns, keep=2, title=(
        f"memory: bytes per parameter per rank at the high point of a window ({info['numel']:,} bf16 parameters, "
        "AdamW, fp32 masters for gaengine; largest over the ranks), measured from the allocated storages"))
    wire_columns = [("variant", "recipe", "s"), ("world", "d", "d"), ("formula", "formula", "s"),
                    ("wire", "wire B/param/window", ".3f"), ("wire_vs_stage0", "wire vs stage 0", ".3f")]
    print_table(rows, wire_columns, keep=2,
                title="memory: the formula of each row, and the bytes per parameter each rank sends per window "
                      "(ring algorithm)")
    print_note("memory: = formula (first table) is the value of the formula (second table) in B/param, what total "
               "B/param should be, padding to whole buckets aside.")
    if fsdp2_rows:
        print_fsdp2_table(fsdp2_rows, info)


def print_fsdp2_table(rows: Sequence[dict], info: dict) -> None:
    """The FSDP2 rows (``FSDP2_RECIPES``): gradient memory and total, per parameter per rank, with their formulas;
    the bytes each rank sends per window in reduce-scatters (with their formula) and in all-gathers."""
    columns = [("variant", "recipe", "s"), ("world", "d", "d"), ("grad", "grad B/param", ".3f"),
               ("grad_formula", "= formula", "s"), ("total", "total", ".3f"), ("total_value", "= formula", ".3f"),
               ("reduce_wire", "reduce-scatter B", ".3f"), ("reduce_formula", "= formula", "s"),
               ("gather_wire", "all-gather B", ".3f")]
    print_table(rows, columns, keep=2, title=(
        f"memory, FSDP2: bytes per parameter per rank ({info['numel']:,} fp32 parameters sharded, bf16 compute, "
        f"AdamW; K = {info['config']['accumulation_steps']}); wire: bytes per parameter each rank sends per window"))
    print_note("memory, FSDP2: grad = the window's gradient at its largest over the micro-batches; total = fp32 "
               "parameter shards (4/d) + grad + AdamW moments (8/d); all-gathers: bf16 parameters, forward and "
               "backward of every micro-batch (all recipes alike).")
