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

from .graph_utils import arg, eliminate_dead_code, node_module_fqn, op_name, shape, tensor_val

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
