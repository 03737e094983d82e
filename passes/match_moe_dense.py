"""Pass 2c (second form) — MoE experts that run every expert on every token, input-scaled.

Llama-4's text MoE computes ``y[n] = sum_e expert_e(x[n] * s[n, e])`` for *every* expert e, with
``s = g(scatter(fill, 1, idx, vals))``: the router's scores written at each token's top-k
experts ``idx`` into a constant ``fill`` elsewhere, then an elementwise ``g`` (``sigmoid`` of
``-inf`` is 0). The experts are two stacked 3-D weights applied by ``bmm`` to the ``[E, N, h]``
scaled copies of the hidden state.

Where ``g(fill) == 0`` exactly and ``expert_e(0) == 0`` exactly (a row-wise activation with
``act(0) * 0 == 0`` and no biases), an unchosen expert adds exactly zero to the output, to the
hidden state's gradient and to its weights' gradient, and its score's gradient goes only into
the constant fill. So the block equals, exactly, the top-k form ``moe_experts`` runs:
``y[n] = sum_j expert_{idx[n, j]}(x[n] * s[n, idx[n, j]])`` — k experts per token instead of E,
the pairs routed to the experts' owners by all-to-all (``passes/rewrite_moe.py``).

Everything is checked by what the ops do: the region from ``(x, s)`` to the first matmul's
input is run on random values and must equal ``x[None] * s.T[..., None]``; the region from the
second matmul to the block's output must equal a sum over the experts; the activation must map
zero rows to zero and act on rows alone; ``g`` is run on the fill value. Whatever does not hold
is a skip with the reason.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import (
    copy_region,
    first_reached,
    module_fqn_of_param,
    op_name,
    shape,
    tensor_inputs,
    val,
)
from .moe_match import MoeMatch

BMM = ("bmm", "matmul")
_FILLS = {"full_like": 1, "new_full": 2, "full": 1}
_ZERO_FILLS = ("zeros_like", "new_zeros", "zeros")
_SCORE_CHAIN = ("to", "float", "sigmoid", "type_as", "contiguous", "half", "bfloat16", "clone")


class DenseNoMatch(Exception):
    pass


def bmm_of(param: fx.Node) -> fx.Node | None:
    """The batched matmul applying the stacked ``param`` ``[E, ., .]`` as its right operand."""
    for u in param.users:
        if op_name(u) in BMM and len(u.args) >= 2 and u.args[1] is param:
            return u
    return None


def _copy_region(nodes: list[fx.Node], inputs: list[fx.Node], out: fx.Node) -> fx.GraphModule:
    try:
        return copy_region(nodes, inputs, out)
    except LookupError as e:
        raise DenseNoMatch(f"the experts' {e}") from e


def _between(dst: fx.Node, srcs: list[fx.Node]) -> list[fx.Node]:
    """The nodes on paths from ``srcs`` to ``dst`` (``dst`` included, ``srcs`` not)."""
    start, stop = min(srcs), set(srcs)
    back, stack = {dst}, [dst]
    while stack:  # backward from dst, not through srcs (their own inputs are not between)
        n = stack.pop()
        for i in tensor_inputs(n, include_tuples=True):
            if i not in back and not i < start:
                back.add(i)
                if i not in stop:
                    stack.append(i)
    fwd: set[fx.Node] = set(srcs)
    for n in sorted(back):
        if any(i in fwd for i in n.all_input_nodes):
            fwd.add(n)
    return sorted((back & fwd) - set(srcs))


def _random_like(node: fx.Node, gen: torch.Generator, shape_: tuple | None = None) -> torch.Tensor:
    v = val(node)
    return torch.randn(shape_ or tuple(int(s) for s in v.shape), generator=gen).to(v.dtype)


def _find_inputs(a: fx.Node, n_tok: int, hidden: int, experts: int) -> tuple[fx.Node, fx.Node]:
    """The ``[N, h]`` hidden state and the ``[N, E]`` scores nearest behind ``a``."""
    if hidden == experts:
        raise DenseNoMatch("the hidden size equals the number of experts: x and the scores alike")
    x = s = None
    stack, seen = [a], {a}
    while stack:
        n = stack.pop(0)
        sh = tuple(int(d) for d in val(n).shape) if n is not a else None
        if sh == (n_tok, hidden) and x is None:
            x = n
            continue
        if sh == (n_tok, experts) and s is None:
            s = n
            continue
        for i in tensor_inputs(n):
            if i not in seen and i.op != "placeholder":
                seen.add(i)
                stack.append(i)
    if x is None or s is None:
        raise DenseNoMatch(
            "the experts' input is not the hidden state scaled by one [tokens, experts] score"
        )
    return x, s


def _check_scaled_copies(a, x, s, experts: int) -> None:
    region = _between(a, [x, s])
    mod = _copy_region(region, [x, s], a)
    gen = torch.Generator().manual_seed(0)
    xv, sv = _random_like(x, gen), _random_like(s, gen)
    got = mod(xv, sv)
    want = (xv[None] * sv.t()[..., None]).to(got.dtype).reshape(got.shape)
    if not torch.equal(got, want):
        raise DenseNoMatch("the experts' input is not x[n] * s[n, e] for every expert e")


def _top_k_of(s: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """``idx``, the ``[N, k]`` expert ids the scores were written at, and ``g``'s nodes;
    checks ``g(fill) == 0``."""
    chain, node = [], s
    while op_name(node) in _SCORE_CHAIN:
        chain.append(node)
        node = node.args[0]
    if op_name(node) not in ("scatter", "scatter_") or len(node.args) < 4:
        raise DenseNoMatch(
            "the scores are not the router's top-k written into a constant (scatter)"
        )
    base, dim, idx = node.args[0], node.args[1], node.args[2]
    if not isinstance(dim, int) or dim % 2 != 1:
        raise DenseNoMatch("the scores are scattered along the tokens")
    name = op_name(base) if isinstance(base, fx.Node) else None
    if (
        name in _FILLS
        and len(base.args) > _FILLS[name]
        and isinstance(base.args[_FILLS[name]], float | int)
    ):
        fill = float(base.args[_FILLS[name]])
    elif name in _ZERO_FILLS:
        fill = 0.0
    else:
        raise DenseNoMatch("the scores are not written into a constant fill")
    if op_name(idx) != "getitem" or idx.args[1] != 1 or op_name(idx.args[0]) != "topk":
        raise DenseNoMatch("the scores' expert ids are not a top-k's (distinct per token)")
    chain.reverse()
    if chain:
        mod = _copy_region(chain, [node], chain[-1])
        probe = torch.full((1, 2), fill, dtype=val(node).dtype)
        if not torch.equal(mod(probe), torch.zeros_like(mod(probe))):
            raise DenseNoMatch(f"an unchosen expert's score g({fill}) is not exactly 0")
    elif fill != 0.0:
        raise DenseNoMatch(f"an unchosen expert's score is {fill}, not 0")
    return idx, chain


def _check_chain(chain_nodes: list[fx.Node], mm1: fx.Node, mm2_in: fx.Node) -> None:
    """The activation acts on rows alone and maps a zero row to zero."""
    for n in chain_nodes:
        for i in tensor_inputs(n, include_tuples=True):
            if i is not mm1 and i not in chain_nodes:
                raise DenseNoMatch(f"the activation between the expert matmuls reads {i.name}")
    mod = _copy_region(chain_nodes, [mm1], mm2_in)
    gen = torch.Generator().manual_seed(1)
    e, n, w = (int(d) for d in val(mm1).shape)
    xv = _random_like(mm1, gen)
    whole = mod(xv)
    rows = mod(xv.reshape(e * n, w))
    if rows.shape[:1] != (e * n,) or not torch.equal(whole.reshape(rows.shape), rows):
        raise DenseNoMatch("the activation between the expert matmuls is not row-wise")
    zero = mod(torch.zeros((1, w), dtype=xv.dtype))
    if not torch.equal(zero, torch.zeros_like(zero)):
        raise DenseNoMatch("an expert maps a zero input to a nonzero output (biases or act(0))")


def _expert_sum(mm2: fx.Node, n_tok: int, hidden: int) -> tuple[fx.Node, list[fx.Node]]:
    """The first ``[N, h]`` node after the second matmul, checked to be its sum over experts."""
    best = first_reached(
        mm2,
        ("view", "reshape", "sum", "to", "contiguous"),
        lambda u: tuple(int(d) for d in val(u).shape) == (n_tok, hidden),
    )
    if best is None:
        raise DenseNoMatch("the experts' outputs are not summed back to one row per token")
    region = _between(best, [mm2])
    mod = _copy_region(region, [mm2], best)
    gen = torch.Generator().manual_seed(2)
    ov = _random_like(mm2, gen)
    want = ov.reshape(-1, n_tok, hidden).sum(0)
    if not torch.allclose(mod(ov).to(want.dtype), want, rtol=1e-5, atol=1e-6):
        raise DenseNoMatch("the experts' outputs are not summed over the experts")
    return best, region


def match_dense(w_a: fx.Node, w_b: fx.Node, params):
    """The every-expert, input-scaled experts computation (module docstring) applying the
    stacked ``w_a`` and ``w_b``, as the ``MoeMatch`` of its top-k form."""
    mm_a, mm_b = bmm_of(w_a), bmm_of(w_b)
    if mm_a is None or mm_b is None:
        raise DenseNoMatch(
            "the stacked experts are applied neither by a grouped matmul over tokens sorted "
            "by expert nor by a batched matmul over every expert"
        )
    (w1, mm1), (w2, mm2) = sorted([(w_a, mm_a), (w_b, mm_b)], key=lambda t: t[1])
    experts = shape(w1)[0]
    a = mm1.args[0]
    sa = shape(a)
    if len(sa) != 3 or sa[0] != experts or shape(w2)[0] != experts:
        raise DenseNoMatch(f"the batched expert matmul's input is {list(sa)}, not [E, N, h]")
    _, n_tok, hidden = sa
    if shape(w1)[1] != hidden or shape(w2)[2] != hidden:
        raise DenseNoMatch(
            f"the stacked weights {list(shape(w1))}, {list(shape(w2))} do not map {hidden} to itself"
        )
    x, s = _find_inputs(a, n_tok, hidden, experts)
    _check_scaled_copies(a, x, s, experts)
    idx, _ = _top_k_of(s)
    mm2_in = mm2.args[0]
    chain = _between(mm2_in, [mm1])
    _check_chain(chain, mm1, mm2_in)
    out, tail = _expert_sum(mm2, n_tok, hidden)
    region = set(_between(a, [x, s])) | {mm1, mm2} | set(chain) | set(tail)
    region.discard(out)
    k = int(shape(idx)[1])
    return MoeMatch(
        module=module_fqn_of_param(params[w1].fqn),
        x=x,
        ids=idx,
        weights=s,
        w1=w1,
        w2=w2,
        orient="nn",
        chain=chain,
        mm1=mm1,
        mm2_input=mm2_in,
        mm2=mm2,
        out=out,
        region=region,
        experts=experts,
        top_k=k,
        hidden=hidden,
        intermediate=shape(mm2_in)[-1],
        form="dense",
    )
