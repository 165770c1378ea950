"""``gaengine bench --quick`` on CPU: one table, a results JSON with the required keys, a PNG; the e2e facts
that do not depend on timing (the same first loss for every variant, exact gradient + optimizer bytes); and the
host benchmark's rows and fields (``--only host``). Timings themselves are never asserted."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
import torch

from gaengine import bench


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gaengine")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


_THREADS = torch.get_num_threads()


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


def test_quick_prints_one_table(quick_run):
    rc, text, _ = quick_run
    assert rc == 0
    assert torch.get_num_threads() == _THREADS  # --threads holds for the run only
    header = [line for line in text.splitlines() if line.startswith("| benchmark")]
    assert len(header) == 1, text  # one table
    cells = [c.strip() for c in header[0].strip("|").split("|")]
    assert cells[:6] == ["benchmark", "variant", "ms", "GB/s", "% of peak", "vs torch"]
    assert "measured peak: fp32 dst.copy_(src)" in text
    for name in ("accumulate bf16->fp32", "l2norm_sq fp32", "scale_ fp32", "host, 32 bf16 params", "e2e GPT bf16, K=8"):
        assert f"| {name}" in text
    for label in bench.E2E_VARIANTS.values():
        assert label in text


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
    kernels = [r for r in rows if not r["benchmark"].startswith(("e2e", "host"))]
    assert {r["benchmark"] for r in kernels} == {"accumulate bf16->fp32", "l2norm_sq fp32", "scale_ fp32"}
    assert any(r["variant"] == "gaengine torch: accumulate_" for r in kernels)
    for r in kernels:
        assert r["ms"] > 0 and r["gb_s"] > 0 and r["pct_of_peak"] > 0 and r["ratio_vs_torch"] > 0
    first = {}
    for r in kernels:
        first.setdefault(r["benchmark"], r)
    assert all(r["variant"].startswith("torch:") and r["ratio_vs_torch"] == 1.0 for r in first.values())

    e2e = {r["key"]: r for r in rows if r["benchmark"].startswith("e2e")}
    assert set(e2e) == set(bench.E2E_VARIANTS)
    assert e2e["plain"]["ratio_vs_torch"] == 1.0
    for r in e2e.values():
        assert r["tokens_per_s"] > 0 and r["peak_mib"] > 0 and r["state_mib"] > 0


def test_e2e_same_start_and_exact_state_bytes(quick_run):
    _, _, out = quick_run
    e2e = {r["key"]: r for r in json.loads((out / "r.json").read_text())["results"]
           if r["benchmark"].startswith("e2e")}
    # Same seed, same initialization, same first micro-batches: the first window's loss is the same forward.
    assert len({r["losses"][0] for r in e2e.values()}) == 1
    # fp32 grad 4 + fp32 master 4 + fp32 m, v 8 against bf16 grad 2 + bf16 m, v 4 (the bytes model).
    assert e2e["plain"]["state_bytes_per_param"] == pytest.approx(6.0, abs=0.01)
    for key in ("gaengine-fused", "gaengine-torch", "native-fp32"):
        assert e2e[key]["state_bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    # master_weights=False: fp32 grad 4 + bf16 m, v 4.
    assert e2e["gaengine-lean"]["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    # The live-tensor peak counts the state (allocated inside the measured run) plus activations.
    for r in e2e.values():
        assert r["peak_live_mib"] > r["state_mib"]


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
    header = [line for line in text.splitlines() if line.startswith("| benchmark")]
    assert len(header) == 1, text
    cells = [c.strip() for c in header[0].strip("|").split("|")]
    assert cells[:6] == ["benchmark", "variant", "ms", "GB/s", "% of peak", "vs torch"]
    assert {"us/param/mb", "added us/param/mb", "target us", "launches/mb", "buckets"} <= set(cells)
    assert "| host, 4 bf16 params x 32" in text and "| host, 16 fp32 params x 32" in text
    assert "| host, bf16, fit over P=4,16" in text
    assert "per parameter per micro-batch" in text and f"CPU target <= {bench.HOST_TARGET_US:g} us" in text
    assert "accumulate bf16->fp32" not in text and "e2e GPT" not in text  # --only host


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
