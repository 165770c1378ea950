"""``examples/``: each example runs as the README says, prints what it should, and the README's Quick start is
the example's code line for line."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import load_file
from tests.tolerances import mean_rtol

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def _load_quickstart():
    return load_file("quickstart", QUICKSTART)


def _readme_quick_start() -> list[str]:
    """The lines of the first ``python`` block under the README's ``## Quick start``."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start\n"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    return block.group(1).splitlines()


def _first_window_loss(qs, windows: int, micro_batch_size: int, seed: int = 0) -> float:
    """The first window's loss by plain torch, no gaengine: the mean of the first 8 micro-batch losses of the
    example's bf16 model, initialized and fed exactly as the example does (same seeds, same loader)."""
    torch.manual_seed(seed)
    model = qs.TinyLM().to(torch.bfloat16)
    loader = torch.utils.data.DataLoader(qs.byte_windows(windows, seed), batch_size=micro_batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        losses = [model(x, y).double() for (x, y), _ in zip(loader, range(8))]
    return float(sum(losses) / len(losses))


def test_quickstart_runs_as_a_script(tmp_path):
    """``python examples/quickstart.py --epochs 2 --windows 600``: 19 micro-batches of 32 per epoch, so 2 full
    windows of 8 and a partial one of 3 per epoch: 6 updates, the loss falling, the first one the plain-torch
    loss of the first 8 micro-batches."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(QUICKSTART), "--epochs", "2", "--windows", "600"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "19 micro-batches of 32 per epoch" in proc.stdout
    updates = [line for line in proc.stdout.splitlines() if line.startswith("loss ")]
    assert len(updates) == 2 * math.ceil(19 / 8)
    assert not any("skipped" in line for line in updates)
    losses = [float(re.match(r"loss (\S+)  grad norm (\S+)", line).group(1)) for line in updates]
    norms = [float(re.match(r"loss (\S+)  grad norm (\S+)", line).group(2)) for line in updates]
    assert all(math.isfinite(v) and v > 0 for v in losses + norms)
    ref = _first_window_loss(_load_quickstart(), 600, 32)
    # the same bf16 micro-batch losses, their mean of 8 taken in fp32 (mean_rtol), printed with 4 decimals
    assert losses[0] == pytest.approx(ref, abs=mean_rtol(8) * ref + 0.5e-4)
    assert losses[0] == pytest.approx(math.log(256), abs=0.5)  # an untrained model: about uniform over 256 bytes
    assert losses[-1] < losses[0] - 0.2


def test_readme_quick_start_is_the_example():
    """The README's snippet: its set-up lines name what the example defines, and from ``optimizer =`` on it is
    the body of ``quickstart()`` line for line, to its end: ``acc.close()`` included."""
    qs = _load_quickstart()
    readme = _readme_quick_start()
    start = next(i for i, line in enumerate(readme) if line.startswith("optimizer = "))
    source = inspect.getsource(qs.quickstart).splitlines()
    first = next(i for i, line in enumerate(source) if line.strip().startswith("optimizer = "))
    body_lines = textwrap.dedent("\n".join(source[first:])).splitlines()
    snippet = readme[start:]
    assert body_lines == snippet
    assert snippet[-1].startswith("acc.close()")
    setup = "\n".join(readme[:start])
    for name in ("TinyLM", "byte_windows", "print_update"):
        assert hasattr(qs, name) and name in setup
    assert "model = TinyLM().to(torch.bfloat16)" in setup and "model = TinyLM().to(torch.bfloat16)" in \
        inspect.getsource(qs.main)


# ---------------------------------------------------------------- Lightning (examples/lightning_*example.py)
LIGHTNING_EXAMPLES = {"automatic": ROOT / "examples" / "lightning_example.py",
                      "manual": ROOT / "examples" / "lightning_manual_example.py"}


@contextlib.contextmanager
def _restored_environ():
    """os.environ as it was on entry, restored on exit: variables set while inside are removed, changed ones reset.
    Lightning's Trainer, run in this process, sets launch variables (LOCAL_RANK, NODE_RANK, MASTER_ADDR,
    MASTER_PORT, ...) and OMP_NUM_THREADS that later tests in the same pytest worker would otherwise see (Accelerate
    would start a process group from them)."""
    saved = dict(os.environ)
    try:
        yield saved
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def _fresh_environ():
    """Every test here leaves os.environ as it found it (the in-process examples included)."""
    with _restored_environ():
        yield


def _load_example(name: str, path: Path):
    return load_file(name, path)


@pytest.mark.parametrize("kind", ["automatic", "manual"])
def test_lightning_examples_run(kind, capsys, monkeypatch):
    """Both Lightning examples' ``main()`` (what ``python examples/lightning_*example.py`` runs; in this process,
    Lightning's import paid once), 3 epochs of 10 micro-batches at K = 4: 9 updates of 4, 4 and 2 micro-batches (the
    partial window applied, not divided by 4), the first update's loss the plain-torch mean of the first 4
    micro-batch losses (no gaengine, no Lightning), and the loss falling."""
    pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # the manual example imports lightning_example, as a script
    example = _load_example("lightning_example", LIGHTNING_EXAMPLES["automatic"])
    with _restored_environ() as before:
        _load_example(f"lightning_{kind}_run", LIGHTNING_EXAMPLES[kind]).main([])
        leaked = {k for k in os.environ if os.environ[k] != before.get(k)}
    assert dict(os.environ) == before, "the example's launch variables stayed in os.environ"
    if kind == "automatic":
        assert "LOCAL_RANK" in leaked  # what the restore is for: Lightning's Trainer sets it in this process
    out = capsys.readouterr().out
    updates = re.findall(r"update (\d+): (\d+) micro-batches, loss (\S+), grad norm (\S+)", out)
    assert [int(u[1]) for u in updates] == [4, 4, 2] * 3
    assert ("global_step 9" if kind == "automatic" else "updates 9") in out

    net, loader = example.make_net(), torch.utils.data.DataLoader(example.make_data(), batch_size=8)
    with torch.no_grad():
        first = [torch.nn.functional.mse_loss(net(x), y).double() for (x, y), _ in zip(loader, range(4))]
    losses = [float(u[2]) for u in updates]
    # The same fp32 micro-batch losses (the same net, the same batches of 8), averaged by the engine in fp32 and here
    # in fp64, printed with 5 decimals (half a unit of the last one).
    want = float(sum(first) / 4)
    assert losses[0] == pytest.approx(want, abs=mean_rtol(4) * want + 0.5e-5)
    assert sum(losses[-3:]) < sum(losses[:3])


def _run_example(name: str, args: list[str], tmp_path) -> list[str]:
    # One process, whatever launch variables an in-process run before left in os.environ (Lightning sets LOCAL_RANK).
    launch = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT"}
    env = {**{k: v for k, v in os.environ.items() if k not in launch}, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("update ")]


def test_accelerate_loop_runs_as_a_script(tmp_path):
    """``python examples/accelerate_loop.py --epochs 1 --sequences 40 --sequential``: 5 micro-batches of 8, K = 4, so
    a full window and a partial one of 1; the first update's loss is the exact token mean of the first 32 sequences
    under the untrained model, computed here by plain torch in fp64."""
    pytest.importorskip("accelerate")
    updates = _run_example("accelerate_loop", ["--epochs", "1", "--sequences", "40", "--sequential"], tmp_path)
    assert [re.search(r"micro-batches (\d+)", line).group(1) for line in updates] == ["4", "1"]
    assert not any("skipped" in line for line in updates)
    losses = [float(re.search(r"loss (\S+)", line).group(1)) for line in updates]
    ex = _load_example("accelerate_loop", ROOT / "examples" / "accelerate_loop.py")
    torch.manual_seed(0)
    model = ex.TinyCausalLM().double()
    rows = ex.padded_sequences(40, 0)[:32]
    ids = torch.stack([r["input_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])[:, 1:]
    with torch.no_grad():
        logits = model(ids)[:, :-1]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, ex.VOCAB), labels.reshape(-1), ignore_index=-100)
    # Not from tests/tolerances.py: the example's fp32 model (a running mean over the sequence, micro-batches of 8)
    # against its fp64 copy; 1e-5 relative is a documented margin for this end-to-end check.
    assert losses[0] == pytest.approx(float(ref), rel=1e-5)
    assert losses[0] == pytest.approx(math.log(ex.VOCAB), abs=0.5)


def test_hf_trainer_runs_as_a_script(tmp_path):
    """``python examples/hf_trainer.py --epochs 1 --sequences 72 --sequential``: 18 micro-batches of 4, K = 4, so 5
    updates (the last a partial window of 2); the first update's loss is the exact token mean of the first 16
    sequences under the untrained tiny Llama, computed here by plain torch (fp32 model, fp64 loss)."""
    pytest.importorskip("transformers")
    updates = _run_example("hf_trainer", ["--epochs", "1", "--sequences", "72", "--sequential"], tmp_path)
    assert len(updates) == 5 and all(line.endswith("skipped 0") for line in updates)
    losses = [float(re.search(r"loss (\S+)", line).group(1)) for line in updates]
    norms = [float(re.search(r"grad norm (\S+)", line).group(1)) for line in updates]
    assert all(math.isfinite(v) and v > 0 for v in losses + norms)
    ex = _load_example("hf_trainer", ROOT / "examples" / "hf_trainer.py")
    model = ex.tiny_llama(0)
    rows = ex.padded_sequences(72, 0)[:16]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    labels = batch["labels"][:, 1:]
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, ex.VOCAB), labels.reshape(-1),
                                            ignore_index=-100)
    # Not from tests/tolerances.py: a tiny Llama (attention, RMSNorm, rotary embeddings: outside the error model's
    # plain layers) on micro-batches of 4 against one forward over 16; 1e-5 relative is a documented margin.
    assert losses[0] == pytest.approx(float(ref), rel=1e-5)
    assert losses[0] == pytest.approx(math.log(ex.VOCAB), abs=0.5)


def test_readme_quick_start_set_up_runs_from_the_repository_root():
    """The README's snippet up to the optimizer (its imports, the model, the loader), pasted as written into a
    Python started at the repository root (``python -c``: the root on ``sys.path``, as in a REPL or a script there):
    the stand-ins import and build."""
    readme = _readme_quick_start()
    setup = "\n".join(readme[:next(i for i, line in enumerate(readme) if line.startswith("optimizer = "))])
    done = subprocess.run([sys.executable, "-c", setup + "\nprint(len(loader))"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["63"]  # 2000 windows in micro-batches of 32
