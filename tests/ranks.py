"""Real ranks for the multi-process tests: processes started from a forkserver and joined against one deadline, a
free TCP port, and the environment torchrun gives each rank."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import poison
from tests.oracle_hooks import install_from_environment


# What the forkserver imports once, so that each rank starts as a fork of an interpreter that has imported torch
# and nothing else (about 0.05 s) instead of a fresh interpreter importing it (1.5 s of CPU per rank). torch._dynamo
# too: torch imports it the first time an optimizer is built (torch.optim.Optimizer.__init__), which nearly every
# rank does: 1.1 s of CPU per rank (of 1.35 s for a rank that imports gaengine and takes one accumulator window).
# It reads no environment variable the tests set, and starts no thread.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo"]


@functools.cache
def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _rank_entry(environ: dict, log_path: str, payload: bytes, rank: int, world: int) -> None:
    """A rank's first code: this test's environment (the forkserver keeps the one it started with), its stdout and
    stderr into ``log_path`` (the forkserver's are those of whichever test started it), then ``target`` unpickled
    and imported only now, under that environment."""
    os.environ.clear()
    os.environ.update(environ)
    install_from_environment()  # the hooks the test chose (tests/oracle_hooks.py use_hooks)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    target, args = pickle.loads(payload)
    try:
        target(rank, world, *args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def spawn_ranks(target, world: int, args: tuple = (), join_s: float = 120.0) -> list[int | None]:
    """Run ``target(rank, world, *args)`` in ``world`` processes and join them against one deadline of ``join_s``
    seconds; a rank still alive then is killed. Returns the exit codes in rank order (a killed rank's is negative).

    Each rank is forked from a forkserver that has imported torch's modules only (``FORKSERVER_PRELOAD``), with the
    caller's ``os.environ`` at this call; the target's module is imported in the rank, under that environment, as a fresh
    interpreter started by torchrun would. What a rank prints goes to a log that this function prints (to the
    calling test's captured output) for each rank that did not exit 0. The one launcher of the suite: every
    multi-process test starts its ranks here."""
    ctx = _context()
    payload = pickle.dumps((target, tuple(args)))
    with tempfile.TemporaryDirectory(prefix="gaengine-ranks-") as logs:
        paths = [os.path.join(logs, f"rank{rank}.log") for rank in range(world)]
        procs = [ctx.Process(target=_rank_entry, args=(dict(os.environ), paths[rank], payload, rank, world))
                 for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + join_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        for rank, (code, path) in enumerate(zip(codes, paths)):
            if code != 0 and os.path.exists(path):
                with open(path, errors="replace") as f:
                    print(f"---- rank {rank} of {world} (exit code {code}):\n{f.read()[-20000:]}")
    return codes


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


def _scenario_rank(rank, world, init_file, scenario, out, timeout_s, abandons_group):
    """One rank of ``launch_scenario``: ``scenario(rank, world, out)`` in a gloo group; its result saved for the
    test to load."""
    poison.install_if_asked()  # NaN-filled torch.empty, as in the parent test (tests/poison.py)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = scenario(rank, world, out)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        if abandons_group:
            # A gloo group whose peer is gone cannot be torn down cleanly (its threads abort at exit).
            sys.stdout.flush()
            os._exit(0)
        dist.barrier()  # no rank tears the group down while a peer's collectives are still in flight
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if not abandons_group:
            dist.destroy_process_group()


def launch_scenario(tmp_path, world: int, scenario, timeout_s: float = 60, join_s: float = 120,
                    abandons_group: bool = False) -> tuple[list[int | None], list]:
    """``scenario`` (a picklable callable ``(rank, world, out) -> result``, ``out`` the directory ``tmp_path``) on
    ``world`` gloo ranks started by ``spawn_ranks``, its collectives timing out after ``timeout_s``: their exit
    codes and the results they saved, in rank order (None for a rank that saved none). Fails the test when a rank
    hung (killed after ``join_s``). ``abandons_group``: a rank of the scenario exits on purpose mid-run, so the
    others leave the group without the closing barrier and teardown."""
    codes = spawn_ranks(_scenario_rank, world, (str(tmp_path / "store"), scenario, str(tmp_path), timeout_s,
                                                abandons_group), join_s=join_s)
    assert -signal.SIGKILL not in codes, f"{scenario}: rank(s) hung (killed after {join_s} s): exit codes {codes}"
    return codes, [torch.load(tmp_path / f"rank{r}.pt") if (tmp_path / f"rank{r}.pt").exists()
                   else None for r in range(world)]
