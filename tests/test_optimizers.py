"""gaengine.optimizers' table against the optimizers themselves: the moment keys are the state tensors each one
creates in a step, writes_model is FusedAdamW's attach_model_params, grad_scale the fused ones' GradScaler flag."""

from __future__ import annotations

import pytest
import torch

from gaengine import optimizers
from gaengine.optim import FusedAdamW

CASES = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-amsgrad-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "sgd-momentum-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "fused-adamw": lambda ps: FusedAdamW(ps, lr=1e-2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_row_names_the_state_its_optimizer_keeps(case):
    p = torch.nn.Parameter(torch.randn(7))
    opt = CASES[case]([p])
    p.grad = torch.randn(7)
    opt.step()
    assert optimizers.is_elementwise(opt)
    keys = optimizers.moment_keys(opt, opt.param_groups[0])
    created = {k for k, v in opt.state[p].items() if k != "step" and torch.is_tensor(v) and v.shape == p.shape}
    assert set(keys) == created
    assert optimizers.keeps_step(opt) == ("step" in opt.state[p])
    assert optimizers.writes_model_params(opt) == callable(getattr(opt, "attach_model_params", None))
    assert optimizers.takes_grad_scale(opt) == bool(getattr(opt, "_step_supports_amp_scaling", False)
                                                    and opt.defaults.get("fused"))


def test_a_subclass_is_not_elementwise_but_keeps_writing_the_model():
    class Mine(FusedAdamW):
        pass

    class MyAdam(torch.optim.Adam):
        pass

    p = torch.nn.Parameter(torch.randn(3))
    assert not optimizers.is_elementwise(Mine([p])) and optimizers.writes_model_params(Mine([p]))
    assert not optimizers.is_elementwise(MyAdam([p])) and not optimizers.writes_model_params(MyAdam([p]))
    with pytest.raises(KeyError, match="elementwise"):
        optimizers.moment_keys(MyAdam([p]), {})
    assert not optimizers.is_elementwise(torch.optim.Adagrad([p]))
