"""Attention and MLP blocks written the way libraries outside transformers write them (no
import of those libraries: each form is copied in spirit, small and hand-written).

- ``fused_gqa``: torchtitan-style fused ``wqkv`` serving q (8 heads) and k/v (2 heads) from one
  weight, split by ``split``, GQA repeated torchtitan's way (``x[:, :, :, None, :].expand(...)
  .reshape(...)`` in the [batch, seq, heads, dim] layout, then ``transpose``);
  ``fused_gqa_kv_first_bias``: the same weight holding k, v, then q, with a bias.
- ``tune_gqa``: torchtune-style GQA: k/v viewed ``[b, s, kv, 1, d]``, expanded and reshaped to the
  query heads *before* RoPE and the transpose.
- ``tune_gqa_flatten``: torchtune's later GQA, ``unsqueeze(2).expand(...).flatten(1, 2)`` right
  before the call.
- ``einsum``: projections, scores and the value product written with ``einsum``, an additive
  causal mask, eager softmax; a GLU feed-forward written as one ``einsum`` projection whose output
  is ``chunk``-ed into gate and up.
- ``flex`` / ``flex_window``: ``torch.nn.attention.flex_attention`` with a causal
  ``BlockMask`` / a causal sliding window (FlexAttention has no backward on CPU: forward only).
- ``v_dim``: values with a head size different from the queries' and keys' (SDPA allows it).
- ``l2norm_qk``: q/k and the input normalised by ``F.normalize`` (x-transformers' q/k norm and
  RMSNorm): token-wise and head-local along the last dim.
- ``heads_innermost_in`` / ``_out``: features read or written heads-innermost (einops'
  ``(d h)``): skipped with the reason (they ran matched, with wrong or NaN outputs, before).
- ``tiled_gqa``: K/V heads repeated tiled (einops' ``(r h)``): no head group holds its own keys,
  so it is skipped with that reason, never run with another head's keys.
- ``nanogpt`` / ``nanogpt_finfo``: nanoGPT's eager attention, the causal mask applied with
  ``masked_fill`` (``tril(ones) == 0`` filled with ``-inf``; ``~tril`` with ``finfo.min``).

Every form has a gated MLP (``w2(silu(w1(x)) * w3(x))``, or the einsum GLU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

H, HEADS, KV, D_HEAD, VOCAB, FFN = 64, 8, 2, 8, 128, 128
V_HEAD = 4  # the ``v_dim`` form's value head size
WINDOW = 5  # the ``flex_window`` form's sliding window (keys)


def _rope(x, s: int):
    """RoPE by rotate-half on ``[b, s, heads, d]``."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))
    f = torch.arange(s, device=x.device).float()[:, None] * inv
    f = torch.cat((f, f), -1)[None, :, None, :]
    x1, x2 = x.chunk(2, -1)
    return x * f.cos() + torch.cat((-x2, x1), -1) * f.sin()


def _projections(m: nn.Module, names: str, kv_out: int, v_out: int, o_in: int) -> None:
    """Bias-free q/k/v/o ``nn.Linear`` layers named by ``names`` ("q k v o")."""
    q, k, v, o = names.split()
    widths = {q: (H, HEADS * D_HEAD), k: (H, kv_out), v: (H, v_out), o: (o_in, H)}
    for name, (n_in, n_out) in widths.items():
        setattr(m, name, nn.Linear(n_in, n_out, bias=False))


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, FFN, bias=False)
        self.w3 = nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class EinsumGLU(nn.Module):
    """One projection into gate and up (``[2F, h]``), chunked; all three by ``einsum``."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(2 * FFN, H) * 0.05)
        self.w_out = nn.Parameter(torch.randn(H, FFN) * 0.05)

    def forward(self, x):
        gate, up = torch.einsum("bsd,fd->bsf", x, self.w_in).chunk(2, dim=-1)
        return torch.einsum("bsf,df->bsd", F.gelu(gate) * up, self.w_out)


class FusedGQA(nn.Module):
    """``kv_first``: the fused weight holds k, v, then q; ``bias``: with a bias."""

    def __init__(self, bias: bool = False, kv_first: bool = False):
        super().__init__()
        self.kv_first = kv_first
        self.wqkv = nn.Linear(H, (HEADS + 2 * KV) * D_HEAD, bias=bias)
        self.wo = nn.Linear(HEADS * D_HEAD, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        if self.kv_first:
            k, v, q = self.wqkv(x).split([KV * D_HEAD, KV * D_HEAD, HEADS * D_HEAD], dim=-1)
        else:
            q, k, v = self.wqkv(x).split([HEADS * D_HEAD, KV * D_HEAD, KV * D_HEAD], dim=-1)
        q = _rope(q.view(b, s, HEADS, D_HEAD), s)
        k = _rope(k.view(b, s, KV, D_HEAD), s)
        v = v.view(b, s, KV, D_HEAD)
        rep = HEADS // KV
        k = k[:, :, :, None, :].expand(b, s, KV, rep, D_HEAD).reshape(b, s, HEADS, D_HEAD)
        v = v[:, :, :, None, :].expand(b, s, KV, rep, D_HEAD).reshape(b, s, HEADS, D_HEAD)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TuneGQA(nn.Module):
    def __init__(self):
        super().__init__()
        _projections(
            self, "q_proj k_proj v_proj output_proj", KV * D_HEAD, KV * D_HEAD, HEADS * D_HEAD
        )

    def forward(self, x):
        b, s, _ = x.shape
        rep = HEADS // KV
        q = self.q_proj(x).view(b, s, HEADS, D_HEAD)
        k = self.k_proj(x).view(b, s, KV, 1, D_HEAD)
        v = self.v_proj(x).view(b, s, KV, 1, D_HEAD)
        k = k.expand(b, s, KV, rep, D_HEAD).reshape(b, s, -1, D_HEAD)
        v = v.expand(b, s, KV, rep, D_HEAD).reshape(b, s, -1, D_HEAD)
        q, k = _rope(q, s), _rope(k, s)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, -1))


class TuneGQAFlatten(TuneGQA):
    """torchtune's later spelling: ``unsqueeze(2).expand(...).flatten(1, 2)`` after the
    transpose, right before the call."""

    def forward(self, x):
        b, s, _ = x.shape
        rep = HEADS // KV
        q = _rope(self.q_proj(x).view(b, s, HEADS, D_HEAD), s).transpose(1, 2)
        k = _rope(self.k_proj(x).view(b, s, KV, D_HEAD), s).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV, D_HEAD).transpose(1, 2)
        k, v = (t.unsqueeze(2).expand(b, KV, rep, s, D_HEAD).flatten(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, -1))


class EinsumAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(HEADS * D_HEAD, H) * 0.05)
        self.wk = nn.Parameter(torch.randn(HEADS * D_HEAD, H) * 0.05)
        self.wv = nn.Parameter(torch.randn(HEADS * D_HEAD, H) * 0.05)
        self.wo = nn.Parameter(torch.randn(H, HEADS * D_HEAD) * 0.05)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            torch.einsum("bsd,ed->bse", x, w).view(b, s, HEADS, D_HEAD).permute(0, 2, 1, 3)
            for w in (self.wq, self.wk, self.wv)
        )
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * D_HEAD**-0.5
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        probs = (scores + mask).softmax(dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        return torch.einsum("bse,de->bsd", out.permute(0, 2, 1, 3).reshape(b, s, -1), self.wo)


class FlexAttention(nn.Module):
    """``flex_attention`` with a causal ``BlockMask``, or a causal sliding window of
    ``window`` keys."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window
        _projections(self, "wq wk wv wo", HEADS * D_HEAD, HEADS * D_HEAD, HEADS * D_HEAD)

    def forward(self, x):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, HEADS, D_HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )

        window = self.window

        def causal(b_, h_, q_idx, kv_idx):
            return q_idx >= kv_idx

        def sliding(b_, h_, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        mask_mod = causal if window is None else sliding
        mask = create_block_mask(mask_mod, None, None, s, s, device=str(x.device))
        out = flex_attention(q, k, v, block_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class L2NormQK(nn.Module):
    """q and k l2-normalised per head with ``F.normalize`` and scaled by a learnt temperature
    (x-transformers' ``attn_qk_norm``), the input normalised the same way (its RMSNorm)."""

    def __init__(self):
        super().__init__()
        _projections(self, "q k v o", HEADS * D_HEAD, HEADS * D_HEAD, HEADS * D_HEAD)
        self.gamma = nn.Parameter(torch.ones(H))

    def forward(self, x):
        b, s, _ = x.shape
        x = F.normalize(x, dim=-1) * H**0.5 * self.gamma
        q, k, v = (t(x).view(b, s, HEADS, D_HEAD).transpose(1, 2) for t in (self.q, self.k, self.v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=10.0)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class TiledGQA(nn.Module):
    """GQA repeated the way einops' ``repeat(k, 'b h n d -> b (r h) n d')`` does it
    (x-transformers): query head i reads KV head i mod KV, not i // (HEADS / KV)."""

    def __init__(self):
        super().__init__()
        _projections(self, "q k v o", KV * D_HEAD, KV * D_HEAD, HEADS * D_HEAD)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, D_HEAD).transpose(1, 2)
        k, v = (t(x).view(b, s, KV, D_HEAD).transpose(1, 2) for t in (self.k, self.v))
        rep = HEADS // KV
        k, v = (
            t[:, None].expand(b, rep, KV, s, D_HEAD).reshape(b, HEADS, s, D_HEAD) for t in (k, v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class HeadsInnermost(nn.Module):
    """Features read with the heads innermost, einops' ``(d h)``: ``inward`` the projections'
    outputs viewed ``[b, s, d, h]`` then permuted (here d = h, so a head group of the
    projection lands on the call's head_dim), else the output laid out ``[b, s, d, h]`` before
    the output projection (a head group's columns strided). Both are skipped with the reason."""

    def __init__(self, inward: bool):
        super().__init__()
        self.inward = inward
        _projections(self, "q k v o", HEADS * D_HEAD, HEADS * D_HEAD, HEADS * D_HEAD)

    def forward(self, x):
        b, s, _ = x.shape
        if self.inward:
            q, k, v = (
                t(x).view(b, s, D_HEAD, HEADS).permute(0, 3, 1, 2) for t in (self.q, self.k, self.v)
            )
        else:
            q, k, v = (
                t(x).view(b, s, HEADS, D_HEAD).transpose(1, 2) for t in (self.q, self.k, self.v)
            )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.inward:
            return self.o(out.transpose(1, 2).reshape(b, s, -1))
        return self.o(out.permute(0, 2, 3, 1).reshape(b, s, -1))


class NanoGPTAttention(nn.Module):
    """nanoGPT / minGPT's eager path: one fused ``c_attn`` (with a bias) split into q, k, v,
    the causal mask applied with ``masked_fill`` (``tril(ones) == 0`` to ``-inf``); ``fill``:
    another spelling, a bool ``~tril`` filled with ``torch.finfo(dtype).min``."""

    def __init__(self, fill: bool = False):
        super().__init__()
        self.fill = fill
        self.c_attn = nn.Linear(H, 3 * H)
        self.c_proj = nn.Linear(H, H)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (t.view(b, s, HEADS, c // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.fill:
            hide = ~torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(hide, torch.finfo(att.dtype).min)
        else:
            causal = torch.tril(torch.ones(s, s, device=x.device)).view(1, 1, s, s)
            att = att.masked_fill(causal == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, s, c)
        return self.c_proj(y)


class VDimAttention(nn.Module):
    def __init__(self):
        super().__init__()
        _projections(self, "q k v o", HEADS * D_HEAD, HEADS * V_HEAD, HEADS * V_HEAD)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, D_HEAD).transpose(1, 2)
        k = self.k(x).view(b, s, HEADS, D_HEAD).transpose(1, 2)
        v = self.v(x).view(b, s, HEADS, V_HEAD).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


ATTENTION = {
    "fused_gqa": FusedGQA,
    "fused_gqa_kv_first_bias": lambda: FusedGQA(bias=True, kv_first=True),
    "tune_gqa": TuneGQA,
    "tune_gqa_flatten": TuneGQAFlatten,
    "einsum": EinsumAttention,
    "flex": FlexAttention,
    "flex_window": lambda: FlexAttention(window=WINDOW),
    "v_dim": VDimAttention,
    "nanogpt": NanoGPTAttention,
    "nanogpt_finfo": lambda: NanoGPTAttention(fill=True),
    "tiled_gqa": TiledGQA,
    "l2norm_qk": L2NormQK,
    "heads_innermost_in": lambda: HeadsInnermost(inward=True),
    "heads_innermost_out": lambda: HeadsInnermost(inward=False),
}


class Block(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.attn = ATTENTION[form]()
        self.mlp = EinsumGLU() if form == "einsum" else GatedMLP()
        self.norm1, self.norm2 = nn.RMSNorm(H), nn.RMSNorm(H)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PeerModel(nn.Module):
    """``layers`` blocks of one form, or one block per form of a list of forms."""

    def __init__(self, form: str | list[str], layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, H)
        forms = [form] * layers if isinstance(form, str) else form
        self.layers = nn.ModuleList(Block(f) for f in forms)
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


FORMS = tuple(ATTENTION)
