"""The one source rewrite the CUDA emulation needs: kernel launches, which g++ cannot parse.

``kernel<<<grid, block[, shmem[, stream]]>>>(args...)`` becomes
``::gaemu::launch(&kernel, "kernel", grid, block[, shmem[, stream]])(args...)`` (tests/cuda_emu/include/gaemu.h),
character for character elsewhere, newlines kept: compiler and sanitizer reports point at the original lines (a
``#line 1 "<original path>"`` directive heads the output). The kernel name may be qualified and carry template
arguments (``accumulate_kernel<src_t, true, true>``).

Grid caps (``grid_caps``, default ``("kMaxBlocks",)``): the definition ``constexpr <type> <name> = <expr>;`` becomes
``inline const <type> <name> = ::gaemu::max_grid<type>(<expr>);``, so ``GAENGINE_EMU_MAX_GRID`` lowers the grid
cap a launcher reads (kernels.cuh ``kMaxBlocks``, used by host code only) at run time. A named cap that is not
defined in a file is an error only when ``require_caps`` is true.

Everything else compiles as written. Command line::

    python tests/cuda_emu/rewrite.py SRC OUT [--no-caps]

writes the rewritten SRC to OUT (a file, or a directory that receives SRC's basename) and prints the number of
launches rewritten. From Python: ``rewrite(text) -> (text, n_launches)``, ``rewrite_file(src, out) -> n_launches``.
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


def rewrite_file(src: str, out: str, caps=GRID_CAPS, require_caps: bool = False) -> int:
    with open(src) as f:
        text = f.read()
    new, n = rewrite(text, caps, require_caps)
    if os.path.isdir(out):
        out = os.path.join(out, os.path.basename(src))
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write(f'#line 1 "{os.path.abspath(src)}"\n')
        f.write(new)
    os.replace(tmp, out)
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--no-caps", action="store_true", help="leave grid caps as written")
    parser.add_argument("--require-caps", action="store_true", help="fail when a grid cap is not defined")
    args = parser.parse_args(argv)
    try:
        n = rewrite_file(args.src, args.out, () if args.no_caps else GRID_CAPS, args.require_caps)
    except RewriteError as e:
        print(f"{args.src}: {e}", file=sys.stderr)
        return 1
    print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
