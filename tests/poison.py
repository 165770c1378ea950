"""NaN-poisoned allocations in tests: ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty``
return floating tensors filled with NaN, so a slot a kernel or the library forgets to write (a missing zero, a stale
slice of a reused buffer, a partials entry never finished) shows up as NaN instead of passing on whatever memory held.

Applies to every caller that looks the function up at call time (``torch.empty(...)``: gaengine's partials tables,
the staging ring of ``zero_stage=2``, the Triton norm partials, and the tests), not to allocations made in C++
(``at::empty`` in ``csrc/``: those tables are poisoned by ``gaengine._C`` itself under ``SCRATCH_ENV``). ``tests/conftest.py`` installs it around every test (autouse) and sets
``GAENGINE_POISON=1``, which the gloo rank processes inherit: ``tests/ranks.py``'s ranks install
it there too. Integer and bool tensors are left as allocated.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "GAENGINE_POISON"
SCRATCH_ENV = "GAENGINE_POISON_SCRATCH"
"""Read by ``gaengine._C`` (``csrc/scratch.h``): with ``1``, the tables it allocates and its kernels then fill (the hot
path's per-micro-batch norm tables, the CPU and cuda ops' norm partials) start NaN, the C++ side of this module."""


def _poisoning(allocate):
    @functools.wraps(allocate)
    def poisoned(*args, **kwargs):
        out = allocate(*args, **kwargs)
        if (out.is_floating_point() or out.is_complex()) and out.device.type != "meta":
            with torch.no_grad():
                out.fill_(float("nan"))
        return out
    poisoned.__wrapped_allocation__ = allocate
    return poisoned


def install() -> callable:
    """Poison ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` in this process; returns the undo."""
    originals = [(torch, "empty", torch.empty), (torch, "empty_like", torch.empty_like),
                 (torch.Tensor, "new_empty", torch.Tensor.new_empty)]
    for owner, name, fn in originals:
        if not hasattr(fn, "__wrapped_allocation__"):
            setattr(owner, name, _poisoning(fn))

    def undo():
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return undo


def install_if_asked() -> None:
    """In a process the tests started (a gloo rank): poison as the parent test does when ``GAENGINE_POISON=1``."""
    if os.environ.get(ENV) == "1":
        install()
