"""benchmarks/mode_branches.py, the figure issue 43's closing note gives before and after (mode-branch sites outside
the layouts), on sources whose sites are known by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "mode_branches.py"


def _script():
    return load_file("mode_branches", SCRIPT)


KNOWN = '''"""A docstring naming isinstance(p, DTensor) and zero_stage == 1: not code."""
import functools


@functools.wraps(print)
def f(acc, p, layout, cfg):
    # isinstance(p, Replicated) in a comment: not code
    if isinstance(p, DTensor):
        pass
    if isinstance(acc.sharding, (int, Replicated)):
        pass
    if isinstance(p, int):
        pass
    if acc.config.zero_stage == 2 or 0 < cfg.zero_stage:
        pass
    if cfg.get("zero_stage", 0) != 0 and cfg.get("other", 0) != 0:
        pass
    layout.sharded = True
    return layout.sharded, layout.holds_whole_grad, zero_stage >= 1, layout.wraps
'''


def test_the_sites_of_a_known_source():
    """Every kind of site counted once where it is, nothing in a docstring, a comment, an assignment to a flag, an
    ``isinstance`` of another class, another key's comparison or ``functools.wraps``."""
    got = _script().sites(KNOWN)
    assert got == [
        (8, "isinstance DTensor"),
        (10, "isinstance Replicated"),
        (14, "zero_stage compared with a number"),
        (14, "zero_stage compared with a number"),
        (16, "zero_stage compared with a number"),
        (19, "layout flag .holds_whole_grad"),
        (19, "layout flag .sharded"),
        (19, "layout flag .wraps"),
        (19, "zero_stage compared with a number"),
    ], got


def test_the_layout_modules_and_the_options_are_left_out():
    """The layout modules are never counted; ``config.py`` and ``integrations/`` only with ``everything``."""
    count = _script().count
    files = {p: "x = zero_stage == 1\n" for p in ("gaengine/zero.py", "gaengine/rank_layout.py", "gaengine/fsdp2.py",
                                                  "gaengine/config.py", "gaengine/integrations/a.py", "gaengine/b.py")}
    assert [path for path, _, _ in count(files)] == ["gaengine/b.py"]
    assert [path for path, _, _ in count(files, everything=True)] == ["gaengine/b.py", "gaengine/config.py",
                                                                      "gaengine/integrations/a.py"]


def test_the_command_prints_each_site_and_the_total():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    lines = out.splitlines()
    assert lines[-1] == f"{len(lines) - 1} mode-branch site(s) outside the layouts", out
    assert all(line.startswith("gaengine/") and ": " in line for line in lines[:-1]), out
