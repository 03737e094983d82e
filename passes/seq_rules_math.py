"""Sequence-sharding rules for math: elementwise ops, ops along one dim, reductions,
projections, matmuls and norms. Each rule is ``rule(p, node)`` over the walk ``p``
(``seq_rule_api.SequencePropagator``): it sets ``p.layout[node]`` and returns None, or returns False when the
op does not keep the tokens independent (the propagator then gathers its inputs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from tspc.runtime.seq_reductions import sharded_mean, sharded_sum

from .graph_utils import arg, replace_input, shape, tensor_val
from .layout import Sharded, map_broadcast, map_reduce, reduced_dims
from .seq_ops import in_table, is_first_arg_only, is_inplace, resolve
from .seq_rules_shape import acting_along, acts_along

if TYPE_CHECKING:
    from .seq_rule_api import SequencePropagator

_MAX_MIN = resolve("max min argmax argmin".split())  # no dim: one value of all tokens
_SUM = resolve(["sum"])
_MEAN = resolve(["mean"])


def rule_elementwise(p: SequencePropagator, node: fx.Node):
    out = tensor_val(node)
    if out is None:
        return False
    out_ndim = out.dim()
    participants = p.tensor_args(node)
    if is_first_arg_only(node):
        participants = participants[:1]
    inplace = is_inplace(node)
    target: Sharded | None = None
    if inplace:
        self_node = node.args[0]
        sl = p.L(self_node)
        target = map_broadcast(len(shape(self_node)), out_ndim, sl) if sl else None
    else:
        for part in participants:
            sp = p.L(part)
            if isinstance(sp, Sharded):
                target = map_broadcast(len(shape(part)), out_ndim, sp)
                break
    out_shape = tuple(out.shape)
    for part in participants:
        sp = p.L(part)
        p_shape = shape(part)
        offset = out_ndim - len(p_shape)
        if isinstance(sp, Sharded):
            mapped = map_broadcast(len(p_shape), out_ndim, sp)
            if target is None or mapped != target:
                replace_input(node, part, p.gather(part, node, "operands split differently"))
                sp = None
            else:
                continue
        if target is None:
            continue
        a = target.dim - offset
        if a >= 0 and p_shape[a] != 1:
            if p_shape[a] != out_shape[target.dim]:
                return False
            replace_input(node, part, p.slice(part, a, target))
    p.layout[node] = target
    return None


rule_along_dim = acts_along(1, "dim")


def rule_reduction(p: SequencePropagator, node: fx.Node):
    x = node.args[0]
    sh = p.L(x)
    if not isinstance(sh, Sharded) or len(p.tensor_args(node)) != 1:
        return False
    ndim = len(shape(x))
    dims = arg(node, 1, "dim")
    out_val = node.meta.get("val", node.meta.get("example_value"))
    first_out = out_val[0] if isinstance(out_val, tuple) else out_val
    # keepdim's position differs between reductions (var(dim, unbiased, keepdim)): read it
    # off the result's rank instead.
    keepdim = isinstance(first_out, torch.Tensor) and first_out.dim() == ndim and ndim > 0
    if in_table(node, _MAX_MIN) and dims is None:
        return False
    mapped = map_reduce(ndim, dims, keepdim, sh)
    if mapped is not None:
        p.layout[node] = (mapped, mapped) if isinstance(out_val, tuple) else mapped
        return None
    is_sum = in_table(node, _SUM)
    if not is_sum and not in_table(node, _MEAN):
        return False
    x = p.fill_padding(x, 0)
    dtype = node.kwargs.get("dtype")
    tag = p.tag_for(node)
    if is_sum:
        new_target, args = sharded_sum, (x, dims, keepdim, dtype, p.group, p.D, tag)
    else:
        count = 1
        for d in reduced_dims(ndim, dims):
            count *= shape(x)[d]
        new_target = sharded_mean
        args = (x, dims, keepdim, dtype, count, p.group, p.D, tag)
    node.op, node.target, node.args, node.kwargs = "call_function", new_target, args, {}
    p.layout[node] = None
    return None


def rule_linear(p: SequencePropagator, node: fx.Node):
    x = node.args[0]
    sh = p.L(x)
    if not isinstance(sh, Sharded) or sh.dim == len(shape(x)) - 1:
        return False
    for w in p.tensor_args(node)[1:]:
        if isinstance(p.L(w), Sharded):
            replace_input(node, w, p.gather(w, node, "linear weight"))
    p.layout[node] = sh
    return None


def rule_addmm(p: SequencePropagator, node: fx.Node):
    """``addmm(b, x, W)`` (GPT-2's Conv1D on flattened tokens): token-wise, like linear,
    when only the rows of ``x`` are split."""
    bias, x, w = (node.args + (None, None, None))[:3]
    sh = p.L(x) if isinstance(x, fx.Node) else None
    if not isinstance(sh, Sharded) or sh.dim != 0 or node.kwargs:
        return False
    if any(isinstance(t, fx.Node) and isinstance(p.L(t), Sharded) for t in (bias, w)):
        return False
    p.layout[node] = sh
    return None


def rule_embedding(p: SequencePropagator, node: fx.Node):
    ids = node.args[0]
    sh = p.L(ids)
    if not isinstance(sh, Sharded):
        return False
    w = arg(node, 1, "weight")
    if isinstance(p.L(w), Sharded):
        return False
    p.layout[node] = sh
    return None


def rule_matmul(p: SequencePropagator, node: fx.Node):
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    sa, sb = p.L(a), p.L(b)
    an, bn = len(shape(a)), len(shape(b))
    on = len(shape(node))
    if an < 2 or bn < 2:
        return False
    if isinstance(sa, Sharded) and sa.dim == an - 1:
        a = p.gather(a, node, "contracted dimension")
        replace_input(node, node.args[0], a)
        sa = None
    if isinstance(sb, Sharded) and sb.dim == bn - 2:
        b = p.gather(b, node, "contracted dimension")
        replace_input(node, node.args[1], b)
        sb = None
    if isinstance(sa, Sharded) and isinstance(sb, Sharded):
        oa = map_broadcast(an, on, sa)
        ob = map_broadcast(bn, on, sb)
        if oa != ob or oa.dim >= on - 2:
            replace_input(node, node.args[1], p.gather(node.args[1], node, "both sharded"))
            sb = None
    if isinstance(sa, Sharded):
        out = map_broadcast(an, on, sa)
        if out.dim < on - 2:  # a batch dimension: b must follow
            bd = out.dim - (on - bn)
            if sb is None and bd >= 0 and shape(b)[bd] != 1:
                replace_input(node, node.args[1], p.slice(node.args[1], bd, out))
    elif isinstance(sb, Sharded):
        out = map_broadcast(bn, on, sb)
        if out.dim < on - 2:
            ad = out.dim - (on - an)
            if ad >= 0 and shape(a)[ad] != 1:
                replace_input(node, node.args[0], p.slice(node.args[0], ad, out))
    else:
        out = None
    p.layout[node] = out
    return None


def _norm(p: SequencePropagator, node, shape_index: int):
    x = node.args[0]
    sh = p.L(x)
    nshape = arg(node, shape_index, "normalized_shape")
    k = 1 if isinstance(nshape, int) else len(nshape)
    if not isinstance(sh, Sharded) or sh.dim >= len(shape(x)) - k:
        return False
    for w in p.tensor_args(node)[1:]:
        if isinstance(p.L(w), Sharded):
            return False
    p.layout[node] = sh
    return None


def rule_layer_norm(p: SequencePropagator, node):
    return _norm(p, node, 1)


# ``F.normalize(x, p, dim=1)``: x divided by its p-norm along ``dim`` (x-transformers' RMSNorm
# and q/k l2-norm): token-wise unless that dim is the sequence
rule_normalize = acting_along(lambda node: arg(node, 2, "dim", 1))


# The rules not chosen by the op tables of seq_ops (elementwise, along a dim, reductions).
RULES = {
    "normalize": rule_normalize,
    "linear": rule_linear,
    "addmm": rule_addmm,
    "embedding": rule_embedding,
    "matmul bmm": rule_matmul,
    "layer_norm rms_norm": rule_layer_norm,
}
