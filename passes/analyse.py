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

from tspc.runtime.compat import FakeTensorMode

from .graph_utils import node_module_fqn, placeholder_fqn
from .value_rules import VALUE_RULES


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


_PROPAGATED = "tspc_propagated"  # node.meta key: what the node's value was computed from
_FAKE_MODE = "_tspc_fake_mode"  # GraphModule attribute: the mode of its nodes' values


def _value_key(v: Any) -> Any:
    """What later nodes' fake values can depend on: tensor metadata, or the value itself."""
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device, v.requires_grad)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return v
    return (type(v).__name__, id(v))  # anything else: changed unless it is the same object


class _FakeProp(fx.Interpreter):
    """Runs the graph on fake tensors, re-running only the nodes whose value may differ from
    the one recorded by the previous propagation in the same mode: new nodes, nodes whose
    target or arguments were replaced (fx replaces a node's args tuple on every change, so
    identity tells), and nodes with an input whose recorded metadata changed."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm)
        self.mode = mode
        self.changed: set[fx.Node] = set()
        self.rerun = 0

    def _is_current(self, n: fx.Node) -> bool:
        prev = n.meta.get(_PROPAGATED)
        return (
            prev is not None
            and prev[0] is self.mode
            and prev[1] is n.args
            and prev[2] is n.kwargs
            and prev[3] is n.target
            and "val" in n.meta
            and not any(i in self.changed for i in n.all_input_nodes)
        )

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        rule = VALUE_RULES.get(target)
        if rule is not None:
            return rule(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "placeholder" and self._is_current(n):
            return n.meta["val"]  # placeholders run: they consume the next input
        try:
            result = super().run_node(n)
        except Exception as e:  # noqa: BLE001 - re-raised with the node named
            where = node_module_fqn(n) or "?"
            raise ShapePropagationError(
                f"shape propagation failed at node '{n.name}' ({n.op} {n.target}, module "
                f"{where}): {type(e).__name__}: {e}"
            ) from e
        self.rerun += n.op != "placeholder"
        old = n.meta.get("val", _MISSING) if n.meta.get(_PROPAGATED) else _MISSING
        if old is _MISSING or _value_key(old) != _value_key(result):
            self.changed.add(n)
        n.meta["val"] = result
        n.meta[_PROPAGATED] = (self.mode, n.args, n.kwargs, n.target)
        return result


_MISSING = object()


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


def adopt_static_values(gm: fx.GraphModule) -> bool:
    """If every node carries a static fake value (Dynamo records one as ``example_value``
    while tracing), copy it to ``meta['val']`` and return True: the passes that only read
    shapes can then start without a propagation of their own. Symbolic sizes (dynamic
    shapes) or a node without a value: nothing is changed, returns False."""

    def static(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return not any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))
        if isinstance(v, (tuple, list)):
            return all(static(x) for x in v)
        return not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))

    values = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        m = n.meta
        if "val" not in m and "example_value" not in m:
            return False
        v = m["val"] if "val" in m else m["example_value"]
        if not static(v):
            return False
        values[n] = v
    for n, v in values.items():
        n.meta["val"] = v
    return True


def propagate_shapes(gm: fx.GraphModule, example_inputs: list[Any]) -> int:
    """Record every node's fake value in ``meta['val']`` (static shapes, no real compute).

    The first call on ``gm`` runs every node; later calls reuse its fake mode and re-run only
    what a pass changed since (see ``_FakeProp``) — on a rewritten 32-layer graph most nodes
    are untouched, and running them again was a large share of the passes' time. Returns the
    number of nodes run. Also brings ``gm``'s code up to date if a pass deferred its
    recompilation."""
    recompile_if_stale(gm)
    mode = getattr(gm, _FAKE_MODE, None)
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        setattr(gm, _FAKE_MODE, mode)
    # The mode memoizes conversions: the same input gives the same fake on every call.
    fakes = [
        mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
        for x in example_inputs
    ]
    grad_enabled = torch.is_grad_enabled()
    prop = _FakeProp(gm, mode)
    try:
        with mode:
            prop.run(*fakes)
    finally:
        torch.set_grad_enabled(grad_enabled)
    return prop.rerun
