"""gaengine's fused elementwise optimizers: ``FusedAdamW`` and ``FusedLion``, each torch's update (or the paper's) in
one pass per parameter, with the clip coefficient, the skip flag and the fp32 master -> bf16/fp16 model write folded
in, and no host sync. Both are ``FusedElementwiseOptimizer``s: an optimizer is its class (with its row of
``gaengine.optimizers.OPTIMIZERS`` and its ``STEP``, ``gaengine.contract.FusedStep``: its kernel name and its
plain-torch step), its functor (``csrc/optim/<name>.h``, run by the C++ and CUDA multi-tensor launchers through the
op ``optimizer_step_``), its Triton kernel (``gaengine.kernels.<name>``) and its test. The kernel of each device is
the one the backend ``gaengine.backends.get_backend`` picks there gives for ``STEP`` (``optimizer_kernel``): no
table of backends here, none of optimizers in the backends.

``FusedAdamW``: torch's AdamW in one pass per parameter, with the clip coefficient, the skip flag and the
fp32 master -> bf16/fp16 model write folded in, and no host sync.

AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, Algorithm 2), with
``torch.optim.AdamW``'s defaults, state layout and fp32 arithmetic: per parameter ``step`` (0-d fp32 tensor on
the parameter's device, as torch's fused path keeps it), ``exp_avg`` and ``exp_avg_sq`` (the parameter's shape
and dtype: fp32 for fp32 parameters, bf16/fp16 for bf16/fp16 ones, the dtype ``torch.optim.AdamW`` keeps). A
``FusedAdamW`` state dict loads into ``torch.optim.AdamW`` and back.

One update of a parameter is one kernel pass. fp32 parameters (the master weights): read grad, m, v and the
param, write m, v, the param and, when a model parameter is attached (``attach_model_params``), its bf16/fp16
rounding. Bytes per element with an fp32 grad: 16 read + 12 written (+ 2 for an attached bf16 model parameter),
against 28 + 6 for torch's fused AdamW followed by a separate master -> model copy. bf16/fp16 parameters (no
masters, ``GradientAccumulator(master_weights=False)``): updated in place from an fp32 gradient, computed in
fp32 and each of p, m, v rounded to nearest even: 10 B read + 6 B written = 16 B per element, against 28 B for
an fp32 scale pass, a rounding copy of the gradient and torch's fused AdamW on the bf16 parameters.

The gradient of a parameter ``p`` is ``p.main_grad`` when that attribute is set and not None (Megatron-Core's
name: an fp32 gradient of a bf16/fp16 parameter, which ``p.grad`` cannot hold; ``GradientAccumulator`` sets it
to its view of the fp32 main_grad buffer for the duration of ``step()``), else ``p.grad``.

Kernels: ``adamw_kernel(backend, device)`` (``backend=``, ``"auto"`` by default: the backend
``gaengine.backends.get_backend`` picks for the parameters' device, asked for its AdamW step,
``Backend.optimizer_step(FusedAdamW.STEP)``; the AdamW step is not an op of the table).
``torch.ops.gaengine.adamw_step_`` of ``gaengine._C`` on CPU tensors (C++, AVX2 or portable, ``at::parallel_for``) and
on CUDA tensors when the extension carries its CUDA kernels (one launch per 384 parameters and dtype; ``csrc/cuda/``),
else ``gaengine.kernels.adamw`` (Triton, one launch per parameter) on CUDA tensors (and CPU tensors under
``TRITON_INTERPRET=1``), and a plain-torch fallback (``adamw_step_reference``). On the CPU and Triton paths the result
is bitwise equal to ``torch.optim.AdamW(fused=True)`` on CPU (outside torch's scalar tail: the last ``numel % 8``
elements, where torch skips an FMA), and within 1e-6 relative of the default ``torch.optim.AdamW`` (which rounds
``sqrt(v) / sqrt(bc2)`` differently).

Integration protocol (the one torch's fused optimizers share with ``torch.amp.GradScaler``):
``_step_supports_amp_scaling = True`` and ``defaults["fused"] = True``; before ``step()`` a caller may set
``opt.grad_scale`` (0-d tensor: the gradient used is ``grad / grad_scale``) and ``opt.found_inf`` (0-d tensor:
when != 0 nothing is written, step counts included). Both are read by the kernels through their pointers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import increment_version

from gaengine.backends import BACKEND_NAMES, get_backend
from gaengine.buffer import FlatLayout
from gaengine.contract import AdamWStep, FusedStep
from gaengine.optimizers import OptimizerSpec, register_optimizer

__all__ = ["FusedAdamW", "FusedElementwiseOptimizer", "FusedLion", "OptimizerKernel", "adamw_kernel",
           "adamw_step_reference", "flat_moments", "lion_step_reference", "optimizer_kernel"]

_MODEL_DTYPES = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = _GRAD_DTYPES  # fp32 (master weights) or bf16/fp16 updated in place, m and v in the same dtype
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Keys of torch.optim.AdamW's param groups that are implementation flags, not hyper-parameters: a loaded
# state dict's values are replaced by FusedAdamW's, which are the ones a torch AdamW then loads back.
_IMPL_FLAGS = {"foreach": None, "capturable": False, "differentiable": False, "fused": True,
               "decoupled_weight_decay": True}

KernelFn = Callable[..., None]


def _check_hyperparameters(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the argument for a hyper-parameter FusedAdamW cannot use."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr must be a Python float: a tensor lr is not supported by FusedAdamW (it is passed "
                         "to the kernels by value); use lr.item() once when building the param group")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0.0 or not math.isfinite(lr):
        raise ValueError(f"lr must be a finite float >= 0, got {lr!r}")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            raise ValueError(f"betas[{i}] must be a Python float: tensor betas are not supported by FusedAdamW")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta!r}")
    eps = group["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    wd = group["weight_decay"]
    if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not wd >= 0.0 or not math.isfinite(wd):
        raise ValueError(f"weight_decay must be a finite float >= 0, got {wd!r}")
    if group.get("amsgrad", False):
        raise ValueError("amsgrad=True is not supported by FusedAdamW (use torch.optim.AdamW(amsgrad=True))")
    if not isinstance(group.get("maximize", False), bool):
        raise ValueError(f"maximize must be a bool, got {group['maximize']!r}")


def adamw_step_reference(*args, **kwargs) -> None:
    """One AdamW update of every ``params[i]``: the plain-torch reference and fallback of the AdamW kernels
    (``FusedAdamW.STEP``'s: the ``torch`` backend's). Its arguments (``*AdamWStep(...)``, positional or by name) and
    contract are ``AdamWStep``'s (``gaengine.contract``; the C++ kernels ``csrc/adamw.h``).

    Here: several passes and temporaries per parameter, and the skip applied by ``torch.where`` (no host sync).
    Numerics: torch's eager ops (``lerp``, ``addcmul``) in fp32, within a few fp32 ulps of the fused kernels
    (bf16/fp16 parameters: on fp32 copies of p, m, v, each rounded back by ``copy_``).
    """
    a = AdamWStep(*args, **kwargs)
    if not a.params:
        return
    lr, beta1, beta2 = a.lr, a.beta1, a.beta2
    skip = None if a.found_inf is None else a.found_inf != 0
    torch._foreach_add_(a.steps, 1 if skip is None else (~skip).to(torch.float32))
    for p, g, m, v, step, model in zip(a.params, a.grads, a.exp_avgs, a.exp_avg_sqs, a.steps, a.model_params):
        t = step.to(torch.float64)
        neg_step_size = (-lr / (1.0 - torch.pow(beta1, t))).to(torch.float32)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t)).to(torch.float32)
        grad = g.reshape(p.shape).to(torch.float32)
        if a.grad_scale is not None:
            grad = grad / a.grad_scale
        if a.maximize:
            grad = -grad
        p32, m32, v32 = p.float(), m.float(), v.float()  # fp32 copies of bf16/fp16 ones (exact); fp32: no copy
        new_p = p32 * (1.0 - lr * a.weight_decay) if a.weight_decay != 0 else p32.clone()
        new_m = torch.lerp(m32, grad, 1.0 - beta1)
        new_v = torch.addcmul(v32 * beta2, grad, grad, value=1.0 - beta2)
        new_p += neg_step_size * new_m / (new_v.sqrt() / bc2_sqrt + a.eps)
        if skip is not None:
            new_p, new_m, new_v = (torch.where(skip, old, new) for old, new in ((p, new_p), (m, new_m), (v, new_v)))
        p.copy_(new_p)
        m.copy_(new_m)
        v.copy_(new_v)
        if model is not None:
            rounded = p.reshape(model.shape).to(model.dtype)
            model.copy_(rounded if skip is None else torch.where(skip, model, rounded))


class OptimizerKernel(NamedTuple):
    """The kernel a fused optimizer runs on one device: ``backend`` the kernel family (a backend name, as
    ``gaengine.backends.get_backend`` chose it), ``step`` the function, ``where`` its name (e.g.
    ``"torch.ops.gaengine.adamw_step_"``). ``FusedAdamW``'s is called as ``step(*AdamWStep(...))``, every other
    fused optimizer's as ``step(params, grads, states, steps, model_params, hyper, grad_scale, found_inf)``
    (``FusedElementwiseOptimizer``; ``gaengine.contract.FusedStep``)."""

    backend: str
    step: KernelFn
    where: str

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.step(*args, **kwargs)


def optimizer_kernel(step: FusedStep, backend: str, device: torch.device | str) -> OptimizerKernel:
    """The kernel of the fused optimizer step ``step`` (an optimizer's ``STEP``) for ``backend`` (one of
    ``gaengine.backends.BACKEND_NAMES``) on ``device``: the backend ``get_backend`` chooses, as for the accumulate
    kernels ("auto" is "cuda" on CUDA when ``gaengine._C`` carries its CUDA kernels and the driver can launch them,
    else "triton"; "cpu" on CPU), asked for its kernel (``Backend.optimizer_step``). Raises what ``get_backend``
    raises (``ValueError`` for an unknown name, ``RuntimeError`` when a backend asked for by name cannot run on
    ``device``) and ``RuntimeError`` when the backend has no kernel for ``step``."""
    chosen = get_backend(backend, device)
    return OptimizerKernel(chosen.name, *chosen.optimizer_step(step))


def adamw_kernel(backend: str, device: torch.device | str) -> OptimizerKernel:
    """The AdamW kernel for ``backend`` on ``device`` (``optimizer_kernel`` of ``FusedAdamW.STEP``)."""
    return optimizer_kernel(FusedAdamW.STEP, backend, device)


class FusedElementwiseOptimizer(torch.optim.Optimizer):
    """What gaengine's fused elementwise optimizers share (``FusedAdamW``, ``FusedLion``): one fused pass per
    parameter on one multi-tensor kernel per device (the C++/CUDA launchers over the optimizer's functor,
    ``csrc/optim/``; its Triton kernel; a plain-torch reference), the clip coefficient (``grad_scale``), the skip
    flag (``found_inf``) and the fp32 master -> bf16/fp16 model write (``attach_model_params``) folded in, no
    host sync.

    A subclass is the optimizer: ``STATE_KEYS`` (its per-element state tensors, in its functor's order), ``KEEPS_STEP``
    (a 0-d fp32 ``step`` per parameter), ``STEP`` (``gaengine.contract.FusedStep``: its kernel name and plain-torch
    step, from which each backend gives its kernel), ``_check_hyperparameters(group)`` (``ValueError`` naming the
    argument) and ``_hyper(group)`` (its functor's hyper list). Its kernels take ``(params, grads, states, steps,
    model_params, hyper, grad_scale, found_inf)``: per device, ``states[k][i]`` state ``STATE_KEYS[k]`` of
    ``params[i]``. Its row of ``gaengine.optimizers.OPTIMIZERS`` goes beside it (``register_optimizer``).

    Parameters: fp32 (masters) or bf16/fp16 updated in place (state in their dtype), contiguous. Gradient of ``p``:
    ``p.main_grad`` when set and not None (fp32 | bf16 | fp16, ``p``'s numel), else ``p.grad``. States created in
    one ``step()`` (or loaded) are views of one flat buffer per group, device and dtype (``flat_moments``).
    ``step()`` reads ``self.grad_scale`` / ``self.found_inf`` (torch.amp.GradScaler's protocol,
    ``_step_supports_amp_scaling``).
    """

    _step_supports_amp_scaling = True  # step() reads grad_scale / found_inf (torch.amp.GradScaler's protocol)
    STATE_KEYS: tuple[str, ...] = ()
    KEEPS_STEP: bool = True
    STEP: FusedStep

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any],
                 backend: str) -> None:
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
        self._check_hyperparameters(defaults)
        self.backend = backend
        self._kernels: dict[torch.device, OptimizerKernel] = {}
        self._model_params: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(master) -> (master, model)
        super().__init__(params, defaults)

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the argument for a hyper-parameter of ``group`` the kernels cannot use."""
        raise NotImplementedError(f"{type(self).__name__} must define _check_hyperparameters (each fused optimizer "
                                  "checks its own hyper-parameters, e.g. FusedAdamW's)")

    def _hyper(self, group: dict[str, Any]) -> list[float]:
        """``group``'s hyper-parameters as its functor's hyper list (Python floats)."""
        raise NotImplementedError(f"{type(self).__name__} must define _hyper (the hyper list, in the order of its "
                                  "functor's csrc/optim/<name>.h)")

    # ------------------------------------------------------------------ param groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the hyper-parameters and parameters validated."""
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_hyperparameters(merged)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if isinstance(p, torch.Tensor) and (not p.is_floating_point() or p.is_complex()):
                raise ValueError(f"params must be floating point tensors, got one of dtype {p.dtype}")
        super().add_param_group({**param_group, "params": params})

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for p, p_state in self.state.items():
            if "step" in p_state and not torch.is_tensor(p_state["step"]):
                p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32, device=p.device)
        self.__dict__.setdefault("_kernels", {})
        self.__dict__.setdefault("_model_params", {})
        self.__dict__.setdefault("backend", "auto")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer (or of the torch optimizer with the same state keys).

        The state is converted to the kernels' layout: ``step`` (``KEEPS_STEP``) a 0-d fp32 tensor on the
        parameter's device, each of ``STATE_KEYS`` a copy on that device: fp32 for an fp32 parameter; for a
        bf16/fp16 parameter, in the saved dtype when that is the parameter's or fp32, else fp32 (saved fp32 state
        of a bf16/fp16 parameter stays fp32: a master-weights checkpoint loaded before ``GradientAccumulator``
        swaps in the fp32 masters; a ``step()`` on the bf16/fp16 parameter itself refuses it). Raises
        ``ValueError`` for an invalid hyper-parameter, before anything is loaded.
        """
        for group in state_dict["param_groups"]:
            self._check_hyperparameters({**self.defaults, **group})
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if not saved:
                continue
            state = self.state[p]
            # Copies: the kernels update the state in place, which must not write into the caller's dict.
            if self.KEEPS_STEP:
                step = saved["step"]
                step = step.detach() if torch.is_tensor(step) else torch.tensor(float(step))
                state["step"] = step.to(device=p.device, dtype=torch.float32, copy=True).reshape(())
            for key in self.STATE_KEYS:
                dtype = saved[key].dtype if saved[key].dtype in (p.dtype, torch.float32) else torch.float32
                state[key] = saved[key].detach().to(device=p.device, dtype=dtype, copy=True).contiguous()
        # The loaded states as step() creates them: per group, views of one flat buffer (copied in; states
        # that do not fit their parameter keep their own copy, for step() to refuse naming them).
        for group in self.param_groups:
            fit = [p for p in group["params"] if self.state.get(p) and all(
                torch.is_tensor(self.state[p].get(k)) and self.state[p][k].numel() == p.numel()
                and self.state[p][k].device == p.device and self.state[p][k].dtype == _moment_dtype(p)
                for k in self.STATE_KEYS)]
            for p, views in zip(fit, flat_moments(fit, len(self.STATE_KEYS))):
                for key, view in zip(self.STATE_KEYS, views):
                    view.view(-1).copy_(self.state[p][key].reshape(-1))
                    self.state[p][key] = view

    def attach_model_params(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After this, each update of ``master`` also writes its bf16/fp16 rounding into ``model_param``.

        pairs: ``(master, model_param)`` tuples. ``master``: an fp32 contiguous parameter of this optimizer.
            ``model_param``: bf16 | fp16, contiguous, same shape and device; overwritten by the update (in the
            same pass) with exactly ``master.to(model_param.dtype)``. A skipped update (``found_inf``) or a
            parameter without a gradient leaves it untouched. Attaching a master again replaces its model param.

        Raises ``ValueError`` naming what is wrong, before anything is attached.
        """
        pairs = list(pairs)
        own = {id(p) for g in self.param_groups for p in g["params"]}
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"pairs[{i}] must be a (master, model_param) tuple")
            master, model = pair
            if not isinstance(master, torch.Tensor) or id(master) not in own:
                raise ValueError(f"pairs[{i}]: master is not a parameter of this optimizer")
            if master.dtype != torch.float32 or not master.is_contiguous():
                raise ValueError(f"pairs[{i}]: master must be a contiguous float32 tensor, got {master.dtype}")
            if not isinstance(model, torch.Tensor) or model.dtype not in _MODEL_DTYPES:
                got = model.dtype if isinstance(model, torch.Tensor) else type(model).__name__
                raise ValueError(f"pairs[{i}]: model_param must be a bfloat16 or float16 tensor, got {got}")
            if model.shape != master.shape or model.device != master.device or not model.is_contiguous():
                raise ValueError(f"pairs[{i}]: model_param must be contiguous with master's shape "
                                 f"{tuple(master.shape)} and device {master.device}, got {tuple(model.shape)} "
                                 f"on {model.device}")
        for master, model in pairs:
            self._model_params[id(master)] = (master, model)

    # ------------------------------------------------------------------ update
    def _kernel(self, device: torch.device) -> OptimizerKernel:
        kernel = self._kernels.get(device)
        if kernel is not None:
            return kernel
        # Raises when a backend asked for by name cannot run. "auto" is "cuda" on CUDA when gaengine._C carries
        # its CUDA kernels and the driver can launch them (backends.cuda_kernels_unusable, the one decision): one
        # launch for the whole list (Triton launches once per parameter).
        kernel = self._kernels[device] = optimizer_kernel(self.STEP, self.backend, device)
        return kernel

    def _launch(self, kernel: OptimizerKernel, params: list, grads: list, states: list[list], steps: list,
                models: list, group: dict[str, Any], grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> None:
        """One kernel call for one device's lists (``states[k]``: state ``STATE_KEYS[k]`` of each parameter)."""
        kernel(params, grads, states, steps, models, self._hyper(group), grad_scale, found_inf)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()``'s loss, if given.

        Reads ``self.grad_scale`` / ``self.found_inf`` when set (0-d floating tensors, moved to each parameter
        device without a sync): the gradient used is ``grad / grad_scale`` (``grad``: ``p.main_grad`` when set,
        else ``p.grad``), and ``found_inf != 0`` skips the update entirely (parameters, moments, step counts and
        attached model parameters stay bit-identical).
        No host sync: nothing here reads a tensor on the host.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        # Per group, the parameters with a gradient and their states, looked up by id: a dict keyed by the tensors
        # calls Tensor.__hash__ (Python) once per lookup, and an update issues no Python call per parameter
        # (tests/test_step_host_cost.py).
        # Everything checked (every group) before any state is created or written.
        self._check_scalars(grad_scale, found_inf)
        states = {id(p): state for p, state in self.state.items()}
        entries = [_entries(group, states) for group in self.param_groups]
        if not all([self._fits(group, e) for group, e in zip(self.param_groups, entries)]):
            self._check_step(grad_scale, found_inf)  # names what does not fit (or finds that it fits after all)
        for group, (params, grads, group_states) in zip(self.param_groups, entries):
            self._step_group(group, params, grads, group_states, grad_scale, found_inf)
        return loss

    def _fits(self, group: dict[str, Any], entries: tuple[list, list, list]) -> bool:
        """Whether ``group``'s parameters, gradients and states fit the kernels, checked list by list (one Python
        call per group, none per parameter); ``False`` sends ``step()`` to ``_check_step``, which names what does
        not fit."""
        self._check_hyperparameters(group)
        params, grads, states = entries
        if not all([isinstance(g, torch.Tensor) and not g.is_sparse and p.dtype in _PARAM_DTYPES
                    and p.is_contiguous() and g.dtype in _GRAD_DTYPES and g.numel() == p.numel()
                    and g.device == p.device for p, g in zip(params, grads)]):
            return False
        held = [(p, s) for p, s in zip(params, states) if s]
        for key in self.STATE_KEYS:
            if not all([isinstance(t := s.get(key), torch.Tensor) and t.dtype == p.dtype and t.is_contiguous()
                        and t.numel() == p.numel() and t.device == p.device for p, s in held]):
                return False
        if self.KEEPS_STEP and not all([isinstance(t := s.get("step"), torch.Tensor) and t.dim() == 0
                                        and t.dtype == torch.float32 and t.device == p.device for p, s in held]):
            return False
        attached = [(p, a[1]) for p, a in zip(params, map(self._model_params.get, map(id, params))) if a is not None]
        return all([p.dtype == torch.float32 and isinstance(m, torch.Tensor) and m.dtype in _MODEL_DTYPES
                    and m.is_contiguous() and m.numel() == p.numel() and m.device == p.device for p, m in attached])

    def _check_scalars(self, grad_scale: Any, found_inf: Any) -> None:
        """``grad_scale`` and ``found_inf``: each ``None`` or a one-element real tensor (``TypeError`` /
        ``ValueError`` naming it otherwise)."""
        for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a 0-d tensor or None, got {type(t).__name__}")
            if t.numel() != 1 or t.is_complex() or t.is_sparse:
                raise ValueError(f"{name} must be a 0-d (one-element) real tensor, got shape {tuple(t.shape)} "
                                 f"{t.dtype}")

    def _check_step(self, grad_scale: Any, found_inf: Any) -> None:
        """Everything ``step()`` passes to a kernel, checked in Python before anything is created or written.

        It covers every contract of the C++ launchers (``TORCH_CHECK``s of ``optimizer_step_`` / ``adamw_step_``: a
        failed one must never be the first line of defence, see ``csrc/README.md``) and the Triton kernels': raises
        ``ValueError`` (or ``TypeError`` for a non-tensor) naming the parameter and the argument.
        """
        self._check_scalars(grad_scale, found_inf)
        name = type(self).__name__
        for g, group in enumerate(self.param_groups):
            self._check_hyperparameters(group)
            for i, p in enumerate(group["params"]):
                grad = _grad_of(p)
                if grad is None:
                    continue
                where = f"param_groups[{g}]['params'][{i}]"
                if not isinstance(grad, torch.Tensor):
                    raise TypeError(f"the main_grad of {where} must be a tensor or None, got {type(grad).__name__}")
                if grad.is_sparse:
                    raise ValueError(f"{name} does not support sparse gradients ({where})")
                if p.dtype not in _PARAM_DTYPES:
                    raise ValueError(
                        f"{name} updates float32 (master weights), bfloat16 or float16 parameters, got one of "
                        f"dtype {p.dtype} with a gradient ({where}); use {self._plain_alternative}"
                    )
                if not p.is_contiguous():
                    raise ValueError(f"{where} must be contiguous (the kernels update it in place as a flat "
                                     "buffer); make the parameter contiguous before building the optimizer")
                if grad.dtype not in _GRAD_DTYPES:
                    raise ValueError(f"gradients must be float32, bfloat16 or float16, got {grad.dtype} ({where})")
                if grad.numel() != p.numel() or grad.device != p.device:
                    raise ValueError(f"the gradient of {where} has {grad.numel()} elements on {grad.device}; the "
                                     f"parameter has {p.numel()} on {p.device}")
                _check_state(self.state.get(p), p, where, self.STATE_KEYS, self.KEEPS_STEP)
                attached = self._model_params.get(id(p))
                if attached is not None and p.dtype != torch.float32:
                    raise ValueError(f"{where} has an attached model param but is {p.dtype} now: a model param is "
                                     "written from a float32 master only")
                if attached is not None:
                    model = attached[1]
                    if (not isinstance(model, torch.Tensor) or model.dtype not in _MODEL_DTYPES
                            or not model.is_contiguous() or model.numel() != p.numel() or model.device != p.device):
                        raise ValueError(f"the model param attached to {where} is no longer a contiguous bf16/fp16 "
                                         f"tensor with the master's {p.numel()} elements on {p.device}; attach it "
                                         "again (attach_model_params)")

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    states: list[dict[str, Any] | None], grad_scale: torch.Tensor | None,
                    found_inf: torch.Tensor | None) -> None:
        """One kernel call per device over ``group``'s ``params`` with a gradient (``_entries``), checked by
        ``_fits`` / ``_check_step``; states created here for the parameters updated for the first time."""
        n_states = len(self.STATE_KEYS)
        # The group's params updated for the first time: their states are views of one flat buffer.
        new = [p for p, state in zip(params, states) if not state]
        if new:
            for p, views in zip(new, flat_moments(new, n_states)):
                if self.KEEPS_STEP:
                    self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                self.state[p].update(zip(self.STATE_KEYS, views))
            states = [state if state else self.state[p] for p, state in zip(params, states)]
        models = [a[1] if a is not None else None for a in map(self._model_params.get, map(id, params))]
        grads = [g.contiguous() for g in grads]
        steps = [s["step"] for s in states] if self.KEEPS_STEP else []
        moments = [[s[key] for s in states] for key in self.STATE_KEYS]
        devices = {p.device for p in params}
        for device in devices:
            # One device (the common case): the lists as they are, no Python call per parameter
            # (tests/test_step_host_cost.py); several: each device's part.
            on = None if len(devices) == 1 else [p.device == device for p in params]

            def pick(xs: list, on: list[bool] | None = on) -> list:
                return xs if on is None else list(itertools.compress(xs, on))

            dev_params, dev_models = pick(params), pick(models)
            self._launch(self._kernel(device), dev_params, pick(grads), [pick(m) for m in moments], pick(steps),
                         dev_models, group, _on(grad_scale, device), _on(found_inf, device))
            increment_version(dev_params + [m for m in dev_models if m is not None])  # they were written in place


def _entries(group: dict[str, Any], states: dict[int, dict[str, Any]]) -> tuple[list, list, list]:
    """``group``'s parameters that have a gradient, their gradients (``p.main_grad`` when set and not None, else
    ``p.grad``) and their states (``None`` before the first update), from ``states`` keyed by ``id(p)``."""
    params = group["params"]
    mains = [getattr(p, "main_grad", None) for p in params]
    grads = [m if m is not None else p.grad for p, m in zip(params, mains)]
    live = [(p, g, states.get(id(p))) for p, g in zip(params, grads) if g is not None]
    return [e[0] for e in live], [e[1] for e in live], [e[2] for e in live]


class FusedAdamW(FusedElementwiseOptimizer):
    """AdamW with ``torch.optim.AdamW``'s semantics and defaults, one fused pass per parameter, no host sync.

    Args:
        params: an iterable of Parameters or of param-group dicts (each may override any hyper-parameter).
            Floating point; the ones that receive a gradient must be fp32, bf16 or fp16 and contiguous at
            ``step()``. fp32: master weights (``GradientAccumulator`` swaps bf16/fp16 model parameters for fp32
            masters by default). bf16/fp16: updated in place, no master (``master_weights=False``): the update is
            computed in fp32 from the widened p, m, v and the gradient (best an fp32 one, ``p.main_grad``), then
            p, m and v are each rounded to nearest even, as ``torch.optim.AdamW`` in fp32 on fp32 copies
            followed by ``.to(p.dtype)`` of each.
        lr: learning rate, a Python float >= 0 (a tensor lr raises ``ValueError``).
        betas: ``(beta1, beta2)``, each in [0, 1): decay rates of the first and second moment estimates.
        eps: added to ``sqrt(v_hat)`` after the bias correction (torch's placement), >= 0.
        weight_decay: decoupled weight decay ``lambda``: ``p *= 1 - lr * lambda`` before the Adam step.
        amsgrad: must be False (``ValueError`` otherwise; kept so torch's signature and state dicts fit).
        maximize: ascend the objective instead.
        backend: the AdamW kernel's family, one of ``gaengine.backends.BACKEND_NAMES`` ("auto" | "torch" | "cpu"
            | "cuda" | "triton", or a backend registered with ``gaengine.backends.register_backend``), chosen for each
            parameter device as ``gaengine.backends.get_backend`` chooses a backend, whose AdamW step it runs
            (``Backend.optimizer_step``, ``adamw_kernel``). "auto": the
            C++ kernel for CPU tensors; for CUDA ones the CUDA kernel when ``gaengine._C`` carries it and the
            driver can launch it, else Triton; the plain-torch reference when neither loads. An unknown name
            raises ``ValueError`` here; a family asked for by name that cannot run on the parameters' device
            raises ``RuntimeError`` at the first ``step()``.

    Per-parameter state: ``step`` (0-d fp32 on the parameter's device), ``exp_avg``, ``exp_avg_sq`` (the
    parameter's shape and dtype: fp32, or bf16/fp16 for a parameter updated in place), created at the
    parameter's first update.

    Gradient of ``p``: ``p.main_grad`` when set and not None (fp32 | bf16 | fp16, ``p``'s numel), else ``p.grad``.

    The moments of the parameters of a group whose state is created in the same ``step()`` (or loaded by
    ``load_state_dict``) are contiguous views of one flat buffer per group, device and moment dtype
    (``flat_moments``): ``[exp_avg | exp_avg_sq]``, each
    half laid out by ``gaengine.buffer.FlatLayout`` (aligned starts, zero padding). ``state[p]`` keeps
    torch's keys, so state dicts load into ``torch.optim.AdamW`` and back; a saved state dict holds the
    views (``torch.save`` writes each flat buffer once).

    The update of parameter ``p`` with gradient ``g`` at step ``t`` (fp32; coefficients rounded from double):
    ``g = grad / grad_scale``; ``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - beta1)``;
    ``v = beta2 * v + (1 - beta2) * g * g``; ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.

    Raises ``ValueError`` naming the argument for a bad hyper-parameter (here and in ``add_param_group`` and
    ``load_state_dict``); ``step()`` raises ``ValueError`` naming the parameter for anything its kernel cannot
    take (a parameter with a gradient that is not fp32/bf16/fp16 or not contiguous, a sparse or mis-sized
    gradient, state of another dtype than the parameter's (e.g. fp32 moments of an fp16 parameter) or of the
    wrong size / device, an attached model parameter that changed since, a multi-element ``grad_scale`` or
    ``found_inf``, a bad hyper-parameter set on a group later), for every group, before anything is created
    or written.
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq")
    KEEPS_STEP = True
    STEP = FusedStep("adamw", adamw_step_reference, op="adamw_step_")
    _plain_alternative = "torch.optim.AdamW"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        backend: str = "auto",
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, **_IMPL_FLAGS)
        super().__init__(params, defaults, backend)

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        _check_hyperparameters(group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.update(_IMPL_FLAGS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``FusedAdamW`` or ``torch.optim.AdamW`` state dict (``FusedElementwiseOptimizer.load_state_dict``:
        ``step`` a 0-d fp32 tensor, ``exp_avg`` / ``exp_avg_sq`` copies on the parameter's device). Raises
        ``ValueError`` for a group with ``amsgrad=True`` or an invalid hyper-parameter, before anything is loaded.
        """
        super().load_state_dict(state_dict)
        for p_state in self.state.values():
            p_state.pop("max_exp_avg_sq", None)

    def _launch(self, kernel: OptimizerKernel, params: list, grads: list, states: list[list], steps: list,
                models: list, group: dict[str, Any], grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs = states
        kernel(*AdamWStep(
            params, grads, exp_avgs, exp_avg_sqs, steps, models,
            float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            bool(group["maximize"]), grad_scale, found_inf,
        ))


# gaengine.optimizers' row: elementwise, Adam's moments (amsgrad is refused), its step on the parameter's device,
# writes the model, always fused.
register_optimizer(FusedAdamW, OptimizerSpec(name="gaengine.optim.FusedAdamW", elementwise=True,
                                             moments=("exp_avg", "exp_avg_sq"), step_device="always",
                                             writes_model=True))


# ------------------------------------------------------------------------------------------------ Lion
def lion_step_reference(params, grads, states, steps, model_params, hyper, grad_scale=None, found_inf=None) -> None:
    """One Lion update of every ``params[i]``: the plain-torch reference and fallback of the Lion kernels
    (``FusedLion.STEP``'s: the ``torch`` backend's), with the arguments of every fused optimizer's kernel
    (``FusedElementwiseOptimizer``; ``states == [exp_avgs]``, ``steps == []``, ``hyper == [lr, beta1, beta2,
    weight_decay]``). Several passes per parameter in fp32 (bf16/fp16 ones on fp32 copies, each rounded back by
    ``copy_``); the skip by ``torch.where``."""
    (exp_avgs,) = states
    lr, beta1, beta2, weight_decay = (float(h) for h in hyper)
    skip = None if found_inf is None else found_inf != 0
    for p, g, m, model in zip(params, grads, exp_avgs, model_params):
        grad = g.reshape(p.shape).to(torch.float32)
        if grad_scale is not None:
            grad = grad / grad_scale
        p32, m32 = p.float(), m.float()
        direction = torch.sign(m32 * beta1 + grad * (1.0 - beta1))
        new_p = p32 * (1.0 - lr * weight_decay) if weight_decay != 0 else p32.clone()
        new_p -= lr * direction
        new_m = m32 * beta2 + grad * (1.0 - beta2)
        if skip is not None:
            new_p, new_m = (torch.where(skip, old, new) for old, new in ((p, new_p), (m, new_m)))
        p.copy_(new_p)
        m.copy_(new_m)
        if model is not None:
            rounded = p.reshape(model.shape).to(model.dtype)
            model.copy_(rounded if skip is None else torch.where(skip, model, rounded))


class FusedLion(FusedElementwiseOptimizer):
    """Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023, Algorithm 2: decoupled weight
    decay), one fused pass per parameter, no host sync (``FusedElementwiseOptimizer``: masters and the bf16/fp16
    model write, ``grad_scale`` / ``found_inf``, ``p.main_grad``).

    The update of parameter ``p`` with gradient ``g`` (fp32, each operation rounded once; ``csrc/optim/lion.h``):
    ``g = grad / grad_scale``; ``c = beta1 * m + (1 - beta1) * g``; ``p *= 1 - lr * weight_decay``;
    ``p -= lr * sign(c)`` (``torch.sign``: 0 for 0 and NaN); ``m = beta2 * m + (1 - beta2) * g``.

    Args:
        params: an iterable of Parameters or of param-group dicts (each may override any hyper-parameter):
            floating point; the ones with a gradient fp32, bf16 or fp16 and contiguous at ``step()``.
        lr: learning rate, a Python float >= 0 (the paper's default 1e-4; it suggests 3-10x smaller than AdamW's).
        betas: ``(beta1, beta2)``, each in [0, 1): the interpolation of the update direction and the decay of the
            momentum (the paper's (0.9, 0.99)).
        weight_decay: decoupled weight decay ``lambda`` >= 0: ``p *= 1 - lr * lambda`` (default 0).
        backend: the kernel family, as ``FusedAdamW``'s (the backend's Lion step: ``torch.ops.gaengine.optimizer_step_(
            "lion", ...)`` for cpu and cuda, ``gaengine.kernels.lion.lion_step_`` for triton, the reference for torch).

    Per-parameter state: ``exp_avg`` (the momentum ``m``, the parameter's shape and dtype), created at the
    parameter's first update; no ``step``. Raises ``ValueError`` naming the argument for a bad hyper-parameter
    (here, in ``add_param_group``, ``load_state_dict`` and ``step()``), and what ``FusedAdamW.step()`` raises for
    a parameter its kernels cannot take, before anything is written.
    """

    STATE_KEYS = ("exp_avg",)
    KEEPS_STEP = False
    STEP = FusedStep("lion", lion_step_reference)
    _plain_alternative = "an unfused Lion"

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 backend: str = "auto") -> None:
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, weight_decay=weight_decay,
                        fused=True)
        super().__init__(params, defaults, backend)

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        _check_float(group["lr"], "lr", FusedLion.__name__)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be a Python float in [0, 1), got {beta!r}")
        _check_float(group["weight_decay"], "weight_decay", FusedLion.__name__)

    def _hyper(self, group: dict[str, Any]) -> list[float]:
        beta1, beta2 = group["betas"]
        return [float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"])]


def _check_float(value: Any, name: str, owner: str) -> None:
    """``value`` is a finite Python float >= 0 (``ValueError`` naming ``name`` otherwise)."""
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a Python float: a tensor {name} is not supported by {owner} (it is passed "
                         f"to the kernels by value); use {name}.item() once when building the param group")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")


# gaengine.optimizers' row: elementwise, one state (the momentum), no step count, writes the model, always fused.
register_optimizer(FusedLion, OptimizerSpec(name="gaengine.optim.FusedLion", elementwise=True, moments=("exp_avg",),
                                            keeps_step=False, writes_model=True))


def flat_moments(params: list[torch.Tensor], n_states: int = 2) -> list[tuple[torch.Tensor, ...]]:
    """``n_states`` zeroed state tensors (AdamW's two: ``(exp_avg, exp_avg_sq)``) for each of ``params``: contiguous,
    shaped like the parameter, in ``_moment_dtype(p)`` (fp32, or the dtype of a bf16/fp16 parameter updated in
    place), views of one flat buffer per device and dtype holding ``[state 0 | state 1 | ...]``, each part laid out
    by ``FlatLayout.build`` over those params (aligned starts, zero padding that stays zero)."""
    out: dict[int, tuple[torch.Tensor, ...]] = {}
    by_device: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for i, p in enumerate(params):
        by_device.setdefault((p.device, _moment_dtype(p)), []).append((i, p))
    for (device, dtype), entries in by_device.items():
        layout = FlatLayout.build([p for _, p in entries])
        n = layout.total_numel
        flat = torch.zeros(n_states * n, dtype=dtype, device=device)
        for (i, p), offset, numel in zip(entries, layout.offsets, layout.numels):
            out[i] = tuple(flat.narrow(0, k * n + offset, numel).view(p.shape) for k in range(n_states))
    return [out[i] for i in range(len(params))]


def _moment_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s moments: its own for a bf16/fp16 parameter (updated in place), else fp32."""
    return p.dtype if p.dtype in _MODEL_DTYPES else torch.float32


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient ``step()`` uses for ``p``: ``p.main_grad`` when set and not None, else ``p.grad``."""
    main_grad = getattr(p, "main_grad", None)
    return main_grad if main_grad is not None else p.grad


def _check_state(state: dict[str, Any] | None, p: torch.Tensor, where: str,
                 keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), keeps_step: bool = True) -> None:
    """A parameter's existing state (``keys``, and ``step`` when ``keeps_step``), as the kernels take it (a missing
    state is created by ``step``)."""
    if not state:
        return
    for key in (("step",) if keeps_step else ()) + keys:
        if not isinstance(state.get(key), torch.Tensor):
            raise ValueError(f"state[{key!r}] of {where} must be a tensor, got {type(state.get(key)).__name__}; "
                             "load AdamW state with load_state_dict, which converts it")
    step = state.get("step")
    # 0-d fp32 on the parameter's device: the C++ / CUDA kernels read it through its pointer.
    if keeps_step and (step.dim() != 0 or step.dtype != torch.float32 or step.device != p.device):
        raise ValueError(f"state['step'] of {where} must be a 0-d float32 tensor on {p.device}, got shape "
                         f"{tuple(step.shape)} {step.dtype} on {step.device}; load AdamW state with load_state_dict")
    name = _DTYPE_NAMES[p.dtype]
    for key in keys:
        t = state[key]
        if t.dtype != p.dtype or not t.is_contiguous() or t.numel() != p.numel() or t.device != p.device:
            hint = (f"the moments of a {name} parameter are kept in its dtype (convert them with .to({p.dtype}), or "
                    "keep float32 master weights)" if t.dtype != p.dtype and p.dtype != torch.float32
                    else "load AdamW state with load_state_dict")
            raise ValueError(f"state[{key!r}] of {where} must be a contiguous {name} tensor (the parameter's dtype) "
                             f"with the parameter's {p.numel()} elements on {p.device}, got {t.numel()} {t.dtype} on "
                             f"{t.device} (contiguous={t.is_contiguous()}); {hint}")


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` as a 0-d fp32 tensor on ``device`` (a non-blocking copy when it lives elsewhere; no sync)."""
    if t is None:
        return None
    if t.device != device or t.dtype != torch.float32:
        t = t.to(device=device, dtype=torch.float32, non_blocking=True)
    return t.reshape(())
