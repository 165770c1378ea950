"""Backends: the three gradient-buffer operations the engine needs, behind one small interface.

Every backend implements the same contract (``Backend``):

* ``accumulate_(dst, src, scale, overwrite)`` — ``dst = (0 if overwrite else dst) + src * scale``.
  ``dst``: fp32, contiguous, written in place. ``src``: fp32 | bf16 | fp16, contiguous, same numel, read.
  ``scale``: a Python float or a 0-d fp32 tensor on ``dst.device``. Unscaled (``scale == 1``) results
  are bitwise equal to ``dst.add_(src)`` in torch; scaled ones are within 1 fp32 ulp of the exact value.
* ``l2norm_sq(x)`` -> ``(sum_of_squares, found_inf)`` — two 0-d fp32 tensors on ``x.device``;
  ``found_inf`` is 1.0 when ``x`` holds an inf or a NaN, else 0.0. One pass, no host sync.
* ``accumulate_sumsq_(dst, src, scale, overwrite, partials, index)`` -> ``dst`` — ``accumulate_`` (the same
  arguments, the same bits in ``dst``) that also writes, without a host sync, ``partials[index, 0]`` = the
  sum of squares (in fp64) of the values it wrote into ``dst`` and ``partials[index, 1]`` = 1.0 if any of
  them is inf or NaN, else 0.0: the "free norm" of the buffer, read off the accumulate pass. ``partials``:
  a contiguous ``(n, 2)`` float64 tensor on ``dst.device``; ``index``: an int in ``[0, n)``. Its bits do not
  depend on the thread count.
* ``scale_(x, coef)`` — ``x *= coef`` in place; ``x`` fp32 contiguous, ``coef`` a 0-d fp32 tensor on
  ``x.device`` (read on the device, never on the host).

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
from typing import Union

import torch

__all__ = ["Backend", "TorchBackend", "get_backend", "BACKEND_NAMES", "ContractError"]

logger = logging.getLogger("gaengine")

Scale = Union[float, torch.Tensor]
BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "cuda")
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


def check_sumsq_partials(dst: torch.Tensor, partials: torch.Tensor, index: int) -> None:
    """Validate ``partials`` and ``index`` of ``accumulate_sumsq_``; raises ``ContractError`` (a ``ValueError``)
    or ``TypeError`` naming the argument."""
    if not isinstance(partials, torch.Tensor) or partials.dtype != torch.float64:
        raise ContractError(f"partials must be a float64 tensor, got {getattr(partials, 'dtype', type(partials))}")
    if partials.dim() != 2 or partials.shape[1] != 2:
        raise ContractError(f"partials must have shape (n, 2), got {tuple(partials.shape)}")
    if not partials.is_contiguous():
        raise ContractError("partials must be contiguous")
    if partials.device != dst.device:
        raise ContractError(f"partials is on {partials.device} but dst is on {dst.device}; they must match")
    if isinstance(index, bool):
        raise TypeError("index must be an int, got bool")
    try:
        index = operator.index(index)
    except TypeError:
        raise TypeError(f"index must be an int, got {type(index).__name__}") from None
    if not 0 <= index < partials.shape[0]:
        raise ContractError(f"index {index} is out of range for partials with {partials.shape[0]} rows")


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


class Backend:
    """Interface of a backend; this base class is the ``torch`` reference implementation.

    Besides the ops, a backend says how the accumulator's hooks drive it (``gaengine.hooks.make_hooks``):
    ``hot_path_kernels`` names the kernels the native hooks (``csrc/hot_path.cpp``) launch for it ("cpu",
    "cuda", "aten": one ATen op per gradient), or is None when its kernels launch from Python (then the Python
    hooks run); ``bucketed``: the Python hooks hold gradients and accumulate a whole bucket per launch;
    ``fused_sumsq``: its ``accumulate_sumsq_`` reads the values it writes in the same pass (the reference here
    makes a second one, so the Python hooks then leave the norm to one ``l2norm_sq`` pass at ``step()``).
    """

    name = "torch"
    hot_path_kernels: str | None = "aten"
    bucketed = False
    fused_sumsq = False

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

    def accumulate_sumsq_(self, dst: torch.Tensor, src: torch.Tensor, scale: Scale, overwrite: bool,
                          partials: torch.Tensor, index: int) -> torch.Tensor:
        check_sumsq_partials(dst, partials, index)
        self.accumulate_(dst, src, scale, overwrite)
        d = dst.reshape(-1).double()
        stats = torch.stack([(d * d).sum(), (~torch.isfinite(d)).any().double()])
        partials[int(index)].copy_(stats)  # tensor ops only: no host sync
        return dst

    def l2norm_sq(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.reshape(-1).float()
        sum_sq = torch.dot(xf, xf) if xf.numel() else xf.new_zeros(())
        found_inf = (~torch.isfinite(xf)).any().float() if xf.numel() else xf.new_zeros(())
        return sum_sq, found_inf

    def scale_(self, x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return x.mul_(coef)

    def kernels_problem(self) -> str | None:
        """Why this backend's kernels cannot run now (the native hooks then fall back), or None."""
        return None

    def finish_norm_partials(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_sq, found_inf)``, 0-d fp32 on ``partials.device``, of the free-norm partials the accumulate
        pass of this backend wrote: per parameter, a contiguous ``(P, 2)`` fp64 table of (sum of squares,
        non-finite flag) rows (``accumulate_sumsq_``, the ``cpu`` kernels), summed in a fixed order. Backends
        whose bucket kernels write ``(2, n_chunks)`` fp32 per-chunk partials finish them with their own
        fixed-order reduction. No host sync."""
        sums = partials.sum(0)
        return sums[0].to(torch.float32), (sums[1] > 0).to(torch.float32)


class TorchBackend(Backend):
    """Plain PyTorch: the reference every other backend is tested against, and the fallback."""


class CpuBackend(Backend):
    """The compiled C++ extension ``gaengine._C`` (vectorized, ``at::parallel_for``), CPU tensors only."""

    name = "cpu"
    hot_path_kernels = "cpu"
    fused_sumsq = True

    def __init__(self) -> None:
        from gaengine import _C  # noqa: PLC0415 - kept lazy: ``import gaengine`` must not load the extension

        self._C = _C

    # Every argument is checked here, in Python, before ``self._C``: its TORCH_CHECKs are a second line only.
    @staticmethod
    def _check_accumulate(dst, src, scale):
        check_device_type(dst, "dst", "cpu")
        check_device_type(src, "src", "cpu")
        check_accumulate_args(dst, src, scale)

    def accumulate_(self, dst, src, scale=1.0, overwrite=False):
        self._check_accumulate(dst, src, scale)
        # A 0-d CPU tensor is read on the host; on CPU this is a plain load, not a device sync.
        s = float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)
        self._C.accumulate_(dst, src.reshape(-1) if not src.is_contiguous() else src, s, bool(overwrite))
        return dst

    def accumulate_sumsq_(self, dst, src, scale, overwrite, partials, index):
        self._check_accumulate(dst, src, scale)
        check_device_type(partials, "partials", "cpu")
        check_sumsq_partials(dst, partials, index)
        s = float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)  # a plain load on CPU
        self._C.accumulate_sumsq_(dst, src.reshape(-1) if not src.is_contiguous() else src, s, bool(overwrite),
                                  partials, operator.index(index))
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


class TritonBackend(Backend):
    """Triton kernels from ``gaengine.kernels``: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""

    name = "triton"
    hot_path_kernels = None  # launched from Python: the Python hooks run
    bucketed = True

    def __init__(self) -> None:
        from gaengine.kernels import accumulate, bucket, norm, scale  # noqa: PLC0415 - imports triton

        self._accumulate, self._norm, self._scale, self._bucket = accumulate, norm, scale, bucket

    def finish_norm_partials(self, partials):
        return self._bucket.l2norm_sq_from_partials(partials)  # (2, n_blocks) fp32, fixed-order tree

    def accumulate_(self, dst, src, scale=1.0, overwrite=False):
        return self._accumulate.accumulate_(dst, src.contiguous(), scale, overwrite=overwrite)

    def l2norm_sq(self, x):
        return self._norm.l2norm_sq(x.contiguous())

    def scale_(self, x, coef):
        return self._scale.scale_(x, coef)


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
    from gaengine import _C  # noqa: PLC0415 - kept lazy: ``import gaengine`` must not load the extension

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

    def __init__(self) -> None:
        self._C = _load_cuda_kernels()

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
        return tuple(self._C.sum_partials_cuda(partials))  # (2, n_chunks) fp32, fixed-order tree

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
