"""gaengine: a gradient accumulation engine for PyTorch.

Low-precision gradients are accumulated into one fp32 flat buffer as autograd produces them, normalized
once at the end of the accumulation window, clipped with a coefficient that never leaves the device,
reduced across ranks in buckets while backward runs, and handed to the optimizer. ``import gaengine``
neither initializes CUDA nor loads the compiled extension or triton.
"""

import gaengine.fsdp2  # noqa: F401 - registers FullyShardedGrads, the strategy of FSDP2 models (gaengine.sharding)
from gaengine import ops, optim, schedules
from gaengine.clip import clip_grad_norm_
from gaengine.config import AccumulatorConfig
from gaengine.engine import GradientAccumulator, StepResult
from gaengine.utils import MicroBatches, find_micro_batch_size, scale_lr, split_batch
from gaengine.verify import EquivalenceReport, verify_equivalence

__version__ = "0.1.0"


def __getattr__(name: str):
    # gaengine.checkpoint imports torch.distributed.checkpoint (about 2 s): it loads on first use.
    if name == "full_optimizer_state_dict":
        from gaengine.checkpoint import full_optimizer_state_dict  # noqa: PLC0415

        return full_optimizer_state_dict
    raise AttributeError(f"module 'gaengine' has no attribute {name!r}")


__all__ = [
    "AccumulatorConfig",
    "EquivalenceReport",
    "GradientAccumulator",
    "MicroBatches",
    "StepResult",
    "clip_grad_norm_",
    "find_micro_batch_size",
    "full_optimizer_state_dict",
    "ops",
    "optim",
    "scale_lr",
    "schedules",
    "split_batch",
    "verify_equivalence",
    "__version__",
]
