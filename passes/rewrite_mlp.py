"""Pass 4b — rewrite matched MLPs into the ring schedule (``runtime/ring_mlp.py``).

The whole ``down(act(up_1(x), ..., up_k(x)))`` becomes one ``ring_mlp`` call on this rank's shard
of the intermediate dimension F: an even chunk of F of every up weight (rows of a Linear
``[F, h]``, columns of a Conv1D ``[h, F]``) and bias, and of the down weight (its columns, or
rows for Conv1D). The activation chain between them is copied out of the graph into a small
function the ring applies to each shard (``chain_module``), registered under a key the graph
names. The ring's forward and backward are fixed algorithms with explicit hop nodes, which
aot_autograd traces into the forward and backward graphs. The down projection's bias, if any,
is added once after the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from tspc.runtime.group import TSPGroup
from tspc.runtime.ring_mlp import register_chain, ring_mlp
from tspc.runtime.shard_store import ShardSpec

from .analyse import GraphInfo, defer_recompile
from .graph_utils import erase_unused, shape, tensor_val
from .match_mlp import MlpMatch, chain_key, chain_module
from .shard_inputs import ShardInputs


@dataclass
class MlpRewrite:
    module: str
    steps: int
    hops: int
    activation: str
    form: str  # "plain" (one up projection) or "gated"
    shard_numel: int
    predicted_recv_bytes: int


def _ring_specs(m: MlpMatch, rank: int, f_local: int) -> dict[str, tuple[fx.Node, ShardSpec]]:
    """The slices of the MLP's weights that ``rank`` owns: its F-range of every up weight (the
    weight's output-feature dim: rows of a Linear, columns of a Conv1D) and bias, and of the
    down weight's input-feature dim (columns of a Linear, rows of a Conv1D). Each rank owns an
    even chunk of F, so each weight's slices are a DTensor ``Shard`` (``_StridedShard`` for the
    parts of a fused one)."""

    def f_range(u, dim: int) -> ShardSpec:
        return ShardSpec(dim, u.start + rank * f_local, u.start + (rank + 1) * f_local)

    specs = {}
    for i, u in enumerate(m.ups):
        specs[f"w{i}"] = (u.proj.weight, f_range(u, u.proj.f_dim))
        if u.proj.bias is not None:
            specs[f"b{i}"] = (u.proj.bias, f_range(u, 0))
    down_dim = 0 if m.down.transposed else 1
    specs["down_w"] = (m.down.weight, ShardSpec(down_dim, rank * f_local, (rank + 1) * f_local))
    # The runtime fills the shard inputs parameter by parameter (tspc/backend.py): the slices
    # of one parameter (a fused gate_up weight, its bias) must be adjacent inputs.
    order = list(dict.fromkeys(pnode for pnode, _ in specs.values()))
    return dict(sorted(specs.items(), key=lambda kv: order.index(kv[1][0])))


def rewrite_mlp(
    gm: fx.GraphModule,
    info: GraphInfo,
    m: MlpMatch,
    group: TSPGroup,
    shards: ShardInputs,
    chains: dict,
) -> MlpRewrite:
    """``chains``: the compiled graph's ``RuntimeContext.chains``, which holds the ring's
    activation chain for as long as the graph lives."""
    g = gm.graph
    D, rank = group.size, group.rank
    f_local = m.intermediate // D
    per_rank = [_ring_specs(m, r, f_local) for r in range(D)]
    specs = per_rank[rank]
    nodes: dict[str, fx.Node | None] = {}
    numel = 0
    if D > 1:
        # every rank's slices of each parameter (a fused gate_up weight holds two per rank)
        layouts: dict[fx.Node, list[list[ShardSpec]]] = {}
        for r, pr in enumerate(per_rank):
            for pnode, spec in pr.values():
                layouts.setdefault(pnode, [[] for _ in range(D)])[r].append(spec)
        for pnode, layout in layouts.items():
            shards.declare(pnode, layout)
    with g.inserting_before(m.down.node):
        for name, (pnode, spec) in specs.items():
            if D > 1:
                nodes[name] = shards.get(pnode, spec, f"tsp_{m.module.replace('.', '_')}_{name}")
                numel += (spec.stop - spec.start) * (
                    shape(pnode)[1 - spec.dim] if len(shape(pnode)) == 2 else 1
                )
            elif spec.start == 0 and spec.stop == shape(pnode)[spec.dim]:
                nodes[name] = pnode
            else:
                nodes[name] = g.call_function(
                    torch.narrow, (pnode, spec.dim, spec.start, spec.stop - spec.start)
                )
        chain = chain_module(m)
        key = register_chain(chain_key(m, chain), chain, chains)
        k = len(m.ups)
        orient = "".join("t" if lin.transposed else "n" for lin in [u.proj for u in m.ups])
        x = m.ups[0].proj.current_x()
        y = g.call_function(
            ring_mlp,
            (
                x,
                [nodes[f"w{i}"] for i in range(k)],
                [nodes.get(f"b{i}") for i in range(k)],
                nodes["down_w"],
                key,
                orient + ("t" if m.down.transposed else "n"),
                rank,
                D,
                group.name,
                m.module,
            ),
        )
        y.meta["tspc_role"] = "mlp_ring"
        for meta in ("recompute", "ac_graph_id", "nn_module_stack"):  # activation checkpointing
            if meta in m.down.node.meta:
                y.meta[meta] = m.down.node.meta[meta]
        # the bias as the graph reads it now: through its gradient sync (it stays replicated)
        bias = m.down.current_bias()
        out = g.call_function(torch.add, (y, bias)) if bias is not None else y
        if len(shape(m.down.node)) != len(shape(x)):  # Linear and Conv1D mixed: 3-D vs 2-D
            out = g.call_function(torch.reshape, (out, shape(m.down.node)))
    m.down.node.replace_all_uses_with(out)
    upstream = m.down.node.all_input_nodes
    g.erase_node(m.down.node)
    erase_unused(g, upstream)  # the up projections and the activation chain, now unused
    defer_recompile(gm)  # once for all layers, by the next shape propagation
    elem = tensor_val(m.down_weight).element_size()
    return MlpRewrite(
        m.module,
        steps=D,
        hops=D - 1,
        activation=m.activation,
        form="gated" if m.gated else "plain",
        shard_numel=numel,
        predicted_recv_bytes=(D - 1) * numel * elem,
    )


# Sub-shard hops for the rings of recomputed blocks when the option does not say (options.py):
# there the ring's four buffers (weights in use and in flight, accumulators arriving and
# leaving: four shards) were the largest thing at the backward's peak; in c chunks they are
# about (2c + 3) / c shards. Measured on the 'weights' bench config at D = 4 (fake tensors,
# per-rank peak): 2 chunks 91.25 MB, 4: 89.40, 8: 88.48, 16: 88.16 (then the peak is the
# optimizer step's, not the ring's).
RECOMPUTED_RING_CHUNKS = 8


def set_ring_hop_chunks(gm: fx.GraphModule, chunks: int | None) -> int:
    """Give every MLP ring call its ``hop_chunks``: ``chunks`` if given, else
    ``RECOMPUTED_RING_CHUNKS`` for a ring that saves no projection (a recomputed block's,
    ``passes/recompute.py``) and 1 for the others. Returns the number of rings that hop in
    chunks."""
    chunked = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not ring_mlp:
            continue
        c = chunks
        if c is None:
            recomputed = not n.kwargs.get("save_projections", True)
            c = RECOMPUTED_RING_CHUNKS if recomputed else 1
        n.kwargs = {**n.kwargs, "hop_chunks": c}
        chunked += c > 1
    return chunked
