"""Pass 4b — rewrite matched gated MLPs into the ring schedule (``runtime/ring_mlp.py``).

The whole ``down(act(gate(x)) * up(x))`` becomes one ``ring_mlp`` call on this rank's shard of
the intermediate dimension (rows of gate/up, columns of down). Its forward and backward are
fixed algorithms with explicit hop nodes, which aot_autograd traces into the forward and
backward graphs. The down projection's bias, if any, is added once after the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from tspc.runtime.group import TSPGroup
from tspc.runtime.ring_mlp import ring_mlp
from tspc.runtime.shard_store import ShardSpec

from .analyse import GraphInfo, defer_recompile, register_value_rule
from .graph_utils import erase_unused, shape, tensor_val
from .match_mlp import MlpMatch
from .shard_inputs import ShardInputs


def _ring_mlp_value(x, w_gate, w_up, w_down, *rest):
    """The ring's output metadata: ``x``'s leading dimensions and the down projection's
    output features, contiguous, in ``x``'s dtype (the ring adds F.linear results)."""
    out = x.new_empty((*x.shape[:-1], w_down.shape[0]))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, w_gate, w_up, w_down, *rest)
    )
    return out.requires_grad_(needs_grad)


register_value_rule(ring_mlp, _ring_mlp_value)


@dataclass
class MlpRewrite:
    module: str
    steps: int
    hops: int
    activation: str
    shard_numel: int
    predicted_recv_bytes: int


def _ring_specs(m: MlpMatch, rank: int, f_local: int) -> dict[str, tuple[fx.Node, ShardSpec]]:
    """The slices of the MLP's weights that ``rank`` owns: its F-range of gate/up rows (and
    biases) and of down's columns."""

    def rows(p) -> ShardSpec:
        return ShardSpec(0, p.row_start + rank * f_local, p.row_start + (rank + 1) * f_local)

    specs = {
        "gate_w": (m.gate.weight, rows(m.gate)),
        "up_w": (m.up.weight, rows(m.up)),
        "down_w": (m.down_weight, ShardSpec(1, rank * f_local, (rank + 1) * f_local)),
    }
    if (m.gate.bias is None) != (m.up.bias is None):
        raise ValueError(f"{m.module}: gate and up must both have biases or neither")
    if m.gate.bias is not None:
        specs["gate_b"] = (m.gate.bias, rows(m.gate))
        specs["up_b"] = (m.up.bias, rows(m.up))
    return specs


def rewrite_mlp(
    gm: fx.GraphModule,
    info: GraphInfo,
    m: MlpMatch,
    group: TSPGroup,
    shards: ShardInputs,
) -> MlpRewrite:
    g = gm.graph
    D, rank = group.size, group.rank
    f_local = m.intermediate // D
    per_rank = [_ring_specs(m, r, f_local) for r in range(D)]
    specs = per_rank[rank]
    nodes: dict[str, fx.Node | None] = {"gate_b": None, "up_b": None}
    numel = 0
    if D > 1:
        # every rank's slices of each parameter (a fused gate_up weight holds two per rank)
        layouts: dict[fx.Node, list[list[ShardSpec]]] = {}
        for r, pr in enumerate(per_rank):
            for pnode, spec in pr.values():
                layouts.setdefault(pnode, [[] for _ in range(D)])[r].append(spec)
        for pnode, layout in layouts.items():
            shards.declare(pnode, layout)
    with g.inserting_before(m.down):
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
        y = g.call_function(
            ring_mlp,
            (
                m.x,
                nodes["gate_w"],
                nodes["up_w"],
                nodes["down_w"],
                nodes["gate_b"],
                nodes["up_b"],
                m.act,
                rank,
                D,
                group.name,
                m.module,
            ),
        )
        y.meta["tspc_role"] = "mlp_ring"
        for key in ("recompute", "ac_graph_id", "nn_module_stack"):  # activation checkpointing
            if key in m.down.meta:
                y.meta[key] = m.down.meta[key]
        down_bias = m.down.args[2] if len(m.down.args) > 2 else m.down.kwargs.get("bias")
        out = g.call_function(torch.add, (y, down_bias)) if down_bias is not None else y
    m.down.replace_all_uses_with(out)
    upstream = m.down.all_input_nodes
    g.erase_node(m.down)
    erase_unused(g, upstream)  # the gate/up projections and the activation, now unused
    defer_recompile(gm)  # once for all layers, by the next shape propagation
    elem = tensor_val(m.down_weight).element_size()
    return MlpRewrite(
        m.module,
        steps=D,
        hops=D - 1,
        activation=m.act,
        shard_numel=numel,
        predicted_recv_bytes=(D - 1) * numel * elem,
    )
