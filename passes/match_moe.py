"""Pass 2c — match mixture-of-experts experts for expert parallelism on the TSP axis.

A MoE block computes, for every token ``n`` and each of its ``k`` choices ``j``,
``y[n] = sum_j w[n, j] * expert_{ids[n, j]}(x[n])`` with
``expert_e(x) = W2_e(chain(W1_e(x)))``, the experts' weights stacked in two 3-D parameters
``[E, ., .]``. The matcher finds that computation by what the ops do, not by module names:

* two stacked 3-D parameters, each applied per expert group by a grouped matmul
  (``torch._grouped_mm``, ``F.grouped_mm`` or transformers' ``grouped_mm_fallback`` — what
  transformers 5 runs under ``torch.compile`` for Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE,
  PhiMoE), the first one's output reaching the second one's input only through a row-wise
  *chain* (the activation: ``silu(gate) * up`` of a fused ``gate_up``, or a plain one);
* the group offsets of both come from sorting one flat vector of expert ids (``ids``, the
  routing's choice per (token, choice) pair);
* the first matmul reads rows of one ``[N, h]`` hidden state ``x`` (each pair's token);
* after the second matmul, the pairs' outputs are scaled by one more tensor ``w`` of ``N k``
  router weights and summed back to ``[N, h]`` (``y``, the block's routed output);
* ``y`` depends on nothing else: every input of the region between them is ``x``, ``ids``,
  ``w``, the two parameters, or a constant.

Whatever routes (softmax or sigmoid, top-k, renormalisation, PhiMoE's sparse mixer) stays in
the graph and runs on the local tokens; only the experts are replaced
(``passes/rewrite_moe.py``). Shared experts are ordinary MLPs (the ring's, ``match_mlp``).
A block that does not fit is reported as skipped with the reason (``find_moe_blocks``' list).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .analyse import GraphInfo
from .graph_utils import (
    backward_reach,
    closure,
    module_fqn_of_param,
    op_name,
    reachable,
    shape,
    tensor_inputs,
    val,
)
from .held_whole import size_fix
from .match_attention import Skip, failed
from .match_moe_dense import DenseNoMatch, match_dense
from .moe_match import MoeMatch
from .projection import _MATMULS
from .verify_moe import CollapseMismatch, check_collapse

log = logging.getLogger("tspc")

GROUPED_MM = ("grouped_mm_fallback", "_grouped_mm", "grouped_mm")
_TRANSPOSES = ("transpose", "t", "permute", "contiguous")
_SORT_PATH = ("cumsum", "histc", "bincount", "to", "float", "getitem", "sort", "int", "long")
_CASTS = ("to", "float", "contiguous", "type_as", "bfloat16", "half")


class _NoMatch(Exception):
    pass


def _grouped_mm_of(param: fx.Node) -> tuple[fx.Node, str] | None:
    """(the grouped matmul applying ``param`` as its weights, "t" or "n")."""
    work = [(param, 0)]
    while work:
        node, flips = work.pop()
        for u in node.users:
            name = op_name(u) or ""
            if name in GROUPED_MM and u.args[1] is node:
                return u, "t" if flips % 2 else "n"
            if name in _TRANSPOSES:
                dims = [a for a in u.args[1:] if isinstance(a, int)]
                swap = name == "t" or (
                    name == "transpose" and sorted(d % 3 for d in dims) == [1, 2]
                )
                if name == "permute":
                    swap = list(u.args[1:]) in ([0, 2, 1], [[0, 2, 1]], [(0, 2, 1)])
                work.append((u, flips + (1 if swap else 0)))
    return None


def _sorted_ids(offs: fx.Node) -> fx.Node:
    """The flat expert ids whose sort gives the group offsets ``offs``."""
    node = offs
    for _ in range(8):
        if not isinstance(node, fx.Node) or op_name(node) not in _SORT_PATH:
            break
        if op_name(node) == "sort":
            return node.args[0]
        node = node.args[0]
    raise _NoMatch("the experts' group offsets do not come from sorting one vector of expert ids")


def _rows_of(mm_input: fx.Node) -> fx.Node:
    """The ``[N, h]`` tensor whose rows (per pair) the first grouped matmul reads."""
    node = mm_input
    while op_name(node) in _CASTS:
        node = node.args[0]
    if op_name(node) in ("getitem", "index_select", "index") and isinstance(node.args[0], fx.Node):
        return node.args[0]
    raise _NoMatch("the first expert matmul does not read rows of one hidden state")


def is_constant(node: fx.Node) -> bool:
    """Built inside the graph from no input (``arange``, ``zeros``): the same at any D."""
    return not any(n.op == "placeholder" for n in reachable([node], forward=False))


def match_one(w_a: fx.Node, w_b: fx.Node, params) -> MoeMatch:
    """The experts computation applying the stacked weights ``w_a`` and ``w_b``."""
    found = [_grouped_mm_of(w_a), _grouped_mm_of(w_b)]
    if None in found:
        try:
            return match_dense(w_a, w_b, params)
        except DenseNoMatch as e:
            raise _NoMatch(str(e)) from e
    (mm_a, o_a), (mm_b, o_b) = found
    first, second = ((w_a, mm_a, o_a), (w_b, mm_b, o_b))
    if mm_b < mm_a:
        first, second = second, first
    w1, mm1, o1 = first
    w2, mm2, o2 = second
    offs = mm1.kwargs.get("offs", mm1.args[2] if len(mm1.args) > 2 else None)
    offs2 = mm2.kwargs.get("offs", mm2.args[2] if len(mm2.args) > 2 else None)
    if offs is None or offs is not offs2:
        raise _NoMatch("the two expert matmuls do not share one set of group offsets")
    # any routing (top-k, PhiMoE's sparse mixer) stays in the graph: the region reads only
    # the ids it chose and the router weights
    ids = _sorted_ids(offs)
    x = _rows_of(mm1.args[0])
    xs = shape(x)
    if len(xs) != 2:
        raise _NoMatch(f"the experts' hidden state {x.name} is {list(xs)}, not [tokens, hidden]")
    n_tok, hidden = xs
    pairs = int(val(ids).numel())
    if n_tok == 0 or pairs % n_tok:
        raise _NoMatch(f"{pairs} expert choices for {n_tok} tokens")
    k = pairs // n_tok
    s1, s2 = shape(w1), shape(w2)
    if s1[0] != s2[0]:
        raise _NoMatch(f"the stacked weights hold {s1[0]} and {s2[0]} experts")
    if (s1[2] if o1 == "t" else s1[1]) != hidden or (s2[1] if o2 == "t" else s2[2]) != hidden:
        raise _NoMatch(f"the stacked weights {list(s1)}, {list(s2)} do not map {hidden} to itself")
    # the chain: the first matmul's output reaches the second's input through row-wise ops
    mm2_in = mm2.args[0]
    chain_nodes = backward_reach(mm2_in, mm1) & reachable([mm1], within=None) - {mm1}
    for n in chain_nodes:
        for i in tensor_inputs(n, include_tuples=True):
            if i is not mm1 and i not in chain_nodes and not is_constant(i):
                raise _NoMatch(f"the activation between the expert matmuls reads {i.name}")
        if op_name(n) in ("sum", "mean", "softmax", "cumsum", "sort", "topk", "amax", "max"):
            raise _NoMatch(f"{n.name} between the expert matmuls is not row-wise")
    out = _combined_output(mm2, n_tok, hidden)
    region = (
        backward_reach(out, ids) & reachable([w1, w2, ids], forward=True, within=None)
    ) | chain_nodes
    region = {n for n in region if not out < n}
    weights = _router_weights(region, x, ids, w1, w2, pairs)
    if reachable([weights], within=region | {weights}) & {mm1, mm2}:
        raise _NoMatch(
            "the router weights scale the experts' input, not their output (Llama-4's form)"
        )
    inter = shape(mm2_in)[-1]
    return MoeMatch(
        module=module_fqn_of_param(params[w1].fqn),
        x=x,
        ids=ids,
        weights=weights,
        w1=w1,
        w2=w2,
        orient=o1 + o2,
        chain=sorted(chain_nodes),
        mm1=mm1,
        mm2_input=mm2_in,
        mm2=mm2,
        out=out,
        region=region,
        experts=s1[0],
        top_k=k,
        hidden=hidden,
        intermediate=inter,
    )


def moe_chain_module(m: MoeMatch) -> fx.GraphModule:
    """The activation between the two expert matmuls as a function of the first one's rows."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {m.mm1: g.placeholder("p0")}
    for n in m.chain:
        env[n] = g.node_copy(n, lambda a: env[a] if a in env else _constant(g, a, env))
    g.output(env[m.mm2_input])
    return fx.GraphModule(torch.nn.Module(), g)


def _constant(g: fx.Graph, node: fx.Node, env: dict) -> fx.Node:
    """A constant the chain reads (built from no input): copied with its own inputs."""
    for i in node.all_input_nodes:
        if i not in env:
            _constant(g, i, env)
    env[node] = g.node_copy(node, lambda a: env[a])
    return env[node]


_COMBINE = ("mul", "getitem", "index_select", "view", "reshape", "sum", "unsqueeze", "to", "float")


def _combined_output(mm2: fx.Node, n_tok: int, hidden: int) -> fx.Node:
    """The weighted sum over each token's choices: the *last* ``[N, h]`` node reached from the
    second matmul through scaling, un-permuting, reshaping and summing. Not the first: with
    top-k 1 the pairs are as many as the tokens, so the scaled rows are ``[N, h]`` already,
    still in the experts' order, and the un-permutation and the sum over k = 1 come after
    them (taking the scaled rows left the un-permutation in the graph, applied twice)."""
    reached = closure(mm2, _COMBINE)
    best = max((u for u in reached if shape(u) == (n_tok, hidden)), default=None)
    if best is None:
        raise _NoMatch("the experts' outputs are not summed back to one row per token")
    return best


def _router_weights(region, x, ids, w1, w2, pairs: int) -> fx.Node:
    outside = []
    for n in sorted(region - {ids}):
        for i in tensor_inputs(n, include_tuples=True):
            if i in region or i in (x, ids, w1, w2) or i in outside or is_constant(i):
                continue
            outside.append(i)
    weights = [i for i in outside if (v := val(i)) is not None and v.numel() == pairs]
    if len(outside) != 1 or len(weights) != 1:
        names = ", ".join(i.name for i in outside) or "nothing"
        raise _NoMatch(
            f"the experts' output depends on {names} besides the hidden state and the expert "
            "ids (expected one tensor of router weights)"
        )
    if not weights[0].meta.get("val", torch.empty(0)).is_floating_point():
        raise _NoMatch(f"the router weights {weights[0].name} are not floating point")
    return weights[0]


def einsum_projection_only(param: fx.Node) -> bool:
    """True when every use of the 3-D ``param`` is a two-operand einsum in which none of its
    indices is a batch index (in both operands and the output): a projection whose weight
    contracts or adds several dims (``bhse,hed->bsd``), not one expert per leading index."""
    if not param.users:
        return False
    for user in param.users:
        args = list(user.args)
        if len(args) == 2 and isinstance(args[1], (list, tuple)):
            args = [args[0], *args[1]]
        if op_name(user) != "einsum" or len(args) != 3 or not isinstance(args[0], str):
            return False
        eq = args[0].replace(" ", "")
        if "->" not in eq or len(eq.split("->")[0].split(",")) != 2:
            return False
        lhs, out = eq.split("->")
        a, b = lhs.split(",")
        mine, other = (a, b) if args[1] is param else (b, a)
        if any(c in other and c in out for c in mine if c != "."):
            return False
    return True


def applied_by_matmul(node: fx.Node, depth: int = 3) -> fx.Node | None:
    """The matmul-family op (grouped, batched, einsum, ...) that applies the 3-D parameter
    ``node``, through a few views and casts; None for any other use (a convolution's
    ``[C, 1, K]`` weight is no stack of experts)."""
    for u in node.users:
        name = op_name(u) or ""
        if name in _MATMULS or "mm" in name.split("_") or name in ("bmm", "baddbmm", "einsum"):
            return u
        if depth > 1 and name in ("getitem", "transpose", "permute", "t", "to", "contiguous"):
            found = applied_by_matmul(u, depth - 1)
            if found is not None:
                return found
    return None


def stacked_pairs(gm: fx.GraphModule, params) -> dict[str, list[fx.Node]]:
    """{MoE block (``module_fqn_of_param``'s module of the experts): its 3-D parameters}."""
    out: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in params and len(shape(node)) == 3:
            if einsum_projection_only(node) or applied_by_matmul(node) is None:
                continue
            out.setdefault(module_fqn_of_param(params[node].fqn), []).append(node)
    return out


def match_moe(gm: fx.GraphModule, info: GraphInfo, world: int) -> tuple[list[MoeMatch], list[Skip]]:
    """MoE experts the expert-parallel schedule can run, and (module, reason) for those it
    cannot (left to ``match_mlp``'s MoE skip, which reports them)."""
    params = info.params
    matches, skips = [], []
    for block, stacked in stacked_pairs(gm, params).items():
        if len(stacked) != 2:
            names = ", ".join(params[p].fqn for p in stacked)
            skips.append(
                Skip(
                    "mlp",
                    block,
                    f"mixture of experts: {len(stacked)} stacked "
                    f"parameters ({names}); expert parallelism takes two (no biases)",
                )
            )
            continue
        try:
            m = match_one(stacked[0], stacked[1], params)
            if m.form != "dense":  # the dense form proves its own reading (match_moe_dense)
                unchecked = check_collapse(m, moe_chain_module(m))
                if unchecked:
                    log.debug("tspc: MoE block %s: the collapse check was %s", block, unchecked)
        except (_NoMatch, CollapseMismatch) as e:
            skips.append(Skip("mlp", block, f"mixture of experts: {e}"))
            continue
        except Exception as e:  # noqa: BLE001 - this block alone is skipped and reported
            skips.append(failed("mlp", block, "match", e))
            continue
        c = -(-m.experts // world)
        if world > 1 and (world - 1) * c >= m.experts:
            # an empty Shard(0) slice trains exactly, but generate() at D = 3 with E = 4 hung
            # (the empty rank recompiled its prefill alone): held whole until that is solved
            skips.append(
                Skip(
                    "mlp",
                    block,
                    f"mixture of experts: {m.experts} experts cannot be split over D={world} "
                    f"ranks in chunks of {c} (a rank would own none)",
                    fix=size_fix("number of experts", m.experts),
                )
            )
            continue
        matches.append(m)
    return matches, skips
