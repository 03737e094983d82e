"""Which graph nodes act elementwise over the last dimension — what the MLP ring may split.

Dynamo's graphs call torch-level functions (``F.gelu``, ``operator.mul``, ``x.pow``, ...), not
ATen ops, so a node's nature is read off the ATen ops it dispatches to: the node is run once on
its fake inputs under a recording dispatch mode, and it is elementwise when every op it reached
carries ``torch.Tag.pointwise`` (or is a dtype cast / alias, which are elementwise too) and its
output has its tensor inputs' shape. No op names are listed: ``gelu(x, approximate="tanh")``,
``relu(x) ** 2``, ``torch.square``, GPT-2's hand-written tanh GELU or a user's own activation
are recognised by what they compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from tspc.runtime.compat import OpOverload, TorchDispatchMode, op_schema, tree_map_only

from .graph_utils import fake_inputs, op_name, tensor_val

# Elementwise ops that are not tagged pointwise: casts and aliases move each element as is.
_ELEMENTWISE_UNTAGGED = frozenset(
    {
        torch.ops.aten._to_copy.default,
        torch.ops.aten.alias.default,
        torch.ops.aten.detach.default,
        torch.ops.aten.lift_fresh.default,
    }
)
# Reshapes that keep the last dimension keep every element's place in it.
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "contiguous"})


@dataclass(frozen=True)
class Nature:
    """What a node does to the last dimension: ``elementwise``, ``reshape`` (leading dims only),
    or ``other`` with ``why`` (the op that is not elementwise, or why it could not be told)."""

    kind: str
    why: str = ""
    random: bool = False  # reached an RNG op (dropout in training mode)


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def dispatched_ops(node: fx.Node) -> list[OpOverload] | None:
    """The ATen ops ``node`` reaches when run on its inputs' fake values (None if it cannot be
    run: no fake inputs, or the op fails on them)."""
    if node.op not in ("call_function", "call_method"):
        return None
    args, kwargs, fake_mode = fake_inputs(node)
    if fake_mode is None:
        return None
    # in-place ops would mutate the graph's recorded values: run them on copies
    with fake_mode:
        args, kwargs = tree_map_only(torch.Tensor, lambda t: t.clone(), (args, kwargs))
        try:
            with _Record() as rec:
                if node.op == "call_function":
                    node.target(*args, **kwargs)
                else:
                    getattr(args[0], node.target)(*args[1:], **kwargs)
        except Exception:  # noqa: BLE001 - an op that cannot run on fake inputs is not elementwise
            return None
    return rec.ops


def is_reshape(node: fx.Node) -> bool:
    """A reshape that keeps the last dimension (it only regroups the leading ones)."""
    if op_name(node) not in _RESHAPES or len(node.all_input_nodes) != 1:
        return False
    out, src = tensor_val(node), tensor_val(node.all_input_nodes[0])
    return (
        out is not None
        and src is not None
        and src.shape[-1:] == out.shape[-1:]
        and src.numel() == out.numel()
    )


def nature(node: fx.Node) -> Nature:
    """Elementwise, a leading-dims reshape, or other (with the reason), for one call node."""
    out = tensor_val(node)
    ins = [tensor_val(a) for a in node.all_input_nodes]
    ins = [t for t in ins if t is not None]
    name = op_name(node) or str(node.target)
    if out is None or not ins:
        return Nature("other", f"{name} does not map tensors to a tensor")
    if is_reshape(node):
        return Nature("reshape")
    if name in _RESHAPES:
        return Nature("other", f"{name} reshapes the intermediate dim")
    ops = dispatched_ops(node)
    if ops is None:
        return Nature("other", f"{name} could not be evaluated on fake tensors")
    for op in ops:
        if torch.Tag.nondeterministic_seeded in op.tags:
            return Nature("other", f"{name} draws random numbers ({op})", random=True)
    for op in ops:
        if op_schema(op).is_mutable:
            # the ring saves each shard's projections for backward: an in-place chain would
            # overwrite them (it runs with replicated weights instead)
            return Nature("other", f"{name} works in place ({op})")
        if op.namespace == "prim":  # metadata queries (prim.device): no element is touched
            continue
        if torch.Tag.pointwise not in op.tags and op not in _ELEMENTWISE_UNTAGGED:
            return Nature("other", f"{name} is not elementwise ({op})")
    # Operands broadcast onto the value (a scale, a mask) are elementwise too; whether they
    # may be read is the matcher's question (they come from outside the chain).
    if all(t.shape != out.shape for t in ins):
        return Nature("other", f"{name} changes the shape to {tuple(out.shape)}")
    return Nature("elementwise")
