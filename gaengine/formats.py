"""The tags of gaengine's state dicts (``state["format"]``), in one place.

``STATE_FORMAT`` is what ``GradientAccumulator.state_dict()`` returns on every sharding strategy, FSDP2 models
included (``gaengine.checkpoint.accumulator_state_dict``). The earlier formats no longer load directly:
``gaengine.checkpoint.upgrade`` brings ``OLD_FORMATS`` to ``STATE_FORMAT``; ``FSDP2_FORMAT`` (FSDP2 models before
their state went through ``STATE_FORMAT``: one ``torch.save`` per rank of the scalars, the local ``main_grad`` and
masters, no optimizer state) is refused with what to do (``gaengine.checkpoint.load_accumulator_state_dict``).
"""

from __future__ import annotations

__all__ = ["FSDP2_FORMAT", "OLD_FORMATS", "PLAIN_FORMAT", "STATE_FORMAT", "ZERO_FORMAT"]

STATE_FORMAT = "gaengine.GradientAccumulator/2"
FSDP2_FORMAT = "gaengine.GradientAccumulator/fsdp2/1"  # FSDP2 models before STATE_FORMAT: refused
ZERO_FORMAT = "gaengine.GradientAccumulator.zero/1"  # zero_stage >= 1 before STATE_FORMAT (DCP)
PLAIN_FORMAT = "gaengine.GradientAccumulator/1"  # zero_stage=0 before STATE_FORMAT (torch.save)
OLD_FORMATS = (PLAIN_FORMAT, ZERO_FORMAT)  # what gaengine.checkpoint.upgrade takes
