"""The accumulator's construction stage: the ranks joined, the window's stages built, and the stages released.

``GradientAccumulator.__init__`` (``gaengine.engine``) checks its options (``gaengine.config``), takes the
parameters (``gaengine.ownership``), then builds its stages through this module and the sharding strategy
(``gaengine.sharding.make_sharding``):

* ``join_ranks``: the world size, and on several ranks the construction's header and the ranks' agreement on the
  parameters and the options, before the first collective;
* ``init_window``: the window's stages (the ``Window``, the schedule, the ranks' counts, the loss scale, the skips,
  the noise scale, the window's BatchNorm, the lending of the window's gradient);
* ``init_members``: the parameters that may join or leave after construction, and on several ranks their check;
* ``release``: what ``close()`` and garbage collection give back (the hooks, the fused forwards, the BatchNorm
  layers, the parameters' claims).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from gaengine import ownership
from gaengine.batchnorm import WindowBatchNorm, warn_batchnorm
from gaengine.config import AccumulatorConfig
from gaengine.lending import Lending
from gaengine.noise import WindowNoise
from gaengine.protocol import CONSTRUCTION, open_phase
from gaengine.reduce import check_ranks_agree, group_device
from gaengine.scaler import ConsecutiveSkips, choose_loss_scaler
from gaengine.schedules import AccumulationSchedule, WindowSchedule
from gaengine.window import RankCounts, Window

if TYPE_CHECKING:  # annotations only: the engine sits above this module and calls it
    from gaengine.engine import GradientAccumulator

__all__ = ["init_members", "init_window", "join_ranks", "release"]


def join_ranks(config: AccumulatorConfig, process_group: dist.ProcessGroup | None,
               named_params: list[tuple[str, torch.Tensor]], backend) -> int:
    """The world size of ``process_group`` (by default the global group when ``torch.distributed`` is initialized);
    on several ranks, before the first collective (the parameters' broadcast), ``ValueError`` on every rank unless
    they agree on the parameters and the options (``gaengine.reduce.check_ranks_agree``)."""
    world_size = dist.get_world_size(process_group) if (
        process_group is not None or (dist.is_available() and dist.is_initialized())) else 1
    if world_size > 1:  # the construction's header first (gaengine.protocol), then the agreement
        open_phase(CONSTRUCTION, 0, world_size, dist.get_rank(process_group), group_device(process_group),
                   process_group)
        check_ranks_agree(config.rank_settings(named_params, backend), process_group)
    return world_size


def init_window(acc: GradientAccumulator, accumulation_steps: int | AccumulationSchedule,
                params: list[torch.Tensor], module: nn.Module | None) -> None:
    """``acc``'s window (counters, loss sum, failed flag, stats: ``gaengine.window``), K per window and the updates
    so far (``gaengine.schedules``), the counts a ``step()`` left unread (several ranks), the loss scale, the
    noise scale and the window's BatchNorm statistics (``batchnorm="window"``; else a warning for BatchNorm)."""
    config = acc.config
    acc.window = Window(acc.device)
    acc.schedule = WindowSchedule(accumulation_steps)
    acc._counts = RankCounts(acc.world_size, acc.device, acc.process_group)
    acc._skips = ConsecutiveSkips(config.max_consecutive_skips)
    acc.scaler = choose_loss_scaler(config.loss_scale, params, acc.device, acc.min_loss_scale)
    acc._auto_loss_scale = config.loss_scale == "auto" and acc.scaler is None  # till a backward sees autocast
    acc._noise = WindowNoise(config.noise_scale_ema, acc.device) if config.measure_noise_scale else None
    acc.window_batchnorm = None
    if module is not None and config.batchnorm == "window":
        acc.window_batchnorm = WindowBatchNorm(module)
    elif module is not None:
        warn_batchnorm(module, acc.accumulation_steps, stacklevel=4)  # the user's GradientAccumulator(...) line
    acc._lending = Lending(acc.backend)  # the window's gradient lent in .grad (begin_step, before_update)


def init_members(acc: GradientAccumulator, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                 module: nn.Module | None) -> None:
    """Parameters joining (unfrozen, a param group added) or leaving (frozen) after construction: found at the
    window boundaries, adopted by the strategy (``gaengine.ownership.Membership``, ``gaengine.membership.adopt``,
    docs/accumulator.md); on several ranks every rank must change them alike (one small all-reduce per window
    boundary, ``gaengine.ownership.RankMembership``)."""
    acc._members = ownership.Membership(module, params, optimizer)
    acc._ranks_members = ownership.RankMembership(
        acc._members, acc.world_size, dist.get_rank(acc.process_group), acc.device, acc.process_group) if (
        acc.distributed) else None


def release(acc: GradientAccumulator) -> None:
    """Give back what ``acc`` holds: the strategy's hooks, collectives in flight and forward pre-hooks
    (``ShardingStrategy.close``), the Linear layers' own forwards (``gradient_accumulation_fusion``), the window's
    BatchNorm layers and the parameters' claims (another accumulator may take them). Nothing where the constructor
    raised before building the strategy."""
    sharding = getattr(acc, "sharding", None)  # None: the constructor raised before building it
    if sharding is None:
        return
    sharding.close()  # the hooks, the collectives in flight, the forward pre-hooks of overlap_param_gather
    if getattr(acc, "_fusion", None) is not None:
        acc._fusion.close()  # the Linear layers' own forwards again
    if acc.window_batchnorm is not None:
        acc.window_batchnorm.close()
    ownership.release(acc.params, acc)
