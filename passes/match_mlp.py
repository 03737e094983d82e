"""Pass 2b — match gated MLPs: ``down(act(gate(x)) * up(x))`` for the ring schedule.

Anchored on the elementwise product: one operand is an activation of a projection of ``x``, the
other a projection of the same ``x`` (either order), and the product's only consumer is a
projection back to the hidden size. Gate and up may be two linear layers or the two halves of a
fused ``gate_up`` projection (``chunk(2, -1)`` or last-dim slices). A ``linear -> activation ->
linear`` chain with no product is reported as a skipped, non-gated MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from tspc.runtime.errors import TSPConfigError
from tspc.runtime.ring_mlp import SUPPORTED_ACTIVATIONS

from .analyse import GraphInfo
from .graph_utils import arg, module_fqn_of_param, op_name, shape
from .match_attention import Projection, Skip, _param_linear, _projection_rows

_PASSTHROUGH = ("to", "type_as", "contiguous", "clone", "float", "half", "bfloat16")


@dataclass
class MlpMatch:
    module: str
    x: fx.Node
    gate: Projection
    up: Projection
    act: str
    act_node: fx.Node
    mul: fx.Node
    down: fx.Node
    down_weight: fx.Node
    down_bias: fx.Node | None
    intermediate: int


def activation_name(node: fx.Node) -> str | None:
    name = op_name(node)
    if name == "gelu":
        approx = arg(node, 1, "approximate", "none")
        name = "gelu_tanh" if approx == "tanh" else "gelu"
    return name if name in SUPPORTED_ACTIVATIONS else None


def _skip_passthrough(node: fx.Node) -> fx.Node:
    while op_name(node) in _PASSTHROUGH and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _source_linear(node: fx.Node, params) -> fx.Node | None:
    """The parameter linear a (possibly sliced) projection output comes from."""
    node = _skip_passthrough(node)
    if _param_linear(node, params):
        return node
    from .graph_utils import is_getitem

    if is_getitem(node) or op_name(node) == "narrow":
        src = node.args[0]
        if isinstance(src, fx.Node):
            if op_name(src) in ("chunk", "split", "split_with_sizes"):
                src = src.args[0]
            src = _skip_passthrough(src) if isinstance(src, fx.Node) else src
            if isinstance(src, fx.Node) and _param_linear(src, params):
                return src
    return None


def _single_consumer(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    while len(users) == 1 and op_name(users[0]) in _PASSTHROUGH:
        node = users[0]
        users = list(node.users)
    return users[0] if len(users) == 1 else None


def match_gated_mlp(
    gm: fx.GraphModule, info: GraphInfo, world: int, claimed: set[fx.Node] = frozenset()
) -> tuple[list[MlpMatch], list[Skip]]:
    """Find gated MLPs; ``claimed`` holds linear nodes already owned by matched attention."""
    params = info.params
    matches: list[MlpMatch] = []
    skips: list[Skip] = []
    used: set[fx.Node] = set(claimed)
    for node in list(gm.graph.nodes):
        if op_name(node) != "mul" or len(node.args) < 2:
            continue
        lhs, rhs = node.args[0], node.args[1]
        if not (isinstance(lhs, fx.Node) and isinstance(rhs, fx.Node)):
            continue
        for act_side, up_side in ((lhs, rhs), (rhs, lhs)):
            act_node = _skip_passthrough(act_side)
            act = activation_name(act_node)
            if act is None:
                continue
            gate_lin = _source_linear(act_node.args[0], params)
            up_lin = _source_linear(up_side, params)
            if gate_lin is None or up_lin is None or gate_lin.args[0] is not up_lin.args[0]:
                continue
            down = _single_consumer(node)
            if down is None or not _param_linear(down, params) or len(act_node.users) != 1:
                continue
            module = module_fqn_of_param(params[arg(gate_lin, 1, "weight")].fqn)
            gate = _projection_rows(gate_lin, act_node.args[0], params)
            up = _projection_rows(up_lin, up_side, params)
            if gate.key() == up.key():
                skips.append(Skip("mlp", module, "gate and up read the same rows"))
                break
            if gate.rows != up.rows:
                skips.append(Skip("mlp", module, f"gate rows {gate.rows} != up rows {up.rows}"))
                break
            inter = gate.rows
            if shape(arg(down, 1, "weight"))[1] != inter:
                skips.append(Skip("mlp", module, "down projection width != intermediate size"))
                break
            if world > inter:
                raise TSPConfigError(
                    f"{module}: D={world} ranks is more than its intermediate size {inter}; "
                    f"use a TSP group of at most {inter} ranks"
                )
            if inter % world:
                skips.append(
                    Skip("mlp", module, f"intermediate size {inter} not divisible by D={world}")
                )
                break
            if {gate_lin, up_lin, down} & used:
                break
            used |= {gate_lin, up_lin, down}
            gate.n_heads = up.n_heads = 1
            matches.append(
                MlpMatch(
                    module=module,
                    x=gate_lin.args[0],
                    gate=gate,
                    up=up,
                    act=act,
                    act_node=act_node,
                    mul=node,
                    down=down,
                    down_weight=arg(down, 1, "weight"),
                    down_bias=arg(down, 2, "bias"),
                    intermediate=inter,
                )
            )
            break
    skips += _non_gated(gm, params, used)
    return matches, skips


def _non_gated(gm: fx.GraphModule, params, used: set[fx.Node]) -> list[Skip]:
    """``linear -> activation -> linear`` chains: MLPs the ring does not run (not gated)."""
    skips = []
    for node in gm.graph.nodes:
        if not _param_linear(node, params) or node in used:
            continue
        consumer = _single_consumer(node)
        if consumer is None or op_name(consumer) not in SUPPORTED_ACTIVATIONS + ("gelu",):
            continue
        nxt = _single_consumer(consumer)
        if nxt is not None and _param_linear(nxt, params) and nxt not in used:
            module = module_fqn_of_param(params[arg(node, 1, "weight")].fqn)
            skips.append(
                Skip(
                    "mlp",
                    module,
                    f"not a gated MLP: {op_name(consumer)}(linear) feeds the next linear "
                    "directly (no elementwise product with a second projection); it runs with "
                    "replicated weights on the local tokens",
                )
            )
    return skips
