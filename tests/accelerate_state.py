"""Accelerate's process-wide state, reset around every test of a file that imports ``fresh_accelerate_state``
(the HF Trainer runs on Accelerate too). Imported only by those files: it imports Accelerate."""

from __future__ import annotations

import pytest
from accelerate.state import AcceleratorState, GradientState

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT")


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """Accelerate keeps its state in process-wide singletons: each test starts from none, as one process (launch
    variables another test left in os.environ, e.g. Lightning's LOCAL_RANK, would make Accelerate start a group)."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
