"""Sequence rules of mixture-of-experts routing (the walk's table, ``shard_sequence.py``).

* ``topk`` along a dim that is not the tokens' (each token's best experts) is token-wise: its
  values and indices keep the tokens split.
* ``gather`` / ``take_along_dim`` and the ``scatter`` family along a dim that is not the
  tokens' (a token's scores at its chosen experts, or written there) are token-wise when the
  input, the index and the source are all split alike along the tokens.
* ``moe_experts`` (``runtime/moe.py``) computes each (token, choice) pair's expert output from
  that token's row alone (the all-to-all inside moves rows between ranks, not across tokens):
  its ``[N k, h]`` output is split like its ``[N k]`` expert ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

import tspc.runtime.moe  # noqa: F401 - registers tspc::moe_experts

from .graph_utils import arg, shape
from .layout import Sharded
from .seq_rules_shape import tokens_kept

if TYPE_CHECKING:
    from .seq_rule_api import SequencePropagator


def rule_topk(p: SequencePropagator, node: fx.Node):
    sh = tokens_kept(p, node, arg(node, 2, "dim", -1))
    if sh is None:
        return False
    p.layout[node] = (sh, sh)
    return None


def rule_indexed_along(p: SequencePropagator, node: fx.Node):
    """``gather(x, dim, index)`` / ``scatter(x, dim, index, src)`` and their in-place and
    ``_add``/``_reduce`` forms, along a dim that is not the tokens'."""
    dim = arg(node, 1, "dim")
    operands = [
        a for a in (node.args[0], arg(node, 2, "index"), arg(node, 3, "src")) if a is not None
    ]
    tensors = [a for a in operands if isinstance(a, fx.Node)]
    layouts = [p.L(a) for a in tensors]
    first = layouts[0] if layouts else None
    if (
        not isinstance(dim, int)
        or not isinstance(first, Sharded)
        or any(sh != first for sh in layouts)
        or any(len(shape(t)) != len(shape(tensors[0])) for t in tensors)
        or dim % len(shape(tensors[0])) == first.dim
    ):
        return False
    p.layout[node] = first
    return None


def rule_moe_experts(p: SequencePropagator, node: fx.Node):
    x, ids = p.L(node.args[0]), p.L(node.args[1])
    if not (isinstance(x, Sharded) and isinstance(ids, Sharded) and x.dim == 0 == ids.dim):
        return False
    p.layout[node] = ids
    return None


RULES = {
    "topk": rule_topk,
    "gather scatter scatter_ scatter_add scatter_add_ scatter_reduce "
    "scatter_reduce_": rule_indexed_along,
    torch.ops.tspc.moe_experts: rule_moe_experts,
}
