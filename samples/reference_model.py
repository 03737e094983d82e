"""A small Llama-style decoder written here, the reference model for tspc.

Token embedding, RMSNorm, rotary position embedding (RoPE), grouped-query attention through
``F.scaled_dot_product_attention``, a SwiGLU MLP and an LM head. Nothing in it knows about
tspc: ``torch.compile(model, backend="tsp")`` has to find its attention and MLP on its own.

``mask="causal"`` calls SDPA with ``is_causal=True``; ``mask="explicit"`` builds a boolean
``[S, S]`` lower-triangular mask in the forward and calls SDPA with ``attn_mask=...`` instead,
the shape of what Hugging Face models do under ``torch.compile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RefConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 160
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    mask: str = "causal"  # "causal" (is_causal=True) or "explicit" (a bool tril mask)
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        cfg = self.cfg
        b, s, _ = x.shape
        d = cfg.head_dim
        q = self.q_proj(x).view(b, s, cfg.num_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.num_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.num_kv_heads, d).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = cfg.num_heads // cfg.num_kv_heads
        if n_rep > 1:  # grouped-query attention, expanded the way Llama does it
            k = k[:, :, None].expand(b, cfg.num_kv_heads, n_rep, s, d).reshape(b, -1, s, d)
            v = v[:, :, None].expand(b, cfg.num_kv_heads, n_rep, s, d).reshape(b, -1, s, d)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        return x + self.mlp(self.post_attn_norm(x))


class RefModel(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = 1.0 / math.sqrt(self.cfg.hidden_size)
        for p in self.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = None
        if self.cfg.mask == "explicit":
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def build_reference_model(seed: int = 0, **overrides) -> RefModel:
    """The reference model with deterministic random weights (same on every rank)."""
    torch.manual_seed(seed)
    return RefModel(RefConfig(**overrides))
