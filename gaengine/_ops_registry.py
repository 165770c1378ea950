"""Fake (meta) implementations of the ``torch.library`` ops of ``gaengine._C``, so ``torch.compile`` can trace them.

The ops (schemas in ``csrc/op_library.h`` and ``csrc/adamw.h``, kernels per device in ``csrc/module.cpp`` (CPU) and
``csrc/cuda/cuda_ops.cu`` (CUDA)) are ``torch.ops.gaengine.*``; ``gaengine._C`` calls ``register_fakes`` when it
loads (the emulated build of ``tests/cuda_emu`` with its own namespace). A fake implementation allocates the
outputs' shapes and dtypes and writes nothing: the mutating ops return nothing, ``l2norm_sq`` and ``sum_partials``
(a CUDA build's) two 0-d fp32 tensors on their argument's device. Imports only torch.
"""

from __future__ import annotations

import torch

__all__ = ["register_fakes"]

_registered: set[str] = set()


def register_fakes(namespace: str = "gaengine", with_cuda: bool = False) -> None:
    """Register the fake implementations of ``torch.ops.<namespace>.*`` (with_cuda: also of the ops only a CUDA build
    defines); a second call for a namespace does nothing."""
    if namespace in _registered:
        return
    _registered.add(namespace)

    def _mutates_only(*args, **kwargs):  # writes its (a!) arguments in place: no outputs to allocate
        return None

    for op in ("accumulate_", "scale_", "accumulate_bucket_", "adamw_step_", "optimizer_step_", "wgrad_accumulate_"):
        torch.library.register_fake(f"{namespace}::{op}", _mutates_only)

    @torch.library.register_fake(f"{namespace}::l2norm_sq")
    def _l2norm_sq_fake(x):
        return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)

    if with_cuda:
        @torch.library.register_fake(f"{namespace}::sum_partials")
        def _sum_partials_fake(partials):
            return partials.new_empty((), dtype=torch.float32), partials.new_empty((), dtype=torch.float32)
