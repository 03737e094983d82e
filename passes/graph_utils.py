"""Small helpers shared by the passes: what a node computes, its value's metadata, names."""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from tspc.runtime.comm import SIDE_EFFECT_OPS
from tspc.runtime.compat import (
    OpOverload,
    OpOverloadPacket,
    interpreter_state_functions,
    is_erased,
    op_base_name,
    op_packet_qualified_name,
    op_schema,
)
from tspc.runtime.packing import unpack

# Spellings Dynamo uses for the same operation, mapped to one canonical name.
_ALIASES = {
    "truediv": "div",
    "floordiv": "floor_divide",
    "and_": "bitwise_and",
    "or_": "bitwise_or",
    "xor": "bitwise_xor",
    "invert": "bitwise_not",
    "iadd": "add_",
    "isub": "sub_",
    "imul": "mul_",
    "itruediv": "div_",
    "scaled_dot_product_attention": "sdpa",
    "_scaled_dot_product_attention": "sdpa",
    "causal_attention": "sdpa",  # tspc.ops.zigzag_attention.causal_attention
    "masked_attention": "sdpa",  # tspc.ops.masked_rows.masked_attention (SDPA's arguments)
}


def op_name(node: fx.Node) -> str | None:
    """Canonical name of what a call node does ('add', 'linear', 'view', 'sdpa', ...)."""
    if node.op == "call_method":
        return _ALIASES.get(node.target, node.target)
    if node.op == "call_function":
        t = node.target
        if isinstance(t, OpOverload):
            name = op_base_name(t)
        elif isinstance(t, OpOverloadPacket):
            name = op_packet_qualified_name(t).split("::")[-1]
        else:
            name = getattr(t, "__name__", None)
        if name is None:
            return None
        return _ALIASES.get(name, name)
    return None


def val(node: Any) -> Any:
    """The (fake) value a node produced, as recorded by Dynamo or by our shape propagation."""
    if not isinstance(node, fx.Node):
        return node
    m = node.meta
    if "val" in m:
        return m["val"]
    return m.get("example_value")


def tensor_val(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def shape(node: fx.Node) -> tuple[int, ...]:
    v = tensor_val(node)
    if v is None:
        raise ValueError(f"node {node} has no tensor value")
    return tuple(int(s) for s in v.shape)


def is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and tensor_val(x) is not None


def _is_tensor_tuple(x: Any) -> bool:
    v = val(x)
    return isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in v)


def tensor_inputs(node: fx.Node, include_tuples: bool = False) -> list[fx.Node]:
    """Distinct tensor-valued nodes among a node's args and kwargs, in order (with
    ``include_tuples``, also nodes producing tuples of tensors, as split/chunk do)."""
    seen: list[fx.Node] = []

    def visit(a):
        ok = is_tensor_node(a) or (
            include_tuples and isinstance(a, fx.Node) and _is_tensor_tuple(a)
        )
        if ok and a not in seen:
            seen.append(a)
        return a

    map_arg((node.args, node.kwargs), visit)
    return seen


# ``x[i] = v`` and ``x += y`` as Dynamo records them, and the Tensor method each calls
INPLACE_OPERATORS = {
    operator.setitem: "__setitem__",
    operator.iadd: "__iadd__",
    operator.isub: "__isub__",
    operator.imul: "__imul__",
    operator.itruediv: "__itruediv__",
}
_INPLACE_DUNDERS = frozenset(INPLACE_OPERATORS.values())


def mutated_args(n: fx.Node) -> list[fx.Node]:
    """The graph values ``n`` writes in place: ``x[i] = v``, ``x.add_(y)``, ``x += y``,
    ``torch.relu_(x)`` and ATen ops whose schema marks an argument as written."""
    first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if n.op == "call_method":
        name = n.target
        in_place = (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS
        return [first] if in_place and first is not None else []
    if n.op != "call_function":
        return []
    t = n.target
    if t in INPLACE_OPERATORS:
        return [first] if first is not None else []
    if isinstance(t, OpOverload):
        return [
            v
            for a, v in zip(op_schema(t).arguments, n.args)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(v, fx.Node)
        ]
    name = getattr(t, "__name__", "")
    # torch.relu_(x) and the like; operator.and_/or_/not_ only carry the underscore because
    # "and" is a keyword
    in_module_operator = getattr(t, "__module__", None) in ("_operator", "operator")
    if name.endswith("_") and not name.startswith("_") and not in_module_operator:
        return [first] if first is not None else []
    return []


# Ops whose result is a view of their first input (no copy): Tensor methods by name, torch
# functions by identity, ATen ops by their schema's ``is_view`` (and two that may alias).
_VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "transpose",
        "swapaxes",
        "swapdims",
        "permute",
        "movedim",
        "moveaxis",
        "t",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "flatten",
        "unflatten",
        "narrow",
        "select",
        "diagonal",
        "unfold",
        "as_strided",
        "split",
        "chunk",
        "unbind",
        "__getitem__",
    }
)
_VIEW_FUNCTIONS = {
    operator.getitem,
    torch.narrow,
    torch.select,
    torch.reshape,
    torch.transpose,
    torch.swapaxes,
    torch.movedim,
    torch.flatten,
    torch.unsqueeze,
    torch.squeeze,
    torch.permute,
    torch.diagonal,
    torch.as_strided,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.t,
    unpack,  # tspc.runtime.packing.unpack: views of one packed buffer
}
_VIEW_ATEN = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
}


def calls_one_of(
    n: fx.Node,
    methods: Collection[str],
    functions: Collection[Any],
    overload: Callable[[OpOverload], bool],
) -> bool:
    """Whether ``n`` calls one of a family of ops, in each of the forms a graph names them: a
    Tensor method (by name), a Python-level function, or an ATen overload (``overload(op)``)."""
    if n.op == "call_method":
        return n.target in methods
    if n.op != "call_function":
        return False
    t = n.target
    if isinstance(t, OpOverload):
        return overload(t)
    return t in functions


def _is_view_overload(op: OpOverload) -> bool:
    return bool(getattr(op, "is_view", False)) or op in _VIEW_ATEN


def is_view(n: fx.Node) -> bool:
    """Whether ``n``'s result may be a view of its input (the one predicate: in-place writes
    into a view are live, the schedule moves free views with their transfer)."""
    return calls_one_of(n, _VIEW_METHODS, _VIEW_FUNCTIONS, _is_view_overload)


def _write_is_live(n: fx.Node) -> bool:
    """Whether the in-place write ``n`` can matter: it writes a graph input or attribute (a
    module buffer), a value that may alias another (a view: conservative), or a value something
    besides in-place writes reads. A write into a value nobody reads is dead (after
    canonicalize_attention replaced an eager attention, Falcon's ``scores /= c`` kept the unused
    ``q @ k^T`` and its K gather alive)."""
    for a in mutated_args(n):
        chain = [a]  # an in-place call returns what it wrote: x.mul_(c).add_(y) writes x
        while mutated_args(chain[-1]) and len(chain) < 64:
            chain.append(mutated_args(chain[-1])[0])
        for x in chain:
            if x.op in ("placeholder", "get_attr") or is_view(x):
                return True
            if any(u is not n and not mutated_args(u) for u in x.users):
                return True
    return False


@functools.cache
def _interpreter_state_functions() -> frozenset:
    return interpreter_state_functions()


def has_side_effects(n: fx.Node) -> bool:
    """fx's notion of impure, plus live in-place writes: fx counts ``x.add_(y)`` (a method
    call) as pure, so its dead-code elimination drops an in-place accumulation whose result is
    not used — transformers' MoE blocks add the routed experts into the shared expert's output
    that way. Also functorch's level changes (vmap nesting: ``interpreter_state_functions``),
    which fx does not count as impure; and tspc's collectives (``runtime/comm.py``), which
    tspc marks impure for fx only while aot_autograd compiles its graphs."""
    if n.op == "call_function" and (
        n.target in _interpreter_state_functions() or n.target in SIDE_EFFECT_OPS
    ):
        return True
    try:
        if n.is_impure():
            return True
    except Exception:  # noqa: BLE001 - an op fx cannot classify: keep it
        return True
    return bool(mutated_args(n)) and _write_is_live(n)


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """``Graph.eliminate_dead_code`` keeping in-place writes (``has_side_effects``)."""
    return graph.eliminate_dead_code(is_impure_node=has_side_effects)


def erase_unused(graph: fx.Graph, nodes: Any) -> int:
    """Erase ``nodes`` that have no users and no side effects, then whatever that leaves
    unused upstream, transitively; returns how many were erased.

    Dead-code elimination local to a rewritten region: ``Graph.eliminate_dead_code`` walks
    (and lints) the whole graph, and a per-layer rewrite calling it made the passes quadratic
    in depth."""
    erased = 0
    work = list(nodes)
    while work:
        n = work.pop()
        if (
            is_erased(n)  # already gone (here, or by the caller)
            or n.graph is not graph
            or n.op in ("placeholder", "output")
            or n.users
            or has_side_effects(n)
        ):
            continue
        work.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased += 1
    return erased


def replace_input(node: fx.Node, old: fx.Node, new: fx.Node) -> None:
    node.args = map_arg(node.args, lambda a: new if a is old else a)
    node.kwargs = map_arg(node.kwargs, lambda a: new if a is old else a)


_SOURCE_PART = re.compile(
    r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]|\.(\w+)|\[(\d+)\]"
)


def fqn_from_source(source_name: str) -> str:
    """``L['args'][0]._modules['layers']._modules['0']._parameters['weight']`` -> ``layers.0.weight``.

    Dynamo names a parameter by the access path from the compiled callable's arguments; the
    leading ``L['self']`` / ``L['args'][0]`` is the module itself and is dropped — as is
    ``L['s']`` when the model's ``forward`` names its first parameter otherwise (any argument
    whose submodules or parameters are read is the module).
    """
    m = re.match(
        r"^L\[['\"](?:(?:self|args|kwargs)['\"]\](?:\[\d+\])?"
        r"|\w+['\"]\](?=\._(?:modules|parameters|buffers)\[))",
        source_name,
    )
    rest = source_name[m.end() :] if m else source_name
    parts = []
    for a, b, c in _SOURCE_PART.findall(rest):
        parts.append(a or b or c)
    return ".".join(parts)


def placeholder_fqn(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None)
    if src is not None:
        try:
            return fqn_from_source(src.name)
        except Exception:  # noqa: BLE001 - fall back to the placeholder's name below
            pass
    # Fallback: Dynamo's placeholder names spell the same path with underscores, e.g.
    # l_self_modules_layers_modules_0_modules_attn_modules_q_proj_parameters_weight_
    name = re.sub(
        r"^l_(?:self|args_\d+|kwargs|[a-z0-9]+(?=_(?:modules|parameters|buffers)_))_",
        "",
        node.name.lower(),
    )
    parts = [p for p in re.split(r"_?(?:modules|parameters|buffers)_", name) if p]
    return ".".join(p.strip("_") for p in parts)


def module_fqn_of_param(param_fqn: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn``."""
    parts = param_fqn.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 else ".".join(parts[:-1])


def projection_module(weight_fqn: str) -> str:
    """The module a projection weight belongs to: ``...self_attn.q_proj.weight`` ->
    ``...self_attn`` (a Linear's weight names its layer's parent); a bare parameter that a
    module applies itself (``einsum("bsd,ed->bse", x, self.wq)``) -> that module."""
    parts = weight_fqn.split(".")
    if parts[-1] in ("weight", "bias"):
        return module_fqn_of_param(weight_fqn)
    return ".".join(parts[:-1])


def node_module_fqn(node: fx.Node) -> str:
    """The innermost module a call node was traced in, from ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return fqn_from_source(path) if path.startswith("L[") else path


def calls_named(graph: fx.Graph, name: str) -> Iterator[tuple[fx.Node, str]]:
    """Each node of ``graph`` whose ``op_name`` is ``name``, in graph order, with the module it
    was traced in (the node's own name where none is recorded). It walks a copy of the node
    list, so a caller may rewrite the graph between items."""
    for node in list(graph.nodes):
        if op_name(node) == name:
            yield node, node_module_fqn(node) or node.name


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """A call's argument by position or keyword (Dynamo emits both spellings)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def set_arg(node: fx.Node, index: int, name: str, value: Any) -> None:
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[name] = value
        node.kwargs = kwargs


def fake_inputs(node: fx.Node) -> tuple[Any, Any, Any]:
    """``node``'s args and kwargs with every input node replaced by its fake value, and the
    fake mode they belong to (None when no input has a fake tensor value)."""
    fake_mode = None

    def to_val(a):
        nonlocal fake_mode
        v = val(a)
        if isinstance(v, torch.Tensor) and fake_mode is None:
            fake_mode = getattr(v, "fake_mode", None)
        return v

    args = map_arg(node.args, to_val)
    kwargs = map_arg(node.kwargs, to_val)
    return args, kwargs, fake_mode


def fake_value(node: fx.Node) -> Any:
    """Compute a new node's value from its inputs' fake values (for nodes a pass inserts)."""
    args, kwargs, fake_mode = fake_inputs(node)
    if fake_mode is None:
        raise ValueError(f"no fake input to evaluate {node}")
    with fake_mode:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise ValueError(f"cannot evaluate {node.op} node {node}")


def set_fake_value(node: fx.Node) -> fx.Node:
    node.meta["val"] = fake_value(node)
    return node


def sink_after(anchor: fx.Node, nodes: Any) -> None:
    """Restore definition-before-use after ``nodes`` were given ``anchor`` as an input.

    A rewrite that inserts a new value and hands it to existing users may find some users
    *earlier* in the graph than the new value (a KV cache that slices the keys right where they
    are computed, before the attention the rewrite replaced). Those users, and every node
    between them and ``anchor`` that depends on them, move to just after ``anchor`` in their
    original order. Moving a node later cannot break its own inputs, and what depends on it is
    moved along, so the graph stays valid."""
    late = {n for n in nodes if n < anchor}
    if not late:
        return
    moved: list[fx.Node] = []
    moving = set(late)
    n = min(late)
    while n is not anchor:
        if n in late or any(i in moving for i in n.all_input_nodes):
            moving.add(n)
            moved.append(n)
        n = n.next
    at = anchor
    for n in moved:
        at.append(n)
        at = n


def reachable(
    nodes: list[fx.Node], forward: bool = True, within: set[fx.Node] | None = None
) -> set[fx.Node]:
    """``nodes`` and every node reached from them through users (``forward``) or inputs,
    staying inside ``within`` when given (a start outside it is not taken either)."""
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if within is None or n in within]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        nxt = n.users if forward else n.all_input_nodes
        stack.extend(x for x in nxt if within is None or x in within)
    return seen


def first_reached(
    start: fx.Node, through: Collection[str], is_target: Callable[[fx.Node], bool]
) -> fx.Node | None:
    """The earliest node in graph order that ``is_target`` accepts among those reached from
    ``start`` through users whose ``op_name`` is in ``through`` (a walk ends at a target, and
    is not continued past the best one found so far: what follows it comes later)."""
    best, seen, stack = None, set(), [start]
    while stack:
        for u in stack.pop().users:
            if u in seen or op_name(u) not in through:
                continue
            seen.add(u)
            if is_target(u):
                best = u if best is None or u < best else best
            elif best is None or u < best:
                stack.append(u)
    return best


def copy_region(nodes: list[fx.Node], inputs: list[fx.Node], out: fx.Node) -> fx.GraphModule:
    """``nodes`` (graph order) as a module of ``inputs`` returning ``out``, to run on values of
    one's choosing; what else they read must be built from no input (a constant: copied along).
    Raises ``LookupError`` naming a graph input or attribute the region reads besides
    ``inputs``."""
    g = fx.Graph()
    env = {n: g.placeholder(f"p{i}") for i, n in enumerate(inputs)}

    def get(a: fx.Node) -> fx.Node:
        if a not in env:
            if a.op in ("placeholder", "get_attr"):
                raise LookupError(f"the region reads {a.name}")
            for i in a.all_input_nodes:
                get(i)
            env[a] = g.node_copy(a, lambda b: env[b])
        return env[a]

    for n in nodes:
        get(n)
    g.output(env[out])
    return fx.GraphModule(torch.nn.Module(), g)


def closure(start: fx.Node, through: Collection[str]) -> set[fx.Node]:
    """The nodes reached from ``start`` through users whose ``op_name`` is in ``through``."""
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        for u in stack.pop().users:
            if u not in seen and op_name(u) in through:
                seen.add(u)
                stack.append(u)
    return seen


def backward_reach(dst: fx.Node, start: fx.Node) -> set[fx.Node]:
    """The tensor nodes ``dst`` depends on, from ``start`` on in graph order (nodes before
    ``start`` cannot lie on a path from it; stopping there keeps each call local to one layer
    instead of walking back through every earlier layer)."""
    seen = {dst}
    stack = [dst]
    while stack:
        n = stack.pop()
        for i in tensor_inputs(n, include_tuples=True):
            if i not in seen and not i < start:
                seen.add(i)
                stack.append(i)
    return seen
