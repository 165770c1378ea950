"""The rank's layout: what this rank holds of each trainable parameter, answered in one place for every mode.

Everything that differs between the data-parallel modes about *where* a parameter's values, masters and optimizer
pieces live on this rank is one object, a ``RankLayout``, built by the sharding strategy (``gaengine.sharding``) and
handed to the parameter store (``gaengine.store.ParameterStore``), the update (``gaengine.sharding.Update``) and the
checkpoint (``gaengine.checkpoint``, through ``ShardingStrategy.rank_layout``), none of which asks which mode it is:

* **The gradient views and chunks** (``grad_views``): this rank's views of the window's fp32 sums, what its
  update, norm and checkpoint read.
* **Holdings** (``hold``): per trainable parameter, the range ``[lo, hi)`` of the flattened parameter this rank
  holds, the optimizer's piece for it (or None), its fp32 master and the model tensor the master's rounding goes
  into; the flat parameter buffers the parameters were re-pointed into, and the fp32 ``master_buffer``.
* **Pieces as the optimizer and the user see them** (``local``, ``wrap``): a piece's local elements, and a local
  tensor wrapped like its parameter (a DTensor for FSDP2's parameters, the tensor itself otherwise).
* **The masters' rounding into the model** (``copy_masters``, ``model_views``, ``version_tensors``) and the check
  that the model still lives where it was laid out (``check_storage``).
* **What a layout refuses** (``check_masters_to_model``, ``check_release``): where the pieces are 1-D ranges the
  optimizer cannot be given back to the model.
* **Where the window's sums lie in a checkpoint** (``window_chunks``, ``window_rows``): this rank's ranges of the
  parameters, or its own row of unreduced sums (replicated on several ranks).
* ``sharded``: the optimizer state is split over several ranks (a checkpoint's meta records it);
  ``holds_whole_grad``: every rank holds the window's whole reduced gradient (``step(before_update=...)`` and
  ``begin_step()`` lend it in ``.grad``; a replicated run's old state dicts load).
* **What the store and the replaced-parameter watch ask** (so that neither reads a mode flag):
  ``follows_param_writes`` (whether an optimizer call outside ``step()`` that writes the pieces must be followed
  into the model), ``grad_wrapper`` (the function the update wraps each piece's gradient with, or None: no Python
  call per parameter) and ``adopts_replaced`` (whether a parameter replaced in the model can be taken in on this
  rank alone).

Implementations: ``gaengine.zero.WholeParams`` (every rank holds every parameter whole: replicated, and one rank),
``gaengine.zero.EvenShards`` (ZeRO's even flat shards of a ``ShardLayout``), ``gaengine.zero.WholeOwners`` (ZeRO's
shards laid out so that each parameter lies whole in one rank's: whole-matrix owners, for optimizers that are not
elementwise) and ``gaengine.fsdp2.DTensorShards`` (FSDP2's DTensor local shards). A new layout is one more
subclass; one of ZeRO's shards (an ``EvenShards`` subclass answering ``takes`` and ``plan``) is plugged in by
``gaengine.sharding.register_zero_layout``, with no change to the engine, the store or ``gaengine.checkpoint``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gaengine.buffer import FlatBuffer
from gaengine.update import LOW_PRECISION

__all__ = ["Mastered", "ParamSlot", "RankLayout", "WindowChunk", "copy_all"]


@dataclass(frozen=True)
class ParamSlot:
    """One trainable parameter as this rank holds it (``RankLayout.hold``, ``ShardingStrategy.param_slots``; what a
    checkpoint reads).

    param: the model parameter. lo, hi: the range ``[lo, hi)`` of the flattened parameter this rank owns
    (``0, numel`` where it holds it whole; ``lo == hi``: nothing). shard_offset: where element ``lo`` lies in the
    rank's flat shard (0 where there is none). piece: the optimizer's parameter holding that range (shaped like
    ``param``, or 1-D over a range), or None (not optimized, or nothing owned). optimized: the optimizer holds
    ``param``. master: it has fp32 master weights (``piece`` is then a view of ``master_buffer``). grad:
    ``(hi - lo,)`` fp32, the window's gradient sum of that range, a view.
    """

    param: torch.Tensor
    lo: int
    hi: int
    shard_offset: int
    piece: torch.Tensor | None
    optimized: bool
    master: bool
    grad: torch.Tensor | None = None


@dataclass(frozen=True)
class Mastered:
    """One parameter with an fp32 master held on this rank: the model ``param``, the optimizer's ``piece`` (a view of
    the master, wrapped like the parameter), the ``master`` itself (this rank's fp32 elements) and ``view``, the model
    tensor its rounding goes into (None where the layout finds it afresh each time: ``RankLayout.model_views``)."""

    param: torch.Tensor
    piece: torch.Tensor
    master: torch.Tensor
    view: torch.Tensor | None


@dataclass(frozen=True)
class WindowChunk:
    """Where one parameter's window gradient sum lies in a checkpoint (``RankLayout.window_chunks``, ``ShardingStrategy.window_sums``;
    ``gaengine.checkpoint`` saves it as a ``FlatShard``). local: the ``(length,)`` fp32 sum this rank saves or
    loads into. numel: elements of the whole saved tensor. start: where ``local`` starts in it. own: ``local`` is
    this rank's own row of a tensor holding one row per rank (a replicated run's unreduced sums on several ranks)."""

    local: torch.Tensor
    numel: int
    start: int
    own: bool = False


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i: ``copy_`` for one or two (one per dtype), else one multi-tensor launch."""
    with torch.no_grad():
        if len(dsts) <= len(LOW_PRECISION):
            for dst, src in zip(dsts, srcs):
                dst.copy_(src)
        else:
            torch._foreach_copy_(dsts, srcs)


class RankLayout(ABC):
    """What this rank holds of each trainable parameter (module docstring). Built by the strategy; ``hold`` is called
    once, by the store built over it (a new layout of the parameters is a new ``RankLayout``).

    Attributes set by ``hold``: ``param_buffers`` (dtype -> the flat buffer the laid-out parameters are views of;
    empty where none is laid out), ``master_buffer`` (``FlatBuffer`` of this rank's fp32 masters, or None).
    """

    sharded = False  # the optimizer state is split over several ranks (a checkpoint's meta)
    window_rows: tuple[int, int] | None = None
    """``(rank, world)`` where this rank's window sums are its own unreduced sums of whole parameters (replicated on
    several ranks: reduced only by the window's last micro-batch), saved as its row of one per rank
    (``window_chunks``; a checkpoint's meta records it, and such a state resumes mid-window only on the same world
    size); None where they are this rank's ranges of the parameters."""
    holds_whole_grad = False  # every rank holds the window's whole reduced gradient (it can be lent in .grad)
    param_buffers: dict[torch.dtype, torch.Tensor]
    master_buffer: FlatBuffer | None = None

    @abstractmethod
    def hold(self, params: Sequence[torch.Tensor], optimized: Sequence[bool], mastered: set[torch.dtype],
             device: torch.device) -> tuple[list[ParamSlot], list[Mastered]]:
        """Lay out what this rank holds of ``params`` (every trainable parameter, the store's order; ``optimized[j]``:
        the optimizer holds ``params[j]``; ``mastered``: the dtypes whose optimized parameters get fp32 masters) on
        ``device``: re-point parameters into flat buffers where this layout does, build the masters (starting as the
        parameters' exact fp32 values) and the optimizer's pieces. Returns per parameter its ``ParamSlot`` (no
        ``grad``), and the ``Mastered`` entries in the order the masters are copied."""

    def state_meta(self) -> dict[str, bool]:
        """This layout's entries in a checkpoint's meta (``ShardingStrategy.state_meta``): ``sharded`` and
        ``window_rows`` (whether it is set). A state saved mid-window resumes only where they are alike."""
        return {"sharded": self.sharded, "window_rows": self.window_rows is not None}

    def grad_views(self, main_grad: FlatBuffer, reducer) -> dict[str, Any]:
        """This rank's views of the window's fp32 sums where they are not ``main_grad``'s own, as keyword arguments
        of ``gaengine.accumulation.Accumulation`` (``shard_grads``, ``chunks``, ``grad_views``): by default none (this
        rank updates every parameter it holds from ``main_grad``'s views). reducer: the layout's ``BucketReducer``
        (its ``grad_shard`` where the sums live in a shard), or None."""
        return {}

    def window_chunks(self, slots: Sequence[ParamSlot], sums: Sequence[torch.Tensor]) -> list[WindowChunk]:
        """Per parameter (layout order, ``slots``: ``ShardingStrategy.param_slots``), where the window's fp32 gradient
        sum ``sums[i]`` (``(hi - lo,)``, this rank's) lies in a checkpoint: the range ``[lo, hi)`` of the flattened
        parameter (``(numel,)``); with ``window_rows``, this rank's row of a ``(world x numel,)`` tensor
        (``WindowChunk.own``), so that a window resumes bit-identically on the same world size."""
        if self.window_rows is None:
            return [WindowChunk(local, s.param.numel(), s.lo) for s, local in zip(slots, sums, strict=True)]
        rank, world = self.window_rows
        return [WindowChunk(local, world * s.param.numel(), rank * s.param.numel() + s.lo, own=True)
                for s, local in zip(slots, sums, strict=True)]

    def kept_in_groups(self, q: torch.Tensor) -> torch.Tensor | None:
        """What stays in the optimizer's param groups for a parameter it holds that is not trainable (``q``): ``q``
        itself where the pieces are shaped like their parameters (so the optimizer can be given back); None where
        they are ranges."""
        return q

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The elements of ``t`` (a parameter, a piece or its state) this rank holds, as a plain tensor: ``t``."""
        return t

    def wrap(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` (shaped like ``local(p)``) as the optimizer and the user see it beside ``p``: ``local`` itself."""
        return local

    def grad_wrapper(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The function the update gives each piece's gradient through (``wrap``, called as ``f(piece, grad)``), or
        None where ``wrap`` gives back what it is given: the update then makes no Python call per parameter (its
        loop runs once per parameter at every step). By default None."""
        return None

    def follows_param_writes(self, mastered: bool) -> bool:
        """Whether an optimizer call outside ``step()`` that writes the pieces (``gaengine.store.PARAM_WRITERS``:
        schedule-free's ``eval()`` / ``train()``) must be followed for the model to hold what it wrote
        (``ParameterStore`` then wraps those methods): where the pieces are fp32 masters (``mastered``: the store has
        a ``master_buffer``, rounded into the model), or where they are only this rank's part of the parameters
        (``sharded``: the other ranks' parts must reach the model too). Not where the pieces are the model's own
        parameters, whole on this rank: the optimizer then writes the model itself."""
        return mastered or self.sharded

    def adopts_replaced(self) -> bool:
        """Whether a parameter replaced in the model between windows (another object in its slot, or another
        storage, ``p.data = x``) can be taken in on this rank alone (``gaengine.replaced.ReplacedParams``, where the
        strategy adopts parameters at all, ``ShardingStrategy.adopts_params``): only where this rank holds every
        parameter whole, so that its new values reach its fp32 master and optimizer state here with nothing held on
        other ranks to agree. By default False (it is refused, naming the parameter)."""
        return False

    def model_views(self, mastered: Sequence[Mastered]) -> list[torch.Tensor]:
        """Per entry of ``mastered``, the model tensor its master's rounding goes into now."""
        return [m.view for m in mastered]

    def version_tensors(self, mastered: Sequence[Mastered]) -> list[torch.Tensor]:
        """The tensors whose version counters tell a write into the model (``ParameterStore.pull_model_writes``): the
        parameters with masters."""
        return [m.param for m in mastered]

    def copy_masters(self, mastered: Sequence[Mastered]) -> None:
        """Round the fp32 masters of ``mastered`` into the model (``model_views``), bumping the version counters of
        ``version_tensors`` as an in-place op would."""
        copy_all(self.model_views(mastered), [m.master for m in mastered])

    def check_storage(self) -> None:
        """``RuntimeError`` where the parameters left the storage this layout put them in (the model was moved or
        converted after the accumulator was built); nothing where it put them nowhere."""

    def check_masters_to_model(self) -> None:
        """``RuntimeError`` where ``GradientAccumulator.masters_to_model()`` cannot run on this rank's masters
        (they are ranges, rounded into the model by the update's gathers); nothing by default."""

    def check_lend(self, mode: str) -> None:
        """``ValueError`` where the window's whole reduced gradient cannot be lent in ``.grad``
        (``step(before_update=...)``, ``begin_step()``): every rank must hold it (``holds_whole_grad``). mode: the
        strategy's name, for the message."""
        if not self.holds_whole_grad:
            raise ValueError(f"step(before_update=...) and begin_step() need the whole window gradient on every rank, "
                             f"which {mode} does not hold; use zero_stage=0, or read StepResult.grad_norm")

    def check_release(self) -> None:
        """``ValueError`` where the optimizer cannot be given back to the model (``close(release_optimizer=True)``):
        its pieces are not shaped like their parameters; nothing by default."""
