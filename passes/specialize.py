"""Turn a graph traced with symbolic sizes into a static one for concrete inputs.

Dynamo marks a dimension dynamic once it has seen two values and then traces with ``SymInt``
sizes. The TSP passes bake the local sequence length into shapes, so the backend compiles such
a graph per concrete shape: the symbolic inputs are replaced by their values, shapes are
propagated, and every node that computes a plain number (``x.size(1)``, ``s0 * 2``) is folded
into a constant. The placeholders stay, unused, so the compiled callable keeps Dynamo's
signature.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from .analyse import propagate_shapes
from .graph_utils import has_side_effects


def _is_plain_number(v: Any) -> bool:
    if isinstance(v, (bool, int, float)):
        return not (isinstance(v, float) and math.isnan(v))
    if isinstance(v, (torch.Size, tuple, list)):
        return all(isinstance(x, int) for x in v)
    return False


def specialize(gm: fx.GraphModule, args: list[Any]) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = fx.GraphModule(gm, graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph, a in zip(placeholders, args):
        if isinstance(a, (int, torch.SymInt)) and not isinstance(a, bool):
            value = int(a)
            for u in list(ph.users):
                u.args = map_arg(u.args, lambda x, p=ph, v=value: v if x is p else x)
                u.kwargs = map_arg(u.kwargs, lambda x, p=ph, v=value: v if x is p else x)
            ph.meta["val"] = value
        elif isinstance(a, torch.Tensor) and a.dim() == 0 and not isinstance(a, torch.nn.Parameter):
            # Dynamo passes a module's float/int attribute (a norm's eps) as a 0-d tensor when
            # shapes are dynamic, and reads it with .item(): the value is part of the key.
            for u in list(ph.users):
                if u.op == "call_method" and u.target == "item":
                    u.replace_all_uses_with(a.item())  # type: ignore[arg-type]
                    graph.erase_node(u)
    propagate_shapes(new, args)
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method") or has_side_effects(node):
            continue
        v = node.meta.get("val")
        if isinstance(v, torch.SymInt):
            v = int(v)
        if not _is_plain_number(v):
            continue
        value = tuple(v) if isinstance(v, (torch.Size, list)) else v
        for u in list(node.users):
            u.args = map_arg(u.args, lambda x, n=node, c=value: c if x is n else x)
            u.kwargs = map_arg(u.kwargs, lambda x, n=node, c=value: c if x is n else x)
        graph.erase_node(node)
    graph.lint()
    new.recompile()
    propagate_shapes(new, args)
    return new
