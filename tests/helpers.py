"""Helpers for tests: capture Dynamo's graph, count tspc collectives, compare with one process."""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx


def capture(model, *inputs, **kwargs):
    """Dynamo's graph and example inputs for ``model(*inputs)`` (the graph a backend gets)."""
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*inputs, **kwargs)
    return captured["gm"], captured["inputs"]


def count_collectives(gm: fx.GraphModule) -> Counter:
    """{(op name, tag): count} for every tspc op in a graph."""
    c: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "tspc":
            name = n.target._opname
            tag = n.args[-1] if isinstance(n.args[-1], str) else ""
            c[(name, tag)] += 1
    return c


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
