"""Pass 1a'' — FlexAttention as the SDPA call the rest of the pipeline reads.

``flex_attention(q, k, v, block_mask=create_block_mask(mask_mod, ...))`` reaches the backend as
the ``flex_attention`` higher-order op, its ``mask_mod`` and ``score_mod`` as small graphs of
their own. When the scores are not modified (``score_mod`` returns the score) and ``mask_mod``
reads nothing but its indices, the mask is a function of (query, key) positions alone: the pass
evaluates it once on the whole ``S x S`` grid of the traced length and recognises

- causal (``q_idx >= kv_idx``): ``F.scaled_dot_product_attention(..., is_causal=True)``;
- a causal sliding window of W keys (``q_idx - kv_idx < W`` as well): SDPA with the bool mask
  ``(k <= q) & (q - k < W)`` built from ``arange`` in the graph, the form the mask classifier
  reads as a window (so the zigzag kernel runs it without an S x S mask).

Anything else (a ``score_mod`` such as ALiBi or softcapping, a mask reading tensors such as
document ids, the log-sum-exp used, a symbolic or very long length, another mask) is left as
it is and reported as a skipped attention with the reason. The scale is FlexAttention's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import calls_named, eliminate_dead_code, is_getitem, shape

# the longest length whose S x S mask is evaluated at compile time (bools: S*S bytes)
MAX_EVAL_LEN = 8192


@dataclass
class FlexCall:
    module: str
    replaced: bool
    reason: str = ""  # why not, when not replaced; else the mask form


def _submodule(gm: fx.GraphModule, node) -> fx.GraphModule | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return getattr(gm, node.target, None)
    return None


def _is_identity(score_mod: fx.GraphModule | None) -> bool:
    if score_mod is None:
        return False
    placeholders = [n for n in score_mod.graph.nodes if n.op == "placeholder"]
    out = next(n for n in score_mod.graph.nodes if n.op == "output")
    ret = out.args[0]
    return bool(placeholders) and ret is placeholders[0]


def _mask_form(mask_mod: fx.GraphModule, length: int) -> tuple[str, int] | str:
    """("causal", 0) or ("window", W), else the reason it is neither."""
    i = torch.arange(length)
    zero = torch.tensor(0)
    try:
        with torch.no_grad():
            m = mask_mod(zero, zero, i[:, None], i[None, :])
    except Exception as e:  # noqa: BLE001 - a mask that cannot run on index grids is reported
        return f"its mask_mod could not be evaluated on positions ({type(e).__name__})"
    m = torch.as_tensor(m).broadcast_to(length, length)
    causal = i[None, :] <= i[:, None]
    if torch.equal(m, causal):
        return "causal", 0
    w = int(m[-1].sum())
    window = causal & (i[:, None] - i[None, :] < w)
    if 0 < w < length and torch.equal(m, window):
        return "window", w
    return "its mask_mod is neither causal nor a causal sliding window"


def _replace(g: fx.Graph, node: fx.Node, out: fx.Node, form: tuple[str, int], scale) -> None:
    q, k, v = node.args[:3]
    gqa = shape(q)[1] != shape(k)[1]
    with g.inserting_before(node):
        if form[0] == "causal":
            kwargs = {"is_causal": True, "scale": scale, "enable_gqa": gqa}
        else:
            s = shape(q)[2]
            i = g.call_function(torch.arange, (s,), {"device": torch.device("cpu")})
            device = g.call_function(getattr, (q, "device"))
            i = g.call_method("to", (i, device))
            rows = g.call_method("unsqueeze", (i, 1))
            cols = g.call_method("unsqueeze", (i, 0))
            seen = g.call_function(torch.le, (cols, rows))
            near = g.call_function(torch.lt, (g.call_function(torch.sub, (rows, cols)), form[1]))
            mask = g.call_function(torch.logical_and, (seen, near))
            kwargs = {"attn_mask": mask, "scale": scale, "enable_gqa": gqa}
        sdpa = g.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
    sdpa.meta.update({k_: v_ for k_, v_ in out.meta.items()})
    sdpa.meta["tspc_canonical"] = "flex_attention"
    out.replace_all_uses_with(sdpa)
    g.erase_node(out)


def canonicalize_flex(gm: fx.GraphModule) -> list[FlexCall]:
    """Every FlexAttention call: replaced by SDPA with its recognised mask, or the reason not."""
    g = gm.graph
    found = []
    for node, module in calls_named(g, "flex_attention"):

        def skip(reason: str, module=module) -> None:
            found.append(FlexCall(module, False, f"FlexAttention: {reason}"))

        args = list(node.args)
        if len(args) < 9:
            skip("an unexpected call signature")
            continue
        score_mod, block_mask, scale = args[3], args[4], args[5]
        if not _is_identity(_submodule(gm, score_mod)):
            skip("its score_mod changes the scores (only the mask is mapped to the kernel)")
            continue
        if args[7] or args[8]:
            skip("its score_mod or mask_mod reads tensors (document ids?), not positions alone")
            continue
        users = list(node.users)
        if len(users) != 1 or not is_getitem(users[0]) or users[0].args[1] != 0:
            skip("more than its output is used (the log-sum-exp)")
            continue
        s, sk = shape(args[0])[2], shape(args[1])[2]
        if not isinstance(s, int) or s != sk or s > MAX_EVAL_LEN:
            skip(f"query length {s} and key length {sk} (the mask is evaluated at one length)")
            continue
        mask_mod = _submodule(gm, block_mask[-1]) if isinstance(block_mask, tuple) else None
        if mask_mod is None:
            skip("no mask_mod graph in its BlockMask")
            continue
        form = _mask_form(mask_mod, s)
        if isinstance(form, str):
            skip(form)
            continue
        _replace(g, node, users[0], form, scale)
        g.erase_node(node)
        desc = "causal" if form[0] == "causal" else f"causal sliding window of {form[1]} keys"
        found.append(FlexCall(module, True, desc))
    if any(f.replaced for f in found):
        eliminate_dead_code(g)
        gm.recompile()
    return found
