"""The optimizer step with the step's coefficient folded in, and the policies the parameter store runs it with.

The parameter store (``gaengine.store.ParameterStore``) owns the parameters, the fp32 masters, the optimizer's
pieces and the update; this module holds what it runs and decides with:

* ``step_optimizer``: ``optimizer.step()`` with ``coef`` (0-d fp32 on the device: normalization x clipping) and
  the skip flag. A fused torch optimizer takes both through ``grad_scale``/``found_inf`` (no pass, no host sync);
  any other gets its gradients scaled first (one pass, by the store) and one host read of the skip flag.
  ``step_scheduler`` steps the lr scheduler only when the update was applied.
* which optimizer writes the model itself or takes ``grad_scale``/``found_inf`` is ``gaengine.optimizers``' table
  (``writes_model_params``, ``takes_grad_scale``).
* ``merge_model_write``/``param_versions``: a model write since the last update (``model.load_state_dict()``)
  reaches the masters; ``convert_state``: optimizer state built before the accumulator follows its parameter's
  dtype.
* ``expose_grads``: without an optimizer, leave the final gradients in ``p.grad`` (views of main_grad for
  fp32 params, rounded copies for bf16/fp16).
* ``WindowGrads``: the window's normalized gradient lent to the user in ``.grad`` (``acc.begin_step()``,
  ``acc.step(before_update=...)``) and what the user left there taken back into ``main_grad``.
"""

from __future__ import annotations

import inspect

import torch

from gaengine import optimizers
from gaengine.buffer import FlatBuffer

__all__ = ["LOW_PRECISION", "WindowGrads", "check_optimizer_step", "convert_state", "expose_grads", "merge_model_write",
           "param_versions", "step_optimizer", "step_scheduler", "SchedulerWatch"]

LOW_PRECISION = (torch.bfloat16, torch.float16)  # the dtypes that get fp32 master weights


def convert_state(state: dict, param: torch.Tensor, dtype: torch.dtype) -> None:
    """Give ``dtype`` to the per-element floating tensors of one parameter's optimizer ``state`` (those of
    ``param``'s numel, e.g. Adam's ``exp_avg``/``exp_avg_sq``; ``step`` and other scalars are kept), in place."""
    for key, t in state.items():
        if (key != "step" and isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
                and t.numel() == param.numel()):
            state[key] = t.to(dtype).contiguous()


def check_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """``TypeError`` naming ``optimizer`` unless its ``step()`` can be called with no argument, once per window, as
    gaengine calls it (``torch.optim.LBFGS`` and other closure optimizers re-evaluate the loss inside ``step``,
    which an accumulation window cannot do)."""
    try:  # the class's step, less self (an lr_scheduler wraps the instance's step in a (*args, **kwargs) wrapper)
        signature = list(inspect.signature(type(optimizer).step).parameters.values())[1:]
    except (TypeError, ValueError):
        return  # a builtin step: nothing to read, gaengine calls it as torch's optimizers are called
    required = [q.name for q in signature
                if q.default is inspect.Parameter.empty and q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD,
                                                                        q.KEYWORD_ONLY)]
    if not required:
        return
    what = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    closure = "closure" in required
    raise TypeError(
        f"optimizer {what}.step() requires {', '.join(map(repr, required))}, but gaengine calls optimizer.step() "
        "with no argument once per accumulation window, on the window's accumulated gradient. "
        + ("A closure optimizer (LBFGS) re-evaluates the loss several times per step, which a window of "
           "micro-batches cannot do: " if closure else "")
        + "use an optimizer whose step() needs no argument (torch.optim.AdamW, SGD, gaengine.optim.FusedAdamW), "
        "or train without the accumulator")


def merge_model_write(master: torch.Tensor, param: torch.Tensor) -> None:
    """``master`` (fp32) takes ``param``'s value (bf16/fp16, same numel) wherever it differs from the master's own
    rounding: a value written into the model since; elsewhere the master keeps its fp32 bits. On the device, no
    host read."""
    with torch.no_grad():
        param = param.reshape(master.shape)
        master.copy_(torch.where(param == master.to(param.dtype), master, param.to(torch.float32)))


def param_versions(params: list[torch.Tensor]) -> list[int]:
    """Each parameter's version counter (``Tensor._version``: bumped by every in-place write)."""
    return [p._version for p in params]


def step_optimizer(optimizer: torch.optim.Optimizer, coef: torch.Tensor, skipped: torch.Tensor,
                   scaled: bool) -> bool | None:
    """``optimizer.step()`` on the gradients in place, with normalization x clipping ``coef`` and the skip flag.

    coef: 0-d fp32, skipped: 0-d bool, on the device. scaled: the gradients were already multiplied by ``coef``.
    A fused optimizer (``gaengine.optimizers.takes_grad_scale``) takes ``1 / coef`` as ``grad_scale`` (unless ``scaled``) and the skip as
    ``found_inf``: no pass, no host sync, and None is returned (decided on the device). Any other optimizer reads
    the skip flag on the host and steps only when it is False; returns whether it stepped.
    """
    if not optimizers.takes_grad_scale(optimizer):
        applied = not bool(skipped)  # host read: a non-fused optimizer cannot skip on the device
        if applied:
            optimizer.step()
        return applied
    # The fused kernels divide each gradient by grad_scale and skip everything (step counts included) when
    # found_inf is set: normalization + clipping + skip at no extra pass or sync.
    if not scaled:
        optimizer.grad_scale = coef.reciprocal()
    optimizer.found_inf = skipped.to(torch.float32)
    try:
        optimizer.step()
    finally:
        if not scaled:
            del optimizer.grad_scale
        del optimizer.found_inf
    return None


def step_scheduler(lr_scheduler, applied: bool | None, skipped: torch.Tensor) -> None:
    """Step ``lr_scheduler`` (or nothing for None) when the update was applied: ``applied`` as ``step_optimizer``
    returned it, or None, then one host read of ``skipped`` (the scheduler runs on the host)."""
    if lr_scheduler is None:
        return
    if applied is None:
        applied = not bool(skipped)  # host read: the scheduler runs on the host
    if applied:
        lr_scheduler.step()


class SchedulerWatch:
    """The accumulator's ``lr_scheduler`` stepped only by ``step()``: ``check`` raises ``RuntimeError`` when it was
    stepped outside since the last update (its ``last_epoch`` moved), which would decay its learning rate twice as
    fast. Armed by the first update (``stepped``: a scheduler resumed before it is fine) and by ``load_state_dict``."""

    def __init__(self, lr_scheduler) -> None:
        self.lr_scheduler = lr_scheduler
        self.epoch: int | None = None  # lr_scheduler.last_epoch after the last update

    def stepped(self) -> None:
        """The accumulator stepped (or restored) the scheduler: its ``last_epoch`` now is the one to keep."""
        self.epoch = getattr(self.lr_scheduler, "last_epoch", None)

    def check(self) -> None:
        """``RuntimeError`` when the scheduler was stepped outside ``acc.step()`` since it was last ``stepped``."""
        if self.epoch is None:
            return
        epoch = getattr(self.lr_scheduler, "last_epoch", None)
        if epoch is not None and epoch != self.epoch:
            raise RuntimeError(
                f"lr_scheduler ({type(self.lr_scheduler).__name__}) was stepped outside acc.step(): its last_epoch is "
                f"{epoch}, but acc.step() left it at {self.epoch}. The accumulator was given it as "
                f"GradientAccumulator(..., lr_scheduler=...) and steps it once per applied update, so your own "
                f"scheduler.step() would decay the learning rate {epoch - self.epoch + 1} times as fast. "
                f"Remove your scheduler.step() (or pass lr_scheduler=None and step it yourself when acc.step() "
                f"returns a result whose skipped is False); to restore the scheduler's state, load it through "
                f"acc.load_state_dict(). Nothing was accumulated or applied by this call")


def expose_grads(params: list[torch.Tensor], main_grad: FlatBuffer, unwritten: list[int], wrap=None) -> None:
    """No optimizer: ``p.grad`` = the final gradient (the view of main_grad for fp32 params, a rounded copy for
    bf16/fp16), None for the params in ``unwritten`` (no gradient in the window). wrap: ``wrap(p, grad)`` is what
    ``p.grad`` takes (``gaengine.fsdp2.DTensorShards.wrap`` for FSDP2's DTensor parameters, whose ``main_grad`` views
    are shaped like their local shards), or None: the gradient itself."""
    unused = set(unwritten)
    with torch.no_grad():
        for i, p in enumerate(params):
            if i in unused:
                p.grad = None
            else:
                view = main_grad.views[i]
                grad = view if p.dtype == torch.float32 else view.to(p.dtype)
                p.grad = grad if wrap is None else wrap(p, grad)


class WindowGrads:
    """The window's normalized gradient lent to the user in ``.grad`` and taken back (docs/accumulator.md).

    Lent (``expose_grads``): an fp32 parameter's ``.grad`` is its view of ``main_grad`` (zero-copy: an edit in place
    is an edit of the window); a bf16/fp16 parameter's is the rounding of that view to the parameter's dtype (a
    copy: torch requires a ``.grad`` of the parameter's dtype); None for a parameter in ``unwritten``.

    Taken back (``take_back``), per parameter, what its ``.grad`` holds then:

    * its fp32 view itself: nothing to do, the edits made in place are in ``main_grad`` already;
    * any other tensor of the parameter's shape (the bf16/fp16 copy, edited in place or not; a ``.grad`` replaced):
      merged into ``main_grad`` element by element (``merge_model_write``'s rule): an element equal to the rounding
      of what ``main_grad`` holds keeps its fp32 value, any other takes the edited value. So an unedited gradient
      loses nothing, and an edit reaches the update for every dtype, as in the plain recipe;
    * None: the parameter gets no update (torch's optimizers skip a ``.grad`` of None): it joins ``unwritten`` and
      its slice of ``main_grad`` is zeroed.

    params: the layout's parameters (``main_grad``'s order); names: their names, for errors; unwritten: the layout
    indices with no gradient in the window.
    """

    def __init__(self, params: list[torch.Tensor], names: list[str], main_grad: FlatBuffer,
                 unwritten: list[int]) -> None:
        self.params, self.names, self.main_grad = params, names, main_grad
        self.unwritten = list(unwritten)
        self.lend()

    def lend(self) -> None:
        """``.grad`` = the window's gradient as ``main_grad`` holds it now (see the class docstring)."""
        expose_grads(self.params, self.main_grad, self.unwritten)

    def take_back(self) -> list[int]:
        """Take what ``.grad`` holds into ``main_grad`` (the class docstring) and return the parameters without a
        gradient now (layout indices). A ``.grad`` of another shape, dtype or device cannot be there: torch refuses
        to set one."""
        unwritten = []
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(self.params, self.main_grad.views)):
                g = p.grad
                if g is None:
                    view.zero_()
                    unwritten.append(i)
                elif g is not view:
                    merge_model_write(view, g)
        self.unwritten = unwritten
        return unwritten

    def release(self) -> None:
        """``.grad`` = None for every parameter."""
        for p in self.params:
            p.grad = None
