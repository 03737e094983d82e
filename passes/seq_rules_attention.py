"""Sequence-sharding rules for attention and token losses.

Attention keeps the local queries and gathers the keys and values (before any grouped-query
head repetition: only the KV heads move); ``is_causal`` becomes the zigzag causal kernel with no
mask tensor, an explicit mask is cut to the local query rows. A token loss over sharded logits
reduces locally and all-reduces one value (``runtime/seq_reductions.py``), padding tokens set to
``ignore_index`` first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx
import torch.nn.functional as F

from tspc.ops.masked_rows import masked_attention
from tspc.ops.zigzag_attention import causal_attention, default_scale
from tspc.runtime.seq_reductions import sharded_cross_entropy

from .graph_utils import arg, replace_input, shape
from .layout import Sharded
from .match_attention import sdpa_args
from .seq_ops import ATTENTION

if TYPE_CHECKING:
    from .seq_rule_api import SequencePropagator


def sdpa_local_queries(q, k, v, attn_mask, dropout_p, scale, enable_gqa, safe_softmax=None):
    """SDPA of local query rows against all keys (mask already cut to those rows).
    ``safe_softmax`` not None: ``masked_attention`` (an additive mask whose rows hidden from
    every key are exact; False: eager code's softmax)."""
    if safe_softmax is not None:
        return masked_attention(
            q, k, v, attn_mask, dropout_p, scale=scale, enable_gqa=enable_gqa,
            safe_softmax=safe_softmax,
        )  # fmt: skip
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )


def rule_sdpa(p: SequencePropagator, node):
    a = sdpa_args(node)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    sq = p.L(q)
    q_ndim = len(shape(q))
    if not isinstance(sq, Sharded) or sq.dim != q_ndim - 2 or not sq.is_plain:
        return False
    if sq.n != p.S:
        return False
    tag = p.tags.get(node)
    for t in (k, v):
        if isinstance(p.L(t), Sharded):
            replace_input(node, t, p.gather(t, node, "attention keys/values need every token", tag))
    if isinstance(mask, fx.Node):
        m_shape = shape(mask)
        sm = p.L(mask)
        qd = len(m_shape) - 2
        if isinstance(sm, Sharded) and sm.dim != qd:
            mask_new = p.gather(mask, node, "mask split along keys")
            replace_input(node, mask, mask_new)
            mask, sm = mask_new, None
        if sm is None and qd >= 0 and m_shape[qd] != 1:
            replace_input(node, mask, p.slice(mask, qd, sq))
        exact_rows = a["safe_softmax"] if node.target is masked_attention else None
        node.target = sdpa_local_queries
        node.args = (
            arg(node, 0, "query"),
            arg(node, 1, "key"),
            arg(node, 2, "value"),
            arg(node, 3, "attn_mask"),
            a["dropout_p"],
            a["scale"],
            bool(a["enable_gqa"]),
            exact_rows,
        )
        node.kwargs = {}
    elif a["is_causal"]:
        # causal attention of the local zigzag queries: no mask tensor at all
        scale = a["scale"] if a["scale"] is not None else default_scale(shape(q)[-1])
        key_valid, doc_ids = a["key_valid"], a["doc_ids"]
        if isinstance(key_valid, fx.Node) and isinstance(p.L(key_valid), Sharded):
            if key_valid.meta.get("tspc_role") == "seq_slice":
                key_valid = key_valid.args[0]  # the replicated [B, S] it was cut from
            else:
                key_valid = p.gather(key_valid, node, "key padding needs every key")
        if isinstance(doc_ids, fx.Node) and isinstance(p.L(doc_ids), Sharded):
            if doc_ids.meta.get("tspc_role") == "seq_slice":
                doc_ids = doc_ids.args[0]
            else:
                doc_ids = p.gather(doc_ids, node, "document ids of every key")
        node.target = causal_attention
        node.args = (
            arg(node, 0, "query"),
            arg(node, 1, "key"),
            arg(node, 2, "value"),
            key_valid,
            float(scale),
            p.rank,
            p.D,
        )
        node.kwargs = {
            "window": a["window"],
            "doc_ids": doc_ids,
            "dense_mask": a["dense_mask"],  # an explicit mask input: whole, replicated
            "masked_value": a["masked_value"],  # what a row that sees no key gives
            "safe_softmax": a["safe_softmax"],
        }
    else:
        # No mask, not causal: every query sees every key; local queries need nothing else.
        pass
    node.meta["tspc_role"] = "attention"
    p.layout[node] = sq
    return None


def _loss(p: SequencePropagator, node, nll: bool):
    logits, target = node.args[0], arg(node, 1, "target")
    sl, st = p.L(logits), p.L(target)
    if not isinstance(logits, fx.Node) or not isinstance(target, fx.Node):
        return False
    if not isinstance(sl, Sharded) or sl.dim != 0 or len(shape(logits)) != 2:
        return False
    if isinstance(st, Sharded):
        if st.dim != 0 or (st.outer, st.inner) != (sl.outer, sl.inner):
            return False
    else:
        target_new = p.slice(target, 0, sl)
        replace_input(node, target, target_new)
        target = target_new
    weight = arg(node, 2, "weight")
    if isinstance(p.L(weight), Sharded):
        return False
    reduction = node.kwargs.get("reduction", "mean")
    if len(node.args) > 5 and not nll:
        reduction = node.args[5]
    ignore_index = node.kwargs.get("ignore_index", -100)
    if len(node.args) > 4:
        ignore_index = node.args[4]
    smoothing = node.kwargs.get("label_smoothing", 0.0)
    if len(node.args) > 6:
        smoothing = node.args[6]
    if node.kwargs.get("size_average") is not None or node.kwargs.get("reduce") is not None:
        return False
    target = p.fill_padding(target, ignore_index)  # padding tokens are not predicted
    node.target = sharded_cross_entropy
    node.args = (
        logits,
        target,
        weight,
        ignore_index,
        reduction,
        smoothing,
        p.group,
        p.D,
        p.tag_for(node),
        nll,
    )
    node.kwargs = {}
    p.layout[node] = sl if reduction == "none" else None
    return None


def rule_cross_entropy(p: SequencePropagator, node):
    return _loss(p, node, nll=False)


def rule_nll_loss(p: SequencePropagator, node):
    return _loss(p, node, nll=True)


# ------------------------------------------------------------------ outputs


RULES = {
    **dict.fromkeys(ATTENTION, rule_sdpa),  # SDPA, and SDPA already made causal_attention
    "cross_entropy": rule_cross_entropy,
    "nll_loss": rule_nll_loss,
}
