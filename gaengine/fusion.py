"""Gradient accumulation fusion: each ``torch.nn.Linear``'s weight gradient computed straight into fp32 ``main_grad``.

``GradientAccumulator(..., gradient_accumulation_fusion=True)`` routes the forward of every ``torch.nn.Linear`` of
the model, and of every ``transformers.pytorch_utils.Conv1D`` when transformers is imported (the same module
objects: an instance ``forward`` is set, and ``acc.close()`` removes it) through the op
``torch.ops.gaengine.fused_linear`` (``csrc/wgrad.h``; Conv1D with ``transposed=True``: its weight is (in, out)).
Its forward is ``torch.nn.functional.linear`` (Conv1D: its ``addmm``); its backward
is C++ (a ``torch::autograd::Function``, ``csrc/wgrad.cpp``): ``dX = dY @ W`` as usual, and for a weight (and bias)
that the accumulator holds, one call of ``torch.ops.gaengine.wgrad_accumulate_`` writes (first contribution of the
window: micro-batch 0's "write, don't zero") or adds ``fp32(dY)^T @ fp32(X)`` (and the row sum of ``fp32(dY)``)
into the parameter's ``main_grad`` slice. No low-precision weight gradient is materialized and no Python runs per
layer in backward. Autograd still runs the parameter's AccumulateGrad node (with no gradient, or with the gradient of
the parameter's other, unfused uses: a tied embedding, which is then added), and the native hooks count the
parameter as arrived there: bucket completion and the last micro-batch's all-reduce are unchanged. The loss-scale
factor is in ``dY`` already (``acc.backward`` scales the loss), as it is in the unfused gradient.

Megatron-Core's ``gradient_accumulation_fusion`` (apex ``wgrad_gemm_accum_fp32``) and TransformerEngine's
``fuse_wgrad_accumulation`` do the same for their own layer classes (``/work/shared/research/wgrad_fusion.md``).

Kernels of ``wgrad_accumulate_``: on CPU tensors the C++ one (``csrc/wgrad.cpp``); on CUDA tensors the CUDA one of
``gaengine._C`` (``csrc/cuda/cuda_ops.cu``: one ``cublasGemmEx`` with fp32 C, as apex's ``wgrad_gemm_accum_fp32``),
built where the CUDA toolkit has cuBLAS's headers. A CUDA build without them has no CUDA kernel for the op, and
``register_triton_wgrad`` then registers the Triton one (``gaengine/kernels/wgrad.py``: an fp32-accumulator GEMM whose
epilogue loads and adds C) under the op's CUDA key, so ``HotPath``'s dispatch in ``fused_linear``'s backward reaches
it: one Python launch per fused Linear in backward, with the host time of a Python call.

What it needs (``check_fusion``, ``ValueError`` naming ``gradient_accumulation_fusion``): ``model`` as an
``nn.Module``; CPU parameters, or CUDA ones (the cuBLAS kernel built, or triton installed); the native hooks (``backend`` "cpu", "cuda" or
"auto" with ``gaengine._C`` built (for CUDA, with its CUDA kernels)); no FSDP2
model; ``AccumulatorConfig`` refuses it with ``zero_stage`` > 0. With ``measure_noise_scale`` the fused gradient of a
micro-batch goes into an fp32 tensor that the hook holds and its bucket adds and measures (docs/fusion.md). Under
``torch.autocast`` the op's Autocast kernel casts input, weight and bias to the autocast dtype inside the autograd
Function (as autocast casts ``F.linear``'s operands): the GEMM operands are the casts, the fp32 ``main_grad`` is
written from their products accumulated in fp32.

Hooks (``LinearFusion.follow_hooks``): a routed layer's weight or bias holding a hook of the user's, a tensor hook
(``param.register_hook``: ``param._backward_hooks``) or a post-accumulate-grad hook
(``param.register_post_accumulate_grad_hook``: ``param._post_accumulate_grad_hooks``), is not fused: its
``fused_linear`` backward returns its ordinary gradient to autograd, which runs the hooks, then the accumulator's
AccumulateGrad hook takes it (the unfused path, exactly). Checked at construction and at every window's first
``backward()``: a Python pass over the routed layers' parameters, once per window. A hook registered in the middle of
a window, on a parameter fused at its start, makes ``step()`` refuse (``RuntimeError`` naming the parameter and the
hook, nothing applied). gaengine's own gradient hooks are C++ hooks on the AccumulateGrad nodes (in neither
dictionary); a Python hook that observes gradients and knows the fusion (``gaengine verify``'s) is marked with
``observes_fusion`` and does not count.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch import nn

from gaengine import compat
from gaengine.hooks import native_hooks_problem

__all__ = ["LinearFusion", "check_fusion", "observes_fusion", "register_triton_wgrad", "user_hooks"]

OPTION = "gradient_accumulation_fusion"

# The torch.library registrations of the Triton kernel, by (namespace, dispatch key): kept alive for the process
# (a Library object that is collected takes its registrations with it).
_TRITON_LIBRARIES: dict[tuple[str, str], torch.library.Library] = {}


def _triton_wgrad_accumulate_(dw, db, grad_output, input, overwrite_w, overwrite_b) -> None:
    from gaengine.kernels import wgrad  # noqa: PLC0415 - imports triton, once

    wgrad.wgrad_accumulate_(dw, db, grad_output, input, overwrite_w, overwrite_b)


def register_triton_wgrad(namespace: str = "gaengine", dispatch_key: str = "CUDA") -> bool:
    """Make the Triton kernel (``gaengine.kernels.wgrad.wgrad_accumulate_``) the kernel of
    ``torch.ops.<namespace>.wgrad_accumulate_`` for ``dispatch_key`` ("CUDA": what ``HotPath`` dispatches to for a
    CUDA main_grad), unless that key has a kernel already (a compiled one wins; a second call does nothing).

    Returns True when the op has a kernel for ``dispatch_key`` afterwards. Raises ``ImportError`` when triton is not
    installed (nothing is registered then).
    """
    op = f"{namespace}::wgrad_accumulate_"
    if (namespace, dispatch_key) in _TRITON_LIBRARIES or torch._C._dispatch_has_kernel_for_dispatch_key(
            op, dispatch_key):
        return True
    import triton  # noqa: F401, PLC0415 - the kernel needs it: fail here, before anything is registered

    library = torch.library.Library(namespace, "IMPL")
    library.impl("wgrad_accumulate_", _triton_wgrad_accumulate_, dispatch_key)
    _TRITON_LIBRARIES[(namespace, dispatch_key)] = library
    return True


def check_fusion(model: Any, backend, device: torch.device) -> None:
    """``ValueError`` naming ``gradient_accumulation_fusion`` when the accumulator of ``model`` (its parameters on
    ``device``, kernels from ``backend``) cannot fuse: see the module docstring."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{OPTION}=True needs model as an nn.Module (its torch.nn.Linear layers are routed through "
                         f"the fused op), got {type(model).__name__}: pass the module, or set {OPTION}=False")
    fsdp_module = compat.fsdp_module_class()
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        raise ValueError(f"{OPTION}=True is not supported with an FSDP2 (fully_shard) model: FSDP2 reduce-scatters "
                         f"the unsharded .grad, which the fused op does not produce; set {OPTION}=False")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{OPTION}=True has kernels for CPU and CUDA parameters, got parameters on {device}; "
                         f"set {OPTION}=False")
    why = native_hooks_problem(backend)
    if why is None and not backend.hot_path_kernels:
        why = f"backend {backend.name!r} has no wgrad_accumulate_ kernel in gaengine._C"
    if why is not None:
        raise ValueError(f"{OPTION}=True needs the native hooks of gaengine._C (backend 'cpu', 'cuda' or 'auto' with "
                         f"the extension built), but they cannot run: {why}; set {OPTION}=False, or use "
                         f"backend={'cpu' if device.type == 'cpu' else 'cuda'!r}")
    if device.type == "cuda":
        try:
            register_triton_wgrad(backend.extension()[0].OP_NAMESPACE, "CUDA")
        except ImportError as exc:
            raise ValueError(f"{OPTION}=True on CUDA parameters runs the Triton kernel gaengine.kernels.wgrad, but "
                             f"triton cannot be imported ({exc}): pip install triton, or set {OPTION}=False") from exc


_OBSERVER = "_gaengine_observes_fusion"


def observes_fusion(hook):
    """Mark ``hook`` (a tensor or post-accumulate-grad hook of gaengine's own that only reads gradients and knows that
    a fused parameter's arrive as None: ``gaengine verify``'s) so that ``user_hooks`` leaves it out: the parameter
    stays fused. Returns ``hook``."""
    setattr(hook, _OBSERVER, True)
    return hook


def user_hooks(param: torch.Tensor) -> list[str]:
    """The user's hooks on ``param`` (those not marked by ``observes_fusion``), described for an error message: its
    tensor hooks (``param._backward_hooks``, an OrderedDict or None) and its post-accumulate-grad hooks
    (``param._post_accumulate_grad_hooks``). Empty when it has none."""
    tensor_hooks, post_hooks = param._backward_hooks, getattr(param, "_post_accumulate_grad_hooks", None)
    if not tensor_hooks and not post_hooks:  # the usual parameter: no hook at all
        return []
    found = []
    for what, hooks in (("tensor hook (register_hook)", tensor_hooks),
                        ("post-accumulate-grad hook (register_post_accumulate_grad_hook)", post_hooks)):
        for hook in (hooks or {}).values():
            if not getattr(hook, _OBSERVER, False):
                found.append(f"{what} {getattr(hook, '__qualname__', type(hook).__name__)}")
    return found


def _conv1d_class() -> type | None:
    """``transformers.pytorch_utils.Conv1D`` when transformers has loaded it (no import here), else None."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _linear_forward(module: nn.Linear, input: torch.Tensor, *, op) -> torch.Tensor:
    """``nn.Linear.forward`` through ``op`` (``fused_linear``): input (..., in) -> (..., out). Under
    ``torch.autocast`` the op's Autocast kernel casts the operands as ``F.linear``'s would be cast."""
    return op(input, module.weight, module.bias)


def _conv1d_forward(module: nn.Module, input: torch.Tensor, *, op) -> torch.Tensor:
    """transformers' ``Conv1D.forward`` (weight (in, out), ``addmm(bias, x_2d, weight)``) through ``op`` with
    ``transposed=True``: input (..., in) -> (..., out)."""
    return op(input, module.weight, module.bias, True)


class LinearFusion:
    """The ``torch.nn.Linear`` modules of ``model``, and its ``transformers.pytorch_utils.Conv1D`` modules (GPT-2's
    layer, when transformers is imported), routed through ``torch.ops.<namespace>.fused_linear``.

    Only modules whose class keeps ``nn.Linear.forward`` (``Conv1D.forward``) are routed: a subclass with its own
    forward, or a module that already has an instance ``forward``, keeps its own. ``close()`` restores their
    forwards (idempotent).
    """

    def __init__(self, model: nn.Module, namespace: str) -> None:
        op = getattr(torch.ops, namespace).fused_linear
        conv1d = _conv1d_class()
        self.modules: list[nn.Module] = []
        for module in model.modules():
            if "forward" in module.__dict__:
                continue
            if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
                forward = _linear_forward
            elif conv1d is not None and isinstance(module, conv1d) and type(module).forward is conv1d.forward:
                forward = _conv1d_forward
            else:
                continue
            module.forward = types.MethodType(lambda m, x, f=forward: f(m, x, op=op), module)
            self.modules.append(module)
        self._forwards = [m.__dict__["forward"] for m in self.modules]

    def _routed(self) -> set[int]:
        """``id`` of the routed layers' weights and biases (read now: a layer's parameter may have been replaced)."""
        return {id(p) for m in self.modules for p in (m.weight, getattr(m, "bias", None)) if p is not None}

    def follow_hooks(self, accumulation, params: list[torch.Tensor]) -> None:
        """At construction and at every window's first ``backward()``: the routed layers' parameters among
        ``params`` (the accumulator's, layout order) that hold a user hook (``user_hooks``) are not fused from this
        backward on, the others are (``accumulation.set_fused``: a C++ call only when that changes). One Python pass
        over the parameters per window; nothing per micro-batch."""
        routed = self._routed()
        which = [not (id(p) in routed and bool(user_hooks(p))) for p in params]
        accumulation.set_fused(which)
        self._unfused = {id(p) for p, fused in zip(params, which) if not fused}

    def check_window(self, params: list[torch.Tensor], named_params: list[tuple[str, torch.Tensor]]) -> None:
        """``step()``, before anything is applied: ``RuntimeError`` naming a routed parameter that was fused at this
        window's start and holds a user hook now (registered in the middle of the window: the micro-batches since
        then wrote its gradient into main_grad without running the hook). ``named_params``: ``(name, p)`` pairs
        (the accumulator's ``named_params``) for the message."""
        routed, unfused = self._routed(), getattr(self, "_unfused", set())
        for i, p in enumerate(params):
            if id(p) in routed and id(p) not in unfused:
                found = user_hooks(p)
                if found:
                    name = next((n for n, q in named_params if q is p), f"param[{i}]")
                    raise RuntimeError(
                        f"gaengine: parameter {name!r} got a {found[0]} in the middle of "
                        f"this accumulation window, while gradient_accumulation_fusion wrote its gradient straight "
                        f"into main_grad: the micro-batches of this window did not run that hook, so nothing was "
                        f"applied (the window stays open). A layer whose weight or bias holds a hook when a window's "
                        f"first acc.backward() runs takes the unfused path for it, hooks included: register hooks "
                        f"between windows (after acc.step()). To go on: acc.zero_grad() drops this window")

    def close(self) -> None:
        for module, forward in zip(self.modules, self._forwards):
            if module.__dict__.get("forward") is forward:
                del module.forward
        self.modules, self._forwards = [], []
