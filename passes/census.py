"""The census: every attention-like and MLP-like computation of a graph, found without the
matchers, so that the report can list each one as matched or skipped with a reason.

The matchers look for the forms the schedules can run; a form they do not know would otherwise
leave no trace, and a report saying "skipped: none" while nothing is sharded is the silent
non-application this project must never show. The census looks for what attention and MLPs
*compute*, in loose terms:

- **attention**: a fused attention call (SDPA, the flash/efficient/cuDNN ATen ops,
  FlexAttention, tspc's own kernels after mask classification), or a softmax over the product
  of two computed tensors (``softmax(q @ k^T)``, with scaling, masks, casts or softcapping
  between), in any spelling of the product (``matmul``, ``bmm``, ``einsum``);
- **MLP**: a projection by a 2-D parameter back to the width of a projection it reads through
  elementwise ops only (``w2(act(w1(x)) [* w3(x)])``, a fused GLU ``chunk``-ed or sliced, any
  spelling: ``linear``, ``addmm``, ``matmul``, ``einsum``), with at least one op between the
  two that is not a reshape (the activation).

``reconcile`` in ``tspc/pipeline.py`` compares the census with the matchers' results: an item no
match or skip accounts for becomes a skip saying the matcher does not recognise its form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .elementwise import nature
from .graph_utils import is_getitem, node_module_fqn, op_name, shape, tensor_inputs
from .graph_utils import projection_module as owner_of

# Fused attention calls, by canonical op name (``graph_utils.op_name``).
ATTENTION_CALLS = frozenset(
    {
        "sdpa",
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "flex_attention",
        "causal_attention",  # tspc's zigzag kernel (classify_masks)
        "sdpa_local_queries",
        "masked_attention",
    }
)
# Whole attention layers that Dynamo keeps as one call (``nn.MultiheadAttention`` and
# ``nn.TransformerEncoderLayer``: their projections, heads and softmax inside): no matcher
# reads into them, so the census names what they are.
MODULE_CALLS = {
    "multi_head_attention_forward": "torch.nn.MultiheadAttention's fused call "
    "(F.multi_head_attention_forward), left as one call: its in_proj and out_proj weights "
    "run whole on every rank",
    "_native_multi_head_attention": "torch.nn.MultiheadAttention's native fast path",
    "_transformer_encoder_layer_fwd": "torch.nn.TransformerEncoderLayer's native fast path",
}
_SOFTMAX = ("softmax", "_softmax", "_safe_softmax")
_PRODUCTS = ("matmul", "bmm", "einsum", "__matmul__", "mm")
# between the score product and the softmax: scaling, masks, casts, softcapping, views
_SCORE_OPS = (
    "mul",
    "div",
    "mul_",
    "div_",
    "add",
    "add_",
    "sub",
    "masked_fill",
    "masked_fill_",
    "where",
    "to",
    "float",
    "type_as",
    "tanh",
    "view",
    "reshape",
    "contiguous",
    "clone",
    "_to_copy",
)
_PASS_THROUGH = (
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "contiguous",
    "clone",
    "to",
    "float",
    "type_as",
    "chunk",
    "split",
    "split_with_sizes",
    "unsqueeze",
    "squeeze",
    "narrow",
    "_unsafe_view",
    "_to_copy",
)
_SUMS = ("add", "add_", "sub", "sub_", "__add__", "__iadd__", "__sub__")
# how far back from a projection the search for the projection feeding it looks (nodes)
_SEARCH_LIMIT = 48


@dataclass
class CensusItem:
    kind: str  # "attention" | "mlp"
    module: str
    anchor: fx.Node  # attention: the call or the softmax; mlp: the projection back to width
    form: str  # what the census saw, for the report


def param_projection(node: fx.Node, params) -> tuple[fx.Node, fx.Node] | None:
    """(input, weight parameter) when ``node`` multiplies one computed tensor by a 2-D
    parameter (or its transpose), in any spelling, with at most a 1-D parameter beside them
    (a bias)."""
    if op_name(node) not in ("linear", "addmm", "matmul", "mm", "__matmul__", "einsum"):
        return None
    ins = tensor_inputs(node)
    weights = [w for w in ins if _param_2d(w, params) is not None]
    others = [i for i in ins if i not in weights and not _param_1d(i, params)]
    if len(weights) != 1 or len(others) != 1 or not shape(others[0]) or not shape(node):
        return None
    return others[0], _param_2d(weights[0], params)


def _param_2d(node: fx.Node, params) -> fx.Node | None:
    """The parameter when ``node`` is a 2-D parameter or its transpose."""
    if not isinstance(node, fx.Node):
        return None
    if node in params and len(shape(node)) == 2:
        return node
    if op_name(node) in ("t", "transpose", "permute", "getattr", "swapaxes") and node.args:
        src = node.args[0]
        if isinstance(src, fx.Node) and src in params and len(shape(src)) == 2:
            return src
    return None


def _param_1d(node: fx.Node, params) -> bool:
    return isinstance(node, fx.Node) and node in params and len(shape(node)) == 1


def _weight_in_out(node: fx.Node, params) -> tuple[fx.Node, int, int] | None:
    """(parameter, in features, out features) of a projection node, by its input's and
    output's last dims (the weight's orientation does not matter)."""
    p = param_projection(node, params)
    if p is None:
        return None
    x, w = p
    return w, shape(x)[-1], shape(node)[-1]


def _computed(node) -> bool:
    return isinstance(node, fx.Node) and node.op not in ("placeholder", "get_attr")


def _attention_form(node: fx.Node, params) -> str | None:
    name = op_name(node) or ""
    if name in ATTENTION_CALLS:
        return f"{name} call"
    if name in MODULE_CALLS:
        return MODULE_CALLS[name]
    if name not in _SOFTMAX:
        return None
    x = node.args[0] if node.args else None
    for _ in range(12):
        if not isinstance(x, fx.Node):
            return None
        n = op_name(x) or ""
        if n in _PRODUCTS:
            operands = [i for i in tensor_inputs(x) if i not in params]
            if len(operands) == 2 and all(_computed(o) for o in operands):
                return f"softmax over {n} of two computed tensors"
            return None
        if n not in _SCORE_OPS:
            return None
        # follow the operand that carries the scores (the widest)
        ins = [i for i in tensor_inputs(x) if _computed(i)]
        if not ins:
            return None
        x = max(ins, key=lambda i: len(shape(i)))
    return None


def _mlp_form(node: fx.Node, params, natures: dict) -> str | None:
    """The MLP ending at projection ``node``, described, or None."""
    down = _weight_in_out(node, params)
    if down is None:
        return None
    _, down_in, down_out = down
    x = param_projection(node, params)[0]
    seen: set[tuple[fx.Node, bool]] = set()
    work = [(x, False)]  # (node, an op other than a reshape lies between it and the down)
    while work and len(seen) < _SEARCH_LIMIT:
        n, activated = work.pop()
        if (n, activated) in seen or not _computed(n):
            continue
        seen.add((n, activated))
        up = _weight_in_out(n, params)
        if up is not None:
            # h -> F, then F (or a fused 2F/kF, chunked) -> h: a projection whose output the
            # down does not read in full (a gate of width 1, an lm_head) is no up
            if activated and up[1] == down_out and up[2] % down_in == 0:
                return f"{op_name(n)} -> elementwise -> {op_name(node)} ({down_out} -> {down_in})"
            continue
        name = op_name(n) or ""
        ins = tensor_inputs(n, include_tuples=True)
        if is_getitem(n) or name in _PASS_THROUGH or "dropout" in name:
            # dropout is no activation: a residual ``x + dropout(w2(h))`` feeding the next
            # layer's projections is not an MLP
            work += [(i, activated) for i in ins]
        elif name in _SUMS and sum(_computed(i) for i in ins) > 1:
            # a sum of two computed values (a residual, a routed output plus a shared expert's)
            # ends the chain: an MLP's up and down lie between two such sums, never across one
            continue
        elif _nature(n, natures) == "elementwise":
            # an activation is a function of one value (gelu, silu, relu², a scale); a sum
            # with another value alone (a residual) makes no MLP
            work += [(i, activated or len(ins) == 1) for i in ins]
    return None


def _nature(node: fx.Node, natures: dict) -> str:
    """What ``node`` does to the last dim (``elementwise``/...), each node classified once: it
    runs the node on fake values."""
    if node not in natures:
        natures[node] = nature(node).kind
    return natures[node]


def census(gm: fx.GraphModule, params) -> list[CensusItem]:
    """Every attention-like and MLP-like computation of ``gm``, in graph order."""
    items = []
    natures: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        form = _attention_form(node, params)
        if form is not None:
            items.append(CensusItem("attention", node_module_fqn(node) or node.name, node, form))
            continue
        form = _mlp_form(node, params, natures)
        if form is not None:
            w = _weight_in_out(node, params)[0]
            module = owner_of(params[w].fqn) if w in params else node.name
            items.append(CensusItem("mlp", module, node, form))
    return items


def reconcile(
    items: list[CensusItem], anchors: dict[fx.Node, str], listed: set[tuple[str, str]]
) -> list[CensusItem]:
    """The items no match or skip accounts for. ``anchors`` maps the calls and down projections
    the matchers matched or skipped to the module they named (an item so anchored takes that
    name); ``listed`` holds the (kind, module) of every report entry so far: an item of a listed
    module, or of a module inside one (a mixture-of-experts block), is accounted for."""
    missing = []
    for item in items:
        if item.anchor in anchors:
            item.module = anchors[item.anchor]
            continue
        if not any(
            kind == item.kind and (item.module == m or item.module.startswith(m + "."))
            for kind, m in listed
        ):
            missing.append(item)
    return missing
