"""What a node is to the overlap schedule (``passes/schedule.py``): a free view or a cheap
packing copy (moves with a transfer), heavy compute (what transfers hide behind), or pinned
(never moved: graph inputs and outputs, collectives, side effects, random draws, in-place
writes and the reads of written values)."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from tspc.runtime.comm import is_transfer, is_transfer_start, is_transfer_wait
from tspc.runtime.compat import OpOverload, op_base_name
from tspc.runtime.packing import pack

from .graph_utils import calls_one_of, is_view, mutated_args

# Cheap copies that pack or lay out parameters (their inputs are all graph inputs).
_PACK_ATEN = {
    torch.ops.aten.cat.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten._to_copy.default,
}
_PACK_FUNCTIONS = {torch.cat, torch.clone, pack}  # pack: tspc.runtime.packing.pack
_PACK_METHODS = frozenset({"contiguous", "clone", "to", "float", "half", "bfloat16"})

_HEAVY_ATEN = re.compile(
    r"^(mm|addmm|bmm|baddbmm|matmul|linear|convolution\w*|_?scaled_dot_product\w*|\w*attention\w*)$"
)
_HEAVY_FUNCTIONS = frozenset(
    {
        "linear",
        "matmul",
        "mm",
        "bmm",
        "scaled_dot_product_attention",
        "causal_attention",
        "masked_attention",
        "sdpa_local_queries",
        "ring_mlp",
        "conv1d",
        "conv2d",
    }
)
_HEAVY_METHODS = frozenset({"matmul", "__matmul__", "mm", "bmm"})


_is_start = is_transfer_start
_is_wait = is_transfer_wait
_is_view = is_view


def _is_pack(n: fx.Node) -> bool:
    return calls_one_of(n, _PACK_METHODS, _PACK_FUNCTIONS, _PACK_ATEN.__contains__)


def is_view_or_pack(n: fx.Node) -> bool:
    """Free views and cheap packing copies: what moves with a transfer (and, in
    ``tspc/inner.py``, what the backward recomputes around one rather than saves)."""
    return _is_view(n) or _is_pack(n)


def is_heavy(n: fx.Node) -> bool:
    """GEMMs and attention kernels: the compute that transfers hide behind."""
    if n.op == "call_method":
        return n.target in _HEAVY_METHODS
    if n.op != "call_function" or is_transfer(n):
        return False
    t = n.target
    if isinstance(t, OpOverload):
        return bool(_HEAVY_ATEN.match(op_base_name(t)))
    return getattr(t, "__name__", "") in _HEAVY_FUNCTIONS


def pin_mutation_order(graph: fx.Graph) -> int:
    """Pin (``meta["tspc_pinned"]``) every in-place write and every node that reads the written
    value or any view of it. Their order is a dependency that no graph edge carries
    (``inv[perm] = arange(n)`` then ``out[inv]``: the read has no edge to the write), so a node
    moved across the write would see the value before or after it. Returns how many nodes
    were pinned. Conservative: every view chain counts as one value."""
    root: dict[fx.Node, fx.Node] = {}

    def find(x: fx.Node) -> fx.Node:
        while root.get(x, x) is not x:
            x = root[x]
        return x

    for n in graph.nodes:
        if _is_view(n) and n.args and isinstance(n.args[0], fx.Node):
            root[find(n)] = find(n.args[0])
    written = {find(m) for n in graph.nodes for m in mutated_args(n)}
    if not written:
        return 0
    pinned = 0
    for n in graph.nodes:
        if (
            mutated_args(n)
            or find(n) in written
            or any(find(i) in written for i in n.all_input_nodes)
        ):
            n.meta["tspc_pinned"] = True
            pinned += 1
    return pinned


def is_pinned(n: fx.Node) -> bool:
    """Nodes this pass never moves: graph inputs and outputs, collectives (moved only as
    starts and waits), side effects, random number generation, and the in-place writes and
    reads of written values (``pin_mutation_order``)."""
    if n.op in ("placeholder", "output", "root"):
        return True
    if n.meta.get("tspc_pinned"):
        return True
    if n.op == "get_attr":
        return False
    if _is_start(n) or _is_wait(n):
        return True
    if getattr(n.target, "_nondeterministic_seeded", False):
        return True
    try:
        return n.is_impure()
    except Exception:  # noqa: BLE001 - an op fx cannot classify: leave it where it is
        return True


# Calls that switch a mode every later node runs under (Dynamo keeps ``with torch.no_grad()``
# and ``autocast`` blocks as such calls in the graph): a node moved across one runs under the
# other mode, e.g. a softmax hoisted out of an ``enable_grad`` block into the ``no_grad`` one
# before it computes the same values but records no gradient.
_MODE_SWITCHES = frozenset(
    {"_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast"}
)


def is_mode_switch(n: fx.Node) -> bool:
    """A grad-mode or autocast switch (pinned, and nothing may move across it)."""
    return n.op == "call_function" and getattr(n.target, "__name__", "") in _MODE_SWITCHES


def mode_regions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Node -> the index of the stretch between mode switches it runs in (a switch opens the
    stretch after it)."""
    region, out = 0, {}
    for n in graph.nodes:
        if is_mode_switch(n):
            region += 1
        out[n] = region
    return out
