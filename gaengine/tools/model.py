"""A small byte-level GPT for ``gaengine train``: the workload of the end-to-end job and its benchmarks.

GPT-2 layout (nanoGPT-style): learned token and position embeddings, pre-LayerNorm blocks of causal
self-attention (``F.scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm, and an output head
whose weight is the token embedding (tied, as in GPT-2). The vocabulary is the 256 byte values, so any
file is a valid corpus and no tokenizer is involved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 256
    """Number of token ids; 256 for bytes."""
    context_len: int = 128
    """Longest sequence the position embedding covers, in tokens."""
    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "n_layers", "d_model", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")


class _CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, n_heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = _CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, config.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT; ``forward(idx, targets)`` returns the mean cross-entropy over all tokens.

    ``idx``, ``targets``: ``(batch, seq_len)`` int64 token ids on the model's device,
    ``seq_len <= config.context_len``. Without ``targets`` the logits ``(batch, seq_len, vocab_size)`` are
    returned in the parameter dtype. The loss is computed in fp32 whatever the parameter dtype.
    Initialization follows GPT-2: N(0, 0.02) weights, residual projections scaled by
    ``1/sqrt(2 * n_layers)``, zero biases.
    """

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied, as in GPT-2: one Parameter, two uses
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp[2].weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Number of distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.context_len:
            raise ValueError(f"sequence length {t} exceeds context_len {self.config.context_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
