"""``AccumulatorConfig``: every option of ``GradientAccumulator``, validated once.

``GradientAccumulator(model, optimizer, **options)`` builds one ``AccumulatorConfig(**options)`` (less
``lr_scheduler`` and ``process_group``, objects the accumulator works on rather than options) and keeps it as
``acc.config``. The dataclass is frozen and keyword-only (Megatron-Core's ``DistributedDataParallelConfig``,
torchtitan's job config): ``__post_init__`` checks each field and raises ``ValueError`` naming it and saying what it
accepts, so a bad value is refused before anything touches the model. Checks that need the model, the optimizer or
the process group (``zero_stage``'s optimizer, a sharded model, ``overlap_param_gather``'s ``nn.Module``) stay with
the accumulator.

The docstring under each field is its reference (``gaengine train --help`` shows its first paragraph:
``field_help``). ``metadata`` records what a command line needs besides the type of the default:
``choices`` (the accepted values), ``minimum`` (an int's lower bound) and ``positive`` (a float that must be > 0
where it is not None).

What changes during training is not here: ``acc.accumulation_steps`` (K of the current window: a schedule's
answer, or a value set with ``acc.accumulation_steps = K``) and ``acc.micro_batch_size`` start from the
config and are the accumulator's own; ``acc.config`` stays what was asked at construction.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from gaengine.backends import BACKEND_NAMES
from gaengine.noise import check_noise_scale_ema
from gaengine.scaler import DEFAULT_MIN_LOSS_SCALE, check_min_loss_scale
from gaengine.schedules import AccumulationSchedule, check_accumulation_steps
from gaengine.zero import ZERO_STAGES

__all__ = ["AccumulatorConfig", "CheckedSetting", "check_max_grad_norm", "check_optional_count", "field_help"]

_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class AccumulatorConfig:
    """The options of one ``GradientAccumulator``; ``ValueError`` naming the field for a bad value."""

    accumulation_steps: int | AccumulationSchedule = field(default=8, metadata={"minimum": 1})
    """K, micro-batches per optimizer update (the accumulation window).

    An int >= 1, or a schedule ``(update_index, items_seen) -> K`` called at the start of every window
    (``gaengine.schedules``: ``RampUp``, ``Milestones``, ``Adaptive``, or any callable; ``update_index``: windows
    stepped so far; ``items_seen``: the samples they consumed over all ranks, ``micro_batch_size`` x micro-batches x
    world size, or micro-batches x world size without ``micro_batch_size``). Default 8. ``acc.accumulation_steps`` is
    the current window's K; every window is normalized by the micro-batches it holds, so each is the exact mean of
    its own effective batch. A schedule that follows the gradient noise scale (``needs_noise_scale``) needs
    ``measure_noise_scale=True``. ``ValueError`` naming ``accumulation_steps`` for anything else (a bool, a float, a
    string)."""

    max_grad_norm: float | None = field(default=1.0, metadata={"positive": True})
    """Clip the L2 norm of the normalized gradient to this; None disables clipping.

    A positive finite float, in the gradient's units, applied after dividing by the window's denominator
    (micro-batches, or items). Default 1.0 (Megatron-LM's ``--clip-grad`` and HF Trainer's default): gaengine clips
    unless told not to. ``ValueError`` naming ``max_grad_norm`` for 0, a negative, NaN, inf or a non-number."""

    backend: str = field(default="auto", metadata={"choices": BACKEND_NAMES})
    """The backend that runs the accumulate, norm and scale kernels.

    One of ``gaengine.backends.BACKEND_NAMES``: "auto" (default; reads ``GAENGINE_BACKEND``, then picks ``cuda``
    or ``triton`` for CUDA parameters and ``cpu`` or ``torch`` for CPU ones), "torch", "cpu", "triton", "cuda"
    (``gaengine.backends``), or a backend registered with ``gaengine.backends.register_backend``. The per-parameter hooks are native (``gaengine._C``, ``gaengine.hot_path``) for every
    backend: "triton" and "torch" run their bucket kernel from them, once per complete bucket (``gaengine.hooks``), so
    every backend needs the compiled extension. A backend asked for by name that cannot load raises ``RuntimeError``
    at construction; an unknown name ``ValueError`` naming ``backend``."""

    master_weights: bool = True
    """Keep fp32 master weights for bf16/fp16 parameters (4 B/param; the optimizer and its state work in fp32).

    Default True (Megatron-Core's and DeepSpeed's mixed-precision optimizers). False: the optimizer updates the
    low-precision parameters in place with its state in their dtype, as torch's optimizers keep it (8 instead of 16
    B/param of gradient and AdamW state). With ``gaengine.optim.FusedAdamW`` that is one pass per parameter: it reads
    the fp32 main_grad view (as ``p.main_grad``) with normalization and clipping as its ``grad_scale`` and the skip as
    ``found_inf``, computes in fp32 and rounds p, m, v to their dtype (16 B/param, no host sync). With a torch
    optimizer, at ``step()`` one fp32 pass normalizes and clips the buffer, and each parameter gets it rounded once
    to its dtype (a transient copy, 2 B/param while the optimizer runs). Accumulation stays fp32 either way.
    ``ValueError`` naming ``master_weights`` unless a bool."""

    bucket_size_mb: float = 25.0
    """MiB of fp32 gradient per all-reduce (or reduce-scatter) bucket.

    A positive number; default 25, torch DDP's ``bucket_cap_mb``. ``ValueError`` naming ``bucket_size_mb``
    otherwise."""

    reduce_dtype: torch.dtype = torch.float32
    """The dtype gradients travel in across ranks: torch.float32 (default), torch.bfloat16 or torch.float16.

    bf16 halves the bytes on the wire; the sum is accumulated in fp32 either way. ``ValueError`` naming
    ``reduce_dtype`` for another dtype (or a string: pass the ``torch.dtype``)."""

    broadcast_buffers: bool = True
    """Broadcast the model's buffers from the group's first rank at construction, with the parameters.

    Several ranks only; default True (torch DDP's ``broadcast_buffers``). ``ValueError`` naming
    ``broadcast_buffers`` unless a bool."""

    loss_scale: str | float | None = "auto"
    """Loss scaling: "auto", "dynamic", a fixed positive float, or None.

    "auto" (default): dynamic when a parameter is fp16 or a backward runs under ``torch.autocast(dtype=
    torch.float16)``, else none. "dynamic": ``torch.amp.GradScaler``'s defaults (2^16 start, x2 every 2000 clean
    windows, /2 on overflow), updated on the device. The loss is multiplied by the scale in ``backward``; the inverse
    scale is folded into the step's single coefficient.
    ``ValueError`` naming ``loss_scale`` for another string, a bool, 0, a negative or a non-finite float."""

    min_loss_scale: float = DEFAULT_MIN_LOSS_SCALE
    """The dynamic loss scale's floor: a back-off that reaches it makes ``step()`` raise ``RuntimeError``.

    A positive finite float; default 1.0, DeepSpeed's ``min_loss_scale``. A back-off that reaches it holds the scale
    there and makes ``step()`` raise ``RuntimeError`` naming the likely causes (a loss already scaled by
    ``torch.amp.GradScaler``; a diverged model): a scale that keeps falling skips every update silently otherwise.
    Read without a host sync (on CUDA one window late). ``ValueError`` naming ``min_loss_scale`` otherwise."""

    batchnorm: str | None = field(default=None, metadata={"choices": (None, "window")})
    """BatchNorm over a window: None (warn once when the model has BatchNorm layers and K > 1) or "window".

    "window": the running statistics are updated once per window from the combined micro-batch statistics
    (``gaengine.batchnorm``). ``ValueError`` naming ``batchnorm`` for anything else."""

    max_consecutive_skips: int | None = field(default=None, metadata={"minimum": 1})
    """Raise ``RuntimeError`` after this many skipped (non-finite) updates in a row; None: never (default).

    An int >= 1. The error names the loss scale and the parameters with non-finite gradients; it costs one host
    read of the skip flag per update. ``ValueError`` naming ``max_consecutive_skips`` otherwise."""

    micro_batch_size: int | None = field(default=None, metadata={"minimum": 1})
    """Samples per micro-batch, when fixed (enables ``acc.effective_batch_size``).

    An int >= 1, or None (default); a schedule's ``items_seen`` counts micro-batches x world size without it.
    ``acc.micro_batch_size`` starts from it and may be changed during training
    (``gaengine train --auto-micro-batch`` halves it). ``ValueError`` naming ``micro_batch_size`` otherwise."""

    measure_noise_scale: bool = False
    """Measure the gradient noise scale B_simple (McCandlish et al. 2018) at every update (``gaengine.noise``).

    Default False. True: each micro-batch's accumulate also writes the squared norm of its incoming gradient
    (same pass, no extra launch, no Python per parameter) and ``step()`` reports ``grad_noise_scale``,
    ``noise_trace_sigma`` and ``noise_grad_sq`` in ``StepResult`` (0-d fp32 device tensors, no host sync). A window
    of one micro-batch on one rank cannot be measured (there is no small batch besides the big one). ``ValueError``
    naming ``measure_noise_scale`` unless a bool."""

    noise_scale_ema: float = 0.95
    """Decay of the noise scale's two moving averages, a float in (0, 1); default 0.95.

    Bias-corrected as Adam's moments, so the first window reports its own estimate. ``ValueError`` naming
    ``noise_scale_ema`` otherwise (checked whether or not ``measure_noise_scale`` is on)."""

    zero_stage: int = field(default=0, metadata={"choices": ZERO_STAGES})
    """ZeRO stage: 0 holds everything on every rank, 1 shards the fp32 masters and optimizer state, 2 also the gradient.

    Default 0. Several ranks only (``gaengine.zero``, docs/sharding.md); a world of one accepts it and shards
    nothing. 1: the fp32 master weights and the optimizer state are sharded over the d ranks of ``process_group``
    (12/d B/param with AdamW and masters); main_grad still accumulates the window locally and the last micro-batch
    reduce-scatters each bucket as it completes (the bytes of stage 0's all-reduce, counting the all-gather of the
    parameters after the update). 2: the fp32 gradient sum is sharded too (4/d B/param): every micro-batch's buckets
    are reduce-scattered (in ``reduce_dtype``) and added into the rank's fp32 shard, K reductions per window instead
    of one: it trades communication for memory. Each micro-batch's buckets are staged in a ring of
    ``gaengine.zero.STAGING_SLOTS`` bucket-sized fp32 buffers (S x ``bucket_size_mb``; no full-size main_grad; the
    first window, which learns the layout, stages all its buckets at once). Needs an optimizer with no state yet (the
    accumulator checks it): an elementwise one (``gaengine.optimizers.OPTIMIZERS``) updates even flat ranges, any
    other (Muon, Adafactor, ...) whole parameters on owner ranks (``gaengine.zero.WholeOwners``); the layout is not
    re-learned from the first window. ``ValueError`` naming ``zero_stage`` for another value, no optimizer or one
    with state."""

    overlap_param_gather: bool = False
    """With ``zero_stage`` >= 1, leave the parameters' all-gather in flight after ``step()``.

    A forward pre-hook on each module waits for the buckets of its own parameters, so the gather overlaps the next
    forward (Megatron-Core's name). Default False. ``ValueError`` naming ``overlap_param_gather`` unless a bool, or
    when True with ``zero_stage=0``; the accumulator also needs ``model`` as an ``nn.Module``."""

    overlap_grad_reduce: bool = True
    """Launch each bucket's reduction during the last micro-batch's backward, as soon as the bucket is complete.

    Default True (Megatron-Core's ``overlap_grad_reduce``, torch DDP's behaviour). False: every bucket is reduced
    after backward, one after another (what the benchmarks time as the serial baseline; the numbers are the same).
    Several ranks only. ``ValueError`` naming ``overlap_grad_reduce`` unless a bool."""

    gradient_accumulation_fusion: bool = False
    """Compute each ``torch.nn.Linear``'s weight and bias gradients straight into the fp32 main_grad (Megatron's name).

    Default False. True: the forward of every ``torch.nn.Linear`` of the model (the same module objects;
    ``acc.close()`` restores their forwards) runs the op ``torch.ops.gaengine.fused_linear``, whose backward (C++, no
    Python per layer) computes dX as usual and writes (first contribution of the window) or adds dW = dY^T X and the
    bias gradient into the parameter's main_grad slice with one fp32 GEMM: no bf16/fp16 weight gradient is
    materialized (saves its memory and 4 of 12 B per weight element and micro-batch), and each micro-batch's dW is
    exact to fp32 rounding instead of rounded to the parameter's dtype (``gaengine.fusion``, docs/fusion.md). Needs
    ``model`` as an ``nn.Module`` with its parameters on the CPU (the C++ kernel) or on CUDA (one ``cublasGemmEx``;
    a build without cuBLAS's headers launches the Triton kernel ``gaengine.kernels.wgrad`` from Python once per
    Linear in backward, and needs triton) and the native hooks. Under ``torch.autocast`` the GEMM operands are
    autocast's casts. With ``measure_noise_scale`` each micro-batch's fused gradient is first written into an fp32
    tensor of the weight's shape, held like an arriving gradient until its bucket adds it (the noise scale needs its
    norm, which a GEMM adding into main_grad does not give): exact as the fused path, but it materializes an fp32
    weight gradient per micro-batch. ``ValueError`` naming ``gradient_accumulation_fusion`` unless a bool, with
    ``zero_stage`` > 0 (the sharded gradient cannot take a full-size GEMM output), and where the accumulator cannot
    fuse (an FSDP2 model, CUDA parameters without a CUDA kernel and without triton, the ``torch`` or
    ``triton`` backend)."""

    def __post_init__(self) -> None:
        for name in ("master_weights", "broadcast_buffers", "measure_noise_scale", "overlap_param_gather",
                     "overlap_grad_reduce", "gradient_accumulation_fusion"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        steps = self.accumulation_steps
        if not callable(steps):
            check_accumulation_steps(steps)
        elif getattr(steps, "needs_noise_scale", False) and not self.measure_noise_scale:
            raise ValueError(f"accumulation_steps={steps!r} follows the gradient noise scale: build the "
                             "accumulator with measure_noise_scale=True")
        self._set("max_grad_norm", check_max_grad_norm(self.max_grad_norm))
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        size = self.bucket_size_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not (size > 0 and math.isfinite(size)):
            raise ValueError(f"bucket_size_mb must be a positive number (MiB of fp32 gradient), got {size!r}")
        self._set("bucket_size_mb", float(size))
        if not isinstance(self.reduce_dtype, torch.dtype) or self.reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {self.reduce_dtype!r}")
        scale = self.loss_scale
        if not (scale in ("auto", "dynamic", None) or (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                                       and math.isfinite(scale) and scale > 0)):
            raise ValueError(f"loss_scale must be 'auto', 'dynamic', a positive float or None, got {scale!r}")
        self._set("min_loss_scale", check_min_loss_scale(self.min_loss_scale))
        if self.batchnorm not in (None, "window"):
            raise ValueError(f"batchnorm must be None or 'window', got {self.batchnorm!r}")
        for name in ("max_consecutive_skips", "micro_batch_size"):
            check_optional_count(name, getattr(self, name))
        self._set("noise_scale_ema", check_noise_scale_ema(self.noise_scale_ema))
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {self.zero_stage!r}")
        if self.overlap_param_gather and self.zero_stage == 0:
            raise ValueError("overlap_param_gather=True needs zero_stage=1 or 2 (it overlaps the all-gather of the "
                             "sharded update with the next forward); got zero_stage=0: drop overlap_param_gather or "
                             "set zero_stage")
        if self.gradient_accumulation_fusion and self.zero_stage != 0:
            raise ValueError(f"gradient_accumulation_fusion=True is not supported with zero_stage={self.zero_stage}: "
                             "the fused GEMM writes a full-size fp32 weight gradient into main_grad, which a sharded "
                             "gradient does not hold; use zero_stage=0 or gradient_accumulation_fusion=False")

    @classmethod
    def from_options(cls, owner: str = "GradientAccumulator", **options: Any) -> AccumulatorConfig:
        """The config of ``owner(..., **options)``: ``TypeError`` naming an unknown keyword and listing the fields
        (Python's own error would name this dataclass, not the call the user wrote)."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}; its options are the fields "
                            f"of gaengine.AccumulatorConfig: {', '.join(names)}")
        return cls(**options)

    def _set(self, name: str, value: Any) -> None:
        """Store the normalized value of a checked field (e.g. ``max_grad_norm=1`` as ``1.0``)."""
        object.__setattr__(self, name, value)

    def rank_settings(self, named_params: list[tuple[str, torch.Tensor]], backend: Any) -> dict[str, Any]:
        """What every rank's accumulator must agree on (``gaengine.reduce.check_ranks_agree``): the trainable
        parameters' names, shapes and dtypes in order, and the options that shape the collectives or the update."""
        steps = self.accumulation_steps
        return {
            "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in named_params if p.requires_grad],
            "accumulation_steps": steps if isinstance(steps, int) else type(steps).__qualname__,
            "max_grad_norm": self.max_grad_norm, "bucket_size_mb": self.bucket_size_mb,
            "zero_stage": self.zero_stage, "reduce_dtype": str(self.reduce_dtype), "loss_scale": self.loss_scale,
            "min_loss_scale": self.min_loss_scale, "master_weights": self.master_weights,
            "backend": getattr(backend, "name", type(backend).__name__),
        }

    def as_kwargs(self) -> dict[str, Any]:
        """The keywords that rebuild this config: ``GradientAccumulator(model, optimizer, **config.as_kwargs())``
        (the values themselves, not copies: a schedule stays the same object)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_optional_count(name: str, value: Any) -> int | None:
    """``value`` of the field ``name`` (``max_consecutive_skips``, ``micro_batch_size``): None or an int >= 1;
    ``ValueError`` naming ``name`` otherwise. Also checks ``acc.micro_batch_size = ...`` (the same message)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    return value


def check_max_grad_norm(value: Any) -> float | None:
    """``max_grad_norm`` as a float, or None (no clipping); ``ValueError`` naming it for 0, a negative, NaN, inf, a
    bool or a non-number. Also checks ``acc.max_grad_norm = ...`` (the same message)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)):  # float("1") would take it: a number is expected, not its text
        raise ValueError(f"max_grad_norm must be a positive finite float or None, got the string {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"max_grad_norm must be a positive finite float or None, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
        raise ValueError(f"max_grad_norm must be a positive finite float or None (no clipping), got {value!r}")
    return number


@functools.cache
def _field_docs() -> dict[str, str]:
    """The docstring under each field of ``AccumulatorConfig``, read from this module's source."""
    tree = ast.parse(inspect.getsource(AccumulatorConfig))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_help(name: str, full: bool = False) -> str:
    """The docstring of field ``name`` of ``AccumulatorConfig``: its first paragraph (a command line's help), or
    all of it (``full``), on one line each paragraph, with the reST quotes removed. ``KeyError`` for no such field."""
    paragraphs = _field_docs()[name].split("\n\n")
    text = paragraphs if full else paragraphs[:1]
    return "\n\n".join(" ".join(p.split()).replace("``", "") for p in text)


class CheckedSetting:
    """One of the accumulator's own settings (``GradientAccumulator.max_grad_norm``, ...), a data descriptor checked on
    assignment with the constructor's check and message: a bad value is refused where it is set (``ValueError`` naming
    it, the value kept), not at the next ``step()``. check: value -> the checked value (raises); then: called as
    ``then(obj, value)`` after a set (e.g. to pass the value on to a stage), or None."""

    def __init__(self, check: Callable[[Any], Any], doc: str, then: Callable[[Any, Any], None] | None = None) -> None:
        self.check, self.then, self.__doc__ = check, then, doc
        self.attr = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        value = self.check(value)
        setattr(obj, self.attr, value)
        if self.then is not None:
            self.then(obj, value)
