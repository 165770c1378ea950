"""torch's Muon with its Newton–Schulz iteration in fp64 (what the Muon tests patch in on both sides: the model, the
optimizers' state and the gradients stay fp32), counting its calls, and the worst-case first-order gain of the
iteration (``newton_schulz_gain``)."""

from __future__ import annotations

import pytest
import torch
import torch.optim._muon as torch_muon

__all__ = ["NewtonSchulzCalls", "newton_schulz", "newton_schulz_gain", "ns_fp64"]


def ns_fp64(grad, ns_coefficients, ns_steps, eps):
    """torch's ``_zeropower_via_newtonschulz`` (torch/optim/_muon.py) with the iterate in fp64 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.double()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class NewtonSchulzCalls:
    """torch's Muon orthogonalization replaced by ``ns_fp64``, counting its calls (and their matrices' shapes)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, grad, ns_coefficients, ns_steps, eps):
        self.shapes.append(tuple(grad.shape))
        return ns_fp64(grad, ns_coefficients, ns_steps, eps)


def newton_schulz_gain(coefficients=(torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C),
                       ns_steps: int = torch_muon.DEFAULT_NS_STEPS) -> float:
    """A first-order bound of how much ``ns_steps`` Newton–Schulz iterations ``X <- f(X) = a X + b X X^T X + c (X
    X^T)^2 X`` grow a perturbation of their input X (Frobenius norm, ||X||_2 <= 1 after the normalization): in the
    SVD basis of X the derivative of the odd matrix polynomial f acts by the divided differences (f(s_i) - f(s_j)) /
    (s_i - s_j) and (f(s_i) + f(s_j)) / (s_i + s_j) of its scalar f (Higham, "Functions of Matrices", Thm 3.11 for
    polynomials), each at most max(|f'|, f(s)/s) over the singular values' interval (the mean value theorem); that
    interval after each iteration is f's image of the one before (from [0, 1])."""
    a, b, c = coefficients
    gain, hi = 1.0, 1.0
    for _ in range(ns_steps):
        s = torch.linspace(0.0, hi, 100001, dtype=torch.float64)
        f = a * s + b * s**3 + c * s**5
        slope = (a + 3 * b * s**2 + 5 * c * s**4).abs().max()
        ratio = (a + b * s**2 + c * s**4).abs().max()  # f(s) / s
        gain *= float(max(slope, ratio))
        hi = float(f.abs().max())
    return gain


@pytest.fixture
def newton_schulz(monkeypatch) -> NewtonSchulzCalls:
    """torch's Muon with ``ns_fp64`` for the test (the calls counted)."""
    calls = NewtonSchulzCalls()
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", calls)
    return calls
