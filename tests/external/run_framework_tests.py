"""Run the frameworks' own accumulation tests plainly and through gaengine, and count pass / fail / skip.

Not collected by pytest (its name is not ``test_*.py``): the frameworks' test files are not part of gaengine. They are copied at run time from checkouts given on the command line (a work tree, or a git directory and
a ref, read with ``git archive``), into a scratch directory, and run there twice, each in its own pytest process
(one process, ``-p no:cacheprovider``, only the selected tests):

* plainly;
* through gaengine: a pytest plugin written next to them swaps the framework's class for gaengine's before the test
  modules import it. Transformers: ``transformers.Trainer`` becomes ``GaengineTrainer``. Lightning: every
  ``lightning.pytorch.Trainer(strategy="auto" | "ddp" | "ddp_spawn")`` gets ``GaengineStrategy()``. Fabric (the
  same checkout's ``tests_fabric``): every ``lightning.Fabric(strategy="auto" | "ddp" | "ddp_spawn")`` gets
  ``gaengine.integrations.fabric.GaengineStrategy(accumulation_steps=1)`` (``start_method="spawn"`` for
  ``ddp_spawn``: Fabric's own launcher for it). Accelerate: ``accelerate.Accelerator`` becomes
  ``GaengineAccelerator`` (with the name bound in ``test_utils/scripts/test_sync.py``, whose scenarios a generated
  test file runs one by one, each on 1 and on 2 processes of Accelerate's ``debug_launcher``: gloo on CPU, forked).

Usage (``make framework-tests`` runs it with the checkouts in ``FRAMEWORKS``)::

    python tests/external/run_framework_tests.py --transformers ~/src/transformers@v5.24.0 \\
        --lightning ~/src/pytorch-lightning@2.6.5 --fabric ~/src/pytorch-lightning@2.6.5 \\
        --accelerate ~/src/accelerate@v1.14.0 [--json results.json] [--keep DIR] [--only PATH_PART]

Each path is a checkout's root; ``PATH@REF`` reads REF from the git directory at PATH (a bare mirror works).
Prints a table of counts per file and mode, and every test that passes plainly but fails through gaengine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Suite:
    """One framework's selection: the tree to copy (``root``, relative to the checkout), the test files in it with
    their ``-k`` expressions (None: the whole file), the package root to put on ``sys.path``, and the plugin that
    swaps in gaengine."""

    name: str
    root: str
    files: dict[str, str | None]
    plugin: str
    env: dict[str, str] = field(default_factory=dict)
    generated: dict[str, str] = field(default_factory=dict)  # test files written into the copy: path -> text


# Written next to the copied tests as the pytest plugin ``gaengine_swap``; every gaengine object the tests build, in
# the pytest process or in a process forked from it (Accelerate's debug_launcher), adds a line to the file
# ``GAENGINE_BUILT_LOG`` names: the run counts them (the swap took effect).
_COUNT = '''
import os as _os

_LOG = _os.environ["GAENGINE_BUILT_LOG"]  # read once: some tests clear os.environ before building


def _counted(cls):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        with open(_LOG, "a") as log:
            log.write(f"{cls.__name__} {_os.getpid()}\\n")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
'''

_TRANSFORMERS_PLUGIN = _COUNT + '''
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("GAENGINE_SWAP") == "1":
    import transformers
    import transformers.trainer
    from gaengine.integrations.transformers import GaengineTrainer
    _counted(GaengineTrainer)
    transformers.trainer.Trainer = GaengineTrainer
    vars(transformers)["Trainer"] = GaengineTrainer
'''

_ACCELERATE_PLUGIN = _COUNT + '''
import os
if os.environ.get("GAENGINE_SWAP") == "1":
    import accelerate
    import accelerate.accelerator
    from gaengine.integrations.accelerate import GaengineAccelerator
    _counted(GaengineAccelerator)
    accelerate.accelerator.Accelerator = GaengineAccelerator
    vars(accelerate)["Accelerator"] = GaengineAccelerator
    from accelerate.test_utils.scripts import test_sync
    test_sync.Accelerator = GaengineAccelerator
'''

# Accelerate's test_sync.py is a script whose main() runs its scenarios in turn and stops at the first failure; this
# file runs each scenario alone, on 1 and on 2 processes (Accelerate's debug_launcher, as its tests/test_grad_sync.py)
_ACCELERATE_SYNC_SCENARIOS = '''
import functools
import itertools
import os

import pytest
from accelerate import debug_launcher
from accelerate.test_utils.scripts import test_sync

# the swap took effect before this module bound the name
SWAPPED = os.environ["GAENGINE_SWAP"] == "1"
assert test_sync.Accelerator.__name__ == ("GaengineAccelerator" if SWAPPED else "Accelerator")

FLAGS = list(itertools.product([True, False], repeat=3))  # split_batches, dispatch_batches, sync_each_batch


def _with_accelerator(name):
    accelerator = test_sync.Accelerator()
    getattr(test_sync, name)(accelerator)
    accelerator.state.destroy_process_group()


def _with_flags(name, flags):
    getattr(test_sync, name)(*flags)
    test_sync.Accelerator().state.destroy_process_group()


SCENARIOS = {
    "dataloader_break": functools.partial(_with_flags, "test_dataloader_break", ()),
    **{name: functools.partial(_with_accelerator, f"test_{name}")
       for name in ("noop_sync", "distributed_sync", "distributed_sync_multiple_fwd")},
    **{f"gradient_accumulation-{flags}": functools.partial(_with_flags, "test_gradient_accumulation", flags)
       for flags in FLAGS},
    **{f"gradient_accumulation_with_opt_and_scheduler-{flags}": functools.partial(
        _with_flags, "test_gradient_accumulation_with_opt_and_scheduler", flags) for flags in FLAGS},
}


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sync_scenario(scenario, processes):
    debug_launcher(SCENARIOS[scenario], num_processes=processes)
'''


def _swap_plugin(package: str, cls: str, integration: str, strategy: str) -> str:
    """The plugin's text: ``strategy`` (an expression over ``name``, the strategy asked for; ``GaengineStrategy``
    imported from ``integration``) in place of ``strategy="auto" | "ddp" | "ddp_spawn"`` in every
    ``package.cls(...)``."""
    return _COUNT + f'''
import functools
import os
if os.environ.get("GAENGINE_SWAP") == "1":
    import {package} as framework
    from {integration} import GaengineStrategy
    _counted(GaengineStrategy)
    _init = framework.{cls}.__init__

    @functools.wraps(_init)
    def __init__(self, *args, **kwargs):
        name = kwargs.get("strategy", "auto")
        if name in ("auto", "ddp", "ddp_spawn"):
            kwargs["strategy"] = {strategy}
        _init(self, *args, **kwargs)

    framework.{cls}.__init__ = __init__
'''


_LIGHTNING_PLUGIN = _swap_plugin("lightning.pytorch", "Trainer", "gaengine.integrations.lightning",
                                 "GaengineStrategy()")
# Fabric: K = 1 (its tests call optimizer.step() after every backward); ddp_spawn keeps Fabric's spawning launcher
_FABRIC_PLUGIN = _swap_plugin("lightning.fabric", "Fabric", "gaengine.integrations.fabric",
                              "GaengineStrategy(accumulation_steps=1, "
                              "**({\"start_method\": \"spawn\"} if name == \"ddp_spawn\" else {}))")

SUITES = {
    "transformers": Suite(
        "transformers", "tests", {
            "tests/trainer/test_trainer.py": "grad_accum or gradient_accumulation",
            "tests/trainer/test_trainer_resume.py": None,
        }, _TRANSFORMERS_PLUGIN, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}),
    "lightning": Suite(
        "lightning", "tests/tests_pytorch", {
            "tests/tests_pytorch/trainer/optimization/test_manual_optimization.py": "accumulat",
            "tests/tests_pytorch/trainer/test_trainer.py": "accumulat",
            "tests/tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py": None,
            "tests/tests_pytorch/trainer/optimization/test_backward_calls.py": None,
            "tests/tests_pytorch/models/test_hooks.py": None,
            "tests/tests_pytorch/core/test_lightning_module.py": None,
        }, _LIGHTNING_PLUGIN, {"PL_RUN_CUDA_TESTS": "0"}),
    "fabric": Suite(
        "fabric", "tests/tests_fabric", {
            "tests/tests_fabric/test_fabric.py": None,
            "tests/tests_fabric/test_wrappers.py": None,
            "tests/tests_fabric/strategies/test_ddp_integration.py": None,
            "tests/tests_fabric/plugins/precision/test_amp_integration.py": None,
        }, _FABRIC_PLUGIN, {"PL_RUN_CUDA_TESTS": "0"}),
    "accelerate": Suite(
        "accelerate", "tests", {
            "tests/gaengine_test_sync_scenarios.py": None,
            "tests/test_scheduler.py": None,
            "tests/test_state_checkpointing.py": None,
        }, _ACCELERATE_PLUGIN, {"OMP_NUM_THREADS": "1"},
        {"tests/gaengine_test_sync_scenarios.py": _ACCELERATE_SYNC_SCENARIOS}),
}


def copy_tree(source: str, subdir: str, dest: Path) -> None:
    """``subdir`` of ``source`` (a work tree, or ``GITDIR@REF``) into ``dest / subdir``."""
    path, _, ref = source.partition("@")
    if ref:
        archive = subprocess.run(["git", f"--git-dir={_git_dir(Path(path))}", "archive", ref, subdir],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    else:
        shutil.copytree(Path(path) / subdir, dest / subdir)


def _git_dir(path: Path) -> Path:
    return path / ".git" if (path / ".git").exists() else path


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> "pass" / "fail" / "skip" from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        result[name] = "fail" if tags & {"failure", "error"} else "skip" if "skipped" in tags else "pass"
    return result


def run_suite(suite: Suite, source: str, work: Path, timeout: int, only: str | None = None) -> dict:
    """Copy, then run each file (those whose path holds ``only``, if given) plainly and through gaengine; per file
    and mode, each test's outcome."""
    if not (work / suite.root).exists():
        copy_tree(source, suite.root, work)
    for path, text in suite.generated.items():
        (work / path).write_text(text)
    plugin_dir = work / "_gaengine_swap"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "gaengine_swap.py").write_text(suite.plugin)
    results: dict = {}
    for path, select in suite.files.items():
        if only and only not in path:
            continue
        if not (work / path).exists():
            results[path] = {"missing": True}
            continue
        results[path] = {}
        for mode in ("plain", "gaengine"):
            junit = work / f"junit-{suite.name}-{Path(path).stem}-{mode}.xml"
            built_log = work / f"built-{suite.name}-{Path(path).stem}-{mode}.log"
            built_log.unlink(missing_ok=True)
            env = {**os.environ, **suite.env, "GAENGINE_SWAP": "1" if mode == "gaengine" else "0",
                   "GAENGINE_BUILT_LOG": str(built_log),
                   "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(work / Path(suite.root).parent), str(REPO),
                                                  os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gaengine_swap", "-n", "0",
                   "--rootdir", str(work), f"--junitxml={junit}", str(work / path)]
            if select:
                cmd += ["-k", select]
            try:
                subprocess.run(cmd, cwd=work, env=env, timeout=timeout, capture_output=True, text=True)
            except subprocess.TimeoutExpired:
                pass
            results[path][mode] = outcomes(junit) if junit.exists() else {}
            results[path][f"{mode}_built"] = len(built_log.read_text().splitlines()) if built_log.exists() else 0
    return results


def counts(tests: dict[str, str]) -> str:
    return "/".join(str(sum(v == k for v in tests.values())) for k in ("pass", "fail", "skip"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", help="a transformers checkout root, or GITDIR@REF")
    parser.add_argument("--lightning", help="a pytorch-lightning checkout root, or GITDIR@REF")
    parser.add_argument("--fabric", help="a pytorch-lightning checkout root, or GITDIR@REF (its tests_fabric)")
    parser.add_argument("--accelerate", help="an accelerate checkout root, or GITDIR@REF (its tests/; test_sync.py "
                        "is the installed package's)")
    parser.add_argument("--json", help="write every test's outcome per mode here")
    parser.add_argument("--keep", help="copy the frameworks' tests here (kept) instead of a temporary directory")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per pytest process")
    parser.add_argument("--only", help="run only the selected files whose path contains this")
    args = parser.parse_args(argv)
    chosen = {name: getattr(args, name) for name in SUITES if getattr(args, name)}
    if not chosen:
        parser.error("give at least one of --transformers, --lightning, --fabric, --accelerate")
    all_results = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        for name, source in chosen.items():
            work = base / name
            work.mkdir(parents=True, exist_ok=True)
            all_results[name] = run_suite(SUITES[name], source, work, args.timeout, args.only)
    print(f"{'file':<72} {'plain p/f/s':>12} {'gaengine p/f/s':>15}")
    for name, files in all_results.items():
        for path, modes in files.items():
            if modes.get("missing"):
                print(f"{path:<72} {'(not in this checkout)':>28}")
                continue
            print(f"{path:<72} {counts(modes['plain']):>12} {counts(modes['gaengine']):>15}   "
                  f"gaengine objects built: {modes.get('gaengine_built')}")
            for test, outcome in sorted(modes["gaengine"].items()):
                if outcome == "fail" and modes["plain"].get(test) == "pass":
                    print(f"    gaengine only: {test}")
    if args.json:
        Path(args.json).write_text(json.dumps(all_results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
