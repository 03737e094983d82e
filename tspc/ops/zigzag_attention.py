"""Causal attention of this rank's zigzag query chunks against the full, true-order keys.

Rank p holds query chunks p and 2D-1-p (each c tokens, half its local queries). Chunk j attends
to keys [0, (j+1)c): a fully visible prefix [0, jc) and the causal diagonal block [jc, (j+1)c).
Each part goes through the fused attention kernel on its own (no mask for the prefix,
``is_causal`` for the diagonal) and the parts are merged by their log-sum-exps, so no c x S (let
alone S x S) mask is ever built. An optional key-validity vector (padding) becomes a
``[B, 1, 1, L]`` additive mask per block.

A sliding window (query q sees keys q - W < k <= q) and documents (q sees only keys of its own
document: contiguous runs of equal ``doc_ids``, per batch row) narrow each query's keys to
[lo(q), q] with lo(q) = max(document start, q - W + 1). The rows are then cut into tiles of at
most ``TILE`` (split again at a document start); a tile [a, b) whose rows all begin at or
before a runs as a partial edge (a band: an additive mask of at most TILE x TILE), a fully
visible middle and the causal diagonal; any other tile (a window narrower than the tile, a
tile holding several documents) is one band block of at most TILE x 2 TILE. Key blocks
wholly outside the window or the document are never touched: the work is the band's, and no
mask is larger than a tile's. Batch rows whose documents differ run one at a time.

The keys may be fewer than 2Dc: a sequence padded to split into 2D chunks (``runtime/zigzag.py``)
has its padding at the end, and the keys come without it. Query rows past the last key are
padding: they take part in no block (output 0, lse -inf), so no real query ever sees a padding
token.

Each block runs on the kernel that fits the device and dtype (``attention_kernels.py``: CPU
flash, CUDA/ROCm flash or memory-efficient, a math fallback). Backward uses the kernel's own
backward per block, given the *merged* output and log-sum-exp (the same identity ring attention
relies on: each block's softmax weights are ``exp(scores - lse_total)``). The merge is in fp32
(float64 for a float64 model). K/V may have fewer heads than Q (GQA), never repeated.

The op does no communication; it only needs ``rank`` and ``world`` to know which chunks it holds.
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass

import torch

from tspc.runtime.compat import dispatch_key_for_device, tensor_version
from tspc.runtime.precision import accumulation_dtype, upcast

from .attention_kernels import block_backward, block_forward
from .masked_rows import (
    HIDDEN,
    fill_hidden_rows,
    hidden_bias,
    hidden_rows,
    hidden_rows_backward,
    hidden_rule,
)

# ----------------------------------------------------------------------------- the block plan

# Query tile of the banded and document paths: a band block's mask is at most TILE x 2*TILE.
TILE = 256


@dataclass(frozen=True)
class Block:
    """Query rows [q0, q1) (global positions) against keys [k0, k1).

    ``kind``: "full" (every query sees every key), "causal" (square, q0 == k0: the diagonal),
    or "band" (query q sees key k iff ``lo(q) <= k <= q``: a small additive mask)."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str


class _Structure:
    """``lo(q)``, the first key query q may see: max(start of q's document, q - window + 1)."""

    def __init__(self, window: int | None, starts: list[int] | None, dense=None):
        self.window = window
        self.starts = starts or [0]
        self.dense = dense  # this group's rows of an explicit mask ("dense" blocks)

    def start(self, q: int) -> int:
        return self.starts[bisect.bisect_right(self.starts, q) - 1]

    def lo(self, q: int) -> int:
        lo = self.start(q)
        return lo if self.window is None else max(lo, q - self.window + 1)

    def starts_in(self, a: int, b: int) -> list[int]:
        """Document starts s with a < s < b."""
        i, j = bisect.bisect_right(self.starts, a), bisect.bisect_left(self.starts, b)
        return self.starts[i:j]


def _segment_blocks(st: _Structure, a: int, b: int) -> list[Block]:
    """Blocks of query rows [a, b): where every row's first key lies at or before ``a`` (one
    document, rows no farther apart than the window), a partial edge (band), a fully visible
    middle and the causal diagonal; otherwise one band block over keys [lo(a), b)."""
    lo_a, lo_z = st.lo(a), st.lo(b - 1)
    if lo_z > a:
        return [Block(a, b, lo_a, b, "band")]
    out = []
    if lo_z > lo_a:
        out.append(Block(a, b, lo_a, lo_z, "band"))
    if a > lo_z:
        out.append(Block(a, b, lo_z, a, "full"))
    out.append(Block(a, b, a, b, "causal"))
    return out


def plan_blocks(
    a: int, b: int, window: int | None, starts: list[int] | str | None, n_keys: int = 0
) -> list[list]:
    """Query rows [a, b) cut into tiles, each with its blocks: [[Block, ...], ...].

    Plain causal attention is one tile (a fully visible prefix and the diagonal). With a
    window or documents, tiles of at most ``TILE`` rows, each split at its first document
    start: the rows before it lie in one document, the rows from it on begin a new one, so
    no block reaches farther back than a window or a tile — every mask is at most
    TILE x 2 TILE, never c x S."""
    if b <= a:
        return []
    if starts == "dense":  # an arbitrary mask: its rows, a tile at a time, against every key
        return [[Block(t0, min(t0 + TILE, b), 0, n_keys, "dense")] for t0 in range(a, b, TILE)]
    st = _Structure(window, starts)
    if window is None and (starts is None or starts == [0]):  # plain causal: one tile
        return [_segment_blocks(st, a, b)]
    tiles = []
    for t0 in range(a, b, TILE):
        t1 = min(t0 + TILE, b)
        inside = st.starts_in(t0, t1)
        cuts = [t0] + inside[:1] + [t1]
        for s0, s1 in zip(cuts, cuts[1:]):
            tiles.append(_segment_blocks(st, s0, s1))
    return tiles


def _chunks(rank: int, world: int, n_queries: int) -> list[tuple[int, int, int]]:
    """(first local row, first global position, rows) of each local query chunk."""
    if world == 1:
        return [(0, 0, n_queries)]
    c = n_queries // 2
    return [(i * c, j * c, c) for i, j in enumerate((rank, 2 * world - 1 - rank))]


# The document starts of the last ``doc_ids`` seen: one forward hands the same tensor to every
# layer and head-group step (and its backward), and reading them is a device-to-host copy (a
# sync on a GPU). Keyed by the tensor object itself (a weak reference: a live tensor's memory
# is never another's) and its version counter (an in-place change).
_STARTS_CACHE: list = [None, -1, None]


def _doc_starts(doc_ids: torch.Tensor) -> list:
    """Per batch row, the positions where a document starts (0 first), or "dense" for a row
    of negative ids (not documents: see ``documents_of_mask``)."""
    ref, version, starts = _STARTS_CACHE
    if ref is not None and ref() is doc_ids and version == tensor_version(doc_ids):
        return starts
    ids = doc_ids.cpu()
    change = ids[:, 1:] != ids[:, :-1]
    out = []
    for first, row in zip(ids[:, 0].tolist(), change):
        out.append("dense" if first < 0 else [0] + (row.nonzero().flatten() + 1).tolist())
    _STARTS_CACHE[:] = [weakref.ref(doc_ids), tensor_version(doc_ids), out]
    return out


def _row_groups(batch: int, doc_ids: torch.Tensor | None):
    """[(batch slice, document starts, or None, or "dense")]: one group when every row has
    the same documents (or there are none), else one per row (views, no copies). A row whose
    ids are negative (``documents_of_mask`` found its mask is not block-diagonal causal) runs
    on its explicit mask ("dense")."""
    if doc_ids is None:
        return [(slice(None), None)]
    starts = _doc_starts(doc_ids)
    if all(s == starts[0] for s in starts):
        return [(slice(None), starts[0])]
    return [(slice(b, b + 1), s) for b, s in enumerate(starts)]


def _block_bias(blk: Block, st: _Structure, valid, dtype, device):
    """Additive mask of a block ([B|1, 1, M|1, L]) or None: the band's structure and the key
    padding."""
    bias = None
    if blk.kind == "band":
        qpos = torch.arange(blk.q0, blk.q1, device=device)
        kpos = torch.arange(blk.k0, blk.k1, device=device)
        starts = torch.tensor(st.starts, device=device)
        lo = starts[torch.searchsorted(starts, qpos, right=True) - 1]
        if st.window is not None:
            lo = torch.maximum(lo, qpos - (st.window - 1))
        see = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= qpos[:, None])
        bias = torch.zeros(see.shape, dtype=dtype, device=device).masked_fill(~see, float("-inf"))
        bias = bias[None, None]
    elif blk.kind == "dense":
        m = st.dense[:, :, blk.q0 : blk.q1, blk.k0 : blk.k1]
        hide = ~m if m.dtype == torch.bool else m <= HIDDEN
        bias = (
            torch.zeros(m.shape, dtype=dtype, device=device)
            if m.dtype == torch.bool
            else m.to(dtype)
        )
        # -inf where a key is hidden: a row hidden from every key is then one no block sees
        # (a fused kernel's log-sum-exp cannot hold m + log L at m = finfo.min: masked_rows.py)
        bias = bias.masked_fill(hide, float("-inf"))
    if valid is not None:
        v = valid[:, blk.k0 : blk.k1]
        pad = torch.zeros(v.shape, dtype=dtype, device=device).masked_fill(~v, float("-inf"))
        pad = pad[:, None, None, :]
        bias = pad if bias is None else bias + pad
    return bias


def _seen(bias: torch.Tensor | None, blk: Block):
    """[B|1, 1, M] bool: rows that see at least one key of the block (None: all of them)."""
    if bias is None:
        return None
    m = blk.q1 - blk.q0
    see = ~torch.isneginf(bias)  # [B, 1, M|1, L]
    if blk.kind == "causal":  # only key padding: row i sees keys k0 .. k0 + i
        return torch.cummax(see[:, :, 0].to(torch.int8), dim=-1).values.bool()[..., :m]
    return see.any(-1).expand(see.shape[0], 1, m)


def _merge(parts, dtype):
    """Output and log-sum-exp of a row over all its blocks, from each block's (fp32 merge)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    o = sum(upcast(p_o) * torch.exp(p_l - safe).unsqueeze(-1) for p_o, p_l in parts)
    return o.to(dtype), lse


def _pad_rows(x: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``x`` ([B, H, r, ...]) extended along dim 2 to ``rows`` with ``value``."""
    if x.shape[2] == rows:
        return x
    extra = list(x.shape)
    extra[2] = rows - x.shape[2]
    return torch.cat([x, x.new_full(extra, value)], dim=2)


def _plan(rank, world, n_queries, n_keys, window, doc_ids, batch, dense_mask=None):
    """[(batch rows, structure, [(local row of the chunk, rows, [tile blocks...])])]."""
    out = []
    for rows, starts in _row_groups(batch, doc_ids):
        dense = None
        if starts == "dense":
            if dense_mask is None:
                raise ValueError("negative document ids without an explicit mask to fall back to")
            dense = dense_mask[rows] if dense_mask.shape[0] == batch else dense_mask
        st = _Structure(window, None if dense is not None else starts, dense)
        chunks = []
        for r0, p0, n in _chunks(rank, world, n_queries):
            # rows past the last key are padding (runtime/zigzag.py): in no block
            last = min(p0 + n, n_keys)
            chunks.append((r0, p0, n, plan_blocks(p0, last, window, starts, n_keys)))
        out.append((rows, st, chunks))
    return out


def _forward(
    q, k, v, rank, world, scale, valid, window=None, doc_ids=None, dense_mask=None,
    masked_value=None, safe_softmax=True,
):  # fmt: skip
    out_groups, lse_groups = [], []
    plan = _plan(rank, world, q.shape[2], k.shape[2], window, doc_ids, q.shape[0], dense_mask)
    for rows, st, chunks in plan:
        qg, kg, vg = q[rows], k[rows], v[rows]
        vg_valid = None if valid is None else valid[rows]
        rule = hidden_rule(st.dense, masked_value, safe_softmax)
        outs, lses = [], []
        for r0, p0, n, tiles in chunks:
            tile_out, tile_lse = [], []
            for blocks in tiles:
                a, b = blocks[0].q0, blocks[0].q1
                qt = qg[:, :, r0 + a - p0 : r0 + b - p0]
                parts, seens = [], []
                for blk in blocks:
                    bias = _block_bias(blk, st, vg_valid, q.dtype, q.device)
                    o, lse = block_forward(
                        qt, kg[:, :, blk.k0 : blk.k1], vg[:, :, blk.k0 : blk.k1],
                        causal=blk.kind == "causal", bias=bias, scale=scale,
                    )  # fmt: skip
                    seen = _seen(bias, blk)
                    seens.append(seen)
                    if seen is not None:
                        # a row that sees no key: CPU flash reports lse = 0, the efficient
                        # kernel may give NaN (0/0); what it saw is nothing: output 0, lse -inf
                        lse = lse.masked_fill(~seen, float("-inf"))
                        o = o.masked_fill(~seen[..., None], 0.0)
                    parts.append((o, lse))
                o, lse = _merge(parts, q.dtype)
                hidden = hidden_rows(seens, qt.shape[0]) if rule is not None else None
                if hidden is not None:  # rows that see no key, as the model's softmax has them
                    bias = hidden_bias(rule, st.dense, a, b, k.shape[2])
                    o = fill_hidden_rows(o, hidden, qt, kg, vg, bias, scale, safe_softmax)
                tile_out.append(o)
                tile_lse.append(lse)
            if tile_out:
                o, lse = torch.cat(tile_out, dim=2), torch.cat(tile_lse, dim=2)
            else:
                o, lse = qg[:, :, :0], qg.new_zeros(qg.shape[:2] + (0,))  # upcast below
            # rows that take no part (padding past the last key): output 0, lse -inf
            outs.append(_pad_rows(o, n, 0.0))
            lses.append(_pad_rows(upcast(lse), n, float("-inf")))
        out_groups.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])
        lse_groups.append(torch.cat(lses, dim=2) if len(lses) > 1 else lses[0])
    if len(out_groups) == 1:
        return out_groups[0], lse_groups[0]
    return torch.cat(out_groups, dim=0), torch.cat(lse_groups, dim=0)


# What both ops take after their tensors (the forward's q, k, v; the backward's grad_out, q, k,
# v, out, lse): which chunks this rank holds, the softmax scale and the optional masks. One text
# for both, as the backward is handed exactly the forward's arguments (``_backward``); the types
# are those custom_op infers from annotations (an int is a SymInt: it may be symbolic).
_ATTENTION_ARGS = (
    "SymInt rank, SymInt world, float scale, Tensor? key_valid=None, SymInt? window=None, "
    "Tensor? doc_ids=None, Tensor? dense_mask=None, float? masked_value=None, "
    "bool safe_softmax=True"
)


@torch.library.custom_op(
    "tspc::zigzag_causal_attention",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_ATTENTION_ARGS}) -> (Tensor, Tensor)",
)
def zigzag_causal_attention(
    q, k, v, rank, world, scale, key_valid=None, window=None, doc_ids=None, dense_mask=None,
    masked_value=None, safe_softmax=True,
):  # fmt: skip
    """Returns (output [B, Hq, S/D, d], log-sum-exp [B, Hq, S/D] in fp32). A row that sees no
    key has log-sum-exp -inf; its output is 0, or — an additive mask (``masked_value``, or
    ``dense_mask``'s float rows) — softmax over every key of its scores plus its mask, as the
    model's own softmax gives it (``masked_rows.py``; ``safe_softmax``: SDPA's, a row that is
    -inf at every key is 0; else eager code's, NaN)."""
    out, lse = _forward(
        q, k, v, rank, world, scale, key_valid, window, doc_ids, dense_mask, masked_value,
        safe_softmax,
    )  # fmt: skip
    return out.contiguous(), lse.contiguous()


@zigzag_causal_attention.register_fake
def _(q, k, v, rank, world, scale, key_valid=None, window=None, doc_ids=None, dense_mask=None,
      masked_value=None, safe_softmax=True):  # fmt: skip
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


def _setup(ctx, inputs, output):
    q, k, v, rank, world, scale, key_valid, window, doc_ids, dense_mask, masked, safe = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_valid, doc_ids, dense_mask)
    ctx.rank, ctx.world, ctx.scale, ctx.window = rank, world, scale, window
    ctx.masked_value, ctx.safe_softmax = masked, safe
    ctx.has = (key_valid is not None, doc_ids is not None, dense_mask is not None)


def _attention_backward(
    grad_out, q, k, v, out, lse, rank, world, scale, valid, window=None, doc_ids=None,
    dense_mask=None, masked_value=None, safe_softmax=True,
):  # fmt: skip
    # Rows that see no key at all: output 0, no gradient. lse=+inf makes every weight 0.
    lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dq_groups = []
    plan = _plan(rank, world, q.shape[2], k.shape[2], window, doc_ids, q.shape[0], dense_mask)
    for rows, st, chunks in plan:
        g_valid = None if valid is None else valid[rows]
        kg, vg, dkg, dvg = k[rows], v[rows], dk[rows], dv[rows]
        rule = hidden_rule(st.dense, masked_value, safe_softmax)
        dq_chunks = []
        for r0, p0, n, tiles in chunks:
            dq_tiles = []
            for blocks in tiles:
                a, b = blocks[0].q0, blocks[0].q1
                t = slice(r0 + a - p0, r0 + b - p0)
                go, qt, ot, lt = (x[rows][:, :, t] for x in (grad_out, q, out, lse_b))
                dq_t, seens = None, []
                for blk in blocks:
                    bias = _block_bias(blk, st, g_valid, q.dtype, q.device)
                    dq_b, dk_b, dv_b = block_backward(
                        go, qt, kg[:, :, blk.k0 : blk.k1], vg[:, :, blk.k0 : blk.k1], ot, lt,
                        causal=blk.kind == "causal", bias=bias, scale=scale,
                    )  # fmt: skip
                    dq_t = dq_b if dq_t is None else dq_t + dq_b
                    dkg[:, :, blk.k0 : blk.k1] += dk_b
                    dvg[:, :, blk.k0 : blk.k1] += dv_b
                    seens.append(_seen(bias, blk))
                hidden = hidden_rows(seens, qt.shape[0]) if rule is not None else None
                if hidden is not None:  # the rows the forward filled (no block saw them)
                    bias = hidden_bias(rule, st.dense, a, b, k.shape[2])
                    hidden_rows_backward(
                        go, hidden, qt, kg, vg, bias, scale, safe_softmax, dq_t, dkg, dvg
                    )
                dq_tiles.append(dq_t)
            if not dq_tiles:  # a chunk of padding only
                dq_tiles = [torch.zeros_like(q[rows][:, :, :0])]
            dq_c = torch.cat(dq_tiles, dim=2) if len(dq_tiles) > 1 else dq_tiles[0]
            dq_chunks.append(_pad_rows(dq_c, n, 0.0))  # padding rows: no gradient
        dq_groups.append(torch.cat(dq_chunks, dim=2) if len(dq_chunks) > 1 else dq_chunks[0])
    dq = dq_groups[0] if len(dq_groups) == 1 else torch.cat(dq_groups, dim=0)
    return dq, dk, dv


# The backward is an op of its own, so aot_autograd records it as one node instead of tracing
# its block kernels, slices and accumulations into the joint graph: per layer and head group
# that was most of the nodes the partitioner and the schedule had to process (compile time).
@torch.library.custom_op(
    "tspc::zigzag_causal_attention_backward",
    mutates_args=(),
    schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"{_ATTENTION_ARGS}) -> (Tensor, Tensor, Tensor)",
)
def zigzag_causal_attention_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    rank,
    world,
    scale,
    key_valid=None,
    window=None,
    doc_ids=None,
    dense_mask=None,
    masked_value=None,
    safe_softmax=True,
):
    """Returns (dq, dk, dv) of ``zigzag_causal_attention`` given its output and lse."""
    dq, dk, dv = _attention_backward(
        grad_out, q, k, v, out, lse, rank, world, scale, key_valid, window, doc_ids, dense_mask,
        masked_value, safe_softmax,
    )  # fmt: skip
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@zigzag_causal_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, rank, world, scale, key_valid=None, window=None, doc_ids=None,
      dense_mask=None, masked_value=None, safe_softmax=True):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, *optional = ctx.saved_tensors
    valid, doc_ids, dense_mask = (t if has else None for t, has in zip(optional, ctx.has))
    dq, dk, dv = torch.ops.tspc.zigzag_causal_attention_backward(
        grad_out, q, k, v, out, lse, ctx.rank, ctx.world, ctx.scale, valid, ctx.window, doc_ids,
        dense_mask, ctx.masked_value, ctx.safe_softmax,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("tspc::zigzag_causal_attention", _backward, setup_context=_setup)


# Rows of an explicit mask checked at a time: a [rows, S] temporary, never S x S.
CHECK_ELEMENTS = 1 << 22


@torch.library.custom_op("tspc::documents_of_mask", mutates_args=())
def documents_of_mask(mask: torch.Tensor) -> torch.Tensor:
    """Document ids [B, S] (int64) of an explicit ``[B|1, 1, S, S]`` mask that is block-diagonal
    causal — query q sees exactly keys [start of its document, q] — checked element by element,
    a band of rows at a time; a batch row whose mask is anything else gets ids -1 (the kernel
    then runs it on the mask's own rows). A bool mask attends where True; an additive float
    mask where 0, and it must be very negative (<= -1e4) everywhere else."""
    b, h, s, s_k = mask.shape
    if h != 1 or s != s_k:
        raise ValueError(f"documents_of_mask needs a [B, 1, S, S] mask, got {tuple(mask.shape)}")
    rows = max(1, CHECK_ELEMENTS // max(s, 1))
    out = torch.empty(b, s, dtype=torch.long, device=mask.device)
    pos = torch.arange(s, device=mask.device)
    for i in range(b):
        first = torch.empty(s, dtype=torch.long, device=mask.device)
        ok = True
        for r0 in range(0, s, rows):
            m = mask[i, 0, r0 : r0 + rows]
            see = m if m.dtype == torch.bool else m == 0
            if m.dtype != torch.bool and not bool((m[~see] <= -1e4).all()):
                ok = False
                break
            first[r0 : r0 + rows] = see.to(torch.int8).argmax(-1)  # the first key it sees
        if ok:
            # each row starts a document (first == q) or continues the previous row's
            prev = torch.cat([first.new_zeros(1), first[:-1]])
            ok = bool(((first == pos) | (first == prev)).all())
        if ok:
            for r0 in range(0, s, rows):
                m = mask[i, 0, r0 : r0 + rows]
                see = m if m.dtype == torch.bool else m == 0
                q = pos[r0 : r0 + rows, None]
                want = (pos[None, :] >= first[r0 : r0 + rows, None]) & (pos[None, :] <= q)
                if not bool((see == want).all()):
                    ok = False
                    break
        out[i] = torch.cumsum((first == pos).long(), 0) - 1 if ok else -1
    return out


@documents_of_mask.register_fake
def _(mask):
    return mask.new_empty((mask.shape[0], mask.shape[2]), dtype=torch.long)


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
    *,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
    dense_mask: torch.Tensor | None = None,
    masked_value: float | None = None,
    safe_softmax: bool = True,
) -> torch.Tensor:
    """Causal attention (plus optional key padding, sliding window and documents) in the form
    the passes emit: query q sees key k iff ``k <= q``, ``q - k < window``,
    ``doc_ids[b, q] == doc_ids[b, k]`` (documents are contiguous runs of equal ids) and
    ``key_valid[b, k]``. A batch row whose ``doc_ids`` are negative runs on its rows of
    ``dense_mask`` instead (an explicit mask that turned out not to be documents; exact).
    ``masked_value``: the additive mask's value at a hidden key (None: a bool mask), which
    decides what a row that sees no key gives (``zigzag_causal_attention``).

    With ``world == 1`` it is attention over the whole sequence; the sequence pass sets
    ``rank``/``world`` when the queries are this rank's zigzag chunks.
    A value head size unlike q's (SDPA allows it, the fused kernels not) is padded with zero
    features: they change no score (q, k; the scale is explicit) and give outputs cut off (v).
    """
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_qk != d_v:
        w = max(d_qk, d_v)
        q, k = (torch.nn.functional.pad(t, (0, w - d_qk)) for t in (q, k))
        v = torch.nn.functional.pad(v, (0, w - d_v))
    out = zigzag_causal_attention(
        q,
        k,
        v,
        rank,
        world,
        scale,
        key_valid,
        window,
        doc_ids,
        dense_mask,
        masked_value,
        safe_softmax,
    )[0]
    return out[..., :d_v] if d_qk != d_v else out


# Under torch.autocast the attention of the original graph (SDPA) runs in the autocast dtype;
# the projections feeding it come out in that dtype while RoPE may leave q/k in fp32. The op
# casts its floating inputs to the *current* autocast dtype, as SDPA's autocast policy does
# (torch.library.register_autocast would fix one dtype per device at registration).
_AUTOCAST_LIB = torch.library.Library("tspc", "IMPL")


def _autocast_kernel(device_type: str):
    def kernel(
        q, k, v, rank, world, scale, key_valid=None, window=None, doc_ids=None, dense=None,
        masked_value=None, safe_softmax=True,
    ):  # fmt: skip
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            ok = isinstance(t, torch.Tensor) and t.is_floating_point()
            return t.to(dtype) if ok and t.device.type == device_type else t

        with torch.autocast(device_type, enabled=False):
            return torch.ops.tspc.zigzag_causal_attention(
                cast(q), cast(k), cast(v), rank, world, scale, key_valid, window, doc_ids, dense,
                masked_value, safe_softmax,
            )  # fmt: skip

    return kernel


for _device in ("cpu", "cuda"):
    _AUTOCAST_LIB.impl(
        "zigzag_causal_attention",
        _autocast_kernel(_device),
        "Autocast" + dispatch_key_for_device(_device),
    )
