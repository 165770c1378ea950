"""The Muon + AdamW rows of ``gaengine bench`` (``gaengine.tools.bench.optimizers``): at ``zero_stage`` 1 and 2 each
rank holds about 1/d of the replicated run's optimizer state and masters (issue 44: within 10 % on a model of at
least 8 matrices, for d = 2 and 4), measured from the tensors the optimizers hold, against the bytes the recipe
needs computed here from the model's shapes."""

from __future__ import annotations

import pytest
import torch

from gaengine.tools.bench import memory, optimizers

pytestmark = pytest.mark.multiproc

WORLDS = (2, 4)


@pytest.fixture(scope="module")
def table():
    rows, info = optimizers.bench_optimizers(optimizers.QUICK, WORLDS)
    return {(row["stage"], row["world"]): row for row in rows}, info


def _replicated_bytes_per_param() -> tuple[float, float]:
    """(masters, optimizer state) in B/param of the replicated run, from the shapes: every bf16 parameter has an
    fp32 master (4 B); Muon keeps one fp32 momentum buffer per matrix element, AdamW two fp32 moments per element
    (and a 0-d step per tensor)."""
    model = memory._model(optimizers.QUICK.model)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    matrices = sum(p.numel() for p in params if p.ndim == 2)
    others = [p for p in params if p.ndim != 2]
    optim = 4 * matrices + 8 * sum(p.numel() for p in others) + 4 * len(others)
    return 4.0, optim / numel


def test_every_stage_and_world_has_a_row(table):
    rows, info = table
    assert set(rows) == {(s, d) for s in optimizers.STAGES for d in WORLDS}
    assert info["config"]["model"]["layers"] >= 8


def test_replicated_rows_hold_the_whole_state(table):
    rows, _ = table
    masters, optim = _replicated_bytes_per_param()
    for d in WORLDS:
        row = rows[0, d]
        assert row["masters"] == pytest.approx(masters, rel=1e-3), row
        assert row["optim"] == pytest.approx(optim, rel=1e-3), row
        assert row["step_ms"] > 0 and row["wire"] > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_stages_hold_one_over_d_of_the_state_and_masters(table, stage):
    """Optimizer state plus masters per rank within 10 % of 1/d of the replicated run's (the largest rank)."""
    rows, _ = table
    masters, optim = _replicated_bytes_per_param()
    for d in WORLDS:
        row = rows[stage, d]
        assert not row.get("refused"), row.get("refused")
        held = row["masters"] + row["optim"]
        assert abs(held * d / (masters + optim) - 1) <= 0.10, (d, row)
        assert row["vs_replicated_times_d"] == pytest.approx(held * d / (masters + optim), rel=1e-3)
        torch.testing.assert_close(row["vs_replicated"] * d, row["vs_replicated_times_d"])
