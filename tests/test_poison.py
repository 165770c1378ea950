"""tests/poison.py, installed around every test by tests/conftest.py: floating allocations come back NaN-filled."""

from __future__ import annotations

import os

import torch

from tests import poison


def test_floating_allocations_are_nan_in_tests():
    base = torch.zeros(3, dtype=torch.bfloat16)
    for t in (torch.empty(5), torch.empty(2, 3, dtype=torch.float64), torch.empty((4,), dtype=torch.float16),
              torch.empty_like(base), base.new_empty(7), base.new_empty((2, 2), dtype=torch.float32)):
        assert t.numel() and bool(t.isnan().all()), (t.dtype, t)
    assert torch.empty(0).numel() == 0
    assert torch.empty(2, device="meta").is_meta


def test_integer_allocations_and_the_undo():
    assert torch.empty(4, dtype=torch.int64).dtype == torch.int64  # left as allocated (no NaN to write)
    undo = poison.install()  # installing twice wraps once
    assert not hasattr(torch.empty.__wrapped_allocation__, "__wrapped_allocation__")
    undo()
    assert hasattr(torch.empty, "__wrapped_allocation__")  # the fixture's own, still in place
    assert os.environ[poison.ENV] == "1"  # the gloo ranks a test starts poison theirs too


def test_native_hot_path_tables_start_poisoned_and_end_written():
    """``gaengine._C``'s scratch tables (``csrc/scratch.h``, ``GAENGINE_POISON_SCRATCH=1`` from tests/conftest.py):
    the source-partials table the native hot path allocates in ``begin()`` for a micro-batch is all NaN when backward
    starts (before any bucket launch writes it), and holds no NaN after it. An entry a launch forgot would stay NaN
    and reach the noise scale as NaN; unpoisoned, it would hold whatever the allocator's memory held (zeros, often)
    and pass. The free-norm table of the same ``begin()`` is allocated the same way."""
    import pytest  # noqa: PLC0415

    import gaengine  # noqa: PLC0415

    pytest.importorskip("gaengine._C")
    assert os.environ[poison.SCRATCH_ENV] == "1"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2,
                                       measure_noise_scale=True, backend="cpu", bucket_size_mb=1e-4)
    try:
        hot = getattr(acc.hooks, "_hot", None)
        if hot is None:
            pytest.skip(f"the native hot path is not in use here ({type(acc.hooks).__name__})")
        at_start = []
        loss = model(torch.randn(4, 8)).square().mean()
        loss.register_hook(lambda grad: at_start.append(hot.source_partials()[0][-1].clone()))  # first in backward
        acc.backward(loss)
        written = hot.source_partials()[0][-1]
        assert at_start and at_start[0].numel() > 1 and bool(at_start[0].isnan().all()), at_start
        assert not bool(written.isnan().any()), written
    finally:
        acc.close()
