"""State dicts saved by earlier gaengine versions load into today's accumulator exactly, through
``gaengine.checkpoint.upgrade``; ``load_state_dict`` refuses them, naming the format and ``upgrade``.

``tests/data/plain_state_5fe3dd9_parent.pt`` was written by gaengine at the parent of commit 5fe3dd9 (the last
version whose ``zero_stage=0`` masters were one ``FlatLayout`` over the bf16, then the fp16 masters; the parameter
store pads each dtype's span to a whole bucket since) with ``tests/data/make_plain_state.py``: a model with a bf16
layer of 64 elements (an odd multiple of the 64-element alignment, so the two layouts differ), an fp16 and an fp32
layer, AdamW, three windows of K = 2 and one micro-batch into the fourth, saved mid-window. Beside the model's,
the optimizer's and the accumulator's state dicts it holds the optimizer's parameters as that run had them
("masters": the fp32 masters of the bf16/fp16 parameters, then the fp32 parameters): the reference.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

import gaengine
from gaengine.checkpoint import PLAIN_FORMAT, STATE_FORMAT, ZERO_FORMAT, upgrade
from gaengine.formats import FSDP2_FORMAT

DATA = os.path.join(os.path.dirname(__file__), "data", "plain_state_5fe3dd9_parent.pt")


def _build_fp32():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, backend="torch", loss_scale=None)
    return model, opt, acc


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
    upgraded = upgrade(saved["acc"], acc)
    assert upgraded["format"] == STATE_FORMAT
    acc.load_state_dict(upgraded)  # its own values again: nothing changes
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
    before = acc.main_grad.data.clone()
    with pytest.raises(ValueError, match="another model"):
        upgrade(saved["acc"], acc)
    assert torch.equal(acc.main_grad.data, before)


def test_load_state_dict_refuses_an_old_format_naming_it_and_upgrade():
    saved = torch.load(DATA, weights_only=True)
    _, _, acc = _build()
    before = acc.main_grad.data.clone()
    with pytest.raises(ValueError, match=f"{PLAIN_FORMAT}.*gaengine.checkpoint.upgrade"):
        acc.load_state_dict(saved["acc"])
    with pytest.raises(ValueError, match=f"{ZERO_FORMAT}.*gaengine.checkpoint.upgrade"):
        acc.load_state_dict({"format": ZERO_FORMAT})
    with pytest.raises(ValueError, match="acc"):  # the plain format is laid out by an accumulator
        upgrade(saved["acc"])
    with pytest.raises(ValueError, match="none that gaengine wrote"):
        upgrade({"format": "something else"}, acc)
    with pytest.raises(ValueError, match=f"{FSDP2_FORMAT} state dict.*does not convert it. To go on"):
        upgrade({"format": FSDP2_FORMAT, "main_grad": torch.zeros(3), "master": None}, acc)
    assert torch.equal(acc.main_grad.data, before) and acc.num_micro_batches == 0


def _as_zero_format(state: dict) -> dict:
    """``state`` (``STATE_FORMAT``) as gaengine wrote it in ``ZERO_FORMAT``: the meta blob without the fields that
    format did not have (mode, window_rows, optimizer_state), with ``zero_stage`` and ``sharded``."""
    meta = torch.load(io.BytesIO(state["meta"]), weights_only=True)
    assert meta["optimizer_state"] == {}  # AdamW: every state tensor is in the elementwise part
    zero_stage = int(meta["mode"].split("=")[1]) if meta["mode"].startswith("zero_stage=") else 0
    meta = {k: v for k, v in meta.items() if k not in ("mode", "window_rows", "optimizer_state")}
    meta["zero_stage"] = zero_stage
    blob = io.BytesIO()
    torch.save(meta, blob)
    return {**state, "format": ZERO_FORMAT, "meta": blob.getvalue()}


def test_a_zero_format_state_upgraded_resumes_as_the_uninterrupted_run():
    """A one-rank run saved between windows in the earlier DCP format (``ZERO_FORMAT``), upgraded and loaded into
    a fresh accumulator, trains on exactly as the run that was never interrupted (the reference)."""
    def batches(n):
        g = torch.Generator().manual_seed(3)
        return [torch.randn(4, 8, generator=g) for _ in range(n)]

    def run(model, acc, xs):
        for x in xs:
            acc.backward(model(x).square().mean())
            acc.step()

    xs = batches(8)
    model, _, acc = _build_fp32()
    run(model, acc, xs[:4])
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "acc": _as_zero_format(acc.state_dict())}, blob)
    saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    run(model, acc, xs[4:])

    model2, _, acc2 = _build_fp32()
    model2.load_state_dict(saved["model"])
    acc2.load_state_dict(upgrade(saved["acc"]))
    run(model2, acc2, xs[4:])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
