"""This rank's weight shards as extra graph inputs.

A compiled graph must stay a pure function of its inputs: Dynamo reuses it for every call whose
guards match — also for *another module* with the same code (each layer of a model whose blocks
are compiled on their own, or traced separately after a graph break). So the rewritten graph
does not hold shards as constants; it reads each shard from a new placeholder, and the runtime
(``tspc/backend.py``) fills those inputs on every call from the parameters actually passed: views
of this rank's local part of the module's DTensor parameter (``runtime/tsp_params.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from tspc.runtime.group import TSPGroup
from tspc.runtime.shard_store import STORE, Layout, ShardSpec, ShardStore

from .analyse import GraphInfo


@dataclass
class ShardInput:
    param_index: int  # position of the full parameter among the graph's original inputs
    spec: ShardSpec
    node: fx.Node  # the placeholder the rewritten graph reads the shard from
    example: torch.Tensor | None  # the shard of this compile's example parameter (while compiling)


class ShardInputs:
    """The shard inputs the rewrites ask for. Layouts are declared in ``store`` (the runtime's
    process-wide ``STORE`` when compiling; a test may pass its own ``ShardStore``), which is
    where the runtime finds every rank's slices of a parameter when it runs the graph."""

    def __init__(
        self, gm: fx.GraphModule, info: GraphInfo, group: TSPGroup, store: ShardStore = STORE
    ):
        self.store = store
        self.gm = gm
        self.info = info
        self.group = group
        self.items: list[ShardInput] = []
        self._index = {inp.node: i for i, inp in enumerate(info.inputs)}
        self._cache: dict[tuple, fx.Node] = {}

    def declare(self, param: fx.Node, layout: Layout) -> None:
        """The full parameter is sharded over the group: ``layout`` lists every rank's slices
        (this rank may hold none). Every rank declares the same layout, so every rank gives the
        module the same DTensor placement."""
        g = self.group
        self.store.declare(
            self.info.inputs[self._index[param]].example, layout, g.name, g.rank, g.size
        )

    def get(self, param: fx.Node, spec: ShardSpec, name: str) -> fx.Node:
        """The placeholder holding this rank's ``spec`` shard of the parameter ``param``."""
        key = (param, spec)
        if key in self._cache:
            return self._cache[key]
        full = self.info.inputs[self._index[param]].example
        shard = self.store.example_shard(full, spec)
        graph = self.gm.graph
        # After the last placeholder: the runtime passes the shards after the original inputs,
        # and another pass may already have put a node between two placeholders (the sequence
        # pass cuts an input's local rows right after it), so "before the first other node"
        # could land among the original inputs and misalign every later one.
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            node = graph.placeholder(name)
        node.meta["tspc_shard_of"] = param.name  # its value is set by the next propagation
        self.items.append(ShardInput(self._index[param], spec, node, shard))
        self._cache[key] = node
        return node

    @property
    def examples(self) -> list[torch.Tensor]:
        return [i.example for i in self.items]
