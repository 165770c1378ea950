"""gaengine: a gradient accumulation engine for PyTorch.

Low-precision gradients are accumulated into one fp32 flat buffer as autograd produces them, normalized
once at the end of the accumulation window, clipped with a coefficient that never leaves the device, and
handed to the optimizer. ``import gaengine`` neither initializes CUDA nor builds anything.
"""

from gaengine import ops
from gaengine.clip import clip_grad_norm_
from gaengine.engine import GradientAccumulator, StepResult

__version__ = "0.1.0"

__all__ = [
    "GradientAccumulator",
    "StepResult",
    "clip_grad_norm_",
    "ops",
    "__version__",
]
