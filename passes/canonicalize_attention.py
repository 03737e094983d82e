"""Pass 1a — canonicalise eager attention into ``F.scaled_dot_product_attention``.

Models in "eager" attention mode spell attention out:

    scores = (q @ k.transpose(-2, -1)) * scale  [+ mask]
    probs  = softmax(scores, dim=-1 [, dtype=float32])  [.to(dtype)]  [dropout(p=0 / eval)]
    out    = probs @ v

When the scores and probabilities are used by nothing else (the model does not return its
attention weights), the whole chain is replaced by one SDPA call with the same mask and scale,
so the rest of the pipeline sees a single anchor and never an ``S x S`` score tensor on the TSP
path. The result equals the eager chain up to floating-point summation order — including a query
row the mask hides from every key (left padding), which eager softmax makes uniform over every
key under Hugging Face's finfo.min mask: the call is marked ``tspc_canonical``, and
``classify_mask.py`` hands it to a kernel that computes such rows as eager code does, forward
and backward (``tspc/ops/masked_rows.py``; torch's fused SDPA kernels get their backward wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import (
    arg,
    eliminate_dead_code,
    node_module_fqn,
    op_name,
    set_fake_value,
    shape,
    tensor_val,
)

_CASTS = ("to", "type", "float", "type_as", "half", "bfloat16", "contiguous")
# the scale of the scores; in place too (Falcon's ``scores /= sqrt(d)``: its only user)
_SCALES = ("mul", "div", "mul_", "div_")


@dataclass
class EagerAttention:
    module: str
    replaced: bool
    reason: str = ""


def _single_user(n: fx.Node) -> bool:
    return len(n.users) == 1


def _is_key_transpose(kt: fx.Node) -> fx.Node | None:
    """``k.transpose(-2, -1)`` (any spelling) -> k."""
    name = op_name(kt)
    if name in ("transpose", "swapaxes"):
        nd = len(shape(kt))
        dims = {arg(kt, 1, "dim0") % nd, arg(kt, 2, "dim1") % nd}
        if dims == {nd - 2, nd - 1}:
            return kt.args[0]
    if name == "permute":
        dims = kt.args[1] if isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        nd = len(dims)
        if list(dims) == list(range(nd - 2)) + [nd - 1, nd - 2]:
            return kt.args[0]
    return None


def _fill_is_additive(value: float, dtype: torch.dtype) -> bool:
    """Whether ``s.masked_fill(m, value)`` equals ``s + where(m, value, 0)`` for every score a
    model computes: -inf absorbs any finite score, and a value at the dtype's most negative
    float does too wherever half its spacing there (>= 1e31 in fp32 / bf16 / fp64) exceeds any
    score. Another value (``-1e9``) differs in a row masked at every key: masked_fill makes it
    uniform, a sum does not."""
    if value == float("-inf"):
        return True
    if dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return False
    return value <= torch.finfo(dtype).min / 2


def _masked_fill_mask(scores: fx.Node):
    """``s.masked_fill(m, v)`` (nanoGPT / minGPT / einsum code's causal mask) as (s, the
    additive mask ``where(m, v, 0)`` in the scores' dtype), or the reason it cannot be one.

    The new mask nodes read only ``m``: ``classify_mask`` evaluates them like the masks Hugging
    Face builds (``where`` of a bool condition), so a causal ``ones(S, S).tril()`` becomes the
    zigzag kernel and nothing S x S is left."""
    if not _single_user(scores):
        return "the masked scores are used elsewhere"
    raw, hide = arg(scores, 0, "self"), arg(scores, 1, "mask")
    value = arg(scores, 2, "value")
    if not isinstance(raw, fx.Node) or not isinstance(hide, fx.Node) or not _single_user(raw):
        return "the softmax input is not q @ k^T (softcapping or another transform)"
    hv, sv = tensor_val(hide), tensor_val(raw)
    if hv is None or sv is None or hv.dtype != torch.bool:
        return "masked_fill by a mask that is not a bool tensor"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "masked_fill with a tensor value (only a Python number is read as a mask value)"
    if not _fill_is_additive(float(value), sv.dtype):
        return (
            f"masked_fill with {value} in {sv.dtype}: a row masked at every key would not equal "
            "an additive mask (write float('-inf') or torch.finfo(dtype).min)"
        )
    g = scores.graph
    with g.inserting_before(scores):
        additive = g.call_function(torch.where, (hide, float(value), 0.0))
        additive.meta.update({k: v for k, v in scores.meta.items() if k != "val"})
        set_fake_value(additive)
        if tensor_val(additive).dtype != sv.dtype:
            additive = g.call_method("to", (additive, sv.dtype))
            additive.meta.update({k: v for k, v in scores.meta.items() if k != "val"})
            set_fake_value(additive)
    return raw, additive


def _match(out: fx.Node):
    """(q, k, v, mask, scale) of an eager attention ending at ``out = probs @ v``, or a reason."""
    probs, v = out.args[0], out.args[1]
    if not isinstance(probs, fx.Node):
        return "not a matmul of tensors"
    node = probs
    while op_name(node) in _CASTS + ("dropout",):
        if not _single_user(node):
            return "the attention probabilities are used elsewhere (returned attention weights)"
        if op_name(node) == "dropout":
            p = arg(node, 1, "p", 0.5)
            training = arg(node, 2, "training", True)
            if p not in (0, 0.0) and training:
                return f"attention dropout p={p} in training"
        node = node.args[0]
    if op_name(node) not in ("softmax", "_softmax") or not _single_user(node):
        return None  # not attention at all
    dim = arg(node, 1, "dim")
    scores = node.args[0]
    if dim is None or dim % len(shape(scores)) != len(shape(scores)) - 1:
        return "softmax is not over the last dimension"
    mask = None
    if op_name(scores) == "add" and _single_user(scores):
        a, b = scores.args
        scores, mask = (a, b) if op_name(a) in _SCALES + ("matmul",) else (b, a)
    tv = tensor_val(mask) if isinstance(mask, fx.Node) else None
    if tv is not None and tv.dtype == torch.bool:
        return "a bool mask added to the scores (eager adds it as 0/1; SDPA would mask with it)"
    if mask is None and op_name(scores) in ("masked_fill", "masked_fill_"):
        filled = _masked_fill_mask(scores)
        if isinstance(filled, str):
            return filled
        scores, mask = filled
    scale = 1.0
    if op_name(scores) in _SCALES and _single_user(scores):
        a, b = scores.args
        raw, c = (a, b) if isinstance(a, fx.Node) else (b, a)
        if not isinstance(c, (int, float)):
            return "the scores are scaled by a tensor"
        scale = float(c) if op_name(scores) in ("mul", "mul_") else 1.0 / float(c)
        scores = raw
    if op_name(scores) != "matmul" or not _single_user(scores):
        return "the softmax input is not q @ k^T (softcapping or another transform)"
    q, kt = scores.args
    k = _is_key_transpose(kt) if isinstance(kt, fx.Node) else None
    if k is None or not _single_user(kt):
        return "keys are not transposed with transpose(-2, -1)"
    if len(shape(q)) != 4 or len(shape(k)) != 4 or len(shape(v)) != 4:
        return "not 4-D [batch, heads, seq, head_dim]"
    return q, k, v, mask, scale


def canonicalize_eager_attention(gm: fx.GraphModule) -> list[EagerAttention]:
    found = []
    g = gm.graph
    for node in list(g.nodes):
        if op_name(node) != "matmul" or len(node.args) != 2:
            continue
        m = _match(node)
        if m is None:
            continue
        where = node_module_fqn(node)
        if isinstance(m, str):
            found.append(EagerAttention(where, False, m))
            continue
        q, k, v, mask, scale = m
        with g.inserting_before(node):
            sdpa = g.call_function(
                F.scaled_dot_product_attention,
                (q, k, v),
                {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": scale},
            )
        sdpa.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ != "val"})
        sdpa.meta["val"] = node.meta.get("val", node.meta.get("example_value"))
        sdpa.meta["tspc_canonical"] = "eager_attention"
        node.replace_all_uses_with(sdpa)
        g.erase_node(node)
        found.append(EagerAttention(where, True))
    eliminate_dead_code(g)
    gm.recompile()
    return found
