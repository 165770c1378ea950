"""Triton kernels of gaengine, installed as ``gaengine.kernels``.

One kernel family per file: a private ``@triton.jit`` kernel and the launcher that builds its grid.
Importing this package does not import triton; each family module does, when it is first used.
"""
