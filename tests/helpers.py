"""Helpers several test files share (one definition each): a guard against host reads, nvcc's location, an engine
bug to plant, the hooks of a model driven without an accumulator, one intra-op thread, and a script imported from
its file."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys

import torch

from gaengine.backends import ReferenceBackend
from gaengine.bucket import build_buckets
from gaengine.buffer import FlatBuffer, FlatLayout
from gaengine.engine import GradientAccumulator
from gaengine.hooks import make_hooks
from tests.oracle_hooks import use_hooks



def load_file(name: str, path, register: bool = False):
    """The Python file ``path`` (a script of benchmarks/, examples/, setup.py) imported as module ``name``, without
    running its ``__main__`` block; ``register``: put in ``sys.modules`` first (a file whose dataclasses look their
    module up while their classes are made)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_SYNC_METHODS = ("item", "__bool__", "cpu", "tolist", "__float__", "__int__", "numpy")


@contextlib.contextmanager
def forbid_host_reads():
    """Within it, a host read of a tensor (``.item()``, ``bool()``, ``.cpu()``, ``.tolist()`` ...) raises
    ``AssertionError``: the hot path's no-host-sync rule. One read is allowed: ``gaengine.protocol.read_header_slots``
    on a CPU tensor (host memory after a blocking wait, no device sync)."""
    saved = {name: getattr(torch.Tensor, name) for name in _SYNC_METHODS}

    from gaengine.protocol import read_header_slots  # its one read of CPU memory is allowed (its docstring)

    allowed = read_header_slots.__code__

    def make(name):
        saved_fn = saved[name]

        def forbidden(self, *args, **kwargs):
            if self.device.type == "cpu" and sys._getframe(1).f_code is allowed:
                return saved_fn(self, *args, **kwargs)
            raise AssertionError(f"host read Tensor.{name}() on the hot path")
        return forbidden

    for name in _SYNC_METHODS:
        setattr(torch.Tensor, name, make(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def one_thread():
    """One intra-op thread within it (put back after): a CPU kernel's summation order may follow the thread count, so
    two runs that must see the same gradient bits run on one thread each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def find_nvcc() -> str | None:
    """The nvcc on PATH, else under CUDA_HOME, CUDA_PATH or /usr/local/cuda; None without one."""
    candidates = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


NVCC = find_nvcc()


ENGINE_BUGS = ["divided-twice", "not-divided", "dropped-micro-batch", "bf16-sum"]


def plant_engine_bug(monkeypatch, bug):
    """Plant one engine bug (``ENGINE_BUGS``) in the torch backend (the backend the equivalence checks run), for
    ``monkeypatch``'s test."""
    if bug == "divided-twice":  # the window's coefficient 1/K applied twice
        monkeypatch.setattr(ReferenceBackend, "scale_", lambda self, x, coef: x.mul_(coef).mul_(coef))
    elif bug == "not-divided":
        monkeypatch.setattr(ReferenceBackend, "scale_", lambda self, x, coef: x)
    elif bug in ("dropped-micro-batch", "bf16-sum"):
        calls = []
        backward, accumulate = GradientAccumulator.backward, ReferenceBackend.accumulate_bucket_

        def counting_backward(self, *args, **kwargs):
            calls.append(None)
            return backward(self, *args, **kwargs)

        def broken_accumulate(self, dst, *args, **kwargs):
            if bug == "dropped-micro-batch":  # the second micro-batch's backward runs, its sum never lands
                return dst if len(calls) == 2 else accumulate(self, dst, *args, **kwargs)
            accumulate(self, dst, *args, **kwargs)
            return dst.copy_(dst.to(torch.bfloat16))  # the running sum kept in bf16

        monkeypatch.setattr(GradientAccumulator, "backward", counting_backward)
        monkeypatch.setattr(ReferenceBackend, "accumulate_bucket_", broken_accumulate)
    else:
        raise AssertionError(bug)


def source_norm_hooks(model, backend, hot_path, bucket_size_mb, measure, monkeypatch):
    """``make_hooks`` over ``model``'s trainable parameters (one fp32 CPU ``main_grad``), on ``hot_path``'s hooks
    (``tests.oracle_hooks.use_hooks``: "native" the library's, "python" the oracle), measuring the source norms
    when ``measure``."""
    use_hooks(monkeypatch, hot_path)
    params = [p for p in model.parameters() if p.requires_grad]
    layout = FlatLayout.build(params)
    main_grad = FlatBuffer(layout, torch.float32, torch.device("cpu"))
    hooks = make_hooks(params, main_grad, backend, build_buckets(layout, bucket_size_mb), None,
                       measure_sources=measure)
    assert hooks.native == (hot_path == "native"), f"{type(hooks).__name__} built for hot_path={hot_path!r}"
    return hooks


def hooks_backward(hooks, loss, last):
    """One micro-batch's backward of ``loss`` through ``hooks`` (``last``: the window's last)."""
    hooks.begin(last, want_norm=last, armed=False)
    try:
        loss.backward()
    except BaseException:
        hooks.abort()
        raise
    hooks.end()
