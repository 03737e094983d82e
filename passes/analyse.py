"""Pass 1 — analyse: who is who among the graph's inputs, and fresh shape metadata.

Dynamo hands parameters and buffers to a backend as placeholders, and the example input in that
position is the live tensor. ``analyse`` records, for every placeholder, whether it is a
parameter, a buffer, a user input or a symbolic size, with its fully qualified name — the same
on every rank, since it depends only on the traced program.

``propagate_shapes`` re-runs a graph on fake tensors and records every node's value in
``node.meta['val']``. Passes call it after they change shapes: it keeps the metadata they read
truthful, and it turns an inconsistent rewrite into a compile-time error at the node that broke.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from .graph_utils import node_module_fqn, placeholder_fqn


@dataclass
class InputInfo:
    node: fx.Node
    kind: str  # "parameter" | "buffer" | "input" | "symint" | "other"
    fqn: str
    example: Any


@dataclass
class GraphInfo:
    inputs: list[InputInfo] = field(default_factory=list)

    def by_node(self) -> dict[fx.Node, InputInfo]:
        return {i.node: i for i in self.inputs}

    @property
    def params(self) -> dict[fx.Node, InputInfo]:
        return {i.node: i for i in self.inputs if i.kind == "parameter"}

    @property
    def user_inputs(self) -> list[InputInfo]:
        return [i for i in self.inputs if i.kind == "input"]

    @property
    def has_symbolic_inputs(self) -> bool:
        return any(i.kind == "symint" for i in self.inputs)


def _input_kind(node: fx.Node, example: Any) -> str:
    if isinstance(example, torch.nn.Parameter):
        return "parameter"
    if isinstance(example, (torch.SymInt, int)) and not isinstance(example, bool):
        return "symint"
    if not isinstance(example, torch.Tensor):
        return "other"
    ga = node.meta.get("grapharg")
    src = getattr(getattr(ga, "source", None), "name", "") or ""
    if "_buffers[" in src or "_buffers_" in node.name:
        return "buffer"
    return "input"


def analyse(gm: fx.GraphModule, example_inputs: list[Any]) -> GraphInfo:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ValueError(
            f"graph has {len(placeholders)} placeholders but {len(example_inputs)} example inputs"
        )
    info = GraphInfo()
    for node, ex in zip(placeholders, example_inputs):
        kind = _input_kind(node, ex)
        fqn = placeholder_fqn(node) if kind in ("parameter", "buffer") else node.name
        info.inputs.append(InputInfo(node, kind, fqn, ex))
    return info


class ShapePropagationError(RuntimeError):
    pass


class _FakeProp(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as e:  # noqa: BLE001 - re-raised with the node named
            where = node_module_fqn(n) or "?"
            raise ShapePropagationError(
                f"shape propagation failed at node '{n.name}' ({n.op} {n.target}, module "
                f"{where}): {type(e).__name__}: {e}"
            ) from e
        n.meta["val"] = result
        return result


_STALE_CODE = "_tspc_stale_code"


def defer_recompile(gm: fx.GraphModule) -> None:
    """Mark ``gm``'s Python code as out of date with its graph, to be regenerated once by the
    next ``propagate_shapes`` (or ``recompile_if_stale``) instead of after every change:
    regenerating a large graph's code per rewritten layer made compile time quadratic in depth.
    """
    setattr(gm, _STALE_CODE, True)


def recompile_if_stale(gm: fx.GraphModule) -> None:
    if getattr(gm, _STALE_CODE, False):
        gm.recompile()
        setattr(gm, _STALE_CODE, False)


def propagate_shapes(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Record every node's fake value in ``meta['val']`` (static shapes, no real compute).

    Also brings ``gm``'s code up to date if a pass deferred its recompilation."""
    recompile_if_stale(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [
        mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
        for x in example_inputs
    ]
    grad_enabled = torch.is_grad_enabled()
    try:
        with mode:
            _FakeProp(gm).run(*fakes)
    finally:
        torch.set_grad_enabled(grad_enabled)
