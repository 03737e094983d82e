"""Pass 1a' — lower two-operand ``einsum`` calls to the matmul forms the matchers read.

Research code writes projections and attention products with ``einsum``:

    q = einsum("bsd,ed->bse", x, wq)              # a projection: F.linear(x, wq)
    k = einsum("bsd,de->bse", x, wk)              # ... by an [in, out] weight: x @ wk
    s = einsum("bhqd,bhkd->bhqk", q, k)           # scores: q @ k.permute(0, 1, 3, 2)
    o = einsum("bhqk,bhkd->bhqd", p, v)           # the value product: p @ v

A call is lowered when it is a product over exactly one contracted index, every other index of
an operand in the output (what ``bmm`` computes). Of an operand's free indices the one the
output has last is the matmul's row (column); any other is a batch index the other operand
broadcasts over (multi-query attention's keys without a heads index: ``bhid,bjd->bhij``), except
in a parameter's einsum, which stays whole. A projection is the case where one operand is a 2-D
parameter and the contracted index is the other operand's last one. The operands are permuted to
``[batch..., free, contracted]`` / ``[batch..., contracted, free]`` (no-op permutes are left
out), multiplied with ``matmul``, and the result permuted to the equation's output order. The
values are the einsum's up to summation order. Any other call (three operands, repeated
indices, ``...`` outside a projection, several contracted indices) is left as it is; the census
still lists the attention or MLP it belongs to.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import eliminate_dead_code, op_name, shape, tensor_val


def _parse(equation: str) -> tuple[str, str, str] | None:
    eq = equation.replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    return ops[0], ops[1], out


def _operands(node: fx.Node) -> tuple[str, fx.Node, fx.Node] | None:
    args = list(node.args)
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        args = [args[0], *args[1]]
    if len(args) != 3 or not isinstance(args[0], str):
        return None
    eq, a, b = args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or node.kwargs:
        return None
    return eq, a, b


def _projection(sa: str, sb: str, out: str, b_is_weight: bool) -> str | None:
    """'linear' (weight ``[out, in]``) or 'matmul' (``[in, out]``) when ``sa`` is the input, a
    2-D weight ``sb`` contracts its last index and the output appends the weight's other."""
    if len(sb) != 2 or not b_is_weight:
        return None
    lead = sa[:-1]
    contracted = sa[-1]
    if contracted not in sb or sb[0] == sb[1]:
        return None
    other = sb[1] if sb[0] == contracted else sb[0]
    letters = sa.replace("...", "")
    if out != lead + other or other in sa or len(set(letters)) != len(letters):
        return None
    return "linear" if sb[1] == contracted else "matmul"


def _bmm_plan(sa: str, sb: str, out: str, broadcast: bool = True):
    """(the layout plan of a, of b, the product's permute) lowering ``sa,sb->out`` to
    ``matmul``, or None when it is not a product over one contracted index."""
    if "." in sa + sb + out or len(set(sa)) != len(sa) or len(set(sb)) != len(sb):
        return None
    if len(set(out)) != len(out) or not set(out) <= set(sa) | set(sb):
        return None
    contracted = [c for c in sa if c in sb and c not in out]
    batch = [c for c in out if c in sa and c in sb]
    free_a = [c for c in sa if c not in sb]
    free_b = [c for c in sb if c not in sa]
    if len(contracted) != 1:
        return None
    if set(free_a + free_b) - set(out) or len(batch) + len(free_a) + len(free_b) != len(out):
        return None
    if not free_a or not free_b:
        return None  # a vector product: matmul would drop a dim; left as it is
    if not broadcast and (len(free_a) > 1 or len(free_b) > 1):
        return None
    # Several free indices of one operand (multi-query attention's ``bhid,bjd->bhij``: keys
    # without a heads index): the one the output has last is the matmul's row (column), the
    # others batch indices the other operand broadcasts over (a size-1 dim there)
    fa = max(free_a, key=out.index)
    fb = max(free_b, key=out.index)
    batch = [x for x in out if x not in (fa, fb)]
    (c,) = contracted
    prod = batch + [fa, fb]
    po = [prod.index(x) for x in out]
    return _operand_plan(sa, batch, fa, c), _operand_plan(sb, batch, c, fb), po


def _operand_plan(sx: str, batch: list[str], row: str, col: str):
    """How one operand becomes ``[batch..., row, col]``: (the permute of its own indices, the
    positions where it gets a size-1 dim, whether a last ``transpose(-2, -1)`` follows). An
    operand that holds ``col`` before ``row`` (keys ``[..., j, d]`` in ``q @ k^T``) is laid out
    ``[..., col, row]`` and transposed, the spelling the attention matcher reads."""
    last = [col, row] if sx.index(col) < sx.index(row) else [row, col]
    order = batch + last
    perm = [sx.index(x) for x in order if x in sx]
    return perm, [i for i, x in enumerate(order) if x not in sx], last[0] == col


def _call(g: fx.Graph, target, args: tuple, like: fx.Node, method: bool = False) -> fx.Node:
    node = g.call_method(target, args) if method else g.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "example_value")})
    vals = [tensor_val(a) if isinstance(a, fx.Node) else a for a in args]
    if all(v is not None for v in vals):
        fn = getattr(torch.Tensor, target) if method else target
        node.meta["val"] = fn(*vals)
    return node


def _permute(g: fx.Graph, x: fx.Node, perm: list[int], like: fx.Node) -> fx.Node:
    if perm == list(range(len(perm))):
        return x
    return _call(g, "permute", (x, *perm), like, method=True)


def _lay_out(g: fx.Graph, x: fx.Node, plan, like: fx.Node) -> fx.Node:
    perm, size_one, transpose = plan
    x = _permute(g, x, perm, like)
    for d in size_one:  # ascending: each position is final once the earlier ones are inserted
        x = _call(g, "unsqueeze", (x, d), like, method=True)
    return _call(g, "transpose", (x, -2, -1), like, method=True) if transpose else x


def canonicalize_einsum(gm: fx.GraphModule, params) -> int:
    """Lower the einsum calls that are projections or batched products; the number lowered."""
    g = gm.graph
    lowered = 0
    for node in list(g.nodes):
        if op_name(node) != "einsum":
            continue
        ops = _operands(node)
        parsed = _parse(ops[0]) if ops else None
        if parsed is None:
            continue
        _, a, b = ops
        sa, sb, out = parsed
        with g.inserting_before(node):
            new = None
            for x, w, sx, sw in ((a, b, sa, sb), (b, a, sb, sa)):
                kind = _projection(sx, sw, out, w in params and len(shape(w)) == 2)
                if kind == "linear":
                    new = _call(g, F.linear, (x, w), node)
                elif kind == "matmul":
                    new = _call(g, torch.matmul, (x, w), node)
                if new is not None:
                    break
            if new is None:
                # A parameter's einsum (the einsum decoder's ``bsd,thed->tbhse``) is left
                # whole: as a broadcast matmul it would copy its input once per weight slice
                # and still be no projection the matchers read
                plan = _bmm_plan(sa, sb, out, broadcast=a not in params and b not in params)
                if plan is None:
                    continue
                plan_a, plan_b, po = plan
                pa_node, pb_node = (_lay_out(g, x, p, node) for x, p in ((a, plan_a), (b, plan_b)))
                new = _permute(g, _call(g, torch.matmul, (pa_node, pb_node), node), po, node)
        new.meta["tspc_canonical"] = "einsum"
        node.replace_all_uses_with(new)
        g.erase_node(node)
        lowered += 1
    if lowered:
        eliminate_dead_code(g)
        gm.recompile()
    return lowered
