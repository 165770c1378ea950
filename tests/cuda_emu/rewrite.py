"""The one source rewrite the CUDA emulation needs: kernel launches, which g++ cannot parse.

``kernel<<<grid, block[, shmem[, stream]]>>>(args...)`` becomes
``::gaemu::launch(&kernel, "kernel", grid, block[, shmem[, stream]])(args...)`` (tests/cuda_emu/include/gaemu.h),
character for character elsewhere, newlines kept: compiler and sanitizer reports point at the original lines (a
``#line 1 "<original path>"`` directive heads the output). The kernel name may be qualified and carry template
arguments (``accumulate_kernel<src_t, true, true>``).

Grid caps (``grid_caps``, default ``("kMaxBlocks",)``): the definition ``constexpr <type> <name> = <expr>;`` becomes
``inline const <type> <name> = ::gaemu::max_grid<type>(<expr>);``, so ``GAENGINE_EMU_MAX_GRID`` lowers the grid
cap a launcher reads (kernels/common.cuh ``kMaxBlocks``, used by host code only) at run time. A named cap that is not
defined in a file is an error only when ``require_caps`` is true.

Everything else compiles as written. The kernels are a tree: ``csrc/cuda/kernels.cuh``, an umbrella that includes
``kernels/*.cuh`` (one header per family) by quoted relative paths, so ``rewrite_tree(umbrella, out_dir)`` rewrites
the umbrella and every ``.cuh`` below its directory into ``out_dir`` at the same relative paths: an includer of the
rewritten umbrella finds only rewritten headers (a quoted include is looked up first beside the file that includes
it, whatever its ``#line`` says). A grid cap must then be defined once in the whole tree. Command line::

    python tests/cuda_emu/rewrite.py SRC OUT [--no-caps] [--require-caps]

writes the rewritten SRC to OUT (a file, or a directory that receives SRC's basename) and prints the number of
launches rewritten; with ``--tree``, SRC is an umbrella and OUT a directory that receives its tree. From Python:
``rewrite(text) -> (text, n_launches)``, ``rewrite_file(src, out) -> n_launches``, ``tree_files(umbrella) -> [relative
paths]``, ``rewrite_tree(umbrella, out_dir) -> n_launches``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

GRID_CAPS = ("kMaxBlocks",)
_OPEN, _CLOSE = {"(": ")", "[": "]", "{": "}"}, {")": "(", "]": "[", "}": "{"}


class RewriteError(ValueError):
    pass


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _kernel_start(text: str, end: int) -> int:
    """Start of the kernel expression ending at ``end`` (exclusive): an identifier, ``::`` qualifiers and a
    balanced template-argument list."""
    i = end
    while i > 0 and text[i - 1].isspace():
        i -= 1
    if i > 0 and text[i - 1] == ">":  # template arguments: walk back to the matching '<' (outside parentheses)
        depth = parens = 0
        while i > 0:
            i -= 1
            c = text[i]
            if c in ")]":
                parens += 1
            elif c in "([":
                parens -= 1
            elif parens == 0 and c == ">":
                depth += 1
            elif parens == 0 and c == "<":
                depth -= 1
                if depth == 0:
                    break
        else:
            raise RewriteError(f"line {_line(text, end)}: unbalanced template arguments before <<<")
        while i > 0 and text[i - 1].isspace():
            i -= 1
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_:"):
        j -= 1
    if j == i:
        raise RewriteError(f"line {_line(text, end)}: no kernel name before <<<")
    return j


def _balanced(text: str, start: int, close: str) -> int:
    """Index of the ``close`` that ends the group opened just before ``start`` (brackets nested, strings skipped)."""
    stack = [close]
    i = start
    while i < len(text):
        c = text[i]
        if c in "\"'":
            q, i = c, i + 1
            while text[i] != q:
                i += 2 if text[i] == "\\" else 1
        elif c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if c != stack[-1]:
                raise RewriteError(f"line {_line(text, i)}: unbalanced {c!r}")
            stack.pop()
            if not stack:
                return i
        i += 1
    raise RewriteError(f"line {_line(text, start)}: unterminated group")


def _config_end(text: str, start: int) -> int:
    """Index of the ``>>>`` closing a launch configuration that starts at ``start``."""
    depth = 0
    i = start
    while i < len(text):
        if text.startswith(">>>", i) and depth == 0:
            return i
        c = text[i]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        i += 1
    raise RewriteError(f"line {_line(text, start)}: <<< without >>>")


def rewrite_launches(text: str) -> tuple[str, int]:
    out, pos, n = [], 0, 0
    while True:
        k = text.find("<<<", pos)
        if k < 0:
            out.append(text[pos:])
            return "".join(out), n
        start = _kernel_start(text, k)
        if start < pos:
            raise RewriteError(f"line {_line(text, k)}: overlapping launches")
        kernel = text[start:k].rstrip()
        cfg_end = _config_end(text, k + 3)
        config = text[k + 3:cfg_end]
        p = cfg_end + 3
        while p < len(text) and text[p].isspace():
            p += 1
        if p >= len(text) or text[p] != "(":
            raise RewriteError(f"line {_line(text, k)}: a launch configuration not followed by an argument list")
        name = " ".join(kernel.split()).replace('"', "")
        # The config keeps its own newlines; the name string has none.
        out.append(text[pos:start])
        out.append(f'::gaemu::launch(&{kernel}, "{name}", {config.strip()})')
        out.append("\n" * config.count("\n"))
        out.append(text[cfg_end + 3:p])
        pos = p
        n += 1


def rewrite_caps(text: str, caps=GRID_CAPS, require: bool = True) -> str:
    for name in caps:
        pattern = re.compile(rf"\bconstexpr\s+([\w:]+)\s+{re.escape(name)}\s*=\s*([^;]+);")
        matches = pattern.findall(text)
        if len(matches) > 1:
            raise RewriteError(f"grid cap {name} is defined {len(matches)} times")
        if not matches:
            if require:
                raise RewriteError(f"grid cap {name} is not defined as `constexpr <type> {name} = <expr>;`")
            continue
        text = pattern.sub(lambda m: f"inline const {m.group(1)} {name} = ::gaemu::max_grid<{m.group(1)}>({m.group(2)});",
                           text)
    return text


def rewrite(text: str, caps=GRID_CAPS, require_caps: bool = False) -> tuple[str, int]:
    text, n = rewrite_launches(text)
    return rewrite_caps(text, caps, require_caps), n


def _with_line(src: str, text: str) -> str:
    return f'#line 1 "{os.path.abspath(src)}"\n' + text


def _write(path: str, text: str, only_if_changed: bool = False) -> None:
    """Write ``text`` to ``path`` (atomically); with ``only_if_changed``, not when it holds ``text`` already (ninja
    then sees nothing new)."""
    if only_if_changed:
        try:
            with open(path) as f:
                if f.read() == text:
                    return
        except OSError:
            pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def rewrite_file(src: str, out: str, caps=GRID_CAPS, require_caps: bool = False) -> int:
    with open(src) as f:
        text = f.read()
    new, n = rewrite(text, caps, require_caps)
    if os.path.isdir(out):
        out = os.path.join(out, os.path.basename(src))
    _write(out, _with_line(src, new))
    return n


def tree_files(umbrella: str) -> list[str]:
    """The umbrella's basename, then every other ``.cuh`` below its directory, as sorted relative paths."""
    root = os.path.dirname(os.path.abspath(umbrella))
    top = os.path.basename(umbrella)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if name.endswith(".cuh") and rel != top:
                found.append(rel)
    return [top] + sorted(found)


def rewrite_tree(umbrella: str, out_dir: str, caps=GRID_CAPS, require_caps: bool = False,
                 only_if_changed: bool = False) -> int:
    """Rewrite ``umbrella`` and every ``.cuh`` below its directory (``tree_files``) into ``out_dir`` at the same
    relative paths, each headed by a ``#line`` to its original; returns the launches rewritten. With
    ``require_caps``, each grid cap must be defined exactly once in the tree (a ``RewriteError`` otherwise)."""
    root = os.path.dirname(os.path.abspath(umbrella))
    outputs, defined, n = {}, dict.fromkeys(caps, 0), 0
    for rel in tree_files(umbrella):
        src = os.path.join(root, rel)
        with open(src) as f:
            text = f.read()
        for name in caps:
            defined[name] += len(re.findall(rf"\bconstexpr\s+[\w:]+\s+{re.escape(name)}\s*=", text))
        try:
            new, k = rewrite(text, caps)
        except RewriteError as e:
            raise RewriteError(f"{rel}: {e}") from None
        outputs[rel], n = _with_line(src, new), n + k
    if require_caps:
        wrong = {name: count for name, count in defined.items() if count != 1}
        if wrong:
            raise RewriteError(f"grid caps not defined exactly once as `constexpr <type> <name> = <expr>;` in the "
                               f"tree of {umbrella}: {wrong}")
    for rel, text in outputs.items():
        _write(os.path.join(out_dir, rel), text, only_if_changed)
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--no-caps", action="store_true", help="leave grid caps as written")
    parser.add_argument("--require-caps", action="store_true", help="fail when a grid cap is not defined")
    parser.add_argument("--tree", action="store_true",
                        help="SRC is an umbrella header: rewrite it and every .cuh below its directory into OUT")
    args = parser.parse_args(argv)
    caps = () if args.no_caps else GRID_CAPS
    try:
        if args.tree:
            n = rewrite_tree(args.src, args.out, caps, args.require_caps)
        else:
            n = rewrite_file(args.src, args.out, caps, args.require_caps)
    except RewriteError as e:
        print(f"{args.src}: {e}", file=sys.stderr)
        return 1
    print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
