"""Ranks built with different settings stop at construction with gaengine's error on every rank (issue 31, F8, F9).

Before, an extra parameter, a bf16 model, another ``bucket_size_mb`` or ``zero_stage`` on one rank killed it with
SIGABRT inside gloo (``EnforceNotMet: Received data size doesn't match``) and left the other a raw "Connection reset
by peer"; another ``max_grad_norm`` trained the ranks apart silently. Now one ``all_gather_object`` at construction
compares them and every rank raises ``ValueError`` naming the setting and each rank's value. Two gloo ranks, one
launch for every case; a case with equal settings builds and trains one window on both.
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

# case -> (the setting the error must name, rank 1's difference)
CASES = {
    "extra_parameter": "parameters",
    "bf16_model": "parameters",
    "bucket_size_mb": "bucket_size_mb",
    "zero_stage": "zero_stage",
    "max_grad_norm": "max_grad_norm",
}


def _build(case: str, rank: int):
    torch.manual_seed(0)
    differs = rank == 1
    layers = [nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)]
    if differs and case == "extra_parameter":
        layers.append(nn.Linear(2, 2))
    model = nn.Sequential(*layers)
    if differs and case == "bf16_model":
        model = model.to(torch.bfloat16)
    options = dict(accumulation_steps=2, max_grad_norm=None, bucket_size_mb=25.0, zero_stage=0)
    if differs and case in ("bucket_size_mb", "zero_stage", "max_grad_norm"):
        options[case] = {"bucket_size_mb": 1.0, "zero_stage": 1, "max_grad_norm": 1e-3}[case]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, gaengine.GradientAccumulator(model, optimizer, backend="torch", **options)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    with torchrun_rank(rank, world, port):
        dist.init_process_group("gloo")
        lines = []
        for case in ["equal", *CASES]:
            try:
                model, acc = _build(case, rank)
            except ValueError as exc:
                lines.append(f"{case}\tValueError\t{exc}")
                continue
            for k in range(2):  # one window: the collectives agree
                x = torch.full((3, 4), float(rank + k))
                acc.backward(model(x.to(next(model.parameters()).dtype)).float().square().mean())
            acc.step()
            acc.close()
            lines.append(f"{case}\tbuilt\t")
        pathlib.Path(out, f"rank{rank}.txt").write_text("\n".join(lines))


def test_mismatched_ranks_raise_on_every_rank(tmp_path):
    codes = spawn_ranks(_rank, 2, (free_port(), str(tmp_path)), join_s=180)
    assert codes == [0, 0], f"exit codes {codes} (a negative one: killed by a signal)"
    for rank in range(2):
        rows = dict((line.split("\t")[0], line.split("\t")[1:])
                    for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines())
        assert rows["equal"][0] == "built"
        for case, setting in CASES.items():
            outcome, message = rows[case]
            assert outcome == "ValueError", f"rank {rank}, {case}: {outcome}"
            assert f"different {setting}" in message and "rank 0" in message and "rank 1" in message, message
