"""Pass 0 — inline activation-checkpoint regions, keeping their recompute intent.

A model that asks for activation checkpointing (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing_enable()``) reaches the backend as a ``tag_activation_checkpoint``
higher-order op whose body is a separate graph — where the matchers cannot see its attention
and MLP. This pass copies each body into the main graph and tags the copied nodes
``PREFER_RECOMPUTE`` with one ``ac_graph_id`` per region: exactly what aot_autograd itself does
with such a region, so its partitioner still recomputes them in backward instead of saving
their activations.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

_HOP = torch.ops.higher_order.tag_activation_checkpoint


def inline_checkpoints(gm: fx.GraphModule) -> int:
    g = gm.graph
    regions = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not _HOP:
            continue
        body_attr, *operands = node.args
        body: fx.GraphModule = getattr(gm, body_attr.target)
        regions += 1
        env: dict[fx.Node, object] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(placeholders, operands):
            env[ph] = value
        outputs = None
        with g.inserting_before(node):
            for n in body.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outputs = fx.node.map_arg(n.args[0], lambda a, e=env: e[a])
                    continue
                if n.op == "get_attr":
                    raise NotImplementedError("checkpoint body reads module attributes")
                new = g.node_copy(n, lambda a, e=env: e[a])
                new.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                new.meta["ac_graph_id"] = regions
                env[n] = new
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                g.erase_node(user)
            else:
                raise NotImplementedError("checkpoint output used without indexing")
        g.erase_node(node)
        if not body_attr.users:
            g.erase_node(body_attr)
    if regions:
        g.lint()
        gm.recompile()
    return regions
