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
