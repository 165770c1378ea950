"""Flat fp32 storage for a list of parameters: offsets, per-parameter views, aligned starts.

Parameters are laid out in the order given (the engine passes reverse registration order, the order in
which backward produces their gradients). Every parameter starts on a multiple of ``ALIGN_NUMEL``
elements, so each view is 256-byte aligned in fp32 and the matching 16-bit gradient is 128-byte aligned
(Megatron-Core pads parameter starts the same way, ``param_layout.py`` ``pad_param_start``): every kernel
can use 16-byte vector loads and stores. The padding between parameters is zero and stays zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ALIGN_NUMEL", "FlatLayout", "FlatBuffer"]

ALIGN_NUMEL = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in a flat buffer.

    offsets[i], numels[i]: start and length (elements) of parameter i; total_numel: buffer length,
    padded to a multiple of ``ALIGN_NUMEL``.
    """

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    total_numel: int

    @classmethod
    def build(cls, params: Sequence[torch.Tensor]) -> FlatLayout:
        offsets, cursor = [], 0
        for p in params:
            offsets.append(cursor)
            cursor = _round_up(cursor + p.numel(), ALIGN_NUMEL)
        return cls(tuple(offsets), tuple(p.numel() for p in params), tuple(p.shape for p in params), cursor)


class FlatBuffer:
    """One zero-initialized flat tensor and a view of it per parameter.

    data: (layout.total_numel,) ``dtype`` on ``device``. flat_views[i]: (numels[i],) contiguous view;
    views[i]: the same memory shaped like parameter i.
    """

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.data = torch.zeros(layout.total_numel, dtype=dtype, device=device)
        self.flat_views = [self.data.narrow(0, o, n) for o, n in zip(layout.offsets, layout.numels)]
        self.views = [v.view(shape) for v, shape in zip(self.flat_views, layout.shapes)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
