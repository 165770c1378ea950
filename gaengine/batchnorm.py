"""BatchNorm under gradient accumulation.

Each micro-batch's forward updates a BatchNorm's running statistics from that micro-batch alone, so with
K micro-batches the running mean and variance follow small-batch statistics and ``num_batches_tracked``
advances K times per update. ``WindowBatchNorm`` makes them follow the effective batch instead: it
records each micro-batch's per-channel count, mean and biased variance in training forwards, undoes the
module's own update, and applies one update per window from the combined statistics (the parallel
mean/variance formula of Chan, Golub & LeVeque 1979, "Updating formulae and a pairwise algorithm for
computing sample variances"), with torch's momentum rule and Bessel-corrected variance.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["batchnorm_modules", "warn_batchnorm", "WindowBatchNorm"]

_warned: set[int] = set()


def batchnorm_modules(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def warn_batchnorm(model: nn.Module, accumulation_steps: int, stacklevel: int = 3) -> None:
    """Warn once per model that its BatchNorm layers see micro-batches, not the effective batch."""
    mods = [name for name, m in batchnorm_modules(model) if not isinstance(m, nn.SyncBatchNorm)]
    if not mods or accumulation_steps <= 1 or id(model) in _warned:
        return
    _warned.add(id(model))
    warnings.warn(
        f"BatchNorm layers {mods} normalize each micro-batch on its own statistics under gradient accumulation "
        f"(accumulation_steps={accumulation_steps}), so the gradient is not the large batch's and the running "
        "statistics follow the micro-batch. Alternatives: GroupNorm or LayerNorm; SyncBatchNorm across ranks; "
        "or GradientAccumulator(..., batchnorm='window') so the running statistics are updated once per window "
        "from the combined micro-batch statistics.",
        UserWarning,
        stacklevel=stacklevel,
    )


class _Stats:
    """Running combination of (count, mean, M2 = count * biased variance) per channel, in fp64."""

    __slots__ = ("count", "mean", "m2", "saved")

    def __init__(self):
        self.count = 0
        self.mean = self.m2 = None
        self.saved = None

    def add(self, n: int, mean: torch.Tensor, var_biased: torch.Tensor) -> None:
        m2 = var_biased * n
        if self.count == 0:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta * delta * (self.count * n / total)
        self.count = total


class WindowBatchNorm:
    """Per-window running statistics for every tracking ``_BatchNorm`` in ``model`` (see module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [m for _, m in batchnorm_modules(model) if m.track_running_stats]
        self._stats = {id(m): _Stats() for m in self.modules}
        self._handles = []
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        if module.training:
            # The module updates scratch copies (autograd may keep them for backward, so they are never
            # written again); the real buffers are put back untouched after the forward.
            st = self._stats[id(module)]
            st.saved = (module.running_mean, module.running_var, module.num_batches_tracked)
            module.running_mean = module.running_mean.clone()
            module.running_var = module.running_var.clone()
            module.num_batches_tracked = module.num_batches_tracked.clone()

    def _post(self, module, args, output):
        if not module.training:
            return
        st = self._stats[id(module)]
        x = args[0].detach()
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            var_b, mean = torch.var_mean(x.double(), dim=dims, correction=0)
            st.add(n, mean, var_b)
            module.running_mean, module.running_var, module.num_batches_tracked = st.saved
            st.saved = None

    def end_window(self) -> None:
        """Apply one running-statistics update per module from the window's combined statistics."""
        with torch.no_grad():
            for m in self.modules:
                st = self._stats[id(m)]
                if st.count == 0:
                    continue
                n = st.count
                mean = st.mean
                var = st.m2 / max(n - 1, 1)  # Bessel-corrected, as torch's running_var
                m.num_batches_tracked.add_(1)
                if m.momentum is None:  # cumulative moving average, as torch does
                    factor = 1.0 / float(m.num_batches_tracked)
                else:
                    factor = m.momentum
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
                m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)
                self._stats[id(m)] = _Stats()

    def reset(self) -> None:
        self._stats = {id(m): _Stats() for m in self.modules}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
