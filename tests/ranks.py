"""Real ranks for the multi-process tests: spawned processes joined against one deadline, a free TCP port, and the
environment torchrun gives each rank."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from tests import poison


def spawn_ranks(target, world: int, args: tuple = (), join_s: float = 120.0) -> list[int | None]:
    """Run ``target(rank, world, *args)`` in ``world`` spawned processes (a fresh interpreter each, as torchrun
    gives) and join them against one deadline of ``join_s`` seconds; a rank still alive then is killed. Returns the
    exit codes in rank order (a killed rank's is negative)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, world, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def torchrun_rank(rank: int, world: int, port: int):
    """Inside a spawned rank: the environment ``torchrun`` gives it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT on 127.0.0.1, OMP_NUM_THREADS=1) and the tests' NaN poison when asked
    (``tests.poison``). An exception is printed with its traceback before it propagates (the parent sees only the
    exit code); the process group, if one was made, is destroyed at the end."""
    poison.install_if_asked()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        yield
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
