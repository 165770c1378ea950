"""The memory table of ``gaengine bench`` (``gaengine.tools.bench.memory``): measured bytes per parameter per rank
of ZeRO stages 0/1/2, the plain recipe and torch DDP on 1, 2 and 4 gloo processes, against the formulas of the
issue (stage 1: 2 + 4 + 12/d, stage 2: 2 + 16/d plus the staging ring) and the bytes a ring algorithm sends."""

from __future__ import annotations

import pytest

from gaengine.window_end import WINDOW_SETTINGS
from gaengine.protocol import header_numel
from gaengine.tools.bench import memory
from gaengine.zero import STAGING_SLOTS

pytestmark = pytest.mark.multiproc

WORLDS = (1, 2, 4)
PAD = 0.005  # B/param: every flat buffer is padded to whole buckets (pad_unit(d) elements), under 0.1 % here


@pytest.fixture(scope="module")
def table():
    rows, info = memory.bench_memory(memory.QUICK, WORLDS)
    return {(row["variant"], row["world"]): row for row in rows}, info


def test_every_recipe_and_world_has_a_row(table):
    rows, info = table
    assert info["numel"] == 4 * (256 * 256 + 256)
    expected = {("plain", 1)} | {("torch DDP", d) for d in WORLDS[1:]} | {
        (f"gaengine stage {s}", d) for s in memory.MEMORY_STAGES for d in WORLDS} | {
        (v[0], d) for v in memory.FSDP2_RECIPES.values() for d in WORLDS[1:]}
    assert set(rows) == expected


def test_measured_bytes_match_the_formulas(table):
    rows, _ = table
    for (variant, d), row in rows.items():
        if row.get("fsdp2"):
            continue  # test_fsdp2_rows
        assert row["total"] == pytest.approx(sum(row[c] for c in memory.COLUMNS))
        assert abs(row["total"] - row["formula_value"]) <= PAD, (variant, d, row)


def test_sharded_parts_fall_as_one_over_d(table):
    """Masters (4 B) and AdamW moments (8 B) shard at stages 1 and 2, the fp32 gradient sum (4 B) at stage 2;
    the bf16 parameters (2 B) and stage 1's main_grad (4 B) do not. Stage 2's staging is a ring of
    ``gaengine.zero.STAGING_SLOTS`` buffers of one bucket: QUICK's 0.25 MiB buckets hold one ``Linear(256, 256)``
    each (its 256 x 256 fp32 weight fills the bucket, its bias joins it), 4 buckets for the 4 layers."""
    rows, _ = table
    layer = 256 * 256 + 256
    staging = min(STAGING_SLOTS, 4) * 4 * layer / (4 * layer)  # B/param: the ring over the model's 4 layers
    for stage in (1, 2):
        for d in WORLDS:
            row = rows[f"gaengine stage {stage}", d]
            assert abs(row["masters"] - 4 / d) <= PAD and abs(row["optim"] - 8 / d) <= PAD, row
            assert abs(row["params"] - 2) <= PAD, row
            if stage == 1 or d == 1:
                assert abs(row["grad"] - 4) <= PAD and row["staging"] == 0, row
            else:
                assert abs(row["grad"] - 4 / d) <= PAD and abs(row["staging"] - staging) <= PAD, row
                assert staging < 4  # below the whole fp32 main_grad
    for d in WORLDS:  # stage 0 and the baselines hold everything on every rank
        assert abs(rows["gaengine stage 0", d]["total"] - 18) <= PAD
        if d > 1:
            assert abs(rows["torch DDP", d]["total"] - 8) <= PAD
    assert abs(rows["plain", 1]["total"] - 8) <= PAD


def test_bytes_on_the_wire_per_window(table):
    """A ring all-reduce of n bytes sends 2 (d-1)/d n per rank, a reduce-scatter or all-gather (d-1)/d n: stage 0
    all-reduces the fp32 gradient once, stage 1 reduce-scatters it once and all-gathers the bf16 parameters,
    stage 2 reduce-scatters every one of the K micro-batches; DDP all-reduces its bf16 gradient once. (Stage 0 and
    1 add the window's few-float statistics and norm all-reduces.)"""
    rows, info = table
    k = memory.QUICK.accumulation_steps
    tensors = len(list(memory._model(memory.QUICK).parameters()))
    for d in WORLDS[1:]:
        share = (d - 1) / d
        # B/param of the window's few-float all-reduces, as ring all-reduces of fp64: the statistics
        # (gaengine.reduce.launch_window_stats: the loss and the items, a used flag per parameter tensor, a
        # micro-batch count per rank, 8 agreement terms for each setting the ranks must agree on), and at most as many
        # again for the norm's and the skip flag's (on 2 ranks: 36 floats of statistics); plus gaengine.protocol's
        # two headers a window (the window start's, carried by the parameter-change all-reduce, and the reductions').
        stats_floats = 2 + tensors + d + 8 * len(WINDOW_SETTINGS)
        header_floats = 2 * header_numel(d)
        small = 2 * share * 8 * (2 * stats_floats + header_floats) / info["numel"]
        assert rows["torch DDP", d]["wire"] == pytest.approx(2 * share * 2, abs=small)
        assert rows["gaengine stage 0", d]["wire"] == pytest.approx(2 * share * 4, abs=small)
        assert rows["gaengine stage 1", d]["wire"] == pytest.approx(share * (4 + 2), abs=small)
        assert rows["gaengine stage 2", d]["wire"] == pytest.approx(share * (4 * k + 2), abs=small)
        assert rows["gaengine stage 1", d]["wire_vs_stage0"] <= 1.0


def test_fsdp2_rows(table):
    """FSDP2's recipes and gaengine's FSDP2 mode, fp32 sharded parameters with bf16 compute, on 2 and 4 ranks:
    the window's gradient is the fp32 shard (4/d) when every micro-batch is reduce-scattered, by FSDP2 alone or
    accumulated by gaengine, and the whole unsharded model (2 B in bf16, 4 B in fp32) between the micro-batches of a
    sync-last window; reduce-scatters send K r (d-1)/d (once r (d-1)/d when syncing last), r the reduce_dtype's
    bytes: gaengine with a bf16 wire sends half of FSDP2's fp32 sync-every recipe and keeps the fp32 shard."""
    rows, _ = table
    k = memory.QUICK.accumulation_steps
    for d in WORLDS[1:]:
        share = (d - 1) / d
        want = {"FSDP2 sync every": (4 / d, k * 4), "FSDP2 sync last, bf16 reduce": (2, 2),
                "FSDP2 sync last, fp32 reduce": (4, 4), "gaengine fsdp2, fp32 reduce": (4 / d, k * 4),
                "gaengine fsdp2, bf16 reduce": (4 / d, k * 2)}
        for variant, (grad, reduce_bytes) in want.items():
            row = rows[variant, d]
            assert abs(row["grad"] - grad) <= PAD and abs(row["grad"] - row["grad_value"]) <= PAD, row
            assert abs(row["total"] - (grad + 12 / d)) <= PAD and row["masters"] == 0, row
            assert row["reduce_wire"] == pytest.approx(reduce_bytes * share) == pytest.approx(row["reduce_value"])
            assert row["gather_wire"] == pytest.approx(2 * k * 2 * share), row  # bf16, forward and backward
