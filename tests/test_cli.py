"""``gaengine train`` end to end, with a tiny model: in process, as ``python -m gaengine``, ``--compare``,
``--data``, ``--threads``, and argument errors; the help texts; ``gaengine info``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gaengine.tools.cli import build_parser, main
from tests.helpers import ENGINE_BUGS, plant_engine_bug
from tests.models import TINY
from tests.ranks import free_port
from tests.tolerances import mean_rtol

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_run(out: Path, steps: int, recipes=("gaengine",)) -> list[dict]:
    records = _records(out)
    for recipe in recipes:
        train = [r for r in records if r["kind"] == "train" and r["recipe"] == recipe]
        assert [r["step"] for r in train] == list(range(1, steps + 1))
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train)
        assert all(r["skipped"] is False and r["lr"] > 0 for r in train)
        assert train[-1]["tokens"] == steps * 2 * 2 * 16
        evals = [r for r in records if r["kind"] == "eval" and r["recipe"] == recipe]
        assert evals and evals[-1]["step"] == steps and math.isfinite(evals[-1]["val_loss"])
    assert {r["recipe"] for r in records} == set(recipes)
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC
    return records


def test_train_in_process(tmp_path, capsys):
    import torch

    out = tmp_path / "run"
    before = torch.get_num_threads()
    assert main(["train", "--steps", "3", *TINY, "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == before  # set for the run, restored after it
    _check_run(out, 3)
    stdout = capsys.readouterr().out
    for label in ("updates", "tokens/s (train)", "final train loss", "validation loss", "grad norm min/max", "peak memory"):
        assert label in stdout
    assert "torch threads 1 (--threads)" in stdout
    assert "\nmode: one process (1 rank), nothing sharded or all-reduced\n" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["accumulation_steps"] == 2 and config["torch_threads"] == 1


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize("omp", [None, "1"], ids=["auto", "omp-num-threads-1"])
def test_train_subprocess(tmp_path, omp):
    """As ``python -m gaengine``: by default half the CPUs (at least 1) run torch's ops; OMP_NUM_THREADS set
    (as torchrun sets it) is respected."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    proc = subprocess.run(
        [sys.executable, "-m", "gaengine", "train", "--steps", "3", *TINY, "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "final train loss" in proc.stdout and "validation loss" in proc.stdout
    _check_run(out, 3)
    threads = json.loads((out / "config.json").read_text())["torch_threads"]
    if omp is None:
        assert threads == max(1, _cpus() // 2)
        assert f"torch threads {threads} (auto: half of {_cpus()} CPUs)" in proc.stdout
    else:
        assert threads == 1 and "torch threads 1 (OMP_NUM_THREADS=1)" in proc.stdout  # what torchrun sets


@pytest.mark.parametrize(
    "requested, environ, cpus, expected",
    [
        (None, {}, 2, 1),
        (None, {}, 1, 1),
        (None, {}, 16, 8),
        (None, {}, 3, 1),
        (4, {}, 2, 4),
        (None, {"OMP_NUM_THREADS": "1"}, 16, None),
        (None, {"WORLD_SIZE": "2"}, 16, None),
        (None, {"WORLD_SIZE": "1"}, 16, 8),
        (2, {"OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}, 16, 2),
    ],
    ids=["2-cpus", "1-cpu", "16-cpus", "3-cpus", "requested", "omp-set", "torchrun", "world-1", "requested-wins"],
)
def test_choose_threads(requested, environ, cpus, expected):
    from gaengine.tools.train import choose_threads

    threads, why = choose_threads(requested, environ=environ, cpus=cpus)
    assert threads == expected and why


def test_compare(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", *TINY, "--dtype", "fp32", "--compare", "--out", str(out)]) == 0
    records = _check_run(out, 2, recipes=("gaengine", "torch"))
    first = {r["recipe"]: r["loss"] for r in records if r["kind"] == "train" and r["step"] == 1}
    # Same initialization and the same micro-batches: the first window's loss is the same forward pass, the same K = 2
    # fp32 losses averaged by each recipe (the engine in fp32, the plain loop in a Python float).
    assert first["gaengine"] == pytest.approx(first["torch"], rel=2 * mean_rtol(2))
    stdout = capsys.readouterr().out
    assert "gap (gaengine - torch)" in stdout and "torch" in stdout


def test_no_master_weights(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", *TINY, "--no-master-weights", "--compare", "--out", str(out)]) == 0
    records = _check_run(out, 2, recipes=("gaengine", "torch"))
    first = {r["recipe"]: r["loss"] for r in records if r["kind"] == "train" and r["step"] == 1}
    assert first["gaengine"] == pytest.approx(first["torch"], rel=2 * mean_rtol(2))  # as in test_compare
    assert json.loads((out / "config.json").read_text())["master_weights"] is False
    assert build_parser().parse_args(["train"]).master_weights is True
    assert build_parser().parse_args(["train", "--master-weights"]).master_weights is True


def test_data_file_and_folder(tmp_path):
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(text)
    (tmp_path / "corpus" / "sub").mkdir()
    (tmp_path / "corpus" / "sub" / "b.py").write_text(text[::-1])
    (tmp_path / "corpus" / "ignored.bin").write_bytes(b"\x00" * 100)
    for data in (tmp_path / "corpus" / "a.txt", tmp_path / "corpus"):
        out = tmp_path / f"run-{data.name}"
        assert main(["train", "--steps", "2", *TINY, "--data", str(data), "--out", str(out)]) == 0
        _check_run(out, 2)


def test_corpus_is_deterministic_and_split():
    from gaengine.tools.data import load_corpus

    a, b = load_corpus(max_bytes=200_000), load_corpus(max_bytes=200_000)
    assert a.train.numel() + a.val.numel() == 200_000
    assert a.val.numel() > 0 and a.train.numel() > a.val.numel()
    assert a.train.equal(b.train) and a.val.equal(b.val)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--accumulation-steps", "0"], "must be >= 1"),
        (["--micro-batch-size", "-1"], "must be >= 1"),
        (["--dtype", "fp8"], "invalid choice"),
        (["--backend", "nope"], "invalid choice"),
        (["--lr", "nan"], "positive finite"),
        (["--n-heads", "3"], "must divide d_model"),
        (["--data", "/nonexistent/corpus"], "no such file or folder"),
        (["--lr", "abc"], "expected a number, got 'abc'"),
        (["--max-data-mb", "0"], "must be a positive finite number, got 0"),
        (["--eval-interval", "-1"], "must be >= 0, got -1"),
        (["--steps", "2.5"], "expected an integer, got '2.5'"),
        (["--threads", "0"], "must be >= 1, got 0"),
        (["--threads", "many"], "expected an integer, got 'many'"),
    ],
    ids=["accumulation-steps-0", "micro-batch-negative", "dtype-fp8", "backend-nope", "lr-nan", "heads-3",
         "data-missing", "lr-text", "max-data-0", "eval-interval-negative", "steps-float", "threads-0", "threads-text"],
)
def test_bad_arguments(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "1", *TINY, *args, "--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parser_defaults_and_clip_off():
    parser = build_parser()
    args = parser.parse_args(["train"])
    assert (args.max_grad_norm, args.dtype, args.backend, args.compare) == (1.0, "auto", "auto", False)
    assert args.threads is None  # auto
    assert parser.parse_args(["train", "--threads", "3"]).threads == 3
    for off in ("0", "none", "None"):
        assert parser.parse_args(["train", "--max-grad-norm", off]).max_grad_norm is None
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a command is required


@pytest.mark.multiproc
def test_torchrun_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m gaengine train --steps 3` (gloo on CPU): rank 0 alone writes the outputs."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "gaengine", "train", "--steps", "3", *TINY, "--out", str(out), "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(out)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[-1]["tokens"] == 3 * 2 * 2 * 16 * 2  # both ranks' tokens
    assert proc.stdout.count("2 rank(s)") == 1  # one summary, from rank 0
    assert proc.stdout.count("\nmode: replicated over 2 ranks (") == 1


@pytest.mark.parametrize("zero_stage, fsdp, world, mode", [
    (0, False, 1, "one process (1 rank), nothing sharded or all-reduced"),
    (2, False, 1, "one process (1 rank), nothing sharded (--zero-stage 2 shards under torchrun)"),
    (0, False, 4, "replicated over 4 ranks"), (1, False, 2, "ZeRO-1 over 2 ranks"),
    (2, False, 8, "ZeRO-2 over 8 ranks"), (0, True, 2, "FSDP2 over 2 ranks"),
], ids=["one", "one-zero2", "replicated", "zero1", "zero2", "fsdp2"])
def test_summary_names_the_mode_and_the_world_size(zero_stage, fsdp, world, mode):
    """The run summary's ``mode:`` line (issue 34): the strategy the run used and over how many ranks, within 100
    columns. (The runs under torchrun check it in place: test_torchrun_two_ranks, test_zero's and test_fsdp2's.)"""
    from gaengine.tools.cli import _mode
    from gaengine.tools.train import TrainConfig

    line = _mode(TrainConfig(zero_stage=zero_stage, fsdp=fsdp), world)
    assert line.startswith(f"mode: {mode}") and len(line) <= 100


@pytest.mark.multiproc
def test_torchrun_refusal_is_one_line_per_rank(tmp_path):
    """`torchrun --nproc-per-node 2 -m gaengine train --compare` (gloo on CPU) is refused: each rank prints one
    line naming itself and the reason, no usage text and no Python traceback of its own, and exits with status 2;
    torchrun's own report (its ChildFailedError) names that line as the root cause, not a link to its docs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "gaengine", "train", "--compare", "--steps", "1", *TINY, "--out", str(tmp_path / "run"),
           "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    reason = "--compare runs the single-process plain recipe; run it without torchrun"
    lines = proc.stderr.splitlines()
    for rank in (0, 1):
        assert lines.count(f"gaengine train: rank {rank}: {reason}") == 1, proc.stderr[-3000:]
    assert not [line for line in lines if line.startswith("gaengine train: ") and ": rank " not in line]
    assert "usage:" not in proc.stderr and "_UsageError" not in proc.stderr and "SystemExit" not in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") <= 1  # torchrun's ChildFailedError, if any
    assert "exitcode  : 2 " in proc.stderr  # the first rank to exit: status 2 (torchrun may stop the other)
    assert f"traceback : gaengine train: rank 1: {reason}" in proc.stderr or \
        f"traceback : gaengine train: rank 0: {reason}" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before any output


def test_refusal_under_torchrun_names_the_rank(tmp_path, capsys, monkeypatch):
    """In one process with torchrun's environment (RANK=1 of WORLD_SIZE=2): an argument error and an engine's
    refusal are each one line naming the rank, no usage text; the line also goes to torchrun's error file."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dtype", "fp8"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.splitlines() == [
        "gaengine train: rank 1: argument --dtype: invalid choice: 'fp8' (choose from 'auto', 'bf16', 'fp16', 'fp32')"]
    record = json.loads(error_file.read_text())
    assert record["message"]["extraInfo"]["py_callstack"] == err.strip()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "1", *TINY, "--n-heads", "3", "--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "gaengine train: rank 1: n_heads (3) must divide d_model (32)\n"


def test_auto_micro_batch_recovers_from_out_of_memory(tmp_path, monkeypatch, capsys):
    import torch

    from gaengine.tools.model import GPT

    real_forward = GPT.forward

    def forward(self, x, y=None):
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("simulated: micro-batch of more than 1 sequence")
        return real_forward(self, x, y)

    monkeypatch.setattr(GPT, "forward", forward)
    out = tmp_path / "run"
    args = ["train", "--steps", "2", *TINY, "--out", str(out), "--eval-batches", "1"]
    monkeypatch.setattr("gaengine.tools.train.evaluate", lambda model, batches: 1.0)  # eval batches are 2 sequences
    assert main([*args, "--auto-micro-batch"]) == 0
    records = _records(out)
    oom = [r for r in records if r["kind"] == "oom"]
    assert oom == [{"kind": "oom", "recipe": "gaengine", "micro_batch_size": 1, "accumulation_steps": 4,
                    "previous": [2, 2], "effective_batch_size": 4}]
    assert len([r for r in records if r["kind"] == "train"]) == 2
    assert "out of memory: window dropped" in capsys.readouterr().out
    with pytest.raises(torch.OutOfMemoryError):  # without the flag the error propagates
        main([*args, "--out", str(tmp_path / "run2")])


def test_verify_prints_a_passing_report(capsys):
    assert main(["verify", "--batch-size", "8", "--accumulation-steps", "4", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out.upper() and "blocks.0.attn.qkv.weight" in out


def test_verify_with_gradient_accumulation_fusion_passes_and_says_so(capsys):
    """--gradient-accumulation-fusion: the bf16 GPT's engine, its Linear layers fused, passes both checks; the header
    names the option; --backend torch with it is a usage error naming the option."""
    args = ["verify", "--dtype", "bf16", "--backend", "cpu", "--batch-size", "4", "--seq-len", "16"]
    assert main([*args, "--gradient-accumulation-fusion"]) == 0
    out = capsys.readouterr().out
    assert "(bf16, gradient accumulation fusion)" in out and "gradient equivalence PASSED" in out
    assert "blocks.0.mlp.0.weight" in out
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--backend", "torch", "--gradient-accumulation-fusion"])
    assert exc.value.code == 2 and "gradient_accumulation_fusion" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_verify_defaults_pass_in_every_dtype_and_state_the_bounds(capsys, dtype):
    """With the defaults (16 x 64 bytes, 4 micro-batches, seed 0) a correct engine passes in each dtype, bf16 and
    fp16 included (their rounding is bounded, not mistaken for a bug); the output states both bounds, and every
    line fits in 100 columns."""
    assert main(["verify", "--dtype", dtype]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "gradient equivalence PASSED"
    unit_roundoff = {"fp32": "2^-24", "bf16": "2^-8", "fp16": "2^-11"}[dtype]
    rtol = {"fp32": "1.0e-05", "bf16": "2^-3", "fp16": "2^-6"}[dtype]
    assert lines[3] == "  engine vs the micro-batch gradients summed in fp64: ok"
    assert lines[5].endswith(f"K = 4, u = {unit_roundoff} ({dtype})")
    assert lines[6] == "  whole batch vs the micro-batches: ok" and lines[8].endswith(f"rtol = {rtol} ({dtype})")
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)


@pytest.mark.parametrize("bug", ENGINE_BUGS)
def test_verify_fails_on_an_engine_bug_with_the_reason(capsys, monkeypatch, bug):
    """A bug planted in the engine (tests/test_verify.py) fails the bf16 demo with exit status 1 and says why."""
    plant_engine_bug(monkeypatch, bug)
    assert main(["verify", "--dtype", "bf16", "--backend", "torch", "--batch-size", "4", "--seq-len", "16"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "gradient equivalence FAILED: the engine's accumulation is wrong (beyond rounding)"
    assert lines[3].startswith("  engine vs the micro-batch gradients summed in fp64: FAIL in ")
    assert lines[6] == "  whole batch vs the micro-batches: ok"
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_train_help_states_defaults_plainly(capsys):
    text = _help(capsys, "train")
    assert "--master-weights, --no-master-weights keep fp32 master weights" in text
    assert "(default: on)" in text and "(default: True)" not in text
    assert "(default: None)" not in text  # an option without a default says what happens instead
    assert "--threads N|auto" in text and "OMP_NUM_THREADS" in text and "(default: auto)" in text
    assert "(default: auto)" in text and "(default: 120)" in text
    assert "bf16 on a GPU that supports it" in " ".join(text.split())  # --dtype auto says what it picks
    flat = " ".join(text.split())
    # --gradient-accumulation-fusion says its CPU cost; --benefit what it trains and shows.
    assert "Its CPU cost: with bf16 params about 14% slower training on a CPU with native bf16" in flat
    assert "with fp32 params no slower" in flat
    assert "--benefit, --no-benefit show what gaengine buys" in flat and "(default: on)" in flat


def test_verify_help_shows_defaults(capsys):
    text = _help(capsys, "verify")
    parser_defaults = {"--batch-size": 16, "--accumulation-steps": 4, "--seq-len": 64, "--dtype": "fp32",
                       "--backend": "auto", "--seed": 0}
    for option, default in parser_defaults.items():
        assert f"{option} " in text
        assert getattr(build_parser().parse_args(["verify"]), option[2:].replace("-", "_")) == default
    for default in ("(default: 16)", "(default: 4)", "(default: 64)", "(default: fp32)", "(default: auto)",
                    "(default: 0)"):
        assert default in text, default
    assert "(default: None)" not in text


def test_info_reports_what_was_built(capsys):
    import importlib.util

    assert main(["info"]) == 0
    rows, item = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("    "):  # a long finding wraps under the row above it
            assert item is not None, f"a continuation line before any row: {line!r}"
            rows[item] += " " + line.strip()
            continue
        item, _, finding = line.strip().partition("  ")
        rows[item] = finding.strip()
    assert {"gaengine", "torch", "CPU", "train dtype", "gaengine._C", "CPU ops", "CUDA kernels", "hooks on CPU",
            "triton"} <= set(rows)
    import torch

    assert rows["CPU"].startswith(torch.backends.cpu.get_cpu_capability() + ",")  # ATen's own report
    built = importlib.util.find_spec("gaengine._C") is not None
    assert rows["gaengine._C"].startswith("yes" if built else "no")
    assert rows["CPU ops"].startswith("yes" if built else "no")
    assert rows["hooks on CPU"].startswith("native C++ hooks (NativeHooks)")
    assert rows["triton"].startswith("yes" if importlib.util.find_spec("triton") else "no")


def test_output_fits_100_columns(tmp_path, capsys):
    """Every line ``gaengine train`` (its header and summary, with the widest table: --compare's gap column and
    --noise-scale's row) and ``gaengine info`` print fits in 100 columns (issue 21)."""
    out = tmp_path / "run"  # "wrote <metrics.jsonl>, <loss.png>" wraps between the two (a path never breaks)
    assert main(["train", "--steps", "2", *TINY, "--threads", "1", "--compare", "--noise-scale",
                 "--out", str(out)]) == 0
    train = capsys.readouterr().out
    assert "gap (gaengine - torch)" in train and "final noise scale" in train
    assert main(["info"]) == 0
    info = capsys.readouterr().out
    for text in (train, info):
        wide = [line for line in text.splitlines() if len(line) > 100]
        assert not wide, "\n".join(wide)


# ---------------------------------------------------------------- the noise scale and accumulation schedules
def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_noise_scale_with_an_adaptive_schedule(tmp_path, capsys):
    """--noise-scale logs B_simple (in sequences: the engine's micro-batches x micro-batch size) at every update,
    K stays in [K_MIN, K_MAX] with the effective batch following it, the plot gets a second panel and the summary
    says the final effective batch."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", *TINY, "--threads", "1", "--noise-scale",
                 "--accumulation-schedule", "adaptive:2,4,1,sqrt", "--out", str(out)]) == 0
    train = [r for r in _records(out) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert all(r["grad_noise_scale"] is not None and r["grad_noise_scale"] > 0 for r in train)  # K >= 2: measured
    assert all(2 <= r["accumulation_steps"] <= 4 and r["effective_batch"] == 2 * r["accumulation_steps"]
               for r in train)
    assert train[-1]["tokens"] == sum(r["effective_batch"] for r in train) * 16
    assert train[0]["accumulation_steps"] == 2  # --accumulation-steps is the first K
    stdout = capsys.readouterr().out
    final = train[-1]["effective_batch"]
    assert any(line.startswith("final effective batch") and line.rstrip().endswith(f"{final} seq ({final * 16:,} tok)")
               for line in stdout.splitlines())
    assert any(line.startswith("final noise scale") for line in stdout.splitlines())
    width, height = _png_size(out / "loss.png")
    assert height > 0.8 * width  # two panels (8 x 7 in) instead of one (8 x 4.5 in)


def test_rampup_schedule_follows_megatron(tmp_path, capsys):
    """rampup:2,2,8 up to 2 x 4 = 8 sequences: 3 increments over 8 samples, one every 8/3 samples consumed
    (Megatron's rampup_batch_size), so the batches are 2, 2, 4, 8, 8, 8 (consumed 0, 2, 4, 8, 16, 24)."""
    out = tmp_path / "run"
    tiny = [a if a != "2" or i != TINY.index("--accumulation-steps") + 1 else "4" for i, a in enumerate(TINY)]
    assert main(["train", "--steps", "6", *tiny, "--threads", "1", "--accumulation-schedule", "rampup:2,2,8",
                 "--out", str(out)]) == 0
    train = [r for r in _records(out) if r["kind"] == "train"]
    assert [r["effective_batch"] for r in train] == [2, 2, 4, 8, 8, 8]
    assert all("grad_noise_scale" not in r for r in train)  # measured only when asked (or adaptive)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("final effective batch") and line.rstrip().endswith("8 seq (128 tok)") for line in lines)
    assert not any(line.startswith("final noise scale") for line in lines)
    width, height = _png_size(out / "loss.png")
    assert height > 0.8 * width  # K changed: the effective batch gets its panel


@pytest.mark.parametrize(
    "args,message",
    [
        (["--accumulation-schedule", "ramp:1,2,3"], "expected rampup:START,INCREMENT,RAMP_SAMPLES or adaptive:"),
        (["--accumulation-schedule", "rampup:2,2"], "expected rampup:START,INCREMENT,RAMP_SAMPLES or adaptive:"),
        (["--accumulation-schedule", "adaptive:1,x"], "the numbers must be integers"),
        (["--accumulation-schedule", "adaptive:1,4"], "k_min must be >= 2 on one rank"),
        (["--accumulation-schedule", "adaptive:4,2"], "k_min must be <= k_max, got k_min=4 > k_max=2"),
        (["--accumulation-schedule", "adaptive:1,4,1,cubic"], "must be linear or sqrt, got 'cubic'"),
        (["--accumulation-schedule", "adaptive:3,4"], "it must lie in [K_MIN, K_MAX] = [3, 4]"),
        (["--accumulation-schedule", "rampup:2,1,8"], "batch size 3 is not a multiple of micro_batch_size x world_size"),
        (["--accumulation-schedule", "rampup:2,2,8", "--compare"], "--compare trains the plain recipe at a fixed K"),
        (["--accumulation-schedule", "rampup:2,2,8", "--auto-micro-batch"], "use one or the other"),
    ],
    ids=["unknown-kind", "rampup-two-numbers", "adaptive-text", "kmin-1-one-rank", "kmin-over-kmax", "rule-cubic", "first-k-outside",
         "ramp-not-multiple", "with-compare", "with-auto-micro-batch"],
)
def test_bad_accumulation_schedules(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "1", *TINY, *args, "--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "bench", "verify"])
def test_every_help_line_fits_in_100_columns(capsys, monkeypatch, command):
    """argparse wraps help text to the terminal, but never inside one option's brackets in the usage line: at 100
    columns (and at 80, pytest's default), every line of ``--help`` fits in 100; ``--noise-scale`` still parses."""
    for columns in ("100", "80"):
        monkeypatch.setenv("COLUMNS", columns)
        with pytest.raises(SystemExit):
            main([command, "--help"])
        lines = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    if command == "train":
        parser = build_parser()
        assert parser.parse_args(["train", "--noise-scale"]).noise_scale is True
        assert parser.parse_args(["train", "--no-noise-scale"]).noise_scale is False
        assert parser.parse_args(["train"]).noise_scale is False


def test_gradient_accumulation_fusion(tmp_path, capsys):
    """--gradient-accumulation-fusion trains (every GPT Linear fused), says so in the summary and config.json, and its
    first window's loss is the plain recipe's (as in test_compare); its refusals are usage errors naming it."""
    pytest.importorskip("gaengine._C", reason="gaengine._C is not built")
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", *TINY, "--dtype", "fp32", "--gradient-accumulation-fusion", "--compare",
                 "--out", str(out)]) == 0
    records = _check_run(out, 2, recipes=("gaengine", "torch"))
    first = {r["recipe"]: r["loss"] for r in records if r["kind"] == "train" and r["step"] == 1}
    assert first["gaengine"] == pytest.approx(first["torch"], rel=2 * mean_rtol(2))
    assert "\ngradient accumulation fusion: on (each Linear's weight gradient" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["gradient_accumulation_fusion"] is True
    assert build_parser().parse_args(["train"]).gradient_accumulation_fusion is False
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "1", *TINY, "--gradient-accumulation-fusion", "--zero-stage", "1",
              "--out", str(tmp_path / "run2")])
    assert exc.value.code == 2
    assert "gradient_accumulation_fusion" in capsys.readouterr().err


_SHOWN = [arg for arg in TINY if arg != "--quiet"]  # TINY with its progress shown


def test_progress_off_a_terminal_is_periodic_lines(tmp_path, capsys):
    """With stderr a file or a pipe (capsys: not a terminal) the progress is a status line every tenth of the
    updates and one at the last, each tqdm's own meter with the loss, never a bar redrawn in place with ``\r``."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "15", *_SHOWN, "--dtype", "fp32", "--threads", "1", "--eval-interval", "0",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("gaengine")]
    assert [int(re.search(r" (\d+)/15 ", line).group(1)) for line in lines] == [2, 4, 6, 8, 10, 12, 14, 15], err
    losses = [r["loss"] for r in _records(out) if r["kind"] == "train"]
    for line in lines:  # each line's loss is that update's, as metrics.jsonl has it
        step = int(re.search(r" (\d+)/15 ", line).group(1))
        assert f"loss={losses[step - 1]:.3f}" in line and "upd" in line and len(line) <= 100, line


def test_progress_on_a_terminal_is_tqdms_bar(tmp_path, capsys, monkeypatch):
    """On a terminal the bar is tqdm's, redrawn in place (``\r``); ``--quiet`` prints neither bar nor lines."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["train", "--steps", "3", *_SHOWN, "--dtype", "fp32", "--threads", "1", "--out", str(tmp_path / "a")]) == 0
    assert "\r" in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main(["train", "--steps", "3", *TINY, "--dtype", "fp32", "--threads", "1", "--quiet",
                 "--out", str(tmp_path / "b")]) == 0
    assert "upd" not in capsys.readouterr().err


_BENEFIT = [arg for arg in TINY if arg != "--no-benefit"]  # TINY with the benefit shown


def test_benefit_where_bf16_is_fast_trains_three_runs_and_plots_their_distance(tmp_path, capsys, monkeypatch):
    """A machine that runs bf16 fast (the capability monkeypatched: a 0.8x bf16 matmul): ``gaengine train`` trains
    the fp32 reference (plain recipe), then the bf16 model through gaengine and through the plain recipe; each bf16
    run's distance from the fp32 run is recorded at its updates, in the table and the verdict line. The last
    distances are checked against the parameters of the three runs trained again here through the library's own
    loops (``watch`` keeps each final model's parameters), the norm taken in fp64."""
    import torch

    from gaengine.tools import capability
    from gaengine.tools.data import load_corpus
    from gaengine.tools.train import TrainConfig, train_gaengine, train_reference

    monkeypatch.setattr(capability, "bf16_matmul_slowdown", lambda: 0.8)
    out = tmp_path / "run"
    steps = 4
    assert main(["train", "--steps", str(steps), *_BENEFIT, "--threads", "1", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith("gaengine train: bf16 params: this CPU multiplies bf16 about as fast as fp32")
    records = _records(out)
    for recipe in ("fp32 reference", "gaengine", "torch"):
        assert [r["step"] for r in records if r["kind"] == "train" and r["recipe"] == recipe] == list(range(1, 5))
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC

    # The same three runs, their final parameters kept.
    final = {}

    def keeper(name):
        def watch(step, model):
            if step == steps:
                final[name] = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
        return watch

    args = build_parser().parse_args(["train", "--steps", str(steps), *_BENEFIT])
    config = TrainConfig(steps=steps, micro_batch_size=args.micro_batch_size, accumulation_steps=args.accumulation_steps,
                         seq_len=args.seq_len, n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads,
                         eval_batches=args.eval_batches, eval_interval=args.eval_interval, dtype="bf16")
    corpus = load_corpus(None, max_bytes=int(args.max_data_mb * 2**20), min_split_bytes=args.seq_len + 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command ran them (--threads 1): the same reductions, the same roundings
    try:
        train_reference(TrainConfig(**{**config.__dict__, "dtype": "fp32"}), corpus, watch=keeper("fp32"))
        train_gaengine(config, corpus, watch=keeper("gaengine"))
        train_reference(config, corpus, watch=keeper("torch"))
    finally:
        torch.set_num_threads(threads)
    expected = {name: float((final[name] - final["fp32"]).norm() / final["fp32"].norm()) for name in ("gaengine", "torch")}
    row = next(line for line in stdout.splitlines() if line.startswith("distance from fp32, last"))
    shown = row.split()[-3:]
    # fp32 sums of fp32 terms against fp64 ones: a relative difference of at most n * 2^-24 (n parameters), and the
    # table's 4 significant digits.
    for cell, name in zip(shown, ("gaengine", "torch")):
        assert float(cell) == pytest.approx(expected[name], rel=5e-4), (name, row)
    assert shown[2] == "-"
    assert expected["gaengine"] < expected["torch"]  # gaengine's fp32 sums and masters stay closer to fp32
    ratio = expected["torch"] / expected["gaengine"]
    line = " ".join(stdout.split())
    assert re.search(rf"bf16 benefit: after 4 updates gaengine's bf16 parameters are \S+ from the fp32 run's, the "
                     rf"plain bf16 recipe's \S+: {ratio:.1f}x closer", line), line


def test_benefit_where_only_fp32_is_fast_says_so_and_runs_verify(tmp_path, capsys, monkeypatch):
    """A machine without fast bf16 (an AVX2-only CPU: a 28x bf16 matmul): one fp32 run, then a line saying the
    benefit is bf16's and gaengine verify's summary on the run's model, passing; ``--no-benefit`` and a forced
    ``--dtype fp32`` print neither."""
    from gaengine.tools import capability

    monkeypatch.setattr(capability, "bf16_matmul_slowdown", lambda: 28.0)
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", *_BENEFIT, "--threads", "1", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert {r["recipe"] for r in _records(out)} == {"gaengine"}
    text = " ".join(stdout.split())
    assert "bf16 benefit: not shown here, this machine runs fp32 only: this CPU has no fast bf16 matmul" in text
    assert "What gaengine buys is bf16's" in text and "(gaengine verify, 4 rows as 2 micro-batches):" in text
    assert "\n  gradient equivalence PASSED\n" in stdout
    assert "engine vs the micro-batch gradients summed in fp64: ok" in stdout
    assert all(len(line) <= 100 for line in stdout.splitlines()), stdout
    for extra in (["--no-benefit"], ["--dtype", "fp32"]):
        assert main(["train", "--steps", "1", *_BENEFIT, *extra, "--threads", "1", "--out", str(tmp_path / "b")]) == 0
        assert "bf16 benefit" not in capsys.readouterr().out
