"""The accumulator's construction stage: the ranks joined, the window's stages built, and the stages released.

``GradientAccumulator.__init__`` (``gaengine.engine``) checks its options (``gaengine.config``), takes the
parameters (``gaengine.ownership``), then builds its stages through this module and the sharding strategy
(``gaengine.sharding.make_sharding``):

* ``join_ranks``: the world size, and on several ranks the construction's header and the ranks' agreement on the
  parameters and the options, before the first collective;
* ``init_window``: the window's stages (``gaengine.stages.WindowStages``: the ``Window``, the schedule, the
  ranks' counts, the loss scale, the skips, the noise scale, the window's BatchNorm, the lending of the window's
  gradient);
* ``release``: what ``close()`` and garbage collection give back (the hooks, the fused forwards, the BatchNorm
  layers, the parameters' claims).

Each takes the parts it needs and returns what it builds; the engine keeps them, and builds the membership stage
(``gaengine.membership.MembershipStage.build``) and the window stage (``gaengine.window_end.WindowEnd``) over them and
the strategy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from gaengine.stages import WindowStages
from gaengine.window import RankCounts, Window

if TYPE_CHECKING:  # annotations only
    from gaengine.fusion import LinearFusion
    from gaengine.sharding import ShardingStrategy

__all__ = ["init_window", "join_ranks", "release"]


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


def init_window(config: AccumulatorConfig, accumulation_steps: int | AccumulationSchedule, params: list[torch.Tensor],
                module: nn.Module | None, device: torch.device, world_size: int,
                process_group: dist.ProcessGroup | None, backend: Any) -> WindowStages:
    """The window's stages (``WindowStages``): the window (counters, loss sum, failed flag, stats:
    ``gaengine.window``), K per window and the updates so far (``gaengine.schedules``), the counts a ``step()`` left
    unread (several ranks), the skips, the loss scale, the noise scale, the window's BatchNorm statistics
    (``batchnorm="window"``; else a warning for BatchNorm) and the lending of the window's gradient (over
    ``backend``, ``gaengine.backends``)."""
    schedule = WindowSchedule(accumulation_steps)
    scaler = choose_loss_scaler(config.loss_scale, params, device, config.min_loss_scale)
    batchnorm = None
    if module is not None and config.batchnorm == "window":
        batchnorm = WindowBatchNorm(module)
    elif module is not None:
        warn_batchnorm(module, schedule.k(0), stacklevel=4)  # the user's GradientAccumulator(...) line
    return WindowStages(
        Window(device), schedule, RankCounts(world_size, device, process_group),
        ConsecutiveSkips(config.max_consecutive_skips), scaler,
        config.loss_scale == "auto" and scaler is None,  # till a backward sees autocast
        WindowNoise(config.noise_scale_ema, device) if config.measure_noise_scale else None, batchnorm,
        Lending(backend))


def release(owner: Any, sharding: ShardingStrategy | None, fusion: LinearFusion | None,
            batchnorm: WindowBatchNorm | None) -> None:
    """Give back what ``owner`` (the accumulator) holds: the strategy's hooks, collectives in flight and forward
    pre-hooks (``ShardingStrategy.close``), the Linear layers' own forwards (``fusion``:
    ``gradient_accumulation_fusion``), the window's BatchNorm layers and the parameters' claims (another accumulator
    may take them). Nothing where the constructor raised before building the strategy (``sharding`` None)."""
    if sharding is None:
        return
    sharding.close()  # the hooks, the collectives in flight, the forward pre-hooks of overlap_param_gather
    if fusion is not None:
        fusion.close()  # the Linear layers' own forwards again
    if batchnorm is not None:
        batchnorm.close()
    ownership.release(sharding.params, owner)
