"""Passes over the graphs aot_autograd makes from the rewritten graph (``tspc/inner.py`` runs
them through the phases of ``tspc/pipeline.py``).

* On the joint forward-backward graph, before the min-cut partitioner: which transfers the
  backward recomputes rather than saves (``mark_transfers_for_recompute``), which stay in the
  backward (``keep_backward_transfers_in_backward``), and, under block recomputation, a copy of
  each recomputed transfer for the backward (``split_recomputed_transfers``).
* On Inductor's post-grad graph: ``split_addmm_across_waits`` keeps a GEMM before the wait it
  was scheduled to overlap.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from tspc.ops.keyed_random import SEED_TAG
from tspc.runtime.comm import is_transfer_wait

from .schedule import is_view_or_pack

_RECOMPUTE_STARTS = (
    torch.ops.tspc.broadcast_start.default,
    torch.ops.tspc.all_gather_start.default,
    torch.ops.tspc.ring_start.default,
    torch.ops.tspc.ring_chunk_start.default,
)


def _is_recomputed_start(n: fx.Node) -> bool:
    """A weight broadcast, K/V gather or ring hop — not the broadcast of the random ops' seed
    (``passes/keyed_random.py``): its 16 bytes are saved, not sent again in backward."""
    return n.target in _RECOMPUTE_STARTS and n.args[-1] != SEED_TAG


def _is_recomputed_wait(n: fx.Node) -> bool:
    """The wait of a weight broadcast, K/V gather or ring hop (in a traced graph, the
    ``wait_tensor`` of such a start)."""
    return is_transfer_wait(n) and _is_recomputed_start(n.args[0])


TAGGED_BY = "tspc_tagged_by"
"""The meta key naming the tspc pass that tagged a joint-graph node for the partitioner (read
by ``passes/tag_origin.py`` when the partitioner cannot honour a tag)."""


def _mark(n: fx.Node) -> None:
    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    n.meta.setdefault("ac_graph_id", 0)
    n.meta[TAGGED_BY] = "mark_transfers_for_recompute"


def _free_to_recompute(n: fx.Node) -> bool:
    """A view or pack the backward can rebuild from a tensor the partitioner may save.

    ``getitem`` counts as a view, but of a multi-output op's result it reads a tuple, which the
    partitioner cannot save: marking it MUST_RECOMPUTE forces the op itself to be recomputed,
    which the partitioner refuses for ops outside its recompute allowlist ("getitem_30: must
    recompute: marked by checkpoint policy" on ``native_layer_norm``'s output, when BART's
    encoder output feeds the output gather). Such a getitem is free only when its producer
    is itself recomputed (the split of a received weight pack)."""
    if not is_view_or_pack(n):
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.meta.get("recompute") == (
            CheckpointPolicy.MUST_RECOMPUTE
        )
    return True


def mark_transfers_for_recompute(graph: fx.Graph) -> int:
    """Tag weight transfers and K/V gathers (and the views/packs around them) MUST_RECOMPUTE.

    Without this the min-cut partitioner would save what they produce for the backward — every
    head group's weights and gathered K/V, the whole layer — or, for transfers that the backward
    issues but that do not depend on a gradient (the MLP ring's backward weight hops), would
    hoist them into the forward and save their results. Recomputing keeps both in the backward.
    """
    marked = 0
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if _is_recomputed_start(n):
            _mark(n)
            marked += 1
            # the packed weights the broadcast sends: a cheap cat of local shards
            src = n.args[0]
            if isinstance(src, fx.Node) and _free_to_recompute(src):
                for i in src.all_input_nodes:  # inputs first: a getitem's producer decides it
                    if _free_to_recompute(i):
                        _mark(i)
                _mark(src)
        elif _is_recomputed_wait(n):
            _mark(n)
            stack = list(n.users)
            while stack:
                u = stack.pop()
                if "recompute" not in u.meta and _free_to_recompute(u):
                    _mark(u)
                    stack.extend(u.users)
    return marked


def keep_backward_transfers_in_backward(graph: fx.Graph) -> int:
    """Pin collectives traced in backward to the backward graph.

    The partitioner may move a backward node that does not depend on a gradient into the
    forward and save its result — for the MLP ring's backward weight hops that would mean
    fetching every shard in the forward and keeping them all. ``must_be_in_backward`` forbids it.
    """
    pinned = 0
    for n in graph.nodes:
        if (
            n.op == "call_function"
            and (getattr(n.target, "namespace", None) == "tspc" or is_transfer_wait(n))
            and n.meta.get("partitioner_tag") == "is_backward"
        ):
            n.meta["partitioner_tag"] = "must_be_in_backward"
            n.meta[TAGGED_BY] = "keep_backward_transfers_in_backward"
            pinned += 1
    return pinned


_SPLIT_STARTS = (torch.ops.tspc.broadcast_start.default, torch.ops.tspc.all_gather_start.default)


def _in_backward(n: fx.Node) -> bool:
    return n.meta.get("partitioner_tag") in ("is_backward", "must_be_in_backward")


def split_recomputed_transfers(graph: fx.Graph) -> int:
    """Give the backward its own copy of each recomputed weight broadcast and K/V gather whose
    result both a recomputed forward node and a backward node read.

    Under block recomputation (``options={"recompute": ...}``) the backward replays a block's
    forward — which needs head group r's weights and gathered K/V — and then runs the block's
    backward, which needs them again. As one node the transfer would be recomputed once and its
    result kept from the replayed forward to the backward of group r: every head group's
    weights and full-sequence K/V alive at once (a whole layer's, 8x the one group the schedule
    keeps at D = 8). With a copy for the backward users, the replay's transfer dies after the
    replayed group and the backward fetches the group again just before it needs it (one more
    broadcast and K/V gather per group in the backward: the paper's "weights re-streamed, K/V
    re-gathered"). The pack a broadcast sends is copied with it. Every rank builds the same
    graph, so every rank issues the copies in the same order. Returns the number of transfers
    copied.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    copied = 0
    for start in [n for n in graph.nodes if n.op == "call_function" and n.target in _SPLIT_STARTS]:
        if _in_backward(start) or start.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        chain, seen, stack = [start], {start}, list(start.users)
        while stack:  # the wait and the free views/packs after it (what moves with a transfer)
            u = stack.pop()
            if u in seen or _in_backward(u) or u.op != "call_function":
                continue
            if _is_recomputed_wait(u) or (
                is_view_or_pack(u) and u.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
            ):
                seen.add(u)
                chain.append(u)
                stack.extend(u.users)
        readers = [u for c in chain for u in c.users if u not in seen]
        backward = [u for u in readers if _in_backward(u)]
        if not backward or len(backward) == len(readers):
            continue
        # The packed weights a broadcast sends (a cat of views of the shards): copied too, or
        # the one pack would be kept from the replay's start to the backward's.
        stack = [a for a in start.all_input_nodes]
        while stack:
            a = stack.pop()
            if (
                a not in seen
                and a.op == "call_function"
                and not _in_backward(a)
                and is_view_or_pack(a)
                and a.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
            ):
                seen.add(a)
                chain.append(a)
                stack.extend(a.all_input_nodes)
        chain.sort(key=order.__getitem__)
        env: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(min(backward, key=order.__getitem__)):
            for c in chain:
                env[c] = graph.node_copy(c, lambda a, env=env: env.get(a, a))
                # a backward node: the forward graph must not run it (its users are backward)
                env[c].meta["partitioner_tag"] = "must_be_in_backward"
                env[c].meta[TAGGED_BY] = "split_recomputed_transfers"
        for u in dict.fromkeys(backward):
            u.args = fx.node.map_arg(u.args, lambda a, env=env: env.get(a, a))
            u.kwargs = fx.node.map_arg(u.kwargs, lambda a, env=env: env.get(a, a))
        copied += 1
    return copied


def split_addmm_across_waits(graph: fx.Graph) -> int:
    """Undo Inductor's ``mm`` + ``add`` -> ``addmm`` fusion where a wait lies between them.

    The schedule overlaps a GEMM with a transfer by placing it before the transfer's wait; when
    its result is accumulated only after the wait (the MLP ring's backward adds a weight
    gradient GEMM to the next step's), Inductor's post-grad pattern fuses the two into one
    ``addmm`` at the add's place, after the wait, and the GEMM no longer overlaps anything. Here
    such an ``addmm`` becomes the GEMM again, just before the latest wait after its operands
    are ready, and the add where it was. Returns the number split."""
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(graph.nodes)}
    waits = [n for n in graph.nodes if is_transfer_wait(n)]
    split = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.addmm.default or n.kwargs:
            continue
        inp, mat1, mat2 = n.args[:3]
        ready = max(
            (x for x in (mat1, mat2) if isinstance(x, fx.Node)),
            key=order.__getitem__,
            default=None,
        )
        if ready is None:
            continue
        between = [w for w in waits if order[ready] < order[w] < order[n]]
        if not between:
            continue
        with graph.inserting_before(between[-1]):
            gemm = graph.call_function(aten.mm.default, (mat1, mat2))
        gemm.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        if "val" in n.meta:
            gemm.meta["val"] = torch.empty_like(n.meta["val"])  # addmm's shape, dtype, device
        with graph.inserting_before(n):
            add = graph.call_function(aten.add.Tensor, (inp, gemm))
        add.meta.update(n.meta)
        n.replace_all_uses_with(add)
        graph.erase_node(n)
        split += 1
    return split
