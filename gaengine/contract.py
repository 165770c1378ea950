"""The backend contract: what every backend of ``gaengine.backends`` implements (``Backend``), the argument checks
every implementation runs before its kernels, what a fused elementwise optimizer gives every backend to build its
step kernel from (``FusedStep``; ``Backend.optimizer_step``), and the arguments of the fused AdamW step
(``AdamWStep``). An optimizer step is not an op of the table: ``gaengine.optim``'s optimizers ask the backend
``gaengine.backends.get_backend`` picks for their step (``gaengine.optim.optimizer_kernel``), so neither side keeps a
table of the other's names.

Every backend implements the same ops (``OPS``):

* ``accumulate_(dst, src, scale, overwrite)`` -> ``dst`` — ``dst = (0 if overwrite else dst) + src * scale``.
  ``dst``: fp32, contiguous, written in place. ``src``: fp32 | bf16 | fp16, contiguous, same numel, read.
  ``scale``: a Python float, taken as its nearest fp32 value (as torch's own tensor-scalar arithmetic takes it),
  or a 0-d fp32 tensor on ``dst.device``. Unscaled (``scale == 1``) results are bitwise equal to
  ``dst.add_(src)`` in torch; scaled ones are within 1 fp32 ulp of the exact ``dst + src * fp32(scale)``.
* ``l2norm_sq(x)`` -> ``(sum_of_squares, found_inf)`` — two 0-d fp32 tensors on ``x.device``;
  ``found_inf`` is 1.0 when ``x`` holds an inf or a NaN, else 0.0. One pass, no host sync.
* ``scale_(x, coef)`` -> ``x`` — ``x *= coef`` in place; ``x`` fp32 contiguous, ``coef`` a 0-d fp32 tensor on
  ``x.device`` (read on the device, never on the host).
* ``accumulate_bucket_(dst, srcs, offsets, overwrite, partials=None, source_partials=None)`` -> ``dst`` — for every
  source ``j``: ``dst[offsets[j] : offsets[j] + srcs[j].numel()] = (0 if overwrite[j] else that slice) + srcs[j]``,
  unscaled (bitwise equal to torch's ``copy_`` / ``add_``), one launch (one parallel region on CPU) for the bucket.
  ``dst``: fp32, contiguous; ``srcs[j]``: fp32 | bf16 | fp16, contiguous, on ``dst.device``; the slices may not
  overlap or pass the end; ``overwrite``: one flag, or one per source. ``partials``: None, or the backend's
  free-norm table for these sources (``new_bucket_partials``), written with the sums of squares and non-finite flags
  of the values written, in the backend's own layout, finished by its ``finish_norm_partials``. ``source_partials``:
  None, or a table of the same format, written in the same pass with the sums of squares and non-finite flags of the
  sources' own values (``float(srcs[j])``, before the add), not of the values written.
* ``new_bucket_partials(numels, device)`` -> an uninitialized partials table for one ``accumulate_bucket_`` call
  over sources of these numels: ``(len(numels), 2)`` fp64 rows per source (the reference, ``cpu``), or
  ``(2, n_chunks)`` fp32 columns per chunk (``triton``, ``cuda``).
* ``finish_norm_partials(partials)`` -> ``(sum_of_squares, found_inf)`` of a partials table, in a fixed order; a
  stack of ``k`` tables (a leading dimension) -> ``(k,)`` results.

Bad arguments raise ``ContractError`` (a ``ValueError``, and a ``RuntimeError`` for code written against the
compiled ops' ``TORCH_CHECK`` contracts) or ``TypeError`` naming the argument, in Python, before anything is
written and before any call into ``gaengine._C``: a failed ``TORCH_CHECK`` must never be the first line of
defence (on some images it crashes the interpreter instead of raising, see ``csrc/README.md``).

Imports only torch: the Triton launchers (``gaengine.kernels``) take ``AdamWStep`` from here too.
"""

from __future__ import annotations

import abc
import numbers
import operator
from collections.abc import Sequence
from typing import Callable, NamedTuple, Optional, Union

import torch

__all__ = ["AdamWStep", "Backend", "ContractError", "FusedStep", "OPS", "Scale"]

Scale = Union[float, torch.Tensor]
# The operation table: every backend implements each of these.
OPS = ("accumulate_", "l2norm_sq", "scale_", "accumulate_bucket_", "new_bucket_partials", "finish_norm_partials")
FLOAT_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ContractError(ValueError, RuntimeError):
    """A bad argument to a backend op, found in Python before any kernel runs and before anything is written.

    A ``ValueError``; also a ``RuntimeError``, which is what the compiled ops' ``TORCH_CHECK`` contracts raise,
    so code written against those keeps catching it.
    """


class AdamWStep(NamedTuple):
    """The arguments of the multi-tensor AdamW step, in their positional order: the one spelling of the signature
    of every AdamW kernel (``gaengine.optim.adamw_step_reference``, the Triton ``adamw_step_``,
    ``torch.ops.gaengine.adamw_step_`` of ``csrc/adamw.h``; ``gaengine.optim.FusedAdamW`` calls the one its backend
    gives, ``gaengine.optim.adamw_kernel``), which take ``*AdamWStep(...)``.

    One AdamW update (``torch.optim.AdamW``; Loshchilov & Hutter 2019) of every ``params[i]``:

    params[i]: contiguous, updated in place: fp32 (the master weight), or bf16 | fp16 (the model parameter itself:
        computed in fp32, p, m, v each rounded to nearest even).
    grads[i]: fp32 | bf16 | fp16, contiguous, same numel; read only.
    exp_avgs[i], exp_avg_sqs[i]: params[i]'s dtype, contiguous, same numel; updated in place.
    steps[i]: 0-d fp32 on the parameters' device, incremented in place (by ``found_inf == 0``, by 1 without
        ``found_inf``) before the update; the new value sets the bias corrections.
    model_params[i]: None, or (fp32 params[i] only) bf16 | fp16 contiguous with the same numel: receives the
        rounded new param.
    lr, beta1, beta2, eps, weight_decay: Python floats (torch.optim.AdamW's hyper-parameters).
    maximize: ascend the gradient instead.
    grad_scale: None or a 0-d floating tensor on the device; the gradient used is ``grads[i] / grad_scale``.
    found_inf: None or a 0-d floating tensor on the device; when != 0 nothing is written (steps included).
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    model_params: list[Optional[torch.Tensor]]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    grad_scale: Optional[torch.Tensor]
    found_inf: Optional[torch.Tensor]


class FusedStep(NamedTuple):
    """A fused elementwise optimizer's step as every backend builds its kernel from it (``Backend.optimizer_step``):
    the optimizer's side of the one lookup, so that adding an optimizer touches no backend and adding a backend no
    optimizer.

    name: the optimizer's kernel name: its functor ``csrc/optim/<name>.h`` (``torch.ops.gaengine.optimizer_step_(name,
        ...)``, the C++ and CUDA multi-tensor launchers) and its Triton kernel ``gaengine.kernels.<name>.<name>_step_``.
    reference: its plain-torch step (the ``torch`` backend's kernel, and what a backend without a kernel of its own
        for this optimizer runs), with the arguments every kernel of this optimizer takes.
    op: None (the kernel takes ``(params, grads, states, steps, model_params, hyper, grad_scale, found_inf)``,
        ``gaengine.optim.FusedElementwiseOptimizer``), or the name of an op of the compiled module of the optimizer's
        own, with the reference's arguments (AdamW's ``adamw_step_``, taking ``*AdamWStep(...)``).
    """

    name: str
    reference: Callable[..., None]
    op: Optional[str] = None


class Backend(abc.ABC):
    """The interface of a backend: the ops of ``OPS`` (contracts in the module docstring) and how the accumulator's
    hooks drive it (``gaengine.hooks.make_hooks``).

    ``name``: what users pass as ``backend=``. The native hooks (``csrc/hot_path.cpp``) drive every backend: each
    complete bucket is one call, from C++ through the dispatcher, of ``accumulate_bucket_`` in the namespace
    ``hot_path_namespace`` gives (the compiled ops' own for ``cpu`` and ``cuda``; for ``torch`` and ``triton``, this
    backend's ``accumulate_bucket_`` registered as that op's kernel in a namespace of its own). ``hot_path_kernels``
    is truthy ("cpu", "cuda") when those kernels are ``gaengine._C``'s own, which gradient accumulation fusion also
    needs (``wgrad_accumulate_``), None otherwise. ``partials_dim``: the
    dimension of a ``new_bucket_partials`` table that runs over the sources (0: ``(n_src, 2)`` rows) or chunks (1:
    ``(2, n_chunks)`` columns); the table of several buckets' sources is the concatenation of theirs along it, so one
    table can serve a whole buffer, each bucket's call a slice.
    """

    name: str
    hot_path_kernels: Optional[str] = None
    partials_dim: int = 0

    @abc.abstractmethod
    def accumulate_(self, dst: torch.Tensor, src: torch.Tensor, scale: Scale = 1.0,
                    overwrite: bool = False) -> torch.Tensor:
        """``dst = (0 if overwrite else dst) + src * scale`` in place; returns ``dst``."""

    @abc.abstractmethod
    def l2norm_sq(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_of_squares, found_inf)`` of ``x``: two 0-d fp32 tensors on ``x.device``."""

    @abc.abstractmethod
    def scale_(self, x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """``x *= coef`` in place, ``coef`` read on the device; returns ``x``."""

    @abc.abstractmethod
    def accumulate_bucket_(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int],
                           overwrite: bool | Sequence[bool], partials: torch.Tensor | None = None,
                           source_partials: torch.Tensor | None = None) -> torch.Tensor:
        """Every source of a bucket into its ``dst`` slice in one launch; returns ``dst``."""

    @abc.abstractmethod
    def new_bucket_partials(self, numels: Sequence[int], device: torch.device | str) -> torch.Tensor:
        """An uninitialized partials table, in this backend's layout, for sources of these numels."""

    @abc.abstractmethod
    def finish_norm_partials(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_sq, found_inf)``, fp32 on ``partials.device``, of a table (or a stack of tables) this backend's
        ``accumulate_bucket_`` wrote, summed in a fixed order. No host sync."""


    def optimizer_step(self, step: FusedStep) -> tuple[Callable[..., None], str]:
        """This backend's kernel of the fused optimizer step ``step`` as ``(kernel, where)``: ``kernel`` takes the
        arguments of ``step.reference``, ``where`` names it (e.g. ``"torch.ops.gaengine.adamw_step_"``). By default
        the plain-torch reference itself (the ``torch`` backend's, and a backend's that has no fused optimizer
        kernels); a backend with its own kernels overrides this (``gaengine.backends``' ``cpu``, ``cuda`` and
        ``triton``). Raises ``RuntimeError`` naming the optimizer when this backend cannot run it."""
        return step.reference, f"{step.reference.__module__}.{step.reference.__qualname__}"

    def kernels_problem(self) -> str | None:
        """Why this backend's kernels cannot run now (the native hooks then fall back), or None."""
        return None

    def extension(self):
        """``(module, None)``: the compiled module whose ``HotPath`` runs this backend's hooks (``gaengine._C``), or
        ``(None, why)`` when it cannot (``gaengine.backends``' backends say which)."""
        return None, f"backend {self.name!r} does not say which compiled module runs its hooks"

    def hot_path_namespace(self, module) -> str:
        """The ``torch.library`` namespace whose ``accumulate_bucket_`` ``module.HotPath`` calls for this backend:
        by default this backend's own ``accumulate_bucket_``, registered as the kernel of an op of the compiled
        schema (``register_bucket_kernel``); the compiled backends return the compiled ops' namespace."""
        return register_bucket_kernel(self, module)


# The torch.library registrations of the Python backends' bucket kernels, by namespace: kept alive for the process (a
# Library object that is collected takes its registrations with it).
_BUCKET_LIBRARIES: dict[str, torch.library.Library] = {}


def register_bucket_kernel(backend: Backend, module) -> str:
    """Register ``backend.accumulate_bucket_`` as the kernel (``CompositeExplicitAutograd``: every device) of an op
    ``accumulate_bucket_`` with the compiled op's schema (``torch.ops.<module.OP_NAMESPACE>.accumulate_bucket_``) in
    the namespace ``<module.OP_NAMESPACE>_<backend.name>``, once per process, and return that namespace: the native
    hooks (``module.HotPath(..., op_namespace=...)``) then launch this backend's bucket kernel from C++ through the
    dispatcher, holding the GIL for the call (one per complete bucket)."""
    namespace = f"{module.OP_NAMESPACE}_{backend.name}"
    if namespace not in _BUCKET_LIBRARIES:
        schema = str(getattr(torch.ops, module.OP_NAMESPACE).accumulate_bucket_.default._schema).split("::", 1)[1]

        def kernel(dst, srcs, offsets, overwrite, partials=None, source_partials=None) -> None:
            backend.accumulate_bucket_(dst, srcs, offsets, overwrite, partials, source_partials)

        library = torch.library.Library(namespace, "DEF")
        library.define(schema)
        library.impl("accumulate_bucket_", kernel, "CompositeExplicitAutograd")
        _BUCKET_LIBRARIES[namespace] = library
    return namespace


# ---------------------------------------------------------------------------------------------------- the checks
def _check_tensor(x: object, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_device_type(x: torch.Tensor, name: str, device_type: str) -> None:
    """``x`` must live on a ``device_type`` device (the compiled kernels' ``CHECK_CPU`` / ``CHECK_CUDA``)."""
    _check_tensor(x, name)
    if x.device.type != device_type:
        kind = "CPU" if device_type == "cpu" else device_type.upper()
        raise ContractError(f"{name} must be a {kind} tensor, got device {x.device}")


def check_accumulate_args(dst: torch.Tensor, src: torch.Tensor, scale: Scale) -> None:
    """Validate the arguments of ``accumulate_``; raises ``ContractError`` (a ``ValueError``) or ``TypeError``
    naming the argument."""
    _check_tensor(dst, "dst")
    _check_tensor(src, "src")
    if dst.dtype != torch.float32:
        raise ContractError(f"dst must be float32 (the main_grad buffer), got {dst.dtype}")
    if not dst.is_contiguous():
        raise ContractError("dst must be contiguous")
    if src.dtype not in FLOAT_GRAD_DTYPES:
        raise ContractError(f"src must be float32, bfloat16 or float16, got {src.dtype}")
    if src.numel() != dst.numel():
        raise ContractError(f"src has {src.numel()} elements but dst has {dst.numel()}; they must match")
    if src.device != dst.device:
        raise ContractError(f"src is on {src.device} but dst is on {dst.device}; they must match")
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or scale.dtype != torch.float32 or scale.device != dst.device:
            raise ContractError(
                f"scale must be a Python float or a 0-d float32 tensor on {dst.device}, got a "
                f"{tuple(scale.shape)} {scale.dtype} tensor on {scale.device}"
            )
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python float or a 0-d float32 tensor, got {type(scale).__name__}")


def check_grad_tensor(x: torch.Tensor, name: str = "x") -> None:
    """``x`` of ``l2norm_sq``: a float32 | bfloat16 | float16 tensor."""
    _check_tensor(x, name)
    if x.dtype not in FLOAT_GRAD_DTYPES:
        raise ContractError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_scale_args(x: torch.Tensor, coef: torch.Tensor) -> None:
    """Validate the arguments of ``scale_``; raises ``ContractError`` (a ``ValueError``) or ``TypeError``."""
    _check_tensor(x, "x")
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ContractError(f"x must be a contiguous float32 tensor, got {x.dtype} (contiguous={x.is_contiguous()})")
    if not isinstance(coef, torch.Tensor):
        raise TypeError(f"coef must be a 0-d tensor on {x.device} (so it is never read on the host), got "
                        f"{type(coef).__name__}")
    if coef.dim() != 0 or coef.device != x.device:
        raise ContractError(f"coef must be a 0-d tensor on {x.device} (so it is never read on the host), got shape "
                            f"{tuple(coef.shape)} on {coef.device}")
    if coef.is_complex():
        raise ContractError(f"coef must be a real tensor, got {coef.dtype}")


def check_bucket_args(dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int],
                      overwrite: bool | Sequence[bool],
                      device_type: str | None = None) -> tuple[list[int], list[bool], list[int]]:
    """Validate the arguments of ``accumulate_bucket_`` (on ``device_type`` devices when given); returns the offsets,
    one overwrite flag per source and the sources' numels. Raises ``ContractError`` (a ``ValueError``) or
    ``TypeError`` naming the argument."""
    _check_tensor(dst, "dst")
    if device_type is not None:
        check_device_type(dst, "dst", device_type)
    if dst.dtype != torch.float32 or not dst.is_contiguous():
        raise ContractError(f"dst must be a contiguous float32 tensor (the main_grad buffer), got {dst.dtype} "
                            f"(contiguous={dst.is_contiguous()})")
    srcs = list(srcs)
    offsets = [operator.index(o) for o in offsets]
    flags = [bool(overwrite)] * len(srcs) if isinstance(overwrite, bool) else [bool(f) for f in overwrite]
    if len(offsets) != len(srcs) or len(flags) != len(srcs):
        raise ContractError(f"srcs, offsets and overwrite must have the same length, got {len(srcs)}, {len(offsets)} "
                            f"and {len(flags)}")
    spans, numels, total = [], [], dst.numel()
    for j, src in enumerate(srcs):
        _check_tensor(src, f"srcs[{j}]")
        if src.dtype not in FLOAT_GRAD_DTYPES or not src.is_contiguous() or src.device != dst.device:
            raise ContractError(f"srcs[{j}] must be a contiguous float32, bfloat16 or float16 tensor on {dst.device}, "
                                f"got {src.dtype} on {src.device} (contiguous={src.is_contiguous()})")
        n = src.numel()
        numels.append(n)
        if offsets[j] < 0 or offsets[j] + n > total:
            raise ContractError(f"offsets[{j}] = {offsets[j]} puts the {n} elements of srcs[{j}] outside dst "
                                f"({total} elements)")
        if n:
            spans.append((offsets[j], offsets[j] + n, j))
    spans.sort()
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise ContractError(f"the dst slices of srcs[{i}] and srcs[{j}] overlap")
    return offsets, flags, numels


def check_partials_like(partials: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        contiguous: bool, name: str = "partials") -> None:
    """``partials`` (the argument ``name``) has this shape, dtype and device (``new_bucket_partials``'s), and is
    contiguous (or only has unit column stride, a column slice of a whole-buffer table, when ``contiguous`` is
    False); else ``ContractError`` naming it."""
    ok = (isinstance(partials, torch.Tensor) and tuple(partials.shape) == tuple(shape) and partials.dtype == dtype
          and partials.device == device and (partials.is_contiguous() if contiguous
                                             else partials.numel() == 0 or partials.stride(-1) == 1))
    if not ok:
        got = (f"a {tuple(partials.shape)} {partials.dtype} tensor on {partials.device}"
               if isinstance(partials, torch.Tensor) else type(partials).__name__)
        layout = "contiguous" if contiguous else "with unit column stride"
        raise ContractError(f"{name} must be a {tuple(shape)} {dtype} tensor on {device}, {layout} "
                            f"(new_bucket_partials), got {got}")
