"""Precision: the accumulated gradient of one window of K micro-batches on an FSDP2 model, every recipe against fp64.

    python benchmarks/fsdp2_accumulation_error.py [--world 2] [--k 32] [--out PATH]

The model: ``MODEL_LAYERS`` x (``Linear(WIDTH, WIDTH)``, tanh), ``fully_shard`` on each ``Linear`` then on the root,
on d gloo processes (CPU: the arithmetic is the same on any device, the order of the reductions aside). Each rank
runs K micro-batches of ``BATCH`` rows of its own inputs, loss ``mean(out^2)``, bf16 compute; the result of each
recipe is the window's normalized gradient (the mean over the K x d micro-batches), gathered whole.

The reference is exact for what the compute produced: the fp64 mean over ranks and micro-batches of each
micro-batch's bf16 gradient, computed in this process by the same model unsharded in bf16 (FSDP2's ``param_dtype``
cast of the same fp32 initialization; FSDP2 casts the inputs to it too) and summed in fp64. What a recipe adds to
it is its wire (``reduce_dtype``) and its accumulation; the compute's own rounding is common to all and left out.
Error: ``|g - g_ref|_2 / |g_ref|_2`` over all parameters.

Recipes (``RECIPES``), fp32 sharded parameters with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=r)``
unless named "bf16 params" (the model cast to bf16 before ``fully_shard``, no policy):

* gaengine fsdp2 (``GradientAccumulator(model, None, K)``, ``step()`` leaves the normalized gradient in ``.grad``),
  with r = fp32 and r = bf16: FSDP2 reduce-scatters every micro-batch in r, gaengine adds each fp32 shard into its
  fp32 ``main_grad``;
* FSDP2 sync every micro-batch (``(loss / K).backward()``, FSDP2 adds the reduced shard into ``.grad`` in the
  sharded parameters' dtype), r = fp32 and bf16;
* FSDP2 sync last (``set_requires_gradient_sync(k == K - 1)``): r = fp32 accumulates FSDP2's fp32
  ``unsharded_accumulated_grad``; r = bf16 (equal to ``param_dtype``, so FSDP2 clamps it to None) lets autograd add
  the unsharded bf16 gradients;
* bf16 params: FSDP2 sync every micro-batch (``.grad`` summed in bf16) against gaengine (fp32 ``main_grad``, fp32
  master shards).

The bound for a bf16 wire (``reduce_dtype=bf16``) with fp32 accumulation: the micro-batch gradients g_rk are
bf16 already, so the reduce-scatter's only roundings are its d - 1 bf16 additions per element and micro-batch,
each within half an ulp (2^-9) of a partial sum; the division by d and the cast to fp32 are exact, and the fp32
accumulation adds at most K 2^-24. Per element, to first order, the window's error is therefore at most
``(d - 1) 2^-9 sum_{r,k} |g_rk| / (d K)``, and its relative L2 error at most
``(d - 1) 2^-9 |sum_{r,k} |g_rk||_2 / |sum_{r,k} g_rk|_2`` (``bf16_wire_bound``, printed under the table: the
ratio of the norms is 1 when the micro-batch gradients agree in sign, larger when they cancel). It does not grow
with K. bf16 accumulation (FSDP2 sync last with a bf16 ``reduce_dtype``, or bf16 sharded parameters) rounds every
running sum instead, an error that grows with K.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WIDTH, MODEL_LAYERS, BATCH = 256, 4, 8
RECIPES = {
    # name: (gaengine accumulates, sync on the last micro-batch only, reduce_dtype, bf16 sharded parameters)
    "gaengine fsdp2, fp32 reduce": (True, False, torch.float32, False),
    "gaengine fsdp2, bf16 reduce": (True, False, torch.bfloat16, False),
    "FSDP2 sync every, fp32 reduce": (False, False, torch.float32, False),
    "FSDP2 sync every, bf16 reduce": (False, False, torch.bfloat16, False),
    "FSDP2 sync last, fp32 reduce": (False, True, torch.float32, False),
    "FSDP2 sync last, bf16 reduce": (False, True, torch.bfloat16, False),
    "gaengine fsdp2, bf16 params": (True, False, None, True),
    "FSDP2 sync every, bf16 params": (False, False, None, True),
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(MODEL_LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _inputs(rank: int, k: int) -> torch.Tensor:
    """(BATCH, WIDTH) fp32: rank ``rank``'s micro-batch ``k``."""
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + k))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _recipe(name: str, rank: int, world: int, k_steps: int) -> list[torch.Tensor]:
    """The window's normalized gradient of recipe ``name`` on this rank, as full fp64 tensors (a collective)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import gaengine

    through_gaengine, last, reduce_dtype, bf16_params = RECIPES[name]
    model = _model()
    kwargs = {}
    if bf16_params:
        model = model.to(torch.bfloat16)
    else:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=k_steps, max_grad_norm=None) \
        if through_gaengine else None
    for k in range(k_steps):
        x = _inputs(rank, k)
        x = x.to(torch.bfloat16) if bf16_params else x
        if acc is not None:
            acc.backward(_loss(model(x)))
        else:
            if last:
                model.set_requires_gradient_sync(k == k_steps - 1)
            (_loss(model(x)) / k_steps).backward()
    if acc is not None:
        acc.step()
    grads = [p.grad.full_tensor().double() for p in model.parameters()]
    if acc is not None:
        acc.close()
    return grads


def _worker(rank: int, world: int, k_steps: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        results = {name: _recipe(name, rank, world, k_steps) for name in RECIPES}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "grads.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def reference(world: int, k_steps: int) -> tuple[list[torch.Tensor], float]:
    """The fp64 mean over ranks and micro-batches of each micro-batch's bf16 gradient (module docstring), and the
    bf16-wire bound on the relative L2 error, ``(d - 1) 2^-9 |sum |g_rk||_2 / |sum g_rk|_2``."""
    model = _model().to(torch.bfloat16)
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    absolute = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for rank in range(world):
        for k in range(k_steps):
            model.zero_grad(set_to_none=True)
            _loss(model(_inputs(rank, k).to(torch.bfloat16))).backward()
            for t, a, p in zip(total, absolute, model.parameters()):
                t += p.grad.double()
                a += p.grad.double().abs()
    norm = lambda ts: sum(float(t.square().sum()) for t in ts) ** 0.5  # noqa: E731
    bound = (world - 1) * 2.0**-9 * norm(absolute) / norm(total)
    return [t / (world * k_steps) for t in total], bound


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a - b).square().sum()) for a, b in zip(got, want))
    den = sum(float(b.square().sum()) for b in want)
    return (num / den) ** 0.5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo processes (d)")
    parser.add_argument("--k", type=int, default=32, help="micro-batches per window (K)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gaengine-fsdp2-error-") as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, args.world, args.k, os.path.join(tmp, "store"), tmp))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1200)
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"ranks exited with {[p.exitcode for p in procs]}")
        results = torch.load(os.path.join(tmp, "grads.pt"))
    ref, bound = reference(args.world, args.k)
    numel = sum(t.numel() for t in ref)
    lines = [f"FSDP2, K = {args.k} micro-batches x d = {args.world} ranks, {numel:,} parameters, bf16 compute, "
             f"torch {torch.__version__}: relative L2 error of the window's gradient against the fp64 sum of the "
             "micro-batches' bf16 gradients",
             "", "| recipe | relative error |", "|---|---|"]
    lines += [f"| {name} | {rel_error(grads, ref):.2e} |" for name, grads in results.items()]
    lines += ["", f"bf16-wire bound with fp32 accumulation, (d - 1) 2^-9 |sum |g_rk|| / |sum g_rk|: {bound:.2e}"]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
