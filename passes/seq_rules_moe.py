"""Sequence rules of mixture-of-experts routing (the walk's table, ``shard_sequence.py``).

* ``topk`` along a dim that is not the tokens' (each token's best experts) is token-wise: its
  values and indices keep the tokens split.
* ``moe_experts`` (``runtime/moe.py``) computes each (token, choice) pair's expert output from
  that token's row alone (the all-to-all inside moves rows between ranks, not across tokens):
  its ``[N k, h]`` output is split like its ``[N k]`` expert ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

import tspc.runtime.moe  # noqa: F401 - registers tspc::moe_experts

from .graph_utils import arg
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


def rule_moe_experts(p: SequencePropagator, node: fx.Node):
    x, ids = p.L(node.args[0]), p.L(node.args[1])
    if not (isinstance(x, Sharded) and isinstance(ids, Sharded) and x.dim == 0 == ids.dim):
        return False
    p.layout[node] = ids
    return None


RULES = {"topk": rule_topk, torch.ops.tspc.moe_experts: rule_moe_experts}
