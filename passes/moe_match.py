"""What the MoE matchers find (``passes/match_moe.py``, ``passes/match_moe_dense.py``) and the
rewrite replaces (``passes/rewrite_moe.py``): one MoE block's experts computation."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass
class MoeMatch:
    module: str  # the MoE block (the module holding the experts' module)
    x: fx.Node  # [N, h] hidden states
    ids: fx.Node  # [N k] expert id per pair
    weights: fx.Node  # N k router weights, pair order
    w1: fx.Node  # stacked first weight [E, ., .] (gate_up or up)
    w2: fx.Node  # stacked second weight [E, ., .] (down)
    orient: str  # "t"/"n" per weight: x @ W_e^T (stored [out, in]) or x @ W_e
    chain: list[fx.Node]  # row-wise ops from the first matmul's output to the second's input
    mm1: fx.Node
    mm2_input: fx.Node
    mm2: fx.Node
    out: fx.Node  # y: [N, h]
    region: set[fx.Node]  # the nodes the rewrite replaces (erased once unused)
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    activation: str = ""  # the chain's code, once copied out (passes/rewrite_moe.py)
    # "sorted": pairs sorted by expert, outputs scaled by ``weights`` (N k router weights);
    # "dense": every expert on every token (``match_moe_dense``): ``weights`` is the [N, E]
    # scores scaling the experts' input, ``ids`` the [N, k] top-k they were written at
    form: str = "sorted"
