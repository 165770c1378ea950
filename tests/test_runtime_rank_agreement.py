"""A setting changed at run time on one rank only is caught in the next window's stats all-reduce (issue 31, F9).

Before, ``acc.max_grad_norm = 1e-3`` on rank 1 and None on rank 0 trained on without an error, the ranks' parameters
9.1e-2 apart after 3 windows; another ``acc.accumulation_steps`` on one rank surfaced only as a count mismatch that
did not name it. Now the window's stats all-reduce (which runs anyway) carries every rank's settings, and every rank
raises ``ValueError`` naming the setting, before anything is applied: the ranks' parameters stay equal (and equal to
their values before the window). After setting the same value everywhere and ``zero_grad()``, training goes on.
Two gloo ranks, one launch for every case; the fused optimizer case reads the result one call late (no host read
in its ``step()``). (Parameters unfrozen on some ranks only: tests/test_joining_params.py.)
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gaengine
from tests.ranks import free_port, spawn_ranks, torchrun_rank

pytestmark = pytest.mark.multiproc

# case -> the setting the error must name
CASES = {"max_grad_norm": "max_grad_norm", "max_grad_norm_fused": "max_grad_norm",
         "accumulation_steps": "accumulation_steps"}


def _window(model, acc, rank: int, step: int):
    for k in range(acc.accumulation_steps):
        x = torch.full((3, 4), float(rank + k + step + 1))
        acc.backward(model(x).square().mean())
    return acc.step()


def _rank(rank: int, world: int, port: int, out: str) -> None:
    with torchrun_rank(rank, world, port):
        dist.init_process_group("gloo")
        lines = []
        for case in CASES:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=case.endswith("fused"))
            acc = gaengine.GradientAccumulator(model, optimizer, accumulation_steps=2, max_grad_norm=None,
                                               backend="torch")
            _window(model, acc, rank, 0)  # one window with equal settings
            before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
            if rank == 1:  # set at run time on one rank only
                if case.startswith("max_grad_norm"):
                    acc.max_grad_norm = 1e-3
                else:
                    acc.accumulation_steps = 3
            outcome = "none"
            try:
                _window(model, acc, rank, 1)
                _window(model, acc, rank, 2)  # the fused optimizer's step() reports it at the next call
            except ValueError as exc:
                outcome = f"ValueError\t{exc}"
            after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            unchanged = torch.equal(before, after)
            gathered = [torch.empty_like(after) for _ in range(world)]
            dist.all_gather(gathered, after)
            equal = torch.equal(gathered[0], gathered[1])
            # Going on: the same setting everywhere, the window dropped, the next window trains on both ranks alike.
            acc.max_grad_norm, acc.accumulation_steps = None, 2
            acc.zero_grad()
            result = _window(model, acc, rank, 3)
            again = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            dist.all_gather(gathered, again)
            went_on = (not bool(result.skipped) and torch.equal(gathered[0], gathered[1])
                       and not torch.equal(again, after))
            acc.close()
            lines.append(f"{case}\t{unchanged}\t{equal}\t{went_on}\t{outcome}")
        pathlib.Path(out, f"rank{rank}.txt").write_text("\n".join(lines))


def test_setting_changed_on_one_rank_raises_on_every_rank(tmp_path):
    codes = spawn_ranks(_rank, 2, (free_port(), str(tmp_path)), join_s=180)
    assert codes == [0, 0], f"exit codes {codes} (a negative one: killed by a signal)"
    for rank in range(2):
        rows = {line.split("\t")[0]: line.split("\t")[1:]
                for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()}
        for case, setting in CASES.items():
            unchanged, equal, went_on, outcome, *message = rows[case]
            assert outcome == "ValueError", f"rank {rank}, {case}: no error ({rows[case]})"
            assert f"different {setting}" in message[0], message[0]
            assert unchanged == "True", f"rank {rank}, {case}: the mismatched window was applied"
            assert equal == "True", f"rank {rank}, {case}: the ranks' parameters differ"
            assert went_on == "True", f"rank {rank}, {case}: training did not go on after the error"
