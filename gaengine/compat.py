"""What differs between the torch versions gaengine supports, and torch internals it reads, in one place.

Each function looks the name up when it is called (a test that wraps ``torch.distributed.reduce_scatter_single``
to count bytes sees gaengine's calls):

* ``reduce_scatter_single``/``all_gather_single``: the flat-tensor collectives, under their torch >= 2.10 names,
  else the older ``reduce_scatter_tensor``/``all_gather_into_tensor`` (same signature).
* ``composable_apis``: the ``torch.distributed._composable`` APIs applied to a module (``fully_shard``,
  ``replicate``, ...), read from its private registry.
* ``fsdp_param_groups``: an FSDP2 state's parameter groups (a list on torch >= 2.12, one group or None before).
* ``has_grad_dtype``: whether tensors take ``grad_dtype`` (autograd accumulating a bf16 parameter's gradient in
  fp32; torch >= 2.10), what the benchmarks' torch-native fp32 recipe needs.
* ``cuda_driver_version_query``: torch's private ``cudaDriverGetVersion`` (CUDA builds only), and
  ``fsdp_module_class``: FSDP2's ``FSDPModule`` (None where this torch has no ``torch.distributed``).
* ``tensor_use_count`` and ``BACKWARD_TLS``: the C++ reference count of a tensor and the thread-local-state
  functions a backward's ``contextvars`` context is kept in (None where this torch does not have them), for
  ``gaengine.reduce.Collective``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BACKWARD_TLS", "BACKWARD_TLS_KEY", "all_gather_single", "composable_apis", "fsdp_param_groups",
           "cuda_driver_version_query", "fsdp_module_class", "has_grad_dtype", "reduce_scatter_single",
           "tensor_use_count"]

# C++ references to a tensor (one: its Python object's); None where torch does not count them.
tensor_use_count: Callable[[torch.Tensor], int] | None = getattr(torch.Tensor, "_use_count", None)
# The Python object torch.autograd.graph._engine_run_backward stashes in the thread-local state for a backward
# (a contextvars.Context), and torch's functions to take it out and put it back (torch >= 2.6 as far as they exist):
# is_key, get, remove, stash; each None where missing.
BACKWARD_TLS_KEY = "context"
BACKWARD_TLS = tuple(getattr(torch._C, name, None) for name in
                     ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls"))


def cuda_driver_version_query() -> Callable[[], int] | None:
    """torch's ``torch._C._cuda_getDriverVersion`` (``cudaDriverGetVersion``: 12040 for 12.4), present in CUDA
    builds of torch only; None in a CPU build."""
    return getattr(torch._C, "_cuda_getDriverVersion", None)


def fsdp_module_class() -> type | None:
    """FSDP2's ``torch.distributed.fsdp.FSDPModule`` (what ``fully_shard`` makes a module), or None where this
    torch has no ``torch.distributed`` or no such class."""
    if not dist.is_available():
        return None
    import torch.distributed.fsdp as fsdp  # noqa: PLC0415 - only when distributed exists

    return getattr(fsdp, "FSDPModule", None)


def has_grad_dtype() -> bool:
    """Whether this torch's tensors have ``grad_dtype`` (torch >= 2.10): ``p.grad_dtype = torch.float32`` makes
    autograd accumulate a bf16 parameter's gradient in fp32."""
    return hasattr(torch.Tensor, "grad_dtype")


def reduce_scatter_single() -> Callable:
    """``torch.distributed.reduce_scatter_single`` (torch >= 2.10), else ``reduce_scatter_tensor``:
    ``fn(output, input, op=..., group=..., async_op=...)``."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single() -> Callable:
    """``torch.distributed.all_gather_single`` (torch >= 2.10), else ``all_gather_into_tensor``:
    ``fn(output, input, group=..., async_op=...)``."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def composable_apis(module: torch.nn.Module) -> set[str]:
    """The names of the ``torch.distributed._composable`` APIs applied to ``module`` itself (``"fully_shard"``,
    ``"replicate"``, ...; empty for a plain module). Needs ``torch.distributed`` to be available."""
    from torch.distributed._composable.contract import _get_registry  # noqa: PLC0415 - only when distributed exists

    return set(_get_registry(module) or {})


def fsdp_param_groups(state: Any) -> list:
    """The ``FSDPParamGroup``s an FSDP2 state (``FSDPModule._get_fsdp_state()``) holds: torch 2.12 keeps a list,
    torch 2.11 one group or None."""
    held = getattr(state, "_fsdp_param_groups", None)
    if held is None:
        group = getattr(state, "_fsdp_param_group", None)
        held = [group] if group is not None else []
    return list(held)
