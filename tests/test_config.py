"""``gaengine.AccumulatorConfig``: the accumulator's options in one frozen dataclass, checked once.

Checked against references outside the config: ``GradientAccumulator``'s signature (its named options are fields,
with the same defaults; every other keyword reaches the config, an unknown one is a ``TypeError`` naming it), the error text (it names the field), the gradient of a window computed in fp64 by autograd, the
command line that ``gaengine train`` parses, and, on two gloo ranks, where the all-reduces are launched.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import re

import pytest
import torch
from torch import nn

import gaengine
from gaengine import AccumulatorConfig
from gaengine.config import field_help
from tests.ranks import launch_scenario as _launch
from tests.tolerances import (
    clip_coef_rtol,
    network_rtol,
    norm_rtol,
    rel_diff,
    split_batch_rtol,
)

OBJECTS = ("model", "optimizer", "lr_scheduler", "process_group")  # what the accumulator works on, not options


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(5, 6, generator=g).to(next(model.parameters()).dtype)  # the same draw for the fp64 reference
    return model(x).square().mean()


def test_every_keyword_of_the_accumulator_is_a_field_with_the_same_default():
    signature = inspect.signature(gaengine.GradientAccumulator.__init__).parameters
    named = {name: p.default for name, p in signature.items()
             if p.kind is not p.VAR_KEYWORD and name != "self" and name not in OBJECTS}
    fields = {f.name: f.default for f in dataclasses.fields(AccumulatorConfig)}
    assert named and named == {name: fields[name] for name in named}
    assert set(signature) - {"self", "options"} - set(fields) == set(OBJECTS)


@pytest.mark.parametrize("field", [f for f in dataclasses.fields(AccumulatorConfig)], ids=lambda f: f.name)
def test_every_field_reaches_the_accumulators_config(field):
    """Each option passed by keyword ends in ``acc.config``: a non-default value where one is valid on one rank."""
    other = {"accumulation_steps": 3, "max_grad_norm": 0.5, "backend": "torch", "master_weights": False,
             "bucket_size_mb": 1.0, "reduce_dtype": torch.bfloat16, "broadcast_buffers": False, "loss_scale": 8.0,
             "min_loss_scale": 0.5, "batchnorm": "window", "max_consecutive_skips": 2, "micro_batch_size": 4,
             "measure_noise_scale": True, "noise_scale_ema": 0.5, "zero_stage": 1, "overlap_param_gather": None,
             "overlap_grad_reduce": False, "gradient_accumulation_fusion": True}[field.name]
    if other is None:  # needs zero_stage >= 1 too
        kwargs = {"zero_stage": 1, field.name: True}
    else:
        kwargs = {field.name: other}
    model = _model()
    acc = gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    try:
        assert {name: getattr(acc.config, name) for name in kwargs} == kwargs
    finally:
        acc.close()


def test_an_unknown_keyword_is_a_type_error_naming_it():
    model = _model()
    with pytest.raises(TypeError, match=r"GradientAccumulator\(\) got an unexpected keyword argument 'max_norm'.*"
                                        r"max_grad_norm"):
        gaengine.GradientAccumulator(model, None, max_norm=1.0)
    assert all(not hasattr(p, "_gaengine_accumulator") for p in model.parameters())  # nothing was taken


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(AccumulatorConfig)])
def test_every_field_has_a_docstring_that_says_what_raises(name):
    summary, full = field_help(name), field_help(name, full=True)
    assert summary and full.startswith(summary) and len(full) > len(summary)
    assert f"ValueError naming {name}" in full, full


def test_the_accumulator_docstring_points_at_every_field():
    doc = gaengine.GradientAccumulator.__doc__
    options = doc[doc.index("**options:"):doc.index("Multi-rank:")]
    named = set(re.findall(r"``([a-z_]+)``", options))
    assert {f.name for f in dataclasses.fields(AccumulatorConfig)} <= named, options


BAD = [
    ("accumulation_steps", 0), ("accumulation_steps", 2.0), ("accumulation_steps", True), ("accumulation_steps", "4"),
    ("max_grad_norm", 0.0), ("max_grad_norm", -1), ("max_grad_norm", math.nan), ("max_grad_norm", math.inf),
    ("max_grad_norm", "x"), ("max_grad_norm", True),
    ("backend", "fast"),
    ("master_weights", "yes"), ("master_weights", 1),
    ("bucket_size_mb", 0), ("bucket_size_mb", -1.0), ("bucket_size_mb", True), ("bucket_size_mb", "25"),
    ("bucket_size_mb", math.inf),
    ("reduce_dtype", torch.float64), ("reduce_dtype", "bf16"),
    ("broadcast_buffers", None),
    ("loss_scale", "static"), ("loss_scale", True), ("loss_scale", 0.0), ("loss_scale", -2.0), ("loss_scale", math.nan),
    ("min_loss_scale", 0), ("min_loss_scale", math.nan),
    ("batchnorm", "sync"),
    ("max_consecutive_skips", 0), ("max_consecutive_skips", 1.5), ("max_consecutive_skips", True),
    ("micro_batch_size", 0), ("micro_batch_size", "8"),
    ("measure_noise_scale", 1),
    ("noise_scale_ema", 1.0), ("noise_scale_ema", 0.0),
    ("zero_stage", 3), ("zero_stage", True),
    ("overlap_param_gather", "yes"),
    ("overlap_grad_reduce", None), ("overlap_grad_reduce", "no"),
    ("gradient_accumulation_fusion", 1), ("gradient_accumulation_fusion", "yes"),
]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}-{v!r}" for n, v in BAD])
def test_a_bad_value_raises_value_error_naming_the_field(name, value):
    with pytest.raises(ValueError) as from_config:
        AccumulatorConfig(**{name: value})
    assert re.match(rf"{name}\b", str(from_config.value)), str(from_config.value)
    model = _model()
    with pytest.raises(ValueError) as from_accumulator:
        gaengine.GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **{name: value})
    assert str(from_accumulator.value) == str(from_config.value)
    gaengine.GradientAccumulator(model, None).close()  # nothing was taken: the parameters are free


def test_fields_checked_together_name_both():
    with pytest.raises(ValueError, match=r"overlap_param_gather=True needs zero_stage=1 or 2.*got zero_stage=0"):
        AccumulatorConfig(overlap_param_gather=True)
    adaptive = gaengine.schedules.Adaptive(k_min=2, k_max=8)
    with pytest.raises(ValueError, match=r"^accumulation_steps=.*measure_noise_scale=True"):
        AccumulatorConfig(accumulation_steps=adaptive)
    assert AccumulatorConfig(accumulation_steps=adaptive, measure_noise_scale=True).accumulation_steps is adaptive
    # What needs the model stays with the accumulator, and still names the option.
    params = list(_model().parameters())
    with pytest.raises(ValueError, match=r"overlap_param_gather=True needs model as an nn.Module.*list"):
        gaengine.GradientAccumulator(params, torch.optim.SGD(params, lr=0.1), zero_stage=1, overlap_param_gather=True)


def test_frozen_and_keyword_only():
    config = AccumulatorConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_grad_norm = 2.0
    with pytest.raises(TypeError):
        AccumulatorConfig(8)


def test_acc_config_holds_the_arguments_normalized():
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=3, max_grad_norm=2, bucket_size_mb=1,
                                       micro_batch_size=4, backend="torch", overlap_grad_reduce=False)
    try:
        expected = AccumulatorConfig(accumulation_steps=3, max_grad_norm=2.0, bucket_size_mb=1.0, micro_batch_size=4,
                                     backend="torch", overlap_grad_reduce=False)
        assert acc.config == expected
        assert type(acc.config.max_grad_norm) is float and type(acc.config.bucket_size_mb) is float
        assert (acc.max_grad_norm, acc.bucket_size_mb, acc.micro_batch_size) == (2.0, 1.0, 4)
    finally:
        acc.close()
    again = gaengine.GradientAccumulator(_model(), None, **expected.as_kwargs())
    assert again.config == expected
    again.close()


def _fp64_grad_rtol(micro_batches: int, clipped: bool = False) -> float:
    """An fp32 window gradient of ``_model`` (3 tanh layers at most 8 wide) over ``micro_batches`` of ``_loss``'s 5
    samples against the fp64 one, relative to its largest element: each micro-batch's backward against fp64
    (``network_rtol``), the samples reduced in fp32 (half ``split_batch_rtol``: one side rounds), and with clipping
    the fp32 clip coefficient from the model's norm (``clip_coef_rtol``)."""
    n_params = sum(p.numel() for p in _model().parameters())
    rtol = network_rtol(3, 8) + split_batch_rtol(5 * micro_batches) / 2
    return rtol + (clip_coef_rtol(n_params) if clipped else 0.0)


def _assert_grads(model: nn.Module, expected: list[torch.Tensor], rtol: float) -> None:
    for i, (p, q) in enumerate(zip(model.parameters(), expected, strict=True)):
        assert rel_diff(p.grad, q) <= rtol, f"param {i}: {rel_diff(p.grad, q):.3e} > {rtol:.3e}"


def _window_grads(model: nn.Module, seeds: list[int]) -> list[torch.Tensor]:
    """fp64 reference: the mean over ``seeds`` of each micro-batch's gradient, by autograd on an fp64 copy."""
    ref = copy.deepcopy(model).double()
    for s in seeds:
        (_loss(ref, s) / len(seeds)).backward()
    return [p.grad for p in ref.parameters()]


def test_setting_k_changes_the_window_and_keeps_the_config():
    model = _model()
    expected = _window_grads(model, [0, 1, 2])
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, backend="torch")
    try:
        acc.accumulation_steps = 3
        assert acc.config.accumulation_steps == 2  # what was asked at construction
        results = []
        for s in range(3):
            acc.backward(_loss(model, s))
            results.append(acc.step())
        assert results[:2] == [None, None] and results[2].num_micro_batches == 3
        _assert_grads(model, expected, _fp64_grad_rtol(3))
    finally:
        acc.close()


def test_setting_max_grad_norm_clips_the_next_window_as_torch_does():
    """``acc.max_grad_norm`` set between windows (as the trainer integrations do) is the next step's threshold:
    the gradient equals torch.nn.utils.clip_grad_norm_ on the fp64 window mean; the config keeps what was asked."""
    model = _model()
    acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None, backend="torch")
    try:
        for threshold, seeds in ((None, [0, 1]), (0.05, [2, 3]), (None, [4, 5])):
            acc.max_grad_norm = threshold
            expected = _window_grads(model, seeds)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected]))
            if threshold is not None:
                assert norm > threshold  # the check clips something
                holders = [torch.zeros_like(g, requires_grad=True) for g in expected]
                for h, g in zip(holders, expected):
                    h.grad = g.clone()
                torch.nn.utils.clip_grad_norm_(holders, threshold)  # torch's own clip, in fp64
                expected = [h.grad for h in holders]
            for s in seeds:
                acc.backward(_loss(model, s))
            result = acc.step()
            n_params = sum(p.numel() for p in model.parameters())
            norm_rel = _fp64_grad_rtol(len(seeds)) + norm_rtol(n_params)  # the fp32 gradient's error, then its norm's
            torch.testing.assert_close(result.grad_norm.double(), norm, rtol=norm_rel, atol=0)
            _assert_grads(model, expected, _fp64_grad_rtol(len(seeds), clipped=threshold is not None))
        assert acc.config.max_grad_norm is None
    finally:
        acc.close()


def test_a_schedule_is_kept_as_given_and_refuses_the_setter():
    def schedule(update_index, items_seen):
        return 2 if update_index == 0 else 3

    acc = gaengine.GradientAccumulator(_model(), None, accumulation_steps=schedule)
    try:
        assert acc.config.accumulation_steps is schedule and acc.accumulation_steps == 2
        with pytest.raises(ValueError, match="schedule"):
            acc.accumulation_steps = 4
    finally:
        acc.close()


# ---------------------------------------------------------------- gaengine train's options
def test_train_options_are_built_from_the_fields():
    from gaengine.tools.cli import build_parser
    from gaengine.tools.train import ENGINE_FIELDS, TrainConfig

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    actions = {a.dest: a for a in train._actions}
    assert set(ENGINE_FIELDS) == {"accumulation_steps", "max_grad_norm", "backend", "master_weights",
                                  "micro_batch_size", "zero_stage", "gradient_accumulation_fusion"}
    for name in ENGINE_FIELDS:
        action = actions[name]
        assert "--" + name.replace("_", "-") in action.option_strings
        words = field_help(name).split()[1:6]  # the first paragraph, past its (case-adjusted) first word
        assert " ".join(words) in " ".join(action.help.split()), (name, action.help)
        choices = dataclasses.fields(AccumulatorConfig)[[f.name for f in dataclasses.fields(AccumulatorConfig)]
                                                         .index(name)].metadata.get("choices")
        assert action.choices == choices
    # --measure-noise-scale from the field; its short form --noise-scale parses too (kept out of the usage line).
    assert {"--noise-scale", "--measure-noise-scale"} <= {o for a in train._actions if a.dest == "noise_scale"
                                                          for o in a.option_strings}

    argv = ["train", "--accumulation-steps", "3", "--micro-batch-size", "2", "--max-grad-norm", "off",
            "--backend", "torch", "--no-master-weights", "--zero-stage", "1", "--measure-noise-scale"]
    args = build_parser().parse_args(argv)
    config = TrainConfig(**{name: getattr(args, name) for name in (*ENGINE_FIELDS, "noise_scale")})
    assert config.accumulator_config() == AccumulatorConfig(
        accumulation_steps=3, micro_batch_size=2, max_grad_norm=None, backend="torch", master_weights=False,
        zero_stage=1, measure_noise_scale=True)
    assert build_parser().parse_args(["train", "--noise-scale"]).noise_scale is True
    with pytest.raises(ValueError, match="^max_grad_norm"):
        TrainConfig(max_grad_norm=-1.0)


# ---------------------------------------------------------------- overlap_grad_reduce on two ranks
def _overlap_scenario(rank: int, world: int, out: str) -> dict:
    """Two windows (K=2) with tiny buckets, once per setting; every all-reduce records whether it was launched
    inside the backward of the last micro-batch (an autograd graph task running) or after it."""
    import torch.distributed as dist

    real = dist.all_reduce
    launches: list[bool] = []

    def recording(*args, **kwargs):
        launches.append(torch._C._current_graph_task_id() != -1)
        return real(*args, **kwargs)

    results = {}
    for overlap in (True, False):
        model = _model()
        acc = gaengine.GradientAccumulator(model, None, accumulation_steps=2, max_grad_norm=None,
                                           bucket_size_mb=1e-4, overlap_grad_reduce=overlap)
        dist.all_reduce = recording
        try:
            for window in range(2):
                for k in range(2):
                    launches.clear()
                    acc.backward(_loss(model, 10 * window + 2 * rank + k))
                    during = list(launches)
                acc.step()
        finally:
            dist.all_reduce = real
        results[overlap] = {"during": during, "grads": [p.grad.clone() for p in model.parameters()]}
        acc.close()
    return results


@pytest.mark.multiproc
def test_overlap_grad_reduce_moves_the_launches_not_the_numbers(tmp_path):
    codes, results = _launch(tmp_path, 2, _overlap_scenario)
    assert codes == [0, 0]
    reference = _window_grads(_model(), [10 + 2 * r + k for r in range(2) for k in range(2)])
    for result in results:
        overlapped, serial = result[True], result[False]
        assert any(overlapped["during"]), overlapped["during"]  # buckets reduced while backward ran
        assert serial["during"] and not any(serial["during"]), serial["during"]  # all after backward
        for a, b, q in zip(overlapped["grads"], serial["grads"], reference):
            assert torch.equal(a, b)  # the same sums, launched at other times
            assert rel_diff(a, q) <= _fp64_grad_rtol(4)  # 2 ranks x 2 micro-batches, against fp64
