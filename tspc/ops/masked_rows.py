"""Query rows whose mask hides every key, computed as the model's own softmax computes them.

With key padding some query rows see no key at all (left padding: the first positions of a
padded row). What such a row computes is fixed by the code the model runs:

* an additive mask ``m`` (eager ``softmax(q @ k^T * scale + mask) @ v``, or SDPA with a float
  mask, whose math backend is that formula): every score of the row is ``s + m``. With Hugging
  Face's ``m = finfo.min`` the sum rounds to ``m``, so the row attends *uniformly to every key*,
  and autograd's softmax backward at those uniform weights is its gradient (to q, k and v).
  With ``m = -inf`` eager softmax gives NaN and SDPA's safe softmax 0.
* a bool mask (SDPA): the row is 0 and takes no gradient (torch >= 2.5, every backend).

A fused kernel cannot give the additive case: it keeps a row's log-sum-exp, and at
``|m| = 3.4e38`` ``m + log(L)`` rounds to ``m``. Its forward still divides by the sum (uniform
weights), but its backward recomputes the weights as ``exp(s + m - lse) = 1`` instead of
``1 / L``, so every gradient of the row comes out L times too large (torch 2.13's CPU flash
kernel: ``aten._scaled_dot_product_flash_attention_for_cpu`` returns lse = finfo.min for such a
row; its math backend is right). So tspc never lets a fused kernel decide such a row:

* the zigzag kernel (``zigzag_attention.py``) leaves a row that sees no key out of every block,
  as it always did, and — where the mask is additive — fills it with ``rows_forward`` and adds
  ``rows_backward``'s gradient;
* ``masked_attention`` (SDPA with an additive mask the passes did not recognise) runs torch's
  SDPA and then ``tspc::attend_masked_rows``, which replaces the rows masked at every key and
  keeps their gradient away from SDPA's backward.

``rows_forward`` / ``rows_backward`` compute a row densely in fp32, the way eager code does:
its scores against every key plus its mask, softmax normalised by its sum (no log-sum-exp), and
the softmax backward at those weights. They touch only the rows that see no key, a tile of
``ROWS`` at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tspc.runtime.precision import accumulation_dtype, upcast

# An additive mask value at or below this hides a key (what ``passes/classify_mask.py`` reads
# as ``where(C, 0, very negative)`` and ``documents_of_mask`` as masked).
HIDDEN = -1e4

# Rows computed at a time: scores of ROWS x L per head, never S x S.
ROWS = 256


def _scores(q, k, bias, scale):
    """``q k^T * scale + bias`` in the accumulation dtype (fp32 for 16-bit floats) as [Hkv, g,
    n, L] (q [Hq, n, d], k [Hkv, L, d]; the g query heads of a KV head share it: GQA without
    repeating K)."""
    hq, n, d = q.shape
    hk = k.shape[0]
    qg = upcast(q).reshape(hk, hq // hk, n, d)
    s = torch.matmul(qg, upcast(k)[:, None].transpose(-1, -2)) * scale
    if isinstance(bias, torch.Tensor):  # [Hq|1, n, L]
        b = upcast(bias)
        b = b.reshape(hk, hq // hk, n, -1) if b.shape[0] == hq and hq > 1 else b[None]
        return s + b, qg
    return s + bias, qg


def _softmax(x: torch.Tensor, safe: bool) -> torch.Tensor:
    p = torch.softmax(x, dim=-1)
    if safe:  # SDPA's safe softmax: a row that is -inf at every key is 0, not NaN
        p = p.masked_fill(torch.isneginf(x).all(-1, keepdim=True), 0.0)
    return p


def rows_forward(q, k, v, bias, scale: float, safe: bool) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) @ v`` (accumulation dtype, [Hq, n, dv]) of query rows
    q [Hq, n, d] against every key k, v [Hkv, L, d]; ``bias`` a float (the same at every key)
    or a tensor broadcastable to [Hq|1, n, L]. ``safe``: SDPA's softmax (a row -inf everywhere
    is 0)."""
    hq, n = q.shape[:2]
    out = []
    for r0 in range(0, n, ROWS):
        b = bias if not isinstance(bias, torch.Tensor) else bias[:, r0 : r0 + ROWS]
        x, _ = _scores(q[:, r0 : r0 + ROWS], k, b, scale)
        p = _softmax(x, safe)
        out.append(torch.matmul(p, upcast(v)[:, None]).reshape(hq, -1, v.shape[-1]))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def rows_backward(go, q, k, v, bias, scale: float, safe: bool):
    """(dq [Hq, n, d], dk, dv [Hkv, L, d]) in the accumulation dtype of ``rows_forward`` for
    the output gradient ``go`` [Hq, n, dv]: autograd's softmax backward at the row's weights,
    as the eager code's autograd computes it."""
    hq, n = q.shape[:2]
    hk = k.shape[0]
    kf, vf = upcast(k)[:, None], upcast(v)[:, None]  # [Hkv, 1, L, d]
    dq = []
    dk = torch.zeros(k.shape, dtype=accumulation_dtype(k.dtype), device=k.device)
    dv = torch.zeros(v.shape, dtype=accumulation_dtype(v.dtype), device=v.device)
    for r0 in range(0, n, ROWS):
        b = bias if not isinstance(bias, torch.Tensor) else bias[:, r0 : r0 + ROWS]
        x, qg = _scores(q[:, r0 : r0 + ROWS], k, b, scale)
        p = _softmax(x, safe)  # [Hkv, g, r, L]
        gog = upcast(go[:, r0 : r0 + ROWS]).reshape(hk, hq // hk, -1, v.shape[-1])
        dv += torch.matmul(p.transpose(-1, -2), gog).sum(1)
        dp = torch.matmul(gog, vf.transpose(-1, -2))
        ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
        dq.append(torch.matmul(ds, kf).reshape(hq, -1, q.shape[-1]))
        dk += torch.matmul(ds.transpose(-1, -2), qg).sum(1)
    return (dq[0] if len(dq) == 1 else torch.cat(dq, dim=1)), dk, dv


# ------------------------------------------------------------------ the zigzag kernel's rows


def hidden_rule(dense: torch.Tensor | None, masked_value: float | None, safe: bool):
    """What a row that sees no key attends with: None (it is 0 and takes no gradient: a bool
    mask, or SDPA's safe softmax of -inf), a float (the additive mask's value, the same at
    every key) or "dense" (its own rows of the explicit float mask ``dense``)."""
    if dense is not None:
        return None if dense.dtype == torch.bool else "dense"
    if masked_value is None or (safe and masked_value == float("-inf")):
        return None
    return float(masked_value)


def hidden_bias(rule, dense: torch.Tensor | None, a: int, b: int, n_keys: int):
    """The bias ``rows_forward`` takes for query rows [a, b) (global positions) under
    ``rule``: the float, or those rows of the explicit mask."""
    return dense[:, :, a:b, :n_keys] if rule == "dense" else rule


def hidden_rows(seen: list, batch: int) -> torch.Tensor | None:
    """[B, M] bool: the rows of a tile that see no key in any of its blocks, from each block's
    ``[B|1, 1, M]`` rows that see one (None: every row of the block sees one); None when there
    are none (a host sync: only where such rows compute something)."""
    if not seen or any(s is None for s in seen):
        return None
    acc = seen[0]
    for s in seen[1:]:
        acc = acc | s
    hidden = ~acc[:, 0]
    return hidden.expand(batch, -1) if bool(hidden.any()) else None


def _tile_bias(bias, b: int, idx: torch.Tensor):
    """The bias ``rows_forward`` takes for rows ``idx`` of batch row ``b``: a float, or the
    rows of a [B|1, 1, M, L] mask tile ([1, n, L])."""
    return _rows_of(bias, b)[:, idx] if isinstance(bias, torch.Tensor) else bias


def fill_hidden_rows(out, hidden, q, k, v, bias, scale: float, safe: bool) -> torch.Tensor:
    """``out`` [B, Hq, M, dv] (a tile of the zigzag kernel) with each row ``hidden[b, m]``
    replaced by ``rows_forward`` of q [B, Hq, M, d] against every key k, v [B, Hkv, L, d]."""
    for b in range(out.shape[0]):
        idx = hidden[b].nonzero().flatten()
        if idx.numel():
            rows = rows_forward(q[b][:, idx], k[b], v[b], _tile_bias(bias, b, idx), scale, safe)
            out[b][:, idx] = rows.to(out.dtype)
    return out


def hidden_rows_backward(go, hidden, q, k, v, bias, scale: float, safe: bool, dq, dk, dv) -> None:
    """Adds the gradient of ``fill_hidden_rows``'s rows to dq (the tile's), dk and dv."""
    for b in range(go.shape[0]):
        idx = hidden[b].nonzero().flatten()
        if idx.numel():
            dq_b, dk_b, dv_b = rows_backward(
                go[b][:, idx], q[b][:, idx], k[b], v[b], _tile_bias(bias, b, idx), scale, safe
            )
            dq[b][:, idx] += dq_b.to(dq.dtype)
            dk[b] += dk_b.to(dk.dtype)
            dv[b] += dv_b.to(dv.dtype)


# ------------------------------------------------------------------ SDPA with an additive mask


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _hidden(mask: torch.Tensor, batch: int, rows: int) -> torch.Tensor:
    """[B, Hm, M] bool: rows of the additive ``mask`` that hide every key."""
    m = _as_4d(mask)
    h = (m <= HIDDEN).all(-1)
    return h.expand(batch, h.shape[1], rows)


def _rows_of(x: torch.Tensor, b: int) -> torch.Tensor:
    """Batch row ``b`` of ``x`` (a batch of 1 broadcasts)."""
    return x[b if x.shape[0] > 1 else 0]


def _masked_row_sets(mask, batch, n_rows):
    """Per batch row b with hidden rows: (b, their indices [n], which heads [Hm, n] hide them,
    the mask's rows [Hm, n, L])."""
    hidden = _hidden(mask, batch, n_rows)
    m4 = _as_4d(mask)
    for b in range(batch):
        idx = hidden[b].any(0).nonzero().flatten()
        if idx.numel() == 0:
            continue
        mb = _rows_of(m4, b)  # [Hm, M|1, L]
        bias = mb[:, idx] if mb.shape[1] > 1 else mb.expand(-1, idx.numel(), -1)
        yield b, idx, hidden[b][:, idx], bias


@torch.library.custom_op("tspc::attend_masked_rows", mutates_args=())
def attend_masked_rows(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    safe_softmax: bool,
) -> torch.Tensor:
    """``out`` — SDPA of q [B, Hq, M, d] over k, v [B|1, Hkv, L, d] under the additive ``mask``
    (broadcastable to [B, Hq, M, L]) — with every row that the mask hides from every key
    replaced by what ``softmax(q k^T * scale + mask) @ v`` gives it (``safe_softmax``: SDPA's
    softmax, a row -inf everywhere is 0)."""
    res = out.clone()
    for b, idx, heads, bias in _masked_row_sets(mask, q.shape[0], q.shape[2]):
        rows = rows_forward(q[b][:, idx], _rows_of(k, b), _rows_of(v, b), bias, scale, safe_softmax)
        rows = rows.to(out.dtype)
        res[b][:, idx] = torch.where(heads[..., None], rows, res[b][:, idx])
    return res


@attend_masked_rows.register_fake
def _(out, q, k, v, mask, scale, safe_softmax):
    return torch.empty_like(out)


@torch.library.custom_op("tspc::attend_masked_rows_backward", mutates_args=())
def attend_masked_rows_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    safe_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the gradient left to SDPA — ``grad`` with the hidden rows zeroed —, dq, dk, dv of the
    hidden rows)."""
    rest = grad.clone()
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for b, idx, heads, bias in _masked_row_sets(mask, q.shape[0], q.shape[2]):
        go = grad[b][:, idx] * heads[..., None]  # only the heads the mask hides them from
        kb, vb = _rows_of(k, b), _rows_of(v, b)
        dq_b, dk_b, dv_b = rows_backward(go, q[b][:, idx], kb, vb, bias, scale, safe_softmax)
        dq[b][:, idx] = dq_b.to(q.dtype)
        _rows_of(dk, b).add_(dk_b.to(k.dtype))
        _rows_of(dv, b).add_(dv_b.to(v.dtype))
        rest[b][:, idx] = grad[b][:, idx] * ~heads[..., None]
    return rest, dq, dk, dv


@attend_masked_rows_backward.register_fake
def _(grad, q, k, v, mask, scale, safe_softmax):
    return torch.empty_like(grad), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    _, q, k, v, mask, scale, safe = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.scale, ctx.safe = scale, safe


def _backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    rest, dq, dk, dv = torch.ops.tspc.attend_masked_rows_backward(
        grad, q, k, v, mask, ctx.scale, ctx.safe
    )
    return rest, dq, dk, dv, None, None, None


torch.library.register_autograd("tspc::attend_masked_rows", _backward, setup_context=_setup)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    safe_softmax: bool = True,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (same arguments) whose rows that an additive float
    mask hides from every key are what ``softmax(q k^T * scale + mask) @ v`` gives them, forward
    and backward, on every device and kernel (see the module doc). ``safe_softmax=False``: the
    softmax of eager code (a row -inf at every key is NaN, as the model's own code gives)."""
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )  # fmt: skip
    additive = isinstance(attn_mask, torch.Tensor) and attn_mask.dtype.is_floating_point
    if not additive or dropout_p or is_causal or query.dim() != 4:
        return out
    s = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    return torch.ops.tspc.attend_masked_rows(out, query, key, value, attn_mask, s, safe_softmax)
