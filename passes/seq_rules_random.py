"""Sequence-sharding rule for the keyed random ops (``passes/keyed_random.py``).

A keyed op on a sharded value stays sharded: it is told which dimension is split and the global
positions of the local entries along it (``arange`` of the global size, cut to this rank's zigzag
part — padding tokens repeat the last real position, and are dropped later anyway), so each local
element draws what it draws in the unsharded graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

import tspc.ops.keyed_random  # noqa: F401 - defines tspc::keyed_dropout, tspc::keyed_rand

from .graph_utils import arg, shape, tensor_val
from .layout import Sharded
from .seq_rules_math import rule_elementwise

if TYPE_CHECKING:
    from .seq_rule_api import SequencePropagator

# (dim, positions, global_size): the arguments after (value, seed, key, normal or p)
_DIM_ARG = 4


def rule_keyed(p: SequencePropagator, node: fx.Node):
    x = node.args[0]
    sh = p.L(x)
    if not isinstance(sh, Sharded) or isinstance(p.L(node.args[1]), Sharded):
        return False  # a sharded seed cannot be: gather (exact)
    size = shape(x)[sh.dim]  # global: rules reason in global shapes
    with node.graph.inserting_before(node):
        ar = node.graph.call_function(
            torch.arange, (size,), {"dtype": torch.int64, "device": tensor_val(x).device}
        )
    ar.meta["val"] = tensor_val(x).new_empty((size,), dtype=torch.int64)  # a fake value
    p.layout[ar] = None
    pos = p.slice(ar, 0, sh)
    args = list(node.args)
    args[_DIM_ARG : _DIM_ARG + 3] = [sh.dim, pos, size]
    node.args = tuple(args)
    p.layout[node] = sh
    return None


def rule_dropout(p: SequencePropagator, node: fx.Node):
    """A dropout left in the graph: in eval mode (or p = 0) the identity, token-wise; in
    training (not keyed: ``p`` a graph value) it draws from torch's generator, so its input is
    gathered and it runs on the whole value."""
    training = arg(node, 2, "train" if "train" in node.kwargs else "training", True)
    if training is False or arg(node, 1, "p", 0.5) in (0, 0.0):
        return rule_elementwise(p, node)
    return False


RULES = {
    "dropout dropout_": rule_dropout,
    torch.ops.tspc.keyed_dropout: rule_keyed,
    torch.ops.tspc.keyed_rand: rule_keyed,
}
