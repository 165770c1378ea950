"""Dynamic fp16 loss scaling that never leaves the device.

Defaults are ``torch.amp.GradScaler``'s (``amp/grad_scaler.py``): initial scale 2**16, growth x2 after 2000
consecutive clean updates, backoff x0.5 on an overflow. The update is torch's own fused
``torch._amp_update_scale_`` kernel, driven by the engine's on-device ``found_inf`` flag, so no value is
read on the host. The engine folds the inverse scale into its late normalization (the step's single
coefficient), so unscaling costs no pass over the gradients.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LossScaler"]


class LossScaler:
    """Loss scale state on ``device``.

    scale: 0-d fp32 tensor, multiplies each micro-batch's loss. dynamic: grow/back off after each
    update; a static scaler keeps ``scale`` fixed. growth_tracker: 0-d int32 tensor, clean updates in a row.
    """

    def __init__(self, device: torch.device, init_scale: float = 2.0**16, dynamic: bool = True,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"loss_scale must be a positive finite float, 'dynamic' or None, got {init_scale!r}")
        self.dynamic = dynamic
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        """After a window: back off if ``found_inf`` (0-d fp32, 1.0 = overflow), else count towards growth."""
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, self.growth_factor,
                                     self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        return {"scale": self.scale.detach().clone().cpu(), "growth_tracker": self.growth_tracker.detach().clone().cpu(),
                "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])
        self.dynamic = bool(state["dynamic"])
