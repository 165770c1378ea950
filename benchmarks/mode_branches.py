"""The mode-branch sites of the ``gaengine`` package outside its layouts: where code asks which data-parallel mode it
runs in instead of asking the rank's layout (issue 43's figure, before and after).

    python benchmarks/mode_branches.py [--rev REV] [--all]

Reads ``gaengine/**/*.py`` from the working tree, or with ``--rev`` from that git revision (``git ls-tree`` and
``git show``, nothing checked out), and counts, in code only (``ast``: docstrings and comments are not code):

* ``isinstance(x, C)`` where ``C`` (or one class of a tuple) is a strategy (``ShardingStrategy``, ``Replicated``,
  ``ZeroStage1``, ``ZeroStage2``, ``_Zero``, ``FullyShardedGrads``), a layout (``RankLayout``, ``WholeParams``,
  ``EvenShards``, ``WholeOwners``, ``DTensorShards``, ``_FlatParams``) or ``DTensor``;
* a comparison of ``zero_stage`` (a name, an attribute, or ``.get("zero_stage", ...)``) with an integer;
* a read of a layout flag: ``.sharded``, ``.holds_whole_grad``, ``.window_rows``, ``.wraps`` (not
  ``functools.wraps``), ``.whole_matrix``.

The layout modules themselves (``rank_layout.py``, ``zero.py``, ``fsdp2.py``), where such knowledge belongs, are not
counted. By default ``config.py`` (the options checked once, where ``zero_stage`` is input) and ``integrations/``
(the trainers, reading ``acc.config``) are left out too; ``--all`` counts them. Prints each site, then the total.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

LAYOUT_MODULES = {"gaengine/rank_layout.py", "gaengine/zero.py", "gaengine/fsdp2.py"}
OPTIONAL = ("gaengine/config.py", "gaengine/integrations/")
CLASSES = {"ShardingStrategy", "Replicated", "ZeroStage1", "ZeroStage2", "_Zero", "FullyShardedGrads", "RankLayout",
           "WholeParams", "EvenShards", "WholeOwners", "DTensorShards", "_FlatParams", "DTensor"}
FLAGS = {"sharded", "holds_whole_grad", "window_rows", "wraps", "whole_matrix"}


def _class_names(node: ast.AST) -> Iterable[str]:
    if isinstance(node, ast.Tuple):
        for e in node.elts:
            yield from _class_names(e)
    elif isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr


def _is_zero_stage(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "zero_stage"
    if isinstance(node, ast.Attribute):
        return node.attr == "zero_stage"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "zero_stage")


def sites(source: str) -> list[tuple[int, str]]:
    """The mode-branch sites of one module's ``source``: ``(line, what)``, in line order (module docstring)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and len(node.args) == 2):
            hit = sorted(set(_class_names(node.args[1])) & CLASSES)
            if hit:
                out.append((node.lineno, "isinstance " + ", ".join(hit)))
        elif isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(map(_is_zero_stage, parts)) and any(
                    isinstance(p, ast.Constant) and type(p.value) is int for p in parts):
                out.append((node.lineno, "zero_stage compared with a number"))
        elif (isinstance(node, ast.Attribute) and node.attr in FLAGS and isinstance(node.ctx, ast.Load)
              and not (isinstance(node.value, ast.Name) and node.value.id == "functools")):
            out.append((node.lineno, f"layout flag .{node.attr}"))
    return sorted(out)


def _files(root: Path, rev: str | None) -> dict[str, str]:
    """``{path: source}`` of ``gaengine/**/*.py`` in the working tree at ``root``, or at git revision ``rev``."""
    if rev is None:
        return {str(p.relative_to(root)): p.read_text() for p in sorted((root / "gaengine").rglob("*.py"))}
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", rev, "gaengine"], check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "-C", str(root), "show", f"{rev}:{n}"], check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def count(files: dict[str, str], everything: bool = False) -> list[tuple[str, int, str]]:
    """Every site of ``files`` (``{path: source}``) outside the layout modules (and, unless ``everything``,
    outside ``config.py`` and ``integrations/``): ``(path, line, what)``."""
    out = []
    for path, source in sorted(files.items()):
        if path in LAYOUT_MODULES or (not everything and path.startswith(OPTIONAL)):
            continue
        out.extend((path, line, what) for line, what in sites(source))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    parser.add_argument("--all", action="store_true", help="count config.py and integrations/ too")
    args = parser.parse_args(argv)
    found = count(_files(Path(__file__).resolve().parents[1], args.rev), args.all)
    for path, line, what in found:
        print(f"{path}:{line}: {what}")
    print(f"{len(found)} mode-branch site(s) outside the layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
