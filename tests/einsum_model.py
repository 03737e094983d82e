"""A decoder written with ``einsum``, as research code often is (issue 26's peer zoo).

Attention projects q, k and v with one einsum over a fused ``[3, heads, head_dim, dim]`` weight,
scores and mixes values with einsums, and projects out with an einsum over ``[heads, head_dim,
dim]``; the feed-forward is a GLU whose fused input projection ``[2F, dim]`` is applied with an
einsum and chunked into gate and up. Nothing here is a ``nn.Linear`` or an SDPA call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EinsumAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wqkv = nn.Parameter(torch.randn(3, heads, self.head_dim, dim) * dim**-0.5)
        self.wo = nn.Parameter(torch.randn(heads, self.head_dim, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = torch.einsum("bsd,thed->tbhse", x, self.wqkv).unbind(0)
        scores = torch.einsum("bhqe,bhke->bhqk", q, k) * self.head_dim**-0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("bhqk,bhke->bhqe", probs, v)
        return torch.einsum("bhse,hed->bsd", out, self.wo)


class EinsumGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(2 * hidden, dim) * dim**-0.5)  # gate and up, fused
        self.w_out = nn.Parameter(torch.randn(dim, hidden) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("bsd,fd->bsf", x, self.w_in).chunk(2, dim=-1)
        return torch.einsum("bsf,df->bsd", F.silu(gate) * up, self.w_out)


class EinsumBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = EinsumAttention(dim, heads), EinsumGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class EinsumDecoder(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, vocab]``; causal."""

    def __init__(
        self, vocab: int = 128, dim: int = 64, heads: int = 4, hidden: int = 128, layers: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(EinsumBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
