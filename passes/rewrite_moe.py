"""Pass 4c — rewrite matched MoE experts into expert parallelism (``runtime/moe.py``).

The experts' region (dispatch sort, grouped matmuls, activation, un-permutation, weighted sum)
becomes one ``moe_experts`` call on this rank's tokens and experts, followed by the weighted sum
over each token's choices as plain graph ops (so the router weights' gradient is autograd's):

    out = moe_experts(x, ids, W1[mine], W2[mine], chain, orient, E, ...)      # [N k, h]
    y = (out * weights.reshape(-1, 1)).view(-1, k, h).sum(1)                 # [N, h]

Rank r's shard of each stacked weight is experts ``[r c, min((r + 1) c, E))``, ``c =
ceil(E / D)``: the chunks of ``torch.chunk``, a ``Shard(0)`` DTensor. The routing before it is
untouched (it runs on the local tokens); the activation chain is copied out of the graph like
the MLP ring's (``chain_module``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from tspc.runtime.group import TSPGroup
from tspc.runtime.moe import owned_experts
from tspc.runtime.ring_mlp import register_chain
from tspc.runtime.shard_store import ShardSpec

from .analyse import defer_recompile
from .graph_utils import mutated_args, shape, tensor_val
from .match_moe import MoeMatch, is_constant, moe_chain_module
from .shard_inputs import ShardInputs


@dataclass
class MoeRewrite:
    module: str
    experts: int
    experts_per_rank: list[int]
    top_k: int
    activation: str
    form: str  # "moe (expert parallel)"
    shard_numel: int


def _specs(m: MoeMatch, world: int, rank: int) -> ShardSpec | None:
    own = owned_experts(m.experts, world, rank)
    return ShardSpec(0, own.start, own.stop) if len(own) else None


def collapse_moe(gm: fx.GraphModule, m: MoeMatch, chains: dict) -> fx.Node:
    """Replace the experts' region by one ``moe_experts`` call on the whole weights (world 1)
    and the weighted sum; returns the call. Runs before the sequence pass, which sees a
    token-wise op (``passes/seq_rules_moe.py``) where the region's sorts over all pairs would
    need the whole sequence; ``shard_moe`` then gives it this rank's experts."""
    g = gm.graph
    with g.inserting_before(m.out):
        chain = moe_chain_module(m)
        digest = hashlib.sha1(chain.code.encode()).hexdigest()[:10]
        key = register_chain(f"moe#{digest}", chain, chains)
        out_dtype = tensor_val(m.mm2).dtype
        x, ids = m.x, m.ids
        if m.form == "dense":
            # each pair's row is its token's hidden state scaled by its expert's score, as
            # the model's own x[n] * s[n, e] (same op, same dtypes): the experts' input
            pair_scores = g.call_function(torch.gather, (m.weights, 1, m.ids))
            scaled_rows = g.call_function(
                torch.mul,
                (
                    g.call_function(torch.unsqueeze, (m.x, 1)),
                    g.call_function(torch.unsqueeze, (pair_scores, -1)),
                ),
            )
            x = g.call_function(torch.reshape, (scaled_rows, (-1, m.hidden)))
            ids = g.call_function(torch.reshape, (m.ids, (-1,)))
        args = (x, ids, m.w1, m.w2, key, m.orient, m.experts, out_dtype, 0, 1, "", m.module)
        res = g.call_function(torch.ops.tspc.moe_experts.default, args)
        res.meta["tspc_role"] = "moe_experts"
        for meta in ("recompute", "ac_graph_id", "nn_module_stack"):
            if meta in m.out.meta:
                res.meta[meta] = m.out.meta[meta]
        if m.form == "dense":
            scaled, w_dtype = res, out_dtype
        else:
            w = g.call_function(torch.reshape, (m.weights, (-1, 1)))
            scaled = g.call_function(torch.mul, (res, w))
            w_dtype = tensor_val(m.weights).dtype
        grouped = g.call_function(torch.reshape, (scaled, (-1, m.top_k, m.hidden)))
        y = g.call_function(torch.sum, (grouped,), {"dim": 1})
        if tensor_val(m.out).dtype != torch.promote_types(out_dtype, w_dtype):
            y = g.call_function(torch.Tensor.to, (y, tensor_val(m.out).dtype))
    m.out.replace_all_uses_with(y)
    _erase_region(g, m)
    defer_recompile(gm)
    m.activation = chain.code
    return res


def shard_moe(
    gm: fx.GraphModule, op: fx.Node, m: MoeMatch, group: TSPGroup, shards: ShardInputs | None
) -> MoeRewrite:
    """Give the ``moe_experts`` call ``op`` this rank's experts (``Shard(0)`` of both stacked
    weights, declared for every rank) and the group."""
    D, rank = group.size, group.rank
    args = list(op.args)
    numel = 0
    if D > 1:
        with gm.graph.inserting_before(op):
            for i, p in ((2, m.w1), (3, m.w2)):
                layout = [[s] if (s := _specs(m, D, r)) else [] for r in range(D)]
                shards.declare(p, layout)
                spec = _specs(m, D, rank)
                name = f"tsp_{m.module.replace('.', '_')}_w{i - 1}"
                args[i] = shards.get(p, spec, name)
                numel += spec.length * shape(p)[1] * shape(p)[2]
        args[8:11] = [rank, D, group.name]
    op.args = tuple(args)
    defer_recompile(gm)
    return MoeRewrite(
        m.module,
        experts=m.experts,
        experts_per_rank=[len(owned_experts(m.experts, D, r)) for r in range(D)],
        top_k=m.top_k,
        activation=_chain_text(m),
        form="moe (expert parallel)",
        shard_numel=numel,
    )


def _chain_text(m: MoeMatch) -> str:
    body = [ln.strip() for ln in m.activation.splitlines() if ln.strip().startswith(("return",))]
    return body[0] if body else "?"


def _erase_region(g: fx.Graph, m: MoeMatch) -> None:
    """Erase the replaced region: its nodes and the in-place writes into its own tensors (the
    un-permutation's ``inv_perm[perm] = arange``), once nothing else reads them."""
    keep = {m.x, m.ids, m.weights, m.w1, m.w2}
    candidates = set(m.region) | {m.out}
    for n in list(g.nodes):
        if n in candidates or n.op != "call_function":
            continue
        ins = {i for i in n.all_input_nodes if not is_constant(i)}
        writes = mutated_args(n)
        if ins and ins <= candidates | keep and writes and all(a in candidates for a in writes):
            candidates.add(n)
    changed = True
    while changed:
        changed = False
        for n in sorted(candidates, reverse=True):
            if n in keep or n.op == "placeholder" or n.graph is not g or n.users:
                continue
            g.erase_node(n)
            candidates.discard(n)
            changed = True
