"""``gaengine.norm.window_norm``, the one norm of every sharding strategy, over each rank's chunks and summed over
the ranks (``over_ranks``) as ZeRO's shards are: every rank's result against the fp64 norm of the whole gradient
(the concatenation of every rank's chunks) and torch's clip formula; a non-finite value on any rank skips every
rank's update. The ranks are simulated in one process: ``over_ranks`` adds the other ranks' ``local_sum_sq``, as
the all-reduce would."""

from __future__ import annotations

import pytest
import torch

from gaengine.backends import get_backend
from gaengine.norm import CLIP_EPS, local_sum_sq, window_norm
from tests.tolerances import clip_coef_rtol, norm_rtol, rel_diff

# Per rank, the numels of its chunks: one chunk (the backend's one pass), several (torch._foreach_norm), none, and
# empty chunks (a rank that owns nothing of a bucket).
_LAYOUTS = {
    "one-rank-n4097": [[4097]],
    "two-ranks-one-chunk-n127": [[127], [127]],
    "three-ranks-several-chunks": [[1, 4097, 0], [33, 127], []],
}


def _chunks(layout: list[list[int]], seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=gen) for n in rank] for rank in layout]


def _norms(ranks: list[list[torch.Tensor]], grad_denom: torch.Tensor, max_grad_norm: float | None):
    """Each rank's ``window_norm``: its own chunks, the others' sums added by ``over_ranks`` (one rank: none)."""
    backend = get_backend("torch", "cpu")
    local = [torch.stack([s.float() for s in local_sum_sq(c, backend, grad_denom.device)]) for c in ranks]
    out = []
    for r, chunks in enumerate(ranks):
        others = sum((local[q] for q in range(len(ranks)) if q != r), torch.zeros(2))
        over = None if len(ranks) == 1 else (lambda sums, o=others: sums + o)
        out.append(window_norm(chunks, grad_denom, max_grad_norm, backend, over_ranks=over))
    return out


@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["no-clip", "clip0.5"])
@pytest.mark.parametrize("layout", list(_LAYOUTS.values()), ids=list(_LAYOUTS))
def test_every_rank_gets_the_norm_of_the_whole_gradient(layout, max_grad_norm):
    ranks = _chunks(layout, seed=len(layout))
    whole = torch.cat([c.double() for chunks in ranks for c in chunks])
    grad_denom = torch.tensor(6.0)
    exact = whole.norm() / 6.0
    n = whole.numel()
    for r, norm in enumerate(_norms(ranks, grad_denom, max_grad_norm)):
        assert not bool(norm.skipped), f"rank {r}"
        assert rel_diff(norm.grad_norm, exact) <= norm_rtol(n), f"rank {r}"
        clip = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (exact.item() + CLIP_EPS))
        assert rel_diff(norm.clip_coef, torch.tensor(clip, dtype=torch.float64)) <= clip_coef_rtol(n), f"rank {r}"
        assert rel_diff(norm.coef, torch.tensor(clip / 6.0, dtype=torch.float64)) <= (
            clip_coef_rtol(n) + 2 * torch.finfo(torch.float32).eps), f"rank {r}"


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("where", [0, 1], ids=["rank0-several-chunks", "rank1-one-chunk"])
def test_a_non_finite_value_on_one_rank_skips_every_rank(bad, where):
    """Rank 0 holds several chunks (its flag is the non-finite sum), rank 1 one chunk (the backend's flag)."""
    ranks = _chunks([[5, 127], [64]], seed=3)
    ranks[where][-1][7] = bad
    for r, norm in enumerate(_norms(ranks, torch.tensor(2.0), 1.0)):
        assert bool(norm.skipped), f"rank {r}"
        assert norm.coef.item() == 1.0, f"rank {r}: the coefficient must stay finite (1) when skipped"


def test_a_rank_with_no_chunks_adds_nothing():
    """A rank that owns no element: its local sums are zeros (on the device of ``grad_denom``), not a missing term."""
    sum_sq, found_inf = local_sum_sq([torch.empty(0)], get_backend("torch", "cpu"), torch.device("cpu"))
    assert sum_sq.item() == 0.0 and found_inf.item() == 0.0
    assert sum_sq.dtype == torch.float32 and found_inf.dtype == torch.float32
