"""Flat fp32 storage for a list of parameters: offsets, per-parameter views, aligned starts; the layout order.

Parameters are laid out in the order given. The engine starts from ``initial_order`` (reverse registration
order, the order in which backward usually produces their gradients) and, after the first window, re-lays
the buffer out in the order the gradients actually arrived (``learned_order``; on several ranks, the first
rank's order, so every rank has the same layout and the same buckets).

Every parameter starts on a multiple of ``ALIGN_NUMEL`` elements, so each view is 256-byte aligned in fp32
and the matching 16-bit gradient is 128-byte aligned (Megatron-Core pads parameter starts the same way,
``param_layout.py`` ``pad_param_start``): every kernel can use 16-byte vector loads and stores. The padding
between parameters is zero and stays zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ALIGN_NUMEL", "FlatLayout", "FlatBuffer", "initial_order", "learned_order"]

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


def initial_order(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Reverse registration order: the order in which backward produces the gradients of most models."""
    return list(params[::-1])


def learned_order(arrival: Sequence[int], num_params: int, device: torch.device, *, distributed: bool = False,
                  group: dist.ProcessGroup | None = None) -> list[int]:
    """The layout order learned from a window: ``order[j]`` is the current layout index to put at position j.

    arrival: current layout indices in the order their gradients first arrived (repeats are ignored);
    parameters that never arrived follow in their current order. distributed: every rank takes the first
    rank of ``group``'s order (one broadcast of ``num_params`` int64 on ``device`` if it is CUDA, else on the
    CPU, and one host read: a one-time round trip), so the layouts and buckets agree across ranks.
    """
    arrival = list(dict.fromkeys(arrival))  # first arrival of each parameter
    seen = set(arrival)
    order = arrival + [i for i in range(num_params) if i not in seen]
    if distributed:
        t = torch.tensor(order, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(t, src=src, group=group)
        order = t.tolist()
    return order


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` unless ``src`` is ``dst`` already (``dcp.load`` wrote the chunk in place)."""
    if src.data_ptr() != dst.data_ptr() or src.device != dst.device or src.dtype != dst.dtype:
        dst.copy_(src)
