"""``import gaengine`` works from any working directory, the folder that contains the clone included.

With the clone named ``gaengine`` and the working directory its parent, ``''`` (the working directory, first on
``sys.path`` for ``python -c`` and ``python -m``) holds a folder ``gaengine/`` without ``__init__.py``: a namespace
portion. An editable install that setuptools implements as a finder appended to ``sys.meta_path`` loses to it
(``PathFinder`` runs first and returns the namespace package when no regular package is on ``sys.path``:
``module 'gaengine' has no attribute 'GradientAccumulator'``, pypa/setuptools#3557). ``setup.py`` keeps every package
under ``gaengine/`` and maps only ``""``, so the editable install is a path entry, and a regular package found
anywhere on ``sys.path`` wins over a namespace portion found earlier. A wheel install is a regular package too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

PROBE = "import gaengine, sys; sys.stdout.write(repr((gaengine.__file__, gaengine.GradientAccumulator.__name__)))"


def _import_from(cwd) -> tuple[str, str]:
    """``(gaengine.__file__, 'GradientAccumulator')`` as a fresh interpreter sees them from ``cwd``, with no
    ``PYTHONPATH``: the install alone decides (``-I`` would also drop ``cwd`` from ``sys.path``, hiding the case)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"import gaengine from {cwd} failed:\n{done.stderr}"
    return ast.literal_eval(done.stdout)


@pytest.mark.parametrize("folder", ["empty", "clone"])
def test_import_from_a_folder_that_holds_a_gaengine_folder(tmp_path, folder):
    """``empty``: an empty ``gaengine/``; ``clone``: what a clone's root looks like (no ``__init__.py`` at the top,
    the package one level down, itself without an ``__init__.py`` here so that it cannot be imported by mistake)."""
    (tmp_path / "gaengine").mkdir()
    if folder == "clone":
        (tmp_path / "gaengine" / "setup.py").write_text("raise SystemExit('not a package')\n")
        (tmp_path / "gaengine" / "gaengine").mkdir()
        (tmp_path / "gaengine" / "gaengine" / "engine.py").write_text("raise ImportError('the wrong gaengine')\n")
    where, name = _import_from(tmp_path)
    assert name == "GradientAccumulator"
    assert os.path.basename(where) == "__init__.py" and not where.startswith(str(tmp_path)), where



# ------------------------------------------------------------------------------ gaengine._C is required
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("setting, message", [("0", "GAENGINE_BUILD_EXT=0 .* is no longer possible"),
                                              ("yes", "GAENGINE_BUILD_EXT must be auto or 1, got 'yes'")])
def test_an_install_without_the_extension_is_refused(setting, message):
    """``setup.py`` with ``GAENGINE_BUILD_EXT=0`` (the pure-Python install of earlier versions) or a wrong value
    stops before building anything, naming the variable and what it takes (nothing is built: ``--name`` would
    print the name and exit 0 if ``main()`` got past the check)."""
    import re  # noqa: PLC0415

    env = {**os.environ, "GAENGINE_BUILD_EXT": setting}
    done = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and re.search(message, done.stderr), (done.returncode, done.stderr[-2000:])


def test_the_accumulator_without_the_extension_says_how_to_build_it(monkeypatch):
    """An install whose ``gaengine._C`` does not load (deleted, or never built): constructing the accumulator raises
    ``RuntimeError`` naming the reason and the reinstall command, on every backend, instead of running other hooks."""
    import torch  # noqa: PLC0415

    import gaengine  # noqa: PLC0415
    from gaengine import backends  # noqa: PLC0415

    why = "gaengine._C is not built (No module named 'gaengine._C')"
    monkeypatch.setattr(backends, "load_extension", lambda: (None, why))
    for backend in ("torch", "triton"):
        try:
            backends.get_backend(backend, "cpu")
        except (ImportError, RuntimeError):
            continue  # triton not installed here
        with pytest.raises(RuntimeError, match=rf"cannot run for backend '{backend}': .*not built.*"
                                               r"pip install --no-build-isolation -e \."):
            gaengine.GradientAccumulator(torch.nn.Linear(2, 2), None, accumulation_steps=2, backend=backend)


# ------------------------------------------------------------------------------ the build keeps working
# The PEP 517 metadata step (what pip runs first): pyproject.toml and setup.py read and checked, nothing compiled.
# Every warning is recorded, then the deprecations printed, one a line, and the step's own output kept.
_METADATA_STEP = """
import sys, warnings
from setuptools import build_meta
from setuptools.warnings import SetuptoolsDeprecationWarning
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    name = build_meta.prepare_metadata_for_build_wheel(sys.argv[1])
deprecated = (DeprecationWarning, PendingDeprecationWarning, FutureWarning, SetuptoolsDeprecationWarning)
for w in caught:
    if issubclass(w.category, deprecated):
        print("DEPRECATION", w.category.__name__, str(w.message).splitlines()[0])
print("DIST-INFO", name)
"""


def test_the_build_metadata_step_prints_no_deprecation_warning(tmp_path):
    """setuptools announces what it will stop reading (``project.license`` as a TOML table: unsupported from
    2027-02-18) as a deprecation warning in the build log; any such warning fails here, while there is time to fix
    it. The metadata step runs ``setup.py`` as pip does (about 5 s: it imports torch), in a copy of the sources so
    that nothing is written into the clone; the metadata says the license as the SPDX expression."""
    import shutil  # noqa: PLC0415

    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(os.path.join(ROOT, "gaengine"), tmp_path / "gaengine",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    (tmp_path / "metadata").mkdir()
    done = subprocess.run([sys.executable, "-c", _METADATA_STEP, str(tmp_path / "metadata")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "DEPRECATION" not in log and "deprecat" not in log.lower(), log[-3000:]
    dist_info = done.stdout.split("DIST-INFO ")[-1].strip()
    metadata = (tmp_path / "metadata" / dist_info / "METADATA").read_text()
    assert "License-Expression: BSD-3-Clause" in metadata and "License-File: LICENSE" in metadata, metadata[:1500]


def test_the_makefile_installs_the_build_tools_pyproject_requires():
    """``make``'s build tools (``BUILD_TOOLS``) are pyproject.toml's ``[build-system] requires`` less torch (which
    ``TORCH_SPEC`` pins): the same tested ranges, so that ``make`` and ``pip wheel .`` build with the same tools."""
    import re  # noqa: PLC0415
    import shlex  # noqa: PLC0415

    try:
        import tomllib  # noqa: PLC0415
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib  # noqa: PLC0415
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    match = re.search(r"^BUILD_TOOLS := (.*)$", makefile, re.M)
    assert match, "the Makefile defines no BUILD_TOOLS"
    assert shlex.split(match.group(1)) == [r for r in requires if r != "torch"]
    for r in requires:  # each tool pinned to a range: a lower and an upper bound
        assert r == "torch" or re.fullmatch(r"[a-z0-9]+>=[0-9.]+,<[0-9.]+", r), r
