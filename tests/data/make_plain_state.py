"""Writes tests/data/plain_state_5fe3dd9_parent.pt with the gaengine checked out at GAENGINE_ROOT (not a test).

    git worktree add /tmp/old 5fe3dd9^ && GAENGINE_HOT_PATH=python python tests/data/make_plain_state.py /tmp/old OUT
"""

import sys

import torch

sys.path.insert(0, sys.argv[1])
import gaengine  # noqa: E402

assert gaengine.__file__.startswith(sys.argv[1]), gaengine.__file__
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False).bfloat16(), torch.nn.Linear(8, 5).half(),
                            torch.nn.Linear(5, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
acc = gaengine.GradientAccumulator(model, opt, accumulation_steps=2, backend="torch", loss_scale=None)
g = torch.Generator().manual_seed(1)


def loss(x):
    return model[2](model[1](model[0](x.bfloat16()).half()).float()).square().mean()


for _ in range(3):
    for _ in range(2):
        acc.backward(loss(torch.randn(4, 8, generator=g)))
    acc.step()
acc.backward(loss(torch.randn(4, 8, generator=g)))  # mid-window
state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "acc": acc.state_dict(),
         "masters": [q.detach().clone() for group in opt.param_groups for q in group["params"]]}
torch.save(state, sys.argv[2])
