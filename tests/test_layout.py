"""The rooms: the library (``gaengine/``) never imports the tools built on it (``gaengine/tools/``), and the
``gaengine`` command named in ``pyproject.toml`` and ``python -m gaengine`` resolve to the tools' CLI."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gaengine"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module ``tree`` imports, at any depth (function-level imports included);
    ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


# ``python -m gaengine`` runs the tools' CLI: the one file in gaengine/ that is an entry point, not library.
ENTRY_POINTS = {PACKAGE / "__main__.py"}


def _library_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] != "tools" and p not in ENTRY_POINTS)


def test_library_never_imports_the_tools():
    files = _library_files()
    assert len(files) > 10, f"expected the library's modules under {PACKAGE}, found {files}"
    offenders = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in sorted(_imported(tree, _module_name(path), path.name == "__init__.py")):
            if name == "gaengine.tools" or name.startswith("gaengine.tools."):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, ("the library must not import gaengine.tools (move what it needs into the library):\n"
                           + "\n".join(offenders))


def test_the_checker_sees_tool_imports(tmp_path):
    """The ast walk catches every spelling, lazy ones included (so the test above can fail)."""
    source = ("import gaengine.tools.cli\n"
              "def f():\n    from gaengine.tools import bench\n"
              "def g():\n    from .tools.train import TrainConfig\n"
              "def h():\n    from . import tools\n")
    names = _imported(ast.parse(source), "gaengine.engine", is_package=False)
    assert {"gaengine.tools.cli", "gaengine.tools", "gaengine.tools.bench", "gaengine.tools.train"} <= names


def test_cli_entry_point_resolves():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gaengine"] == "gaengine.tools.cli:main", scripts
    module, _, attr = scripts["gaengine"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    from gaengine import __main__ as dunder_main  # noqa: PLC0415 - python -m gaengine runs the same main

    assert dunder_main.main is getattr(importlib.import_module(module), attr)
    out = subprocess.run([sys.executable, "-m", "gaengine", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0 and "train" in out.stdout and "bench" in out.stdout, out.stderr
