"""Every Python snippet of the documentation runs as written, on CPU (issue 34).

Each ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` is run on its own, in a fresh namespace
(``__name__ == "__main__"``), with the repository root as the working directory and first on ``sys.path``, as
``python`` started there would run it. A failure points at the document and the line of the block.

How a block gets what it uses (the rules, each visible in the Markdown source):

* **It is complete**: it defines or imports everything it uses (the README's Quick start).
* **It is a fragment** (``model``, ``optimizer``, ``path``, ... come from the surrounding text): an HTML comment,
  invisible on the rendered page, declares the set-up code, which runs first in the block's namespace::

      <!-- snippet-setup: what it stands for
      import torch, gaengine
      model = torch.nn.Linear(4, 2)
      -->

  Its first line is ``<!-- snippet-setup`` (the rest of that line is a description), the code is the lines
  up to ``-->``. It applies to every ``python`` block after it on the same page, until the next
  ``snippet-setup`` comment replaces it (an empty one ends it). Nothing else is implicit: blocks never
  share a namespace, so no block depends on having run after another.
* **It cannot run on CPU in one process** (a multi-rank or GPU job): its first line says so, visibly, with the
  reason, ``# (not run by tests/test_docs_snippets.py: <reason>)``, and it is reported as skipped with it.

The set-up stands in for the reader's objects with tiny ones (a few-thousand-parameter model, a few micro-batches)
and writes files only under the test's temporary folder (``tempfile`` points there), so the whole file takes a few
seconds. ```` ```diff ```` blocks (``docs/integrations/*.md``: a plain-PyTorch or trainer script turned into its
gaengine form) are checked without running a trainer: the code after the change parses, and each import the
change adds (a ``+`` line) runs, so the names it brings in exist.
"""

from __future__ import annotations

import ast
import re
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SETUP_START = "<!-- snippet-setup"
SKIP = re.compile(r"# \(not run by tests/test_docs_snippets\.py: (?P<reason>.+)\)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, the line of its first code line (1-based), its code and language, and the
    set-up in force for it (with the line of its first code line), or ``None``."""

    page: Path
    line: int
    language: str
    code: str
    setup: str | None = None
    setup_line: int = 0

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"


def extract(page: Path) -> list[Block]:
    """The ``python`` and ``diff`` blocks of ``page``, in order, each with the set-up in force for it."""
    lines = page.read_text().splitlines()
    blocks, setup, setup_line, i = [], None, 0, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(SETUP_START):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            assert end is not None, f"{page}:{i + 1}: a snippet-setup comment without its -->"
            body = "\n".join(lines[i + 1:end])
            setup, setup_line = (body, i + 2) if body.strip() else (None, 0)
            i = end + 1
            continue
        fence = re.match(r"```(\w*)\s*$", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence.group(1) in ("python", "diff"):
                code = "\n".join(lines[i + 1:end]) + "\n"
                blocks.append(Block(page, i + 2, fence.group(1), code, setup, setup_line))
            i = end + 1
            continue
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in extract(page)]
PYTHON = [b for b in BLOCKS if b.language == "python"]
DIFFS = [b for b in BLOCKS if b.language == "diff"]


def _compiled(code: str, page: Path, line: int):
    """``code`` compiled as lines ``line...`` of ``page``: a traceback shows the document's own line."""
    return compile("\n" * (line - 1) + code, str(page), "exec")


@pytest.fixture
def at_the_root(monkeypatch, tmp_path):
    """The repository root as the working directory and first on ``sys.path``; ``tempfile``'s folder under
    ``tmp_path``; one torch thread (the snippets are tiny: more threads only contend with other tests)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_docs_have_snippets():
    """The extraction finds the blocks (a changed fence or comment syntax would otherwise test nothing)."""
    pages = {b.page.relative_to(ROOT).as_posix() for b in PYTHON}
    assert {"README.md", "docs/accumulator.md", "docs/checkpoints.md", "docs/pitfalls.md"} <= pages
    assert len(PYTHON) >= 10 and len(DIFFS) >= 3
    assert any(b.setup for b in PYTHON) and any(SKIP.match(b.code.splitlines()[0]) for b in PYTHON)


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_snippet_runs(block, at_the_root):
    skip = SKIP.match(block.code.splitlines()[0])
    if skip:
        pytest.skip(f"{block.id}: {skip.group('reason')}")
    namespace = {"__name__": "__main__"}
    if block.setup is not None:
        exec(_compiled(block.setup, block.page, block.setup_line), namespace)  # noqa: S102 - the doc's own set-up
    exec(_compiled(block.code, block.page, block.line), namespace)  # noqa: S102 - the snippet under test


def _after(diff: str) -> tuple[str, list[str]]:
    """The code after the change (context and ``+`` lines) and the ``+`` lines alone, the marker column removed."""
    after, added = [], []
    for line in diff.splitlines():
        marker, text = line[:1], line[1:]
        if marker in (" ", "+", ""):
            after.append(text)
        if marker == "+":
            added.append(text)
    return textwrap.dedent("\n".join(after)), added


@pytest.mark.parametrize("block", DIFFS, ids=[b.id for b in DIFFS])
def test_diff_snippet_parses_and_its_imports_run(block, at_the_root):
    after, added = _after(block.code)
    ast.parse(after, filename=block.id)  # a SyntaxError names the line
    imports = [line.strip() for line in added if re.match(r"\s*(from \S+ )?import ", line)]
    assert imports, f"{block.id}: the change adds no import to check"
    namespace: dict = {}
    for statement in imports:
        exec(statement, namespace)  # noqa: S102 - an ImportError names the missing module or name
    for name in ast.walk(ast.parse(after)):
        if isinstance(name, ast.Name) and name.id.startswith("Gaengine"):
            assert name.id in namespace, f"{block.id}: {name.id} is used but not imported by the change"


@pytest.mark.parametrize("page", ["README.md", "docs/accumulator.md"])
def test_the_documented_defaults_are_the_constructors(page):
    """The constructor call that lists "the defaults" (README.md, docs/accumulator.md) passes each argument at the
    value that ``GradientAccumulator``'s signature and ``AccumulatorConfig``'s fields default it to: running it
    (above) shows the values are accepted, this that they are the defaults."""
    import dataclasses
    import inspect

    from gaengine import AccumulatorConfig, GradientAccumulator

    block = next(b for b in PYTHON if b.page == ROOT / page and b.code.startswith("gaengine.GradientAccumulator("))
    call = ast.parse(block.code).body[0].value
    defaults = {f.name: f.default for f in dataclasses.fields(AccumulatorConfig)}
    defaults.update({name: p.default for name, p in inspect.signature(GradientAccumulator).parameters.items()
                     if p.default is not inspect.Parameter.empty})
    documented = {kw.arg: eval(compile(ast.Expression(kw.value), page, "eval"), {"torch": torch})
                  for kw in call.keywords}
    assert len(documented) >= 15
    assert {name: defaults.get(name, "<no such argument>") for name in documented} == documented


def test_a_failing_snippet_fails_and_points_at_its_line(tmp_path, at_the_root):
    """The runner itself: a fragment without its set-up fails with a ``NameError`` whose traceback names the page
    and the block's line; with the set-up it runs; a marked block is skipped with its reason."""
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```python\nacc = model * 2\n```\n\n<!-- snippet-setup: a stand-in\nmodel = 21\n"
                    "-->\n\n```python\nassert model * 2 == 42\n```\n\n```python\n"
                    "# (not run by tests/test_docs_snippets.py: needs two GPUs)\nraise SystemExit\n```\n")
    bare, with_setup, marked = extract(page)
    assert (bare.line, bare.setup, with_setup.setup, with_setup.setup_line) == (4, None, "model = 21", 8)
    with pytest.raises(NameError, match="model") as exc:
        test_python_snippet_runs(bare, None)
    assert (exc.traceback[-1].path, exc.traceback[-1].lineno + 1) == (page, 4)
    test_python_snippet_runs(with_setup, None)
    with pytest.raises(pytest.skip.Exception, match="needs two GPUs"):
        test_python_snippet_runs(marked, None)
