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
"""

from __future__ import annotations

import inspect

import torch

from gaengine import optimizers
from gaengine.buffer import FlatBuffer

__all__ = ["LOW_PRECISION", "check_optimizer_step", "convert_state", "expose_grads", "merge_model_write",
           "param_versions", "step_optimizer", "step_scheduler"]

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


def take_grad_writes(params: list[torch.Tensor], main_grad: FlatBuffer, exposed: list[torch.Tensor | None],
                     versions: list[int | None]) -> bool:
    """After a ``step(before_update=...)`` hook, the writes it made to the ``.grad`` that ``expose_grads`` gave
    (``exposed``, with their ``_version`` counters then, ``versions``) reach ``main_grad``: an fp32 parameter's
    ``.grad`` written in place is ``main_grad``'s view already; a bf16/fp16 parameter's rounded copy written in place
    is merged back (``merge_model_write``: the fp32 sum takes the copy's value wherever it differs from the sum's own
    rounding, elsewhere it keeps its fp32 bits); a ``.grad`` replaced by another tensor of the parameter's shape is
    copied in. A ``.grad`` set to None is not a write. Returns whether anything may have changed (the norm is then
    taken again). ``ValueError`` for a replacement of another shape."""
    changed = False
    with torch.no_grad():
        for i, (p, old, version) in enumerate(zip(params, exposed, versions)):
            grad = p.grad
            if old is None or grad is None:
                continue
            if grad is not old:
                if grad.shape != old.shape:
                    raise ValueError(f"a before-the-update hook set .grad of a parameter of shape {tuple(old.shape)} "
                                     f"to a tensor of shape {tuple(grad.shape)}: write the window's gradient in place "
                                     "(p.grad.clamp_(...)) or with a tensor of the parameter's shape")
                main_grad.views[i].copy_(grad.reshape(old.shape))
            elif old._version == version:
                continue
            elif p.dtype != torch.float32:
                merge_model_write(main_grad.views[i], grad)
            changed = True
    return changed


def expose_grads(params: list[torch.Tensor], main_grad: FlatBuffer, unwritten: list[int], wrap=None) -> None:
    """No optimizer: ``p.grad`` = the final gradient (the view of main_grad for fp32 params, a rounded copy for
    bf16/fp16), None for the params in ``unwritten`` (no gradient in the window). wrap: ``wrap(p, grad)`` is what
    ``p.grad`` takes (``gaengine.store.DTensorShards.wrap`` for FSDP2's DTensor parameters, whose ``main_grad`` views
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
