"""Tools built on the gaengine library: the ``gaengine`` command (:mod:`gaengine.tools.cli`), the demo model
(:mod:`~gaengine.tools.model`), its data (:mod:`~gaengine.tools.data`), the training loops it runs
(:mod:`~gaengine.tools.train`) and the benchmarks (:mod:`gaengine.tools.bench`, one module per family).

The tools import the library; the library never imports the tools (``tests/test_layout.py``).
"""

from __future__ import annotations

import textwrap

WIDTH = 100
"""Columns of every line the ``gaengine`` command prints (``train``'s header and summary, ``info``, ``bench``'s
tables and notes): a long line is wrapped (:func:`fill`), a wide table is narrowed or split
(:func:`gaengine.tools.bench.common.print_table`). ``tests/test_cli.py`` and ``tests/test_bench.py`` check it."""


def fill(text: str, indent: str = "  ", width: int = WIDTH) -> str:
    """``text`` wrapped to ``width`` columns, the lines after the first indented by ``indent``. Lines break at
    spaces only: a path, a version or a hyphenated name stays whole (and may leave its line longer)."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
