"""Which tspc pass put a partitioner tag on a joint-graph node, and what option avoids it.

tspc steers aot_autograd's min-cut partitioner with tags on the joint graph: ``recompute``
(``CheckpointPolicy.MUST_RECOMPUTE``: rebuild in the backward, never save) and
``partitioner_tag = "must_be_in_backward"``. When the partitioner cannot honour one (a value it
may neither save nor recompute), torch's error blames PyTorch ("This is a bug in PyTorch"); the
tag is tspc's, so the backend re-raises it as tspc's error naming the node, the pass and the
option (``tspc/inner.py``'s ``tsp_partition``). This module reads the tags; it changes nothing.

The passes over the joint graph (``passes/aot_graphs.py``) name themselves in the node's
``tspc_tagged_by``; tags set on Dynamo's graph reach aot's nodes only as ``recompute`` and
``ac_graph_id`` (what aot copies), and are told apart by those: ``MUST_RECOMPUTE`` with a region
id of 1 or more is ``passes/recompute.py``'s block recomputation, ``PREFER_RECOMPUTE`` a
``torch.utils.checkpoint`` region of the model that ``passes/inline_checkpoint.py`` inlined.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .aot_graphs import TAGGED_BY


@dataclass(frozen=True)
class TagOrigin:
    node: str
    tag: str  # what the partitioner was told, in its words
    tagged_by: str  # the tspc pass and its file
    option: str  # what a user can change to avoid the tag


_NO_TRANSFERS = (
    "options={'schedules': 'none'} (no transfers to tag: weights and activations replicated)"
)
_JOINT_PASSES = {
    "mark_transfers_for_recompute": (
        "MUST_RECOMPUTE (a weight transfer, K/V or sequence gather, or a view or pack around "
        "one, rebuilt in the backward rather than saved)",
        _NO_TRANSFERS,
    ),
    "keep_backward_transfers_in_backward": (
        "must_be_in_backward (a transfer the backward issues)",
        _NO_TRANSFERS,
    ),
    "split_recomputed_transfers": (
        "must_be_in_backward (the backward's own copy of a recomputed transfer)",
        "options={'recompute': 'none'}",
    ),
}


def tag_origin(node: fx.Node) -> TagOrigin | None:
    """Where ``node``'s partitioner tag came from, or None when it carries no tspc tag."""
    by = node.meta.get(TAGGED_BY)
    if by in _JOINT_PASSES:
        tag, option = _JOINT_PASSES[by]
        return TagOrigin(node.name, tag, f"{by} (passes/aot_graphs.py)", option)
    policy = node.meta.get("recompute")
    if policy == CheckpointPolicy.MUST_RECOMPUTE and node.meta.get("ac_graph_id", 0) >= 1:
        return TagOrigin(
            node.name,
            "MUST_RECOMPUTE (part of a transformer block recomputed in the backward)",
            "tag_recompute (passes/recompute.py)",
            "options={'recompute': 'none'}",
        )
    if policy == CheckpointPolicy.PREFER_RECOMPUTE:
        return TagOrigin(
            node.name,
            "PREFER_RECOMPUTE (inside a torch.utils.checkpoint region of the model)",
            "inline_checkpoints (passes/inline_checkpoint.py)",
            "removing the model's activation checkpointing",
        )
    return None


_CONFLICT = re.compile(r"Nodes involved in the conflict:(.*?)(?:\n\s*\n|\Z)", re.S)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tags_in_error(graph: fx.Graph, message: str) -> list[TagOrigin]:
    """The tspc-tagged nodes a partitioner error names (in its "Nodes involved in the
    conflict" part when it has one), in graph order."""
    section = _CONFLICT.search(message)
    words = set(_NAME.findall(section.group(1) if section else message))
    out = []
    for n in graph.nodes:
        if n.name in words:
            origin = tag_origin(n)
            if origin is not None:
                out.append(origin)
    return out


def torch_words(message: str) -> str:
    """The partitioner's message without its lines that send the reader to PyTorch's tracker
    (the tag it could not honour is tspc's)."""
    drop = ("bug in PyTorch", "file an issue", "For PyTorch developers", "one of the above")
    return "\n".join(line for line in message.splitlines() if not any(d in line for d in drop))
