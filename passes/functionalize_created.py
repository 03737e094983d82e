"""Pass 1a — in-place writes to tensors the graph itself builds, written out of place.

A model may build a value in place: ``mask = torch.zeros(S, S); mask.masked_fill_(upper,
-inf)`` or ``torch.full((S, S), -inf).triu_(1)``. Dynamo's graph then hands the attention the
*factory* node (``zeros``), whose value the in-place call changes later in the graph. The
passes read a node's value as what it computes, so they would read a mask of zeros: the mask
classifier (no mask at all) and the sequence pass (each rank's rows cut from the unwritten
tensor) — a silent wrong answer, 0.24-0.27 relative error at D = 2 before this pass.

An in-place tensor method (``x.masked_fill_(...)``, ``x.triu_(1)``, ``x.add_(y)``) on a tensor
the graph created fresh (a factory such as ``zeros`` / ``full`` / ``*_like``, or ``clone``)
becomes its out-of-place twin, and every later reader of ``x`` reads the new value — the same
values, now in a form every pass reads. Only when nothing reads ``x`` before the write (else
an earlier reader, or a view of the old value, would see the write under torch's aliasing
but not here). Other in-place writes (``x[i] = v``, a write to a view, to an input) are left
as they are; ``docs/guarantees.md`` says what that means for a mask.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import op_name

# calls that return a new tensor no other value aliases
_FRESH = {
    "zeros",
    "ones",
    "full",
    "empty",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "clone",
    "arange",
    "eye",
}


def _fresh(x: object) -> bool:
    return (
        isinstance(x, fx.Node) and x.op in ("call_function", "call_method") and op_name(x) in _FRESH
    )


def _out_of_place(name: str) -> str | None:
    """``masked_fill`` for ``masked_fill_``: a tensor method with an out-of-place twin."""
    if not name.endswith("_") or name.startswith("_"):
        return None
    twin = name[:-1]
    if hasattr(torch.Tensor, name) and hasattr(torch.Tensor, twin):
        return twin
    return None


def functionalize_created_tensors(gm: fx.GraphModule) -> list[str]:
    """Rewrite in-place methods on fresh in-graph tensors out of place; the names of the
    rewritten calls."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    done = []
    created: set[fx.Node] = set()  # the twins: fresh too (``m.masked_fill_(a).masked_fill_(b)``)
    for node in list(g.nodes):
        if node.op != "call_method":
            continue
        twin = _out_of_place(node.target)
        x = node.args[0] if node.args else None
        if twin is None or not (_fresh(x) or x in created):
            continue
        readers = [u for u in x.users if u is not node]
        if any(order[u] < order[node] for u in readers):
            continue  # something read (or viewed) the value before the write
        with g.inserting_before(node):
            new = g.call_method(twin, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        for u in readers:
            u.replace_input_with(x, new)
        order[new] = order[node]
        created.add(new)
        done.append(f"{node.target} on {x.name}")
        g.erase_node(node)
    if done:
        gm.recompile()
    return done
