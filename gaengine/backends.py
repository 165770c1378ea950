"""Backends: the three gradient-buffer operations the engine needs, behind one small interface.

Every backend implements the same contract (``Backend``):

* ``accumulate_(dst, src, scale, overwrite)`` — ``dst = (0 if overwrite else dst) + src * scale``.
  ``dst``: fp32, contiguous, written in place. ``src``: fp32 | bf16 | fp16, contiguous, same numel, read.
  ``scale``: a Python float, taken as its nearest fp32 value (as torch's own tensor-scalar arithmetic takes it),
  or a 0-d fp32 tensor on ``dst.device``. Unscaled (``scale == 1``) results are bitwise equal to
  ``dst.add_(src)`` in torch; scaled ones are within 1 fp32 ulp of the exact ``dst + src * fp32(scale)``.
* ``l2norm_sq(x)`` -> ``(sum_of_squares, found_inf)`` — two 0-d fp32 tensors on ``x.device``;
  ``found_inf`` is 1.0 when ``x`` holds an inf or a NaN, else 0.0. One pass, no host sync.
* ``scale_(x, coef)`` — ``x *= coef`` in place; ``x`` fp32 contiguous, ``coef`` a 0-d fp32 tensor on
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
* ``adamw_step_(*AdamWStep(...))`` — the multi-tensor AdamW step of ``gaengine.optim.FusedAdamW``; its arguments and
  contract are ``AdamWStep``'s docstring (and ``csrc/adamw.h``). An attribute holding the kernel function itself.

A backend that lacks an op says so at construction: ``lacks`` maps the op's name to why, and the op is the
reference's (``Backend``'s). Nothing outside this module branches on a backend's ``name``.

Bad arguments raise ``ContractError`` (a ``ValueError``, and a ``RuntimeError`` for code written against the
compiled ops' ``TORCH_CHECK`` contracts) or ``TypeError`` naming the argument, in Python, before anything is
written and before any call into ``gaengine._C``: a failed ``TORCH_CHECK`` must never be the first line of
defence (on some images it crashes the interpreter instead of raising, see ``csrc/README.md``).

Backends: ``torch`` (plain PyTorch, the reference and the fallback, any device), ``cpu`` (the compiled
C++ extension ``gaengine._C``, CPU tensors), ``triton`` (``gaengine.kernels``, CUDA tensors, or CPU
tensors under ``TRITON_INTERPRET=1``), ``cuda`` (the CUDA kernels of ``gaengine._C``, ``csrc/cuda/``, in
an extension built against a CUDA torch; CUDA tensors). ``auto`` picks the fastest available one for a
device and says which once; a backend asked for by name that cannot load raises ``RuntimeError`` with the
reason.
"""

from __future__ import annotations

import logging
import numbers
import operator
import os
from collections.abc import Sequence
from typing import Union

import torch

from gaengine.kernels._utils import AdamWStep

__all__ = ["AdamWStep", "Backend", "TorchBackend", "get_backend", "BACKEND_NAMES", "ContractError", "OPS",
           "adamw_step_reference", "load_extension"]

logger = logging.getLogger("gaengine")

Scale = Union[float, torch.Tensor]
BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "cuda")
# The operation table: every backend has each of these (its own kernel, or the reference when ``lacks`` names it).
OPS = ("accumulate_", "l2norm_sq", "scale_", "accumulate_bucket_", "new_bucket_partials",
       "finish_norm_partials", "adamw_step_")
_FLOAT_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ContractError(ValueError, RuntimeError):
    """A bad argument to a backend op, found in Python before any kernel runs and before anything is written.

    A ``ValueError``; also a ``RuntimeError``, which is what the compiled ops' ``TORCH_CHECK`` contracts raise,
    so code written against those keeps catching it.
    """


def _is_unit(scale: Scale) -> bool:
    return not isinstance(scale, torch.Tensor) and float(scale) == 1.0


def _check_tensor(x: object, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_device_type(x: torch.Tensor, name: str, device_type: str) -> None:
    """``x`` must live on a ``device_type`` device (the compiled backends' ``CHECK_CPU`` / ``CHECK_CUDA``)."""
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
    if src.dtype not in _FLOAT_GRAD_DTYPES:
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
    if x.dtype not in _FLOAT_GRAD_DTYPES:
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
        if src.dtype not in _FLOAT_GRAD_DTYPES or not src.is_contiguous() or src.device != dst.device:
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


def _check_partials_like(partials: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
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


def _sumsq_rows(tensors: Sequence[torch.Tensor], table: torch.Tensor) -> None:
    """Row ``j`` of the ``(len(tensors), 2)`` fp64 ``table`` = (sum of squares of ``float(tensors[j])``, 1.0 if it
    holds an inf or a NaN else 0.0): the partials of the row format, in fp64 (the square of the fp64 norm: within a
    few fp64 ulps of the exact sum; an fp32 value's square cannot overflow fp64, so a non-finite norm is exactly a
    non-finite value). A fixed number of tensor ops for any number of tensors; no host sync."""
    if not tensors:
        return
    norms = torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float64))
    table[:, 0].copy_(norms * norms)
    table[:, 1].copy_((~torch.isfinite(norms)).to(torch.float64))


def _check_row_tables(dst: torch.Tensor, n_srcs: int, partials, source_partials) -> None:
    """``partials`` and ``source_partials`` are None or contiguous ``(n_srcs, 2)`` fp64 tables on ``dst.device``."""
    for name, table in (("partials", partials), ("source_partials", source_partials)):
        if table is not None:
            _check_partials_like(table, (n_srcs, 2), torch.float64, dst.device, True, name)


def adamw_step_reference(*args, **kwargs) -> None:
    """One AdamW update of every ``params[i]``: the plain-torch reference and fallback of every backend's
    ``adamw_step_``. Its arguments (``*AdamWStep(...)``, positional or by name) and contract are ``AdamWStep``'s
    (``gaengine.kernels._utils``; the C++ kernels ``csrc/adamw.h``).

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


def load_extension():
    """``(gaengine._C, None)`` when the compiled extension loads, else ``(None, why)`` (a sentence): the one place
    gaengine looks for it. Lazy: ``import gaengine`` does not load the extension."""
    try:
        from gaengine import _C  # noqa: PLC0415
    except ImportError as exc:
        return None, f"gaengine._C is not built ({exc})"
    return _C, None


class Backend:
    """Interface of a backend; this base class is the ``torch`` reference implementation.

    Besides the ops, a backend says how the accumulator's hooks drive it (``gaengine.hooks.make_hooks``):
    ``hot_path_kernels`` is truthy ("cpu", "cuda") when the native hooks (``csrc/hot_path.cpp``) can launch its
    bucket kernels from C++ (``torch.ops.gaengine.accumulate_bucket_``), None when its kernels launch from Python
    (this reference, ``triton``): then the Python hooks run, holding each gradient until its bucket is complete and
    accumulating the bucket with one ``accumulate_bucket_``. ``partials_dim``: the dimension of a
    ``new_bucket_partials`` table that runs over the sources (0: ``(n_src, 2)`` rows) or chunks (1: ``(2, n_chunks)``
    columns); the table of several buckets' sources is the concatenation of theirs along it, so one table can serve
    a whole buffer, each bucket's call a slice.
    """

    name = "torch"
    hot_path_kernels: str | None = None
    partials_dim = 0
    # The ops of ``OPS`` this backend takes from the reference, each with why (set at construction).
    lacks: dict[str, str] = {}
    adamw_step_ = staticmethod(adamw_step_reference)

    def accumulate_(self, dst: torch.Tensor, src: torch.Tensor, scale: Scale = 1.0, overwrite: bool = False) -> torch.Tensor:
        d, s = dst.view(-1), src.reshape(-1)
        if _is_unit(scale):
            # One IEEE add (or an exact widening copy) per element: the definition of "bitwise equal to torch".
            d.copy_(s) if overwrite else d.add_(s)
        elif overwrite:
            torch.mul(s.float(), scale, out=d)
        else:
            d.add_(s.float() * scale)
        return dst

    def l2norm_sq(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.reshape(-1).float()
        sum_sq = torch.dot(xf, xf) if xf.numel() else xf.new_zeros(())
        found_inf = (~torch.isfinite(xf)).any().float() if xf.numel() else xf.new_zeros(())
        return sum_sq, found_inf

    def scale_(self, x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return x.mul_(coef)

    def new_bucket_partials(self, numels: Sequence[int], device: torch.device | str) -> torch.Tensor:
        return torch.empty(len(numels), 2, dtype=torch.float64, device=device)

    def accumulate_bucket_(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int],
                           overwrite: bool | Sequence[bool], partials: torch.Tensor | None = None,
                           source_partials: torch.Tensor | None = None) -> torch.Tensor:
        srcs = list(srcs)
        offsets, flags, _ = check_bucket_args(dst, srcs, offsets, overwrite)
        _check_row_tables(dst, len(srcs), partials, source_partials)
        flat = dst.view(-1)
        written = [flat.narrow(0, offset, src.numel()) for src, offset in zip(srcs, offsets)]
        for d, src, flag in zip(written, srcs, flags):
            Backend.accumulate_(self, d, src, 1.0, flag)  # the one reference of "add a gradient into the buffer"
        if partials is not None:
            _sumsq_rows(written, partials)
        if source_partials is not None:
            _sumsq_rows(srcs, source_partials)
        return dst

    def kernels_problem(self) -> str | None:
        """Why this backend's kernels cannot run now (the native hooks then fall back), or None."""
        return None

    def extension(self):
        """``(module, None)``: the compiled module whose ``HotPath`` launches this backend's ``hot_path_kernels``
        (``gaengine._C``; the tests' emulated build for the emulated ``cuda`` backend), or ``(None, why)``."""
        module = getattr(self, "_C", None)
        return (module, None) if module is not None else load_extension()

    def finish_norm_partials(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_sq, found_inf)``, fp32 on ``partials.device``, of a partials table this backend's
        ``accumulate_bucket_`` wrote (``new_bucket_partials``): here a contiguous ``(P, 2)`` fp64 table of (sum of
        squares, non-finite flag) rows, summed in a fixed order; the ``(2, n_chunks)`` fp32 per-chunk tables of
        ``triton`` and ``cuda`` by their own fixed-order reduction. A stack of ``k`` tables (a leading dimension
        of ``k``) gives ``(k,)`` results, one per table, in one call. No host sync."""
        sums = partials.sum(-2)
        return sums[..., 0].to(torch.float32), (sums[..., 1] > 0).to(torch.float32)


class TorchBackend(Backend):
    """Plain PyTorch: the reference every other backend is tested against, and the fallback."""


class CpuBackend(Backend):
    """The compiled C++ extension ``gaengine._C`` (vectorized, ``at::parallel_for``), CPU tensors only."""

    name = "cpu"
    hot_path_kernels = "cpu"

    def __init__(self) -> None:
        _C, why = load_extension()
        if _C is None:
            raise ImportError(why)
        self._C = _C
        self._source_partials = bool(getattr(_C, "BUCKET_SOURCE_PARTIALS", False))
        self.lacks = {}
        if hasattr(_C, "adamw_step_"):
            self.adamw_step_ = _C.adamw_step_
        else:  # an extension built before the fused AdamW: the reference's
            self.lacks = {"adamw_step_": "gaengine._C was built without adamw_step_"}

    # Every argument is checked here, in Python, before ``self._C``: its TORCH_CHECKs are a second line only.
    @staticmethod
    def _check_accumulate(dst, src, scale):
        check_device_type(dst, "dst", "cpu")
        check_device_type(src, "src", "cpu")
        check_accumulate_args(dst, src, scale)

    @staticmethod
    def _fp32_scale(scale) -> float:
        """The scale as the kernel takes it: a 0-d CPU tensor read on the host (a plain load on CPU, not a device
        sync), a Python float rounded to fp32 first, as every other backend takes it (the contract above)."""
        if isinstance(scale, torch.Tensor):
            return float(scale.item())
        return float(scale) if float(scale) == 1.0 else torch.tensor(float(scale), dtype=torch.float32).item()

    def accumulate_(self, dst, src, scale=1.0, overwrite=False):
        self._check_accumulate(dst, src, scale)
        s = self._fp32_scale(scale)
        self._C.accumulate_(dst, src.reshape(-1) if not src.is_contiguous() else src, s, bool(overwrite))
        return dst

    def l2norm_sq(self, x):
        check_device_type(x, "x", "cpu")
        check_grad_tensor(x)
        return tuple(self._C.l2norm_sq(x.contiguous()))

    def scale_(self, x, coef):
        check_device_type(x, "x", "cpu")
        check_scale_args(x, coef)
        # The kernel reads coef as a float (coef.item<float>(), which throws for a double out of float range):
        # the same rounding as torch's cast, and inf instead of an error for an out-of-range double.
        self._C.scale_(x, coef if coef.dtype == torch.float32 else coef.to(torch.float32))
        return x

    def accumulate_bucket_(self, dst, srcs, offsets, overwrite, partials=None, source_partials=None):
        srcs = list(srcs)
        offsets, flags, _ = check_bucket_args(dst, srcs, offsets, overwrite, "cpu")
        _check_row_tables(dst, len(srcs), partials, source_partials)
        if source_partials is None:
            self._C.accumulate_bucket_(dst, srcs, offsets, flags, partials)
        elif self._source_partials:
            self._C.accumulate_bucket_(dst, srcs, offsets, flags, partials, source_partials=source_partials)
        else:  # an extension built before source_partials: the reference's rows, one more read of the sources
            _sumsq_rows(srcs, source_partials)
            self._C.accumulate_bucket_(dst, srcs, offsets, flags, partials)
        return dst


class TritonBackend(Backend):
    """Triton kernels from ``gaengine.kernels``: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""

    name = "triton"
    hot_path_kernels = None  # launched from Python: the Python hooks run
    partials_dim = 1

    def __init__(self) -> None:
        from gaengine.kernels import accumulate, adamw, bucket, norm, scale  # noqa: PLC0415 - imports triton

        self._accumulate, self._norm, self._scale, self._bucket = accumulate, norm, scale, bucket
        self.adamw_step_ = adamw.adamw_step_  # one launch per parameter

    def finish_norm_partials(self, partials):
        return self._bucket.l2norm_sq_from_partials(partials)  # (2, n_blocks) fp32, fixed-order tree

    def accumulate_(self, dst, src, scale=1.0, overwrite=False):
        return self._accumulate.accumulate_(dst, src.contiguous(), scale, overwrite=overwrite)

    def l2norm_sq(self, x):
        return self._norm.l2norm_sq(x.contiguous())

    def scale_(self, x, coef):
        return self._scale.scale_(x, coef)

    def new_bucket_partials(self, numels, device):
        return torch.empty(2, self._bucket.num_blocks(numels), dtype=torch.float32, device=device)

    def accumulate_bucket_(self, dst, srcs, offsets, overwrite, partials=None, source_partials=None):
        # gaengine.kernels.bucket checks every argument (ValueError) before it launches.
        return self._bucket.accumulate_bucket_(dst, srcs, offsets, 1.0, overwrite, partials=partials,
                                               source_partials=source_partials)


# cudaDriverGetVersion()'s 1000 * major + 10 * minor of CUDA 12.1: the first driver that launches kernels with more
# than 4 KB of parameters, which the multi-tensor kernels pass (20.5 KB bucket, 27.7 KB AdamW; csrc/cuda/README.md).
MIN_CUDA_DRIVER = 12010


def _cuda_driver_version() -> int | None:
    """The CUDA version the installed driver supports, as ``cudaDriverGetVersion`` encodes it (12040 for 12.4),
    or ``None`` when this torch cannot say (a CPU build, or the query failed)."""
    query = getattr(torch._C, "_cuda_getDriverVersion", None)  # CUDA builds of torch only
    try:
        return int(query()) if query is not None else None
    except (RuntimeError, TypeError, ValueError):
        return None


def cuda_driver_problem(driver_version: int | None) -> str | None:
    """Why a driver reporting ``driver_version`` (``cudaDriverGetVersion``'s encoding) cannot launch the CUDA
    kernels of ``gaengine._C``, or ``None`` when it can. An unknown version (``None``) is given the benefit of
    the doubt."""
    if driver_version is None or driver_version >= MIN_CUDA_DRIVER:
        return None
    found = f"{driver_version // 1000}.{driver_version % 1000 // 10}"
    need = f"{MIN_CUDA_DRIVER // 1000}.{MIN_CUDA_DRIVER % 1000 // 10}"
    return (f"the CUDA driver supports CUDA {found} (cudaDriverGetVersion() = {driver_version}), but the CUDA kernels "
            f"of gaengine._C need CUDA >= {need}: the multi-tensor ones pass up to 27.7 KB of kernel parameters by "
            f"value, which an older driver refuses at every launch. Update the NVIDIA driver (R530 or newer), or use "
            f"backend='triton'")


# A test hook, None in every real run: tests/cuda_emu/engine.py sets it to an emulated build of gaengine._C (csrc/cuda's
# kernels executed on CPU by the shim, built with CPU tensors standing in for CUDA ones). The cuda backend, the native
# hot path's kernels="cuda" and FusedAdamW's adamw_step_cuda_ then take their ops from it, on CPU tensors.
_EMULATED_CUDA_MODULE = None


def _cuda_device_type() -> str:
    """The device type of the cuda backend's tensors: "cuda" ("cpu" only under the test hook above)."""
    return "cuda" if _EMULATED_CUDA_MODULE is None else "cpu"


def _load_cuda_kernels():
    """``gaengine._C`` when its CUDA kernels can run in this process; else raises ``RuntimeError`` with the reason
    (``ImportError`` when the extension is not built). The driver is checked when a GPU is visible."""
    if _EMULATED_CUDA_MODULE is not None:
        return _EMULATED_CUDA_MODULE
    if not torch.version.cuda:
        raise RuntimeError("this torch is a CPU-only build (torch.version.cuda is None)")
    if torch.cuda.is_available():
        problem = cuda_driver_problem(_cuda_driver_version())
        if problem is not None:
            raise RuntimeError(problem)
    _C, why = load_extension()
    if _C is None:
        raise ImportError(why)
    missing = [op for op in ("accumulate_cuda_", "l2norm_sq_cuda", "scale_cuda_", "accumulate_bucket_cuda_",
                              "sum_partials_cuda", "adamw_step_cuda_") if not hasattr(_C, op)]
    if missing:
        raise RuntimeError(f"gaengine._C was built without its CUDA ops ({', '.join(missing)} missing); rebuild it "
                           "against a CUDA torch with CUDA_HOME set, both CUDA >= 12.1 (setup.py prints why it left "
                           "them out)")
    return _C


def cuda_kernels_unusable() -> str | None:
    """Why the CUDA kernels of ``gaengine._C`` cannot run in this process, or ``None`` when they can.

    The one decision behind the ``cuda`` backend (``CudaBackend`` loads only when this is ``None``), so behind
    ``auto``'s choice on CUDA devices, the native hot path's bucket kernel (``gaengine.hot_path.make_hooks``) and
    ``FusedAdamW``'s ``adamw_step_cuda_``: a CPU-only torch, an extension without its CUDA ops, or a CUDA driver
    older than 12.1 (``cuda_driver_problem``).
    """
    try:
        _load_cuda_kernels()
    except (ImportError, RuntimeError) as exc:
        return str(exc)
    return None


class CudaBackend(Backend):
    """The CUDA kernels of ``gaengine._C`` (``csrc/cuda/``): CUDA tensors only.

    They are in the extension only when it was built against a CUDA torch with a CUDA toolkit, both >= 12.1
    (``setup.py``), and they launch only on a driver for CUDA >= 12.1; loading raises ``RuntimeError`` with the
    reason otherwise (``cuda_kernels_unusable``).
    """

    name = "cuda"
    hot_path_kernels = "cuda"
    partials_dim = 1

    def __init__(self) -> None:
        self._C = _load_cuda_kernels()
        self.adamw_step_ = self._C.adamw_step_cuda_  # one launch for the whole list (per 384 params and dtype)

    # Every argument is checked here, in Python, before ``self._C``: its TORCH_CHECKs are a second line only.
    # Nothing below reads a tensor on the host.
    def accumulate_(self, dst, src, scale=1.0, overwrite=False):
        check_device_type(dst, "dst", _cuda_device_type())
        check_device_type(src, "src", _cuda_device_type())
        check_accumulate_args(dst, src, scale)  # same device, dtypes, numel; a tensor scale: 0-d fp32 on dst's
        tensor = scale if isinstance(scale, torch.Tensor) else None  # read by the kernel, never on the host
        self._C.accumulate_cuda_(dst, src.contiguous(), 1.0 if tensor is not None else float(scale), tensor,
                                 bool(overwrite))
        return dst

    def l2norm_sq(self, x):
        check_device_type(x, "x", _cuda_device_type())
        check_grad_tensor(x)
        return tuple(self._C.l2norm_sq_cuda(x.contiguous()))

    def scale_(self, x, coef):
        check_device_type(x, "x", _cuda_device_type())
        check_scale_args(x, coef)
        # The kernel reads a float through coef's pointer: a cast on the device (no host read), torch's rounding.
        self._C.scale_cuda_(x, coef if coef.dtype == torch.float32 else coef.to(torch.float32))
        return x

    def finish_norm_partials(self, partials):
        if partials.dim() == 2:
            return tuple(self._C.sum_partials_cuda(partials))  # (2, n_chunks) fp32, fixed-order tree
        sums = [self._C.sum_partials_cuda(table) for table in partials]  # a stack: one launch per table
        return torch.stack([s[0] for s in sums]), torch.stack([s[1] for s in sums])

    def new_bucket_partials(self, numels, device):
        n_chunks = self._C.bucket_num_chunks([int(n) for n in numels])
        return torch.empty(2, n_chunks, dtype=torch.float32, device=device)

    def accumulate_bucket_(self, dst, srcs, offsets, overwrite, partials=None, source_partials=None):
        srcs = list(srcs)
        offsets, flags, numels = check_bucket_args(dst, srcs, offsets, overwrite, _cuda_device_type())
        if partials is not None or source_partials is not None:
            shape = (2, self._C.bucket_num_chunks(numels))
            for name, table in (("partials", partials), ("source_partials", source_partials)):
                if table is not None:
                    _check_partials_like(table, shape, torch.float32, dst.device, False, name)
        if source_partials is None:
            self._C.accumulate_bucket_cuda_(dst, srcs, offsets, flags, partials)
        elif getattr(self._C, "BUCKET_SOURCE_PARTIALS", False):
            self._C.accumulate_bucket_cuda_(dst, srcs, offsets, flags, partials, source_partials=source_partials)
        else:
            raise RuntimeError("source_partials needs a gaengine._C built with them (BUCKET_SOURCE_PARTIALS): rebuild "
                               "it with pip install --no-build-isolation -e .")
        return dst

    def kernels_problem(self):
        return cuda_kernels_unusable()  # ops built, driver >= 12.1


_CLASSES = {"torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend, "cuda": CudaBackend}
_instances: dict[str, Backend] = {}
_load_errors: dict[str, BaseException] = {}
_announced: set[tuple[str, str]] = set()


def _load(name: str) -> Backend | None:
    if name in _instances:
        return _instances[name]
    if name in _load_errors:
        return None
    try:
        _instances[name] = _CLASSES[name]()
    except Exception as exc:  # kept and re-raised only when this backend is asked for by name
        _load_errors[name] = exc
        return None
    return _instances[name]


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> Backend:
    """Return the backend ``name`` for tensors on ``device``.

    ``name``: one of ``BACKEND_NAMES``; ``"auto"`` reads ``GAENGINE_BACKEND`` first, then picks ``cuda``
    for CUDA devices when ``gaengine._C`` carries its CUDA kernels and the driver can launch them
    (``cuda_kernels_unusable``; the native hot path launches them from C++, ``gaengine.hot_path``), else
    ``triton``, and ``cpu`` for CPU ones, falling back to ``torch`` quietly (logged once).
    Raises ``ValueError`` for an unknown name and ``RuntimeError`` when a backend asked for by name
    cannot load or cannot run on ``device`` (the original import error is chained).
    """
    device = torch.device(device)
    if name == "auto":
        name = os.environ.get("GAENGINE_BACKEND", "auto") or "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        preferred = "cuda" if device.type == "cuda" else "cpu" if device.type == "cpu" else "torch"
        backend = _load(preferred) or (_load("triton") if device.type == "cuda" else None) or _load("torch")
        if (device.type, backend.name) not in _announced:
            _announced.add((device.type, backend.name))
            why = "" if backend.name == preferred else f" ({preferred} unavailable: {_load_errors.get(preferred)})"
            logger.info("gaengine: backend %r for %s tensors%s", backend.name, device.type, why)
        return backend
    if name == "cpu" and device.type != "cpu":
        raise RuntimeError(f"backend 'cpu' runs on CPU tensors only, got device {device}")
    if name == "triton" and device.type == "cpu" and not _interpreter_on():
        raise RuntimeError("backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    backend = _load(name)
    if backend is None:
        hint = " (build it with GAENGINE_BUILD_EXT=1 pip install --no-build-isolation -e .)" if name == "cpu" else ""
        raise RuntimeError(f"backend {name!r} could not be loaded{hint}: {_load_errors[name]}") from _load_errors[name]
    if name == "cuda" and device.type != _cuda_device_type():
        raise RuntimeError(f"backend 'cuda' runs on CUDA tensors only, got device {device}")
    return backend
