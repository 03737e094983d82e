"""Grouped-query attention as models write it: which K/V heads reach an attention call, and
where the model repeats them to the query heads' count.

Two places: right before the call (Llama's ``repeat_kv``: ``x[:, :, None].expand(...)
.reshape(...)``, or ``repeat_interleave``), which ``head_repeat_chain`` walks back over so that
the schedule drops it and gathers the fewer K/V heads; or before the last head-local ops
(torchtune's view + expand + reshape before RoPE, torchtitan's ``repeat_kv`` before the
transpose), where ``projected_kv_heads`` reads the K/V heads off the projections and the
repetition stays in the region, run by each head group on its own K/V heads.
"""

from __future__ import annotations

from typing import Protocol

import torch.fx as fx

from .graph_utils import arg, is_getitem, op_name, shape
from .held_whole import heads_fix


class Projection(Protocol):
    """What this module reads of ``match_attention.Projection``: its output feature count."""

    @property
    def rows(self) -> int: ...


class NoMatch(Exception):
    """The attention cannot run the schedule: the reason, and what the user can change."""

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(reason)
        self.fix = fix


def single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def head_repeat_chain(kv: fx.Node, heads_target: int) -> tuple[fx.Node, list[fx.Node]]:
    """Walk back over Llama-style ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``,
    or ``.flatten(1, 2)``) or ``repeat_interleave(n, dim=1)``. Returns (root before repetition, the repetition nodes)."""
    node = kv
    name = op_name(node)
    if name == "repeat_interleave" and single_user(node):
        rep = arg(node, 1, "repeats")
        dim = arg(node, 2, "dim")
        if isinstance(rep, int) and dim in (1, -3):
            return node.args[0], [node]
        return kv, []
    # torchtune's ``k.unsqueeze(2).expand(b, kv, rep, s, d).flatten(1, 2)`` merges the same dims
    flat = name == "flatten" and (arg(node, 1, "start_dim", 0), arg(node, 2, "end_dim", -1)) in (
        (1, 2),
        (1, -3),
    )
    if (name in ("reshape", "view") or flat) and single_user(node):
        exp = node.args[0]
        if isinstance(exp, fx.Node) and op_name(exp) == "expand" and single_user(exp):
            ins = exp.args[0]
            if isinstance(ins, fx.Node) and single_user(ins):
                src_shape = shape(ins)
                exp_shape = shape(exp)
                out_shape = shape(node)
                inserted = False
                if op_name(ins) == "unsqueeze" and arg(ins, 1, "dim") in (2, -3):
                    inserted = True
                elif is_getitem(ins):
                    idx = ins.args[1]
                    inserted = (
                        isinstance(idx, tuple)
                        and len(idx) >= 3
                        and idx[2] is None
                        and all(isinstance(i, slice) and i == slice(None) for i in idx[:2])
                    )
                if (
                    inserted
                    and len(src_shape) == 5
                    and src_shape[2] == 1
                    and exp_shape[:2] == src_shape[:2]
                    and exp_shape[3:] == src_shape[3:]
                    and len(out_shape) == 4
                    and out_shape[1] == exp_shape[1] * exp_shape[2] == heads_target
                ):
                    return ins.args[0], [node, exp, ins]
    return kv, []


def projected_kv_heads(kp: Projection, vp: Projection, hq: int, d: int, dv: int, world: int) -> int:
    """The KV heads the k and v projections produce when the model repeats them to ``hq``
    heads inside the region (``hq`` when they produce ``hq`` heads: no repetition)."""
    if kp.rows % d or vp.rows % dv or kp.rows // d != vp.rows // dv:
        return hq
    n = kp.rows // d
    if n >= hq or hq % n:
        return hq
    if n % world:
        raise NoMatch(
            f"{n} key/value heads repeated to {hq} before the attention's head-local ops are not "
            f"divisible by D={world} (each rank must own whole KV heads to repeat them itself)",
            heads_fix(hq, n),
        )
    return n
