"""Exposed communication of the last micro-batch: gaengine's overlapped buckets vs after-backward vs torch DDP.

Two gloo ranks on CPU (one thread each), a 23.6 M-parameter fp32 MLP, K micro-batches per update. For each
variant we time, on rank 0, the window's last micro-batch: its backward plus the update (``acc.step()``, or
``clip_grad_norm_`` + ``optimizer.step()`` for DDP), and count the collective calls per update.

    compute   = the same last micro-batch with no communication (a one-rank group)
    serial    = gaengine with every all-reduce issued after backward      -> all-reduce time = serial - compute
                (``overlap_grad_reduce=False``)
    overlap   = gaengine, buckets launched during backward                -> exposed = overlap - compute
    ddp       = torch DDP + no_sync() for micro-batches 0..K-2            -> exposed = ddp - ddp_compute

exposed fraction = exposed communication / total all-reduce time (1.0: nothing hidden).
Bytes on the wire per update: 4 B per parameter (fp32), for every variant.

The ZeRO stages (``zero_stage=1``, ``2``) communicate by reduce-scatter (gradients) and all-gather (parameters,
waited in ``step()``: ``overlap_param_gather`` off), so their baseline is their own compute with those
collectives answered at once (``_no_communication``: ``torch.distributed``'s reduce-scatter and all-gather
replaced by a one-element all-reduce on a one-rank group, whose Work stands in for theirs; the shard's smaller
update is kept). Their two small all-reduces run for real in every variant: the window's stats (loss sum, item
count, used flags and each rank's micro-batch count, 2 + P + W fp64 values) and the gradient norm (2 fp32
values). Their values decide the step: answered at once, each rank would see only its own micro-batch count, the
accumulator's per-rank count check would skip the update and raise, and the norm would be the rank's shard's. So:

    zero_compute = stage s, reduce-scatters and all-gathers answered at once (1 real collective per update
                   by gaengine's count: the stats all-reduce)
    zero_serial  = stage s with each reduce-scatter issued after backward and waited at once
                   (``overlap_grad_reduce=False``)
                                                              -> reduce-scatter + all-gather time = serial - compute
    zero_overlap = stage s as it runs (buckets reduce-scattered during backward)  -> exposed = overlap - compute

Stage 1 is timed like stage 0 (the last micro-batch and the update: it reduce-scatters once per window); stage 2
reduce-scatters every micro-batch, so its whole window is timed (each micro-batch's reductions overlap the rest of
its backward and the next forward). The all-gather is waited in ``step()`` in both (exposed by design there).

Collectives per update are gaengine's counts (``acc.reducer.collectives_issued``: the buckets' launches and the
stats all-reduce; ``acc.sharding.gather.gathers_issued``: the all-gathers; the ZeRO norm's all-reduce is in
neither), and torch DDP's buckets (rebuilt after its first synced backward; one all-reduce each). Every gaengine
variant checks that no timed update was skipped, and the ZeRO compute rows that every reduce-scatter and
all-gather was answered at once (else the script stops: it would time something else).

``--quick``: a 128 x 4 MLP (66 k parameters), 4 rows per micro-batch, 0.1 MiB buckets (several per model, as in
the full run), 2 windows per variant: the whole script in seconds, for a check (its timings mean nothing).

Run: python benchmarks/bench_ddp.py [--windows N] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, time_rounds, write_json  # noqa: E402

import gaengine  # noqa: E402

K = 4
# The model and its buckets: width x depth Linear + Tanh layers, rows per micro-batch, bucket_size_mb (gaengine's
# buckets and DDP's bucket_cap_mb), windows per variant (the first is warm-up).
FULL = {"width": 1536, "depth": 10, "rows": 16, "bucket_mb": 25.0, "windows": 5}
QUICK = {"width": 128, "depth": 4, "rows": 4, "bucket_mb": 0.1, "windows": 2}


def _model(shape):
    torch.manual_seed(0)
    width = shape["width"]
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(shape["depth"])])


def _loss(model, k, shape):
    g = torch.Generator().manual_seed(k)
    return model(torch.randn(shape["rows"], shape["width"], generator=g)).pow(2).mean()


def _time_last_micro_batch(window, windows):
    """Median ms of the timed part of ``window = (setup, fn)`` over ``windows`` windows, the first one untimed (it
    learns the bucket order and warms up): setup runs the first K - 1 micro-batches and a barrier, fn the last
    micro-batch and the update."""
    return statistics.median(time_rounds({"window": window}, warmup=1, repeats=windows - 1).ms["window"])


def _gaengine_window(acc, model, shape, results):
    """``(setup, last)``: setup runs the first K - 1 micro-batches and a barrier, last the window's last micro-batch
    and the update, whose ``StepResult`` goes to ``results`` (read after the timing: ``_check_updates``)."""
    def setup():
        for k in range(K - 1):
            acc.backward(_loss(model, k, shape))
            acc.step()
        dist.barrier()

    def last():
        acc.backward(_loss(model, K - 1, shape))
        results.append(acc.step())
    return setup, last


def _zero_window(acc, model, stage, serial, shape, results):
    """Stage 1: ``(setup, last)`` as ``_gaengine_window``. Stage 2: the whole window is timed (setup is a barrier);
    ``serial`` waits for each micro-batch's reduce-scatters right after its backward."""
    if stage == 1:
        return _gaengine_window(acc, model, shape, results)

    def setup():
        dist.barrier()

    def window():
        for k in range(K):
            acc.backward(_loss(model, k, shape))
            if serial:
                acc.reducer.wait()
        results.append(acc.step())
    return setup, window


def _check_updates(name, results, windows):
    """Every window of ``name`` ended in an update that was applied (read after the timing: a host read)."""
    skipped = sum(r is None or bool(r.skipped) for r in results)
    if len(results) != windows or skipped:
        raise RuntimeError(f"bench_ddp: {name}: {skipped} of {len(results)} windows ended without an applied update "
                           f"(expected {windows} updates): the row would not time what it says")


def _gathers_issued(acc):
    """The parameters' all-gathers ``acc`` issued so far: its sharding strategy's (``acc.sharding``,
    ``gaengine.sharding``) ``gather`` (``gaengine.zero.ParamGather``)."""
    gather = getattr(acc.sharding, "gather", None)
    if gather is None:  # the strategy before ParamGather held its gathers in ``zero`` (gaengine.zero.ShardedState)
        gather = acc.sharding.zero
    return gather.gathers_issued


# torch.distributed's names for the bulk collectives of ZeRO (the older and the newer spelling of each).
_BULK_COLLECTIVES = ("reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor", "all_gather_single")


@contextlib.contextmanager
def _no_communication(solo):
    """Every reduce-scatter and all-gather issued through ``torch.distributed`` returns at once: a one-element
    all-reduce on the one-rank group ``solo`` stands in for its Work (buffers are left as they are; for timing only).
    All-reduces run as they are (module docstring). Yields a one-element list: the collectives answered so far."""
    tiny = torch.zeros(1)
    all_reduce = dist.all_reduce
    count = [0]

    def answered(*args, **kwargs):
        count[0] += 1
        return all_reduce(tiny, group=solo, async_op=True)

    names = [n for n in _BULK_COLLECTIVES if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, answered)
    try:
        yield count
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _ddp_window(ddp, opt, sync_last, shape):
    def setup():
        for k in range(K - 1):
            with ddp.no_sync():
                (_loss(ddp, k, shape) / K).backward()
        dist.barrier()

    def last():
        if sync_last:
            (_loss(ddp, K - 1, shape) / K).backward()
        else:
            with ddp.no_sync():
                (_loss(ddp, K - 1, shape) / K).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return setup, last


def _worker(rank, world, store, out, windows, shape):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    solos = [dist.new_group([r]) for r in range(world)]  # new_group is collective: every rank creates all
    solo = solos[rank]
    bucket_mb = shape["bucket_mb"]
    rows = {}

    def engine(name, group, overlap):
        model = _model(shape)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=1.0, process_group=group,
                                           overlap_grad_reduce=overlap, bucket_size_mb=bucket_mb)
        results = []
        ms = _time_last_micro_batch(_gaengine_window(acc, model, shape, results), windows)
        _check_updates(name, results, windows)
        calls = acc.reducer.collectives_issued / windows if acc.reducer is not None else 0
        buckets = len(acc.reducer.buckets) if acc.reducer is not None else 0
        acc.close()
        return ms, calls, buckets

    rows["compute"] = engine("stage 0, compute", solo, True)
    rows["serial"] = engine("stage 0, serial", None, False)
    rows["overlap"] = engine("stage 0, overlap", None, True)

    for stage in (1, 2):
        for variant in ("compute", "serial", "overlap"):
            name = f"stage {stage}, {variant}"
            model = _model(shape)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=1.0, zero_stage=stage,
                                               overlap_grad_reduce=variant != "serial", bucket_size_mb=bucket_mb)
            results = []
            with _no_communication(solo) if variant == "compute" else contextlib.nullcontext([0]) as answered:
                ms = _time_last_micro_batch(_zero_window(acc, model, stage, variant == "serial", shape, results),
                                            windows)
            _check_updates(name, results, windows)
            issued = acc.reducer.collectives_issued + _gathers_issued(acc)
            if variant == "compute" and answered[0] != issued - windows:  # all but the stats all-reduce, per window
                raise RuntimeError(f"bench_ddp: {name}: {answered[0]} collectives answered at once, but gaengine "
                                   f"issued {issued} reduce-scatters, all-gathers and stats all-reduces in {windows} "
                                   "windows: a reduce-scatter or all-gather went past _no_communication")
            rows[f"zero{stage}_{variant}"] = (ms, (issued - answered[0]) / windows)
            acc.close()

    model = _model(shape)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)
    ddp_compute = _time_last_micro_batch(_ddp_window(ddp, opt, False, shape), windows)
    ddp_ms = _time_last_micro_batch(_ddp_window(ddp, opt, True, shape), windows)
    # DDP starts with one bucket of every parameter and rebuilds them (bucket_cap_mb, in the order the gradients came)
    # in the forward after its first synced backward, the warm-up window's: the timed windows all-reduce those.
    log = ddp._get_ddp_logging_data()
    ddp_buckets = len((log.get("rebuilt_bucket_sizes") or log.get("bucket_sizes", "")).split(", "))
    rows["ddp"] = (ddp_ms, ddp_buckets, ddp_buckets, ddp_compute)
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=None,
                        help="windows per variant, the first one warm-up (default 5; 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a 66 k-parameter MLP, 0.1 MiB buckets, 2 windows: seconds, a check (timings are noise)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    if args.windows is not None:
        if args.windows < 2:
            parser.error(f"--windows must be >= 2 (the first window is warm-up), got {args.windows}")
        shape["windows"] = args.windows
    windows = shape.pop("windows")
    world = 2
    n_params = sum(p.numel() for p in _model(shape).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), out, windows, shape), nprocs=world,
                           start_method="spawn")
        r = torch.load(out)
    compute, serial, overlap = r["compute"][0], r["serial"][0], r["overlap"][0]
    ddp_ms, ddp_calls, _, ddp_compute = r["ddp"]
    comm = serial - compute
    ddp_comm = comm  # the same bytes over the same transport

    def frac(exposed, total):  # None (an empty cell) when the communication is not above this run's noise
        return exposed / total if total > 0 else None

    rows = [
        {"variant": "gaengine, no communication (1-rank group)", "ms": compute, "exposed_ms": 0.0,
         "exposed_frac": None, "calls": 0},
        {"variant": "gaengine, all-reduces after backward", "ms": serial, "exposed_ms": serial - compute,
         "exposed_frac": frac(serial - compute, comm), "calls": r["serial"][1]},
        {"variant": "gaengine, buckets overlapped with backward", "ms": overlap, "exposed_ms": overlap - compute,
         "exposed_frac": frac(overlap - compute, comm), "calls": r["overlap"][1]},
        {"variant": "torch DDP + no_sync(), no communication", "ms": ddp_compute, "exposed_ms": 0.0,
         "exposed_frac": None, "calls": 0},
        {"variant": "torch DDP + no_sync()", "ms": ddp_ms, "exposed_ms": ddp_ms - ddp_compute,
         "exposed_frac": frac(ddp_ms - ddp_compute, ddp_comm), "calls": ddp_calls},
    ]
    zero_comm = {}
    for stage in (1, 2):
        z_compute, z_serial, z_overlap = (r[f"zero{stage}_{v}"][0] for v in ("compute", "serial", "overlap"))
        zero_comm[stage] = z_comm = z_serial - z_compute
        timed = "last micro-batch" if stage == 1 else "whole window"
        rows += [
            {"variant": f"gaengine stage {stage} ({timed}), no reduce-scatter/all-gather",
             "ms": z_compute, "exposed_ms": 0.0, "exposed_frac": None, "calls": r[f"zero{stage}_compute"][1]},
            {"variant": f"gaengine stage {stage}, reduce-scatters after backward", "ms": z_serial,
             "exposed_ms": z_serial - z_compute, "exposed_frac": frac(z_serial - z_compute, z_comm),
             "calls": r[f"zero{stage}_serial"][1]},
            {"variant": f"gaengine stage {stage}, reduce-scatters overlapped with backward", "ms": z_overlap,
             "exposed_ms": z_overlap - z_compute, "exposed_frac": frac(z_overlap - z_compute, z_comm),
             "calls": r[f"zero{stage}_overlap"][1]},
        ]
    print(f"{world} gloo ranks on CPU, {n_params / 1e6:.1f} M fp32 parameters, K = {K}, "
          f"{n_params * 4 / 2**20:.{0 if n_params * 4 >= 2**24 else 2}f} MiB all-reduced per update; total all-reduce "
          f"time {comm:.1f} ms (gaengine's {r['overlap'][2]} buckets of {shape['bucket_mb']:g} MiB); ZeRO "
          f"reduce-scatter + all-gather time: stage 1 "
          f"{zero_comm[1]:.1f} ms, stage 2 {zero_comm[2]:.1f} ms per window (fp32 reduce-scatters, fp32 all-gather)")
    print_table(rows, [("variant", "variant", "s"), ("ms", "timed part + step, ms", ".1f"),
                       ("exposed_ms", "exposed comm, ms", ".1f"), ("exposed_frac", "exposed / total comm", ".2f"),
                       ("calls", "collectives per update", ".0f")])
    if comm <= 0 or min(zero_comm.values()) <= 0:
        print("exposed / total comm is left empty where serial - compute <= 0: the communication is not above this "
              "run's timing noise (more --windows, a larger model)")
    if args.json:
        write_json(args.json, "ddp", {"world": world, "params": n_params, "K": K, "windows": windows,
                                      "quick": args.quick, **shape}, rows, ["cpu"])


if __name__ == "__main__":
    main()
