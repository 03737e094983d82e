"""One block of attention (queries x keys) with its log-sum-exp, on the kernel that fits the device.

The zigzag kernel (``zigzag_attention.py``) cuts a rank's causal attention into blocks — a
fully visible key prefix and a square causal diagonal — and merges them by their log-sum-exps.
This module runs one block forward (``block_forward`` -> output, fp32 log-sum-exp ``[B, Hq, M]``)
or backward (``block_backward``, given the *merged* output and log-sum-exp) on:

==================  =====================================================================
``cpu_flash``       CPU, any dtype: ``aten._scaled_dot_product_flash_attention_for_cpu``
                    (takes an additive mask; grouped heads natively)
``cuda_flash``      CUDA/ROCm, fp16/bf16, head dim a multiple of 8 and <= 256, no mask:
                    ``aten._scaled_dot_product_flash_attention`` (grouped heads natively on
                    CUDA)
``cuda_efficient``  CUDA/ROCm otherwise (fp32, a key-padding mask):
                    ``aten._scaled_dot_product_efficient_attention(compute_log_sumexp=True)``
``math``            anything else (another device, an odd head dim): matmuls over the block
==================  =====================================================================

Grouped-query attention never repeats K/V (a g-fold copy of the gathered keys and values).
Where the kernel has no grouped heads, the g query heads of one KV head are folded into the
query rows (``[B, Hkv, g*M, d]``) for a block without causal structure, and looped over (views,
one call each) for a causal block, whose mask does not survive the fold.

Conventions read from torch 2.13 (``torch/_meta_registrations.py``, native_functions.yaml):
the efficient kernel's log-sum-exp is ``[B, H, ceil(M/32)*32]`` on CUDA (padding rows +inf)
and ``[B, H, M]`` on ROCm, and its backward wants it back in that shape; its bias must be
expanded to ``[B, H, M, L]`` with a last-dim stride aligned to 16 (what SDPA's
``preprocess_mask`` does). Flash's backward takes undefined ``cum_seq`` tensors for dense
batches and ignores the RNG state without dropout; so does the efficient backward.
"""

from __future__ import annotations

import math

import torch

from tspc.runtime.precision import HALF as _HALF
from tspc.runtime.precision import upcast

aten = torch.ops.aten

KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "math")


def choose_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """Which kernel runs a block on ``device`` (see the module doc). Rank-independent."""
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda":  # ROCm builds use the same device type and aten ops
        if dtype in _HALF and not masked and head_dim % 8 == 0 and head_dim <= 256:
            return "cuda_flash"
        if dtype in (*_HALF, torch.float32) and head_dim % 8 == 0:
            return "cuda_efficient"
    return "math"


def _native_gqa(kernel: str) -> bool:
    # CUDA's flash (flash-attn 2) takes fewer KV heads; ROCm's is not known to: fold there.
    return kernel == "cpu_flash" or (kernel == "cuda_flash" and not torch.version.hip)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------- per kernel, equal heads


def _efficient_lse_len(m: int) -> int:
    return m if torch.version.hip else math.ceil(m / 32) * 32


def _efficient_bias(bias, q, k):
    """SDPA's preprocess_mask: last dim padded to 16 for stride alignment, expanded."""
    if bias is None:
        return None
    n = bias.shape[-1]
    pad = (-n) % 16
    if pad:
        bias = torch.nn.functional.pad(bias, (0, pad))[..., :n]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _forward_same_heads(kernel, q, k, v, causal, bias, scale):
    if kernel == "cpu_flash":
        # The aten kernel, unlike F.scaled_dot_product_attention in front of it, does not check
        # strides: a head dim that is not the innermost (``view(b, s, d, h).permute(0, 3, 1,
        # 2)``) reads garbage. Copy such operands, as the public SDPA does.
        q, k, v = map(_last_dim_contiguous, (q, k, v))
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    if kernel == "cuda_flash":
        q, k, v = map(_last_dim_contiguous, (q, k, v))
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1]
    if kernel == "cuda_efficient":
        q, k, v = map(_last_dim_contiguous, (q, k, v))
        b = _efficient_bias(bias, q, k)
        o, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, b, True, 0.0, causal, scale=scale
        )
        return o, lse[..., : q.shape[2]]
    return _math_forward(q, k, v, causal, bias, scale)


def _backward_same_heads(kernel, go, q, k, v, out, lse, causal, bias, scale):
    if kernel == "cpu_flash":
        go, q, k, v, out = map(_last_dim_contiguous, (go, q, k, v, out))
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if kernel == "cuda_flash":
        go, q, k, v, out = map(_last_dim_contiguous, (go, q, k, v, out))
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # no dropout: unread
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        m, n = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_flash_attention_backward(
            go, q, k, v, out, lse.contiguous(), None, None, m, n, 0.0, causal, seed, offset,
            scale=scale,
        )  # fmt: skip
    if kernel == "cuda_efficient":
        go, q, k, v, out = map(_last_dim_contiguous, (go, q, k, v, out))
        m = q.shape[2]
        pad = _efficient_lse_len(m) - m
        lse_k = (
            lse if not pad else torch.cat([lse, lse.new_full((*lse.shape[:2], pad), math.inf)], 2)
        )
        seed = torch.empty((), dtype=torch.long)  # no dropout: unread
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            go, q, k, v, _efficient_bias(bias, q, k), out, lse_k.contiguous(), seed, seed, 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    return _math_backward(go, q, k, v, out, lse, causal, bias, scale)


# ---------------------------------------------------------------------- math (grouped natively)


def _math_scores(q, k, causal, bias, scale):
    """Scores [B, Hkv, g, M, L] in the accumulation dtype (fp32 for 16-bit floats): q [B, Hq,
    M, d] grouped over k [B, Hkv, L, d] by broadcasting (no K copy)."""
    b, hq, m, d = q.shape
    hk = k.shape[1]
    qg = upcast(q).reshape(b, hk, hq // hk, m, d)
    s = torch.matmul(qg, upcast(k)[:, :, None].transpose(-1, -2)) * scale
    if bias is not None:
        s = s + upcast(bias)[:, :, None]
    if causal:
        keep = torch.ones(m, k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    return s


def _math_forward(q, k, v, causal, bias, scale):
    s = _math_scores(q, k, causal, bias, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    o = torch.matmul(p, upcast(v)[:, :, None])
    return o.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _math_backward(go, q, k, v, out, lse, causal, bias, scale):
    b, hq, m, d = q.shape
    hk = k.shape[1]
    s = _math_scores(q, k, causal, bias, scale)
    p = torch.exp(s - lse.reshape(b, hk, hq // hk, m)[..., None])
    gog = upcast(go).reshape(b, hk, hq // hk, m, -1)
    dv = torch.matmul(p.transpose(-1, -2), gog).sum(2)
    dp = torch.matmul(gog, upcast(v)[:, :, None].transpose(-1, -2))
    delta = (gog * upcast(out).reshape(gog.shape)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, upcast(k)[:, :, None]).flatten(1, 2)
    qg = upcast(q).reshape(b, hk, hq // hk, m, d)
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------- grouped heads


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, M, ...] -> [B, Hkv, g*M, ...]: a KV head's query heads one after the other."""
    b, hq, m = x.shape[:3]
    return x.reshape(b, kv_heads, (hq // kv_heads) * m, *x.shape[3:])


def _unfold(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    b, hk, gm = x.shape[:3]
    return x.reshape(b, q_heads, gm // (q_heads // hk), *x.shape[3:])


def _member(x: torch.Tensor, kv_heads: int, j: int) -> torch.Tensor:
    """Query head j of every KV group: [B, Hq, M, ...] -> [B, Hkv, M, ...] (a view)."""
    b, hq = x.shape[:2]
    return x.view(b, kv_heads, hq // kv_heads, *x.shape[2:])[:, :, j]


def _bias_per_key(bias) -> bool:
    """No bias, or one that is the same for every query row (it survives folding the query
    heads into the rows); a band's ``[., 1, M, L]`` mask does not."""
    return bias is None or bias.shape[-2] == 1


def block_forward(q, k, v, *, causal: bool, bias, scale: float):
    """Attention of q [B, Hq, M, d] over k, v [B, Hkv, L, d] (Hkv divides Hq; causal blocks are
    square); ``bias`` None or additive ``[B|1, 1, 1|M, L]`` in q's dtype (key padding, a band's
    mask). Returns (output [B, Hq, M, d], log-sum-exp [B, Hq, M] fp32)."""
    kernel = choose_kernel(q.device, q.dtype, q.shape[-1], bias is not None)
    hq, hk = q.shape[1], k.shape[1]
    if hq == hk or _native_gqa(kernel) or kernel == "math":
        return _forward_same_heads(kernel, q, k, v, causal, bias, scale)
    if not causal and _bias_per_key(bias):
        o, lse = _forward_same_heads(kernel, _fold(q, hk), k, v, False, bias, scale)
        return _unfold(o, hq), _unfold(lse, hq)
    parts = [
        _forward_same_heads(kernel, _member(q, hk, j), k, v, causal, bias, scale)
        for j in range(hq // hk)
    ]
    o = torch.stack([p[0] for p in parts], 2).flatten(1, 2)
    lse = torch.stack([p[1] for p in parts], 2).flatten(1, 2)
    return o, lse


def block_backward(go, q, k, v, out, lse, *, causal: bool, bias, scale: float):
    """(dq [B, Hq, M, d], dk, dv [B, Hkv, L, d]) of ``block_forward``'s block, given the
    output and log-sum-exp of the *whole* row (the merge of every block the row attends)."""
    kernel = choose_kernel(q.device, q.dtype, q.shape[-1], bias is not None)
    hq, hk = q.shape[1], k.shape[1]
    if hq == hk or _native_gqa(kernel) or kernel == "math":
        return _backward_same_heads(kernel, go, q, k, v, out, lse, causal, bias, scale)
    if not causal and _bias_per_key(bias):
        f = lambda x: _fold(x, hk)  # noqa: E731
        dq, dk, dv = _backward_same_heads(
            kernel, f(go), f(q), k, v, f(out), f(lse), False, bias, scale
        )
        return _unfold(dq, hq), dk, dv
    dqs, dk, dv = [], None, None
    for j in range(hq // hk):
        go_j, q_j, out_j, lse_j = (_member(x, hk, j) for x in (go, q, out, lse))
        dq_j, dk_j, dv_j = _backward_same_heads(
            kernel, go_j, q_j, k, v, out_j, lse_j, causal, bias, scale
        )
        dqs.append(dq_j)
        dk = dk_j if dk is None else dk + dk_j
        dv = dv_j if dv is None else dv + dv_j
    return torch.stack(dqs, 2).flatten(1, 2), dk, dv
