"""The ``fusion`` benchmark: one bf16 ``nn.Linear``'s backward per micro-batch, with gradient accumulation fusion
(``gradient_accumulation_fusion=True``: ``dW`` written straight into the fp32 ``main_grad``), without it (gaengine's
hooks: a bf16 ``dW``, then accumulated into fp32) and in the plain recipe (``loss.backward()``: ``.grad += dW`` in
bf16), timed in interleaved rounds on the current device (docs/fusion.md).

Each variant's layer sees the same micro-batch every round (input X and, through the loss ``sum(fp32(Y) * G)``, the
output gradient ``dY = G``), so after n backward passes its exact window gradient is ``n * G^T X``; the table gives
each variant's relative distance from that, computed in fp64, beside its time: the fused sum is exact to fp32
rounding, the hooks' sum carries each ``dW``'s bf16 rounding, the plain recipe's bf16 sum drifts further.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from gaengine.tools.bench.common import RATIO_NOTE, display_rows, print_note, print_table, ratio_stats, time_rounds

VARIANTS = {
    "plain": "plain recipe: loss.backward(), .grad += dW in bf16",
    "hooks": "gaengine hooks: bf16 dW, added into fp32 main_grad",
    "fused": "gaengine fused: dW written/added straight into fp32 main_grad",
}
"""The rows, in order; ``plain`` is the baseline of the ratio column."""


@dataclass(frozen=True)
class FusionConfig:
    """The layer ``Linear(features, features)`` in bf16, its micro-batch ``tokens`` rows."""

    features: int
    tokens: int


def fusion_config(device_type: str, quick: bool) -> FusionConfig:
    """Sizes per device: quick (tests, smoke runs) 128 x 64 tokens; CPU 512 x 512; CUDA 4096 x 8192 (a 7B-class
    projection, one micro-batch of 8192 tokens)."""
    if quick:
        return FusionConfig(128, 64)
    return FusionConfig(4096, 8192) if device_type == "cuda" else FusionConfig(512, 512)


class _Variant:
    """One layer, its micro-batch, and one backward of it per call of ``step()`` (the forward in ``forward()``,
    untimed)."""

    def __init__(self, variant: str, cfg: FusionConfig, device: torch.device, backend: str) -> None:
        import gaengine  # noqa: PLC0415 - the command imports the benchmarks before the engine

        g = torch.Generator(device="cpu").manual_seed(0)
        self.layer = nn.Linear(cfg.features, cfg.features, bias=False).to(device, torch.bfloat16)
        with torch.no_grad():
            self.layer.weight.copy_(torch.randn(cfg.features, cfg.features, generator=g) / cfg.features**0.5)
        self.x = torch.randn(cfg.tokens, cfg.features, generator=g).to(device, torch.bfloat16)
        self.g = torch.randn(cfg.tokens, cfg.features, generator=g).to(device, torch.bfloat16).float()
        self.acc = None
        if variant != "plain":
            self.acc = gaengine.GradientAccumulator(self.layer, None, accumulation_steps=10**6, max_grad_norm=None,
                                                    backend=backend,
                                                    gradient_accumulation_fusion=variant == "fused")
        self.loss: torch.Tensor | None = None
        self.calls = 0

    def forward(self) -> None:
        self.loss = (self.layer(self.x).float() * self.g).sum()  # dY = G exactly

    def step(self) -> None:
        if self.acc is None:
            self.loss.backward()
        else:
            self.acc.backward(self.loss)
        self.loss = None
        self.calls += 1

    def error(self) -> float:
        """max |sum - n G^T X| / max |n G^T X| in fp64: the accumulated gradient's distance from the exact one."""
        exact = self.calls * (self.g.double().t() @ self.x.double())
        got = self.layer.weight.grad if self.acc is None else self.acc.main_grad.views[0].view_as(exact)
        return float((got.double() - exact).abs().max() / exact.abs().max())

    def close(self) -> None:
        if self.acc is not None:
            self.acc.zero_grad()
            self.acc.close()


def bench_fusion(device: torch.device, cfg: FusionConfig, *, warmup: int = 3,
                 repeats: int = 15) -> tuple[list[dict], dict]:
    """Time the three variants' backward per micro-batch in interleaved rounds (each forward untimed, right before).

    Returns the rows (``variant``, ``label``, ``ms`` median per backward, ``rel_error`` of the accumulated gradient
    against fp64 after all the rounds, ratio columns against the plain recipe) and the info (``features``,
    ``tokens``, ``backend``, ``skipped``: why rows are missing, or None). The gaengine variants run backend "cpu" /
    "cuda"; the fused one needs the native hooks of gaengine._C (and triton on CUDA): a variant that cannot run here
    is left out.
    """
    backend = "cuda" if device.type == "cuda" else "cpu"
    variants: dict[str, _Variant] = {}
    skipped: list[str] = []
    for name in VARIANTS:
        try:
            variants[name] = _Variant(name, cfg, device, backend)
        except (ValueError, RuntimeError) as exc:  # no extension, or no triton on CUDA: the rows that can run
            if name == "plain":
                raise
            skipped.append(f"{name}: {exc}")
    try:
        fns: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            name: (v.forward, v.step) for name, v in variants.items()}
        ms = time_rounds(fns, device=device, warmup=warmup, repeats=repeats).ms
        rows = []
        for name, v in variants.items():
            t = ms[name]
            rows.append({"variant": name, "label": VARIANTS[name], "device": str(device), "ms": statistics.median(t),
                         "min_ms": min(t), "max_ms": max(t), "rel_error": v.error(), "backward_passes": v.calls,
                         **ratio_stats(ms["plain"], t, baseline=name == "plain")})
    finally:
        for v in variants.values():
            v.close()
    return rows, {"features": cfg.features, "tokens": cfg.tokens, "backend": backend,
                  "skipped": "; ".join(skipped) or None}


FUSION_COLUMNS = [("label", "variant", "s"), ("ms", "ms/backward", ".3f"), ("rel_error", "rel. error vs fp64", ".1e"),
                  ("ratio_text", "vs plain [p25-p75]", "s")]


def print_tables(rows: Sequence[dict], info: dict) -> None:
    """The fusion table and what its columns mean."""
    print_table(display_rows(rows), FUSION_COLUMNS,
                f"fusion: one bf16 Linear({info['features']}, {info['features']}), {info['tokens']} tokens per "
                f"micro-batch, backend {info['backend']}", wrap=("label",))
    passes = rows[0]["backward_passes"] if rows else 0
    print_note(f"fusion: ms/backward = median over the timed rounds of one micro-batch's backward (the forward "
               f"untimed); rel. error = max |accumulated dW - n G^T X| / max |n G^T X| in fp64 after all "
               f"{passes} backward passes of the same micro-batch; vs plain = median per-round ratio of the plain "
               f"recipe's time to the variant's, > 1: faster. {RATIO_NOTE}.")
    if info["skipped"]:
        print_note(f"fusion: rows left out ({info['skipped']})")
