"""Causal attention of this rank's zigzag query chunks against the full, true-order keys.

Rank p holds query chunks p and 2D-1-p (each c tokens, half its local queries). Chunk j attends
to keys [0, (j+1)c): a fully visible prefix [0, jc) and the causal diagonal block [jc, (j+1)c).
Each part goes through the fused attention kernel on its own (no mask for the prefix,
``is_causal`` for the diagonal) and the parts are merged by their log-sum-exps, so no c x S (let
alone S x S) mask is ever built. An optional key-validity vector (padding) becomes a
``[B, 1, 1, L]`` additive mask per block.

The keys may be fewer than 2Dc: a sequence padded to split into 2D chunks (``runtime/zigzag.py``)
has its padding at the end, and the keys come without it. Blocks are then cut at the last key;
a diagonal block cut short is square on its first rows only, and the query rows past it
(padding, computed but dropped by the caller) take no part in it. So no real query ever sees a
padding token, and the kernel's own causal convention for non-square blocks never matters.

Each block runs on the kernel that fits the device and dtype (``attention_kernels.py``: CPU
flash, CUDA/ROCm flash or memory-efficient, a math fallback). Backward uses the kernel's own
backward per block, given the *merged* output and log-sum-exp (the same identity ring attention
relies on: each block's softmax weights are ``exp(scores - lse_total)``). The merge is in fp32
on every device. Keys and values may have fewer heads than the queries (GQA); they are never
repeated (see ``attention_kernels.py``).

The op does no communication; it only needs ``rank`` and ``world`` to know which chunks it holds.
"""

from __future__ import annotations

import math

import torch

from .attention_kernels import block_backward, block_forward


def _blocks(rank: int, world: int, n_queries: int, n_keys: int):
    """(query chunk slice, [(key start, key stop, is_causal, query rows)]) for each local
    chunk: the block's keys, and how many of the chunk's first query rows take part in it."""
    if world == 1:
        return [((0, n_queries), [(0, n_keys, True, n_queries)])]
    c = n_queries // 2
    out = []
    for i, j in enumerate((rank, 2 * world - 1 - rank)):
        keys = []
        prefix = min(j * c, n_keys)
        if prefix > 0:
            keys.append((0, prefix, False, c))
        stop = min((j + 1) * c, n_keys)
        if stop > j * c:  # the diagonal, square: rows past the last key are padding
            keys.append((j * c, stop, True, stop - j * c))
        out.append(((i * c, (i + 1) * c), keys))
    return out


def _pad_rows(x: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``x`` ([B, H, r, ...]) extended along dim 2 to ``rows`` with ``value``."""
    if x.shape[2] == rows:
        return x
    extra = list(x.shape)
    extra[2] = rows - x.shape[2]
    return torch.cat([x, x.new_full(extra, value)], dim=2)


def _additive_mask(valid: torch.Tensor | None, k0: int, k1: int, dtype) -> torch.Tensor | None:
    if valid is None:
        return None
    v = valid[:, k0:k1]
    m = torch.zeros(v.shape, dtype=dtype, device=v.device).masked_fill(~v, float("-inf"))
    return m[:, None, None, :]


def _visible(valid: torch.Tensor | None, k0: int, k1: int, causal: bool, nq: int):
    """[B, 1, nq] bool: does each query row see at least one valid key in this block?"""
    if valid is None:
        return None
    v = valid[:, k0:k1]
    if causal:
        seen = torch.cummax(v.to(torch.int8), dim=1).values.bool()[:, :nq]
    else:
        seen = v.any(dim=1, keepdim=True).expand(v.shape[0], nq)
    return seen[:, None, :]


def _forward(q, k, v, rank, world, scale, valid):
    outs, lses = [], []
    for (q0, q1), keys in _blocks(rank, world, q.shape[2], k.shape[2]):
        qc = q[:, :, q0:q1]
        parts = []
        for k0, k1, causal, rows in keys:
            mask = _additive_mask(valid, k0, k1, q.dtype)
            o, lse = block_forward(
                qc[:, :, :rows],
                k[:, :, k0:k1],
                v[:, :, k0:k1],
                causal=causal,
                bias=mask,
                scale=scale,
            )
            vis = _visible(valid, k0, k1, causal, rows)
            if vis is not None:
                # a row that sees no key: CPU flash reports lse = 0, the efficient kernel may
                # give a NaN output (0/0); what it saw is nothing: output 0, lse -inf
                lse = lse.masked_fill(~vis, float("-inf"))
                o = o.masked_fill(~vis[..., None], 0.0)
            # rows that take no part in this block: nothing seen (output 0, lse -inf)
            parts.append((_pad_rows(o, q1 - q0, 0.0), _pad_rows(lse, q1 - q0, float("-inf"))))
        if len(parts) == 1:
            o, lse = parts[0]
        else:
            lse = torch.logaddexp(parts[0][1], parts[1][1])
            safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
            o = sum(p_o.float() * torch.exp(p_l - safe).unsqueeze(-1) for p_o, p_l in parts).to(
                q.dtype
            )
        outs.append(o)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    return out, lse


@torch.library.custom_op("tspc::zigzag_causal_attention", mutates_args=())
def zigzag_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rank: int,
    world: int,
    scale: float,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output [B, Hq, S/D, d], log-sum-exp [B, Hq, S/D] in fp32)."""
    out, lse = _forward(q, k, v, rank, world, scale, key_valid)
    return out.contiguous(), lse.contiguous()


@zigzag_causal_attention.register_fake
def _(q, k, v, rank, world, scale, key_valid=None):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, rank, world, scale, key_valid = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_valid)
    ctx.rank, ctx.world, ctx.scale = rank, world, scale
    ctx.has_valid = key_valid is not None


def _attention_backward(grad_out, q, k, v, out, lse, rank, world, scale, valid):
    # Rows that see no key at all: output 0, no gradient. lse=+inf makes every weight 0.
    lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
    dq_parts = []
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for (q0, q1), keys in _blocks(rank, world, q.shape[2], k.shape[2]):
        go = grad_out[:, :, q0:q1]
        qc = q[:, :, q0:q1]
        oc = out[:, :, q0:q1]
        lc = lse_b[:, :, q0:q1]
        dqc = None
        for k0, k1, causal, rows in keys:
            mask = _additive_mask(valid, k0, k1, q.dtype)
            dq_b, dk_b, dv_b = block_backward(
                go[:, :, :rows],
                qc[:, :, :rows],
                k[:, :, k0:k1],
                v[:, :, k0:k1],
                oc[:, :, :rows],
                lc[:, :, :rows],
                causal=causal,
                bias=mask,
                scale=scale,
            )
            dq_b = _pad_rows(dq_b, q1 - q0, 0.0)
            dqc = dq_b if dqc is None else dqc + dq_b
            dk[:, :, k0:k1] += dk_b
            dv[:, :, k0:k1] += dv_b
        dq_parts.append(dqc)
    dq = dq_parts[0] if len(dq_parts) == 1 else torch.cat(dq_parts, dim=2)
    return dq, dk, dv


# The backward is an op of its own, so aot_autograd records it as one node instead of tracing
# its 2D block kernels, slices and accumulations into the joint graph: per layer and head group
# that was most of the nodes the partitioner and the schedule had to process (compile time).
@torch.library.custom_op("tspc::zigzag_causal_attention_backward", mutates_args=())
def zigzag_causal_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rank: int,
    world: int,
    scale: float,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv) of ``zigzag_causal_attention`` given its output and lse."""
    dq, dk, dv = _attention_backward(grad_out, q, k, v, out, lse, rank, world, scale, key_valid)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@zigzag_causal_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, rank, world, scale, key_valid=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, valid = ctx.saved_tensors
    if not ctx.has_valid:
        valid = None
    dq, dk, dv = torch.ops.tspc.zigzag_causal_attention_backward(
        grad_out, q, k, v, out, lse, ctx.rank, ctx.world, ctx.scale, valid
    )
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("tspc::zigzag_causal_attention", _backward, setup_context=_setup)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    scale: float,
    rank: int = 0,
    world: int = 1,
) -> torch.Tensor:
    """Causal attention (plus optional key padding) in the form the passes emit.

    With ``world == 1`` it is plain causal attention over the whole sequence; the sequence
    pass sets ``rank``/``world`` when the queries are this rank's zigzag chunks.
    """
    return zigzag_causal_attention(q, k, v, rank, world, scale, key_valid)[0]


# Under torch.autocast the attention of the original graph (SDPA) runs in the autocast dtype;
# the projections feeding it come out in that dtype while RoPE may leave q/k in fp32. The op
# casts its floating inputs to the *current* autocast dtype, as SDPA's autocast policy does
# (torch.library.register_autocast would fix one dtype per device at registration).
_AUTOCAST_LIB = torch.library.Library("tspc", "IMPL")


def _autocast_kernel(device_type: str):
    def kernel(q, k, v, rank, world, scale, key_valid=None):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            ok = isinstance(t, torch.Tensor) and t.is_floating_point()
            return t.to(dtype) if ok and t.device.type == device_type else t

        with torch.autocast(device_type, enabled=False):
            return torch.ops.tspc.zigzag_causal_attention(
                cast(q), cast(k), cast(v), rank, world, scale, key_valid
            )

    return kernel


for _device in ("cpu", "cuda"):
    _AUTOCAST_LIB.impl(
        "zigzag_causal_attention",
        _autocast_kernel(_device),
        "Autocast" + torch._C._dispatch_key_for_device(_device),
    )
