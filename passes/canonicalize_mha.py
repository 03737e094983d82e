"""Pass 1a''' — ``torch.nn.MultiheadAttention``'s fused call as the ops it stands for.

Dynamo keeps ``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` and so
``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` call) as one node: the packed
in-projection, the head split, the attention and the out-projection are inside it, where no
matcher reads. For self-attention (query, key and value the same tensor) with the packed
``in_proj_weight`` the pass writes the call out as what torch computes there:

    q, k, v = linear(x, in_proj_weight, in_proj_bias).chunk(3, -1)        # x: [L, B, E]
    q = q.unflatten(-1, (H, d)).permute(1, 2, 0, 3)                     # [B, H, L, d]
    out = scaled_dot_product_attention(q, k, v, mask, is_causal=c)
    out = linear(out.permute(2, 0, 1, 3).flatten(-2), out_proj_weight, out_proj_bias)

with torch's own mask rules: the ``is_causal`` hint replaces the mask when no key padding mask
is given and the weights are not asked for (torch then ignores the mask's values); otherwise a
bool mask (True = masked) becomes ``-inf`` added to the scores, a 3-D ``[B*H, L, S]`` mask is
viewed per batch and head, and a key padding mask is added to it. The rest of the pipeline then
sees an ordinary fused-QKV attention (``qkv_proj`` of equal parts) and shards it.

With ``need_weights=True`` (``nn.MultiheadAttention``'s default) torch computes the scores with
an explicit softmax; when the weights are not used the result is the same attention, and the
SDPA call is marked as eager attention so that a query row the mask hides from every key comes
out as that softmax gives it. Left as the call, with the reason in the report: cross-attention
(key or value another tensor), separate q/k/v weights, ``bias_k``/``bias_v``,
``add_zero_attn``, static keys, dropout on the weights while training, unbatched input, and
attention weights that are used.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import (
    calls_named,
    eliminate_dead_code,
    is_getitem,
    shape,
    tensor_val,
)

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@dataclass
class MhaCall:
    module: str
    replaced: bool
    reason: str = ""  # why not, when not replaced


def _bound(node: fx.Node) -> dict | None:
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _why_not(a: dict, users: list[fx.Node]) -> str | None:
    """Why the call cannot be written out, or None."""
    q = a["query"]
    if a["key"] is not q or a["value"] is not q:
        return "cross-attention (key or value is not the query's tensor)"
    if a["use_separate_proj_weight"] or not isinstance(a["in_proj_weight"], fx.Node):
        return "separate q/k/v projection weights (kdim/vdim differ from embed_dim)"
    if a["bias_k"] is not None or a["bias_v"] is not None or a["add_zero_attn"]:
        return "bias_k/bias_v or add_zero_attn (keys appended to the sequence)"
    if a["static_k"] is not None or a["static_v"] is not None:
        return "static keys or values"
    if a["training"] and a["dropout_p"] > 0:
        return "dropout on the attention weights while training"
    if len(shape(q) or ()) != 3:
        return "unbatched input"
    masks = [m for m in (a["attn_mask"], a["key_padding_mask"]) if m is not None]
    if any(not isinstance(m, fx.Node) or tensor_val(m) is None for m in masks):
        return "a mask that is not a tensor of the graph"
    if any(not is_getitem(u) or u.args[1] not in (0, 1) for u in users):
        return "its result is used other than as (output, weights)"
    if any(u.args[1] == 1 and u.users for u in users):
        return "its attention weights are used"
    return None


def _additive(g: fx.Graph, mask: fx.Node, dtype: torch.dtype) -> fx.Node:
    """torch's ``_canonical_mask``: a bool mask (True = masked) as ``-inf`` to add, in the
    query's dtype; a float mask as it is."""
    if tensor_val(mask).dtype == torch.bool:
        return g.call_method(
            "to", (g.call_function(torch.where, (mask, float("-inf"), 0.0)), dtype)
        )
    return mask


def _heads_first(g: fx.Graph, t: fx.Node, heads: int, d: int) -> fx.Node:
    """``[L, B, H*d]`` -> ``[B, H, L, d]``, with no shape constant but the heads'."""
    return g.call_method("permute", (g.call_method("unflatten", (t, -1, (heads, d))), 1, 2, 0, 3))


def _write_out(g: fx.Graph, node: fx.Node, a: dict) -> fx.Node:
    x, heads = a["query"], a["num_heads"]
    e = shape(x)[-1]
    d = e // heads
    kpm, mask = a["key_padding_mask"], a["attn_mask"]
    causal = bool(a["is_causal"]) and kpm is None and not a["need_weights"]
    dropout = a["dropout_p"] if a["training"] else 0.0
    dtype = tensor_val(x).dtype
    with g.inserting_before(node):
        qkv = g.call_function(F.linear, (x, a["in_proj_weight"], a["in_proj_bias"]))
        parts = g.call_method("chunk", (qkv, 3, -1))
        q, k, v = (
            _heads_first(g, g.call_function(operator.getitem, (parts, i)), heads, d)
            for i in range(3)
        )
        bias = None
        if not causal and mask is not None:
            bias = _additive(g, mask, dtype)
            if len(shape(mask)) == 3:  # [B*H, L, S]
                bias = g.call_method("unflatten", (bias, 0, (-1, heads)))
        if kpm is not None:
            pad = _additive(g, kpm, dtype)
            pad = g.call_method("unsqueeze", (g.call_method("unsqueeze", (pad, 1)), 1))
            bias = pad if bias is None else g.call_function(torch.add, (bias, pad))
        kwargs = {"attn_mask": bias, "dropout_p": dropout, "is_causal": causal}
        out = g.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
        merged = g.call_method("flatten", (g.call_method("permute", (out, 2, 0, 1, 3)), -2))
        proj = g.call_function(F.linear, (merged, a["out_proj_weight"], a["out_proj_bias"]))
    # the new nodes are the module's: the matchers and the report name it
    for n in (qkv, parts, out, merged, proj):
        for key in ("nn_module_stack", "source_fn_stack", "stack_trace"):
            if key in node.meta:
                n.meta[key] = node.meta[key]
    if a["need_weights"]:  # torch's explicit softmax: rows hidden from every key as it has them
        out.meta["tspc_canonical"] = "eager_attention"
    return proj


def canonicalize_mha(gm: fx.GraphModule) -> list[MhaCall]:
    """Every ``F.multi_head_attention_forward`` call: written out as SDPA between its
    projections, or the reason not."""
    g = gm.graph
    found = []
    for node, module in calls_named(g, "multi_head_attention_forward"):
        a = _bound(node)
        users = list(node.users)
        reason = "an unexpected call signature" if a is None else _why_not(a, users)
        if reason is not None:
            found.append(MhaCall(module, False, f"nn.MultiheadAttention: {reason}"))
            continue
        proj = _write_out(g, node, a)
        for u in users:
            if u.args[1] == 0:
                u.replace_all_uses_with(proj)
            g.erase_node(u)
        g.erase_node(node)
        found.append(MhaCall(module, True))
    if any(f.replaced for f in found):
        eliminate_dead_code(g)
        gm.recompile()
    return found
