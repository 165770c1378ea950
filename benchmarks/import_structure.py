"""The import structure of the ``gaengine`` package: modules, floors, and the arrows that run back up.

    python benchmarks/import_structure.py [--rev REV] [--tool MODULE ...] [--json PATH]

Reads ``gaengine/**/*.py`` from the working tree, or with ``--rev`` from that git revision (``git ls-tree`` and
``git show``, nothing checked out), and parses every import of a module of the package with ``ast``:

* module level: run when the module is imported (in a class body, ``try`` or ``if`` at module level too);
* lazy: inside a function, run when the function is first called;
* typing: under ``if TYPE_CHECKING:``, never run (listed, left out of the layering).

An import names the module it reaches: ``from gaengine.a import b`` reaches ``gaengine.a.b`` when that is a
module of the package, else ``gaengine.a``; relative imports are resolved; the implicit import of parent
packages (``import gaengine.a`` runs ``gaengine/__init__.py`` first) is not counted. Imports of anything
outside the files read (``torch``, ``gaengine._C``; ``gaengine.kernels`` too at a revision from before the Triton
kernels moved from ``kernels/`` into ``gaengine/kernels/``) are not arrows.

Floors: ``floor(m) = 1 + max floor of what m imports at module level`` (1 for a module that imports none of
the package), computed on the strongly connected components, so that the modules of an import cycle share a
floor. The number of floors is the longest chain of module-level imports. An arrow runs back up when it goes
from a module to one on the same or a higher floor: a lazy import against the layering, or a module-level
import inside a cycle. Every cycle of the whole graph (module level and lazy together) is listed too.

The same figures are printed for the library alone: the package without ``gaengine.tools`` (the tools built
on the library; ``--tool`` names more, for a revision before they had their own folder) and
``gaengine.__main__`` (the entry point of ``python -m gaengine``).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gaengine"
KINDS = ("module", "lazy", "typing")


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` (both module names of the package); ``kind`` one of :data:`KINDS`; ``line``
    of the import statement in ``source``."""

    source: str
    target: str
    kind: str
    line: int


@dataclass
class Structure:
    """Modules, arrows, floors (module -> floor, from 1) and cycles of one set of modules."""

    modules: list[str]
    arrows: list[Arrow]
    floors: dict[str, int] = field(default_factory=dict)
    floors_with_lazy: dict[str, int] = field(default_factory=dict)  # the same, lazy imports counted as arrows
    cycles: list[list[str]] = field(default_factory=list)  # of the module-level graph
    all_cycles: list[list[str]] = field(default_factory=list)  # of module-level + lazy arrows

    @property
    def num_floors(self) -> int:
        return max(self.floors.values(), default=0)

    def back_up(self) -> list[Arrow]:
        """Arrows (module level or lazy) to a module on the same or a higher floor."""
        return [a for a in self.arrows if a.kind != "typing" and self.floors[a.target] >= self.floors[a.source]]


# ------------------------------------------------------------------------------------------------ reading
def read_sources(rev: str | None, root: Path = REPO_ROOT) -> dict[str, str]:
    """Path (relative to ``root``, ``gaengine/...``) -> source text of every ``gaengine/**/*.py``: from the
    working tree, or from git revision ``rev``. Raises RuntimeError (with git's message) for an unknown ``rev``."""
    if rev is None:
        return {p.relative_to(root).as_posix(): p.read_text() for p in sorted((root / PACKAGE).rglob("*.py"))}

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"git {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    paths = [p for p in git("ls-tree", "-r", "--name-only", rev, "--", PACKAGE).splitlines() if p.endswith(".py")]
    return {p: git("show", f"{rev}:{p}") for p in sorted(paths)}


def module_name(path: str) -> str:
    """``gaengine/tools/cli.py`` -> ``gaengine.tools.cli``; ``gaengine/tools/__init__.py`` -> ``gaengine.tools``."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """``(node, kind)`` for every import statement of ``tree``: ``module``, ``lazy`` (in a function) or
    ``typing`` (under ``if TYPE_CHECKING:``)."""

    def visit(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, "typing" if kind == "typing" else "lazy")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from visit(child, kind)

    yield from visit(tree, "module")


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{anchor}.{node.module}" if node.module else anchor


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (definitions, assignments, imports): what ``from it import x`` may
    take besides its submodules."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def arrows_of(sources: dict[str, str]) -> tuple[list[str], list[Arrow]]:
    """The modules of ``sources`` (path -> text) and every import between them. Raises SyntaxError naming the
    file that does not parse.

    ``from p import x`` with ``p`` a package of the set: an arrow to ``p.x`` when that is a module of the set, to
    ``p`` when its ``__init__`` binds ``x``, else none (``x`` is a submodule from elsewhere: ``gaengine._C``,
    ``gaengine.kernels``). A dotted name that is no module of the set (``import gaengine.kernels``) is no arrow.
    """
    trees = {module_name(p): (p, ast.parse(text, filename=p)) for p, text in sources.items()}
    packages = {m for m, (p, _) in trees.items() if p.endswith("__init__.py")}
    bound = {m: _top_level_names(tree) for m, (_, tree) in trees.items() if m in packages}
    arrows: set[Arrow] = set()
    for source, (path, tree) in trees.items():
        for node, kind in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(node, source, source in packages)
                targets = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in trees:
                        targets.append(sub)
                    elif base in trees and (base not in packages or alias.name in bound[base]):
                        targets.append(base)
            for target in targets:
                if target in trees and target != source:
                    arrows.add(Arrow(source, target, kind, node.lineno))
    # one arrow per (source, target, kind): the first line
    first: dict[tuple[str, str, str], Arrow] = {}
    for a in sorted(arrows, key=lambda a: (a.source, a.target, a.kind, a.line)):
        first.setdefault((a.source, a.target, a.kind), a)
    return sorted(trees), list(first.values())


# ------------------------------------------------------------------------------------------------ graph
def _components(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), each sorted; iterative, so any depth works."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                out.append(sorted(comp))
    return out


def structure(modules: list[str], arrows: list[Arrow]) -> Structure:
    """Floors and cycles of ``modules`` under ``arrows`` (arrows leaving the set are dropped)."""
    keep = set(modules)
    arrows = [a for a in arrows if a.source in keep and a.target in keep]
    s = Structure(sorted(modules), arrows)
    eager: dict[str, set[str]] = {}
    both: dict[str, set[str]] = {}
    for a in arrows:
        if a.kind == "module":
            eager.setdefault(a.source, set()).add(a.target)
        if a.kind != "typing":
            both.setdefault(a.source, set()).add(a.target)
    s.floors, s.cycles = _floors(s.modules, eager)
    s.floors_with_lazy, s.all_cycles = _floors(s.modules, both)
    return s


def _floors(modules: list[str], edges: dict[str, set[str]]) -> tuple[dict[str, int], list[list[str]]]:
    """Module -> floor (1 + the highest floor it imports, a cycle's modules sharing one), and the cycles."""
    comps = _components(modules, edges)  # Tarjan emits a component after every component it reaches
    comp_of = {m: i for i, comp in enumerate(comps) for m in comp}
    comp_floor: list[int] = []
    for i, comp in enumerate(comps):
        below = [comp_floor[comp_of[t]] for m in comp for t in edges.get(m, ()) if comp_of[t] != i]
        comp_floor.append(1 + max(below, default=0))
    return {m: comp_floor[comp_of[m]] for m in modules}, [c for c in comps if len(c) > 1]


def is_library(module: str, tools: Sequence[str] = ()) -> bool:
    """A module of the library: not a tool (``gaengine.tools``, or a module named in ``tools``, e.g. ``cli`` for
    a revision before the tools had their own folder), not a trainer integration (``gaengine.integrations``, built
    on the public API like the tools) and not the ``python -m gaengine`` entry point."""
    names = [f"{PACKAGE}.tools", f"{PACKAGE}.integrations", *(f"{PACKAGE}.{t}" for t in tools)]
    return not (module == f"{PACKAGE}.__main__" or any(module == n or module.startswith(n + ".") for n in names))


# ------------------------------------------------------------------------------------------------ report
def _short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".") if module != PACKAGE else f"{PACKAGE} (__init__)"


def report(s: Structure, title: str) -> str:
    """The figures of ``s`` as text: modules, floors (each listed), lazy imports, arrows back up, cycles."""
    lazy = [a for a in s.arrows if a.kind == "lazy"]
    typing = [a for a in s.arrows if a.kind == "typing"]
    up = s.back_up()
    higher = sum(s.floors[a.target] > s.floors[a.source] for a in up)
    lines = [f"{title}: {len(s.modules)} modules, {s.num_floors} floors "
             f"({max(s.floors_with_lazy.values(), default=0)} with the lazy imports as arrows), "
             f"{sum(a.kind == 'module' for a in s.arrows)} module-level imports, {len(lazy)} lazy, "
             f"{len(typing)} typing-only; {len(up)} arrows back up ({higher} to a higher floor, {len(up) - higher} "
             f"to the same floor); {len(s.cycles)} module-level cycles, {len(s.all_cycles)} cycles with the lazy "
             "imports"]
    for f in range(s.num_floors, 0, -1):
        lines.append(f"  floor {f:2d}: {', '.join(_short(m) for m in s.modules if s.floors[m] == f)}")
    for a in up:
        where = "up" if s.floors[a.target] > s.floors[a.source] else "same floor"
        lines.append(f"  back up ({a.kind}, {where}): {_short(a.source)}:{a.line} (floor {s.floors[a.source]}) -> "
                     f"{_short(a.target)} (floor {s.floors[a.target]})")
    for c in s.cycles:
        lines.append(f"  module-level cycle: {' <-> '.join(map(_short, c))}")
    for c in s.all_cycles:
        lines.append(f"  cycle with lazy imports: {' <-> '.join(map(_short, c))}")
    return "\n".join(lines)


def analyse(rev: str | None, root: Path = REPO_ROOT, tools: Sequence[str] = ()) -> tuple[Structure, Structure]:
    """``(whole package, library alone)`` at ``rev`` (None: the working tree); ``tools``: see :func:`is_library`."""
    modules, arrows = arrows_of(read_sources(rev, root))
    return structure(modules, arrows), structure([m for m in modules if is_library(m, tools)], arrows)


def _as_json(s: Structure) -> dict:
    return {"modules": len(s.modules), "floors": s.num_floors, "floor_of": s.floors,
            "floors_with_lazy": max(s.floors_with_lazy.values(), default=0),
            "arrows": [a.__dict__ for a in s.arrows], "back_up": [a.__dict__ for a in s.back_up()],
            "cycles": s.cycles, "cycles_with_lazy": s.all_cycles}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rev", default=None, metavar="REV",
                        help="git revision to read gaengine/**/*.py from (default: the working tree)")
    parser.add_argument("--tool", nargs="+", default=[], metavar="MODULE",
                        help="modules to count as tools besides gaengine.tools, e.g. 'cli train model data bench' "
                             "for a revision before gaengine/tools/ existed")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    try:
        whole, library = analyse(args.rev, tools=args.tool)
    except (RuntimeError, SyntaxError) as exc:
        print(f"import_structure: error: {exc}", file=sys.stderr)
        return 2
    if not whole.modules:
        print(f"import_structure: error: no {PACKAGE}/**/*.py at {args.rev or 'the working tree'}", file=sys.stderr)
        return 2
    where = args.rev or "working tree"
    print(report(whole, f"{PACKAGE} at {where}"))
    tools = ", ".join([f"{PACKAGE}.tools", *args.tool, f"{PACKAGE}.__main__"])
    print(report(library, f"library (without {tools}) at {where}"))
    if args.json is not None:
        args.json.write_text(json.dumps({"rev": args.rev, "package": _as_json(whole), "library": _as_json(library)},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
