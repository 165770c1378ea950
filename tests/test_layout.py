"""The rooms: the library (``gaengine/``) never imports the tools built on it (``gaengine/tools/``), the
``gaengine`` command named in ``pyproject.toml`` and ``python -m gaengine`` resolve to the tools' CLI, and no module
of ``tests/`` imports a test file (what several test files share lives in a helper module there)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.helpers import load_file

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gaengine"
TESTS = ROOT / "tests"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
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


def _is_test_file(path: Path) -> bool:
    """A file pytest collects tests from (``test_*.py``, pytest's default ``python_files``, as pyproject.toml keeps)."""
    return path.name.startswith("test_") and path.suffix == ".py"


def _test_file_imports(files: list[Path], root: Path = ROOT) -> list[str]:
    """``"<file> imports <module>"`` for each import, at any depth, by one of ``files`` of a test file among them
    other than itself (its own module imported in a child process is allowed)."""
    test_modules = {_module_name(p, root): p for p in files if _is_test_file(p)}
    offenders = []
    for path in files:
        own = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in sorted(_imported(tree, own, path.name == "__init__.py")):
            if name in test_modules and name != own:
                offenders.append(f"{path.relative_to(root)} imports {name}")
    return offenders


def test_no_test_file_imports_another():
    """Each test file stands alone: a test's helpers, models, scenarios and oracles live in a module of ``tests/``
    that is not a test file (``tests/zero_scenarios.py``, ``tests/emulated_cuda.py``, ``tests/models.py``...), and a
    case that runs on another backend is a parametrization of the test itself, not a replay from another file."""
    files = sorted(TESTS.rglob("*.py"))
    assert sum(_is_test_file(p) for p in files) > 20, f"expected the test files under {TESTS}, found {files}"
    offenders = _test_file_imports(files)
    assert not offenders, ("a module of tests/ imports a test file (move what it shares into a helper module of "
                           "tests/, or parametrize the test itself):\n" + "\n".join(offenders))


def test_the_checker_sees_test_file_imports(tmp_path):
    """Every spelling of importing a test file is caught, lazy and relative ones included, from a test file or a
    helper; a helper, a conftest and a file's own module are not test files."""
    files = {
        "tests/__init__.py": "",
        "tests/helper.py": "import torch\nfrom tests import conftest\n",
        "tests/conftest.py": "from tests.helper import x\n",
        "tests/test_a.py": "from tests import helper, test_b as tb\n",
        "tests/test_b.py": "import tests.test_c as c\nfrom tests.helper import y\n",
        "tests/test_c.py": "def f():\n    from .test_a import g\n    from tests.test_c import h\n",
        "tests/ops/__init__.py": "",
        "tests/ops/test_d.py": "from ..test_b import z\nfrom tests.ops import test_e\n",
        "tests/ops/test_e.py": "from tests.conftest import q\nfrom tests.helper import r\n",
        "tests/scenarios.py": "from tests.test_c import f\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    offenders = _test_file_imports(sorted(tmp_path.rglob("*.py")), root=tmp_path)
    assert sorted(offenders) == ["tests/ops/test_d.py imports tests.ops.test_e",
                                 "tests/ops/test_d.py imports tests.test_b", "tests/scenarios.py imports tests.test_c",
                                 "tests/test_a.py imports tests.test_b", "tests/test_b.py imports tests.test_c",
                                 "tests/test_c.py imports tests.test_a"], offenders


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


def _import_structure():
    return load_file("import_structure", ROOT / "benchmarks" / "import_structure.py", register=True)


def _write_package(root: Path, files: dict[str, str]) -> None:
    """A ``gaengine`` package under ``root``: each of ``files`` (a path inside the package -> its text) written."""
    for name, text in files.items():
        (root / "gaengine" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "gaengine" / name).write_text(text)


def test_import_structure_of_a_known_package(tmp_path):
    """benchmarks/import_structure.py on a package whose floors, arrows back up and cycles are known by hand."""
    files = {
        "__init__.py": "from gaengine.top import run\nfrom gaengine import _C\n",
        "low.py": "import torch\nimport gaengine.kernels\n",
        "mid.py": "from gaengine.low import x\n"
                  "def f():\n    from gaengine.top import run\n    from . import side\n",
        "side.py": "from .low import y\n",
        "top.py": "from gaengine import mid\nfrom typing import TYPE_CHECKING\n"
                  "if TYPE_CHECKING:\n    from gaengine.side import z\n",
        "tools/__init__.py": "",
        "tools/cli.py": "import gaengine\nfrom gaengine.tools import helper\n",
        "tools/helper.py": "def g():\n    from gaengine.tools.cli import main\n",
    }
    _write_package(tmp_path, files)
    whole, library = _import_structure().analyse(None, root=tmp_path)
    # low 1, side 2, mid 2, top 3, __init__ 4; tools 1, helper 1, cli 5 (imports __init__ at module level)
    assert whole.floors == {"gaengine.low": 1, "gaengine.side": 2, "gaengine.mid": 2, "gaengine.top": 3,
                            "gaengine": 4, "gaengine.tools": 1, "gaengine.tools.helper": 1, "gaengine.tools.cli": 5}
    assert whole.num_floors == 5 and library.num_floors == 4
    back = {(a.source, a.target, a.kind) for a in whole.back_up()}
    assert back == {("gaengine.mid", "gaengine.top", "lazy"), ("gaengine.mid", "gaengine.side", "lazy"),
                    ("gaengine.tools.helper", "gaengine.tools.cli", "lazy")}
    assert whole.cycles == [] and sorted(whole.all_cycles) == [["gaengine.mid", "gaengine.top"],
                                                               ["gaengine.tools.cli", "gaengine.tools.helper"]]
    assert library.all_cycles == [["gaengine.mid", "gaengine.top"]]
    assert {a.kind for a in whole.arrows if a.target == "gaengine.side" and a.source == "gaengine.top"} == {"typing"}


def test_the_library_has_no_import_cycle():
    """The working tree's library (gaengine/ without tools/ and __main__) has no import cycle, lazy imports
    included; the script runs on a revision too."""
    whole, library = _import_structure().analyse(None)
    assert len(library.modules) > 10
    assert library.all_cycles == [], library.all_cycles
    rev = ["--rev", "HEAD"] if (ROOT / ".git").exists() else []  # a copy without git history: the working tree
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "import_structure.py"), *rev],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "floors" in out.stdout, out.stderr


def test_the_library_has_at_most_eight_floors():
    """The library's longest chain of module-level imports (benchmarks/import_structure.py's floors) is at most 8: an
    import made only for annotations sits under ``TYPE_CHECKING`` (the hooks name the reducer they call, which sits
    above them)."""
    _, library = _import_structure().analyse(None)
    assert library.num_floors <= 8, {m: f for m, f in library.floors.items() if f == library.num_floors}


# A test's nn.Module lives in tests/models.py, one definition each, so that models are found and shared, not copied
# under another name (``_MLP`` twice, ``Net`` three times before). A module of a framework that skips without its
# optional package (Lightning's ``LightningModule``) stays with the tests that import that package.
_FRAMEWORK_MODULES = {"LightningModule"}


def _module_classes_outside_models(files: list[Path], root: Path = ROOT) -> list[str]:
    """``"<file>:<line> <class>"`` for each class of ``files`` (nested ones included) that derives from a name ending
    in ``Module`` (``nn.Module``, ``torch.nn.Module``, an alias) other than a framework's, outside tests/models.py."""
    offenders = []
    for path in files:
        if path.name == "models.py" and path.parent.name == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            if any(b.endswith("Module") and b not in _FRAMEWORK_MODULES for b in bases):
                offenders.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return offenders


def test_test_models_live_in_models_py():
    files = sorted(TESTS.rglob("*.py"))
    offenders = _module_classes_outside_models(files)
    assert not offenders, ("an nn.Module defined in a test module: move it into tests/models.py (one definition, "
                           "parametrized by what differs) and import it from there:\n" + "\n".join(offenders))


def test_the_checker_sees_test_models(tmp_path):
    """Every spelling of a module class is caught outside tests/models.py (nested, aliased base), and tests/models.py
    itself and a LightningModule are not."""
    files = {
        "tests/models.py": "from torch import nn\nclass Net(nn.Module):\n    pass\n",
        "tests/test_a.py": "import torch\nclass _MLP(torch.nn.Module):\n    pass\n",
        "tests/test_b.py": "from torch.nn import Module\ndef test():\n    class Tied(Module):\n        pass\n",
        "tests/helper.py": "import lightning.pytorch as pl\nclass R(pl.LightningModule):\n    pass\n"
                           "class Plain:\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    offenders = _module_classes_outside_models(sorted(tmp_path.rglob("*.py")), root=tmp_path)
    assert offenders == ["tests/test_a.py:2 _MLP", "tests/test_b.py:3 Tied"], offenders


# The engine is the pipeline's driver, at the top of the library: a stage is given the parts it works on and never
# names the engine, not even for annotations (an import under TYPE_CHECKING is a cycle in the type graph: the hub
# hidden). The package's __init__, the integrations and the tools stand on it (its public API); verify.py's lazy import
# checks the engine from above it.
_STANDING_ON_THE_ENGINE = ("gaengine.integrations", "gaengine.tools")


def _engine_importers(arrows) -> list[str]:
    """``"<module>:<line> (<kind>)"`` for each module-level or ``TYPE_CHECKING`` import of ``gaengine.engine`` by a
    module other than the engine, the package's ``__init__``, the integrations and the tools."""
    return sorted(f"{a.source}:{a.line} ({a.kind})" for a in arrows
                  if a.target == "gaengine.engine" and a.kind != "lazy" and a.source not in ("gaengine",
                                                                                             "gaengine.engine")
                  and not any(a.source == p or a.source.startswith(p + ".") for p in _STANDING_ON_THE_ENGINE))


def test_no_stage_imports_the_engine():
    whole, _ = _import_structure().analyse(None)
    assert any(a.target == "gaengine.engine" for a in whole.arrows), "expected gaengine/__init__.py to import it"
    offenders = _engine_importers(whole.arrows)
    assert not offenders, ("a library module imports gaengine.engine (at module level or under TYPE_CHECKING): give "
                           "it the stages it works on (or a Protocol, gaengine.stages.HasParts) instead:\n"
                           + "\n".join(offenders))


def test_the_checker_sees_engine_imports(tmp_path):
    """A TYPE_CHECKING import and a module-level one are caught; __init__, the integrations, the tools and a lazy
    import are not."""
    files = {
        "__init__.py": "from gaengine.engine import GradientAccumulator\n",
        "engine.py": "from gaengine import stage\n",
        "stage.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gaengine.engine import A\n",
        "other.py": "import gaengine.engine\n",
        "verify.py": "def f():\n    from gaengine.engine import GradientAccumulator\n",
        "integrations/__init__.py": "",
        "integrations/hf.py": "from gaengine.engine import GradientAccumulator\n",
        "tools/__init__.py": "",
        "tools/train.py": "from gaengine.engine import GradientAccumulator\n",
    }
    _write_package(tmp_path, files)
    whole, _ = _import_structure().analyse(None, root=tmp_path)
    assert _engine_importers(whole.arrows) == ["gaengine.other:1 (module)", "gaengine.stage:3 (typing)"]
