"""The update: fp32 master weights, the optimizer step with the step's coefficient folded in, the model copy.

* ``MasterWeights``: for the bf16/fp16 parameters the optimizer holds, fp32 masters in one flat buffer
  (4 B/param), swapped into the optimizer's param groups; during ``apply_update`` each master's ``.grad`` is its
  view of the fp32 main_grad buffer, so the optimizer reads the accumulated gradient in place. The bf16/fp16 model parameters themselves (the same ``Parameter`` objects,
  ``p.data`` re-pointed) become views of one flat buffer per dtype laid out exactly like their range of the
  master buffer (Megatron-Core's distributed optimizer re-points its params the same way), so after the
  update the masters are rounded into the model with one flat copy per dtype, unless the optimizer writes
  them itself (``gaengine.optim.FusedAdamW``).
* ``apply_update``: gives every optimized parameter (or its master) its gradient, runs the optimizer with
  ``coef`` (0-d fp32 on the device: normalization x clipping) and the skip flag, then steps the scheduler.
  The gradients exist only for that call: outside it the optimizer's parameters hold no ``.grad`` (and no
  ``main_grad``), so a leftover ``optimizer.step()`` / ``optimizer.zero_grad()`` in a user's loop after
  ``acc.step()`` changes nothing (torch's optimizers skip a parameter whose ``.grad`` is None).
  A fused torch optimizer takes both through ``grad_scale``/``found_inf`` (no pass, no host sync); any
  other gets one scale pass over main_grad and one host read of the skip flag. Without masters, a torch
  optimizer gets each low-precision parameter's gradient normalized, clipped and rounded to its dtype;
  ``gaengine.optim.FusedAdamW`` reads the fp32 main_grad views themselves (``p.main_grad``) and updates the
  bf16/fp16 parameters in place in one pass (16 B/param), coef and skip through ``grad_scale``/``found_inf``.
* ``expose_grads``: without an optimizer, leave the final gradients in ``p.grad`` (views of main_grad for
  fp32 params, rounded copies for bf16/fp16).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.autograd.graph import increment_version

from gaengine.buffer import FlatBuffer, FlatLayout

__all__ = ["MasterWeights", "apply_update", "check_optimizer_step", "expose_grads", "fused_optimizer",
           "merge_model_write", "param_versions", "step_optimizer", "step_scheduler", "writes_model_params"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """The optimizer's view of the model: which params it holds, and fp32 masters for the low-precision ones.

    optimizer: re-pointed at the masters (param groups, hyper-parameters and any existing state kept).
    params: the trainable parameters in layout order; main_grad: the fp32 flat gradient buffer over them.
    enabled: keep masters (``master_weights=True``); False: the optimizer updates the low-precision params
        in place: ``reads_main_grad`` is set for ``gaengine.optim.FusedAdamW`` (it takes the fp32
        main_grad views as ``p.main_grad``; existing fp32 moments of those params, e.g. a master-weights
        checkpoint loaded before, are rounded to the param dtype once, as torch's loader would), else
        ``normalize_before_rounding``.

    optimized: ids of the model parameters the optimizer holds. masters: model param id -> fp32 master
    (a ``Parameter`` aliasing ``buffer``). buffer: the flat fp32 master buffer, or None when no optimized
    param is bf16/fp16 (or masters are disabled). Its params are grouped by dtype (bf16 first, then fp16;
    layout order within a dtype), so each dtype's params fill one aligned range of it.

    model_buffers: dtype -> ``FlatBuffer`` of that dtype laid out exactly like the dtype's range of
    ``buffer`` (the same offsets relative to the range's start, which is ``ALIGN_NUMEL``-aligned; with one
    low-precision dtype, the same offsets). Each optimized bf16/fp16 model parameter is re-pointed at its
    view (``p.data = view``: same ``Parameter`` object, same dtype and device, so autograd keeps its
    AccumulateGrad node and the hooks registered on it). Padding is zero and stays zero.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], main_grad: FlatBuffer,
                 device: torch.device, enabled: bool) -> None:
        self.optimized: set[int] = {id(q) for g in optimizer.param_groups for q in g["params"]}
        self.masters: dict[int, nn.Parameter] = {}
        self.buffer: FlatBuffer | None = None
        self.low_params: list[torch.Tensor] = []
        self._versions: list[int] = []  # low_params' version counters when the masters were last rounded into them
        self.low_masters: list[nn.Parameter] = []
        self.model_buffers: dict[torch.dtype, FlatBuffer] = {}
        self._model_copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model flat buffer, master range)
        self._model_firsts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model flat buffer, its first param)
        # An optimizer that writes the rounded master into the model parameter in its own pass
        # (gaengine.optim.FusedAdamW) saves the separate master -> model copy.
        self.optimizer_writes_model = False
        # master_weights=False: step() normalizes and clips the fp32 buffer before rounding it to the low-
        # precision params, so each gradient is rounded once at its final scale (and a loss-scaled sum
        # cannot overflow fp16).
        self.normalize_before_rounding = False
        # master_weights=False with gaengine.optim.FusedAdamW: each low-precision param's fp32 main_grad view is
        # passed as p.main_grad (p.grad cannot hold an fp32 gradient of a bf16 tensor) and coef as grad_scale:
        # no scale pass, no rounding copy, one in-place pass per param.
        self.reads_main_grad = False
        low = [p for p in params if p.dtype in _LOW_PRECISION and id(p) in self.optimized]
        if not low:
            return
        if not enabled:
            # The update keeps the state in the param dtype (torch.optim.AdamW's layout); fp32 state (a master-weights
            # checkpoint loaded before) is rounded to it once, as torch's Optimizer.load_state_dict casts it.
            for p in low:
                _convert_state(optimizer.state.get(p, {}), p, p.dtype)
            if writes_model_params(optimizer):
                self.reads_main_grad = True
            else:
                self.normalize_before_rounding = True
            return
        low = [p for dtype in _LOW_PRECISION for p in low if p.dtype == dtype]  # each dtype one range
        self.buffer = FlatBuffer(FlatLayout.build(low), torch.float32, device)
        with torch.no_grad():
            for p, view in zip(low, self.buffer.views):
                view.copy_(p)
                self.masters[id(p)] = nn.Parameter(view, requires_grad=True)  # aliases the flat master buffer
            start = 0
            for dtype in _LOW_PRECISION:
                group = [p for p in low if p.dtype == dtype]
                if not group:
                    continue
                # Offsets relative to an aligned start are those of the master range (FlatLayout rounds up
                # to ALIGN_NUMEL from there), and its length reaches the next dtype's start.
                model = FlatBuffer(FlatLayout.build(group), dtype, device)
                master_range = self.buffer.data.narrow(0, start, model.layout.total_numel)
                model.data.copy_(master_range)  # exact: every master is a bf16/fp16 value; padding 0
                for p, view in zip(group, model.views):
                    p.data = view  # same dtype and device: the AccumulateGrad node and its hooks are kept
                self.model_buffers[dtype] = model
                self._model_copies.append((model.data, master_range))
                self._model_firsts.append((model.data, group[0]))
                start += model.layout.total_numel
        for group in optimizer.param_groups:
            group["params"] = [self.masters.get(id(q), q) for q in group["params"]]
        for p in low:  # state built before the accumulator (a step taken, a resume) follows its parameter, in fp32
            if p in optimizer.state:
                state = optimizer.state[self.masters[id(p)]] = optimizer.state.pop(p)
                _convert_state(state, p, torch.float32)  # exact: bf16/fp16 -> fp32
        self.low_params = low
        self.low_masters = [self.masters[id(p)] for p in low]
        self.optimizer_writes_model = writes_model_params(optimizer)
        if self.optimizer_writes_model:
            optimizer.attach_model_params(list(zip(self.low_masters, low)))
        self._versions = param_versions(low)

    def pull_model_writes(self) -> None:
        """Copy into their fp32 masters the bf16/fp16 parameters written since the masters were last rounded into
        the model: ``model.load_state_dict()`` or an in-place write under ``torch.no_grad()`` after construction
        (exact: a bf16/fp16 value is an fp32 value). Without it the next update would start from the old masters
        and revert the write. Seen through each parameter's version counter (bumped by every in-place op; a write
        through ``p.data`` is not seen): one host-side integer per parameter, no device work unless one changed.
        An element that still holds its master's rounding keeps the master (``merge_model_write``), so loading the
        model of a checkpoint beside the accumulator's own masters, in either order, keeps their fp32 bits."""
        versions = param_versions(self.low_params)
        if versions == self._versions:
            return
        for p, master, new, old in zip(self.low_params, self.low_masters, versions, self._versions):
            if new != old:
                merge_model_write(master, p)
        self._versions = versions

    def model_written(self) -> None:
        """The masters' rounding is in the model now (after the update): the version counters to compare with."""
        self._versions = param_versions(self.low_params)

    def check_model(self) -> None:
        """Raise ``RuntimeError`` when the re-pointed parameters no longer live in the flat model buffers (the
        model was moved or converted after the accumulator was built: ``model.to(other device or dtype)``,
        ``.float()``, ...). One parameter per dtype is looked at: ``Module._apply`` moves them all."""
        for model, first in self._model_firsts:
            if first.device != model.device or first.untyped_storage().data_ptr() != model.untyped_storage().data_ptr():
                raise RuntimeError(
                    f"a {model.dtype} model parameter of shape {tuple(first.shape)} is no longer a view of the "
                    f"accumulator's flat {model.dtype} buffer (it is {first.dtype} on {first.device}): the model was "
                    "moved or converted after the GradientAccumulator was built (model.to(...), .float(), "
                    ".cuda(), ...). Move and convert the model first, then build the optimizer and the accumulator"
                )

    def copy_to_model(self) -> None:
        """Round the fp32 masters into the bf16/fp16 model parameters: one flat copy per dtype (the padding is
        zero in both buffers), then the parameters' version counters are bumped as an in-place op would.
        Raises ``RuntimeError`` as ``check_model``."""
        self.check_model()
        with torch.no_grad():
            for model, master_range in self._model_copies:
                model.copy_(master_range)
        increment_version(self.low_params)  # p.data = view gave each parameter its own version counter
        self.model_written()


def _convert_state(state: dict, param: torch.Tensor, dtype: torch.dtype) -> None:
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


def writes_model_params(optimizer: torch.optim.Optimizer) -> bool:
    """An optimizer that takes the fp32 gradient of a bf16/fp16 parameter as ``p.main_grad`` and writes the rounded
    master into the model parameter in its own pass (``gaengine.optim.FusedAdamW``: its ``attach_model_params``).
    The one test of it, for the masters of every sharding strategy."""
    return callable(getattr(optimizer, "attach_model_params", None))


def fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """A torch optimizer with ``fused=True`` that takes ``grad_scale``/``found_inf`` (Adam, AdamW, SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False) and optimizer.defaults.get("fused"))


def apply_update(optimizer: torch.optim.Optimizer, lr_scheduler, masters: MasterWeights, backend,
                 params: list[torch.Tensor], main_grad: FlatBuffer, coef: torch.Tensor, skipped: torch.Tensor,
                 unwritten: list[int]) -> None:
    """Run the optimizer on the window's gradient ``main_grad · coef``, skipping it when ``skipped``.

    params: layout order; main_grad: (n,) fp32 raw sums, scaled in place by ``coef`` unless a fused optimizer
    takes it. coef: 0-d fp32, skipped: 0-d bool, both on the device. unwritten: layout indices with no
    gradient in the window: their params get ``.grad = None`` (no update, as torch optimizers do).
    ``lr_scheduler`` (or None) is stepped only when the update was applied (one host read of ``skipped``).
    """
    masters.check_model()  # before anything is written
    masters.pull_model_writes()  # model.load_state_dict() since the last update reaches the masters
    targets = []  # what the optimizer holds and was handed a gradient: none of it keeps one after the step
    unused = {id(params[i]) for i in unwritten}
    fused = fused_optimizer(optimizer)
    scaled = not fused or masters.normalize_before_rounding
    if scaled:
        backend.scale_(main_grad.data, coef)  # one fp32 pass: normalization and clipping
    for i, p in enumerate(params):  # every param the optimizer holds gets its gradient or None
        if id(p) not in masters.optimized:
            continue  # trainable but not optimized: counted in the norm, left alone
        target = masters.masters.get(id(p), p)
        view = main_grad.views[i]
        targets.append(target)
        if masters.reads_main_grad and target.dtype != torch.float32:
            target.grad = None
            target.main_grad = None if id(p) in unused else view  # read by FusedAdamW in fp32, no copy
        elif id(p) in unused:
            target.grad = None
        else:  # fp32 (a master, or an fp32 param): the view itself; a low-precision param: a rounded copy
            target.grad = view if target.dtype == torch.float32 else view.to(target.dtype)
    try:
        applied = step_optimizer(optimizer, coef, skipped, scaled)
    finally:
        for target in targets:
            target.grad = None
            if hasattr(target, "main_grad"):
                del target.main_grad
    if masters.masters and not masters.optimizer_writes_model:
        # A skipped update left the masters unchanged, and the model already holds their rounding:
        # copying unconditionally is bit-identical and needs no host read of the skip flag.
        masters.copy_to_model()
    masters.model_written()
    step_scheduler(lr_scheduler, applied, skipped)


def step_optimizer(optimizer: torch.optim.Optimizer, coef: torch.Tensor, skipped: torch.Tensor,
                   scaled: bool) -> bool | None:
    """``optimizer.step()`` on the gradients in place, with normalization x clipping ``coef`` and the skip flag.

    coef: 0-d fp32, skipped: 0-d bool, on the device. scaled: the gradients were already multiplied by ``coef``.
    A fused optimizer (``fused_optimizer``) takes ``1 / coef`` as ``grad_scale`` (unless ``scaled``) and the skip as
    ``found_inf``: no pass, no host sync, and None is returned (decided on the device). Any other optimizer reads
    the skip flag on the host and steps only when it is False; returns whether it stepped.
    """
    if not fused_optimizer(optimizer):
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


def expose_grads(params: list[torch.Tensor], main_grad: FlatBuffer, unwritten: list[int]) -> None:
    """No optimizer: ``p.grad`` = the final gradient (the view of main_grad for fp32 params, a rounded copy for
    bf16/fp16), None for the params in ``unwritten`` (no gradient in the window)."""
    unused = set(unwritten)
    with torch.no_grad():
        for i, p in enumerate(params):
            if i in unused:
                p.grad = None
            else:
                view = main_grad.views[i]
                p.grad = view if p.dtype == torch.float32 else view.to(p.dtype)
