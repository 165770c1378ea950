"""Backends: the implementations of the backend contract (``gaengine.contract``), and the one place that picks one.

Backends (the names users pass as ``backend=``): ``torch`` (``ReferenceBackend``: plain PyTorch, the reference and
the fallback, any device), ``cpu`` and ``cuda`` (``CompiledBackend``: the kernels of the compiled extension
``gaengine._C``, reached through the dispatcher as ``torch.ops.gaengine.*``, which runs the CPU kernel on CPU tensors
and the CUDA kernel, ``csrc/cuda/``, on CUDA tensors; one class, one instance per device type, which differ only in
the partials layout of their bucket kernels), ``triton`` (``TritonBackend``: ``gaengine.kernels``, CUDA tensors, or CPU
tensors under ``TRITON_INTERPRET=1``). ``auto`` picks the fastest available one for a device and says which once; a
backend asked for by name that cannot load raises ``RuntimeError`` with the reason.

``gaengine._C`` is loaded in one place, ``load_extension``: a module built from other sources than this gaengine
(its ``ABI_VERSION`` is not ``EXTENSION_ABI_VERSION``) is refused there with one message, rebuild it with
``make install``. The CUDA kernels are in it only when it was built against a CUDA torch with a CUDA toolkit, both
>= 12.1 (``setup.py``), and launch only on a driver for CUDA >= 12.1 (``cuda_kernels_unusable``).

A backend is one unit: its ``Backend`` class (the ops, how the hooks drive it, and its fused optimizers' step
kernels, ``Backend.optimizer_step``) and one ``register_backend`` call (its name, its device types, whether
``auto`` may pick it); the fused optimizers (``gaengine.optim``) ask the chosen backend for their step and keep no
table of backends. Adding one touches its module, its registration, its test and its docs (docs/backends.md).

Every op checks its arguments in Python (``gaengine.contract``) before anything is written and before any call
into ``gaengine._C``. Nothing outside this module branches on a backend's ``name``.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from gaengine import compat
from gaengine.contract import (
    OPS,
    Backend,
    ContractError,
    FusedStep,
    Scale,
    check_accumulate_args,
    check_bucket_args,
    check_device_type,
    check_grad_tensor,
    check_partials_like,
    check_scale_args,
    register_bucket_kernel,
)

__all__ = ["Backend", "BACKEND_NAMES", "CompiledBackend", "ContractError", "EXTENSION_ABI_VERSION", "FusedStep", "OPS",
           "ReferenceBackend", "TritonBackend", "get_backend", "load_extension", "register_backend",
           "register_bucket_kernel"]

logger = logging.getLogger("gaengine")

# What this gaengine expects of gaengine._C: csrc/op_library.h's GAENGINE_ABI_VERSION, raised with it.
EXTENSION_ABI_VERSION = 7


def load_extension():
    """``(gaengine._C, None)`` when the compiled extension loads and was built from these sources, else
    ``(None, why)`` (a sentence): the one place gaengine looks for it. Lazy: ``import gaengine`` does not load the
    extension."""
    try:
        from gaengine import _C  # noqa: PLC0415
    except ImportError as exc:
        return None, (f"gaengine._C is not built ({exc}): build it with `make install` (or GAENGINE_BUILD_EXT=1 pip "
                      "install --no-build-isolation -e .)")
    why = extension_mismatch(_C)
    return (None, why) if why is not None else (_C, None)


def extension_mismatch(module) -> str | None:
    """Why ``module`` (``gaengine._C``, or the tests' emulated build of it) does not match this gaengine, or None:
    its ``ABI_VERSION`` (``csrc/op_library.h``) is not ``EXTENSION_ABI_VERSION``."""
    found = getattr(module, "ABI_VERSION", None)  # absent: a module built before the version was compiled in
    if found == EXTENSION_ABI_VERSION:
        return None
    return (f"{getattr(module, '__file__', module.__name__)} was built from other sources than this gaengine "
            f"(ABI_VERSION {found}, this gaengine needs {EXTENSION_ABI_VERSION}): rebuild it with `make install` "
            "(or pip install --no-build-isolation -e .)")


class _RegisteredBucketKernel:
    """What the native hooks need of a backend whose ``accumulate_bucket_`` is Python (``torch``, ``triton``):
    ``gaengine._C``'s ``HotPath``, which dispatches to that method registered as an op (the default
    ``Backend.hot_path_namespace``: ``register_bucket_kernel``)."""

    def extension(self):
        return load_extension()


# ------------------------------------------------------------------------------------------- the torch reference
def _fp32(scale: float) -> float:
    """A Python float scale as the contract takes it: its nearest fp32 value."""
    return float(scale) if float(scale) == 1.0 else torch.tensor(float(scale), dtype=torch.float32).item()


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


class RowPartials:
    """The partials layout of the reference and of the CPU kernels: ``(n_sources, 2)`` fp64 rows of (sum of squares,
    non-finite flag), one per source, finished by a fixed-order sum over the rows."""

    dim = 0  # the dimension that runs over the sources (Backend.partials_dim)

    def new(self, numels: Sequence[int], device: torch.device | str) -> torch.Tensor:
        return torch.empty(len(numels), 2, dtype=torch.float64, device=device)

    def check(self, table: torch.Tensor, numels: Sequence[int], device: torch.device, name: str) -> None:
        check_partials_like(table, (len(numels), 2), torch.float64, device, True, name)

    def finish(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sums = partials.sum(-2)
        return sums[..., 0].to(torch.float32), (sums[..., 1] > 0).to(torch.float32)


class ReferenceBackend(_RegisteredBucketKernel, Backend):
    """Plain PyTorch (``torch``): the reference every other backend is tested against, and the fallback. Any device;
    the native hooks call its ``accumulate_bucket_`` through ``register_bucket_kernel``."""

    name = "torch"
    partials_dim = RowPartials.dim
    _layout = RowPartials()

    def accumulate_(self, dst: torch.Tensor, src: torch.Tensor, scale: Scale = 1.0,
                    overwrite: bool = False) -> torch.Tensor:
        d, s = dst.view(-1), src.reshape(-1)
        if not isinstance(scale, torch.Tensor) and float(scale) == 1.0:
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
        return self._layout.new(numels, device)

    def accumulate_bucket_(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int],
                           overwrite: bool | Sequence[bool], partials: torch.Tensor | None = None,
                           source_partials: torch.Tensor | None = None) -> torch.Tensor:
        srcs = list(srcs)
        offsets, flags, numels = check_bucket_args(dst, srcs, offsets, overwrite)
        for name, table in (("partials", partials), ("source_partials", source_partials)):
            if table is not None:
                self._layout.check(table, numels, dst.device, name)
        flat = dst.view(-1)
        written = [flat.narrow(0, offset, src.numel()) for src, offset in zip(srcs, offsets)]
        for d, src, flag in zip(written, srcs, flags):
            ReferenceBackend.accumulate_(self, d, src, 1.0, flag)  # the one reference of "add a gradient"
        if partials is not None:
            _sumsq_rows(written, partials)
        if source_partials is not None:
            _sumsq_rows(srcs, source_partials)
        return dst

    def finish_norm_partials(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layout.finish(partials)


# -------------------------------------------------------------------------------------- the compiled extension
class ChunkPartials:
    """The partials layout of the CUDA bucket kernel: ``(2, n_chunks)`` fp32 columns of (sum of squares, non-finite
    flag), one per 4096-element chunk of each source (``torch.ops.gaengine.bucket_num_chunks``), finished by the
    fixed-order tree of ``torch.ops.gaengine.sum_partials``."""

    dim = 1  # the dimension that runs over the chunks (Backend.partials_dim)

    def __init__(self, ops) -> None:
        self._ops = ops

    def _shape(self, numels: Sequence[int]) -> tuple[int, int]:
        return 2, self._ops.bucket_num_chunks([int(n) for n in numels])

    def new(self, numels: Sequence[int], device: torch.device | str) -> torch.Tensor:
        return torch.empty(self._shape(numels), dtype=torch.float32, device=device)

    def check(self, table: torch.Tensor, numels: Sequence[int], device: torch.device, name: str) -> None:
        check_partials_like(table, self._shape(numels), torch.float32, device, False, name)

    def finish(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if partials.dim() == 2:
            return tuple(self._ops.sum_partials(partials))
        sums = [self._ops.sum_partials(table) for table in partials]  # a stack: one launch per table
        return torch.stack([s[0] for s in sums]), torch.stack([s[1] for s in sums])


class CompiledBackend(Backend):
    """The kernels of ``gaengine._C`` (``cpu``, ``cuda``), reached through the dispatcher: ``torch.ops.gaengine.*``
    runs the CPU kernel on CPU tensors (vectorized, ``at::parallel_for``) and the CUDA kernel on CUDA tensors.

    One instance per device type, each built by ``get_backend``: name and ``hot_path_kernels`` ``"cpu"`` or
    ``"cuda"``; module: the extension (``_C``; its ``OP_NAMESPACE`` names the ops); device_type: where its tensors
    live ("cuda"; "cpu" for the cpu backend, and for the cuda one over the tests' emulated build); layout: its bucket
    kernel's partials layout (``RowPartials`` on CPU, ``ChunkPartials`` on CUDA); problem: why its kernels cannot run
    now, or None (``kernels_problem``).

    Every argument is checked here, in Python, before the op: its ``TORCH_CHECK`` contracts are a second line only.
    Nothing here reads a tensor on the host (a 0-d CPU scale is read by the CPU kernel: a plain load, not a sync).
    """

    def __init__(self, name: str, module, device_type: str, layout: RowPartials | ChunkPartials,
                 problem: Callable[[], str | None] = lambda: None) -> None:
        self.name = self.hot_path_kernels = name
        self._C = module
        self._ops = getattr(torch.ops, module.OP_NAMESPACE)
        self._device_type = device_type
        self._layout = layout
        self.partials_dim = layout.dim
        self._problem = problem

    def accumulate_(self, dst, src, scale=1.0, overwrite=False):
        check_device_type(dst, "dst", self._device_type)
        check_device_type(src, "src", self._device_type)
        check_accumulate_args(dst, src, scale)  # same device, dtypes, numel; a tensor scale: 0-d fp32 on dst's
        if isinstance(scale, torch.Tensor):  # read by the kernel (on the device; on CPU a plain load)
            self._ops.accumulate_(dst, src.contiguous(), 1.0, bool(overwrite), scale)
        else:
            self._ops.accumulate_(dst, src.contiguous(), _fp32(scale), bool(overwrite))
        return dst

    def l2norm_sq(self, x):
        check_device_type(x, "x", self._device_type)
        check_grad_tensor(x)
        return tuple(self._ops.l2norm_sq(x.contiguous()))

    def scale_(self, x, coef):
        check_device_type(x, "x", self._device_type)
        check_scale_args(x, coef)
        # The kernels read coef as a float: the same rounding as torch's cast (inf for an out-of-range double).
        self._ops.scale_(x, coef if coef.dtype == torch.float32 else coef.to(torch.float32))
        return x

    def new_bucket_partials(self, numels, device):
        return self._layout.new(numels, device)

    def accumulate_bucket_(self, dst, srcs, offsets, overwrite, partials=None, source_partials=None):
        srcs = list(srcs)
        offsets, flags, numels = check_bucket_args(dst, srcs, offsets, overwrite, self._device_type)
        for name, table in (("partials", partials), ("source_partials", source_partials)):
            if table is not None:
                self._layout.check(table, numels, dst.device, name)
        self._ops.accumulate_bucket_(dst, srcs, offsets, flags, partials, source_partials)
        return dst

    def finish_norm_partials(self, partials):
        return self._layout.finish(partials)

    def optimizer_step(self, step: FusedStep):
        """The compiled module's kernel of ``step`` (looked up at each call, as the ops above): its own op when it has
        one (``step.op``: AdamW's ``adamw_step_``), else ``optimizer_step_(step.name, ...)`` (``csrc/optim/step.h``:
        the multi-tensor launcher over the functor of that name), its per-state lists flattened state-major as the op
        takes them. cpu: one parallel region per parameter; cuda: one launch per 384 parameters and dtype."""
        ops, namespace = self._ops, self._C.OP_NAMESPACE
        if step.op is not None:
            op = step.op

            def own_op(*args, **kwargs) -> None:
                getattr(ops, op)(*args, **kwargs)

            return own_op, f"torch.ops.{namespace}.{op}"
        name = step.name

        def launcher(params, grads, states, steps, model_params, hyper, grad_scale=None, found_inf=None) -> None:
            ops.optimizer_step_(name, params, grads, [t for state in states for t in state], steps, model_params,
                                hyper, grad_scale, found_inf)

        return launcher, f"torch.ops.{namespace}.optimizer_step_({name!r})"

    def kernels_problem(self):
        return self._problem()

    def extension(self):
        return self._C, None

    def hot_path_namespace(self, module) -> str:
        return module.OP_NAMESPACE  # the compiled kernels themselves


# ---------------------------------------------------------------------------------------------------- Triton
class TritonBackend(_RegisteredBucketKernel, Backend):
    """Triton kernels from ``gaengine.kernels``: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. The
    native hooks call its ``accumulate_bucket_`` through ``register_bucket_kernel`` (a Python launch per bucket)."""

    name = "triton"
    partials_dim = 1

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

    def new_bucket_partials(self, numels, device):
        return torch.empty(2, self._bucket.num_blocks(numels), dtype=torch.float32, device=device)

    def accumulate_bucket_(self, dst, srcs, offsets, overwrite, partials=None, source_partials=None):
        # gaengine.kernels.bucket checks every argument (ValueError) before it launches.
        return self._bucket.accumulate_bucket_(dst, srcs, offsets, 1.0, overwrite, partials=partials,
                                               source_partials=source_partials)

    def optimizer_step(self, step: FusedStep):
        """``gaengine.kernels.<step.name>.<step.name>_step_``: the optimizer's Triton kernel, one launch per
        parameter; ``RuntimeError`` naming it when there is none."""
        where = f"gaengine.kernels.{step.name}.{step.name}_step_"
        try:
            kernel = getattr(importlib.import_module(f"gaengine.kernels.{step.name}"), f"{step.name}_step_")
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(f"backend 'triton' has no kernel for the fused optimizer {step.name!r} ({where}: "
                               f"{exc}); use backend='torch' for its plain-torch step") from exc
        return kernel, where


# cudaDriverGetVersion()'s 1000 * major + 10 * minor of CUDA 12.1: the first driver that launches kernels with more
# than 4 KB of parameters, which the multi-tensor kernels pass (20.5 KB bucket, 27.7 KB AdamW; csrc/cuda/README.md).
MIN_CUDA_DRIVER = 12010


def _cuda_driver_version() -> int | None:
    """The CUDA version the installed driver supports, as ``cudaDriverGetVersion`` encodes it (12040 for 12.4),
    or ``None`` when this torch cannot say (a CPU build, or the query failed)."""
    query = compat.cuda_driver_version_query()
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
# kernels executed on CPU by the shim, registered under the CPU key of the build's own op namespace, CPU tensors
# standing in for CUDA ones). The cuda backend, and so the native hot path's kernels="cuda" and FusedAdamW on it,
# then takes its ops from it, on CPU tensors.
_EMULATED_CUDA_MODULE = None


def _cuda_device_type() -> str:
    """The device type of the cuda backend's tensors: "cuda" ("cpu" only under the test hook above)."""
    return "cuda" if _EMULATED_CUDA_MODULE is None else "cpu"


def _load_cuda_kernels():
    """``gaengine._C`` when its CUDA kernels can run in this process; else raises ``RuntimeError`` with the reason
    (``ImportError`` when the extension is not built or does not match). The driver is checked when a GPU is
    visible."""
    if _EMULATED_CUDA_MODULE is not None:
        why = extension_mismatch(_EMULATED_CUDA_MODULE)
        if why is not None:
            raise ImportError(why)
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
    if not _C.WITH_CUDA:
        raise RuntimeError("gaengine._C was built without its CUDA kernels; rebuild it against a CUDA torch with "
                           "CUDA_HOME set, both CUDA >= 12.1 (setup.py prints why it left them out)")
    return _C


def cuda_kernels_unusable() -> str | None:
    """Why the CUDA kernels of ``gaengine._C`` cannot run in this process, or ``None`` when they can.

    The one decision behind the ``cuda`` backend (it loads only when this is ``None``), so behind ``auto``'s choice
    on CUDA devices, the native hot path's bucket kernel (``gaengine.hot_path``) and ``FusedAdamW`` on CUDA tensors:
    a CPU-only torch, an extension without its CUDA kernels, or a CUDA driver older than 12.1
    (``cuda_driver_problem``).
    """
    try:
        _load_cuda_kernels()
    except (ImportError, RuntimeError) as exc:
        return str(exc)
    return None


def _cpu_backend() -> CompiledBackend:
    module, why = load_extension()
    if module is None:
        raise ImportError(why)
    return CompiledBackend("cpu", module, "cpu", RowPartials())


def _cuda_backend() -> CompiledBackend:
    module = _load_cuda_kernels()
    ops = getattr(torch.ops, module.OP_NAMESPACE)
    return CompiledBackend("cuda", module, _cuda_device_type(), ChunkPartials(ops), problem=cuda_kernels_unusable)


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_device_types() -> tuple[str, ...]:
    """CUDA tensors, and CPU ones under ``TRITON_INTERPRET=1``."""
    return ("cuda", "cpu") if _interpreter_on() else ("cuda",)


# ------------------------------------------------------------------------------------------------ the registry
class Registration(NamedTuple):
    """One backend as ``register_backend`` recorded it (its arguments)."""

    factory: Callable[[], Backend]
    device_types: tuple[str, ...] | Callable[[], tuple[str, ...]] | None
    auto_for: tuple[str, ...] | None
    auto_rank: int
    hint: str


_REGISTRY: dict[str, Registration] = {}
_instances: dict[str, Backend] = {}
_load_errors: dict[str, BaseException] = {}
_announced: set[tuple[str, str]] = set()


def register_backend(name: str, factory: Callable[[], Backend], *,
                     device_types: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
                     auto_for: tuple[str, ...] | None = (), auto_rank: int = 0, hint: str = "") -> None:
    """Register the backend ``name``: the one place a backend is added (gaengine's own four are registered below).

    name: what users pass as ``backend=`` (``GradientAccumulator``, ``FusedAdamW``, ``gaengine.ops``,
        ``GAENGINE_BACKEND``): a Python identifier (a Python backend's bucket kernel is registered as an op in the
        ``torch.library`` namespace ``gaengine_<name>``, ``register_bucket_kernel``), not ``"auto"``.
    factory: builds the ``Backend`` (``gaengine.contract``: the ops of ``OPS``, how the hooks drive it, and its fused
        optimizers' step kernels, ``Backend.optimizer_step``), whose ``name`` is ``name``; called once, at the first
        ``get_backend`` that needs it. An exception it raises is kept: ``get_backend(name)`` re-raises it as
        ``RuntimeError`` with the reason, and ``"auto"`` passes this backend by.
    device_types: the ``torch.device`` types its tensors live on, or a function of no arguments returning them (read
        at each ``get_backend``); None: any device. ``get_backend`` raises ``RuntimeError`` for another device,
        before loading it, with ``hint`` appended.
    auto_for: the device types on which ``"auto"`` may pick it (None: every one; default: none, so registering a
        backend changes no ``"auto"`` choice); among them the one with the highest ``auto_rank`` that loads and runs
        on the device (registration order breaks ties).

    Raises ``ValueError`` naming the argument for a name that is not an identifier, is ``"auto"`` or is already
    registered (nothing is registered then).
    """
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise ValueError(f"name must be a Python identifier other than 'auto' (it names the backend's op namespace), "
                         f"got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"name: a backend {name!r} is already registered; pick another name")
    if not callable(factory):
        raise ValueError(f"factory must be a callable returning the Backend, got {type(factory).__name__}")
    _REGISTRY[name] = Registration(factory, device_types, None if auto_for is None else tuple(auto_for),
                                   int(auto_rank), hint)


class _BackendNames(Sequence):
    """``BACKEND_NAMES``: ``"auto"`` and every registered backend's name, in registration order, read from the
    registry at each use (a backend registered later is in it)."""

    def _names(self) -> tuple[str, ...]:
        return ("auto", *_REGISTRY)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return 1 + len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(self._names())


BACKEND_NAMES: Sequence[str] = _BackendNames()
"""The names ``backend=`` takes: ``"auto"`` and every registered backend's (``register_backend``)."""

# gaengine's own backends: the reference anywhere (auto's last resort), the compiled kernels on their device type,
# Triton on CUDA after the compiled CUDA kernels.
register_backend("torch", ReferenceBackend, auto_for=None)
register_backend("cpu", _cpu_backend, device_types=("cpu",), auto_for=("cpu",), auto_rank=2)
register_backend("triton", TritonBackend, device_types=_triton_device_types, auto_for=("cuda",), auto_rank=1,
                 hint=" (CPU tensors need TRITON_INTERPRET=1)")
register_backend("cuda", _cuda_backend, device_types=lambda: (_cuda_device_type(),), auto_for=("cuda",),
                 auto_rank=2)


def _load(name: str) -> Backend | None:
    if name in _instances:
        return _instances[name]
    if name in _load_errors:
        return None
    try:
        _instances[name] = _REGISTRY[name].factory()
    except Exception as exc:  # kept and re-raised only when this backend is asked for by name
        _load_errors[name] = exc
        return None
    return _instances[name]


def _device_problem(name: str, device: torch.device) -> str | None:
    """Why the backend ``name`` cannot take tensors on ``device`` (its registered device types), or None."""
    entry = _REGISTRY[name]
    types = entry.device_types() if callable(entry.device_types) else entry.device_types
    if types is None or device.type in types:
        return None
    kinds = " or ".join("CPU" if t == "cpu" else t.upper() for t in types)
    return f"backend {name!r} runs on {kinds} tensors only, got device {device}{entry.hint}"


def _auto(device: torch.device) -> Backend:
    """``"auto"``'s backend for ``device``: the registered candidates for its type, highest ``auto_rank`` first,
    the first that runs there and loads; says which once (and why the first choice did not)."""
    candidates = sorted((n for n, r in _REGISTRY.items() if r.auto_for is None or device.type in r.auto_for),
                        key=lambda n: -_REGISTRY[n].auto_rank)
    candidates = [n for n in candidates if _device_problem(n, device) is None]
    chosen = next((n for n in candidates if _load(n) is not None), None)
    if chosen is None:
        raise RuntimeError(f"no backend loads for {device.type} tensors (tried {candidates}); pass backend= by name "
                           "to see why")
    preferred = candidates[0]
    if (device.type, chosen) not in _announced:
        _announced.add((device.type, chosen))
        why = "" if chosen == preferred else f" ({preferred} unavailable: {_load_errors.get(preferred)})"
        logger.info("gaengine: backend %r for %s tensors%s", chosen, device.type, why)
    return _instances[chosen]


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> Backend:
    """Return the backend ``name`` for tensors on ``device``.

    ``name``: one of ``BACKEND_NAMES``; ``"auto"`` reads ``GAENGINE_BACKEND`` first, then picks among the backends
    registered for ``device``'s type (``register_backend``'s ``auto_for``): ``cuda`` for CUDA devices when
    ``gaengine._C`` carries its CUDA kernels and the driver can launch them (``cuda_kernels_unusable``; the native hot
    path launches them from C++, ``gaengine.hot_path``), else ``triton``, and ``cpu`` for CPU ones, falling back to
    ``torch`` quietly (logged once).
    Raises ``ValueError`` for an unknown name and ``RuntimeError`` when a backend asked for by name cannot run on
    ``device`` (its registered device types) or cannot load (the original error is chained).
    """
    device = torch.device(device)
    if name == "auto":
        name = os.environ.get("GAENGINE_BACKEND", "auto") or "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        return _auto(device)
    problem = _device_problem(name, device)
    if problem is not None:
        raise RuntimeError(problem)
    backend = _load(name)
    if backend is None:
        raise RuntimeError(f"backend {name!r} could not be loaded: {_load_errors[name]}") from _load_errors[name]
    return backend
