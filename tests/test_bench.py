"""``gaengine bench --quick`` on CPU: a table per benchmark with the columns it has, a results JSON with the
required keys, a PNG; the e2e facts that do not depend on timing (the same first loss for every variant, exact
gradient + optimizer bytes); the host benchmark's rows and fields (``--only host``); how a ratio and its spread
are summarized and when it is called noise; no profiler log on stderr. Timings themselves are never asserted."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re

import pytest
import torch

from gaengine.tools import bench
from gaengine.tools.bench import fusion as bench_fusion
from tests.tolerances import dot_rtol, gamma


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gaengine")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


_THREADS = torch.get_num_threads()


# The quick run's memory table runs gloo ranks as processes, its e2e memory a fresh process per variant: the tests
# that read it are multi-process tests (``make test`` names them before they start, tests/conftest.py).
multiproc = pytest.mark.multiproc


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # One thread: on a small shared CI machine, two OpenMP threads of tiny ops wait on each other for ages.
    args = _parse(["bench", "--device", "cpu", "--quick", "--threads", "1", "--json", str(out / "r.json"),
                   "--plot", str(out / "r.png")])
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = args.func(args)
    return rc, stdout.getvalue(), out


def test_parser_defaults_and_choices():
    args = _parse(["bench"])
    assert args.func is bench.run
    assert (args.device, args.only, args.quick, args.threads, args.json, args.plot) == (None, None, False, None,
                                                                                        None, None)
    assert _parse(["bench", "--only", "scale", "e2e"]).only == ["scale", "e2e"]
    assert _parse(["bench", "--only", "host"]).only == ["host"]
    assert _parse(["bench", "--host-params", "8", "16"]).host_params == [8, 16]
    assert "host" in bench.BENCHMARKS
    with pytest.raises(SystemExit):
        _parse(["bench", "--only", "nope"])


def _paragraphs(text: str) -> list[str]:
    """The printed lines with each wrapped line joined to the one it continues (indented by two more spaces)."""
    out: list[str] = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if out and out[-1].strip() and line.strip() and not line.startswith("|") and not out[-1].startswith("|") \
                and indent >= len(out[-1]) - len(out[-1].lstrip(" ")) + 2:
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    return out


def _note(text: str, start: str) -> str:
    """The (wrapped) line of ``text`` that starts with ``start``, joined."""
    return next(line for line in _paragraphs(text) if line.startswith(start))


def _tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header cells, body rows' cells)`` of every Markdown table in ``text``; the title is the (wrapped)
    line just above the header. A continuation row (its first cell's text indented, or empty: a wrapped cell) is
    joined to its row; a table titled ``... (continued)`` is joined to the one before it (its leading columns,
    the ones both share, name the same rows)."""
    lines = _paragraphs(text)
    tables = []
    for i, line in enumerate(lines):
        if line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|--"):
            header = [c.strip() for c in line.strip("|").split("|")]
            body: list[list[str]] = []
            for row in lines[i + 2:]:
                if not row.startswith("| "):
                    break
                raw = row[1:-1].split("|")
                cells = [c.strip() for c in raw]
                if body and raw[0][1:2] == " ":  # a continuation row
                    body[-1] = [f"{a} {b}".strip() for a, b in zip(body[-1], cells)]
                else:
                    body.append(cells)
            title = lines[i - 1]
            if title.endswith(" (continued)") and tables:
                first, head, rows = tables[-1]
                keep = next(k for k in range(len(header)) if k == len(head) or header[k] != head[k])
                tables[-1] = (first, head + header[keep:], [a + b[keep:] for a, b in zip(rows, body)])
            else:
                tables.append((title, header, body))
    return tables


KERNEL_HEADER = ["variant", "ms", "GB/s", "% of copy", "vs torch [p25-p75]"]
FUSION_HEADER = ["variant", "ms/backward", "rel. error vs fp64", "vs plain [p25-p75]"]


def _fused_error_bound(tokens: int, calls: int) -> float:
    """The fused window sum of ``calls`` backward passes of the same ``tokens``-row dY^T X (exact bf16 products in
    fp32) against fp64, relative to its largest element: one GEMM's ``dot_rtol(tokens)`` with the random-sign
    condition ``sqrt(tokens)``, and the ``calls`` additions of that same value, correlated roundings, so the worst
    case ``gamma(calls)`` (the probabilistic model does not hold for a constant added repeatedly)."""
    return dot_rtol(tokens) * math.sqrt(tokens) + gamma(calls)


def test_fusion_rows_time_the_three_backwards_and_their_errors():
    """The fusion benchmark on a small bf16 Linear: a row per variant (the plain recipe the baseline), and the errors
    it reports against fp64 tell the paths apart as tests/test_fusion.py measures them: the fused sum within fp32
    rounding (``_fused_error_bound``), the hooks' at least 50x further (bf16 dW), the plain recipe's bf16 .grad
    further still."""
    rows, info = bench_fusion.bench_fusion(torch.device("cpu"), bench_fusion.FusionConfig(48, 16), warmup=1,
                                           repeats=3)
    assert [r["variant"] for r in rows] == list(bench_fusion.VARIANTS) and info["skipped"] is None
    assert rows[0]["ratio_baseline"] and all(r["backward_passes"] == 4 and r["ms"] > 0 for r in rows)
    error = {r["variant"]: r["rel_error"] for r in rows}
    bound = _fused_error_bound(16, rows[0]["backward_passes"])
    assert error["fused"] <= bound and error["hooks"] >= 50 * error["fused"], (error, bound)
    assert error["plain"] >= error["hooks"], error


@multiproc
def test_quick_prints_a_table_per_benchmark(quick_run):
    rc, text, out = quick_run
    assert rc == 0
    assert torch.get_num_threads() == _THREADS  # --threads holds for the run only
    valid = {r["variant"]: r["valid"] for r in json.loads((out / "r.json").read_text())["results"] if "valid" in r}
    tables = _tables(text)
    titles = [title for title, _, _ in tables]
    assert len(tables) == 12, titles  # three kernels, host (2), fusion, e2e (2), memory (2), FSDP2 memory, optimizers
    assert titles[-1].startswith("optimizers: Muon (2-D weights) + AdamW (biases)")
    for (title, header, body), name in zip(tables[:3], ("accumulate bf16->fp32", "l2norm_sq fp32", "scale_ fp32")):
        assert title.startswith(f"{name}: 1,048,576 elements, ") and title.endswith(" B/element")
        assert header == KERNEL_HEADER
        # the baseline's ratio, unless its figure is over the bound (plausible.py): then none is printed
        assert body[0][0].startswith("torch:") and body[0][-1] == ("1 (baseline)" if valid[body[0][0]] else "")
        assert all(len(row) == len(header) for row in body)
    assert "gaengine cpu: accumulate_bucket_ (16 grads), noise scale on" in [row[0] for row in tables[0][2]]
    title, header, body = tables[3]
    assert title.startswith("host: ") and header[:3] == ["dtype", "P", "variant"]
    assert len(body) == 2 * 3 * 2  # dtypes x P (quick) x variants
    title, header, body = tables[4]
    assert title.startswith("host per parameter: ") and header == ["dtype", "P", "variant", "us/param/mb",
                                                                    "added us/param/mb"]
    title, header, body = tables[5]
    assert title.startswith("fusion: one bf16 Linear(128, 128), 64 tokens") and header == FUSION_HEADER
    assert " ".join(row[0].strip() for row in body if row[0].strip()) == " ".join(bench_fusion.VARIANTS.values())
    title, header, body = tables[6]
    assert title.startswith("e2e: ") and header == ["variant", "ms/update", "tokens/s", "vs plain [p25-p75]"]
    assert [row[0] for row in body] == list(bench.E2E_VARIANTS)
    # The copy the kernels are measured against.
    assert "% of copy = GB/s / the GB/s of fp32 dst.copy_(src) timed in the same rounds" in _note(text, "kernels: ms")
    for label in bench.E2E_VARIANTS.values():  # the legend under the e2e tables
        assert label in text
    title, header, body = tables[7]
    assert title.startswith("e2e memory: ") and [row[0] for row in body] == list(bench.E2E_VARIANTS)
    # Every memory column of the e2e tables is explained under them, and nothing they lack is.
    note = _note(text, "e2e memory: peak = ")
    for column in ("peak = ", "peak delta = ", "peak live = ", "state = ", "state B/param = "):
        assert column in note, column
    assert header == ["variant", "peak MiB", "peak delta MiB", "peak live MiB", "state MiB", "state B/param"]
    title, header, body = tables[8]  # the memory table (tests/test_bench_memory.py checks its numbers)
    assert title.startswith("memory: bytes per parameter per rank") and header[:2] == ["recipe", "d"]
    assert [(row[0], row[1]) for row in body][:2] == [("plain", "1"), ("gaengine stage 0", "1")]
    title, header, body = tables[9]
    assert title.startswith("memory: the formula") and header == ["recipe", "d", "formula", "wire B/param/window",
                                                                  "wire vs stage 0"]
    assert [(row[0], row[1]) for row in body] == [(row[0], row[1]) for row in tables[8][2]]
    title, header, body = tables[10]  # FSDP2's recipes and gaengine's FSDP2 mode (tests/test_bench_memory.py)
    assert "FSDP2" in title and {row[1] for row in body} <= {"2", "4"} and body, (title, header)


@multiproc
def test_quick_lines_fit_100_columns(quick_run, host_run):
    """Every line ``gaengine bench --quick`` prints, tables and notes, fits in 100 columns (issue 21)."""
    for text in (quick_run[1], host_run[1]):
        wide = [line for line in text.splitlines() if len(line) > 100]
        assert not wide, "\n".join(wide)


@multiproc
def test_percent_of_copy_above_100_says_why(quick_run):
    """A kernel row above 100 % of the copy is explained under the tables; none above it, no such note."""
    _, text, out = quick_run
    rows = [r for r in json.loads((out / "r.json").read_text())["results"] if "pct_of_copy" in r]
    above = [r for r in rows if r["valid"] and r["pct_of_copy"] > 100]  # over the bound: invalid, said apart
    assert ("% of copy above 100" in text) == bool(above)
    if above:
        note = _note(text, "% of copy above 100")
        assert f"({len(above)} of {len(rows)} rows)" in note and "cache" in note and "write-allocate" in note


def test_print_table_wraps_then_splits_a_wide_table(capsys):
    """A too-wide table: the ``wrap`` column's text wraps onto continuation rows; what still does not fit goes to
    a ``(continued)`` table that repeats the ``keep`` columns; every line within the width."""
    rows = [{"name": "a long variant label " * 3, "x": 1.0, "note": "short"},
            {"name": "b", "x": 22.5, "note": "n" * 25}]
    columns = [("name", "variant", "s"), ("x", "x", ".1f"), ("note", "note", "s")]
    bench.print_table(rows, columns, "t: wide", width=60, wrap=("name",))
    text = capsys.readouterr().out
    assert all(len(line) <= 60 for line in text.splitlines()), text
    assert "t (continued)" in text
    [(title, header, body)] = _tables(text)
    assert (title, header) == ("t: wide", ["variant", "x", "note"])
    assert body == [[("a long variant label " * 3).strip(), "1.0", "short"], ["b", "22.5", "n" * 25]]
    bench.print_table(rows[1:], columns, "t: narrow")  # fits: one table, as before
    assert capsys.readouterr().out.splitlines()[1:] == ["t: narrow", "| variant | x    | note                      |",
                                                        "|---------|------|---------------------------|",
                                                        "| b       | 22.5 | nnnnnnnnnnnnnnnnnnnnnnnnn |"]


@multiproc
def test_quick_ratios_say_when_they_are_noise(quick_run):
    """Every printed ratio is a figure with its spread, the baseline, or marked as noise, as its JSON row says."""
    _, text, out = quick_run
    rows = json.loads((out / "r.json").read_text())["results"]
    cells = [row[-1] for _, header, body in _tables(text) if header[0] not in ("dtype", "recipe")
             and header[-1].startswith("vs ") for row in body]
    timed = [r for r in rows if not r["benchmark"].startswith(("host", "memory", "optimizers"))]  # bytes, no ratios
    assert len(cells) == len(timed)
    for cell, r in zip(cells, timed):
        assert cell == bench.ratio_text(r)
        if r.get("valid") is False:  # an impossible figure (gaengine.tools.bench.plausible): no ratio printed
            assert cell == "" and f"INVALID MEASUREMENT, not a result: {r['variant'][:20]}" in " ".join(text.split())
        elif r["ratio_baseline"]:
            assert cell == "1 (baseline)"
        elif r["ratio_noise"]:
            assert "noise" in cell
        else:
            assert re.fullmatch(r"\d+\.\d\dx \[\d+\.\d\d-\d+\.\d\d\]", cell), cell


@multiproc
def test_quick_writes_json(quick_run):
    _, _, out = quick_run
    payload = json.loads((out / "r.json").read_text())
    assert set(payload) >= {"benchmark", "params", "environment", "results"}
    env = payload["environment"]
    assert env["torch"] == torch.__version__
    assert "triton" in env and env["git_sha"]
    assert env["devices"]["cpu"] == payload["params"]["device_name"]
    peak = payload["params"]["peak"]
    assert peak["bytes_per_element"] == 8 and peak["gb_s"] > 0

    rows = payload["results"]
    kernels = [r for r in rows if not r["benchmark"].startswith(("e2e", "host", "memory", "fusion", "optimizers"))]
    assert {r["benchmark"] for r in kernels} == {"accumulate bf16->fp32", "l2norm_sq fp32", "scale_ fp32"}
    assert any(r["variant"] == "gaengine torch: accumulate_" for r in kernels)
    repeats = payload["params"]["repeats"]
    for r in kernels:  # an invalid row keeps its figures under "invalid", with the reason
        figures = r if r["valid"] else {**r, **r["invalid"]}
        assert r["valid"] or (r["gb_s"] is None and r["invalid"]["reason"])
        f = figures
        assert f["ms"] > 0 and f["gb_s"] > 0 and f["pct_of_copy"] > 0 and f["ratio_vs_torch"] > 0
        assert f["ratio_min"] <= f["ratio_p25"] <= f["ratio_vs_torch"] <= f["ratio_p75"] <= f["ratio_max"]
        assert r["ratio_rounds"] == repeats and isinstance(r["ratio_noise"], bool)
    first = {}
    for r in kernels:
        first.setdefault(r["benchmark"], r if r["valid"] else {**r, **r["invalid"]})
    assert all(r["variant"].startswith("torch:") and r["ratio_vs_torch"] == 1.0 for r in first.values())
    assert all(r["ratio_baseline"] is True and r["ratio_noise"] is False for r in first.values())
    assert sum(r["ratio_baseline"] for r in kernels) == len(first)

    e2e = {r["key"]: r for r in rows if r["benchmark"].startswith("e2e")}
    assert set(e2e) == set(bench.E2E_VARIANTS)
    assert e2e["plain"]["ratio_vs_torch"] == 1.0 and e2e["plain"]["ratio_baseline"] is True
    assert all(r["ratio_rounds"] == payload["params"]["e2e"]["config"]["timed_updates"] for r in e2e.values())
    for r in e2e.values():
        assert r["tokens_per_s"] > 0 and r["peak_mib"] > 0 and r["state_mib"] > 0
    fusion_rows = {r["variant"]: r for r in rows if r["benchmark"] == "fusion"}
    assert set(fusion_rows) == set(bench_fusion.VARIANTS) and payload["params"]["fusion"]["skipped"] is None
    fused_bound = _fused_error_bound(payload["params"]["fusion"]["tokens"], fusion_rows["fused"]["backward_passes"])
    assert fusion_rows["fused"]["rel_error"] <= fused_bound and fusion_rows["plain"]["ratio_baseline"] is True
    memory_rows = [r for r in rows if r["benchmark"] == "memory"]  # --quick: d = 1, 2
    assert {(r["variant"], r["world"]) for r in memory_rows} >= {("plain", 1), ("torch DDP", 2), ("gaengine stage 1", 2)}
    assert payload["params"]["memory"]["numel"] > 0
    optimizer_rows = {(r["stage"], r["world"]) for r in rows if r["benchmark"] == "optimizers"}  # --quick: d = 1, 2
    assert optimizer_rows == {(0, 1), (0, 2), (1, 2), (2, 2)}


@multiproc
def test_e2e_same_start_and_exact_state_bytes(quick_run):
    _, _, out = quick_run
    e2e = {r["key"]: r for r in json.loads((out / "r.json").read_text())["results"]
           if r["benchmark"].startswith("e2e")}
    # Same seed, same initialization, same first micro-batches: the first window's loss is the same forward.
    assert len({r["losses"][0] for r in e2e.values()}) == 1
    # The bytes model, for the parameters' dtype the bench chose for this machine (bf16 where it computes bf16
    # fast, else fp32: gaengine.tools.capability), p bytes each: the plain recipe's grad p + m, v 2p; gaengine's
    # fp32 main_grad 4 + fp32 m, v 8, plus fp32 masters 4 for bf16 parameters only; native fp32 accumulation's fp32
    # grad 4 + m, v 8 + its masters 4 (for fp32 parameters p.float() is p itself: no copy); master_weights=False:
    # main_grad 4 + m, v 2p.
    dtype = e2e["plain"]["benchmark"].split()[2].rstrip(",")
    p = {"bf16": 2, "fp32": 4}[dtype]
    masters = 4 if dtype == "bf16" else 0
    expected = {"plain": 3 * p, "gaengine-fused": 12 + masters, "gaengine-torch": 12 + masters, "native-fp32": 12 + masters,
                "gaengine-lean": 4 + 2 * p}
    for key, bytes_per_param in expected.items():
        assert e2e[key]["state_bytes_per_param"] == pytest.approx(bytes_per_param, abs=0.01), (key, dtype)
    # The live-tensor peak counts the state (allocated inside the measured run) plus activations.
    for r in e2e.values():
        assert r["peak_live_mib"] > r["state_mib"]


@multiproc
def test_quick_writes_png(quick_run):
    _, _, out = quick_run
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_host")
    args = _parse(["bench", "--device", "cpu", "--only", "host", "--quick", "--threads", "1",
                   "--host-params", "4", "16", "--json", str(out / "h.json")])
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = args.func(args)
    return rc, stdout.getvalue(), json.loads((out / "h.json").read_text())


def test_host_quick_prints_rows_and_target(host_run):
    rc, text, _ = host_run
    assert rc == 0
    tables = _tables(text)
    assert len(tables) == 2, text  # --only host: its tables alone
    (title, header, body), (per_title, per_header, per_body) = tables
    assert title.startswith("host: ") and per_title.startswith("host per parameter: ")
    assert header == ["dtype", "P", "variant", "ms/window", "vs (b) [p25-p75]", "launches/mb", "buckets"]
    assert per_header == ["dtype", "P", "variant", "us/param/mb", "added us/param/mb"]
    names = {key: label.split(":")[0] for key, label in bench.HOST_VARIANTS.items()}  # "(b) plain", "(a) gaengine"
    expected = [(dtype, p, name) for dtype in ("bf16", "fp32") for p in ("4", "16") for name in names.values()]
    assert [tuple(row[:3]) for row in body] == [tuple(row[:3]) for row in per_body] == expected
    for row, per in zip(body, per_body):
        plain = row[2] == names["plain"]
        assert (row[4] == "1 (baseline)") == plain and (row[6] == "") == plain and (per[4] == "") == plain
    for label in bench.HOST_VARIANTS.values():  # the legend under the tables
        assert f"  {label}" in text.splitlines()
    for dtype in ("bf16", "fp32"):
        line = _note(text, f"host {dtype}: gaengine adds ")
        assert "per parameter per micro-batch" in line and f"CPU target <= {bench.HOST_TARGET_US:g} us (1 torch " \
            "thread, idle CPUs): " in line
        assert re.search(r": (met|NOT met) \(load average [0-9.]+ over \d+ CPUs\)|: not judged, the machine was "
                         r"loaded \(load average [0-9.]+ over \d+ CPUs", line), line
    assert "accumulate bf16->fp32" not in text and "e2e:" not in text  # --only host


def test_host_quick_json_fields(host_run):
    _, _, payload = host_run
    assert payload["params"]["benchmarks"] == ["host"]
    info = payload["params"]["host"]
    assert info["param_counts"] == [4, 16] and info["accumulation_steps"] == bench.HOST_ACCUMULATION_STEPS
    assert info["target_us_per_param_mb"] == bench.HOST_TARGET_US
    assert set(info["fit"]) == {"bf16", "fp32"}
    rows = payload["results"]
    assert all(r["benchmark"].startswith("host") and r["device"] == "cpu" for r in rows)
    measured = [r for r in rows if not r["key"].endswith("-fit")]
    fits = {r["dtype"]: r for r in rows if r["key"].endswith("-fit")}
    assert len(measured) == 2 * 2 * 2 and set(fits) == {"bf16", "fp32"}  # dtypes x P x variants
    k = bench.HOST_ACCUMULATION_STEPS
    for r in measured:
        for field in ("variant", "dtype", "num_params", "param_numel", "accumulation_steps", "ms", "window_ms",
                      "ratio_vs_torch", "us_per_param_mb", "added_us_per_param_mb", "launches_per_mb",
                      "accumulate_ops_per_mb", "gaengine_launches_per_mb", "gaengine_launches_source", "buckets",
                      "target_us"):
            assert field in r, field
        assert r["accumulation_steps"] == k and r["param_numel"] == bench.HOST_PARAM_NUMEL
        assert isinstance(r["ms"], float) and len(r["window_ms"]) == payload["params"]["host"]["repeats"]
        assert r["us_per_param_mb"] == pytest.approx(r["ms"] * 1e3 / (r["num_params"] * k))
        if r["key"].endswith("-plain"):
            assert r["variant"] == bench.HOST_VARIANTS["plain"] and r["ratio_vs_torch"] == 1.0
            assert r["added_us_per_param_mb"] is None and r["buckets"] is None
            # Micro-batch 1 of a window: AccumulateGrad adds each incoming gradient into .grad.
            assert r["accumulate_ops_per_mb"] == r["num_params"] == r["launches_per_mb"]
        else:
            assert r["variant"] == bench.HOST_VARIANTS["gaengine"]
            assert isinstance(r["added_us_per_param_mb"], float)
            assert r["target_us"] == bench.HOST_TARGET_US
            assert isinstance(r["buckets"], int) and r["buckets"] >= 1
            own = r["gaengine_launches_per_mb"]
            assert r["launches_per_mb"] == ("n/a" if own is None else own)
            assert (own is None) == (r["gaengine_launches_source"] is None)
    for r in fits.values():
        assert isinstance(r["added_us_per_param_mb"], float) and isinstance(r["intercept_us_per_mb"], float)
        assert r["target_us"] == bench.HOST_TARGET_US


@pytest.mark.parametrize(
    "variant_ms, expected",
    [
        # The baseline takes 10 ms every round, so the per-round ratios are 10 / variant_ms. Quartiles by
        # linear interpolation between order statistics (statistics.quantiles, method="inclusive").
        ([5.0, 4.0, 5.0, 5.0, 2.0], {"ratio_vs_torch": 2.0, "ratio_p25": 2.0, "ratio_p75": 2.5, "ratio_noise": False}),
        ([5.0, 5.0, 5.0, 5.0, 4.0, 4.0], {"ratio_vs_torch": 2.0, "ratio_p25": 2.0, "ratio_p75": (2.0 + 3 * 2.5) / 4,
                                          "ratio_noise": False}),
        ([20.0, 8.0, 10.0, 12.5, 5.0], {"ratio_vs_torch": 1.0, "ratio_p25": 0.8, "ratio_p75": 1.25,
                                        "ratio_noise": True}),
        ([8.0, 8.0, 8.0, 8.0, 12.5, 12.5], {"ratio_vs_torch": 1.25, "ratio_p25": (3 * 0.8 + 1.25) / 4,
                                            "ratio_p75": 1.25, "ratio_noise": True}),
        ([1.0, 20.0], {"ratio_vs_torch": 5.25, "ratio_rounds": 2, "ratio_noise": True}),  # too few rounds
    ],
    ids=["2x-clear", "2x-interpolated", "straddles-1", "1.25x-but-p25-below-1", "two-rounds"],
)
def test_ratio_stats(variant_ms, expected):
    stats = bench.ratio_stats([10.0] * len(variant_ms), variant_ms)
    ratios = sorted(10.0 / v for v in variant_ms)
    assert stats["ratio_min"] == ratios[0] and stats["ratio_max"] == ratios[-1]
    assert stats["ratio_rounds"] == len(variant_ms) and stats["ratio_baseline"] is False
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value), key


def test_ratio_text():
    row = {"ratio_vs_torch": 7.7, "ratio_p25": 7.123, "ratio_p75": 8.031, "ratio_rounds": 15, "ratio_noise": False}
    assert bench.ratio_text(row) == "7.70x [7.12-8.03]"
    assert bench.ratio_text({**row, "ratio_noise": True, "ratio_p25": 0.9}) == "~1 (noise) [0.90-8.03]"
    assert bench.ratio_text({**row, "ratio_rounds": 2, "ratio_noise": True}) == "noise (2 rounds) [7.12-8.03]"
    assert bench.ratio_text({**row, "ratio_vs_torch": 1.0, "ratio_baseline": True}) == "1 (baseline)"
    assert bench.ratio_text({"ratio_vs_torch": None}) == ""
    baseline = bench.ratio_stats([3.0, 4.0, 5.0], [3.0, 4.0, 5.0], baseline=True)
    assert (baseline["ratio_vs_torch"], baseline["ratio_noise"]) == (1.0, False)  # few rounds: still the baseline


def test_profiler_log_is_kept_off_stderr(capfd):
    """kineto prints ``... SyncActivityProfilerHandler.cpp:52] profiler_start`` to fd 2 at every profiler start;
    the host benchmark profiles every variant, so those lines are dropped, and nothing else the profiled code
    writes to stderr is."""
    def fn():
        os.write(2, b"a line of the profiled code\n")
        torch.ones(4).add_(1)

    counts = bench.host._profile_launches(fn, torch.device("cpu"))
    err = capfd.readouterr().err
    assert counts["accumulate_ops"] == 0
    assert "a line of the profiled code" in err
    assert "profiler_start" not in err and "profiler_stop" not in err and ".cpp:" not in err


def test_time_rounds_is_the_one_timing_loop():
    """Setups run untimed right before their function, warmup rounds are dropped, an ``Elapsed`` return is taken
    as the call's time, ``shuffle=False`` keeps the order, shuffled rounds are the same every run."""
    calls = []
    rounds = bench.common.time_rounds(
        {"a": (lambda: calls.append("setup a"), lambda: calls.append("a")),
         "b": lambda: (calls.append("b"), bench.common.Elapsed(0.25))[1]},
        warmup=2, repeats=3, shuffle=False)
    assert calls == ["setup a", "a", "b"] * 5
    assert rounds.ms["b"] == [250.0] * 3 and rounds.cpu_ms["b"] == [None] * 3
    assert len(rounds.ms["a"]) == len(rounds.cpu_ms["a"]) == 3 and all(t >= 0 for t in rounds.ms["a"])

    def order():
        seen = []
        bench.common.time_rounds({k: (lambda k=k: seen.append(k)) for k in "abcd"}, warmup=0, repeats=4)
        return seen

    first = order()
    assert first == order()
    assert all(sorted(first[i:i + 4]) == list("abcd") for i in range(0, 16, 4))  # each round: every function once
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.common.time_rounds({"a": lambda: None}, warmup=0, repeats=0)


@pytest.mark.parametrize("slope, threads, load, cpus, verdict", [
    (0.04, 1, 0.9, 2, ": met (load average 0.9 over 2 CPUs)"),
    (1.67, 1, 1.5, 2, ": NOT met (load average 1.5 over 2 CPUs)"),
    (1.67, 1, 6.6, 2, ": not judged, the machine was loaded (load average 6.6 over 2 CPUs"),
    (0.04, 2, 6.6, 2, ": not judged, the machine was loaded"),  # a loaded machine is not judged either way
    (1.67, 4, float("nan"), 8, ": NOT met (load unknown)"),
])
def test_host_target_line_states_its_conditions_and_the_load(slope, threads, load, cpus, verdict):
    """The CPU target holds for the benchmark's threads on idle CPUs: the line names both, and on a machine with
    more runnable threads than CPUs says the target was not judged rather than "NOT met"."""
    from gaengine.tools.bench.host import target_verdict  # noqa: PLC0415

    line = target_verdict(slope, threads, load, cpus)
    plural = "s" if threads != 1 else ""
    assert line.startswith(f"CPU target <= {bench.HOST_TARGET_US:g} us ({threads} torch thread{plural}, idle CPUs)")
    assert verdict in line, line
