"""split_batch, scale_lr and find_micro_batch_size: structure, exact sizes, memory freed between tries, errors."""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gaengine.utils as gu
from gaengine.utils import MicroBatches, find_micro_batch_size, is_oom_error, scale_lr, split_batch
from tests.tolerances import mean_rtol

Pair = namedtuple("Pair", ["x", "y"])


# ---------------------------------------------------------------- split_batch
@pytest.mark.parametrize("n_rows,k,sizes", [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (5, 5, [1] * 5),
                                            (7, 1, [7]), (4097, 3, [1366, 1366, 1365])])
def test_split_by_count_sizes_differ_by_at_most_one(n_rows, k, sizes):
    x = torch.arange(n_rows * 3, dtype=torch.float32).reshape(n_rows, 3)
    micro = split_batch(x, k)
    assert isinstance(micro, MicroBatches) and isinstance(micro, list)
    assert list(micro.sizes) == sizes and len(micro) == k
    assert [m.shape[0] for m in micro] == sizes
    assert torch.equal(torch.cat(list(micro)), x)
    assert micro.uneven == (len(set(sizes)) > 1)


@pytest.mark.parametrize("n_rows,m,sizes", [(8, 4, [4, 4]), (10, 4, [4, 4, 2]), (3, 5, [3]), (1, 1, [1]),
                                            (127, 64, [64, 63])])
def test_split_by_size_last_holds_remainder(n_rows, m, sizes):
    x = torch.randn(n_rows, 2)
    micro = split_batch(x, micro_batch_size=m)
    assert list(micro.sizes) == sizes
    assert torch.equal(torch.cat(list(micro)), x)


def test_split_nested_structure_is_kept_and_tensors_are_views():
    batch = {
        "input": (torch.randn(6, 4), [torch.arange(6), None]),
        "labels": torch.randint(0, 3, (6, 5)),
        "pair": Pair(torch.ones(6), torch.zeros(6, 1, 2)),
        "od": OrderedDict(mask=torch.ones(6, dtype=torch.bool)),
    }
    micro = split_batch(batch, 4)
    assert micro.sizes == (2, 2, 1, 1)
    start = 0
    for mb, size in zip(micro, micro.sizes):
        assert list(mb) == ["input", "labels", "pair", "od"]
        assert isinstance(mb["input"], tuple) and isinstance(mb["input"][1], list)
        assert mb["input"][1][1] is None
        assert isinstance(mb["pair"], Pair) and isinstance(mb["od"], OrderedDict)
        assert torch.equal(mb["labels"], batch["labels"][start:start + size])
        assert torch.equal(mb["input"][1][0], torch.arange(start, start + size))
        assert mb["pair"].y.shape == (size, 1, 2) and mb["od"]["mask"].dtype == torch.bool
        # A view of the batch, not a copy.
        assert mb["input"][0].data_ptr() == batch["input"][0][start:].data_ptr()
        start += size


def test_split_mapping_that_cannot_be_rebuilt_becomes_a_dict():
    from collections import defaultdict

    batch = defaultdict(list, x=torch.arange(4))
    micro = split_batch(batch, 2)
    assert type(micro[0]) is dict and torch.equal(micro[1]["x"], torch.tensor([2, 3]))


def test_split_uneven_weighted_by_sizes_gives_the_batch_mean():
    """The documented recipe: weight uneven micro-batch means by their sizes to get the whole-batch mean."""
    x = torch.randn(10, 3, dtype=torch.float64)
    micro = split_batch(x, 3)
    weighted = sum(mb.mean() * n for mb, n in zip(micro, micro.sizes)) / sum(micro.sizes)
    naive = sum(mb.mean() for mb in micro) / len(micro)
    # fp64 throughout: each side is a mean of at most 10 values in a few steps, within mean_rtol(10) of mean |x| (no
    # relative bound on the mean itself: randn values may nearly cancel). The naive mean is off by more than that.
    rounding = 2 * mean_rtol(10, torch.float64) * float(x.abs().mean())
    assert abs(float(weighted - x.mean())) <= rounding
    assert abs(float(naive - x.mean())) > rounding


@settings(max_examples=25, deadline=None)
@given(n_rows=st.integers(1, 300), k=st.integers(1, 40), m=st.integers(1, 400))
def test_split_property_partition(n_rows, k, m):
    x = torch.arange(n_rows)
    if k <= n_rows:
        micro = split_batch({"x": x}, k)
        assert len(micro) == k and max(micro.sizes) - min(micro.sizes) <= 1 and min(micro.sizes) >= 1
        assert torch.equal(torch.cat([mb["x"] for mb in micro]), x)
    micro = split_batch(x, micro_batch_size=m)
    assert len(micro) == math.ceil(n_rows / m)
    assert all(s == m for s in micro.sizes[:-1]) and 1 <= micro.sizes[-1] <= m
    assert sum(micro.sizes) == n_rows and torch.equal(torch.cat(list(micro)), x)


@pytest.mark.parametrize("kwargs,match", [
    ({}, "exactly one of num_micro_batches and micro_batch_size"),
    ({"num_micro_batches": 2, "micro_batch_size": 2}, "exactly one of num_micro_batches and micro_batch_size"),
    ({"num_micro_batches": 0}, "num_micro_batches must be an int >= 1"),
    ({"num_micro_batches": -1}, "num_micro_batches must be an int >= 1"),
    ({"num_micro_batches": 2.0}, "num_micro_batches must be an int >= 1"),
    ({"num_micro_batches": True}, "num_micro_batches must be an int >= 1"),
    ({"micro_batch_size": 0}, "micro_batch_size must be an int >= 1"),
    ({"num_micro_batches": 7}, "num_micro_batches=7 exceeds the batch's 6 rows"),
])
def test_split_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        split_batch(torch.randn(6, 2), **kwargs)


def test_split_bad_batches():
    with pytest.raises(ValueError, match=r"batch\['b'\] has 5"):
        split_batch({"a": torch.randn(6), "b": torch.randn(5, 2)}, 2)
    with pytest.raises(ValueError, match=r"batch\[1\] is a 0-d tensor"):
        split_batch((torch.randn(4), torch.tensor(3.0)), 2)
    with pytest.raises(ValueError, match="holds no tensor"):
        split_batch({"a": None, "b": []}, 1)
    with pytest.raises(ValueError, match="0 rows"):
        split_batch(torch.randn(0, 3), micro_batch_size=2)
    with pytest.raises(TypeError, match=r"batch\['text'\] is a str"):
        split_batch({"x": torch.randn(4), "text": "hello"}, 2)


# ---------------------------------------------------------------- scale_lr
def test_scale_lr_rules():
    assert scale_lr(0.1, 256, 8192) == pytest.approx(3.2)  # Goyal et al.: 0.1 per 256 images
    assert scale_lr(1e-3, 32, 512, rule="sqrt") == pytest.approx(4e-3)
    assert scale_lr(1e-3, 64, 64, rule="sqrt") == 1e-3
    assert scale_lr(0.4, 1024, 256) == pytest.approx(0.1)  # a smaller batch scales down
    assert scale_lr(0.0, 8, 16) == 0.0
    assert isinstance(scale_lr(1, 2, 4), float)


@pytest.mark.parametrize("args,kwargs,match", [
    ((-0.1, 8, 16), {}, "base_lr"),
    ((float("nan"), 8, 16), {}, "base_lr"),
    ((float("inf"), 8, 16), {}, "base_lr"),
    (("0.1", 8, 16), {}, "base_lr"),
    ((0.1, 0, 16), {}, "base_batch_size"),
    ((0.1, 8.0, 16), {}, "base_batch_size"),
    ((0.1, 8, -16), {}, "effective_batch_size"),
    ((0.1, 8, 16), {"rule": "cubic"}, "rule must be one of"),
])
def test_scale_lr_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        scale_lr(*args, **kwargs)


# ---------------------------------------------------------------- find_micro_batch_size
class FakeStep:
    """Raises an out-of-memory error above ``limit`` rows; records the sizes it was called with."""

    def __init__(self, limit, error=torch.OutOfMemoryError):
        self.limit, self.error, self.calls = limit, error, []

    def __call__(self, size):
        self.calls.append(size)
        if size > self.limit:
            raise self.error(f"CUDA out of memory. Tried to allocate {size} MiB")


@pytest.mark.parametrize("target,limit,expected,calls", [
    (64, 20, (16, 4), [64, 32, 16]),
    (64, 64, (64, 1), [64]),
    (100, 30, (25, 4), [100, 50, 25]),
    (96, 40, (24, 4), [96, 48, 24]),
    (7, 2, (1, 7), [7, 3, 1]),
    (130, 40, (32, 5), [130, 65, 32]),  # 32 does not divide 130: 5 micro-batches, the last holds 2 rows
])
def test_find_halves_until_it_fits(target, limit, expected, calls):
    step = FakeStep(limit)
    assert find_micro_batch_size(step, target) == expected
    assert step.calls == calls
    size, steps = expected
    assert (steps - 1) * size < target <= steps * size
    # The documented recipe: split the target batch by size; exactly `steps` micro-batches, target rows.
    micro = split_batch(torch.zeros(target), micro_batch_size=size)
    assert len(micro) == steps and sum(micro.sizes) == target


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, torch.cuda.OutOfMemoryError, RuntimeError],
                         ids=["torch-oom", "cuda-oom", "runtime-message"])
def test_find_recognizes_oom_errors(error):
    step = FakeStep(10, error)
    assert find_micro_batch_size(step, 40) == (10, 4)


def test_find_cpu_allocator_message_is_oom():
    assert is_oom_error(RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom_error(ValueError("out of memory"))  # only RuntimeErrors carry allocator messages


def test_find_start_and_min_size():
    step = FakeStep(6)
    assert find_micro_batch_size(step, 64, start=24) == (6, 11)
    assert step.calls == [24, 12, 6]
    step = FakeStep(3)
    assert find_micro_batch_size(step, 64, min_size=3) == (3, 22)
    assert step.calls == [64, 32, 16, 8, 4, 3]  # min_size is tried last, never skipped


def test_find_raises_when_min_size_does_not_fit():
    step = FakeStep(0)
    with pytest.raises(RuntimeError, match=r"even at min_size=2 \(tried \[8, 4, 2\]\)") as info:
        find_micro_batch_size(step, 8, min_size=2)
    assert "CUDA out of memory" in str(info.value.__cause__)


def test_find_other_errors_propagate():
    calls = []

    def step(size):
        calls.append(size)
        if size > 4:
            raise torch.OutOfMemoryError("out of memory")
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        find_micro_batch_size(step, 16)
    assert calls == [16, 8, 4]


def test_find_frees_the_failed_step_before_retrying(monkeypatch):
    """The failed step's tensors are unreachable (traceback dropped, gc run) before the next try."""
    refs, alive_at_call = [], []
    collected = []
    monkeypatch.setattr(gu.gc, "collect", lambda: collected.append(True) or 0)
    cleared = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cleared.append(True))

    def step(size):
        alive_at_call.append([r() is not None for r in refs])
        activations = torch.empty(size, 1024)
        refs.append(weakref.ref(activations))
        if size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert find_micro_batch_size(step, 32) == (8, 4)
    assert alive_at_call == [[], [False], [False, False]]
    assert len(collected) == 2 and len(cleared) == 2  # once per failed try


def test_find_does_not_touch_cuda_when_uninitialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("empty_cache called without CUDA"))
    assert find_micro_batch_size(FakeStep(4), 16) == (4, 4)


@pytest.mark.parametrize("args,kwargs,match", [
    ((FakeStep(1), 0), {}, "target_batch_size must be an int >= 1"),
    ((FakeStep(1), 8.0), {}, "target_batch_size must be an int >= 1"),
    ((FakeStep(1), 8, 0), {}, "start must be an int >= 1"),
    ((FakeStep(1), 8, 16), {}, "start=16 exceeds target_batch_size=8"),
    ((FakeStep(1), 8), {"min_size": 0}, "min_size must be an int >= 1"),
    ((FakeStep(1), 8, 4), {"min_size": 5}, "min_size=5 exceeds"),
])
def test_find_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_micro_batch_size(*args, **kwargs)
    assert args[0].calls == []


def test_find_step_fn_must_be_callable():
    with pytest.raises(TypeError, match="step_fn must be callable"):
        find_micro_batch_size(32, 8)


@settings(max_examples=25, deadline=None)
@given(target=st.integers(1, 5000), limit=st.integers(1, 5000))
def test_find_property_largest_halving_that_fits(target, limit):
    step = FakeStep(limit)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gu.gc, "collect", lambda: 0)  # a full collection per try is slow with torch loaded
        size, steps = find_micro_batch_size(step, target)
    halvings = [target >> i for i in range(target.bit_length()) if target >> i >= 1]
    assert size == next(s for s in halvings if s <= limit)
    assert steps == math.ceil(target / size) and (steps - 1) * size < target <= steps * size
