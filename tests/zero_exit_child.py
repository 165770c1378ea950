"""One rank of ``tests/test_zero_exit.py``: a training script on a 2-rank gloo group, ``zero_stage=1``, that ends
without ``acc.close()``. Run as ``python tests/zero_exit_child.py RANK INIT_FILE CHECKPOINT_DIR PATTERN``.

PATTERN:
    dcp      the reported one: a ``torch.distributed.checkpoint`` of ``{"model": ..., "acc": acc.state_dict()}``
             after each window (as ``GradientAccumulator.state_dict``'s docstring shows), then ``dist.barrier()``
             and ``dist.destroy_process_group()``.
    step     the script ends right after ``acc.step()``, leaving the process group alive as well (torch warns; the
             interpreter finalizes with gloo's worker threads running).
    overlap  the same with ``overlap_param_gather=True``: the parameter all-gathers are still in flight at the end.

The accumulator, model and optimizer are module globals, alive until the interpreter finalizes, as in a script.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import gaengine

WINDOWS, K = 2, 2


def main(rank: int, init_file: str, checkpoint_dir: str, pattern: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=K, zero_stage=1,
                                       bucket_size_mb=1e-3, overlap_param_gather=pattern == "overlap")
    g = torch.Generator().manual_seed(rank)
    for window in range(WINDOWS):
        for _ in range(K):
            acc.backward(model(torch.randn(8, 16, generator=g)).square().mean())
        acc.step()
        if pattern == "dcp":
            state = {"model": model.state_dict(), "acc": acc.state_dict()}
            dcp.save(state, checkpoint_id=f"{checkpoint_dir}/window{window}")
    if pattern == "dcp":
        dist.barrier()
        dist.destroy_process_group()
    return model, optimizer, acc


if __name__ == "__main__":
    SCRIPT_STATE = main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])  # no acc.close()
