"""Proof by execution of a MoE match: the block the matcher found, run on random values, equals
what its collapse onto ``moe_experts`` computes — or the block is not matched.

The grouped-matmul matcher (``passes/match_moe.py``) reads the experts' region by what its ops
do, but which node ends the region (the combined output), which tensor are the router weights
and how the pairs map to tokens are inferences. One wrong inference is a silently wrong model
with the block reported as matched: top-1 routing once made the matcher take the scaled pairs,
still in the experts' order, for the output. So before a block is collapsed, its region is
copied into a module of (hidden states, expert ids, router weights, the two stacked weights)
and run on random values (expert ids: a top-k of random scores), and compared with the
collapse's own definition evaluated densely: each pair's row through its expert
(``w2_e(chain(w1_e(x)))``), scaled by its router weight and summed per token. Permuted rows,
a missing sum or a wrong scale are O(1) errors; rounding between a grouped kernel and per-expert
matmuls is ~1e-6.

A block too large to run here (``BUDGET`` elements of stacked weights: the real-size models of
``tspc plan --measure``, on fake tensors) and a region that cannot run on CPU values (device
arguments baked into it) are not checked: ``check_collapse`` returns why, and the caller logs it.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from tspc.runtime.compat import no_fake_mode
from tspc.runtime.moe import _expert_forward, rows_by_expert

from .graph_utils import copy_region, mutated_args, shape, val

BUDGET = 1 << 24  # elements of the two stacked weights
# relative to the output's largest entry, by the operands' dtype: rounding of a grouped kernel
# against per-expert matmuls, far below the O(1) of a misread block (permuted rows, no sum)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class CollapseMismatch(Exception):
    """The block's region and its collapse disagree on random values."""


def _with_writes(region: set[fx.Node]) -> list[fx.Node]:
    """The region and the in-place writes into its tensors (the un-permutation's
    ``inv_perm[perm] = arange``, which no value flows out of), in graph order."""
    nodes = set(region)
    for n in list(region):
        for u in n.users:
            written = mutated_args(u)
            if u not in nodes and written and all(a in region for a in written):
                nodes.add(u)
    return sorted(nodes)


def _random_operands(m, gen: torch.Generator) -> list[torch.Tensor]:
    n_tok, k, experts = shape(m.x)[0], m.top_k, m.experts

    def rand(node: fx.Node, scale: float = 1.0) -> torch.Tensor:
        v = val(node)
        return (torch.randn(tuple(shape(node)), generator=gen) * scale).to(v.dtype)

    ids = torch.rand(n_tok, experts, generator=gen).topk(k, dim=1).indices
    ids = ids.reshape(tuple(shape(m.ids))).to(val(m.ids).dtype)
    weights = torch.rand(tuple(shape(m.weights)), generator=gen).to(val(m.weights).dtype)
    return [
        rand(m.x),
        ids,
        weights,
        rand(m.w1, shape(m.w1)[-1] ** -0.5),
        rand(m.w2, shape(m.w2)[-1] ** -0.5),
    ]


def _collapsed(m, chain: fx.GraphModule, x, ids, weights, w1, w2) -> torch.Tensor:
    """What ``collapse_moe`` makes of the block, densely, pair by pair."""
    flat = ids.reshape(-1).long()
    rows = x.reshape(x.shape[0], -1)[torch.arange(flat.numel()) // m.top_k]
    out = rows.new_zeros((flat.numel(), m.hidden), dtype=torch.float64)
    for e, sel in rows_by_expert(flat, m.experts):
        out[sel] = _expert_forward(chain, m.orient, rows[sel], w1[e], w2[e]).double()
    scaled = out * weights.reshape(-1, 1).double()
    return scaled.view(-1, m.top_k, m.hidden).sum(1)


def check_collapse(m, chain: fx.GraphModule) -> str | None:
    """Raise ``CollapseMismatch`` when the region of match ``m`` (grouped form) computes
    something else than its collapse; return why it was not checked, or None."""
    if math.prod(shape(m.w1)) + math.prod(shape(m.w2)) > BUDGET:
        return f"not run: stacked weights above {BUDGET} elements"
    inputs = [m.x, m.ids, m.weights, m.w1, m.w2]
    with no_fake_mode():
        try:
            module = copy_region(_with_writes(m.region | {m.out}), inputs, m.out)
            operands = _random_operands(m, torch.Generator().manual_seed(0))
            got = module(*operands).double()
        except Exception as e:  # noqa: BLE001 - a region that cannot run here is not checked
            return f"not run: {type(e).__name__}: {e}"
        want = _collapsed(m, chain, *operands)
    if got.shape != want.shape:
        raise CollapseMismatch(
            f"the block's output is {list(got.shape)}, its collapse's {list(want.shape)}"
        )
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= TOLERANCE.get(val(m.w1).dtype, 5e-2):
        raise CollapseMismatch(
            f"on random inputs the block and its collapse onto the expert-parallel op differ "
            f"by {err:.2g} (relative): the matcher misread the block"
        )
    return None
