"""Activation recomputation of whole transformer blocks (or their attention) inside the TSP schedules.

``options={"recompute": "full"}`` makes the backward recompute every transformer block from its
input, as activation checkpointing of each block would, on an unmodified model: the only value
of a block the forward keeps for the backward is the block's input (the residual stream entering
it, this rank's tokens only). In the backward each block's forward is replayed just before the
block's own backward: its weights are re-streamed (the attention's per-head-group broadcasts and
the MLP ring's hops run again), its K/V re-gathered, and the intermediates rebuilt.

An MLP ring inside a recomputed region saves no projection for the backward
(``ring_mlp(..., save_projections=False)``, ``recompute_ring_projections``): its backward ring
rebuilds each shard's up projections from the weights it receives anyway, so nothing of the
forward ring is needed and the backward does not replay it. Replayed, the forward ring's received
shards would stay alive beside the backward ring's (each until the backward step that rebuilds
its projections, which comes in the reverse order), and its D - 1 hops would be sent again.

``"selective"`` recomputes only the attention sub-block of each layer (projections, RoPE, the K/V
gathers, the weight broadcasts and the attention kernel: everything whose size grows with the
number of head groups streamed, and whose recompute costs one set of attention GEMMs), while the
MLP and the norms keep what aot_autograd's min-cut partitioner saves (their GEMM outputs).

How: this pass tags the graph's nodes the way ``torch.utils.checkpoint`` tags a checkpointed
region for torch's partitioner — ``node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE`` and
one ``node.meta["ac_graph_id"]`` per block. aot_autograd copies both tags onto every ATen node it
traces from a tagged node (custom ops and the MLP ring's autograd.Function included), and its
min-cut partitioner then recomputes the tagged nodes in the backward and saves a block's output
where the next block (a larger ``ac_graph_id``) reads it (``cleanup_recompute_tags``); its
``reordering_to_mimic_autograd_engine`` replays each block's forward right before that block's
backward, so one block's intermediates are alive at a time. The collectives of the replayed
forward are the same nodes on every rank (no pass reads rank-local state), so every rank issues
them in the same order.

Blocks are found from the graph, not from names: each matched attention (and MLP) module's
parent module in ``nn_module_stack`` is its block (``model.layers.3`` for
``model.layers.3.self_attn``); a module matched at the top level is its own block. Nodes the
rewrites created (broadcasts, gathers, per-head-group compute) carry no module stack; each joins
the block all of its users belong to.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from tspc.runtime.ring_mlp import ring_mlp

from .graph_utils import fqn_from_source

POLICIES = ("none", "selective", "full")


def _stack_fqns(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, _type in stack.values():
        out.append(fqn_from_source(path) if path.startswith("L[") else path)
    return out


def block_of_module(module: str) -> str:
    """``model.layers.3.self_attn`` -> ``model.layers.3`` (a top-level module: itself)."""
    return module.rsplit(".", 1)[0] if "." in module else module


def assign_regions(gm: fx.GraphModule, regions: list[str]) -> dict[fx.Node, int]:
    """Each call node of ``gm`` that belongs to one of ``regions`` (module FQNs), by index.

    A node belongs to a region when the region's module is on its ``nn_module_stack``; a node
    without a stack (made by a pass) belongs to the region of all its users, when they agree.
    """
    wanted = {fqn: i for i, fqn in enumerate(regions)}
    region: dict[fx.Node, int] = {}
    unknown = []
    for n in gm.graph.nodes:
        if n.op != "call_function" and n.op != "call_method":
            continue
        stack = _stack_fqns(n)
        if not stack:
            unknown.append(n)
            continue
        for fqn in reversed(stack):  # the innermost wanted module
            if fqn in wanted:
                region[n] = wanted[fqn]
                break
    for n in reversed(unknown):  # users come later in graph order: one reverse sweep
        owners = {region.get(u) for u in n.users}
        if len(owners) == 1 and None not in owners:
            region[n] = owners.pop()
    return region


def tag_recompute(
    gm: fx.GraphModule, attention_modules: list[str], mlp_modules: list[str], policy: str
) -> list[str]:
    """Tag the nodes of each block (``full``) or attention (``selective``) MUST_RECOMPUTE with one
    ``ac_graph_id`` per region, numbered in graph order from 1. Returns the regions tagged."""
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r} is not one of {list(POLICIES)}")
    if policy == "none":
        return []
    if policy == "full":
        modules = attention_modules + mlp_modules
        names = [block_of_module(m) for m in modules]
    else:
        names = list(attention_modules)
    names = list(dict.fromkeys(names))
    if not names:
        return []
    region = assign_regions(gm, names)
    first: dict[int, int] = {}
    for pos, n in enumerate(gm.graph.nodes):
        if n in region:
            first.setdefault(region[n], pos)
    order = sorted(first, key=first.get)
    ids = {r: i + 1 for i, r in enumerate(order)}
    for n, r in region.items():
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        n.meta["ac_graph_id"] = ids[r]
    return [names[r] for r in order]


def extend_checkpoint_regions(gm: fx.GraphModule) -> int:
    """Nodes a rewrite made inside a user's ``torch.utils.checkpoint`` region (which
    ``inline_checkpoints`` tagged) join that region: same policy, same ``ac_graph_id``.

    Without this a weight broadcast feeding a checkpointed projection would sit outside the
    region and be saved at the region's boundary (the partitioner saves a region's inputs).
    """
    joined = 0
    for n in reversed(list(gm.graph.nodes)):
        if n.op not in ("call_function", "call_method") or "ac_graph_id" in n.meta:
            continue
        if n.meta.get("nn_module_stack"):
            continue
        ids = {u.meta.get("ac_graph_id") for u in n.users}
        if len(ids) == 1 and None not in ids:
            (user,) = [u for u in n.users][:1]
            n.meta["recompute"] = user.meta.get("recompute", CheckpointPolicy.PREFER_RECOMPUTE)
            n.meta["ac_graph_id"] = ids.pop()
            joined += 1
    return joined


_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def recompute_ring_projections(gm: fx.GraphModule) -> int:
    """Each MLP ring call in a recomputed region (tagged here or by a user's checkpoint) saves
    no projection: its backward rebuilds them from the shards its ring receives (module doc).
    Returns the number of rings changed."""
    changed = 0
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and n.target is ring_mlp
            and n.meta.get("recompute") in _RECOMPUTED
            and n.kwargs.get("save_projections", True)
        ):
            n.kwargs = {**n.kwargs, "save_projections": False}
            changed += 1
    return changed
