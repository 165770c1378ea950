"""The accumulation window: what one window of micro-batches has accumulated besides the gradients.

``Window`` is the only writer of the window's host-side state: the micro-batch count, whether the window is in
item mode and its item count, the loss sum, the failed flag (a backward raised mid-window), and the stats
all-reduce of several ranks (``gaengine.reduce.WindowStats``, launched by the last micro-batch). The gradients
themselves live with the sharding strategy (``gaengine.sharding``), the per-parameter flags with the hooks
(``gaengine.hooks``), the noise-scale bookkeeping with ``gaengine.noise.WindowNoise``.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gaengine.reduce import HostMailbox, WindowStats, count_mismatch_message

MEMBERSHIP_SETTING = "trainable parameters changed in the window"
"""The window setting (``gaengine.ownership.Membership.window_term``) that tells ranks which changed their trainable
parameters in the middle of a window from those which did not."""

__all__ = ["FAILED_WINDOW", "RankCounts", "StepResult", "Window", "check_num_items", "foreign_gradient_error",
           "warn_dropped_window"]

FAILED_WINDOW = ("a backward in this accumulation window raised, so the window is no longer a sum of whole "
                 "micro-batches; call acc.zero_grad() to drop it, then go on")


class Window:
    """One accumulation window's counters (see the module docstring), on ``device``.

    num_micro_batches: micro-batches accumulated. item_mode: None before the first, then whether they passed
    ``num_items``. items_host: the items given as Python ints; items_dev: the items given as tensors, summed as a
    0-d fp64 tensor on the device (no host read), or None. loss_sum: 0-d fp32 on the device, the sum of the
    micro-batches' losses (unscaled). failed: a backward of this window raised. stats: the stats all-reduce of
    the window's last micro-batch (several ranks), or None. used: per parameter (layout order), whether a gradient
    reached it in an earlier micro-batch of the window whose hooks' flags were since restarted (``mark_used``; the
    ``zero_stage=2`` staging restarts them every micro-batch), or None for none; ``used_with`` adds the hooks'
    current flags. graph_mark: None, or the mark (an ``object()``, new each window) left in the autograd graphs
    that a backward of this window retained (``retain_graph=True``), to refuse a second backward through them
    (``claim_graph``). settings: ``(name, value)`` pairs of the settings every rank must share (the window's K,
    ``max_grad_norm``), set by the accumulator before the stats all-reduce carries them (several ranks).
    grads_left: the accumulator left a gradient in the parameters' ``.grad`` (``step()`` without an optimizer, the
    gradient ``begin_step()`` lent, a resumed state): the next ``backward()`` clears it. Kept across windows.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.grads_left = False
        self.dropped_warned = False  # warn_dropped_window warned once
        self.reset()

    def reset(self) -> None:
        """An empty window."""
        self.num_micro_batches = 0
        self.item_mode: bool | None = None
        self.items_host = 0
        self.items_dev: torch.Tensor | None = None
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.failed = False
        self.stats: WindowStats | None = None
        self.used: list[bool] | None = None
        self.graph_mark: object | None = None
        self.settings: tuple[tuple[str, object], ...] = ()

    def claim_graph(self, loss: torch.Tensor, retain: bool) -> None:
        """Before a micro-batch's backward of ``loss``: ``RuntimeError`` if its autograd graph reaches a node that a
        backward of this window retained (``retain_graph=True`` on the same loss, or on another loss sharing part of
        its graph): each ``backward()`` counts one micro-batch, so the gradients through that part would be summed
        twice and normalized as two micro-batches. ``retain``: this backward retains its graph, whose nodes are then
        marked (``torch.autograd.graph.Node.metadata``). Walks the graph (host only, once per node) only in a window
        where a backward retained one: the ordinary loop pays nothing."""
        if self.graph_mark is None and not retain:
            return
        mark = self.graph_mark if self.graph_mark is not None else object()
        nodes = _graph_nodes(loss.grad_fn)
        if self.graph_mark is not None and any(node.metadata.get(GRAPH_MARK) is mark for node in nodes):
            raise RuntimeError(
                f"acc.backward(): this loss's autograd graph was already accumulated in this window by an earlier "
                f"acc.backward(..., retain_graph=True) (the same loss, or one sharing part of its graph). Every "
                f"acc.backward() counts one micro-batch, so a second backward through that graph would add its "
                f"gradients twice and divide them as two micro-batches. For several losses of one micro-batch call "
                f"acc.backward(loss_a + loss_b) once; for another micro-batch, run its forward again. Nothing was "
                f"accumulated: the window holds its {self.num_micro_batches} micro-batch(es) as before")
        if retain:
            for node in nodes:
                node.metadata[GRAPH_MARK] = mark
            self.graph_mark = mark

    def check_next(self, item_mode: bool) -> None:
        """Before a micro-batch's backward: ``RuntimeError`` if a backward of this window failed, ``ValueError`` if
        ``item_mode`` differs from the window's (``num_items`` for every micro-batch of a window or for none)."""
        if self.failed:
            raise RuntimeError(FAILED_WINDOW)
        if self.item_mode is not None and item_mode != self.item_mode:
            raise ValueError(
                "num_items must be given for every micro-batch of a window or for none: this window was started "
                f"{'with' if self.item_mode else 'without'} num_items"
            )

    def add(self, loss: torch.Tensor, num_items: int | torch.Tensor | None) -> int | torch.Tensor | None:
        """A micro-batch's backward succeeded: count it, add its loss (0-d, any float dtype) and items (an int, a
        0-d tensor on any device, or None in mean mode). Returns its items as counted (a 0-d fp64 tensor on the
        device, or the int), or None."""
        self.item_mode = num_items is not None
        self.num_micro_batches += 1
        self.loss_sum += loss.detach().reshape(()).to(torch.float32)
        if num_items is None:
            return None
        if isinstance(num_items, torch.Tensor):
            n = num_items.to(device=self.device, dtype=torch.float64, non_blocking=True)  # exact past 2**24
            # A negative, NaN or inf count poisons the window's item count with NaN, on the device (no host read):
            # the denominator, summed over the ranks by the stats all-reduce, is then NaN on every rank, and
            # step() skips the update (StepResult.invalid_num_items). A negative count would otherwise reverse the
            # update, an inf one zero it.
            n = torch.where(torch.isfinite(n) & (n >= 0), n, torch.full_like(n, float("nan")))
            self.items_dev = n if self.items_dev is None else self.items_dev + n
            return n
        self.items_host += num_items
        return num_items

    def mark_used(self, flags: list[bool]) -> None:
        """The hooks' per-parameter flags of a micro-batch (which parameters a gradient reached), before the hooks
        restart them: kept in ``used`` (or-ed in)."""
        self.used = self.used_with(flags)

    def used_with(self, flags: list[bool]) -> list[bool]:
        """Per parameter (layout order), whether a gradient reached it in the window: ``used`` or-ed with the
        hooks' current ``flags``."""
        if self.used is None or all(flags):  # the usual case: no Python per parameter
            return list(flags)
        return [u or f for u, f in zip(self.used, flags)]

    def fail(self) -> None:
        """A backward raised mid-window: the window is no longer a sum of whole micro-batches."""
        self.failed = True

    def items(self) -> torch.Tensor:
        """This rank's item count: 0-d fp64 on the device (host ints added without a read)."""
        if self.items_dev is None:
            return torch.full((), float(self.items_host), dtype=torch.float64, device=self.device)  # a fill, no copy
        return self.items_dev + self.items_host

    def num_items(self) -> int | torch.Tensor:
        """The items as ``StepResult.num_items`` reports them on one rank: the int when every count was an int,
        else the 0-d fp64 device tensor."""
        return self.items() if self.items_dev is not None else self.items_host

    def unwritten(self, flags: list[bool], world_size: int) -> list[int]:
        """Indices (layout order) of the parameters no gradient reached in this window on any rank (unused branches):
        from the hooks' ``flags`` on one rank, from the stats all-reduce (``WindowStats.globally_unused``) on several."""
        if world_size > 1:
            return self.stats.globally_unused()
        return [i for i, used in enumerate(self.used_with(flags)) if not used]

    def totals(self, world_size: int) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor | None,
                                               torch.Tensor | None]:
        """The window over all ``world_size`` ranks, for ``step()``: ``(loss_sum, denom, num_items, mismatch)``.

        loss_sum: 0-d fp32 on the device, every rank's losses. denom: the window's denominator, 0-d on the device:
        the global item count (fp64) in item mode, else micro-batches x world size (fp32). num_items: what
        ``StepResult.num_items`` reports (None in mean mode). mismatch: several ranks, 0-d bool, the ranks' windows
        hold different micro-batch counts; else None. Several ranks: waits for the stats all-reduce (launched).
        """
        mismatch = items = None
        loss_sum = self.loss_sum
        if world_size > 1:
            loss_sum, items = self.stats.wait()
            mismatch = self.stats.mismatch()
        if self.item_mode:
            if world_size > 1:
                return loss_sum, items, items, mismatch
            return loss_sum, self.items().float(), self.num_items(), mismatch
        count = float(self.num_micro_batches * world_size)
        return loss_sum, torch.full((), count, dtype=torch.float32, device=self.device), None, mismatch  # no H2D copy

    def state_dict(self) -> dict[str, Any]:
        """The counters, CPU tensors and Python scalars."""
        return {
            "num_micro_batches": self.num_micro_batches,
            "item_mode": self.item_mode,
            "items_host": self.items_host,
            "items_dev": None if self.items_dev is None else self.items_dev.detach().cpu().clone(),
            "loss_sum": self.loss_sum.detach().cpu().clone(),
            "failed_backward": self.failed,
            "window_used": None if self.used is None else list(self.used),
        }

    @staticmethod
    def check_state(state: dict[str, Any], accumulation_steps: int, num_params: int) -> None:
        """``ValueError`` naming the key of ``state_dict()``'s part of ``state`` whose value is out of range: the
        micro-batch count (an int in [0, ``accumulation_steps``], the K of the saved window), the item mode (None
        for an empty window, else a bool), the items (an int >= 0, a one-element tensor or None), the loss sum
        (a one-element tensor), the failed flag (a bool), the parameters reached (None or ``num_params`` bools)."""
        def bad(key: str, expected: str) -> ValueError:
            return ValueError(f"state[{key!r}] must be {expected}, got {state.get(key)!r}: the state dict is corrupt "
                              "or not an acc.state_dict(); load another checkpoint")

        n = state.get("num_micro_batches")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= accumulation_steps:
            raise bad("num_micro_batches", f"an int in [0, {accumulation_steps}] (the window's accumulation_steps)")
        mode = state.get("item_mode")
        if (mode is not None or n) and not isinstance(mode, bool):
            raise bad("item_mode", "True or False for a window holding micro-batches, None for an empty one")
        items = state.get("items_host")
        if isinstance(items, bool) or not isinstance(items, int) or items < 0:
            raise bad("items_host", "an int >= 0")
        items_dev = state.get("items_dev")
        if items_dev is not None and (not isinstance(items_dev, torch.Tensor) or items_dev.numel() != 1):
            raise bad("items_dev", "None or a one-element tensor")
        loss = state.get("loss_sum")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise bad("loss_sum", "a one-element tensor")
        if not isinstance(state.get("failed_backward"), bool):
            raise bad("failed_backward", "True or False")
        used = state.get("window_used")
        if used is not None and (not isinstance(used, (list, tuple)) or len(used) != num_params):
            raise bad("window_used", f"None or a list of {num_params} bools")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (``stats`` is None: a state is never saved between the last backward and
        ``step()``)."""
        self.reset()
        self.num_micro_batches = int(state["num_micro_batches"])
        self.item_mode = state["item_mode"]
        self.items_host = int(state["items_host"])
        self.items_dev = None if state["items_dev"] is None else state["items_dev"].to(self.device)
        self.loss_sum = state["loss_sum"].to(self.device)
        self.failed = bool(state["failed_backward"])
        used = state.get("window_used")  # absent from state dicts saved before it was the window's
        self.used = None if used is None else [bool(u) for u in used]


GRAPH_MARK = "gaengine.window"  # the key of a window's mark in an autograd node's metadata


def _graph_nodes(root: Any) -> list[Any]:
    """The nodes of the autograd graph below ``root`` (a ``grad_fn``, or None), each once, without the parameters'
    ``AccumulateGrad`` leaves (the same node in every micro-batch: reaching a parameter twice is the point)."""
    nodes, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))  # ``nodes`` keeps every visited node alive: no id is reused during the walk
        nodes.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return nodes


# What the hooks say when a gradient reaches a parameter of theirs outside its accumulator's backward (csrc).
OUTSIDE_BACKWARD = "managed by GradientAccumulator outside acc.backward()"


def foreign_gradient_error(exc: BaseException, loss: torch.Tensor, acc: Any) -> RuntimeError | None:
    """The error of ``acc.backward(loss)`` whose autograd pass reached a parameter of another live accumulator
    (``exc``: what the other accumulator's hook raised, ``OUTSIDE_BACKWARD``), naming that parameter and the two
    ways on; None when ``exc`` is another error. Two accumulators on one graph: a GAN's generator loss through the
    discriminator (docs/pitfalls.md). Walks the loss's graph for the parameters' ``AccumulateGrad`` nodes (host
    only, on this error path only)."""
    from gaengine.clip import OWNER_ATTR  # noqa: PLC0415 - the mark every accumulator leaves on its parameters

    if not isinstance(exc, RuntimeError) or OUTSIDE_BACKWARD not in str(exc):
        return None
    found, seen, stack = None, set(), [loss.grad_fn]
    while stack and found is None:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        owner = getattr(variable, OWNER_ATTR, None) if isinstance(variable, torch.Tensor) else None
        other = owner() if owner is not None else None
        if other is not None and other is not acc:
            found = (variable, other)
        stack.extend(child for child, _ in node.next_functions)
    if found is None:
        return None
    p, other = found
    name = next((n for n, q in other.named_params if q is p), f"of shape {tuple(p.shape)}")
    return RuntimeError(
        f"acc.backward(loss): this loss's graph reaches parameter {name!r} of another GradientAccumulator (B), so "
        f"autograd produced a gradient of accumulator B's parameters inside this accumulator's (A's) backward, as a "
        f"GAN's generator loss does through the discriminator. Neither accumulator adds it: B's window is as it "
        f"was, and this micro-batch's backward stopped part way, so A's window failed (acc.zero_grad() on A drops "
        f"it). Two ways on: freeze B's parameters for A's windows (p.requires_grad_(False) for each, between B's "
        f"windows; requires_grad_(True) again before B's next backward), or let autograd compute A's gradients only: "
        f"acc.backward(loss, inputs=[...A's parameters...]). See docs/pitfalls.md (two accumulators on one graph)")


# The dtypes of a tensor num_items: integers, and floats that count exactly up to 2**24 items or more (fp16 and
# bf16 round counts above 2048 and 256).
NUM_ITEMS_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64)


def warn_dropped_window(window: Window | None, how: str) -> None:
    """One ``UserWarning`` when the accumulator is closed (``how``) with micro-batches in its ``window`` (None: the
    constructor raised before building it)."""
    k = 0 if window is None or window.failed else window.num_micro_batches
    if k > 0 and not window.dropped_warned:
        window.dropped_warned = True
        warnings.warn(
            f"{how} dropped the {k} micro-batch(es) of an unfinished accumulation window: they were never "
            f"applied. Call acc.step(force=True) before acc.close() (and "
            f"at the end of every epoch) to apply a partial window, exactly normalized by what it holds; "
            f"acc.zero_grad() drops it without this warning", UserWarning, stacklevel=3)


def check_num_items(num_items: Any, device: torch.device | None = None) -> int | torch.Tensor:
    """``num_items`` as ``Window.add`` takes it: an int >= 1, or a one-element tensor of a ``NUM_ITEMS_DTYPES``
    dtype on the CPU or on ``device`` (the parameters'), reshaped to 0-d and never read on the host. What the host
    can check is checked here, before autograd runs: ``ValueError`` naming ``num_items`` otherwise (a tensor on
    another device, e.g. ``meta``, or of another dtype). Its value stays on the device: a negative, NaN or inf count
    makes ``step()`` skip the window (``Window.add``)."""
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype not in NUM_ITEMS_DTYPES:
            raise ValueError(f"num_items must be an int or a one-element tensor of an integer dtype, float32 or "
                             f"float64, got shape {tuple(num_items.shape)} {num_items.dtype}")
        if device is not None and num_items.device.type != "cpu" and num_items.device != device:
            raise ValueError(f"num_items must be a tensor on the cpu or on the parameters' device {device}, got one on "
                             f"{num_items.device}: count the items where the batch is (e.g. "
                             "(labels != -100).sum() on the labels' device)")
        return num_items.reshape(())
    if isinstance(num_items, bool) or not isinstance(num_items, int):
        raise ValueError(f"num_items must be an int >= 1 or a one-element tensor, got {num_items!r}")
    if num_items < 1:
        raise ValueError(
            f"num_items must be >= 1 (the items the summed loss covers), got {num_items}: a micro-batch with no "
            "items adds nothing to the gradient, so skip its acc.backward() (the window is unchanged). On several "
            "ranks, where every rank must call acc.backward() together, pass it as a tensor: "
            "num_items=torch.tensor(0)")
    return num_items


@dataclass(frozen=True)
class StepResult:
    """What one applied (or skipped) update did. Tensors are 0-d and on the parameters' device.

    grad_norm: fp32, L2 norm of the normalized gradient (after dividing by the window's denominator,
        before clipping).
    clip_coef: fp32, the clip coefficient ``min(1, max_norm / (grad_norm + 1e-6))`` (1.0 without clipping).
    skipped: bool, True when the update was not applied: a gradient was inf/NaN, a tensor ``num_items`` was
        negative, NaN or inf (``invalid_num_items``), or (several ranks) the ranks' micro-batch counts differed.
    num_micro_batches: micro-batches in the window (K, or fewer for ``step(force=True)``).
    num_items: total items of the window in item mode (an int, or a 0-d tensor when items were given as
        tensors); None in mean mode.
    loss: fp32, the window's loss normalized like the gradient (mean of the micro-batch means, or the
        sum of the loss sums divided by ``num_items``).
    loss_scale: fp32, the loss scale this window was computed with (None without loss scaling).
    grad_noise_scale: fp32, ``B_simple = noise_trace_sigma / noise_grad_sq`` after this window
        (``measure_noise_scale=True``; else None): the gradient noise scale of McCandlish et al. (arXiv
        1812.06162), in items (item mode) or micro-batches (mean mode); NaN until a window could be measured.
        See ``gaengine.noise``.
    noise_trace_sigma: fp32, the bias-corrected moving average of tr(Sigma), the per-sample gradient
        covariance's trace (eq. A.3), or None.
    noise_grad_sq: fp32, the bias-corrected moving average of |G|^2, the true gradient's squared norm (eq.
        A.2), or None.
    invalid_num_items: bool, a ``num_items`` tensor of the window (on any rank) was negative, NaN or inf, so the
        update was skipped (``skipped`` is True, ``num_items``, ``grad_norm`` and ``loss`` are NaN); None unless the
        window passed ``num_items`` as tensors (or ran on several ranks in item mode).
    """

    grad_norm: torch.Tensor
    clip_coef: torch.Tensor
    skipped: torch.Tensor
    num_micro_batches: int
    num_items: int | torch.Tensor | None
    loss: torch.Tensor
    loss_scale: torch.Tensor | None = None
    grad_noise_scale: torch.Tensor | None = None
    noise_trace_sigma: torch.Tensor | None = None
    noise_grad_sq: torch.Tensor | None = None
    invalid_num_items: torch.Tensor | None = None


class RankCounts:
    """Several ranks: every rank's window must hold the same number of micro-batches (docs/multi-rank.md). The stats
    all-reduce carries each rank's count (``WindowStats.counts``); ``step()`` reads them on the host where it reads
    the device anyway, else (a fused optimizer, no host read) they are copied to host memory behind the all-reduce
    without a wait (``gaengine.reduce.HostMailbox``), with what that step is about to count, and the next
    ``backward()`` or ``step()`` reads them (``pending``, ``take``). world_size, device, group: the ranks'."""

    def __init__(self, world_size: int, device: torch.device, group: Any) -> None:
        self.world_size, self.device, self.group = world_size, device, group
        self._mailbox: HostMailbox | None = None
        self._mailbox_numel = 0
        self._names: list[str] = []
        self._settings: tuple[tuple[str, object], ...] = ()
        self._saved: Any = None
        self.pending = False

    def read(self, stats: WindowStats, now: bool, saved) -> tuple[list[int], list[str]] | None:
        """The window's counts as ints and the names of the settings the ranks disagree on
        (``WindowStats.settings_mismatch``) when ``now`` (a host read), else None: they are posted, with what
        ``saved()`` returns (what ``take()`` gives back to undo the step's counting if they differed; no host
        read)."""
        self._settings = stats.settings
        self._names = [name for name, _ in stats.settings]
        if now:
            if not self._names:
                return stats.read_counts(), []
            values = stats.disagreement().tolist()  # one host read, the counts and the flags: step() reads anyway
            stats.host_counts = [int(c) for c in values[:self.world_size]]
            return stats.host_counts, [n for n, f in zip(self._names, values[self.world_size:]) if f]
        numel = self.world_size + len(self._names)
        if self._mailbox is None or self._mailbox_numel != numel:
            self._mailbox, self._mailbox_numel = HostMailbox(numel, torch.float64, self.device), numel
        self._mailbox.post(stats.disagreement())
        self._saved, self.pending = saved(), True
        return None

    def take(self) -> tuple[tuple[list[int], list[str]], Any]:
        """What ``read`` posted, as ``read`` returns it (host memory; on CUDA waits for their copy only), and what
        was posted with them."""
        saved, self._saved, self.pending = self._saved, None, False
        values = self._mailbox.read()
        flags = values[self.world_size:]
        return ([int(c) for c in values[:self.world_size]], [n for n, f in zip(self._names, flags) if f]), saved

    def take_error(self, schedule: Any, scaler: Any) -> Exception | None:
        """Read the last window's counts (``take``; called first thing by ``backward()`` and ``step()``, the window
        since empty): None where they agreed; else what its ``step()`` counted is restored (``schedule``'s update
        count and items seen, the loss scale of ``scaler``) and the error returned (``error``)."""
        (counts, settings_differ), (update_index, items_seen, scaler_state) = self.take()
        if all(c == counts[0] for c in counts) and not settings_differ:
            return None
        schedule.update_index, schedule.items_seen = update_index, items_seen
        if scaler_state is not None:
            scaler.scale.copy_(scaler_state[0])
            scaler.growth_tracker.copy_(scaler_state[1])
        return self.error(counts, f" in the last window (after {update_index} updates: its step() skipped the update "
                                  "on the device without reading the counts, this call read them)", settings_differ)

    def error(self, counts: list[int], found: str = "", differ: list[str] = ()) -> Exception:
        """The error of a window whose ranks held different counts (``RuntimeError``,
        ``gaengine.reduce.count_mismatch_message``) or, first, different settings: ``ValueError`` naming each
        setting in ``differ`` and this rank's value of it in the window last read."""
        rank = dist.get_rank(self.group)
        if differ == [MEMBERSHIP_SETTING]:
            changed = dict(self._settings).get(MEMBERSHIP_SETTING)
            return ValueError(
                f"gaengine: the ranks changed their trainable parameters differently in this window{found}: rank "
                f"{rank} of {self.world_size} {'made parameters trainable or froze them' if changed else 'changed none'}"
                ", another rank did otherwise (requires_grad_() or optimizer.add_param_group(...) on some ranks only, "
                "in the middle of a window). No rank applied this window: the parameters, the optimizer state, the "
                "lr_scheduler and the loss scale are as before it. Change parameters alike on every rank, between "
                "windows, then call acc.zero_grad() and go on")
        if differ:
            values = dict(self._settings)
            named = ", ".join(f"{n} (this rank's: {values.get(n)!r})" for n in differ)
            return ValueError(
                f"gaengine: the ranks hold different {named}{found}: rank {rank} of {self.world_size} disagrees with "
                f"another rank (set at run time, e.g. acc.{differ[0]} = ..., on some ranks only). Different settings "
                "would train the ranks apart silently, so no rank applied this window: the parameters, the optimizer "
                "state, the lr_scheduler and the loss scale are as before it. Set the same value on every rank (the "
                "counts per rank were " + ", ".join(f"{r}: {c}" for r, c in enumerate(counts[:16])) + "), call "
                "acc.zero_grad() and go on")
        return RuntimeError(count_mismatch_message(counts, rank, found))
