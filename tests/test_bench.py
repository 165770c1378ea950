"""``gaengine bench --quick`` on CPU: one table, a results JSON with the required keys, a PNG; and the e2e facts
that do not depend on timing (the same first loss for every variant, exact gradient + optimizer bytes)."""

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
    for name in ("accumulate bf16->fp32", "l2norm_sq fp32", "scale_ fp32", "e2e GPT bf16, K=8"):
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
    kernels = [r for r in rows if not r["benchmark"].startswith("e2e")]
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
    e2e = {r["key"]: r for r in json.loads((out / "r.json").read_text())["results"] if "key" in r}
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
