"""The tags of gaengine's state dicts (``state["format"]``), in one place.

``STATE_FORMAT`` is what ``GradientAccumulator.state_dict()`` returns on every sharding strategy
(``gaengine.checkpoint.accumulator_state_dict``); ``FSDP2_FORMAT`` what it returns for an FSDP2 model
(``gaengine.fsdp2.FullyShardedGrads``, one per rank). The earlier formats no longer load directly:
``gaengine.checkpoint.upgrade`` brings them to ``STATE_FORMAT``.
"""

from __future__ import annotations

__all__ = ["FSDP2_FORMAT", "OLD_FORMATS", "PLAIN_FORMAT", "STATE_FORMAT", "ZERO_FORMAT"]

STATE_FORMAT = "gaengine.GradientAccumulator/2"
FSDP2_FORMAT = "gaengine.GradientAccumulator/fsdp2/1"
ZERO_FORMAT = "gaengine.GradientAccumulator.zero/1"  # zero_stage >= 1 before STATE_FORMAT (DCP)
PLAIN_FORMAT = "gaengine.GradientAccumulator/1"  # zero_stage=0 before STATE_FORMAT (torch.save)
OLD_FORMATS = (PLAIN_FORMAT, ZERO_FORMAT)  # what gaengine.checkpoint.upgrade takes
