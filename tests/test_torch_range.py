"""The torch range gaengine claims (setup.py's ``TORCH_SPEC``) is the one pyproject.toml declares and docs/install.md
states; an install against an older torch stops before compiling with a message that names the torch found and
the range (setup.py run against a fake ``torch`` package: nothing compiles); no version-dependent access to torch
outside ``gaengine/compat.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version, refused", [
    ("2.8.1", True), ("2.6.0+cu124", True), ("1.13.1", True), ("2.9.0", False), ("2.9.1+cu128", False),
    ("2.10.0a0+git1234abc", False), ("2.13.0+cpu", False), ("2.14.1", False), ("2.16.0", False), ("nightly", True),
])
def test_torch_version_problem(setup_py, version, refused):
    problem = setup_py.torch_version_problem(version)
    assert (problem is not None) == refused, problem
    if refused:
        assert setup_py.TORCH_SPEC in problem and repr(version) in problem or f"torch {version}" in problem


@pytest.mark.parametrize("version, standard", [("2.9.1", "c++17"), ("2.13.0+cpu", "c++17"), ("2.14.1", "c++20"),
                                               ("2.15.0a0+git", "c++20")])
def test_cxx_standard(setup_py, version, standard):
    """torch 2.14's headers stop below C++20 (``#error C++20 or later compatible compiler is required``)."""
    assert setup_py.cxx_standard(version) == standard


def test_the_range_is_declared_once(setup_py):
    pyproject = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'dependencies = \[\s*"(torch[^"]*)"', pyproject).group(1)
    assert spec == setup_py.TORCH_SPEC == "torch>=2.9,<2.15"
    assert f"`{setup_py.TORCH_SPEC}`" in (ROOT / "docs" / "install.md").read_text()


FAKE_TORCH = {
    "torch/__init__.py": "__version__ = {version!r}\nclass version:\n    cuda = None\n",
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": ("CUDA_HOME = None\nclass BuildExtension:\n    pass\n"
                                     "def CppExtension(*a, **k):\n    raise SystemExit('compiling: not refused')\n"
                                     "CUDAExtension = CppExtension\n"),
}


@pytest.mark.parametrize("version", ["2.8.0", "2.9.0"])
def test_install_refuses_an_older_torch(tmp_path, version):
    """setup.py against a fake torch 2.8.0 exits before any extension is made, naming the version and the range;
    against 2.9.0 it goes on to make the extension (where the fake stops it)."""
    for name, text in FAKE_TORCH.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.format(version=version))
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "build_ext"], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode != 0
    if version == "2.8.0":
        assert "gaengine needs torch>=2.9,<2.15, found torch 2.8.0" in proc.stderr, proc.stderr
        assert "compiling" not in proc.stderr
    else:
        assert "compiling: not refused" in proc.stderr, proc.stderr


# What reads a version of torch, or asks whether torch has an API, outside compat.py
VERSION_DEPENDENT = re.compile(r"torch\.__version__\s*[<>=]|hasattr\(\s*(torch|dist|torch\.\w+)\b[^)]*\)|"
                               r"getattr\(\s*(torch|dist)(\.\w+)*\s*,\s*\"[^\"]+\"\s*,\s*None\)|"
                               r"TorchVersion|torch_version|version\.parse")


def test_version_dependent_access_goes_through_compat():
    found = []
    for path in sorted((ROOT / "gaengine").rglob("*.py")):
        if path.name == "compat.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if VERSION_DEPENDENT.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def _shell_array(name: str) -> list[str]:
    """The entries of the bash array ``name=( ... )`` in .ci/torch_range.sh (comments and quotes dropped)."""
    text = (ROOT / ".ci" / "torch_range.sh").read_text()
    body = re.search(rf"^{name}=\(\n(.*?)^\)", text, re.S | re.M).group(1)
    return [word.strip('"') for line in body.splitlines() for word in line.split("#")[0].split()]


def test_ci_subset_names_tests_that_exist():
    """Every entry of SMOKE_CI_TESTS (what CI runs against the oldest and the newest torch) is a test file of the
    suite, or a test function of one (a renamed test would otherwise fail only in CI's last minutes, after the
    suite), and lies in a file of the full smoke subset (SMOKE_TESTS)."""
    full = _shell_array("SMOKE_TESTS")
    entries = _shell_array("SMOKE_CI_TESTS")
    assert len(entries) >= 5
    problems = []
    for entry in entries:
        path, _, function = entry.partition("::")
        function = function.split("[")[0]
        if not (ROOT / path).is_file():
            problems.append(f"{entry}: no file {path}")
            continue
        if function and not re.search(rf"^def {re.escape(function)}\(", (ROOT / path).read_text(), re.M):
            problems.append(f"{entry}: {path} has no test {function}")
        if not any(path == f or path.startswith(f.rstrip("/") + "/") for f in full):
            problems.append(f"{entry}: {path} is not in SMOKE_TESTS")
    assert not problems, "\n".join(problems)


def test_ci_runs_the_range_at_both_ends(setup_py):
    """.ci/run builds against both ends beside the suite and runs the CI subset after it, failing the run on
    either; torch_range.sh's ci halves name the oldest and the newest versions setup.py declares."""
    run = (ROOT / ".ci" / "run").read_text()
    assert "torch_range.sh ci-build" in run and "torch_range.sh ci-test" in run
    assert run.index("make test") < run.index("torch_range.sh ci-test")
    text = (ROOT / ".ci" / "torch_range.sh").read_text()
    ci_build = re.search(r"^ci-build\)\n(.*?);;", text, re.S | re.M).group(1)
    newest, oldest = re.findall(r"prepare (\S+)", ci_build)
    floor, ceiling = setup_py.TORCH_FLOOR, setup_py.TORCH_CEILING
    assert tuple(map(int, oldest.split(".")[:2])) == floor
    assert tuple(map(int, newest.split(".")[:2])) == (ceiling[0], ceiling[1] - 1)
    ci_tests = re.search(r"^ci_tests\(\) \{\n(.*?)^\}", text, re.S | re.M).group(1)
    assert sorted(re.findall(r"run_subset (\S+) ci", ci_tests)) == sorted([newest, oldest])
