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
waited in ``step()``: ``overlap_param_gather`` off), so their baseline is their own compute with every collective
answered at once (``no communication``: the collectives of ``torch.distributed`` replaced by a one-element
all-reduce on a one-rank group, whose Work stands in for theirs; the shard's smaller update is kept):

    zero_compute = stage s with no communication
    zero_serial  = stage s with each reduce-scatter issued after backward and waited at once
                   (``overlap_grad_reduce=False``)
                                                              -> reduce-scatter + all-gather time = serial - compute
    zero_overlap = stage s as it runs (buckets reduce-scattered during backward)  -> exposed = overlap - compute

Stage 1 is timed like stage 0 (the last micro-batch and the update: it reduce-scatters once per window); stage 2
reduce-scatters every micro-batch, so its whole window is timed (each micro-batch's reductions overlap the rest of
its backward and the next forward). The all-gather is waited in ``step()`` in both (exposed by design there).

Run: python benchmarks/bench_ddp.py [--json PATH]
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

WIDTH, DEPTH, K, ROWS = 1536, 10, 4, 16


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)])


def _loss(model, k):
    g = torch.Generator().manual_seed(k)
    return model(torch.randn(ROWS, WIDTH, generator=g)).pow(2).mean()


def _time_last_micro_batch(window, windows):
    """Median ms of the timed part of ``window = (setup, fn)`` over ``windows`` windows, the first one untimed (it
    learns the bucket order and warms up): setup runs the first K - 1 micro-batches and a barrier, fn the last
    micro-batch and the update."""
    return statistics.median(time_rounds({"window": window}, warmup=1, repeats=windows - 1).ms["window"])


def _gaengine_window(acc, model):
    def setup():
        for k in range(K - 1):
            acc.backward(_loss(model, k))
            acc.step()
        dist.barrier()

    def last():
        acc.backward(_loss(model, K - 1))
        acc.step()
    return setup, last


def _zero_window(acc, model, stage, serial):
    """Stage 1: ``(setup, last)`` as ``_gaengine_window``. Stage 2: the whole window is timed (setup is a barrier);
    ``serial`` waits for each micro-batch's reduce-scatters right after its backward."""
    if stage == 1:
        return _gaengine_window(acc, model)

    def setup():
        dist.barrier()

    def window():
        for k in range(K):
            acc.backward(_loss(model, k))
            if serial:
                acc.reducer.wait()
        acc.step()
    return setup, window


@contextlib.contextmanager
def _no_communication(solo):
    """Every collective issued through ``torch.distributed`` returns at once: a one-element all-reduce on the
    one-rank group ``solo`` stands in for its Work (buffers are left as they are; for timing only)."""
    tiny = torch.zeros(1)
    all_reduce = dist.all_reduce

    def answered(*args, **kwargs):
        return all_reduce(tiny, group=solo, async_op=True)

    names = [n for n in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
                         "all_gather_single") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, answered)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _ddp_window(ddp, opt, sync_last):
    def setup():
        for k in range(K - 1):
            with ddp.no_sync():
                (_loss(ddp, k) / K).backward()
        dist.barrier()

    def last():
        if sync_last:
            (_loss(ddp, K - 1) / K).backward()
        else:
            with ddp.no_sync():
                (_loss(ddp, K - 1) / K).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return setup, last


def _worker(rank, world, store, out, windows):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    solos = [dist.new_group([r]) for r in range(world)]  # new_group is collective: every rank creates all
    solo = solos[rank]
    rows = {}

    def engine(group, overlap):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=1.0, process_group=group,
                                           overlap_grad_reduce=overlap)
        ms = _time_last_micro_batch(_gaengine_window(acc, model), windows)
        calls = acc.reducer.collectives_issued / windows if acc.reducer is not None else 0
        buckets = len(acc.reducer.buckets) if acc.reducer is not None else 0
        acc.close()
        return ms, calls, buckets

    rows["compute"] = engine(solo, True)
    rows["serial"] = engine(None, False)
    rows["overlap"] = engine(None, True)

    for stage in (1, 2):
        for variant in ("compute", "serial", "overlap"):
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=1.0, zero_stage=stage,
                                               overlap_grad_reduce=variant != "serial")
            with _no_communication(solo) if variant == "compute" else contextlib.nullcontext():
                ms = _time_last_micro_batch(_zero_window(acc, model, stage, variant == "serial"), windows)
            calls = (acc.reducer.collectives_issued + acc._zero.gathers_issued) / windows
            rows[f"zero{stage}_{variant}"] = (ms, calls)
            acc.close()

    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)
    ddp_compute = _time_last_micro_batch(_ddp_window(ddp, opt, sync_last=False), windows)
    ddp_ms = _time_last_micro_batch(_ddp_window(ddp, opt, sync_last=True), windows)
    ddp_buckets = len(ddp._get_ddp_logging_data().get("bucket_sizes", "").split(", "))
    rows["ddp"] = (ddp_ms, ddp_buckets, ddp_buckets, ddp_compute)
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (the first is warm-up)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    world = 2
    n_params = sum(p.numel() for p in _model().parameters())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), out, args.windows), nprocs=world,
                           start_method="spawn")
        r = torch.load(out)
    compute, serial, overlap = r["compute"][0], r["serial"][0], r["overlap"][0]
    ddp_ms, ddp_calls, _, ddp_compute = r["ddp"]
    comm = max(serial - compute, 1e-9)
    ddp_comm = comm  # the same bytes over the same transport
    rows = [
        {"variant": "gaengine, no communication (1-rank group)", "ms": compute, "exposed_ms": 0.0,
         "exposed_frac": None, "calls": 0},
        {"variant": "gaengine, all-reduces after backward", "ms": serial, "exposed_ms": serial - compute,
         "exposed_frac": (serial - compute) / comm, "calls": r["serial"][1]},
        {"variant": "gaengine, buckets overlapped with backward", "ms": overlap, "exposed_ms": overlap - compute,
         "exposed_frac": (overlap - compute) / comm, "calls": r["overlap"][1]},
        {"variant": "torch DDP + no_sync(), no communication", "ms": ddp_compute, "exposed_ms": 0.0,
         "exposed_frac": None, "calls": 0},
        {"variant": "torch DDP + no_sync()", "ms": ddp_ms, "exposed_ms": ddp_ms - ddp_compute,
         "exposed_frac": (ddp_ms - ddp_compute) / ddp_comm, "calls": ddp_calls},
    ]
    zero_comm = {}
    for stage in (1, 2):
        z_compute, z_serial, z_overlap = (r[f"zero{stage}_{v}"][0] for v in ("compute", "serial", "overlap"))
        zero_comm[stage] = z_comm = max(z_serial - z_compute, 1e-9)
        timed = "last micro-batch" if stage == 1 else "whole window"
        rows += [
            {"variant": f"gaengine stage {stage} ({timed}), no communication", "ms": z_compute, "exposed_ms": 0.0,
             "exposed_frac": None, "calls": 0},
            {"variant": f"gaengine stage {stage}, reduce-scatters after backward", "ms": z_serial,
             "exposed_ms": z_serial - z_compute, "exposed_frac": (z_serial - z_compute) / z_comm,
             "calls": r[f"zero{stage}_serial"][1]},
            {"variant": f"gaengine stage {stage}, reduce-scatters overlapped with backward", "ms": z_overlap,
             "exposed_ms": z_overlap - z_compute, "exposed_frac": (z_overlap - z_compute) / z_comm,
             "calls": r[f"zero{stage}_overlap"][1]},
        ]
    print(f"{world} gloo ranks on CPU, {n_params / 1e6:.1f} M fp32 parameters, K = {K}, "
          f"{n_params * 4 / 2**20:.0f} MiB all-reduced per update; total all-reduce time {comm:.1f} ms "
          f"(gaengine's {r['overlap'][2]} buckets of 25 MiB); ZeRO reduce-scatter + all-gather time: stage 1 "
          f"{zero_comm[1]:.1f} ms, stage 2 {zero_comm[2]:.1f} ms per window (fp32 reduce-scatters, fp32 all-gather)")
    print_table(rows, [("variant", "variant", "s"), ("ms", "timed part + step, ms", ".1f"),
                       ("exposed_ms", "exposed comm, ms", ".1f"), ("exposed_frac", "exposed / total comm", ".2f"),
                       ("calls", "collectives per update", ".0f")])
    if args.json:
        write_json(args.json, "ddp", {"world": world, "params": n_params, "K": K}, rows, ["cpu"])


if __name__ == "__main__":
    main()
