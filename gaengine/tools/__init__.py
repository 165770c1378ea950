"""Tools built on the gaengine library: the ``gaengine`` command (:mod:`gaengine.tools.cli`), the demo model
(:mod:`~gaengine.tools.model`), its data (:mod:`~gaengine.tools.data`), the training loops it runs
(:mod:`~gaengine.tools.train`) and the benchmarks (:mod:`gaengine.tools.bench`, one module per family).

The tools import the library; the library never imports the tools (``tests/test_layout.py``).
"""
