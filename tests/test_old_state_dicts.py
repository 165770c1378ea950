"""State dicts saved by earlier gaengine versions load into today's accumulator exactly.

``tests/data/plain_state_5fe3dd9_parent.pt`` was written by gaengine at the parent of commit 5fe3dd9 (the last
version whose ``zero_stage=0`` masters were one ``FlatLayout`` over the bf16, then the fp16 masters; the parameter
store pads each dtype's span to a whole bucket since) with ``tests/data/make_plain_state.py``: a model with a bf16
layer of 64 elements (an odd multiple of the 64-element alignment, so the two layouts differ), an fp16 and an fp32
layer, AdamW, three windows of K = 2 and one micro-batch into the fourth, saved mid-window. Beside the model's,
the optimizer's and the accumulator's state dicts it holds the optimizer's parameters as that run had them
("masters": the fp32 masters of the bf16/fp16 parameters, then the fp32 parameters): the reference.
"""

from __future__ import annotations

import os

import torch

import gaengine

DATA = os.path.join(os.path.dirname(__file__), "data", "plain_state_5fe3dd9_parent.pt")


def _build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False).bfloat16(), torch.nn.Linear(8, 5).half(),
                                torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, backend="torch", loss_scale=None)
    return model, opt, acc


def test_plain_state_from_before_the_store_loads_its_masters_and_window_exactly():
    saved = torch.load(DATA, weights_only=True)
    model, opt, acc = _build()
    assert acc.master_buffer.data.numel() != saved["acc"]["master"].numel()  # the layouts do differ
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    acc.load_state_dict(saved["acc"])
    held = [q.detach() for g in opt.param_groups for q in g["params"]]
    assert len(held) == len(saved["masters"])
    for got, ref in zip(held, saved["masters"]):
        assert got.dtype == torch.float32 and torch.equal(got, ref)
    assert acc.num_micro_batches == 1  # saved mid-window
    order = [acc.registered_params[i] for i in saved["acc"]["layout_order"]]
    assert [id(p) for p in order] == [id(p) for p in acc.params]  # the learned layout came back
    assert torch.equal(acc.main_grad.data, saved["acc"]["main_grad"])  # the window's sums, as saved


def test_a_plain_state_of_another_model_is_still_refused():
    saved = torch.load(DATA, weights_only=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False).bfloat16(), torch.nn.Linear(8, 5).bfloat16(),
                                torch.nn.Linear(5, 3))
    acc = gaengine.GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulation_steps=2,
                                       backend="torch", loss_scale=None)
    try:
        acc.load_state_dict(saved["acc"])
    except ValueError as exc:
        assert "another model" in str(exc)
    else:
        raise AssertionError("a state of another model loaded")
