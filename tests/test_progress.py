"""``make test``'s progress (``pytest -q``): before the first multi-process test of each file, a line of its own
names the file, how many multi-process tests it runs and about how long they take (``tests/conftest.py``). Run
in a subprocess on a throwaway test folder with ``tests.conftest`` as a plugin: nothing of the real suite runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MULTIPROC_TEST_S, multiproc_line

REPO = Path(__file__).resolve().parents[1]

FAST = "def test_a():\n    pass\n\n\ndef test_b():\n    pass\n"
MULTI = """import pytest


def test_plain():
    pass


@pytest.mark.multiproc
def test_x():
    pass


@pytest.mark.multiproc
def test_y():
    pass


@pytest.mark.multiproc
@pytest.mark.skip(reason="known skip: not counted")
def test_z():
    pass
"""


def _pytest(folder: Path, *args: str) -> list[str]:
    """``pytest -q`` (or the mode ``args`` set) on ``folder`` with ``tests/conftest.py``'s hooks; stdout's lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-o", "markers=multiproc: starts several processes", "--rootdir", str(folder), *args, str(folder)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("suite")
    (folder / "test_fast.py").write_text(FAST)
    (folder / "test_multi.py").write_text(MULTI)
    return folder


def test_a_line_before_each_files_multi_process_tests(folder):
    lines = _pytest(folder, "-q")
    expected = multiproc_line("test_multi.py", 2)
    assert expected == "test_multi.py: 2 multi-process tests (gloo), under a minute"
    assert lines.count(expected) == 1, lines  # a line of its own, once
    at = lines.index(expected)
    assert lines[at - 1].startswith("...") and lines[at + 1].startswith("..s")  # between the dots, in order
    assert all(len(line) <= 100 for line in lines)


def test_the_count_follows_the_selection(folder):
    assert "test_multi.py: 1 multi-process test (gloo), under a minute" in _pytest(folder, "-q", "-k", "not test_y")
    assert not any("multi-process" in line for line in _pytest(folder, "-q", "-m", "not multiproc"))


@pytest.mark.parametrize("mode", [[], ["-v"]], ids=["default", "verbose"])
def test_no_line_where_file_names_show(folder, mode):
    """Without -q each line starts with its file's (or test's) name: nothing is added."""
    lines = _pytest(folder, *mode)
    assert not any("multi-process" in line for line in lines) and any("test_multi.py" in line for line in lines)


def test_the_estimate_reads_in_minutes():
    assert multiproc_line("t.py", 1) == "t.py: 1 multi-process test (gloo), under a minute"
    n = 60 // MULTIPROC_TEST_S
    assert multiproc_line("t.py", n) == f"t.py: {n} multi-process tests (gloo), about 1 minute"
    assert multiproc_line("t.py", 240 // MULTIPROC_TEST_S).endswith("about 4 minutes")
