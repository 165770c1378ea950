"""The ``backend`` fixture every operation test in ``tests/ops/`` is parametrized over, and the per-backend adapters.

One test file per operation (``test_accumulate.py``, ``test_accumulate_bucket.py``, ``test_l2norm.py``,
``test_scale.py``, ``test_adamw.py``); each case runs on every backend available here against the fp64 oracle of
``tests/reference.py`` with the one budget of ``tests/tolerances.py`` (the same for every backend):

* ``torch``: ``gaengine.backends`` ``ReferenceBackend`` (plain PyTorch), CPU tensors;
* ``cpu``: the compiled ``gaengine._C`` (skipped when it is not built);
* ``triton``: ``gaengine.kernels`` on CUDA tensors with a GPU, else on CPU tensors under ``TRITON_INTERPRET=1``
  (``tests/conftest.py``); slow there, so its cases keep the sizes the Triton kernel tests used
  (``INTERPRETER_MAX_NUMEL``);
* ``cuda-emu``: the ``cuda`` backend over the emulated build of ``gaengine._C`` (``tests/cuda_emu/engine.py``:
  ``csrc/cuda``'s kernels executed on CPU tensors; built once per session, about 75 s, cached under ``build/``);
  skipped when there is no C++ compiler;
* ``cuda-gpu``: the ``cuda`` backend on a GPU (``pytest.mark.cuda``: skipped without one).

Parametrize ids never say just ``cuda``: ``tests/conftest.py`` skips items with a ``cuda`` keyword without a GPU.

The ``Backend`` interface (``gaengine/contract.py``) has ``accumulate_``, ``l2norm_sq``, ``scale_``,
``accumulate_bucket_``, ``new_bucket_partials`` and ``finish_norm_partials``; the tests call those on
``backend.ops``. ``OpBackend.accumulate_bucket_`` adds a scale (the torch reference: one ``accumulate_`` per source;
triton: its kernel with small blocks). ``OpBackend.adamw_step_`` is the AdamW kernel of the same family, which is not
a backend op: ``gaengine.optim.adamw_kernel``'s choice (the backend's ``optimizer_step(FusedAdamW.STEP)``; triton: its
kernel, called with small blocks).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import pytest
import torch

from tests.conftest import backend_params

HAS_GPU = torch.cuda.is_available()
TRITON_DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
# Sizes the slow backends run (larger cases skip there): the Triton interpreter, and the emulated CUDA kernels
# (fibers with real barriers). Today's sizes of the per-implementation files they came from.
INTERPRETER_MAX_NUMEL = 3 * 4096 + 5
EMULATION_MAX_NUMEL = 70 * 4096 + 3



@dataclasses.dataclass
class OpBackend:
    """One backend as the op tests see it.

    name: the parametrize id. device: where its tensors live. ops: the ``gaengine.backends.Backend``.
    max_numel: the largest tensor its cases run (None: any). bucket_scale: its bucket op takes a scale.
    partials_layout: "rows" (``(n_sources, 2)`` fp64 per source: torch, cpu) or "columns" (``(2, n_chunks)``
    fp32 per chunk: triton, cuda), what its bucket op writes and ``ops.finish_norm_partials`` finishes.
    """

    name: str
    device: torch.device
    ops: Any
    public_name: str = ""  # the name gaengine.ops and get_backend take ("cuda" for both cuda backends)
    max_numel: int | None = None
    bucket_scale: bool = True
    partials_layout: str = "rows"
    _bucket: Callable | None = None
    _num_partials: Callable | None = None
    _adamw: Callable | None = None

    def __post_init__(self) -> None:
        self.public_name = self.public_name or self.name

    def __repr__(self) -> str:
        return f"OpBackend({self.name})"

    def require(self, n: int) -> None:
        """Skip the calling case when ``n`` elements are past what this backend runs at test speed."""
        if self.max_numel is not None and n > self.max_numel:
            pytest.skip(f"{self.name}: n={n} is past its test size ({self.max_numel}), covered on the fast backends")

    # -- the bucket accumulate ------------------------------------------------------------------------------
    def num_partials(self, numels) -> int:
        """Rows (``rows`` layout) or columns (``columns``) of the partials of one bucket of these numels."""
        return self._num_partials([int(n) for n in numels])

    def new_partials(self, count: int) -> torch.Tensor:
        """A NaN-poisoned partials table of ``count`` entries in this backend's layout."""
        if self.partials_layout == "rows":
            return torch.full((count, 2), float("nan"), dtype=torch.float64, device=self.device)
        return torch.full((2, count), float("nan"), dtype=torch.float32, device=self.device)

    def partials_slice(self, table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return table[start:stop] if self.partials_layout == "rows" else table[:, start:stop]

    def non_finite_flags(self, partials: torch.Tensor) -> torch.Tensor:
        return partials[:, 1] if self.partials_layout == "rows" else partials[1]

    def accumulate_bucket_(self, dst, srcs, offsets, overwrite, scale=1.0, partials=None):
        """``dst[o_i:o_i + n_i] = (0 if overwrite[i] else dst[...]) + srcs[i] * scale`` for every ``i``, writing
        ``partials`` (``new_partials(num_partials(numels))`` or a slice of a larger table) when given."""
        if not (isinstance(scale, float) and scale == 1.0) and not self.bucket_scale:
            pytest.skip(f"{self.name}: its bucket op takes no scale")
        self._bucket(dst, list(srcs), [int(o) for o in offsets], [bool(w) for w in overwrite], scale, partials)
        return dst

    # -- the multi-tensor AdamW step -------------------------------------------------------------------------
    def adamw_step_(self, *args, **kwargs):
        """The AdamW kernel of this backend's family (``gaengine.optim.adamw_kernel``), called as
        ``adamw_step_(*AdamWStep(...))`` (``gaengine.contract.AdamWStep``)."""
        return self._adamw(*args, **kwargs)


def _torch_bucket(ops):
    def bucket(dst, srcs, offsets, overwrite, scale, partials):
        if isinstance(scale, float) and scale == 1.0:
            ops.accumulate_bucket_(dst, srcs, offsets, overwrite, partials)
            return
        assert partials is None, "the bucket op takes no scale: a scaled bucket is one accumulate_ per source"
        for src, o, w in zip(srcs, offsets, overwrite):
            ops.accumulate_(dst.view(-1)[o:o + src.numel()], src, scale, w)
    return bucket


def _torch_backend() -> OpBackend:
    from gaengine.backends import get_backend  # noqa: PLC0415
    from gaengine.optim import adamw_kernel  # noqa: PLC0415

    ops = get_backend("torch", "cpu")
    return OpBackend("torch", torch.device("cpu"), ops, _bucket=_torch_bucket(ops), _num_partials=len,
                     _adamw=adamw_kernel("torch", "cpu"))


def _cpu_backend() -> OpBackend:
    pytest.importorskip("gaengine._C", reason="gaengine._C is not built (pip install --no-build-isolation -e .)")
    from gaengine.backends import get_backend  # noqa: PLC0415
    from gaengine.optim import adamw_kernel  # noqa: PLC0415

    ops = get_backend("cpu")

    def bucket(dst, srcs, offsets, overwrite, scale, partials):
        ops.accumulate_bucket_(dst, srcs, offsets, overwrite, partials)

    return OpBackend("cpu", torch.device("cpu"), ops, bucket_scale=False, _bucket=bucket, _num_partials=len,
                     _adamw=adamw_kernel("cpu", "cpu"))


TRITON_BUCKET_BLOCK = 128  # small blocks: many programs, full chunks and tails, at interpreter speed
TRITON_ADAMW_BLOCK = 512


def _triton_backend() -> OpBackend:
    pytest.importorskip("triton")
    if not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    if not HAS_GPU:
        # The norm's finalize kernel and the bucket kernel's tail chunk loop to a runtime argument: where the
        # interpreter cannot (tests/ops/interpreter_probe.py: Triton 3.5, torch 2.9's, with NumPy >= 2.4), no case
        # of this backend is run rather than a few that reach no such loop.
        from tests.ops.interpreter_probe import interpreter_scalar_loop_error  # noqa: PLC0415

        error = interpreter_scalar_loop_error()
        if error is not None:
            pytest.skip(f"{error}; a GPU compiles the kernels and never meets it. To run these cases under the "
                        "interpreter: pip install 'numpy<2.4', or a Triton >= 3.8")
    from gaengine.backends import get_backend  # noqa: PLC0415
    from gaengine.kernels import bucket as bucket_kernels  # noqa: PLC0415
    from gaengine.optim import adamw_kernel  # noqa: PLC0415

    ops = get_backend("triton", TRITON_DEVICE)
    adamw = adamw_kernel("triton", TRITON_DEVICE)

    def bucket(dst, srcs, offsets, overwrite, scale, partials):
        bucket_kernels.accumulate_bucket_(dst, srcs, offsets, scale, overwrite, partials=partials,
                                          block_size=TRITON_BUCKET_BLOCK)

    def adamw_step(*args, **kwargs):
        adamw.step(*args, block_size=TRITON_ADAMW_BLOCK, **kwargs)

    return OpBackend("triton", TRITON_DEVICE, ops, max_numel=None if HAS_GPU else INTERPRETER_MAX_NUMEL,
                     partials_layout="columns", _bucket=bucket,
                     _num_partials=lambda numels: bucket_kernels.num_blocks(numels, TRITON_BUCKET_BLOCK),
                     _adamw=adamw_step)


def _cuda_backend(name: str, device: torch.device, max_numel: int | None) -> OpBackend:
    from gaengine.backends import get_backend  # noqa: PLC0415
    from gaengine.optim import adamw_kernel  # noqa: PLC0415

    ops = get_backend("cuda", device)
    C = getattr(torch.ops, ops._C.OP_NAMESPACE)

    def bucket(dst, srcs, offsets, overwrite, scale, partials):
        ops.accumulate_bucket_(dst, srcs, offsets, overwrite, partials)

    return OpBackend(name, device, ops, public_name="cuda", max_numel=max_numel, bucket_scale=False,
                     partials_layout="columns",
                     _bucket=bucket, _num_partials=C.bucket_num_chunks, _adamw=adamw_kernel("cuda", device))


def _registered_backend(name: str) -> OpBackend:
    """A backend of ``tests/conftest.py``'s list without a builder of its own here (one registered with
    ``gaengine.backends.register_backend``): its ``Backend`` as it is, on CPU tensors, its bucket op unscaled, its
    partials layout read from its ``partials_dim`` and its AdamW kernel the one it gives (``adamw_kernel``)."""
    from gaengine.backends import get_backend  # noqa: PLC0415
    from gaengine.optim import adamw_kernel  # noqa: PLC0415

    device = torch.device("cpu")
    ops = get_backend(name, device)

    def bucket(dst, srcs, offsets, overwrite, scale, partials):
        ops.accumulate_bucket_(dst, srcs, offsets, overwrite, partials)

    def num_partials(numels):
        return ops.new_bucket_partials(numels, device).shape[ops.partials_dim]

    return OpBackend(name, device, ops, bucket_scale=False, partials_layout="rows" if ops.partials_dim == 0 else
                     "columns", _bucket=bucket, _num_partials=num_partials, _adamw=adamw_kernel(name, device))


BACKEND_PARAMS = backend_params()  # tests/conftest.py's list of the backends that exist here


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request) -> OpBackend:
    """Every backend available here (see the module docstring), as an ``OpBackend``."""
    name = request.param
    if name == "torch":
        return _torch_backend()
    if name == "cpu":
        return _cpu_backend()
    if name == "triton":
        return _triton_backend()
    if name == "cuda-emu":
        emu_engine, module = request.getfixturevalue("emulated_cuda_module")
        emu_engine.use(request.getfixturevalue("monkeypatch"), module)
        return _cuda_backend("cuda-emu", torch.device("cpu"), EMULATION_MAX_NUMEL)
    if name == "cuda-gpu":
        return _cuda_backend("cuda-gpu", torch.device("cuda"), None)
    return _registered_backend(name)


# --- inputs shared by the op files ----------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_PARAMS = [pytest.param(dt, id=name) for name, dt in DTYPES.items()]


def grad_like(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(n,) gradient-like values in ``dtype`` of mixed magnitudes (five decades, so adds round), on ``device``."""
    return (torch.randn(n) * torch.logspace(-3, 2, n)).to(dtype).to(device)


def main_grad(n: int, device) -> torch.Tensor:
    return (torch.randn(n) * 10).to(device)


def poisoned(n: int, device) -> torch.Tensor:
    """An fp32 buffer full of NaN: a slot the kernel forgets to write (or reads when it should not) shows up."""
    return torch.full((n,), float("nan"), dtype=torch.float32, device=device)


def at_offset(values: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``values`` starting ``offset`` elements into its allocation (offset 1: not 16-byte aligned)."""
    buf = torch.empty(values.numel() + offset, dtype=values.dtype, device=values.device)
    buf[offset:] = values.reshape(-1)
    return buf[offset:]
